//! The self-check's model fixture on the models partition: a small GGUF v3 file whose bytes
//! depend on nothing but this code, written with the runtime's own GGUF writer and ggml's
//! reference quantisers (the same code the runtime's tests check against gguf-py).

use anyhow::{Context, Result};
use half::f16;
use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::Value;
use kiln_runtime::quant::{quantize_to_vec, GgmlType};

/// File name on the models partition (`/models/kiln-selftest.gguf` on the board).
pub const FILE_NAME: &str = "kiln-selftest.gguf";

/// Tensor shapes: `ne0` = K (the reduction, a multiple of 32 as RK3588's NPU wants), `ne1` = N.
const K: usize = 64;
const N: usize = 32;

/// A deterministic stream of small values (xorshift32), so weights are not all one value.
struct Values(u32);
impl Values {
    fn next(&mut self) -> u32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.0 = x;
        x
    }
    /// A value in [-1, 1) on a 1/64 grid: exact in f16, quantises cleanly.
    fn weight(&mut self) -> f32 {
        (self.next() % 128) as f32 / 64.0 - 1.0
    }
}

/// The fixture's bytes: the same weights as F32, F16, Q8_0 and Q4_0.
pub fn gguf() -> Result<Vec<u8>> {
    let mut v = Values(0x6b696c6e); // "kiln"
    let w: Vec<f32> = (0..K * N).map(|_| v.weight()).collect();
    let dims = [K as u64, N as u64];
    let mut g = GgufWriter::new();
    g.add("general.architecture", Value::String("kiln-fixture".into()))?
        .add(
            "general.name",
            Value::String("kiln self-check fixture (same weights in four types)".into()),
        )?
        .alignment(32)?;
    g.tensor_f32("fixture.f32", &dims, &w)?;
    let f16s: Vec<u8> = w
        .iter()
        .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
        .collect();
    g.tensor("fixture.f16", GgmlType::F16, &dims, f16s)?;
    for (name, ty) in [
        ("fixture.q8_0", GgmlType::Q8_0),
        ("fixture.q4_0", GgmlType::Q4_0),
    ] {
        let q = quantize_to_vec(ty, &w).with_context(|| format!("quantising {name}"))?;
        g.tensor(name, ty, &dims, q)?;
    }
    Ok(g.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixture_is_deterministic_and_reads_back() {
        let a = gguf().unwrap();
        assert_eq!(a, gguf().unwrap());
        let g = kiln_runtime::gguf::Gguf::parse(&a).unwrap();
        let types: Vec<GgmlType> = g.tensor_infos().iter().map(|t| t.ty).collect();
        assert_eq!(
            types,
            [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0]
        );
    }
}
