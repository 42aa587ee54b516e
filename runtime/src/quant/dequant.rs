//! Scalar reference dequantisation, block by block exactly as ggml's `dequantize_row_*`
//! (`ggml-quants.c`) lays the bytes out. This is the oracle every fast path is tested against, so
//! it stays plain: one element at a time, no cleverness.

use super::{GgmlType, QK_K};
use half::{bf16, f16};

/// Why a row could not be (de)quantised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{0} is not supported (no reference dequantisation for this type)")]
    Unsupported(GgmlType),
    #[error("{ty}: {elems} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        elems: usize,
        block: usize,
    },
    #[error("{ty}: {elems} elements need {expected} bytes of blocks, got {actual}")]
    LengthMismatch {
        ty: GgmlType,
        elems: usize,
        expected: usize,
        actual: usize,
    },
}

/// Every type [`dequantize_row`] handles.
pub const DEQUANTIZABLE: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

pub fn is_dequantizable(ty: GgmlType) -> bool {
    DEQUANTIZABLE.contains(&ty)
}

/// Bytes of `elems` elements of `ty`, checked to be whole blocks.
pub(crate) fn bytes_for(ty: GgmlType, elems: usize) -> Result<usize, QuantError> {
    let (be, bb) = ty.block();
    if elems % be != 0 {
        return Err(QuantError::PartialBlock {
            ty,
            elems,
            block: be,
        });
    }
    Ok(elems / be * bb)
}

pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block (ggml's
/// `get_scale_min_k4`): 8 pairs packed into 12 bytes.
pub fn get_scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Dequantise `dst.len()` elements of type `ty` from `src`, which must hold exactly the blocks
/// for that many elements.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !is_dequantizable(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let expected = bytes_for(ty, dst.len())?;
    if src.len() != expected {
        return Err(QuantError::LengthMismatch {
            ty,
            elems: dst.len(),
            expected,
            actual: src.len(),
        });
    }
    let (be, bb) = ty.block();
    for (blk, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
        match ty {
            GgmlType::F32 => y[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            GgmlType::F16 => y[0] = f16_at(blk, 0),
            GgmlType::Bf16 => y[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            GgmlType::Q8_0 => block_q8_0(blk, y),
            GgmlType::Q4_0 => block_q4_0(blk, y),
            GgmlType::Q4_1 => block_q4_1(blk, y),
            GgmlType::Q5_0 => block_q5_0(blk, y),
            GgmlType::Q5_1 => block_q5_1(blk, y),
            GgmlType::Q4K => block_q4_k(blk, y),
            GgmlType::Q5K => block_q5_k(blk, y),
            GgmlType::Q6K => block_q6_k(blk, y),
            other => return Err(QuantError::Unsupported(other)),
        }
    }
    Ok(())
}

/// `d: f16, qs: [i8; 32]`; x = d·q.
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// `d: f16, qs: [u8; 16]`; byte j holds element j (low nibble) and j+16 (high); x = d·(q−8).
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `d: f16, m: f16, qs: [u8; 16]` in Q4_0's nibble order; x = d·q + m.
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// `d: f16, qh: u32 (bit j = 5th bit of element j), qs: [u8; 16]`; x = d·(q−16).
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] as u32 & 0x0F) | xh0) as i32 - 16;
        let x1 = ((qs[j] as u32 >> 4) | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// `d: f16, m: f16, qh: u32, qs: [u8; 16]`; x = d·q + m.
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = (qs[j] as u32 & 0x0F) | xh0;
        let x1 = (qs[j] as u32 >> 4) | xh1;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`, 256 elements in 4 chunks of 64: the low
/// nibbles of 32 bytes are sub-block 2c, the high nibbles sub-block 2c+1.
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..QK_K / 64 {
        let (sc1, m1) = get_scale_min_k4(2 * c, scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * c..32 * c + 32];
        for l in 0..32 {
            y[64 * c + l] = d1 * (q[l] & 0xF) as f32 - min1;
            y[64 * c + 32 + l] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

/// `d, dmin, scales[12], qh[32], qs[128]`: Q4_K plus a 5th bit from `qh[l]`, bit 2c for the low
/// half of chunk c and bit 2c+1 for the high half.
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..QK_K / 64 {
        let (sc1, m1) = get_scale_min_k4(2 * c, scales);
        let (sc2, m2) = get_scale_min_k4(2 * c + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 1u8 << (2 * c + 1));
        let q = &qs[32 * c..32 * c + 32];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * c + l] = d1 * ((q[l] & 0xF) + h1) as f32 - min1;
            y[64 * c + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - min2;
        }
    }
}

/// `ql[128], qh[64], scales: [i8; 16], d: f16` (d last). Two halves of 128; q = 4 low bits from
/// `ql` and 2 high bits from `qh`, minus 32; one scale per 16 elements.
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}
