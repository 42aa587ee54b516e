//! The device-mapper ioctls kiln needs (create, load a table, resume, read the table or the
//! status back, remove), on `/dev/mapper/control`, as `include/uapi/linux/dm-ioctl.h` defines
//! them (interface version 4).
//!
//! By hand because the one crate (`devicemapper`) generates its bindings with `bindgen` and
//! probes libdevmapper at build time, which a cross build for the board does not have; and
//! because the image then needs no `dmsetup` and libdevmapper. RAUC maps its verity bundles the
//! same way (its `dm.c`).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

const NAME_LEN: usize = 128;
const UUID_LEN: usize = 129;
/// `sizeof(struct dm_ioctl)`.
const HDR: usize = 312;
/// `sizeof(struct dm_target_spec)`.
const SPEC: usize = 40;

const DEV_CREATE: u8 = 3;
const DEV_REMOVE: u8 = 4;
const DEV_SUSPEND: u8 = 6;
const TABLE_LOAD: u8 = 9;
const TABLE_STATUS: u8 = 12;

const READONLY_FLAG: u32 = 1 << 0;
const STATUS_TABLE_FLAG: u32 = 1 << 4;
const BUFFER_FULL_FLAG: u32 = 1 << 8;

#[repr(C)]
#[derive(Clone, Copy)]
struct Header {
    version: [u32; 3],
    data_size: u32,
    data_start: u32,
    target_count: u32,
    open_count: i32,
    flags: u32,
    event_nr: u32,
    padding: u32,
    dev: u64,
    name: [u8; NAME_LEN],
    uuid: [u8; UUID_LEN],
    data: [u8; 7],
}

const _: () = assert!(std::mem::size_of::<Header>() == HDR);

/// A device-mapper error: the operation, the device's name and the kernel's errno.
#[derive(Debug)]
pub struct DmError {
    pub what: &'static str,
    pub name: String,
    pub err: std::io::Error,
}

impl std::fmt::Display for DmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device-mapper {} of {}: {}",
            self.what, self.name, self.err
        )
    }
}

impl std::error::Error for DmError {}

/// One target of a table read back: start and length in 512-byte sectors, its type and its
/// parameter (or status) text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub start: u64,
    pub length: u64,
    pub kind: String,
    pub params: String,
}

/// `/dev/mapper/control`, open.
pub struct Control {
    f: File,
}

fn request(nr: u8) -> nix::sys::ioctl::ioctl_num_type {
    // _IOWR(0xfd, nr, struct dm_ioctl): the same encoding on aarch64 and x86-64.
    nix::request_code_readwrite!(0xfd, nr, HDR)
}

impl Control {
    pub fn open(dev: &Path) -> Result<Control, DmError> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dev)
            .map_err(|err| DmError {
                what: "open of the control node",
                name: dev.display().to_string(),
                err,
            })?;
        Ok(Control { f })
    }

    /// One ioctl: the header for `name` with `flags` and `targets`, then `payload`, in a buffer
    /// of at least `room` bytes for the answer. Returns the answer's header and its data.
    #[allow(clippy::too_many_arguments)] // the ioctl header's fields, each named at the call
    fn call(
        &self,
        what: &'static str,
        nr: u8,
        name: &str,
        uuid: Option<&str>,
        flags: u32,
        targets: u32,
        payload: &[u8],
        room: usize,
    ) -> Result<(Header, Vec<u8>), DmError> {
        let fail = |err| DmError {
            what,
            name: name.to_string(),
            err,
        };
        if name.is_empty() || name.len() >= NAME_LEN || uuid.is_some_and(|u| u.len() >= UUID_LEN) {
            return Err(fail(std::io::Error::from(std::io::ErrorKind::InvalidInput)));
        }
        let mut room = room.max(payload.len()).next_multiple_of(8);
        loop {
            // u64 words: the buffer is aligned for the header and the target specs.
            let mut buf = vec![0u64; (HDR + room) / 8];
            let mut h = Header {
                version: [4, 0, 0],
                data_size: (HDR + room) as u32,
                data_start: HDR as u32,
                target_count: targets,
                open_count: 0,
                flags,
                event_nr: 0,
                padding: 0,
                dev: 0,
                name: [0; NAME_LEN],
                uuid: [0; UUID_LEN],
                data: [0; 7],
            };
            h.name[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(u) = uuid {
                h.uuid[..u.len()].copy_from_slice(u.as_bytes());
            }
            // SAFETY: `buf` holds at least HDR + payload bytes, is 8-aligned, and Header is
            // plain old data of HDR bytes.
            unsafe {
                let p = buf.as_mut_ptr() as *mut u8;
                std::ptr::copy_nonoverlapping(&h as *const Header as *const u8, p, HDR);
                std::ptr::copy_nonoverlapping(payload.as_ptr(), p.add(HDR), payload.len());
            }
            // SAFETY: the kernel reads and writes at most data_size bytes of `buf`, which is
            // that long.
            let r = unsafe {
                libc::ioctl(
                    self.f.as_raw_fd(),
                    request(nr) as _,
                    buf.as_mut_ptr() as *mut libc::c_void,
                )
            };
            if r < 0 {
                return Err(fail(std::io::Error::last_os_error()));
            }
            // SAFETY: as above; the kernel wrote a Header at the start.
            let out: Header = unsafe { std::ptr::read(buf.as_ptr() as *const Header) };
            if out.flags & BUFFER_FULL_FLAG != 0 {
                room *= 4;
                if room > 1 << 24 {
                    return Err(fail(std::io::Error::other("answer larger than 16 MiB")));
                }
                continue;
            }
            let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
            let start = (out.data_start as usize).min(bytes.len());
            let end = (out.data_size as usize).clamp(start, bytes.len());
            return Ok((out, bytes[start..end].to_vec()));
        }
    }

    /// Create the device `name` (no table yet); its `major:minor`.
    pub fn create(&self, name: &str, uuid: &str) -> Result<(u32, u32), DmError> {
        let (h, _) = self.call("create", DEV_CREATE, name, Some(uuid), 0, 0, &[], 0)?;
        // huge_encode_dev
        let major = ((h.dev >> 8) & 0xfff) as u32;
        let minor = ((h.dev & 0xff) | ((h.dev >> 12) & 0xfff00)) as u32;
        Ok((major, minor))
    }

    /// Load a read-only table of one target into `name`'s inactive slot.
    pub fn load(&self, name: &str, t: &Target) -> Result<(), DmError> {
        let mut params = t.params.as_bytes().to_vec();
        params.push(0);
        let len = (SPEC + params.len()).next_multiple_of(8);
        let mut spec = vec![0u8; len];
        spec[0..8].copy_from_slice(&t.start.to_ne_bytes());
        spec[8..16].copy_from_slice(&t.length.to_ne_bytes());
        // status (i32) stays 0; next: the offset of the (absent) next spec from this one.
        spec[20..24].copy_from_slice(&(len as u32).to_ne_bytes());
        let kind = t.kind.as_bytes();
        if kind.len() >= 16 {
            return Err(DmError {
                what: "table load",
                name: name.to_string(),
                err: std::io::Error::other(format!("target type {:?} too long", t.kind)),
            });
        }
        spec[24..24 + kind.len()].copy_from_slice(kind);
        spec[SPEC..SPEC + params.len()].copy_from_slice(&params);
        self.call(
            "table load",
            TABLE_LOAD,
            name,
            None,
            READONLY_FLAG,
            1,
            &spec,
            0,
        )
        .map(|_| ())
    }

    /// Make the loaded table live (a resume).
    pub fn resume(&self, name: &str) -> Result<(), DmError> {
        self.call("resume", DEV_SUSPEND, name, None, 0, 0, &[], 0)
            .map(|_| ())
    }

    pub fn remove(&self, name: &str) -> Result<(), DmError> {
        self.call("remove", DEV_REMOVE, name, None, 0, 0, &[], 0)
            .map(|_| ())
    }

    /// The live table (`table`: the parameters as loaded) or each target's status.
    pub fn targets(&self, name: &str, table: bool) -> Result<Vec<Target>, DmError> {
        let flags = if table { STATUS_TABLE_FLAG } else { 0 };
        let what = if table { "table read" } else { "status read" };
        let (h, data) = self.call(what, TABLE_STATUS, name, None, flags, 0, &[], 16 << 10)?;
        let bad = || DmError {
            what,
            name: name.to_string(),
            err: std::io::Error::other("malformed answer from the kernel"),
        };
        let mut out = Vec::new();
        let mut at = 0usize;
        for _ in 0..h.target_count {
            let spec = data.get(at..at + SPEC).ok_or_else(bad)?;
            let u64_at = |i: usize| u64::from_ne_bytes(spec[i..i + 8].try_into().unwrap_or([0; 8]));
            let next = u32::from_ne_bytes(spec[20..24].try_into().unwrap_or([0; 4])) as usize;
            let cstr = |b: &[u8]| {
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end]).into_owned()
            };
            out.push(Target {
                start: u64_at(0),
                length: u64_at(8),
                kind: cstr(&spec[24..40]),
                params: cstr(data.get(at + SPEC..).ok_or_else(bad)?),
            });
            // `next` counts from the start of the data.
            if next <= at {
                break;
            }
            at = next;
        }
        Ok(out)
    }
}
