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

/// How RoPE turns a position into angles: llama.cpp's `freq_base`, `freq_scale` and the
/// optional per-pair frequency factors (`rope_freqs.weight`, Llama 3's `llama3` rope type baked
/// in by llama.cpp's converter).
#[derive(Clone, Copy, Debug)]
pub struct RopeFreqs<'a> {
    pub n_rot: usize,
    pub freq_base: f32,
    pub freq_scale: f32,
    /// n_rot/2 factors; pair i's angle is divided by `factors[i]`.
    pub factors: Option<&'a [f32]>,
}

/// cos/sin per rotated pair at position `pos`, as ggml's rope cache (`ggml_rope_cache_init` +
/// `rope_yarn` without YaRN's ramp, ggml-cpu/ops.cpp): `theta = pos`, then
/// `theta *= powf(base, -2/n_rot)` per pair (not `powf` per pair); each pair's angle is
/// `freq_scale · (theta / factor)`, `cosf`/`sinf` in f32. With no factors and a scale of 1 every
/// operation added to the plain `cos(theta)` is exact (x/1, 1·x), so the angles are bit for bit
/// those of unscaled RoPE.
pub fn rope_cache(pos: usize, r: &RopeFreqs<'_>, cs: &mut [(f32, f32)]) {
    let theta_scale = r.freq_base.powf(-2.0f32 / r.n_rot as f32);
    let mut theta = pos as f32;
    for (i, c) in cs.iter_mut().take(r.n_rot / 2).enumerate() {
        let ff = r.factors.map_or(1.0, |f| f[i]);
        let t = r.freq_scale * (theta / ff);
        *c = (t.cos(), t.sin());
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

/// ggml's GELU (tanh approximation) as its CPU backend computes it (`GGML_GELU_FP16`): below
/// −10 it is 0, from 10 up the identity, and between, the input rounded to f16 looks up
/// `ggml_table_gelu_f16`, i.e. `gelu_f32` of that f16 value rounded to f16 again.
pub fn gelu_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        round_f16(gelu_f32(round_f16(x)))
    }
}

/// ggml's `ggml_gelu_f32`: `0.5x(1 + tanh(sqrt(2/π)·x·(1 + 0.044715x²)))`, in its order.
fn gelu_f32(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// ggml's `geglu` (`ggml_vec_geglu_f32`): `gelu(g)·u` into `g`; outside ±10 as ggml: 0, or `g·u`.
pub fn geglu_inplace(g: &mut [f32], u: &[f32]) {
    for (a, &b) in g.iter_mut().zip(u) {
        *a = if *a <= -10.0 {
            0.0
        } else if *a >= 10.0 {
            *a * b
        } else {
            gelu_ggml(*a) * b
        };
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

    fn plain(n_rot: usize) -> RopeFreqs<'static> {
        RopeFreqs {
            n_rot,
            freq_base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        }
    }

    #[test]
    fn rope_norm_and_neox_pair_differently() {
        let mut cs = vec![(0.0, 0.0); 2];
        rope_cache(3, &plain(4), &mut cs);
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
        rope_cache(0, &plain(4), &mut cs);
        let mut z = x;
        rope_heads(&mut z, 4, 4, RopeKind::Neox, &cs);
        assert_eq!(z, x);
    }

    /// Factors of 1.0 and a scale of 1 give the angles of plain RoPE bit for bit; real factors
    /// divide each pair's angle (as ggml's `theta / ff`), and a linear scale multiplies it.
    #[test]
    fn rope_factors_and_scale_change_the_cache_and_ones_change_nothing() {
        let n_rot = 64;
        let ones = vec![1.0f32; n_rot / 2];
        let factors: Vec<f32> = (0..n_rot / 2).map(|i| 1.0 + i as f32 * 0.25).collect();
        for pos in [0usize, 1, 7, 100, 4095] {
            let mut a = vec![(0.0, 0.0); n_rot / 2];
            let mut b = a.clone();
            rope_cache(pos, &plain(n_rot), &mut a);
            let with_ones = RopeFreqs {
                factors: Some(&ones),
                ..plain(n_rot)
            };
            rope_cache(pos, &with_ones, &mut b);
            let bits = |v: &[(f32, f32)]| -> Vec<(u32, u32)> {
                v.iter().map(|(c, s)| (c.to_bits(), s.to_bits())).collect()
            };
            assert_eq!(
                bits(&a),
                bits(&b),
                "pos {pos}: factors of 1.0 changed the cache"
            );
            let with_factors = RopeFreqs {
                factors: Some(&factors),
                ..plain(n_rot)
            };
            rope_cache(pos, &with_factors, &mut b);
            if pos > 0 {
                assert_eq!(a[0], b[0], "pair 0 has factor 1");
                for i in 1..n_rot / 2 {
                    assert_ne!(a[i], b[i], "pos {pos} pair {i}: the factor was not applied");
                }
                // Pair i at factor f turns as plain RoPE does at theta / f.
                let theta = pos as f32 * 10000f32.powf(-2.0 / n_rot as f32);
                let t = theta / factors[1];
                assert_eq!(b[1], (t.cos(), t.sin()));
            }
            let half = RopeFreqs {
                freq_scale: 0.5,
                ..plain(n_rot)
            };
            rope_cache(pos, &half, &mut b);
            let t = 0.5 * pos as f32;
            assert_eq!(b[0], (t.cos(), t.sin()));
        }
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
