//! Making the tools root from its pinned packages, without debootstrap, apt or dpkg on the host
//! (`docs/rootless.md`, decision 1), the same way as root or as an ordinary user:
//!
//! 1. every pin resolved and verified (cache → archive → snapshot, sha256);
//! 2. an empty root laid out as debootstrap lays out bookworm (merged `/usr`: `bin`, `sbin`,
//!    `lib*` as links into `usr/`), with placeholders for the host's device nodes
//!    ([`super::enter::DEVICES`]) and an empty dpkg database;
//! 3. every package's `data.tar` unpacked into it by kiln (the `ar`, `tar`, `xz2` and `zstd`
//!    crates): enough of a system for dpkg and the maintainer scripts to run;
//! 4. inside the root (entered as every command is, [`super::enter`]), the root's own dpkg:
//!    `dpkg --force-depends --unpack` of every pinned package, then `dpkg --configure -a` (what
//!    debootstrap's second stage does). The maintainer scripts run (mawk's makes `/usr/bin/awk`,
//!    base-passwd's `/etc/passwd`), and dpkg writes the status database [`super::ToolsRoot::verify`]
//!    reads. Services are not started (`policy-rc.d` says 101 while it runs).
//!
//! Made in `.<key>.tmp` beside the roots and renamed into place when whole.

use super::enter::{Entry, DEVICES};
use super::{root_dir, ToolsRoot, PINS};
use crate::pins::{self, Cache, Input};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The top-level links of a merged-`/usr` bookworm amd64 root (as debootstrap makes them).
const MERGED: &[&str] = &["bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// Where the pinned .debs are put inside the root while dpkg installs them.
const DEBS: &str = "var/cache/kiln-debs";

/// Make the root: resolve every pin, lay out, unpack, then dpkg inside.
pub fn make(root: &ToolsRoot, inputs: &[Input], offline: bool) -> Result<()> {
    let t0 = Instant::now();
    println!(
        "tools root: making {} ({} pinned packages of {PINS}; once per pin list) as {}",
        root.key.short(),
        inputs.len(),
        root.entry.describe()
    );
    let cache = Cache::user()?;
    let all: Vec<&Input> = inputs.iter().collect();
    let mut debs = Vec::new();
    let mut missing = Vec::new();
    let got = pins::resolve_all(&cache, &all, offline, &pins::apt_fetch, pins::FETCH_JOBS);
    for (i, r) in inputs.iter().zip(got) {
        match r {
            Ok(p) => debs.push((i, p)),
            Err(e) => missing.push(format!("{e:#}")),
        }
    }
    if !missing.is_empty() {
        bail!(
            "cannot make the tools root: {} package(s) missing:\n  - {}",
            missing.len(),
            missing.join("\n  - ")
        );
    }
    println!(
        "tools root: {} packages resolved and verified in {:.1} s",
        debs.len(),
        t0.elapsed().as_secs_f64()
    );
    let base = root_dir()?;
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let tmp = base.join(format!(".{}.tmp", root.key.short()));
    if tmp.exists() {
        remove_tree(&root.entry, &tmp)?;
    }
    lay_out(&tmp)?;

    // 3. Unpacked by kiln.
    let t = Instant::now();
    for (n, (i, p)) in debs.iter().enumerate() {
        unpack(p, &tmp).with_context(|| format!("unpacking {} {}", i.name, i.version))?;
        if (n + 1) % 50 == 0 {
            println!(
                "tools root: {} of {} packages unpacked ({:.0} s)",
                n + 1,
                debs.len(),
                t.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "tools root: {} packages unpacked in {:.0} s",
        debs.len(),
        t.elapsed().as_secs_f64()
    );

    // 4. dpkg inside: the .debs linked in (the cache and the roots share a file system, else
    // copied), named in pin order.
    let in_root = tmp.join(DEBS);
    std::fs::create_dir_all(&in_root)?;
    let mut names = Vec::new();
    for (n, (i, p)) in debs.iter().enumerate() {
        let name = format!("{n:04}_{}.deb", i.name);
        let dst = in_root.join(&name);
        if std::fs::hard_link(p, &dst).is_err() {
            std::fs::copy(p, &dst).with_context(|| format!("copying {}", p.display()))?;
        }
        names.push(format!("/{DEBS}/{name}"));
    }
    let t = Instant::now();
    let env = [
        ("DEBIAN_FRONTEND", "noninteractive".to_string()),
        ("DEBCONF_NONINTERACTIVE_SEEN", "true".into()),
        ("LC_ALL", "C".into()),
    ];
    let mut unpack_argv = vec![
        "dpkg".to_string(),
        "--force-depends".into(),
        "--force-unsafe-io".into(),
        "--unpack".into(),
    ];
    unpack_argv.extend(names);
    dpkg(&root.entry, &tmp, &env, &unpack_argv, "dpkg --unpack")?;
    println!(
        "tools root: dpkg --unpack of {} packages in {:.0} s",
        debs.len(),
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let configure: Vec<String> = ["dpkg", "--force-unsafe-io", "--configure", "-a"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    dpkg(&root.entry, &tmp, &env, &configure, "dpkg --configure -a")?;
    println!(
        "tools root: dpkg --configure -a in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    for f in [in_root.as_path(), &tmp.join("usr/sbin/policy-rc.d")] {
        if f.is_dir() {
            std::fs::remove_dir_all(f).with_context(|| format!("removing {}", f.display()))?;
        } else if f.exists() {
            std::fs::remove_file(f).with_context(|| format!("removing {}", f.display()))?;
        }
    }
    // Whole only if dpkg says so, before it is renamed into place.
    ToolsRoot {
        dir: tmp.clone(),
        ..root.clone()
    }
    .verify()
    .context("the root dpkg made")?;
    std::fs::write(tmp.join(".kiln-tools-root"), format!("{}\n", root.key))?;
    if root.dir.exists() {
        remove_tree(&root.entry, &root.dir)?;
    }
    std::fs::rename(&tmp, &root.dir)
        .with_context(|| format!("renaming into {}", root.dir.display()))?;
    println!(
        "tools root: made {} in {:.0} s",
        root.dir.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Run dpkg in the root being made; its output is shown only if it fails.
fn dpkg(
    entry: &Entry,
    root: &Path,
    env: &[(&str, String)],
    argv: &[String],
    what: &str,
) -> Result<()> {
    let out = super::enter::chroot_command(entry, root, &[], Path::new("/"), env, argv)
        .output()
        .with_context(|| format!("running {what} in the tools root being made"))?;
    if !out.status.success() {
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let tail: Vec<&str> = all.lines().rev().take(30).collect();
        bail!(
            "{what} in the tools root being made ({}) failed ({}):\n{}",
            root.display(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// The empty root: merged `/usr`, the kernel's file systems' mount points, device
/// placeholders, an empty dpkg database, and a `policy-rc.d` that starts no service.
pub fn lay_out(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let mk = |rel: &str, mode: u32| -> Result<PathBuf> {
        let p = dir.join(rel);
        std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))?;
        Ok(p)
    };
    mk("", 0o755)?;
    mk("usr", 0o755)?;
    for l in MERGED {
        mk(&format!("usr/{l}"), 0o755)?;
        symlink(format!("usr/{l}"), dir.join(l))?;
    }
    for d in [
        "etc",
        "proc",
        "sys",
        "dev",
        "root",
        "var/lib/dpkg/info",
        "var/lib/dpkg/updates",
    ] {
        mk(d, if d == "root" { 0o700 } else { 0o755 })?;
    }
    mk("tmp", 0o1777)?;
    mk("dev/shm", 0o1777)?;
    mk("dev/pts", 0o755)?;
    for n in DEVICES {
        std::fs::write(dir.join("dev").join(n), b"")?;
    }
    for (l, t) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(t, dir.join("dev").join(l))?;
    }
    for f in ["status", "available"] {
        std::fs::write(dir.join("var/lib/dpkg").join(f), b"")?;
    }
    let rc = dir.join("usr/sbin/policy-rc.d");
    std::fs::write(
        &rc,
        "#!/bin/sh\n# kiln: no service starts while the tools root is made\nexit 101\n",
    )?;
    std::fs::set_permissions(&rc, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Unpack a .deb's `data.tar` into `dir`: modes and times kept, owners left to dpkg (it sets
/// them when it unpacks the package again inside), device nodes skipped (a Debian package
/// ships none; the root's come from the host, [`DEVICES`]).
pub fn unpack(deb: &Path, dir: &Path) -> Result<()> {
    let dir = dir
        .canonicalize()
        .with_context(|| format!("{}", dir.display()))?;
    crate::archive::with_data_tar(deb, |tar| {
        tar.set_preserve_permissions(true);
        tar.set_preserve_mtime(true);
        tar.set_overwrite(true);
        tar.set_unpack_xattrs(false);
        for e in tar.entries()? {
            let mut e = e?;
            let kind = e.header().entry_type();
            if kind.is_block_special() || kind.is_character_special() || kind.is_fifo() {
                continue;
            }
            let path = crate::archive::entry_path(&e)?;
            if path.is_empty() {
                continue;
            }
            // A directory the merged layout already has as a link (`./bin/`, `./lib64/`).
            if kind.is_dir() && dir.join(path.trim_end_matches('/')).is_symlink() {
                continue;
            }
            e.unpack_in(&dir)
                .with_context(|| format!("{path} into {}", dir.display()))?;
        }
        Ok(())
    })
}

/// Remove a root (or a half-made one): as the user, inside its namespace, where every owner
/// dpkg gave a file is the user's to remove.
pub fn remove_tree(entry: &Entry, d: &Path) -> Result<()> {
    let d = d.display().to_string();
    let status = entry
        .command(&["rm", "-rf", "--one-file-system", &d])
        .status()
        .with_context(|| format!("removing {d}"))?;
    if !status.success() {
        bail!("removing {d} failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A .deb whose data has a file under `./bin` (a link in the merged layout), a directory
    /// entry for `./lib64/`, a hard link and a symlink.
    fn deb(dir: &Path) -> PathBuf {
        let mut t = tar::Builder::new(Vec::new());
        let add_dir = |t: &mut tar::Builder<Vec<u8>>, p: &str| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
            h.set_cksum();
            t.append_data(&mut h, p, &[][..]).unwrap();
        };
        add_dir(&mut t, "./");
        add_dir(&mut t, "./bin/");
        add_dir(&mut t, "./lib64/");
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o4755);
        h.set_mtime(1_000_000);
        h.set_cksum();
        t.append_data(&mut h, "./bin/tool", &b"hi\n"[..]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Link);
        h.set_size(0);
        h.set_cksum();
        t.append_link(&mut h, "./bin/tool2", "./bin/tool").unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_cksum();
        t.append_link(&mut h, "./lib64/ld.so", "/usr/lib/ld.so")
            .unwrap();
        let data = xz(&t.into_inner().unwrap());
        let path = dir.join("p.deb");
        let mut ar = ar::Builder::new(std::fs::File::create(&path).unwrap());
        for (id, bytes) in [("debian-binary", &b"2.0\n"[..]), ("data.tar.xz", &data[..])] {
            let h = ar::Header::new(id.as_bytes().to_vec(), bytes.len() as u64);
            ar.append(&h, bytes).unwrap();
        }
        path
    }

    fn xz(b: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut e = xz2::write::XzEncoder::new(Vec::new(), 6);
        e.write_all(b).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn a_package_unpacks_into_the_merged_layout_with_its_modes_and_links() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        lay_out(&root).unwrap();
        unpack(&deb(d.path()), &root).unwrap();
        let tool = root.join("usr/bin/tool");
        assert_eq!(std::fs::read(&tool).unwrap(), b"hi\n");
        let m = std::fs::metadata(&tool).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o4755);
        assert_eq!(m.mtime(), 1_000_000);
        assert_eq!(
            std::fs::metadata(root.join("usr/bin/tool2")).unwrap().ino(),
            m.ino()
        );
        assert!(root.join("bin").is_symlink());
        assert_eq!(
            std::fs::read_link(root.join("usr/lib64/ld.so")).unwrap(),
            Path::new("/usr/lib/ld.so")
        );
        assert_eq!(
            std::fs::metadata(root.join("tmp"))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777,
            0o1777
        );
        for n in DEVICES {
            assert!(root.join("dev").join(n).is_file(), "{n}");
        }
    }

    #[test]
    fn a_file_that_is_not_a_package_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        lay_out(&root).unwrap();
        let f = d.path().join("x.deb");
        std::fs::write(&f, b"not an ar archive").unwrap();
        let e = format!("{:#}", unpack(&f, &root).unwrap_err());
        assert!(e.contains("x.deb"), "{e}");
    }
}
