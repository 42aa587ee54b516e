//! `kiln verity`: the models partition through dm-verity. `/init` runs `map` before the
//! self-check and mounts the device it prints; `status` shows the live mapping against the
//! manifest; `root` prints the live root hash (a bundle's install check compares it with the
//! one its system needs). The logic is `kiln_runtime::verity`.

use anyhow::{anyhow, Context as _};
use kiln_runtime::verity;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

/// The partition, the manifest that describes it and the device-mapper control node.
#[derive(clap::Args)]
struct Mapping {
    /// The models partition (a block device).
    #[arg(long)]
    device: PathBuf,
    /// The booted system's manifest (its factory models slot and `models_verity`).
    #[arg(long, default_value = "/boot/kiln/manifest.json")]
    manifest: PathBuf,
    /// The update keyring a models bundle's signature must verify against (RAUC's).
    #[arg(long, default_value = kiln_runtime::models_slot::trust::KEYRING)]
    keyring: PathBuf,
    /// The device-mapper control node.
    #[arg(long, default_value = verity::CONTROL)]
    control: PathBuf,
}

#[derive(clap::Subcommand)]
enum What {
    /// Map the models slot as `kiln-models` with its own verity parameters once it is believed
    /// (the factory slot the manifest names, or signed by a key the keyring trusts); print the
    /// device (`/dev/dm-N`) on stdout and what was mapped, and why it is believed, on stderr.
    Map(Mapping),
    /// Exit 0 when the slot on `--device` is the factory slot the manifest names (believed
    /// without openssl), 1 when believing it needs its signature checked (init then mounts the
    /// updates tree, which holds openssl, first).
    IsFactory {
        /// The models partition (a block device).
        #[arg(long)]
        device: PathBuf,
        /// The booted system's manifest.
        #[arg(long, default_value = "/boot/kiln/manifest.json")]
        manifest: PathBuf,
    },
    /// Read the live table back from the kernel and compare it with the slot's own (root hash,
    /// salt, sizes, the device beneath, status V/C), once the slot on `--device` is believed.
    Status(Mapping),
    /// The models slot in use (beneath the live mapping), as a system bundle's hook reads it:
    /// `device=… sha256=… format=… signed=yes|no`, its `kiln-models.json` read, not believed.
    Active {
        /// The device-mapper control node.
        #[arg(long, default_value = verity::CONTROL)]
        control: PathBuf,
    },
    /// Print the models format this kiln reads (what a models bundle's hook compares with).
    Format,
    /// Print the live mapping's root hash (from the kernel's table, not from a file).
    Root {
        /// The device-mapper control node.
        #[arg(long, default_value = verity::CONTROL)]
        control: PathBuf,
    },
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.what {
        What::Map(Mapping {
            device,
            manifest,
            keyring,
            control,
        }) => {
            let m = kiln_runtime::models_slot::trust::map(&manifest, &device, &keyring, &control)
                .map_err(|e| anyhow!(e))?;
            eprintln!("kiln verity: {}", m.line);
            println!("{}", m.dev.display());
        }
        What::Status(Mapping {
            device,
            manifest,
            keyring,
            control,
        }) => {
            let t = kiln_runtime::models_slot::trust::trusted_slot(&manifest, &device, &keyring)
                .map_err(|e| anyhow!(e))?;
            println!("{}: {}", device.display(), t.describe());
            let p = t.slot.meta.verity;
            let devno = verity::devno(&device).map_err(|e| anyhow!(e))?;
            for l in verity::check(&control, &p, &devno).map_err(|e| anyhow!(e))? {
                println!("{l}");
            }
        }
        What::IsFactory { device, manifest } => {
            use kiln_runtime::models_slot as ms;
            let m: serde_json::Value = serde_json::from_slice(
                &std::fs::read(&manifest)
                    .with_context(|| format!("reading {}", manifest.display()))?,
            )
            .with_context(|| format!("parsing {}", manifest.display()))?;
            let slot = ms::read(&device)?
                .with_context(|| format!("{} holds no models", device.display()))?;
            let sha = slot.meta_sha256();
            if ms::trust::factory_sha(&m) == Some(sha.as_str()) {
                println!("{}: the factory models slot ({sha})", device.display());
            } else {
                println!(
                    "{}: not the factory models slot (kiln-models.json {sha}): its signature decides",
                    device.display()
                );
                std::process::exit(1);
            }
        }
        What::Active { control } => {
            let dev = verity::live_device(
                &control,
                std::path::Path::new("/sys"),
                std::path::Path::new("/dev"),
            )
            .map_err(|e| anyhow!(e))?;
            let slot = kiln_runtime::models_slot::read(&dev)?
                .with_context(|| format!("{} holds no models", dev.display()))?;
            println!(
                "device={} sha256={} format={} signed={}",
                dev.display(),
                slot.meta_sha256(),
                slot.meta.format,
                if slot.signature.is_empty() {
                    "no"
                } else {
                    "yes"
                }
            );
        }
        What::Format => println!("{}", kiln_runtime::models_slot::FORMAT),
        What::Root { control } => {
            println!("{}", verity::live_root(&control).map_err(|e| anyhow!(e))?);
        }
    }
    Ok(())
}
