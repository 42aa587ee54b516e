//! What the slot tests share: finding the reference tools (skipping loudly when one is missing,
//! failing when `KILN_REQUIRE_TOOLS=1`), a `fw_env.config` naming a file, and running `kiln slot`.

#![allow(dead_code)] // each test file uses its own part

use kiln_runtime::slot::env::Env;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `name` on PATH, or `None` after a loud SKIPPED line: a missing reference tool skips the test
/// unless `KILN_REQUIRE_TOOLS=1`, which makes it a failure.
/// Under qemu-user (the aarch64 stages, `KILN_UNDER_QEMU_USER`) these tests would spawn the
/// aarch64 `kiln` with no runner, beside the host's x86 references: they are host tests, run by
/// `host-tests`. True (after a SKIPPED line) when the test must return.
pub fn under_qemu_user(test: &str) -> bool {
    if std::env::var_os("KILN_UNDER_QEMU_USER").is_none() {
        return false;
    }
    let line = format!(
        "\n******** SKIPPED {test}: under qemu-user; the slot interop tests run in host-tests ********\n"
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
    true
}

pub fn tool(name: &str, package: &str, test: &str) -> Option<PathBuf> {
    if under_qemu_user(test) {
        return None;
    }
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        let why = format!("{name} is not on PATH (apt-get install {package})");
        if std::env::var("KILN_REQUIRE_TOOLS").as_deref() == Ok("1") {
            panic!("{test}: {why}, and KILN_REQUIRE_TOOLS=1");
        }
        // Straight to fd 2: the test harness captures eprintln! of a passing test.
        let line = format!(
            "\n******** SKIPPED {test}: {why}; KILN_REQUIRE_TOOLS=1 makes this a failure ********\n"
        );
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    found
}

/// Return from the test (after [`tool`]'s SKIPPED line) unless every `(tool, package)` is there.
#[macro_export]
macro_rules! require_tools {
    ($test:expr, $(($name:expr, $pkg:expr)),+ $(,)?) => {{
        let mut all = true;
        $( all &= slot_common::tool($name, $pkg, $test).is_some(); )+
        if !all {
            return;
        }
    }};
}

/// A `fw_env.config` beside `env` naming it as a non-redundant environment at offset 0, size
/// 0x4000 (libubootenv's `dev offset size`).
pub fn fw_env_config(env: &Path) -> PathBuf {
    let cfg = env.with_file_name("fw_env.config");
    std::fs::write(&cfg, format!("{} 0x0 0x4000\n", env.display())).unwrap();
    cfg
}

/// Run `cmd`, panicking with its stderr if it fails.
pub fn ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}\n(libubootenv's fw_* lock /var/lock/fw_printenv.lock: \
         /var/lock must exist)",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `fw_printenv -c cfg`: every variable.
pub fn fw_printenv(cfg: &Path) -> BTreeMap<String, String> {
    let out = ok(Command::new("fw_printenv").arg("-c").arg(cfg));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("{l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// `fw_setenv -c cfg k v`.
pub fn fw_setenv(cfg: &Path, k: &str, v: &str) {
    ok(Command::new("fw_setenv").arg("-c").arg(cfg).args([k, v]));
}

/// Our decoding of the file at `p`.
pub fn decode(p: &Path) -> Env {
    Env::decode(&std::fs::read(p).unwrap(), &p.display().to_string())
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// `kiln slot ARGS --env env` (and `--cmdline`), its output whatever its status.
pub fn kiln_slot(env: &Path, cmdline: Option<&Path>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.arg("slot").args(args).arg("--env").arg(env);
    if let Some(cl) = cmdline {
        c.arg("--cmdline").arg(cl);
    }
    c.output().unwrap()
}

/// `kiln slot status --json` parsed.
pub fn kiln_status(env: &Path, cmdline: Option<&Path>) -> serde_json::Value {
    let out = kiln_slot(env, cmdline, &["status", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
