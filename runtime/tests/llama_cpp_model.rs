//! kiln's forward pass against llama.cpp itself (llama-cpp-python, pinned; `KILN_LLAMA_PY` names
//! its python, `KILN_SMOLLM2` the real model). Per position: KL(llama.cpp ‖ kiln) of the
//! next-token distributions and the same top-1; the mean NLL of the sequence; 16 greedy tokens
//! (teacher-forced, a near-tie rule: see [`forced_greedy`]).
//! llama.cpp's KV cache is pinned to f16 (kiln's default) and flash attention off, which is the
//! rounding kiln's attention reproduces (Q and the softmax weights rounded to f16).
//!
//! Models: SmolLM2-135M Q4_1 (llama, tied Q8_0 head) and seeded synthetic models written by
//! gguf-py (`tests/py/llama_cpp_model.py synth`): qwen3 with key_length 64 ≠ 256/8 and Q/K norms,
//! qwen2 with Q/K/V biases, llama with an untied head, gemma3 with every Gemma 3 piece set away
//! from its default; each with Q8_0, Q4_0 and Q4_K weights; a Llama-3-style llama
//! (`rope_freqs.weight` factors, linear `rope.scaling`); and Gemma 3 270M Q4_K_M (`KILN_GEMMA3`)
//! on a text longer than its sliding window.
//!
//! Tolerances, and why they are not zero: kiln quantises activations exactly as ggml's
//! `vec_dot_type` does (Q8_0 / Q8_1 / Q8_K), so the integer dots are the same; what differs is the
//! f32 summation order (ggml's SIMD accumulators vs ours, in the matmuls' block sums, the attention
//! dots and the softmax), i.e. rounding in the last bits of f32, which can move an activation
//! across a Q8 rounding boundary now and then. Those differences stay orders of magnitude below a
//! real bug: each injected fault (RoPE pairing swapped, Q/K norm or biases dropped) is shown to
//! break the same comparison.
//!
//! Ignored under plain `cargo test`; run by the `llama-cpp` stage. Without the variables they fail.

mod support;

use kiln_runtime::gguf::GgufFile;
use kiln_runtime::model::{BackendSel, Fault, KvType, Model, Options, Want};
use serde_json::Value as J;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Tolerances (nats), the same for both KV cache types: mean KL per position, largest KL at one
/// position, |Δ mean NLL|; and the share of positions whose top-1 may differ by more than a tie.
///
/// Measured: with Q4_0 and Q4_K weights and an f32 cache kiln equals llama.cpp to KL ≈ 1e-12
/// (the same integer dots, the same f32 order); Q8_0 gives ≈ 1e-6, Q4_1 synthetic ≤ 2.1e-4; the
/// f16 cache adds ≈ 2e-4 (kiln rounds Q and the softmax weights to f16 as ggml does). SmolLM2
/// (30 layers, Q4_1) sits at KL 6.4e-3: that is the model's amplification of Q8 activation
/// rounding, measured on kiln itself by `llama_cpp_smollm2_logits_nll_greedy` (one-ulp nudge →
/// KL 6.1e-3), and these bounds admit it. Every injected fault measures ≥ 0.06.
const KL_MEAN_MAX: f64 = 1e-2;
const KL_MAX: f64 = 5e-2;
const NLL_DIFF_MAX: f64 = 3e-2;
const TOP1_MISS_SHARE: f64 = 0.15;

fn env_path(var: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "{var} is not set: this test compares kiln with llama.cpp (llama-cpp-python) and the \
             SmolLM2 model, which `cargo xtask test --stage llama-cpp` installs and names in {var}"
        ),
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/llama_cpp_model.py")
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn py(args: &[&str]) -> String {
    let python = env_path("KILN_LLAMA_PY");
    let out = Command::new(&python)
        .arg(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "llama_cpp_model.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn threads() -> String {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .to_string()
}

/// llama.cpp's logits for `ids` ([n][n_vocab]) and its greedy continuation.
struct Reference {
    n_vocab: usize,
    logits: Vec<f32>,
    greedy: Vec<u32>,
    /// llama.cpp's top-1 − top-2 logit at each greedy step.
    gaps: Vec<f64>,
    /// llama.cpp's second token at each greedy step.
    seconds: Vec<u32>,
}

fn u32s(v: &J) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn f64s(v: &J) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Greedy steps compared with llama.cpp's, on every model (the issue asks for 16).
const GREEDY_STEPS: usize = 16;

/// A greedy step whose top two logits (llama.cpp's) are closer than this is a tie that rounding
/// may break either way (the synthetic models' logits are a few units wide; SmolLM2's bound is
/// measured, see its test).
const GREEDY_TIE: f64 = 0.05;

/// kiln's greedy choices at llama.cpp's [`GREEDY_STEPS`] greedy steps, teacher-forced: kiln is fed
/// llama.cpp's token after every step, so one near-tie does not end the comparison. A step
/// passes when kiln picks llama.cpp's token, or — only where llama.cpp's own top-1 − top-2 logit
/// margin is below `tie` — llama.cpp's second token. `last` is kiln's logits after the prompt.
/// `Ok` lists the steps passed as ties; `Err` names the first step that fails.
fn forced_greedy(
    m: &Model<'_>,
    s: &mut kiln_runtime::model::Session,
    mut last: Vec<f32>,
    r: &Reference,
    tie: f64,
) -> Result<Vec<usize>, String> {
    assert_eq!(r.greedy.len(), GREEDY_STEPS, "llama.cpp's greedy steps");
    assert_eq!(r.seconds.len(), GREEDY_STEPS, "llama.cpp's second tokens");
    let mut ties = Vec::new();
    for (i, &g) in r.greedy.iter().enumerate() {
        let t = argmax(&last) as u32;
        if t != g {
            if r.gaps[i] < tie && t == r.seconds[i] {
                ties.push(i);
            } else {
                return Err(format!(
                    "greedy step {i}: kiln chose {t}, llama.cpp {g} (its second {}, top-2 margin \
                     {:.4}; a tie only below {tie})",
                    r.seconds[i], r.gaps[i]
                ));
            }
        }
        last = m.forward(s, &[g], Want::Last).unwrap();
    }
    Ok(ties)
}

/// [`forced_greedy`] after a prefill of `ids`, on the fast CPU path (f16 KV), with `fault`.
fn kiln_forced_greedy(
    f: &GgufFile,
    ids: &[u32],
    fault: Option<Fault>,
    r: &Reference,
    tie: f64,
) -> Result<Vec<usize>, String> {
    let m = Model::load(
        f,
        &Options {
            backend: BackendSel::Cpu,
            fault,
            ..Options::default()
        },
    )
    .unwrap();
    let mut s = m
        .session(ids.len() + GREEDY_STEPS + 1, KvType::F16)
        .unwrap();
    let last = m.forward(&mut s, ids, Want::Last).unwrap();
    forced_greedy(&m, &mut s, last, r, tie)
}

/// [`kiln_forced_greedy`] must pass (printing the tokens and any tie it accepted).
fn check_greedy(what: &str, f: &GgufFile, ids: &[u32], r: &Reference, tie: f64) {
    let ties = kiln_forced_greedy(f, ids, None, r, tie)
        .unwrap_or_else(|e| panic!("{what}: kiln's greedy tokens differ from llama.cpp's: {e}"));
    eprintln!(
        "{what}: {GREEDY_STEPS} greedy tokens (teacher-forced) equal llama.cpp's {:?}; near-ties \
         (margin < {tie}) at steps {:?}, kiln took the second token at {ties:?}",
        r.greedy,
        r.gaps
            .iter()
            .enumerate()
            .filter(|(_, g)| **g < tie)
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
    );
}

fn reference(model: &Path, ids: &[u32], dir: &Path, greedy: usize, kv: KvType) -> Reference {
    let out = dir.join("ref.f32");
    let ids_s: Vec<String> = ids.iter().map(u32::to_string).collect();
    let j: J = serde_json::from_str(&py(&[
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--ids",
        &ids_s.join(","),
        "--out",
        out.to_str().unwrap(),
        "--threads",
        &threads(),
        "--kv",
        match kv {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        },
        "--greedy",
        &greedy.to_string(),
    ]))
    .unwrap();
    let raw = std::fs::read(&out).unwrap();
    Reference {
        n_vocab: j["n_vocab"].as_u64().unwrap() as usize,
        logits: raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        greedy: u32s(&j["greedy"]),
        gaps: f64s(&j["gaps"]),
        seconds: u32s(&j["seconds"]),
    }
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = l.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    l.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(l: &[f32]) -> usize {
    kiln_runtime::model::sample::argmax(l) as usize
}

#[derive(Debug)]
struct Diff {
    kl_mean: f64,
    kl_max: f64,
    top1_same: usize,
    /// Positions whose top-1 differs although llama.cpp's top two are further apart than a
    /// rounding tie.
    top1_real_miss: usize,
    positions: usize,
    nll_kiln: f64,
    nll_ref: f64,
}

impl Diff {
    fn ok(&self, _kv: KvType) -> bool {
        self.kl_mean <= KL_MEAN_MAX
            && self.kl_max <= KL_MAX
            && self.top1_real_miss as f64 <= TOP1_MISS_SHARE * self.positions as f64
            && self.top1_same + self.top1_real_miss <= self.positions
            && (self.nll_kiln - self.nll_ref).abs() <= NLL_DIFF_MAX
    }
}

fn compare(ours: &[f32], r: &Reference, ids: &[u32]) -> Diff {
    let nv = r.n_vocab;
    assert_eq!(ours.len(), r.logits.len(), "logit counts differ");
    let n = ids.len();
    let (mut kl_sum, mut kl_max, mut same, mut miss) = (0.0, 0.0f64, 0, 0);
    let (mut nll_k, mut nll_r) = (0.0, 0.0);
    for i in 0..n {
        let a = &r.logits[i * nv..(i + 1) * nv];
        let b = &ours[i * nv..(i + 1) * nv];
        let (la, lb) = (log_softmax(a), log_softmax(b));
        let kl: f64 = la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum();
        kl_sum += kl;
        if std::env::var_os("KL_TRACE").is_some() {
            eprint!("{i}:{kl:.1e} ");
        }
        kl_max = kl_max.max(kl);
        let (ta, tb) = (argmax(a), argmax(b));
        if ta == tb {
            same += 1;
        } else {
            // A tie within rounding in llama.cpp's own logits may go either way.
            let gap = (a[ta] - a[tb]).abs();
            if gap > 1e-3 * a[ta].abs().max(1.0) {
                miss += 1;
            }
        }
        if i + 1 < n {
            nll_r -= la[ids[i + 1] as usize];
            nll_k -= lb[ids[i + 1] as usize];
        }
    }
    Diff {
        kl_mean: kl_sum / n as f64,
        kl_max,
        top1_same: same,
        top1_real_miss: miss,
        positions: n,
        nll_kiln: nll_k / (n - 1) as f64,
        nll_ref: nll_r / (n - 1) as f64,
    }
}

fn kiln_logits(f: &GgufFile, ids: &[u32], fault: Option<Fault>, kv: KvType) -> Vec<f32> {
    kiln_logits_on(f, ids, fault, kv, BackendSel::Cpu)
}

fn kiln_logits_on(
    f: &GgufFile,
    ids: &[u32],
    fault: Option<Fault>,
    kv: KvType,
    backend: BackendSel,
) -> Vec<f32> {
    let m = Model::load(
        f,
        &Options {
            backend,
            fault,
            ..Options::default()
        },
    )
    .unwrap();
    let mut s = m.session(ids.len() + 40, kv).unwrap();
    m.forward(&mut s, ids, Want::All).unwrap()
}

/// A fixed pseudo-random id sequence (no tokenizer needed for synthetic models).
fn ids(n: usize, n_vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % n_vocab as u64) as u32
        })
        .collect()
}

fn synthetic(arch: &str, faults: &[Fault]) {
    synthetic_on(arch, faults, true, &["q8_0", "q4_0", "q4_1", "q4_k"])
}

/// [`synthetic`] with or without the [`GREEDY_STEPS`] greedy comparison, on the weight types
/// `wtypes`. Each fault must break the logits comparison on every weight type, and the greedy
/// one (where it runs) on at least one: a random synthetic model's greedy continuation may be
/// one token repeated (qwen2 Q8_0: 359 sixteen times), which a fault can leave in place.
fn synthetic_on(arch: &str, faults: &[Fault], greedy: bool, wtypes: &[&str]) {
    let mut greedy_broken = vec![false; faults.len()];
    for (wi, wtype) in wtypes.iter().enumerate() {
        let dir = scratch(&format!("llama_cpp_{arch}_{wtype}"));
        let model = dir.join("m.gguf");
        let seed = (wi + 1).to_string();
        py(&[
            "synth",
            "--arch",
            arch,
            "--wtype",
            wtype,
            "--seed",
            &seed,
            "--out",
            model.to_str().unwrap(),
        ]);
        let f = GgufFile::open(&model).unwrap();
        let seq = ids(48, 384, wi as u64 + 11);
        let r32 = reference(&model, &seq, &dir, 0, KvType::F32);
        let d = compare(&kiln_logits(&f, &seq, None, KvType::F32), &r32, &seq);
        eprintln!("{arch} {wtype} kv f32: {d:?}");
        assert!(
            d.ok(KvType::F32),
            "{arch} {wtype} kv f32: kiln differs from llama.cpp: {d:?}"
        );
        let steps = if greedy { GREEDY_STEPS } else { 0 };
        let r = reference(&model, &seq, &dir, steps, KvType::F16);
        let d = compare(&kiln_logits(&f, &seq, None, KvType::F16), &r, &seq);
        eprintln!("{arch} {wtype} kv f16: {d:?}");
        assert!(
            d.ok(KvType::F16),
            "{arch} {wtype} kv f16: kiln differs from llama.cpp: {d:?}"
        );
        if greedy {
            check_greedy(&format!("{arch} {wtype}"), &f, &seq, &r, GREEDY_TIE);
        }
        // The comparison is not blind: each fault breaks it, even at the looser f16 tolerance.
        for (fi, &fault) in faults.iter().enumerate() {
            let d = compare(&kiln_logits(&f, &seq, Some(fault), KvType::F16), &r, &seq);
            eprintln!("{arch} {wtype} with {fault:?}: {d:?}");
            assert!(
                !d.ok(KvType::F16),
                "{arch} {wtype}: {fault:?} went unnoticed: {d:?}"
            );
            if greedy {
                let g = kiln_forced_greedy(&f, &seq, Some(fault), &r, GREEDY_TIE);
                eprintln!("{arch} {wtype} with {fault:?}: greedy {g:?}");
                greedy_broken[fi] |= g.is_err();
            }
        }
    }
    if greedy {
        for (fault, broken) in faults.iter().zip(greedy_broken) {
            assert!(
                broken,
                "{arch}: {fault:?} kept all {GREEDY_STEPS} greedy tokens on every weight type"
            );
        }
    }
}

#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_qwen3_synthetic_logits_nll_greedy() {
    synthetic("qwen3", &[Fault::SwapRope, Fault::NoQkNorm]);
}

#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_qwen2_synthetic_logits_nll_greedy() {
    synthetic("qwen2", &[Fault::SwapRope, Fault::NoBias]);
}

/// gemma3 with every piece set away from llama.cpp's defaults (window 8 over 48 tokens, every
/// third layer global, windowed RoPE base 20000, linear scaling ×2 on the global layers, soft-cap
/// 5, key_length 128 ≠ 256/4); each of kiln's gemma faults must break the comparison. One weight
/// type (Q4_K; Q8_0 measured the same) and no greedy steps, for the stage's time: llama.cpp decodes this
/// file at ~0.5 s a token (its SWA cache path), and the real Gemma 3 test has greedy steps.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_gemma3_synthetic_logits_nll_greedy() {
    synthetic_on(
        "gemma3",
        &[
            Fault::SwapRope,
            Fault::NoQkNorm,
            Fault::NoEmbdScale,
            Fault::NoPostNorms,
            Fault::SiluGate,
            Fault::NoWindow,
            Fault::WindowPlusOne,
            Fault::OneRopeBase,
            Fault::QScaleEmbd,
            Fault::NoSoftcap,
        ],
        false,
        &["q4_k"],
    );
}

/// phi3 with fused `attn_qkv` and gate/up `ffn_up`, an untied head, and a `sliding_window` key
/// that llama.cpp reads and switches off (so kiln must not apply it either). One weight type,
/// for the stage's time (the synthetic gemma3 runs Q4_K).
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_phi3_synthetic_logits_nll_greedy() {
    synthetic_on(
        "phi3",
        &[Fault::SwapRope, Fault::SwapGateUp],
        true,
        &["q4_0"],
    );
}

#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_llama_synthetic_logits_nll_greedy() {
    synthetic("llama", &[Fault::SwapRope]);
}

/// A Llama-3-style synthetic file (`synth --rope llama3`): `rope_freqs.weight` with the factors
/// Llama 3's formula gives for this file's context (1, 8 and the ramp between) and linear
/// `rope.scaling` keys (factor 2, original context 64). kiln equals llama.cpp within the usual
/// tolerances; and the same file with the factors all 1.0, or without the `rope.scaling` keys,
/// is far from llama.cpp on the original (so kiln reads both).
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_llama3_rope_synthetic_logits_nll_greedy() {
    for (wi, wtype) in ["q8_0", "q4_0"].iter().enumerate() {
        let dir = scratch(&format!("llama_cpp_llama3_{wtype}"));
        let seed = (wi + 31).to_string();
        let synth = |alter: &str| {
            let model = dir.join(format!("m-{alter}.gguf"));
            py(&[
                "synth",
                "--arch",
                "llama",
                "--wtype",
                wtype,
                "--seed",
                &seed,
                "--rope",
                "llama3",
                "--alter",
                alter,
                "--out",
                model.to_str().unwrap(),
            ]);
            model
        };
        let model = synth("none");
        let f = GgufFile::open(&model).unwrap();
        let seq = ids(64, 384, wi as u64 + 41);
        let r32 = reference(&model, &seq, &dir, 0, KvType::F32);
        let d = compare(&kiln_logits(&f, &seq, None, KvType::F32), &r32, &seq);
        eprintln!("llama3-rope {wtype} kv f32: {d:?}");
        assert!(
            d.ok(KvType::F32),
            "llama3-rope {wtype} kv f32: kiln differs from llama.cpp: {d:?}"
        );
        let r = reference(&model, &seq, &dir, GREEDY_STEPS, KvType::F16);
        let d = compare(&kiln_logits(&f, &seq, None, KvType::F16), &r, &seq);
        eprintln!("llama3-rope {wtype} kv f16: {d:?}");
        assert!(
            d.ok(KvType::F16),
            "llama3-rope {wtype} kv f16: kiln differs from llama.cpp: {d:?}"
        );
        check_greedy(&format!("llama3-rope {wtype}"), &f, &seq, &r, GREEDY_TIE);
        for alter in ["factors-ones", "no-scaling"] {
            let altered = synth(alter);
            let fa = GgufFile::open(&altered).unwrap();
            let d = compare(&kiln_logits(&fa, &seq, None, KvType::F16), &r, &seq);
            eprintln!("llama3-rope {wtype}: kiln on the file with {alter} vs llama.cpp on the original: {d:?}");
            assert!(
                !d.ok(KvType::F16),
                "llama3-rope {wtype}: kiln on the file with {alter} still matches llama.cpp on \
                 the original: that part of the file is not read: {d:?}"
            );
        }
    }
}

/// Logits viewed as a reference, to compare kiln with itself.
fn as_reference(l: &[f32], n_vocab: usize) -> Reference {
    Reference {
        n_vocab,
        logits: l.to_vec(),
        greedy: Vec::new(),
        gaps: Vec::new(),
        seconds: Vec::new(),
    }
}

/// Root-mean-square |Δ logit| between two runs: the typical size of the noise that separates
/// them.
fn rms_diff(a: &[f32], b: &[f32]) -> f64 {
    let s: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    (s / a.len().max(1) as f64).sqrt()
}

/// SmolLM2-135M Q4_1, the real model. Why it differs from llama.cpp more than the synthetic
/// models, measured here every run: kiln (like llama.cpp) quantises each matmul's activations to
/// Q8_1/Q8_0 (ggml's `vec_dot_type`), and that rounding is a step function — a one-ulp change of
/// an input moves some values across a Q8 rounding boundary, and SmolLM2's 30 layers amplify that
/// to a KL of a few 1e-3. So the test measures kiln's own noise floor: the same pass with every
/// embedding value nudged by one f32 ulp (`Fault::Ulp`). llama.cpp must sit within twice that
/// floor — it differs from kiln only by such rounding (its f32 summation order) — while the
/// `cpu-ref` path (f32 activations, no Q8 step) must stay put under the same nudge (KL < 1e-9),
/// which shows the floor comes from the activation quantisation and not from a bug that makes
/// the model unstable. A wrong RoPE base or a swapped RoPE pairing must fail the same bounds.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY) and KILN_SMOLLM2; run by the llama-cpp stage"]
fn llama_cpp_smollm2_logits_nll_greedy() {
    let model = env_path("KILN_SMOLLM2");
    let dir = scratch("llama_cpp_smollm2");
    let f = GgufFile::open(&model).unwrap();
    let seq: Vec<u32> = ids(96, 49152, 5);
    let r32 = reference(&model, &seq, &dir, 0, KvType::F32);
    let ours = kiln_logits(&f, &seq, None, KvType::F32);
    let d = compare(&ours, &r32, &seq);
    eprintln!("smollm2 kv f32: {d:?}");
    assert!(
        d.ok(KvType::F32),
        "smollm2 kv f32: kiln differs from llama.cpp: {d:?}"
    );
    // kiln's own rounding-noise floor on this model.
    let nudged = kiln_logits(&f, &seq, Some(Fault::Ulp), KvType::F32);
    let floor = compare(&nudged, &as_reference(&ours, r32.n_vocab), &seq);
    let noise = rms_diff(&ours, &nudged);
    eprintln!("smollm2 kiln vs kiln nudged by one ulp: {floor:?}, rms |Δlogit| {noise:.3}");
    assert!(
        d.kl_mean <= 2.0 * floor.kl_mean,
        "smollm2: llama.cpp is further from kiln (KL {:.2e}) than twice kiln's own one-ulp \
         rounding floor ({:.2e})",
        d.kl_mean,
        floor.kl_mean
    );
    let (r_ref, r_ref_nudged) = (
        kiln_logits_on(&f, &seq, None, KvType::F32, BackendSel::CpuRef),
        kiln_logits_on(&f, &seq, Some(Fault::Ulp), KvType::F32, BackendSel::CpuRef),
    );
    let stable = compare(&r_ref_nudged, &as_reference(&r_ref, r32.n_vocab), &seq);
    eprintln!("smollm2 cpu-ref vs cpu-ref nudged by one ulp: {stable:?}");
    assert!(
        stable.kl_max < 1e-9,
        "smollm2: the f32-activation path is not stable under a one-ulp nudge: {stable:?}"
    );
    let r = reference(&model, &seq, &dir, GREEDY_STEPS, KvType::F16);
    let d = compare(&kiln_logits(&f, &seq, None, KvType::F16), &r, &seq);
    eprintln!("smollm2 kv f16: {d:?}");
    assert!(
        d.ok(KvType::F16),
        "smollm2 kv f16: kiln differs from llama.cpp: {d:?}"
    );
    // Greedy: a step may go to llama.cpp's second token only where its top two are a tie at
    // this model's rounding level: closer than twice the rms logit noise that kiln's own one-ulp
    // nudge produces.
    let tie = (2.0 * noise).max(GREEDY_TIE);
    check_greedy("smollm2", &f, &seq, &r, tie);
    for fault in [Fault::SwapRope, Fault::RopeBase] {
        let d = compare(&kiln_logits(&f, &seq, Some(fault), KvType::F16), &r, &seq);
        eprintln!("smollm2 with {fault:?}: {d:?}");
        assert!(
            !d.ok(KvType::F16) || d.kl_mean > 2.0 * floor.kl_mean,
            "smollm2: {fault:?} went unnoticed: {d:?}"
        );
        let g = kiln_forced_greedy(&f, &seq, Some(fault), &r, tie);
        eprintln!("smollm2 with {fault:?}: greedy {g:?}");
        assert!(
            g.is_err(),
            "smollm2: {fault:?} kept all {GREEDY_STEPS} greedy tokens"
        );
    }
}

/// The case on a real model: SmolLM2 with a `rope_freqs.weight` added through gguf-py
/// (Llama 3's factors for its head and RoPE base, original context 64). kiln's `tokenize`/`ppl`
/// of the paragraph equal llama.cpp's NLL on the altered file within the usual tolerance, and
/// the unaltered file's NLL is far from it (so the comparison could tell a kiln that ignores the
/// tensor, as kiln did before it read it).
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY) and KILN_SMOLLM2; run by the llama-cpp stage"]
fn llama_cpp_smollm2_rope_freqs_paragraph_nll() {
    let dir = scratch("llama_cpp_smollm2_rope_freqs");
    let original = env_path("KILN_SMOLLM2");
    let model = dir.join("smollm2-rope-freqs.gguf");
    py(&[
        "add-rope-freqs",
        "--model",
        original.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
    ]);
    let text_file = dir.join("paragraph.txt");
    std::fs::write(&text_file, PARAGRAPH).unwrap();
    let (ids, nll) = kiln_tokens_nll(None, &kiln_bin(), &model, &text_file);
    let (ids_orig, nll_orig) = kiln_tokens_nll(None, &kiln_bin(), &original, &text_file);
    assert_eq!(ids, ids_orig, "the tokenizer did not change");
    let r = reference(&model, &ids, &dir, 0, KvType::F16);
    let reference_nll = compare(&vec![0.0; r.logits.len()], &r, &ids).nll_ref;
    eprintln!(
        "smollm2 + rope_freqs: paragraph of {} tokens: mean NLL kiln {nll:.6}, llama.cpp \
         {reference_nll:.6}, Δ {:+.2e}; kiln on the file without the tensor {nll_orig:.6}",
        ids.len(),
        nll - reference_nll
    );
    assert!(
        (nll - reference_nll).abs() <= NLL_DIFF_MAX,
        "smollm2 + rope_freqs: paragraph NLL kiln {nll} vs llama.cpp {reference_nll} \
         (tolerance {NLL_DIFF_MAX})"
    );
    let f = GgufFile::open(&model).unwrap();
    let r32 = reference(&model, &ids, &dir, 0, KvType::F32);
    let d = compare(&kiln_logits(&f, &ids, None, KvType::F32), &r32, &ids);
    eprintln!("smollm2 + rope_freqs kv f32: {d:?}");
    assert!(
        d.ok(KvType::F32),
        "smollm2 + rope_freqs kv f32: kiln differs from llama.cpp: {d:?}"
    );
    assert!(
        (nll_orig - reference_nll).abs() > 5.0 * NLL_DIFF_MAX,
        "the factors move llama.cpp's NLL by less than 5× the tolerance ({nll_orig} vs \
         {reference_nll}): this comparison could not tell that they are applied"
    );
}

/// |Δ mean NLL| allowed between the aarch64 build (NEON/dotprod, under qemu) and the host
/// build. kiln's kernels do the same integer dots and the same f32 operations in the same order on
/// both (Rust never contracts or reorders float ops), so the two agree to the last bit — measured
/// Δ = 0 on every model here; this leaves room for libm differences only.
const AARCH64_NLL_MAX: f64 = 1e-4;

/// A paragraph of ordinary prose (ASCII, digits, punctuation, a Unicode word).
const PARAGRAPH: &str = "The lighthouse keeper climbed the 137 steps every evening at dusk. \
He checked the lamp, wiped the salt from the glass, and wrote the wind's direction in a worn \
notebook. In 1921 a storm tore the door off its hinges, but the light never failed; sailors \
from Brest to Cork still tell the story of the café owner's son who kept it burning.";

fn kiln_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kiln"))
}

/// Runs `kiln` (through `runner` when given, e.g. qemu-aarch64-static) and parses its JSON.
fn kiln_json(runner: Option<&[String]>, bin: &Path, args: &[&str]) -> J {
    let mut c = match runner {
        Some([first, rest @ ..]) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin);
            c
        }
        _ => Command::new(bin),
    };
    let out = c
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "kiln {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "kiln {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// `kiln tokenize` then `kiln ppl` of a text file: (tokens, mean NLL).
fn kiln_tokens_nll(
    runner: Option<&[String]>,
    bin: &Path,
    model: &Path,
    text: &Path,
) -> (Vec<u32>, f64) {
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let tok = kiln_json(runner, bin, &["tokenize", m, "--file", t, "--json"]);
    let ids: Vec<u32> = tok["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let ppl = kiln_json(
        runner,
        bin,
        &[
            "ppl",
            m,
            "--file",
            t,
            "--json",
            "--backend",
            "cpu",
            "--kv",
            "f16",
            "--threads",
            &threads(),
        ],
    );
    assert_eq!(
        ppl["tokens"].as_u64(),
        Some(ids.len() as u64),
        "kiln ppl tokenised differently"
    );
    (ids, ppl["mean_nll"].as_f64().unwrap())
}

/// `kiln ppl` of a tokenised paragraph against llama.cpp's NLL over the same tokens (its logits,
/// f16 KV as kiln's default), on SmolLM2 and on the synthetic llama/qwen2/qwen3 models (whose
/// SentencePiece vocabulary tokenises the text to byte tokens). With `KILN_AARCH64_KILN` (an
/// aarch64 build of `kiln`) and `KILN_AARCH64_RUNNER` (e.g. `qemu-aarch64-static -cpu cortex-a76
/// -L /usr/aarch64-linux-gnu`), the same commands run on the NEON/dotprod path: the token ids must
/// be identical and the NLL within the same rounding tolerance of the host build.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY) and KILN_SMOLLM2; run by the llama-cpp stage"]
fn llama_cpp_paragraph_nll() {
    let dir = scratch("llama_cpp_paragraph");
    let a64_bin = std::env::var_os("KILN_AARCH64_KILN").map(PathBuf::from);
    let runner: Option<Vec<String>> = std::env::var("KILN_AARCH64_RUNNER")
        .ok()
        .map(|r| r.split_whitespace().map(String::from).collect());
    let mut models = vec![("smollm2".to_string(), env_path("KILN_SMOLLM2"), PARAGRAPH)];
    for (i, arch) in ["llama", "qwen2", "qwen3"].iter().enumerate() {
        let m = dir.join(format!("{arch}.gguf"));
        let seed = (i + 21).to_string();
        py(&[
            "synth",
            "--arch",
            arch,
            "--wtype",
            "q4_1",
            "--seed",
            &seed,
            "--out",
            m.to_str().unwrap(),
        ]);
        // The synthetic context is 256 tokens; byte fallback spends up to 3 per character.
        models.push((format!("synthetic {arch} q4_1"), m, &PARAGRAPH[..120]));
    }
    for (name, model, text) in &models {
        let text_file = dir.join("paragraph.txt");
        std::fs::write(&text_file, text).unwrap();
        let (ids, nll) = kiln_tokens_nll(None, &kiln_bin(), model, &text_file);
        let r = reference(model, &ids, &dir, 0, KvType::F16);
        let d = compare(&vec![0.0; r.logits.len()], &r, &ids);
        let diff = nll - d.nll_ref;
        eprintln!(
            "{name}: paragraph of {} tokens: mean NLL kiln {nll:.6}, llama.cpp {:.6}, Δ {diff:+.2e}",
            ids.len(),
            d.nll_ref
        );
        assert!(
            diff.abs() <= NLL_DIFF_MAX,
            "{name}: paragraph NLL kiln {nll} vs llama.cpp {} (tolerance {NLL_DIFF_MAX})",
            d.nll_ref
        );
        if let Some(bin) = &a64_bin {
            let (a_ids, a_nll) = kiln_tokens_nll(runner.as_deref(), bin, model, &text_file);
            eprintln!(
                "{name}: aarch64 under qemu: mean NLL {a_nll:.6} (host {nll:.6}, Δ {:+.2e}), tokens {}",
                a_nll - nll,
                if a_ids == ids { "identical" } else { "DIFFER" }
            );
            assert_eq!(
                a_ids, ids,
                "{name}: the aarch64 build tokenises differently"
            );
            assert!(
                (a_nll - nll).abs() <= AARCH64_NLL_MAX,
                "{name}: aarch64 NLL {a_nll} vs host {nll}"
            );
        }
    }
}

/// The seeded llama fixture the image carries for `model.nll`, on the text the image records:
/// llama.cpp loads it, gives the same token ids, and the same per-position distributions and
/// mean NLL within the tolerances above (kiln's CPU path and its cpu-ref path, which computes
/// the recorded answer).
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_selftest_fixture_tokens_and_nll() {
    use kiln_runtime::model::fixture;
    let dir = scratch("llama_cpp_fixture");
    let model = dir.join(fixture::FILE_NAME);
    std::fs::write(&model, fixture::gguf().unwrap()).unwrap();
    let text = include_str!("../../xtask/src/image/known-answer.txt").trim_end();
    let text_file = dir.join("text.txt");
    std::fs::write(&text_file, text).unwrap();
    let theirs: Vec<u32> = serde_json::from_str(&py(&[
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--text-file",
        text_file.to_str().unwrap(),
    ]))
    .unwrap();
    let f = GgufFile::open(&model).unwrap();
    let tok = kiln_runtime::tokenizer::Tokenizer::from_gguf(f.gguf()).unwrap();
    let ours = tok.encode(text, true, true).unwrap();
    assert_eq!(ours, theirs, "fixture: token ids differ from llama.cpp's");
    let r = reference(&model, &ours, &dir, 0, KvType::F16);
    let d = compare(&kiln_logits(&f, &ours, None, KvType::F16), &r, &ours);
    eprintln!("fixture ({} tokens) cpu: {d:?}", ours.len());
    assert!(
        d.ok(KvType::F16),
        "fixture: kiln differs from llama.cpp: {d:?}"
    );
    let m = Model::load(
        &f,
        &Options {
            backend: BackendSel::CpuRef,
            ..Options::default()
        },
    )
    .unwrap();
    let mut s = m.session(ours.len(), KvType::F16).unwrap();
    let d = compare(&m.forward(&mut s, &ours, Want::All).unwrap(), &r, &ours);
    eprintln!("fixture cpu-ref: {d:?}");
    assert!(
        d.ok(KvType::F16),
        "fixture cpu-ref: differs from llama.cpp: {d:?}"
    );
    let d = compare(
        &kiln_logits(&f, &ours, Some(Fault::SwapRope), KvType::F16),
        &r,
        &ours,
    );
    assert!(
        !d.ok(KvType::F16),
        "fixture: a swapped RoPE went unnoticed: {d:?}"
    );
}

/// |Δ mean NLL| between kiln's fast CPU path and its `cpu-ref` path (f32 activations, f32 KV) on
/// [`long_text_ids`]: what the Q8 activation quantisation that llama.cpp shares may cost.
const LONG_NLL_VS_REF_MAX: f64 = 5e-3;
/// |Δ mean NLL| between kiln and llama.cpp (f16 KV both) on [`long_text_ids`].
const LONG_NLL_VS_LLAMA_MAX: f64 = 1e-2;

/// 1024 tokens of ordinary English prose in windows of 512 (as llama-perplexity's chunks): the
/// GNU GPL v3 text every Debian system carries (`base-files`), from its preamble on. A short
/// text cannot judge NLL: on SmolLM2 a one-ulp nudge of the embeddings moves the mean NLL of a
/// 25-token sentence by up to ±0.03 (docs/speed.md, "Numerics"), over 1024 tokens by ±0.002.
fn long_text_ids(f: &GgufFile) -> Vec<u32> {
    let path = Path::new("/usr/share/common-licenses/GPL-3");
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (Debian's base-files has it)", path.display()));
    let text = &text[text.find("Preamble").expect("the GPL's preamble")..];
    let tok = kiln_runtime::tokenizer::Tokenizer::from_gguf(f.gguf()).unwrap();
    let ids = tok.encode(text, false, false).unwrap();
    assert!(ids.len() >= 1024, "only {} tokens", ids.len());
    ids[..1024].to_vec()
}

/// Mean NLL over windows of 512 (each scored from its second token on), for `logits_of`.
fn windows_nll(ids: &[u32], n_vocab: usize, mut logits_of: impl FnMut(&[u32]) -> Vec<f32>) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for w in ids.chunks(512) {
        let l = logits_of(w);
        for i in 0..w.len() - 1 {
            sum -= log_softmax(&l[i * n_vocab..(i + 1) * n_vocab])[w[i + 1] as usize];
            n += 1;
        }
    }
    sum / n as f64
}

/// The numerics of the fast CPU path on a text long enough to judge: within
/// [`LONG_NLL_VS_REF_MAX`] of kiln's exact `cpu-ref` path (f32 KV) and within
/// [`LONG_NLL_VS_LLAMA_MAX`] of llama.cpp (f16 KV, as both store it), on SmolLM2 and on every
/// GGUF named in `KILN_NLL_MODELS` (comma-separated; e.g. a Q4_K_M file). kiln's own rounding
/// floor on this text (a one-ulp nudge of the embeddings: ±2.5e-3 on SmolLM2) is in
/// docs/speed.md; the bounds are twice it and four times it.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY) and KILN_SMOLLM2; run by the llama-cpp stage"]
fn llama_cpp_long_text_nll() {
    let dir = scratch("llama_cpp_long_text");
    let mut models = vec![env_path("KILN_SMOLLM2")];
    if let Ok(extra) = std::env::var("KILN_NLL_MODELS") {
        models.extend(
            extra
                .split(',')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
        );
    }
    for model in &models {
        let f = GgufFile::open(model).unwrap();
        let ids = long_text_ids(&f);
        let nv = f.tensor("token_embd.weight").unwrap().ne[1] as usize;
        let on = |fault, kv, backend| {
            let f = &f;
            move |w: &[u32]| kiln_logits_on(f, w, fault, kv, backend)
        };
        let t = std::time::Instant::now();
        let fast = windows_nll(&ids, nv, on(None, KvType::F32, BackendSel::Cpu));
        let exact = windows_nll(&ids, nv, on(None, KvType::F32, BackendSel::CpuRef));
        let fast16 = windows_nll(&ids, nv, on(None, KvType::F16, BackendSel::Cpu));
        let llama = windows_nll(&ids, nv, |w| {
            reference(model, w, &dir, 0, KvType::F16).logits
        });
        let name = model.file_name().unwrap().to_string_lossy();
        eprintln!(
            "{name}: 1024 tokens: mean NLL kiln cpu {fast:.5} / cpu-ref {exact:.5} (f32 KV, Δ \
             {:+.2e}); kiln {fast16:.5} / llama.cpp {llama:.5} (f16 KV, Δ {:+.2e}) [{:.0} s]",
            fast - exact,
            fast16 - llama,
            t.elapsed().as_secs_f64()
        );
        assert!(
            (fast - exact).abs() <= LONG_NLL_VS_REF_MAX,
            "{name}: the fast path's NLL {fast} is more than {LONG_NLL_VS_REF_MAX} from cpu-ref's {exact}"
        );
        assert!(
            (fast16 - llama).abs() <= LONG_NLL_VS_LLAMA_MAX,
            "{name}: kiln's NLL {fast16} is more than {LONG_NLL_VS_LLAMA_MAX} from llama.cpp's {llama}"
        );
    }
}

/// Tokens of the real Gemma 3 text test: more than its 512-token sliding window, so that the
/// windowed layers (15 of 18) hide the start of the text from the last positions.
const GEMMA3_TOKENS: usize = 600;

/// Gemma 3 270M Q4_K_M (`KILN_GEMMA3`, the pinned PyPI file): on [`GEMMA3_TOKENS`] tokens of the
/// GPL's preamble in one context, kiln's token ids equal llama.cpp's, its mean NLL is within
/// [`LONG_NLL_VS_LLAMA_MAX`] of llama.cpp's (f16 KV both); the NLL of the 87 positions past the
/// window alone within [`NLL_DIFF_MAX`] (the short-text bound: a mean over so few tokens moves by
/// that much with rounding alone; measured −1.1e-2 here, −2.7e-3 over the 127 of a 640-token
/// run); and [`GREEDY_STEPS`] greedy tokens after the text agree ([`forced_greedy`]), which
/// `Fault::NoQkNorm` breaks. With `KILN_GEMMA3_FAULTS`
/// set, kiln with the window off (`Fault::NoWindow`) must be more than twice that bound away past
/// the window (measured 0.23; 0.59 over 640 tokens): left out of the stage for its time, the
/// synthetic gemma3 and `tests/gemma3_host.rs` hold that fault every run.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY) and KILN_GEMMA3; run by the llama-cpp stage"]
fn llama_cpp_gemma3_long_text_nll_greedy() {
    let t0 = std::time::Instant::now();
    let model = env_path("KILN_GEMMA3");
    let dir = scratch("llama_cpp_gemma3");
    let f = GgufFile::open(&model).unwrap();
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .expect("/usr/share/common-licenses/GPL-3 (Debian's base-files has it)");
    let text = &text[text.find("Preamble").expect("the GPL's preamble")..];
    let text = &text[..text.char_indices().nth(4000).map_or(text.len(), |(i, _)| i)];
    let text_file = dir.join("text.txt");
    std::fs::write(&text_file, text).unwrap();
    let tok = kiln_runtime::tokenizer::Tokenizer::from_gguf(f.gguf()).unwrap();
    let ours = tok.encode(text, true, true).unwrap();
    let theirs: Vec<u32> = serde_json::from_str(&py(&[
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--text-file",
        text_file.to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(ours, theirs, "gemma3: token ids differ from llama.cpp's");
    assert!(ours.len() > GEMMA3_TOKENS, "only {} tokens", ours.len());
    let ids = &ours[..GEMMA3_TOKENS];
    let n_swa = kiln_runtime::model::HParams::from_gguf(f.gguf())
        .unwrap()
        .swa
        .expect("the file has a sliding window")
        .n_swa;
    // Positions whose prediction sees past the window: from position n_swa on.
    let tail = GEMMA3_TOKENS - n_swa;
    // llama.cpp decodes this file at ~0.45 s a token on 2 cores (its SWA cache path), against
    // ~14 s for loading it and the whole prefill.
    let greedy = GREEDY_STEPS;
    let ids_s: Vec<String> = ids.iter().map(u32::to_string).collect();
    let t_ref = std::time::Instant::now();
    let r: J = serde_json::from_str(&py(&[
        "nll",
        "--model",
        model.to_str().unwrap(),
        "--ids",
        &ids_s.join(","),
        "--threads",
        &threads(),
        "--tail",
        &(tail - 1).to_string(),
        "--greedy",
        &greedy.to_string(),
    ]))
    .unwrap();
    let t_ref = t_ref.elapsed().as_secs_f64();
    let nv = r["n_vocab"].as_u64().unwrap() as usize;
    let (ref_nll, ref_tail) = (r["nll"].as_f64().unwrap(), r["nll_tail"].as_f64().unwrap());
    let reference = Reference {
        n_vocab: nv,
        logits: Vec::new(),
        greedy: u32s(&r["greedy"]),
        gaps: f64s(&r["gaps"]),
        seconds: u32s(&r["seconds"]),
    };
    let nlls = |fault: Option<Fault>| -> (f64, f64, Result<Vec<usize>, String>) {
        let m = Model::load(
            &f,
            &Options {
                backend: BackendSel::Cpu,
                fault,
                ..Options::default()
            },
        )
        .unwrap();
        let mut s = m.session(ids.len() + greedy + 1, KvType::F16).unwrap();
        // The fault run needs the positions past the window only: the rest is prefilled
        // without logits (the 262144-row LM head is most of the cost), then scored.
        let from = if fault.is_some() { n_swa } else { 0 };
        if from > 0 {
            m.forward(&mut s, &ids[..from], Want::None).unwrap();
        }
        let l = m.forward(&mut s, &ids[from..], Want::All).unwrap();
        let per: Vec<f64> = (from..ids.len() - 1)
            .map(|i| {
                let r = i - from;
                kiln_runtime::model::token_nll(&l[r * nv..(r + 1) * nv], ids[i + 1])
            })
            .collect();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let last = l[(ids.len() - 1 - from) * nv..].to_vec();
        let g = forced_greedy(&m, &mut s, last, &reference, GREEDY_TIE);
        (mean(&per), mean(&per[per.len() - (tail - 1)..]), g)
    };
    let t_kiln = std::time::Instant::now();
    let (nll, nll_tail, ours_greedy) = nlls(None);
    let t_kiln = t_kiln.elapsed().as_secs_f64();
    let nw_tail = std::env::var_os("KILN_GEMMA3_FAULTS").map(|_| nlls(Some(Fault::NoWindow)).1);
    // The greedy comparison is not blind either: kiln without Gemma's query/key norms, fed the
    // same tokens, leaves llama.cpp's choices (the prefill only to the last position: its LM
    // head once).
    let t_fault = std::time::Instant::now();
    let g_fault = kiln_forced_greedy(&f, ids, Some(Fault::NoQkNorm), &reference, GREEDY_TIE);
    let t_fault = t_fault.elapsed().as_secs_f64();
    eprintln!(
        "gemma3 270M: {GEMMA3_TOKENS} tokens (window {n_swa}): mean NLL kiln {nll:.5} / llama.cpp \
         {ref_nll:.5} (Δ {:+.2e}); the {} positions past the window: kiln {nll_tail:.5} / \
         llama.cpp {ref_tail:.5} (Δ {:+.2e}); kiln without the window {nw_tail:.5?} there \
         [llama.cpp {t_ref:.1} s, kiln {t_kiln:.1} s, total {:.1} s]",
        nll - ref_nll,
        tail - 1,
        nll_tail - ref_tail,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        (nll - ref_nll).abs() <= LONG_NLL_VS_LLAMA_MAX,
        "gemma3: kiln's NLL {nll} is more than {LONG_NLL_VS_LLAMA_MAX} from llama.cpp's {ref_nll}"
    );
    assert!(
        (nll_tail - ref_tail).abs() <= NLL_DIFF_MAX,
        "gemma3: past the window kiln's NLL {nll_tail} is more than {NLL_DIFF_MAX} from \
         llama.cpp's {ref_tail}"
    );
    if let Some(nw_tail) = nw_tail {
        assert!(
            (nw_tail - ref_tail).abs() > 2.0 * NLL_DIFF_MAX,
            "gemma3: kiln without the sliding window ({nw_tail}) is within twice the tolerance of \
         llama.cpp ({ref_tail}) past the window: this text cannot tell whether it is applied"
        );
    }
    let ties = ours_greedy
        .unwrap_or_else(|e| panic!("gemma3: kiln's greedy tokens differ from llama.cpp's: {e}"));
    eprintln!(
        "gemma3 270M: {GREEDY_STEPS} greedy tokens (teacher-forced) equal llama.cpp's {:?}, \
         top-2 margins {:.3?}; kiln took the second token at near-ties {ties:?}; with \
         Fault::NoQkNorm: {g_fault:?} [{t_fault:.1} s]",
        reference.greedy, reference.gaps
    );
    assert!(
        g_fault.is_err(),
        "gemma3: Fault::NoQkNorm kept all {GREEDY_STEPS} greedy tokens"
    );
}

/// Gemma 3's chat template (the text Google ships, as in `tests/gemma3_host.rs`) rendered by
/// kiln's minijinja equals llama-cpp-python's jinja2 render (Hugging Face's engine) of the same
/// two conversations, and llama.cpp's own `llama_chat_apply_template` (its built-in gemma
/// format, which leaves BOS to the tokenizer) equals kiln's prompt after the leading BOS is
/// dropped, as kiln's `Template::render` drops it for a file that adds BOS.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_gemma3_chat_template() {
    let dir = scratch("llama_cpp_gemma3_chat");
    let template = include_str!("gemma3_chat_template.jinja");
    let tf = dir.join("template.jinja");
    std::fs::write(&tf, template).unwrap();
    let m = |r: &str, c: &str| (r.to_string(), c.to_string());
    for conv in [
        vec![
            m("user", "Hello there. "),
            m("assistant", "Hi! How can I help?"),
        ],
        vec![
            m("system", "Answer in one word."),
            m("user", "Capital of France?"),
        ],
    ] {
        let mf = dir.join("messages.json");
        let msgs: Vec<J> = conv
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        std::fs::write(&mf, serde_json::to_vec(&msgs).unwrap()).unwrap();
        let theirs: J = serde_json::from_str(&py(&[
            "chat",
            "--template-file",
            tf.to_str().unwrap(),
            "--messages-json",
            mf.to_str().unwrap(),
        ]))
        .unwrap();
        let ours =
            kiln_runtime::tokenizer::chat::render(template, &conv, "<bos>", "<eos>").unwrap();
        eprintln!("gemma3 chat: kiln {ours:?}\ngemma3 chat: llama.cpp {theirs}");
        assert_eq!(
            Some(ours.as_str()),
            theirs["jinja2"].as_str(),
            "jinja2 renders otherwise"
        );
        assert_eq!(
            ours.strip_prefix("<bos>"),
            theirs["llama_cpp"].as_str(),
            "llama.cpp's llama_chat_apply_template renders otherwise"
        );
    }
}

/// llama.cpp's token ids of `text` and its mean NLL over them (one context, f16 KV).
fn llama_cpp_tokens_nll(model: &Path, text: &str, dir: &Path) -> (Vec<u32>, f64) {
    let text_file = dir.join("known-text.txt");
    std::fs::write(&text_file, text).unwrap();
    let ids: Vec<u32> = serde_json::from_str(&py(&[
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--text-file",
        text_file.to_str().unwrap(),
    ]))
    .unwrap();
    let ids_s: Vec<String> = ids.iter().map(u32::to_string).collect();
    let r: J = serde_json::from_str(&py(&[
        "nll",
        "--model",
        model.to_str().unwrap(),
        "--ids",
        &ids_s.join(","),
        "--threads",
        &threads(),
    ]))
    .unwrap();
    (ids, r["nll"].as_f64().unwrap())
}

/// The self-check's model checks and `kiln plan` on one model, as the board runs them (see
/// `support/board_root.rs`): the known answers recorded as the image records them have
/// llama.cpp's token ids and an NLL within [`NLL_DIFF_MAX`] of llama.cpp's; `kiln plan`, the
/// self-check's coverage and the model's load cover the same weights; every model check PASSes;
/// and each fault FAILs the check that must see it, naming the model (and the tensor):
/// a changed matmul known answer (its sha256 recomputed, so only the recomputation can see it),
/// a changed NLL known answer, and a flipped scale byte in `flip` (a tensor, its row) of the copy
/// on the models partition. Returns the root for per-architecture checks.
fn self_check_on(model: &Path, name: &str, flip: (&str, usize)) -> support::board_root::BoardRoot {
    use kiln_runtime::selftest::model_matmul;
    let dir = scratch(&format!("self_check_{name}"));
    let root = support::board_root::BoardRoot::new(model, name);
    let (ids, nll) = llama_cpp_tokens_nll(model, support::board_root::known_text(), &dir);
    eprintln!(
        "{name}: known text: {} tokens; recorded mean NLL (cpu-ref) {:.6}, llama.cpp {nll:.6}, Δ {:+.2e}; tolerance of the check {:.4}",
        ids.len(),
        root.nll.mean_nll,
        root.nll.mean_nll - nll,
        root.nll.tolerance
    );
    assert_eq!(
        root.nll.tokens, ids,
        "{name}: recorded token ids differ from llama.cpp's"
    );
    assert!(
        (root.nll.mean_nll - nll).abs() <= NLL_DIFF_MAX,
        "{name}: the recorded NLL {} is more than {NLL_DIFF_MAX} from llama.cpp's {nll}",
        root.nll.mean_nll
    );

    // `kiln plan`, the self-check's plan and the model's own load: the same matmul weights.
    let f = GgufFile::open(model).unwrap();
    let m = Model::load(&f, &Options::default()).unwrap();
    let mut loaded: Vec<&str> = m.matmul_weight_names();
    loaded.sort_unstable();
    let mut planned: Vec<&str> = kiln_runtime::sched::matmul_weights(&f)
        .iter()
        .map(|w| w.name)
        .collect();
    planned.sort_unstable();
    assert_eq!(
        planned, loaded,
        "{name}: kiln plan's weights are not the model's"
    );
    let out = Command::new(kiln_bin())
        .args(["plan", model.to_str().unwrap(), "--m", "1,8", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: J = serde_json::from_slice(&out.stdout).unwrap();
    let mut in_plan: Vec<&str> = j["plan"]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    in_plan.sort_unstable();
    assert_eq!(
        in_plan, loaded,
        "{name}: `kiln plan --json` lists other weights"
    );
    assert_eq!(
        j["table"]["coverage"]["none"]["weights"], 0,
        "{name}: {}",
        j["table"]
    );
    eprintln!("{name}: kiln plan ownership: {}", j["ledger_lines"]);

    root.assert_all_pass();

    // A changed matmul answer, its digest recomputed: only recomputing it can tell.
    let mut edited = root.matmul.clone();
    let k = edited.len() - 1;
    edited[k].expected[0] += 1.0;
    edited[k].sha256 = model_matmul::digest(&edited[k].expected);
    root.write_manifest(&edited, &root.nll);
    let why = root.fail_reason("model.matmul.cpu");
    let km = &root.matmul[k];
    let what = format!(
        "mismatch: {name} {} ({} {}x{}, rows {}..{}, M={})",
        km.tensor,
        km.ty,
        km.k,
        km.n,
        km.rows[0],
        km.rows[0] + km.rows[1],
        km.m
    );
    eprintln!("{name}: changed matmul answer: model.matmul.cpu FAIL: {why}");
    assert!(why.contains(&what), "{why}");
    // A changed NLL answer.
    let mut nll_edit = root.nll.clone();
    nll_edit.mean_nll += 4.0 * nll_edit.tolerance;
    root.write_manifest(&root.matmul, &nll_edit);
    let why = root.fail_reason("model.nll.cpu");
    eprintln!("{name}: changed NLL answer: model.nll.cpu FAIL: {why}");
    assert!(why.contains(&format!("{name} [cpu]: mean NLL")), "{why}");
    root.write_manifest(&root.matmul, &root.nll);
    // A flipped byte on the card.
    let (tensor, row) = flip;
    let at = root.flip_scale(tensor, row);
    let why = root.fail_reason("model.matmul.cpu");
    eprintln!("{name}: flipped byte {at} ({tensor} row {row}): model.matmul.cpu FAIL: {why}");
    assert!(
        why.contains(&format!("mismatch: {name} {tensor} (")),
        "{why}"
    );
    let why = root.fail_reason("model.nll.cpu");
    eprintln!("{name}: flipped byte: model.nll.cpu FAIL: {why}");
    assert!(why.contains(&format!("{name} [cpu]: mean NLL")), "{why}");
    root
}

/// [`self_check_on`] on Gemma 3 270M Q4_K_M (`KILN_GEMMA3`, the pinned PyPI file). Its known
/// answers take one weight of each type, the tied Q8_0 `token_embd` (the LM head, also the
/// largest), Q5_0 `blk.0.attn_k`, Q4_K `blk.0.attn_output`, Q6_K `blk.0.ffn_down`; the flipped
/// byte is in a recorded row of `blk.0.attn_k` (rows 64..128).
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY) and KILN_GEMMA3; run by the llama-cpp stage"]
fn llama_cpp_gemma3_self_check_and_plan() {
    let t = std::time::Instant::now();
    let model = env_path("KILN_GEMMA3");
    let root = self_check_on(
        &model,
        "gemma-3-270m-q4_k_m.gguf",
        ("blk.0.attn_k.weight", 96),
    );
    let picked: Vec<(&str, &str, [usize; 2])> = root
        .matmul
        .iter()
        .filter(|k| k.m == 1)
        .map(|k| (k.tensor.as_str(), k.ty.as_str(), k.rows))
        .collect();
    eprintln!(
        "gemma3: known answers of {picked:?} [{:.1} s]",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(
        picked,
        [
            ("token_embd.weight", "Q8_0", [131008, 64]),
            ("blk.0.attn_k.weight", "Q5_0", [64, 64]),
            ("blk.0.attn_output.weight", "Q4_K", [256, 64]),
            ("blk.0.ffn_down.weight", "Q6_K", [256, 64]),
        ]
    );
}

/// [`self_check_on`] on a synthetic phi3 (Q4_0, written by gguf-py): the known answers cover
/// each part of the fused weights, `blk.0.attn_qkv` (q, k, v: 256 + 128 + 128 rows) and
/// `blk.0.ffn_up` (gate, up: 512 + 512), and a byte flipped in the v part's rows fails them.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_phi3_self_check_and_plan() {
    let dir = scratch("self_check_phi3_model");
    let model = dir.join("phi3.gguf");
    py(&[
        "synth",
        "--arch",
        "phi3",
        "--wtype",
        "q4_0",
        "--seed",
        "7",
        "--out",
        model.to_str().unwrap(),
    ]);
    let root = self_check_on(&model, "phi3.gguf", ("blk.0.attn_qkv.weight", 384));
    let picked: Vec<(&str, &str, [usize; 2])> = root
        .matmul
        .iter()
        .filter(|k| k.m == 1)
        .map(|k| (k.tensor.as_str(), k.ty.as_str(), k.rows))
        .collect();
    eprintln!("phi3: known answers of {picked:?}");
    for want in [
        ("blk.0.attn_qkv.weight", "Q4_0", [64, 64]),
        ("blk.0.attn_qkv.weight", "Q4_0", [256, 64]),
        ("blk.0.attn_qkv.weight", "Q4_0", [384, 64]),
        ("blk.0.ffn_up.weight", "Q4_0", [192, 64]),
        ("blk.0.ffn_up.weight", "Q4_0", [704, 64]),
    ] {
        assert!(
            picked.contains(&want),
            "phi3: no known answer {want:?}: {picked:?}"
        );
    }
}

/// `conv`s rendered by kiln's minijinja ([`kiln_runtime::tokenizer::chat::render`], what `kiln
/// chat` and `kiln serve` use) and by the python side (`chat`): kiln's must equal jinja2's, set up
/// and called as Hugging Face's `apply_chat_template` does (`hf_jinja2`), with the generation
/// prompt; with `native`, also llama-cpp-python's Jinja2ChatFormatter and llama.cpp's own
/// `llama_chat_apply_template` (its built-in format for the template), except for a conversation
/// with an empty system message (which those built-in formats write and Phi's template skips).
fn chat_against_jinja2(
    file: &str,
    template: &str,
    (bos, eos): (&str, &str),
    convs: &[Vec<(String, String)>],
    native: bool,
) {
    let dir = scratch(&format!("llama_cpp_chat_{file}"));
    let tf = dir.join(file);
    std::fs::write(&tf, template).unwrap();
    for conv in convs {
        let mf = dir.join("messages.json");
        let msgs: Vec<J> = conv
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        std::fs::write(&mf, serde_json::to_vec(&msgs).unwrap()).unwrap();
        let theirs: J = serde_json::from_str(&py(&[
            "chat",
            "--template-file",
            tf.to_str().unwrap(),
            "--messages-json",
            mf.to_str().unwrap(),
            "--bos",
            bos,
            "--eos",
            eos,
        ]))
        .unwrap();
        let ours = kiln_runtime::tokenizer::chat::render(template, conv, bos, eos).unwrap();
        eprintln!("{file}: kiln {ours:?}\n{file}: python {theirs}");
        assert_eq!(
            Some(ours.as_str()),
            theirs["hf_jinja2"].as_str(),
            "{file}: jinja2 (as Hugging Face sets it up) renders otherwise"
        );
        if native && !conv.iter().any(|(r, c)| r == "system" && c.is_empty()) {
            assert_eq!(
                Some(ours.as_str()),
                theirs["jinja2"].as_str(),
                "{file}: llama-cpp-python's Jinja2ChatFormatter renders otherwise"
            );
            assert_eq!(
                Some(ours.as_str()),
                theirs["llama_cpp"].as_str(),
                "{file}: llama.cpp's llama_chat_apply_template renders otherwise"
            );
        }
    }
}

/// Conversations for the template tests: with a system message, several turns with none, a
/// system message and several turns, an empty system message.
fn conversations() -> Vec<Vec<(String, String)>> {
    let m = |r: &str, c: &str| (r.to_string(), c.to_string());
    vec![
        vec![
            m("system", "Answer in one word."),
            m("user", "Capital of France?"),
        ],
        vec![
            m("user", "Hello there. "),
            m("assistant", "Hi! How can I help?"),
            m("user", "Name a colour.\nOne only."),
        ],
        vec![
            m("system", "You are terse."),
            m("user", "2+2?"),
            m("assistant", "4"),
            m("user", "And 3+3?"),
        ],
        vec![m("system", ""), m("user", "Hi")],
    ]
}

/// Phi's chat templates as llama.cpp's repository carries them (`models/templates/`, copied from
/// the models' `tokenizer_config.json`): Phi-3.5-mini-instruct's
/// (`phi3_5_mini_chat_template.jinja`; Phi-3-mini-4k's differs only in not skipping an empty
/// system message), also against llama.cpp's built-in phi3 format, and Phi-4-mini-instruct's
/// (`phi4_mini_chat_template.jinja`, also a `phi3` GGUF; block tags on lines of their own, a
/// `tools` branch: llama-cpp-python's formatter passes `tools=None` and fails on it, and
/// llama.cpp's built-in phi3 format puts newlines the template does not).
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_phi3_chat_template() {
    let convs = conversations();
    let tokens = ("<s>", "<|endoftext|>");
    chat_against_jinja2(
        "phi3_5_mini_chat_template.jinja",
        include_str!("phi3_5_mini_chat_template.jinja"),
        tokens,
        &convs,
        true,
    );
    chat_against_jinja2(
        "phi4_mini_chat_template.jinja",
        include_str!("phi4_mini_chat_template.jinja"),
        tokens,
        &convs,
        false,
    );
}

/// Llama 3.2 Instruct's chat template (`llama3_2_chat_template.jinja`, from llama.cpp's
/// `models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja`): `strftime_now("%d %b %Y")` for
/// its "Today Date" line (UTC on both sides), `messages[1:]`, `|trim`, `is defined` / `none`.
#[test]
#[ignore = "needs llama-cpp-python (KILN_LLAMA_PY); run by the llama-cpp stage"]
fn llama_cpp_llama3_2_chat_template() {
    chat_against_jinja2(
        "llama3_2_chat_template.jinja",
        include_str!("llama3_2_chat_template.jinja"),
        ("<|begin_of_text|>", "<|eot_id|>"),
        &conversations(),
        false,
    );
}
