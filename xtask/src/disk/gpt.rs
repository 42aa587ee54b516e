//! The GPT (through `gptman`, every GUID given explicitly) and the assembly of a whole disk image:
//! protective MBR, primary and backup GPT, partition images and raw blobs (RK3588's idbloader and
//! u-boot.itb), checked for overlaps and written sparse and atomically.

use super::{copy_sparse, AtomicOut, Guid, SECTOR};
use anyhow::{bail, ensure, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};

/// GPT attribute bit 2, "legacy BIOS bootable": U-Boot's distro boot scans only these partitions.
pub const ATTR_LEGACY_BIOS_BOOTABLE: u64 = 1 << 2;

/// Entries in the partition array (the usual 128 × 128 bytes: 32 sectors).
const ENTRIES: u64 = 128;
/// Sectors the primary GPT takes: protective MBR, header, entry array (LBA 0–33).
pub const PRIMARY_SECTORS: u64 = 2 + ENTRIES * 128 / SECTOR;
/// Sectors the backup GPT takes at the end of the disk: entry array + header.
pub const BACKUP_SECTORS: u64 = 1 + ENTRIES * 128 / SECTOR;

/// Well-known partition type GUIDs.
pub mod types {
    use super::Guid;

    fn g(s: &str) -> Guid {
        s.parse().expect("constant GUID text is valid")
    }
    /// EFI System Partition.
    pub fn efi_system() -> Guid {
        g("c12a7328-f81f-11d2-ba4b-00a0c93ec93b")
    }
    /// Microsoft basic data (what FAT data partitions usually carry).
    pub fn basic_data() -> Guid {
        g("ebd0a0a2-b9e5-4433-87c0-68b6b72699c7")
    }
    /// Linux filesystem data.
    pub fn linux_fs() -> Guid {
        g("0fc63daf-8483-4772-8e79-3d69d8477de4")
    }
}

/// One partition to create. `size_bytes` is a multiple of [`SECTOR`]; the partition image placed in
/// it may be shorter (the rest reads as zeros).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PartitionSpec {
    pub name: String,
    pub type_guid: Guid,
    pub unique_guid: Guid,
    pub first_lba: u64,
    pub size_bytes: u64,
    /// GPT attribute bits; [`ATTR_LEGACY_BIOS_BOOTABLE`] for the boot partition.
    pub attributes: u64,
}

impl PartitionSpec {
    pub fn last_lba(&self) -> u64 {
        self.first_lba + self.size_bytes / SECTOR - 1
    }
}

/// One partition as read back from a disk or image.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PartitionEntryInfo {
    /// 1-based, as in `/dev/sda1`.
    pub number: u32,
    pub name: String,
    pub type_guid: Guid,
    pub unique_guid: Guid,
    pub first_lba: u64,
    pub last_lba: u64,
    pub attributes: u64,
    pub sector_size: u64,
}

impl PartitionEntryInfo {
    pub fn start_bytes(&self) -> u64 {
        self.first_lba * self.sector_size
    }
    pub fn size_bytes(&self) -> u64 {
        (self.last_lba + 1 - self.first_lba) * self.sector_size
    }
}

/// A whole partition table as read back.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TableInfo {
    pub disk_guid: Guid,
    pub sector_size: u64,
    pub first_usable_lba: u64,
    pub last_usable_lba: u64,
    pub partitions: Vec<PartitionEntryInfo>,
}

/// Read the GPT of an image file or a block device (opened read-only; 512- or 4096-byte sectors).
pub fn read(path: &Path) -> Result<Vec<PartitionEntryInfo>> {
    Ok(read_table(path)?.partitions)
}

/// Like [`read`], with the disk GUID and usable range.
pub fn read_table(path: &Path) -> Result<TableInfo> {
    let mut f =
        File::open(path).with_context(|| format!("opening {} read-only", path.display()))?;
    let gpt = gptman::GPT::find_from(&mut f)
        .with_context(|| format!("reading the GPT of {}", path.display()))?;
    let partitions = gpt
        .iter()
        .filter(|(_, e)| e.is_used())
        .map(|(i, e)| PartitionEntryInfo {
            number: i,
            name: e.partition_name.as_str().to_string(),
            type_guid: Guid(e.partition_type_guid),
            unique_guid: Guid(e.unique_partition_guid),
            first_lba: e.starting_lba,
            last_lba: e.ending_lba,
            attributes: e.attribute_bits,
            sector_size: gpt.sector_size,
        })
        .collect();
    Ok(TableInfo {
        disk_guid: Guid(gpt.header.disk_guid),
        sector_size: gpt.sector_size,
        first_usable_lba: gpt.header.first_usable_lba,
        last_usable_lba: gpt.header.last_usable_lba,
        partitions,
    })
}

/// A byte range of the output that something claims, for the overlap check.
struct Claim {
    what: String,
    start: u64,
    end: u64,
}

/// Write a disk image of `total_size` bytes to `out`: protective MBR, GPT with `disk_guid` (primary
/// and backup), each partition of `parts` with its image copied in, and each `raw` blob at its byte
/// offset. Refuses any two things that overlap (blobs, GPT structures, partitions), a partition
/// image larger than its partition, and a partition outside the usable range. Sparse (all-zero
/// 4 KiB blocks are never written) and atomic.
pub fn assemble(
    out: &Path,
    total_size: u64,
    disk_guid: Guid,
    parts: &[(PartitionSpec, PathBuf)],
    raw: &[(u64, PathBuf)],
) -> Result<()> {
    ensure!(
        total_size % SECTOR == 0,
        "disk size {total_size} is not a multiple of {SECTOR} bytes"
    );
    let sectors = total_size / SECTOR;
    ensure!(
        sectors > PRIMARY_SECTORS + BACKUP_SECTORS,
        "disk size {total_size} cannot even hold the GPT"
    );
    ensure!(
        parts.len() as u64 <= ENTRIES,
        "{} partitions: a GPT holds {ENTRIES}",
        parts.len()
    );
    let first_usable = PRIMARY_SECTORS;
    let last_usable = sectors - BACKUP_SECTORS - 1;

    let mut claims = vec![
        Claim {
            what: "the protective MBR and primary GPT".into(),
            start: 0,
            end: PRIMARY_SECTORS * SECTOR,
        },
        Claim {
            what: "the backup GPT".into(),
            start: (last_usable + 1) * SECTOR,
            end: total_size,
        },
    ];
    for (p, img) in parts {
        ensure!(
            p.size_bytes > 0 && p.size_bytes % SECTOR == 0,
            "partition `{}`: size {} is not a positive multiple of {SECTOR} bytes",
            p.name,
            p.size_bytes
        );
        ensure!(
            p.name.encode_utf16().count() <= 36,
            "partition name `{}` is longer than GPT's 36 UTF-16 units",
            p.name
        );
        let len = std::fs::metadata(img)
            .with_context(|| format!("partition `{}`: image {}", p.name, img.display()))?
            .len();
        ensure!(
            len <= p.size_bytes,
            "partition `{}`: image {} is {len} bytes, larger than the partition ({} bytes)",
            p.name,
            img.display(),
            p.size_bytes
        );
        let end_lba = p.first_lba + p.size_bytes / SECTOR - 1;
        if p.first_lba < first_usable || end_lba > last_usable {
            bail!(
                "partition `{}` (LBA {}–{end_lba}) is outside the usable LBAs {first_usable}–{last_usable} \
                 of a {total_size}-byte disk",
                p.name,
                p.first_lba
            );
        }
        claims.push(Claim {
            what: format!("partition `{}`", p.name),
            start: p.first_lba * SECTOR,
            end: (end_lba + 1) * SECTOR,
        });
    }
    for (off, blob) in raw {
        let len = std::fs::metadata(blob)
            .with_context(|| format!("raw blob {}", blob.display()))?
            .len();
        ensure!(
            off + len <= total_size,
            "raw blob {} at byte {off} ({len} bytes) ends past the disk ({total_size} bytes)",
            blob.display()
        );
        claims.push(Claim {
            what: format!(
                "raw blob {} (LBA {}, {len} bytes)",
                blob.display(),
                off / SECTOR
            ),
            start: *off,
            end: off + len,
        });
    }
    check_overlaps(&mut claims)?;

    let mut table = Vec::with_capacity(parts.len());
    for (p, _) in parts {
        table.push(gptman::GPTPartitionEntry {
            partition_type_guid: p.type_guid.0,
            unique_partition_guid: p.unique_guid.0,
            starting_lba: p.first_lba,
            ending_lba: p.last_lba(),
            attribute_bits: p.attributes,
            partition_name: p.name.as_str().into(),
        });
    }

    let tmp = AtomicOut::new(out)?;
    let mut f = tmp.create()?;
    f.set_len(total_size)
        .with_context(|| format!("sizing {} to {total_size} bytes", tmp.path().display()))?;
    let mut gpt = gptman::GPT::new_from(&mut f, SECTOR, disk_guid.0)
        .with_context(|| format!("creating a GPT on {}", tmp.path().display()))?;
    ensure!(
        gpt.header.first_usable_lba == first_usable && gpt.header.last_usable_lba == last_usable,
        "gptman laid out usable LBAs {}–{}, expected {first_usable}–{last_usable}",
        gpt.header.first_usable_lba,
        gpt.header.last_usable_lba
    );
    for (i, e) in table.into_iter().enumerate() {
        gpt[i as u32 + 1] = e;
    }
    gpt.write_into(&mut f)
        .with_context(|| format!("writing the GPT of {}", tmp.path().display()))?;
    gptman::GPT::write_protective_mbr_into(&mut f, SECTOR)
        .with_context(|| format!("writing the protective MBR of {}", tmp.path().display()))?;

    for (p, img) in parts {
        copy_sparse(&f, p.first_lba * SECTOR, img)
            .with_context(|| format!("partition `{}`", p.name))?;
    }
    for (off, blob) in raw {
        copy_sparse(&f, *off, blob)?;
    }
    // A source that grew since it was measured must not spill past its claim.
    ensure!(
        f.metadata()?.len() == total_size,
        "{} grew past {total_size} bytes while being written",
        tmp.path().display()
    );
    drop(f);
    tmp.commit()
}

fn check_overlaps(claims: &mut [Claim]) -> Result<()> {
    claims.sort_by_key(|c| (c.start, c.end));
    // Compared with the furthest end so far, so a short claim nested after a long one is caught.
    let mut furthest: Option<&Claim> = None;
    for c in claims.iter().filter(|c| c.end > c.start) {
        if let Some(f) = furthest {
            if c.start < f.end {
                bail!(
                    "{} (bytes {}–{}) overlaps {} (bytes {}–{})",
                    c.what,
                    c.start,
                    c.end,
                    f.what,
                    f.start,
                    f.end
                );
            }
        }
        if furthest.is_none_or(|f| c.end > f.end) {
            furthest = Some(c);
        }
    }
    Ok(())
}
