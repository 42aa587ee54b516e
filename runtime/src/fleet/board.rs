//! What the fleet client does to the board: which slot runs, the slots' self-check reports,
//! `rauc install`, reboot, the facts sent as `configData`.

use super::action::{Kind, Verdict};
use crate::slot::Slot;
use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

pub trait Board {
    fn running(&self) -> Slot;
    /// Changes at every boot (`/proc/sys/kernel/random/boot_id`).
    fn boot_id(&self) -> String;
    /// The models slot mapped on `/models` now (through the kernel), if any.
    fn running_models(&self) -> Option<Slot>;
    /// A self-check report in the `kiln` folder of `slot`'s boot partition (`report.json`, or
    /// a kept [`crate::selftest::report::models_report_name`]), if it is there.
    fn report(&self, slot: Slot, name: &str) -> Result<Option<Verdict>>;
    /// Which slot pair `bundle` is for (`rauc info`, which checks its signature); `Err` is
    /// RAUC's reason for refusing it.
    fn bundle_kind(&self, bundle: &Path) -> std::result::Result<Kind, String>;
    /// `rauc install`; `Err` is RAUC's reason.
    fn install(&mut self, bundle: &Path) -> std::result::Result<(), String>;
    /// sha256 of `slot`'s `kiln/manifest.json`.
    fn manifest_of(&self, slot: Slot) -> Result<Option<String>>;
    /// sha256 of models slot `slot`'s `kiln-models.json` (its trailer, read in place).
    fn models_json_of(&self, slot: Slot) -> Result<Option<String>>;
    fn reboot(&mut self) -> Result<()>;
    fn facts(&self) -> Map<String, Value>;
}

/// The board under `/init`: `/boot` is the running slot's boot partition (its report in
/// `/boot/kiln`); the other slot's partition is mounted read-only for a moment when its report
/// or manifest is read (never while RAUC could write it: the client does one thing at a time).
pub struct SystemBoard {
    pub running: Slot,
    pub boot_a: PathBuf,
    pub boot_b: PathBuf,
    pub models_a: PathBuf,
    pub models_b: PathBuf,
    pub report_dir: PathBuf,
}

impl SystemBoard {
    fn dev(&self, s: Slot) -> &Path {
        match s {
            Slot::A => &self.boot_a,
            Slot::B => &self.boot_b,
        }
    }

    /// `f` on the `kiln` folder of `slot`'s boot partition.
    fn with_slot<T>(&self, slot: Slot, f: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
        if slot == self.running {
            return f(&self.report_dir);
        }
        let mp = Path::new("/run/kiln-fleet-slot");
        std::fs::create_dir_all(mp).with_context(|| format!("creating {}", mp.display()))?;
        let dev = self.dev(slot);
        let out = Command::new("mount")
            .args(["-t", "vfat", "-o", "ro"])
            .arg(dev)
            .arg(mp)
            .output()
            .context("running mount")?;
        if !out.status.success() {
            bail!(
                "mount {} (slot {}): {}",
                dev.display(),
                slot.name(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let r = f(&mp.join("kiln"));
        let _ = Command::new("umount").arg(mp).status();
        r
    }
}

fn read_opt(p: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(p) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

impl Board for SystemBoard {
    fn running(&self) -> Slot {
        self.running
    }

    fn boot_id(&self) -> String {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    }

    fn running_models(&self) -> Option<Slot> {
        match crate::selftest::known::mapped(&crate::selftest::Paths::default()) {
            Ok((s, _)) => Some(s),
            Err(e) => {
                super::log(&format!("no models slot mapped: {e}"));
                None
            }
        }
    }

    fn report(&self, slot: Slot, name: &str) -> Result<Option<Verdict>> {
        self.with_slot(slot, |k| {
            let p = k.join(name);
            read_opt(&p)?
                .map(|b| Verdict::from_report_json(&b, &p.display().to_string()))
                .transpose()
        })
    }

    fn bundle_kind(&self, bundle: &Path) -> std::result::Result<Kind, String> {
        // The configuration init started RAUC with (the keyring; decision 5's slots).
        let mut cmd = Command::new("rauc");
        let conf = Path::new("/run/kiln/system.conf");
        if conf.exists() {
            cmd.arg(format!("--conf={}", conf.display()));
        }
        let out = cmd
            .args(["info", "--output-format=json"])
            .arg(bundle)
            .output()
            .map_err(|e| format!("cannot run rauc info: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let reason = err
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty() && !l.contains("rauc-Message"))
                .unwrap_or("no message")
                .trim()
                .to_string();
            return Err(format!(
                "{reason} (rauc info exited {})",
                out.status.code().unwrap_or(-1)
            ));
        }
        Kind::from_rauc_info(&out.stdout)
    }

    fn install(&mut self, bundle: &Path) -> std::result::Result<(), String> {
        // RAUC's progress is logged as it comes (a console shows how far an install got when
        // the power went); stderr is kept for the reason of a refusal.
        let mut child = Command::new("rauc")
            .arg("install")
            .arg(bundle)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run rauc: {e}"))?;
        let err = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = std::io::Read::read_to_string(&mut e, &mut s);
                s
            })
        });
        let mut text = String::new();
        if let Some(o) = child.stdout.take() {
            for l in std::io::BufRead::lines(std::io::BufReader::new(o)).map_while(|l| l.ok()) {
                super::log(&format!("rauc: {l}"));
                text.push_str(&l);
                text.push('\n');
            }
        }
        let status = child.wait().map_err(|e| format!("waiting for rauc: {e}"))?;
        let err = err.and_then(|h| h.join().ok()).unwrap_or_default();
        for l in err.lines() {
            super::log(&format!("rauc: {l}"));
        }
        text.push_str(&err);
        if status.success() {
            return Ok(());
        }
        // RAUC's own reason (`LastError: signature verification failed: …`), else its last line.
        let reason = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("LastError:"))
            .or_else(|| {
                text.lines()
                    .rev()
                    .find(|l| !l.trim().is_empty() && !l.contains("rauc-Message"))
            })
            .unwrap_or("no message")
            .trim()
            .to_string();
        Err(format!(
            "{reason} (rauc install exited {})",
            status.code().unwrap_or(-1)
        ))
    }

    fn manifest_of(&self, slot: Slot) -> Result<Option<String>> {
        self.with_slot(slot, |k| {
            let p = k.join("manifest.json");
            if !p.exists() {
                return Ok(None);
            }
            super::ddi::sha256_file(&p).map(Some)
        })
    }

    fn models_json_of(&self, slot: Slot) -> Result<Option<String>> {
        let dev = match slot {
            Slot::A => &self.models_a,
            Slot::B => &self.models_b,
        };
        Ok(crate::models_slot::read(dev)?.map(|s| s.meta_sha256()))
    }

    fn reboot(&mut self) -> Result<()> {
        // busybox `reboot` signals /init, which stops serving, unmounts and syncs first.
        let st = Command::new("reboot").status().context("running reboot")?;
        if !st.success() {
            bail!("reboot exited {st}");
        }
        // /init takes it from here; wait to be stopped.
        std::thread::sleep(std::time::Duration::from_secs(600));
        bail!("still running 10 minutes after reboot was asked")
    }

    fn facts(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("kiln".into(), env!("CARGO_PKG_VERSION").into());
        m.insert("slot".into(), self.running.name().into());
        if let Ok(r) = std::fs::read_to_string("/proc/sys/kernel/osrelease") {
            m.insert("kernel".into(), r.trim().into());
        }
        if let Ok(b) = std::fs::read(self.report_dir.join("report.json")) {
            if let Ok(r) = serde_json::from_slice::<crate::selftest::report::Report>(&b) {
                m.insert("verdict".into(), r.verdict.word().into());
                if let Some(x) = r.manifest {
                    m.insert("manifest_sha256".into(), x.into());
                }
                if let Some(x) = r.board {
                    m.insert("board".into(), x.into());
                }
                if let Some(d) = r.slot {
                    if let Some(x) = d.models_slot {
                        m.insert("models_slot".into(), x.into());
                    }
                    if let Some(x) = d.models_json {
                        m.insert("models_json_sha256".into(), x.into());
                    }
                }
            }
        }
        m
    }
}
