//! `matmul.<backend>.<type>`: known-answer tests for every weight type each backend claims, at
//! M = 1 (decode) and M = 8 (prefill), each run twice with different activations so a stale
//! result fails. Every run goes through `run_checked` (output poisoned first, status checked).
//! The NPU is also held to the CPU on the same random inputs.
//!
//! The known answer comes from [`super::oracle`]: weights encoded there from power-of-two scales
//! and small integer quants, integer activations, the product computed in i64 — no code shared
//! with the backends or the reference dequantisation — and compared exactly. Beside it, the NPU
//! is held to the CPU on a random weight (NMSE).

use super::{oracle, CheckResult, Outcome};
use crate::backend::{run_checked, Backend, Decline, MatmulOp, Weight};
use crate::quant::{dequantize_row, quantize_to_vec, GgmlType, QUANTIZABLE};
use half::{bf16, f16};
use std::time::Instant;

/// K and N of the test weight: K a multiple of 256 (K-quants) and of 32 (NPU), N of 64 (NPU
/// int4/int8/fp16 alignment).
pub const K: usize = 256;
pub const N: usize = 64;
/// Decode and prefill.
pub const MS: [usize; 2] = [1, 8];
/// The normalised mean squared error a backend may show against the known answer or the CPU
/// (quantised activations on the fast paths cost ~1e-5).
pub const NMSE_BAR: f64 = 5e-4;
/// The f64 reference path has only f32 output rounding.
pub const NMSE_BAR_REF: f64 = 1e-10;

/// Deterministic values in [-1, 1) (xorshift64*), so a run is reproducible from its seed.
pub struct Values(u64);
impl Values {
    pub fn new(seed: u64) -> Values {
        Values(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn next_f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// Weight bytes of `ty` for an N×K weight; `None` for a type with no generator here.
pub fn weight_bytes(ty: GgmlType, k: usize, n: usize, seed: u64) -> Option<Vec<u8>> {
    let mut v = Values::new(seed);
    let x = v.vec(k * n);
    let small_f16 =
        |v: &mut Values| f16::from_f32(0.002 + 0.01 * (v.next_f32().abs())).to_le_bytes();
    match ty {
        GgmlType::F32 => Some(x.iter().flat_map(|f| f.to_le_bytes()).collect()),
        GgmlType::F16 => Some(
            x.iter()
                .flat_map(|f| f16::from_f32(*f).to_le_bytes())
                .collect(),
        ),
        GgmlType::Bf16 => Some(
            x.iter()
                .flat_map(|f| bf16::from_f32(*f).to_le_bytes())
                .collect(),
        ),
        t if QUANTIZABLE.contains(&t) => {
            let mut out = Vec::new();
            for row in x.chunks(k) {
                out.extend(quantize_to_vec(t, row).ok()?);
            }
            Some(out)
        }
        // K-quants: random quants and scales, with the f16 super-block scales set to small
        // finite values (random bits could be NaN or huge).
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            let bb = ty.block_bytes();
            let blocks = k * n / ty.block_elems();
            let mut out: Vec<u8> = (0..blocks * bb).map(|_| v.next_u64() as u8).collect();
            for b in out.chunks_mut(bb) {
                if ty == GgmlType::Q6K {
                    b[bb - 2..].copy_from_slice(&small_f16(&mut v));
                } else {
                    b[0..2].copy_from_slice(&small_f16(&mut v));
                    b[2..4].copy_from_slice(&small_f16(&mut v));
                }
            }
            Some(out)
        }
        _ => None,
    }
}

/// C = A·Wᵀ in f64 from the reference dequantisation.
pub fn known_answer(w: &Weight<'_>, a: &[f32], m: usize) -> anyhow::Result<Vec<f32>> {
    let row_bytes = w.ty.row_bytes(w.k as u64).unwrap_or(0) as usize;
    let mut rows = vec![0f32; w.k * w.n];
    for n in 0..w.n {
        dequantize_row(
            w.ty,
            &w.data[n * row_bytes..(n + 1) * row_bytes],
            &mut rows[n * w.k..(n + 1) * w.k],
        )
        .map_err(|e| anyhow::anyhow!("reference dequantisation of {}: {e}", w.ty))?;
    }
    let mut c = vec![0f32; m * w.n];
    for i in 0..m {
        for n in 0..w.n {
            let mut acc = 0f64;
            for k in 0..w.k {
                acc += rows[n * w.k + k] as f64 * a[i * w.k + k] as f64;
            }
            c[i * w.n + n] = acc as f32;
        }
    }
    Ok(c)
}

/// Σ(got−want)² / Σwant²; infinite when `got` holds a NaN.
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let d = *g as f64 - *w as f64;
        num += d * d;
        den += (*w as f64) * (*w as f64);
    }
    if num.is_nan() {
        return f64::INFINITY;
    }
    num / den.max(f64::MIN_POSITIVE)
}

/// The weight types `b` claims: those it does not decline as `WeightType` on a well-aligned op.
pub fn claimed_types(b: &dyn Backend) -> Vec<GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|&ty| {
            !matches!(
                b.supports(&MatmulOp {
                    m: 8,
                    k: K,
                    n: N,
                    ty
                }),
                Err(Decline::WeightType { .. })
            )
        })
        .collect()
}

/// One backend, one type: the integer-oracle runs (exact, see [`super::oracle`]), and
/// (`cross`) the comparison with another backend on the same random weight and activations.
pub fn check_type(b: &dyn Backend, ty: GgmlType, cross: Option<&dyn Backend>) -> Outcome {
    let Some(ow) = oracle::weight(ty, K, N, ty.id() as u64 + 1) else {
        return Outcome::fail(
            format!(
                "{} claims {ty}, for which the integer oracle builds no weight",
                b.name()
            ),
            vec![],
        );
    };
    let name = format!("selftest.oracle.{}", ty.name());
    let w = Weight {
        name: &name,
        ty,
        k: K,
        n: N,
        data: &ow.bytes,
    };
    let prepared = match b.prepare(&w) {
        Ok(p) => p,
        Err(e) => return Outcome::fail(format!("prepare: {e:#}"), vec![]),
    };
    let mut ev = Vec::new();
    let mut bad = Vec::new();
    let mut ran = 0;
    for &m in &MS {
        if let Err(d) = b.supports(&MatmulOp::for_weight(&w, m)) {
            ev.push(format!("M={m}: declined ({d})"));
            continue;
        }
        let mut line = format!("M={m}: integer oracle");
        // Two runs with different activations: a backend that returns the previous result
        // (a stale activation cache) fails the second.
        for run in 0..2u64 {
            let ai = oracle::activations(m, K, 1000 * m as u64 + run + 7);
            let a: Vec<f32> = ai.iter().map(|&x| x as f32).collect();
            let want = oracle::answer(&ow, &ai, m, K, N);
            let mut c = vec![0f32; m * N];
            if let Err(e) = run_checked(b, &w, prepared.as_ref(), &a, m, &mut c) {
                bad.push(format!("M={m} run {}: {e:#}", run + 1));
                continue;
            }
            ran += 1;
            let wrong: Vec<usize> = (0..c.len()).filter(|&i| c[i] != want[i]).collect();
            line.push_str(&format!(
                " run{} exact {}/{}",
                run + 1,
                c.len() - wrong.len(),
                c.len()
            ));
            if let Some(&i) = wrong.first() {
                bad.push(format!(
                    "M={m} run {}: {} of {} outputs differ from the exact integer answer \
                     (first C[{}][{}] = {:e}, exact {:e})",
                    run + 1,
                    wrong.len(),
                    c.len(),
                    i / N,
                    i % N,
                    c[i],
                    want[i]
                ));
            }
        }
        ev.push(line);
    }
    if let Some(cb) = cross {
        cross_check(b, cb, ty, &mut ev, &mut bad);
    }
    if !bad.is_empty() {
        let reason = bad[0].clone();
        bad.extend(ev);
        return Outcome::fail(reason, bad);
    }
    if ran == 0 {
        return Outcome::fail(
            format!("{} claims {ty} but declined it at every M tested", b.name()),
            ev,
        );
    }
    Outcome::pass(ev)
}

/// `b` against `cb` on a random weight of `ty` and random activations, M = 1 and 8 (NMSE).
fn cross_check(
    b: &dyn Backend,
    cb: &dyn Backend,
    ty: GgmlType,
    ev: &mut Vec<String>,
    bad: &mut Vec<String>,
) {
    let Some(bytes) = weight_bytes(ty, K, N, ty.id() as u64 + 1) else {
        bad.push(format!(
            "no random weight generator for {ty} to compare with {}",
            cb.name()
        ));
        return;
    };
    let name = format!("selftest.random.{}", ty.name());
    let w = Weight {
        name: &name,
        ty,
        k: K,
        n: N,
        data: &bytes,
    };
    let (p, cp) = match (b.prepare(&w), cb.prepare(&w)) {
        (Ok(p), Ok(cp)) => (p, cp),
        (Err(e), _) | (_, Err(e)) => {
            bad.push(format!("random weight, prepare: {e:#}"));
            return;
        }
    };
    for &m in &MS {
        if b.supports(&MatmulOp::for_weight(&w, m)).is_err() {
            continue;
        }
        let a = Values::new(1000 * m as u64 + 7).vec(m * K);
        let mut c = vec![0f32; m * N];
        let mut cc = vec![0f32; m * N];
        if let Err(e) = run_checked(b, &w, p.as_ref(), &a, m, &mut c) {
            bad.push(format!("M={m} random weight: {e:#}"));
            continue;
        }
        if let Err(e) = run_checked(cb, &w, cp.as_ref(), &a, m, &mut cc) {
            bad.push(format!("{} reference run: {e:#}", cb.name()));
            continue;
        }
        let x = nmse(&c, &cc);
        ev.push(format!(
            "M={m}: random weight vs {} NMSE {x:.2e}",
            cb.name()
        ));
        if x.is_nan() || x > NMSE_BAR {
            bad.push(format!(
                "M={m} random weight: NMSE {x:.3e} against {} exceeds {NMSE_BAR:.0e}",
                cb.name()
            ));
        }
    }
}

/// Every claimed type of every backend, as `matmul.<backend>.<type>` checks. `reference` is the
/// backend the others are compared with on random inputs (the CPU), if it is also `b`, no
/// comparison is made.
pub fn checks(backends: &[&dyn Backend], reference: Option<&dyn Backend>) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for &b in backends {
        let simulated = match b.probe() {
            Ok(caps) => caps.simulated,
            Err(d) => {
                out.push(CheckResult::new(
                    format!("matmul.{}", b.name()),
                    Outcome::skip(format!("backend {} is absent: {d}", b.name())),
                    0.0,
                ));
                continue;
            }
        };
        let cross = reference.filter(|r| r.name() != b.name() && b.name() == "npu");
        for ty in claimed_types(b) {
            let t = Instant::now();
            let mut o = check_type(b, ty, cross);
            o.simulated = simulated;
            out.push(CheckResult::new(
                format!("matmul.{}.{}", b.name(), ty.name().to_lowercase()),
                o,
                t.elapsed().as_secs_f64() * 1e3,
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Status;
    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuRefBackend};
    use crate::backend::{Capabilities, PreparedWeight};
    use std::sync::Mutex;

    #[test]
    fn cpu_backends_pass_every_claimed_type() {
        let cpu = CpuBackend::new();
        let cref = CpuRefBackend;
        let r = checks(&[&cref, &cpu], Some(&cpu));
        assert!(r.len() >= 11, "{r:?}");
        for c in &r {
            assert_eq!(c.status, Status::Pass, "{c:?}");
        }
        assert!(r.iter().any(|c| c.id == "matmul.cpu.q4_k"), "{r:?}");
    }

    /// A backend wrapper with the faults the NPU stand-in injects, for a test that needs no
    /// library: it proves the check, not the NPU.
    struct Faulty {
        inner: CpuRefBackend,
        fault: &'static str,
        last: Mutex<Option<Vec<f32>>>,
    }
    impl Backend for Faulty {
        fn name(&self) -> &'static str {
            "faulty"
        }
        fn probe(&self) -> Result<Capabilities, Decline> {
            self.inner.probe()
        }
        fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
            self.inner.supports(op)
        }
        fn prepare<'w>(&self, w: &Weight<'w>) -> anyhow::Result<Box<dyn PreparedWeight + 'w>> {
            self.inner.prepare(w)
        }
        fn run(
            &self,
            w: &Weight<'_>,
            p: &dyn PreparedWeight,
            a: &[f32],
            m: usize,
            c: &mut [f32],
        ) -> anyhow::Result<()> {
            match self.fault {
                "error" => anyhow::bail!("RKNN_ERR_FAIL"),
                "untouched" => Ok(()),
                "wrong" => {
                    self.inner.run(w, p, a, m, c)?;
                    c.iter_mut().for_each(|x| *x = -*x);
                    Ok(())
                }
                // One output one ulp off: far inside any NMSE bar, still not the answer.
                "ulp" => {
                    self.inner.run(w, p, a, m, c)?;
                    c[c.len() / 2] = f32::from_bits(c[c.len() / 2].to_bits() + 1);
                    Ok(())
                }
                "stale" => {
                    let mut last = self.last.lock().unwrap();
                    match last.as_ref().filter(|l| l.len() == c.len()) {
                        Some(l) => c.copy_from_slice(l),
                        None => self.inner.run(w, p, a, m, c)?,
                    }
                    *last = Some(c.to_vec());
                    Ok(())
                }
                _ => self.inner.run(w, p, a, m, c),
            }
        }
    }

    #[test]
    fn every_backend_fault_fails_its_check() {
        for fault in ["error", "untouched", "wrong", "stale", "ulp"] {
            let b = Faulty {
                inner: CpuRefBackend,
                fault,
                last: Mutex::new(None),
            };
            let o = check_type(&b, GgmlType::F16, None);
            assert_eq!(o.status, Status::Fail, "{fault}: {o:?}");
        }
        let ok = Faulty {
            inner: CpuRefBackend,
            fault: "none",
            last: Mutex::new(None),
        };
        assert_eq!(check_type(&ok, GgmlType::Q8_0, None).status, Status::Pass);
    }
}
