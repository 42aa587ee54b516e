//! The RK3588 boot loader of a board image, built alone and judged: `cargo xtask bootloader`
//! (build the recipe's `[bootloader]`, optionally twice to compare) and the checks of a disk
//! image's loader region — the boot ROM's `RKNS` header at LBA 64, a FIT inside the loader that
//! loads U-Boot and the pinned BL31, the GPT's first partition after the loader's last byte — and
//! the `u-boot` test stage, which shows each check failing on an image broken on purpose.

use super::board::Board;
use crate::bootloader::{self, BootloaderOut, LOADER_LBA, PRODUCTS};
use crate::pins::{self, identity, Cache, Sha256};
use anyhow::{bail, ensure, Context, Result};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use xshell::cmd;

/// Where `u-boot-rockchip-spi.bin` holds the boot header (the boot ROM reads the SPI NOR's
/// header at 32 KiB; U-Boot's FIT is at 0x60000).
const SPI_HEADER_OFFSET: usize = 0x8000;

#[derive(clap::Args)]
pub struct Args {
    /// Board recipe under `images/` with a `[bootloader]` table.
    #[arg(long, default_value = "rock-5b")]
    pub board: String,
    /// Use the download cache alone.
    #[arg(long)]
    pub offline: bool,
    /// Build a second time from a clean tree and require the same bytes.
    #[arg(long)]
    pub twice: bool,
}

pub fn run(args: Args) -> Result<()> {
    let board = Board::load(&args.board)?;
    let (first, bl31) = build(&board, args.offline, false)?;
    let loader = std::fs::read(first.product(PRODUCTS[0]))?;
    let found = check_loader(&loader, &bl31)?;
    println!("bootloader: {}: {found}", PRODUCTS[0]);
    if args.twice {
        let (second, _) = build(&board, args.offline, true)?;
        same_bytes(&first, &second)?;
    }
    for (n, h) in &first.products {
        println!("bootloader: {} sha256 {h}", first.product(n).display());
    }
    Ok(())
}

/// Both builds' products are byte-identical.
fn same_bytes(a: &BootloaderOut, b: &BootloaderOut) -> Result<()> {
    for ((n, x), (_, y)) in a.products.iter().zip(&b.products) {
        ensure!(
            x == y,
            "U-Boot is not reproducible: {n} is {x} in one build and {y} in the next"
        );
    }
    println!(
        "bootloader: two clean builds, same bytes: {}",
        a.products
            .iter()
            .map(|(n, h)| format!("{n} {}", h.short()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Resolve the `[bootloader]` inputs of `board` alone and build (or reuse, unless `fresh`). Also
/// returns the BL31 ELF that went in, read from its pinned package.
pub fn build(board: &Board, offline: bool, fresh: bool) -> Result<(BootloaderOut, Vec<u8>)> {
    let spec = board
        .bootloader
        .as_ref()
        .with_context(|| format!("{} has no [bootloader]", board.path.display()))?;
    let cache = Cache::user()?;
    let all = pins::inputs_of(&board.pin_files())?;
    let mut want = Vec::new();
    for n in [&spec.source, &spec.bl31, &spec.tpl] {
        want.push(
            all.iter()
                .find(|i| &i.name == n)
                .with_context(|| format!("[bootloader] input {n} is not declared"))?,
        );
    }
    let got = pins::resolve_all(&cache, &want, offline, &pins::apt_fetch, pins::FETCH_JOBS);
    let mut files: Vec<(PathBuf, Sha256)> = Vec::new();
    for (i, r) in want.iter().zip(got) {
        let p = r?;
        files.push((p, i.sha256.context("unpinned")?));
    }
    let tools = crate::tools_root::ensure(offline)?;
    let epoch = super::git(&[
        "log",
        "-1",
        "--format=%ct",
        "--",
        &board.path.display().to_string(),
    ])?
    .parse()
    .context("the recipe's commit time")?;
    let inputs = bootloader::Inputs {
        source: (&files[0].0, files[0].1),
        bl31_deb: (&files[1].0, files[1].1),
        tpl: (&files[2].0, files[2].1),
    };
    let out = bootloader::build(spec, &inputs, epoch, &tools, fresh)?;
    let bl31 = crate::archive::with_deb_member(&files[1].0, &spec.bl31_in_deb, |r| {
        let mut v = Vec::new();
        r.read_to_end(&mut v)?;
        Ok(v)
    })?;
    Ok((out, bl31))
}

/// The loader's own checks: the RKNS header, the FIT and its U-Boot, every BL31 segment the
/// pinned ELF's. A one-line account of what was found.
pub fn check_loader(bytes: &[u8], bl31: &[u8]) -> Result<String> {
    let l = identity::rockchip_loader(bytes)?;
    let segs = identity::bl31_in_loader(bytes, &l, bl31)?;
    let uboot = l.with_os("u-boot");
    Ok(format!(
        "RKNS boot header; FIT at {:#x} loading {} (U-Boot {} bytes) and {segs} BL31 segment(s), \
         each the pinned bl31.elf's; loader ends at byte {:#x}",
        l.fit_offset,
        l.images
            .iter()
            .map(|i| format!("{} ({} {})", i.name, i.kind, i.os))
            .collect::<Vec<_>>()
            .join(", "),
        uboot[0].data.len(),
        l.end
    ))
}

/// The loader region of a disk image: the loader at LBA 64 (header, FIT, BL31 as [`check_loader`])
/// and the GPT's first partition (as `sfdisk --json` reads it) after the loader's last byte.
pub fn check_disk(img: &Path, bl31: &[u8]) -> Result<String> {
    let sh = xshell::Shell::new()?;
    let table: serde_json::Value = serde_json::from_str(
        &cmd!(sh, "sfdisk --json {img}")
            .quiet()
            .read()
            .with_context(|| format!("sfdisk --json {}", img.display()))?,
    )?;
    let first = table["partitiontable"]["partitions"]
        .as_array()
        .and_then(|p| p.iter().filter_map(|p| p["start"].as_u64()).min())
        .context("sfdisk lists no partition")?;
    check_region(img, first, bl31)
}

/// [`check_disk`] with the first partition's LBA given (the image build's own layout).
pub fn check_region(img: &Path, first: u64, bl31: &[u8]) -> Result<String> {
    let mut f = std::fs::File::open(img).with_context(|| format!("opening {}", img.display()))?;
    f.seek(SeekFrom::Start(LOADER_LBA * 512))?;
    // Read up to where kiln's first partition belongs (or further, to a later first partition),
    // so that a partition placed over the loader is named as such, not as a cut loader.
    let upto = first.max(super::board::FIRST_PARTITION_LBA);
    let mut region = Vec::new();
    f.take(upto.saturating_sub(LOADER_LBA) * 512)
        .read_to_end(&mut region)?;
    let what = check_loader(&region, bl31)
        .with_context(|| format!("the loader at LBA {LOADER_LBA} of {}", img.display()))?;
    let l = identity::rockchip_loader(&region)?;
    let end_lba = LOADER_LBA + (l.end as u64).div_ceil(512);
    ensure!(
        end_lba <= first,
        "the GPT's first partition starts at LBA {first}, inside the loader (LBA {LOADER_LBA}..{end_lba})"
    );
    Ok(format!(
        "{what}; the loader spans LBA {LOADER_LBA}..{end_lba}, the first partition starts at LBA \
         {first}"
    ))
}

/// A test disk: a GPT (sfdisk) with one partition at `first_lba`, then `loader` at LBA 64.
fn test_disk(dir: &Path, name: &str, loader: &[u8], first_lba: u64) -> Result<PathBuf> {
    let img = dir.join(name);
    let f = std::fs::File::create(&img)?;
    f.set_len(64 << 20)?;
    drop(f);
    let sh = xshell::Shell::new()?;
    let script = format!("label: gpt\nfirst-lba: 34\nstart={first_lba}, size=8192, type=L\n");
    cmd!(sh, "sfdisk --quiet {img}")
        .stdin(script)
        .quiet()
        .run()
        .context("sfdisk")?;
    // Written in place: the rest of the file stays a hole, as in a built image.
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(&img)?;
    f.seek(SeekFrom::Start(LOADER_LBA * 512))?;
    f.write_all(loader)?;
    Ok(img)
}

/// `u-boot-twice` (a long proof): U-Boot from the rock-5b recipe built again from a clean tree
/// has the bytes of the (cached) first build.
pub fn twice_stage() -> Result<()> {
    let board = Board::load("rock-5b")?;
    seed_rkbin(&board)?;
    let (first, _) = build(&board, false, false)?;
    let (second, _) = build(&board, false, true)?;
    same_bytes(&first, &second)
}

/// `u-boot`: build U-Boot from the rock-5b recipe (reused when built with the same key); check the product;
/// a disk with it at LBA 64 passes [`check_disk`] and `cargo xtask flash` writes it to a file
/// whose loader region is the same; then each fault (no RKNS, a FIT without BL31, a BL31 byte
/// changed, a first partition over the loader) makes its check fail, naming it.
pub fn stage() -> Result<()> {
    let board = Board::load("rock-5b")?;
    seed_rkbin(&board)?;
    let (first, bl31) = build(&board, false, false)?;
    let loader = std::fs::read(first.product(PRODUCTS[0]))?;
    println!("u-boot: {}", check_loader(&loader, &bl31)?);
    // The SPI image: the boot ROM reads its header at 32 KiB of the NOR, U-Boot's FIT follows.
    let spi = std::fs::read(first.product(PRODUCTS[1]))?;
    let at = SPI_HEADER_OFFSET;
    ensure!(spi.len() > at, "{} is {} bytes", PRODUCTS[1], spi.len());
    println!(
        "u-boot: {} at {at:#x}: {}",
        PRODUCTS[1],
        check_loader(&spi[at..], &bl31).with_context(|| PRODUCTS[1].to_string())?
    );

    let tmp = tempfile::tempdir()?;
    let good = test_disk(tmp.path(), "good.img", &loader, 32768)?;
    println!("u-boot: disk image: {}", check_disk(&good, &bl31)?);

    // `cargo xtask flash` to a regular file, with a bmap of the sparse image: the loader lands.
    let bmap = tmp.path().join("good.bmap");
    let sh = xshell::Shell::new()?;
    cmd!(sh, "bmaptool create -o {bmap} {good}").quiet().run()?;
    let target = tmp.path().join("card.img");
    std::fs::File::create(&target)?.set_len(64 << 20)?;
    crate::flash::run(crate::flash::Args::onto_file(
        good.clone(),
        target.clone(),
        Some(bmap),
    ))
    .context("cargo xtask flash of the rock-5b loader test disk")?;
    println!(
        "u-boot: after `cargo xtask flash`: {}",
        check_disk(&target, &bl31)?
    );

    // Faults, each on its own copy.
    let expect_fail = |what: &str, r: Result<String>, needle: &str| -> Result<()> {
        match r {
            Ok(s) => bail!("{what}: the check passed: {s}"),
            Err(e) => {
                let e = format!("{e:#}");
                ensure!(
                    e.contains(needle),
                    "{what}: failed, but not naming {needle:?}: {e}"
                );
                println!("u-boot: fault {what}: FAIL as it must: {e}");
                Ok(())
            }
        }
    };
    let l = identity::rockchip_loader(&loader)?;
    // The FIT's own device tree ends where the first image's external data starts.
    let fdt_end = l.images.iter().map(|i| i.data.start).min().unwrap_or(l.end);
    let mut no_rkns = loader.clone();
    no_rkns[0] = b'X';
    let d = test_disk(tmp.path(), "no-rkns.img", &no_rkns, 32768)?;
    expect_fail("boot header", check_disk(&d, &bl31), "RKNS")?;

    let mut no_atf = loader.clone();
    let fit = l.fit_offset;
    let pat = b"arm-trusted-firmware";
    let n = replace_all(&mut no_atf[fit..fdt_end], pat, b"arm-trusted-firmwarX");
    ensure!(n > 0, "the FIT names no arm-trusted-firmware");
    let d = test_disk(tmp.path(), "no-bl31.img", &no_atf, 32768)?;
    expect_fail("FIT without BL31", check_disk(&d, &bl31), "no BL31")?;

    let mut bad_bl31 = loader.clone();
    let atf = l.with_os("arm-trusted-firmware")[0].data.clone();
    bad_bl31[atf.start + atf.len() / 2] ^= 0x01;
    let d = test_disk(tmp.path(), "bl31-flip.img", &bad_bl31, 32768)?;
    expect_fail(
        "BL31 byte changed",
        check_disk(&d, &bl31),
        "is not the pinned BL31",
    )?;

    let mut no_uboot = loader.clone();
    let n = replace_all(&mut no_uboot[fit..fdt_end], b"U-Boot\0", b"U-Boox\0");
    ensure!(n > 0, "the FIT names no os U-Boot");
    let d = test_disk(tmp.path(), "no-u-boot.img", &no_uboot, 32768)?;
    expect_fail(
        "FIT without U-Boot",
        check_disk(&d, &bl31),
        "os = \"u-boot\"",
    )?;

    // The first partition at 1 MiB, as a PC image would have it: over the loader's FIT.
    let d = test_disk(tmp.path(), "overlap.img", &loader, 2048)?;
    expect_fail(
        "first partition over the loader",
        check_disk(&d, &bl31),
        "the GPT's first partition starts at LBA 2048, inside the loader",
    )?;
    Ok(())
}

fn replace_all(hay: &mut [u8], from: &[u8], to: &[u8]) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i + from.len() <= hay.len() {
        if &hay[i..i + from.len()] == from {
            hay[i..i + from.len()].copy_from_slice(to);
            n += 1;
            i += from.len();
        } else {
            i += 1;
        }
    }
    n
}

/// These machines reach no GitHub: the DDR blob and its licence notice go into the cache from
/// the shared copy beside the checkout (`../shared/inputs/rkbin/`, or `KILN_RKBIN_DIR`), as a
/// user would with `cargo xtask pins seed`.
pub fn seed_rkbin(board: &Board) -> Result<()> {
    let spec = board.bootloader.as_ref().context("no [bootloader]")?;
    let dir = std::env::var_os("KILN_RKBIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::paths::project_root().join("../shared/inputs/rkbin"));
    let inputs = pins::inputs_of(&board.pin_files())?;
    let mut files = Vec::new();
    for name in std::iter::once(&spec.tpl).chain(spec.tpl_licence.as_ref()) {
        let input = inputs
            .iter()
            .find(|i| &i.name == name)
            .with_context(|| format!("the input {name}"))?;
        let pins::Source::Url { url } = &input.source else {
            bail!("{} is not a url input", input.name);
        };
        if Cache::user()?
            .get(&input.name, &input.sha256.context("unpinned")?)?
            .is_some()
        {
            continue;
        }
        let file = dir.join(url.rsplit('/').next().unwrap_or_default());
        ensure!(
            file.exists(),
            "{} is not in the cache and {} is missing (set KILN_RKBIN_DIR)",
            input.name,
            file.display()
        );
        files.push(file);
    }
    if files.is_empty() {
        return Ok(());
    }
    pins::seed(&board.pin_files(), &files).map(|_| ())
}
