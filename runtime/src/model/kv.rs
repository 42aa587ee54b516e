//! The KV cache: allocated once for the whole context (every layer, K and V), f16 by default as
//! llama.cpp stores it (`type_k`/`type_v` = F16), f32 on request. Tokens are written in place at
//! their position; nothing grows, nothing is copied as a whole.

use crate::backend::cpu::f16_bits_to_f32;
use anyhow::{bail, Result};
use half::f16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum KvType {
    F16,
    F32,
}

enum Store {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Store {
    fn new(ty: KvType, n: usize) -> Store {
        match ty {
            KvType::F16 => Store::F16(vec![f16::ZERO; n]),
            KvType::F32 => Store::F32(vec![0.0; n]),
        }
    }

    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Store::F16(v) => {
                for (o, &x) in v[at..at + src.len()].iter_mut().zip(src) {
                    *o = f16::from_f32(x);
                }
            }
            Store::F32(v) => v[at..at + src.len()].copy_from_slice(src),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Store::F16(v) => v.len() * 2,
            Store::F32(v) => v.len() * 4,
        }
    }
}

/// f16 → f32, exact, without `half`'s per-call CPU feature detection (this runs once per cached
/// element per head per token).
#[inline(always)]
fn widen(x: f16) -> f32 {
    f16_bits_to_f32(x.to_bits())
}

/// `q·r` in eight lanes (lane l takes elements 8i + l), then the lanes summed in order and the
/// tail added: the order every path here keeps.
fn dot_f16(q: &[f32], r: &[f16]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = q.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            acc[l] += q[i * 8 + l] * widen(r[i * 8 + l]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..q.len() {
        s += q[i] * widen(r[i]);
    }
    s
}

/// `y += a·r`, element by element.
fn axpy_f16(y: &mut [f32], a: f32, r: &[f16]) {
    for (o, v) in y.iter_mut().zip(r.iter()) {
        *o += a * widen(*v);
    }
}

/// [`dot_f16`] and [`axpy_f16`] with the widening in `vcvtph2ps` (exact) and the same lanes and
/// operations (mul then add, no FMA), so the bits are the same; the portable versions compile
/// to SSE2 here and were a third of a decode step.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{f16, widen};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn dot_f16(q: &[f32], r: &[f16]) -> f32 {
        let chunks = q.len().min(r.len()) / 8;
        let mut acc = _mm256_setzero_ps();
        for i in 0..chunks {
            // SAFETY: 8(i + 1) <= len of both slices.
            unsafe {
                let w = _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(i * 8) as *const __m128i));
                acc = _mm256_add_ps(
                    acc,
                    _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(i * 8)), w),
                );
            }
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let mut s: f32 = lanes.iter().sum();
        for i in chunks * 8..q.len().min(r.len()) {
            s += q[i] * widen(r[i]);
        }
        s
    }

    /// # Safety
    /// The CPU must have AVX and F16C.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn axpy_f16(y: &mut [f32], a: f32, r: &[f16]) {
        let n = y.len().min(r.len());
        let chunks = n / 8;
        let av = _mm256_set1_ps(a);
        for i in 0..chunks {
            // SAFETY: 8(i + 1) <= n.
            unsafe {
                let w = _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(i * 8) as *const __m128i));
                let p = y.as_mut_ptr().add(i * 8);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(av, w)));
            }
        }
        for i in chunks * 8..n {
            y[i] += a * widen(r[i]);
        }
    }
}

/// A row of the cache as the attention reads it.
pub enum Row<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl Row<'_> {
    /// `q·row`; q was already rounded to the row's type (ggml converts the f32 operand).
    #[inline]
    pub fn dot(&self, q: &[f32]) -> f32 {
        match self {
            Row::F32(r) => super::ops::dot(q, r),
            Row::F16(r) => {
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: AVX and F16C were just detected on this CPU.
                    return unsafe { x86::dot_f16(q, r) };
                }
                dot_f16(q, r)
            }
        }
    }

    /// `y += a·row`.
    #[inline]
    pub fn axpy(&self, y: &mut [f32], a: f32) {
        match self {
            Row::F32(r) => super::ops::axpy(y, a, r),
            Row::F16(r) => {
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: AVX and F16C were just detected on this CPU.
                    return unsafe { x86::axpy_f16(y, a, r) };
                }
                axpy_f16(y, a, r)
            }
        }
    }
}

pub struct KvCache {
    pub ty: KvType,
    pub n_ctx: usize,
    n_layer: usize,
    kv_dim: usize,
    head_dim: usize,
    k: Store,
    v: Store,
    /// Tokens held (positions 0..len).
    pub len: usize,
}

impl KvCache {
    pub fn new(
        ty: KvType,
        n_layer: usize,
        n_ctx: usize,
        kv_dim: usize,
        head_dim: usize,
    ) -> KvCache {
        let n = n_layer * n_ctx * kv_dim;
        KvCache {
            ty,
            n_ctx,
            n_layer,
            kv_dim,
            head_dim,
            k: Store::new(ty, n),
            v: Store::new(ty, n),
            len: 0,
        }
    }

    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// An error unless `n` more tokens fit.
    pub fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.n_ctx {
            bail!(
                "context overflow: {} tokens in the cache + {n} new > context length {} \
                 (raise --ctx, up to the model's context_length)",
                self.len,
                self.n_ctx
            );
        }
        Ok(())
    }

    fn at(&self, layer: usize, pos: usize) -> usize {
        (layer * self.n_ctx + pos) * self.kv_dim
    }

    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        debug_assert!(layer < self.n_layer && pos < self.n_ctx);
        let at = self.at(layer, pos);
        self.k.write(at, k);
        self.v.write(at, v);
    }

    fn row<'a>(&self, s: &'a Store, layer: usize, pos: usize, head: usize) -> Row<'a> {
        let at = self.at(layer, pos) + head * self.head_dim;
        match s {
            Store::F16(v) => Row::F16(&v[at..at + self.head_dim]),
            Store::F32(v) => Row::F32(&v[at..at + self.head_dim]),
        }
    }

    pub fn k(&self, layer: usize, pos: usize, head: usize) -> Row<'_> {
        self.row(&self.k, layer, pos, head)
    }

    pub fn v(&self, layer: usize, pos: usize, head: usize) -> Row<'_> {
        self.row(&self.v, layer, pos, head)
    }
}

#[cfg(test)]
mod tests {
    use super::{f16, KvCache, KvType};

    /// The attention's f16 row dot and axpy give the same bits on every path this CPU takes as the
    /// portable loops do (x86: the F16C versions), including rows with a tail after the lanes.
    #[test]
    fn f16_rows_match_the_portable_loops_to_the_bit() {
        let mut z = 0x1234_5678u32;
        let mut next = move || {
            z ^= z << 13;
            z ^= z >> 17;
            z ^= z << 5;
            (z >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        };
        for hd in [64usize, 67, 128, 5] {
            let mut kv = KvCache::new(KvType::F16, 1, 2, hd, hd);
            let k: Vec<f32> = (0..hd).map(|_| next()).collect();
            kv.write(0, 0, &k, &k);
            let q: Vec<f32> = (0..hd).map(|_| next()).collect();
            let r: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let row = kv.k(0, 0, 0);
            assert_eq!(
                row.dot(&q).to_bits(),
                super::dot_f16(&q, &r).to_bits(),
                "dot, head_dim {hd}"
            );
            let (mut y1, mut y2) = (q.clone(), q.clone());
            row.axpy(&mut y1, 0.37);
            super::axpy_f16(&mut y2, 0.37, &r);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y1), bits(&y2), "axpy, head_dim {hd}");
        }
    }
}
