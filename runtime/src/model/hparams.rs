//! Hyper-parameters from GGUF metadata, checked once at the edge: every missing or inconsistent
//! key is an error that names it, and architectures other than llama / qwen2 / qwen3 are refused
//! by name.

use crate::gguf::Gguf;
use anyhow::{bail, Context, Result};

/// How RoPE pairs the values of a head (`llama_model_rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum RopeKind {
    /// llama: consecutive pairs (2i, 2i+1).
    Norm,
    /// qwen2, qwen3: pairs (i, i + n_rot/2).
    Neox,
}

/// The supported architectures and the flags that tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Arch> {
        Ok(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => bail!(
                "general.architecture = {other:?} is not supported (kiln runs llama, qwen2, qwen3)"
            ),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    pub fn rope(self) -> RopeKind {
        match self {
            Arch::Llama => RopeKind::Norm,
            Arch::Qwen2 | Arch::Qwen3 => RopeKind::Neox,
        }
    }

    /// qwen2 always carries Q/K/V biases; llama may.
    pub fn qkv_bias_required(self) -> bool {
        self == Arch::Qwen2
    }

    /// qwen3 normalises each Q and K head before RoPE.
    pub fn qk_norm(self) -> bool {
        self == Arch::Qwen3
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
    pub n_ctx_train: usize,
    /// Attention scale: `attention.scale` when the file has it, else 1/sqrt(head_dim).
    pub kq_scale: f32,
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

impl HParams {
    pub fn from_gguf(g: &Gguf) -> Result<HParams> {
        let arch_v = g
            .get("general.architecture")
            .context("metadata key general.architecture is missing")?;
        let arch_name = arch_v
            .as_str()
            .context("metadata key general.architecture is not a string")?;
        let arch = Arch::parse(arch_name)?;
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let n_layer = req_int(g, &k("block_count"))?;
        let n_embd = req_int(g, &k("embedding_length"))?;
        let n_ff = req_int(g, &k("feed_forward_length"))?;
        let n_head = req_int(g, &k("attention.head_count"))?;
        // llama.cpp's default when the key is absent: as many KV heads as query heads.
        let n_head_kv = match int(g, &k("attention.head_count_kv"))? {
            Some(0) => bail!("metadata key {} is 0", k("attention.head_count_kv")),
            Some(v) => v,
            None => n_head,
        };
        if n_head % n_head_kv != 0 {
            bail!(
                "{} = {n_head} is not a multiple of {} = {n_head_kv} (GQA shares each KV head \
                 by a whole number of query heads)",
                k("attention.head_count"),
                k("attention.head_count_kv")
            );
        }
        let head_dim = match int(g, &k("attention.key_length"))? {
            Some(0) => bail!("metadata key {} is 0", k("attention.key_length")),
            Some(v) => v,
            None => {
                if n_embd % n_head != 0 {
                    bail!(
                        "{} is absent and {} = {n_embd} is not a multiple of {} = {n_head}",
                        k("attention.key_length"),
                        k("embedding_length"),
                        k("attention.head_count")
                    );
                }
                n_embd / n_head
            }
        };
        if let Some(vl) = int(g, &k("attention.value_length"))? {
            if vl != head_dim {
                bail!(
                    "{} = {vl} differs from the key length {head_dim}; kiln needs them equal",
                    k("attention.value_length")
                );
            }
        }
        let n_rot = int(g, &k("rope.dimension_count"))?.unwrap_or(head_dim);
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            bail!(
                "{} = {n_rot} must be even and in 1..={head_dim} (the head dimension)",
                k("rope.dimension_count")
            );
        }
        let eps_key = k("attention.layer_norm_rms_epsilon");
        let eps =
            float(g, &eps_key)?.with_context(|| format!("metadata key {eps_key} is missing"))?;
        if !(eps > 0.0 && eps.is_finite()) {
            bail!("metadata key {eps_key} = {eps} is not a positive number");
        }
        let freq_base = float(g, &k("rope.freq_base"))?.unwrap_or(10000.0);
        if !(freq_base > 0.0 && freq_base.is_finite()) {
            bail!(
                "metadata key {} = {freq_base} is not a positive number",
                k("rope.freq_base")
            );
        }
        if let Some(v) = g.get(&k("rope.scaling.type")) {
            let t = v.as_str().unwrap_or("?");
            if t != "none" {
                bail!(
                    "metadata key {} = {t:?}: RoPE scaling is not supported",
                    k("rope.scaling.type")
                );
            }
        }
        if let Some(n) = int(g, &k("expert_count"))? {
            if n > 0 {
                bail!(
                    "metadata key {} = {n}: mixture-of-experts models are not supported",
                    k("expert_count")
                );
            }
        }
        let n_ctx_train = req_int(g, &k("context_length"))?;
        let kq_scale = match float(g, &k("attention.scale"))? {
            Some(s) if s != 0.0 => s,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        Ok(HParams {
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
            n_ctx_train,
            kq_scale,
        })
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
