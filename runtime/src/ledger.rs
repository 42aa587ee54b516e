//! The ownership ledger: for each backend, which weights it owns and how their bytes arrived —
//! measured, not declared.
//!
//! Field lesson (`context/experiment-2026-10-11.txt`): ownership must be a positive line that
//! names the mechanism, because "owned via a multi-GiB memcpy" and "owned via an mmap window"
//! otherwise print the same word, and "copied 0" must be a measurement rather than an argument.
//! So every backend gets one line, always, and what it says rests on two measurements taken
//! around each `prepare`:
//!
//! - **where the bytes are**: the address range the prepared weight will read at run time
//!   ([`crate::backend::PreparedWeight::reads_from`]) must lie inside a live model mapping (every
//!   [`crate::gguf::GgufFile`] registers its `Mmap` here);
//! - **what was allocated**: the heap bytes still live after `prepare`, counted by this crate's
//!   global allocator on the preparing thread ([`CountingAlloc`]). This is the verdict because it
//!   is exact and per thread: a 1 KiB copy shows as 1 KiB, and other threads (tests run in
//!   parallel, the CPU backend's workers) cannot blur it. The process's anonymous memory
//!   (`/proc/self/smaps_rollup` `Anonymous:`, or `/proc/self/status` `RssAnon:` on kernels
//!   without `CONFIG_PROC_PAGE_MONITOR`) is measured too and printed beside it: it also sees
//!   memory a C library (librknnrt) allocates, but it is process-wide and page-granular, so it
//!   is evidence for a human, not the verdict.
//!
//! A backend that declares `Borrowed` but reads outside the mapping, or whose `prepare` left
//! more than [`PREPARE_ALLOWANCE`] bytes allocated, is counted as copied, whatever it says.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// How a weight's bytes reached the backend that owns it, as the backend declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arrival {
    /// A view into the model mapping: no byte moved.
    Borrowed,
    /// Rewritten into a backend's own layout (the NPU's native B layout): `bytes` produced.
    Converted { bytes: u64 },
    /// Copied as-is into memory the backend allocated. The thing the ledger exists to catch.
    Copied { bytes: u64 },
}

// ---- measuring the heap: a counting global allocator --------------------------------------

/// The runtime's global allocator: the system allocator, plus a per-thread count of live bytes
/// (allocated minus freed on that thread), so [`measure`] can say what a call left allocated.
pub struct CountingAlloc;

thread_local! {
    // `const` and `Cell<i64>`: no destructor, no lazy init, so it is usable inside the allocator.
    static LIVE: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    let _ = LIVE.try_with(|c| c.set(c.get().wrapping_add(delta)));
}

// SAFETY: every call is forwarded unchanged to `System`; only a thread-local counter is updated.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        count(-(layout.size() as i64));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Live heap bytes allocated by this thread (allocations minus frees, since it started).
pub fn thread_live_heap() -> i64 {
    LIVE.try_with(Cell::get).unwrap_or(0)
}

/// Where the anonymous-memory figure comes from, and its value in bytes.
pub fn anon_bytes() -> Option<(&'static str, u64)> {
    let field = |path: &str, key: &str| -> Option<u64> {
        let s = std::fs::read_to_string(path).ok()?;
        let line = s.lines().find(|l| l.starts_with(key))?;
        let kib: u64 = line[key.len()..]
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    if let Some(b) = field("/proc/self/smaps_rollup", "Anonymous:") {
        return Some(("smaps_rollup Anonymous", b));
    }
    field("/proc/self/status", "RssAnon:").map(|b| ("status RssAnon", b))
}

/// What one call allocated: live heap bytes it left on this thread, and how the process's
/// anonymous memory moved across it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Measurement {
    pub heap_bytes: i64,
    /// `None` when neither `/proc/self/smaps_rollup` nor `/proc/self/status` could be read.
    pub anon_bytes: Option<i64>,
    #[serde(skip)]
    pub anon_source: Option<&'static str>,
}

/// Run `f` and measure what it left allocated.
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, Measurement) {
    let anon0 = anon_bytes();
    let heap0 = thread_live_heap();
    let out = f();
    let heap = thread_live_heap() - heap0;
    let anon1 = anon_bytes();
    let anon = match (anon0, anon1) {
        (Some((src, a)), Some((_, b))) => Some((src, b as i64 - a as i64)),
        _ => None,
    };
    (
        out,
        Measurement {
            heap_bytes: heap,
            anon_bytes: anon.map(|a| a.1),
            anon_source: anon.map(|a| a.0),
        },
    )
}

/// Live heap a `prepare` may leave behind and still be "borrowed": its own bookkeeping (a boxed
/// shape record is tens of bytes). A copy of any weight worth running is larger.
pub const PREPARE_ALLOWANCE: i64 = 1024;

// ---- where the bytes are: the registry of model mappings ---------------------------------

struct Mapping {
    id: u64,
    range: Range<usize>,
    path: PathBuf,
}

static MAPPINGS: Mutex<(u64, Vec<Mapping>)> = Mutex::new((0, Vec::new()));

/// Registered while a model mapping is alive; unregisters on drop.
#[derive(Debug)]
pub struct MappingGuard(u64);

impl Drop for MappingGuard {
    fn drop(&mut self) {
        if let Ok(mut m) = MAPPINGS.lock() {
            m.1.retain(|x| x.id != self.0);
        }
    }
}

/// Record that `bytes` is the mapping of the model file `path`, for as long as the guard lives.
pub fn register_mapping(bytes: &[u8], path: &Path) -> MappingGuard {
    let start = bytes.as_ptr() as usize;
    let mut m = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
    m.0 += 1;
    let id = m.0;
    m.1.push(Mapping {
        id,
        range: start..start + bytes.len(),
        path: path.to_path_buf(),
    });
    MappingGuard(id)
}

/// The model file whose live mapping holds the whole address range `r`, if any.
pub fn mapping_containing(r: &Range<usize>) -> Option<PathBuf> {
    let m = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
    m.1.iter()
        .find(|x| x.range.start <= r.start && r.end <= x.range.end && r.start <= r.end)
        .map(|x| x.path.clone())
}

/// The address range of a slice, as [`crate::backend::PreparedWeight::reads_from`] reports it.
pub fn address_range(bytes: &[u8]) -> Range<usize> {
    let s = bytes.as_ptr() as usize;
    s..s + bytes.len()
}

// ---- the ledger ----------------------------------------------------------------------------

/// The evidence for one prepared weight.
#[derive(Clone, Debug)]
pub struct Evidence {
    pub declared: Arrival,
    /// The address range the backend reads at run time, when it reads the model's bytes.
    pub reads: Option<Range<usize>>,
    pub measured: Measurement,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackendTotals {
    /// Weights owned by this backend.
    pub tensors: usize,
    /// Of those, the ones measured as views into a model mapping: declared borrowed, read
    /// inside the mapping, and `prepare` left nothing allocated past [`PREPARE_ALLOWANCE`].
    pub mapped_tensors: usize,
    /// Bytes of the owned weights as they lie in the file.
    pub file_bytes: u64,
    /// What the backend says it produced in its own layout.
    pub converted_bytes: u64,
    /// Measured: bytes copied (declared, found outside the mapping, or left allocated).
    pub copied_bytes: u64,
    /// One entry per copied weight: its name and the evidence.
    pub copied_tensors: Vec<String>,
    /// Weights whose run-time reads were checked to lie inside a model mapping.
    pub reads_in_mapping: usize,
    /// Live heap bytes all `prepare` calls left on the preparing thread.
    pub heap_bytes: i64,
    /// How the process's anonymous memory moved across the `prepare` calls.
    pub anon_bytes: Option<i64>,
    #[serde(skip)]
    pub anon_source: Option<&'static str>,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Ledger {
    backends: BTreeMap<String, BackendTotals>,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn smib(bytes: i64) -> String {
    format!("{:+.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Record that `backend` owns `tensor` (`file_bytes` long in the file), with the evidence
    /// measured around its `prepare`. What counts is the measurement; the declaration only
    /// says which rule applies (a conversion is expected to allocate, a borrow is not).
    pub fn record(&mut self, backend: &str, tensor: &str, file_bytes: u64, ev: &Evidence) {
        let t = self.backends.entry(backend.to_string()).or_default();
        t.tensors += 1;
        t.file_bytes += file_bytes;
        t.heap_bytes += ev.measured.heap_bytes;
        if let Some(a) = ev.measured.anon_bytes {
            t.anon_bytes = Some(t.anon_bytes.unwrap_or(0) + a);
            t.anon_source = ev.measured.anon_source;
        }
        let in_mapping = ev.reads.as_ref().and_then(mapping_containing);
        if in_mapping.is_some() {
            t.reads_in_mapping += 1;
        }
        let heap = ev.measured.heap_bytes;
        match ev.declared {
            Arrival::Borrowed => {
                if in_mapping.is_none() {
                    t.copied_bytes += file_bytes.max(heap.max(0) as u64);
                    let where_ = match &ev.reads {
                        Some(r) => format!(
                            "reads {:#x}..{:#x}, outside every model mapping",
                            r.start, r.end
                        ),
                        None => "names no bytes it reads".to_string(),
                    };
                    t.copied_tensors
                        .push(format!("{tensor} (declared borrowed, but {where_})"));
                } else if heap > PREPARE_ALLOWANCE {
                    t.copied_bytes += heap as u64;
                    t.copied_tensors.push(format!(
                        "{tensor} (declared borrowed, but prepare left {heap} bytes ({}) allocated)",
                        smib(heap)
                    ));
                } else {
                    t.mapped_tensors += 1;
                }
            }
            Arrival::Converted { bytes } => t.converted_bytes += bytes,
            Arrival::Copied { bytes } => {
                t.copied_bytes += bytes.max(heap.max(0) as u64);
                t.copied_tensors.push(format!("{tensor} (declared copied)"));
            }
        }
    }

    pub fn totals(&self, backend: &str) -> Option<&BackendTotals> {
        self.backends.get(backend)
    }

    pub fn backends(&self) -> impl Iterator<Item = (&str, &BackendTotals)> {
        self.backends.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// One positive line per backend, e.g.
    /// `weights on CPU via mmap (zero-copy, borrowed): 98.36 MiB (mapped 272/272 tensors,
    /// copied 0.00 MiB; measured over prepare: reads inside the model mapping 272/272, heap
    /// +0.00 MiB [counting allocator], anonymous +0.00 MiB [smaps_rollup Anonymous])`.
    pub fn lines(&self) -> Vec<String> {
        self.backends
            .iter()
            .map(|(name, t)| {
                let how = if t.copied_bytes > 0 {
                    "via copy (NOT zero-copy)"
                } else if t.converted_bytes > 0 && t.mapped_tensors == 0 {
                    "via mmap, converted to native layout"
                } else if t.converted_bytes > 0 {
                    "via mmap (zero-copy, borrowed) and converted to native layout"
                } else {
                    "via mmap (zero-copy, borrowed)"
                };
                let mut line = format!(
                    "weights on {name} {how}: {:.2} MiB (mapped {}/{} tensors, copied {:.2} MiB",
                    mib(t.file_bytes),
                    t.mapped_tensors,
                    t.tensors,
                    mib(t.copied_bytes)
                );
                if t.converted_bytes > 0 {
                    let _ = write!(
                        line,
                        ", {:.2} MiB in {name} memory",
                        mib(t.converted_bytes)
                    );
                }
                let _ = write!(
                    line,
                    "; measured over prepare: reads inside the model mapping {}/{}, heap {} [counting allocator]",
                    t.reads_in_mapping,
                    t.tensors,
                    smib(t.heap_bytes)
                );
                match (t.anon_bytes, t.anon_source) {
                    (Some(a), Some(src)) => {
                        let _ = write!(line, ", anonymous {} [{src}]", smib(a));
                    }
                    _ => line.push_str(", anonymous memory not measurable here"),
                }
                line.push(')');
                line
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(declared: Arrival, reads: Option<Range<usize>>, heap: i64) -> Evidence {
        Evidence {
            declared,
            reads,
            measured: Measurement {
                heap_bytes: heap,
                anon_bytes: Some(0),
                anon_source: Some("test"),
            },
        }
    }

    #[test]
    fn the_counting_allocator_sees_a_copy_on_this_thread_only() {
        let src = vec![7u8; 3 << 20];
        let (copy, m) = measure(|| src.clone());
        assert_eq!(m.heap_bytes, 3 << 20);
        let (_, m) = measure(|| std::thread::spawn(|| vec![1u8; 1 << 20]).join().unwrap());
        // The spawned thread's Vec, now owned here, was allocated there: a worker's copy is
        // not counted on this thread, which is why anonymous memory is printed beside it.
        assert!(m.heap_bytes < 1 << 20, "{m:?}");
        let (_, m) = measure(|| drop(copy));
        assert_eq!(m.heap_bytes, -(3 << 20));
        assert!(anon_bytes().is_some(), "this host has /proc/self");
    }

    #[test]
    fn borrowed_weights_print_the_measured_zero_copy_line() {
        let file = vec![0u8; 4 << 20];
        let _g = register_mapping(&file, Path::new("m.gguf"));
        let mut l = Ledger::new();
        let a = address_range(&file[..3 << 20]);
        let b = address_range(&file[3 << 20..]);
        l.record("CPU", "a", 3 << 20, &ev(Arrival::Borrowed, Some(a), 48));
        l.record("CPU", "b", 1 << 20, &ev(Arrival::Borrowed, Some(b), 48));
        assert_eq!(
            l.lines(),
            ["weights on CPU via mmap (zero-copy, borrowed): 4.00 MiB (mapped 2/2 tensors, copied 0.00 MiB; \
              measured over prepare: reads inside the model mapping 2/2, heap +0.00 MiB [counting allocator], \
              anonymous +0.00 MiB [test])"]
        );
    }

    #[test]
    fn a_declared_borrow_is_a_copy_when_the_measurement_says_so() {
        let file = vec![0u8; 1 << 20];
        let g = register_mapping(&file, Path::new("m.gguf"));
        let inside = address_range(&file[..4096]);
        let heap_copy = vec![0u8; 4096];
        let mut l = Ledger::new();
        // Reads the mapping, but prepare kept a copy.
        l.record(
            "CPU",
            "kept",
            4096,
            &ev(Arrival::Borrowed, Some(inside.clone()), 4096 + 48),
        );
        // Reads its own buffer.
        l.record(
            "CPU",
            "elsewhere",
            4096,
            &ev(Arrival::Borrowed, Some(address_range(&heap_copy)), 0),
        );
        // Names nothing it reads.
        l.record("CPU", "silent", 4096, &ev(Arrival::Borrowed, None, 0));
        l.record(
            "CPU",
            "fine",
            4096,
            &ev(Arrival::Borrowed, Some(inside.clone()), 48),
        );
        let t = l.totals("CPU").unwrap();
        assert_eq!(
            (t.mapped_tensors, t.reads_in_mapping, t.copied_tensors.len()),
            (1, 2, 3)
        );
        assert!(t.copied_tensors[0]
            .starts_with("kept (declared borrowed, but prepare left 4144 bytes (+0.00 MiB)"));
        assert!(t.copied_tensors[1].contains("outside every model mapping"));
        assert!(t.copied_tensors[2].contains("names no bytes it reads"));
        let line = &l.lines()[0];
        assert!(line.contains("NOT zero-copy"), "{line}");
        assert!(line.contains("mapped 1/4 tensors"), "{line}");
        // Once the mapping is gone, the same range is no longer inside one.
        drop(g);
        let mut l = Ledger::new();
        l.record("CPU", "late", 4096, &ev(Arrival::Borrowed, Some(inside), 0));
        assert_eq!(l.totals("CPU").unwrap().copied_tensors.len(), 1);
    }

    #[test]
    fn npu_conversion_is_counted_separately() {
        let mut l = Ledger::new();
        l.record(
            "NPU",
            "w",
            1024 * 1024,
            &ev(
                Arrival::Converted {
                    bytes: 2 * 1024 * 1024,
                },
                None,
                2 * 1024 * 1024,
            ),
        );
        assert_eq!(
            l.lines(),
            ["weights on NPU via mmap, converted to native layout: 1.00 MiB (mapped 0/1 tensors, copied 0.00 MiB, \
              2.00 MiB in NPU memory; measured over prepare: reads inside the model mapping 0/1, heap +2.00 MiB \
              [counting allocator], anonymous +0.00 MiB [test])"]
        );
    }
}
