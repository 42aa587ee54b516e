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
    /// A bundle of the models slot instead of the boot slot (docs/models-slots.md): the image's
    /// models partition — the erofs of the `--model` files and the self-check's fixtures, its
    /// dm-verity hash tree and its `kiln-models.json` — with that JSON signed by the bundle's
    /// key (detached CMS, checked against the board's keyring here), as the image `models.img`
    /// for the slot class `models`. A board installs it into its models slot not in use and maps
    /// that slot at the next boot.
    #[arg(long)]
    pub models_slot: bool,
    /// A `compatible` other than the board's (for tests of RAUC's refusal).
    #[arg(long, hide = true)]
    pub compatible: Option<String>,
    /// An extra `NAME:SHA256` the bundle's system says it needs on /models (for tests of the
    /// refusal of a bundle whose models the card does not hold).
    #[arg(long, hide = true)]
    pub needs_model: Vec<String>,
    /// The keyring the new bundle must verify against (default: the board's, what its RAUC
    /// trusts), for tests of other keys.
    #[arg(long, hide = true)]
    pub keyring: Option<PathBuf>,
    /// A system that must FAIL its self-check: the bundle's `kiln/manifest.json` records another
    /// sha256 for `/Image` (for tests of the failure a fleet must hear).
    #[arg(long, hide = true)]
    pub failing_system: bool,
    /// Another dm-verity root hash the bundle's system says its models partition must have
    /// (for tests of the refusal of a bundle whose models partition the card does not hold).
    #[arg(long, hide = true)]
    pub needs_verity_root: Option<String>,
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
            compatible: None,
            needs_model: vec![],
            keyring,
            failing_system: false,
            needs_verity_root: None,
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

/// The bundle's list of what its system needs on /models: `sha256  name` lines.
const MODELS_FILE: &str = "kiln-models.txt";

/// The models partition is not a slot: the system in a bundle runs only with the models (and
/// self-check fixtures) its manifest names, so RAUC's install-check hook refuses a bundle whose
/// list the card does not hold, naming them; each file is hashed on the card at install time
/// (seconds per GiB: the price of an update, not of a boot). A hook replaces
/// RAUC's own `compatible` check, so it makes that check too.
const HOOK: &str = r#"#!/bin/sh
# kiln bundle hook (made by cargo xtask bundle: xtask/src/bundle.rs).
[ "$1" = install-check ] || exit 0
if [ "$RAUC_MF_COMPATIBLE" != "$RAUC_SYSTEM_COMPATIBLE" ]; then
    echo "Compatible mismatch: Expected '$RAUC_SYSTEM_COMPATIBLE' but bundle manifest has '$RAUC_MF_COMPATIBLE'" >&2
    exit 10
fi
list="$(dirname "$0")/kiln-models.txt"
if [ ! -r "$list" ]; then
    echo "the bundle has no readable $list" >&2
    exit 10
fi
missing=
while read -r sha name; do
    [ -n "$name" ] || continue
    # Measured, not looked up: the file on the card, hashed now.
    got=$(sha256sum "/models/$name" 2>/dev/null | cut -d' ' -f1)
    [ "$got" = "$sha" ] || missing="$missing $name"
done < "$list"
if [ -n "$missing" ]; then
    echo "this system needs on /models what the card does not hold:$missing (bundles do not update the models partition: reflash the card with them)" >&2
    exit 10
fi
# The new system maps the models partition through dm-verity with its manifest's root hash: the
# card's live mapping (read from the kernel by the running kiln) must have that root.
want=$(cat "$(dirname "$0")/kiln-models-verity.txt" 2>/dev/null)
if [ -n "$want" ]; then
    got=$(kiln verity root 2>/dev/null)
    if [ "$got" != "$want" ]; then
        echo "this system needs the models partition with dm-verity root $want; the card's is ${got:-not mapped through dm-verity (an image from before dm-verity)} (bundles do not update the models partition: reflash the card)" >&2
        exit 10
    fi
fi
exit 0
"#;

fn write_hook(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The root hash of the models partition the bundle's system maps (its manifest's
/// `models_verity.root_hash`), for the hook.
const VERITY_FILE: &str = "kiln-models-verity.txt";

fn models_verity_root(manifest: &Path) -> Result<String> {
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(manifest).with_context(|| format!("reading {}", manifest.display()))?,
    )
    .with_context(|| format!("parsing {}", manifest.display()))?;
    m["models_verity"]["root_hash"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("{}: no models_verity.root_hash", manifest.display()))
}

/// `sha256  name` of every file the image's manifest puts on /models (models and fixtures),
/// then `extra` (`NAME:SHA256`).
fn models_needed(manifest: &Path, extra: &[String]) -> Result<String> {
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(manifest).with_context(|| format!("reading {}", manifest.display()))?,
    )
    .with_context(|| format!("parsing {}", manifest.display()))?;
    let mut entries: Vec<&serde_json::Value> = vec![&m["fixture"]];
    for k in ["fixtures", "models"] {
        if let Some(a) = m[k].as_array() {
            entries.extend(a);
        }
    }
    let mut out = String::new();
    for e in entries {
        let (Some(name), Some(sha)) = (e["name"].as_str(), e["sha256"].as_str()) else {
            bail!(
                "{}: a model entry without name and sha256: {e}",
                manifest.display()
            );
        };
        out.push_str(&format!("{sha}  {name}\n"));
    }
    for x in extra {
        let (name, sha) = x
            .split_once(':')
            .with_context(|| format!("--needs-model {x}: NAME:SHA256 expected"))?;
        out.push_str(&format!("{sha}  {name}\n"));
    }
    Ok(out)
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

/// The hook of a models bundle. `install-check`: RAUC's own `compatible` check, which a hook
/// replaces (the check of the models format against the running system's comes with the
/// signed trust path at boot). `slot-pre-install`: the slot RAUC is about to write (the models
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

/// The factory models slot `src` (unsigned, `image::build`'s models partition) made a signed
/// one at `dst`: the same erofs and hash tree, the same `kiln-models.json` bytes, its detached
/// CMS signature by `cert`/`key` after it, the footer at the end; padded to whole MiB. The
/// signature is checked against `keyring` (what the board trusts) before anything ships.
fn signed_models_slot(
    src: &Path,
    dst: &Path,
    cert: &Path,
    key: &Path,
    keyring: &Path,
) -> Result<kiln_runtime::models_slot::Slot> {
    use kiln_runtime::models_slot as ms;
    use std::io::{Read as _, Write as _};
    let slot =
        ms::read(src)?.with_context(|| format!("{}: no models slot trailer", src.display()))?;
    let sig = ms::sign(&slot.meta_bytes, cert, key)?;
    ms::verify_signature(&slot.meta_bytes, &sig, keyring).with_context(|| {
        format!(
            "the models signature by {} against {}: the board would refuse it",
            cert.display(),
            keyring.display()
        )
    })?;
    let tree_end = slot.meta.hash_tree_end()?;
    let probe = ms::layout(tree_end, &slot.meta_bytes, sig.len() as u64, u64::MAX >> 1)?;
    let len = (probe.sig_off + sig.len() as u64 + ms::FOOTER_LEN).next_multiple_of(1 << 20);
    let footer = ms::layout(tree_end, &slot.meta_bytes, sig.len() as u64, len)?;
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
    ms::write_trailer(&mut out, len, &footer, &slot.meta_bytes, &sig)
        .with_context(|| format!("writing the trailer of {}", dst.display()))?;
    out.flush()?;
    out.sync_all()?;
    let back =
        ms::read(dst)?.with_context(|| format!("{}: no trailer read back", dst.display()))?;
    anyhow::ensure!(
        back.meta_bytes == slot.meta_bytes && back.signature == sig,
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
    let built = crate::image::build(&args.image)?;
    let tools = crate::tools_root::ensure(args.image.offline)?;
    let commit = &built.commit;
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
            if args.models_slot { "-models" } else { "" }
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
    let (payload_name, slot_class, description) = if args.models_slot {
        let slot = signed_models_slot(
            &built.models_slot,
            &content.join("models.img"),
            &certfile,
            &keyfile,
            &keyringfile,
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
        std::fs::copy(&built.boot_fs, content.join("boot.vfat"))
            .with_context(|| format!("copying {}", built.boot_fs.display()))?;
        if args.failing_system {
            break_image_hash(&content.join("boot.vfat"))?;
        }
        let models = models_needed(&built.manifest, &args.needs_model)?;
        std::fs::write(content.join(MODELS_FILE), &models)?;
        let root = match &args.needs_verity_root {
            Some(r) => r.clone(),
            None => models_verity_root(&built.manifest)?,
        };
        std::fs::write(content.join(VERITY_FILE), root)?;
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
        image_hooks = if args.models_slot {
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
            "image_sha256": built.sha256.to_string(),
            "not_reproducible": "the dm-verity salt (random per bundle) and the CMS signing time",
        }))?,
    )?;
    Ok(Bundle {
        path: out,
        payload_name,
        payload,
    })
}

/// The `image-checks` stage's models bundle: `bundle --models-slot` of the qemu-virt image
/// (checked by `rauc info` against the board's keyring as it is made), then `rauc extract`
/// gives back `models.img`, whose trailer reads, whose `kiln-models.json` is the image's
/// factory slot's byte for byte (the sha256 its manifest names), whose signature verifies
/// against the board's keyring and not against a CA the board does not hold, and whose erofs
/// and hash tree `veritysetup verify` accepts with the JSON's root hash.
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
    let factory = manifest["models_slot"]["meta_sha256"]
        .as_str()
        .context("the image's manifest names no models_slot.meta_sha256")?;
    anyhow::ensure!(
        slot.meta_sha256() == factory,
        "the bundle's kiln-models.json {} is not the factory slot's {factory}",
        slot.meta_sha256()
    );
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
        "bundle: models bundle {} ({} MiB models.img): kiln-models.json {} is the factory slot's, \
         its signature verifies against the board's keyring and not against another CA ({:#}); \
         veritysetup verifies root {}",
        b.path.file_name().and_then(|n| n.to_str()).unwrap_or(""),
        std::fs::metadata(&img)?.len() >> 20,
        &factory[..12],
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
        let dir = tempfile::tempdir().unwrap();
        let hook = dir.path().join("hook.sh");
        write_hook(&hook, MODELS_HOOK).unwrap();
        let log = dir.path().join("kiln.log");
        let kiln = dir.path().join("kiln");
        std::fs::write(
            &kiln,
            format!(
                "#!/bin/sh\necho \"$@\" >> {}\nexit {kiln_rc}\n",
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
        let (rc, _, _) = run_hook(
            "install-check",
            &[
                ("RAUC_MF_COMPATIBLE", "kiln-qemu-virt"),
                ("RAUC_SYSTEM_COMPATIBLE", "kiln-qemu-virt"),
            ],
            0,
        );
        assert_eq!(rc, 0);
    }
}
