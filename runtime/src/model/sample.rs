//! Choosing the next token. `temp <= 0` is greedy: the argmax, ties to the lowest id. Otherwise,
//! in llama.cpp's default order: top-k, top-p, temperature, then a draw from a seeded generator
//! (SplitMix64, so a seed gives the same tokens on every machine).

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub temp: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    pub seed: u64,
}

pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
}

/// Greedy: the largest logit, the lowest id among equals. NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let state = cfg.seed;
        Sampler { cfg, state }
    }

    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temp <= 0.0 {
            return argmax(logits);
        }
        let mut c: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if c.is_empty() {
            return 0;
        }
        c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.cfg.top_k > 0 {
            c.truncate(self.cfg.top_k.max(1));
        }
        let max = c[0].1 as f64;
        let mut p: Vec<f64> = c.iter().map(|(_, v)| (*v as f64 - max).exp()).collect();
        if self.cfg.top_p < 1.0 {
            let total: f64 = p.iter().sum();
            let mut cum = 0.0;
            let mut keep = p.len();
            for (i, q) in p.iter().enumerate() {
                cum += q / total;
                if cum >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            p.truncate(keep);
        }
        let t = self.cfg.temp as f64;
        for (q, (_, v)) in p.iter_mut().zip(&c) {
            *q = ((*v as f64 - max) / t).exp();
        }
        let total: f64 = p.iter().sum();
        let mut r = self.next_f64() * total;
        for (q, (id, _)) in p.iter().zip(&c) {
            if r < *q {
                return *id;
            }
            r -= q;
        }
        c[c.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_ties_go_to_the_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
    }

    #[test]
    fn seeded_sampling_repeats_and_top_k_1_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let cfg = SamplerConfig {
            temp: 0.8,
            top_k: 0,
            top_p: 0.95,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "a temperature draw varies: {a:?}"
        );
        let mut k1 = Sampler::new(SamplerConfig { top_k: 1, ..cfg });
        assert_eq!(k1.sample(&logits), argmax(&logits));
    }
}
