//! `kiln bench`: prefill and decode speed of a model, the weight bytes a decoded token reads, and
//! that traffic as a fraction of the read bandwidth measured in the same run; which backend ran
//! which ops; resident anonymous memory after the run (weights must stay file-backed).

use super::run::ModelArgs;
use anyhow::Result;
use kiln_runtime::model::{rss_kb, Want};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub m: ModelArgs,
    /// Prompt tokens to prefill.
    #[arg(short = 'p', default_value_t = 128)]
    pub prompt: usize,
    /// Tokens to decode.
    #[arg(short = 'n', default_value_t = 64)]
    pub n: usize,
    /// One JSON object instead of the lines.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(a.prompt >= 1 && a.n >= 1, "-p and -n must be at least 1");
    let f = a.m.open()?;
    let (model, cpus) = a.m.load_pinned(&f)?;
    let n_ctx = a.m.ctx.unwrap_or(a.prompt + a.n + 1);
    let mut s = model.session(n_ctx, a.m.kv)?;
    // Token ids spread over the vocabulary: speed does not depend on which ids.
    let prompt: Vec<u32> = (0..a.prompt)
        .map(|i| ((i * 7919 + 13) % model.n_vocab) as u32)
        .collect();
    let t0 = Instant::now();
    let mut logits = model.forward(&mut s, &prompt, Want::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let prefill_stats = std::mem::take(&mut s.stats);
    let t1 = Instant::now();
    for _ in 0..a.n {
        let t = kiln_runtime::model::sample::argmax(&logits);
        logits = model.forward(&mut s, &[t], Want::Last)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let decode_stats = std::mem::take(&mut s.stats);
    let threads = if a.m.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        a.m.threads
    };
    let rss = rss_kb();
    let ran_on = kiln_runtime::cpus::ran_on(threads);
    let bw = kiln_runtime::membw::read_bandwidth(threads);
    let wbytes = model.weight_bytes_per_token();
    let prefill_tps = a.prompt as f64 / prefill_s;
    let decode_tps = a.n as f64 / decode_s;
    let weight_bps = wbytes as f64 * decode_tps;
    let kv_bytes = s.kv.bytes();
    if a.json {
        let v = serde_json::json!({
            "model": a.m.path()?.display().to_string(),
            "threads": threads,
            "cpus": cpus.cpus,
            "cpus_how": cpus.describe(),
            "cpus_ran_on": ran_on,
            "prompt_tokens": a.prompt,
            "decode_tokens": a.n,
            "prefill_tok_s": prefill_tps,
            "decode_tok_s": decode_tps,
            "weight_bytes_per_token": wbytes,
            "decode_weight_gb_s": weight_bps / 1e9,
            "read_bandwidth_gb_s": bw / 1e9,
            "fraction_of_bandwidth": weight_bps / bw,
            "prefill_ops": prefill_stats.ops,
            "decode_ops": decode_stats.ops,
            "prefill_declined": prefill_stats.declined,
            "decode_declined": decode_stats.declined,
            "kv_cache_bytes": kv_bytes,
            "rss_anon_kb": rss.map(|r| r.0),
            "rss_file_kb": rss.map(|r| r.1),
            "ownership": model.ledger.lines(),
        });
        println!("{v}");
        return Ok(());
    }
    println!("model: {} ({} threads)", a.m.path()?.display(), threads);
    println!(
        "{}; the matmul pool's threads measured on cpus {}",
        cpus.describe(),
        kiln_runtime::cpus::format_list(&ran_on)
    );
    println!(
        "prefill: {} tokens in {:.3} s = {prefill_tps:.1} tok/s",
        a.prompt, prefill_s
    );
    println!(
        "decode:  {} tokens in {:.3} s = {decode_tps:.1} tok/s",
        a.n, decode_s
    );
    println!(
        "decode reads {:.2} MiB of weights per token = {:.2} GB/s; measured read bandwidth {:.2} GB/s; \
         fraction {:.3}",
        wbytes as f64 / (1 << 20) as f64,
        weight_bps / 1e9,
        bw / 1e9,
        weight_bps / bw
    );
    for (what, st) in [("prefill", &prefill_stats), ("decode", &decode_stats)] {
        let parts: Vec<String> = st
            .ops
            .iter()
            .map(|(b, (ops, rows))| format!("{b}: {ops} matmuls, {rows} rows"))
            .collect();
        println!("{what} ran on: {}", parts.join("; "));
        for (why, n) in &st.declined {
            println!("{what}: {n} op(s) declined at run time and run by the next backend: {why}");
        }
    }
    if let Some((anon, file)) = rss {
        println!(
            "memory after the run: anonymous RSS {:.1} MiB (KV cache {:.1} MiB + scratch; taken before the \
             bandwidth probe), file-backed RSS {:.1} MiB (the mapped weights)",
            anon as f64 / 1024.0,
            kv_bytes as f64 / (1 << 20) as f64,
            file as f64 / 1024.0
        );
    }
    for l in model.ledger.lines() {
        println!("{l}");
    }
    Ok(())
}
