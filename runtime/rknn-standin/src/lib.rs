//! A stand-in for Rockchip's `librknnrt.so`, matmul subset. It exports the same C symbols with
//! the same struct layouts (2.x ABI, or 1.x with the `abi1` feature), enforces RK3588's shape and
//! layout rules (a violation is `RKNN_ERR_PARAM_INVALID`, as the real library answers), reads B in
//! the native layout and computes like the hardware: fp16 × fp16 with f32 accumulation, int8 ×
//! int8 into int32. It runs where no NPU exists (tests, the QEMU image) and must never pass for
//! the real thing: its embedded version string says SIMULATOR, which kiln reports as `simulated`.
//!
//! Faults, chosen per `rknn_matmul_run` by `KILN_RKNN_STANDIN_FAULT`:
//! `error` (run returns `RKNN_ERR_FAIL`), `untouched` (success, C not written), `wrong` (one
//! output perturbed), `stale` (C gets the previous run's output of that context); and at
//! `rknn_matmul_create`, `tile` (B's native tile is reported, and read, as another size than
//! RK3588's table: a library whose layout kiln does not know).
//!
//! Like the real library, A and B are taken in at `rknn_matmul_set_io_mem` time (the real one
//! re-lays them out there), so a caller that writes A without calling it again computes on old A.
//!
//! Strict where the hardware is unforgiving:
//! - The cache is not coherent. Every `rknn_tensor_mem` has a host side (`virt_addr`) and a
//!   device side; `rknn_mem_sync` TO_DEVICE copies host → device, FROM_DEVICE device → host.
//!   `set_io_mem` reads A and B from the device side, `run` writes C to the device side. A caller
//!   that forgets a sync computes on stale (at first: zero) operands or reads a stale C.
//! - B's tile (`io_attr.B.dims[2..4]`) comes from this library's own table (see [`tile`]).
//! - `KILN_RKNN_STANDIN_MEM_MIB` caps the bytes of all live buffers: `rknn_create_mem` past it
//!   returns NULL, as the real one does when the NPU's memory is spent.
//! - fp16 is IEEE binary16 as the NPU takes it: a value the caller converted beyond ±65504 is
//!   inf, and propagates to C (inf, or NaN where it meets a zero).
//! - `kiln_standin_b_buffers`, `kiln_standin_mem_bytes` and `kiln_standin_contexts` let a test
//!   count what is live (not part of librknnrt's API).

#![allow(clippy::missing_safety_doc)]

use half::f16;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};
use std::sync::{Mutex, MutexGuard};

/// The embedded identity, found by scanning the file as `strings | grep version` would.
#[cfg(not(feature = "abi1"))]
#[no_mangle]
#[used]
pub static KILN_STANDIN_VERSION: [u8; 51] =
    *b"librknnrt version: 2.3.2 (kiln-standin SIMULATOR)\0\0";
#[cfg(feature = "abi1")]
#[no_mangle]
#[used]
pub static KILN_STANDIN_VERSION: [u8; 51] =
    *b"librknnrt version: 1.6.0 (kiln-standin SIMULATOR)\0\0";

pub const RKNN_SUCC: c_int = 0;
pub const RKNN_ERR_FAIL: c_int = -1;
pub const RKNN_ERR_PARAM_INVALID: c_int = -5;
pub const RKNN_ERR_CTX_INVALID: c_int = -7;
pub const RKNN_ERR_INPUT_INVALID: c_int = -8;
pub const RKNN_ERR_OUTPUT_INVALID: c_int = -9;

pub const FLOAT16_MM_FLOAT16_TO_FLOAT32: i32 = 1;
pub const INT8_MM_INT8_TO_INT32: i32 = 2;
const TENSOR_FLOAT32: i32 = 0;
const TENSOR_FLOAT16: i32 = 1;
const TENSOR_INT8: i32 = 2;
const TENSOR_INT32: i32 = 6;
const LAYOUT_NORM: i32 = 0;
const LAYOUT_NATIVE: i32 = 1;

/// RK3588: B in native layout is cut into segments of at most this many K (MM.h).
pub const K_SEGMENT: usize = 8192;
/// MM.h: "K max: k <= 10240".
pub const K_MAX: usize = 10240;
/// The N cap RK3588 is known to accept (UG table 3-14); beyond it callers split N.
pub const N_MAX: usize = 4096;

/// `rknn_matmul_info`, 2.1+ layout (64 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MatmulInfo {
    pub m: i32,
    pub k: i32,
    pub n: i32,
    pub ty: i32,
    pub b_layout: i16,
    pub b_quant_type: i16,
    pub ac_layout: i16,
    pub ac_quant_type: i16,
    pub iommu_domain_id: i32,
    pub group_size: i16,
    pub reserved: [i8; 34],
}

/// `rknn_matmul_info` of the 1.6 runtime (24 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MatmulInfoV1 {
    pub m: i32,
    pub k: i32,
    pub n: i32,
    pub ty: i32,
    pub b_layout: i32,
    pub ac_layout: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct TensorAttr {
    pub name: [u8; 256],
    pub n_dims: u32,
    pub dims: [u32; 16],
    pub size: u32,
    pub ty: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IoAttr {
    pub a: TensorAttr,
    pub b: TensorAttr,
    pub c: TensorAttr,
}

#[repr(C)]
pub struct TensorMem {
    pub virt_addr: *mut c_void,
    pub phys_addr: u64,
    pub fd: i32,
    pub offset: i32,
    pub size: u32,
    pub flags: u32,
    pub priv_data: *mut c_void,
}

#[repr(C)]
pub struct QuantParams {
    pub name: [u8; 256],
    pub scale: *mut f32,
    pub scale_len: i32,
    pub zp: *mut i32,
    pub zp_len: i32,
}

// The sizes the 2.3.2 headers give on LP64 (checked with gcc there).
const _: () = assert!(size_of::<MatmulInfo>() == 64);
const _: () = assert!(offset_of!(MatmulInfo, b_layout) == 16);
const _: () = assert!(offset_of!(MatmulInfo, iommu_domain_id) == 24);
const _: () = assert!(offset_of!(MatmulInfo, group_size) == 28);
const _: () = assert!(size_of::<MatmulInfoV1>() == 24);
const _: () = assert!(size_of::<TensorAttr>() == 332);
const _: () = assert!(offset_of!(TensorAttr, size) == 324);
const _: () = assert!(size_of::<IoAttr>() == 996);
const _: () = assert!(size_of::<TensorMem>() == 40);
const _: () = assert!(offset_of!(TensorMem, size) == 24);
const _: () = assert!(size_of::<QuantParams>() == 288);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    int8: bool,
    b_native: bool,
}

impl Shape {
    fn in_bytes(&self) -> usize {
        if self.int8 {
            1
        } else {
            2
        }
    }
    /// (subN, subK) of the native B layout this library uses.
    fn sub(&self) -> (usize, usize) {
        tile(self.int8)
    }
}

/// This library's native B tile (subN, subK): RK3588's table (MM.h: fp16 (N/16, K/32, 16, 32),
/// int8 (N/32, K/32, 32, 32)), or under the `tile` fault a K tile of 16: the same sizes, another
/// permutation, which only a caller that reads `B.dims` can notice.
pub fn tile(int8: bool) -> (usize, usize) {
    let sub_k = if fault() == "tile" { 16 } else { 32 };
    (if int8 { 32 } else { 16 }, sub_k)
}

fn fault() -> String {
    std::env::var("KILN_RKNN_STANDIN_FAULT").unwrap_or_default()
}

/// `KILN_RKNN_STANDIN_MEM_MIB`, in bytes; no limit when unset or unparsable.
fn mem_limit() -> Option<usize> {
    std::env::var("KILN_RKNN_STANDIN_MEM_MIB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map(|mib| mib << 20)
}

/// The operands as the NPU sees them after `set_io_mem` re-laid them out.
enum Operand {
    F16(Vec<f32>),
    I8(Vec<i8>),
}

struct Ctx {
    shape: Shape,
    /// A as (M, K).
    a: Option<Operand>,
    /// B as (N, K), whatever layout it came in.
    b: Option<Operand>,
    /// The `rknn_tensor_mem` bound to C.
    c: Option<usize>,
    last_output: Option<Vec<u8>>,
}

/// One `rknn_create_mem` buffer: the host side the caller sees, the device side the NPU sees.
struct Mem {
    ctx: u64,
    host: Vec<u8>,
    dev: Vec<u8>,
    /// Bound as some context's B at least once.
    is_b: bool,
}

struct State {
    next_ctx: u64,
    ctxs: BTreeMap<u64, Ctx>,
    /// Memory handed out by `rknn_create_mem`, by `rknn_tensor_mem` address.
    mems: BTreeMap<usize, Mem>,
}

static STATE: Mutex<State> = Mutex::new(State {
    next_ctx: 1,
    ctxs: BTreeMap::new(),
    mems: BTreeMap::new(),
});

fn state() -> MutexGuard<'static, State> {
    // A panic while holding the lock cannot leave half-written state that matters here.
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn validate(s: &Shape, ty: i32, ac_layout: i32) -> Result<(), c_int> {
    let n_align = if s.int8 { 32 } else { 16 };
    let ok_type = ty == FLOAT16_MM_FLOAT16_TO_FLOAT32 || ty == INT8_MM_INT8_TO_INT32;
    if !ok_type
        || s.m == 0
        || s.k == 0
        || s.n == 0
        || s.k % 32 != 0
        || s.n % n_align != 0
        || s.k > K_MAX
        || s.n > N_MAX
        // The stand-in models A and C in the normal layout only.
        || ac_layout != LAYOUT_NORM
    {
        return Err(RKNN_ERR_PARAM_INVALID);
    }
    Ok(())
}

fn attr(name: &str, dims: &[usize], size: usize, ty: i32) -> TensorAttr {
    let mut a = TensorAttr {
        name: [0; 256],
        n_dims: dims.len() as u32,
        dims: [0; 16],
        size: size as u32,
        ty,
    };
    a.name[..name.len()].copy_from_slice(name.as_bytes());
    for (d, v) in a.dims.iter_mut().zip(dims) {
        *d = *v as u32;
    }
    a
}

fn io_attrs(s: &Shape) -> IoAttr {
    let es = s.in_bytes();
    let in_ty = if s.int8 { TENSOR_INT8 } else { TENSOR_FLOAT16 };
    let out_ty = if s.int8 { TENSOR_INT32 } else { TENSOR_FLOAT32 };
    let (sub_n, sub_k) = s.sub();
    let b = if s.b_native {
        attr(
            "B",
            &[s.n / sub_n, s.k.min(K_SEGMENT) / sub_k, sub_n, sub_k],
            s.k * s.n * es,
            in_ty,
        )
    } else {
        attr("B", &[s.k, s.n], s.k * s.n * es, in_ty)
    };
    IoAttr {
        a: attr("A", &[s.m, s.k], s.m * s.k * es, in_ty),
        b,
        c: attr("C", &[s.m, s.n], s.m * s.n * 4, out_ty),
    }
}

fn create(s: Shape, ty: i32, ac_layout: i32, ctx: *mut u64, io: *mut IoAttr) -> c_int {
    if ctx.is_null() || io.is_null() {
        return RKNN_ERR_PARAM_INVALID;
    }
    if let Err(e) = validate(&s, ty, ac_layout) {
        return e;
    }
    let mut st = state();
    let id = st.next_ctx;
    st.next_ctx += 1;
    st.ctxs.insert(
        id,
        Ctx {
            shape: s,
            a: None,
            b: None,
            c: None,
            last_output: None,
        },
    );
    unsafe {
        *ctx = id;
        *io = io_attrs(&s);
    }
    RKNN_SUCC
}

#[cfg(not(feature = "abi1"))]
#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_create(
    ctx: *mut u64,
    info: *mut MatmulInfo,
    io: *mut IoAttr,
) -> c_int {
    let Some(i) = info.as_ref() else {
        return RKNN_ERR_PARAM_INVALID;
    };
    if i.m < 0 || i.k < 0 || i.n < 0 || !(0..=1).contains(&i.b_layout) {
        return RKNN_ERR_PARAM_INVALID;
    }
    let s = Shape {
        m: i.m as usize,
        k: i.k as usize,
        n: i.n as usize,
        int8: i.ty == INT8_MM_INT8_TO_INT32,
        b_native: i.b_layout as i32 == LAYOUT_NATIVE,
    };
    create(s, i.ty, i.ac_layout as i32, ctx, io)
}

#[cfg(feature = "abi1")]
#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_create(
    ctx: *mut u64,
    info: *mut MatmulInfoV1,
    io: *mut IoAttr,
) -> c_int {
    let Some(i) = info.as_ref() else {
        return RKNN_ERR_PARAM_INVALID;
    };
    if i.m < 0 || i.k < 0 || i.n < 0 || !(0..=1).contains(&i.b_layout) {
        return RKNN_ERR_PARAM_INVALID;
    }
    let s = Shape {
        m: i.m as usize,
        k: i.k as usize,
        n: i.n as usize,
        int8: i.ty == INT8_MM_INT8_TO_INT32,
        b_native: i.b_layout == LAYOUT_NATIVE,
    };
    create(s, i.ty, i.ac_layout, ctx, io)
}

/// Dynamic shapes are not modelled; kiln creates one static context per M instead.
#[cfg(not(feature = "abi1"))]
#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_create_dynamic_shape(
    _ctx: *mut u64,
    _info: *mut MatmulInfo,
    _shape_num: c_int,
    _shapes: *mut c_void,
    _io: *mut IoAttr,
) -> c_int {
    RKNN_ERR_FAIL
}

#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_destroy(ctx: u64) -> c_int {
    let mut st = state();
    if st.ctxs.remove(&ctx).is_none() {
        return RKNN_ERR_CTX_INVALID;
    }
    RKNN_SUCC
}

#[no_mangle]
pub unsafe extern "C" fn rknn_create_mem(ctx: u64, size: u32) -> *mut TensorMem {
    let mut st = state();
    if !st.ctxs.contains_key(&ctx) || size == 0 {
        return std::ptr::null_mut();
    }
    let live: usize = st.mems.values().map(|m| m.host.len()).sum();
    if mem_limit().is_some_and(|cap| live + size as usize > cap) {
        return std::ptr::null_mut();
    }
    let mut host = vec![0u8; size as usize];
    let mem = Box::into_raw(Box::new(TensorMem {
        virt_addr: host.as_mut_ptr().cast(),
        phys_addr: 0,
        fd: -1,
        offset: 0,
        size,
        flags: 0,
        priv_data: std::ptr::null_mut(),
    }));
    st.mems.insert(
        mem as usize,
        Mem {
            ctx,
            host,
            dev: vec![0u8; size as usize],
            is_b: false,
        },
    );
    mem
}

#[no_mangle]
pub unsafe extern "C" fn rknn_destroy_mem(ctx: u64, mem: *mut TensorMem) -> c_int {
    let mut st = state();
    match st.mems.get(&(mem as usize)) {
        Some(m) if m.ctx == ctx => {}
        _ => return RKNN_ERR_PARAM_INVALID,
    }
    st.mems.remove(&(mem as usize));
    for c in st.ctxs.values_mut() {
        if c.c == Some(mem as usize) {
            c.c = None;
        }
    }
    drop(Box::from_raw(mem));
    RKNN_SUCC
}

pub const RKNN_MEMORY_SYNC_TO_DEVICE: c_int = 1;
pub const RKNN_MEMORY_SYNC_FROM_DEVICE: c_int = 2;
pub const RKNN_MEMORY_SYNC_BIDIRECTIONAL: c_int = 3;

/// Cache maintenance, modelled: TO_DEVICE makes the device side what the host wrote,
/// FROM_DEVICE makes the host side what the device wrote (BIDIRECTIONAL: both, in that order).
#[no_mangle]
pub unsafe extern "C" fn rknn_mem_sync(ctx: u64, mem: *mut TensorMem, mode: c_int) -> c_int {
    let mut st = state();
    if !st.ctxs.contains_key(&ctx) {
        return RKNN_ERR_CTX_INVALID;
    }
    let Some(m) = st.mems.get_mut(&(mem as usize)) else {
        return RKNN_ERR_PARAM_INVALID;
    };
    match mode {
        RKNN_MEMORY_SYNC_TO_DEVICE => m.dev.copy_from_slice(&m.host),
        RKNN_MEMORY_SYNC_FROM_DEVICE => m.host.copy_from_slice(&m.dev),
        RKNN_MEMORY_SYNC_BIDIRECTIONAL => m.dev.copy_from_slice(&m.host),
        _ => return RKNN_ERR_PARAM_INVALID,
    }
    RKNN_SUCC
}

/// Live buffers that have been bound as B (a test asserts one per weight).
#[no_mangle]
pub extern "C" fn kiln_standin_b_buffers() -> u64 {
    state().mems.values().filter(|m| m.is_b).count() as u64
}

/// Bytes of all live `rknn_create_mem` buffers.
#[no_mangle]
pub extern "C" fn kiln_standin_mem_bytes() -> u64 {
    state().mems.values().map(|m| m.host.len() as u64).sum()
}

/// Live matmul contexts.
#[no_mangle]
pub extern "C" fn kiln_standin_contexts() -> u64 {
    state().ctxs.len() as u64
}

#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_set_core_mask(ctx: u64, mask: c_int) -> c_int {
    if !state().ctxs.contains_key(&ctx) {
        return RKNN_ERR_CTX_INVALID;
    }
    match mask {
        0 | 1 | 2 | 4 | 3 | 7 | 0xffff => RKNN_SUCC,
        _ => RKNN_ERR_PARAM_INVALID,
    }
}

#[cfg(not(feature = "abi1"))]
#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_set_quant_params(ctx: u64, params: *mut QuantParams) -> c_int {
    let st = state();
    let Some(c) = st.ctxs.get(&ctx) else {
        return RKNN_ERR_CTX_INVALID;
    };
    let Some(p) = params.as_ref() else {
        return RKNN_ERR_PARAM_INVALID;
    };
    // Per-layer (1) or per-channel (N); with int32 output the scales do not change C.
    let n = c.shape.n as i32;
    if !c.shape.int8 || p.scale.is_null() || !(p.scale_len == 1 || p.scale_len == n) {
        return RKNN_ERR_PARAM_INVALID;
    }
    RKNN_SUCC
}

/// Index of B element (k, n) in RK3588's native layout, K cut in segments of [`K_SEGMENT`].
pub fn native_index(k: usize, n: usize, kk: usize, nn: usize, sub_n: usize, sub_k: usize) -> usize {
    let seg = k / K_SEGMENT;
    let seg_start = seg * K_SEGMENT;
    let seg_k = (kk - seg_start).min(K_SEGMENT);
    let k_in = k - seg_start;
    let base = seg_start * nn;
    base + (((n / sub_n) * (seg_k / sub_k) + k_in / sub_k) * sub_n + n % sub_n) * sub_k
        + k_in % sub_k
}

#[cfg(not(feature = "abi1"))]
#[no_mangle]
pub unsafe extern "C" fn rknn_B_normal_layout_to_native_layout(
    b_in: *mut c_void,
    b_out: *mut c_void,
    k: c_int,
    n: c_int,
    info: *mut MatmulInfo,
) -> c_int {
    let Some(i) = info.as_ref() else {
        return RKNN_ERR_PARAM_INVALID;
    };
    if b_in.is_null() || b_out.is_null() || k <= 0 || n <= 0 {
        return RKNN_ERR_PARAM_INVALID;
    }
    let s = Shape {
        m: 1,
        k: k as usize,
        n: n as usize,
        int8: i.ty == INT8_MM_INT8_TO_INT32,
        b_native: true,
    };
    if let Err(e) = validate(&s, i.ty, LAYOUT_NORM) {
        return e;
    }
    let es = s.in_bytes();
    let (sub_n, sub_k) = s.sub();
    let src = std::slice::from_raw_parts(b_in as *const u8, s.k * s.n * es);
    let dst = std::slice::from_raw_parts_mut(b_out as *mut u8, s.k * s.n * es);
    for kk in 0..s.k {
        for nn in 0..s.n {
            let from = (kk * s.n + nn) * es;
            let to = native_index(kk, nn, s.k, s.n, sub_n, sub_k) * es;
            dst[to..to + es].copy_from_slice(&src[from..from + es]);
        }
    }
    RKNN_SUCC
}

fn name_of(a: &TensorAttr) -> &[u8] {
    let end = a.name.iter().position(|b| *b == 0).unwrap_or(a.name.len());
    &a.name[..end]
}

fn read_operand(bytes: &[u8], int8: bool, index: impl Fn(usize) -> usize, count: usize) -> Operand {
    if int8 {
        Operand::I8((0..count).map(|i| bytes[index(i)] as i8).collect())
    } else {
        Operand::F16(
            (0..count)
                .map(|i| {
                    let o = index(i) * 2;
                    f16::from_le_bytes([bytes[o], bytes[o + 1]]).to_f32()
                })
                .collect(),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_set_io_mem(
    ctx: u64,
    mem: *mut TensorMem,
    attr: *mut TensorAttr,
) -> c_int {
    let mut guard = state();
    let st = &mut *guard;
    let Some(c) = st.ctxs.get_mut(&ctx) else {
        return RKNN_ERR_CTX_INVALID;
    };
    let (Some(m), Some(a)) = (mem.as_ref(), attr.as_ref()) else {
        return RKNN_ERR_PARAM_INVALID;
    };
    // A buffer from another context may be bound (one B shared by the contexts of every M).
    let Some(mm) = st.mems.get_mut(&(mem as usize)) else {
        return RKNN_ERR_PARAM_INVALID;
    };
    let expect = io_attrs(&c.shape);
    let want = match name_of(a) {
        b"A" => &expect.a,
        b"B" => &expect.b,
        b"C" => &expect.c,
        _ => return RKNN_ERR_PARAM_INVALID,
    };
    let off = m.offset.max(0) as usize;
    if a.size != want.size
        || a.ty != want.ty
        || (m.size as usize) < want.size as usize
        || off + want.size as usize > mm.dev.len()
    {
        return RKNN_ERR_PARAM_INVALID;
    }
    if name_of(a) == b"B" {
        mm.is_b = true;
    }
    // The NPU reads what reached the device, not what sits in the CPU's cache.
    let bytes = &mm.dev[off..off + want.size as usize];
    let s = c.shape;
    match name_of(a) {
        b"A" => c.a = Some(read_operand(bytes, s.int8, |i| i, s.m * s.k)),
        b"B" => {
            let (sub_n, sub_k) = s.sub();
            // Store B as (N, K): element i = n * K + k.
            let idx = |i: usize| {
                let (n, k) = (i / s.k, i % s.k);
                if s.b_native {
                    native_index(k, n, s.k, s.n, sub_n, sub_k)
                } else {
                    k * s.n + n
                }
            };
            c.b = Some(read_operand(bytes, s.int8, idx, s.n * s.k));
        }
        _ => c.c = Some(mem as usize),
    }
    RKNN_SUCC
}

fn compute(s: &Shape, a: &Operand, b: &Operand) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.m * s.n * 4);
    match (a, b) {
        (Operand::F16(a), Operand::F16(b)) => {
            for i in 0..s.m {
                for j in 0..s.n {
                    let (ar, br) = (&a[i * s.k..][..s.k], &b[j * s.k..][..s.k]);
                    let acc: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
                    out.extend_from_slice(&acc.to_le_bytes());
                }
            }
        }
        (Operand::I8(a), Operand::I8(b)) => {
            for i in 0..s.m {
                for j in 0..s.n {
                    let (ar, br) = (&a[i * s.k..][..s.k], &b[j * s.k..][..s.k]);
                    let acc: i32 = ar.iter().zip(br).map(|(x, y)| *x as i32 * *y as i32).sum();
                    out.extend_from_slice(&acc.to_le_bytes());
                }
            }
        }
        _ => unreachable!("A and B of one context share the input type"),
    }
    out
}

#[no_mangle]
pub unsafe extern "C" fn rknn_matmul_run(ctx: u64) -> c_int {
    let fault = fault();
    let mut guard = state();
    let st = &mut *guard;
    let Some(c) = st.ctxs.get_mut(&ctx) else {
        return RKNN_ERR_CTX_INVALID;
    };
    let (Some(a), Some(b)) = (&c.a, &c.b) else {
        return RKNN_ERR_INPUT_INVALID;
    };
    let Some(cmem) = c.c else {
        return RKNN_ERR_OUTPUT_INVALID;
    };
    let Some(cbuf) = st.mems.get_mut(&cmem).map(|m| &mut m.dev) else {
        return RKNN_ERR_OUTPUT_INVALID;
    };
    let off = (*(cmem as *const TensorMem)).offset.max(0) as usize;
    let mut out = compute(&c.shape, a, b);
    match fault.as_str() {
        "error" => return RKNN_ERR_FAIL,
        "untouched" => return RKNN_SUCC,
        "wrong" => {
            let v = [out[0], out[1], out[2], out[3]];
            let w = if c.shape.int8 {
                i32::from_le_bytes(v).wrapping_add(1 << 20).to_le_bytes()
            } else {
                (f32::from_le_bytes(v) + 1000.0).to_le_bytes()
            };
            out[..4].copy_from_slice(&w);
        }
        "stale" => {
            if let Some(prev) = &c.last_output {
                out.clone_from(prev);
            }
        }
        _ => {}
    }
    cbuf[off..off + out.len()].copy_from_slice(&out);
    c.last_output = Some(out);
    RKNN_SUCC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_layout_is_a_permutation_with_segments() {
        for (k, n, sub_n) in [(64, 32, 16), (96, 64, 32), (8192 + 64, 16, 16)] {
            let mut seen = vec![false; k * n];
            for kk in 0..k {
                for nn in 0..n {
                    let i = native_index(kk, nn, k, n, sub_n, 32);
                    assert!(!seen[i], "index {i} twice for k={kk} n={nn}");
                    seen[i] = true;
                }
            }
        }
        // MM.h's fp16 example: the first 32 values are K1..K32 of N1, then K1..K32 of N2.
        assert_eq!(native_index(31, 0, 64, 32, 16, 32), 31);
        assert_eq!(native_index(0, 1, 64, 32, 16, 32), 32);
        assert_eq!(native_index(32, 0, 64, 32, 16, 32), 16 * 32);
        assert_eq!(native_index(0, 16, 64, 32, 16, 32), 2 * 16 * 32);
    }

    #[cfg(not(feature = "abi1"))]
    #[test]
    fn shape_rules_are_enforced() {
        let mut info = MatmulInfo {
            m: 4,
            k: 48,
            n: 32,
            ty: FLOAT16_MM_FLOAT16_TO_FLOAT32,
            b_layout: 1,
            b_quant_type: 0,
            ac_layout: 0,
            ac_quant_type: 0,
            iommu_domain_id: 0,
            group_size: 0,
            reserved: [0; 34],
        };
        let mut ctx = 0u64;
        let mut io = io_attrs(&Shape {
            m: 1,
            k: 32,
            n: 16,
            int8: false,
            b_native: true,
        });
        let r = unsafe { rknn_matmul_create(&mut ctx, &mut info, &mut io) };
        assert_eq!(r, RKNN_ERR_PARAM_INVALID, "K=48 is not a multiple of 32");
        info.k = 64;
        info.n = 16;
        info.ty = INT8_MM_INT8_TO_INT32;
        let r = unsafe { rknn_matmul_create(&mut ctx, &mut info, &mut io) };
        assert_eq!(r, RKNN_ERR_PARAM_INVALID, "int8 needs N % 32");
        info.ty = FLOAT16_MM_FLOAT16_TO_FLOAT32;
        let r = unsafe { rknn_matmul_create(&mut ctx, &mut info, &mut io) };
        assert_eq!(r, RKNN_SUCC);
        assert_eq!(io.b.size, 64 * 16 * 2);
        assert_eq!(&io.b.dims[..4], &[1, 2, 16, 32]);
        assert_eq!(unsafe { rknn_matmul_run(ctx) }, RKNN_ERR_INPUT_INVALID);
        assert_eq!(unsafe { rknn_matmul_destroy(ctx) }, RKNN_SUCC);
        assert_eq!(unsafe { rknn_matmul_destroy(ctx) }, RKNN_ERR_CTX_INVALID);
    }
}
