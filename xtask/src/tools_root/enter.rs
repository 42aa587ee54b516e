//! How a command enters the tools root, as root or as an ordinary user (`docs/rootless.md`).
//!
//! - **Root**: `unshare --mount --fork`, then the bind mounts and `chroot` (as before users
//!   could build).
//! - **An ordinary user**: `unshare --user --map-root-user --map-users=S,1,65535
//!   --map-groups=G,1,65535 --mount --pid --fork --kill-child`. The user is uid 0 inside and its
//!   subordinate ids are 1…65 535 (util-linux maps them through the host's setuid
//!   `newuidmap`/`newgidmap`; kiln has no setuid helper of its own), so dpkg can give a file any
//!   owner a Debian package names, and the image's tools see the user's files as root's, exactly
//!   as under root. Its own PID namespace, because a user namespace may only mount a `proc` of a
//!   PID namespace it owns; `--kill-child`, so that nothing is left behind when the caller
//!   kills the command (a linker, a QEMU).
//!
//! Either way the same script runs inside the namespace: the binds (the checkout, `target/`,
//! what the caller adds) at their own paths, recursively, the host's `/dev/null`, `zero`, `full`, `random`,
//! `urandom` and `tty` onto the root's placeholders (a user cannot make device nodes; root
//! binds the same), `/proc`, then `chroot` with an empty environment plus what the caller
//! passes.

use crate::userns;
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// The device nodes a root needs: bound from the host at every entry onto placeholders that
/// [`super::make`] lays out.
pub const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// Who enters the root, and so how.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    Root,
    /// An ordinary user, with the first of its [`userns::SUBORDINATE`] subordinate user and
    /// group ids.
    User {
        subuid: u64,
        subgid: u64,
    },
}

impl Entry {
    /// This process's entry: root, or the user when the host has every prerequisite (the
    /// findings of [`userns::report`], a live namespace among them); otherwise refused, naming
    /// what the host lacks and what to enable. Decided once per process (every
    /// `tools_root::ensure` asks, and the decision makes a namespace).
    pub fn this() -> Result<Entry> {
        static FOUND: std::sync::OnceLock<Entry> = std::sync::OnceLock::new();
        if let Some(e) = FOUND.get() {
            return Ok(e.clone());
        }
        let e = Self::decide()?;
        Ok(FOUND.get_or_init(|| e).clone())
    }

    fn decide() -> Result<Entry> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            return Ok(Entry::Root);
        }
        let host = userns::Host::this();
        let f = userns::report(&host);
        if f.iter().any(|x| !x.ok) {
            bail!("{}", refusal(&f));
        }
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        match (
            userns::subordinate_start(&read(&host.subuid), &host.user, host.uid),
            userns::subordinate_start(&read(&host.subgid), &host.user, host.uid),
        ) {
            (Some(subuid), Some(subgid)) => Ok(Entry::User { subuid, subgid }),
            _ => bail!(
                "{}",
                refusal(&[userns::Finding {
                    what: "subordinate ids",
                    ok: false,
                    detail: format!("none for {} in /etc/subuid or /etc/subgid", host.user),
                }])
            ),
        }
    }

    /// `unshare` and its options, up to the command (without `--`).
    pub fn unshare(&self) -> Vec<String> {
        match self {
            Entry::Root => ["unshare", "--mount", "--fork"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            Entry::User { subuid, subgid } => vec![
                "unshare".into(),
                "--user".into(),
                "--map-root-user".into(),
                format!("--map-users={subuid},1,{}", userns::SUBORDINATE),
                format!("--map-groups={subgid},1,{}", userns::SUBORDINATE),
                "--mount".into(),
                "--pid".into(),
                "--fork".into(),
                "--kill-child".into(),
            ],
        }
    }

    /// A command in the namespace, not in any root: `argv` as the namespace's root (for the
    /// user: files with any of the mapped owners, e.g. removing a root dpkg made).
    pub fn command(&self, argv: &[&str]) -> std::process::Command {
        let mut u = self.unshare();
        u.push("--".into());
        u.extend(argv.iter().map(|s| s.to_string()));
        let mut c = std::process::Command::new(&u[0]);
        c.args(&u[1..]);
        c
    }

    /// The command that removes `dir` by hand: plain `rm -rf` for root; for a user, inside the
    /// namespace, where the subordinate ids dpkg gave files are the user's.
    pub fn removal(&self, dir: &Path) -> String {
        let rm = format!("rm -rf {}", quote(&dir.display().to_string()));
        match self {
            Entry::Root => rm,
            Entry::User { .. } => format!("{} -- {rm}", self.unshare().join(" ")),
        }
    }

    /// For the manifest and logs.
    pub fn describe(&self) -> String {
        match self {
            Entry::Root => "root (unshare --mount, chroot)".into(),
            Entry::User { subuid, subgid } => format!(
                "an ordinary user (a user namespace: the user as 0, subordinate ids {subuid}/{subgid} \
                 as 1…{})",
                userns::SUBORDINATE
            ),
        }
    }
}

/// Why this user cannot enter a root: what the host lacks (each with what to enable), one line.
pub fn refusal(f: &[userns::Finding]) -> String {
    let missing: Vec<String> = f
        .iter()
        .filter(|x| !x.ok)
        .map(|x| format!("{}: {}", x.what, x.detail))
        .collect();
    format!(
        "an ordinary user enters the tools root through a user namespace with its subordinate ids \
         (docs/rootless.md), and this host lacks: {} (`cargo xtask doctor` lists every \
         prerequisite; or build as root)",
        missing.join("; ")
    )
}

/// The mounts every entry makes, as `sh` lines: `binds` (outermost only) at their own paths
/// under `root`, the host's device nodes onto the root's placeholders, and `/proc`.
pub fn mounts(root: &Path, binds: &[PathBuf]) -> String {
    let mut binds: Vec<PathBuf> = binds.iter().filter(|b| b.is_dir()).cloned().collect();
    binds.sort();
    binds.dedup();
    let outer: Vec<&PathBuf> = binds
        .iter()
        .filter(|b| !binds.iter().any(|o| o != *b && b.starts_with(o)))
        .collect();
    let r = quote(&root.display().to_string());
    // `chroot` is in sbin, which an ordinary user's PATH may not name.
    let mut s = String::from("set -e\nPATH=\"/usr/sbin:/sbin:$PATH\"\n");
    // Recursive: a folder with a mount below it (a read-only bind of `~/.cargo/bin`, as the
    // fresh-machine stage makes) cannot be bound alone in a user namespace (EINVAL: its
    // submount is locked).
    for b in outer {
        let b = quote(&b.display().to_string());
        s.push_str(&format!("mkdir -p {r}{b}\nmount --rbind {b} {r}{b}\n"));
    }
    s.push_str(&format!(
        "for n in {}; do if [ -e {r}/dev/$n ] && [ -e /dev/$n ]; then mount --bind /dev/$n \
         {r}/dev/$n; fi; done\n",
        DEVICES.join(" ")
    ));
    s.push_str(&format!("mount -t proc proc {r}/proc\n"));
    s
}

/// `argv` run in the root at `root` through `entry`: [`mounts`] with `binds`, then `chroot` with
/// an empty environment but `PATH`, `HOME=/root` and `env`, in `cwd` (a path inside the root).
pub fn chroot_command(
    entry: &Entry,
    root: &Path,
    binds: &[PathBuf],
    cwd: &Path,
    env: &[(&str, String)],
    argv: &[String],
) -> std::process::Command {
    let mut script = mounts(root, binds);
    script.push_str(&format!(
        "exec chroot {} /usr/bin/env -i -C {} PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=/root",
        quote(&root.display().to_string()),
        quote(&cwd.display().to_string())
    ));
    for (k, v) in env {
        script.push(' ');
        script.push_str(&quote(&format!("{k}={v}")));
    }
    for a in argv {
        script.push(' ');
        script.push_str(&quote(a));
    }
    entry.command(&["sh", "-c", &script])
}

/// Single-quote for `sh`.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_is_mapped_with_its_subordinate_ids_and_its_own_pid_namespace() {
        let u = Entry::User {
            subuid: 100000,
            subgid: 200000,
        }
        .unshare();
        for want in [
            "--user",
            "--map-root-user",
            "--map-users=100000,1,65535",
            "--map-groups=200000,1,65535",
            "--pid",
            "--kill-child",
        ] {
            assert!(u.iter().any(|a| a == want), "{want}: {u:?}");
        }
        assert!(!Entry::Root.unshare().iter().any(|a| a == "--user"));
        let user = Entry::User {
            subuid: 100000,
            subgid: 200000,
        };
        assert!(
            user.removal(Path::new("/c/r"))
                .starts_with("unshare --user --map-root-user --map-users=100000,1,65535"),
            "{}",
            user.removal(Path::new("/c/r"))
        );
        assert_eq!(Entry::Root.removal(Path::new("/c/r")), "rm -rf '/c/r'");
    }

    #[test]
    fn mounts_bind_only_the_outermost_folders_and_the_devices() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        std::fs::create_dir_all(a.join("b")).unwrap();
        let s = mounts(
            Path::new("/r"),
            &[a.join("b"), a.clone(), d.path().join("missing")],
        );
        assert_eq!(s.matches("mount --rbind '").count(), 1, "{s}");
        assert!(
            s.contains(&format!("mount --rbind '{}' '/r'", a.display())),
            "{s}"
        );
        assert!(
            s.contains("for n in null zero full random urandom tty"),
            "{s}"
        );
        assert!(s.ends_with("mount -t proc proc '/r'/proc\n"), "{s}");
    }

    #[test]
    fn a_user_the_host_cannot_map_is_refused_with_what_to_enable() {
        let f = |ok, what| userns::Finding {
            what,
            ok,
            detail: format!("{what} detail"),
        };
        let m = refusal(&[
            f(true, "user namespaces"),
            f(false, "newuidmap and newgidmap"),
        ]);
        assert!(
            m.contains("this host lacks: newuidmap and newgidmap: newuidmap and newgidmap detail"),
            "{m}"
        );
        assert!(!m.contains("user namespaces:"), "{m}");
    }
}
