//! `kiln plan` and `kiln matmul` from outside, on a file written by kiln's GGUF writer and (with
//! `KILN_SMOLLM2`, stage `npu-plan-smollm2`) on the SmolLM2 model; the NPU is rknn-standin.
//! `kiln plan`'s NPU declines against what the NPU declines when the model is loaded on it.

mod support;

mod npu_common;

use kiln_runtime::backend::{Backend, Capabilities, Decline, MatmulOp, PreparedWeight, Weight};
use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::{GgufFile, Value};
use kiln_runtime::quant::{quantize_to_vec, GgmlType};
use npu_common::*;
use serde_json::Value as J;
use std::path::{Path, PathBuf};
use std::process::Output;

/// `kiln`, through the cargo runner when the tests run as aarch64 code under qemu-user. Each
/// call has a device root of its own: the NPU lock is per root, and these run in parallel.
fn kiln(args: &[&str]) -> Output {
    let devroot = tempfile::tempdir().expect("tempdir");
    support::kiln_cmd()
        .args(args)
        .env("KILN_RKNN_LIB", standin("KILN_RKNN_STANDIN"))
        .env("KILN_DEVROOT", devroot.path())
        .env_remove("KILN_RKNN_STANDIN_FAULT")
        .output()
        .expect("running kiln")
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small llama-shaped model: weights the NPU takes (F16, Q8_0), ones it declines for shape
/// (K % 32, N % 16) and type (Q4_0), a norm and tied embeddings.
fn model(dir: &Path) -> PathBuf {
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("llama".into()))
        .unwrap();
    let q = |ty, k: usize, n: usize, seed| quantize_to_vec(ty, &values(seed, k * n)).unwrap();
    let f16 = |k: usize, n: usize, seed| weight(GgmlType::F16, k, n, seed).0;
    w.tensor(
        "token_embd.weight",
        GgmlType::Q8_0,
        &[64, 96],
        q(GgmlType::Q8_0, 64, 96, 1),
    )
    .unwrap();
    w.tensor_f32("blk.0.attn_norm.weight", &[64], &values(2, 64))
        .unwrap();
    w.tensor(
        "blk.0.attn_q.weight",
        GgmlType::F16,
        &[64, 64],
        f16(64, 64, 3),
    )
    .unwrap();
    w.tensor(
        "blk.0.attn_k.weight",
        GgmlType::F16,
        &[48, 32],
        f16(48, 32, 4),
    )
    .unwrap();
    w.tensor(
        "blk.0.attn_v.weight",
        GgmlType::F16,
        &[64, 24],
        f16(64, 24, 5),
    )
    .unwrap();
    w.tensor(
        "blk.0.ffn_up.weight",
        GgmlType::Q8_0,
        &[64, 128],
        q(GgmlType::Q8_0, 64, 128, 6),
    )
    .unwrap();
    w.tensor(
        "blk.0.ffn_down.weight",
        GgmlType::Q4_0,
        &[128, 64],
        q(GgmlType::Q4_0, 128, 64, 7),
    )
    .unwrap();
    let p = dir.join("model.gguf");
    w.write(&p).unwrap();
    p
}

fn plan_json(file: &Path, ms: &str) -> J {
    plan_json_args(file, &["--m", ms])
}

fn plan_json_args(file: &Path, args: &[&str]) -> J {
    let mut all = vec!["plan", file.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let out = kiln(&all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every matmul weight is owned by exactly one backend (or `none`), every op at every M is
/// claimed by one, and every decline has a reason with its numbers.
fn check_counts(j: &J, n_weights: usize, n_ms: usize) {
    let t = &j["table"];
    assert_eq!(t["total_weights"], n_weights);
    let cov = t["coverage"].as_object().unwrap();
    let owned: u64 = cov.values().map(|c| c["weights"].as_u64().unwrap()).sum();
    assert_eq!(owned, n_weights as u64, "{t}");
    for i in 0..n_ms {
        let claimed: u64 = cov.values().map(|c| c["ops"][i].as_u64().unwrap()).sum();
        assert_eq!(claimed, n_weights as u64, "ops at M index {i}: {t}");
    }
    assert_eq!(
        cov["none"]["weights"], 0,
        "the CPU takes what the NPU declines"
    );
    for w in j["plan"]["weights"].as_array().unwrap() {
        for d in w["declined"].as_array().unwrap() {
            assert!(d["decline"]["reason"].is_string(), "{d}");
        }
        for at in w["at_m"].as_array().unwrap() {
            assert!(at["backend"].is_string(), "{at}");
        }
    }
}

#[test]
fn plan_on_a_written_model() {
    let dir = scratch("plan-written");
    let file = model(&dir);
    let f = GgufFile::open(&file).unwrap();
    let names: Vec<&str> = kiln_runtime::sched::matmul_weights(&f)
        .iter()
        .map(|w| w.name)
        .collect();
    assert_eq!(names.len(), 6, "tied token_embd + 5 blk weights: {names:?}");
    assert!(!names.contains(&"blk.0.attn_norm.weight"));

    let j = plan_json(&file, "1,8,512");
    check_counts(&j, 6, 3);
    let t = &j["table"];
    // NPU: attn_q (F16), ffn_up and token_embd (Q8_0); at M=1 it declines them as SmallM.
    assert_eq!(t["coverage"]["npu"]["weights"], 3, "{t}");
    assert_eq!(t["coverage"]["npu"]["ops"], serde_json::json!([0, 3, 3]));
    assert_eq!(t["coverage"]["cpu"]["weights"], 3);
    let npu = &t["declines"]["npu"];
    assert_eq!(npu["KNotAligned"]["weights"], 1, "{npu}");
    assert_eq!(npu["NNotAligned"]["weights"], 1, "{npu}");
    assert_eq!(npu["WeightType"]["weights"], 1, "{npu}");
    assert_eq!(npu["SmallM"]["ops"], serde_json::json!([3, 0, 0]), "{npu}");
    let lines: Vec<&str> = j["ledger_lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("weights on NPU via mmap, converted to native layout")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("weights on CPU via mmap (zero-copy, borrowed)")),
        "{lines:?}"
    );
    let probe = &j["plan"]["probes"][0];
    assert_eq!(probe["result"]["Ok"]["simulated"], true, "{probe}");

    let out = kiln(&["plan", file.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("declined by npu:"), "{text}");
    assert!(text.contains("SIMULATED"), "{text}");
    assert!(text.contains("KNotAligned{k: 48, need: 32}"), "{text}");
    // NPU memory per weight (converted B: F16 64×64 = 8 KiB, Q8_0 as int8 64×128 / 64×96),
    // and the total against the default budget.
    assert!(
        text.contains("NPU memory (converted B, one copy per weight):"),
        "{text}"
    );
    assert!(
        text.contains("  blk.0.attn_q.weight          F16   K=64     N=64          0.01 MiB\n"),
        "{text}"
    );
    assert!(text.contains("int8 per-row requant NMSE"), "{text}");
    assert!(
        text.contains("NPU total 0.02 MiB for 3 weights of budget 1024.00 MiB"),
        "{text}"
    );
    assert_eq!(t["npu_bytes"], 64 * 64 * 2 + 64 * 128 + 64 * 96, "{t}");
    assert_eq!(t["npu_budget"], 1u64 << 30);
}

/// `--npu-budget-mib 0`: every weight the NPU could take is declined as `NpuMemory`, at every M
/// too, the CPU runs them, and the counts still add up.
#[test]
fn plan_with_no_npu_budget() {
    let dir = scratch("plan-budget");
    let file = model(&dir);
    let out = kiln(&[
        "plan",
        file.to_str().unwrap(),
        "--m",
        "1,8,512",
        "--json",
        "--npu-budget-mib",
        "0",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: J = serde_json::from_slice(&out.stdout).unwrap();
    check_counts(&j, 6, 3);
    let t = &j["table"];
    assert_eq!(t["coverage"]["npu"]["weights"], 0, "{t}");
    assert_eq!(t["declines"]["npu"]["NpuMemory"]["weights"], 3, "{t}");
    assert_eq!(
        t["declines"]["npu"]["NpuMemory"]["ops"],
        serde_json::json!([3, 3, 3])
    );
    assert_eq!(t["npu_bytes"], 0);
    let out = kiln(&["plan", file.to_str().unwrap(), "--npu-budget-mib", "0"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("NPU total 0.00 MiB for 0 weights of budget 0.00 MiB (0.00 MiB left; 3 weights declined as NpuMemory)"),
        "{text}"
    );
    assert!(
        text.contains("NpuMemory{need: 0.01 MiB, left: 0.00 MiB}"),
        "{text}"
    );
}

/// A loadable one-layer llama (embedding 512, FFN 1024, tied embeddings), every matmul weight
/// F16, listed in an order that is not the forward pass's: the tied embedding first, then the
/// layer's tensors by name (as converters often write them). Converted NPU bytes: Q, K, V and
/// the attention output 0.5 MiB each, gate, up, down and the tied LM head 1 MiB each.
fn loadable_model(dir: &Path) -> PathBuf {
    let (e, ff, vocab) = (512usize, 1024usize, 1024usize);
    let mut w = GgufWriter::new();
    let u = |x: usize| Value::U32(x as u32);
    w.add("general.architecture", Value::String("llama".into()))
        .unwrap()
        .add("llama.block_count", u(1))
        .unwrap()
        .add("llama.context_length", u(64))
        .unwrap()
        .add("llama.embedding_length", u(e))
        .unwrap()
        .add("llama.feed_forward_length", u(ff))
        .unwrap()
        .add("llama.attention.head_count", u(8))
        .unwrap()
        .add("llama.attention.head_count_kv", u(8))
        .unwrap()
        .add("llama.rope.dimension_count", u(64))
        .unwrap()
        .add("llama.rope.freq_base", Value::F32(10000.0))
        .unwrap()
        .add("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
        .unwrap()
        .add("llama.vocab_size", u(vocab))
        .unwrap();
    let mut seed = 100;
    let mut f16 = |name: &str, k: usize, n: usize| {
        seed += 1;
        let b = weight(GgmlType::F16, k, n, seed).0;
        w.tensor(name, GgmlType::F16, &[k as u64, n as u64], b)
            .unwrap();
    };
    f16("token_embd.weight", e, vocab);
    f16("blk.0.attn_k.weight", e, e);
    f16("blk.0.attn_output.weight", e, e);
    f16("blk.0.attn_q.weight", e, e);
    f16("blk.0.attn_v.weight", e, e);
    f16("blk.0.ffn_down.weight", ff, e);
    f16("blk.0.ffn_gate.weight", e, ff);
    f16("blk.0.ffn_up.weight", e, ff);
    for n in ["blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"] {
        w.tensor_f32(format!("{n}.weight"), &[e as u64], &vec![1.0; e])
            .unwrap();
    }
    let p = dir.join("loadable.gguf");
    w.write(&p).unwrap();
    p
}

/// The stand-in NPU backend, recording each weight it declines while preparing, and why.
struct Recording {
    npu: kiln_runtime::backend::npu::NpuBackend,
    declined: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

impl Backend for Recording {
    fn name(&self) -> &'static str {
        self.npu.name()
    }
    fn probe(&self) -> Result<Capabilities, Decline> {
        self.npu.probe()
    }
    fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
        self.npu.supports(op)
    }
    fn prepare<'w>(&self, w: &Weight<'w>) -> anyhow::Result<Box<dyn PreparedWeight + 'w>> {
        let r = self.npu.prepare(w);
        if let Some(d) = r.as_ref().err().and_then(|e| e.downcast_ref::<Decline>()) {
            let mut v = self.declined.lock().unwrap();
            v.push((w.name.to_string(), d.kind().to_string()));
        }
        r
    }
    fn run(
        &self,
        w: &Weight<'_>,
        p: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> anyhow::Result<()> {
        self.npu.run(w, p, a, m, c)
    }
}

/// At a budget where only some weights fit (3 MiB of the model's 6), the weights `kiln plan`
/// declines as `NpuMemory` are the ones the NPU backend declines when the model is loaded on it
/// with that budget: one order of preparation for both, whatever order the file lists them in.
#[test]
fn plan_declines_what_the_loaded_model_declines() {
    use kiln_runtime::backend::cpu::CpuBackend;
    use kiln_runtime::model::{Model, Options};
    use std::collections::BTreeSet;
    const MIB: u64 = 3;
    let dir = scratch("plan-vs-load");
    let file = loadable_model(&dir);
    let j = plan_json_args(
        &file,
        &["--m", "1,512", "--npu-budget-mib", &MIB.to_string()],
    );
    check_counts(&j, 8, 2);
    let planned: BTreeSet<String> = j["plan"]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| {
            w["declined"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["backend"] == "npu" && d["decline"]["reason"] == "NpuMemory")
        })
        .map(|w| w["name"].as_str().unwrap().to_string())
        .collect();
    let npu_owned = j["table"]["coverage"]["npu"]["weights"].as_u64().unwrap();
    assert!(
        !planned.is_empty() && npu_owned > 0,
        "only some weights fit in {MIB} MiB: {planned:?}, {npu_owned} on the NPU"
    );

    let declined = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let npu = Recording {
        npu: backend_with("KILN_RKNN_STANDIN", |c| c.budget = MIB << 20),
        declined: declined.clone(),
    };
    let f = GgufFile::open(&file).unwrap();
    let opt = Options {
        ubatch: 512,
        threads: 1,
        ..Options::default()
    };
    let backends: Vec<Box<dyn Backend>> = vec![Box::new(npu), Box::new(CpuBackend::new())];
    let model = Model::load_with(&f, &opt, backends).unwrap();
    let loaded: BTreeSet<String> = declined
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, why)| why == "NpuMemory")
        .map(|(name, _)| name.clone())
        .collect();
    assert_eq!(
        planned, loaded,
        "kiln plan declines {planned:?}, the loaded model's NPU declined {loaded:?}\n{}",
        model.plan_text
    );
}

#[test]
fn matmul_runs_on_the_named_backend_or_says_why_not() {
    let dir = scratch("matmul-cli");
    let file = model(&dir);
    let f = file.to_str().unwrap();
    let (m, k, n) = (8usize, 64usize, 128usize);
    let a = values(42, m * k);
    let input = dir.join("a.f32");
    std::fs::write(
        &input,
        a.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    let read = |p: &Path| -> Vec<f32> {
        std::fs::read(p)
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let mut results = Vec::new();
    for be in ["npu", "cpu", "cpu-ref"] {
        let out_p = dir.join(format!("c-{be}.f32"));
        let o = kiln(&[
            "matmul",
            f,
            "blk.0.ffn_up.weight",
            "--input",
            input.to_str().unwrap(),
            "--m",
            "8",
            "-o",
            out_p.to_str().unwrap(),
            "--backend",
            be,
            "--threads",
            "3",
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{be}: {stdout} {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(stdout.starts_with(&format!("ran on {be}")), "{stdout}");
        if be == "npu" {
            assert!(stdout.contains("(SIMULATED)"), "{stdout}");
        }
        let c = read(&out_p);
        assert_eq!(c.len(), m * n);
        results.push(c);
    }
    let e = nmse(&results[0], &results[2]);
    assert!(e <= 5e-4, "npu vs cpu-ref NMSE {e:e}");

    // M=1: the NPU declines with its reason and exits non-zero; the default order falls back.
    let one = dir.join("a1.f32");
    std::fs::write(
        &one,
        values(1, k)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let out_p = dir.join("c1.f32");
    let args = |be: Option<&str>| {
        let mut v = vec![
            "matmul".to_string(),
            f.to_string(),
            "blk.0.ffn_up.weight".into(),
            "--input".into(),
            one.to_str().unwrap().into(),
            "--m".into(),
            "1".into(),
            "-o".into(),
            out_p.to_str().unwrap().into(),
        ];
        if let Some(b) = be {
            v.extend(["--backend".to_string(), b.to_string()]);
        }
        v
    };
    let o = kiln(
        &args(Some("npu"))
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(!o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("npu declined blk.0.ffn_up.weight at M=1: SmallM{m: 1, min: 8}"),
        "{text}"
    );
    let o = kiln(&args(None).iter().map(String::as_str).collect::<Vec<_>>());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("ran on cpu"), "{text}");
}

/// The real model: SmolLM2-135M, Q4_1 blocks (which the NPU declines as WeightType) and a Q8_0
/// tied embedding (which it takes, N = 49152 split into 12 contexts). The counts add up to the
/// model's matmul weights.
#[test]
#[ignore = "needs KILN_SMOLLM2: run `cargo xtask test --stage npu-plan`"]
fn plan_on_smollm2() {
    let model = std::env::var_os("KILN_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!("KILN_SMOLLM2 is not set: run `cargo xtask test --stage npu-plan`")
        });
    let f = GgufFile::open(&model).unwrap();
    let weights = kiln_runtime::sched::matmul_weights(&f);
    // 30 layers × 7 projections, plus the tied output (token_embd).
    assert_eq!(weights.len(), 30 * 7 + 1, "matmul weights in SmolLM2-135M");
    let npu_able = weights
        .iter()
        .filter(|w| match w.ty {
            GgmlType::F16 => w.k % 32 == 0 && w.n % 16 == 0,
            GgmlType::Q8_0 => w.k % 32 == 0 && w.n % 32 == 0,
            _ => false,
        })
        .count();
    let j = plan_json(&model, "1,64,512");
    check_counts(&j, weights.len(), 3);
    let t = &j["table"];
    assert_eq!(t["coverage"]["npu"]["weights"], npu_able as u64, "{t}");
    assert_eq!(
        t["coverage"]["cpu"]["weights"],
        (weights.len() - npu_able) as u64
    );
    assert_eq!(
        t["declines"]["npu"]["WeightType"]["weights"],
        (weights.len() - npu_able) as u64,
        "{t}"
    );
    assert_eq!(t["declines"]["npu"]["SmallM"]["ops"][0], npu_able as u64);

    // NPU memory: the tied output (Q8_0 576×49152 → int8, 27 MiB) against the 1 GiB default.
    let out = kiln(&["plan", model.to_str().unwrap(), "--m", "1,64,512"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    println!("{text}");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("token_embd.weight"))
        .unwrap_or_else(|| panic!("no NPU memory line for token_embd: {text}"));
    assert!(
        line.contains("Q8_0  K=576    N=49152      27.00 MiB"),
        "{line}"
    );
    assert!(line.contains("int8 per-row requant NMSE"), "{line}");
    assert!(
        text.contains("NPU total 27.00 MiB for 1 weights of budget 1024.00 MiB (997.00 MiB left"),
        "{text}"
    );
    // A 16 MiB budget cannot hold it: declined with the numbers, the CPU owns everything.
    let j = plan_json_args(&model, &["--m", "1,64,512", "--npu-budget-mib", "16"]);
    check_counts(&j, weights.len(), 3);
    assert_eq!(j["table"]["coverage"]["npu"]["weights"], 0);
    assert_eq!(
        j["table"]["declines"]["npu"]["NpuMemory"]["weights"],
        npu_able as u64
    );
    let d = j["plan"]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == "token_embd.weight")
        .unwrap()["declined"][0]["decline"]
        .clone();
    assert_eq!(
        d,
        serde_json::json!({"reason": "NpuMemory", "need": 576u64 * 49152, "left": 16u64 << 20})
    );
}

/// The int8 path's accuracy on real weights: SmolLM2's Q8_0 tied output projection, requantised
/// to per-row int8 (and activations per-row int8), against the CPU reference (dequantise, f64
/// dot) at M = 8 and M = 64, over three 4096-row slices of the 49152 rows. Activations are
/// synthetic: uniform in [-1, 1), and the same with three channels ×20 (the outliers real hidden
/// states have). Measured with the bar off (the numbers are printed for the evidence), then with
/// the bar on: an op the NPU accepts must be within llama.cpp's MUL_MAT bar (5e-4), and one it
/// refuses (`Int8Accuracy`) runs on the CPU, counted.
#[test]
#[ignore = "needs KILN_SMOLLM2: run `cargo xtask test --stage npu-plan`"]
fn int8_accuracy_on_smollm2() {
    use kiln_runtime::backend::cpu::CpuRefBackend;
    use kiln_runtime::backend::npu::INT8_BAR;
    use kiln_runtime::backend::run_checked;
    let model = std::env::var_os("KILN_SMOLLM2")
        .map(PathBuf::from)
        .expect("KILN_SMOLLM2 is not set: run `cargo xtask test --stage npu-plan`");
    let f = GgufFile::open(&model).unwrap();
    let emb = kiln_runtime::sched::matmul_weights(&f)
        .into_iter()
        .find(|w| w.name == "token_embd.weight")
        .expect("token_embd");
    assert_eq!(emb.ty, GgmlType::Q8_0);
    let row_bytes = emb.data.len() / emb.n;
    let raw = backend_with("KILN_RKNN_STANDIN", |c| c.int8_bar = f64::INFINITY);
    let npu = backend("KILN_RKNN_STANDIN");
    let cpu = CpuRefBackend;
    let log = kiln_runtime::sched::RunLog::default();
    let (mut accepted, mut refused) = (0, 0);
    for n0 in [0usize, 20480, 45056] {
        let n = 4096;
        let w = Weight {
            name: "token_embd.weight[slice]",
            ty: emb.ty,
            k: emb.k,
            n,
            data: &emb.data[n0 * row_bytes..(n0 + n) * row_bytes],
        };
        let p_raw = raw.prepare(&w).unwrap();
        let p = npu.prepare(&w).unwrap();
        for outliers in [false, true] {
            for m in [8usize, 64] {
                let mut a = values((n0 + m) as u64, m * w.k);
                if outliers {
                    for row in a.chunks_exact_mut(w.k) {
                        for ch in [3, 77, 301] {
                            row[ch] *= 20.0;
                        }
                    }
                }
                let want = cpu_reference(&w, &a, m);
                let mut c = vec![0f32; m * n];
                run_checked(&raw, &w, p_raw.as_ref(), &a, m, &mut c).unwrap();
                let e = nmse(&c, &want);
                let ran = kiln_runtime::sched::run_with_fallback(
                    &npu,
                    p.as_ref(),
                    &cpu,
                    &w,
                    &a,
                    m,
                    &mut c,
                    &log,
                )
                .unwrap();
                println!(
                    "int8 NMSE token_embd rows {n0}..{} M={m} outliers={outliers}: {e:.3e} \
                     -> with the bar: ran on {ran}",
                    n0 + n
                );
                if ran == "npu" {
                    accepted += 1;
                    assert!(e <= INT8_BAR, "accepted at NMSE {e:e}");
                } else {
                    refused += 1;
                    assert!(nmse(&c, &want) < 1e-10);
                }
            }
        }
    }
    let counts = log.counts();
    println!("{counts:?}");
    assert_eq!(
        counts.declined["npu"].get("Int8Accuracy").copied(),
        Some(refused)
    );
    assert_eq!(counts.ran.get("npu").copied().unwrap_or(0), accepted);
    assert!(
        accepted > 0,
        "plain activations are within the bar on the int8 path"
    );
}
