//! The load: one generic walk over the architecture's table ([`super::tensors`]) that reads
//! every tensor the forward pass uses, refuses a file with any other, plans the matmuls over the
//! backends and prepares each weight where the plan sends it. Each matmul weight is pushed once
//! into the model's list; a layer holds its weights' places in that list ([`MatId`]).

use super::tensors::{self, Need, Reader, Role};
use super::{BackendSel, Fault, GateUp, HParams, Layer, Mat, MatId, Model, Options, QkvIn};
use crate::backend::{cpu, npu, Backend, PreparedWeight, Weight};
use crate::gguf::{GgufFile, TensorView};
use crate::ledger::{Arrival, Ledger};
use crate::sched;
use anyhow::{bail, ensure, Context, Result};
use std::collections::{BTreeMap, HashSet};

/// The matmul weights in the order the plan takes them, each with its bias.
type MatList<'m> = Vec<(Weight<'m>, Option<&'m [f32]>)>;

fn push<'m>(list: &mut MatList<'m>, w: Weight<'m>, bias: Option<&'m [f32]>) -> MatId {
    list.push((w, bias));
    MatId(list.len() - 1)
}

impl<'m> Model<'m> {
    pub fn load(f: &'m GgufFile, opt: &Options) -> Result<Model<'m>> {
        let threads = super::resolve_threads(opt.threads);
        let cpu_b = cpu::CpuBackend::new().with_threads(threads);
        let backends: Vec<Box<dyn Backend>> = match opt.backend {
            BackendSel::Cpu => vec![Box::new(cpu_b)],
            BackendSel::CpuRef => vec![Box::new(cpu::CpuRefBackend)],
            BackendSel::Auto => vec![
                Box::new(npu::NpuBackend::open(npu::NpuConfig::default())?),
                Box::new(cpu_b),
            ],
            BackendSel::Npu => {
                let n = npu::NpuBackend::open(npu::NpuConfig::default())?;
                if let Err(d) = n.probe() {
                    bail!("--backend npu: the NPU is not available: {d}");
                }
                vec![Box::new(n), Box::new(cpu_b)]
            }
        };
        Model::load_with(f, opt, backends)
    }

    /// [`Model::load`] with the given backends in board order (`opt.backend` is not read): the
    /// self-check passes the board's NPU configuration, and tests a faulty backend.
    pub fn load_with(
        f: &'m GgufFile,
        opt: &Options,
        backends: Vec<Box<dyn Backend>>,
    ) -> Result<Model<'m>> {
        ensure!(!backends.is_empty(), "a model needs at least one backend");
        let mut hp = HParams::from_gguf(f.gguf())
            .with_context(|| format!("{}: model hyper-parameters", f.path().display()))?;
        fault_hparams(&mut hp, opt.fault);
        let rd = Reader::new(f);
        let tok_embd = token_embd(&rd, f, hp.n_embd)?;
        let n_vocab = tok_embd.ne[1] as usize;
        let mut list = MatList::new();
        let layers = (0..hp.n_layer)
            .map(|l| read_layer(&rd, &hp, l, opt.fault, &mut list))
            .collect::<Result<Vec<_>>>()?;
        let rope_factors = rope_factors(&rd, &hp)?;
        refuse_longrope(f)?;
        let tied = !rd.has("output.weight");
        let out_w = if tied {
            tok_embd
                .as_weight()
                .context("token_embd.weight as the tied LM head")?
        } else {
            matmul_weight(&rd, "output.weight", &[hp.n_embd, n_vocab])?
        };
        let output = push(&mut list, out_w, None);
        let out_norm = rd.vector("output_norm.weight", hp.n_embd)?;
        rd.check_all_used()?;
        let ubatch = opt.ubatch.max(1);
        let (mats, plan_text, ledger) = prepare(f, &backends, list, ubatch)?;
        let fault = |x: Fault| opt.fault == Some(x);
        Ok(Model {
            gelu: hp.arch.gemma() && !fault(Fault::SiluGate),
            rope: super::rope_kind(hp.arch, opt.fault),
            hp,
            n_vocab,
            tied,
            file: f,
            tok_embd,
            layers,
            mats,
            out_norm,
            output,
            backends,
            plan_text,
            ledger,
            threads: super::resolve_threads(opt.threads),
            ubatch,
            rope_factors,
            ulp_nudge: fault(Fault::Ulp),
            no_window: fault(Fault::NoWindow),
            one_rope_base: fault(Fault::OneRopeBase),
            swap_gate_up: fault(Fault::SwapGateUp),
        })
    }
}

/// The faults that are a wrong hyper-parameter.
fn fault_hparams(hp: &mut HParams, fault: Option<Fault>) {
    match fault {
        Some(Fault::RopeBase) => {
            hp.freq_base = if hp.freq_base == 10000.0 {
                1e6
            } else {
                10000.0
            };
        }
        Some(Fault::NoEmbdScale) => hp.embd_scale = None,
        Some(Fault::NoSoftcap) => hp.final_softcap = None,
        Some(Fault::QScaleEmbd) => hp.q_scale = 1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt(),
        Some(Fault::WindowPlusOne) => {
            if let Some(w) = &mut hp.swa {
                w.n_swa += 1;
            }
        }
        _ => {}
    }
}

/// `token_embd.weight`, `[n_embd, n_vocab]`: the vocabulary's size is the file's.
fn token_embd<'m>(rd: &Reader<'m>, f: &'m GgufFile, e: usize) -> Result<TensorView<'m>> {
    let t = f
        .tensor("token_embd.weight")
        .with_context(|| format!("{}: tensor token_embd.weight is missing", rd.path()))?;
    rd.mark_used("token_embd.weight");
    ensure!(
        t.n_dims == 2 && t.ne[0] == e as u64,
        "{}: token_embd.weight has shape {:?}, want [{e}, n_vocab]",
        rd.path(),
        &t.ne[..t.n_dims as usize]
    );
    Ok(t)
}

fn matmul_weight<'m>(rd: &Reader<'m>, name: &str, dims: &[usize]) -> Result<Weight<'m>> {
    rd.tensor(name, dims)?
        .as_weight()
        .with_context(|| format!("{}: tensor {name} as a matmul weight", rd.path()))
}

/// One tensor as the layer reads it.
enum Got<'m> {
    Mat(Weight<'m>),
    Vector(&'m [f32]),
}

/// Layer `l`'s tensors, by the table: each required one (an error naming it when missing), each
/// optional one the file has. A fault drops what it skips after the read (a deliberate fault,
/// not a tensor the load forgot).
fn read_layer<'m>(
    rd: &Reader<'m>,
    hp: &HParams,
    l: usize,
    fault: Option<Fault>,
    list: &mut MatList<'m>,
) -> Result<Layer<'m>> {
    let mut got = BTreeMap::new();
    for x in tensors::of(hp.arch).layer {
        let name = format!("blk.{l}.{}", x.name);
        if !rd.has(&name) {
            match x.need {
                Need::Optional => continue,
                Need::Required if !x.why.is_empty() => bail!(
                    "{}: tensor {name} is missing ({} {})",
                    rd.path(),
                    hp.arch.name(),
                    x.why
                ),
                Need::Required => {} // the reader's "is missing"
            }
        }
        let dims: Vec<usize> = x.shape.iter().map(|d| d.of(hp)).collect();
        let v = if x.role.is_matmul() {
            Got::Mat(matmul_weight(rd, &name, &dims)?)
        } else {
            Got::Vector(rd.vector(&name, dims[0])?)
        };
        got.insert(x.role, v);
    }
    let dropped: &[Role] = match fault {
        Some(Fault::NoQkNorm) => &[Role::QNorm, Role::KNorm],
        Some(Fault::NoPostNorms) => &[Role::PostAttnNorm, Role::PostFfnNorm],
        Some(Fault::NoBias) => &[Role::BiasQ, Role::BiasK, Role::BiasV],
        _ => &[],
    };
    for r in dropped {
        got.remove(r);
    }
    assemble(LayerRead(got), list)
}

/// A layer's tensors by role, taken out one by one as the layer is assembled.
struct LayerRead<'m>(BTreeMap<Role, Got<'m>>);

impl<'m> LayerRead<'m> {
    fn vector(&mut self, r: Role) -> Option<&'m [f32]> {
        match self.0.remove(&r) {
            Some(Got::Vector(v)) => Some(v),
            _ => None,
        }
    }
    fn mat(&mut self, r: Role) -> Option<Weight<'m>> {
        match self.0.remove(&r) {
            Some(Got::Mat(w)) => Some(w),
            _ => None,
        }
    }
    fn need_mat(&mut self, r: Role) -> Result<Weight<'m>> {
        self.mat(r)
            .with_context(|| format!("internal: the architecture table has no {r:?}"))
    }
    fn need_vector(&mut self, r: Role) -> Result<&'m [f32]> {
        self.vector(r)
            .with_context(|| format!("internal: the architecture table has no {r:?}"))
    }
}

/// The layer from its tensors, its matmul weights pushed in the plan's order: Q, K, V (or the
/// fused QKV), the output projection, gate and up (or the fused pair), down.
fn assemble<'m>(mut t: LayerRead<'m>, list: &mut MatList<'m>) -> Result<Layer<'m>> {
    let qkv = match t.mat(Role::Wqkv) {
        Some(w) => QkvIn::Fused(push(list, w, None)),
        None => {
            let (q, bq) = (t.need_mat(Role::Wq)?, t.vector(Role::BiasQ));
            let (k, bk) = (t.need_mat(Role::Wk)?, t.vector(Role::BiasK));
            let (v, bv) = (t.need_mat(Role::Wv)?, t.vector(Role::BiasV));
            QkvIn::Separate {
                wq: push(list, q, bq),
                wk: push(list, k, bk),
                wv: push(list, v, bv),
            }
        }
    };
    let wo = push(list, t.need_mat(Role::Wo)?, None);
    let gate_up = match t.mat(Role::GateUp) {
        Some(w) => GateUp::Fused(push(list, w, None)),
        None => {
            let (g, u) = (t.need_mat(Role::Gate)?, t.need_mat(Role::Up)?);
            GateUp::Separate {
                gate: push(list, g, None),
                up: push(list, u, None),
            }
        }
    };
    let down = push(list, t.need_mat(Role::Down)?, None);
    Ok(Layer {
        attn_norm: t.need_vector(Role::AttnNorm)?,
        q_norm: t.vector(Role::QNorm),
        k_norm: t.vector(Role::KNorm),
        post_attn_norm: t.vector(Role::PostAttnNorm),
        post_ffn_norm: t.vector(Role::PostFfnNorm),
        qkv,
        wo,
        ffn_norm: t.need_vector(Role::FfnNorm)?,
        gate_up,
        down,
    })
}

/// Llama 3.x's RoPE frequency factors, where the architecture reads them: positive numbers.
fn rope_factors<'m>(rd: &Reader<'m>, hp: &HParams) -> Result<Option<&'m [f32]>> {
    if !tensors::of(hp.arch).rope_freqs {
        return Ok(None);
    }
    let v = rd.opt_vector("rope_freqs.weight", hp.n_rot / 2)?;
    if let Some((i, x)) = v
        .into_iter()
        .flatten()
        .enumerate()
        .find(|(_, x)| !(**x > 0.0 && x.is_finite()))
    {
        bail!(
            "{}: tensor rope_freqs.weight[{i}] = {x}: a RoPE frequency factor must be a \
             positive number",
            rd.path()
        );
    }
    Ok(v)
}

/// Phi-3's LongRoPE (long/short frequency factors chosen by context length, plus an attention
/// factor): not implemented, refused by name rather than left unused.
fn refuse_longrope(f: &GgufFile) -> Result<()> {
    let longrope: Vec<&str> = f
        .tensors()
        .map(|t| t.name)
        .filter(|n| n.starts_with("rope_factors_") || n.contains(".rope_factors_"))
        .collect();
    if !longrope.is_empty() {
        bail!(
            "{}: LongRoPE frequency factors ({}) are not implemented by kiln",
            f.path().display(),
            longrope.join(", ")
        );
    }
    Ok(())
}

/// The plan over every matmul weight (ownership at the largest M, ops per M), each backend's
/// prepared weight where the plan sends it an op, and the ledger with every other tensor the
/// CPU borrows where it lies.
fn prepare<'m>(
    f: &'m GgufFile,
    backends: &[Box<dyn Backend>],
    list: MatList<'m>,
    ubatch: usize,
) -> Result<(Vec<Mat<'m>>, String, Ledger)> {
    let weights: Vec<Weight<'m>> = list.iter().map(|(w, _)| *w).collect();
    let refs: Vec<&dyn Backend> = backends.iter().map(|b| b.as_ref()).collect();
    let plan = sched::plan(&refs, &weights, &[1, ubatch], true);
    let plan_text = plan.render();
    let mut ledger = plan.ledger.clone();
    let mut mats = Vec::with_capacity(list.len());
    for (((w, bias), wp), owner_prep) in list.into_iter().zip(&plan.weights).zip(plan.prepared) {
        let prepared = prepare_one(backends, &w, wp, owner_prep)?;
        if wp.owner.is_none() {
            bail!(
                "{}: no backend can run {} ({} {}×{}): {}",
                f.path().display(),
                w.name,
                w.ty,
                w.k,
                w.n,
                wp.declined
                    .iter()
                    .map(|d| format!("{}: {}", d.backend, d.decline))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        mats.push(Mat { w, bias, prepared });
    }
    record_borrowed(f, &weights, &mut ledger)?;
    Ok((mats, plan_text, ledger))
}

/// One slot per backend: the owner's prepared weight from the plan, a fresh one where the plan
/// sends the backend any op of `w`, and always one for a CPU backend (so a size of M the plan
/// did not list still has a backend); `None` elsewhere.
fn prepare_one<'m>(
    backends: &[Box<dyn Backend>],
    w: &Weight<'m>,
    wp: &sched::WeightPlan,
    mut owner_prep: Option<Box<dyn PreparedWeight + 'm>>,
) -> Result<Vec<Option<Box<dyn PreparedWeight + 'm>>>> {
    let mut prepared = Vec::with_capacity(backends.len());
    for b in backends {
        let owner = wp.owner.as_deref() == Some(b.name());
        let used = owner
            || wp
                .at_m
                .iter()
                .any(|a| a.backend.as_deref() == Some(b.name()));
        let p = if owner && owner_prep.is_some() {
            owner_prep.take()
        } else if used || b.name().starts_with("cpu") {
            // CPU prepares borrow.
            match b.prepare(w) {
                Ok(p) => Some(p),
                Err(e) if used => return Err(e.context(format!("preparing {}", w.name))),
                Err(_) => None,
            }
        } else {
            None
        };
        prepared.push(p);
    }
    Ok(prepared)
}

/// Everything the model reads besides the matmul weights (norms, biases, the embedding rows) is
/// borrowed by the CPU: no prepare runs for these, the CPU reads the slice where it lies, and
/// the ledger checks that address range against the registered mapping.
fn record_borrowed(f: &GgufFile, weights: &[Weight<'_>], ledger: &mut Ledger) -> Result<()> {
    let in_plan: HashSet<&str> = weights.iter().map(|w| w.name).collect();
    let map = f.bytes().as_ptr_range();
    for t in f.tensors() {
        let r = t.data.as_ptr_range();
        ensure!(
            map.start <= r.start && r.end <= map.end,
            "tensor {} does not lie inside the mapping",
            t.name
        );
        if !in_plan.contains(t.name) {
            let ev = crate::ledger::Evidence {
                declared: Arrival::Borrowed,
                reads: Some(crate::ledger::address_range(t.data)),
                measured: crate::ledger::Measurement::default(),
            };
            ledger.record("CPU", t.name, t.data.len() as u64, &ev);
        }
    }
    Ok(())
}
