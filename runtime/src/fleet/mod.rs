//! `kiln fleet`: the board's hawkBit client (DDI). `/init` starts it after the self-check's
//! verdict. It polls the server, sends the board's facts (`configData`), downloads a deployment's
//! RAUC bundle to `data` (resumed, size and sha256 checked), installs it with `rauc install`,
//! reboots into it, and reports success only after the new slot's self-check said PASS; a FAIL,
//! or a slot that never reached a verdict (U-Boot fell back), is reported as a failure by the slot
//! that runs, naming the failed checks. The action's state is on `data` ([`action`]): exactly one
//! final feedback per action, whatever reboots and power cuts come between. `rauc info` says what
//! a bundle is for: a system goes to the other boot slot; a models slot (issue 38) to the models
//! slot not in use, judged by the report of the boot that mapped it, or by the FAIL the self-check
//! kept when it blamed that slot (`report-models-<slot>.json`).
//!
//! [`ddi`] is the protocol, [`config`] the recipe's `[fleet]` table and the token, [`board`] what
//! the client does to the board (RAUC, the slots' reports, reboot).

pub mod action;
pub mod board;
pub mod config;
pub mod ddi;

use crate::slot::Slot;
use action::{Action, Kind, Next, Phase, Verdict};
use anyhow::{Context, Result};
use board::Board;
use ddi::{Ddi, DownloadError, Execution, Finished};
use std::path::PathBuf;
use std::time::Duration;

pub fn log(msg: &str) {
    eprintln!("kiln-fleet: {msg}");
}

/// Faults `kiln fleet` can be told to inject (`KILN_FLEET_INJECT`, set by `/init` from
/// `kiln.inject=fleet-NAME` on the kernel command line, as the self-check's are from
/// `kiln.inject=NAME`), so that the A/B test sees the check that must catch each one fail.
/// Without that word on the command line, none is injected.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inject {
    /// `early-success`: a system install's success is sent right after `rauc install`, before
    /// the reboot and the new slot's verdict, in the words a PASS would give (a client that
    /// trusts RAUC's exit status instead of the new slot's self-check).
    pub early_success: bool,
}

impl Inject {
    pub const ENV: &'static str = "KILN_FLEET_INJECT";

    /// Parse a comma-separated list; unknown names are an error, so a typo in a test does not
    /// silently inject nothing.
    pub fn parse(s: &str) -> Result<Inject> {
        let mut i = Inject::default();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "early-success" => i.early_success = true,
                other => anyhow::bail!(
                    "{}: unknown fault {other:?} (known: early-success)",
                    Inject::ENV
                ),
            }
        }
        Ok(i)
    }

    pub fn from_env() -> Result<Inject> {
        match std::env::var(Inject::ENV) {
            Ok(s) => Inject::parse(&s),
            Err(_) => Ok(Inject::default()),
        }
    }
}

pub struct Client<B: Board> {
    pub cfg: config::Config,
    pub ddi: Ddi,
    pub board: B,
    /// Test faults ([`Inject`]); none unless the kernel command line asks.
    pub inject: Inject,
    dir: PathBuf,
}

impl<B: Board> Client<B> {
    pub fn new(cfg: config::Config, ddi: Ddi, board: B) -> Result<Client<B>> {
        let dir = cfg.state_dir.clone();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Client {
            cfg,
            ddi,
            board,
            inject: Inject::default(),
            dir,
        })
    }

    fn bundle_path(&self, a: &Action) -> PathBuf {
        self.dir.join(format!("{}.raucb", a.sha256))
    }

    fn save(&self, a: &Action) -> Result<()> {
        action::save(&self.dir, a)
    }

    /// One poll and what it asks for. Returns the server's sleep.
    pub fn step(&mut self) -> Result<Option<Duration>> {
        let poll = self.ddi.poll()?;
        if let Some(url) = &poll.config_data {
            match self.ddi.put_config_data(url, &self.board.facts()) {
                Ok(()) => log("configData sent"),
                Err(e) => log(&format!("configData not sent: {e:#}")),
            }
        }
        if poll.confirmation.is_some() {
            log("the server asks for a confirmation (user consent) first: kiln does not confirm on its own; confirm the action on the server or turn user consent off for this target");
        }
        if let Some(url) = &poll.cancel {
            self.cancel(url)?;
        } else if let Some(url) = &poll.deployment {
            self.deploy(url)?;
        } else if let Some(a) = action::load(&self.dir)? {
            if let Phase::Installing { from, .. } | Phase::Installed { from, .. } = &a.phase {
                let written = Slot::parse(from).map(|s| s.other().name()).unwrap_or("?");
                log(&format!("action {} is no longer offered by the server, but {} {written} was written for it: the next action's install overwrites it", a.id, a.kind.word()));
            }
        }
        Ok(poll.sleep)
    }

    fn cancel(&mut self, url: &str) -> Result<()> {
        let (id, stop) = self.ddi.cancel_action(url)?;
        let mut a = action::load(&self.dir)?;
        let (exec, fin, detail) = match &mut a {
            Some(a) if a.id == stop => match a.phase {
                Phase::Downloading => {
                    let _ = std::fs::remove_file(self.bundle_path(a).with_extension("part"));
                    let _ = std::fs::remove_file(self.bundle_path(a));
                    a.phase = Phase::Done { success: false };
                    self.save(a)?;
                    (
                        Execution::Closed,
                        Finished::Success,
                        format!("action {stop} canceled before its install"),
                    )
                }
                _ => (
                    Execution::Rejected,
                    Finished::Failure,
                    format!("action {stop} is already installed (or decided): too late to cancel"),
                ),
            },
            _ => (
                Execution::Closed,
                Finished::Success,
                format!("action {stop} was not running here"),
            ),
        };
        log(&format!("cancelAction {id}: {detail}"));
        self.ddi.cancel_feedback(&id, exec, fin, &[detail])
    }

    fn deploy(&mut self, url: &str) -> Result<()> {
        let d = self.ddi.deployment(url)?;
        let mut a = match action::load(&self.dir)? {
            Some(a) if a.id == d.id => a,
            old => {
                if let Some(o) = old {
                    log(&format!(
                        "action {} ends here: the server now offers action {}",
                        o.id, d.id
                    ));
                }
                if d.artifacts.len() != 1 {
                    let msg = format!(
                        "deployment {} has {} artifacts: kiln installs exactly one RAUC bundle per action",
                        d.id,
                        d.artifacts.len()
                    );
                    log(&msg);
                    return self
                        .ddi
                        .feedback(&d.id, Execution::Closed, Finished::Failure, &[msg]);
                }
                let a = Action::new(&d.id, &d.artifacts[0]);
                self.save(&a)?;
                log(&format!(
                    "action {}: {} ({} bytes, sha256 {})",
                    a.id, a.filename, a.size, a.sha256
                ));
                a
            }
        };
        loop {
            match a.phase.clone() {
                Phase::Downloading => {
                    if d.download == "skip" {
                        log(&format!(
                            "action {}: download skip (maintenance window?): waiting",
                            a.id
                        ));
                        return Ok(());
                    }
                    let art = &d.artifacts[0];
                    if art.sha256 != a.sha256 || art.size != a.size {
                        a.decide(
                            false,
                            vec![format!(
                                "action {}: its artifact changed on the server (size or sha256)",
                                a.id
                            )],
                        );
                        continue;
                    }
                    let dest = self.bundle_path(&a);
                    self.proceeding(&a, format!("downloading {} ({} bytes)", a.filename, a.size));
                    let mut last = 0u64;
                    let step = (a.size / 10).max(1 << 20);
                    match self.ddi.download(art, &dest, |n| {
                        if n >= last + step {
                            last = n;
                            log(&format!("downloaded {n} of {} bytes", art.size));
                        }
                    }) {
                        Ok(()) => {
                            log(&format!(
                                "action {}: {} downloaded, sha256 verified",
                                a.id, a.filename
                            ));
                            if d.maintenance.as_deref() == Some("unavailable") {
                                log(&format!(
                                    "action {}: maintenanceWindow unavailable: downloaded, not installed until the server opens the window",
                                    a.id
                                ));
                                return Ok(());
                            }
                            if d.update == "skip" {
                                let _ = self.ddi.feedback(
                                    &a.id,
                                    Execution::Downloaded,
                                    Finished::None,
                                    &[format!(
                                        "{} downloaded; update skip: not installed",
                                        a.filename
                                    )],
                                );
                                return Ok(());
                            }
                            self.install(&mut a)?;
                        }
                        Err(DownloadError::Retry(m)) => {
                            self.save(&a)?;
                            anyhow::bail!("action {}: {m} (resumed at the next poll)", a.id);
                        }
                        Err(DownloadError::Bad(m)) => a.decide(false, vec![m]),
                    }
                }
                Phase::Installing { .. } | Phase::Installed { .. } => {
                    let running = match a.kind {
                        Kind::System => self.board.running(),
                        Kind::Models => match self.board.running_models() {
                            Some(m) => m,
                            None => {
                                a.decide(
                                    false,
                                    vec![format!(
                                        "no models slot is mapped on this boot (slot {} runs): \
                                         the models update cannot be judged",
                                        self.board.running().name()
                                    )],
                                );
                                continue;
                            }
                        },
                    };
                    let boot_id = self.board.boot_id();
                    match action::next(&a, running, &boot_id) {
                        Some(Next::Install) => self.install(&mut a)?,
                        Some(Next::Reboot) => {
                            log(&format!("action {}: installed; rebooting into it", a.id));
                            return self.board.reboot();
                        }
                        Some(Next::Judge { slot, on_new }) => {
                            let expected = match &a.phase {
                                Phase::Installed { written, .. } => written.clone(),
                                _ => None,
                            };
                            let (ok, details) = match a.kind {
                                Kind::System => {
                                    let v = self.report(slot, "report.json");
                                    action::judge(
                                        expected.as_deref(),
                                        slot,
                                        running,
                                        on_new,
                                        v.as_ref(),
                                    )
                                }
                                Kind::Models => {
                                    let v = action::pick_models(
                                        expected.as_deref(),
                                        slot,
                                        on_new,
                                        self.models_reports(slot),
                                    );
                                    action::judge_models(slot, Some(running), on_new, v.as_ref())
                                }
                            };
                            a.decide(ok, details);
                        }
                        Some(Next::Fail(m)) => a.decide(false, vec![m]),
                        None => a.decide(
                            false,
                            vec!["the action's state names a slot that is not A or B".into()],
                        ),
                    }
                }
                Phase::Final { success, details } => {
                    self.save(&a)?;
                    let fin = if success {
                        Finished::Success
                    } else {
                        Finished::Failure
                    };
                    // The details as JSON: what the server gets, word for word.
                    log(&format!(
                        "action {}: {} {}",
                        a.id,
                        fin_word(success),
                        serde_json::to_string(&details).unwrap_or_default()
                    ));
                    self.ddi.feedback(&a.id, Execution::Closed, fin, &details)?;
                    let _ = std::fs::remove_file(self.bundle_path(&a));
                    let _ = std::fs::remove_file(self.bundle_path(&a).with_extension("part"));
                    a.phase = Phase::Done { success };
                    self.save(&a)?;
                    log(&format!(
                        "action {}: final feedback acknowledged by the server",
                        a.id
                    ));
                    return Ok(());
                }
                Phase::Done { success } => {
                    // The server still offers an action we reported: our feedback was lost on the
                    // way. Say it again (the same words are kept nowhere: the verdict is).
                    log(&format!("action {} was reported ({}) but the server still offers it: reporting again", a.id, fin_word(success)));
                    let fin = if success {
                        Finished::Success
                    } else {
                        Finished::Failure
                    };
                    return self.ddi.feedback(
                        &a.id,
                        Execution::Closed,
                        fin,
                        &[format!("reported before: {}", fin_word(success))],
                    );
                }
            }
        }
    }

    fn proceeding(&self, a: &Action, detail: String) {
        if let Err(e) = self.ddi.feedback(
            &a.id,
            Execution::Proceeding,
            Finished::None,
            std::slice::from_ref(&detail),
        ) {
            log(&format!("proceeding feedback not sent ({detail}): {e:#}"));
        }
    }

    /// A report of boot slot `slot` (`name` in its `kiln` folder), or `None` with the reason
    /// logged; this boot's `report.json` is marked `current`.
    fn report(&self, slot: Slot, name: &str) -> Option<Verdict> {
        match self.board.report(slot, name) {
            Ok(v) => v.map(|mut v| {
                v.current = slot == self.board.running() && name == "report.json";
                v
            }),
            Err(e) => {
                log(&format!("slot {}'s {name} unreadable: {e:#}", slot.name()));
                None
            }
        }
    }

    /// The reports that may judge new models slot `m`, this boot's first: its `report.json`,
    /// the FAIL kept when `m` was blamed (the same system booted again on the other models slot
    /// and replaced `report.json`), then the other boot slot's (a FAIL that marked the system
    /// bad and fell back).
    fn models_reports(&self, m: Slot) -> Vec<Verdict> {
        let kept = crate::selftest::report::models_report_name(m);
        let (run, other) = (self.board.running(), self.board.running().other());
        [
            (run, "report.json"),
            (run, kept.as_str()),
            (other, "report.json"),
            (other, kept.as_str()),
        ]
        .into_iter()
        .filter_map(|(s, n)| self.report(s, n))
        .collect()
    }

    fn install(&mut self, a: &mut Action) -> Result<()> {
        let bundle = self.bundle_path(a);
        let system = self.board.running();
        // What the bundle is for decides which slot it goes to and how it is judged; a bundle
        // RAUC will not read is refused before anything is written.
        a.kind = match self.board.bundle_kind(&bundle) {
            Ok(k) => k,
            Err(reason) => {
                return refuse(a, &bundle, &reason, format!("slot {} runs", system.name()))
            }
        };
        log(&format!(
            "action {}: {} is a {} bundle (rauc info: signature verified)",
            a.id,
            a.filename,
            match a.kind {
                Kind::System => "system",
                Kind::Models => "models",
            }
        ));
        let from = match a.kind {
            Kind::System => system,
            Kind::Models => match self.board.running_models() {
                Some(m) => m,
                None => {
                    let _ = std::fs::remove_file(&bundle);
                    a.decide(
                        false,
                        vec![format!(
                            "{} is a models bundle, and no models slot is mapped on this boot \
                             (slot {} runs): not installed",
                            a.filename,
                            system.name()
                        )],
                    );
                    return Ok(());
                }
            },
        };
        let word = a.kind.word();
        let target = from.other();
        a.installs += 1;
        a.phase = Phase::Installing {
            from: from.name().into(),
            boot_id: self.board.boot_id(),
        };
        self.save(a)?;
        self.proceeding(
            a,
            format!("installing {} into {word} {}", a.filename, target.name()),
        );
        match self.board.install(&bundle) {
            Err(reason) => refuse(a, &bundle, &reason, format!("{word} {} runs", from.name())),
            Ok(()) => {
                let written = match a.kind {
                    Kind::System => self.board.manifest_of(target),
                    Kind::Models => self.board.models_json_of(target),
                }
                .unwrap_or_else(|e| {
                    log(&format!(
                        "what was written to {word} {} is unreadable after the install: {e:#}",
                        target.name()
                    ));
                    None
                });
                a.phase = Phase::Installed {
                    from: from.name().into(),
                    target: target.name().into(),
                    written,
                    boot_id: self.board.boot_id(),
                };
                self.save(a)?;
                self.proceeding(
                    a,
                    match a.kind {
                        Kind::System => format!(
                            "installed into slot {}; rebooting into it: its self-check decides",
                            target.name()
                        ),
                        Kind::Models => format!(
                            "installed into models slot {}; rebooting to map it: the self-check \
                             decides",
                            target.name()
                        ),
                    },
                );
                if self.inject.early_success && a.kind == Kind::System {
                    self.early_success(a, target);
                }
                Ok(())
            }
        }
    }

    /// The injected fault `early-success`: the success a PASS of `target` would give, sent now
    /// (before the reboot and its verdict); the action goes on as if it had not been sent.
    fn early_success(&self, a: &Action, target: Slot) {
        let written = match &a.phase {
            Phase::Installed { written, .. } => written.as_deref(),
            _ => None,
        };
        let details = action::pass_details(target, written);
        log(&format!(
            "injected fault early-success: action {}: success {} before slot {}'s verdict",
            a.id,
            serde_json::to_string(&details).unwrap_or_default(),
            target.name()
        ));
        if let Err(e) = self
            .ddi
            .feedback(&a.id, Execution::Closed, Finished::Success, &details)
        {
            log(&format!("injected fault early-success: not sent: {e:#}"));
        }
    }

    /// Poll for ever: the server's sleep (bounded by `poll_max_s`) with ±10 % jitter; errors
    /// back off from 10 s, doubling, up to the sleep.
    pub fn run(&mut self) -> Result<()> {
        let mut sleep = Duration::from_secs(self.cfg.poll_default_s);
        let mut backoff = Duration::from_secs(10);
        loop {
            let wait = match self.step() {
                Ok(s) => {
                    if let Some(s) = s {
                        sleep = s.max(Duration::from_secs(1));
                    }
                    backoff = Duration::from_secs(10);
                    sleep
                }
                Err(e) => {
                    log(&format!("{e:#}"));
                    let b = backoff.min(sleep);
                    backoff = (backoff * 2).min(Duration::from_secs(3600));
                    b
                }
            };
            let wait = match self.cfg.poll_max_s {
                Some(m) => wait.min(Duration::from_secs(m)),
                None => wait,
            };
            std::thread::sleep(jitter(wait));
        }
    }
}

/// RAUC refused the bundle (`rauc info` or `rauc install`): it is deleted and the action fails
/// with RAUC's reason and what runs.
fn refuse(a: &mut Action, bundle: &std::path::Path, reason: &str, runs: String) -> Result<()> {
    let _ = std::fs::remove_file(bundle);
    a.decide(
        false,
        vec![format!("RAUC refused {}: {reason}", a.filename), runs],
    );
    Ok(())
}

fn fin_word(success: bool) -> &'static str {
    if success {
        "success"
    } else {
        "failure"
    }
}

/// ±10 %: a fleet that booted together does not poll together.
fn jitter(d: Duration) -> Duration {
    let mut b = [0u8; 2];
    let r = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b));
    let x = if r.is_ok() {
        u16::from_le_bytes(b) as f64 / 65535.0
    } else {
        0.5
    };
    d.mul_f64(0.9 + 0.2 * x)
}
