//! `kiln verity`: the models partition through dm-verity. `/init` runs `map` before the
//! self-check and mounts the device it prints; `status` shows the live mapping against the
//! manifest; `root` prints the live root hash (a bundle's install check compares it with the
//! one its system needs). The logic is `kiln_runtime::verity`.

use anyhow::anyhow;
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
    #[arg(long, default_value = "/boot/kiln/manifest.json")]
    manifest: PathBuf,
    #[arg(long, default_value = verity::CONTROL)]
    control: PathBuf,
}

#[derive(clap::Subcommand)]
enum What {
    /// Map the models partition as `kiln-models` with the manifest's `models_verity`; print the
    /// device (`/dev/dm-N`) on stdout and what was mapped on stderr.
    Map(Mapping),
    /// Compare the live mapping with the manifest (table, root hash, status V/C).
    Status(Mapping),
    /// Print the live mapping's root hash (from the kernel's table, not from a file).
    Root {
        #[arg(long, default_value = verity::CONTROL)]
        control: PathBuf,
    },
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.what {
        What::Map(Mapping {
            device,
            manifest,
            control,
        }) => {
            let m = verity::map(&manifest, &device, &control).map_err(|e| anyhow!(e))?;
            eprintln!("kiln verity: {}", m.line);
            println!("{}", m.dev.display());
        }
        What::Status(Mapping {
            device,
            manifest,
            control,
        }) => {
            let p = verity::Params::from_manifest(&manifest).map_err(|e| anyhow!(e))?;
            let devno = verity::devno(&device).map_err(|e| anyhow!(e))?;
            for l in verity::check(&control, &p, &devno).map_err(|e| anyhow!(e))? {
                println!("{l}");
            }
        }
        What::Root { control } => {
            println!("{}", verity::live_root(&control).map_err(|e| anyhow!(e))?);
        }
    }
    Ok(())
}
