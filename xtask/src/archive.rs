//! Readers of the archives kiln's inputs come in: Debian packages (`ar` with a `data.tar.*`),
//! tar files, and their compressions (gzip, xz, zstd), chosen by magic bytes. Nothing here knows
//! what is inside.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::path::Path;

/// Open a possibly compressed tar (gzip, xz, zstd or plain, by magic bytes).
pub fn open_maybe_compressed(path: &Path) -> Result<Box<dyn Read>> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut magic = [0u8; 6];
    let n = f.read(&mut magic)?;
    let f = std::fs::File::open(path)?;
    let r = std::io::BufReader::new(f);
    decompressor(&magic[..n], r)
}

/// A decompressing reader chosen by the stream's first bytes.
pub fn decompressor<'a>(magic: &[u8], r: impl Read + 'a) -> Result<Box<dyn Read + 'a>> {
    Ok(if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::GzDecoder::new(r))
    } else if magic.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Box::new(xz2::read::XzDecoder::new_multi_decoder(r))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(zstd::stream::read::Decoder::new(r)?)
    } else {
        Box::new(r)
    })
}

/// Run `f` on the data tar of a .deb (ar archive: `data.tar.{xz,zst,gz}`).
pub fn with_data_tar<T>(
    deb: &Path,
    f: impl FnOnce(&mut tar::Archive<Box<dyn Read + '_>>) -> Result<T>,
) -> Result<T> {
    with_member_tar(deb, "data.tar", f)
}

/// Run `f` on the tar member of a .deb whose name starts with `prefix` (`data.tar`,
/// `control.tar`), decompressed by its magic.
fn with_member_tar<T>(
    deb: &Path,
    prefix: &str,
    f: impl FnOnce(&mut tar::Archive<Box<dyn Read + '_>>) -> Result<T>,
) -> Result<T> {
    let file = std::fs::File::open(deb).with_context(|| format!("opening {}", deb.display()))?;
    let mut ar = ar::Archive::new(file);
    while let Some(entry) = ar.next_entry() {
        let mut entry =
            entry.with_context(|| format!("reading the ar archive {}", deb.display()))?;
        let name = String::from_utf8_lossy(entry.header().identifier()).to_string();
        if !name.starts_with(prefix) {
            continue;
        }
        let mut head = Vec::with_capacity(6);
        (&mut entry).take(6).read_to_end(&mut head)?;
        let chained: Box<dyn Read + '_> = Box::new(std::io::Cursor::new(head.clone()).chain(entry));
        let dec = decompressor(&head, chained)?;
        let mut tar = tar::Archive::new(dec);
        return f(&mut tar).with_context(|| format!("{name} of {}", deb.display()));
    }
    bail!(
        "{} has no {prefix} member: not a Debian package",
        deb.display()
    )
}

/// A tar entry's path as the archive names it, without the leading `./` that dpkg-deb writes.
pub fn entry_path<R: Read>(e: &tar::Entry<'_, R>) -> Result<String> {
    Ok(e.path()?
        .to_string_lossy()
        .trim_start_matches("./")
        .to_string())
}

/// Run `f` on the contents of one member (`usr/src/…`) of a .deb's data.
pub fn with_deb_member<T>(
    deb: &Path,
    member: &str,
    f: impl FnOnce(&mut dyn Read) -> Result<T>,
) -> Result<T> {
    with_member_tar(deb, "data.tar", |tar| in_tar(tar, member, f))
}

/// The `control` file of a .deb (from its `control.tar.{xz,zst,gz}` member), as text.
pub fn deb_control(deb: &Path) -> Result<String> {
    with_member_tar(deb, "control.tar", |tar| {
        in_tar(tar, "control", |r| {
            let mut s = String::new();
            r.read_to_string(&mut s).context("reading control")?;
            Ok(s)
        })
    })
}

/// Run `f` on the contents of the entry `member` of `tar`.
fn in_tar<T>(
    tar: &mut tar::Archive<Box<dyn Read + '_>>,
    member: &str,
    f: impl FnOnce(&mut dyn Read) -> Result<T>,
) -> Result<T> {
    for e in tar.entries()? {
        let mut e = e?;
        if entry_path(&e)? == member {
            return f(&mut e);
        }
    }
    bail!("no {member}")
}
