//! `kiln serve`: its arguments, the NPU lock, the key and the report; the server itself is the
//! library's `serve` module.

use crate::cli::run::ModelArgs;
use anyhow::{Context, Result};
use kiln_runtime::gguf::GgufFile;
use kiln_runtime::model::{KvType, Model};
use kiln_runtime::serve::{is_loopback_name, Config, Loader};
use std::path::PathBuf;

/// Without MODEL, `kiln serve` serves the report, `/health` and `/metrics` only (what init starts
/// on a board whose models partition holds no model to serve).
#[derive(clap::Args)]
#[command(mut_arg("model", |a| a.required(false)))]
pub struct Args {
    #[command(flatten)]
    pub m: ModelArgs,
    /// Address to listen on. Anything but loopback needs --api-key-file, or --insecure in so many
    /// words. On loopback, a request whose `Host` is not a loopback name or address gets 403
    /// (DNS rebinding: a web page's script reaching a server on the user's own machine).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port to listen on.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded at once (each with its own KV cache from one pool allocated at start).
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// A file holding the bearer key every request but GET /health must carry (one line).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Serve beyond loopback without an API key: anyone who reaches the port may use the model
    /// and read the report. Said at start-up and in /health.
    #[arg(long, conflicts_with = "api_key_file")]
    pub insecure: bool,
    /// The self-check report served byte-equal at GET /kiln/report (its verdict in /health).
    /// Only a PASS report serves; a missing file refuses inference like a FAIL.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Seconds a client may take to send a request's headers (also the idle time a kept-alive
    /// connection may wait for its next request) and, once they are in, its body: past it the
    /// connection is closed, or the request answered 408.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub client_timeout: u64,
    /// Open connections at once; a connection past it is closed as soon as it is accepted.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
}

pub fn run(a: Args) -> Result<()> {
    // The NPU lock first, on this thread: the model loads on the engine thread while /health
    // already answers, and a load error there leaves the server up (503). A second NPU user must
    // instead exit with the holder's name. The engine's backend shares this process's hold.
    use kiln_runtime::backend::npu::{NpuBackend, NpuConfig};
    use kiln_runtime::model::BackendSel;
    let _npu = match a.m.backend {
        BackendSel::Auto | BackendSel::Npu => Some(NpuBackend::open(NpuConfig::default())?),
        BackendSel::Cpu | BackendSel::CpuRef => None,
    };
    let key = match &a.api_key_file {
        Some(p) => {
            let k = std::fs::read_to_string(p)
                .with_context(|| format!("reading --api-key-file {}", p.display()))?;
            let k = k.trim().to_string();
            anyhow::ensure!(
                !k.is_empty(),
                "--api-key-file {}: the file is empty",
                p.display()
            );
            Some(k)
        }
        None => None,
    };
    let loopback = is_loopback_name(&a.host);
    if !loopback && key.is_none() && !a.insecure {
        anyhow::bail!(
            "--host {}: serving beyond loopback needs an API key (--api-key-file FILE); to serve \
             without one, say --insecure",
            a.host
        );
    }
    // A report that is not there is a refusal, not a start-up error: the board stays
    // diagnosable over the network (/health says why) and serves nothing it did not prove.
    let (report, missing) = match &a.report {
        Some(p) => match std::fs::read(p) {
            Ok(b) => (Some(b), None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
                None,
                Some(format!(
                    "no self-check report at {}: the self-check wrote none",
                    p.display()
                )),
            ),
            Err(e) => return Err(e).with_context(|| format!("reading --report {}", p.display())),
        },
        None => (None, None),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let model_id =
        a.m.model
            .as_deref()
            .and_then(|m| m.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "none".into());
    let cfg = Config {
        host: a.host,
        port: a.port,
        model_id,
        parallel: a.parallel,
        queue: a.queue,
        key,
        report,
        missing_report: missing,
        client_timeout: std::time::Duration::from_secs(a.client_timeout),
        max_connections: a.max_connections as usize,
    };
    let model = a.m.model.is_some().then_some(a.m);
    rt.block_on(kiln_runtime::serve::serve(cfg, model))
}

/// The engine loads MODEL as every model command does (pinned to the inference CPUs, the
/// backends of `--backend`, the ownership ledger on stderr).
impl Loader for ModelArgs {
    fn open(&self) -> Result<GgufFile> {
        ModelArgs::open(self)
    }
    fn load<'m>(&self, f: &'m GgufFile) -> Result<Model<'m>> {
        ModelArgs::load(self, f)
    }
    fn n_ctx(&self, m: &Model<'_>) -> usize {
        ModelArgs::n_ctx(self, m)
    }
    fn kv(&self) -> KvType {
        self.kv
    }
}
