//! `kiln plan` and `kiln matmul` from outside, on a file written by kiln's GGUF writer and (with
//! `KILN_SMOLLM2`, stage `npu-plan-smollm2`) on the SmolLM2 model; the NPU is rknn-standin.

mod support;

mod npu_common;

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::{GgufFile, Value};
use kiln_runtime::quant::{quantize_to_vec, GgmlType};
use npu_common::*;
use serde_json::Value as J;
use std::path::{Path, PathBuf};
use std::process::Output;

/// `kiln`, through the cargo runner when the tests run as aarch64 code under qemu-user.
fn kiln(args: &[&str]) -> Output {
    support::kiln_cmd()
        .args(args)
        .env("KILN_RKNN_LIB", standin("KILN_RKNN_STANDIN"))
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
    let out = kiln(&["plan", file.to_str().unwrap(), "--m", ms, "--json"]);
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
}
