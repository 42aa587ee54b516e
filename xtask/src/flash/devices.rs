//! What the host's block devices are, and which one may be written. Facts are gathered once
//! (`lsblk`, `/proc/swaps`, `/sys/block/*/holders`, `/proc/self/mountinfo`, `/dev/disk/by-id`)
//! into [`Host`]; the decision, [`assess`], is a pure function of them so that it is tested over
//! recorded `lsblk -J` output.

use anyhow::{Context, Result};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// The `lsblk` columns we read; fixtures are recorded with exactly these.
pub const LSBLK_COLUMNS: &str = "NAME,TYPE,RM,HOTPLUG,TRAN,SIZE,RO,MOUNTPOINTS,MODEL,SERIAL";

/// Disks above this size are probably not SD cards: `--force-large` (bytes, decimal GB as
/// vendors count).
pub const LARGE_BYTES: u64 = 256_000_000_000;

/// One node of `lsblk -J -b`, children (partitions, holders) included.
#[derive(Clone, Debug, Deserialize)]
pub struct BlockDev {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(deserialize_with = "flag")]
    pub rm: bool,
    #[serde(deserialize_with = "flag")]
    pub hotplug: bool,
    pub tran: Option<String>,
    #[serde(deserialize_with = "number")]
    pub size: u64,
    #[serde(deserialize_with = "flag")]
    pub ro: bool,
    #[serde(default)]
    pub mountpoints: Vec<Option<String>>,
    pub model: Option<String>,
    pub serial: Option<String>,
    #[serde(default)]
    pub children: Vec<BlockDev>,
}

/// util-linux before 2.37 printed flags as "0"/"1" strings; later as JSON booleans.
fn flag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Bool(b) => Ok(b),
        serde_json::Value::Null => Ok(false),
        serde_json::Value::String(s) => Ok(s.trim() == "1"),
        serde_json::Value::Number(n) => Ok(n.as_u64() == Some(1)),
        v => Err(serde::de::Error::custom(format!("not a flag: {v}"))),
    }
}

/// Sizes are numbers with `-b` on recent util-linux, strings on older ones.
fn number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| serde::de::Error::custom(format!("not a size: {n}"))),
        serde_json::Value::String(s) => s
            .trim()
            .parse()
            .map_err(|_| serde::de::Error::custom(format!("not a size: {s:?}"))),
        serde_json::Value::Null => Ok(0),
        v => Err(serde::de::Error::custom(format!("not a size: {v}"))),
    }
}

impl BlockDev {
    /// This node and everything below it.
    pub fn walk(&self) -> Vec<&BlockDev> {
        let mut out = vec![self];
        for c in &self.children {
            out.extend(c.walk());
        }
        out
    }

    pub fn mounts(&self) -> impl Iterator<Item = &str> {
        self.mountpoints.iter().flatten().map(String::as_str)
    }

    /// Card readers and USB sticks: removable or hot-plugged, or on a USB or MMC bus. The MMC
    /// core never sets the removable flag, so a built-in SD reader counts by its transport.
    pub fn is_removable_kind(&self) -> bool {
        self.rm
            || self.hotplug
            || matches!(self.tran.as_deref(), Some("usb") | Some("mmc"))
            || self.name.starts_with("mmcblk")
    }
}

#[derive(Deserialize)]
struct LsblkOutput {
    blockdevices: Vec<BlockDev>,
}

pub fn parse_lsblk(json: &str) -> Result<Vec<BlockDev>> {
    let out: LsblkOutput = serde_json::from_str(json).context("parsing `lsblk -J` output")?;
    Ok(out.blockdevices)
}

/// Everything the decision needs about the host.
#[derive(Clone, Debug, Default)]
pub struct Host {
    /// Top-level nodes of `lsblk` with their children.
    pub devices: Vec<BlockDev>,
    /// Kernel names of devices used as swap (`/proc/swaps`).
    pub swaps: BTreeSet<String>,
    /// Kernel name -> names in its `/sys/block/…/holders` (dm, md, bcache over it).
    pub holders: BTreeMap<String, Vec<String>>,
    /// Whole-disk kernel name -> why it must never be written (holds `/`, the image, …).
    pub protected: BTreeMap<String, Vec<String>>,
    /// Kernel name -> its `/dev/disk/by-id` names.
    pub by_id: BTreeMap<String, Vec<String>>,
}

/// What the user allowed beyond the safe default.
#[derive(Clone, Copy, Debug, Default)]
pub struct Policy {
    pub allow_loop: bool,
    pub force_non_removable: bool,
    pub force_large: bool,
    /// Bytes that will be written at most (the raw image size).
    pub image_size: u64,
}

/// Why a device is not written. Each is a hard refusal except those an option lifts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    NotFound,
    Partition { disk: String },
    Loop,
    DeviceMapper,
    Raid,
    Zram,
    NotADisk { kind: String },
    Mounted { node: String, at: String },
    Swap { node: String },
    Held { node: String, by: String },
    Protected { why: String },
    ReadOnly,
    TooSmall { size: u64, need: u64 },
    NonRemovable,
    TooLarge { size: u64 },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotFound => write!(f, "no such block device in lsblk"),
            Refusal::Partition { disk } => {
                write!(f, "is a partition or holder of {disk}: give the whole disk")
            }
            Refusal::Loop => write!(f, "is a loop device (pass --allow-loop to write it)"),
            Refusal::DeviceMapper => write!(f, "is a device-mapper device (LVM, crypt)"),
            Refusal::Raid => write!(f, "is an md RAID device"),
            Refusal::Zram => write!(f, "is a zram device (compressed RAM)"),
            Refusal::NotADisk { kind } => write!(f, "is a {kind}, not a disk"),
            Refusal::Mounted { node, at } => write!(f, "{node} is mounted at {at}"),
            Refusal::Swap { node } => write!(f, "{node} is in use as swap"),
            Refusal::Held { node, by } => {
                write!(f, "{node} is held by {by} (LVM, dm-crypt, md or dm)")
            }
            Refusal::Protected { why } => write!(f, "holds {why}"),
            Refusal::ReadOnly => write!(f, "is read-only (write-protect switch?)"),
            Refusal::TooSmall { size, need } => write!(
                f,
                "is too small: {} but the image needs {}",
                human(*size),
                human(*need)
            ),
            Refusal::NonRemovable => write!(
                f,
                "is a fixed disk (not removable, hot-plugged, USB or MMC); pass \
                 --force-non-removable if you really mean it"
            ),
            Refusal::TooLarge { size } => write!(
                f,
                "is {} (over {}): probably not an SD card; pass --force-large if you mean it",
                human(*size),
                human(LARGE_BYTES)
            ),
        }
    }
}

pub fn human(bytes: u64) -> String {
    let gb = bytes as f64 / 1e9;
    if gb >= 1.0 {
        format!("{gb:.1} GB")
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

fn holder_kind(kind: &str) -> bool {
    matches!(kind, "lvm" | "crypt" | "dm" | "mpath" | "md") || kind.starts_with("raid")
}

/// May `name` (a kernel name like `sdb`) be overwritten with an image? `Ok` gives the lsblk
/// node; `Err` every reason it may not, so the user sees them all at once.
pub fn assess<'h>(host: &'h Host, name: &str, p: &Policy) -> Result<&'h BlockDev, Vec<Refusal>> {
    let Some(disk) = host.devices.iter().find(|d| d.name == name) else {
        // A child node: partition or holder; say whose.
        for d in &host.devices {
            if d.walk().iter().skip(1).any(|n| n.name == name) {
                return Err(vec![Refusal::Partition {
                    disk: d.name.clone(),
                }]);
            }
        }
        return Err(vec![Refusal::NotFound]);
    };
    let mut why = Vec::new();
    let is_loop = disk.kind == "loop" || disk.name.starts_with("loop");
    if is_loop {
        if !p.allow_loop {
            why.push(Refusal::Loop);
        }
    } else if disk.name.starts_with("zram") {
        why.push(Refusal::Zram);
    } else if disk.name.starts_with("dm-") || matches!(disk.kind.as_str(), "lvm" | "crypt" | "dm") {
        why.push(Refusal::DeviceMapper);
    } else if disk.name.starts_with("md") || disk.kind.starts_with("raid") || disk.kind == "md" {
        why.push(Refusal::Raid);
    } else if disk.kind != "disk" {
        why.push(Refusal::NotADisk {
            kind: disk.kind.clone(),
        });
    }
    for n in disk.walk() {
        for at in n.mounts() {
            if at == "[SWAP]" {
                why.push(Refusal::Swap {
                    node: n.name.clone(),
                });
            } else {
                why.push(Refusal::Mounted {
                    node: n.name.clone(),
                    at: at.to_string(),
                });
            }
        }
        if host.swaps.contains(&n.name) && !n.mounts().any(|m| m == "[SWAP]") {
            why.push(Refusal::Swap {
                node: n.name.clone(),
            });
        }
        for c in &n.children {
            if holder_kind(&c.kind) {
                why.push(Refusal::Held {
                    node: n.name.clone(),
                    by: format!("{} ({})", c.name, c.kind),
                });
            }
        }
        for h in host.holders.get(&n.name).into_iter().flatten() {
            if !holder_kind_of(n, h) {
                why.push(Refusal::Held {
                    node: n.name.clone(),
                    by: h.clone(),
                });
            }
        }
    }
    for w in host.protected.get(&disk.name).into_iter().flatten() {
        why.push(Refusal::Protected { why: w.clone() });
    }
    if disk.ro {
        why.push(Refusal::ReadOnly);
    }
    if disk.size < p.image_size {
        why.push(Refusal::TooSmall {
            size: disk.size,
            need: p.image_size,
        });
    }
    if !(disk.is_removable_kind() || (is_loop && p.allow_loop) || p.force_non_removable) {
        why.push(Refusal::NonRemovable);
    }
    if disk.size > LARGE_BYTES && !p.force_large {
        why.push(Refusal::TooLarge { size: disk.size });
    }
    if why.is_empty() {
        Ok(disk)
    } else {
        Err(why)
    }
}

/// Whether `h` is already reported as a holder child of `n` (so it is not listed twice).
fn holder_kind_of(n: &BlockDev, h: &str) -> bool {
    n.children
        .iter()
        .any(|c| c.name == h && holder_kind(&c.kind))
}

/// Every top-level device with its verdict, for the interactive list.
pub fn survey<'h>(host: &'h Host, p: &Policy) -> Vec<(&'h BlockDev, Result<(), Vec<Refusal>>)> {
    host.devices
        .iter()
        .map(|d| (d, assess(host, &d.name, p).map(|_| ())))
        .collect()
}

// ---- gathering the facts (the impure edge) ----

/// `/proc/self/mountinfo`: (mount point, "major:minor") per line. Mount points are unescaped
/// (`\040` for space).
pub fn parse_mountinfo(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let devno = f.get(2)?;
            let at = f.get(4)?;
            Some((unescape_octal(at), devno.to_string()))
        })
        .collect()
}

fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let digits = std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(digits, 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount (its "major:minor") that contains `path`: the longest mount point that prefixes it.
pub fn mount_of(mounts: &[(String, String)], path: &Path) -> Option<String> {
    mounts
        .iter()
        .filter(|(at, _)| path.starts_with(at))
        .max_by_key(|(at, _)| at.len())
        .map(|(_, dev)| dev.clone())
}

/// The whole disks under block device `maj:min` (through `slaves/` for dm and md, through the
/// parent for a partition), from sysfs.
pub fn disks_of_devno(sys: &Path, devno: &str) -> Vec<String> {
    let Ok(real) = std::fs::canonicalize(sys.join("dev/block").join(devno)) else {
        return Vec::new();
    };
    disks_of_sysfs(&real, 0)
}

fn disks_of_sysfs(node: &Path, depth: u32) -> Vec<String> {
    if depth > 8 {
        return Vec::new();
    }
    let slaves: Vec<PathBuf> = std::fs::read_dir(node.join("slaves"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    if !slaves.is_empty() {
        return slaves
            .iter()
            .filter_map(|s| std::fs::canonicalize(s).ok())
            .flat_map(|s| disks_of_sysfs(&s, depth + 1))
            .collect();
    }
    let is_partition = node.join("partition").exists();
    let disk = if is_partition {
        node.parent()
    } else {
        Some(node)
    };
    disk.and_then(|d| d.file_name())
        .map(|n| vec![n.to_string_lossy().into_owned()])
        .unwrap_or_default()
}

/// The nearest existing ancestor (the cache may not exist yet), canonicalised.
fn existing(path: &Path) -> Option<PathBuf> {
    path.ancestors().find_map(|a| std::fs::canonicalize(a).ok())
}

/// The paths whose disks are never written, with why.
pub fn protected_paths(image: &Path) -> Vec<(PathBuf, String)> {
    let mut v: Vec<(PathBuf, String)> = ["/", "/boot", "/boot/efi", "/usr", "/home"]
        .iter()
        .map(|p| (PathBuf::from(p), format!("{p} (a system file system)")))
        .collect();
    v.push((
        image.to_path_buf(),
        format!("the image file {}", image.display()),
    ));
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|c| c.join("kiln"));
    if let Some(c) = cache {
        let why = format!("the download cache {}", c.display());
        v.push((c, why));
    }
    v
}

/// Gather the facts from this machine.
pub fn gather(image: &Path) -> Result<Host> {
    let sh = xshell::Shell::new()?;
    let json = xshell::cmd!(sh, "lsblk -J -b -o {LSBLK_COLUMNS}")
        .read()
        .context("running lsblk")?;
    let devices = parse_lsblk(&json)?;
    let swaps = std::fs::read_to_string("/proc/swaps")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|p| {
            std::fs::canonicalize(p)
                .ok()
                .and_then(|c| c.file_name().map(|n| n.to_string_lossy().into_owned()))
        })
        .collect();
    let mut holders = BTreeMap::new();
    for d in &devices {
        for n in d.walk() {
            let dir = sysfs_node(&d.name, &n.name).join("holders");
            let hs: Vec<String> = std::fs::read_dir(&dir)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            if !hs.is_empty() {
                holders.insert(n.name.clone(), hs);
            }
        }
    }
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    let mounts = parse_mountinfo(&mountinfo);
    let mut protected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let system = ["/boot", "/boot/efi", "/usr", "/home"];
    for (path, why) in protected_paths(image) {
        let Some(real) = existing(&path) else {
            continue;
        };
        // `/boot` on the root file system is covered by `/`; name it only as its own mount.
        if system.iter().any(|s| path == Path::new(s))
            && !mounts.iter().any(|(at, _)| Path::new(at) == real)
        {
            continue;
        }
        let Some(devno) = mount_of(&mounts, &real) else {
            continue;
        };
        for disk in disks_of_devno(Path::new("/sys"), &devno) {
            let e = protected.entry(disk).or_default();
            if !e.contains(&why) {
                e.push(why.clone());
            }
        }
    }
    let mut by_id: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir("/dev/disk/by-id") {
        for e in rd.flatten() {
            if let Ok(t) = std::fs::canonicalize(e.path()) {
                if let Some(n) = t.file_name() {
                    by_id
                        .entry(n.to_string_lossy().into_owned())
                        .or_default()
                        .push(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
    }
    for v in by_id.values_mut() {
        v.sort();
    }
    Ok(Host {
        devices,
        swaps,
        holders,
        protected,
        by_id,
    })
}

fn sysfs_node(disk: &str, node: &str) -> PathBuf {
    let top = Path::new("/sys/block").join(disk);
    if disk == node {
        top
    } else if top.join(node).exists() {
        top.join(node)
    } else {
        Path::new("/sys/class/block").join(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<BlockDev> {
        let p = crate::paths::project_root()
            .join("xtask/tests/fixtures/lsblk")
            .join(name);
        let text = std::fs::read_to_string(&p).expect("fixture exists");
        parse_lsblk(&text).expect("fixture parses")
    }

    fn host(name: &str) -> Host {
        Host {
            devices: fixture(name),
            ..Host::default()
        }
    }

    const IMG: u64 = 2 << 30;

    fn policy() -> Policy {
        Policy {
            image_size: IMG,
            ..Policy::default()
        }
    }

    #[test]
    fn nvme_laptop_disk_is_refused() {
        let mut h = host("laptop-nvme-usb-reader.json");
        let e = assess(&h, "nvme0n1", &policy()).expect_err("system disk");
        assert!(e.contains(&Refusal::NonRemovable), "{e:?}");
        assert!(
            e.iter()
                .any(|r| matches!(r, Refusal::Mounted { at, .. } if at == "/")),
            "{e:?}"
        );
        assert!(e.iter().any(|r| matches!(r, Refusal::Swap { .. })), "{e:?}");
        assert!(
            e.iter().any(|r| matches!(r, Refusal::TooLarge { .. })),
            "{e:?}"
        );
        // Even with every override, the mounts and the root still refuse it.
        h.protected
            .insert("nvme0n1".into(), vec!["/ (a system file system)".into()]);
        let all = Policy {
            allow_loop: true,
            force_non_removable: true,
            force_large: true,
            image_size: IMG,
        };
        let e = assess(&h, "nvme0n1", &all).expect_err("still refused");
        assert!(
            e.iter().any(|r| matches!(r, Refusal::Protected { .. })),
            "{e:?}"
        );
        assert!(!e.contains(&Refusal::NonRemovable));
        // Partitions are never targets.
        let e = assess(&h, "nvme0n1p2", &all).expect_err("partition");
        assert_eq!(
            e,
            vec![Refusal::Partition {
                disk: "nvme0n1".into()
            }]
        );
    }

    #[test]
    fn usb_card_reader_is_accepted() {
        let h = host("laptop-nvme-usb-reader.json");
        let d = assess(&h, "sda", &policy()).expect("an unmounted SD card in a USB reader");
        assert_eq!(d.tran.as_deref(), Some("usb"));
        // A card smaller than the image is not.
        let big = Policy {
            image_size: 64_000_000_000,
            ..policy()
        };
        let e = assess(&h, "sda", &big).expect_err("too small");
        assert!(matches!(e[0], Refusal::TooSmall { .. }), "{e:?}");
        // The survey offers exactly the reader.
        let ok: Vec<&str> = survey(&h, &policy())
            .into_iter()
            .filter(|(_, v)| v.is_ok())
            .map(|(d, _)| d.name.as_str())
            .collect();
        assert_eq!(ok, vec!["sda"]);
    }

    #[test]
    fn builtin_mmc_reader_counts_as_removable() {
        let h = host("builtin-mmcblk0.json");
        let d = h
            .devices
            .iter()
            .find(|d| d.name == "mmcblk0")
            .expect("fixture");
        assert!(
            !d.rm,
            "the fixture records removable=0, as the MMC core reports"
        );
        assert!(assess(&h, "mmcblk0", &policy()).is_ok());
        assert!(assess(&h, "mmcblk0p1", &policy()).is_err());
        // And the same card with its transport unknown still counts, by its name.
        let mut h2 = h.clone();
        for d in &mut h2.devices {
            d.tran = None;
        }
        assert!(assess(&h2, "mmcblk0", &policy()).is_ok());
    }

    #[test]
    fn usb_hard_disk_needs_force_large() {
        let h = host("usb-hdd.json");
        let e = assess(&h, "sdb", &policy()).expect_err("2 TB");
        assert_eq!(
            e,
            vec![Refusal::TooLarge {
                size: 2_000_398_934_016
            }]
        );
        let forced = Policy {
            force_large: true,
            ..policy()
        };
        assert!(assess(&h, "sdb", &forced).is_ok());
    }

    #[test]
    fn mounted_partition_refuses_its_disk() {
        let h = host("usb-stick-mounted.json");
        let all = Policy {
            allow_loop: true,
            force_non_removable: true,
            force_large: true,
            image_size: IMG,
        };
        let e = assess(&h, "sdc", &all).expect_err("mounted");
        assert!(
            e.iter().any(|r| matches!(r, Refusal::Mounted { node, at }
                if node == "sdc1" && at == "/media/user/KILN-BOOT")),
            "{e:?}"
        );
    }

    #[test]
    fn holders_swap_and_special_devices() {
        let h = host("lvm-zram-loop.json");
        let all = Policy {
            allow_loop: true,
            force_non_removable: true,
            force_large: true,
            image_size: 1 << 20,
        };
        let e = assess(&h, "sdd", &all).expect_err("LVM physical volume");
        assert!(e.iter().any(|r| matches!(r, Refusal::Held { .. })), "{e:?}");
        let e = assess(&h, "zram0", &all).expect_err("zram");
        assert!(e.contains(&Refusal::Zram), "{e:?}");
        let no_loop = Policy {
            allow_loop: false,
            ..all
        };
        let e = assess(&h, "loop0", &no_loop).expect_err("loop");
        assert_eq!(e, vec![Refusal::Loop]);
        assert!(assess(&h, "loop0", &all).is_ok());
        // Swap known only from /proc/swaps (lsblk not showing it) still counts.
        let mut h2 = h.clone();
        h2.swaps.insert("loop0".into());
        assert!(assess(&h2, "loop0", &all)
            .expect_err("swap")
            .contains(&Refusal::Swap {
                node: "loop0".into()
            }));
        // A holder known only from sysfs.
        let mut h3 = h.clone();
        h3.holders.insert("loop0".into(), vec!["dm-3".into()]);
        assert!(assess(&h3, "loop0", &all).is_err());
        // Read-only.
        let mut h4 = h.clone();
        for d in &mut h4.devices {
            d.ro = true;
        }
        assert!(assess(&h4, "loop0", &all)
            .expect_err("ro")
            .contains(&Refusal::ReadOnly));
    }

    /// util-linux before 2.37 printed flags and sizes as strings.
    #[test]
    fn old_lsblk_string_columns_parse() {
        let json = r#"{"blockdevices": [{"name":"sdb","type":"disk","rm":"1","hotplug":"1",
            "tran":"usb","size":"31914983424","ro":"0","mountpoints":[null],"model":"Card Reader",
            "serial":null}]}"#;
        let d = parse_lsblk(json).expect("parses");
        assert!(d[0].rm && d[0].hotplug && !d[0].ro);
        assert_eq!(d[0].size, 31_914_983_424);
        assert!(parse_lsblk(r#"{"blockdevices":[{"name":"x","type":"disk","rm":[],"#).is_err());
    }

    #[test]
    fn mountinfo_finds_the_root_device() {
        let text = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
                    40 27 259:2 / /boot/efi rw - vfat /dev/nvme0n1p1 rw\n\
                    41 27 0:30 / /mnt/my\\040disk rw - tmpfs tmpfs rw\n";
        let m = parse_mountinfo(text);
        assert_eq!(
            mount_of(&m, Path::new("/work/x.img")).as_deref(),
            Some("254:0")
        );
        assert_eq!(
            mount_of(&m, Path::new("/boot/efi/EFI")).as_deref(),
            Some("259:2")
        );
        assert_eq!(
            mount_of(&m, Path::new("/mnt/my disk/a")).as_deref(),
            Some("0:30")
        );
    }

    /// The real machine: the disk under `/` is found and refused whatever the options.
    #[test]
    fn the_real_root_disk_is_refused() {
        crate::doctor::ensure(&[&crate::doctor::LSBLK]).expect("lsblk");
        let host = gather(Path::new("/")).expect("gather");
        let mounts =
            parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo"));
        let devno = mount_of(&mounts, Path::new("/")).expect("/ is mounted");
        let disks = disks_of_devno(Path::new("/sys"), &devno);
        assert!(
            !disks.is_empty(),
            "/ is on {devno}, which sysfs does not resolve to a disk (a container?)"
        );
        let all = Policy {
            allow_loop: true,
            force_non_removable: true,
            force_large: true,
            image_size: 1,
        };
        for d in &disks {
            let e = assess(&host, d, &all).expect_err("the root disk must be refused");
            assert!(
                e.iter()
                    .any(|r| matches!(r, Refusal::Protected { why } if why.starts_with("/ "))),
                "{d}: {e:?}"
            );
        }
    }
}
