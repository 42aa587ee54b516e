//! `cargo xtask test`: the one test command. Stages run in order; each prints its result and
//! time, a failed stage does not stop the next, and the last line counts them.

use crate::doctor;
use anyhow::{bail, Context, Result};
use std::time::Instant;
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Run only the stages whose name contains one of these words (e.g. `--stage aarch64`).
    #[arg(long)]
    pub stage: Vec<String>,
    /// Reuse slow cached artefacts (the kernel) where a stage allows it, and say so.
    #[arg(long)]
    pub quick: bool,
    /// List the stages and exit.
    #[arg(long)]
    pub list: bool,
}

type StageFn = fn(&Args) -> Result<()>;

/// Every stage of the suite, in order.
const STAGES: &[(&str, StageFn)] = &[
    ("fmt", fmt),
    ("clippy", clippy),
    ("host-tests", host_tests),
    ("aarch64-tests-cortex-a76", |_| {
        aarch64_tests("cortex-a76", true)
    }),
    ("aarch64-tests-cortex-a72", |_| {
        aarch64_tests("cortex-a72", false)
    }),
    ("boot-qemu-clean", boot_qemu_clean),
    ("boot-qemu-npu-fault", boot_qemu_npu_fault),
];

pub fn run(args: Args) -> Result<()> {
    if args.list {
        for (name, _) in STAGES {
            println!("{name}");
        }
        return Ok(());
    }
    let chosen: Vec<&(&str, StageFn)> = STAGES
        .iter()
        .filter(|(name, _)| args.stage.is_empty() || args.stage.iter().any(|s| name.contains(s)))
        .collect();
    if chosen.is_empty() {
        bail!(
            "no stage matches {:?}; `cargo xtask test --list` names them",
            args.stage
        );
    }
    let mut results = Vec::new();
    for (name, f) in chosen {
        println!("\n==> stage {name}");
        let t = Instant::now();
        let r = f(&args);
        let secs = t.elapsed().as_secs_f64();
        match &r {
            Ok(()) => println!("<== stage {name}: PASS ({secs:.1} s)"),
            Err(e) => println!("<== stage {name}: FAIL ({secs:.1} s): {e:#}"),
        }
        results.push((*name, r.is_ok(), secs));
    }
    println!("\nstage summary:");
    for (name, ok, secs) in &results {
        println!(
            "  {:<28} {} {secs:>7.1} s",
            name,
            if *ok { "PASS" } else { "FAIL" }
        );
    }
    let passed = results.iter().filter(|r| r.1).count();
    let failed = results.len() - passed;
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} stage(s) failed");
    }
    Ok(())
}

fn fmt(_: &Args) -> Result<()> {
    let sh = crate::shell()?;
    cmd!(sh, "cargo fmt --all -- --check")
        .run()
        .context("cargo fmt found unformatted code (run `cargo fmt --all`)")
}

fn clippy(_: &Args) -> Result<()> {
    let sh = crate::shell()?;
    cmd!(
        sh,
        "cargo clippy --locked --workspace --all-targets -- -D warnings"
    )
    .run()
    .context("clippy")
}

fn host_tests(_: &Args) -> Result<()> {
    let sh = crate::shell()?;
    cmd!(sh, "cargo test --locked --workspace")
        .run()
        .context("host tests")
}

/// The runtime's tests as aarch64 code under qemu-user, on a CPU with dotprod (cortex-a76, what
/// RK3588's big cores are) and one without (cortex-a72), so both kernels of the CPU backend run.
fn aarch64_tests(cpu: &str, dotprod: bool) -> Result<()> {
    doctor::ensure(&[&doctor::QEMU_USER, &doctor::AARCH64_SYSROOT])?;
    let tc = doctor::cross_toolchain()?;
    let sh = crate::shell()?;
    let runner = format!("qemu-aarch64-static -cpu {cpu} -L {}", doctor::SYSROOT);
    tc.cargo(&sh)
        .args([
            "test",
            "--locked",
            "-p",
            "kiln-runtime",
            "--target",
            doctor::AARCH64,
        ])
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", runner)
        .env("KILN_EXPECT_ARCH", "aarch64")
        .env("KILN_EXPECT_DOTPROD", if dotprod { "1" } else { "0" })
        .run()
        .with_context(|| format!("aarch64 tests under qemu-aarch64-static -cpu {cpu}"))
}

fn boot_args(inject: Option<&str>) -> crate::boot_test::Args {
    crate::boot_test::Args {
        board: "qemu-virt".into(),
        inject: inject.map(str::to_string),
        no_build: false,
        timeout: 120,
    }
}

/// The image boots through U-Boot under QEMU, its self-check passes, and the report on the disk
/// equals the console's (all checked inside `boot_test::boot`).
fn boot_qemu_clean(_: &Args) -> Result<()> {
    let b = crate::boot_test::boot(&boot_args(None))?;
    crate::boot_test::print_boot(&b);
    if b.report.verdict != crate::boot_test::Verdict::Pass {
        bail!("clean boot FAILED: {}", b.report.failed_ids().join(", "));
    }
    Ok(())
}

/// The NPU stand-in leaves its output untouched: the boot's verdict must be FAIL, on the NPU's
/// matmul checks and nothing else. A PASS here means the check is dead.
fn boot_qemu_npu_fault(_: &Args) -> Result<()> {
    let b = crate::boot_test::boot(&boot_args(Some("untouched")))?;
    crate::boot_test::print_boot(&b);
    let failed = b.report.failed_ids();
    if b.report.verdict != crate::boot_test::Verdict::Fail || failed.is_empty() {
        bail!(
            "injected NPU fault `untouched` was not seen: verdict {:?}",
            b.report.verdict
        );
    }
    if let Some(other) = failed.iter().find(|id| !id.starts_with("matmul.npu.")) {
        bail!("injected NPU fault failed an unrelated check {other} (failed: {failed:?})");
    }
    println!("boot-qemu-npu-fault: the verdict is FAIL on {failed:?}, as it must be");
    Ok(())
}
