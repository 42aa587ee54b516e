use clap::Parser;
use std::path::PathBuf;

/// kiln: the on-board LLM runtime and boot self-check for RK3588 boards.
#[derive(Parser)]
#[command(name = "kiln", version, about)]
enum Cli {
    /// Print the build's identity: version and target architecture.
    Version,
    /// The boot self-check: every check with its status, evidence and duration; the report to the
    /// console (between KILN-REPORT-BEGIN/END, then a KILN-SELFTEST verdict line) and, with
    /// --report-dir, to report.json and report.txt. Exits non-zero if any check failed.
    Selftest(SelftestArgs),
}

#[derive(clap::Args)]
struct SelftestArgs {
    /// The board file (/etc/kiln/board.toml). Without it the board-only checks skip.
    #[arg(long)]
    board: Option<PathBuf>,
    /// Where to write report.json and report.txt (atomically).
    #[arg(long)]
    report_dir: Option<PathBuf>,
    /// Root that /proc, /sys, /dev, /boot, /models and /data/models are looked up under.
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// Folders searched for GGUF models, instead of ROOT/models and ROOT/data/models.
    #[arg(long)]
    models: Vec<PathBuf>,
}

fn selftest(a: SelftestArgs) -> anyhow::Result<std::process::ExitCode> {
    use kiln_runtime::selftest::{board::Board, run_all, Ctx, Inject, Paths};
    let mut paths = Paths::under(&a.root);
    if !a.models.is_empty() {
        paths.models = a.models;
    }
    let board = a.board.as_deref().map(Board::load).transpose()?;
    let ctx = Ctx {
        paths,
        board,
        inject: Inject::from_env()?,
    };
    let report = run_all(&ctx);
    let mut write_err = None;
    if let Some(dir) = &a.report_dir {
        if let Err(e) = report.write_to(dir) {
            write_err = Some(e);
        }
    }
    print!("{}", report.console());
    if let Some(e) = write_err {
        // The console verdict stands; a missing report file is its own failure.
        eprintln!("kiln selftest: could not write the report: {e:#}");
        return Ok(std::process::ExitCode::from(2));
    }
    Ok(if report.failed == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

fn main() -> anyhow::Result<std::process::ExitCode> {
    match Cli::parse() {
        Cli::Version => {
            println!(
                "kiln {} ({})",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::ARCH
            );
        }
        Cli::Selftest(a) => return selftest(a),
    }
    Ok(std::process::ExitCode::SUCCESS)
}
