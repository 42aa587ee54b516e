//! `cargo xtask flash --api-key FILE` and `--fleet-token FILE`: the board's own secrets (its API
//! key, its hawkBit target token), written after the image onto the card's `data` partition
//! (`/data/kiln/api-key`, `/data/kiln/fleet-token` on the board, mode 0600, owner root), where no
//! image, bundle or update writes: the image stays the same bytes for every board of a fleet.
//!
//! The partition is ext4; the key goes in with e2fsprogs' `debugfs -w` (the card's partition at
//! its byte offset, `DEVICE?offset=N`, so a whole-disk device and an image file are written
//! alike), is read back through `debugfs cat` and the file system checked by `e2fsck -fn`.
//! debugfs reports a failed command on stderr but exits 0: the read-back is what proves it.

use crate::disk::gpt;
use crate::doctor;
use anyhow::{bail, ensure, Context, Result};
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

/// The key's path inside the data partition (`/data/kiln/api-key` on the board: the recipes'
/// default `[serve] api_key_file`).
pub const KEY_PATH: &str = "kiln/api-key";
/// The fleet token's path inside the data partition (`[fleet] token_file`'s default,
/// `/data/kiln/fleet-token`).
pub const FLEET_TOKEN_PATH: &str = "kiln/fleet-token";

/// `--fleet-token FILE`: one line of 8 to 4096 visible ASCII characters (hawkBit's generated
/// target tokens are 32), checked before anything is written.
pub fn read_token(file: &Path) -> Result<Vec<u8>> {
    read_secret(file, "--fleet-token", 8, "TargetToken TOKEN")
}

/// The key in FILE: one line of 16 to 4096 visible ASCII characters (a bearer token), checked
/// before anything is written.
pub fn read_key(file: &Path) -> Result<Vec<u8>> {
    read_secret(file, "--api-key", 16, "Bearer KEY")
}

fn read_secret(file: &Path, flag: &str, min: usize, sent_as: &str) -> Result<Vec<u8>> {
    let raw = std::fs::read(file).with_context(|| format!("reading {flag} {}", file.display()))?;
    let key = raw.strip_suffix(b"\n").unwrap_or(&raw);
    let key = key.strip_suffix(b"\r").unwrap_or(key);
    ensure!(
        (min..=4096).contains(&key.len()),
        "{flag} {}: it is {} bytes; one line of {min} to 4096 characters is needed \
         (e.g. `openssl rand -hex 32 > {}`)",
        file.display(),
        key.len(),
        file.display()
    );
    if let Some(b) = key.iter().find(|b| !b.is_ascii_graphic()) {
        bail!(
            "{flag} {}: byte 0x{b:02x} is not a visible ASCII character (one line, no \
             spaces: it is sent as `Authorization: {sent_as}`)",
            file.display()
        );
    }
    Ok(key.to_vec())
}

fn debugfs(spec: &str, write: bool, script: &str) -> Result<(String, String)> {
    let mut c = Command::new("debugfs");
    if write {
        c.arg("-w");
    }
    let mut child = c
        .args(["-f", "-", spec])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running debugfs (e2fsprogs)")?;
    child
        .stdin
        .take()
        .context("debugfs's stdin")?
        .write_all(script.as_bytes())
        .context("writing to debugfs")?;
    let out = child.wait_with_output().context("waiting for debugfs")?;
    ensure!(
        out.status.success(),
        "debugfs {spec} exited with {}",
        out.status
    );
    Ok((
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The `data` partition of a disk or image with kiln's GPT.
fn data_partition(disk: &Path) -> Result<gpt::PartitionEntryInfo> {
    let parts = gpt::read(disk).with_context(|| {
        format!(
            "--api-key needs a kiln image, with a GPT: {}",
            disk.display()
        )
    })?;
    parts
        .into_iter()
        .find(|p| p.name == "data")
        .with_context(|| {
            format!(
                "{} has no partition named data: --api-key needs a kiln image",
                disk.display()
            )
        })
}

/// Before anything is written: an uncompressed image must have the data partition (a compressed
/// one is checked on the card, after the write).
pub fn check_image(image: &Path) -> Result<()> {
    data_partition(image).map(|_| ())
}

/// Write `key` to the `data` partition of `target` (a block device or an image file holding
/// kiln's GPT), replacing the one there; then read it back and check the file system.
pub fn provision(target: &Path, key: &[u8]) -> Result<()> {
    provision_file(target, KEY_PATH, key)
}

/// Write `key` as `path` (inside the data partition) of `target`, as [`provision`] does.
pub fn provision_file(target: &Path, path: &str, key: &[u8]) -> Result<()> {
    doctor::ensure(&[&doctor::E2FSCK])?;
    let data = data_partition(target)?;
    let spec = format!("{}?offset={}", target.display(), data.start_bytes());
    let dir = tempfile::tempdir().context("a private directory for the key")?;
    let tmp = dir.path().join("api-key");
    // debugfs splits its commands at whitespace: a temporary path with a space would write
    // something else, or nothing.
    if tmp.to_string_lossy().contains(char::is_whitespace) {
        bail!(
            "the temporary key file {} has whitespace in its path, which debugfs cannot take: \
             set TMPDIR to a directory without spaces",
            tmp.display()
        );
    }
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(key)
            .and_then(|()| f.write_all(b"\n"))
            .with_context(|| format!("writing {}", tmp.display()))?;
    }
    // mkdir and rm fail harmlessly when the directory exists or no key was there before.
    let script = format!(
        "mkdir kiln\nrm {path}\nwrite {} {path}\nsif {path} mode 0100600\n\
         sif {path} uid 0\nsif {path} gid 0\n",
        tmp.display()
    );
    let (_, err) = debugfs(&spec, true, &script)?;
    let (back, _) = debugfs(&spec, false, &format!("cat {path}\n"))?;
    let mut want = key.to_vec();
    want.push(b'\n');
    // debugfs echoes each command it reads from -f as "debugfs: cmd" on stdout.
    let got: String = back
        .lines()
        .filter(|l| !l.starts_with("debugfs:"))
        .map(|l| format!("{l}\n"))
        .collect();
    if got.as_bytes() != want.as_slice() {
        bail!(
            "{path} on {}'s data partition does not read back as written (debugfs said: {})",
            target.display(),
            err.trim()
        );
    }
    let (stat, _) = debugfs(&spec, false, &format!("stat {path}\n"))?;
    ensure!(
        stat.contains("Mode:  0600") && stat.contains("User:     0   Group:     0"),
        "{path} on {}'s data partition is not mode 0600, owner root: {}",
        target.display(),
        stat.lines().take(4).collect::<Vec<_>>().join(" / ")
    );
    let fsck = Command::new("e2fsck")
        .args(["-fn", &spec])
        .output()
        .context("running e2fsck")?;
    ensure!(
        fsck.status.success(),
        "e2fsck -fn of {}'s data partition after writing the key: {}",
        target.display(),
        String::from_utf8_lossy(&fsck.stdout)
    );
    Ok(())
}
