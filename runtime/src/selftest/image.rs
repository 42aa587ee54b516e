//! `image.manifest`: the running system is the one the build recorded. The manifest
//! (`/boot/kiln/manifest.json`) must be present and parse; then every file it pins is hashed as
//! it is here and now and compared:
//!
//! - the runtime, through `/proc/self/exe` (the binary that is running, not a path's current
//!   contents);
//! - the NPU library actually loaded, found in `/proc/self/maps` (the manifest's path when this
//!   process has not loaded one);
//! - every file the manifest lists on the boot partition (`/Image`, the initramfs, the dtb,
//!   `extlinux.conf`);
//! - every model and the self-check fixtures (`fixture`, `fixtures[]`) on `/models`, and no
//!   unlisted model there;
//! - `/proc/cmdline`: the `append` line of the (hashed) `extlinux.conf`, word for word, with
//!   only `kiln.*` words where `${kiln_args}` stands and `rauc.slot=A` or `B` for
//!   `rauc.slot=${kiln_slot}` (the slot `boot.scr` booted).
//!
//! A mismatch names the file and both hashes.

use super::{Ctx, Outcome};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// The file the NPU library this process mapped was loaded from, per `/proc/self/maps`: a
/// mapped file named like the manifest's library or like what the backend loads
/// (`KILN_RKNN_LIB`).
fn loaded_npu_lib(maps: &Path, names: &[&str]) -> Option<PathBuf> {
    let text = std::fs::read_to_string(maps).ok()?;
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| names.contains(&n))
        })
        .map(PathBuf::from)
}

/// [`sha256_of`] of every path, on as many threads as the CPU has (the boot files are tens of
/// MiB and the verdict waits for them), in the order given.
pub(super) fn sha256_all(paths: &[PathBuf]) -> Vec<std::io::Result<String>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    // The biggest files first, so that no thread is left with one big file at the end.
    let mut order: Vec<usize> = (0..paths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(std::fs::metadata(&paths[i]).map_or(0, |m| m.len())));
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<std::io::Result<String>>>> =
        Mutex::new((0..paths.len()).map(|_| None).collect());
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(paths.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let r = sha256_of(&paths[i]);
                    out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    out.into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(std::io::Error::other("not hashed"))))
        .collect()
}

/// Boot files nothing runs before the verdict, hashed by init when it first uses them, against
/// a sha256 file in the initramfs (which this check hashes): `(file on /boot, sha256 file)`.
const DEFERRED: &[(&str, &str)] = &[("/kiln/updates.erofs", "/etc/kiln/updates.sha256")];

/// A [`DEFERRED`] file: the initramfs's sha256 for it must be the manifest's (read, not the
/// file's bytes: init hashes those before it mounts them).
fn deferred_file(c: &mut Compare, ctx: &Ctx, rel: &str, want: Option<&str>) {
    let Some((_, sha_file)) = DEFERRED.iter().find(|(f, _)| *f == rel) else {
        return;
    };
    let at = ctx.paths.root.join(sha_file.trim_start_matches('/'));
    let got = std::fs::read_to_string(&at)
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string));
    match (got, want) {
        (Some(g), Some(w)) if g == w => c.ok.push(format!(
            "/boot{rel}: sha256 {g} in the manifest and in {sha_file}, against which init \
             hashes it before it mounts it (after the verdict)"
        )),
        (g, w) => c.bad.push(format!(
            "/boot{rel}: {sha_file} says {}, the manifest {}",
            g.as_deref().unwrap_or("nothing (missing)"),
            w.unwrap_or("nothing")
        )),
    }
}

struct Compare {
    ok: Vec<String>,
    bad: Vec<String>,
    /// Hashes taken ahead, all files at once on every core (see [`sha256_all`]).
    hashes: std::collections::HashMap<PathBuf, std::io::Result<String>>,
}

impl Compare {
    fn file(&mut self, what: &str, path: &Path, want: Option<&str>) {
        let got = self.hashes.remove(path).unwrap_or_else(|| sha256_of(path));
        self.hashed(what, path, want, got)
    }

    /// [`Compare::file`] with the file's hash already taken.
    fn hashed(
        &mut self,
        what: &str,
        path: &Path,
        want: Option<&str>,
        got: std::io::Result<String>,
    ) {
        let Some(want) = want else {
            self.bad
                .push(format!("{what}: the manifest records no sha256 for it"));
            return;
        };
        match got {
            Ok(got) if got == want => self.ok.push(format!("{what} sha256 {got}")),
            Ok(got) => self.bad.push(format!(
                "{what} ({}): sha256 {got}, manifest says {want}",
                path.display()
            )),
            Err(e) => self
                .bad
                .push(format!("{what} ({}): cannot read: {e}", path.display())),
        }
    }
}

/// The words of `/proc/cmdline` must be the `append` line's, in order, with `${kiln_args}`
/// standing for any number of `kiln.*` words and `rauc.slot=${kiln_slot}` for `rauc.slot=A|B`.
fn check_cmdline(extlinux: &str, cmdline: &str) -> Result<String, String> {
    let append = extlinux
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("append "))
        .ok_or("extlinux.conf has no append line")?;
    let want: Vec<&str> = append.split_whitespace().collect();
    let got: Vec<&str> = cmdline.split_whitespace().collect();
    let mut g = 0;
    for w in &want {
        if *w == "${kiln_args}" {
            while g < got.len() && got[g].starts_with("kiln.") {
                g += 1;
            }
            continue;
        }
        if *w == "rauc.slot=${kiln_slot}"
            && matches!(got.get(g), Some(&"rauc.slot=A") | Some(&"rauc.slot=B"))
        {
            g += 1;
            continue;
        }
        if got.get(g) != Some(w) {
            return Err(format!(
                "/proc/cmdline {cmdline:?} is not the pinned command line {append:?}: \
                 word {} is {:?}, pinned {w:?}",
                g + 1,
                got.get(g).copied().unwrap_or("(end)")
            ));
        }
        g += 1;
    }
    if g != got.len() {
        return Err(format!(
            "/proc/cmdline {cmdline:?} has words the pinned command line {append:?} does not: {:?}",
            &got[g..]
        ));
    }
    Ok(format!(
        "/proc/cmdline {:?} is the pinned {append:?}",
        cmdline.trim()
    ))
}

pub fn manifest(ctx: &Ctx) -> Outcome {
    if let Err(skip) = ctx.board() {
        return skip;
    }
    let path = ctx.paths.manifest();
    let m: Value = match std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(v) => v,
        Err(e) => {
            return Outcome::fail(
                format!("manifest {} is missing or unreadable: {e}", path.display()),
                vec![],
            )
        }
    };
    if m["kiln_manifest"].as_u64() != Some(1) {
        return Outcome::fail(
            format!(
                "{}: not a kiln manifest (kiln_manifest != 1)",
                path.display()
            ),
            vec![],
        );
    }
    let mut c = Compare {
        ok: vec![format!(
            "manifest {} (board {}, commit {})",
            path.display(),
            m["board"].as_str().unwrap_or("?"),
            m["commit"].as_str().unwrap_or("?")
        )],
        bad: Vec::new(),
        hashes: Default::default(),
    };

    // What is compared, in the order it is reported: the runtime that is running, the NPU
    // library (the one this process loaded, else the manifest's path), the boot partition's
    // files, the models. All are hashed first, together, on every core.
    let runtime = m["runtime"]["path"].as_str().unwrap_or("/usr/bin/kiln");
    let exe = ctx.paths.proc.join("self/exe");
    let npu = m["npu_runtime"].as_object().map(|npu| {
        let pinned = npu.get("path").and_then(Value::as_str).unwrap_or("");
        let name = Path::new(pinned)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("librknnrt.so");
        let want = npu.get("sha256").and_then(Value::as_str);
        let backend_lib = crate::backend::npu::ffi::default_lib_path();
        let backend_name = backend_lib
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or(name);
        match loaded_npu_lib(&ctx.paths.proc.join("self/maps"), &[name, backend_name]) {
            Some(p) => (format!("{} (loaded)", p.display()), p, want),
            None => (
                format!("{pinned} (not loaded by this process)"),
                ctx.paths.root.join(pinned.trim_start_matches('/')),
                want,
            ),
        }
    });
    let boot_files = m["boot"]["files"].as_object();
    let (deferred, files): (Vec<_>, Vec<_>) = boot_files
        .into_iter()
        .flatten()
        .partition(|(rel, _)| DEFERRED.iter().any(|(f, _)| f == rel));
    let boot_paths: Vec<PathBuf> = files
        .iter()
        .map(|(rel, _)| ctx.paths.boot.join(rel.trim_start_matches('/')))
        .collect();
    let mut listed: Vec<(String, Option<String>)> = m["models"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| {
            (
                x["name"].as_str().unwrap_or("").to_string(),
                x["sha256"].as_str().map(str::to_string),
            )
        })
        .collect();
    if let Some(name) = m["fixture"]["name"].as_str() {
        listed.push((
            name.to_string(),
            m["fixture"]["sha256"].as_str().map(str::to_string),
        ));
    }
    // Further fixtures (the seeded llama model of `model.nll`), listed the same way.
    for x in m["fixtures"].as_array().into_iter().flatten() {
        listed.push((
            x["name"].as_str().unwrap_or("").to_string(),
            x["sha256"].as_str().map(str::to_string),
        ));
    }
    let models_dir = ctx
        .paths
        .models
        .first()
        .cloned()
        .unwrap_or_else(|| ctx.paths.root.join("models"));
    // Through dm-verity the models are proved by the mapping's root hash, block by block as
    // they are read: checked once here instead of hashing every byte.
    let verity = m.get("models_verity").is_some();
    let all: Vec<PathBuf> = std::iter::once(exe.clone())
        .chain(npu.iter().map(|(_, p, _)| p.clone()))
        .chain(boot_paths.iter().cloned())
        .chain(
            listed
                .iter()
                .filter(|_| !verity)
                .map(|(name, _)| models_dir.join(name)),
        )
        .collect();
    c.hashes = all.iter().cloned().zip(sha256_all(&all)).collect();

    c.file(
        &format!("{runtime} (running, via /proc/self/exe)"),
        &exe,
        m["runtime"]["sha256"].as_str(),
    );
    if let Some((what, p, want)) = &npu {
        c.file(what, p, *want);
    }

    // The boot partition's files.
    if boot_files.is_some_and(|f| !f.is_empty()) {
        // The card's notices (SBOMs, licence texts) are checked one by one like the rest, but a
        // folder whose files all match is one evidence line, not hundreds.
        let mut folders: std::collections::BTreeMap<&str, usize> = Default::default();
        for (rel, v) in deferred {
            deferred_file(&mut c, ctx, rel, v["sha256"].as_str());
        }
        for ((rel, v), p) in files.into_iter().zip(&boot_paths) {
            let before = c.ok.len();
            c.file(&format!("/boot{rel}"), p, v["sha256"].as_str());
            if let Some(dir) = ["/kiln/licenses/", "/kiln/sbom/"]
                .into_iter()
                .find(|d| rel.starts_with(d))
            {
                if c.ok.len() > before {
                    c.ok.pop();
                    *folders.entry(dir).or_default() += 1;
                }
            }
        }
        for (dir, n) in folders {
            c.ok.push(format!(
                "/boot{} {n} files, each sha256 as the manifest lists",
                dir.trim_end_matches('/')
            ));
        }
    } else {
        c.bad.push("the manifest lists no boot files".into());
    }

    // Models: every listed one present and equal, nothing unlisted. Through dm-verity the list
    // is the mapped slot's own (a models bundle's need not be the factory models the manifest
    // lists), each file's size as it says; its bytes are proved by the root hash.
    if verity {
        match verity_mapping(ctx, &path, &models_dir) {
            Ok(mapping) => {
                c.ok.extend(mapping.ok);
                c.bad.extend(mapping.bad);
                // A damaged description: the manifest's list (sizes unknown here).
                let files = mapping
                    .files
                    .unwrap_or_else(|| listed.iter().map(|(n, _)| (n.clone(), u64::MAX)).collect());
                listed = files.iter().map(|(n, _)| (n.clone(), None)).collect();
                let mut here = Vec::new();
                for (name, size) in &files {
                    match std::fs::metadata(models_dir.join(name)) {
                        Ok(md) if md.is_file() && (md.len() == *size || *size == u64::MAX) => {
                            here.push(name.as_str())
                        }
                        Ok(md) => c.bad.push(format!(
                            "/models/{name}: {} bytes, the slot's kiln-models.json says {size}",
                            md.len()
                        )),
                        Err(e) => c.bad.push(format!(
                            "/models/{name}: listed in the slot's kiln-models.json, not on \
                             /models: {e}"
                        )),
                    }
                }
                c.ok.push(format!(
                    "/models: the {} file(s) the slot lists present at their sizes ({}), their \
                     bytes proved by that root hash as they are read, not hashed here",
                    here.len(),
                    here.join(", ")
                ));
            }
            Err(why) => c.bad.push(why),
        }
    } else {
        for (name, sha) in &listed {
            c.file(
                &format!("/models/{name}"),
                &models_dir.join(name),
                sha.as_deref(),
            );
        }
    }
    let on_disk = std::fs::read_dir(&models_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_file())
        .filter_map(|e| e.file_name().to_str().map(str::to_string));
    for f in on_disk {
        if !listed.iter().any(|(n, _)| *n == f) {
            let sha = if verity {
                "under the mapping's root hash".to_string()
            } else {
                format!(
                    "sha256 {}",
                    sha256_of(&models_dir.join(&f)).unwrap_or_else(|e| e.to_string())
                )
            };
            c.bad.push(format!(
                "/models/{f} is not in the {} ({sha})",
                if verity {
                    "slot's kiln-models.json"
                } else {
                    "manifest"
                }
            ));
        }
    }

    // The command line.
    let extlinux = std::fs::read_to_string(ctx.paths.boot.join("extlinux/extlinux.conf"));
    let cmdline = std::fs::read_to_string(ctx.paths.proc.join("cmdline"));
    match (extlinux, cmdline) {
        (Ok(e), Ok(cl)) => match check_cmdline(&e, &cl) {
            Ok(line) => c.ok.push(line),
            Err(why) => c.bad.push(why),
        },
        (Err(e), _) => c
            .bad
            .push(format!("/boot/extlinux/extlinux.conf: cannot read: {e}")),
        (_, Err(e)) => c.bad.push(format!("/proc/cmdline: cannot read: {e}")),
    }

    if c.bad.is_empty() {
        Outcome::pass(c.ok)
    } else {
        let reason = c.bad.join("; ");
        c.bad.extend(c.ok);
        Outcome::fail(reason, c.bad)
    }
}

/// What [`verity_mapping`] found: evidence, failures, and the files the slot says it holds
/// (`None`: its description is damaged, so the manifest's list stands).
struct Mapping {
    ok: Vec<String>,
    bad: Vec<String>,
    files: Option<Vec<(String, u64)>>,
}

/// `/models` is mounted from the dm-verity mapping [`crate::verity::NAME`] over a models slot
/// (`models_a` or `models_b`) the booted system believes (`crate::models_slot::trust`: the
/// factory slot its manifest names, or one signed by a key its update keyring trusts), whose
/// live table (read from the kernel) is that slot's verity parameters and whose status says no
/// corrupted block was read. A slot whose own description is damaged FAILs here by name; its
/// mapping (init's, with the manifest's `models_verity`) is still checked, so a corrupted block
/// is named too.
fn verity_mapping(ctx: &Ctx, manifest: &Path, models_dir: &Path) -> Result<Mapping, String> {
    use super::known::{self, View};
    let slot = known::mapped_slot(&ctx.paths, models_dir)?;
    let m: serde_json::Value = std::fs::read(manifest)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| format!("{}: not readable JSON", manifest.display()))?;
    let mut out = Mapping {
        ok: Vec::new(),
        bad: Vec::new(),
        files: None,
    };
    let want = match known::view(ctx, &m, &slot.part)? {
        View::Trusted(t) => {
            crate::models_slot::trust::checked(manifest, &t, &format!("/dev/{}", slot.part))?;
            out.ok.push(format!(
                "/dev/{} describes itself: {}",
                slot.part,
                t.describe()
            ));
            out.files = Some(
                t.slot
                    .meta
                    .models
                    .iter()
                    .map(|x| (x.name.clone(), x.size))
                    .collect(),
            );
            t.slot.meta.verity.clone()
        }
        View::Damaged(why) => {
            out.bad.push(format!(
                "/dev/{}: its own description is damaged: {why}",
                slot.part
            ));
            crate::verity::Params::from_manifest(manifest)?
        }
    };
    out.ok.push(format!(
        "{} mounted from {} ({}) over /dev/{} (PARTNAME={}: models slot {})",
        models_dir.display(),
        slot.dev,
        crate::verity::NAME,
        slot.part,
        slot.partname,
        slot.letter()
    ));
    match crate::verity::check(&ctx.paths.dev.join("mapper/control"), &want, &slot.part_dev) {
        Ok(l) => out.ok.extend(l),
        Err(why) => out.bad.push(why),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::board::Board;
    use super::super::testutil::FakeRoot;
    use super::super::{Ctx, Paths, Status};
    use super::*;

    fn hex_of(b: &[u8]) -> String {
        hex::encode(Sha256::digest(b))
    }

    const EXTLINUX: &str = "default kiln\nlabel kiln\n    kernel /Image\n    append console=ttyAMA0 panic=-1 ${kiln_args}\n";

    #[test]
    fn the_slot_word_is_a_or_b_where_the_append_line_has_kiln_slot() {
        let e =
            "label kiln\n    append console=ttyAMA0 panic=-1 rauc.slot=${kiln_slot} ${kiln_args}\n";
        for ok in [
            "console=ttyAMA0 panic=-1 rauc.slot=A kiln.mode=test",
            "console=ttyAMA0 panic=-1 rauc.slot=B",
        ] {
            assert!(check_cmdline(e, ok).is_ok(), "{ok}");
        }
        for bad in [
            "console=ttyAMA0 panic=-1 rauc.slot=C",
            "console=ttyAMA0 panic=-1 kiln.mode=test",
            "console=ttyAMA0 panic=-1 rauc.slot=A rauc.slot=B",
        ] {
            assert!(check_cmdline(e, bad).is_err(), "{bad}");
        }
    }

    /// A fake booted system and the manifest that describes it.
    fn system(root: &FakeRoot) -> Value {
        let exe = root.file("usr/bin/kiln", b"the kiln binary");
        std::fs::create_dir_all(root.join("proc/self")).unwrap();
        std::os::unix::fs::symlink(&exe, root.join("proc/self/exe")).unwrap();
        let lib = root.file("usr/lib/librknnrt.so", b"the npu library");
        root.file(
            "proc/self/maps",
            format!(
                "7f0000-7f1000 r-xp 00000000 00:00 1  {}\n7f2000-7f3000 rw-p 00000000 00:00 0 \n",
                lib.display()
            ),
        );
        root.file("proc/cmdline", "console=ttyAMA0 panic=-1 kiln.mode=test\n");
        root.file("boot/Image", b"kernel");
        root.file("boot/initramfs.cpio.gz", b"initramfs");
        root.file("boot/extlinux/extlinux.conf", EXTLINUX);
        root.file("models/model.gguf", b"weights");
        root.file("models/selftest.gguf", b"fixture");
        let m = serde_json::json!({
            "kiln_manifest": 1, "board": "test", "commit": "abc",
            "runtime": {"path": "/usr/bin/kiln", "sha256": hex_of(b"the kiln binary")},
            "npu_runtime": {"path": "/usr/lib/librknnrt.so", "sha256": hex_of(b"the npu library")},
            "boot": {"files": {
                "/Image": {"sha256": hex_of(b"kernel")},
                "/initramfs.cpio.gz": {"sha256": hex_of(b"initramfs")},
                "/extlinux/extlinux.conf": {"sha256": hex_of(EXTLINUX.as_bytes())},
            }},
            "models": [{"name": "model.gguf", "sha256": hex_of(b"weights")}],
            "fixture": {"name": "selftest.gguf", "sha256": hex_of(b"fixture")},
        });
        write_manifest(root, &m);
        m
    }

    fn write_manifest(root: &FakeRoot, m: &Value) {
        root.file(
            "boot/kiln/manifest.json",
            serde_json::to_vec_pretty(m).unwrap(),
        );
    }

    fn ctx(root: &FakeRoot) -> Ctx {
        Ctx {
            paths: Paths::under(root),
            board: Some(
                Board::parse("[board]\nname = \"test\"\n").expect("minimal board file parses"),
            ),
            ..Ctx::default()
        }
    }

    #[test]
    fn the_system_the_manifest_describes_passes() {
        let root = FakeRoot::new();
        system(&root);
        let o = manifest(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.evidence.iter().any(|e| e.contains("(loaded)")), "{o:?}");
        // Without a board there is nothing pinned: skip.
        let host = Ctx {
            paths: Paths::under(&root),
            ..Ctx::default()
        };
        assert_eq!(manifest(&host).status, Status::Skip);
    }

    #[test]
    fn the_cards_notices_are_one_line_when_they_match_and_named_when_not() {
        let root = FakeRoot::new();
        let mut m = system(&root);
        let files = m["boot"]["files"].as_object_mut().unwrap();
        for (rel, text) in [
            ("kiln/licenses/deb/libc6/copyright", "GPL"),
            ("kiln/licenses/README", "what is where"),
            ("kiln/sbom/kiln-test.spdx.json", "{}"),
        ] {
            root.file(&format!("boot/{rel}"), text);
            files.insert(
                format!("/{rel}"),
                serde_json::json!({"sha256": hex_of(text.as_bytes())}),
            );
        }
        write_manifest(&root, &m);
        let o = manifest(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(
            o.evidence
                .iter()
                .any(|e| e == "/boot/kiln/licenses 2 files, each sha256 as the manifest lists"),
            "{o:?}"
        );
        assert!(
            o.evidence
                .iter()
                .any(|e| e == "/boot/kiln/sbom 1 files, each sha256 as the manifest lists"),
            "{o:?}"
        );
        assert!(!o.evidence.iter().any(|e| e.contains("copyright")), "{o:?}");
        root.file("boot/kiln/licenses/deb/libc6/copyright", "edited");
        let o = manifest(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o
            .reason
            .unwrap()
            .contains("/boot/kiln/licenses/deb/libc6/copyright"));
    }

    /// With `models_verity` the models are not hashed: /models must be mounted from the
    /// mapping `kiln-models` over a models slot's partition, whose live table the kernel
    /// gives; each way that falls short FAILs by name, and a listed model must be there.
    #[test]
    fn under_verity_the_mapping_is_checked_not_the_files() {
        let root = FakeRoot::new();
        let mut m = system(&root);
        m["models_verity"] = serde_json::json!({
            "version": 1, "algorithm": "sha256", "data_block_size": 4096,
            "hash_block_size": 4096, "data_blocks": 100, "hash_start_block": 100,
            "salt": "ab".repeat(32), "root_hash": "cd".repeat(32)});
        write_manifest(&root, &m);
        // Other bytes than the manifest's sha256: not read, so not a failure by itself.
        root.file("models/model.gguf", b"other weights");
        let reason = |root: &FakeRoot| {
            let o = manifest(&ctx(root));
            assert_eq!(o.status, Status::Fail, "{o:?}");
            o.reason.unwrap()
        };
        let models = root.join("models").display().to_string();
        let r = reason(&root);
        assert!(r.contains(&format!("{models} is not mounted")), "{r}");
        assert!(!r.contains("sha256"), "{r}");
        root.file(
            "proc/self/mountinfo",
            format!("30 22 254:4 / {models} ro - erofs /dev/vda4 ro\n"),
        );
        let r = reason(&root);
        assert!(
            r.contains("not from the dm-verity mapping kiln-models"),
            "{r}"
        );
        root.map_models("vda6", 6, "data");
        let r = reason(&root);
        assert!(
            r.contains("maps /dev/vda6, which is not a models slot (a partition named models_a or models_b)"),
            "{r}"
        );
        // The right partition: what is left is the kernel's table, which a file cannot give.
        root.remove("sys/dev/block/253:0/slaves/vda6");
        root.map_models("vda4", 4, "models_a");
        root.file("dev/mapper/control", "");
        // The partition's own trailer: missing, empty, another one than the manifest names
        // (unsigned: not believed), with other verity parameters, then the one named.
        let r = reason(&root);
        assert!(r.contains("dev/vda4") && r.contains("opening"), "{r}");
        root.file("dev/vda4", vec![0u8; 1 << 20]);
        let r = reason(&root);
        assert!(r.contains("holds no kiln-models.json"), "{r}");
        let (bytes, sha) = slot_bytes(&m["models_verity"]);
        let mut other = m["models_verity"].clone();
        other["salt"] = serde_json::json!("ef".repeat(32));
        root.file("dev/vda4", slot_bytes(&other).0);
        let r = reason(&root);
        assert!(
            r.contains(
                "is not signed and is not the factory slot this system's manifest names (none)"
            ),
            "{r}"
        );
        m["models_slot"] = serde_json::json!({ "meta_sha256": slot_bytes(&other).1 });
        write_manifest(&root, &m);
        let r = reason(&root);
        assert!(r.contains("other verity parameters"), "{r}");
        m["models_slot"]["meta_sha256"] = serde_json::json!(sha);
        write_manifest(&root, &m);
        root.file("dev/vda4", bytes);
        let o = manifest(&ctx(&root));
        let r = o.reason.clone().unwrap();
        assert!(r.contains("device-mapper table read of kiln-models"), "{r}");
        assert!(
            o.evidence.iter().any(|e| e.contains(
                "is the factory slot this system's manifest names (models_slot.meta_sha256)"
            )),
            "{o:?}"
        );
        // A damaged description (one byte of its kiln-models.json): named, and the mapping
        // (init's, with the manifest's parameters) is still checked.
        let mut damaged = std::fs::read(root.join("dev/vda4")).unwrap();
        let footer = crate::models_slot::Footer::decode(
            &damaged[damaged.len() - 4096..],
            damaged.len() as u64,
        )
        .unwrap()
        .unwrap();
        damaged[(footer.meta_off + footer.meta_len / 2) as usize] ^= 1;
        let good = root.file("dev/vda4", &damaged);
        let r = reason(&root);
        assert!(
            r.contains("/dev/vda4: its own description is damaged")
                && r.contains("does not match the sha256 its footer gives")
                && r.contains("device-mapper table read of kiln-models"),
            "{r}"
        );
        damaged[(footer.meta_off + footer.meta_len / 2) as usize] ^= 1;
        std::fs::write(good, &damaged).unwrap();
        // The files are the slot's list: one of another size, then one missing, are named.
        root.file("models/model.gguf", b"other weights, longer");
        let r = reason(&root);
        assert!(
            r.contains("/models/model.gguf: 21 bytes, the slot's kiln-models.json says 13"),
            "{r}"
        );
        root.remove("models/model.gguf");
        let r = reason(&root);
        assert!(
            r.contains("/models/model.gguf: listed in the slot's kiln-models.json, not on /models"),
            "{r}"
        );
        // And one the slot does not list.
        root.file("models/model.gguf", b"other weights");
        root.file("models/extra.gguf", b"x");
        let r = reason(&root);
        assert!(
            r.contains("/models/extra.gguf is not in the slot's kiln-models.json"),
            "{r}"
        );
    }

    /// A 1 MiB models slot whose trailer gives `verity` (unsigned, as the factory's), and
    /// its kiln-models.json's sha256.
    fn slot_bytes(verity: &serde_json::Value) -> (Vec<u8>, String) {
        use crate::models_slot as ms;
        let meta = ms::Meta {
            format: ms::FORMAT,
            models: vec![ms::Model {
                name: "model.gguf".into(),
                size: 13,
                sha256: hex_of(b"other weights"),
            }],
            verity: serde_json::from_value(verity.clone()).unwrap(),
            known_answers: Default::default(),
        };
        let json = serde_json::to_vec(&meta).unwrap();
        let len = 1u64 << 20;
        let footer = ms::layout(meta.hash_tree_end().unwrap(), &json, 0, len).unwrap();
        let mut c = std::io::Cursor::new(vec![0u8; len as usize]);
        ms::write_trailer(&mut c, len, &footer, &json, &[]).unwrap();
        (c.into_inner(), hex::encode(footer.meta_sha256))
    }

    #[test]
    fn the_updates_tree_is_left_to_init_but_its_two_hashes_must_agree() {
        let tree = hex_of(b"the updates tree");
        let setup = |sha_file: Option<&str>| {
            let root = FakeRoot::new();
            let mut m = system(&root);
            m["boot"]["files"]["/kiln/updates.erofs"] = serde_json::json!({"sha256": tree});
            write_manifest(&root, &m);
            if let Some(s) = sha_file {
                root.file(
                    "etc/kiln/updates.sha256",
                    format!("{s}  /boot/kiln/updates.erofs\n").as_bytes(),
                );
            }
            root
        };
        // Agreeing: PASS without the file on /boot at all (it is not read before the verdict).
        let root = setup(Some(&tree));
        let o = manifest(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(
            o.evidence
                .iter()
                .any(|e| e.contains("/boot/kiln/updates.erofs: sha256") && e.contains(&tree)),
            "{:?}",
            o.evidence
        );
        // The initramfs's sha256 differs from the manifest's, or is missing: FAIL naming both.
        for (what, s) in [("other", Some("00".repeat(32))), ("missing", None)] {
            let root = setup(s.as_deref());
            let o = manifest(&ctx(&root));
            assert_eq!(o.status, Status::Fail, "{what}: {o:?}");
            let r = o.reason.unwrap();
            assert!(
                r.contains("/etc/kiln/updates.sha256") && r.contains(&tree),
                "{what}: {r}"
            );
        }
    }

    #[test]
    fn each_difference_fails_naming_the_file_and_both_hashes() {
        // A manifest edited to another kiln hash.
        let root = FakeRoot::new();
        let mut m = system(&root);
        m["runtime"]["sha256"] = Value::from("00".repeat(32));
        write_manifest(&root, &m);
        let o = manifest(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        let r = o.reason.unwrap();
        assert!(
            r.contains("/usr/bin/kiln")
                && r.contains(&"00".repeat(32))
                && r.contains(&hex_of(b"the kiln binary")),
            "{r}"
        );

        // No manifest, and one that does not parse.
        let root = FakeRoot::new();
        system(&root);
        root.remove("boot/kiln/manifest.json");
        let o = manifest(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("missing or unreadable"));
        root.file("boot/kiln/manifest.json", "{not json");
        assert_eq!(manifest(&ctx(&root)).status, Status::Fail);

        // A flipped byte in a model, an unlisted model, a changed kernel, another library.
        for (what, rel, contents) in [
            ("model", "models/model.gguf", &b"weightS"[..]),
            ("unlisted", "models/extra.gguf", b"x"),
            ("kernel", "boot/Image", b"kernel2"),
            ("library", "usr/lib/librknnrt.so", b"the stand-in"),
        ] {
            let root = FakeRoot::new();
            system(&root);
            root.file(rel, contents);
            let o = manifest(&ctx(&root));
            assert_eq!(o.status, Status::Fail, "{what}: {o:?}");
            let name = rel.rsplit('/').next().unwrap();
            assert!(o.reason.unwrap().contains(name), "{what}");
        }

        // A command line with a word that is not pinned, or missing one.
        for cl in [
            "console=ttyAMA0 panic=-1 kiln.mode=test init=/bin/sh",
            "console=ttyS0 panic=-1",
            "console=ttyAMA0",
        ] {
            let root = FakeRoot::new();
            system(&root);
            root.file("proc/cmdline", cl);
            let o = manifest(&ctx(&root));
            assert_eq!(o.status, Status::Fail, "{cl}: {o:?}");
            assert!(o.reason.unwrap().contains("/proc/cmdline"), "{cl}");
        }
    }
}
