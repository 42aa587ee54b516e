//! The integer and float inner loops of the CPU fast path, one implementation per [`Kernel`].
//!
//! Only the i8 block dot products differ between kernels; everything around them (unpacking,
//! scales, accumulation order) is shared, so every kernel produces bit-identical results and the
//! tests can hold them to that.

use std::fmt;

/// Which inner loops run the integer dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust written so LLVM vectorises it (any architecture).
    Portable,
    /// aarch64 NEON: `vmull_s8` + `vpadalq_s16` (cores without dotprod: A53, A72).
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// aarch64 NEON with `sdot` (ARMv8.2 dotprod: A55, A76), through `asm!` because `vdotq_s32`
    /// is not stable Rust.
    #[cfg(target_arch = "aarch64")]
    NeonSdot,
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => "neon",
            #[cfg(target_arch = "aarch64")]
            Kernel::NeonSdot => "neon+sdot",
        }
    }

    /// Every kernel this CPU can run, best first.
    pub fn available() -> Vec<Kernel> {
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                vec![Kernel::NeonSdot, Kernel::Neon, Kernel::Portable]
            } else {
                vec![Kernel::Neon, Kernel::Portable]
            }
        }
        #[cfg(not(target_arch = "aarch64"))]
        {
            vec![Kernel::Portable]
        }
    }

    /// The best kernel for this CPU, chosen at run time (never a compile-time `+dotprod`, which
    /// would SIGILL on A72/A53 cores).
    pub fn detect() -> Kernel {
        Kernel::available()[0]
    }

    pub fn is_available(self) -> bool {
        Kernel::available().contains(&self)
    }

    /// `out[i] = Σ_{j<G} w[G·i+j] · a[G·i+j]` for every whole group of `G` (16 or 32).
    pub(crate) fn dots<const G: usize>(self, w: &[i8], a: &[i8], out: &mut [i32]) {
        debug_assert!(G == 16 || G == 32);
        match self {
            Kernel::Portable => {
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 was just detected on this CPU.
                    return unsafe { portable::dots_avx2::<G>(w, a, out) };
                }
                portable::dots::<G>(w, a, out)
            }
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => neon::dots::<G>(w, a, out),
            #[cfg(target_arch = "aarch64")]
            Kernel::NeonSdot => {
                // A `Kernel` is a plain value anyone can name, so the feature is re-checked here
                // (a cached atomic load) rather than trusted: running `sdot` without it is UB.
                if std::arch::is_aarch64_feature_detected!("dotprod") {
                    // SAFETY: dotprod was just detected on this CPU.
                    unsafe { neon::dots_sdot::<G>(w, a, out) }
                } else {
                    neon::dots::<G>(w, a, out)
                }
            }
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod portable {
    #[inline(always)]
    pub(super) fn dots<const G: usize>(w: &[i8], a: &[i8], out: &mut [i32]) {
        for ((wc, ac), o) in w.chunks_exact(G).zip(a.chunks_exact(G)).zip(out.iter_mut()) {
            // i16 products summed in i32: the shape LLVM turns into pmaddwd / smull+sadalp.
            *o = wc
                .iter()
                .zip(ac)
                .map(|(&x, &y)| (x as i16 * y as i16) as i32)
                .sum();
        }
    }

    /// The same source compiled with AVX2 (vpmaddwd on 16 lanes), chosen at run time; integer
    /// sums are exact, so the results are the same.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dots_avx2<const G: usize>(w: &[i8], a: &[i8], out: &mut [i32]) {
        dots::<G>(w, a, out)
    }
}

#[cfg(target_arch = "aarch64")]
pub(super) use neon::sdot;

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;
    use std::arch::asm;

    /// 16 products of one register pair, widened: i8·i8 fits i16 (|−128·−128| = 16384).
    #[inline(always)]
    unsafe fn dot16(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
        let hi = vmull_high_s8(w, a);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }

    pub(super) fn dots<const G: usize>(w: &[i8], a: &[i8], out: &mut [i32]) {
        for ((wc, ac), o) in w.chunks_exact(G).zip(a.chunks_exact(G)).zip(out.iter_mut()) {
            // SAFETY: each chunk is exactly G (16 or 32) bytes, so every 16-byte load is in
            // bounds; NEON is part of the aarch64 baseline.
            unsafe {
                let (pw, pa) = (wc.as_ptr(), ac.as_ptr());
                let mut acc = dot16(vdupq_n_s32(0), vld1q_s8(pw), vld1q_s8(pa));
                if G == 32 {
                    acc = dot16(acc, vld1q_s8(pw.add(16)), vld1q_s8(pa.add(16)));
                }
                *o = vaddvq_s32(acc);
            }
        }
    }

    /// `sdot` through `asm!` (the `vdotq_s32` intrinsic is not stable). Callers must run on a
    /// CPU with dotprod, inside a `#[target_feature(enable = "dotprod")]` function.
    #[inline(always)]
    pub(in crate::backend::cpu) unsafe fn sdot(
        acc: int32x4_t,
        w: int8x16_t,
        a: int8x16_t,
    ) -> int32x4_t {
        let mut acc = acc;
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            a = in(vreg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// # Safety
    /// The CPU must have the dotprod extension.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn dots_sdot<const G: usize>(w: &[i8], a: &[i8], out: &mut [i32]) {
        for ((wc, ac), o) in w.chunks_exact(G).zip(a.chunks_exact(G)).zip(out.iter_mut()) {
            let (pw, pa) = (wc.as_ptr(), ac.as_ptr());
            // SAFETY: chunks are exactly G bytes (see `dots`); dotprod is the caller's promise.
            unsafe {
                let mut acc = sdot(vdupq_n_s32(0), vld1q_s8(pw), vld1q_s8(pa));
                if G == 32 {
                    acc = sdot(acc, vld1q_s8(pw.add(16)), vld1q_s8(pa.add(16)));
                }
                *o = vaddvq_s32(acc);
            }
        }
    }
}

/// Independent f32 accumulators of [`f32_lanes`]: enough that LLVM vectorises without having to
/// reassociate.
pub(crate) const LANES: usize = 16;

/// `acc[j] += a[LANES·i + j] · b[LANES·i + j]` over the whole groups of `LANES`; returns the plain
/// sum of the products left over.
#[inline(always)]
pub(crate) fn f32_lanes(acc: &mut [f32; LANES], a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    tail
}

/// f32 dot product in [`LANES`] independent lanes.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let tail = f32_lanes(&mut acc, a, b);
    acc.iter().sum::<f32>() + tail
}

/// The canonical reduction order of every quantised dot (ARCHITECTURE.md, "CPU reduction
/// order"): block b's scale term is added to accumulator `b % BLOCK_LANES` (each starting at
/// +0.0, blocks in increasing order), and the accumulators are reduced by [`reduce_lanes`]. Eight,
/// because that is one AVX2 register and two NEON registers (two independent add chains on the
/// A76's two FP pipes), and enough independent adds to hide the f32 add latency on both.
pub(crate) const BLOCK_LANES: usize = 8;

/// The fixed tree over the [`BLOCK_LANES`] accumulators: `s_j = acc_j + acc_{j+4}`, then
/// `(s_0 + s_2) + (s_1 + s_3)` (the halves of a 256-bit register, then of a 128-bit one).
#[inline(always)]
pub(crate) fn reduce_lanes(acc: &[f32; BLOCK_LANES]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|j| acc[j] + acc[j + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Σ `term(b)` for b in 0..nb in the canonical order. `SERIAL` (tests only: the fault the order
/// tests must catch) adds every term to one running sum instead.
#[inline(always)]
pub(crate) fn sum_blocks<const SERIAL: bool>(nb: usize, mut term: impl FnMut(usize) -> f32) -> f32 {
    if SERIAL {
        return (0..nb).fold(0.0f32, |s, b| s + term(b));
    }
    let mut acc = [0.0f32; BLOCK_LANES];
    let full = nb / BLOCK_LANES * BLOCK_LANES;
    let mut b = 0;
    while b < full {
        for (j, a) in acc.iter_mut().enumerate() {
            *a += term(b + j);
        }
        b += BLOCK_LANES;
    }
    for (j, a) in acc.iter_mut().enumerate().take(nb - full) {
        *a += term(full + j);
    }
    reduce_lanes(&acc)
}
