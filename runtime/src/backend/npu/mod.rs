//! The RK3588 NPU backend: Rockchip's `librknnrt.so` matmul API, loaded at run time, over the
//! vendor rknpu kernel driver. On machines without the NPU the same code runs against
//! `rknn-standin` (`runtime/rknn-standin`), and `probe()` says `simulated`.
//!
//! Per weight: F16 runs as FLOAT16_MM_FLOAT16_TO_FLOAT32; Q8_0 is requantised to per-channel
//! int8 and runs as INT8_MM_INT8_TO_INT32 with per-row int8 activations, the scales applied on
//! the host. K is cut at 8192 and N at 4096, one block each.
//!
//! Memory: each block's B is converted once, at prepare time, into ONE `rknn_tensor_mem` (owned
//! by the block's first context) that every context of that block binds with
//! `rknn_matmul_set_io_mem`; contexts exist per M bucket (the next power of two of M + 1, the
//! canary row), created lazily and at most [`MAX_CTXS`] per block. The NPU bytes of a weight (its
//! converted B) are reserved against the budget ([`NpuConfig::budget`]) in the order weights are
//! prepared ([`crate::sched::prepare_order`], the model load's and `kiln plan`'s alike); a
//! weight that does not fit is declined with `NpuMemory { need, left }`.
//!
//! Layout: the tile used to convert B is the one the library reports in `io_attr.B.dims[2..4]`
//! after `rknn_matmul_create`, and A, B and C's dims and types are checked against what kiln
//! lays out; anything else is declined as `LayoutMismatch`.
//!
//! Coherence: `rknn_create_mem` memory is cacheable. `rknn_mem_sync` TO_DEVICE after the CPU
//! writes B (once), A (every run) and C's poison; FROM_DEVICE before the CPU reads C.
//!
//! Every run re-binds A with `rknn_matmul_set_io_mem` after writing it (the library re-lays A
//! out there), poisons C, and carries one canary row whose answer the host knows and padding rows
//! (zero A) whose answer is exactly zero, so an untouched, stale or misrouted result is an error
//! (the field's dead gate, `test-ork-cache`, missed exactly that). Activations beyond fp16's
//! range are refused with `Fp16Range` (the caller falls back to the CPU), never sent as inf.
//!
//! One user: once the library has loaded, and before the driver is opened or the library is
//! asked for anything, the backend takes the process's NPU lock ([`lock`],
//! `<devroot>/run/kiln/npu.lock`) and holds it as long as it lives. Another process holding it
//! is an error naming that process ([`NpuBackend::open`]), never a fall back to the CPU.

pub mod driver;
pub mod ffi;
pub mod layout;
pub mod lock;

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
/// NPU memory for converted weights when the board recipe names none: 1 GiB (rock-5b).
pub const DEFAULT_BUDGET: u64 = 1 << 30;
/// The hard cap: one IOMMU domain is a 4 GiB NPU address space, and kiln uses domain 0 only.
pub const IOMMU_DOMAIN: u64 = 4 << 30;
/// Contexts (M buckets) kept per block, the one that owns B included.
pub const MAX_CTXS: usize = 8;
/// fp16's largest finite value; beyond it a value is inf on the NPU.
pub const FP16_MAX: f32 = 65504.0;

#[derive(Clone, Debug)]
pub struct NpuConfig {
    /// `librknnrt.so` to load: `KILN_RKNN_LIB`, else the dynamic linker's search path.
    pub lib_path: PathBuf,
    /// Where `dev/dri` and `dev/rknpu` are looked for, and the lock (`run/kiln/npu.lock`) is
    /// taken: `KILN_DEVROOT`, else `/` on a board; a fake tree in tests.
    pub devroot: PathBuf,
    /// Smallest M the backend claims.
    pub min_m: usize,
    /// Bytes of NPU memory converted weights may take (capped at [`IOMMU_DOMAIN`]):
    /// `KILN_NPU_BUDGET_MIB`, else [`DEFAULT_BUDGET`].
    pub budget: u64,
    /// Fault injection for tests: skip this cache sync, as a backend that forgot it would (the
    /// non-coherent stand-in then gives stale operands or results, which the run must catch).
    pub omit_sync: Option<SyncPoint>,
    /// The int8 path's accuracy bar: an op whose estimated NMSE (the worst activation row's
    /// int8 error plus the weight's requantisation error) is above it is declined as
    /// `Int8Accuracy` and runs elsewhere. Default [`INT8_BAR`].
    pub int8_bar: f64,
}

/// llama.cpp's MUL_MAT NMSE bar (test-backend-ops), the accuracy the int8 path must keep.
pub const INT8_BAR: f64 = 5e-4;

/// The cache syncs a run depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncPoint {
    /// TO_DEVICE after converting B (prepare).
    B,
    /// TO_DEVICE after writing A (every run).
    A,
    /// FROM_DEVICE before reading C (every run).
    C,
}

/// `KILN_NPU_BUDGET_MIB` in bytes, else [`DEFAULT_BUDGET`]. A value that does not parse is an
/// error that names the variable.
pub fn budget_from_env() -> Result<u64> {
    match std::env::var("KILN_NPU_BUDGET_MIB") {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(|mib| mib << 20)
            .with_context(|| format!("KILN_NPU_BUDGET_MIB={v:?} is not a whole number of MiB")),
        Err(_) => Ok(DEFAULT_BUDGET),
    }
}

/// `KILN_DEVROOT`, else `/`: the device root of the commands that take no `--root`.
pub fn devroot_from_env() -> PathBuf {
    std::env::var_os("KILN_DEVROOT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"))
}

impl Default for NpuConfig {
    fn default() -> NpuConfig {
        NpuConfig {
            lib_path: ffi::default_lib_path(),
            devroot: devroot_from_env(),
            min_m: DEFAULT_MIN_M,
            // A bad variable is reported by `kiln plan`, which reads it with `budget_from_env`.
            budget: budget_from_env().unwrap_or(DEFAULT_BUDGET),
            omit_sync: None,
            int8_bar: INT8_BAR,
        }
    }
}

struct Loaded {
    lib: Arc<RknnLib>,
    driver: Result<driver::Driver, Decline>,
    /// This process's hold on the NPU, for as long as the backend lives.
    lock: lock::NpuLock,
}

pub struct NpuBackend {
    cfg: NpuConfig,
    loaded: OnceLock<Result<Loaded, Decline>>,
    /// Bytes of the budget held by live prepared weights.
    reserved: Arc<AtomicU64>,
}

impl NpuBackend {
    pub fn new(cfg: NpuConfig) -> NpuBackend {
        NpuBackend {
            cfg,
            loaded: OnceLock::new(),
            reserved: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A backend for every command that runs on the NPU: [`NpuBackend::new`], with the library
    /// loaded and the NPU lock taken now. Another process holding the NPU is an error naming it;
    /// any other reason the NPU is unusable (no library, no driver) stays a decline, so the
    /// model runs on the CPU as before.
    pub fn open(cfg: NpuConfig) -> Result<NpuBackend> {
        let b = NpuBackend::new(cfg);
        if let Err(Decline::NpuLock { why }) = b.loaded() {
            bail!("{why}");
        }
        Ok(b)
    }

    pub fn config(&self) -> &NpuConfig {
        &self.cfg
    }

    /// The budget in force: the configured one, capped at one IOMMU domain.
    pub fn budget(&self) -> u64 {
        self.cfg.budget.min(IOMMU_DOMAIN)
    }

    /// Bytes of the budget that live prepared weights hold.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::SeqCst)
    }

    /// Take `need` bytes of the budget, or say how much is left.
    fn reserve(&self, need: u64) -> Result<Reservation, Decline> {
        let budget = self.budget();
        let mut cur = self.reserved.load(Ordering::SeqCst);
        loop {
            let left = budget.saturating_sub(cur);
            if need > left {
                return Err(Decline::NpuMemory { need, left });
            }
            match self.reserved.compare_exchange(
                cur,
                cur + need,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    return Ok(Reservation {
                        pool: self.reserved.clone(),
                        bytes: need,
                    })
                }
                Err(now) => cur = now,
            }
        }
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
                // Before anything opens the device (the driver's ioctls, the library's calls).
                let lock = lock::acquire(&self.cfg.devroot)
                    .map_err(|e| Decline::NpuLock { why: e.to_string() })?;
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
                    lock,
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

/// Budget bytes held by one prepared weight, given back when it is dropped.
struct Reservation {
    pool: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pool.fetch_sub(self.bytes, Ordering::SeqCst);
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
    fn in_type(self) -> i32 {
        match self {
            Kind::F16 => ffi::TENSOR_FLOAT16,
            Kind::I8 => ffi::TENSOR_INT8,
        }
    }
    fn out_type(self) -> i32 {
        match self {
            Kind::F16 => ffi::TENSOR_FLOAT32,
            Kind::I8 => ffi::TENSOR_INT32,
        }
    }
}

/// The M bucket (rows of the context) for `m` rows of activations: the canary row added, the
/// next power of two, at least `floor`.
pub fn bucket(m: usize, floor: usize) -> usize {
    (m + 1).next_power_of_two().max(floor)
}

/// A context for one block at one bucket, with its own A and C buffers (B is the block's).
struct MmCtx {
    lib: Arc<RknnLib>,
    ctx: ffi::RknnCtx,
    rows: usize,
    io: IoAttr,
    a: *mut TensorMem,
    c: *mut TensorMem,
    /// The last run that used it (for evicting the least recently used).
    used: u64,
}

// SAFETY: the context and its buffers are used by one thread at a time (behind the Mutex of
// `NpuPrepared::blocks`); librknnrt contexts are not tied to the creating thread.
unsafe impl Send for MmCtx {}

impl Drop for MmCtx {
    fn drop(&mut self) {
        // SAFETY: these came from this library for this context and are released once.
        // Errors on teardown have no one to report to; the context is gone either way.
        unsafe {
            for m in [self.a, self.c] {
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

fn dims(t: &ffi::TensorAttr) -> &[u32] {
    &t.dims[..(t.n_dims as usize).min(t.dims.len())]
}

fn type_name(t: i32) -> &'static str {
    match t {
        ffi::TENSOR_FLOAT32 => "FLOAT32",
        ffi::TENSOR_FLOAT16 => "FLOAT16",
        ffi::TENSOR_INT8 => "INT8",
        ffi::TENSOR_INT32 => "INT32",
        _ => "another type",
    }
}

/// What `io_attr` must say for a context of `rows`×`kc`×`nc`, with B in the tile `tile`
/// (None: the first context of a block, whose reported tile is taken if it is RK3588's).
/// Returns the tile B is laid out in; anything else is a `LayoutMismatch` decline.
fn check_io(
    io: &IoAttr,
    kind: Kind,
    rows: usize,
    kc: usize,
    nc: usize,
    tile: Option<(usize, usize)>,
) -> std::result::Result<(usize, usize), Decline> {
    let bad = |why: String| Decline::LayoutMismatch { why };
    let es = kind.elem();
    let want_dims = |name: &str, t: &ffi::TensorAttr, want: &[u32], ty: i32, size: usize| {
        if dims(t) != want {
            return Err(bad(format!(
                "{name} dims {:?}, kiln lays out {want:?}",
                dims(t)
            )));
        }
        if t.ty != ty {
            return Err(bad(format!(
                "{name} type {} ({}), kiln expects {} ({ty})",
                type_name(t.ty),
                t.ty,
                type_name(ty)
            )));
        }
        if t.size as usize != size {
            return Err(bad(format!(
                "{name} size {} bytes, kiln's layout needs {size}",
                t.size
            )));
        }
        Ok(())
    };
    want_dims(
        "A",
        &io.a,
        &[rows as u32, kc as u32],
        kind.in_type(),
        rows * kc * es,
    )?;
    want_dims(
        "C",
        &io.c,
        &[rows as u32, nc as u32],
        kind.out_type(),
        rows * nc * 4,
    )?;
    let b = dims(&io.b);
    if b.len() != 4 || b[2] == 0 || b[3] == 0 {
        return Err(bad(format!(
            "B dims {b:?}, kiln expects [N/subN, K/subK, subN, subK]"
        )));
    }
    let got = (b[2] as usize, b[3] as usize);
    let expect = layout::sub_tile(kind == Kind::I8);
    if got != tile.unwrap_or(expect) {
        return Err(bad(format!(
            "B tile (subN, subK) = {got:?}, kiln converts for {:?}",
            tile.unwrap_or(expect)
        )));
    }
    if kc % got.1 != 0 || nc % got.0 != 0 {
        return Err(bad(format!("B tile {got:?} does not divide K={kc} N={nc}")));
    }
    want_dims(
        "B",
        &io.b,
        &[
            (nc / got.0) as u32,
            (kc / got.1) as u32,
            got.0 as u32,
            got.1 as u32,
        ],
        kind.in_type(),
        kc * nc * es,
    )?;
    Ok(got)
}

/// `rknn_matmul_create` for `rows`×`kc`×`nc`, its io_attr checked, and its A and C buffers.
/// Errors that are a `Decline` (`LayoutMismatch`) say the library is not what kiln expects.
fn create_ctx(
    lib: &Arc<RknnLib>,
    kind: Kind,
    rows: usize,
    kc: usize,
    nc: usize,
    tile: Option<(usize, usize)>,
) -> Result<(MmCtx, (usize, usize))> {
    let mut info = MatmulInfo::zeroed();
    info.m = rows as i32;
    info.k = kc as i32;
    info.n = nc as i32;
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
    .with_context(|| format!("M={rows} K={kc} N={nc} type {kind:?}"))?;
    let mut mc = MmCtx {
        lib: lib.clone(),
        ctx,
        rows,
        io,
        a: std::ptr::null_mut(),
        c: std::ptr::null_mut(),
        used: 0,
    };
    let tile = check_io(&mc.io, kind, rows, kc, nc, tile)?;
    // SAFETY: ctx is live; the calls take it by value; the buffers are checked before use.
    unsafe {
        check(
            "rknn_matmul_set_core_mask",
            (lib.matmul_set_core_mask)(ctx, ffi::CORE_AUTO),
        )?;
        mc.a = (lib.create_mem)(ctx, mc.io.a.size);
        mem_bytes(mc.a, mc.io.a.size as usize, "A")?;
        mc.c = (lib.create_mem)(ctx, mc.io.c.size);
        mem_bytes(mc.c, mc.io.c.size as usize, "C")?;
        check(
            "rknn_matmul_set_io_mem(C)",
            (lib.matmul_set_io_mem)(ctx, mc.c, &mut mc.io.c),
        )?;
    }
    Ok((mc, tile))
}

/// One K×N block of the weight: its B buffer (in the native layout, owned by `home`) and the
/// contexts of every M bucket that bind it.
struct Block {
    k0: usize,
    kc: usize,
    n0: usize,
    nc: usize,
    /// The tile B was converted with, as the library reported it.
    tile: (usize, usize),
    /// The one B buffer, created in `home`'s context.
    b: *mut TensorMem,
    /// The first context (the smallest bucket): owns `b`, never evicted.
    home: Option<MmCtx>,
    /// Contexts of the other buckets, by rows; at most [`MAX_CTXS`] − 1.
    others: HashMap<usize, MmCtx>,
}

// SAFETY: as for `MmCtx`: one thread at a time, behind `NpuPrepared::blocks`' Mutex.
unsafe impl Send for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // The contexts that bind B go first, then B, then the context that owns it.
        self.others.clear();
        if let Some(home) = self.home.take() {
            if !self.b.is_null() {
                // SAFETY: `b` came from `home`'s context and is released once, here.
                unsafe { (home.lib.destroy_mem)(home.ctx, self.b) };
            }
        }
    }
}

impl Block {
    /// B(k, n) as the NPU multiplies it (f16 or int8, as f64), read back from the B buffer.
    fn b_value(&self, kind: Kind, k: usize, n: usize) -> Result<f64> {
        let i = layout::native_index(k, n, self.kc, self.tile.0, self.tile.1);
        // SAFETY: `b` is live for as long as the block; the host side is only read here.
        let b = unsafe { mem_bytes(self.b, self.kc * self.nc * kind.elem(), "B")? };
        Ok(match kind {
            Kind::F16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f64(),
            Kind::I8 => b[i] as i8 as f64,
        })
    }

    /// The context for `rows`, created (and B bound to it) if it does not exist yet; the least
    /// recently used is dropped when the block would hold more than [`MAX_CTXS`].
    fn ctx(&mut self, lib: &Arc<RknnLib>, kind: Kind, rows: usize, run: u64) -> Result<&mut MmCtx> {
        let home_rows = self.home.as_ref().map(|h| h.rows);
        if home_rows == Some(rows) {
            let h = self
                .home
                .as_mut()
                .context("block without its home context")?;
            h.used = run;
            return Ok(h);
        }
        if !self.others.contains_key(&rows) {
            if self.others.len() + 1 >= MAX_CTXS {
                if let Some(old) = self.others.values().min_by_key(|c| c.used).map(|c| c.rows) {
                    self.others.remove(&old);
                }
            }
            let (mut mc, _) = create_ctx(lib, kind, rows, self.kc, self.nc, Some(self.tile))?;
            // SAFETY: `b` is live and already synced to the device; this context binds it.
            check("rknn_matmul_set_io_mem(B, shared)", unsafe {
                (lib.matmul_set_io_mem)(mc.ctx, self.b, &mut mc.io.b)
            })?;
            self.others.insert(rows, mc);
        }
        let c = self
            .others
            .get_mut(&rows)
            .context("context just inserted")?;
        c.used = run;
        Ok(c)
    }

    /// Live contexts of this block.
    fn contexts(&self) -> usize {
        self.others.len() + usize::from(self.home.is_some())
    }
}

pub struct NpuPrepared {
    lib: Arc<RknnLib>,
    kind: Kind,
    k: usize,
    n: usize,
    /// The smallest bucket: the rows of each block's home context.
    floor: usize,
    blocks: Mutex<Vec<Block>>,
    /// Bytes of converted B (the weight's NPU memory).
    converted: u64,
    /// Q8_0: the per-channel scale of each of the N rows.
    b_scale: Vec<f32>,
    /// Q8_0: NMSE of the per-row int8 weight against the Q8_0 weight (the requantisation's
    /// own loss, before any activation is quantised).
    requant_nmse: Option<f64>,
    runs: AtomicU64,
    _reservation: Reservation,
}

impl NpuPrepared {
    /// NPU bytes this weight holds: its converted B.
    pub fn npu_bytes(&self) -> u64 {
        self.converted
    }

    /// Q8_0 only: NMSE of the per-row int8 requantisation against the Q8_0 weight.
    pub fn requant_nmse(&self) -> Option<f64> {
        self.requant_nmse
    }

    /// Live contexts over all blocks (bounded by [`MAX_CTXS`] per block).
    pub fn contexts(&self) -> usize {
        self.blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(Block::contexts)
            .sum()
    }

    /// Blocks (K and N splits): one B buffer each.
    pub fn blocks(&self) -> usize {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl PreparedWeight for NpuPrepared {
    fn arrival(&self) -> Arrival {
        Arrival::Converted {
            bytes: self.converted,
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn splits(total: usize, step: usize) -> Vec<(usize, usize)> {
    (0..total)
        .step_by(step)
        .map(|s| (s, step.min(total - s)))
        .collect()
}

/// The largest magnitude in `x`, as `Fp16Range` reports it (rounded up; inf as `u64::MAX`).
fn range_max(x: f32) -> u64 {
    if x.is_finite() {
        x.abs().ceil() as u64
    } else {
        u64::MAX
    }
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
        facts.push(("lock".to_string(), l.lock.path().display().to_string()));
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
        // The budget first: a weight that does not fit is declined before any work.
        let converted = (w.k * w.n * kind.elem()) as u64;
        let reservation = self
            .reserve(converted)
            .map_err(|d| anyhow::Error::new(d).context(format!("npu declines {}", w.name)))?;
        // Rows of W in the element type the NPU takes, and (Q8_0) the channel scales.
        let mut rows = Vec::with_capacity(w.n);
        let mut b_scale = Vec::new();
        let (mut err, mut norm) = (0f64, 0f64);
        for n in 0..w.n {
            match kind {
                Kind::F16 => {
                    let row = &w.data[n * row_bytes..(n + 1) * row_bytes];
                    // A finite f16 is within ±65504 by construction; inf (or NaN) is not.
                    let bad = row
                        .chunks_exact(2)
                        .any(|b| !f16::from_le_bytes([b[0], b[1]]).is_finite());
                    if bad {
                        return Err(anyhow::Error::new(Decline::Fp16Range { max: u64::MAX })
                            .context(format!("npu declines {}: row {n}", w.name)));
                    }
                    rows.push(row.to_vec());
                }
                Kind::I8 => {
                    let x = layout::q8_0_row(w.data, w.k, n)?;
                    let (q, s) = layout::quantize_sym(&x);
                    ensure!(
                        s.is_finite(),
                        "{}: row {n} holds a non-finite value",
                        w.name
                    );
                    for (v, qv) in x.iter().zip(&q) {
                        err += (*v as f64 - *qv as f64 * s as f64).powi(2);
                        norm += (*v as f64).powi(2);
                    }
                    rows.push(q.into_iter().map(|v| v as u8).collect());
                    b_scale.push(s);
                }
            }
        }
        let floor = bucket(self.cfg.min_m, 1);
        let mut blocks = Vec::new();
        for &(n0, nc) in &splits(w.n, N_SPLIT) {
            for &(k0, kc) in &splits(w.k, K_SPLIT) {
                let what = || format!("{}: block K {k0}+{kc} N {n0}+{nc}", w.name);
                let (home, tile) =
                    create_ctx(&l.lib, kind, floor, kc, nc, None).with_context(what)?;
                let mut blk = Block {
                    k0,
                    kc,
                    n0,
                    nc,
                    tile,
                    b: std::ptr::null_mut(),
                    home: Some(home),
                    others: HashMap::new(),
                };
                let h = blk.home.as_mut().context("home context")?;
                let size = h.io.b.size;
                // SAFETY: the home context is live; B is written by the CPU, then cleaned to
                // the device once, then bound; it is released in `Block::drop`.
                unsafe {
                    blk.b = (l.lib.create_mem)(h.ctx, size);
                    let out = mem_bytes(blk.b, kc * nc * kind.elem(), "B").with_context(what)?;
                    layout::pack_native_into(out, &rows, kind.elem(), tile, (k0, kc), (n0, nc));
                    if self.cfg.omit_sync != Some(SyncPoint::B) {
                        check(
                            "rknn_mem_sync(B, TO_DEVICE)",
                            (l.lib.mem_sync)(h.ctx, blk.b, ffi::SYNC_TO_DEVICE),
                        )
                        .with_context(what)?;
                    }
                    check(
                        "rknn_matmul_set_io_mem(B)",
                        (l.lib.matmul_set_io_mem)(h.ctx, blk.b, &mut h.io.b),
                    )
                    .with_context(what)?;
                }
                blocks.push(blk);
            }
        }
        Ok(Box::new(NpuPrepared {
            lib: l.lib.clone(),
            kind,
            k: w.k,
            n: w.n,
            floor,
            blocks: Mutex::new(blocks),
            converted,
            b_scale,
            requant_nmse: (kind == Kind::I8).then(|| if norm > 0.0 { err / norm } else { 0.0 }),
            runs: AtomicU64::new(0),
            _reservation: reservation,
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
            !a.iter().any(|v| v.is_nan()),
            "{}: activations hold a NaN",
            w.name
        );
        if p.kind == Kind::F16 {
            // Beyond ±65504 a value is inf in fp16: refuse, so the caller runs it elsewhere.
            let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax > FP16_MAX {
                return Err(anyhow::Error::new(Decline::Fp16Range {
                    max: range_max(amax),
                })
                .context(format!("npu declines {} at M={m}", w.name)));
            }
        }
        let (k, n) = (w.k, w.n);
        // Rows m: the canary, a multiple of one unit vector, whose answer is a column of B;
        // rows m+1..: padding up to the bucket, zero A, whose answer is exactly zero.
        let rows = bucket(m, p.floor);
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
                let mut worst_row = 0f64;
                for row in a.chunks_exact(k) {
                    let (qr, sr) = layout::quantize_sym(row);
                    let (mut err, mut norm) = (0f64, 0f64);
                    for (v, qv) in row.iter().zip(&qr) {
                        err += (*v as f64 - *qv as f64 * sr as f64).powi(2);
                        norm += (*v as f64).powi(2);
                    }
                    if norm > 0.0 {
                        worst_row = worst_row.max(err / norm);
                    }
                    q.extend(qr);
                    s.push(sr);
                }
                // Independent errors of A and B add in a dot product's relative error.
                let estimate = worst_row + p.requant_nmse.unwrap_or(0.0);
                if estimate > self.cfg.int8_bar {
                    return Err(anyhow::Error::new(Decline::Int8Accuracy {
                        estimate: format!("{estimate:.2e}"),
                        bar: format!("{:.2e}", self.cfg.int8_bar),
                    })
                    .context(format!("npu declines {} at M={m}", w.name)));
                }
                (vec![], q, s)
            }
        };
        let mut acc_f = vec![0f64; m * n];

        let mut blocks = p.blocks.lock().unwrap_or_else(|e| e.into_inner());
        for blk in blocks.iter_mut() {
            let where_ = format!(
                "{}: block K {}+{} N {}+{} at M={m} (bucket {rows})",
                w.name, blk.k0, blk.kc, blk.n0, blk.nc
            );
            let es = p.kind.elem();
            let canary_col = (run_no as usize) % blk.kc;
            let want_canary: Vec<f64> = (0..blk.nc)
                .map(|j| Ok(canary_v as f64 * blk.b_value(p.kind, canary_col, j)?))
                .collect::<Result<_>>()?;
            let (blk_k0, blk_kc, blk_nc) = (blk.k0, blk.kc, blk.nc);
            let mc = blk
                .ctx(&p.lib, p.kind, rows, run_no)
                .with_context(|| where_.clone())?;
            // SAFETY: the buffers belong to `mc` (and B to the block), live, and are only
            // touched under the lock.
            unsafe {
                let abuf = mem_bytes(mc.a, rows * blk_kc * es, "A")?;
                for i in 0..rows {
                    for kk in 0..blk_kc {
                        let at = (i * blk_kc + kk) * es;
                        let src = i * k + blk_k0 + kk;
                        match p.kind {
                            Kind::F16 => {
                                let bits = if i < m {
                                    a16[src]
                                } else if i == m && kk == canary_col {
                                    f16::from_f32(canary_v as f32).to_bits()
                                } else {
                                    0
                                };
                                abuf[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                            }
                            Kind::I8 => {
                                abuf[at] = if i < m {
                                    a8[src] as u8
                                } else if i == m && kk == canary_col {
                                    canary_v as i8 as u8
                                } else {
                                    0
                                };
                            }
                        }
                    }
                }
                if self.cfg.omit_sync != Some(SyncPoint::A) {
                    check(
                        "rknn_mem_sync(A, TO_DEVICE)",
                        (p.lib.mem_sync)(mc.ctx, mc.a, ffi::SYNC_TO_DEVICE),
                    )
                    .with_context(|| where_.clone())?;
                }
                // The library takes A in here, not at run: bind it after every write.
                check(
                    "rknn_matmul_set_io_mem(A)",
                    (p.lib.matmul_set_io_mem)(mc.ctx, mc.a, &mut mc.io.a),
                )?;
                let cbuf = mem_bytes(mc.c, rows * blk_nc * 4, "C")?;
                for v in cbuf.chunks_exact_mut(4) {
                    v.copy_from_slice(&POISON_BITS.to_le_bytes());
                }
                // Clean the poison out of the cache, so no dirty line lands on the NPU's result.
                check(
                    "rknn_mem_sync(C, TO_DEVICE)",
                    (p.lib.mem_sync)(mc.ctx, mc.c, ffi::SYNC_TO_DEVICE),
                )
                .with_context(|| where_.clone())?;
                check("rknn_matmul_run", (p.lib.matmul_run)(mc.ctx))
                    .with_context(|| where_.clone())?;
                if self.cfg.omit_sync != Some(SyncPoint::C) {
                    check(
                        "rknn_mem_sync(C, FROM_DEVICE)",
                        (p.lib.mem_sync)(mc.ctx, mc.c, ffi::SYNC_FROM_DEVICE),
                    )
                    .with_context(|| where_.clone())?;
                }
                let cbuf = mem_bytes(mc.c, rows * blk_nc * 4, "C")?;
                let word = |i: usize, j: usize| {
                    let o = (i * blk_nc + j) * 4;
                    u32::from_le_bytes([cbuf[o], cbuf[o + 1], cbuf[o + 2], cbuf[o + 3]])
                };
                let untouched = (0..rows * blk_nc)
                    .filter(|x| word(x / blk_nc, x % blk_nc) == POISON_BITS)
                    .count();
                if untouched > 0 {
                    bail!(
                        "rknn_matmul_run returned success but left {untouched} of {} outputs \
                         untouched ({where_})",
                        rows * blk_nc,
                    );
                }
                let value = |bits: u32| match p.kind {
                    Kind::F16 => f32::from_bits(bits) as f64,
                    Kind::I8 => bits as i32 as f64,
                };
                // int8 is exact. fp16 is exact too (one product, 18 significant bits), except
                // that hardware may flush fp16 subnormals: allow that much and no more.
                let slack = match p.kind {
                    Kind::F16 => canary_v as f64 * f64::powi(2.0, -14),
                    Kind::I8 => 0.0,
                };
                for (j, want) in want_canary.iter().enumerate() {
                    let got = value(word(m, j));
                    let close = (got - want).abs() <= slack; // false for NaN too
                    if !close {
                        bail!(
                            "rknn_matmul_run returned success but its output is not this run's: \
                             canary row, column {j}, expected {want}, got {got} (stale or \
                             misrouted result; {where_})"
                        );
                    }
                }
                for i in m + 1..rows {
                    if let Some(j) = (0..blk_nc).find(|j| value(word(i, *j)) != 0.0) {
                        bail!(
                            "rknn_matmul_run returned success but padding row {i} (zero A) \
                             gave {} at column {j}, not 0 (misrouted rows; {where_})",
                            value(word(i, j))
                        );
                    }
                }
                for i in 0..m {
                    for j in 0..blk_nc {
                        acc_f[i * n + blk.n0 + j] += value(word(i, j));
                    }
                }
            }
        }
        drop(blocks);
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
