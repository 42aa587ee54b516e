//! Persistent worker threads for the CPU matmuls and the attention.
//!
//! A decode step is a few hundred matmuls of tens of microseconds each. Spawning a thread per
//! matmul cost about 60 µs on the 2-core development host, and waking a sleeping rayon worker
//! about 90 µs (both measured), so a second thread made decode slower, not faster. Written by
//! hand because no well-kept crate offers what ggml's own thread pool does: workers that spin
//! between calls for a short while (here [`SPIN`]) and only then park, so back-to-back calls
//! cost a cache-line handoff instead of a futex wake-up.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_millis(1);

/// The job of one call: `f(i)` for part `i`, lifetime erased (see [`Pool::run`]).
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped (SeqCst) to publish a job; workers wait for it to move.
    epoch: AtomicUsize,
    /// Workers still running the current job.
    pending: AtomicUsize,
    /// Workers that are parked (or about to), so a caller knows to notify.
    sleepers: AtomicUsize,
    panicked: AtomicBool,
    job: UnsafeCell<Option<Job>>,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller holding `Pool::caller` while no worker runs (all
// have decremented `pending` for the previous epoch), and read by workers only between the epoch
// bump that publishes it (SeqCst) and their own decrement of `pending`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    workers: usize,
    /// One call at a time; a call that finds it taken (another thread's call, or a nested one)
    /// uses scoped threads instead.
    caller: Mutex<()>,
}

impl Pool {
    fn new(workers: usize) -> std::io::Result<Pool> {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            job: UnsafeCell::new(None),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        for w in 0..workers {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("kiln-worker-{}", w + 1))
                .spawn(move || worker(&s, w + 1))?;
        }
        Ok(Pool {
            shared,
            workers,
            caller: Mutex::new(()),
        })
    }

    /// `f(i)` for i in 0..=workers, i = 0 on the calling thread; returns when all are done.
    /// `false` if the pool is busy (nothing ran).
    fn run(&self, f: &(dyn Fn(usize) + Sync)) -> bool {
        let _guard = match self.caller.try_lock() {
            Ok(g) => g,
            // A part panicked in an earlier call; the pool itself is consistent.
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        let s = &*self.shared;
        // SAFETY: erasing the lifetime of `f` is sound because this function does not return
        // before every worker has finished with it (`pending` back to 0 below), and the pointer
        // is cleared before `f` goes out of scope.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no worker reads `job` now: all finished the previous epoch (see `Shared`).
        unsafe { *s.job.get() = Some(job) };
        s.pending.store(self.workers, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _p = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        while s.pending.load(Acquire) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: every worker is done with this epoch's job.
        unsafe { *s.job.get() = None };
        // Cleared whichever panic is reported, so the next call starts clean.
        let worker_panicked = s.panicked.swap(false, SeqCst);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if worker_panicked {
            panic!("a kiln worker thread panicked");
        }
        true
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new epoch: spin for SPIN, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(SeqCst);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 && start.elapsed() > SPIN {
                let mut g = s.park.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, SeqCst);
                while s.epoch.load(SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, SeqCst);
                drop(g);
                seen = s.epoch.load(SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        // SAFETY: the caller published the job before bumping the epoch and keeps it alive
        // until `pending` reaches 0, which this worker's decrement below is part of.
        if let Some(job) = unsafe { *s.job.get() } {
            // SAFETY: as above, `job` points to a live `Fn` for this epoch.
            let f = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| f(index))).is_err() {
                s.panicked.store(true, SeqCst);
            }
        }
        s.pending.fetch_sub(1, Release);
    }
}

/// One pool per worker count, made on first use and kept for the process.
fn pool(workers: usize) -> Option<Arc<Pool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<Pool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.get(&workers) {
        return Some(p.clone());
    }
    let p = Arc::new(Pool::new(workers).ok()?);
    pools.insert(workers, p.clone());
    Some(p)
}

/// `work(i, part)` for every part, part 0 on the calling thread and each other on a worker of a
/// persistent pool of `parts.len() − 1` threads; returns when all are done. If the pool is busy
/// (a concurrent or nested call) or cannot be made, the parts run on scoped threads instead:
/// slower, same results.
pub fn run_parts<T: Send>(parts: Vec<T>, work: impl Fn(usize, T) + Sync) {
    let n = parts.len();
    if n == 0 {
        return;
    }
    if n == 1 {
        if let Some(p) = parts.into_iter().next() {
            work(0, p);
        }
        return;
    }
    // Each part is taken exactly once, by the thread whose index it has.
    let slots: Vec<Mutex<Option<T>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
    let take = |i: usize| {
        let part = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(part) = part {
            work(i, part);
        }
    };
    if let Some(p) = pool(n - 1) {
        if p.run(&take) {
            return;
        }
    }
    std::thread::scope(|s| {
        for i in 1..n {
            let take = &take;
            s.spawn(move || take(i));
        }
        take(0);
    });
}

#[cfg(test)]
mod tests {
    use super::run_parts;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_part_runs_once_with_its_index() {
        for n in [1usize, 2, 3, 8, 2, 3] {
            for _ in 0..200 {
                let mut out = vec![0usize; n * 4];
                let calls = AtomicUsize::new(0);
                let parts: Vec<&mut [usize]> = out.chunks_mut(4).collect();
                run_parts(parts, |i, part| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    part.fill(i + 1);
                });
                assert_eq!(calls.load(Ordering::Relaxed), n);
                let want: Vec<usize> = (0..n).flat_map(|i| [i + 1; 4]).collect();
                assert_eq!(out, want);
            }
        }
        run_parts(Vec::<()>::new(), |_, _| panic!("no parts, no calls"));
    }

    /// Calls from several threads at once (as the test harness makes them) and a call nested
    /// in a part all complete, each part once.
    #[test]
    fn concurrent_and_nested_calls_complete() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        run_parts(vec![(); 2], |_, ()| {
                            run_parts(vec![(); 2], |_, ()| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 100 * 2 * 2);
    }

    #[test]
    fn a_panicking_part_is_reported_to_the_caller() {
        let r = std::panic::catch_unwind(|| {
            run_parts(vec![0usize, 1], |i, _| {
                if i == 1 {
                    panic!("injected");
                }
            })
        });
        assert!(r.is_err());
        // The pool still works afterwards.
        let n = AtomicUsize::new(0);
        run_parts(vec![(); 2], |_, ()| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
