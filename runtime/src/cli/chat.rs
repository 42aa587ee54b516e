//! `kiln chat`: an interactive console chat (the board's serial console is a real use). Each turn
//! renders the file's `tokenizer.chat_template` with minijinja over the whole conversation and
//! feeds only the tokens the KV cache does not hold yet, so the cache is kept across turns; a
//! reply stops at an end-of-generation token.

use super::run::{ModelArgs, SampleArgs, TextOut};
use anyhow::{bail, Context, Result};
use kiln_runtime::model::Want;
use std::io::{BufRead, Write};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub m: ModelArgs,
    /// A system message for the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', default_value_t = 256)]
    pub n: usize,
    #[command(flatten)]
    pub sample: SampleArgs,
}

pub fn run(a: Args) -> Result<()> {
    let f = a.m.open()?;
    let model = a.m.load(&f)?;
    let text = TextOut::new(&f)?;
    let tok = text.tokenizer();
    let path = a.m.path()?.display().to_string();
    let chat = kiln_runtime::tokenizer::chat::Template::of(tok).with_context(|| path.clone())?;
    let mut s = model.session(a.m.n_ctx(&model), a.m.kv)?;
    let mut sampler = a.sample.sampler();
    let mut messages: Vec<(String, String)> = Vec::new();
    if let Some(sys) = &a.system {
        messages.push(("system".into(), sys.clone()));
    }
    // Every token the cache holds, in order: the next turn's prompt must start with them.
    let mut held: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    eprintln!("kiln chat: type a message, an empty line or EOF ends the chat");
    loop {
        write!(out, "> ")
            .and_then(|_| out.flush())
            .context("stdout")?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).context("stdin")? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            break;
        }
        messages.push(("user".into(), line.to_string()));
        let prompt = chat.render(&messages)?;
        let ids = tok.encode(&prompt, true, true)?;
        // Reuse the cache as far as the new prompt agrees with what it holds.
        let common = held.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        if common < held.len() {
            // The template re-rendered earlier turns differently: start the cache over.
            s.kv.clear();
            held.clear();
        }
        let new = &ids[held.len()..];
        if new.is_empty() {
            bail!("the rendered conversation added no tokens");
        }
        let mut logits = model.forward(&mut s, new, Want::Last)?;
        held.extend_from_slice(new);
        let mut stream = text.stream();
        let mut reply = String::new();
        for _ in 0..a.n {
            let t = sampler.sample(&logits);
            if text.is_eog(t) {
                // The template writes the end-of-turn itself; the cache keeps the EOG token.
                model.forward(&mut s, &[t], Want::None)?;
                held.push(t);
                break;
            }
            let p = stream.push(t);
            reply.push_str(&p);
            write!(out, "{p}")
                .and_then(|_| out.flush())
                .context("stdout")?;
            logits = model.forward(&mut s, &[t], Want::Last)?;
            held.push(t);
        }
        let rest = stream.finish();
        reply.push_str(&rest);
        writeln!(out, "{rest}").context("stdout")?;
        messages.push(("assistant".into(), reply));
    }
    Ok(())
}
