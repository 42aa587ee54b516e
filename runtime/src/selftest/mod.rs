//! `kiln selftest`: the boot self-check. Every check has an id, a status (pass, fail, or skip with
//! a reason), evidence and its duration; the report goes to the console between markers and to
//! the boot partition, and the exit code is non-zero if anything failed.
//!
//! Every file-system root is a field of [`Paths`], so the checks run over fake `/proc`, `/sys`,
//! `/dev` and `/boot` trees in host tests: each check has a test that injects its fault and sees
//! it fail.

pub mod board;
pub mod cli;
pub mod cpu;
pub mod image;
pub mod kernel;
pub mod known;
pub mod matmul;
pub mod model_matmul;
pub mod model_nll;
pub mod models;
pub mod npu;
pub mod oracle;
pub mod report;

use board::Board;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use report::Report;

/// Where the checks look. [`Paths::under`] roots them all in one directory for tests.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The root the others hang under; the NPU backend looks for `dev/dri` below it.
    pub root: PathBuf,
    pub proc: PathBuf,
    pub sys: PathBuf,
    pub dev: PathBuf,
    /// The boot partition (p1): `kiln/manifest.json`, a shipped kernel `.config`.
    pub boot: PathBuf,
    /// Folders searched for GGUF models.
    pub models: Vec<PathBuf>,
}

impl Default for Paths {
    fn default() -> Paths {
        Paths::under(Path::new("/"))
    }
}

impl Paths {
    pub fn under(root: &Path) -> Paths {
        Paths {
            root: root.to_path_buf(),
            proc: root.join("proc"),
            sys: root.join("sys"),
            dev: root.join("dev"),
            boot: root.join("boot"),
            models: vec![root.join("models"), root.join("data/models")],
        }
    }

    pub fn manifest(&self) -> PathBuf {
        self.boot.join("kiln/manifest.json")
    }
}

/// Faults the self-check itself can be told to inject (`KILN_SELFTEST_INJECT`, set by `/init`
/// from `kiln.inject=`), so that a boot test sees the check that must catch each one fail.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inject {
    /// The first usable backend copies every weight while declaring it borrowed (the ledger
    /// must measure the copy).
    pub copy_weight: bool,
}

impl Inject {
    pub const ENV: &'static str = "KILN_SELFTEST_INJECT";

    /// Parse a comma-separated list; unknown names are returned as an error so a typo in a
    /// boot test does not silently inject nothing.
    pub fn parse(s: &str) -> anyhow::Result<Inject> {
        let mut i = Inject::default();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "copy" => i.copy_weight = true,
                other => anyhow::bail!("{}: unknown fault {other:?} (known: copy)", Inject::ENV),
            }
        }
        Ok(i)
    }

    pub fn from_env() -> anyhow::Result<Inject> {
        match std::env::var(Inject::ENV) {
            Ok(s) => Inject::parse(&s),
            Err(_) => Ok(Inject::default()),
        }
    }
}

/// Everything a check may look at.
#[derive(Clone, Debug, Default)]
pub struct Ctx {
    pub paths: Paths,
    /// `None` on the host: the checks that compare against a board's pins skip.
    pub board: Option<Board>,
    pub inject: Inject,
}

impl Ctx {
    /// The board, or the skip outcome every board-only check gives without one.
    pub fn board(&self) -> Result<&Board, Outcome> {
        self.board
            .as_ref()
            .ok_or_else(|| Outcome::skip("no board file (--board): nothing pinned to compare with"))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

impl Status {
    pub fn word(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Skip => "skip",
        }
    }
}

/// What a check found, before it is timed and named.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub status: Status,
    /// Why it failed or skipped.
    pub reason: Option<String>,
    /// Positive evidence: versions, counts, the ledger line.
    pub evidence: Vec<String>,
    /// True when the evidence comes from a stand-in, not real hardware.
    pub simulated: bool,
}

impl Outcome {
    pub fn pass(evidence: Vec<String>) -> Outcome {
        Outcome {
            status: Status::Pass,
            reason: None,
            evidence,
            simulated: false,
        }
    }
    pub fn fail(reason: impl Into<String>, evidence: Vec<String>) -> Outcome {
        Outcome {
            status: Status::Fail,
            reason: Some(reason.into()),
            evidence,
            simulated: false,
        }
    }
    pub fn skip(reason: impl Into<String>) -> Outcome {
        Outcome {
            status: Status::Skip,
            reason: Some(reason.into()),
            evidence: Vec::new(),
            simulated: false,
        }
    }
    pub fn with_evidence(mut self, more: Vec<String>) -> Outcome {
        self.evidence.extend(more);
        self
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct CheckResult {
    pub id: String,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub evidence: Vec<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub simulated: bool,
    pub duration_ms: f64,
}

impl CheckResult {
    /// A check during which a model page could not be read ([`crate::gguf::fault`]: the
    /// self-check recovers with zeros) FAILs with the read error first, whatever it computed.
    pub fn new(id: impl Into<String>, mut o: Outcome, duration_ms: f64) -> CheckResult {
        #[cfg(test)]
        let _serial = crate::gguf::fault::test_serial();
        let unread = crate::gguf::fault::take();
        if !unread.is_empty() {
            let mut why = unread.join("; ");
            if let Some(r) = o.reason.take() {
                why = format!("{why}; then: {r}");
            }
            o.status = Status::Fail;
            o.reason = Some(why);
        }
        CheckResult {
            id: id.into(),
            status: o.status,
            reason: o.reason,
            evidence: o.evidence,
            simulated: o.simulated,
            // Microsecond resolution is plenty and keeps the report readable.
            duration_ms: (duration_ms * 1e3).round() / 1e3,
        }
    }
}

/// Run one single-id check, timed.
pub fn timed(id: &str, f: impl FnOnce() -> Outcome) -> CheckResult {
    let t = Instant::now();
    let o = f();
    CheckResult::new(id, o, t.elapsed().as_secs_f64() * 1e3)
}

/// Run every check, in report order, with the board's backends: the NPU (the real library or
/// the stand-in), the CPU fast path and the CPU reference.
pub fn run_all(ctx: &Ctx) -> Report {
    use crate::backend::cpu::{CpuBackend, CpuRefBackend};
    use crate::backend::npu::{NpuBackend, NpuConfig};
    use crate::backend::Backend;
    // A model page that cannot be read (a block dm-verity refuses) FAILs the check that read
    // it, naming the model, instead of killing the self-check with SIGBUS.
    crate::gguf::fault::set_recover(true);
    let mut npu_cfg = NpuConfig {
        devroot: ctx.paths.root.clone(),
        ..NpuConfig::default()
    };
    if let Some(mib) = ctx.board.as_ref().and_then(|b| b.board.npu_budget_mib) {
        npu_cfg.budget = mib << 20;
    }
    // Inference on the big cores, as `kiln run` and `kiln serve` choose them: applied before any
    // backend or pool thread starts, so every thread inherits it.
    let cores = crate::cpus::select(&ctx.paths.sys.join("devices/system/cpu"), None)
        .and_then(|s| crate::cpus::apply(&s.cpus).map(|()| s))
        .map_err(|e| format!("{e:#}"));
    let npu = NpuBackend::new(npu_cfg.clone());
    let cpu = CpuBackend::new();
    let cpu_ref = CpuRefBackend;
    let cpu_kernel = cpu.kernel().name().to_string();
    // Board order: the NPU first, the CPU as the fallback.
    let board_order: [&dyn Backend; 2] = [&npu, &cpu];
    let mut checks = vec![
        timed("kernel.release", || kernel::release(ctx)),
        timed("kernel.config", || kernel::config(ctx)),
    ];
    // Only where the kernel loads modules (the manifest lists them).
    let t = Instant::now();
    if let Some(o) = kernel::modules(ctx) {
        checks.push(CheckResult::new(
            "kernel.modules",
            o,
            t.elapsed().as_secs_f64() * 1e3,
        ));
    }
    checks.extend([
        timed("npu.driver", || npu::driver(ctx)),
        timed("npu.runtime", || npu::runtime(ctx, &npu)),
        timed("cpu.features", || {
            let ran = crate::cpus::ran_on(cpu.threads());
            cpu::with_cores(cpu::features(ctx, Some(&cpu_kernel)), &cores, &ran)
        }),
        timed("cpu.governors", || cpu::governors(ctx)),
        timed("memory.bandwidth", || cpu::bandwidth(ctx)),
        timed("model.mmap", || models::mmap(ctx, &board_order)),
    ]);
    checks.extend(matmul::checks(&[&cpu_ref, &cpu, &npu], Some(&cpu)));
    checks.push(timed("coverage", || models::coverage(ctx, &board_order)));
    // Known answers of the real weights, from the models as mapped, on every board backend.
    for b in board_order {
        let id = format!("model.matmul.{}", b.name());
        checks.push(timed(&id, || model_matmul::check(ctx, b)));
    }
    // The model-level known answer, per backend configuration the board offers.
    let cpu_only = || -> Vec<Box<dyn Backend>> { vec![Box::new(CpuBackend::new())] };
    checks.push(timed("model.nll.cpu", || {
        model_nll::check(ctx, "cpu", &cpu_only, None)
    }));
    let npu_cpu = || -> Vec<Box<dyn Backend>> {
        vec![
            Box::new(NpuBackend::new(npu_cfg.clone())),
            Box::new(CpuBackend::new()),
        ]
    };
    checks.push(timed("model.nll.npu", || match npu.probe() {
        Ok(caps) => {
            let mut o = model_nll::check(ctx, "npu+cpu", &npu_cpu, Some(npu.name()));
            o.simulated = caps.simulated;
            o
        }
        // Another process holds the NPU: a failure wherever it happens, never a skip.
        Err(d @ crate::backend::Decline::NpuLock { .. }) => Outcome::fail(d.to_string(), vec![]),
        Err(d) if ctx.board.as_ref().is_some_and(|b| b.board.npu) => Outcome::fail(
            format!("the board has an NPU but its backend is absent: {d}"),
            vec![],
        ),
        Err(d) => Outcome::skip(format!("no NPU runtime on this board: {d}")),
    }));
    // After the NPU checks, so the library the backend loaded is in /proc/self/maps.
    checks.push(timed("image.manifest", || image::manifest(ctx)));
    // Last, so that anything the other checks provoked (an NPU reset) is in the log it reads.
    checks.push(timed("kernel.log", || kernel::log(ctx)));
    if let Some(b) = &ctx.board {
        let required = &b.expect.checks;
        let missing = report::missing_checks(&checks, required);
        let o = if required.is_empty() {
            Outcome::skip(format!("board {} names no required checks", b.board.name))
        } else if missing.is_empty() {
            Outcome::pass(vec![format!(
                "all {} checks the board requires are in the report",
                required.len()
            )])
        } else {
            Outcome::fail(
                format!("required check(s) missing: {}", missing.join(", ")),
                vec![],
            )
        };
        checks.push(CheckResult::new("report.required", o, 0.0));
    }
    Report::new(ctx, checks)
}

#[cfg(test)]
pub(crate) mod testutil {
    use std::ops::Deref;
    use std::path::{Path, PathBuf};

    /// A fake `/` for host tests: `proc/`, `sys/`, `dev/`, `boot/` as plain files.
    pub struct FakeRoot {
        dir: tempfile::TempDir,
    }

    impl FakeRoot {
        pub fn new() -> FakeRoot {
            FakeRoot {
                dir: tempfile::tempdir().expect("temp dir"),
            }
        }

        /// Write `rel` (creating folders) and return its path.
        pub fn file(&self, rel: &str, contents: impl AsRef<[u8]>) -> PathBuf {
            let p = self.dir.path().join(rel);
            std::fs::create_dir_all(p.parent().expect("has a parent")).expect("mkdir");
            std::fs::write(&p, contents).expect("write");
            p
        }

        /// `/models` mounted from the dm-verity mapping `kiln-models` (253:0) over `/dev/{part}`
        /// (254:`minor`), whose GPT name is `partname`.
        pub fn map_models(&self, part: &str, minor: u32, partname: &str) {
            let models = self.join("models").display().to_string();
            self.file(
                "proc/self/mountinfo",
                format!("30 22 253:0 / {models} ro - erofs /dev/dm-0 ro\n"),
            );
            self.file("sys/dev/block/253:0/dm/name", "kiln-models\n");
            self.file(
                &format!("sys/dev/block/253:0/slaves/{part}/dev"),
                format!("254:{minor}\n"),
            );
            self.file(
                &format!("sys/class/block/{part}/uevent"),
                format!("MAJOR=254\nMINOR={minor}\nPARTNAME={partname}\n"),
            );
            self.file(
                &format!("sys/class/block/{part}/dev"),
                format!("254:{minor}\n"),
            );
        }

        pub fn remove(&self, rel: &str) {
            let p = self.dir.path().join(rel);
            if p.is_dir() {
                std::fs::remove_dir_all(p).expect("rm -r");
            } else {
                std::fs::remove_file(p).expect("rm");
            }
        }
    }

    impl Deref for FakeRoot {
        type Target = Path;
        fn deref(&self) -> &Path {
            self.dir.path()
        }
    }
}
