//! Each fault the stand-in injects (`KILN_RKNN_STANDIN_FAULT`) must surface: `error`,
//! `untouched` and `stale` as an error from the run, `wrong` as a mismatch against the reference.
//! The tests take one lock, because the fault is chosen by a process-wide variable.

mod npu_common;

use kiln_runtime::backend::{run_checked, Backend, Weight};
use kiln_runtime::quant::GgmlType;
use npu_common::*;

/// The faults are process-wide variables: one test at a time.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn injected_faults_are_caught() {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    for ty in [GgmlType::F16, GgmlType::Q8_0] {
        let (m, k, n) = (8, 64, 32);
        let b = backend("KILN_RKNN_STANDIN");
        let (data, deq) = weight(ty, k, n, 7);
        let w = Weight {
            name: "fault.weight",
            ty,
            k,
            n,
            data: &data,
        };
        let p = b.prepare(&w).unwrap();
        let a1 = values(1, m * k);
        let a2 = values(2, m * k);
        let mut c = vec![0f32; m * n];
        let run = |a: &[f32], c: &mut [f32]| run_checked(&b, &w, p.as_ref(), a, m, c);

        std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
        run(&a1, &mut c).expect("healthy run");
        assert!(nmse(&c, &reference(&a1, &deq, m, k, n)) <= 5e-4);

        std::env::set_var("KILN_RKNN_STANDIN_FAULT", "error");
        let e = format!("{:#}", run(&a1, &mut c).unwrap_err());
        assert!(
            e.contains("rknn_matmul_run returned -1 (RKNN_ERR_FAIL)"),
            "{ty}: {e}"
        );

        std::env::set_var("KILN_RKNN_STANDIN_FAULT", "untouched");
        let e = format!("{:#}", run(&a1, &mut c).unwrap_err());
        assert!(e.contains("untouched"), "{ty}: {e}");

        // Stale: the first run under the fault has no previous output to replay on this path,
        // so run twice with different inputs; the second must be refused.
        std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
        run(&a1, &mut c).expect("healthy run");
        std::env::set_var("KILN_RKNN_STANDIN_FAULT", "stale");
        let e = format!("{:#}", run(&a2, &mut c).unwrap_err());
        assert!(e.contains("not this run's"), "{ty}: {e}");

        std::env::set_var("KILN_RKNN_STANDIN_FAULT", "wrong");
        run(&a2, &mut c).expect("a wrong answer is not visible to the backend itself");
        let want = cpu_reference(&w, &a2, m);
        assert!(nmse(&want, &reference(&a2, &deq, m, k, n)) < 1e-10);
        assert!(
            nmse(&c, &want) > 5e-4 || worst(&c, &want) > 0.1,
            "{ty}: the perturbed output passed the comparison"
        );
        std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
        run(&a2, &mut c).expect("healthy again");
        assert!(nmse(&c, &want) <= 5e-4);
    }
}

/// `tile`: the stand-in reports (and uses) another B tile than RK3588's table. kiln must decline
/// the weight with `LayoutMismatch` naming the tile (the CPU then owns it), not convert with its
/// own table and compute wrong numbers. And `KILN_RKNN_STANDIN_MEM_MIB`: a library whose memory
/// is spent answers NULL, which is an error naming the buffer, not a crash or a silent success.
/// In sequence with the test above would race on the variables, so both live in one test.
#[test]
fn tile_and_memory_faults_are_caught() {
    use kiln_runtime::backend::cpu::CpuRefBackend;
    use kiln_runtime::backend::Decline;
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let (m, k, n) = (8, 64, 32);
    for ty in [GgmlType::F16, GgmlType::Q8_0] {
        let (data, deq) = weight(ty, k, n, 8);
        let w = Weight {
            name: "tile.weight",
            ty,
            k,
            n: if ty == GgmlType::Q8_0 { 32 } else { n },
            data: &data,
        };
        std::env::set_var("KILN_RKNN_STANDIN_FAULT", "tile");
        let b = backend("KILN_RKNN_STANDIN");
        let e = b.prepare(&w).err().expect("another tile must be declined");
        let Some(Decline::LayoutMismatch { why }) = e.downcast_ref::<Decline>() else {
            panic!("{ty}: expected LayoutMismatch, got {e:#}");
        };
        assert!(why.contains("B tile (subN, subK) = ("), "{why}");
        assert!(why.contains(", 16)"), "{why}");
        let cpu = CpuRefBackend;
        let backends: [&dyn Backend; 2] = [&b, &cpu];
        let p = kiln_runtime::sched::plan(&backends, &[w], &[m], false);
        assert_eq!(p.weights[0].owner.as_deref(), Some("cpu-ref"));
        assert_eq!(p.table().declines["npu"]["LayoutMismatch"].weights, 1);

        // The same weight with the table's tile: prepared and right.
        std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
        let p = b.prepare(&w).expect("RK3588's tile");
        let a = values(3, m * k);
        let mut c = vec![0f32; m * n];
        run_checked(&b, &w, p.as_ref(), &a, m, &mut c).unwrap();
        assert!(nmse(&c, &reference(&a, &deq, m, k, n)) <= 5e-4);
    }

    // 1 MiB of NPU memory, a weight of 2 MiB converted.
    std::env::set_var("KILN_RKNN_STANDIN_MEM_MIB", "1");
    let (k, n) = (1024, 1024);
    let (data, _) = weight(GgmlType::F16, k, n, 9);
    let w = Weight {
        name: "big.weight",
        ty: GgmlType::F16,
        k,
        n,
        data: &data,
    };
    let b = backend("KILN_RKNN_STANDIN");
    let e = format!(
        "{:#}",
        b.prepare(&w).err().expect("over the library's memory")
    );
    std::env::remove_var("KILN_RKNN_STANDIN_MEM_MIB");
    assert!(e.contains("rknn_create_mem for B returned NULL"), "{e}");
    assert!(e.contains("big.weight"), "{e}");
    assert_eq!(b.reserved(), 0, "a failed prepare gives its budget back");
    b.prepare(&w).expect("fits without the limit");
}
