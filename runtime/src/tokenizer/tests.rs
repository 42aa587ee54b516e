//! Unit tests on small vocabularies built here; equality with llama.cpp itself is tested in
//! `runtime/tests/llama_cpp_tokenize.rs`.

use super::*;
use crate::gguf::writer::GgufWriter;
use crate::gguf::ValueType;

fn strs(v: &[&str]) -> Value {
    Value::Array(
        ValueType::String,
        v.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

fn ints(v: &[i32]) -> Value {
    Value::Array(ValueType::I32, v.iter().map(|&i| Value::I32(i)).collect())
}

fn floats(v: &[f32]) -> Value {
    Value::Array(ValueType::F32, v.iter().map(|&f| Value::F32(f)).collect())
}

fn build(kvs: Vec<(&str, Value)>) -> Result<Tokenizer> {
    let mut w = GgufWriter::new();
    for (k, v) in kvs {
        w.add(k, v)?;
    }
    let bytes = w.to_bytes();
    let g = Gguf::parse(&bytes)?;
    Tokenizer::from_gguf(&g)
}

/// A byte-level BPE vocabulary: the 256 byte characters, a few merges, two control tokens.
fn bpe_vocab(pre: &str, extra: Vec<(&str, Value)>) -> Result<Tokenizer> {
    let table = pretok::byte_to_char_table();
    let mut toks: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    toks.extend(table.iter().map(|c| c.to_string()));
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "Ġwo rl", "Ġworl d", "b c", "a b",
    ];
    for m in merges {
        toks.push(m.replace(' ', ""));
    }
    let toks: Vec<&str> = toks.iter().map(String::as_str).collect();
    let mut types = vec![1; toks.len()];
    types[0] = 3;
    types[1] = 3;
    types[2] = 3;
    let mut kvs = vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", strs(&toks)),
        ("tokenizer.ggml.token_type", ints(&types)),
        ("tokenizer.ggml.merges", strs(&merges)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    kvs.extend(extra);
    build(kvs)
}

fn texts(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| t.token_text(i).unwrap_or("?").to_string())
        .collect()
}

#[test]
fn bpe_merges_by_rank() {
    let t = bpe_vocab("smollm", vec![]).unwrap();
    let ids = t.encode("hello world", false, false).unwrap();
    assert_eq!(texts(&t, &ids), ["hello", "Ġworld"]);
    // "b c" has a lower rank than "a b": abc → a + bc, not ab + c.
    let ids = t.encode("abc", false, false).unwrap();
    assert_eq!(texts(&t, &ids), ["a", "bc"]);
}

#[test]
fn specials_are_matched_whole_only_when_asked() {
    let t = bpe_vocab("smollm", vec![]).unwrap();
    let ids = t
        .encode("<|im_start|>hello<|im_end|>", false, true)
        .unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(*ids.last().unwrap(), 2);
    assert_eq!(texts(&t, &ids[1..ids.len() - 1]), ["hello"]);
    let ids = t.encode("<|im_start|>", false, false).unwrap();
    assert!(ids.len() > 1 && !ids.contains(&1));
    assert_eq!(t.decode(&ids), b"<|im_start|>");
}

#[test]
fn add_bos_follows_the_file() {
    let t = bpe_vocab("smollm", vec![]).unwrap();
    assert_eq!(t.encode("", true, true).unwrap(), Vec::<u32>::new());
    let t = bpe_vocab(
        "smollm",
        vec![("tokenizer.ggml.add_bos_token", Value::Bool(true))],
    )
    .unwrap();
    assert_eq!(t.encode("", true, true).unwrap(), [1]);
    assert_eq!(t.encode("", false, true).unwrap(), Vec::<u32>::new());
    // llama-bpe adds BOS unless the file says otherwise.
    let t = bpe_vocab("llama-bpe", vec![]).unwrap();
    assert_eq!(t.encode("hello", true, false).unwrap()[0], 1);
}

#[test]
fn eog_holds_eos_and_end_of_turn_tokens() {
    let t = bpe_vocab("smollm", vec![]).unwrap();
    assert!(t.is_eog(2), "eos");
    assert!(t.is_eog(0), "<|endoftext|>");
    assert!(!t.is_eog(1), "<|im_start|>");
}

#[test]
fn unknown_pre_and_model_are_refused_by_name() {
    let e = bpe_vocab("falcon", vec![]).unwrap_err().to_string();
    assert!(
        e.contains("\"falcon\"") && e.contains("tokenizer.ggml.pre"),
        "{e}"
    );
    let e = build(vec![("tokenizer.ggml.model", Value::String("bert".into()))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"bert\""), "{e}");
}

#[test]
fn byte_level_decode_round_trips() {
    let t = bpe_vocab("qwen2", vec![]).unwrap();
    for s in [
        "hello world",
        "  tabs\tand\nnewlines \r\n",
        "é😀中文 x\u{301}",
        "",
    ] {
        let ids = t.encode(s, false, false).unwrap();
        assert_eq!(t.decode(&ids), s.as_bytes(), "{s:?}");
    }
}

/// A SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, then scored pieces.
fn spm_vocab(extra: Vec<(&str, Value)>) -> Result<Tokenizer> {
    let mut toks: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..256 {
        toks.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (p, s) in [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("he", -3.0),
        ("ll", -1.5),
        ("hell", -4.0),
        ("▁hell", -5.0),
        ("lo", -0.5),
    ] {
        toks.push(p.into());
        types.push(1);
        scores.push(s);
    }
    let toks: Vec<&str> = toks.iter().map(String::as_str).collect();
    let mut kvs = vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strs(&toks)),
        ("tokenizer.ggml.token_type", ints(&types)),
        ("tokenizer.ggml.scores", floats(&scores)),
    ];
    kvs.extend(extra);
    build(kvs)
}

#[test]
fn spm_merges_by_score_with_byte_fallback_and_space_prefix() {
    let t = spm_vocab(vec![]).unwrap();
    let ids = t.encode("hello", true, false).unwrap();
    // BOS (add_bos defaults to true for llama), then "▁" + "hello": "lo" (-0.5) merges first,
    // then "ll" is gone; "he" (-3), and "▁he"? not a token: ▁ he l lo.
    assert_eq!(ids[0], 1);
    assert_eq!(texts(&t, &ids[1..]), ["▁", "he", "l", "lo"]);
    // "x" is not a piece: its byte token.
    let ids = t.encode("x", false, false).unwrap();
    assert_eq!(texts(&t, &ids), ["▁", "<0x78>"]);
    assert_eq!(
        t.decode(&ids),
        b"x",
        "the prefix space is dropped on decode"
    );
    let ids = t.encode("é", false, false).unwrap();
    assert_eq!(texts(&t, &ids), ["▁", "<0xC3>", "<0xA9>"]);
    let t = spm_vocab(vec![(
        "tokenizer.ggml.add_space_prefix",
        Value::Bool(false),
    )])
    .unwrap();
    let ids = t.encode("x", false, false).unwrap();
    assert_eq!(texts(&t, &ids), ["<0x78>"]);
}

#[test]
fn spm_eog_is_eos() {
    let t = spm_vocab(vec![]).unwrap();
    assert_eq!((t.bos(), t.eos()), (Some(1), Some(2)));
    assert!(t.is_eog(2) && !t.is_eog(1));
}

#[test]
fn clean_spaces_matches_llama_cpp_passes() {
    let mut v = b"a , b . c ' d it 's we 're x 't".to_vec();
    clean_spaces(&mut v);
    assert_eq!(v, b"a, b. c'd it's we're x 't");
}

/// A special-token id outside the vocabulary does not take effect, as in llama.cpp: the id stays
/// at the model's default (SentencePiece's EOS 2) or is disabled (no default), it never enters
/// the EOG set, and the load says so, naming the key and the value.
#[test]
fn out_of_range_special_ids_are_disabled_with_a_warning_naming_the_key() {
    let t = spm_vocab(vec![("tokenizer.ggml.eos_token_id", Value::U32(u32::MAX))]).unwrap();
    assert_eq!(t.eos(), Some(2), "the default EOS stays");
    assert!(!t.is_eog(u32::MAX));
    assert!(t.eog_ids().all(|i| (i as usize) < t.n_vocab()));
    assert_eq!(t.warnings().len(), 1, "{:?}", t.warnings());
    let w = &t.warnings()[0];
    assert!(
        w.contains("tokenizer.ggml.eos_token_id = 4294967295")
            && w.contains("default id 2 is used instead"),
        "{w}"
    );

    let t = bpe_vocab(
        "smollm",
        vec![
            ("tokenizer.ggml.eot_token_id", Value::U32(5000)),
            ("tokenizer.ggml.padding_token_id", Value::U32(70000)),
        ],
    )
    .unwrap();
    assert!(
        !t.is_eog(5000),
        "an out-of-range EOT must not end generation"
    );
    let eog: Vec<u32> = t.eog_ids().collect();
    assert_eq!(eog, [0, 2], "<|endoftext|> by name and the file's EOS only");
    let w = t.warnings().join("\n");
    assert!(
        w.contains("tokenizer.ggml.eot_token_id = 5000") && w.contains("the token is disabled"),
        "{w}"
    );
    assert!(w.contains("tokenizer.ggml.padding_token_id = 70000"), "{w}");
    // In range: no warning.
    assert!(bpe_vocab("smollm", vec![]).unwrap().warnings().is_empty());
}
