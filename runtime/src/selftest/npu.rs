//! `npu.driver`: the rknpu DRM device is present and its driver version is the pinned one.
//! (`npu.runtime`, which loads librknnrt through the NPU backend, lives with the backend checks.)

use super::{Ctx, Outcome};
use std::path::{Path, PathBuf};

/// `struct drm_version` from `include/uapi/drm/drm.h`.
#[repr(C)]
struct DrmVersion {
    major: libc::c_int,
    minor: libc::c_int,
    patch: libc::c_int,
    name_len: libc::size_t,
    name: *mut libc::c_char,
    date_len: libc::size_t,
    date: *mut libc::c_char,
    desc_len: libc::size_t,
    desc: *mut libc::c_char,
}

/// `DRM_IOWR(0x00, struct drm_version)`: `_IOWR('d', 0, 64)` on LP64.
const DRM_IOCTL_VERSION: libc::c_ulong = 0xC040_6400;

/// Name and `major.minor.patch` of a DRM node, through `DRM_IOCTL_VERSION`.
pub fn drm_version(node: &Path) -> std::io::Result<(String, String)> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(node)?;
    let mut name = vec![0u8; 64];
    let mut v = DrmVersion {
        major: 0,
        minor: 0,
        patch: 0,
        name_len: name.len(),
        name: name.as_mut_ptr().cast(),
        date_len: 0,
        date: std::ptr::null_mut(),
        desc_len: 0,
        desc: std::ptr::null_mut(),
    };
    // SAFETY: `v` is a live drm_version whose only buffer (`name`, `name_len` bytes) outlives
    // the call; the kernel writes at most `name_len` bytes into it and fills the ints.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), DRM_IOCTL_VERSION as _, &mut v) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = v.name_len.min(name.len());
    let name = String::from_utf8_lossy(&name[..n])
        .trim_end_matches('\0')
        .to_string();
    Ok((name, format!("{}.{}.{}", v.major, v.minor, v.patch)))
}

/// DRM nodes (`cardN`, `renderDN`) whose sysfs device names the rknpu driver.
fn rknpu_nodes(ctx: &Ctx) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    let class = ctx.paths.sys.join("class/drm");
    let mut names: Vec<String> = std::fs::read_dir(&class)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| (n.starts_with("card") || n.starts_with("renderD")) && !n.contains('-'))
        .collect();
    names.sort();
    for n in names {
        let uevent = class.join(&n).join("device/uevent");
        let text = std::fs::read_to_string(&uevent).unwrap_or_default();
        if text.to_ascii_lowercase().contains("rknpu") {
            let node = ctx.paths.dev.join("dri").join(&n);
            if node.exists() {
                let line = text
                    .lines()
                    .find(|l| l.starts_with("DRIVER=") || l.starts_with("OF_COMPATIBLE_0="))
                    .unwrap_or("rknpu")
                    .to_string();
                found.push((node, line));
            }
        }
    }
    let misc = ctx.paths.dev.join("rknpu");
    if misc.exists() {
        found.push((misc, "misc device (CONFIG_ROCKCHIP_RKNPU_DMA_HEAP)".into()));
    }
    found
}

/// `RKNPU driver: v0.9.8` → `0.9.8` (debugfs / procfs `version`, npu.md §2.4).
fn version_file(ctx: &Ctx) -> Option<(PathBuf, String)> {
    [
        ctx.paths.sys.join("kernel/debug/rknpu/version"),
        ctx.paths.proc.join("rknpu/version"),
    ]
    .into_iter()
    .find_map(|p| {
        let text = std::fs::read_to_string(&p).ok()?;
        let v = text.trim().rsplit(['v', ' ']).next()?.trim().to_string();
        (!v.is_empty()).then_some((p, v))
    })
}

/// Why a board's NPU is not checked: its recipe's note (a board whose kernel has no NPU driver),
/// else that it has none.
fn no_npu(b: &super::board::BoardInfo) -> String {
    match &b.npu_note {
        Some(n) => format!("board {}: {n}", b.name),
        None => format!("board {} has no NPU", b.name),
    }
}

pub fn driver(ctx: &Ctx) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    if !board.board.npu {
        return Outcome::skip(no_npu(&board.board));
    }
    let Some(want) = &board.expect.npu_driver else {
        return Outcome::fail("NPU board, but the board file pins no npu_driver", vec![]);
    };
    let nodes = rknpu_nodes(ctx);
    if nodes.is_empty() {
        return Outcome::fail(
            format!(
                "no rknpu device: no {}/class/drm/*/device naming rknpu with a node in {}/dri, no {}/rknpu",
                ctx.paths.sys.display(),
                ctx.paths.dev.display(),
                ctx.paths.dev.display()
            ),
            vec![],
        );
    }
    let mut ev: Vec<String> = nodes
        .iter()
        .map(|(p, why)| format!("device {} ({why})", p.display()))
        .collect();
    // The ioctl is the authority; the debugfs file stands in where the node is not a device
    // (fake trees) or debugfs is what the board exposes.
    let mut versions = Vec::new();
    for (node, _) in &nodes {
        match drm_version(node) {
            Ok((name, v)) => {
                ev.push(format!("DRM_IOCTL_VERSION {}: {name} {v}", node.display()));
                versions.push(v);
            }
            Err(e) => ev.push(format!("DRM_IOCTL_VERSION {}: {e}", node.display())),
        }
    }
    if versions.is_empty() {
        if let Some((p, v)) = version_file(ctx) {
            ev.push(format!("{}: {v}", p.display()));
            versions.push(v);
        }
    }
    let Some(got) = versions.first() else {
        return Outcome::fail("rknpu device found but its version could not be read", ev);
    };
    if versions.iter().all(|v| v == want) {
        ev.push(format!("driver {got} (pinned {want})"));
        Outcome::pass(ev)
    } else {
        Outcome::fail(format!("rknpu driver {got} is not the pinned {want}"), ev)
    }
}

/// `npu.runtime`: librknnrt loads through the NPU backend, its matmul ABI is 2.x and its version
/// is the pinned one. The stand-in passes, marked simulated, only on a board without an NPU: on
/// a board whose recipe has `npu = true` a simulated runtime is a FAIL, whatever its version.
pub fn runtime(ctx: &Ctx, npu: &dyn crate::backend::Backend) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let want = board.expect.npu_runtime.as_deref();
    let caps = match (npu.probe(), want) {
        (Ok(c), _) => c,
        (Err(d @ crate::backend::Decline::NpuLock { .. }), _) => {
            return Outcome::fail(format!("the NPU cannot be taken: {d}"), vec![])
        }
        (Err(d), None) if !board.board.npu => {
            return Outcome::skip(match &board.board.npu_note {
                Some(_) => format!("{} (no NPU runtime: {d})", no_npu(&board.board)),
                None => format!(
                    "board {} has no NPU and pins no NPU runtime ({d})",
                    board.board.name
                ),
            })
        }
        (Err(d), _) => return Outcome::fail(format!("librknnrt is not usable: {d}"), vec![]),
    };
    let fact = |k: &str| {
        caps.facts
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let version = fact("library version");
    let abi = fact("matmul abi");
    let mut ev: Vec<String> = caps
        .facts
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    let mut o = if caps.simulated && board.board.npu {
        Outcome::fail(
            format!(
                "board {} has an NPU, but librknnrt is a simulation (stand-in) whatever its \
                 version {version:?} says",
                board.board.name
            ),
            ev,
        )
    } else if !abi.starts_with("2.") {
        Outcome::fail(format!("matmul ABI {abi:?} is not 2.x"), ev)
    } else {
        match want {
            Some(w) if version.split_whitespace().next() != Some(w) => {
                Outcome::fail(format!("librknnrt {version} is not the pinned {w}"), ev)
            }
            Some(w) => {
                ev.push(format!("version {w} (pinned)"));
                Outcome::pass(ev)
            }
            None if board.board.npu => {
                Outcome::fail("NPU board, but the board file pins no npu_runtime", ev)
            }
            None => {
                ev.push("version not pinned by the board file".into());
                Outcome::pass(ev)
            }
        }
    };
    o.simulated = caps.simulated;
    o
}

#[cfg(test)]
mod tests {
    use super::super::testutil::FakeRoot;
    use super::super::{board::Board, Ctx, Paths, Status};
    use super::*;

    fn ctx(root: &FakeRoot, npu: bool) -> Ctx {
        let text =
            format!("[board]\nname = \"rock-5b\"\nnpu = {npu}\n[expect]\nnpu_driver = \"0.9.8\"\n");
        Ctx {
            paths: Paths::under(root),
            board: Some(Board::parse(&text).unwrap()),
            ..Ctx::default()
        }
    }

    fn rk3588_npu(root: &FakeRoot) {
        root.file(
            "sys/class/drm/card1/device/uevent",
            "DRIVER=RKNPU\nOF_NAME=npu\nOF_COMPATIBLE_0=rockchip,rk3588-rknpu\n",
        );
        root.file("sys/class/drm/card0/device/uevent", "DRIVER=rockchip-drm\n");
        root.file("dev/dri/card1", "");
        root.file("dev/dri/card0", "");
        root.file("sys/kernel/debug/rknpu/version", "RKNPU driver: v0.9.8\n");
    }

    #[test]
    fn driver_found_and_pinned() {
        let root = FakeRoot::new();
        rk3588_npu(&root);
        let o = driver(&ctx(&root, true));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.evidence.iter().any(|e| e.contains("card1")), "{o:?}");
        // Older driver.
        root.file("sys/kernel/debug/rknpu/version", "RKNPU driver: v0.9.6\n");
        let o = driver(&ctx(&root, true));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("0.9.6"));
    }

    #[test]
    fn missing_npu_device_on_an_npu_board_fails() {
        let root = FakeRoot::new();
        rk3588_npu(&root);
        root.remove("dev/dri/card1");
        let o = driver(&ctx(&root, true));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("no rknpu device"));
        root.remove("sys/class/drm/card1");
        assert_eq!(driver(&ctx(&root, true)).status, Status::Fail);
    }

    /// A backend with no NPU library to load (`npu_runtime = "none"`).
    struct Unusable;
    impl crate::backend::Backend for Unusable {
        fn name(&self) -> &'static str {
            "npu"
        }
        fn probe(&self) -> Result<crate::backend::Capabilities, crate::backend::Decline> {
            Err(crate::backend::Decline::NoDevice {
                why: "no librknnrt.so".into(),
            })
        }
        fn supports(&self, _: &crate::backend::MatmulOp) -> Result<(), crate::backend::Decline> {
            Ok(())
        }
        fn prepare<'w>(
            &self,
            _: &crate::backend::Weight<'w>,
        ) -> anyhow::Result<Box<dyn crate::backend::PreparedWeight + 'w>> {
            anyhow::bail!("not used")
        }
        fn run(
            &self,
            _: &crate::backend::Weight<'_>,
            _: &dyn crate::backend::PreparedWeight,
            _: &[f32],
            _: usize,
            _: &mut [f32],
        ) -> anyhow::Result<()> {
            anyhow::bail!("not used")
        }
    }

    /// A backend that reports what a stand-in reports: simulated, ABI 2.x, the pinned version.
    struct Simulated;
    impl crate::backend::Backend for Simulated {
        fn name(&self) -> &'static str {
            "npu"
        }
        fn probe(&self) -> Result<crate::backend::Capabilities, crate::backend::Decline> {
            Ok(crate::backend::Capabilities {
                facts: vec![
                    ("library version".into(), "2.3.2 (stand-in)".into()),
                    ("matmul abi".into(), "2.x".into()),
                ],
                simulated: true,
            })
        }
        fn supports(&self, _: &crate::backend::MatmulOp) -> Result<(), crate::backend::Decline> {
            Ok(())
        }
        fn prepare<'w>(
            &self,
            _: &crate::backend::Weight<'w>,
        ) -> anyhow::Result<Box<dyn crate::backend::PreparedWeight + 'w>> {
            anyhow::bail!("not used")
        }
        fn run(
            &self,
            _: &crate::backend::Weight<'_>,
            _: &dyn crate::backend::PreparedWeight,
            _: &[f32],
            _: usize,
            _: &mut [f32],
        ) -> anyhow::Result<()> {
            anyhow::bail!("not used")
        }
    }

    #[test]
    fn a_simulated_runtime_fails_on_an_npu_board_and_passes_marked_elsewhere() {
        let root = FakeRoot::new();
        let pinned = |npu: bool| {
            let text =
                format!("[board]\nname = \"b\"\nnpu = {npu}\n[expect]\nnpu_runtime = \"2.3.2\"\n");
            Ctx {
                paths: Paths::under(&root),
                board: Some(Board::parse(&text).unwrap()),
                ..Ctx::default()
            }
        };
        let o = runtime(&pinned(true), &Simulated);
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("simulation"));
        let o = runtime(&pinned(false), &Simulated);
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.simulated);
    }

    #[test]
    fn a_board_without_npu_skips() {
        let root = FakeRoot::new();
        let o = driver(&ctx(&root, false));
        assert_eq!(o.status, Status::Skip);
        assert_eq!(o.reason.as_deref(), Some("board rock-5b has no NPU"));
    }

    /// rock-5b on Debian's kernel: the npu checks say why, neither a PASS nor a bare skip.
    #[test]
    fn a_board_whose_kernel_has_no_npu_driver_says_so() {
        let root = FakeRoot::new();
        rk3588_npu(&root);
        let note =
            "mainline kernel: no NPU driver; inference on the CPU; for the NPU use rock-5b-vendor";
        let text = format!("[board]\nname = \"rock-5b\"\nnpu = false\nnpu_note = \"{note}\"\n");
        let c = Ctx {
            paths: Paths::under(&root),
            board: Some(Board::parse(&text).unwrap()),
            ..Ctx::default()
        };
        let o = driver(&c);
        assert_eq!(o.status, Status::Skip, "{o:?}");
        assert_eq!(
            o.reason.as_deref(),
            Some(&*format!("board rock-5b: {note}"))
        );
        let o = runtime(&c, &Unusable);
        assert_eq!(o.status, Status::Skip, "{o:?}");
        assert!(
            o.reason.as_deref().unwrap_or_default().contains(note),
            "{o:?}"
        );
    }
}
