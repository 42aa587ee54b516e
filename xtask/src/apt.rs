//! kiln's private apt configuration. Pinned Debian packages are resolved through their own sources
//! list (the pinned suites, signed by Debian's archive keyring), their own package lists, cache
//! and dpkg status under `target/kiln/apt/`, every setting passed as `-o` so that it wins over the
//! host's `apt.conf.d`. The host's sources, lists, pinning and architectures are never consulted,
//! so the same pins resolve on a Debian host with any sources, on Ubuntu, or with an empty
//! sources list; the host's apt is only used to install host tools (`doctor`).

use anyhow::{bail, Context, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;
use xshell::cmd;

/// The pinned suites: Debian 12 and its security suite (where kernel updates are served).
pub const ARCHIVES: &[Archive] = &[
    Archive {
        name: "debian",
        url: "http://deb.debian.org/debian",
        suite: "bookworm",
    },
    Archive {
        name: "debian-security",
        url: "http://deb.debian.org/debian-security",
        suite: "bookworm-security",
    },
];

/// One Debian archive: its name on snapshot.debian.org, the live mirror and the pinned suite.
pub struct Archive {
    pub name: &'static str,
    pub url: &'static str,
    pub suite: &'static str,
}

/// Architectures the private lists carry: the root filesystem's arm64 packages and the tools
/// root's amd64 ones (`all` comes with every arch's index).
const ARCHS: &str = "arm64,amd64";

/// Lists refreshed in this process (per configuration folder): at most one refresh per run.
static REFRESHED: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);

/// Held while the lists are checked or refreshed: concurrent fetches run one `apt-get update`,
/// never two over the same folder.
static LISTS: Mutex<()> = Mutex::new(());

/// A private apt configuration rooted at `dir`.
pub struct Apt {
    pub dir: PathBuf,
}

/// What `apt-get download` did.
pub enum Download {
    Got(PathBuf),
    /// The lists do not know this version (apt's message kept).
    NotFound(String),
}

impl Apt {
    /// `target/kiln/apt`.
    pub fn kiln() -> Apt {
        Apt::at(crate::paths::target_dir().join("kiln/apt"))
    }

    pub fn at(dir: PathBuf) -> Apt {
        Apt { dir }
    }

    fn lists(&self) -> PathBuf {
        self.dir.join("lists")
    }

    fn stamp(&self) -> PathBuf {
        self.dir.join("lists-updated")
    }

    /// The configuration as apt options; each overrides the host's.
    pub fn options(&self) -> Vec<String> {
        let d = self.dir.display();
        [
            format!("Dir::Etc::SourceList={d}/sources.list"),
            format!("Dir::Etc::SourceParts={d}/empty.d"),
            format!("Dir::Etc::Preferences={d}/preferences"),
            format!("Dir::Etc::PreferencesParts={d}/empty.d"),
            format!("Dir::Etc::Trusted={d}/trusted.gpg"),
            format!("Dir::Etc::TrustedParts={d}/empty.d"),
            format!("Dir::State={d}/state"),
            format!("Dir::State::Lists={d}/lists"),
            format!("Dir::State::status={d}/status"),
            format!("Dir::Cache={d}/cache"),
            // Keep the binary package cache between runs, whatever the host says: Debian's
            // container images set both to "" (`/etc/apt/apt.conf.d/docker-clean`), and then
            // every `apt-get download` re-parses all the lists (1.5 s of CPU here, against 0.4 s).
            "Dir::Cache::pkgcache=pkgcache.bin".into(),
            "Dir::Cache::srcpkgcache=srcpkgcache.bin".into(),
            format!("APT::Architectures={ARCHS}"),
            "APT::Default-Release=".into(),
            "Acquire::Languages=none".into(),
            // Only the Packages indexes: no AppStream or Contents files a host's apt.conf.d asks for.
            "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons-hidpi::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::Contents-udeb::DefaultEnabled=false".into(),
            "APT::Get::List-Cleanup=true".into(),
        ]
        .into_iter()
        .flat_map(|o| ["-o".to_string(), o])
        .collect()
    }

    /// Write the sources list and make the folders (idempotent).
    pub fn setup(&self) -> Result<()> {
        let d = &self.dir;
        for sub in [
            "empty.d",
            "state",
            "lists/partial",
            "cache/archives/partial",
        ] {
            std::fs::create_dir_all(d.join(sub))
                .with_context(|| format!("creating {}", d.join(sub).display()))?;
        }
        let key = crate::doctor::DEBIAN_KEYRING_PATH;
        let sources: String = ARCHIVES
            .iter()
            .map(|a| {
                format!(
                    "deb [arch={ARCHS} signed-by={key}] {} {} main\n",
                    a.url, a.suite
                )
            })
            .collect();
        if std::fs::read_to_string(d.join("sources.list"))
            .ok()
            .as_deref()
            != Some(&sources)
        {
            crate::atomic::write_atomic(&d.join("sources.list"), sources.as_bytes())?;
        }
        if !d.join("status").exists() {
            crate::atomic::write_atomic(&d.join("status"), b"")?;
        }
        Ok(())
    }

    /// Are there package lists at all?
    fn have_lists(&self) -> bool {
        std::fs::read_dir(self.lists())
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .any(|e| e.file_name().to_string_lossy().contains("_Packages"))
            })
            .unwrap_or(false)
    }

    /// Are the lists present and newer than every file in `pins` (the pins files they serve)?
    pub fn lists_fresh(&self, pins: &[&Path]) -> bool {
        let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let Some(stamp) = mtime(&self.stamp()) else {
            return false;
        };
        self.have_lists()
            && pins
                .iter()
                .all(|p| mtime(p).is_none_or(|t: SystemTime| t <= stamp))
    }

    pub fn refreshed_this_run(&self) -> bool {
        REFRESHED
            .lock()
            .map(|g| g.as_ref().is_some_and(|s| s.contains(&self.dir)))
            .unwrap_or(false)
    }

    /// `apt-get update` over the private configuration; the caller holds [`LISTS`].
    fn update_held(&self, why: &str) -> Result<()> {
        self.setup()?;
        println!(
            "pins: refreshing kiln's package lists ({why}): apt-get update over {} ({})",
            self.dir.display(),
            ARCHIVES
                .iter()
                .map(|a| a.suite)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        cmd!(sh, "apt-get {opts...} -q update")
            .run()
            .with_context(|| {
                format!(
                    "refreshing kiln's package lists from {} failed: is the Debian archive \
                     reachable? (`--offline` builds from the download cache alone)",
                    ARCHIVES
                        .iter()
                        .map(|a| a.url)
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            })?;
        crate::atomic::write_atomic(&self.stamp(), b"")?;
        if let Ok(mut g) = REFRESHED.lock() {
            g.get_or_insert_with(HashSet::new).insert(self.dir.clone());
        }
        Ok(())
    }

    /// Refresh the lists unless they are present and newer than `pins` (at most once per run).
    pub fn ensure_lists(&self, pins: &[&Path]) -> Result<()> {
        let _held = LISTS.lock().unwrap_or_else(|e| e.into_inner());
        self.setup()?;
        let have = self.have_lists();
        if self.lists_fresh(pins) || (have && self.refreshed_this_run()) {
            return Ok(());
        }
        let why = if !have {
            "none yet"
        } else {
            "older than the pins"
        };
        self.update_held(why)
    }

    /// Refresh the lists unless this run already did (another fetch may have, meanwhile).
    pub fn refresh_once(&self, why: &str) -> Result<()> {
        let _held = LISTS.lock().unwrap_or_else(|e| e.into_inner());
        if self.refreshed_this_run() {
            return Ok(());
        }
        self.update_held(why)
    }

    /// `apt-get download spec` into `dir` (made writable for apt's `_apt` user).
    pub fn download(&self, spec: &str, dir: &Path) -> Result<Download> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
        let sh = xshell::Shell::new()?;
        sh.change_dir(dir);
        let opts = self.options();
        let out = cmd!(sh, "apt-get {opts...} -q download {spec}")
            .quiet()
            .ignore_status()
            .output()
            .with_context(|| format!("running apt-get download {spec}"))?;
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if !out.status.success() {
            if err.contains("was not found")
                || err.contains("Unable to locate package")
                || err.contains("Can't select")
            {
                return Ok(Download::NotFound(err));
            }
            bail!("`apt-get download {spec}` failed: {err}");
        }
        let deb = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .with_context(|| format!("apt-get download {spec} produced no .deb"))?;
        Ok(Download::Got(deb))
    }

    /// The versions of `package:arch` the lists offer now, newest first (`apt-cache madison`).
    pub fn versions(&self, package: &str, arch: &str) -> Result<Vec<String>> {
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        let spec = format!("{package}:{arch}");
        let out = cmd!(sh, "apt-cache {opts...} madison {spec}")
            .quiet()
            .ignore_status()
            .read()?;
        Ok(out
            .lines()
            .filter_map(|l| l.split('|').nth(1).map(|v| v.trim().to_string()))
            .collect())
    }

    /// What the archive serves now for `package:arch` (the candidate).
    pub fn candidate(&self, package: &str, arch: &str) -> Result<String> {
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        let spec = format!("{package}:{arch}");
        let out = cmd!(sh, "apt-cache {opts...} policy {spec}")
            .quiet()
            .read()?;
        out.lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("Candidate:")
                    .map(|v| v.trim().to_string())
            })
            .filter(|v| v != "(none)")
            .with_context(|| {
                format!("apt-cache policy {spec}: Debian's archive offers no candidate")
            })
    }

    /// Where the live archive serves `spec`: (archive name, path under it, e.g.
    /// `pool/main/b/busybox/busybox-static_1.35.0-4+deb12u1+b1_arm64.deb`).
    pub fn pool_path(&self, spec: &str) -> Result<(String, String)> {
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        let out = cmd!(sh, "apt-get {opts...} download --print-uris {spec}")
            .quiet()
            .read()
            .with_context(|| format!("apt-get download --print-uris {spec}"))?;
        let url = out
            .split_whitespace()
            .next()
            .map(|u| u.trim_matches('\''))
            .with_context(|| format!("apt-get --print-uris {spec} printed nothing"))?;
        for a in ARCHIVES {
            if let Some(rest) = url.strip_prefix(&format!("{}/", a.url)) {
                return Ok((a.name.to_string(), percent_decode(rest)?));
            }
        }
        bail!("{spec} is served from {url}, outside kiln's archives")
    }

    /// A snapshot timestamp (`YYYYMMDDTHHMMSSZ`) for the state of the archive the pins were
    /// resolved in: the `Date:` of its Release file in the lists plus 6 hours. snapshot.debian.org
    /// serves its latest import at or before a timestamp, and imports follow the archive's updates
    /// by up to that long, so the Date alone could name the import before this state.
    pub fn release_timestamp(&self, archive: &str) -> Result<String> {
        let a = ARCHIVES
            .iter()
            .find(|a| a.name == archive)
            .with_context(|| format!("unknown archive {archive}"))?;
        let host_path = a
            .url
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .replace('/', "_");
        let f = self
            .lists()
            .join(format!("{host_path}_dists_{}_InRelease", a.suite));
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
        let date = text
            .lines()
            .find_map(|l| l.strip_prefix("Date:"))
            .with_context(|| format!("{} has no Date:", f.display()))?;
        rfc2822_to_snapshot(date.trim(), 6 * 3600)
    }

    /// What `apt-get install` of `specs` would install on an empty system, in apt's order:
    /// `(package, version, arch)` of every `Inst` line of a simulation (the status is empty).
    pub fn simulate_install(&self, specs: &[String]) -> Result<Vec<(String, String, String)>> {
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        let out = cmd!(
            sh,
            "apt-get {opts...} -s -q --no-install-recommends install {specs...}"
        )
        .quiet()
        .read()
        .context("apt-get -s install over kiln's lists")?;
        let mut got = Vec::new();
        for l in out.lines() {
            let Some(rest) = l.strip_prefix("Inst ") else {
                continue;
            };
            let (name, rest) = rest
                .split_once(" (")
                .with_context(|| format!("unexpected apt line {l:?}"))?;
            let version = rest
                .split_whitespace()
                .next()
                .with_context(|| format!("no version in apt line {l:?}"))?;
            let arch = rest
                .rsplit_once('[')
                .and_then(|(_, a)| a.split(']').next())
                .with_context(|| format!("no arch in apt line {l:?}"))?;
            let name = name.split(':').next().unwrap_or(name);
            got.push((name.to_string(), version.to_string(), arch.to_string()));
        }
        Ok(got)
    }

    /// The package names of `arch`'s Packages indexes in the lists whose stanza says
    /// `Priority: required` or `Essential: yes` (what a minimal Debian root holds).
    pub fn required_packages(&self, arch: &str) -> Result<Vec<String>> {
        let mut out = std::collections::BTreeSet::new();
        let suffix = format!("_binary-{arch}_Packages");
        for e in std::fs::read_dir(self.lists())? {
            let p = e?.path();
            if !p.to_string_lossy().contains(&suffix) {
                continue;
            }
            // The host's apt.conf may keep lists compressed (lz4, gz): apt reads them for us.
            let sh = xshell::Shell::new()?;
            let text = cmd!(sh, "/usr/lib/apt/apt-helper cat-file {p}")
                .quiet()
                .read()
                .with_context(|| format!("reading {}", p.display()))?;
            for stanza in text.split("\n\n") {
                let mut name = None;
                let mut wanted = false;
                for l in stanza.lines() {
                    if let Some(n) = l.strip_prefix("Package: ") {
                        name = Some(n.trim());
                    } else if l == "Priority: required" || l == "Essential: yes" {
                        wanted = true;
                    }
                }
                if let (Some(n), true) = (name, wanted) {
                    out.insert(n.to_string());
                }
            }
        }
        if out.is_empty() {
            bail!("no {arch} Packages index in {}", self.lists().display());
        }
        Ok(out.into_iter().collect())
    }

    /// `apt-get download` of many specs at once into `dir`.
    pub fn download_all(&self, specs: &[String], dir: &Path) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
        let sh = xshell::Shell::new()?;
        sh.change_dir(dir);
        let opts = self.options();
        cmd!(sh, "apt-get {opts...} -q download {specs...}")
            .run()
            .with_context(|| format!("apt-get download of {} packages", specs.len()))
    }

    /// Where the live archive serves each spec: `(archive, pool path, file name)`, in order.
    pub fn pool_paths(&self, specs: &[String]) -> Result<Vec<(String, String, String)>> {
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        let out = cmd!(sh, "apt-get {opts...} download --print-uris {specs...}")
            .quiet()
            .read()
            .context("apt-get download --print-uris")?;
        let mut got = Vec::new();
        for l in out.lines() {
            let mut w = l.split_whitespace();
            let (Some(url), Some(file)) = (w.next(), w.next()) else {
                continue;
            };
            let url = url.trim_matches('\'');
            let a = ARCHIVES
                .iter()
                .find(|a| url.starts_with(&format!("{}/", a.url)))
                .with_context(|| format!("{url} is outside kiln's archives"))?;
            let rest = &url[a.url.len() + 1..];
            got.push((a.name.to_string(), percent_decode(rest)?, file.to_string()));
        }
        Ok(got)
    }

    /// Fetch one URL to `dest` with apt's own transport (`apt-helper download-file`).
    pub fn fetch_url(&self, url: &str, dest: &Path) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = dest
            .parent()
            .with_context(|| format!("{} has no folder", dest.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
        let sh = xshell::Shell::new()?;
        let opts = self.options();
        let out = cmd!(
            sh,
            "/usr/lib/apt/apt-helper {opts...} -o Acquire::Retries=0 download-file {url} {dest}"
        )
        .quiet()
        .ignore_status()
        .output()
        .with_context(|| format!("running apt-helper download-file {url}"))?;
        if !out.status.success() || !dest.exists() {
            let err = String::from_utf8_lossy(&out.stderr);
            let err = err
                .lines()
                .filter(|l| !l.trim().is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            bail!("fetching {url} failed: {err}");
        }
        Ok(())
    }
}

/// `%2b` → `+` (apt prints URIs percent-encoded; the pins keep the plain path).
pub fn percent_decode(s: &str) -> Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let h = std::str::from_utf8(&b[i + 1..i + 3])?;
            out.push(u8::from_str_radix(h, 16).with_context(|| format!("bad escape in {s}"))?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(String::from_utf8(out)?)
}

/// `Sat, 28 Nov 2026 09:14:03 UTC` plus `add` seconds → `20261128T091403Z` (+ add).
pub fn rfc2822_to_snapshot(date: &str, add: i64) -> Result<String> {
    let w: Vec<&str> = date.split_whitespace().collect();
    let bad = || format!("not an RFC 2822 UTC date: {date:?}");
    anyhow::ensure!(
        w.len() == 6 && (w[5] == "UTC" || w[5] == "+0000"),
        "{}",
        bad()
    );
    let day: u32 = w[1].parse().with_context(bad)?;
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = months.iter().position(|m| *m == w[2]).with_context(bad)? + 1;
    let year: u32 = w[3].parse().with_context(bad)?;
    let t: Vec<u32> = w[4]
        .split(':')
        .map(|x| x.parse())
        .collect::<std::result::Result<_, _>>()
        .with_context(bad)?;
    anyhow::ensure!(t.len() == 3, "{}", bad());
    let secs = crate::civil::days_from_civil(year as i64, month as i64, day as i64) * 86400
        + (t[0] * 3600 + t[1] * 60 + t[2]) as i64
        + add;
    let (y, m, d) = crate::civil::civil_from_days(secs.div_euclid(86400));
    let s = secs.rem_euclid(86400);
    Ok(format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn release_date_becomes_a_snapshot_timestamp() {
        assert_eq!(
            super::rfc2822_to_snapshot("Sun, 08 Nov 2026 09:14:03 UTC", 0).unwrap(),
            "20261108T091403Z"
        );
        // Across a month and a leap day.
        assert_eq!(
            super::rfc2822_to_snapshot("Thu, 29 Feb 2024 20:00:00 UTC", 6 * 3600).unwrap(),
            "20240301T020000Z"
        );
        assert!(super::rfc2822_to_snapshot("yesterday", 0).is_err());
        assert_eq!(
            super::percent_decode(
                "pool/main/b/busybox/busybox-static_1.35.0-4%2bdeb12u1_arm64.deb"
            )
            .unwrap(),
            "pool/main/b/busybox/busybox-static_1.35.0-4+deb12u1_arm64.deb"
        );
    }
}
