//! The inference side of `kiln serve`: one std thread owns the mapping, the model and a pool of
//! `--parallel` sessions (KV caches allocated once, at start). Requests arrive over a bounded
//! channel; the scheduler admits them into free slots between steps (prefill), then every step
//! advances each active sequence by one token, and a sequence that ends or whose client went away
//! frees its slot at once.
//!
//!
//! Continuous batching: each step is one forward pass over every active sequence
//! ([`Model::forward_batch`]), so the decode matmuls run at M = active sequences and each weight
//! is read once per step for all of them. A new request's prefill runs between steps. On the CPU
//! backends a row's bits do not depend on M or on the other rows, so each request gets the
//! tokens `kiln run` gives it alone (held to the bit by the model's
//! `batch_rows_equal_each_sequence_alone` test and, through HTTP, by the serve stage). Where a
//! batch's M reaches an op the NPU accepts, that op may run on the NPU: the answer then moves only
//! within the NPU's int8/fp16 tolerance that the plan and `run_checked` hold every NPU op to.

use super::metrics::Metrics;
use crate::gguf::GgufFile;
use crate::model::sample::{Sampler, SamplerConfig};
use crate::model::{KvType, Model, Session, Want};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::{Context, Result};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What to generate from.
pub enum Input {
    Text(String),
    Ids(Vec<u32>),
    Chat(Vec<(String, String)>),
}

pub struct Params {
    /// None: until end-of-generation or the context is full.
    pub max_tokens: Option<usize>,
    pub temp: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
    pub stop: Vec<String>,
}

pub struct Job {
    pub input: Input,
    pub params: Params,
    pub tx: UnboundedSender<Event>,
}

/// What the engine tells the HTTP side about one request, in order: `Started`, `Text`*, `Done`;
/// or a single `Rejected`.
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
    },
    Text(String),
    Done {
        finish_reason: &'static str,
        completion_tokens: usize,
        tokens: Vec<u32>,
    },
    Rejected {
        status: u16,
        message: String,
        param: Option<&'static str>,
        code: &'static str,
    },
}

/// How the engine gets its model: `kiln serve`'s MODEL arguments (CPU pinning, backends), or a
/// fuzz target's fixture. Called on the engine thread, which owns what it returns.
pub trait Loader: Send + 'static {
    fn open(&self) -> Result<GgufFile>;
    fn load<'m>(&self, f: &'m GgufFile) -> Result<Model<'m>>;
    /// Tokens each sequence's KV cache holds.
    fn n_ctx(&self, m: &Model<'_>) -> usize;
    fn kv(&self) -> KvType;
}

/// The loaded state the HTTP side reads (set once the model is ready).
pub struct Ready {
    pub n_ctx: usize,
}

struct Seq {
    sampler: Sampler,
    tx: UnboundedSender<Event>,
    max_new: usize,
    stop: Vec<String>,
    tokens: Vec<u32>,
    dec: StreamDecoder,
    text: String,
    sent: usize,
    last: u32,
}

/// Load the model and serve jobs until the channel closes. `on_ready` is called once the model
/// is loaded (or with the load error).
pub fn run(
    args: impl Loader,
    parallel: usize,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    on_ready: impl FnOnce(Result<Ready, String>),
) {
    let f = match args.open() {
        Ok(f) => f,
        Err(e) => return on_ready(Err(format!("{e:#}"))),
    };
    let loaded = (|| -> Result<_> {
        let model = args.load(&f)?;
        let tok = Tokenizer::from_gguf(f.gguf())
            .with_context(|| format!("{}: tokenizer", f.path().display()))?;
        let n_ctx = args.n_ctx(&model);
        let sessions = (0..parallel.max(1))
            .map(|_| model.session(n_ctx, args.kv()))
            .collect::<Result<Vec<_>>>()
            .context("allocating the KV cache pool")?;
        Ok((model, tok, n_ctx, sessions))
    })();
    let (model, tok, n_ctx, sessions) = match loaded {
        Ok(v) => v,
        Err(e) => return on_ready(Err(format!("{e:#}"))),
    };
    on_ready(Ok(Ready { n_ctx }));
    // Compiled once: a chat request renders it, a file without one (or with one that does not
    // parse) still serves completions and refuses chats with the reason.
    let chat = crate::tokenizer::chat::Template::of(&tok).map_err(|e| format!("{e:#}"));
    let mut e = Engine {
        model,
        tok,
        chat,
        n_ctx,
        metrics,
    };
    e.serve(sessions, jobs);
}

struct Engine<'m> {
    model: Model<'m>,
    tok: Tokenizer,
    chat: Result<crate::tokenizer::chat::Template, String>,
    n_ctx: usize,
    metrics: Arc<Metrics>,
}

fn reject(
    tx: &UnboundedSender<Event>,
    status: u16,
    code: &'static str,
    param: Option<&'static str>,
    message: String,
) {
    let _ = tx.send(Event::Rejected {
        status,
        message,
        param,
        code,
    });
}

impl Engine<'_> {
    fn serve(&mut self, mut free: Vec<Session>, jobs: Receiver<Job>) {
        let mut active: Vec<(Session, Seq)> = Vec::new();
        loop {
            // Admit: block when idle, otherwise take what is waiting without stopping the step.
            loop {
                if free.is_empty() {
                    break;
                }
                let job = if active.is_empty() {
                    match jobs.recv_timeout(Duration::from_millis(200)) {
                        Ok(j) => j,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                } else {
                    match jobs.try_recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    }
                };
                self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                let Some(mut s) = free.pop() else { break };
                s.kv.clear();
                match self.start(&mut s, job) {
                    Some(seq) => active.push((s, seq)),
                    None => free.push(s),
                }
            }
            self.metrics
                .active
                .store(active.len() as u64, Ordering::Relaxed);
            if active.is_empty() {
                continue;
            }
            // Free the slots of clients that went away, then one decode step: a single forward
            // pass over every active sequence.
            let mut i = 0;
            while i < active.len() {
                if active[i].1.tx.is_closed() {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    let (mut s, _) = active.swap_remove(i);
                    self.record_ops(&mut s);
                    free.push(s);
                } else {
                    i += 1;
                }
            }
            if active.is_empty() {
                // Idle from here until a job comes: the gauge must not keep the last batch's size.
                self.metrics.active.store(0, Ordering::Relaxed);
                continue;
            }
            let t0 = Instant::now();
            let stepped = active.len() as u64;
            let last: Vec<u32> = active.iter().map(|(_, q)| q.last).collect();
            let result = {
                let mut sessions: Vec<&mut Session> = active.iter_mut().map(|(s, _)| s).collect();
                self.model.forward_batch(&mut sessions, &last)
            };
            match result {
                Err(e) => {
                    for (mut s, seq) in active.drain(..) {
                        reject(&seq.tx, 500, "internal_error", None, format!("{e:#}"));
                        self.record_ops(&mut s);
                        free.push(s);
                    }
                }
                Ok(logits) => {
                    let n_vocab = self.model.n_vocab;
                    let mut ended = Vec::new();
                    for (i, ((_, seq), row)) in active
                        .iter_mut()
                        .zip(logits.chunks_exact(n_vocab))
                        .enumerate()
                    {
                        if self.emit(seq, row) {
                            ended.push(i);
                        }
                    }
                    // Highest index first: swap_remove then only moves rows still running.
                    for i in ended.into_iter().rev() {
                        let (mut s, _) = active.swap_remove(i);
                        self.record_ops(&mut s);
                        free.push(s);
                    }
                }
            }
            self.metrics.add_decode(stepped, t0.elapsed());
            // Sequences that ended in this step are gone now, not at the next admission (which
            // blocks when nothing is active: the gauge would stay at the last batch's size).
            self.metrics
                .active
                .store(active.len() as u64, Ordering::Relaxed);
        }
    }

    /// Add the session's matmul counts to /metrics and start them over (a slot is reused).
    fn record_ops(&self, s: &mut Session) {
        self.metrics.add_ops(&std::mem::take(&mut s.stats).ops);
    }

    fn encode(
        &self,
        input: &Input,
    ) -> Result<Vec<u32>, (u16, &'static str, Option<&'static str>, String)> {
        let bad = |m: String| (400, "invalid_request_error", None, m);
        match input {
            Input::Ids(ids) => Ok(ids.clone()),
            Input::Text(t) => self
                .tok
                .encode(t, true, true)
                .map_err(|e| bad(format!("{e:#}"))),
            Input::Chat(msgs) => {
                // Not the file's path: where the models live is not the client's business.
                let chat = self
                    .chat
                    .as_ref()
                    .map_err(|e| bad(format!("the model's chat template: {e}")))?;
                let prompt = chat.render(msgs).map_err(|e| {
                    (
                        400,
                        "invalid_request_error",
                        Some("messages"),
                        format!("{e:#}"),
                    )
                })?;
                self.tok
                    .encode(&prompt, true, true)
                    .map_err(|e| bad(format!("{e:#}")))
            }
        }
    }

    /// Validate, prefill and sample the first token; None when the request ended already.
    fn start(&mut self, s: &mut Session, job: Job) -> Option<Seq> {
        let tx = job.tx;
        let p = job.params;
        let prompt = match self.encode(&job.input) {
            Ok(p) => p,
            Err((status, code, param, msg)) => {
                reject(&tx, status, code, param, msg);
                return None;
            }
        };
        if prompt.is_empty() {
            reject(
                &tx,
                400,
                "invalid_request_error",
                Some("prompt"),
                "the prompt has no tokens".into(),
            );
            return None;
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.model.n_vocab) {
            reject(
                &tx,
                400,
                "invalid_request_error",
                Some("prompt"),
                format!(
                    "token id {bad} is outside the vocabulary ({})",
                    self.model.n_vocab
                ),
            );
            return None;
        }
        let room = self.n_ctx.saturating_sub(prompt.len());
        if room == 0 {
            reject(&tx, 400, "context_length_exceeded", Some("prompt"), format!(
                "the prompt has {} tokens; the context (--ctx) holds {} and needs room for one generated token",
                prompt.len(),
                self.n_ctx
            ));
            return None;
        }
        let max_new = match p.max_tokens {
            Some(n) if n > room => {
                reject(
                    &tx,
                    400,
                    "context_length_exceeded",
                    Some("max_tokens"),
                    format!(
                        "max_tokens {n} + {} prompt tokens exceed the context of {} tokens",
                        prompt.len(),
                        self.n_ctx
                    ),
                );
                return None;
            }
            Some(n) => n,
            None => room,
        };
        if tx
            .send(Event::Started {
                prompt_tokens: prompt.len(),
            })
            .is_err()
        {
            return None;
        }
        let t0 = Instant::now();
        let logits = match self.model.forward(s, &prompt, Want::Last) {
            Ok(l) => l,
            Err(e) => {
                reject(&tx, 500, "internal_error", None, format!("{e:#}"));
                return None;
            }
        };
        self.metrics.add_prefill(prompt.len() as u64, t0.elapsed());
        let mut seq = Seq {
            sampler: Sampler::new(SamplerConfig {
                temp: p.temp,
                top_k: p.top_k,
                top_p: p.top_p,
                seed: p.seed,
            }),
            tx,
            max_new,
            stop: p.stop,
            tokens: Vec::new(),
            dec: StreamDecoder::new(),
            text: String::new(),
            sent: 0,
            last: 0,
        };
        if self.emit(&mut seq, &logits) {
            self.record_ops(s);
            return None;
        }
        Some(seq)
    }

    /// Sample one token and send the text it makes safe to send; true when the sequence ended.
    fn emit(&self, seq: &mut Seq, logits: &[f32]) -> bool {
        let t = seq.sampler.sample(logits);
        seq.tokens.push(t);
        seq.last = t;
        self.metrics
            .completion_tokens
            .fetch_add(1, Ordering::Relaxed);
        let eog = self.tok.is_eog(t);
        if !eog {
            seq.text
                .push_str(&seq.dec.push(&self.tok.token_to_piece(t)));
        }
        let at_max = seq.tokens.len() >= seq.max_new;
        let mut finish = if eog {
            Some("stop")
        } else if at_max {
            Some("length")
        } else {
            None
        };
        if finish.is_some() {
            let rest = std::mem::take(&mut seq.dec).finish();
            seq.text.push_str(&rest);
        }
        // A stop string ends the text before it; text that could still begin one is held back.
        let mut end = seq.text.len();
        let search_from = seq
            .sent
            .saturating_sub(seq.stop.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = floor_char(&seq.text, search_from);
        if let Some(at) = seq
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| {
                seq.text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min()
        {
            end = at.max(seq.sent);
            finish = Some("stop");
        } else if finish.is_none() {
            let hold = seq
                .stop
                .iter()
                .map(|s| s.len())
                .max()
                .unwrap_or(1)
                .saturating_sub(1);
            end = floor_char(&seq.text, seq.text.len().saturating_sub(hold).max(seq.sent));
        }
        if end > seq.sent {
            let piece = seq.text[seq.sent..end].to_string();
            seq.sent = end;
            if seq.tx.send(Event::Text(piece)).is_err() {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        if let Some(reason) = finish {
            let _ = seq.tx.send(Event::Done {
                finish_reason: reason,
                completion_tokens: seq.tokens.len(),
                tokens: std::mem::take(&mut seq.tokens),
            });
            return true;
        }
        false
    }
}

/// The largest char boundary of `s` at or below `i`.
fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::{run, Event, Input, Job, Params};
    use crate::fuzzing::serve_request::Fixture;
    use crate::model::fixture;
    use crate::serve::metrics::Metrics;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Found by `cargo xtask soak serve`: after a batch ended, `kiln_active_sequences` kept the
    /// batch's size while the server sat idle (the gauge was set only after an admission, and an
    /// idle engine blocks in the admission). Idle must read 0.
    #[test]
    fn the_active_gauge_is_zero_when_idle() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(fixture::FILE_NAME);
        std::fs::write(&path, fixture::gguf().expect("fixture")).expect("writing the fixture");
        let args = Fixture { path };
        let metrics = Arc::new(Metrics::default());
        let (jobs, rx) = std::sync::mpsc::sync_channel(8);
        let m2 = metrics.clone();
        let engine = std::thread::spawn(move || {
            run(args, 2, rx, m2, |r| assert!(r.is_ok(), "the fixture loads"));
        });
        let mut answers = Vec::new();
        for seed in 0..2 {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
            jobs.send(Job {
                input: Input::Ids(vec![1, 2, 3]),
                params: Params {
                    max_tokens: Some(3),
                    temp: 1.0,
                    top_p: 1.0,
                    top_k: 0,
                    seed,
                    stop: Vec::new(),
                },
                tx,
            })
            .expect("the engine takes jobs");
            answers.push(rx);
        }
        for mut rx in answers {
            loop {
                match rx.blocking_recv() {
                    Some(Event::Done { .. }) => break,
                    Some(Event::Rejected { message, .. }) => panic!("rejected: {message}"),
                    Some(_) => {}
                    None => panic!("the engine dropped a request"),
                }
            }
        }
        let t0 = Instant::now();
        while metrics.active.load(Ordering::Relaxed) != 0 && t0.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            metrics.active.load(Ordering::Relaxed),
            0,
            "idle, yet active"
        );
        assert_eq!(metrics.queue_depth.load(Ordering::Relaxed), 0);
        drop(jobs);
        engine.join().expect("the engine thread");
    }
}
