//! The self-check's model fixture on the models partition: a small GGUF v3 file whose bytes
//! depend on nothing but this code. Written by hand here because the runtime's GGUF writer
//! (`kiln_runtime::gguf::writer`) is not on main yet; the format is llama.cpp's `gguf.md`.

use half::f16;

/// File name on the models partition (`/models/kiln-selftest.gguf` on the board).
pub const FILE_NAME: &str = "kiln-selftest.gguf";

const ALIGN: usize = 32;

/// GGUF metadata value types used here.
const T_UINT32: u32 = 4;
const T_STRING: u32 = 8;

/// ggml tensor types used here (ids from ggml.h).
const GGML_F32: u32 = 0;
const GGML_F16: u32 = 1;
const GGML_Q4_0: u32 = 2;
const GGML_Q8_0: u32 = 8;

/// Tensor shapes: `ne0` = K (the reduction, a multiple of 32 as RK3588's NPU wants), `ne1` = N.
const K: usize = 64;
const N: usize = 32;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

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

fn q8_0(vals: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in vals.chunks(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for v in b {
            let q = if d == 0.0 { 0 } else { (v / d).round() as i32 };
            out.push(q.clamp(-127, 127) as i8 as u8);
        }
    }
    out
}

fn q4_0(vals: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in vals.chunks(32) {
        // ggml's reference: the value of largest magnitude maps to -8.
        let max = b
            .iter()
            .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for j in 0..16 {
            let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
            out.push(q(b[j]) | (q(b[j + 16]) << 4));
        }
    }
    out
}

/// The fixture's bytes.
pub fn gguf() -> Vec<u8> {
    let mut v = Values(0x6b696c6e); // "kiln"
    let w: Vec<f32> = (0..K * N).map(|_| v.weight()).collect();
    let f16s: Vec<u8> = w
        .iter()
        .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
        .collect();
    let f32s: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let tensors: Vec<(&str, u32, Vec<u8>)> = vec![
        ("fixture.f32", GGML_F32, f32s),
        ("fixture.f16", GGML_F16, f16s),
        ("fixture.q8_0", GGML_Q8_0, q8_0(&w)),
        ("fixture.q4_0", GGML_Q4_0, q4_0(&w)),
    ];
    let kv: Vec<(&str, u32, Vec<u8>)> = vec![
        ("general.architecture", T_STRING, {
            let mut b = Vec::new();
            put_str(&mut b, "kiln-fixture");
            b
        }),
        ("general.name", T_STRING, {
            let mut b = Vec::new();
            put_str(
                &mut b,
                "kiln self-check fixture (same weights in four types)",
            );
            b
        }),
        (
            "general.alignment",
            T_UINT32,
            (ALIGN as u32).to_le_bytes().to_vec(),
        ),
    ];
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, t, val) in &kv {
        put_str(&mut out, k);
        out.extend_from_slice(&t.to_le_bytes());
        out.extend_from_slice(val);
    }
    let mut offset = 0usize;
    for (name, ty, data) in &tensors {
        put_str(&mut out, name);
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&(K as u64).to_le_bytes());
        out.extend_from_slice(&(N as u64).to_le_bytes());
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += data.len().div_ceil(ALIGN) * ALIGN;
    }
    out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    for (_, _, data) in &tensors {
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixture_is_deterministic_and_well_formed() {
        let a = gguf();
        assert_eq!(a, gguf());
        assert_eq!(&a[..4], b"GGUF");
        assert_eq!(u32::from_le_bytes(a[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(a[8..16].try_into().unwrap()), 4);
        // Data: f32 (8192) + f16 (4096) + q8_0 (64 blocks × 34) + q4_0 (64 × 18), each aligned.
        let data = 8192 + 4096 + 2176 + 1152;
        assert_eq!(a.len() % ALIGN, 0);
        assert!(a.len() > data && a.len() < data + 1024, "{}", a.len());
    }

    #[test]
    fn quantisers_round_trip_the_grid() {
        let vals: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) / 16.0).collect();
        let q = q8_0(&vals);
        let d = f16::from_bits(u16::from_le_bytes([q[0], q[1]])).to_f32();
        for (i, v) in vals.iter().enumerate() {
            assert!((q[2 + i] as i8 as f32 * d - v).abs() <= d, "{i}");
        }
    }
}
