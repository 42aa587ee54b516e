//! Each fault the stand-in injects (`KILN_RKNN_STANDIN_FAULT`) must surface: `error`,
//! `untouched` and `stale` as an error from the run, `wrong` as a mismatch against the reference.
//! One test, run in sequence, because the fault is chosen by a process-wide variable.

mod npu_common;

use kiln_runtime::backend::{run_checked, Backend, Weight};
use kiln_runtime::quant::GgmlType;
use npu_common::*;

#[test]
fn injected_faults_are_caught() {
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
        let want = reference(&a2, &deq, m, k, n);
        assert!(
            nmse(&c, &want) > 5e-4 || worst(&c, &want) > 0.1,
            "{ty}: the perturbed output passed the comparison"
        );
        std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
        run(&a2, &mut c).expect("healthy again");
        assert!(nmse(&c, &want) <= 5e-4);
    }
}
