use clap::Parser;

mod cli;

/// kiln: the on-board LLM runtime and boot self-check for RK3588 boards.
#[derive(Parser)]
#[command(name = "kiln", version, about)]
enum Cli {
    /// Print the build's identity: version and target architecture.
    Version,
    /// Print a GGUF file's header: version, alignment, data offset, metadata, tensor table,
    /// totals per type and the weight-ownership line.
    Inspect(cli::inspect::Args),
    /// Write one tensor as raw little-endian f32, ne0 fastest.
    Dequant(cli::dequant::Args),
    /// The coverage table for a model: per backend (board order: npu, then cpu) the matmul
    /// weights and bytes it owns and the ops it claims at each M; per reason, the declines.
    Plan(cli::plan::Args),
    /// C = A · Wᵀ for one weight of a GGUF file: A is M rows of K raw little-endian f32, C is
    /// written as M rows of N. Prints which backend ran it, or why none would.
    Matmul(cli::matmul::Args),
    /// The boot self-check: every check with its status, evidence and duration; the report to the
    /// console (between KILN-REPORT-BEGIN/END, then a KILN-SELFTEST verdict line) and, with
    /// --report-dir, to report.json and report.txt. Exits non-zero if any check failed.
    Selftest(cli::selftest::Args),
    /// Generate a continuation of a prompt, streamed (--json: one object with the tokens, the
    /// text and the prefill/decode speeds).
    Run(cli::run::Args),
    /// Mean negative log-likelihood and perplexity of a text, in windows of --ctx tokens.
    Ppl(cli::ppl::Args),
    /// Prefill and decode tok/s, weight bytes per decoded token as a fraction of the read
    /// bandwidth measured in the same run, which backend ran what, anonymous vs mapped memory.
    Bench(cli::bench::Args),
    /// Interactive console chat: the file's chat template (minijinja), the KV cache kept across
    /// turns, each reply stopping at end-of-generation.
    Chat(cli::chat::Args),
    /// The token ids of a text as llama.cpp gives them (BOS/EOS as the file says, special tokens
    /// parsed): one line per token with its piece, or `{"tokens":[…]}` with --json.
    Tokenize(cli::tokenize::Args),
    /// An OpenAI-compatible HTTP API over the model (/v1/models, /v1/completions,
    /// /v1/chat/completions, streamed as server-sent events), /health, /kiln/report, /metrics;
    /// inference on its own thread, up to --parallel sequences at once.
    Serve(cli::serve::Args),
    /// The A/B boot slots' counters (kiln/abstate.env on bootctl, RAUC's U-Boot contract):
    /// `status` (--json), `mark-good|mark-bad|mark-active [A|B|booted|other]` as rauc does them.
    Slot(cli::slot::Args),
    /// The board's hawkBit client (DDI): poll, download, `rauc install`, and report the new
    /// slot's self-check verdict to the fleet (started by /init after the verdict).
    Fleet(cli::fleet::Args),
    /// The models partition through dm-verity: `map` (by /init), `status`, `root`.
    Verity(cli::verity::Args),
}

fn main() {
    // The release profile unwinds so that a panic of the chat template engine can be contained
    // (`kiln_runtime::contain`); every other panic still ends the process, as `abort` did.
    kiln_runtime::contain::install_abort_hook();
    let result = match Cli::parse() {
        Cli::Version => {
            println!(
                "kiln {} ({})",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::ARCH
            );
            Ok(())
        }
        Cli::Inspect(a) => cli::inspect::run(a),
        Cli::Dequant(a) => cli::dequant::run(a),
        Cli::Plan(a) => cli::plan::run(a),
        Cli::Matmul(a) => cli::matmul::run(a),
        Cli::Selftest(a) => cli::selftest::run(a),
        Cli::Run(a) => cli::run::run(a),
        Cli::Ppl(a) => cli::ppl::run(a),
        Cli::Bench(a) => cli::bench::run(a),
        Cli::Chat(a) => cli::chat::run(a),
        Cli::Tokenize(a) => cli::tokenize::run(a),
        Cli::Serve(a) => cli::serve::run(a),
        Cli::Slot(a) => cli::slot::run(a),
        Cli::Fleet(a) => cli::fleet::run(a),
        Cli::Verity(a) => cli::verity::run(a),
    };
    if let Err(e) = result {
        // One line: the file, the byte offset and what was wrong travel in the chain.
        eprintln!("kiln: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(argv: &[&str]) -> cli::run::SampleArgs {
        match Cli::try_parse_from(argv).unwrap() {
            Cli::Run(a) => a.sample,
            Cli::Chat(a) => a.sample,
            _ => unreachable!("only run and chat are parsed here"),
        }
    }

    #[test]
    fn run_and_chat_sample_alike() {
        let run = sample(&["kiln", "run", "m.gguf", "-p", "hi"]);
        let chat = sample(&["kiln", "chat", "m.gguf"]);
        assert_eq!(run, chat, "one set of defaults");
        assert_eq!((run.temp, run.top_k, run.top_p), (0.8, 40, 0.95));
        let set = [
            "--temp", "0", "--top-k", "5", "--top-p", "0.5", "--seed", "7",
        ];
        let run = sample(&[&["kiln", "run", "m.gguf", "-p", "hi"][..], &set].concat());
        let chat = sample(&[&["kiln", "chat", "m.gguf"][..], &set].concat());
        assert_eq!(run, chat);
        assert_eq!((run.temp, run.top_k, run.seed), (0.0, 5, 7));
    }
}
