//! Hyper-parameters from GGUF metadata, checked once at the edge: every missing or inconsistent
//! key is an error that names it, and architectures other than llama / qwen2 / qwen3 / gemma3 /
//! phi3 are refused by name.
//!
//! Every `{arch}.` key is accounted for ([`audit_arch_keys`]): kiln either applies it
//! ([`APPLIED_KEYS`]), knows it does not change the maths of these architectures
//! ([`HARMLESS_KEYS`]), or accepts it only at its neutral value ([`NEUTRAL_KEYS`]); any other
//! `{arch}.` key refuses the load, all of them named in one error. The list is closed on purpose:
//! a key kiln has never heard of may be one that changes the maths (a sliding window, a soft-cap,
//! a scale), and a model that runs with part of its definition silently dropped gives plausible
//! text and wrong logits. Keys under `general.` and `tokenizer.` (and other prefixes llama.cpp
//! does not read as hyper-parameters, e.g. `quantize.imatrix.*`) are not audited here.

use crate::gguf::{Gguf, Value};
use anyhow::{bail, Context, Result};

/// How RoPE pairs the values of a head (`llama_model_rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RopeKind {
    /// llama: consecutive pairs (2i, 2i+1).
    Norm,
    /// qwen2, qwen3, gemma3: pairs (i, i + n_rot/2).
    Neox,
}

/// The supported architectures and the flags that tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    /// Gemma 3 (text): embeddings scaled by sqrt(n_embd), Q/K norms, post-attention and
    /// post-FFN norms, GELU(tanh)-gated FFN, Q pre-scaled, interleaved sliding-window layers
    /// with their own RoPE base, optional final logit soft-cap (llama-cpp-python 0.3.36's
    /// `src/models/gemma3.cpp`).
    Gemma3,
    /// Phi-3 (`src/models/phi3.cpp`): fused `attn_qkv`, fused gate/up `ffn_up` (2·n_ff wide, the
    /// gate first), Q pre-scaled by 1/sqrt(head_dim); LongRoPE factors refused.
    Phi3,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Arch> {
        Ok(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            "phi3" => Arch::Phi3,
            other => bail!(
                "general.architecture = {other:?} is not supported (kiln runs llama, qwen2, \
                 qwen3, gemma3, phi3)"
            ),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    pub fn rope(self) -> RopeKind {
        match self {
            Arch::Llama => RopeKind::Norm,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Phi3 => RopeKind::Neox,
        }
    }

    /// qwen2 always carries Q/K/V biases; llama may.
    pub fn qkv_bias_required(self) -> bool {
        self == Arch::Qwen2
    }

    /// qwen3 and gemma3 normalise each Q and K head before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Gemma3)
    }

    /// gemma3 normalises the attention output and the FFN output before each residual add
    /// (`post_attention_norm`, `post_ffw_norm`), scales the embeddings by sqrt(n_embd) and gates
    /// its FFN with GELU(tanh) instead of SiLU.
    pub fn gemma(self) -> bool {
        self == Arch::Gemma3
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct HParams {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dimensions per head (`rope.dimension_count`, default head_dim).
    pub n_rot: usize,
    pub eps: f32,
    pub freq_base: f32,
    /// RoPE position scale (llama.cpp's `freq_scale`): 1/`rope.scaling.factor` under linear
    /// scaling (the default type when the factor is given, as in llama.cpp), else 1.
    pub freq_scale: f32,
    pub n_ctx_train: usize,
    /// Attention scale inside the softmax: `attention.scale` when the file has it, else
    /// 1/sqrt(head_dim); 1 for gemma3, which scales Q instead ([`HParams::q_scale`]).
    pub kq_scale: f32,
    /// gemma3's `f_attention_scale`, multiplied into Q after RoPE (before Q meets the f16 cache):
    /// 1/sqrt(head_dim), or 1/sqrt(n_embd/n_head) for the 62-layer (27B) model, as llama.cpp
    /// decides by layer count. 1 (not applied) for the others.
    pub q_scale: f32,
    /// Sliding-window attention: the window `n_swa` (`attention.sliding_window`) and which layers
    /// use it; `None` when every layer attends to the whole context.
    pub swa: Option<Swa>,
    /// The RoPE base of sliding-window layers (`rope.freq_base_swa`, default 10000); they never
    /// take the file's RoPE scaling (llama.cpp's `rope_freq_scale_train_swa` is always 1).
    pub freq_base_swa: f32,
    /// `final_logit_softcapping`: logits = cap·tanh(logits/cap) (gemma3, when the file sets it).
    pub final_softcap: Option<f32>,
    /// gemma3: the embeddings are multiplied by sqrt(n_embd) (in f32, as `ggml_scale`).
    pub embd_scale: Option<f32>,
}

/// Which layers attend through a sliding window, and its width.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Swa {
    /// A query at position p sees the keys at positions k with p − k < n_swa (llama.cpp's
    /// `LLAMA_SWA_TYPE_STANDARD`: masked when p − k ≥ n_swa), i.e. itself and n_swa − 1 before.
    pub n_swa: usize,
    /// One flag per layer: true where the layer uses the window.
    pub layers: Vec<bool>,
}

impl HParams {
    /// Whether layer `l` attends through the sliding window.
    pub fn is_swa(&self, l: usize) -> bool {
        self.swa
            .as_ref()
            .is_some_and(|s| s.layers.get(l).copied().unwrap_or(false))
    }

    /// The first cache position a query at `pos` attends to in layer `l`.
    pub fn first_visible(&self, l: usize, pos: usize) -> usize {
        match &self.swa {
            Some(s) if self.is_swa(l) => (pos + 1).saturating_sub(s.n_swa),
            _ => 0,
        }
    }
}

/// `{arch}.` keys kiln reads and applies (`HParams::from_gguf`, or the tokenizer/model for
/// `vocab_size`-like facts): suffixes after `{arch}.`.
pub const APPLIED_KEYS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.scale",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
];

/// `{arch}.` keys one architecture applies on top of [`APPLIED_KEYS`] (read as llama.cpp's
/// `load_arch_hparams` for it reads them); for the other architectures they stay in
/// [`NEUTRAL_KEYS`] or unknown.
pub const ARCH_APPLIED_KEYS: &[(Arch, &[&str])] = &[(
    Arch::Gemma3,
    &[
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
        "final_logit_softcapping",
    ],
)];

/// Keys of [`APPLIED_KEYS`] that an architecture's llama.cpp graph does not read: refused by
/// name for it, with the reason (a file that sets one means something llama.cpp does not run).
pub const ARCH_REFUSED_KEYS: &[(Arch, &str, &str)] = &[
    (
        Arch::Gemma3,
        "attention.scale",
        "llama.cpp's gemma3 ignores it and scales Q by 1/sqrt(key_length) (1/sqrt(n_embd/n_head) \
         for 62 layers)",
    ),
    (
        Arch::Phi3,
        "attention.scale",
        "llama.cpp's phi3 ignores it and scales Q by 1/sqrt(head_dim)",
    ),
];

/// `{arch}.` keys that one architecture's llama.cpp reads and then does not use, with the
/// reason: accepted at any value for it.
pub const ARCH_HARMLESS_KEYS: &[(Arch, &str, &str)] = &[(
    Arch::Phi3,
    "attention.sliding_window",
    "llama.cpp's phi3 reads it and turns the window off (swa_type NONE, n_swa 0: \
     \"Phi SWA is currently disabled\"); every layer attends fully",
)];

/// `{arch}.` keys that do not change what llama.cpp computes for llama / qwen2 / qwen3 (read in
/// llama.cpp's `llama_model_base::load_hparams` / `llama-context.cpp` of the pinned
/// llama-cpp-python 0.3.36), with the reason.
pub const HARMLESS_KEYS: &[(&str, &str)] = &[
    (
        "vocab_size",
        "llama.cpp uses it only to name the model size; the vocabulary is the token list",
    ),
    (
        "rope.scaling.original_context_length",
        "llama.cpp passes it to RoPE only for the YaRN ramp, and kiln refuses YaRN",
    ),
    (
        "rope.scaling.finetuned",
        "llama.cpp stores it and never reads it back",
    ),
];

/// What value of a key leaves the maths unchanged.
#[derive(Clone, Copy, Debug)]
pub enum Neutral {
    /// 0, 0.0, false (counts, windows, soft-caps, biases off).
    Zero,
    /// 1.0 or 0.0 (a multiplier; llama.cpp reads 0 as "not set").
    Scale,
    /// true.
    True,
}

/// `{arch}.` keys kiln does not apply, accepted only at their neutral value (converters write
/// some so, e.g. a sliding window of 0 when every layer attends fully), refused by name otherwise.
pub const NEUTRAL_KEYS: &[(&str, Neutral)] = &[
    ("expert_count", Neutral::Zero),
    ("expert_used_count", Neutral::Zero),
    ("expert_shared_count", Neutral::Zero),
    ("expert_group_count", Neutral::Zero),
    ("expert_group_used_count", Neutral::Zero),
    ("expert_feed_forward_length", Neutral::Zero),
    ("expert_shared_feed_forward_length", Neutral::Zero),
    ("nextn_predict_layers", Neutral::Zero),
    ("pooling_type", Neutral::Zero),
    ("use_parallel_residual", Neutral::Zero),
    ("attention.sliding_window", Neutral::Zero),
    ("attention.clamp_kqv", Neutral::Zero),
    ("attention.max_alibi_bias", Neutral::Zero),
    ("attn_logit_softcapping", Neutral::Zero),
    ("final_logit_softcapping", Neutral::Zero),
    ("router_logit_softcapping", Neutral::Zero),
    ("embedding_scale", Neutral::Scale),
    ("residual_scale", Neutral::Scale),
    ("logit_scale", Neutral::Scale),
    ("rope.scaling.attn_factor", Neutral::Scale),
    ("attention.causal", Neutral::True),
];

fn is_neutral(v: &Value, n: Neutral) -> bool {
    let x = match v {
        Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        other => other.as_f64().or_else(|| other.as_int().map(|i| i as f64)),
    };
    match (n, x) {
        (Neutral::Zero, Some(x)) => x == 0.0,
        (Neutral::Scale, Some(x)) => x == 0.0 || x == 1.0,
        (Neutral::True, _) => matches!(v, Value::Bool(true)),
        (_, None) => false,
    }
}

/// Every `{arch}.` key that kiln neither applies, nor knows harmless, nor finds at its neutral
/// value: refused, all named (sorted) in one error.
pub fn audit_arch_keys(g: &Gguf, arch: Arch) -> Result<()> {
    let prefix = format!("{}.", arch.name());
    let mut refused: Vec<String> = Vec::new();
    for (key, v) in g.metadata() {
        let Some(suffix) = key.strip_prefix(&prefix) else {
            continue;
        };
        if let Some((_, _, why)) = ARCH_REFUSED_KEYS
            .iter()
            .find(|(a, k, _)| *a == arch && *k == suffix)
        {
            refused.push(format!("{key} = {} ({why})", v.summary(4)));
            continue;
        }
        let arch_applied = ARCH_APPLIED_KEYS
            .iter()
            .any(|(a, ks)| *a == arch && ks.contains(&suffix))
            || ARCH_HARMLESS_KEYS
                .iter()
                .any(|(a, k, _)| *a == arch && *k == suffix);
        if arch_applied
            || APPLIED_KEYS.contains(&suffix)
            || HARMLESS_KEYS.iter().any(|(k, _)| *k == suffix)
        {
            continue;
        }
        match NEUTRAL_KEYS.iter().find(|(k, _)| *k == suffix) {
            Some(&(_, n)) if is_neutral(v, n) => {}
            Some(_) => refused.push(format!(
                "{key} = {} (kiln does not apply it; only its neutral value is accepted)",
                v.summary(4)
            )),
            None => refused.push(format!(
                "{key} = {} (not a key kiln applies or knows to be harmless)",
                v.summary(4)
            )),
        }
    }
    if !refused.is_empty() {
        refused.sort();
        bail!(
            "{} metadata key(s) that change or may change the maths are not supported: {}",
            refused.len(),
            refused.join("; ")
        );
    }
    Ok(())
}

fn int(g: &Gguf, key: &str) -> Result<Option<usize>> {
    g.get_int::<usize>(key).map_err(|e| anyhow::anyhow!("{e}"))
}

fn req_int(g: &Gguf, key: &str) -> Result<usize> {
    let v = int(g, key)?.with_context(|| format!("metadata key {key} is missing"))?;
    if v == 0 {
        bail!("metadata key {key} is 0");
    }
    Ok(v)
}

fn float(g: &Gguf, key: &str) -> Result<Option<f32>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .with_context(|| format!("metadata key {key} is {}, not a float", v.value_type())),
    }
}

/// gemma3's sliding window as llama.cpp's `llama_model_gemma3::load_arch_hparams` reads it: a
/// window `attention.sliding_window` > 0 turns it on; which layers use it comes from
/// `attention.sliding_window_pattern` as an array (one bool per layer: true = windowed) or a
/// number n (default 6), where layer l is windowed unless l % n == n − 1 (every n-th layer
/// attends globally; n = 0 windows every layer). A window of 0 or none: every layer is global.
fn read_swa(g: &Gguf, a: &str, n_layer: usize) -> Result<Option<Swa>> {
    let key = format!("{a}.attention.sliding_window");
    let n_swa = match int(g, &key)? {
        None | Some(0) => return Ok(None),
        Some(n) => n,
    };
    let pkey = format!("{a}.attention.sliding_window_pattern");
    let layers = match g.get(&pkey) {
        None => pattern_layers(6, n_layer),
        Some(Value::Array(_, items)) => {
            if items.len() != n_layer {
                bail!(
                    "metadata key {pkey} has {} entries, the model has {n_layer} layers",
                    items.len()
                );
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Bool(b) => Ok(*b),
                    other => other
                        .as_int()
                        .map(|x| x != 0)
                        .with_context(|| format!("metadata key {pkey}[{i}] is not a bool")),
                })
                .collect::<Result<Vec<bool>>>()?
        }
        Some(v) => {
            let n = v
                .as_int()
                .with_context(|| format!("metadata key {pkey} is not a number or an array"))?;
            let n = usize::try_from(n)
                .with_context(|| format!("metadata key {pkey} = {n} is negative"))?;
            pattern_layers(n, n_layer)
        }
    };
    Ok(Some(Swa { n_swa, layers }))
}

/// llama.cpp's `set_swa_pattern(n, dense_first = false)`.
fn pattern_layers(n: usize, n_layer: usize) -> Vec<bool> {
    (0..n_layer).map(|l| n == 0 || l % n < n - 1).collect()
}

/// An architecture's metadata keys: `{arch}.{name}`.
struct Keys(&'static str);

impl Keys {
    fn k(&self, s: &str) -> String {
        format!("{}.{s}", self.0)
    }
}

/// `(n_head, n_head_kv, head_dim)`: llama.cpp's defaults where a key is absent (as many KV heads
/// as query heads; head_dim = n_embd/n_head), refused where they cannot hold.
fn read_heads(g: &Gguf, k: &Keys, n_embd: usize) -> Result<(usize, usize, usize)> {
    let n_head = req_int(g, &k.k("attention.head_count"))?;
    let n_head_kv = match int(g, &k.k("attention.head_count_kv"))? {
        Some(0) => bail!("metadata key {} is 0", k.k("attention.head_count_kv")),
        Some(v) => v,
        None => n_head,
    };
    if n_head % n_head_kv != 0 {
        bail!(
            "{} = {n_head} is not a multiple of {} = {n_head_kv} (GQA shares each KV head \
             by a whole number of query heads)",
            k.k("attention.head_count"),
            k.k("attention.head_count_kv")
        );
    }
    let head_dim = match int(g, &k.k("attention.key_length"))? {
        Some(0) => bail!("metadata key {} is 0", k.k("attention.key_length")),
        Some(v) => v,
        None => {
            if n_embd % n_head != 0 {
                bail!(
                    "{} is absent and {} = {n_embd} is not a multiple of {} = {n_head}",
                    k.k("attention.key_length"),
                    k.k("embedding_length"),
                    k.k("attention.head_count")
                );
            }
            n_embd / n_head
        }
    };
    if let Some(vl) = int(g, &k.k("attention.value_length"))? {
        if vl != head_dim {
            bail!(
                "{} = {vl} differs from the key length {head_dim}; kiln needs them equal",
                k.k("attention.value_length")
            );
        }
    }
    Ok((n_head, n_head_kv, head_dim))
}

/// A float key that must be a positive number when present.
fn positive(g: &Gguf, key: &str) -> Result<Option<f32>> {
    match float(g, key)? {
        Some(v) if !(v > 0.0 && v.is_finite()) => {
            bail!("metadata key {key} = {v} is not a positive number")
        }
        v => Ok(v),
    }
}

/// `(n_rot, freq_base, freq_scale)`. RoPE scaling as llama.cpp reads it: the type defaults to
/// "linear", the factor to `rope.scaling.factor`, else the old `rope.scale_linear`; freq_scale =
/// 1/factor (a factor of 0 or none means 1), and "none" never scales.
fn read_rope(g: &Gguf, k: &Keys, head_dim: usize) -> Result<(usize, f32, f32)> {
    let n_rot = int(g, &k.k("rope.dimension_count"))?.unwrap_or(head_dim);
    if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
        bail!(
            "{} = {n_rot} must be even and in 1..={head_dim} (the head dimension)",
            k.k("rope.dimension_count")
        );
    }
    let freq_base = positive(g, &k.k("rope.freq_base"))?.unwrap_or(10000.0);
    let type_key = k.k("rope.scaling.type");
    let scaling = match g.get(&type_key) {
        None => "linear",
        Some(v) => v
            .as_str()
            .with_context(|| format!("metadata key {type_key} is not a string"))?,
    };
    let factor_key = if g.get(&k.k("rope.scaling.factor")).is_some() {
        k.k("rope.scaling.factor")
    } else {
        k.k("rope.scale_linear")
    };
    let factor = float(g, &factor_key)?.unwrap_or(0.0);
    if !(factor >= 0.0 && factor.is_finite()) {
        bail!("metadata key {factor_key} = {factor} is not a non-negative number");
    }
    let freq_scale = match scaling {
        "none" => 1.0,
        "linear" if factor == 0.0 => 1.0,
        "linear" => 1.0 / factor,
        "yarn" | "longrope" => bail!(
            "metadata key {type_key} = {scaling:?}: {scaling} RoPE scaling is not \
             implemented by kiln (it applies none, linear and rope_freqs factors)"
        ),
        other => bail!(
            "metadata key {type_key} = {other:?}: unknown RoPE scaling type (llama.cpp \
             knows none, linear, yarn, longrope)"
        ),
    };
    Ok((n_rot, freq_base, freq_scale))
}

impl HParams {
    pub fn from_gguf(g: &Gguf) -> Result<HParams> {
        let arch_v = g
            .get("general.architecture")
            .context("metadata key general.architecture is missing")?;
        let arch_name = arch_v
            .as_str()
            .context("metadata key general.architecture is not a string")?;
        let arch = Arch::parse(arch_name)?;
        let k = Keys(arch.name());
        let n_layer = req_int(g, &k.k("block_count"))?;
        let n_embd = req_int(g, &k.k("embedding_length"))?;
        let n_ff = req_int(g, &k.k("feed_forward_length"))?;
        let (n_head, n_head_kv, head_dim) = read_heads(g, &k, n_embd)?;
        let (n_rot, freq_base, freq_scale) = read_rope(g, &k, head_dim)?;
        let eps_key = k.k("attention.layer_norm_rms_epsilon");
        let eps =
            positive(g, &eps_key)?.with_context(|| format!("metadata key {eps_key} is missing"))?;
        let n_ctx_train = req_int(g, &k.k("context_length"))?;
        let kq_scale = match float(g, &k.k("attention.scale"))? {
            Some(s) if s != 0.0 => s,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        audit_arch_keys(g, arch)?;
        let mut hp = HParams {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            eps,
            freq_base,
            freq_scale,
            n_ctx_train,
            kq_scale,
            q_scale: 1.0,
            swa: None,
            freq_base_swa: 10000.0,
            final_softcap: None,
            embd_scale: None,
        };
        match arch {
            Arch::Gemma3 => hp.read_gemma3(g, &k)?,
            Arch::Phi3 => {
                // llama.cpp: Qcur × 1/sqrtf(n_embd_head), then the softmax at scale 1.
                hp.q_scale = 1.0 / (head_dim as f32).sqrt();
                hp.kq_scale = 1.0;
            }
            _ => {}
        }
        Ok(hp)
    }

    /// Gemma 3's pieces: Q's pre-scale, the embedding scale, the sliding window and its RoPE
    /// base, the final logit soft-cap.
    fn read_gemma3(&mut self, g: &Gguf, k: &Keys) -> Result<()> {
        // llama.cpp: 1/sqrt(n_embd/n_head) for LLM_TYPE_27B (62 layers), else
        // 1/sqrt(n_embd_head_k); applied to Q, the softmax scale is 1.
        self.q_scale = if self.n_layer == 62 {
            1.0 / ((self.n_embd / self.n_head) as f32).sqrt()
        } else {
            1.0 / (self.head_dim as f32).sqrt()
        };
        self.kq_scale = 1.0;
        self.embd_scale = Some((self.n_embd as f32).sqrt());
        self.swa = read_swa(g, k.0, self.n_layer)?;
        if self.swa.is_some() {
            if let Some(b) = positive(g, &k.k("rope.freq_base_swa"))? {
                self.freq_base_swa = b;
            }
        }
        let key = k.k("final_logit_softcapping");
        self.final_softcap = match float(g, &key)? {
            None => None,
            Some(0.0) => None,
            Some(c) if c > 0.0 && c.is_finite() => Some(c),
            Some(c) => bail!("metadata key {key} = {c} is not a positive number"),
        };
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::Value;

    fn parse(kv: &[(&str, Value)]) -> Result<HParams> {
        let mut w = GgufWriter::new();
        for (k, v) in kv {
            w.add(*k, v.clone()).unwrap();
        }
        HParams::from_gguf(&Gguf::parse(&w.to_bytes()).unwrap())
    }

    fn llama() -> Vec<(&'static str, Value)> {
        vec![
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::U32(2)),
            ("llama.embedding_length", Value::U32(256)),
            ("llama.feed_forward_length", Value::U32(512)),
            ("llama.attention.head_count", Value::U32(8)),
            ("llama.attention.head_count_kv", Value::U32(4)),
            ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
            ("llama.context_length", Value::U32(128)),
        ]
    }

    #[test]
    fn reads_llama_and_defaults_as_llama_cpp() {
        let h = parse(&llama()).unwrap();
        assert_eq!((h.head_dim, h.n_rot, h.freq_base), (32, 32, 10000.0));
        assert_eq!(h.arch.rope(), RopeKind::Norm);
        let mut kv = llama();
        kv.push(("llama.attention.key_length", Value::U32(64)));
        assert_eq!(parse(&kv).unwrap().head_dim, 64);
    }

    /// llama.cpp's reading: the type defaults to linear, the factor to `rope.scaling.factor` or
    /// the old `rope.scale_linear`; "none" never scales; YaRN and LongRoPE are refused by name.
    #[test]
    fn rope_scaling_as_llama_cpp_reads_it() {
        let scale = |extra: &[(&'static str, Value)]| {
            let mut kv = llama();
            for (k, v) in extra {
                kv.retain(|(old, _)| old != k);
                kv.push((k, v.clone()));
            }
            parse(&kv).map(|h| h.freq_scale)
        };
        let t = |s: &str| ("llama.rope.scaling.type", Value::String(s.into()));
        let f = |x: f32| ("llama.rope.scaling.factor", Value::F32(x));
        assert_eq!(scale(&[]).unwrap(), 1.0);
        assert_eq!(scale(&[t("linear"), f(4.0)]).unwrap(), 0.25);
        assert_eq!(scale(&[f(2.0)]).unwrap(), 0.5, "linear is the default type");
        assert_eq!(
            scale(&[("llama.rope.scale_linear", Value::F32(8.0))]).unwrap(),
            0.125
        );
        assert_eq!(scale(&[t("none"), f(4.0)]).unwrap(), 1.0);
        assert_eq!(scale(&[t("linear"), f(0.0)]).unwrap(), 1.0);
        for ty in ["yarn", "longrope", "dynamic"] {
            let e = format!("{:#}", scale(&[t(ty), f(4.0)]).unwrap_err());
            assert!(
                e.contains(&format!("llama.rope.scaling.type = {ty:?}")),
                "{e}"
            );
        }
        let e = format!("{:#}", scale(&[f(-1.0)]).unwrap_err());
        assert!(e.contains("llama.rope.scaling.factor = -1"), "{e}");
    }

    /// Gemma 3 270M's keys: Q scaled by 1/sqrt(key_length) with the softmax scale 1, the window
    /// on every layer but each sixth (llama.cpp's default pattern), windowed layers at base
    /// 10000 unscaled; the 27B rule (62 layers) scales by 1/sqrt(n_embd/n_head).
    #[test]
    fn gemma3_reads_as_llama_cpp() {
        let gemma = |n_layer: u32, extra: &[(&'static str, Value)]| {
            let mut kv = vec![
                ("general.architecture", Value::String("gemma3".into())),
                ("gemma3.block_count", Value::U32(n_layer)),
                ("gemma3.embedding_length", Value::U32(640)),
                ("gemma3.feed_forward_length", Value::U32(2048)),
                ("gemma3.attention.head_count", Value::U32(4)),
                ("gemma3.attention.head_count_kv", Value::U32(1)),
                ("gemma3.attention.key_length", Value::U32(256)),
                ("gemma3.attention.value_length", Value::U32(256)),
                ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
                ("gemma3.rope.freq_base", Value::F32(1e6)),
                ("gemma3.attention.sliding_window", Value::U32(512)),
                ("gemma3.context_length", Value::U32(32768)),
            ];
            for (k, v) in extra {
                kv.retain(|(old, _)| old != k);
                kv.push((k, v.clone()));
            }
            parse(&kv)
        };
        let h = gemma(18, &[]).unwrap();
        assert_eq!((h.q_scale, h.kq_scale), (1.0 / 16.0, 1.0));
        assert_eq!(h.embd_scale, Some(640f32.sqrt()));
        assert_eq!(h.arch.rope(), RopeKind::Neox);
        let w = h.swa.as_ref().unwrap();
        assert_eq!(w.n_swa, 512);
        let global: Vec<usize> = (0..18).filter(|&l| !h.is_swa(l)).collect();
        assert_eq!(global, [5, 11, 17]);
        assert_eq!(
            (h.freq_base, h.freq_base_swa, h.final_softcap),
            (1e6, 1e4, None)
        );
        assert_eq!((h.first_visible(0, 511), h.first_visible(0, 512)), (0, 1));
        assert_eq!(
            h.first_visible(5, 4000),
            0,
            "a global layer sees everything"
        );
        let h = gemma(62, &[]).unwrap();
        assert_eq!(h.q_scale, 1.0 / 160f32.sqrt());
        let h = gemma(
            18,
            &[
                ("gemma3.rope.freq_base_swa", Value::F32(5e4)),
                ("gemma3.final_logit_softcapping", Value::F32(30.0)),
                ("gemma3.attention.sliding_window_pattern", Value::U32(2)),
            ],
        )
        .unwrap();
        assert_eq!((h.freq_base_swa, h.final_softcap), (5e4, Some(30.0)));
        assert!(h.is_swa(0) && !h.is_swa(1) && h.is_swa(16) && !h.is_swa(17));
        let h = gemma(18, &[("gemma3.attention.sliding_window", Value::U32(0))]).unwrap();
        assert!(h.swa.is_none() && !h.is_swa(0));
        let e = format!(
            "{:#}",
            gemma(18, &[("gemma3.attention.scale", Value::F32(0.0625))]).unwrap_err()
        );
        assert!(
            e.contains("gemma3.attention.scale = 0.0625 (llama.cpp's gemma3 ignores it"),
            "{e}"
        );
        assert_eq!(pattern_layers(0, 3), [true; 3]);
        assert_eq!(pattern_layers(1, 3), [false; 3]);
    }

    #[test]
    fn errors_name_the_key_or_the_architecture() {
        let mut kv = llama();
        kv.retain(|(k, _)| *k != "llama.embedding_length");
        let e = format!("{:#}", parse(&kv).unwrap_err());
        assert!(e.contains("llama.embedding_length is missing"), "{e}");
        let mut kv = llama();
        kv[5].1 = Value::U32(3);
        let e = format!("{:#}", parse(&kv).unwrap_err());
        assert!(e.contains("llama.attention.head_count_kv = 3"), "{e}");
        let mut kv = llama();
        kv[0].1 = Value::String("gpt2".into());
        let e = format!("{:#}", parse(&kv).unwrap_err());
        assert!(e.contains("\"gpt2\" is not supported"), "{e}");
    }
}
