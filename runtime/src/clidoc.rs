//! docs/commands.md from the commands' own `--help`: a clap command tree as Markdown, one
//! section per visible command (its usage, its long help, each visible argument with its long
//! help, default and possible values). `cargo xtask docs --write` writes the page; a test in each
//! program (`cargo xtask`'s `main.rs`, `kiln`'s `main.rs`) fails while its part of the page is
//! not what this gives, so the page cannot drift from `--help`. Here rather than in xtask because
//! both programs render with it and xtask cannot see `kiln`'s command line (a binary's).

use clap::{Arg, Command};
use std::collections::BTreeSet;

/// The lines around one program's part of docs/commands.md.
pub fn markers(program: &str) -> (String, String) {
    (
        format!("<!-- {program}: generated from its --help by `cargo xtask docs --write` -->"),
        format!("<!-- end of {program} -->"),
    )
}

/// Every visible subcommand of `root`, depth first, as Markdown (`### \`root sub\`` sections).
pub fn markdown(root: &Command) -> String {
    let mut root = root.clone();
    root.build();
    let mut out = String::new();
    for sub in visible(&root) {
        section(sub, &BTreeSet::new(), &mut out);
    }
    out
}

/// `doc` with `program`'s part replaced by `part`, or an error naming the missing marker.
pub fn with_part(doc: &str, program: &str, part: &str) -> Result<String, String> {
    let (begin, end) = markers(program);
    replace_between(
        doc,
        "docs/commands.md",
        (&begin, &end),
        &format!("\n{part}"),
    )
}

/// A generated part of a page: `doc` split at the lines `begin` and `end` into what comes
/// before `begin`, what lies between, and what follows `end`; `file` names the page in the
/// error when a marker is missing. Every generated page of the project (docs/commands.md,
/// docs/testing.md's stage table, ARCHITECTURE.md's layer list) is read through it.
pub fn between<'a>(
    doc: &'a str,
    file: &str,
    (begin, end): (&str, &str),
) -> Result<(&'a str, &'a str, &'a str), String> {
    let (head, rest) = doc
        .split_once(begin)
        .ok_or_else(|| format!("{file} has no line {begin}"))?;
    let (inner, tail) = rest
        .split_once(end)
        .ok_or_else(|| format!("{file} has no line {end}"))?;
    Ok((head, inner, tail))
}

/// `doc` with what lies between `begin` and `end` replaced by a newline and `body`.
pub fn replace_between(
    doc: &str,
    file: &str,
    (begin, end): (&str, &str),
    body: &str,
) -> Result<String, String> {
    let (head, _, tail) = between(doc, file, (begin, end))?;
    Ok(format!("{head}{begin}\n{body}{end}{tail}"))
}

fn visible(c: &Command) -> impl Iterator<Item = &Command> {
    c.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

/// One command's section, then its subcommands'. `inherited`: the global arguments a parent's
/// section already showed.
fn section(cmd: &Command, inherited: &BTreeSet<String>, out: &mut String) {
    let name = cmd.get_bin_name().unwrap_or(cmd.get_name());
    out.push_str(&format!("### `{name}`\n\n"));
    let usage = cmd.clone().render_usage().to_string();
    out.push_str(&format!("```text\n{}\n```\n\n", usage.trim()));
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        out.push_str(&format!("{}\n\n", text(about.to_string().trim())));
    }
    let args: Vec<&Arg> = cmd
        .get_arguments()
        .filter(|a| {
            let id = a.get_id().as_str();
            !a.is_hide_set() && id != "help" && id != "version" && !inherited.contains(id)
        })
        .collect();
    for a in &args {
        out.push_str(&arg_item(a));
    }
    if !args.is_empty() {
        out.push('\n');
    }
    let mut globals = inherited.clone();
    globals.extend(
        args.iter()
            .filter(|a| a.is_global_set())
            .map(|a| a.get_id().as_str().to_string()),
    );
    for sub in visible(cmd) {
        section(sub, &globals, out);
    }
}

/// `- \`-p, --prompt <PROMPT>\`: help [default: …] [possible values: …]`, later paragraphs
/// of the help indented under the item.
fn arg_item(a: &Arg) -> String {
    let takes = a.get_action().takes_values();
    let values: Vec<String> = a
        .get_value_names()
        .map(|v| v.iter().map(|n| format!("<{n}>")).collect())
        .unwrap_or_else(|| vec![format!("<{}>", a.get_id().as_str().to_uppercase())]);
    let mut names = Vec::new();
    if let Some(s) = a.get_short() {
        names.push(format!("-{s}"));
    }
    if let Some(l) = a.get_long() {
        names.push(format!("--{l}"));
    }
    let mut flag = names.join(", ");
    if takes {
        if !flag.is_empty() {
            flag.push(' ');
        }
        flag.push_str(&values.join(" "));
    }
    let help = a
        .get_long_help()
        .or(a.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let mut extra = Vec::new();
    if takes && !a.is_hide_default_value_set() && !a.get_default_values().is_empty() {
        let d: Vec<String> = a
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        extra.push(format!("[default: {}]", d.join(", ")));
    }
    let possible: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| p.get_name().to_string())
        .collect();
    if takes && !a.is_hide_possible_values_set() && !possible.is_empty() {
        extra.push(format!("[possible values: {}]", possible.join(", ")));
    }
    let mut paragraphs: Vec<String> = help
        .trim()
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
        .map(|p| text(p.trim()))
        .collect();
    if !extra.is_empty() {
        match paragraphs.last_mut() {
            Some(last) => {
                last.push(' ');
                last.push_str(&extra.join(" "));
            }
            None => paragraphs.push(extra.join(" ")),
        }
    }
    let mut item = format!("- `{flag}`");
    for (i, p) in paragraphs.iter().enumerate() {
        if i == 0 {
            item.push_str(&format!(": {p}\n"));
        } else {
            item.push_str(&format!("\n  {}\n", p.replace('\n', "\n  ")));
        }
    }
    if paragraphs.is_empty() {
        item.push('\n');
    }
    item
}

/// Help text as Markdown: outside code spans a `<` that would open an HTML tag (`kiln-<board>`)
/// is escaped, so the page shows what `--help` prints.
fn text(help: &str) -> String {
    let mut out = String::with_capacity(help.len());
    let mut code = false;
    let mut chars = help.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '`' => code = !code,
            '<' if !code
                && chars
                    .peek()
                    .is_some_and(|n| n.is_ascii_alphabetic() || *n == '/') =>
            {
                out.push('\\')
            }
            _ => {}
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli() -> Command {
        Command::new("tool")
            .subcommand(
                Command::new("make")
                    .about("Make a thing")
                    .long_about("Make a thing.\n\nIt is made twice.")
                    .arg(Arg::new("file").value_name("FILE").required(true))
                    .arg(
                        Arg::new("board")
                            .long("board")
                            .value_name("BOARD")
                            .default_value("qemu-virt")
                            .help("Board recipe"),
                    )
                    .arg(
                        Arg::new("fast")
                            .long("fast")
                            .action(clap::ArgAction::SetTrue)
                            .help("Quickly.\n\nNot in CI."),
                    )
                    .arg(
                        Arg::new("secret")
                            .long("secret")
                            .hide(true)
                            .action(clap::ArgAction::SetTrue),
                    ),
            )
            .subcommand(Command::new("hidden").hide(true))
            .subcommand(
                Command::new("slot")
                    .about("Slots")
                    .arg(
                        Arg::new("env")
                            .long("env")
                            .global(true)
                            .value_name("ENV")
                            .help("The file"),
                    )
                    .subcommand(Command::new("status").about("Print it")),
            )
    }

    #[test]
    fn every_visible_command_with_its_long_help() {
        let md = markdown(&cli());
        let want = "### `tool make`\n\n```text\nUsage: tool make [OPTIONS] <FILE>\n```\n\n\
             Make a thing.\n\nIt is made twice.\n\n\
             - `<FILE>`\n\
             - `--board <BOARD>`: Board recipe [default: qemu-virt]\n\
             - `--fast`: Quickly.\n\n  Not in CI.\n\n\
             ### `tool slot`\n\n```text\nUsage: tool slot [OPTIONS] [COMMAND]\n```\n\nSlots\n\n\
             - `--env <ENV>`: The file\n\n\
             ### `tool slot status`\n\n```text\nUsage: tool slot status [OPTIONS]\n```\n\n\
             Print it\n\n";
        assert_eq!(md, want, "{md}");
    }

    #[test]
    fn a_tag_outside_code_is_escaped() {
        assert_eq!(
            text("kiln-<board>.img, `kiln-<board>.img`, a </b> and x <= 1"),
            "kiln-\\<board>.img, `kiln-<board>.img`, a \\</b> and x <= 1"
        );
    }

    #[test]
    fn a_part_is_replaced_between_its_markers() {
        let (b, e) = markers("tool");
        let doc = format!("# Head\n{b}\nold\n{e}\ntail\n");
        assert_eq!(
            with_part(&doc, "tool", "new\n").unwrap(),
            format!("# Head\n{b}\n\nnew\n{e}\ntail\n")
        );
        assert!(with_part("# Head\n", "tool", "x")
            .unwrap_err()
            .contains("no line <!-- tool:"));
    }
}
