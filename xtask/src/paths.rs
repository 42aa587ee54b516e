//! Where things are: the workspace root, `target/`, and a shell that starts there. Ground: every
//! module may use it; the crate root (`main.rs`) only parses and dispatches and is imported by none.

use std::path::{Path, PathBuf};

/// The workspace root: the folder above this crate.
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// `target/` under the root, unless `CARGO_TARGET_DIR` moves it.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_root().join("target"))
}

/// An `xshell` shell whose working directory is the workspace root.
pub fn shell() -> anyhow::Result<xshell::Shell> {
    let sh = xshell::Shell::new()?;
    sh.change_dir(project_root());
    Ok(sh)
}
