//! `cargo xtask` and the host tests build the same dependencies: xtask's Cargo.toml asks for the
//! features the workspace's dev-dependencies turn on, so `cargo test --workspace` after `cargo
//! xtask` compiles the tests, not a second copy of serde, syn, tokio and all that depends on them.
//! This compares the two feature resolutions with `cargo tree` (nothing is compiled). rustls and
//! webpki differ on purpose (aws-lc, httpmock's TLS, stays out of `cargo xtask image`).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Crates whose features may differ, and why: rustls and webpki (aws-lc, see xtask/Cargo.toml);
/// kiln-runtime (xtask takes its library half, the tests all of it, and the test profile builds it
/// at another opt-level anyway).
const ALLOWED: &[&str] = &["rustls", "rustls-webpki", "kiln-runtime"];

/// `cargo tree` with `args`: package name and version → the feature sets it is built with.
fn features(args: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new(env!("CARGO"))
        .current_dir(root)
        .args([
            "tree", "--locked", "--prefix", "none", "--format", "{p}|{f}",
        ])
        .args(args)
        .output()
        .expect("running cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut map: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((package, feats)) = line.split_once('|') else {
            continue;
        };
        let name: Vec<&str> = package.split_whitespace().take(2).collect();
        // A package already listed above is marked " (*)".
        let feats = feats.trim().trim_end_matches("(*)").trim_end();
        map.entry(name.join(" "))
            .or_default()
            .insert(feats.to_string());
    }
    map
}

#[test]
fn xtask_features_match_the_tests() {
    let xtask = features(&["-p", "xtask", "-e", "normal,build"]);
    let tests = features(&["--workspace", "-e", "normal,build,dev"]);
    assert!(xtask.len() > 100, "cargo tree listed only {}", xtask.len());
    let differ: Vec<String> = xtask
        .iter()
        .filter(|(name, _)| !ALLOWED.contains(&name.split(' ').next().unwrap_or("")))
        .filter(|(name, feats)| tests.get(*name) != Some(*feats))
        .map(|(name, feats)| {
            format!(
                "{name}: xtask builds it with {feats:?}, the tests with {:?}",
                tests.get(name)
            )
        })
        .collect();
    assert!(
        differ.is_empty(),
        "add these features to xtask/Cargo.toml's unification list, or the host tests compile \
         them (and everything that depends on them) a second time:\n{}",
        differ.join("\n")
    );
}
