//! Hashes of files already read, kept while the files are unchanged, so that a no-op
//! `cargo xtask image` does not read 300 MiB again to learn that nothing changed.
//!
//! What stays sound: a recorded hash is used only while the file has the same device, inode,
//! size, mtime and ctime (nanoseconds) it had when it was read, and a record is made only of a
//! file whose last change (ctime) was at least [`SETTLED`] before the read began. Every write to
//! a file moves its mtime and ctime, which the kernel keeps: user space can set mtime (`touch
//! -d`) but not ctime, and setting mtime moves ctime too; replacing a file moves its inode. The
//! settle time closes the window where a write lands in the same clock tick as the record. What
//! this does not see: bytes changed under the file system (a raw write to the block device) or a
//! clock set backwards — `KILN_REHASH=1` reads every file again.

use super::Sha256;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a file must have been left alone before its hash is recorded.
pub const SETTLED: Duration = Duration::from_secs(2);

/// What identifies one state of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Stat {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stat {
    fn of(m: &std::fs::Metadata) -> Stat {
        let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
        Stat {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        }
    }
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    stat: Stat,
    sha256: String,
}

/// The records, in a JSON file (written atomically; a lost or unreadable file only costs reads).
pub struct Memo {
    file: PathBuf,
    map: Mutex<Option<BTreeMap<PathBuf, Entry>>>,
}

impl Memo {
    pub fn at(file: PathBuf) -> Memo {
        Memo {
            file,
            map: Mutex::new(None),
        }
    }

    /// The sha256 of `p`: recorded if the file is unchanged since, else read (and recorded).
    pub fn hash(&self, p: &Path) -> Result<Sha256> {
        if std::env::var_os("KILN_REHASH").is_some_and(|v| !v.is_empty() && v != "0") {
            return Sha256::of_file(p);
        }
        let key = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let before = std::fs::metadata(p).with_context(|| format!("reading {}", p.display()))?;
        let stat = Stat::of(&before);
        {
            let mut g = self.map.lock().unwrap_or_else(|e| e.into_inner());
            let map = g.get_or_insert_with(|| self.load());
            if let Some(e) = map.get(&key) {
                if e.stat == stat {
                    if let Ok(h) = e.sha256.parse() {
                        return Ok(h);
                    }
                }
            }
        }
        let started = SystemTime::now();
        let h = Sha256::of_file(p)?;
        let after = std::fs::metadata(p).map(|m| Stat::of(&m)).ok();
        let started_ns = started
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let settled = stat.ctime_ns + SETTLED.as_nanos() as i128 <= started_ns;
        if after == Some(stat) && settled {
            let mut g = self.map.lock().unwrap_or_else(|e| e.into_inner());
            let map = g.get_or_insert_with(|| self.load());
            map.insert(
                key,
                Entry {
                    stat,
                    sha256: h.to_string(),
                },
            );
            // Best effort: the record only saves reads.
            if let Ok(json) = serde_json::to_vec_pretty(&*map) {
                let _ = crate::atomic::write_atomic(&self.file, &json);
            }
        }
        Ok(h)
    }

    fn load(&self) -> BTreeMap<PathBuf, Entry> {
        std::fs::read(&self.file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }
}

/// This checkout's record, `target/kiln/sha256-memo.json`.
pub fn memo() -> &'static Memo {
    static MEMO: OnceLock<Memo> = OnceLock::new();
    MEMO.get_or_init(|| Memo::at(crate::paths::target_dir().join("kiln/sha256-memo.json")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set a file's times into the past, as if it had been left alone (ctime moves to now: a
    /// file is only recorded once its ctime has settled, so the test waits that out).
    fn age(p: &Path) {
        let old = SystemTime::now() - Duration::from_secs(3600);
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(old).unwrap();
    }

    #[test]
    fn a_changed_file_is_read_again_whatever_its_mtime() {
        let d = tempfile::tempdir().unwrap();
        let memo = Memo::at(d.path().join("memo.json"));
        let f = d.path().join("blob");
        std::fs::write(&f, b"first").unwrap();
        age(&f);
        // Not settled yet (ctime is now): read, not recorded.
        assert_eq!(memo.hash(&f).unwrap(), Sha256::of_bytes(b"first"));
        assert!(!d.path().join("memo.json").exists());
        std::thread::sleep(SETTLED + Duration::from_millis(100));
        assert_eq!(memo.hash(&f).unwrap(), Sha256::of_bytes(b"first"));
        assert!(
            d.path().join("memo.json").exists(),
            "a settled file is recorded"
        );
        // A fresh memo over the same file reads the record: prove it by the record alone
        // (a wrong recorded hash would be returned while the stat matches).
        let text = std::fs::read_to_string(d.path().join("memo.json")).unwrap();
        let forged = text.replace(
            &Sha256::of_bytes(b"first").to_string(),
            &Sha256::of_bytes(b"forged").to_string(),
        );
        std::fs::write(d.path().join("memo.json"), forged).unwrap();
        let fresh = Memo::at(d.path().join("memo.json"));
        assert_eq!(
            fresh.hash(&f).unwrap(),
            Sha256::of_bytes(b"forged"),
            "an unchanged file is not read again"
        );
        // Same size, mtime put back to the recorded value: ctime still moved, so it is read.
        let mtime = std::fs::metadata(&f).unwrap().modified().unwrap();
        std::fs::write(&f, b"other").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(fresh.hash(&f).unwrap(), Sha256::of_bytes(b"other"));
        // A replaced file (new inode) is read too.
        std::fs::write(d.path().join("new"), b"third").unwrap();
        std::fs::rename(d.path().join("new"), &f).unwrap();
        assert_eq!(fresh.hash(&f).unwrap(), Sha256::of_bytes(b"third"));
    }
}
