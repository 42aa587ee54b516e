//! `kiln matmul`: C = A · Wᵀ for one weight, on the backend the board order (or --backend) picks.

use super::BackendChoice;
use anyhow::Context;
use kiln_runtime::gguf::GgufFile;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// The weight W, by its tensor name.
    tensor: String,
    /// A: M rows of K raw little-endian f32.
    #[arg(long)]
    input: PathBuf,
    /// M, the rows of A.
    #[arg(long)]
    m: usize,
    /// Where to write C: M rows of N raw little-endian f32.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Run on this backend only (default: board order, npu then cpu).
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// Threads of the cpu backend (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    matmul(
        &a.file, &a.tensor, &a.input, a.m, &a.output, a.backend, a.threads,
    )
}

fn matmul(
    file: &Path,
    tensor: &str,
    input: &Path,
    m: usize,
    output: &Path,
    choice: Option<BackendChoice>,
    threads: Option<usize>,
) -> anyhow::Result<()> {
    use kiln_runtime::backend::{cpu, npu, run_checked, Backend, MatmulOp};
    let f = GgufFile::open(file)?;
    let t = super::tensor(&f, tensor)?;
    let w = t.as_weight().with_context(|| {
        format!(
            "{}: tensor {tensor:?} has {} dimensions, a matmul weight has 2",
            file.display(),
            t.n_dims
        )
    })?;
    anyhow::ensure!(m > 0, "--m must be at least 1");
    let raw = std::fs::read(input).with_context(|| format!("reading {}", input.display()))?;
    anyhow::ensure!(
        raw.len() == m * w.k * 4,
        "{}: {} bytes, but M×K f32 for {tensor} is {m}×{}×4 = {} bytes",
        input.display(),
        raw.len(),
        w.k,
        m * w.k * 4
    );
    let a: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut cpu_b = cpu::CpuBackend::new();
    if let Some(t) = threads {
        cpu_b = cpu_b.with_threads(t);
    }
    // The NPU (and its lock) only when it may run the op.
    let npu_b = match choice {
        None | Some(BackendChoice::Npu) => Some(npu::NpuBackend::open(npu::NpuConfig::default())?),
        Some(BackendChoice::Cpu | BackendChoice::CpuRef) => None,
    };
    let cpu_ref = cpu::CpuRefBackend;
    let mut order: Vec<&dyn Backend> = Vec::new();
    if let Some(n) = &npu_b {
        order.push(n);
    }
    match choice {
        None | Some(BackendChoice::Cpu) => order.push(&cpu_b),
        Some(BackendChoice::CpuRef) => order.push(&cpu_ref),
        Some(BackendChoice::Npu) => {}
    }
    let op = MatmulOp::for_weight(&w, m);
    let mut why = Vec::new();
    for b in order {
        if let Err(d) = b.supports(&op) {
            println!("{} declined {tensor} at M={m}: {d}", b.name());
            why.push(format!("{}: {d}", b.name()));
            continue;
        }
        let started = std::time::Instant::now();
        let prepared = match b.prepare(&w) {
            Ok(p) => p,
            Err(e) if choice.is_none() => {
                println!(
                    "{} could not prepare {tensor}, falling back: {e:#}",
                    b.name()
                );
                why.push(format!("{}: prepare failed: {e:#}", b.name()));
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut c = vec![0f32; m * w.n];
        if let Err(e) = run_checked(b, &w, prepared.as_ref(), &a, m, &mut c) {
            if choice.is_some() {
                return Err(e);
            }
            println!("{} failed, falling back: {e:#}", b.name());
            why.push(format!("{}: failed: {e:#}", b.name()));
            continue;
        }
        let bytes: Vec<u8> = c.iter().flat_map(|v| v.to_le_bytes()).collect();
        super::write_atomic(output, &bytes)?;
        let simulated = b.probe().is_ok_and(|c| c.simulated);
        println!(
            "ran on {}{}: {tensor} ({}) M={m} K={} N={} in {:.1} ms -> {}",
            b.name(),
            if simulated { " (SIMULATED)" } else { "" },
            w.ty,
            w.k,
            w.n,
            started.elapsed().as_secs_f64() * 1e3,
            output.display()
        );
        return Ok(());
    }
    anyhow::bail!("no backend ran {tensor} at M={m}: {}", why.join("; "))
}
