//! Every input that is not in this repository, pinned by name, version, source and sha256, and
//! the content-addressed download cache (`$XDG_CACHE_HOME/kiln/sha256/<hash>`) whose files are
//! re-verified on every use. Knows inputs, not boards: callers pass the pins files to act on
//! (the command is `pins_cmd`).

use crate::apt::{Apt, Download};
use anyhow::{bail, ensure, Context, Result};
use sha2::Digest;
use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;
pub mod identity;
pub mod memo;

/// A sha256 digest: parsed once from hex at the edge, printed as lowercase hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256(pub [u8; 32]);

impl Sha256 {
    pub fn of_bytes(b: &[u8]) -> Sha256 {
        Sha256(sha2::Sha256::digest(b).into())
    }

    pub fn of_reader(mut r: impl Read) -> std::io::Result<Sha256> {
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(Sha256(h.finalize().into()))
    }

    pub fn of_file(p: &Path) -> Result<Sha256> {
        let f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
        Sha256::of_reader(f).with_context(|| format!("reading {}", p.display()))
    }

    /// [`Sha256::of_file`], without reading a file again that is unchanged since it was last
    /// hashed (see [`memo`] for what "unchanged" means and why it is sound).
    pub fn of_file_memo(p: &Path) -> Result<Sha256> {
        memo::memo().hash(p)
    }

    pub fn short(&self) -> String {
        self.to_string()[..16].to_string()
    }
}

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256({self})")
    }
}

impl FromStr for Sha256 {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Sha256> {
        let s = s.trim();
        if s.len() != 64 {
            bail!(
                "a sha256 is 64 hex digits, got {} characters: {s:?}",
                s.len()
            );
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).with_context(|| format!("not hex: {s:?}"))?;
        Ok(Sha256(out))
    }
}

impl serde::Serialize for Sha256 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for Sha256 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One pinned input as written in a pins file (`[[input]]`).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInput {
    pub name: String,
    pub version: String,
    /// `deb` (a Debian package fetched with apt), `url` (a file fetched from `url`) or
    /// `supplied` (a file the user gives).
    pub kind: String,
    /// For `url`: where the file is fetched from (http or https).
    pub url: Option<String>,
    pub package: Option<String>,
    pub arch: Option<String>,
    /// For `supplied`: how to get the file, shown when it is missing.
    pub how: Option<String>,
    /// For `supplied`: what the file must prove it is before it is locked.
    #[serde(default)]
    pub identity: BTreeMap<String, String>,
    /// Empty for a `supplied` input that was never locked.
    #[serde(default)]
    pub sha256: String,
    /// For `deb`: the snapshot.debian.org timestamp at which this version is served
    /// (`YYYYMMDDTHHMMSSZ`), recorded by `pins update`.
    pub snapshot: Option<String>,
    /// For `deb`: the file under that snapshot (`<archive>/pool/…/<file>.deb`).
    pub snapshot_path: Option<String>,
    /// For `deb`: the Debian release the package is from, as a purl's `distro` (`debian-13`),
    /// when it is not the release of kiln's apt lists ([`DEFAULT_DISTRO`]).
    #[serde(default)]
    pub distro: Option<String>,
}

/// The Debian release of kiln's apt lists (bookworm), as a purl's `distro`.
pub const DEFAULT_DISTRO: &str = "debian-12";

/// Where snapshot.debian.org serves a pinned package: `{base}/archive/{path's archive}/{timestamp}/{pool path}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub timestamp: String,
    /// The archive (`debian`, `debian-security`).
    pub archive: String,
    /// The path under the archive (`pool/main/…/x.deb`).
    pub pool: String,
}

impl Snapshot {
    pub fn url(&self, base: &str) -> String {
        format!(
            "{}/archive/{}/{}/{}",
            base.trim_end_matches('/'),
            self.archive,
            self.timestamp,
            self.pool
        )
    }
}

/// What a supplied file must contain to be accepted by `pins lock`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Identity {
    /// A kernel source tarball: `VERSION.PATCHLEVEL.SUBLEVEL` from its top Makefile and,
    /// if given, the rknpu driver version from `drivers/rknpu/include/rknpu_drv.h`.
    KernelSource {
        kernel_version: String,
        rknpu_version: Option<String>,
    },
    /// A binary that contains this exact string (e.g. `librknnrt version: 2.3.2`).
    Contains(String),
    /// A file that starts with these bytes (e.g. a FIT image's `d00dfeed`).
    Magic(Vec<u8>),
    /// Rockchip's `librknnrt.so` of this version ([`identity::librknnrt`]).
    Librknnrt(String),
    /// An RK3588 idbloader: the v2 Rockchip boot header ([`identity::idbloader`]).
    RockchipIdb,
    /// A U-Boot FIT (`u-boot.itb`, [`identity::uboot_itb`]).
    UbootItb,
    /// Nothing to check beyond the sha256 once it is locked.
    Any,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Deb {
        package: String,
        arch: String,
    },
    Supplied {
        how: String,
        identity: Identity,
    },
    /// A file fetched from a URL into the cache and verified by its pinned sha256.
    Url {
        url: String,
    },
}

/// A checked input.
#[derive(Clone, Debug)]
pub struct Input {
    pub name: String,
    pub version: String,
    pub source: Source,
    /// `None` only for a supplied input not yet locked.
    pub sha256: Option<Sha256>,
    /// Where the snapshot service keeps this version (deb inputs pinned by `pins update`).
    pub snapshot: Option<Snapshot>,
    /// The Debian release of a deb input (`debian-12` unless the pin says otherwise).
    pub distro: Option<String>,
    /// The pins file it was read from (for messages and for rewriting).
    pub file: PathBuf,
}

impl Input {
    pub fn parse(raw: RawInput, file: &Path) -> Result<Input> {
        let ctx = || format!("input {:?} in {}", raw.name, file.display());
        let sha256 = if raw.sha256.is_empty() {
            None
        } else {
            Some(raw.sha256.parse().with_context(ctx)?)
        };
        let source = match raw.kind.as_str() {
            "deb" => Source::Deb {
                package: raw.package.clone().unwrap_or_else(|| raw.name.clone()),
                arch: raw
                    .arch
                    .clone()
                    .with_context(|| format!("{}: a deb input needs `arch`", ctx()))?,
            },
            "supplied" => {
                let id = &raw.identity;
                let identity = if let Some(kv) = id.get("kernel_version") {
                    Identity::KernelSource {
                        kernel_version: kv.clone(),
                        rknpu_version: id.get("rknpu_version").cloned(),
                    }
                } else if let Some(v) = id.get("librknnrt") {
                    Identity::Librknnrt(v.clone())
                } else if let Some(m) = id.get("rockchip_idb") {
                    ensure!(m == "RKNS", "{}: rockchip_idb knows only \"RKNS\"", ctx());
                    Identity::RockchipIdb
                } else if let Some(os) = id.get("fit_firmware") {
                    ensure!(
                        os == "u-boot",
                        "{}: fit_firmware knows only \"u-boot\"",
                        ctx()
                    );
                    Identity::UbootItb
                } else if let Some(s) = id.get("contains") {
                    Identity::Contains(s.clone())
                } else if let Some(m) = id.get("magic_hex") {
                    Identity::Magic(
                        hex::decode(m).with_context(|| format!("{}: magic_hex", ctx()))?,
                    )
                } else if id.is_empty() {
                    Identity::Any
                } else {
                    bail!("{}: unknown identity keys {:?}", ctx(), id.keys());
                };
                Source::Supplied {
                    how: raw
                        .how
                        .clone()
                        .with_context(|| format!("{}: a supplied input needs `how`", ctx()))?,
                    identity,
                }
            }
            "url" => {
                let url = raw
                    .url
                    .clone()
                    .with_context(|| format!("{}: a url input needs `url`", ctx()))?;
                ensure!(
                    url.starts_with("https://") || url.starts_with("http://"),
                    "{}: url {url:?} is not http(s)",
                    ctx()
                );
                Source::Url { url }
            }
            k => bail!("{}: unknown kind {k:?} (deb, url or supplied)", ctx()),
        };
        if matches!(source, Source::Deb { .. } | Source::Url { .. }) && sha256.is_none() {
            bail!("{}: a {} input must carry its sha256", ctx(), raw.kind);
        }
        if raw.url.is_some() && !matches!(source, Source::Url { .. }) {
            bail!("{}: `url` belongs to kind = \"url\"", ctx());
        }
        let snapshot = match (&raw.snapshot, &raw.snapshot_path) {
            (None, None) => None,
            (Some(t), Some(p)) => {
                let ok_time = t.len() == 16
                    && t.as_bytes()[8] == b'T'
                    && t.ends_with('Z')
                    && t[..8]
                        .bytes()
                        .chain(t[9..15].bytes())
                        .all(|b| b.is_ascii_digit());
                if !ok_time {
                    bail!("{}: snapshot {t:?} is not YYYYMMDDTHHMMSSZ", ctx());
                }
                let (archive, pool) = p
                    .split_once('/')
                    .filter(|(a, rest)| {
                        !a.is_empty() && rest.starts_with("pool/") && !rest.contains("..")
                    })
                    .with_context(|| {
                        format!("{}: snapshot_path {p:?} is not <archive>/pool/…", ctx())
                    })?;
                Some(Snapshot {
                    timestamp: t.clone(),
                    archive: archive.to_string(),
                    pool: pool.to_string(),
                })
            }
            _ => bail!("{}: `snapshot` and `snapshot_path` go together", ctx()),
        };
        let distro = match (&source, raw.distro) {
            (Source::Deb { .. }, None) => Some(DEFAULT_DISTRO.to_string()),
            (Source::Deb { .. }, Some(d)) => {
                ensure!(
                    d.strip_prefix("debian-")
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())),
                    "{}: distro {d:?} is not debian-<release number>",
                    ctx()
                );
                Some(d)
            }
            (_, None) => None,
            (_, Some(_)) => bail!("{}: `distro` belongs to kind = \"deb\"", ctx()),
        };
        Ok(Input {
            name: raw.name,
            version: raw.version,
            source,
            sha256,
            snapshot,
            distro,
            file: file.to_path_buf(),
        })
    }

    pub fn describe_source(&self) -> String {
        match &self.source {
            Source::Deb { package, arch } => format!("debian {package}:{arch}={}", self.version),
            Source::Supplied { .. } => "supplied by the user (cargo xtask pins lock)".into(),
            Source::Url { url } => format!("url {url}"),
        }
    }
}

#[derive(serde::Deserialize)]
struct PinsFile {
    #[serde(default)]
    input: Vec<RawInput>,
}

/// Read the `[[input]]` entries of a pins TOML file.
pub fn read_inputs(file: &Path) -> Result<Vec<Input>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let pf: PinsFile =
        toml::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    pf.input
        .into_iter()
        .map(|r| Input::parse(r, file))
        .collect()
}

/// The content-addressed download cache.
pub struct Cache {
    pub dir: PathBuf,
}

impl Cache {
    /// `$XDG_CACHE_HOME/kiln/sha256`, else `~/.cache/kiln/sha256`.
    pub fn user() -> Result<Cache> {
        Ok(Cache {
            dir: crate::paths::user_cache()?.join("sha256"),
        })
    }

    pub fn path(&self, h: &Sha256) -> PathBuf {
        self.dir.join(h.to_string())
    }

    /// The cached file for `h`, re-verified now. A file whose bytes do not hash to `h` is
    /// reported with both hashes and removed, so that the caller fetches it again.
    pub fn get(&self, name: &str, h: &Sha256) -> Result<Option<PathBuf>> {
        let p = self.path(h);
        if !p.exists() {
            return Ok(None);
        }
        let got = Sha256::of_file_memo(&p)?;
        if got == *h {
            return Ok(Some(p));
        }
        eprintln!(
            "pins: cached {name} at {} is corrupt: pinned sha256 {h}, file has {got}; discarding it",
            p.display()
        );
        std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        Ok(None)
    }

    /// Hash `src`, check it against `expected` (naming both hashes), and store it atomically.
    pub fn put(
        &self,
        name: &str,
        src: &Path,
        expected: Option<&Sha256>,
    ) -> Result<(Sha256, PathBuf)> {
        let got = Sha256::of_file(src)?;
        if let Some(want) = expected {
            if *want != got {
                bail!(
                    "{name}: sha256 mismatch: the pin says {want}, {} has {got}: refused (the \
                     file was corrupted or tampered with, or it is not the pinned one)",
                    src.display()
                );
            }
        }
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let dst = self.path(&got);
        // A unique temporary name per writer: concurrent fetches of one hash never share it.
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{got}.tmp"))
            .tempfile_in(&self.dir)
            .with_context(|| format!("a temporary file in {}", self.dir.display()))?;
        std::fs::copy(src, tmp.path())
            .with_context(|| format!("copying {} into the cache", src.display()))?;
        tmp.persist(&dst)
            .with_context(|| format!("renaming into {}", dst.display()))?;
        Ok((got, dst))
    }
}

/// Downloads an input into `dir` and returns the downloaded file.
pub type Fetcher<'a> = &'a (dyn Fn(&Input, &Path) -> Result<PathBuf> + Sync);

/// The default snapshot service (`KILN_SNAPSHOT_URL` overrides it, e.g. for a mirror).
pub const SNAPSHOT_URL: &str = "https://snapshot.debian.org";

/// Where deb inputs come from: kiln's private apt configuration (the live archive), then the
/// snapshot service at the input's recorded timestamp.
pub struct DebSource {
    pub apt: Apt,
    pub snapshot_base: String,
}

impl DebSource {
    pub fn kiln() -> DebSource {
        DebSource {
            apt: Apt::kiln(),
            snapshot_base: std::env::var("KILN_SNAPSHOT_URL")
                .ok()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| SNAPSHOT_URL.to_string()),
        }
    }

    /// Download `input` into `dir`: the live archive (lists refreshed first when missing or
    /// older than the pins file; on "not found" refreshed and retried once), then the snapshot
    /// service. The caller verifies the sha256.
    pub fn fetch(&self, input: &Input, dir: &Path) -> Result<PathBuf> {
        let Source::Deb { package, arch } = &input.source else {
            bail!("{} is supplied by the user, not downloaded", input.name);
        };
        let spec = format!("{package}:{arch}={}", input.version);
        if !crate::http::host_has_apt() {
            return self.fetch_without_apt(input, &spec, dir);
        }
        // Once per process, not per package (each ask runs the tools' probes).
        static APT_READY: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        if APT_READY.get().is_none() {
            crate::doctor::ensure(crate::doctor::FOR_APT)?;
            let _ = APT_READY.set(());
        }
        self.apt.ensure_lists(&[&input.file])?;
        println!("pins: downloading {spec}");
        let t = std::time::Instant::now();
        let mut found = self.apt.download(&spec, dir)?;
        if matches!(found, Download::NotFound(_)) {
            self.apt.refresh_once(&format!(
                "{spec} not found: refreshing, then trying once more"
            ))?;
            found = self.apt.download(&spec, dir)?;
        }
        let (deb, from) = match found {
            Download::Got(deb) => (deb, "Debian's archive".to_string()),
            Download::NotFound(apt_says) => {
                // Another suite's package (e.g. trixie's, with bookworm lists): the live
                // archive's pool serves it at the path the pin records.
                let live = input.snapshot.as_ref().and_then(|sn| {
                    let a = crate::apt::ARCHIVES.iter().find(|a| a.name == sn.archive)?;
                    let url = format!("{}/{}", a.url, sn.pool);
                    let name = sn.pool.rsplit('/').next().unwrap_or("live.deb");
                    let dest = dir.join(name);
                    println!("pins: {spec} is not in kiln's lists: trying {url}");
                    self.apt.fetch_url(&url, &dest).ok().map(|()| (dest, url))
                });
                let snap = match (live, &input.snapshot) {
                    (Some(got), _) => Ok(got),
                    (None, None) => Err(format!(
                        "no snapshot timestamp is recorded for it in {}",
                        input.file.display()
                    )),
                    (None, Some(sn)) => {
                        let url = sn.url(&self.snapshot_base);
                        println!("pins: {spec} is not in the live archive: trying {url}");
                        let name = sn.pool.rsplit('/').next().unwrap_or("snapshot.deb");
                        let dest = dir.join(name);
                        match self.apt.fetch_url(&url, &dest) {
                            Ok(()) => Ok((dest, url)),
                            Err(e) => Err(format!("{e:#}")),
                        }
                    }
                };
                match snap {
                    Ok(got) => got,
                    Err(why) => bail!("{}", self.not_served(input, &spec, &apt_says, &why)),
                }
            }
        };
        let size = std::fs::metadata(&deb)?.len();
        println!(
            "pins: downloaded {} from {from} ({:.1} MiB in {:.1} s)",
            deb.file_name().unwrap_or_default().to_string_lossy(),
            size as f64 / 1048576.0,
            t.elapsed().as_secs_f64()
        );
        Ok(deb)
    }

    /// On a host without apt: the pool path the pin records, from the live archive, then from
    /// the snapshot service at the pin's timestamp (the caller verifies the sha256).
    fn fetch_without_apt(&self, input: &Input, spec: &str, dir: &Path) -> Result<PathBuf> {
        let Some(sn) = &input.snapshot else {
            bail!(
                "{spec}: this host has no apt, and {} records no archive path for it                  (`snapshot_path`): `cargo xtask pins update` on a host with apt records one",
                input.file.display()
            );
        };
        let name = sn.pool.rsplit('/').next().unwrap_or("input.deb");
        let dest = dir.join(name);
        let live = crate::apt::ARCHIVES
            .iter()
            .find(|a| a.name == sn.archive)
            .map(|a| format!("{}/{}", a.url, sn.pool));
        let mut tried = Vec::new();
        for url in live.into_iter().chain([sn.url(&self.snapshot_base)]) {
            let t = std::time::Instant::now();
            match crate::http::download(&url, &dest) {
                Ok(n) => {
                    println!(
                        "pins: downloaded {name} from {url} ({:.1} MiB in {:.1} s; no apt on this host)",
                        n as f64 / 1048576.0,
                        t.elapsed().as_secs_f64()
                    );
                    return Ok(dest);
                }
                Err(e) => tried.push(format!("{e:#}")),
            }
        }
        bail!(
            "{spec} (sha256 {}) is not served: {}. Remedies: build with `--offline` from a \
             download cache that holds it, or change the pins deliberately with `cargo xtask pins \
             update`",
            input.sha256.map(|h| h.to_string()).unwrap_or_default(),
            tried.join("; ")
        )
    }

    /// The version is served neither live nor by the snapshot: what the archive serves now and
    /// both remedies.
    fn not_served(&self, input: &Input, spec: &str, apt_says: &str, snapshot: &str) -> String {
        let Source::Deb { package, arch } = &input.source else {
            return String::new();
        };
        let now = match self.apt.versions(package, arch) {
            Ok(v) if !v.is_empty() => v.join(", "),
            Ok(_) => "no version of it".into(),
            Err(e) => format!("(unknown: {e:#})"),
        };
        let suites: Vec<&str> = crate::apt::ARCHIVES.iter().map(|a| a.suite).collect();
        format!(
            "{spec} (sha256 {}) is not served: Debian's archive ({}, lists refreshed just now) \
             says {:?} and serves {now}; the snapshot service: {snapshot}. Remedies: build with \
             `--offline` from a download cache that holds it ($XDG_CACHE_HOME/kiln/sha256/{}), \
             or change the pins deliberately with `cargo xtask pins update`",
            input.sha256.map(|h| h.to_string()).unwrap_or_default(),
            suites.join(", "),
            apt_says.lines().last().unwrap_or(apt_says),
            input.sha256.map(|h| h.to_string()).unwrap_or_default(),
        )
    }
}

/// The real fetcher: [`DebSource::kiln`] for a deb, [`fetch_url`] for a url input.
pub fn apt_fetch(input: &Input, dir: &Path) -> Result<PathBuf> {
    match &input.source {
        Source::Url { url } => fetch_url(input, url, dir),
        _ => DebSource::kiln().fetch(input, dir),
    }
}

/// Download a url input into `dir` (apt's own downloader, which speaks http and https); the
/// caller verifies the sha256.
pub fn fetch_url(input: &Input, url: &str, dir: &Path) -> Result<PathBuf> {
    let name = url
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty() && !n.starts_with('.'))
        .unwrap_or("download");
    let dest = dir.join(name);
    println!("pins: downloading {} from {url}", input.name);
    let t = std::time::Instant::now();
    if crate::http::host_has_apt() {
        crate::doctor::ensure(&[&crate::doctor::APT_HELPER])?;
        Apt::kiln().fetch_url(url, &dest)?;
    } else {
        crate::http::download(url, &dest)?;
    }
    let size = std::fs::metadata(&dest)
        .with_context(|| format!("{}", dest.display()))?
        .len();
    println!(
        "pins: downloaded {} ({:.1} MiB in {:.1} s)",
        input.name,
        size as f64 / 1048576.0,
        t.elapsed().as_secs_f64()
    );
    Ok(dest)
}

/// How to put a url input into the cache by hand, for a machine that cannot reach its URL.
pub fn seed_hint(cache: &Cache, input: &Input) -> String {
    let sha = input.sha256.map(|h| h.to_string()).unwrap_or_default();
    format!(
        "to build without reaching it, fetch the file elsewhere and seed the cache: `cargo xtask \
         pins seed FILE` (or copy it to {}), whose sha256 must be {sha}",
        cache.dir.join(&sha).display()
    )
}

/// The verified cached file of a pinned input: from the cache, else fetched (unless offline).
pub fn resolve(cache: &Cache, input: &Input, offline: bool, fetch: Fetcher) -> Result<PathBuf> {
    let Some(want) = &input.sha256 else {
        bail!("{}", missing_message(input));
    };
    if let Some(p) = cache.get(&input.name, want)? {
        return Ok(p);
    }
    if let Source::Supplied { .. } = input.source {
        bail!("{}", missing_message(input));
    }
    if offline {
        bail!(
            "{} {} (sha256 {want}) is not in the cache {} and --offline forbids fetching it",
            input.name,
            input.version,
            cache.dir.display()
        );
    }
    let tmp = tempfile::tempdir().context("temporary download dir")?;
    if let Source::Url { url } = &input.source {
        // A url input's failure names the input, the URL and how to seed the cache instead.
        let got = fetch(input, tmp.path()).with_context(|| {
            format!(
                "input {} {} ({}): cannot fetch {url}; {}",
                input.name,
                input.version,
                input.file.display(),
                seed_hint(cache, input)
            )
        })?;
        let (_, p) = cache.put(&input.name, &got, Some(want)).with_context(|| {
            format!(
                "input {} {} fetched from {url} is not the pinned file; {}",
                input.name,
                input.version,
                seed_hint(cache, input)
            )
        })?;
        return Ok(p);
    }
    let got = fetch(input, tmp.path())?;
    let (_, p) = cache.put(&input.name, &got, Some(want))?;
    Ok(p)
}

/// `pins seed`: put files into the cache, each only if it is the pinned file of one of the
/// inputs of `files` (by sha256); the names of the inputs seeded.
pub fn seed(files: &[PathBuf], given: &[PathBuf]) -> Result<Vec<String>> {
    let cache = Cache::user()?;
    let inputs = inputs_of(files)?;
    let mut seeded = Vec::new();
    for f in given {
        let got = Sha256::of_file(f)?;
        let Some(input) = inputs.iter().find(|i| i.sha256 == Some(got)) else {
            bail!(
                "{} (sha256 {got}) is the pinned file of no input in {}",
                f.display(),
                files
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        cache.put(&input.name, f, Some(&got))?;
        println!(
            "pins: seeded {} {} ({}) into {}",
            input.name,
            input.version,
            f.display(),
            cache.path(&got).display()
        );
        seeded.push(input.name.clone());
    }
    Ok(seeded)
}

/// How many pinned inputs are fetched at once.
pub const FETCH_JOBS: usize = 8;

/// [`resolve`] of every input, at most `jobs` at once; the results in input order. Progress is
/// shown as `N/M` with the bytes resolved so far.
pub fn resolve_all(
    cache: &Cache,
    inputs: &[&Input],
    offline: bool,
    fetch: Fetcher,
    jobs: usize,
) -> Vec<Result<PathBuf>> {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let results: Mutex<Vec<Option<Result<PathBuf>>>> =
        Mutex::new((0..inputs.len()).map(|_| None).collect());
    let t = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, inputs.len().max(1)) {
            s.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::SeqCst);
                let Some(input) = inputs.get(n) else { break };
                let r = resolve(cache, input, offline, fetch);
                if let Ok(p) = &r {
                    let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
                    bytes.fetch_add(len, Ordering::SeqCst);
                }
                let d = done.fetch_add(1, Ordering::SeqCst) + 1;
                if d % 25 == 0 || d == inputs.len() {
                    println!(
                        "pins: resolved {d}/{} ({:.1} MiB, {:.1} s)",
                        inputs.len(),
                        bytes.load(Ordering::SeqCst) as f64 / 1048576.0,
                        t.elapsed().as_secs_f64()
                    );
                }
                if let Ok(mut g) = results.lock() {
                    g[n] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a fetch worker panicked"))))
        .collect()
}

/// How to provide a missing supplied input.
pub fn missing_message(input: &Input) -> String {
    match &input.source {
        Source::Supplied { how, identity } => {
            let what = match identity {
                Identity::KernelSource {
                    kernel_version,
                    rknpu_version,
                } => format!(
                    "kernel source tarball of version {kernel_version}{}",
                    rknpu_version
                        .as_ref()
                        .map(|v| format!(" with rknpu driver {v}"))
                        .unwrap_or_default()
                ),
                Identity::Contains(s) => format!("a file containing {s:?}"),
                Identity::Magic(m) => format!("a file starting with bytes {}", hex::encode(m)),
                Identity::Librknnrt(v) => format!(
                    "Rockchip's librknnrt.so: an aarch64 ELF exporting the rknn matmul API, \
                     containing \"librknnrt version: {v}\", not kiln's stand-in"
                ),
                Identity::RockchipIdb => {
                    "an idbloader with the Rockchip v2 boot header (magic RKNS)".into()
                }
                Identity::UbootItb => {
                    "a FIT whose configuration loads an os = \"u-boot\" image".into()
                }
                Identity::Any => "the file".into(),
            };
            let locked = match &input.sha256 {
                Some(h) => format!(" (locked to sha256 {h}, not in the cache)"),
                None => String::new(),
            };
            format!(
                "missing input {} {}{locked}: {what}. {how}. Then run `cargo xtask pins lock \
                 --input {}=PATH`",
                input.name, input.version, input.name
            )
        }
        Source::Deb { .. } | Source::Url { .. } => {
            format!("missing input {} {}", input.name, input.version)
        }
    }
}

/// Every input declared in `files` (a pins file that does not exist declares none), in order.
pub fn inputs_of(files: &[PathBuf]) -> Result<Vec<Input>> {
    let mut all = Vec::new();
    for f in files {
        if f.exists() {
            all.extend(read_inputs(f)?);
        }
    }
    Ok(all)
}

/// Resolve every input of `files` (the pins of `what`, e.g. a board) into the cache.
pub fn check(what: &str, files: &[PathBuf], offline: bool) -> Result<()> {
    let cache = Cache::user()?;
    let mut missing = Vec::new();
    let inputs = inputs_of(files)?;
    let refs: Vec<&Input> = inputs.iter().collect();
    let got = resolve_all(&cache, &refs, offline, &apt_fetch, FETCH_JOBS);
    for (input, r) in inputs.iter().zip(got) {
        match r {
            Ok(p) => println!(
                "ok       {:<24} {:<28} sha256 {} ({})",
                input.name,
                input.version,
                input.sha256.map(|h| h.short()).unwrap_or_default(),
                p.display()
            ),
            Err(e) => {
                println!("MISSING  {:<24} {:<28} {e:#}", input.name, input.version);
                missing.push(input.name.clone());
            }
        }
    }
    if !missing.is_empty() {
        bail!(
            "{} input(s) of {} unresolved: {}",
            missing.len(),
            what,
            missing.join(", ")
        );
    }
    println!("pins: every input of {what} resolves and verifies");
    Ok(())
}

/// Record where the snapshot service keeps an input's version (`snapshot`, `snapshot_path`).
pub fn rewrite_snapshot(file: &Path, name: &str, snap: &Snapshot) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut doc: toml_edit::DocumentMut = text
        .parse()
        .with_context(|| format!("parsing {}", file.display()))?;
    let t = doc
        .get_mut("input")
        .and_then(|i| i.as_array_of_tables_mut())
        .and_then(|a| {
            a.iter_mut()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
        })
        .with_context(|| format!("{} has no input {name:?}", file.display()))?;
    t["snapshot"] = toml_edit::value(snap.timestamp.clone());
    t["snapshot_path"] = toml_edit::value(format!("{}/{}", snap.archive, snap.pool));
    crate::atomic::write_atomic(file, doc.to_string().as_bytes())
}

/// Rewrite `version` and `sha256` of the input `name` in a pins file, keeping its formatting.
pub fn rewrite_pin(file: &Path, name: &str, version: Option<&str>, sha: &Sha256) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut doc: toml_edit::DocumentMut = text
        .parse()
        .with_context(|| format!("parsing {}", file.display()))?;
    let arr = doc
        .get_mut("input")
        .and_then(|i| i.as_array_of_tables_mut())
        .with_context(|| format!("{} has no [[input]]", file.display()))?;
    let t = arr
        .iter_mut()
        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
        .with_context(|| format!("{} has no input {name:?}", file.display()))?;
    if let Some(v) = version {
        t["version"] = toml_edit::value(v);
    }
    t["sha256"] = toml_edit::value(sha.to_string());
    crate::atomic::write_atomic(file, doc.to_string().as_bytes())
}

pub fn update() -> Result<()> {
    let root = crate::paths::project_root();
    let mut files = vec![root.join("rootfs/packages.toml")];
    for e in std::fs::read_dir(root.join("kernel-config"))? {
        let p = e?.path().join("pins.toml");
        if p.exists() {
            files.push(p);
        }
    }
    update_files(&files, &Cache::user()?, &DebSource::kiln())?;
    Ok(())
}

/// [`update`] of `files`: how many pins were rewritten and how many of another Debian release
/// were kept.
fn update_files(files: &[PathBuf], cache: &Cache, src: &DebSource) -> Result<(usize, usize)> {
    let (mut changed, mut kept) = (0, 0);
    for f in files {
        let f = f.as_path();
        for input in read_inputs(f)? {
            let Source::Deb { package, arch } = &input.source else {
                continue;
            };
            // kiln's lists are bookworm's: a package of another release (rock-5b's trixie
            // kernel) has no candidate in them, and asking stopped the whole update.
            if let Some(d) = input.distro.as_deref().filter(|d| *d != DEFAULT_DISTRO) {
                println!(
                    "pins: {} {} kept: it is from {d}, and kiln's apt lists are {DEFAULT_DISTRO}'s; \
                     re-pin it by hand in {} (version, sha256, snapshot, snapshot_path)",
                    input.name,
                    input.version,
                    f.display()
                );
                kept += 1;
                continue;
            }
            src.apt.ensure_lists(&[f])?;
            let now = src.apt.candidate(package, arch)?;
            let mut fresh = input.clone();
            fresh.version = now.clone();
            fresh.snapshot = None;
            let tmp = tempfile::tempdir()?;
            let deb = src.fetch(&fresh, tmp.path())?;
            let (sha, _) = cache.put(&input.name, &deb, None)?;
            let spec = format!("{package}:{arch}={now}");
            let (archive, pool) = src.apt.pool_path(&spec)?;
            let snap = Snapshot {
                timestamp: src.apt.release_timestamp(&archive)?,
                archive,
                pool,
            };
            if now == input.version && Some(sha) == input.sha256 {
                if input.snapshot.is_none() {
                    println!(
                        "pins: {} {now} unchanged; recording its snapshot {}",
                        input.name,
                        snap.url(&src.snapshot_base)
                    );
                    rewrite_snapshot(f, &input.name, &snap)?;
                    changed += 1;
                } else {
                    println!("pins: {} {} unchanged", input.name, now);
                }
                continue;
            }
            println!("{}: [[input]] name = {:?}", f.display(), input.name);
            println!("-  version = {:?}", input.version);
            println!(
                "-  sha256 = {:?}",
                input.sha256.map(|h| h.to_string()).unwrap_or_default()
            );
            println!("+  version = {now:?}");
            println!("+  sha256 = {:?}", sha.to_string());
            println!("+  snapshot = {:?}", snap.timestamp);
            rewrite_pin(f, &input.name, Some(&now), &sha)?;
            rewrite_snapshot(f, &input.name, &snap)?;
            changed += 1;
        }
    }
    println!("pins: {changed} pin(s) rewritten, {kept} of another Debian release kept as pinned");
    Ok((changed, kept))
}

/// Check a supplied file's identity, lock its sha256 (on first supply) and cache it.
pub fn lock(what: &str, files: &[PathBuf], name: &str, path: &Path) -> Result<()> {
    let inputs = inputs_of(files)?;
    let input = inputs.iter().find(|i| i.name == name).with_context(|| {
        format!(
            "{what} has no input {name:?}; its inputs: {}",
            inputs
                .iter()
                .map(|i| i.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let Source::Supplied { identity, .. } = &input.source else {
        bail!("{name} is fetched from Debian, not supplied: `cargo xtask pins check` fetches it");
    };
    check_identity(identity, path).with_context(|| format!("{name}: {}", path.display()))?;
    let cache = Cache::user()?;
    let (sha, _) = cache.put(name, path, input.sha256.as_ref())?;
    if input.sha256.is_none() {
        rewrite_pin(&input.file, name, None, &sha)?;
        println!(
            "pins: locked {name} to sha256 {sha} in {}",
            input.file.display()
        );
    } else {
        println!("pins: {name} matches its lock {sha}; cached");
    }
    Ok(())
}

fn check_identity(id: &Identity, path: &Path) -> Result<()> {
    match id {
        Identity::Any => Ok(()),
        Identity::Magic(m) => {
            let mut f = std::fs::File::open(path)?;
            let mut got = vec![0u8; m.len()];
            f.read_exact(&mut got)
                .context("file shorter than its magic")?;
            anyhow::ensure!(
                got == *m,
                "starts with {}, expected {}",
                hex::encode(&got),
                hex::encode(m)
            );
            Ok(())
        }
        Identity::Librknnrt(v) => identity::librknnrt(&std::fs::read(path)?, v),
        Identity::RockchipIdb => identity::idbloader(&std::fs::read(path)?),
        Identity::UbootItb => identity::uboot_itb(&std::fs::read(path)?),
        Identity::Contains(s) => {
            let bytes = std::fs::read(path)?;
            let found = bytes.windows(s.len()).any(|w| w == s.as_bytes());
            if !found {
                // Name what it does say, when it says a version at all.
                let prefix = s.split(':').next().unwrap_or(s).as_bytes();
                let other = bytes
                    .windows(prefix.len())
                    .position(|w| w == prefix)
                    .map(|i| {
                        String::from_utf8_lossy(&bytes[i..(i + prefix.len() + 24).min(bytes.len())])
                            .into_owned()
                    });
                bail!(
                    "does not contain {s:?}{}",
                    other
                        .map(|o| format!(" (it says {o:?})"))
                        .unwrap_or_default()
                );
            }
            Ok(())
        }
        Identity::KernelSource {
            kernel_version,
            rknpu_version,
        } => {
            let (mk, drv) = kernel_identity_files(path)?;
            let mk = mk.context("no top-level Makefile in the tarball")?;
            let got = kernel_version_from_makefile(&mk)?;
            anyhow::ensure!(
                got == *kernel_version,
                "kernel version {got}, expected {kernel_version}"
            );
            if let Some(want) = rknpu_version {
                let drv = drv.context("no drivers/rknpu/include/rknpu_drv.h in the tarball")?;
                let got = rknpu_version_from_header(&drv)?;
                anyhow::ensure!(got == *want, "rknpu driver {got}, expected {want}");
            }
            Ok(())
        }
    }
}

/// The top-level `Makefile` and `drivers/rknpu/include/rknpu_drv.h` of a kernel tarball.
fn kernel_identity_files(path: &Path) -> Result<(Option<String>, Option<String>)> {
    let mut ar = tar::Archive::new(crate::archive::open_maybe_compressed(path)?);
    let (mut mk, mut drv) = (None, None);
    for e in ar.entries()? {
        let mut e = e?;
        let p = crate::archive::entry_path(&e)?;
        let rel = match p.split_once('/') {
            Some((_, rest)) => rest.to_string(),
            None => p.clone(),
        };
        let top = if rel == "Makefile" || p == "Makefile" {
            &mut mk
        } else if rel == "drivers/rknpu/include/rknpu_drv.h" {
            &mut drv
        } else {
            continue;
        };
        if top.is_none() {
            let mut s = String::new();
            e.read_to_string(&mut s)?;
            *top = Some(s);
        }
        if mk.is_some() && drv.is_some() {
            break;
        }
    }
    Ok((mk, drv))
}

pub fn kernel_version_from_makefile(mk: &str) -> Result<String> {
    let var = |name: &str| -> Result<String> {
        mk.lines()
            .find_map(|l| {
                let (k, v) = l.split_once('=')?;
                (k.trim() == name).then(|| v.trim().to_string())
            })
            .with_context(|| format!("Makefile has no {name}"))
    };
    Ok(format!(
        "{}.{}.{}",
        var("VERSION")?,
        var("PATCHLEVEL")?,
        var("SUBLEVEL")?
    ))
}

pub fn rknpu_version_from_header(h: &str) -> Result<String> {
    let def = |name: &str| -> Result<String> {
        h.lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some("#define") && w.next() == Some(name))
                    .then(|| w.next().map(str::to_string))?
            })
            .with_context(|| format!("rknpu_drv.h has no #define {name}"))
    };
    Ok(format!(
        "{}.{}.{}",
        def("DRIVER_MAJOR")?,
        def("DRIVER_MINOR")?,
        def("DRIVER_PATCHLEVEL")?
    ))
}

#[cfg(test)]
mod archive_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn deb_input(sha: Sha256) -> Input {
        Input {
            name: "busybox-static".into(),
            version: "1:1.35.0-4+deb12u1+b1".into(),
            source: Source::Deb {
                package: "busybox-static".into(),
                arch: "arm64".into(),
            },
            sha256: Some(sha),
            snapshot: None,
            distro: Some(DEFAULT_DISTRO.into()),
            file: PathBuf::from("rootfs/packages.toml"),
        }
    }

    /// kiln's lists are bookworm's: `pins update` keeps a pin of another release as it is,
    /// saying so, instead of asking apt for a candidate it cannot have (rock-5b's trixie kernel
    /// stopped the whole update: "Debian's archive offers no candidate"). The apt here has no
    /// lists and no sources: asking it would fail.
    #[test]
    fn update_keeps_a_pin_of_another_release_without_asking_apt() {
        let d = tempfile::tempdir().unwrap();
        let pins = d.path().join("pins.toml");
        let text = "[[input]]\nname = \"linux-image-arm64\"\nversion = \"6.12.118-1\"\n\
                    kind = \"deb\"\npackage = \"linux-image-6.12.118+deb13-arm64\"\n\
                    arch = \"arm64\"\ndistro = \"debian-13\"\nsha256 = \"e4326441e404a21af104a07bf207090737c1a276a30c67413c3548b764e4c050\"\n";
        std::fs::write(&pins, text).unwrap();
        let src = DebSource {
            apt: Apt::at(d.path().join("apt")),
            snapshot_base: "http://127.0.0.1:9".into(),
        };
        let cache = Cache {
            dir: d.path().join("cache"),
        };
        assert_eq!(
            update_files(std::slice::from_ref(&pins), &cache, &src).unwrap(),
            (0, 1)
        );
        assert_eq!(std::fs::read_to_string(&pins).unwrap(), text);
    }

    #[test]
    fn resolve_all_fetches_concurrently_and_refuses_a_wrong_hash_by_name() {
        let src = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: src.path().join("cache"),
        };
        let mut inputs = Vec::new();
        for n in 0..6u8 {
            let body = vec![n; 1000 + n as usize];
            std::fs::write(src.path().join(format!("p{n}")), &body).unwrap();
            // p3's pin names another content: a wrong hash.
            let pinned = if n == 3 { b"other".to_vec() } else { body };
            let mut i = deb_input(Sha256::of_bytes(&pinned));
            i.name = format!("p{n}");
            inputs.push(i);
        }
        let served = src.path().to_path_buf();
        let (now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let fetch = |i: &Input, dir: &Path| -> Result<PathBuf> {
            let n = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(n, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(50));
            let dst = dir.join(&i.name);
            std::fs::copy(served.join(&i.name), &dst)?;
            now.fetch_sub(1, Ordering::SeqCst);
            Ok(dst)
        };
        let refs: Vec<&Input> = inputs.iter().collect();
        let got = resolve_all(&cache, &refs, false, &fetch, 4);
        assert_eq!(got.len(), 6);
        let most = most.load(Ordering::SeqCst);
        assert!(
            (2..=4).contains(&most),
            "{most} fetches at once: concurrent, within the bound of 4"
        );
        for (n, r) in got.iter().enumerate() {
            if n == 3 {
                let e = format!("{:#}", r.as_ref().unwrap_err());
                assert!(e.contains("p3: sha256 mismatch"), "{e}");
            } else {
                let p = r.as_ref().unwrap();
                assert_eq!(std::fs::read(p).unwrap(), vec![n as u8; 1000 + n]);
            }
        }
        // The cache holds the five good files and nothing else (no partial, no temporary).
        let mut names: Vec<String> = std::fs::read_dir(&cache.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut want: Vec<String> = [0, 1, 2, 4, 5]
            .iter()
            .map(|&n| Sha256::of_bytes(&vec![n as u8; 1000 + n]).to_string())
            .collect();
        want.sort();
        assert_eq!(names, want);
    }

    #[test]
    fn sha256_parses_and_prints() {
        let h = Sha256::of_bytes(b"abc");
        assert_eq!(
            h.to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(h.to_string().parse::<Sha256>().unwrap(), h);
        assert!("abc".parse::<Sha256>().is_err());
    }

    #[test]
    fn tampered_cache_file_is_refetched_and_refused_offline() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: dir.path().join("sha256"),
        };
        let payload = b"the real package".to_vec();
        let input = deb_input(Sha256::of_bytes(&payload));
        let fetches = AtomicUsize::new(0);
        let fetch = |_: &Input, d: &Path| -> Result<PathBuf> {
            fetches.fetch_add(1, Ordering::SeqCst);
            let p = d.join("x.deb");
            std::fs::write(&p, &payload)?;
            Ok(p)
        };
        let p = resolve(&cache, &input, false, &fetch).unwrap();
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        resolve(&cache, &input, false, &fetch).unwrap();
        assert_eq!(
            fetches.load(Ordering::SeqCst),
            1,
            "a good cache file is used, not fetched again"
        );
        std::fs::write(&p, b"tampered").unwrap();
        let err = resolve(&cache, &input, true, &fetch)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--offline"), "{err}");
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        std::fs::write(&p, b"tampered").unwrap();
        let p2 = resolve(&cache, &input, false, &fetch).unwrap();
        assert_eq!(
            fetches.load(Ordering::SeqCst),
            2,
            "the tampered file is fetched again"
        );
        assert_eq!(std::fs::read(p2).unwrap(), payload);
    }

    #[test]
    fn wrong_pin_hash_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: dir.path().to_path_buf(),
        };
        let pinned = Sha256::of_bytes(b"what the pin says");
        let served = Sha256::of_bytes(b"what the archive serves");
        let input = deb_input(pinned);
        let fetch = |_: &Input, d: &Path| -> Result<PathBuf> {
            let p = d.join("x.deb");
            std::fs::write(&p, b"what the archive serves")?;
            Ok(p)
        };
        let err = format!("{:#}", resolve(&cache, &input, false, &fetch).unwrap_err());
        assert!(
            err.contains(&pinned.to_string()) && err.contains(&served.to_string()),
            "{err}"
        );
        assert!(err.contains("busybox-static"), "{err}");
        assert!(!cache.path(&served).exists() && !cache.path(&pinned).exists());
    }

    #[test]
    fn rewrite_pin_keeps_the_rest_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pins.toml");
        let text = "# comment kept\n[kernel]\nbase = \"tinyconfig\"\n\n[[input]]\nname = \"a\"\nversion = \"1\"\nkind = \"deb\"\narch = \"arm64\"\nsha256 = \"\"\n\n[[input]]\nname = \"b\"\nversion = \"1\"\nkind = \"supplied\"\nhow = \"x\"\nsha256 = \"\"\n";
        std::fs::write(&f, text).unwrap();
        let h = Sha256::of_bytes(b"b");
        rewrite_pin(&f, "b", Some("2"), &h).unwrap();
        let out = std::fs::read_to_string(&f).unwrap();
        assert!(
            out.starts_with("# comment kept\n[kernel]\nbase = \"tinyconfig\"\n"),
            "{out}"
        );
        let v: toml::Value = toml::from_str(&out).unwrap();
        assert_eq!(v["input"][0]["sha256"].as_str(), Some(""));
        assert_eq!(v["input"][1]["version"].as_str(), Some("2"));
        assert_eq!(
            v["input"][1]["sha256"].as_str(),
            Some(h.to_string().as_str())
        );
        assert!(rewrite_pin(&f, "nope", None, &h).is_err());
    }

    #[test]
    fn kernel_and_rknpu_versions_parse() {
        let mk = "# SPDX\nVERSION = 6\nPATCHLEVEL = 1\nSUBLEVEL = 115\nEXTRAVERSION =\n";
        assert_eq!(kernel_version_from_makefile(mk).unwrap(), "6.1.115");
        let h = "#define DRIVER_MAJOR 0\n#define DRIVER_MINOR 9\n#define DRIVER_PATCHLEVEL 8\n";
        assert_eq!(rknpu_version_from_header(h).unwrap(), "0.9.8");
    }

    #[test]
    fn supplied_identity_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("librknnrt.so");
        std::fs::write(&lib, b"\x7fELF....librknnrt version: 2.3.0 (abc)\0").unwrap();
        let want = Identity::Contains("librknnrt version: 2.3.2".into());
        let err = check_identity(&want, &lib).unwrap_err().to_string();
        assert!(err.contains("2.3.0"), "{err}");
        std::fs::write(&lib, b"\x7fELF....librknnrt version: 2.3.2 (abc)\0").unwrap();
        check_identity(&want, &lib).unwrap();

        // A kernel tarball: Makefile + rknpu header under one top folder, gzip-compressed.
        let tgz = dir.path().join("linux.tar.gz");
        let gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&tgz).unwrap(),
            flate2::Compression::fast(),
        );
        let mut b = tar::Builder::new(gz);
        for (p, body) in [
            (
                "linux-6.1/Makefile",
                "VERSION = 6\nPATCHLEVEL = 1\nSUBLEVEL = 115\n",
            ),
            (
                "linux-6.1/drivers/rknpu/include/rknpu_drv.h",
                "#define DRIVER_MAJOR 0\n#define DRIVER_MINOR 9\n#define DRIVER_PATCHLEVEL 6\n",
            ),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, p, body.as_bytes()).unwrap();
        }
        b.into_inner().unwrap().finish().unwrap();
        let id = Identity::KernelSource {
            kernel_version: "6.1.115".into(),
            rknpu_version: Some("0.9.8".into()),
        };
        let err = check_identity(&id, &tgz).unwrap_err().to_string();
        assert!(err.contains("0.9.6") && err.contains("0.9.8"), "{err}");
    }
}
