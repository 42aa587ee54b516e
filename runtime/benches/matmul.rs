//! `cargo xtask bench matmul` (or `cargo bench -p kiln-runtime --bench matmul`): the CPU matmul
//! backend at model shapes, against the machine's memory read bandwidth measured in the same run.
//!
//! Headline: at M = 1 (decode) a matmul streams every weight byte once per token, so weight GB/s
//! divided by the read bandwidth says how close the kernel gets to the memory ceiling.
//! Set `KILN_BENCH_THREADS` to pin the thread count (default: all cores), `KILN_BENCH_TYPES`
//! (e.g. `Q4_0,F16`) and `KILN_BENCH_M` (e.g. `1`) to run a subset.

use half::{bf16, f16};
use kiln_runtime::backend::cpu::{CpuBackend, CpuRefBackend};
use kiln_runtime::backend::{run_checked, Backend, Weight};
use kiln_runtime::quant::{quantize_to_vec, GgmlType};
use std::time::{Duration, Instant};

/// SplitMix64 for weights and activations: no dependency for random numbers.
struct Rng(u64);

impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn make_weight(ty: GgmlType, vals: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => quantize_to_vec(ty, vals).expect("bench types are quantisable"),
    }
}

/// Read bandwidth in GB/s, the same measurement `kiln bench` makes.
fn read_bandwidth(threads: usize) -> f64 {
    kiln_runtime::membw::read_bandwidth(threads) / 1e9
}

/// The largest CPU cache (sysfs), if the kernel says: weights smaller than it are streamed from
/// cache, not DRAM, once warm.
fn last_level_cache() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let size = std::fs::read_to_string(e.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(n) => (n, 1024),
            None => match size.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (size, 1),
            },
        };
        num.parse::<u64>().ok().map(|v| v * mult)
    })
    .max()
}

/// Seconds per call: at least `reps` calls and at least `min` of wall time, best of them.
fn time_it(min: Duration, reps: usize, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut best = f64::MAX;
    let mut n = 0;
    while n < reps || start.elapsed() < min {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        n += 1;
    }
    best
}

/// Whether `item` is in the comma-separated list in env `var` (everything when unset).
fn selected(var: &str, item: &str) -> bool {
    std::env::var(var).map_or(true, |v| v.split(',').any(|x| x.trim() == item))
}

fn run_once(backend: &dyn Backend, w: &Weight<'_>, a: &[f32], m: usize, c: &mut [f32]) {
    let p = backend.prepare(w).expect("prepare");
    if let Err(e) = run_checked(backend, w, &*p, a, m, c) {
        panic!("{} on {}: {e:#}", backend.name(), w.name);
    }
}

fn main() {
    let threads = std::env::var("KILN_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cpu = CpuBackend::new().with_threads(threads);
    let facts = cpu.probe().map(|c| c.facts).unwrap_or_default();
    println!("kiln matmul bench: C[M×N] = A[M×K]·Wᵀ on the CPU backend");
    for (k, v) in &facts {
        println!("  {k}: {v}");
    }
    let bw1 = read_bandwidth(1);
    let bw = read_bandwidth(threads);
    println!("  memory read bandwidth: {bw:.2} GB/s with {threads} threads, {bw1:.2} GB/s with 1");
    let llc = last_level_cache();
    if let Some(llc) = llc {
        println!(
            "  last-level cache: {} MiB (rows marked * have weights that fit in it: their M=1 GB/s \
             is cache, not DRAM, bandwidth)",
            llc >> 20
        );
    }
    println!();
    println!(
        "{:>5} {:>5} {:>4} {:>5} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "K", "N", "M", "type", "ms/call", "GFLOP/s", "W GB/s", "W/bw", "vs ref"
    );
    let mut rng = Rng(42);
    let mut headline = Vec::new();
    for (k, n) in [(2048usize, 6144usize), (576, 1536)] {
        let vals: Vec<f32> = (0..k * n).map(|_| rng.f32() * 0.1).collect();
        for ty in [
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
        ] {
            if !selected("KILN_BENCH_TYPES", ty.name()) {
                continue;
            }
            let data = make_weight(ty, &vals);
            let w = Weight {
                name: "bench.weight",
                ty,
                k,
                n,
                data: &data,
            };
            // The reference is single-threaded and slow: it runs on the first N/48 rows, and
            // the speed-up compares time per output.
            let n_ref = n / 48;
            let row = data.len() / n;
            let w_ref = Weight {
                n: n_ref,
                data: &data[..row * n_ref],
                ..w
            };
            for m in [1usize, 64, 512] {
                if !selected("KILN_BENCH_M", &m.to_string()) {
                    continue;
                }
                let a: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
                let mut c = vec![0.0f32; m * n];
                let (min, reps) = if m == 1 {
                    (Duration::from_millis(300), 5)
                } else {
                    (Duration::ZERO, 2)
                };
                let t = time_it(min, reps, || run_once(&cpu, &w, &a, m, &mut c));
                let mut c_ref = vec![0.0f32; m * n_ref];
                let t_ref = time_it(Duration::ZERO, 2, || {
                    run_once(&CpuRefBackend, &w_ref, &a, m, &mut c_ref)
                });
                let speedup = (t_ref / n_ref as f64) / (t / n as f64);
                let gflops = 2.0 * (m * n * k) as f64 / t / 1e9;
                let wgbs = data.len() as f64 / t / 1e9;
                let cached = if llc.is_some_and(|l| data.len() as u64 <= l) {
                    "*"
                } else {
                    ""
                };
                println!(
                    "{k:>5} {n:>5} {m:>4} {:>5} {:>10.3} {gflops:>9.2} {wgbs:>9.2} {:>9.2} {speedup:>8.1}× {cached}",
                    ty.name(),
                    t * 1e3,
                    wgbs / bw,
                );
                if m == 1 && k == 2048 {
                    headline.push((ty, wgbs / bw));
                }
            }
        }
    }
    // Per-call overhead at M=1 (threads started and joined, activations quantised): a weight so
    // small that the dots take a few microseconds, with all threads and with one.
    let (k, n) = (256usize, 64usize);
    let vals: Vec<f32> = (0..k * n).map(|_| rng.f32()).collect();
    let data = make_weight(GgmlType::Q4_0, &vals);
    let w = Weight {
        name: "bench.tiny",
        ty: GgmlType::Q4_0,
        k,
        n,
        data: &data,
    };
    let a: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
    let mut c = vec![0.0f32; n];
    let one = CpuBackend::new().with_threads(1);
    let t1 = time_it(Duration::from_millis(200), 50, || {
        run_once(&one, &w, &a, 1, &mut c)
    });
    let tn = time_it(Duration::from_millis(200), 50, || {
        run_once(&cpu, &w, &a, 1, &mut c)
    });
    println!();
    println!(
        "per-call overhead (Q4_0 K={k} N={n} M=1, best call): {:.1} µs with 1 thread, {:.1} µs with {threads}",
        t1 * 1e6,
        tn * 1e6
    );
    println!();
    println!(
        "headline (M=1, K=2048, N=6144, {threads} threads, kernel {}): weight GB/s ÷ read bandwidth",
        cpu.kernel()
    );
    for (ty, r) in headline {
        println!("  {:>5}: {r:.2}", ty.name());
    }
}
