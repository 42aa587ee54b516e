//! The soak's clients: one request each, hand-written HTTP/1.1 over `std::net` (every byte on the
//! wire is the soak's choice: half a head, a body announced and never sent, a stream dropped after
//! its first event), and every answer checked against what that kind of request must get.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

/// What a client does. Valid kinds must be answered 200 with a well-formed answer; invalid kinds
/// must get their own status; vanishing kinds leave mid-request and expect nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Completion,
    CompletionStream,
    Chat,
    ChatStream,
    /// A valid completion whose request arrives in pieces, well within `--client-timeout`.
    SlowWriter,
    /// A valid streamed chat completion read a few bytes at a time.
    SlowReader,
    /// A parameter kiln does not implement: 400 naming it.
    UnknownParam,
    /// A wrong bearer key: 401.
    BadKey,
    /// A body announced over 1 MiB (and not sent): 413 before it is read.
    Oversized,
    /// A body that is not JSON: 400.
    BadJson,
    /// A `Host` that does not name loopback: 403.
    ForeignHost,
    /// A body that stops arriving: 408 after `--client-timeout`.
    StalledBody,
    /// Half a request head, then the connection is dropped.
    HalfHead,
    /// The whole head and half the body, then dropped.
    HalfBody,
    /// A streamed completion dropped after its first event (the engine must free the slot).
    DropStream,
    /// Connect and close at once.
    ConnectDrop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Valid,
    Invalid,
    Vanishing,
}

/// The seeded mix: each kind's weight.
pub const MIX: &[(Kind, u32)] = &[
    (Kind::Completion, 14),
    (Kind::CompletionStream, 12),
    (Kind::Chat, 12),
    (Kind::ChatStream, 10),
    (Kind::SlowWriter, 3),
    (Kind::SlowReader, 3),
    (Kind::UnknownParam, 5),
    (Kind::BadKey, 5),
    (Kind::Oversized, 4),
    (Kind::BadJson, 5),
    (Kind::ForeignHost, 5),
    (Kind::StalledBody, 1),
    (Kind::HalfHead, 4),
    (Kind::HalfBody, 4),
    (Kind::DropStream, 6),
    (Kind::ConnectDrop, 4),
];

impl Kind {
    pub fn class(self) -> Class {
        use Kind::*;
        match self {
            Completion | CompletionStream | Chat | ChatStream | SlowWriter | SlowReader => {
                Class::Valid
            }
            UnknownParam | BadKey | Oversized | BadJson | ForeignHost | StalledBody => {
                Class::Invalid
            }
            HalfHead | HalfBody | DropStream | ConnectDrop => Class::Vanishing,
        }
    }

    /// The status an invalid kind must get.
    fn expected(self) -> u16 {
        match self {
            Kind::UnknownParam | Kind::BadJson => 400,
            Kind::BadKey => 401,
            Kind::ForeignHost => 403,
            Kind::StalledBody => 408,
            Kind::Oversized => 413,
            _ => 200,
        }
    }

    pub fn name(self) -> &'static str {
        use Kind::*;
        match self {
            Completion => "completion",
            CompletionStream => "completion-stream",
            Chat => "chat",
            ChatStream => "chat-stream",
            SlowWriter => "slow-writer",
            SlowReader => "slow-reader",
            UnknownParam => "unknown-param-400",
            BadKey => "bad-key-401",
            Oversized => "oversized-413",
            BadJson => "bad-json-400",
            ForeignHost => "foreign-host-403",
            StalledBody => "stalled-body-408",
            HalfHead => "half-head",
            HalfBody => "half-body",
            DropStream => "drop-stream",
            ConnectDrop => "connect-drop",
        }
    }
}

/// splitmix64: the soak's seeded choices (no dependency, the same sequence everywhere).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.next() as usize % v.len()]
    }
    pub fn kind(&mut self) -> Kind {
        let total: u32 = MIX.iter().map(|m| m.1).sum();
        let mut x = (self.next() % u64::from(total)) as u32;
        for &(k, w) in MIX {
            if x < w {
                return k;
            }
            x -= w;
        }
        MIX[0].0
    }
}

/// How one request ended, as the soak judges it.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Answered as its kind must be (a vanishing client: left as planned).
    Ok,
    /// A valid request answered 429 (the queue was full).
    Busy,
    Failed(String),
}

/// One request: its kind, outcome and timings (first response byte and end, from the send).
#[derive(Clone, Debug)]
pub struct Record {
    /// When it ended, from the soak's start.
    pub at: Duration,
    pub kind: Kind,
    pub outcome: Outcome,
    pub ttfb: Option<Duration>,
    pub total: Duration,
}

/// Where the server is and what it answers to.
pub struct Target {
    pub port: u16,
    pub key: String,
    pub model: String,
    /// `--client-timeout` of the server.
    pub client_timeout: Duration,
}

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Once upon a time, in a small village,",
    "A list of three colours:",
    "def fibonacci(n):",
    "The quick brown fox",
    "Water boils at",
];
const QUESTIONS: &[&str] = &[
    "What is 2 + 2?",
    "Name a planet.",
    "Say hello in French.",
    "What colour is the sky?",
];

/// A valid request body for `kind` and its `max_tokens`.
fn valid_body(t: &Target, kind: Kind, rng: &mut Rng, max_tokens: u64) -> (String, String) {
    let chat = matches!(kind, Kind::Chat | Kind::ChatStream | Kind::SlowReader);
    let stream = matches!(
        kind,
        Kind::CompletionStream | Kind::ChatStream | Kind::SlowReader | Kind::DropStream
    );
    let temp = *rng.pick(&[0.0, 0.7, 1.0]);
    let mut b = json!({
        "model": t.model,
        "max_tokens": max_tokens,
        "temperature": temp,
        "seed": rng.range(0, 1 << 31),
    });
    if chat {
        b["messages"] = json!([{"role": "user", "content": rng.pick(QUESTIONS)}]);
    } else {
        b["prompt"] = json!(rng.pick(PROMPTS));
    }
    if stream {
        b["stream"] = json!(true);
        if rng.next() % 2 == 0 {
            b["stream_options"] = json!({"include_usage": true});
        }
    }
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    (path.to_string(), b.to_string())
}

fn head(path: &str, host: &str, key: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    )
}

fn connect(t: &Target) -> Result<TcpStream> {
    let s = TcpStream::connect(("127.0.0.1", t.port))
        .with_context(|| format!("connecting to 127.0.0.1:{}", t.port))?;
    s.set_nodelay(true).context("TCP_NODELAY")?;
    // A valid request not answered within this is a failure, not a hang of the soak.
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .context("setting a read timeout")?;
    s.set_write_timeout(Some(Duration::from_secs(30)))
        .context("setting a write timeout")?;
    Ok(s)
}

/// Run one client of `kind`; `start` is the soak's start (for [`Record::at`]).
pub fn run(t: &Target, kind: Kind, rng: &mut Rng, start: Instant) -> Record {
    let t0 = Instant::now();
    let (outcome, ttfb) = match one(t, kind, rng) {
        Ok((o, ttfb)) => (o, ttfb),
        Err(e) => (Outcome::Failed(format!("{e:#}")), None),
    };
    Record {
        at: start.elapsed(),
        kind,
        outcome,
        ttfb,
        total: t0.elapsed(),
    }
}

fn one(t: &Target, kind: Kind, rng: &mut Rng) -> Result<(Outcome, Option<Duration>)> {
    let host = format!("127.0.0.1:{}", t.port);
    let max_tokens = rng.range(1, 12);
    match kind {
        Kind::Completion
        | Kind::CompletionStream
        | Kind::Chat
        | Kind::ChatStream
        | Kind::SlowWriter
        | Kind::SlowReader => {
            let (path, body) = valid_body(t, kind, rng, max_tokens);
            let req = format!("{}{body}", head(&path, &host, &t.key, body.len()));
            let mut s = connect(t)?;
            let sent = Instant::now();
            if kind == Kind::SlowWriter {
                // Eight pieces, 100–300 ms apart: under 2.5 s, within any --client-timeout.
                let bytes = req.as_bytes();
                let step = bytes.len().div_ceil(8);
                for piece in bytes.chunks(step) {
                    s.write_all(piece).context("sending a piece")?;
                    std::thread::sleep(Duration::from_millis(rng.range(100, 300)));
                }
            } else {
                s.write_all(req.as_bytes()).context("sending the request")?;
            }
            let slow = (kind == Kind::SlowReader).then_some(Duration::from_millis(30));
            let r = read_response(&mut s, sent, slow)?;
            if r.status == 429 {
                return Ok((Outcome::Busy, Some(r.ttfb)));
            }
            let stream = matches!(
                kind,
                Kind::CompletionStream | Kind::ChatStream | Kind::SlowReader
            );
            let chat = path.contains("chat");
            let checked = if stream {
                check_stream(&r, chat, max_tokens)
            } else {
                check_json(&r, chat, max_tokens)
            };
            Ok((
                match checked {
                    Ok(()) => Outcome::Ok,
                    Err(e) => Outcome::Failed(format!("{path}: {e:#}")),
                },
                Some(r.ttfb),
            ))
        }
        Kind::UnknownParam
        | Kind::BadKey
        | Kind::Oversized
        | Kind::BadJson
        | Kind::ForeignHost
        | Kind::StalledBody => {
            let (path, body) = valid_body(t, Kind::Completion, rng, max_tokens);
            let (req, key, host) = match kind {
                Kind::UnknownParam => {
                    let mut v: Value = serde_json::from_str(&body).context("own body")?;
                    v["grammar"] = json!("root ::= \"x\"");
                    (v.to_string(), t.key.clone(), host.clone())
                }
                Kind::BadKey => (body, format!("{}x", t.key), host.clone()),
                Kind::ForeignHost => (body, t.key.clone(), "rebind.example:80".into()),
                Kind::BadJson => (
                    body[..body.len() / 2].to_string(),
                    t.key.clone(),
                    host.clone(),
                ),
                _ => (body, t.key.clone(), host.clone()),
            };
            let mut s = connect(t)?;
            let sent = Instant::now();
            match kind {
                Kind::Oversized => {
                    let h = head(&path, &host, &key, 2 << 20);
                    s.write_all(h.as_bytes()).context("sending the head")?;
                    // A little of the body; the rest never comes.
                    s.write_all(&req.as_bytes()[..req.len().min(64)])
                        .context("sending the start of the body")?;
                }
                Kind::StalledBody => {
                    let h = head(&path, &host, &key, req.len());
                    s.write_all(h.as_bytes()).context("sending the head")?;
                    s.write_all(&req.as_bytes()[..req.len() / 3])
                        .context("sending a third of the body")?;
                }
                _ => {
                    let r = format!("{}{req}", head(&path, &host, &key, req.len()));
                    s.write_all(r.as_bytes()).context("sending the request")?;
                }
            }
            let r = read_response(&mut s, sent, None)?;
            let want = kind.expected();
            let outcome = if r.status != want {
                Outcome::Failed(format!(
                    "{}: got {} (want {want}): {}",
                    kind.name(),
                    r.status,
                    String::from_utf8_lossy(&r.body[..r.body.len().min(200)])
                ))
            } else if kind == Kind::UnknownParam
                && serde_json::from_slice::<Value>(&r.body)
                    .ok()
                    .and_then(|v| v["error"]["param"].as_str().map(str::to_string))
                    .as_deref()
                    != Some("grammar")
            {
                Outcome::Failed("unknown-param: the 400 does not name `grammar`".into())
            } else {
                Outcome::Ok
            };
            Ok((outcome, Some(r.ttfb)))
        }
        Kind::HalfHead => {
            let mut s = connect(t)?;
            let h = head("/v1/completions", &host, &t.key, 100);
            s.write_all(&h.as_bytes()[..h.len() / 2])
                .context("sending half a head")?;
            std::thread::sleep(Duration::from_millis(rng.range(0, 200)));
            drop(s);
            Ok((Outcome::Ok, None))
        }
        Kind::HalfBody => {
            let (path, body) = valid_body(t, Kind::Completion, rng, max_tokens);
            let mut s = connect(t)?;
            let h = head(&path, &host, &t.key, body.len());
            s.write_all(h.as_bytes()).context("sending the head")?;
            s.write_all(&body.as_bytes()[..body.len() / 2])
                .context("sending half the body")?;
            std::thread::sleep(Duration::from_millis(rng.range(0, 200)));
            drop(s);
            Ok((Outcome::Ok, None))
        }
        Kind::DropStream => {
            // Long enough to still be decoding when the client leaves.
            let (path, body) = valid_body(t, Kind::DropStream, rng, 48);
            let mut s = connect(t)?;
            let req = format!("{}{body}", head(&path, &host, &t.key, body.len()));
            let sent = Instant::now();
            s.write_all(req.as_bytes()).context("sending the request")?;
            // Up to the first event (or the end, if it came all at once), then gone.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let mut ttfb = None;
            while !contains(&buf, b"data:") {
                let n = s.read(&mut chunk).context("reading the stream")?;
                if n == 0 {
                    break;
                }
                ttfb.get_or_insert_with(|| sent.elapsed());
                buf.extend_from_slice(&chunk[..n]);
            }
            let status = status_of(&buf)?;
            let _ = s.shutdown(Shutdown::Both);
            if status == 429 {
                return Ok((Outcome::Busy, ttfb));
            }
            ensure!(status == 200, "drop-stream: got {status} before leaving");
            Ok((Outcome::Ok, ttfb))
        }
        Kind::ConnectDrop => {
            drop(connect(t)?);
            Ok((Outcome::Ok, None))
        }
    }
}

/// `GET path` with the key, on a fresh connection.
pub fn get(t: &Target, path: &str) -> Result<Response> {
    let mut s = connect(t)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .context("setting a read timeout")?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {}\r\n\
         Connection: close\r\n\r\n",
        t.port, t.key
    );
    let sent = Instant::now();
    s.write_all(req.as_bytes()).context("sending the request")?;
    read_response(&mut s, sent, None)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// A response as read: status, lower-cased headers, the (de-chunked) body, time to first byte.
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub ttfb: Duration,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

fn status_of(buf: &[u8]) -> Result<u16> {
    let line_end = buf.iter().position(|&b| b == b'\n').unwrap_or(buf.len());
    let line = String::from_utf8_lossy(&buf[..line_end]);
    line.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP status line: {line:?}"))
}

/// Reads a response until it is complete (its length, its last chunk, or the close); `slow`:
/// a few bytes at a time with a pause between reads.
fn read_response(s: &mut TcpStream, sent: Instant, slow: Option<Duration>) -> Result<Response> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; if slow.is_some() { 16 } else { 16 << 10 }];
    let mut ttfb = None;
    loop {
        let n = match s.read(&mut chunk) {
            Ok(n) => n,
            // A reset after a complete response is the server's close, not an error.
            Err(e) if parse(&buf, true).is_ok() => {
                let _ = e;
                0
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "reading the response ({} bytes so far, {:.1} s after the send)",
                        buf.len(),
                        sent.elapsed().as_secs_f64()
                    )
                })
            }
        };
        if n == 0 {
            let (status, headers, body) = parse(&buf, true).with_context(|| {
                format!(
                    "the connection closed before a complete response ({} bytes)",
                    buf.len()
                )
            })?;
            return Ok(Response {
                status,
                headers,
                body,
                ttfb: ttfb.unwrap_or_else(|| sent.elapsed()),
            });
        }
        ttfb.get_or_insert_with(|| sent.elapsed());
        buf.extend_from_slice(&chunk[..n]);
        if let Ok((status, headers, body)) = parse(&buf, false) {
            return Ok(Response {
                status,
                headers,
                body,
                ttfb: ttfb.unwrap_or_else(|| sent.elapsed()),
            });
        }
        if let Some(d) = slow {
            std::thread::sleep(d);
        }
    }
}

type Parsed = (u16, Vec<(String, String)>, Vec<u8>);

/// The response in `buf` if it is complete; `closed`: the peer closed, so a body without a length
/// ends here.
fn parse(buf: &[u8], closed: bool) -> Result<Parsed> {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("the head is incomplete")?;
    let head = std::str::from_utf8(&buf[..end]).context("the head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = status_of(lines.next().unwrap_or_default().as_bytes())?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &buf[end + 4..];
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    if get("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        let body = dechunk(rest)?.context("the chunked body is incomplete")?;
        return Ok((status, headers, body));
    }
    if let Some(n) = get("content-length") {
        let n: usize = n.parse().with_context(|| format!("Content-Length {n:?}"))?;
        ensure!(rest.len() >= n, "the body is incomplete");
        return Ok((status, headers, rest[..n].to_vec()));
    }
    ensure!(closed, "a body without a length, still open");
    Ok((status, headers, rest.to_vec()))
}

/// A chunked body: `None` while its last chunk has not arrived.
fn dechunk(mut b: &[u8]) -> Result<Option<Vec<u8>>> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(&b[..eol]).context("a chunk size line is not UTF-8")?;
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("bad chunk size line {line:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            // No trailers from kiln: the last chunk is `0\r\n\r\n`.
            return Ok(b.starts_with(b"\r\n").then_some(out));
        }
        if b.len() < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&b[..size]);
        ensure!(
            &b[size..size + 2] == b"\r\n",
            "a chunk does not end in CRLF"
        );
        b = &b[size + 2..];
    }
}

fn check_usage(v: &Value, max_tokens: u64) -> Result<()> {
    let c = v["usage"]["completion_tokens"]
        .as_u64()
        .context("no usage.completion_tokens")?;
    ensure!(
        (1..=max_tokens).contains(&c),
        "usage.completion_tokens {c} is not in 1..={max_tokens}"
    );
    ensure!(
        v["usage"]["prompt_tokens"].as_u64().is_some_and(|p| p >= 1),
        "no usage.prompt_tokens"
    );
    Ok(())
}

fn check_json(r: &Response, chat: bool, max_tokens: u64) -> Result<()> {
    let text = String::from_utf8_lossy(&r.body);
    ensure!(r.status == 200, "got {} (want 200): {text}", r.status);
    let v: Value = serde_json::from_slice(&r.body).with_context(|| format!("not JSON: {text}"))?;
    let c = &v["choices"][0];
    if chat {
        ensure!(
            v["object"] == "chat.completion",
            "object is not chat.completion: {text}"
        );
        ensure!(
            c["message"]["role"] == "assistant" && c["message"]["content"].is_string(),
            "no assistant message: {text}"
        );
    } else {
        ensure!(
            v["object"] == "text_completion",
            "object is not text_completion: {text}"
        );
        ensure!(c["text"].is_string(), "no choices[0].text: {text}");
    }
    ensure!(
        matches!(c["finish_reason"].as_str(), Some("stop" | "length")),
        "finish_reason is not stop or length: {text}"
    );
    check_usage(&v, max_tokens).with_context(|| text.to_string())
}

fn check_stream(r: &Response, chat: bool, max_tokens: u64) -> Result<()> {
    let text = String::from_utf8_lossy(&r.body);
    ensure!(r.status == 200, "got {} (want 200): {text}", r.status);
    ensure!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "Content-Type is not text/event-stream"
    );
    let events: Vec<&str> = text
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    ensure!(
        events.last() == Some(&"data: [DONE]"),
        "the stream does not end with data: [DONE]: {text}"
    );
    let (mut finished, mut first) = (false, true);
    for e in &events[..events.len() - 1] {
        let data = e
            .strip_prefix("data: ")
            .with_context(|| format!("an event is not `data: `: {e:?}"))?;
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("an event is not JSON: {data}"))?;
        if let Some(err) = v.get("error") {
            bail!("the stream carries an error: {err}");
        }
        if !v["usage"].is_null() {
            check_usage(&v, max_tokens)?;
        }
        let Some(c) = v["choices"].get(0) else {
            continue;
        };
        if chat {
            ensure!(
                v["object"] == "chat.completion.chunk",
                "object is not chat.completion.chunk: {data}"
            );
            if first {
                ensure!(
                    c["delta"]["role"] == "assistant",
                    "the first delta has no role: {data}"
                );
            }
        } else {
            ensure!(c["text"].is_string(), "a chunk has no text: {data}");
        }
        first = false;
        if !c["finish_reason"].is_null() {
            ensure!(
                matches!(c["finish_reason"].as_str(), Some("stop" | "length")),
                "finish_reason is not stop or length: {data}"
            );
            finished = true;
        }
    }
    ensure!(finished, "no chunk has a finish_reason: {text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_complete_only_when_whole() {
        let chunked =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
        let (s, _, b) = parse(chunked, false).expect("complete");
        assert_eq!((s, b.as_slice()), (200, &b"hello"[..]));
        assert!(parse(&chunked[..chunked.len() - 2], false).is_err());
        let sized = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nabc";
        assert_eq!(parse(sized, false).expect("complete").0, 413);
        assert!(parse(&sized[..sized.len() - 1], true).is_err());
    }

    #[test]
    fn the_mix_is_seeded() {
        let a: Vec<Kind> = (0..50).scan(Rng::new(7), |r, _| Some(r.kind())).collect();
        let b: Vec<Kind> = (0..50).scan(Rng::new(7), |r, _| Some(r.kind())).collect();
        assert_eq!(a, b);
        let c: Vec<Kind> = (0..50).scan(Rng::new(8), |r, _| Some(r.kind())).collect();
        assert_ne!(a, c);
    }

    #[test]
    fn a_stream_must_end_and_finish() {
        let r = |body: &str| Response {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: body.as_bytes().to_vec(),
            ttfb: Duration::ZERO,
        };
        let good = "data: {\"object\":\"text_completion\",\"choices\":[{\"text\":\"a\",\"finish_reason\":null}]}\n\n\
                    data: {\"object\":\"text_completion\",\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n";
        check_stream(&r(good), false, 4).expect("a good stream");
        let cut = &good[..good.len() - "data: [DONE]\n\n".len()];
        assert!(check_stream(&r(cut), false, 4).is_err());
    }
}
