//! Licences from a Debian package's `copyright` file, where it is machine-readable (DEP-5,
//! `Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/`).
//!
//! The `License:` synopsis of every `Files:` paragraph is turned into an SPDX expression, the
//! paragraphs joined with `AND` (each covers part of the package). A Debian short name is mapped
//! only where the SPDX id means exactly the same licence; one name that cannot be mapped (or a
//! file that is not DEP-5) makes the whole package `NOASSERTION`: a licence is never guessed.

/// What the copyright file says, as the SBOM will say it.
#[derive(Debug, PartialEq, Eq)]
pub enum Licence {
    /// An SPDX licence expression.
    Spdx(String),
    /// `NOASSERTION`, and why.
    NoAssertion(String),
}

/// Debian short name (compared case-insensitively) → SPDX licence id, exact equivalents only.
const SHORT_NAMES: &[(&str, &str)] = &[
    ("Apache-2.0", "Apache-2.0"),
    ("BSD-2-clause", "BSD-2-Clause"),
    ("BSD-3-clause", "BSD-3-Clause"),
    ("BSD-4-clause", "BSD-4-Clause"),
    ("CC0-1.0", "CC0-1.0"),
    // DEP-5: "Expat" is the licence SPDX calls MIT.
    ("Expat", "MIT"),
    ("MIT", "MIT"),
    ("GPL-1", "GPL-1.0-only"),
    ("GPL-1+", "GPL-1.0-or-later"),
    ("GPL-2", "GPL-2.0-only"),
    ("GPL-2+", "GPL-2.0-or-later"),
    ("GPL-3", "GPL-3.0-only"),
    ("GPL-3+", "GPL-3.0-or-later"),
    ("LGPL-2", "LGPL-2.0-only"),
    ("LGPL-2+", "LGPL-2.0-or-later"),
    ("LGPL-2.1", "LGPL-2.1-only"),
    ("LGPL-2.1+", "LGPL-2.1-or-later"),
    ("LGPL-3", "LGPL-3.0-only"),
    ("LGPL-3+", "LGPL-3.0-or-later"),
    ("MPL-2.0", "MPL-2.0"),
    ("ISC", "ISC"),
    ("Zlib", "Zlib"),
];

/// `with <name> exception` → SPDX exception id.
const EXCEPTIONS: &[(&str, &str)] = &[
    ("GCC-exception-3.1", "GCC-exception-3.1"),
    ("GCC-exception-2.0", "GCC-exception-2.0"),
    ("Linux-syscall-note", "Linux-syscall-note"),
];

fn lookup(table: &[(&str, &'static str)], name: &str) -> Option<&'static str> {
    table
        .iter()
        .find(|(d, _)| d.eq_ignore_ascii_case(name))
        .map(|(_, s)| *s)
}

/// The paragraphs of a control-style file: (field name, first line of its value) pairs.
fn paragraphs(text: &str) -> Vec<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut cur: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        } else if line.starts_with([' ', '\t']) || line.starts_with('#') {
            // A continuation line or a comment: the synopsis is the first line only.
        } else if let Some((k, v)) = line.split_once(':') {
            cur.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn field<'a>(p: &'a [(String, String)], name: &str) -> Option<&'a str> {
    p.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// One synopsis (`GPL-2+ or BSD-3-clause, and MIT`) as an SPDX expression, or the name that
/// could not be mapped.
fn synopsis(s: &str) -> Result<String, String> {
    let mut out = String::new();
    for (n, g) in s.split(',').map(str::trim).enumerate() {
        // After a comma DEP-5 repeats the operator: `A or B, and C` is `(A OR B) AND C`.
        let (join, g) = match g.split_once(' ') {
            Some((w, rest)) if n > 0 && (w == "and" || w == "or") => (w, rest),
            _ if n > 0 => return Err(format!("no and/or after a comma in {s:?}")),
            _ => ("", g),
        };
        let expr = group(g)?;
        if n > 0 {
            out = format!("({out}) {} {expr}", join.to_ascii_uppercase());
        } else {
            out = expr;
        }
    }
    Ok(out)
}

/// One comma-free group: names joined by one kind of operator.
fn group(g: &str) -> Result<String, String> {
    let toks: Vec<&str> = g.split_whitespace().collect();
    let mut names = Vec::new();
    let mut ops = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i];
        if t == "and" || t == "or" {
            ops.push(t);
            i += 1;
            continue;
        }
        let id = lookup(SHORT_NAMES, t).ok_or_else(|| t.to_string())?;
        if toks.get(i + 1) == Some(&"with") {
            let exc = toks.get(i + 2).copied().unwrap_or_default();
            if toks.get(i + 3) != Some(&"exception") {
                return Err(format!("{t} with {exc}"));
            }
            let e = lookup(EXCEPTIONS, exc).ok_or_else(|| format!("{exc} exception"))?;
            names.push(format!("{id} WITH {e}"));
            i += 4;
        } else {
            names.push(id.to_string());
            i += 1;
        }
    }
    if names.is_empty() || ops.len() + 1 != names.len() {
        return Err(format!("malformed synopsis {g:?}"));
    }
    ops.dedup();
    match ops.as_slice() {
        [] => Ok(names.remove(0)),
        [op] if names.len() > 1 => Ok(names.join(&format!(" {} ", op.to_ascii_uppercase()))),
        // `A or B and C` without a comma has no defined grouping.
        _ => Err(format!("mixed and/or in {g:?}")),
    }
}

/// Whether `v` is the DEP-5 1.0 format URL (http or https, with or without the final slash).
fn is_dep5(v: &str) -> bool {
    let v = v.trim_end_matches('/');
    let v = v
        .strip_prefix("https://")
        .or_else(|| v.strip_prefix("http://"))
        .unwrap_or(v);
    v == "www.debian.org/doc/packaging-manuals/copyright-format/1.0"
}

/// The licence of a package from the text of its `copyright` file.
pub fn licence(text: &str) -> Licence {
    let ps = paragraphs(text);
    let Some(format) = ps.first().and_then(|h| field(h, "format")) else {
        return Licence::NoAssertion("not DEP-5 (no Format: header)".into());
    };
    if !is_dep5(format) {
        return Licence::NoAssertion(format!("not DEP-5 1.0 (Format: {format})"));
    }
    let mut exprs: Vec<String> = Vec::new();
    for p in ps.iter().filter(|p| field(p, "files").is_some()) {
        let Some(syn) = field(p, "license").filter(|l| !l.is_empty()) else {
            return Licence::NoAssertion("a Files paragraph without a License synopsis".into());
        };
        match synopsis(syn) {
            Ok(e) => exprs.push(e),
            Err(name) => return Licence::NoAssertion(format!("unmapped licence name {name}")),
        }
    }
    if exprs.is_empty() {
        return Licence::NoAssertion("no Files paragraph".into());
    }
    exprs.sort();
    exprs.dedup();
    if exprs.len() == 1 {
        return Licence::Spdx(exprs.remove(0));
    }
    let wrapped: Vec<String> = exprs
        .iter()
        .map(|e| {
            if e.contains(' ') {
                format!("({e})")
            } else {
                e.clone()
            }
        })
        .collect();
    Licence::Spdx(wrapped.join(" AND "))
}

/// The licence of the Debian package `package` from its `.deb` at `deb`
/// (`usr/share/doc/<package>/copyright`). A package without that file (libgcc-s1, whose doc
/// directory is a symlink to gcc-12-base's) is `NOASSERTION`: the other package's file is not
/// read in its place.
pub fn of_deb(deb: &std::path::Path, package: &str) -> anyhow::Result<Licence> {
    use anyhow::Context;
    let bytes = match copyright_of_deb(deb, package)? {
        Ok(b) => b,
        Err(why) => return Ok(Licence::NoAssertion(why)),
    };
    let text = String::from_utf8(bytes).with_context(|| {
        format!(
            "usr/share/doc/{package}/copyright of {}: not UTF-8",
            deb.display()
        )
    })?;
    Ok(licence(&text))
}

/// The bytes of a package's `copyright` file as its .deb holds it, or why there are none (the
/// reason [`of_deb`] gives for `NOASSERTION`). The image puts them on the card as they are.
pub fn copyright_of_deb(
    deb: &std::path::Path,
    package: &str,
) -> anyhow::Result<Result<Vec<u8>, String>> {
    use anyhow::Context;
    let member = format!("usr/share/doc/{package}/copyright");
    let bytes = match crate::archive::with_deb_member(deb, &member, |r| {
        let mut b = Vec::new();
        r.read_to_end(&mut b)
            .context("reading the copyright file")?;
        Ok(b)
    }) {
        Ok(b) => b,
        Err(e) if e.root_cause().to_string() == format!("no {member}") => {
            return Ok(Err("no copyright file in the package".into()))
        }
        Err(e) => return Err(e.context(format!("{member} of {}", deb.display()))),
    };
    if bytes.is_empty() {
        // A symlink entry reads as nothing: the file it points at is another package's.
        return Ok(Err("the copyright file is empty or a link".into()));
    }
    Ok(Ok(bytes))
}

/// This module's source: part of the key of the image step that records the licences.
pub const SOURCE: &str = include_str!("dep5.rs");

#[cfg(test)]
mod tests {
    use super::*;

    /// The real copyright files of two pinned debs (bookworm arm64), where the download cache
    /// holds them: neither is DEP-5, so both are NOASSERTION.
    #[test]
    fn pinned_debs_copyright_files() {
        let Ok(cache) = crate::pins::Cache::user() else {
            return;
        };
        for (pkg, h) in [
            (
                "busybox-static",
                "732c9135564fc71337e0e05fb4da4d11e6c28c1834bce3e405e575afef2a52f5",
            ),
            (
                "libc6",
                "01f4330719fd4f65580e16ea5a0527f372fca750e8f588d26deaf09f2d3b1cf4",
            ),
        ] {
            let deb = cache.dir.join(h);
            if !deb.exists() {
                eprintln!(
                    "skipped {pkg}: {} is not in the download cache",
                    deb.display()
                );
                continue;
            }
            let l = of_deb(&deb, pkg).expect(pkg);
            assert!(
                matches!(l, Licence::NoAssertion(ref why) if why.contains("not DEP-5")),
                "{pkg}: {l:?}"
            );
        }
    }

    const FORMAT: &str =
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n";

    #[test]
    fn not_dep5_is_noassertion() {
        // The opening of busybox-static 1:1.35.0-4+deb12u1+b1's copyright file (not DEP-5).
        let t = "This package was debianized by Erik Andersen <andersee@debian.org> on\n\
                 Sun, 18 Jun 2000 23:31:02 -0600\n";
        assert!(matches!(licence(t), Licence::NoAssertion(_)));
    }

    #[test]
    fn files_paragraphs_joined_with_and() {
        let t = format!(
            "{FORMAT}Upstream-Name: x\n\nFiles: *\nLicense: GPL-2+\n text\n\n\
             Files: lib/*\nLicense: LGPL-2.1 or BSD-2-clause\n\n\
             Files: debian/*\nLicense: GPL-2+\n\nLicense: GPL-2+\n full text\n"
        );
        assert_eq!(
            licence(&t),
            Licence::Spdx("GPL-2.0-or-later AND (LGPL-2.1-only OR BSD-2-Clause)".into())
        );
    }

    #[test]
    fn comma_groups_and_exceptions() {
        assert_eq!(
            synopsis("GPL-2+ or Expat, and MIT").as_deref(),
            Ok("(GPL-2.0-or-later OR MIT) AND MIT")
        );
        assert_eq!(
            synopsis("GPL-3+ with GCC-exception-3.1 exception").as_deref(),
            Ok("GPL-3.0-or-later WITH GCC-exception-3.1")
        );
        assert!(synopsis("GPL-2 or MIT and BSD-3-clause").is_err());
        assert!(synopsis("GPL-2+ with Foo exception").is_err());
    }

    #[test]
    fn one_unmapped_name_makes_the_package_noassertion() {
        // linux-source-6.1 6.1.192-3's copyright names GPL-2+-or-X11 (among others): no exact SPDX id.
        let t = format!(
            "{FORMAT}Upstream-Name: Linux kernel\n\nFiles: *\nLicense: GPL-2\n\n\
             Files: some/*\nLicense: GPL-2+-or-X11\n"
        );
        assert_eq!(
            licence(&t),
            Licence::NoAssertion("unmapped licence name GPL-2+-or-X11".into())
        );
    }
}
