//! `model.nll.<config>`: the model-level known answer. At image build time `xtask` tokenised a
//! fixed text with the host build of this code and computed its mean NLL on the `cpu-ref` path
//! ([`record`]), for the seeded llama fixture and every `--model`; the manifest carries them
//! under `known_answers.nll`. At boot each backend configuration the board offers (`cpu`; `npu`
//! = NPU where it accepts an op, CPU for the rest) must give the same token ids exactly and the
//! mean NLL within the recorded tolerance, from the model mapped from `/models`.
//!
//! This is the field log's perplexity gate made so it cannot be dead: a wrong NPU output or a
//! flipped weight byte moves the NLL far beyond the tolerance (tests show both), and in the `npu`
//! configuration the NPU must have run some model's matmuls, or the check tested nothing.

use super::{Ctx, Outcome};
use crate::backend::Backend;
use crate::gguf::GgufFile;
use crate::model::{nll_windows, KvType, Model, Options, RunStats};
use crate::tokenizer::Tokenizer;
use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The part of the tolerance (nats of mean NLL vs `cpu-ref`) every model gets: the NPU's fp16 /
/// int8 operands (each op within the backend's 5e-4 NMSE bar) and f32 summation order. Measured
/// on the fixture: NPU stand-in 1.3e-4 to 4.2e-3, the CPU fast path 4.5e-4 to 1.9e-3.
pub const TOLERANCE_FLOOR: f64 = 0.02;
/// The fast CPU path quantises activations to 8 bits (as ggml's `vec_dot_type`), the reference
/// does not: a gap that grows with depth (SmolLM2's 30 Q4_1 layers: 0.026 nats). It is measured
/// at build time on the host and added to the floor this many times over; the board's CPU path
/// computes the same integer dots and differs from the host's only in f32 summation order.
pub const FAST_PATH_GAP_FACTOR: f64 = 2.0;
pub const WHY: &str = "|Δ mean NLL| vs cpu-ref ≤ 0.02 (NPU fp16/int8 operands within 5e-4 NMSE \
    per op, f32 summation order: ≤ 4.2e-3 measured) + 2 × the gap between the host's fast CPU \
    path (8-bit activations, as ggml) and cpu-ref measured at build time; a wrong NPU output or \
    a flipped weight exponent moves it by whole nats";

/// The tolerance for a model whose fast CPU path differs from `cpu-ref` by `gap` on the host,
/// rounded up to 1e-4 so the manifest shows a short number.
pub fn tolerance(gap: f64) -> f64 {
    ((TOLERANCE_FLOOR + FAST_PATH_GAP_FACTOR * gap.abs()) * 1e4).ceil() / 1e4
}

/// One recorded known answer, as the manifest holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NllAnswer {
    /// File name on the models partition.
    pub model: String,
    pub text: String,
    /// The token ids of `text` (BOS and specials as the file says, as `kiln tokenize`).
    pub tokens: Vec<u32>,
    /// Tokens scored: all after the first, each from all earlier ones (one window).
    pub scored: usize,
    pub mean_nll: f64,
    /// The path that computed `mean_nll` at build time.
    pub backend: String,
    /// The host's fast CPU path on the same tokens, at build time (sets the tolerance).
    pub host_cpu_mean_nll: f64,
    pub kv: String,
    pub tolerance: f64,
    pub why: String,
}

impl NllAnswer {
    /// One line of what the build recorded: tokens, both NLLs, the tolerance.
    pub fn summary(&self) -> String {
        format!(
            "{}: {} tokens, mean NLL {:.6} on {}, {:.6} on the host's fast CPU path, tolerance {:.4}",
            self.model,
            self.tokens.len(),
            self.mean_nll,
            self.backend,
            self.host_cpu_mean_nll,
            self.tolerance
        )
    }
}

/// What one configuration measured on one model.
#[derive(Clone, Debug)]
pub struct Measured {
    pub tokens: Vec<u32>,
    pub scored: usize,
    pub mean_nll: f64,
    pub stats: RunStats,
}

/// Tokenise `text` and compute its mean NLL on `f` with `backends` (board order), the whole
/// text as one window, f16 KV cache (kiln's and llama.cpp's default).
pub fn measure(f: &GgufFile, text: &str, backends: Vec<Box<dyn Backend>>) -> Result<Measured> {
    let path = f.path().display().to_string();
    let tok = Tokenizer::from_gguf(f.gguf()).with_context(|| format!("{path}: tokenizer"))?;
    let tokens = tok
        .encode(text, true, true)
        .with_context(|| format!("{path}: tokenising the known-answer text"))?;
    ensure!(
        tokens.len() >= 2,
        "{path}: the text gives {} token(s), nothing to score",
        tokens.len()
    );
    let model = Model::load_with(f, &Options::default(), backends)
        .with_context(|| format!("{path}: loading the model"))?;
    let mut s = model.session(tokens.len(), KvType::F16)?;
    let (scored, sum) = nll_windows(&model, &mut s, &tokens, tokens.len())
        .with_context(|| format!("{path}: forward pass over the known-answer text"))?;
    ensure!(scored > 0, "{path}: nothing scored");
    Ok(Measured {
        tokens,
        scored,
        mean_nll: sum / scored as f64,
        stats: s.stats,
    })
}

/// The build-time answer for the model at `path` (named `name` on the models partition), on the
/// scalar reference path.
pub fn record(path: &Path, name: &str, text: &str) -> Result<NllAnswer> {
    let f = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let m = measure(&f, text, vec![Box::new(crate::backend::cpu::CpuRefBackend)])?;
    let fast = measure(
        &f,
        text,
        vec![Box::new(crate::backend::cpu::CpuBackend::new())],
    )?;
    ensure!(
        fast.tokens == m.tokens && fast.mean_nll.is_finite() && m.mean_nll.is_finite(),
        "{}: the fast CPU path and cpu-ref disagree on tokens or give a non-finite NLL \
         ({} vs {})",
        path.display(),
        fast.mean_nll,
        m.mean_nll
    );
    Ok(NllAnswer {
        model: name.to_string(),
        text: text.to_string(),
        tokens: m.tokens,
        scored: m.scored,
        mean_nll: m.mean_nll,
        backend: "cpu-ref".into(),
        host_cpu_mean_nll: fast.mean_nll,
        kv: "f16".into(),
        tolerance: tolerance(fast.mean_nll - m.mean_nll),
        why: WHY.into(),
    })
}

/// The recorded answers (the mapped models slot's own, or the manifest's for the factory slot:
/// [`super::known::answers`]), or the outcome to report without them.
fn answers(ctx: &Ctx) -> Result<(Vec<NllAnswer>, String), Outcome> {
    let k = super::known::answers(ctx)?;
    let list = &k.answers["nll"];
    if list.is_null() {
        return Err(Outcome::fail(
            format!(
                "{}: no known_answers.nll (the build recorded no model-level known answer)",
                k.source
            ),
            vec![],
        ));
    }
    let a: Vec<NllAnswer> = serde_json::from_value(list.clone())
        .map_err(|e| Outcome::fail(format!("{}: known_answers.nll: {e}", k.source), vec![]))?;
    if a.is_empty() {
        return Err(Outcome::fail(
            format!("{}: known_answers.nll is empty", k.source),
            vec![],
        ));
    }
    Ok((a, k.source))
}

fn find_model(ctx: &Ctx, name: &str) -> Option<PathBuf> {
    ctx.paths
        .models
        .iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// One configuration over every recorded answer. `make` gives the configuration's backends in
/// board order (fresh per model); `npu` names the backend that must have run ops (`None` for
/// the CPU configuration).
pub fn check(
    ctx: &Ctx,
    config: &str,
    make: &dyn Fn() -> Vec<Box<dyn Backend>>,
    npu: Option<&str>,
) -> Outcome {
    let (answers, source) = match answers(ctx) {
        Ok(a) => a,
        Err(o) => return o,
    };
    let mut evidence = vec![format!("known answers from {source}")];
    let mut failures = Vec::new();
    let mut npu_ran = false;
    for a in &answers {
        let Some(path) = find_model(ctx, &a.model) else {
            failures.push(format!("model {} is not on the models partition", a.model));
            continue;
        };
        let f = match GgufFile::open(&path) {
            Ok(f) => f,
            Err(e) => {
                failures.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        let m = match measure(&f, &a.text, make()) {
            Ok(m) => m,
            Err(e) => {
                failures.push(format!("{} [{config}]: {e:#}", a.model));
                continue;
            }
        };
        if m.tokens != a.tokens {
            let i = m
                .tokens
                .iter()
                .zip(&a.tokens)
                .position(|(x, y)| x != y)
                .unwrap_or(m.tokens.len().min(a.tokens.len()));
            failures.push(format!(
                "{} [{config}]: token ids differ from the build's at index {i} ({} vs {} tokens)",
                a.model,
                m.tokens.len(),
                a.tokens.len()
            ));
            continue;
        }
        let d = (m.mean_nll - a.mean_nll).abs();
        let ops: Vec<String> = m
            .stats
            .ops
            .iter()
            .map(|(b, (ops, rows))| format!("{b} {ops} ops/{rows} rows"))
            .collect();
        let declined: u64 = m.stats.declined.values().sum();
        let line = format!(
            "{} [{config}]: {} tokens equal, mean NLL {:.6} vs recorded {:.6} ({}), |Δ| {:.2e} \
             (tolerance {:.4}); ran: {}{}",
            a.model,
            m.tokens.len(),
            m.mean_nll,
            a.mean_nll,
            a.backend,
            d,
            a.tolerance,
            ops.join(", "),
            if declined > 0 {
                format!("; {declined} run-time refusal(s) fell back")
            } else {
                String::new()
            }
        );
        // A NaN NLL (or tolerance) fails too.
        if d.is_nan() || a.tolerance.is_nan() || d > a.tolerance {
            failures.push(format!(
                "{} [{config}]: mean NLL {:.6}, the build recorded {:.6} (|Δ| {:.3e} > {:.4})",
                a.model, m.mean_nll, a.mean_nll, d, a.tolerance
            ));
        }
        if let Some(n) = npu {
            npu_ran |= m.stats.ops.contains_key(n);
        }
        evidence.push(line);
    }
    // A model may keep every op off the NPU (SmolLM2's Q8_0 head is refused at run time as
    // `Int8Accuracy`: the evidence line counts the refusals), but the configuration must have
    // run some model's matmuls on the NPU — the fixture's F16/Q8_0 prefill — or it tested nothing.
    if let Some(n) = npu {
        if !npu_ran && failures.is_empty() {
            failures.push(format!(
                "[{config}]: {n} ran none of the matmuls of any model: this configuration tested \
                 only the CPU"
            ));
        }
    }
    if failures.is_empty() {
        Outcome::pass(evidence)
    } else {
        Outcome::fail(failures.join("; "), evidence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::fixture;
    use crate::selftest::testutil::FakeRoot;
    use crate::selftest::Paths;

    pub const TEXT: &str = "The kiln board reads this text at every boot, and the model gives \
        the same numbers the build said it would.";

    fn cpu() -> Vec<Box<dyn Backend>> {
        vec![Box::new(CpuBackend::new())]
    }

    /// A fake root with the fixture on /models and a manifest recording its answer.
    fn root_with(fixture_bytes: &[u8]) -> (FakeRoot, Ctx, NllAnswer) {
        let r = FakeRoot::new();
        let good = r.file("host/fixture.gguf", fixture::gguf().unwrap());
        let a = record(&good, fixture::FILE_NAME, TEXT).unwrap();
        r.file(&format!("models/{}", fixture::FILE_NAME), fixture_bytes);
        r.file(
            "boot/kiln/manifest.json",
            serde_json::to_vec(&serde_json::json!({"known_answers": {"nll": [a]}})).unwrap(),
        );
        let ctx = Ctx {
            paths: Paths::under(&r),
            ..Ctx::default()
        };
        (r, ctx, a)
    }

    #[test]
    fn cpu_reproduces_the_recorded_answer() {
        let (_r, ctx, a) = root_with(&fixture::gguf().unwrap());
        let o = check(&ctx, "cpu", &cpu, None);
        assert_eq!(o.status, super::super::Status::Pass, "{o:?}");
        eprintln!(
            "recorded {:.6} over {} tokens; {:?}",
            a.mean_nll,
            a.tokens.len(),
            o.evidence
        );
    }

    #[test]
    fn an_npu_configuration_where_the_npu_ran_nothing_fails() {
        let (_r, ctx, _) = root_with(&fixture::gguf().unwrap());
        let o = check(&ctx, "npu+cpu", &cpu, Some("npu"));
        assert_eq!(o.status, super::super::Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("npu ran none"));
    }

    #[test]
    fn flipped_weight_byte_fails() {
        let mut bytes = fixture::gguf().unwrap();
        let g = crate::gguf::Gguf::parse(&bytes).unwrap();
        let t = g.tensor_info("blk.0.attn_q.weight").unwrap();
        // The high byte of the first F16 weight: bit 6 is the exponent's top bit.
        let at = (g.data_offset + t.offset) as usize + 1;
        bytes[at] ^= 0x40;
        let (_r, ctx, _) = root_with(&bytes);
        let o = check(&ctx, "cpu", &cpu, None);
        assert_eq!(o.status, super::super::Status::Fail, "{o:?}");
        let why = o.reason.unwrap();
        assert!(
            why.contains(fixture::FILE_NAME) && why.contains("[cpu]"),
            "{why}"
        );
        eprintln!("flipped byte: {why}");
    }

    #[test]
    fn changed_text_fails_on_token_ids() {
        let (r, ctx, mut a) = root_with(&fixture::gguf().unwrap());
        a.tokens[3] += 1;
        r.file(
            "boot/kiln/manifest.json",
            serde_json::to_vec(&serde_json::json!({"known_answers": {"nll": [a]}})).unwrap(),
        );
        let o = check(&ctx, "cpu", &cpu, None);
        assert!(o.reason.unwrap().contains("token ids differ"));
    }

    #[test]
    fn missing_answers_fail_on_a_board() {
        let (r, mut ctx, _) = root_with(&fixture::gguf().unwrap());
        r.file("boot/kiln/manifest.json", b"{\"kiln_manifest\": 1}");
        assert_eq!(
            check(&ctx, "cpu", &cpu, None).status,
            super::super::Status::Fail
        );
        r.remove("boot/kiln/manifest.json");
        assert_eq!(
            check(&ctx, "cpu", &cpu, None).status,
            super::super::Status::Skip
        );
        ctx.board = Some(crate::selftest::board::Board::parse("[board]\nname = \"t\"\n").unwrap());
        assert_eq!(
            check(&ctx, "cpu", &cpu, None).status,
            super::super::Status::Fail
        );
    }
}
