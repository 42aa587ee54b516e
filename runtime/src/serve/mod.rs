//! The server behind `kiln serve` (its arguments and start-up are `cli/serve.rs` in the binary):
//! an OpenAI-compatible HTTP API over one model.
//!
//! HTTP is axum on tokio: a kept, hyper-based stack whose tower layers give the body-size limit,
//! and whose handlers never run a matmul — inference runs on its own std thread
//! ([`engine`]), fed over a bounded channel (full → 429) and answering over one unbounded
//! channel per request, which the engine sees closed when the client goes away.
//!
//! It is a library module so that the fuzz targets (`runtime/fuzz`, and their seeded run in
//! `tests/fuzz_seeded.rs`) drive the very router and connection handling `kiln serve` runs.

mod engine;
mod http;
mod metrics;

pub use engine::Loader;
pub use http::{is_loopback_name, serve, serve_connection, serve_connection_with, start, Server};

use std::time::Duration;

/// What `kiln serve` was asked, once its arguments are read.
pub struct Config {
    /// Address to listen on (loopback: a request whose `Host` is not loopback gets 403).
    pub host: String,
    pub port: u16,
    /// The id `/v1/models` names and requests must ask for.
    pub model_id: String,
    /// Sequences decoded at once.
    pub parallel: usize,
    /// Requests that may wait for a slot before new ones get 429.
    pub queue: usize,
    /// The bearer key every route but `GET /health` needs, when given.
    pub key: Option<String>,
    /// The self-check report's bytes (`GET /kiln/report`; its verdict gates inference).
    pub report: Option<Vec<u8>>,
    /// Why there is no report although one was asked for (refuses inference like a FAIL).
    pub missing_report: Option<String>,
    pub client_timeout: Duration,
    pub max_connections: usize,
}
