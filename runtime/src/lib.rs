//! kiln's on-board runtime. See `ARCHITECTURE.md` at the repository root for the map.

pub mod backend;
pub mod civil;
#[doc(hidden)]
pub mod clidoc;
pub mod contain;
pub mod cpus;
#[cfg(feature = "net")]
pub mod fleet;
/// Without the `net` feature (the host tool's build), only the fleet's configuration, which
/// `cargo xtask image` checks in a recipe's `[fleet]`.
#[cfg(not(feature = "net"))]
pub mod fleet {
    pub mod config;
}
#[doc(hidden)]
pub mod fuzzing;
pub mod gguf;
pub mod ledger;
pub mod membw;
pub mod model;
pub mod models_slot;
pub mod pool;
pub mod quant;
pub mod sched;
pub mod selftest;
#[cfg(feature = "net")]
pub mod serve;
pub mod slot;
pub mod tokenizer;
pub mod verity;

#[cfg(test)]
mod arch_tests {
    /// `cargo xtask test` sets `KILN_EXPECT_ARCH=aarch64` for the qemu-user stages, so a run that
    /// silently happened on the host cannot pass as an aarch64 run.
    #[test]
    fn runs_on_the_architecture_the_harness_expects() {
        if let Ok(want) = std::env::var("KILN_EXPECT_ARCH") {
            assert_eq!(std::env::consts::ARCH, want);
            let compiled_for = if cfg!(target_arch = "aarch64") {
                "aarch64"
            } else {
                "not aarch64"
            };
            assert_eq!(compiled_for, want);
        }
    }
}
