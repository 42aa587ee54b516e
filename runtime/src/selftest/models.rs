//! `model.mmap` and `coverage`: every GGUF on the models folders opens over mmap, the ownership
//! ledger shows each backend's weights arrived without a copy, and the plan says which backend
//! runs each matmul and why the others declined.

use super::{Ctx, Outcome};
use crate::backend::{Backend, Capabilities, Decline, MatmulOp, PreparedWeight, Weight};
use crate::gguf::GgufFile;
use crate::ledger::Arrival;
use crate::sched;
use std::path::PathBuf;

/// Row counts the plan is made for: decode and prefill.
pub const PLAN_MS: [usize; 2] = [1, 8];

/// `*.gguf` directly in each models folder, sorted; missing folders are skipped.
pub fn find_models(ctx: &Ctx) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in &ctx.paths.models {
        let mut here: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
                    && p.is_file()
            })
            .collect();
        here.sort();
        out.extend(here);
    }
    out
}

/// The self-check's own fault hook (`KILN_SELFTEST_INJECT=copy`): a backend that copies the
/// weight into memory it owns and *declares* it borrowed, even naming the mapping's address
/// range as what it reads. Only the measurement can catch it: the copy is still allocated when
/// `prepare` returns.
pub struct CopyingBackend<'b> {
    pub inner: &'b dyn Backend,
}

struct CopiedWeight {
    bytes: Vec<u8>,
    claimed: std::ops::Range<usize>,
}

impl PreparedWeight for CopiedWeight {
    fn arrival(&self) -> Arrival {
        Arrival::Borrowed
    }
    fn reads_from(&self) -> Option<std::ops::Range<usize>> {
        Some(self.claimed.clone())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Backend for CopyingBackend<'_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn probe(&self) -> Result<Capabilities, Decline> {
        self.inner.probe()
    }
    fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
        self.inner.supports(op)
    }
    fn prepare<'w>(&self, w: &Weight<'w>) -> anyhow::Result<Box<dyn PreparedWeight + 'w>> {
        Ok(Box::new(CopiedWeight {
            bytes: w.data.to_vec(),
            claimed: crate::ledger::address_range(w.data),
        }))
    }
    fn run(
        &self,
        w: &Weight<'_>,
        prepared: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> anyhow::Result<()> {
        let copy = prepared
            .as_any()
            .downcast_ref::<CopiedWeight>()
            .ok_or_else(|| anyhow::anyhow!("{} was not prepared by the copying backend", w.name))?;
        let from_copy = Weight {
            data: &copy.bytes,
            ..*w
        };
        let p = self.inner.prepare(&from_copy)?;
        self.inner.run(&from_copy, p.as_ref(), a, m, c)
    }
}

/// What the planning of one model found.
struct ModelPlan {
    name: String,
    tensors: usize,
    ledger_lines: Vec<String>,
    copied: Vec<String>,
    coverage: String,
    unowned: Vec<String>,
}

fn plan_model(path: &std::path::Path, backends: &[&dyn Backend]) -> Result<ModelPlan, String> {
    let f = GgufFile::open(path).map_err(|e| format!("{}: {e:#}", path.display()))?;
    let views: Vec<_> = f.tensors().collect();
    let weights: Vec<Weight<'_>> = views.iter().filter_map(|v| v.as_weight()).collect();
    let plan = sched::plan(backends, &weights, &PLAN_MS, false);
    let mut copied = Vec::new();
    for (name, t) in plan.ledger.backends() {
        if t.copied_bytes > 0 || !t.copied_tensors.is_empty() {
            copied.push(format!(
                "{name}: {} tensor(s) copied ({})",
                t.copied_tensors.len(),
                t.copied_tensors.join(", ")
            ));
        }
    }
    let unowned = plan
        .weights
        .iter()
        .filter(|w| w.owner.is_none())
        .map(|w| {
            let why: Vec<String> = w
                .declined
                .iter()
                .map(|d| format!("{}: {}", d.backend, d.decline))
                .chain(w.prepare_errors.iter().map(|(b, e)| format!("{b}: {e}")))
                .collect();
            format!("{} ({})", w.name, why.join("; "))
        })
        .collect();
    Ok(ModelPlan {
        name: path.display().to_string(),
        tensors: views.len(),
        ledger_lines: plan.ledger.lines(),
        copied,
        coverage: plan.render(),
        unowned,
    })
}

fn plans(ctx: &Ctx, backends: &[&dyn Backend]) -> Result<Vec<ModelPlan>, Outcome> {
    let models = find_models(ctx);
    if models.is_empty() {
        let where_ = ctx
            .paths
            .models
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        // An image ships at least the self-check's fixture: none on a board means the models
        // partition did not mount, which must not pass as "nothing to check".
        return Err(if ctx.board.is_some() {
            Outcome::fail(format!("no GGUF model in {where_}"), vec![])
        } else {
            Outcome::skip(format!("no GGUF model in {where_}"))
        });
    }
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for m in &models {
        match plan_model(m, backends) {
            Ok(p) => out.push(p),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        let reason = format!("{} of {} model(s) do not open", errors.len(), models.len());
        return Err(Outcome::fail(reason, errors));
    }
    Ok(out)
}

/// `backends` in board order; with `ctx.inject.copy_weight` the first one copies.
pub fn mmap(ctx: &Ctx, backends: &[&dyn Backend]) -> Outcome {
    let copying;
    let mut list: Vec<&dyn Backend> = backends.to_vec();
    if ctx.inject.copy_weight {
        if let Some(first) = list.iter().position(|b| b.probe().is_ok()) {
            copying = CopyingBackend { inner: list[first] };
            list[first] = &copying;
        }
    }
    let plans = match plans(ctx, &list) {
        Ok(p) => p,
        Err(o) => return o,
    };
    let mut ev = Vec::new();
    let mut copied = Vec::new();
    for p in &plans {
        ev.push(format!(
            "{}: {} tensors, opened over mmap",
            p.name, p.tensors
        ));
        ev.extend(p.ledger_lines.iter().map(|l| format!("  {l}")));
        copied.extend(p.copied.iter().map(|c| format!("{}: {c}", p.name)));
    }
    if copied.is_empty() {
        Outcome::pass(ev)
    } else {
        let reason = format!(
            "weights were copied instead of mapped: {}",
            copied.join("; ")
        );
        Outcome::fail(reason, ev)
    }
}

pub fn coverage(ctx: &Ctx, backends: &[&dyn Backend]) -> Outcome {
    let plans = match plans(ctx, backends) {
        Ok(p) => p,
        Err(o) => return o,
    };
    let mut ev = Vec::new();
    let mut unowned = Vec::new();
    for p in &plans {
        ev.push(format!("{}:", p.name));
        ev.extend(p.coverage.lines().map(|l| format!("  {l}")));
        unowned.extend(p.unowned.iter().map(|u| format!("{}: {u}", p.name)));
    }
    if unowned.is_empty() {
        Outcome::pass(ev)
    } else {
        let reason = format!("{} weight(s) no backend runs", unowned.len());
        unowned.extend(ev);
        Outcome::fail(reason, unowned)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::FakeRoot;
    use super::super::{Ctx, Inject, Paths, Status};
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::gguf::writer::GgufWriter;

    fn model(root: &FakeRoot) {
        let mut w = GgufWriter::new();
        let x: Vec<f32> = (0..64 * 32).map(|i| (i % 7) as f32 * 0.25).collect();
        w.tensor_f32("blk.0.ffn_up.weight", &[64, 32], &x).unwrap();
        w.tensor_f32("output_norm.weight", &[64], &x[..64]).unwrap();
        let p = root.file("models/tiny.gguf", w.to_bytes());
        assert!(p.exists());
    }

    fn ctx(root: &FakeRoot, inject: Inject) -> Ctx {
        Ctx {
            paths: Paths::under(root),
            inject,
            ..Ctx::default()
        }
    }

    #[test]
    fn mapped_model_passes_and_a_copied_weight_fails() {
        let root = FakeRoot::new();
        model(&root);
        let cpu = CpuBackend::new();
        let o = mmap(&ctx(&root, Inject::default()), &[&cpu]);
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(
            o.evidence
                .iter()
                .any(|e| e.contains("mapped 1/1 tensors, copied 0.00 MiB")),
            "{o:?}"
        );
        assert!(
            o.evidence
                .iter()
                .any(|e| e.contains("reads inside the model mapping 1/1, heap +0.00 MiB")),
            "{o:?}"
        );
        // The fault declares Borrowed and names the mapping as what it reads: the copy is
        // caught by what prepare left allocated, and the line shows it in MiB.
        let o = mmap(&ctx(&root, Inject::parse("copy").unwrap()), &[&cpu]);
        assert_eq!(o.status, Status::Fail, "{o:?}");
        let reason = o.reason.as_deref().unwrap();
        assert!(
            reason.contains("blk.0.ffn_up.weight (declared borrowed, but prepare left 8232 bytes (+0.01 MiB) allocated)"),
            "{o:?}"
        );
        assert!(
            o.evidence
                .iter()
                .any(|e| e.contains("NOT zero-copy") && e.contains("copied 0.01 MiB")),
            "{o:?}"
        );
    }

    #[test]
    fn coverage_names_owners_and_no_models_skips_on_the_host() {
        let root = FakeRoot::new();
        let cpu = CpuBackend::new();
        assert_eq!(
            coverage(&ctx(&root, Inject::default()), &[&cpu]).status,
            Status::Skip
        );
        model(&root);
        let o = coverage(&ctx(&root, Inject::default()), &[&cpu]);
        assert_eq!(o.status, Status::Pass, "{o:?}");
        let junk = root.file("data/models/broken.gguf", b"GGUF\x03\0\0\0");
        assert!(junk.exists());
        let o = mmap(&ctx(&root, Inject::default()), &[&cpu]);
        assert_eq!(o.status, Status::Fail, "{o:?}");
    }
}
