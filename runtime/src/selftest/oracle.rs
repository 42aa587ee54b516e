//! The integer oracle of `matmul.<backend>.<type>`: weights built so that the exact product is
//! an integer computation, sharing no code with the backends or with `quant/` (the reference
//! dequantisation the CPU backends are built on).
//!
//! Each block is encoded here, from ggml's block layouts, out of power-of-two scales and small
//! integer quants, so every weight value is `W · 2^-E` with `W` an exact integer. Activations
//! are integers with one ±127 in every 32 values (so every activation quantisation a backend
//! does — ggml's Q8_0/Q8_1/Q8_K, the NPU's symmetric int8 — has scale exactly 1) and the rest
//! in [-8, 8] (so Q8_1's f16 block sum stays exact). The answer is `Σ W·a` in i64, scaled by
//! `2^-E`; bounds keep it below 2^24, so it is exactly an f32 and a backend must return it bit
//! for bit.

use crate::quant::GgmlType;
use half::{bf16, f16};

/// A test weight: its bytes, and its values as integers `W[n][k]` with value `W · 2^-exp`.
pub struct OracleWeight {
    pub bytes: Vec<u8>,
    pub ints: Vec<i64>,
    pub exp: i32,
}

/// splitmix64: the oracle's own generator.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }
}

/// f16 bits of 2^-e (e in 0..=14): exponent field 15 - e, no mantissa.
fn f16_pow2(e: i32) -> [u8; 2] {
    assert!((0..=14).contains(&e));
    (((15 - e) as u16) << 10).to_le_bytes()
}

/// Integer activations, `m` rows of `k`: one ±127 per 32 values, the rest in [-8, 8].
pub fn activations(m: usize, k: usize, seed: u64) -> Vec<i64> {
    let mut r = Rng::new(seed);
    let mut a: Vec<i64> = (0..m * k).map(|_| r.int(-8, 8)).collect();
    for block in a.chunks_mut(32) {
        let at = r.int(0, block.len() as i64 - 1) as usize;
        block[at] = if r.next_u64() & 1 == 0 { 127 } else { -127 };
    }
    a
}

/// The exact answer `C[m][n] = Σ_k W[n][k]·A[m][k] · 2^-exp` as f32 (exact: asserted < 2^24).
pub fn answer(w: &OracleWeight, a: &[i64], m: usize, k: usize, n: usize) -> Vec<f32> {
    let scale = (2f64).powi(-w.exp);
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: i64 = (0..k).map(|x| w.ints[j * k + x] * a[i * k + x]).sum();
            assert!(dot.abs() < 1 << 24, "oracle bound broken: {dot}");
            c[i * n + j] = (dot as f64 * scale) as f32;
        }
    }
    c
}

/// An N×K weight of `ty`, or `None` for a type this oracle cannot encode.
pub fn weight(ty: GgmlType, k: usize, n: usize, seed: u64) -> Option<OracleWeight> {
    let mut r = Rng::new(seed ^ (ty.id() as u64) << 32);
    let mut bytes = Vec::new();
    let mut ints = Vec::with_capacity(k * n);
    let exp;
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            exp = 3;
            for _ in 0..k * n {
                let wi = r.int(-64, 64);
                let v = wi as f32 / 8.0;
                match ty {
                    GgmlType::F32 => bytes.extend(v.to_le_bytes()),
                    GgmlType::F16 => bytes.extend(f16::from_f32(v).to_le_bytes()),
                    _ => bytes.extend(bf16::from_f32(v).to_le_bytes()),
                }
                ints.push(wi);
            }
        }
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // One d = 2^-e per row (so a per-channel requantisation keeps it exactly), and for
            // Q8_0 a ±127 in every row (so the channel's amax is 127·d).
            exp = 6;
            for row in 0..n {
                let e = (row % 4) as i32 + 2; // d = 2^-e, e in 2..=5
                let wmul = 1i64 << (exp - e); // d = wmul · 2^-exp
                let min_units = r.int(-3, 3); // m = min_units · 2^-exp (Q4_1/Q5_1)
                let big = r.int(0, k as i64 - 1) as usize;
                for b in 0..k / 32 {
                    let mut q = [0i64; 32];
                    for (x, qx) in q.iter_mut().enumerate() {
                        *qx = match ty {
                            GgmlType::Q8_0 if b * 32 + x == big => {
                                if r.next_u64() & 1 == 0 {
                                    127
                                } else {
                                    -127
                                }
                            }
                            GgmlType::Q8_0 => r.int(-20, 20),
                            GgmlType::Q4_0 | GgmlType::Q4_1 => r.int(0, 15),
                            _ => r.int(0, 31),
                        };
                    }
                    bytes.extend(f16_pow2(e));
                    match ty {
                        GgmlType::Q8_0 => {
                            bytes.extend(q.iter().map(|&v| v as i8 as u8));
                            ints.extend(q.iter().map(|&v| v * wmul));
                        }
                        GgmlType::Q4_0 => {
                            bytes.extend((0..16).map(|j| (q[j] | q[j + 16] << 4) as u8));
                            ints.extend(q.iter().map(|&v| (v - 8) * wmul));
                        }
                        GgmlType::Q4_1 => {
                            bytes.extend(f16::from_f64(min_units as f64 / 64.0).to_le_bytes());
                            bytes.extend((0..16).map(|j| (q[j] | q[j + 16] << 4) as u8));
                            ints.extend(q.iter().map(|&v| v * wmul + min_units));
                        }
                        _ => {
                            if ty == GgmlType::Q5_1 {
                                bytes.extend(f16::from_f64(min_units as f64 / 64.0).to_le_bytes());
                            }
                            let qh: u32 = (0..32).map(|j| ((q[j] as u32 >> 4) & 1) << j).sum();
                            bytes.extend(qh.to_le_bytes());
                            bytes.extend(
                                (0..16).map(|j| ((q[j] & 15) | (q[j + 16] & 15) << 4) as u8),
                            );
                            let off = if ty == GgmlType::Q5_0 { 16 } else { 0 };
                            let add = if ty == GgmlType::Q5_1 { min_units } else { 0 };
                            ints.extend(q.iter().map(|&v| (v - off) * wmul + add));
                        }
                    }
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            // value = d·sc·q − dmin·m, d = 2^-4, dmin = 2^-5: W = 2·sc·q − m at exp 5.
            exp = 5;
            for _ in 0..n {
                for _ in 0..k / 256 {
                    let sc: Vec<i64> = (0..8).map(|_| r.int(0, 63)).collect();
                    let mn: Vec<i64> = (0..8).map(|_| r.int(0, 63)).collect();
                    let top = if ty == GgmlType::Q4K { 15 } else { 31 };
                    let q: Vec<i64> = (0..256).map(|_| r.int(0, top)).collect();
                    bytes.extend(f16_pow2(4));
                    bytes.extend(f16_pow2(5));
                    // 6-bit scales and mins, 12 bytes (ggml's get_scale_min_k4, inverted).
                    let mut s = [0u8; 12];
                    for j in 0..4 {
                        s[j] = ((sc[j] & 63) | (sc[j + 4] >> 4) << 6) as u8;
                        s[j + 4] = ((mn[j] & 63) | (mn[j + 4] >> 4) << 6) as u8;
                        s[j + 8] = ((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4) as u8;
                    }
                    bytes.extend(s);
                    if ty == GgmlType::Q5K {
                        // qh[l] bit 2i / 2i+1: high bit of element l of sub-block 2i / 2i+1.
                        let qh: Vec<u8> = (0..32)
                            .map(|l| {
                                (0..8)
                                    .map(|sb| (((q[sb * 32 + l] >> 4) & 1) as u8) << sb)
                                    .sum()
                            })
                            .collect();
                        bytes.extend(qh);
                    }
                    // qs: per pair of sub-blocks, low nibble = first, high nibble = second.
                    for pair in 0..4 {
                        for l in 0..32 {
                            let lo = q[pair * 64 + l] & 15;
                            let hi = q[pair * 64 + 32 + l] & 15;
                            bytes.push((lo | hi << 4) as u8);
                        }
                    }
                    for (x, &qx) in q.iter().enumerate() {
                        let sb = x / 32;
                        ints.push(2 * sc[sb] * qx - mn[sb]);
                    }
                }
            }
        }
        GgmlType::Q6K => {
            // value = d·sc·(q − 32), d = 2^-4, sc a signed byte in [-20, 20].
            exp = 4;
            for _ in 0..n {
                for _ in 0..k / 256 {
                    let sc: Vec<i64> = (0..16).map(|_| r.int(-20, 20)).collect();
                    let q: Vec<i64> = (0..256).map(|_| r.int(0, 63)).collect();
                    let mut ql = [0u8; 128];
                    let mut qh = [0u8; 64];
                    for h in 0..2 {
                        for l in 0..32 {
                            let y = |o: usize| q[128 * h + l + o];
                            ql[64 * h + l] = ((y(0) & 15) | (y(64) & 15) << 4) as u8;
                            ql[64 * h + l + 32] = ((y(32) & 15) | (y(96) & 15) << 4) as u8;
                            qh[32 * h + l] = ((y(0) >> 4)
                                | (y(32) >> 4) << 2
                                | (y(64) >> 4) << 4
                                | (y(96) >> 4) << 6)
                                as u8;
                        }
                    }
                    bytes.extend(ql);
                    bytes.extend(qh);
                    bytes.extend(sc.iter().map(|&s| s as i8 as u8));
                    bytes.extend(f16_pow2(4));
                    // Element x of the block uses scale 8·(x/128) + (x%128)/16 … in ggml's
                    // order: within a half, l/16 + 2·(x%128 / 32).
                    for (x, &qx) in q.iter().enumerate() {
                        let h = x / 128;
                        let within = x % 128;
                        let is = (within % 32) / 16 + 2 * (within / 32);
                        ints.push(sc[8 * h + is] * (qx - 32));
                    }
                }
            }
        }
        _ => return None,
    }
    let row = ty.row_bytes(k as u64)? as usize;
    assert_eq!(
        bytes.len(),
        row * n,
        "{ty}: oracle encoding has the wrong size"
    );
    Some(OracleWeight { bytes, ints, exp })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, DEQUANTIZABLE};

    /// The oracle and the reference dequantisation were written apart; they agree exactly on
    /// every type the CPU claims (each is a check on the other).
    #[test]
    fn oracle_values_are_what_the_reference_dequantises() {
        let (k, n) = (256, 4);
        for ty in DEQUANTIZABLE {
            let w = weight(ty, k, n, 11).unwrap_or_else(|| panic!("no oracle for {ty}"));
            let mut out = vec![0f32; k * n];
            dequantize_row(ty, &w.bytes, &mut out).unwrap();
            let want: Vec<f32> = w
                .ints
                .iter()
                .map(|&i| (i as f64 * 2f64.powi(-w.exp)) as f32)
                .collect();
            assert_eq!(out, want, "{ty}");
        }
    }
}
