//! `kiln slot`: the A/B slots' counters in `kiln/abstate.env` (RAUC's U-Boot contract):
//! `status`, and `mark-good|mark-bad|mark-active [SLOT]` as `rauc status mark-*` would edit them,
//! for the boot slots or (`--class models`) the models slots; `models-primary`, the models slot
//! init maps. The logic is `kiln_runtime::slot`.

use anyhow::{bail, Context};
use kiln_runtime::slot::status::{self, Mark};
use kiln_runtime::slot::{Class, Slot, ENV_PATH};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
    /// The counters file (U-Boot binary environment, 0x4000 bytes).
    #[arg(long, global = true, default_value = ENV_PATH)]
    env: PathBuf,
    /// Where the booted slot (`rauc.slot=`) is read from.
    #[arg(long, global = true, default_value = "/proc/cmdline")]
    cmdline: PathBuf,
    /// Which pair the marks edit: `boot` (BOOT_ORDER, BOOT_x_LEFT, read by U-Boot) or `models`
    /// (MODELS_ORDER, MODELS_x_LEFT, read by init; `mark-active` gives the slot one try, and
    /// the slot must be named A or B).
    #[arg(long, global = true, value_enum, default_value_t = ClassArg::Boot)]
    class: ClassArg,
}

/// `--class`: the slot pair a mark edits.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ClassArg {
    Boot,
    Models,
}

impl From<ClassArg> for Class {
    fn from(c: ClassArg) -> Class {
        match c {
            ClassArg::Boot => Class::Boot,
            ClassArg::Models => Class::Models,
        }
    }
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// The booted slot (`rauc.slot=`), BOOT_ORDER, the primary (the first listed slot with tries
    /// left), each slot's tries left and good/bad, and "no good slot"; a damaged file (bad CRC:
    /// U-Boot uses its defaults) and a stray `abstate.env.new` are reported as such. With `--class
    /// models` the models slots' pair, likewise.
    Status {
        /// One JSON object instead of the human form.
        #[arg(long)]
        json: bool,
    },
    /// Tries left = 3 (RAUC's boot-attempts); BOOT_ORDER unchanged.
    MarkGood(MarkArgs),
    /// Out of BOOT_ORDER, tries left = 0.
    MarkBad(MarkArgs),
    /// First in BOOT_ORDER, tries left = 3 (RAUC's boot-attempts-primary).
    MarkActive(MarkArgs),
    /// The models slot init maps (A or B) on stdout, and why on stderr: the first in
    /// MODELS_ORDER with tries left; the factory slot A when the file is missing or damaged.
    ModelsPrimary,
    /// What init runs before it maps a models slot: the slot (A or B) on stdout, its try
    /// counted down and written first; why on stderr. The factory slot A, nothing written, when
    /// the file is missing or damaged or no models slot has tries left.
    ModelsTake,
}

#[derive(clap::Args)]
struct MarkArgs {
    /// A, B, `booted` or `other` (as rauc names them); default: the booted slot.
    slot: Option<String>,
    /// If the file is damaged or missing, start from the initial state (BOOT_ORDER "A B", 3
    /// tries each, U-Boot's defaults) instead of refusing. A readable state is always kept.
    #[arg(long)]
    reset: bool,
}

/// The slot a mark names: A/B, or `booted`/`other` (or nothing) from the command line's.
fn resolve(arg: Option<&str>, cmdline: &Path) -> anyhow::Result<Slot> {
    match arg {
        Some(s @ ("A" | "B")) => Slot::parse(s),
        None | Some("booted" | "other") => {
            let booted = status::booted(cmdline)?.with_context(|| {
                format!(
                    "no slot given and no booted slot known: {} has no rauc.slot= (not booted \
                     through boot.scr); name the slot, e.g. `kiln slot mark-good A`",
                    cmdline.display()
                )
            })?;
            Ok(if arg == Some("other") {
                booted.other()
            } else {
                booted
            })
        }
        Some(s) => bail!("slot {s:?}: A, B, booted or other expected"),
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let (m, ma) = match a.cmd {
        Cmd::Status { json } => {
            // The booted slot is informative here: an unreadable command line is "unknown".
            let booted = status::booted(&a.cmdline).unwrap_or(None);
            let st = status::status(&a.env, booted)?;
            let out = if json {
                let mut s = serde_json::to_string(&st)?;
                s.push('\n');
                s
            } else {
                st.human()
            };
            return super::print_all(&out);
        }
        Cmd::MarkGood(ma) => (Mark::Good, ma),
        Cmd::MarkBad(ma) => (Mark::Bad, ma),
        Cmd::MarkActive(ma) => (Mark::Active, ma),
        Cmd::ModelsPrimary | Cmd::ModelsTake => {
            let (s, why) = if matches!(a.cmd, Cmd::ModelsTake) {
                status::models_take(&a.env)
            } else {
                status::models_primary(&a.env)
            };
            eprintln!("kiln slot: models slot {} ({why})", s.name());
            return super::print_all(&format!("{}\n", s.name()));
        }
    };
    let class = Class::from(a.class);
    let slot = match (class, ma.slot.as_deref()) {
        (Class::Boot, s) => resolve(s, &a.cmdline)?,
        (Class::Models, Some(s @ ("A" | "B"))) => Slot::parse(s)?,
        (Class::Models, s) => bail!(
            "models slot {}: name it A or B (the booted slot names a boot slot)",
            s.unwrap_or("(none)")
        ),
    };
    let (before, after) = status::mark_class(&a.env, class, m, slot, ma.reset)?;
    let from = match &before {
        Some(st) if class == Class::Boot => st.describe(),
        Some(st) => st.describe_of(class),
        None => "a damaged or missing file, reset to the initial state".into(),
    };
    super::print_all(&format!(
        "kiln slot: {}{} slot {}: {} (was {from})\n",
        m.name(),
        if class == Class::Models {
            " models"
        } else {
            ""
        },
        slot.name(),
        if class == Class::Boot {
            after.describe()
        } else {
            after.describe_of(class)
        }
    ))
}
