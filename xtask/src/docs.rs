//! `cargo xtask docs`: docs/commands.md, every command of `cargo xtask` and of the board's `kiln`
//! with its `--help` (usage, long help, every visible option), rendered by
//! `kiln_runtime::clidoc`. `--write` writes the page; without it the page is printed.
//! `cargo xtask`'s part is rendered from the command line `main.rs` hands over (no module
//! imports the crate root); `kiln`'s command line lives in its binary, so its part is what the
//! host build of `kiln` prints (`kiln commands-md`, hidden). Each program's tests hold its part of
//! the page equal to its `--help`: `main.rs`'s `docs_commands_md_is_the_help` here, the same
//! test in `runtime/src/main.rs` for `kiln`.

use anyhow::{anyhow, Context, Result};
use kiln_runtime::clidoc;
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Write docs/commands.md; without it, print what it would hold.
    #[arg(long)]
    pub write: bool,
}

/// The page, relative to the workspace root.
pub const PAGE: &str = "docs/commands.md";

/// `cargo xtask`'s part of the page (the root command's name is the program's).
pub fn xtask_part(xtask: &clap::Command) -> String {
    clidoc::markdown(xtask)
}

/// `doc` with `program`'s part replaced.
pub fn with_part(doc: &str, program: &str, part: &str) -> Result<String> {
    clidoc::with_part(doc, program, part).map_err(|e| anyhow!(e))
}

/// `kiln`'s part, from the host build of `kiln` (`cargo run`: built first if needed).
fn kiln_part() -> Result<String> {
    let sh = crate::paths::shell()?;
    let out = cmd!(
        sh,
        "cargo run --quiet --locked -p kiln-runtime --bin kiln -- commands-md"
    )
    .output()
    .context("`kiln commands-md` (the host build of kiln)")?;
    String::from_utf8(out.stdout).context("`kiln commands-md` printed other than UTF-8")
}

pub fn run(a: Args, xtask: &clap::Command) -> Result<()> {
    let path = crate::paths::project_root().join(PAGE);
    let doc =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let name = xtask.get_name().to_string();
    let doc = with_part(&doc, &name, &xtask_part(xtask))?;
    let doc = with_part(&doc, "kiln", &kiln_part()?)?;
    if a.write {
        crate::atomic::write_atomic(&path, doc.as_bytes())?;
        println!("wrote every command's --help into {}", path.display());
    } else {
        print!("{doc}");
    }
    Ok(())
}
