//! Test stages of the image (`cargo xtask test --stage image`): independent tools judge the
//! qemu-virt image (`image-checks`). Reproducibility across machines, paths, time zones, umasks
//! and times is the `fresh-machine` stage's (`crate::fresh_machine`).

use super::{board::Board, Args};
use crate::doctor;
use crate::pins::{Cache, Sha256};
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use xshell::cmd;

fn qemu_args() -> Args {
    Args {
        board: "qemu-virt".into(),
        models: Vec::new(),
        offline: false,
        dev_keys: false,
    }
}

pub fn read_json(p: &Path) -> Result<Value> {
    serde_json::from_slice(&std::fs::read(p).with_context(|| format!("reading {}", p.display()))?)
        .with_context(|| format!("parsing {}", p.display()))
}

/// Copy `len` bytes at `off` of `img` into `out`.
fn extract(img: &Path, off: u64, len: u64, out: &Path) -> Result<()> {
    let mut f = std::fs::File::open(img)?;
    f.seek(SeekFrom::Start(off))?;
    let mut o = std::fs::File::create(out)?;
    std::io::copy(&mut f.take(len), &mut o)?;
    o.flush()?;
    Ok(())
}

/// `image-checks`: build (or reuse) the qemu-virt image, then let sfdisk, fsck.vfat, fsck.erofs,
/// e2fsck, mtools, cpio and bmaptool judge it; see a real Kconfig drop options and the check name
/// them; build rock-5b from public inputs and judge it ([`rock5b`]); see the rock-5b-vendor build
/// list its missing vendor inputs.
pub fn stage() -> Result<()> {
    doctor::ensure(&[
        &doctor::SFDISK,
        &doctor::FSCK_VFAT,
        &doctor::FSCK_EROFS,
        &doctor::E2FSCK,
        &doctor::VERITYSETUP,
        &doctor::MTOOLS,
        &doctor::CPIO,
        &doctor::BMAPTOOL,
        &doctor::KMOD,
    ])?;
    let built = super::build(&qemu_args())?;
    let img = &built.image;
    let manifest = read_json(&built.manifest)?;
    let sh = xshell::Shell::new()?;
    sh.set_var("TZ", "UTC");
    let tmp = tempfile::tempdir()?;

    // The partition table as sfdisk reads it, against the manifest.
    let table: Value = serde_json::from_str(&cmd!(sh, "sfdisk --json {img}").read()?)?;
    let t = &table["partitiontable"];
    ensure!(t["label"] == "gpt", "sfdisk: label {}", t["label"]);
    let disk = &manifest["disk"];
    let eq_guid = |a: &Value, b: &Value| {
        a.as_str().map(str::to_lowercase) == b.as_str().map(str::to_lowercase)
    };
    ensure!(
        eq_guid(&t["id"], &disk["disk_guid"]),
        "disk GUID: sfdisk {} vs manifest {}",
        t["id"],
        disk["disk_guid"]
    );
    let parts = t["partitions"]
        .as_array()
        .context("sfdisk: no partitions")?;
    let want = disk["partitions"]
        .as_array()
        .context("manifest: no partitions")?;
    ensure!(
        parts.len() == 6 && want.len() == 6,
        "expected 6 partitions (bootctl, boot_a, boot_b, models_a, models_b, data), sfdisk lists {}",
        parts.len()
    );
    let mut files = Vec::new();
    for (i, (p, w)) in parts.iter().zip(want).enumerate() {
        let start = p["start"].as_u64().context("start")?;
        let size = p["size"].as_u64().context("size")?;
        ensure!(
            start == w["first_lba"].as_u64().unwrap_or(0),
            "p{}: start {start} vs manifest {}",
            i + 1,
            w["first_lba"]
        );
        ensure!(
            size * 512 == w["size_bytes"].as_u64().unwrap_or(0),
            "p{}: size {size} sectors vs manifest {}",
            i + 1,
            w["size_bytes"]
        );
        ensure!(
            eq_guid(&p["uuid"], &w["unique_guid"]),
            "p{}: uuid {} vs manifest {}",
            i + 1,
            p["uuid"],
            w["unique_guid"]
        );
        ensure!(
            eq_guid(&p["type"], &w["type_guid"]),
            "p{}: type {} vs manifest {}",
            i + 1,
            p["type"],
            w["type_guid"]
        );
        ensure!(
            p["name"] == w["name"],
            "p{}: name {} vs manifest {}",
            i + 1,
            p["name"],
            w["name"]
        );
        let attrs = p["attrs"].as_str().unwrap_or("");
        ensure!(
            (i == 0) == attrs.contains("LegacyBIOSBootable"),
            "p{}: attrs {attrs:?} (only bootctl is legacy-BIOS-bootable)",
            i + 1
        );
        let out = tmp.path().join(format!("p{}", i + 1));
        extract(img, start * 512, size * 512, &out)?;
        files.push(out);
    }
    ensure!(
        parts[0]["start"] == 32768,
        "bootctl does not start at 16 MiB"
    );
    println!(
        "image-checks: sfdisk --json agrees with the manifest (GUIDs, offsets, names, attributes)"
    );

    ensure!(
        files.len() == 6,
        "{} partitions, 6 expected (bootctl, boot_a, boot_b, models_a, models_b, data)",
        files.len()
    );
    let (ctl, p1, slot_b, models, models_b, data) = (
        &files[0], &files[1], &files[2], &files[3], &files[4], &files[5],
    );
    // The second models slot holds no models: zeros but its last 4 KiB, the empty footer.
    ensure!(
        kiln_runtime::models_slot::read(models_b)?.is_none()
            && std::fs::metadata(models_b)?.len() == std::fs::metadata(models)?.len(),
        "models_b is not an empty models slot the size of models_a"
    );
    println!("image-checks: models_b is empty and the size of models_a");
    for (p, what) in [(ctl, "bootctl"), (p1, "boot_a"), (slot_b, "boot_b")] {
        cmd!(sh, "fsck.vfat -n {p}")
            .run()
            .with_context(|| format!("fsck.vfat -n on {what}"))?;
    }
    cmd!(sh, "fsck.erofs {models}")
        .run()
        .context("fsck.erofs on the models partition")?;
    // The dm-verity tree after the erofs, judged by veritysetup with the manifest's parameters
    // (the board's kernel judges it again at every read).
    let v = &manifest["models_verity"];
    let (Some(blocks), Some(start), Some(salt), Some(root)) = (
        v["data_blocks"].as_u64(),
        v["hash_start_block"].as_u64(),
        v["salt"].as_str(),
        v["root_hash"].as_str(),
    ) else {
        bail!("the manifest's models_verity is missing or incomplete: {v}");
    };
    let (off, salt_arg) = (
        format!("--hash-offset={}", start * 4096),
        format!("--salt={salt}"),
    );
    let blocks_arg = format!("--data-blocks={blocks}");
    cmd!(
        sh,
        "veritysetup verify --no-superblock {off} {blocks_arg} {salt_arg} {models} {models} {root}"
    )
    .run()
    .context("veritysetup verify on the models partition with the manifest's root hash")?;
    println!("image-checks: veritysetup verifies the models partition's dm-verity tree against root {root}");
    cmd!(sh, "e2fsck -fn {data}")
        .run()
        .context("e2fsck -fn on the data partition")?;
    println!("image-checks: fsck.vfat (bootctl, boot_a, boot_b), fsck.erofs and e2fsck find the partitions clean");
    ensure!(
        std::fs::read(p1)? == std::fs::read(slot_b)?,
        "boot_a and boot_b differ: a new image carries the same system in both slots"
    );
    println!("image-checks: boot_a and boot_b are byte-identical");
    // bootctl holds only the chooser and its counters, which libubootenv reads as RAUC does.
    let listing = cmd!(sh, "mdir -/ -b -i {ctl} ::/").read()?;
    let mut listed: Vec<&str> = listing
        .lines()
        .map(str::trim)
        .filter(|l| !l.ends_with('/'))
        .collect();
    listed.sort();
    ensure!(
        listed == ["::/boot.scr", "::/kiln/abstate.env"],
        "bootctl holds {listed:?}, only boot.scr and kiln/abstate.env expected"
    );
    let scr = tmp.path().join("boot.scr");
    cmd!(sh, "mcopy -n -i {ctl} ::/boot.scr {scr}").run()?;
    let info = cmd!(sh, "mkimage -l {scr}").read()?;
    ensure!(
        info.contains("AArch64 Linux Script (uncompressed)"),
        "mkimage -l boot.scr: {info}"
    );
    let env = tmp.path().join("abstate.env");
    cmd!(sh, "mcopy -n -i {ctl} ::/kiln/abstate.env {env}").run()?;
    let st =
        kiln_runtime::slot::State::decode(&std::fs::read(&env)?, "bootctl's kiln/abstate.env")?;
    ensure!(
        st == kiln_runtime::slot::State::initial(),
        "bootctl's kiln/abstate.env is not BOOT_ORDER 'A B' with 3 tries each: {st:?}"
    );
    println!("image-checks: bootctl holds only boot.scr (mkimage -l: a script image) and kiln/abstate.env (A B, 3, 3)");

    // mtools lists and reads the boot files.
    let listing = cmd!(sh, "mdir -/ -b -i {p1} ::/").read()?;
    for f in [
        "::/extlinux/extlinux.conf",
        "::/Image",
        "::/initramfs.cpio.gz",
        "::/kiln/manifest.json",
    ] {
        ensure!(
            listing.lines().any(|l| l.trim() == f),
            "mdir does not list {f}:\n{listing}"
        );
    }
    let conf = cmd!(sh, "mtype -i {p1} ::/extlinux/extlinux.conf").read()?;
    let board = Board::load("qemu-virt")?;
    ensure!(
        conf.trim_end() == super::extlinux_conf(&board, None).trim_end(),
        "extlinux.conf read back differs:\n{conf}"
    );
    let kimg = tmp.path().join("Image");
    let initrd = tmp.path().join("initramfs.cpio.gz");
    cmd!(sh, "mcopy -n -i {p1} ::/Image {kimg}").run()?;
    cmd!(sh, "mcopy -n -i {p1} ::/initramfs.cpio.gz {initrd}").run()?;
    let ksha = Sha256::of_file(&kimg)?.to_string();
    ensure!(
        Value::String(ksha.clone()) == manifest["kernel"]["image_sha256"],
        "Image read back by mcopy: {ksha} vs manifest"
    );
    println!("image-checks: mdir lists the boot files; mcopy reads back extlinux.conf and the kernel as built");

    // The sidecar names the boot manifest's hash (the board's `manifest=`), as sha256sum sees it.
    let bman = tmp.path().join("manifest.json");
    cmd!(sh, "mcopy -n -i {p1} ::/kiln/manifest.json {bman}").run()?;
    let sum = cmd!(sh, "sha256sum {bman}").read()?;
    let sum = sum.split_whitespace().next().unwrap_or_default();
    let sidecar = img.with_extension("manifest.sha256");
    let side = std::fs::read_to_string(&sidecar)
        .with_context(|| format!("reading {}", sidecar.display()))?;
    ensure!(
        side == format!("{sum}  kiln/manifest.json\n"),
        "{} says {side:?}, but sha256sum of kiln/manifest.json read back by mcopy is {sum}",
        sidecar.display()
    );
    ensure!(
        manifest["image"]["boot_manifest_sha256"] == Value::String(sum.to_string()),
        "manifest.json's image.boot_manifest_sha256 is not sha256sum's {sum}"
    );
    println!(
        "image-checks: {} matches sha256sum of the boot partition's kiln/manifest.json",
        sidecar.display()
    );

    // cpio lists the initramfs.
    let mut cpio_bytes = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&initrd)?).read_to_end(&mut cpio_bytes)?;
    let list = cmd!(sh, "cpio -it --quiet").stdin(&cpio_bytes).read()?;
    for f in [
        "usr/bin/kiln",
        "bin/busybox",
        "bin/sh",
        "etc/kiln/board.toml",
        "lib/ld-linux-aarch64.so.1",
        "lib/aarch64-linux-gnu/libc.so.6",
    ] {
        ensure!(list.lines().any(|l| l == f), "cpio -t does not list {f}");
    }
    let verbose = cmd!(sh, "cpio -itvn --quiet").stdin(&cpio_bytes).read()?;
    for l in verbose.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        ensure!(
            w.len() > 3 && w[2] == "0" && w[3] == "0",
            "cpio entry not owned by 0:0: {l}"
        );
    }
    println!(
        "image-checks: cpio lists {} initramfs entries, all owned by 0:0",
        list.lines().count()
    );

    // bmaptool copies the image with our bmap (checking our range checksums) to the same bytes.
    let bmap = &built.bmap;
    let copy = tmp.path().join("copy.img");
    cmd!(sh, "bmaptool copy --bmap {bmap} {img} {copy}")
        .run()
        .context("bmaptool copy with our bmap")?;
    let csha = Sha256::of_file(&copy)?;
    ensure!(
        csha == built.sha256,
        "bmaptool copy gives sha256 {csha}, the image is {}",
        built.sha256
    );
    println!(
        "image-checks: bmaptool copy with our bmap reproduces the image ({})",
        built.sha256
    );
    // A user cannot make a loop device: every other check runs, and the stage ends naming this
    // one (`NeedsRoot`: the suite says SKIPPED with the reason) instead of passing without it.
    let reflash_not_run = if crate::doctor::is_root() {
        reflash_clears_models_b(&sh, img, bmap, models, tmp.path())?;
        false
    } else {
        println!(
            "image-checks: NOT RUN as a user: the reflash onto a loop device (models_b cleared by \
             the bmap) needs root"
        );
        true
    };

    // A real Kconfig run: a fragment without MISC_FILESYSTEMS and with an unknown option.
    let frag = std::fs::read_to_string(board.kernel.fragment_path())?;
    let bad: String = frag
        .lines()
        .filter(|l| !l.starts_with("CONFIG_MISC_FILESYSTEMS="))
        .chain(["CONFIG_KILN_NO_SUCH_OPTION=y"])
        .map(|l| format!("{l}\n"))
        .collect();
    let cache = Cache::user()?;
    let inputs = super::resolve_inputs(&board, &cache, true)?;
    let (src, path) = &inputs[&board.kernel.source];
    let sha = src.sha256.context("kernel source unpinned")?;
    let tools = crate::tools_root::ensure(true)?;
    match crate::kernel::check_config_only(&board.kernel, path, &sha, &bad, &tools) {
        Ok(()) => bail!("the fragment check accepted a fragment Kconfig cannot satisfy"),
        Err(e) => {
            let e = format!("{e:#}");
            for s in ["CONFIG_EROFS_FS=y", "CONFIG_KILN_NO_SUCH_OPTION=y"] {
                ensure!(e.contains(s), "the fragment check did not name {s}: {e}");
            }
            println!("image-checks: olddefconfig dropped options and the check named them:\n{e}");
        }
    }

    rock5b(&sh, tmp.path())?;

    // rock-5b-vendor without its vendor files: the build stops and lists each one.
    let r = super::build(&Args {
        board: "rock-5b-vendor".into(),
        models: Vec::new(),
        offline: true,
        dev_keys: true,
    });
    match r {
        Ok(_) => bail!("rock-5b-vendor built without its vendor inputs"),
        Err(e) => {
            let e = format!("{e:#}");
            for n in ["linux-rk35xx-vendor", "librknnrt"] {
                ensure!(
                    e.contains(&format!("missing input {n}")),
                    "rock-5b-vendor build did not list {n}: {e}"
                );
            }
            println!(
                "image-checks: rock-5b-vendor without vendor inputs stops and lists them:\n{e}"
            );
        }
    }
    if reflash_not_run {
        return Err(crate::doctor::NeedsRoot(
            "image-checks' reflash onto a loop device (models_b cleared by the bmap) was not \
             run; every other check of the stage ran and passed"
                .into(),
        )
        .into());
    }
    Ok(())
}

/// rock-5b from public inputs (the DDR blob seeded as the u-boot stage does): it builds; its slot
/// holds Debian's Image, dtb and config byte for byte as `dpkg-deb` unpacks them from the pinned
/// package; the loader is at LBA 64 and `cargo xtask flash` writes the image; a fragment option
/// the package's config does not hold is refused, named.
/// A card whose `models_b` a models install wrote (here: `models_a`'s slot), reflashed with the
/// image by `bmaptool copy` onto a block device (a loop device: a regular file would be
/// truncated): the bmap maps `models_b`'s empty footer, so `models_b` reads as empty again, not
/// as the old slot. Needs root and `/dev/loop-control` (CI has both): not run as a user, and the
/// stage then ends naming it.
fn reflash_clears_models_b(
    sh: &xshell::Shell,
    img: &Path,
    bmap: &Path,
    models_a: &Path,
    tmp: &Path,
) -> Result<()> {
    use std::os::unix::fs::FileExt as _;
    crate::doctor::ensure(&[&crate::doctor::LOSETUP])?;
    let p5 = crate::disk::gpt::read(img)?
        .into_iter()
        .find(|p| p.name == "models_b")
        .context("the image has no models_b")?;
    let card = tmp.join("card.img");
    std::fs::copy(img, &card).context("copying the image as a card")?;
    let old = std::fs::read(models_a)?;
    ensure!(
        old.len() as u64 == p5.size_bytes(),
        "models_a's slot is not the size of models_b"
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&card)?
        .write_all_at(&old, p5.start_bytes())?;
    ensure!(
        kiln_runtime::models_slot::read_in(&card, p5.start_bytes(), p5.size_bytes(), "models_b")?
            .is_some(),
        "the card's models_b does not hold the slot written to it"
    );
    let dev = cmd!(sh, "losetup --find --show {card}")
        .read()
        .context("a loop device over the card")?;
    let dev = dev.trim().to_string();
    let copied = cmd!(sh, "bmaptool copy --bmap {bmap} {img} {dev}").run();
    let _ = cmd!(sh, "losetup -d {dev}").quiet().run();
    copied.context("bmaptool copy onto the card's loop device")?;
    let after =
        kiln_runtime::models_slot::read_in(&card, p5.start_bytes(), p5.size_bytes(), "models_b")
            .context("models_b after the reflash")?;
    ensure!(
        after.is_none(),
        "after a reflash by the bmap, models_b still holds the card's old slot (kiln-models.json {})",
        after.map(|s| s.meta_sha256()).unwrap_or_default()
    );
    println!(
        "image-checks: a card whose models_b held a models slot, reflashed by bmaptool onto a loop \
         device: models_b reads as empty (its empty footer is in the bmap)"
    );
    Ok(())
}

fn rock5b(sh: &xshell::Shell, tmp: &Path) -> Result<()> {
    let board = Board::load("rock-5b")?;
    super::loader::seed_rkbin(&board)?;
    // A test board: it trusts the development key, asked for in so many words.
    let built = super::build(&Args {
        board: "rock-5b".into(),
        models: Vec::new(),
        offline: false,
        dev_keys: true,
    })?;
    let manifest = read_json(&built.manifest)?;
    let release = board
        .kernel
        .prebuilt_release
        .as_deref()
        .context("rock-5b's kernel is not Debian's build")?;
    let pkg = &manifest["kernel"]["package"];
    let cache = Cache::user()?;
    let inputs = super::resolve_inputs(&board, &cache, true)?;
    let (input, deb) = &inputs[&board.kernel.source];
    ensure!(
        pkg["sha256"] == serde_json::to_value(input.sha256)?
            && pkg["version"] == Value::String(input.version.clone()),
        "the manifest's kernel package {pkg} is not the pinned {} {}",
        input.name,
        input.version
    );
    // The package unpacked by dpkg-deb, the slot read by mtools.
    let unpacked = tmp.join("deb");
    cmd!(sh, "dpkg-deb -x {deb} {unpacked}").run()?;
    let start = manifest["disk"]["partitions"][1]["first_lba"]
        .as_u64()
        .context("manifest: boot_a's first_lba")?;
    let size = manifest["disk"]["partitions"][1]["size_bytes"]
        .as_u64()
        .context("manifest: boot_a's size")?;
    let slot = tmp.join("rock-5b-boot_a");
    extract(&built.image, start * 512, size, &slot)?;
    let (image, config, dtb) = crate::kernel::prebuilt_members(&board.kernel, release);
    let dtb = dtb.context("rock-5b names no dtb")?;
    let dtb_name = dtb.rsplit('/').next().unwrap_or(&dtb).to_string();
    for (member, on_slot) in [
        (image, "Image".to_string()),
        (config, format!("config-{release}")),
        (dtb, dtb_name),
    ] {
        let got = tmp.join(format!("slot-{on_slot}"));
        cmd!(sh, "mcopy -n -i {slot} ::/{on_slot} {got}").run()?;
        ensure!(
            std::fs::read(&got)? == std::fs::read(unpacked.join(&member))?,
            "the slot's {on_slot} is not the package's {member}"
        );
    }
    println!(
        "image-checks: rock-5b's slot holds {} {}'s Image, config and dtb byte for byte as dpkg-deb unpacks them",
        input.name, input.version
    );
    rock5b_modules(sh, &manifest, &unpacked, release)?;
    // The loader at LBA 64, then the image through `cargo xtask flash`, checked on the target.
    let (_, bl31) = super::loader::build(&board, true, false)?;
    println!(
        "image-checks: rock-5b image: {}",
        super::loader::check_disk(&built.image, &bl31)?
    );
    let target = tmp.join("rock-5b-card.img");
    std::fs::File::create(&target)?.set_len(std::fs::metadata(&built.image)?.len())?;
    crate::flash::run(crate::flash::Args::onto_file(
        built.image.clone(),
        target.clone(),
        Some(built.bmap.clone()),
    ))
    .context("cargo xtask flash of the rock-5b image")?;
    println!(
        "image-checks: rock-5b after `cargo xtask flash`: {}",
        super::loader::check_disk(&target, &bl31)?
    );
    std::fs::remove_file(&target)?;
    let modules = manifest["kernel_modules"]["load_order"]
        .as_array()
        .map_or(0, Vec::len);
    rock5b_emulated(tmp, &built.image, &slot, modules)?;
    // The fragment is held to the package's config: an option Debian builds as a module asked
    // built in, and one it does not have, are refused, each named.
    let frag = std::fs::read_to_string(board.kernel.fragment_path())?;
    let bad: String = frag
        .lines()
        .map(|l| {
            if l == "CONFIG_EROFS_FS=m" {
                "CONFIG_EROFS_FS=y"
            } else {
                l
            }
        })
        .chain(["CONFIG_KILN_NO_SUCH_OPTION=y"])
        .map(|l| format!("{l}\n"))
        .collect();
    ensure!(
        bad.contains("CONFIG_EROFS_FS=y"),
        "rock-5b.config has no CONFIG_EROFS_FS=m"
    );
    let sha = input.sha256.context("kernel package unpinned")?;
    let tools = crate::tools_root::ensure(true)?;
    match crate::kernel::check_config_only(&board.kernel, deb, &sha, &bad, &tools) {
        Ok(()) => bail!("the fragment check accepted options Debian's config does not hold"),
        Err(e) => {
            let e = format!("{e:#}");
            for s in ["CONFIG_EROFS_FS=y", "CONFIG_KILN_NO_SUCH_OPTION=y"] {
                ensure!(e.contains(s), "the fragment check did not name {s}: {e}");
            }
            println!("image-checks: rock-5b's fragment against Debian's config: the faults are named:\n{e}");
        }
    }
    Ok(())
}

/// The checks that need the RK3588 itself, and why each fails under QEMU's `virt` machine.
const EMULATION_FAILS: &[(&str, &str)] = &[
    // No cpufreq-dt policies: virt has no OPP tables and no SCMI clocks.
    ("cpu.governors", "no cpufreq policy"),
    // The board's UART is ttyS2 at 1.5 Mbaud (extlinux's append line); virt's is ttyAMA0.
    (
        "image.manifest",
        "word 1 is \"console=ttyAMA0\", pinned \"console=ttyS2,1500000\"",
    ),
];

/// Checks whose outcome under emulation is the emulating host's, not the image's: the board's
/// minimum read bandwidth is a Rock 5B's, and what TCG reaches depends on the host and its load.
/// They must run and measure; pass or fail is printed, not required.
const EMULATION_HOST_SPEED: &[&str] = &["memory.bandwidth"];

/// The module the fault boot keeps the kernel from loading (`module_blacklist=`): one nothing
/// else depends on, so the rest of the boot is unchanged and `kernel.modules` must name it.
const EMULATION_FAULT_MODULE: &str = "rtc_hym8563";

/// rock-5b's own kernel, modules and initramfs (taken from its boot slot) booted under QEMU's
/// `virt` machine (QEMU has no RK3588 machine) with a copy of the image as its disk: init must
/// load every module of the list, mount the partitions and run the self-check, whose failures
/// must be exactly [`EMULATION_FAILS`], each for its reason. A second boot with one module
/// refused by the kernel must fail `kernel.modules` too, naming it. What this cannot show: the
/// boot ROM, U-Boot on the board, the RK3588 device tree and the drivers binding to its hardware.
fn rock5b_emulated(tmp: &Path, image: &Path, slot: &Path, modules: usize) -> Result<()> {
    let sh = crate::paths::shell()?;
    let kernel = tmp.join("emu-Image");
    let initrd = tmp.join("emu-initramfs.cpio.gz");
    cmd!(sh, "mcopy -n -i {slot} ::/Image {kernel}").run()?;
    cmd!(sh, "mcopy -n -i {slot} ::/initramfs.cpio.gz {initrd}").run()?;
    let disk = tmp.join("emu-disk.img");
    // Kept after the stage (the temporary folder is not).
    let logdir = crate::paths::target_dir().join("boot-test/rock-5b-emulated");
    std::fs::create_dir_all(&logdir).with_context(|| format!("creating {}", logdir.display()))?;

    let started = std::time::Instant::now();
    crate::disk::copy_image(image, &disk)?;
    let log = logdir.join("serial.log");
    let (console, report, line) = emulated_boot(&kernel, &initrd, &disk, &log, "")?;
    let loaded = format!("kiln-init: loaded {modules} kernel modules");
    ensure!(
        modules > 0 && console.contains(&loaded),
        "rock-5b under QEMU virt: no \"{loaded}\" from init; serial log {}",
        log.display()
    );
    // The models partition is mounted through its dm-verity mapping (the kernel's dm-verity
    // module among those loaded).
    for mounted in [
        "(bootctl) on /",
        "(boot_a) on /",
        "(kiln-models: dm-verity over ",
        "(data) on /",
    ] {
        let part = mounted
            .trim_start_matches('(')
            .split([')', ':'])
            .next()
            .unwrap_or(mounted);
        ensure!(
            console.contains(mounted),
            "rock-5b under QEMU virt: init did not mount {part}; serial log {}",
            log.display()
        );
    }
    let host_speed = board_only_failures(&report, &[], &log)?;
    let modules_line = report
        .checks
        .iter()
        .find(|c| c.id == "kernel.modules")
        .map(|c| c.evidence.join(" "))
        .unwrap_or_default();
    println!(
        "image-checks: rock-5b's Image, {modules} modules and initramfs under QEMU virt \
         ({:.0} s): every module loaded, the partitions mounted; {line}; kernel.modules: \
         {modules_line}; failed only where the RK3588 is needed: {}; measured the host: {}",
        started.elapsed().as_secs_f64(),
        EMULATION_FAILS
            .iter()
            .map(|(id, why)| format!("{id} ({why})"))
            .collect::<Vec<_>>()
            .join(", "),
        host_speed.join(", ")
    );

    // The fault: the kernel refuses one module of the list.
    let started = std::time::Instant::now();
    crate::disk::copy_image(image, &disk)?;
    let log = logdir.join("serial-module-refused.log");
    let extra = format!("module_blacklist={EMULATION_FAULT_MODULE}");
    let (_, report, _) = emulated_boot(&kernel, &initrd, &disk, &log, &extra)?;
    board_only_failures(&report, &["kernel.modules"], &log)?;
    let c = report
        .checks
        .iter()
        .find(|c| c.id == "kernel.modules")
        .context("no kernel.modules in the report")?;
    let reason = c.reason.as_deref().unwrap_or("");
    let want = format!("{EMULATION_FAULT_MODULE}: not loaded");
    ensure!(
        reason.contains(&want),
        "rock-5b under QEMU virt with {extra}: kernel.modules did not say {want:?}: {reason}"
    );
    println!(
        "image-checks: rock-5b under QEMU virt with {extra} ({:.0} s): kernel.modules FAIL: {reason}",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Boot rock-5b's kernel and initramfs under QEMU `virt` on `disk` until the machine ends
/// (`kiln.mode=test` ends it after the verdict; a FAIL reboots, which `-no-reboot` makes an
/// exit); the serial console goes to `log`. The console, the report and its verdict line.
fn emulated_boot(
    kernel: &Path,
    initrd: &Path,
    disk: &Path,
    log: &Path,
    extra_append: &str,
) -> Result<(String, kiln_runtime::selftest::report::Report, String)> {
    use kiln_runtime::selftest::report::Report;
    let append = format!("console=ttyAMA0 panic=-1 {extra_append} rauc.slot=A kiln.mode=test")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let started = std::time::Instant::now();
    // rock-5b has no [qemu]: its kernel runs on the QEMU board's machine (virtio is built in).
    let machine = crate::tools_root::machine::qemu_virt_machine()?;
    let argv = crate::tools_root::qemu_virt()?.command(
        &machine,
        crate::tools_root::machine::Start::Kernel {
            kernel,
            initrd,
            append: &append,
        },
        &[crate::tools_root::machine::Disk {
            path: disk,
            options: "",
        }],
        None,
        &[],
    );
    let mut child = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(log)?)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .context("starting qemu-system-aarch64 for rock-5b's kernel and initramfs")?;
    let deadline = std::time::Duration::from_secs(300);
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "rock-5b under QEMU virt: no end after {} s; serial log {}",
                deadline.as_secs(),
                log.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let console = String::from_utf8_lossy(&std::fs::read(log)?).into_owned();
    let (report, line) = Report::from_console(&console)
        .with_context(|| format!("rock-5b under QEMU virt: serial log {}", log.display()))?;
    Ok((console, report, line))
}

/// The report's failures must be [`EMULATION_FAILS`] (each for its reason alone) plus `also`,
/// give or take the [`EMULATION_HOST_SPEED`] checks, which must have run: their statuses.
fn board_only_failures(
    report: &kiln_runtime::selftest::report::Report,
    also: &[&str],
    log: &Path,
) -> Result<Vec<String>> {
    let mut host_speed = Vec::new();
    for id in EMULATION_HOST_SPEED {
        let c = report
            .checks
            .iter()
            .find(|c| c.id == *id)
            .with_context(|| format!("rock-5b under QEMU virt: no {id} in the report"))?;
        ensure!(
            c.evidence.iter().any(|e| e.contains("GB/s")),
            "rock-5b under QEMU virt: {id} measured nothing: {:?}",
            c.evidence
        );
        host_speed.push(format!(
            "{id} {} ({})",
            c.status.word().to_uppercase(),
            c.evidence.join(" ")
        ));
    }
    let failed: Vec<String> = report
        .failed_ids()
        .into_iter()
        .filter(|id| !EMULATION_HOST_SPEED.contains(id))
        .map(|id| id.to_string())
        .collect();
    let mut want: Vec<&str> = EMULATION_FAILS.iter().map(|(id, _)| *id).collect();
    want.extend(also);
    let mut sorted_failed = failed.clone();
    sorted_failed.sort();
    want.sort();
    ensure!(
        sorted_failed == want,
        "rock-5b under QEMU virt: the failed checks are {failed:?}, not the board-only {want:?}; \
         serial log {}",
        log.display()
    );
    for (id, why) in EMULATION_FAILS {
        let c = report
            .checks
            .iter()
            .find(|c| c.id == *id)
            .context("a failed check is missing")?;
        let reason = c.reason.as_deref().unwrap_or("");
        ensure!(
            reason.contains(why),
            "rock-5b under QEMU virt: {id} failed for another reason than the board's ({why}): \
             {reason}"
        );
        // image.manifest: the command line is its only complaint (every hash held).
        ensure!(
            !reason.contains(';'),
            "rock-5b under QEMU virt: {id} failed for more than the board's reason: {reason}"
        );
    }
    Ok(host_speed)
}

/// rock-5b's modules against kmod: `depmod -b` over the unpacked package, then `modprobe -d
/// --show-depends` for the recipe's list gives the same files as the manifest's closure; each file's
/// sha256 is that of `xz -dc` of the package's; the initramfs holds them with modules.dep and the
/// list init loads.
fn rock5b_modules(
    sh: &xshell::Shell,
    manifest: &Value,
    unpacked: &Path,
    release: &str,
) -> Result<()> {
    let km = &manifest["kernel_modules"];
    let files = km["files"]
        .as_array()
        .context("manifest: no kernel_modules.files")?;
    let ours: std::collections::BTreeMap<String, String> = files
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap_or_default().to_string(),
                f["sha256"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let base = unpacked.join("usr");
    cmd!(sh, "depmod -b {base} {release}").run()?;
    let prefix = format!("{}/lib/modules/{release}/", base.display());
    let mut theirs = std::collections::BTreeSet::new();
    for m in km["load"]
        .as_array()
        .context("manifest: no kernel_modules.load")?
    {
        let m = m.as_str().unwrap_or_default();
        let out = cmd!(sh, "modprobe -d {base} -S {release} --show-depends {m}").read()?;
        for l in out.lines() {
            let p = l
                .strip_prefix("insmod ")
                .with_context(|| format!("modprobe --show-depends {m}: {l}"))?
                .trim();
            let rel = p
                .strip_prefix(&prefix)
                .with_context(|| format!("{p} is not under {prefix}"))?;
            theirs.insert(format!(
                "/lib/modules/{release}/{}",
                rel.trim_end_matches(".xz")
            ));
        }
    }
    let ours_set: std::collections::BTreeSet<String> = ours.keys().cloned().collect();
    ensure!(
        ours_set == theirs,
        "the module closure differs from kmod's modprobe --show-depends: only ours {:?}, only kmod's {:?}",
        ours_set.difference(&theirs).collect::<Vec<_>>(),
        theirs.difference(&ours_set).collect::<Vec<_>>()
    );
    for (path, sha) in &ours {
        let xz = base.join(format!("{}.xz", path.trim_start_matches('/')));
        let ko = cmd!(sh, "xz -dc {xz}").output()?.stdout;
        ensure!(
            Sha256::of_bytes(&ko).to_string() == *sha,
            "{path}: the manifest's sha256 {sha} is not that of xz -dc of the package's file"
        );
    }
    let initramfs = &manifest["initramfs"]["files"];
    for p in [
        format!("/lib/modules/{release}/modules.dep"),
        format!("/{}", super::steps::MODULES_LIST),
    ]
    .iter()
    .chain(ours.keys())
    {
        ensure!(initramfs.get(p).is_some(), "the initramfs has no {p}");
    }
    println!(
        "image-checks: rock-5b's {} modules ({} listed; {} bytes, {} as .ko.xz) are kmod's modprobe --show-depends closure, each the package's file decompressed",
        ours.len(),
        km["load"].as_array().map(|a| a.len()).unwrap_or(0),
        km["bytes"],
        km["xz_bytes"]
    );
    Ok(())
}

/// Which leaves of two manifests differ (JSON paths), at most `max`.
pub fn json_diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>, max: usize) {
    if out.len() >= max || a == b {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                json_diff(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &format!("{path}/{k}"),
                    out,
                    max,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                json_diff(p, q, &format!("{path}[{i}]"), out, max);
            }
        }
        _ => out.push(format!("{path}: {a} vs {b}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_diff_names_the_differing_file() {
        let a = serde_json::json!({"initramfs": {"files": {"/usr/bin/kiln": {"sha256": "aa"}, "/init": {"sha256": "bb"}}}});
        let b = serde_json::json!({"initramfs": {"files": {"/usr/bin/kiln": {"sha256": "cc"}, "/init": {"sha256": "bb"}}}});
        let mut d = Vec::new();
        json_diff(&a, &b, "", &mut d, 10);
        assert_eq!(
            d,
            vec!["/initramfs/files//usr/bin/kiln/sha256: \"aa\" vs \"cc\"".to_string()]
        );
    }
}
