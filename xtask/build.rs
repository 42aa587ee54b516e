//! Empty: it exists so that cargo resolves `[build-dependencies]` (syn's features, unified
//! with the proc-macros of the workspace's tests; see Cargo.toml).
fn main() {}
