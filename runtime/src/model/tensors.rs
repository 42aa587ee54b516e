//! What each architecture's file holds, as data: per layer, every tensor the forward pass reads
//! (its name after `blk.N.`, its shape in the hyper-parameters' terms, required or optional,
//! and its role), and the [`Reader`] that hands tensors out and refuses a file with any tensor
//! it did not hand out. The loader (`load.rs`) is one generic walk over these tables.

use super::hparams::{Arch, HParams};
use crate::gguf::{GgufFile, TensorView};
use crate::quant::GgmlType;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashSet;

/// A dimension of a tensor, in the hyper-parameters' terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dim {
    /// `n_embd`.
    Embd,
    /// `n_ff`.
    Ff,
    /// `2·n_ff`: phi3's fused [gate | up].
    TwoFf,
    /// `n_head·head_dim`.
    Q,
    /// `n_head_kv·head_dim`.
    Kv,
    /// `q + 2·kv`: phi3's fused [q | k | v].
    Qkv,
    /// `head_dim`.
    Head,
}

impl Dim {
    pub(crate) fn of(self, hp: &HParams) -> usize {
        match self {
            Dim::Embd => hp.n_embd,
            Dim::Ff => hp.n_ff,
            Dim::TwoFf => 2 * hp.n_ff,
            Dim::Q => hp.q_dim(),
            Dim::Kv => hp.kv_dim(),
            Dim::Qkv => hp.q_dim() + 2 * hp.kv_dim(),
            Dim::Head => hp.head_dim,
        }
    }
}

/// What a layer tensor is to the forward pass. Matmul weights are 2-D (`[k, n]` in ggml's
/// order), the rest F32 vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
    AttnNorm,
    Wq,
    Wk,
    Wv,
    /// phi3's fused [q | k | v] projection.
    Wqkv,
    BiasQ,
    BiasK,
    BiasV,
    QNorm,
    KNorm,
    Wo,
    PostAttnNorm,
    FfnNorm,
    Gate,
    Up,
    /// phi3's fused [gate | up] projection (`ffn_up`, 2·n_ff wide).
    GateUp,
    Down,
    PostFfnNorm,
}

impl Role {
    /// Whether the tensor is a matmul weight (2-D, any type the backends take).
    pub(crate) fn is_matmul(self) -> bool {
        matches!(
            self,
            Role::Wq
                | Role::Wk
                | Role::Wv
                | Role::Wqkv
                | Role::Wo
                | Role::Gate
                | Role::Up
                | Role::GateUp
                | Role::Down
        )
    }
}

/// Whether a file must hold a tensor. An optional one is read when present (and then refused
/// if its shape is wrong), never skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Need {
    Required,
    Optional,
}

/// One tensor of every layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerTensor {
    pub role: Role,
    /// The name after `blk.N.`.
    pub name: &'static str,
    /// `[k, n]` of a matmul weight, `[n]` of a vector.
    pub shape: &'static [Dim],
    pub need: Need,
    /// Why a required tensor is required, for the error when it is missing ("" = the
    /// architecture's plain structure).
    pub why: &'static str,
}

const fn t(role: Role, name: &'static str, shape: &'static [Dim], need: Need) -> LayerTensor {
    LayerTensor {
        role,
        name,
        shape,
        need,
        why: "",
    }
}

const fn bias(role: Role, name: &'static str, shape: &'static [Dim], need: Need) -> LayerTensor {
    LayerTensor {
        role,
        name,
        shape,
        need,
        why: "has Q/K/V biases",
    }
}

use Dim::{Embd, Ff, Head, Kv, Qkv, TwoFf, Q};
use Need::{Optional, Required};

// The rows the tables share.
const ATTN_NORM: LayerTensor = t(Role::AttnNorm, "attn_norm.weight", &[Embd], Required);
const WQ: LayerTensor = t(Role::Wq, "attn_q.weight", &[Embd, Q], Required);
const WK: LayerTensor = t(Role::Wk, "attn_k.weight", &[Embd, Kv], Required);
const WV: LayerTensor = t(Role::Wv, "attn_v.weight", &[Embd, Kv], Required);
const BQ: LayerTensor = bias(Role::BiasQ, "attn_q.bias", &[Q], Optional);
const BK: LayerTensor = bias(Role::BiasK, "attn_k.bias", &[Kv], Optional);
const BV: LayerTensor = bias(Role::BiasV, "attn_v.bias", &[Kv], Optional);
const Q_NORM: LayerTensor = t(Role::QNorm, "attn_q_norm.weight", &[Head], Required);
const K_NORM: LayerTensor = t(Role::KNorm, "attn_k_norm.weight", &[Head], Required);
const WO: LayerTensor = t(Role::Wo, "attn_output.weight", &[Q, Embd], Required);
const FFN_NORM: LayerTensor = t(Role::FfnNorm, "ffn_norm.weight", &[Embd], Required);
const GATE: LayerTensor = t(Role::Gate, "ffn_gate.weight", &[Embd, Ff], Required);
const UP: LayerTensor = t(Role::Up, "ffn_up.weight", &[Embd, Ff], Required);
const DOWN: LayerTensor = t(Role::Down, "ffn_down.weight", &[Ff, Embd], Required);

/// `row`, required.
const fn required(row: LayerTensor) -> LayerTensor {
    LayerTensor {
        need: Required,
        ..row
    }
}

/// llama (biases optional: llama.cpp's llama reads them when present).
const LLAMA: &[LayerTensor] = &[
    ATTN_NORM, WQ, BQ, WK, BK, WV, BV, WO, FFN_NORM, GATE, UP, DOWN,
];

/// qwen2: llama's layer with the Q/K/V biases required.
const QWEN2: &[LayerTensor] = &[
    ATTN_NORM,
    WQ,
    required(BQ),
    WK,
    required(BK),
    WV,
    required(BV),
    WO,
    FFN_NORM,
    GATE,
    UP,
    DOWN,
];

/// qwen3: llama's layer and a per-head RMSNorm of Q and K.
const QWEN3: &[LayerTensor] = &[
    ATTN_NORM, WQ, BQ, WK, BK, WV, BV, Q_NORM, K_NORM, WO, FFN_NORM, GATE, UP, DOWN,
];

/// gemma3: qwen3's layer and the post-attention and post-FFN norms.
const GEMMA3: &[LayerTensor] = &[
    ATTN_NORM,
    WQ,
    BQ,
    WK,
    BK,
    WV,
    BV,
    Q_NORM,
    K_NORM,
    WO,
    t(
        Role::PostAttnNorm,
        "post_attention_norm.weight",
        &[Embd],
        Required,
    ),
    FFN_NORM,
    GATE,
    UP,
    DOWN,
    t(Role::PostFfnNorm, "post_ffw_norm.weight", &[Embd], Required),
];

/// phi3 (as its converter writes it): one [q | k | v] projection and one [gate | up]
/// projection, no biases.
const PHI3: &[LayerTensor] = &[
    ATTN_NORM,
    t(Role::Wqkv, "attn_qkv.weight", &[Embd, Qkv], Required),
    WO,
    FFN_NORM,
    t(Role::GateUp, "ffn_up.weight", &[Embd, TwoFf], Required),
    DOWN,
];

/// An architecture's tensors beside the layers' (`token_embd.weight`, `output_norm.weight`
/// and an optional `output.weight` are every architecture's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ArchTensors {
    pub layer: &'static [LayerTensor],
    /// Llama 3.x's `rope_freqs.weight` (n_rot/2 factors shared by every layer; llama.cpp reads
    /// it for llama only, so another architecture's file with it is refused as unused).
    pub rope_freqs: bool,
}

pub(crate) fn of(arch: Arch) -> ArchTensors {
    let (layer, rope_freqs) = match arch {
        Arch::Llama => (LLAMA, true),
        Arch::Qwen2 => (QWEN2, false),
        Arch::Qwen3 => (QWEN3, false),
        Arch::Gemma3 => (GEMMA3, false),
        Arch::Phi3 => (PHI3, false),
    };
    ArchTensors { layer, rope_freqs }
}

/// Tensors a file may carry that the forward pass does not read, because llama.cpp does not
/// read them either: `(name pattern, reason)`, `blk.*.` standing for every layer.
///
/// Empty, as verified in the llama.cpp that kiln is tested against (llama-cpp-python 0.3.36's
/// vendored `src/models/{llama,qwen2,qwen3}.cpp` and `llama-model-loader.cpp`): for these
/// architectures every tensor its loader creates feeds the graph, and a file with any other
/// tensor fails there (`done_getting_tensors`: "wrong number of tensors"). llama.cpp skips a
/// tensor only when its `llm_tensor_info` op is `GGML_OP_NONE` (none of these architectures'
/// tensors) or an architecture loads it with `TENSOR_SKIP` (multi-token-prediction layers of other
/// architectures). An entry belongs here only with such a line of llama.cpp to point to.
pub const IGNORED_TENSORS: &[(&str, &str)] = &[];

/// Whether `name` matches an [`IGNORED_TENSORS`]-style pattern (`blk.*.` = any layer number).
pub(crate) fn matches_pattern(pattern: &str, name: &str) -> bool {
    match pattern.split_once("blk.*.") {
        None => pattern == name,
        Some((pre, post)) => name
            .strip_prefix(pre)
            .and_then(|r| r.strip_prefix("blk."))
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(l, rest)| {
                !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()) && rest == post
            }),
    }
}

/// The file's tensors that were not read and are not in `allowed`, sorted.
pub(crate) fn unused_tensors<'a>(
    all: impl Iterator<Item = &'a str>,
    used: &HashSet<String>,
    allowed: &[(&str, &str)],
) -> Vec<&'a str> {
    let mut out: Vec<&str> = all
        .filter(|n| !used.contains(*n) && !allowed.iter().any(|(p, _)| matches_pattern(p, n)))
        .collect();
    out.sort_unstable();
    out
}

/// An F32 tensor's values, borrowed from the mapping (tensors are 32-byte aligned in the file
/// and the mapping is page-aligned, so the cast is checked, not assumed).
pub(crate) fn f32_view<'m>(t: &TensorView<'m>) -> Result<&'m [f32]> {
    ensure!(
        t.ty == GgmlType::F32,
        "tensor {} is {}, kiln reads norms and biases as F32",
        t.name,
        t.ty
    );
    ensure!(
        cfg!(target_endian = "little"),
        "F32 views need a little-endian host"
    );
    // SAFETY: any bit pattern is a valid f32; align_to only yields the aligned middle part,
    // and we require it to be the whole slice.
    let (pre, mid, post) = unsafe { t.data.align_to::<f32>() };
    ensure!(
        pre.is_empty() && post.is_empty(),
        "tensor {} is not 4-byte aligned in the mapping",
        t.name
    );
    Ok(mid)
}

/// Reads tensors from the file and remembers every name it handed out, so that the load can
/// refuse a file whose tensors the forward pass does not all use.
pub(crate) struct Reader<'m> {
    f: &'m GgufFile,
    used: std::cell::RefCell<HashSet<String>>,
}

impl<'m> Reader<'m> {
    pub(crate) fn new(f: &'m GgufFile) -> Reader<'m> {
        Reader {
            f,
            used: Default::default(),
        }
    }

    pub(crate) fn path(&self) -> std::path::Display<'_> {
        self.f.path().display()
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.f.tensor(name).is_some()
    }

    /// `name`, whose shape must be `dims` (ggml's order).
    pub(crate) fn tensor(&self, name: &str, dims: &[usize]) -> Result<TensorView<'m>> {
        let t = self
            .f
            .tensor(name)
            .with_context(|| format!("{}: tensor {name} is missing", self.path()))?;
        let got: Vec<u64> = t.ne[..t.n_dims as usize].to_vec();
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        ensure!(
            got == want,
            "{}: tensor {name} has shape {got:?}, the metadata implies {want:?}",
            self.path()
        );
        self.mark_used(name);
        Ok(t)
    }

    pub(crate) fn vector(&self, name: &str, n: usize) -> Result<&'m [f32]> {
        f32_view(&self.tensor(name, &[n])?).with_context(|| self.path().to_string())
    }

    pub(crate) fn opt_vector(&self, name: &str, n: usize) -> Result<Option<&'m [f32]>> {
        if !self.has(name) {
            return Ok(None);
        }
        self.vector(name, n).map(Some)
    }

    pub(crate) fn mark_used(&self, name: &str) {
        self.used.borrow_mut().insert(name.to_string());
    }

    /// Every tensor of the file is read, or an error naming all the others (sorted).
    pub(crate) fn check_all_used(&self) -> Result<()> {
        let used = self.used.borrow();
        let unused = unused_tensors(self.f.tensors().map(|t| t.name), &used, IGNORED_TENSORS);
        if !unused.is_empty() {
            bail!(
                "{}: {} tensor(s) in the file are not used by kiln's forward pass for this \
                 architecture (refused rather than ignored): {}",
                self.path(),
                unused.len(),
                unused.join(", ")
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every table names each role once, matmul roles with two dimensions and the rest with
    /// one, and holds what its architecture's forward pass needs: a Q/K/V path (fused or
    /// separate), an output projection, a gate/up path and a down projection.
    #[test]
    fn every_architecture_table_is_well_formed() {
        for arch in [
            Arch::Llama,
            Arch::Qwen2,
            Arch::Qwen3,
            Arch::Gemma3,
            Arch::Phi3,
        ] {
            let tab = of(arch).layer;
            let mut roles: Vec<Role> = tab.iter().map(|x| x.role).collect();
            roles.sort();
            let n = roles.len();
            roles.dedup();
            assert_eq!(roles.len(), n, "{arch:?}: a role twice");
            let names: HashSet<&str> = tab.iter().map(|x| x.name).collect();
            assert_eq!(names.len(), n, "{arch:?}: a name twice");
            for x in tab {
                let dims = if x.role.is_matmul() { 2 } else { 1 };
                assert_eq!(x.shape.len(), dims, "{arch:?} {}", x.name);
            }
            let has = |r: Role| roles.contains(&r);
            assert!(has(Role::Wqkv) != (has(Role::Wq) && has(Role::Wk) && has(Role::Wv)));
            assert!(has(Role::GateUp) != (has(Role::Gate) && has(Role::Up)));
            for r in [Role::AttnNorm, Role::Wo, Role::FfnNorm, Role::Down] {
                assert!(has(r), "{arch:?} lacks {r:?}");
            }
            assert_eq!(has(Role::QNorm), arch.qk_norm(), "{arch:?}");
            assert_eq!(has(Role::PostAttnNorm), arch.gemma(), "{arch:?}");
            let required_bias = tab
                .iter()
                .any(|x| x.role == Role::BiasQ && x.need == Need::Required);
            assert_eq!(required_bias, arch.qkv_bias_required(), "{arch:?}");
        }
    }
}
