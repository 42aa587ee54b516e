//! A chat turned into a prompt: the file's `tokenizer.chat_template` (a Jinja template, as
//! Hugging Face and llama.cpp render it) over the conversation, with `bos_token` / `eos_token` as
//! the file's own pieces and `add_generation_prompt`. `kiln chat`, `kiln serve`'s
//! `/v1/chat/completions` and the boot stage's host reference all render through here.

use super::Tokenizer;
use anyhow::{Context, Result};

/// The conversation rendered by the model's template.
pub fn render(
    template: &str,
    messages: &[(String, String)],
    bos: &str,
    eos: &str,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.add_template("chat", template)
        .context("tokenizer.chat_template does not parse")?;
    // Hugging Face templates call raise_exception(msg) for conversations they refuse.
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    let msgs: Vec<_> = messages
        .iter()
        .map(|(role, content)| minijinja::context! { role => role, content => content })
        .collect();
    env.get_template("chat")
        .and_then(|t| {
            t.render(minijinja::context! {
                messages => msgs,
                add_generation_prompt => true,
                bos_token => bos,
                eos_token => eos,
            })
        })
        .context("rendering tokenizer.chat_template")
}

/// A tokenizer's chat template with its BOS/EOS pieces.
pub struct Template {
    template: String,
    bos: String,
    eos: String,
    /// Whether encoding the prompt adds BOS / EOS itself (the file's `add_bos_token` /
    /// `add_eos_token`).
    add_bos: bool,
    add_eos: bool,
}

impl Template {
    /// The file's template; an error when the file has none.
    pub fn of(tok: &Tokenizer) -> Result<Template> {
        let template = tok
            .chat_template()
            .context("no tokenizer.chat_template in the file")?
            .to_string();
        let piece = |id: Option<u32>| {
            id.map(|t| String::from_utf8_lossy(&tok.token_to_piece(t)).into_owned())
                .unwrap_or_default()
        };
        Ok(Template {
            template,
            bos: piece(tok.bos()),
            eos: piece(tok.eos()),
            add_bos: tok.add_bos(),
            add_eos: tok.add_eos(),
        })
    }

    /// `(role, content)` messages as the prompt text (to be encoded with special tokens parsed
    /// and added). As llama.cpp's `common_chat_template_direct_apply`: where encoding adds BOS
    /// itself, a leading BOS piece the template wrote (`{{ bos_token }}`, Gemma, Llama 3) is
    /// dropped, and likewise a trailing EOS piece, so the prompt does not start with two BOS.
    pub fn render(&self, messages: &[(String, String)]) -> Result<String> {
        let mut out = render(&self.template, messages, &self.bos, &self.eos)?;
        if self.add_bos && !self.bos.is_empty() && out.starts_with(&self.bos) {
            out.drain(..self.bos.len());
        }
        if self.add_eos && !self.eos.is_empty() && out.ends_with(&self.eos) {
            out.truncate(out.len() - self.eos.len());
        }
        Ok(out)
    }
}
