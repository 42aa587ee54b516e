//! The partition table of every kiln image: p1 `bootctl` at 16 MiB (legacy-BIOS-bootable, the one
//! partition U-Boot's distro boot scans: `boot.scr` and the A/B counters), p2 `boot_a` and p3
//! `boot_b` (the two boot slots, FAT), p4 `models_a` and p5 `models_b` (the two models slots,
//! docs/models-slots.md), then p6 `data`, each aligned to 1 MiB; every
//! GUID from the seed (board + commit). Below 16 MiB only the GPT and the board's bootloader
//! blobs.

use super::board::FIRST_PARTITION_LBA;
use crate::disk::{self, gpt::PartitionSpec, Guid};
use anyhow::{bail, Result};
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;

pub struct Layout {
    pub total_size: u64,
    pub disk_guid: Guid,
    pub parts: Vec<PartitionSpec>,
}

/// The partitions of every image, in order (p1 … p6).
pub const NAMES: [&str; 6] = [
    "bootctl", "boot_a", "boot_b", "models_a", "models_b", "data",
];

/// Lay out `(name, bytes)` partitions in order; the first is the one U-Boot scans (`bootctl`),
/// FAT boot slots (`boot_*`) are basic data, the rest Linux file systems.
pub fn plan(seed: &str, sizes: &[(&str, u64)]) -> Result<Layout> {
    let mut lba = FIRST_PARTITION_LBA;
    let mut parts = Vec::new();
    for (i, (name, size)) in sizes.iter().enumerate() {
        if *size == 0 {
            bail!("partition {name} has size 0");
        }
        let size = size.div_ceil(MIB) * MIB;
        parts.push(PartitionSpec {
            name: name.to_string(),
            type_guid: if i == 0 {
                disk::gpt::types::efi_system()
            } else if name.starts_with("boot_") {
                disk::gpt::types::basic_data()
            } else {
                disk::gpt::types::linux_fs()
            },
            unique_guid: disk::guid_from_seed(seed, &format!("part-{name}")),
            first_lba: lba,
            size_bytes: size,
            attributes: if i == 0 {
                disk::gpt::ATTR_LEGACY_BIOS_BOOTABLE
            } else {
                0
            },
        });
        lba += size / 512;
    }
    // 1 MiB after the last partition holds the backup GPT (33 sectors) with room to spare.
    Ok(Layout {
        total_size: lba * 512 + MIB,
        disk_guid: disk::guid_from_seed(seed, "disk"),
        parts,
    })
}

impl Layout {
    pub fn describe(&self) -> Value {
        json!({
            "label": "gpt",
            "sector_size": 512,
            "size": self.total_size,
            "disk_guid": self.disk_guid.to_string(),
            "partitions": self.parts.iter().enumerate().map(|(i, p)| json!({
                "number": i + 1,
                "name": p.name,
                "type_guid": p.type_guid.to_string(),
                "unique_guid": p.unique_guid.to_string(),
                "first_lba": p.first_lba,
                "size_bytes": p.size_bytes,
                "attributes": p.attributes,
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom};
    use std::path::PathBuf;

    #[test]
    fn first_partition_at_16_mib_bootable_and_aligned() {
        let l = plan(
            "qemu-virt:abc",
            &[("boot", 64 * MIB), ("models", 12345), ("data", 32 * MIB)],
        )
        .unwrap();
        assert_eq!(l.parts[0].first_lba, 32768);
        assert_eq!(l.parts[0].attributes, 1 << 2);
        assert_eq!(l.parts[1].first_lba, 32768 + 64 * 2048);
        assert_eq!(l.parts[1].size_bytes, MIB);
        assert_eq!(l.parts[2].first_lba, l.parts[1].first_lba + 2048);
        assert_eq!(l.total_size, (l.parts[2].first_lba + 32 * 2048) * 512 + MIB);
        let again = plan(
            "qemu-virt:abc",
            &[("boot", 64 * MIB), ("models", 12345), ("data", 32 * MIB)],
        )
        .unwrap();
        assert_eq!(again.describe(), l.describe());
        let other = plan(
            "qemu-virt:abd",
            &[("boot", 64 * MIB), ("models", 12345), ("data", 32 * MIB)],
        )
        .unwrap();
        assert_ne!(other.disk_guid, l.disk_guid);
    }

    /// rock-5b: test blobs land at LBA 64 and 16384 byte for byte, the GPT stays intact, and a
    /// blob that would run into the next one is refused.
    #[test]
    fn rock5b_blobs_at_exact_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, bytes: Vec<u8>| -> PathBuf {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            p
        };
        let idb: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8 | 1).collect();
        let itb: Vec<u8> = (0..700_000u32).map(|i| (i % 241) as u8 | 1).collect();
        let idb_p = w("idbloader.img", idb.clone());
        let itb_p = w("u-boot.itb", itb.clone());
        let boot = w("boot", vec![0xb0; 4096]);
        let models = w("models", vec![0x30; 4096]);
        let data = w("data", vec![0xda; 4096]);
        let l = plan(
            "rock-5b:test",
            &[("boot", 4 * MIB), ("models", MIB), ("data", MIB)],
        )
        .unwrap();
        let img = dir.path().join("rock.img");
        let parts: Vec<_> = l.parts.iter().cloned().zip([boot, models, data]).collect();
        disk::assemble(
            &img,
            l.total_size,
            l.disk_guid,
            &parts,
            &[(64 * 512, idb_p.clone()), (16384 * 512, itb_p.clone())],
        )
        .unwrap();
        let mut f = std::fs::File::open(&img).unwrap();
        let mut read = |off: u64, n: usize| {
            let mut b = vec![0u8; n];
            f.seek(SeekFrom::Start(off)).unwrap();
            f.read_exact(&mut b).unwrap();
            b
        };
        assert_eq!(read(64 * 512, idb.len()), idb);
        assert_eq!(read(16384 * 512, itb.len()), itb);
        assert_eq!(&read(512, 8), b"EFI PART");
        assert_eq!(read(32768 * 512, 4096), vec![0xb0; 4096]);
        // An idbloader long enough to reach u-boot.itb's LBA is refused.
        let big = w("big.img", vec![1u8; (16384 - 64) * 512 + 512]);
        let err = disk::assemble(
            &dir.path().join("bad.img"),
            l.total_size,
            l.disk_guid,
            &parts,
            &[(64 * 512, big), (16384 * 512, itb_p)],
        );
        assert!(err.is_err());
    }
}
