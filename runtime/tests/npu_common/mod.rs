//! Shared by the NPU tests: the stand-in's path, test weights, and an independent f32 reference.
#![allow(dead_code)]

use half::f16;
use kiln_runtime::backend::npu::{NpuBackend, NpuConfig};
use kiln_runtime::quant::GgmlType;
use std::path::PathBuf;

/// The stand-in library built for this test's target, as `cargo xtask test` passes it.
pub fn standin(var: &str) -> PathBuf {
    let p = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "{var} is not set: the NPU tests need rknn-standin built for this target; run them \
             through `cargo xtask test` (stages host-tests / aarch64-tests build it and set {var})"
        )
    });
    assert!(p.is_file(), "{var}={} does not exist", p.display());
    p
}

/// An empty device root: no rknpu driver, as on every machine these tests run on.
pub fn no_devices() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-npu-test-devroot-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

pub fn backend(lib_var: &str) -> NpuBackend {
    backend_with(lib_var, |_| {})
}

/// The stand-in backend with its config changed by `f` (budget, injected faults).
pub fn backend_with(lib_var: &str, f: impl FnOnce(&mut NpuConfig)) -> NpuBackend {
    let mut cfg = NpuConfig {
        lib_path: standin(lib_var),
        devroot: no_devices(),
        min_m: 8,
        budget: kiln_runtime::backend::npu::DEFAULT_BUDGET,
        omit_sync: None,
        int8_bar: kiln_runtime::backend::npu::INT8_BAR,
    };
    f(&mut cfg);
    NpuBackend::new(cfg)
}

/// A counter the stand-in exports for tests (`kiln_standin_b_buffers`, `_mem_bytes`,
/// `_contexts`), read from the same loaded library the backend uses.
pub fn standin_counter(name: &str) -> u64 {
    let lib = unsafe { libloading::Library::new(standin("KILN_RKNN_STANDIN")) }.unwrap();
    let f: libloading::Symbol<unsafe extern "C" fn() -> u64> =
        unsafe { lib.get(name.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"));
    unsafe { f() }
}

/// Deterministic values in [-1, 1).
pub fn values(seed: u64, count: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// W (N rows of K) in `ty`, and the same weight dequantised to f32 by this file's own code.
pub fn weight(ty: GgmlType, k: usize, n: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let x = values(seed, k * n);
    match ty {
        GgmlType::F16 => {
            let bytes = x
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect();
            let deq = x.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
            (bytes, deq)
        }
        GgmlType::Q8_0 => {
            let mut bytes = Vec::new();
            let mut deq = Vec::new();
            for blk in x.chunks_exact(32) {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                bytes.extend_from_slice(&d.to_le_bytes());
                for v in blk {
                    let q = if d.to_f32() == 0.0 {
                        0
                    } else {
                        (v / d.to_f32()).round() as i8
                    };
                    bytes.push(q as u8);
                    deq.push(d.to_f32() * q as f32);
                }
            }
            (bytes, deq)
        }
        t => panic!("no test weights for {t}"),
    }
}

/// C = A · Wᵀ in f64, rounded to f32.
pub fn reference(a: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|x| a[i * k + x] as f64 * w[j * k + x] as f64)
                .sum();
            c[i * n + j] = s as f32;
        }
    }
    c
}

/// llama.cpp's MUL_MAT error measure.
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    err / norm
}

/// The largest error of one element, relative to the output's RMS.
pub fn worst(got: &[f32], want: &[f32]) -> f64 {
    let rms = (want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).abs() / rms)
        .fold(0.0, f64::max)
}

/// C from the CPU reference backend (`cpu-ref`: dequantise, dot in f64), the bar the NPU meets.
pub fn cpu_reference(w: &kiln_runtime::backend::Weight<'_>, a: &[f32], m: usize) -> Vec<f32> {
    use kiln_runtime::backend::{cpu::CpuRefBackend, run_checked, Backend};
    let b = CpuRefBackend;
    let p = b.prepare(w).expect("cpu-ref prepares every loader type");
    let mut c = vec![0f32; m * w.n];
    run_checked(&b, w, p.as_ref(), a, m, &mut c).expect("cpu-ref run");
    c
}
