//! Deterministic writers and read-only readers of everything that goes on the disk image: the GPT
//! and its assembly ([`gpt`], [`assemble`]), the FAT boot partition ([`fat`]), the initramfs
//! ([`cpio`]), the models partition ([`erofs`]) and the data partition ([`ext4`]).
//!
//! Invariants: the same inputs give the same bytes (no clock, host id, umask, locale or directory
//! order reaches an output); every output appears under its final name only when complete (temp
//! file in the same folder + fsync + rename); images are written sparse.

// The caller is the image pipeline (issue 4, branch `image`); until it lands, parts of this API
// have no caller in the binary yet.
#![allow(dead_code)]

pub mod cpio;
pub mod erofs;
pub mod ext4;
pub mod fat;
pub mod gpt;
pub mod verity;

pub use crate::atomic::AtomicOut;
#[allow(unused_imports)] // the image pipeline calls `disk::assemble`
pub use gpt::assemble;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::str::FromStr;

/// Bytes per logical sector (LBA) of every image kiln writes.
pub const SECTOR: u64 = 512;

/// Granularity of holes in sparse outputs (and of bmap ranges).
pub const BLOCK: u64 = 4096;

/// A GUID as GPT stores it on disk: the first three fields little-endian ("mixed-endian").
/// `Display` and `FromStr` use the usual text form (`c12a7328-f81f-11d2-ba4b-00a0c93ec93b`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Guid(pub [u8; 16]);

impl Guid {
    /// From the big-endian (RFC 4122 / text-order) bytes, the order ext4 and erofs store a UUID in.
    pub fn from_rfc_bytes(b: [u8; 16]) -> Guid {
        let mut g = b;
        g[0..4].reverse();
        g[4..6].reverse();
        g[6..8].reverse();
        Guid(g)
    }

    /// The big-endian (RFC 4122 / text-order) bytes.
    pub fn to_rfc_bytes(self) -> [u8; 16] {
        let mut b = self.0;
        b[0..4].reverse();
        b[4..6].reverse();
        b[6..8].reverse();
        b
    }
}

impl fmt::Display for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.to_rfc_bytes();
        for (i, x) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{x:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Guid({self})")
    }
}

impl FromStr for Guid {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Guid> {
        let parts: Vec<&str> = s.split('-').collect();
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        if lens != [8, 4, 4, 4, 12] {
            bail!("`{s}` is not a GUID (want 8-4-4-4-12 hex digits)");
        }
        let hex: String = parts.concat();
        let mut b = [0u8; 16];
        for (i, byte) in b.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .with_context(|| format!("`{s}` is not a GUID (bad hex digit)"))?;
        }
        Ok(Guid::from_rfc_bytes(b))
    }
}

impl serde::Serialize for Guid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Guid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Guid, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

fn seed_digest(seed: &str, label: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"kiln-disk-id\0");
    h.update(seed.as_bytes());
    h.update([0u8]);
    h.update(label.as_bytes());
    h.finalize().into()
}

/// A GUID derived from `seed` (board + commit) and a role `label` ("disk", "boot", "models-fs",
/// …): the first 16 bytes of a sha256, with the RFC 4122 variant and version-4 bits set, as
/// systemd-repart does for its seeded GUIDs.
pub fn guid_from_seed(seed: &str, label: &str) -> Guid {
    let d = seed_digest(seed, label);
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    Guid::from_rfc_bytes(b)
}

/// A 32-bit id (a FAT volume id) derived from `seed` and a role `label`.
pub fn u32_from_seed(seed: &str, label: &str) -> u32 {
    let d = seed_digest(seed, label);
    u32::from_le_bytes([d[0], d[1], d[2], d[3]])
}

static ZEROS: [u8; BLOCK as usize] = [0; BLOCK as usize];

/// A sparse copy of the image, so the boot writes its report into the copy, not the original.
pub fn copy_image(src: &Path, dst: &Path) -> Result<()> {
    let len = std::fs::metadata(src)
        .with_context(|| format!("reading {}", src.display()))?
        .len();
    let _ = std::fs::remove_file(dst);
    let f = std::fs::File::create(dst).with_context(|| format!("creating {}", dst.display()))?;
    f.set_len(len)?;
    copy_sparse(&f, 0, src)?;
    f.sync_all()?;
    Ok(())
}

/// Copy `src` into `dst` at byte `offset`, skipping every [`BLOCK`]-aligned (in `dst`) piece that
/// is all zeros, so holes stay holes. `dst` must read as zeros there already (fresh `set_len`).
/// Returns the number of bytes of `src`.
pub fn copy_sparse(dst: &File, offset: u64, src: &Path) -> Result<u64> {
    let mut f = File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = offset;
    loop {
        let n =
            read_full(&mut f, &mut buf).with_context(|| format!("reading {}", src.display()))?;
        if n == 0 {
            break;
        }
        // Runs of non-zero blocks go out as one write.
        let mut run: Option<usize> = None;
        let mut i = 0usize;
        while i <= n {
            let end = if i < n {
                (i + (BLOCK - (pos + i as u64) % BLOCK) as usize).min(n)
            } else {
                n
            };
            // Slice equality is a memcmp, fast even in the unoptimised builds `cargo xtask` runs.
            let data = i < n && buf[i..end] != ZEROS[..end - i];
            match (data, run) {
                (true, None) => run = Some(i),
                (false, Some(start)) => {
                    let abs = pos + start as u64;
                    dst.write_all_at(&buf[start..i], abs)
                        .with_context(|| format!("writing {} at byte {abs}", src.display()))?;
                    run = None;
                }
                _ => {}
            }
            if i == n {
                break;
            }
            i = end;
        }
        pos += n as u64;
    }
    Ok(pos - offset)
}

/// Read until `buf` is full or EOF.
fn read_full(f: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Run a filesystem tool (`argv`) under the pinned environment (`TZ=UTC`, `LC_ALL=C`,
/// `SOURCE_DATE_EPOCH`, plus `env`): inside the tools root when given (the image build always
/// gives it), else the host's (tests of our flags, over temporary folders the root cannot see).
pub(crate) fn run_fs_tool(
    tools: Option<&crate::tools_root::ToolsRoot>,
    epoch: i64,
    env: &[(&'static str, String)],
    argv: &[String],
) -> Result<()> {
    let mut all: Vec<(&'static str, String)> = vec![
        ("TZ", "UTC".into()),
        ("LC_ALL", "C".into()),
        ("SOURCE_DATE_EPOCH", epoch.to_string()),
    ];
    all.extend(env.iter().cloned());
    match tools {
        Some(t) => {
            let a: Vec<&str> = argv.iter().map(|s| s.as_str()).collect();
            t.read(std::path::Path::new("/"), &all, &a).map(|_| ())
        }
        None => {
            let sh = pinned_shell(epoch)?;
            for (k, v) in env {
                sh.set_var(k, v);
            }
            let (prog, args) = argv.split_first().context("no program")?;
            xshell::cmd!(sh, "{prog} {args...}").quiet().run()?;
            Ok(())
        }
    }
}

/// The environment every filesystem tool runs under: no locale, clock zone or umask of the host.
pub(crate) fn pinned_shell(epoch: i64) -> Result<xshell::Shell> {
    let sh = xshell::Shell::new()?;
    sh.set_var("TZ", "UTC");
    sh.set_var("LC_ALL", "C");
    sh.set_var("SOURCE_DATE_EPOCH", epoch.to_string());
    Ok(sh)
}

#[cfg(test)]
mod tests;
