//! The fast path against the reference, on every type and kernel this CPU runs. Under
//! `cargo xtask test --stage aarch64` these run as aarch64 code on a cortex-a76 (sdot) and a
//! cortex-a72 (NEON without dotprod). Sizes stay small: qemu-user is slow.

use super::*;
use crate::backend::{find_poison, run_checked, POISON_BITS};
use crate::quant::quantize_to_vec;
use half::{bf16, f16};

/// llama.cpp's `test-backend-ops` bar for MUL_MAT.
const MAX_NMSE: f64 = 5e-4;

/// SplitMix64: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [−1, 1).
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// N rows of K elements of `ty`. Types with a reference quantiser get quantised random values;
/// K-quants (which have none here) get random bytes with small positive scales, which is every
/// bit pattern the dequantiser has to handle.
fn make_weight(ty: GgmlType, k: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
    let vals: Vec<f32> = (0..k * n).map(|_| rng.f32()).collect();
    match ty {
        GgmlType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            let bb = ty.block_bytes();
            let mut out: Vec<u8> = (0..k / QK * n * bb).map(|_| rng.byte()).collect();
            for b in out.chunks_exact_mut(bb) {
                let d = f16::from_f32(0.001 + 0.01 * rng.f32().abs()).to_le_bytes();
                let dmin = f16::from_f32(0.001 + 0.01 * rng.f32().abs()).to_le_bytes();
                if ty == GgmlType::Q6K {
                    b[208..210].copy_from_slice(&d);
                } else {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&dmin);
                }
            }
            out
        }
        _ => quantize_to_vec(ty, &vals).expect("quantisable type"),
    }
}

const QK: usize = crate::quant::QK_K;

fn weight<'a>(ty: GgmlType, k: usize, n: usize, data: &'a [u8]) -> Weight<'a> {
    Weight {
        name: "test.weight",
        ty,
        k,
        n,
        data,
    }
}

fn run(backend: &dyn Backend, w: &Weight<'_>, a: &[f32], m: usize) -> Vec<f32> {
    let (p, measured) = crate::ledger::measure(|| backend.prepare(w));
    let p = p.expect("prepare");
    assert_eq!(
        p.arrival(),
        Arrival::Borrowed,
        "{} copied a weight",
        backend.name()
    );
    // Borrowed is measured, not taken on trust: the range it reads is the weight's, and
    // prepare left no more than its bookkeeping allocated.
    assert_eq!(p.reads_from(), Some(crate::ledger::address_range(w.data)));
    assert!(
        measured.heap_bytes <= crate::ledger::PREPARE_ALLOWANCE,
        "{} prepare left {} bytes allocated",
        backend.name(),
        measured.heap_bytes
    );
    let mut c = vec![0.0f32; m * w.n];
    run_checked(backend, w, &*p, a, m, &mut c)
        .unwrap_or_else(|e| panic!("{} on {}: {e:#}", backend.name(), w.ty));
    c
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    err / norm
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (M, K, N, threads): M = 1, 7, 8, 64; K = 32 and 4096 (K-quants round K up to 256); N not a
/// multiple of the thread count. K = 4096 only with small N.
const SHAPES: [(usize, usize, usize, usize); 8] = [
    (1, 32, 7, 3),
    (7, 32, 10, 4),
    (8, 64, 13, 3),
    (64, 128, 5, 2),
    (8, 256, 17, 4),
    (1, 4096, 3, 2),
    (7, 4096, 2, 1),
    (64, 4096, 3, 2),
];

/// Every configuration of the CPU backend this host runs, with `threads` threads: each kernel,
/// and on x86 the portable kernel once per register-tile tier (`gemm.rs`: AVX512-VNNI,
/// AVX-VNNI, AVX2, those the CPU has) and once with no tiles (the unpacked path they replace
/// for M > 1), so each of them is held to the same bits.
fn every_backend(threads: usize) -> Vec<CpuBackend> {
    let mut all = Vec::new();
    for kernel in Kernel::available() {
        let cpu = CpuBackend::new()
            .with_threads(threads)
            .with_kernel(kernel)
            .expect("available kernel");
        if kernel == Kernel::Portable {
            for t in super::gemm::Tier::available() {
                let mut c = cpu.clone();
                c.tier = Some(Some(t));
                all.push(c);
            }
            let mut c = cpu.clone();
            c.tier = Some(None);
            all.push(c);
        } else {
            all.push(cpu);
        }
    }
    all
}

/// A backend's kernel and register-tile tier, for messages.
fn label(cpu: &CpuBackend) -> String {
    match cpu.tier {
        Some(Some(t)) => format!("{} tiles {t:?}", cpu.kernel()),
        Some(None) => format!("{} no tiles", cpu.kernel()),
        None => format!("{}", cpu.kernel()),
    }
}

#[test]
fn every_fast_kernel_matches_the_reference_on_every_type() {
    let mut rng = Rng(7);
    for ty in CPU_TYPES {
        for (m, k, n, threads) in SHAPES {
            let k = if ty.block_elems() == QK {
                k.div_ceil(QK) * QK
            } else {
                k
            };
            let data = make_weight(ty, k, n, &mut rng);
            let w = weight(ty, k, n, &data);
            let a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            let want = run(&CpuRefBackend, &w, &a, m);
            let mut first: Option<(String, Vec<f32>)> = None;
            for cpu in every_backend(threads) {
                let kernel = label(&cpu);
                let got = run(&cpu, &w, &a, m);
                let e = nmse(&got, &want);
                assert!(
                    e <= MAX_NMSE,
                    "{ty} {kernel} M={m} K={k} N={n}: NMSE {e:e} > {MAX_NMSE:e}"
                );
                // Kernels differ only in how they compute exact integer dots, so they must agree
                // to the bit.
                match &first {
                    None => first = Some((kernel, got)),
                    Some((k0, g0)) => assert_eq!(
                        bits(&got),
                        bits(g0),
                        "{ty} M={m} K={k} N={n}: {kernel} and {k0} differ"
                    ),
                }
            }
        }
    }
}

#[test]
fn thread_count_does_not_change_a_bit() {
    let mut rng = Rng(11);
    // The second shape is big enough that the activations are quantised on several threads too.
    for (m, k, n) in [(3, 64, 11), (67, 512, 11)] {
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::F16] {
            if k % ty.block_elems() != 0 {
                continue;
            }
            let data = make_weight(ty, k, n, &mut rng);
            let w = weight(ty, k, n, &data);
            let a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            let one = run(&CpuBackend::new().with_threads(1), &w, &a, m);
            for t in [2, 3, 4, 16] {
                let many = run(&CpuBackend::new().with_threads(t), &w, &a, m);
                assert_eq!(bits(&one), bits(&many), "{ty} M={m} with {t} threads");
            }
        }
    }
}

/// Weights with power-of-two scales and activations that are exactly Q8_0-representable (each
/// block a multiple of a power of two with a ±127 in it): quantising the activations loses
/// nothing and every product and partial sum is exact, so fast and reference agree to the bit.
#[test]
fn exact_integer_math_is_bit_exact() {
    let mut rng = Rng(3);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0] {
        for (m, k, n) in [(1, 32, 5), (7, 4096, 2), (8, 256, 9)] {
            let bb = ty.block_bytes();
            let mut data: Vec<u8> = (0..k / 32 * n * bb).map(|_| rng.byte()).collect();
            for b in data.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&f16::from_f32(1.0 / 64.0).to_le_bytes());
            }
            let w = weight(ty, k, n, &data);
            let mut a = Vec::with_capacity(m * k);
            for i in 0..m {
                let scale = 1.0 / (1 << (3 + i % 4)) as f32;
                for blk in 0..k / 32 {
                    for j in 0..32 {
                        let q = if j == blk % 32 {
                            if rng.byte() & 1 == 0 {
                                127
                            } else {
                                -127
                            }
                        } else {
                            (rng.byte() as i8).max(-127) as i32
                        };
                        a.push(q as f32 * scale);
                    }
                }
            }
            let want = run(&CpuRefBackend, &w, &a, m);
            for kernel in Kernel::available() {
                let cpu = CpuBackend::new()
                    .with_threads(2)
                    .with_kernel(kernel)
                    .unwrap();
                let got = run(&cpu, &w, &a, m);
                assert_eq!(bits(&got), bits(&want), "{ty} {kernel} M={m} K={k} N={n}");
            }
        }
    }
}

/// Every kernel's block dots against plain i32 arithmetic, including the extremes (−128·−128).
#[test]
fn block_dots_are_exact_on_every_kernel() {
    let mut rng = Rng(5);
    let mut w: Vec<i8> = (0..256).map(|_| rng.byte() as i8).collect();
    let mut a: Vec<i8> = (0..256).map(|_| rng.byte() as i8).collect();
    w[..32].fill(-128);
    a[..32].fill(-128);
    w[32..64].fill(127);
    a[32..64].fill(-128);
    for kernel in Kernel::available() {
        for g in [16usize, 32] {
            let want: Vec<i32> = w
                .chunks(g)
                .zip(a.chunks(g))
                .map(|(x, y)| x.iter().zip(y).map(|(&p, &q)| p as i32 * q as i32).sum())
                .collect();
            let mut got = vec![0i32; 256 / g];
            if g == 16 {
                kernel.dots::<16>(&w, &a, &mut got);
            } else {
                kernel.dots::<32>(&w, &a, &mut got);
            }
            assert_eq!(got, want, "{kernel} groups of {g}");
        }
    }
}

/// `cargo xtask test` runs the aarch64 tests on a cortex-a76 with `KILN_EXPECT_DOTPROD=1` and a
/// cortex-a72 with `=0`, so the stage that is meant to exercise the fallback really does.
#[test]
fn kernel_selection_matches_what_the_harness_expects() {
    let cpu = CpuBackend::new();
    let facts = cpu
        .probe()
        .expect("the CPU backend is always present")
        .facts;
    let reported = facts
        .iter()
        .find(|(k, _)| k == "kernel")
        .map(|(_, v)| v.clone());
    assert_eq!(reported.as_deref(), Some(cpu.kernel().name()));
    match std::env::var("KILN_EXPECT_DOTPROD").as_deref() {
        Ok("1") => assert_eq!(cpu.kernel().name(), "neon+sdot"),
        Ok("0") => {
            assert_ne!(cpu.kernel().name(), "neon+sdot");
            if cfg!(target_arch = "aarch64") {
                assert_eq!(cpu.kernel().name(), "neon");
            }
        }
        _ => {}
    }
}

/// A kernel that skips an output (here: column 5, deliberately) returns Ok, and `run_checked`
/// still turns it into an error because the column kept its poison.
#[test]
fn a_skipped_row_is_caught_by_the_poison() {
    let mut rng = Rng(9);
    let (k, n) = (64, 9);
    let data = make_weight(GgmlType::Q4_0, k, n, &mut rng);
    let w = weight(GgmlType::Q4_0, k, n, &data);
    for m in [1, 3] {
        let a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let mut broken = CpuBackend::new().with_threads(2);
        broken.skip_column = Some(5);
        let p = broken.prepare(&w).unwrap();
        let mut c = vec![f32::from_bits(POISON_BITS); m * n];
        broken
            .run(&w, &*p, &a, m, &mut c)
            .expect("the broken kernel itself reports success");
        assert_eq!(find_poison(&c), Some((5, m)), "M={m}");
        let mut c = vec![0.0f32; m * n];
        let err = run_checked(&broken, &w, &*p, &a, m, &mut c).expect_err("poison must be caught");
        let msg = format!("{err:#}");
        assert!(msg.contains("untouched") && msg.contains("cpu"), "{msg}");
        let healthy = CpuBackend::new().with_threads(2);
        run_checked(&healthy, &w, &*p, &a, m, &mut c).expect("healthy kernel passes");
    }
}

#[test]
fn declines_and_bad_weights_are_named_errors() {
    let cpu = CpuBackend::new();
    let op = |ty, k| MatmulOp { m: 1, k, n: 4, ty };
    assert_eq!(
        cpu.supports(&op(GgmlType::Q2K, 256)),
        Err(Decline::WeightType { ty: "Q2_K".into() })
    );
    assert_eq!(
        cpu.supports(&op(GgmlType::Q4_0, 48)),
        Err(Decline::KNotAligned { k: 48, need: 32 })
    );
    assert_eq!(cpu.supports(&op(GgmlType::Q6K, 512)), Ok(()));
    assert_eq!(
        CpuRefBackend.supports(&op(GgmlType::Iq4Nl, 32)),
        Err(Decline::WeightType {
            ty: "IQ4_NL".into()
        })
    );

    // A weight whose bytes are one short is refused at prepare and at run, never read past.
    let data = vec![0u8; 18 * 4 - 1];
    let w = weight(GgmlType::Q4_0, 32, 4, &data);
    let err = cpu.prepare(&w).err().expect("short weight refused");
    assert!(format!("{err:#}").contains("71 bytes"), "{err:#}");
    let good = vec![0u8; 18 * 4];
    let wg = weight(GgmlType::Q4_0, 32, 4, &good);
    let p = cpu.prepare(&wg).unwrap();
    let mut c = vec![0.0f32; 4];
    assert!(cpu.run(&w, &*p, &[0.0; 32], 1, &mut c).is_err());
    // A prepared weight for another shape is refused.
    let w8 = weight(GgmlType::Q4_0, 64, 2, &good);
    assert!(cpu.run(&w8, &*p, &[0.0; 64], 1, &mut c[..2]).is_err());
    // So is one prepared over other bytes: the range the ledger checked is the range read.
    let other = good.clone();
    let wo = weight(GgmlType::Q4_0, 32, 4, &other);
    let err = cpu.run(&wo, &*p, &[0.0; 32], 1, &mut c).unwrap_err();
    assert!(
        format!("{err:#}").contains("was prepared over bytes at"),
        "{err:#}"
    );
}

#[test]
fn forcing_an_unavailable_kernel_is_an_error_and_f32_weights_need_no_alignment() {
    #[cfg(not(target_arch = "aarch64"))]
    assert!(Kernel::available() == vec![Kernel::Portable]);
    #[cfg(target_arch = "aarch64")]
    if !Kernel::NeonSdot.is_available() {
        let err = CpuBackend::new().with_kernel(Kernel::NeonSdot).err();
        assert!(err.is_some(), "sdot forced on a CPU without dotprod");
    }
    // F32 bytes at an odd address: read with from_le_bytes, never cast.
    let mut rng = Rng(1);
    let mut buf = vec![0u8; 1];
    buf.extend(make_weight(GgmlType::F32, 32, 3, &mut rng));
    let w = weight(GgmlType::F32, 32, 3, &buf[1..]);
    let a: Vec<f32> = (0..64).map(|_| rng.f32()).collect();
    let got = run(&CpuBackend::new(), &w, &a, 2);
    let want = run(&CpuRefBackend, &w, &a, 2);
    assert!(nmse(&got, &want) < 1e-10);
}

#[test]
fn f16_widening_is_exact_for_every_bit_pattern() {
    for h in 0..=u16::MAX {
        let want = f16::from_bits(h).to_f32();
        let got = super::fast::f16_bits_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
        }
    }
}

/// M = 1 runs the fused dots on the packed bytes, M > 1 the unpacked tiles (or, where `takes_m`,
/// the fused path's own M > 1 loop): the same row, run alone and as both rows of an M = 2 run,
/// must give the same bits, on every kernel, for every type the fused path takes with some
/// kernel (each kernel's bits are also held to the others' by
/// `every_fast_kernel_matches_the_reference_on_every_type`). Weights use every byte pattern (extreme nibbles and 5th bits, Q8_0's
/// −128); K = 544, 128 and 96 (17, 4 and 3 blocks), and 547 for F16, leave every tail of x86's
/// four-block groups, the F16 chunking and the lanes.
#[test]
fn fused_decode_dots_equal_the_unpacked_path() {
    let mut rng = Rng(13);
    let n = 9;
    let fused = |t| {
        Kernel::available()
            .into_iter()
            .any(|k| super::fused::supports(k, t))
    };
    for ty in CPU_TYPES.into_iter().filter(|&t| fused(t)) {
        // F16 rows of 547: a tail after the 16 lanes too. Blocks: 17 (groups of four and a
        // tail, as x86's AVX2 path takes them), 4 (no tail), 3 (only the tail).
        let ks: &[usize] = if ty == GgmlType::F16 {
            &[547]
        } else if ty.block_elems() == QK {
            // K-quants (where the fused path takes them): 9, 1 and 3 super-blocks.
            &[9 * QK, QK, 3 * QK]
        } else {
            &[544, 128, 96]
        };
        for &k in ks {
            let data: Vec<u8> = match ty {
                GgmlType::F16 | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
                    make_weight(ty, k, n, &mut rng)
                }
                _ => {
                    let bb = ty.block_bytes();
                    let mut d: Vec<u8> = (0..k / 32 * n * bb).map(|_| rng.byte()).collect();
                    for b in d.chunks_exact_mut(bb) {
                        b[..2]
                            .copy_from_slice(&f16::from_f32(0.01 + 0.01 * rng.f32()).to_le_bytes());
                        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                            b[2..4].copy_from_slice(&f16::from_f32(0.02 * rng.f32()).to_le_bytes());
                        }
                    }
                    d
                }
            };
            let w = weight(ty, k, n, &data);
            let a: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
            let a2: Vec<f32> = a.iter().chain(&a).copied().collect();
            let want = run(&CpuRefBackend, &w, &a, 1);
            for kernel in Kernel::available() {
                let cpu = CpuBackend::new()
                    .with_threads(2)
                    .with_kernel(kernel)
                    .unwrap();
                let one = run(&cpu, &w, &a, 1);
                let two = run(&cpu, &w, &a2, 2);
                assert_eq!(bits(&one), bits(&two[..n]), "{ty} {kernel} K={k}");
                assert_eq!(bits(&one), bits(&two[n..]), "{ty} {kernel} K={k}");
                let e = nmse(&one, &want);
                assert!(e <= MAX_NMSE, "{ty} {kernel} K={k}: NMSE {e:e}");
            }
        }
    }
}

/// The block terms of weight row `w` (whole blocks of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 row) with
/// activation row `row`, written from ggml's block layouts here, apart from the kernels: the
/// integer dot of each block in i32, scaled by the formula ARCHITECTURE.md states.
fn oracle_terms(
    ty: GgmlType,
    w: &[u8],
    act: &super::fast::Activations<'_>,
    row: usize,
) -> Vec<f32> {
    let k = act.k;
    let nb = k / 32;
    let h = |b: &[u8], at: usize| f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    let bb = ty.block_bytes();
    (0..nb)
        .map(|b| {
            let blk = &w[b * bb..(b + 1) * bb];
            let aq = &act.qs[row * k + 32 * b..row * k + 32 * b + 32];
            let ad = act.d[row * nb + b];
            // (quants, bias, 5th bits, offset of the quants, has m)
            let q: Vec<i32> = match ty {
                GgmlType::Q8_0 => blk[2..34].iter().map(|&x| x as i8 as i32).collect(),
                _ => {
                    let (off, qh, bias) = match ty {
                        GgmlType::Q4_0 => (2, 0u32, 8),
                        GgmlType::Q4_1 => (4, 0, 0),
                        GgmlType::Q5_0 => {
                            (6, u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]), 16)
                        }
                        GgmlType::Q5_1 => {
                            (8, u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]), 0)
                        }
                        _ => unreachable!("oracle_terms takes the 32-element quant types"),
                    };
                    (0..32)
                        .map(|j| {
                            let byte = blk[off + j % 16];
                            let nib = if j < 16 { byte & 0xF } else { byte >> 4 };
                            (nib as i32 | (((qh >> j) & 1) as i32) << 4) - bias
                        })
                        .collect()
                }
            };
            let dot: i32 = q.iter().zip(aq).map(|(&x, &y)| x * y as i32).sum();
            match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    (h(blk, 0) * ad) * dot as f32 + h(blk, 2) * act.s[row * nb + b]
                }
                _ => dot as f32 * h(blk, 0) * ad,
            }
        })
        .collect()
}

/// The super-block terms of a Q4_K/Q5_K/Q6_K weight row with Q8_K activation row `row`, from
/// ggml's layouts (`dequantize_row_q*_K`) here, apart from the kernels: per super-block the exact
/// integer sums, then ARCHITECTURE.md's formula (Q4_K/Q5_K `d_a·(d_w·Σsc·dot − dmin_w·Σmin·bsum)`,
/// Q6_K `d_w·d_a·Σsc·dot`).
fn oracle_terms_k(
    ty: GgmlType,
    w: &[u8],
    act: &super::fast::Activations<'_>,
    row: usize,
) -> Vec<f32> {
    let k = act.k;
    let nb = k / QK;
    let h = |b: &[u8], at: usize| f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    let bb = ty.block_bytes();
    (0..nb)
        .map(|b| {
            let blk = &w[b * bb..(b + 1) * bb];
            let aq = &act.qs[row * k + QK * b..row * k + QK * b + QK];
            let ad = act.d[row * nb + b];
            if ty == GgmlType::Q6K {
                let mut isum = 0i32;
                for e in 0..QK {
                    let (half, l) = (e / 128, e % 128);
                    let (quarter, l) = (l / 32, l % 32);
                    let ql = blk[64 * half + l + if quarter % 2 == 1 { 32 } else { 0 }];
                    let low = if quarter < 2 { ql & 0xF } else { ql >> 4 };
                    let high = (blk[128 + 32 * half + l] >> (2 * quarter)) & 3;
                    let q = (low | (high << 4)) as i32 - 32;
                    isum += blk[192 + e / 16] as i8 as i32 * q * aq[e] as i32;
                }
                return h(blk, 208) * ad * isum as f32;
            }
            let (mut isum, mut msum) = (0i32, 0i32);
            for j in 0..8 {
                let (sc, m) = crate::quant::get_scale_min_k4(j, &blk[4..16]);
                let (mut dot, mut asum) = (0i32, 0i32);
                for l in 0..32 {
                    let e = 32 * j + l;
                    let byte = if ty == GgmlType::Q5K {
                        blk[48 + 32 * (j / 2) + l]
                    } else {
                        blk[16 + 32 * (j / 2) + l]
                    };
                    let mut q = if j % 2 == 0 { byte & 0xF } else { byte >> 4 } as i32;
                    if ty == GgmlType::Q5K {
                        q |= (((blk[16 + l] >> j) & 1) as i32) << 4;
                    }
                    dot += q * aq[e] as i32;
                    asum += aq[e] as i32;
                }
                isum += sc as i32 * dot;
                msum += m as i32 * asum;
            }
            ad * (h(blk, 0) * isum as f32 - h(blk, 2) * msum as f32)
        })
        .collect()
}

/// The canonical order as ARCHITECTURE.md states it, for `lanes` = 8; `lanes` = 1 is the old
/// one-running-sum order, the fault the tests below must tell apart.
fn oracle_sum(terms: &[f32], lanes: usize) -> f32 {
    let mut acc = vec![0.0f32; lanes];
    for (b, t) in terms.iter().enumerate() {
        acc[b % lanes] += t;
    }
    match lanes {
        8 => ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])),
        1 => acc[0],
        _ => unreachable!("8 lanes, or the one-sum fault"),
    }
}

/// The quantised types (every CPU type but the float ones, whose rows use the f32 lanes).
fn quant_types() -> impl Iterator<Item = GgmlType> {
    CPU_TYPES
        .into_iter()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16))
}

/// K of 19 blocks (two groups of eight and a tail of three), 9 super-blocks for the K-quants.
fn order_k(ty: GgmlType) -> usize {
    if ty.block_elems() == QK {
        9 * QK
    } else {
        19 * 32
    }
}

/// Every output of `cpu` at M = 1, 3, 8, 64 against the oracle's order with `lanes`
/// accumulators, to the bit; the first difference as an error.
fn check_oracle_order(cpu: &CpuBackend, lanes: usize) -> Result<(), String> {
    let mut rng = Rng(17);
    let n = 5;
    for ty in quant_types() {
        let k = order_k(ty);
        let data = make_weight(ty, k, n, &mut rng);
        let w = weight(ty, k, n, &data);
        let row_bytes = ty.block_bytes() * (k / ty.block_elems());
        for m in [1, 3, 8, 64] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            let got = run(cpu, &w, &a, m);
            let fmt = super::fast::act_format(ty).expect("a quant type");
            let act = super::fast::Activations::quantize(fmt, &a, k);
            for i in 0..m {
                for j in 0..n {
                    let rowb = &data[j * row_bytes..][..row_bytes];
                    let terms = if ty.block_elems() == QK {
                        oracle_terms_k(ty, rowb, &act, i)
                    } else {
                        oracle_terms(ty, rowb, &act, i)
                    };
                    let want = oracle_sum(&terms, lanes);
                    let g = got[i * n + j];
                    if g.to_bits() != want.to_bits() {
                        return Err(format!(
                            "{ty} {} M={m} row {i} col {j}: {g:e} ≠ oracle {want:e}",
                            label(cpu)
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every kernel, at every M, gives exactly the sum the canonical order defines.
#[test]
fn every_kernel_at_every_m_sums_in_the_canonical_order() {
    for threads in [1, 2] {
        for cpu in every_backend(threads) {
            check_oracle_order(&cpu, 8).unwrap_or_else(|e| panic!("{threads} threads: {e}"));
        }
    }
}

/// The order check can fail: the one-running-sum order (kiln's old one) is told apart from the
/// kernels' results, and a backend whose M > 1 path keeps that order is caught.
#[test]
fn a_changed_summation_order_fails_the_order_checks() {
    let cpu = CpuBackend::new().with_threads(2);
    let err = check_oracle_order(&cpu, 1).expect_err("the one-sum order must differ");
    assert!(err.contains("oracle"), "{err}");
    let mut broken = CpuBackend::new().with_threads(2);
    broken.serial_order = true;
    let err = check_oracle_order(&broken, 8).expect_err("a serial M > 1 path must be caught");
    assert!(
        !err.contains("M=1 "),
        "the fault is in the M > 1 path only: {err}"
    );
    let err = check_batch_invariance(&[broken]).expect_err("and changes a row with its batch");
    assert!(err.contains("batch"), "{err}");
}

/// Row `x` alone (M = 1, one thread) against `x` at positions 0, middle and last of batches of
/// M = 3, 8, 64 random rows, on every backend given; the first difference as an error.
fn check_batch_invariance(backends: &[CpuBackend]) -> Result<(), String> {
    let mut rng = Rng(23);
    let n = 6;
    let types = quant_types().chain([GgmlType::F16, GgmlType::F32, GgmlType::Bf16]);
    for ty in types {
        let k = order_k(ty);
        let data = make_weight(ty, k, n, &mut rng);
        let w = weight(ty, k, n, &data);
        let x: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
        let alone = run(&CpuBackend::new().with_threads(1), &w, &x, 1);
        for cpu in backends {
            let one = run(cpu, &w, &x, 1);
            if bits(&one) != bits(&alone) {
                return Err(format!("{ty} {}: M=1 differs from one thread", label(cpu)));
            }
            for m in [3, 8, 64] {
                for p in [0, m / 2, m - 1] {
                    let mut a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
                    a[p * k..(p + 1) * k].copy_from_slice(&x);
                    let got = run(cpu, &w, &a, m);
                    if bits(&got[p * n..(p + 1) * n]) != bits(&alone) {
                        return Err(format!(
                            "{ty} {} {} threads: row at {p} of a batch of {m} differs from it alone",
                            label(cpu),
                            cpu.threads()
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// A row's output is the same bits whatever rows share its batch, wherever it sits in it, on
/// every kernel and thread count.
#[test]
fn a_rows_output_does_not_depend_on_its_batch() {
    let backends: Vec<CpuBackend> = [1, 2].into_iter().flat_map(every_backend).collect();
    check_batch_invariance(&backends).unwrap_or_else(|e| panic!("{e}"));
}

/// On aarch64 the NEON kernels take M > 1 through `fused::rows` for the five unpacked types and
/// the K-quants (`kquant::neon`'s super-block dots), and M = 1 for the K-quants too (so the
/// order and batch checks above run those paths), and the portable kernel takes neither: it
/// keeps the tile path.
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_kernels_take_m_for_the_unpacked_types() {
    use super::fused::{supports, takes_m};
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ] {
        for kernel in [Kernel::Neon, Kernel::NeonSdot] {
            assert!(takes_m(kernel, ty), "{ty} {kernel}");
            assert!(supports(kernel, ty), "{ty} {kernel}");
        }
        assert!(!takes_m(Kernel::Portable, ty), "{ty}");
    }
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        assert!(!supports(Kernel::Portable, ty), "{ty}");
    }
    for kernel in [Kernel::Neon, Kernel::NeonSdot] {
        assert!(!takes_m(kernel, GgmlType::Q2K), "{kernel}");
        assert!(!supports(kernel, GgmlType::Q2K), "{kernel}");
    }
}

/// On x86 the register tiles take M > 1 for the types they are written for, on every tier this
/// CPU has (so the order and batch checks above run them, not a silent fallback), and decline
/// the others and M = 1.
#[test]
fn register_tiles_take_their_types_on_every_tier() {
    use super::gemm::{rows, ActTiles, Tier};
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        assert!(Tier::available().contains(&Tier::Avx2));
    }
    #[cfg(not(target_arch = "x86_64"))]
    assert!(Tier::available().is_empty());
    let mut rng = Rng(29);
    for tier in Tier::available() {
        for ty in quant_types() {
            let k = order_k(ty);
            let n = 3;
            let data = make_weight(ty, k, n, &mut rng);
            let row_bytes = ty.block_bytes() * (k / ty.block_elems());
            for m in [1, 3] {
                let a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
                let fmt = super::fast::act_format(ty).expect("a quant type");
                let act = super::fast::Activations::quantize(fmt, &a, k);
                let tiles = ActTiles::new(tier, ty, &act);
                assert_eq!(tiles.is_some(), tier.takes(ty), "{ty} {tier:?}");
                let Some(tiles) = tiles else { continue };
                let mut ct = vec![f32::NAN; m * n];
                let done = rows(&tiles, &data, ty, row_bytes, &act, 0, &mut ct, None);
                assert_eq!(done, m > 1, "{ty} {tier:?} M={m}");
                if done {
                    assert!(ct.iter().all(|v| v.is_finite()), "{ty} {tier:?} M={m}");
                }
            }
        }
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
        ] {
            assert!(tier.takes(ty), "{ty} {tier:?}");
        }
        for ty in [GgmlType::Q4K, GgmlType::Q6K] {
            assert!(tier.takes(ty), "{ty} {tier:?}");
        }
        assert_eq!(tier.takes(GgmlType::Q8_0), tier != Tier::Avx2);
    }
}
