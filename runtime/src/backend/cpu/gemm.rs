//! M > 1 on x86 as a small gemm in registers, as llama.cpp's tinyBLAS and its repacked `gemm`
//! kernels do it: a tile of R weight rows × C activation rows is computed at once, each weight
//! vector loaded once for the C activation rows and each activation vector once for the R
//! weight rows. What makes it cheap under the canonical order (ARCHITECTURE.md, "CPU reduction
//! order") is the layout, not the tile: the order needs each block's integer dot on its own
//! (block b's term goes to accumulator b mod 8), and the unpacked path (`fused::x86::Unpacked`)
//! gets it by reducing the eight i32 lanes of every (block, activation row) pair across the
//! register (two `vphaddd` levels per four blocks: more shuffle work than the dot itself).
//! Here both operands are laid out *interleaved*: for every 256 quants (eight blocks of 32, or
//! one super-block's eight 32-quant chunks), vector v holds bytes 4v..4v+4 of chunk j in its
//! i32 lane j. Eight `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd`) then leave chunk j's whole dot in
//! lane j, which is exactly the lane of the canonical accumulator it belongs to: no horizontal
//! sum at all for the 32-element types, one per eight super-blocks for the K-quants.
//!
//! `vpdpbusd` multiplies unsigned weight bytes by signed activation bytes, so the signed types
//! are stored biased (Q4_0 + 8, Q5_0 + 16, Q8_0 + 128: the bytes `q + bias` in 0..=255) and the
//! bias taken back exactly as `bias · Σa` of the activation block, in i32, before the
//! conversion. Every integer dot is therefore the exact one of every other kernel, and the f32
//! terms are formed with the same operations in the same order (no FMA), so the bits are theirs.
//!
//! The weights are unpacked per call into a scratch of R rows (nothing is repacked at load; the
//! ledger's zero-copy line stays true), the activations interleaved once per matmul
//! ([`ActTiles`], built before the threads split N).

// The tiles are x86 code: on aarch64 no tier is ever detected, so their types go unused there.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use super::fast::{ActFormat, Activations};
use crate::quant::{GgmlType, QK_K};

/// Which instruction does the u8 × i8 dot of four bytes into an i32 lane. All three are exact
/// for the operands they are given here, so they give the same bits; the tests run each one
/// this CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tier {
    /// `vpmaddubsw` + `vpmaddwd`: exact only while a pair of products stays inside i16, i.e.
    /// weight bytes ≤ 127 (so not Q8_0's biased bytes).
    Avx2,
    /// `vpdpbusd` with the VEX encoding (AVX-VNNI: Alder Lake, Sapphire Rapids, Zen 5).
    AvxVnni,
    /// `vpdpbusd` with the EVEX encoding on 256-bit vectors (AVX512-VNNI and VL: Ice Lake,
    /// Sapphire Rapids, Zen 4).
    Avx512Vnni,
}

impl Tier {
    /// Every tier this CPU runs, best first (none without AVX2 and F16C).
    pub(crate) fn available() -> Vec<Tier> {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let mut v = Vec::new();
            if !(has!("avx2") && has!("f16c")) {
                return v;
            }
            if has!("avx512f") && has!("avx512vl") && has!("avx512vnni") {
                v.push(Tier::Avx512Vnni);
            }
            // AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4, read here because its name in
            // `is_x86_feature_detected!` is newer than the workspace's `rust-version`; the OS's
            // YMM state is what the AVX2 check above already required. (`unsafe` for Rust
            // 1.85, where `__cpuid_count` still was.)
            #[allow(unused_unsafe)]
            // SAFETY: CPUID exists on every x86_64 CPU; leaf 7 is there when AVX2 is.
            let leaf7_1 = unsafe { std::arch::x86_64::__cpuid_count(7, 1) };
            if leaf7_1.eax & (1 << 4) != 0 {
                v.push(Tier::AvxVnni);
            }
            v.push(Tier::Avx2);
            v
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Vec::new()
        }
    }

    /// The best tier here, if any.
    pub(crate) fn detect() -> Option<Tier> {
        Tier::available().first().copied()
    }

    /// Whether this tier runs `ty` (the types of the files people download; Q5_K and the
    /// others keep the unpacked path).
    pub(crate) fn takes(self, ty: GgmlType) -> bool {
        use GgmlType::*;
        match ty {
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4K | Q6K => true,
            // Q8_0's biased bytes go up to 255: a `vpmaddubsw` pair could saturate.
            Q8_0 => self != Tier::Avx2,
            _ => false,
        }
    }
}

/// What a signed type's bytes are stored biased by (0 for the unsigned ones).
fn bias(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q8_0 => 128,
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        _ => 0,
    }
}

/// The M activation rows of one matmul, interleaved for the tiles (see the module comment):
/// per row `qlen` bytes of quants, groups of eight blocks (or one super-block) of 256 quants,
/// the last group of a 32-element type padded with zero blocks; the block scales (and Q8_1's
/// sums) per row in groups of eight lanes, zero-padded; for the biased types `−bias·Σa` of
/// every block, in the same lanes. Built once per matmul, shared by the threads.
pub(crate) struct ActTiles {
    pub(crate) tier: Tier,
    ty: GgmlType,
    m: usize,
    k: usize,
    /// Blocks per row: of 32 quants, or super-blocks for the K-quants.
    nb: usize,
    /// Groups of eight blocks (eight super-blocks for the K-quants) per row.
    ng: usize,
    qlen: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    neg_bias: Vec<i32>,
}

impl ActTiles {
    /// The tiles of `act` for weights of `ty` on `tier`; `None` if the tier does not take the
    /// type or the activations are not whole blocks of it.
    pub(crate) fn new(tier: Tier, ty: GgmlType, act: &Activations<'_>) -> Option<ActTiles> {
        if !tier.takes(ty) {
            return None;
        }
        let kq = ty.block_elems() == QK_K;
        let (per, fmt) = if kq {
            (QK_K, ActFormat::Q8K)
        } else if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            (32, ActFormat::Q8_1)
        } else {
            (32, ActFormat::Q8_0)
        };
        let k = act.k;
        if act.fmt != fmt || k == 0 || k % per != 0 || act.qs.len() % k != 0 {
            return None;
        }
        let m = act.qs.len() / k;
        let nb = k / per;
        let ng = nb.div_ceil(8);
        let qlen = if kq { k } else { ng * 256 };
        if act.d.len() != m * nb
            || (fmt == ActFormat::Q8_1 && act.s.len() != m * nb)
            || (fmt == ActFormat::Q8K && act.bsums.len() != m * nb * 16)
        {
            return None;
        }
        let bias = bias(ty);
        let mut t = ActTiles {
            tier,
            ty,
            m,
            k,
            nb,
            ng,
            qlen,
            q: vec![0; m * qlen],
            d: vec![0.0; m * ng * 8],
            s: vec![
                0.0;
                if fmt == ActFormat::Q8_1 {
                    m * ng * 8
                } else {
                    0
                }
            ],
            neg_bias: vec![0; if bias != 0 { m * ng * 8 } else { 0 }],
        };
        for i in 0..m {
            let src = &act.qs[i * k..(i + 1) * k];
            let dst = &mut t.q[i * qlen..(i + 1) * qlen];
            for (c, out) in dst.chunks_exact_mut(256).enumerate() {
                for j in 0..8 {
                    let at = c * 256 + j * 32;
                    if at >= k {
                        break;
                    }
                    for v in 0..8 {
                        let o = v * 32 + j * 4;
                        out[o..o + 4].copy_from_slice(&src[at + 4 * v..at + 4 * v + 4]);
                    }
                }
            }
            let row = i * ng * 8;
            t.d[row..row + nb].copy_from_slice(&act.d[i * nb..(i + 1) * nb]);
            if fmt == ActFormat::Q8_1 {
                t.s[row..row + nb].copy_from_slice(&act.s[i * nb..(i + 1) * nb]);
            }
            if bias != 0 {
                for b in 0..nb {
                    let sum: i32 = src[32 * b..32 * b + 32].iter().map(|&x| x as i32).sum();
                    t.neg_bias[row + b] = -bias * sum;
                }
            }
        }
        Some(t)
    }
}

/// Columns `n0..` of Cᵀ (`ct`, one row of M per column) through the tiles, for every column but
/// `skip`; false (nothing written) if the weight does not match the tiles.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows(
    at: &ActTiles,
    data: &[u8],
    ty: GgmlType,
    row_bytes: usize,
    act: &Activations<'_>,
    n0: usize,
    ct: &mut [f32],
    skip: Option<usize>,
) -> bool {
    let m = at.m;
    if ty != at.ty || act.k != at.k || m < 2 || ct.len() % m != 0 {
        return false;
    }
    let cols = ct.len() / m;
    if row_bytes != at.nb * ty.block_bytes()
        || data.len() < (n0 + cols) * row_bytes
        || (ty.block_elems() == QK_K && act.bsums.len() != m * at.nb * 16)
    {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if !Tier::available().contains(&at.tier) {
            return false;
        }
        let src = &data[n0 * row_bytes..(n0 + cols) * row_bytes];
        let skip = skip.and_then(|s| s.checked_sub(n0));
        // SAFETY: the tier's features were just detected on this CPU; every length the
        // kernels read by was checked above and in `ActTiles::new`.
        unsafe {
            match at.tier {
                Tier::Avx512Vnni => x86::rows_evex(at, src, row_bytes, &act.bsums, ct, skip),
                Tier::AvxVnni => x86::rows_vex(at, src, row_bytes, &act.bsums, ct, skip),
                Tier::Avx2 => x86::rows_avx2(at, src, row_bytes, &act.bsums, ct, skip),
            }
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (act, n0, skip);
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::fused::x86::{add_tail, fifth, nibbles, reduce8, tail_mask};
    use super::super::kquant::scales_mins;
    use super::super::kquant::x86::sums8;
    use super::{ActTiles, GgmlType, QK_K};
    use std::arch::x86_64::*;

    /// `acc` + the dot of four unsigned weight bytes with four signed activation bytes, per
    /// i32 lane. Exact for every operand the tiles pass (see [`super::Tier`]).
    pub(super) trait Dp {
        unsafe fn dp(acc: __m256i, u: __m256i, a: __m256i) -> __m256i;
    }

    pub(super) struct Madd;
    impl Dp for Madd {
        #[inline(always)]
        unsafe fn dp(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
            let p = _mm256_maddubs_epi16(u, a);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }

    // `vpdpbusd` through `asm!`, not its intrinsics: those (and the `avxvnni`/`avx512vnni`
    // target features) are stable only from Rust 1.89, past the workspace's `rust-version`.
    // Without those target features the 16 extra registers of AVX-512 are out of reach too, so
    // the tile is 2 × 4 (8 accumulators) on every tier; with them (intrinsics, 32 registers)
    // a 4 × 4 tile measured ~10 % faster on this model's prefill (docs/speed.md).

    /// AVX-VNNI's VEX encoding.
    pub(super) struct Vex;
    impl Dp for Vex {
        #[inline(always)]
        unsafe fn dp(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
            dpbusd_vex(acc, u, a)
        }
    }

    /// AVX512-VNNI's EVEX encoding, on 256-bit registers (AVX512VL).
    pub(super) struct Evex;
    impl Dp for Evex {
        #[inline(always)]
        unsafe fn dp(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
            dpbusd_evex(acc, u, a)
        }
    }

    /// # Safety
    /// AVX-VNNI. (`asm!` operands of class `ymm_reg` need AVX enabled, hence the attribute.)
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn dpbusd_vex(mut acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
        std::arch::asm!(
            "{{vex}} vpdpbusd {acc}, {u}, {a}",
            acc = inout(ymm_reg) acc,
            u = in(ymm_reg) u,
            a = in(ymm_reg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// # Safety
    /// AVX512VL and AVX512-VNNI.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn dpbusd_evex(mut acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
        std::arch::asm!(
            "vpdpbusd {acc}, {u}, {a}",
            acc = inout(ymm_reg) acc,
            u = in(ymm_reg) u,
            a = in(ymm_reg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q5_0: u8 = 2;
    const Q4_1: u8 = 3;
    const Q5_1: u8 = 4;
    const Q4K: u8 = 5;
    const Q6K: u8 = 6;

    const fn has_min(t: u8) -> bool {
        t == Q4_1 || t == Q5_1
    }

    const fn biased(t: u8) -> bool {
        t == Q8_0 || t == Q4_0 || t == Q5_0
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// The 8×8 transpose of i32 lanes: lane j of out[v] is lane v of r[j].
    #[inline(always)]
    unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
        let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
        let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
        let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
        let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
        let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        [
            _mm256_permute2x128_si256::<0x20>(u0, u4),
            _mm256_permute2x128_si256::<0x20>(u1, u5),
            _mm256_permute2x128_si256::<0x20>(u2, u6),
            _mm256_permute2x128_si256::<0x20>(u3, u7),
            _mm256_permute2x128_si256::<0x31>(u0, u4),
            _mm256_permute2x128_si256::<0x31>(u1, u5),
            _mm256_permute2x128_si256::<0x31>(u2, u6),
            _mm256_permute2x128_si256::<0x31>(u3, u7),
        ]
    }

    /// Eight f16 widened (exact); the caller zero-fills the lanes it has no value for.
    #[inline(always)]
    unsafe fn f16x8(h: &[u16; 8]) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
    }

    #[inline(always)]
    unsafe fn u16_at(p: *const u8) -> u16 {
        (p as *const u16).read_unaligned()
    }

    /// R weight rows unpacked for the tiles, slot r at offsets r·(its length): `q` interleaved
    /// as the activations are (unsigned bytes, biased for the signed types), `d` (and Q4_1/Q5_1's
    /// `m`, Q4_K's dmin) in groups of eight lanes, zero-padded; for the K-quants per super-block
    /// `sa` (Q4_K: the eight sub-block scales; Q6_K: the even groups' scales), `sb` (Q6_K: the
    /// odd groups'), `s16` (Q4_K: each min twice, against the bsum pairs; Q6_K: the sixteen
    /// scales, against the bsums), as i32 and i16 lanes.
    struct Wt {
        qlen: usize,
        dlen: usize,
        nb: usize,
        q: Vec<u8>,
        d: Vec<f32>,
        m: Vec<f32>,
        sa: Vec<i32>,
        sb: Vec<i32>,
        s16: Vec<i16>,
    }

    impl Wt {
        fn new<const T: u8, const R: usize>(at: &ActTiles) -> Wt {
            let kq = T == Q4K || T == Q6K;
            let nb = at.nb;
            let dlen = at.ng * 8;
            Wt {
                qlen: at.qlen,
                dlen,
                nb,
                q: vec![0; R * at.qlen],
                d: vec![0.0; R * dlen],
                m: vec![0.0; if has_min(T) || T == Q4K { R * dlen } else { 0 }],
                sa: vec![0; if kq { R * nb * 8 } else { 0 }],
                sb: vec![0; if T == Q6K { R * nb * 8 } else { 0 }],
                s16: vec![0; if kq { R * nb * 16 } else { 0 }],
            }
        }

        /// Weight row `src` (whole blocks of `T`, `nb` of them) into slot `r`.
        ///
        /// # Safety
        /// AVX2 and F16C; `src` holds `nb` blocks of `T` and `r` < the R of [`Wt::new`].
        #[inline(always)]
        unsafe fn unpack<const T: u8>(&mut self, r: usize, src: &[u8]) {
            let ps = src.as_ptr();
            let q = self.q.as_mut_ptr().add(r * self.qlen);
            let dl = r * self.dlen;
            let nb = self.nb;
            match T {
                Q4K | Q6K => {
                    let m4 = _mm256_set1_epi8(0x0F);
                    let m2 = _mm256_set1_epi8(0x03);
                    for sb in 0..nb {
                        let mut rows = [_mm256_setzero_si256(); 8];
                        let o8 = (r * nb + sb) * 8;
                        let o16 = (r * nb + sb) * 16;
                        if T == Q6K {
                            let p = ps.add(sb * 210);
                            for n in 0..2 {
                                let ql0 = load(p.add(64 * n));
                                let ql1 = load(p.add(64 * n + 32));
                                let qh = load(p.add(128 + 32 * n));
                                let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2));
                                let h2 = _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srli_epi16::<2>(qh),
                                    m2,
                                ));
                                let h4 = _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srli_epi16::<4>(qh),
                                    m2,
                                ));
                                let h6 = _mm256_slli_epi16::<4>(_mm256_and_si256(
                                    _mm256_srli_epi16::<6>(qh),
                                    m2,
                                ));
                                rows[4 * n] = _mm256_or_si256(_mm256_and_si256(ql0, m4), h0);
                                rows[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), h2);
                                rows[4 * n + 2] = _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                                    h4,
                                );
                                rows[4 * n + 3] = _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                                    h6,
                                );
                            }
                            for g in 0..16 {
                                let s = *p.add(192 + g) as i8;
                                self.s16[o16 + g] = s as i16;
                                if g % 2 == 0 {
                                    self.sa[o8 + g / 2] = s as i32;
                                } else {
                                    self.sb[o8 + g / 2] = s as i32;
                                }
                            }
                            self.d[dl + sb] = super::super::kquant::x86::f16_at(
                                std::slice::from_raw_parts(p, 210),
                                208,
                            );
                        } else {
                            let p = ps.add(sb * 144);
                            for c in 0..4 {
                                let v = load(p.add(16 + 32 * c));
                                rows[2 * c] = _mm256_and_si256(v, m4);
                                rows[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                            }
                            let (sc, mins) = scales_mins(&*(p.add(4) as *const [u8; 12]));
                            for j in 0..8 {
                                self.sa[o8 + j] = sc[j] as i32;
                                self.s16[o16 + 2 * j] = mins[j] as i16;
                                self.s16[o16 + 2 * j + 1] = mins[j] as i16;
                            }
                            let blk = std::slice::from_raw_parts(p, 144);
                            self.d[dl + sb] = super::super::kquant::x86::f16_at(blk, 0);
                            self.m[dl + sb] = super::super::kquant::x86::f16_at(blk, 2);
                        }
                        let t = transpose8(rows);
                        for (v, x) in t.iter().enumerate() {
                            _mm256_storeu_si256(q.add(sb * 256 + 32 * v) as *mut __m256i, *x);
                        }
                    }
                }
                _ => {
                    let bb = match T {
                        Q8_0 => 34,
                        Q4_0 => 18,
                        Q5_0 => 22,
                        Q4_1 => 20,
                        _ => 24,
                    };
                    for g in 0..nb.div_ceil(8) {
                        let mut rows = [_mm256_setzero_si256(); 8];
                        let (mut dh, mut mh) = ([0u16; 8], [0u16; 8]);
                        for j in 0..8.min(nb - 8 * g) {
                            let p = ps.add((8 * g + j) * bb);
                            rows[j] = match T {
                                Q8_0 => {
                                    _mm256_xor_si256(load(p.add(2)), _mm256_set1_epi8(0x80u8 as i8))
                                }
                                Q4_0 => nibbles(p.add(2)),
                                Q5_0 => fifth(nibbles(p.add(6)), p.add(2)),
                                Q4_1 => nibbles(p.add(4)),
                                _ => fifth(nibbles(p.add(8)), p.add(4)),
                            };
                            dh[j] = u16_at(p);
                            mh[j] = u16_at(p.add(2));
                        }
                        let t = transpose8(rows);
                        for (v, x) in t.iter().enumerate() {
                            _mm256_storeu_si256(q.add(g * 256 + 32 * v) as *mut __m256i, *x);
                        }
                        _mm256_storeu_ps(self.d.as_mut_ptr().add(dl + 8 * g), f16x8(&dh));
                        if has_min(T) {
                            _mm256_storeu_ps(self.m.as_mut_ptr().add(dl + 8 * g), f16x8(&mh));
                        }
                    }
                }
            }
        }
    }

    /// One tile: weight slots 0..R of `wt` against activation rows `ai` (C of them, repeats
    /// allowed), each output written to `out[j][c]` unless `out[j]` is `None` or `c ≥ live`.
    ///
    /// # Safety
    /// The caller's features for `D`; `wt` and `at` as built for the same type and K, `ai` rows
    /// of `at`, `bsums` the activations' Q8_K sums (K-quants).
    #[inline(always)]
    unsafe fn tile<D: Dp, const T: u8, const R: usize, const C: usize>(
        wt: &Wt,
        at: &ActTiles,
        bsums: &[i16],
        ai: [usize; C],
        put: &mut dyn FnMut(usize, usize, f32),
        live_r: usize,
        live_c: usize,
    ) {
        let (ng, nb) = (at.ng, at.nb);
        let kq = T == Q4K || T == Q6K;
        let mut facc = [[_mm256_setzero_ps(); C]; R];
        for g in 0..ng {
            let n = (nb - 8 * g).min(8);
            let mask = tail_mask(n);
            let mut terms = [[_mm256_setzero_ps(); C]; R];
            if kq {
                let mut isv = [[[_mm256_setzero_si256(); 8]; C]; R];
                let mut msv = [[[_mm256_setzero_si256(); 8]; C]; R];
                for s in 0..n {
                    let sb = 8 * g + s;
                    let mut bs = [_mm256_setzero_si256(); C];
                    for c in 0..C {
                        bs[c] = load(bsums.as_ptr().add((ai[c] * nb + sb) * 16) as *const u8);
                    }
                    let halves = if T == Q6K { 2 } else { 1 };
                    for h in 0..halves {
                        let (v0, v1) = if T == Q6K { (4 * h, 4 * h + 4) } else { (0, 8) };
                        let mut acc = [[_mm256_setzero_si256(); C]; R];
                        for v in v0..v1 {
                            let mut av = [_mm256_setzero_si256(); C];
                            for c in 0..C {
                                av[c] =
                                    load(at.q.as_ptr().add(ai[c] * at.qlen + sb * 256 + 32 * v)
                                        as *const u8);
                            }
                            for (r, accr) in acc.iter_mut().enumerate() {
                                let wv = load(wt.q.as_ptr().add(r * wt.qlen + sb * 256 + 32 * v));
                                for c in 0..C {
                                    accr[c] = D::dp(accr[c], wv, av[c]);
                                }
                            }
                        }
                        for r in 0..R {
                            let o8 = (r * nb + sb) * 8;
                            let scales = if h == 0 { &wt.sa } else { &wt.sb };
                            let sc = load(scales.as_ptr().add(o8) as *const u8);
                            for c in 0..C {
                                let x = _mm256_mullo_epi32(acc[r][c], sc);
                                isv[r][c][s] = _mm256_add_epi32(isv[r][c][s], x);
                            }
                        }
                    }
                    for r in 0..R {
                        let s16 = load(wt.s16.as_ptr().add((r * nb + sb) * 16) as *const u8);
                        for c in 0..C {
                            let x = _mm256_madd_epi16(s16, bs[c]);
                            if T == Q6K {
                                // The −32 of every quant: 32·Σ sc_g·bsum_g.
                                let corr = _mm256_slli_epi32::<5>(x);
                                isv[r][c][s] = _mm256_sub_epi32(isv[r][c][s], corr);
                            } else {
                                msv[r][c][s] = x;
                            }
                        }
                    }
                }
                for r in 0..R {
                    let d = _mm256_loadu_ps(wt.d.as_ptr().add(r * wt.dlen + 8 * g));
                    for c in 0..C {
                        let ad = _mm256_loadu_ps(at.d.as_ptr().add(ai[c] * ng * 8 + 8 * g));
                        let isum = sums8(&isv[r][c]);
                        terms[r][c] = if T == Q6K {
                            _mm256_mul_ps(_mm256_mul_ps(d, ad), isum)
                        } else {
                            let dmin = _mm256_loadu_ps(wt.m.as_ptr().add(r * wt.dlen + 8 * g));
                            let msum = sums8(&msv[r][c]);
                            _mm256_mul_ps(
                                ad,
                                _mm256_sub_ps(_mm256_mul_ps(d, isum), _mm256_mul_ps(dmin, msum)),
                            )
                        };
                    }
                }
            } else {
                let mut acc = [[_mm256_setzero_si256(); C]; R];
                if biased(T) {
                    for c in 0..C {
                        let nbias =
                            load(at.neg_bias.as_ptr().add(ai[c] * ng * 8 + 8 * g) as *const u8);
                        for accr in acc.iter_mut() {
                            accr[c] = nbias;
                        }
                    }
                }
                for v in 0..8 {
                    let mut av = [_mm256_setzero_si256(); C];
                    for c in 0..C {
                        av[c] = load(
                            at.q.as_ptr().add(ai[c] * at.qlen + g * 256 + 32 * v) as *const u8
                        );
                    }
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let wv = load(wt.q.as_ptr().add(r * wt.qlen + g * 256 + 32 * v));
                        for c in 0..C {
                            accr[c] = D::dp(accr[c], wv, av[c]);
                        }
                    }
                }
                for r in 0..R {
                    let wd = _mm256_loadu_ps(wt.d.as_ptr().add(r * wt.dlen + 8 * g));
                    for c in 0..C {
                        let o = ai[c] * ng * 8 + 8 * g;
                        let ad = _mm256_loadu_ps(at.d.as_ptr().add(o));
                        let dot = _mm256_cvtepi32_ps(acc[r][c]);
                        terms[r][c] = if has_min(T) {
                            let wm = _mm256_loadu_ps(wt.m.as_ptr().add(r * wt.dlen + 8 * g));
                            let as_ = _mm256_loadu_ps(at.s.as_ptr().add(o));
                            _mm256_add_ps(
                                _mm256_mul_ps(_mm256_mul_ps(wd, ad), dot),
                                _mm256_mul_ps(wm, as_),
                            )
                        } else {
                            _mm256_mul_ps(_mm256_mul_ps(dot, wd), ad)
                        };
                    }
                }
            }
            // Block 8g + j's term into lane j; a short last group into lanes 0..n, the others
            // left as they are (`add_tail`), as every kernel adds them.
            for r in 0..R {
                for c in 0..C {
                    facc[r][c] = if n == 8 {
                        _mm256_add_ps(facc[r][c], terms[r][c])
                    } else {
                        add_tail(facc[r][c], terms[r][c], mask)
                    };
                }
            }
        }
        for (r, fr) in facc.iter().enumerate().take(live_r) {
            for (c, f) in fr.iter().enumerate().take(live_c) {
                put(r, c, reduce8(*f));
            }
        }
    }

    /// Every column of `ct` (weight rows of `src`, one after another) against every activation
    /// row, in tiles of R × C; short tiles at the ends repeat their last row and write only the
    /// real ones.
    #[inline(always)]
    unsafe fn drive<D: Dp, const T: u8, const R: usize, const C: usize>(
        at: &ActTiles,
        src: &[u8],
        row_bytes: usize,
        bsums: &[i16],
        ct: &mut [f32],
        skip: Option<usize>,
    ) {
        let m = at.m;
        let cols = ct.len() / m;
        let mut wt = Wt::new::<T, R>(at);
        let mut j0 = 0;
        while j0 < cols {
            let live_r = (cols - j0).min(R);
            for r in 0..R {
                let j = j0 + r.min(live_r - 1);
                wt.unpack::<T>(r, &src[j * row_bytes..(j + 1) * row_bytes]);
            }
            let mut i0 = 0;
            while i0 < m {
                let live_c = (m - i0).min(C);
                let mut ai = [0usize; C];
                for (c, a) in ai.iter_mut().enumerate() {
                    *a = i0 + c.min(live_c - 1);
                }
                let mut put = |r: usize, c: usize, v: f32| {
                    if skip != Some(j0 + r) {
                        ct[(j0 + r) * m + i0 + c] = v;
                    }
                };
                tile::<D, T, R, C>(&wt, at, bsums, ai, &mut put, live_r, live_c);
                i0 += C;
            }
            j0 += R;
        }
    }

    #[inline(always)]
    unsafe fn by_type<D: Dp, const R: usize, const C: usize>(
        at: &ActTiles,
        src: &[u8],
        row_bytes: usize,
        bsums: &[i16],
        ct: &mut [f32],
        skip: Option<usize>,
    ) {
        match at.ty {
            GgmlType::Q8_0 => drive::<D, Q8_0, R, C>(at, src, row_bytes, bsums, ct, skip),
            GgmlType::Q4_0 => drive::<D, Q4_0, R, C>(at, src, row_bytes, bsums, ct, skip),
            GgmlType::Q5_0 => drive::<D, Q5_0, R, C>(at, src, row_bytes, bsums, ct, skip),
            GgmlType::Q4_1 => drive::<D, Q4_1, R, C>(at, src, row_bytes, bsums, ct, skip),
            GgmlType::Q5_1 => drive::<D, Q5_1, R, C>(at, src, row_bytes, bsums, ct, skip),
            GgmlType::Q4K => drive::<D, Q4K, R, C>(at, src, row_bytes, bsums, ct, skip),
            GgmlType::Q6K => drive::<D, Q6K, R, C>(at, src, row_bytes, bsums, ct, skip),
            _ => {}
        }
        let _ = QK_K;
    }

    /// # Safety
    /// AVX2 and F16C; the lengths checked by `super::rows`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn rows_avx2(
        at: &ActTiles,
        src: &[u8],
        row_bytes: usize,
        bsums: &[i16],
        ct: &mut [f32],
        skip: Option<usize>,
    ) {
        by_type::<Madd, 2, 4>(at, src, row_bytes, bsums, ct, skip)
    }

    /// # Safety
    /// AVX2, F16C and AVX-VNNI; the lengths checked by `super::rows`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn rows_vex(
        at: &ActTiles,
        src: &[u8],
        row_bytes: usize,
        bsums: &[i16],
        ct: &mut [f32],
        skip: Option<usize>,
    ) {
        by_type::<Vex, 2, 4>(at, src, row_bytes, bsums, ct, skip)
    }

    /// # Safety
    /// AVX2, F16C, AVX512VL and AVX512-VNNI; the lengths checked by `super::rows`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn rows_evex(
        at: &ActTiles,
        src: &[u8],
        row_bytes: usize,
        bsums: &[i16],
        ct: &mut [f32],
        skip: Option<usize>,
    ) {
        by_type::<Evex, 2, 4>(at, src, row_bytes, bsums, ct, skip)
    }
}
