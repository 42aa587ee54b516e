//! The NPU backend against rknn-standin: same numbers as the CPU reference backend (and this
//! file's own f32 matmul of the dequantised weight) within llama.cpp's MUL_MAT bar, the gates, the probe, the 1.x-ABI decline. Faults are in `npu_faults.rs`.

mod npu_common;

use kiln_runtime::backend::{run_checked, Backend, Decline, MatmulOp, Weight};
use kiln_runtime::ledger::Arrival;
use kiln_runtime::quant::GgmlType;
use npu_common::*;

const STANDIN: &str = "KILN_RKNN_STANDIN";
const STANDIN_ABI1: &str = "KILN_RKNN_STANDIN_ABI1";

fn check_against_reference(ty: GgmlType, m: usize, k: usize, n: usize) {
    let b = backend(STANDIN);
    let (data, deq) = weight(ty, k, n, (k * 31 + n) as u64);
    let w = Weight {
        name: "blk.0.test.weight",
        ty,
        k,
        n,
        data: &data,
    };
    b.supports(&MatmulOp::for_weight(&w, m))
        .expect("supported shape");
    let p = b.prepare(&w).expect("prepare");
    let elem = if ty == GgmlType::F16 { 2 } else { 1 };
    assert_eq!(
        p.arrival(),
        Arrival::Converted {
            bytes: (k * n * elem) as u64
        }
    );
    for round in 0..2u64 {
        let a = values(1000 + round, m * k);
        let want = reference(&a, &deq, m, k, n);
        let mut c = vec![0f32; m * n];
        run_checked(&b, &w, p.as_ref(), &a, m, &mut c).expect("run");
        let e = nmse(&c, &want);
        assert!(
            e <= 5e-4,
            "{ty} M={m} K={k} N={n} round {round}: NMSE {e:e} > 5e-4"
        );
        assert!(
            worst(&c, &want) < 0.1,
            "{ty} M={m} K={k} N={n}: one element far off"
        );
    }
}

#[test]
fn f16_matches_reference() {
    check_against_reference(GgmlType::F16, 8, 64, 48);
    check_against_reference(GgmlType::F16, 13, 256, 16);
}

#[test]
fn q8_0_matches_reference() {
    check_against_reference(GgmlType::Q8_0, 8, 96, 64);
    check_against_reference(GgmlType::Q8_0, 17, 512, 32);
}

/// K above 8192 and N above 4096 run as several contexts whose results are summed / joined.
#[test]
fn large_k_and_n_are_split() {
    check_against_reference(GgmlType::Q8_0, 8, 8192 + 64, 32);
    check_against_reference(GgmlType::F16, 8, 32, 4096 + 32);
}

#[test]
fn probe_reports_the_standin_as_simulated() {
    let caps = backend(STANDIN).probe().expect("stand-in loads");
    assert!(caps.simulated, "{caps:?}");
    let fact = |k: &str| caps.facts.iter().find(|f| f.0 == k).map(|f| f.1.clone());
    let v = fact("library version").unwrap();
    assert!(v.starts_with("2.3.2 (kiln-standin SIMULATOR"), "{v}");
    assert!(fact("matmul abi").unwrap().starts_with("2.1+"));
    let d = fact("driver").unwrap();
    assert!(d.starts_with("absent: NoDevice"), "{d}");
}

#[test]
fn gates_name_their_reasons() {
    let b = backend(STANDIN);
    let op = |m, k, n, ty| MatmulOp { m, k, n, ty };
    assert_eq!(b.supports(&op(8, 64, 64, GgmlType::F16)), Ok(()));
    assert_eq!(
        b.supports(&op(1, 64, 64, GgmlType::F16)),
        Err(Decline::SmallM { m: 1, min: 8 })
    );
    assert_eq!(
        b.supports(&op(8, 48, 64, GgmlType::F16)),
        Err(Decline::KNotAligned { k: 48, need: 32 })
    );
    assert_eq!(
        b.supports(&op(8, 64, 48, GgmlType::Q8_0)),
        Err(Decline::NNotAligned { n: 48, need: 32 })
    );
    assert_eq!(b.supports(&op(8, 64, 48, GgmlType::F16)), Ok(()));
    assert_eq!(
        b.supports(&op(8, 64, 64, GgmlType::Q4_0)),
        Err(Decline::WeightType { ty: "Q4_0".into() })
    );
}

#[test]
fn abi1_library_is_declined() {
    let b = backend(STANDIN_ABI1);
    let d = b.probe().unwrap_err();
    let Decline::RuntimeAbi { why } = &d else {
        panic!("expected RuntimeAbi, got {d}");
    };
    assert!(why.contains("1.x"), "{why}");
    let op = MatmulOp {
        m: 64,
        k: 64,
        n: 64,
        ty: GgmlType::F16,
    };
    assert_eq!(b.supports(&op).unwrap_err().kind(), "RuntimeAbi");
}

#[test]
fn missing_library_is_no_device() {
    let b = kiln_runtime::backend::npu::NpuBackend::new(kiln_runtime::backend::npu::NpuConfig {
        lib_path: "/nonexistent/librknnrt.so".into(),
        devroot: no_devices(),
        min_m: 8,
        budget: kiln_runtime::backend::npu::DEFAULT_BUDGET,
        omit_sync: None,
        int8_bar: kiln_runtime::backend::npu::INT8_BAR,
    });
    assert_eq!(b.probe().unwrap_err().kind(), "NoDevice");
}

/// kiln's own native-layout packer agrees with the library's `rknn_B_normal_layout_to_native_layout`.
#[test]
fn packer_agrees_with_the_library_conversion() {
    use kiln_runtime::backend::npu::{ffi, layout};
    let lib = unsafe { libloading::Library::new(standin(STANDIN)) }.unwrap();
    type Conv = unsafe extern "C" fn(
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        i32,
        i32,
        *mut ffi::MatmulInfo,
    ) -> i32;
    let conv: libloading::Symbol<Conv> =
        unsafe { lib.get(b"rknn_B_normal_layout_to_native_layout") }.unwrap();
    for int8 in [false, true] {
        let (k, n, es) = (96usize, 64usize, if int8 { 1 } else { 2 });
        let rows: Vec<Vec<u8>> = (0..n)
            .map(|r| (0..k * es).map(|x| (r * 7 + x * 13) as u8).collect())
            .collect();
        // Normal layout B is (K, N).
        let mut normal = vec![0u8; k * n * es];
        for (r, row) in rows.iter().enumerate() {
            for kk in 0..k {
                normal[(kk * n + r) * es..][..es].copy_from_slice(&row[kk * es..][..es]);
            }
        }
        let mut info = ffi::MatmulInfo::zeroed();
        info.ty = if int8 {
            ffi::INT8_MM_INT8_TO_INT32
        } else {
            ffi::FLOAT16_MM_FLOAT16_TO_FLOAT32
        };
        info.b_layout = ffi::LAYOUT_NATIVE;
        let mut out = vec![0u8; k * n * es];
        let r = unsafe {
            conv(
                normal.as_mut_ptr().cast(),
                out.as_mut_ptr().cast(),
                k as i32,
                n as i32,
                &mut info,
            )
        };
        assert_eq!(r, 0);
        assert_eq!(
            layout::pack_native(&rows, es, layout::sub_tile(int8), (0, k), (0, n)),
            out,
            "int8={int8}"
        );
    }
}
