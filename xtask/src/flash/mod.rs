//! `cargo xtask flash`: write an image to an SD card or eMMC, safely (every check before a byte
//! is written), sparsely (only the ranges its `.bmap` maps) and verified (read back, bypassing the
//! page cache, against the bmap's sha256).

pub mod devices;
pub mod key;
pub mod write;

use crate::bmap::{self, Bmap};
use crate::doctor;
use anyhow::{bail, Context, Result};
use devices::{assess, Host, Policy};
use std::io::{BufRead, Write as _};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use write::{Extent, Source, Target};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The image: raw `.img`, or `.img.zst`, `.img.gz`, `.img.xz` (decompressed as it is written).
    #[arg(long)]
    pub image: PathBuf,
    /// The whole-disk device (`/dev/sdX`, `/dev/mmcblkN`, a `/dev/disk/by-id/…` link), or a
    /// regular file. Without it the candidates are listed and you choose.
    #[arg(long)]
    pub device: Option<PathBuf>,
    /// The block map; default: `<raw image>.bmap`, then `<raw image without .img>.bmap`.
    /// Without one the whole image is written.
    #[arg(long)]
    pub bmap: Option<PathBuf>,
    /// Do not ask to type the device name (for scripts).
    #[arg(long)]
    pub yes: bool,
    /// Skip the read-back.
    #[arg(long)]
    pub no_verify: bool,
    /// Check everything and print the plan; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Allow loop devices (tests, benches).
    #[arg(long)]
    pub allow_loop: bool,
    /// Allow a disk that is neither removable, hot-plugged, USB nor MMC.
    #[arg(long)]
    pub force_non_removable: bool,
    /// Allow a disk over 256 GB.
    #[arg(long)]
    pub force_large: bool,
    /// Refuse unless the device reports this serial number (for scripts that use `--yes`).
    #[arg(long)]
    pub expect_serial: Option<String>,
    /// The board's own API key (one line, 16–4096 visible characters, checked before a byte is
    /// written): written after the image, and verified, to the data partition as
    /// `/data/kiln/api-key` (mode 0600), where `kiln serve` looks for it; a board serves beyond
    /// loopback only with it (or where its recipe says `insecure = true`). The image stays the same
    /// for every board; to rotate a key, flash again or write the file by hand.
    #[arg(long, value_name = "FILE")]
    pub api_key: Option<PathBuf>,
    /// The board's hawkBit target token (one line): written after the image, and verified, to
    /// the data partition as `/data/kiln/fleet-token` (mode 0600), where `kiln fleet` looks for it
    /// (the recipe's `[fleet] token_file` default); without it the client says so and stops.
    /// Never in the image.
    #[arg(long, value_name = "FILE")]
    pub fleet_token: Option<PathBuf>,
    /// Test hook: flip the byte at this offset on the target between write and verify.
    #[arg(long, hide = true)]
    pub test_corrupt_at: Option<u64>,
    /// Test hook: stop writing after this many ranges (an interrupted write), then verify.
    #[arg(long, hide = true)]
    pub test_stop_after: Option<usize>,
}

/// The raw image's name without a compression suffix.
fn raw_name(image: &Path) -> PathBuf {
    match write::compression_of(image) {
        write::Compression::None => image.to_path_buf(),
        _ => image.with_extension(""),
    }
}

fn find_bmap(args: &Args) -> Option<PathBuf> {
    if let Some(b) = &args.bmap {
        return Some(b.clone());
    }
    let raw = raw_name(&args.image);
    let mut with = raw.clone().into_os_string();
    with.push(".bmap");
    let candidates = [PathBuf::from(with), raw.with_extension("bmap")];
    candidates.into_iter().find(|p| p.is_file())
}

/// Block ranges of the bmap as byte extents; or the whole image in 64 MiB pieces.
fn plan(bmap: Option<&Bmap>, image_size: u64) -> Vec<Extent> {
    match bmap {
        Some(b) => b
            .ranges
            .iter()
            .map(|r| {
                let (start, end) = b.byte_span(r);
                Extent {
                    start,
                    end,
                    sha256: Some(r.sha256),
                }
            })
            .collect(),
        None => {
            const PIECE: u64 = 64 << 20;
            (0..image_size.div_ceil(PIECE))
                .map(|i| Extent {
                    start: i * PIECE,
                    end: ((i + 1) * PIECE).min(image_size),
                    sha256: None,
                })
                .collect()
        }
    }
}

enum Dest {
    Block { path: PathBuf, name: String },
    File(PathBuf),
}

/// `--device` as a block device (by kernel name) or a regular file.
fn resolve(dev: &Path) -> Result<Dest> {
    match std::fs::canonicalize(dev) {
        Ok(real) => {
            let md =
                std::fs::metadata(&real).with_context(|| format!("stat {}", real.display()))?;
            if md.file_type().is_block_device() {
                let name = real
                    .file_name()
                    .with_context(|| format!("{} has no name", real.display()))?
                    .to_string_lossy()
                    .into_owned();
                Ok(Dest::Block { path: real, name })
            } else if md.is_file() {
                Ok(Dest::File(real))
            } else {
                bail!(
                    "{} is neither a block device nor a regular file",
                    dev.display()
                )
            }
        }
        Err(_) if !dev.starts_with("/dev") => Ok(Dest::File(dev.to_path_buf())),
        Err(e) => Err(e).with_context(|| format!("no such device {}", dev.display())),
    }
}

fn describe(host: &Host, d: &devices::BlockDev) -> String {
    let ids = host
        .by_id
        .get(&d.name)
        .and_then(|v| v.first())
        .map(|s| format!("/dev/disk/by-id/{s}"))
        .unwrap_or_else(|| "(no by-id name)".into());
    format!(
        "/dev/{:<10} {:>9}  {:<5} {:<26} {}",
        d.name,
        devices::human(d.size),
        d.tran.as_deref().unwrap_or("-"),
        d.model.as_deref().unwrap_or("-").trim(),
        ids
    )
}

fn prompt(q: &str) -> Result<String> {
    print!("{q}");
    std::io::stdout().flush()?;
    let mut line = String::new();
    let n = std::io::stdin()
        .lock()
        .read_line(&mut line)
        .context("reading the answer from stdin")?;
    if n == 0 {
        bail!("no answer on stdin: pass --device (and --yes) when not interactive");
    }
    Ok(line.trim().to_string())
}

/// List the devices, the writable ones numbered, and ask which.
fn choose(host: &Host, policy: &Policy) -> Result<String> {
    let survey = devices::survey(host, policy);
    let ok: Vec<&devices::BlockDev> = survey
        .iter()
        .filter(|(_, v)| v.is_ok())
        .map(|(d, _)| *d)
        .collect();
    println!("Devices that may be written:");
    if ok.is_empty() {
        println!("  (none)");
    }
    for (i, d) in ok.iter().enumerate() {
        println!("  {}) {}", i + 1, describe(host, d));
    }
    let refused: Vec<_> = survey.iter().filter(|(_, v)| v.is_err()).collect();
    if !refused.is_empty() {
        println!("Refused:");
        for (d, v) in refused {
            if let Err(why) = v {
                let why: Vec<String> = why.iter().map(|r| r.to_string()).collect();
                println!("  /dev/{}: {}", d.name, why.join("; "));
            }
        }
    }
    if ok.is_empty() {
        bail!("no device may be written (insert a card, or see the reasons above)");
    }
    let a = prompt("Which device? (number or name, empty to cancel): ")?;
    if a.is_empty() {
        bail!("cancelled");
    }
    if let Ok(k) = a.parse::<usize>() {
        if let Some(d) = k.checked_sub(1).and_then(|k| ok.get(k)) {
            return Ok(d.name.clone());
        }
        bail!("no device number {k}");
    }
    Ok(a.trim_start_matches("/dev/").to_string())
}

/// What a flash took, for `bench flash`.
pub struct Summary {
    pub written_bytes: u64,
    pub write: std::time::Duration,
    pub verify: Option<std::time::Duration>,
}

impl Args {
    /// `cargo xtask flash --image IMAGE --device TARGET [--bmap BMAP] --yes` as the tests run it:
    /// onto a regular file, read back and verified, with no test hooks.
    pub fn onto_file(image: PathBuf, target: PathBuf, bmap: Option<PathBuf>) -> Args {
        Args {
            image,
            device: Some(target),
            bmap,
            yes: true,
            no_verify: false,
            dry_run: false,
            allow_loop: false,
            force_non_removable: false,
            force_large: false,
            expect_serial: None,
            api_key: None,
            fleet_token: None,
            test_corrupt_at: None,
            test_stop_after: None,
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    flash(args).map(|_| ())
}

/// Refuse, before the prompt and before a byte is written, a device this process may not read
/// and write, naming what is missing: root, or write access through the device's group.
fn may_write(dev: &Path) -> Result<()> {
    use nix::unistd::{access, AccessFlags};
    match access(dev, AccessFlags::R_OK | AccessFlags::W_OK) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::EACCES | nix::errno::Errno::EPERM) => {
            let md = std::fs::metadata(dev).with_context(|| format!("{}", dev.display()))?;
            let groups = nix::unistd::getgroups().unwrap_or_default();
            let mine = |gid: u32| {
                nix::unistd::getegid().as_raw() == gid || groups.iter().any(|g| g.as_raw() == gid)
            };
            let name = |gid: u32| {
                nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
                    .ok()
                    .flatten()
                    .map(|g| g.name)
                    .unwrap_or_else(|| gid.to_string())
            };
            bail!(
                "{}",
                permission_refusal(
                    dev,
                    nix::unistd::geteuid().as_raw(),
                    md.uid(),
                    &name(md.gid()),
                    mine(md.gid()),
                    md.mode()
                )
            )
        }
        Err(e) => Err(e).with_context(|| format!("checking access to {}", dev.display())),
    }
}

/// The refusal for a device `dev` (owner `owner`, group `group`, `mode`) that user `uid` may not
/// write; `in_group`: the user is in `group`.
fn permission_refusal(
    dev: &Path,
    uid: u32,
    owner: u32,
    group: &str,
    in_group: bool,
    mode: u32,
) -> String {
    let way = if mode & 0o060 == 0o060 && !in_group {
        format!(
            "you are not in its group `{group}`, which may write it: `sudo usermod -aG {group} \
             $USER` and log in again, or run kiln as root"
        )
    } else if mode & 0o060 == 0o060 {
        format!(
            "you are in its group `{group}`, but this session is not yet (log in again), or a \
             security module refuses it"
        )
    } else {
        "its group may not write it: run kiln as root, or grant your user access to it (e.g. a \
         udev rule)"
            .to_string()
    };
    format!(
        "refusing to write {}: permission denied for uid {uid} (the device is owner uid {owner}, \
         group `{group}`, mode {:04o}): {way}. kiln never escalates by itself",
        dev.display(),
        mode & 0o7777
    )
}

pub fn flash(args: Args) -> Result<Summary> {
    doctor::ensure(&[&doctor::LSBLK])?;
    // Checked before a byte is written.
    let api_key = match &args.api_key {
        Some(f) => Some(key::read_key(f)?),
        None => None,
    };
    let fleet_token = match &args.fleet_token {
        Some(f) => Some(key::read_token(f)?),
        None => None,
    };
    let image = std::fs::canonicalize(&args.image)
        .with_context(|| format!("image {}", args.image.display()))?;
    let bmap = match find_bmap(&args) {
        Some(p) => Some(bmap::parse(&p)?),
        None => None,
    };
    let image_size = match &bmap {
        Some(b) => b.image_size,
        None => Source::measure(&image)?,
    };
    if bmap.is_none() {
        println!(
            "flash: no bmap next to {}: writing all {} bytes",
            image.display(),
            image_size
        );
    }
    if (api_key.is_some() || fleet_token.is_some())
        && write::compression_of(&image) == write::Compression::None
    {
        key::check_image(&image)?;
    }
    let raw_len = std::fs::metadata(&image)?.len();
    if write::compression_of(&image) == write::Compression::None && raw_len != image_size {
        bail!(
            "{} is {raw_len} bytes but its bmap says {image_size}: they do not belong together",
            image.display()
        );
    }
    let policy = Policy {
        allow_loop: args.allow_loop,
        force_non_removable: args.force_non_removable,
        force_large: args.force_large,
        image_size,
    };
    let dest = match &args.device {
        Some(d) => resolve(d)?,
        None => {
            let host = devices::gather(&image)?;
            let name = choose(&host, &policy)?;
            resolve(&Path::new("/dev").join(name))?
        }
    };
    let (target_path, is_block) = match &dest {
        Dest::Block { path, name } => {
            let host = devices::gather(&image)?;
            let d = assess(&host, name, &policy).map_err(|why| {
                let why: Vec<String> = why.iter().map(|r| format!("  - {r}")).collect();
                anyhow::anyhow!("refusing to write {}:\n{}", path.display(), why.join("\n"))
            })?;
            if let Some(want) = &args.expect_serial {
                let got = d.serial.as_deref().unwrap_or("").trim();
                if got != want.trim() {
                    bail!(
                        "refusing to write {}: its serial is {got:?}, not the expected {want:?}",
                        path.display()
                    );
                }
            }
            println!("target: {}", describe(&host, d));
            if let Some(s) = &d.serial {
                println!("        serial {s}");
            }
            // As an ordinary user: the device opens if the user may write it, else a refusal
            // that names the permission; kiln never escalates by itself. A dry run says so and
            // still shows its plan.
            match may_write(path) {
                Err(e) if args.dry_run => println!("flash: dry run: a real run would stop: {e:#}"),
                r => r?,
            }
            if !args.yes && !args.dry_run {
                let a = prompt(&format!(
                    "Everything on /dev/{name} will be overwritten. Type `{name}` to go on: "
                ))?;
                if a.trim_start_matches("/dev/") != name {
                    bail!("you typed {a:?}, not {name:?}: nothing written");
                }
            }
            (path.clone(), true)
        }
        Dest::File(p) => {
            if let Ok(md) = std::fs::metadata(p) {
                let im = std::fs::metadata(&image)?;
                if md.dev() == im.dev() && md.ino() == im.ino() {
                    bail!("{} is the image itself", p.display());
                }
            }
            println!("target: regular file {}", p.display());
            (p.clone(), false)
        }
    };
    let plan = plan(bmap.as_ref(), image_size);
    let mapped = bmap.as_ref().map_or(image_size, Bmap::mapped_bytes);
    println!(
        "plan: {} range(s), {} of {} ({}), from {}",
        plan.len(),
        devices::human(mapped),
        devices::human(image_size),
        if bmap.is_some() { "bmap" } else { "no bmap" },
        image.display()
    );
    if args.dry_run {
        println!("dry run: nothing written");
        return Ok(Summary {
            written_bytes: 0,
            write: std::time::Duration::ZERO,
            verify: None,
        });
    }
    let mut target = Target::open(&target_path, is_block)?;
    if is_block {
        let size = target.device_size()?;
        if size < image_size {
            bail!(
                "{} is {size} bytes, smaller than the image ({image_size})",
                target_path.display()
            );
        }
    }
    let mut src = Source::open(&image)?;
    let w = write::write(&mut src, &mut target, &plan, args.test_stop_after)?;
    let secs = w.elapsed.as_secs_f64();
    println!(
        "wrote {} in {secs:.2} s ({:.1} MB/s)",
        devices::human(w.bytes),
        w.bytes as f64 / 1e6 / secs.max(1e-9)
    );
    if let Some(off) = args.test_corrupt_at {
        println!("flash: test hook: flipping the byte at offset {off} on the target");
        target.corrupt_byte(off)?;
    }
    let mut result = Ok(());
    let mut verify_time = None;
    if args.no_verify {
        println!("verify skipped (--no-verify)");
    } else {
        // Extents the bmap does not hash take the hash computed while writing; an extent that
        // was never written (interrupted) keeps the bmap's, or none, and fails.
        let mut check = plan.clone();
        for (c, w) in check.iter_mut().zip(&w.written) {
            if c.sha256.is_none() {
                c.sha256 = w.sha256;
            }
        }
        match write::verify(&target_path, is_block, &check, &image) {
            Ok(v) => {
                verify_time = Some(v.elapsed);
                let secs = v.elapsed.as_secs_f64();
                println!(
                    "verified {} in {secs:.2} s ({:.1} MB/s): every range matches",
                    devices::human(v.bytes),
                    v.bytes as f64 / 1e6 / secs.max(1e-9)
                );
            }
            Err(e) => result = Err(e),
        }
    }
    if is_block {
        if let Err(e) = target.reread_partitions() {
            let name = target_path.file_name().map(|n| n.to_string_lossy());
            if name.is_some_and(|n| n.starts_with("loop")) {
                println!("flash: partition table not re-read ({e:#}): a loop device without -P");
            } else {
                println!(
                    "flash: warning: {e:#} (the kernel keeps the old partition table until \
                     the card is re-inserted)"
                );
            }
        }
    }
    result?;
    if let Some(k) = &api_key {
        key::provision(&target_path, k)?;
        println!(
            "flash: the API key is on the data partition as /data/{} (mode 0600, read back \
             equal, e2fsck clean)",
            key::KEY_PATH
        );
    }
    if let Some(t) = &fleet_token {
        key::provision_file(&target_path, key::FLEET_TOKEN_PATH, t)?;
        println!(
            "flash: the fleet token is on the data partition as /data/{} (mode 0600, read back \
             equal, e2fsck clean)",
            key::FLEET_TOKEN_PATH
        );
    }
    println!("flash: done: {}", target_path.display());
    Ok(Summary {
        written_bytes: w.bytes,
        write: w.elapsed,
        verify: verify_time,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_the_user_may_not_write_is_refused_naming_the_way() {
        let dev = Path::new("/dev/sdz");
        let r = permission_refusal(dev, 1000, 0, "disk", false, 0o60660);
        assert!(
            r.contains("/dev/sdz")
                && r.contains("uid 1000")
                && r.contains("mode 0660")
                && r.contains("not in its group `disk`")
                && r.contains("usermod -aG disk")
                && r.contains("never escalates"),
            "{r}"
        );
        let r = permission_refusal(dev, 1000, 0, "disk", true, 0o60660);
        assert!(r.contains("log in again") && !r.contains("usermod"), "{r}");
        let r = permission_refusal(dev, 1000, 0, "root", false, 0o60600);
        assert!(r.contains("its group may not write it"), "{r}");
    }

    #[test]
    fn plan_without_bmap_covers_the_image_exactly() {
        let p = plan(None, 200 << 20 | 123);
        assert_eq!(p.first().map(|e| e.start), Some(0));
        assert_eq!(p.last().map(|e| e.end), Some(200 << 20 | 123));
        assert!(p.windows(2).all(|w| w[0].end == w[1].start));
        assert!(p.iter().all(|e| e.sha256.is_none()));
    }

    #[test]
    fn bmap_is_found_beside_the_raw_or_compressed_image() {
        assert_eq!(raw_name(Path::new("a/k.img.zst")), PathBuf::from("a/k.img"));
        assert_eq!(raw_name(Path::new("a/k.img")), PathBuf::from("a/k.img"));
    }
}
