//! `model.matmul.<backend>`: known answers of the real weights on the models partition.
//!
//! At image build time `xtask` calls [`record`] on every model it puts on the models partition:
//! for a few real weights (one per weight type present, and the largest one, the LM head), it
//! computes `C = A·Wᵀ` with the scalar reference (`cpu-ref`) for M = 1 and M = 8, over all of K
//! and a recorded range of output rows, with activations drawn from a recorded seed. The values
//! go into the manifest under `known_answers.matmul`, with their sha256 and the tolerance.
//!
//! At boot, [`check`] recomputes each one with a backend of the board, from the weight's bytes
//! in the model *as mapped from /models*, and compares: a corrupt tensor on the card is a FAIL
//! that names the model, the tensor, the backend and the error against the tolerance.

use super::{Ctx, Outcome};
use crate::backend::cpu::CpuRefBackend;
use crate::backend::{run_checked, Backend, MatmulOp, Weight};
use crate::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeMap;
use std::path::Path;

/// Row counts of the known answers: decode and prefill.
pub const MS: [usize; 2] = [1, 8];
/// Output rows taken from a weight with more: a multiple of 64, so the NPU's N alignment
/// (16 fp16 / 32 int8 / 64 int4) holds for the subset as for the whole weight.
pub const ROWS: usize = 64;
/// The seed recorded when the build gives none of its own.
pub const DEFAULT_SEED: u64 = 0x6b69_6c6e_6d6d; // "kilnmm"

/// How close a backend must come to the reference. NMSE over all outputs of one case, and the
/// largest single error relative to the root mean square of the expected outputs. The NPU's
/// int8 path declines ops whose estimated NMSE exceeds 5e-4, so 2e-3 leaves it room; a flipped
/// scale or a wrong row goes far past both.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    pub nmse: f64,
    pub max_err_over_rms: f64,
}

pub const TOLERANCE: Tolerance = Tolerance {
    nmse: 2e-3,
    max_err_over_rms: 0.25,
};

/// One known answer, as recorded in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KnownMatmul {
    /// The model's file name on the models partition.
    pub model: String,
    pub tensor: String,
    /// ggml type name, as `kiln inspect` prints it.
    #[serde(rename = "type")]
    pub ty: String,
    pub k: usize,
    /// The weight's N (all its output rows).
    pub n: usize,
    /// The output rows computed: `[first, count]`.
    pub rows: [usize; 2],
    pub m: usize,
    /// Seed of the activations ([`activations`]).
    pub seed: u64,
    pub tolerance: Tolerance,
    /// sha256 of `expected` as little-endian f32 bytes.
    pub sha256: String,
    /// `m × rows[1]` outputs, row-major.
    pub expected: Vec<f32>,
}

/// Activations for `m` rows of `k` from `seed`: splitmix64, each value a multiple of 2⁻²³ in
/// [-1, 1), so host and board draw the same f32 bits.
pub fn activations(seed: u64, m: usize, k: usize) -> Vec<f32> {
    let mut s = seed;
    (0..m * k)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as i64 - (1 << 23)) as f32 / (1u32 << 23) as f32
        })
        .collect()
}

/// sha256 of f32 values as little-endian bytes, hex.
pub fn digest(values: &[f32]) -> String {
    let mut h = sha2::Sha256::new();
    for v in values {
        h.update(v.to_le_bytes());
    }
    hex::encode(h.finalize())
}

/// The weights whose answers are recorded: the model's matmul weights (every 2-D weight when it
/// has none by name, as the self-check fixture), the first of each type and the largest one; and
/// the first layer's fused projections (phi3's `attn_qkv` = [q | k | v], its `ffn_up` =
/// [gate | up]), whichever type they are.
fn chosen<'f>(f: &'f GgufFile) -> Vec<Weight<'f>> {
    let mut all = crate::sched::matmul_weights(f);
    if all.is_empty() {
        all = f.tensors().filter_map(|t| t.as_weight()).collect();
    }
    let mut out: Vec<Weight<'f>> = Vec::new();
    for w in &all {
        if !out.iter().any(|o| o.ty == w.ty) {
            out.push(*w);
        }
    }
    if let Some(big) = all.iter().max_by_key(|w| w.data.len()) {
        if !out.iter().any(|o| o.name == big.name) {
            out.push(*big);
        }
    }
    for w in &all {
        if !fused_parts(f, w).is_empty() && !out.iter().any(|o| o.name == w.name) {
            out.push(*w);
        }
    }
    out
}

/// The output-row parts of a fused weight of the first layer, from the file's hyper-parameters:
/// `attn_qkv` = [q_dim, kv_dim, kv_dim], a fused `ffn_up` (N = 2 × feed_forward_length) =
/// [n_ff, n_ff]; empty for any other weight (or a file without a model's metadata).
fn fused_parts(f: &GgufFile, w: &Weight<'_>) -> Vec<usize> {
    if !w.name.starts_with("blk.0.") {
        return Vec::new();
    }
    let Ok(hp) = crate::model::HParams::from_gguf(f.gguf()) else {
        return Vec::new();
    };
    let parts = match w.name {
        "blk.0.attn_qkv.weight" => vec![hp.q_dim(), hp.kv_dim(), hp.kv_dim()],
        "blk.0.ffn_up.weight" if w.n == 2 * hp.n_ff => vec![hp.n_ff, hp.n_ff],
        _ => return Vec::new(),
    };
    if parts.iter().sum::<usize>() == w.n {
        parts
    } else {
        Vec::new()
    }
}

/// The recorded row ranges of `w`: one ([`row_range`]) for a plain weight; for a fused one, one
/// per part: [`ROWS`] rows (fewer only where the weight ends) from a multiple of 64 at or below
/// the part's middle rows, so that every projection sharing the weight is checked and not only
/// the part that holds the weight's middle rows (parts narrower than that share a range).
fn row_ranges(f: &GgufFile, w: &Weight<'_>) -> Vec<[usize; 2]> {
    let parts = fused_parts(f, w);
    if parts.is_empty() {
        return vec![row_range(w.n)];
    }
    let mut out = Vec::new();
    let mut at = 0;
    for len in parts {
        let first = (at + len.saturating_sub(ROWS) / 2) & !63;
        let first = first.min(w.n.saturating_sub(ROWS) & !63);
        let range = [first, ROWS.min(w.n - first)];
        if !out.contains(&range) {
            out.push(range);
        }
        at += len;
    }
    out
}

/// `rows` of `w`: a view into the same bytes.
fn rows_of<'w>(w: &Weight<'w>, rows: [usize; 2]) -> Result<Weight<'w>> {
    let rb =
        w.ty.row_bytes(w.k as u64)
            .and_then(|b| usize::try_from(b).ok())
            .with_context(|| {
                format!(
                    "{}: K = {} is not whole {} blocks",
                    w.name,
                    w.k,
                    w.ty.name()
                )
            })?;
    let [first, count] = rows;
    let end = first.checked_add(count).filter(|e| *e <= w.n);
    let Some(end) = end else {
        bail!("{}: rows {first}..+{count} outside N = {}", w.name, w.n);
    };
    let data = w
        .data
        .get(first * rb..end * rb)
        .with_context(|| format!("{}: rows {first}..{end} outside its data", w.name))?;
    Ok(Weight {
        n: count,
        data,
        ..*w
    })
}

/// The recorded row range for a weight of `n` rows: all of them up to [`ROWS`], else [`ROWS`]
/// from the middle (rounded down to a multiple of 64).
fn row_range(n: usize) -> [usize; 2] {
    if n <= ROWS {
        [0, n]
    } else {
        [((n - ROWS) / 2) & !63, ROWS]
    }
}

/// Compute the known answers of the model at `path`, named `model` on the models partition,
/// with the scalar reference.
pub fn record(path: &Path, model: &str, seed: u64) -> Result<Vec<KnownMatmul>> {
    let f = GgufFile::open(path).with_context(|| format!("model {}", path.display()))?;
    let reference = CpuRefBackend;
    let mut out = Vec::new();
    for (w, rows) in chosen(&f)
        .into_iter()
        .flat_map(|w| row_ranges(&f, &w).into_iter().map(move |r| (w, r)))
    {
        let sub = rows_of(&w, rows)?;
        reference
            .supports(&MatmulOp::for_weight(&sub, 1))
            .map_err(|d| anyhow::anyhow!("cpu-ref declines {} of {model}: {d}", w.name))?;
        let prepared = reference.prepare(&sub)?;
        for m in MS {
            let a = activations(seed, m, w.k);
            let mut c = vec![0f32; m * sub.n];
            run_checked(&reference, &sub, prepared.as_ref(), &a, m, &mut c)
                .with_context(|| format!("known answer of {} in {model}, M = {m}", w.name))?;
            out.push(KnownMatmul {
                model: model.to_string(),
                tensor: w.name.to_string(),
                ty: w.ty.name().to_string(),
                k: w.k,
                n: w.n,
                rows,
                m,
                seed,
                tolerance: TOLERANCE,
                sha256: digest(&c),
                expected: c,
            });
        }
    }
    Ok(out)
}

/// How far `got` is from `want`: (NMSE, largest |error| / rms(want)).
pub fn error(got: &[f32], want: &[f32]) -> (f64, f64) {
    let (mut se, mut ss, mut max) = (0f64, 0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let e = (*g as f64 - *w as f64).abs();
        se += e * e;
        ss += (*w as f64) * (*w as f64);
        max = max.max(if e.is_nan() { f64::INFINITY } else { e });
    }
    let n = want.len().max(1) as f64;
    let rms = (ss / n).sqrt();
    if ss == 0.0 {
        return (if se == 0.0 { 0.0 } else { f64::INFINITY }, max);
    }
    (se / ss, max / rms)
}

/// The known answers (the mapped models slot's own, or the manifest's for the factory slot:
/// [`super::known::answers`]), `Err` as the outcome to give when there are none to check.
fn recorded(ctx: &Ctx) -> Result<(Vec<KnownMatmul>, String), Outcome> {
    let k = super::known::answers(ctx)?;
    let Some(list) = k.answers.get("matmul") else {
        let why = format!("{} records no known_answers.matmul", k.source);
        return Err(if ctx.board.is_some() {
            Outcome::fail(why, vec![])
        } else {
            Outcome::skip(why)
        });
    };
    let list = serde_json::from_value(list.clone())
        .map_err(|e| Outcome::fail(format!("{}: known_answers.matmul: {e}", k.source), vec![]))?;
    Ok((list, k.source))
}

/// One case against one backend: `Ok(Some(line))` computed and within tolerance, `Ok(None)`
/// declined (the reason pushed to `declined`), `Err(line)` a mismatch or an error.
fn one(
    f: &GgufFile,
    backend: &dyn Backend,
    km: &KnownMatmul,
    declined: &mut Vec<String>,
) -> Result<Option<String>, String> {
    let what = format!(
        "{} {} ({} {}x{}, rows {}..{}, M={})",
        km.model,
        km.tensor,
        km.ty,
        km.k,
        km.n,
        km.rows[0],
        km.rows[0] + km.rows[1],
        km.m
    );
    if digest(&km.expected) != km.sha256 || km.expected.len() != km.m * km.rows[1] {
        return Err(format!(
            "{what}: the recorded expected values do not match their sha256 {}",
            km.sha256
        ));
    }
    let w = f
        .tensor(&km.tensor)
        .and_then(|t| t.as_weight())
        .ok_or_else(|| format!("{what}: no 2-D tensor {} in the model", km.tensor))?;
    if w.ty.name() != km.ty || w.k != km.k || w.n != km.n {
        return Err(format!(
            "{what}: the model has {} {}x{}, the known answer recorded {} {}x{}",
            w.ty.name(),
            w.k,
            w.n,
            km.ty,
            km.k,
            km.n
        ));
    }
    // Owned by this backend in the plan (the whole weight), and the subset runs there too.
    for op in [
        MatmulOp::for_weight(&w, km.m),
        MatmulOp {
            n: km.rows[1],
            ..MatmulOp::for_weight(&w, km.m)
        },
    ] {
        if let Err(d) = backend.supports(&op) {
            declined.push(format!("{} M={}: {d}", km.tensor, km.m));
            return Ok(None);
        }
    }
    let sub = rows_of(&w, km.rows).map_err(|e| format!("{what}: {e:#}"))?;
    let prepared = backend
        .prepare(&sub)
        .map_err(|e| format!("{what}: {} prepare: {e:#}", backend.name()))?;
    let a = activations(km.seed, km.m, km.k);
    let mut c = vec![0f32; km.m * km.rows[1]];
    run_checked(backend, &sub, prepared.as_ref(), &a, km.m, &mut c)
        .map_err(|e| format!("{what}: {e:#}"))?;
    let (nmse, max) = error(&c, &km.expected);
    let t = km.tolerance;
    let line = format!(
        "{what}: {} NMSE {nmse:.2e} (tolerance {:.0e}), max error {max:.3} of rms (tolerance {})",
        backend.name(),
        t.nmse,
        t.max_err_over_rms
    );
    if nmse <= t.nmse && max <= t.max_err_over_rms {
        Ok(Some(line))
    } else {
        Err(format!("mismatch: {line}"))
    }
}

/// `model.matmul.<backend>`: every known answer in the manifest, recomputed with `backend` from
/// the models on the models folders (mapped, as the model loader maps them).
pub fn check(ctx: &Ctx, backend: &dyn Backend) -> Outcome {
    if let Err(d) = backend.probe() {
        return Outcome::skip(format!("{} is not usable here: {d}", backend.name()));
    }
    let (known, source) = match recorded(ctx) {
        Ok(k) => k,
        Err(o) => return o,
    };
    let on_card: BTreeMap<String, std::path::PathBuf> = super::models::find_models(ctx)
        .into_iter()
        .filter_map(|p| Some((p.file_name()?.to_str()?.to_string(), p)))
        .collect();
    let mut by_model: BTreeMap<&str, Vec<&KnownMatmul>> = BTreeMap::new();
    for k in &known {
        by_model.entry(k.model.as_str()).or_default().push(k);
    }
    let mut failures = Vec::new();
    for name in on_card.keys() {
        if !by_model.contains_key(name.as_str()) {
            failures.push(format!(
                "{name}: on the models partition, but the known answers record none for it"
            ));
        }
    }
    let (mut ok, mut declined) = (Vec::new(), Vec::new());
    for (model, cases) in &by_model {
        let Some(path) = on_card.get(*model) else {
            failures.push(format!(
                "{model}: has known answers, but is not on the models partition"
            ));
            continue;
        };
        let f = match GgufFile::open(path) {
            Ok(f) => f,
            Err(e) => {
                failures.push(format!("{model}: {e:#}"));
                continue;
            }
        };
        for km in cases {
            match one(&f, backend, km, &mut declined) {
                Ok(Some(line)) => ok.push(line),
                Ok(None) => {}
                Err(e) => failures.push(e),
            }
        }
    }
    let mut ev = ok;
    if !declined.is_empty() {
        ev.push(format!(
            "{} declined {} case(s): {}",
            backend.name(),
            declined.len(),
            declined.join("; ")
        ));
    }
    if !failures.is_empty() {
        let reason = format!(
            "{} of {} known answer(s) wrong on {}: {}",
            failures.len(),
            known.len(),
            backend.name(),
            failures.join("; ")
        );
        ev.insert(0, format!("known answers from {source}"));
        return Outcome::fail(reason, ev);
    }
    if ev.len() == usize::from(!declined.is_empty()) {
        return Outcome::skip(format!(
            "{} owns none of the {} known answer(s): {}",
            backend.name(),
            known.len(),
            declined.join("; ")
        ));
    }
    ev.insert(0, format!("known answers from {source}"));
    Outcome::pass(ev)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::FakeRoot;
    use super::super::{Paths, Status};
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::gguf::writer::GgufWriter;
    use crate::quant::{quantize_to_vec, GgmlType};

    /// A small model with three weight types; `output.weight` (Q8_0, 256 rows) is the largest.
    fn model_bytes() -> Vec<u8> {
        let mut g = GgufWriter::new();
        let vals = |n: usize, s: u64| activations(s, 1, n);
        let k = 64;
        g.tensor_f32("blk.0.attn_q.weight", &[k as u64, 32], &vals(k * 32, 1))
            .unwrap();
        let q4 = quantize_to_vec(GgmlType::Q4_0, &vals(k * 64, 2)).unwrap();
        g.tensor("blk.0.ffn_up.weight", GgmlType::Q4_0, &[k as u64, 64], q4)
            .unwrap();
        let q8 = quantize_to_vec(GgmlType::Q8_0, &vals(k * 256, 3)).unwrap();
        g.tensor("output.weight", GgmlType::Q8_0, &[k as u64, 256], q8)
            .unwrap();
        g.to_bytes()
    }

    fn ctx(root: &FakeRoot) -> Ctx {
        Ctx {
            paths: Paths::under(root),
            board: Some(
                super::super::board::Board::parse("[board]\nname = \"qemu-virt\"\n").unwrap(),
            ),
            ..Ctx::default()
        }
    }

    fn manifest(root: &FakeRoot, known: &[KnownMatmul]) {
        let v = serde_json::json!({"known_answers": {"matmul": known}});
        root.file("boot/kiln/manifest.json", serde_json::to_vec(&v).unwrap());
    }

    #[test]
    fn activations_are_fixed_bits() {
        let a = activations(DEFAULT_SEED, 1, 4);
        let b = activations(DEFAULT_SEED, 1, 4);
        assert_eq!(a, b);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        assert_ne!(a, activations(DEFAULT_SEED + 1, 1, 4));
    }

    #[test]
    fn records_one_per_type_and_the_largest_with_a_row_subset() {
        let root = FakeRoot::new();
        let p = root.file("models/m.gguf", model_bytes());
        let known = record(&p, "m.gguf", 7).unwrap();
        let names: Vec<(&str, usize)> = known.iter().map(|k| (k.tensor.as_str(), k.m)).collect();
        assert_eq!(
            names,
            [
                ("blk.0.attn_q.weight", 1),
                ("blk.0.attn_q.weight", 8),
                ("blk.0.ffn_up.weight", 1),
                ("blk.0.ffn_up.weight", 8),
                ("output.weight", 1),
                ("output.weight", 8),
            ]
        );
        let head = &known[5];
        assert_eq!(head.rows, [64, 64]);
        assert_eq!(head.expected.len(), 8 * 64);
        // Independent of the backends: dequantise with the quant module's whole-tensor path
        // and take f64 dots by hand.
        let f = GgufFile::open(&p).unwrap();
        let w = f.tensor("output.weight").unwrap().to_f32().unwrap();
        let a = activations(7, 8, 64);
        for i in [0, 3, 7] {
            for r in [0, 17, 63] {
                let row = &w[(64 + r) * 64..(65 + r) * 64];
                let dot: f64 = row
                    .iter()
                    .zip(&a[i * 64..(i + 1) * 64])
                    .map(|(x, y)| *x as f64 * *y as f64)
                    .sum();
                assert_eq!(head.expected[i * 64 + r], dot as f32);
            }
        }
    }

    #[test]
    fn the_mapped_model_matches_and_a_flipped_byte_fails_naming_the_tensor() {
        let root = FakeRoot::new();
        let bytes = model_bytes();
        let p = root.file("models/m.gguf", &bytes);
        manifest(&root, &record(&p, "m.gguf", 7).unwrap());
        let cpu = CpuBackend::new();
        let o = check(&ctx(&root), &cpu);
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert_eq!(o.evidence.len(), 7, "{o:?}");
        assert!(o.evidence[0].starts_with("known answers from "), "{o:?}");

        // Flip the high byte of a block scale inside the recorded rows of output.weight.
        let f = GgufFile::open(&p).unwrap();
        let t = f.tensor("output.weight").unwrap();
        let at = t.data.as_ptr() as usize - f.bytes().as_ptr() as usize + 64 * 2 * 34 + 1;
        drop(f);
        let mut bad = bytes.clone();
        bad[at] ^= 0x10;
        root.file("models/m.gguf", &bad);
        let o = check(&ctx(&root), &cpu);
        assert_eq!(o.status, Status::Fail, "{o:?}");
        let reason = o.reason.unwrap();
        // One block of 32 weights in one row is 16x off: the prefill case (M = 8) sees it.
        assert!(
            reason.contains("mismatch: m.gguf output.weight (Q8_0 64x256, rows 64..128, M=8)"),
            "{reason}"
        );
        assert!(
            reason.contains("mismatch: ") && reason.contains("cpu NMSE"),
            "{reason}"
        );
        assert!(!reason.contains("ffn_up"), "{reason}");
    }

    #[test]
    fn missing_answers_models_and_edited_values_fail() {
        let root = FakeRoot::new();
        let p = root.file("models/m.gguf", model_bytes());
        let cpu = CpuBackend::new();
        // No manifest on a board: FAIL; on the host: SKIP.
        assert_eq!(check(&ctx(&root), &cpu).status, Status::Fail);
        let host = Ctx {
            paths: Paths::under(&root),
            ..Ctx::default()
        };
        assert_eq!(check(&host, &cpu).status, Status::Skip);
        // A model on the card with no answers.
        manifest(&root, &[]);
        let o = check(&ctx(&root), &cpu);
        assert!(
            o.reason
                .as_deref()
                .unwrap()
                .contains("m.gguf: on the models partition, but the known answers record none"),
            "{o:?}"
        );
        // An edited expected value breaks its digest.
        let mut known = record(&p, "m.gguf", 7).unwrap();
        known[0].expected[0] += 1.0;
        manifest(&root, &known);
        let o = check(&ctx(&root), &cpu);
        assert!(
            o.reason
                .as_deref()
                .unwrap()
                .contains("do not match their sha256"),
            "{o:?}"
        );
        // Answers for a model that is not there.
        root.remove("models/m.gguf");
        root.file("models/other.gguf", model_bytes());
        let o = check(&ctx(&root), &cpu);
        assert!(
            o.reason
                .as_deref()
                .unwrap()
                .contains("m.gguf: has known answers, but is not on the models partition"),
            "{o:?}"
        );
    }
}
