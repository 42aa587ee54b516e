//! `cargo xtask bundle`: a signed RAUC bundle (verity format) of the boot slot, made by Debian's
//! `rauc` in the tools root from the image pipeline's own `boot.vfat` (built, or reused, by the
//! same run). `compatible` = `kiln-<board>` (what the board's `/etc/rauc/system.conf` says),
//! `version` = the commit. One image, `boot.vfat`, for the slot class `boot` (RAUC installs it
//! into whichever of `boot_a`/`boot_b` is not booted).
//!
//! What is the same from the same commit, and what is not: the payload (`boot.vfat`, and the
//! squashfs mksquashfs makes of it under `SOURCE_DATE_EPOCH`) is byte-identical; the bundle is
//! not, because RAUC draws a random dm-verity salt for every bundle and the CMS signature holds
//! its signing time. `bundle.json` beside the bundle records the payload's sha256 for comparison.

use crate::atomic::write_atomic;
use crate::disk::gpt;
use crate::image::updates;
use crate::pins::Sha256;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
#[group(skip)]
pub struct Args {
    /// The image the bundle is of, as `cargo xtask image` takes it (built, or reused, first).
    /// The bundle carries its boot slot only.
    #[command(flatten)]
    pub image: crate::image::Args,
    /// The signing key (PEM). Without it: kiln's public development key, with a warning.
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,
    /// The signing certificate (PEM); the board's keyring must hold it or its CA.
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,
    /// Where to write the bundle (default: target/images/kiln-<board>-<commit>.raucb, or
    /// `-models.raucb` with `--models-slot`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A bundle of a models slot instead of the boot slot (docs/models-slots.md) for the image's
    /// `--model` files: the erofs of them and the self-check's fixtures, its dm-verity hash tree
    /// and its `kiln-models.json` carrying the self-check's known answers for them (the image's own
    /// steps; no system is built), that JSON signed by the bundle's key (detached CMS, checked
    /// against the board's keyring here), as the image `models.img` for the slot class `models`.
    /// A board installs it into its models slot not in use and maps that slot at the next boot.
    #[arg(long)]
    pub models_slot: bool,
    /// A models bundle of these GGUF files (and the self-check's fixtures), with the known
    /// answers the self-check judges them by, computed here by the image's own steps and signed
    /// with the slot: `--models-slot` of these models, without building a system. Several may
    /// follow one `--models`.
    #[arg(id = "models_files", long = "models", num_args = 1.., value_name = "M.gguf")]
    pub models: Vec<PathBuf>,
    /// A models bundle whose known NLL answer of its last model is edited (+1 nat) before it
    /// is signed: signed and installable, but the self-check must FAIL it (for tests).
    #[arg(long, hide = true)]
    pub wrong_known_answer: bool,
    /// A models bundle that says it is this models format (its slot's JSON and the hook's
    /// file), for tests of the refusal of a format the running system does not read.
    #[arg(long, hide = true)]
    pub models_format: Option<u32>,
    /// A `compatible` other than the board's (for tests of RAUC's refusal).
    #[arg(long, hide = true)]
    pub compatible: Option<String>,
    /// Another models format the bundle's system says it reads (for tests of the refusal of a
    /// system that cannot read the models slot in use).
    #[arg(long, hide = true)]
    pub system_models_format: Option<u32>,
    /// The keyring the new bundle must verify against (default: the board's, what its RAUC
    /// trusts), for tests of other keys.
    #[arg(long, hide = true)]
    pub keyring: Option<PathBuf>,
    /// A system that must FAIL its self-check: the bundle's `kiln/manifest.json` records another
    /// sha256 for `/Image` (for tests of the failure a fleet must hear).
    #[arg(long, hide = true)]
    pub failing_system: bool,
    /// Another factory models slot (`kiln-models.json` sha256) the bundle's system says it
    /// names (for tests of the refusal of a system that would not believe an unsigned slot).
    #[arg(long, hide = true)]
    pub system_factory_models: Option<String>,
}

impl Args {
    /// A bundle of the qemu-virt image without a model (the one `boot-qemu-ab` boots), signed
    /// with `key`/`cert` (none: the development pair), written to `out`, checked against
    /// `keyring` (none: the board's): what the update tests make.
    pub fn qemu_virt(
        key_cert: Option<(PathBuf, PathBuf)>,
        out: PathBuf,
        keyring: Option<PathBuf>,
    ) -> Args {
        let (key, cert) = key_cert.unzip();
        Args {
            image: crate::image::Args {
                board: "qemu-virt".into(),
                models: vec![],
                offline: false,
                dev_keys: false,
            },
            key,
            cert,
            out: Some(out),
            models_slot: false,
            models: vec![],
            wrong_known_answer: false,
            models_format: None,
            compatible: None,
            system_models_format: None,
            keyring,
            failing_system: false,
            system_factory_models: None,
        }
    }
}

/// What a bundle run made.
pub struct Bundle {
    pub path: PathBuf,
    /// The payload's file name in the bundle (`boot.vfat` or `models.img`).
    pub payload_name: &'static str,
    /// sha256 of the payload.
    pub payload: Sha256,
}

pub fn run(args: Args) -> Result<()> {
    let b = make(&args)?;
    println!(
        "bundle: {} (payload {} sha256 {})",
        b.path.display(),
        b.payload_name,
        b.payload
    );
    println!(
        "bundle: on the board: `rauc install {}` (or `kiln.update=` on the kernel command line)",
        b.path.file_name().and_then(|n| n.to_str()).unwrap_or("")
    );
    Ok(())
}

fn pem(path: &Path, what: &str, marker: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).with_context(|| format!("{what} {}", path.display()))?;
    if !String::from_utf8_lossy(&bytes).contains(marker) {
        bail!(
            "{what} {}: no `{marker}` in it (a PEM file is expected)",
            path.display()
        );
    }
    Ok(bytes)
}

/// What the bundle's system reads, for its hook (decision 6 of `docs/models-slots.md`): the
/// models format (`kiln_runtime::models_slot::FORMAT` of the runtime it carries) and the factory
/// models slot its manifest names (`models_slot.meta_sha256`).
const SYSTEM_FORMAT_FILE: &str = "kiln-models-format.txt";
const SYSTEM_FACTORY_FILE: &str = "kiln-models-factory.txt";

/// A system update never rewrites the models, so RAUC's install-check hook refuses a system that
/// could not believe the models slot in use (`kiln verity active`, read on the card now): one
/// that reads another models format (install a models bundle of its format first), or, for an
/// unsigned slot, one whose manifest names another factory slot (a slot of another image: a
/// models bundle first, or reflash). A signed slot of the format it reads is believed by its
/// signature. A hook replaces RAUC's own `compatible` check, so it makes that check too.
const HOOK: &str = r#"#!/bin/sh
# kiln bundle hook (made by cargo xtask bundle: xtask/src/bundle.rs).
[ "$1" = install-check ] || exit 0
if [ "$RAUC_MF_COMPATIBLE" != "$RAUC_SYSTEM_COMPATIBLE" ]; then
    echo "Compatible mismatch: Expected '$RAUC_SYSTEM_COMPATIBLE' but bundle manifest has '$RAUC_MF_COMPATIBLE'" >&2
    exit 10
fi
here=$(dirname "$0")
reads=$(cat "$here/kiln-models-format.txt" 2>/dev/null)
factory=$(cat "$here/kiln-models-factory.txt" 2>/dev/null)
if [ -z "$reads" ] || [ -z "$factory" ]; then
    echo "the bundle does not say which models its system reads ($here/kiln-models-format.txt, kiln-models-factory.txt)" >&2
    exit 10
fi
# Measured, not looked up: the slot beneath the live dm-verity mapping, its trailer read now.
if ! active=$(kiln verity active 2>&1); then
    echo "cannot tell which models slot is in use: $active" >&2
    exit 10
fi
field() { echo "$active" | tr ' ' '
' | sed -n "s/^$1=//p"; }
dev=$(field device) sha=$(field sha256) format=$(field format) signed=$(field signed)
if [ "$format" != "$reads" ]; then
    echo "this system reads models format $reads; the models slot in use ($dev) is format $format: install a models bundle of format $reads first (system and models bundles never rewrite each other)" >&2
    exit 10
fi
if [ "$sha" != "$factory" ] && [ "$signed" != yes ]; then
    echo "this system's factory models slot is kiln-models.json $factory; the models slot in use ($dev) is $sha, unsigned: another image's factory models, which this system would not believe (install a models bundle first, or reflash)" >&2
    exit 10
fi
exit 0
"#;

fn write_hook(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The factory models slot the bundle's system names (its manifest's
/// `models_slot.meta_sha256`).
fn factory_models(manifest: &Path) -> Result<String> {
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(manifest).with_context(|| format!("reading {}", manifest.display()))?,
    )
    .with_context(|| format!("parsing {}", manifest.display()))?;
    m["models_slot"]["meta_sha256"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("{}: no models_slot.meta_sha256", manifest.display()))
}

/// Replace `path` (e.g. `kiln/manifest.json`) in the FAT image `fs` with `bytes` (mtools).
pub fn replace_in_fat(fs: &Path, path: &str, bytes: &[u8]) -> Result<()> {
    crate::doctor::ensure(&[&crate::doctor::MTOOLS])?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("file");
    std::fs::write(&file, bytes)?;
    let sh = crate::paths::shell()?;
    let target = format!("::{path}");
    xshell::cmd!(sh, "mcopy -o -i {fs} {file} {target}")
        .env("MTOOLS_SKIP_CHECK", "1")
        .quiet()
        .run()
        .with_context(|| format!("replacing {path} in {}", fs.display()))
}

/// The manifest of the slot image `fs` with `/Image`'s sha256 reversed: `image.manifest` FAILs.
fn break_image_hash(fs: &Path) -> Result<()> {
    let p = crate::disk::fat::read_file(fs, 0, std::fs::metadata(fs)?.len(), "kiln/manifest.json")?;
    let mut m: serde_json::Value = serde_json::from_slice(&p)?;
    let img = m["boot"]["files"]["/Image"]["sha256"]
        .as_str()
        .context("the slot's manifest records no /Image sha256")?
        .chars()
        .rev()
        .collect::<String>();
    m["boot"]["files"]["/Image"]["sha256"] = img.clone().into();
    println!("bundle: a failing system (for tests): its manifest records /Image sha256 {img}");
    replace_in_fat(fs, "kiln/manifest.json", &serde_json::to_vec_pretty(&m)?)
}

/// The models format a models bundle's slot is, for its hook (decision 6).
const MODELS_FORMAT_FILE: &str = "kiln-models-format.txt";

/// The hook of a models bundle. `install-check`: RAUC's own `compatible` check, which a hook
/// replaces, and the bundle's models format against the one the running system reads (`kiln
/// verity format`): a system that cannot read it would refuse the slot at boot, so the bundle is
/// refused now, naming both (install a system that reads it first). `slot-pre-install`: the slot RAUC is about to write (the models
/// slot not in use: init lists only that one) is marked bad first, out of `MODELS_ORDER`, so a
/// power cut while it is half written never leaves it where init would map it (as RAUC marks a
/// boot slot bad before writing it). `slot-post-install`: the slot RAUC wrote is put first in
/// `MODELS_ORDER` with one try, so the next boot maps it (`docs/models-slots.md`, decisions 4
/// and 5). A device that is no models slot is refused before anything is marked or written.
const MODELS_HOOK: &str = r#"#!/bin/sh
# kiln models bundle hook (made by cargo xtask bundle --models-slot: xtask/src/bundle.rs).
slot_of() {
    case "$RAUC_SLOT_DEVICE" in
        */models_a) s=A ;;
        */models_b) s=B ;;
        *)
            echo "kiln: RAUC is writing $RAUC_SLOT_DEVICE, which is neither models_a nor models_b" >&2
            exit 1
            ;;
    esac
}
case "$1" in
    install-check)
        if [ "$RAUC_MF_COMPATIBLE" != "$RAUC_SYSTEM_COMPATIBLE" ]; then
            echo "Compatible mismatch: Expected '$RAUC_SYSTEM_COMPATIBLE' but bundle manifest has '$RAUC_MF_COMPATIBLE'" >&2
            exit 10
        fi
        want=$(cat "$(dirname "$0")/kiln-models-format.txt" 2>/dev/null)
        reads=$(kiln verity format 2>/dev/null)
        if [ -z "$want" ] || [ "$want" != "$reads" ]; then
            echo "this models bundle is models format ${want:-(none given)}; the running system reads format ${reads:-(none: a kiln from before models formats)}: install a system that reads it first (docs/models-slots.md, decision 6)" >&2
            exit 10
        fi
        ;;
    slot-pre-install)
        slot_of
        kiln slot --class models mark-bad "$s" >&2 || exit 1
        ;;
    slot-post-install)
        slot_of
        kiln slot --class models mark-active "$s" >&2 || exit 1
        ;;
esac
exit 0
"#;

/// The models slot `src` (unsigned, as the image builds its factory slot) made a bundle's at
/// `dst`: the same erofs and hash tree, its `kiln-models.json` now carrying `answers` (the
/// self-check's known answers for its models: a bundle's slot is judged by its own), the JSON's
/// detached CMS signature by `cert`/`key` after it, the footer at the end; padded to whole MiB.
/// The signature is checked against `keyring` (what the board trusts) before anything ships.
/// `wrong`: the last model's known NLL is edited (+1 nat) before signing (for tests).
fn signed_models_slot(
    src: &Path,
    dst: &Path,
    (cert, key, keyring): (&Path, &Path, &Path),
    answers: serde_json::Map<String, serde_json::Value>,
    (wrong, format): (bool, Option<u32>),
) -> Result<kiln_runtime::models_slot::Slot> {
    use kiln_runtime::models_slot as ms;
    use std::io::{Read as _, Write as _};
    let factory =
        ms::read(src)?.with_context(|| format!("{}: no models slot trailer", src.display()))?;
    let mut meta = factory.meta.clone();
    meta.known_answers = answers;
    if let Some(f) = format {
        println!(
            "bundle: models format {f} (for tests; this kiln reads {})",
            meta.format
        );
        meta.format = f;
    }
    if wrong {
        let nll = meta
            .known_answers
            .get_mut("nll")
            .and_then(|v| v.as_array_mut())
            .and_then(|a| a.last_mut())
            .context("no known NLL answer to edit")?;
        let was = nll["mean_nll"]
            .as_f64()
            .context("a known NLL answer without mean_nll")?;
        nll["mean_nll"] = serde_json::json!(was + 1.0);
        println!(
            "bundle: a wrong known answer (for tests): {}'s mean NLL recorded as {:.6}, computed {was:.6}",
            nll["model"].as_str().unwrap_or("?"),
            was + 1.0
        );
    }
    let meta_bytes = serde_json::to_vec_pretty(&meta)?;
    let sig = ms::sign(&meta_bytes, cert, key)?;
    ms::verify_signature(&meta_bytes, &sig, keyring).with_context(|| {
        format!(
            "the models signature by {} against {}: the board would refuse it",
            cert.display(),
            keyring.display()
        )
    })?;
    let tree_end = meta.hash_tree_end()?;
    let probe = ms::layout(tree_end, &meta_bytes, sig.len() as u64, u64::MAX >> 1)?;
    let len = (probe.sig_off + sig.len() as u64 + ms::FOOTER_LEN).next_multiple_of(1 << 20);
    let footer = ms::layout(tree_end, &meta_bytes, sig.len() as u64, len)?;
    let mut out =
        std::fs::File::create(dst).with_context(|| format!("creating {}", dst.display()))?;
    let mut head = std::fs::File::open(src)
        .with_context(|| format!("opening {}", src.display()))?
        .take(tree_end);
    let copied = std::io::copy(&mut head, &mut out)
        .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
    anyhow::ensure!(
        copied == tree_end,
        "{}: {copied} bytes before the trailer, its metadata says {tree_end}",
        src.display()
    );
    out.set_len(len)?;
    ms::write_trailer(&mut out, len, &footer, &meta_bytes, &sig)
        .with_context(|| format!("writing the trailer of {}", dst.display()))?;
    out.flush()?;
    out.sync_all()?;
    let back =
        ms::read(dst)?.with_context(|| format!("{}: no trailer read back", dst.display()))?;
    anyhow::ensure!(
        back.meta_bytes == meta_bytes && back.signature == sig,
        "{}: the trailer does not read back as written",
        dst.display()
    );
    Ok(back)
}

/// Make the bundle of `args.image.board`'s image at this commit.
pub fn make(args: &Args) -> Result<Bundle> {
    let (key, cert) = match (&args.key, &args.cert) {
        (Some(k), Some(c)) => (
            pem(k, "--key", "PRIVATE KEY")?,
            pem(c, "--cert", "CERTIFICATE")?,
        ),
        _ => {
            println!("bundle: WARNING: signing with {}", updates::DEV_WARNING);
            (
                updates::DEV_KEY.as_bytes().to_vec(),
                updates::DEV_CERT.as_bytes().to_vec(),
            )
        }
    };
    let models_mode = args.models_slot || !args.models.is_empty();
    let (built, models_built) = if models_mode {
        let img = crate::image::Args {
            board: args.image.board.clone(),
            models: args
                .image
                .models
                .iter()
                .chain(&args.models)
                .cloned()
                .collect(),
            offline: args.image.offline,
            dev_keys: args.image.dev_keys,
        };
        (None, Some(crate::image::models_slot(&img)?))
    } else {
        (Some(crate::image::build(&args.image)?), None)
    };
    let tools = crate::tools_root::ensure(args.image.offline)?;
    let commit = match (&built, &models_built) {
        (Some(b), _) => &b.commit,
        (_, Some(m)) => &m.commit,
        _ => unreachable!("one of the two was built"),
    };
    let short = &commit.hash[..12.min(commit.hash.len())];
    let version = if commit.dirty {
        format!("{short}-dirty")
    } else {
        short.to_string()
    };
    let out = match &args.out {
        Some(p) => std::path::absolute(p)?,
        None => crate::paths::target_dir().join("images").join(format!(
            "kiln-{}-{version}{}.raucb",
            args.image.board,
            if models_mode { "-models" } else { "" }
        )),
    };
    let compatible = args
        .compatible
        .clone()
        .unwrap_or_else(|| updates::compatible(&args.image.board));

    // Everything rauc reads must be under target/ (the tools root sees the checkout and target/).
    let work = crate::paths::target_dir().join("kiln/bundle");
    std::fs::create_dir_all(&work)?;
    let tmp = tempfile::tempdir_in(&work)?;
    let content = tmp.path().join("content");
    std::fs::create_dir(&content)?;
    let keyfile = tmp.path().join("key.pem");
    {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&keyfile)?
            .write_all(&key)?;
    }
    let certfile = tmp.path().join("cert.pem");
    std::fs::write(&certfile, &cert)?;
    // What the board will check: the signature against the keyring its RAUC trusts (a CA, for a
    // fleet's keys), so a bundle that board would refuse is refused here, before it ships.
    let (trusted, what) = match &args.keyring {
        Some(k) => (pem(k, "--keyring", "CERTIFICATE")?, k.display().to_string()),
        None => {
            let b = crate::image::board::Board::load(&args.image.board)?;
            let what = (b.update.keyring.as_deref()).unwrap_or("kiln's development certificate");
            (
                updates::keyring_of(&b)?.0,
                format!("images/{}.toml's keyring ({what})", args.image.board),
            )
        }
    };
    let keyringfile = tmp.path().join("keyring.pem");
    std::fs::write(&keyringfile, &trusted)?;
    let (payload_name, slot_class, description) = if let Some(mb) = &models_built {
        let slot = signed_models_slot(
            &mb.slot,
            &content.join("models.img"),
            (&certfile, &keyfile, &keyringfile),
            mb.known_answers.clone(),
            (args.wrong_known_answer, args.models_format),
        )?;
        std::fs::write(
            content.join(MODELS_FORMAT_FILE),
            format!("{}\n", slot.meta.format),
        )?;
        write_hook(&content.join("hook.sh"), MODELS_HOOK)?;
        println!(
            "bundle: models slot of {} file(s) ({}), kiln-models.json {} signed by {}",
            slot.meta.models.len(),
            slot.meta
                .models
                .iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            &slot.meta_sha256()[..12],
            args.cert
                .as_deref()
                .map(|c| c.display().to_string())
                .unwrap_or_else(|| "the development certificate".into())
        );
        ("models.img", "models", "models slot")
    } else {
        let built = built.as_ref().context("no system built")?;
        std::fs::copy(&built.boot_fs, content.join("boot.vfat"))
            .with_context(|| format!("copying {}", built.boot_fs.display()))?;
        if args.failing_system {
            break_image_hash(&content.join("boot.vfat"))?;
        }
        let format = args
            .system_models_format
            .unwrap_or(kiln_runtime::models_slot::FORMAT);
        std::fs::write(content.join(SYSTEM_FORMAT_FILE), format!("{format}\n"))?;
        let factory = match &args.system_factory_models {
            Some(f) => f.clone(),
            None => factory_models(&built.manifest)?,
        };
        std::fs::write(content.join(SYSTEM_FACTORY_FILE), format!("{factory}\n"))?;
        write_hook(&content.join("hook.sh"), HOOK)?;
        ("boot.vfat", "boot", "boot slot")
    };
    let payload = Sha256::of_file(&content.join(payload_name))?;
    let manifest = format!(
        "[update]\n\
         compatible={compatible}\n\
         version={version}\n\
         description=kiln {board} {description} ({commit})\n\
         build={epoch}\n\
         \n\
         [bundle]\n\
         format=verity\n\
         \n\
         [hooks]\n\
         filename=hook.sh\n\
         hooks=install-check\n\
         \n\
         [image.{slot_class}]\n\
         filename={payload_name}\n{image_hooks}",
        image_hooks = if models_mode {
            "hooks=pre-install;post-install\n"
        } else {
            ""
        },
        board = args.image.board,
        commit = commit.hash,
        epoch = commit.epoch,
    );
    std::fs::write(content.join("manifest.raucm"), &manifest)?;
    // RAUC reads check-crl from its system.conf only: a conf for the check that checks the
    // keyring's CRL as the board's does (`updates::system_conf`), with no bootloader to touch.
    let checkconf = tmp.path().join("check-system.conf");
    std::fs::write(
        &checkconf,
        format!(
            "[system]\ncompatible={compatible}\nbootloader=noop\n\n[keyring]\npath={}\n{}",
            keyringfile.display(),
            if updates::has_crl(&trusted) {
                "check-crl=true\n"
            } else {
                ""
            }
        ),
    )?;
    let raucb = tmp.path().join("out.raucb");
    let env = [
        ("TZ", "UTC".to_string()),
        ("LC_ALL", "C".to_string()),
        ("SOURCE_DATE_EPOCH", commit.epoch.to_string()),
    ];
    println!(
        "bundle: rauc bundle (verity) of {payload_name} ({:.1} MiB, sha256 {}), compatible {compatible}, version {version}",
        std::fs::metadata(content.join(payload_name))?.len() as f64 / 1048576.0,
        payload.short()
    );
    let p = |x: &Path| x.display().to_string();
    tools
        .read(
            tmp.path(),
            &env,
            &[
                "rauc",
                "bundle",
                "--cert",
                &p(&certfile),
                "--key",
                &p(&keyfile),
                &p(&content),
                &p(&raucb),
            ],
        )
        .context("rauc bundle")?;
    let info = tools
        .read(
            tmp.path(),
            &env,
            &[
                "rauc",
                &format!("--conf={}", p(&checkconf)),
                "info",
                "--output-format=json",
                &p(&raucb),
            ],
        )
        .with_context(|| {
            format!(
                "rauc info of the new bundle against {what}: the board would refuse it (sign with a \
                 key its keyring trusts)"
            )
        })?;
    let info: serde_json::Value =
        serde_json::from_str(&info).context("rauc info --output-format=json")?;
    if info["compatible"].as_str() != Some(compatible.as_str()) {
        bail!(
            "rauc info reads compatible {:?}, not {compatible}",
            info["compatible"]
        );
    }
    if let Some(d) = out.parent() {
        std::fs::create_dir_all(d)?;
    }
    // Same file system: a rename; elsewhere (--out): an atomic write of the bytes.
    if std::fs::rename(&raucb, &out).is_err() {
        write_atomic(&out, &std::fs::read(&raucb)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    write_atomic(
        &PathBuf::from(format!("{}.json", out.display())),
        &serde_json::to_vec_pretty(&serde_json::json!({
            "bundle": out.file_name().and_then(|n| n.to_str()),
            "sha256": Sha256::of_file(&out)?.to_string(),
            "compatible": compatible,
            "version": version,
            "commit": commit.hash,
            "payload": {payload_name: payload.to_string()},
            "image_sha256": built.as_ref().map(|b| b.sha256.to_string()),
            "not_reproducible": "the dm-verity salt (random per bundle) and the CMS signing time",
        }))?,
    )?;
    Ok(Bundle {
        path: out,
        payload_name,
        payload,
    })
}

/// The `image-checks` stage's models bundle: `bundle --models-slot` of the qemu-virt image's
/// models (checked by `rauc info` against the board's keyring as it is made), then `rauc
/// extract` gives back `models.img`, whose trailer reads; whose `kiln-models.json` lists the
/// factory slot's files and verity parameters and carries the known answers the image's manifest
/// records for them (computed by the same steps in the bundle's own work folder, so equal to the
/// value); whose signature verifies against the board's keyring and not against a CA the board
/// does not hold; and whose erofs and hash tree `veritysetup verify` accepts with the JSON's root
/// hash.
pub fn models_stage() -> Result<()> {
    use kiln_runtime::models_slot as ms;
    crate::doctor::ensure(&[&crate::doctor::VERITYSETUP])?;
    let work = crate::paths::target_dir().join("kiln/bundle");
    std::fs::create_dir_all(&work)?;
    let tmp = tempfile::tempdir_in(&work)?;
    let out = tmp.path().join("models.raucb");
    let mut args = Args::qemu_virt(None, out.clone(), None);
    args.models_slot = true;
    let b = make(&args)?;
    let built = crate::image::build(&args.image)?;
    let board = crate::image::board::Board::load(&args.image.board)?;
    let keyring = tmp.path().join("keyring.pem");
    std::fs::write(&keyring, updates::keyring_of(&board)?.0)?;
    let tools = crate::tools_root::ensure(false)?;
    let extracted = tmp.path().join("extracted");
    let p = |x: &Path| x.display().to_string();
    tools
        .read(
            tmp.path(),
            &[("LC_ALL", "C".to_string())],
            &[
                "rauc",
                &format!("--keyring={}", p(&keyring)),
                "extract",
                &p(&b.path),
                &p(&extracted),
            ],
        )
        .context("rauc extract of the models bundle")?;
    let img = extracted.join("models.img");
    let slot = ms::read(&img)?.with_context(|| format!("{}: no models trailer", img.display()))?;
    let manifest = crate::image::checks::read_json(&built.manifest)?;
    let parts = gpt::read(&built.image)
        .with_context(|| format!("reading the GPT of {}", built.image.display()))?;
    let a = parts
        .iter()
        .find(|p| p.name == "models_a")
        .context("the image has no models_a")?;
    let factory = ms::read_in(&built.image, a.start_bytes(), a.size_bytes(), "models_a")?
        .context("the image's models_a holds no slot")?;
    anyhow::ensure!(
        factory.meta_sha256()
            == manifest["models_slot"]["meta_sha256"]
                .as_str()
                .unwrap_or(""),
        "the image's models_a is not the slot its manifest names"
    );
    anyhow::ensure!(
        slot.meta.models == factory.meta.models && slot.meta.verity == factory.meta.verity,
        "the bundle's kiln-models.json lists other files or verity parameters than the factory slot's"
    );
    let recorded = manifest["known_answers"]
        .as_object()
        .context("the image's manifest records no known_answers")?;
    for k in ["nll", "matmul"] {
        anyhow::ensure!(
            slot.meta.known_answers.get(k).is_some()
                && slot.meta.known_answers.get(k) == recorded.get(k),
            "the bundle's known_answers.{k} is not the image's for the same models"
        );
    }
    ms::verify_signature(&slot.meta_bytes, &slot.signature, &keyring)
        .context("the bundle's models signature against the board's keyring")?;
    // A CA the board does not hold: a fresh self-signed certificate.
    let other_key = tmp.path().join("other-key.pem");
    let other = tmp.path().join("other-ca.pem");
    let sh = crate::paths::shell()?;
    xshell::cmd!(
        sh,
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=not-the-fleet -days 1 -keyout {other_key} -out {other}"
    )
    .quiet()
    .ignore_stderr()
    .run()
    .context("making a certificate the board does not trust")?;
    let refused = ms::verify_signature(&slot.meta_bytes, &slot.signature, &other);
    let Err(why) = refused else {
        bail!("the models signature verified against a CA the board does not hold");
    };
    // As image-checks judges the factory partition: veritysetup with the JSON's parameters.
    let v = &slot.meta.verity;
    let off = format!("--hash-offset={}", v.hash_start_block * v.hash_block_size);
    let blocks = format!("--data-blocks={}", v.data_blocks);
    let salt = format!("--salt={}", v.salt);
    let root = &v.root_hash;
    xshell::cmd!(
        sh,
        "veritysetup verify --no-superblock {off} {blocks} {salt} {img} {img} {root}"
    )
    .quiet()
    .run()
    .with_context(|| {
        format!(
            "veritysetup verify of {} with its JSON's root hash",
            img.display()
        )
    })?;
    println!(
        "bundle: models bundle {} ({} MiB models.img): kiln-models.json {} lists the factory \
         slot's files and verity root and carries the image's known answers for them ({} NLL, {} \
         matmul); its signature verifies against the board's keyring and not against another CA \
         ({:#}); veritysetup verifies root {}",
        b.path.file_name().and_then(|n| n.to_str()).unwrap_or(""),
        std::fs::metadata(&img)?.len() >> 20,
        &slot.meta_sha256()[..12],
        slot.meta.known_answers["nll"]
            .as_array()
            .map_or(0, |a| a.len()),
        slot.meta.known_answers["matmul"]
            .as_array()
            .map_or(0, |a| a.len()),
        why,
        &root[..12]
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    /// The models hook run by `sh` as RAUC runs it (`hook.sh slot-post-install` with RAUC's
    /// variables), with a `kiln` on `PATH` that logs its arguments and exits `kiln_rc`:
    /// (exit code, stderr, what `kiln` was asked).
    fn run_hook(arg: &str, env: &[(&str, &str)], kiln_rc: i32) -> (i32, String, String) {
        run_hook_with(arg, env, kiln_rc, Some("1\n"), "1")
    }

    /// [`run_hook`] with the bundle's `kiln-models-format.txt` (`None`: absent) and what `kiln
    /// verity format` prints (the running system's models format).
    fn run_hook_with(
        arg: &str,
        env: &[(&str, &str)],
        kiln_rc: i32,
        bundle_format: Option<&str>,
        reads: &str,
    ) -> (i32, String, String) {
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook.sh");
        write_hook(&hook, MODELS_HOOK).unwrap();
        if let Some(f) = bundle_format {
            std::fs::write(dir.path().join(MODELS_FORMAT_FILE), f).unwrap();
        }
        let log = dir.path().join("kiln.log");
        let kiln = dir.path().join("kiln");
        std::fs::write(
            &kiln,
            format!(
                "#!/bin/sh\nif [ \"$1 $2\" = \"verity format\" ]; then echo {reads}; exit 0; fi\n\
                 echo \"$@\" >> {}\nexit {kiln_rc}\n",
                log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&kiln, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = std::process::Command::new("sh")
            .arg(&hook)
            .arg(arg)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", dir.path().display()))
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            std::fs::read_to_string(&log).unwrap_or_default(),
        )
    }

    #[test]
    fn the_models_hook_marks_only_a_models_slot_it_wrote() {
        // (hook, the device RAUC writes, kiln's exit status) -> (the hook's, what kiln was asked).
        let cases: &[(&str, &str, i32, i32, &str)] = &[
            // Before RAUC writes a slot, it is marked bad (out of MODELS_ORDER) ...
            ("slot-pre-install", "models_a", 0, 0, "mark-bad A"),
            // ... and after, first with one try.
            ("slot-post-install", "models_b", 0, 0, "mark-active B"),
            ("slot-post-install", "models_a", 0, 0, "mark-active A"),
            // Fault: a mark that cannot be written fails the hook: before, no byte is written;
            // after, the install fails.
            ("slot-pre-install", "models_a", 3, 1, "mark-bad A"),
            ("slot-post-install", "models_b", 3, 1, "mark-active B"),
            // Fault: a device that is no models slot (a boot slot): refused, nothing marked.
            ("slot-pre-install", "vda2", 0, 1, ""),
            ("slot-post-install", "vda2", 0, 1, ""),
        ];
        for &(hook, part, kiln_rc, want_rc, want) in cases {
            let dev = if part.starts_with("models_") {
                format!("/dev/disk/by-partlabel/{part}")
            } else {
                format!("/dev/{part}")
            };
            let (rc, err, asked) = run_hook(hook, &[("RAUC_SLOT_DEVICE", dev.as_str())], kiln_rc);
            let want_asked = if want.is_empty() {
                String::new()
            } else {
                format!("slot --class models {want}\n")
            };
            assert_eq!(
                (rc, asked.as_str()),
                (want_rc, want_asked.as_str()),
                "{hook} {dev} (kiln exits {kiln_rc}): {err}"
            );
            if want.is_empty() {
                assert!(
                    err.contains(&format!(
                        "RAUC is writing {dev}, which is neither models_a nor models_b"
                    )),
                    "{err}"
                );
            }
        }
        // install-check: another compatible is refused with RAUC's own words.
        let (rc, err, _) = run_hook(
            "install-check",
            &[
                ("RAUC_MF_COMPATIBLE", "kiln-rock-5b"),
                ("RAUC_SYSTEM_COMPATIBLE", "kiln-qemu-virt"),
            ],
            0,
        );
        assert_eq!(rc, 10, "{err}");
        assert!(err.contains("Compatible mismatch"), "{err}");
        let same = [
            ("RAUC_MF_COMPATIBLE", "kiln-qemu-virt"),
            ("RAUC_SYSTEM_COMPATIBLE", "kiln-qemu-virt"),
        ];
        let (rc, err, _) = run_hook("install-check", &same, 0);
        assert_eq!(rc, 0, "{err}");
        // install-check: a models format the running system does not read, or a bundle that
        // names none, is refused naming both (decision 6).
        for (bundle, reads, want) in [
            (
                Some("2\n"),
                "1",
                "models format 2; the running system reads format 1",
            ),
            (None, "1", "models format (none given)"),
            (
                Some("1\n"),
                "",
                "reads format (none: a kiln from before models formats)",
            ),
        ] {
            let (rc, err, _) = run_hook_with("install-check", &same, 0, bundle, reads);
            assert_eq!(rc, 10, "{bundle:?} {reads}: {err}");
            assert!(
                err.contains(want) && err.contains("install a system that reads it first"),
                "{err}"
            );
        }
    }
}
