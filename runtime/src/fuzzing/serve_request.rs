//! `serve_request`: arbitrary bytes as one client's whole byte stream into `kiln serve`'s own
//! router and HTTP/1 connection handling ([`crate::serve::start`],
//! [`crate::serve::serve_connection_with`]), over an in-memory pipe, in front of the real engine
//! on the seeded fixture model (`model::fixture`, with Phi-3.5-mini's chat template): a
//! well-formed request goes through HTTP parsing, the Host guard and the key, the body limits,
//! JSON, parameter validation, the chat template, tokenization and a few real decode steps.
//!
//! Invariants, per input: no panic; the bytes that come back are a sequence of well-formed HTTP/1
//! responses (possibly none: a closed connection), each with a status of the documented set,
//! every error body OpenAI's `{"error": {message, type, param, code}}`, every event stream ending
//! `data: [DONE]`, no body naming where the model file or the sources live; and afterwards the
//! server still answers a known-good completion with 200.
//!
//! The one difference from `kiln serve`: the connection is served with `half_close`, so the end
//! of the input does not cancel the requests in it (the client here sends everything, then
//! reads); `kiln serve` takes a client's close mid-request as its going away.

use crate::gguf::writer::GgufWriter;
use crate::gguf::{GgufFile, Value};
use crate::model::{BackendSel, KvType, Model, Options};
use crate::serve::{self, Config, Loader, Server};
use anyhow::{Context, Result};
use serde_json::Value as Json;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The served model's id (requests name it in `model`).
pub const MODEL_ID: &str = "kiln-llama-fixture";
/// The bearer key the server is started with.
pub const KEY: &str = "kiln-fuzz-key";
/// Tokens per sequence: prompts and generations stay short, so an input costs little engine time.
const N_CTX: usize = 128;
const TEMPLATE: &str = include_str!("../../tests/phi3_5_mini_chat_template.jinja");

/// The statuses `kiln serve` answers with (docs/serving.md, "Its doors"), hyper's own (400 for
/// a malformed head, 414, 431) and axum's 405 for a route asked with another method. Never 500
/// or 503 here: the model is loaded and the report passes.
pub const STATUSES: &[u16] = &[100, 200, 400, 401, 403, 404, 405, 408, 413, 414, 429, 431];

/// A known-good request, answered 200 after every input.
pub fn known_good() -> Vec<u8> {
    let body =
        format!(r#"{{"model":"{MODEL_ID}","prompt":"the board","max_tokens":1,"temperature":0}}"#);
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The llama fixture on the CPU from `path` (which is removed once it is mapped), 128 tokens a
/// sequence; also the engine's own tests' model.
pub struct Fixture {
    pub path: PathBuf,
}

impl Loader for Fixture {
    fn open(&self) -> Result<GgufFile> {
        let f = GgufFile::open(&self.path).context("opening the fixture")?;
        // Mapped: the file's name is gone, only the harness knows where it was.
        let _ = std::fs::remove_file(&self.path);
        Ok(f)
    }
    fn load<'m>(&self, f: &'m GgufFile) -> Result<Model<'m>> {
        Model::load(
            f,
            &Options {
                backend: BackendSel::Cpu,
                threads: 1,
                ..Options::default()
            },
        )
    }
    fn n_ctx(&self, _: &Model<'_>) -> usize {
        N_CTX
    }
    fn kv(&self) -> KvType {
        KvType::F16
    }
}

struct Harness {
    rt: tokio::runtime::Runtime,
    server: Server,
    /// Where the model file was: no response may name it.
    secret: String,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| start().expect("starting the fuzz server"))
}

fn start() -> Result<Harness> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("kiln-fuzz-{}-{nanos:08x}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(crate::model::fixture::FILE_NAME);
    let bytes = crate::model::fixture::gguf_with(|w: &mut GgufWriter| {
        w.add(
            "tokenizer.chat_template",
            Value::String(TEMPLATE.to_string()),
        )?;
        Ok(())
    })?;
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    let cfg = Config {
        host: "127.0.0.1".into(),
        port: 0,
        model_id: MODEL_ID.into(),
        parallel: 2,
        queue: 8,
        key: Some(KEY.into()),
        report: Some(br#"{"verdict":"PASS","checks":[{"id":"fuzz","status":"pass"}]}"#.to_vec()),
        missing_report: None,
        client_timeout: Duration::from_secs(30),
        max_connections: 1,
    };
    let server = serve::start(&cfg, Some(Fixture { path }))?;
    let t0 = std::time::Instant::now();
    loop {
        match server.ready() {
            Some(Ok(_)) => break,
            Some(Err(e)) => anyhow::bail!("the fixture did not load: {e}"),
            None if t0.elapsed() > Duration::from_secs(120) => {
                anyhow::bail!("no model after 120 s")
            }
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    let _ = std::fs::remove_dir(&dir);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(Harness {
        rt,
        server,
        secret: dir.to_string_lossy().into_owned(),
    })
}

/// What comes back for `input`: every byte the server wrote until it closed the connection.
async fn exchange(server: &Server, input: &[u8]) -> Vec<u8> {
    let (client, server_io) = tokio::io::duplex(64 << 10);
    let conn = tokio::spawn(serve::serve_connection_with(
        server_io,
        server.router.clone(),
        Duration::from_secs(30),
        true,
    ));
    let (mut rd, mut wr) = tokio::io::split(client);
    let input = input.to_vec();
    let writer = tokio::spawn(async move {
        // The server may close before it has read everything (a 413, a malformed head).
        let _ = wr.write_all(&input).await;
        let _ = wr.shutdown().await;
    });
    let mut out = Vec::new();
    let read = async {
        let mut buf = [0u8; 16 << 10];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    out.extend_from_slice(&buf[..n]);
                    assert!(out.len() <= 64 << 20, "over 64 MiB of answer to one input");
                }
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .is_err()
    {
        panic!("the server neither answered nor closed the connection within 60 s");
    }
    let _ = writer.await;
    conn.await.expect("the connection task panicked");
    out
}

/// One response as it came over the wire.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The responses in `out`, or what is malformed about them. A response to HEAD announces a length
/// but carries no body: a body that is not there, or where the next response starts, is taken as
/// that.
pub fn parse_responses(mut out: &[u8]) -> Result<Vec<Response>, String> {
    let mut rs = Vec::new();
    while !out.is_empty() {
        let end = find(out, b"\r\n\r\n").ok_or("a response head without its end")?;
        let head = std::str::from_utf8(&out[..end]).map_err(|_| "a head that is not UTF-8")?;
        out = &out[end + 4..];
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line
            .strip_prefix("HTTP/1.1 ")
            .or_else(|| status_line.strip_prefix("HTTP/1.0 "))
            .and_then(|r| r.get(..3))
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("a bad status line {status_line:?}"))?;
        let mut headers = Vec::new();
        for l in lines {
            let (k, v) = l
                .split_once(':')
                .ok_or_else(|| format!("a bad header line {l:?}"))?;
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
        let mut r = Response {
            status,
            headers,
            body: Vec::new(),
        };
        if status < 200 {
            rs.push(r);
            continue;
        }
        let chunked = r
            .header("transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        if chunked {
            loop {
                let e = find(out, b"\r\n").ok_or("a chunk size line without its end")?;
                let size = std::str::from_utf8(&out[..e])
                    .ok()
                    .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
                    .ok_or("a bad chunk size")?;
                out = &out[e + 2..];
                if size == 0 {
                    out = out
                        .strip_prefix(b"\r\n")
                        .ok_or("no end after the last chunk")?;
                    break;
                }
                let chunk = out.get(..size).ok_or("a chunk cut short")?;
                r.body.extend_from_slice(chunk);
                out = out[size..]
                    .strip_prefix(b"\r\n")
                    .ok_or("a chunk without its end")?;
            }
        } else if let Some(n) = r.header("content-length") {
            let n: usize = n
                .parse()
                .map_err(|_| format!("a bad content-length {n:?}"))?;
            let head_reply = out.len() < n || (n > 0 && out.starts_with(b"HTTP/1."));
            if !head_reply {
                r.body = out[..n].to_vec();
                out = &out[n..];
            }
        } else {
            // Delimited by the close (an HTTP/1.0 client's stream): the rest.
            r.body = out.to_vec();
            out = &[];
        }
        rs.push(r);
    }
    Ok(rs)
}

/// What must hold of one response.
fn check(r: &Response, secret: &str) -> Result<(), String> {
    if !STATUSES.contains(&r.status) {
        return Err(format!(
            "status {} is not one kiln serve answers with",
            r.status
        ));
    }
    let text = String::from_utf8_lossy(&r.body);
    for leak in [secret, env!("CARGO_MANIFEST_DIR"), ".rs:"] {
        if text.contains(leak) {
            return Err(format!("a body names {leak:?}"));
        }
    }
    let ctype = r.header("content-type").unwrap_or_default();
    if ctype.starts_with("application/json") && !r.body.is_empty() {
        let v: Json =
            serde_json::from_slice(&r.body).map_err(|e| format!("a JSON body that is not: {e}"))?;
        if r.status >= 400 {
            let e = v.get("error").ok_or("an error body without error")?;
            for k in ["message", "type", "param", "code"] {
                if e.get(k).is_none() {
                    return Err(format!("an error without {k}"));
                }
            }
        }
    } else if ctype.starts_with("text/event-stream") {
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        if events.last() != Some(&"data: [DONE]") {
            return Err("an event stream that does not end with data: [DONE]".into());
        }
        for e in &events[..events.len() - 1] {
            let data = e
                .strip_prefix("data: ")
                .ok_or("an event that is not data")?;
            serde_json::from_str::<Json>(data)
                .map_err(|err| format!("an event that is not JSON: {err}"))?;
        }
    } else if r.status >= 400 && r.status != 405 && !r.body.is_empty() {
        // hyper's own errors (a malformed head, 431) carry no body; kiln's are JSON.
        return Err(format!("an error body that is not JSON ({ctype:?})"));
    }
    Ok(())
}

/// The target's body: panics if an invariant breaks.
pub fn run(data: &[u8]) {
    let h = harness();
    h.rt.block_on(async {
        let out = exchange(&h.server, data).await;
        let rs = parse_responses(&out).unwrap_or_else(|e| {
            panic!(
                "malformed answer ({e}): {:?}",
                String::from_utf8_lossy(&out[..out.len().min(2000)])
            )
        });
        for r in &rs {
            if let Err(e) = check(r, &h.secret) {
                panic!(
                    "{e}: status {} body {:?}",
                    r.status,
                    String::from_utf8_lossy(&r.body[..r.body.len().min(2000)])
                );
            }
        }
        let out = exchange(&h.server, &known_good()).await;
        let rs = parse_responses(&out).unwrap_or_default();
        assert!(
            rs.len() == 1 && rs[0].status == 200,
            "after the input the server no longer answers a known-good request: {:?}",
            String::from_utf8_lossy(&out[..out.len().min(2000)])
        );
    });
}

/// For diagnosis: the statuses and bodies answered to `data`.
pub fn answers(data: &[u8]) -> Vec<(u16, String)> {
    let h = harness();
    h.rt.block_on(async {
        let out = exchange(&h.server, data).await;
        parse_responses(&out)
            .unwrap_or_default()
            .into_iter()
            .map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned()))
            .collect()
    })
}
