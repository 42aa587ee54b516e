//! `kiln plan`: the coverage table of a model, and the NPU memory each weight takes against the
//! NPU's budget.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model.
    file: PathBuf,
    /// Row counts (M) to plan for, e.g. 1 for decode and 512 for prefill.
    #[arg(long, value_delimiter = ',', default_value = "1,8,512")]
    m: Vec<usize>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// NPU memory for converted weights, in MiB (default: `KILN_NPU_BUDGET_MIB`, else 1024;
    /// capped at the 4096 MiB of one IOMMU domain). Weights that do not fit, in model order
    /// (layer by layer, then the LM head; as the model load reserves them), are declined as
    /// `NpuMemory`.
    #[arg(long)]
    npu_budget_mib: Option<u64>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let budget = a.npu_budget_mib.map(|mib| mib << 20);
    let out = kiln_runtime::sched::plan_report_with(&a.file, &a.m, a.json, budget)?;
    super::print_all(&out)
}
