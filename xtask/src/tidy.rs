//! The layers of `xtask`, kept by a test (as rust-analyzer keeps its conventions in `tidy`
//! tests): every `crate::…` path in a module's source must point to its own layer or one below,
//! and the modules must not import each other in a circle. ARCHITECTURE.md lists the same table
//! (held equal to [`LAYERS`] here) and names every module of both crates (held here too).

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

/// The circles between sibling files of one directory module: file `a.rs` naming `super::b`
/// where `b.rs` (or `b/`) is its sibling, and back, directly or around. `files` as for
/// [`imports`]; comments and strings skipped, `mod.rs` (the parent) left out. Each circle once,
/// as `dir: a -> b -> a`.
pub fn sibling_cycles(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut dirs: BTreeMap<PathBuf, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (rel, _) in files {
        let (Some(dir), Some(stem)) = (rel.parent(), rel.file_stem()) else {
            continue;
        };
        let stem = stem.to_string_lossy().into_owned();
        if stem == "mod" {
            if let (Some(up), Some(name)) = (dir.parent(), dir.file_name()) {
                let name = name.to_string_lossy().into_owned();
                dirs.entry(up.to_path_buf())
                    .or_default()
                    .entry(name)
                    .or_default();
            }
        } else {
            dirs.entry(dir.to_path_buf())
                .or_default()
                .entry(stem)
                .or_default();
        }
    }
    for (rel, text) in files {
        let (Some(dir), Some(stem)) = (rel.parent(), rel.file_stem()) else {
            continue;
        };
        let (dir, stem) = if stem == "mod" {
            match (dir.parent(), dir.file_name()) {
                (Some(up), Some(n)) => (up, n.to_string_lossy().into_owned()),
                _ => continue,
            }
        } else {
            (dir, stem.to_string_lossy().into_owned())
        };
        // A directory module's own files name their parent `mod.rs` `super`; only a plain file's
        // `super::` is its directory.
        if rel.file_stem().is_some_and(|s| s == "mod") {
            continue;
        }
        let Some(siblings) = dirs.get(dir) else {
            continue;
        };
        let names: BTreeSet<String> = siblings.keys().cloned().collect();
        let mut found = BTreeSet::new();
        for line in text.lines() {
            let code = without_strings(line.split("//").next().unwrap_or(""));
            for (i, _) in code.match_indices("super::") {
                if code[..i].ends_with("super::") {
                    continue; // super::super:: reaches past the directory
                }
                let rest = &code[i + "super::".len()..];
                let mut targets: Vec<String> = Vec::new();
                if let Some(group) = rest.strip_prefix('{') {
                    let group = group.split('}').next().unwrap_or("");
                    targets.extend(
                        group
                            .split(',')
                            .map(|t| t.trim().split("::").next().unwrap_or("").trim().to_string()),
                    );
                } else {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    targets.push(name);
                }
                for t in targets {
                    if t != stem && names.contains(&t) {
                        found.insert(t);
                    }
                }
            }
        }
        if let Some(e) = dirs.get_mut(dir).and_then(|m| m.get_mut(&stem)) {
            e.extend(found);
        }
    }
    rings(&dirs)
}

/// Each circle of the per-directory import graphs `dirs` once, as `dir: a -> b -> a`.
fn rings(dirs: &BTreeMap<PathBuf, BTreeMap<String, BTreeSet<String>>>) -> Vec<String> {
    let mut out = BTreeSet::new();
    for (dir, graph) in dirs {
        for start in graph.keys() {
            // Every path from `start` back to it, shortest first (breadth first).
            let mut queue = std::collections::VecDeque::from([vec![start.clone()]]);
            while let Some(path) = queue.pop_front() {
                let last = path.last().cloned().unwrap_or_default();
                for next in graph.get(&last).into_iter().flatten() {
                    if next == start {
                        // Named once, from its smallest member.
                        if path.iter().all(|p| p >= start) {
                            let mut ring = path.clone();
                            ring.push(start.clone());
                            let d = dir.display().to_string();
                            let d = if d.is_empty() { "src".into() } else { d };
                            out.insert(format!("{d}: {}", ring.join(" -> ")));
                        }
                    } else if !path.contains(next) && path.len() < 8 {
                        let mut p = path.clone();
                        p.push(next.clone());
                        queue.push_back(p);
                    }
                }
            }
        }
    }
    out.into_iter().collect()
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

/// The lines around ARCHITECTURE.md's copy of [`LAYERS`].
pub const ARCH_LAYERS_BEGIN: &str = "<!-- layers: tidy::LAYERS, held equal by tidy's tests -->";
pub const ARCH_LAYERS_END: &str = "<!-- end of layers -->";

/// ARCHITECTURE.md's layer list: the lines between [`ARCH_LAYERS_BEGIN`] and
/// [`ARCH_LAYERS_END`], each `N. name: `module`, `module`, …`, as (name, modules).
pub fn arch_layers(doc: &str) -> Result<Vec<(String, Vec<String>)>, String> {
    let (_, list, _) = kiln_runtime::clidoc::between(
        doc,
        "ARCHITECTURE.md",
        (ARCH_LAYERS_BEGIN, ARCH_LAYERS_END),
    )?;
    let mut out = Vec::new();
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let item = line
            .split_once(". ")
            .filter(|(n, _)| n.chars().all(|c| c.is_ascii_digit()))
            .map(|(_, rest)| rest)
            .ok_or_else(|| format!("ARCHITECTURE.md's layer list: `{line}` is not `N. name: …`"))?;
        let (name, modules) = item
            .split_once(':')
            .ok_or_else(|| format!("ARCHITECTURE.md's layer list: `{line}` has no `:`"))?;
        let modules = modules
            .split(',')
            .map(|m| m.trim().trim_matches('`').to_string())
            .filter(|m| !m.is_empty())
            .collect();
        out.push((name.trim().to_string(), modules));
    }
    Ok(out)
}

/// [`LAYERS`] as [`arch_layers`] reads them, and as ARCHITECTURE.md must list them.
pub fn layers_text() -> String {
    LAYERS
        .iter()
        .enumerate()
        .map(|(i, (name, ms))| {
            let ms: Vec<String> = ms.iter().map(|m| format!("`{m}`")).collect();
            format!("{}. {name}: {}\n", i + 1, ms.join(", "))
        })
        .collect()
}

/// A module of a crate's `src/`, as its path components and whether it is a folder (`disk/` with
/// its `mod.rs`) or a file (`disk/gpt.rs`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Module {
    pub comps: Vec<String>,
    pub folder: bool,
}

impl Module {
    /// As ARCHITECTURE.md may name it: `disk/`, `disk/gpt.rs`.
    pub fn path(&self) -> String {
        let p = self.comps.join("/");
        if self.folder {
            format!("{p}/")
        } else {
            format!("{p}.rs")
        }
    }
}

/// Every module under `src` (paths relative to it, as [`sources`] gives them): each `.rs` file
/// but the crate roots (`main.rs`, `lib.rs`) and `mod.rs` files, and each folder with a `mod.rs`
/// (a folder beside `name.rs`, as `pins/`, holds that module's children: `pins.rs` is the module).
pub fn modules(files: &[PathBuf]) -> Vec<Module> {
    let mut out = BTreeSet::new();
    for f in files {
        let comps: Vec<String> = f
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let Some((last, dirs)) = comps.split_last() else {
            continue;
        };
        let stem = last.trim_end_matches(".rs").to_string();
        if dirs.is_empty() && (stem == "main" || stem == "lib") {
            continue;
        }
        if stem == "mod" {
            out.insert(Module {
                comps: dirs.to_vec(),
                folder: true,
            });
        } else {
            let mut c = dirs.to_vec();
            c.push(stem);
            out.insert(Module {
                comps: c,
                folder: false,
            });
        }
    }
    out.into_iter().collect()
}

/// The modules a word of ARCHITECTURE.md names, of one crate's `all`: a path that ends a module's
/// path at a component boundary (`gpt.rs`, `disk/gpt.rs`, `xtask/src/disk/gpt.rs`, `disk/`,
/// `disk/mod.rs`), a Rust path through one (`disk::gpt`, `kiln_runtime::disk::gpt::assemble`;
/// one component only for a top-level module), or a top-level module's bare name (`disk`). A
/// word that fits several modules of the crate names none of them.
fn named_by(word: &str, crate_src: &str, all: &[Module]) -> Vec<Module> {
    let ends_with = |m: &Module, c: &[String]| m.comps.len() >= c.len() && m.comps.ends_with(c);
    let unique = |found: Vec<&Module>| -> Vec<Module> {
        if found.len() == 1 {
            vec![found[0].clone()]
        } else {
            Vec::new()
        }
    };
    let word = word
        .strip_prefix(crate_src)
        .or_else(|| word.strip_prefix("src/"))
        .unwrap_or(word);
    if word.ends_with(".rs") || word.ends_with('/') {
        let mut folder = word.ends_with('/');
        let mut comps: Vec<String> = word
            .split('/')
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .collect();
        if let Some(stem) = comps.last().and_then(|l| l.strip_suffix(".rs")) {
            let stem = stem.to_string();
            comps.pop();
            if stem == "mod" {
                folder = true;
            } else {
                comps.push(stem);
            }
        }
        if comps.is_empty() {
            return Vec::new();
        }
        return unique(
            all.iter()
                .filter(|m| m.folder == folder && ends_with(m, &comps))
                .collect(),
        );
    }
    let ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if word.contains("::") {
        let path = ["crate::", "kiln_runtime::", "super::"]
            .iter()
            .find_map(|p| word.strip_prefix(p))
            .unwrap_or(word);
        let comps: Vec<String> = path.split("::").map(str::to_string).collect();
        if !comps.iter().all(|c| ident(c)) {
            return Vec::new();
        }
        let mut out = Vec::new();
        for n in 1..=comps.len() {
            let c = &comps[..n];
            out.extend(unique(
                all.iter()
                    .filter(|m| ends_with(m, c) && (c.len() >= 2 || m.comps.len() == 1))
                    .collect(),
            ));
        }
        return out;
    }
    if ident(word) {
        return unique(
            all.iter()
                .filter(|m| m.comps.len() == 1 && m.comps[0] == word)
                .collect(),
        );
    }
    Vec::new()
}

/// The modules of `all` (one crate's, under `crate_src`, e.g. `runtime/src/`) that no backticked
/// word of `text` names (see [`named_by`]).
pub fn unnamed(text: &str, crate_src: &str, all: &[Module]) -> Vec<Module> {
    let mut named = BTreeSet::new();
    for (i, span) in text.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        for word in span.split(|c: char| c.is_whitespace() || ",;()[]{}'\"".contains(c)) {
            named.extend(named_by(word, crate_src, all));
        }
    }
    all.iter()
        .filter(|m| !named.contains(*m))
        .cloned()
        .collect()
}

/// ARCHITECTURE.md's section under `heading` (a `### ` line), up to the next `## ` or `### `.
pub fn section<'d>(doc: &'d str, heading: &str) -> Result<&'d str, String> {
    let start = doc
        .lines()
        .position(|l| l.trim() == heading)
        .ok_or_else(|| format!("ARCHITECTURE.md has no heading `{heading}`"))?;
    let lines: Vec<&str> = doc.lines().collect();
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## ") || l.starts_with("### "))
        .map_or(lines.len(), |e| start + 1 + e);
    let from = lines[..start].iter().map(|l| l.len() + 1).sum::<usize>();
    let to = lines[..end].iter().map(|l| l.len() + 1).sum::<usize>();
    Ok(&doc[from..to.min(doc.len())])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src() -> Vec<(PathBuf, String)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        sources(&dir).expect("reading xtask/src")
    }

    fn architecture_md() -> String {
        let p = crate::paths::project_root().join("ARCHITECTURE.md");
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
    }

    /// ARCHITECTURE.md's layer list is [`LAYERS`], layer by layer, module by module, in order.
    #[test]
    fn architecture_md_lists_the_layers() {
        let doc = architecture_md();
        let listed = arch_layers(&doc).unwrap();
        let want: Vec<(String, Vec<String>)> = LAYERS
            .iter()
            .map(|(n, ms)| (n.to_string(), ms.iter().map(|m| m.to_string()).collect()))
            .collect();
        assert!(
            listed == want,
            "ARCHITECTURE.md's layer list (between {ARCH_LAYERS_BEGIN} and {ARCH_LAYERS_END}) is \
             not tidy::LAYERS; it should read:\n{}",
            layers_text()
        );
    }

    /// ARCHITECTURE.md names every module of both crates, each in its crate's section: a file or
    /// folder added under `xtask/src` or `runtime/src` is a failing test until the code map
    /// says what it is.
    #[test]
    fn architecture_md_names_every_module() {
        let doc = architecture_md();
        let root = crate::paths::project_root();
        let mut missing = Vec::new();
        for (krate, heading) in [
            ("xtask", "### `xtask/`: the host tool"),
            (
                "runtime",
                "### `runtime/`: `kiln`, on the board and the host",
            ),
        ] {
            let src = root.join(krate).join("src");
            let files: Vec<PathBuf> = sources(&src).unwrap().into_iter().map(|(p, _)| p).collect();
            let all = modules(&files);
            assert!(all.len() > 20, "{krate}: only {} modules", all.len());
            let text = section(&doc, heading).unwrap();
            for m in unnamed(text, &format!("{krate}/src/"), &all) {
                missing.push(format!("{krate}/src/{}", m.path()));
            }
        }
        assert!(
            missing.is_empty(),
            "ARCHITECTURE.md's code map does not name these modules (name each in its crate's \
             section, in backticks: `gpt.rs`, `disk/gpt.rs`, `disk/`, or `disk::gpt`):\n  {}",
            missing.join("\n  ")
        );
    }

    /// How a module is named: by a path or Rust path that ends it, unambiguously; a folder only as
    /// a folder; a nested module never by its bare name. Injected: a list that drops a module.
    #[test]
    fn how_modules_are_named() {
        let files: Vec<PathBuf> = [
            "main.rs",
            "disk/mod.rs",
            "disk/gpt.rs",
            "disk/tests.rs",
            "quant/tests.rs",
            "quant/mod.rs",
            "pins.rs",
            "pins/identity.rs",
            "serve/mod.rs",
            "cli/serve.rs",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        let all = modules(&files);
        let paths: Vec<String> = all.iter().map(Module::path).collect();
        assert_eq!(
            paths,
            [
                "cli/serve.rs",
                "disk/",
                "disk/gpt.rs",
                "disk/tests.rs",
                "pins.rs",
                "pins/identity.rs",
                "quant/",
                "quant/tests.rs",
                "serve/"
            ]
        );
        let left = |text: &str| -> Vec<String> {
            unnamed(text, "x/src/", &all)
                .iter()
                .map(Module::path)
                .collect()
        };
        let full = "`disk/` (`gpt.rs`, `disk/tests.rs`), `quant` with `quant/tests.rs`, \
                    `pins` and `pins::identity::check`, `serve/`, `x/src/cli/serve.rs`";
        assert!(left(full).is_empty(), "{:?}", left(full));
        // `tests.rs` is two modules' name, `gpt` is not a top-level module, `serve.rs` is not
        // the folder `serve/`, `identity` alone is a nested module's bare name.
        assert_eq!(
            left("`disk` `tests.rs` `gpt` `quant/` `pins.rs` `identity` `serve.rs`"),
            [
                "disk/gpt.rs",
                "disk/tests.rs",
                "pins/identity.rs",
                "quant/tests.rs",
                "serve/"
            ]
        );
    }

    /// The layer list is read line by line; a layer or module out of place is seen.
    #[test]
    fn the_layer_list_is_read() {
        let doc = format!(
            "x\n{ARCH_LAYERS_BEGIN}\n{}{ARCH_LAYERS_END}\ny\n",
            layers_text()
        );
        let got = arch_layers(&doc).unwrap();
        assert_eq!(got.len(), LAYERS.len());
        assert_eq!(got[1], ("inputs".to_string(), vec!["pins".to_string()]));
        let moved = doc.replace("`kernel_modules`, ", "");
        assert_ne!(arch_layers(&moved).unwrap()[2].1, got[2].1);
        assert!(arch_layers("no list").is_err());
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

    /// No two sibling files import each other, directly or around, in either crate; the
    /// runtime's `backend/cpu` circle is the one left (issue 60: the backend cut by instruction
    /// set removes it, and this list with it).
    #[test]
    fn sibling_files_import_one_way() {
        let runtime = sources(&crate::paths::project_root().join("runtime/src"))
            .expect("reading runtime/src");
        let mut found = sibling_cycles(&src());
        found.extend(
            sibling_cycles(&runtime)
                .into_iter()
                .map(|c| format!("runtime/{c}")),
        );
        let known = |c: &String| c.starts_with("runtime/backend/cpu: ");
        assert!(
            found.iter().any(known),
            "runtime/backend/cpu has no circle any more: take it out of this test's list"
        );
        let new: Vec<&String> = found.iter().filter(|c| !known(c)).collect();
        assert!(
            new.is_empty(),
            "sibling files import each other in a circle (move what both need into a module of \
             its own):\n  {}",
            new.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }

    /// Injected: `image/updates.rs` takes `Ctx` from `steps.rs` again, which imports it back.
    #[test]
    fn a_sibling_circle_is_named() {
        let mut files = src();
        let updates = files
            .iter_mut()
            .find(|(p, _)| p == Path::new("image/updates.rs"))
            .expect("image/updates.rs");
        updates
            .1
            .push_str("\nfn f() { let _ = super::steps::models_key; }\n");
        let found = sibling_cycles(&files);
        assert!(
            found
                .iter()
                .any(|c| c == "image: steps -> updates -> steps"),
            "{found:?}"
        );
        // Grouped and nested paths count; strings, comments and `super::super::` do not.
        let t = |s: &str| (PathBuf::from(format!("m/{s}.rs")), String::new());
        let mut files = vec![t("a"), t("b"), t("c")];
        files[0].1 = "use super::{b::X, other};".into();
        files[1].1 = "// super::a\nlet s = \"super::a\"; super::super::a::f();".into();
        assert!(sibling_cycles(&files).is_empty());
        files[1].1 = "fn f() { super::c::g() }".into();
        files[2].1 = "use super::a;".into();
        assert_eq!(
            sibling_cycles(&files),
            vec!["m: a -> b -> c -> a".to_string()]
        );
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
