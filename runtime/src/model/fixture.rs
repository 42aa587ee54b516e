//! A small seeded llama model for the boot self-check's known answer (`model.nll`): 2 layers,
//! embedding 64, 4 query heads over 2 KV heads (GQA), a SentencePiece (`llama`) vocabulary of 512
//! pieces with byte fallback, and weights in F16, Q8_0 and Q4_0 (the types the backends claim),
//! quantised with ggml's reference quantisers. Its bytes depend on nothing but this code: `xtask`
//! writes it onto the models partition at image build time, and tests build the same bytes.
//!
//! It lives in the runtime crate (not in `xtask`) so that the runtime's own tests can load the
//! very file the image carries.

use crate::gguf::writer::GgufWriter;
use crate::gguf::{Value, ValueType};
use crate::quant::{quantize_to_vec, GgmlType};
use anyhow::{Context, Result};
use half::f16;
use std::collections::BTreeSet;

/// File name on the models partition (`/models/kiln-llama-fixture.gguf` on the board).
pub const FILE_NAME: &str = "kiln-llama-fixture.gguf";

const N_EMBD: usize = 64;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = N_EMBD / N_HEAD;
const N_FF: usize = 128;
const N_LAYER: usize = 2;
/// A multiple of 64, so the LM head's N suits every NPU element type.
const N_VOCAB: usize = 512;
const N_CTX: usize = 256;

/// Words whose SentencePiece pieces (`▁word` and every prefix of it) the vocabulary holds.
const WORDS: &[&str] = &[
    "the", "a", "of", "and", "to", "in", "is", "it", "that", "at", "every", "boot", "board",
    "model", "kiln", "image", "check", "checks", "self", "build", "said", "what", "runs", "number",
    "numbers", "if", "not", "this", "text", "reads", "small", "same", "tokens", "known", "answer",
    "each", "backend", "gives", "was", "on", "by", "with", "from", "be",
];

/// xorshift32: a deterministic stream with no dependency.
struct Rng(u32);
impl Rng {
    fn next(&mut self) -> u32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.0 = x;
        x
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }
}

/// The vocabulary: (piece, score, token type) in id order. Types as llama.cpp numbers them:
/// 1 normal, 2 unknown, 3 control, 6 byte.
fn vocab() -> Vec<(String, f32, i32)> {
    let mut v: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    for b in 0..=255u8 {
        v.push((format!("<0x{b:02X}>"), 0.0, 6));
    }
    let mut seen: BTreeSet<String> = v.iter().map(|t| t.0.clone()).collect();
    let mut pieces: Vec<String> = vec!["\u{2581}".into()];
    for c in (b'!'..=b'~').map(char::from) {
        pieces.push(c.to_string());
    }
    for w in WORDS {
        let full = format!("\u{2581}{w}");
        let chars: Vec<char> = full.chars().collect();
        for n in 2..=chars.len() {
            pieces.push(chars[..n].iter().collect());
        }
    }
    // Fill to N_VOCAB with letter pairs: real merges too, so no id is dead weight.
    'fill: for a in 'a'..='z' {
        for b in 'a'..='z' {
            pieces.push(format!("{a}{b}"));
            if pieces.len() > 4 * N_VOCAB {
                break 'fill;
            }
        }
    }
    for p in pieces {
        if v.len() == N_VOCAB {
            break;
        }
        if seen.insert(p.clone()) {
            // Longer pieces score higher, so whole words win the merges; ties by id.
            let score = p.chars().count() as f32 - v.len() as f32 * 1e-3;
            v.push((p, score, 1));
        }
    }
    v
}

/// `n` weights of a `k`-input matrix: uniform, scaled by `gain / sqrt(k)`.
fn weights(r: &mut Rng, k: usize, n: usize, gain: f32) -> Vec<f32> {
    let s = gain / (k as f32).sqrt();
    (0..k * n).map(|_| r.unit() * s).collect()
}

fn add_tensor(
    g: &mut GgufWriter,
    name: &str,
    ty: GgmlType,
    dims: &[usize],
    w: &[f32],
) -> Result<()> {
    let d: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
    match ty {
        GgmlType::F32 => {
            g.tensor_f32(name, &d, w)?;
        }
        GgmlType::F16 => {
            let b: Vec<u8> = w
                .iter()
                .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
                .collect();
            g.tensor(name, ty, &d, b)?;
        }
        _ => {
            let q = quantize_to_vec(ty, w).with_context(|| format!("quantising {name} as {ty}"))?;
            g.tensor(name, ty, &d, q)?;
        }
    }
    Ok(())
}

/// The fixture's bytes.
pub fn gguf() -> Result<Vec<u8>> {
    gguf_with(|_| Ok(()))
}

/// The fixture with `edit` applied last (tests add tensors and keys to a known-good model).
pub fn gguf_with(edit: impl FnOnce(&mut GgufWriter) -> Result<()>) -> Result<Vec<u8>> {
    build(
        "kiln llama fixture (seeded, for the boot known answer)",
        0x6c6c616d, // "llam"
        edit,
    )
}

/// Another model of the fixture's shape and vocabulary, with weights drawn from `seed` and
/// `general.name` = `name`: a second model that is not the fixture (the A/B boot test's models
/// bundle carries one, and the board serves it).
pub fn gguf_seeded(name: &str, seed: u32) -> Result<Vec<u8>> {
    build(name, seed, |_| Ok(()))
}

fn build(
    name: &str,
    seed: u32,
    edit: impl FnOnce(&mut GgufWriter) -> Result<()>,
) -> Result<Vec<u8>> {
    let mut g = GgufWriter::new();
    let u32v = |x: usize| Value::U32(x as u32);
    g.add("general.architecture", Value::String("llama".into()))?
        .add("general.name", Value::String(name.into()))?
        .alignment(32)?
        .add("llama.block_count", u32v(N_LAYER))?
        .add("llama.context_length", u32v(N_CTX))?
        .add("llama.embedding_length", u32v(N_EMBD))?
        .add("llama.feed_forward_length", u32v(N_FF))?
        .add("llama.attention.head_count", u32v(N_HEAD))?
        .add("llama.attention.head_count_kv", u32v(N_HEAD_KV))?
        .add("llama.rope.dimension_count", u32v(HEAD_DIM))?
        .add("llama.rope.freq_base", Value::F32(10000.0))?
        .add("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))?
        .add("llama.vocab_size", u32v(N_VOCAB))?;
    let v = vocab();
    g.add("tokenizer.ggml.model", Value::String("llama".into()))?
        .add("tokenizer.ggml.pre", Value::String("default".into()))?
        .add(
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                v.iter().map(|t| Value::String(t.0.clone())).collect(),
            ),
        )?
        .add(
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, v.iter().map(|t| Value::F32(t.1)).collect()),
        )?
        .add(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, v.iter().map(|t| Value::I32(t.2)).collect()),
        )?
        .add("tokenizer.ggml.bos_token_id", Value::U32(1))?
        .add("tokenizer.ggml.eos_token_id", Value::U32(2))?
        .add("tokenizer.ggml.unknown_token_id", Value::U32(0))?
        .add("tokenizer.ggml.add_bos_token", Value::Bool(true))?
        .add("tokenizer.ggml.add_eos_token", Value::Bool(false))?;

    let mut r = Rng(seed);
    let (e, kvd, ff) = (N_EMBD, N_HEAD_KV * HEAD_DIM, N_FF);
    add_tensor(
        &mut g,
        "token_embd.weight",
        GgmlType::Q8_0,
        &[e, N_VOCAB],
        &weights(&mut r, 1, e * N_VOCAB, 1.0),
    )?;
    // Layer 0: attention F16, FFN Q8_0; layer 1: attention Q8_0, FFN Q4_0.
    let types = [
        (GgmlType::F16, GgmlType::Q8_0),
        (GgmlType::Q8_0, GgmlType::Q4_0),
    ];
    for (l, (att, ffn)) in types.iter().enumerate() {
        let p = |s: &str| format!("blk.{l}.{s}");
        let norm: Vec<f32> = (0..e).map(|_| 1.0 + 0.25 * r.unit()).collect();
        add_tensor(&mut g, &p("attn_norm.weight"), GgmlType::F32, &[e], &norm)?;
        for (name, n) in [("attn_q", e), ("attn_k", kvd), ("attn_v", kvd)] {
            let w = weights(&mut r, e, n, 2.0);
            add_tensor(&mut g, &p(&format!("{name}.weight")), *att, &[e, n], &w)?;
        }
        let w = weights(&mut r, e, e, 1.0);
        add_tensor(&mut g, &p("attn_output.weight"), *att, &[e, e], &w)?;
        let norm: Vec<f32> = (0..e).map(|_| 1.0 + 0.25 * r.unit()).collect();
        add_tensor(&mut g, &p("ffn_norm.weight"), GgmlType::F32, &[e], &norm)?;
        for name in ["ffn_gate", "ffn_up"] {
            let w = weights(&mut r, e, ff, 1.5);
            add_tensor(&mut g, &p(&format!("{name}.weight")), *ffn, &[e, ff], &w)?;
        }
        let w = weights(&mut r, ff, e, 1.0);
        add_tensor(&mut g, &p("ffn_down.weight"), *ffn, &[ff, e], &w)?;
    }
    let norm: Vec<f32> = (0..e).map(|_| 1.0 + 0.25 * r.unit()).collect();
    add_tensor(&mut g, "output_norm.weight", GgmlType::F32, &[e], &norm)?;
    let w = weights(&mut r, e, N_VOCAB, 3.0);
    add_tensor(&mut g, "output.weight", GgmlType::F16, &[e, N_VOCAB], &w)?;
    edit(&mut g)?;
    Ok(g.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::model::{nll_windows, BackendSel, KvType, Model, Options, Want};
    use crate::tokenizer::Tokenizer;

    #[test]
    fn fixture_is_deterministic_small_and_runs() {
        let a = gguf().unwrap();
        assert_eq!(a, gguf().unwrap(), "the fixture's bytes must not vary");
        assert!(a.len() < 1 << 20, "{} bytes", a.len());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE_NAME);
        std::fs::write(&p, &a).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let types: BTreeSet<String> = f.tensors().map(|t| t.ty.to_string()).collect();
        for t in ["F16", "Q8_0", "Q4_0"] {
            assert!(types.contains(t), "{t} missing from {types:?}");
        }
        let tok = Tokenizer::from_gguf(f.gguf()).unwrap();
        let ids = tok
            .encode("The kiln board reads this text at every boot.", true, true)
            .unwrap();
        assert_eq!(ids[0], 1, "BOS first: {ids:?}");
        assert!(ids.len() < 20, "whole-word pieces expected: {ids:?}");
        let opt = Options {
            backend: BackendSel::CpuRef,
            ..Options::default()
        };
        let m = Model::load(&f, &opt).unwrap();
        let mut s = m.session(ids.len(), KvType::F16).unwrap();
        let (scored, sum) = nll_windows(&m, &mut s, &ids, ids.len()).unwrap();
        let mean = sum / scored as f64;
        // A seeded random model: not uniform (ln 512 = 6.24), not degenerate.
        assert!(
            mean.is_finite() && mean > 0.5 && (mean - (N_VOCAB as f64).ln()).abs() > 0.05,
            "{mean}"
        );
    }

    /// Decoding several sequences in one pass (M = sequences) gives each the logits it gets
    /// alone, to the bit: on the CPU fast path (threaded) and the scalar reference, f16 and f32
    /// caches, with sequences of different lengths joining and leaving the batch.
    #[test]
    fn batch_rows_equal_each_sequence_alone() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE_NAME);
        std::fs::write(&p, gguf().unwrap()).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let tok = Tokenizer::from_gguf(f.gguf()).unwrap();
        let prompts = [
            "The kiln board",
            "reads this text at every boot.",
            "The",
            "boot text",
        ];
        let steps = [6usize, 3, 8, 1];
        for backend in [BackendSel::Cpu, BackendSel::CpuRef] {
            for kv in [KvType::F16, KvType::F32] {
                let opt = Options {
                    backend,
                    threads: 2,
                    ..Options::default()
                };
                let m = Model::load(&f, &opt).unwrap();
                let argmax = |l: &[f32]| crate::model::sample::argmax(l);
                // Alone: prefill, then one token at a time (M = 1).
                let mut alone = Vec::new();
                for (pr, &n) in prompts.iter().zip(&steps) {
                    let ids = tok.encode(pr, true, true).unwrap();
                    let mut s = m.session(64, kv).unwrap();
                    let mut l = m.forward(&mut s, &ids, Want::Last).unwrap();
                    let mut rows = Vec::new();
                    for _ in 0..n {
                        let t = argmax(&l);
                        l = m.forward(&mut s, &[t], Want::Last).unwrap();
                        rows.push((t, l.clone()));
                    }
                    alone.push(rows);
                }
                // Batched: every sequence prefilled, then one pass per step over those still
                // decoding; sequence 1 joins two steps late.
                let mut ss: Vec<_> = (0..prompts.len())
                    .map(|_| m.session(64, kv).unwrap())
                    .collect();
                for (s, pr) in ss.iter_mut().zip(&prompts) {
                    let ids = tok.encode(pr, true, true).unwrap();
                    m.forward(s, &ids, Want::Last).unwrap();
                }
                let mut done = vec![0usize; prompts.len()];
                let mut batched_rows = 0;
                for step in 0.. {
                    let live: Vec<usize> = (0..prompts.len())
                        .filter(|&i| done[i] < steps[i] && (i != 1 || step >= 2))
                        .collect();
                    if live.is_empty() && done.iter().zip(&steps).all(|(d, n)| d == n) {
                        break;
                    }
                    let toks: Vec<u32> = live.iter().map(|&i| alone[i][done[i]].0).collect();
                    let mut refs: Vec<&mut crate::model::Session> = ss
                        .iter_mut()
                        .enumerate()
                        .filter(|(i, _)| live.contains(i))
                        .map(|(_, s)| s)
                        .collect();
                    if refs.is_empty() {
                        continue;
                    }
                    let logits = m.forward_batch(&mut refs, &toks).unwrap();
                    assert_eq!(logits.len(), live.len() * N_VOCAB);
                    batched_rows += live.len();
                    for (row, &i) in logits.chunks_exact(N_VOCAB).zip(&live) {
                        let want = &alone[i][done[i]].1;
                        let same = row
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{backend:?} {kv:?}: sequence {i} step {} differs in a batch of {}",
                            done[i],
                            live.len()
                        );
                        done[i] += 1;
                    }
                }
                assert_eq!(batched_rows, steps.iter().sum::<usize>());
            }
        }
    }
}
