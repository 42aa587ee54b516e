//! The NPU backend against the strict stand-in (issue 12): non-coherent cache (a missing
//! `rknn_mem_sync` is caught), activations beyond fp16 (declined, run on the CPU, counted), one B
//! buffer per weight whatever the number of M values (bounded contexts), and a memory budget
//! smaller than the model (`NpuMemory` declines, the plan's totals add up). The stand-in's
//! counters are process-wide, so the tests here run one at a time (`serial`).

mod npu_common;

use half::f16;
use kiln_runtime::backend::cpu::CpuRefBackend;
use kiln_runtime::backend::npu::{NpuPrepared, SyncPoint, MAX_CTXS};
use kiln_runtime::backend::{run_checked, Backend, Decline, Weight};
use kiln_runtime::quant::GgmlType;
use kiln_runtime::sched;
use npu_common::*;
use std::sync::{Mutex, MutexGuard};

const STANDIN: &str = "KILN_RKNN_STANDIN";

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn w<'a>(name: &'a str, ty: GgmlType, k: usize, n: usize, data: &'a [u8]) -> Weight<'a> {
    Weight {
        name,
        ty,
        k,
        n,
        data,
    }
}

/// Each sync is load-bearing: the stand-in does not make CPU writes visible to the NPU (or the
/// NPU's to the CPU) without it, and the run must fail, never return stale numbers.
#[test]
fn every_cache_sync_is_needed() {
    let _s = serial();
    for ty in [GgmlType::F16, GgmlType::Q8_0] {
        let (m, k, n) = (8, 64, 64);
        let (data, deq) = weight(ty, k, n, 11);
        let wt = w("sync.weight", ty, k, n, &data);
        let a = values(5, m * k);
        let want = reference(&a, &deq, m, k, n);
        let mut c = vec![0f32; m * n];

        let healthy = backend(STANDIN);
        let p = healthy.prepare(&wt).unwrap();
        for _ in 0..2 {
            run_checked(&healthy, &wt, p.as_ref(), &a, m, &mut c).expect("with every sync");
            assert!(nmse(&c, &want) <= 5e-4, "{ty}");
        }

        for (point, says) in [
            (SyncPoint::B, "not this run's"),
            (SyncPoint::A, "not this run's"),
            (SyncPoint::C, "untouched"),
        ] {
            let b = backend_with(STANDIN, |c| c.omit_sync = Some(point));
            let p = b.prepare(&wt).unwrap();
            for round in 0..2 {
                let e = run_checked(&b, &wt, p.as_ref(), &a, m, &mut c)
                    .expect_err("a run without the sync must fail");
                let e = format!("{e:#}");
                assert!(
                    e.contains(says),
                    "{ty} without {point:?} round {round}: {e}"
                );
            }
        }
    }
}

/// An activation of 1e5 would be inf in fp16: the NPU refuses the op with `Fp16Range`, the CPU
/// runs it, and the refusal is counted in the coverage table. The int8 path (per-row scales)
/// takes it. An F16 weight holding inf is declined at prepare.
#[test]
fn activations_beyond_fp16_fall_back_to_the_cpu() {
    let _s = serial();
    let (m, k, n) = (8, 64, 32);
    let npu = backend(STANDIN);
    let cpu = CpuRefBackend;
    let (data, deq) = weight(GgmlType::F16, k, n, 3);
    let wt = w("range.weight", GgmlType::F16, k, n, &data);
    let mut a = values(9, m * k);
    a[5] = 65504.0;
    let backends: [&dyn Backend; 2] = [&npu, &cpu];
    let p = sched::plan(&backends, &[wt], &[m], true);
    assert_eq!(p.weights[0].owner.as_deref(), Some("npu"));
    let prepared = p.prepared[0].as_ref().unwrap();
    let mut c = vec![0f32; m * n];
    let ran = sched::run_with_fallback(&npu, prepared.as_ref(), &cpu, &wt, &a, m, &mut c, &p.runs)
        .unwrap();
    assert_eq!(ran, "npu", "65504 is fp16's largest finite value");

    a[5] = 1e5;
    let e = run_checked(&npu, &wt, prepared.as_ref(), &a, m, &mut c).unwrap_err();
    assert_eq!(
        e.downcast_ref::<Decline>(),
        Some(&Decline::Fp16Range { max: 100000 }),
        "{e:#}"
    );
    let ran = sched::run_with_fallback(&npu, prepared.as_ref(), &cpu, &wt, &a, m, &mut c, &p.runs)
        .unwrap();
    assert_eq!(ran, "cpu-ref");
    let want = reference(&a, &deq, m, k, n);
    assert!(nmse(&c, &want) < 1e-10, "the CPU's result, not an inf");
    assert!(c.iter().all(|v| v.is_finite()));
    let t = p.table();
    assert_eq!(t.runs.declined["npu"]["Fp16Range"], 1, "{:?}", t.runs);
    assert_eq!(t.runs.ran["npu"], 1);
    assert_eq!(t.runs.ran["cpu-ref"], 1);
    let text = p.render();
    assert!(
        text.contains("declined by npu Fp16Range") && text.contains("Fp16Range{max: 100000"),
        "{text}"
    );

    // What the check prevents: the stand-in, like the NPU, takes the f16 the host converted,
    // and 1e5 converts to inf.
    assert!(f16::from_f32(1e5).to_f32().is_infinite());

    // int8 (Q8_0): the row scale absorbs the magnitude.
    let (q8, q8_deq) = weight(GgmlType::Q8_0, k, n, 4);
    let wq = w("range.q8.weight", GgmlType::Q8_0, k, n, &q8);
    let pq = npu.prepare(&wq).unwrap();
    run_checked(&npu, &wq, pq.as_ref(), &a, m, &mut c).expect("int8 takes 1e5");
    assert!(nmse(&c, &reference(&a, &q8_deq, m, k, n)) <= 5e-4);

    // An F16 weight holding inf: declined when preparing, and the CPU owns it.
    let mut bad = data.clone();
    bad[10..12].copy_from_slice(&f16::INFINITY.to_le_bytes());
    let wb = w("inf.weight", GgmlType::F16, k, n, &bad);
    let e = npu.prepare(&wb).err().expect("inf weight");
    assert_eq!(
        e.downcast_ref::<Decline>(),
        Some(&Decline::Fp16Range { max: u64::MAX })
    );
    let p = sched::plan(&backends, &[wb], &[m], false);
    assert_eq!(p.weights[0].owner.as_deref(), Some("cpu-ref"));
    assert_eq!(p.table().declines["npu"]["Fp16Range"].weights, 1);
}

/// Twenty M values on one weight: one B buffer per block the whole time, contexts bounded by
/// MAX_CTXS per block (LRU over power-of-two buckets), memory back where it was on a second
/// pass, every result right; and everything released when the weight is dropped.
#[test]
fn twenty_m_values_share_one_b_buffer() {
    let _s = serial();
    let ms = [
        8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 31, 40, 70, 130, 260, 520, 1030, 2050, 100,
    ];
    assert_eq!(ms.len(), 20);
    let npu = backend(STANDIN);
    for (ty, k, n, blocks) in [
        (GgmlType::F16, 64, 32, 1),
        (GgmlType::Q8_0, 64, 64, 1),
        (GgmlType::F16, 32, 4096 + 32, 2),
    ] {
        let b0 = standin_counter("kiln_standin_b_buffers");
        let ctx0 = standin_counter("kiln_standin_contexts");
        let (data, deq) = weight(ty, k, n, 21);
        let wt = w("many-m.weight", ty, k, n, &data);
        let p = npu.prepare(&wt).unwrap();
        let np = p.as_any().downcast_ref::<NpuPrepared>().unwrap();
        assert_eq!(np.blocks(), blocks);
        assert_eq!(
            standin_counter("kiln_standin_b_buffers"),
            b0 + blocks as u64
        );
        let mut mem_after = Vec::new();
        for pass in 0..2 {
            for &m in &ms {
                // The large-N weight only at a few M: the stand-in computes on the CPU.
                if blocks > 1 && m > 64 {
                    continue;
                }
                let a = values(m as u64, m * k);
                let mut c = vec![0f32; m * n];
                run_checked(&npu, &wt, p.as_ref(), &a, m, &mut c)
                    .unwrap_or_else(|e| panic!("{ty} M={m}: {e:#}"));
                let e = nmse(&c, &reference(&a, &deq, m, k, n));
                assert!(e <= 5e-4, "{ty} M={m} pass {pass}: NMSE {e:e}");
                assert_eq!(
                    standin_counter("kiln_standin_b_buffers"),
                    b0 + blocks as u64,
                    "{ty} M={m}: one B buffer per block, shared by every context"
                );
                assert!(
                    np.contexts() <= MAX_CTXS * blocks,
                    "{ty} M={m}: {} contexts",
                    np.contexts()
                );
            }
            mem_after.push(standin_counter("kiln_standin_mem_bytes"));
        }
        assert_eq!(
            mem_after[0], mem_after[1],
            "{ty}: memory flat over a second pass"
        );
        assert_eq!(
            standin_counter("kiln_standin_contexts"),
            ctx0 + np.contexts() as u64
        );
        drop(p);
        assert_eq!(standin_counter("kiln_standin_b_buffers"), b0);
        assert_eq!(standin_counter("kiln_standin_contexts"), ctx0);
    }
}

/// A budget smaller than the model: weights in model order take what is left, the ones that do
/// not fit are declined as `NpuMemory { need, left }` (and run on the CPU at every M), and the
/// totals add up. The budget is given back when the plan's prepared weights are dropped.
#[test]
fn budget_smaller_than_the_model() {
    let _s = serial();
    let npu = backend_with(STANDIN, |c| c.budget = 20 << 10);
    let cpu = CpuRefBackend;
    let shapes = [(64, 64), (64, 128), (64, 64), (64, 64)];
    let datas: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, (k, n))| weight(GgmlType::F16, *k, *n, i as u64).0)
        .collect();
    let names = ["w0.weight", "w1.weight", "w2.weight", "w3.weight"];
    let ws: Vec<Weight> = shapes
        .iter()
        .zip(&datas)
        .zip(names)
        .map(|((&(k, n), d), name)| w(name, GgmlType::F16, k, n, d))
        .collect();
    let backends: [&dyn Backend; 2] = [&npu, &cpu];
    let mut p = sched::plan(&backends, &ws, &[1, 8, 64], false);
    p.npu_budget = Some(npu.budget());
    let owners: Vec<&str> = p
        .weights
        .iter()
        .map(|w| w.owner.as_deref().unwrap())
        .collect();
    assert_eq!(owners, ["npu", "cpu-ref", "npu", "cpu-ref"]);
    assert_eq!(
        p.weights[1].declined[0].decline,
        Decline::NpuMemory {
            need: 16 << 10,
            left: 12 << 10
        }
    );
    assert_eq!(
        p.weights[3].declined[0].decline,
        Decline::NpuMemory {
            need: 8 << 10,
            left: 4 << 10
        }
    );
    let t = p.table();
    assert_eq!(t.npu_bytes, 16 << 10);
    assert!(t.npu_bytes <= npu.budget());
    assert_eq!(t.coverage["npu"].weights + t.coverage["cpu-ref"].weights, 4);
    assert_eq!(t.coverage["npu"].ops, [0, 2, 2], "{t:?}");
    assert_eq!(t.coverage["cpu-ref"].ops, [4, 2, 2]);
    assert_eq!(t.declines["npu"]["NpuMemory"].weights, 2);
    assert_eq!(t.declines["npu"]["NpuMemory"].ops, [2, 2, 2]);
    let npu_sum: u64 = p
        .weights
        .iter()
        .filter(|w| w.owner.as_deref() == Some("npu"))
        .map(|w| w.converted_bytes)
        .sum();
    assert_eq!(npu_sum, t.npu_bytes);
    let text = p.render();
    assert!(
        text.contains("NPU total 0.02 MiB for 2 weights of budget 0.02 MiB"),
        "{text}"
    );
    assert!(text.contains("2 weights declined as NpuMemory"), "{text}");
    assert!(
        text.contains("NpuMemory{need: 0.02 MiB, left: 0.01 MiB}"),
        "{text}"
    );
    assert_eq!(npu.reserved(), 0, "the plan's prepared weights are dropped");
}
