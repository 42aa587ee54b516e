//! K-quant (Q4_K, Q5_K, Q6_K) dots straight off the packed super-blocks, as ggml's
//! `ggml_vec_dot_q*_K_q8_K` computes them: each 256-element super-block's quants are unpacked in
//! registers, dotted with the Q8_K activation block and weighted by their sub-block scales in
//! exact integer arithmetic, giving per super-block the integer sums `isum = Σ sc·dot` (and for
//! Q4_K/Q5_K `msum = Σ min·bsum`). The f32 term of each super-block is then formed with the
//! operations of the unpacked path (`fast.rs`: Q4_K/Q5_K `d_a·(d_w·isum − dmin_w·msum)`, Q6_K
//! `d_w·d_a·isum`) and added in the canonical order (ARCHITECTURE.md, "CPU reduction order"), so
//! the bits are those of every other kernel. Decode reads each weight byte once and writes
//! nothing back; M > 1 unpacks each weight row once per matmul into a per-call scratch
//! (`x86::Unpacked`, `neon::Unpacked`: the quants as the dot instructions take them, the scales
//! ready) and dots it with every activation row from L1. Nothing is repacked at load.

use super::fast::Activations;
use super::kernels::{reduce_lanes, Kernel, BLOCK_LANES};
use crate::quant::{GgmlType, QK_K};

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K/Q5_K super-block from its 12 packed
/// bytes (ggml's `utmp` shuffle: the same values as `get_scale_min_k4(j)` for j in 0..8, four
/// at a time as u32 words instead of one byte at a time).
#[inline(always)]
pub(crate) fn scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc_lo = u0 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let join = |lo: u32, hi: u32| {
        let (l, h) = (lo.to_le_bytes(), hi.to_le_bytes());
        [l[0], l[1], l[2], l[3], h[0], h[1], h[2], h[3]]
    };
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
}

/// The types [`x86::row_dot`] and [`neon`]'s row dots take.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) const TYPES: [GgmlType; 3] = [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

/// Whether `kernel` runs the hand-written K-quant dots of `ty` on this CPU: x86 with AVX2 and
/// F16C (its one kernel), aarch64 with the NEON kernels (`Neon`, `NeonSdot`); the portable
/// kernel on aarch64 keeps the unpacked tile path.
pub(super) fn available(kernel: Kernel, ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let _ = kernel;
        TYPES.contains(&ty)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(target_arch = "aarch64")]
    {
        kernel != Kernel::Portable && TYPES.contains(&ty)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (kernel, ty);
        false
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::fused::x86::{add_tail, hsum4, prefetch_ahead, reduce8, tail_mask};
    use super::{reduce_lanes, scales_mins, Activations, GgmlType, BLOCK_LANES, QK_K};
    use std::arch::x86_64::*;

    /// The f16 at byte `at` of `b`, widened (exact, the bits of `fast::f16_bits_to_f32`),
    /// without arithmetic on a subnormal f32: `f16_bits_to_f32` forms a subnormal f16 as a
    /// subnormal f32 times 2¹¹², and on Intel cores that multiply takes a microcode assist
    /// (~150 cycles). Q6_K's super-block scales are mostly subnormal f16 (d ≈ max|w| / 4064), so
    /// the unpack of a Q6_K row paid one per super-block. Here a subnormal (or zero) f16 is its
    /// 10-bit mantissa times 2⁻²⁴: an integer conversion and a multiply by a power of two, exact.
    #[inline(always)]
    pub(in super::super) fn f16_at(b: &[u8], at: usize) -> f32 {
        let h = u16::from_le_bytes([b[at], b[at + 1]]);
        if h & 0x7C00 == 0 {
            let v = (h & 0x3FF) as f32 * f32::from_bits(0x3380_0000);
            if h & 0x8000 != 0 {
                -v
            } else {
                v
            }
        } else {
            super::super::fast::f16_bits_to_f32(h)
        }
    }

    /// Σ of the eight i32 lanes (exact: the caller's sums stay far inside i32).
    #[inline(always)]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// A `vpshufb` control that copies i16 lane `j` (bytes 2j, 2j + 1) of each 128-bit half to
    /// all eight lanes of that half.
    #[inline(always)]
    unsafe fn lane16(j: usize) -> __m256i {
        _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16)
    }

    /// Σ_j sc_j · (q·a over sub-block j) for the eight 32-element sub-blocks of a Q4_K or Q5_K
    /// super-block: `qs` its 128 nibble bytes, `qh` its 32 fifth-bit bytes (Q5_K), `a` the 256
    /// activation quants, `scv` the eight scales as i16 lanes 0..8 of both 128-bit halves.
    /// `vpmaddubsw` pairs are at most 2·31·127 < 2¹⁵ and the scales at most 63, so every step is
    /// exact.
    #[inline(always)]
    unsafe fn isum_q45(
        qs: *const u8,
        qh: Option<*const u8>,
        a: *const i8,
        scv: __m256i,
    ) -> __m256i {
        let m4 = _mm256_set1_epi8(0x0F);
        let one = _mm256_set1_epi8(1);
        // `if let`, not `Option::map`: a closure would not inherit the caller's AVX2.
        #[allow(clippy::manual_map)]
        let hbits = if let Some(p) = qh {
            Some(load(p))
        } else {
            None
        };
        let mut acc = _mm256_setzero_si256();
        for c in 0..4 {
            let q = load(qs.add(32 * c));
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if let Some(h) = hbits {
                // Bit 2c of byte l is element 64c + l's fifth bit, bit 2c + 1 element 64c + 32 + l's.
                let sh0 = _mm_cvtsi32_si128(2 * c as i32);
                let sh1 = _mm_cvtsi32_si128(2 * c as i32 + 1);
                let b0 = _mm256_and_si256(_mm256_srl_epi16(h, sh0), one);
                let b1 = _mm256_and_si256(_mm256_srl_epi16(h, sh1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(b0));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(b1));
            }
            let p_lo = _mm256_maddubs_epi16(lo, load(a.add(64 * c) as *const u8));
            let p_hi = _mm256_maddubs_epi16(hi, load(a.add(64 * c + 32) as *const u8));
            let s_lo = _mm256_shuffle_epi8(scv, lane16(2 * c));
            let s_hi = _mm256_shuffle_epi8(scv, lane16(2 * c + 1));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p_lo, s_lo));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p_hi, s_hi));
        }
        acc
    }

    /// Σ_j min_j · (bsum_2j + bsum_2j+1) of a Q4_K/Q5_K super-block: `mins` the eight mins,
    /// `bsums` the activation block's sixteen sums of 16 quants. A pair of sums is at most
    /// 2·16·127 and a min at most 63: exact in `vpmaddwd`.
    /// (Four i32 lanes whose sum is the msum: the caller reduces eight super-blocks' at once.)
    #[inline(always)]
    unsafe fn msum_q45(mins: u64, bsums: *const i16) -> __m128i {
        let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64));
        let pairs = _mm_hadd_epi16(
            _mm_loadu_si128(bsums as *const __m128i),
            _mm_loadu_si128(bsums.add(8) as *const __m128i),
        );
        _mm_madd_epi16(m, pairs)
    }

    /// Σ_j sc_j · (q·a over the 16-element group j) of a Q6_K super-block (`b` its 210 bytes),
    /// quants q in −32..=31 as (unsigned 6-bit) − 32: `vpmaddubsw(q6, a)` (pairs at most
    /// 2·63·127 < 2¹⁵) weighted by the signed scales in `vpmaddwd`, and the −32 of every quant
    /// taken once per super-block as `32·Σ sc_j·bsum_j` from the activation block's sums
    /// (`bsums`, sixteen sums of 16 quants, each at most 16·127). Exact. (Eight i32 lanes whose
    /// sum is the isum: the caller reduces eight super-blocks' at once.)
    #[inline(always)]
    unsafe fn isum_q6(b: *const u8, a: *const i8, bsums: *const i16) -> __m256i {
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
        let mut acc = _mm256_setzero_si256();
        for n in 0..2 {
            let ql0 = load(b.add(64 * n));
            let ql1 = load(b.add(64 * n + 32));
            let qh = load(b.add(128 + 32 * n));
            // ((qh >> s) & 3) << 4, per byte: the two high bits of each quant.
            let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2));
            let h2 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2));
            let h4 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2));
            let h6 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2));
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), h0),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), h2),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), h4),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), h6),
            ];
            for (j, q) in q.into_iter().enumerate() {
                let av = load(a.add(128 * n + 32 * j) as *const u8);
                let p = _mm256_maddubs_epi16(q, av);
                // Lanes 0..8 (elements 0..16 of this 32) take group g's scale, 8..16 group g + 1's.
                let g = (8 * n + 2 * j) as i64;
                let pick =
                    _mm_set_epi64x((g + 1) * 0x0101_0101_0101_0101, g * 0x0101_0101_0101_0101);
                let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
            }
        }
        let corr = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(sc8),
            _mm256_loadu_si256(bsums as *const __m256i),
        );
        _mm256_sub_epi32(acc, _mm256_slli_epi32::<5>(corr))
    }

    /// [Σv[x], Σv[x + 1], Σv[x + 2], Σv[x + 3]] of vectors of four i32.
    #[inline(always)]
    unsafe fn hsum4x4(v: &[__m128i; BLOCK_LANES], x: usize) -> __m128i {
        _mm_hadd_epi32(
            _mm_hadd_epi32(v[x], v[x + 1]),
            _mm_hadd_epi32(v[x + 2], v[x + 3]),
        )
    }

    /// The i32 sums of eight vectors of eight lanes (`v[j]`'s into lane j), converted to f32 as
    /// `isum as f32` converts (`vcvtdq2ps`, round to nearest even).
    #[inline(always)]
    pub(in super::super) unsafe fn sums8(v: &[__m256i; BLOCK_LANES]) -> __m256 {
        let lo = hsum4([v[0], v[1], v[2], v[3]]);
        let hi = hsum4([v[4], v[5], v[6], v[7]]);
        _mm256_cvtepi32_ps(_mm256_set_m128i(hi, lo))
    }

    /// The f32 terms of the `n` (1..=8) Q4_K/Q5_K super-blocks from `p` (activation quants `a`,
    /// sums `bs`, scales `ad` of the same blocks), super-block j's in lane j: the scalar
    /// formula `ad·(d·isum − dmin·msum)` lane by lane (each op rounded as it, no FMA). Lanes from
    /// `n` on are garbage and read nothing; the caller blends them away.
    #[inline(always)]
    unsafe fn terms_q45<const Q5: bool>(
        p: *const u8,
        a: *const i8,
        bs: *const i16,
        ad: *const f32,
        n: usize,
        mask: __m256i,
    ) -> __m256 {
        let bb = if Q5 { 176 } else { 144 };
        let mut isums = [_mm256_setzero_si256(); BLOCK_LANES];
        let mut msums = [_mm_setzero_si128(); BLOCK_LANES];
        // d and dmin of each super-block as one u32 (f16 d in the low half).
        let mut dd = [0u32; BLOCK_LANES];
        for j in 0..n {
            let blk = p.add(j * bb);
            prefetch_ahead(blk, bb);
            let (sc, mins) = scales_mins(&*(blk.add(4) as *const [u8; 12]));
            let (qs, qh) = if Q5 {
                (blk.add(48), Some(blk.add(16)))
            } else {
                (blk.add(16), None)
            };
            let scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(
                u64::from_le_bytes(sc) as i64,
            )));
            isums[j] = isum_q45(qs, qh, a.add(j * QK_K), scv);
            msums[j] = msum_q45(u64::from_le_bytes(mins), bs.add(16 * j));
            dd[j] = (blk as *const u32).read_unaligned();
        }
        let isum = sums8(&isums);
        let msum = _mm256_cvtepi32_ps(_mm256_set_m128i(hsum4x4(&msums, 4), hsum4x4(&msums, 0)));
        // [d0..d7 | dmin0..dmin7] as u16: packus gives [d0..3, dmin0..3 | d4..7, dmin4..7].
        let g = _mm256_loadu_si256(dd.as_ptr() as *const __m256i);
        let pk = _mm256_packus_epi32(
            _mm256_and_si256(g, _mm256_set1_epi32(0xFFFF)),
            _mm256_srli_epi32::<16>(g),
        );
        let pk = _mm256_permute4x64_epi64::<0b11_01_10_00>(pk);
        let d = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
        let dmin = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(pk));
        let adv = _mm256_maskload_ps(ad, mask);
        _mm256_mul_ps(
            adv,
            _mm256_sub_ps(_mm256_mul_ps(d, isum), _mm256_mul_ps(dmin, msum)),
        )
    }

    /// [`terms_q45`] for Q6_K: `d·ad·isum` lane by lane.
    #[inline(always)]
    unsafe fn terms_q6(
        p: *const u8,
        a: *const i8,
        bs: *const i16,
        ad: *const f32,
        n: usize,
        mask: __m256i,
    ) -> __m256 {
        const BB: usize = 210;
        let mut isums = [_mm256_setzero_si256(); BLOCK_LANES];
        let mut dh = [0u16; BLOCK_LANES];
        for j in 0..n {
            let blk = p.add(j * BB);
            prefetch_ahead(blk, BB);
            isums[j] = isum_q6(blk, a.add(j * QK_K), bs.add(16 * j));
            dh[j] = (blk.add(208) as *const u16).read_unaligned();
        }
        let isum = sums8(&isums);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(dh.as_ptr() as *const __m128i));
        let adv = _mm256_maskload_ps(ad, mask);
        _mm256_mul_ps(_mm256_mul_ps(d, adv), isum)
    }

    /// One K-quant weight row unpacked once for M > 1, so the per-activation-row loop
    /// ([`Unpacked::dot`]) is one `vpmaddubsw` and one `vpmaddwd` per 32 quants: `u` holds the
    /// quants as unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, i.e. Q6_K's without its
    /// −32), `sv` for every 32 quants the 16 i16 scale lanes `vpmaddwd` takes (one 32-element
    /// sub-block's scale, or Q6_K's two 16-element groups' scales eight lanes each), `sc` Q6_K's
    /// 16 scales per super-block (for `−32·Σ sc·bsum`), `mins` Q4_K/Q5_K's eight mins, `d` and
    /// `dmin` widened (exact). The integer sums equal [`row_dot`]'s, so the bits do too.
    #[derive(Default)]
    pub(in super::super) struct Unpacked {
        ty: Option<GgmlType>,
        nb: usize,
        u: Vec<u8>,
        sv: Vec<i16>,
        sc: Vec<i32>,
        mins: Vec<i32>,
        d: Vec<f32>,
        dmin: Vec<f32>,
    }

    impl Unpacked {
        /// Unpack weight row `src` (whole super-blocks of a K-quant `ty`); false (nothing to
        /// dot) for another type or a row that is not whole super-blocks.
        pub(in super::super) fn unpack(&mut self, ty: GgmlType, src: &[u8]) -> bool {
            let bb = ty.block_bytes();
            if !super::TYPES.contains(&ty) || src.len() % bb != 0 {
                self.ty = None;
                return false;
            }
            let nb = src.len() / bb;
            self.ty = Some(ty);
            self.nb = nb;
            self.u.resize(nb * QK_K, 0);
            self.sv.resize(nb * 8 * 16, 0);
            self.d.resize(nb, 0.0);
            let q6 = ty == GgmlType::Q6K;
            self.sc.resize(if q6 { nb * 16 } else { 0 }, 0);
            self.mins.resize(if q6 { 0 } else { nb * 8 }, 0);
            self.dmin.resize(if q6 { 0 } else { nb }, 0.0);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let u = &mut self.u[b * QK_K..(b + 1) * QK_K];
                let sv = &mut self.sv[b * 128..(b + 1) * 128];
                if q6 {
                    self.d[b] = f16_at(blk, 208);
                    for n in 0..2 {
                        let (ql, qh) =
                            (&blk[64 * n..64 * n + 64], &blk[128 + 32 * n..160 + 32 * n]);
                        let u = &mut u[128 * n..128 * n + 128];
                        for l in 0..32 {
                            u[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                            u[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                            u[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                            u[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                        }
                    }
                    for g in 0..16 {
                        let s = blk[192 + g] as i8 as i32;
                        self.sc[16 * b + g] = s;
                        sv[8 * g..8 * g + 8].fill(s as i16);
                    }
                } else {
                    self.d[b] = f16_at(blk, 0);
                    self.dmin[b] = f16_at(blk, 2);
                    let Ok(packed) = <&[u8; 12]>::try_from(&blk[4..16]) else {
                        self.ty = None;
                        return false;
                    };
                    let (sc, mins) = scales_mins(packed);
                    let (qs, qh) = if ty == GgmlType::Q5K {
                        (&blk[48..176], Some(&blk[16..48]))
                    } else {
                        (&blk[16..144], None)
                    };
                    for c in 0..4 {
                        for l in 0..32 {
                            let q = qs[32 * c + l];
                            let (h0, h1) = match qh {
                                Some(h) => (
                                    ((h[l] >> (2 * c)) & 1) << 4,
                                    ((h[l] >> (2 * c + 1)) & 1) << 4,
                                ),
                                None => (0, 0),
                            };
                            u[64 * c + l] = (q & 0xF) | h0;
                            u[64 * c + 32 + l] = (q >> 4) | h1;
                        }
                    }
                    for j in 0..8 {
                        sv[16 * j..16 * j + 16].fill(sc[j] as i16);
                        self.mins[8 * b + j] = mins[j] as i32;
                    }
                }
            }
            true
        }

        /// The unpacked row · activation row `row` of `act` (Q8_K), in the canonical order;
        /// `None` if nothing is unpacked or the row's K differs.
        ///
        /// # Safety
        /// The CPU must have AVX2 and F16C.
        #[target_feature(enable = "avx2,f16c")]
        #[inline(never)]
        pub(in super::super) unsafe fn dot(
            &self,
            act: &Activations<'_>,
            row: usize,
        ) -> Option<f32> {
            let ty = self.ty?;
            let (k, nb) = (act.k, self.nb);
            if k != nb * QK_K {
                return None;
            }
            let aq = act.qs.get(row * k..row * k + k)?;
            let ad = act.d.get(row * nb..row * nb + nb)?;
            let bsums = act.bsums.get(row * nb * 16..(row + 1) * nb * 16)?;
            let (pu, pa, ps) = (self.u.as_ptr(), aq.as_ptr(), self.sv.as_ptr());
            let mut acc = [0.0f32; BLOCK_LANES];
            for b in 0..nb {
                // SAFETY: b < nb: the super-block's 256 quants and 128 scale lanes lie inside
                // `u`, `sv` (sized by `unpack`) and `aq` (checked above); AVX2 is promised.
                let mut v = _mm256_setzero_si256();
                for c in 0..8 {
                    let o = b * QK_K + 32 * c;
                    let p = _mm256_maddubs_epi16(load(pu.add(o)), load(pa.add(o) as *const u8));
                    let s = _mm256_loadu_si256(ps.add(b * 128 + 16 * c) as *const __m256i);
                    v = _mm256_add_epi32(v, _mm256_madd_epi16(p, s));
                }
                let isum = hsum_i32(v);
                let bs = &bsums[16 * b..16 * b + 16];
                acc[b % BLOCK_LANES] += if ty == GgmlType::Q6K {
                    // The −32 of every quant, exactly: Σ_g sc_g · 32 · bsum_g.
                    let sc = &self.sc[16 * b..16 * b + 16];
                    let mut corr = 0i32;
                    for g in 0..16 {
                        corr += sc[g] * bs[g] as i32;
                    }
                    self.d[b] * ad[b] * (isum - 32 * corr) as f32
                } else {
                    let mins = &self.mins[8 * b..8 * b + 8];
                    let mut msum = 0i32;
                    for j in 0..8 {
                        msum += mins[j] * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
                    }
                    ad[b] * (self.d[b] * isum as f32 - self.dmin[b] * msum as f32)
                };
            }
            Some(reduce_lanes(&acc))
        }
    }

    /// Activation row `row` of `act` (Q8_K) · the weight row `src` (whole super-blocks of a
    /// K-quant `ty`), in the canonical order; `None` for another type or lengths that are not
    /// whole super-blocks (the unpacked path takes those).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    #[inline(never)]
    pub(in super::super) unsafe fn row_dot(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        // SAFETY: AVX2 and F16C are the caller's promise.
        unsafe { row_dot_in(ty, src, act, row) }
    }

    /// `ct[j]` = weight row `n0 + j` of `data` (rows of `row_bytes`) · activation row 0, for
    /// every j but `skip`: decode's row loop inside one AVX2 function (see
    /// `fused::x86::rows_m1`). False (nothing written) if a row is not whole super-blocks.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(in super::super) unsafe fn rows_m1(
        ty: GgmlType,
        data: &[u8],
        row_bytes: usize,
        act: &Activations<'_>,
        n0: usize,
        ct: &mut [f32],
        skip: Option<usize>,
    ) -> bool {
        let k = act.k;
        if k % QK_K != 0 || row_bytes != k / QK_K * ty.block_bytes() {
            return false;
        }
        if data.len() < (n0 + ct.len()) * row_bytes || !super::TYPES.contains(&ty) {
            return false;
        }
        for (j, o) in ct.iter_mut().enumerate() {
            let n = n0 + j;
            if skip == Some(n) {
                continue;
            }
            // SAFETY: AVX2 and F16C are the caller's promise; the lengths are checked above.
            match unsafe { row_dot_in(ty, &data[n * row_bytes..(n + 1) * row_bytes], act, 0) } {
                Some(v) => *o = v,
                None => return false,
            }
        }
        true
    }

    /// [`row_dot`]'s body, inlined into both callers.
    #[inline(always)]
    unsafe fn row_dot_in(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        let k = act.k;
        let nb = k / QK_K;
        let bb = ty.block_bytes();
        if k % QK_K != 0 || src.len() != nb * bb || !super::TYPES.contains(&ty) {
            return None;
        }
        let aq = act.qs.get(row * k..row * k + k)?;
        let ad = act.d.get(row * nb..row * nb + nb)?;
        let bsums = act.bsums.get(row * nb * 16..(row + 1) * nb * 16)?;
        let (ps, pa, pb, pd) = (src.as_ptr(), aq.as_ptr(), bsums.as_ptr(), ad.as_ptr());
        // Eight super-blocks per step, super-block i + j's term into lane j (accumulator j of
        // the canonical order), the tail's into lanes 0.. blended ([`add_tail`]): `sum_blocks`'
        // order, with one reduction of eight integer sums instead of eight.
        // SAFETY (every step): i + n <= nb, so the n blocks' bytes and their activation quants,
        // sums and scales lie inside `src`, `aq`, `bsums` and `ad` (lengths checked above); AVX2
        // and F16C are the caller's promise. Loops, not closures: a closure would not inherit
        // this function's AVX2.
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < nb {
            let n = (nb - i).min(BLOCK_LANES);
            let mask = tail_mask(n);
            let (p, a, s, d) = (ps.add(i * bb), pa.add(i * QK_K), pb.add(16 * i), pd.add(i));
            let t = match ty {
                GgmlType::Q6K => terms_q6(p, a, s, d, n, mask),
                GgmlType::Q5K => terms_q45::<true>(p, a, s, d, n, mask),
                _ => terms_q45::<false>(p, a, s, d, n, mask),
            };
            acc = if n == BLOCK_LANES {
                _mm256_add_ps(acc, t)
            } else {
                add_tail(acc, t, mask)
            };
            i += n;
        }
        Some(reduce8(acc))
    }
}

/// aarch64: the same super-block sums with NEON, as llama.cpp's `ggml_vec_dot_q*_K_q8_K` NEON
/// code forms them — with `sdot` ([`row_dot_sdot`], A55/A76) or with `smull`/`sadalp`
/// widening multiplies ([`row_dot_neon`], A53/A72). Only the instruction that multiplies 16
/// weight bytes by 16 activation bytes differs ([`Dot`]); both keep every integer sum exact, so
/// `isum`/`msum` are the tile path's and the f32 terms, formed as `fast.rs` forms them, are added
/// to accumulator `b % 8` as `x86::row_dot` adds them.
#[cfg(target_arch = "aarch64")]
pub(super) mod neon {
    use super::super::kernels::sdot;
    use super::{reduce_lanes, scales_mins, Activations, GgmlType, BLOCK_LANES, QK_K};
    use std::arch::aarch64::*;

    /// The two f16 at `at` and `at + 2` of `b` (Q4_K/Q5_K's d and dmin; Q6_K's d and 0)
    /// widened by one `fcvtl`, as `fused.rs`'s NEON blocks widen theirs: exact, the values of
    /// `f16_bits_to_f32` for every f16 but a signalling NaN (quieted here; the result is NaN
    /// either way), in 4 instructions where the integer widening takes about 12 per scale.
    #[inline(always)]
    pub(super) fn f16x2_at(b: &[u8], at: usize) -> (f32, f32) {
        let lo = u16::from_le_bytes([b[at], b[at + 1]]) as u64;
        let hi = b
            .get(at + 2..at + 4)
            .map_or(0, |h| u16::from_le_bytes([h[0], h[1]]) as u64);
        let out: float32x4_t;
        // SAFETY: FCVTL (half to single) is baseline Advanced SIMD; registers only.
        unsafe {
            std::arch::asm!(
                "fcvtl {o:v}.4s, {i:v}.4h",
                o = out(vreg) out,
                i = in(vreg) vcreate_u16(lo | hi << 16),
                options(pure, nomem, nostack, preserves_flags)
            );
            (vgetq_lane_f32::<0>(out), vgetq_lane_f32::<1>(out))
        }
    }

    /// `acc` plus the 16 products of one weight and one activation register, in four i32
    /// partial sums (which products go to which lane differs between the implementations, their
    /// total does not: integer sums are exact in any order). Exact for every i8 pair.
    trait Dot {
        /// # Safety
        /// Whatever the implementation's instructions need (`Sdot`: dotprod).
        unsafe fn dot16(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t;
    }

    /// Without dotprod (A72, A53): `smull`/`smull2` (an i8·i8 product fits i16: |−128·−128| =
    /// 2¹⁴) and `sadalp` pairwise into the i32 lanes (four products per lane).
    struct Neon;

    impl Dot for Neon {
        #[inline(always)]
        unsafe fn dot16(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
            let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
            let hi = vmull_high_s8(w, a);
            vpadalq_s16(vpadalq_s16(acc, lo), hi)
        }
    }

    /// `sdot` (the `asm!` of `kernels`), only ever inlined into [`row_dot_sdot`], which enables
    /// dotprod.
    struct Sdot;

    impl Dot for Sdot {
        #[inline(always)]
        unsafe fn dot16(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
            sdot(acc, w, a)
        }
    }

    /// Four groups' partial sums to their four integer dots, lane j = group j (two levels of
    /// pairwise adds, exact).
    #[inline(always)]
    unsafe fn sums4(p0: int32x4_t, p1: int32x4_t, p2: int32x4_t, p3: int32x4_t) -> int32x4_t {
        vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3))
    }

    /// Σ_j sc_j · (q·a over sub-block j) for the eight 32-element sub-blocks of a Q4_K
    /// (`Q5` false) or Q5_K super-block: `qs` its 128 nibble bytes, `qh` its 32 fifth-bit bytes
    /// (Q5_K only), `a` the 256 activation quants, `sc` the eight 6-bit scales. Bounds: q ≤ 31,
    /// |a| ≤ 128, so a sub-block's dot is at most 32·31·128 < 2¹⁷ (each lane of its partial sums
    /// less), times sc ≤ 63 < 2²³, and the eight together < 2²⁶: every i32 step is exact.
    #[inline(always)]
    unsafe fn isum_q45<D: Dot, const Q5: bool>(
        qs: *const u8,
        qh: *const u8,
        a: *const i8,
        sc: &[u8; 8],
    ) -> i32 {
        let m4 = vdupq_n_u8(0x0F);
        let (one, two) = (vdupq_n_u8(1), vdupq_n_u8(2));
        let zero = vdupq_n_s32(0);
        // Byte l of qh: bit 2c is element 64c + l's fifth bit, bit 2c + 1 element 64c + 32 + l's
        // (l in 0..32, two registers); shifted right by two after each c.
        let mut h = if Q5 {
            [vld1q_u8(qh), vld1q_u8(qh.add(16))]
        } else {
            [vdupq_n_u8(0); 2]
        };
        let mut dots = [zero; 8];
        for c in 0..4 {
            let q = [vld1q_u8(qs.add(32 * c)), vld1q_u8(qs.add(32 * c + 16))];
            let mut lo = [vandq_u8(q[0], m4), vandq_u8(q[1], m4)];
            let mut hi = [vshrq_n_u8::<4>(q[0]), vshrq_n_u8::<4>(q[1])];
            if Q5 {
                for i in 0..2 {
                    lo[i] = vorrq_u8(lo[i], vshlq_n_u8::<4>(vandq_u8(h[i], one)));
                    hi[i] = vorrq_u8(hi[i], vshlq_n_u8::<3>(vandq_u8(h[i], two)));
                    h[i] = vshrq_n_u8::<2>(h[i]);
                }
            }
            // Sub-block 2c: elements 64c..64c + 32 (the low nibbles), 2c + 1: the next 32.
            let p = a.add(64 * c);
            let s8 = vreinterpretq_s8_u8;
            dots[2 * c] = D::dot16(
                D::dot16(zero, s8(lo[0]), vld1q_s8(p)),
                s8(lo[1]),
                vld1q_s8(p.add(16)),
            );
            dots[2 * c + 1] = D::dot16(
                D::dot16(zero, s8(hi[0]), vld1q_s8(p.add(32))),
                s8(hi[1]),
                vld1q_s8(p.add(48)),
            );
        }
        let d03 = sums4(dots[0], dots[1], dots[2], dots[3]);
        let d47 = sums4(dots[4], dots[5], dots[6], dots[7]);
        // The scales widened to i32 (exact), lane j sub-block j's (4 + j's).
        let s = vmovl_u8(vld1_u8(sc.as_ptr()));
        let s03 = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(s)));
        let s47 = vreinterpretq_s32_u32(vmovl_high_u16(s));
        vaddvq_s32(vmlaq_s32(vmulq_s32(d03, s03), d47, s47))
    }

    /// Σ_j min_j · (bsum_2j + bsum_2j+1) of a Q4_K/Q5_K super-block (`bs` its 16 Q8_K bsums).
    /// |bsum| ≤ 16·128, a pair ≤ 2¹² (fits the i16 lane of `addp`), min ≤ 63: < 2²¹. Exact.
    #[inline(always)]
    unsafe fn msum_q45(bs: *const i16, mins: &[u8; 8]) -> i32 {
        let pairs = vpaddq_s16(vld1q_s16(bs), vld1q_s16(bs.add(8)));
        let m = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mins.as_ptr())));
        let p = vmlal_high_s16(vmull_s16(vget_low_s16(pairs), vget_low_s16(m)), pairs, m);
        vaddvq_s32(p)
    }

    /// Σ_g sc_g · (q·a over the 16-element group g) of a Q6_K super-block (`b` its 210 bytes,
    /// `bs` the 16 Q8_K bsums), quants q in −32..=31 as (unsigned 6-bit u) − 32, as llama.cpp
    /// forms it: Σ sc·(u·a) − 32·Σ sc·bsum. Bounds: u ≤ 63, |a| ≤ 128, |sc| ≤ 128, so a group's
    /// u·a is at most 16·63·128 < 2¹⁷, times sc < 2²⁴, the sixteen < 2²⁸; Σ sc·bsum ≤
    /// 16·128·2048 = 2²², times 32 = 2²⁷; the difference (the signed sum, < 2²⁷) and every step
    /// fit i32: exact.
    #[inline(always)]
    unsafe fn isum_q6<D: Dot>(b: *const u8, a: *const i8, bs: *const i16) -> i32 {
        let m4 = vdupq_n_u8(0x0F);
        let m3 = vdupq_n_u8(0x03);
        let m30 = vdupq_n_u8(0x30);
        let zero = vdupq_n_s32(0);
        let s8 = vreinterpretq_s8_u8;
        let mut dots = [zero; 16];
        for n in 0..2 {
            let ql = b.add(64 * n);
            let qh = b.add(128 + 32 * n);
            let l = [
                vld1q_u8(ql),
                vld1q_u8(ql.add(16)),
                vld1q_u8(ql.add(32)),
                vld1q_u8(ql.add(48)),
            ];
            for i in 0..2 {
                // Bytes 16i..16i + 16 of this half's ql/qh; quarter j's quants are elements
                // 128n + 32j + 16i + (0..16), group 8n + 2j + i: ql's nibble, qh's bits 2j, 2j + 1
                // as bits 4 and 5.
                let h = vld1q_u8(qh.add(16 * i));
                let u = [
                    vorrq_u8(vandq_u8(l[i], m4), vshlq_n_u8::<4>(vandq_u8(h, m3))),
                    vorrq_u8(vandq_u8(l[2 + i], m4), vandq_u8(vshlq_n_u8::<2>(h), m30)),
                    vorrq_u8(vshrq_n_u8::<4>(l[i]), vandq_u8(h, m30)),
                    vorrq_u8(vshrq_n_u8::<4>(l[2 + i]), vandq_u8(vshrq_n_u8::<2>(h), m30)),
                ];
                for (j, u) in u.into_iter().enumerate() {
                    let av = vld1q_s8(a.add(128 * n + 32 * j + 16 * i));
                    dots[8 * n + 2 * j + i] = D::dot16(zero, s8(u), av);
                }
            }
        }
        // The signed scales widened (exact): s16[h] groups 8h..8h + 8, s32[q] groups 4q..4q + 4.
        let sc = vld1q_s8(b.add(192) as *const i8);
        let s16 = [vmovl_s8(vget_low_s8(sc)), vmovl_high_s8(sc)];
        let s32 = [
            vmovl_s16(vget_low_s16(s16[0])),
            vmovl_high_s16(s16[0]),
            vmovl_s16(vget_low_s16(s16[1])),
            vmovl_high_s16(s16[1]),
        ];
        let mut acc = vdupq_n_s32(0);
        for (d, s) in dots.chunks_exact(4).zip(s32) {
            acc = vmlaq_s32(acc, sums4(d[0], d[1], d[2], d[3]), s);
        }
        // The −32 of every quant: Σ_g sc_g · bsum_g.
        let (b0, b1) = (vld1q_s16(bs), vld1q_s16(bs.add(8)));
        let m = vmull_s16(vget_low_s16(b0), vget_low_s16(s16[0]));
        let m = vmlal_high_s16(m, b0, s16[0]);
        let m = vmlal_s16(m, vget_low_s16(b1), vget_low_s16(s16[1]));
        let m = vmlal_high_s16(m, b1, s16[1]);
        vaddvq_s32(acc) - 32 * vaddvq_s32(m)
    }

    /// The Q4_K (`Q5` false) or Q5_K super-blocks' terms, `ad·(d·isum − dmin·msum)` as `fast.rs`
    /// forms them, added to `acc[b % 8]` in increasing b.
    ///
    /// # Safety
    /// `D`'s features; `src` holds `nb` super-blocks of `bb` bytes, `aq` nb·256 quants, `ad` nb
    /// scales, `bsums` nb·16 sums.
    #[inline(always)]
    unsafe fn terms_q45<D: Dot, const Q5: bool>(
        src: &[u8],
        bb: usize,
        aq: &[i8],
        ad: &[f32],
        bsums: &[i16],
        acc: &mut [f32; BLOCK_LANES],
    ) {
        let (ps, pa, pb) = (src.as_ptr(), aq.as_ptr(), bsums.as_ptr());
        for (b, blk) in src.chunks_exact(bb).enumerate().take(ad.len()) {
            let Ok(packed) = <&[u8; 12]>::try_from(&blk[4..16]) else {
                continue; // unreachable: a super-block is at least 144 bytes
            };
            let (sc, mins) = scales_mins(packed);
            let p = ps.add(b * bb);
            let (qs, qh) = if Q5 {
                (p.add(48), p.add(16))
            } else {
                (p.add(16), p)
            };
            let isum = isum_q45::<D, Q5>(qs, qh, pa.add(b * QK_K), &sc);
            let msum = msum_q45(pb.add(16 * b), &mins);
            let (d, dmin) = f16x2_at(blk, 0);
            acc[b % BLOCK_LANES] += ad[b] * (d * isum as f32 - dmin * msum as f32);
        }
    }

    /// Activation row `row` of `act` (Q8_K) · weight row `src` (whole super-blocks of a K-quant
    /// `ty`) in the canonical order; `None` for another type or lengths that are not whole
    /// super-blocks.
    ///
    /// # Safety
    /// `D`'s features.
    #[inline(always)]
    unsafe fn row_dot<D: Dot>(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        let k = act.k;
        let nb = k / QK_K;
        let bb = ty.block_bytes();
        if k % QK_K != 0 || src.len() != nb * bb || !super::TYPES.contains(&ty) {
            return None;
        }
        let aq = act.qs.get(row * k..row * k + k)?;
        let ad = act.d.get(row * nb..row * nb + nb)?;
        let bsums = act.bsums.get(row * nb * 16..(row + 1) * nb * 16)?;
        // SAFETY (every super-block below): b < nb, so its bb bytes, its 256 activation quants
        // and its 16 bsums lie inside `src`, `aq` and `bsums` (lengths checked above).
        let mut acc = [0.0f32; BLOCK_LANES];
        // Loops and `#[inline(always)]` fns, not closures: a closure would not inherit
        // `row_dot_sdot`'s dotprod, and `sdot` would not assemble in it.
        match ty {
            GgmlType::Q6K => {
                let (ps, pa, pb) = (src.as_ptr(), aq.as_ptr(), bsums.as_ptr());
                for b in 0..nb {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let isum = isum_q6::<D>(ps.add(b * bb), pa.add(b * QK_K), pb.add(16 * b));
                    let (d, _) = f16x2_at(blk, 208);
                    acc[b % BLOCK_LANES] += d * ad[b] * isum as f32;
                }
            }
            GgmlType::Q5K => terms_q45::<D, true>(src, bb, aq, ad, bsums, &mut acc),
            _ => terms_q45::<D, false>(src, bb, aq, ad, bsums, &mut acc),
        }
        Some(reduce_lanes(&acc))
    }

    /// One K-quant weight row unpacked once for M > 1 (x86's `kquant::x86::Unpacked` on NEON),
    /// so the per-activation-row loop ([`Unpacked::dot`]) is loads, `sdot` (or `smull`/`sadalp`)
    /// and the reductions of [`isum_q45`]/[`isum_q6`], with no nibble, high-bit, scale or f16 work:
    /// `q` holds each super-block's 256 quants in element order as the bytes those take (Q4_K
    /// 0..15, Q5_K 0..31, Q6_K 0..63, i.e. without its −32, folded in through the bsums as
    /// decode does), `sc` the scales widened to i32 (Q4_K/Q5_K eight, Q6_K sixteen), `m16` the
    /// i16 the bsums term multiplies (Q4_K/Q5_K the eight mins, Q6_K the sixteen scales), `d` and
    /// `dmin` widened by [`f16x2_at`]. The integer sums are decode's, exactly, and the f32 terms
    /// the same operations in the same order, so the bits are [`row_dot`]'s. Per thread, at most
    /// 256 + 64 + 32 + 4 bytes per super-block of K (Q6_K; K = 8192: 11 KiB), reused for every
    /// row of the call.
    #[derive(Default)]
    pub(in super::super) struct Unpacked {
        ty: Option<GgmlType>,
        nb: usize,
        q: Vec<u8>,
        sc: Vec<i32>,
        m16: Vec<i16>,
        d: Vec<f32>,
        dmin: Vec<f32>,
    }

    impl Unpacked {
        /// Unpack weight row `src` (whole super-blocks of a K-quant `ty`); false (and nothing to
        /// dot) for another type or a row that is not whole super-blocks.
        pub(in super::super) fn unpack(&mut self, ty: GgmlType, src: &[u8]) -> bool {
            let bb = ty.block_bytes();
            if !super::TYPES.contains(&ty) || src.len() % bb != 0 {
                self.ty = None;
                return false;
            }
            let nb = src.len() / bb;
            let q6 = ty == GgmlType::Q6K;
            let per = if q6 { 16 } else { 8 };
            self.ty = Some(ty);
            self.nb = nb;
            self.q.resize(nb * QK_K, 0);
            self.sc.resize(nb * per, 0);
            self.m16.resize(nb * per, 0);
            self.d.resize(nb, 0.0);
            self.dmin.resize(if q6 { 0 } else { nb }, 0.0);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                // SAFETY: `blk` is one whole super-block and `q` holds 256 bytes at 256·b (sized
                // above); NEON is baseline.
                unsafe {
                    let out = self.q.as_mut_ptr().add(b * QK_K);
                    match ty {
                        GgmlType::Q6K => quants_q6(blk.as_ptr(), out),
                        GgmlType::Q5K => {
                            quants_q45::<true>(blk.as_ptr().add(48), blk.as_ptr().add(16), out)
                        }
                        _ => quants_q45::<false>(blk.as_ptr().add(16), blk.as_ptr(), out),
                    }
                }
                if q6 {
                    self.d[b] = f16x2_at(blk, 208).0;
                    for g in 0..16 {
                        let s = blk[192 + g] as i8;
                        self.sc[16 * b + g] = s as i32;
                        self.m16[16 * b + g] = s as i16;
                    }
                } else {
                    (self.d[b], self.dmin[b]) = f16x2_at(blk, 0);
                    let Ok(packed) = <&[u8; 12]>::try_from(&blk[4..16]) else {
                        self.ty = None;
                        return false;
                    };
                    let (sc, mins) = scales_mins(packed);
                    for j in 0..8 {
                        self.sc[8 * b + j] = sc[j] as i32;
                        self.m16[8 * b + j] = mins[j] as i16;
                    }
                }
            }
            true
        }

        /// The unpacked row · activation row `row` of `act` (Q8_K), in the canonical order;
        /// `None` if nothing is unpacked or the row's K differs.
        ///
        /// # Safety
        /// `D`'s features (`Sdot`: dotprod).
        #[inline(always)]
        unsafe fn dot<D: Dot>(&self, act: &Activations<'_>, row: usize) -> Option<f32> {
            let ty = self.ty?;
            let (k, nb) = (act.k, self.nb);
            if k != nb * QK_K {
                return None;
            }
            let aq = act.qs.get(row * k..row * k + k)?;
            let ad = act.d.get(row * nb..row * nb + nb)?;
            let bsums = act.bsums.get(row * nb * 16..(row + 1) * nb * 16)?;
            let (pq, pa, pb) = (self.q.as_ptr(), aq.as_ptr(), bsums.as_ptr());
            let (psc, pm) = (self.sc.as_ptr(), self.m16.as_ptr());
            let zero = vdupq_n_s32(0);
            let mut acc = [0.0f32; BLOCK_LANES];
            // SAFETY (every super-block below): b < nb, so its 256 quants, its scales and its
            // activation quants and bsums lie inside `q`, `sc`, `m16` (sized by `unpack`), `aq`
            // and `bsums` (checked above). Loops, not closures (see `row_dot`).
            if ty == GgmlType::Q6K {
                for b in 0..nb {
                    let (q, a) = (pq.add(b * QK_K), pa.add(b * QK_K));
                    // Group g: elements 16g..16g + 16, one register of each; the bounds of
                    // `isum_q6`.
                    let mut s = zero;
                    for g4 in 0..4 {
                        let mut p = [zero; 4];
                        for (j, p) in p.iter_mut().enumerate() {
                            let o = 16 * (4 * g4 + j);
                            *p = D::dot16(
                                zero,
                                vreinterpretq_s8_u8(vld1q_u8(q.add(o))),
                                vld1q_s8(a.add(o)),
                            );
                        }
                        let d = sums4(p[0], p[1], p[2], p[3]);
                        s = vmlaq_s32(s, d, vld1q_s32(psc.add(16 * b + 4 * g4)));
                    }
                    let (b0, b1) = (vld1q_s16(pb.add(16 * b)), vld1q_s16(pb.add(16 * b + 8)));
                    let (s0, s1) = (vld1q_s16(pm.add(16 * b)), vld1q_s16(pm.add(16 * b + 8)));
                    let m = vmull_s16(vget_low_s16(b0), vget_low_s16(s0));
                    let m = vmlal_high_s16(m, b0, s0);
                    let m = vmlal_s16(m, vget_low_s16(b1), vget_low_s16(s1));
                    let m = vmlal_high_s16(m, b1, s1);
                    let isum = vaddvq_s32(s) - 32 * vaddvq_s32(m);
                    acc[b % BLOCK_LANES] += self.d[b] * ad[b] * isum as f32;
                }
            } else {
                for b in 0..nb {
                    let (q, a) = (pq.add(b * QK_K), pa.add(b * QK_K));
                    // Sub-block j: elements 32j..32j + 32, two registers of each; the bounds of
                    // `isum_q45`.
                    let mut s = zero;
                    for h in 0..2 {
                        let mut p = [zero; 4];
                        for (j, p) in p.iter_mut().enumerate() {
                            let o = 32 * (4 * h + j);
                            let w0 = vreinterpretq_s8_u8(vld1q_u8(q.add(o)));
                            let w1 = vreinterpretq_s8_u8(vld1q_u8(q.add(o + 16)));
                            *p = D::dot16(
                                D::dot16(zero, w0, vld1q_s8(a.add(o))),
                                w1,
                                vld1q_s8(a.add(o + 16)),
                            );
                        }
                        let d = sums4(p[0], p[1], p[2], p[3]);
                        s = vmlaq_s32(s, d, vld1q_s32(psc.add(8 * b + 4 * h)));
                    }
                    let isum = vaddvq_s32(s);
                    // Σ_j min_j · (bsum_2j + bsum_2j+1), as `msum_q45`.
                    let pairs =
                        vpaddq_s16(vld1q_s16(pb.add(16 * b)), vld1q_s16(pb.add(16 * b + 8)));
                    let mn = vld1q_s16(pm.add(8 * b));
                    let p =
                        vmlal_high_s16(vmull_s16(vget_low_s16(pairs), vget_low_s16(mn)), pairs, mn);
                    let msum = vaddvq_s32(p);
                    acc[b % BLOCK_LANES] +=
                        ad[b] * (self.d[b] * isum as f32 - self.dmin[b] * msum as f32);
                }
            }
            Some(reduce_lanes(&acc))
        }
    }

    /// [`Unpacked::dot`] with `sdot`.
    ///
    /// # Safety
    /// The CPU must have the dotprod extension.
    #[target_feature(enable = "dotprod")]
    #[inline(never)]
    pub(in super::super) unsafe fn unpacked_sdot(
        un: &Unpacked,
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        un.dot::<Sdot>(act, row)
    }

    /// [`Unpacked::dot`] with widening multiplies (A72, A53).
    #[inline(never)]
    pub(in super::super) fn unpacked_neon(
        un: &Unpacked,
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        // SAFETY: `Neon` needs nothing beyond baseline NEON.
        unsafe { un.dot::<Neon>(act, row) }
    }

    /// A Q4_K (`Q5` false) or Q5_K super-block's 256 quants in element order, to `out`, as
    /// [`isum_q45`] forms them (`qs` the 128 nibble bytes, `qh` the 32 fifth-bit bytes).
    ///
    /// # Safety
    /// `qs` (and `qh` for Q5_K) readable, `out` writable for 256 bytes.
    #[inline(always)]
    unsafe fn quants_q45<const Q5: bool>(qs: *const u8, qh: *const u8, out: *mut u8) {
        let m4 = vdupq_n_u8(0x0F);
        let (one, two) = (vdupq_n_u8(1), vdupq_n_u8(2));
        let mut h = if Q5 {
            [vld1q_u8(qh), vld1q_u8(qh.add(16))]
        } else {
            [vdupq_n_u8(0); 2]
        };
        for c in 0..4 {
            let q = [vld1q_u8(qs.add(32 * c)), vld1q_u8(qs.add(32 * c + 16))];
            for i in 0..2 {
                let mut lo = vandq_u8(q[i], m4);
                let mut hi = vshrq_n_u8::<4>(q[i]);
                if Q5 {
                    lo = vorrq_u8(lo, vshlq_n_u8::<4>(vandq_u8(h[i], one)));
                    hi = vorrq_u8(hi, vshlq_n_u8::<3>(vandq_u8(h[i], two)));
                    h[i] = vshrq_n_u8::<2>(h[i]);
                }
                vst1q_u8(out.add(64 * c + 16 * i), lo);
                vst1q_u8(out.add(64 * c + 32 + 16 * i), hi);
            }
        }
    }

    /// A Q6_K super-block's 256 unsigned 6-bit quants in element order, to `out`, as
    /// [`isum_q6`] forms them (`b` its 210 bytes).
    ///
    /// # Safety
    /// `b` readable for 192 bytes, `out` writable for 256.
    #[inline(always)]
    unsafe fn quants_q6(b: *const u8, out: *mut u8) {
        let m4 = vdupq_n_u8(0x0F);
        let m3 = vdupq_n_u8(0x03);
        let m30 = vdupq_n_u8(0x30);
        for n in 0..2 {
            let (ql, qh) = (b.add(64 * n), b.add(128 + 32 * n));
            for i in 0..2 {
                let (l0, l2) = (vld1q_u8(ql.add(16 * i)), vld1q_u8(ql.add(32 + 16 * i)));
                let h = vld1q_u8(qh.add(16 * i));
                let u = [
                    vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8::<4>(vandq_u8(h, m3))),
                    vorrq_u8(vandq_u8(l2, m4), vandq_u8(vshlq_n_u8::<2>(h), m30)),
                    vorrq_u8(vshrq_n_u8::<4>(l0), vandq_u8(h, m30)),
                    vorrq_u8(vshrq_n_u8::<4>(l2), vandq_u8(vshrq_n_u8::<2>(h), m30)),
                ];
                for (j, u) in u.into_iter().enumerate() {
                    vst1q_u8(out.add(128 * n + 32 * j + 16 * i), u);
                }
            }
        }
    }

    /// [`row_dot`] with `sdot` (A55, A76).
    ///
    /// # Safety
    /// The CPU must have the dotprod extension.
    #[target_feature(enable = "dotprod")]
    #[inline(never)]
    pub(in super::super) unsafe fn row_dot_sdot(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        row_dot::<Sdot>(ty, src, act, row)
    }

    /// [`row_dot`] with widening multiplies (A72, A53).
    #[inline(never)]
    pub(in super::super) fn row_dot_neon(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        // SAFETY: `Neon` needs nothing beyond baseline NEON.
        unsafe { row_dot::<Neon>(ty, src, act, row) }
    }
}

#[cfg(test)]
mod tests {

    /// Every super-block's `d` (and `dmin`) in `src`, every other one a subnormal f16, as Q6_K's
    /// super-block scales are in real files (d ≈ max|w| / 4064).
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn set_scales(ty: crate::quant::GgmlType, src: &mut [u8], next: &mut impl FnMut() -> u64) {
        use crate::quant::GgmlType;
        use half::f16;
        for (i, b) in src.chunks_exact_mut(ty.block_bytes()).enumerate() {
            let sub = i % 2 == 1;
            let scale = |x: u64, normal: f32| {
                if sub {
                    f16::from_bits(1 + (x % 0x3FF) as u16)
                } else {
                    f16::from_f32(normal)
                }
            };
            let d = scale(next(), 0.001 + (next() % 1000) as f32 * 1e-5).to_le_bytes();
            if ty == GgmlType::Q6K {
                b[208..210].copy_from_slice(&d);
            } else {
                b[..2].copy_from_slice(&d);
                let m = scale(next(), (next() % 1000) as f32 * 1e-5).to_le_bytes();
                b[2..4].copy_from_slice(&m);
            }
        }
    }
    use super::scales_mins;
    use crate::quant::get_scale_min_k4;

    /// The AVX2 super-block dots (decode's, off the packed bytes, and M > 1's, off a row
    /// unpacked once) against the unpacked tile path (`RowScratch`, the portable statement
    /// every other kernel shares), to the bit: each activation row of an M = 3 run, weights of
    /// every byte pattern (random quants, scales, mins and high bits; signed Q6_K scales down to
    /// −128), K of 9, 1 and 3 super-blocks (a group of eight and a tail, only a tail).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_super_block_dots_equal_the_unpacked_path() {
        use super::super::fast::{act_format, Activations, RowScratch};
        use super::super::kernels::Kernel;
        use crate::quant::{GgmlType, QK_K};
        if !super::available(Kernel::Portable, GgmlType::Q4K) {
            eprintln!("no AVX2/F16C here: nothing to compare");
            return;
        }
        let mut z = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z
        };
        for ty in super::TYPES {
            for nb in [9usize, 1, 3] {
                let k = nb * QK_K;
                let bb = ty.block_bytes();
                let mut src: Vec<u8> = (0..nb * bb).map(|_| next() as u8).collect();
                set_scales(ty, &mut src, &mut next);
                let a: Vec<f32> = (0..3 * k)
                    .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
                    .collect();
                let fmt = act_format(ty).expect("a fast-path type");
                let act = Activations::quantize(fmt, &a, k);
                let mut sc = RowScratch::default();
                sc.unpack(ty, &src);
                let mut un = super::x86::Unpacked::default();
                assert!(un.unpack(ty, &src), "{ty} K={k}: not unpacked");
                for row in 0..3 {
                    let want = sc.dot(Kernel::Portable, ty, &act, row);
                    // SAFETY: AVX2 and F16C were detected above.
                    let (fused, unpacked) =
                        unsafe { (super::x86::row_dot(ty, &src, &act, row), un.dot(&act, row)) };
                    for (path, got) in [("fused", fused), ("unpacked", unpacked)] {
                        assert_eq!(
                            got.map(f32::to_bits),
                            Some(want.to_bits()),
                            "{ty} K={k} row {row} ({path}): {got:?} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The K-quant unpack's f16 widening (`x86::f16_at`, in software without subnormal f32
    /// arithmetic) against `fast::f16_bits_to_f32`, for all 65,536 patterns, to the bit. (Decode
    /// widens with `vcvtph2ps`, exact by definition; the super-block test above draws subnormal
    /// scales for it.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_widening_equals_f16_bits_to_f32() {
        use super::super::fast::f16_bits_to_f32;
        for h in 0..=u16::MAX {
            let want = f16_bits_to_f32(h);
            let got = super::x86::f16_at(&h.to_le_bytes(), 0);
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}: {got} vs {want}");
        }
    }

    /// The NEON super-block dots (`smull`/`sadalp`, and `sdot` where the CPU has dotprod: the
    /// cortex-a76 stage), decode's off the packed bytes and M > 1's off a row unpacked once
    /// (`neon::Unpacked`), against the unpacked tile path (`RowScratch`, the portable statement every
    /// other kernel shares), to the bit: each activation row of an M = 3 run (the third all
    /// −1.0, so every quant is −127), weights of every byte pattern (random quants, scales, mins
    /// and high bits, signed Q6_K scales; the first super-block all ones: quants 15/31/63, scales
    /// and mins 63, Q6_K scales −128, the bounds the comments state), K of 9, 1 and 3
    /// super-blocks (a group of eight and a tail, only a tail).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_super_block_dots_equal_the_unpacked_path() {
        use super::super::fast::{act_format, Activations, RowScratch};
        use super::super::kernels::Kernel;
        use crate::quant::{GgmlType, QK_K};
        let sdot = std::arch::is_aarch64_feature_detected!("dotprod");
        if !sdot {
            eprintln!("no dotprod here: the sdot dots are not compared");
        }
        let mut z = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z
        };
        for ty in super::TYPES {
            for nb in [9usize, 1, 3] {
                let k = nb * QK_K;
                let bb = ty.block_bytes();
                let mut src: Vec<u8> = (0..nb * bb).map(|_| next() as u8).collect();
                src[..bb].fill(0xFF);
                if ty == GgmlType::Q6K {
                    src[192..208].fill(0x80);
                }
                set_scales(ty, &mut src, &mut next);
                let mut a: Vec<f32> = (0..2 * k)
                    .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
                    .collect();
                a.resize(3 * k, -1.0);
                let fmt = act_format(ty).expect("a fast-path type");
                let act = Activations::quantize(fmt, &a, k);
                let mut sc = RowScratch::default();
                sc.unpack(ty, &src);
                let mut un = super::neon::Unpacked::default();
                assert!(un.unpack(ty, &src), "{ty} K={k}: not unpacked");
                for row in 0..3 {
                    let want = sc.dot(Kernel::Portable, ty, &act, row);
                    let mut got = vec![
                        ("neon", super::neon::row_dot_neon(ty, &src, &act, row)),
                        ("neon unpacked", super::neon::unpacked_neon(&un, &act, row)),
                    ];
                    if sdot {
                        // SAFETY: dotprod was detected above.
                        let (v, u) = unsafe {
                            (
                                super::neon::row_dot_sdot(ty, &src, &act, row),
                                super::neon::unpacked_sdot(&un, &act, row),
                            )
                        };
                        got.push(("sdot", v));
                        got.push(("sdot unpacked", u));
                    }
                    for (kernel, got) in got {
                        assert_eq!(
                            got.map(f32::to_bits),
                            Some(want.to_bits()),
                            "{ty} {kernel} K={k} row {row}: {got:?} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The NEON dots' `fcvtl` widening of the super-block scales gives `f16_bits_to_f32`'s
    /// value (the unpacked path's) for every f16 bit pattern in both lanes, NaN for NaN; and a
    /// pair cut short at the end of the block (Q6_K's d, its last two bytes) reads 0.0 beside it.
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_scale_widening_equals_f16_bits_to_f32() {
        use super::super::fast::f16_bits_to_f32;
        for h in 0..=u16::MAX {
            let g = h.rotate_left(7) ^ 0x8000;
            let b = [h.to_le_bytes(), g.to_le_bytes()].concat();
            let (lo, hi) = super::neon::f16x2_at(&b, 0);
            for (got, bits) in [(lo, h), (hi, g)] {
                let want = f16_bits_to_f32(bits);
                if want.is_nan() {
                    assert!(got.is_nan(), "{bits:#06x}");
                } else {
                    assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
                }
            }
            let (d, rest) = super::neon::f16x2_at(&b[..2], 0);
            assert_eq!(d.to_bits(), lo.to_bits(), "{h:#06x}");
            assert_eq!(rest.to_bits(), 0, "{h:#06x}");
        }
    }

    /// The word-wise shuffle gives `get_scale_min_k4`'s values for every byte pattern of each
    /// position (all 256 values of each of the 12 bytes, the others random).
    #[test]
    fn scales_mins_equal_get_scale_min_k4() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for pos in 0..12 {
            for v in 0..=255u8 {
                let mut s = [0u8; 12];
                for b in s.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8;
                }
                s[pos] = v;
                let (sc, m) = scales_mins(&s);
                for j in 0..8 {
                    assert_eq!((sc[j], m[j]), get_scale_min_k4(j, &s), "{s:?} j={j}");
                }
            }
        }
    }
}
