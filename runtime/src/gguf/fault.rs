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
//! A `SIGBUS` outside every model mapping gets the default action, as before.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

const SLOTS: usize = 64;
const PATH_MAX: usize = 240;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicUsize = AtomicUsize::new(0);
/// Start address of each live mapping (0: free slot); written last on register, first on drop.
static START: [AtomicUsize; SLOTS] = [ZERO; SLOTS];
static LEN: [AtomicUsize; SLOTS] = [ZERO; SLOTS];
/// Pages replaced in each mapping, and the first faulting offset + 1.
static FAULTS: [AtomicUsize; SLOTS] = [ZERO; SLOTS];
static FIRST: [AtomicUsize; SLOTS] = [ZERO; SLOTS];
/// Each slot's path, for the handler's message (written before START publishes the slot).
static mut PATHS: [[u8; PATH_MAX]; SLOTS] = [[0; PATH_MAX]; SLOTS];
static PATH_LEN: [AtomicUsize; SLOTS] = [ZERO; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// Faults already handed out by [`take`], per live slot.
static REPORTED: [AtomicUsize; SLOTS] = [ZERO; SLOTS];
/// Faults of mappings since closed, not yet handed out by [`take`].
static CLOSED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
static RECOVER: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

/// Recover from read errors in model mappings (zero pages, counted) instead of stopping: for a
/// process that reports each mapping's faults itself (the self-check).
pub fn set_recover(on: bool) {
    RECOVER.store(on, Ordering::SeqCst);
}

/// While it lives, faults inside its mapping are caught and counted.
pub struct FaultGuard {
    slot: Option<usize>,
}

/// Watch the mapping `bytes` of `path` (installs the handler on first use). With more than 64
/// live mappings the extra ones are not watched (the default action applies to them).
pub fn watch(bytes: &[u8], path: &Path) -> FaultGuard {
    INSTALL.call_once(install);
    let start = bytes.as_ptr() as usize;
    if bytes.is_empty() {
        return FaultGuard { slot: None };
    }
    for i in 0..SLOTS {
        // Claim the slot with a placeholder start (1), fill it, then publish the real start.
        if START[i]
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let p = path.as_os_str().as_encoded_bytes();
            let n = p.len().min(PATH_MAX);
            // SAFETY: slot i is ours (claimed above); the handler reads PATHS[i] only while
            // START[i] holds a real start, which is published below, after this write.
            unsafe {
                let dst = std::ptr::addr_of_mut!(PATHS[i]) as *mut u8;
                std::ptr::copy_nonoverlapping(p.as_ptr(), dst, n);
            }
            PATH_LEN[i].store(n, Ordering::Release);
            FAULTS[i].store(0, Ordering::Release);
            FIRST[i].store(0, Ordering::Release);
            REPORTED[i].store(0, Ordering::Release);
            LEN[i].store(bytes.len(), Ordering::Release);
            START[i].store(start, Ordering::Release);
            return FaultGuard { slot: Some(i) };
        }
    }
    FaultGuard { slot: None }
}

impl FaultGuard {
    /// Pages of this mapping that could not be read (replaced by zeros), and the first
    /// faulting offset in the file.
    pub fn faults(&self) -> Option<(usize, usize)> {
        slot_faults(self.slot?)
    }

    /// An error naming `path` when any page of it could not be read.
    pub fn error(&self, path: &Path) -> Option<String> {
        self.slot.and_then(|i| slot_error(i, path))
    }
}

/// Slot `i`'s faults: how many pages, and the first faulting offset.
fn slot_faults(i: usize) -> Option<(usize, usize)> {
    let n = FAULTS[i].load(Ordering::Acquire);
    (n > 0).then(|| (n, FIRST[i].load(Ordering::Acquire).saturating_sub(1)))
}

/// Slot `i`'s faults as an error naming `path`.
fn slot_error(i: usize, path: &Path) -> Option<String> {
    slot_faults(i).map(|(n, off)| {
        format!(
            "I/O error reading {}: {n} page(s) could not be read, the first at byte offset \
             {off} (the storage or dm-verity refused the block: its bytes do not match the \
             image's root hash, or the medium failed)",
            path.display()
        )
    })
}

/// The read errors recovered since the last call, each naming its file: of mappings closed
/// since, and new ones of mappings still open. The self-check FAILs the check during which
/// they happened.
pub fn take() -> Vec<String> {
    let mut out: Vec<String> =
        std::mem::take(&mut *CLOSED.lock().unwrap_or_else(|e| e.into_inner()));
    for i in 0..SLOTS {
        if START[i].load(Ordering::Acquire) <= 1 {
            continue;
        }
        let n = FAULTS[i].load(Ordering::Acquire);
        if n > REPORTED[i].swap(n, Ordering::AcqRel) {
            out.extend(slot_error(i, &slot_path(i)));
        }
    }
    out
}

fn slot_path(i: usize) -> std::path::PathBuf {
    let n = PATH_LEN[i].load(Ordering::Acquire);
    // SAFETY: read in normal context while the slot is live; written only when claimed.
    let name: &[u8; PATH_MAX] = unsafe { &*std::ptr::addr_of!(PATHS[i]) };
    std::path::PathBuf::from(String::from_utf8_lossy(&name[..n]).into_owned())
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let n = FAULTS[i].load(Ordering::Acquire);
            if n > REPORTED[i].load(Ordering::Acquire) {
                if let Some(e) = self.error(&slot_path(i)) {
                    CLOSED.lock().unwrap_or_else(|e| e.into_inner()).push(e);
                }
            }
            START[i].store(1, Ordering::Release);
            LEN[i].store(0, Ordering::Release);
            START[i].store(0, Ordering::Release);
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

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for i in 0..SLOTS {
        let s = START[i].load(Ordering::Acquire);
        let l = LEN[i].load(Ordering::Acquire);
        if s <= 1 || addr < s || addr >= s + l {
            continue;
        }
        let off = addr - s;
        if RECOVER.load(Ordering::SeqCst) {
            let page = PAGE.load(Ordering::Relaxed);
            let at = addr & !(page - 1);
            // SAFETY: the page lies inside a live read-only model mapping of ours; a private
            // anonymous zero page in its place changes only what later reads of it see.
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
            if r != libc::MAP_FAILED {
                FAULTS[i].fetch_add(1, Ordering::AcqRel);
                let _ = FIRST[i].compare_exchange(0, off + 1, Ordering::AcqRel, Ordering::Relaxed);
                return;
            }
        }
        let n = PATH_LEN[i].load(Ordering::Acquire);
        let mut digits = [0u8; 24];
        write_stderr(b"kiln: I/O error reading ");
        // SAFETY: slot i is live (START checked above) and its path was written before.
        let name: &[u8; PATH_MAX] = unsafe { &*std::ptr::addr_of!(PATHS[i]) };
        write_stderr(&name[..n]);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A mapped file truncated under the mapping faults with SIGBUS past its end, as an
    /// unreadable block does: in recover mode the read completes with zeros and the guard
    /// names the file and the offset.
    #[test]
    fn a_fault_in_a_watched_mapping_is_counted_and_named() {
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

    /// Outside the self-check (no recovery) a fault in a watched mapping stops the process
    /// with exit status 74 and one line naming the file and the offset. Run in a child: this
    /// test binary again, told by the environment to provoke the fault.
    // The child is this test binary run again: on the host only (the aarch64 stages run tests
    // under qemu-user, which cannot exec an aarch64 binary without binfmt_misc).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn without_recovery_the_process_stops_naming_the_file() {
        if let Ok(p) = std::env::var("KILN_FAULT_CHILD") {
            let p = std::path::PathBuf::from(p);
            let f = std::fs::File::open(&p).unwrap();
            // SAFETY: the parent truncated the file on purpose to provoke the fault.
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
            panic!("the read past the end returned {v} instead of stopping the process");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("stop.gguf");
        std::fs::write(&p, vec![1u8; 3 * 65536]).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "gguf::fault::tests::without_recovery_the_process_stops_naming_the_file",
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
