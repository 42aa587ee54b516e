//! The model loop's run-time fallback (30ba2c9), under a backend that goes bad mid-run: a
//! refusal (`Decline`) after some ops → the next backend runs every later op, the refusals are
//! counted, and the NLL is the CPU's to the bit; an error, or success with the output left
//! untouched (whole or in part) → the forward pass fails naming the backend and the weight.
//! Never a silent wrong answer. Runs on the seeded llama fixture the image carries.

use kiln_runtime::backend::cpu::CpuBackend;
use kiln_runtime::backend::{Backend, Capabilities, Decline, MatmulOp, PreparedWeight, Weight};
use kiln_runtime::gguf::GgufFile;
use kiln_runtime::model::{fixture, nll_windows, KvType, Model, Options, RunStats};
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Bad {
    /// Refuse at run time as the NPU does (`Fp16Range`).
    Decline,
    /// Fail the run.
    Error,
    /// Report success without writing the output.
    Untouched,
    /// Report success after writing only the first half of the output.
    Half,
}

/// The CPU fast path until `good` runs have succeeded, then `bad` on every run.
struct Flaky {
    cpu: CpuBackend,
    good: usize,
    bad: Bad,
    runs: AtomicUsize,
}

impl Backend for Flaky {
    fn name(&self) -> &'static str {
        "flaky"
    }
    fn probe(&self) -> Result<Capabilities, Decline> {
        self.cpu.probe()
    }
    fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
        self.cpu.supports(op)
    }
    fn prepare<'w>(&self, w: &Weight<'w>) -> anyhow::Result<Box<dyn PreparedWeight + 'w>> {
        self.cpu.prepare(w)
    }
    fn run(
        &self,
        w: &Weight<'_>,
        p: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> anyhow::Result<()> {
        if self.runs.fetch_add(1, Ordering::SeqCst) < self.good {
            return self.cpu.run(w, p, a, m, c);
        }
        match self.bad {
            Bad::Decline => Err(Decline::Fp16Range { max: 70000 }.into()),
            Bad::Error => anyhow::bail!("device lost"),
            Bad::Untouched => Ok(()),
            Bad::Half => {
                let mut full = vec![0f32; c.len()];
                self.cpu.run(w, p, a, m, &mut full)?;
                let h = c.len() / 2;
                c[..h].copy_from_slice(&full[..h]);
                Ok(())
            }
        }
    }
}

const TEXT: &str = "Every time this board starts, it reads the same short paragraph.";
/// Matmul runs before the backend goes bad: inside the first forward's first layer.
const GOOD: usize = 5;

fn cpu() -> CpuBackend {
    CpuBackend::new().with_threads(1)
}

fn nll(f: &GgufFile, backends: Vec<Box<dyn Backend>>) -> anyhow::Result<(f64, RunStats)> {
    let tok = kiln_runtime::tokenizer::Tokenizer::from_gguf(f.gguf())?;
    let ids = tok.encode(TEXT, true, true)?;
    let model = Model::load_with(f, &Options::default(), backends)?;
    let mut s = model.session(ids.len(), KvType::F16)?;
    // Two windows: a prefill of M > 1, then ids one at a time (M = 1 decode).
    let (n1, s1) = nll_windows(&model, &mut s, &ids, ids.len())?;
    s.kv.clear();
    let mut s2 = 0f64;
    let mut n2 = 0usize;
    for i in 0..ids.len() - 1 {
        let logits = model.forward(&mut s, &ids[i..i + 1], kiln_runtime::model::Want::Last)?;
        s2 += kiln_runtime::model::token_nll(&logits, ids[i + 1]);
        n2 += 1;
    }
    Ok(((s1 + s2) / (n1 + n2) as f64, s.stats))
}

fn flaky(bad: Bad) -> Vec<Box<dyn Backend>> {
    vec![
        Box::new(Flaky {
            cpu: cpu(),
            good: GOOD,
            bad,
            runs: AtomicUsize::new(0),
        }),
        Box::new(cpu()),
    ]
}

fn fixture_file() -> (tempfile::TempDir, GgufFile) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(fixture::FILE_NAME);
    std::fs::write(&p, fixture::gguf().unwrap()).unwrap();
    let f = GgufFile::open(&p).unwrap();
    (dir, f)
}

#[test]
fn a_refusal_mid_run_falls_back_to_the_same_answer() {
    let (_d, f) = fixture_file();
    let (want, _) = nll(&f, vec![Box::new(cpu())]).unwrap();
    let (got, st) = nll(&f, flaky(Bad::Decline)).unwrap();
    assert_eq!(got.to_bits(), want.to_bits(), "{got} vs {want}");
    assert_eq!(st.ops["flaky"].0, GOOD as u64, "{st:?}");
    let refused: u64 = st.declined.values().sum();
    assert_eq!(
        refused, st.ops["cpu"].0,
        "every later op refused once and run on the CPU: {st:?}"
    );
    assert!(
        st.declined.keys().all(|k| k.starts_with("flaky: ")),
        "{st:?}"
    );
}

#[test]
fn an_error_or_an_untouched_output_mid_run_fails_loudly() {
    let (_d, f) = fixture_file();
    for bad in [Bad::Error, Bad::Untouched, Bad::Half] {
        let e = format!("{:#}", nll(&f, flaky(bad)).unwrap_err());
        assert!(e.contains("flaky matmul on blk."), "{bad:?}: {e}");
        let what = match bad {
            Bad::Error => "device lost",
            _ => "untouched",
        };
        assert!(e.contains(what), "{bad:?}: {e}");
    }
}
