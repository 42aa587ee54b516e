//! `kernel.release`, `kernel.config`, `kernel.log`.

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
}
