//! Phi-3 on the host (the comparison with llama.cpp is `llama_cpp_phi3_synthetic_logits_nll_greedy`
//! in the llama-cpp stage): a small seeded phi3 GGUF with fused `attn_qkv` and gate/up `ffn_up`
//! loads with every tensor used; the `sliding_window` key that llama.cpp's phi3 reads and switches
//! off changes nothing; `attention.scale` (ignored by llama.cpp's phi3) and LongRoPE's factor
//! tensors are refused by name; the fused halves are read in llama.cpp's order (swapping them,
//! `Fault::SwapGateUp`, changes the logits).

mod support;

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::Value;
use kiln_runtime::model::{Fault, KvType, Want};

const E: usize = 64;
const NH: usize = 4;
const NKV: usize = 2;
const HD: usize = 16;
const FF: usize = 96;
const NV: usize = 80;

fn gguf(edit: impl FnOnce(&mut Vec<(String, Value)>), extra_tensor: Option<&str>) -> Vec<u8> {
    let mut z = 0x2545_f491_4f6c_dd1du64;
    let mut vals = |n: usize, mean: f32, sd: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                mean + ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * sd * 1.7
            })
            .collect()
    };
    let mut g = GgufWriter::new();
    g.add("general.architecture", Value::String("phi3".into()))
        .unwrap();
    let mut kv: Vec<(String, Value)> = [
        ("context_length", Value::U32(64)),
        ("embedding_length", Value::U32(E as u32)),
        ("block_count", Value::U32(2)),
        ("feed_forward_length", Value::U32(FF as u32)),
        ("attention.head_count", Value::U32(NH as u32)),
        ("attention.head_count_kv", Value::U32(NKV as u32)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("rope.dimension_count", Value::U32(HD as u32)),
    ]
    .into_iter()
    .map(|(k, v)| (format!("phi3.{k}"), v))
    .collect();
    edit(&mut kv);
    for (k, v) in kv {
        g.add(k, v).unwrap();
    }
    let mut mat = |g: &mut GgufWriter, name: &str, k: usize, n: usize| {
        let v = vals(k * n, 0.0, 1.0 / (k as f32).sqrt());
        g.tensor_f32(name, &[k as u64, n as u64], &v).unwrap();
    };
    mat(&mut g, "token_embd.weight", E, NV);
    mat(&mut g, "output.weight", E, NV);
    let (qd, kvd) = (NH * HD, NKV * HD);
    for l in 0..2 {
        mat(&mut g, &format!("blk.{l}.attn_qkv.weight"), E, qd + 2 * kvd);
        mat(&mut g, &format!("blk.{l}.attn_output.weight"), qd, E);
        mat(&mut g, &format!("blk.{l}.ffn_up.weight"), E, 2 * FF);
        mat(&mut g, &format!("blk.{l}.ffn_down.weight"), FF, E);
    }
    let mut names = vec!["output_norm.weight".to_string()];
    for l in 0..2 {
        names.push(format!("blk.{l}.attn_norm.weight"));
        names.push(format!("blk.{l}.ffn_norm.weight"));
    }
    for n in names {
        let v = vals(E, 1.0, 0.2);
        g.tensor_f32(n, &[E as u64], &v).unwrap();
    }
    if let Some(name) = extra_tensor {
        let v = vals(HD / 2, 1.0, 0.0);
        g.tensor_f32(name, &[(HD / 2) as u64], &v).unwrap();
    }
    g.to_bytes()
}

fn run(bytes: &[u8], fault: Option<Fault>) -> Result<Vec<f32>, String> {
    support::with_model(bytes, fault, |m| {
        let ids: Vec<u32> = (0..24u32).map(|i| (i * 29 + 3) % NV as u32).collect();
        let mut s = m.session(ids.len(), KvType::F32).unwrap();
        m.forward(&mut s, &ids, Want::All).unwrap()
    })
}

#[test]
fn phi3_fused_weights_load_and_llama_cpp_s_ignored_keys_are_handled() {
    let plain = run(&gguf(|_| {}, None), None).unwrap();
    assert!(plain.iter().all(|v| v.is_finite()));
    let windowed = run(
        &gguf(
            |kv| kv.push(("phi3.attention.sliding_window".into(), Value::U32(4))),
            None,
        ),
        None,
    )
    .unwrap();
    assert_eq!(plain, windowed, "phi3's sliding_window changed the logits");
    assert_ne!(
        run(&gguf(|_| {}, None), Some(Fault::SwapGateUp)).unwrap(),
        plain
    );
    let e = run(
        &gguf(
            |kv| kv.push(("phi3.attention.scale".into(), Value::F32(0.25))),
            None,
        ),
        None,
    )
    .unwrap_err();
    assert!(
        e.contains("phi3.attention.scale = 0.25 (llama.cpp's phi3 ignores it"),
        "{e}"
    );
    let e = run(&gguf(|_| {}, Some("rope_factors_long.weight")), None).unwrap_err();
    assert!(
        e.contains("LongRoPE frequency factors (rope_factors_long.weight) are not implemented"),
        "{e}"
    );
    let e = run(
        &gguf(
            |kv| {
                kv.push((
                    "phi3.rope.scaling.type".into(),
                    Value::String("longrope".into()),
                ))
            },
            None,
        ),
        None,
    )
    .unwrap_err();
    assert!(e.contains("phi3.rope.scaling.type = \"longrope\""), "{e}");
}

/// The self-check's matmul known answers of a phi3 file, recorded as the image records them:
/// one row range per part of each fused weight of the first layer (`attn_qkv` = [q 64 | k 32 |
/// v 32] rows here, `ffn_up` = [gate 96 | up 96]), every range checked by `model.matmul.cpu` on
/// the mapped copy; a weight overwritten in the v part (row 112; the one range of a plain weight
/// would be rows 0..64) fails the check naming the model, the tensor and the rows.
#[test]
fn phi3_known_answers_cover_each_part_of_the_fused_weights() {
    use kiln_runtime::selftest::{model_matmul, Ctx, Paths, Status};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("models/phi3.gguf");
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let bytes = gguf(|_| {}, None);
    std::fs::write(&p, &bytes).unwrap();
    let known = model_matmul::record(&p, "phi3.gguf", model_matmul::DEFAULT_SEED).unwrap();
    let ranges = |t: &str| -> Vec<[usize; 2]> {
        known
            .iter()
            .filter(|k| k.tensor == t && k.m == 1)
            .map(|k| k.rows)
            .collect()
    };
    assert_eq!(ranges("blk.0.attn_qkv.weight"), [[0, 64], [64, 64]]);
    assert_eq!(ranges("blk.0.ffn_up.weight"), [[0, 64], [64, 64]]);
    let manifest = dir.path().join("boot/kiln/manifest.json");
    std::fs::create_dir_all(manifest.parent().unwrap()).unwrap();
    let m = serde_json::json!({"known_answers": {"matmul": known}});
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    let ctx = Ctx {
        paths: Paths::under(dir.path()),
        board: Some(
            kiln_runtime::selftest::board::Board::parse("[board]\nname = \"qemu-virt\"\n").unwrap(),
        ),
        ..Ctx::default()
    };
    let cpu = kiln_runtime::backend::cpu::CpuBackend::new();
    let o = model_matmul::check(&ctx, &cpu);
    assert_eq!(o.status, Status::Pass, "{o:?}");
    // The F32 weight's row 112 (v part): its first value overwritten with 1000.
    let g = kiln_runtime::gguf::Gguf::parse(&bytes).unwrap();
    let info = g.tensor_info("blk.0.attn_qkv.weight").unwrap();
    let at = (g.data_offset + info.offset) as usize + 112 * E * 4;
    let mut bad = bytes.clone();
    bad[at..at + 4].copy_from_slice(&1000f32.to_le_bytes());
    std::fs::write(&p, &bad).unwrap();
    let o = model_matmul::check(&ctx, &cpu);
    assert_eq!(o.status, Status::Fail, "{o:?}");
    let why = o.reason.unwrap();
    assert!(
        why.contains("mismatch: phi3.gguf blk.0.attn_qkv.weight (F32 64x128, rows 64..128, M=1)"),
        "{why}"
    );
}
