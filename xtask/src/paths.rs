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

/// An exclusive lock on `path` (created if absent), held until the returned file is dropped:
/// two builds that would make the same keyed cache entry take turns instead of writing one
/// temporary folder together. Says who waits, when it has to.
pub fn lock_exclusive(path: &Path) -> anyhow::Result<std::fs::File> {
    use anyhow::Context;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening the lock {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => return Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => {
            println!(
                "waiting for {} (another build holds it) ...",
                path.display()
            )
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
    f.lock()
        .with_context(|| format!("locking {}", path.display()))?;
    Ok(f)
}
