//! Where things are: the workspace root, `target/`, and a shell that starts there. Ground: every
//! module may use it; the crate root (`main.rs`) only parses and dispatches and is imported by none.

use std::path::{Path, PathBuf};

/// The workspace root: the folder above this crate.
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// `target/` under the root, unless `CARGO_TARGET_DIR` moves it.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_root().join("target"))
}

/// An `xshell` shell whose working directory is the workspace root.
pub fn shell() -> anyhow::Result<xshell::Shell> {
    let sh = xshell::Shell::new()?;
    sh.change_dir(project_root());
    Ok(sh)
}

/// kiln's per-user cache: `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`. It outlives checkouts:
/// the download cache (`sha256/`) and the builds keyed by every input that shapes their bytes
/// (`tools-root/<key>`, `kernel/<key>`), so a new clone does not make them again.
pub fn user_cache() -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(
            std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set")?,
        )
        .join(".cache"),
    };
    Ok(base.join("kiln"))
}

/// An exclusive lock on `path` (created if absent), held until the returned lock is dropped:
/// two builds that would make the same keyed cache entry take turns instead of writing one
/// temporary folder together. Says who waits, when it has to. (`flock(2)`: released by the
/// kernel when the process dies.)
pub fn lock_exclusive(path: &Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    use anyhow::Context;
    use nix::fcntl::{Flock, FlockArg};
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("opening the lock {}", path.display()))
    };
    match Flock::lock(open()?, FlockArg::LockExclusiveNonblock) {
        Ok(l) => return Ok(l),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            println!(
                "waiting for {} (another build holds it) ...",
                path.display()
            )
        }
        Err((_, e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
    }
    Flock::lock(open()?, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .with_context(|| format!("locking {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_second_lock_waits_for_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/.key.lock");
        let first = lock_exclusive(&path).unwrap();
        let got = Arc::new(AtomicBool::new(false));
        let (p, g) = (path.clone(), got.clone());
        let t = std::thread::spawn(move || {
            let _second = lock_exclusive(&p).unwrap();
            g.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!got.load(Ordering::SeqCst), "the second lock did not wait");
        drop(first);
        t.join().unwrap();
        assert!(got.load(Ordering::SeqCst));
    }
}

/// Debian gives an ordinary user a PATH without `/usr/sbin` and `/sbin` (`ENV_PATH` in
/// `login.defs`), where `sfdisk`, `mke2fs`, `fsck.*` and `losetup` live; on files they work for
/// any user, and the test suite's references are among them. A PATH that has `/usr/bin` but not
/// these gets them appended, for this process and what it runs; a PATH without `/usr/bin` was
/// narrowed on purpose (the doctor's tests hide one tool that way) and is kept as it is.
pub fn with_sbin(path: &std::ffi::OsStr) -> Option<std::ffi::OsString> {
    let dirs: Vec<PathBuf> = std::env::split_paths(path).collect();
    if !dirs.iter().any(|d| d == Path::new("/usr/bin")) {
        return None;
    }
    let missing: Vec<PathBuf> = ["/usr/sbin", "/sbin"]
        .iter()
        .map(PathBuf::from)
        .filter(|s| !dirs.contains(s))
        .collect();
    if missing.is_empty() {
        return None;
    }
    std::env::join_paths(dirs.into_iter().chain(missing)).ok()
}

#[cfg(test)]
mod sbin_tests {
    use super::with_sbin;
    use std::ffi::OsStr;

    #[test]
    fn a_users_path_gets_sbin_and_a_narrowed_one_is_kept() {
        assert_eq!(
            with_sbin(OsStr::new(
                "/home/u/.cargo/bin:/usr/local/bin:/usr/bin:/bin"
            ))
            .unwrap(),
            "/home/u/.cargo/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
        );
        assert_eq!(
            with_sbin(OsStr::new("/usr/sbin:/usr/bin:/bin")).unwrap(),
            "/usr/sbin:/usr/bin:/bin:/sbin"
        );
        assert!(with_sbin(OsStr::new("/usr/sbin:/usr/bin:/sbin:/bin")).is_none());
        assert!(with_sbin(OsStr::new("/tmp/only-these-tools")).is_none());
    }
}

/// Bytes of the files below `p` (symlinks not followed); what cannot be read counts 0.
pub fn size_of(p: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if !m.is_dir() {
        return m.len();
    }
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| size_of(&e.path()))
        .sum()
}
