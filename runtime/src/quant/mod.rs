//! ggml block formats: the type table for every id llama.cpp defines, and (in submodules) the
//! scalar reference dequantisation that every fast path is tested against.

use std::fmt;

pub(crate) mod dequant;
mod quantize;
#[cfg(test)]
mod tests;

pub use dequant::{dequantize_row, get_scale_min_k4, is_dequantizable, QuantError, DEQUANTIZABLE};
pub(crate) use quantize::q8_row;
pub use quantize::{
    q8_0_block, q8_1_block, q8_k_block, quantize_row, quantize_to_vec, BlockQ8K, BlockQ8_0,
    BlockQ8_1, QUANTIZABLE,
};

/// A ggml tensor type, by its on-disk id. Ids that llama.cpp has retired stay out of the enum, so
/// an id read from a file either becomes one of these or is rejected by [`GgmlType::from_id`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    Iq2Xxs = 16,
    Iq2Xs = 17,
    Iq3Xxs = 18,
    Iq1S = 19,
    Iq4Nl = 20,
    Iq3S = 21,
    Iq2S = 22,
    Iq4Xs = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    Iq1M = 29,
    Bf16 = 30,
    Tq1_0 = 34,
    Tq2_0 = 35,
    Mxfp4 = 39,
    Nvfp4 = 40,
    Q1_0 = 41,
}

/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

impl GgmlType {
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::Iq2Xxs,
        GgmlType::Iq2Xs,
        GgmlType::Iq3Xxs,
        GgmlType::Iq1S,
        GgmlType::Iq4Nl,
        GgmlType::Iq3S,
        GgmlType::Iq2S,
        GgmlType::Iq4Xs,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::Iq1M,
        GgmlType::Bf16,
        GgmlType::Tq1_0,
        GgmlType::Tq2_0,
        GgmlType::Mxfp4,
        GgmlType::Nvfp4,
        GgmlType::Q1_0,
    ];

    /// The type for an on-disk id, or `None` for an id llama.cpp does not define (or retired).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// (elements per block, bytes per block), as ggml's `type_traits` table has them.
    pub fn block(self) -> (usize, usize) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (QK_K, 84),
            Q3K => (QK_K, 110),
            Q4K => (QK_K, 144),
            Q5K => (QK_K, 176),
            Q6K => (QK_K, 210),
            Q8K => (QK_K, 292),
            Iq2Xxs => (QK_K, 66),
            Iq2Xs => (QK_K, 74),
            Iq3Xxs => (QK_K, 98),
            Iq1S => (QK_K, 50),
            Iq4Nl => (32, 18),
            Iq3S => (QK_K, 110),
            Iq2S => (QK_K, 82),
            Iq4Xs => (QK_K, 136),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            Iq1M => (QK_K, 56),
            Bf16 => (1, 2),
            Tq1_0 => (QK_K, 54),
            Tq2_0 => (QK_K, 66),
            Mxfp4 => (32, 17),
            Nvfp4 => (64, 36),
            Q1_0 => (128, 18),
        }
    }

    pub fn block_elems(self) -> usize {
        self.block().0
    }

    pub fn block_bytes(self) -> usize {
        self.block().1
    }

    /// Bytes of one row of `ne0` elements, or `None` if `ne0` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        let (be, bb) = self.block();
        if ne0 % be as u64 != 0 {
            return None;
        }
        (ne0 / be as u64).checked_mul(bb as u64)
    }

    /// ggml's name for the type, as llama.cpp prints it.
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            Iq2Xxs => "IQ2_XXS",
            Iq2Xs => "IQ2_XS",
            Iq3Xxs => "IQ3_XXS",
            Iq1S => "IQ1_S",
            Iq4Nl => "IQ4_NL",
            Iq3S => "IQ3_S",
            Iq2S => "IQ2_S",
            Iq4Xs => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            Iq1M => "IQ1_M",
            Bf16 => "BF16",
            Tq1_0 => "TQ1_0",
            Tq2_0 => "TQ2_0",
            Mxfp4 => "MXFP4",
            Nvfp4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_unknown() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 42, 1000] {
            assert_eq!(GgmlType::from_id(retired), None, "id {retired}");
        }
    }

    #[test]
    fn row_bytes_rejects_partial_blocks() {
        assert_eq!(GgmlType::Q4_0.row_bytes(64), Some(36));
        assert_eq!(GgmlType::Q4_0.row_bytes(48), None);
        assert_eq!(GgmlType::Q6K.row_bytes(512), Some(420));
        assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
    }
}
