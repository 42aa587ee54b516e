use clap::{CommandFactory as _, Parser};

mod cli;

/// kiln: the on-board LLM runtime and boot self-check for RK3588 boards.
#[derive(Parser)]
#[command(name = "kiln", version, about)]
enum Cli {
    /// Print the build's identity: version and target architecture.
    Version,
    /// Print a GGUF file's header: version, alignment, data offset, metadata, tensor table, totals
    /// per type and data-section size.
    ///
    /// Facts of the file: it prepares nothing, so it says nothing about who owns the weights; that
    /// is printed, measured, by `kiln plan` and the self-check.
    Inspect(cli::inspect::Args),
    /// Write one tensor as raw little-endian f32, ne0 fastest.
    Dequant(cli::dequant::Args),
    /// The coverage table for a model: per backend (board order: npu, then cpu) the matmul weights
    /// and bytes it owns and the ops it claims at each M; per reason, the declines.
    ///
    /// Also the NPU MiB of each weight (converted B) and the total against the NPU budget
    /// (`--npu-budget-mib`), and the ownership lines, measured around each `prepare`.
    /// `KILN_RKNN_LIB` picks the librknnrt to load.
    Plan(cli::plan::Args),
    /// C = A · Wᵀ for one weight of a GGUF file: A is M rows of K raw little-endian f32, C is
    /// written as M rows of N. Prints which backend ran it (SIMULATED on the NPU stand-in), or why
    /// none would.
    Matmul(cli::matmul::Args),
    /// The boot self-check: every check with its status, evidence and duration, to the console and
    /// (with --report-dir) to report.json and report.txt. Exits non-zero if any check failed.
    ///
    /// `/init` runs it at every boot. On the console first one line per check for farm tools,
    /// `KILN-CHECK <id> PASS|FAIL|SKIP <ms>` (the report's ids and statuses in its order; `/init`
    /// keeps kernel messages off the console meanwhile, `printk` level 1, so none breaks a line;
    /// every boot stage checks the lines against the report), then the report as one JSON line
    /// between `KILN-REPORT-BEGIN` and `KILN-REPORT-END` (`--console json`, what `/init` asks under
    /// `kiln.mode=test`, for the harness) or as report.txt's table (`--console text`, what `/init`
    /// asks otherwise, for a person), then the verdict line `KILN-SELFTEST: PASS|FAIL n/m
    /// manifest=<sha256>`: the sha256 of the boot partition's `kiln/manifest.json`, which `cargo
    /// xtask image` prints and writes to `target/images/kiln-<board>.manifest.sha256`, and `cargo
    /// xtask report` matches with the built image.
    ///
    /// The checks and what each proves: docs/self-check.md.
    Selftest(cli::selftest::Args),
    /// Generate a continuation of a prompt, streamed (--json: one object with the tokens, the text
    /// and the prefill/decode speeds).
    ///
    /// `--temp 0` is greedy, ties to the lowest id. Inference runs on the big cores (told apart by
    /// `cpu_capacity` or `cpuinfo_max_freq` in sysfs: an RK3588's four A76) unless `--cpus` says
    /// otherwise, and a line on stderr says which and why, as for every model command (`run`,
    /// `chat`, `ppl`, `bench`, `serve`). `--json` prints
    /// `{"prompt_tokens","tokens","text","prefill_tok_s","decode_tok_s"}`. `--ids 1,2,3` instead of
    /// `-p` serves models without a tokenizer.
    Run(cli::run::Args),
    /// Mean negative log-likelihood and perplexity of a text, in windows of --ctx tokens.
    ///
    /// Every token after the first of each window is scored from the earlier tokens of its window;
    /// the cache is cleared between windows. `--json` prints
    /// `{"tokens","scored","mean_nll","ppl"}`.
    Ppl(cli::ppl::Args),
    /// Prefill and decode tok/s, weight bytes per decoded token as a fraction of the read bandwidth
    /// measured in the same run, which backend ran how many matmuls, anonymous vs file-backed
    /// memory.
    Bench(cli::bench::Args),
    /// Interactive console chat: the file's chat template (`tokenizer.chat_template`, rendered with
    /// minijinja), the KV cache kept across turns, each reply stopping at end-of-generation.
    Chat(cli::chat::Args),
    /// The token ids of a text as llama.cpp gives them (BOS/EOS as the file says, special tokens
    /// parsed): one line per token with its piece, or `{"tokens":[…]}` with --json.
    Tokenize(cli::tokenize::Args),
    /// An OpenAI-compatible HTTP API over the model (/v1/models, /v1/completions,
    /// /v1/chat/completions, streamed as server-sent events), /health, /kiln/report, /metrics;
    /// inference on its own thread, up to --parallel sequences at once.
    ///
    /// Requests take `temperature`, `top_p`, `top_k`, `seed`, `stop`, `max_tokens`, `usage` and
    /// `stream: true` (server-sent events ending `data: [DONE]`); chat goes through the file's chat
    /// template, as `kiln chat`. A parameter kiln does not implement gets 400 naming it, never a
    /// plain answer. `GET /health` is 503 until the model is loaded; `GET /kiln/report` is the
    /// `--report` file's bytes; `GET /metrics` is Prometheus text.
    ///
    /// Up to `--parallel` sequences are decoded together, one forward pass per step at M = active
    /// sequences (continuous batching), a new request's prefill between steps; with greedy sampling
    /// each request gets the tokens `kiln run --temp 0` gives it alone on the CPU backends.
    ///
    /// Only what the self-check proved is served: a `--report` whose verdict is not PASS, or a
    /// model that did not load, gets 503 naming why; past `--queue`, 429. Without MODEL it serves
    /// the report, `/health` and `/metrics` only. One process uses the NPU at a time: a second NPU
    /// user exits at once naming the holder. Its doors, limits and numerics, and how `/init` starts
    /// it on a board: docs/serving.md.
    Serve(cli::serve::Args),
    /// The A/B boot slots' counters (kiln/abstate.env on bootctl, RAUC's U-Boot contract): `status`
    /// (--json), `mark-good|mark-bad|mark-active [A|B|booted|other]` as rauc does them.
    ///
    /// The marks (default: the booted slot) edit the file as `rauc status mark-*` does (good: 3
    /// tries; bad: out of `BOOT_ORDER`, 0; active: first, 3), written as `.new`, fsync, rename,
    /// folder fsync; a damaged or missing file is refused unless `--reset`. `--class models` edits
    /// the models slots' `MODELS_ORDER`/`MODELS_x_LEFT` instead; `models-primary` prints the models
    /// slot init maps next, `models-take` is init's take of its try. Tested against
    /// `fw_printenv`/`fw_setenv`, `mkenvimage` and a real rauc 1.8 service
    /// (`runtime/tests/slot_tools.rs`, `slot_rauc.rs`). The slots: docs/ab-and-fleet.md.
    Slot(cli::slot::Args),
    /// The board's hawkBit client (DDI): poll, download, `rauc install`, and report the new slot's
    /// self-check verdict to the fleet (started by /init after the verdict).
    ///
    /// `/init` starts it when the image has `/etc/kiln/fleet.toml` (the recipe's `[fleet]`): the
    /// server, the controller id and the token file on `data` (written by `cargo xtask flash
    /// --fleet-token`). A deployment is `closed`/`success` only after the new slot's self-check
    /// said PASS. The protocol, what it refuses and what a power cut does: docs/ab-and-fleet.md.
    Fleet(cli::fleet::Args),
    /// The models partition through dm-verity: `map` (by /init), `status`, `is-factory`, `active`,
    /// `format`, `root`.
    ///
    /// A models slot is believed when it is the factory slot the booted manifest names or is signed
    /// by a key the update keyring trusts, in a models format this kiln reads; only then is it
    /// mapped. How: docs/models-slots.md.
    Verity(cli::verity::Args),
    /// docs/commands.md's `kiln` part (every command's --help as Markdown), for `cargo xtask
    /// docs --write`.
    #[command(hide = true)]
    CommandsMd,
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
        Cli::CommandsMd => cli::print_all(&kiln_runtime::clidoc::markdown(&Cli::command())),
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

    #[test]
    fn every_command_parses() {
        Cli::command().debug_assert();
    }

    /// docs/commands.md's `kiln` part is what `kiln … --help` says: a command, option or help
    /// text changed here is a failing test until `cargo xtask docs --write` puts it there.
    #[test]
    fn docs_commands_md_is_the_help() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/commands.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let part = kiln_runtime::clidoc::markdown(&Cli::command());
        let want = kiln_runtime::clidoc::with_part(&doc, "kiln", &part).unwrap();
        assert!(
            doc == want,
            "docs/commands.md's `kiln` part is not what `kiln … --help` says: run \
             `cargo xtask docs --write`"
        );
    }
}
