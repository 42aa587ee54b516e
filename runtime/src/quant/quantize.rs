//! Reference quantisers, as ggml's `quantize_row_*_ref` (`ggml-quants.c`) computes them.
//!
//! Q8_0, Q8_1 and Q8_K are the activation formats of the CPU fast path (ggml's `vec_dot_type`);
//! Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 also make weights for tests and benches. The per-block functions
//! return the fields unpacked so the fast path can keep them in its own arrays; the row functions
//! write ggml's byte layout.

use super::dequant::bytes_for;
use super::{GgmlType, QuantError, QK_K};
use half::f16;

/// A Q8_0 block: `d` (as stored, f16) and 32 signed quants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

/// A Q8_1 block: Q8_0 plus `s = d·Σqs` (f16), which the Q4_1/Q5_1 dots use for the min term.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; 32],
}

/// A Q8_K block: f32 `d`, 256 quants, and the sums of each 16 quants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

/// ggml's `nearest_int`: round to nearest, ties to even, by its float magic-number trick where
/// ggml uses it (|x| ≤ 4194303: adding 1.5·2²³ leaves the rounded integer in the low mantissa
/// bits), `round_ties_even` elsewhere (large values, NaN → 0). The trick, not
/// `round_ties_even` throughout: without SSE4.1 in the baseline x86-64 target that is a call
/// to libm's `rintf` per value, 5 % of a Q4_K_M prefill in the Q8_K activation quantiser.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    if x.abs() <= 4_194_303.0 {
        ((x + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
    } else {
        x.round_ties_even() as i32
    }
}

/// `v.round() as i8` (half away from zero, saturating, NaN to 0) for every f32, without a call
/// to libm's `roundf` per element (94 of the activation quantiser's 218 samples in a prefill
/// profile; the quantiser's total did not drop with it, see docs/speed.md). Below 2²³ the
/// truncation `t` and `v − t` are exact, so the comparison with ±0.5 rounds exactly; above it
/// `v` is already whole and saturates as before.
#[inline(always)]
pub(crate) fn round_i8(v: f32) -> i8 {
    let t = v as i32 as f32;
    let f = v - t;
    let r = if f >= 0.5 {
        t + 1.0
    } else if f <= -0.5 {
        t - 1.0
    } else {
        t
    };
    r as i8
}

/// `quantize_row_q8_0_ref` for one block: d = amax/127, q = round(x/d) (half away from zero).
pub fn q8_0_block(x: &[f32; 32]) -> BlockQ8_0 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; 32];
    for (q, v) in qs.iter_mut().zip(x) {
        *q = round_i8(v * id);
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// `quantize_row_q8_1_ref` for one block: as Q8_0, plus `s = Σq · d` with the f32 `d`.
pub fn q8_1_block(x: &[f32; 32]) -> BlockQ8_1 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; 32];
    let mut sum = 0i32;
    for j in 0..16 {
        qs[j] = round_i8(x[j] * id);
        qs[j + 16] = round_i8(x[j + 16] * id);
        sum += qs[j] as i32 + qs[j + 16] as i32;
    }
    BlockQ8_1 {
        d: f16::from_f32(d),
        s: f16::from_f32(sum as f32 * d),
        qs,
    }
}

/// `quantize_row_q8_K_ref` for one super-block: scale from the signed value of largest magnitude
/// (iscale = −127/max), q = min(127, nearest(x·iscale)), d = 1/iscale.
pub fn q8_k_block(x: &[f32; QK_K]) -> BlockQ8K {
    let mut out = BlockQ8K {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
    };
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return out;
    }
    let iscale = -127.0 / max;
    for (q, v) in out.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (j, s) in out.bsums.iter_mut().enumerate() {
        *s = out.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
    }
    out.d = 1.0 / iscale;
    out
}

/// Value of largest magnitude, keeping its sign (the first one on ties), as Q4_0/Q5_0 pick it.
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

fn q4_0_block(x: &[f32], out: &mut [u8]) {
    let d = signed_absmax(&x[..32]) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        // `(int8_t)(x + 8.5f)` truncates toward zero; the value is in [0.5, 16.5].
        let x0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let x1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        out[2 + j] = x0 | (x1 << 4);
    }
}

fn q4_1_block(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(&x[..32]);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    out[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
    for j in 0..16 {
        let x0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let x1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
        out[4 + j] = x0 | (x1 << 4);
    }
}

fn q5_0_block(x: &[f32], out: &mut [u8]) {
    let d = signed_absmax(&x[..32]) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let mut qh = 0u32;
    for j in 0..16 {
        let x0 = ((x[j] * id + 16.5) as i8).min(31) as u32;
        let x1 = ((x[j + 16] * id + 16.5) as i8).min(31) as u32;
        out[6 + j] = ((x0 & 0x0F) | ((x1 & 0x0F) << 4)) as u8;
        qh |= ((x0 & 0x10) >> 4) << j;
        qh |= ((x1 & 0x10) >> 4) << (j + 16);
    }
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

fn q5_1_block(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(&x[..32]);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    out[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
    let mut qh = 0u32;
    for j in 0..16 {
        // ggml casts to uint8_t without a clamp; the value is in [0.5, 31.5].
        let x0 = ((x[j] - min) * id + 0.5) as u8 as u32;
        let x1 = ((x[j + 16] - min) * id + 0.5) as u8 as u32;
        out[8 + j] = ((x0 & 0x0F) | ((x1 & 0x0F) << 4)) as u8;
        qh |= ((x0 & 0x10) >> 4) << j;
        qh |= ((x1 & 0x10) >> 4) << (j + 16);
    }
    out[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// Types [`quantize_row`] writes.
pub const QUANTIZABLE: [GgmlType; 7] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q8K,
];

/// Quantise `src` into `dst` in ggml's byte layout for `ty` (one of [`QUANTIZABLE`]).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !QUANTIZABLE.contains(&ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let expected = bytes_for(ty, src.len())?;
    if dst.len() != expected {
        return Err(QuantError::LengthMismatch {
            ty,
            elems: src.len(),
            expected,
            actual: dst.len(),
        });
    }
    let (be, bb) = ty.block();
    for (x, out) in src.chunks_exact(be).zip(dst.chunks_exact_mut(bb)) {
        match ty {
            GgmlType::Q4_0 => q4_0_block(x, out),
            GgmlType::Q4_1 => q4_1_block(x, out),
            GgmlType::Q5_0 => q5_0_block(x, out),
            GgmlType::Q5_1 => q5_1_block(x, out),
            GgmlType::Q8_0 => {
                let Ok(x) = <&[f32; 32]>::try_from(x) else {
                    continue; // unreachable: chunks_exact(32)
                };
                let b = q8_0_block(x);
                out[..2].copy_from_slice(&b.d.to_le_bytes());
                for (o, q) in out[2..].iter_mut().zip(b.qs) {
                    *o = q as u8;
                }
            }
            GgmlType::Q8_1 => {
                let Ok(x) = <&[f32; 32]>::try_from(x) else {
                    continue; // unreachable: chunks_exact(32)
                };
                let b = q8_1_block(x);
                out[..2].copy_from_slice(&b.d.to_le_bytes());
                out[2..4].copy_from_slice(&b.s.to_le_bytes());
                for (o, q) in out[4..].iter_mut().zip(b.qs) {
                    *o = q as u8;
                }
            }
            GgmlType::Q8K => {
                let Ok(x) = <&[f32; QK_K]>::try_from(x) else {
                    continue; // unreachable: chunks_exact(QK_K)
                };
                let b = q8_k_block(x);
                out[..4].copy_from_slice(&b.d.to_le_bytes());
                for (o, q) in out[4..4 + QK_K].iter_mut().zip(b.qs) {
                    *o = q as u8;
                }
                for (o, s) in out[4 + QK_K..].chunks_exact_mut(2).zip(b.bsums) {
                    o.copy_from_slice(&s.to_le_bytes());
                }
            }
            other => return Err(QuantError::Unsupported(other)),
        }
    }
    Ok(())
}

/// Convenience for tests and benches: quantise a whole row into a new buffer.
pub fn quantize_to_vec(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = vec![0u8; bytes_for(ty, src.len())?];
    quantize_row(ty, src, &mut out)?;
    Ok(out)
}

/// A row of activations as the CPU fast path keeps them: `x` (whole blocks of 32) into `qs`, one
/// scale per block into `d` (the f16 the format stores, widened), and for Q8_1 (`s` given)
/// `s = d·Σq` per block likewise. The same values as [`q8_0_block`] / [`q8_1_block`] block by
/// block (tested bit for bit), with AVX2 where the CPU has it and NEON on aarch64: the scalar
/// blocks were five times llama.cpp's `quantize_row_q8_1` in a prefill profile (docs/speed.md).
pub(crate) fn q8_row(x: &[f32], qs: &mut [i8], d: &mut [f32], s: Option<&mut [f32]>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        unsafe { x86::q8_row(x, qs, d, s) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    {
        // NEON is part of the aarch64 baseline.
        neon::q8_row(x, qs, d, s)
    }
    #[cfg(not(target_arch = "aarch64"))]
    q8_row_scalar(x, qs, d, s)
}

/// [`q8_row`] block by block through the reference quantisers.
#[cfg_attr(target_arch = "aarch64", allow(dead_code))]
fn q8_row_scalar(x: &[f32], qs: &mut [i8], d: &mut [f32], mut s: Option<&mut [f32]>) {
    let blocks = x
        .chunks_exact(32)
        .zip(qs.chunks_exact_mut(32))
        .zip(d.iter_mut());
    for (b, ((x, q), d)) in blocks.enumerate() {
        let Ok(x) = <&[f32; 32]>::try_from(x) else {
            continue; // unreachable: chunks_exact(32)
        };
        match s.as_deref_mut() {
            None => {
                let blk = q8_0_block(x);
                *d = blk.d.to_f32();
                q.copy_from_slice(&blk.qs);
            }
            Some(s) => {
                let blk = q8_1_block(x);
                *d = blk.d.to_f32();
                if let Some(s) = s.get_mut(b) {
                    *s = blk.s.to_f32();
                }
                q.copy_from_slice(&blk.qs);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// [`super::round_i8`] on eight lanes, as i32: truncate, step by one where the fraction is
    /// at least a half away from zero, NaN to 0, saturate to the i8 range.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn round8(v: __m256) -> __m256i {
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let f = _mm256_sub_ps(v, t);
        let one = _mm256_set1_ps(1.0);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(f, _mm256_set1_ps(0.5)), one);
        let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(f, _mm256_set1_ps(-0.5)), one);
        let r = _mm256_sub_ps(_mm256_add_ps(t, up), down);
        // A NaN input stays NaN through all of it and becomes 0, as the scalar cast makes it
        // (±∞ keeps its truncation ±∞, its NaN fraction adds nothing, and saturates below).
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        let r = _mm256_min_ps(
            _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
            _mm256_set1_ps(127.0),
        );
        _mm256_cvttps_epi32(r)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q8_row(
        x: &[f32],
        qs: &mut [i8],
        d: &mut [f32],
        mut s: Option<&mut [f32]>,
    ) {
        let sign = _mm256_set1_ps(-0.0);
        let blocks = x
            .chunks_exact(32)
            .zip(qs.chunks_exact_mut(32))
            .zip(d.iter_mut());
        for (b, ((x, q), d)) in blocks.enumerate() {
            let p = x.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            // f32::max ignores a NaN; `maxps` returns its second operand when either is NaN, so
            // the running maximum (never NaN) goes second.
            let mut m = _mm256_setzero_ps();
            for &v in &v {
                m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
            let amax = _mm_cvtss_f32(m1);
            let dd = amax / 127.0;
            let id = _mm256_set1_ps(if dd != 0.0 { 1.0 / dd } else { 0.0 });
            let q0 = round8(_mm256_mul_ps(v[0], id));
            let q1 = round8(_mm256_mul_ps(v[1], id));
            let q2 = round8(_mm256_mul_ps(v[2], id));
            let q3 = round8(_mm256_mul_ps(v[3], id));
            // Σq before packing (exact in i32).
            let sum = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
            let s4 = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2));
            let total = _mm_cvtsi128_si32(s1);
            // i32 → i16 → i8 (values are in the i8 range already), then undo the per-128-bit
            // interleave of the packs.
            let w01 = _mm256_packs_epi32(q0, q1);
            let w23 = _mm256_packs_epi32(q2, q3);
            let bytes = _mm256_packs_epi16(w01, w23);
            let bytes =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().cast(), bytes);
            *d = f16::from_f32(dd).to_f32();
            if let Some(s) = s.as_deref_mut().and_then(|s| s.get_mut(b)) {
                *s = f16::from_f32(total as f32 * dd).to_f32();
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use half::f16;
    use std::arch::aarch64::*;

    /// [`super::q8_row`] with NEON: `fmaxnm` is what `f32::max` compiles to (a NaN operand
    /// gives the other one), and `fcvtas` is `f32::round` then the saturating cast to i32 (ties
    /// away from zero, NaN to 0), narrowed with saturation to i8 as `as i8` saturates.
    pub(super) fn q8_row(x: &[f32], qs: &mut [i8], d: &mut [f32], mut s: Option<&mut [f32]>) {
        let blocks = x
            .chunks_exact(32)
            .zip(qs.chunks_exact_mut(32))
            .zip(d.iter_mut());
        for (b, ((x, q), d)) in blocks.enumerate() {
            // SAFETY: `x` is 32 f32 and `q` 32 bytes (chunks_exact); NEON is baseline.
            unsafe {
                let p = x.as_ptr();
                let mut v = [vdupq_n_f32(0.0); 8];
                let mut m = vdupq_n_f32(0.0);
                for (j, v) in v.iter_mut().enumerate() {
                    *v = vld1q_f32(p.add(4 * j));
                    m = vmaxnmq_f32(m, vabsq_f32(*v));
                }
                let amax = vmaxnmvq_f32(m);
                let dd = amax / 127.0;
                let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
                let mut h = [vdup_n_s16(0); 8];
                for (j, h) in h.iter_mut().enumerate() {
                    *h = vqmovn_s32(vcvtaq_s32_f32(vmulq_n_f32(v[j], id)));
                }
                let lo = vcombine_s8(
                    vqmovn_s16(vcombine_s16(h[0], h[1])),
                    vqmovn_s16(vcombine_s16(h[2], h[3])),
                );
                let hi = vcombine_s8(
                    vqmovn_s16(vcombine_s16(h[4], h[5])),
                    vqmovn_s16(vcombine_s16(h[6], h[7])),
                );
                vst1q_s8(q.as_mut_ptr(), lo);
                vst1q_s8(q.as_mut_ptr().add(16), hi);
                // Σq of the stored quants (each half at most 16·128 in magnitude: exact in i16).
                let total = vaddlvq_s8(lo) as i32 + vaddlvq_s8(hi) as i32;
                *d = f16::from_f32(dd).to_f32();
                if let Some(s) = s.as_deref_mut().and_then(|s| s.get_mut(b)) {
                    *s = f16::from_f32(total as f32 * dd).to_f32();
                }
            }
        }
    }
}
