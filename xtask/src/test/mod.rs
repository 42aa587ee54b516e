//! `cargo xtask test`: the one test command, in two tiers drawn from one table ([`STAGES`]).
//! The standard tier is what every change and CI run (budget [`STANDARD_BUDGET_S`] on 2 cores);
//! `--full` adds the long proofs, which a change to their area runs before it is called done.
//! Stages run in order; each prints its result and time, a failed stage does not stop the next,
//! and the run ends with where its time went (also `target/test-times.json`) and the count.

mod stages;
mod times;

pub(crate) use stages::{
    download_cache, ggml_x86_without_amx, gguf_py_venv, llama_cpp_venv, smollm2_model, verify,
    LLAMA_CPP_PINS, SMOLLM2_SHA256,
};

use crate::doctor::{self, is_root, NeedsRoot};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Instant;
use times::{Outcome, StageTime};
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Run only the stages whose name contains one of these words (e.g. `--stage aarch64`),
    /// of either tier.
    #[arg(long)]
    pub stage: Vec<String>,
    /// The standard tier and the long proofs (fresh machine, seeded power cuts, fleets of
    /// boards, soak, …): what a change to their area runs before it is called done.
    #[arg(long)]
    pub full: bool,
    /// List the stages (with `--full`: the long proofs alone) and exit.
    #[arg(long)]
    pub list: bool,
    /// Print docs/testing.md's stage table as this code has it, or with `--write` put it into
    /// docs/testing.md (a host test holds the two equal).
    #[arg(long)]
    pub table: bool,
    /// With `--table`: rewrite the table in docs/testing.md.
    #[arg(long, requires = "table")]
    pub write: bool,
    /// Compare two runs' `target/test-times.json` (A, then B) stage by stage, and exit.
    #[arg(long, num_args = 2, value_names = ["A", "B"])]
    pub compare: Vec<PathBuf>,
    /// Internal: the fresh-machine stage's root half alone, as the suite runs it in the
    /// background.
    #[arg(long, hide = true)]
    pub fresh_machine_root: bool,
}

/// Which runs take a stage.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Tier {
    /// Every `cargo xtask test`: every change, CI.
    Standard,
    /// `cargo xtask test --full` only: before a change to the area it guards is called done.
    Full,
}

impl Tier {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Tier::Standard => "standard",
            Tier::Full => "full",
        }
    }
}

/// One stage of the suite.
pub(crate) struct Stage {
    pub name: &'static str,
    pub tier: Tier,
    /// What it guards: what breaks unseen without it.
    pub guards: &'static str,
    /// When a change must run it (for the standard tier: always).
    pub run_when: &'static str,
    /// Its time, warm (caches as a previous run left them, a clean clone), on 2 cores, measured
    /// in the run docs/testing.md names; its budget in the report is a margin over it.
    pub secs: u32,
    /// Where it came from, when it moved between tiers: what the standard tier no longer runs.
    pub moved: Option<&'static str>,
    run: fn() -> Result<()>,
}

/// The standard tier's budget: CI's limit is 90 minutes; every change waits on this one.
pub(crate) const STANDARD_BUDGET_S: u32 = 30 * 60;

/// A stage's budget in the report: its measured time and a margin for a shared machine.
pub(crate) fn stage_budget(secs: u32) -> u32 {
    secs + secs / 4 + 20
}

const ALWAYS: &str = "every change (the standard tier)";

/// Every stage of the suite, in the order they run. The standard tier first; `--full` runs the
/// long proofs after it.
pub(crate) const STAGES: &[Stage] = &[
    Stage {
        name: "fmt",
        tier: Tier::Standard,
        guards: "rustfmt's layout of every crate",
        run_when: ALWAYS,
        secs: 1,
        moved: None,
        run: stages::fmt,
    },
    Stage {
        name: "clippy",
        tier: Tier::Standard,
        guards: "clippy -D warnings on every target of the workspace",
        run_when: ALWAYS,
        secs: 25,
        moved: None,
        run: stages::clippy,
    },
    Stage {
        name: "host-tests",
        tier: Tier::Standard,
        guards: "every unit and integration test on x86-64 with the real judges (fsck.*, \
                 bmaptool, rauc, fw_printenv, mkenvimage), tidy's layers, the docs' tables",
        run_when: ALWAYS,
        secs: 244,
        moved: None,
        run: stages::host_tests,
    },
    Stage {
        name: "gguf-reference",
        tier: Tier::Standard,
        guards:
            "the GGUF reader and dequantisation against gguf-py, on SmolLM2 and gguf-py's files",
        run_when: ALWAYS,
        secs: 13,
        moved: None,
        run: stages::gguf_reference,
    },
    Stage {
        name: "llama-cpp",
        tier: Tier::Standard,
        guards: "tokenizer, logits, NLL and greedy tokens against llama.cpp (SmolLM2, Gemma 3, \
                 synthetic qwen2/qwen3/gemma3/phi3), the aarch64 release kiln under qemu-user",
        run_when: ALWAYS,
        secs: 393,
        moved: None,
        run: stages::llama_cpp,
    },
    Stage {
        name: "npu-plan-smollm2",
        tier: Tier::Standard,
        guards: "`kiln plan` on SmolLM2 with the NPU stand-in",
        run_when: ALWAYS,
        secs: 52,
        moved: None,
        run: stages::npu_plan_smollm2,
    },
    Stage {
        name: "serve",
        tier: Tier::Standard,
        guards: "`kiln serve` against the pinned openai client",
        run_when: ALWAYS,
        secs: 33,
        moved: None,
        run: stages::serve,
    },
    Stage {
        name: "aarch64-tests-cortex-a76",
        tier: Tier::Standard,
        guards: "the runtime's tests as aarch64 code under qemu-user on RK3588's big core \
                 (NEON, dotprod)",
        run_when: ALWAYS,
        secs: 182,
        moved: None,
        run: || stages::aarch64_tests("cortex-a76", true),
    },
    Stage {
        name: "aarch64-tests-cortex-a72",
        tier: Tier::Standard,
        guards: "the CPU backend's kernels without dotprod, and the architecture check",
        run_when: ALWAYS,
        secs: 3,
        moved: None,
        run: || stages::aarch64_tests("cortex-a72", false),
    },
    Stage {
        name: "boot-qemu-clean",
        tier: Tier::Standard,
        guards: "a clean boot through U-Boot: the self-check PASS with SmolLM2, the card's \
                 report, the README's excerpt, LAVA's monitors, `cargo xtask qemu` and the \
                 openai client on the board, the board's greedy tokens equal to the host's",
        run_when: ALWAYS,
        secs: 120,
        moved: None,
        run: stages::boot_qemu_clean,
    },
    Stage {
        name: "sbom",
        tier: Tier::Standard,
        guards: "the image's SPDX and CycloneDX SBOMs by their official validators",
        run_when: ALWAYS,
        secs: 10,
        moved: None,
        run: stages::sbom,
    },
    Stage {
        name: "boot-qemu-npu-fault",
        tier: Tier::Standard,
        guards: "an NPU whose results are wrong FAILs the boot",
        run_when: ALWAYS,
        secs: 9,
        moved: None,
        run: stages::boot_qemu_npu_fault,
    },
    Stage {
        name: "boot-qemu-faults",
        tier: Tier::Standard,
        guards: "the booted fault matrix: a flipped model block, an edited or missing manifest",
        run_when: ALWAYS,
        secs: 46,
        moved: None,
        run: stages::boot_qemu_faults,
    },
    Stage {
        name: "boot-qemu-ab",
        tier: Tier::Standard,
        guards: "A/B updates with real U-Boot and RAUC: the scenarios, the four milestone power \
                 cuts, the fleet over DDI, labgrid's suite, a fleet's own keys",
        run_when: ALWAYS,
        secs: 347,
        moved: None,
        run: stages::boot_qemu_ab,
    },
    Stage {
        name: "flash",
        tier: Tier::Standard,
        guards: "`cargo xtask flash` onto loop devices, bmap ranges, read-back",
        run_when: ALWAYS,
        secs: 5,
        moved: None,
        run: stages::flash,
    },
    Stage {
        name: "image-checks",
        tier: Tier::Standard,
        guards: "rock-5b's kernel, modules and initramfs booted under QEMU, the Kconfig \
                 fragments, rock-5b-vendor's refusals, the reflash, the models bundle",
        run_when: ALWAYS,
        secs: 62,
        moved: None,
        run: stages::image_checks,
    },
    Stage {
        name: "u-boot",
        tier: Tier::Standard,
        guards: "U-Boot for rock-5b built from the pinned source: its RKNS header, FIT, BL31, \
                 the SPI image, placed at LBA 64 and written by `cargo xtask flash`; each fault \
                 named",
        run_when: ALWAYS,
        secs: 2,
        moved: None,
        run: crate::image::loader::stage,
    },
    Stage {
        name: "u-boot-twice",
        tier: Tier::Full,
        guards: "U-Boot for rock-5b built again from a clean tree gives the same bytes",
        run_when: "a change to the bootloader build, its pins or the tools root",
        secs: 47,
        moved: Some("the second build was in `u-boot` until 2026-12-07"),
        run: crate::image::loader::twice_stage,
    },
    Stage {
        name: "pins-archive",
        tier: Tier::Full,
        guards: "pins against Debian's archive (stale lists, the snapshot fallback, an empty \
                 host sources list), the doctor with each tool removed from PATH",
        run_when: "a change to pins, apt, the doctor or the tools root",
        secs: 214,
        moved: Some("standard tier until 2026-12-07"),
        run: stages::pins_archive,
    },
    Stage {
        name: "fresh-machine",
        tier: Tier::Full,
        guards: "the README's commands on a new Debian 13 root as an ordinary user, from a \
                 toolchain without the aarch64 std: the image has root's sha256 and SBOMs",
        run_when: "a change to pins, the tools root, the doctor, the build, the toolchain or \
                   anything that goes into the image's bytes",
        secs: 1439,
        moved: Some("standard tier until 2026-12-07"),
        run: crate::fresh_machine::stage,
    },
    Stage {
        name: "ab-seeded-cuts",
        tier: Tier::Full,
        guards: "power cut at 12 seeded moments of the update chain up to B's verdict",
        run_when: "a change to boot.scr, the A/B state, slot/, init or the update path",
        secs: 749,
        moved: None,
        run: || stages::ab_long(stages::AbLong::SeededCuts),
    },
    Stage {
        name: "ab-models-cuts",
        tier: Tier::Full,
        guards: "power cuts during a models install: the board serves a models slot that passed",
        run_when: "a change to the models slots, verity, models bundles or init's take of them",
        secs: 97,
        moved: None,
        run: || stages::ab_long(stages::AbLong::ModelsCuts),
    },
    Stage {
        name: "ab-boards",
        tier: Tier::Full,
        guards: "three boards polling one DDI server at once, the last with a failing update",
        run_when: "a change to fleet/ or the DDI client",
        secs: 111,
        moved: None,
        run: || stages::ab_long(stages::AbLong::Boards(3)),
    },
    Stage {
        name: "ab-fleet-faults",
        tier: Tier::Full,
        guards: "the fleet scenario's check that no success reaches the server before B's \
                 verdict fails on a board whose `kiln fleet` sends it early (an injected fault)",
        run_when: "a change to fleet/, its injected faults or the fleet scenario",
        secs: 73,
        moved: None,
        run: stages::ab_fleet_faults,
    },
    Stage {
        name: "llama-cpp-long",
        tier: Tier::Full,
        guards: "Gemma 3's real file with its sliding window off must miss llama.cpp by more \
                 than twice the bound",
        run_when: "a change to the model graphs, attention or the CPU kernels",
        secs: 51,
        moved: None,
        run: stages::llama_cpp_long,
    },
    Stage {
        name: "soak-serve",
        tier: Tier::Full,
        guards: "`kiln serve` for 30 minutes under a seeded mix of clients: RSS, descriptors, \
                 threads and latency flat",
        run_when: "a change to serve/, the scheduler or the batch path",
        secs: 1988,
        moved: None,
        run: stages::soak_serve,
    },
];

/// The stages that need root by their nature, and why. When this process is not root, the suite
/// does not run them: it says [`NeedsRoot`] for them, does not ask for their tools, and does not
/// start the fresh machine's root in the background.
const ROOT_ONLY: &[(&str, &str)] = &[
    (
        "flash",
        "the flash stage makes loop devices, partitions and mounts one",
    ),
    (
        "fresh-machine",
        "the fresh-machine stage makes a Debian root (debootstrap) and a user of its own in it",
    ),
];

/// Why stage `name` cannot run in this process, if it is root's and this process is not.
fn root_only(name: &str) -> Option<&'static str> {
    ROOT_ONLY
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, why)| *why)
        .filter(|_| !is_root())
}

pub fn run(args: Args) -> Result<()> {
    if args.fresh_machine_root {
        return crate::fresh_machine::inside();
    }
    if let [a, b] = args.compare.as_slice() {
        return times::compare(a, b);
    }
    if args.table {
        return table(args.write);
    }
    if args.list {
        list(args.full);
        return Ok(());
    }
    let chosen = choose(&args)?;
    let names: Vec<&str> = chosen.iter().map(|s| s.name).collect();
    prepare_stages(&names)?;
    share_build_dir()?;
    // With other stages to run, the fresh machine's root builds in the background from the
    // start (see `fresh_machine::Background`); alone, it runs in the foreground.
    let mut background = None;
    if names.len() > 1 && names.contains(&"fresh-machine") && root_only("fresh-machine").is_none() {
        match crate::fresh_machine::Background::start() {
            Ok(b) => background = Some(b),
            Err(e) => println!(
                "fresh-machine: not started in the background ({e:#}): it runs at its turn"
            ),
        }
    }
    let started = Instant::now();
    let mut results = Vec::new();
    for stage in chosen {
        println!("\n==> stage {} ({} tier)", stage.name, stage.tier.word());
        times::begin_stage();
        let t = Instant::now();
        let r = match (stage.name, background.take()) {
            ("fresh-machine", Some(b)) => b.finish(),
            (_, b) => {
                background = b;
                match root_only(stage.name) {
                    Some(why) => Err(NeedsRoot(why.to_string()).into()),
                    None => (stage.run)(),
                }
            }
        };
        let secs = t.elapsed().as_secs_f64();
        let (outcome, why) = match &r {
            Ok(()) => {
                println!("<== stage {}: PASS ({secs:.1} s)", stage.name);
                (Outcome::Pass, None)
            }
            Err(e) if e.downcast_ref::<NeedsRoot>().is_some() => {
                println!("<== stage {}: SKIPPED ({e:#})", stage.name);
                (Outcome::Skipped, Some(format!("{e:#}")))
            }
            Err(e) => {
                println!("<== stage {}: FAIL ({secs:.1} s): {e:#}", stage.name);
                (Outcome::Fail, Some(format!("{e:#}")))
            }
        };
        times::record_stage(stage.name, outcome, secs);
        results.push(StageTime {
            name: stage.name.to_string(),
            tier: stage.tier.word().to_string(),
            outcome,
            secs,
            budget_s: stage_budget(stage.secs),
            why,
            parts: times::end_stage(),
        });
    }
    let run = times::Run::new(args.full, started.elapsed().as_secs_f64(), results);
    run.print();
    if let Err(e) = run.write() {
        println!("test: could not write the run's times: {e:#}");
    }
    run.verdict()
}

/// The stages a run takes: `--stage` words pick from both tiers; else the standard tier, and
/// with `--full` the long proofs after it.
fn choose(args: &Args) -> Result<Vec<&'static Stage>> {
    let chosen: Vec<&Stage> = STAGES
        .iter()
        .filter(|s| {
            if args.stage.is_empty() {
                args.full || s.tier == Tier::Standard
            } else {
                args.stage.iter().any(|w| s.name.contains(w.as_str()))
            }
        })
        .collect();
    if chosen.is_empty() {
        bail!(
            "no stage matches {:?}; `cargo xtask test --list` names them",
            args.stage
        );
    }
    Ok(chosen)
}

/// `--list`: every stage with its tier, measured time and what it guards; with `--full`, the
/// long proofs alone and when a change must run each.
fn list(full_only: bool) {
    let total = |tier: Tier| -> u32 {
        STAGES
            .iter()
            .filter(|s| s.tier == tier)
            .map(|s| s.secs)
            .sum()
    };
    for s in STAGES.iter().filter(|s| !full_only || s.tier == Tier::Full) {
        println!(
            "{:<26} {:<8} {:>6}  {}",
            s.name,
            s.tier.word(),
            times::minutes(f64::from(s.secs)),
            s.guards
        );
        if s.tier == Tier::Full {
            println!("{:<26} run on: {}", "", s.run_when);
        }
    }
    println!(
        "standard tier: {} measured, budget {}; --full adds {}",
        times::minutes(f64::from(total(Tier::Standard))),
        times::minutes(f64::from(STANDARD_BUDGET_S)),
        times::minutes(f64::from(total(Tier::Full)))
    );
}

/// Where docs/testing.md keeps the table.
const TABLE_BEGIN: &str = "<!-- stages: generated by `cargo xtask test --table --write` -->";
const TABLE_END: &str = "<!-- end of stages -->";

/// The stage table as docs/testing.md has it.
pub(crate) fn table_markdown() -> String {
    let mut out =
        String::from("| stage | tier | guards | run it on | measured |\n|---|---|---|---|---:|\n");
    for s in STAGES {
        let moved = s
            .moved
            .map(|m| format!(" (moved: {m})"))
            .unwrap_or_default();
        out.push_str(&format!(
            "| `{}` | {}{moved} | {} | {} | {} |\n",
            s.name,
            s.tier.word(),
            s.guards,
            s.run_when,
            times::minutes(f64::from(s.secs))
        ));
    }
    out
}

/// docs/testing.md with its table replaced by `table`, or an error naming what is missing.
pub(crate) fn with_table(doc: &str, table: &str) -> Result<String> {
    kiln_runtime::clidoc::replace_between(doc, "docs/testing.md", (TABLE_BEGIN, TABLE_END), table)
        .map_err(anyhow::Error::msg)
}

fn table(write: bool) -> Result<()> {
    let t = table_markdown();
    if !write {
        print!("{t}");
        return Ok(());
    }
    let path = crate::paths::project_root().join("docs/testing.md");
    let doc =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    crate::atomic::write_atomic(&path, with_table(&doc, &t)?.as_bytes())?;
    println!("wrote the stage table into {}", path.display());
    Ok(())
}

/// How large the suite's build directory may grow before it is emptied.
const BUILD_DIR_BOUND: u64 = 40 << 30;

/// The suite's cargo builds (checks, tests, the NPU stand-ins; not the image's `kiln`, see
/// `CrossToolchain::cargo`) put their intermediate artifacts in one build directory per user,
/// `~/.cache/kiln/cargo-build`, shared by every checkout's runs: a clean clone (CI's is always
/// one) compiles kiln's own crates, not its ~300 dependencies again for every profile and target
/// (minutes on 2 cores). Cargo names a workspace crate's artifacts by its path inside the
/// workspace and judges them by file times, so another checkout's build of kiln's crates could
/// pass for this one's: when the directory was last used by another checkout, kiln's own crates
/// are removed from it (`cargo clean -p`) first. Over its bound the whole directory goes.
fn share_build_dir() -> Result<()> {
    let dir = crate::paths::user_cache()?.join("cargo-build");
    if crate::paths::size_of(&dir) > BUILD_DIR_BOUND {
        println!(
            "test: {} is over {} GiB: emptied",
            dir.display(),
            BUILD_DIR_BOUND >> 30
        );
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let marker = dir.join("kiln-checkout");
    let here = std::fs::canonicalize(crate::paths::project_root())?;
    let last = std::fs::read_to_string(&marker).ok();
    if last.as_deref() != Some(&*here.to_string_lossy()) {
        let sh = crate::paths::shell()?;
        for target in [None, Some(doctor::AARCH64)] {
            let t = target.map(|t| format!("--target={t}"));
            cmd!(
                sh,
                "cargo clean --quiet -p xtask -p kiln-runtime -p rknn-standin {t...}"
            )
            .env("CARGO_BUILD_BUILD_DIR", &dir)
            .env("CARGO_TARGET_DIR", dir.join("artifacts"))
            .quiet()
            .run()
            .with_context(|| {
                format!(
                    "removing another checkout's build of kiln from {}",
                    dir.display()
                )
            })?;
        }
        if let Some(l) = &last {
            println!(
                "test: {} was last used by {l}: kiln's own crates removed from it",
                dir.display()
            );
        }
        crate::atomic::write_atomic(&marker, here.to_string_lossy().as_bytes())?;
    }
    // Set while this process has no other thread: every later child inherits it.
    std::env::set_var("CARGO_BUILD_BUILD_DIR", &dir);
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
                &APT_HELPER,
                // runtime/tests/slot_tools.rs: the references for kiln/abstate.env.
                &FW_PRINTENV,
                // models_slot's hash tree against veritysetup's (a new machine lacked it).
                &VERITYSETUP,
                &RAUC,
                &UBOOT_TOOLS,
                // pins::identity's test builds an aarch64 librknnrt with the cross gcc, and
                // doctor_path's wrong-rustc test needs every other tool present to reach the
                // rustc check (a new machine lacked the cross gcc at this stage).
                &CROSS_GCC,
            ]);
            (t, false)
        }
        "gguf-reference" | "npu-plan-smollm2" | "serve" | "soak-serve" => {
            (vec![&PYTHON_VENV], false)
        }
        // llama-cpp-python compiles llama.cpp with CMake and g++ on its first install (the
        // tools llama-server's build needs too); the image's `kiln` is cross-built for the
        // qemu-aarch64 comparison.
        "llama-cpp" | "llama-cpp-long" => (
            [
                &[&PYTHON_VENV, &QEMU_USER, &AARCH64_SYSROOT][..],
                FOR_LLAMA_SERVER_BUILD,
            ]
            .concat(),
            true,
        ),
        "sbom" => ([FOR_IMAGE, &[&PYTHON_VENV]].concat(), true),
        s if s.starts_with("aarch64-tests") => (vec![&QEMU_USER, &AARCH64_SYSROOT], true),
        // boot-qemu-ab's fleet scenario serves the bundles with nginx; labgrid --remote exports
        // the board's console through ser2net.
        "boot-qemu-ab" | "ab-seeded-cuts" | "ab-models-cuts" | "ab-boards" | "ab-fleet-faults" => (
            [FOR_IMAGE, FOR_BOOT, &[&PYTHON_VENV, &NGINX, &SER2NET]].concat(),
            true,
        ),
        s if s.starts_with("boot-qemu") => ([FOR_IMAGE, FOR_BOOT, &[&PYTHON_VENV]].concat(), true),
        "flash" => (vec![&BMAPTOOL, &LSBLK, &LOSETUP, &MKE2FS, &SFDISK], false),
        // xz and depmod: the references for rock-5b's initramfs modules (a new machine lacked xz).
        "image-checks" => ([FOR_IMAGE, judges, &[&XZ, &KMOD]].concat(), true),
        "u-boot" | "u-boot-twice" => ([FOR_IMAGE, &[&SFDISK, &BMAPTOOL, &LSBLK]].concat(), false),
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
        if root_only(n).is_some() {
            continue;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/testing.md's stage table is this code's: a stage added, moved or re-measured here
    /// is a failing test until `cargo xtask test --table --write` puts it there.
    #[test]
    fn docs_testing_md_has_the_stage_table() {
        let path = crate::paths::project_root().join("docs/testing.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let want = with_table(&doc, &table_markdown()).unwrap();
        assert!(
            doc == want,
            "docs/testing.md's stage table is not the code's: run `cargo xtask test --table --write`"
        );
    }

    #[test]
    fn every_stage_is_named_once_and_knows_its_tools() {
        let mut names: Vec<&str> = STAGES.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len(), "a stage name is used twice");
        for s in STAGES {
            assert!(s.secs > 0, "{} has no measured time", s.name);
            let (tools, _) = stage_tools(s.name);
            assert!(
                tools.len() < doctor::all_tools().len(),
                "{} falls through to every tool the doctor knows: name its tools in stage_tools",
                s.name
            );
            if s.tier == Tier::Full {
                assert_ne!(
                    s.run_when, ALWAYS,
                    "{}: a long proof says when to run it",
                    s.name
                );
            }
        }
    }

    /// `--stage` picks from both tiers; no words: the standard tier, or both with `--full`.
    #[test]
    fn the_tiers_choose_their_stages() {
        let args = |full: bool, stage: &[&str]| Args {
            stage: stage.iter().map(|s| s.to_string()).collect(),
            full,
            list: false,
            table: false,
            write: false,
            compare: vec![],
            fresh_machine_root: false,
        };
        let names = |a: &Args| -> Vec<&str> { choose(a).unwrap().iter().map(|s| s.name).collect() };
        let std = names(&args(false, &[]));
        assert!(std.contains(&"boot-qemu-ab") && !std.contains(&"fresh-machine"));
        let full = names(&args(true, &[]));
        assert_eq!(full.len(), STAGES.len());
        assert_eq!(names(&args(false, &["fresh"])), ["fresh-machine"]);
        assert!(choose(&args(false, &["no-such-stage"])).is_err());
    }
}
