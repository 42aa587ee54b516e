//! `cpu.features` and `cpu.governors`.

use super::{Ctx, Outcome, Status};
use std::collections::BTreeSet;
use std::path::Path;

/// The feature names of the first `Features` (aarch64) or `flags` (x86) line of `/proc/cpuinfo`.
pub fn cpuinfo_features(proc: &Path) -> Result<BTreeSet<String>, String> {
    let p = proc.join("cpuinfo");
    let text = std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k.trim(), "Features" | "flags")
                .then(|| v.split_whitespace().map(str::to_string).collect())
        })
        .ok_or_else(|| format!("{} has no Features line", p.display()))
}

/// `cpu_kernel` is what the CPU backend reports it selected (e.g. `neon-dotprod`), if known.
pub fn features(ctx: &Ctx, cpu_kernel: Option<&str>) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let have = match cpuinfo_features(&ctx.paths.proc) {
        Ok(h) => h,
        Err(e) => return Outcome::fail(e, vec![]),
    };
    let want = &board.expect.cpu_features;
    let missing: Vec<&str> = want
        .iter()
        .filter(|f| !have.contains(f.as_str()))
        .map(String::as_str)
        .collect();
    let mut ev = vec![format!(
        "needed: {} ; present: {}",
        want.join(" "),
        want.iter()
            .filter(|f| have.contains(f.as_str()))
            .cloned()
            .collect::<Vec<_>>()
            .join(" ")
    )];
    // The kernel the features allow: sdot needs asimddp, NEON needs asimd (x86: portable).
    let allowed = if have.contains("asimddp") && have.contains("asimd") {
        "neon+sdot"
    } else if have.contains("asimd") {
        "neon"
    } else {
        "portable"
    };
    let mut wrong_kernel = None;
    match cpu_kernel {
        Some(k) if k == allowed => ev.push(format!(
            "CPU backend selected kernel: {k} (the one these features allow)"
        )),
        Some(k) => {
            wrong_kernel = Some(format!(
                "CPU backend selected kernel {k}, but these features allow {allowed}"
            ));
            ev.push(format!("CPU backend selected kernel: {k}"));
        }
        None => {
            wrong_kernel = Some("the CPU backend's selected kernel is unknown".to_string());
        }
    }
    if want.is_empty() {
        return Outcome::fail("the board file lists no cpu_features", ev);
    }
    if let Some(why) = wrong_kernel {
        return Outcome::fail(why, ev);
    }
    if missing.is_empty() {
        Outcome::pass(ev)
    } else {
        Outcome::fail(format!("missing CPU features: {}", missing.join(" ")), ev)
    }
}

/// `cpu.features`, continued: the CPUs inference runs on (`cores`: the selection applied to this
/// process, see [`crate::cpus`]) and where the matmul pool's threads were measured to run
/// (`ran`, [`crate::cpus::ran_on`]). A selection that could not be made or applied, or a thread
/// seen outside it, fails the check.
pub fn with_cores(
    o: Outcome,
    cores: &Result<crate::cpus::Selection, String>,
    ran: &[usize],
) -> Outcome {
    // A failure here is added to the check's own (whose reason stays first).
    let fail = |o: Outcome, why: String, ev: Vec<String>| match o.status {
        Status::Fail => o.with_evidence(ev),
        _ => Outcome::fail(why, o.evidence).with_evidence(ev),
    };
    let sel = match cores {
        Ok(s) => s,
        Err(e) => {
            let why = format!("could not choose the inference CPUs: {e}");
            return fail(o, why.clone(), vec![why]);
        }
    };
    let ev = vec![
        sel.describe(),
        format!(
            "matmul pool threads measured on cpus {} (sched_getcpu in each part)",
            crate::cpus::format_list(ran)
        ),
    ];
    let outside: Vec<usize> = ran
        .iter()
        .copied()
        .filter(|c| !sel.cpus.contains(c))
        .collect();
    if ran.is_empty() {
        fail(o, "no CPU was seen running the matmul pool".into(), ev)
    } else if !outside.is_empty() {
        let why = format!(
            "matmul pool threads ran on cpus {} outside the inference cpus {}",
            crate::cpus::format_list(&outside),
            crate::cpus::format_list(&sel.cpus)
        );
        fail(o, why, ev)
    } else {
        o.with_evidence(ev)
    }
}

#[cfg(test)]
mod cores_tests {
    use super::*;
    use crate::cpus::{Basis, Selection};

    #[test]
    fn the_cores_line_is_measured_and_fails_outside_the_selection() {
        let sel = Ok(Selection {
            cpus: vec![4, 5, 6, 7],
            basis: Basis::Capacity,
            left_out: vec![
                (0, Some(397)),
                (1, Some(397)),
                (2, Some(397)),
                (3, Some(397)),
            ],
            range: Some((1024, 1024)),
        });
        let o = with_cores(Outcome::pass(vec!["features".into()]), &sel, &[4, 6]);
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.evidence[1].starts_with("inference cpus 4-7 (big cores by cpu_capacity"));
        assert!(o.evidence[2].contains("measured on cpus 4,6"));
        // Faults: a thread seen on a little core; nothing seen; no selection.
        let o = with_cores(Outcome::pass(vec![]), &sel, &[1, 4]);
        assert_eq!(o.status, Status::Fail);
        assert!(o
            .reason
            .unwrap()
            .contains("ran on cpus 1 outside the inference cpus 4-7"));
        assert_eq!(
            with_cores(Outcome::pass(vec![]), &sel, &[]).status,
            Status::Fail
        );
        let o = with_cores(Outcome::pass(vec![]), &Err("no online file".into()), &[0]);
        assert_eq!(o.status, Status::Fail);
        // The features' own failure keeps its reason.
        let o = with_cores(Outcome::fail("missing CPU features: x", vec![]), &sel, &[1]);
        assert_eq!(o.reason.as_deref(), Some("missing CPU features: x"));
    }
}

fn read_trim(p: &Path) -> Result<String, String> {
    std::fs::read_to_string(p)
        .map(|s| s.trim().to_string())
        .map_err(|e| format!("reading {}: {e}", p.display()))
}

/// Sorted entries of `dir` whose name passes `keep`; none if the folder is missing.
fn entries(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| keep(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

pub fn governors(ctx: &Ctx) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let sys = &ctx.paths.sys;
    let policies = entries(&sys.join("devices/system/cpu/cpufreq"), |n| {
        n.starts_with("policy")
    });
    // The DDR controller's devfreq node is named after `dmc` on Rockchip.
    let ddr = entries(&sys.join("class/devfreq"), |n| n.contains("dmc"));
    let mut ev = Vec::new();
    let mut bad = Vec::new();
    let mut checked = 0;
    let e = &board.expect;
    let cpu_pinned = e.governors.is_some() || !e.cpu_khz.is_empty();
    let ddr_pinned = e.ddr_governor.is_some() || e.ddr_hz.is_some();
    // A pinned expectation this machine cannot show is a failure, not a skip.
    if cpu_pinned && policies.is_empty() {
        bad.push("cpufreq governor/rate pinned but not measurable: no cpufreq policy".into());
    }
    if ddr_pinned && ddr.is_empty() {
        bad.push("DDR governor/rate pinned but not measurable: no DDR devfreq (dmc)".into());
    }
    if !cpu_pinned {
        ev.push("board pins no cpufreq governor or rate".to_string());
    }
    if !ddr_pinned {
        ev.push("board pins no DDR governor or rate".to_string());
    }
    for p in policies.iter().filter(|_| cpu_pinned) {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        if let Some(want) = &e.governors {
            match read_trim(&p.join("scaling_governor")) {
                Ok(g) if &g == want => ev.push(format!("{name}: {g}")),
                Ok(g) => bad.push(format!("{name}: {g}, want {want}")),
                Err(e) => bad.push(e),
            }
        }
        if let Some(want) = e.cpu_khz.get(name.as_ref()) {
            match read_trim(&p.join("scaling_cur_freq")).map(|f| f.parse::<u64>()) {
                Ok(Ok(f)) if f == *want => ev.push(format!("{name}: {f} kHz (pinned)")),
                Ok(Ok(f)) => bad.push(format!("{name}: {f} kHz, pinned {want} kHz")),
                Ok(Err(err)) => bad.push(format!("{name}: scaling_cur_freq: {err}")),
                Err(err) => bad.push(err),
            }
        }
        checked += 1;
    }
    if !e.cpu_khz.is_empty() {
        for want in e.cpu_khz.keys() {
            if !policies.is_empty() && !policies.iter().any(|p| p.ends_with(want)) {
                bad.push(format!("{want}: pinned rate, but no such cpufreq policy"));
            }
        }
    }
    for d in ddr.iter().filter(|_| ddr_pinned) {
        let name = d.file_name().unwrap_or_default().to_string_lossy();
        if let Some(want) = &e.ddr_governor {
            match read_trim(&d.join("governor")) {
                Ok(g) if &g == want => ev.push(format!("DDR {name}: {g}")),
                Ok(g) => bad.push(format!("DDR {name}: {g}, want {want}")),
                Err(e) => bad.push(e),
            }
        }
        if let Some(want) = e.ddr_hz {
            match read_trim(&d.join("cur_freq")).map(|f| f.parse::<u64>()) {
                Ok(Ok(f)) if f == want => ev.push(format!("DDR {name}: {f} Hz (pinned)")),
                Ok(Ok(f)) => bad.push(format!("DDR {name}: {f} Hz, pinned {want} Hz")),
                Ok(Err(err)) => bad.push(format!("DDR {name}: cur_freq: {err}")),
                Err(err) => bad.push(err),
            }
        }
        checked += 1;
    }
    if !bad.is_empty() {
        let reason = bad.join("; ");
        bad.extend(ev);
        return Outcome::fail(reason, bad);
    }
    if checked == 0 {
        let mut o = Outcome::skip(format!(
            "{} pins no governor or rate (and has no cpufreq policies and no DDR devfreq)",
            board.board.name
        ));
        o.evidence = ev;
        return o;
    }
    Outcome::pass(ev)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::FakeRoot;
    use super::super::{board::Board, Ctx, Paths, Status};
    use super::*;

    const ROCK5B: &str = r#"
[board]
name = "rock-5b"
npu = true
[expect]
kernel_release = "6.1.115-vendor-rk35xx"
cpu_features = ["asimd", "asimddp", "fphp"]
governors = "performance"
ddr_governor = "performance"
npu_driver = "0.9.8"
"#;

    fn ctx(root: &FakeRoot) -> Ctx {
        Ctx {
            paths: Paths::under(root),
            board: Some(Board::parse(ROCK5B).unwrap()),
            ..Ctx::default()
        }
    }

    fn rk3588_sysfs(root: &FakeRoot) {
        for p in ["policy0", "policy4", "policy6"] {
            root.file(
                &format!("sys/devices/system/cpu/cpufreq/{p}/scaling_governor"),
                "performance\n",
            );
        }
        root.file("sys/class/devfreq/dmc/governor", "performance\n");
        root.file(
            "sys/class/devfreq/fdab0000.npu/governor",
            "rknpu_ondemand\n",
        );
    }

    #[test]
    fn governors_pass_then_a_mismatch_fails() {
        let root = FakeRoot::new();
        rk3588_sysfs(&root);
        let o = governors(&ctx(&root));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert_eq!(o.evidence.len(), 4, "{o:?}");
        // Fault: one cluster left on schedutil.
        root.file(
            "sys/devices/system/cpu/cpufreq/policy4/scaling_governor",
            "schedutil\n",
        );
        let o = governors(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.evidence[0].contains("policy4: schedutil"), "{o:?}");
        // Fault: DDR governor wrong.
        rk3588_sysfs(&root);
        root.file("sys/class/devfreq/dmc/governor", "dmc_ondemand\n");
        assert_eq!(governors(&ctx(&root)).status, Status::Fail);
    }

    #[test]
    fn pinned_but_not_measurable_fails_and_unpinned_skips() {
        let root = FakeRoot::new();
        root.file("sys/devices/system/cpu/online", "0-1\n");
        let o = governors(&ctx(&root));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("pinned but not measurable"));
        let unpinned = Ctx {
            board: Some(Board::parse("[board]\nname = \"qemu-virt\"\n").unwrap()),
            ..ctx(&root)
        };
        let o = governors(&unpinned);
        assert_eq!(o.status, Status::Skip, "{o:?}");
        assert!(o.reason.unwrap().contains("pins no governor"));
    }

    #[test]
    fn frequencies_are_checked_against_their_pins() {
        let root = FakeRoot::new();
        rk3588_sysfs(&root);
        let pinned = format!(
            "{ROCK5B}ddr_hz = 2112000000\n[expect.cpu_khz]\npolicy0 = 1800000\npolicy4 = 2400000\npolicy6 = 2400000\n"
        );
        let c = Ctx {
            board: Some(Board::parse(&pinned).unwrap()),
            ..ctx(&root)
        };
        for (p, f) in [
            ("policy0", "1800000"),
            ("policy4", "2400000"),
            ("policy6", "2400000"),
        ] {
            root.file(
                &format!("sys/devices/system/cpu/cpufreq/{p}/scaling_cur_freq"),
                f,
            );
        }
        root.file("sys/class/devfreq/dmc/cur_freq", "2112000000\n");
        let o = governors(&c);
        assert_eq!(o.status, Status::Pass, "{o:?}");
        // Fault: DDR at a third of the pinned rate, as users of slow boards report.
        root.file("sys/class/devfreq/dmc/cur_freq", "528000000\n");
        let o = governors(&c);
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o
            .reason
            .unwrap()
            .contains("528000000 Hz, pinned 2112000000"));
        // Fault: an A76 cluster throttled.
        root.file("sys/class/devfreq/dmc/cur_freq", "2112000000\n");
        root.file(
            "sys/devices/system/cpu/cpufreq/policy6/scaling_cur_freq",
            "1200000",
        );
        let o = governors(&c);
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("policy6: 1200000 kHz"));
    }

    #[test]
    fn features_need_every_pinned_flag() {
        let root = FakeRoot::new();
        let line = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n";
        root.file("proc/cpuinfo", line);
        let o = features(&ctx(&root), Some("neon+sdot"));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.evidence.iter().any(|e| e.contains("neon+sdot")));
        // Fault: the backend fell back to a slower kernel than the features allow.
        let o = features(&ctx(&root), Some("portable"));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("allow neon+sdot"));
        // A cortex-a72 has no dotprod.
        root.file("proc/cpuinfo", line.replace(" asimddp", ""));
        let o = features(&ctx(&root), Some("neon"));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("asimddp"));
    }
}

/// `memory.bandwidth`: sequential read bandwidth over a buffer well past the caches, for at most
/// [`BANDWIDTH_BUDGET_S`], against the board's pinned minimum (`memory_read_gbs`). A board that
/// pins none gets a SKIP that still reports the figure.
pub const BANDWIDTH_BUDGET_S: f64 = 0.1;

/// GB/s read over `buf`, repeated until `budget_s` is spent (at least one pass).
pub fn read_bandwidth(buf: &[u64], budget_s: f64) -> (f64, usize) {
    let t = std::time::Instant::now();
    let mut passes = 0;
    let mut acc = 0u64;
    loop {
        // Four independent sums keep the loop memory-bound rather than add-latency-bound.
        let (mut a, mut b, mut c, mut d) = (0u64, 0u64, 0u64, 0u64);
        for q in buf.chunks_exact(4) {
            a = a.wrapping_add(q[0]);
            b = b.wrapping_add(q[1]);
            c = c.wrapping_add(q[2]);
            d = d.wrapping_add(q[3]);
        }
        acc = acc.wrapping_add(a ^ b ^ c ^ d);
        passes += 1;
        if t.elapsed().as_secs_f64() * (passes + 1) as f64 / passes as f64 > budget_s {
            break;
        }
    }
    std::hint::black_box(acc);
    let bytes = (buf.len() * 8 * passes) as f64;
    (bytes / t.elapsed().as_secs_f64() / 1e9, passes)
}

pub fn bandwidth(ctx: &Ctx) -> Outcome {
    let board = match ctx.board() {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    // 16 MiB: five times the RK3588's L3 (3 MiB; L2 is 512 KiB per core), written once before
    // timing so page faults are not measured. Not more: under QEMU's TCG every MiB mapped and
    // written costs about 14 ms of the boot (64 MiB took 0.9-1.1 s, half the self-check).
    let words = 2 << 20;
    let t = std::time::Instant::now();
    let mut map = match memmap2::MmapOptions::new()
        .len(words * 8)
        .populate()
        .map_anon()
    {
        Ok(m) => m,
        Err(e) => {
            return Outcome::fail(
                format!(
                    "could not map {} MiB to measure read bandwidth: {e}",
                    words >> 17
                ),
                vec![],
            )
        }
    };
    // An anonymous mapping is page-aligned, so its bytes are u64-aligned.
    let (_, buf, _) = unsafe { map.align_to_mut::<u64>() };
    if buf.len() != words {
        return Outcome::fail(
            format!("the {} MiB mapping is not u64-aligned", words >> 17),
            vec![],
        );
    }
    for (i, w) in buf.iter_mut().enumerate() {
        *w = i as u64;
    }
    let setup_ms = t.elapsed().as_secs_f64() * 1e3;
    let (gbs, passes) = read_bandwidth(buf, BANDWIDTH_BUDGET_S);
    let ev = vec![format!(
        "read {gbs:.2} GB/s ({passes} pass(es) over {} MiB, budget {BANDWIDTH_BUDGET_S} s; \
         buffer mapped and written in {setup_ms:.0} ms)",
        (words * 8) >> 20
    )];
    match board.expect.memory_read_gbs {
        None => {
            let mut o = Outcome::skip(format!(
                "board {} pins no minimum read bandwidth (measured {gbs:.2} GB/s)",
                board.board.name
            ));
            o.evidence = ev;
            o
        }
        Some(min) if gbs >= min => {
            Outcome::pass(ev).with_evidence(vec![format!("pinned minimum {min} GB/s")])
        }
        Some(min) => Outcome::fail(
            format!("read bandwidth {gbs:.2} GB/s is below the pinned minimum {min} GB/s"),
            ev,
        ),
    }
}

#[cfg(test)]
mod bandwidth_tests {
    use super::super::testutil::FakeRoot;
    use super::super::{board::Board, Ctx, Paths, Status};
    use super::*;

    #[test]
    fn bandwidth_is_measured_and_judged_against_the_pin() {
        let root = FakeRoot::new();
        let c = |extra: &str| Ctx {
            paths: Paths::under(&root),
            board: Some(
                Board::parse(&format!("[board]\nname = \"b\"\n[expect]\n{extra}")).unwrap(),
            ),
            ..Ctx::default()
        };
        let o = bandwidth(&c(""));
        assert_eq!(o.status, Status::Skip, "{o:?}");
        assert!(o.reason.unwrap().contains("measured"));
        assert!(o.evidence[0].contains("GB/s"));
        // Fault: a pin no machine reaches.
        let o = bandwidth(&c("memory_read_gbs = 1e9\n"));
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert_eq!(
            bandwidth(&c("memory_read_gbs = 1e-9\n")).status,
            Status::Pass
        );
    }
}
