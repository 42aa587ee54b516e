//! One NPU user at a time. Two processes driving the rknpu driver at once have panicked the
//! kernel (RKLLM users saw it), so every `kiln` process that opens the NPU first takes an
//! exclusive, non-blocking `flock(2)` on `<devroot>/run/kiln/npu.lock` (`/run/kiln/npu.lock` on
//! the board; a test's fake device root gets its own, so tests on separate roots never contend).
//! A second process is refused at once, with an error naming the holder: never queued, never
//! run beside it, never sent to the CPU instead.
//!
//! The holder writes who it is into the file (pid, command line, when it took the lock) after
//! taking the lock, truncating what was there; the refused process reads that back for its
//! error. The kernel releases a `flock` when its last file descriptor closes, so a holder that
//! crashed or was killed never blocks the next one: its stale lines are simply overwritten. The
//! file is opened close-on-exec, so a program `kiln` starts does not inherit the lock.
//!
//! The lock belongs to the process, not to a backend: a `flock` is held per open file
//! description, so a second open and lock of the file in the same process would be refused like
//! another process. [`acquire`] therefore takes it once per lock file and counts the holders in
//! the process ([`NpuLock`] guards); the file is unlocked and closed when the last one drops.

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The lock file, relative to the device root.
pub const LOCK_FILE: &str = "run/kiln/npu.lock";

/// The lock file for the NPU under `devroot`.
pub fn lock_path(devroot: &Path) -> PathBuf {
    devroot.join(LOCK_FILE)
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another open of the lock file holds it: another process (or, through [`take`], another
    /// open in this one). `holder` is what the holder wrote, e.g.
    /// `pid 1234 (kiln serve /models/x.gguf --port 8080) since 2026-10-12T08:00:00Z`.
    #[error(
        "the NPU is in use by {holder}; kiln will not run a second NPU user beside it \
         (lock {})",
        path.display()
    )]
    InUse { path: PathBuf, holder: String },
    /// The lock file could not be made, opened, locked or written.
    #[error("the NPU lock {}: {why}", path.display())]
    Failed { path: PathBuf, why: String },
}

/// This process's hold on the NPU under one device root. The lock is released when the last
/// guard for that lock file is dropped.
#[derive(Debug)]
pub struct NpuLock {
    key: PathBuf,
}

impl NpuLock {
    /// The lock file held.
    pub fn path(&self) -> &Path {
        &self.key
    }
}

struct Held {
    _file: Flock<File>,
    users: usize,
}

/// The lock files this process holds, by canonical path, with how many guards share each.
static HELD: Mutex<Option<HashMap<PathBuf, Held>>> = Mutex::new(None);

fn held() -> MutexGuard<'static, Option<HashMap<PathBuf, Held>>> {
    // The map stays consistent whatever panicked while it was locked (every update is one insert,
    // remove or counter change), so a poisoned lock is still usable.
    HELD.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for NpuLock {
    fn drop(&mut self) {
        let mut g = held();
        let map = g.get_or_insert_with(HashMap::new);
        if let Some(h) = map.get_mut(&self.key) {
            h.users -= 1;
            if h.users == 0 {
                // Dropping the `Flock` unlocks and closes the file.
                map.remove(&self.key);
            }
        }
    }
}

/// Take the NPU lock under `devroot` for this process, or share the hold it already has.
pub fn acquire(devroot: &Path) -> Result<NpuLock, LockError> {
    let path = lock_path(devroot);
    let failed = |why: String| LockError::Failed {
        path: path.clone(),
        why,
    };
    let dir = path
        .parent()
        .ok_or_else(|| failed("the path has no parent directory".into()))?;
    std::fs::create_dir_all(dir).map_err(|e| failed(format!("creating {}: {e}", dir.display())))?;
    // One key per file, however the device root was spelt (`/`, `/./`, a symlink).
    let key = dir
        .canonicalize()
        .map_err(|e| failed(format!("resolving {}: {e}", dir.display())))?
        .join(path.file_name().unwrap_or_default());
    let mut g = held();
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(h) = map.get_mut(&key) {
        h.users += 1;
        return Ok(NpuLock { key });
    }
    let file = take(&key)?;
    map.insert(
        key.clone(),
        Held {
            _file: file,
            users: 1,
        },
    );
    Ok(NpuLock { key })
}

/// Open `path` (made if missing), lock it exclusively without waiting and write this process's
/// identity into it. Every call is a new open file description, so a second call in the same
/// process is refused as another process would be; [`acquire`] is what the backend uses.
pub fn take(path: &Path) -> Result<Flock<File>, LockError> {
    let failed = |why: String| LockError::Failed {
        path: path.to_path_buf(),
        why,
    };
    // Not truncated on open: until the lock is ours, the content is the holder's name.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(path)
        .map_err(|e| failed(format!("opening: {e}")))?;
    let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(f) => f,
        Err((mut file, Errno::EWOULDBLOCK)) => {
            return Err(LockError::InUse {
                path: path.to_path_buf(),
                holder: holder(&mut file),
            })
        }
        Err((_, e)) => return Err(failed(format!("flock: {e}"))),
    };
    let me = identity();
    file.set_len(0)
        .and_then(|_| file.seek(SeekFrom::Start(0)))
        .and_then(|_| file.write_all(me.as_bytes()))
        .and_then(|_| file.flush())
        .map_err(|e| failed(format!("writing the holder's identity: {e}")))?;
    Ok(file)
}

/// This process as the lock file records it: `pid=`, `cmdline=` and `since=` lines.
fn identity() -> String {
    let cmdline = std::fs::read("/proc/self/cmdline")
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| std::env::args().collect::<Vec<_>>().join(" "));
    // One line per field: a newline in an argument would start a field of its own.
    let cmdline = cmdline.replace(['\n', '\r'], " ");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!(
        "pid={}\ncmdline={cmdline}\nsince={}\n",
        std::process::id(),
        utc(now)
    )
}

/// The holder as its lock file names it, for the refusal. The file is another process's
/// writing: anything missing or unreadable is said so, never trusted to parse.
fn holder(file: &mut File) -> String {
    let mut raw = Vec::new();
    let read = file
        .seek(SeekFrom::Start(0))
        .and_then(|_| file.take(4096).read_to_end(&mut raw));
    if let Err(e) = read {
        return format!("another process (its lock file cannot be read: {e})");
    }
    let text = String::from_utf8_lossy(&raw);
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    match field("pid") {
        Some(pid) => format!(
            "pid {pid} ({}) since {}",
            field("cmdline").unwrap_or("command line unknown"),
            field("since").unwrap_or("an unknown time")
        ),
        None => "another process (it has not written its pid into the lock file yet)".into(),
    }
}

/// `secs` after the Unix epoch as `YYYY-MM-DDThh:mm:ssZ` (proleptic Gregorian, UTC).
fn utc(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let (y, m, d) = crate::civil::civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn devroot(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("kiln-npu-lock-{name}-"))
            .tempdir()
            .expect("tempdir")
    }

    /// A second open of the lock file is refused while the first holds it, and the refusal names
    /// this process as the holder; once the hold is dropped the file can be taken again.
    #[test]
    fn second_open_is_refused_with_the_holder() {
        let root = devroot("refused");
        let held = acquire(root.path()).expect("first lock");
        let path = lock_path(root.path());
        assert!(path.is_file(), "the lock file is made, parent dirs too");
        let err = take(&path).expect_err("a second open must be refused while the first holds");
        let msg = err.to_string();
        assert!(matches!(err, LockError::InUse { .. }), "{msg}");
        let pid = format!("pid {} (", std::process::id());
        assert!(msg.contains(&pid), "names the holder's pid: {msg}");
        assert!(
            msg.contains("kiln will not run a second NPU user beside it"),
            "{msg}"
        );
        assert!(msg.contains(" since "), "{msg}");
        // The refused open did not wipe the holder's identity.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with(&format!("pid={}\n", std::process::id())),
            "{text}"
        );
        drop(held);
        let again = take(&path).expect("free once the holder is gone");
        drop(again);
    }

    /// Backends of one process share the process's hold: a second `acquire` is not refused, and
    /// the file stays locked until the last guard goes.
    #[test]
    fn one_process_holds_it_once() {
        let root = devroot("shared");
        let a = acquire(root.path()).expect("first backend");
        // The same root spelt another way is the same lock.
        let b = acquire(&root.path().join(".")).expect("second backend in the same process");
        assert_eq!(a.path(), b.path());
        drop(a);
        assert!(
            matches!(take(&lock_path(root.path())), Err(LockError::InUse { .. })),
            "still held while one guard lives"
        );
        drop(b);
        take(&lock_path(root.path())).expect("released with the last guard");
    }

    /// Stale lines from a holder that died are overwritten; whatever is in the file is never
    /// trusted to parse.
    #[test]
    fn stale_or_garbage_content_is_overwritten() {
        let root = devroot("stale");
        let path = lock_path(root.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(
            &path,
            b"pid=99999999\ncmdline=kiln serve old\nsince=x\nmore junk\n",
        )
        .unwrap();
        let held = take(&path).expect("nobody holds it: the content is stale");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with(&format!("pid={}\n", std::process::id())),
            "{text}"
        );
        assert!(
            !text.contains("99999999") && !text.contains("junk"),
            "{text}"
        );
        drop(held);
        // A holder whose file holds no pid (it has not written yet) is still refused by name.
        std::fs::write(&path, b"\xff\xfe garbage").unwrap();
        let mut f = File::open(&path).unwrap();
        assert!(holder(&mut f).contains("has not written its pid"));
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_790_000_000), "2026-09-21T14:13:20Z");
    }
}
