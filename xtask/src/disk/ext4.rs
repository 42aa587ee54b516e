//! The data partition: an empty ext4 made by `mke2fs` with every input pinned. No mature Rust
//! crate writes ext4. Empty on purpose: e2fsprogs 1.47.0's `-d` copies host ctimes into inodes.

use super::{run_fs_tool, AtomicOut, Guid};
use crate::doctor;
use crate::tools_root::ToolsRoot;
use anyhow::{ensure, Context, Result};
use std::path::Path;

/// Our own `mke2fs.conf`, so the host's (whose defaults change between releases, e.g. 1.47's
/// `orphan_file` that older e2fsck refuses) cannot change the features or geometry.
const MKE2FS_CONF: &str = "\
[defaults]
\tbase_features = sparse_super,large_file,filetype,resize_inode,dir_index,ext_attr
\tdefault_mntopts = acl,user_xattr
\tenable_periodic_fsck = 0
\tblocksize = 4096
\tinode_size = 256
\tinode_ratio = 16384

[fs_types]
\text4 = {
\t\tfeatures = has_journal,extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize
\t}
\tsmall = {
\t\tinode_ratio = 4096
\t}
\tfloppy = {
\t\tinode_ratio = 8192
\t}
\tbig = {
\t\tinode_ratio = 32768
\t}
\thuge = {
\t\tinode_ratio = 65536
\t}
";

/// Make an empty ext4 of `size` bytes at `out` (atomically) with filesystem UUID `uuid`, directory
/// hash seed `hash_seed`, label `label`, root owned by 0:0, every time stamp `epoch`
/// (`E2FSPROGS_FAKE_TIME`), inode tables and journal fully initialised (nothing left for the
/// first mount to write lazily). All `-E` options go in one `-E`: e2fsprogs before 1.47.4 keeps
/// only the last one.
pub fn build_empty(
    out: &Path,
    size: u64,
    uuid: Guid,
    hash_seed: Guid,
    label: &str,
    epoch: i64,
    tools: Option<&ToolsRoot>,
) -> Result<()> {
    ensure!(epoch >= 0, "ext4 time {epoch} is before 1970");
    ensure!(
        size % 4096 == 0 && size >= 1 << 20,
        "ext4 size {size} is not a multiple of 4096 of at least 1 MiB"
    );
    ensure!(
        label.len() <= 16,
        "ext4 label `{label}` is longer than 16 bytes"
    );
    if tools.is_none() {
        doctor::ensure(&[&doctor::MKE2FS])?;
    }
    let tmp = AtomicOut::new(out)?;
    let f = tmp.create()?;
    f.set_len(size)
        .with_context(|| format!("sizing {} to {size} bytes", tmp.path().display()))?;
    drop(f);
    let conf = AtomicOut::new(&tmp.path().with_extension("mke2fs.conf"))?;
    std::fs::write(conf.path(), MKE2FS_CONF)
        .with_context(|| format!("writing {}", conf.path().display()))?;

    let env = [
        ("MKE2FS_CONFIG", conf.path().display().to_string()),
        ("E2FSPROGS_FAKE_TIME", epoch.to_string()),
    ];
    let ext =
        format!("hash_seed={hash_seed},root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0");
    let argv: Vec<String> = [
        "mke2fs", "-q", "-F", "-t", "ext4", "-b", "4096", "-I", "256", "-m", "0", "-U",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        uuid.to_string(),
        "-L".into(),
        label.to_string(),
        "-E".into(),
        ext,
        tmp.path().display().to_string(),
    ])
    .collect();
    run_fs_tool(tools, epoch, &env, &argv)
        .with_context(|| format!("mke2fs of {}", out.display()))?;
    drop(conf);
    tmp.commit()
}
