//! The boot loader, built from pinned public inputs: U-Boot's source (Debian's orig tarball),
//! one of its defconfigs, TF-A's BL31 (an ELF inside a pinned Debian package) and Rockchip's DDR
//! init blob as `ROCKCHIP_TPL` (a url input). `make <defconfig>` then `make` with `BL31=` and
//! `ROCKCHIP_TPL=`, inside the tools root ([`crate::tools_root`]), with `SOURCE_DATE_EPOCH` fixed
//! (U-Boot's version string and mkimage's FIT timestamps take it) so two builds give the same
//! bytes. binman writes `u-boot-rockchip.bin` (for LBA 64 of an SD/eMMC) and
//! `u-boot-rockchip-spi.bin` (for the SPI NOR). Built in `target/kiln/u-boot/`, kept in
//! `~/.cache/kiln/u-boot/<key>` by the hash of every input, like the kernel.

use crate::pins::Sha256;
use crate::tools_root::ToolsRoot;
use anyhow::{bail, ensure, Context, Result};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `[bootloader]` of a board recipe.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct BootloaderSpec {
    /// The pinned input holding U-Boot's source (a `.tar.*` with one top folder).
    pub source: String,
    /// The defconfig (`rock5b-rk3588_defconfig`).
    pub defconfig: String,
    /// The pinned Debian package holding BL31, and the ELF's path inside it.
    pub bl31: String,
    pub bl31_in_deb: String,
    /// The pinned input that is the DDR init blob (`ROCKCHIP_TPL`).
    pub tpl: String,
    /// The pinned input that is the blob's licence notice (it must travel with the blob):
    /// the card carries it in `kiln/licenses/`.
    #[serde(default)]
    pub tpl_licence: Option<String>,
    pub cross_compile: String,
}

/// The products binman writes, the first for the SD/eMMC image (LBA 64), the second for SPI.
pub const PRODUCTS: &[&str] = &["u-boot-rockchip.bin", "u-boot-rockchip-spi.bin"];

/// Where the SD/eMMC product goes: the RK3588 boot ROM reads its header at sector 64.
pub const LOADER_LBA: u64 = 64;

/// The inputs of one build: each file as resolved in the cache, with its pinned sha256.
pub struct Inputs<'a> {
    pub source: (&'a Path, Sha256),
    pub bl31_deb: (&'a Path, Sha256),
    pub tpl: (&'a Path, Sha256),
}

/// A finished boot loader build.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct BootloaderOut {
    pub key: Sha256,
    /// U-Boot's version string (`U-Boot 2025.01 (…)`), as it prints it at boot.
    pub version: String,
    pub defconfig: String,
    /// The sha256 of each product, in [`PRODUCTS`] order.
    pub products: Vec<(String, Sha256)>,
    /// The BL31 ELF that went in (its sha256 inside the pinned package).
    pub bl31_sha256: Sha256,
    pub build_timestamp: i64,
    pub toolchain: String,
    /// How long the build took when it ran (not part of the identity).
    pub build_seconds: f64,
    #[serde(skip)]
    pub dir: PathBuf,
    #[serde(skip)]
    pub reused: bool,
}

impl BootloaderOut {
    pub fn product(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    /// The BL31 ELF that went into the build.
    pub fn bl31(&self) -> PathBuf {
        self.dir.join("bl31.elf")
    }
    pub fn sha256_of(&self, name: &str) -> Option<Sha256> {
        self.products
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, h)| *h)
    }
}

/// Where the source is unpacked and built: `target/kiln/u-boot/`.
fn root() -> PathBuf {
    crate::paths::target_dir().join("kiln/u-boot")
}

/// Where finished builds are kept, by key: the user's cache (`~/.cache/kiln/u-boot/<key>`), as
/// the kernel's are, so that a new checkout of the same inputs (the key holds every one, the
/// recipe's commit time among them) does not build U-Boot again; an entry is re-hashed before
/// it is used, and the `u-boot` stage still builds it once more from scratch and compares.
fn outputs_root() -> Result<PathBuf> {
    Ok(crate::paths::user_cache()?.join("u-boot"))
}

/// The key of a build: every input that can change its bytes.
pub fn build_key(
    spec: &BootloaderSpec,
    inputs: &Inputs,
    epoch: i64,
    tools_root: &Sha256,
) -> Sha256 {
    let text = format!(
        "kiln-u-boot-v2\nsource={}\ndefconfig={}\nbl31={} {}\ntpl={}\ncross={}\nepoch={epoch}\n\
         tools_root={tools_root}\n",
        inputs.source.1,
        spec.defconfig,
        inputs.bl31_deb.1,
        spec.bl31_in_deb,
        inputs.tpl.1,
        spec.cross_compile
    );
    Sha256::of_bytes(text.as_bytes())
}

/// Unpack the source tarball once into `target/kiln/u-boot/src-<sha>/` (inside the tools root:
/// its tar and bzip2) and return the tree (the folder holding `Makefile` and `Kconfig`).
fn unpack_source(tools: &ToolsRoot, file: &Path, sha: &Sha256) -> Result<PathBuf> {
    let dir = root().join(format!("src-{}", sha.short()));
    let done = dir.join(".kiln-unpacked");
    if !done.exists() {
        let t = Instant::now();
        println!("u-boot: unpacking source {} ...", file.display());
        let tmp = root().join(format!(".src-{}.tmp", sha.short()));
        for d in [&dir, &tmp] {
            if d.exists() {
                std::fs::remove_dir_all(d).with_context(|| format!("removing {}", d.display()))?;
            }
        }
        std::fs::create_dir_all(&tmp)?;
        // The cache is outside what the root sees: the tarball goes in through stdin, its
        // decompressor named by its magic.
        let mut head = [0u8; 3];
        std::fs::File::open(file)
            .and_then(|mut f| f.read_exact(&mut head))
            .with_context(|| format!("reading {}", file.display()))?;
        let flag = match &head {
            b"BZh" => "-xjf",
            [0x1f, 0x8b, _] => "-xzf",
            [0xfd, b'7', b'z'] => "-xJf",
            _ => "-xf",
        };
        // Owned by whoever builds (a user namespace maps the tarball's owners to subordinate ids
        // the user could not remove).
        let mut c = tools.command(
            &tmp,
            &[],
            &[
                "tar".into(),
                "--no-same-owner".into(),
                flag.into(),
                "-".into(),
            ],
        );
        c.stdin(std::fs::File::open(file)?);
        let out = c
            .output()
            .with_context(|| format!("unpacking {}", file.display()))?;
        ensure!(
            out.status.success(),
            "unpacking {} in the tools root failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        std::fs::rename(&tmp, &dir)?;
        std::fs::write(&done, b"")?;
        println!("u-boot: unpacked in {:.1} s", t.elapsed().as_secs_f64());
    }
    for e in std::fs::read_dir(&dir)? {
        let p = e?.path();
        if p.join("Makefile").exists() && p.join("Kconfig").exists() && p.join("configs").is_dir() {
            return Ok(p);
        }
    }
    bail!(
        "no U-Boot tree (Makefile, Kconfig, configs/) in {}",
        dir.display()
    )
}

/// U-Boot's licence texts: every file of its source's `Licenses/` folder (the SPDX identifiers
/// of its files name them; `README` says how), as (path below `Licenses/`, bytes), sorted.
pub fn licence_texts(
    tools: &ToolsRoot,
    source: &Path,
    source_sha: &Sha256,
) -> Result<Vec<(String, Vec<u8>)>> {
    let dir = unpack_source(tools, source, source_sha)?.join("Licenses");
    let mut out = Vec::new();
    let mut todo = vec![dir.clone()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(&dir)?.to_string_lossy().into_owned();
                out.push((
                    rel,
                    std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?,
                ));
            }
        }
    }
    ensure!(
        out.iter().any(|(f, _)| f == "gpl-2.0.txt"),
        "U-Boot's source {} has no Licenses/gpl-2.0.txt",
        source.display()
    );
    out.sort();
    Ok(out)
}

/// Build (or reuse) the boot loader. `epoch` is its `SOURCE_DATE_EPOCH`; `fresh` ignores a cached
/// build (the reproducibility test builds twice).
pub fn build(
    spec: &BootloaderSpec,
    inputs: &Inputs,
    epoch: i64,
    tools: &ToolsRoot,
    fresh: bool,
) -> Result<BootloaderOut> {
    let key = build_key(spec, inputs, epoch, &tools.key);
    let out_dir = outputs_root()?.join(key.short());
    if !fresh {
        if let Some(b) = load_cached(&out_dir, &key)? {
            println!(
                "u-boot: reused cached build {} ({}, u-boot-rockchip.bin sha256 {})",
                key.short(),
                b.version,
                b.products[0].1.short()
            );
            return Ok(b);
        }
    }
    let t0 = Instant::now();
    let src = unpack_source(tools, inputs.source.0, &inputs.source.1)?;
    ensure!(
        src.join("configs").join(&spec.defconfig).exists(),
        "U-Boot source {} has no configs/{}",
        inputs.source.0.display(),
        spec.defconfig
    );
    let gcc = format!("{}gcc", spec.cross_compile);
    let toolchain = tools
        .read(&src, &[], &[&gcc, "--version"])?
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    // One folder per key, started clean: never an incremental build over other objects.
    let bdir = root().join(format!("build-{}", key.short()));
    if bdir.exists() {
        std::fs::remove_dir_all(&bdir).with_context(|| format!("removing {}", bdir.display()))?;
    }
    std::fs::create_dir_all(&bdir)?;
    // BL31 and the TPL are copied next to the objects, under fixed names: the root sees target/.
    let bl31 = bdir.join("bl31.elf");
    crate::archive::with_deb_member(inputs.bl31_deb.0, &spec.bl31_in_deb, |r| {
        let mut f = std::fs::File::create(&bl31)?;
        std::io::copy(r, &mut f)?;
        Ok(())
    })
    .with_context(|| {
        format!(
            "BL31 {} from {}",
            spec.bl31_in_deb,
            inputs.bl31_deb.0.display()
        )
    })?;
    let bl31_sha256 = Sha256::of_file(&bl31)?;
    let tpl = bdir.join("ddr-tpl.bin");
    std::fs::copy(inputs.tpl.0, &tpl)
        .with_context(|| format!("copying {}", inputs.tpl.0.display()))?;
    let env = env(spec, epoch);
    let o = format!("O={}", bdir.join("obj").display());
    println!("u-boot: make {}", spec.defconfig);
    tools
        .read(&src, &env, &["make", "-s", &o, &spec.defconfig])
        .with_context(|| format!("make {}", spec.defconfig))?;
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .to_string();
    println!(
        "u-boot: make -j{jobs} (BL31 sha256 {}; a few minutes on 2 cores)",
        bl31_sha256.short()
    );
    let argv: Vec<String> = vec![
        "make".into(),
        format!("-j{jobs}"),
        o.clone(),
        format!("BL31={}", bl31.display()),
        format!("ROCKCHIP_TPL={}", tpl.display()),
    ];
    crate::tools_root::run_with_progress(tools.command(&src, &env, &argv), "u-boot")
        .context("U-Boot build")?;
    let obj = bdir.join("obj");
    let version = version_string(&std::fs::read(obj.join(PRODUCTS[0]))?)
        .context("U-Boot's version string is not in u-boot-rockchip.bin")?;
    let secs = t0.elapsed().as_secs_f64();
    let tmp = outputs_root()?.join(format!(".{}.tmp{}", key.short(), std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut products = Vec::new();
    for p in PRODUCTS {
        let from = obj.join(p);
        std::fs::copy(&from, tmp.join(p))
            .with_context(|| format!("U-Boot's build wrote no {}", from.display()))?;
        products.push((p.to_string(), Sha256::of_file(&tmp.join(p))?));
    }
    std::fs::copy(obj.join(".config"), tmp.join("config"))?;
    // The BL31 that went in, for the checks that read it back out of the loader.
    std::fs::copy(&bl31, tmp.join("bl31.elf"))?;
    let out = BootloaderOut {
        key,
        version,
        defconfig: spec.defconfig.clone(),
        products,
        bl31_sha256,
        build_timestamp: epoch,
        toolchain,
        build_seconds: secs,
        dir: out_dir.clone(),
        reused: false,
    };
    std::fs::write(tmp.join("u-boot.json"), serde_json::to_vec_pretty(&out)?)?;
    if out_dir.exists() {
        std::fs::remove_dir_all(&out_dir)?;
    }
    std::fs::rename(&tmp, &out_dir)?;
    std::fs::remove_dir_all(&bdir).with_context(|| format!("removing {}", bdir.display()))?;
    println!(
        "u-boot: built {} in {secs:.0} s (u-boot-rockchip.bin {:.2} MiB, sha256 {})",
        out.version,
        std::fs::metadata(out.product(PRODUCTS[0]))?.len() as f64 / 1048576.0,
        out.products[0].1.short()
    );
    Ok(out)
}

/// U-Boot proper's banner as the loader carries it (`U-Boot 2025.01 (<SOURCE_DATE_EPOCH's date>)`),
/// not SPL's.
pub fn version_string(bytes: &[u8]) -> Option<String> {
    bytes.split(|b| *b == 0).find_map(|s| {
        let s = std::str::from_utf8(s).ok()?;
        let rest = s.strip_prefix("U-Boot ")?;
        (rest.starts_with("20") && rest.contains(" (")).then(|| s.to_string())
    })
}

fn env(spec: &BootloaderSpec, epoch: i64) -> Vec<(&'static str, String)> {
    vec![
        ("CROSS_COMPILE", spec.cross_compile.clone()),
        ("ARCH", "arm".into()),
        ("SOURCE_DATE_EPOCH", epoch.to_string()),
        ("KBUILD_BUILD_USER", "kiln".into()),
        ("KBUILD_BUILD_HOST", "kiln".into()),
        ("LC_ALL", "C".into()),
        ("TZ", "UTC".into()),
    ]
}

/// A cached build, if its files still hash to what its record says.
fn load_cached(dir: &Path, key: &Sha256) -> Result<Option<BootloaderOut>> {
    let rec = dir.join("u-boot.json");
    let Ok(bytes) = std::fs::read(&rec) else {
        return Ok(None);
    };
    let mut b: BootloaderOut =
        serde_json::from_slice(&bytes).with_context(|| rec.display().to_string())?;
    b.dir = dir.to_path_buf();
    b.reused = true;
    let ok = b.key == *key
        && Sha256::of_file_memo(&b.bl31()).ok() == Some(b.bl31_sha256)
        && b.products.len() == PRODUCTS.len()
        && b.products
            .iter()
            .all(|(n, h)| Sha256::of_file_memo(&dir.join(n)).ok() == Some(*h));
    if !ok {
        println!(
            "u-boot: cached build {} does not verify; rebuilding",
            key.short()
        );
        return Ok(None);
    }
    Ok(Some(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_u_boot_propers_banner_not_spls() {
        let b = b"x\0U-Boot SPL 2025.01 (Dec 04 2026 - 10:33:30 +0000)\0U-Boot 2025.01 (Dec 04 2026 - 10:33:30 +0000)\0";
        assert_eq!(
            version_string(b).as_deref(),
            Some("U-Boot 2025.01 (Dec 04 2026 - 10:33:30 +0000)")
        );
        assert_eq!(version_string(b"U-Boot SPL 2025.01 (x)\0"), None);
    }
}
