//! The models partition: an uncompressed erofs (so GGUF weights mmap straight from the page
//! cache) made by `mkfs.erofs` with a fixed time, UUID and ownership. No Rust crate writes erofs.

use super::{run_fs_tool, AtomicOut, Guid};
use crate::doctor;
use crate::tools_root::ToolsRoot;
use anyhow::{ensure, Context, Result};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Build an erofs image of `src_dir` at `out` (atomically): every time stamp `epoch`, UUID `uuid`,
/// every file owned by root, no extended attributes (host SELinux labels would leak in), no
/// compression. File modes come from `src_dir` as they are: stage it with explicit modes, or use
/// [`build_files`], which does.
pub fn build(
    out: &Path,
    src_dir: &Path,
    uuid: Guid,
    epoch: i64,
    tools: Option<&ToolsRoot>,
) -> Result<()> {
    build_with(out, src_dir, uuid, epoch, tools, &[])
}

/// [`build`], lz4hc-compressed (the kernel's `EROFS_FS_ZIP`): for files read once, not mapped.
pub fn build_compressed(
    out: &Path,
    src_dir: &Path,
    uuid: Guid,
    epoch: i64,
    tools: Option<&ToolsRoot>,
) -> Result<()> {
    build_with(out, src_dir, uuid, epoch, tools, &["-zlz4hc"])
}

fn build_with(
    out: &Path,
    src_dir: &Path,
    uuid: Guid,
    epoch: i64,
    tools: Option<&ToolsRoot>,
    extra: &[&str],
) -> Result<()> {
    ensure!(epoch >= 0, "erofs time {epoch} is before 1970");
    ensure!(
        src_dir.is_dir(),
        "erofs source {} is not a folder",
        src_dir.display()
    );
    if tools.is_none() {
        doctor::ensure(&[&doctor::MKFS_EROFS])?;
    }
    let tmp = AtomicOut::new(out)?;
    let argv: Vec<String> = [
        "mkfs.erofs".to_string(),
        "--quiet".into(),
        format!("-T{epoch}"),
        format!("-U{uuid}"),
        "--all-root".into(),
        "-x-1".into(),
    ]
    .into_iter()
    .chain(extra.iter().map(|s| s.to_string()))
    .chain([
        tmp.path().display().to_string(),
        src_dir.display().to_string(),
    ])
    .collect();
    run_fs_tool(tools, epoch, &[], &argv)
        .with_context(|| format!("mkfs.erofs of {} into {}", src_dir.display(), out.display()))?;
    tmp.commit()
}

pub fn build_files(
    out: &Path,
    files: &[(String, PathBuf)],
    uuid: Guid,
    epoch: i64,
    tools: Option<&ToolsRoot>,
) -> Result<()> {
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
        build(out, &root, uuid, epoch, tools)
    })();
    let _ = std::fs::remove_dir_all(&root);
    drop(stage);
    result
}
