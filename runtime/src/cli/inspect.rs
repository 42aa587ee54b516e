//! `kiln inspect`: a GGUF file's header, metadata, tensor table and totals — facts of the file.
//! It prepares nothing, so it says nothing about ownership: that is printed, measured, by what
//! prepares the weights (`kiln plan`, `kiln selftest`).

use kiln_runtime::gguf::{GgufFile, Value};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// Machine-readable output, with every metadata value in full.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let f = GgufFile::open(&a.file)?;
    let out = if a.json {
        let mut s = serde_json::to_string_pretty(&inspect_json(&f))?;
        s.push('\n');
        s
    } else {
        inspect_text(&f)
    };
    super::print_all(&out)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn type_label(v: &Value) -> String {
    match v.as_array() {
        Some((elem, _)) => format!("ARRAY[{elem}]"),
        None => v.value_type().to_string(),
    }
}

fn inspect_text(f: &GgufFile) -> String {
    use std::fmt::Write as _;
    let g = f.gguf();
    let mut s = String::new();
    let _ = writeln!(s, "file: {}", f.path().display());
    let _ = writeln!(
        s,
        "GGUF v{}, alignment {}, data offset {}, file size {} bytes, {} metadata keys, {} tensors",
        g.version,
        g.alignment,
        g.data_offset,
        g.file_len,
        g.metadata().len(),
        g.tensor_infos().len()
    );
    let _ = writeln!(s, "\nmetadata:");
    let key_w = g.metadata().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in g.metadata() {
        let _ = writeln!(s, "  {k:<key_w$}  {:<14} {}", type_label(v), v.summary(8));
    }
    let _ = writeln!(s, "\ntensors:");
    let name_w = g
        .tensor_infos()
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        s,
        "  {:<name_w$}  {:<7} {:>8} {:>8} {:>6} {:>6} {:>12} {:>12}",
        "name", "type", "ne0", "ne1", "ne2", "ne3", "offset", "bytes"
    );
    for t in g.tensor_infos() {
        let _ = writeln!(
            s,
            "  {:<name_w$}  {:<7} {:>8} {:>8} {:>6} {:>6} {:>12} {:>12}",
            t.name,
            t.ty.name(),
            t.ne[0],
            t.ne[1],
            t.ne[2],
            t.ne[3],
            t.offset,
            t.n_bytes
        );
    }
    let _ = writeln!(s, "\ntotals by type:");
    for (ty, n, bytes) in g.totals_by_type() {
        let _ = writeln!(
            s,
            "  {:<7} {n:>5} tensors {:>12} bytes ({:.2} MiB)",
            ty.name(),
            bytes,
            mib(bytes)
        );
    }
    let (tensor_bytes, span) = data_span(f);
    let _ = writeln!(
        s,
        "\ndata section: {} tensors, {tensor_bytes} tensor bytes ({:.2} MiB) in {span} bytes from offset {} (the rest is alignment padding)",
        g.tensor_infos().len(),
        mib(tensor_bytes),
        g.data_offset
    );
    s
}

/// Bytes of all tensors, and the length of the data section from its start to the end of the
/// last tensor.
fn data_span(f: &GgufFile) -> (u64, u64) {
    let g = f.gguf();
    let bytes = g.tensor_infos().iter().map(|t| t.n_bytes).sum();
    let end = g
        .tensor_infos()
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap_or(0);
    (bytes, end)
}

fn inspect_json(f: &GgufFile) -> serde_json::Value {
    use serde_json::json;
    let g = f.gguf();
    let metadata: Vec<_> = g
        .metadata()
        .map(|(k, v)| {
            let mut m = json!({ "key": k, "type": v.value_type().name(), "value": v.to_json() });
            if let Some((elem, items)) = v.as_array() {
                m["element_type"] = json!(elem.name());
                m["length"] = json!(items.len());
            }
            m
        })
        .collect();
    let tensors: Vec<_> = g
        .tensor_infos()
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "type": t.ty.name(),
                "type_id": t.ty.id(),
                "n_dims": t.n_dims,
                "ne": t.ne,
                "offset": t.offset,
                "bytes": t.n_bytes,
            })
        })
        .collect();
    let totals: Vec<_> = g
        .totals_by_type()
        .into_iter()
        .map(|(ty, n, bytes)| json!({ "type": ty.name(), "tensors": n, "bytes": bytes }))
        .collect();
    let (tensor_bytes, span) = data_span(f);
    json!({
        "file": f.path().display().to_string(),
        "version": g.version,
        "alignment": g.alignment,
        "data_offset": g.data_offset,
        "file_size": g.file_len,
        "metadata": metadata,
        "tensors": tensors,
        "totals_by_type": totals,
        "tensor_bytes": tensor_bytes,
        "data_span": span,
    })
}
