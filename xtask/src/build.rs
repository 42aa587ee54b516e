//! `cargo xtask build`: the runtime for aarch64, dynamically linked against glibc because the
//! NPU backend `dlopen`s the vendor library.

use crate::doctor;
use anyhow::{Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Optimised build (what goes into images).
    #[arg(long)]
    pub release: bool,
}

/// Build `kiln` for aarch64 and return the binary's path.
pub fn run(args: Args) -> Result<PathBuf> {
    let bin = build_runtime(args.release)?;
    println!("{}", bin.display());
    Ok(bin)
}

pub fn build_runtime(release: bool) -> Result<PathBuf> {
    let tc = doctor::cross_toolchain()?;
    let sh = crate::paths::shell()?;
    let profile: &[&str] = if release { &["--release"] } else { &[] };
    let target = doctor::AARCH64;
    tc.cargo(&sh)
        .args([
            "build",
            "--locked",
            "-p",
            "kiln-runtime",
            "--bin",
            "kiln",
            "--target",
            target,
        ])
        .args(profile)
        .run()
        .context("cross-building kiln for aarch64")?;
    let bin = crate::paths::target_dir()
        .join(target)
        .join(if release { "release" } else { "debug" })
        .join("kiln");
    anyhow::ensure!(
        bin.exists(),
        "cargo reported success but {} is missing",
        bin.display()
    );
    Ok(bin)
}
