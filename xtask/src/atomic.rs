//! Atomic file writes: an output appears under its final name only when complete (a temp file in
//! the same folder, fsync, rename), and a failed or interrupted write leaves no half file.

use anyhow::{Context, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Write `path` atomically: a temporary file beside it (its folder created), fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let out = AtomicOut::new(path)?;
    let mut f = out.create()?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", out.path().display()))?;
    drop(f);
    out.commit()
}

/// An output file under construction: a temp file beside `out`, removed unless [`commit`]ed,
/// so an interrupted or failed write never leaves `out` (nor an old `out` half-overwritten).
///
/// [`commit`]: AtomicOut::commit
pub struct AtomicOut {
    out: PathBuf,
    tmp: PathBuf,
    committed: bool,
}

impl AtomicOut {
    /// Reserve a temp path beside `out` (creating `out`'s folder). Nothing is created yet.
    pub fn new(out: &Path) -> Result<AtomicOut> {
        let name = out
            .file_name()
            .with_context(|| format!("{} has no file name", out.display()))?;
        let dir = match out.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dir.join(format!(
            ".{}.tmp.{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        remove_stale_temps(&dir, &name.to_string_lossy());
        Ok(AtomicOut {
            out: out.to_path_buf(),
            tmp,
            committed: false,
        })
    }

    /// The temp path to write to.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Create the temp file, empty.
    pub fn create(&self) -> Result<File> {
        File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&self.tmp)
            .with_context(|| format!("creating {}", self.tmp.display()))
    }

    /// fsync the temp file and rename it to the final name.
    pub fn commit(mut self) -> Result<()> {
        let f = File::open(&self.tmp).with_context(|| format!("opening {}", self.tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync {}", self.tmp.display()))?;
        std::fs::rename(&self.tmp, &self.out).with_context(|| {
            format!("renaming {} to {}", self.tmp.display(), self.out.display())
        })?;
        self.committed = true;
        if let Some(dir) = self.out.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

/// Remove `.NAME.tmp.PID` files left by killed runs (their PID no longer lives), including one
/// with our own PID from a previous life.
fn remove_stale_temps(dir: &Path, name: &str) {
    let prefix = format!(".{name}.tmp.");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(pid) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let mine = pid == std::process::id().to_string();
        if mine || !Path::new("/proc").join(pid).exists() {
            // A stage folder (erofs::build_files) or a file.
            let _ = std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_file(e.path()));
        }
    }
}

impl Drop for AtomicOut {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}
