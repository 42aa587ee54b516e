//! Pins do not depend on the host's apt configuration: with an empty host sources list (and
//! empty host package lists), in a private mount namespace, `cargo xtask pins check` still
//! resolves every pin of qemu-virt from Debian's archive into an empty download cache. The mount
//! namespace is root's own, or a user's inside a user namespace of its own (where the user is
//! root over its mounts, as kiln's builds are); it needs the network to Debian's archive: run by
//! `cargo xtask test --stage pins-archive`.

use std::process::Command;

#[test]
#[ignore = "Debian's archive: cargo xtask test --stage pins-archive"]
fn empty_host_sources_list_still_resolves_the_pins() {
    // SAFETY: geteuid has no preconditions.
    let namespaces: &[&str] = if unsafe { libc::geteuid() } == 0 {
        &["--mount", "--fork"]
    } else {
        // apt drops to its `_apt` user for downloads: the subordinate ids map it.
        &[
            "--user",
            "--map-root-user",
            "--map-auto",
            "--mount",
            "--fork",
        ]
    };
    let tmp = tempfile::tempdir().unwrap();
    let empty_file = tmp.path().join("empty.list");
    std::fs::write(&empty_file, "").unwrap();
    let empty_dir = tmp.path().join("empty.d");
    std::fs::create_dir(&empty_dir).unwrap();
    let xtask = env!("CARGO_BIN_EXE_xtask");
    let (f, d) = (empty_file.display(), empty_dir.display());
    // Everything the host's apt would resolve from is emptied: sources, lists, archives cache.
    let script = format!(
        "set -e\n\
         mount --make-rprivate /\n\
         [ -e /etc/apt/sources.list ] && mount --bind '{f}' /etc/apt/sources.list\n\
         mount --bind '{d}' /etc/apt/sources.list.d\n\
         mount --bind '{d}' /var/lib/apt/lists\n\
         test -z \"$(cat /etc/apt/sources.list 2>/dev/null)\" && test -z \"$(ls /etc/apt/sources.list.d)\"\n\
         apt-cache policy libc6:arm64 | grep -q 'Candidate: (none)' || ! apt-cache policy libc6:arm64 | grep -q Candidate\n\
         exec '{xtask}' pins check --board qemu-virt\n"
    );
    let out = Command::new("unshare")
        .args(namespaces)
        .args(["sh", "-c", &script])
        .env("KILN_NO_INSTALL", "1")
        .env("CARGO_TARGET_DIR", tmp.path().join("target"))
        .env("XDG_CACHE_HOME", tmp.path().join("cache"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "pins check failed:\n{text}");
    assert!(
        text.contains("refreshing kiln's package lists"),
        "the private lists were made: {text}"
    );
    for name in [
        "linux-source-6.1",
        "busybox-static",
        "libc6",
        "libgcc-s1",
        "libstdc++6",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("ok") && l.contains(name)),
            "{name} resolved: {text}"
        );
    }
    assert!(text.contains("pins: every input of qemu-virt resolves and verifies"));
}
