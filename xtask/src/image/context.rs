//! What every step of one image build reads ([`Ctx`]: the recipe, the commit, the resolved
//! inputs, the tools root) and the pinned rootfs packages as a tree: shared by the system's steps
//! (`steps.rs`) and the updates tree (`updates.rs`), which do not import each other.

use super::board::Board;
use super::{Commit, Inputs};
use crate::pins;
use crate::rootfs::{self, NodeKind, Tree};
use anyhow::Result;
use std::path::PathBuf;

/// What every step of one build may read: the recipe, the commit and the resolved inputs.
pub struct Ctx {
    pub board: Board,
    pub commit: Commit,
    /// `SOURCE_DATE_EPOCH`: the commit time.
    pub epoch: i64,
    /// `<board>:<commit>`: every id of the image derives from it.
    pub seed: String,
    pub inputs: Inputs,
    /// `target/kiln/image/<board>/`: the partitions and the initramfs.
    pub work: PathBuf,
    /// Where the kernel build and `mkfs.*` run; its key is in every key of theirs.
    pub tools: crate::tools_root::ToolsRoot,
}

/// `name=sha256` of every pinned rootfs package: the part of a step's key that says which debs
/// its tree is made from.
pub fn rootfs_debs_key(ctx: &Ctx) -> String {
    ctx.inputs
        .values()
        .filter(|(i, _)| i.file.ends_with("rootfs/packages.toml"))
        .map(|(i, _)| {
            format!(
                "{}={}",
                i.name,
                i.sha256.map(|h| h.to_string()).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Every pinned rootfs package but `skip`, unpacked into one tree (the first package to give a
/// path keeps it): where shared objects are taken from.
pub fn rootfs_libs(inputs: &Inputs, skip: &[&str]) -> Result<Tree> {
    let mut libs = Tree::default();
    for (name, (input, p)) in inputs {
        if matches!(input.source, pins::Source::Deb { .. })
            && input.file.ends_with("rootfs/packages.toml")
            && !skip.contains(&name.as_str())
        {
            for (path, n) in rootfs::deb_tree(p, name)?.nodes {
                if libs
                    .nodes
                    .get(&path)
                    .is_none_or(|o| o.kind == NodeKind::Dir)
                {
                    libs.nodes.insert(path, n);
                }
            }
        }
    }
    Ok(libs)
}
