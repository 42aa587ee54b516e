//! Where a run's time went: each stage's time against its budget, the slowest parts of the
//! slowest stages (each test binary of a `cargo test`, or a part a stage names), the total
//! against the tier's budget; printed at the end, written to `target/test-times.json` and a line
//! per stage to `~/.cache/kiln/test-stages.log`. Over a budget is reported, never failed: time on
//! a shared machine is not a test.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Instant;

/// How a stage ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub(crate) enum Outcome {
    Pass,
    Fail,
    Skipped,
}

impl Outcome {
    fn word(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skipped => "SKIPPED",
        }
    }
}

/// A part of a stage and its time: a test binary of a `cargo test`, or a part the stage names.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct Part {
    pub name: String,
    pub secs: f64,
}

/// One stage of a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct StageTime {
    pub name: String,
    pub tier: String,
    pub outcome: Outcome,
    pub secs: f64,
    pub budget_s: u32,
    pub why: Option<String>,
    /// Its parts, slowest first.
    pub parts: Vec<Part>,
}

/// A whole run, as `target/test-times.json` keeps it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Run {
    pub commit: String,
    /// UTC, `YYYY-MM-DDTHH:MM:SSZ`, when the run ended.
    pub ended: String,
    pub full: bool,
    pub total_s: f64,
    /// The standard tier's budget (a `--full` run is over it by design).
    pub budget_s: u32,
    pub stages: Vec<StageTime>,
}

/// The parts of the stage that is running.
static PARTS: Mutex<Vec<Part>> = Mutex::new(Vec::new());

fn parts() -> std::sync::MutexGuard<'static, Vec<Part>> {
    PARTS.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn begin_stage() {
    parts().clear();
}

/// The parts recorded since [`begin_stage`], slowest first.
pub(crate) fn end_stage() -> Vec<Part> {
    let mut p = std::mem::take(&mut *parts());
    p.sort_by(|a, b| b.secs.total_cmp(&a.secs));
    p
}

/// Run `f` as a named part of the running stage.
pub(crate) fn part<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let t = Instant::now();
    let r = f();
    parts().push(Part {
        name: name.to_string(),
        secs: t.elapsed().as_secs_f64(),
    });
    r
}

/// The test binary a line of cargo's stderr starts, if it starts one: `Running tests/x.rs
/// (target/…/x-0123abcd)` gives `tests/x.rs`; `Running unittests src/main.rs
/// (target/…/xtask-0123abcd)` gives `xtask src/main.rs`; `Doc-tests kiln_runtime` gives
/// `kiln_runtime doc-tests`.
pub(crate) fn test_binary(line: &str) -> Option<String> {
    let l = line.trim_start();
    if let Some(krate) = l.strip_prefix("Doc-tests ") {
        return Some(format!("{} doc-tests", krate.trim()));
    }
    let rest = l.strip_prefix("Running ")?;
    let (what, bin) = match rest.rsplit_once(" (") {
        Some((w, b)) => (w.trim(), b.trim_end_matches(')')),
        None => (rest.trim(), ""),
    };
    match what.strip_prefix("unittests ") {
        Some(src) => {
            let file = bin.rsplit('/').next().unwrap_or(bin);
            let krate = file.rsplit_once('-').map_or(file, |(k, _)| k);
            Some(format!("{krate} {src}"))
        }
        None => Some(what.to_string()),
    }
}

/// Run a `cargo test` command, passing its output through, and record the time of each test
/// binary it runs (between cargo's `Running` lines) as a part of the running stage; the build
/// before the first binary is the part `build`.
pub(crate) fn cargo_test(cmd: xshell::Cmd<'_>) -> Result<()> {
    cargo_test_to(cmd, &mut std::io::stderr())
}

/// [`cargo_test`] passing cargo's stderr on to `err`.
fn cargo_test_to(cmd: xshell::Cmd<'_>, err: &mut dyn Write) -> Result<()> {
    let shown = cmd.to_string();
    let mut c: std::process::Command = cmd.into();
    c.stderr(Stdio::piped());
    let mut child = c.spawn().with_context(|| format!("starting {shown}"))?;
    let stderr = child.stderr.take().context("cargo's stderr")?;
    let mut current = ("build".to_string(), Instant::now());
    for line in BufReader::new(stderr).lines() {
        let line = line.with_context(|| format!("reading the output of {shown}"))?;
        let _ = writeln!(err, "{line}");
        if let Some(bin) = test_binary(&line) {
            let (name, t) = std::mem::replace(&mut current, (bin, Instant::now()));
            add_part(name, t);
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for {shown}"))?;
    add_part(current.0, current.1);
    if !status.success() {
        bail!("command exited with {status}: {shown}");
    }
    Ok(())
}

fn add_part(name: String, since: Instant) {
    parts().push(Part {
        name,
        secs: since.elapsed().as_secs_f64(),
    });
}

/// `1234.5` as `20m35s`.
pub(crate) fn minutes(secs: f64) -> String {
    let s = secs.round() as u64;
    if s < 60 {
        format!("{s}s")
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

fn utc_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (y, mo, d) = crate::civil::civil_from_days(now.div_euclid(86400));
    let t = now.rem_euclid(86400);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(crate::paths::project_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "-".into())
}

/// One line per finished stage in `~/.cache/kiln/test-stages.log` (UTC time, commit, stage,
/// PASS/FAIL, seconds): the stage times of earlier runs, clean clones among them, outlive their
/// checkouts, so a run's cost can be read back stage by stage. A failure to record is only said.
pub(crate) fn record_stage(name: &str, outcome: Outcome, secs: f64) {
    let line = format!(
        "{} {} {name} {} {secs:.1}\n",
        utc_now(),
        commit(),
        outcome.word()
    );
    let write = || -> Result<()> {
        let p = crate::paths::user_cache()?.join("test-stages.log");
        std::fs::create_dir_all(p.parent().unwrap_or(Path::new(".")))?;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)?;
        f.write_all(line.as_bytes())?;
        Ok(())
    };
    if let Err(e) = write() {
        println!("test: could not record the stage's time: {e:#}");
    }
}

/// How many of the slowest parts the report names, for how many of the slowest stages.
const SLOWEST_PARTS: usize = 5;
const SLOWEST_STAGES: usize = 3;

impl Run {
    pub(crate) fn new(full: bool, total_s: f64, stages: Vec<StageTime>) -> Run {
        Run {
            commit: commit(),
            ended: utc_now(),
            full,
            total_s,
            budget_s: super::STANDARD_BUDGET_S,
            stages,
        }
    }

    fn count(&self, o: Outcome) -> usize {
        self.stages.iter().filter(|s| s.outcome == o).count()
    }

    /// The report: each stage against its budget, the slowest parts of the slowest stages, the
    /// total against the tier's budget and the stages over theirs.
    pub(crate) fn print(&self) {
        println!("\nwhere the time went ({}):", self.commit);
        println!(
            "  {:<26} {:<8} {:<8} {:>8} {:>8}",
            "stage", "tier", "result", "time", "budget"
        );
        for s in &self.stages {
            println!(
                "  {:<26} {:<8} {:<8} {:>8} {:>8}",
                s.name,
                s.tier,
                s.outcome.word(),
                minutes(s.secs),
                minutes(f64::from(s.budget_s))
            );
        }
        let mut slow: Vec<&StageTime> =
            self.stages.iter().filter(|s| !s.parts.is_empty()).collect();
        slow.sort_by(|a, b| b.secs.total_cmp(&a.secs));
        for s in slow.iter().take(SLOWEST_STAGES) {
            let p: Vec<String> = s
                .parts
                .iter()
                .take(SLOWEST_PARTS)
                .map(|p| format!("{} {}", p.name, minutes(p.secs)))
                .collect();
            println!("  slowest of {}: {}", s.name, p.join(", "));
        }
        let standard: f64 = self
            .stages
            .iter()
            .filter(|s| s.tier == super::Tier::Standard.word())
            .map(|s| s.secs)
            .sum();
        println!(
            "  total {} (standard tier {} of its budget {}{})",
            minutes(self.total_s),
            minutes(standard),
            minutes(f64::from(self.budget_s)),
            if standard > f64::from(self.budget_s) {
                ": OVER BUDGET"
            } else {
                ""
            }
        );
        for s in self
            .stages
            .iter()
            .filter(|s| s.secs > f64::from(s.budget_s))
        {
            println!(
                "  over budget: {} took {}, its budget is {} (reported, not failed)",
                s.name,
                minutes(s.secs),
                minutes(f64::from(s.budget_s))
            );
        }
        for s in self.stages.iter().filter(|s| s.outcome != Outcome::Pass) {
            println!(
                "  {} {}: {}",
                s.name,
                s.outcome.word(),
                s.why.as_deref().unwrap_or("")
            );
        }
        let (passed, failed, skipped) = (
            self.count(Outcome::Pass),
            self.count(Outcome::Fail),
            self.count(Outcome::Skipped),
        );
        if skipped > 0 {
            println!(
                "{passed} passed, {failed} failed, {skipped} skipped (they need root: \
                 `sudo cargo xtask test --stage NAME` runs one; CI runs them all as root)"
            );
        } else {
            println!("{passed} passed, {failed} failed");
        }
    }

    /// `target/test-times.json`, written atomically.
    pub(crate) fn write(&self) -> Result<()> {
        let p = crate::paths::target_dir().join("test-times.json");
        std::fs::create_dir_all(crate::paths::target_dir())?;
        crate::atomic::write_atomic(&p, &serde_json::to_vec_pretty(self)?)?;
        println!("test: the run's times are in {}", p.display());
        Ok(())
    }

    pub(crate) fn verdict(&self) -> Result<()> {
        let failed = self.count(Outcome::Fail);
        if failed > 0 {
            bail!("{failed} stage(s) failed");
        }
        Ok(())
    }
}

fn read_run(p: &Path) -> Result<Run> {
    let b = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_slice(&b).with_context(|| format!("{} is not a test-times.json", p.display()))
}

/// The comparison of two runs, stage by stage (a stage in one run only shows `-` for the other).
pub(crate) fn comparison(a: &Run, b: &Run) -> String {
    let mut names: Vec<&str> = a.stages.iter().map(|s| s.name.as_str()).collect();
    for s in &b.stages {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    let find = |r: &Run, n: &str| r.stages.iter().find(|s| s.name == n).map(|s| s.secs);
    let mut out = format!(
        "{:<26} {:>9} {:>9} {:>9} {:>6}\n",
        "stage",
        format!("A {}", a.commit.get(..7).unwrap_or(&a.commit)),
        format!("B {}", b.commit.get(..7).unwrap_or(&b.commit)),
        "B - A",
        "B / A"
    );
    let show = |v: Option<f64>| v.map_or("-".to_string(), minutes);
    for n in names {
        let (x, y) = (find(a, n), find(b, n));
        let (d, r) = match (x, y) {
            (Some(x), Some(y)) => (
                format!("{:+.0}s", y - x),
                if x > 0.0 {
                    format!("{:.2}", y / x)
                } else {
                    "-".into()
                },
            ),
            _ => ("-".into(), "-".into()),
        };
        out.push_str(&format!(
            "{n:<26} {:>9} {:>9} {d:>9} {r:>6}\n",
            show(x),
            show(y)
        ));
    }
    out.push_str(&format!(
        "{:<26} {:>9} {:>9} {:>9}\n",
        "total",
        minutes(a.total_s),
        minutes(b.total_s),
        format!("{:+.0}s", b.total_s - a.total_s)
    ));
    out
}

/// `--compare A B`.
pub(crate) fn compare(a: &Path, b: &Path) -> Result<()> {
    print!("{}", comparison(&read_run(a)?, &read_run(b)?));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargo_lines_name_their_test_binaries() {
        assert_eq!(
            test_binary("     Running tests/flash.rs (target/debug/deps/flash-0123abcd)")
                .as_deref(),
            Some("tests/flash.rs")
        );
        assert_eq!(
            test_binary(
                "     Running unittests src/lib.rs (target/debug/deps/kiln_runtime-89ab01cd)"
            )
            .as_deref(),
            Some("kiln_runtime src/lib.rs")
        );
        assert_eq!(
            test_binary("   Doc-tests kiln_runtime").as_deref(),
            Some("kiln_runtime doc-tests")
        );
        assert_eq!(test_binary("   Compiling xtask v0.1.0"), None);
        assert_eq!(test_binary("test foo ... ok"), None);
    }

    /// A real `cargo test` through [`cargo_test`]: its binaries become parts, and a failing
    /// command is an error.
    #[test]
    fn a_command_that_fails_is_an_error_and_parts_are_kept() {
        let sh = xshell::Shell::new().unwrap();
        begin_stage();
        let script = "echo '     Running tests/a.rs (x/a-1)' >&2; sleep 0.3; \
                      echo '     Running tests/b.rs (x/b-2)' >&2";
        // Into a buffer: the test's own stderr is read by the suite's `cargo test`, which would
        // take these lines for its own test binaries.
        let mut out = Vec::new();
        cargo_test_to(xshell::cmd!(sh, "sh -c {script}"), &mut out).unwrap();
        assert!(String::from_utf8_lossy(&out).contains("Running tests/b.rs"));
        let p = end_stage();
        let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names.len(), 3, "{names:?}");
        assert_eq!(names[0], "tests/a.rs", "the slowest first: {p:?}");
        assert!(cargo_test_to(xshell::cmd!(sh, "false"), &mut Vec::new()).is_err());
    }

    #[test]
    fn two_runs_compare_stage_by_stage() {
        let stage = |name: &str, secs: f64| StageTime {
            name: name.into(),
            tier: "standard".into(),
            outcome: Outcome::Pass,
            secs,
            budget_s: 100,
            why: None,
            parts: vec![],
        };
        let run = |commit: &str, total_s: f64, stages: Vec<StageTime>| Run {
            commit: commit.into(),
            ended: "x".into(),
            full: false,
            total_s,
            budget_s: 1800,
            stages,
        };
        let a = run(
            "aaaaaaaaaaaa",
            300.0,
            vec![stage("fmt", 100.0), stage("gone", 200.0)],
        );
        let b = run(
            "bbbbbbbbbbbb",
            60.0,
            vec![stage("fmt", 50.0), stage("new", 10.0)],
        );
        let t = comparison(&a, &b);
        assert!(
            t.contains("fmt") && t.contains("-50s") && t.contains("0.50"),
            "{t}"
        );
        assert!(
            t.lines()
                .any(|l| l.starts_with("gone") && l.contains(" - ")),
            "{t}"
        );
        assert!(t.lines().any(|l| l.starts_with("new")), "{t}");
        let j = serde_json::to_string(&a).unwrap();
        let back: Run = serde_json::from_str(&j).unwrap();
        assert_eq!(back.stages.len(), 2);
    }
}
