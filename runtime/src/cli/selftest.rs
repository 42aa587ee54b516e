//! `kiln selftest`: the boot self-check (arguments and driver live in `selftest::cli`).

use anyhow::Context;
use std::io::Write as _;

pub use kiln_runtime::selftest::cli::Args;

pub fn run(a: Args) -> anyhow::Result<()> {
    let code = kiln_runtime::selftest::cli::run(a)?;
    std::io::stdout().flush().context("flushing stdout")?;
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}
