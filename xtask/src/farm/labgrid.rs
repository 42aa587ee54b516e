//! `cargo xtask labgrid`: kiln's labgrid environments and board suite (`images/labgrid/`) run by
//! labgrid itself, pinned from PyPI into a venv: `KilnStrategy` (off → written → verdict →
//! shell → serving) and `test_kiln_board.py` (the check lines against the report, the report on
//! the shell and over HTTP, an A/B update through RAUC, a power cut at the verdict). On the QEMU
//! board (`qemu-virt.yaml`, labgrid's QEMUDriver) this prepares what the environment names: U-Boot's
//! environment on the second pflash (no `kiln.mode`: init serves and gives the shell), a path for
//! the disk copy the strategy writes. For a rack (`--env images/labgrid/rock-5b.yaml`) the LG_*
//! variables of that file come from the caller.
//!
//! With `--remote` the QEMU board is a remote place on loopback ([`super::remote`]): a
//! coordinator, an exporter exporting its console through ser2net, the place acquired with
//! `labgrid-client`, and the suite run through it (`qemu-virt-remote.yaml`).
//!
//! CI runs the suite in `boot-qemu-ab`, on that stage's image and its `v2.raucb`, and requires
//! all four tests to pass (none skipped); then the boot and report tests once more through the
//! remote place ([`REMOTE_TESTS`], one boot); and loads `rock-5b.yaml` with labgrid's own config
//! loader (`xtask/tests/labgrid_envs.py`): every resource and driver of a rack place is named.

use anyhow::{ensure, Context, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use xshell::cmd;

/// labgrid 26.0.1 and the versions of its dependencies it resolved to (pip, Python 3.11):
/// every package of the venv pinned, so the suite runs the same labgrid on every host.
pub const PINS: &str = "labgrid==26.0.1 attrs==26.1.0 certifi==2026.10.19.post1 \
charset-normalizer==3.5.3 exceptiongroup==1.3.2 grpcio==1.85.3 grpcio-reflection==1.85.1 \
idna==3.21 iniconfig==2.3.1 Jinja2==3.1.6 MarkupSafe==3.0.4 packaging==26.4 pexpect==4.9.0 \
pluggy==1.7.0 protobuf==7.36.2 ptyprocess==0.7.0 Pygments==2.21.0 pyserial-labgrid==3.5.0.2 \
pytest==9.2.0 pyudev==0.24.5 pyusb==1.3.1 PyYAML==6.0.4 requests==2.34.2 \
typing_extensions==4.16.0 urllib3==2.8.0 xmodem==0.5.0";

/// The suite's tests, all of which CI requires to pass.
pub const TESTS: &[&str] = &[
    "test_boot_verdict_and_check_lines",
    "test_report_over_shell_and_http",
    "test_ab_update_boots_the_other_slot",
    "test_power_cut_at_the_verdict",
];

/// The tests CI runs once more through the remote place: the first boot's (every check line
/// against the report, the verdict) and the report on the shell and over HTTP, in one boot.
pub const REMOTE_TESTS: &[&str] = &[
    "test_boot_verdict_and_check_lines",
    "test_report_over_shell_and_http",
];

#[derive(clap::Args)]
pub struct Args {
    /// The labgrid environment (default: images/labgrid/qemu-virt.yaml, the QEMU board).
    #[arg(long)]
    pub env: Option<PathBuf>,
    /// The image the strategy writes (default: target/images/kiln-qemu-virt.img; build it with
    /// `cargo xtask image`).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// The RAUC bundle the update test installs (`cargo xtask bundle`); without it that test is
    /// skipped, by name.
    #[arg(long)]
    pub bundle: Option<PathBuf>,
    /// The QEMU board as a remote place, on loopback: labgrid-coordinator, labgrid-exporter
    /// exporting the board's serial console (ser2net, RFC 2217) and its HTTP address, the place
    /// created and acquired with labgrid-client, and the suite run through it
    /// (images/labgrid/qemu-virt-remote.yaml; power: an external command that starts and kills
    /// QEMU, the stand-in for a PDU). Logs of every piece in target/labgrid-remote/remote/.
    #[arg(long, conflicts_with = "env")]
    pub remote: bool,
    /// Arguments for pytest, after `--` (e.g. `-- -k power_cut`).
    #[arg(last = true)]
    pub pytest: Vec<String>,
}

fn dir() -> PathBuf {
    crate::paths::project_root().join("images/labgrid")
}

/// What a run of the suite found, from its JUnit XML.
#[derive(Debug, Default)]
pub struct Outcome {
    pub passed: Vec<String>,
    pub failed: Vec<String>,
    pub skipped: Vec<String>,
    /// What else a failure should name: with `--remote`, the farm's pieces that died during
    /// the run and where every piece logs.
    pub farm: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let o = suite(&args)?;
    println!(
        "labgrid: {} passed, {} failed, {} skipped{}",
        o.passed.len(),
        o.failed.len(),
        o.skipped.len(),
        if o.skipped.is_empty() {
            String::new()
        } else {
            format!(" ({})", o.skipped.join(", "))
        }
    );
    ensure!(
        o.failed.is_empty(),
        "labgrid: failed: {}{}",
        o.failed.join(", "),
        o.farm.map(|f| format!(" ({f})")).unwrap_or_default()
    );
    Ok(())
}

/// Run the suite with `args`; the outcome per test (pytest's own exit status is not used: a
/// failure is read from the JUnit XML, with the rest).
pub fn suite(args: &Args) -> Result<Outcome> {
    let python = crate::doctor::pinned_venv("labgrid-venv", PINS)?;
    let env = args.env.clone().unwrap_or_else(|| {
        dir().join(if args.remote {
            "qemu-virt-remote.yaml"
        } else {
            "qemu-virt.yaml"
        })
    });
    let env = std::fs::canonicalize(&env)
        .with_context(|| format!("the labgrid environment {}", env.display()))?;
    let work = crate::paths::target_dir().join(if args.remote {
        "labgrid-remote"
    } else {
        "labgrid"
    });
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let image = args
        .image
        .clone()
        .unwrap_or_else(|| crate::boot_test::image_path("qemu-virt"));
    let image = std::fs::canonicalize(&image).with_context(|| {
        format!(
            "the image {} (cargo xtask image, or --image)",
            image.display()
        )
    })?;
    let mut vars: Vec<(&str, OsString)> = vec![("LG_KILN_IMAGE", image.into())];
    if let Some(b) = &args.bundle {
        let b = std::fs::canonicalize(b)
            .with_context(|| format!("the bundle {} (cargo xtask bundle)", b.display()))?;
        vars.push(("LG_KILN_BUNDLE", b.into()));
    }
    let mut farm = None;
    if args.remote {
        crate::doctor::ensure(crate::doctor::FOR_BOOT)?;
        crate::doctor::ensure(&[&crate::doctor::SER2NET])?;
        let pflash = crate::boot_test::pflash_with(&work, "")?;
        let disk = work.join("disk.img");
        let f = super::remote::Farm::start(&super::remote::Board {
            python: &python,
            work: &work,
            disk: &disk,
            pflash: &pflash,
        })
        .context("labgrid --remote: bringing up the loopback farm")?;
        vars.push(("LG_KILN_DISK", disk.into()));
        vars.extend(f.vars().into_iter().map(|(k, v)| (k, v.into())));
        farm = Some(f);
    } else if env.file_name().is_some_and(|n| n == "qemu-virt.yaml") {
        crate::doctor::ensure(crate::doctor::FOR_BOOT)?;
        // No kiln.mode: init runs the self-check, then serves and gives the console shell.
        vars.push((
            "LG_KILN_PFLASH",
            crate::boot_test::pflash_with(&work, "")?.into(),
        ));
        vars.push(("LG_KILN_DISK", work.join("disk.img").into()));
        let q = crate::tools_root::qemu_virt()?;
        vars.push(("LG_UBOOT", q.uboot.into()));
        vars.push(("LG_QEMU_BIN", q.qemu.into()));
    }
    let junit = work.join("junit.xml");
    let log = work.join("log");
    let suite = dir().join("test_kiln_board.py");
    let extra = &args.pytest;
    println!(
        "labgrid: {} on {} ({}; console log {})",
        suite.display(),
        env.display(),
        vars.iter()
            .map(|(k, v)| format!("{k}={}", v.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(" "),
        log.display()
    );
    let sh = crate::paths::shell()?;
    let mut c = cmd!(
        sh,
        "{python} -m pytest -p no:cacheprovider -v --lg-env {env} --lg-log {log} --junitxml {junit} {suite} {extra...}"
    )
    .ignore_status();
    for (k, v) in &vars {
        c = c.env(k, v);
    }
    let out = c.run();
    // The farm's state before it is stopped: a piece that died during the run is named.
    let farm_note = farm.as_mut().map(|f| {
        let dead = f.dead();
        if dead.is_empty() {
            format!("farm: {}", f.logs())
        } else {
            format!("farm pieces died: {}; {}", dead.join("; "), f.logs())
        }
    });
    drop(farm);
    let mut outcome = read_junit(&junit).with_context(|| {
        format!(
            "labgrid's pytest left no readable results ({}){}",
            match &out {
                Ok(()) => "it exited".to_string(),
                Err(e) => format!("{e:#}"),
            },
            farm_note
                .as_ref()
                .map(|n| format!("; {n}"))
                .unwrap_or_default()
        )
    })?;
    outcome.farm = farm_note;
    Ok(outcome)
}

/// The tests of a JUnit XML file (pytest's `--junitxml`) by outcome.
pub fn read_junit(path: &Path) -> Result<Outcome> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_junit(&text).with_context(|| path.display().to_string())
}

fn parse_junit(text: &str) -> Result<Outcome> {
    let doc = roxmltree::Document::parse(text).context("not XML")?;
    let mut o = Outcome::default();
    for case in doc.descendants().filter(|n| n.has_tag_name("testcase")) {
        let name = case.attribute("name").unwrap_or("?").to_string();
        let has = |t: &str| case.children().any(|c| c.has_tag_name(t));
        if has("failure") || has("error") {
            o.failed.push(name);
        } else if has("skipped") {
            o.skipped.push(name);
        } else {
            o.passed.push(name);
        }
    }
    ensure!(
        !(o.passed.is_empty() && o.failed.is_empty() && o.skipped.is_empty()),
        "no test case in it"
    );
    Ok(o)
}

/// The `boot-qemu-ab` stage's part: the suite on the stage's image with its `v2.raucb`, every
/// test passed; then the rack's environment loaded by labgrid.
pub fn stage(image: &Path, bundle: &Path) -> Result<()> {
    let o = suite(&Args {
        env: None,
        image: Some(image.to_path_buf()),
        bundle: Some(bundle.to_path_buf()),
        remote: false,
        pytest: vec![],
    })?;
    ensure!(
        o.failed.is_empty() && o.skipped.is_empty(),
        "labgrid suite: failed {:?}, skipped {:?} (console log target/labgrid/log)",
        o.failed,
        o.skipped
    );
    let missing: Vec<&&str> = TESTS
        .iter()
        .filter(|t| !o.passed.iter().any(|p| p == **t))
        .collect();
    ensure!(
        missing.is_empty(),
        "labgrid suite: {missing:?} did not run (passed: {:?})",
        o.passed
    );
    println!(
        "labgrid: the suite passed on the QEMU board: {}",
        o.passed.join(", ")
    );
    remote_stage(image)?;
    check_rack_env()
}

/// The boot and report tests once more, through the QEMU board as a remote place (one boot).
fn remote_stage(image: &Path) -> Result<()> {
    let t = std::time::Instant::now();
    let o = suite(&Args {
        env: None,
        image: Some(image.to_path_buf()),
        bundle: None,
        remote: true,
        pytest: vec!["-k".into(), REMOTE_TESTS.join(" or ")],
    })?;
    let farm = o.farm.clone().unwrap_or_default();
    ensure!(
        o.failed.is_empty() && o.skipped.is_empty(),
        "labgrid --remote: failed {:?}, skipped {:?} (console log target/labgrid-remote/log; {farm})",
        o.failed,
        o.skipped
    );
    let mut ran = o.passed.clone();
    ran.sort();
    let mut want: Vec<String> = REMOTE_TESTS.iter().map(|t| t.to_string()).collect();
    want.sort();
    ensure!(
        ran == want,
        "labgrid --remote: passed {:?}, want exactly {REMOTE_TESTS:?}",
        o.passed
    );
    println!(
        "labgrid --remote: {} passed through the remote place in {:.0} s",
        o.passed.join(", "),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `rock-5b.yaml` through labgrid's own loader: every resource and driver a rack place needs.
pub fn check_rack_env() -> Result<()> {
    let python = crate::doctor::pinned_venv("labgrid-venv", PINS)?;
    let script = crate::paths::project_root().join("xtask/tests/labgrid_envs.py");
    let env = dir().join("rock-5b.yaml");
    let sh = crate::paths::shell()?;
    cmd!(sh, "{python} {script} {env}")
        .run()
        .context("the rack's labgrid environment (images/labgrid/rock-5b.yaml)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// labgrid's QEMUDriver runs the machine of qemu-virt's `[qemu]`: the same machine, CPU,
    /// memory, cores and NIC model as every other caller's command line.
    #[test]
    fn labgrid_runs_the_recipes_machine() {
        let m = crate::tools_root::machine::qemu_virt_machine().unwrap();
        for env in ["qemu-virt.yaml", "qemu-virt-remote.yaml"] {
            let path = dir().join(env);
            let y = std::fs::read_to_string(&path).unwrap();
            let field = |k: &str| {
                y.lines()
                    .find_map(|l| l.trim().strip_prefix(&format!("{k}: ")))
                    .map(|v| v.trim().to_string())
            };
            if env == "qemu-virt-remote.yaml" && field("machine").is_none() {
                // The remote environment's power is a command: it runs `boot_test::qemu_command`.
                continue;
            }
            assert_eq!(
                field("machine").as_deref(),
                Some(m.machine.as_str()),
                "{env}"
            );
            assert_eq!(field("cpu").as_deref(), Some(m.cpu.as_str()), "{env}");
            assert_eq!(
                field("memory"),
                Some(format!("{}G", m.memory_mib / 1024)),
                "{env}"
            );
            assert_eq!(field("nic"), Some(format!("user,model={}", m.nic)), "{env}");
            let extra = field("extra_args").unwrap_or_default();
            for want in [
                format!("-smp {}", m.smp),
                format!("-global {}.romfile=", m.nic),
            ] {
                assert!(extra.contains(&want), "{env}: extra_args lacks {want}");
            }
        }
    }

    #[test]
    fn junit_outcomes_are_read_per_test() {
        let x = r#"<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="t" name="a" time="1"/>
<testcase classname="t" name="b" time="1"><failure message="x">y</failure></testcase>
<testcase classname="t" name="c" time="0"><skipped message="no bundle"/></testcase>
<testcase classname="t" name="d" time="1"><error message="setup"/></testcase>
</testsuite></testsuites>"#;
        let o = parse_junit(x).unwrap();
        assert_eq!(o.passed, ["a"]);
        assert_eq!(o.failed, ["b", "d"]);
        assert_eq!(o.skipped, ["c"]);
        assert!(parse_junit("<testsuites/>").is_err());
        assert!(parse_junit("not xml").is_err());
    }

    #[test]
    fn the_pins_name_labgrid_and_nothing_twice() {
        let names: Vec<&str> = PINS
            .split_whitespace()
            .map(|p| p.split("==").next().unwrap_or(p))
            .collect();
        assert!(names.contains(&"labgrid"));
        let mut d = names.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), names.len());
        assert!(PINS.split_whitespace().all(|p| p.contains("==")));
    }
}
