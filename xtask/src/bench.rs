//! `cargo xtask bench WHAT`: the benchmarks (never timed tests). Each prints its own table.

use anyhow::{bail, Context, Result};
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Which benchmark: matmul.
    pub what: String,
}

pub fn run(args: Args) -> Result<()> {
    let sh = crate::shell()?;
    match args.what.as_str() {
        "matmul" => cmd!(sh, "cargo bench -p kiln-runtime --bench matmul")
            .run()
            .context("matmul bench"),
        other => bail!("unknown bench {other:?}; known: matmul"),
    }
}
