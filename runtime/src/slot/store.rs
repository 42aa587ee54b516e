//! `kiln/abstate.env` on disk: read it (telling a damaged file from one that is not there) and
//! write it as atomically as FAT allows.
//!
//! [`save`] writes `abstate.env.new` in the same folder, fsyncs it, renames it over
//! `abstate.env` and fsyncs the folder. What a power cut leaves:
//! - before the rename: the old `abstate.env`, intact, and a stray (maybe partial)
//!   `abstate.env.new`. Nothing reads the stray (U-Boot, libubootenv and [`read`] all open
//!   `abstate.env`); the next [`save`] truncates and replaces it.
//! - after the rename has reached the disk: the new file.
//! - during the rename itself: FAT has no journal. Linux's vfat rewrites the directory entries
//!   in place (the target's entry freed, the source's renamed), so a cut inside that window of
//!   one or two sector writes can leave both names, or a lost cluster chain that `fsck.vfat`
//!   reclaims. That window is the "as far as FAT allows"; it is not shown by a power-cut test.
//!
//! U-Boot does not do this: its `boot.scr` decrements the counter and `save`s the file with
//! `fat_write`, which rewrites an existing file in place (`fs/fat/fat_write.c`; Debian 12's U-Boot
//! 2023.01 cannot rename on FAT at all). A cut there leaves a file with a bad CRC, which the next
//! boot's `env import -c` refuses, so U-Boot falls back to its defaults; [`read`] reports it as
//! [`Read::Damaged`]. libubootenv's `fw_setenv` (what RAUC runs) also rewrites the file in place.

use super::env::Env;
use super::State;
use anyhow::{Context, Result};
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// What is in `abstate.env`.
#[derive(Debug)]
pub enum Read {
    /// A readable A/B state.
    State(State),
    /// Not a U-Boot environment U-Boot can import (wrong size or bad CRC, e.g. a write cut
    /// short): U-Boot uses its defaults. The error says what is wrong, naming the file.
    Damaged(anyhow::Error),
}

/// `path` + `.new`: where [`save`] writes before the rename.
pub fn new_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".new");
    PathBuf::from(p)
}

/// Read `path`. A file that is not there or cannot be read is an error; a file U-Boot cannot
/// import is [`Read::Damaged`]; an importable environment whose `BOOT_ORDER` or counters kiln
/// cannot read (e.g. `BOOT_ORDER=C`) is an error too, since U-Boot does not fall back then.
pub fn read(path: &Path) -> Result<Read> {
    let what = path.display().to_string();
    let bytes = std::fs::read(path).with_context(|| format!("reading {what}"))?;
    if let Err(e) = Env::decode(&bytes, &what) {
        return Ok(Read::Damaged(e));
    }
    Ok(Read::State(State::decode(&bytes, &what)?))
}

/// Write `st` to `path` through `path.new` and a rename (see the module's documentation for what
/// a power cut leaves). A stray `path.new` from a cut write is replaced.
pub fn save(st: &State, path: &Path) -> Result<()> {
    let bytes = st.encode()?;
    let tmp = new_path(path);
    let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} over {}", tmp.display(), path.display()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| {
        format!(
            "{} is written, but syncing its folder {} failed: the rename may not survive a \
                 power cut",
            path.display(),
            dir.display()
        )
    })
}

/// Run `f` with the file system holding `path` writable: when it is mounted read-only (init
/// mounts `bootctl` so), it is remounted read-write and synchronous (each write reaches the card
/// in the order it is made: the new file's data and chain before the rename's directory entry)
/// for `f`, then read-only again, which clears FAT's dirty bit. Linux only; elsewhere `f` runs.
pub fn with_writable<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let Some(mp) = read_only_mount_of(path) else {
        return f();
    };
    remount(&mp, libc::MS_SYNCHRONOUS).with_context(|| {
        format!(
            "remounting {} read-write to write {}",
            mp.display(),
            path.display()
        )
    })?;
    let r = f();
    let back = remount(&mp, libc::MS_RDONLY)
        .with_context(|| format!("remounting {} read-only again", mp.display()));
    let out = r?;
    back?;
    Ok(out)
}

fn remount(mp: &Path, flags: libc::c_ulong) -> Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(mp.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path; null source, type and data are allowed for a remount.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            c.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

/// The mount point holding `path` when it is mounted read-only (`/proc/self/mountinfo`).
fn read_only_mount_of(path: &Path) -> Option<PathBuf> {
    let dir = path.parent()?.canonicalize().ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<(PathBuf, bool)> = None;
    for l in info.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (Some(mp), Some(opts)) = (f.get(4), f.get(5)) else {
            continue;
        };
        let mp = PathBuf::from(mp.replace("\\040", " "));
        if dir.starts_with(&mp)
            && best
                .as_ref()
                .is_none_or(|(b, _)| mp.as_os_str().len() >= b.as_os_str().len())
        {
            best = Some((mp, opts.split(',').any(|o| o == "ro")));
        }
    }
    best.and_then(|(mp, ro)| ro.then_some(mp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slot::Slot;

    #[test]
    fn save_replaces_the_file_and_leaves_no_new() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        save(&State::initial(), &p).unwrap();
        let mut st = State::initial();
        st.mark_bad(Slot::B).unwrap();
        save(&st, &p).unwrap();
        match read(&p).unwrap() {
            Read::State(got) => assert_eq!(got, st),
            Read::Damaged(e) => panic!("{e:#}"),
        }
        assert!(!new_path(&p).exists());
    }

    #[test]
    fn a_stray_new_is_ignored_by_read_and_replaced_by_save() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        save(&State::initial(), &p).unwrap();
        // A cut before the rename: half of a new file.
        std::fs::write(new_path(&p), &State::initial().encode().unwrap()[..100]).unwrap();
        assert!(matches!(read(&p).unwrap(), Read::State(s) if s == State::initial()));
        let mut st = State::initial();
        st.mark_active(Slot::B).unwrap();
        save(&st, &p).unwrap();
        assert!(!new_path(&p).exists());
        assert!(matches!(read(&p).unwrap(), Read::State(s) if s == st));
    }

    #[test]
    fn damaged_missing_and_unreadable_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        let err = read(&p).unwrap_err();
        assert!(format!("{err:#}").contains("abstate.env"), "{err:#}");
        // A cut during U-Boot's in-place fat_write: the first sector new, the rest old.
        let mut bytes = State::initial().encode().unwrap();
        bytes[20] ^= 0x40;
        std::fs::write(&p, &bytes).unwrap();
        match read(&p).unwrap() {
            Read::Damaged(e) => {
                let e = format!("{e:#}");
                assert!(e.contains("abstate.env") && e.contains("damaged"), "{e}");
            }
            Read::State(s) => panic!("read {s:?} from a damaged file"),
        }
        std::fs::write(&p, &bytes[..512]).unwrap();
        assert!(matches!(read(&p).unwrap(), Read::Damaged(_)));
        let mut e = Env::default();
        e.set("BOOT_ORDER", "A C");
        std::fs::write(&p, e.encode().unwrap()).unwrap();
        let err = format!("{:#}", read(&p).unwrap_err());
        assert!(
            err.contains("abstate.env") && err.contains("BOOT_ORDER"),
            "{err}"
        );
    }
}
