//! `kiln ppl`: perplexity of a text. Tokenised as `kiln tokenize` does; windows of `--ctx` tokens
//! (default: the whole text if it fits the model's context, else 512), the cache cleared between
//! them; every token after the first of a window is scored from all earlier tokens of its window.

use super::run::{encode_text, parse_ids, ModelArgs};
use anyhow::{Context, Result};
use kiln_runtime::model::nll_windows;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(mut_arg("ctx", |a| a.help(
    "Window length in tokens, the cache cleared between windows (default: the whole text if it \
     fits the model's context, else 512)"
)))]
pub struct Args {
    #[command(flatten)]
    pub m: ModelArgs,
    /// The text to score, from a file.
    #[arg(long, conflicts_with_all = ["text", "ids"])]
    pub file: Option<PathBuf>,
    /// The text to score.
    #[arg(long, conflicts_with = "ids")]
    pub text: Option<String>,
    /// The tokens to score, as comma-separated ids (models without a tokenizer).
    #[arg(long)]
    pub ids: Option<String>,
    /// One JSON object instead of the line.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let f = a.m.open()?;
    let tokens = match (&a.file, &a.text, &a.ids) {
        (Some(p), _, _) => {
            let t =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            encode_text(&f, &t)?
        }
        (None, Some(t), _) => encode_text(&f, t)?,
        (None, None, Some(ids)) => parse_ids(ids)?,
        _ => anyhow::bail!("give --file F, --text T or --ids"),
    };
    anyhow::ensure!(
        tokens.len() >= 2,
        "{} tokens: nothing to score",
        tokens.len()
    );
    let model = a.m.load(&f)?;
    let n_ctx = match a.m.ctx {
        Some(c) => c,
        None if tokens.len() <= model.hp.n_ctx_train => tokens.len(),
        None => 512,
    };
    let mut s = model.session(n_ctx, a.m.kv)?;
    let (scored, sum) = nll_windows(&model, &mut s, &tokens, n_ctx)?;
    anyhow::ensure!(scored > 0, "no window had two tokens to score");
    let mean = sum / scored as f64;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"tokens": tokens.len(), "scored": scored, "mean_nll": mean, "ppl": mean.exp()})
        );
    } else {
        println!(
            "tokens {} scored {scored} (windows of {n_ctx}) mean NLL {mean:.6} PPL {:.4}",
            tokens.len(),
            mean.exp()
        );
    }
    Ok(())
}
