//! The one action in flight, on `data` (`action.json`, written atomically with fsync): which
//! deployment, how far it got, and the final feedback once it is decided. It survives reboots and
//! power cuts, so the action ends with one final feedback that matches the slot that runs.
//!
//! The phases and what a restart (a power cut, a reboot) does in each:
//! - `Downloading`: resumed from the `.part` file (Range).
//! - `Installing { from, boot_id }`: `rauc install` was started. Same boot: the client itself
//!   died; install again. Another boot on `from`: the install was cut; install again (at most
//!   [`MAX_INSTALLS`] times). Another boot on the other slot: RAUC finished and activated it
//!   before the state could say so; judged as `Installed`.
//! - `Installed { from, target, manifest, boot_id }`: same boot: reboot now. Another boot on
//!   `target`: its own report decides (PASS → success). Another boot on `from`: the new slot
//!   failed its self-check, or never reached one and U-Boot fell back: failure, naming the failed
//!   checks from the new slot's report (its manifest sha256 says the report is of the new system).
//! - `Final { finished, details }`: decided, the feedback not yet acknowledged: sent again at each
//!   poll while the server still offers the action, then `Done`.

use super::ddi::{Artifact, Finished};
use crate::slot::Slot;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Installs of one action before it is given up as a failure (power cut during each).
pub const MAX_INSTALLS: u32 = 3;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Action {
    pub id: String,
    pub filename: String,
    pub size: u64,
    pub sha256: String,
    pub installs: u32,
    pub phase: Phase,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    Downloading,
    Installing {
        from: String,
        boot_id: String,
    },
    Installed {
        from: String,
        target: String,
        manifest: Option<String>,
        boot_id: String,
    },
    Final {
        success: bool,
        details: Vec<String>,
    },
    Done {
        success: bool,
    },
}

impl Action {
    pub fn new(id: &str, a: &Artifact) -> Action {
        Action {
            id: id.into(),
            filename: a.filename.clone(),
            size: a.size,
            sha256: a.sha256.clone(),
            installs: 0,
            phase: Phase::Downloading,
        }
    }

    pub fn finished(&self) -> Option<Finished> {
        match &self.phase {
            Phase::Final { success, .. } | Phase::Done { success } => Some(if *success {
                Finished::Success
            } else {
                Finished::Failure
            }),
            _ => None,
        }
    }

    pub fn decide(&mut self, success: bool, details: Vec<String>) {
        self.phase = Phase::Final { success, details };
    }
}

pub fn load(dir: &Path) -> Result<Option<Action>> {
    let p = dir.join("action.json");
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .with_context(|| format!("{}: not an action state", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

pub fn save(dir: &Path, a: &Action) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(a)?;
    crate::selftest::report::write_atomic(dir, "action.json", &bytes)
}

/// What a report says of one system, reduced to what the fleet hears.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub pass: bool,
    pub manifest: Option<String>,
    pub failed: Vec<String>,
}

impl Verdict {
    pub fn from_report_json(bytes: &[u8], what: &str) -> Result<Verdict> {
        let r: crate::selftest::report::Report =
            serde_json::from_slice(bytes).with_context(|| format!("{what}: not a kiln report"))?;
        Ok(Verdict {
            pass: r.verdict == crate::selftest::report::Verdict::Pass,
            manifest: r.manifest,
            failed: r
                .checks
                .iter()
                .filter(|c| c.status == crate::selftest::Status::Fail)
                .map(|c| c.id.clone())
                .collect(),
        })
    }
}

/// What to do about an action found `Installing` or `Installed` at start-up.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Install (again).
    Install,
    /// The install is done in this boot: reboot into it.
    Reboot,
    /// Judge the new system by the report of `slot`.
    Judge { slot: Slot, on_new: bool },
    /// Give up: failure with this detail.
    Fail(String),
}

pub fn next(a: &Action, running: Slot, boot_id: &str) -> Option<Next> {
    match &a.phase {
        Phase::Installing { from, boot_id: b } => {
            let from = Slot::parse(from).ok()?;
            if b != boot_id && running != from {
                return Some(Next::Judge {
                    slot: running,
                    on_new: true,
                });
            }
            if a.installs >= MAX_INSTALLS {
                return Some(Next::Fail(format!(
                    "the install was interrupted {} times (power cuts?): given up, slot {} runs",
                    a.installs,
                    running.name()
                )));
            }
            Some(Next::Install)
        }
        Phase::Installed {
            from,
            target,
            boot_id: b,
            ..
        } => {
            let (from, target) = (Slot::parse(from).ok()?, Slot::parse(target).ok()?);
            if b == boot_id {
                Some(Next::Reboot)
            } else if running == target {
                Some(Next::Judge {
                    slot: target,
                    on_new: true,
                })
            } else {
                let _ = from;
                Some(Next::Judge {
                    slot: target,
                    on_new: false,
                })
            }
        }
        _ => None,
    }
}

/// The final feedback once the new system's report (`v`, or none) is read.
/// `on_new`: the board runs the new slot; else it fell back to `running`.
pub fn judge(
    expected_manifest: Option<&str>,
    target: Slot,
    running: Slot,
    on_new: bool,
    v: Option<&Verdict>,
) -> (bool, Vec<String>) {
    let t = target.name();
    let of_new = |v: &Verdict| match (expected_manifest, v.manifest.as_deref()) {
        (Some(e), Some(m)) => e == m,
        // RAUC activated the slot before the state could record its manifest: the running
        // report is of the new system by construction.
        (None, _) => on_new,
        _ => false,
    };
    match v {
        Some(v) if of_new(v) && v.pass && on_new => (
            true,
            vec![
                format!("self-check PASS on slot {t}"),
                format!("manifest sha256 {}", v.manifest.as_deref().unwrap_or("unknown")),
            ],
        ),
        Some(v) if of_new(v) && !v.pass => (
            false,
            vec![
                format!("self-check FAIL on slot {t}: {}", if v.failed.is_empty() { "no failed check named".to_string() } else { v.failed.join(", ") }),
                format!("slot {} runs", running.name()),
            ],
        ),
        _ => (
            false,
            vec![
                format!("slot {t} never reached a self-check verdict of the new system: U-Boot fell back"),
                format!("slot {} runs", running.name()),
            ],
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn act(phase: Phase, installs: u32) -> Action {
        Action {
            id: "7".into(),
            filename: "u.raucb".into(),
            size: 1,
            sha256: "a".repeat(64),
            installs,
            phase,
        }
    }

    #[test]
    fn restarts_in_each_phase() {
        let inst = |b: &str| Phase::Installing {
            from: "A".into(),
            boot_id: b.into(),
        };
        assert_eq!(next(&act(inst("1"), 1), Slot::A, "1"), Some(Next::Install));
        assert_eq!(next(&act(inst("1"), 1), Slot::A, "2"), Some(Next::Install));
        assert_eq!(
            next(&act(inst("1"), 1), Slot::B, "2"),
            Some(Next::Judge {
                slot: Slot::B,
                on_new: true
            })
        );
        assert!(
            matches!(next(&act(inst("1"), 3), Slot::A, "2"), Some(Next::Fail(m)) if m.contains("3 times"))
        );
        let done = |b: &str| Phase::Installed {
            from: "A".into(),
            target: "B".into(),
            manifest: Some("m".into()),
            boot_id: b.into(),
        };
        assert_eq!(next(&act(done("1"), 1), Slot::A, "1"), Some(Next::Reboot));
        assert_eq!(
            next(&act(done("1"), 1), Slot::B, "2"),
            Some(Next::Judge {
                slot: Slot::B,
                on_new: true
            })
        );
        assert_eq!(
            next(&act(done("1"), 1), Slot::A, "2"),
            Some(Next::Judge {
                slot: Slot::B,
                on_new: false
            })
        );
        assert_eq!(next(&act(Phase::Downloading, 0), Slot::A, "2"), None);
    }

    #[test]
    fn verdicts() {
        let v = |pass, m: &str, failed: &[&str]| Verdict {
            pass,
            manifest: Some(m.into()),
            failed: failed.iter().map(|s| s.to_string()).collect(),
        };
        let (ok, d) = judge(
            Some("m2"),
            Slot::B,
            Slot::B,
            true,
            Some(&v(true, "m2", &[])),
        );
        assert!(ok, "{d:?}");
        assert_eq!(d, ["self-check PASS on slot B", "manifest sha256 m2"]);
        let (ok, d) = judge(
            Some("m2"),
            Slot::B,
            Slot::A,
            false,
            Some(&v(false, "m2", &["model.nll.cpu"])),
        );
        assert!(!ok);
        assert_eq!(d[0], "self-check FAIL on slot B: model.nll.cpu");
        // The other slot's report is of the old system (the new one never booted).
        let (ok, d) = judge(
            Some("m2"),
            Slot::B,
            Slot::A,
            false,
            Some(&v(true, "m1", &[])),
        );
        assert!(!ok);
        assert!(d[0].contains("never reached"), "{d:?}");
        let (ok, _) = judge(Some("m2"), Slot::B, Slot::A, false, None);
        assert!(!ok);
        // A PASS of the new system while the board runs the old one is no success.
        let (ok, _) = judge(
            Some("m2"),
            Slot::B,
            Slot::A,
            false,
            Some(&v(true, "m2", &[])),
        );
        assert!(!ok);
    }

    #[test]
    fn state_round_trips_atomically() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(load(d.path()).unwrap(), None);
        let a = act(
            Phase::Final {
                success: false,
                details: vec!["x".into()],
            },
            2,
        );
        save(d.path(), &a).unwrap();
        assert_eq!(load(d.path()).unwrap(), Some(a));
        std::fs::write(d.path().join("action.json"), b"{").unwrap();
        assert!(format!("{:#}", load(d.path()).unwrap_err()).contains("action.json"));
    }
}
