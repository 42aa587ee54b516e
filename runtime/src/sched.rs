//! The scheduler: for a model, which backend owns each matmul weight and which backend runs its
//! op at each M, with every decline reason kept (the per-model answer to llama.cpp's
//! `test-backend-ops support`). Backends are tried in board order (NPU, then CPU).
//!
//! Ownership is decided at the largest M asked about (prefill is where locality matters): the
//! first backend that supports the op there and prepares the weight owns it, and the ledger
//! records how its bytes arrived. Per M, the first backend that supports the op claims it.
//!
//! A backend may also decline when preparing (the NPU: `NpuMemory` when its budget is spent,
//! `Fp16Range`, `LayoutMismatch`) or when running (`Fp16Range` for activations beyond fp16):
//! those are declines too, recorded with their reason, and the next backend takes the weight
//! ([`plan`]) or the op ([`run_with_fallback`], counted in a [`RunLog`]).
//!
//! NPU memory policy: weights are prepared in the model's order, [`prepare_order`] (layer by
//! layer, each layer's in the forward pass's order, then the LM head; not the order the file
//! lists them in), and all of them stay prepared until the plan is complete, so each takes its
//! converted bytes from what the earlier ones left; one that does not fit is declined with
//! `NpuMemory { need, left }` and the next weight is tried. `kiln plan` and the model load both
//! plan through [`plan`], which applies that order, so they decline the same weights.

use crate::backend::{Backend, Capabilities, Decline, MatmulOp, PreparedWeight, Weight};
use crate::ledger::{Arrival, Evidence, Ledger};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// A backend that declined, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Declined {
    pub backend: String,
    pub decline: Decline,
}

/// Who runs one weight's op at one M.
#[derive(Clone, Debug, Serialize)]
pub struct AtM {
    pub m: usize,
    pub backend: Option<String>,
    /// The backends before it (or all, if none claimed the op), with their reasons.
    pub declined: Vec<Declined>,
}

#[derive(Clone, Debug, Serialize)]
pub struct WeightPlan {
    pub name: String,
    pub ty: String,
    pub k: usize,
    pub n: usize,
    pub bytes: u64,
    pub owner: Option<String>,
    /// Bytes the owner converted into its own layout (the NPU: converted B in NPU memory).
    pub converted_bytes: u64,
    /// NPU int8 path (Q8_0): NMSE of the per-row int8 requantisation against the weight.
    pub int8_requant_nmse: Option<f64>,
    /// Why the backends before the owner did not take it.
    pub declined: Vec<Declined>,
    /// Backends that accepted the op but failed to prepare the weight.
    pub prepare_errors: Vec<(String, String)>,
    pub at_m: Vec<AtM>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    pub backend: String,
    pub result: Result<Capabilities, Decline>,
}

#[derive(Serialize)]
pub struct Plan<'w> {
    pub ms: Vec<usize>,
    pub backends: Vec<String>,
    pub probes: Vec<Probe>,
    pub weights: Vec<WeightPlan>,
    pub ledger: Ledger,
    /// The NPU's memory budget in bytes, when the plan was made with one (see [`plan_report`]).
    pub npu_budget: Option<u64>,
    /// Declines at run time ([`run_with_fallback`]); part of the coverage table.
    #[serde(skip)]
    pub runs: RunLog,
    /// The owners' prepared weights, in `weights` order, when asked to keep them.
    #[serde(skip)]
    pub prepared: Vec<Option<Box<dyn PreparedWeight + 'w>>>,
}

/// The name a backend carries in the ledger: `npu` → `NPU`.
pub fn ledger_name(backend: &str) -> String {
    backend.to_uppercase()
}

/// The order in which [`plan`] prepares weights, as indices into `weights`: the order the NPU's
/// budget is taken in (a weight that does not fit is declined `NpuMemory` and the next one is
/// tried). It is the forward pass's: layer by layer by layer number (`blk.2` before `blk.10`),
/// in each layer Q, K, V (or phi3's fused QKV), the attention output, the FFN's gate, up (or
/// phi3's fused gate and up), down, then any other weight of the layer by name; then the
/// weights outside the layers (the LM head: `output.weight`, or the tied `token_embd.weight`)
/// by name. It does not depend on the order the file lists the tensors in, nor on the order a
/// caller passes them in: `kiln plan` and the model load both plan through [`plan`], so at any
/// budget they decline the same weights.
pub fn prepare_order(weights: &[Weight<'_>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| order_key(weights[i].name));
    order
}

/// A weight's place in [`prepare_order`]: `(0, layer, role, name)` for a layer's weight,
/// `(1, 0, 0, name)` for any other.
fn order_key(name: &str) -> (u8, u64, usize, &str) {
    const ROLES: [&str; 8] = [
        "attn_qkv",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(l, tail)| Some((l.parse::<u64>().ok()?, tail)));
    match layer {
        Some((l, tail)) => {
            let stem = tail.strip_suffix(".weight").unwrap_or(tail);
            let role = ROLES.iter().position(|r| *r == stem).unwrap_or(ROLES.len());
            (0, l, role, name)
        }
        None => (1, 0, 0, name),
    }
}

/// Assign `weights` to `backends` (board order) for the row counts `ms`. The weights are
/// prepared in [`prepare_order`]; the plan lists them in the order given.
/// `keep_prepared`: keep each owner's prepared weight in [`Plan::prepared`] (else it is dropped
/// once its arrival is recorded).
pub fn plan<'w>(
    backends: &[&dyn Backend],
    weights: &[Weight<'w>],
    ms: &[usize],
    keep_prepared: bool,
) -> Plan<'w> {
    let mut ms: Vec<usize> = ms.to_vec();
    ms.sort_unstable();
    ms.dedup();
    let own_m = ms.last().copied().unwrap_or(1);
    let probes = backends
        .iter()
        .map(|b| Probe {
            backend: b.name().to_string(),
            result: b.probe(),
        })
        .collect();
    let mut ledger = Ledger::new();
    let mut out: Vec<Option<WeightPlan>> = vec![None; weights.len()];
    let mut prepared: Vec<Owned<'w>> = weights.iter().map(|_| None).collect();
    for i in prepare_order(weights) {
        let w = &weights[i];
        let (mut wp, kept, prepare_declines) = own(backends, w, own_m, &mut ledger);
        wp.at_m = at_each_m(backends, w, &ms, &prepare_declines);
        // Kept until the plan is complete either way: a prepared weight holds its backend's
        // memory, and the next weight must see what is left.
        prepared[i] = kept;
        out[i] = Some(wp);
    }
    if !keep_prepared {
        prepared.clear();
    }
    Plan {
        ms,
        backends: backends.iter().map(|b| b.name().to_string()).collect(),
        probes,
        // Every index is in the order once: every weight has its plan.
        weights: out.into_iter().flatten().collect(),
        ledger,
        npu_budget: None,
        runs: RunLog::default(),
        prepared,
    }
}

/// The owner's prepared weight, if a backend took it.
type Owned<'w> = Option<Box<dyn PreparedWeight + 'w>>;

/// The owner of `w` at `own_m`: the first backend that supports the op there and prepares the
/// weight, its arrival recorded in `ledger`. Returns the weight's plan (without `at_m`), the
/// owner's prepared weight, and the backends that refused it while preparing.
fn own<'w>(
    backends: &[&dyn Backend],
    w: &Weight<'w>,
    own_m: usize,
    ledger: &mut Ledger,
) -> (WeightPlan, Owned<'w>, Vec<Declined>) {
    let mut wp = WeightPlan {
        name: w.name.to_string(),
        ty: w.ty.name().to_string(),
        k: w.k,
        n: w.n,
        bytes: w.data.len() as u64,
        owner: None,
        converted_bytes: 0,
        int8_requant_nmse: None,
        declined: Vec::new(),
        prepare_errors: Vec::new(),
        at_m: Vec::new(),
    };
    let mut prepare_declines: Vec<Declined> = Vec::new();
    for b in backends {
        if let Err(decline) = b.supports(&MatmulOp::for_weight(w, own_m)) {
            wp.declined.push(Declined {
                backend: b.name().to_string(),
                decline,
            });
            continue;
        }
        let (prepared, measured) = crate::ledger::measure(|| b.prepare(w));
        match prepared {
            Ok(p) => {
                let arrival = p.arrival();
                let ev = Evidence {
                    declared: arrival,
                    reads: p.reads_from(),
                    measured,
                };
                ledger.record(&ledger_name(b.name()), w.name, w.data.len() as u64, &ev);
                if let Arrival::Converted { bytes } = arrival {
                    wp.converted_bytes = bytes;
                }
                wp.int8_requant_nmse = p
                    .as_any()
                    .downcast_ref::<crate::backend::npu::NpuPrepared>()
                    .and_then(|n| n.requant_nmse());
                wp.owner = Some(b.name().to_string());
                return (wp, Some(p), prepare_declines);
            }
            // A refusal found while preparing (budget, range, layout) is a decline.
            Err(e) => match e.downcast_ref::<Decline>() {
                Some(d) => {
                    let d = Declined {
                        backend: b.name().to_string(),
                        decline: d.clone(),
                    };
                    wp.declined.push(d.clone());
                    prepare_declines.push(d);
                }
                None => wp
                    .prepare_errors
                    .push((b.name().to_string(), format!("{e:#}"))),
            },
        }
    }
    (wp, None, prepare_declines)
}

/// Who runs `w`'s op at each of `ms`: the first backend that supports it there, with the
/// declines of those before it (a backend that refused the weight when preparing it cannot run
/// its ops).
fn at_each_m(
    backends: &[&dyn Backend],
    w: &Weight<'_>,
    ms: &[usize],
    prepare_declines: &[Declined],
) -> Vec<AtM> {
    let mut out = Vec::with_capacity(ms.len());
    for &m in ms {
        let mut at = AtM {
            m,
            backend: None,
            declined: Vec::new(),
        };
        for b in backends {
            if let Some(d) = prepare_declines.iter().find(|d| d.backend == b.name()) {
                at.declined.push(d.clone());
                continue;
            }
            match b.supports(&MatmulOp::for_weight(w, m)) {
                Ok(()) => {
                    at.backend = Some(b.name().to_string());
                    break;
                }
                Err(decline) => at.declined.push(Declined {
                    backend: b.name().to_string(),
                    decline,
                }),
            }
        }
        out.push(at);
    }
    out
}

/// Run-time counts: ops each backend ran, and declines by backend and reason.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RunCounts {
    pub ran: BTreeMap<String, u64>,
    pub declined: BTreeMap<String, BTreeMap<String, u64>>,
    /// The first decline of each backend and reason, with the weight: `weight: reason`.
    pub examples: BTreeMap<String, String>,
}

/// What [`run_with_fallback`] counted; shared by the threads of a forward pass.
#[derive(Debug, Default)]
pub struct RunLog(Mutex<RunCounts>);

impl RunLog {
    pub fn counts(&self) -> RunCounts {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    fn ran(&self, backend: &str) {
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *c.ran.entry(backend.to_string()).or_default() += 1;
    }
    fn declined(&self, backend: &str, weight: &str, d: &Decline) {
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *c.declined
            .entry(backend.to_string())
            .or_default()
            .entry(d.kind().to_string())
            .or_default() += 1;
        c.examples
            .entry(format!("{backend} {}", d.kind()))
            .or_insert_with(|| format!("{weight}: {d}"));
    }
}

/// Run one op on `primary` (through [`crate::backend::run_checked`]); if it refuses the op with
/// a [`Decline`] (the NPU's `Fp16Range`), run it on `fallback` instead, preparing the weight
/// there (the CPU borrows the mapping: no copy). The decline is counted in `log`; an error that
/// is not a decline is returned as it is. Returns the name of the backend that ran the op.
#[allow(clippy::too_many_arguments)]
pub fn run_with_fallback(
    primary: &dyn Backend,
    prepared: &dyn PreparedWeight,
    fallback: &dyn Backend,
    w: &Weight<'_>,
    a: &[f32],
    m: usize,
    c: &mut [f32],
    log: &RunLog,
) -> anyhow::Result<&'static str> {
    use anyhow::Context;
    match crate::backend::run_checked(primary, w, prepared, a, m, c) {
        Ok(()) => {
            log.ran(primary.name());
            Ok(primary.name())
        }
        Err(e) => {
            let Some(d) = e.downcast_ref::<Decline>() else {
                return Err(e);
            };
            log.declined(primary.name(), w.name, d);
            let fp = fallback.prepare(w).with_context(|| {
                format!(
                    "{} declined {} ({d}); {} cannot prepare it",
                    primary.name(),
                    w.name,
                    fallback.name()
                )
            })?;
            crate::backend::run_checked(fallback, w, fp.as_ref(), a, m, c)?;
            log.ran(fallback.name());
            Ok(fallback.name())
        }
    }
}

/// One backend's row of the coverage table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Coverage {
    pub weights: usize,
    pub bytes: u64,
    /// Ops claimed at each M of the plan, in order.
    pub ops: Vec<usize>,
}

/// Declines of one backend for one reason: at ownership, and at each M.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReasonCount {
    pub weights: usize,
    pub ops: Vec<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Table {
    pub ms: Vec<usize>,
    pub total_weights: usize,
    pub total_bytes: u64,
    /// Backend name (and `none` for what no backend took) → coverage.
    pub coverage: BTreeMap<String, Coverage>,
    /// Backend name → reason kind → counts.
    pub declines: BTreeMap<String, BTreeMap<String, ReasonCount>>,
    /// Ops run and declined at run time, if any ran through [`run_with_fallback`].
    pub runs: RunCounts,
    /// NPU memory: converted bytes of the weights the NPU owns, against its budget.
    pub npu_bytes: u64,
    pub npu_budget: Option<u64>,
}

impl Plan<'_> {
    pub fn table(&self) -> Table {
        let nm = self.ms.len();
        let mut coverage: BTreeMap<String, Coverage> = BTreeMap::new();
        for b in self.backends.iter().map(String::as_str).chain(["none"]) {
            coverage.insert(
                b.to_string(),
                Coverage {
                    ops: vec![0; nm],
                    ..Coverage::default()
                },
            );
        }
        let mut declines: BTreeMap<String, BTreeMap<String, ReasonCount>> = BTreeMap::new();
        let mut count = |d: &Declined, at: Option<usize>| {
            let r = declines
                .entry(d.backend.clone())
                .or_default()
                .entry(d.decline.kind().to_string())
                .or_insert_with(|| ReasonCount {
                    weights: 0,
                    ops: vec![0; nm],
                });
            match at {
                None => r.weights += 1,
                Some(i) => r.ops[i] += 1,
            }
        };
        for w in &self.weights {
            let owner = w.owner.clone().unwrap_or_else(|| "none".into());
            if let Some(c) = coverage.get_mut(&owner) {
                c.weights += 1;
                c.bytes += w.bytes;
            }
            for d in &w.declined {
                count(d, None);
            }
            for (i, at) in w.at_m.iter().enumerate() {
                let who = at.backend.clone().unwrap_or_else(|| "none".into());
                if let Some(c) = coverage.get_mut(&who) {
                    c.ops[i] += 1;
                }
                for d in &at.declined {
                    count(d, Some(i));
                }
            }
        }
        Table {
            ms: self.ms.clone(),
            total_weights: self.weights.len(),
            total_bytes: self.weights.iter().map(|w| w.bytes).sum(),
            coverage,
            declines,
            runs: self.runs.counts(),
            npu_bytes: self
                .weights
                .iter()
                .filter(|w| w.owner.as_deref() == Some("npu"))
                .map(|w| w.converted_bytes)
                .sum(),
            npu_budget: self.npu_budget,
        }
    }

    /// The coverage table, the probes and the ledger as text.
    pub fn render(&self) -> String {
        let t = self.table();
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let mut s = String::new();
        let ms: Vec<String> = t.ms.iter().map(|m| m.to_string()).collect();
        let _ = writeln!(
            s,
            "matmul weights: {} ({:.2} MiB); ops at M = {}",
            t.total_weights,
            mib(t.total_bytes),
            ms.join(", ")
        );
        let _ = writeln!(s, "\nbackends (board order):");
        for p in &self.probes {
            let what = match &p.result {
                Ok(c) => {
                    let facts: Vec<String> =
                        c.facts.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                    format!(
                        "{}{}",
                        if c.simulated { "SIMULATED; " } else { "" },
                        facts.join("; ")
                    )
                }
                Err(d) => format!("absent: {d}"),
            };
            let _ = writeln!(s, "  {:<8} {what}", p.backend);
        }
        let _ = write!(s, "\n{:<8} {:>8} {:>10}", "owner", "weights", "MiB");
        for m in &t.ms {
            let _ = write!(s, " {:>9}", format!("ops@M={m}"));
        }
        s.push('\n');
        let mut order: Vec<String> = self.backends.clone();
        order.push("none".into());
        for b in &order {
            let c = &t.coverage[b];
            let _ = write!(s, "{b:<8} {:>8} {:>10.2}", c.weights, mib(c.bytes));
            for o in &c.ops {
                let _ = write!(s, " {o:>9}");
            }
            s.push('\n');
        }
        let _ = write!(
            s,
            "{:<8} {:>8} {:>10.2}",
            "total",
            t.total_weights,
            mib(t.total_bytes)
        );
        for _ in &t.ms {
            let _ = write!(s, " {:>9}", t.total_weights);
        }
        s.push('\n');
        for b in &self.backends {
            let Some(reasons) = t.declines.get(b) else {
                continue;
            };
            let _ = write!(s, "\ndeclined by {b}:\n  {:<14} {:>8}", "reason", "weights");
            for m in &t.ms {
                let _ = write!(s, " {:>9}", format!("M={m}"));
            }
            s.push('\n');
            for (reason, r) in reasons {
                let _ = write!(s, "  {reason:<14} {:>8}", r.weights);
                for o in &r.ops {
                    let _ = write!(s, " {o:>9}");
                }
                s.push('\n');
            }
            // One example of each distinct reason, with its numbers.
            let mut seen = std::collections::BTreeSet::new();
            for w in &self.weights {
                for d in w
                    .declined
                    .iter()
                    .chain(w.at_m.iter().flat_map(|a| a.declined.iter()))
                {
                    if d.backend == *b && seen.insert(d.decline.to_string()) && seen.len() <= 12 {
                        let _ = writeln!(s, "    e.g. {}: {}", w.name, d.decline);
                    }
                }
            }
        }
        if !t.runs.ran.is_empty() || !t.runs.declined.is_empty() {
            let _ = writeln!(s, "\nat run time:");
            for (b, n) in &t.runs.ran {
                let _ = writeln!(s, "  ran on {b:<8} {n:>8} ops");
            }
            for (b, reasons) in &t.runs.declined {
                for (r, n) in reasons {
                    let eg = t.runs.examples.get(&format!("{b} {r}"));
                    let _ = writeln!(
                        s,
                        "  declined by {b} {r:<14} {n:>8} ops (fell back; e.g. {})",
                        eg.map(String::as_str).unwrap_or("-")
                    );
                }
            }
        }
        let npu_owned: Vec<&WeightPlan> = self
            .weights
            .iter()
            .filter(|w| w.owner.as_deref() == Some("npu"))
            .collect();
        if !npu_owned.is_empty() || self.npu_budget.is_some() {
            let _ = writeln!(s, "\nNPU memory (converted B, one copy per weight):");
            for w in &npu_owned {
                let _ = write!(
                    s,
                    "  {:<28} {:<5} K={:<6} N={:<6} {:>9.2} MiB",
                    w.name,
                    w.ty,
                    w.k,
                    w.n,
                    mib(w.converted_bytes)
                );
                if let Some(e) = w.int8_requant_nmse {
                    let _ = write!(s, "  int8 per-row requant NMSE {e:.2e}");
                }
                s.push('\n');
            }
            let declined_mem = self
                .weights
                .iter()
                .filter(|w| w.declined.iter().any(|d| d.decline.kind() == "NpuMemory"))
                .count();
            let _ = write!(
                s,
                "  NPU total {:.2} MiB for {} weights",
                mib(t.npu_bytes),
                npu_owned.len()
            );
            match t.npu_budget {
                Some(b) => {
                    let _ = writeln!(
                        s,
                        " of budget {:.2} MiB ({:.2} MiB left; {declined_mem} weights declined \
                         as NpuMemory)",
                        mib(b),
                        mib(b.saturating_sub(t.npu_bytes))
                    );
                }
                None => s.push('\n'),
            }
        }
        let errors: Vec<&WeightPlan> = self
            .weights
            .iter()
            .filter(|w| !w.prepare_errors.is_empty())
            .collect();
        if !errors.is_empty() {
            let _ = writeln!(s, "\nprepare failures:");
            for w in errors {
                for (b, e) in &w.prepare_errors {
                    let _ = writeln!(s, "  {b} {}: {e}", w.name);
                }
            }
        }
        let _ = writeln!(s, "\nownership:");
        for l in self.ledger.lines() {
            let _ = writeln!(s, "  {l}");
        }
        s
    }
}

/// Tensor names that are 2-D but looked up by row (`get_rows`), not multiplied.
const NOT_MATMUL: [&str; 3] = ["position_embd", "token_types", "rope_freqs"];

/// The model's matmul weights: 2-D `*.weight` tensors that are not norms or row look-up tables.
/// `token_embd.weight` counts only when the model has no `output.weight` (tied embeddings: the
/// output projection multiplies by it).
pub fn matmul_weights(f: &crate::gguf::GgufFile) -> Vec<Weight<'_>> {
    let tied = f.tensor("output.weight").is_none();
    f.tensors()
        .filter(|t| t.name.ends_with(".weight") && !t.name.contains("norm"))
        .filter(|t| !NOT_MATMUL.iter().any(|p| t.name.starts_with(p)))
        .filter(|t| tied || !t.name.starts_with("token_embd"))
        .filter_map(|t| t.as_weight())
        .collect()
}

/// What `kiln plan` prints: the coverage table (or the plan as JSON) for `file` at `ms`, with
/// the NPU budget from `KILN_NPU_BUDGET_MIB` (else 1 GiB).
pub fn plan_report(file: &std::path::Path, ms: &[usize], json: bool) -> anyhow::Result<String> {
    plan_report_with(file, ms, json, None)
}

/// [`plan_report`] with the NPU budget in bytes (`None`: `KILN_NPU_BUDGET_MIB`, else 1 GiB;
/// capped at the 4 GiB IOMMU domain either way).
pub fn plan_report_with(
    file: &std::path::Path,
    ms: &[usize],
    json: bool,
    npu_budget: Option<u64>,
) -> anyhow::Result<String> {
    use crate::backend::npu::{budget_from_env, NpuBackend, NpuConfig};
    use anyhow::Context;
    anyhow::ensure!(!ms.is_empty(), "--m needs at least one row count");
    anyhow::ensure!(ms.iter().all(|m| *m > 0), "--m values must be at least 1");
    let f = crate::gguf::GgufFile::open(file)?;
    let weights = matmul_weights(&f);
    let budget = match npu_budget {
        Some(b) => b,
        None => budget_from_env()?,
    };
    let npu = NpuBackend::open(NpuConfig {
        budget,
        ..NpuConfig::default()
    })?;
    let cpu = crate::backend::cpu::CpuBackend::new();
    let backends: [&dyn Backend; 2] = [&npu, &cpu];
    let mut p = plan(&backends, &weights, ms, false);
    p.npu_budget = Some(npu.budget());
    if json {
        let v = serde_json::json!({
            "file": file.display().to_string(),
            "table": p.table(),
            "plan": &p,
            "ledger_lines": p.ledger.lines(),
        });
        let mut s = serde_json::to_string_pretty(&v).context("plan as JSON")?;
        s.push('\n');
        Ok(s)
    } else {
        Ok(format!("model: {}\n{}", file.display(), p.render()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuRefBackend;
    use crate::quant::GgmlType;

    /// The order weights are prepared in (and the NPU's budget taken in): by layer number, the
    /// forward pass's order within a layer, the LM head last; whatever order they come in.
    #[test]
    fn weights_are_prepared_layer_by_layer_then_the_head() {
        let names = [
            "token_embd.weight",
            "blk.10.attn_q.weight",
            "blk.2.ffn_up.weight",
            "blk.2.attn_v.weight",
            "blk.2.attn_k.weight",
            "blk.2.ffn_down.weight",
            "blk.2.attn_output.weight",
            "blk.2.ffn_gate.weight",
            "blk.2.attn_q.weight",
            "blk.2.ssm_x.weight",
            "blk.0.attn_qkv.weight",
            "blk.0.ffn_up.weight",
            "blk.x.attn_q.weight",
        ];
        let ws: Vec<Weight<'_>> = names
            .iter()
            .map(|&name| Weight {
                name,
                ty: GgmlType::F16,
                k: 32,
                n: 32,
                data: &[],
            })
            .collect();
        let order: Vec<&str> = prepare_order(&ws).iter().map(|&i| names[i]).collect();
        assert_eq!(
            order,
            [
                "blk.0.attn_qkv.weight",
                "blk.0.ffn_up.weight",
                "blk.2.attn_q.weight",
                "blk.2.attn_k.weight",
                "blk.2.attn_v.weight",
                "blk.2.attn_output.weight",
                "blk.2.ffn_gate.weight",
                "blk.2.ffn_up.weight",
                "blk.2.ffn_down.weight",
                "blk.2.ssm_x.weight",
                "blk.10.attn_q.weight",
                "blk.x.attn_q.weight",
                "token_embd.weight",
            ]
        );
        let mut reversed = ws.clone();
        reversed.reverse();
        let again: Vec<&str> = prepare_order(&reversed)
            .iter()
            .map(|&i| reversed[i].name)
            .collect();
        assert_eq!(again, order, "the order does not depend on the order given");
    }

    /// Without the NPU library every weight falls to the CPU, and every count still adds up.
    #[test]
    fn counts_add_up_and_declines_are_kept() {
        let npu = crate::backend::npu::NpuBackend::new(crate::backend::npu::NpuConfig {
            lib_path: "/nonexistent/librknnrt.so".into(),
            devroot: std::env::temp_dir(),
            min_m: 8,
            budget: crate::backend::npu::DEFAULT_BUDGET,
            omit_sync: None,
            int8_bar: crate::backend::npu::INT8_BAR,
        });
        let cpu = CpuRefBackend;
        let data = vec![0u8; 64 * 32 * 2];
        // Stands for a model mapping: the ledger checks reads lie inside a registered one.
        let _mapped = crate::ledger::register_mapping(&data, std::path::Path::new("test.gguf"));
        let ws = [
            Weight {
                name: "a.weight",
                ty: GgmlType::F16,
                k: 64,
                n: 32,
                data: &data,
            },
            Weight {
                name: "b.weight",
                ty: GgmlType::F16,
                k: 32,
                n: 64,
                data: &data,
            },
        ];
        let backends: [&dyn Backend; 2] = [&npu, &cpu];
        let p = plan(&backends, &ws, &[512, 1, 1], false);
        assert_eq!(p.ms, [1, 512]);
        let t = p.table();
        assert_eq!(t.coverage["cpu-ref"].weights, 2);
        assert_eq!(t.coverage["cpu-ref"].ops, [2, 2]);
        assert_eq!(t.coverage["npu"].weights, 0);
        assert_eq!(t.declines["npu"]["NoDevice"].weights, 2);
        assert_eq!(t.declines["npu"]["NoDevice"].ops, [2, 2]);
        assert!(p.weights.iter().all(|w| w.declined.len() == 1));
        let ledger = p.ledger.lines();
        assert_eq!(ledger.len(), 1);
        assert!(ledger[0].starts_with("weights on CPU-REF via mmap (zero-copy, borrowed)"));
        let text = p.render();
        assert!(text.contains("declined by npu:"), "{text}");
        assert!(text.contains("NoDevice(librknnrt: cannot load"), "{text}");
    }
}
