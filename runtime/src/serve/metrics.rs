//! Counters for `GET /metrics` (Prometheus text format).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub cancelled: AtomicU64,
    pub connections_refused: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub queue_depth: AtomicU64,
    pub active: AtomicU64,
    prefill_us: AtomicU64,
    decode_tokens: AtomicU64,
    decode_steps: AtomicU64,
    decode_us: AtomicU64,
    ops: Mutex<BTreeMap<String, u64>>,
}

impl Metrics {
    pub fn add_prefill(&self, tokens: u64, t: Duration) {
        self.prompt_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.prefill_us
            .fetch_add(t.as_micros() as u64, Ordering::Relaxed);
    }

    /// One decode step (one forward pass) that advanced `tokens` sequences by a token each.
    pub fn add_decode(&self, tokens: u64, t: Duration) {
        self.decode_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.decode_us
            .fetch_add(t.as_micros() as u64, Ordering::Relaxed);
    }

    /// Add a finished session's per-backend matmul counts (ops, rows).
    pub fn add_ops(&self, ops: &BTreeMap<String, (u64, u64)>) {
        if let Ok(mut m) = self.ops.lock() {
            for (b, (n, _)) in ops {
                *m.entry(b.clone()).or_default() += n;
            }
        }
    }

    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let rate = |n: u64, us: u64| {
            if us == 0 {
                0.0
            } else {
                n as f64 / (us as f64 / 1e6)
            }
        };
        let mut s = String::new();
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        one(
            "kiln_requests_total",
            "counter",
            "HTTP requests received.",
            g(&self.requests).to_string(),
        );
        one(
            "kiln_request_errors_total",
            "counter",
            "Requests answered with an error.",
            g(&self.errors).to_string(),
        );
        one(
            "kiln_requests_cancelled_total",
            "counter",
            "Sequences freed because the client went away.",
            g(&self.cancelled).to_string(),
        );
        one(
            "kiln_connections_refused_total",
            "counter",
            "Connections closed on accept because --max-connections were open.",
            g(&self.connections_refused).to_string(),
        );
        one(
            "kiln_prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled.",
            g(&self.prompt_tokens).to_string(),
        );
        one(
            "kiln_completion_tokens_total",
            "counter",
            "Tokens generated.",
            g(&self.completion_tokens).to_string(),
        );
        one(
            "kiln_prefill_tokens_per_second",
            "gauge",
            "Prompt tokens per second of prefill time, since start.",
            format!("{:.3}", rate(g(&self.prompt_tokens), g(&self.prefill_us))),
        );
        one(
            "kiln_decode_tokens_per_second",
            "gauge",
            "Decoded tokens per second of decode-step time (all sequences), since start.",
            format!("{:.3}", rate(g(&self.decode_tokens), g(&self.decode_us))),
        );
        one(
            "kiln_decode_steps_total",
            "counter",
            "Decode steps: forward passes over all active sequences at once.",
            g(&self.decode_steps).to_string(),
        );
        one(
            "kiln_decode_rows_total",
            "counter",
            "Sequence-tokens decoded by those steps (rows / steps = mean batch M).",
            g(&self.decode_tokens).to_string(),
        );
        one(
            "kiln_queue_depth",
            "gauge",
            "Requests waiting for a sequence slot.",
            g(&self.queue_depth).to_string(),
        );
        one(
            "kiln_active_sequences",
            "gauge",
            "Sequences being decoded.",
            g(&self.active).to_string(),
        );
        let _ = writeln!(s, "# HELP kiln_matmuls_total Matmul ops run, per backend (finished sequences).\n# TYPE kiln_matmuls_total counter");
        if let Ok(m) = self.ops.lock() {
            for (b, n) in m.iter() {
                let _ = writeln!(s, "kiln_matmuls_total{{backend=\"{b}\"}} {n}");
            }
        }
        s
    }
}
