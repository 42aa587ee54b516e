//! The root filesystem (the initramfs) as a tree in memory: busybox and its applet links, the
//! glibc/libgcc shared objects the dynamic binaries need (taken from pinned Debian arm64 packages,
//! unpacked in-process with `ar` + `tar` + xz/zstd), `kiln`, the NPU runtime library, the overlay
//! tree and `/etc/kiln/board.toml`. Nothing else.

use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeKind {
    File(Vec<u8>),
    Dir,
    Symlink(String),
}

/// One path of the tree; `mode` holds permission bits only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub mode: u32,
    pub kind: NodeKind,
    /// Where it came from, for the manifest (`busybox-static`, `overlay`, `kiln`, …).
    pub origin: String,
}

/// Paths relative to `/`, without a leading slash, sorted.
#[derive(Default, Debug)]
pub struct Tree {
    pub nodes: BTreeMap<String, Node>,
}

impl Tree {
    /// Add a node and any missing parent folders (0755). Two different nodes at one path are an
    /// error naming both origins.
    pub fn add(&mut self, path: &str, mode: u32, kind: NodeKind, origin: &str) -> Result<()> {
        let path = path
            .trim_start_matches("./")
            .trim_start_matches('/')
            .trim_end_matches('/');
        if path.is_empty()
            || path
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            bail!("bad rootfs path {path:?} from {origin}");
        }
        let mut parent = String::new();
        let comps: Vec<&str> = path.split('/').collect();
        for c in &comps[..comps.len() - 1] {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(c);
            match self.nodes.get(&parent) {
                Some(n) if n.kind == NodeKind::Dir => {}
                Some(n) => bail!(
                    "{path} (from {origin}) needs folder {parent}, which {} made a non-folder",
                    n.origin
                ),
                None => {
                    self.nodes.insert(
                        parent.clone(),
                        Node {
                            mode: 0o755,
                            kind: NodeKind::Dir,
                            origin: origin.to_string(),
                        },
                    );
                }
            }
        }
        let node = Node {
            mode: mode & 0o7777,
            kind,
            origin: origin.to_string(),
        };
        match self.nodes.get(path) {
            None => {
                self.nodes.insert(path.to_string(), node);
            }
            Some(old) if old.kind == NodeKind::Dir && node.kind == NodeKind::Dir => {}
            Some(old) => bail!(
                "rootfs path /{path} comes from both {} and {origin}",
                old.origin
            ),
        }
        Ok(())
    }

    /// Resolve a path inside the tree (following symlinks, at most 16 hops).
    pub fn resolve(&self, path: &str) -> Option<String> {
        let mut p = path.trim_start_matches('/').to_string();
        for _ in 0..16 {
            match &self.nodes.get(&p)?.kind {
                NodeKind::Symlink(t) => {
                    p = if let Some(abs) = t.strip_prefix('/') {
                        abs.to_string()
                    } else {
                        let dir = p.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                        normalize(&format!("{dir}/{t}"))
                    };
                }
                _ => return Some(p),
            }
        }
        None
    }
}

fn normalize(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out.join("/")
}

/// Every file, folder and symlink of a .deb's data, as a tree.
pub fn deb_tree(deb: &Path, origin: &str) -> Result<Tree> {
    crate::archive::with_data_tar(deb, |tar| {
        let mut t = Tree::default();
        for e in tar.entries()? {
            let mut e = e?;
            let p = crate::archive::entry_path(&e)?;
            if p.is_empty() || p == "." {
                continue;
            }
            let mode = e.header().mode()?;
            let kind = match e.header().entry_type() {
                tar::EntryType::Directory => NodeKind::Dir,
                tar::EntryType::Symlink => NodeKind::Symlink(
                    e.link_name()?
                        .with_context(|| format!("symlink {p} without target"))?
                        .to_string_lossy()
                        .into_owned(),
                ),
                tar::EntryType::Regular => {
                    let mut v = Vec::new();
                    e.read_to_end(&mut v)?;
                    NodeKind::File(v)
                }
                // Hard links and devices do not occur in the packages we take files from.
                _ => continue,
            };
            t.add(&p, mode, kind, origin)?;
        }
        Ok(t)
    })
}

/// The `DT_NEEDED` sonames and the `PT_INTERP` of an ELF.
pub fn elf_deps(bytes: &[u8], what: &str) -> Result<(Vec<String>, Option<String>)> {
    let elf =
        goblin::elf::Elf::parse(bytes).with_context(|| format!("{what} is not an ELF file"))?;
    if elf.header.e_machine != goblin::elf::header::EM_AARCH64 {
        bail!(
            "{what} is not an aarch64 ELF (e_machine {})",
            elf.header.e_machine
        );
    }
    Ok((
        elf.libraries.iter().map(|s| s.to_string()).collect(),
        elf.interpreter.map(str::to_string),
    ))
}

/// Where the loader looks for a soname (Debian arm64's multiarch order).
const LIB_DIRS: &[&str] = &[
    "lib/aarch64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib",
    "usr/lib",
];

/// Copy `path` (and every symlink hop to its file) from `from` into `into`.
fn copy_with_links(from: &Tree, into: &mut Tree, path: &str) -> Result<()> {
    let mut p = path.trim_start_matches('/').to_string();
    for _ in 0..16 {
        let n = from
            .nodes
            .get(&p)
            .with_context(|| format!("/{p} is not in the packages"))?;
        if into.nodes.get(&p) != Some(n) {
            into.add(&p, n.mode, n.kind.clone(), &n.origin)?;
        }
        let NodeKind::Symlink(t) = &n.kind else {
            return Ok(());
        };
        p = match t.strip_prefix('/') {
            Some(abs) => abs.to_string(),
            None => {
                let dir = p.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                normalize(&format!("{dir}/{t}"))
            }
        };
    }
    bail!("/{path}: too many symlink hops")
}

/// Add the interpreter and the shared-object closure of the ELF files at `roots` (paths in
/// `into`), taking them from `libs` (the unpacked packages). A soname nobody provides is an error.
pub fn add_shared_objects(into: &mut Tree, libs: &Tree, roots: &[&str]) -> Result<Vec<String>> {
    let mut todo: Vec<(String, String)> = roots
        .iter()
        .map(|r| (r.to_string(), r.to_string()))
        .collect();
    let mut seen = BTreeSet::new();
    let mut added = Vec::new();
    while let Some((path, why)) = todo.pop() {
        let real = into
            .resolve(&path)
            .with_context(|| format!("/{path} missing"))?;
        let Some(Node {
            kind: NodeKind::File(bytes),
            ..
        }) = into.nodes.get(&real)
        else {
            bail!("/{real} is not a file");
        };
        let (needed, interp) = elf_deps(bytes, &format!("/{real} (needed by {why})"))?;
        if let Some(i) = interp {
            if seen.insert(i.clone()) {
                copy_with_links(libs, into, &i)
                    .with_context(|| format!("interpreter {i} of /{real}"))?;
                added.push(i.trim_start_matches('/').to_string());
            }
        }
        for so in needed {
            if !seen.insert(so.clone()) {
                continue;
            }
            let found = LIB_DIRS
                .iter()
                .map(|d| format!("{d}/{so}"))
                .find(|p| libs.nodes.contains_key(p))
                .with_context(|| {
                    format!("/{real} needs {so}, which none of the pinned packages (rootfs/packages.toml) provides")
                })?;
            copy_with_links(libs, into, &found)?;
            added.push(found.clone());
            todo.push((found, real.clone()));
        }
    }
    Ok(added)
}

/// The busybox applets linked in `/bin` and `/sbin` (what `/init` and a person at the console use).
pub const APPLETS: &[(&str, &[&str])] = &[
    (
        "bin",
        &[
            "sh",
            "ash",
            "cat",
            "chmod",
            "cp",
            "date",
            "dd",
            "df",
            "dmesg",
            "echo",
            "false",
            "grep",
            "gunzip",
            "gzip",
            "head",
            "hexdump",
            "kill",
            "ln",
            "ls",
            "mkdir",
            "mknod",
            "mount",
            "mv",
            "ps",
            "readlink",
            "rm",
            "rmdir",
            "sed",
            "sleep",
            "stat",
            "sync",
            "tail",
            "tee",
            "test",
            "touch",
            "tr",
            "true",
            "umount",
            "uname",
            "vi",
            "wc",
            "zcat",
            "cut",
            "find",
            "free",
            "md5sum",
            "sha256sum",
            "xargs",
            "sort",
            "uniq",
            "awk",
            "ip",
            // A farm's test (images/labgrid) fetches a bundle from the test host for `rauc install`.
            "wget",
        ],
    ),
    (
        "sbin",
        &[
            "halt",
            "poweroff",
            "reboot",
            "switch_root",
            "mdev",
            "blkid",
            "sysctl",
            "fsck",
            "udhcpc",
        ],
    ),
];

/// Folders the system mounts things on: `/bootctl` (p1), `/boot` (the booted slot, p2 or p3),
/// `/models` (the mapped models slot, p4 or p5), `/data` (p6).
pub const MOUNTPOINTS: &[&str] = &[
    "dev", "proc", "sys", "tmp", "run", "root", "mnt", "boot", "bootctl", "models", "data",
];

/// Write a tree out as a folder (files with their modes, folders, symlinks), for a `mkfs` that
/// takes a folder. `dir` must not exist.
pub fn write_dir(tree: &Tree, dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    // Every folder gets its mode here, never the umask's: the same tree must give the same
    // file system on any machine (a folder the tree does not list, such as a library's
    // parent, is 0755).
    let mkdir = |d: &Path| -> Result<()> {
        if !d.exists() {
            std::fs::create_dir(d).with_context(|| format!("creating {}", d.display()))?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("chmod {}", d.display()))?;
        }
        Ok(())
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for (p, n) in &tree.nodes {
        let at = dir.join(p);
        let mut d = dir.to_path_buf();
        for c in Path::new(p)
            .parent()
            .into_iter()
            .flat_map(|x| x.components())
        {
            d.push(c);
            mkdir(&d)?;
        }
        match &n.kind {
            NodeKind::Dir => mkdir(&at).map_err(std::io::Error::other),
            NodeKind::File(b) => std::fs::write(&at, b),
            NodeKind::Symlink(t) => std::os::unix::fs::symlink(t, &at),
        }
        .with_context(|| format!("writing {}", at.display()))?;
        if !matches!(n.kind, NodeKind::Symlink(_)) {
            std::fs::set_permissions(&at, std::fs::Permissions::from_mode(n.mode))
                .with_context(|| format!("chmod {}", at.display()))?;
        }
    }
    Ok(())
}

/// Add a folder tree from the host (the overlay) as it is: files keep their executable bit
/// (0755 or 0644), folders are 0755, symlinks are kept as links.
pub fn add_host_tree(into: &mut Tree, dir: &Path, origin: &str) -> Result<()> {
    fn walk(into: &mut Tree, root: &Path, dir: &Path, origin: &str) -> Result<()> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .collect::<std::io::Result<_>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            let rel = p
                .strip_prefix(root)?
                .to_str()
                .with_context(|| format!("{} is not UTF-8", p.display()))?;
            let ft = e.file_type()?;
            if ft.is_symlink() {
                let t = std::fs::read_link(&p)?;
                into.add(
                    rel,
                    0o777,
                    NodeKind::Symlink(t.to_string_lossy().into_owned()),
                    origin,
                )?;
            } else if ft.is_dir() {
                into.add(rel, 0o755, NodeKind::Dir, origin)?;
                walk(into, root, &p, origin)?;
            } else if ft.is_file() {
                use std::os::unix::fs::PermissionsExt;
                let exec = e.metadata()?.permissions().mode() & 0o111 != 0;
                let data = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
                into.add(
                    rel,
                    if exec { 0o755 } else { 0o644 },
                    NodeKind::File(data),
                    origin,
                )?;
            } else {
                bail!(
                    "{}: only files, folders and symlinks go into the rootfs",
                    p.display()
                );
            }
        }
        Ok(())
    }
    if dir.is_dir() {
        walk(into, dir, dir, origin)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The folders `write_dir` makes have the tree's modes (0755 where it lists none), whatever
    /// the umask: the updates tree's erofs must be the same bytes on every machine.
    #[test]
    fn written_folders_do_not_take_the_umask() {
        use std::os::unix::fs::PermissionsExt as _;
        let mut t = Tree::default();
        t.nodes.insert(
            "lib/aarch64-linux-gnu/libx.so.1".into(),
            Node {
                mode: 0o644,
                kind: NodeKind::File(b"x".to_vec()),
                origin: "test".into(),
            },
        );
        t.add("etc", 0o700, NodeKind::Dir, "test").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("tree");
        // SAFETY: umask only changes this process's file creation mask; restored below.
        let old = unsafe { libc::umask(0o077) };
        let r = write_dir(&t, &out);
        unsafe { libc::umask(old) };
        r.unwrap();
        let mode = |p: &str| std::fs::metadata(out.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode("lib"), 0o755);
        assert_eq!(mode("lib/aarch64-linux-gnu"), 0o755);
        assert_eq!(mode("etc"), 0o700);
        assert_eq!(mode("lib/aarch64-linux-gnu/libx.so.1"), 0o644);
    }

    #[test]
    fn parents_are_made_and_conflicts_named() {
        let mut t = Tree::default();
        t.add("/usr/bin/kiln", 0o755, NodeKind::File(vec![1]), "kiln")
            .unwrap();
        assert_eq!(t.nodes["usr"].kind, NodeKind::Dir);
        assert_eq!(t.nodes["usr/bin"].kind, NodeKind::Dir);
        let err = t
            .add("usr/bin/kiln", 0o644, NodeKind::File(vec![2]), "overlay")
            .unwrap_err()
            .to_string();
        assert!(err.contains("kiln") && err.contains("overlay"), "{err}");
        assert!(t.add("usr/../etc", 0o644, NodeKind::Dir, "x").is_err());
    }

    #[test]
    fn symlinks_resolve() {
        let mut t = Tree::default();
        t.add(
            "lib/aarch64-linux-gnu/ld-linux-aarch64.so.1",
            0o755,
            NodeKind::File(vec![]),
            "libc6",
        )
        .unwrap();
        t.add(
            "lib/ld-linux-aarch64.so.1",
            0o777,
            NodeKind::Symlink("aarch64-linux-gnu/ld-linux-aarch64.so.1".into()),
            "libc6",
        )
        .unwrap();
        assert_eq!(
            t.resolve("/lib/ld-linux-aarch64.so.1").as_deref(),
            Some("lib/aarch64-linux-gnu/ld-linux-aarch64.so.1")
        );
        let mut into = Tree::default();
        copy_with_links(&t, &mut into, "/lib/ld-linux-aarch64.so.1").unwrap();
        assert!(into
            .nodes
            .contains_key("lib/aarch64-linux-gnu/ld-linux-aarch64.so.1"));
        assert!(into.nodes.contains_key("lib/ld-linux-aarch64.so.1"));
    }
}
