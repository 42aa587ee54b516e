//! `kiln fleet`'s DDI client against `hawkbit_mock` (the hawkbit-rs project's DDI server for
//! tests, on httpmock): every DDI call the client makes, the whole action across a reboot, and
//! the bad servers. The board side here is a record of what the client asked (RAUC and the
//! reboot run for real in the boot stage); the HTTP side is the mock's.

// The DDI server is a host program (its crates are x86-64 dev-dependencies only).
#![cfg(target_arch = "x86_64")]

use hawkbit::ddi::{Execution as HbExec, Finished as HbFin, Type};
use hawkbit_mock::ddi::{ChunkProtocol, DeploymentBuilder, Server, ServerBuilder, Target};
use kiln_runtime::fleet::action::{self, Kind, Phase, Verdict};
use kiln_runtime::fleet::board::Board;
use kiln_runtime::fleet::config::Config;
use kiln_runtime::fleet::ddi::{Artifact, Ddi, DownloadError};
use kiln_runtime::fleet::Client;
use kiln_runtime::slot::Slot;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

#[derive(Default)]
struct Seen {
    installs: Vec<PathBuf>,
    reboots: u32,
}

/// The board: which slot runs, its boot id, the slots' reports; what RAUC answers.
struct FakeBoard {
    running: Slot,
    boot: u32,
    /// Each boot slot's `report.json`.
    reports: [Option<Verdict>; 2],
    /// Other reports in a boot slot's `kiln` folder (the kept `report-models-b.json`).
    kept: Vec<(Slot, String, Verdict)>,
    manifest_after_install: Option<String>,
    /// What `rauc info` says the bundle is for, or its refusal.
    kind: Result<Kind, String>,
    /// The models slot mapped now, and the `kiln-models.json` RAUC writes.
    models: Option<Slot>,
    models_json_after_install: Option<String>,
    rauc_refuses: Option<String>,
    seen: Rc<RefCell<Seen>>,
}

impl Board for FakeBoard {
    fn running(&self) -> Slot {
        self.running
    }
    fn boot_id(&self) -> String {
        format!("boot-{}", self.boot)
    }
    fn running_models(&self) -> Option<Slot> {
        self.models
    }
    fn report(&self, slot: Slot, name: &str) -> anyhow::Result<Option<Verdict>> {
        if name == "report.json" {
            return Ok(self.reports[slot as usize].clone());
        }
        Ok(self
            .kept
            .iter()
            .find(|(s, n, _)| *s == slot && n == name)
            .map(|(_, _, v)| v.clone()))
    }
    fn bundle_kind(&self, bundle: &Path) -> Result<Kind, String> {
        assert!(bundle.exists(), "rauc info on a bundle that is not there");
        self.kind.clone()
    }
    fn install(&mut self, bundle: &Path) -> Result<(), String> {
        assert!(bundle.exists(), "installing a bundle that is not there");
        self.seen.borrow_mut().installs.push(bundle.to_path_buf());
        match &self.rauc_refuses {
            Some(r) => Err(r.clone()),
            None => Ok(()),
        }
    }
    fn manifest_of(&self, _: Slot) -> anyhow::Result<Option<String>> {
        Ok(self.manifest_after_install.clone())
    }
    fn models_json_of(&self, _: Slot) -> anyhow::Result<Option<String>> {
        Ok(self.models_json_after_install.clone())
    }
    fn reboot(&mut self) -> anyhow::Result<()> {
        self.seen.borrow_mut().reboots += 1;
        Ok(())
    }
    fn facts(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("slot".into(), self.running.name().into());
        m.insert("verdict".into(), "PASS".into());
        m
    }
}

struct Lab {
    server: Server,
    dir: tempfile::TempDir,
}

const NAME: &str = "kiln-test-1";

fn lab() -> Lab {
    Lab {
        server: ServerBuilder::default().build(),
        dir: tempfile::tempdir().unwrap(),
    }
}

fn config(server: &str, state: &Path) -> Config {
    Config::parse(
        &format!(
            "server = {server:?}\ncontroller_id = \"fixed:{NAME}\"\nstall_timeout_s = 2\nstate_dir = {:?}\n",
            state.display().to_string()
        ),
        "test",
    )
    .unwrap()
}

fn client(l: &Lab, board: FakeBoard) -> Client<FakeBoard> {
    let cfg = config(&l.server.base_url(), &l.dir.path().join("state"));
    let ddi = Ddi::new(&cfg, NAME, &format!("Key{NAME}")).unwrap();
    Client::new(cfg, ddi, board).unwrap()
}

fn board(seen: &Rc<RefCell<Seen>>) -> FakeBoard {
    FakeBoard {
        running: Slot::A,
        boot: 1,
        reports: [None, None],
        kept: vec![],
        manifest_after_install: Some("m2".into()),
        kind: Ok(Kind::System),
        models: Some(Slot::A),
        models_json_after_install: Some("j2".into()),
        rauc_refuses: None,
        seen: seen.clone(),
    }
}

/// A bundle file and its deployment (one chunk, one artifact, http links).
fn bundle(
    l: &Lab,
    id: &str,
    bytes: &[u8],
    sha256: Option<&str>,
) -> (hawkbit_mock::ddi::Deployment, String) {
    let p = l.dir.path().join("v2.raucb");
    std::fs::write(&p, bytes).unwrap();
    let sum = sha256
        .map(str::to_string)
        .unwrap_or_else(|| hex::encode(Sha256::digest(bytes)));
    let d = DeploymentBuilder::new(id, Type::Forced, Type::Forced)
        .chunk(
            ChunkProtocol::HTTP,
            "os",
            "2",
            "kiln",
            vec![(p, "md5", "sha1", &sum)],
        )
        .build();
    (d, sum)
}

fn expect<'a>(
    t: &'a Target,
    id: &str,
    e: HbExec,
    f: HbFin,
    details: Vec<&str>,
) -> httpmock::Mock<'a> {
    t.expect_deployment_feedback(id, e, f, None, details)
}

fn state(l: &Lab) -> action::Action {
    action::load(&l.dir.path().join("state")).unwrap().unwrap()
}

#[test]
fn success_is_reported_only_after_the_new_slot_passed() {
    let l = lab();
    let t = l.server.add_target(NAME);
    t.request_config(json!({"mode": "merge", "data": {"slot": "A", "verdict": "PASS"}}));
    let body = vec![7u8; 300_000];
    let (d, _) = bundle(&l, "10", &body, None);
    t.push_deployment(d);
    let downloading = expect(
        &t,
        "10",
        HbExec::Proceeding,
        HbFin::None,
        vec!["downloading v2.raucb (300000 bytes)"],
    );
    let installing = expect(
        &t,
        "10",
        HbExec::Proceeding,
        HbFin::None,
        vec!["installing v2.raucb into slot B"],
    );
    let installed = expect(
        &t,
        "10",
        HbExec::Proceeding,
        HbFin::None,
        vec!["installed into slot B; rebooting into it: its self-check decides"],
    );
    let success = expect(
        &t,
        "10",
        HbExec::Closed,
        HbFin::Success,
        vec!["self-check PASS on slot B", "manifest sha256 m2"],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    c.step().unwrap();
    assert_eq!(t.poll_hits(), 1);
    assert_eq!(
        t.config_data_hits(),
        1,
        "configData not sent as the mock expects"
    );
    assert_eq!(t.deployment_hits(), 1);
    assert_eq!(
        (downloading.calls(), installing.calls(), installed.calls()),
        (1, 1, 1)
    );
    assert_eq!(seen.borrow().installs.len(), 1);
    assert_eq!(seen.borrow().reboots, 1);
    // Installed and rebooting: nothing final yet.
    assert_eq!(success.calls(), 0);
    assert!(matches!(state(&l).phase, Phase::Installed { .. }));

    // The reboot: slot B runs, its self-check passed on the new system.
    c.board.running = Slot::B;
    c.board.boot = 2;
    c.board.reports[Slot::B as usize] = Some(Verdict {
        pass: true,
        manifest: Some("m2".into()),
        failed: vec![],
        ..Verdict::default()
    });
    c.step().unwrap();
    assert_eq!(success.calls(), 1);
    assert_eq!(state(&l).phase, Phase::Done { success: true });
    assert_eq!(
        seen.borrow().installs.len(),
        1,
        "installed again after the verdict"
    );
    assert!(
        !c.cfg
            .state_dir
            .join(format!("{}.raucb", state(&l).sha256))
            .exists(),
        "the bundle stays on data"
    );
}

/// The fault the A/B test injects to see its "no success before B's verdict" check fail
/// (`kiln.inject=fleet-early-success`): the success reaches the server before the reboot, in
/// the words the check expects. Unknown fault names are refused, none is the default.
#[test]
fn the_early_success_fault_reports_success_before_the_reboot() {
    use kiln_runtime::fleet::Inject;
    assert_eq!(Inject::parse("").unwrap(), Inject::default());
    let err = Inject::parse("early-sucess").unwrap_err().to_string();
    assert!(
        err.contains("unknown fault") && err.contains(Inject::ENV),
        "{err}"
    );
    let l = lab();
    let t = l.server.add_target(NAME);
    let (d, _) = bundle(&l, "11", &[7u8; 1000], None);
    t.push_deployment(d);
    let success = expect(
        &t,
        "11",
        HbExec::Closed,
        HbFin::Success,
        vec!["self-check PASS on slot B", "manifest sha256 m2"],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    assert_eq!(c.inject, Inject::default(), "a fault injected by default");
    c.inject = Inject::parse("early-success").unwrap();
    c.step().unwrap();
    assert_eq!(seen.borrow().reboots, 1);
    assert_eq!(success.calls(), 1, "no success before the reboot");
    assert!(matches!(state(&l).phase, Phase::Installed { .. }));
}

#[test]
fn a_failed_self_check_is_reported_by_the_slot_that_fell_back() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let (d, _) = bundle(&l, "11", b"bundle v3", None);
    t.push_deployment(d);
    let failure = expect(
        &t,
        "11",
        HbExec::Closed,
        HbFin::Failure,
        vec![
            "self-check FAIL on slot B: model.nll.cpu, report.required",
            "slot A runs",
        ],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    c.step().unwrap();
    assert_eq!(failure.calls(), 0);
    // B booted, failed, was marked bad; U-Boot / init went back to A (a new boot).
    c.board.boot = 3;
    c.board.reports[Slot::B as usize] = Some(Verdict {
        pass: false,
        manifest: Some("m2".into()),
        failed: vec!["model.nll.cpu".into(), "report.required".into()],
        ..Verdict::default()
    });
    c.step().unwrap();
    assert_eq!(failure.calls(), 1);
    assert_eq!(state(&l).phase, Phase::Done { success: false });
    // The server keeps offering the action (its feedback was lost): said again, never installed again.
    let again = expect(
        &t,
        "11",
        HbExec::Closed,
        HbFin::Failure,
        vec!["reported before: failure"],
    );
    c.step().unwrap();
    assert_eq!(again.calls(), 1);
    assert_eq!(seen.borrow().installs.len(), 1);
}

#[test]
fn a_slot_that_never_reached_a_verdict_is_a_failure() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let (d, _) = bundle(&l, "12", b"bundle", None);
    t.push_deployment(d);
    let failure = expect(
        &t,
        "12",
        HbExec::Closed,
        HbFin::Failure,
        vec![
            "slot B never reached a self-check verdict of the new system: U-Boot fell back",
            "slot A runs",
        ],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    c.step().unwrap();
    c.board.boot = 2;
    // B's partition still holds the old system's report (another manifest).
    c.board.reports[Slot::B as usize] = Some(Verdict {
        pass: true,
        manifest: Some("m1".into()),
        failed: vec![],
        ..Verdict::default()
    });
    c.step().unwrap();
    assert_eq!(failure.calls(), 1);
}

#[test]
fn a_bundle_rauc_refuses_is_a_failure_with_rauc_s_reason() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let (d, _) = bundle(&l, "13", b"signed by someone else", None);
    t.push_deployment(d);
    let failure = expect(
        &t,
        "13",
        HbExec::Closed,
        HbFin::Failure,
        vec![
            "RAUC refused v2.raucb: signature verification failed (rauc install exited 1)",
            "slot A runs",
        ],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut b = board(&seen);
    b.rauc_refuses = Some("signature verification failed (rauc install exited 1)".into());
    let mut c = client(&l, b);
    c.step().unwrap();
    assert_eq!(failure.calls(), 1);
    assert_eq!(seen.borrow().reboots, 0);
}

/// A models verdict as a report gives it.
fn models_verdict(pass: bool, slot: Slot, json: &str, failed: &[&str]) -> Verdict {
    Verdict {
        pass,
        manifest: Some("m1".into()),
        failed: failed.iter().map(|s| s.to_string()).collect(),
        models_slot: Some(slot.name().into()),
        models_json: Some(json.into()),
        ..Verdict::default()
    }
}

/// A models bundle (issue 38): RAUC writes the models slot not in use, the reboot maps it and
/// this boot's self-check of it decides; the system slot stays.
#[test]
fn a_models_bundle_succeeds_when_the_boot_that_maps_it_passes() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let (d, _) = bundle(&l, "20", b"models bundle", None);
    t.push_deployment(d);
    let installing = expect(
        &t,
        "20",
        HbExec::Proceeding,
        HbFin::None,
        vec!["installing v2.raucb into models slot B"],
    );
    let installed = expect(
        &t,
        "20",
        HbExec::Proceeding,
        HbFin::None,
        vec!["installed into models slot B; rebooting to map it: the self-check decides"],
    );
    let success = expect(
        &t,
        "20",
        HbExec::Closed,
        HbFin::Success,
        vec![
            "self-check PASS on models slot B",
            "kiln-models.json sha256 j2",
        ],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut b = board(&seen);
    b.kind = Ok(Kind::Models);
    let mut c = client(&l, b);
    c.step().unwrap();
    assert_eq!((installing.calls(), installed.calls()), (1, 1));
    assert_eq!(seen.borrow().reboots, 1);
    let a = state(&l);
    assert_eq!(a.kind, Kind::Models);
    assert!(
        matches!(&a.phase, Phase::Installed { from, target, written, .. }
            if from == "A" && target == "B" && written.as_deref() == Some("j2")),
        "{a:?}"
    );
    // The reboot: the same system (A), models slot B mapped. The old report of boot slot B
    // (another system) says nothing of it.
    c.board.boot = 2;
    c.board.models = Some(Slot::B);
    c.board.reports[Slot::B as usize] = Some(models_verdict(false, Slot::B, "j0", &["x"]));
    c.board.reports[Slot::A as usize] = Some(models_verdict(true, Slot::B, "j2", &[]));
    c.step().unwrap();
    assert_eq!(success.calls(), 1);
    assert_eq!(state(&l).phase, Phase::Done { success: true });
}

/// A models slot blamed on its first boot: marked bad, and the same system booted again on the
/// other models slot, whose PASS replaced `report.json`. The failure names the checks from the
/// FAIL kept beside it; a kept FAIL of an older install of that slot (another
/// `kiln-models.json`) is no verdict of this one.
#[test]
fn a_blamed_models_slot_is_a_failure_from_its_kept_report() {
    for (kept_json, want) in [
        (
            "j2",
            vec![
                "self-check FAIL on models slot B: model.nll.cpu",
                "models slot A runs",
            ],
        ),
        (
            "j0",
            vec![
                "models slot B never reached a self-check verdict of the new models",
                "models slot A runs",
            ],
        ),
    ] {
        let l = lab();
        let t = l.server.add_target(NAME);
        let (d, _) = bundle(&l, "21", b"models bundle", None);
        t.push_deployment(d);
        let failure = expect(&t, "21", HbExec::Closed, HbFin::Failure, want.clone());
        let seen = Rc::new(RefCell::new(Seen::default()));
        let mut b = board(&seen);
        b.kind = Ok(Kind::Models);
        let mut c = client(&l, b);
        c.step().unwrap();
        c.board.boot = 3;
        c.board.models = Some(Slot::A);
        c.board.reports[Slot::A as usize] = Some(models_verdict(true, Slot::A, "j1", &[]));
        c.board.kept.push((
            Slot::A,
            "report-models-b.json".into(),
            models_verdict(false, Slot::B, kept_json, &["model.nll.cpu"]),
        ));
        c.step().unwrap();
        assert_eq!(failure.calls(), 1, "want {want:?}");
        assert_eq!(state(&l).phase, Phase::Done { success: false });
    }
}

/// A power cut while RAUC writes a models slot (the state says `Installing`, from models slot A,
/// on an earlier boot): the boot after it maps A again, so the bundle is installed again; had
/// RAUC finished and its hook put B first before the cut, the boot maps B and its report
/// decides, without a second install.
#[test]
fn a_models_install_cut_by_the_power_goes_by_the_models_slot_mapped_after_it() {
    for (mapped, installs, want) in [
        (Slot::A, 1, None),
        (
            Slot::B,
            0,
            Some(vec![
                "self-check PASS on models slot B",
                "kiln-models.json sha256 j2",
            ]),
        ),
    ] {
        let l = lab();
        let t = l.server.add_target(NAME);
        let (d, sum) = bundle(&l, "23", b"models bundle", None);
        t.push_deployment(d);
        let success = want
            .clone()
            .map(|w| expect(&t, "23", HbExec::Closed, HbFin::Success, w));
        let seen = Rc::new(RefCell::new(Seen::default()));
        let mut b = board(&seen);
        b.kind = Ok(Kind::Models);
        b.boot = 2;
        b.models = Some(mapped);
        b.reports[Slot::A as usize] = Some(Verdict {
            pass: true,
            models_slot: Some(mapped.name().into()),
            models_json: Some("j2".into()),
            ..Verdict::default()
        });
        let mut c = client(&l, b);
        let mut a = action::Action::new(
            "23",
            &Artifact {
                filename: "v2.raucb".into(),
                size: 13,
                sha256: sum.clone(),
                url: String::new(),
            },
        );
        a.kind = Kind::Models;
        a.installs = 1;
        a.phase = Phase::Installing {
            from: "A".into(),
            boot_id: "boot-1".into(),
        };
        std::fs::create_dir_all(&c.cfg.state_dir).unwrap();
        std::fs::write(
            c.cfg.state_dir.join(format!("{sum}.raucb")),
            b"models bundle",
        )
        .unwrap();
        action::save(&c.cfg.state_dir, &a).unwrap();
        c.step().unwrap();
        assert_eq!(seen.borrow().installs.len(), installs, "mapped {mapped:?}");
        match success {
            None => {
                assert_eq!(seen.borrow().reboots, 1);
                assert!(
                    matches!(&state(&l).phase, Phase::Installed { target, .. } if target == "B"),
                    "{:?}",
                    state(&l)
                );
            }
            Some(m) => {
                assert_eq!(m.calls(), 1);
                assert_eq!(state(&l).phase, Phase::Done { success: true });
            }
        }
    }
}

/// `rauc info` refuses the bundle (its signature): a failure with RAUC's reason, nothing
/// installed, no reboot.
#[test]
fn a_bundle_rauc_info_refuses_is_never_installed() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let (d, _) = bundle(&l, "22", b"signed by someone else", None);
    t.push_deployment(d);
    let failure = expect(
        &t,
        "22",
        HbExec::Closed,
        HbFin::Failure,
        vec![
            "RAUC refused v2.raucb: signature verification failed (rauc info exited 1)",
            "slot A runs",
        ],
    );
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut b = board(&seen);
    b.kind = Err("signature verification failed (rauc info exited 1)".into());
    let mut c = client(&l, b);
    c.step().unwrap();
    assert_eq!(failure.calls(), 1);
    assert!(seen.borrow().installs.is_empty());
    assert_eq!(seen.borrow().reboots, 0);
}

#[test]
fn an_artifact_whose_hash_differs_is_deleted_never_installed() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let wrong = "0".repeat(64);
    let (d, _) = bundle(&l, "14", b"tampered", Some(&wrong));
    t.push_deployment(d);
    let sum = hex::encode(Sha256::digest(b"tampered"));
    let detail = format!("v2.raucb: sha256 {sum}, the deployment announced {wrong}: deleted");
    let failure = expect(&t, "14", HbExec::Closed, HbFin::Failure, vec![&detail]);
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    c.step().unwrap();
    assert_eq!(failure.calls(), 1);
    assert!(seen.borrow().installs.is_empty());
}

#[test]
fn a_closed_maintenance_window_downloads_once_and_installs_when_it_opens() {
    use hawkbit::ddi::MaintenanceWindow;
    let l = lab();
    let t = l.server.add_target(NAME);
    let p = l.dir.path().join("v2.raucb");
    std::fs::write(&p, b"bundle").unwrap();
    let sum = hex::encode(Sha256::digest(b"bundle"));
    let window = |w| {
        DeploymentBuilder::new("17", Type::Forced, Type::Forced)
            .maintenance_window(w)
            .chunk(
                ChunkProtocol::HTTP,
                "os",
                "2",
                "kiln",
                vec![(p.clone(), "md5", "sha1", &sum)],
            )
            .build()
    };
    t.push_deployment(window(MaintenanceWindow::Unavailable));
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    use std::os::unix::fs::MetadataExt;
    let bundle = c.cfg.state_dir.join(format!("{sum}.raucb"));
    c.step().unwrap();
    let first = std::fs::metadata(&bundle)
        .expect("not downloaded ahead of the window")
        .ino();
    c.step().unwrap();
    assert!(
        seen.borrow().installs.is_empty(),
        "installed outside the maintenance window"
    );
    // Fetched once: a second download would have put a new file in its place.
    assert_eq!(
        std::fs::metadata(&bundle).unwrap().ino(),
        first,
        "downloaded again at the next poll"
    );
    t.push_deployment(window(MaintenanceWindow::Available));
    c.step().unwrap();
    assert_eq!(seen.borrow().installs.len(), 1);
}

#[test]
fn cancel_before_the_install() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    // An action started (its state says downloading), then the server cancels it.
    let a = action::Action::new(
        "15",
        &Artifact {
            filename: "x.raucb".into(),
            size: 5,
            sha256: "a".repeat(64),
            url: String::new(),
        },
    );
    action::save(&c.cfg.state_dir, &a).unwrap();
    t.cancel_action("15");
    let fb = t.expect_cancel_feedback(
        "15",
        HbExec::Closed,
        HbFin::Success,
        vec!["action 15 canceled before its install"],
    );
    c.step().unwrap();
    assert_eq!(t.cancel_action_hits(), 1);
    assert_eq!(fb.calls(), 1);
    assert_eq!(state(&l).phase, Phase::Done { success: false });
}

#[test]
fn a_wrong_token_is_an_error_that_names_it() {
    let l = lab();
    let _t = l.server.add_target(NAME);
    let cfg = config(&l.server.base_url(), &l.dir.path().join("state"));
    let ddi = Ddi::new(&cfg, NAME, "KeyOfSomeoneElse").unwrap();
    let e = format!("{:#}", ddi.poll().unwrap_err());
    // The mock answers an unmatched request 404 (hawkBit: 401).
    assert!(e.contains("HTTP 404") && e.contains("controller id"), "{e}");
}

// Bad servers beyond the mock's DDI: httpmock, the mock's own engine, answering as they would.

fn raw_client(srv: &httpmock::MockServer, dir: &Path) -> Ddi {
    let cfg = config(&srv.base_url(), dir);
    Ddi::new(&cfg, NAME, "tok").unwrap()
}

const POLL: &str = "/DEFAULT/controller/v1/kiln-test-1";

#[test]
fn malformed_and_failing_answers_are_errors_with_their_cause() {
    let srv = httpmock::MockServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ddi = raw_client(&srv, dir.path());
    let mut m = srv.mock(|w, t| {
        w.path(POLL);
        t.status(200).body("{\"config\": ");
    });
    assert!(format!("{:#}", ddi.poll().unwrap_err()).contains("not JSON"));
    m.delete();
    let mut m = srv.mock(|w, t| {
        w.path(POLL);
        t.status(503);
    });
    let e = format!("{:#}", ddi.poll().unwrap_err());
    assert!(e.contains("HTTP 503") && e.contains("retried"), "{e}");
    m.delete();
    // An answer larger than any DDI answer.
    let mut m = srv.mock(|w, t| {
        w.path(POLL);
        t.status(200).body(format!("[{}0]", "0,".repeat(1 << 20)));
    });
    assert!(format!("{:#}", ddi.poll().unwrap_err()).contains("at most"));
    m.delete();
    // Links are followed as paths on the configured server, never at the host they name: the
    // token goes nowhere else. A path outside this controller's is not followed at all.
    let other = httpmock::MockServer::start();
    let theirs = other.mock(|w, t| {
        w.any_request();
        t.status(200).json_body(json!({}));
    });
    let mut m = srv.mock(|w, t| {
        w.path(POLL);
        t.status(200)
            .json_body(json!({"_links": {"deploymentBase": {"href": other.url("/steal")}}}));
    });
    let p = ddi.poll().unwrap();
    let e = format!(
        "{:#}",
        ddi.deployment(p.deployment.as_deref().unwrap())
            .unwrap_err()
    );
    assert!(e.contains("not under this controller"), "{e}");
    m.delete();
    srv.mock(|w, t| {
        w.path(POLL);
        t.status(200).json_body(json!({"_links": {"deploymentBase": {"href": other.url(format!("{POLL}/deploymentBase/3"))}}}));
    });
    let ours = srv.mock(|w, t| {
        w.path(format!("{POLL}/deploymentBase/3"))
            .header("Authorization", "TargetToken tok");
        t.status(200)
            .json_body(json!({"id": "3", "deployment": {"chunks": []}}));
    });
    let p = ddi.poll().unwrap();
    ddi.deployment(p.deployment.as_deref().unwrap()).unwrap();
    assert_eq!((ours.calls(), theirs.calls()), (1, 0));
}

fn art(url: String, bytes: &[u8]) -> Artifact {
    Artifact {
        filename: "b.raucb".into(),
        size: bytes.len() as u64,
        sha256: hex::encode(Sha256::digest(bytes)),
        url,
    }
}

#[test]
fn downloads_resume_after_a_cut_with_a_range_request() {
    let srv = httpmock::MockServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ddi = raw_client(&srv, dir.path());
    let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let a = art(srv.url("/download/b.raucb"), &body);
    let dest = dir.path().join("b.raucb");
    // First: the body ends after 70 000 bytes (a truncated answer).
    let mut cut = srv.mock(|w, t| {
        w.path("/download/b.raucb")
            .header("Authorization", "TargetToken tok");
        t.status(200).body(&body[..70_000]);
    });
    match ddi.download(&a, &dest, |_| {}) {
        Err(DownloadError::Retry(m)) => assert!(m.contains("70000"), "{m}"),
        r => panic!("{r:?}"),
    }
    cut.delete();
    let resumed = srv.mock(|w, t| {
        w.path("/download/b.raucb").header("Range", "bytes=70000-");
        t.status(206)
            .header("Content-Range", "bytes 70000-199999/200000")
            .body(&body[70_000..]);
    });
    ddi.download(&a, &dest, |_| {}).unwrap();
    assert_eq!(resumed.calls(), 1);
    assert_eq!(std::fs::read(&dest).unwrap(), body);
}

#[test]
fn an_artifact_larger_than_the_free_space_is_refused_before_a_byte() {
    let srv = httpmock::MockServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ddi = raw_client(&srv, dir.path());
    let fetch = srv.mock(|w, t| {
        w.path("/download/b.raucb");
        t.status(200).body("x");
    });
    // 1 EiB: no file system here holds it.
    let a = Artifact {
        size: 1 << 60,
        ..art(srv.url("/download/b.raucb"), b"x")
    };
    let dest = dir.path().join("b.raucb");
    match ddi.download(&a, &dest, |_| {}) {
        Err(DownloadError::Bad(m)) => assert!(
            m.contains("does not fit on") && m.contains("free; not downloaded"),
            "{m}"
        ),
        r => panic!("{r:?}"),
    }
    assert_eq!(fetch.calls(), 0, "a byte was requested");
    assert!(!dest.with_extension("part").exists() && !dest.exists());
    // What fits is fetched.
    ddi.download(&art(srv.url("/download/b.raucb"), b"x"), &dest, |_| {})
        .unwrap();
    assert_eq!(fetch.calls(), 1);
}

#[test]
fn a_stalled_download_times_out_and_keeps_its_bytes() {
    let srv = httpmock::MockServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ddi = raw_client(&srv, dir.path());
    let a = art(srv.url("/download/b.raucb"), b"0123456789");
    srv.mock(|w, t| {
        w.path("/download/b.raucb");
        t.status(200)
            .delay(std::time::Duration::from_secs(5))
            .body("0123456789");
    });
    let t0 = std::time::Instant::now();
    let r = ddi.download(&a, &dir.path().join("b.raucb"), |_| {});
    assert!(matches!(r, Err(DownloadError::Retry(_))), "{r:?}");
    assert!(
        t0.elapsed().as_secs() < 5,
        "the stall was not cut at the 2 s stall timeout"
    );
}

#[test]
fn more_bytes_than_announced_and_compressed_bodies_are_refused_undecompressed() {
    let srv = httpmock::MockServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ddi = raw_client(&srv, dir.path());
    let mut a = art(srv.url("/download/b.raucb"), b"0123456789");
    srv.mock(|w, t| {
        w.path("/download/b.raucb");
        t.status(200).body(vec![b'x'; 100_000]);
    });
    match ddi.download(&a, &dir.path().join("b.raucb"), |_| {}) {
        Err(DownloadError::Bad(m)) => assert!(m.contains("more than the 10 bytes"), "{m}"),
        r => panic!("{r:?}"),
    }
    // A gzip bomb: 64 MiB of zeros in ~64 KiB, announced as the 64 MiB it inflates to.
    let zeros = vec![0u8; 64 << 20];
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, &zeros).unwrap();
    let gz = gz.finish().unwrap();
    a = art(srv.url("/bomb"), &zeros);
    let bomb = srv.mock(|w, t| {
        w.path("/bomb").header_missing("Accept-Encoding");
        t.status(200).header("Content-Encoding", "gzip").body(&gz);
    });
    let dest = dir.path().join("bomb.raucb");
    let r = ddi.download(&a, &dest, |_| {});
    assert_eq!(bomb.calls(), 1, "Accept-Encoding was sent");
    assert!(
        matches!(&r, Err(DownloadError::Retry(m)) if m.contains(&format!("after {} of", gz.len()))),
        "{r:?}"
    );
    assert_eq!(
        std::fs::metadata(dest.with_extension("part"))
            .unwrap()
            .len(),
        gz.len() as u64,
        "the body was inflated"
    );
}

#[test]
fn credentials_go_only_to_the_configured_host() {
    let srv = httpmock::MockServer::start();
    let cdn = httpmock::MockServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ddi = raw_client(&srv, dir.path());
    let body = b"bundle bytes";
    // A redirect from the server to another host: followed without the token.
    srv.mock(|w, t| {
        w.path("/download/b.raucb")
            .header("Authorization", "TargetToken tok");
        t.status(302).header("Location", cdn.url("/b.raucb"));
    });
    let clean = cdn.mock(|w, t| {
        w.path("/b.raucb").header_missing("Authorization");
        t.status(200).body(body);
    });
    ddi.download(
        &art(srv.url("/download/b.raucb"), body),
        &dir.path().join("1.raucb"),
        |_| {},
    )
    .unwrap();
    assert_eq!(clean.calls(), 1);
    // An artifact link straight to another host: fetched without the token.
    ddi.download(
        &art(cdn.url("/b.raucb"), body),
        &dir.path().join("2.raucb"),
        |_| {},
    )
    .unwrap();
    assert_eq!(clean.calls(), 2);
}

#[test]
fn a_server_that_vanishes_mid_action_loses_nothing() {
    let l = lab();
    let t = l.server.add_target(NAME);
    let body = vec![1u8; 1000];
    let (d, _) = bundle(&l, "16", &body, None);
    t.push_deployment(d);
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut c = client(&l, board(&seen));
    // The artifact's mock answers, but the action's state is written first: replace the
    // server by a dead port and the state stays, resumable.
    let a = action::Action::new(
        "16",
        &Artifact {
            filename: "v2.raucb".into(),
            size: 1000,
            sha256: hex::encode(Sha256::digest(&body)),
            url: String::new(),
        },
    );
    action::save(&c.cfg.state_dir, &a).unwrap();
    let dead = {
        let s = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap().port()
    };
    let cfg = config(&format!("http://127.0.0.1:{dead}"), &c.cfg.state_dir);
    c.ddi = Ddi::new(&cfg, NAME, &format!("Key{NAME}")).unwrap();
    let e = format!("{:#}", c.step().unwrap_err());
    assert!(e.contains(&format!("127.0.0.1:{dead}")), "{e}");
    assert_eq!(state(&l).phase, Phase::Downloading);
    assert!(seen.borrow().installs.is_empty());
}

/// The DDI server of the boot stage (`cargo xtask ab-test`): `hawkbit_mock` for the controllers
/// named by `KILN_DDI_TARGET` (a comma list: one target each), driven line by line on stdin by the
/// harness, answering on stdout (lines starting `DDI `). Not a test of its own: `--ignored
/// --exact ddi_stand_in`. A line `@NAME COMMAND` is for target NAME, a bare command for the first.
///
/// - `deploy ID FILE SHA256 LOCATION`: a deployment of FILE whose download link (on this server,
///   with the token) redirects to LOCATION (nginx, without it).
/// - `expect ID EXECUTION FINISHED DETAILS-JSON`: a feedback the board must send, exactly; `DDI
///   expect K` names it.
/// - `calls K`, `polls`: how often it came, how often the board polled.
#[test]
#[ignore]
fn ddi_stand_in() {
    use std::io::BufRead;
    let Ok(names) = std::env::var("KILN_DDI_TARGET") else {
        panic!("KILN_DDI_TARGET: the controller ids to serve");
    };
    let names: Vec<&str> = names.split(',').collect();
    let server = ServerBuilder::default().build();
    let targets: Vec<_> = names.iter().map(|n| server.add_target(n)).collect();
    println!("DDI url {}", server.base_url());
    let mut mocks = Vec::new();
    let exec = |s: &str| match s {
        "closed" => HbExec::Closed,
        "proceeding" => HbExec::Proceeding,
        "canceled" => HbExec::Canceled,
        "rejected" => HbExec::Rejected,
        "downloaded" => HbExec::Downloaded,
        _ => panic!("execution {s:?}"),
    };
    let fin = |s: &str| match s {
        "success" => HbFin::Success,
        "failure" => HbFin::Failure,
        "none" => HbFin::None,
        _ => panic!("finished {s:?}"),
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let (i, cmd) = match line.strip_prefix('@').and_then(|l| l.split_once(' ')) {
            Some((n, cmd)) => match names.iter().position(|x| *x == n) {
                Some(i) => (i, cmd),
                None => {
                    println!("DDI error no target {n:?}");
                    continue;
                }
            },
            None => (0, line.as_str()),
        };
        let (name, t) = (names[i], &targets[i]);
        let w: Vec<&str> = cmd.splitn(5, ' ').collect();
        match w[..] {
            ["deploy", id, file, sha, loc] => {
                let path = PathBuf::from(file);
                let base = path.file_name().unwrap().to_str().unwrap().to_string();
                let (loc, token) = (loc.to_string(), format!("TargetToken Key{name}"));
                let d = DeploymentBuilder::new(id, Type::Forced, Type::Forced)
                    .chunk_with_mock(
                        ChunkProtocol::HTTP,
                        "os",
                        id,
                        "kiln",
                        vec![(path, "md5", "sha1", sha)],
                        Box::new(move |w, t| {
                            w.method(httpmock::Method::GET)
                                .path(format!("/download/{base}"))
                                .header("Authorization", token.clone());
                            t.status(302).header("Location", loc.clone());
                        }),
                    )
                    .build();
                t.push_deployment(d);
                println!("DDI ok");
            }
            ["expect", id, e, f, details] => {
                let d: Vec<String> = serde_json::from_str(details).unwrap();
                let d: Vec<&str> = d.iter().map(String::as_str).collect();
                mocks.push(t.expect_deployment_feedback(id, exec(e), fin(f), None, d));
                println!("DDI expect {}", mocks.len() - 1);
            }
            ["calls", k] => {
                let k: usize = k.parse().unwrap();
                println!("DDI calls {k} {}", mocks[k].calls());
            }
            ["polls"] => println!("DDI polls {}", t.poll_hits()),
            ["quit"] => return,
            _ => println!("DDI error {line:?}"),
        }
    }
}
