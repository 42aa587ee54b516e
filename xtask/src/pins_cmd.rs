//! `cargo xtask pins check|update|lock`: the command over [`crate::pins`]. It knows boards;
//! `pins` does not: it is handed the pins files of the board to act on.

use crate::image::board::Board;
use crate::pins;
use anyhow::{Context, Result};
use std::path::Path;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub cmd: PinsCmd,
}

#[derive(clap::Subcommand)]
pub enum PinsCmd {
    /// Resolve every pinned input of a board into the download cache and verify it, without
    /// building.
    Check {
        /// Board recipe under `images/`.
        #[arg(long, default_value = "qemu-virt")]
        board: String,
        /// Use the cache alone; list what is missing.
        #[arg(long)]
        offline: bool,
    },
    /// Re-pin the Debian packages to what the archive serves now, showing the diff, and record with
    /// each the snapshot.debian.org timestamp and path that serve it.
    Update,
    /// Re-resolve the tools root's closure (a minimal bookworm amd64 root and the tools that shape
    /// the image, images/tools-root.toml) to what the archive serves now, download every package
    /// into the cache and rewrite the pin list whole.
    UpdateToolsRoot,
    /// Check a file you supply (vendor kernel, U-Boot blobs, `librknnrt.so`) against its declared
    /// identity, lock its sha256 in the pins and cache it.
    Lock {
        /// Board recipe under `images/`.
        #[arg(long, default_value = "rock-5b-vendor")]
        board: String,
        /// `NAME=PATH`, e.g. `librknnrt=/tmp/librknnrt.so`.
        #[arg(long = "input", required = true)]
        inputs: Vec<String>,
    },
    /// Put files fetched elsewhere into the download cache, each only if it is (by sha256) the
    /// pinned file of one of the board's inputs: for a machine that cannot reach a url input (the
    /// rkbin DDR blob and rkbin's LICENSE, fetched from GitHub).
    Seed {
        /// Board recipe under `images/`.
        #[arg(long, default_value = "rock-5b")]
        board: String,
        /// The files, e.g. the rkbin DDR blob.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
    },
}

pub fn run(args: Args) -> Result<()> {
    match args.cmd {
        PinsCmd::Check { board, offline } => {
            let board = Board::load(&board)?;
            pins::check(&board.name, &board.pin_files(), offline)?;
            let tools = crate::paths::project_root().join(crate::tools_root::PINS);
            pins::check("the tools root", &[tools], offline)
        }
        PinsCmd::Update => pins::update(),
        PinsCmd::UpdateToolsRoot => crate::tools_root::update(),
        PinsCmd::Seed { board, files } => {
            let board = Board::load(&board)?;
            pins::seed(&board.pin_files(), &files).map(|_| ())
        }
        PinsCmd::Lock { board, inputs } => {
            let board = Board::load(&board)?;
            for spec in inputs {
                let (name, path) = spec
                    .split_once('=')
                    .with_context(|| format!("--input takes NAME=PATH, got {spec:?}"))?;
                pins::lock(&board.name, &board.pin_files(), name, Path::new(path))?;
            }
            Ok(())
        }
    }
}
