//! `cpu.features` and `cpu.governors`.

use super::{Ctx, Outcome};
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
    if let Some(k) = cpu_kernel {
        ev.push(format!("CPU backend selected kernel: {k}"));
    }
    if want.is_empty() {
        return Outcome::fail("the board file lists no cpu_features", ev);
    }
    if missing.is_empty() {
        Outcome::pass(ev)
    } else {
        Outcome::fail(format!("missing CPU features: {}", missing.join(" ")), ev)
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
    match (&board.expect.governors, policies.is_empty()) {
        (None, _) => ev.push("board pins no cpufreq governor".to_string()),
        (Some(_), true) => ev.push("no cpufreq policies on this machine".to_string()),
        (Some(want), false) => {
            for p in &policies {
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                match read_trim(&p.join("scaling_governor")) {
                    Ok(g) if &g == want => ev.push(format!("{name}: {g}")),
                    Ok(g) => bad.push(format!("{name}: {g}, want {want}")),
                    Err(e) => bad.push(e),
                }
                checked += 1;
            }
        }
    }
    match (&board.expect.ddr_governor, ddr.is_empty()) {
        (None, _) => ev.push("board pins no DDR governor".to_string()),
        (Some(_), true) => ev.push("no DDR devfreq (dmc) on this machine".to_string()),
        (Some(want), false) => {
            for d in &ddr {
                let name = d.file_name().unwrap_or_default().to_string_lossy();
                match read_trim(&d.join("governor")) {
                    Ok(g) if &g == want => ev.push(format!("DDR {name}: {g}")),
                    Ok(g) => bad.push(format!("DDR {name}: {g}, want {want}")),
                    Err(e) => bad.push(e),
                }
                checked += 1;
            }
        }
    }
    if !bad.is_empty() {
        let reason = format!("{} governor(s) not as pinned", bad.len());
        bad.extend(ev);
        return Outcome::fail(reason, bad);
    }
    if checked == 0 {
        let mut o = Outcome::skip(format!(
            "{} has no cpufreq policies and no DDR devfreq",
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
    fn governors_skip_with_a_reason_where_there_are_none() {
        let root = FakeRoot::new();
        root.file("sys/devices/system/cpu/online", "0-1\n");
        let o = governors(&ctx(&root));
        assert_eq!(o.status, Status::Skip, "{o:?}");
        assert!(o.reason.unwrap().contains("no cpufreq"));
    }

    #[test]
    fn features_need_every_pinned_flag() {
        let root = FakeRoot::new();
        let line = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n";
        root.file("proc/cpuinfo", line);
        let o = features(&ctx(&root), Some("neon-dotprod"));
        assert_eq!(o.status, Status::Pass, "{o:?}");
        assert!(o.evidence.iter().any(|e| e.contains("neon-dotprod")));
        // A cortex-a72 has no dotprod.
        root.file("proc/cpuinfo", line.replace(" asimddp", ""));
        let o = features(&ctx(&root), None);
        assert_eq!(o.status, Status::Fail, "{o:?}");
        assert!(o.reason.unwrap().contains("asimddp"));
    }
}
