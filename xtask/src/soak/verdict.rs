//! The soak's verdict: after the warm-up, resident memory and descriptors stay flat, the server is
//! back to its idle baseline once the clients are gone, and every request got its answer.
//! A pure function of the samples and counts, so that a growing series can be shown to fail.

use serde::Serialize;

/// The server's state at one moment: what `/proc/PID` and `/metrics` say.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Proc {
    /// VmRSS.
    pub rss_kib: u64,
    /// RssAnon: the heap and the KV caches, without the model's file-backed pages.
    pub anon_kib: u64,
    /// Entries of /proc/PID/fd.
    pub fds: u64,
    pub threads: u64,
    /// `kiln_active_sequences`, `kiln_queue_depth`.
    pub active: u64,
    pub queue: u64,
}

/// How many requests ended how, over the whole run.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Counts {
    pub valid_ok: u64,
    /// Valid requests answered 429 (queue full).
    pub busy: u64,
    pub valid_failed: u64,
    pub invalid_ok: u64,
    pub invalid_failed: u64,
    pub vanished: u64,
    pub vanishing_failed: u64,
}

/// The bound on resident memory growth after the warm-up: the larger of a fraction of the first
/// post-warm-up sample and an absolute slack (allocator arenas settle by a few MiB).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Bound {
    pub rss_pct: f64,
    pub rss_mib: f64,
}

pub struct Inputs<'a> {
    /// (seconds since the start, state) under load, in time order.
    pub samples: &'a [(f64, Proc)],
    /// Samples before this many seconds are the warm-up.
    pub warmup_s: f64,
    pub idle_before: Proc,
    pub idle_after: Proc,
    pub counts: Counts,
    /// Clients above `--parallel` + `--queue`: 429 is then a correct answer.
    pub busy_allowed: bool,
    pub clients: usize,
    pub bound: Bound,
    /// The server still ran (and answered /health) at the end.
    pub alive: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

pub fn verdict(i: &Inputs) -> Vec<Check> {
    let mut out = Vec::new();
    let mut check = |name, ok, detail: String| out.push(Check { name, ok, detail });
    let post: Vec<&Proc> = i
        .samples
        .iter()
        .filter(|(t, _)| *t >= i.warmup_s)
        .map(|(_, p)| p)
        .collect();
    match (post.first(), post.last()) {
        (Some(first), Some(last)) if post.len() >= 2 => {
            let allowed = (mib(first.rss_kib) * i.bound.rss_pct / 100.0).max(i.bound.rss_mib);
            let grew = mib(last.rss_kib) - mib(first.rss_kib);
            check(
                "rss-flat",
                grew <= allowed,
                format!(
                    "VmRSS {:.1} MiB after the warm-up, {:.1} MiB at the end: {grew:+.1} MiB \
                     (bound +{allowed:.1} MiB: {}% or {} MiB); RssAnon {:.1} -> {:.1} MiB",
                    mib(first.rss_kib),
                    mib(last.rss_kib),
                    i.bound.rss_pct,
                    i.bound.rss_mib,
                    mib(first.anon_kib),
                    mib(last.anon_kib),
                ),
            );
            let max_fds = post.iter().map(|p| p.fds).max().unwrap_or(0);
            let fd_bound = i.idle_before.fds + 2 * i.clients as u64 + 16;
            check(
                "fds-bounded",
                max_fds <= fd_bound,
                format!(
                    "at most {max_fds} descriptors under load after the warm-up (bound \
                     {fd_bound}: idle {} + 2 x {} clients + 16)",
                    i.idle_before.fds, i.clients
                ),
            );
        }
        _ => check(
            "rss-flat",
            false,
            format!(
                "{} sample(s) after the warm-up: too few to judge (run longer)",
                post.len()
            ),
        ),
    }
    let (b, a) = (i.idle_before, i.idle_after);
    check(
        "fds-baseline",
        a.fds <= b.fds,
        format!("{} descriptors idle before, {} idle after", b.fds, a.fds),
    );
    check(
        "threads-baseline",
        a.threads <= b.threads,
        format!(
            "{} threads idle before, {} idle after",
            b.threads, a.threads
        ),
    );
    check(
        "engine-idle",
        a.active == 0 && a.queue == 0,
        format!(
            "idle after: {} active sequence(s), {} queued request(s)",
            a.active, a.queue
        ),
    );
    let c = i.counts;
    check(
        "valid-answered",
        c.valid_failed == 0 && c.valid_ok > 0,
        format!(
            "{} valid request(s) answered, {} not (or answered wrongly)",
            c.valid_ok, c.valid_failed
        ),
    );
    check(
        "no-429",
        c.busy == 0 || i.busy_allowed,
        if i.busy_allowed {
            format!(
                "{} valid request(s) got 429: allowed, the clients exceed --parallel + --queue",
                c.busy
            )
        } else {
            format!(
                "{} valid request(s) got 429 with clients <= --parallel + --queue",
                c.busy
            )
        },
    );
    check(
        "invalid-refused",
        c.invalid_failed == 0,
        format!(
            "{} invalid request(s) got their status, {} did not",
            c.invalid_ok, c.invalid_failed
        ),
    );
    check(
        "vanishing",
        c.vanishing_failed == 0,
        format!(
            "{} client(s) left mid-request, {} could not even start",
            c.vanished, c.vanishing_failed
        ),
    );
    check(
        "alive",
        i.alive,
        if i.alive {
            "the server answered /health 200 at the end".into()
        } else {
            "the server exited or stopped answering /health".into()
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(rss_mib: f64, fds: u64) -> Proc {
        Proc {
            rss_kib: (rss_mib * 1024.0) as u64,
            anon_kib: (rss_mib * 512.0) as u64,
            fds,
            threads: 5,
            active: 0,
            queue: 0,
        }
    }

    fn judge(series: &[(f64, Proc)], counts: Counts, after: Proc) -> Vec<Check> {
        verdict(&Inputs {
            samples: series,
            warmup_s: 60.0,
            idle_before: p(200.0, 12),
            idle_after: after,
            counts,
            busy_allowed: false,
            clients: 8,
            bound: Bound {
                rss_pct: 5.0,
                rss_mib: 4.0,
            },
            alive: true,
        })
    }

    fn failed(v: &[Check]) -> Vec<&'static str> {
        v.iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    fn good() -> Counts {
        Counts {
            valid_ok: 100,
            invalid_ok: 40,
            vanished: 20,
            ..Counts::default()
        }
    }

    /// 300 s sampled every 5 s; RSS at `f(t)`, a warm-up that climbs by 40 MiB first.
    fn series(f: impl Fn(f64) -> f64) -> Vec<(f64, Proc)> {
        (0..60)
            .map(|k| {
                let t = k as f64 * 5.0;
                let warm = if t < 60.0 { t / 60.0 * 40.0 } else { 40.0 };
                (t, p(200.0 + warm + f(t), 20 + (k % 7)))
            })
            .collect()
    }

    #[test]
    fn flat_after_warm_up_passes() {
        // ±1.5 MiB of noise after a 40 MiB warm-up.
        let s = series(|t| ((t / 5.0) as i64 % 3 - 1) as f64 * 1.5);
        let v = judge(&s, good(), p(240.0, 12));
        assert!(failed(&v).is_empty(), "{v:#?}");
    }

    #[test]
    fn growing_rss_fails() {
        // 1 MiB a minute is 4 MiB over the 4 minutes after the warm-up: under 5 % of 240 MiB
        // (12 MiB), so it passes; 4 MiB a minute (16 MiB) must not.
        let slow = series(|t| (t - 60.0).max(0.0) / 60.0);
        assert!(failed(&judge(&slow, good(), p(240.0, 12))).is_empty());
        let leak = series(|t| (t - 60.0).max(0.0) / 60.0 * 4.0);
        let v = judge(&leak, good(), p(260.0, 12));
        assert_eq!(failed(&v), ["rss-flat"], "{v:#?}");
        let detail = &v.iter().find(|c| c.name == "rss-flat").expect("rss").detail;
        assert!(
            detail.contains("+15.") || detail.contains("+16."),
            "{detail}"
        );
    }

    #[test]
    fn descriptors_must_return_to_baseline_and_stay_bounded() {
        let s = series(|_| 0.0);
        assert_eq!(
            failed(&judge(&s, good(), p(240.0, 13))),
            ["fds-baseline"],
            "one descriptor more when idle is a leak"
        );
        let mut leak = s.clone();
        for (k, (_, q)) in leak.iter_mut().enumerate() {
            q.fds += k as u64;
        }
        assert_eq!(failed(&judge(&leak, good(), p(240.0, 12))), ["fds-bounded"]);
    }

    #[test]
    fn every_valid_request_must_be_answered() {
        let s = series(|_| 0.0);
        let mut c = good();
        c.valid_failed = 1;
        assert_eq!(failed(&judge(&s, c, p(240.0, 12))), ["valid-answered"]);
        let mut c = good();
        c.busy = 3;
        assert_eq!(failed(&judge(&s, c, p(240.0, 12))), ["no-429"]);
        let mut c = good();
        c.invalid_failed = 1;
        assert_eq!(failed(&judge(&s, c, p(240.0, 12))), ["invalid-refused"]);
        let mut stuck = p(240.0, 12);
        stuck.active = 1;
        assert_eq!(failed(&judge(&s, good(), stuck)), ["engine-idle"]);
    }

    #[test]
    fn a_run_too_short_to_judge_fails() {
        let s = series(|_| 0.0);
        let v = judge(&s[..13], good(), p(240.0, 12));
        assert_eq!(failed(&v), ["rss-flat"]);
    }
}
