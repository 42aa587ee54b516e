use anyhow::Context;
use clap::Parser;
use kiln_runtime::gguf::{GgufFile, Value};
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// kiln: the on-board LLM runtime and boot self-check for RK3588 boards.
#[derive(Parser)]
#[command(name = "kiln", version, about)]
enum Cli {
    /// Print the build's identity: version and target architecture.
    Version,
    /// Print a GGUF file's header: version, alignment, data offset, metadata, tensor table,
    /// totals per type and the weight-ownership line.
    Inspect {
        file: PathBuf,
        /// Machine-readable output, with every metadata value in full.
        #[arg(long)]
        json: bool,
    },
    /// Write one tensor as raw little-endian f32, ne0 fastest.
    Dequant {
        file: PathBuf,
        tensor: String,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// The coverage table for a model: per backend (board order: npu, then cpu) the matmul
    /// weights and bytes it owns and the ops it claims at each M; per reason, the declines.
    Plan {
        file: PathBuf,
        /// Row counts (M) to plan for, e.g. 1 for decode and 512 for prefill.
        #[arg(long, value_delimiter = ',', default_value = "1,8,512")]
        m: Vec<usize>,
        #[arg(long)]
        json: bool,
    },
    /// C = A · Wᵀ for one weight of a GGUF file: A is M rows of K raw little-endian f32, C is
    /// written as M rows of N. Prints which backend ran it, or why none would.
    Matmul {
        file: PathBuf,
        tensor: String,
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        m: usize,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
        /// Run on this backend only (default: board order, npu then cpu).
        #[arg(long, value_enum)]
        backend: Option<BackendChoice>,
        /// Threads of the cpu backend (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// The boot self-check: every check with its status, evidence and duration; the report to the
    /// console (between KILN-REPORT-BEGIN/END, then a KILN-SELFTEST verdict line) and, with
    /// --report-dir, to report.json and report.txt. Exits non-zero if any check failed.
    Selftest(kiln_runtime::selftest::cli::Args),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum BackendChoice {
    Cpu,
    CpuRef,
    Npu,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        // One line: the file, the byte offset and what was wrong travel in the chain.
        eprintln!("kiln: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli {
        Cli::Selftest(a) => {
            let code = kiln_runtime::selftest::cli::run(a)?;
            std::io::stdout().flush().context("flushing stdout")?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Cli::Version => {
            println!(
                "kiln {} ({})",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::ARCH
            );
        }
        Cli::Inspect { file, json } => {
            let f = GgufFile::open(&file)?;
            let out = if json {
                let mut s = serde_json::to_string_pretty(&inspect_json(&f))?;
                s.push('\n');
                s
            } else {
                inspect_text(&f)
            };
            let mut stdout = std::io::stdout().lock();
            // A closed pipe (`kiln inspect … | head`) is not an error worth a message.
            match stdout.write_all(out.as_bytes()) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                r => r.context("writing to stdout")?,
            }
        }
        Cli::Plan { file, m, json } => {
            let out = kiln_runtime::sched::plan_report(&file, &m, json)?;
            let mut stdout = std::io::stdout().lock();
            match stdout.write_all(out.as_bytes()) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                r => r.context("writing to stdout")?,
            }
        }
        Cli::Matmul {
            file,
            tensor,
            input,
            m,
            output,
            backend,
            threads,
        } => matmul(&file, &tensor, &input, m, &output, backend, threads)?,
        Cli::Dequant {
            file,
            tensor,
            output,
        } => dequant(&file, &tensor, &output)?,
    }
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn type_label(v: &Value) -> String {
    match v.as_array() {
        Some((elem, _)) => format!("ARRAY[{elem}]"),
        None => v.value_type().to_string(),
    }
}

fn inspect_text(f: &GgufFile) -> String {
    use std::fmt::Write as _;
    let g = f.gguf();
    let mut s = String::new();
    let _ = writeln!(s, "file: {}", f.path().display());
    let _ = writeln!(
        s,
        "GGUF v{}, alignment {}, data offset {}, file size {} bytes, {} metadata keys, {} tensors",
        g.version,
        g.alignment,
        g.data_offset,
        g.file_len,
        g.metadata().len(),
        g.tensor_infos().len()
    );
    let _ = writeln!(s, "\nmetadata:");
    let key_w = g.metadata().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in g.metadata() {
        let _ = writeln!(s, "  {k:<key_w$}  {:<14} {}", type_label(v), v.summary(8));
    }
    let _ = writeln!(s, "\ntensors:");
    let name_w = g
        .tensor_infos()
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        s,
        "  {:<name_w$}  {:<7} {:>8} {:>8} {:>6} {:>6} {:>12} {:>12}",
        "name", "type", "ne0", "ne1", "ne2", "ne3", "offset", "bytes"
    );
    for t in g.tensor_infos() {
        let _ = writeln!(
            s,
            "  {:<name_w$}  {:<7} {:>8} {:>8} {:>6} {:>6} {:>12} {:>12}",
            t.name,
            t.ty.name(),
            t.ne[0],
            t.ne[1],
            t.ne[2],
            t.ne[3],
            t.offset,
            t.n_bytes
        );
    }
    let _ = writeln!(s, "\ntotals by type:");
    for (ty, n, bytes) in g.totals_by_type() {
        let _ = writeln!(
            s,
            "  {:<7} {n:>5} tensors {:>12} bytes ({:.2} MiB)",
            ty.name(),
            bytes,
            mib(bytes)
        );
    }
    let _ = writeln!(s);
    for line in f.ledger().lines() {
        let _ = writeln!(s, "{line}");
    }
    s
}

fn inspect_json(f: &GgufFile) -> serde_json::Value {
    use serde_json::json;
    let g = f.gguf();
    let metadata: Vec<_> = g
        .metadata()
        .map(|(k, v)| {
            let mut m = json!({ "key": k, "type": v.value_type().name(), "value": v.to_json() });
            if let Some((elem, items)) = v.as_array() {
                m["element_type"] = json!(elem.name());
                m["length"] = json!(items.len());
            }
            m
        })
        .collect();
    let tensors: Vec<_> = g
        .tensor_infos()
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "type": t.ty.name(),
                "type_id": t.ty.id(),
                "n_dims": t.n_dims,
                "ne": t.ne,
                "offset": t.offset,
                "bytes": t.n_bytes,
            })
        })
        .collect();
    let totals: Vec<_> = g
        .totals_by_type()
        .into_iter()
        .map(|(ty, n, bytes)| json!({ "type": ty.name(), "tensors": n, "bytes": bytes }))
        .collect();
    let ledger = f.ledger();
    json!({
        "file": f.path().display().to_string(),
        "version": g.version,
        "alignment": g.alignment,
        "data_offset": g.data_offset,
        "file_size": g.file_len,
        "metadata": metadata,
        "tensors": tensors,
        "totals_by_type": totals,
        "ownership": ledger.lines(),
        "ledger": ledger,
    })
}

fn dequant(file: &Path, tensor: &str, output: &Path) -> anyhow::Result<()> {
    let f = GgufFile::open(file)?;
    let t = f.tensor(tensor).with_context(|| {
        format!(
            "{}: no tensor named {tensor:?} ({} tensors in the file)",
            file.display(),
            f.gguf().tensor_infos().len()
        )
    })?;
    let at = f.gguf().data_offset + t.offset;
    let values = t.to_f32().with_context(|| {
        format!(
            "{}: at byte {at}: tensor {tensor:?} ({} {:?})",
            file.display(),
            t.ty,
            &t.ne[..t.n_dims as usize]
        )
    })?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_atomic(output, &bytes)
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
    let t = f.tensor(tensor).with_context(|| {
        format!(
            "{}: no tensor named {tensor:?} ({} tensors in the file)",
            file.display(),
            f.gguf().tensor_infos().len()
        )
    })?;
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
    let npu_b = npu::NpuBackend::default();
    let cpu_ref = cpu::CpuRefBackend;
    let order: Vec<&dyn Backend> = match choice {
        None => vec![&npu_b, &cpu_b],
        Some(BackendChoice::Npu) => vec![&npu_b],
        Some(BackendChoice::Cpu) => vec![&cpu_b],
        Some(BackendChoice::CpuRef) => vec![&cpu_ref],
    };
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
        write_atomic(output, &bytes)?;
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

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file path", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
