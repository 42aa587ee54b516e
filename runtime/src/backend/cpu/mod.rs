//! The CPU backends: `cpu-ref`, the scalar reference (dequantise each weight row, dot in f64:
//! obviously right, slow), and `cpu`, the fast path (ggml-style quantised activations, integer
//! dots, NEON/`sdot` on aarch64 chosen at run time, threads over N). Both borrow the weight from
//! the mapping: nothing is copied at prepare time.

mod fast;
mod fused;
mod gemm;
mod kernels;
mod kquant;
#[cfg(test)]
mod tests;

pub(crate) use fast::f16_bits_to_f32;
pub use kernels::Kernel;

use super::{Backend, Capabilities, Decline, MatmulOp, PreparedWeight, Weight};
use crate::ledger::Arrival;
use crate::quant::{dequantize_row, is_dequantizable, GgmlType, DEQUANTIZABLE};
use anyhow::{bail, Context, Result};
use fast::{act_format, Activations, RowScratch};

/// Weight types both CPU backends run (the types the loader dequantises).
pub const CPU_TYPES: [GgmlType; 11] = DEQUANTIZABLE;

/// What `prepare` hands back: the CPU reads the weight where it lies, so this only records the
/// shape it was prepared for and the address range of the bytes (both checked again at run
/// time, so the range the ledger checked against the mapping is the one that is read).
#[derive(Debug)]
pub struct CpuPrepared {
    pub ty: GgmlType,
    pub k: usize,
    pub n: usize,
    pub data: std::ops::Range<usize>,
}

impl PreparedWeight for CpuPrepared {
    fn arrival(&self) -> Arrival {
        Arrival::Borrowed
    }
    fn reads_from(&self) -> Option<std::ops::Range<usize>> {
        Some(self.data.clone())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn cpu_supports(op: &MatmulOp) -> Result<(), Decline> {
    if !is_dequantizable(op.ty) {
        return Err(Decline::WeightType {
            ty: op.ty.name().to_string(),
        });
    }
    let need = op.ty.block_elems();
    if op.k % need != 0 {
        return Err(Decline::KNotAligned { k: op.k, need });
    }
    Ok(())
}

fn cpu_prepare<'w>(backend: &str, w: &Weight<'w>) -> Result<Box<dyn PreparedWeight + 'w>> {
    check_weight(backend, w)?;
    Ok(Box::new(CpuPrepared {
        ty: w.ty,
        k: w.k,
        n: w.n,
        data: crate::ledger::address_range(w.data),
    }))
}

/// Everything `run` relies on, checked with errors that name the weight: the type and K are
/// supported, the bytes are exactly N rows, `prepared` is ours and for this weight, and A and C
/// have M×K and M×N values.
fn check_run(
    backend: &str,
    w: &Weight<'_>,
    prepared: &dyn PreparedWeight,
    a: &[f32],
    m: usize,
    c: &[f32],
) -> Result<usize> {
    let row = check_weight(backend, w)?;
    match prepared.as_any().downcast_ref::<CpuPrepared>() {
        Some(p) if (p.ty, p.k, p.n) == (w.ty, w.k, w.n) => {
            if p.data != crate::ledger::address_range(w.data) {
                bail!(
                    "{backend}: {} was prepared over bytes at {:#x}..{:#x}, run over {:#x}..{:#x}",
                    w.name,
                    p.data.start,
                    p.data.end,
                    w.data.as_ptr() as usize,
                    w.data.as_ptr() as usize + w.data.len()
                );
            }
        }
        Some(p) => bail!(
            "{backend}: {} was prepared as {} {}×{}, run as {} {}×{}",
            w.name,
            p.ty,
            p.k,
            p.n,
            w.ty,
            w.k,
            w.n
        ),
        None => bail!("{backend}: {} was prepared by another backend", w.name),
    }
    if m.checked_mul(w.k) != Some(a.len()) || m.checked_mul(w.n) != Some(c.len()) {
        bail!(
            "{backend}: {} with M={m}: A has {} values (want M×K, K={}), C has {} (want M×N, N={})",
            w.name,
            a.len(),
            w.k,
            c.len(),
            w.n
        );
    }
    Ok(row)
}

/// Bytes per weight row, after checking the weight is something the CPU runs.
fn check_weight(backend: &str, w: &Weight<'_>) -> Result<usize> {
    cpu_supports(&MatmulOp::for_weight(w, 1))
        .map_err(|d| anyhow::anyhow!("{backend}: {} ({} {}×{}): {d}", w.name, w.ty, w.k, w.n))?;
    let row =
        w.ty.row_bytes(w.k as u64)
            .and_then(|r| usize::try_from(r).ok());
    let total = row.and_then(|r| r.checked_mul(w.n));
    match (row, total) {
        (Some(row), Some(total)) if total == w.data.len() => Ok(row),
        _ => bail!(
            "{backend}: {} ({} {}×{}) has {} bytes, expected {:?}",
            w.name,
            w.ty,
            w.k,
            w.n,
            w.data.len(),
            total
        ),
    }
}

/// `cpu-ref`: the oracle. One thread, dequantise a row, f64 dot.
#[derive(Debug, Default)]
pub struct CpuRefBackend;

impl Backend for CpuRefBackend {
    fn name(&self) -> &'static str {
        "cpu-ref"
    }

    fn probe(&self) -> Result<Capabilities, Decline> {
        Ok(Capabilities {
            facts: vec![
                (
                    "kernel".into(),
                    "scalar reference (dequantise, f64 dot)".into(),
                ),
                ("arch".into(), std::env::consts::ARCH.into()),
            ],
            simulated: false,
        })
    }

    fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
        cpu_supports(op)
    }

    fn prepare<'w>(&self, w: &Weight<'w>) -> Result<Box<dyn PreparedWeight + 'w>> {
        cpu_prepare(self.name(), w)
    }

    fn run(
        &self,
        w: &Weight<'_>,
        prepared: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> Result<()> {
        let row_bytes = check_run(self.name(), w, prepared, a, m, c)?;
        let mut row = vec![0.0f32; w.k];
        for n in 0..w.n {
            let src = &w.data[n * row_bytes..(n + 1) * row_bytes];
            dequantize_row(w.ty, src, &mut row)
                .with_context(|| format!("cpu-ref: dequantising row {n} of {}", w.name))?;
            for i in 0..m {
                let x = &a[i * w.k..(i + 1) * w.k];
                let dot: f64 = row.iter().zip(x).map(|(&p, &q)| p as f64 * q as f64).sum();
                c[i * w.n + n] = dot as f32;
            }
        }
        Ok(())
    }
}

/// `cpu`: the fast path.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    kernel: Kernel,
    threads: usize,
    /// Fault injection for tests: this output column is never written, as a kernel with a
    /// skipped-row bug would leave it.
    #[cfg(test)]
    skip_column: Option<usize>,
    /// Fault injection for tests: M > 1 goes through the tile path (not `fused::takes_m`'s),
    /// which sums its blocks in one running sum, not in the canonical order, as a kernel that
    /// kept the old order would.
    #[cfg(test)]
    serial_order: bool,
    /// Tests: which register-tile tier M > 1 uses (`Some(None)`: none, the unpacked path),
    /// instead of the best one this CPU has, so every tier is held to the same bits.
    #[cfg(test)]
    tier: Option<Option<gemm::Tier>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The best kernel for this CPU, one thread per available core.
    pub fn new() -> CpuBackend {
        CpuBackend {
            kernel: Kernel::detect(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            #[cfg(test)]
            skip_column: None,
            #[cfg(test)]
            serial_order: false,
            #[cfg(test)]
            tier: None,
        }
    }

    /// Use `threads` threads (at least one).
    pub fn with_threads(mut self, threads: usize) -> CpuBackend {
        self.threads = threads.max(1);
        self
    }

    /// Force a kernel; an error if this CPU cannot run it.
    pub fn with_kernel(mut self, kernel: Kernel) -> Result<CpuBackend> {
        if !kernel.is_available() {
            bail!(
                "CPU kernel {kernel} is not available here (available: {:?})",
                Kernel::available()
            );
        }
        self.kernel = kernel;
        Ok(self)
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    fn run_parallel(
        &self,
        w: &Weight<'_>,
        row_bytes: usize,
        act: &Activations<'_>,
        m: usize,
        ct: &mut [f32],
    ) {
        let threads = self.threads.min(w.n);
        let per = w.n.div_ceil(threads);
        if threads == 1 {
            self.run_columns(w, row_bytes, act, m, 0, ct);
            return;
        }
        // M = 1: C is one row, so one contiguous chunk of N per thread; the calling thread takes
        // the first, the pool's persistent workers the rest.
        let chunks: Vec<&mut [f32]> = ct.chunks_mut(per * m).collect();
        crate::pool::run_parts(chunks, |t, chunk| {
            self.run_columns(w, row_bytes, act, m, t * per, chunk)
        });
    }

    /// M > 1: each thread's columns of C through a Cᵀ block of its own (see `run`).
    fn run_parallel_t(
        &self,
        w: &Weight<'_>,
        row_bytes: usize,
        act: &Activations<'_>,
        m: usize,
        c: &mut [f32],
    ) {
        let n = w.n;
        let threads = self.threads.min(n);
        let per = n.div_ceil(threads);
        let parts: Vec<(usize, usize)> = (0..n)
            .step_by(per)
            .map(|n0| (n0, per.min(n - n0)))
            .collect();
        let cols = Columns {
            ptr: c.as_mut_ptr(),
            len: c.len(),
            m,
            n,
        };
        crate::pool::run_parts(parts, |_, (n0, len)| {
            CT.with(|buf| {
                let mut buf = buf.borrow_mut();
                buf.resize(len * m, 0.0);
                let ct = &mut buf[..len * m];
                // SAFETY: the parts' column ranges are disjoint (consecutive steps of `per`),
                // so this thread alone reads and writes columns n0..n0+len while the call runs.
                unsafe { cols.gather(n0, len, ct) };
                self.run_columns(w, row_bytes, act, m, n0, ct);
                // SAFETY: as above.
                unsafe { cols.scatter(n0, len, ct) };
                if buf.capacity() > CT_KEEP {
                    *buf = Vec::new();
                }
            })
        });
    }

    /// Columns `n0..n0+len` of Cᵀ into `ct` (len rows of M).
    fn run_columns(
        &self,
        w: &Weight<'_>,
        row_bytes: usize,
        act: &Activations<'_>,
        m: usize,
        n0: usize,
        ct: &mut [f32],
    ) {
        // Prefill on x86: register tiles of weight rows × activation rows (`gemm.rs`).
        if let Some(tiles) = act.tiles.as_ref().filter(|_| m > 1) {
            #[cfg(test)]
            let skip = self.skip_column;
            #[cfg(not(test))]
            let skip = None;
            if gemm::rows(tiles, w.data, w.ty, row_bytes, act, n0, ct, skip) {
                return;
            }
        }
        // Decode (and prefill where `takes_m`): fused dots straight off the packed bytes, one
        // pass over each weight row.
        #[cfg(test)]
        let takes_m = fused::takes_m(self.kernel, w.ty) && !self.serial_order;
        #[cfg(not(test))]
        let takes_m = fused::takes_m(self.kernel, w.ty);
        if (m == 1 && fused::supports(self.kernel, w.ty)) || (m > 1 && takes_m) {
            #[cfg(test)]
            let skip = self.skip_column;
            #[cfg(not(test))]
            let skip = None;
            fused::rows(self.kernel, w, row_bytes, act, n0, ct, skip);
            return;
        }
        // A tile of weight rows is unpacked together and each activation row is dotted with all
        // of them while it sits in L1, so M > 1 reads the activations once per tile, not per row.
        const TILE: usize = 4;
        let mut scratch: [RowScratch; TILE] = Default::default();
        for (t, outs) in ct.chunks_mut(TILE * m).enumerate() {
            let rows = outs.len() / m;
            #[allow(unused_mut)]
            let mut live = [true; TILE];
            for (r, sc) in scratch.iter_mut().enumerate().take(rows) {
                let n = n0 + t * TILE + r;
                #[cfg(test)]
                if self.skip_column == Some(n) {
                    live[r] = false;
                    continue;
                }
                sc.unpack(w.ty, &w.data[n * row_bytes..(n + 1) * row_bytes]);
            }
            #[cfg(test)]
            let serial = self.serial_order;
            #[cfg(not(test))]
            let serial = false;
            for i in 0..m {
                for (r, sc) in scratch.iter_mut().enumerate().take(rows) {
                    if live[r] {
                        outs[r * m + i] = if serial {
                            sc.dot_in::<true>(self.kernel, w.ty, act, i)
                        } else {
                            sc.dot(self.kernel, w.ty, act, i)
                        };
                    }
                }
            }
        }
    }
}

thread_local! {
    /// Each thread's Cᵀ block for M > 1, kept between matmuls (a fresh one per call was a
    /// page-faulting mmap at prefill sizes) unless it grew past [`CT_KEEP`] floats.
    static CT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
const CT_KEEP: usize = 1 << 20;

/// C (M×N, row-major) shared by the threads of one matmul, each of which touches only its own
/// columns; a raw pointer because those columns interleave in memory and no slice split can
/// hand them out.
struct Columns {
    ptr: *mut f32,
    len: usize,
    m: usize,
    n: usize,
}

// SAFETY: the threads reach C only through `gather`/`scatter`, over disjoint column ranges.
unsafe impl Sync for Columns {}

/// Square tiles, so both sides of a transpose stay in cache (a plain double loop strides a whole
/// row of N floats per write: 6 % of prefill's matmul time).
const TILE_T: usize = 16;

impl Columns {
    /// `ct` (len×M) = columns n0..n0+len of C, transposed.
    ///
    /// # Safety
    /// No other thread may write those columns while this runs.
    unsafe fn gather(&self, n0: usize, len: usize, ct: &mut [f32]) {
        let (m, n) = (self.m, self.n);
        assert!(n0 + len <= n && m * n <= self.len && ct.len() == len * m);
        for i0 in (0..m).step_by(TILE_T) {
            for r0 in (0..len).step_by(TILE_T) {
                for i in i0..(i0 + TILE_T).min(m) {
                    for r in r0..(r0 + TILE_T).min(len) {
                        // SAFETY: in bounds by the assert; the column is this thread's.
                        ct[r * m + i] = unsafe { *self.ptr.add(i * n + n0 + r) };
                    }
                }
            }
        }
    }

    /// Columns n0..n0+len of C = `ct` (len×M), transposed.
    ///
    /// # Safety
    /// No other thread may read or write those columns while this runs.
    unsafe fn scatter(&self, n0: usize, len: usize, ct: &[f32]) {
        let (m, n) = (self.m, self.n);
        assert!(n0 + len <= n && m * n <= self.len && ct.len() == len * m);
        for i0 in (0..m).step_by(TILE_T) {
            for r0 in (0..len).step_by(TILE_T) {
                for i in i0..(i0 + TILE_T).min(m) {
                    for r in r0..(r0 + TILE_T).min(len) {
                        // SAFETY: in bounds by the assert; the column is this thread's.
                        unsafe { *self.ptr.add(i * n + n0 + r) = ct[r * m + i] };
                    }
                }
            }
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn probe(&self) -> Result<Capabilities, Decline> {
        #[allow(unused_mut)]
        let mut features: Vec<&str> = Vec::new();
        #[cfg(target_arch = "aarch64")]
        for (name, on) in [
            ("neon", std::arch::is_aarch64_feature_detected!("neon")),
            (
                "dotprod",
                std::arch::is_aarch64_feature_detected!("dotprod"),
            ),
            ("fp16", std::arch::is_aarch64_feature_detected!("fp16")),
            ("i8mm", std::arch::is_aarch64_feature_detected!("i8mm")),
        ] {
            if on {
                features.push(name);
            }
        }
        Ok(Capabilities {
            facts: vec![
                ("kernel".into(), self.kernel.name().into()),
                ("threads".into(), self.threads.to_string()),
                ("arch".into(), std::env::consts::ARCH.into()),
                ("cpu features".into(), features.join(" ")),
                (
                    "activations".into(),
                    "Q8_0 (Q4_0/Q5_0/Q8_0), Q8_1 (Q4_1/Q5_1), Q8_K (K-quants), f32 (F32/F16/BF16)"
                        .into(),
                ),
            ],
            simulated: false,
        })
    }

    fn supports(&self, op: &MatmulOp) -> Result<(), Decline> {
        cpu_supports(op)
    }

    fn prepare<'w>(&self, w: &Weight<'w>) -> Result<Box<dyn PreparedWeight + 'w>> {
        cpu_prepare(self.name(), w)
    }

    fn run(
        &self,
        w: &Weight<'_>,
        prepared: &dyn PreparedWeight,
        a: &[f32],
        m: usize,
        c: &mut [f32],
    ) -> Result<()> {
        let row_bytes = check_run(self.name(), w, prepared, a, m, c)?;
        if m == 0 || w.n == 0 {
            return Ok(());
        }
        let fmt = act_format(w.ty).with_context(|| format!("cpu: no fast path for {}", w.ty))?;
        #[allow(unused_mut)]
        let mut act = Activations::quantize_on(fmt, a, w.k, self.threads);
        if m > 1 {
            #[cfg(test)]
            let tier = self.tier.unwrap_or_else(gemm::Tier::detect);
            #[cfg(not(test))]
            let tier = gemm::Tier::detect();
            // The kernels a test forces by hand keep their own paths (`serial_order` is the tile
            // path's fault; a kernel other than x86's one has no register tiles).
            #[cfg(test)]
            let tier = tier.filter(|_| !self.serial_order);
            act.tiles = tier
                .filter(|_| self.kernel == Kernel::Portable)
                .and_then(|t| gemm::ActTiles::new(t, w.ty, &act));
        }
        // Threads own contiguous ranges of N. C is row-major M×N, so for M > 1 each thread works
        // on a block of Cᵀ (its columns, len×M) in a buffer of its own, copied from C first, so a
        // column the kernel does not write keeps C's poison and `run_checked` sees it; then
        // copied back. Each thread transposes only its own columns: done once for all threads
        // on the calling thread, the two transposes were a twentieth of a two-thread prefill
        // with the other thread waiting (docs/speed.md).
        if m == 1 {
            self.run_parallel(w, row_bytes, &act, 1, c);
        } else {
            self.run_parallel_t(w, row_bytes, &act, m, c);
        }
        Ok(())
    }
}
