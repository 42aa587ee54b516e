//! `cargo xtask bench serve`: `kiln serve` against `llama-server` under 1, 4 and 8 concurrent
//! streaming clients — aggregate tok/s and time to first token, kiln ÷ llama-server, one run.
//!
//! llama-server is built from the llama.cpp that the pinned llama-cpp-python ships
//! (`vendor/llama.cpp` of its sdist), so both sides of this bench and of `bench model` are the
//! same llama.cpp. The client is hand-written HTTP/1.1 over `std::net`, one thread per client:
//! no HTTP stack of its own to measure, and nothing shared between the clients but a barrier.

use crate::doctor;
use anyhow::{bail, ensure, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use xshell::cmd;

/// The llama-cpp-python sdist of [`crate::test::LLAMA_CPP_PINS`]'s pin (PyPI's sha256).
const SDIST_SHA256: &str = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e";
/// Per-slot context of both servers (kiln's default for SmolLM2: min(n_ctx_train, 2048)).
const CTX_PER_SLOT: usize = 2048;
/// A prompt SmolLM2 continues past 64 tokens under greedy decoding (no early end of text).
const PROMPT: &str = "The history of the printing press begins in the fifteenth century, when";

pub struct Opts {
    pub clients: Vec<usize>,
    pub rounds: usize,
    pub threads: usize,
    pub max_tokens: usize,
}

pub fn run(o: &Opts) -> Result<()> {
    ensure!(o.rounds >= 1, "--rounds must be at least 1");
    ensure!(
        !o.clients.is_empty() && o.clients.iter().all(|&c| c >= 1),
        "--clients must list client counts of at least 1"
    );
    let gguf = smollm2()?;
    let llama = llama_server()?;
    let kiln = super::release_kiln("bench serve")?;
    let logs = crate::paths::target_dir().join("kiln/bench-serve");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;

    let sides = [Side::Kiln(kiln), Side::LlamaServer(llama)];
    let mut rows = Vec::new();
    for &n in &o.clients {
        // Per side and round: (aggregate tok/s, median TTFT).
        let mut got: [Vec<(f64, Duration)>; 2] = [Vec::new(), Vec::new()];
        for round in 0..o.rounds {
            // Alternate which side goes first (the host's load drifts), one server at a time
            // (an idle server's spinning threads must not slow the measured one).
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let side = &sides[i];
                let log = logs.join(format!("{}-{n}.log", side.name()));
                let server = Server::start(side, &gguf, n, o.threads, &log)?;
                let model = server.model_id()?;
                let req = request_body(&model, o.max_tokens, matches!(side, Side::LlamaServer(_)));
                run_round(server.port, &req, n)
                    .with_context(|| format!("{}: warm-up with {n} clients", side.name()))?;
                let r = run_round(server.port, &req, n)
                    .with_context(|| format!("{}: {n} clients", side.name()))?;
                drop(server);
                let short: Vec<u64> = r
                    .requests
                    .iter()
                    .map(|q| q.tokens)
                    .filter(|&t| t < o.max_tokens as u64)
                    .collect();
                if !short.is_empty() {
                    println!(
                        "bench serve: note: {} stopped {} request(s) before {} tokens ({short:?}); \
                         the rate counts the tokens received",
                        side.name(),
                        short.len(),
                        o.max_tokens
                    );
                }
                println!(
                    "bench serve: {n} client(s), round {}/{}: {:<12} {:>7.1} tok/s, TTFT {:>6.1} ms ({} tokens in {:.2} s)",
                    round + 1,
                    o.rounds,
                    side.name(),
                    r.tok_s(),
                    ms(r.median_ttft()),
                    r.tokens(),
                    r.wall.as_secs_f64()
                );
                got[i].push((r.tok_s(), r.median_ttft()));
            }
        }
        let med = |v: &[(f64, Duration)]| {
            (
                median(v.iter().map(|x| x.0).collect()),
                median(v.iter().map(|x| ms(x.1)).collect()),
            )
        };
        rows.push((n, med(&got[0]), med(&got[1])));
    }

    println!();
    println!(
        "SmolLM2-135M Q4_1, {} threads, prompt {:?}, {} tokens per request (temperature 0), \
         f16 KV, no flash attention, median of {} round(s)",
        threads(o.threads),
        PROMPT,
        o.max_tokens,
        o.rounds
    );
    println!(
        "tok/s = all clients' generated tokens / wall time of the round (first request sent to \
         last stream ended); TTFT = request sent to the first chunk with text, median over clients"
    );
    println!(
        "{:>7} | {:>10} | {:>17} | {:>5} | {:>10} | {:>17} | {:>5}",
        "clients",
        "kiln tok/s",
        "llama-server tok/s",
        "ratio",
        "kiln TTFT",
        "llama-server TTFT",
        "ratio"
    );
    for (n, (kt, kf), (lt, lf)) in rows {
        println!(
            "{n:>7} | {kt:>10.1} | {lt:>17.1} | {:>5.2} | {:>7.1} ms | {lf:>14.1} ms | {:>5.2}",
            kt / lt,
            kf,
            kf / lf
        );
    }
    println!("(tok/s ratio > 1: kiln faster; TTFT ratio < 1: kiln answers sooner)");
    Ok(())
}

fn threads(t: usize) -> usize {
    if t == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        t
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// SmolLM2 from the cache (fetched through the gguf-py venv the first time).
fn smollm2() -> Result<PathBuf> {
    let cached = crate::test::download_cache()?.join(crate::test::SMOLLM2_SHA256);
    if cached.exists() {
        crate::test::verify(&cached, crate::test::SMOLLM2_SHA256, "cached SmolLM2 model")?;
        return Ok(cached);
    }
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    crate::test::smollm2_model(&crate::test::gguf_py_venv()?)
}

// ---------------------------------------------------------------------------------------------
// llama-server, built once per pin and flags

/// The CMake options of the llama-server build: a static binary of the server alone, no
/// network at build time (no curl, no prebuilt web UI), and the CPU's features as in the
/// `llama-cpp` test stage ([`crate::test::ggml_x86_without_amx`]: on a CPU with AMX, every
/// feature but AMX; elsewhere ggml's native build).
fn cmake_args(cpuinfo: Option<&str>) -> Vec<String> {
    let mut a: Vec<String> = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DGGML_CCACHE=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
    ]
    .map(String::from)
    .to_vec();
    match cpuinfo.and_then(crate::test::ggml_x86_without_amx) {
        Some(cpu) => a.extend(cpu.split_whitespace().map(String::from)),
        None => a.push("-DGGML_NATIVE=ON".into()),
    }
    a
}

/// `~/.cache/kiln/llama-server/<key of pin, sdist and options>/llama-server`, built the first
/// time (a few minutes on 2 cores), from the sdist in the content-addressed cache.
fn llama_server() -> Result<PathBuf> {
    let pin = crate::test::LLAMA_CPP_PINS[0];
    let cpuinfo = if cfg!(target_arch = "x86_64") {
        std::fs::read_to_string("/proc/cpuinfo").ok()
    } else {
        None
    };
    let args = cmake_args(cpuinfo.as_deref());
    let key = crate::pins::Sha256::of_bytes(
        format!("{pin} {SDIST_SHA256} {}", args.join(" ")).as_bytes(),
    )
    .short();
    let cache = crate::test::download_cache()?;
    let base = cache
        .parent()
        .context("the download cache has no parent")?
        .join("llama-server");
    let dir = base.join(&key);
    let bin = dir.join("llama-server");
    if bin.exists() {
        return Ok(bin);
    }
    doctor::ensure(doctor::FOR_LLAMA_SERVER_BUILD)?;
    let sdist = sdist(pin)?;
    let version = pin
        .split_once("==")
        .map(|(_, v)| v)
        .context("the llama-cpp-python pin has no version")?;
    let work = crate::paths::target_dir().join(format!("kiln/llama-server-build/{key}"));
    let src = work.join("llama.cpp");
    let _ = std::fs::remove_dir_all(&work);
    println!(
        "bench serve: extracting vendor/llama.cpp of {pin} into {}",
        src.display()
    );
    extract_vendor(
        &sdist,
        &format!("llama_cpp_python-{version}/vendor/llama.cpp/"),
        &src,
    )?;
    let build = work.join("build");
    let jobs = threads(0).to_string();
    println!(
        "bench serve: building llama-server ({pin}'s llama.cpp, {} jobs) with {}",
        jobs,
        args.join(" ")
    );
    let sh = crate::paths::shell()?;
    let configure = &args;
    cmd!(sh, "cmake -S {src} -B {build} {configure...}")
        .run()
        .context("configuring llama.cpp (cmake)")?;
    cmd!(
        sh,
        "cmake --build {build} --target llama-server --parallel {jobs}"
    )
    .run()
    .context("building llama-server")?;
    let built = build.join("bin/llama-server");
    ensure!(built.exists(), "the build made no {}", built.display());
    let tmp = base.join(format!("{key}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    std::fs::copy(&built, tmp.join("llama-server"))
        .with_context(|| format!("copying {} into {}", built.display(), tmp.display()))?;
    std::fs::write(
        tmp.join("cmake-args.txt"),
        format!("{pin} sdist {SDIST_SHA256}\n{}\n", args.join(" ")),
    )
    .context("writing cmake-args.txt")?;
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(bin)
}

/// The pinned sdist in the content-addressed cache, fetched with `pip download` the first time.
fn sdist(pin: &str) -> Result<PathBuf> {
    let cache = crate::test::download_cache()?;
    let file = cache.join(SDIST_SHA256);
    if file.exists() {
        crate::test::verify(&file, SDIST_SHA256, "cached llama-cpp-python sdist")?;
        return Ok(file);
    }
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = crate::test::gguf_py_venv()?;
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let dl = crate::paths::target_dir().join("kiln/download/llama-cpp-python-sdist");
    let _ = std::fs::remove_dir_all(&dl);
    std::fs::create_dir_all(&dl).with_context(|| format!("creating {}", dl.display()))?;
    println!("bench serve: fetching the {pin} sdist (77 MB; pip prepares its metadata, ~3 min)");
    let sh = crate::paths::shell()?;
    cmd!(
        sh,
        "{python} -m pip download --no-binary :all: --no-deps --disable-pip-version-check -d {dl} {pin}"
    )
    .run()
    .with_context(|| format!("pip download --no-binary :all: {pin}"))?;
    let got = std::fs::read_dir(&dl)
        .with_context(|| format!("reading {}", dl.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        .with_context(|| format!("pip download left no .tar.gz in {}", dl.display()))?;
    crate::test::verify(&got, SDIST_SHA256, &format!("{pin} sdist"))?;
    std::fs::rename(&got, &file).with_context(|| format!("renaming to {}", file.display()))?;
    let _ = std::fs::remove_dir_all(&dl);
    Ok(file)
}

/// Unpacks the members of a `.tar.gz` under `prefix` into `dest`, without the prefix.
fn extract_vendor(tgz: &Path, prefix: &str, dest: &Path) -> Result<()> {
    let f = std::fs::File::open(tgz).with_context(|| format!("opening {}", tgz.display()))?;
    let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let mut n = 0usize;
    for e in ar
        .entries()
        .with_context(|| format!("reading {}", tgz.display()))?
    {
        let mut e = e.with_context(|| format!("reading {}", tgz.display()))?;
        let path = e.path()?.to_string_lossy().into_owned();
        let Some(rel) = path.strip_prefix(prefix) else {
            continue;
        };
        let rel = Path::new(rel);
        if rel.as_os_str().is_empty() {
            continue;
        }
        ensure!(
            rel.components()
                .all(|c| matches!(c, std::path::Component::Normal(_))),
            "{}: member {path:?} leaves its folder",
            tgz.display()
        );
        let out = dest.join(rel);
        if let Some(p) = out.parent() {
            std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        }
        e.unpack(&out)
            .with_context(|| format!("unpacking {path} to {}", out.display()))?;
        n += 1;
    }
    ensure!(n > 0, "{}: nothing under {prefix}", tgz.display());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The servers

enum Side {
    Kiln(PathBuf),
    LlamaServer(PathBuf),
}

impl Side {
    fn name(&self) -> &'static str {
        match self {
            Side::Kiln(_) => "kiln",
            Side::LlamaServer(_) => "llama-server",
        }
    }

    /// The same model, threads, per-slot context, f16 KV and no flash attention on both sides;
    /// llama-server's context is split among its slots, so it gets the per-slot one times N, and
    /// reuses no prompt cache (the clients also send `cache_prompt: false`).
    fn command(&self, model: &Path, port: u16, parallel: usize, threads: usize) -> Command {
        let (port, n, t) = (port.to_string(), parallel.to_string(), threads.to_string());
        let mut c;
        match self {
            Side::Kiln(bin) => {
                c = Command::new(bin);
                c.arg("serve")
                    .arg(model)
                    .args(["--host", "127.0.0.1", "--port", &port, "--parallel", &n])
                    .args(["--threads", &t, "--ctx", &CTX_PER_SLOT.to_string()])
                    .args(["--backend", "cpu", "--kv", "f16"]);
            }
            Side::LlamaServer(bin) => {
                c = Command::new(bin);
                c.arg("-m")
                    .arg(model)
                    .args(["--host", "127.0.0.1", "--port", &port, "-np", &n])
                    .args(["-t", &t, "-tb", &t])
                    .args(["-c", &(CTX_PER_SLOT * parallel).to_string()])
                    .args([
                        "--no-kv-unified",
                        "-fa",
                        "off",
                        "-ctk",
                        "f16",
                        "-ctv",
                        "f16",
                    ])
                    .args(["--cache-reuse", "0", "--cache-ram", "0", "--no-webui"]);
            }
        }
        c
    }
}

/// A running server, killed when dropped: on success, on error and on panic alike.
struct Server {
    child: Child,
    name: &'static str,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(l.local_addr()?.port())
}

fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

impl Server {
    /// Starts the side's server (output to `log`) and waits until `/health` says 200.
    fn start(
        side: &Side,
        model: &Path,
        parallel: usize,
        threads: usize,
        log: &Path,
    ) -> Result<Self> {
        let port = free_port()?;
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let mut c = side.command(model, port, parallel, threads);
        c.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = c
            .spawn()
            .with_context(|| format!("starting {} ({c:?})", side.name()))?;
        let mut s = Server {
            child,
            name: side.name(),
            port,
        };
        let t0 = Instant::now();
        loop {
            if let Some(st) = s.child.try_wait()? {
                bail!(
                    "{} exited ({st}) before it was ready; the end of {}:\n{}",
                    s.name,
                    log.display(),
                    tail(log, 20)
                );
            }
            if matches!(get(port, "/health"), Ok((200, _))) {
                return Ok(s);
            }
            if t0.elapsed() > Duration::from_secs(120) {
                bail!(
                    "{} did not answer /health with 200 within 120 s; the end of {}:\n{}",
                    s.name,
                    log.display(),
                    tail(log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The model id the server answers to (`GET /v1/models`).
    fn model_id(&self) -> Result<String> {
        let (status, body) = get(self.port, "/v1/models")?;
        let text = String::from_utf8_lossy(&body);
        ensure!(
            status == 200,
            "{}: GET /v1/models: {status} {text}",
            self.name
        );
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: GET /v1/models: {text}", self.name))?;
        v["data"][0]["id"]
            .as_str()
            .map(String::from)
            .with_context(|| format!("{}: no data[0].id in {text}", self.name))
    }
}

// ---------------------------------------------------------------------------------------------
// The client

fn request_body(model: &str, max_tokens: usize, llama_server: bool) -> String {
    let mut body = serde_json::json!({
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    // `ignore_eos` and `cache_prompt` are llama-server's own; kiln refuses parameters it does
    // not implement (it has no `ignore_eos`: the prompt is chosen so that greedy decoding does
    // not end early, and the tokens are counted from `usage` either way).
    if llama_server {
        body["ignore_eos"] = true.into();
        body["cache_prompt"] = false.into();
    }
    body.to_string()
}

fn connect(port: u16) -> Result<TcpStream> {
    let s = TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    Ok(s)
}

/// The status and headers of a response (names lower-cased).
struct Head {
    status: u16,
    chunked: bool,
    length: Option<usize>,
}

fn read_head(r: &mut impl BufRead) -> Result<Head> {
    let mut line = String::new();
    r.read_line(&mut line).context("reading the status line")?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("not an HTTP status line: {line:?}"))?;
    let mut head = Head {
        status,
        chunked: false,
        length: None,
    };
    loop {
        line.clear();
        ensure!(
            r.read_line(&mut line).context("reading a header")? > 0,
            "the connection closed inside the headers"
        );
        let l = line.trim_end();
        if l.is_empty() {
            return Ok(head);
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
                head.chunked = true;
            } else if k == "content-length" {
                head.length = v.parse().ok();
            }
        }
    }
}

/// The body of a response as a reader: de-chunked, length-limited, or up to the close.
fn body<'a, R: BufRead + 'a>(r: R, h: &Head) -> Box<dyn BufRead + 'a> {
    if h.chunked {
        Box::new(BufReader::new(Chunked::new(r)))
    } else if let Some(n) = h.length {
        Box::new(r.take(n as u64))
    } else {
        Box::new(r)
    }
}

/// `GET path` on a fresh connection: status and body.
fn get(port: u16, path: &str) -> Result<(u16, Vec<u8>)> {
    let mut s = connect(port)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut r = BufReader::new(s);
    let h = read_head(&mut r)?;
    let mut b = Vec::new();
    body(r, &h).read_to_end(&mut b)?;
    Ok((h.status, b))
}

/// HTTP/1.1 chunked transfer coding, decoded as the chunks arrive.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Chunked<R> {
    fn new(inner: R) -> Self {
        Chunked {
            inner,
            left: 0,
            done: false,
        }
    }
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::io::{Error, ErrorKind};
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(Error::new(
                    ErrorKind::UnexpectedEof,
                    "closed inside a chunked body",
                ));
            }
            let size = line.trim_end().split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size, 16).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidData,
                    format!("bad chunk size line {line:?}"),
                )
            })?;
            if size == 0 {
                // Trailers up to the empty line.
                loop {
                    line.clear();
                    if self.inner.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                        break;
                    }
                }
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(Error::new(
                ErrorKind::UnexpectedEof,
                "closed inside a chunk",
            ));
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

/// Server-sent events, line by line: the `data` of each event at its blank line.
#[derive(Default)]
struct Sse {
    data: Option<String>,
}

impl Sse {
    fn line(&mut self, line: &str) -> Option<String> {
        let line = line.strip_suffix('\n').unwrap_or(line);
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() {
            return self.data.take();
        }
        if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => self.data = Some(v.to_string()),
            }
        }
        // Comments (`:`), `event:`, `id:`, `retry:` carry nothing this bench needs.
        None
    }
}

/// What one event of a streamed completion says.
#[derive(Debug, PartialEq)]
enum Event {
    /// A chunk; `text` is true when it carries generated text.
    Chunk {
        text: bool,
        usage: Option<u64>,
    },
    Done,
}

fn event(data: &str) -> Result<Event> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    let v: serde_json::Value =
        serde_json::from_str(data).with_context(|| format!("an SSE event is not JSON: {data}"))?;
    if let Some(e) = v.get("error") {
        bail!("the server sent an error: {e}");
    }
    let text = v["choices"][0]["text"]
        .as_str()
        .is_some_and(|t| !t.is_empty());
    let usage = v["usage"]["completion_tokens"].as_u64();
    Ok(Event::Chunk { text, usage })
}

/// One streamed request, as the client saw it.
struct Request {
    sent: Instant,
    first: Option<Instant>,
    end: Instant,
    tokens: u64,
}

fn stream(port: u16, body_json: &str) -> Result<Request> {
    let mut s = connect(port)?;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body_json}",
        body_json.len()
    );
    let sent = Instant::now();
    s.write_all(req.as_bytes()).context("sending the request")?;
    let mut r = BufReader::new(s);
    let h = read_head(&mut r)?;
    let mut b = body(r, &h);
    if h.status != 200 {
        let mut t = String::new();
        let _ = b.read_to_string(&mut t);
        bail!("POST /v1/completions: {} {t}", h.status);
    }
    let (mut first, mut chunks, mut usage) = (None, 0u64, None);
    let mut sse = Sse::default();
    let mut line = String::new();
    loop {
        line.clear();
        if b.read_line(&mut line).context("reading the stream")? == 0 {
            break;
        }
        let now = Instant::now();
        let Some(data) = sse.line(&line) else {
            continue;
        };
        match event(&data)? {
            Event::Done => break,
            Event::Chunk { text, usage: u } => {
                if text {
                    first.get_or_insert(now);
                    chunks += 1;
                }
                if u.is_some() {
                    usage = u;
                }
            }
        }
    }
    Ok(Request {
        sent,
        first,
        end: Instant::now(),
        // `usage` counts tokens; text chunks are the fallback (a token that completes no
        // character sends no text).
        tokens: usage.unwrap_or(chunks),
    })
}

struct Round {
    requests: Vec<Request>,
    wall: Duration,
}

impl Round {
    fn tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.tokens).sum()
    }
    fn tok_s(&self) -> f64 {
        self.tokens() as f64 / self.wall.as_secs_f64().max(1e-9)
    }
    fn median_ttft(&self) -> Duration {
        let v = self
            .requests
            .iter()
            .map(|r| r.first.unwrap_or(r.end) - r.sent)
            .map(|d| d.as_secs_f64())
            .collect();
        Duration::from_secs_f64(median(v))
    }
}

/// `n` clients, each one streamed request, all released at once.
fn run_round(port: u16, req: &str, n: usize) -> Result<Round> {
    let barrier = std::sync::Barrier::new(n);
    let results: Vec<Result<Request>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|_| {
                let b = &barrier;
                s.spawn(move || {
                    b.wait();
                    stream(port, req)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let requests = results.into_iter().collect::<Result<Vec<_>>>()?;
    let start = requests
        .iter()
        .map(|r| r.sent)
        .min()
        .context("no requests")?;
    let end = requests
        .iter()
        .map(|r| r.end)
        .max()
        .context("no requests")?;
    for r in &requests {
        ensure!(r.first.is_some(), "a request streamed no text");
    }
    Ok(Round {
        wall: end - start,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_decoded_as_they_come() {
        let raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: y\r\n\r\nNEXT";
        let mut r = std::io::Cursor::new(&raw[..]);
        let mut out = String::new();
        Chunked::new(&mut r).read_to_string(&mut out).unwrap();
        assert_eq!(out, "hello, world");
        // The reader stops at the end of the body, not of the connection.
        let mut rest = String::new();
        r.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "NEXT");
        // A connection closed mid-chunk is an error, not a short body.
        let mut cut = std::io::Cursor::new(&b"a\r\nhello"[..]);
        assert!(Chunked::new(&mut cut).read_to_string(&mut out).is_err());
        let mut bad = std::io::Cursor::new(&b"zz\r\n"[..]);
        assert!(Chunked::new(&mut bad).read_to_string(&mut out).is_err());
    }

    #[test]
    fn sse_events_end_at_blank_lines() {
        let mut s = Sse::default();
        let mut got = Vec::new();
        for l in [
            ": a comment\n",
            "data: {\"a\":1}\r\n",
            "\r\n",
            "event: x\n",
            "data:one\n",
            "data: two\n",
            "\n",
            "\n",
            "data: [DONE]\n",
            "\n",
        ] {
            got.extend(s.line(l));
        }
        assert_eq!(got, ["{\"a\":1}", "one\ntwo", "[DONE]"]);
    }

    #[test]
    fn events_say_text_usage_and_errors() {
        let k = r#"{"choices":[{"index":0,"text":" the","finish_reason":null}]}"#;
        assert_eq!(
            event(k).unwrap(),
            Event::Chunk {
                text: true,
                usage: None
            }
        );
        let u = r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":64}}"#;
        assert_eq!(
            event(u).unwrap(),
            Event::Chunk {
                text: false,
                usage: Some(64)
            }
        );
        let empty = r#"{"choices":[{"text":"","finish_reason":"length"}],"usage":null}"#;
        assert_eq!(
            event(empty).unwrap(),
            Event::Chunk {
                text: false,
                usage: None
            }
        );
        assert_eq!(event("[DONE]").unwrap(), Event::Done);
        assert!(event(r#"{"error":{"message":"x"}}"#).is_err());
        assert!(event("not json").is_err());
    }

    #[test]
    fn cmake_args_leave_amx_out_and_the_network_off() {
        let spr = "flags\t\t: sse4_2 avx avx2 bmi2 fma f16c avx512f avx512cd avx512vl \
                   avx512dq avx512bw amx_tile amx_int8\n";
        let a = cmake_args(Some(spr));
        for want in [
            "-DLLAMA_BUILD_SERVER=ON",
            "-DGGML_CCACHE=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=OFF",
            "-DGGML_AVX512=ON",
            "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_TILE=OFF",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} in {a:?}");
        }
        assert!(!a.iter().any(|x| x == "-DGGML_NATIVE=ON"));
        // Without AMX (or off x86): ggml's native build.
        let plain = cmake_args(Some("flags : sse4_2 avx avx2 fma f16c\n"));
        assert!(plain.iter().any(|x| x == "-DGGML_NATIVE=ON"));
        assert!(!plain.iter().any(|x| x.contains("AMX")));
        assert_eq!(cmake_args(None), plain);
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }
}
