//! Tokenizer from GGUF metadata, tokenising as llama.cpp does (`src/llama-vocab.cpp`):
//! byte-level BPE (`tokenizer.ggml.model = gpt2`, merged by rank) and SentencePiece (`llama`,
//! merged by score, byte fallback), special-token partitioning, BOS/EOS as the file says, and
//! decoding back to bytes. A model or pre-tokenizer this code does not implement is refused by
//! name: a tokenizer that is almost right gives plausible text and wrong logits.

pub mod chat;
mod pretok;
mod stream;

pub use stream::StreamDecoder;

use crate::gguf::{Gguf, Value};
use anyhow::{bail, Context, Result};
use pretok::Split;
use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

// llama.cpp's token attributes (`llama_token_attr`).
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;
const ATTR_LSTRIP: u16 = 1 << 7;
const ATTR_RSTRIP: u16 = 1 << 8;

/// The pre-tokenizers implemented, by their `tokenizer.ggml.pre` names.
pub const SUPPORTED_PRE: &[&str] = &[
    "smollm",
    "starcoder",
    "qwen2",
    "deepseek-r1-qwen",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "gpt-2",
    "default",
];

#[derive(Debug)]
enum Model {
    /// Byte-level BPE: merge ranks keyed by "left right" (as the file writes them).
    Bpe {
        ranks: HashMap<(String, String), u32>,
        splits: Vec<Split>,
        ignore_merges: bool,
        byte_chars: Box<[char; 256]>,
        char_bytes: HashMap<char, u8>,
    },
    /// SentencePiece merged by score.
    Spm,
}

#[derive(Debug)]
pub struct Tokenizer {
    model: Model,
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u16>,
    token_to_id: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first (llama.cpp's
    /// `cache_special_tokens`).
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: BTreeSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    chat_template: Option<String>,
    /// What the file says that did not take effect (special ids outside the vocabulary), one
    /// line each, also printed on stderr at load.
    warnings: Vec<String>,
}

fn str_array<'a>(g: &'a Gguf, key: &str) -> Result<Option<&'a [Value]>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => match v.as_array() {
            Some((_, items)) => Ok(Some(items)),
            None => bail!("{key}: expected an array, found {}", v.value_type()),
        },
    }
}

fn get_bool(g: &Gguf, key: &str) -> Result<Option<bool>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .with_context(|| format!("{key}: expected a bool, found {}", v.value_type())),
    }
}

fn get_str<'a>(g: &'a Gguf, key: &str) -> Result<Option<&'a str>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .with_context(|| format!("{key}: expected a string, found {}", v.value_type())),
    }
}

impl Tokenizer {
    /// From the GGUF metadata (tokenizer.ggml.*); unknown model or pre-tokenizer → error naming it.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let model_name = get_str(g, "tokenizer.ggml.model")?
            .context("tokenizer.ggml.model: missing (no tokenizer in this file)")?;
        let pre = get_str(g, "tokenizer.ggml.pre")?;

        // Defaults per model, as llama.cpp's llama_vocab::impl::load.
        let (mut bos, mut eos): (Option<u32>, Option<u32>);
        let mut add_bos;
        let mut add_eos = false;
        let mut add_space_prefix;
        let clean_spaces;
        let model = match model_name {
            "gpt2" => {
                bos = Some(11);
                eos = Some(11);
                add_space_prefix = false;
                let mut clean = true;
                let mut ignore_merges = false;
                add_bos = false;
                let splits = match pre.unwrap_or("default") {
                    "default" => vec![
                        Split::PunctRuns,
                        Split::Gpt2,
                        Split::NumberRuns,
                        Split::ThreeAsciiDigits,
                    ],
                    "gpt-2" => vec![Split::Gpt2],
                    "smollm" => {
                        clean = false;
                        vec![Split::EachNumber, Split::Gpt2]
                    }
                    "starcoder" => vec![Split::EachNumber, Split::Gpt2],
                    "qwen2" | "deepseek-r1-qwen" => {
                        clean = false;
                        vec![Split::Llama3 { max_digits: 1 }]
                    }
                    "llama3" | "llama-v3" | "llama-bpe" => {
                        ignore_merges = true;
                        add_bos = true;
                        vec![Split::Llama3 { max_digits: 3 }]
                    }
                    other => bail!(
                        "tokenizer.ggml.pre = {other:?}: pre-tokenizer not implemented by kiln \
                         (implemented: {})",
                        SUPPORTED_PRE.join(", ")
                    ),
                };
                clean_spaces = clean;
                let merges = str_array(g, "tokenizer.ggml.merges")?.context(
                    "tokenizer.ggml.merges: missing (a gpt2 tokenizer needs its merges)",
                )?;
                let mut ranks = HashMap::with_capacity(merges.len());
                for (i, m) in merges.iter().enumerate() {
                    let s = m
                        .as_str()
                        .with_context(|| format!("tokenizer.ggml.merges[{i}]: not a string"))?;
                    // llama.cpp: split at the first space after the first byte; no space → ("", "").
                    let space = s
                        .as_bytes()
                        .get(1..)
                        .and_then(|r| r.iter().position(|&b| b == b' '));
                    let (first, second) = match space {
                        Some(p) => (s[..p + 1].to_string(), s[p + 2..].to_string()),
                        None => (String::new(), String::new()),
                    };
                    ranks.entry((first, second)).or_insert(i as u32);
                }
                let byte_chars = Box::new(pretok::byte_to_char_table());
                let char_bytes = byte_chars
                    .iter()
                    .enumerate()
                    .map(|(b, &c)| (c, b as u8))
                    .collect();
                Model::Bpe {
                    ranks,
                    splits,
                    ignore_merges,
                    byte_chars,
                    char_bytes,
                }
            }
            "llama" => {
                bos = Some(1);
                eos = Some(2);
                add_space_prefix = true;
                clean_spaces = false;
                add_bos = true;
                Model::Spm
            }
            other => bail!(
                "tokenizer.ggml.model = {other:?}: tokenizer model not implemented by kiln \
                 (implemented: gpt2, llama)"
            ),
        };
        if let Some(v) = get_bool(g, "tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }

        let list =
            str_array(g, "tokenizer.ggml.tokens")?.context("tokenizer.ggml.tokens: missing")?;
        let n = list.len();
        let score_vals = str_array(g, "tokenizer.ggml.scores")?;
        if let Some(s) = score_vals {
            if s.len() < n {
                bail!("tokenizer.ggml.scores: {} values for {n} tokens", s.len());
            }
        }
        let type_vals = str_array(g, "tokenizer.ggml.token_type")?;
        if let Some(t) = type_vals {
            if t.len() < n {
                bail!(
                    "tokenizer.ggml.token_type: {} values for {n} tokens",
                    t.len()
                );
            }
        }
        let mut tokens = Vec::with_capacity(n);
        let mut scores = Vec::with_capacity(n);
        let mut attrs = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, v) in list.iter().enumerate() {
            let mut word = v
                .as_str()
                .with_context(|| format!("tokenizer.ggml.tokens[{i}]: not a string"))?
                .to_string();
            if word.is_empty() {
                word = format!("[EMPTY_{i}]");
            }
            if let Some(prev) = token_to_id.insert(word.clone(), i as u32) {
                bail!("tokenizer.ggml.tokens: {word:?} appears twice (ids {prev} and {i})");
            }
            tokens.push(word);
            let score = match score_vals {
                Some(s) => match &s[i] {
                    Value::F32(f) => *f,
                    other => other
                        .as_int()
                        .map(|x| x as f32)
                        .with_context(|| format!("tokenizer.ggml.scores[{i}]: not a number"))?,
                },
                None => 0.0,
            };
            scores.push(score);
            let attr = match type_vals {
                None => ATTR_NORMAL,
                Some(t) => match t[i].as_int() {
                    Some(1) => ATTR_NORMAL,
                    Some(2) => ATTR_UNKNOWN,
                    Some(3) => ATTR_CONTROL,
                    Some(4) => ATTR_USER_DEFINED,
                    Some(5) => ATTR_UNUSED,
                    Some(6) => ATTR_BYTE,
                    Some(_) => 0,
                    None => bail!("tokenizer.ggml.token_type[{i}]: not an integer"),
                },
            };
            attrs.push(attr);
        }
        let n_u32 = u32::try_from(n).context("tokenizer.ggml.tokens: too many tokens")?;

        // Special ids as llama.cpp's `llama_vocab::impl::load` takes them: a default out of
        // range is disabled, and a key out of range is not used: the id stays at its default
        // (itself disabled when out of range), so the out-of-range id is never BOS, EOS or in
        // the EOG set. llama.cpp logs both; kiln prints them on stderr and keeps them
        // (`warnings`), so that a file whose special tokens did not take effect says so.
        let mut warnings: Vec<String> = Vec::new();
        let mut id_key = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            let default = match default {
                Some(d) if d >= n_u32 => {
                    warnings.push(format!(
                        "{key}: the default id {d} is outside the vocabulary of {n} tokens: \
                         disabled (as llama.cpp does)"
                    ));
                    None
                }
                d => d,
            };
            match g.get(key) {
                None => Ok(default),
                Some(v) => {
                    let id = v
                        .to_int::<u32>()
                        .with_context(|| format!("{key}: not an integer"))?
                        .map_err(|x| anyhow::anyhow!("{key}: {x} is not a token id"))?;
                    if id < n_u32 {
                        return Ok(Some(id));
                    }
                    let fallback = match default {
                        Some(d) => format!("the default id {d} is used instead"),
                        None => "the token is disabled".to_string(),
                    };
                    warnings.push(format!(
                        "{key} = {id} is outside the vocabulary of {n} tokens: ignored, \
                         {fallback} (as llama.cpp does)"
                    ));
                    Ok(default)
                }
            }
        };
        bos = id_key("tokenizer.ggml.bos_token_id", bos)?;
        eos = id_key("tokenizer.ggml.eos_token_id", eos)?;
        let mut eot = id_key("tokenizer.ggml.eot_token_id", None)?;
        let mut eom = id_key("tokenizer.ggml.eom_token_id", None)?;
        // Read only to be checked (kiln does not use them), in llama.cpp's order.
        let spm_unk = matches!(model, Model::Spm).then_some(0);
        id_key("tokenizer.ggml.unknown_token_id", spm_unk)?;
        id_key("tokenizer.ggml.seperator_token_id", None)?;
        id_key("tokenizer.ggml.padding_token_id", None)?;
        id_key("tokenizer.ggml.mask_token_id", None)?;
        let mut fim_key = |new: &str, old: Option<&str>| -> Result<Option<u32>> {
            let mut v = id_key(new, None)?;
            if let Some(old) = old {
                v = id_key(old, v)?;
            }
            Ok(v)
        };
        let mut fim_pre = fim_key(
            "tokenizer.ggml.fim_pre_token_id",
            Some("tokenizer.ggml.prefix_token_id"),
        )?;
        let mut fim_suf = fim_key(
            "tokenizer.ggml.fim_suf_token_id",
            Some("tokenizer.ggml.suffix_token_id"),
        )?;
        let mut fim_mid = fim_key(
            "tokenizer.ggml.fim_mid_token_id",
            Some("tokenizer.ggml.middle_token_id"),
        )?;
        let mut fim_pad = fim_key("tokenizer.ggml.fim_pad_token_id", None)?;
        let mut fim_rep = fim_key("tokenizer.ggml.fim_rep_token_id", None)?;
        let mut fim_sep = fim_key("tokenizer.ggml.fim_sep_token_id", None)?;
        for w in &warnings {
            eprintln!("kiln: warning: {w}");
        }

        if let Some(v) = get_bool(g, "tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = get_bool(g, "tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }
        if add_bos && bos.is_none() {
            bail!(
                "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
            );
        }
        if add_eos && eos.is_none() {
            bail!(
                "tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set"
            );
        }

        // Tokens recognised by their text, as llama.cpp does (marked control when they are not).
        // Visit in id order; llama.cpp visits a hash map, which matters only when a file has two
        // candidates for the same role.
        let mark = |slot: &mut Option<u32>, names: &[&str], attrs: &mut Vec<u16>| {
            if slot.is_some() {
                return;
            }
            if let Some(id) = (0..n).find(|&i| names.contains(&tokens[i].as_str())) {
                *slot = Some(id as u32);
                attrs[id] |= ATTR_CONTROL;
            }
        };
        mark(&mut eot, EOT_NAMES, &mut attrs);
        mark(&mut eom, &["<|eom_id|>"], &mut attrs);
        mark(
            &mut fim_pre,
            &[
                "<|fim_prefix|>",
                "<fim-prefix>",
                "<fim_prefix>",
                "<｜fim▁begin｜>",
                "<PRE>",
                "▁<PRE>",
                "<|code_prefix|>",
                "<|prefix|>",
            ],
            &mut attrs,
        );
        mark(
            &mut fim_suf,
            &[
                "<|fim_suffix|>",
                "<fim-suffix>",
                "<fim_suffix>",
                "<｜fim▁hole｜>",
                "<SUF>",
                "▁<SUF>",
                "<|code_suffix|>",
                "<|suffix|>",
            ],
            &mut attrs,
        );
        mark(
            &mut fim_mid,
            &[
                "<|fim_middle|>",
                "<fim-middle>",
                "<fim_middle>",
                "<｜fim▁end｜>",
                "<MID>",
                "▁<MID>",
                "<|code_middle|>",
                "<|middle|>",
            ],
            &mut attrs,
        );
        mark(
            &mut fim_pad,
            &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
            &mut attrs,
        );
        mark(
            &mut fim_rep,
            &[
                "<|fim_repo|>",
                "<|repo_name|>",
                "<fim-repo>",
                "<REPO>",
                "<reponame>",
            ],
            &mut attrs,
        );
        mark(&mut fim_sep, &["<|file_sep|>"], &mut attrs);
        let _ = (fim_pre, fim_suf, fim_mid);

        let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for (i, t) in tokens.iter().enumerate() {
            if EOG_NAMES.contains(&t.as_str()) {
                eog.insert(i as u32);
                attrs[i] |= ATTR_CONTROL;
            }
            if matches!(
                t.as_str(),
                "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
            ) {
                attrs[i] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        let find_eog = |eog: &BTreeSet<u32>, name: &str| {
            eog.iter().copied().find(|&i| tokens[i as usize] == name)
        };
        let has = |eog: &BTreeSet<u32>, name: &str| find_eog(eog, name).is_some();
        if let Some(end) = find_eog(&eog, "<|end|>") {
            let call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
            if call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
                eog.remove(&end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
        if let Some(s) = find_eog(&eog, "</s>") {
            if has(&eog, "<|tool_response>") {
                eog.remove(&s);
                attrs[s as usize] = ATTR_NORMAL;
            }
        }

        let mut specials: Vec<u32> = (0..n_u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        // llama.cpp's std::sort by length is not stable; ties keep id order here.
        specials.sort_by(|&a, &b| tokens[b as usize].len().cmp(&tokens[a as usize].len()));

        // Per-model strip attributes (llama.cpp sets them by name).
        let general_name = get_str(g, "general.name")?.unwrap_or("").to_lowercase();
        let arch = get_str(g, "general.architecture")?.unwrap_or("");
        let set_attr = |attrs: &mut Vec<u16>, name: &str, bit: u16, on: bool| -> Result<()> {
            let id = *token_to_id.get(name).with_context(|| {
                format!("token {name:?} missing (llama.cpp requires it for this model)")
            })?;
            let a = &mut attrs[id as usize];
            *a = if on { *a | bit } else { *a & !bit };
            Ok(())
        };
        if ["nomic-bert-moe", "jina-bert-v3"]
            .iter()
            .any(|s| arch.contains(s))
        {
            if token_to_id.contains_key("<mask>") {
                set_attr(&mut attrs, "<mask>", ATTR_LSTRIP, true)?;
            }
        } else if general_name.contains("phi-3") || general_name.contains("phi3") {
            for &id in &specials {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            set_attr(&mut attrs, "</s>", ATTR_RSTRIP, true)?;
            for name in ["<unk>", "<s>", "<|endoftext|>"] {
                set_attr(&mut attrs, name, ATTR_RSTRIP, false)?;
            }
        } else if general_name.contains("modern-bert") && token_to_id.contains_key("[MASK]") {
            set_attr(&mut attrs, "[MASK]", ATTR_LSTRIP, true)?;
        }

        let chat_template = get_str(g, "tokenizer.chat_template")?.map(str::to_string);
        Ok(Tokenizer {
            model,
            tokens,
            scores,
            attrs,
            token_to_id,
            specials,
            bos,
            eos,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            chat_template,
            warnings,
        })
    }

    /// The load's warnings (special-token ids the file sets outside the vocabulary).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// As llama.cpp's llama_tokenize(text, add_special, parse_special): add_special adds BOS/EOS
    /// as the file's add_bos_token/add_eos_token say; parse_special matches control/user-defined
    /// tokens whole (user-defined ones are matched whole even without it, as in llama.cpp).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.model {
            Model::Spm => {
                let mut prev_special = true;
                for f in &frags {
                    match *f {
                        Frag::Text(s, e) => {
                            let mut t = String::with_capacity(e - s + 4);
                            if self.add_space_prefix && prev_special {
                                t.push(' ');
                            }
                            t.push_str(&text[s..e]);
                            let t = t.replace(' ', "\u{2581}");
                            self.spm(&t, &mut out)?;
                            prev_special = false;
                        }
                        Frag::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe { .. } => {
                for f in &frags {
                    match *f {
                        Frag::Text(s, e) => self.bpe(&text[s..e], &mut out),
                        Frag::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`: cut the text at every occurrence of each special
    /// token, longest first.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Frag::Text(0, text.len()));
        let isspace = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r');
        let bytes = text.as_bytes();
        for &id in &self.specials {
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            if !frags
                .iter()
                .any(|f| matches!(*f, Frag::Text(s, e) if text[s..e].contains(pat)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Frag::Text(s, e) = f else {
                    next.push(f);
                    continue;
                };
                let mut pos = s;
                while let Some(m) = text[pos..e].find(pat).map(|m| m + pos) {
                    let mut left_end = m;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > pos && isspace(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > pos {
                        next.push(Frag::Text(pos, left_end));
                    }
                    next.push(Frag::Token(id));
                    pos = m + pat.len();
                    if attr & ATTR_RSTRIP != 0 {
                        while pos < e && isspace(bytes[pos]) {
                            pos += 1;
                        }
                    }
                    if pos >= e {
                        break;
                    }
                }
                if pos < e {
                    next.push(Frag::Text(pos, e));
                }
            }
            frags = next;
        }
        frags
    }

    fn bpe(&self, text: &str, out: &mut Vec<u32>) {
        let Model::Bpe {
            ranks,
            splits,
            ignore_merges,
            byte_chars,
            ..
        } = &self.model
        else {
            return;
        };
        for word in pretok::split(text, splits) {
            // Byte-level encoding: every byte of the word becomes one character.
            let w: String = word.bytes().map(|b| byte_chars[b as usize]).collect();
            if *ignore_merges && self.token_to_id.contains_key(&w) {
                out.push(self.token_to_id[&w]);
                continue;
            }
            for piece in bpe_merge(&w, ranks) {
                match self.token_to_id.get(piece) {
                    Some(&id) => out.push(id),
                    None => {
                        // llama.cpp: each byte of the piece looked up as a one-byte token.
                        for b in piece.bytes().filter(u8::is_ascii) {
                            let s = [b];
                            let s = std::str::from_utf8(&s).unwrap_or_default();
                            if let Some(&id) = self.token_to_id.get(s) {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
    }

    fn spm(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        // Symbols: one per UTF-8 character, linked list, merged by the highest-scoring pair.
        let mut syms: Vec<Sym> = Vec::new();
        for (i, (off, ch)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start: off,
                len: ch.len_utf8(),
                prev: i as isize - 1,
                next: if off + ch.len_utf8() == text.len() {
                    -1
                } else {
                    i as isize + 1
                },
            });
        }
        let mut heap = BinaryHeap::new();
        let try_add = |syms: &[Sym], heap: &mut BinaryHeap<SpmBigram>, l: isize, r: isize| {
            if l < 0 || r < 0 {
                return;
            }
            let (ls, rs) = (&syms[l as usize], &syms[r as usize]);
            let s = &text[ls.start..ls.start + ls.len + rs.len];
            if let Some(&id) = self.token_to_id.get(s) {
                heap.push(SpmBigram {
                    score: self.scores[id as usize],
                    left: l as usize,
                    right: r as usize,
                    size: s.len(),
                });
            }
        };
        for i in 1..syms.len() {
            try_add(&syms, &mut heap, i as isize - 1, i as isize);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            syms[l].next = syms[r].next;
            if syms[r].next >= 0 {
                let nx = syms[r].next as usize;
                syms[nx].prev = l as isize;
            }
            let (p, nx) = (syms[l].prev, syms[l].next);
            try_add(&syms, &mut heap, p, l as isize);
            try_add(&syms, &mut heap, l as isize, nx);
        }
        let mut i = if syms.is_empty() { -1 } else { 0 };
        while i >= 0 {
            let s = &syms[i as usize];
            let piece = &text[s.start..s.start + s.len];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    // Byte fallback (merged symbols are always tokens, so only single
                    // characters get here).
                    for b in piece.bytes() {
                        out.push(self.spm_byte_token(b)?);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    /// llama.cpp's `byte_to_token` for SentencePiece: `<0xXX>`, else the byte as a one-byte token.
    fn spm_byte_token(&self, b: u8) -> Result<u32> {
        if let Some(&id) = self.token_to_id.get(&format!("<0x{b:02X}>")) {
            return Ok(id);
        }
        let one = [b];
        std::str::from_utf8(&one)
            .ok()
            .and_then(|s| self.token_to_id.get(s).copied())
            .with_context(|| {
                format!(
                    "byte 0x{b:02X} has no token (<0x{b:02X}>) in this SentencePiece vocabulary"
                )
            })
    }

    /// The bytes this token decodes to (byte-level BPE mapped back to bytes; SentencePiece ▁ →
    /// space, <0xNN> → that byte; control tokens → their text). Out of range → empty.
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        let attr = self.attrs[id as usize];
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & ATTR_NORMAL != 0 {
            return match &self.model {
                Model::Spm => text.replace('\u{2581}', " ").into_bytes(),
                Model::Bpe { char_bytes, .. } => {
                    let mut out = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        match char_bytes.get(&c) {
                            Some(&b) => out.push(b),
                            None => {
                                // llama.cpp's llama_decode_text marks the unmappable character.
                                out.extend_from_slice(b"[UNK_BYTE_0x");
                                let mut buf = [0u8; 4];
                                for b in c.encode_utf8(&mut buf).bytes() {
                                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                                }
                                out.extend_from_slice(text.as_bytes());
                                out.push(b']');
                            }
                        }
                    }
                    out
                }
            };
        }
        if attr & ATTR_BYTE != 0 {
            // "<0xXX>": the two hex digits at 3..5 (strtol: a bad digit ends the number).
            let hex = text.get(3..5).unwrap_or("");
            let mut v: u32 = 0;
            for c in hex.chars() {
                match c.to_digit(16) {
                    Some(d) => v = v * 16 + d,
                    None => break,
                }
            }
            return vec![v as u8];
        }
        Vec::new()
    }

    /// llama.cpp's llama_detokenize(ids, remove_special = false, unparse_special = true): the
    /// pieces concatenated, the first one's leading space dropped when the file adds a space
    /// prefix, and the tokenizer's clean-up of spaces where the pre-tokenizer asks for it.
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut text = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_to_piece(id);
            if i == 0 && self.add_space_prefix && piece.first() == Some(&b' ') {
                text.extend_from_slice(&piece[1..]);
            } else {
                text.extend_from_slice(&piece);
            }
        }
        if self.clean_spaces {
            clean_spaces(&mut text);
        }
        text
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// Whether `encode(.., add_special = true, ..)` adds BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` adds EOS (`tokenizer.ggml.add_eos_token`).
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End of generation: EOS, EOT and the tokens llama.cpp treats as end-of-generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The token's text as the file stores it (byte-level BPE characters, ▁ for spaces).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose stored text is `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
}

const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

#[derive(Clone, Copy, Debug)]
enum Frag {
    Text(usize, usize),
    Token(u32),
}

struct Sym {
    start: usize,
    len: usize,
    prev: isize,
    next: isize,
}

/// A SentencePiece candidate: the highest score first, then the leftmost.
struct SpmBigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for SpmBigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for SpmBigram {}
impl PartialOrd for SpmBigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for SpmBigram {
    fn cmp(&self, o: &Self) -> Ordering {
        // As llama.cpp's comparator (`l.score < r.score || (== && l.left > r.left)` is "less").
        if self.score < o.score {
            Ordering::Less
        } else if self.score > o.score {
            Ordering::Greater
        } else {
            o.left.cmp(&self.left)
        }
    }
}

/// A BPE candidate: the lowest rank first, then the leftmost.
#[derive(PartialEq, Eq)]
struct BpeBigram {
    rank: u32,
    left: usize,
    right: usize,
    size: usize,
}
impl PartialOrd for BpeBigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for BpeBigram {
    fn cmp(&self, o: &Self) -> Ordering {
        o.rank.cmp(&self.rank).then(o.left.cmp(&self.left))
    }
}

/// Merge one byte-encoded word by rank (llama.cpp's `llm_tokenizer_bpe_session`); returns the
/// final pieces in order.
fn bpe_merge<'w>(w: &'w str, ranks: &HashMap<(String, String), u32>) -> Vec<&'w str> {
    let mut syms: Vec<Sym> = Vec::new();
    for (i, (off, ch)) in w.char_indices().enumerate() {
        syms.push(Sym {
            start: off,
            len: ch.len_utf8(),
            prev: i as isize - 1,
            next: if off + ch.len_utf8() == w.len() {
                -1
            } else {
                i as isize + 1
            },
        });
    }
    let mut heap = BinaryHeap::new();
    let mut key = (String::new(), String::new());
    let mut try_add = |syms: &[Sym], heap: &mut BinaryHeap<BpeBigram>, l: isize, r: isize| {
        if l < 0 || r < 0 {
            return;
        }
        let (ls, rs) = (&syms[l as usize], &syms[r as usize]);
        key.0.clear();
        key.0.push_str(&w[ls.start..ls.start + ls.len]);
        key.1.clear();
        key.1.push_str(&w[rs.start..rs.start + rs.len]);
        if let Some(&rank) = ranks.get(&key) {
            heap.push(BpeBigram {
                rank,
                left: l as usize,
                right: r as usize,
                size: ls.len + rs.len,
            });
        }
    };
    for i in 1..syms.len() {
        try_add(&syms, &mut heap, i as isize - 1, i as isize);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left, b.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if syms[r].next >= 0 {
            let nx = syms[r].next as usize;
            syms[nx].prev = l as isize;
        }
        let (p, nx) = (syms[l].prev, syms[l].next);
        try_add(&syms, &mut heap, p, l as isize);
        try_add(&syms, &mut heap, l as isize, nx);
    }
    syms.iter()
        .filter(|s| s.len > 0)
        .map(|s| &w[s.start..s.start + s.len])
        .collect()
}

/// llama.cpp's `clean_spaces` passes of llama_detokenize, in place, byte for byte.
fn clean_spaces(text: &mut Vec<u8>) {
    // First pass: " ?", " !", " .", " ," lose the space.
    let n1 = text.len();
    let mut total = usize::from(n1 > 0);
    for i in 1..n1 {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
    // Second pass: a single apostrophe between spaces loses both spaces.
    let n2 = text.len();
    let mut total = usize::from(n2 > 0);
    let mut i = 1;
    while i < n2 {
        let x = text[i];
        if x == b'\'' && i + 1 < n2 && text[i - 1] == b' ' && text[i + 1] == b' ' {
            total -= 1;
            i += 1;
            text[i] = 0;
        }
        text[total] = x;
        total += 1;
        i += 1;
    }
    text.truncate(total);
    // Third pass: " 's", " 'm", " 're", " 've" lose the space.
    let n3 = text.len();
    let mut total = usize::from(n3 > 0);
    for i in 1..n3 {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n3 {
            let x1 = text[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if i + 2 < n3 {
                let x2 = text[i + 2];
                if x2 == b'e' && (x1 == b'r' || x1 == b'v') {
                    total -= 1;
                }
            }
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
}

#[cfg(test)]
mod tests;
