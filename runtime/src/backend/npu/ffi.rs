//! librknnrt's matmul ABI (2.1+, as in rknn-toolkit2 2.3.2's `rknn_matmul_api.h` / `rknn_api.h`),
//! loaded at run time. Hand-written rather than bindgen'd: twenty symbols, and the 1.x/2.x
//! struct-size split must be decided before any struct crosses the boundary.

use anyhow::{bail, Context, Result};
use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};

pub type RknnCtx = u64;

pub const FLOAT16_MM_FLOAT16_TO_FLOAT32: i32 = 1;
pub const INT8_MM_INT8_TO_INT32: i32 = 2;
pub const LAYOUT_NORM: i16 = 0;
pub const LAYOUT_NATIVE: i16 = 1;
pub const TENSOR_FLOAT32: i32 = 0;
pub const TENSOR_FLOAT16: i32 = 1;
pub const TENSOR_INT8: i32 = 2;
pub const TENSOR_INT32: i32 = 6;
/// `rknn_mem_sync_mode`: clean the CPU cache so the NPU sees what the CPU wrote.
pub const SYNC_TO_DEVICE: c_int = 1;
/// `rknn_mem_sync_mode`: invalidate the CPU cache so the CPU sees what the NPU wrote.
pub const SYNC_FROM_DEVICE: c_int = 2;
/// `RKNN_NPU_CORE_AUTO`.
pub const CORE_AUTO: c_int = 0;

/// `rknn_matmul_info` (2.1+): 64 bytes, always zero-filled before use.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MatmulInfo {
    pub m: i32,
    pub k: i32,
    pub n: i32,
    pub ty: i32,
    pub b_layout: i16,
    pub b_quant_type: i16,
    pub ac_layout: i16,
    pub ac_quant_type: i16,
    pub iommu_domain_id: i32,
    pub group_size: i16,
    pub reserved: [i8; 34],
}

/// `rknn_matmul_tensor_attr`: 332 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TensorAttr {
    pub name: [u8; 256],
    pub n_dims: u32,
    pub dims: [u32; 16],
    pub size: u32,
    pub ty: i32,
}

/// `rknn_matmul_io_attr`: A, B, C; 996 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IoAttr {
    pub a: TensorAttr,
    pub b: TensorAttr,
    pub c: TensorAttr,
}

/// `rknn_tensor_mem`: 40 bytes.
#[repr(C)]
#[derive(Debug)]
pub struct TensorMem {
    pub virt_addr: *mut c_void,
    pub phys_addr: u64,
    pub fd: i32,
    pub offset: i32,
    pub size: u32,
    pub flags: u32,
    pub priv_data: *mut c_void,
}

/// `rknn_quant_params`: 288 bytes (declared for the ABI asserts; kiln applies scales on the host).
#[repr(C)]
pub struct QuantParams {
    pub name: [u8; 256],
    pub scale: *mut f32,
    pub scale_len: i32,
    pub zp: *mut i32,
    pub zp_len: i32,
}

// Sizes and offsets of the 2.3.2 headers compiled with gcc on LP64 (the aarch64 rules).
const _: () = assert!(size_of::<MatmulInfo>() == 64);
const _: () = assert!(offset_of!(MatmulInfo, ty) == 12);
const _: () = assert!(offset_of!(MatmulInfo, b_layout) == 16);
const _: () = assert!(offset_of!(MatmulInfo, ac_layout) == 20);
const _: () = assert!(offset_of!(MatmulInfo, iommu_domain_id) == 24);
const _: () = assert!(offset_of!(MatmulInfo, group_size) == 28);
const _: () = assert!(offset_of!(MatmulInfo, reserved) == 30);
const _: () = assert!(size_of::<TensorAttr>() == 332);
const _: () = assert!(offset_of!(TensorAttr, n_dims) == 256);
const _: () = assert!(offset_of!(TensorAttr, dims) == 260);
const _: () = assert!(offset_of!(TensorAttr, size) == 324);
const _: () = assert!(offset_of!(TensorAttr, ty) == 328);
const _: () = assert!(size_of::<IoAttr>() == 996);
const _: () = assert!(offset_of!(IoAttr, c) == 664);
const _: () = assert!(size_of::<TensorMem>() == 40);
const _: () = assert!(offset_of!(TensorMem, fd) == 16);
const _: () = assert!(offset_of!(TensorMem, size) == 24);
const _: () = assert!(offset_of!(TensorMem, priv_data) == 32);
const _: () = assert!(size_of::<QuantParams>() == 288);
const _: () = assert!(offset_of!(QuantParams, zp_len) == 280);

impl MatmulInfo {
    pub fn zeroed() -> MatmulInfo {
        MatmulInfo {
            m: 0,
            k: 0,
            n: 0,
            ty: 0,
            b_layout: 0,
            b_quant_type: 0,
            ac_layout: 0,
            ac_quant_type: 0,
            iommu_domain_id: 0,
            group_size: 0,
            reserved: [0; 34],
        }
    }
}

impl TensorAttr {
    pub fn zeroed() -> TensorAttr {
        TensorAttr {
            name: [0; 256],
            n_dims: 0,
            dims: [0; 16],
            size: 0,
            ty: 0,
        }
    }
}

/// The name `rknn_api.h` gives an error code.
pub fn error_name(code: c_int) -> &'static str {
    match code {
        0 => "RKNN_SUCC",
        -1 => "RKNN_ERR_FAIL",
        -2 => "RKNN_ERR_TIMEOUT",
        -3 => "RKNN_ERR_DEVICE_UNAVAILABLE",
        -4 => "RKNN_ERR_MALLOC_FAIL",
        -5 => "RKNN_ERR_PARAM_INVALID",
        -6 => "RKNN_ERR_MODEL_INVALID",
        -7 => "RKNN_ERR_CTX_INVALID",
        -8 => "RKNN_ERR_INPUT_INVALID",
        -9 => "RKNN_ERR_OUTPUT_INVALID",
        -10 => "RKNN_ERR_DEVICE_UNMATCH",
        -11 => "RKNN_ERR_INCOMPATILE_PRE_COMPILE_MODEL",
        -12 => "RKNN_ERR_INCOMPATILE_OPTIMIZATION_LEVEL_VERSION",
        -13 => "RKNN_ERR_TARGET_PLATFORM_UNMATCH",
        _ => "unknown RKNN error",
    }
}

/// Turn a return code into an error that names the call and the code.
pub fn check(call: &str, code: c_int) -> Result<()> {
    if code != 0 {
        bail!("{call} returned {code} ({})", error_name(code));
    }
    Ok(())
}

type CreateFn = unsafe extern "C" fn(*mut RknnCtx, *mut MatmulInfo, *mut IoAttr) -> c_int;
type SetIoMemFn = unsafe extern "C" fn(RknnCtx, *mut TensorMem, *mut TensorAttr) -> c_int;
type CtxFn = unsafe extern "C" fn(RknnCtx) -> c_int;
type CoreMaskFn = unsafe extern "C" fn(RknnCtx, c_int) -> c_int;
type CreateMemFn = unsafe extern "C" fn(RknnCtx, u32) -> *mut TensorMem;
type DestroyMemFn = unsafe extern "C" fn(RknnCtx, *mut TensorMem) -> c_int;
type MemSyncFn = unsafe extern "C" fn(RknnCtx, *mut TensorMem, c_int) -> c_int;

/// Which matmul ABI the library presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abi {
    /// 2.1 and later: 64-byte info with `group_size`, `rknn_matmul_create_dynamic_shape`.
    V2_1,
    /// 2.0.0b0: 64-byte info, `rknn_matmul_create_dyn_shape`.
    V2_0,
}

impl Abi {
    pub fn name(self) -> &'static str {
        match self {
            Abi::V2_1 => "2.1+ (64-byte rknn_matmul_info)",
            Abi::V2_0 => "2.0 (64-byte rknn_matmul_info)",
        }
    }
}

/// Why a library cannot be used: not loadable, or the wrong ABI.
#[derive(Debug)]
pub enum LoadError {
    Missing(String),
    Abi(String),
}

/// The loaded library and the functions kiln calls. The `Library` is kept so that the
/// function pointers stay valid for as long as this value lives.
pub struct RknnLib {
    pub path: PathBuf,
    pub abi: Abi,
    /// From the embedded `librknnrt version: …` string, if the file has one.
    pub version: Option<String>,
    pub matmul_create: CreateFn,
    pub matmul_set_io_mem: SetIoMemFn,
    pub matmul_set_core_mask: CoreMaskFn,
    pub matmul_run: CtxFn,
    pub matmul_destroy: CtxFn,
    pub create_mem: CreateMemFn,
    pub destroy_mem: DestroyMemFn,
    /// `rknn_mem_sync(ctx, mem, mode)`: `rknn_create_mem` memory is cacheable, so without it
    /// the NPU reads stale A/B and the CPU stale C. A library without it is declined at load.
    pub mem_sync: MemSyncFn,
    _lib: libloading::Library,
}

/// The version from a `librknnrt version: X.Y.Z (…)` string anywhere in the file's bytes (as
/// Rockchip's docs find it with `strings | grep`): trust the bytes, not the file name.
pub fn embedded_version(bytes: &[u8]) -> Option<String> {
    const TAG: &[u8] = b"librknnrt version: ";
    let at = bytes.windows(TAG.len()).position(|w| w == TAG)?;
    let rest = &bytes[at + TAG.len()..];
    let end = rest
        .iter()
        .position(|b| *b == 0 || *b == b'\n' || !b.is_ascii() || b.is_ascii_control())
        .unwrap_or(rest.len())
        .min(200);
    let s = String::from_utf8_lossy(&rest[..end]).trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// Where the library is looked for: `KILN_RKNN_LIB`, else the dynamic linker's search path.
pub fn default_lib_path() -> PathBuf {
    std::env::var_os("KILN_RKNN_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("librknnrt.so"))
}

/// The file the dynamic linker would load for a bare name, for reading its version string.
fn resolve_on_disk(path: &Path) -> Option<PathBuf> {
    if path.components().count() > 1 {
        return Some(path.to_path_buf());
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib",
        "/lib",
        "/usr/local/lib",
        "/usr/lib/aarch64-linux-gnu",
        "/lib/aarch64-linux-gnu",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs.into_iter().map(|d| d.join(path)).find(|p| p.is_file())
}

unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T> {
    let s: libloading::Symbol<T> = lib
        .get(name.as_bytes())
        .with_context(|| format!("symbol {name} missing"))?;
    Ok(*s)
}

impl RknnLib {
    pub fn load(path: &Path) -> std::result::Result<RknnLib, LoadError> {
        // SAFETY: loading runs the library's initialisers; librknnrt's (and the stand-in's) are
        // benign. This is the documented way to use it without a link-time dependency.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| LoadError::Missing(format!("cannot load {}: {e}", path.display())))?;
        let has = |name: &str| unsafe { lib.get::<*const c_void>(name.as_bytes()).is_ok() };
        // rknn_matmul_set_quant_params arrived with the 64-byte info struct (2.0.0b0); a library
        // without it is 1.x, whose 24-byte info a 64-byte struct would overrun.
        let abi = if !has("rknn_matmul_set_quant_params") {
            return Err(LoadError::Abi(format!(
                "{} has no rknn_matmul_set_quant_params: a 1.x runtime (24-byte rknn_matmul_info); \
                 kiln needs the 2.x matmul ABI",
                path.display()
            )));
        } else if has("rknn_matmul_create_dynamic_shape") {
            Abi::V2_1
        } else {
            Abi::V2_0
        };
        let version = resolve_on_disk(path)
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| embedded_version(&b));
        let missing = |e: anyhow::Error| LoadError::Abi(format!("{}: {e:#}", path.display()));
        // SAFETY: the signatures are those of rknn_matmul_api.h / rknn_api.h 2.3.2, and the
        // pointers live as long as `_lib`, which the struct keeps.
        unsafe {
            Ok(RknnLib {
                path: path.to_path_buf(),
                abi,
                version,
                matmul_create: sym(&lib, "rknn_matmul_create").map_err(missing)?,
                matmul_set_io_mem: sym(&lib, "rknn_matmul_set_io_mem").map_err(missing)?,
                matmul_set_core_mask: sym(&lib, "rknn_matmul_set_core_mask").map_err(missing)?,
                matmul_run: sym(&lib, "rknn_matmul_run").map_err(missing)?,
                matmul_destroy: sym(&lib, "rknn_matmul_destroy").map_err(missing)?,
                create_mem: sym(&lib, "rknn_create_mem").map_err(missing)?,
                destroy_mem: sym(&lib, "rknn_destroy_mem").map_err(missing)?,
                mem_sync: sym(&lib, "rknn_mem_sync").map_err(|e| {
                    LoadError::Abi(format!(
                        "{}: {e:#}: kiln cannot keep the CPU's cache and the NPU's view of \
                         A, B and C coherent without it",
                        path.display()
                    ))
                })?,
                _lib: lib,
            })
        }
    }

    /// The stand-in says so in its version string; the real library never does.
    pub fn simulated(&self) -> bool {
        self.version
            .as_deref()
            .is_some_and(|v| v.contains("SIMULATOR"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_string_is_found_in_bytes() {
        let mut bytes = b"\x7fELF\0\0junk".to_vec();
        bytes.extend_from_slice(b"librknnrt version: 2.3.2 (429f97ae6b@2025-04-09T09:09:27)\0more");
        assert_eq!(
            embedded_version(&bytes).as_deref(),
            Some("2.3.2 (429f97ae6b@2025-04-09T09:09:27)")
        );
        assert_eq!(embedded_version(b"no version here"), None);
    }

    #[test]
    fn error_codes_are_named() {
        let e = check("rknn_matmul_run", -5).unwrap_err().to_string();
        assert_eq!(e, "rknn_matmul_run returned -5 (RKNN_ERR_PARAM_INVALID)");
        assert!(check("x", 0).is_ok());
    }
}
