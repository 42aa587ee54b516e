//! Which CPUs run inference. On a big.LITTLE board (the RK3588: four Cortex-A55 at 1.8 GHz, two
//! clusters of two Cortex-A76 at 2.4 GHz) a matmul split evenly over all eight cores waits for
//! the little ones, so by default inference runs on the big cores only, found from sysfs rather
//! than from a list of board names:
//!
//! - `cpuN/cpu_capacity` (arm64's scheduler capacity, 1024 for the biggest core; an A55 beside an
//!   A76 is about 400) when the CPUs' capacities differ;
//! - else `cpuN/cpufreq/cpuinfo_max_freq` when those differ (a kernel without capacities);
//! - else every CPU is the same kind (QEMU's `virt`, most x86 hosts): all of them.
//!
//! "Big" is at least [`BIG_FRACTION`] of the largest value: an A55 (0.40 of an A76 by capacity,
//! 0.75 by frequency) is left out, two A76 clusters binned at 2.256 and 2.4 GHz (0.94) are both
//! in. Only CPUs that are online and in this process's affinity mask are considered.
//!
//! The selection is applied with `sched_setaffinity` to the calling thread before the model is
//! loaded, so every thread it starts afterwards (the matmul pool) inherits it, and
//! `available_parallelism` (the default thread count) counts it. [`ran_on`] measures where the
//! pool's threads actually ran: a declaration is not evidence.

use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::Path;

/// A CPU is big when its capacity (or maximum frequency) is at least this fraction of the
/// largest.
pub const BIG_FRACTION: f64 = 0.8;

/// What the big cores were told apart by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    Capacity,
    MaxFreq,
    /// All CPUs report the same (or nothing): all are used.
    AllAlike,
    /// `--cpus` named them.
    Given,
}

#[derive(Clone, Debug)]
pub struct Cpu {
    pub id: usize,
    pub capacity: Option<u64>,
    pub max_khz: Option<u64>,
}

/// The CPUs inference runs on, and why.
#[derive(Clone, Debug)]
pub struct Selection {
    pub cpus: Vec<usize>,
    pub basis: Basis,
    /// The considered CPUs left out, with the value that left them out.
    pub left_out: Vec<(usize, Option<u64>)>,
    /// The value (capacity, or kHz) of the selected CPUs, lowest and highest.
    pub range: Option<(u64, u64)>,
}

impl Selection {
    /// One line for logs, the report and `kiln bench`.
    pub fn describe(&self) -> String {
        let unit = |v: u64| match self.basis {
            Basis::MaxFreq => format!("{:.2} GHz", v as f64 / 1e6),
            _ => v.to_string(),
        };
        let val = |r: Option<(u64, u64)>| match r {
            Some((a, b)) if a == b => unit(a),
            Some((a, b)) => format!("{}-{}", unit(a), unit(b)),
            None => "?".into(),
        };
        let mut s = format!("inference cpus {}", format_list(&self.cpus));
        match self.basis {
            Basis::Given => s.push_str(" (given by --cpus)"),
            Basis::AllAlike => s.push_str(" (all alike: no cpu_capacity or cpufreq differences)"),
            Basis::Capacity | Basis::MaxFreq => {
                let what = if self.basis == Basis::Capacity {
                    "cpu_capacity"
                } else {
                    "cpuinfo_max_freq"
                };
                s.push_str(&format!(" (big cores by {what} {}", val(self.range)));
                if !self.left_out.is_empty() {
                    let ids: Vec<usize> = self.left_out.iter().map(|c| c.0).collect();
                    let lo = self.left_out.iter().filter_map(|c| c.1).min();
                    let hi = self.left_out.iter().filter_map(|c| c.1).max();
                    let r = lo.zip(hi);
                    s.push_str(&format!(
                        "; cpus {} at {} left out",
                        format_list(&ids),
                        val(r)
                    ));
                }
                s.push(')');
            }
        }
        s
    }
}

/// `0-3,6` → [0, 1, 2, 3, 6] (the kernel's cpulist format, also `--cpus`).
pub fn parse_list(s: &str) -> Result<Vec<usize>> {
    let mut out = BTreeSet::new();
    for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |t: &str| {
            t.trim()
                .parse::<usize>()
                .with_context(|| format!("CPU list {s:?}: {t:?} is not a CPU number"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b || b - a > 4096 {
                    bail!("CPU list {s:?}: range {part:?} is not low-high");
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(num(part)?);
            }
        }
    }
    if out.is_empty() {
        bail!("CPU list {s:?} names no CPU");
    }
    Ok(out.into_iter().collect())
}

/// [0, 1, 2, 3, 6] → `0-3,6`.
pub fn format_list(cpus: &[usize]) -> String {
    let mut v: Vec<usize> = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// The online CPUs under `sys_cpu` (`/sys/devices/system/cpu`) that `allowed` (this process's
/// affinity) contains, with their capacity and maximum frequency where sysfs has them.
pub fn read_cpus(sys_cpu: &Path, allowed: Option<&[usize]>) -> Result<Vec<Cpu>> {
    let online_path = sys_cpu.join("online");
    let online = std::fs::read_to_string(&online_path)
        .with_context(|| format!("reading {}", online_path.display()))?;
    let online =
        parse_list(&online).with_context(|| format!("parsing {}", online_path.display()))?;
    Ok(online
        .into_iter()
        .filter(|c| allowed.is_none_or(|a| a.contains(c)))
        .map(|id| {
            let dir = sys_cpu.join(format!("cpu{id}"));
            Cpu {
                id,
                capacity: read_u64(&dir.join("cpu_capacity")),
                max_khz: read_u64(&dir.join("cpufreq/cpuinfo_max_freq")),
            }
        })
        .collect())
}

/// The big cores of `cpus` (see the module's notes).
pub fn big_cores(cpus: &[Cpu]) -> Selection {
    let differ = |vals: Vec<Option<u64>>| -> Option<Vec<u64>> {
        let v: Vec<u64> = vals.into_iter().collect::<Option<Vec<u64>>>()?;
        let lo = *v.iter().min()?;
        let hi = *v.iter().max()?;
        (lo != hi).then_some(v)
    };
    let by = differ(cpus.iter().map(|c| c.capacity).collect())
        .map(|v| (Basis::Capacity, v))
        .or_else(|| differ(cpus.iter().map(|c| c.max_khz).collect()).map(|v| (Basis::MaxFreq, v)));
    let Some((basis, vals)) = by else {
        return Selection {
            cpus: cpus.iter().map(|c| c.id).collect(),
            basis: Basis::AllAlike,
            left_out: vec![],
            range: None,
        };
    };
    let max = vals.iter().copied().max().unwrap_or(0);
    let big = |v: u64| v as f64 >= BIG_FRACTION * max as f64;
    let mut sel = Selection {
        cpus: vec![],
        basis,
        left_out: vec![],
        range: None,
    };
    for (c, &v) in cpus.iter().zip(&vals) {
        if big(v) {
            sel.cpus.push(c.id);
            sel.range = Some(sel.range.map_or((v, v), |(a, b)| (a.min(v), b.max(v))));
        } else {
            sel.left_out.push((c.id, Some(v)));
        }
    }
    sel
}

/// This thread's affinity mask.
pub fn affinity() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("sched_getaffinity");
    }
    // SAFETY: CPU_ISSET reads the set within its size.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Restrict the calling thread (and every thread it starts from now on) to `cpus`.
pub fn apply(cpus: &[usize]) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            bail!("CPU {c} is beyond what sched_setaffinity can name");
        }
        // SAFETY: c < CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("sched_setaffinity to CPUs {}", format_list(cpus)));
    }
    Ok(())
}

/// The CPUs for inference: `given` (`--cpus`), which must be online and allowed, else the big
/// cores of `sys_cpu`'s online CPUs within this process's affinity. Not applied.
pub fn select(sys_cpu: &Path, given: Option<&str>) -> Result<Selection> {
    let allowed = affinity().ok();
    let cpus = read_cpus(sys_cpu, allowed.as_deref())?;
    if cpus.is_empty() {
        bail!(
            "no online CPU under {} is in this process's affinity mask",
            sys_cpu.display()
        );
    }
    match given {
        Some(list) => {
            let want = parse_list(list).context("--cpus")?;
            let bad: Vec<usize> = want
                .iter()
                .copied()
                .filter(|w| !cpus.iter().any(|c| c.id == *w))
                .collect();
            if !bad.is_empty() {
                bail!(
                    "--cpus {list}: CPU(s) {} are not online or not allowed to this process \
                     (usable: {})",
                    format_list(&bad),
                    format_list(&cpus.iter().map(|c| c.id).collect::<Vec<_>>())
                );
            }
            Ok(Selection {
                cpus: want,
                basis: Basis::Given,
                left_out: vec![],
                range: None,
            })
        }
        None => Ok(big_cores(&cpus)),
    }
}

/// [`select`] then [`apply`] on the calling thread, for the commands that run a model.
pub fn select_and_apply(given: Option<&str>) -> Result<Selection> {
    let sel = select(Path::new("/sys/devices/system/cpu"), given)?;
    apply(&sel.cpus)?;
    Ok(sel)
}

/// The CPUs that `threads` parts of a pool call ran on, measured with `sched_getcpu` in each part
/// (several times, with some work between, so a thread the scheduler moves is seen moving).
pub fn ran_on(threads: usize) -> Vec<usize> {
    use std::sync::Mutex;
    let seen = Mutex::new(BTreeSet::new());
    for _ in 0..4 {
        crate::pool::run_parts(vec![(); threads.max(1)], |_, ()| {
            let mut acc = 0u64;
            for i in 0..20_000u64 {
                acc = acc.wrapping_mul(6364136223846793005).wrapping_add(i);
            }
            std::hint::black_box(acc);
            // SAFETY: sched_getcpu has no preconditions.
            let c = unsafe { libc::sched_getcpu() };
            if c >= 0 {
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(c as usize);
            }
        });
    }
    seen.into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/sys/devices/system/cpu`: `(id, capacity, max kHz)`, `None` = no file.
    fn tree(online: &str, cpus: &[(usize, Option<u64>, Option<u64>)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("online"), format!("{online}\n")).expect("online");
        for &(id, cap, khz) in cpus {
            let c = d.path().join(format!("cpu{id}"));
            std::fs::create_dir_all(c.join("cpufreq")).expect("cpu dir");
            if let Some(v) = cap {
                std::fs::write(c.join("cpu_capacity"), format!("{v}\n")).expect("capacity");
            }
            if let Some(v) = khz {
                std::fs::write(c.join("cpufreq/cpuinfo_max_freq"), format!("{v}\n")).expect("freq");
            }
        }
        d
    }

    /// An RK3588: cpu0-3 A55, cpu4-5 and cpu6-7 two A76 clusters. Capacities as the kernel
    /// derives them from the DT's capacity-dmips-mhz (530 and 1024) scaled by the maximum
    /// frequencies (1.8 and 2.4 GHz, or 2.256 GHz for a binned cluster); not read off a board.
    fn rk3588(cap: bool, binned: bool) -> Vec<(usize, Option<u64>, Option<u64>)> {
        let a76_khz = |c: usize| {
            if binned && c < 6 {
                2_256_000
            } else {
                2_400_000
            }
        };
        (0..8)
            .map(|c| {
                if c < 4 {
                    (c, cap.then_some(397), Some(1_800_000))
                } else {
                    let capv = if binned && c < 6 { 963 } else { 1024 };
                    (c, cap.then_some(capv), Some(a76_khz(c)))
                }
            })
            .collect()
    }

    fn big(online: &str, cpus: &[(usize, Option<u64>, Option<u64>)]) -> Selection {
        let d = tree(online, cpus);
        big_cores(&read_cpus(d.path(), None).expect("read"))
    }

    #[test]
    fn rk3588_runs_inference_on_its_four_a76() {
        for (cap, binned) in [(true, false), (true, true), (false, false), (false, true)] {
            let s = big("0-7", &rk3588(cap, binned));
            assert_eq!(s.cpus, vec![4, 5, 6, 7], "capacity {cap}, binned {binned}");
            let ids: Vec<usize> = s.left_out.iter().map(|c| c.0).collect();
            assert_eq!(ids, vec![0, 1, 2, 3]);
            assert_eq!(s.basis, if cap { Basis::Capacity } else { Basis::MaxFreq });
        }
        let s = big("0-7", &rk3588(true, false));
        assert_eq!(
            s.describe(),
            "inference cpus 4-7 (big cores by cpu_capacity 1024; cpus 0-3 at 397 left out)"
        );
        let s = big("0-7", &rk3588(false, true));
        assert_eq!(
            s.describe(),
            "inference cpus 4-7 (big cores by cpuinfo_max_freq 2.26 GHz-2.40 GHz; cpus 0-3 at \
             1.80 GHz left out)"
        );
        // A kernel whose DT gives every core capacity 1024 still tells them apart by frequency.
        let mut same_cap = rk3588(false, false);
        for c in &mut same_cap {
            c.1 = Some(1024);
        }
        assert_eq!(big("0-7", &same_cap).cpus, vec![4, 5, 6, 7]);
        // Offline CPUs are not considered: with the A76 cluster 6-7 offline, 4-5 remain.
        assert_eq!(big("0-5", &rk3588(true, false)).cpus, vec![4, 5]);
    }

    #[test]
    fn cpus_that_are_all_alike_are_all_used() {
        // QEMU virt: capacities all 1024, no cpufreq.
        let s = big("0-1", &[(0, Some(1024), None), (1, Some(1024), None)]);
        assert_eq!((s.cpus, s.basis), (vec![0, 1], Basis::AllAlike));
        // An x86 host: no capacity, turbo-favoured cores a little faster: all are big.
        let s = big(
            "0-3",
            &[
                (0, None, Some(4_900_000)),
                (1, None, Some(4_700_000)),
                (2, None, Some(4_900_000)),
                (3, None, Some(4_700_000)),
            ],
        );
        assert_eq!(s.cpus, vec![0, 1, 2, 3]);
        // Nothing in sysfs at all.
        let s = big("0-2", &[]);
        assert_eq!((s.cpus, s.basis), (vec![0, 1, 2], Basis::AllAlike));
        // Fault: a hybrid x86 (P-cores 5.0 GHz, E-cores 3.8 GHz = 0.76) leaves the E-cores out.
        let s = big(
            "0-3",
            &[
                (0, None, Some(5_000_000)),
                (1, None, Some(5_000_000)),
                (2, None, Some(3_800_000)),
                (3, None, Some(3_800_000)),
            ],
        );
        assert_eq!(s.cpus, vec![0, 1]);
    }

    #[test]
    fn cpu_lists_parse_and_print_as_the_kernel_writes_them() {
        assert_eq!(parse_list("0-3,6\n").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_list("4").unwrap(), vec![4]);
        assert_eq!(format_list(&[6, 0, 1, 2, 3]), "0-3,6");
        assert_eq!(format_list(&[0, 2, 4, 5]), "0,2,4-5");
        for bad in ["", "a", "3-1", "1-", "0-99999999"] {
            assert!(parse_list(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn given_cpus_must_be_online_and_allowed() {
        let d = tree("0-1", &[(0, None, None), (1, None, None)]);
        let s = select(d.path(), Some("1")).expect("cpu 1 is online");
        assert_eq!((s.cpus, s.basis), (vec![1], Basis::Given));
        let e = select(d.path(), Some("1-2")).unwrap_err();
        assert!(
            format!("{e:#}").contains("CPU(s) 2 are not online"),
            "{e:#}"
        );
        assert!(select(d.path(), Some("x")).is_err());
    }

    /// Applied to a thread, the selection is where the pool's threads run, measured.
    #[test]
    fn pool_threads_run_where_the_selection_says() {
        let mine = affinity().expect("affinity");
        let cpu = *mine.last().expect("some CPU");
        std::thread::spawn(move || {
            apply(&[cpu]).expect("apply");
            assert_eq!(affinity().expect("affinity"), vec![cpu]);
            assert_eq!(
                std::thread::available_parallelism().map(|n| n.get()).ok(),
                Some(1)
            );
            // Threads started from here inherit it (scoped threads: the shared pool of the
            // test process may have been started elsewhere).
            let seen = std::thread::scope(|s| {
                s.spawn(|| {
                    // SAFETY: no preconditions.
                    unsafe { libc::sched_getcpu() }
                })
                .join()
                .expect("join")
            });
            assert_eq!(seen, cpu as i32);
        })
        .join()
        .expect("thread");
    }
}
