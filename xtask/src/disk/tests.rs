//! The disk writers judged by independent tools (sfdisk, fsck.vfat, mtools, fsck.erofs, e2fsck,
//! GNU cpio), built twice under a different clock zone, umask, folder and second, and checked for
//! overlap refusal, sparseness and atomicity.

use super::cpio::{CpioEntry, EntryKind};
use super::gpt::{types, PartitionSpec, ATTR_LEGACY_BIOS_BOOTABLE};
use super::*;
use crate::doctor;
use anyhow::Result;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use xshell::{cmd, Shell};

const MIB: u64 = 1 << 20;
const EPOCH: i64 = 1_760_000_000; // 2025-10-09 08:53:20 UTC
const SEED: &str = "qemu-virt/0123456789abcdef";
const BOOT_SIZE: u64 = 40 * MIB; // the smallest round size FAT32 takes with 512-byte clusters
const MODELS_SIZE: u64 = 8 * MIB;
const DATA_SIZE: u64 = 8 * MIB;
const DISK_SIZE: u64 = 16 * MIB + BOOT_SIZE + MODELS_SIZE + DATA_SIZE + MIB;
/// Stand-in for RK3588's idbloader, at LBA 64 as on the board.
const BLOB_OFFSET: u64 = 64 * SECTOR;

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn sha256_file(p: &Path) -> String {
    sha256_hex(&std::fs::read(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display())))
}

fn tools() {
    doctor::ensure(&[
        &doctor::MKFS_EROFS,
        &doctor::MKE2FS,
        &doctor::SFDISK,
        &doctor::FSCK_VFAT,
        &doctor::FSCK_EROFS,
        &doctor::E2FSCK,
        &doctor::MTOOLS,
        &doctor::CPIO,
    ])
    .expect("test tools (doctor::ensure)");
}

fn boot_files() -> Vec<(String, Vec<u8>)> {
    // A kernel-sized file with a hole-sized run of zeros, so sparseness and data both matter.
    let mut image = vec![0u8; 3 * MIB as usize];
    for (i, b) in image.iter_mut().enumerate().take(MIB as usize) {
        *b = (i * 7 + i / 4096) as u8;
    }
    image[3 * MIB as usize - 1] = 0xAA;
    vec![
        // Deliberately unsorted: the writer sorts.
        (
            "kiln/manifest.json".into(),
            br#"{"board":"qemu-virt"}"#.to_vec(),
        ),
        (
            "extlinux/extlinux.conf".into(),
            b"default kiln\nprompt 0\ntimeout 1\nlabel kiln\n    kernel /Image\n    initrd /initramfs.cpio.gz\n"
                .to_vec(),
        ),
        ("Image".into(), image),
        // Two levels deep, as a board's dtb is: `..` of a nested folder is not the root.
        (
            "dtbs/rockchip/rk3588-rock-5b.dtb".into(),
            vec![0xd0, 0x0d, 0xfe, 0xed, 0, 0, 0, 0x28],
        ),
        ("initramfs.cpio.gz".into(), b"not really gzip".to_vec()),
    ]
}

/// A models tree with explicit modes, its files created in an order that depends on `reversed`,
/// so neither umask nor directory order may reach the image.
fn stage_models(dir: &Path, reversed: bool) {
    let mut files: Vec<(&str, Vec<u8>, u32)> = vec![
        ("fixture.gguf", b"GGUF\x03\0\0\0fixture".to_vec(), 0o644),
        ("models/a.gguf", vec![0x5a; 70_000], 0o644),
        ("models/b.gguf", vec![0x00; 10_000], 0o600),
        ("tools/run", b"#!/bin/sh\necho hi\n".to_vec(), 0o755),
    ];
    if reversed {
        files.reverse();
    }
    for (p, data, mode) in &files {
        let path = dir.join(p);
        let parent = path.parent().expect("staged file has a parent");
        std::fs::create_dir_all(parent).expect("staging folder");
        std::fs::write(&path, data).expect("staging file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode)).expect("chmod");
    }
    for d in [dir.to_path_buf(), dir.join("models"), dir.join("tools")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    }
}

fn cpio_entries() -> Vec<CpioEntry> {
    vec![
        CpioEntry::file(
            "init",
            0o755,
            b"#!/bin/sh\nexec /bin/kiln selftest\n".to_vec(),
        ),
        CpioEntry::dir("etc", 0o755),
        CpioEntry::file(
            "etc/kiln/board.toml",
            0o644,
            b"board = \"qemu-virt\"\n".to_vec(),
        ),
        CpioEntry::file("bin/busybox", 0o755, vec![0x7f; 5000]),
        CpioEntry::symlink("bin/sh", "busybox"),
        CpioEntry::dir("root", 0o700),
        CpioEntry::file("etc/secret", 0o600, b"s".to_vec()),
        CpioEntry::file("empty", 0o644, Vec::new()),
    ]
}

/// Every artefact the writers make, in `dir`; returns name → sha256.
fn build_all(dir: &Path, reversed: bool) -> Result<BTreeMap<String, String>> {
    let boot = dir.join("boot.vfat");
    fat::build(
        &boot,
        BOOT_SIZE,
        u32_from_seed(SEED, "boot-fs"),
        "KILN-BOOT",
        &boot_files(),
        EPOCH,
    )?;
    let staged = dir.join("models-src");
    stage_models(&staged, reversed);
    let models = dir.join("models.erofs");
    erofs::build(
        &models,
        &staged,
        guid_from_seed(SEED, "models-fs"),
        EPOCH,
        None,
    )?;
    let data = dir.join("data.ext4");
    ext4::build_empty(
        &data,
        DATA_SIZE,
        guid_from_seed(SEED, "data-fs"),
        guid_from_seed(SEED, "data-hash"),
        "data",
        EPOCH,
        None,
    )?;
    let initrd = dir.join("initramfs.cpio.gz");
    let mut entries = cpio_entries();
    if reversed {
        entries.reverse();
    }
    cpio::write_newc_gz(&initrd, &entries, EPOCH as u32)?;
    let blob = dir.join("idbloader.img");
    std::fs::write(&blob, vec![0xB1; 3000])?;
    let img = dir.join("disk.img");
    assemble(
        &img,
        DISK_SIZE,
        guid_from_seed(SEED, "disk"),
        &layout(&boot, &models, &data),
        &[(BLOB_OFFSET, blob)],
    )?;
    let mut out = BTreeMap::new();
    for p in [&boot, &models, &data, &initrd, &img] {
        let name = p.file_name().unwrap_or_default().to_string_lossy().into();
        out.insert(name, sha256_file(p));
    }
    Ok(out)
}

fn specs() -> Vec<PartitionSpec> {
    let mut lba = 16 * MIB / SECTOR;
    let mut v = Vec::new();
    for (name, size, ty, attrs) in [
        (
            "boot",
            BOOT_SIZE,
            types::efi_system(),
            ATTR_LEGACY_BIOS_BOOTABLE,
        ),
        ("models", MODELS_SIZE, types::linux_fs(), 0),
        ("data", DATA_SIZE, types::linux_fs(), 0),
    ] {
        v.push(PartitionSpec {
            name: name.into(),
            type_guid: ty,
            unique_guid: guid_from_seed(SEED, name),
            first_lba: lba,
            size_bytes: size,
            attributes: attrs,
        });
        lba += size / SECTOR;
    }
    v
}

fn layout(boot: &Path, models: &Path, data: &Path) -> Vec<(PartitionSpec, PathBuf)> {
    specs()
        .into_iter()
        .zip([boot, models, data])
        .map(|(s, p)| (s, p.to_path_buf()))
        .collect()
}

fn extract(img: &Path, start: u64, len: u64, to: &Path) {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(img).expect("open image");
    f.seek(SeekFrom::Start(start)).expect("seek");
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).expect("read partition");
    std::fs::write(to, buf).expect("write partition copy");
}

#[test]
fn guid_text_form_and_seeded_bits() {
    let esp: Guid = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B".parse().unwrap();
    // On disk the first three fields are little-endian.
    assert_eq!(
        esp.0,
        [
            0x28, 0x73, 0x2a, 0xc1, 0x1f, 0xf8, 0xd2, 0x11, 0xba, 0x4b, 0x00, 0xa0, 0xc9, 0x3e,
            0xc9, 0x3b
        ]
    );
    assert_eq!(esp.to_string(), "c12a7328-f81f-11d2-ba4b-00a0c93ec93b");
    assert!("c12a7328-f81f-11d2-ba4b-00a0c93ec93"
        .parse::<Guid>()
        .is_err());
    assert!("c12a7328-f81f-11d2-ba4b-00a0c93ec93g"
        .parse::<Guid>()
        .is_err());

    let a = guid_from_seed(SEED, "boot");
    assert_eq!(a, guid_from_seed(SEED, "boot"));
    assert_ne!(a, guid_from_seed(SEED, "models"));
    assert_ne!(a, guid_from_seed("rock-5b/0123456789abcdef", "boot"));
    let rfc = a.to_rfc_bytes();
    assert_eq!(rfc[6] >> 4, 4, "version 4");
    assert_eq!(rfc[8] >> 6, 0b10, "RFC 4122 variant");
    let text = a.to_string();
    assert_eq!(&text[14..15], "4");
    assert_eq!(text.parse::<Guid>().unwrap(), a);
    let json = serde_json::to_string(&a).unwrap();
    assert_eq!(json, format!("\"{text}\""));
    assert_eq!(serde_json::from_str::<Guid>(&json).unwrap(), a);
    assert!(serde_json::from_str::<Guid>("\"nope\"").is_err());
}

/// The 3-partition disk (plus an RK3588-style blob at LBA 64), judged by sfdisk, fsck.vfat,
/// mtools, fsck.erofs and e2fsck, and by our own readers.
#[test]
fn three_partition_disk_passes_independent_tools() {
    tools();
    let t = tempfile::tempdir().unwrap();
    build_all(t.path(), false).unwrap();
    let img = t.path().join("disk.img");
    let sh = Shell::new().unwrap();

    // sfdisk's view of the table.
    let json = cmd!(sh, "sfdisk --json {img}").read().unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let pt = &v["partitiontable"];
    assert_eq!(pt["label"], "gpt");
    assert_eq!(
        pt["id"].as_str().unwrap().to_lowercase(),
        guid_from_seed(SEED, "disk").to_string()
    );
    assert_eq!(pt["firstlba"], 34);
    assert_eq!(pt["lastlba"], DISK_SIZE / SECTOR - 34);
    let parts = pt["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 3);
    for (p, s) in parts.iter().zip(specs()) {
        assert_eq!(p["name"], s.name.as_str());
        assert_eq!(p["start"], s.first_lba);
        assert_eq!(p["size"], s.size_bytes / SECTOR);
        assert_eq!(
            p["uuid"].as_str().unwrap().to_lowercase(),
            s.unique_guid.to_string()
        );
        assert_eq!(
            p["type"].as_str().unwrap().to_lowercase(),
            s.type_guid.to_string()
        );
        let attrs = p["attrs"].as_str().unwrap_or("");
        assert_eq!(
            attrs.contains("LegacyBIOSBootable"),
            s.name == "boot",
            "attrs of {}: {attrs:?}",
            s.name
        );
    }
    // sfdisk --verify checks the backup GPT and the protective MBR too.
    let verify = cmd!(sh, "sfdisk --verify {img}").read().unwrap();
    assert!(verify.contains("No errors detected"), "{verify}");
    let mbr = std::fs::read(&img).unwrap();
    assert_eq!(mbr[450], 0xEE, "protective MBR partition type");
    assert_eq!(&mbr[510..512], &[0x55, 0xAA]);

    // Our reader agrees.
    let table = gpt::read_table(&img).unwrap();
    assert_eq!(table.disk_guid, guid_from_seed(SEED, "disk"));
    let ours = gpt::read(&img).unwrap();
    assert_eq!(ours.len(), 3);
    for (p, s) in ours.iter().zip(specs()) {
        assert_eq!(
            (
                &p.name,
                p.type_guid,
                p.unique_guid,
                p.first_lba,
                p.size_bytes(),
                p.attributes
            ),
            (
                &s.name,
                s.type_guid,
                s.unique_guid,
                s.first_lba,
                s.size_bytes,
                s.attributes
            )
        );
    }

    // The raw blob sits at LBA 64, outside the table.
    assert!(mbr[BLOB_OFFSET as usize..BLOB_OFFSET as usize + 3000]
        .iter()
        .all(|&b| b == 0xB1));
    assert_eq!(mbr[BLOB_OFFSET as usize + 3000], 0);

    // Each filesystem, extracted from the image, passes its checker.
    let boot = &ours[0];
    let models = &ours[1];
    let data = &ours[2];
    let p1 = t.path().join("p1.vfat");
    let p2 = t.path().join("p2.erofs");
    let p3 = t.path().join("p3.ext4");
    extract(&img, boot.start_bytes(), boot.size_bytes(), &p1);
    extract(&img, models.start_bytes(), models.size_bytes(), &p2);
    extract(&img, data.start_bytes(), data.size_bytes(), &p3);
    // fsck.vfat exits non-zero on anything it would change.
    cmd!(sh, "fsck.vfat -n {p1}").run().unwrap();
    let p1_bytes = std::fs::read(&p1).unwrap();
    assert_eq!(&p1_bytes[0x52..0x5A], b"FAT32   ");
    cmd!(sh, "fsck.erofs {p2}").run().unwrap();
    cmd!(sh, "e2fsck -fn {p3}").run().unwrap();
    let dumpe2fs = cmd!(sh, "dumpe2fs -h {p3}").quiet().read().unwrap();
    assert!(dumpe2fs.contains(&format!(
        "Filesystem UUID:          {}",
        guid_from_seed(SEED, "data-fs")
    )));
    assert!(dumpe2fs.contains(&format!(
        "Directory Hash Seed:      {}",
        guid_from_seed(SEED, "data-hash")
    )));
    assert!(!dumpe2fs.contains("orphan_file"), "{dumpe2fs}");

    // mtools lists and reads the boot partition in place, at its offset in the image.
    let at = format!("{}@@{}", img.display(), boot.start_bytes());
    let listing = cmd!(sh, "mdir -i {at} -/ -b ::/")
        .env("MTOOLS_SKIP_CHECK", "1")
        .read()
        .unwrap();
    let mut got: Vec<&str> = listing.lines().map(|l| l.trim_end_matches('/')).collect();
    got.sort();
    assert_eq!(
        got,
        [
            "::/Image",
            "::/dtbs",
            "::/dtbs/rockchip",
            "::/dtbs/rockchip/rk3588-rock-5b.dtb",
            "::/extlinux",
            "::/extlinux/extlinux.conf",
            "::/initramfs.cpio.gz",
            "::/kiln",
            "::/kiln/manifest.json"
        ]
    );
    for (path, data) in boot_files() {
        let out = t.path().join("mcopy.out");
        let src = format!("::/{path}");
        cmd!(sh, "mcopy -n -i {at} {src} {out}")
            .env("MTOOLS_SKIP_CHECK", "1")
            .run()
            .unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), data, "{path} via mcopy");
        // Our read-only reader agrees.
        assert_eq!(
            fat::read_file(&img, boot.start_bytes(), boot.size_bytes(), &path).unwrap(),
            data,
            "{path} via fat::read_file"
        );
    }
    let list = fat::list(&img, boot.start_bytes(), boot.size_bytes()).unwrap();
    let names: Vec<(&str, bool)> = list.iter().map(|e| (e.path.as_str(), e.is_dir)).collect();
    assert_eq!(
        names,
        [
            ("Image", false),
            ("dtbs", true),
            ("dtbs/rockchip", true),
            ("dtbs/rockchip/rk3588-rock-5b.dtb", false),
            ("extlinux", true),
            ("extlinux/extlinux.conf", false),
            ("initramfs.cpio.gz", false),
            ("kiln", true),
            ("kiln/manifest.json", false)
        ]
    );
    assert_eq!(list[0].size, 3 * MIB);
    // mtools shows the fixed date; the volume id and label are ours.
    let minfo = cmd!(sh, "minfo -i {at} ::")
        .env("MTOOLS_SKIP_CHECK", "1")
        .read()
        .unwrap();
    let id = u32_from_seed(SEED, "boot-fs");
    assert!(
        minfo.contains(&format!("serial number: {id:08X}")),
        "{minfo}"
    );
    assert!(minfo.contains("label=\"KILN-BOOT  \""), "{minfo}");
    let long = cmd!(sh, "mdir -i {at} ::/kiln")
        .env("MTOOLS_SKIP_CHECK", "1")
        .env("TZ", "UTC")
        .read()
        .unwrap();
    assert!(long.contains("2025-10-09   8:53"), "{long}");

    // Reading changed nothing.
    let before = sha256_file(&img);
    fat::list(&img, boot.start_bytes(), boot.size_bytes()).unwrap();
    gpt::read(&img).unwrap();
    assert_eq!(sha256_file(&img), before);

    // Sparse: the 73 MiB image takes only what its data needs.
    let md = std::fs::metadata(&img).unwrap();
    assert_eq!(md.len(), DISK_SIZE);
    assert!(
        md.blocks() * 512 < 16 * MIB,
        "image allocates {} bytes of {}",
        md.blocks() * 512,
        md.len()
    );
}

/// Run in a child process by `writers_are_reproducible`, under the TZ and umask it was given.
#[test]
#[ignore = "run by writers_are_reproducible in a child process"]
fn repro_child() {
    let Some(dir) = std::env::var_os("KILN_DISK_REPRO_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let reversed = std::env::var_os("KILN_DISK_REPRO_REVERSED").is_some();
    let hashes = build_all(&dir, reversed).unwrap();
    std::fs::write(
        dir.join("hashes.json"),
        serde_json::to_string_pretty(&hashes).unwrap(),
    )
    .unwrap();
}

#[test]
fn writers_are_reproducible() {
    tools();
    let exe = std::env::current_exe().unwrap();
    let mut results = Vec::new();
    let mut dirs = Vec::new();
    for (i, (tz, umask)) in [("UTC", "022"), ("America/St_Johns", "077")]
        .into_iter()
        .enumerate()
    {
        if i > 0 {
            // FAT keeps 2-second times and e2fsprogs whole seconds: cross at least one of each.
            std::thread::sleep(std::time::Duration::from_millis(2100));
        }
        let t = tempfile::Builder::new()
            .prefix(&format!("kiln-repro-{i}-"))
            .tempdir()
            .unwrap();
        let sh = Shell::new().unwrap();
        let script = format!("umask {umask} && exec \"$0\" \"$@\"");
        let dir = t.path();
        let mut c = cmd!(
            sh,
            "sh -c {script} {exe} --exact disk::tests::repro_child --ignored --test-threads 1"
        )
        .env("TZ", tz)
        .env("KILN_DISK_REPRO_DIR", dir)
        .quiet();
        if i > 0 {
            c = c.env("KILN_DISK_REPRO_REVERSED", "1");
        }
        c.run().unwrap();
        let hashes: BTreeMap<String, String> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("hashes.json")).unwrap())
                .unwrap();
        assert_eq!(hashes.len(), 5, "{hashes:?}");
        results.push(hashes);
        dirs.push(t);
    }
    let differ: Vec<&String> = results[0]
        .iter()
        .filter(|(name, h)| results[1].get(*name) != Some(*h))
        .map(|(name, _)| name)
        .collect();
    assert!(
        differ.is_empty(),
        "differ between two builds: {differ:?} (kept in {:?})",
        dirs.into_iter().map(|d| d.keep()).collect::<Vec<_>>()
    );
}

#[test]
fn overlaps_are_refused_and_nothing_is_left_behind() {
    let t = tempfile::tempdir().unwrap();
    let part = t.path().join("part.img");
    std::fs::write(&part, vec![1u8; 4096]).unwrap();
    let blob = t.path().join("blob.img");
    std::fs::write(&blob, vec![2u8; 2 * MIB as usize]).unwrap();
    let out = t.path().join("disk.img");
    let spec = |name: &str, first_lba: u64, size_bytes: u64| PartitionSpec {
        name: name.into(),
        type_guid: types::linux_fs(),
        unique_guid: guid_from_seed(SEED, name),
        first_lba,
        size_bytes,
        attributes: 0,
    };
    let p1 = spec("boot", 16 * MIB / SECTOR, 4 * MIB);
    let disk = guid_from_seed(SEED, "disk");
    let err = |parts: &[(PartitionSpec, PathBuf)], raw: &[(u64, PathBuf)]| {
        let e = assemble(&out, 32 * MIB, disk, parts, raw).unwrap_err();
        assert!(!out.exists(), "a refused assembly left {}", out.display());
        format!("{e:#}")
    };
    let one = [(p1.clone(), part.clone())];

    // A 2 MiB blob at 15 MiB runs into the partition at 16 MiB.
    let e = err(&one, &[(15 * MIB, blob.clone())]);
    assert!(
        e.contains("overlaps") && e.contains("partition `boot`") && e.contains("raw blob"),
        "{e}"
    );
    // A blob on the primary GPT.
    let e = err(&one, &[(8 * SECTOR, blob.clone())]);
    assert!(e.contains("primary GPT"), "{e}");
    // A blob on the backup GPT.
    let small = t.path().join("small.img");
    std::fs::write(&small, [3u8; 512]).unwrap();
    let e = err(&one, &[(32 * MIB - 4 * SECTOR, small.clone())]);
    assert!(e.contains("backup GPT"), "{e}");
    // A short blob inside a long one.
    let e = err(&one, &[(MIB, blob.clone()), (2 * MIB, small.clone())]);
    assert!(e.contains("overlaps"), "{e}");
    // Two partitions over each other.
    let e = err(
        &[
            (p1.clone(), part.clone()),
            (spec("models", 18 * MIB / SECTOR, 4 * MIB), part.clone()),
        ],
        &[],
    );
    assert!(e.contains("partition `models`"), "{e}");
    // A partition running into the backup GPT.
    let e = err(
        &[(spec("big", 16 * MIB / SECTOR, 16 * MIB), part.clone())],
        &[],
    );
    assert!(e.contains("outside the usable LBAs"), "{e}");
    // A partition image larger than its partition.
    let e = err(
        &[(spec("tiny", 16 * MIB / SECTOR, 2048), part.clone())],
        &[],
    );
    assert!(e.contains("larger than the partition"), "{e}");

    // The RK3588 layout itself is fine: idbloader at LBA 64, u-boot.itb at LBA 16384 (8 MiB).
    assemble(
        &out,
        32 * MIB,
        disk,
        &one,
        &[(64 * SECTOR, small.clone()), (16384 * SECTOR, blob.clone())],
    )
    .unwrap();
    let img = std::fs::read(&out).unwrap();
    assert_eq!(img[64 * 512], 3);
    assert_eq!(img[8 * MIB as usize + 5], 2);
    assert_eq!(img[16 * MIB as usize], 1);

    // Nothing but our inputs and the one output remain in the folder.
    let mut names: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["blob.img", "disk.img", "part.img", "small.img"]);
}

#[test]
fn a_failed_write_never_leaves_or_damages_the_final_file() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("disk.img");
    std::fs::write(&out, b"previous image").unwrap();
    let part = t.path().join("part.img");
    std::fs::write(&part, vec![1u8; 4096]).unwrap();
    let missing = t.path().join("missing.img");
    let mk = |name: &str, lba: u64| PartitionSpec {
        name: name.into(),
        type_guid: types::linux_fs(),
        unique_guid: guid_from_seed(SEED, name),
        first_lba: lba,
        size_bytes: MIB,
        attributes: 0,
    };
    // The second partition's image vanishes: the first was already measured.
    let e = assemble(
        &out,
        32 * MIB,
        guid_from_seed(SEED, "disk"),
        &[(mk("a", 2048), part.clone()), (mk("b", 4096), missing)],
        &[],
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("missing.img"), "{e:#}");
    assert_eq!(std::fs::read(&out).unwrap(), b"previous image");

    // A FAT build that fails half-way (a path that is a file and a folder) leaves nothing.
    let vfat = t.path().join("boot.vfat");
    let files = vec![
        ("a".to_string(), b"x".to_vec()),
        ("a/b".to_string(), b"y".to_vec()),
    ];
    assert!(fat::build(&vfat, 40 * MIB, 1, "BOOT", &files, EPOCH).is_err());
    assert!(!vfat.exists());
    // Likewise an archive with a duplicate path, and an ext4 that mke2fs refuses.
    let gz = t.path().join("i.cpio.gz");
    let dup = vec![CpioEntry::dir("a", 0o755), CpioEntry::dir("a", 0o700)];
    assert!(cpio::write_newc_gz(&gz, &dup, 0).is_err());
    assert!(!gz.exists());

    let mut names: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["disk.img", "part.img"]);

    // An interrupted process (killed between temp write and rename) leaves only a dot-temp file,
    // never the final name: the rename is the last step, after fsync.
    let a = AtomicOut::new(&t.path().join("x.img")).unwrap();
    std::fs::write(a.path(), b"partial").unwrap();
    assert!(!t.path().join("x.img").exists());
    std::mem::forget(a);
}

#[test]
fn fat_falls_back_to_fat16_when_small_and_passes_fsck() {
    tools();
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("small.vfat");
    let files = boot_files();
    let kind = fat::build(&out, 16 * MIB, 0x1234_abcd, "KILN", &files, EPOCH).unwrap();
    assert_eq!(kind, fat::FatKind::Fat16);
    let sh = Shell::new().unwrap();
    let fsck = cmd!(sh, "fsck.vfat -n {out}").read().unwrap();
    assert!(fsck.contains("FAT16") || fsck.contains("files"), "{fsck}");
    let at = format!("{}", out.display());
    let got = cmd!(sh, "mtype -i {at} ::/extlinux/extlinux.conf")
        .env("MTOOLS_SKIP_CHECK", "1")
        .read()
        .unwrap();
    assert_eq!(got.as_bytes(), &files[1].1[..files[1].1.len() - 1]);
    // Out-of-range times and bad labels are refused, not wrapped.
    assert!(fat::build(&out, 16 * MIB, 1, "KILN", &files, 0).is_err());
    assert!(fat::build(&out, 16 * MIB, 1, "lower", &files, EPOCH).is_err());
}

#[test]
fn cpio_reads_back_with_gnu_cpio() {
    tools();
    let t = tempfile::tempdir().unwrap();
    let gz = t.path().join("initramfs.cpio.gz");
    cpio::write_newc_gz(&gz, &cpio_entries(), EPOCH as u32).unwrap();

    // gzip header: no name, no mtime, our fixed level's XFL (2 = maximum compression).
    let raw = std::fs::read(&gz).unwrap();
    assert_eq!(&raw[0..3], &[0x1f, 0x8b, 8]);
    assert_eq!(raw[3], 0, "no FNAME/FEXTRA/FCOMMENT flags");
    assert_eq!(&raw[4..8], &[0, 0, 0, 0], "mtime 0");
    assert_eq!(raw[8], 2);

    let mut cpio_bytes = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&raw[..]), &mut cpio_bytes)
        .unwrap();
    let archive = t.path().join("initramfs.cpio");
    std::fs::write(&archive, &cpio_bytes).unwrap();

    let sh = Shell::new().unwrap();
    sh.set_var("TZ", "UTC");
    sh.set_var("LC_ALL", "C");
    let listing = cmd!(sh, "cpio -it --quiet -F {archive}").read().unwrap();
    let names: Vec<&str> = listing.lines().collect();
    assert_eq!(
        names,
        [
            "bin",
            "bin/busybox",
            "bin/sh",
            "empty",
            "etc",
            "etc/kiln",
            "etc/kiln/board.toml",
            "etc/secret",
            "init",
            "root"
        ]
    );
    let verbose = cmd!(sh, "cpio -itvn --quiet -F {archive}").read().unwrap();
    for line in verbose.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((cols[2], cols[3]), ("0", "0"), "uid/gid of {line}");
        assert!(line.contains("Oct  9  2025"), "mtime of {line}");
    }
    assert!(verbose.contains("lrwxrwxrwx"), "{verbose}");
    assert!(verbose.contains("bin/sh -> busybox"), "{verbose}");

    // Unpack and compare contents and modes.
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    sh.change_dir(&root);
    cmd!(sh, "cpio -idm --quiet --no-absolute-filenames -F {archive}")
        .run()
        .unwrap();
    for e in cpio_entries() {
        let p = root.join(&e.path);
        let md = std::fs::symlink_metadata(&p).unwrap();
        match &e.kind {
            EntryKind::File(d) => {
                assert_eq!(&std::fs::read(&p).unwrap(), d, "{}", e.path);
                assert_eq!(md.mode() & 0o7777, e.mode, "mode of {}", e.path);
                assert_eq!(md.mtime(), EPOCH, "mtime of {}", e.path);
            }
            EntryKind::Dir => {
                assert!(md.is_dir());
                assert_eq!(md.mode() & 0o7777, e.mode, "mode of {}", e.path);
            }
            EntryKind::Symlink(target) => {
                assert_eq!(std::fs::read_link(&p).unwrap(), Path::new(target));
            }
        }
    }
    // The implied parents are real folders.
    assert!(root.join("etc/kiln").is_dir());

    // Inode numbers are unique and count up in path order; nlink counts subfolders.
    let mut r = &cpio_bytes[..];
    let mut inos = Vec::new();
    loop {
        let reader = ::cpio::newc::Reader::new(r).unwrap();
        let e = reader.entry();
        if e.is_trailer() {
            break;
        }
        inos.push(e.ino());
        if e.name() == "etc" {
            assert_eq!(e.nlink(), 3);
        }
        assert_eq!((e.uid(), e.gid(), e.mtime()), (0, 0, EPOCH as u32));
        r = reader.finish().unwrap();
    }
    assert_eq!(inos, (1..=10).collect::<Vec<u32>>());

    // Bad input is refused.
    let bad = [CpioEntry::file("../x", 0o644, vec![])];
    assert!(cpio::write_newc_gz(&gz, &bad, 0).is_err());
    let bad = [CpioEntry::file("x", 0o100644, vec![])];
    assert!(cpio::write_newc_gz(&gz, &bad, 0).is_err());
    let bad = [
        CpioEntry::file("a", 0o644, vec![]),
        CpioEntry::file("a/b", 0o644, vec![]),
    ];
    assert!(cpio::write_newc_gz(&gz, &bad, 0).is_err());
}

/// A loop device over an image, detached on drop (also when the test panics).
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        if let Ok(sh) = Shell::new() {
            let dev = &self.0;
            let _ = cmd!(sh, "losetup -d {dev}").quiet().run();
        }
    }
}

/// The readers work on a block device, read-only: the image behind a read-only loop device.
/// Needs root (loop devices); elsewhere it says so and passes.
#[test]
fn readers_work_on_a_read_only_block_device() {
    let root = doctor::version_of("id", &["-u"]).as_deref() == Some("0");
    if !root || !Path::new("/dev/loop-control").exists() {
        eprintln!(
            "SKIP readers_work_on_a_read_only_block_device: needs root and /dev/loop-control"
        );
        return;
    }
    tools();
    doctor::ensure(&[&doctor::LOSETUP]).unwrap();
    let t = tempfile::tempdir().unwrap();
    let part = t.path().join("boot.vfat");
    let files = boot_files();
    fat::build(&part, BOOT_SIZE, 7, "KILN-BOOT", &files, EPOCH).unwrap();
    let spec = specs().remove(0);
    let img = t.path().join("disk.img");
    assemble(
        &img,
        DISK_SIZE,
        guid_from_seed(SEED, "disk"),
        &[(spec.clone(), part)],
        &[],
    )
    .unwrap();
    let before = sha256_file(&img);
    let sh = Shell::new().unwrap();
    let dev = cmd!(sh, "losetup --find --show --read-only {img}")
        .read()
        .unwrap();
    let lo = Loop(dev.trim().to_string());
    let dev = Path::new(&lo.0);
    let parts = gpt::read(dev).unwrap();
    assert_eq!(parts.len(), 1);
    assert_eq!(parts[0].name, "boot");
    assert_eq!(parts[0].unique_guid, spec.unique_guid);
    let (off, len) = (parts[0].start_bytes(), parts[0].size_bytes());
    assert_eq!(
        fat::read_file(dev, off, len, "extlinux/extlinux.conf").unwrap(),
        files[1].1
    );
    assert_eq!(fat::list(dev, off, len).unwrap().len(), 9);
    drop(lo);
    assert_eq!(sha256_file(&img), before);
}

/// Run in a child process by `a_killed_write_never_leaves_the_final_file`: assembles a disk whose
/// partition image is a FIFO nobody writes, so it blocks half-way with the temp file open.
#[test]
#[ignore = "run by a_killed_write_never_leaves_the_final_file in a child process"]
fn interrupt_child() {
    let Some(dir) = std::env::var_os("KILN_DISK_INTERRUPT_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let spec = specs().remove(0);
    let _ = assemble(
        &dir.join("disk.img"),
        DISK_SIZE,
        guid_from_seed(SEED, "disk"),
        &[(spec, dir.join("stalled.fifo"))],
        &[],
    );
}

#[test]
fn a_killed_write_never_leaves_the_final_file() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let sh = Shell::new().unwrap();
    let fifo = dir.join("stalled.fifo");
    cmd!(sh, "mkfifo {fifo}").run().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut child: std::process::Command = cmd!(
        sh,
        "{exe} --exact disk::tests::interrupt_child --ignored --test-threads 1"
    )
    .env("KILN_DISK_INTERRUPT_DIR", dir)
    .quiet()
    .into();
    let mut child = child.spawn().unwrap();
    // Wait until the output exists under some name: the writer is then blocked on the FIFO.
    let tmp_seen = (0..600).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        std::fs::read_dir(dir).unwrap().any(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name == "disk.img" || name.starts_with(".disk.img.tmp.")
        })
    });
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(tmp_seen, "the child never started writing");
    assert!(
        !dir.join("disk.img").exists(),
        "a killed assembly left a final-named file"
    );
    // The next run clears the dead run's temp file and succeeds.
    let part = dir.join("boot.img");
    std::fs::write(&part, b"boot").unwrap();
    let spec = specs().remove(0);
    assemble(
        &dir.join("disk.img"),
        DISK_SIZE,
        guid_from_seed(SEED, "disk"),
        &[(spec, part)],
        &[],
    )
    .unwrap();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["boot.img", "disk.img", "stalled.fifo"]);
}

#[test]
fn erofs_from_files_ignores_source_modes() {
    tools();
    let t = tempfile::tempdir().unwrap();
    let mut images = Vec::new();
    for (i, (file_mode, exec_mode)) in [(0o600, 0o700), (0o666, 0o775)].into_iter().enumerate() {
        let src = t.path().join(format!("src{i}"));
        std::fs::create_dir(&src).unwrap();
        let model = src.join("model.gguf");
        std::fs::write(&model, vec![0x47; 9000]).unwrap();
        std::fs::set_permissions(&model, std::fs::Permissions::from_mode(file_mode)).unwrap();
        let tool = src.join("tool");
        std::fs::write(&tool, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(exec_mode)).unwrap();
        let out = t.path().join(format!("models{i}.erofs"));
        let files = [
            ("models/model.gguf".to_string(), model.clone()),
            ("bin/tool".to_string(), tool),
            ("fixture.gguf".to_string(), model),
        ];
        erofs::build_files(&out, &files, guid_from_seed(SEED, "models-fs"), EPOCH, None).unwrap();
        images.push(out);
    }
    assert_eq!(sha256_file(&images[0]), sha256_file(&images[1]));
    let sh = Shell::new().unwrap();
    let img = &images[0];
    cmd!(sh, "fsck.erofs {img}").run().unwrap();
    // Nothing but the two images is left (no stage folder).
    let mut names: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["models0.erofs", "models1.erofs", "src0", "src1"]);
}

#[test]
fn copy_sparse_keeps_every_byte_at_unaligned_offsets() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    // Zero and non-zero stretches that straddle 4 KiB boundaries of the destination, and a source
    // longer than the 1 MiB read buffer.
    let mut data = vec![0u8; (MIB + 30_000) as usize];
    for (a, b) in [
        (1, 2),
        (5000, 9000),
        (20_000, 20_001),
        (MIB as usize - 3, MIB as usize + 7),
    ] {
        data[a..b].fill(0x5c);
    }
    *data.last_mut().unwrap() = 9;
    std::fs::write(&src, &data).unwrap();
    for offset in [0u64, 512, 1000, 4095, 3 * 4096] {
        let dst_path = t.path().join("dst");
        let dst = std::fs::File::create(&dst_path).unwrap();
        dst.set_len(offset + data.len() as u64 + 4096).unwrap();
        assert_eq!(copy_sparse(&dst, offset, &src).unwrap(), data.len() as u64);
        drop(dst);
        let got = std::fs::read(&dst_path).unwrap();
        assert!(got[..offset as usize].iter().all(|&b| b == 0));
        assert_eq!(
            &got[offset as usize..offset as usize + data.len()],
            &data[..],
            "offset {offset}"
        );
        assert!(got[offset as usize + data.len()..].iter().all(|&b| b == 0));
        // Only the blocks that hold data were written.
        assert!(std::fs::metadata(&dst_path).unwrap().blocks() * 512 <= 8 * 4096 * 2);
    }
}

/// U-Boot (Debian's `qemu_arm64` build, what the qemu-virt board boots through) loads the kernel
/// named by `extlinux/extlinux.conf` on our FAT32 through distro boot, which scans the partitions
/// with the legacy-BIOS-bootable attribute: p1 is a decoy FAT whose extlinux.conf names
/// `/Decoy`, p2 our boot partition with the attribute, so only the attribute leads U-Boot to p2.
#[test]
fn uboot_distro_boot_follows_the_bootable_attribute_into_our_fat() {
    tools();
    let q = crate::tools_root::qemu_virt().unwrap();
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let boot = dir.join("boot.vfat");
    fat::build(
        &boot,
        BOOT_SIZE,
        0x4b494c4e,
        "KILN-BOOT",
        &boot_files(),
        EPOCH,
    )
    .unwrap();
    let decoy = dir.join("decoy.vfat");
    let decoy_conf = b"default d\nprompt 0\ntimeout 1\nlabel d\n    kernel /Decoy\n".to_vec();
    let decoy_files = [("extlinux/extlinux.conf".to_string(), decoy_conf)];
    fat::build(&decoy, DATA_SIZE, 1, "DECOY", &decoy_files, EPOCH).unwrap();
    let mut s = specs();
    let (mut p_boot, mut p_decoy) = (s.remove(0), s.remove(1));
    p_decoy.type_guid = types::basic_data();
    // U-Boot also counts an EFI System Partition as bootable (disk/part_efi.c `is_bootable`):
    // a basic-data type leaves the attribute as the only signal.
    p_boot.type_guid = types::basic_data();
    p_decoy.first_lba = 16 * MIB / SECTOR;
    p_boot.first_lba = p_decoy.first_lba + DATA_SIZE / SECTOR;
    let img = dir.join("disk.img");
    let parts = [(p_decoy, decoy), (p_boot, boot)];
    assemble(&img, DISK_SIZE, guid_from_seed(SEED, "disk"), &parts, &[]).unwrap();

    let machine = crate::tools_root::machine::qemu_virt_machine().unwrap();
    let argv = q.command(
        &machine,
        crate::tools_root::machine::Start::UBoot { pflash: None },
        &[crate::tools_root::machine::Disk {
            path: &img,
            options: "snapshot=on",
        }],
        None,
        &["-no-reboot"],
    );
    let mut qemu = std::process::Command::new(&argv[0]);
    qemu.args(&argv[1..]);
    let mut child = qemu
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains("Retrieving file: /Image")
                    || line.contains("Retrieving file: /Decoy");
                log.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let log = log.join("\n");
    assert!(found, "U-Boot loaded no kernel from our disk:\n{log}");
    assert!(log.contains("Scanning virtio 0:2"), "{log}");
    assert!(
        !log.contains("Scanning virtio 0:1"),
        "p1 has no bootable attribute:\n{log}"
    );
    assert!(log.contains("Found /extlinux/extlinux.conf"), "{log}");
}
