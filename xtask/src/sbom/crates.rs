//! The Rust crates compiled into the image's binaries, as cargo resolves them for aarch64: the
//! facts (version, source, licence) from `cargo metadata`, the `.crate` file's sha256 from
//! `Cargo.lock`, and which crates are built at all from `cargo tree -p <root> -e normal`.
//!
//! Why `cargo tree` as well: `cargo metadata`'s resolve unifies features across the whole
//! workspace, so a walk over its graph also reaches optional dependencies that only another
//! member (xtask) switches on — `zlib-rs` through flate2, for one — and that the image's
//! `cargo build -p kiln-runtime` never compiles. `cargo tree -p` resolves features for the
//! package alone, as that build does. The walk over metadata's normal edges must reach every
//! crate `cargo tree` lists (checked), so both say the same graph.
//!
//! Dev-dependencies are left out (not in any binary), and so are build-dependencies (build
//! scripts and their crates run on the host; they are tools, not contents). Proc-macro crates and
//! the crates only they use are normal dependencies but also run only at compile time: they are
//! kept and marked `linked: false`.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The target the image's binaries are built for.
pub const TARGET: &str = "aarch64-unknown-linux-gnu";
const CRATES_IO: &str = "registry+https://github.com/rust-lang/crates.io-index";

/// `(name, version)` pairs, as `cargo tree` lists them.
pub type CrateSet = BTreeSet<(String, String)>;

/// One crate of an image binary, as the manifest records it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Crate {
    pub name: String,
    pub version: String,
    /// `crates.io`, `path`, or cargo's source id for anything else.
    pub source: String,
    /// Cargo.lock's `checksum`: the sha256 of the `.crate` file (registry crates only).
    pub crate_sha256: Option<String>,
    /// The `license` field of the crate's Cargo.toml, as given.
    pub license: Option<String>,
    /// False for proc-macros and crates only proc-macros use (compile-time only).
    pub linked: bool,
    /// The root packages whose artifact it is compiled into (`kiln-runtime`, `rknn-standin`).
    pub roots: Vec<String>,
    /// Its source folder on this machine (where its Cargo.toml is), for its licence texts; not
    /// in the manifest (it differs between machines).
    #[serde(default)]
    pub dir: Option<std::path::PathBuf>,
}

impl Crate {
    pub fn to_json(&self) -> Value {
        json!({
            "name": self.name, "version": self.version, "source": self.source,
            "crate_sha256": self.crate_sha256, "license": self.license,
            "linked": self.linked, "in": self.roots,
        })
    }
}

/// `(name, version)` of each crate `cargo tree` prints (`--prefix none -f {p}`), in order.
pub fn parse_tree(out: &str) -> Result<CrateSet> {
    let mut set = BTreeSet::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let mut w = line.split_whitespace();
        let (Some(name), Some(v)) = (w.next(), w.next()) else {
            bail!("cargo tree: unexpected line {line:?}");
        };
        let version = v
            .strip_prefix('v')
            .with_context(|| format!("cargo tree: no version in {line:?}"))?;
        set.insert((name.to_string(), version.to_string()));
    }
    Ok(set)
}

/// Cargo.lock's checksums by `(name, version, source)`.
pub fn lock_checksums(lock: &str) -> Result<BTreeMap<(String, String, String), String>> {
    let v: toml::Value = toml::from_str(lock).context("parsing Cargo.lock")?;
    let mut out = BTreeMap::new();
    for p in v
        .get("package")
        .and_then(|p| p.as_array())
        .context("Cargo.lock has no [[package]]")?
    {
        let field = |k: &str| p.get(k).and_then(|x| x.as_str()).map(str::to_string);
        if let (Some(n), Some(v), Some(s), Some(c)) = (
            field("name"),
            field("version"),
            field("source"),
            field("checksum"),
        ) {
            out.insert((n, v, s), c);
        }
    }
    Ok(out)
}

/// The crates of `roots`: `metadata` is `cargo metadata --filter-platform` output, `trees[root]`
/// = (all crates, crates without proc-macro edges) as `cargo tree -p root -e normal[,no-proc-macro]`
/// lists them. Sorted by name and version; the roots themselves are left out (the SBOM has them
/// as the artifacts they build).
pub fn resolve(
    metadata: &Value,
    lock: &BTreeMap<(String, String, String), String>,
    trees: &BTreeMap<String, (CrateSet, CrateSet)>,
) -> Result<Vec<Crate>> {
    let packages: BTreeMap<&str, &Value> = metadata["packages"]
        .as_array()
        .context("cargo metadata: no packages")?
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let nodes: BTreeMap<&str, &Value> = metadata["resolve"]["nodes"]
        .as_array()
        .context("cargo metadata: no resolve graph")?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let nv = |id: &str| -> Result<(String, String)> {
        let p = packages
            .get(id)
            .with_context(|| format!("cargo metadata: no package {id}"))?;
        Ok((
            p["name"].as_str().unwrap_or_default().to_string(),
            p["version"].as_str().unwrap_or_default().to_string(),
        ))
    };
    let mut found: BTreeMap<String, Crate> = BTreeMap::new();
    for (root, (all, linked)) in trees {
        let root_id = packages
            .iter()
            .find(|(_, p)| p["name"] == root.as_str() && p["source"].is_null())
            .map(|(id, _)| *id)
            .with_context(|| format!("cargo metadata: no workspace package {root}"))?;
        // Normal edges only, from the root.
        let mut seen: BTreeMap<(String, String), &str> = BTreeMap::new();
        let mut stack = vec![root_id];
        while let Some(id) = stack.pop() {
            if seen.insert(nv(id)?, id).is_some() {
                continue;
            }
            let node = nodes
                .get(id)
                .with_context(|| format!("cargo metadata: {id} is not in the resolve graph"))?;
            for d in node["deps"].as_array().into_iter().flatten() {
                let normal = d["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["kind"].is_null());
                if normal {
                    stack.push(
                        d["pkg"]
                            .as_str()
                            .context("cargo metadata: dep without pkg")?,
                    );
                }
            }
        }
        for c in all {
            let id = seen.get(c).with_context(|| {
                format!(
                    "cargo tree lists {} {} under {root}, but cargo metadata's normal edges do not reach it",
                    c.0, c.1
                )
            })?;
            if *id == root_id {
                continue;
            }
            let p = packages[id];
            let source = p["source"].as_str();
            let e = found.entry(id.to_string()).or_insert_with(|| Crate {
                name: c.0.clone(),
                version: c.1.clone(),
                source: match source {
                    None => "path".into(),
                    Some(CRATES_IO) => "crates.io".into(),
                    Some(s) => s.into(),
                },
                crate_sha256: source
                    .and_then(|s| lock.get(&(c.0.clone(), c.1.clone(), s.into())).cloned()),
                license: p["license"].as_str().map(str::to_string),
                linked: false,
                roots: Vec::new(),
                dir: p["manifest_path"]
                    .as_str()
                    .and_then(|m| Path::new(m).parent())
                    .map(Path::to_path_buf),
            });
            e.linked |= linked.contains(c);
            e.roots.push(root.clone());
        }
    }
    let mut out: Vec<Crate> = found.into_values().collect();
    for c in &out {
        if c.source == "crates.io" && c.crate_sha256.is_none() {
            bail!("Cargo.lock has no checksum for {} {}", c.name, c.version);
        }
    }
    out.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
    Ok(out)
}

/// The crates of `roots` in the workspace at `root_dir`, by running cargo there. Not `--offline`:
/// `cargo metadata` reads the manifest of every package in Cargo.lock, also those the image never
/// compiles (dev-dependencies, other platforms), which a fresh machine has not downloaded yet.
pub fn of_workspace(root_dir: &Path, roots: &[&str]) -> Result<Vec<Crate>> {
    // Five cargo runs cost about a second: remembered per Cargo.lock, manifests and roots (all
    // that decides cargo's answer), so that a no-op `cargo xtask image` stays quick.
    let mut key = Sha256::new();
    for f in [
        "Cargo.lock",
        "Cargo.toml",
        "runtime/Cargo.toml",
        "runtime/rknn-standin/Cargo.toml",
        "xtask/Cargo.toml",
    ] {
        let p = root_dir.join(f);
        key.update(f.as_bytes());
        key.update(std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?);
    }
    key.update(roots.join(",").as_bytes());
    key.update(TARGET.as_bytes());
    // v2: with each crate's source folder.
    key.update(b"crates-memo-v2");
    let memo = crate::paths::target_dir()
        .join("kiln/crates")
        .join(format!("{}.json", hex::encode(&key.finalize()[..12])));
    if let Some(c) = std::fs::read(&memo)
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<Crate>>(&b).ok())
    {
        return Ok(c);
    }
    let crates = of_workspace_uncached(root_dir, roots)?;
    if let Some(dir) = memo.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    crate::atomic::write_atomic(&memo, &serde_json::to_vec(&crates)?)?;
    Ok(crates)
}

fn of_workspace_uncached(root_dir: &Path, roots: &[&str]) -> Result<Vec<Crate>> {
    let sh = crate::paths::shell()?;
    sh.change_dir(root_dir);
    let format = "{p}";
    let metadata: Value = serde_json::from_str(
        &xshell::cmd!(
            sh,
            "cargo metadata --locked --format-version 1 --filter-platform {TARGET}"
        )
        .quiet()
        .read()
        .context("cargo metadata (of the image's crates)")?,
    )
    .context("parsing cargo metadata's output")?;
    let lock_path = root_dir.join("Cargo.lock");
    let lock = lock_checksums(
        &std::fs::read_to_string(&lock_path)
            .with_context(|| format!("reading {}", lock_path.display()))?,
    )?;
    let mut trees = BTreeMap::new();
    for root in roots {
        let tree = |edges: &str| -> Result<CrateSet> {
            parse_tree(
                &xshell::cmd!(
                    sh,
                    "cargo tree --locked -p {root} -e {edges} --target {TARGET} --prefix none -f {format}"
                )
                .quiet()
                .read()
                .with_context(|| format!("cargo tree -p {root} -e {edges}"))?,
            )
        };
        trees.insert(
            root.to_string(),
            (tree("normal")?, tree("normal,no-proc-macro")?),
        );
    }
    resolve(&metadata, &lock, &trees)
}

/// A crate's `license` as an SPDX expression: as given when it is one (SPDX license list ids,
/// `AND`/`OR`/`WITH`), `/`-separated lists (old cargo style) as `OR`; `None` otherwise.
pub fn spdx_expression(license: &str) -> Option<String> {
    let strict = |s: &str| spdx::Expression::parse(s).is_ok();
    if strict(license) {
        return Some(license.to_string());
    }
    if license.contains('/') && !license.contains('(') && !license.contains(" AND ") {
        let ored = license
            .split('/')
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" OR ");
        if strict(&ored) {
            return Some(ored);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn license_expressions() {
        assert_eq!(
            spdx_expression("MIT OR Apache-2.0").unwrap(),
            "MIT OR Apache-2.0"
        );
        assert_eq!(
            spdx_expression("(MIT OR Apache-2.0) AND Unicode-3.0").unwrap(),
            "(MIT OR Apache-2.0) AND Unicode-3.0"
        );
        assert_eq!(
            spdx_expression("MIT/Apache-2.0").unwrap(),
            "MIT OR Apache-2.0"
        );
        assert_eq!(
            spdx_expression("MIT / Apache-2.0").unwrap(),
            "MIT OR Apache-2.0"
        );
        assert_eq!(
            spdx_expression("Apache-2.0 WITH LLVM-exception").unwrap(),
            "Apache-2.0 WITH LLVM-exception"
        );
        assert_eq!(spdx_expression("Foo-Licence"), None);
        assert_eq!(spdx_expression("MIT/Foo"), None);
        assert_eq!(
            spdx_expression("GPL-2.0"),
            None,
            "deprecated ids are not valid"
        );
        assert_eq!(spdx_expression("mit"), None, "ids are case-sensitive");
    }

    #[test]
    fn tree_lines() {
        let t = parse_tree("kiln-runtime v0.1.0 (/w/runtime)\nserde v1.0.1\nserde_derive v1.0.1 (proc-macro)\n\nserde v1.0.1 (*)\n").unwrap();
        assert_eq!(t.len(), 3);
        assert!(t.contains(&("serde_derive".into(), "1.0.1".into())));
        assert!(parse_tree("serde 1.0\n").is_err());
    }

    fn pkg(name: &str, source: Option<&str>, license: &str) -> Value {
        json!({"id": format!("{name}-id"), "name": name, "version": "1.0.0", "source": source, "license": license})
    }

    fn dep(name: &str, kind: Option<&str>) -> Value {
        json!({"pkg": format!("{name}-id"), "dep_kinds": [{"kind": kind, "target": null}]})
    }

    /// A made-up graph: root -> a (normal), pm (proc-macro, normal) -> syn; root -> t (dev),
    /// root -> cc (build).
    #[test]
    fn walk_keeps_normal_edges_and_marks_compile_time_crates() {
        let r = Some(CRATES_IO);
        let metadata = json!({
            "packages": [pkg("root", None, "MIT"), pkg("a", r, "MIT/Apache-2.0"), pkg("pm", r, "MIT"),
                         pkg("syn", r, "MIT"), pkg("t", r, "MIT"), pkg("cc", r, "MIT")],
            "resolve": {"nodes": [
                {"id": "root-id", "deps": [dep("a", None), dep("pm", None), dep("t", Some("dev")), dep("cc", Some("build"))]},
                {"id": "a-id", "deps": []}, {"id": "pm-id", "deps": [dep("syn", None)]},
                {"id": "syn-id", "deps": []}, {"id": "t-id", "deps": []}, {"id": "cc-id", "deps": []},
            ]},
        });
        let lock: BTreeMap<_, _> = ["a", "pm", "syn", "t", "cc"]
            .iter()
            .map(|n| {
                (
                    (n.to_string(), "1.0.0".into(), CRATES_IO.into()),
                    format!("{n}sum"),
                )
            })
            .collect();
        let set = |ns: &[&str]| {
            ns.iter()
                .map(|n| (n.to_string(), "1.0.0".to_string()))
                .collect::<BTreeSet<_>>()
        };
        let trees = BTreeMap::from([(
            "root".to_string(),
            (set(&["root", "a", "pm", "syn"]), set(&["root", "a"])),
        )]);
        let got = resolve(&metadata, &lock, &trees).unwrap();
        let names: Vec<(&str, bool)> = got.iter().map(|c| (c.name.as_str(), c.linked)).collect();
        assert_eq!(names, [("a", true), ("pm", false), ("syn", false)]);
        assert_eq!(got[0].crate_sha256.as_deref(), Some("asum"));
        assert_eq!(got[0].source, "crates.io");
        assert_eq!(got[0].license.as_deref(), Some("MIT/Apache-2.0"));
        assert_eq!(got[0].roots, ["root"]);
        // A crate cargo tree lists but the normal edges do not reach (a dev-dependency) is an error.
        let trees = BTreeMap::from([(
            "root".to_string(),
            (set(&["root", "t"]), set(&["root", "t"])),
        )]);
        let e = resolve(&metadata, &lock, &trees).unwrap_err().to_string();
        assert!(e.contains("t 1.0.0"), "{e}");
    }

    /// The real workspace: kiln's crates for aarch64, as the image build records them.
    #[test]
    fn kiln_runtime_crates_of_this_workspace() {
        let root = crate::paths::project_root();
        let crates = of_workspace(&root, &["kiln-runtime", "rknn-standin"]).unwrap();
        let find = |n: &str| crates.iter().find(|c| c.name == n);
        let serde = find("serde").expect("serde is a dependency of kiln");
        assert!(serde.linked && serde.source == "crates.io");
        assert_eq!(serde.crate_sha256.as_ref().map(String::len), Some(64));
        assert!(
            !find("serde_derive").unwrap().linked,
            "a proc-macro is compile-time only"
        );
        assert!(find("half")
            .unwrap()
            .roots
            .contains(&"rknn-standin".to_string()));
        // Dev-dependencies of kiln-runtime, host-only crates of xtask, and what only workspace
        // feature unification would add (flate2's zlib-rs, switched on by xtask) are not in.
        for absent in [
            "tempfile",
            "proptest",
            "kiln-runtime",
            "rknn-standin",
            "xshell",
            "zlib-rs",
        ] {
            assert!(find(absent).is_none(), "{absent}");
        }
        let mut sorted = crates.clone();
        sorted.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
        assert_eq!(sorted, crates);
    }
}
