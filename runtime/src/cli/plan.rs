//! `kiln plan`: the coverage table of a model.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    file: PathBuf,
    /// Row counts (M) to plan for, e.g. 1 for decode and 512 for prefill.
    #[arg(long, value_delimiter = ',', default_value = "1,8,512")]
    m: Vec<usize>,
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let out = kiln_runtime::sched::plan_report(&a.file, &a.m, a.json)?;
    super::print_all(&out)
}
