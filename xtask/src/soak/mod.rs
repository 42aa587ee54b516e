//! `cargo xtask soak serve`: `kiln serve` under a seeded mix of clients for N minutes — valid
//! completions and chat completions (some streamed), invalid requests, clients that vanish
//! mid-request and slow ones, at and above `--parallel` — sampling the server's resident memory,
//! descriptors and threads and the clients' latency percentiles every window. The verdict
//! ([`verdict`]): flat after the warm-up, back to the idle baseline afterwards, every valid
//! request answered and every invalid one refused with its status. Not in CI: it takes minutes.

mod client;
mod verdict;

use anyhow::{bail, ensure, Context, Result};
use client::{Class, Kind, Outcome, Record, Rng, Target};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use verdict::{Bound, Counts, Proc};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand)]
pub enum What {
    /// `kiln serve` (host release build, SmolLM2, an API key) under a seeded mix of valid,
    /// invalid, streaming, slow and vanishing clients; RSS, descriptors, threads and latency
    /// percentiles per window; a verdict (exit 1 naming what failed). Samples under target/soak/.
    ///
    /// Not in CI: it takes minutes; run it by hand before a release (`nice` on a shared machine).
    /// The host release `kiln serve` on SmolLM2 (pinned, as the serve stage gets it) listens on a
    /// free loopback port with an API key and is driven for N minutes by C seeded clients (default
    /// twice `--parallel`): valid completions and chat completions (short `max_tokens`, some
    /// streamed as SSE, some written or read slowly), invalid ones (an unknown parameter → 400
    /// naming it, a wrong key → 401, a body announced over 1 MiB → 413, broken JSON → 400, a
    /// foreign `Host` → 403, a stalled body → 408) and vanishing ones (half a head, half a body, a
    /// stream dropped after its first event, connect-and-close); every answer is checked.
    ///
    /// Every window: kiln's VmRSS/RssAnon, open descriptors and threads (`/proc/PID`), `/metrics`'
    /// active sequences, queue and cancellations, and the valid requests' time to first byte and
    /// total time (p50/p95/p99) with counts per outcome, one line each. At the end the table over
    /// time and a verdict: after the warm-up (the first 20 %) VmRSS grows at most max(5 %, 4 MiB)
    /// (`--rss-slack-pct`, `--rss-slack-mib`), descriptors stay under idle + 2C + 16, and once the
    /// clients are gone descriptors, threads, active sequences and queue are back to the idle
    /// baseline (taken after one completion); every valid request is answered 200 and well-formed
    /// (429 counted apart, and a failure unless C > `--parallel` + `--queue`), every invalid one
    /// its status, and the server is alive. Samples in `target/soak/serve.csv` and `serve.json`
    /// (atomic); exit 1 naming the failed checks.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// How long the clients run (fractions allowed: `--minutes 0.5`).
    #[arg(long)]
    pub minutes: f64,
    /// `kiln serve --parallel`: sequences decoded at once.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Concurrent clients (default: 2 x --parallel).
    #[arg(long)]
    pub clients: Option<usize>,
    /// `kiln serve --queue`. With clients <= parallel + queue a valid request must never get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// The GGUF served (default: SmolLM2-135M Q4_1, pinned: `KILN_SMOLLM2` or the download cache,
    /// as the serve stage gets it).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Seed of the clients' mix, prompts and sampling parameters.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds between samples (one progress line each).
    #[arg(long, default_value_t = 10)]
    pub window: u64,
    /// `kiln serve --client-timeout` (the stalled-body clients wait this long for their 408).
    #[arg(long, default_value_t = 5)]
    pub client_timeout: u64,
    /// `kiln serve --threads` (0: kiln's default).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The allowed growth of VmRSS after the warm-up (first 20 % of the run), in percent of the
    /// first post-warm-up sample; the larger of this and --rss-slack-mib applies.
    #[arg(long, default_value_t = 5.0)]
    pub rss_slack_pct: f64,
    /// The allowed growth of VmRSS after the warm-up, in MiB (see --rss-slack-pct).
    #[arg(long, default_value_t = 4.0)]
    pub rss_slack_mib: f64,
}

pub fn run(a: Args) -> Result<()> {
    match a.what {
        What::Serve(s) => serve(&s),
    }
}

/// The first fraction of the run whose samples the verdict does not judge.
const WARMUP: f64 = 0.2;

/// One window's sample: the server's state at its end and what the clients saw during it.
#[derive(Clone, Debug, serde::Serialize)]
struct Sample {
    t_s: f64,
    proc: Proc,
    cancelled: u64,
    stats: Stats,
}

/// What the clients saw over some span: counts per outcome and the valid requests' latency
/// percentiles (ms).
#[derive(Clone, Debug, Default, serde::Serialize)]
struct Stats {
    counts: Counts,
    ttfb_ms: [f64; 3],
    total_ms: [f64; 3],
}

fn stats<'a>(records: impl Iterator<Item = &'a Record>) -> Stats {
    let mut c = Counts::default();
    let (mut ttfb, mut total) = (Vec::new(), Vec::new());
    for r in records {
        match (r.kind.class(), &r.outcome) {
            (Class::Valid, Outcome::Ok) => {
                c.valid_ok += 1;
                ttfb.push(r.ttfb.unwrap_or(r.total).as_secs_f64() * 1e3);
                total.push(r.total.as_secs_f64() * 1e3);
            }
            (_, Outcome::Busy) => c.busy += 1,
            (Class::Valid, Outcome::Failed(_)) => c.valid_failed += 1,
            (Class::Invalid, Outcome::Ok) => c.invalid_ok += 1,
            (Class::Invalid, Outcome::Failed(_)) => c.invalid_failed += 1,
            (Class::Vanishing, Outcome::Ok) => c.vanished += 1,
            (Class::Vanishing, Outcome::Failed(_)) => c.vanishing_failed += 1,
        }
    }
    Stats {
        counts: c,
        ttfb_ms: percentiles(ttfb),
        total_ms: percentiles(total),
    }
}

/// p50, p95, p99 (nearest rank); NaN without data.
fn percentiles(mut v: Vec<f64>) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    [50.0, 95.0, 99.0].map(|p| {
        if v.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    })
}

/// `kiln serve`, killed when dropped (on success, error and panic alike).
struct Server {
    child: Child,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn pid(&self) -> u32 {
        self.child.id()
    }
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
    fn tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = s.lines().collect();
        v[v.len().saturating_sub(20)..].join("\n")
    }
}

/// SmolLM2, pinned: `KILN_SMOLLM2` (checked against its sha256) or the download cache (fetched
/// through the gguf-py venv the first time), as the serve stage gets it.
fn smollm2() -> Result<PathBuf> {
    use crate::test::{download_cache, verify, SMOLLM2_SHA256};
    if let Some(p) = std::env::var_os("KILN_SMOLLM2") {
        let p = PathBuf::from(p);
        verify(&p, SMOLLM2_SHA256, "KILN_SMOLLM2")?;
        return Ok(p);
    }
    let cached = download_cache()?.join(SMOLLM2_SHA256);
    if cached.exists() {
        verify(&cached, SMOLLM2_SHA256, "cached SmolLM2 model")?;
        return Ok(cached);
    }
    crate::doctor::ensure(&[&crate::doctor::PYTHON_VENV])?;
    crate::test::smollm2_model(&crate::test::gguf_py_venv()?)
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(l.local_addr().context("the free port's address")?.port())
}

/// A key only this run knows: 32 hex digits from the clock, the pid and the seed.
fn api_key(seed: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut r = Rng::new(seed ^ nanos ^ u64::from(std::process::id()).rotate_left(32));
    format!("soak-{:016x}{:016x}", r.next(), r.next())
}

/// VmRSS, RssAnon, Threads of /proc/PID/status and the count of /proc/PID/fd.
fn proc_of(pid: u32) -> Result<Proc> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{path} has no {name}"))
    };
    let fd_dir = format!("/proc/{pid}/fd");
    let fds = std::fs::read_dir(&fd_dir)
        .with_context(|| format!("reading {fd_dir}"))?
        .count() as u64;
    Ok(Proc {
        rss_kib: field("VmRSS:")?,
        anon_kib: field("RssAnon:")?,
        fds,
        threads: field("Threads:")?,
        active: 0,
        queue: 0,
    })
}

/// The server's state: /proc and the gauges of /metrics; and `kiln_requests_cancelled_total`.
fn sample(t: &Target, pid: u32) -> Result<(Proc, u64)> {
    let mut p = proc_of(pid)?;
    let m = client::get(t, "/metrics").context("GET /metrics")?;
    ensure!(m.status == 200, "GET /metrics: {}", m.status);
    let text = String::from_utf8_lossy(&m.body);
    let metric = |name: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("/metrics has no {name}"))
    };
    p.active = metric("kiln_active_sequences")?;
    p.queue = metric("kiln_queue_depth")?;
    Ok((p, metric("kiln_requests_cancelled_total")?))
}

fn serve(a: &ServeArgs) -> Result<()> {
    ensure!(
        a.minutes > 0.0 && a.minutes.is_finite(),
        "--minutes must be positive"
    );
    ensure!(a.parallel >= 1, "--parallel must be at least 1");
    ensure!(a.window >= 1, "--window must be at least 1 second");
    let clients = a.clients.unwrap_or(2 * a.parallel);
    ensure!(clients >= 1, "--clients must be at least 1");
    let dir = crate::paths::target_dir().join("soak");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            // Named by a link, so that the model id kiln serves is its name, not a hash.
            let cached = smollm2()?;
            let link = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
            let tmp = dir.join(format!(".model.tmp{}", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            std::os::unix::fs::symlink(&cached, &tmp)
                .and_then(|()| std::fs::rename(&tmp, &link))
                .with_context(|| format!("linking {} to {}", link.display(), cached.display()))?;
            link
        }
    };
    let kiln = crate::bench::release_kiln("soak serve")?;
    let key = api_key(a.seed);
    let key_file = dir.join("api-key");
    crate::atomic::write_atomic(&key_file, format!("{key}\n").as_bytes())?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod 600 {}", key_file.display()))?;
    }

    let port = free_port()?;
    let log = dir.join("kiln-serve.log");
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let err = out
        .try_clone()
        .context("duplicating the log's descriptor")?;
    let mut c = Command::new(&kiln);
    c.arg("serve")
        .arg(&model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--parallel", &a.parallel.to_string()])
        .args(["--queue", &a.queue.to_string()])
        .args(["--client-timeout", &a.client_timeout.to_string()])
        .args(["--backend", "cpu"])
        .arg("--api-key-file")
        .arg(&key_file);
    if a.threads > 0 {
        c.args(["--threads", &a.threads.to_string()]);
    }
    c.stdin(Stdio::null()).stdout(out).stderr(err);
    println!("soak serve: {c:?}");
    let child = c.spawn().with_context(|| format!("starting {c:?}"))?;
    let mut server = Server { child, log };
    let mut target = Target {
        port,
        key,
        model: String::new(),
        client_timeout: Duration::from_secs(a.client_timeout),
    };
    let t0 = Instant::now();
    loop {
        if !server.alive() {
            bail!(
                "kiln serve exited before it was ready; the end of {}:\n{}",
                server.log.display(),
                server.tail()
            );
        }
        if client::get(&target, "/health").is_ok_and(|r| r.status == 200) {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(300),
            "kiln serve did not answer /health with 200 within 300 s; the end of {}:\n{}",
            server.log.display(),
            server.tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let models = client::get(&target, "/v1/models").context("GET /v1/models")?;
    let v: serde_json::Value = serde_json::from_slice(&models.body)
        .with_context(|| format!("GET /v1/models: {}", String::from_utf8_lossy(&models.body)))?;
    target.model = v["data"][0]["id"]
        .as_str()
        .context("GET /v1/models has no data[0].id")?
        .to_string();
    // The idle baseline after one request: what the first request creates once (the inference
    // thread pool) is not what the soak looks for.
    let mut rng = Rng::new(a.seed);
    let first = client::run(&target, Kind::Completion, &mut rng, Instant::now());
    if let Outcome::Failed(why) = &first.outcome {
        bail!("the first completion failed: {why}");
    }
    std::thread::sleep(Duration::from_secs(1));
    let (idle_before, _) = sample(&target, server.pid()).context("the idle baseline")?;

    let duration = Duration::from_secs_f64(a.minutes * 60.0);
    let busy_allowed = clients > a.parallel + a.queue;
    println!(
        "soak serve: {} on 127.0.0.1:{port} (pid {}), --parallel {} --queue {}, {clients} clients, \
         seed {}, {:.1} min, a sample every {} s; warm-up: the first {:.0} s",
        target.model,
        server.pid(),
        a.parallel,
        a.queue,
        a.seed,
        a.minutes,
        a.window,
        duration.as_secs_f64() * WARMUP
    );
    println!(
        "soak serve: idle after one completion: VmRSS {:.1} MiB, {} fds, {} threads",
        idle_before.rss_kib as f64 / 1024.0,
        idle_before.fds,
        idle_before.threads
    );
    println!("{}", header());

    let records: Arc<Mutex<Vec<Record>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let target = Arc::new(target);
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            let (records, stop, target) = (records.clone(), stop.clone(), target.clone());
            let mut rng = Rng::new(a.seed.wrapping_mul(0x1000_0000_01b3) ^ (i as u64 + 1));
            std::thread::Builder::new()
                .name(format!("soak-client-{i}"))
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let kind = rng.kind();
                        let r = client::run(&target, kind, &mut rng, start);
                        if let Ok(mut v) = records.lock() {
                            v.push(r);
                        }
                    }
                })
                .context("starting a client thread")
        })
        .collect::<Result<_>>()?;

    let mut samples: Vec<Sample> = Vec::new();
    let mut alive = true;
    let mut seen = 0usize;
    let mut next = Duration::from_secs(a.window);
    while next <= duration {
        std::thread::sleep(next.saturating_sub(start.elapsed()));
        next += Duration::from_secs(a.window);
        if !server.alive() {
            alive = false;
            println!(
                "soak serve: kiln serve exited; the end of {}:\n{}",
                server.log.display(),
                server.tail()
            );
            break;
        }
        let t_s = start.elapsed().as_secs_f64();
        let (proc, cancelled) = match sample(&target, server.pid()) {
            Ok(s) => s,
            Err(e) => {
                println!("soak serve: sampling failed at {t_s:.0} s: {e:#}");
                alive = false;
                break;
            }
        };
        let window: Vec<Record> = match records.lock() {
            Ok(v) => {
                let w = v[seen..].to_vec();
                seen = v.len();
                w
            }
            Err(_) => bail!("a client thread panicked"),
        };
        let s = Sample {
            t_s,
            proc,
            cancelled,
            stats: stats(window.iter()),
        };
        println!(
            "{}",
            row(&s, &tag(t_s, t_s < duration.as_secs_f64() * WARMUP))
        );
        let _ = std::io::stdout().flush();
        samples.push(s);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        if w.join().is_err() {
            bail!("a client thread panicked");
        }
    }
    let records = match Arc::try_unwrap(records).map(Mutex::into_inner) {
        Ok(Ok(v)) => v,
        _ => bail!("the clients' records are still shared or poisoned"),
    };

    // Idle again: every connection closed (a stalled one within --client-timeout), the engine's
    // slots free. Wait for the baseline, then take what is there.
    let settle = Instant::now();
    let idle_after = loop {
        let s = if alive {
            sample(&target, server.pid()).ok().map(|s| s.0)
        } else {
            None
        };
        match s {
            Some(p)
                if (p.fds <= idle_before.fds
                    && p.threads <= idle_before.threads
                    && p.active == 0
                    && p.queue == 0)
                    || settle.elapsed() > target.client_timeout + Duration::from_secs(15) =>
            {
                break p
            }
            Some(_) => std::thread::sleep(Duration::from_millis(500)),
            None => {
                alive = false;
                break Proc::default();
            }
        }
    };
    alive &= server.alive() && client::get(&target, "/health").is_ok_and(|r| r.status == 200);

    let total = stats(records.iter());
    let checks = verdict::verdict(&verdict::Inputs {
        samples: &samples.iter().map(|s| (s.t_s, s.proc)).collect::<Vec<_>>(),
        warmup_s: duration.as_secs_f64() * WARMUP,
        idle_before,
        idle_after,
        counts: total.counts,
        busy_allowed,
        clients,
        bound: Bound {
            rss_pct: a.rss_slack_pct,
            rss_mib: a.rss_slack_mib,
        },
        alive,
    });

    println!();
    println!(
        "soak serve: {} over {:.1} min, {clients} clients, --parallel {}, seed {} \
         (latencies: valid requests answered 200, ms; ttfb = request sent to the first response \
         byte; w = warm-up)",
        target.model, a.minutes, a.parallel, a.seed
    );
    println!("{}", header());
    for s in &table_rows(&samples, &records) {
        let warm = s.t_s < duration.as_secs_f64() * WARMUP + 1e-9;
        println!("{}", row(s, &tag(s.t_s, warm)));
    }
    let all = Sample {
        t_s: start.elapsed().as_secs_f64(),
        proc: idle_after,
        cancelled: samples.last().map_or(0, |s| s.cancelled),
        stats: total.clone(),
    };
    println!(
        "{} (idle after; counts and latencies over the whole run)",
        row(&all, "all")
    );
    println!(
        "idle before: VmRSS {:.1} MiB, {} fds, {} threads; idle after: VmRSS {:.1} MiB, {} fds, \
         {} threads, {} active, {} queued",
        idle_before.rss_kib as f64 / 1024.0,
        idle_before.fds,
        idle_before.threads,
        idle_after.rss_kib as f64 / 1024.0,
        idle_after.fds,
        idle_after.threads,
        idle_after.active,
        idle_after.queue
    );
    let mut per_kind: BTreeMap<Kind, (u64, u64, u64)> = BTreeMap::new();
    let mut failures: BTreeMap<String, u64> = BTreeMap::new();
    for r in &records {
        let e = per_kind.entry(r.kind).or_default();
        match &r.outcome {
            Outcome::Ok => e.0 += 1,
            Outcome::Busy => e.1 += 1,
            Outcome::Failed(why) => {
                e.2 += 1;
                *failures.entry(why.clone()).or_default() += 1;
            }
        }
    }
    println!(
        "per kind (ok / 429 / failed): {}",
        per_kind
            .iter()
            .map(|(k, (o, b, f))| format!("{} {o}/{b}/{f}", k.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (why, n) in failures.iter().take(10) {
        println!("  failed {n}x: {why}");
    }
    for c in &checks {
        println!(
            "soak serve: {} {}: {}",
            if c.ok { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    write_results(&dir, a, clients, &samples, &total, &per_kind, &checks)?;
    let failed: Vec<&str> = checks.iter().filter(|c| !c.ok).map(|c| c.name).collect();
    if failed.is_empty() {
        println!("soak serve: PASS");
        Ok(())
    } else {
        bail!("soak serve: FAIL: {}", failed.join(", "))
    }
}

/// The table's rows: the windows as sampled, or merged so that there are at most 20 (each row
/// the state at its end, the latencies over its span).
fn table_rows(samples: &[Sample], records: &[Record]) -> Vec<Sample> {
    let per = samples.len().div_ceil(20).max(1);
    let mut out = Vec::new();
    let mut from = 0.0;
    for group in samples.chunks(per) {
        let Some(last) = group.last() else { continue };
        let to = last.t_s;
        let span = records
            .iter()
            .filter(|r| r.at.as_secs_f64() > from && r.at.as_secs_f64() <= to);
        let mut s = last.clone();
        s.proc.fds = group.iter().map(|g| g.proc.fds).max().unwrap_or(0);
        s.stats = stats(span);
        out.push(s);
        from = to;
    }
    out
}

fn tag(t_s: f64, warm: bool) -> String {
    format!("{t_s:>5.0}{}", if warm { "w" } else { " " })
}

fn header() -> String {
    format!(
        "{:>6} {:>8} {:>8} {:>4} {:>4} {:>6} {:>4} {:>5} {:>7} {:>5} {:>6} {:>5} {:>21} {:>21}",
        "t s",
        "RSS MiB",
        "anon",
        "fds",
        "thr",
        "valid",
        "429",
        "vfail",
        "invalid",
        "ifail",
        "vanish",
        "cancl",
        "ttfb p50/p95/p99",
        "total p50/p95/p99"
    )
}

/// A row of the table; `tag` (6 wide) says when: the seconds into the run, `w` in the warm-up.
fn row(s: &Sample, tag: &str) -> String {
    let c = &s.stats.counts;
    let p = |v: &[f64; 3]| {
        if v[0].is_nan() {
            "-".to_string()
        } else {
            format!("{:.0}/{:.0}/{:.0}", v[0], v[1], v[2])
        }
    };
    format!(
        "{tag:>6} {:>8.1} {:>8.1} {:>4} {:>4} {:>6} {:>4} {:>5} {:>7} {:>5} {:>6} {:>5} {:>21} {:>21}",
        s.proc.rss_kib as f64 / 1024.0,
        s.proc.anon_kib as f64 / 1024.0,
        s.proc.fds,
        s.proc.threads,
        c.valid_ok,
        c.busy,
        c.valid_failed,
        c.invalid_ok,
        c.invalid_failed,
        c.vanished + c.vanishing_failed,
        s.cancelled,
        p(&s.stats.ttfb_ms),
        p(&s.stats.total_ms)
    )
}

/// `serve.csv` (one line per window) and `serve.json` (the run, its totals and the verdict),
/// each written atomically.
fn write_results(
    dir: &Path,
    a: &ServeArgs,
    clients: usize,
    samples: &[Sample],
    total: &Stats,
    per_kind: &BTreeMap<Kind, (u64, u64, u64)>,
    checks: &[verdict::Check],
) -> Result<()> {
    let mut csv = String::from(
        "t_s,rss_kib,anon_kib,fds,threads,active,queue,cancelled_total,valid_ok,busy_429,\
         valid_failed,invalid_ok,invalid_failed,vanished,vanishing_failed,ttfb_p50_ms,\
         ttfb_p95_ms,ttfb_p99_ms,total_p50_ms,total_p95_ms,total_p99_ms\n",
    );
    for s in samples {
        let (p, c) = (&s.proc, &s.stats.counts);
        let ms = |v: f64| {
            if v.is_nan() {
                String::new()
            } else {
                format!("{v:.1}")
            }
        };
        csv.push_str(&format!(
            "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            s.t_s,
            p.rss_kib,
            p.anon_kib,
            p.fds,
            p.threads,
            p.active,
            p.queue,
            s.cancelled,
            c.valid_ok,
            c.busy,
            c.valid_failed,
            c.invalid_ok,
            c.invalid_failed,
            c.vanished,
            c.vanishing_failed,
            ms(s.stats.ttfb_ms[0]),
            ms(s.stats.ttfb_ms[1]),
            ms(s.stats.ttfb_ms[2]),
            ms(s.stats.total_ms[0]),
            ms(s.stats.total_ms[1]),
            ms(s.stats.total_ms[2]),
        ));
    }
    crate::atomic::write_atomic(&dir.join("serve.csv"), csv.as_bytes())?;
    // NaN is no JSON: a window without a valid answer has null percentiles.
    let json_ms = |v: &[f64; 3]| v.map(|x| (!x.is_nan()).then_some(x));
    let json = serde_json::json!({
        "minutes": a.minutes,
        "parallel": a.parallel,
        "queue": a.queue,
        "clients": clients,
        "seed": a.seed,
        "window_s": a.window,
        "client_timeout_s": a.client_timeout,
        "samples": samples.iter().map(|s| serde_json::json!({
            "t_s": s.t_s,
            "proc": s.proc,
            "cancelled_total": s.cancelled,
            "counts": s.stats.counts,
            "ttfb_ms": json_ms(&s.stats.ttfb_ms),
            "total_ms": json_ms(&s.stats.total_ms),
        })).collect::<Vec<_>>(),
        "totals": {
            "counts": total.counts,
            "ttfb_ms": json_ms(&total.ttfb_ms),
            "total_ms": json_ms(&total.total_ms),
            "per_kind": per_kind.iter().map(|(k, (o, b, f))| (k.name().to_string(),
                serde_json::json!({"ok": o, "busy_429": b, "failed": f}))).collect::<serde_json::Map<_, _>>(),
        },
        "verdict": checks,
    });
    let text = serde_json::to_string_pretty(&json).context("serialising the soak's results")?;
    crate::atomic::write_atomic(&dir.join("serve.json"), text.as_bytes())?;
    println!(
        "soak serve: samples in {} and {}",
        dir.join("serve.csv").display(),
        dir.join("serve.json").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(super::percentiles(v), [50.0, 95.0, 99.0]);
        assert_eq!(super::percentiles(vec![7.0]), [7.0, 7.0, 7.0]);
        assert!(super::percentiles(Vec::new())[0].is_nan());
    }
}
