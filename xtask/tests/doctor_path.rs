//! Every command that needs host tools resolves them through the doctor before it does anything:
//! run with one of its tools removed from PATH (and `KILN_NO_INSTALL=1`, so the doctor may not
//! install), it stops at once with one line naming the tool, its Debian package and the command
//! to run, and no Rust backtrace even with `RUST_BACKTRACE=1`. (The installing path is what the
//! `fresh-machine` stage exercises, from an empty root.)

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A folder of symlinks to every program on this PATH except `without`.
fn path_without(dir: &Path, without: &[&str]) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let mut seen: HashSet<String> = without.iter().map(|s| s.to_string()).collect();
    let path = std::env::var_os("PATH").unwrap_or_default();
    for d in std::env::split_paths(&path) {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if seen.insert(name.clone()) {
                std::os::unix::fs::symlink(e.path(), bin.join(&name)).unwrap();
            }
        }
    }
    bin
}

fn run_without(args: &[&str], without: &[&str]) -> Output {
    let tmp = tempfile::tempdir().unwrap();
    let bin = path_without(tmp.path(), without);
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .env("PATH", &bin)
        .env("KILN_NO_INSTALL", "1")
        .env("RUST_BACKTRACE", "1")
        // Nothing may be built or fetched before the tools are resolved.
        .env("CARGO_TARGET_DIR", tmp.path().join("target"))
        .env("XDG_CACHE_HOME", tmp.path().join("cache"))
        .output()
        .expect("xtask runs");
    eprintln!(
        "$ xtask {} (without {without:?})\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The command stops with one line naming the tool, the package and the install command.
fn stops_with_remedy(args: &[&str], tool: &str, package: &str) {
    let out = run_without(args, &[tool]);
    assert!(!out.status.success(), "xtask {args:?} ran without {tool}");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line, got:\n{err}");
    let l = lines[0];
    assert!(l.starts_with("error: "), "{l}");
    assert!(l.contains(&format!("cargo xtask {}", args[0])), "{l}");
    assert!(l.contains(tool), "names the tool: {l}");
    assert!(l.contains(package), "names the package: {l}");
    assert!(
        l.contains("apt-get install -y --no-install-recommends"),
        "names the command: {l}"
    );
    assert!(
        !err.contains("backtrace") && !err.contains("Caused by"),
        "{err}"
    );
    assert!(!l.contains("not runnable"), "{l}");
}

#[test]
fn image_without_git() {
    stops_with_remedy(&["image"], "git", "git");
}

/// What the image and a boot no longer take from the host: the tools root makes the kernel,
/// links `kiln` and runs QEMU and U-Boot, kiln makes the root without debootstrap, fetches
/// without apt and writes U-Boot's environment itself. Without all of them, `image` and
/// `boot-test` still get past the doctor and stop on their own input (a board, an image that
/// does not exist), naming no tool.
#[test]
fn image_and_boot_test_without_the_tools_the_tools_root_brings() {
    let gone = [
        "aarch64-linux-gnu-gcc",
        "debootstrap",
        "apt-get",
        "dpkg",
        "qemu-system-aarch64",
        "mkenvimage",
        "mkimage",
    ];
    for (args, own) in [
        (
            &["image", "--board", "no-such-board"][..],
            "no board \"no-such-board\"",
        ),
        (
            &["boot-test", "--no-build", "--image", "/nonexistent.img"][..],
            "/nonexistent.img does not exist",
        ),
    ] {
        let out = run_without(args, &gone);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(!err.contains("cannot start"), "{args:?}: {err}");
        assert!(err.contains(own), "{args:?} stops on its own input: {err}");
    }
}

#[test]
fn build_without_the_cross_compiler() {
    stops_with_remedy(&["build"], "aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu");
}

#[test]
fn test_stage_without_qemu_user() {
    stops_with_remedy(
        &["test", "--stage", "aarch64-tests-cortex-a72"],
        "qemu-aarch64-static",
        "qemu-user-static",
    );
}

#[test]
fn flash_without_lsblk() {
    stops_with_remedy(
        &["flash", "--image", "/nonexistent.img"],
        "lsblk",
        "util-linux",
    );
}

#[test]
fn bench_flash_without_losetup() {
    stops_with_remedy(&["bench", "flash"], "losetup", "mount");
}

#[test]
fn pins_without_apt_get() {
    stops_with_remedy(&["pins", "check", "--offline"], "apt-get", "apt");
}

/// The control: with the tool present the same command gets past the doctor (it fails later on
/// its own input, which names no tool).
#[test]
fn with_every_tool_the_commands_get_past_the_doctor() {
    let out = run_without(&["flash", "--image", "/nonexistent.img", "--dry-run"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("cannot start"), "{err}");
    let out = run_without(&["pins", "check", "--offline"], &[]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("cannot start"), "{all}");
    assert!(all.contains("--offline forbids fetching it"), "{all}");
    // `report` needs no host tool at all: with an empty PATH it reaches its own error.
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["report", "/nonexistent.img"])
        .env("PATH", tmp.path())
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("/nonexistent.img") && !err.contains("cannot start"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// Another rustc than `rust-toolchain.toml` pins (a distribution's, or `cargo +toolchain`) would
/// build another `kiln` and so another image: the cross build refuses it in one line that names
/// the pinned release and the rustup command.
#[test]
fn build_with_another_rustc_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fake = tmp.path().join("fake");
    std::fs::create_dir_all(&fake).unwrap();
    let rustc = fake.join("rustc");
    std::fs::write(
        &rustc,
        "#!/bin/sh\ncase \"$1\" in --version) echo 'rustc 1.80.0 (051478957 2024-07-21)';; \
         *) echo /nonexistent;; esac\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&rustc, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = std::env::join_paths(std::iter::once(fake.clone()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .arg("build")
        .env("PATH", &path)
        .env("KILN_NO_INSTALL", "1")
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env("CARGO_TARGET_DIR", tmp.path().join("target"))
        .env("XDG_CACHE_HOME", tmp.path().join("cache"))
        .output()
        .expect("xtask runs");
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("{}{err}", String::from_utf8_lossy(&out.stdout));
    assert!(!out.status.success(), "built with rustc 1.80.0");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line, got:\n{err}");
    let pinned = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../rust-toolchain.toml"
    ))
    .unwrap()
    .lines()
    .find_map(|l| {
        l.strip_prefix("channel = \"")
            .map(|r| r.trim_end_matches('"').to_string())
    })
    .expect("rust-toolchain.toml names a channel");
    assert!(
        lines[0].contains("rustc 1.80.0"),
        "names the rustc found: {}",
        lines[0]
    );
    assert!(
        lines[0].contains(&format!("pinned Rust {pinned}")),
        "names the pin: {}",
        lines[0]
    );
    assert!(
        lines[0].contains(&format!("rustup toolchain install {pinned}")),
        "names the command: {}",
        lines[0]
    );
}
