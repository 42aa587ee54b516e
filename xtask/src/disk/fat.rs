//! The FAT boot partition, written in-process with `fatfs`: fixed volume id and label, every time
//! stamp from one epoch (a fixed `TimeProvider`, never the clock), files inserted in sorted order,
//! so the bytes depend on nothing but the arguments. Read back (read-only) from an image file or a
//! block device at a partition's offset.

use super::AtomicOut;
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

/// FAT32 needs at least this many clusters (fewer and every implementation reads it as FAT16).
const FAT32_MIN_CLUSTERS: u64 = 65525;

/// Which FAT a volume was formatted as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum FatKind {
    Fat12,
    Fat16,
    Fat32,
}

/// Build a FAT volume of `size` bytes at `out` holding `files` (`'/'`-separated paths; parent
/// folders are created as needed). FAT32 when the size allows at least 65525 clusters of 512 B or
/// more, else FAT16 (or FAT12). Every date is `epoch` (UTC; FAT's range is 1980–2107).
pub fn build(
    out: &Path,
    size: u64,
    volume_id: u32,
    label: &str,
    files: &[(String, Vec<u8>)],
    epoch: i64,
) -> Result<FatKind> {
    ensure!(
        size % 512 == 0,
        "FAT volume size {size} is not a multiple of 512"
    );
    let label = volume_label(label)?;
    let clock = clock_for(epoch)?;
    let tree = plan(files)?;

    let tmp = AtomicOut::new(out)?;
    let mut f = tmp.create()?;
    f.set_len(size)
        .with_context(|| format!("sizing {} to {size} bytes", tmp.path().display()))?;
    let kind = format(&mut f, size, volume_id, label)
        .with_context(|| format!("formatting {}", tmp.path().display()))?;
    f.seek(SeekFrom::Start(0))?;
    {
        let fs = fatfs::FileSystem::new(&mut f, fatfs::FsOptions::new().time_provider(clock))
            .with_context(|| format!("mounting the new FAT in {}", tmp.path().display()))?;
        let root = fs.root_dir();
        for item in &tree {
            match item {
                Item::Dir(p) => {
                    root.create_dir(p)
                        .with_context(|| format!("creating folder {p} in the FAT image"))?;
                }
                Item::File(p, data) => {
                    let mut file = root
                        .create_file(p)
                        .with_context(|| format!("creating {p} in the FAT image"))?;
                    file.truncate()?;
                    file.write_all(data).with_context(|| {
                        format!("writing {p} into the FAT image ({} bytes)", data.len())
                    })?;
                    file.flush()?;
                }
            }
        }
        drop(root);
        // Fills FSInfo's free-cluster count (written at unmount), which fsck otherwise flags.
        fs.stats()
            .with_context(|| format!("counting free clusters of {}", tmp.path().display()))?;
        fs.unmount()
            .with_context(|| format!("closing the FAT in {}", tmp.path().display()))?;
    }
    fix_dot_entries(&f, kind)
        .with_context(|| format!("repairing `.`/`..` entries in {}", tmp.path().display()))?;
    drop(f);
    tmp.commit()?;
    Ok(kind)
}

fn format(f: &mut File, size: u64, volume_id: u32, label: [u8; 11]) -> Result<FatKind> {
    let base = fatfs::FormatVolumeOptions::new()
        .volume_id(volume_id)
        .volume_label(label)
        .bytes_per_sector(512);
    // Largest cluster that still leaves FAT32 its minimum cluster count; fatfs then places the
    // FATs and counts exactly.
    for cluster in [4096u32, 2048, 1024, 512] {
        if size / u64::from(cluster) < FAT32_MIN_CLUSTERS + 1024 {
            continue;
        }
        f.seek(SeekFrom::Start(0))?;
        let opts = base
            .clone()
            .fat_type(fatfs::FatType::Fat32)
            .bytes_per_cluster(cluster);
        if fatfs::format_volume(&mut *f, opts).is_ok() {
            return Ok(FatKind::Fat32);
        }
    }
    f.seek(SeekFrom::Start(0))?;
    fatfs::format_volume(&mut *f, base)?;
    f.seek(SeekFrom::Start(0))?;
    let fs = fatfs::FileSystem::new(&mut *f, fatfs::FsOptions::new())?;
    Ok(match fs.fat_type() {
        fatfs::FatType::Fat12 => FatKind::Fat12,
        fatfs::FatType::Fat16 => FatKind::Fat16,
        fatfs::FatType::Fat32 => FatKind::Fat32,
    })
}

/// The geometry of a FAT volume, from its boot sector.
struct Geometry {
    kind: FatKind,
    bytes_per_sector: u64,
    cluster_bytes: u64,
    fat_start: u64,
    first_data: u64,
    /// FAT12/16: the fixed root directory region (offset, bytes).
    fixed_root: (u64, u64),
    root_cluster: u32,
}

impl Geometry {
    fn read(f: &File, kind: FatKind) -> Result<Geometry> {
        let mut b = [0u8; 512];
        f.read_exact_at(&mut b, 0)?;
        let u16_at = |o: usize| u64::from(u16::from_le_bytes([b[o], b[o + 1]]));
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let bps = u16_at(0x0B);
        let spc = u64::from(b[0x0D]);
        let reserved = u16_at(0x0E);
        let fats = u64::from(b[0x10]);
        let root_entries = u16_at(0x11);
        let fat_size = match u16_at(0x16) {
            0 => u64::from(u32_at(0x24)),
            n => n,
        };
        ensure!(bps >= 512 && spc > 0, "not a FAT boot sector");
        let root_dir_bytes = (root_entries * 32).div_ceil(bps) * bps;
        let fat_start = reserved * bps;
        let root_start = fat_start + fats * fat_size * bps;
        Ok(Geometry {
            kind,
            bytes_per_sector: bps,
            cluster_bytes: spc * bps,
            fat_start,
            first_data: root_start + root_dir_bytes,
            fixed_root: (root_start, root_dir_bytes),
            root_cluster: if kind == FatKind::Fat32 {
                u32_at(0x2C)
            } else {
                0
            },
        })
    }

    fn cluster_offset(&self, c: u32) -> u64 {
        self.first_data + u64::from(c - 2) * self.cluster_bytes
    }

    fn next_cluster(&self, f: &File, c: u32) -> Result<Option<u32>> {
        let next = match self.kind {
            FatKind::Fat32 => {
                let mut e = [0u8; 4];
                f.read_exact_at(&mut e, self.fat_start + 4 * u64::from(c))?;
                u32::from_le_bytes(e) & 0x0FFF_FFFF
            }
            FatKind::Fat16 => {
                let mut e = [0u8; 2];
                f.read_exact_at(&mut e, self.fat_start + 2 * u64::from(c))?;
                u32::from(u16::from_le_bytes(e)) | 0x0FFF_0000
            }
            FatKind::Fat12 => {
                let mut e = [0u8; 2];
                f.read_exact_at(&mut e, self.fat_start + u64::from(c) * 3 / 2)?;
                let v = u16::from_le_bytes(e);
                let v = if c % 2 == 0 { v & 0x0FFF } else { v >> 4 };
                u32::from(v) | 0x0FFF_F000
            }
        };
        Ok(
            if (2..0x0FFF_FFF7).contains(&(next & 0x0FFF_FFFF)) && next < 0x0FFF_0000 {
                Some(next)
            } else {
                None
            },
        )
    }

    /// The byte ranges holding a directory's entries (one per cluster, or the fixed root).
    fn dir_extents(&self, f: &File, first: Option<u32>) -> Result<Vec<(u64, u64)>> {
        let Some(mut c) = first else {
            return Ok(vec![self.fixed_root]);
        };
        let mut out = Vec::new();
        loop {
            ensure!(out.len() < 1 << 20, "directory cluster chain loops");
            out.push((self.cluster_offset(c), self.cluster_bytes));
            match self.next_cluster(f, c)? {
                Some(n) => c = n,
                None => return Ok(out),
            }
        }
    }
}

const DOT: [u8; 11] = *b".          ";
const DOTDOT: [u8; 11] = *b"..         ";
const ATTR_LFN: u8 = 0x0F;
const ATTR_DIR: u8 = 0x10;

/// fatfs 0.3.6 (the last release) writes a long-name entry before `.` and `..` of every new folder
/// and points a first-level folder's `..` at the FAT32 root's cluster instead of 0
/// (rafalh/rust-fatfs#117 and #99, fixed only on its unreleased master); fsck.fat calls both
/// corruption. Put `.` and `..` in the first two slots, mark the two spare slots deleted, and
/// give `..` cluster 0 when the parent is the root.
fn fix_dot_entries(f: &File, kind: FatKind) -> Result<()> {
    let g = Geometry::read(f, kind)?;
    ensure!(g.bytes_per_sector == 512, "unexpected sector size");
    let root = if kind == FatKind::Fat32 {
        Some(g.root_cluster)
    } else {
        None
    };
    // (folder's first cluster or None for a fixed root, `..` cluster its children must carry)
    let mut stack: Vec<(Option<u32>, u32)> = vec![(root, 0)];
    let mut seen = 0usize;
    while let Some((dir, _)) = stack.pop() {
        let own = dir.filter(|&c| Some(c) != root).unwrap_or(0);
        for (off, len) in g.dir_extents(f, dir)? {
            let mut buf = vec![0u8; len as usize];
            f.read_exact_at(&mut buf, off)?;
            for e in buf.chunks_exact(32) {
                if e[0] == 0 {
                    break;
                }
                let name = &e[..11];
                if e[0] == 0xE5 || e[11] == ATTR_LFN || e[11] & ATTR_DIR == 0 {
                    continue;
                }
                if name == DOT || name == DOTDOT {
                    continue;
                }
                let child = u32::from(u16::from_le_bytes([e[20], e[21]])) << 16
                    | u32::from(u16::from_le_bytes([e[26], e[27]]));
                seen += 1;
                ensure!(seen < 1 << 20, "too many folders (a loop?)");
                repair_child(f, &g, child, own)?;
                stack.push((Some(child), own));
            }
        }
    }
    Ok(())
}

fn repair_child(f: &File, g: &Geometry, child: u32, parent: u32) -> Result<()> {
    let at = g.cluster_offset(child);
    let mut slots = [0u8; 128];
    f.read_exact_at(&mut slots, at)?;
    let (s0, s1, s2, s3) = (
        &slots[0..32],
        &slots[32..64],
        &slots[64..96],
        &slots[96..128],
    );
    if s0[11] == ATTR_LFN && s1[..11] == DOT && s2[11] == ATTR_LFN && s3[..11] == DOTDOT {
        let (dot, dotdot) = (s1.to_vec(), s3.to_vec());
        slots[0..32].copy_from_slice(&dot);
        slots[32..64].copy_from_slice(&dotdot);
        for spare in [64usize, 96] {
            slots[spare..spare + 32].fill(0);
            slots[spare] = 0xE5;
        }
    }
    ensure!(
        slots[..11] == DOT && slots[32..43] == DOTDOT,
        "folder at cluster {child} does not start with `.` and `..`"
    );
    let [lo0, lo1, hi0, hi1] = parent.to_le_bytes();
    slots[32 + 26] = lo0;
    slots[32 + 27] = lo1;
    slots[32 + 20] = hi0;
    slots[32 + 21] = hi1;
    f.write_all_at(&slots, at)?;
    Ok(())
}

enum Item<'a> {
    Dir(String),
    File(String, &'a [u8]),
}

/// Sorted insertion order: every folder before what it holds, siblings by name.
fn plan(files: &[(String, Vec<u8>)]) -> Result<Vec<Item<'_>>> {
    let mut entries: BTreeMap<String, Option<&[u8]>> = BTreeMap::new();
    for (path, data) in files {
        let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        ensure!(!parts.is_empty(), "empty path in the FAT file list");
        for p in &parts {
            ensure!(
                *p != "." && *p != ".." && !p.contains('\\'),
                "path `{path}` has a `.`, `..` or `\\` component"
            );
        }
        for i in 1..parts.len() {
            let dir = parts[..i].join("/");
            if let Some(Some(_)) = entries.get(&dir) {
                bail!("`{dir}` is both a file and a folder in the FAT file list");
            }
            entries.insert(dir, None);
        }
        let full = parts.join("/");
        if entries.insert(full.clone(), Some(data)).is_some() {
            bail!("`{full}` appears twice (or as a folder too) in the FAT file list");
        }
    }
    // FAT compares names case-insensitively: two that fold together would overwrite each other.
    let mut folded = std::collections::BTreeSet::new();
    for k in entries.keys() {
        ensure!(
            folded.insert(k.to_uppercase()),
            "`{k}` differs from another path only by case, which FAT cannot keep apart"
        );
    }
    // BTreeMap order sorts "a/b" after "a-b" but still after "a", which is all creation needs.
    Ok(entries
        .into_iter()
        .map(|(k, v)| match v {
            None => Item::Dir(k),
            Some(d) => Item::File(k, d),
        })
        .collect())
}

fn volume_label(label: &str) -> Result<[u8; 11]> {
    ensure!(
        label.len() <= 11
            && label
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b"_- ".contains(&b)),
        "FAT label `{label}`: at most 11 of A–Z, 0–9, `_`, `-`, space"
    );
    let mut l = [b' '; 11];
    l[..label.len()].copy_from_slice(label.as_bytes());
    Ok(l)
}

/// Every time stamp of a build: one instant, in UTC.
#[derive(Debug)]
struct EpochClock(fatfs::DateTime);

impl fatfs::TimeProvider for EpochClock {
    fn get_current_date(&self) -> fatfs::Date {
        self.0.date
    }
    fn get_current_date_time(&self) -> fatfs::DateTime {
        self.0
    }
}

/// fatfs 0.3 wants a `&'static` provider: keep one per distinct epoch for the process.
fn clock_for(epoch: i64) -> Result<&'static EpochClock> {
    static CLOCKS: Mutex<Vec<(i64, &'static EpochClock)>> = Mutex::new(Vec::new());
    let dt = dos_date_time(epoch)?;
    let mut clocks = CLOCKS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = clocks.iter().find(|(e, _)| *e == epoch) {
        return Ok(c);
    }
    let c: &'static EpochClock = Box::leak(Box::new(EpochClock(dt)));
    clocks.push((epoch, c));
    Ok(c)
}

/// Seconds since 1970 (UTC) as a FAT date and time (Howard Hinnant's civil_from_days).
fn dos_date_time(epoch: i64) -> Result<fatfs::DateTime> {
    let secs = epoch.rem_euclid(86400);
    let (year, month, day) = crate::civil::civil_from_days(epoch.div_euclid(86400));
    ensure!(
        (1980..=2107).contains(&year),
        "time {epoch} (year {year}) is outside FAT's 1980–2107"
    );
    Ok(fatfs::DateTime {
        date: fatfs::Date {
            year: year as u16,
            month: month as u16,
            day: day as u16,
        },
        time: fatfs::Time {
            hour: (secs / 3600) as u16,
            min: (secs / 60 % 60) as u16,
            sec: (secs % 60) as u16,
            millis: 0,
        },
    })
}

/// A window of a file or device (one partition), which refuses every write: the readers below
/// must never change a card, and fatfs's API wants `Write` even to read.
struct ReadOnlySlice {
    f: File,
    start: u64,
    len: u64,
    pos: u64,
}

impl Read for ReadOnlySlice {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.len.saturating_sub(self.pos);
        let n = (buf.len() as u64).min(left) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.f.seek(SeekFrom::Start(self.start + self.pos))?;
        let k = self.f.read(&mut buf[..n])?;
        self.pos += k as u64;
        Ok(k)
    }
}

impl Write for ReadOnlySlice {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "kiln opened this FAT read-only",
        ))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Seek for ReadOnlySlice {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let new = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match new {
            Some(p) if p <= self.len => {
                self.pos = p;
                Ok(p)
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek outside the partition",
            )),
        }
    }
}

fn open(img: &Path, part_offset: u64, part_size: u64) -> Result<fatfs::FileSystem<ReadOnlySlice>> {
    let f = File::open(img).with_context(|| format!("opening {} read-only", img.display()))?;
    let slice = ReadOnlySlice {
        f,
        start: part_offset,
        len: part_size,
        pos: 0,
    };
    fatfs::FileSystem::new(slice, fatfs::FsOptions::new()).with_context(|| {
        format!(
            "reading a FAT at byte {part_offset} ({part_size} bytes) of {}",
            img.display()
        )
    })
}

/// The contents of `path` (`'/'`-separated, case-insensitive as FAT is) in the FAT at
/// `part_offset` of an image or device, read-only.
pub fn read_file(img: &Path, part_offset: u64, part_size: u64, path: &str) -> Result<Vec<u8>> {
    let fs = open(img, part_offset, part_size)?;
    let mut data = Vec::new();
    fs.root_dir()
        .open_file(path.trim_start_matches('/'))
        .and_then(|mut f| f.read_to_end(&mut data))
        .with_context(|| format!("reading {path} from the FAT in {}", img.display()))?;
    Ok(data)
}

/// One file or folder of a FAT volume.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FatEntry {
    /// `'/'`-separated from the root, long names as stored.
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
}

/// Every file and folder of the FAT at `part_offset` of an image or device, sorted by path,
/// read-only.
pub fn list(img: &Path, part_offset: u64, part_size: u64) -> Result<Vec<FatEntry>> {
    let fs = open(img, part_offset, part_size)?;
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), fs.root_dir())];
    while let Some((prefix, dir)) = stack.pop() {
        for e in dir.iter() {
            let e = e.with_context(|| format!("listing /{prefix} in {}", img.display()))?;
            let name = e.file_name();
            if name == "." || name == ".." {
                continue;
            }
            let path = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            if e.is_dir() {
                stack.push((path.clone(), e.to_dir()));
            }
            out.push(FatEntry {
                path,
                is_dir: e.is_dir(),
                size: if e.is_dir() { 0 } else { e.len() },
            });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
