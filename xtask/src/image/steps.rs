//! The steps of `image::build`, one function each, in pipeline order. Each takes its inputs
//! explicitly (the build's [`Ctx`] plus the products it uses) and gives one product: either a
//! [`Step`] for the runner (key, files, how to make them) or, where a builder keeps its own cache
//! (the kernel, cargo's build of the runtime), the product itself, counted with
//! [`Runner::record`] / [`Runner::observed`].

use super::board::{Board, NpuRuntime};
pub use super::context::Ctx;
use super::context::{rootfs_debs_key, rootfs_libs};
use super::runner::{key_of, Product, Runner, Step};
use super::{fixture, layout, Inputs};
use crate::atomic::write_atomic;
use crate::bootloader::{self, BootloaderOut};
use crate::disk;
use crate::kernel::{self, KernelOut};
use crate::pins::{self, Sha256};
use crate::rootfs::{self, NodeKind, Tree};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_runtime::model::fixture as llama_fixture;

/// A model for the models partition: its name there, where it is, its sha256.
pub struct Model {
    pub name: String,
    pub path: PathBuf,
    pub sha256: Sha256,
    /// Its `general.*` metadata and tensor types ([`gguf_summary`]), for the manifest and SBOMs.
    pub gguf: Value,
}

/// The models given on the command line, named by their file names (unique, not the fixture's).
pub fn models(paths: &[PathBuf]) -> Result<Vec<Model>> {
    let mut models: Vec<Model> = Vec::new();
    for m in paths {
        let name = m
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("model {} has no UTF-8 file name", m.display()))?
            .to_string();
        if name == fixture::FILE_NAME
            || name == llama_fixture::FILE_NAME
            || models.iter().any(|x| x.name == name)
        {
            bail!("two models named {name} on the models partition");
        }
        let sha256 = Sha256::of_file_memo(m).with_context(|| format!("model {}", m.display()))?;
        let file = kiln_runtime::gguf::GgufFile::open(m)
            .with_context(|| format!("model {}: reading it as GGUF", m.display()))?;
        models.push(Model {
            name,
            path: m.clone(),
            sha256,
            gguf: gguf_summary(file.gguf()),
        });
    }
    Ok(models)
}

/// The `general.*` keys that say what a model is (GGUF's own names), as the SBOMs record them.
const GENERAL_KEYS: &[&str] = &[
    "general.name",
    "general.architecture",
    "general.type",
    "general.basename",
    "general.finetune",
    "general.size_label",
    "general.version",
    "general.organization",
    "general.license",
    "general.license.name",
    "general.license.link",
    "general.quantized_by",
    "general.file_type",
    "general.quantization_version",
];

/// llama.cpp's name of a `general.file_type` (`enum llama_ftype`), for the ids known here.
fn file_type_name(id: i128) -> Option<&'static str> {
    Some(match id {
        0 => "ALL_F32",
        1 => "MOSTLY_F16",
        2 => "MOSTLY_Q4_0",
        3 => "MOSTLY_Q4_1",
        7 => "MOSTLY_Q8_0",
        8 => "MOSTLY_Q5_0",
        9 => "MOSTLY_Q5_1",
        10 => "MOSTLY_Q2_K",
        11 => "MOSTLY_Q3_K_S",
        12 => "MOSTLY_Q3_K_M",
        13 => "MOSTLY_Q3_K_L",
        14 => "MOSTLY_Q4_K_S",
        15 => "MOSTLY_Q4_K_M",
        16 => "MOSTLY_Q5_K_S",
        17 => "MOSTLY_Q5_K_M",
        18 => "MOSTLY_Q6_K",
        32 => "MOSTLY_BF16",
        _ => return None,
    })
}

/// What a GGUF says of itself, read by kiln's own parser: the [`GENERAL_KEYS`] it has, the
/// name of its `general.file_type`, and how many tensors of each ggml type it holds (the
/// quantisation as it is, whatever the metadata claims).
pub fn gguf_summary(g: &kiln_runtime::gguf::Gguf) -> Value {
    let mut out = serde_json::Map::new();
    for k in GENERAL_KEYS {
        if let Some(v) = g.get(k) {
            out.insert(k.to_string(), v.to_json());
        }
    }
    if let Some(name) = g
        .get("general.file_type")
        .and_then(|v| v.as_int())
        .and_then(file_type_name)
    {
        out.insert("file_type_name".into(), json!(name));
    }
    let types: serde_json::Map<String, Value> = g
        .totals_by_type()
        .into_iter()
        .map(|(t, n, _)| (t.name().to_string(), json!(n)))
        .collect();
    out.insert("tensor_types".into(), Value::Object(types));
    Value::Object(out)
}

/// [`gguf_summary`] of a GGUF in memory (the fixtures kiln writes).
pub fn gguf_summary_of(name: &str, bytes: &[u8]) -> Result<Value> {
    let g = kiln_runtime::gguf::Gguf::parse(bytes)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{name}: reading it as GGUF"))?;
    Ok(gguf_summary(&g))
}

/// The kernel, from its pinned source and fragment (cached by `kernel::build` under its key),
/// checked to be the release the recipe expects.
pub fn kernel(run: &mut Runner, ctx: &Ctx) -> Result<KernelOut> {
    let t = Instant::now();
    let board = &ctx.board;
    let (src_input, src_path) = ctx
        .inputs
        .get(&board.kernel.source)
        .with_context(|| format!("kernel source input {} not declared", board.kernel.source))?;
    let src_sha = src_input.sha256.context("kernel source not locked")?;
    let k = kernel::build(
        &board.kernel,
        src_path,
        &src_sha,
        ctx.commit.kernel_epoch,
        &ctx.tools,
    )?;
    run.record(
        "kernel",
        k.reused,
        &format!("{} build {}", k.release, k.key.short()),
        t,
    );
    if k.release != board.expect.kernel_release {
        bail!(
            "kernel release is {}, but images/{}.toml expects {}: fix one of them",
            k.release,
            board.name,
            board.expect.kernel_release
        );
    }
    Ok(k)
}

/// The fragment's options that the self-check looks for in the running kernel's config: every
/// option, `# CONFIG_X is not set` included, so the running kernel is held to both kinds.
pub fn kernel_config(board: &Board) -> Result<Vec<String>> {
    let fragment = kernel::parse_fragment(&std::fs::read_to_string(board.kernel.fragment_path())?)?;
    Ok(fragment.iter().map(|o| o.line()).collect())
}

/// `kiln` for aarch64 and the board's NPU runtime library, as bytes.
pub struct Runtime {
    pub kiln: Vec<u8>,
    pub kiln_sha: Sha256,
    /// The library and where it came from.
    pub npu: Option<(Vec<u8>, String)>,
    /// The crates compiled into `kiln` and the stand-in, as cargo resolved them for this build.
    pub crates: Vec<crate::sbom::crates::Crate>,
}

/// Cross-build the runtime (cargo keeps its own cache) and take the NPU library; the step counts
/// as reused when their bytes are those of the last build.
pub fn runtime(run: &mut Runner, ctx: &Ctx) -> Result<Runtime> {
    let t = Instant::now();
    let kiln_path = crate::build::build_runtime(true)?;
    let kiln = std::fs::read(&kiln_path)?;
    let kiln_sha = Sha256::of_bytes(&kiln);
    let npu = npu_library(&ctx.board, &ctx.inputs)?;
    let npu_sha = npu.as_ref().map(|(b, _)| Sha256::of_bytes(b));
    let mut roots = vec!["kiln-runtime"];
    if matches!(&npu, Some((_, from)) if from == "rknn-standin") {
        roots.push("rknn-standin");
    }
    let crates = crate::sbom::crates::of_workspace(&crate::paths::project_root(), &roots)
        .context("listing the crates compiled into the image")?;
    let key = key_of(&[
        "runtime-v1",
        &kiln_sha.to_string(),
        &npu_sha.map(|h| h.to_string()).unwrap_or_default(),
    ]);
    run.observed(
        "runtime",
        &key,
        &format!(
            "kiln {} (sha256 {}){}",
            kiln.len(),
            kiln_sha.short(),
            npu.as_ref()
                .zip(npu_sha)
                .map(|((_, o), h)| format!(", NPU library from {o} (sha256 {})", h.short()))
                .unwrap_or_default()
        ),
        t,
    )?;
    Ok(Runtime {
        kiln,
        kiln_sha,
        npu,
        crates,
    })
}

/// The initramfs (`initramfs.cpio.gz`) and its per-path listing for the manifest
/// (`initramfs.files.json`).
pub fn initramfs<'a>(
    ctx: &'a Ctx,
    rt: &'a Runtime,
    board_toml: &'a str,
    serve_env: &'a str,
    updates_sha: &'a Sha256,
    modules: Option<&'a Product>,
) -> Result<Step<'a>> {
    let overlay_key = {
        let mut ov = Tree::default();
        rootfs::add_host_tree(
            &mut ov,
            &crate::paths::project_root().join("rootfs/overlay"),
            "overlay",
        )?;
        tree_hash(&ov)
    };
    let (keyring, _) = super::updates::keyring(ctx)?;
    let key = key_of(&[
        "initramfs-v1",
        &ctx.epoch.to_string(),
        &rootfs_debs_key(ctx),
        &rt.kiln_sha.to_string(),
        &rt.npu
            .as_ref()
            .map(|(b, _)| Sha256::of_bytes(b).to_string())
            .unwrap_or_default(),
        &overlay_key.to_string(),
        board_toml,
        serve_env,
        &ctx.board
            .fleet
            .as_ref()
            .map(|f| f.toml.clone())
            .unwrap_or_default(),
        &ctx.board
            .fleet
            .as_ref()
            .and_then(|f| f.ca.as_ref())
            .map(|c| Sha256::of_bytes(c).to_string())
            .unwrap_or_default(),
        &Sha256::of_bytes(&keyring).to_string(),
        &updates_sha.to_string(),
        &modules.map(|m| m.key.to_string()).unwrap_or_default(),
    ]);
    Ok(Step {
        name: "initramfs",
        key,
        outputs: vec![
            ctx.work.join("initramfs.cpio.gz"),
            ctx.work.join("initramfs.files.json"),
        ],
        make: Box::new(move |tmp: &[PathBuf]| {
            let mut tree = initramfs_tree(&ctx.inputs, &rt.kiln, &rt.npu, board_toml, serve_env)?;
            if let Some(f) = &ctx.board.fleet {
                tree.add(
                    "etc/kiln/fleet.toml",
                    0o644,
                    NodeKind::File(f.toml.as_bytes().to_vec()),
                    "images/<board>.toml [fleet]",
                )?;
                if let Some(ca) = &f.ca {
                    tree.add(
                        super::board::FLEET_CA_ON_BOARD.trim_start_matches('/'),
                        0o644,
                        NodeKind::File(ca.clone()),
                        "images/<board>.toml [fleet] ca",
                    )?;
                }
            }
            super::updates::add_to_initramfs(&mut tree, &ctx.board.name, &keyring, updates_sha)?;
            if let Some(m) = modules {
                for (path, bytes) in crate::sbom::texts::read_tar(m.path())? {
                    tree.add(&path, 0o644, NodeKind::File(bytes), "kernel modules")?;
                }
            }
            let epoch32 = u32::try_from(ctx.epoch)
                .context("SOURCE_DATE_EPOCH does not fit cpio's 32 bits")?;
            disk::cpio::write_newc_gz(&tmp[0], &to_cpio(&tree), epoch32)?;
            write_atomic(&tmp[1], &serde_json::to_vec_pretty(&tree_listing(&tree))?)?;
            Ok(format!(
                "{} paths, {:.2} MiB",
                tree.nodes.len(),
                std::fs::metadata(&tmp[0])?.len() as f64 / 1048576.0
            ))
        }),
    })
}

/// Where the initramfs's module list is: `/init` loads it with busybox `modprobe -a`.
pub const MODULES_LIST: &str = "etc/kiln/modules";

/// The recipe's `[modules]` from its Debian kernel package: `modules.tar` (the closure's `.ko`
/// files decompressed, `modules.dep`, [`MODULES_LIST`] in load order; the initramfs's paths) and
/// `modules.json` (for the manifest). None for a board without a list.
pub fn kernel_modules(ctx: &Ctx) -> Result<Option<Step<'_>>> {
    let board = &ctx.board;
    if board.modules.is_empty() {
        return Ok(None);
    }
    let release = board
        .kernel
        .prebuilt_release
        .clone()
        .context("[modules] without a prebuilt kernel")?;
    let (input, deb) = ctx
        .inputs
        .get(&board.kernel.source)
        .with_context(|| format!("kernel input {} not declared", board.kernel.source))?;
    let sha = input.sha256.context("kernel package not pinned")?;
    // The firmware package, when the modules need files from one.
    let firmware = match &board.firmware {
        Some((name, files)) => {
            let (i, p) = ctx
                .inputs
                .get(name)
                .with_context(|| format!("[modules] firmware_input {name} is not declared"))?;
            let sha = i.sha256.context("firmware package not pinned")?;
            Some((i, p, sha, files))
        }
        None => None,
    };
    // The reader's source is in the key: a change to how the closure is taken redoes it.
    let code = Sha256::of_bytes(include_str!("../kernel_modules.rs").as_bytes()).to_string();
    let fw_key = firmware
        .as_ref()
        .map(|(_, _, sha, files)| format!("{sha} {}", files.join(" ")))
        .unwrap_or_default();
    let key = key_of(&[
        "kernel-modules-v2",
        &code,
        &sha.to_string(),
        &release,
        &board.modules.join(" "),
        &fw_key,
    ]);
    Ok(Some(Step {
        name: "kernel modules",
        key,
        outputs: vec![ctx.work.join("modules.tar"), ctx.work.join("modules.json")],
        make: Box::new(move |tmp: &[PathBuf]| {
            let pkg = crate::kernel_modules::read_package(deb, &release)
                .with_context(|| format!("the modules of {}", input.name))?;
            let order = pkg.closure(&board.modules)?;
            let dir = format!("lib/modules/{release}");
            let mut files: Vec<(String, Vec<u8>)> = Vec::new();
            let mut listing = Vec::new();
            let (mut xz_total, mut ko_total) = (0usize, 0usize);
            for n in &order {
                let m = &pkg.modules[n];
                let mut ko = Vec::new();
                std::io::Read::read_to_end(&mut xz2::read::XzDecoder::new(&m.xz[..]), &mut ko)
                    .with_context(|| format!("decompressing {}.xz", m.path))?;
                xz_total += m.xz.len();
                ko_total += ko.len();
                listing.push(json!({
                    "name": n, "path": format!("/{dir}/{}", m.path), "size": ko.len(),
                    "sha256": Sha256::of_bytes(&ko), "xz_size": m.xz.len(), "xz_sha256": Sha256::of_bytes(&m.xz),
                }));
                files.push((format!("{dir}/{}", m.path), ko));
            }
            // Firmware: each file must be one a module of the closure requests (its .modinfo
            // `firmware=` line), and is the package's as it holds it.
            let mut fw_listing = Vec::new();
            if let Some((fw_input, deb, _, names)) = &firmware {
                for f in names.iter() {
                    let needle = format!("firmware={f}\0");
                    let by = files
                        .iter()
                        .find(|(_, ko)| ko.windows(needle.len()).any(|w| w == needle.as_bytes()))
                        .map(|(p, _)| p.rsplit('/').next().unwrap_or(p).trim_end_matches(".ko").to_string())
                        .with_context(|| {
                            format!("firmware {f}: no module of the closure requests it (modinfo firmware=)")
                        })?;
                    let mut bytes = None;
                    for member in [format!("lib/firmware/{f}"), format!("usr/lib/firmware/{f}")] {
                        if let Ok(b) = crate::archive::with_deb_member(deb, &member, |r| {
                            let mut v = Vec::new();
                            r.read_to_end(&mut v)?;
                            Ok(v)
                        }) {
                            bytes = Some(b);
                            break;
                        }
                    }
                    let bytes = bytes.with_context(|| {
                        format!(
                            "{} {} holds no lib/firmware/{f}",
                            fw_input.name, fw_input.version
                        )
                    })?;
                    fw_listing.push(json!({
                        "file": f, "path": format!("/lib/firmware/{f}"), "size": bytes.len(),
                        "sha256": Sha256::of_bytes(&bytes), "requested_by": by,
                    }));
                    files.push((format!("lib/firmware/{f}"), bytes));
                }
            }
            files.push((
                format!("{dir}/modules.dep"),
                pkg.modules_dep(&order).into_bytes(),
            ));
            let list: String = order.iter().map(|n| format!("{n}\n")).collect();
            files.push((MODULES_LIST.to_string(), list.into_bytes()));
            files.sort();
            crate::sbom::texts::write_tar(&tmp[0], &files)?;
            let doc = json!({
                "package": {"input": input.name, "version": input.version, "sha256": sha},
                "release": release, "load": board.modules, "load_order": order, "files": listing,
                "xz_bytes": xz_total, "bytes": ko_total,
            });
            let mut doc = doc;
            if let Some((fw_input, _, fw_sha, _)) = &firmware {
                doc["firmware"] = json!({
                    "package": {"input": fw_input.name, "version": fw_input.version, "sha256": fw_sha},
                    "files": fw_listing,
                });
            }
            write_atomic(&tmp[1], &serde_json::to_vec_pretty(&doc)?)?;
            Ok(format!(
                "{} listed, {} with dependencies, {:.2} MiB ({:.2} MiB as .ko.xz) of {} modules",
                board.modules.len(),
                order.len(),
                ko_total as f64 / 1048576.0,
                xz_total as f64 / 1048576.0,
                pkg.modules.len()
            ))
        }),
    }))
}

/// The models partition: an erofs of the self-check's fixtures (the matmul fixture and the
/// seeded llama model of `model.nll`) and the given models, then its dm-verity tree
/// ([`disk::verity`]); `models-verity.json` holds the tree's parameters for the manifest.
///
/// Its bytes depend on the files it holds and the tools root only — not on the commit or the
/// board — so a system bundle from another commit with the same models needs the same root
/// hash as the card's partition.
pub fn models_partition<'a>(
    ctx: &'a Ctx,
    models: &'a [Model],
    fixture: &'a [u8],
    llama: &'a [u8],
) -> Step<'a> {
    let content = key_of(&[
        &Sha256::of_bytes(fixture).to_string(),
        &Sha256::of_bytes(llama).to_string(),
        &models_key(models),
    ]);
    let uuid = disk::guid_from_seed(&content.to_string(), "models-fs");
    let salt: [u8; 32] =
        <sha2::Sha256 as sha2::Digest>::digest(format!("{content}:models-verity-salt")).into();
    let key = key_of(&[
        "models-v4",
        &ctx.tools.key.to_string(),
        &content.to_string(),
    ]);
    Step {
        name: "models partition",
        key,
        outputs: vec![
            ctx.work.join("models.erofs"),
            ctx.work.join("models-verity.json"),
            ctx.work.join("models-slot.json"),
        ],
        make: Box::new(move |tmp: &[PathBuf]| {
            let stage = ctx.work.join("models-staging");
            stage_models(&stage, models, fixture)?;
            stage_file(&stage.join(llama_fixture::FILE_NAME), llama)?;
            let files = models_slot_files(&stage)?;
            // A fixed time: the files' content, not the commit, makes the bytes.
            disk::erofs::build(&tmp[0], &stage, uuid, 0, Some(&ctx.tools))?;
            std::fs::remove_dir_all(&stage)?;
            let v = disk::verity::append(&tmp[0], &salt)?;
            std::fs::write(&tmp[1], serde_json::to_vec_pretty(&v)?)?;
            let sha = models_slot_trailer(&tmp[0], files, &v)?;
            std::fs::write(
                &tmp[2],
                serde_json::to_vec_pretty(&json!({ "meta_sha256": sha }))?,
            )?;
            Ok(format!(
                "erofs, {} model(s) and the fixtures ({} KiB llama); dm-verity root {}; \
                 kiln-models.json {}",
                models.len(),
                llama.len() >> 10,
                &v.root_hash[..12],
                &sha[..12]
            ))
        }),
    }
}

/// The files of the models erofs as `kiln-models.json` lists them, by name.
fn models_slot_files(stage: &Path) -> Result<Vec<kiln_runtime::models_slot::Model>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(stage).with_context(|| format!("listing {}", stage.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let f = std::fs::File::open(e.path())
            .with_context(|| format!("opening {}", e.path().display()))?;
        out.push(kiln_runtime::models_slot::Model {
            size: f.metadata()?.len(),
            sha256: Sha256::of_reader(f)
                .with_context(|| format!("hashing {}", e.path().display()))?
                .to_string(),
            name,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Make the erofs + hash tree at `path` a self-describing models slot
/// (`kiln_runtime::models_slot`, `docs/models-slots.md`): `kiln-models.json` after the tree,
/// no signature (the image vouches for its factory slot: its manifest names the JSON's
/// sha256), the footer in the last 4 KiB, the whole padded to whole MiB so that the footer is
/// the partition's end. Returns the JSON's sha256 (hex). Depends on the files alone, as the
/// erofs does.
fn models_slot_trailer(
    path: &Path,
    models: Vec<kiln_runtime::models_slot::Model>,
    verity: &disk::verity::Verity,
) -> Result<String> {
    use kiln_runtime::models_slot as ms;
    let meta = ms::Meta {
        format: ms::FORMAT,
        models,
        verity: verity.clone(),
        // Today's known answers stay in the system's manifest (they follow the runtime's
        // code, which a system update changes; a models bundle will carry its own).
        known_answers: Default::default(),
    };
    let bytes = serde_json::to_vec_pretty(&meta)?;
    let tree_end = meta.hash_tree_end()?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    ensure!(
        f.metadata()?.len() == tree_end,
        "{}: the hash tree does not end where its parameters say",
        path.display()
    );
    let len = (tree_end.next_multiple_of(4096)
        + (bytes.len() as u64).next_multiple_of(4096)
        + ms::FOOTER_LEN)
        .next_multiple_of(1 << 20);
    let footer = ms::layout(tree_end, &bytes, 0, len)?;
    f.set_len(len)?;
    ms::write_trailer(&mut f, len, &footer, &bytes, &[])
        .with_context(|| format!("writing the models trailer of {}", path.display()))?;
    f.sync_all()?;
    Ok(hex::encode(footer.meta_sha256))
}

/// Add the models partition's dm-verity parameters to the manifest (`models_verity`).
pub fn manifest_models_verity(manifest: &mut Value, models_part: &Product) -> Result<()> {
    let p = models_part
        .paths
        .get(1)
        .context("the models partition step made no models-verity.json")?;
    let v: disk::verity::Verity = serde_json::from_slice(
        &std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
    )
    .with_context(|| format!("parsing {}", p.display()))?;
    manifest["models_verity"] = serde_json::to_value(v)?;
    let p = models_part
        .paths
        .get(2)
        .context("the models partition step made no models-slot.json")?;
    manifest["models_slot"] = serde_json::from_slice(
        &std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
    )
    .with_context(|| format!("parsing {}", p.display()))?;
    Ok(())
}

/// The models as a step key part: `name=sha256` of each, in order.
pub fn models_key(models: &[Model]) -> String {
    models
        .iter()
        .map(|m| format!("{}={}", m.name, m.sha256))
        .collect::<Vec<_>>()
        .join(",")
}

/// The text whose token ids and mean NLL every model's known answer records (committed, so
/// the answer depends on nothing but the commit).
pub fn known_text() -> &'static str {
    include_str!("known-answer.txt").trim_end()
}

/// `known-answers-nll.json`: the model-level known answers (`model.nll` at boot). For the llama
/// fixture and every `--model`, the token ids of [`known_text`] from the host build of the
/// runtime's tokenizer and its mean NLL on the `cpu-ref` path. Keyed by the source of the
/// runtime library linked into xtask that computes the answer ([`runtime_source_key`]), not by
/// the xtask binary: a `cargo test` in the same run may rebuild (and so delete) the running
/// binary, and an xtask-only change must not redo SmolLM2's two-minute answer.
pub fn known_answers_nll<'a>(
    ctx: &'a Ctx,
    models: &'a [Model],
    llama: &'a [u8],
) -> Result<Step<'a>> {
    let key = key_of(&[
        "known-answers-nll-v2",
        &runtime_source_key()?.to_string(),
        &Sha256::of_bytes(known_text().as_bytes()).to_string(),
        &Sha256::of_bytes(llama).to_string(),
        &models_key(models),
    ]);
    Ok(Step {
        name: "known answers (nll)",
        key,
        outputs: vec![ctx.work.join("known-answers-nll.json")],
        make: Box::new(move |tmp: &[PathBuf]| {
            use kiln_runtime::selftest::model_nll;
            // The fixture is read from a file, mapped, as the board will read it.
            let dir = tempfile::tempdir_in(&ctx.work).context("temp dir for the llama fixture")?;
            let lp = dir.path().join(llama_fixture::FILE_NAME);
            std::fs::write(&lp, llama).with_context(|| format!("writing {}", lp.display()))?;
            let mut list: Vec<(&str, &Path)> = vec![(llama_fixture::FILE_NAME, &lp)];
            list.extend(models.iter().map(|m| (m.name.as_str(), m.path.as_path())));
            let mut answers = Vec::new();
            for (name, path) in list {
                let t = Instant::now();
                let a = model_nll::record(path, name, known_text())
                    .with_context(|| format!("known answer of {name}"))?;
                println!("    {} ({:.1} s)", a.summary(), t.elapsed().as_secs_f64());
                answers.push(a);
            }
            write_atomic(&tmp[0], &serde_json::to_vec_pretty(&answers)?)?;
            Ok(format!("{} model(s)", answers.len()))
        }),
    })
}

/// What the host's copy of the runtime library is built from: every file under `runtime/src`
/// (path and bytes, in path order), `runtime/Cargo.toml`, `Cargo.lock` and the pinned Rust
/// release.
pub fn runtime_source_key() -> Result<Sha256> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let p = e?.path();
            if p.is_dir() {
                walk(&p, out)?;
            } else {
                out.push(p);
            }
        }
        Ok(())
    }
    let root = crate::paths::project_root();
    let mut files = Vec::new();
    walk(&root.join("runtime/src"), &mut files)?;
    files.push(root.join("runtime/Cargo.toml"));
    files.push(root.join("Cargo.lock"));
    files.sort();
    let mut parts = vec![crate::doctor::pinned_rust()?];
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        parts.push(format!("{rel}={}", Sha256::of_file(f)?));
    }
    Ok(Sha256::of_bytes(parts.join("\n").as_bytes()))
}

/// Add the model-level known answers to the manifest: `known_answers.nll` (from the
/// [`known_answers_nll`] step) and the llama fixture under `fixtures` (so `image.manifest`
/// hashes it like every model).
pub fn manifest_known_answers_nll(manifest: &mut Value, nll: &Product, llama: &[u8]) -> Result<()> {
    let answers: Value = serde_json::from_slice(
        &std::fs::read(nll.path()).with_context(|| format!("reading {}", nll.path().display()))?,
    )
    .with_context(|| format!("parsing {}", nll.path().display()))?;
    manifest["known_answers"]["nll"] = answers;
    manifest["fixtures"] = json!([{
        "name": llama_fixture::FILE_NAME, "sha256": Sha256::of_bytes(llama),
        "gguf": gguf_summary_of(llama_fixture::FILE_NAME, llama)?,
    }]);
    Ok(())
}

/// The data partition (ext4, empty, writable on the board).
/// The second models slot as the image leaves it: holding no models (an empty file, so the
/// partition is a hole the bmap skips). init never maps it until an install puts it first in
/// `MODELS_ORDER` (docs/models-slots.md, decision 4).
pub fn models_b_partition<'a>(ctx: &'a Ctx, models_a: &'a Product) -> Result<Step<'a>> {
    let size = std::fs::metadata(models_a.path())
        .with_context(|| format!("the size of {}", models_a.path().display()))?
        .len();
    Ok(Step {
        name: "models_b partition",
        key: key_of(&["models-b-empty-v2", &size.to_string()]),
        outputs: vec![ctx.work.join("models_b.empty")],
        make: Box::new(move |tmp: &[PathBuf]| {
            use kiln_runtime::models_slot as ms;
            // Zeros (a hole) but the last 4 KiB: the empty footer, which a flash by the bmap
            // writes, so a card's old models_b does not survive a reflash.
            let f = std::fs::File::create(&tmp[0])
                .with_context(|| format!("creating {}", tmp[0].display()))?;
            f.set_len(size)?;
            std::os::unix::fs::FileExt::write_all_at(
                &f,
                &ms::Footer::empty(),
                size - ms::FOOTER_LEN,
            )?;
            f.sync_all()?;
            Ok(format!(
                "empty ({} MiB, the size of models_a): the empty footer, no models until a \
                 models bundle is installed",
                size >> 20
            ))
        }),
    })
}

pub fn data_partition(ctx: &Ctx) -> Step<'_> {
    let uuid = disk::guid_from_seed(&ctx.seed, "data-fs");
    let hash_seed = disk::guid_from_seed(&ctx.seed, "data-hash-seed");
    let size = ctx.board.partitions.data_mib << 20;
    let key = key_of(&[
        "data-v2",
        &ctx.tools.key.to_string(),
        &ctx.epoch.to_string(),
        &uuid.to_string(),
        &hash_seed.to_string(),
        &size.to_string(),
    ]);
    Step {
        name: "data partition",
        key,
        outputs: vec![ctx.work.join("data.ext4")],
        make: Box::new(move |tmp: &[PathBuf]| {
            disk::ext4::build_empty(
                &tmp[0],
                size,
                uuid,
                hash_seed,
                "data",
                ctx.epoch,
                Some(&ctx.tools),
            )?;
            Ok(format!("ext4, empty, {} MiB", size >> 20))
        }),
    }
}

/// U-Boot built from the recipe's `[bootloader]` (none without one). Its `SOURCE_DATE_EPOCH` is
/// the time of the last commit that touched the recipe, so a commit elsewhere reuses the build.
pub fn bootloader(run: &mut Runner, ctx: &Ctx) -> Result<Option<BootloaderOut>> {
    let Some(spec) = &ctx.board.bootloader else {
        return Ok(None);
    };
    let t = Instant::now();
    let input = |n: &str| -> Result<(&Path, Sha256)> {
        let (i, p) = ctx
            .inputs
            .get(n)
            .with_context(|| format!("[bootloader] input {n} is not declared"))?;
        Ok((
            p.as_path(),
            i.sha256.context("bootloader input not pinned")?,
        ))
    };
    let inputs = bootloader::Inputs {
        source: input(&spec.source)?,
        bl31_deb: input(&spec.bl31)?,
        tpl: input(&spec.tpl)?,
    };
    let recipe = ctx.board.path.display().to_string();
    let epoch = super::git(&["log", "-1", "--format=%ct", "--", &recipe])?
        .parse()
        .unwrap_or(ctx.epoch);
    let b = bootloader::build(spec, &inputs, epoch, &ctx.tools, false)?;
    run.record(
        "u-boot",
        b.reused,
        &format!("{} build {}", b.version, b.key.short()),
        t,
    );
    Ok(Some(b))
}

/// A raw bootloader blob of the recipe: where it goes, its file, its input name (or built
/// product's name) and sha256.
pub struct Blob {
    pub lba: u64,
    pub path: PathBuf,
    pub input: String,
    pub sha256: Sha256,
}

pub fn blobs(ctx: &Ctx, built: Option<&BootloaderOut>) -> Result<Vec<Blob>> {
    ctx.board
        .raw
        .iter()
        .map(|b| {
            if let Some(p) = &b.bootloader {
                let built = built.context("a [bootloader] blob without a [bootloader] build")?;
                return Ok(Blob {
                    lba: b.lba,
                    path: built.product(p),
                    input: p.clone(),
                    sha256: built
                        .sha256_of(p)
                        .with_context(|| format!("U-Boot's build has no {p}"))?,
                });
            }
            let (i, p) = ctx
                .inputs
                .get(&b.input)
                .with_context(|| format!("blob input {} not declared", b.input))?;
            Ok(Blob {
                lba: b.lba,
                path: p.clone(),
                input: b.input.clone(),
                sha256: i.sha256.context("blob not locked")?,
            })
        })
        .collect()
}

/// The GPT plan: boot, models, data, sized by the recipe and the models partition.
pub fn layout(ctx: &Ctx, models: &Product) -> Result<layout::Layout> {
    let models_size = std::fs::metadata(models.path())?.len();
    layout::plan(
        &ctx.seed,
        &[
            (layout::NAMES[0], ctx.board.partitions.bootctl_mib << 20),
            (layout::NAMES[1], ctx.board.partitions.boot_mib << 20),
            (layout::NAMES[2], ctx.board.partitions.boot_mib << 20),
            // Both models slots the size of the factory one: a models bundle for this card
            // is a slot image of exactly that size (its footer is the slot's last 4 KiB).
            (layout::NAMES[3], models_size),
            (layout::NAMES[4], models_size),
            (layout::NAMES[5], ctx.board.partitions.data_mib << 20),
        ],
    )
}

/// The files of the boot partition but the manifest: extlinux.conf, kernel, initramfs, dtb.
/// The board's dtb as its file name on the slot (`kernel.dtb` without its folder).
fn dtb_file_name(board: &Board) -> Option<String> {
    board
        .kernel
        .dtb
        .as_ref()
        .map(|d| d.rsplit('/').next().unwrap_or(d).to_string())
}

pub fn boot_files(
    ctx: &Ctx,
    k: &KernelOut,
    initramfs: &Product,
    updates: &Product,
) -> Result<Vec<(String, Vec<u8>)>> {
    let dtb_name = dtb_file_name(&ctx.board);
    let extlinux = super::extlinux_conf(&ctx.board, dtb_name.as_deref());
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("extlinux/extlinux.conf".into(), extlinux.into_bytes()),
        ("Image".into(), std::fs::read(k.image())?),
        ("initramfs.cpio.gz".into(), std::fs::read(initramfs.path())?),
        (super::updates::FILE.into(), std::fs::read(updates.path())?),
    ];
    if let (Some(name), Some(p)) = (&dtb_name, k.dtb()) {
        files.push((name.clone(), std::fs::read(p)?));
    }
    // A kernel without CONFIG_IKCONFIG_PROC (Debian's): its config beside it, where
    // `kernel.config` looks for `config-<release>`.
    if ctx.board.kernel.prebuilt_release.is_some() {
        files.push((format!("config-{}", k.release), std::fs::read(k.config())?));
    }
    Ok(files)
}

/// Everything the manifest records, borrowed from the steps that made it.
pub struct ManifestOf<'a> {
    pub models: &'a [Model],
    pub fixture: &'a [u8],
    pub kernel: &'a KernelOut,
    pub runtime: &'a Runtime,
    pub layout: &'a layout::Layout,
    pub blobs: &'a [Blob],
    pub bootloader: Option<&'a BootloaderOut>,
    pub initramfs: &'a Product,
    pub boot_files: &'a [(String, Vec<u8>)],
    pub board_toml: &'a str,
    /// The [`kernel_modules`] step's product, if the board loads modules.
    pub modules: Option<&'a Product>,
    /// The [`licences`] step's product: input name → declared licence.
    pub licences: &'a Product,
}

/// The manifest as it goes on the boot partition (`kiln/manifest.json`); the published one adds
/// the disk image's sha256 ([`manifest_file`]).
pub fn manifest(ctx: &Ctx, m: &ManifestOf) -> Result<Value> {
    let initramfs_files: Value = serde_json::from_slice(&std::fs::read(&m.initramfs.paths[1])?)?;
    let initramfs_sha = Sha256::of_file_memo(m.initramfs.path())?;
    let initramfs_size = std::fs::metadata(m.initramfs.path())?.len();
    let boot_listing: BTreeMap<String, Value> = m
        .boot_files
        .iter()
        .map(|(p, b)| {
            (
                format!("/{p}"),
                json!({"size": b.len(), "sha256": Sha256::of_bytes(b)}),
            )
        })
        .collect();
    let (board, commit, k, npu) = (&ctx.board, &ctx.commit, m.kernel, &m.runtime.npu);
    let toolchain = crate::doctor::cross_toolchain()?;
    let modules_doc: Option<Value> = match m.modules {
        Some(p) => Some(serde_json::from_slice(&std::fs::read(&p.paths[1])?)?),
        None => None,
    };
    let licences: Value = serde_json::from_slice(&std::fs::read(m.licences.path())?)?;
    let inputs: Vec<Value> = ctx
        .inputs
        .values()
        .map(|(i, _)| {
            let mut v = json!({
                "name": i.name, "version": i.version, "source": i.describe_source(), "distro": i.distro, "sha256": i.sha256,
            });
            if let Some(l) = licences.get(&i.name) {
                v["license"] = l["license"].clone();
                if let Some(r) = l.get("reason") {
                    v["license_reason"] = r.clone();
                }
            }
            v
        })
        .collect();
    Ok(json!({
        "kiln_manifest": 1,
        "board": board.name,
        "commit": commit.hash,
        "uncommitted_changes": commit.dirty,
        "source_date_epoch": ctx.epoch,
        "seed": ctx.seed,
        "inputs": inputs,
        "models": m.models.iter().map(|x| json!({"name": x.name, "sha256": x.sha256, "gguf": x.gguf})).collect::<Vec<_>>(),
        "fixture": {
            "name": fixture::FILE_NAME, "sha256": Sha256::of_bytes(m.fixture),
            "gguf": gguf_summary_of(fixture::FILE_NAME, m.fixture)?,
        },
        "kernel": {
            "release": k.release, "key": k.key, "build_timestamp": k.build_timestamp,
            "image_sha256": k.image_sha256, "config_sha256": k.config_sha256, "dtb_sha256": k.dtb_sha256,
            "fragment": board.kernel.fragment, "base": board.kernel.base,
            "package": board.kernel.prebuilt_release.as_ref().and_then(|_| ctx.inputs.get(&board.kernel.source)).map(|(i, _)| {
                let package = match &i.source { pins::Source::Deb { package, .. } => package.as_str(), _ => "" };
                json!({"input": i.name, "package": package, "version": i.version, "sha256": i.sha256})
            }),
        },
        "runtime": {"path": "/usr/bin/kiln", "sha256": m.runtime.kiln_sha},
        "crates": m.runtime.crates.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
        "npu_runtime": npu.as_ref().map(|(b, o)| json!({"path": "/usr/lib/librknnrt.so", "from": o, "sha256": Sha256::of_bytes(b)})),
        "toolchain": {
            "rust": toolchain.rustc_version, "cross_gcc": k.toolchain,
            "rust_std": {"target": crate::doctor::AARCH64, "files_sha256": toolchain.std_sha256},
            "linker": "aarch64-linux-gnu-gcc of the tools root",
        },
        "tools_root": ctx.tools.describe(),
        "disk": m.layout.describe(),
        "raw_blobs": m.blobs.iter().map(|b| json!({"input": b.input, "lba": b.lba, "sha256": b.sha256})).collect::<Vec<_>>(),
        "bootloader": m.bootloader.zip(board.bootloader.as_ref()).map(|(b, s)| json!({
            "version": b.version, "key": b.key, "defconfig": b.defconfig,
            "build_timestamp": b.build_timestamp, "cross_gcc": b.toolchain,
            "source": {"input": s.source, "sha256": ctx.inputs.get(&s.source).and_then(|(i, _)| i.sha256)},
            "bl31": {"input": s.bl31, "path": s.bl31_in_deb, "deb_sha256": ctx.inputs.get(&s.bl31).and_then(|(i, _)| i.sha256), "elf_sha256": b.bl31_sha256},
            "rockchip_tpl": {"input": s.tpl, "sha256": ctx.inputs.get(&s.tpl).and_then(|(i, _)| i.sha256)},
            "rockchip_tpl_licence": s.tpl_licence.as_ref().map(|n| json!({"input": n, "sha256": ctx.inputs.get(n).and_then(|(i, _)| i.sha256), "card": "kiln/licenses/rkbin/LICENSE"})),
            "products": b.products.iter().map(|(n, h)| json!({"file": n, "sha256": h})).collect::<Vec<_>>(),
        })),
        "initramfs": {"sha256": initramfs_sha, "size": initramfs_size, "files": initramfs_files},
        "kernel_modules": modules_doc,
        "boot": {"files": boot_listing},
        "expect": toml::from_str::<toml::Value>(m.board_toml)?,
    }))
}

/// The Debian inputs of the board: the pin, the cached .deb and its package name.
fn deb_inputs(ctx: &Ctx) -> Vec<(&pins::Input, &PathBuf, &str)> {
    ctx.inputs
        .values()
        .filter_map(|(i, p)| match &i.source {
            pins::Source::Deb { package, .. } => Some((i, p, package.as_str())),
            pins::Source::Supplied { .. } | pins::Source::Url { .. } => None,
        })
        .collect()
}

/// `licences.json`: the declared licence of every Debian input, from the DEP-5 `copyright` file
/// in its .deb ([`crate::sbom::dep5`]): `{"<input>": {"license": <SPDX expression or
/// NOASSERTION>, "reason": <why NOASSERTION>}}`. Keyed by the debs' hashes and the reader's
/// source, so a no-op rebuild opens no .deb; the manifest records the result per input.
pub fn licences(ctx: &Ctx) -> Step<'_> {
    use crate::sbom::dep5;
    let debs = deb_inputs(ctx);
    let mut parts = vec![
        "licences-v1".to_string(),
        Sha256::of_bytes(dep5::SOURCE.as_bytes()).to_string(),
    ];
    for (i, _, package) in &debs {
        let sha = i.sha256.map(|h| h.to_string()).unwrap_or_default();
        parts.push(format!("{} {package} {sha}", i.name));
    }
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    Step {
        name: "licences",
        key: key_of(&parts),
        outputs: vec![ctx.work.join("licences.json")],
        make: Box::new(move |tmp: &[PathBuf]| {
            let mut out = BTreeMap::new();
            let (mut declared, mut none) = (0, 0);
            for (i, path, package) in debs {
                let v = match dep5::of_deb(path, package)
                    .with_context(|| format!("the licence of {}", i.name))?
                {
                    dep5::Licence::Spdx(e) => {
                        declared += 1;
                        json!({"license": e})
                    }
                    dep5::Licence::NoAssertion(why) => {
                        none += 1;
                        json!({"license": "NOASSERTION", "reason": why})
                    }
                };
                out.insert(i.name.clone(), v);
            }
            write_atomic(&tmp[0], &serde_json::to_vec_pretty(&out)?)?;
            Ok(format!(
                "{declared} declared from DEP-5 copyright files, {none} NOASSERTION"
            ))
        }),
    }
}

/// `licence-texts.tar`: the licence texts for `kiln/licenses/` on the boot partition
/// ([`crate::sbom::texts`]): each Debian input's copyright file, the kernel source's licence
/// texts, each crate's licence files and a README. Keyed by the debs' and the kernel source's
/// hashes and by each crate licence file's hash (a stat each through the memo), so a no-op
/// rebuild opens no .deb and unpacks no kernel.
pub fn licence_texts<'a>(ctx: &'a Ctx, rt: &'a Runtime) -> Result<Step<'a>> {
    use crate::sbom::{dep5, texts};
    let debs = deb_inputs(ctx);
    let spec = &ctx.board.kernel;
    let (kernel_input, kernel_src) = ctx
        .inputs
        .get(&spec.source)
        .with_context(|| format!("kernel source input {} not declared", spec.source))?;
    let kernel_sha = kernel_input.sha256.context("kernel source not locked")?;
    let texts::CrateTexts {
        files: crate_files,
        without: crates_without,
    } = texts::crate_files(&rt.crates)?;
    let kiln_licence = workspace_licence()?;
    let mut parts = vec![
        "licence-texts-v1".to_string(),
        Sha256::of_bytes(texts::SOURCE.as_bytes()).to_string(),
        Sha256::of_bytes(dep5::SOURCE.as_bytes()).to_string(),
        format!("kernel {} {kernel_sha}", spec.source),
        format!("kiln {kiln_licence}"),
    ];
    for (i, _, package) in &debs {
        let sha = i.sha256.map(|h| h.to_string()).unwrap_or_default();
        parts.push(format!("{} {package} {sha}", i.name));
    }
    for (card, file) in &crate_files {
        parts.push(format!("{card}={}", Sha256::of_file_memo(file)?));
    }
    parts.push(format!("without {}", crates_without.join(",")));
    // A boot loader built here: U-Boot's source's licence texts and the TPL blob's notice.
    let mut loader_inputs = None;
    if let Some(b) = &ctx.board.bootloader {
        let get = |n: &str| {
            ctx.inputs
                .get(n)
                .with_context(|| format!("[bootloader] input {n} is not declared"))
        };
        let (src_input, src_path) = get(&b.source)?;
        let src_sha = src_input.sha256.context("U-Boot source not pinned")?;
        parts.push(format!("u-boot {src_sha}"));
        let tpl_licence = match &b.tpl_licence {
            Some(n) => {
                let (i, p) = get(n)?;
                parts.push(format!("tpl licence {}", Sha256::of_file_memo(p)?));
                Some((i.name.clone(), p.clone()))
            }
            None => None,
        };
        loader_inputs = Some((
            src_input.version.clone(),
            src_path.clone(),
            src_sha,
            tpl_licence,
        ));
    }
    let key = key_of(&parts.iter().map(String::as_str).collect::<Vec<_>>());
    let crates_with = rt.crates.len() - crates_without.len();
    Ok(Step {
        name: "licence texts",
        key,
        outputs: vec![ctx.work.join("licence-texts.tar")],
        make: Box::new(move |tmp: &[PathBuf]| {
            let mut files: Vec<(String, Vec<u8>)> = Vec::new();
            let mut deb_state = Vec::new();
            for (i, path, package) in &debs {
                match dep5::copyright_of_deb(path, package)
                    .with_context(|| format!("the copyright file of {}", i.name))?
                {
                    Ok(b) => {
                        files.push((format!("{}/deb/{}/copyright", texts::DIR, i.name), b));
                        deb_state.push((i.name.as_str(), None));
                    }
                    Err(why) => deb_state.push((i.name.as_str(), Some(why))),
                }
            }
            // A kernel taken from a Debian package has its copyright with the other debs'.
            if spec.prebuilt_release.is_none() {
                for (f, b) in kernel::licence_texts(spec, kernel_src, &kernel_sha)? {
                    files.push((format!("{}/kernel/{f}", texts::DIR), b));
                }
            }
            if let Some((_, src, sha, tpl_licence)) = &loader_inputs {
                for (f, b) in bootloader::licence_texts(&ctx.tools, src, sha)? {
                    files.push((format!("{}/u-boot/Licenses/{f}", texts::DIR), b));
                }
                if let Some((name, p)) = tpl_licence {
                    let b = std::fs::read(p)
                        .with_context(|| format!("reading {name} ({})", p.display()))?;
                    files.push((format!("{}/rkbin/LICENSE", texts::DIR), b));
                }
            }
            for (card, file) in &crate_files {
                files.push((
                    card.clone(),
                    std::fs::read(file).with_context(|| format!("reading {}", file.display()))?,
                ));
            }
            let readme = texts::readme(&texts::Gathered {
                debs: deb_state,
                kernel: spec
                    .prebuilt_release
                    .is_none()
                    .then_some(ctx.board.expect.kernel_release.as_str()),
                u_boot: loader_inputs.as_ref().map(|(v, ..)| v.as_str()),
                tpl_licence: loader_inputs
                    .as_ref()
                    .and_then(|(.., t)| t.as_ref().map(|(n, _)| n.as_str())),
                crates_with,
                crates_without: &crates_without,
                kiln: &kiln_licence,
            });
            files.push((format!("{}/README", texts::DIR), readme.into_bytes()));
            files.sort();
            texts::write_tar(&tmp[0], &files)?;
            let size: usize = files.iter().map(|(_, b)| b.len()).sum();
            Ok(format!(
                "{} files, {:.2} MiB ({} crates without a licence file)",
                files.len(),
                size as f64 / 1048576.0,
                crates_without.len()
            ))
        }),
    })
}

/// The `license` of the workspace's Cargo.toml (`[workspace.package]`): kiln's own.
fn workspace_licence() -> Result<String> {
    let p = crate::paths::project_root().join("Cargo.toml");
    let v: toml::Value = toml::from_str(
        &std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
    )
    .with_context(|| format!("parsing {}", p.display()))?;
    v.get("workspace")
        .and_then(|w| w.get("package"))
        .and_then(|p| p.get("license"))
        .and_then(|l| l.as_str())
        .map(str::to_string)
        .with_context(|| format!("{}: no [workspace.package] license", p.display()))
}

/// The boot files of the [`licence_texts`] step's product.
pub fn licence_files(texts: &Product) -> Result<Vec<(String, Vec<u8>)>> {
    crate::sbom::texts::read_tar(texts.path())
}

/// `kiln/sbom/kiln-<board>.{spdx,cdx}.json` for the boot partition: the SBOMs of the boot
/// manifest with the system on the card as their root ([`crate::sbom::Root::System`]: the
/// image that contains them cannot be named by its hash). Made from the manifest as it is, then
/// listed in its `boot.files` (so `image.manifest` hashes them on the board): the SBOMs read
/// nothing of `boot.files`, so neither their own hashes nor the manifest's are in them.
pub fn card_sboms(manifest: &mut Value) -> Result<Vec<(String, Vec<u8>)>> {
    use crate::sbom::{self, Root};
    let board = manifest["board"]
        .as_str()
        .context("manifest: no board")?
        .to_string();
    let docs = sbom::documents(manifest, Root::System)?;
    let files: Vec<(String, Vec<u8>)> = Root::System
        .file_names(&board)
        .into_iter()
        .zip(docs)
        .collect();
    let listing = manifest["boot"]["files"]
        .as_object_mut()
        .context("manifest: no boot.files")?;
    for (p, b) in &files {
        listing.insert(
            format!("/{p}"),
            json!({"size": b.len(), "sha256": Sha256::of_bytes(b)}),
        );
    }
    Ok(files)
}

/// A FAT partition image of `files`: its volume id from the seed and `role`, dated `epoch`,
/// keyed on the files' hashes (`version` names the step's key format).
struct FatPart<'a> {
    name: &'static str,
    version: &'static str,
    role: &'static str,
    label: &'static str,
    file: &'static str,
    size_mib: u64,
    said: Option<&'static str>,
    ctx: &'a Ctx,
}

impl<'a> FatPart<'a> {
    fn step(self, files: Vec<(String, Vec<u8>)>) -> Step<'a> {
        let ctx = self.ctx;
        let volume_id = disk::u32_from_seed(&ctx.seed, self.role);
        let size_mib = self.size_mib;
        let mut parts = vec![
            self.version.to_string(),
            ctx.epoch.to_string(),
            volume_id.to_string(),
            size_mib.to_string(),
        ];
        parts.extend(
            files
                .iter()
                .map(|(p, b)| format!("{p}={}", Sha256::of_bytes(b))),
        );
        let (label, said) = (self.label, self.said);
        Step {
            name: self.name,
            key: key_of(&parts.iter().map(String::as_str).collect::<Vec<_>>()),
            outputs: vec![ctx.work.join(self.file)],
            make: Box::new(move |tmp: &[PathBuf]| {
                disk::fat::build(&tmp[0], size_mib << 20, volume_id, label, &files, ctx.epoch)?;
                Ok(said.map_or_else(|| format!("FAT, {} files", files.len()), str::to_string))
            }),
        }
    }
}

/// The boot slot's file system (FAT32; `boot_a` and `boot_b` on a new image): `files` and the
/// manifest at `kiln/manifest.json`.
pub fn boot_partition<'a>(
    ctx: &'a Ctx,
    mut files: Vec<(String, Vec<u8>)>,
    manifest: &Value,
) -> Result<Step<'a>> {
    files.push(("kiln/manifest.json".into(), boot_manifest_bytes(manifest)?));
    Ok(FatPart {
        name: "boot partition",
        version: "boot-v1",
        role: "boot-fs",
        label: "KILN-BOOT",
        file: "boot.vfat",
        size_mib: ctx.board.partitions.boot_mib,
        said: None,
        ctx,
    }
    .step(files))
}

/// p1 `bootctl` (FAT): `boot.scr` and `kiln/abstate.env` ([`super::bootscr`]).
pub fn bootctl_partition(ctx: &Ctx) -> Result<Step<'_>> {
    Ok(FatPart {
        name: "bootctl partition",
        version: "bootctl-v1",
        role: "bootctl-fs",
        label: "KILN-CTL",
        file: "bootctl.vfat",
        size_mib: ctx.board.partitions.bootctl_mib,
        said: Some("boot.scr and kiln/abstate.env (BOOT_ORDER A B, 3 tries each)"),
        ctx,
    }
    .step(super::bootscr::files(
        ctx.epoch,
        &super::append_line(&ctx.board),
        dtb_file_name(&ctx.board).as_deref(),
    )?))
}

/// The disk image (GPT, the five partitions, the raw blobs; sparse) and its `.sha256` file.
pub fn disk_image<'a>(
    ctx: &'a Ctx,
    out_dir: &Path,
    lay: &'a layout::Layout,
    parts: [&'a Product; 6],
    blobs: &'a [Blob],
) -> Result<Step<'a>> {
    let img = out_dir.join(format!("kiln-{}.img", ctx.board.name));
    let mut key_parts = vec!["image-v3".to_string()];
    key_parts.extend(parts.iter().map(|p| p.key.to_string()));
    let key = key_of(&[
        &key_parts.join(","),
        &serde_json::to_string(&lay.describe())?,
        &blobs
            .iter()
            .map(|b| format!("{}={}", b.lba, b.sha256))
            .collect::<Vec<_>>()
            .join(","),
    ]);
    Ok(Step {
        name: "disk image",
        key,
        outputs: vec![img.clone(), img.with_extension("img.sha256")],
        make: Box::new(move |tmp: &[PathBuf]| {
            let specs: Vec<(disk::gpt::PartitionSpec, PathBuf)> = lay
                .parts
                .iter()
                .zip(parts)
                .map(|(spec, p)| (spec.clone(), p.path().to_path_buf()))
                .collect();
            let raw: Vec<(u64, PathBuf)> = blobs
                .iter()
                .map(|b| (b.lba * 512, b.path.clone()))
                .collect();
            disk::assemble(&tmp[0], lay.total_size, lay.disk_guid, &specs, &raw)?;
            let sha = Sha256::of_file(&tmp[0])?;
            write_atomic(
                &tmp[1],
                format!("{sha}  kiln-{}.img\n", ctx.board.name).as_bytes(),
            )?;
            Ok(format!(
                "{:.1} MiB, sparse, sha256 {}",
                lay.total_size as f64 / 1048576.0,
                sha.short()
            ))
        }),
    })
}

/// The image's sha256, from the disk step's `.sha256` file.
pub fn image_sha256(disk: &Product) -> Result<Sha256> {
    let text = std::fs::read_to_string(&disk.paths[1])?;
    text.split_whitespace()
        .next()
        .unwrap_or("")
        .parse()
        .with_context(|| format!("{}", disk.paths[1].display()))
}

/// The `.bmap` of the disk image.
pub fn bmap(disk: &Product) -> Step<'_> {
    Step {
        name: "bmap",
        key: key_of(&["bmap-v1", &disk.key.to_string()]),
        outputs: vec![disk.path().with_extension("img.bmap")],
        make: Box::new(move |tmp: &[PathBuf]| {
            crate::bmap::create(disk.path(), &tmp[0])?;
            Ok("written".into())
        }),
    }
}

/// `kiln-<board>.spdx.json` and `kiln-<board>.cdx.json` beside the image: the SBOMs of its
/// manifest ([`crate::sbom`]), remade when the manifest or the SBOM code changes.
pub fn sboms<'a>(manifest: &'a Product, board: &str) -> Result<Step<'a>> {
    let dir = manifest
        .path()
        .parent()
        .context("the manifest has no directory")?;
    Ok(Step {
        name: "sboms",
        key: key_of(&[
            "sboms-v1",
            &manifest.key.to_string(),
            &Sha256::of_bytes(crate::sbom::SOURCE.as_bytes()).to_string(),
        ]),
        outputs: vec![
            dir.join(format!("kiln-{board}.spdx.json")),
            dir.join(format!("kiln-{board}.cdx.json")),
        ],
        make: Box::new(move |tmp: &[PathBuf]| {
            let m: Value = serde_json::from_slice(
                &std::fs::read(manifest.path())
                    .with_context(|| format!("reading {}", manifest.path().display()))?,
            )?;
            let [spdx, cdx] = crate::sbom::documents(&m, crate::sbom::Root::Image)?;
            std::fs::write(&tmp[0], spdx)?;
            std::fs::write(&tmp[1], cdx)?;
            Ok("SPDX 2.3 and CycloneDX 1.6".into())
        }),
    })
}

/// The bytes of `kiln/manifest.json` on the boot partition, as [`boot_partition`] writes them.
pub fn boot_manifest_bytes(manifest: &Value) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec_pretty(manifest)?)
}

/// `target/images/manifest.json`: the boot partition's manifest plus the disk image's and
/// partition images' sha256 and the boot manifest's own sha256 (`image.boot_manifest_sha256`,
/// the `manifest=` of the board's verdict line; the boot copy cannot hold its own hash). Beside
/// it, `kiln-<board>.manifest.sha256` holds that hash as `sha256sum -c` reads it from the root
/// of the mounted boot partition.
pub fn manifest_file<'a>(
    out_dir: &Path,
    mut manifest: Value,
    disk: &Product,
    parts: [&Product; 6],
    size: u64,
) -> Result<Step<'a>> {
    let boot_sha = Sha256::of_bytes(&boot_manifest_bytes(&manifest)?);
    let part_shas: Vec<Value> = parts
        .iter()
        .map(|p| Ok(json!({"image": p.path().file_name().map(|n| n.to_string_lossy().into_owned()), "sha256": Sha256::of_file_memo(p.path())?})))
        .collect::<Result<_>>()?;
    manifest["image"] = json!({
        "file": disk.path().file_name().map(|n| n.to_string_lossy().into_owned()),
        "size": size, "sha256": image_sha256(disk)?, "partition_images": part_shas,
        "boot_manifest_sha256": boot_sha,
    });
    let bytes = serde_json::to_vec_pretty(&manifest)?;
    let sidecar = disk.path().with_extension("manifest.sha256");
    Ok(Step {
        name: "manifest",
        key: key_of(&["manifest-v2", &Sha256::of_bytes(&bytes).to_string()]),
        outputs: vec![out_dir.join("manifest.json"), sidecar],
        make: Box::new(move |tmp: &[PathBuf]| {
            write_atomic(&tmp[0], &bytes)?;
            write_atomic(
                &tmp[1],
                format!("{boot_sha}  kiln/manifest.json\n").as_bytes(),
            )?;
            Ok(format!(
                "{} bytes, boot manifest sha256 {}",
                bytes.len(),
                boot_sha.short()
            ))
        }),
    })
}

/// The boot manifest's sha256, from the manifest step's `.manifest.sha256` file.
pub fn boot_manifest_sha256(manifest: &Product) -> Result<Sha256> {
    let text = std::fs::read_to_string(&manifest.paths[1])?;
    text.split_whitespace()
        .next()
        .unwrap_or("")
        .parse()
        .with_context(|| format!("{}", manifest.paths[1].display()))
}

/// The NPU runtime library for the image, if the board has one: bytes and where they came from.
fn npu_library(board: &Board, inputs: &Inputs) -> Result<Option<(Vec<u8>, String)>> {
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
    let manifest = crate::paths::project_root().join("runtime/rknn-standin/Cargo.toml");
    if !manifest.exists() {
        println!(
            "image: WARNING: NPU stand-in hook: {} is not in this checkout; the image has no \
             /usr/lib/librknnrt.so",
            manifest.display()
        );
        return Ok(None);
    }
    let tc = crate::doctor::cross_toolchain()?;
    let sh = crate::paths::shell()?;
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
    let so = crate::paths::target_dir()
        .join(crate::doctor::AARCH64)
        .join("release/librknn_standin.so");
    Ok(Some(
        std::fs::read(&so).with_context(|| format!("reading {}", so.display()))?,
    ))
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
    inputs: &Inputs,
    kiln: &[u8],
    npu: &Option<(Vec<u8>, String)>,
    board_toml: &str,
    serve_env: &str,
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
    // fsck.fat alone from dosfstools: init repairs the FAT partitions before mounting them.
    let dosfs = rootfs::deb_tree(deb("dosfstools")?, "dosfstools")?;
    let fsck = dosfs
        .nodes
        .get("sbin/fsck.fat")
        .context("dosfstools has no /sbin/fsck.fat")?;
    t.add("sbin/fsck.fat", 0o755, fsck.kind.clone(), "dosfstools")?;
    roots.push("sbin/fsck.fat");
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
    t.add(
        "etc/kiln/serve.env",
        0o644,
        NodeKind::File(serve_env.as_bytes().to_vec()),
        "images/<board>.toml [serve] [network]",
    )?;
    rootfs::add_host_tree(
        &mut t,
        &crate::paths::project_root().join("rootfs/overlay"),
        "rootfs/overlay",
    )?;
    if !t.nodes.contains_key("init") {
        println!("image: WARNING: rootfs/overlay/init is missing: the kernel will find no /init");
    }
    let libs = rootfs_libs(inputs, &["busybox-static", "dosfstools"])?;
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
fn stage_models(dir: &Path, models: &[Model], fixture: &[u8]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    stage_file(&dir.join(fixture::FILE_NAME), fixture)?;
    for m in models {
        let dst = dir.join(&m.name);
        std::fs::copy(&m.path, &dst)
            .with_context(|| format!("copying model {}", m.path.display()))?;
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o644))?;
    }
    Ok(())
}

/// One file of the models partition, mode 0644.
fn stage_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_runtime::selftest::model_nll;

    /// The card's SBOMs are those of the manifest before they were listed in it (so neither
    /// their own hashes nor the manifest's are in them), and `boot.files` lists them after.
    #[test]
    fn card_sboms_are_listed_after_they_are_made() {
        let mut m = json!({
            "board": "qemu-virt", "commit": "ce98691998e7fe36e0b2c29d74b0476de3e837df",
            "source_date_epoch": 1796312582, "inputs": [],
            "kernel": {"release": "6.1.192-kiln", "image_sha256": "4596"},
            "runtime": {"sha256": "d6e5"},
            "fixture": {"name": "kiln-selftest.gguf", "sha256": "5b20"},
            "boot": {"files": {"/Image": {"size": 1, "sha256": "ab"}}},
        });
        let before = m.clone();
        let files = card_sboms(&mut m).unwrap();
        let want = crate::sbom::documents(&before, crate::sbom::Root::System).unwrap();
        assert_eq!(files.len(), 2);
        for ((p, b), w) in files.iter().zip(&want) {
            assert_eq!(b, w, "{p}");
            assert_eq!(
                m["boot"]["files"][format!("/{p}")],
                json!({"size": b.len(), "sha256": Sha256::of_bytes(b)})
            );
        }
        assert_eq!(files[0].0, "kiln/sbom/kiln-qemu-virt.spdx.json");
        assert_eq!(m["boot"]["files"].as_object().unwrap().len(), 3);
        // Made again from the manifest that lists them: the same bytes.
        let again = crate::sbom::documents(&m, crate::sbom::Root::System).unwrap();
        assert_eq!(again, want);
    }

    /// The self-check fixture's metadata and its four tensor types, read by kiln's GGUF parser.
    #[test]
    fn gguf_summary_of_the_fixture() {
        let g = gguf_summary_of("fixture", &fixture::gguf().unwrap()).unwrap();
        assert_eq!(g["general.architecture"], "kiln-fixture");
        assert!(g["general.name"]
            .as_str()
            .unwrap()
            .starts_with("kiln self-check"));
        assert_eq!(
            g["tensor_types"],
            json!({"F32": 1, "F16": 1, "Q4_0": 1, "Q8_0": 1})
        );
        assert!(g.get("general.license").is_none());
        assert_eq!(file_type_name(3), Some("MOSTLY_Q4_1"));
        assert_eq!(file_type_name(4), None);
        assert!(gguf_summary_of("x", b"not a gguf").is_err());
    }

    /// The known answers the image records: the llama fixture (and SmolLM2 when
    /// `KILN_SMOLLM2` names it, as the test stages do) on the committed text, into the manifest.
    #[test]
    fn known_answers_are_recorded_in_the_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let llama = llama_fixture::gguf().unwrap();
        let lp = dir.path().join(llama_fixture::FILE_NAME);
        std::fs::write(&lp, &llama).unwrap();
        let mut answers =
            vec![model_nll::record(&lp, llama_fixture::FILE_NAME, known_text()).unwrap()];
        if let Some(p) = std::env::var_os("KILN_SMOLLM2") {
            let t = Instant::now();
            let a = model_nll::record(Path::new(&p), "smollm2.gguf", known_text()).unwrap();
            eprintln!("{} ({:.1} s)", a.summary(), t.elapsed().as_secs_f64());
            answers.push(a);
        }
        let a = &answers[0];
        assert_eq!(a.tokens[0], 1, "BOS first");
        assert!(a.mean_nll.is_finite() && a.tolerance > 0.0, "{a:?}");
        eprintln!(
            "fixture: {} tokens, mean NLL {:.6}",
            a.tokens.len(),
            a.mean_nll
        );
        let f = dir.path().join("known-answers-nll.json");
        std::fs::write(&f, serde_json::to_vec(&answers).unwrap()).unwrap();
        let product = Product {
            paths: vec![f],
            key: Sha256::of_bytes(b"test"),
        };
        let mut m = json!({"kiln_manifest": 1, "known_answers": {"matmul": []}});
        manifest_known_answers_nll(&mut m, &product, &llama).unwrap();
        assert!(
            m["known_answers"]["matmul"].is_array(),
            "other answers kept"
        );
        let back: Vec<model_nll::NllAnswer> =
            serde_json::from_value(m["known_answers"]["nll"].clone()).unwrap();
        // JSON keeps each number to within an ulp; the tokens and names exactly.
        assert_eq!(back.len(), answers.len());
        for (b, a) in back.iter().zip(&answers) {
            assert_eq!(
                (&b.model, &b.tokens, &b.text),
                (&a.model, &a.tokens, &a.text)
            );
            assert!((b.mean_nll - a.mean_nll).abs() < 1e-12 && b.tolerance == a.tolerance);
        }
        assert_eq!(
            m["fixtures"][0]["sha256"],
            json!(Sha256::of_bytes(&llama).to_string())
        );
    }
}
