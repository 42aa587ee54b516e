//! The kernel, built from pinned source plus a config fragment: `make <base>` (e.g.
//! `tinyconfig`), the fragment merged in, `olddefconfig`, then every fragment option checked in
//! the final `.config` (Kconfig silently drops an option whose dependency is missing), then
//! `make Image`. Reproducible (`KBUILD_BUILD_TIMESTAMP/_USER/_HOST/_VERSION` fixed) and cached
//! under `target/kiln/kernel/<key>` by the hash of every input. Every `make` runs inside the
//! tools root ([`crate::tools_root`]): its cross gcc, binutils, make, flex, bison, bc and perl,
//! never the host's; the root's key is part of the build key.

use crate::pins::Sha256;
use crate::tools_root::ToolsRoot;
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `[kernel]` of `kernel-config/<name>/pins.toml`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelSpec {
    /// The folder name under `kernel-config/` (filled in by the loader).
    #[serde(default)]
    pub name: String,
    /// The pinned input holding the source.
    pub source: String,
    /// For a Debian source package: the tarball inside it (e.g. `usr/src/linux-source-6.1.tar.xz`).
    pub tarball_in_deb: Option<String>,
    /// The make target that writes the base `.config` (`tinyconfig`, `rockchip_linux_defconfig`).
    pub base: String,
    /// The fragment, relative to `kernel-config/`.
    pub fragment: String,
    pub arch: String,
    pub cross_compile: String,
    /// The dtb to build and ship, relative to `arch/<arch>/boot/dts/`, if the board needs one.
    pub dtb: Option<String>,
    /// For a Debian kernel image package used as built (no build here): its release
    /// (`6.12.118+deb13-arm64`). The Image is its `boot/vmlinuz-<release>`, the config its
    /// `boot/config-<release>`, the dtb `usr/lib/linux-image-<release>/<dtb>`.
    pub prebuilt_release: Option<String>,
}

#[derive(serde::Deserialize)]
struct KernelPinsFile {
    kernel: KernelSpec,
}

impl KernelSpec {
    pub fn load(name: &str) -> Result<KernelSpec> {
        let f = crate::paths::project_root()
            .join("kernel-config")
            .join(name)
            .join("pins.toml");
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
        let mut k: KernelPinsFile = toml::from_str(&text)
            .with_context(|| format!("parsing [kernel] of {}", f.display()))?;
        k.kernel.name = name.to_string();
        Ok(k.kernel)
    }

    pub fn fragment_path(&self) -> PathBuf {
        crate::paths::project_root()
            .join("kernel-config")
            .join(&self.fragment)
    }
}

/// A finished kernel build.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct KernelOut {
    pub key: Sha256,
    pub release: String,
    pub image_sha256: Sha256,
    pub config_sha256: Sha256,
    pub dtb_sha256: Option<Sha256>,
    pub build_timestamp: i64,
    pub toolchain: String,
    /// How long the build took when it ran (not part of the identity).
    pub build_seconds: f64,
    #[serde(skip)]
    pub dir: PathBuf,
    #[serde(skip)]
    pub reused: bool,
}

impl KernelOut {
    pub fn image(&self) -> PathBuf {
        self.dir.join("Image")
    }
    pub fn config(&self) -> PathBuf {
        self.dir.join("config")
    }
    pub fn dtb(&self) -> Option<PathBuf> {
        self.dtb_sha256.map(|_| self.dir.join("board.dtb"))
    }
}

/// One option a fragment asks for: `CONFIG_X=val`, or `# CONFIG_X is not set` (`value: None`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FragmentOption {
    pub symbol: String,
    pub value: Option<String>,
}

impl FragmentOption {
    pub fn line(&self) -> String {
        match &self.value {
            Some(v) => format!("{}={v}", self.symbol),
            None => format!("# {} is not set", self.symbol),
        }
    }
}

/// The options of a fragment; comments other than `# CONFIG_X is not set` are ignored.
pub fn parse_fragment(text: &str) -> Result<Vec<FragmentOption>> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if l.is_empty() {
            continue;
        }
        if let Some(rest) = l.strip_prefix("# ") {
            if let Some(sym) = rest.strip_suffix(" is not set") {
                if sym.starts_with("CONFIG_") && !sym.contains(' ') {
                    out.push(FragmentOption {
                        symbol: sym.to_string(),
                        value: None,
                    });
                }
            }
            continue;
        }
        if l.starts_with('#') {
            continue;
        }
        let (sym, val) = l
            .split_once('=')
            .with_context(|| format!("fragment line {}: {raw:?} is not CONFIG_X=value", i + 1))?;
        if !sym.starts_with("CONFIG_") || sym.contains(char::is_whitespace) {
            bail!("fragment line {}: {raw:?} is not CONFIG_X=value", i + 1);
        }
        out.push(FragmentOption {
            symbol: sym.to_string(),
            value: Some(val.to_string()),
        });
    }
    Ok(out)
}

/// The value a `.config` gives a symbol (`None`: not set or absent).
fn config_value<'a>(config: &'a str, symbol: &str) -> Option<&'a str> {
    config.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k == symbol).then_some(v)
    })
}

/// Every option of the fragment must hold in the final `.config`; the error names each one that
/// does not, with what the `.config` says instead.
pub fn check_fragment(fragment: &[FragmentOption], config: &str) -> Result<()> {
    let mut dropped = Vec::new();
    for o in fragment {
        let got = config_value(config, &o.symbol);
        let ok = match (&o.value, got) {
            (Some(want), Some(got)) => want == got,
            (None, None) => true,
            _ => false,
        };
        if !ok {
            let now = match got {
                Some(v) => format!("{}={v}", o.symbol),
                None if config.contains(&format!("# {} is not set", o.symbol)) => {
                    "is not set (a dependency is missing or it was turned off)".into()
                }
                None => "is absent (unknown symbol, or its menu/dependency is off)".into(),
            };
            dropped.push(format!("{} wanted, final .config: {now}", o.line()));
        }
    }
    if !dropped.is_empty() {
        bail!(
            "{} fragment option(s) did not survive olddefconfig:\n  {}",
            dropped.len(),
            dropped.join("\n  ")
        );
    }
    Ok(())
}

/// Merge a fragment into a base `.config`: the base's lines for the fragment's symbols are
/// dropped and the fragment appended (what `merge_config.sh -m` does, without the shell).
pub fn merge_fragment(base: &str, fragment: &[FragmentOption]) -> String {
    let syms: std::collections::HashSet<&str> =
        fragment.iter().map(|o| o.symbol.as_str()).collect();
    let mut out = String::new();
    for l in base.lines() {
        let sym = l.split_once('=').map(|(k, _)| k).or_else(|| {
            l.strip_prefix("# ")
                .and_then(|r| r.strip_suffix(" is not set"))
        });
        if sym.is_some_and(|s| syms.contains(s)) {
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    for o in fragment {
        out.push_str(&o.line());
        out.push('\n');
    }
    out
}

fn kernel_root() -> PathBuf {
    crate::paths::target_dir().join("kiln/kernel")
}

/// Where finished builds are kept, by key: the user's cache (`~/.cache/kiln/kernel/<key>`), so a
/// new checkout of the same inputs does not build the kernel again (about 5 minutes on 2 cores).
/// The key holds every input that can change the bytes; an entry is re-hashed before it is used.
fn outputs_root() -> Result<PathBuf> {
    Ok(crate::paths::user_cache()?.join("kernel"))
}

/// Unpack the kernel source (a Debian source .deb holding a tarball, or a tarball) once, into
/// `target/kiln/kernel/src-<sha>/`, and return the tree (the folder holding `Makefile`).
fn unpack_source(spec: &KernelSpec, file: &Path, sha: &Sha256) -> Result<PathBuf> {
    let dir = kernel_root().join(format!("src-{}", sha.short()));
    let done = dir.join(".kiln-unpacked");
    if !done.exists() {
        let t = Instant::now();
        println!("kernel: unpacking source {} ...", file.display());
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        let tmp = kernel_root().join(format!(".src-{}.tmp", sha.short()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir_all(&tmp)?;
        match &spec.tarball_in_deb {
            Some(inner) => crate::archive::with_deb_member(file, inner, |r| {
                let mut head = [0u8; 6];
                let mut r = std::io::BufReader::new(r);
                let buf = r.fill_buf()?;
                let n = buf.len().min(6);
                head[..n].copy_from_slice(&buf[..n]);
                let dec = crate::archive::decompressor(&head[..n], r)?;
                tar::Archive::new(dec)
                    .unpack(&tmp)
                    .with_context(|| format!("unpacking {inner}"))
            })?,
            None => tar::Archive::new(crate::archive::open_maybe_compressed(file)?)
                .unpack(&tmp)
                .with_context(|| format!("unpacking {}", file.display()))?,
        }
        std::fs::rename(&tmp, &dir)?;
        std::fs::write(&done, b"")?;
        println!("kernel: unpacked in {:.1} s", t.elapsed().as_secs_f64());
    }
    if dir.join("Makefile").exists() {
        return Ok(dir);
    }
    for e in std::fs::read_dir(&dir)? {
        let p = e?.path();
        if p.join("Makefile").exists() && p.join("Kconfig").exists() {
            return Ok(p);
        }
    }
    bail!("no kernel tree (Makefile + Kconfig) in {}", dir.display())
}

/// The kernel's licence as its source tree states it: `COPYING`, and the two texts it points at.
pub const LICENCE_FILES: &[&str] = &[
    "COPYING",
    "LICENSES/preferred/GPL-2.0",
    "LICENSES/exceptions/Linux-syscall-note",
];

/// The [`LICENCE_FILES`] of the kernel source, as (path in the tree, bytes), from the unpacked
/// source (unpacked first if it is not).
pub fn licence_texts(
    spec: &KernelSpec,
    source: &Path,
    source_sha: &Sha256,
) -> Result<Vec<(String, Vec<u8>)>> {
    let src = unpack_source(spec, source, source_sha)?;
    LICENCE_FILES
        .iter()
        .map(|f| {
            let p = src.join(f);
            Ok((
                f.to_string(),
                std::fs::read(&p)
                    .with_context(|| format!("the kernel's licence text {f} ({})", p.display()))?,
            ))
        })
        .collect()
}

/// The key of a kernel build: every input that can change its bytes.
pub fn build_key(
    spec: &KernelSpec,
    source_sha: &Sha256,
    fragment: &str,
    epoch: i64,
    tools_root: &Sha256,
) -> Sha256 {
    let text = format!(
        "kiln-kernel-v2\nsource={source_sha}\nbase={}\narch={}\ncross={}\ndtb={:?}\nepoch={epoch}\n\
         tools_root={tools_root}\nfragment:\n{fragment}",
        spec.base, spec.arch, spec.cross_compile, spec.dtb
    );
    Sha256::of_bytes(text.as_bytes())
}

/// The paths in a Debian kernel image package of its Image, config and the board's dtb.
pub fn prebuilt_members(spec: &KernelSpec, release: &str) -> (String, String, Option<String>) {
    (
        format!("boot/vmlinuz-{release}"),
        format!("boot/config-{release}"),
        spec.dtb
            .as_ref()
            .map(|d| format!("usr/lib/linux-image-{release}/{d}")),
    )
}

/// An uncompressed arm64 Image: `ARM\x64` at 0x38 (the boot header's magic), which `booti` loads
/// as is.
pub fn is_arm64_image(head: &[u8]) -> bool {
    head.get(0x38..0x3c) == Some(&b"ARM\x64"[..])
}

/// Take Debian's build from its package: Image, config, dtb, into `target/kiln/kernel/<key>/`;
/// the fragment checked in the config (Kconfig is not run: the package's config is the build's).
fn from_deb(
    spec: &KernelSpec,
    release: &str,
    source: &Path,
    source_sha: &Sha256,
    fragment_text: &str,
    fragment: &[FragmentOption],
) -> Result<KernelOut> {
    let key = Sha256::of_bytes(
        format!(
            "kiln-kernel-deb-v1\nsource={source_sha}\nrelease={release}\ndtb={:?}\nfragment:\n{fragment_text}",
            spec.dtb
        )
        .as_bytes(),
    );
    let out_dir = outputs_root()?.join(key.short());
    if let Some(k) = load_cached(&out_dir, &key)? {
        println!(
            "kernel: reused {} taken from {} ({}, Image sha256 {})",
            key.short(),
            spec.source,
            k.release,
            k.image_sha256.short()
        );
        return Ok(k);
    }
    let t0 = Instant::now();
    let (image, config, dtb) = prebuilt_members(spec, release);
    println!(
        "kernel: taking {image}, {config}{} from {} ...",
        dtb.as_deref().map(|d| format!(", {d}")).unwrap_or_default(),
        source.display()
    );
    let _lock = lock_key(&key)?;
    let tmp = outputs_root()?.join(format!(".{}.tmp", key.short()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    let mut wanted: Vec<(String, &str)> =
        vec![(image.clone(), "Image"), (config.clone(), "config")];
    if let Some(d) = &dtb {
        wanted.push((d.clone(), "board.dtb"));
    }
    let mut found = std::collections::BTreeSet::new();
    crate::archive::with_data_tar(source, |tar| {
        for e in tar.entries()? {
            let mut e = e?;
            let p = crate::archive::entry_path(&e)?;
            if let Some((_, to)) = wanted.iter().find(|(m, _)| *m == p) {
                let mut f = std::fs::File::create(tmp.join(to))?;
                std::io::copy(&mut e, &mut f).with_context(|| format!("extracting {p}"))?;
                found.insert(p);
            }
        }
        Ok(())
    })?;
    for (m, _) in &wanted {
        if !found.contains(m) {
            bail!("{} ({}) has no {m}", spec.source, source.display());
        }
    }
    let mut head = [0u8; 64];
    std::io::Read::read_exact(&mut std::fs::File::open(tmp.join("Image"))?, &mut head)
        .with_context(|| format!("{image} is shorter than an arm64 boot header"))?;
    if !is_arm64_image(&head) {
        bail!("{image} of {} is not an uncompressed arm64 Image (no ARM\\x64 magic at 0x38): U-Boot's booti cannot load it", spec.source);
    }
    let cfg = std::fs::read_to_string(tmp.join("config"))
        .with_context(|| format!("{config} of {}", spec.source))?;
    check_fragment(fragment, &cfg)
        .with_context(|| format!("{} against {config} of {}", spec.fragment, spec.source))?;
    println!(
        "kernel: all {} fragment options hold in {config}",
        fragment.len()
    );
    let toolchain = config_value(&cfg, "CONFIG_CC_VERSION_TEXT")
        .map(|v| format!("{} (Debian's build)", v.trim_matches('"')))
        .unwrap_or_else(|| "Debian's build".into());
    let out = KernelOut {
        key,
        release: release.to_string(),
        image_sha256: Sha256::of_file(&tmp.join("Image"))?,
        config_sha256: Sha256::of_file(&tmp.join("config"))?,
        dtb_sha256: match &dtb {
            Some(_) => Some(Sha256::of_file(&tmp.join("board.dtb"))?),
            None => None,
        },
        build_timestamp: 0,
        toolchain,
        build_seconds: t0.elapsed().as_secs_f64(),
        dir: out_dir.clone(),
        reused: false,
    };
    publish(&tmp, &out_dir, &out)?;
    println!(
        "kernel: {} from {} in {:.1} s (Image {:.2} MiB, sha256 {})",
        out.release,
        spec.source,
        out.build_seconds,
        std::fs::metadata(out.image())?.len() as f64 / 1048576.0,
        out.image_sha256.short()
    );
    Ok(out)
}

/// Build (or reuse) the kernel. `epoch` is its `KBUILD_BUILD_TIMESTAMP`. A prebuilt kernel
/// (`prebuilt_release`) is taken from its package instead.
pub fn build(
    spec: &KernelSpec,
    source: &Path,
    source_sha: &Sha256,
    epoch: i64,
    tools: &ToolsRoot,
) -> Result<KernelOut> {
    let frag_path = spec.fragment_path();
    let fragment_text = std::fs::read_to_string(&frag_path)
        .with_context(|| format!("reading {}", frag_path.display()))?;
    let fragment =
        parse_fragment(&fragment_text).with_context(|| frag_path.display().to_string())?;
    if let Some(release) = &spec.prebuilt_release {
        return from_deb(spec, release, source, source_sha, &fragment_text, &fragment);
    }
    let key = build_key(spec, source_sha, &fragment_text, epoch, &tools.key);
    let out_dir = outputs_root()?.join(key.short());
    if let Some(k) = load_cached(&out_dir, &key)? {
        println!(
            "kernel: reused cached build {} ({}, Image sha256 {})",
            key.short(),
            k.release,
            k.image_sha256.short()
        );
        return Ok(k);
    }
    let _lock = lock_key(&key)?;
    // Another checkout may have built it while this one waited for the lock.
    if let Some(k) = load_cached(&out_dir, &key)? {
        println!(
            "kernel: reused {} (built meanwhile by another build)",
            key.short()
        );
        return Ok(k);
    }
    let t0 = Instant::now();
    let gcc = format!("{}gcc", spec.cross_compile);
    let src = unpack_source(spec, source, source_sha)?;
    let toolchain = tools
        .read(&src, &[], &[&gcc, "--version"])?
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let bdir = kernel_root().join(format!("build-{}", spec.name));
    // An incremental build over another key's objects is not a clean build: kbuild does not
    // redo the built-in initramfs when only KBUILD_BUILD_TIMESTAMP changes, so it kept an earlier
    // epoch's mtime (seen: two Images 31 bytes apart). The folder is for one key only.
    let stamp = bdir.join(".kiln-key");
    if bdir.exists() && std::fs::read_to_string(&stamp).ok().as_deref() != Some(&*key.to_string()) {
        println!(
            "kernel: {} holds another build's objects: starting clean",
            bdir.display()
        );
        std::fs::remove_dir_all(&bdir).with_context(|| format!("removing {}", bdir.display()))?;
    }
    std::fs::create_dir_all(&bdir)?;
    std::fs::write(&stamp, key.to_string())?;
    let kb = Kbuild::new(spec, &src, epoch, tools);
    let o = format!("O={}", bdir.display());
    configure(&kb, spec, &bdir, &fragment)
        .with_context(|| format!("kernel {}: fragment {}", spec.name, frag_path.display()))?;
    let cfg_path = bdir.join(".config");
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .to_string();
    let mut targets = vec!["Image".to_string()];
    if let Some(d) = &spec.dtb {
        targets.push(d.clone());
    }
    println!(
        "kernel: make -j{jobs} {} (a few minutes on 2 cores)",
        targets.join(" ")
    );
    let mut argv = vec!["make".to_string(), format!("-j{jobs}"), o.clone()];
    argv.extend(targets.iter().cloned());
    crate::tools_root::run_with_progress(kb.command(&argv), "kernel").context("kernel build")?;
    let release = kb
        .read(&["make", "-s", &o, "kernelrelease"])?
        .trim()
        .to_string();
    let secs = t0.elapsed().as_secs_f64();

    let tmp = outputs_root()?.join(format!(".{}.tmp", key.short()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    let image_src = bdir.join("arch").join(&spec.arch).join("boot/Image");
    std::fs::copy(&image_src, tmp.join("Image"))
        .with_context(|| format!("copying {}", image_src.display()))?;
    std::fs::copy(&cfg_path, tmp.join("config"))?;
    let dtb_sha256 = match &spec.dtb {
        Some(d) => {
            let p = bdir.join("arch").join(&spec.arch).join("boot/dts").join(d);
            std::fs::copy(&p, tmp.join("board.dtb"))
                .with_context(|| format!("copying {}", p.display()))?;
            Some(Sha256::of_file(&p)?)
        }
        None => None,
    };
    let out = KernelOut {
        key,
        release,
        image_sha256: Sha256::of_file(&tmp.join("Image"))?,
        config_sha256: Sha256::of_file(&tmp.join("config"))?,
        dtb_sha256,
        build_timestamp: epoch,
        toolchain,
        build_seconds: secs,
        dir: out_dir.clone(),
        reused: false,
    };
    publish(&tmp, &out_dir, &out)?;
    println!(
        "kernel: built {} in {secs:.0} s (Image {:.2} MiB, sha256 {})",
        out.release,
        std::fs::metadata(out.image())?.len() as f64 / 1048576.0,
        out.image_sha256.short()
    );
    Ok(out)
}

/// `make` in the kernel tree, inside the tools root, with the reproducibility variables set.
struct Kbuild<'a> {
    tools: &'a ToolsRoot,
    src: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Kbuild<'_> {
    fn new<'a>(spec: &KernelSpec, src: &Path, epoch: i64, tools: &'a ToolsRoot) -> Kbuild<'a> {
        Kbuild {
            tools,
            src: src.to_path_buf(),
            env: kbuild_env(spec, epoch),
        }
    }

    fn command(&self, argv: &[String]) -> std::process::Command {
        self.tools.command(&self.src, &self.env, argv)
    }

    fn read(&self, argv: &[&str]) -> Result<String> {
        self.tools.read(&self.src, &self.env, argv)
    }
}

fn kbuild_env(spec: &KernelSpec, epoch: i64) -> Vec<(&'static str, String)> {
    vec![
        ("ARCH", spec.arch.clone()),
        ("CROSS_COMPILE", spec.cross_compile.clone()),
        ("KBUILD_BUILD_TIMESTAMP", format!("@{epoch}")),
        ("KBUILD_BUILD_USER", "kiln".into()),
        ("KBUILD_BUILD_HOST", "kiln".into()),
        ("KBUILD_BUILD_VERSION", "1".into()),
        ("LC_ALL", "C".into()),
        ("TZ", "UTC".into()),
    ]
}

/// `make <base>`, merge the fragment, `olddefconfig`, then check every fragment option in the
/// final `.config` of `bdir`.
fn configure(
    kb: &Kbuild,
    spec: &KernelSpec,
    bdir: &Path,
    fragment: &[FragmentOption],
) -> Result<()> {
    let o = format!("O={}", bdir.display());
    let base = &spec.base;
    println!("kernel: make {base} + {} + olddefconfig", spec.fragment);
    kb.read(&["make", "-s", &o, base])
        .with_context(|| format!("make {base}"))?;
    let cfg_path = bdir.join(".config");
    let base_cfg = std::fs::read_to_string(&cfg_path)?;
    std::fs::write(&cfg_path, merge_fragment(&base_cfg, fragment))?;
    kb.read(&["make", "-s", &o, "olddefconfig"])
        .context("make olddefconfig")?;
    let final_cfg = std::fs::read_to_string(&cfg_path)?;
    check_fragment(fragment, &final_cfg)?;
    println!(
        "kernel: all {} fragment options present in the final .config",
        fragment.len()
    );
    Ok(())
}

/// Configure (no build) the kernel source with `fragment_text` in a scratch folder and check the
/// fragment: what the image-checks stage uses to see a real Kconfig drop an option.
pub fn check_config_only(
    spec: &KernelSpec,
    source: &Path,
    source_sha: &Sha256,
    fragment_text: &str,
    tools: &ToolsRoot,
) -> Result<()> {
    let fragment = parse_fragment(fragment_text)?;
    if let Some(release) = &spec.prebuilt_release {
        // Debian's build: its config is final; the fragment is checked in it as is.
        let (_, config, _) = prebuilt_members(spec, release);
        let cfg = crate::archive::with_deb_member(source, &config, |r| {
            let mut s = String::new();
            r.read_to_string(&mut s)?;
            Ok(s)
        })?;
        return check_fragment(&fragment, &cfg)
            .with_context(|| format!("the fragment against {config} of {}", spec.source));
    }
    let src = unpack_source(spec, source, source_sha)?;
    // Under target/: the tools root sees the checkout and target/ only.
    std::fs::create_dir_all(kernel_root())?;
    let scratch = tempfile::tempdir_in(kernel_root())?;
    let kb = Kbuild::new(spec, &src, 0, tools);
    configure(&kb, spec, scratch.path(), &fragment)
}

/// The lock of one key's cache entry (its folder, its temporary folder), held while it is made.
fn lock_key(key: &Sha256) -> Result<nix::fcntl::Flock<std::fs::File>> {
    crate::paths::lock_exclusive(&outputs_root()?.join(format!(".{}.lock", key.short())))
}

/// A cached build, if its files still hash to what its record says.
fn load_cached(dir: &Path, key: &Sha256) -> Result<Option<KernelOut>> {
    let rec = dir.join("kernel.json");
    let Ok(bytes) = std::fs::read(&rec) else {
        return Ok(None);
    };
    let mut k: KernelOut =
        serde_json::from_slice(&bytes).with_context(|| rec.display().to_string())?;
    k.dir = dir.to_path_buf();
    k.reused = true;
    if k.key != *key
        || Sha256::of_file_memo(&k.image()).ok() != Some(k.image_sha256)
        || Sha256::of_file_memo(&k.config()).ok() != Some(k.config_sha256)
        || k.dtb()
            .map(|p| Sha256::of_file_memo(&p).ok())
            .unwrap_or(k.dtb_sha256)
            != k.dtb_sha256
    {
        println!(
            "kernel: cached build {} does not verify; rebuilding",
            key.short()
        );
        return Ok(None);
    }
    Ok(Some(k))
}

/// A kernel's outputs made in `tmp` become the cache entry `out_dir`: its `kernel.json`
/// written, then the folder renamed into place (an older entry of the same key removed first).
fn publish(tmp: &Path, out_dir: &Path, out: &KernelOut) -> Result<()> {
    std::fs::write(tmp.join("kernel.json"), serde_json::to_vec_pretty(out)?)
        .with_context(|| format!("writing {}", tmp.join("kernel.json").display()))?;
    if out_dir.exists() {
        std::fs::remove_dir_all(out_dir)
            .with_context(|| format!("removing {}", out_dir.display()))?;
    }
    std::fs::rename(tmp, out_dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), out_dir.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRAG: &str = "# comment\n# CONFIG_MODULES is not set\nCONFIG_EROFS_FS=y\nCONFIG_LOCALVERSION=\"-kiln\"\n";

    #[test]
    fn fragment_parses() {
        let f = parse_fragment(FRAG).unwrap();
        assert_eq!(f.len(), 3);
        assert_eq!(f[0].line(), "# CONFIG_MODULES is not set");
        assert_eq!(f[2].line(), "CONFIG_LOCALVERSION=\"-kiln\"");
        assert!(parse_fragment("EROFS_FS=y\n").is_err());
    }

    #[test]
    fn fragment_check_passes_when_every_option_holds() {
        let cfg = "CONFIG_64BIT=y\n# CONFIG_MODULES is not set\nCONFIG_EROFS_FS=y\nCONFIG_LOCALVERSION=\"-kiln\"\n";
        check_fragment(&parse_fragment(FRAG).unwrap(), cfg).unwrap();
    }

    #[test]
    fn dropped_option_is_named() {
        // What olddefconfig leaves when MISC_FILESYSTEMS is off: erofs silently gone.
        let cfg = "# CONFIG_MISC_FILESYSTEMS is not set\nCONFIG_LOCALVERSION=\"-kiln\"\nCONFIG_MODULES=y\n";
        let err = check_fragment(&parse_fragment(FRAG).unwrap(), cfg)
            .unwrap_err()
            .to_string();
        assert!(err.contains("CONFIG_EROFS_FS=y wanted"), "{err}");
        assert!(
            err.contains("# CONFIG_MODULES is not set wanted, final .config: CONFIG_MODULES=y"),
            "{err}"
        );
        assert!(err.contains("2 fragment option(s)"), "{err}");
    }

    #[test]
    fn fake_option_cannot_be_satisfied() {
        let f = parse_fragment("CONFIG_KILN_DOES_NOT_EXIST=y\n").unwrap();
        let base = "CONFIG_64BIT=y\n";
        let merged = merge_fragment(base, &f);
        assert!(merged.contains("CONFIG_KILN_DOES_NOT_EXIST=y"));
        // olddefconfig drops unknown symbols; the final .config lacks it.
        let err = check_fragment(&f, base).unwrap_err().to_string();
        assert!(
            err.contains("CONFIG_KILN_DOES_NOT_EXIST=y wanted") && err.contains("absent"),
            "{err}"
        );
    }

    #[test]
    fn merge_replaces_base_lines() {
        let base = "CONFIG_A=y\n# CONFIG_EROFS_FS is not set\nCONFIG_MODULES=y\n";
        let m = merge_fragment(base, &parse_fragment(FRAG).unwrap());
        assert_eq!(
            m,
            "CONFIG_A=y\n# CONFIG_MODULES is not set\nCONFIG_EROFS_FS=y\nCONFIG_LOCALVERSION=\"-kiln\"\n"
        );
    }

    /// The shipped fragments parse, and every line is an option (nothing silently ignored).
    #[test]
    fn shipped_fragments_parse() {
        for f in ["qemu-virt.config", "rock-5b-vendor.config"] {
            let p = crate::paths::project_root().join("kernel-config").join(f);
            let text = std::fs::read_to_string(&p).unwrap();
            let opts = parse_fragment(&text).unwrap();
            assert!(opts.len() > 5, "{f}");
        }
    }
}
