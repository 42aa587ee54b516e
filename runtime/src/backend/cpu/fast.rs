//! The fast path, as ggml's CPU backend computes a quantised matmul: activations are quantised per
//! block to the weight type's `vec_dot_type` (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K
//! for the K-quants), weight blocks are unpacked to i8, and the products are integer dots scaled
//! once per block. F16/BF16 rows are widened to f32 and accumulated in f32.

use super::kernels::{dot_f32, sum_blocks, Kernel};
use crate::quant::{get_scale_min_k4, q8_k_block, q8_row, GgmlType, QK_K};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// binary16 → f32 for one block scale, exact for every bit pattern: the exponent is rebiased by
/// one exact multiply by 2^112 (which also normalises subnormals), Inf/NaN get the all-ones
/// exponent. By hand because `half`'s scalar `to_f32` runs CPU feature detection on every call.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let em = (h & 0x7FFF) << 13;
    let scaled = (f32::from_bits(em) * f32::from_bits(0x7780_0000)).to_bits();
    let bits = if h & 0x7C00 == 0x7C00 {
        em | 0x7F80_0000
    } else {
        scaled
    };
    f32::from_bits(bits | ((h & 0x8000) << 16))
}

/// ggml's nibble order: byte j holds element j (low) and j+16 (high).
#[inline(always)]
fn unpack4(q: &[u8; 16], bias: i8, out: &mut [i8; 32]) {
    for j in 0..16 {
        out[j] = (q[j] & 0xF) as i8 - bias;
        out[j + 16] = (q[j] >> 4) as i8 - bias;
    }
}

/// As [`unpack4`], with each element's 5th bit from `qh` (bit j for element j).
#[inline(always)]
fn unpack5(q: &[u8; 16], qh: u32, bias: i8, out: &mut [i8; 32]) {
    for j in 0..16 {
        out[j] = ((q[j] & 0xF) | (((qh >> j) & 1) << 4) as u8) as i8 - bias;
        out[j + 16] = ((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8) as i8 - bias;
    }
}

fn f16_le(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// The activation format a weight type is multiplied against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActFormat {
    F32,
    Q8_0,
    Q8_1,
    Q8K,
}

pub(crate) fn act_format(ty: GgmlType) -> Option<ActFormat> {
    use GgmlType::*;
    Some(match ty {
        F32 | F16 | Bf16 => ActFormat::F32,
        Q4_0 | Q5_0 | Q8_0 => ActFormat::Q8_0,
        Q4_1 | Q5_1 => ActFormat::Q8_1,
        Q4K | Q5K | Q6K => ActFormat::Q8K,
        _ => return None,
    })
}

/// All M activation rows, quantised once per run and shared by every thread.
pub(crate) struct Activations<'a> {
    pub fmt: ActFormat,
    pub k: usize,
    pub f32s: &'a [f32],
    /// M·K quants.
    pub qs: Vec<i8>,
    /// One scale per block (32, or 256 for Q8_K), as the format stores it, widened to f32.
    pub d: Vec<f32>,
    /// Q8_1: `s = d·Σq` per block (f16 in the format).
    pub s: Vec<f32>,
    /// Q8_K: Σ of each 16 quants.
    pub bsums: Vec<i16>,
    /// M > 1 on x86: the same quants interleaved for the register tiles (`gemm.rs`), when the
    /// weight's type has them; set by the caller once per matmul.
    pub tiles: Option<super::gemm::ActTiles>,
}

impl<'a> Activations<'a> {
    /// Quantise the M rows of `a` (K each) once, on one thread.
    #[cfg(test)]
    pub fn quantize(fmt: ActFormat, a: &'a [f32], k: usize) -> Activations<'a> {
        Activations::quantize_on(fmt, a, k, 1)
    }

    /// As [`Activations::quantize`], the rows split over up to `threads` threads of the pool
    /// when there are enough of them (prefill, batches): every block is quantised alone, so the
    /// split changes no value. Left serial, it was a tenth of a two-thread prefill with the
    /// second thread spinning through it (docs/speed.md).
    pub fn quantize_on(fmt: ActFormat, a: &'a [f32], k: usize, threads: usize) -> Activations<'a> {
        let mut act = Activations {
            fmt,
            k,
            f32s: a,
            qs: Vec::new(),
            d: Vec::new(),
            s: Vec::new(),
            bsums: Vec::new(),
            tiles: None,
        };
        let per_block = match fmt {
            ActFormat::F32 => return act,
            ActFormat::Q8_0 | ActFormat::Q8_1 => 32,
            ActFormat::Q8K => QK_K,
        };
        let blocks = a.len() / per_block;
        act.qs = vec![0; blocks * per_block];
        act.d = vec![0.0; blocks];
        if fmt == ActFormat::Q8_1 {
            act.s = vec![0.0; blocks];
        }
        if fmt == ActFormat::Q8K {
            act.bsums = vec![0; blocks * (QK_K / 16)];
        }
        let m = a.len().checked_div(k).unwrap_or(0);
        // Below this many values per thread the pool's hand-off costs more than it saves.
        const MIN_PER_THREAD: usize = 4096;
        let parts = threads.min(m).min(a.len() / MIN_PER_THREAD).max(1);
        let rows = m.div_ceil(parts).max(1);
        // Blocks per row.
        let bpr = k / per_block;
        // Split every buffer at the same row boundaries (`s` and `bsums` are empty when the
        // format has none).
        fn cut<'b, T>(v: &mut &'b mut [T], n: usize) -> &'b mut [T] {
            let n = n.min(v.len());
            let (head, tail) = std::mem::take(v).split_at_mut(n);
            *v = tail;
            head
        }
        let mut parts = Vec::with_capacity(parts);
        let (mut x, mut qs, mut d) = (a, &mut act.qs[..], &mut act.d[..]);
        let (mut s, mut b) = (&mut act.s[..], &mut act.bsums[..]);
        while !x.is_empty() && k > 0 {
            let r = rows.min(x.len() / k).max(1);
            let (x0, rest) = x.split_at((r * k).min(x.len()));
            x = rest;
            parts.push((
                x0,
                cut(&mut qs, r * k),
                cut(&mut d, r * bpr),
                cut(&mut s, r * bpr),
                cut(&mut b, r * bpr * (QK_K / 16)),
            ));
        }
        crate::pool::run_parts(parts, |_, (x, qs, d, s, bsums)| match fmt {
            ActFormat::F32 => {}
            ActFormat::Q8_0 => q8_row(x, qs, d, None),
            ActFormat::Q8_1 => q8_row(x, qs, d, Some(s)),
            ActFormat::Q8K => {
                let blocks = x
                    .chunks_exact(QK_K)
                    .zip(qs.chunks_exact_mut(QK_K))
                    .zip(d.iter_mut())
                    .zip(bsums.chunks_exact_mut(QK_K / 16));
                for (((x, q), d), b) in blocks {
                    let Ok(x) = <&[f32; QK_K]>::try_from(x) else {
                        continue; // unreachable: chunks_exact(QK_K)
                    };
                    let blk = q8_k_block(x);
                    *d = blk.d;
                    q.copy_from_slice(&blk.qs);
                    b.copy_from_slice(&blk.bsums);
                }
            }
        });
        act
    }
}

/// One weight row unpacked for the integer dots; reused across rows by each thread.
#[derive(Default)]
pub(crate) struct RowScratch {
    qs: Vec<i8>,
    /// Per block: d (or the super-block d for K-quants).
    d: Vec<f32>,
    /// Per block: m (Q4_1/Q5_1) or the super-block dmin (Q4_K/Q5_K).
    m: Vec<f32>,
    /// K-quants: per sub-block integer scale (8 per super-block, 16 for Q6_K) and min.
    sc: Vec<i32>,
    mins: Vec<i32>,
    f: Vec<f32>,
    bits: Vec<u16>,
    dots: Vec<i32>,
}

impl RowScratch {
    /// Unpack weight row `src` (whole blocks of `ty`) into `self`.
    pub fn unpack(&mut self, ty: GgmlType, src: &[u8]) {
        self.qs.clear();
        self.d.clear();
        self.m.clear();
        self.sc.clear();
        self.mins.clear();
        let bb = ty.block_bytes();
        match ty {
            GgmlType::F32 => {
                self.f.clear();
                self.f.extend(
                    src.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            GgmlType::F16 => {
                // `half` converts a slice with F16C / NEON fp16 when the CPU has them (detected
                // once per call); the bytes go through u16s because the mapping may be unaligned.
                self.bits.clear();
                self.bits.extend(
                    src.chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]])),
                );
                self.f.resize(self.bits.len(), 0.0);
                HalfBitsSliceExt::reinterpret_cast::<f16>(&self.bits[..])
                    .convert_to_f32_slice(&mut self.f);
            }
            GgmlType::Bf16 => {
                self.f.clear();
                self.f.extend(
                    src.chunks_exact(2)
                        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
                );
            }
            GgmlType::Q8_0 => {
                let nb = src.len() / bb;
                self.qs.resize(nb * 32, 0);
                self.d.resize(nb, 0.0);
                let blocks = src.chunks_exact(bb).zip(self.qs.chunks_exact_mut(32));
                for ((b, out), d) in blocks.zip(self.d.iter_mut()) {
                    *d = f16_le(b, 0);
                    if let (Ok(q), Ok(out)) = (
                        <&[u8; 32]>::try_from(&b[2..34]),
                        <&mut [i8; 32]>::try_from(out),
                    ) {
                        *out = q.map(|x| x as i8);
                    }
                }
            }
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let nb = src.len() / bb;
                let has_m = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                let five = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
                let bias = match ty {
                    GgmlType::Q4_0 => 8,
                    GgmlType::Q5_0 => 16,
                    _ => 0,
                };
                let off = if has_m { 4 } else { 2 };
                self.qs.resize(nb * 32, 0);
                self.d.resize(nb, 0.0);
                self.m.resize(if has_m { nb } else { 0 }, 0.0);
                let blocks = src.chunks_exact(bb).zip(self.qs.chunks_exact_mut(32));
                for (i, (b, out)) in blocks.enumerate() {
                    self.d[i] = f16_le(b, 0);
                    if has_m {
                        self.m[i] = f16_le(b, 2);
                    }
                    let (qh, qs) = if five {
                        let qh = u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]);
                        (qh, &b[off + 4..off + 20])
                    } else {
                        (0, &b[off..off + 16])
                    };
                    // Fixed-size views so the loops below vectorise; the lengths always match.
                    if let (Ok(q), Ok(out)) =
                        (<&[u8; 16]>::try_from(qs), <&mut [i8; 32]>::try_from(out))
                    {
                        if five {
                            unpack5(q, qh, bias, out);
                        } else {
                            unpack4(q, bias, out);
                        }
                    }
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                for b in src.chunks_exact(bb) {
                    self.d.push(f16_le(b, 0));
                    self.m.push(f16_le(b, 2));
                    let scales = &b[4..16];
                    for j in 0..8 {
                        let (sc, m) = get_scale_min_k4(j, scales);
                        self.sc.push(sc as i32);
                        self.mins.push(m as i32);
                    }
                    let (qh, qs) = if ty == GgmlType::Q5K {
                        (Some(&b[16..48]), &b[48..176])
                    } else {
                        (None, &b[16..144])
                    };
                    for c in 0..4 {
                        let q = &qs[32 * c..32 * c + 32];
                        let hi = |l: usize, bit: usize| match qh {
                            Some(h) => ((h[l] >> bit) & 1) << 4,
                            None => 0,
                        };
                        self.qs
                            .extend((0..32).map(|l| ((q[l] & 0xF) | hi(l, 2 * c)) as i8));
                        self.qs
                            .extend((0..32).map(|l| ((q[l] >> 4) | hi(l, 2 * c + 1)) as i8));
                    }
                }
            }
            GgmlType::Q6K => {
                for b in src.chunks_exact(bb) {
                    self.d.push(f16_le(b, 208));
                    self.sc.extend(b[192..208].iter().map(|&s| s as i8 as i32));
                    let start = self.qs.len();
                    self.qs.resize(start + QK_K, 0);
                    let y = &mut self.qs[start..];
                    for n in 0..2 {
                        let ql = &b[64 * n..64 * n + 64];
                        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                        for l in 0..32 {
                            let y = &mut y[128 * n..];
                            y[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                            y[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                        }
                    }
                }
            }
            // `supports` admits only the types above.
            _ => {}
        }
    }

    /// The dot product of the unpacked row with activation row `row` of `act`, blocks summed in
    /// the canonical order ([`sum_blocks`]).
    pub fn dot(&mut self, kernel: Kernel, ty: GgmlType, act: &Activations<'_>, row: usize) -> f32 {
        self.dot_in::<false>(kernel, ty, act, row)
    }

    /// [`Self::dot`]; `SERIAL` (tests only) sums the blocks in one running sum, the order fault
    /// the order tests must catch.
    #[inline(always)]
    pub fn dot_in<const SERIAL: bool>(
        &mut self,
        kernel: Kernel,
        ty: GgmlType,
        act: &Activations<'_>,
        row: usize,
    ) -> f32 {
        let k = act.k;
        match act.fmt {
            ActFormat::F32 => dot_f32(&self.f, &act.f32s[row * k..row * k + k]),
            ActFormat::Q8_0 | ActFormat::Q8_1 => {
                let nb = k / 32;
                let ad = &act.d[row * nb..row * nb + nb];
                self.dots.resize(nb, 0);
                kernel.dots::<32>(&self.qs, &act.qs[row * k..row * k + k], &mut self.dots);
                let (dots, wd) = (&self.dots[..nb], &self.d[..nb]);
                if act.fmt == ActFormat::Q8_0 {
                    sum_blocks::<SERIAL>(nb, |b| dots[b] as f32 * wd[b] * ad[b])
                } else {
                    let as_ = &act.s[row * nb..row * nb + nb];
                    let wm = &self.m[..nb];
                    sum_blocks::<SERIAL>(nb, |b| (wd[b] * ad[b]) * dots[b] as f32 + wm[b] * as_[b])
                }
            }
            ActFormat::Q8K => {
                let nb = k / QK_K;
                let aq = &act.qs[row * k..row * k + k];
                let ad = &act.d[row * nb..row * nb + nb];
                let bsums = &act.bsums[row * nb * 16..(row + 1) * nb * 16];
                let wd = &self.d[..nb];
                if ty == GgmlType::Q6K {
                    self.dots.resize(k / 16, 0);
                    kernel.dots::<16>(&self.qs, aq, &mut self.dots);
                    let (sc, dots) = (&self.sc[..nb * 16], &self.dots[..nb * 16]);
                    sum_blocks::<SERIAL>(nb, |b| {
                        let (sc, dots) = (&sc[16 * b..16 * b + 16], &dots[16 * b..16 * b + 16]);
                        let isum: i32 = sc.iter().zip(dots).map(|(s, d)| s * d).sum();
                        wd[b] * ad[b] * isum as f32
                    })
                } else {
                    self.dots.resize(k / 32, 0);
                    kernel.dots::<32>(&self.qs, aq, &mut self.dots);
                    let (sc, mins) = (&self.sc[..nb * 8], &self.mins[..nb * 8]);
                    let (dots, wmin) = (&self.dots[..nb * 8], &self.m[..nb]);
                    sum_blocks::<SERIAL>(nb, |b| {
                        let r = 8 * b..8 * b + 8;
                        let isum: i32 = sc[r.clone()]
                            .iter()
                            .zip(&dots[r.clone()])
                            .map(|(s, d)| s * d)
                            .sum();
                        let msum: i32 = mins[r]
                            .iter()
                            .zip(bsums[16 * b..16 * b + 16].chunks_exact(2))
                            .map(|(m, pair)| m * (pair[0] as i32 + pair[1] as i32))
                            .sum();
                        ad[b] * (wd[b] * isum as f32 - wmin[b] * msum as f32)
                    })
                }
            }
        }
    }
}
