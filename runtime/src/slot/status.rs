//! What `kiln slot` reports and does: the status of both slots as RAUC's `rauc status` sees them
//! (booted, primary, good/bad) and the marks, from and to `kiln/abstate.env`.
//!
//! A damaged file (U-Boot cannot import it: bad CRC or wrong size) is reported as such by
//! [`status`]; U-Boot then boots with its defaults. [`mark`] refuses to edit it unless asked to
//! `reset`: then it starts from [`State::initial`] (`A B`, 3 tries each, what RAUC's reference
//! `boot.scr` falls back to) and applies the mark on that. `reset` also stands in for a missing
//! file; it never discards a readable state.

use super::store::{self, Read};
use super::{Slot, State};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// One of RAUC's marks (`rauc status mark-good|mark-bad|mark-active`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    Good,
    Bad,
    Active,
}

impl Mark {
    pub fn apply(self, st: &mut State, s: Slot) -> Result<()> {
        match self {
            Mark::Good => st.mark_good(s),
            Mark::Bad => st.mark_bad(s),
            Mark::Active => st.mark_active(s),
        }
    }

    /// RAUC's name for it (`mark-good`, …), which `kiln slot` uses too.
    pub fn name(self) -> &'static str {
        match self {
            Mark::Good => "mark-good",
            Mark::Bad => "mark-bad",
            Mark::Active => "mark-active",
        }
    }
}

/// The booted slot from a kernel command line file (`rauc.slot=`): `None` if it names none.
pub fn booted(cmdline: &Path) -> Result<Option<Slot>> {
    let text = std::fs::read_to_string(cmdline)
        .with_context(|| format!("reading the kernel command line {}", cmdline.display()))?;
    Ok(Slot::from_cmdline(&text))
}

/// One slot's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotStatus {
    /// `BOOT_x_LEFT` as U-Boot reads it (hex).
    pub left: u32,
    /// Listed in `BOOT_ORDER`.
    pub in_order: bool,
    /// RAUC's good: listed and with tries left.
    pub good: bool,
}

/// `kiln slot status` (`--json` prints this).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    /// The file read.
    pub env: String,
    /// The booted slot (`rauc.slot=`), `null` if unknown.
    pub booted: Option<&'static str>,
    /// Why the file cannot be imported by U-Boot (which then uses its defaults); `null` if it
    /// can. When set, `boot_order`, `primary` and `slots` are `null`.
    pub damaged: Option<String>,
    pub boot_order: Option<Vec<&'static str>>,
    /// The slot U-Boot tries next (RAUC's `boot_primary`).
    pub primary: Option<&'static str>,
    pub slots: Option<std::collections::BTreeMap<&'static str, SlotStatus>>,
    /// Neither slot is good (a readable file only).
    pub no_good_slot: bool,
    /// A `<env>.new` is there: a write cut short before its rename (the next mark replaces it).
    pub stray_new: bool,
}

/// Read `env` into a [`Status`]; `booted` as found by the caller.
pub fn status(env: &Path, booted: Option<Slot>) -> Result<Status> {
    let mut out = Status {
        env: env.display().to_string(),
        booted: booted.map(Slot::name),
        damaged: None,
        boot_order: None,
        primary: None,
        slots: None,
        no_good_slot: false,
        stray_new: store::new_path(env).exists(),
    };
    match store::read(env)? {
        Read::Damaged(e) => out.damaged = Some(format!("{e:#}")),
        Read::State(st) => {
            let order = st.order()?;
            let mut slots = std::collections::BTreeMap::new();
            for s in Slot::ALL {
                slots.insert(
                    s.name(),
                    SlotStatus {
                        left: st.left(s)?,
                        in_order: order.contains(&s),
                        good: st.is_good(s)?,
                    },
                );
            }
            out.no_good_slot = !slots.values().any(|s| s.good);
            out.primary = st.primary()?.map(Slot::name);
            out.boot_order = Some(order.into_iter().map(Slot::name).collect());
            out.slots = Some(slots);
        }
    }
    Ok(out)
}

impl Status {
    /// The human form: one `key  value` line each, in a fixed order.
    pub fn human(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "env         {}", self.env);
        let _ = writeln!(
            s,
            "booted      {}",
            self.booted
                .unwrap_or("unknown (no rauc.slot= found on the kernel command line)")
        );
        if let Some(d) = &self.damaged {
            let _ = writeln!(s, "DAMAGED     {d}");
            let _ = writeln!(
                s,
                "            U-Boot boots with its defaults until the file is rewritten; \
                 `kiln slot mark-* --reset` starts again from BOOT_ORDER \"A B\", 3 tries each"
            );
        }
        if let (Some(order), Some(slots)) = (&self.boot_order, &self.slots) {
            let _ = writeln!(s, "BOOT_ORDER  {}", order.join(" "));
            let _ = writeln!(s, "primary     {}", self.primary.unwrap_or("none"));
            for (name, st) in slots {
                let _ = writeln!(
                    s,
                    "slot {name}      {}, {} tr{} left{}",
                    if st.good { "good" } else { "bad" },
                    st.left,
                    if st.left == 1 { "y" } else { "ies" },
                    if st.in_order {
                        ""
                    } else {
                        ", not in BOOT_ORDER"
                    }
                );
            }
            if self.no_good_slot {
                let _ = writeln!(s, "no good slot");
            }
        }
        if self.stray_new {
            let _ = writeln!(
                s,
                "stray       {}.new: a write cut short before its rename; the next mark replaces it",
                self.env
            );
        }
        s
    }
}

/// Apply `m` to `slot` in `env` and write it back with [`store::save`]. Returns the state before
/// (`None` if `reset` stood in for it) and after. A damaged or missing file is refused unless
/// `reset` (see the module's documentation).
pub fn mark(env: &Path, m: Mark, slot: Slot, reset: bool) -> Result<(Option<State>, State)> {
    let before = match store::read(env) {
        Ok(Read::State(st)) => Some(st),
        Ok(Read::Damaged(_)) if reset => None,
        Ok(Read::Damaged(e)) => bail!(
            "{e:#}. U-Boot boots with its defaults until the file is rewritten; not applying \
             {} to slot {}: run it again with --reset to start from the initial state \
             (BOOT_ORDER \"A B\", 3 tries each) and apply it on that",
            m.name(),
            slot.name()
        ),
        Err(e) if !env.exists() => {
            if reset {
                None
            } else {
                return Err(e.context(format!(
                    "not applying {} to slot {}: {} does not exist (is bootctl mounted? \
                     --reset writes a new one)",
                    m.name(),
                    slot.name(),
                    env.display()
                )));
            }
        }
        Err(e) => return Err(e),
    };
    let mut after = before.clone().unwrap_or_else(State::initial);
    m.apply(&mut after, slot)
        .with_context(|| format!("{}: {} slot {}", env.display(), m.name(), slot.name()))?;
    store::with_writable(env, || store::save(&after, env))?;
    Ok((before, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_of_a_fresh_and_a_marked_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        store::save(&State::initial(), &p).unwrap();
        let st = status(&p, Some(Slot::A)).unwrap();
        assert_eq!(st.boot_order, Some(vec!["A", "B"]));
        assert_eq!(
            (st.primary, st.no_good_slot, st.stray_new),
            (Some("A"), false, false)
        );
        mark(&p, Mark::Bad, Slot::A, false).unwrap();
        mark(&p, Mark::Bad, Slot::B, false).unwrap();
        let st = status(&p, None).unwrap();
        assert!(st.no_good_slot && st.primary.is_none(), "{st:?}");
        let h = st.human();
        assert!(
            h.contains("no good slot") && h.contains("booted      unknown (no rauc.slot="),
            "{h}"
        );
        assert!(
            h.contains("slot B      bad, 0 tries left, not in BOOT_ORDER"),
            "{h}"
        );
    }

    #[test]
    fn a_damaged_file_is_reported_and_only_reset_edits_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        let mut bytes = State::initial().encode().unwrap();
        bytes[7] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let st = status(&p, Some(Slot::B)).unwrap();
        assert!(st.damaged.as_deref().unwrap().contains("damaged"), "{st:?}");
        assert!(st.slots.is_none() && !st.no_good_slot);
        let err = format!("{:#}", mark(&p, Mark::Good, Slot::B, false).unwrap_err());
        assert!(
            err.contains("abstate.env") && err.contains("--reset"),
            "{err}"
        );
        assert_eq!(
            std::fs::read(&p).unwrap(),
            bytes,
            "a refused mark writes nothing"
        );
        let (before, after) = mark(&p, Mark::Bad, Slot::B, true).unwrap();
        assert!(before.is_none());
        assert_eq!(after.order().unwrap(), vec![Slot::A]);
        // --reset keeps a readable state.
        let (before, _) = mark(&p, Mark::Good, Slot::A, true).unwrap();
        assert_eq!(before, Some(after));
    }

    #[test]
    fn a_missing_file_needs_reset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        let err = format!("{:#}", mark(&p, Mark::Good, Slot::A, false).unwrap_err());
        assert!(
            err.contains("does not exist") && err.contains("--reset"),
            "{err}"
        );
        mark(&p, Mark::Good, Slot::A, true).unwrap();
        assert!(status(&p, None).unwrap().damaged.is_none());
    }
}
