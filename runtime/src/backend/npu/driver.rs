//! The rknpu kernel driver, found and versioned through its own ioctls (vendor `rknpu_ioctl.h`,
//! `drivers/rknpu`): the DRM device whose `DRM_IOCTL_VERSION` name is `rknpu`, or the misc device
//! `/dev/rknpu` (`CONFIG_ROCKCHIP_RKNPU_DMA_HEAP` builds) that takes the `'r'` ioctls.
//!
//! Only the request numbers and the "not an rknpu device" path can be exercised off the board:
//! no machine here has the driver, so a real `GET_DRV_VERSION` answer is never seen in tests.

use crate::backend::Decline;
use std::ffi::c_int;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// `struct drm_version` (uapi `drm.h`), 64 bytes on LP64.
#[repr(C)]
pub struct DrmVersion {
    pub version_major: c_int,
    pub version_minor: c_int,
    pub version_patchlevel: c_int,
    pub name_len: usize,
    pub name: *mut u8,
    pub date_len: usize,
    pub date: *mut u8,
    pub desc_len: usize,
    pub desc: *mut u8,
}

/// `struct rknpu_action`: the action code in, the value out.
#[repr(C)]
pub struct RknpuAction {
    pub flags: u32,
    pub value: u32,
}

const _: () = assert!(std::mem::size_of::<DrmVersion>() == 64);
const _: () = assert!(std::mem::size_of::<RknpuAction>() == 8);

/// `RKNPU_GET_DRV_VERSION`: answers major·10000 + minor·100 + patch.
pub const RKNPU_GET_DRV_VERSION: u32 = 1;
/// `DRM_COMMAND_BASE`: driver ioctls on a DRM node start here.
const DRM_COMMAND_BASE: u8 = 0x40;
/// `RKNPU_ACTION`'s number.
const RKNPU_ACTION_NR: u8 = 0x00;

nix::ioctl_readwrite!(drm_ioctl_version, b'd', 0x00, DrmVersion);
nix::ioctl_readwrite!(
    rknpu_drm_action,
    b'd',
    DRM_COMMAND_BASE + RKNPU_ACTION_NR,
    RknpuAction
);
nix::ioctl_readwrite!(rknpu_misc_action, b'r', RKNPU_ACTION_NR, RknpuAction);

/// `DRM_IOCTL_VERSION`.
pub const DRM_IOCTL_VERSION: u64 =
    nix::request_code_readwrite!(b'd', 0x00, std::mem::size_of::<DrmVersion>()) as u64;
/// `DRM_IOCTL_RKNPU_ACTION`: `DRM_IOWR(DRM_COMMAND_BASE + RKNPU_ACTION, struct rknpu_action)`.
pub const DRM_IOCTL_RKNPU_ACTION: u64 = nix::request_code_readwrite!(
    b'd',
    DRM_COMMAND_BASE + RKNPU_ACTION_NR,
    std::mem::size_of::<RknpuAction>()
) as u64;
/// `IOCTL_RKNPU_ACTION` on the misc device: `_IOWR('r', RKNPU_ACTION, struct rknpu_action)`.
pub const MISC_IOCTL_RKNPU_ACTION: u64 =
    nix::request_code_readwrite!(b'r', RKNPU_ACTION_NR, std::mem::size_of::<RknpuAction>()) as u64;

/// The driver kiln talks to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Driver {
    pub node: PathBuf,
    /// `major·10000 + minor·100 + patch` (0.9.8 = 908).
    pub version_code: u32,
}

impl Driver {
    pub fn version(&self) -> String {
        version_string(self.version_code)
    }
}

pub fn version_string(code: u32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

/// The oldest driver kiln accepts: 0.9.6 fixed the submit failures of 0.9.3 (Radxa 6.1 images).
pub const MIN_DRIVER: u32 = 906;

fn drm_name(fd: c_int) -> Result<(String, (i32, i32, i32)), String> {
    let mut name = [0u8; 64];
    let mut v = DrmVersion {
        version_major: 0,
        version_minor: 0,
        version_patchlevel: 0,
        name_len: name.len(),
        name: name.as_mut_ptr(),
        date_len: 0,
        date: std::ptr::null_mut(),
        desc_len: 0,
        desc: std::ptr::null_mut(),
    };
    // SAFETY: `v` points at a live buffer of `name_len` bytes; date/desc lengths are 0.
    unsafe { drm_ioctl_version(fd, &mut v) }.map_err(|e| format!("DRM_IOCTL_VERSION: {e}"))?;
    let len = v.name_len.min(name.len());
    let s = String::from_utf8_lossy(&name[..len])
        .trim_end_matches('\0')
        .to_string();
    Ok((s, (v.version_major, v.version_minor, v.version_patchlevel)))
}

fn action(fd: c_int, misc: bool) -> Result<u32, String> {
    let mut a = RknpuAction {
        flags: RKNPU_GET_DRV_VERSION,
        value: 0,
    };
    // SAFETY: `a` is a live `rknpu_action`, the struct this request carries.
    let r = unsafe {
        if misc {
            rknpu_misc_action(fd, &mut a)
        } else {
            rknpu_drm_action(fd, &mut a)
        }
    };
    r.map_err(|e| format!("RKNPU_ACTION GET_DRV_VERSION: {e}"))?;
    Ok(a.value)
}

fn open(p: &Path) -> Result<std::fs::File, String> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .or_else(|_| OpenOptions::new().read(true).open(p))
        .map_err(|e| format!("open: {e}"))
}

/// Find the rknpu driver under `devroot` (`/` on a board; a fake tree in tests) and read its
/// version. Every node tried is named in the decline.
pub fn find(devroot: &Path) -> Result<Driver, Decline> {
    let mut tried = Vec::new();
    let dri = devroot.join("dev/dri");
    let mut nodes: Vec<PathBuf> = std::fs::read_dir(&dri)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    nodes.sort();
    if nodes.is_empty() {
        tried.push(format!("{}: no DRM nodes", dri.display()));
    }
    for node in nodes {
        let f = match open(&node) {
            Ok(f) => f,
            Err(e) => {
                tried.push(format!("{}: {e}", node.display()));
                continue;
            }
        };
        match drm_name(f.as_raw_fd()) {
            Ok((name, (ma, mi, pa))) if name == "rknpu" => {
                let code = action(f.as_raw_fd(), false).unwrap_or_else(|_| {
                    (ma.max(0) as u32) * 10000 + (mi.max(0) as u32) * 100 + pa.max(0) as u32
                });
                return Ok(Driver {
                    node,
                    version_code: code,
                });
            }
            Ok((name, _)) => tried.push(format!("{}: DRM driver {name:?}", node.display())),
            Err(e) => tried.push(format!("{}: {e}", node.display())),
        }
    }
    let misc = devroot.join("dev/rknpu");
    if misc.exists() {
        match open(&misc).and_then(|f| action(f.as_raw_fd(), true)) {
            Ok(code) => {
                return Ok(Driver {
                    node: misc,
                    version_code: code,
                })
            }
            Err(e) => tried.push(format!("{}: {e}", misc.display())),
        }
    } else {
        tried.push(format!("{}: absent", misc.display()));
    }
    Err(Decline::NoDevice {
        why: format!("no rknpu driver ({})", tried.join("; ")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rknpu_ioctl.h` / the reference's computed values.
    #[test]
    fn ioctl_request_numbers() {
        assert_eq!(DRM_IOCTL_RKNPU_ACTION, 0xc008_6440);
        assert_eq!(MISC_IOCTL_RKNPU_ACTION, 0xc008_7200);
        assert_eq!(DRM_IOCTL_VERSION, 0xc040_6400);
    }

    #[test]
    fn version_codes() {
        assert_eq!(version_string(908), "0.9.8");
        assert_eq!(version_string(10203), "1.2.3");
    }

    /// A fake device tree: a DRM node that is a plain file (the ioctl fails with ENOTTY) and no
    /// misc node. Real rknpu ioctls cannot run here; this covers the "not rknpu" path.
    #[test]
    fn fake_devroot_is_no_device() {
        let root = std::env::temp_dir().join(format!("kiln-npu-devroot-{}", std::process::id()));
        let dri = root.join("dev/dri");
        std::fs::create_dir_all(&dri).unwrap();
        std::fs::write(dri.join("card0"), b"").unwrap();
        let d = find(&root).unwrap_err();
        let _ = std::fs::remove_dir_all(&root);
        let Decline::NoDevice { why } = &d else {
            panic!("expected NoDevice, got {d}");
        };
        assert!(why.contains("card0: DRM_IOCTL_VERSION"), "{why}");
        assert!(why.contains("rknpu: absent"), "{why}");
    }
}
