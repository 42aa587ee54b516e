//! What several integration tests share.

use std::process::Command;

/// The `kiln` binary as a command. Under qemu-user (the aarch64 stages) an aarch64 binary cannot
/// be exec'd directly without binfmt_misc, so it goes through the same runner cargo used.
#[allow(dead_code)] // The model-loading tests share this module without running `kiln`.
pub fn kiln_cmd() -> Command {
    let kiln = env!("CARGO_BIN_EXE_kiln");
    let runner = cfg!(target_arch = "aarch64")
        .then(|| std::env::var("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER").ok())
        .flatten();
    match runner {
        Some(r) if !r.trim().is_empty() => {
            let mut parts = r.split_whitespace();
            let mut c = Command::new(parts.next().unwrap_or_default());
            c.args(parts).arg(kiln);
            c
        }
        _ => Command::new(kiln),
    }
}

/// `bytes` written to a temporary GGUF and loaded on the reference backend (with `fault`), then
/// `then` on the model; a load error as its text (the refusal tests read it).
#[allow(dead_code)] // Not every test crate that shares this module loads a synthetic model.
pub fn with_model<T>(
    bytes: &[u8],
    fault: Option<kiln_runtime::model::Fault>,
    then: impl FnOnce(&kiln_runtime::model::Model<'_>) -> T,
) -> Result<T, String> {
    use kiln_runtime::model::{BackendSel, Model, Options};
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("synthetic.gguf");
    std::fs::write(&p, bytes).expect("writing the synthetic GGUF");
    let f = kiln_runtime::gguf::GgufFile::open(&p).expect("opening the synthetic GGUF");
    let opt = Options {
        backend: BackendSel::CpuRef,
        fault,
        ..Options::default()
    };
    // Bound first: the model borrows `f`, which must outlive the match.
    let r = match Model::load(&f, &opt) {
        Ok(m) => Ok(then(&m)),
        Err(e) => Err(format!("{e:#}")),
    };
    r
}

#[allow(dead_code)] // Used by the tests that check a model as the self-check does.
pub mod board_root;
