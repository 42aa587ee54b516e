//! One module per `kiln` command: each owns its arguments (`Args`) and its `run`. `main.rs` only
//! parses and dispatches.

use anyhow::Context;
use std::io::Write as _;
use std::path::Path;

pub mod bench;
pub mod chat;
pub mod dequant;
pub mod fleet;
pub mod inspect;
pub mod matmul;
pub mod plan;
pub mod ppl;
pub mod run;
pub mod selftest;
pub mod serve;
pub mod slot;
pub mod tokenize;
pub mod verity;

/// Which backend a command runs on, for tests and diagnosis (default: the board order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    Cpu,
    CpuRef,
    Npu,
}

/// Write `out` to stdout; a closed pipe (`kiln inspect … | head`) is not an error worth a message.
pub fn print_all(out: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}

/// The tensor `name` of an open file, or an error naming the file and how many tensors it has.
pub fn tensor<'f>(
    f: &'f kiln_runtime::gguf::GgufFile,
    name: &str,
) -> anyhow::Result<kiln_runtime::gguf::TensorView<'f>> {
    f.tensor(name).with_context(|| {
        format!(
            "{}: no tensor named {name:?} ({} tensors in the file)",
            f.path().display(),
            f.gguf().tensor_infos().len()
        )
    })
}

/// Write `bytes` under `path` only when complete: a temp file beside it, then a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file path", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
