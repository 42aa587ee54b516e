//! The report: JSON between console markers plus one verdict line, and `report.json` /
//! `report.txt` on the boot partition, written atomically (temp file, fsync, rename, fsync dir)
//! so a power cut leaves either the old report or the new one, never half of one.

use super::{CheckResult, Ctx, Status};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

pub const BEGIN: &str = "KILN-REPORT-BEGIN";
pub const END: &str = "KILN-REPORT-END";
pub const VERDICT_PREFIX: &str = "KILN-SELFTEST:";
/// One console line per check, for farms (labgrid, LAVA): `KILN-CHECK <id> PASS|FAIL|SKIP <ms>`.
pub const CHECK_PREFIX: &str = "KILN-CHECK";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    Pass,
    Fail,
}

impl Verdict {
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Bumped when a field changes meaning.
    pub schema: u32,
    /// `kiln` version that wrote it.
    pub kiln: String,
    /// The board file's name, or `None` on the host.
    pub board: Option<String>,
    /// sha256 of `/boot/kiln/manifest.json`: which image this report is about (the build writes
    /// the same hash beside the image, `target/images/kiln-<board>.manifest.sha256`). Reports
    /// written before the rename call it `image`.
    #[serde(alias = "image")]
    pub manifest: Option<String>,
    pub verdict: Verdict,
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    pub checks: Vec<CheckResult>,
    /// What the verdict did to the A/B slots (`kiln selftest --slot-env`): absent on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<crate::slot::Decision>,
}

/// sha256 of a file as lowercase hex, or `None` if it cannot be read.
pub fn sha256_file(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    Some(hex::encode(Sha256::digest(&bytes)))
}

/// The ids in `required` that no check in `checks` has.
pub fn missing_checks(checks: &[CheckResult], required: &[String]) -> Vec<String> {
    required
        .iter()
        .filter(|id| !checks.iter().any(|c| &c.id == *id))
        .cloned()
        .collect()
}

impl Report {
    pub fn new(ctx: &Ctx, checks: Vec<CheckResult>) -> Report {
        let count = |s: Status| checks.iter().filter(|c| c.status == s).count();
        let failed = count(Status::Fail);
        Report {
            schema: 1,
            kiln: env!("CARGO_PKG_VERSION").to_string(),
            board: ctx.board.as_ref().map(|b| b.board.name.clone()),
            manifest: sha256_file(&ctx.paths.manifest()),
            verdict: if failed == 0 {
                Verdict::Pass
            } else {
                Verdict::Fail
            },
            passed: count(Status::Pass),
            failed,
            skipped: count(Status::Skip),
            checks,
            slot: None,
        }
    }

    /// Checks that ran (passed or failed); skipped ones are not counted in the verdict line.
    pub fn ran(&self) -> usize {
        self.passed + self.failed
    }

    /// The verdict recounted from the checks themselves, not the stored field: FAIL if any check
    /// failed or a check in `required` is missing. Returns the verdict and every reason for a
    /// FAIL (failed ids, missing ids).
    pub fn recount(&self, required: &[String]) -> (Verdict, Vec<String>) {
        let mut why: Vec<String> = self
            .failed_ids()
            .into_iter()
            .map(|id| format!("{id} failed"))
            .collect();
        why.extend(
            missing_checks(&self.checks, required)
                .into_iter()
                .map(|id| format!("required check {id} is missing from the report")),
        );
        let v = if why.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail
        };
        (v, why)
    }

    pub fn failed_ids(&self) -> Vec<&str> {
        self.checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .map(|c| c.id.as_str())
            .collect()
    }

    /// `KILN-SELFTEST: PASS 7/7 manifest=<sha256>` — passed over checks that ran (skips
    /// excluded); the hash is of the boot partition's `kiln/manifest.json`, not of the image file.
    pub fn verdict_line(&self) -> String {
        format!(
            "{VERDICT_PREFIX} {} {}/{} manifest={}",
            self.verdict.word(),
            self.passed,
            self.ran(),
            self.manifest.as_deref().unwrap_or("none")
        )
    }

    /// `KILN-CHECK <id> PASS|FAIL|SKIP <ms>`, one line per check in the report's order, the same
    /// ids and statuses as the report: a stable grammar for farm tools (LAVA's `monitors`, a
    /// labgrid test's `expect`). Ids hold no spaces; the time is whole milliseconds.
    pub fn check_lines(&self) -> String {
        let mut s = String::new();
        for c in &self.checks {
            let _ = writeln!(
                s,
                "{CHECK_PREFIX} {} {} {}",
                c.id.replace(char::is_whitespace, "_"),
                c.status.word().to_uppercase(),
                c.duration_ms.round() as u64
            );
        }
        s
    }

    /// The console's `KILN-CHECK` lines of the last self-check (those before the last
    /// [`BEGIN`], after any earlier report) say exactly what this report says: every check once,
    /// the same status, nothing else. Kernel lines between them are allowed; a line that a
    /// kernel message broke is not a check line, so the check it carried is missing.
    pub fn check_lines_match(&self, log: &str) -> Result<()> {
        let lines: Vec<&str> = log.lines().map(|l| l.trim_end_matches('\r')).collect();
        let begin = lines
            .iter()
            .rposition(|l| l.trim() == BEGIN)
            .with_context(|| format!("no {BEGIN} line on the console"))?;
        let start = lines[..begin]
            .iter()
            .rposition(|l| l.trim() == END || l.starts_with(VERDICT_PREFIX))
            .map_or(0, |i| i + 1);
        let mut seen: Vec<(String, String)> = Vec::new();
        for l in &lines[start..begin] {
            let Some(rest) = l
                .strip_prefix(CHECK_PREFIX)
                .and_then(|r| r.strip_prefix(' '))
            else {
                continue;
            };
            let f: Vec<&str> = rest.split(' ').collect();
            let ok = f.len() == 3
                && ["PASS", "FAIL", "SKIP"].contains(&f[1])
                && !f[2].is_empty()
                && f[2].bytes().all(|b| b.is_ascii_digit());
            anyhow::ensure!(ok, "a malformed check line on the console: {l:?}");
            seen.push((f[0].to_string(), f[1].to_string()));
        }
        let want: Vec<(String, String)> = self
            .checks
            .iter()
            .map(|c| {
                (
                    c.id.replace(char::is_whitespace, "_"),
                    c.status.word().to_uppercase(),
                )
            })
            .collect();
        if seen != want {
            let show = |v: &[(String, String)]| {
                v.iter()
                    .map(|(i, s)| format!("{i} {s}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            anyhow::bail!(
                "the console's {CHECK_PREFIX} lines [{}] are not the report's checks [{}]",
                show(&seen),
                show(&want)
            );
        }
        Ok(())
    }

    pub fn to_json_pretty(&self) -> String {
        // A Report is plain data: serialising it cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// What goes to the console: the JSON on one line between the markers, then the verdict.
    /// One line keeps it whole when kernel messages interleave on the serial port.
    pub fn console(&self) -> String {
        format!(
            "{}{BEGIN}\n{}\n{END}\n{}\n",
            self.check_lines(),
            serde_json::to_string(self).unwrap_or_default(),
            self.verdict_line()
        )
    }

    /// A table for people: one row per check, then the evidence indented.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "kiln {} self-check on {}: {}",
            self.kiln,
            self.board.as_deref().unwrap_or("host (no board file)"),
            self.verdict.word()
        );
        let _ = writeln!(
            s,
            "manifest: {} (sha256 of kiln/manifest.json)",
            self.manifest.as_deref().unwrap_or("none")
        );
        if let Some(d) = &self.slot {
            let _ = writeln!(
                s,
                "slot: booted {}, {}{}{}{}",
                d.booted.as_deref().unwrap_or("?"),
                d.action,
                d.after
                    .as_deref()
                    .map(|a| format!(" ({a})"))
                    .unwrap_or_default(),
                d.reboot_into
                    .as_deref()
                    .map(|r| format!("; rebooting into {r}"))
                    .unwrap_or_default(),
                if d.no_good_slot { "; NO GOOD SLOT" } else { "" }
            );
            if let Some(m) = &d.models {
                let _ = writeln!(s, "models: {m}");
            }
        }
        let _ = writeln!(
            s,
            "{} passed, {} failed, {} skipped\n",
            self.passed, self.failed, self.skipped
        );
        let w = self
            .checks
            .iter()
            .map(|c| c.id.len())
            .max()
            .unwrap_or(2)
            .max(5);
        // The farm lines first (the table below says the same for people).
        s.push_str(&self.check_lines());
        let _ = writeln!(s);
        let _ = writeln!(s, "{:<w$}  {:<4}  {:>9}  reason", "check", "", "ms");
        for c in &self.checks {
            let sim = if c.simulated { " (simulated)" } else { "" };
            let _ = writeln!(
                s,
                "{:<w$}  {:<4}  {:>9.1}  {}{sim}",
                c.id,
                c.status.word().to_uppercase(),
                c.duration_ms,
                c.reason.as_deref().unwrap_or("")
            );
            for e in &c.evidence {
                let _ = writeln!(s, "{:<w$}        {e}", "");
            }
        }
        let _ = writeln!(s, "\n{}", self.verdict_line());
        s
    }

    /// Find the report a boot printed: the JSON between the markers (the last one, if the
    /// console shows several) and the verdict line after it. Tolerates `\r` and kernel lines
    /// interleaved between the markers.
    pub fn from_console(log: &str) -> Result<(Report, String)> {
        let lines: Vec<&str> = log.lines().map(|l| l.trim_end_matches('\r')).collect();
        let begin = lines
            .iter()
            .rposition(|l| l.trim() == BEGIN)
            .with_context(|| format!("no {BEGIN} line on the console"))?;
        let end = lines[begin..]
            .iter()
            .position(|l| l.trim() == END)
            .map(|i| begin + i)
            .with_context(|| format!("{BEGIN} without {END} on the console"))?;
        let json = lines[begin + 1..end]
            .iter()
            .find(|l| l.trim_start().starts_with('{'))
            .with_context(|| format!("no JSON between {BEGIN} and {END}"))?;
        let report: Report = serde_json::from_str(json.trim())
            .context("the console's report is not a valid report JSON")?;
        let verdict = lines[end..]
            .iter()
            .find(|l| l.starts_with(VERDICT_PREFIX))
            .with_context(|| format!("no {VERDICT_PREFIX} line after {END}"))?;
        Ok((report, verdict.to_string()))
    }

    /// Write `report.json` and `report.txt` into `dir`, each atomically.
    pub fn write_to(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write_atomic(dir, "report.json", self.to_json_pretty().as_bytes())?;
        write_atomic(dir, "report.txt", self.to_text().as_bytes())?;
        Ok(())
    }
}

/// The report kept beside `report.json` when a FAIL blamed models slot `m` (init boots the same
/// system again at once, whose report replaces `report.json`): `report-models-b.json`.
pub fn models_report_name(m: crate::slot::Slot) -> String {
    format!("report-models-{}.json", m.name().to_lowercase())
}

/// Temp file in the same folder, fsync, rename over the target, fsync the folder.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let dst = dir.join(name);
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.sync_all()
        .with_context(|| format!("fsync {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, &dst)
        .with_context(|| format!("renaming {} to {}", tmp.display(), dst.display()))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync folder {}", dir.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{CheckResult, Ctx, Outcome, Paths};
    use super::*;

    fn ctx(root: &Path) -> Ctx {
        Ctx {
            paths: Paths::under(root),
            ..Ctx::default()
        }
    }

    fn sample(root: &Path) -> Report {
        Report::new(
            &ctx(root),
            vec![
                CheckResult::new("a.ok", Outcome::pass(vec!["x=1".into()]), 1.0),
                CheckResult::new("b.skip", Outcome::skip("not here"), 0.1),
            ],
        )
    }

    #[test]
    fn verdict_counts_and_image_hash() {
        let dir = tempdir();
        std::fs::create_dir_all(dir.join("boot/kiln")).unwrap();
        std::fs::write(dir.join("boot/kiln/manifest.json"), b"{}").unwrap();
        let r = sample(&dir);
        assert_eq!(r.verdict, Verdict::Pass);
        // sha256("{}"), computed independently with sha256sum.
        assert_eq!(
            r.verdict_line(),
            "KILN-SELFTEST: PASS 1/1 manifest=44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        let mut r = r;
        r.checks.push(CheckResult::new(
            "c.bad",
            Outcome::fail("broken", vec![]),
            0.0,
        ));
        let r = Report::new(&ctx(&dir), r.checks);
        assert_eq!(r.verdict, Verdict::Fail);
        assert_eq!(r.failed_ids(), ["c.bad"]);
        assert!(r
            .verdict_line()
            .starts_with("KILN-SELFTEST: FAIL 1/2 manifest="));
    }

    /// A report written before `image` became `manifest` still reads, with the hash in place.
    #[test]
    fn old_reports_name_it_image() {
        let dir = tempdir();
        std::fs::create_dir_all(dir.join("boot/kiln")).unwrap();
        std::fs::write(dir.join("boot/kiln/manifest.json"), b"{}").unwrap();
        let r = sample(&dir);
        let json = r.to_json_pretty();
        assert!(json.contains("\"manifest\": \"44136fa3"), "{json}");
        let old: Report =
            serde_json::from_str(&json.replace("\"manifest\":", "\"image\":")).unwrap();
        assert_eq!(old, r);
        assert!(r.to_text().contains("manifest: 44136fa3"));
    }

    #[test]
    fn console_round_trips_through_noise() {
        let dir = tempdir();
        let r = sample(&dir);
        let log = format!(
            "[    1.0] booting\r\n{}\r\n[    2.0] random: crng init done\r\n",
            r.console().replace('\n', "\r\n")
        );
        let (back, line) = Report::from_console(&log).unwrap();
        assert_eq!(back, r);
        assert_eq!(line, r.verdict_line());
        assert!(Report::from_console("no report here").is_err());
    }

    /// The farm lines: the grammar, the report's ids and statuses, kernel lines between them
    /// tolerated; a missing, broken, extra or contradicting line is refused.
    #[test]
    fn check_lines_say_what_the_report_says() {
        let dir = tempdir();
        let r = sample(&dir);
        assert_eq!(
            r.check_lines(),
            "KILN-CHECK a.ok PASS 1\nKILN-CHECK b.skip SKIP 0\n"
        );
        let old = "KILN-CHECK zz.old FAIL 3\nKILN-REPORT-BEGIN\n{}\nKILN-REPORT-END\nKILN-SELFTEST: FAIL 0/1 manifest=none\n";
        let good = format!(
            "{old}[ 3.1] boot\r\nKILN-CHECK a.ok PASS 1\r\n[ 3.2] random: crng init done\r\n{}",
            r.console().replacen("KILN-CHECK a.ok PASS 1\n", "", 1)
        );
        r.check_lines_match(&good)
            .expect("kernel lines between check lines are fine");
        for (what, bad) in [
            (
                "missing",
                r.console().replace("KILN-CHECK b.skip SKIP 0\n", ""),
            ),
            (
                "broken by a kernel message",
                r.console()
                    .replace("KILN-CHECK b.skip", "KILN-CH[ 4.0] usb 1-1\nECK b.skip"),
            ),
            (
                "another status",
                r.console().replace("b.skip SKIP", "b.skip PASS"),
            ),
            (
                "extra",
                r.console().replace(
                    "KILN-CHECK b.skip",
                    "KILN-CHECK c.x PASS 1\nKILN-CHECK b.skip",
                ),
            ),
            (
                "no time",
                r.console().replace("b.skip SKIP 0", "b.skip SKIP"),
            ),
        ] {
            assert!(
                r.check_lines_match(&bad).is_err(),
                "{what}: accepted\n{bad}"
            );
        }
    }

    #[test]
    fn writes_json_and_text_atomically() {
        let dir = tempdir();
        let r = sample(&dir);
        r.write_to(&dir.join("out")).unwrap();
        let back: Report =
            serde_json::from_slice(&std::fs::read(dir.join("out/report.json")).unwrap()).unwrap();
        assert_eq!(back, r);
        let txt = std::fs::read_to_string(dir.join("out/report.txt")).unwrap();
        assert!(txt.contains("b.skip") && txt.contains("not here"), "{txt}");
        let leftovers: Vec<_> = std::fs::read_dir(dir.join("out"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    fn tempdir() -> crate::selftest::testutil::FakeRoot {
        crate::selftest::testutil::FakeRoot::new()
    }
}
