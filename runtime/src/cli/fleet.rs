//! `kiln fleet`: the board's hawkBit (DDI) client; `/init` starts it after the verdict when the
//! image has `/etc/kiln/fleet.toml`. The logic is `kiln_runtime::fleet`.

use anyhow::Context;
use kiln_runtime::fleet::{self, board::SystemBoard, config::Config, ddi::Ddi};
use kiln_runtime::slot::Slot;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The recipe's `[fleet]` table, as the image holds it.
    #[arg(long, default_value = fleet::config::CONFIG_PATH)]
    config: PathBuf,
    /// Another server than the recipe's (a lab's DDI server; also `kiln.fleet.server=` on the
    /// kernel command line, which /init passes here).
    #[arg(long)]
    server: Option<String>,
    /// An upper bound on the server's poll sleep, in seconds (labs and tests).
    #[arg(long)]
    poll_max: Option<u64>,
    /// The running slot's boot partition (slot A's).
    #[arg(long)]
    boot_a: PathBuf,
    /// Slot B's boot partition.
    #[arg(long)]
    boot_b: PathBuf,
    /// Models slot A's partition (its `kiln-models.json` is read in place after a models
    /// install).
    #[arg(long, default_value = "/dev/disk/by-partlabel/models_a")]
    models_a: PathBuf,
    /// Models slot B's partition.
    #[arg(long, default_value = "/dev/disk/by-partlabel/models_b")]
    models_b: PathBuf,
    /// Where the booted slot (`rauc.slot=`) is read from.
    #[arg(long, default_value = "/proc/cmdline")]
    cmdline: PathBuf,
    /// The running slot's self-check report folder.
    #[arg(long, default_value = "/boot/kiln")]
    report_dir: PathBuf,
    /// Poll once (and do what it asks), then exit.
    #[arg(long)]
    once: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut cfg = Config::load(&a.config)?;
    if let Some(s) = a.server {
        cfg.server = s;
    }
    if a.poll_max.is_some() {
        cfg.poll_max_s = a.poll_max;
    }
    cfg.check()
        .context("the fleet configuration with the command line's overrides")?;
    let cmdline = std::fs::read_to_string(&a.cmdline)
        .with_context(|| format!("reading {}", a.cmdline.display()))?;
    let running = Slot::from_cmdline(&cmdline).context(
        "no rauc.slot=A|B on the kernel command line: not booted through boot.scr, no A/B updates",
    )?;
    let controller = cfg.controller(std::path::Path::new("/"))?;
    let token = cfg.token()?;
    let ddi = Ddi::new(&cfg, &controller, &token)?;
    fleet::log(&format!(
        "controller {controller} on {} (slot {} runs)",
        ddi.base,
        running.name()
    ));
    let board = SystemBoard {
        running,
        boot_a: a.boot_a,
        boot_b: a.boot_b,
        models_a: a.models_a,
        models_b: a.models_b,
        report_dir: a.report_dir,
    };
    let mut c = fleet::Client::new(cfg, ddi, board)?;
    c.inject = fleet::Inject::from_env()?;
    if c.inject != fleet::Inject::default() {
        fleet::log(&format!(
            "test faults injected ({}): {:?}",
            fleet::Inject::ENV,
            c.inject
        ));
    }
    if a.once {
        c.step()?;
        return Ok(());
    }
    c.run()
}
