//! The RK3588 NPU backend: Rockchip's `librknnrt.so` matmul API, loaded at run time, over the
//! vendor rknpu kernel driver. On machines without the NPU the same code runs against
//! `rknn-standin` (`runtime/rknn-standin`), and `probe()` says `simulated`.
//!
//! Per weight: F16 runs as FLOAT16_MM_FLOAT16_TO_FLOAT32; Q8_0 is requantised to per-channel
//! int8 and runs as INT8_MM_INT8_TO_INT32 with per-row int8 activations, the scales applied on
//! the host. K is cut at 8192 and N at 4096, one context per block; B is converted once into the
//! native layout at prepare time. Every run re-binds A with `rknn_matmul_set_io_mem` after writing
//! it (the library re-lays A out there), poisons the device's C buffer, and carries one canary
//! row whose answer the host knows, so an untouched, stale or misrouted result is an error
//! (the field's dead gate, `test-ork-cache`, missed exactly that).

pub mod driver;
pub mod ffi;
pub mod layout;

use crate::backend::{
    Backend, Capabilities, Decline, MatmulOp, PreparedWeight, Weight, POISON_BITS,
};
use crate::ledger::Arrival;
use crate::quant::GgmlType;
use anyhow::{bail, ensure, Context, Result};
use ffi::{check, IoAttr, MatmulInfo, RknnLib, TensorMem};
use half::f16;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// RK3588: K above this is split (the native B layout segments at 8192).
pub const K_SPLIT: usize = 8192;
/// RK3588: N above this is split (the cap UG table 3-14 gives; larger N is unconfirmed).
pub const N_SPLIT: usize = 4096;
/// Below this M the NPU loses to the CPU on RK3588 (decode is at parity or slower).
pub const DEFAULT_MIN_M: usize = 8;

#[derive(Clone, Debug)]
pub struct NpuConfig {
    /// `librknnrt.so` to load: `KILN_RKNN_LIB`, else the dynamic linker's search path.
    pub lib_path: PathBuf,
    /// Where `dev/dri` and `dev/rknpu` are looked for: `/` on a board, a fake tree in tests.
    pub devroot: PathBuf,
    /// Smallest M the backend claims.
    pub min_m: usize,
}

impl Default for NpuConfig {
    fn default() -> NpuConfig {
        NpuConfig {
            lib_path: ffi::default_lib_path(),
            devroot: PathBuf::from("/"),
            min_m: DEFAULT_MIN_M,
        }
    }
}

struct Loaded {
    lib: Arc<RknnLib>,
    driver: Result<driver::Driver, Decline>,
}

pub struct NpuBackend {
    cfg: NpuConfig,
    loaded: OnceLock<Result<Loaded, Decline>>,
}

impl NpuBackend {
    pub fn new(cfg: NpuConfig) -> NpuBackend {
        NpuBackend {
            cfg,
            loaded: OnceLock::new(),
        }
    }

    pub fn config(&self) -> &NpuConfig {
        &self.cfg
    }

    fn loaded(&self) -> Result<&Loaded, Decline> {
        self.loaded
            .get_or_init(|| {
                let lib = RknnLib::load(&self.cfg.lib_path).map_err(|e| match e {
                    ffi::LoadError::Missing(why) => Decline::NoDevice {
                        why: format!("librknnrt: {why}"),
                    },
                    ffi::LoadError::Abi(why) => Decline::RuntimeAbi { why },
                })?;
                let driver = driver::find(&self.cfg.devroot);
                if !lib.simulated() {
                    // The real library without the driver cannot run a matmul.
                    let d = driver.clone()?;
                    if d.version_code < driver::MIN_DRIVER {
                        return Err(Decline::DriverTooOld {
                            found: d.version(),
                            need: driver::version_string(driver::MIN_DRIVER),
                        });
                    }
                }
                Ok(Loaded {
                    lib: Arc::new(lib),
                    driver,
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl Default for NpuBackend {
    fn default() -> NpuBackend {
        NpuBackend::new(NpuConfig::default())
    }
}

/// The element kind an NPU context computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    F16,
    I8,
}

impl Kind {
    fn of(ty: GgmlType) -> Option<Kind> {
        match ty {
            GgmlType::F16 => Some(Kind::F16),
            GgmlType::Q8_0 => Some(Kind::I8),
            _ => None,
        }
    }
    fn elem(self) -> usize {
        match self {
            Kind::F16 => 2,
            Kind::I8 => 1,
        }
    }
    fn n_align(self) -> usize {
        match self {
            Kind::F16 => 16,
            Kind::I8 => 32,
        }
    }
    fn matmul_type(self) -> i32 {
        match self {
            Kind::F16 => ffi::FLOAT16_MM_FLOAT16_TO_FLOAT32,
            Kind::I8 => ffi::INT8_MM_INT8_TO_INT32,
        }
    }
}

/// One K×N block of the weight, in native layout.
struct Block {
    k0: usize,
    kc: usize,
    n0: usize,
    nc: usize,
    b: Vec<u8>,
}

/// A context for one block at one row count, with its three buffers.
struct MmCtx {
    lib: Arc<RknnLib>,
    ctx: ffi::RknnCtx,
    io: IoAttr,
    a: *mut TensorMem,
    b: *mut TensorMem,
    c: *mut TensorMem,
}

// SAFETY: the context and its buffers are used by one thread at a time (behind the Mutex of
// `NpuPrepared::ctxs`); librknnrt contexts are not tied to the creating thread.
unsafe impl Send for MmCtx {}

impl Drop for MmCtx {
    fn drop(&mut self) {
        // SAFETY: these came from this library for this context and are released once.
        // Errors on teardown have no one to report to; the context is gone either way.
        unsafe {
            for m in [self.a, self.b, self.c] {
                if !m.is_null() {
                    (self.lib.destroy_mem)(self.ctx, m);
                }
            }
            (self.lib.matmul_destroy)(self.ctx);
        }
    }
}

/// Buffer of a `rknn_tensor_mem` as a byte slice, checked against the size the caller needs.
///
/// # Safety
/// `m` must be a live buffer from `rknn_create_mem`, not aliased for the slice's lifetime.
unsafe fn mem_bytes<'a>(m: *mut TensorMem, need: usize, what: &str) -> Result<&'a mut [u8]> {
    let mem = m
        .as_ref()
        .with_context(|| format!("rknn_create_mem for {what} returned NULL"))?;
    ensure!(
        !mem.virt_addr.is_null() && mem.size as usize >= need,
        "rknn_create_mem for {what}: buffer of {} bytes at {:?}, need {need}",
        mem.size,
        mem.virt_addr
    );
    Ok(std::slice::from_raw_parts_mut(
        mem.virt_addr.cast::<u8>(),
        need,
    ))
}

impl MmCtx {
    fn create(lib: &Arc<RknnLib>, kind: Kind, rows: usize, blk: &Block) -> Result<MmCtx> {
        let mut info = MatmulInfo::zeroed();
        info.m = rows as i32;
        info.k = blk.kc as i32;
        info.n = blk.nc as i32;
        info.ty = kind.matmul_type();
        info.b_layout = ffi::LAYOUT_NATIVE;
        info.ac_layout = ffi::LAYOUT_NORM;
        let mut io = IoAttr {
            a: ffi::TensorAttr::zeroed(),
            b: ffi::TensorAttr::zeroed(),
            c: ffi::TensorAttr::zeroed(),
        };
        let mut ctx = 0;
        // SAFETY: zeroed 64-byte info and 996-byte io_attr, as the 2.x ABI takes them.
        check("rknn_matmul_create", unsafe {
            (lib.matmul_create)(&mut ctx, &mut info, &mut io)
        })
        .with_context(|| format!("M={rows} K={} N={} type {kind:?}", blk.kc, blk.nc))?;
        let mut mc = MmCtx {
            lib: lib.clone(),
            ctx,
            io,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
        };
        let es = kind.elem();
        let want = [
            ("A", mc.io.a.size as usize, rows * blk.kc * es),
            ("B", mc.io.b.size as usize, blk.b.len()),
            ("C", mc.io.c.size as usize, rows * blk.nc * 4),
        ];
        for (name, got, need) in want {
            ensure!(
                got == need,
                "rknn_matmul_create gave {name} a size of {got} bytes, kiln's layout needs {need}"
            );
        }
        // SAFETY: ctx is live; the calls take it by value.
        unsafe {
            check(
                "rknn_matmul_set_core_mask",
                (lib.matmul_set_core_mask)(ctx, ffi::CORE_AUTO),
            )?;
            mc.a = (lib.create_mem)(ctx, mc.io.a.size);
            mc.b = (lib.create_mem)(ctx, mc.io.b.size);
            mc.c = (lib.create_mem)(ctx, mc.io.c.size);
            mem_bytes(mc.b, blk.b.len(), "B")?.copy_from_slice(&blk.b);
            check(
                "rknn_matmul_set_io_mem(B)",
                (lib.matmul_set_io_mem)(ctx, mc.b, &mut mc.io.b),
            )?;
            mem_bytes(mc.c, mc.io.c.size as usize, "C")?;
            check(
                "rknn_matmul_set_io_mem(C)",
                (lib.matmul_set_io_mem)(ctx, mc.c, &mut mc.io.c),
            )?;
            mem_bytes(mc.a, mc.io.a.size as usize, "A")?;
        }
        Ok(mc)
    }
}

pub struct NpuPrepared {
    lib: Arc<RknnLib>,
    kind: Kind,
    k: usize,
    n: usize,
    blocks: Vec<Block>,
    /// Q8_0: the per-channel scale of each of the N rows.
    b_scale: Vec<f32>,
    ctxs: Mutex<HashMap<(usize, usize), MmCtx>>,
    runs: AtomicU64,
}

impl NpuPrepared {
    fn converted_bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.b.len() as u64).sum()
    }

    /// B(k, n) of block `blk` in the value the NPU multiplies with (f16 or int8, as f64).
    fn b_value(&self, blk: &Block, k: usize, n: usize) -> f64 {
        let (sn, sk) = layout::sub_tile(self.kind == Kind::I8);
        let i = layout::native_index(k, n, blk.kc, sn, sk);
        match self.kind {
            Kind::F16 => f16::from_le_bytes([blk.b[2 * i], blk.b[2 * i + 1]]).to_f64(),
            Kind::I8 => blk.b[i] as i8 as f64,
        }
    }
}

impl PreparedWeight for NpuPrepared {
    fn arrival(&self) -> Arrival {
        Arrival::Converted {
            bytes: self.converted_bytes(),
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// How many contexts one prepared weight keeps (one per block and row count) before it drops
/// them all and starts again.
const CTX_CACHE: usize = 16;

fn splits(total: usize, step: usize) -> Vec<(usize, usize)> {
    (0..total)
        .step_by(step)
        .map(|s| (s, step.min(total - s)))
        .collect()
}

impl Backend for NpuBackend {
    fn name(&self) -> &'static str {
        "npu"
    }

    fn probe(&self) -> Result<Capabilities, Decline> {
        let l = self.loaded()?;
        let mut facts = vec![
            ("library".to_string(), l.lib.path.display().to_string()),
            (
                "library version".to_string(),
                l.lib
                    .version
                    .clone()
                    .unwrap_or_else(|| "unknown (no `librknnrt version:` string)".into()),
            ),
            ("matmul abi".to_string(), l.lib.abi.name().to_string()),
        ];
        facts.push(match &l.driver {
            Ok(d) => (
                "driver".to_string(),
                format!("rknpu {} at {}", d.version(), d.node.display()),
            ),
            Err(e) => ("driver".to_string(), format!("absent: {e}")),
        });
        facts.push(("min M".to_string(), self.cfg.min_m.to_string()));
        Ok(Capabilities {
            facts,
            simulated: l.lib.simulated(),
        })
    }

    fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
        self.loaded()?;
        let Some(kind) = Kind::of(op.ty) else {
            return Err(Decline::WeightType {
                ty: op.ty.name().to_string(),
            });
        };
        if op.k == 0 || op.k % 32 != 0 {
            return Err(Decline::KNotAligned { k: op.k, need: 32 });
        }
        if op.n == 0 || op.n % kind.n_align() != 0 {
            return Err(Decline::NNotAligned {
                n: op.n,
                need: kind.n_align(),
            });
        }
        if op.m < self.cfg.min_m {
            return Err(Decline::SmallM {
                m: op.m,
                min: self.cfg.min_m,
            });
        }
        Ok(())
    }

    fn prepare<'w>(&self, w: &Weight<'w>) -> Result<Box<dyn PreparedWeight + 'w>> {
        let l = self.loaded().map_err(|d| anyhow::anyhow!("npu: {d}"))?;
        self.supports(&MatmulOp::for_weight(w, self.cfg.min_m))
            .map_err(|d| anyhow::anyhow!("npu declines {}: {d}", w.name))?;
        let kind = Kind::of(w.ty).context("checked by supports")?;
        let row_bytes = w.ty.row_bytes(w.k as u64).context("checked by supports")? as usize;
        ensure!(
            w.data.len() == row_bytes * w.n,
            "{}: {} bytes of data, {}×{} {} needs {}",
            w.name,
            w.data.len(),
            w.n,
            w.k,
            w.ty,
            row_bytes * w.n
        );
        // Rows of W in the element type the NPU takes, and (Q8_0) the channel scales.
        let mut rows = Vec::with_capacity(w.n);
        let mut b_scale = Vec::new();
        for n in 0..w.n {
            match kind {
                Kind::F16 => rows.push(w.data[n * row_bytes..(n + 1) * row_bytes].to_vec()),
                Kind::I8 => {
                    let x = layout::q8_0_row(w.data, w.k, n)?;
                    let (q, s) = layout::quantize_sym(&x);
                    ensure!(
                        s.is_finite(),
                        "{}: row {n} holds a non-finite value",
                        w.name
                    );
                    rows.push(q.into_iter().map(|v| v as u8).collect());
                    b_scale.push(s);
                }
            }
        }
        let mut blocks = Vec::new();
        for &(n0, nc) in &splits(w.n, N_SPLIT) {
            for &(k0, kc) in &splits(w.k, K_SPLIT) {
                let b =
                    layout::pack_native(&rows, kind.elem(), kind == Kind::I8, (k0, kc), (n0, nc));
                blocks.push(Block { k0, kc, n0, nc, b });
            }
        }
        Ok(Box::new(NpuPrepared {
            lib: l.lib.clone(),
            kind,
            k: w.k,
            n: w.n,
            blocks,
            b_scale,
            ctxs: Mutex::new(HashMap::new()),
            runs: AtomicU64::new(0),
        }))
    }

    fn run(
        &self,
        w: &Weight<'_>,
        prepared: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> Result<()> {
        let p = prepared
            .as_any()
            .downcast_ref::<NpuPrepared>()
            .with_context(|| format!("{} was not prepared by the npu backend", w.name))?;
        ensure!(
            p.k == w.k && p.n == w.n,
            "{}: prepared for K={} N={}, called with K={} N={}",
            w.name,
            p.k,
            p.n,
            w.k,
            w.n
        );
        self.supports(&MatmulOp::for_weight(w, m))
            .map_err(|d| anyhow::anyhow!("npu declines {} at M={m}: {d}", w.name))?;
        ensure!(
            a.len() == m * w.k && c.len() == m * w.n,
            "A or C has the wrong length"
        );
        ensure!(
            a.iter().all(|v| v.is_finite()),
            "{}: activations hold a non-finite value",
            w.name
        );
        let (k, n) = (w.k, w.n);
        // One extra row: the canary, a multiple of one unit vector; its answer is a column of B.
        let rows = m + 1;
        let run_no = p.runs.fetch_add(1, Ordering::Relaxed);
        let canary_v = 1 + (run_no % 97) as i32;

        // A as the NPU takes it, with the row scales of the int8 path.
        let (a16, a8, a_scale): (Vec<u16>, Vec<i8>, Vec<f32>) = match p.kind {
            Kind::F16 => (
                a.iter().map(|v| f16::from_f32(*v).to_bits()).collect(),
                vec![],
                vec![],
            ),
            Kind::I8 => {
                let mut q = Vec::with_capacity(a.len());
                let mut s = Vec::with_capacity(m);
                for row in a.chunks_exact(k) {
                    let (qr, sr) = layout::quantize_sym(row);
                    q.extend(qr);
                    s.push(sr);
                }
                (vec![], q, s)
            }
        };
        let mut acc_f = vec![0f64; m * n];

        let mut ctxs = p.ctxs.lock().unwrap_or_else(|e| e.into_inner());
        if ctxs.len() >= CTX_CACHE * p.blocks.len() {
            ctxs.clear();
        }
        for (bi, blk) in p.blocks.iter().enumerate() {
            let mc = match ctxs.entry((bi, rows)) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(MmCtx::create(&p.lib, p.kind, rows, blk).with_context(|| {
                        format!(
                            "{}: block K {}+{} N {}+{}",
                            w.name, blk.k0, blk.kc, blk.n0, blk.nc
                        )
                    })?)
                }
            };
            let es = p.kind.elem();
            let canary_col = (run_no as usize) % blk.kc;
            // SAFETY: the buffers belong to `mc`, live, and are only touched under the lock.
            unsafe {
                let abuf = mem_bytes(mc.a, rows * blk.kc * es, "A")?;
                for i in 0..rows {
                    for kk in 0..blk.kc {
                        let at = (i * blk.kc + kk) * es;
                        let src = i * k + blk.k0 + kk;
                        match p.kind {
                            Kind::F16 => {
                                let bits = if i < m {
                                    a16[src]
                                } else if kk == canary_col {
                                    f16::from_f32(canary_v as f32).to_bits()
                                } else {
                                    0
                                };
                                abuf[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                            }
                            Kind::I8 => {
                                abuf[at] = if i < m {
                                    a8[src] as u8
                                } else if kk == canary_col {
                                    canary_v as i8 as u8
                                } else {
                                    0
                                };
                            }
                        }
                    }
                }
                // The library takes A in here, not at run: bind it after every write.
                check(
                    "rknn_matmul_set_io_mem(A)",
                    (p.lib.matmul_set_io_mem)(mc.ctx, mc.a, &mut mc.io.a),
                )?;
                let cbuf = mem_bytes(mc.c, rows * blk.nc * 4, "C")?;
                for v in cbuf.chunks_exact_mut(4) {
                    v.copy_from_slice(&POISON_BITS.to_le_bytes());
                }
                check("rknn_matmul_run", (p.lib.matmul_run)(mc.ctx)).with_context(|| {
                    format!(
                        "{}: block K {}+{} N {}+{} at M={m}",
                        w.name, blk.k0, blk.kc, blk.n0, blk.nc
                    )
                })?;
                let cbuf = mem_bytes(mc.c, rows * blk.nc * 4, "C")?;
                let word = |i: usize, j: usize| {
                    let o = (i * blk.nc + j) * 4;
                    u32::from_le_bytes([cbuf[o], cbuf[o + 1], cbuf[o + 2], cbuf[o + 3]])
                };
                let untouched = (0..rows * blk.nc)
                    .filter(|x| word(x / blk.nc, x % blk.nc) == POISON_BITS)
                    .count();
                if untouched > 0 {
                    bail!(
                        "rknn_matmul_run returned success but left {untouched} of {} outputs \
                         untouched ({}: block K {}+{} N {}+{})",
                        rows * blk.nc,
                        w.name,
                        blk.k0,
                        blk.kc,
                        blk.n0,
                        blk.nc
                    );
                }
                let value = |bits: u32| match p.kind {
                    Kind::F16 => f32::from_bits(bits) as f64,
                    Kind::I8 => bits as i32 as f64,
                };
                for j in 0..blk.nc {
                    let want = canary_v as f64 * p.b_value(blk, canary_col, j);
                    let got = value(word(m, j));
                    if got != want {
                        bail!(
                            "rknn_matmul_run returned success but its output is not this run's: \
                             canary row, column {j}, expected {want}, got {got} (stale or \
                             misrouted result; {}: block K {}+{} N {}+{})",
                            w.name,
                            blk.k0,
                            blk.kc,
                            blk.n0,
                            blk.nc
                        );
                    }
                }
                for i in 0..m {
                    for j in 0..blk.nc {
                        acc_f[i * n + blk.n0 + j] += value(word(i, j));
                    }
                }
            }
        }
        drop(ctxs);
        for i in 0..m {
            for j in 0..n {
                let v = acc_f[i * n + j];
                c[i * n + j] = match p.kind {
                    Kind::F16 => v as f32,
                    Kind::I8 => (v * a_scale[i] as f64 * p.b_scale[j] as f64) as f32,
                };
            }
        }
        Ok(())
    }
}
