//! One decoder for llama / qwen2 / qwen3 / gemma3 / phi3, parameterised by the architecture's
//! flags (RoPE NORM or NEOX, per-head Q/K RMSNorm, Q/K/V biases, tied LM head, `key_length`
//! head_dim, GQA), with Llama 3.x's `rope_freqs.weight` factors and linear RoPE scaling, Gemma 3's
//! pieces (embedding scale, post-attention and post-FFN norms, GELU(tanh) gate, Q pre-scale,
//! interleaved sliding-window layers with their own RoPE base, final logit soft-cap) and Phi-3's
//! fused Q/K/V and gate/up projections.
//!
//! Nothing in the file is ignored: a tensor the forward pass does not read refuses the load (all
//! of them named; [`IGNORED_TENSORS`] is the allow-list), as does an `{arch}.` key that is not
//! applied ([`hparams::audit_arch_keys`]). A model that loads with part of it dropped runs, gives
//! plausible text and is wrong; a refusal that names the part is what the user can act on.
//!
//! Every weight is a view into the mapping. Every matmul goes through the scheduler's plan and
//! [`run_checked`]: per op, the first backend in board order that supports it at that M runs it
//! (the NPU for prefill rows ≥ its minimum, the CPU otherwise), so what `kiln plan` prints is what
//! runs. Attention, norms, RoPE and SwiGLU run on the CPU, rounded as ggml rounds them
//! (`ops.rs`), attention threaded over heads.

pub mod fixture;
pub mod hparams;
pub mod kv;
mod load;
pub mod ops;
pub mod sample;
mod tensors;

use crate::backend::{run_checked, Backend, MatmulOp, PreparedWeight, Weight};
use crate::gguf::{GgufFile, TensorView};
use crate::ledger::Ledger;
use crate::quant::dequantize_row;
use anyhow::{bail, ensure, Context, Result};
pub use hparams::{Arch, HParams, RopeKind};
pub use kv::{KvCache, KvType};
use std::collections::BTreeMap;
pub use tensors::IGNORED_TENSORS;

/// Which backends may run the matmuls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum BackendSel {
    /// The plan's choice per weight and M: NPU where it accepts the op, CPU otherwise.
    Auto,
    /// The CPU fast path only.
    Cpu,
    /// The scalar reference only.
    CpuRef,
    /// NPU wherever it accepts an op (an error if it is absent), CPU for what it declines.
    Npu,
}

#[derive(Clone, Debug)]
pub struct Options {
    pub backend: BackendSel,
    /// Threads for the CPU matmuls and the attention (0 = one per core).
    pub threads: usize,
    /// Most rows per forward chunk (prefill), the largest M the plan is made for.
    pub ubatch: usize,
    /// A deliberate fault, so the equality tests can show they catch it.
    pub fault: Option<Fault>,
}

/// Faults the llama.cpp-equality tests inject to show that their comparison fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Pair RoPE values the other architecture's way (NORM ↔ NEOX).
    SwapRope,
    /// Skip qwen3's per-head Q/K RMSNorm.
    NoQkNorm,
    /// Skip the Q/K/V biases.
    NoBias,
    /// A wrong RoPE frequency base (10000, or 1e6 where the file says 10000).
    RopeBase,
    /// Not a bug but a rounding-level nudge: flip the last mantissa bit of every embedding
    /// value (a change of one f32 ulp, the size of a different summation order), to measure how
    /// far the model itself amplifies rounding.
    Ulp,
    /// gemma3: skip the sqrt(n_embd) embedding scale.
    NoEmbdScale,
    /// gemma3: skip `post_attention_norm` and `post_ffw_norm`.
    NoPostNorms,
    /// gemma3: gate the FFN with SiLU (SwiGLU) instead of GELU(tanh).
    SiluGate,
    /// gemma3: every layer attends to the whole context (the sliding window not applied).
    NoWindow,
    /// gemma3: a window one key wider than llama.cpp's (p − k ≤ n_swa instead of < n_swa).
    WindowPlusOne,
    /// gemma3: the windowed layers take the global RoPE base and scaling.
    OneRopeBase,
    /// gemma3: scale Q by 1/sqrt(n_embd/n_head) (the 27B rule) instead of 1/sqrt(key_length).
    QScaleEmbd,
    /// gemma3: skip the final logit soft-cap.
    NoSoftcap,
    /// phi3: take the fused `ffn_up` row's halves the other way round (up first, gate second).
    SwapGateUp,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            backend: BackendSel::Auto,
            threads: 0,
            ubatch: 512,
            fault: None,
        }
    }
}

/// A matmul weight with its optional bias and what each backend prepared for it.
struct Mat<'m> {
    w: Weight<'m>,
    bias: Option<&'m [f32]>,
    /// One slot per backend of [`Model::backends`]; `None` where the plan never sends it there.
    prepared: Vec<Option<Box<dyn PreparedWeight + 'm>>>,
}

/// A matmul weight's place in [`Model::mats`] (the plan's order).
#[derive(Clone, Copy, Debug)]
struct MatId(usize);

/// Q, K and V: three weights, or phi3's one `attn_qkv` whose output rows are [q | k | v].
enum QkvIn {
    Separate { wq: MatId, wk: MatId, wv: MatId },
    Fused(MatId),
}

/// The FFN's gate and up projections: two weights, or phi3's one `ffn_up` whose output rows are
/// [gate | up] (ggml's `swiglu` of the fused row: the first half through SiLU).
enum GateUp {
    Separate { gate: MatId, up: MatId },
    Fused(MatId),
}

struct Layer<'m> {
    attn_norm: &'m [f32],
    q_norm: Option<&'m [f32]>,
    k_norm: Option<&'m [f32]>,
    /// gemma3's `post_attention_norm` and `post_ffw_norm`.
    post_attn_norm: Option<&'m [f32]>,
    post_ffn_norm: Option<&'m [f32]>,
    qkv: QkvIn,
    wo: MatId,
    ffn_norm: &'m [f32],
    gate_up: GateUp,
    down: MatId,
}

pub struct Model<'m> {
    pub hp: HParams,
    pub n_vocab: usize,
    pub tied: bool,
    file: &'m GgufFile,
    tok_embd: TensorView<'m>,
    layers: Vec<Layer<'m>>,
    /// Every matmul weight, each layer's then the LM head's: the plan's order.
    mats: Vec<Mat<'m>>,
    out_norm: &'m [f32],
    output: MatId,
    backends: Vec<Box<dyn Backend>>,
    pub plan_text: String,
    pub ledger: Ledger,
    threads: usize,
    ubatch: usize,
    rope: RopeKind,
    /// `rope_freqs.weight` (Llama 3.x), n_rot/2 factors.
    rope_factors: Option<&'m [f32]>,
    /// [`Fault::Ulp`].
    ulp_nudge: bool,
    /// The FFN gate: GELU(tanh) (gemma3) or SiLU.
    gelu: bool,
    /// [`Fault::NoWindow`].
    no_window: bool,
    /// [`Fault::OneRopeBase`].
    one_rope_base: bool,
    /// [`Fault::SwapGateUp`].
    swap_gate_up: bool,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    None,
    Last,
    All,
}

/// Per-backend counts of what ran (ops and rows), and of the ops a backend refused at run time
/// (by backend and reason) that the next one then ran.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RunStats {
    pub ops: BTreeMap<String, (u64, u64)>,
    pub declined: BTreeMap<String, u64>,
}

/// The state of one conversation: the KV cache and reusable scratch buffers.
pub struct Session {
    pub kv: KvCache,
    pub stats: RunStats,
    scratch: Scratch,
}

/// One group's rows in a forward pass: its first row, how many, and the position of the first.
struct Span {
    row: usize,
    rows: usize,
    pos: usize,
}

/// A forward pass's buffers, kept between calls so a step allocates nothing.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    att_h: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    cs: Vec<(f32, f32)>,
}

impl<'m> Model<'m> {
    pub fn file(&self) -> &'m GgufFile {
        self.file
    }

    /// Bytes of matmul weights read per decoded token (every layer's and the LM head).
    pub fn weight_bytes_per_token(&self) -> u64 {
        self.mats.iter().map(|m| m.w.data.len() as u64).sum()
    }

    /// A session with a KV cache for `n_ctx` tokens (allocated now, once).
    pub fn session(&self, n_ctx: usize, kv: KvType) -> Result<Session> {
        ensure!(n_ctx >= 1, "--ctx must be at least 1");
        ensure!(
            n_ctx <= self.hp.n_ctx_train,
            "--ctx {n_ctx} exceeds the model's context_length {}",
            self.hp.n_ctx_train
        );
        Ok(Session {
            kv: KvCache::new(
                kv,
                self.hp.n_layer,
                n_ctx,
                self.hp.kv_dim(),
                self.hp.head_dim,
            ),
            stats: RunStats::default(),
            scratch: Scratch {
                cs: vec![(0.0, 0.0); self.hp.n_rot / 2],
                ..Scratch::default()
            },
        })
    }

    /// `c = a·Wᵀ (+ bias)` for `m` rows on the first backend that accepts the op at this M.
    fn matmul(
        &self,
        id: MatId,
        a: &[f32],
        m: usize,
        c: &mut Vec<f32>,
        st: &mut RunStats,
    ) -> Result<()> {
        let mat = &self.mats[id.0];
        c.resize(m * mat.w.n, 0.0);
        let op = MatmulOp::for_weight(&mat.w, m);
        let mut why = Vec::new();
        for (b, p) in self.backends.iter().zip(&mat.prepared) {
            let Some(p) = p else { continue };
            if let Err(d) = b.supports(&op) {
                why.push(format!("{}: {d}", b.name()));
                continue;
            }
            // A refusal at run time (the NPU's `Fp16Range`, `Int8Accuracy`) is a decline: the
            // next backend runs the op, and the refusal is counted. Any other error stands.
            if let Err(e) = run_checked(b.as_ref(), &mat.w, p.as_ref(), a, m, c) {
                match e.downcast_ref::<crate::backend::Decline>() {
                    Some(d) => {
                        why.push(format!("{}: {d}", b.name()));
                        *st.declined.entry(format!("{}: {d}", b.name())).or_default() += 1;
                        continue;
                    }
                    None => return Err(e),
                }
            }
            let e = st.ops.entry(b.name().to_string()).or_default();
            e.0 += 1;
            e.1 += m as u64;
            if let Some(bias) = mat.bias {
                for row in c.chunks_exact_mut(mat.w.n) {
                    for (o, &bv) in row.iter_mut().zip(bias) {
                        *o += bv;
                    }
                }
            }
            return Ok(());
        }
        bail!(
            "no backend runs {} at M={m}: {}",
            mat.w.name,
            why.join("; ")
        )
    }

    /// Evaluate `tokens` at the next positions of the session's cache; returns the logits asked
    /// for (`Want::All`: one row of n_vocab per token).
    pub fn forward(&self, s: &mut Session, tokens: &[u32], want: Want) -> Result<Vec<f32>> {
        s.kv.check_room(tokens.len())?;
        let mut out = Vec::new();
        let n = tokens.len();
        let mut done = 0;
        while done < n {
            let m = (n - done).min(self.ubatch);
            let w = match want {
                Want::All => Want::All,
                Want::Last if done + m == n => Want::Last,
                _ => Want::None,
            };
            out.extend(self.forward_chunk(s, &tokens[done..done + m], w)?);
            done += m;
        }
        Ok(out)
    }

    fn forward_chunk(&self, s: &mut Session, tokens: &[u32], want: Want) -> Result<Vec<f32>> {
        self.forward_groups(&mut [(s, tokens)], want)
    }

    /// One decode step for several sequences at once: the next token of each session, in one
    /// pass whose matmuls run at M = sessions, so each weight is read once for all of them.
    /// Returns one row of logits per session, in order. Each row is computed exactly as
    /// [`Model::forward`] computes it for that session alone (norms, RoPE and attention per row;
    /// every matmul kernel gives a row the same bits at any M), so the tokens do not depend on
    /// what else is in the batch — `batch_rows_equal_each_sequence_alone` holds that to the bit.
    /// On the CPU backends, that is: where M reaches the NPU's minimum the plan may run an op on
    /// the NPU, whose int8/fp16 operands move a row within the bound `tests/npu_batch.rs` holds.
    pub fn forward_batch(&self, sessions: &mut [&mut Session], tokens: &[u32]) -> Result<Vec<f32>> {
        ensure!(
            sessions.len() == tokens.len(),
            "internal: {} sessions but {} tokens in a batch",
            sessions.len(),
            tokens.len()
        );
        for s in sessions.iter() {
            s.kv.check_room(1)?;
        }
        // More sequences than the micro-batch: one pass per `ubatch` of them.
        let mut out = Vec::with_capacity(tokens.len() * self.n_vocab);
        for (ss, ts) in sessions
            .chunks_mut(self.ubatch.max(1))
            .zip(tokens.chunks(self.ubatch.max(1)))
        {
            let mut groups: Vec<(&mut Session, &[u32])> = ss
                .iter_mut()
                .zip(ts.chunks(1))
                .map(|(s, t)| (&mut **s, t))
                .collect();
            out.extend(self.forward_groups(&mut groups, Want::All)?);
        }
        Ok(out)
    }

    /// The forward pass over groups of rows: each group is one session's next tokens (at the
    /// positions after its cache). Matmuls run once over all rows; RoPE, the KV writes and
    /// attention per group, against that group's own cache. Scratch buffers and the op counts
    /// are the first group's session's.
    fn forward_groups(
        &self,
        groups: &mut [(&mut Session, &[u32])],
        want: Want,
    ) -> Result<Vec<f32>> {
        let m: usize = groups.iter().map(|(_, t)| t.len()).sum();
        ensure!(m > 0, "internal: a forward pass over no tokens");
        // (first row, rows, position of the first row) of each group.
        let spans: Vec<Span> = groups
            .iter()
            .scan(0, |r, (s, t)| {
                let span = Span {
                    row: *r,
                    rows: t.len(),
                    pos: s.kv.len,
                };
                *r += t.len();
                Some(span)
            })
            .collect();
        let tokens: Vec<u32> = groups.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let s0 = &mut *groups[0].0;
        let mut stats = std::mem::take(&mut s0.stats);
        let mut sc = std::mem::take(&mut s0.scratch);
        let result = (|| -> Result<Vec<f32>> {
            self.embed(&tokens, &mut sc)?;
            for (li, l) in self.layers.iter().enumerate() {
                self.attention_block(li, l, groups, &spans, &mut sc, &mut stats)?;
                self.ffn_block(l, m, &mut sc, &mut stats)?;
            }
            self.logits(want, m, &mut sc, &mut stats)
        })();
        let s0 = &mut *groups[0].0;
        s0.stats = stats;
        s0.scratch = sc;
        if result.is_ok() {
            for ((s, t), _) in groups.iter_mut().zip(&spans) {
                s.kv.len += t.len();
            }
        }
        result
    }

    /// The embedding rows of `tokens` into `sc.x` (scaled where the architecture scales them).
    fn embed(&self, tokens: &[u32], sc: &mut Scratch) -> Result<()> {
        let e = self.hp.n_embd;
        let m = tokens.len();
        sc.x.resize(m * e, 0.0);
        sc.xn.resize(m * e, 0.0);
        let row_bytes = self.tok_embd.data.len() / self.n_vocab;
        for (i, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            ensure!(
                t < self.n_vocab,
                "token id {t} is outside the vocabulary ({})",
                self.n_vocab
            );
            dequantize_row(
                self.tok_embd.ty,
                &self.tok_embd.data[t * row_bytes..(t + 1) * row_bytes],
                &mut sc.x[i * e..(i + 1) * e],
            )
            .context("token_embd.weight row")?;
        }
        if let Some(f) = self.hp.embd_scale {
            for v in sc.x.iter_mut() {
                *v *= f;
            }
        }
        if self.ulp_nudge {
            for v in sc.x.iter_mut() {
                *v = f32::from_bits(v.to_bits() ^ 1);
            }
        }
        Ok(())
    }

    /// Q, K and V of every row from the normed input `sc.xn` (three matmuls, or phi3's fused one
    /// split as ggml's views of its output), with the per-head Q/K norms where the layer has them.
    fn qkv(&self, l: &Layer<'m>, m: usize, sc: &mut Scratch, st: &mut RunStats) -> Result<()> {
        let hp = &self.hp;
        match &l.qkv {
            QkvIn::Separate { wq, wk, wv } => {
                self.matmul(*wq, &sc.xn, m, &mut sc.q, st)?;
                self.matmul(*wk, &sc.xn, m, &mut sc.k, st)?;
                self.matmul(*wv, &sc.xn, m, &mut sc.v, st)?;
            }
            QkvIn::Fused(w) => {
                // Rows of [q | k | v], split as ggml's views of the fused output.
                let (qd, kd) = (hp.q_dim(), hp.kv_dim());
                self.matmul(*w, &sc.xn, m, &mut sc.u, st)?;
                sc.q.resize(m * qd, 0.0);
                sc.k.resize(m * kd, 0.0);
                sc.v.resize(m * kd, 0.0);
                for (i, row) in sc.u.chunks_exact(qd + 2 * kd).enumerate() {
                    sc.q[i * qd..(i + 1) * qd].copy_from_slice(&row[..qd]);
                    sc.k[i * kd..(i + 1) * kd].copy_from_slice(&row[qd..qd + kd]);
                    sc.v[i * kd..(i + 1) * kd].copy_from_slice(&row[qd + kd..]);
                }
            }
        }
        if let (Some(qn), Some(kn)) = (l.q_norm, l.k_norm) {
            ops::rms_norm_rows_inplace(&mut sc.q, qn, hp.eps);
            ops::rms_norm_rows_inplace(&mut sc.k, kn, hp.eps);
        }
        Ok(())
    }

    /// Layer `li`'s attention half: norm, Q/K/V, then per group RoPE, the KV writes and the
    /// attention against that group's cache, the output projection (and post-norm), added to
    /// the residual `sc.x`.
    fn attention_block(
        &self,
        li: usize,
        l: &Layer<'m>,
        groups: &mut [(&mut Session, &[u32])],
        spans: &[Span],
        sc: &mut Scratch,
        st: &mut RunStats,
    ) -> Result<()> {
        let hp = &self.hp;
        let e = hp.n_embd;
        let m = sc.x.len() / e;
        for (xr, yr) in sc.x.chunks_exact(e).zip(sc.xn.chunks_exact_mut(e)) {
            ops::rms_norm(xr, l.attn_norm, hp.eps, yr);
        }
        self.qkv(l, m, sc, st)?;
        let (hd, nh) = (hp.head_dim, hp.n_head);
        sc.att.resize(m * nh * hd, 0.0);
        let freqs = self.rope_freqs(li);
        for ((s, _), span) in groups.iter_mut().zip(spans) {
            self.rope_and_cache(li, &mut s.kv, span, &freqs, sc);
            let (r0, n) = (span.row, span.rows);
            let qd = hp.q_dim();
            self.attention(
                &s.kv,
                li,
                span.pos,
                n,
                &sc.q[r0 * qd..(r0 + n) * qd],
                &mut sc.att_h,
            );
            for h in 0..nh {
                for i in 0..n {
                    let row = (r0 + i) * nh * hd;
                    sc.att[row + h * hd..row + (h + 1) * hd]
                        .copy_from_slice(&sc.att_h[(h * n + i) * hd..(h * n + i + 1) * hd]);
                }
            }
        }
        self.matmul(l.wo, &sc.att, m, &mut sc.o, st)?;
        if let Some(w) = l.post_attn_norm {
            ops::rms_norm_rows_inplace(&mut sc.o, w, hp.eps);
        }
        for (a, &b) in sc.x.iter_mut().zip(&sc.o) {
            *a += b;
        }
        Ok(())
    }

    /// Layer `li`'s RoPE: windowed layers take their own base and never the file's scaling
    /// (llama.cpp's `get_rope_freq_base` / `get_rope_freq_scale`).
    fn rope_freqs(&self, li: usize) -> ops::RopeFreqs<'m> {
        let hp = &self.hp;
        let (freq_base, freq_scale) = if hp.is_swa(li) && !self.one_rope_base {
            (hp.freq_base_swa, 1.0)
        } else {
            (hp.freq_base, hp.freq_scale)
        };
        ops::RopeFreqs {
            n_rot: hp.n_rot,
            freq_base,
            freq_scale,
            factors: self.rope_factors,
        }
    }

    /// One group's rows: RoPE on Q and K at their positions, Q's pre-scale, K and V into the
    /// group's cache.
    fn rope_and_cache(
        &self,
        li: usize,
        kv: &mut KvCache,
        span: &Span,
        freqs: &ops::RopeFreqs<'m>,
        sc: &mut Scratch,
    ) {
        let hp = &self.hp;
        let (hd, qd, kd) = (hp.head_dim, hp.q_dim(), hp.kv_dim());
        for i in span.row..span.row + span.rows {
            let pos = span.pos + i - span.row;
            ops::rope_cache(pos, freqs, &mut sc.cs);
            let q = &mut sc.q[i * qd..(i + 1) * qd];
            ops::rope_heads(q, hd, hp.n_rot, self.rope, &sc.cs);
            ops::rope_heads(
                &mut sc.k[i * kd..(i + 1) * kd],
                hd,
                hp.n_rot,
                self.rope,
                &sc.cs,
            );
            if hp.q_scale != 1.0 {
                for v in q.iter_mut() {
                    *v *= hp.q_scale;
                }
            }
            kv.write(
                li,
                pos,
                &sc.k[i * kd..(i + 1) * kd],
                &sc.v[i * kd..(i + 1) * kd],
            );
        }
    }

    /// The FFN half: norm, gate and up (or phi3's fused pair), the GELU(tanh) or SiLU gate, down
    /// (and post-norm), added to the residual `sc.x`.
    fn ffn_block(
        &self,
        l: &Layer<'m>,
        m: usize,
        sc: &mut Scratch,
        st: &mut RunStats,
    ) -> Result<()> {
        let hp = &self.hp;
        let e = hp.n_embd;
        for (xr, yr) in sc.x.chunks_exact(e).zip(sc.xn.chunks_exact_mut(e)) {
            ops::rms_norm(xr, l.ffn_norm, hp.eps, yr);
        }
        match &l.gate_up {
            GateUp::Separate { gate, up } => {
                self.matmul(*gate, &sc.xn, m, &mut sc.g, st)?;
                self.matmul(*up, &sc.xn, m, &mut sc.u, st)?;
            }
            GateUp::Fused(w) => {
                // Rows of [gate | up]: ggml's swiglu of the fused row.
                let ff = hp.n_ff;
                self.matmul(*w, &sc.xn, m, &mut sc.o, st)?;
                sc.g.resize(m * ff, 0.0);
                sc.u.resize(m * ff, 0.0);
                let (gh, uh) = if self.swap_gate_up { (ff, 0) } else { (0, ff) };
                for (i, row) in sc.o.chunks_exact(2 * ff).enumerate() {
                    sc.g[i * ff..(i + 1) * ff].copy_from_slice(&row[gh..gh + ff]);
                    sc.u[i * ff..(i + 1) * ff].copy_from_slice(&row[uh..uh + ff]);
                }
            }
        }
        if self.gelu {
            ops::geglu_inplace(&mut sc.g, &sc.u);
        } else {
            ops::swiglu_inplace(&mut sc.g, &sc.u);
        }
        self.matmul(l.down, &sc.g, m, &mut sc.o, st)?;
        if let Some(w) = l.post_ffn_norm {
            ops::rms_norm_rows_inplace(&mut sc.o, w, hp.eps);
        }
        for (a, &b) in sc.x.iter_mut().zip(&sc.o) {
            *a += b;
        }
        Ok(())
    }

    /// The logits `want` asks for: the output norm and the LM head over those rows (and Gemma's
    /// final soft-cap).
    fn logits(
        &self,
        want: Want,
        m: usize,
        sc: &mut Scratch,
        st: &mut RunStats,
    ) -> Result<Vec<f32>> {
        let hp = &self.hp;
        let e = hp.n_embd;
        let rows: std::ops::Range<usize> = match want {
            Want::None => return Ok(Vec::new()),
            Want::Last => m - 1..m,
            Want::All => 0..m,
        };
        let r = rows.len();
        for (xr, yr) in sc.x[rows.start * e..rows.end * e]
            .chunks_exact(e)
            .zip(sc.xn.chunks_exact_mut(e))
        {
            ops::rms_norm(xr, self.out_norm, hp.eps, yr);
        }
        let mut logits = Vec::new();
        self.matmul(self.output, &sc.xn[..r * e], r, &mut logits, st)?;
        if let Some(cap) = hp.final_softcap {
            // ggml_scale(1/cap), ggml_tanh, ggml_scale(cap).
            let inv = 1.0 / cap;
            for v in logits.iter_mut() {
                *v = (*v * inv).tanh() * cap;
            }
        }
        Ok(logits)
    }

    /// Causal GQA attention for rows at positions pos0..pos0+m (already in the cache), into
    /// `out` laid out head-major (`[head][row][head_dim]`), threaded over heads. As ggml without
    /// flash attention: with an f16 cache, Q is rounded to f16 before `K·Q`, and the softmax
    /// weights to f16 before `V·softmax`.
    fn attention(
        &self,
        kv: &KvCache,
        layer: usize,
        pos0: usize,
        m: usize,
        q: &[f32],
        out: &mut Vec<f32>,
    ) {
        let hp = &self.hp;
        let (hd, nh) = (hp.head_dim, hp.n_head);
        let group = nh / hp.n_head_kv;
        let first = |pos: usize| {
            if self.no_window {
                0
            } else {
                hp.first_visible(layer, pos)
            }
        };
        let f16 = kv.ty == KvType::F16;
        out.clear();
        out.resize(nh * m * hd, 0.0);
        let threads = self.threads.min(nh).max(1);
        let per = nh.div_ceil(threads);
        let work = |h0: usize, chunk: &mut [f32]| {
            let mut scores = vec![0.0f32; pos0 + m];
            let mut qh = vec![0.0f32; hd];
            for (hi, oh) in chunk.chunks_exact_mut(m * hd).enumerate() {
                let h = h0 + hi;
                let g = h / group;
                for i in 0..m {
                    // Keys j0..=pos: the causal mask, and the sliding window's where the layer
                    // has one (masked keys weigh exactly 0 in ggml's softmax).
                    let n_kv = pos0 + i + 1;
                    let j0 = first(pos0 + i);
                    let src = &q[i * nh * hd + h * hd..i * nh * hd + (h + 1) * hd];
                    for (d, &s) in qh.iter_mut().zip(src) {
                        *d = if f16 { ops::round_f16(s) } else { s };
                    }
                    let sc = &mut scores[j0..n_kv];
                    for (j, s) in (j0..).zip(sc.iter_mut()) {
                        *s = kv.k(layer, j, g).dot(&qh);
                    }
                    ops::softmax_scaled(sc, hp.kq_scale);
                    let o = &mut oh[i * hd..(i + 1) * hd];
                    o.fill(0.0);
                    for (j, &p) in (j0..).zip(sc.iter()) {
                        let p = if f16 { ops::round_f16(p) } else { p };
                        kv.v(layer, j, g).axpy(o, p);
                    }
                }
            }
        };
        if threads == 1 || m * (pos0 + m) < 64 {
            work(0, out);
            return;
        }
        let chunks: Vec<&mut [f32]> = out.chunks_mut(per * m * hd).collect();
        crate::pool::run_parts(chunks, |t, c| work(t * per, c));
    }

    /// Names of the weights the forward pass multiplies by, in the order the load planned them
    /// (each layer's, then the LM head): what `kiln plan` and the self-check's coverage must
    /// cover.
    pub fn matmul_weight_names(&self) -> Vec<&'m str> {
        self.mats.iter().map(|m| m.w.name).collect()
    }

    /// Names of the backends in board order.
    pub fn backend_names(&self) -> Vec<&'static str> {
        self.backends.iter().map(|b| b.name()).collect()
    }
}

/// The RoPE pairing: the architecture's, or the other one under [`Fault::SwapRope`].
fn rope_kind(arch: Arch, fault: Option<Fault>) -> RopeKind {
    match (fault, arch.rope()) {
        (Some(Fault::SwapRope), RopeKind::Norm) => RopeKind::Neox,
        (Some(Fault::SwapRope), RopeKind::Neox) => RopeKind::Norm,
        (_, r) => r,
    }
}

/// Threads to use: `n`, or one per core for 0.
fn resolve_threads(n: usize) -> usize {
    if n == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        n
    }
}

/// Mean negative log-likelihood of each window's tokens after its first, each predicted from all
/// earlier tokens of the window; windows of `n_ctx` tokens, the cache cleared between them.
/// Returns (scored, sum of NLL).
pub fn nll_windows(
    model: &Model<'_>,
    s: &mut Session,
    tokens: &[u32],
    n_ctx: usize,
) -> Result<(usize, f64)> {
    let mut scored = 0usize;
    let mut sum = 0.0f64;
    for w in tokens.chunks(n_ctx) {
        if w.len() < 2 {
            continue;
        }
        s.kv.clear();
        let logits = model.forward(s, &w[..w.len() - 1], Want::All)?;
        for (i, row) in logits.chunks_exact(model.n_vocab).enumerate() {
            sum += token_nll(row, w[i + 1]);
            scored += 1;
        }
    }
    Ok((scored, sum))
}

/// `logsumexp(logits) − logits[target]` in f64, as llama-perplexity computes it.
pub fn token_nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    sum.ln() + max - logits[target as usize] as f64
}

/// Resident memory by kind, from `/proc/self/status` (kB): (anonymous, file-backed).
pub fn rss_kb() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Some((field("RssAnon:")?, field("RssFile:")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::Value;

    /// The self-check fixture with `edit` applied, loaded on the scalar reference; `Err` is the
    /// load's error text.
    fn with_fixture<T>(
        edit: impl FnOnce(&mut GgufWriter) -> Result<()>,
        then: impl FnOnce(&Model<'_>) -> T,
    ) -> std::result::Result<T, String> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, fixture::gguf_with(edit).unwrap()).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let opt = Options {
            backend: BackendSel::CpuRef,
            ..Options::default()
        };
        let r = match Model::load(&f, &opt) {
            Ok(m) => Ok(then(&m)),
            Err(e) => Err(format!("{e:#}")),
        };
        r
    }

    /// Logits of every position of a fixed id sequence, as bits.
    fn logits(m: &Model<'_>) -> Vec<u32> {
        let ids = [1u32, 300, 301, 290, 400, 17, 511, 260, 300, 2, 77, 123];
        let mut s = m.session(ids.len(), KvType::F32).unwrap();
        let l = m.forward(&mut s, &ids, Want::All).unwrap();
        l.iter().map(|v| v.to_bits()).collect()
    }

    fn ones(n: usize) -> Vec<f32> {
        vec![1.0; n]
    }

    #[test]
    fn tensors_the_forward_pass_does_not_read_are_refused_all_named_in_order() {
        let e = with_fixture(
            |g| {
                g.tensor_f32("zz_extra.weight", &[4], &ones(4))?;
                g.tensor_f32("blk.1.ffn_up.bias", &[128], &ones(128))?;
                g.tensor_f32("blk.0.attn_output.bias", &[64], &ones(64))?;
                Ok(())
            },
            |_| (),
        )
        .unwrap_err();
        assert!(
            e.contains(
                "3 tensor(s) in the file are not used by kiln's forward pass for this \
                 architecture (refused rather than ignored): blk.0.attn_output.bias, \
                 blk.1.ffn_up.bias, zz_extra.weight"
            ),
            "{e}"
        );
        // The plain fixture uses every tensor it has.
        with_fixture(|_| Ok(()), |_| ()).unwrap();
    }

    #[test]
    fn ignored_tensor_patterns_match_whole_layer_names_only() {
        assert!(IGNORED_TENSORS
            .iter()
            .all(|(p, why)| !p.is_empty() && !why.is_empty()));
        let allow = [("blk.*.attn_rot_embd", "test"), ("a.weight", "test")];
        let used = std::collections::HashSet::from(["b".to_string()]);
        let names = [
            "blk.0.attn_rot_embd",
            "blk.12.attn_rot_embd",
            "blk.x.attn_rot_embd",
            "blk.1.attn_rot_embd.extra",
            "a.weight",
            "b",
            "c",
        ];
        assert_eq!(
            tensors::unused_tensors(names.into_iter(), &used, &allow),
            ["blk.1.attn_rot_embd.extra", "blk.x.attn_rot_embd", "c"]
        );
    }

    #[test]
    fn maths_keys_kiln_does_not_apply_are_refused_by_name_and_neutral_values_pass() {
        let e = with_fixture(
            |g| {
                g.add("llama.attention.sliding_window", Value::U32(32))?;
                g.add("llama.final_logit_softcapping", Value::F32(30.0))?;
                g.add("llama.some_new_knob", Value::F32(2.0))?;
                g.add("llama.expert_count", Value::U32(0))?;
                g.add("general.whatever", Value::U32(7))?;
                g.add("quantize.imatrix.file", Value::String("x".into()))?;
                Ok(())
            },
            |_| (),
        )
        .unwrap_err();
        assert!(
            e.contains("3 metadata key(s)")
                && e.contains("llama.attention.sliding_window = 32")
                && e.contains("llama.final_logit_softcapping = 30.0")
                && e.contains("llama.some_new_knob = 2.0 (not a key kiln applies"),
            "{e}"
        );
        assert!(
            e.find("sliding_window") < e.find("final_logit")
                && e.find("final_logit") < e.find("some_new"),
            "sorted: {e}"
        );
        assert!(!e.contains("expert_count") && !e.contains("general.") && !e.contains("imatrix"));
        for (k, v) in [
            ("llama.rope.scaling.type", Value::String("yarn".into())),
            ("llama.rope.scaling.type", Value::String("longrope".into())),
        ] {
            let e = with_fixture(|g| g.add(k, v.clone()).map(|_| ()), |_| ()).unwrap_err();
            assert!(
                e.contains(&format!("{k} = {:?}", v.as_str().unwrap())),
                "{e}"
            );
        }
        // Neutral values load and change nothing.
        let plain = with_fixture(|_| Ok(()), logits).unwrap();
        let neutral = with_fixture(
            |g| {
                g.add("llama.attention.sliding_window", Value::U32(0))?;
                g.add("llama.final_logit_softcapping", Value::F32(0.0))?;
                g.add("llama.expert_count", Value::U32(0))?;
                g.add("llama.logit_scale", Value::F32(1.0))?;
                g.add("llama.attention.causal", Value::Bool(true))?;
                g.add("llama.rope.scaling.type", Value::String("none".into()))?;
                g.add("llama.rope.scaling.factor", Value::F32(8.0))?;
                g.add("llama.rope.scaling.original_context_length", Value::U32(64))?;
                Ok(())
            },
            logits,
        )
        .unwrap();
        assert!(plain == neutral, "neutral keys changed the logits");
    }

    /// `rope_freqs.weight` and linear RoPE scaling are read: factors of 1.0 (and a scale of 1)
    /// give the plain model's logits bit for bit, other factors or a scale change them.
    #[test]
    fn rope_factors_and_linear_scaling_are_applied() {
        let n = fixture_n_rot() / 2;
        let plain = with_fixture(|_| Ok(()), logits).unwrap();
        let with_ones = with_fixture(
            |g| {
                g.tensor_f32("rope_freqs.weight", &[n as u64], &ones(n))
                    .map(|_| ())
            },
            logits,
        )
        .unwrap();
        assert!(plain == with_ones, "factors of 1.0 changed the logits");
        let factors: Vec<f32> = (0..n).map(|i| 1.0 + i as f32).collect();
        let with_factors = with_fixture(
            |g| {
                g.tensor_f32("rope_freqs.weight", &[n as u64], &factors)
                    .map(|_| ())
            },
            logits,
        )
        .unwrap();
        assert!(plain != with_factors, "rope_freqs.weight was not applied");
        let scaled = with_fixture(
            |g| {
                g.add("llama.rope.scaling.type", Value::String("linear".into()))?;
                g.add("llama.rope.scaling.factor", Value::F32(4.0))?;
                Ok(())
            },
            logits,
        )
        .unwrap();
        assert!(plain != scaled, "linear RoPE scaling was not applied");
        let unit = with_fixture(
            |g| {
                g.add("llama.rope.scaling.factor", Value::F32(1.0))
                    .map(|_| ())
            },
            logits,
        )
        .unwrap();
        assert!(plain == unit, "a linear factor of 1 changed the logits");
        let mut bad = ones(n);
        bad[3] = 0.0;
        let e = with_fixture(
            |g| {
                g.tensor_f32("rope_freqs.weight", &[n as u64], &bad)
                    .map(|_| ())
            },
            |_| (),
        )
        .unwrap_err();
        assert!(e.contains("rope_freqs.weight[3] = 0"), "{e}");
        let e = with_fixture(
            |g| {
                g.tensor_f32("rope_freqs.weight", &[3], &ones(3))
                    .map(|_| ())
            },
            |_| (),
        )
        .unwrap_err();
        assert!(e.contains("tensor rope_freqs.weight has shape [3]"), "{e}");
    }

    fn fixture_n_rot() -> usize {
        with_fixture(|_| Ok(()), |m| m.hp.n_rot).unwrap()
    }
}
