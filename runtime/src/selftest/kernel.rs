//! `kernel.release`, `kernel.config`, `kernel.modules`, `kernel.log`.

use super::{Ctx, Outcome};
use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};

/// `uname -r`, read where a fake tree can stand in for it.
pub fn running_release(proc: &Path) -> Result<String, String> {
    let p = proc.join("sys/kernel/osrelease");
    std::fs::read_to_string(&p)
        .map(|s| s.trim().to_string())
        .map_err(|e| format!("reading {}: {e}", p.display()))
}

pub fn release(ctx: &Ctx) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let Some(want) = &board.expect.kernel_release else {
        return Outcome::fail(
            "the board file pins no kernel_release",
            vec![format!("board {}", board.board.name)],
        );
    };
    match running_release(&ctx.paths.proc) {
        Err(e) => Outcome::fail(e, vec![]),
        Ok(got) if &got == want => Outcome::pass(vec![format!("uname -r = {got} (pinned)")]),
        Ok(got) => Outcome::fail(
            format!("running kernel {got} is not the pinned {want}"),
            vec![format!("uname -r = {got}"), format!("pinned = {want}")],
        ),
    }
}

/// The GNU build-id of an ELF file (its `NT_GNU_BUILD_ID` note), as hex: what ties a module the
/// kernel holds (`/sys/module/NAME/notes/.note.gnu.build-id`) to the file it was loaded from.
/// Read by hand: a bounds-checked walk of the section headers and one note list is all it takes,
/// and an ELF crate would ship to the board for these lines.
pub fn elf_build_id(elf: &[u8]) -> Result<String, String> {
    let u16_at = |o: usize| -> Result<usize, String> {
        elf.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .ok_or_else(|| format!("truncated at byte {o}"))
    };
    let u32_at = |o: usize| -> Result<usize, String> {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| format!("truncated at byte {o}"))
    };
    let u64_at = |o: usize| -> Result<usize, String> {
        elf.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| format!("truncated at byte {o}"))
    };
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let (shoff, shentsize, shnum) = (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?);
    for i in 0..shnum {
        let sh = shoff
            .checked_add(i.checked_mul(shentsize).ok_or("section table overflows")?)
            .ok_or("section table overflows")?;
        // SHT_NOTE
        if u32_at(sh + 4)? != 7 {
            continue;
        }
        let (off, size) = (u64_at(sh + 0x18)?, u64_at(sh + 0x20)?);
        let notes = elf
            .get(off..off.checked_add(size).ok_or("note section overflows")?)
            .ok_or_else(|| format!("note section at {off} is past the end"))?;
        if let Some(id) = note_build_id(notes) {
            return Ok(id);
        }
    }
    Err("no NT_GNU_BUILD_ID note".into())
}

/// The build-id in a list of ELF notes (`namesz descsz type name desc`, each padded to 4 bytes),
/// as the kernel also exposes one note section under `/sys/module/NAME/notes/`.
pub fn note_build_id(mut notes: &[u8]) -> Option<String> {
    let pad = |n: usize| n.checked_add(3).map(|v| v & !3);
    while notes.len() >= 12 {
        let w = |o: usize| u32::from_le_bytes([notes[o], notes[o + 1], notes[o + 2], notes[o + 3]]);
        let (namesz, descsz, ty) = (w(0) as usize, w(4) as usize, w(8));
        let name_end = 12usize.checked_add(pad(namesz)?)?;
        let desc_end = name_end.checked_add(pad(descsz)?)?;
        let name = notes.get(12..12 + namesz)?;
        let desc = notes.get(name_end..name_end.checked_add(descsz)?)?;
        // NT_GNU_BUILD_ID from the "GNU" owner.
        if ty == 3 && name == b"GNU\0" && !desc.is_empty() {
            return Some(hex::encode(desc));
        }
        notes = notes.get(desc_end..)?;
    }
    None
}

/// `kernel.modules`, for a board whose kernel comes from a package and loads modules (the
/// manifest's `kernel_modules`; None for a kernel with its drivers built in, whose report has
/// no such check). Positive evidence that what runs is what was built, per module of the load
/// order (the recipe's list and its dependencies):
/// - it is live in the running kernel (`/proc/modules`, state `Live`);
/// - its file in the initramfs has the sha256 the manifest records (the build took it from the
///   pinned package, decompressed);
/// - the module the kernel holds is that file: its build-id (`/sys/module/NAME/notes`) is the
///   file's.
pub fn modules(ctx: &Ctx) -> Option<Outcome> {
    let path = ctx.paths.manifest();
    let m: serde_json::Value = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())?;
    // A board without modules has `"kernel_modules": null` in its manifest.
    let km = m.get("kernel_modules").filter(|v| !v.is_null())?;
    Some(check_modules(ctx, km))
}

fn check_modules(ctx: &Ctx, km: &serde_json::Value) -> Outcome {
    let Some(files) = km["files"].as_array() else {
        return Outcome::fail("the manifest's kernel_modules has no files", vec![]);
    };
    let release = km["release"].as_str().unwrap_or("?");
    match running_release(&ctx.paths.proc) {
        Ok(r) if r == release => {}
        Ok(r) => {
            return Outcome::fail(
                format!("the manifest's modules are {release}'s, the running kernel is {r}"),
                vec![],
            )
        }
        Err(e) => return Outcome::fail(e, vec![]),
    }
    let pm = ctx.paths.proc.join("modules");
    let proc_modules = match std::fs::read_to_string(&pm) {
        Ok(t) => t,
        Err(e) => return Outcome::fail(format!("reading {}: {e}", pm.display()), vec![]),
    };
    let live: BTreeMap<&str, &str> = proc_modules
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            Some((*w.first()?, *w.get(4)?))
        })
        .collect();
    let entries: Vec<(&str, &str, Option<&str>)> = files
        .iter()
        .map(|f| {
            (
                f["name"].as_str().unwrap_or("?"),
                f["path"].as_str().unwrap_or(""),
                f["sha256"].as_str(),
            )
        })
        .collect();
    let paths: Vec<PathBuf> = entries
        .iter()
        .map(|(_, p, _)| ctx.paths.root.join(p.trim_start_matches('/')))
        .collect();
    let hashes = super::image::sha256_all(&paths);
    let mut bad = Vec::new();
    let mut bytes = 0u64;
    for (((name, rel, want), file), got) in entries.iter().zip(&paths).zip(hashes) {
        // The kernel names a module after its file, `-` as `_`.
        let kname = name.replace('-', "_");
        match live.get(kname.as_str()) {
            Some(&"Live") => {}
            Some(state) => {
                bad.push(format!("{name}: in /proc/modules but {state}, not Live"));
                continue;
            }
            None => {
                bad.push(format!("{name}: not loaded (not in /proc/modules)"));
                continue;
            }
        }
        match (got, want) {
            (Ok(g), Some(w)) if g == *w => {}
            (Ok(g), w) => {
                bad.push(format!(
                    "{name}: {rel} has sha256 {g}, the manifest {}",
                    w.unwrap_or("none")
                ));
                continue;
            }
            (Err(e), _) => {
                bad.push(format!("{name}: cannot read {rel}: {e}"));
                continue;
            }
        }
        let file_id = std::fs::read(file)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                bytes += b.len() as u64;
                elf_build_id(&b)
            });
        let note = ctx
            .paths
            .sys
            .join(format!("module/{kname}/notes/.note.gnu.build-id"));
        let held = std::fs::read(&note)
            .map_err(|e| format!("reading {}: {e}", note.display()))
            .and_then(|b| {
                note_build_id(&b).ok_or_else(|| format!("{}: no build-id note", note.display()))
            });
        match (file_id, held) {
            (Ok(f), Ok(h)) if f == h => {}
            (Ok(f), Ok(h)) => bad.push(format!(
                "{name}: the kernel holds build-id {h}, {rel} is {f}: not the module that was loaded"
            )),
            (Err(e), _) => bad.push(format!("{name}: {rel}: {e}")),
            (_, Err(e)) => bad.push(format!("{name}: {e}")),
        }
    }
    // Firmware the modules request: present with the manifest's sha256 (the kernel reads it
    // only when the device probes, so its use is not observable before that).
    let mut fw_ev = Vec::new();
    if let Some(fw) = km["firmware"]["files"].as_array() {
        let paths: Vec<PathBuf> = fw
            .iter()
            .map(|f| {
                let p = f["path"].as_str().unwrap_or("");
                ctx.paths.root.join(p.trim_start_matches('/'))
            })
            .collect();
        for ((f, p), got) in fw.iter().zip(&paths).zip(super::image::sha256_all(&paths)) {
            let name = f["file"].as_str().unwrap_or("?");
            let by = f["requested_by"].as_str().unwrap_or("?");
            match (got, f["sha256"].as_str()) {
                (Ok(g), Some(w)) if g == w => fw_ev.push(format!(
                    "firmware {name} (requested by {by}; read by the kernel when the device \
                     probes): sha256 as the manifest's, from {} {}",
                    km["firmware"]["package"]["input"].as_str().unwrap_or("?"),
                    km["firmware"]["package"]["version"].as_str().unwrap_or("?"),
                )),
                (Ok(g), w) => bad.push(format!(
                    "firmware {name}: {} has sha256 {g}, the manifest {}",
                    p.display(),
                    w.unwrap_or("none")
                )),
                (Err(e), _) => {
                    bad.push(format!("firmware {name}: cannot read {}: {e}", p.display()))
                }
            }
        }
    }
    let pkg = &km["package"];
    let mut ev = vec![format!(
        "{} module(s) of {} {} (sha256 {}) for {release}: {} listed by the recipe, with their dependencies",
        entries.len(),
        pkg["input"].as_str().unwrap_or("?"),
        pkg["version"].as_str().unwrap_or("?"),
        pkg["sha256"].as_str().unwrap_or("?"),
        km["load"].as_array().map_or(0, Vec::len),
    )];
    if bad.is_empty() {
        ev.push(format!(
            "all Live in /proc/modules; each file ({:.2} MiB in all) has the manifest's sha256, \
             and each module the kernel holds has its file's build-id (/sys/module/*/notes)",
            bytes as f64 / 1048576.0
        ));
        ev.extend(fw_ev);
        Outcome::pass(ev)
    } else {
        let n = bad.len();
        let mut reason = bad[..n.min(4)].join("; ");
        if n > 4 {
            reason.push_str(&format!("; and {} more", n - 4));
        }
        ev.extend(bad);
        Outcome::fail(format!("{n} of {} module(s): {reason}", entries.len()), ev)
    }
}

/// A kernel `.config` as option → value; `# CONFIG_X is not set` becomes `n`.
pub fn parse_config(text: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("# ") {
            if let Some(name) = rest.strip_suffix(" is not set") {
                if name.starts_with("CONFIG_") {
                    m.insert(name.to_string(), "n".to_string());
                }
            }
        } else if let Some((k, v)) = line.split_once('=') {
            if k.starts_with("CONFIG_") {
                m.insert(k.to_string(), v.to_string());
            }
        }
    }
    m
}

/// One fragment line as (option, wanted value); `None` for blank lines and comments.
fn fragment_option(line: &str) -> Option<(String, String)> {
    let one = parse_config(line);
    one.into_iter().next()
}

/// Where the running kernel's config comes from, and its text.
fn running_config(ctx: &Ctx, release: &str) -> Result<(String, String), String> {
    let gz = ctx.paths.proc.join("config.gz");
    if gz.exists() {
        let f = std::fs::File::open(&gz).map_err(|e| format!("opening {}: {e}", gz.display()))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(f)
            .read_to_string(&mut text)
            .map_err(|e| format!("decompressing {}: {e}", gz.display()))?;
        return Ok((gz.display().to_string(), text));
    }
    let candidates: Vec<PathBuf> = vec![
        ctx.paths.boot.join(format!("config-{release}")),
        ctx.paths.boot.join("kiln/kernel.config"),
        ctx.paths.boot.join("config"),
    ];
    let Some(p) = candidates.iter().find(|p| p.exists()) else {
        return Err(format!(
            "no {} (CONFIG_IKCONFIG_PROC) and no shipped .config ({})",
            gz.display(),
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    let text = std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
    // A shipped file could belong to another build: its header version plus LOCALVERSION must
    // be the running release.
    let header = text
        .lines()
        .take(5)
        .find_map(|l| {
            let rest = l.strip_prefix("# Linux/")?;
            let ver = rest.split_whitespace().nth(1)?;
            Some(ver.to_string())
        })
        .ok_or_else(|| format!("{} has no `# Linux/<arch> <version>` header", p.display()))?;
    let local = parse_config(&text)
        .get("CONFIG_LOCALVERSION")
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_default();
    let built = format!("{header}{local}");
    // Debian sets its release (`6.12.118+deb13-arm64`) outside the config, which says
    // `6.12.118` and an empty LOCALVERSION: its `config-<release>` holds when it names the running
    // release and its version is the release's before the `+`.
    let debian = *p == candidates[0] && release.strip_prefix(&format!("{built}+")).is_some();
    if built != release.trim_end_matches('+') && !debian {
        return Err(format!(
            "{} is the config of {built}, but {release} is running",
            p.display()
        ));
    }
    Ok((format!("{} (for {built})", p.display()), text))
}

pub fn config(ctx: &Ctx) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let want: Vec<(String, String)> = board
        .expect
        .kernel_config
        .iter()
        .filter_map(|l| fragment_option(l))
        .collect();
    if want.is_empty() {
        return Outcome::fail("the board file lists no kernel_config options", vec![]);
    }
    let release = match running_release(&ctx.paths.proc) {
        Ok(r) => r,
        Err(e) => return Outcome::fail(e, vec![]),
    };
    let (source, text) = match running_config(ctx, &release) {
        Ok(x) => x,
        Err(e) => return Outcome::fail(e, vec![]),
    };
    let have = parse_config(&text);
    let mut wrong = Vec::new();
    for (k, v) in &want {
        let got = have.get(k).map(String::as_str).unwrap_or("n");
        if got != v {
            wrong.push(format!("{k}: fragment wants {v}, running kernel has {got}"));
        }
    }
    let head = format!("source: {source}, {} options", have.len());
    if wrong.is_empty() {
        Outcome::pass(vec![
            head,
            format!("{}/{} fragment options hold", want.len(), want.len()),
        ])
    } else {
        let n = wrong.len();
        let mut ev = vec![head];
        ev.extend(wrong);
        Outcome::fail(
            format!("{n} of {} fragment options do not hold", want.len()),
            ev,
        )
    }
}

/// Lines that mean the kernel or the NPU driver hit trouble (npu.md §2.4 for the RKNPU ones).
pub fn bad_kernel_line(msg: &str) -> Option<&'static str> {
    let lower = msg.to_ascii_lowercase();
    if msg.contains("RKNPU: soft reset") {
        Some("NPU soft reset")
    } else if lower.contains("job timeout") {
        Some("NPU job timeout")
    } else if lower.contains("iommu")
        && lower
            .split(|c: char| !c.is_ascii_alphabetic())
            .any(|w| w == "fault" || w == "faults")
    {
        Some("IOMMU fault")
    } else if msg.contains("Oops") || msg.contains("Unable to handle kernel") {
        Some("oops")
    } else if msg.contains("Kernel panic") {
        Some("panic")
    } else if msg.contains("BUG:") || msg.contains("Internal error:") {
        Some("kernel BUG")
    } else {
        None
    }
}

/// The message of one `/dev/kmsg` record (`prio,seq,usec,flags;message`), or the line itself
/// for a plain-text fixture.
fn kmsg_message(record: &str) -> &str {
    match record.split_once(';') {
        Some((head, msg)) if head.split(',').count() >= 3 => msg,
        _ => record,
    }
}

/// Every record in `/dev/kmsg` since boot. The device returns one record per `read` and
/// `EAGAIN` at the end when opened non-blocking; a fixture file is read as lines.
fn read_kmsg(path: &Path) -> std::io::Result<Vec<String>> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if f.metadata()?.is_file() {
        let mut s = String::new();
        f.read_to_string(&mut s)?;
        return Ok(s.lines().map(str::to_string).collect());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 8192];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.push(String::from_utf8_lossy(&buf[..n]).trim_end().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // The ring buffer overwrote records we had not read yet: keep reading.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

pub fn log(ctx: &Ctx) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let path = ctx.paths.dev.join("kmsg");
    let records = match read_kmsg(&path) {
        Ok(r) => r,
        Err(e) => return Outcome::fail(format!("reading {}: {e}", path.display()), vec![]),
    };
    let hits: Vec<String> = records
        .iter()
        .map(|r| kmsg_message(r))
        .filter_map(|m| bad_kernel_line(m).map(|what| format!("{what}: {m}")))
        .collect();
    let head = format!(
        "{} kernel log records read from {} ({})",
        records.len(),
        path.display(),
        board.board.name
    );
    if records.is_empty() {
        return Outcome::fail("the kernel log is empty: nothing was checked", vec![head]);
    }
    if hits.is_empty() {
        Outcome::pass(vec![
            head,
            "no soft reset, job timeout, IOMMU fault, oops or panic".into(),
        ])
    } else {
        let n = hits.len();
        let mut ev = vec![head];
        ev.extend(hits.into_iter().take(20));
        Outcome::fail(format!("{n} bad kernel log line(s)"), ev)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::FakeRoot;
    use super::super::{board::Board, Ctx, Paths, Status};
    use super::*;
    use std::io::Write as _;

    const BOARD: &str = r##"
[board]
name = "qemu-virt"
npu = false
[expect]
kernel_release = "6.1.192-kiln"
kernel_config = ["CONFIG_EROFS_FS=y", "CONFIG_IKCONFIG_PROC=y", "# CONFIG_MODULES is not set", "CONFIG_LOCALVERSION=\"-kiln\""]
"##;

    const CONFIG: &str = "#\n# Automatically generated file; DO NOT EDIT.\n# Linux/arm64 6.1.192 Kernel Configuration\n#\nCONFIG_LOCALVERSION=\"-kiln\"\nCONFIG_EROFS_FS=y\nCONFIG_IKCONFIG_PROC=y\n# CONFIG_MODULES is not set\n";

    fn ctx(root: &FakeRoot) -> Ctx {
        Ctx {
            paths: Paths::under(root),
            board: Some(Board::parse(BOARD).unwrap()),
            ..Ctx::default()
        }
    }

    fn gz(text: &str) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(text.as_bytes()).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn release_passes_when_pinned_and_fails_when_not() {
        let root = FakeRoot::new();
        root.file("proc/sys/kernel/osrelease", "6.1.192-kiln\n");
        assert_eq!(release(&ctx(&root)).status, Status::Pass);
        // Fault: the wrong kernel is running.
        root.file("proc/sys/kernel/osrelease", "6.1.0-57-arm64\n");
        let o = release(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("6.1.0-57-arm64"));
        // And with no board file it skips with a reason.
        let host = Ctx {
            paths: Paths::under(&root),
            ..Ctx::default()
        };
        assert_eq!(release(&host).status, Status::Skip);
    }

    #[test]
    fn config_from_proc_config_gz() {
        let root = FakeRoot::new();
        root.file("proc/sys/kernel/osrelease", "6.1.192-kiln\n");
        root.file("proc/config.gz", gz(CONFIG));
        let o = config(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        // Fault: Kconfig dropped a fragment option.
        root.file(
            "proc/config.gz",
            gz(&CONFIG.replace("CONFIG_EROFS_FS=y\n", "# CONFIG_EROFS_FS is not set\n")),
        );
        let o = config(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(
            o.evidence.iter().any(|e| e.contains("CONFIG_EROFS_FS")),
            "{o:?}"
        );
        // An option set that the fragment wants unset also fails.
        root.file("proc/config.gz", gz(&format!("{CONFIG}CONFIG_MODULES=y\n")));
        assert_eq!(config(&ctx(&root)).status, Status::Fail);
    }

    #[test]
    fn config_shipped_on_boot_must_match_the_running_kernel() {
        let root = FakeRoot::new();
        root.file("proc/sys/kernel/osrelease", "6.1.192-kiln\n");
        root.file("boot/config-6.1.192-kiln", CONFIG);
        let o = config(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        // The same name, but the file was built for another version.
        root.file(
            "boot/config-6.1.192-kiln",
            CONFIG.replace("6.1.192 Kernel", "6.1.180 Kernel"),
        );
        let o = config(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("6.1.180-kiln"));
        // Nothing at all to read.
        root.remove("boot/config-6.1.192-kiln");
        assert_eq!(config(&ctx(&root)).status, Status::Fail);
    }

    /// Debian's kernel: release `6.12.118+deb13-arm64`, config header `6.12.118`, no
    /// LOCALVERSION, no /proc/config.gz: its `config-<release>` on the slot is read.
    #[test]
    fn config_of_a_debian_kernel_named_by_its_release() {
        const DEBIAN: &str = "#\n# Automatically generated file; DO NOT EDIT.\n# Linux/arm64 6.12.118 Kernel Configuration\n#\nCONFIG_LOCALVERSION=\"\"\nCONFIG_EROFS_FS=m\n";
        const BOARD: &str = "[board]\nname = \"rock-5b\"\nnpu = false\n[expect]\nkernel_release = \"6.12.118+deb13-arm64\"\nkernel_config = [\"CONFIG_EROFS_FS=m\"]\n";
        let root = FakeRoot::new();
        let ctx = || Ctx {
            paths: Paths::under(&root),
            board: Some(Board::parse(BOARD).unwrap()),
            ..Ctx::default()
        };
        root.file("proc/sys/kernel/osrelease", "6.12.118+deb13-arm64\n");
        root.file("boot/config-6.12.118+deb13-arm64", DEBIAN);
        let o = config(&ctx());
        assert_eq!(o.status, Status::Pass, "{o:?}");
        // Another version's config under the running release's name.
        root.file(
            "boot/config-6.12.118+deb13-arm64",
            DEBIAN.replace("6.12.118 Kernel", "6.12.117 Kernel"),
        );
        let o = config(&ctx());
        assert_eq!(o.status, Status::Fail, "{o:?}");
        // The Debian allowance is for `config-<release>` only, not kiln/kernel.config.
        root.remove("boot/config-6.12.118+deb13-arm64");
        root.file("boot/kiln/kernel.config", DEBIAN);
        let o = config(&ctx());
        assert_eq!(o.status, Status::Fail, "{o:?}");
        // An option the recipe relies on is not the package's.
        root.remove("boot/kiln/kernel.config");
        root.file(
            "boot/config-6.12.118+deb13-arm64",
            DEBIAN.replace("CONFIG_EROFS_FS=m", "CONFIG_EROFS_FS=y"),
        );
        let o = config(&ctx());
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(
            o.evidence.iter().any(|e| e.contains("CONFIG_EROFS_FS")),
            "{o:?}"
        );
    }

    #[test]
    fn kernel_log_catches_soft_reset_and_oops() {
        let root = FakeRoot::new();
        let clean = "6,1,0,-;Booting Linux on physical CPU 0x0000000000 [0x414fd0b0]\n\
                     5,2,0,-;Kernel command line: console=ttyAMA0 panic=-1 kiln.mode=test\n\
                     6,3,100,-;iommu: Default domain type: Translated\n";
        root.file("dev/kmsg", clean);
        let o = log(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        root.file(
            "dev/kmsg",
            format!("{clean}4,4,200,-;RKNPU: soft reset, num: 6\n"),
        );
        let o = log(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.evidence.iter().any(|e| e.contains("soft reset")));
        root.file(
            "dev/kmsg",
            format!("{clean}0,5,300,-;Internal error: Oops: 0000000096000004 [#1] SMP\n"),
        );
        let o = log(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.evidence.iter().any(|e| e.starts_with("oops")), "{o:?}");
        root.file(
            "dev/kmsg",
            format!("{clean}3,6,400,-;RKNPU: job timeout, flags: 0x5\n"),
        );
        assert_eq!(log(&ctx(&root)).status, Status::Fail);
        root.file(
            "dev/kmsg",
            format!("{clean}3,7,500,-;rk_iommu fdab9000.iommu: Page fault at 0x0\n"),
        );
        assert_eq!(log(&ctx(&root)).status, Status::Fail);
    }

    /// A GNU build-id note list.
    fn note(id: &[u8]) -> Vec<u8> {
        let mut n = Vec::new();
        // An unrelated note first, as modules carry .note.gnu.property and .note.Linux.
        n.extend(5u32.to_le_bytes());
        n.extend(4u32.to_le_bytes());
        n.extend(6u32.to_le_bytes());
        n.extend(b"Linux\0\0\0");
        n.extend([1, 2, 3, 4]);
        n.extend(4u32.to_le_bytes());
        n.extend((id.len() as u32).to_le_bytes());
        n.extend(3u32.to_le_bytes());
        n.extend(b"GNU\0");
        n.extend(id);
        while n.len() % 4 != 0 {
            n.push(0);
        }
        n
    }

    /// A 64-bit little-endian ELF file with a null section and one note section.
    fn elf(id: &[u8], payload: &[u8]) -> Vec<u8> {
        let notes = note(id);
        let mut e = vec![0u8; 64];
        e[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        e.extend(payload);
        let note_off = e.len();
        e.extend(&notes);
        let shoff = e.len();
        e[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        e[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        e[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes());
        e.extend([0u8; 64]);
        let mut sh = [0u8; 64];
        sh[4..8].copy_from_slice(&7u32.to_le_bytes());
        sh[0x18..0x20].copy_from_slice(&(note_off as u64).to_le_bytes());
        sh[0x20..0x28].copy_from_slice(&(notes.len() as u64).to_le_bytes());
        e.extend(sh);
        e
    }

    #[test]
    fn build_ids_from_files_and_notes_and_garbage_refused() {
        let id = [0x12u8, 0x2a, 0xf7, 0xfb, 0xaf, 0xd3, 0x0b, 0xdd];
        assert_eq!(elf_build_id(&elf(&id, b"x")).unwrap(), "122af7fbafd30bdd");
        assert_eq!(note_build_id(&note(&id)).unwrap(), "122af7fbafd30bdd");
        assert!(elf_build_id(b"\x7fELF\x01\x01").is_err());
        let mut cut = elf(&id, b"");
        cut.truncate(cut.len() - 40);
        assert!(elf_build_id(&cut).is_err());
        assert!(note_build_id(&note(&id)[..20]).is_none());
        // A note list that claims more than it has is refused, not read past.
        let mut lying = note(&id);
        lying[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(note_build_id(&lying).is_none());
    }

    /// Two modules of a Debian kernel, their manifest entries, the kernel's view of them.
    fn modules_root() -> (FakeRoot, serde_json::Value) {
        let root = FakeRoot::new();
        root.file("proc/sys/kernel/osrelease", "6.12.118+deb13-arm64\n");
        let rel = "6.12.118+deb13-arm64";
        let mut files = vec![];
        for (i, name) in ["dw_mmc", "dw_mmc-rockchip"].iter().enumerate() {
            let id = [i as u8 + 1; 20];
            let ko = elf(&id, name.as_bytes());
            let path = format!("/lib/modules/{rel}/kernel/{name}.ko");
            root.file(&path[1..], &ko);
            let k = name.replace('-', "_");
            root.file(
                &format!("sys/module/{k}/notes/.note.gnu.build-id"),
                note(&id),
            );
            files.push(serde_json::json!({
                "name": name, "path": path,
                "sha256": hex::encode(sha2::Sha256::digest(&ko)),
            }));
        }
        root.file(
            "proc/modules",
            "dw_mmc_rockchip 12288 0 - Live 0x0000000000000000\n\
             dw_mmc 61440 1 dw_mmc_rockchip, Live 0x0000000000000000\n",
        );
        let fw = b"rtl8125b firmware patch";
        root.file("lib/firmware/rtl_nic/rtl8125b-2.fw", fw);
        let km = serde_json::json!({
            "package": {"input": "linux-image-rock-5b", "version": "6.12.118-1", "sha256": "e4326441"},
            "release": rel, "load": ["dw_mmc-rockchip"], "load_order": ["dw_mmc", "dw_mmc_rockchip"],
            "files": files,
            "firmware": {
                "package": {"input": "firmware-realtek", "version": "20230210-5", "sha256": "586ce39f"},
                "files": [{"file": "rtl_nic/rtl8125b-2.fw", "path": "/lib/firmware/rtl_nic/rtl8125b-2.fw",
                           "sha256": hex::encode(sha2::Sha256::digest(fw)), "requested_by": "r8169"}],
            },
        });
        root.file(
            "boot/kiln/manifest.json",
            serde_json::to_vec(&serde_json::json!({"kiln_manifest": 1, "kernel_modules": km}))
                .unwrap(),
        );
        (root, km)
    }

    #[test]
    fn modules_pass_when_live_hashed_and_the_kernels_own() {
        let (root, _) = modules_root();
        let o = modules(&ctx(&root)).expect("the manifest lists modules");
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.evidence[0].contains("2 module(s) of linux-image-rock-5b 6.12.118-1"));
        assert!(o.evidence[1].contains("build-id"));
        assert!(o.evidence[2].contains("firmware rtl_nic/rtl8125b-2.fw (requested by r8169"));
        // A board whose kernel loads no modules has no such check, whether its manifest has
        // no `kernel_modules` or (as the image step writes it) a null one.
        root.file("boot/kiln/manifest.json", r#"{"kiln_manifest": 1}"#);
        assert!(modules(&ctx(&root)).is_none());
        root.file(
            "boot/kiln/manifest.json",
            r#"{"kiln_manifest": 1, "kernel_modules": null}"#,
        );
        assert!(modules(&ctx(&root)).is_none());
    }

    use sha2::Digest as _;

    /// Each fault is named: a module not loaded, one still loading, a file that is not the
    /// package's, a kernel holding another build of the module, no notes, another kernel.
    #[test]
    fn modules_faults_are_named() {
        let rel = "lib/modules/6.12.118+deb13-arm64/kernel";
        type Inject<'a> = &'a dyn Fn(&FakeRoot);
        let faults: [(&str, Inject, &str); 8] = [
            (
                "firmware changed",
                &|r| {
                    r.file("lib/firmware/rtl_nic/rtl8125b-2.fw", "other");
                },
                "firmware rtl_nic/rtl8125b-2.fw: /",
            ),
            (
                "firmware missing",
                &|r| r.remove("lib/firmware/rtl_nic"),
                "firmware rtl_nic/rtl8125b-2.fw: cannot read",
            ),
            (
                "unloaded",
                &|r| {
                    r.file("proc/modules", "dw_mmc 61440 1 - Live 0x0000000000000000\n");
                },
                "dw_mmc-rockchip: not loaded",
            ),
            (
                "loading",
                &|r| {
                    r.file(
                        "proc/modules",
                        "dw_mmc_rockchip 12288 0 - Loading 0x0\ndw_mmc 61440 1 - Live 0x0\n",
                    );
                },
                "dw_mmc-rockchip: in /proc/modules but Loading",
            ),
            (
                "tampered file",
                &|r| {
                    r.file(&format!("{rel}/dw_mmc.ko"), elf(&[1; 20], b"other"));
                },
                "dw_mmc: /lib/modules/6.12.118+deb13-arm64/kernel/dw_mmc.ko has sha256",
            ),
            (
                "another build held",
                &|r| {
                    r.file(
                        "sys/module/dw_mmc_rockchip/notes/.note.gnu.build-id",
                        note(&[9; 20]),
                    );
                },
                "dw_mmc-rockchip: the kernel holds build-id 0909",
            ),
            (
                "no notes",
                &|r| r.remove("sys/module/dw_mmc/notes"),
                "dw_mmc: reading",
            ),
            (
                "another kernel",
                &|r| {
                    r.file("proc/sys/kernel/osrelease", "6.1.75-vendor\n");
                },
                "the running kernel is 6.1.75-vendor",
            ),
        ];
        for (what, inject, want) in faults {
            let (root, _) = modules_root();
            inject(&root);
            let o = modules(&ctx(&root)).expect("listed");
            assert_eq!(o.status, Status::Fail, "{what}: {o:?}");
            let reason = o.reason.unwrap_or_default();
            assert!(reason.contains(want), "{what}: {reason}");
        }
    }
}
