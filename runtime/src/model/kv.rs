//! The KV cache: allocated once for the whole context (every layer, K and V), f16 by default as
//! llama.cpp stores it (`type_k`/`type_v` = F16), f32 on request. Tokens are written in place at
//! their position; nothing grows, nothing is copied as a whole.

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
                let mut acc = [0.0f32; 8];
                let chunks = q.len() / 8;
                for i in 0..chunks {
                    for l in 0..8 {
                        acc[l] += q[i * 8 + l] * r[i * 8 + l].to_f32();
                    }
                }
                let mut s: f32 = acc.iter().sum();
                for i in chunks * 8..q.len() {
                    s += q[i] * r[i].to_f32();
                }
                s
            }
        }
    }

    /// `y += a·row`.
    #[inline]
    pub fn axpy(&self, y: &mut [f32], a: f32) {
        match self {
            Row::F32(r) => super::ops::axpy(y, a, r),
            Row::F16(r) => {
                for (o, v) in y.iter_mut().zip(r.iter()) {
                    *o += a * v.to_f32();
                }
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
