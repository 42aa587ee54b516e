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
//!
//! A models bundle (issue 38, `docs/models-slots.md`) goes through the same phases with the
//! models slots in place of the boot slots: RAUC writes the models slot not in use, its hook puts
//! it first with one try, the reboot maps it, and the self-check of that boot decides. A FAIL
//! blamed on it marks it bad and boots the same system again on the other models slot, whose
//! report replaces `report.json`: the blamed one is kept as `report-models-<slot>.json`, and the
//! action is judged by whichever report names the new slot's `kiln-models.json`
//! ([`pick_models`], [`judge_models`]).
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
    /// Which slot pair the bundle is for (`rauc info`), known once the install starts; states
    /// written before models bundles existed are of systems.
    #[serde(default)]
    pub kind: Kind,
    pub phase: Phase,
}

/// The slot pair a bundle is for, from the slot class of its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A system (`boot` image): into the other boot slot, judged by the boot of that slot.
    #[default]
    System,
    /// A models slot (`models` image): into the models slot not in use, judged by the boot that
    /// maps it.
    Models,
}

impl Kind {
    /// How the feedback names a slot of this pair: `slot`, `models slot`.
    pub fn word(self) -> &'static str {
        match self {
            Kind::System => "slot",
            Kind::Models => "models slot",
        }
    }

    /// The kind of a bundle from `rauc info --output-format=json` (its `images`, each an object
    /// keyed by slot class). A bundle for both pairs, or for none, is refused: kiln installs one
    /// slot per action and judges it.
    pub fn from_rauc_info(json: &[u8]) -> std::result::Result<Kind, String> {
        let v: serde_json::Value = serde_json::from_slice(json)
            .map_err(|e| format!("rauc info's JSON is not readable: {e}"))?;
        let classes: Vec<&str> = v["images"]
            .as_array()
            .ok_or("rauc info names no images")?
            .iter()
            .filter_map(|i| i.as_object())
            .flat_map(|o| o.keys().map(String::as_str))
            .collect();
        match classes.as_slice() {
            [] => Err("the bundle has no image".into()),
            c if c.iter().all(|c| *c == "models") => Ok(Kind::Models),
            c if c.iter().all(|c| *c != "models") => Ok(Kind::System),
            c => Err(format!(
                "the bundle has images for slot classes {c:?}: kiln installs a system or a \
                 models slot per action, not both"
            )),
        }
    }
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
        /// What was written, by sha256: the new system's `kiln/manifest.json`, or the new models
        /// slot's `kiln-models.json`.
        #[serde(alias = "manifest")]
        written: Option<String>,
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
            kind: Kind::System,
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
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Verdict {
    pub pass: bool,
    pub manifest: Option<String>,
    pub failed: Vec<String>,
    /// The models slot the checks read and its `kiln-models.json` sha256 (the report's
    /// `slot.models_slot`/`slot.models_json`).
    pub models_slot: Option<String>,
    pub models_json: Option<String>,
    /// Read from this boot's `report.json` (not a kept or another slot's report).
    pub current: bool,
}

impl Verdict {
    pub fn from_report_json(bytes: &[u8], what: &str) -> Result<Verdict> {
        let r: crate::selftest::report::Report =
            serde_json::from_slice(bytes).with_context(|| format!("{what}: not a kiln report"))?;
        let (models_slot, models_json) = r
            .slot
            .as_ref()
            .map(|d| (d.models_slot.clone(), d.models_json.clone()))
            .unwrap_or_default();
        Ok(Verdict {
            pass: r.verdict == crate::selftest::report::Verdict::Pass,
            manifest: r.manifest,
            models_slot,
            models_json,
            current: false,
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

/// `running`: the slot of the action's pair that runs now (the boot slot, or the models slot
/// mapped).
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
                    "the install was interrupted {} times (power cuts?): given up, {} {} runs",
                    a.installs,
                    a.kind.word(),
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

/// The details of a success: the words the server gets for a new slot that passed, whose report
/// names `manifest`.
pub(crate) fn pass_details(target: Slot, manifest: Option<&str>) -> Vec<String> {
    vec![
        format!("self-check PASS on slot {}", target.name()),
        format!("manifest sha256 {}", manifest.unwrap_or("unknown")),
    ]
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
        Some(v) if of_new(v) && v.pass && on_new => (true, pass_details(target, v.manifest.as_deref())),
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

/// The report that judges new models slot `target` (its `kiln-models.json` sha256 `expected`,
/// when it could be read after the install) among `candidates`: the first that names that slot
/// and that file. Without `expected`, only this boot's report, and only on the new slot (RAUC
/// activated it before the state could record its file).
pub fn pick_models(
    expected: Option<&str>,
    target: Slot,
    on_new: bool,
    candidates: Vec<Verdict>,
) -> Option<Verdict> {
    candidates.into_iter().find(|v| {
        v.models_slot.as_deref() == Some(target.name())
            && match (expected, v.models_json.as_deref()) {
                (Some(e), Some(m)) => e == m,
                (None, _) => on_new && v.current,
                _ => false,
            }
    })
}

/// The final feedback of a models action once [`pick_models`] chose its report (`v`, or none).
/// `on_new`: models slot `target` is mapped now; `running`: the models slot mapped now.
pub fn judge_models(
    target: Slot,
    running: Option<Slot>,
    on_new: bool,
    v: Option<&Verdict>,
) -> (bool, Vec<String>) {
    let t = target.name();
    let runs = match running {
        Some(r) => format!("models slot {} runs", r.name()),
        None => "no models slot is mapped".into(),
    };
    match v {
        Some(v) if v.pass && on_new && v.current => (
            true,
            vec![
                format!("self-check PASS on models slot {t}"),
                format!(
                    "kiln-models.json sha256 {}",
                    v.models_json.as_deref().unwrap_or("unknown")
                ),
            ],
        ),
        Some(v) if !v.pass => (
            false,
            vec![
                format!(
                    "self-check FAIL on models slot {t}: {}",
                    if v.failed.is_empty() {
                        "no failed check named".to_string()
                    } else {
                        v.failed.join(", ")
                    }
                ),
                runs,
            ],
        ),
        _ => (
            false,
            vec![
                format!("models slot {t} never reached a self-check verdict of the new models"),
                runs,
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
            kind: Kind::System,
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
            written: Some("m".into()),
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
            ..Verdict::default()
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
    fn a_bundle_s_kind_from_rauc_info() {
        let info = |classes: &[&str]| {
            let images: Vec<_> = classes
                .iter()
                .map(|c| serde_json::json!({ *c: {"filename": "x.img"} }))
                .collect();
            serde_json::to_vec(
                &serde_json::json!({"compatible": "kiln-qemu-virt", "images": images}),
            )
            .unwrap()
        };
        assert_eq!(Kind::from_rauc_info(&info(&["boot"])), Ok(Kind::System));
        assert_eq!(Kind::from_rauc_info(&info(&["models"])), Ok(Kind::Models));
        assert!(Kind::from_rauc_info(&info(&["boot", "models"]))
            .unwrap_err()
            .contains("not both"));
        assert!(Kind::from_rauc_info(&info(&[])).is_err());
        assert!(Kind::from_rauc_info(b"rauc-Message: x").is_err());
    }

    #[test]
    fn an_old_state_reads_as_a_system_action() {
        let old = br#"{"id":"7","filename":"u.raucb","size":1,"sha256":"a","installs":1,
            "phase":{"phase":"installed","from":"A","target":"B","manifest":"m","boot_id":"1"}}"#;
        let a: Action = serde_json::from_slice(old).unwrap();
        assert_eq!(a.kind, Kind::System);
        assert!(matches!(a.phase, Phase::Installed { written: Some(w), .. } if w == "m"));
    }

    #[test]
    fn models_verdicts() {
        let v = |pass, slot: &str, json: &str, current| Verdict {
            pass,
            failed: if pass {
                vec![]
            } else {
                vec!["model.nll.cpu".into()]
            },
            models_slot: Some(slot.into()),
            models_json: Some(json.into()),
            current,
            ..Verdict::default()
        };
        // This boot's PASS on the new slot.
        let p = pick_models(Some("j2"), Slot::B, true, vec![v(true, "B", "j2", true)]);
        let (ok, d) = judge_models(Slot::B, Some(Slot::B), true, p.as_ref());
        assert!(ok, "{d:?}");
        // Fell back: this boot's report is of A; the kept FAIL of B decides.
        let cands = vec![v(true, "A", "j1", true), v(false, "B", "j2", false)];
        let p = pick_models(Some("j2"), Slot::B, false, cands);
        let (ok, d) = judge_models(Slot::B, Some(Slot::A), false, p.as_ref());
        assert!(!ok);
        assert_eq!(
            d,
            [
                "self-check FAIL on models slot B: model.nll.cpu",
                "models slot A runs"
            ]
        );
        // A kept PASS of B while A runs is no success (never: a PASS marks B good and keeps it).
        let p = pick_models(Some("j2"), Slot::B, false, vec![v(true, "B", "j2", false)]);
        assert!(!judge_models(Slot::B, Some(Slot::A), false, p.as_ref()).0);
        // Without the written file's sha256, only this boot's report on the new slot counts.
        assert!(pick_models(None, Slot::B, false, vec![v(false, "B", "j2", false)]).is_none());
        assert!(pick_models(None, Slot::B, true, vec![v(true, "B", "j9", true)]).is_some());
        let (ok, d) = judge_models(Slot::B, None, false, None);
        assert!(!ok && d[1] == "no models slot is mapped", "{d:?}");
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
