//! The models partition: an uncompressed erofs (so GGUF weights mmap straight from the page
//! cache) made by `mkfs.erofs` with a fixed time, UUID and ownership. No Rust crate writes erofs.

use super::{pinned_shell, AtomicOut, Guid};
use crate::doctor;
use anyhow::{ensure, Context, Result};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use xshell::cmd;

/// Build an erofs image of `src_dir` at `out` (atomically): every time stamp `epoch`, UUID `uuid`,
/// every file owned by root, no extended attributes (host SELinux labels would leak in), no
/// compression. File modes come from `src_dir` as they are: stage it with explicit modes, or use
/// [`build_files`], which does.
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

/// Build an erofs image at `out` holding `files` (`'/'`-separated path in the image, source file
/// on the host), staged in a temp folder beside `out` with modes fixed (folders 0755, files 0644,
/// or 0755 where the source is executable by its owner), so neither the sources' modes nor the
/// umask reach the image. Sources are copied (a hard link would share, and let us change, the
/// source's mode).
pub fn build_files(out: &Path, files: &[(String, PathBuf)], uuid: Guid, epoch: i64) -> Result<()> {
    let stage = AtomicOut::new(&out.with_extension("stage"))?;
    let root = stage.path().to_path_buf();
    let result = (|| -> Result<()> {
        std::fs::create_dir(&root).with_context(|| format!("creating {}", root.display()))?;
        let mut dirs = vec![root.clone()];
        for (path, src) in files {
            let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
            ensure!(
                !parts.is_empty() && parts.iter().all(|p| *p != "." && *p != ".."),
                "erofs path `{path}` is empty or has a `.`/`..` component"
            );
            let dst = parts.iter().fold(root.clone(), |p, s| p.join(s));
            ensure!(!dst.exists(), "erofs path `{path}` appears twice");
            let mut d = root.clone();
            for p in &parts[..parts.len() - 1] {
                d = d.join(p);
                if !d.exists() {
                    std::fs::create_dir(&d).with_context(|| format!("creating {}", d.display()))?;
                    dirs.push(d.clone());
                }
            }
            std::fs::copy(src, &dst)
                .with_context(|| format!("copying {} into the erofs stage", src.display()))?;
            let exec = std::fs::metadata(src)?.permissions().mode() & 0o100 != 0;
            let mode = if exec { 0o755 } else { 0o644 };
            std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(mode))?;
        }
        for d in &dirs {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        }
        build(out, &root, uuid, epoch)
    })();
    let _ = std::fs::remove_dir_all(&root);
    drop(stage);
    result
}
