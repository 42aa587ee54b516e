//! `cargo xtask image`: a bootable, bit-for-bit reproducible disk image for a board, from pinned
//! inputs: kernel (from source + fragment), initramfs root filesystem, GPT with a FAT32 boot
//! partition, an erofs models partition and an empty ext4 data partition; then the bmap, the
//! sha256 and the manifest. Every step whose inputs did not change is reused, and says so.

pub mod bench;
pub mod board;
pub mod bootscr;
pub mod checks;
mod context;
pub mod fixture;
mod known;
pub mod layout;
pub mod loader;
mod runner;
mod steps;
pub mod updates;

use crate::pins::{self, Cache, Input, Sha256};
use anyhow::{bail, Context, Result};
use board::Board;
use runner::Runner;
use std::collections::BTreeMap;
use std::path::PathBuf;
use xshell::cmd;

/// Every resolved input of a board by name: the pin and its file in the cache.
pub type Inputs = BTreeMap<String, (Input, PathBuf)>;

#[derive(clap::Args)]
pub struct Args {
    /// Board recipe under `images/` (qemu-virt, rock-5b, rock-5b-vendor).
    #[arg(long, default_value = "qemu-virt")]
    pub board: String,
    /// A GGUF model to put on the models partition (repeatable).
    #[arg(long = "model")]
    pub models: Vec<PathBuf>,
    /// Build from the download cache alone; list what is missing.
    #[arg(long)]
    pub offline: bool,
    /// Let an image of a real board trust kiln's public development update key (anyone can sign
    /// a bundle it installs): for a board on your desk, never a fleet. Without it such a build
    /// stops; `cargo xtask keys new` makes a fleet's own.
    #[arg(long)]
    pub dev_keys: bool,
}

pub fn run(args: Args) -> Result<()> {
    let b = build(&args)?;
    println!(
        "image: {} ({:.1} MiB, initramfs {:.2} MiB, sha256 {}, manifest sha256 {}) in {:.1} s{}",
        b.image.display(),
        b.size as f64 / 1048576.0,
        b.initramfs_size as f64 / 1048576.0,
        b.sha256,
        b.manifest_sha256,
        b.seconds,
        if b.reused.is_empty() {
            String::new()
        } else {
            format!(", {} of {} steps reused", b.reused.len(), b.steps)
        }
    );
    Ok(())
}

/// What a build produced.
pub struct Built {
    pub image: PathBuf,
    pub bmap: PathBuf,
    pub manifest: PathBuf,
    pub sha256: Sha256,
    /// sha256 of the boot partition's `kiln/manifest.json`: the `manifest=` of the verdict line.
    pub manifest_sha256: Sha256,
    pub size: u64,
    pub initramfs_size: u64,
    pub seconds: f64,
    /// How many steps ran, and the names of those that were reused rather than redone.
    pub steps: usize,
    pub reused: Vec<String>,
    /// The boot slot's file system image (`boot.vfat`, the same bytes in `boot_a` and
    /// `boot_b`): what a bundle carries.
    pub boot_fs: PathBuf,
    /// The commit the image is of, and its time (`SOURCE_DATE_EPOCH`).
    pub commit: Commit,
}

fn git(args: &[&str]) -> Result<String> {
    let sh = crate::paths::shell()?;
    Ok(cmd!(sh, "git {args...}")
        .quiet()
        .read()
        .with_context(|| format!("git {}", args.join(" ")))?
        .trim()
        .to_string())
}

/// The commit, its time (`SOURCE_DATE_EPOCH`) and whether the tree has uncommitted changes.
#[derive(Clone, Debug)]
pub struct Commit {
    pub hash: String,
    pub epoch: i64,
    pub kernel_epoch: i64,
    pub dirty: bool,
}

/// The commit's identity and timestamps, for `board`.
pub fn commit_info(board: &Board) -> Result<Commit> {
    let hash = git(&["rev-parse", "HEAD"])?;
    let epoch: i64 = git(&["log", "-1", "--format=%ct"])?
        .parse()
        .context("commit time")?;
    // The kernel's timestamp is the last commit that touched its own files (its pins and its
    // fragment), so that a commit that changes only the runtime, or another board's kernel,
    // reuses it (still one value per commit, still reproducible).
    let kernel = &board.kernel;
    let own = [
        format!("kernel-config/{}", kernel.name),
        format!("kernel-config/{}", kernel.fragment),
    ];
    let kernel_epoch = git(&["log", "-1", "--format=%ct", "--", &own[0], &own[1]])?
        .parse()
        .unwrap_or(epoch);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    Ok(Commit {
        hash,
        epoch,
        kernel_epoch,
        dirty,
    })
}

/// Resolve every pinned input of the board (cache, else download unless offline). Every input
/// that cannot be had is listed, each with how to provide it.
pub fn resolve_inputs(board: &Board, cache: &Cache, offline: bool) -> Result<Inputs> {
    let mut out = BTreeMap::new();
    let mut missing = Vec::new();
    let inputs = pins::inputs_of(&board.pin_files())?;
    let refs: Vec<&pins::Input> = inputs.iter().collect();
    let got = pins::resolve_all(cache, &refs, offline, &pins::apt_fetch, pins::FETCH_JOBS);
    for (i, r) in inputs.iter().zip(got) {
        match r {
            Ok(p) => {
                out.insert(i.name.clone(), (i.clone(), p));
            }
            Err(e) => missing.push(format!("{e:#}")),
        }
    }
    if !missing.is_empty() {
        bail!(
            "cannot build {}: {} input(s) missing:\n  - {}",
            board.name,
            missing.len(),
            missing.join("\n  - ")
        );
    }
    Ok(out)
}

/// `extlinux/extlinux.conf`: no `menu` lines (U-Boot 2023.01 then waits at a prompt forever);
/// `${kiln_args}` is expanded by U-Boot from its environment (the boot test sets it).
pub fn extlinux_conf(board: &Board, dtb: Option<&str>) -> String {
    let fdt = dtb.map(|d| format!("    fdt /{d}\n")).unwrap_or_default();
    format!(
        "default kiln\nprompt 0\ntimeout 1\nlabel kiln\n    kernel /Image\n    initrd /initramfs.cpio.gz\n\
         {fdt}    append {}\n",
        append_line(board)
    )
}

/// The kernel command line of every slot, as extlinux.conf's `append` (and `boot.scr`'s direct
/// boot, for a U-Boot without `sysboot`) gives it: U-Boot expands `${kiln_slot}` and `${kiln_args}`.
pub fn append_line(board: &Board) -> String {
    format!(
        "console={} panic=-1 rauc.slot=${{kiln_slot}} ${{kiln_args}}",
        board.console
    )
}

/// Build the image of `args.board`: the steps in the order the data flows, each one product
/// (see `steps.rs`), reused by the runner when its key is unchanged.
pub fn build(args: &Args) -> Result<Built> {
    let (mut run, ctx, models) = prepare(args)?;
    let system = system(&mut run, &ctx)?;
    let data = data_side(&mut run, &ctx, &models)?;
    let layout = steps::layout(&ctx, &data.models_part)?;
    let blobs = steps::blobs(&ctx, system.uboot.as_ref())?;
    let (manifest, boot_part) =
        boot_slot(&mut run, &ctx, &models, &system, &data, &layout, &blobs)?;
    let bootctl_part = run.run(steps::bootctl_partition(&ctx)?)?;
    // Both boot slots hold the same system: the same file system image, byte for byte. The
    // models slots: the factory one, and one holding no models.
    let parts = [
        &bootctl_part,
        &boot_part,
        &boot_part,
        &data.models_part,
        &data.models_b_part,
        &data.data_part,
    ];
    let out_dir = crate::paths::target_dir().join("images");
    std::fs::create_dir_all(&out_dir)?;
    let disk = run.run(steps::disk_image(&ctx, &out_dir, &layout, parts, &blobs)?)?;
    if let Some(b) = &system.uboot {
        loader_outputs(&mut run, &ctx, b, &layout, disk.path(), &out_dir)?;
    }
    let bmap = run.run(steps::bmap(&disk))?;
    let manifest = run.run(steps::manifest_file(
        &out_dir,
        manifest,
        &disk,
        parts,
        layout.total_size,
    )?)?;
    run.run(steps::sboms(&manifest, &ctx.board.name)?)?;

    run.summary();
    Ok(Built {
        sha256: steps::image_sha256(&disk)?,
        manifest_sha256: steps::boot_manifest_sha256(&manifest)?,
        image: disk.path().to_path_buf(),
        bmap: bmap.path().to_path_buf(),
        manifest: manifest.path().to_path_buf(),
        size: layout.total_size,
        initramfs_size: std::fs::metadata(system.initramfs.path())?.len(),
        seconds: run.elapsed(),
        steps: run.done.len(),
        reused: run.reused(),
        boot_fs: boot_part.path().to_path_buf(),
        commit: ctx.commit.clone(),
    })
}

/// What [`models_slot`] built: a models slot as the image builds its factory one, and the
/// self-check's known answers for its models.
pub struct ModelsBuilt {
    /// The slot's bytes (erofs, hash tree, the factory-style trailer with no answers).
    pub slot: PathBuf,
    /// `known_answers` as the image's manifest records them (`nll`, `matmul`), for these models
    /// and the self-check's fixtures, computed by the same steps.
    pub known_answers: serde_json::Map<String, serde_json::Value>,
    pub commit: Commit,
}

/// A models slot of `args.models` and the self-check's fixtures, with their known answers,
/// built by the image's own steps (`cargo xtask bundle --models`) and nothing of the system.
/// Its products live beside the image's, not over them.
pub fn models_slot(args: &Args) -> Result<ModelsBuilt> {
    let (mut run, ctx, models) = prepare_in(args, Some("models-bundle"))?;
    let fixture = fixture::gguf().context("writing the self-check fixture")?;
    let llama = kiln_runtime::model::fixture::gguf().context("writing the llama fixture")?;
    let part = run.run(steps::models_partition(&ctx, &models, &fixture, &llama))?;
    let nll = run.run(steps::known_answers_nll(&ctx, &models, &llama)?)?;
    let fixtures = [
        (fixture::FILE_NAME, fixture.as_slice()),
        (kiln_runtime::model::fixture::FILE_NAME, llama.as_slice()),
    ];
    let matmul = run.run(known::matmul_step(&ctx, &models, &fixtures))?;
    let mut m = serde_json::json!({});
    known::add_matmul(&mut m, &matmul)?;
    steps::manifest_known_answers_nll(&mut m, &nll, &llama)?;
    let serde_json::Value::Object(known_answers) = m["known_answers"].take() else {
        anyhow::bail!("the known answers are not a JSON object");
    };
    run.summary();
    Ok(ModelsBuilt {
        slot: part.path().to_path_buf(),
        known_answers,
        commit: ctx.commit.clone(),
    })
}

/// The board, its keys, the commit, every pinned input and the tools root, checked before any
/// work; the models named; the context every step reads.
fn prepare(args: &Args) -> Result<(Runner, context::Ctx, Vec<steps::Model>)> {
    prepare_in(args, None)
}

/// [`prepare`] with the steps' products under `sub` of the board's work folder (a models
/// bundle's, so that it does not replace the image's own products of the same steps).
fn prepare_in(args: &Args, sub: Option<&str>) -> Result<(Runner, context::Ctx, Vec<steps::Model>)> {
    let board = Board::load(&args.board)?;
    updates::check_keys(&board, args.dev_keys)?;
    let commit = commit_info(&board)?;
    let mut work = crate::paths::target_dir()
        .join("kiln/image")
        .join(&board.name);
    if let Some(sub) = sub {
        work = work.join(sub);
    }
    let run = Runner::new(&work.join("keys"))?;
    run.say(&format!(
        "board {}, commit {}{}, SOURCE_DATE_EPOCH={}",
        board.name,
        &commit.hash[..12],
        if commit.dirty {
            " (with uncommitted changes)"
        } else {
            ""
        },
        commit.epoch
    ));
    // Inputs, all of them before any work, so a missing one stops the build at once.
    let cache = Cache::user()?;
    let inputs = resolve_inputs(&board, &cache, args.offline)?;
    run.say(&format!(
        "{} pinned inputs verified in the cache {}",
        inputs.len(),
        cache.dir.display()
    ));
    let tools = crate::tools_root::ensure(args.offline)?;
    run.say(&format!(
        "tools root {} ({} pinned packages) verified",
        tools.key.short(),
        tools.packages.len()
    ));
    tools.link_cross_builds()?;
    let models = steps::models(&args.models)?;
    let ctx = context::Ctx {
        tools,
        seed: format!("{}:{}", board.name, commit.hash),
        epoch: commit.epoch,
        board,
        commit,
        inputs,
        work,
    };
    Ok((run, ctx, models))
}

/// What the card holds beside the system: the self-check's fixtures, the models slots (`models_a`
/// self-describing, `models_b` holding none), the models' known NLL answers and the data
/// partition.
struct DataSide {
    fixture: Vec<u8>,
    llama: Vec<u8>,
    models_part: runner::Product,
    models_b_part: runner::Product,
    nll: runner::Product,
    data_part: runner::Product,
}

fn data_side(run: &mut Runner, ctx: &context::Ctx, models: &[steps::Model]) -> Result<DataSide> {
    let fixture = fixture::gguf().context("writing the self-check fixture")?;
    let llama = kiln_runtime::model::fixture::gguf().context("writing the llama fixture")?;
    let models_part = run.run(steps::models_partition(ctx, models, &fixture, &llama))?;
    let nll = run.run(steps::known_answers_nll(ctx, models, &llama)?)?;
    let models_b_part = run.run(steps::models_b_partition(ctx, &models_part)?)?;
    let data_part = run.run(steps::data_partition(ctx))?;
    Ok(DataSide {
        fixture,
        llama,
        models_part,
        models_b_part,
        nll,
        data_part,
    })
}

/// The boot slot's file system: the system's files, the licences, the manifest with every known
/// answer and the models' verity parameters, the SBOMs made from it. Returns the manifest (to
/// be completed with the disk) and the partition.
fn boot_slot(
    run: &mut Runner,
    ctx: &context::Ctx,
    models: &[steps::Model],
    sys: &System,
    data: &DataSide,
    layout: &layout::Layout,
    blobs: &[steps::Blob],
) -> Result<(serde_json::Value, runner::Product)> {
    let licences = run.run(steps::licences(ctx))?;
    let texts = run.run(steps::licence_texts(ctx, &sys.runtime)?)?;
    if updates::keyring(ctx)?.1 {
        run.say(&format!("WARNING: {}", updates::DEV_WARNING));
    }
    let mut boot_files = steps::boot_files(ctx, &sys.kernel, &sys.initramfs, &sys.updates_tree)?;
    boot_files.extend(steps::licence_files(&texts)?);
    let mut manifest = steps::manifest(
        ctx,
        &steps::ManifestOf {
            models,
            fixture: &data.fixture,
            kernel: &sys.kernel,
            runtime: &sys.runtime,
            layout,
            blobs,
            bootloader: sys.uboot.as_ref(),
            initramfs: &sys.initramfs,
            boot_files: &boot_files,
            board_toml: &sys.board_toml,
            modules: sys.modules.as_ref(),
            licences: &licences,
        },
    )?;
    let fixtures = [
        (fixture::FILE_NAME, data.fixture.as_slice()),
        (
            kiln_runtime::model::fixture::FILE_NAME,
            data.llama.as_slice(),
        ),
    ];
    let known_matmul = run.run(known::matmul_step(ctx, models, &fixtures))?;
    known::add_matmul(&mut manifest, &known_matmul)?;
    steps::manifest_known_answers_nll(&mut manifest, &data.nll, &data.llama)?;
    steps::manifest_models_verity(&mut manifest, &data.models_part)?;
    // Last: the SBOMs on the card are made from the manifest as it is complete, then listed in it.
    boot_files.extend(steps::card_sboms(&mut manifest)?);
    let boot_part = run.run(steps::boot_partition(ctx, boot_files, &manifest)?)?;
    Ok((manifest, boot_part))
}

/// What the boot partition's system is made of.
struct System {
    kernel: crate::kernel::KernelOut,
    uboot: Option<crate::bootloader::BootloaderOut>,
    runtime: steps::Runtime,
    board_toml: String,
    updates_tree: runner::Product,
    modules: Option<runner::Product>,
    initramfs: runner::Product,
}

/// The kernel, the boot loader, the runtime, the updates tree and the initramfs.
fn system(run: &mut Runner, ctx: &context::Ctx) -> Result<System> {
    let kernel = steps::kernel(run, ctx)?;
    let uboot = steps::bootloader(run, ctx)?;
    let runtime = steps::runtime(run, ctx)?;
    let board_toml = ctx.board.board_toml(steps::kernel_config(&ctx.board)?)?;
    let serve_env = ctx.board.serve_env()?;
    // The updates tree first: the initramfs holds its sha256, which init checks before it
    // mounts the tree (after the verdict), so the self-check need not read it.
    let updates_tree = run.run(updates::step(ctx))?;
    let updates_sha = Sha256::of_file(updates_tree.path())?;
    let modules = match steps::kernel_modules(ctx)? {
        Some(step) => Some(run.run(step)?),
        None => None,
    };
    let initramfs = run.run(steps::initramfs(
        ctx,
        &runtime,
        &board_toml,
        &serve_env,
        &updates_sha,
        modules.as_ref(),
    )?)?;
    Ok(System {
        kernel,
        uboot,
        runtime,
        board_toml,
        updates_tree,
        modules,
        initramfs,
    })
}

/// The loader as written: RKNS at LBA 64, the FIT's U-Boot and BL31, before the GPT's first
/// partition (the `u-boot` stage shows each of these failing on a broken image); and U-Boot for
/// the board's SPI NOR beside the image (docs/rock-5b.md, "U-Boot in the SPI flash").
fn loader_outputs(
    run: &mut Runner,
    ctx: &context::Ctx,
    b: &crate::bootloader::BootloaderOut,
    layout: &layout::Layout,
    disk: &std::path::Path,
    out_dir: &std::path::Path,
) -> Result<()> {
    let first = layout.parts.iter().map(|p| p.first_lba).min().unwrap_or(0);
    let bl31 = std::fs::read(b.bl31())?;
    let found =
        loader::check_region(disk, first, &bl31).context("the image's boot loader region")?;
    run.say(&format!("boot loader in the image: {found}"));
    let spi = out_dir.join(format!(
        "kiln-{}.{}",
        ctx.board.name,
        crate::bootloader::PRODUCTS[1]
    ));
    crate::atomic::write_atomic(
        &spi,
        &std::fs::read(b.product(crate::bootloader::PRODUCTS[1]))?,
    )?;
    run.say(&format!(
        "{} (sha256 {}): U-Boot for the SPI flash, beside the image",
        spi.display(),
        b.products[1].1.short()
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extlinux_has_no_menu_and_passes_kiln_args() {
        let b = Board::load("qemu-virt").unwrap();
        let c = extlinux_conf(&b, None);
        assert!(!c.contains("menu"));
        assert!(c.starts_with("default kiln\nprompt 0\ntimeout 1\nlabel kiln\n"));
        assert!(c.contains("append console=ttyAMA0 panic=-1 rauc.slot=${kiln_slot} ${kiln_args}\n"));
        assert!(!c.contains("fdt"));
        let r = Board::load("rock-5b-vendor").unwrap();
        assert!(extlinux_conf(&r, Some("rk3588-rock-5b.dtb")).contains("fdt /rk3588-rock-5b.dtb\n"));
    }

    /// Without the vendor files, the rock-5b-vendor build stops and lists each, with how to give it.
    #[test]
    fn rock5b_vendor_without_inputs_lists_them() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: dir.path().to_path_buf(),
        };
        let b = Board::load("rock-5b-vendor").unwrap();
        let err = resolve_inputs(&b, &cache, true).unwrap_err().to_string();
        for name in ["linux-rk35xx-vendor", "librknnrt"] {
            assert!(
                err.contains(&format!("missing input {name}")),
                "{name}: {err}"
            );
            assert!(
                err.contains(&format!("pins lock --input {name}=PATH")),
                "{name}: {err}"
            );
        }
        assert!(err.contains("rknpu driver 0.9.8"), "{err}");
        assert!(err.contains("librknnrt version: 2.3.2"), "{err}");
    }
}
