//! The HTTP side: routes, request parsing, OpenAI-shaped responses and errors.

// A Response as the error of the parsing helpers: built once per rejected request, never hot.
#![allow(clippy::result_large_err)]

use super::engine::{self, Event, Input, Job, Loader, Params};
use super::metrics::Metrics;
use super::Config;
use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use tokio::sync::mpsc::unbounded_channel;
use tokio_stream::StreamExt as _;

/// Request bodies above this get 413 (one announced above it, before it is read).
const BODY_LIMIT: usize = 1 << 20;
/// A request's head (request line and headers) above this gets 431 from hyper, as do more than
/// its default 100 headers.
const HEAD_LIMIT: usize = 64 << 10;

struct App {
    model_id: String,
    /// The API key's SHA-256: compared in constant time with the presented key's.
    key: Option<[u8; 32]>,
    /// Bound to loopback: a request whose `Host` is not a loopback name or address gets 403.
    loopback_only: bool,
    /// How requests are authorised, as /health tells it: "api-key", "loopback" or "insecure".
    access: &'static str,
    report: Option<Vec<u8>>,
    /// Why inference is refused: the `--report` given did not PASS (see [`refusal`]).
    refused: Option<String>,
    ready: OnceLock<Result<usize, String>>,
    jobs: SyncSender<Job>,
    metrics: Arc<Metrics>,
    client_timeout: std::time::Duration,
}

type St = State<Arc<App>>;

/// Nothing is served that the self-check did not prove: a report whose verdict is not PASS (or
/// that is no report) refuses inference, naming the failed checks. `None`: PASS.
fn refusal(report: &[u8]) -> Option<String> {
    let Ok(v) = serde_json::from_slice::<Value>(report) else {
        return Some("the --report file is not a self-check report (not JSON)".into());
    };
    match v.get("verdict").and_then(Value::as_str) {
        Some("PASS") => None,
        verdict => {
            let failed: Vec<&str> = v
                .get("checks")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|c| c.get("status").and_then(Value::as_str) == Some("fail"))
                .filter_map(|c| c.get("id").and_then(Value::as_str))
                .collect();
            Some(format!(
                "the self-check did not pass (verdict {}); failed: {}",
                verdict.unwrap_or("missing"),
                if failed.is_empty() {
                    "none named".to_string()
                } else {
                    failed.join(", ")
                }
            ))
        }
    }
}

fn error(
    status: u16,
    kind: &str,
    code: &str,
    param: Option<&str>,
    message: impl Into<String>,
) -> Response {
    let s = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        s,
        axum::Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}})),
    )
        .into_response()
}

fn bad(param: Option<&str>, message: impl Into<String>) -> Response {
    error(
        400,
        "invalid_request_error",
        "invalid_request_error",
        param,
        message,
    )
}

/// The server, started: its router (every route and layer `kiln serve` answers with) over the
/// engine thread, which loads the model meanwhile.
pub struct Server {
    pub router: Router,
    app: Arc<App>,
}

impl Server {
    /// The model's state: None while it loads, then its context length or why it did not load.
    pub fn ready(&self) -> Option<Result<usize, String>> {
        self.app.ready.get().cloned()
    }

    /// Requests the engine has not taken yet (0 once every job was admitted).
    pub fn queue_depth(&self) -> u64 {
        self.app.metrics.queue_depth.load(Ordering::Relaxed)
    }
}

/// Build the router and start the engine thread on `model` (None: the report, `/health` and
/// `/metrics` only). Needs no runtime; the router is served by [`serve_connection`].
pub fn start(cfg: &Config, model: Option<impl Loader>) -> Result<Server> {
    let (jobs, rx) = std::sync::mpsc::sync_channel(cfg.queue.max(1));
    let metrics = Arc::new(Metrics::default());
    let loopback_only = is_loopback_name(&cfg.host);
    let access = match (&cfg.key, loopback_only) {
        (Some(_), _) => "api-key",
        (None, true) => "loopback",
        (None, false) => "insecure",
    };
    if access == "insecure" {
        eprintln!(
            "kiln serve: INSECURE: no API key on {} (--insecure): anyone who reaches the port may use the model",
            cfg.host
        );
    }
    let app = Arc::new(App {
        client_timeout: cfg.client_timeout,
        model_id: cfg.model_id.clone(),
        key: cfg.key.as_ref().map(|k| sha256(k.as_bytes())),
        loopback_only,
        access,
        refused: cfg
            .missing_report
            .clone()
            .or_else(|| cfg.report.as_deref().and_then(refusal)),
        report: cfg.report.clone(),
        ready: OnceLock::new(),
        jobs,
        metrics: metrics.clone(),
    });
    if let Some(why) = &app.refused {
        // Degraded: the report and /health answer, nothing is loaded (neither the model nor a
        // backend that the failed self-check may be about).
        eprintln!("kiln serve: degraded, no model loaded: {why}");
    } else if let Some(model) = model {
        let parallel = cfg.parallel;
        let app2 = app.clone();
        std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                engine::run(model, parallel, rx, metrics, |r| {
                    if let Err(e) = &r {
                        eprintln!("kiln serve: the model did not load: {e}");
                    } else {
                        eprintln!("kiln serve: ready");
                    }
                    let _ = app2.ready.set(r.map(|r| r.n_ctx));
                })
            })
            .context("starting the inference thread")?;
    } else {
        eprintln!("kiln serve: no MODEL: serving the report, /health and /metrics only");
        let _ = app.ready.set(Err(
            "no model is served (kiln serve was started without MODEL)".into(),
        ));
    }
    // Behind the key: everything but /health (the report and /metrics tell versions and load).
    let keyed = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route_layer(middleware::from_fn_with_state(app.clone(), body_deadline))
        .route("/kiln/report", get(kiln_report))
        .route("/metrics", get(metrics_text))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth));
    let router = Router::new()
        .merge(keyed)
        .route("/health", get(health))
        .fallback(|| async {
            error(
                404,
                "invalid_request_error",
                "not_found",
                None,
                "no such endpoint",
            )
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn_with_state(app.clone(), count))
        .layer(middleware::from_fn_with_state(app.clone(), host_guard))
        .with_state(app.clone());
    Ok(Server { router, app })
}

/// `kiln serve`: [`start`], then listen on `cfg.host:cfg.port` and serve until the process ends.
pub async fn serve(cfg: Config, model: Option<impl Loader>) -> Result<()> {
    let server = start(&cfg, model)?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    eprintln!("kiln serve: listening on http://{addr}");
    accept(listener, server, &cfg).await
}

/// The accept loop (what `axum::serve` does, plus what it leaves out): at most
/// `--max-connections` connections at once, the rest closed on accept (counted in `/metrics`),
/// each served by [`serve_connection`]. A connection's errors end that connection only.
async fn accept(listener: tokio::net::TcpListener, server: Server, cfg: &Config) -> Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin, keep serving.
                eprintln!("kiln serve: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            server
                .app
                .metrics
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (router, timeout) = (server.router.clone(), cfg.client_timeout);
        tokio::spawn(async move {
            let _permit = permit;
            serve_connection(stream, router, timeout).await;
        });
    }
}

/// One client's connection: hyper's HTTP/1 with a timer, so a client that stalls in its
/// headers, or keeps an idle connection open, is cut after `timeout`, and a head over
/// [`HEAD_LIMIT`] gets 431. Ends when the connection does; a client's protocol error or reset is
/// that client's end, not the server's. A client that closes its side while its request is
/// being answered has gone away: the request is dropped (and the engine frees its slot).
pub async fn serve_connection<I>(io: I, router: Router, timeout: std::time::Duration)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    serve_connection_with(io, router, timeout, false).await
}

/// [`serve_connection`], but with `half_close` a client's end of input does not cancel the
/// requests it already sent: each is answered before the connection closes. The fuzz targets
/// use it to send one whole byte stream and read every answer to it; `kiln serve` does not.
pub async fn serve_connection_with<I>(
    io: I,
    router: Router,
    timeout: std::time::Duration,
    half_close: bool,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use hyper_util::rt::{TokioIo, TokioTimer};
    let service = hyper_util::service::TowerToHyperService::new(router);
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .max_header_size(HEAD_LIMIT)
        .half_close(half_close)
        .serve_connection(TokioIo::new(io), service);
    let _ = conn.await;
}

/// The body of a request must arrive within `--client-timeout` of its headers (else 408) and
/// within [`BODY_LIMIT`] (else 413): read whole here, so no handler waits on a slow client.
async fn body_deadline(State(app): St, req: Request, next: Next) -> Response {
    // A body announced over the limit is refused before a byte of it is read.
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if announced.is_some_and(|n| n > BODY_LIMIT as u64) {
        // Answered at once. Then, as nginx's lingering close does, up to LINGER bytes of what
        // the client is still sending are read and dropped (for at most 5 s) before the
        // connection closes: a client that writes its whole body before it reads sees the 413,
        // not a reset.
        const LINGER: usize = 4 << 20;
        let body = req.into_body();
        tokio::spawn(async move {
            use http_body_util::BodyExt;
            let drain = async move {
                let (mut body, mut n) = (body, 0usize);
                while let Some(Ok(f)) = body.frame().await {
                    n += f.data_ref().map_or(0, |d| d.len());
                    if n > LINGER {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
        });
        let mut r = too_large_body();
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        return r;
    }
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(app.client_timeout, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Err(_) => error(
            408,
            "invalid_request_error",
            "request_timeout",
            None,
            format!(
                "the request body did not arrive within {} s",
                app.client_timeout.as_secs()
            ),
        ),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_large {
                too_large_body()
            } else {
                bad(None, format!("reading the request body: {e}"))
            }
        }
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    }
}

async fn count(State(app): St, req: Request, next: Next) -> Response {
    app.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let r = next.run(req).await;
    if r.status().is_client_error() || r.status().is_server_error() {
        app.metrics.errors.fetch_add(1, Ordering::Relaxed);
    }
    r
}

fn sha256(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

/// Whether `host` (a `--host` value, or a `Host` header's name without its port) names loopback:
/// `localhost` (and `*.localhost`, which resolvers keep on loopback, RFC 6761), 127.0.0.0/8 or ::1.
pub fn is_loopback_name(host: &str) -> bool {
    let h = host.trim_end_matches('.').to_ascii_lowercase();
    let h = h
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .unwrap_or(&h);
    h == "localhost"
        || h.ends_with(".localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A `Host` header's name, its port taken off (`name:port`, `[v6]:port`, `[v6]`).
fn host_name(value: &str) -> &str {
    if value.starts_with('[') {
        return value
            .split_once(']')
            .map_or(value, |(v, _)| &value[..v.len() + 1]);
    }
    match value.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => value,
    }
}

/// Bound to loopback, only a request that names loopback in its `Host` is served: a web page
/// that rebinds its own domain to 127.0.0.1 sends its domain, and gets 403.
async fn host_guard(State(app): St, req: Request, next: Next) -> Response {
    if app.loopback_only {
        let host = req
            .headers()
            .get(header::HOST)
            .map(|v| v.to_str().map(host_name));
        let ok = matches!(host, Some(Ok(h)) if is_loopback_name(h));
        if !ok {
            return error(
                403,
                "invalid_request_error",
                "forbidden_host",
                None,
                "this server listens on loopback only and answers only a Host that names loopback \
                 (localhost, 127.0.0.1, [::1])",
            );
        }
    }
    next.run(req).await
}

async fn auth(State(app): St, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(k) = &app.key {
        use subtle::ConstantTimeEq;
        let got = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Digests of equal length, compared in constant time: neither the key's bytes nor its
        // length show in the time a wrong key takes.
        let ok = got.is_some_and(|g| bool::from(sha256(g.as_bytes()).ct_eq(k)));
        if !ok {
            return error(
                401,
                "invalid_request_error",
                "invalid_api_key",
                None,
                "a valid bearer API key is required",
            );
        }
    }
    next.run(req).await
}

async fn health(State(app): St) -> Response {
    let verdict = app
        .report
        .as_ref()
        .and_then(|r| serde_json::from_slice::<Value>(r).ok())
        .and_then(|v| v.get("verdict").cloned());
    if let Some(why) = &app.refused {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "selfcheck_failed", "error": why, "verdict": verdict, "access": app.access})),
        )
            .into_response();
    }
    match app.ready.get() {
        Some(Ok(_)) => (
            StatusCode::OK,
            axum::Json(json!({"status": "ok", "model": app.model_id, "verdict": verdict, "access": app.access})),
        )
            .into_response(),
        Some(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "error", "error": e, "verdict": verdict, "access": app.access})),
        )
            .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading", "verdict": verdict, "access": app.access})),
        )
            .into_response(),
    }
}

async fn kiln_report(State(app): St) -> Response {
    match &app.report {
        Some(r) => ([(header::CONTENT_TYPE, "application/json")], r.clone()).into_response(),
        None => error(
            404,
            "invalid_request_error",
            "no_report",
            None,
            "kiln serve was started without --report",
        ),
    }
}

async fn metrics_text(State(app): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

async fn models(State(app): St) -> Response {
    axum::Json(json!({"object": "list", "data": [{"id": app.model_id, "object": "model", "created": 0, "owned_by": "kiln"}]})).into_response()
}

/// 413, in OpenAI's shape.
fn too_large_body() -> Response {
    error(
        413,
        "invalid_request_error",
        "request_too_large",
        None,
        format!("the body is larger than {BODY_LIMIT} bytes"),
    )
}

fn body_json(
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Map<String, Value>, Response> {
    let b = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large_body()
        } else {
            bad(None, e.body_text())
        }
    })?;
    match serde_json::from_slice::<Value>(&b) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(bad(None, "the body must be a JSON object")),
        Err(e) => Err(bad(None, format!("the body is not valid JSON: {e}"))),
    }
}

/// The parameters kiln implements on both endpoints (`top_k` is llama.cpp's and vLLM's
/// extension; `user` only names the end user to the provider and asks for nothing in the
/// output), then each endpoint's own.
const PARAMS: &[&str] = &[
    "model",
    "max_tokens",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "user",
];
const COMPLETION_ONLY: &[&str] = &["prompt"];
const CHAT_ONLY: &[&str] = &["messages", "max_completion_tokens"];

/// OpenAI parameters kiln does not implement, accepted only at the value that asks for nothing
/// (OpenAI's default; `null` always is), as that value's description: a client that asked for
/// log-probabilities, penalties, tools or a format gets 400 naming the parameter, never a plain
/// answer and 200.
fn neutral_only(k: &str, v: &Value, chat: bool) -> Option<(&'static str, bool)> {
    let zero = |v: &Value| v.as_f64() == Some(0.0);
    let empty = |v: &Value| v.as_object().is_some_and(|o| o.is_empty());
    let r = match k {
        "frequency_penalty" | "presence_penalty" => ("0", zero(v)),
        "logit_bias" => ("{}", empty(v)),
        "logprobs" if chat => ("false", v == &Value::Bool(false)),
        "logprobs" => ("null", false),
        "top_logprobs" if chat => ("0", zero(v)),
        "echo" if !chat => ("false", v == &Value::Bool(false)),
        "best_of" if !chat => ("1", v.as_u64() == Some(1)),
        "suffix" if !chat => ("\"\"", v.as_str() == Some("")),
        "response_format" if chat => (
            "{\"type\": \"text\"}",
            v.as_object()
                .is_some_and(|o| o.len() == 1 && o.get("type") == Some(&json!("text"))),
        ),
        "tools" | "functions" if chat => ("[]", v.as_array().is_some_and(|a| a.is_empty())),
        "tool_choice" | "function_call" if chat => ("\"none\"", v.as_str() == Some("none")),
        "parallel_tool_calls" if chat => ("a boolean (there are no tools)", v.is_boolean()),
        "store" if chat => ("false", v == &Value::Bool(false)),
        "metadata" if chat => ("{}", empty(v)),
        "service_tier" => (
            "\"auto\" or \"default\"",
            matches!(v.as_str(), Some("auto" | "default")),
        ),
        _ => return None,
    };
    Some((r.0, r.1 || v.is_null()))
}

/// Every parameter of the request is implemented, or at its neutral value; anything else is a
/// 400 naming it (a parameter silently ignored is a request answered as if it had not been made).
fn honest(m: &serde_json::Map<String, Value>, chat: bool) -> Result<(), Response> {
    let own = if chat { CHAT_ONLY } else { COMPLETION_ONLY };
    for (k, v) in m {
        if PARAMS.contains(&k.as_str()) || own.contains(&k.as_str()) {
            continue;
        }
        let msg = match neutral_only(k, v, chat) {
            Some((_, true)) => continue,
            Some(("null", false)) => format!("kiln does not implement {k}: only null is accepted"),
            Some((neutral, false)) => {
                format!("kiln does not implement {k}: it is accepted only as {neutral} or null")
            }
            None => format!(
                "unknown parameter {k}: kiln refuses a parameter it does not implement rather \
                 than ignore it"
            ),
        };
        return Err(error(
            400,
            "invalid_request_error",
            "unsupported_parameter",
            Some(k),
            msg,
        ));
    }
    Ok(())
}

fn num(
    m: &serde_json::Map<String, Value>,
    k: &'static str,
    lo: f64,
    hi: f64,
    def: f64,
) -> Result<f64, Response> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(def),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(v) if (lo..=hi).contains(&v) => Ok(v),
            _ => Err(bad(
                Some(k),
                format!("{k} must be a number in [{lo}, {hi}]"),
            )),
        },
        Some(_) => Err(bad(Some(k), format!("{k} must be a number"))),
    }
}

fn uint(m: &serde_json::Map<String, Value>, k: &'static str) -> Result<Option<u64>, Response> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(Some(k), format!("{k} must be a non-negative integer"))),
    }
}

fn params(
    m: &serde_json::Map<String, Value>,
    default_max: Option<usize>,
) -> Result<Params, Response> {
    let max_tokens = match uint(m, "max_completion_tokens")?.or(uint(m, "max_tokens")?) {
        Some(0) => return Err(bad(Some("max_tokens"), "max_tokens must be at least 1")),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => default_max,
    };
    let stop = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad(Some("stop"), "stop must be a string or up to 4 strings"))?,
        Some(_) => {
            return Err(bad(
                Some("stop"),
                "stop must be a string or up to 4 strings",
            ))
        }
    };
    if let Some(n) = uint(m, "n")? {
        if n != 1 {
            return Err(bad(Some("n"), "only n = 1 is supported"));
        }
    }
    Ok(Params {
        max_tokens,
        temp: num(m, "temperature", 0.0, 2.0, 1.0)? as f32,
        top_p: num(m, "top_p", 0.0, 1.0, 1.0)? as f32,
        top_k: match uint(m, "top_k")? {
            None => 0,
            Some(k) => u32::try_from(k)
                .map(|k| k as usize)
                .map_err(|_| bad(Some("top_k"), "top_k must be an integer in [0, 4294967295]"))?,
        },
        seed: match m.get("seed") {
            None | Some(Value::Null) => 42,
            Some(v) => v
                .as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .ok_or_else(|| bad(Some("seed"), "seed must be an integer"))?,
        },
        stop,
    })
}

fn check_model(app: &App, m: &serde_json::Map<String, Value>) -> Result<(), Response> {
    match m.get("model") {
        Some(Value::String(s)) if *s == app.model_id => Ok(()),
        Some(Value::String(s)) => Err(error(
            404,
            "invalid_request_error",
            "model_not_found",
            Some("model"),
            format!(
                "the model {s:?} does not exist; this server serves {:?}",
                app.model_id
            ),
        )),
        _ => Err(bad(Some("model"), "model must be a string")),
    }
}

async fn completions(State(app): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let m = body_json(body)?;
        honest(&m, false)?;
        check_model(&app, &m)?;
        let input = match m.get("prompt") {
            Some(Value::String(s)) => Input::Text(s.clone()),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Input::Text(a[0].as_str().unwrap_or_default().to_string())
            }
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|v| v.is_u64()) => Input::Ids(
                a.iter()
                    .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| bad(Some("prompt"), "token ids must fit in 32 bits"))?,
            ),
            _ => {
                return Err(bad(
                    Some("prompt"),
                    "prompt must be a string, one string in a list, or a list of token ids",
                ))
            }
        };
        let p = params(&m, Some(16))?;
        Ok::<_, Response>((input, p, stream_flags(&m)?))
    }
    .await;
    match r {
        Ok((input, p, flags)) => generate(app, input, p, flags, false).await,
        Err(e) => e,
    }
}

async fn chat(State(app): St, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let m = body_json(body)?;
        honest(&m, true)?;
        check_model(&app, &m)?;
        let msgs = m
            .get("messages")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| bad(Some("messages"), "messages must be a non-empty list"))?;
        let mut out = Vec::new();
        for msg in msgs {
            // A message's other fields (a participant `name`, tool calls) would be dropped by
            // the template: refused unless null.
            if let Some((k, _)) = msg.as_object().and_then(|o| {
                o.iter()
                    .find(|(k, v)| !["role", "content"].contains(&k.as_str()) && !v.is_null())
            }) {
                return Err(error(
                    400,
                    "invalid_request_error",
                    "unsupported_parameter",
                    Some("messages"),
                    format!("kiln does not implement messages[].{k}"),
                ));
            }
            let role = msg
                .get("role")
                .and_then(Value::as_str)
                .filter(|r| ["system", "developer", "user", "assistant"].contains(r))
                .ok_or_else(|| {
                    bad(
                        Some("messages"),
                        "each message needs a role: system, user or assistant",
                    )
                })?;
            let role = if role == "developer" { "system" } else { role };
            let content = match msg.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| {
                        (p.get("type").and_then(Value::as_str) == Some("text"))
                            .then(|| p.get("text").and_then(Value::as_str))
                            .flatten()
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        bad(
                            Some("messages"),
                            "messages: only text content parts are supported",
                        )
                    })?
                    .concat(),
                _ => return Err(bad(Some("messages"), "each message needs a string content")),
            };
            out.push((role.to_string(), content));
        }
        let p = params(&m, None)?;
        Ok::<_, Response>((Input::Chat(out), p, stream_flags(&m)?))
    }
    .await;
    match r {
        Ok((input, p, flags)) => generate(app, input, p, flags, true).await,
        Err(e) => e,
    }
}

/// (stream, include usage in the stream)
fn stream_flags(m: &serde_json::Map<String, Value>) -> Result<(bool, bool), Response> {
    let stream = match m.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad(Some("stream"), "stream must be a boolean")),
    };
    let usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| *k != "include_usage") {
                return Err(error(
                    400,
                    "invalid_request_error",
                    "unsupported_parameter",
                    Some("stream_options"),
                    format!("kiln does not implement stream_options.{k}"),
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(bad(
                        Some("stream_options"),
                        "stream_options.include_usage must be a boolean",
                    ))
                }
            }
        }
        Some(_) => {
            return Err(bad(
                Some("stream_options"),
                "stream_options must be an object",
            ))
        }
    };
    Ok((stream, usage))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn generate(
    app: Arc<App>,
    input: Input,
    params: Params,
    (stream, with_usage): (bool, bool),
    chat: bool,
) -> Response {
    if let Some(why) = &app.refused {
        return error(503, "server_error", "selfcheck_failed", None, why.clone());
    }
    match app.ready.get() {
        Some(Ok(_)) => {}
        Some(Err(e)) => {
            return error(
                503,
                "server_error",
                "model_not_loaded",
                None,
                format!("the model did not load: {e}"),
            )
        }
        None => {
            return error(
                503,
                "server_error",
                "loading",
                None,
                "the model is still loading",
            )
        }
    }
    let (tx, mut rx) = unbounded_channel();
    app.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    match app.jobs.try_send(Job { input, params, tx }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            app.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            return error(
                429,
                "rate_limit_error",
                "queue_full",
                None,
                "too many requests are waiting; retry later",
            );
        }
        Err(TrySendError::Disconnected(_)) => {
            app.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            return error(
                503,
                "server_error",
                "engine_stopped",
                None,
                "the inference thread has stopped",
            );
        }
    }
    let prompt_tokens = match rx.recv().await {
        Some(Event::Started { prompt_tokens }) => prompt_tokens,
        Some(Event::Rejected {
            status,
            message,
            param,
            code,
        }) => {
            let kind = if status >= 500 {
                "server_error"
            } else {
                "invalid_request_error"
            };
            return error(status, kind, code, param, message);
        }
        _ => {
            return error(
                500,
                "server_error",
                "internal_error",
                None,
                "the engine ended the request without an answer",
            )
        }
    };
    let id = format!(
        "{}-{:x}",
        if chat { "chatcmpl" } else { "cmpl" },
        now() ^ (Arc::as_ptr(&app) as u64).rotate_left(17) ^ prompt_tokens as u64
    );
    let model = app.model_id.clone();
    let created = now();
    let usage = move |c: usize| json!({"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c});
    if !stream {
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text(t) => text.push_str(&t),
                Event::Done {
                    finish_reason,
                    completion_tokens,
                    tokens,
                    ..
                } => {
                    let choice = if chat {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": null})
                    } else {
                        json!({"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": null})
                    };
                    return axum::Json(json!({
                        "id": id,
                        "object": if chat { "chat.completion" } else { "text_completion" },
                        "created": created,
                        "model": model,
                        "choices": [choice],
                        "usage": usage(completion_tokens),
                        "kiln": {"tokens": tokens},
                    }))
                    .into_response();
                }
                Event::Rejected {
                    status,
                    message,
                    code,
                    param,
                } => return error(status, "server_error", code, param, message),
                Event::Started { .. } => {}
            }
        }
        return error(
            500,
            "server_error",
            "internal_error",
            None,
            "the engine ended the request early",
        );
    }
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = move |text: Option<&str>, finish: Option<&str>, first: bool| {
        let choice = if chat {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null})
        };
        json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]})
    };
    let mut first = true;
    let s = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| {
        let data = match ev {
            Event::Text(t) => {
                let c = chunk(Some(&t), None, first);
                first = false;
                format!("data: {c}\n\n")
            }
            Event::Done { finish_reason, completion_tokens, .. } => {
                let mut c = chunk(None, Some(finish_reason), first);
                let mut out = String::new();
                if with_usage {
                    out = format!("data: {c}\n\n");
                    c["choices"] = json!([]);
                    c["usage"] = usage(completion_tokens);
                } else {
                    c["usage"] = Value::Null;
                }
                format!("{out}data: {c}\n\ndata: [DONE]\n\n")
            }
            Event::Rejected { message, .. } => {
                format!("data: {}\n\ndata: [DONE]\n\n", json!({"error": {"message": message, "type": "server_error", "param": null, "code": "internal_error"}}))
            }
            Event::Started { .. } => String::new(),
        };
        Ok::<_, std::convert::Infallible>(data)
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(s))
        .unwrap_or_else(|_| {
            error(
                500,
                "server_error",
                "internal_error",
                None,
                "building the stream",
            )
        })
}

#[cfg(test)]
mod refusal_tests {
    use super::{host_name, is_loopback_name, neutral_only, refusal};
    use serde_json::json;

    #[test]
    fn loopback_names_and_host_headers() {
        for h in [
            "localhost",
            "LOCALHOST.",
            "a.localhost",
            "127.0.0.1",
            "127.9.9.9",
            "::1",
            "[::1]",
        ] {
            assert!(is_loopback_name(h), "{h}");
        }
        for h in [
            "0.0.0.0",
            "::",
            "10.0.0.1",
            "localhost.example",
            "127.0.0.1.nip.io",
            "",
            "[::2]",
        ] {
            assert!(!is_loopback_name(h), "{h}");
        }
        assert_eq!(host_name("localhost:8080"), "localhost");
        assert_eq!(host_name("[::1]:8080"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert_eq!(host_name("evil.example:80:80"), "evil.example:80");
    }

    #[test]
    fn neutral_values_only() {
        assert_eq!(
            neutral_only("logprobs", &json!(false), true),
            Some(("false", true))
        );
        assert_eq!(
            neutral_only("logprobs", &json!(true), true),
            Some(("false", false))
        );
        assert_eq!(
            neutral_only("logprobs", &json!(0), false),
            Some(("null", false))
        );
        assert_eq!(
            neutral_only("logprobs", &json!(null), false),
            Some(("null", true))
        );
        assert_eq!(
            neutral_only("presence_penalty", &json!(0.0), true).map(|r| r.1),
            Some(true)
        );
        assert_eq!(
            neutral_only("presence_penalty", &json!(0.1), false).map(|r| r.1),
            Some(false)
        );
        assert_eq!(
            neutral_only("echo", &json!(false), true),
            None,
            "echo is not a chat parameter"
        );
        assert_eq!(neutral_only("grammar", &json!("x"), false), None);
    }

    #[test]
    fn only_a_passing_report_serves() {
        let pass = br#"{"verdict":"PASS","checks":[{"id":"a","status":"pass"}]}"#;
        assert_eq!(refusal(pass), None);
        let fail = br#"{"verdict":"FAIL","checks":[{"id":"a","status":"pass"},{"id":"model.nll.cpu","status":"fail"}]}"#;
        let why = refusal(fail).expect("a FAIL report refuses");
        assert!(
            why.contains("verdict FAIL") && why.contains("model.nll.cpu") && !why.contains("a,"),
            "{why}"
        );
        assert!(refusal(b"{}")
            .expect("no verdict refuses")
            .contains("verdict missing"));
        assert!(refusal(b"not json").is_some());
    }
}
