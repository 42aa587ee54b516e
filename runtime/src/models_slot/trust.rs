//! Whether a models slot is believed (decision 3 of `docs/models-slots.md`), the one rule that
//! init's `kiln verity map` and the self-check both apply:
//! - the factory slot: its `kiln-models.json` is the one the booted system's manifest names
//!   (`models_slot.meta_sha256`; `cargo xtask image` holds no fleet key, so the image vouches for
//!   the models it was built with); its known answers are the manifest's;
//! - any other slot (a models bundle's): its detached CMS signature verifies against the board's
//!   update keyring with its CRL (the file RAUC checks bundles against), and it carries its own
//!   known answers.
//!
//! Either way the slot's models format must be one this system reads (decision 6).

use super::{verify_signature, Slot, FORMAT};
use crate::verity::Mapped;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The board's update keyring (what RAUC's `system.conf` names).
pub const KEYRING: &str = "/etc/rauc/keyring.pem";

/// Why a slot is believed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Basis {
    /// Its `kiln-models.json` is the one the booted manifest names.
    Factory,
    /// Its signature verified against this keyring (with its CRL, when it holds one).
    Signed(PathBuf),
}

/// A slot and why it is believed.
#[derive(Clone, Debug)]
pub struct Trusted {
    pub slot: Slot,
    pub basis: Basis,
}

impl Trusted {
    /// The positive words for a line: what the slot is and why it is believed.
    pub fn describe(&self) -> String {
        let s = &self.slot;
        let why = match &self.basis {
            Basis::Factory => {
                "the factory slot this system's manifest names (models_slot.meta_sha256)".into()
            }
            Basis::Signed(k) => format!(
                "signed: its {}-byte CMS signature verified against {} (with its CRL when it holds one)",
                s.signature.len(),
                k.display()
            ),
        };
        format!(
            "kiln-models.json sha256 {} (format {}, {} files, verity root {}) is {why}",
            s.meta_sha256(),
            s.meta.format,
            s.meta.models.len(),
            s.meta.verity.root_hash
        )
    }

    /// Whether the slot carries its own known answers (a bundle's does; the factory slot's are
    /// in the manifest).
    pub fn has_answers(&self) -> bool {
        !self.slot.meta.known_answers.is_empty()
    }
}

/// The sha256 of the factory slot's `kiln-models.json` that `manifest` names.
pub fn factory_sha(manifest: &serde_json::Value) -> Option<&str> {
    manifest["models_slot"]["meta_sha256"].as_str()
}

/// Whether `slot` is believed by a system whose manifest names `factory` and whose update
/// keyring is `keyring`; `what` names the slot in errors.
pub fn trust(slot: Slot, factory: Option<&str>, keyring: &Path, what: &str) -> Result<Trusted> {
    let sha = slot.meta_sha256();
    if slot.meta.format != FORMAT {
        bail!(
            "{what}: its models are format {}; this system reads format {FORMAT} (decision 6 of \
             docs/models-slots.md: install a system that reads it, or a models bundle of format \
             {FORMAT})",
            slot.meta.format
        );
    }
    if factory == Some(sha.as_str()) {
        return Ok(Trusted {
            slot,
            basis: Basis::Factory,
        });
    }
    if slot.signature.is_empty() {
        bail!(
            "{what}: its kiln-models.json (sha256 {sha}) is not signed and is not the factory slot \
             this system's manifest names ({}): not believed",
            factory.unwrap_or("none")
        );
    }
    verified(&slot, keyring).with_context(|| {
        format!("{what}: kiln-models.json sha256 {sha}: its signature is refused")
    })?;
    if slot.meta.known_answers.is_empty() {
        bail!(
            "{what}: signed, but its kiln-models.json (sha256 {sha}) carries no known answers: \
             nothing to judge its models by (a models bundle carries its own: cargo xtask bundle \
             --models)"
        );
    }
    Ok(Trusted {
        slot,
        basis: Basis::Signed(keyring.to_path_buf()),
    })
}

/// [`verify_signature`], once per metadata, signature and keyring in this process: the
/// self-check asks for several checks, and under emulation each openssl run is a fraction of a
/// second. Only successes are kept (a failure is asked again, and named again).
fn verified(slot: &Slot, keyring: &Path) -> Result<()> {
    static SEEN: OnceLock<Mutex<HashMap<[u8; 32], ()>>> = OnceLock::new();
    let ring = std::fs::read(keyring)
        .with_context(|| format!("reading the update keyring {}", keyring.display()))?;
    let mut h = Sha256::new();
    for part in [&slot.meta_bytes[..], &slot.signature, &ring] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let key: [u8; 32] = h.finalize().into();
    let seen = SEEN.get_or_init(Default::default);
    if seen.lock().is_ok_and(|m| m.contains_key(&key)) {
        return Ok(());
    }
    verify_signature(&slot.meta_bytes, &slot.signature, keyring)?;
    if let Ok(mut m) = seen.lock() {
        m.insert(key, ());
    }
    Ok(())
}

/// What a system makes of the slot on `dev`: believed ([`trust`]), or its own description
/// (footer, `kiln-models.json`) damaged. Init maps a damaged one with the manifest's
/// `models_verity` (the factory data the measured manifest proves by itself) and the self-check
/// FAILs naming the damage; a readable slot that is not believed is an error (never mapped).
pub enum View {
    Trusted(Box<Trusted>),
    Damaged(String),
}

/// [`View`] of the slot on `dev` for a system whose manifest names `factory` and whose update
/// keyring is `keyring`; an error for an empty slot, a device that cannot be opened, or a slot
/// that is refused.
pub fn view(dev: &Path, factory: Option<&str>, keyring: &Path) -> Result<View, String> {
    let what = dev.display().to_string();
    let slot = match super::read(dev) {
        Ok(Some(s)) => s,
        Ok(None) => {
            return Err(format!(
                "{what}: holds no kiln-models.json (an empty models slot)"
            ))
        }
        Err(e) if std::fs::metadata(dev).is_err() => return Err(format!("{e:#}")),
        Err(e) => return Ok(View::Damaged(format!("{e:#}"))),
    };
    trust(slot, factory, keyring, &what)
        .map(|t| View::Trusted(Box::new(t)))
        .map_err(|e| format!("{e:#}"))
}

// The one rule of `kiln verity map` and the self-check: which verity parameters a believed slot
// is mapped with.

fn manifest_json(manifest: &Path) -> Result<serde_json::Value, String> {
    std::fs::read(manifest)
        .map_err(|e| format!("{}: {e}", manifest.display()))
        .and_then(|b| {
            serde_json::from_slice(&b).map_err(|e| format!("{}: not JSON: {e}", manifest.display()))
        })
}

/// A believed slot's verity parameters are what kiln maps, and the factory slot's are the
/// manifest's too (the self-check holds them equal).
pub fn checked(manifest: &Path, t: &Trusted, what: &str) -> Result<(), String> {
    let v = &t.slot.meta.verity;
    v.valid(&format!("{what}: kiln-models.json's verity"))?;
    if t.basis == Basis::Factory {
        let want = crate::verity::Params::from_manifest(manifest)?;
        if &want != v {
            return Err(format!(
                "{what}: its kiln-models.json gives other verity parameters than the manifest's \
                 models_verity (root {} vs {})",
                v.root_hash, want.root_hash
            ));
        }
    }
    Ok(())
}

/// The slot on `part`, believed by the system whose manifest is `manifest` and whose update
/// keyring is `keyring`, with its verity parameters checked.
pub fn trusted_slot(manifest: &Path, part: &Path, keyring: &Path) -> Result<Trusted, String> {
    let m = manifest_json(manifest)?;
    match view(part, factory_sha(&m), keyring)? {
        View::Trusted(t) => {
            checked(manifest, &t, &part.display().to_string())?;
            Ok(*t)
        }
        View::Damaged(e) => Err(e),
    }
}

/// Map `part` through dm-verity as [`crate::verity::NAME`] with the verity parameters of the models slot on it,
/// once it is believed ([`view`]). A slot whose own description
/// (footer, `kiln-models.json`) is damaged is mapped with the manifest's `models_verity`: the
/// factory data the measured manifest proves by itself (any other data then reads as I/O
/// errors), so the self-check still names what it reads, and FAILs naming the damage. A slot
/// that is readable but not believed is not mapped.
pub fn map(manifest: &Path, part: &Path, keyring: &Path, control: &Path) -> Result<Mapped, String> {
    let m = manifest_json(manifest)?;
    let (params, why) = match view(part, factory_sha(&m), keyring)? {
        View::Damaged(e) => (
            crate::verity::Params::from_manifest(manifest)?,
            format!(
                "its own description is damaged ({e}): mapped with the manifest's \
                 models_verity, the factory data it proves; the self-check FAILs on the damage"
            ),
        ),
        View::Trusted(t) => {
            checked(manifest, &t, &part.display().to_string())?;
            (t.slot.meta.verity.clone(), t.describe())
        }
    };
    crate::verity::map_with(part, &params, &why, control)
}
