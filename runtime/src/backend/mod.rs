//! Matmul backends. The op is `C[M×N] = A[M×K] · Wᵀ`: `W` is a GGUF weight with `ne0 = K` and
//! `ne1 = N` in any supported type, `A` and `C` are row-major f32.
//!
//! Field lesson (`context/experiment-2026-10-11.txt`): a backend failure must be an error, never an
//! untouched output buffer. [`run_checked`] poisons `C` before every run and turns poison left
//! behind into an error, whatever the backend returned.

pub mod cpu;
pub mod npu;

use crate::ledger::Arrival;
use crate::quant::GgmlType;
use std::fmt;

/// A weight as a backend sees it: a view into the model mapping, never a copy.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'w> {
    pub name: &'w str,
    pub ty: GgmlType,
    /// Inner dimension (ggml `ne0`).
    pub k: usize,
    /// Output features (ggml `ne1`).
    pub n: usize,
    pub data: &'w [u8],
}

/// The shape of one matmul call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulOp {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub ty: GgmlType,
}

impl MatmulOp {
    pub fn for_weight(w: &Weight<'_>, m: usize) -> MatmulOp {
        MatmulOp {
            m,
            k: w.k,
            n: w.n,
            ty: w.ty,
        }
    }
}

/// Why a backend declines an op. Every decline names its reason; the scheduler records them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(tag = "reason")]
pub enum Decline {
    KNotAligned {
        k: usize,
        need: usize,
    },
    NNotAligned {
        n: usize,
        need: usize,
    },
    SmallM {
        m: usize,
        min: usize,
    },
    WeightType {
        ty: String,
    },
    NoDevice {
        why: String,
    },
    DriverTooOld {
        found: String,
        need: String,
    },
    RuntimeAbi {
        why: String,
    },
    /// The backend's memory budget cannot hold this weight: `need` bytes, `left` bytes free.
    NpuMemory {
        need: u64,
        left: u64,
    },
    /// A value beyond fp16's ±65504 (it would be inf on the NPU); `max` is the largest magnitude,
    /// rounded up (`u64::MAX` for inf).
    Fp16Range {
        max: u64,
    },
    /// The library reports a tensor layout (dims, type, tile) other than the one kiln converts to.
    LayoutMismatch {
        why: String,
    },
    /// The int8 path's estimated NMSE for this op (activation rows and weight requantised to
    /// per-row int8) is above the bar; both as `{:.2e}` text.
    Int8Accuracy {
        estimate: String,
        bar: String,
    },
    /// The NPU lock was not taken: another process holds the NPU (named in `why`), or the lock
    /// file could not be made. Callers that would otherwise fall back to the CPU treat it as an
    /// error (`NpuBackend::open`): a second NPU user is refused, not quietly run on the CPU.
    NpuLock {
        why: String,
    },
}

/// A decline is also an error, so that a run can refuse an op and the caller can tell a refusal
/// (fall back to another backend) from a failure (`anyhow::Error::downcast_ref::<Decline>()`).
impl std::error::Error for Decline {}

impl Decline {
    /// The reason's name without its numbers, for coverage tables.
    pub fn kind(&self) -> &'static str {
        match self {
            Decline::KNotAligned { .. } => "KNotAligned",
            Decline::NNotAligned { .. } => "NNotAligned",
            Decline::SmallM { .. } => "SmallM",
            Decline::WeightType { .. } => "WeightType",
            Decline::NoDevice { .. } => "NoDevice",
            Decline::DriverTooOld { .. } => "DriverTooOld",
            Decline::RuntimeAbi { .. } => "RuntimeAbi",
            Decline::NpuMemory { .. } => "NpuMemory",
            Decline::Fp16Range { .. } => "Fp16Range",
            Decline::LayoutMismatch { .. } => "LayoutMismatch",
            Decline::Int8Accuracy { .. } => "Int8Accuracy",
            Decline::NpuLock { .. } => "NpuLock",
        }
    }
}

impl fmt::Display for Decline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decline::KNotAligned { k, need } => write!(f, "KNotAligned{{k: {k}, need: {need}}}"),
            Decline::NNotAligned { n, need } => write!(f, "NNotAligned{{n: {n}, need: {need}}}"),
            Decline::SmallM { m, min } => write!(f, "SmallM{{m: {m}, min: {min}}}"),
            Decline::WeightType { ty } => write!(f, "WeightType({ty})"),
            Decline::NoDevice { why } => write!(f, "NoDevice({why})"),
            Decline::DriverTooOld { found, need } => {
                write!(f, "DriverTooOld{{found: {found}, need: {need}}}")
            }
            Decline::RuntimeAbi { why } => write!(f, "RuntimeAbi({why})"),
            Decline::NpuMemory { need, left } => write!(
                f,
                "NpuMemory{{need: {:.2} MiB, left: {:.2} MiB}}",
                *need as f64 / (1 << 20) as f64,
                *left as f64 / (1 << 20) as f64
            ),
            Decline::Fp16Range { max } if *max == u64::MAX => write!(f, "Fp16Range{{max: inf}}"),
            Decline::Fp16Range { max } => write!(f, "Fp16Range{{max: {max}, limit: 65504}}"),
            Decline::LayoutMismatch { why } => write!(f, "LayoutMismatch({why})"),
            Decline::Int8Accuracy { estimate, bar } => {
                write!(f, "Int8Accuracy{{estimated NMSE: {estimate}, bar: {bar}}}")
            }
            Decline::NpuLock { why } => write!(f, "NpuLock({why})"),
        }
    }
}

/// What `probe()` found: versions and features, as evidence for the self-check report.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Capabilities {
    /// `key: value` facts (library version, driver version, cores, CPU kernel chosen, ...).
    pub facts: Vec<(String, String)>,
    /// True when the backend runs on a stand-in rather than the real hardware/library.
    pub simulated: bool,
}

/// A weight made ready for one backend. The CPU borrows the mapping; the NPU converts into its
/// native layout. Either way the arrival is recorded in the ownership ledger.
pub trait PreparedWeight: Send + Sync {
    /// What the backend says about how the bytes arrived. The ledger does not take its word:
    /// it measures (see [`crate::ledger`]).
    fn arrival(&self) -> Arrival;
    /// The address range of the model bytes `run` will read, for a backend that reads the
    /// weight where it lies. `None` (the default) for one that reads only its own converted
    /// copy; a backend that declares [`Arrival::Borrowed`] and names no range is counted as a
    /// copy.
    fn reads_from(&self) -> Option<std::ops::Range<usize>> {
        None
    }
    fn as_any(&self) -> &dyn std::any::Any;
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Capabilities, or why the backend is absent on this machine.
    fn probe(&self) -> Result<Capabilities, Decline>;
    /// Yes, or a named reason.
    fn supports(&self, op: &MatmulOp) -> Result<(), Decline>;
    /// Make `w` ready for [`Backend::run`].
    fn prepare<'w>(&self, w: &Weight<'w>) -> anyhow::Result<Box<dyn PreparedWeight + 'w>>;
    /// Compute `c = a · wᵀ` for `m` rows of `a`. Call it through [`run_checked`].
    fn run(
        &self,
        w: &Weight<'_>,
        prepared: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> anyhow::Result<()>;
}

/// The bit pattern written into C before every run: a quiet NaN with a payload no arithmetic
/// produces, so "left untouched" is told apart from "computed a NaN".
pub const POISON_BITS: u32 = 0x7FC0_4B4E;

pub fn poison(c: &mut [f32]) {
    c.fill(f32::from_bits(POISON_BITS));
}

/// Where poison was left behind, if anywhere: (first index, how many).
pub fn find_poison(c: &[f32]) -> Option<(usize, usize)> {
    let first = c.iter().position(|v| v.to_bits() == POISON_BITS)?;
    let count = c.iter().filter(|v| v.to_bits() == POISON_BITS).count();
    Some((first, count))
}

/// Run an op with the output poisoned first; an error from the backend, or poison left behind
/// after an `Ok`, both come back as errors that name the backend and the weight.
pub fn run_checked(
    backend: &dyn Backend,
    w: &Weight<'_>,
    prepared: &dyn PreparedWeight,
    a: &[f32],
    m: usize,
    c: &mut [f32],
) -> anyhow::Result<()> {
    use anyhow::{bail, Context};
    if a.len() != m * w.k {
        bail!(
            "{}: activations for {} have {} values, expected M×K = {}×{}",
            backend.name(),
            w.name,
            a.len(),
            m,
            w.k
        );
    }
    if c.len() != m * w.n {
        bail!(
            "{}: output for {} has {} values, expected M×N = {}×{}",
            backend.name(),
            w.name,
            c.len(),
            m,
            w.n
        );
    }
    poison(c);
    backend
        .run(w, prepared, a, m, c)
        .with_context(|| format!("{} matmul on {} (M={m})", backend.name(), w.name))?;
    if let Some((first, count)) = find_poison(c) {
        bail!(
            "{} matmul on {} (M={m}) returned success but left {count} of {} outputs untouched \
             (first at index {first})",
            backend.name(),
            w.name,
            c.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_is_not_a_computed_nan() {
        let computed = [f32::NAN, -f32::NAN, f32::INFINITY * 0.0];
        assert_eq!(find_poison(&computed), None);
        let mut c = [1.0f32; 4];
        poison(&mut c);
        c[0] = 2.0;
        assert_eq!(find_poison(&c), Some((1, 3)));
    }
}
