//! `chat_template`: an arbitrary template and conversation into the chat template renderer
//! ([`crate::tokenizer::chat::render`]), as a hostile GGUF and a hostile client could give them.
//! Invariants: it returns (Ok or Err) within its fuel, never panics, and never returns more than
//! [`OUTPUT_LIMIT`] bytes. The time bound is libFuzzer's `-timeout` in the fuzz run, and a
//! watchdog in the seeded run.

use crate::tokenizer::chat::{render, OUTPUT_LIMIT};

/// The input's layout: the template, then NUL-separated role and content pairs (a missing
/// content is empty). Invalid UTF-8 is replaced, as the renderer only ever gets `&str`.
pub fn split(data: &[u8]) -> (String, Vec<(String, String)>) {
    let mut parts = data
        .split(|&b| b == 0)
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let template = parts.next().unwrap_or_default();
    let rest: Vec<String> = parts.collect();
    let messages = rest
        .chunks(2)
        .map(|c| (c[0].clone(), c.get(1).cloned().unwrap_or_default()))
        .collect();
    (template, messages)
}

/// The target's body: panics if an invariant breaks.
pub fn run(data: &[u8]) {
    let (template, messages) = split(data);
    if let Ok(out) = render(&template, &messages, "<s>", "</s>") {
        assert!(
            out.len() <= OUTPUT_LIMIT,
            "a template rendered {} bytes, over the {OUTPUT_LIMIT}-byte cap",
            out.len()
        );
    }
}
