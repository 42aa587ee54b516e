//! What a build as an ordinary user needs from the host (issue 41, `docs/rootless.md`, decisions
//! 2 and 3): user namespaces an unprivileged user may create, `newuidmap`/`newgidmap`, and a
//! range of 65 535 subordinate user and group ids. Each missing piece is named with what to
//! enable; the sysctls say why a namespace cannot be made, and only making one (with the
//! mapping) says that it can.
//!
//! The tools root decides with these how an ordinary user enters it, and refuses a user whose
//! host lacks one, naming it (`tools_root::enter::Entry::this`); `cargo xtask doctor` lists them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Subordinate ids a tools root needs mapped beside the user's own (uid 0 inside): Debian's
/// packages use ids up to 65 534 (`nobody`).
pub const SUBORDINATE: u64 = 65_535;

/// Where the host's facts are read (the real host: [`Host::this`]; tests: a folder).
pub struct Host {
    /// `/proc/sys`.
    pub sysctl: PathBuf,
    pub subuid: PathBuf,
    pub subgid: PathBuf,
    /// `PATH`, searched for `newuidmap`/`newgidmap`.
    pub path: Option<OsString>,
    pub user: String,
    pub uid: u32,
}

impl Host {
    pub fn this() -> Host {
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let user = passwd_name(Path::new("/etc/passwd"), uid)
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| uid.to_string());
        Host {
            sysctl: PathBuf::from("/proc/sys"),
            subuid: PathBuf::from("/etc/subuid"),
            subgid: PathBuf::from("/etc/subgid"),
            path: std::env::var_os("PATH"),
            user,
            uid,
        }
    }

    fn sysctl(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.sysctl.join(rel))
            .ok()
            .map(|s| s.trim().to_string())
    }
}

fn passwd_name(passwd: &Path, uid: u32) -> Option<String> {
    let text = std::fs::read_to_string(passwd).ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 2 && f[2] == uid.to_string()).then(|| f[0].to_string())
    })
}

/// One prerequisite: what, whether it holds, and the evidence or what to enable.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub what: &'static str,
    pub ok: bool,
    pub detail: String,
}

/// The first range of at least [`SUBORDINATE`] ids `user` (by name or uid) owns in a
/// `/etc/subuid`-style file: its start.
pub fn subordinate_start(text: &str, user: &str, uid: u32) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut f = l.trim().split(':');
        let (who, start, count) = (f.next()?, f.next()?, f.next()?);
        let (start, count) = (start.parse::<u64>().ok()?, count.parse::<u64>().ok()?);
        ((who == user || who == uid.to_string()) && count >= SUBORDINATE).then_some(start)
    })
}

fn on_path(path: Option<&OsString>, prog: &str) -> Option<PathBuf> {
    std::env::split_paths(path?)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// Every prerequisite but the live one, in the order the doctor shows them.
pub fn findings(h: &Host) -> Vec<Finding> {
    let mut out = Vec::new();
    let max = h.sysctl("user/max_user_namespaces");
    out.push(match max.as_deref() {
        Some("0") => Finding {
            what: "user namespaces",
            ok: false,
            detail: "off (user.max_user_namespaces = 0): enable them with `sudo sysctl -w \
                     user.max_user_namespaces=15000` (and a file in /etc/sysctl.d to keep it)"
                .into(),
        },
        Some(n) => Finding {
            what: "user namespaces",
            ok: true,
            detail: format!("user.max_user_namespaces = {n}"),
        },
        None => Finding {
            what: "user namespaces",
            ok: false,
            detail: format!(
                "{} is missing: a kernel without user namespaces (CONFIG_USER_NS) cannot build \
                 as an ordinary user",
                h.sysctl.join("user/max_user_namespaces").display()
            ),
        },
    });
    // Debian's and some hardened kernels' switch for unprivileged users (absent elsewhere).
    if let Some(v) = h.sysctl("kernel/unprivileged_userns_clone") {
        out.push(Finding {
            what: "unprivileged user namespaces",
            ok: v != "0",
            detail: if v == "0" {
                "off (kernel.unprivileged_userns_clone = 0): `sudo sysctl -w \
                 kernel.unprivileged_userns_clone=1`"
                    .into()
            } else {
                format!("kernel.unprivileged_userns_clone = {v}")
            },
        });
    }
    // Ubuntu 23.10 and later: AppArmor lets only profiled programs make them.
    if let Some(v) = h.sysctl("kernel/apparmor_restrict_unprivileged_userns") {
        out.push(Finding {
            what: "AppArmor and user namespaces",
            ok: v != "1",
            detail: if v == "1" {
                "restricted (kernel.apparmor_restrict_unprivileged_userns = 1, Ubuntu's \
                 default): `sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`, or an \
                 AppArmor profile that allows `userns,` for /usr/bin/unshare"
                    .into()
            } else {
                format!("kernel.apparmor_restrict_unprivileged_userns = {v}")
            },
        });
    }
    let maps: Vec<(&str, Option<PathBuf>)> = ["newuidmap", "newgidmap"]
        .into_iter()
        .map(|p| (p, on_path(h.path.as_ref(), p)))
        .collect();
    let missing: Vec<&str> = maps
        .iter()
        .filter(|(_, p)| p.is_none())
        .map(|(n, _)| *n)
        .collect();
    out.push(Finding {
        what: "newuidmap and newgidmap",
        ok: missing.is_empty(),
        detail: if missing.is_empty() {
            maps.iter()
                .filter_map(|(_, p)| p.as_ref().map(|p| p.display().to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            format!(
                "{} not on PATH: install `uidmap` (Debian, Ubuntu), `shadow-utils` (Fedora) or \
                 `shadow` (Arch)",
                missing.join(" and ")
            )
        },
    });
    for (what, file, flag) in [
        ("subordinate user ids", &h.subuid, "--add-subuids"),
        ("subordinate group ids", &h.subgid, "--add-subgids"),
    ] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        out.push(match subordinate_start(&text, &h.user, h.uid) {
            Some(s) => Finding {
                what,
                ok: true,
                detail: format!(
                    "{}: {s}-{} (1-{SUBORDINATE} in the namespace)",
                    file.display(),
                    s + SUBORDINATE - 1
                ),
            },
            None => Finding {
                what,
                ok: false,
                detail: format!(
                    "no range of {SUBORDINATE} ids for {} in {}: `sudo usermod {flag} \
                     100000-165535 {}`",
                    h.user,
                    file.display(),
                    h.user
                ),
            },
        });
    }
    out
}

/// Make a user namespace with the mapping a tools root needs (the user as 0, the subordinate
/// ranges as 1…65 535) and run `true` in it: `Ok` with the mapping, or why not (unshare's words).
pub fn live(h: &Host) -> Result<String, String> {
    let read = |f: &Path| std::fs::read_to_string(f).unwrap_or_default();
    let (Some(u), Some(g)) = (
        subordinate_start(&read(&h.subuid), &h.user, h.uid),
        subordinate_start(&read(&h.subgid), &h.user, h.uid),
    ) else {
        return Err(format!("no subordinate ids for {}", h.user));
    };
    let out = std::process::Command::new("unshare")
        .args([
            "--user",
            "--map-root-user",
            &format!("--map-users={u},1,{SUBORDINATE}"),
            &format!("--map-groups={g},1,{SUBORDINATE}"),
            "--",
            "cat",
            "/proc/self/uid_map",
        ])
        .output()
        .map_err(|e| format!("cannot run unshare (util-linux): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "unshare --user with {}'s subordinate ids failed: {}",
            h.user,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let map = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    Ok(format!("made one: uid_map {map}"))
}

/// The findings and, when they all hold, the live one: what the doctor prints and the tools
/// root's refusal names.
pub fn report(h: &Host) -> Vec<Finding> {
    let mut f = findings(h);
    if f.iter().all(|x| x.ok) {
        let r = live(h);
        f.push(Finding {
            what: "a user namespace with the mapping",
            ok: r.is_ok(),
            detail: r.unwrap_or_else(|e| e),
        });
    }
    f
}

/// One line per finding, for people.
pub fn lines(f: &[Finding]) -> Vec<String> {
    f.iter()
        .map(|x| {
            format!(
                "{:<34} {:<8} {}",
                x.what,
                if x.ok { "ok" } else { "MISSING" },
                x.detail
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host under a temporary folder: sysctls, subuid/subgid and a PATH folder as given.
    fn host(sysctls: &[(&str, &str)], subuid: &str, maps: bool) -> (tempfile::TempDir, Host) {
        let d = tempfile::tempdir().unwrap();
        for (k, v) in sysctls {
            let p = d.path().join("sys").join(k);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{v}\n")).unwrap();
        }
        std::fs::write(d.path().join("subuid"), subuid).unwrap();
        std::fs::write(d.path().join("subgid"), subuid).unwrap();
        let bin = d.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        if maps {
            std::fs::write(bin.join("newuidmap"), "").unwrap();
            std::fs::write(bin.join("newgidmap"), "").unwrap();
        }
        let h = Host {
            sysctl: d.path().join("sys"),
            subuid: d.path().join("subuid"),
            subgid: d.path().join("subgid"),
            path: Some(bin.into_os_string()),
            user: "builder".into(),
            uid: 1001,
        };
        (d, h)
    }

    fn missing(f: &[Finding]) -> Vec<String> {
        f.iter()
            .filter(|x| !x.ok)
            .map(|x| format!("{}: {}", x.what, x.detail))
            .collect()
    }

    #[test]
    fn a_ready_host_has_nothing_missing() {
        let (_d, h) = host(
            &[("user/max_user_namespaces", "96367")],
            "other:200000:65536\nbuilder:100000:65536\n",
            true,
        );
        let f = findings(&h);
        assert!(missing(&f).is_empty(), "{:?}", missing(&f));
        assert!(f.iter().any(|x| x
            .detail
            .ends_with("subuid: 100000-165534 (1-65535 in the namespace)")));
    }

    /// Each missing prerequisite is named with the way to enable it, and only it.
    #[test]
    fn each_missing_prerequisite_says_what_to_enable() {
        let ready = [("user/max_user_namespaces", "96367")];
        let sub = "builder:100000:65536\n";
        // (sysctls, subuid, newuidmap present, the one missing line expected)
        type Case<'a> = (Vec<(&'a str, &'a str)>, &'a str, bool, &'a str);
        let cases: Vec<Case> = vec![
            (
                vec![("user/max_user_namespaces", "0")],
                sub,
                true,
                "user namespaces: off (user.max_user_namespaces = 0): enable them with `sudo sysctl -w user.max_user_namespaces=15000`",
            ),
            (vec![], sub, true, "user namespaces: "),
            (
                vec![ready[0], ("kernel/unprivileged_userns_clone", "0")],
                sub,
                true,
                "unprivileged user namespaces: off (kernel.unprivileged_userns_clone = 0): `sudo sysctl -w kernel.unprivileged_userns_clone=1`",
            ),
            (
                vec![ready[0], ("kernel/apparmor_restrict_unprivileged_userns", "1")],
                sub,
                true,
                "AppArmor and user namespaces: restricted (kernel.apparmor_restrict_unprivileged_userns = 1, Ubuntu's default): `sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`",
            ),
            (
                ready.to_vec(),
                sub,
                false,
                "newuidmap and newgidmap: newuidmap and newgidmap not on PATH: install `uidmap` (Debian, Ubuntu)",
            ),
            (
                ready.to_vec(),
                "builder:100000:1000\nsomeone:100000:65536\n",
                true,
                "subordinate user ids: no range of 65535 ids for builder in",
            ),
        ];
        for (sysctls, subuid, maps, want) in cases {
            let (_d, h) = host(&sysctls, subuid, maps);
            let m = missing(&findings(&h));
            assert!(
                m.iter().any(|x| x.starts_with(want)),
                "want {want:?} in {m:#?}"
            );
            // One cause, one line (the group ids share the subuid file here).
            let expected = if want.starts_with("subordinate") {
                2
            } else {
                1
            };
            assert_eq!(m.len(), expected, "{m:#?}");
        }
        // The switches that are on say their values.
        let (_d, h) = host(
            &[
                ready[0],
                ("kernel/unprivileged_userns_clone", "1"),
                ("kernel/apparmor_restrict_unprivileged_userns", "0"),
            ],
            sub,
            true,
        );
        assert!(missing(&findings(&h)).is_empty());
    }

    #[test]
    fn subordinate_ranges_by_name_or_uid() {
        assert_eq!(
            subordinate_start("a:1:65536\n1001:300000:65536\n", "b", 1001),
            Some(300000)
        );
        assert_eq!(subordinate_start("b:1:65534\n", "b", 7), None);
        assert_eq!(subordinate_start("garbage\nb:x:y\n", "b", 7), None);
    }

    /// The live probe is the decision: a range that newuidmap will not map for this user is a
    /// failure in unshare's own words, never a success.
    #[test]
    fn the_live_probe_fails_on_a_range_the_user_does_not_own() {
        if on_path(std::env::var_os("PATH").as_ref(), "newuidmap").is_none() {
            eprintln!("skipped: no newuidmap on this host (uidmap)");
            return;
        }
        let (_d, mut h) = host(&[], "", true);
        // Ids 4000000000… are delegated to nobody in the real /etc/subuid.
        std::fs::write(&h.subuid, format!("{}:4000000000:65536\n", "builder")).unwrap();
        std::fs::write(&h.subgid, format!("{}:4000000000:65536\n", "builder")).unwrap();
        h.user = "builder".into();
        let e = live(&h).unwrap_err();
        assert!(
            e.starts_with("unshare --user with builder's subordinate ids failed: "),
            "{e}"
        );
    }
}
