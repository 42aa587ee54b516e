//! The A/B boot slots and their counters, RAUC's U-Boot contract: `BOOT_ORDER` (a space list of
//! slot names, first = tried first) and `BOOT_A_LEFT` / `BOOT_B_LEFT` (tries left, hex) in
//! `kiln/abstate.env` on the `bootctl` partition ([`env`]: U-Boot's binary environment).
//! `boot.scr` picks the first slot in `BOOT_ORDER` with tries left and decrements it before it
//! boots; the self-check's verdict then marks the booted slot good or bad, as `rauc status
//! mark-good|mark-bad` would:
//! - good: `BOOT_x_LEFT` = 3 (RAUC's `boot-attempts`); the order is not changed;
//! - bad: `x` leaves `BOOT_ORDER`, `BOOT_x_LEFT` = 0;
//! - active: `x` first in `BOOT_ORDER` (the others keep their order), `BOOT_x_LEFT` = 3
//!   (`boot-attempts-primary`).
//!
//! The booted slot is the kernel's `rauc.slot=A|B`, which `boot.scr` passes.
//!
//! Debian 12's rauc 1.8 writes `BOOT_x_LEFT` as hex on mark-good but as decimal on mark-active
//! (its `set_primary` used `%d`, fixed in 1.10): `18` for 18 attempts, which U-Boot's
//! `test 0x${BOOT_x_LEFT}` reads as 0x18. [`State::left`] reads every value as U-Boot does (a
//! decimal string is a valid hex string, so it never fails on what rauc writes); with kiln's
//! 3 attempts the two spellings are the same. `runtime/tests/slot_rauc.rs` shows both.
//!
//! [`store`] reads and writes the file (atomically as far as FAT allows); [`status`] is what
//! `kiln slot` reports and does.

pub mod env;
pub mod status;
pub mod store;

use anyhow::{bail, Context, Result};
use env::Env;

/// RAUC's `boot-attempts` and `boot-attempts-primary` defaults, which kiln's system.conf keeps.
pub const ATTEMPTS: u32 = 3;

/// Where the running system finds the counters: init mounts `bootctl` on `/bootctl` (read-only
/// but while something writes it: see `cli/slot.rs` and init).
pub const ENV_PATH: &str = "/bootctl/kiln/abstate.env";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    A,
    B,
}

impl Slot {
    pub const ALL: [Slot; 2] = [Slot::A, Slot::B];

    pub fn name(self) -> &'static str {
        match self {
            Slot::A => "A",
            Slot::B => "B",
        }
    }

    pub fn parse(s: &str) -> Result<Slot> {
        match s {
            "A" => Ok(Slot::A),
            "B" => Ok(Slot::B),
            _ => bail!("slot {s:?}: A or B expected"),
        }
    }

    pub fn other(self) -> Slot {
        match self {
            Slot::A => Slot::B,
            Slot::B => Slot::A,
        }
    }

    /// The slot the running kernel was booted from: `rauc.slot=` on its command line.
    pub fn from_cmdline(cmdline: &str) -> Option<Slot> {
        cmdline
            .split_whitespace()
            .find_map(|w| w.strip_prefix("rauc.slot="))
            .and_then(|s| Slot::parse(s).ok())
    }
}

/// The two slot pairs whose counters `abstate.env` holds: the systems (`BOOT_ORDER`,
/// `BOOT_x_LEFT`, which U-Boot's `boot.scr` reads) and the models (`MODELS_ORDER`,
/// `MODELS_x_LEFT`, issue 38's `models_a`/`models_b`: U-Boot ignores them, init reads them).
/// Both follow the same contract (RAUC's U-Boot one, above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Boot,
    Models,
}

impl Class {
    pub const ALL: [Class; 2] = [Class::Boot, Class::Models];

    pub fn order_var(self) -> &'static str {
        match self {
            Class::Boot => "BOOT_ORDER",
            Class::Models => "MODELS_ORDER",
        }
    }

    pub fn left_var(self, s: Slot) -> String {
        match self {
            Class::Boot => format!("BOOT_{}_LEFT", s.name()),
            Class::Models => format!("MODELS_{}_LEFT", s.name()),
        }
    }

    /// What an absent variable means. For the systems: nothing (no order, no tries, as U-Boot
    /// reads it). For the models, the state of a card whose environment predates them: the
    /// factory slot `A`, good, and `B` empty — so an older image's file reads as what it is.
    fn absent_order(self) -> &'static str {
        match self {
            Class::Boot => "",
            Class::Models => "A",
        }
    }

    fn absent_left(self, s: Slot) -> u32 {
        match (self, s) {
            (Class::Models, Slot::A) => ATTEMPTS,
            _ => 0,
        }
    }
}

/// The counters of both slot pairs, with whatever else the environment holds (kept as it is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    env: Env,
}

impl State {
    /// A new image: both slots hold the same system, `A B`, three tries each (the models'
    /// variables are absent: the factory slot `A`, see [`Class`]).
    pub fn initial() -> State {
        let mut env = Env::default();
        env.set("BOOT_ORDER", "A B");
        for s in Slot::ALL {
            env.set(&Class::Boot.left_var(s), format!("{ATTEMPTS:x}"));
        }
        State { env }
    }

    pub fn decode(bytes: &[u8], what: &str) -> Result<State> {
        let env = Env::decode(bytes, what)?;
        let st = State { env };
        for c in Class::ALL {
            st.order_of(c)
                .with_context(|| format!("{what}: {}", c.order_var()))?;
            for s in Slot::ALL {
                st.left_of(c, s)
                    .with_context(|| format!("{what}: {}", c.left_var(s)))?;
            }
        }
        Ok(st)
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        self.env.encode()
    }

    /// `BOOT_ORDER` as slots (an absent variable is an empty order).
    pub fn order(&self) -> Result<Vec<Slot>> {
        self.order_of(Class::Boot)
    }

    /// A class's order as slots (absent: see [`Class`]).
    pub fn order_of(&self, c: Class) -> Result<Vec<Slot>> {
        self.env
            .get(c.order_var())
            .unwrap_or(c.absent_order())
            .split_whitespace()
            .map(Slot::parse)
            .collect()
    }

    /// `BOOT_x_LEFT`, read as U-Boot's `test 0x${BOOT_x_LEFT}` reads it (hex); absent is 0.
    pub fn left(&self, s: Slot) -> Result<u32> {
        self.left_of(Class::Boot, s)
    }

    /// A class's tries left for `s`, hex as U-Boot reads it (absent: see [`Class`]).
    pub fn left_of(&self, c: Class, s: Slot) -> Result<u32> {
        let var = c.left_var(s);
        match self.env.get(&var) {
            None => Ok(c.absent_left(s)),
            Some(v) => u32::from_str_radix(v.trim_start_matches("0x"), 16)
                .with_context(|| format!("{var}={v:?} is not a hex count")),
        }
    }

    /// The slot U-Boot boots next, RAUC's `boot_primary`: the first in `BOOT_ORDER` with tries
    /// left; `None` if there is none (`boot.scr` then falls back to its defaults).
    pub fn primary(&self) -> Result<Option<Slot>> {
        self.primary_of(Class::Boot)
    }

    pub fn primary_of(&self, c: Class) -> Result<Option<Slot>> {
        for s in self.order_of(c)? {
            if self.left_of(c, s)? > 0 {
                return Ok(Some(s));
            }
        }
        Ok(None)
    }

    /// What `boot.scr` does for the systems, for a class whose chooser is init (the models):
    /// the primary slot, its try counted down **before** it is used, so that a power cut while
    /// it is in use costs a try and never loops. `None`: no slot has tries left (nothing
    /// written).
    pub fn take_try_of(&mut self, c: Class) -> Result<Option<Slot>> {
        let Some(s) = self.primary_of(c)? else {
            return Ok(None);
        };
        let left = self.left_of(c, s)?;
        self.set_left_of(c, s, left - 1);
        // Written explicitly: an absent order reads as the factory's, which must not change
        // meaning once the counters are in the file.
        let order = self.order_of(c)?;
        self.set_order_of(c, &order);
        Ok(Some(s))
    }

    /// Good in RAUC's sense: in `BOOT_ORDER` with tries left.
    pub fn is_good(&self, s: Slot) -> Result<bool> {
        self.is_good_of(Class::Boot, s)
    }

    pub fn is_good_of(&self, c: Class, s: Slot) -> Result<bool> {
        Ok(self.order_of(c)?.contains(&s) && self.left_of(c, s)? > 0)
    }

    fn set_order_of(&mut self, c: Class, order: &[Slot]) {
        let names: Vec<&str> = order.iter().map(|s| s.name()).collect();
        self.env.set(c.order_var(), names.join(" "));
    }

    fn set_left_of(&mut self, c: Class, s: Slot, n: u32) {
        self.env.set(&c.left_var(s), format!("{n:x}"));
    }

    pub fn mark_good(&mut self, s: Slot) -> Result<()> {
        self.mark_good_of(Class::Boot, s)
    }

    pub fn mark_good_of(&mut self, c: Class, s: Slot) -> Result<()> {
        let order = self.order_of(c)?;
        if c == Class::Models {
            // As take_try_of: once a models counter is written, so is the order.
            self.set_order_of(c, &order);
        }
        self.set_left_of(c, s, ATTEMPTS);
        Ok(())
    }

    pub fn mark_bad(&mut self, s: Slot) -> Result<()> {
        self.mark_bad_of(Class::Boot, s)
    }

    pub fn mark_bad_of(&mut self, c: Class, s: Slot) -> Result<()> {
        let order: Vec<Slot> = self.order_of(c)?.into_iter().filter(|&x| x != s).collect();
        self.set_order_of(c, &order);
        self.set_left_of(c, s, 0);
        Ok(())
    }

    pub fn mark_active(&mut self, s: Slot) -> Result<()> {
        self.mark_active_of(Class::Boot, s)
    }

    pub fn mark_active_of(&mut self, c: Class, s: Slot) -> Result<()> {
        self.mark_active_with(c, s, ATTEMPTS)
    }

    /// `s` first in the class's order with `tries` left (a freshly installed models slot gets
    /// one: decision 4 of `docs/models-slots.md`).
    pub fn mark_active_with(&mut self, c: Class, s: Slot, tries: u32) -> Result<()> {
        let mut order = vec![s];
        order.extend(self.order_of(c)?.into_iter().filter(|&x| x != s));
        self.set_order_of(c, &order);
        self.set_left_of(c, s, tries);
        Ok(())
    }

    pub fn env(&self) -> &Env {
        &self.env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The models' pair: an environment without its variables reads as the factory slot `A`;
    /// a try is taken before the slot is used and written with its order; the boot pair is
    /// untouched by anything done to the models'.
    #[test]
    fn the_models_pair_follows_the_same_contract() {
        let mut st = State::initial();
        let boot = st.describe();
        assert_eq!(st.order_of(Class::Models).unwrap(), vec![Slot::A]);
        assert_eq!(st.left_of(Class::Models, Slot::A).unwrap(), ATTEMPTS);
        assert_eq!(st.left_of(Class::Models, Slot::B).unwrap(), 0);
        assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::A));
        assert_eq!(st.env().get("MODELS_ORDER"), Some("A"));
        assert_eq!(st.env().get("MODELS_A_LEFT"), Some("2"));
        // A models bundle installed into B: first, one try.
        st.mark_active_with(Class::Models, Slot::B, 1).unwrap();
        assert_eq!(
            st.describe_of(Class::Models),
            "MODELS_ORDER 'B A', A 2 left, B 1 left"
        );
        assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::B));
        // Power cut before the verdict: B has no try left, A is next.
        assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::A));
        st.mark_good_of(Class::Models, Slot::A).unwrap();
        st.mark_bad_of(Class::Models, Slot::B).unwrap();
        assert_eq!(
            st.describe_of(Class::Models),
            "MODELS_ORDER 'A', A 3 left, B 0 left"
        );
        assert_eq!(st.describe(), boot, "the systems' counters are untouched");
        let back = State::decode(&st.encode().unwrap(), "t").unwrap();
        assert_eq!(back, st);
        st.mark_bad_of(Class::Models, Slot::A).unwrap();
        assert_eq!(st.take_try_of(Class::Models).unwrap(), None);
        let mut bad = State::initial();
        bad.env.set("MODELS_B_LEFT", "zz");
        let e = State::decode(&bad.encode().unwrap(), "abstate.env").unwrap_err();
        assert!(format!("{e:#}").contains("MODELS_B_LEFT"), "{e:#}");
    }

    #[test]
    fn rauc_semantics() {
        let mut st = State::initial();
        assert_eq!(st.order().unwrap(), vec![Slot::A, Slot::B]);
        st.mark_bad(Slot::B).unwrap();
        assert_eq!(st.order().unwrap(), vec![Slot::A]);
        assert_eq!(st.left(Slot::B).unwrap(), 0);
        assert!(!st.is_good(Slot::B).unwrap());
        st.mark_active(Slot::B).unwrap();
        assert_eq!(st.order().unwrap(), vec![Slot::B, Slot::A]);
        assert_eq!(st.left(Slot::B).unwrap(), 3);
        let bytes = st.encode().unwrap();
        assert_eq!(State::decode(&bytes, "t").unwrap(), st);
        assert_eq!(
            Slot::from_cmdline("console=ttyAMA0 rauc.slot=B panic=-1"),
            Some(Slot::B)
        );
        assert_eq!(Slot::from_cmdline("rauc.slot=C"), None);
    }
}

/// Read `path` as the A/B state; a damaged file (bad CRC) is an error here.
pub fn load(path: &std::path::Path) -> Result<State> {
    match store::read(path)? {
        store::Read::State(st) => Ok(st),
        store::Read::Damaged(e) => Err(e),
    }
}

/// The variable `boot.scr` boots when no slot has tries left: the slot the self-check last
/// marked good (RAUC does not write it; RAUC's tools keep it as it is).
pub const LAST_GOOD: &str = "KILN_LAST_GOOD";

/// Whether a FAIL with a failed `model.*` check is the models slot's `m` rather than the
/// system's (`docs/models-slots.md`, decision 4): `m` is on its first boot (the one try its
/// install gave it was taken: none left), the booted system has passed before (it is the slot
/// last marked good) and the other models slot is good. Then the reason; else the system is
/// judged as always (a system that fails with the previous models too is marked bad at the
/// next boot).
fn blame_models(st: &State, booted: Slot, m: Slot) -> Option<String> {
    let fresh = st.left_of(Class::Models, m).ok()? == 0;
    let system_passed = st.env.get(LAST_GOOD) == Some(booted.name());
    let other_good = st.is_good_of(Class::Models, m.other()).ok()?;
    (fresh && system_passed && other_good).then(|| {
        format!(
            "a model check FAILed on models slot {}'s first boot, and system slot {} passed \
             before",
            m.name(),
            booted.name()
        )
    })
}

/// Write `st` to `env_path` ([`store::save`]) and read it back: the report says what the card
/// holds, not what was meant. `Err` is the decision's action: nothing marked (the write failed)
/// or marking failed (it reads back otherwise, told with `describe`, or not at all).
fn write_checked(
    env_path: &std::path::Path,
    st: &State,
    describe: impl Fn(&State) -> String,
) -> Result<(), String> {
    store::with_writable(env_path, || store::save(st, env_path))
        .map_err(|e| format!("nothing marked: {e:#}"))?;
    match load(env_path) {
        Ok(back) if back == *st => Ok(()),
        Ok(back) => Err(format!(
            "marking failed: {} reads back as {}, not {}",
            env_path.display(),
            describe(&back),
            describe(st)
        )),
        Err(e) => Err(format!("marking failed: reading it back: {e:#}")),
    }
}

/// A FAIL blamed on models slot `m`: it is marked bad, the boot slot's counters stay as U-Boot
/// left them (the next PASS restores them), and init reboots to map the other models slot.
fn judge_models(
    env_path: &std::path::Path,
    mut st: State,
    m: Slot,
    why: String,
    mut d: Decision,
) -> Decision {
    if let Err(e) = st.mark_bad_of(Class::Models, m) {
        d.action = format!("nothing marked: {e:#}");
        return d;
    }
    if let Err(e) = write_checked(env_path, &st, |s| s.describe_of(Class::Models)) {
        d.action = e;
        return d;
    }
    d.action = "system not marked: the models slot is blamed".into();
    d.after = Some(st.describe());
    d.models = Some(format!(
        "models slot {}: marked bad ({why}); rebooting to map models slot {} ({})",
        m.name(),
        m.other().name(),
        st.describe_of(Class::Models)
    ));
    d.remap_models = Some(m.other().name().into());
    d
}

/// What the self-check's verdict did to the slots: the JSON of the report's `slot` field.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Decision {
    /// The slot this system was booted from (`rauc.slot=`), if any.
    pub booted: Option<String>,
    /// `BOOT_ORDER` and the counters as U-Boot left them for this boot.
    pub at_boot: Option<String>,
    /// … and as the verdict left them.
    pub after: Option<String>,
    /// `marked good`, `marked bad`, or why nothing was marked.
    pub action: String,
    /// The slot to reboot into now (a FAIL with the other slot still good).
    pub reboot_into: Option<String>,
    /// Neither slot is good after the verdict.
    pub no_good_slot: bool,
    /// The models slot init mapped (`--models-slot`), what the verdict did to it and the
    /// models' counters after it; `null` when init named none.
    #[serde(default)]
    pub models: Option<String>,
    /// The models slot to map instead, now (a FAIL blamed on a models slot on its first boot,
    /// the other one good): init reboots into the same system.
    #[serde(default)]
    pub remap_models: Option<String>,
    /// The models slot the checks read (`A`/`B`, found through the kernel: the partition beneath
    /// the dm-verity mapping of `/models`) and the sha256 of its `kiln-models.json`: which models
    /// this verdict is about (the fleet client judges a models update by them). `null` when
    /// `/models` is not mapped from a models slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models_slot: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models_json: Option<String>,
}

impl State {
    /// `BOOT_ORDER 'A B', A 3 left, B 3 left`: the line the report and `kiln slot` print.
    pub fn describe(&self) -> String {
        let left = |s: Slot| {
            self.left(s)
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into())
        };
        format!(
            "BOOT_ORDER '{}', A {} left, B {} left",
            self.env.get("BOOT_ORDER").unwrap_or(""),
            left(Slot::A),
            left(Slot::B)
        )
    }

    /// The same line for a class: `MODELS_ORDER 'A', A 3 left, B 0 left` (absent variables
    /// shown as they read, see [`Class`]).
    pub fn describe_of(&self, c: Class) -> String {
        let left = |s: Slot| {
            self.left_of(c, s)
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into())
        };
        let order = self
            .order_of(c)
            .map(|o| o.iter().map(|s| s.name()).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|_| self.env.get(c.order_var()).unwrap_or("").to_string());
        format!(
            "{} '{order}', A {} left, B {} left",
            c.order_var(),
            left(Slot::A),
            left(Slot::B)
        )
    }
}

/// The self-check's verdict judges the booted slot (from `cmdline`): PASS marks it good (RAUC's
/// mark-good, and [`LAST_GOOD`]), FAIL marks it bad (RAUC's mark-bad) and names the other slot
/// to reboot into when that one is still good. The state is written with [`save`].
pub fn judge(
    env_path: &std::path::Path,
    cmdline: &str,
    pass: bool,
    models: Option<Slot>,
    models_failed: bool,
) -> Decision {
    let mut d = Decision {
        booted: None,
        at_boot: None,
        after: None,
        action: String::new(),
        reboot_into: None,
        no_good_slot: false,
        models: None,
        remap_models: None,
        models_slot: None,
        models_json: None,
    };
    let Some(booted) = Slot::from_cmdline(cmdline) else {
        d.action = "nothing marked: no rauc.slot= on the kernel command line (not booted through boot.scr)".into();
        return d;
    };
    d.booted = Some(booted.name().into());
    let mut st = match load(env_path) {
        Ok(st) => st,
        Err(e) => {
            d.action = format!("nothing marked: {e:#}");
            return d;
        }
    };
    d.at_boot = Some(st.describe());
    if let Some(m) = models.filter(|_| !pass && models_failed) {
        if let Some(why) = blame_models(&st, booted, m) {
            return judge_models(env_path, st, m, why, d);
        }
    }
    // The models slot init mapped took a try before it was mapped: a PASS gives it back its
    // tries (marked good) in the same write; a FAIL leaves it spent, so a freshly installed
    // models slot (one try) is not mapped again (docs/models-slots.md, decision 4).
    let marked = if pass {
        st.mark_good(booted)
            .map(|_| st.env.set(LAST_GOOD, booted.name()))
            .and_then(|_| match models {
                Some(m) => st.mark_good_of(Class::Models, m),
                None => Ok(()),
            })
    } else {
        st.mark_bad(booted)
    };
    if let Err(e) = marked {
        d.action = format!("nothing marked: {e:#}");
        return d;
    }
    if let Err(e) = write_checked(env_path, &st, State::describe) {
        d.action = e;
        return d;
    }
    d.action = if pass { "marked good" } else { "marked bad" }.into();
    d.after = Some(st.describe());
    d.models = models.map(|m| {
        format!(
            "models slot {}: {} ({})",
            m.name(),
            if pass {
                "marked good"
            } else {
                "not marked good: the try it took at boot stays spent"
            },
            st.describe_of(Class::Models)
        )
    });
    let other = booted.other();
    let other_good = st.is_good(other).unwrap_or(false);
    d.no_good_slot = !st.is_good(booted).unwrap_or(false) && !other_good;
    if !pass && other_good {
        d.reboot_into = Some(other.name().into());
    }
    d
}

#[cfg(test)]
mod judge_tests {
    use super::*;

    #[test]
    fn the_verdict_marks_the_booted_slot_and_names_the_reboot() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        store::save(&State::initial(), &p).unwrap();
        let d = judge(&p, "console=x rauc.slot=A", true, None, false);
        assert_eq!(d.action, "marked good");
        assert_eq!(d.models, None);
        assert_eq!(load(&p).unwrap().env.get(LAST_GOOD), Some("A"));
        let d = judge(&p, "rauc.slot=B", false, None, false);
        assert_eq!(
            (d.action.as_str(), d.reboot_into.as_deref()),
            ("marked bad", Some("A"))
        );
        assert_eq!(load(&p).unwrap().order().unwrap(), vec![Slot::A]);
        let d = judge(&p, "rauc.slot=A", false, None, false);
        assert!(d.no_good_slot && d.reboot_into.is_none(), "{d:?}");
        let d = judge(&p, "no slot", true, None, false);
        assert!(d.action.contains("rauc.slot"));
        std::fs::write(&p, b"garbage").unwrap();
        let d = judge(&p, "rauc.slot=A", true, None, false);
        assert!(d.action.starts_with("nothing marked"), "{d:?}");
        assert!(!dir.path().join("abstate.env.new").exists());
    }

    /// A models slot installed with one try, taken at boot: a PASS marks it good (3 tries) with
    /// the boot slot; a FAIL leaves its try spent, so the next boot maps the other one.
    #[test]
    fn the_verdict_marks_the_mapped_models_slot() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        let mut st = State::initial();
        st.mark_active_with(Class::Models, Slot::B, 1).unwrap();
        assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::B));
        store::save(&st, &p).unwrap();
        let d = judge(&p, "rauc.slot=A", true, Some(Slot::B), false);
        assert_eq!(
            d.models.as_deref(),
            Some("models slot B: marked good (MODELS_ORDER 'B A', A 3 left, B 3 left)")
        );
        let mut st = load(&p).unwrap();
        st.mark_active_with(Class::Models, Slot::A, 1).unwrap();
        assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::A));
        store::save(&st, &p).unwrap();
        let d = judge(&p, "rauc.slot=A", false, Some(Slot::A), false);
        assert!(
            d.models.as_deref().unwrap().contains("stays spent"),
            "{d:?}"
        );
        let st = load(&p).unwrap();
        assert_eq!(st.left_of(Class::Models, Slot::A).unwrap(), 0);
        assert_eq!(st.primary_of(Class::Models).unwrap(), Some(Slot::B));
    }

    /// A model check FAILs on a freshly installed models slot under a system that passed
    /// before: the models slot is marked bad, the system is not, and init is told to map the
    /// other models slot. Not so when the system is itself new, when the models slot passed
    /// before, or when no other models slot is good: then the system is judged as always.
    #[test]
    fn a_model_failure_on_a_new_models_slot_is_the_models_slot() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abstate.env");
        let fresh_b = |last_good: Option<&str>| {
            let mut st = State::initial();
            if let Some(g) = last_good {
                st.env.set(LAST_GOOD, g);
            }
            st.mark_active_with(Class::Models, Slot::B, 1).unwrap();
            assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::B));
            store::save(&st, &p).unwrap();
        };
        fresh_b(Some("A"));
        let d = judge(&p, "rauc.slot=A", false, Some(Slot::B), true);
        assert_eq!(d.remap_models.as_deref(), Some("A"), "{d:?}");
        assert_eq!(d.action, "system not marked: the models slot is blamed");
        assert!(d.reboot_into.is_none());
        let st = load(&p).unwrap();
        assert_eq!(st.order().unwrap(), vec![Slot::A, Slot::B]);
        assert_eq!(st.order_of(Class::Models).unwrap(), vec![Slot::A]);
        assert!(d.models.unwrap().contains("marked bad"));
        // A failure that is not a model check's: the system.
        fresh_b(Some("A"));
        let d = judge(&p, "rauc.slot=A", false, Some(Slot::B), false);
        assert_eq!((d.action.as_str(), d.remap_models), ("marked bad", None));
        // A system that never passed: the system.
        fresh_b(Some("B"));
        let d = judge(&p, "rauc.slot=A", false, Some(Slot::B), true);
        assert_eq!((d.action.as_str(), d.remap_models), ("marked bad", None));
        // The factory slot with nothing else good: the system.
        let mut st = State::initial();
        st.env.set(LAST_GOOD, "A");
        assert_eq!(st.take_try_of(Class::Models).unwrap(), Some(Slot::A));
        store::save(&st, &p).unwrap();
        let d = judge(&p, "rauc.slot=A", false, Some(Slot::A), true);
        assert_eq!((d.action.as_str(), d.remap_models), ("marked bad", None));
    }
}
