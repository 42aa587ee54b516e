//! `kiln tokenize`: the token ids of a text, as llama.cpp's llama_tokenize gives them (BOS/EOS
//! as the file says, special tokens parsed).

use anyhow::Context;
use kiln_runtime::gguf::GgufFile;
use kiln_runtime::tokenizer::Tokenizer;
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct Args {
    /// The GGUF model whose tokenizer to use.
    model: PathBuf,
    /// The text to tokenise.
    #[arg(long)]
    text: Option<String>,
    /// A UTF-8 file whose whole content is the text.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Print `{"tokens":[…]}`.
    #[arg(long)]
    json: bool,
    /// Do not add BOS/EOS even where the file asks for them.
    #[arg(long)]
    no_add_special: bool,
    /// Treat control-token text (e.g. `<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let text = match (&a.text, &a.file) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) => std::fs::read_to_string(p)
            .with_context(|| format!("reading {} (UTF-8 text)", p.display()))?,
        (None, None) => anyhow::bail!("give --text or --file"),
    };
    let f = GgufFile::open(&a.model)?;
    let tok = Tokenizer::from_gguf(f.gguf())
        .with_context(|| format!("{}: tokenizer", a.model.display()))?;
    let ids = tok.encode(&text, !a.no_add_special, !a.no_parse_special)?;
    let out = if a.json {
        let mut s = serde_json::to_string(&serde_json::json!({ "tokens": ids }))?;
        s.push('\n');
        s
    } else {
        let mut s = String::new();
        for id in &ids {
            let piece = tok.token_to_piece(*id);
            let _ = writeln!(s, "{id:>7} {:?}", String::from_utf8_lossy(&piece));
        }
        let _ = writeln!(s, "{} tokens", ids.len());
        s
    };
    super::print_all(&out)
}
