//! The README's first screen shows an excerpt of a real boot's self-check report. This module
//! finds that excerpt and holds it to a boot's report: every line of it must be a line of the
//! report text (`report.txt`, which `cargo xtask report` prints) once timings, counts and hashes
//! are masked, so the README cannot drift from what a board prints (check ids, statuses, layout,
//! the verdict line). `boot-qemu-clean` runs it on its boot.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// The line that opens the excerpt's fenced block (the next line is the fence).
pub const MARKER: &str =
    "<!-- report excerpt: checked against a boot by `cargo xtask test --stage boot-qemu-clean` -->";

/// The excerpt's lines: the fenced block after [`MARKER`].
pub fn excerpt(readme: &str) -> Result<Vec<String>> {
    let mut lines = readme.lines().skip_while(|l| l.trim() != MARKER);
    lines
        .next()
        .with_context(|| format!("README.md has no line `{MARKER}`"))?;
    let fence = lines.next().unwrap_or_default();
    if !fence.trim_start().starts_with("```") {
        bail!("README.md: the line after the report-excerpt marker must open a ``` block");
    }
    let body: Vec<String> = lines
        .take_while(|l| !l.trim_start().starts_with("```"))
        .map(str::to_string)
        .collect();
    if body.iter().filter(|l| !l.trim().is_empty()).count() < 5 {
        bail!("README.md: the report excerpt has fewer than 5 lines");
    }
    Ok(body)
}

/// Masks what changes from boot to boot: hex strings of 8+ digits, then decimal numbers;
/// whitespace runs become one space.
fn shape(line: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let hex_len = chars[i..]
            .iter()
            .take_while(|c| c.is_ascii_hexdigit())
            .count();
        let starts_word = i == 0 || !chars[i - 1].is_alphanumeric();
        if starts_word && hex_len >= 8 && chars[i..i + hex_len].iter().any(|c| c.is_ascii_digit()) {
            out.push_str("<hex>");
            i += hex_len;
        } else if c.is_ascii_digit() {
            let n = chars[i..]
                .iter()
                .take_while(|c| c.is_ascii_digit() || **c == '.')
                .count();
            out.push('#');
            i += n;
        } else if c.is_whitespace() {
            if !out.ends_with(' ') {
                out.push(' ');
            }
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out.trim().to_string()
}

/// Every excerpt line (but blank lines and a `…` line that marks left-out rows) must have the
/// shape of some line of `report_text`. The errors name each line that does not.
pub fn check(excerpt: &[String], report_text: &str) -> Result<()> {
    let real: std::collections::BTreeSet<String> = report_text.lines().map(shape).collect();
    let missing: Vec<&String> = excerpt
        .iter()
        .filter(|l| !l.trim().is_empty() && l.trim() != "…" && l.trim() != "...")
        .filter(|l| !real.contains(&shape(l)))
        .collect();
    if !missing.is_empty() {
        bail!(
            "README.md's report excerpt has {} line(s) that this boot's report.txt has not \
             (copy the excerpt from `cargo xtask report target/boot-test/disk.img`):\n  {}",
            missing.len(),
            missing
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
    Ok(())
}

/// [`check`] of the README at `root` against a boot's report text.
pub fn check_readme(root: &Path, report_text: &str) -> Result<()> {
    let p = root.join("README.md");
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    check(&excerpt(&text)?, report_text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "kiln 0.1.0 self-check on qemu-virt: PASS
image: 5f81c6e1aa00ffee5f81c6e1aa00ffee5f81c6e1aa00ffee5f81c6e1aa00ffee
37 passed, 0 failed, 3 skipped

check                 ms  reason
kernel.release  PASS  1.7
                      uname -r = 6.1.192-kiln (pinned)
memory.bandwidth  SKIP  389.3  board qemu-virt pins no minimum read bandwidth (measured 5.70 GB/s)
model.nll.cpu  PASS  7135.2

KILN-SELFTEST: PASS 37/40 manifest=5f81c6e1aa00ffee5f81c6e1aa00ffee5f81c6e1aa00ffee5f81c6e1aa00ffee
";

    fn readme(block: &str) -> String {
        format!("# kiln\n\ntext\n\n{MARKER}\n```text\n{block}\n```\nmore\n")
    }

    #[test]
    fn an_excerpt_of_the_report_passes() {
        let r = readme(
            "kiln 0.1.0 self-check on qemu-virt: PASS\n\
             image: 00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n\
             38 passed, 0 failed, 2 skipped\n\
             kernel.release    PASS      2.1\n\
             …\n\
             model.nll.cpu  PASS   9000.0\n\
             KILN-SELFTEST: PASS 38/40 manifest=00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
        );
        let ex = excerpt(&r).unwrap();
        assert_eq!(ex.len(), 7);
        check(&ex, REPORT).unwrap();
    }

    /// Injected: a status the boot did not report, a check id it does not have, the old
    /// verdict format: each is named.
    #[test]
    fn drift_is_named() {
        for (line, why) in [
            ("kernel.release  FAIL  1.7", "status"),
            ("kernel.relase  PASS  1.7", "check id"),
            (
                "KILN-SELFTEST: PASS 37/40 image=5f81c6e1aa00ffee5f81c6e1aa00ffee",
                "verdict",
            ),
        ] {
            let r = readme(&format!(
                "kiln 0.1.0 self-check on qemu-virt: PASS\nimage: 00112233\n1 passed, 0 failed, 2 skipped\nmodel.nll.cpu  PASS  1.0\n{line}"
            ));
            let e = check(&excerpt(&r).unwrap(), REPORT)
                .unwrap_err()
                .to_string();
            assert!(e.contains(line) && e.contains("1 line(s)"), "{why}: {e}");
        }
    }

    #[test]
    fn a_readme_without_the_excerpt_is_an_error() {
        assert!(excerpt("# kiln\n").is_err());
        assert!(excerpt(&format!("{MARKER}\nnot a fence\n")).is_err());
        assert!(excerpt(&readme("one\ntwo")).is_err());
    }
}
