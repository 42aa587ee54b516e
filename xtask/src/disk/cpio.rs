//! The initramfs: a cpio "newc" archive (through the `cpio` crate) with sorted paths, uid/gid 0,
//! one mtime, inode numbers by position, gzip-compressed (flate2's pure-Rust backend) at a fixed
//! level with no name and mtime 0 in the gzip header.

use super::AtomicOut;
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::Path;

/// What one archive entry is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    File(Vec<u8>),
    Dir,
    /// The link's target, stored as the entry's data.
    Symlink(String),
}

/// One archive entry. `path` is relative to the root (`bin/busybox`; a leading `/` or `./` is
/// dropped); `mode` holds only permission bits (`0o755`), the type comes from `kind`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpioEntry {
    pub path: String,
    pub mode: u32,
    pub kind: EntryKind,
}

impl CpioEntry {
    pub fn file(path: &str, mode: u32, data: Vec<u8>) -> CpioEntry {
        CpioEntry {
            path: path.into(),
            mode,
            kind: EntryKind::File(data),
        }
    }
    pub fn dir(path: &str, mode: u32) -> CpioEntry {
        CpioEntry {
            path: path.into(),
            mode,
            kind: EntryKind::Dir,
        }
    }
    pub fn symlink(path: &str, target: &str) -> CpioEntry {
        CpioEntry {
            path: path.into(),
            mode: 0o777,
            kind: EntryKind::Symlink(target.into()),
        }
    }
}

/// gzip level of the initramfs: fixed, so the bytes do not depend on a default.
pub const GZIP_LEVEL: u32 = 9;

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

/// One archive member after normalisation.
struct Member<'a> {
    mode: u32,
    kind: &'a EntryKind,
    /// Added because a path needs it, not named in the list.
    implied: bool,
}

/// Normalised path → member, with the folders that paths imply but the list does not name added
/// (mode 0755): the kernel's unpacker creates no missing parents.
fn normalise(entries: &[CpioEntry]) -> Result<BTreeMap<String, Member<'_>>> {
    static DIR: EntryKind = EntryKind::Dir;
    let mut out: BTreeMap<String, Member<'_>> = BTreeMap::new();
    for e in entries {
        ensure!(
            e.mode & !0o7777 == 0,
            "cpio entry `{}`: mode {:o} has bits beyond the permissions (the kind gives the type)",
            e.path,
            e.mode
        );
        let parts: Vec<&str> = e
            .path
            .split('/')
            .filter(|s| !s.is_empty() && *s != ".")
            .collect();
        ensure!(!parts.is_empty(), "cpio entry `{}` names the root", e.path);
        ensure!(
            parts.iter().all(|p| *p != ".."),
            "cpio entry `{}` has a `..` component",
            e.path
        );
        for i in 1..parts.len() {
            let dir = parts[..i].join("/");
            match out.get(&dir) {
                Some(m) if matches!(m.kind, EntryKind::Dir) => {}
                Some(_) => bail!("`{dir}` is a parent of `{}` but not a folder", e.path),
                None => {
                    out.insert(
                        dir,
                        Member {
                            mode: 0o755,
                            kind: &DIR,
                            implied: true,
                        },
                    );
                }
            }
        }
        let path = parts.join("/");
        let member = Member {
            mode: e.mode,
            kind: &e.kind,
            implied: false,
        };
        match out.get(&path) {
            None => {}
            Some(m) if m.implied && matches!(e.kind, EntryKind::Dir) => {}
            Some(m) if m.implied => bail!("`{path}` is a parent folder of another entry"),
            Some(_) => bail!("cpio entry `{path}` appears twice"),
        }
        out.insert(path, member);
    }
    Ok(out)
}

/// Write `entries` as a gzip-compressed newc archive to `out` (atomically). Every entry gets uid
/// and gid 0 and mtime `epoch`; entries are sorted by path (parents first); inode numbers count up
/// from 1 in that order; folders have nlink 2 + their subfolders, everything else 1.
pub fn write_newc_gz(out: &Path, entries: &[CpioEntry], epoch: u32) -> Result<()> {
    let tree = normalise(entries)?;
    let mut subdirs: BTreeMap<&str, u32> = BTreeMap::new();
    for (path, m) in &tree {
        if matches!(m.kind, EntryKind::Dir) {
            if let Some((parent, _)) = path.rsplit_once('/') {
                *subdirs.entry(parent).or_default() += 1;
            }
        }
    }

    let tmp = AtomicOut::new(out)?;
    let f = tmp.create()?;
    let mut w = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(BufWriter::new(f), flate2::Compression::new(GZIP_LEVEL));
    for (ino, (path, m)) in tree.iter().enumerate() {
        let (type_bits, nlink, data): (u32, u32, &[u8]) = match m.kind {
            EntryKind::File(d) => (S_IFREG, 1, d),
            EntryKind::Dir => (
                S_IFDIR,
                2 + subdirs.get(path.as_str()).copied().unwrap_or(0),
                &[],
            ),
            EntryKind::Symlink(t) => (S_IFLNK, 1, t.as_bytes()),
        };
        let size = u32::try_from(data.len())
            .with_context(|| format!("cpio entry `{path}` is larger than newc's 4 GiB"))?;
        let mut writer = ::cpio::newc::Builder::new(path)
            .ino(ino as u32 + 1)
            .mode(type_bits | m.mode)
            .uid(0)
            .gid(0)
            .nlink(nlink)
            .mtime(epoch)
            .write(&mut w, size);
        writer
            .write_all(data)
            .with_context(|| format!("writing cpio entry `{path}`"))?;
        writer
            .finish()
            .with_context(|| format!("finishing cpio entry `{path}`"))?;
    }
    ::cpio::newc::trailer(&mut w).context("writing the cpio trailer")?;
    let buf = w
        .finish()
        .with_context(|| format!("finishing gzip of {}", tmp.path().display()))?;
    buf.into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("writing {}", tmp.path().display()))?;
    tmp.commit()
}
