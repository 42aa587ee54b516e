//! `cargo xtask bench image`: cold build (`target/` empty, in a fresh clone; the download cache
//! warm, or with `--empty-cache` empty too), no-op rebuild (median of 7), rebuild after a runtime
//! change, the kernel build alone; image and initramfs sizes. Printed as a table.

use anyhow::{Context, Result};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;
use xshell::cmd;

fn timed_image(dir: &Path, cache: Option<&Path>) -> Result<f64> {
    let sh = xshell::Shell::new()?;
    sh.change_dir(dir);
    if let Some(c) = cache {
        sh.set_var("XDG_CACHE_HOME", c);
    }
    let t = Instant::now();
    cmd!(sh, "cargo xtask image --board qemu-virt")
        .env_remove("CARGO_TARGET_DIR")
        .run()
        .with_context(|| format!("cargo xtask image in {}", dir.display()))?;
    Ok(t.elapsed().as_secs_f64())
}

pub fn run(empty_cache: bool) -> Result<()> {
    let root = crate::paths::project_root();
    let base = crate::paths::target_dir().join("kiln/bench-image");
    if base.exists() {
        std::fs::remove_dir_all(&base)?;
    }
    let dir = base.join("kiln");
    let sh = xshell::Shell::new()?;
    cmd!(sh, "git clone -q {root} {dir}").run()?;
    // An empty download cache of its own (`XDG_CACHE_HOME`), used by every build of this bench.
    let cache = empty_cache.then(|| base.join("cache"));
    let cache = cache.as_deref();
    let cold_kind = if empty_cache {
        "download cache empty"
    } else {
        "download cache warm"
    };
    println!(
        "bench image: cold build in a fresh clone {} ({cold_kind}, target/ empty)",
        dir.display()
    );
    let cold = timed_image(&dir, cache)?;
    let mut noops = (0..7)
        .map(|_| timed_image(&dir, cache))
        .collect::<Result<Vec<f64>>>()?;
    noops.sort_by(f64::total_cmp);
    let noop = noops[3];
    let main_rs = dir.join("runtime/src/main.rs");
    let mut text = std::fs::read_to_string(&main_rs)?;
    text.push_str(
        "\n#[used]\nstatic KILN_BENCH_RUNTIME_CHANGE: [u8; 16] = *b\"bench-image-edit\";\n",
    );
    std::fs::write(&main_rs, text)?;
    let runtime = timed_image(&dir, cache)?;

    let kdir = dir.join("target/kiln/kernel");
    let mut kernel_secs = None;
    for e in std::fs::read_dir(&kdir)? {
        let p = e?.path().join("kernel.json");
        if let Ok(b) = std::fs::read(&p) {
            let v: serde_json::Value = serde_json::from_slice(&b)?;
            kernel_secs = v["build_seconds"].as_f64();
        }
    }
    let img = dir.join("target/images/kiln-qemu-virt.img");
    let meta = std::fs::metadata(&img)?;
    let initramfs =
        std::fs::metadata(dir.join("target/kiln/image/qemu-virt/initramfs.cpio.gz"))?.len();
    let mib = |b: u64| b as f64 / 1048576.0;
    println!("\n| measurement | value |\n|---|---|");
    println!(
        "| cold build (fresh clone, {cold_kind}, {} cores) | {cold:.1} s |",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "| kernel build alone (inside the cold build) | {} |",
        kernel_secs
            .map(|s| format!("{s:.1} s"))
            .unwrap_or("?".into())
    );
    println!(
        "| no-op rebuild (median of 7; min {:.2} s, max {:.2} s) | {noop:.2} s |",
        noops[0], noops[6]
    );
    println!("| rebuild after a runtime change | {runtime:.1} s |");
    println!(
        "| image size (apparent / allocated) | {:.1} MiB / {:.1} MiB |",
        mib(meta.len()),
        mib(meta.blocks() * 512)
    );
    println!("| initramfs size (gzip) | {:.2} MiB |", mib(initramfs));
    std::fs::remove_dir_all(&base).ok();
    Ok(())
}
