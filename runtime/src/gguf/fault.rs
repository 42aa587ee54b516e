//! Read errors inside a mapped model: a page the storage cannot give (a bad sector, a block
//! dm-verity refuses because it does not match the root hash) is `SIGBUS` on access, which
//! would kill the process with no word of which file. A `SIGBUS` handler looks the address up
//! among the live model mappings (a lock-free table: a handler may not lock) and then either
//!
//! - **recovers** (the self-check, [`set_recover`]): the page is replaced with a zero page so
//!   the access completes, and the fault is counted against the mapping; the check that read it
//!   asks [`FaultGuard::error`] afterwards and FAILs naming the model and the offset; or
//! - **stops** (every other command): it writes one line naming the file and the offset and
//!   exits with 74 (`EX_IOERR`) — never a result computed from bytes that were not read.
//!
//! The table is a chain of segments of [`SLOTS`] slots each: the first is static, the others
//! are allocated by [`watch`] (normal context) when every slot before them is taken, published
//! with an atomic pointer and never freed, so every mapping is watched however many are live,
//! and the handler walks the chain with atomic loads only (no lock, no allocation).
//!
//! A `SIGBUS` outside every model mapping gets the default action, as before.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::sync::Once;

/// Slots per segment of the table.
const SLOTS: usize = 64;
const PATH_MAX: usize = 240;

/// One live mapping's entry. Every field is atomic: the handler reads it while other threads
/// claim and release slots.
struct Slot {
    /// Start address of the mapping (0: free, 1: being filled or released); written last on
    /// register, first on drop.
    start: AtomicUsize,
    len: AtomicUsize,
    /// Pages replaced in the mapping, and the first faulting offset + 1.
    faults: AtomicUsize,
    first: AtomicUsize,
    /// Faults already handed out by [`take`].
    reported: AtomicUsize,
    /// The path, for the handler's message (written before `start` publishes the slot).
    path: [AtomicU8; PATH_MAX],
    path_len: AtomicUsize,
}

impl Slot {
    const fn new() -> Slot {
        #[allow(clippy::declare_interior_mutable_const)]
        const B: AtomicU8 = AtomicU8::new(0);
        Slot {
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            faults: AtomicUsize::new(0),
            first: AtomicUsize::new(0),
            reported: AtomicUsize::new(0),
            path: [B; PATH_MAX],
            path_len: AtomicUsize::new(0),
        }
    }

    /// The live mapping's start and length, when the slot holds one.
    fn live(&self) -> Option<(usize, usize)> {
        let s = self.start.load(Ordering::Acquire);
        let l = self.len.load(Ordering::Acquire);
        (s > 1).then_some((s, l))
    }

    /// The path's bytes into `buf` (no allocation: signal context).
    fn path_into<'b>(&self, buf: &'b mut [u8; PATH_MAX]) -> &'b [u8] {
        let n = self.path_len.load(Ordering::Acquire).min(PATH_MAX);
        for (b, a) in buf.iter_mut().zip(&self.path[..n]) {
            *b = a.load(Ordering::Relaxed);
        }
        &buf[..n]
    }

    fn path(&self) -> std::path::PathBuf {
        let mut buf = [0u8; PATH_MAX];
        let name = self.path_into(&mut buf);
        std::path::PathBuf::from(String::from_utf8_lossy(name).into_owned())
    }

    /// This slot's faults: how many pages, and the first faulting offset.
    fn faults(&self) -> Option<(usize, usize)> {
        let n = self.faults.load(Ordering::Acquire);
        (n > 0).then(|| (n, self.first.load(Ordering::Acquire).saturating_sub(1)))
    }

    /// This slot's faults as an error naming `path`.
    fn error(&self, path: &Path) -> Option<String> {
        self.faults().map(|(n, off)| {
            format!(
                "I/O error reading {}: {n} page(s) could not be read, the first at byte offset \
                 {off} (the storage or dm-verity refused the block: its bytes do not match the \
                 image's root hash, or the medium failed)",
                path.display()
            )
        })
    }
}

/// [`SLOTS`] slots and the next segment (null until one is needed; never freed once published).
struct Segment {
    slots: [Slot; SLOTS],
    next: AtomicPtr<Segment>,
}

impl Segment {
    const fn new() -> Segment {
        #[allow(clippy::declare_interior_mutable_const)]
        const S: Slot = Slot::new();
        Segment {
            slots: [S; SLOTS],
            next: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    fn next(&self) -> Option<&'static Segment> {
        // SAFETY: a non-null `next` was leaked from a Box (so lives for ever) and published with
        // Release after it was fully built; this Acquire load sees it built.
        unsafe { self.next.load(Ordering::Acquire).as_ref() }
    }

    /// The next segment, adding one when there is none yet (normal context only: allocates).
    fn next_or_grow(&self) -> &'static Segment {
        if let Some(n) = self.next() {
            return n;
        }
        let new = Box::into_raw(Box::new(Segment::new()));
        match self.next.compare_exchange(
            std::ptr::null_mut(),
            new,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            // SAFETY: just leaked from a Box, published above, never freed.
            Ok(_) => unsafe { &*new },
            Err(other) => {
                // Another thread published one first: ours was never seen by anyone.
                // SAFETY: `new` came from Box::into_raw above and was not published.
                drop(unsafe { Box::from_raw(new) });
                // SAFETY: `other` is non-null (the exchange from null failed) and published.
                unsafe { &*other }
            }
        }
    }
}

/// The first segment of the table; the chain grows from it.
static TABLE: Segment = Segment::new();
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// Faults of mappings since closed, not yet handed out by [`take`].
static CLOSED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
static RECOVER: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

/// Every slot of the table, segment by segment: atomic loads only, safe in the handler.
fn slots() -> impl Iterator<Item = &'static Slot> {
    std::iter::successors(Some(&TABLE), |s| s.next()).flat_map(|s| s.slots.iter())
}

/// Recover from read errors in model mappings (zero pages, counted) instead of stopping: for a
/// process that reports each mapping's faults itself (the self-check).
pub fn set_recover(on: bool) {
    RECOVER.store(on, Ordering::SeqCst);
}

/// While it lives, faults inside its mapping are caught and counted.
pub struct FaultGuard {
    slot: Option<&'static Slot>,
}

/// Watch the mapping `bytes` of `path` (installs the handler on first use). Every non-empty
/// mapping is watched: when every slot is taken the table grows by a segment.
pub fn watch(bytes: &[u8], path: &Path) -> FaultGuard {
    INSTALL.call_once(install);
    if bytes.is_empty() {
        return FaultGuard { slot: None };
    }
    let mut seg: &'static Segment = &TABLE;
    loop {
        for slot in &seg.slots {
            // Claim the slot with a placeholder start (1), fill it, then publish the real start.
            if slot
                .start
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                fill(slot, bytes, path);
                return FaultGuard { slot: Some(slot) };
            }
        }
        seg = seg.next_or_grow();
    }
}

/// Fill the claimed `slot` for `bytes` of `path` and publish it (its start, last).
fn fill(slot: &Slot, bytes: &[u8], path: &Path) {
    let p = path.as_os_str().as_encoded_bytes();
    let n = p.len().min(PATH_MAX);
    for (a, b) in slot.path.iter().zip(&p[..n]) {
        a.store(*b, Ordering::Relaxed);
    }
    slot.path_len.store(n, Ordering::Release);
    slot.faults.store(0, Ordering::Release);
    slot.first.store(0, Ordering::Release);
    slot.reported.store(0, Ordering::Release);
    slot.len.store(bytes.len(), Ordering::Release);
    slot.start.store(bytes.as_ptr() as usize, Ordering::Release);
}

impl FaultGuard {
    /// Pages of this mapping that could not be read (replaced by zeros), and the first
    /// faulting offset in the file.
    pub fn faults(&self) -> Option<(usize, usize)> {
        self.slot?.faults()
    }

    /// An error naming `path` when any page of it could not be read.
    pub fn error(&self, path: &Path) -> Option<String> {
        self.slot?.error(path)
    }
}

/// The read errors recovered since the last call, each naming its file: of mappings closed
/// since, and new ones of mappings still open. The self-check FAILs the check during which
/// they happened.
pub fn take() -> Vec<String> {
    let mut out: Vec<String> =
        std::mem::take(&mut *CLOSED.lock().unwrap_or_else(|e| e.into_inner()));
    for slot in slots() {
        if slot.live().is_none() {
            continue;
        }
        let n = slot.faults.load(Ordering::Acquire);
        if n > slot.reported.swap(n, Ordering::AcqRel) {
            out.extend(slot.error(&slot.path()));
        }
    }
    out
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            let n = slot.faults.load(Ordering::Acquire);
            if n > slot.reported.load(Ordering::Acquire) {
                if let Some(e) = slot.error(&slot.path()) {
                    CLOSED.lock().unwrap_or_else(|e| e.into_inner()).push(e);
                }
            }
            slot.start.store(1, Ordering::Release);
            slot.len.store(0, Ordering::Release);
            slot.start.store(0, Ordering::Release);
        }
    }
}

fn install() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: a zeroed sigaction with our handler and SA_SIGINFO is a valid argument; the old
    // action is not needed (a fault outside our mappings resets to SIG_DFL).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

fn write_stderr(b: &[u8]) {
    // SAFETY: write(2) is async-signal-safe; b is valid for its length.
    unsafe {
        libc::write(2, b.as_ptr() as *const libc::c_void, b.len());
    }
}

/// Decimal digits of `n` into `buf`, returning the used tail (no allocation: signal context).
fn decimal(mut n: usize, buf: &mut [u8; 24]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// Replace the page holding `addr` with a zero page (signal context): whether it was.
fn zero_page(addr: usize) -> bool {
    let page = PAGE.load(Ordering::Relaxed);
    let at = addr & !(page - 1);
    // SAFETY: the caller found the page inside a live read-only model mapping of ours; a
    // private anonymous zero page in its place changes only what later reads of it see.
    let r = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            page,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    r != libc::MAP_FAILED
}

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in slots() {
        let Some((s, l)) = slot.live() else { continue };
        if addr < s || addr - s >= l {
            continue;
        }
        let off = addr - s;
        if RECOVER.load(Ordering::SeqCst) && zero_page(addr) {
            slot.faults.fetch_add(1, Ordering::AcqRel);
            let _ = slot
                .first
                .compare_exchange(0, off + 1, Ordering::AcqRel, Ordering::Relaxed);
            return;
        }
        let mut name = [0u8; PATH_MAX];
        let mut digits = [0u8; 24];
        write_stderr(b"kiln: I/O error reading ");
        write_stderr(slot.path_into(&mut name));
        write_stderr(b" at byte offset ");
        write_stderr(decimal(off, &mut digits));
        write_stderr(
            b" (the storage or dm-verity refused the block: its bytes do not match the image's \
              root hash, or the medium failed); stopping\n",
        );
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(74) };
    }
    // Not ours: the default action, when the access faults again.
    // SAFETY: restoring SIG_DFL is always valid.
    unsafe {
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}

/// In tests, the tests that fault on purpose and every other caller of [`take`] (the self-check's
/// `CheckResult::new`) one at a time: `take` hands out every mapping's faults, so a test running
/// beside a faulting one would take its faults (and FAIL a check of its own with them).
#[cfg(test)]
pub(crate) fn test_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn faulting() -> std::sync::MutexGuard<'static, ()> {
        super::test_serial()
    }

    /// A mapped file truncated under the mapping faults with SIGBUS past its end, as an
    /// unreadable block does: in recover mode the read completes with zeros and the guard
    /// names the file and the offset.
    #[test]
    fn a_fault_in_a_watched_mapping_is_counted_and_named() {
        let _one_at_a_time = faulting();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&vec![7u8; 3 * 65536]).unwrap();
        drop(f);
        let f = std::fs::File::open(&p).unwrap();
        // SAFETY: the test truncates the file on purpose to provoke the fault.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        let g = watch(&map, &p);
        set_recover(true);
        assert!(g.faults().is_none());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(65536)
            .unwrap();
        let at = 2 * 65536 + 100;
        // SAFETY: the address is inside the mapping; the read faults and is recovered.
        let v = unsafe { std::ptr::read_volatile(map.as_ptr().add(at)) };
        assert_eq!(v, 0);
        assert_eq!(map[10], 7, "pages before the fault keep their bytes");
        let (n, off) = g.faults().expect("the fault was counted");
        assert_eq!(n, 1);
        assert_eq!(off, at);
        let e = g.error(&p).unwrap();
        assert!(
            e.contains("m.gguf") && e.contains(&format!("offset {at}")),
            "{e}"
        );
        // Handed out once while open, not again after the close.
        assert_eq!(take(), std::slice::from_ref(&e));
        drop(g);
        assert!(take().is_empty());
    }

    /// With more live mappings than a segment has slots (130: the first segment full, a
    /// second full, a third begun), a read error in the 65th and in the last is recovered,
    /// counted and named as in the first, not the default SIGBUS action.
    #[test]
    fn every_live_mapping_is_watched_past_the_first_64() {
        let _one_at_a_time = faulting();
        const PAGE: usize = 65536;
        let dir = tempfile::tempdir().unwrap();
        let mut live = Vec::new();
        for i in 0..130 {
            let p = dir.path().join(format!("many-{i}.gguf"));
            std::fs::write(&p, vec![7u8; 2 * PAGE]).unwrap();
            let f = std::fs::File::open(&p).unwrap();
            // SAFETY: the test truncates files on purpose to provoke faults.
            let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
            let g = watch(&map, &p);
            live.push((p, map, g));
        }
        set_recover(true);
        take();
        for i in [0, 64, 129] {
            let (p, map, g) = &live[i];
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(PAGE as u64)
                .unwrap();
            let at = PAGE + 100 + i;
            // SAFETY: inside the mapping; the read faults and is recovered.
            let v = unsafe { std::ptr::read_volatile(map.as_ptr().add(at)) };
            assert_eq!(v, 0, "mapping {i}");
            assert_eq!(
                map[10], 7,
                "mapping {i}: pages before the fault keep their bytes"
            );
            assert_eq!(g.faults(), Some((1, at)), "mapping {i}");
            let e = g.error(p).unwrap();
            assert!(
                e.contains(&format!("reading {}:", p.display()))
                    && e.contains(&format!("offset {at}")),
                "{e}"
            );
            assert_eq!(take(), std::slice::from_ref(&e), "mapping {i}");
        }
        for (_, _, g) in &live[1..64] {
            assert!(g.faults().is_none());
        }
    }

    /// Outside the self-check (no recovery) a fault in a watched mapping stops the process
    /// with exit status 74 and one line naming the file and the offset. Run in a child: this
    /// test binary again, told by the environment to provoke the fault.
    // The child is this test binary run again: on the host only (the aarch64 stages run tests
    // under qemu-user, which cannot exec an aarch64 binary without binfmt_misc).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn without_recovery_the_process_stops_naming_the_file() {
        stop_in_child("without_recovery_the_process_stops_naming_the_file", 0);
    }

    /// The same past the first segment of the table: with 64 other mappings live, the fault in
    /// the 65th stops the process naming its file, not the default SIGBUS action.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn without_recovery_a_fault_in_the_65th_mapping_stops_naming_the_file() {
        stop_in_child(
            "without_recovery_a_fault_in_the_65th_mapping_stops_naming_the_file",
            64,
        );
    }

    /// Run test `name` in a child that holds `before` mappings of another file live, then maps
    /// `stop.gguf`, truncates it and reads past the end; the child must exit 74 naming it.
    #[cfg(target_arch = "x86_64")]
    fn stop_in_child(name: &str, before: usize) {
        if let Ok(p) = std::env::var("KILN_FAULT_CHILD") {
            let p = std::path::PathBuf::from(p);
            let other = p.with_file_name("other.gguf");
            let f = std::fs::File::open(&other).unwrap();
            let live: Vec<_> = (0..before)
                .map(|_| {
                    // SAFETY: nothing changes this file while it is mapped.
                    let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
                    let g = watch(&map, &other);
                    (map, g)
                })
                .collect();
            let f = std::fs::File::open(&p).unwrap();
            // SAFETY: the child truncates the file on purpose to provoke the fault.
            let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
            let _g = watch(&map, &p);
            set_recover(false);
            std::fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .unwrap()
                .set_len(4096)
                .unwrap();
            // SAFETY: inside the mapping; the read faults and the handler exits.
            let v = unsafe { std::ptr::read_volatile(map.as_ptr().add(70_000)) };
            drop(live);
            panic!("the read past the end returned {v} instead of stopping the process");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("stop.gguf");
        std::fs::write(&p, vec![1u8; 3 * 65536]).unwrap();
        std::fs::write(dir.path().join("other.gguf"), vec![2u8; 65536]).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("gguf::fault::tests::{name}"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KILN_FAULT_CHILD", &p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(74), "stderr: {err}");
        assert!(
            err.contains(&format!(
                "kiln: I/O error reading {} at byte offset 70000",
                p.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn decimal_digits() {
        let mut b = [0u8; 24];
        assert_eq!(decimal(0, &mut b), b"0");
        assert_eq!(decimal(1234567, &mut b), b"1234567");
    }
}
