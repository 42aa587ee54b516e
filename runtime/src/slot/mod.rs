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

    fn left_var(self) -> String {
        format!("BOOT_{}_LEFT", self.name())
    }

    /// The slot the running kernel was booted from: `rauc.slot=` on its command line.
    pub fn from_cmdline(cmdline: &str) -> Option<Slot> {
        cmdline
            .split_whitespace()
            .find_map(|w| w.strip_prefix("rauc.slot="))
            .and_then(|s| Slot::parse(s).ok())
    }
}

/// The counters of both slots, with whatever else the environment holds (kept as it is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    env: Env,
}

impl State {
    /// A new image: both slots hold the same system, `A B`, three tries each.
    pub fn initial() -> State {
        let mut env = Env::default();
        env.set("BOOT_ORDER", "A B");
        for s in Slot::ALL {
            env.set(&s.left_var(), format!("{ATTEMPTS:x}"));
        }
        State { env }
    }

    pub fn decode(bytes: &[u8], what: &str) -> Result<State> {
        let env = Env::decode(bytes, what)?;
        let st = State { env };
        st.order().with_context(|| format!("{what}: BOOT_ORDER"))?;
        for s in Slot::ALL {
            st.left(s)
                .with_context(|| format!("{what}: {}", s.left_var()))?;
        }
        Ok(st)
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        self.env.encode()
    }

    /// `BOOT_ORDER` as slots (an absent variable is an empty order).
    pub fn order(&self) -> Result<Vec<Slot>> {
        self.env
            .get("BOOT_ORDER")
            .unwrap_or("")
            .split_whitespace()
            .map(Slot::parse)
            .collect()
    }

    /// `BOOT_x_LEFT`, read as U-Boot's `test 0x${BOOT_x_LEFT}` reads it (hex); absent is 0.
    pub fn left(&self, s: Slot) -> Result<u32> {
        match self.env.get(&s.left_var()) {
            None => Ok(0),
            Some(v) => u32::from_str_radix(v.trim_start_matches("0x"), 16)
                .with_context(|| format!("{}={v:?} is not a hex count", s.left_var())),
        }
    }

    /// The slot U-Boot boots next, RAUC's `boot_primary`: the first in `BOOT_ORDER` with tries
    /// left; `None` if there is none (`boot.scr` then falls back to its defaults).
    pub fn primary(&self) -> Result<Option<Slot>> {
        for s in self.order()? {
            if self.left(s)? > 0 {
                return Ok(Some(s));
            }
        }
        Ok(None)
    }

    /// Good in RAUC's sense: in `BOOT_ORDER` with tries left.
    pub fn is_good(&self, s: Slot) -> Result<bool> {
        Ok(self.order()?.contains(&s) && self.left(s)? > 0)
    }

    fn set_order(&mut self, order: &[Slot]) {
        let names: Vec<&str> = order.iter().map(|s| s.name()).collect();
        self.env.set("BOOT_ORDER", names.join(" "));
    }

    fn set_left(&mut self, s: Slot, n: u32) {
        self.env.set(&s.left_var(), format!("{n:x}"));
    }

    pub fn mark_good(&mut self, s: Slot) -> Result<()> {
        self.order()?;
        self.set_left(s, ATTEMPTS);
        Ok(())
    }

    pub fn mark_bad(&mut self, s: Slot) -> Result<()> {
        let order: Vec<Slot> = self.order()?.into_iter().filter(|&x| x != s).collect();
        self.set_order(&order);
        self.set_left(s, 0);
        Ok(())
    }

    pub fn mark_active(&mut self, s: Slot) -> Result<()> {
        let mut order = vec![s];
        order.extend(self.order()?.into_iter().filter(|&x| x != s));
        self.set_order(&order);
        self.set_left(s, ATTEMPTS);
        Ok(())
    }

    pub fn env(&self) -> &Env {
        &self.env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

/// The self-check's verdict judges the booted slot (from `cmdline`): PASS marks it good (RAUC's
/// mark-good, and [`LAST_GOOD`]), FAIL marks it bad (RAUC's mark-bad) and names the other slot
/// to reboot into when that one is still good. The state is written with [`save`].
pub fn judge(env_path: &std::path::Path, cmdline: &str, pass: bool) -> Decision {
    let mut d = Decision {
        booted: None,
        at_boot: None,
        after: None,
        action: String::new(),
        reboot_into: None,
        no_good_slot: false,
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
    let marked = if pass {
        st.mark_good(booted)
            .map(|_| st.env.set(LAST_GOOD, booted.name()))
    } else {
        st.mark_bad(booted)
    };
    if let Err(e) =
        marked.and_then(|_| store::with_writable(env_path, || store::save(&st, env_path)))
    {
        d.action = format!("nothing marked: {e:#}");
        return d;
    }
    // What the card holds now, read back: the report says what was written, not what was meant.
    let st = match load(env_path) {
        Ok(back) if back == st => back,
        Ok(back) => {
            d.action = format!(
                "marking failed: {} reads back as {}, not {}",
                env_path.display(),
                back.describe(),
                st.describe()
            );
            return d;
        }
        Err(e) => {
            d.action = format!("marking failed: reading it back: {e:#}");
            return d;
        }
    };
    d.action = if pass { "marked good" } else { "marked bad" }.into();
    d.after = Some(st.describe());
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
        let d = judge(&p, "console=x rauc.slot=A", true);
        assert_eq!(d.action, "marked good");
        assert_eq!(load(&p).unwrap().env.get(LAST_GOOD), Some("A"));
        let d = judge(&p, "rauc.slot=B", false);
        assert_eq!(
            (d.action.as_str(), d.reboot_into.as_deref()),
            ("marked bad", Some("A"))
        );
        assert_eq!(load(&p).unwrap().order().unwrap(), vec![Slot::A]);
        let d = judge(&p, "rauc.slot=A", false);
        assert!(d.no_good_slot && d.reboot_into.is_none(), "{d:?}");
        let d = judge(&p, "no slot", true);
        assert!(d.action.contains("rauc.slot"));
        std::fs::write(&p, b"garbage").unwrap();
        let d = judge(&p, "rauc.slot=A", true);
        assert!(d.action.starts_with("nothing marked"), "{d:?}");
        assert!(!dir.path().join("abstate.env.new").exists());
    }
}
