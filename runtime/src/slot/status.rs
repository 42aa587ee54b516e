//! What `kiln slot` reports and does: the status of both slots as RAUC's `rauc status` sees them
//! (booted, primary, good/bad) and the marks, from and to `kiln/abstate.env`.
//!
//! A damaged file (U-Boot cannot import it: bad CRC or wrong size) is reported as such by
//! [`status`]; U-Boot then boots with its defaults. [`mark`] refuses to edit it unless asked to
//! `reset`: then it starts from [`State::initial`] (`A B`, 3 tries each, what RAUC's reference
//! `boot.scr` falls back to) and applies the mark on that. `reset` also stands in for a missing
//! file; it never discards a readable state.

use super::store::{self, Read};
use super::{Class, Slot, State};
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
        self.apply_to(st, Class::Boot, s)
    }

    /// The mark on a slot of class `c`. `mark-active` of a models slot gives it one try, as a
    /// freshly installed models slot gets (`docs/models-slots.md`, decision 4).
    pub fn apply_to(self, st: &mut State, c: Class, s: Slot) -> Result<()> {
        match (self, c) {
            (Mark::Good, _) => st.mark_good_of(c, s),
            (Mark::Bad, _) => st.mark_bad_of(c, s),
            (Mark::Active, Class::Boot) => st.mark_active_of(c, s),
            (Mark::Active, Class::Models) => st.mark_active_with(c, s, 1),
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
    /// The models slots' counters (`MODELS_ORDER 'A', A 3 left, B 0 left`) and the one init
    /// maps next; `null` for a damaged file.
    pub models: Option<String>,
    pub models_primary: Option<&'static str>,
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
        models: None,
        models_primary: None,
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
            out.models = Some(st.describe_of(Class::Models));
            // From the state already read (the file is not read again), as models_primary reads it.
            out.models_primary = Some(st.primary_of(Class::Models)?.unwrap_or(Slot::A).name());
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
            if let (Some(m), Some(p)) = (&self.models, self.models_primary) {
                let _ = writeln!(s, "models      {m}; init maps {p} next");
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
    mark_class(env, Class::Boot, m, slot, reset)
}

/// The models slot init maps (`docs/models-slots.md`, decision 4): the first in `MODELS_ORDER`
/// with tries left, read without writing. A missing or damaged file, or no models slot with
/// tries left, is the factory slot `A`, with why.
pub fn models_primary(env: &Path) -> (Slot, String) {
    match store::read(env) {
        Ok(Read::State(st)) => match (st.primary_of(Class::Models), st.order_of(Class::Models)) {
            (Ok(Some(s)), Ok(order)) => {
                let names: Vec<&str> = order.iter().map(|s| s.name()).collect();
                let left = st.left_of(Class::Models, s).unwrap_or(0);
                (
                    s,
                    format!(
                        "MODELS_ORDER \"{}\", slot {} has {left} tr{} left",
                        names.join(" "),
                        s.name(),
                        if left == 1 { "y" } else { "ies" }
                    ),
                )
            }
            (Ok(None), _) => (
                Slot::A,
                "no models slot has tries left: the factory slot A".into(),
            ),
            (Err(e), _) | (_, Err(e)) => (
                Slot::A,
                format!("the models counters are unreadable ({e:#}): the factory slot A"),
            ),
        },
        Ok(Read::Damaged(e)) => (Slot::A, format!("{e:#}: the factory slot A")),
        Err(e) => (Slot::A, format!("{e:#}: the factory slot A")),
    }
}

/// What init does before it maps a models slot (`docs/models-slots.md`, decision 4): the first
/// in `MODELS_ORDER` with tries left, its try counted down and written **before** it is mapped,
/// so a power cut or a hang while it is in use costs a try and never loops; the verdict's PASS
/// gives the tries back ([`super::judge`]). The factory slot `A`, nothing written, when the file
/// is missing or damaged or no models slot has tries left; `A` too when another slot's try
/// cannot be written (mapping it uncounted could loop).
pub fn models_take(env: &Path) -> (Slot, String) {
    let mut st = match store::read(env) {
        Ok(Read::State(st)) => st,
        Ok(Read::Damaged(e)) => return (Slot::A, format!("{e:#}: the factory slot A")),
        Err(e) => return (Slot::A, format!("{e:#}: the factory slot A")),
    };
    match st.take_try_of(Class::Models) {
        Ok(Some(s)) => match store::with_writable(env, || store::save(&st, env)) {
            Ok(()) => (
                s,
                format!("took its try: {}", st.describe_of(Class::Models)),
            ),
            Err(e) if s == Slot::A => (s, format!("its try could not be written ({e:#})")),
            Err(e) => (
                Slot::A,
                format!(
                    "slot {}'s try could not be written ({e:#}), so it is not mapped: the factory \
                     slot A",
                    s.name()
                ),
            ),
        },
        Ok(None) => (
            Slot::A,
            format!(
                "no models slot has tries left ({}): the factory slot A, nothing written",
                st.describe_of(Class::Models)
            ),
        ),
        Err(e) => (
            Slot::A,
            format!("the models counters are unreadable ({e:#}): the factory slot A"),
        ),
    }
}

/// [`mark`] for a slot of class `c` (`kiln slot --class models mark-*`).
pub fn mark_class(
    env: &Path,
    c: Class,
    m: Mark,
    slot: Slot,
    reset: bool,
) -> Result<(Option<State>, State)> {
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
    m.apply_to(&mut after, c, slot)
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
        assert!(
            h.contains("models      MODELS_ORDER 'A', A 3 left, B 0 left; init maps A next"),
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

    /// The models slot init maps: the factory slot while nothing else is first, the installed
    /// one once `mark-active` put it first, the factory one again once that is marked bad; and
    /// `A` with why for a missing or damaged file.
    #[test]
    fn the_models_primary_follows_the_marks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        let (s, why) = models_primary(&p);
        assert_eq!(s, Slot::A);
        assert!(why.contains("factory slot A"), "{why}");
        store::save(&State::initial(), &p).unwrap();
        let (s, why) = models_primary(&p);
        assert_eq!(
            (s, why.as_str()),
            (Slot::A, "MODELS_ORDER \"A\", slot A has 3 tries left")
        );
        let (_, after) = mark_class(&p, Class::Models, Mark::Active, Slot::B, false).unwrap();
        assert_eq!(after.left_of(Class::Models, Slot::B).unwrap(), 1);
        // The systems' counters are untouched by a models mark.
        assert_eq!(after.order().unwrap(), vec![Slot::A, Slot::B]);
        let (s, why) = models_primary(&p);
        assert_eq!(
            (s, why.as_str()),
            (Slot::B, "MODELS_ORDER \"B A\", slot B has 1 try left")
        );
        mark_class(&p, Class::Models, Mark::Bad, Slot::B, false).unwrap();
        assert_eq!(models_primary(&p).0, Slot::A);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[7] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let (s, why) = models_primary(&p);
        assert_eq!(s, Slot::A);
        assert!(
            why.contains("damaged") && why.contains("factory slot A"),
            "{why}"
        );
    }

    /// init's take: the try is written before the slot is mapped; with none left, the factory
    /// slot and nothing written.
    #[test]
    fn the_models_take_counts_down_before_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        assert_eq!(models_take(&p).0, Slot::A);
        assert!(!p.exists(), "a missing file is not created by a take");
        store::save(&State::initial(), &p).unwrap();
        let (s, why) = models_take(&p);
        assert_eq!(
            (s, why.as_str()),
            (
                Slot::A,
                "took its try: MODELS_ORDER 'A', A 2 left, B 0 left"
            )
        );
        mark_class(&p, Class::Models, Mark::Active, Slot::B, false).unwrap();
        let (s, why) = models_take(&p);
        assert_eq!(
            (s, why.as_str()),
            (
                Slot::B,
                "took its try: MODELS_ORDER 'B A', A 2 left, B 0 left"
            )
        );
        // B's one try is spent (its boot never passed): A again, then A's last tries, then the
        // factory slot with nothing written.
        assert_eq!(models_take(&p).0, Slot::A);
        assert_eq!(models_take(&p).0, Slot::A);
        let bytes = std::fs::read(&p).unwrap();
        let (s, why) = models_take(&p);
        assert_eq!(s, Slot::A);
        assert!(why.contains("nothing written"), "{why}");
        assert_eq!(std::fs::read(&p).unwrap(), bytes);
    }

    /// A try that cannot be written (here: `<env>.new` is a folder, so the atomic write fails
    /// even for root): a models slot other than the factory one is not mapped uncounted.
    #[test]
    fn a_take_that_cannot_be_written_maps_the_factory_slot() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        store::save(&State::initial(), &p).unwrap();
        mark_class(&p, Class::Models, Mark::Active, Slot::B, false).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        std::fs::create_dir(store::new_path(&p)).unwrap();
        let (s, why) = models_take(&p);
        assert_eq!(s, Slot::A, "{why}");
        assert!(
            why.starts_with("slot B's try could not be written (creating ")
                && why.ends_with("so it is not mapped: the factory slot A"),
            "{why}"
        );
        assert_eq!(std::fs::read(&p).unwrap(), bytes, "nothing written");
        // A first: mapped all the same (the factory slot is what a failure falls back to).
        std::fs::remove_dir(store::new_path(&p)).unwrap();
        mark_class(&p, Class::Models, Mark::Active, Slot::A, false).unwrap();
        std::fs::create_dir(store::new_path(&p)).unwrap();
        let (s, why) = models_take(&p);
        assert_eq!(s, Slot::A);
        assert!(why.starts_with("its try could not be written"), "{why}");
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
