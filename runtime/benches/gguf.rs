//! Open-and-index cost of a GGUF follows its header, not its size: a sparse 4 GiB file and a
//! 40 MiB one with the same 400 tensors and metadata, opened and indexed repeatedly. Prints both
//! median times, their ratio (target ≈ 1) and the RSS growth of holding the 4 GiB file open
//! with every tensor indexed (target < 8 MiB). Run: `cargo xtask bench gguf` (or
//! `cargo bench -p kiln-runtime --bench gguf`).

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::{GgufFile, Value, ValueType};
use kiln_runtime::quant::GgmlType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const TENSORS: usize = 400;
const RUNS: usize = 41;

/// A file of `TENSORS` F16 matrices of 4096 × `rows`, with llama-like metadata (a 32k-token
/// vocabulary included, as real headers have).
fn write_fixture(path: &Path, rows: u64) -> anyhow::Result<u64> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("llama".into()))?;
    w.add("llama.block_count", Value::U32(40))?;
    w.add("llama.embedding_length", Value::U32(4096))?;
    let tokens = (0..32000)
        .map(|i| Value::String(format!("tok{i}")))
        .collect();
    w.add(
        "tokenizer.ggml.tokens",
        Value::Array(ValueType::String, tokens),
    )?;
    for i in 0..TENSORS {
        w.tensor_zeros(
            format!("blk.{}.w{}", i / 10, i % 10),
            GgmlType::F16,
            &[4096, rows],
        )?;
    }
    w.write(path)?;
    Ok(std::fs::metadata(path)?.len())
}

/// Open and build a name → (type, bytes) index of every tensor, as a loader would.
fn open_and_index(path: &Path) -> (GgufFile, usize) {
    let f = GgufFile::open(path).unwrap_or_else(|e| panic!("{e}"));
    let index: HashMap<&str, (GgmlType, usize)> = f
        .tensors()
        .map(|t| (t.name, (t.ty, t.data.len())))
        .collect();
    let n = index.len();
    drop(index);
    (f, n)
}

fn median_open(path: &Path) -> Duration {
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let t = Instant::now();
            let (f, n) = open_and_index(path);
            let d = t.elapsed();
            assert_eq!(n, TENSORS);
            drop(f);
            d
        })
        .collect();
    times.sort();
    times[RUNS / 2]
}

fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-bench");
    std::fs::create_dir_all(&dir)?;
    let big = dir.join("sparse-4gib.gguf");
    let small = dir.join("40mib.gguf");
    // 4096 × 1311 F16 = 10.24 MiB per tensor: 4.0 GiB in all; 4096 × 13 = 104 KiB: 40.6 MiB.
    let big_len = write_fixture(&big, 1311)?;
    let small_len = write_fixture(&small, 13)?;

    // Warm both files' header pages, then measure.
    open_and_index(&big);
    open_and_index(&small);
    let t_small = median_open(&small);
    let t_big = median_open(&big);

    let rss_before = vm_rss_kib();
    let (held, n) = open_and_index(&big);
    let rss_after = vm_rss_kib();
    let header = held.gguf().data_offset;
    drop(held);

    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!("gguf open+index, {TENSORS} tensors, median of {RUNS} (page cache warm):");
    println!(
        "  {:>10.2} MiB file (header {:.2} MiB): {:>9.1} µs",
        mib(small_len),
        mib(header),
        t_small.as_secs_f64() * 1e6
    );
    println!(
        "  {:>10.2} MiB file (sparse):          {:>9.1} µs",
        mib(big_len),
        t_big.as_secs_f64() * 1e6
    );
    println!(
        "  ratio 4 GiB / 40 MiB: {:.3} (target ≈ 1)",
        t_big.as_secs_f64() / t_small.as_secs_f64()
    );
    println!(
        "  RSS growth holding the 4 GiB file open with {n} tensors indexed: {:.2} MiB \
         (VmRSS {rss_before} → {rss_after} KiB; target < 8 MiB)",
        (rss_after.saturating_sub(rss_before)) as f64 / 1024.0
    );
    std::fs::remove_file(&big)?;
    std::fs::remove_file(&small)?;
    Ok(())
}
