//! `kiln run`: generate a continuation of a prompt, streamed as it is decoded. Also holds the
//! model arguments `ppl`, `bench` and `chat` share.

use anyhow::{Context, Result};
use kiln_runtime::gguf::GgufFile;
use kiln_runtime::model::sample::{Sampler, SamplerConfig};
use kiln_runtime::model::{BackendSel, KvType, Model, Options, Want};
use kiln_runtime::tokenizer::{StreamDecoder, Tokenizer};
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// What every model command takes.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// The GGUF model (llama, qwen2, qwen3, gemma3 or phi3).
    #[arg(required = true)]
    pub model: Option<PathBuf>,
    /// Context length: the KV cache is allocated for this many tokens (default: the model's
    /// context_length, at most 2048).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// KV cache type (llama.cpp's default is f16).
    #[arg(long, value_enum, default_value = "f16")]
    pub kv: KvType,
    /// Threads for the CPU matmuls and the attention (default: one per inference CPU, see
    /// --cpus).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// CPUs inference runs on, as the kernel lists them (e.g. 4-7 or 0,2). Default: the big
    /// cores, told apart by cpu_capacity or cpuinfo_max_freq in sysfs (all CPUs when they are
    /// alike).
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,
    /// Which backends run the matmuls: auto = the plan's choice per weight and M (NPU for prefill
    /// rows it accepts, CPU otherwise).
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendSel,
    /// Print the coverage table and the ownership lines to stderr before running.
    #[arg(long)]
    pub verbose: bool,
}

impl ModelArgs {
    /// The MODEL argument (required by every command but `kiln serve`, which can serve the
    /// report without one).
    pub fn path(&self) -> Result<&std::path::Path> {
        self.model.as_deref().context("no MODEL given")
    }

    pub fn open(&self) -> Result<GgufFile> {
        let p = self.path()?;
        GgufFile::open(p).with_context(|| format!("opening {}", p.display()))
    }

    /// Restrict this thread, and every thread it starts from now on, to the inference CPUs
    /// (--cpus, else the big cores), and say which on stderr.
    pub fn pin_cpus(&self) -> Result<kiln_runtime::cpus::Selection> {
        let sel = kiln_runtime::cpus::select_and_apply(self.cpus.as_deref())?;
        eprintln!("kiln: {}", sel.describe());
        Ok(sel)
    }

    pub fn load<'m>(&self, f: &'m GgufFile) -> Result<Model<'m>> {
        Ok(self.load_pinned(f)?.0)
    }

    /// [`ModelArgs::load`], with the inference CPUs it pinned.
    pub fn load_pinned<'m>(
        &self,
        f: &'m GgufFile,
    ) -> Result<(Model<'m>, kiln_runtime::cpus::Selection)> {
        let sel = self.pin_cpus()?;
        let m = Model::load(
            f,
            &Options {
                backend: self.backend,
                threads: self.threads,
                ..Options::default()
            },
        )?;
        if self.verbose {
            eprintln!("{}", m.plan_text);
        }
        for l in m.ledger.lines() {
            eprintln!("{l}");
        }
        Ok((m, sel))
    }

    pub fn n_ctx(&self, m: &Model<'_>) -> usize {
        self.ctx.unwrap_or(m.hp.n_ctx_train.min(2048))
    }
}

/// Comma-separated token ids (models without a tokenizer, and tests).
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .with_context(|| format!("--ids: {t:?} is not a token id"))
        })
        .collect()
}

/// The sampling arguments of `kiln run` and `kiln chat`: one set, one set of defaults. They are
/// llama.cpp's (`llama-cli` and `llama-server`: temperature 0.8, top-k 40, top-p 0.95), so that a
/// user comparing the two samples alike; `kiln chat` used 0.7 before, a value no reference uses.
#[derive(clap::Args, Clone, Copy, Debug, PartialEq)]
pub struct SampleArgs {
    /// Temperature; 0 = greedy (argmax, ties to the lowest id).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 = all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// The sampler's seed: the same seed, prompt and model give the same tokens.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

impl SampleArgs {
    pub fn sampler(&self) -> Sampler {
        Sampler::new(SamplerConfig {
            temp: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        })
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub m: ModelArgs,
    /// The prompt text.
    #[arg(short = 'p', long = "prompt", required_unless_present = "ids")]
    pub prompt: Option<String>,
    /// The prompt as comma-separated token ids instead of text.
    #[arg(long, conflicts_with = "prompt")]
    pub ids: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', default_value_t = 64)]
    pub n: usize,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let f = a.m.open()?;
    let model = a.m.load(&f)?;
    let prompt: Vec<u32> = match (&a.ids, &a.prompt) {
        (Some(ids), _) => parse_ids(ids)?,
        (None, Some(p)) => encode_text(&f, p)?,
        (None, None) => anyhow::bail!("give -p PROMPT or --ids"),
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt has no tokens");
    let mut s = model.session(a.m.n_ctx(&model), a.m.kv)?;
    let mut sampler = a.sample.sampler();
    let text = TextOut::new(&f)?;
    let mut stream = text.stream();
    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let mut logits = model.forward(&mut s, &prompt, Want::Last)?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut tokens = Vec::new();
    let mut all_text = String::new();
    let t1 = Instant::now();
    for i in 0..a.n {
        let t = sampler.sample(&logits);
        tokens.push(t);
        let piece = stream.push(t);
        all_text.push_str(&piece);
        if !a.json {
            out.write_all(piece.as_bytes()).context("stdout")?;
            out.flush().context("stdout")?;
        }
        if text.is_eog(t) || i + 1 == a.n {
            break;
        }
        logits = model.forward(&mut s, &[t], Want::Last)?;
    }
    let decode = t1.elapsed().as_secs_f64();
    let rest = stream.finish();
    all_text.push_str(&rest);
    // The first sampled token comes from the prefill's logits; decode steps are the rest.
    let steps = tokens.len().saturating_sub(1);
    if a.json {
        let v = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": tokens,
            "text": all_text,
            "prefill_tok_s": prompt.len() as f64 / prefill,
            "decode_tok_s": if steps > 0 { steps as f64 / decode } else { 0.0 },
        });
        writeln!(out, "{v}").context("stdout")?;
    } else {
        writeln!(out, "{rest}").context("stdout")?;
        eprintln!(
            "prefill {} tokens at {:.1} tok/s, decode {} at {:.1} tok/s",
            prompt.len(),
            prompt.len() as f64 / prefill,
            steps,
            if steps > 0 {
                steps as f64 / decode
            } else {
                0.0
            }
        );
    }
    Ok(())
}

/// The prompt's token ids, as `kiln tokenize` gives them (BOS/EOS per the file, specials parsed).
pub fn encode_text(f: &GgufFile, text: &str) -> Result<Vec<u32>> {
    let tok = Tokenizer::from_gguf(f.gguf())
        .with_context(|| format!("{}: tokenizer", f.path().display()))?;
    tok.encode(text, true, true)
}

/// Token ids back to text for streaming, and the end-of-generation test.
pub struct TextOut {
    tok: Tokenizer,
}

impl TextOut {
    pub fn new(f: &GgufFile) -> Result<TextOut> {
        let tok = Tokenizer::from_gguf(f.gguf())
            .with_context(|| format!("{}: tokenizer", f.path().display()))?;
        Ok(TextOut { tok })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    pub fn is_eog(&self, t: u32) -> bool {
        self.tok.is_eog(t)
    }

    pub fn stream(&self) -> Stream<'_> {
        Stream {
            tok: &self.tok,
            dec: StreamDecoder::new(),
        }
    }
}

/// UTF-8-safe streaming of generated tokens.
pub struct Stream<'t> {
    tok: &'t Tokenizer,
    dec: StreamDecoder,
}

impl Stream<'_> {
    pub fn push(&mut self, t: u32) -> String {
        self.dec.push(&self.tok.token_to_piece(t))
    }

    pub fn finish(self) -> String {
        self.dec.finish()
    }
}
