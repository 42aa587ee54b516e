//! `kiln selftest`'s arguments and driver, kept here so `main.rs` only names the subcommand.

use super::{board::Board, run_all, Ctx, Inject, Paths};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The board file (/etc/kiln/board.toml). Without it the board-only checks skip.
    #[arg(long)]
    pub board: Option<PathBuf>,
    /// Where to write report.json and report.txt (atomically).
    #[arg(long)]
    pub report_dir: Option<PathBuf>,
    /// Root that /proc, /sys, /dev, /boot, /models and /data/models are looked up under.
    #[arg(long, default_value = "/")]
    pub root: PathBuf,
    /// Folders searched for GGUF models, instead of ROOT/models and ROOT/data/models.
    #[arg(long)]
    pub models: Vec<PathBuf>,
    /// What the console gets: `json` (one line between KILN-REPORT-BEGIN/END, for a harness that
    /// reads the serial port) or `text` (the table of report.txt, for a person); the verdict line
    /// ends both.
    #[arg(long, value_enum, default_value_t = Console::Json)]
    pub console: Console,
    /// The A/B counters (`/bootctl/kiln/abstate.env`): the verdict marks the booted slot
    /// (`rauc.slot=` of ROOT/proc/cmdline) good or bad there, and the report records it.
    #[arg(long)]
    pub slot_env: Option<PathBuf>,
    /// With --slot-env: a file that gets `reboot A|B` when the verdict is FAIL and the other slot
    /// is still good (init reboots), `models A|B` when the FAIL is blamed on the models slot
    /// (init reboots into the same system to map the other one), else `stay`.
    #[arg(long, requires = "slot_env")]
    pub slot_action: Option<PathBuf>,
    /// With --slot-env: the models slot init mapped (A or B, `kiln slot models-take`); a PASS
    /// marks it good too.
    #[arg(long, requires = "slot_env", value_parser = ["A", "B"])]
    pub models_slot: Option<String>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Console {
    Json,
    Text,
}

/// Run the checks, print the report, write it; the process exit code: 0 only if no check
/// failed, 1 if one did, 2 if the report could not be written.
pub fn run(a: Args) -> anyhow::Result<i32> {
    let mut paths = Paths::under(&a.root);
    if !a.models.is_empty() {
        paths.models = a.models;
    }
    let board = a.board.as_deref().map(Board::load).transpose()?;
    let ctx = Ctx {
        paths,
        board,
        inject: Inject::from_env()?,
    };
    let mut report = run_all(&ctx);
    if let Some(env) = &a.slot_env {
        let cmdline = std::fs::read_to_string(a.root.join("proc/cmdline")).unwrap_or_default();
        let pass = report.verdict == crate::selftest::report::Verdict::Pass;
        let models = a
            .models_slot
            .as_deref()
            .map(crate::slot::Slot::parse)
            .transpose()?;
        let models_failed = report
            .checks
            .iter()
            .any(|c| c.id.starts_with("model.") && c.status == crate::selftest::Status::Fail);
        let mut d = crate::slot::judge(env, &cmdline, pass, models, models_failed);
        if models.is_some() {
            if let Ok((m, json)) = super::known::mapped(&ctx.paths) {
                (d.models_slot, d.models_json) = (Some(m.name().into()), json);
            }
        }
        if let Some(f) = &a.slot_action {
            let what = match (&d.reboot_into, &d.remap_models) {
                (Some(s), _) => format!("reboot {s}\n"),
                (None, Some(m)) => format!("models {m}\n"),
                (None, None) => "stay\n".into(),
            };
            if let Err(e) = std::fs::write(f, what) {
                eprintln!("kiln selftest: cannot write {}: {e}", f.display());
            }
        }
        report.slot = Some(d);
    }
    let written = a.report_dir.as_deref().map(|dir| {
        report.write_to(dir)?;
        // The same system boots again at once on the other models slot and its report replaces
        // this one: the FAIL that blamed the models slot is kept beside it, for the fleet client
        // to report (a later FAIL of the same slot replaces it).
        if let Some(m) = report
            .slot
            .as_ref()
            .filter(|d| d.remap_models.is_some())
            .and_then(|d| d.models_slot.as_deref())
            .and_then(|m| crate::slot::Slot::parse(m).ok())
        {
            crate::selftest::report::write_atomic(
                dir,
                &crate::selftest::report::models_report_name(m),
                report.to_json_pretty().as_bytes(),
            )?;
        }
        anyhow::Ok(())
    });
    match a.console {
        Console::Json => print!("{}", report.console()),
        Console::Text => print!("{}", report.to_text()),
    }
    if let Some(Err(e)) = written {
        // The console verdict stands; a missing report file is its own failure.
        eprintln!("kiln selftest: could not write the report: {e:#}");
        return Ok(2);
    }
    Ok(if report.failed == 0 { 0 } else { 1 })
}
