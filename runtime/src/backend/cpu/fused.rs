//! Decode (M = 1) dots that read the packed weight bytes directly, as ggml's `vec_dot` does: each
//! block's nibbles (and 5th bits) are unpacked in registers and dotted with the activation block
//! at once, so a weight row is streamed from memory exactly once and never written back unpacked.
//!
//! Only the exact integer block dot differs between kernels ([`BlockDot`]); the block scales are
//! applied by one shared loop in the same order, with the same formula as the unpacked path in
//! `fast.rs`, so every kernel and both paths give bit-identical results.

use super::fast::{f16_bits_to_f32, Activations};
use super::kernels::{f32_lanes, reduce_lanes, Kernel, BLOCK_LANES, LANES};
use crate::backend::Weight;
use crate::quant::GgmlType;
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// The integer dot of one 32-element weight block, in its packed form, with an i8 activation
/// block. Implementations must be exact (no saturation), which makes them interchangeable.
pub(crate) trait BlockDot {
    /// ggml's 4-bit order: byte j holds element j (low nibble) and j + 16 (high), minus `bias`.
    fn q4(q: &[u8; 16], bias: i8, a: &[i8; 32]) -> i32;
    /// As `q4`, with element j's 5th bit at bit j of `qh`.
    fn q5(q: &[u8; 16], qh: u32, bias: i8, a: &[i8; 32]) -> i32;
    /// Q8_0 quants (i8 stored as bytes).
    fn q8(w: &[u8; 32], a: &[i8; 32]) -> i32;
}

/// Plain Rust on fixed-size arrays: LLVM unrolls and vectorises each block (pmaddwd on x86,
/// smull/sadalp on aarch64).
pub(crate) struct Portable;

#[inline(always)]
fn dot32(w: &[i8; 32], a: &[i8; 32]) -> i32 {
    let mut s = 0i32;
    for j in 0..32 {
        s += (w[j] as i16 * a[j] as i16) as i32;
    }
    s
}

impl BlockDot for Portable {
    #[inline(always)]
    fn q4(q: &[u8; 16], bias: i8, a: &[i8; 32]) -> i32 {
        let mut w = [0i8; 32];
        for j in 0..16 {
            w[j] = (q[j] & 0xF) as i8 - bias;
            w[j + 16] = (q[j] >> 4) as i8 - bias;
        }
        dot32(&w, a)
    }

    #[inline(always)]
    fn q5(q: &[u8; 16], qh: u32, bias: i8, a: &[i8; 32]) -> i32 {
        let h = qh.to_le_bytes();
        let mut w = [0i8; 32];
        for j in 0..16 {
            // Bit j of qh and bit j + 16, read from bytes so the shifts are constants per lane.
            let lo = (h[j / 8] >> (j % 8)) & 1;
            let hi = (h[2 + j / 8] >> (j % 8)) & 1;
            w[j] = ((q[j] & 0xF) | (lo << 4)) as i8 - bias;
            w[j + 16] = ((q[j] >> 4) | (hi << 4)) as i8 - bias;
        }
        dot32(&w, a)
    }

    #[inline(always)]
    fn q8(w: &[u8; 32], a: &[i8; 32]) -> i32 {
        dot32(&w.map(|x| x as i8), a)
    }
}

/// Whether [`rows`] takes M = 1 runs of this type with this kernel here: [`row_dot`]'s types
/// everywhere, and the K-quants where [`super::kquant`] has dots for `kernel` (x86 with AVX2;
/// aarch64 with `Neon` or `NeonSdot`); the rest go through the unpacked tile path.
pub(crate) fn supports(kernel: Kernel, ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0) || super::kquant::available(kernel, ty)
}

fn f16_le(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Fixed-size view of `b[at..at + N]` (the caller's block sizes guarantee the length).
#[inline(always)]
fn arr<const N: usize>(b: &[u8], at: usize) -> &[u8; N] {
    match b.get(at..at + N).and_then(|s| <&[u8; N]>::try_from(s).ok()) {
        Some(a) => a,
        // Unreachable: every caller passes whole ggml blocks.
        None => &[0; N],
    }
}

/// [`super::kernels::sum_blocks`] written out where it is used: `$term` (an expression of block index `$b`)
/// summed in the canonical order. A macro, not a closure, because a closure does not inherit the
/// `target_feature(dotprod)` of [`neon::row_dot_sdot`] and `sdot` would not assemble in it.
macro_rules! canonical_sum {
    ($nb:expr, |$b:ident| $term:expr) => {{
        let nb: usize = $nb;
        let mut acc = [0.0f32; BLOCK_LANES];
        let full = nb / BLOCK_LANES * BLOCK_LANES;
        let mut base = 0;
        while base < full {
            for (j, a) in acc.iter_mut().enumerate() {
                let $b = base + j;
                *a += $term;
            }
            base += BLOCK_LANES;
        }
        for (j, a) in acc.iter_mut().enumerate().take(nb - full) {
            let $b = full + j;
            *a += $term;
        }
        reduce_lanes(&acc)
    }};
}

/// `ct[j] = $dot` with `$src` weight row `n0 + j` (of `$row_bytes` in `$data`), for every j
/// but `$skip`. A macro, not a closure, so the row loop and its dot are compiled inside the
/// caller's `target_feature` function.
#[cfg(target_arch = "x86_64")]
macro_rules! each_row {
    ($data:expr, $row_bytes:expr, $n0:expr, $ct:expr, $skip:expr, |$src:ident| $dot:expr) => {{
        for (j, o) in $ct.iter_mut().enumerate() {
            let n = $n0 + j;
            if $skip == Some(n) {
                continue;
            }
            let $src = &$data[n * $row_bytes..(n + 1) * $row_bytes];
            *o = $dot;
        }
    }};
}

/// Σ over blocks of one weight row (`src`, whole blocks of `ty`) · activation row `row`, in the
/// canonical order ([`super::kernels::sum_blocks`]).
#[inline(always)]
fn row_dot<D: BlockDot>(ty: GgmlType, src: &[u8], act: &Activations<'_>, row: usize) -> f32 {
    let k = act.k;
    let nb = k / 32;
    let bb = ty.block_bytes();
    if src.len() < nb * bb {
        // Unreachable: `check_run` holds every row to whole blocks of K.
        return 0.0;
    }
    let aq = &act.qs[row * k..row * k + k];
    let ad = &act.d[row * nb..row * nb + nb];
    match ty {
        GgmlType::Q8_0 => canonical_sum!(nb, |b| {
            let (w, a) = (&src[b * bb..], act32(aq, b));
            D::q8(arr::<32>(w, 2), a) as f32 * f16_le(w, 0) * ad[b]
        }),
        GgmlType::Q4_0 => canonical_sum!(nb, |b| {
            let (w, a) = (&src[b * bb..], act32(aq, b));
            D::q4(arr::<16>(w, 2), 8, a) as f32 * f16_le(w, 0) * ad[b]
        }),
        GgmlType::Q5_0 => canonical_sum!(nb, |b| {
            let (w, a) = (&src[b * bb..], act32(aq, b));
            let qh = u32::from_le_bytes(*arr::<4>(w, 2));
            D::q5(arr::<16>(w, 6), qh, 16, a) as f32 * f16_le(w, 0) * ad[b]
        }),
        GgmlType::Q4_1 => {
            let as_ = &act.s[row * nb..row * nb + nb];
            canonical_sum!(nb, |b| {
                let (w, a) = (&src[b * bb..], act32(aq, b));
                let dot = D::q4(arr::<16>(w, 4), 0, a);
                (f16_le(w, 0) * ad[b]) * dot as f32 + f16_le(w, 2) * as_[b]
            })
        }
        GgmlType::Q5_1 => {
            let as_ = &act.s[row * nb..row * nb + nb];
            canonical_sum!(nb, |b| {
                let (w, a) = (&src[b * bb..], act32(aq, b));
                let qh = u32::from_le_bytes(*arr::<4>(w, 4));
                let dot = D::q5(arr::<16>(w, 8), qh, 0, a);
                (f16_le(w, 0) * ad[b]) * dot as f32 + f16_le(w, 2) * as_[b]
            })
        }
        _ => 0.0,
    }
}

/// Activation block `b` of a row's quants as a fixed-size view (the caller's K is whole blocks).
#[inline(always)]
fn act32(aq: &[i8], b: usize) -> &[i8; 32] {
    match aq
        .get(32 * b..32 * b + 32)
        .and_then(|s| <&[i8; 32]>::try_from(s).ok())
    {
        Some(a) => a,
        None => &[0; 32],
    }
}

/// On x86 with AVX2: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (the types of common small models)
/// through the hand-written blocks of [`x86`]; the others through the portable kernel compiled
/// again with AVX2 enabled. Same formula and order as [`row_dot`], and Rust never contracts
/// float ops, so results are identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_dot_avx2(ty: GgmlType, src: &[u8], act: &Activations<'_>, row: usize) -> f32 {
    // SAFETY: AVX2 and F16C are this function's precondition.
    let hand = unsafe {
        match ty {
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
                super::kquant::x86::row_dot(ty, src, act, row)
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => x86::row_dot_q5(ty, src, act, row),
            _ => x86::row_dot(ty, src, act, row),
        }
    };
    match hand {
        Some(sum) => sum,
        None => row_dot::<Portable>(ty, src, act, row),
    }
}

/// AVX2 dots (decode, and prefill through [`takes_m`]) that keep [`row_dot`]'s results to the
/// bit: each block's integer dot is exact (`vpmaddubsw` pairs of at most 2·128·127 < 2¹⁵, then
/// `vpmaddwd`), eight blocks' dots are reduced together, their scale terms computed in eight
/// lanes with the same operations in the same order as the scalar formula (no FMA), and added to
/// the eight accumulators of the canonical order, one per lane. This is ggml's AVX2 `vec_dot`
/// shape, with its reassociation fixed once (`BLOCK_LANES`) for every kernel.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{f16_le, Activations, GgmlType, BLOCK_LANES};
    use std::arch::x86_64::*;

    /// The 32 nibbles of a 4-bit block as bytes 0..=15: low nibbles are elements 0..16.
    #[inline(always)]
    pub(in super::super) unsafe fn nibbles(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        let v = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }

    /// Eight i32 partial sums of `w`·`a`, `w` unsigned bytes ≤ 128, `a` signed in −127..=127.
    #[inline(always)]
    unsafe fn udot(w: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
    }

    /// As [`udot`] for signed `w`: |w| and a with w's sign (exact, w = −128 included).
    #[inline(always)]
    unsafe fn sdot(w: __m256i, a: __m256i) -> __m256i {
        udot(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w))
    }

    /// [Σv0, Σv1, Σv2, Σv3] of four vectors of eight i32.
    #[inline(always)]
    pub(in super::super) unsafe fn hsum4(v: [__m256i; 4]) -> __m128i {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    }

    /// The types [`row_dot`] and [`row_dot_q5`] take (their match arms; the tests walk this
    /// list).
    #[cfg(test)]
    pub(super) const TYPES: [GgmlType; 5] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
    ];

    /// The types [`Unpacked`] takes (M > 1); [`super::takes_m`] asks this list, not a copy of
    /// it. Once unpacked, Q5_0 is shaped as Q4_0 (signed, `d`) and Q5_1 as Q4_1 (unsigned, `d`
    /// and `m`): their fifth bits are spread once per weight row, not per activation row.
    pub(super) const UNPACK_TYPES: [GgmlType; 5] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
    ];

    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;
    const Q5_0: u8 = 3;
    const Q5_1: u8 = 4;

    /// Whether `T` has a minimum (`m_w·s_a` in its scale term).
    const fn has_min(t: u8) -> bool {
        t == Q4_1 || t == Q5_1
    }

    /// The integer dot of block `b` with activation block `a`.
    #[inline(always)]
    unsafe fn block<const T: u8>(b: *const u8, a: *const i8) -> __m256i {
        let a = _mm256_loadu_si256(a as *const __m256i);
        match T {
            Q8_0 => sdot(_mm256_loadu_si256(b.add(2) as *const __m256i), a),
            Q4_0 => sdot(_mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)), a),
            Q5_0 => sdot(
                _mm256_sub_epi8(fifth(nibbles(b.add(6)), b.add(2)), _mm256_set1_epi8(16)),
                a,
            ),
            Q5_1 => udot(fifth(nibbles(b.add(8)), b.add(4)), a),
            _ => udot(nibbles(b.add(4)), a),
        }
    }

    /// The f16 at byte `at` of the first `n` (at most eight) of consecutive blocks of `bb` bytes,
    /// widened (exact); lanes from `n` on are +0.0 and read nothing. A loop, not
    /// `array::from_fn`: a closure does not inherit the caller's AVX2.
    #[inline(always)]
    unsafe fn f16x8(b: *const u8, bb: usize, at: usize, n: usize) -> __m256 {
        let mut h = [0u16; 8];
        for (j, x) in h.iter_mut().enumerate().take(n) {
            *x = (b.add(j * bb + at) as *const u16).read_unaligned();
        }
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
    }

    /// # Safety
    /// AVX2 and F16C; `src` holds `nb` blocks of `T`'s `bb` bytes, `aq` nb·32 quants, `ad` (and
    /// `as_` for Q4_1) nb scales.
    #[inline(always)]
    unsafe fn blocks<const T: u8>(
        src: &[u8],
        bb: usize,
        aq: &[i8],
        ad: &[f32],
        as_: &[f32],
        nb: usize,
    ) -> f32 {
        let (ps, pa) = (src.as_ptr(), aq.as_ptr());
        // Lane j of `acc` is accumulator j of the canonical order: eight blocks at a time, block
        // i + j into lane j.
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        let all = _mm256_set1_epi32(-1);
        while i + BLOCK_LANES <= nb {
            let b = ps.add(i * bb);
            prefetch_ahead(b, BLOCK_LANES * bb);
            // Loops, not `array::from_fn`: a closure does not inherit this function's AVX2, and
            // its intrinsics can end up as calls.
            let mut dots = [_mm256_setzero_si256(); BLOCK_LANES];
            for (j, d) in dots.iter_mut().enumerate() {
                *d = block::<T>(b.add(j * bb), pa.add((i + j) * 32));
            }
            acc = _mm256_add_ps(acc, terms::<T>(dots, b, bb, ad, as_, i, BLOCK_LANES, all));
            i += BLOCK_LANES;
        }
        // The tail (fewer than eight blocks) goes to lanes 0.. as in `sum_blocks` ([`add_tail`]).
        let rem = nb - i;
        if rem > 0 {
            let b = ps.add(i * bb);
            let mut dots = [_mm256_setzero_si256(); BLOCK_LANES];
            for (j, d) in dots.iter_mut().enumerate().take(rem) {
                *d = block::<T>(b.add(j * bb), pa.add((i + j) * 32));
            }
            let mask = tail_mask(rem);
            acc = add_tail(acc, terms::<T>(dots, b, bb, ad, as_, i, rem, mask), mask);
        }
        reduce8(acc)
    }

    /// The scale terms of the `n` blocks from `b` (block index `i`) from their integer dots, in
    /// eight lanes, each op rounded as the scalar formula (no FMA); lanes outside `mask` (from
    /// `n` on) read no scales.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn terms<const T: u8>(
        dots: [__m256i; 8],
        b: *const u8,
        bb: usize,
        ad: &[f32],
        as_: &[f32],
        i: usize,
        n: usize,
        mask: __m256i,
    ) -> __m256 {
        let wd = f16x8(b, bb, 0, n);
        let adv = _mm256_maskload_ps(ad.as_ptr().add(i), mask);
        if has_min(T) {
            let wm = f16x8(b, bb, 2, n);
            let asv = _mm256_maskload_ps(as_.as_ptr().add(i), mask);
            scale_terms::<T>(dots, wd, adv, wm, asv)
        } else {
            let z = _mm256_setzero_ps();
            scale_terms::<T>(dots, wd, adv, z, z)
        }
    }

    /// Eight blocks' scale terms from their integer dots (`dots[j]`'s eight partial sums) and
    /// scales, lane j block j's, each op rounded as the scalar formula (no FMA): Q4_1
    /// `(wd·ad)·dot + wm·as`, the others `dot·wd·ad` (`wm`, `asv` unused).
    #[inline(always)]
    unsafe fn scale_terms<const T: u8>(
        dots: [__m256i; 8],
        wd: __m256,
        adv: __m256,
        wm: __m256,
        asv: __m256,
    ) -> __m256 {
        let lo = hsum4([dots[0], dots[1], dots[2], dots[3]]);
        let hi = hsum4([dots[4], dots[5], dots[6], dots[7]]);
        let dot = _mm256_cvtepi32_ps(_mm256_set_m128i(hi, lo));
        if has_min(T) {
            _mm256_add_ps(
                _mm256_mul_ps(_mm256_mul_ps(wd, adv), dot),
                _mm256_mul_ps(wm, asv),
            )
        } else {
            _mm256_mul_ps(_mm256_mul_ps(dot, wd), adv)
        }
    }

    /// How far ahead of the bytes being dotted decode asks for the weight bytes
    /// ([`prefetch_ahead`]).
    pub(in super::super) const PREFETCH: usize = 1536;

    /// A prefetch into L1 of every cache line of the `len` bytes [`PREFETCH`] bytes past `p`
    /// (the rows of a weight lie one after another, so past a row's end is the next row's
    /// start). A hint: it reads nothing and cannot fault, past the end of the weight included.
    #[inline(always)]
    pub(in super::super) unsafe fn prefetch_ahead(p: *const u8, len: usize) {
        let mut o = 0;
        while o < len {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + o) as *const i8);
            o += 64;
        }
    }

    /// The mask of a tail of `rem` (1..8) blocks: lanes 0..rem.
    #[inline(always)]
    pub(in super::super) unsafe fn tail_mask(rem: usize) -> __m256i {
        _mm256_loadu_si256(TAIL_MASK.as_ptr().add(BLOCK_LANES - rem) as *const __m256i)
    }

    /// `acc + t` in the lanes of `mask`, the others left as they are (blended, not added +0.0,
    /// which would turn a −0.0 into +0.0).
    #[inline(always)]
    pub(in super::super) unsafe fn add_tail(acc: __m256, t: __m256, mask: __m256i) -> __m256 {
        _mm256_blendv_ps(acc, _mm256_add_ps(acc, t), _mm256_castsi256_ps(mask))
    }

    /// `reduce_lanes` in the register: s_j = acc_j + acc_{j+4}, then (s0 + s2) + (s1 + s3).
    #[inline(always)]
    pub(in super::super) unsafe fn reduce8(acc: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }

    /// `q` (a block's 32 nibbles, [`nibbles`]' order: byte j is quant j) with bit j of the
    /// little-endian u32 at `qh` as bit 4 of byte j: the Q5 quants (ggml's `bytes_from_bits_32`).
    #[inline(always)]
    pub(in super::super) unsafe fn fifth(q: __m256i, qh: *const u8) -> __m256i {
        let bits = u32::from_le_bytes([*qh, *qh.add(1), *qh.add(2), *qh.add(3)]);
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let set = _mm256_cmpeq_epi8(
            _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)),
            _mm256_set1_epi64x(-1),
        );
        _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }

    /// Lanes 0..r all ones when loaded from `BLOCK_LANES - r` (a tail of r blocks).
    const TAIL_MASK: [i32; 2 * BLOCK_LANES] =
        [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

    /// One weight row of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 unpacked once for M > 1, so the
    /// per-activation-row loop ([`Unpacked::dot`]) does no nibble, fifth-bit, f16 or sign work:
    /// `u` holds each block's 32 quants as the unsigned bytes `vpmaddubsw` takes (Q4_1, Q5_1:
    /// the quants; Q4_0, Q5_0, Q8_0: |w|), `s` the signed quants whose signs go onto the
    /// activations (the signed types only), `d` and `m` the block scale and minimum widened to
    /// f32 (exact). The integer dots and the scale
    /// terms are the ones [`blocks`] computes, so the bits are the same.
    #[derive(Default)]
    pub(super) struct Unpacked {
        ty: Option<GgmlType>,
        nb: usize,
        u: Vec<u8>,
        s: Vec<i8>,
        d: Vec<f32>,
        m: Vec<f32>,
    }

    impl Unpacked {
        /// Unpack weight row `src` (`nb` whole blocks of `ty`, one of [`TYPES`]); false (and
        /// nothing to dot) for another type or a short row.
        ///
        /// # Safety
        /// The CPU must have AVX2 and F16C.
        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn unpack(&mut self, ty: GgmlType, src: &[u8], nb: usize) -> bool {
            let bb = ty.block_bytes();
            if !UNPACK_TYPES.contains(&ty) || src.len() != nb * bb {
                self.ty = None;
                return false;
            }
            self.ty = Some(ty);
            self.nb = nb;
            self.u.resize(nb * 32, 0);
            self.d.resize(nb, 0.0);
            let signed = !matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            self.s.resize(if signed { nb * 32 } else { 0 }, 0);
            self.m.resize(if signed { 0 } else { nb }, 0.0);
            for b in 0..nb {
                let blk = &src[b * bb..(b + 1) * bb];
                self.d[b] = f16_le(blk, 0);
                // SAFETY: `blk` is one whole block of `ty` (length checked above); `u` and `s`
                // hold 32 bytes at 32·b; AVX2 is this function's precondition.
                unsafe {
                    let p = blk.as_ptr();
                    let (w, signed_w) = match ty {
                        GgmlType::Q8_0 => (_mm256_loadu_si256(p.add(2) as *const __m256i), true),
                        GgmlType::Q4_0 => (
                            _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)),
                            true,
                        ),
                        GgmlType::Q5_0 => (
                            _mm256_sub_epi8(
                                fifth(nibbles(p.add(6)), p.add(2)),
                                _mm256_set1_epi8(16),
                            ),
                            true,
                        ),
                        GgmlType::Q5_1 => (fifth(nibbles(p.add(8)), p.add(4)), false),
                        _ => (nibbles(p.add(4)), false),
                    };
                    if signed_w {
                        let sp = self.s.as_mut_ptr().add(32 * b) as *mut __m256i;
                        _mm256_storeu_si256(sp, w);
                        let up = self.u.as_mut_ptr().add(32 * b) as *mut __m256i;
                        _mm256_storeu_si256(up, _mm256_abs_epi8(w));
                    } else {
                        self.m[b] = f16_le(blk, 2);
                        let up = self.u.as_mut_ptr().add(32 * b) as *mut __m256i;
                        _mm256_storeu_si256(up, w);
                    }
                }
            }
            true
        }

        /// The unpacked row · activation row `row`, in the canonical order; `None` if nothing is
        /// unpacked or the activations are not `nb` blocks.
        ///
        /// # Safety
        /// The CPU must have AVX2 and F16C.
        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn dot(&self, act: &Activations<'_>, row: usize) -> Option<f32> {
            let ty = self.ty?;
            let (k, nb) = (act.k, self.nb);
            if k != nb * 32 {
                return None;
            }
            let aq = act.qs.get(row * k..row * k + k)?;
            let ad = act.d.get(row * nb..row * nb + nb)?;
            // SAFETY: every slice holds `nb` blocks (checked above and in `unpack`).
            unsafe {
                Some(match ty {
                    GgmlType::Q4_1 | GgmlType::Q5_1 => {
                        let as_ = act.s.get(row * nb..row * nb + nb)?;
                        self.sum::<Q4_1>(aq, ad, as_)
                    }
                    _ => self.sum::<Q8_0>(aq, ad, &[]),
                })
            }
        }

        /// Block `b`'s exact integer dot from the unpacked bytes.
        ///
        /// # Safety
        /// AVX2; `pu`, `pa` (and `ps` unless `T` is `Q4_1`) hold at least 32·(b + 1) bytes.
        #[inline(always)]
        unsafe fn ublock<const T: u8>(
            pu: *const u8,
            ps: *const i8,
            pa: *const i8,
            b: usize,
        ) -> __m256i {
            let a = _mm256_loadu_si256(pa.add(32 * b) as *const __m256i);
            let u = _mm256_loadu_si256(pu.add(32 * b) as *const __m256i);
            if has_min(T) {
                udot(u, a)
            } else {
                let s = _mm256_loadu_si256(ps.add(32 * b) as *const __m256i);
                udot(u, _mm256_sign_epi8(a, s))
            }
        }

        /// [`blocks`] over the unpacked row: `T` is `Q4_1` (unsigned nibbles, `d` and `m`) or
        /// `Q8_0` (any signed type: |w| with w's signs on the activations, `d`).
        #[inline(always)]
        unsafe fn sum<const T: u8>(&self, aq: &[i8], ad: &[f32], as_: &[f32]) -> f32 {
            let nb = self.nb;
            let (pu, ps, pa) = (self.u.as_ptr(), self.s.as_ptr(), aq.as_ptr());
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + BLOCK_LANES <= nb {
                // Loops, not `array::from_fn`: a closure does not inherit the caller's AVX2, and
                // its intrinsics can end up as calls.
                let mut dots = [_mm256_setzero_si256(); BLOCK_LANES];
                for (j, d) in dots.iter_mut().enumerate() {
                    *d = Self::ublock::<T>(pu, ps, pa, i + j);
                }
                let all = _mm256_set1_epi32(-1);
                acc = _mm256_add_ps(acc, self.terms::<T>(dots, ad, as_, i, all));
                i += BLOCK_LANES;
            }
            // The tail (fewer than eight blocks) goes to lanes 0.. as in `sum_blocks` ([`add_tail`]).
            let rem = nb - i;
            if rem > 0 {
                let mut dots = [_mm256_setzero_si256(); BLOCK_LANES];
                for (j, d) in dots.iter_mut().enumerate().take(rem) {
                    *d = Self::ublock::<T>(pu, ps, pa, i + j);
                }
                let mask = tail_mask(rem);
                acc = add_tail(acc, self.terms::<T>(dots, ad, as_, i, mask), mask);
            }
            reduce8(acc)
        }

        /// The scale terms of blocks i..i+8 from their integer dots, in eight lanes, each op
        /// rounded as the scalar formula (no FMA); lanes outside `mask` read no scales.
        #[inline(always)]
        unsafe fn terms<const T: u8>(
            &self,
            dots: [__m256i; 8],
            ad: &[f32],
            as_: &[f32],
            i: usize,
            mask: __m256i,
        ) -> __m256 {
            let wd = _mm256_maskload_ps(self.d.as_ptr().add(i), mask);
            let adv = _mm256_maskload_ps(ad.as_ptr().add(i), mask);
            if has_min(T) {
                let wm = _mm256_maskload_ps(self.m.as_ptr().add(i), mask);
                let asv = _mm256_maskload_ps(as_.as_ptr().add(i), mask);
                scale_terms::<T>(dots, wd, adv, wm, asv)
            } else {
                let z = _mm256_setzero_ps();
                scale_terms::<T>(dots, wd, adv, z, z)
            }
        }
    }

    /// Activation row `row` of `act` · the weight row `src`, for Q4_0, Q4_1 and Q8_0 (Q5_0 and
    /// Q5_1: [`row_dot_q5`]); `None` for the other types, or if the lengths are not whole blocks
    /// (the portable path handles those).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn row_dot(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        let k = act.k;
        let nb = k / 32;
        let bb = ty.block_bytes();
        let aq = act.qs.get(row * k..row * k + k)?;
        let ad = act.d.get(row * nb..row * nb + nb)?;
        if k % 32 != 0 || src.len() != nb * bb {
            return None;
        }
        // SAFETY: lengths checked above; AVX2 + F16C are the caller's promise.
        unsafe {
            match ty {
                GgmlType::Q8_0 => Some(blocks::<Q8_0>(src, bb, aq, ad, &[], nb)),
                GgmlType::Q4_0 => Some(blocks::<Q4_0>(src, bb, aq, ad, &[], nb)),
                GgmlType::Q4_1 => {
                    let as_ = act.s.get(row * nb..row * nb + nb)?;
                    Some(blocks::<Q4_1>(src, bb, aq, ad, as_, nb))
                }
                _ => None,
            }
        }
    }

    /// [`row_dot`] for Q5_0 and Q5_1, kept out of line: inlined beside the Q4 blocks in one
    /// function, their code cost Q4_1 decode 7 % (docs/speed.md).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    #[inline(never)]
    pub(super) unsafe fn row_dot_q5(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        let k = act.k;
        let nb = k / 32;
        let bb = ty.block_bytes();
        let aq = act.qs.get(row * k..row * k + k)?;
        let ad = act.d.get(row * nb..row * nb + nb)?;
        if k % 32 != 0 || src.len() != nb * bb {
            return None;
        }
        // SAFETY: lengths checked above; AVX2 + F16C are the caller's promise.
        unsafe {
            match ty {
                GgmlType::Q5_0 => Some(blocks::<Q5_0>(src, bb, aq, ad, &[], nb)),
                GgmlType::Q5_1 => {
                    let as_ = act.s.get(row * nb..row * nb + nb)?;
                    Some(blocks::<Q5_1>(src, bb, aq, ad, as_, nb))
                }
                _ => None,
            }
        }
    }

    /// What [`rows_m1`] and [`rows_m1_q5`] read of activation row 0 — its quants, scales and
    /// (Q8_1) sums, the blocks per row and the block size — or `None` when the `rows` rows of
    /// `row_bytes` (in `data_len` bytes) are not whole blocks of `ty` over the activations' K.
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    fn m1_inputs<'a>(
        ty: GgmlType,
        data_len: usize,
        row_bytes: usize,
        act: &'a Activations<'_>,
        rows: usize,
    ) -> Option<(&'a [i8], &'a [f32], &'a [f32], usize, usize)> {
        let (k, bb) = (act.k, ty.block_bytes());
        let nb = k / 32;
        let (aq, ad) = (act.qs.get(..k)?, act.d.get(..nb)?);
        if k % 32 != 0 || row_bytes != nb * bb || data_len < rows * row_bytes {
            return None;
        }
        Some((aq, ad, act.s.get(..nb).unwrap_or(&[]), nb, bb))
    }

    /// `ct[j]` = weight row `n0 + j` of `data` (rows of `row_bytes`) · activation row 0, for
    /// every j but `skip`: decode's whole loop in one AVX2 function, the type matched once per
    /// matmul and [`blocks`] inlined into the row loop (dispatching per row through `row_at`
    /// cost two feature checks and a type match per row of 28 blocks). False (nothing written)
    /// for a type this function does not take or rows that are not whole blocks.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn rows_m1(
        ty: GgmlType,
        data: &[u8],
        row_bytes: usize,
        act: &Activations<'_>,
        n0: usize,
        ct: &mut [f32],
        skip: Option<usize>,
    ) -> bool {
        let Some((aq, ad, as_, nb, bb)) = m1_inputs(ty, data.len(), row_bytes, act, n0 + ct.len())
        else {
            return false;
        };
        // SAFETY (each arm): every row lies in `data` (checked above), `aq`/`ad`/`as_` hold
        // `nb` blocks; AVX2 and F16C are the caller's promise.
        unsafe {
            match ty {
                GgmlType::Q8_0 => each_row!(data, row_bytes, n0, ct, skip, |src| blocks::<Q8_0>(
                    src,
                    bb,
                    aq,
                    ad,
                    &[],
                    nb
                )),
                GgmlType::Q4_0 => each_row!(data, row_bytes, n0, ct, skip, |src| blocks::<Q4_0>(
                    src,
                    bb,
                    aq,
                    ad,
                    &[],
                    nb
                )),
                GgmlType::Q4_1 if as_.len() == nb => {
                    each_row!(data, row_bytes, n0, ct, skip, |src| blocks::<Q4_1>(
                        src, bb, aq, ad, as_, nb
                    ))
                }
                GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    return rows_m1_q5(ty, data, row_bytes, act, n0, ct, skip)
                }
                _ => return false,
            }
        }
        true
    }

    /// [`rows_m1`] for Q5_0 and Q5_1, out of line for the reason [`row_dot_q5`] is.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    #[inline(never)]
    unsafe fn rows_m1_q5(
        ty: GgmlType,
        data: &[u8],
        row_bytes: usize,
        act: &Activations<'_>,
        n0: usize,
        ct: &mut [f32],
        skip: Option<usize>,
    ) -> bool {
        let Some((aq, ad, as_, nb, bb)) = m1_inputs(ty, data.len(), row_bytes, act, n0 + ct.len())
        else {
            return false;
        };
        // SAFETY: as in `rows_m1`.
        unsafe {
            match ty {
                GgmlType::Q5_0 => each_row!(data, row_bytes, n0, ct, skip, |src| blocks::<Q5_0>(
                    src,
                    bb,
                    aq,
                    ad,
                    &[],
                    nb
                )),
                GgmlType::Q5_1 if as_.len() == nb => {
                    each_row!(data, row_bytes, n0, ct, skip, |src| blocks::<Q5_1>(
                        src, bb, aq, ad, as_, nb
                    ))
                }
                _ => return false,
            }
        }
        true
    }
}

/// Whether [`rows`] takes M > 1 runs of this type with this kernel here: on x86 with AVX2 and
/// F16C, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 go through [`x86::Unpacked`] (each weight row unpacked once,
/// then dotted with every activation row from L1), which gives the tile path's bits faster; on
/// aarch64 the same five types with the NEON kernels through [`neon::Unpacked`], and the
/// K-quants with them through `kquant::neon::Unpacked`.
pub(crate) fn takes_m(kernel: Kernel, ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        kernel == Kernel::Portable
            && (x86::UNPACK_TYPES.contains(&ty) || super::kquant::available(kernel, ty))
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(target_arch = "aarch64")]
    {
        kernel != Kernel::Portable
            && (neon::UNPACK_TYPES.contains(&ty) || super::kquant::available(kernel, ty))
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (kernel, ty);
        false
    }
}

/// Columns `n0..` of Cᵀ (`ct`: one row of M per column, M the activations' rows): weight row n
/// dotted with every activation row, for M = 1 and a type [`supports`] accepts, or M > 1 and one
/// [`takes_m`] accepts; `skip` (tests only) names a column to leave unwritten.
pub(crate) fn rows(
    kernel: Kernel,
    w: &Weight<'_>,
    row_bytes: usize,
    act: &Activations<'_>,
    n0: usize,
    ct: &mut [f32],
    skip: Option<usize>,
) {
    let m = act.f32s.len() / act.k.max(1);
    #[cfg(target_arch = "x86_64")]
    if m > 1 && takes_m(kernel, w.ty) && super::kquant::TYPES.contains(&w.ty) {
        // K-quants: each weight row unpacked once (`kquant::x86::Unpacked`), then dotted with
        // every activation row from L1.
        let mut un = super::kquant::x86::Unpacked::default();
        for (j, outs) in ct.chunks_exact_mut(m).enumerate() {
            let n = n0 + j;
            if skip == Some(n) {
                continue;
            }
            let src = &w.data[n * row_bytes..(n + 1) * row_bytes];
            let unpacked = un.unpack(w.ty, src);
            for (i, o) in outs.iter_mut().enumerate() {
                // SAFETY: `takes_m` detected AVX2 and F16C.
                *o = match unpacked.then(|| unsafe { un.dot(act, i) }).flatten() {
                    Some(v) => v,
                    None => row_at(kernel, w.ty, src, act, i),
                };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if m > 1 && takes_m(kernel, w.ty) {
        // Each weight row unpacked once, then dotted with every activation row from L1.
        let mut un = x86::Unpacked::default();
        let nb = act.k / 32;
        for (j, outs) in ct.chunks_exact_mut(m).enumerate() {
            let n = n0 + j;
            if skip == Some(n) {
                continue;
            }
            let src = &w.data[n * row_bytes..(n + 1) * row_bytes];
            // SAFETY: `takes_m` detected AVX2 and F16C.
            if !unsafe { un.unpack(w.ty, src, nb) } {
                for (i, o) in outs.iter_mut().enumerate() {
                    *o = row_at(kernel, w.ty, src, act, i);
                }
                continue;
            }
            for (i, o) in outs.iter_mut().enumerate() {
                // SAFETY: as above.
                *o = match unsafe { un.dot(act, i) } {
                    Some(v) => v,
                    None => row_at(kernel, w.ty, src, act, i),
                };
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if m > 1 && takes_m(kernel, w.ty) && super::kquant::TYPES.contains(&w.ty) {
        // K-quants: each weight row unpacked once (`kquant::neon::Unpacked`), then dotted with
        // every activation row from L1.
        let mut un = super::kquant::neon::Unpacked::default();
        // Re-checked, not trusted (see `Kernel::dots`): `sdot` without dotprod is UB.
        let sdot = kernel == Kernel::NeonSdot && std::arch::is_aarch64_feature_detected!("dotprod");
        for (j, outs) in ct.chunks_exact_mut(m).enumerate() {
            let n = n0 + j;
            if skip == Some(n) {
                continue;
            }
            let src = &w.data[n * row_bytes..(n + 1) * row_bytes];
            let unpacked = un.unpack(w.ty, src);
            for (i, o) in outs.iter_mut().enumerate() {
                let v = match (unpacked, sdot) {
                    (false, _) => None,
                    // SAFETY: dotprod was just detected on this CPU.
                    (true, true) => unsafe { super::kquant::neon::unpacked_sdot(&un, act, i) },
                    (true, false) => super::kquant::neon::unpacked_neon(&un, act, i),
                };
                *o = match v {
                    Some(v) => v,
                    None => row_at(kernel, w.ty, src, act, i),
                };
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if m > 1 && takes_m(kernel, w.ty) {
        // Each weight row unpacked once (`neon::Unpacked`), then dotted with every activation row.
        let mut un = neon::Unpacked::default();
        // Re-checked, not trusted (see `Kernel::dots`): `sdot` without dotprod is UB.
        let sdot = kernel == Kernel::NeonSdot && std::arch::is_aarch64_feature_detected!("dotprod");
        for (j, outs) in ct.chunks_exact_mut(m).enumerate() {
            let n = n0 + j;
            if skip == Some(n) {
                continue;
            }
            let src = &w.data[n * row_bytes..(n + 1) * row_bytes];
            let unpacked = un.unpack(w.ty, src, act.k / 32);
            for (i, o) in outs.iter_mut().enumerate() {
                let v = match (unpacked, sdot) {
                    (false, _) => None,
                    // SAFETY: dotprod was just detected on this CPU.
                    (true, true) => unsafe { neon::unpacked_sdot(&un, act, i) },
                    (true, false) => neon::unpacked_neon(&un, act, i),
                };
                *o = match v {
                    Some(v) => v,
                    None => row_at(kernel, w.ty, src, act, i),
                };
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if m == 1
        && kernel == Kernel::Portable
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: AVX2 and F16C were just detected on this CPU.
        let done = unsafe {
            if super::kquant::TYPES.contains(&w.ty) {
                super::kquant::x86::rows_m1(w.ty, w.data, row_bytes, act, n0, ct, skip)
            } else {
                x86::rows_m1(w.ty, w.data, row_bytes, act, n0, ct, skip)
            }
        };
        if done {
            return;
        }
    }
    for (j, outs) in ct.chunks_exact_mut(m.max(1)).enumerate() {
        let n = n0 + j;
        if skip == Some(n) {
            continue;
        }
        let src = &w.data[n * row_bytes..(n + 1) * row_bytes];
        for (i, o) in outs.iter_mut().enumerate() {
            *o = row_at(kernel, w.ty, src, act, i);
        }
    }
}

#[inline]
fn row_at(kernel: Kernel, ty: GgmlType, src: &[u8], act: &Activations<'_>, i: usize) -> f32 {
    if ty == GgmlType::F16 {
        return dot_f16(src, &act.f32s[i * act.k..(i + 1) * act.k]);
    }
    match kernel {
        Kernel::Portable => {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                // SAFETY: AVX2 and F16C were just detected on this CPU.
                return unsafe { row_dot_avx2(ty, src, act, i) };
            }
            row_dot::<Portable>(ty, src, act, i)
        }
        #[cfg(target_arch = "aarch64")]
        Kernel::Neon | Kernel::NeonSdot => {
            // Re-checked, not trusted (see `Kernel::dots`): `sdot` without dotprod is UB.
            let sdot =
                kernel == Kernel::NeonSdot && std::arch::is_aarch64_feature_detected!("dotprod");
            match (super::kquant::TYPES.contains(&ty), sdot) {
                (true, _) => kquant_row_neon(sdot, ty, src, act, i),
                // SAFETY: dotprod was just detected on this CPU.
                (false, true) => unsafe { neon::row_dot_sdot(ty, src, act, i) },
                (false, false) => neon::row_dot_neon(ty, src, act, i),
            }
        }
    }
}

/// A K-quant row on the NEON kernels: [`super::kquant::neon`]'s super-block dots (`sdot` when
/// the caller detected dotprod). A row they do not take (not whole super-blocks: `check_run`
/// refuses those first) goes through the unpacked tile path, as it did before they existed.
#[cfg(target_arch = "aarch64")]
fn kquant_row_neon(sdot: bool, ty: GgmlType, src: &[u8], act: &Activations<'_>, i: usize) -> f32 {
    let v = if sdot {
        // SAFETY: the caller detected dotprod on this CPU.
        unsafe { super::kquant::neon::row_dot_sdot(ty, src, act, i) }
    } else {
        super::kquant::neon::row_dot_neon(ty, src, act, i)
    };
    v.unwrap_or_else(|| {
        let mut sc = super::fast::RowScratch::default();
        sc.unpack(ty, src);
        sc.dot(Kernel::Neon, ty, act, i)
    })
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::kernels::{reduce_lanes, sdot, BLOCK_LANES};
    use super::{act32, arr, f16_le, row_dot, Activations, BlockDot, GgmlType};
    use std::arch::aarch64::*;

    /// Bit j of each byte lane (j = lane mod 8), to spread qh's bits over 16 lanes.
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];

    /// The two 16-lane halves of a 4-bit block (low nibbles = elements 0..16), minus `bias`.
    #[inline(always)]
    unsafe fn nibbles(q: &[u8; 16], bias: i8) -> (int8x16_t, int8x16_t) {
        let v = vld1q_u8(q.as_ptr());
        let lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0xF)));
        let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
        let b = vdupq_n_s8(bias);
        (vsubq_s8(lo, b), vsubq_s8(hi, b))
    }

    /// As `nibbles`, with the 5th bit of element j from bit j of `qh`.
    #[inline(always)]
    unsafe fn nibbles5(q: &[u8; 16], qh: u32, bias: i8) -> (int8x16_t, int8x16_t) {
        let v = vld1q_u8(q.as_ptr());
        let h = qh.to_le_bytes();
        let bit = vld1q_u8(BIT.as_ptr());
        let sixteen = vdupq_n_u8(0x10);
        let hlo = vcombine_u8(vdup_n_u8(h[0]), vdup_n_u8(h[1]));
        let hhi = vcombine_u8(vdup_n_u8(h[2]), vdup_n_u8(h[3]));
        let hlo = vandq_u8(vtstq_u8(hlo, bit), sixteen);
        let hhi = vandq_u8(vtstq_u8(hhi, bit), sixteen);
        let lo = vorrq_u8(vandq_u8(v, vdupq_n_u8(0xF)), hlo);
        let hi = vorrq_u8(vshrq_n_u8::<4>(v), hhi);
        let b = vdupq_n_s8(bias);
        (
            vsubq_s8(vreinterpretq_s8_u8(lo), b),
            vsubq_s8(vreinterpretq_s8_u8(hi), b),
        )
    }

    #[inline(always)]
    unsafe fn act(a: &[i8; 32]) -> (int8x16_t, int8x16_t) {
        (vld1q_s8(a.as_ptr()), vld1q_s8(a.as_ptr().add(16)))
    }

    /// Without dotprod: widening multiplies, pairwise accumulated (i8·i8 fits i16).
    pub(super) struct Neon;

    #[inline(always)]
    unsafe fn dot32(w: (int8x16_t, int8x16_t), a: (int8x16_t, int8x16_t)) -> i32 {
        let p0 = vmull_s8(vget_low_s8(w.0), vget_low_s8(a.0));
        let p1 = vmull_high_s8(w.0, a.0);
        let p2 = vmull_s8(vget_low_s8(w.1), vget_low_s8(a.1));
        let p3 = vmull_high_s8(w.1, a.1);
        let acc = vpaddlq_s16(p0);
        let acc = vpadalq_s16(vpadalq_s16(vpadalq_s16(acc, p1), p2), p3);
        vaddvq_s32(acc)
    }

    impl BlockDot for Neon {
        #[inline(always)]
        fn q4(q: &[u8; 16], bias: i8, a: &[i8; 32]) -> i32 {
            // SAFETY: fixed-size arrays make every 16-byte load in bounds; NEON is baseline.
            unsafe { dot32(nibbles(q, bias), act(a)) }
        }
        #[inline(always)]
        fn q5(q: &[u8; 16], qh: u32, bias: i8, a: &[i8; 32]) -> i32 {
            // SAFETY: as in `q4`.
            unsafe { dot32(nibbles5(q, qh, bias), act(a)) }
        }
        #[inline(always)]
        fn q8(w: &[u8; 32], a: &[i8; 32]) -> i32 {
            // SAFETY: as in `q4`.
            unsafe {
                let w = (
                    vreinterpretq_s8_u8(vld1q_u8(w.as_ptr())),
                    vreinterpretq_s8_u8(vld1q_u8(w.as_ptr().add(16))),
                );
                dot32(w, act(a))
            }
        }
    }

    /// With `sdot` (only ever inlined into [`row_dot_sdot`], which enables dotprod).
    struct Sdot;

    #[inline(always)]
    unsafe fn sdot32(w: (int8x16_t, int8x16_t), a: (int8x16_t, int8x16_t)) -> i32 {
        vaddvq_s32(sdot(sdot(vdupq_n_s32(0), w.0, a.0), w.1, a.1))
    }

    impl BlockDot for Sdot {
        #[inline(always)]
        fn q4(q: &[u8; 16], bias: i8, a: &[i8; 32]) -> i32 {
            // SAFETY: in-bounds loads as in `Neon`; dotprod is `row_dot_sdot`'s precondition.
            unsafe { sdot32(nibbles(q, bias), act(a)) }
        }
        #[inline(always)]
        fn q5(q: &[u8; 16], qh: u32, bias: i8, a: &[i8; 32]) -> i32 {
            // SAFETY: as in `q4`.
            unsafe { sdot32(nibbles5(q, qh, bias), act(a)) }
        }
        #[inline(always)]
        fn q8(w: &[u8; 32], a: &[i8; 32]) -> i32 {
            // SAFETY: as in `q4`.
            unsafe {
                let w = (
                    vreinterpretq_s8_u8(vld1q_u8(w.as_ptr())),
                    vreinterpretq_s8_u8(vld1q_u8(w.as_ptr().add(16))),
                );
                sdot32(w, act(a))
            }
        }
    }

    /// # Safety
    /// The CPU must have the dotprod extension.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn row_dot_sdot(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> f32 {
        match unsafe { grouped::<Sdot>(ty, src, act, row) } {
            Some(v) => v,
            None => row_dot::<Sdot>(ty, src, act, row),
        }
    }

    /// Without dotprod (A72, A53): [`grouped`] with widening multiplies.
    pub(super) fn row_dot_neon(ty: GgmlType, src: &[u8], act: &Activations<'_>, row: usize) -> f32 {
        // SAFETY: `Neon` needs nothing beyond baseline NEON.
        match unsafe { grouped::<Neon>(ty, src, act, row) } {
            Some(v) => v,
            None => row_dot::<Neon>(ty, src, act, row),
        }
    }

    /// A block's integer dot left as four partial sums (no horizontal add), so four blocks are
    /// reduced together ([`sums4`]).
    trait Dot4 {
        /// # Safety
        /// Whatever the implementation's instructions need (`Sdot`: dotprod).
        unsafe fn parts(w: (int8x16_t, int8x16_t), a: (int8x16_t, int8x16_t)) -> int32x4_t;
    }

    impl Dot4 for Sdot {
        #[inline(always)]
        unsafe fn parts(w: (int8x16_t, int8x16_t), a: (int8x16_t, int8x16_t)) -> int32x4_t {
            unsafe { sdot(sdot(vdupq_n_s32(0), w.0, a.0), w.1, a.1) }
        }
    }

    impl Dot4 for Neon {
        #[inline(always)]
        unsafe fn parts(w: (int8x16_t, int8x16_t), a: (int8x16_t, int8x16_t)) -> int32x4_t {
            unsafe {
                let p0 = vmull_s8(vget_low_s8(w.0), vget_low_s8(a.0));
                let p1 = vmull_high_s8(w.0, a.0);
                let p2 = vmull_s8(vget_low_s8(w.1), vget_low_s8(a.1));
                let p3 = vmull_high_s8(w.1, a.1);
                vpadalq_s16(vpadalq_s16(vpadalq_s16(vpaddlq_s16(p0), p1), p2), p3)
            }
        }
    }

    /// Four blocks' partial sums to their four exact integer dots, lane j = block j: two levels
    /// of pairwise adds (integer, so exact in any order).
    #[inline(always)]
    unsafe fn sums4(p: [int32x4_t; 4]) -> float32x4_t {
        unsafe { vcvtq_f32_s32(vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3]))) }
    }

    /// Four half-precision scales (little-endian u16 at `at` in each of four consecutive blocks of
    /// `bb` bytes from `src`) widened by one `fcvtl` (exact, as [`super::f16_le`] is).
    #[inline(always)]
    unsafe fn halves4(src: &[u8], at: usize, bb: usize) -> float32x4_t {
        let h: [u16; 4] =
            std::array::from_fn(|j| u16::from_le_bytes([src[j * bb + at], src[j * bb + at + 1]]));
        let v = unsafe { vld1_u16(h.as_ptr()) };
        let out: float32x4_t;
        // SAFETY: FCVTL (half to single) is baseline Advanced SIMD; registers only.
        unsafe {
            std::arch::asm!(
                "fcvtl {o:v}.4s, {i:v}.4h",
                o = out(vreg) out,
                i = in(vreg) v,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        out
    }

    /// Block `b`'s weights (`bb` bytes each in `src`, one of the types [`grouped`] takes) as two
    /// 16-lane halves.
    #[inline(always)]
    unsafe fn weights(ty: GgmlType, src: &[u8], bb: usize, b: usize) -> (int8x16_t, int8x16_t) {
        let w = &src[b * bb..(b + 1) * bb];
        // SAFETY: `arr` gives whole fixed-size arrays; NEON is baseline.
        unsafe {
            match ty {
                GgmlType::Q8_0 => {
                    let q = arr::<32>(w, 2);
                    (
                        vreinterpretq_s8_u8(vld1q_u8(q.as_ptr())),
                        vreinterpretq_s8_u8(vld1q_u8(q.as_ptr().add(16))),
                    )
                }
                GgmlType::Q4_0 => nibbles(arr::<16>(w, 2), 8),
                GgmlType::Q4_1 => nibbles(arr::<16>(w, 4), 0),
                GgmlType::Q5_0 => {
                    nibbles5(arr::<16>(w, 6), u32::from_le_bytes(*arr::<4>(w, 2)), 16)
                }
                _ => nibbles5(arr::<16>(w, 8), u32::from_le_bytes(*arr::<4>(w, 4)), 0),
            }
        }
    }

    /// The four scale terms of blocks `b..b + 4` (all whole), lane j block b + j's, with the
    /// f32 operations of [`row_dot`] in its order.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn terms4<D: Dot4>(
        ty: GgmlType,
        src: &[u8],
        bb: usize,
        aq: &[i8],
        ad: &[f32],
        as_: &[f32],
        b: usize,
    ) -> float32x4_t {
        // SAFETY: the caller's b + 4 <= nb; whole blocks of `src` and the activation row.
        unsafe {
            let p0 = D::parts(weights(ty, src, bb, b), act(act32(aq, b)));
            let p1 = D::parts(weights(ty, src, bb, b + 1), act(act32(aq, b + 1)));
            let p2 = D::parts(weights(ty, src, bb, b + 2), act(act32(aq, b + 2)));
            let p3 = D::parts(weights(ty, src, bb, b + 3), act(act32(aq, b + 3)));
            let dot = sums4([p0, p1, p2, p3]);
            let s = &src[b * bb..];
            let dw = halves4(s, 0, bb);
            let da = vld1q_f32(ad[b..b + 4].as_ptr());
            match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    let mw = halves4(s, 2, bb);
                    let sa = vld1q_f32(as_[b..b + 4].as_ptr());
                    vaddq_f32(vmulq_f32(vmulq_f32(dw, da), dot), vmulq_f32(mw, sa))
                }
                _ => vmulq_f32(vmulq_f32(dot, dw), da),
            }
        }
    }

    /// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 as the AVX2 path does them, four blocks at a time: the
    /// four exact integer dots in one vector, the scale terms with the same f32 operations in
    /// the same order as [`row_dot`] (vector lane j doing block j's), added to two accumulator
    /// registers whose lanes are accumulators 0..4 and 4..8; the tail and the tree as
    /// `canonical_sum`. So the bits are [`row_dot`]'s. None for other types.
    #[inline(always)]
    unsafe fn grouped<D: Dot4>(
        ty: GgmlType,
        src: &[u8],
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        use GgmlType::*;
        if !matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0) {
            return None;
        }
        let k = act.k;
        let nb = k / 32;
        let bb = ty.block_bytes();
        if src.len() < nb * bb {
            return None;
        }
        let aq = &act.qs[row * k..row * k + k];
        let ad = &act.d[row * nb..row * nb + nb];
        let as_ = if matches!(ty, Q4_1 | Q5_1) {
            &act.s[row * nb..row * nb + nb]
        } else {
            &[][..]
        };
        let full = nb / BLOCK_LANES * BLOCK_LANES;
        // SAFETY: registers and in-bounds array loads/stores only.
        let mut acc = unsafe {
            let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            let mut base = 0;
            while base < full {
                lo = vaddq_f32(lo, terms4::<D>(ty, src, bb, aq, ad, as_, base));
                hi = vaddq_f32(hi, terms4::<D>(ty, src, bb, aq, ad, as_, base + 4));
                base += BLOCK_LANES;
            }
            let mut acc = [0.0f32; BLOCK_LANES];
            vst1q_f32(acc.as_mut_ptr(), lo);
            vst1q_f32(acc.as_mut_ptr().add(4), hi);
            acc
        };
        // The tail after the last whole group of eight, to accumulators 0, 1, … in order.
        let mut j = 0;
        while full + j < nb {
            // SAFETY: block full + j is whole.
            acc[j] += unsafe { term1::<D>(ty, src, bb, aq, ad, as_, full + j) };
            j += 1;
        }
        Some(reduce_lanes(&acc))
    }

    /// The types [`Unpacked`] takes (M > 1); [`super::takes_m`] asks this list.
    pub(super) const UNPACK_TYPES: [GgmlType; 5] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ];

    /// One weight row of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 unpacked once for M > 1, so the
    /// per-activation-row loop ([`Unpacked::dot`]) does no nibble, fifth-bit or f16 work: `q`
    /// holds each block's 32 quants as the signed bytes `sdot`/`smull` take (Q4_0: nibble − 8,
    /// Q5_0: q − 16, Q4_1: 0..15, Q5_1: 0..31, Q8_0: as is), `d` and `m` the block scale
    /// and minimum widened to f32 (exact). The integer dots are [`weights`]' and the scale terms
    /// [`terms4`]'s, so the bits are [`row_dot`]'s. Per thread, 32 + 4 + 4 = 40 bytes per block
    /// of K (K = 8192: 10 KiB), reused for every row of the call.
    #[derive(Default)]
    pub(super) struct Unpacked {
        ty: Option<GgmlType>,
        nb: usize,
        q: Vec<i8>,
        d: Vec<f32>,
        m: Vec<f32>,
    }

    impl Unpacked {
        /// Unpack weight row `src` (`nb` whole blocks of `ty`, one of [`UNPACK_TYPES`]); false
        /// (and nothing to dot) for another type or a short row.
        pub(super) fn unpack(&mut self, ty: GgmlType, src: &[u8], nb: usize) -> bool {
            let bb = ty.block_bytes();
            if !UNPACK_TYPES.contains(&ty) || src.len() != nb * bb {
                self.ty = None;
                return false;
            }
            self.ty = Some(ty);
            self.nb = nb;
            self.q.resize(nb * 32, 0);
            self.d.resize(nb, 0.0);
            let min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            self.m.resize(if min { nb } else { 0 }, 0.0);
            for b in 0..nb {
                let blk = &src[b * bb..(b + 1) * bb];
                self.d[b] = f16_le(blk, 0);
                if min {
                    self.m[b] = f16_le(blk, 2);
                }
                // SAFETY: `weights` reads block b of `src` (whole, checked above); `q` holds 32
                // bytes at 32·b; NEON is baseline.
                unsafe {
                    let (lo, hi) = weights(ty, src, bb, b);
                    let p = self.q.as_mut_ptr().add(32 * b);
                    vst1q_s8(p, lo);
                    vst1q_s8(p.add(16), hi);
                }
            }
            true
        }

        /// The unpacked row · activation row `row` as [`grouped`] sums it (four blocks a step,
        /// accumulators 0..4 and 4..8, the tail and tree of `canonical_sum`); `None` if nothing
        /// is unpacked or the activations are not `nb` blocks.
        ///
        /// # Safety
        /// Whatever `D`'s instructions need (`Sdot`: dotprod).
        #[inline(always)]
        unsafe fn dot<D: Dot4>(&self, act: &Activations<'_>, row: usize) -> Option<f32> {
            let ty = self.ty?;
            let (k, nb) = (act.k, self.nb);
            if k != nb * 32 {
                return None;
            }
            let aq = act.qs.get(row * k..row * k + k)?;
            let ad = act.d.get(row * nb..row * nb + nb)?;
            let min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            let as_ = if min {
                act.s.get(row * nb..row * nb + nb)?
            } else {
                &[][..]
            };
            let full = nb / BLOCK_LANES * BLOCK_LANES;
            // SAFETY: registers and in-bounds loads only (every slice holds `nb` blocks).
            let mut acc = unsafe {
                let (mut lo, mut hi) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
                let mut base = 0;
                while base < full {
                    lo = vaddq_f32(lo, self.terms4::<D>(min, aq, ad, as_, base));
                    hi = vaddq_f32(hi, self.terms4::<D>(min, aq, ad, as_, base + 4));
                    base += BLOCK_LANES;
                }
                let mut acc = [0.0f32; BLOCK_LANES];
                vst1q_f32(acc.as_mut_ptr(), lo);
                vst1q_f32(acc.as_mut_ptr().add(4), hi);
                acc
            };
            // The tail after the last whole group of eight, to accumulators 0, 1, … in order.
            for (j, a) in acc.iter_mut().enumerate().take(nb - full) {
                let b = full + j;
                // SAFETY: block b is whole.
                let dot = unsafe { vaddvq_s32(self.parts::<D>(aq, b)) } as f32;
                *a += if min {
                    (self.d[b] * ad[b]) * dot + self.m[b] * as_[b]
                } else {
                    dot * self.d[b] * ad[b]
                };
            }
            Some(reduce_lanes(&acc))
        }

        /// Block `b`'s four partial integer sums from the unpacked quants.
        ///
        /// # Safety
        /// `D`'s features; b < nb and `aq` holds nb blocks.
        #[inline(always)]
        unsafe fn parts<D: Dot4>(&self, aq: &[i8], b: usize) -> int32x4_t {
            unsafe {
                let p = self.q.as_ptr().add(32 * b);
                D::parts((vld1q_s8(p), vld1q_s8(p.add(16))), act(act32(aq, b)))
            }
        }

        /// [`terms4`] over the unpacked row: the scale terms of blocks b..b + 4, lane j block
        /// b + j's, with [`row_dot`]'s f32 operations in its order.
        ///
        /// # Safety
        /// `D`'s features; b + 4 <= nb.
        #[inline(always)]
        unsafe fn terms4<D: Dot4>(
            &self,
            min: bool,
            aq: &[i8],
            ad: &[f32],
            as_: &[f32],
            b: usize,
        ) -> float32x4_t {
            unsafe {
                let dot = sums4([
                    self.parts::<D>(aq, b),
                    self.parts::<D>(aq, b + 1),
                    self.parts::<D>(aq, b + 2),
                    self.parts::<D>(aq, b + 3),
                ]);
                let dw = vld1q_f32(self.d[b..b + 4].as_ptr());
                let da = vld1q_f32(ad[b..b + 4].as_ptr());
                if min {
                    let mw = vld1q_f32(self.m[b..b + 4].as_ptr());
                    let sa = vld1q_f32(as_[b..b + 4].as_ptr());
                    vaddq_f32(vmulq_f32(vmulq_f32(dw, da), dot), vmulq_f32(mw, sa))
                } else {
                    vmulq_f32(vmulq_f32(dot, dw), da)
                }
            }
        }
    }

    /// [`Unpacked::dot`] with `sdot`.
    ///
    /// # Safety
    /// The CPU must have the dotprod extension.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn unpacked_sdot(
        un: &Unpacked,
        act: &Activations<'_>,
        row: usize,
    ) -> Option<f32> {
        unsafe { un.dot::<Sdot>(act, row) }
    }

    /// [`Unpacked::dot`] with widening multiplies (A72, A53).
    pub(super) fn unpacked_neon(un: &Unpacked, act: &Activations<'_>, row: usize) -> Option<f32> {
        // SAFETY: `Neon` needs nothing beyond baseline NEON.
        unsafe { un.dot::<Neon>(act, row) }
    }

    /// Block `b`'s scale term alone, as [`row_dot`] computes it.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn term1<D: Dot4>(
        ty: GgmlType,
        src: &[u8],
        bb: usize,
        aq: &[i8],
        ad: &[f32],
        as_: &[f32],
        b: usize,
    ) -> f32 {
        let w = &src[b * bb..(b + 1) * bb];
        // SAFETY: as in `terms4`.
        let dot = unsafe { vaddvq_s32(D::parts(weights(ty, src, bb, b), act(act32(aq, b)))) };
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                (f16_le(w, 0) * ad[b]) * dot as f32 + f16_le(w, 2) * as_[b]
            }
            _ => dot as f32 * f16_le(w, 0) * ad[b],
        }
    }
}

/// An F16 weight row (`src`, little-endian, maybe unaligned) · `x`, converted a chunk at a time
/// into a stack buffer (through `half`'s F16C / NEON-fp16 slice conversion) and dotted while it
/// is in L1: one pass over the weight bytes. Same lanes and order as `dot_f32`, so the result
/// equals widening the whole row first.
pub(crate) fn dot_f16(src: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: AVX and F16C were just detected on this CPU.
        return unsafe { dot_f16_f16c(src, x) };
    }
    // A multiple of the 16 lanes, so only the last chunk has a tail.
    const C: usize = 512;
    let mut bits = [0u16; C];
    let mut f = [0.0f32; C];
    let mut acc = [0.0f32; LANES];
    let mut tail = 0.0f32;
    for (b, xs) in src.chunks(2 * C).zip(x.chunks(C)) {
        let n = xs.len().min(b.len() / 2);
        for (o, p) in bits[..n].iter_mut().zip(b.chunks_exact(2)) {
            *o = u16::from_le_bytes([p[0], p[1]]);
        }
        HalfBitsSliceExt::reinterpret_cast::<f16>(&bits[..n]).convert_to_f32_slice(&mut f[..n]);
        tail = f32_lanes(&mut acc, &f[..n], &xs[..n]);
    }
    acc.iter().sum::<f32>() + tail
}

/// [`dot_f16`] with the conversion inlined (`vcvtph2ps`, exact) into the same 16 lanes: lane j of
/// `a0`/`a1` is `acc[j]`/`acc[8 + j]`, products and sums rounded separately as there (no FMA), the
/// tail through [`f32_lanes`]; so the bits are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn dot_f16_f16c(src: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(src.len() / 2);
    let full = n / LANES * LANES;
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let (ps, px) = (src.as_ptr(), x.as_ptr());
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 <= full <= n, so 32 bytes of src and 16 floats of x are in bounds.
        unsafe {
            let w0 = _mm256_cvtph_ps(_mm_loadu_si128(ps.add(2 * i) as *const __m128i));
            let w1 = _mm256_cvtph_ps(_mm_loadu_si128(ps.add(2 * i + 16) as *const __m128i));
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, _mm256_loadu_ps(px.add(i))));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, _mm256_loadu_ps(px.add(i + 8))));
        }
        i += LANES;
    }
    let mut acc = [0.0f32; LANES];
    // SAFETY: acc holds 16 floats.
    unsafe {
        _mm256_storeu_ps(acc.as_mut_ptr(), a0);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
    }
    let mut f = [0.0f32; LANES];
    for (o, p) in f.iter_mut().zip(src[2 * full..2 * n].chunks_exact(2)) {
        *o = f16_bits_to_f32(u16::from_le_bytes([p[0], p[1]]));
    }
    let tail = f32_lanes(&mut [0.0; LANES], &f[..n - full], &x[full..n]);
    acc.iter().sum::<f32>() + tail
}

#[cfg(all(test, target_arch = "x86_64"))]
mod x86_tests {
    use super::super::fast::{act_format, Activations};
    use super::{row_dot, x86, Portable};
    use crate::quant::GgmlType;
    use half::f16;

    /// The hand-written AVX2 blocks against the portable blocks (the path every other kernel
    /// shares), to the bit: every activation row of an M = 3 run, weights of every byte pattern
    /// (Q8_0's −128, extreme nibbles), 17, 4 and 3 blocks (groups of four, a tail, only a tail).
    #[test]
    fn hand_written_avx2_dots_equal_the_portable_blocks() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c"))
        {
            eprintln!("no AVX2/F16C here: nothing to compare");
            return;
        }
        let mut z = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z
        };
        for ty in x86::TYPES {
            for k in [544usize, 128, 96] {
                let bb = ty.block_bytes();
                let mut src: Vec<u8> = (0..k / 32 * bb).map(|_| next() as u8).collect();
                for b in src.chunks_exact_mut(bb) {
                    let d = 0.005 + (next() % 1000) as f32 * 1e-5;
                    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                        let m = (next() % 2000) as f32 * 1e-5 - 0.01;
                        b[2..4].copy_from_slice(&f16::from_f32(m).to_le_bytes());
                    }
                }
                let a: Vec<f32> = (0..3 * k)
                    .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
                    .collect();
                let fmt = act_format(ty).expect("a fast-path type");
                let act = Activations::quantize(fmt, &a, k);
                for row in 0..3 {
                    let want = row_dot::<Portable>(ty, &src, &act, row);
                    // SAFETY: AVX2 and F16C were detected above.
                    let got = unsafe {
                        match ty {
                            GgmlType::Q5_0 | GgmlType::Q5_1 => x86::row_dot_q5(ty, &src, &act, row),
                            _ => x86::row_dot(ty, &src, &act, row),
                        }
                    };
                    assert_eq!(
                        got.map(f32::to_bits),
                        Some(want.to_bits()),
                        "{ty} K={k} row {row}"
                    );
                }
            }
        }
    }
}
