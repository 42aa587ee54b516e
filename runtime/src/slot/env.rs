//! U-Boot's binary environment, the format of `kiln/abstate.env` on the `bootctl` partition:
//! a little-endian CRC32 of the data area, then the data area: `name=value\0` records, an empty
//! record (a second `\0`) at the end, padded to the fixed size. This is what U-Boot's
//! `env export -c -s SIZE` writes and `env import -c` reads, what `mkenvimage -s SIZE` makes and
//! what libubootenv's `fw_printenv`/`fw_setenv` read and write through a `fw_env.config` line
//! naming the file (non-redundant: no flags byte). Written by hand: no crate reads this format,
//! and it is a CRC and a split.

use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;

/// The size of `kiln/abstate.env` (and of U-Boot's `env export -s` / `env import` length).
pub const SIZE: usize = 0x4000;

/// A decoded environment: names to values, in name order (U-Boot's export order).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Env {
    pub vars: BTreeMap<String, String>,
}

impl Env {
    /// Decode `bytes` (exactly [`SIZE`] bytes; `what` names the file in errors). A wrong CRC is
    /// an error: U-Boot then falls back to its defaults, and so must the caller, knowingly.
    pub fn decode(bytes: &[u8], what: &str) -> Result<Env> {
        ensure!(
            bytes.len() == SIZE,
            "{what}: {} bytes, a U-Boot environment of 0x{SIZE:x} bytes expected",
            bytes.len()
        );
        let stored = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let data = &bytes[4..];
        let crc = crc32fast::hash(data);
        if crc != stored {
            bail!("{what}: CRC32 0x{stored:08x} stored, 0x{crc:08x} computed: the environment is damaged");
        }
        let mut vars = BTreeMap::new();
        for rec in data.split(|&b| b == 0) {
            if rec.is_empty() {
                break;
            }
            let rec = std::str::from_utf8(rec)
                .with_context(|| format!("{what}: a record that is not UTF-8"))?;
            let (k, v) = rec
                .split_once('=')
                .with_context(|| format!("{what}: record {rec:?} has no '='"))?;
            vars.insert(k.to_string(), v.to_string());
        }
        Ok(Env { vars })
    }

    /// Encode to exactly [`SIZE`] bytes, padded with zeros as `env export -c` does.
    pub fn encode(&self) -> Result<Vec<u8>> {
        encode_records(
            self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            SIZE,
            0,
        )
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.vars.get(k).map(String::as_str)
    }

    pub fn set(&mut self, k: &str, v: impl Into<String>) {
        self.vars.insert(k.to_string(), v.into());
    }
}

/// `name=value` records, in the order given, as an environment of `size` bytes whose unused
/// tail is `pad`: `0` as U-Boot's `env export -c` writes it, `0xff` (erased flash) as
/// `mkenvimage` does for a flash image (the QEMU board's pflash env, `cargo xtask boot-test`).
pub fn encode_records<'a>(
    records: impl IntoIterator<Item = (&'a str, &'a str)>,
    size: usize,
    pad: u8,
) -> Result<Vec<u8>> {
    let mut data = Vec::with_capacity(size);
    data.extend_from_slice(&[0; 4]);
    for (k, v) in records {
        ensure!(
            !k.is_empty() && !k.contains(['=', '\0']) && !v.contains('\0'),
            "environment variable {k:?}={v:?} cannot be stored"
        );
        data.extend_from_slice(k.as_bytes());
        data.push(b'=');
        data.extend_from_slice(v.as_bytes());
        data.push(0);
    }
    data.push(0);
    ensure!(
        data.len() <= size,
        "the environment needs {} bytes, more than 0x{size:x}",
        data.len()
    );
    data.resize(size, pad);
    let crc = crc32fast::hash(&data[4..]);
    data[..4].copy_from_slice(&crc.to_le_bytes());
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let mut e = Env::default();
        e.set("BOOT_ORDER", "A B");
        e.set("BOOT_A_LEFT", "3");
        let b = e.encode().unwrap();
        assert_eq!(b.len(), SIZE);
        assert_eq!(
            &b[4..],
            {
                let mut d = b"BOOT_A_LEFT=3\0BOOT_ORDER=A B\0\0".to_vec();
                d.resize(SIZE - 4, 0);
                d
            }
            .as_slice()
        );
        assert_eq!(Env::decode(&b, "t").unwrap(), e);
    }

    #[test]
    fn a_flipped_bit_is_a_damaged_environment() {
        let mut e = Env::default();
        e.set("BOOT_ORDER", "A B");
        let mut b = e.encode().unwrap();
        b[9] ^= 1;
        let err = Env::decode(&b, "abstate.env").unwrap_err().to_string();
        assert!(
            err.contains("abstate.env") && err.contains("damaged"),
            "{err}"
        );
        assert!(Env::decode(&b[..100], "x").is_err());
    }

    #[test]
    fn unstorable_values_are_refused() {
        let mut e = Env::default();
        e.set("A=B", "1");
        assert!(e.encode().is_err());
        let mut e = Env::default();
        e.set("X", "y".repeat(SIZE));
        assert!(e.encode().is_err());
    }
}
