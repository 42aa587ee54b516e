//! `cargo xtask image`: a bootable, bit-for-bit reproducible disk image for a board, from pinned
//! inputs: kernel (from source + fragment), initramfs root filesystem, GPT with a FAT32 boot
//! partition, an erofs models partition and an empty ext4 data partition; then the bmap, the
//! sha256 and the manifest. Every step whose inputs did not change is reused, and says so.

pub mod bench;
pub mod board;
pub mod checks;
pub mod fixture;
pub mod layout;
pub mod rootfs;

use crate::disk;
use crate::kernel;
use crate::pins::{self, Cache, Input, Sha256};
use anyhow::{bail, Context, Result};
use board::{Board, NpuRuntime};
use rootfs::{NodeKind, Tree};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Board recipe under `images/` (qemu-virt, rock-5b).
    #[arg(long, default_value = "qemu-virt")]
    pub board: String,
    /// A GGUF model to put on the models partition (repeatable).
    #[arg(long = "model")]
    pub models: Vec<PathBuf>,
    /// Build from the download cache alone; list what is missing.
    #[arg(long)]
    pub offline: bool,
}

pub fn run(args: Args) -> Result<()> {
    let b = build(&args)?;
    println!(
        "image: {} ({:.1} MiB, initramfs {:.2} MiB, sha256 {}) in {:.1} s{}",
        b.image.display(),
        b.size as f64 / 1048576.0,
        b.initramfs_size as f64 / 1048576.0,
        b.sha256,
        b.seconds,
        if b.reused.is_empty() {
            String::new()
        } else {
            format!(", {} step(s) reused", b.reused.len())
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
    pub size: u64,
    pub initramfs_size: u64,
    pub seconds: f64,
    /// The steps that were reused rather than redone.
    pub reused: Vec<String>,
}

/// Write `path` atomically: a temporary file beside it, then rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .with_context(|| format!("{} has no folder", path.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = path
        .file_name()
        .with_context(|| format!("{} has no name", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// The step log: each line says what was done or reused, and when.
struct Steps {
    t0: Instant,
    reused: Vec<String>,
}

impl Steps {
    fn say(&self, msg: &str) {
        println!("image: [{:>6.1} s] {msg}", self.t0.elapsed().as_secs_f64());
    }
    fn reused(&mut self, what: &str, detail: &str) {
        self.say(&format!("reused {what} ({detail})"));
        self.reused.push(what.to_string());
    }
}

fn git(args: &[&str]) -> Result<String> {
    let sh = crate::shell()?;
    Ok(cmd!(sh, "git {args...}")
        .quiet()
        .read()
        .with_context(|| format!("git {}", args.join(" ")))?
        .trim()
        .to_string())
}

/// The commit, its time (`SOURCE_DATE_EPOCH`) and whether the tree has uncommitted changes.
pub struct Commit {
    pub hash: String,
    pub epoch: i64,
    pub kernel_epoch: i64,
    pub dirty: bool,
}

pub fn commit_info() -> Result<Commit> {
    let hash = git(&["rev-parse", "HEAD"])?;
    let epoch: i64 = git(&["log", "-1", "--format=%ct"])?
        .parse()
        .context("commit time")?;
    // The kernel's timestamp is the last commit that touched its config, so that a commit that
    // changes only the runtime reuses the kernel (still one value per commit, still reproducible).
    let kernel_epoch = git(&["log", "-1", "--format=%ct", "--", "kernel-config"])?
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
pub fn resolve_inputs(
    board: &Board,
    cache: &Cache,
    offline: bool,
) -> Result<BTreeMap<String, (Input, PathBuf)>> {
    let mut out = BTreeMap::new();
    let mut missing = Vec::new();
    for i in pins::board_inputs(board)? {
        match pins::resolve(cache, &i, offline, &pins::apt_fetch) {
            Ok(p) => {
                out.insert(i.name.clone(), (i, p));
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

fn key_of(parts: &[&str]) -> Sha256 {
    Sha256::of_bytes(parts.join("\n").as_bytes())
}

/// A built product under `target/kiln/image/<board>/` and the key of the inputs it was built
/// from; reused when the key matches.
struct Product {
    path: PathBuf,
    key_file: PathBuf,
}

impl Product {
    fn new(dir: &Path, name: &str) -> Product {
        Product {
            path: dir.join(name),
            key_file: dir.join(format!("{name}.key")),
        }
    }
    fn fresh(&self, key: &Sha256) -> bool {
        self.path.exists()
            && std::fs::read_to_string(&self.key_file).ok().as_deref() == Some(&key.to_string())
    }
    fn done(&self, key: &Sha256) -> Result<()> {
        write_atomic(&self.key_file, key.to_string().as_bytes())
    }
}

/// The NPU runtime library for the image, if the board has one: bytes and where they came from.
fn npu_library(
    board: &Board,
    inputs: &BTreeMap<String, (Input, PathBuf)>,
) -> Result<Option<(Vec<u8>, String)>> {
    match &board.npu_runtime {
        NpuRuntime::None => Ok(None),
        NpuRuntime::Supplied(name) => {
            let (_, p) = inputs.get(name).with_context(|| {
                format!(
                    "board {} names NPU runtime input {name:?}, which it does not declare",
                    board.name
                )
            })?;
            Ok(Some((std::fs::read(p)?, name.clone())))
        }
        NpuRuntime::Standin => Ok(build_npu_standin()?.map(|b| (b, "rknn-standin".to_string()))),
    }
}

/// HOOK (npu stand-in): the `rknn-standin` crate, cross-built, installed as librknnrt.so. Until
/// that crate is in the workspace, the image is built without it and says so.
fn build_npu_standin() -> Result<Option<Vec<u8>>> {
    let manifest = crate::project_root().join("runtime/rknn-standin/Cargo.toml");
    if !manifest.exists() {
        println!(
            "image: WARNING: NPU stand-in hook: {} is not in this checkout; the image has no \
             /usr/lib/librknnrt.so",
            manifest.display()
        );
        return Ok(None);
    }
    let tc = crate::doctor::cross_toolchain()?;
    let sh = crate::shell()?;
    tc.cargo(&sh)
        .args([
            "build",
            "--locked",
            "-p",
            "rknn-standin",
            "--release",
            "--target",
            crate::doctor::AARCH64,
        ])
        .run()
        .context("cross-building the NPU stand-in (rknn-standin)")?;
    let so = crate::target_dir()
        .join(crate::doctor::AARCH64)
        .join("release/librknn_standin.so");
    Ok(Some(
        std::fs::read(&so).with_context(|| format!("reading {}", so.display()))?,
    ))
}

/// `extlinux/extlinux.conf`: no `menu` lines (U-Boot 2023.01 then waits at a prompt forever);
/// `${kiln_args}` is expanded by U-Boot from its environment (the boot test sets it).
pub fn extlinux_conf(board: &Board, dtb: Option<&str>) -> String {
    let fdt = dtb.map(|d| format!("    fdt /{d}\n")).unwrap_or_default();
    format!(
        "default kiln\nprompt 0\ntimeout 1\nlabel kiln\n    kernel /Image\n    initrd /initramfs.cpio.gz\n\
         {fdt}    append console={} panic=-1 ${{kiln_args}}\n",
        board.console
    )
}

fn tree_hash(tree: &Tree) -> Sha256 {
    let mut text = String::new();
    for (p, n) in &tree.nodes {
        let what = match &n.kind {
            NodeKind::File(b) => format!("file {}", Sha256::of_bytes(b)),
            NodeKind::Dir => "dir".into(),
            NodeKind::Symlink(t) => format!("link {t}"),
        };
        text.push_str(&format!("{p} {:o} {what}\n", n.mode));
    }
    Sha256::of_bytes(text.as_bytes())
}

/// Per-path record of a tree for the manifest.
fn tree_listing(tree: &Tree) -> Value {
    let mut m = serde_json::Map::new();
    for (p, n) in &tree.nodes {
        let v = match &n.kind {
            NodeKind::File(b) => {
                json!({"mode": format!("{:o}", n.mode), "size": b.len(), "sha256": Sha256::of_bytes(b), "from": n.origin})
            }
            NodeKind::Dir => json!({"mode": format!("{:o}", n.mode), "dir": true}),
            NodeKind::Symlink(t) => json!({"symlink": t, "from": n.origin}),
        };
        m.insert(format!("/{p}"), v);
    }
    Value::Object(m)
}

/// Assemble the initramfs tree.
fn initramfs_tree(
    inputs: &BTreeMap<String, (Input, PathBuf)>,
    kiln: &[u8],
    npu: &Option<(Vec<u8>, String)>,
    board_toml: &str,
) -> Result<Tree> {
    let deb = |name: &str| -> Result<&PathBuf> {
        inputs
            .get(name)
            .map(|(_, p)| p)
            .with_context(|| format!("rootfs/packages.toml does not pin {name}"))
    };
    let mut t = Tree::default();
    let bb = rootfs::deb_tree(deb("busybox-static")?, "busybox-static")?;
    let busybox = bb
        .nodes
        .get("bin/busybox")
        .context("busybox-static has no /bin/busybox")?;
    t.add("bin/busybox", 0o755, busybox.kind.clone(), "busybox-static")?;
    for (dir, applets) in rootfs::APPLETS {
        let target = if *dir == "bin" {
            "busybox"
        } else {
            "../bin/busybox"
        };
        for a in *applets {
            t.add(
                &format!("{dir}/{a}"),
                0o777,
                NodeKind::Symlink(target.into()),
                "busybox applets",
            )?;
        }
    }
    for m in rootfs::MOUNTPOINTS {
        t.add(
            m,
            if *m == "tmp" { 0o1777 } else { 0o755 },
            NodeKind::Dir,
            "kiln mountpoints",
        )?;
    }
    t.add("usr/bin/kiln", 0o755, NodeKind::File(kiln.to_vec()), "kiln")?;
    let mut roots = vec!["usr/bin/kiln"];
    if let Some((lib, origin)) = npu {
        t.add(
            "usr/lib/librknnrt.so",
            0o755,
            NodeKind::File(lib.clone()),
            origin,
        )?;
        roots.push("usr/lib/librknnrt.so");
    }
    t.add(
        "etc/kiln/board.toml",
        0o644,
        NodeKind::File(board_toml.as_bytes().to_vec()),
        "images/<board>.toml",
    )?;
    rootfs::add_host_tree(
        &mut t,
        &crate::project_root().join("rootfs/overlay"),
        "rootfs/overlay",
    )?;
    if !t.nodes.contains_key("init") {
        println!("image: WARNING: rootfs/overlay/init is missing: the kernel will find no /init");
    }
    let mut libs = Tree::default();
    for (name, (input, p)) in inputs {
        if matches!(input.source, pins::Source::Deb { .. })
            && input.file.ends_with("rootfs/packages.toml")
            && name != "busybox-static"
        {
            for (path, n) in rootfs::deb_tree(p, name)?.nodes {
                if libs
                    .nodes
                    .get(&path)
                    .is_none_or(|o| o.kind == NodeKind::Dir)
                {
                    libs.nodes.insert(path, n);
                }
            }
        }
    }
    rootfs::add_shared_objects(&mut t, &libs, &roots)?;
    Ok(t)
}

fn to_cpio(tree: &Tree) -> Vec<disk::cpio::CpioEntry> {
    tree.nodes
        .iter()
        .map(|(p, n)| match &n.kind {
            NodeKind::File(b) => disk::cpio::CpioEntry::file(p, n.mode, b.clone()),
            NodeKind::Dir => disk::cpio::CpioEntry::dir(p, n.mode),
            NodeKind::Symlink(t) => disk::cpio::CpioEntry::symlink(p, t),
        })
        .collect()
}

/// Copy the models partition's files into a staging folder with fixed modes (0644 files,
/// 0755 folders), so the host's umask cannot reach the erofs image.
fn stage_models(dir: &Path, files: &[(String, PathBuf)], fixture: &[u8]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    let f = dir.join(fixture::FILE_NAME);
    std::fs::write(&f, fixture)?;
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644))?;
    for (name, src) in files {
        let dst = dir.join(name);
        std::fs::copy(src, &dst).with_context(|| format!("copying model {}", src.display()))?;
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o644))?;
    }
    Ok(())
}

/// Build the image of `args.board`. See the module comment.
pub fn build(args: &Args) -> Result<Built> {
    let mut st = Steps {
        t0: Instant::now(),
        reused: Vec::new(),
    };
    let board = Board::load(&args.board)?;
    let commit = commit_info()?;
    let epoch = commit.epoch;
    let seed = format!("{}:{}", board.name, commit.hash);
    st.say(&format!(
        "board {}, commit {}{}, SOURCE_DATE_EPOCH={epoch}",
        board.name,
        &commit.hash[..12],
        if commit.dirty {
            " (with uncommitted changes)"
        } else {
            ""
        }
    ));

    // Inputs, all of them before any work, so a missing one stops the build at once.
    let cache = Cache::user()?;
    let inputs = resolve_inputs(&board, &cache, args.offline)?;
    st.say(&format!(
        "{} pinned inputs verified in the cache {}",
        inputs.len(),
        cache.dir.display()
    ));
    let mut models = Vec::new();
    for m in &args.models {
        let name = m
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("model {} has no UTF-8 file name", m.display()))?
            .to_string();
        if name == fixture::FILE_NAME
            || models
                .iter()
                .any(|(n, _, _): &(String, PathBuf, Sha256)| *n == name)
        {
            bail!("two models named {name} on the models partition");
        }
        let sha = Sha256::of_file(m).with_context(|| format!("model {}", m.display()))?;
        models.push((name, m.clone(), sha));
    }

    // Kernel.
    let (src_input, src_path) = inputs
        .get(&board.kernel.source)
        .with_context(|| format!("kernel source input {} not declared", board.kernel.source))?;
    let src_sha = src_input.sha256.context("kernel source not locked")?;
    let k = kernel::build(&board.kernel, src_path, &src_sha, commit.kernel_epoch)?;
    if k.reused {
        st.reused("kernel", &format!("{} build {}", k.release, k.key.short()));
    } else {
        st.say(&format!("kernel {} built", k.release));
    }
    if k.release != board.expect.kernel_release {
        bail!(
            "kernel release is {}, but images/{}.toml expects {}: fix one of them",
            k.release,
            board.name,
            board.expect.kernel_release
        );
    }
    let fragment = kernel::parse_fragment(&std::fs::read_to_string(board.kernel.fragment_path())?)?;
    // Every option, `# CONFIG_X is not set` included: the self-check holds the running kernel to
    // both kinds.
    let kernel_config: Vec<String> = fragment.iter().map(|o| o.line()).collect();

    // Runtime and NPU library.
    let kiln_path = crate::build::build_runtime(true)?;
    let kiln = std::fs::read(&kiln_path)?;
    let kiln_sha = Sha256::of_bytes(&kiln);
    let npu = npu_library(&board, &inputs)?;
    st.say(&format!(
        "runtime kiln {} (sha256 {}){}",
        kiln.len(),
        kiln_sha.short(),
        npu.as_ref()
            .map(|(b, o)| format!(
                ", NPU library from {o} (sha256 {})",
                Sha256::of_bytes(b).short()
            ))
            .unwrap_or_default()
    ));

    let work = crate::target_dir().join("kiln/image").join(&board.name);
    std::fs::create_dir_all(&work)?;

    // Initramfs.
    let board_toml = board.board_toml(kernel_config.clone())?;
    let overlay_key = {
        let mut ov = Tree::default();
        rootfs::add_host_tree(
            &mut ov,
            &crate::project_root().join("rootfs/overlay"),
            "overlay",
        )?;
        tree_hash(&ov)
    };
    let deb_shas: Vec<String> = inputs
        .values()
        .filter(|(i, _)| i.file.ends_with("rootfs/packages.toml"))
        .map(|(i, _)| {
            format!(
                "{}={}",
                i.name,
                i.sha256.map(|h| h.to_string()).unwrap_or_default()
            )
        })
        .collect();
    let initramfs = Product::new(&work, "initramfs.cpio.gz");
    let initramfs_list = work.join("initramfs.files.json");
    let ikey = key_of(&[
        "initramfs-v1",
        &epoch.to_string(),
        &deb_shas.join(","),
        &kiln_sha.to_string(),
        &npu.as_ref()
            .map(|(b, _)| Sha256::of_bytes(b).to_string())
            .unwrap_or_default(),
        &overlay_key.to_string(),
        &board_toml,
    ]);
    let initramfs_files: Value = if initramfs.fresh(&ikey) && initramfs_list.exists() {
        st.reused("initramfs", "runtime, packages and overlay unchanged");
        serde_json::from_slice(&std::fs::read(&initramfs_list)?)?
    } else {
        let tree = initramfs_tree(&inputs, &kiln, &npu, &board_toml)?;
        let epoch32 =
            u32::try_from(epoch).context("SOURCE_DATE_EPOCH does not fit cpio's 32 bits")?;
        disk::cpio::write_newc_gz(&initramfs.path, &to_cpio(&tree), epoch32)?;
        let listing = tree_listing(&tree);
        write_atomic(&initramfs_list, &serde_json::to_vec_pretty(&listing)?)?;
        initramfs.done(&ikey)?;
        st.say(&format!(
            "initramfs written: {} paths, {:.2} MiB",
            tree.nodes.len(),
            std::fs::metadata(&initramfs.path)?.len() as f64 / 1048576.0
        ));
        listing
    };
    let initramfs_sha = Sha256::of_file(&initramfs.path)?;
    let initramfs_size = std::fs::metadata(&initramfs.path)?.len();

    // Models partition (erofs).
    let fixture = fixture::gguf().context("writing the self-check fixture")?;
    let models_uuid = disk::guid_from_seed(&seed, "models-fs");
    let models_img = Product::new(&work, "models.erofs");
    let mkey = key_of(&[
        "models-v1",
        &epoch.to_string(),
        &models_uuid.to_string(),
        &Sha256::of_bytes(&fixture).to_string(),
        &models
            .iter()
            .map(|(n, _, s)| format!("{n}={s}"))
            .collect::<Vec<_>>()
            .join(","),
    ]);
    if models_img.fresh(&mkey) {
        st.reused("models partition", "same models");
    } else {
        let stage = work.join("models-staging");
        let list: Vec<(String, PathBuf)> = models
            .iter()
            .map(|(n, p, _)| (n.clone(), p.clone()))
            .collect();
        stage_models(&stage, &list, &fixture)?;
        disk::erofs::build(&models_img.path, &stage, models_uuid, epoch)?;
        std::fs::remove_dir_all(&stage)?;
        models_img.done(&mkey)?;
        st.say("models partition (erofs) written");
    }

    // Data partition (ext4, empty).
    let data_uuid = disk::guid_from_seed(&seed, "data-fs");
    let data_hash_seed = disk::guid_from_seed(&seed, "data-hash-seed");
    let data_size = board.partitions.data_mib << 20;
    let data_img = Product::new(&work, "data.ext4");
    let dkey = key_of(&[
        "data-v1",
        &epoch.to_string(),
        &data_uuid.to_string(),
        &data_hash_seed.to_string(),
        &data_size.to_string(),
    ]);
    if data_img.fresh(&dkey) {
        st.reused("data partition", "same size and ids");
    } else {
        disk::ext4::build_empty(
            &data_img.path,
            data_size,
            data_uuid,
            data_hash_seed,
            "data",
            epoch,
        )?;
        data_img.done(&dkey)?;
        st.say("data partition (ext4, empty) written");
    }

    // Layout.
    let raw: Vec<(u64, PathBuf, String, Sha256)> = board
        .raw
        .iter()
        .map(|b| {
            let (i, p) = inputs
                .get(&b.input)
                .with_context(|| format!("blob input {} not declared", b.input))?;
            Ok((
                b.lba,
                p.clone(),
                b.input.clone(),
                i.sha256.context("blob not locked")?,
            ))
        })
        .collect::<Result<_>>()?;
    let models_size = std::fs::metadata(&models_img.path)?.len();
    let lay = layout::plan(
        &seed,
        &[
            ("boot", board.partitions.boot_mib << 20),
            ("models", models_size),
            ("data", data_size),
        ],
    )?;

    // Boot partition (FAT32).
    let dtb_name = board
        .kernel
        .dtb
        .as_ref()
        .map(|d| d.rsplit('/').next().unwrap_or(d).to_string());
    let extlinux = extlinux_conf(&board, dtb_name.as_deref());
    let mut boot_files: Vec<(String, Vec<u8>)> = vec![
        ("extlinux/extlinux.conf".into(), extlinux.into_bytes()),
        ("Image".into(), std::fs::read(k.image())?),
        ("initramfs.cpio.gz".into(), std::fs::read(&initramfs.path)?),
    ];
    if let (Some(name), Some(p)) = (&dtb_name, k.dtb()) {
        boot_files.push((name.clone(), std::fs::read(p)?));
    }
    let boot_listing: BTreeMap<String, Value> = boot_files
        .iter()
        .map(|(p, b)| {
            (
                format!("/{p}"),
                json!({"size": b.len(), "sha256": Sha256::of_bytes(b)}),
            )
        })
        .collect();
    let toolchain = crate::doctor::cross_toolchain()?;
    let mut manifest = json!({
        "kiln_manifest": 1,
        "board": board.name,
        "commit": commit.hash,
        "uncommitted_changes": commit.dirty,
        "source_date_epoch": epoch,
        "seed": seed,
        "inputs": inputs.values().map(|(i, _)| json!({
            "name": i.name, "version": i.version, "source": i.describe_source(), "sha256": i.sha256,
        })).collect::<Vec<_>>(),
        "models": models.iter().map(|(n, _, s)| json!({"name": n, "sha256": s})).collect::<Vec<_>>(),
        "fixture": {"name": fixture::FILE_NAME, "sha256": Sha256::of_bytes(&fixture)},
        "kernel": {
            "release": k.release, "key": k.key, "build_timestamp": k.build_timestamp,
            "image_sha256": k.image_sha256, "config_sha256": k.config_sha256, "dtb_sha256": k.dtb_sha256,
            "fragment": board.kernel.fragment, "base": board.kernel.base,
        },
        "runtime": {"path": "/usr/bin/kiln", "sha256": kiln_sha},
        "npu_runtime": npu.as_ref().map(|(b, o)| json!({"path": "/usr/lib/librknnrt.so", "from": o, "sha256": Sha256::of_bytes(b)})),
        "toolchain": {
            "rust": toolchain.rustc_version, "rust_std_from": toolchain.source, "cross_gcc": k.toolchain,
            "mkfs.erofs": crate::doctor::version_of("mkfs.erofs", &["--version"]),
            "mke2fs": crate::doctor::version_of("mke2fs", &["-V"]),
        },
        "disk": lay.describe(),
        "raw_blobs": raw.iter().map(|(lba, _, n, s)| json!({"input": n, "lba": lba, "sha256": s})).collect::<Vec<_>>(),
        "initramfs": {"sha256": initramfs_sha, "size": initramfs_size, "files": initramfs_files},
        "boot": {"files": boot_listing},
        "expect": toml::from_str::<toml::Value>(&board_toml)?,
    });
    boot_files.push((
        "kiln/manifest.json".into(),
        serde_json::to_vec_pretty(&manifest)?,
    ));
    let boot_img = Product::new(&work, "boot.vfat");
    let volume_id = disk::u32_from_seed(&seed, "boot-fs");
    let bkey = {
        let mut parts = vec![
            "boot-v1".to_string(),
            epoch.to_string(),
            volume_id.to_string(),
            (board.partitions.boot_mib).to_string(),
        ];
        parts.extend(
            boot_files
                .iter()
                .map(|(p, b)| format!("{p}={}", Sha256::of_bytes(b))),
        );
        key_of(&parts.iter().map(String::as_str).collect::<Vec<_>>())
    };
    if boot_img.fresh(&bkey) {
        st.reused("boot partition", "same files");
    } else {
        disk::fat::build(
            &boot_img.path,
            board.partitions.boot_mib << 20,
            volume_id,
            "KILN-BOOT",
            &boot_files,
            epoch,
        )?;
        boot_img.done(&bkey)?;
        st.say("boot partition (FAT32) written");
    }

    // The disk image, bmap, sha256, manifest.
    let out_dir = crate::target_dir().join("images");
    std::fs::create_dir_all(&out_dir)?;
    let img = out_dir.join(format!("kiln-{}.img", board.name));
    let bmap = out_dir.join(format!("kiln-{}.img.bmap", board.name));
    let sha_file = out_dir.join(format!("kiln-{}.img.sha256", board.name));
    let manifest_file = out_dir.join("manifest.json");
    let final_key = key_of(&[
        "image-v1",
        &bkey.to_string(),
        &mkey.to_string(),
        &dkey.to_string(),
        &serde_json::to_string(&lay.describe())?,
        &raw.iter()
            .map(|(l, _, _, s)| format!("{l}={s}"))
            .collect::<Vec<_>>()
            .join(","),
    ]);
    let final_stamp = Product::new(&work, "image");
    let outputs_exist = [&img, &bmap, &sha_file, &manifest_file]
        .iter()
        .all(|p| p.exists());
    let stamp_ok = std::fs::read_to_string(&final_stamp.key_file)
        .ok()
        .as_deref()
        == Some(&final_key.to_string());
    let sha = if outputs_exist && stamp_ok {
        let text = std::fs::read_to_string(&sha_file)?;
        let sha: Sha256 = text.split_whitespace().next().unwrap_or("").parse()?;
        st.reused(
            "disk image, bmap, manifest",
            &format!("sha256 {}", sha.short()),
        );
        sha
    } else {
        let parts = vec![
            (lay.parts[0].clone(), boot_img.path.clone()),
            (lay.parts[1].clone(), models_img.path.clone()),
            (lay.parts[2].clone(), data_img.path.clone()),
        ];
        let blobs: Vec<(u64, PathBuf)> = raw
            .iter()
            .map(|(lba, p, _, _)| (lba * 512, p.clone()))
            .collect();
        disk::assemble(&img, lay.total_size, lay.disk_guid, &parts, &blobs)?;
        st.say(&format!(
            "disk image assembled ({:.1} MiB, sparse)",
            lay.total_size as f64 / 1048576.0
        ));
        crate::bmap::create(&img, &bmap)?;
        let sha = Sha256::of_file(&img)?;
        write_atomic(
            &sha_file,
            format!("{sha}  kiln-{}.img\n", board.name).as_bytes(),
        )?;
        let part_shas: Vec<Value> = [&boot_img.path, &models_img.path, &data_img.path]
            .iter()
            .map(|p| Ok(json!({"image": p.file_name().map(|n| n.to_string_lossy().into_owned()), "sha256": Sha256::of_file(p)?})))
            .collect::<Result<_>>()?;
        manifest["image"] = json!({
            "file": img.file_name().map(|n| n.to_string_lossy().into_owned()),
            "size": lay.total_size, "sha256": sha, "partition_images": part_shas,
        });
        write_atomic(&manifest_file, &serde_json::to_vec_pretty(&manifest)?)?;
        final_stamp.done(&final_key)?;
        st.say("bmap, sha256 and manifest written");
        sha
    };
    let seconds = st.t0.elapsed().as_secs_f64();
    if !st.reused.is_empty() {
        st.say(&format!("reused: {}", st.reused.join(", ")));
    }
    Ok(Built {
        image: img,
        bmap,
        manifest: manifest_file,
        sha256: sha,
        size: lay.total_size,
        initramfs_size,
        seconds,
        reused: st.reused,
    })
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
        assert!(c.contains("append console=ttyAMA0 panic=-1 ${kiln_args}\n"));
        assert!(!c.contains("fdt"));
        let r = Board::load("rock-5b").unwrap();
        assert!(extlinux_conf(&r, Some("rk3588-rock-5b.dtb")).contains("fdt /rk3588-rock-5b.dtb\n"));
    }

    /// Without the vendor files, the rock-5b build stops and lists each, with how to give it.
    #[test]
    fn rock5b_without_inputs_lists_them() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: dir.path().to_path_buf(),
        };
        let b = Board::load("rock-5b").unwrap();
        let err = resolve_inputs(&b, &cache, true).unwrap_err().to_string();
        for name in [
            "linux-rk35xx-vendor",
            "idbloader",
            "u-boot-itb",
            "librknnrt",
        ] {
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
