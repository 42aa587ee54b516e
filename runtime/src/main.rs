use clap::Parser;

/// kiln: the on-board LLM runtime and boot self-check for RK3588 boards.
#[derive(Parser)]
#[command(name = "kiln", version, about)]
enum Cli {
    /// Print the build's identity: version and target architecture.
    Version,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse() {
        Cli::Version => {
            println!(
                "kiln {} ({})",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::ARCH
            );
        }
    }
    Ok(())
}
