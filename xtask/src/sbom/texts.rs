//! The licence texts the card carries under `kiln/licenses/` on the boot partition, beside the
//! SBOMs that name the licences: the texts themselves, as the sources ship them.
//!
//! - `deb/<package>/copyright`: each Debian input's copyright file, from its .deb as it is
//!   ([`super::dep5::copyright_of_deb`]); a package that has none is named in the README.
//! - `kernel/…`: the kernel source's `COPYING` and the texts it points at
//!   ([`crate::kernel::LICENCE_FILES`]).
//! - `crates/<name>-<version>/…`: the `LICENSE*`, `LICENCE*`, `COPYING*`, `NOTICE*`,
//!   `COPYRIGHT*` and `UNLICENSE*` files at the top of each crate's source folder (cargo
//!   metadata's `manifest_path`), for the crates compiled into `kiln` and the NPU stand-in.
//! - `README`: what is where, what is missing, and that models carry their licence in their
//!   GGUF metadata.
//!
//! Texts are written as found, not deduplicated: they are a few MiB at most on a 64 MiB partition.

use super::crates::Crate;
use anyhow::{Context, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where the texts go on the boot partition.
pub const DIR: &str = "kiln/licenses";

/// This module's source: part of the key of the image step that gathers the texts.
pub const SOURCE: &str = include_str!("texts.rs");

/// Whether a file at the top of a crate's folder is a licence text.
pub fn is_licence_file(name: &str) -> bool {
    let up = name.to_ascii_uppercase();
    [
        "LICENSE",
        "LICENCE",
        "COPYING",
        "NOTICE",
        "COPYRIGHT",
        "UNLICENSE",
    ]
    .iter()
    .any(|p| up.starts_with(p))
}

/// The licence files of the crates.
pub struct CrateTexts {
    /// (card path, file on this machine), sorted by card path.
    pub files: Vec<(String, PathBuf)>,
    /// The crates in which none was found (`name version`).
    pub without: Vec<String>,
}

/// The licence files of each crate ([`is_licence_file`], at the top of its source folder).
pub fn crate_files(crates: &[Crate]) -> Result<CrateTexts> {
    let mut files = Vec::new();
    let mut without = Vec::new();
    for c in crates {
        let mut found = Vec::new();
        if let Some(dir) = &c.dir {
            for e in std::fs::read_dir(dir).with_context(|| {
                format!(
                    "reading crate {} {} at {}",
                    c.name,
                    c.version,
                    dir.display()
                )
            })? {
                let e = e.with_context(|| format!("listing {}", dir.display()))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if is_licence_file(&name) && e.file_type()?.is_file() {
                    found.push((
                        format!("{DIR}/crates/{}-{}/{name}", c.name, c.version),
                        e.path(),
                    ));
                }
            }
        }
        if found.is_empty() {
            without.push(format!("{} {}", c.name, c.version));
        }
        files.extend(found);
    }
    files.sort();
    // FAT folds case: two names that differ only in it would be one file on the card.
    let mut folded = std::collections::BTreeMap::new();
    for (card, file) in &files {
        if let Some(other) = folded.insert(card.to_ascii_lowercase(), file) {
            anyhow::bail!(
                "{} and {} differ only in case, which the FAT boot partition cannot hold apart",
                other.display(),
                file.display()
            );
        }
    }
    Ok(CrateTexts { files, without })
}

/// What the texts were gathered from, for the README.
pub struct Gathered<'a> {
    /// Debian packages: (input name, `None` when its copyright file is carried, else why not).
    pub debs: Vec<(&'a str, Option<String>)>,
    /// The kernel's version, when it is built from source and its texts are carried.
    pub kernel: Option<&'a str>,
    /// U-Boot's version, when the card's boot loader is built from its source here.
    pub u_boot: Option<&'a str>,
    /// The input that is the DDR init blob's licence notice, when the boot loader carries one.
    pub tpl_licence: Option<&'a str>,
    pub crates_with: usize,
    pub crates_without: &'a [String],
    /// kiln's own licence (the workspace's Cargo.toml `license`).
    pub kiln: &'a str,
}

/// `kiln/licenses/README`.
pub fn readme(g: &Gathered) -> String {
    let mut r = String::from(
        "Licence texts of what this card holds (the SBOMs in kiln/sbom/ name the licences).\n\n",
    );
    r.push_str(&format!(
        "kiln (/usr/bin/kiln and the NPU stand-in, built from this commit): {}, as its \
         Cargo.toml declares (the repository holds no licence file).\n\n",
        g.kiln
    ));
    r.push_str("deb/<package>/copyright: the Debian copyright file of each package in the image, as the .deb holds it.\n");
    for (name, why) in &g.debs {
        if let Some(why) = why {
            r.push_str(&format!(
                "  {name}: none carried: {why} (such a package's /usr/share/doc folder is a link \
                 to another package's, which is not in the image)\n"
            ));
        }
    }
    if let Some(k) = g.kernel {
        r.push_str(&format!(
            "\nkernel/: the Linux kernel {k} (built from source): COPYING, \
             LICENSES/preferred/GPL-2.0 and LICENSES/exceptions/Linux-syscall-note of its \
             source tree.\n"
        ));
    }
    if let Some(v) = g.u_boot {
        r.push_str(&format!(
            "\nu-boot/Licenses/: the licence texts of U-Boot {v} (built from source for the \
             loader at sector 64 and the SPI image), its source tree's Licenses/ folder; U-Boot \
             is GPL-2.0+, its files name their licence by SPDX identifier (Licenses/README). Its \
             loader also holds TF-A's BL31 (deb/arm-trusted-firmware/copyright).\n"
        ));
    }
    if let Some(n) = g.tpl_licence {
        r.push_str(&format!(
            "\nrkbin/LICENSE: Rockchip's licence for the DDR init blob inside the loader (the \
             pinned input {n}, from rockchip-linux/rkbin at the blob's commit).\n"
        ));
    }
    r.push_str(&format!(
        "\ncrates/<name>-<version>/: the LICENSE*, LICENCE*, COPYING*, NOTICE*, COPYRIGHT* and \
         UNLICENSE* files of the {} Rust crates compiled into kiln (and the NPU stand-in) that \
         have them.\n",
        g.crates_with
    ));
    if !g.crates_without.is_empty() {
        r.push_str(
            "  No such file in the crate's source (its Cargo.toml licence is in the SBOMs):\n",
        );
        for c in g.crates_without {
            r.push_str(&format!("  {c}\n"));
        }
    }
    r.push_str(
        "\nModels (the models partition) carry their licence in their GGUF metadata \
         (general.license, general.license.name, general.license.link), which the SBOMs \
         record.\n",
    );
    r
}

/// The texts as one tar (the image step's product), sorted, every header fixed.
pub fn write_tar(out: &Path, files: &[(String, Vec<u8>)]) -> Result<()> {
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(f));
    for (path, bytes) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, path, bytes.as_slice())
            .with_context(|| format!("adding {path} to {}", out.display()))?;
    }
    b.into_inner()
        .and_then(|mut w| std::io::Write::flush(&mut w))
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// The files of a tar written by [`write_tar`], in order.
pub fn read_tar(path: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut a = tar::Archive::new(std::io::BufReader::new(f));
    let mut out = Vec::new();
    for e in a
        .entries()
        .with_context(|| format!("reading {}", path.display()))?
    {
        let mut e = e.with_context(|| format!("reading {}", path.display()))?;
        let name = e
            .path()
            .with_context(|| format!("an entry of {}", path.display()))?
            .to_string_lossy()
            .into_owned();
        let mut bytes = Vec::new();
        e.read_to_end(&mut bytes)
            .with_context(|| format!("{name} in {}", path.display()))?;
        out.push((name, bytes));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn licence_file_names() {
        for n in [
            "LICENSE",
            "LICENSE-MIT",
            "license-apache",
            "COPYING",
            "NOTICE",
            "LICENCE.txt",
            "UNLICENSE",
            "COPYRIGHT",
        ] {
            assert!(is_licence_file(n), "{n}");
        }
        for n in ["README.md", "Cargo.toml", "src", "CHANGELOG.md"] {
            assert!(!is_licence_file(n), "{n}");
        }
    }

    /// A crate's licence files go under its name and version; a crate without any is listed.
    #[test]
    fn crate_files_and_the_tar_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        std::fs::create_dir_all(a.join("LICENSES")).unwrap();
        std::fs::write(a.join("LICENSE-MIT"), "mit").unwrap();
        std::fs::write(a.join("Cargo.toml"), "").unwrap();
        let b = d.path().join("b");
        std::fs::create_dir_all(&b).unwrap();
        let c = |name: &str, dir: &Path| Crate {
            name: name.into(),
            version: "1.0.0".into(),
            source: "crates.io".into(),
            crate_sha256: None,
            license: None,
            linked: true,
            roots: vec![],
            dir: Some(dir.to_path_buf()),
        };
        let CrateTexts { files, without } = crate_files(&[c("a", &a), c("b", &b)]).unwrap();
        assert_eq!(
            files,
            [(
                "kiln/licenses/crates/a-1.0.0/LICENSE-MIT".to_string(),
                a.join("LICENSE-MIT")
            )]
        );
        assert_eq!(without, ["b 1.0.0"]);
        let t = d.path().join("t.tar");
        let entries = vec![
            ("kiln/licenses/README".to_string(), b"r".to_vec()),
            ("kiln/licenses/deb/x/copyright".to_string(), vec![0xff, 0]),
        ];
        write_tar(&t, &entries).unwrap();
        assert_eq!(read_tar(&t).unwrap(), entries);
        let first = std::fs::read(&t).unwrap();
        write_tar(&t, &entries).unwrap();
        assert_eq!(std::fs::read(&t).unwrap(), first, "deterministic");
    }
}
