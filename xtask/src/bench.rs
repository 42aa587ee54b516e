//! `cargo xtask bench [WHAT…]`: benchmarks, never timed tests. Each arm prints its own numbers.

use anyhow::{bail, Context, Result};
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// What to benchmark (see `--list`); everything when none is named.
    pub what: Vec<String>,
    /// List the benchmarks and exit.
    #[arg(long)]
    pub list: bool,
}

type BenchFn = fn() -> Result<()>;

/// Every benchmark: name, what it measures, how.
const BENCHES: &[(&str, &str, BenchFn)] = &[(
    "gguf",
    "GGUF open+index of a sparse 4 GiB file vs a 40 MiB one (400 tensors): times, ratio, RSS growth",
    gguf,
)];

pub fn run(args: Args) -> Result<()> {
    if args.list {
        for (name, what, _) in BENCHES {
            println!("{name:<10} {what}");
        }
        return Ok(());
    }
    for w in &args.what {
        if !BENCHES.iter().any(|(name, _, _)| name == w) {
            bail!("no benchmark named {w:?}; `cargo xtask bench --list` names them");
        }
    }
    for (name, _, f) in BENCHES {
        if args.what.is_empty() || args.what.iter().any(|w| w == name) {
            println!("==> bench {name}");
            f().with_context(|| format!("bench {name}"))?;
        }
    }
    Ok(())
}

fn gguf() -> Result<()> {
    let sh = crate::shell()?;
    cmd!(sh, "cargo bench --locked -p kiln-runtime --bench gguf")
        .run()
        .context("cargo bench --bench gguf")
}
