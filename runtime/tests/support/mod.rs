//! What several integration tests share.

use std::process::Command;

/// The `kiln` binary as a command. Under qemu-user (the aarch64 stages) an aarch64 binary cannot
/// be exec'd directly without binfmt_misc, so it goes through the same runner cargo used.
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
