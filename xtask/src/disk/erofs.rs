//! The models partition: an uncompressed erofs (so GGUF weights mmap straight from the page
//! cache) made by `mkfs.erofs` with a fixed time, UUID and ownership. No Rust crate writes erofs.

use super::{pinned_shell, AtomicOut, Guid};
use crate::doctor;
use anyhow::{ensure, Context, Result};
use std::path::Path;
use xshell::cmd;

/// Build an erofs image of `src_dir` at `out` (atomically): every time stamp `epoch`, UUID `uuid`,
/// every file owned by root, no extended attributes (host SELinux labels would leak in), no
/// compression. File modes come from `src_dir` as they are: stage it with explicit modes.
pub fn build(out: &Path, src_dir: &Path, uuid: Guid, epoch: i64) -> Result<()> {
    ensure!(epoch >= 0, "erofs time {epoch} is before 1970");
    ensure!(
        src_dir.is_dir(),
        "erofs source {} is not a folder",
        src_dir.display()
    );
    doctor::ensure(&[&doctor::MKFS_EROFS])?;
    let tmp = AtomicOut::new(out)?;
    let sh = pinned_shell(epoch)?;
    let t = format!("-T{epoch}");
    let u = format!("-U{uuid}");
    let dst = tmp.path();
    cmd!(
        sh,
        "mkfs.erofs --quiet {t} {u} --all-root -x-1 {dst} {src_dir}"
    )
    .quiet()
    .run()
    .with_context(|| format!("mkfs.erofs of {} into {}", src_dir.display(), out.display()))?;
    tmp.commit()
}
