//! The layers of `xtask`, kept by a test (as rust-analyzer keeps its conventions in `tidy`
//! tests): every `crate::…` path in a module's source must point to its own layer or one below,
//! and the modules must not import each other in a circle. ARCHITECTURE.md lists the same table.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first; each names its top-level modules. `main` is the crate root: it only
/// parses and dispatches, so it sits above every layer and no module may import it (the helpers
/// every module uses are in `paths`, a ground module).
pub const LAYERS: &[(&str, &[&str])] = &[
    (
        "ground",
        &[
            "paths", "civil", "atomic", "archive", "doctor", "apt", "userns", "http",
        ],
    ),
    ("inputs", &["pins"]),
    (
        "builders",
        &[
            "tools_root",
            "kernel",
            "kernel_modules",
            "bootloader",
            "rootfs",
            "disk",
            "bmap",
            "build",
        ],
    ),
    (
        "pipelines and commands",
        &[
            "image",
            "boot_test",
            "ab_test",
            "qemu",
            "flash",
            "report",
            "bench",
            "soak",
            "test",
            "pins_cmd",
            "fresh_machine",
            "readme",
            "tidy",
            "sbom",
            "bundle",
            "farm",
            "keys",
            "docs",
        ],
    ),
    ("crate root", &["main"]),
];

/// One `crate::` reference: where it is and what it names.
#[derive(Clone, Debug)]
pub struct Import {
    pub file: String,
    pub line: usize,
    pub text: String,
    pub from: String,
    pub to: String,
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// The top-level module a source file belongs to: `image/board.rs` → `image`.
fn module_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_default();
    first.trim_end_matches(".rs").to_string()
}

/// The top-level names each `crate::` path in `line` starts with; `crate::{a, b::c}` gives both.
fn crate_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        // `kiln_crate::x` is not ours.
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let ident = |s: &str| -> String {
            s.trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        };
        if let Some(group) = rest.strip_prefix('{') {
            // The group's items, split at its own commas (not those of a nested `{…}`).
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '}' if depth == 0 => break,
                    ',' if depth == 0 => {
                        out.push(ident(&item));
                        item.clear();
                        continue;
                    }
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                item.push(c);
            }
            out.push(ident(&item));
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|n| !n.is_empty());
    out
}

/// `line` with the contents of its string literals blanked: a `crate::` inside quotes (a test's
/// injected source, a message) is text, not an import.
fn without_strings(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let (mut in_str, mut escaped) = (false, false);
    for c in line.chars() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    in_str = false;
                    out.push(c);
                }
                _ => {}
            }
        } else {
            if c == '"' {
                in_str = true;
            }
            out.push(c);
        }
    }
    out
}

/// Every `crate::` reference in `files` (path relative to `src/`, text), comments skipped. A
/// name that is not a top-level module is an item of the crate root (`crate::shell`).
pub fn imports(files: &[(PathBuf, String)]) -> Vec<Import> {
    let modules: BTreeSet<String> = files.iter().map(|(p, _)| module_of(p)).collect();
    let mut out = Vec::new();
    for (rel, text) in files {
        let from = module_of(rel);
        let lines: Vec<&str> = text.lines().collect();
        let mut n = 0;
        while n < lines.len() {
            let first = n;
            let mut line = lines[n].to_string();
            n += 1;
            if line.trim_start().starts_with("//") {
                continue;
            }
            // A `use crate::{…}` that rustfmt spread over several lines is read as one.
            let open = |l: &str| {
                l.find("crate::{").map_or(0, |i| {
                    l[i..].matches('{').count() as i64 - l[i..].matches('}').count() as i64
                })
            };
            while open(&line) > 0 && n < lines.len() {
                line.push(' ');
                line.push_str(lines[n].trim());
                n += 1;
            }
            for name in crate_targets(&without_strings(&line)) {
                let to = if modules.contains(&name) {
                    name
                } else {
                    "main".to_string()
                };
                if to != from {
                    out.push(Import {
                        file: format!("xtask/src/{}", rel.display()),
                        line: first + 1,
                        text: line.trim().to_string(),
                        from: from.clone(),
                        to,
                    });
                }
            }
        }
    }
    out
}

/// Every violation: a module in no layer, an import that points upward, an import that closes a
/// cycle between modules. Each message names the file, the line and the import.
pub fn check(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut errors = Vec::new();
    let modules: BTreeSet<String> = files.iter().map(|(p, _)| module_of(p)).collect();
    for m in &modules {
        if layer_of(m).is_none() {
            errors.push(format!(
                "module `{m}` is in no layer: add it to tidy::LAYERS and to ARCHITECTURE.md"
            ));
        }
    }
    let imports = imports(files);
    let mut edges: BTreeMap<&str, Vec<&Import>> = BTreeMap::new();
    for i in &imports {
        let (Some(lf), Some(lt)) = (layer_of(&i.from), layer_of(&i.to)) else {
            continue;
        };
        if lt > lf {
            errors.push(format!(
                "{}:{}: `{}`: {} ({}) imports {} from a layer above ({})",
                i.file, i.line, i.text, i.from, LAYERS[lf].0, i.to, LAYERS[lt].0
            ));
        } else {
            edges.entry(&i.from).or_default().push(i);
        }
    }
    // A cycle: an import a → b where b already reaches a.
    let reaches = |start: &str, goal: &str| -> Option<Vec<String>> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![(start.to_string(), vec![start.to_string()])];
        while let Some((m, path)) = stack.pop() {
            if m == goal {
                return Some(path);
            }
            if !seen.insert(m.clone()) {
                continue;
            }
            for e in edges.get(m.as_str()).into_iter().flatten() {
                let mut p = path.clone();
                p.push(e.to.clone());
                stack.push((e.to.clone(), p));
            }
        }
        None
    };
    let mut reported = BTreeSet::new();
    for i in edges.values().flatten() {
        if let Some(path) = reaches(&i.to, &i.from) {
            let mut cycle: Vec<String> = path.clone();
            cycle.sort();
            if reported.insert(cycle) {
                errors.push(format!(
                    "{}:{}: `{}` closes a cycle: {} -> {}",
                    i.file,
                    i.line,
                    i.text,
                    i.from,
                    path.join(" -> ")
                ));
            }
        }
    }
    errors
}

/// Every `.rs` file under `dir`, relative to it, sorted.
pub fn sources(dir: &Path) -> std::io::Result<Vec<(PathBuf, String)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p)?;
                let rel = p.strip_prefix(dir).unwrap_or(&p).to_path_buf();
                out.push((rel, text));
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src() -> Vec<(PathBuf, String)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        sources(&dir).expect("reading xtask/src")
    }

    /// The real tree keeps its layers.
    #[test]
    fn xtask_layers_point_one_way() {
        let files = src();
        assert!(files.len() > 20, "found only {} sources", files.len());
        let errors = check(&files);
        assert!(
            errors.is_empty(),
            "xtask's layers (ARCHITECTURE.md, tidy::LAYERS) are broken:\n  {}",
            errors.join("\n  ")
        );
        // The reader sees the imports the layers are about (so the test is not vacuous).
        let seen: BTreeSet<(String, String)> = imports(&files)
            .into_iter()
            .map(|i| (i.from, i.to))
            .collect();
        for (a, b) in [("kernel", "pins"), ("image", "kernel"), ("pins", "archive")] {
            assert!(seen.contains(&(a.into(), b.into())), "{a} -> {b} not seen");
        }
    }

    /// Injected: `pins` takes `Board` from `image` again (what it did before the layers).
    #[test]
    fn an_upward_import_is_named() {
        let mut files = src();
        let pins = files
            .iter_mut()
            .find(|(p, _)| p == Path::new("pins.rs"))
            .expect("pins.rs");
        pins.1 = format!("use crate::image::board::Board;\n{}", pins.1);
        let errors = check(&files);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(
            errors[0].starts_with(
                "xtask/src/pins.rs:1: `use crate::image::board::Board;`: pins (inputs) imports \
                 image from a layer above (pipelines and commands)"
            ),
            "{}",
            errors[0]
        );
    }

    /// Injected: a module that imports the crate root (an item of `main.rs`, as `project_root`
    /// was before `paths`): the crate root only dispatches, nothing imports it.
    #[test]
    fn importing_the_crate_root_is_named() {
        let mut files = src();
        let kernel = files
            .iter_mut()
            .find(|(p, _)| p == Path::new("kernel.rs"))
            .expect("kernel.rs");
        kernel
            .1
            .push_str("\nfn f() { let _ = crate::project_root(); }\n");
        let errors = check(&files);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(
            errors[0].contains("kernel (builders) imports main from a layer above (crate root)"),
            "{}",
            errors[0]
        );
        // And the real tree has no such import: the crate root is imported by none.
        assert!(imports(&src()).iter().all(|i| i.to != "main"));
    }

    /// Injected: two modules of one layer that use each other, through a grouped `use`.
    #[test]
    fn a_cycle_is_named() {
        let mut files = src();
        let bmap = files
            .iter_mut()
            .find(|(p, _)| p == Path::new("bmap.rs"))
            .expect("bmap.rs");
        bmap.1
            .push_str("\nuse crate::{doctor, kernel::KernelSpec};\n");
        let kernel = files
            .iter_mut()
            .find(|(p, _)| p == Path::new("kernel.rs"))
            .expect("kernel.rs");
        kernel
            .1
            .push_str("\nfn f() { let _ = crate::bmap::parse; }\n");
        let errors = check(&files);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(
            errors[0].contains("closes a cycle: ") && errors[0].contains("bmap -> kernel"),
            "{}",
            errors[0]
        );
        assert!(errors[0].starts_with("xtask/src/"), "{}", errors[0]);
    }

    /// A multi-line grouped `use` is read whole.
    #[test]
    fn grouped_use_over_lines() {
        let files = vec![
            (
                PathBuf::from("pins.rs"),
                "use crate::{\n    doctor,\n    image::board::Board,\n};\n".to_string(),
            ),
            (PathBuf::from("doctor.rs"), String::new()),
            (PathBuf::from("image/mod.rs"), String::new()),
        ];
        let errors = check(&files);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(
            errors[0]
                .starts_with("xtask/src/pins.rs:1: `use crate::{ doctor, image::board::Board, };`"),
            "{}",
            errors[0]
        );
    }

    /// A new module must be given a layer; comments and other crates' `crate::` do not count.
    #[test]
    fn unknown_modules_and_non_imports() {
        let mut files = src();
        files.push((PathBuf::from("newcmd.rs"), "use crate::image;\n".into()));
        let pins = files
            .iter_mut()
            .find(|(p, _)| p == Path::new("pins.rs"))
            .expect("pins.rs");
        pins.1
            .push_str("\n// see crate::image\nuse kiln_crate::image;\n");
        let errors = check(&files);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(errors[0].contains("module `newcmd`"), "{errors:#?}");
        assert_eq!(
            crate_targets("use crate::{disk::{self, fat}, pins::Sha256};"),
            ["disk", "pins"]
        );
        assert_eq!(
            crate_targets("let x = crate::target_dir().join(1);"),
            ["target_dir"]
        );
    }
}
