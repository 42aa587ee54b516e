//! The models slot through dm-verity: init maps it with the verity parameters of the slot's own
//! `kiln-models.json` once that is believed (`kiln verity map`; `crate::models_slot::trust`
//! decides: the factory slot the manifest names, or a slot signed by a key the update keyring
//! trusts, and calls [`map_with`]; this module knows nothing of trust) and
//! mounts the mapping on `/models`; the kernel then checks every block against the root hash as
//! it is read, so a model is proved by one root hash at boot instead of by hashing every byte of
//! it. A block that does not match is an I/O error on read (never the wrong bytes);
//! [`crate::gguf`]'s fault guard turns that into an error naming the model.
//!
//! The self-check (`image.manifest`) reads the live table back through the kernel
//! ([`check`]): the root hash, salt, sizes and the partition beneath must be the believed
//! slot's, the status `V` (no corrupted block seen), and `/models` mounted from that mapping.

pub mod dm;

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The device-mapper name of the models mapping.
pub const NAME: &str = "kiln-models";
/// Its device-mapper UUID (what `dmsetup info` shows).
pub const UUID: &str = "KILN-VERITY-models";
pub const CONTROL: &str = "/dev/mapper/control";

/// The manifest's `models_verity`, as `cargo xtask image` writes it (xtask `disk::verity`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// Always 1 (salt first).
    pub version: u32,
    pub algorithm: String,
    pub data_block_size: u64,
    pub hash_block_size: u64,
    pub data_blocks: u64,
    /// In hash blocks from the start of the device (the same device as the data).
    pub hash_start_block: u64,
    /// Hex.
    pub salt: String,
    /// Hex.
    pub root_hash: String,
}

impl Params {
    /// The manifest's `models_verity`, or an error naming the file and what is wrong.
    pub fn from_manifest(manifest: &Path) -> Result<Params, String> {
        let bytes = std::fs::read(manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{}: not JSON: {e}", manifest.display()))?;
        let p = v.get("models_verity").ok_or_else(|| {
            format!(
                "{} has no models_verity (an image built before dm-verity: reflash)",
                manifest.display()
            )
        })?;
        let p: Params = serde_json::from_value(p.clone())
            .map_err(|e| format!("{}: models_verity: {e}", manifest.display()))?;
        p.valid(&format!("{}: models_verity", manifest.display()))?;
        Ok(p)
    }

    /// What kiln maps: version 1, sha256, 4 KiB blocks, 64-hex root and salt, the tree after
    /// the data. `what` names where the parameters came from.
    pub fn valid(&self, what: &str) -> Result<(), String> {
        let p = self;
        let hex_ok = |s: &str, n| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if p.version != 1
            || p.algorithm != "sha256"
            || p.data_block_size != 4096
            || p.hash_block_size != 4096
            || p.data_blocks < 2
            || p.hash_start_block < p.data_blocks
            || !hex_ok(&p.root_hash, 64)
            || !hex_ok(&p.salt, 64)
        {
            return Err(format!(
                "{what} {p:?} is not version 1, sha256, 4 KiB blocks, a 64-hex root and salt, \
                 with the tree after the data"
            ));
        }
        Ok(())
    }

    /// The verity target's parameters over the block device `dev` (`major:minor`).
    pub fn table(&self, dev: &str) -> String {
        format!(
            "{} {dev} {dev} {} {} {} {} {} {} {}",
            self.version,
            self.data_block_size,
            self.hash_block_size,
            self.data_blocks,
            self.hash_start_block,
            self.algorithm,
            self.root_hash,
            self.salt
        )
    }

    fn target(&self, dev: &str) -> dm::Target {
        dm::Target {
            start: 0,
            length: self.data_blocks * self.data_block_size / 512,
            kind: "verity".into(),
            params: self.table(dev),
        }
    }
}

/// `major:minor` of the block device at `path`.
pub fn devno(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !m.file_type().is_block_device() {
        return Err(format!("{} is not a block device", path.display()));
    }
    let r = m.rdev();
    Ok(format!("{}:{}", libc::major(r), libc::minor(r)))
}

/// What [`map_with`] made.
pub struct Mapped {
    /// `/dev/dm-N`.
    pub dev: PathBuf,
    /// The positive line: what is mapped over what, with which root hash, from where.
    pub line: String,
}

/// Map `part` through dm-verity as [`NAME`] with `params`; `why` ends the positive line (how the
/// parameters came to be believed: `crate::models_slot::trust::map` decides, this only maps).
pub fn map_with(part: &Path, params: &Params, why: &str, control: &Path) -> Result<Mapped, String> {
    let p = &params;
    let devno = devno(part)?;
    let size = std::fs::File::open(part)
        .and_then(|mut f| std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)))
        .map_err(|e| format!("{}: {e}", part.display()))?;
    let need = p.hash_start_block * p.hash_block_size;
    if size < need {
        return Err(format!(
            "{} is {size} bytes; its verity parameters need more than {need} (data and tree)",
            part.display()
        ));
    }
    let c = dm::Control::open(control).map_err(|e| e.to_string())?;
    let (major, minor) = c.create(NAME, UUID).map_err(|e| e.to_string())?;
    let live = c
        .load(NAME, &p.target(&devno))
        .and_then(|()| c.resume(NAME));
    if let Err(e) = live {
        let _ = c.remove(NAME);
        return Err(e.to_string());
    }
    Ok(Mapped {
        dev: PathBuf::from(format!("/dev/dm-{minor}")),
        line: format!(
            "{} ({major}:{minor}) maps {} ({devno}) through dm-verity: root hash {}, {} data \
             blocks of 4 KiB, every block checked against it when read; its {}",
            NAME,
            part.display(),
            p.root_hash,
            p.data_blocks,
            why
        ),
    })
}

/// Compare the live mapping [`NAME`] with `want` over the partition `devno`: `Ok` with the
/// evidence lines, `Err` with what differs.
pub fn check(control: &Path, want: &Params, devno: &str) -> Result<Vec<String>, String> {
    let c = dm::Control::open(control).map_err(|e| e.to_string())?;
    let table = c.targets(NAME, true).map_err(|e| e.to_string())?;
    let status = c.targets(NAME, false).map_err(|e| e.to_string())?;
    let [t] = table.as_slice() else {
        return Err(format!("{NAME} has {} targets, 1 expected", table.len()));
    };
    let expect = want.target(devno);
    if t.kind != "verity" || t.start != 0 || t.length != expect.length {
        return Err(format!(
            "{NAME} is a {} target of sectors {}+{}, not verity over 0+{}",
            t.kind, t.start, t.length, expect.length
        ));
    }
    // The kernel prints the table as loaded, optional arguments after the salt.
    let got: Vec<&str> = t.params.split_whitespace().collect();
    let exp_text = want.table(devno);
    let exp: Vec<&str> = exp_text.split_whitespace().collect();
    if got.len() < exp.len() || got[..exp.len()] != exp[..] {
        return Err(format!(
            "{NAME}'s live table is `{}`, the slot's `{exp_text}`",
            t.params
        ));
    }
    let state = status.first().map(|s| s.params.trim().to_string());
    match state.as_deref() {
        Some("V") => {}
        Some("C") => {
            return Err(format!(
                "{NAME}: dm-verity has seen a corrupted block (status C): a block of the models \
                 partition does not match root hash {}",
                want.root_hash
            ))
        }
        other => return Err(format!("{NAME}: unexpected verity status {other:?}")),
    }
    Ok(vec![format!(
        "{NAME}: live verity table over {devno} with root hash {} and salt {} (the slot's), \
         {} data blocks, status V (no corrupted block read so far)",
        want.root_hash, want.salt, want.data_blocks
    )])
}

/// The live mapping's root hash, from the kernel's table.
pub fn live_root(control: &Path) -> Result<String, String> {
    let c = dm::Control::open(control).map_err(|e| e.to_string())?;
    let table = c.targets(NAME, true).map_err(|e| e.to_string())?;
    table
        .iter()
        .find(|t| t.kind == "verity")
        .and_then(|t| t.params.split_whitespace().nth(8).map(str::to_string))
        .ok_or_else(|| format!("{NAME} has no verity target"))
}

/// The partition beneath the live mapping (from the kernel's table: its data device's
/// `major:minor`, named through `sys`), as `/dev/NAME` under `dev`.
pub fn live_device(control: &Path, sys: &Path, dev: &Path) -> Result<PathBuf, String> {
    let c = dm::Control::open(control).map_err(|e| e.to_string())?;
    let table = c.targets(NAME, true).map_err(|e| e.to_string())?;
    let devno = table
        .iter()
        .find(|t| t.kind == "verity")
        .and_then(|t| t.params.split_whitespace().nth(1).map(str::to_string))
        .ok_or_else(|| format!("{NAME} has no verity target"))?;
    let uevent = sys.join(format!("dev/block/{devno}/uevent"));
    let text =
        std::fs::read_to_string(&uevent).map_err(|e| format!("{}: {e}", uevent.display()))?;
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .ok_or_else(|| format!("{}: no DEVNAME", uevent.display()))?;
    Ok(dev.join(name))
}

/// The `major:minor` of the filesystem mounted at `mountpoint`, from `mountinfo`.
pub fn mounted_from(mountinfo: &Path, mountpoint: &str) -> Option<String> {
    let text = std::fs::read_to_string(mountinfo).ok()?;
    // The last mount on the point is the one seen there.
    text.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(4) == Some(&mountpoint)).then(|| f.get(2).map(|s| s.to_string()))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params {
            version: 1,
            algorithm: "sha256".into(),
            data_block_size: 4096,
            hash_block_size: 4096,
            data_blocks: 100,
            hash_start_block: 100,
            salt: "ab".repeat(32),
            root_hash: "cd".repeat(32),
        }
    }

    #[test]
    fn the_table_is_the_kernels_format() {
        assert_eq!(
            params().table("254:4"),
            format!(
                "1 254:4 254:4 4096 4096 100 100 sha256 {} {}",
                "cd".repeat(32),
                "ab".repeat(32)
            )
        );
        assert_eq!(params().target("1:2").length, 800);
    }

    #[test]
    fn bad_manifests_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("manifest.json");
        std::fs::write(&m, "{}").unwrap();
        assert!(Params::from_manifest(&m)
            .unwrap_err()
            .contains("has no models_verity"));
        let mut v = serde_json::json!({"models_verity": {
            "version": 1, "algorithm": "sha256", "data_block_size": 4096,
            "hash_block_size": 4096, "data_blocks": 100, "hash_start_block": 100,
            "salt": "ab".repeat(32), "root_hash": "cd".repeat(32)}});
        std::fs::write(&m, v.to_string()).unwrap();
        assert_eq!(Params::from_manifest(&m).unwrap(), params());
        v["models_verity"]["root_hash"] = "zz".into();
        std::fs::write(&m, v.to_string()).unwrap();
        assert!(Params::from_manifest(&m)
            .unwrap_err()
            .contains("64-hex root"));
        v["models_verity"]["extra"] = 1.into();
        std::fs::write(&m, v.to_string()).unwrap();
        assert!(Params::from_manifest(&m)
            .unwrap_err()
            .contains("unknown field"));
    }

    #[test]
    fn mountinfo_names_the_device() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("mountinfo");
        std::fs::write(
            &m,
            "22 1 0:5 / / rw - rootfs rootfs rw\n30 22 254:0 / /models ro - erofs /dev/dm-0 ro\n",
        )
        .unwrap();
        assert_eq!(mounted_from(&m, "/models").as_deref(), Some("254:0"));
        assert_eq!(mounted_from(&m, "/data"), None);
    }
}
