//! The non-matmul ops, on the CPU, written to round as ggml's CPU ops do (see
//! `shared/reference/llm.md`, "Numerics that decide equality with llama.cpp"): plain loops over
//! contiguous slices that the compiler vectorises.

use super::hparams::RopeKind;

/// ggml's `rms_norm` then `mul`: sum of squares in f64, mean narrowed to f32,
/// `scale = 1/sqrtf(mean + eps)`, `y = (x·scale)·w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// In place, for every row of `x` (rows of `w.len()` values).
pub fn rms_norm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0f32 / (mean + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = (*v * scale) * g;
        }
    }
}

/// cos/sin per rotated pair at position `pos`, as ggml's rope cache: `theta = pos`, then
/// `theta *= powf(base, -2/n_rot)` per pair (not `powf` per pair), `cosf`/`sinf` in f32.
pub fn rope_cache(pos: usize, n_rot: usize, freq_base: f32, cs: &mut [(f32, f32)]) {
    let theta_scale = freq_base.powf(-2.0f32 / n_rot as f32);
    let mut theta = pos as f32;
    for c in cs.iter_mut().take(n_rot / 2) {
        *c = (theta.cos(), theta.sin());
        theta *= theta_scale;
    }
}

/// Rotate every head (rows of `head_dim`) of one token's Q or K.
pub fn rope_heads(x: &mut [f32], head_dim: usize, n_rot: usize, kind: RopeKind, cs: &[(f32, f32)]) {
    for h in x.chunks_exact_mut(head_dim) {
        match kind {
            RopeKind::Norm => {
                for (pair, &(c, s)) in h[..n_rot].chunks_exact_mut(2).zip(cs) {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = x0 * c - x1 * s;
                    pair[1] = x0 * s + x1 * c;
                }
            }
            RopeKind::Neox => {
                let half = n_rot / 2;
                let (a, b) = h[..n_rot].split_at_mut(half);
                for ((x0, x1), &(c, s)) in a.iter_mut().zip(b.iter_mut()).zip(cs) {
                    let (v0, v1) = (*x0, *x1);
                    *x0 = v0 * c - v1 * s;
                    *x1 = v0 * s + v1 * c;
                }
            }
        }
    }
}

/// ggml's `swiglu`: `silu(g)·u` with `silu(x) = x/(1+expf(−x))`, into `g`.
pub fn swiglu_inplace(g: &mut [f32], u: &[f32]) {
    for (a, &b) in g.iter_mut().zip(u) {
        *a = (*a / (1.0 + (-*a).exp())) * b;
    }
}

/// ggml's `soft_max_ext` over the first `n` scores (the causal mask makes the rest −∞):
/// `x·scale`, max, `expf(x − max)`, sum in f64, multiply by `1/sum`.
pub fn softmax_scaled(s: &mut [f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    for v in s.iter_mut() {
        *v *= scale;
        max = max.max(*v);
    }
    let mut sum = 0.0f64;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in s.iter_mut() {
        *v *= inv;
    }
}

/// Round through f16 (ggml converts the f32 operand of an f16 matmul to the weight's type).
#[inline]
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: independent lanes the compiler turns into SIMD, like ggml's
    // GGML_F32_STEP accumulators.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            acc[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += a·x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_norm_and_neox_pair_differently() {
        let mut cs = vec![(0.0, 0.0); 2];
        rope_cache(3, 4, 10000.0, &mut cs);
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let mut n = x;
        rope_heads(&mut n, 4, 4, RopeKind::Norm, &cs);
        let mut e = x;
        rope_heads(&mut e, 4, 4, RopeKind::Neox, &cs);
        let (c, s) = cs[0];
        assert_eq!(n[0], 1.0 * c - 2.0 * s);
        assert_eq!(e[0], 1.0 * c - 3.0 * s);
        assert_ne!(n, e);
        // Position 0 is the identity for both.
        rope_cache(0, 4, 10000.0, &mut cs);
        let mut z = x;
        rope_heads(&mut z, 4, 4, RopeKind::Neox, &cs);
        assert_eq!(z, x);
    }

    #[test]
    fn softmax_sums_to_one_and_rms_norm_normalises() {
        let mut s = [1.0f32, 2.0, 3.0];
        softmax_scaled(&mut s, 0.5);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[2] > s[1] && s[1] > s[0]);
        let mut y = [0.0f32; 4];
        rms_norm(&[2.0, -2.0, 2.0, -2.0], &[1.0; 4], 0.0, &mut y);
        assert_eq!(y, [1.0, -1.0, 1.0, -1.0]);
    }
}
