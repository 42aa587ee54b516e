//! A models slot that describes itself (issue 38, `docs/models-slots.md`, decision 2): the
//! slot's bytes are the models' erofs, its dm-verity hash tree, then a trailer — the metadata
//! [`Meta`] as JSON (`kiln-models.json`: the models, the verity parameters, the known answers,
//! the models format) and a detached CMS signature of it in DER (`kiln-models.p7s`) — and, in
//! the slot's last [`FOOTER_LEN`] bytes, a [`Footer`] giving where the two are and the JSON's
//! sha256. So a slot written by a bundle carries what the board needs to trust and map it,
//! whichever system reads it.
//!
//! Trust (decision 3): [`read`] only finds and parses; the metadata is believed when
//! [`verify_signature`] accepts its signature against the board's update keyring and CRL (the
//! file RAUC uses), or when its sha256 ([`Slot::meta_sha256`]) is the one the booted system's
//! manifest names (the factory slot, which the image build cannot sign: it holds no fleet key).
//!
//! Everything read from a slot is bounded before it is used: offsets and lengths inside the slot
//! and outside the footer, the trailer after the hash tree, the two parts apart, the JSON at most
//! [`MAX_META`] and the signature at most [`MAX_SIG`] bytes. An empty slot (zeros, or the
//! [`Footer::empty`] a new image's `models_b` ends with) is "holds no models", not a parse error.

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::{Command, Stdio};

pub mod trust;

/// The GPT names of the models slot pair, slot `A` then `B` (p4, p5).
pub const PARTITIONS: [&str; 2] = ["models_a", "models_b"];

/// The footer's size: the slot's last 4 KiB (one verity block).
pub const FOOTER_LEN: u64 = 4096;
pub const MAGIC: &[u8; 16] = b"KILN-MODELS-SLOT";
/// The footer's layout version.
pub const FOOTER_VERSION: u32 = 1;
/// The models format this runtime reads (what a bundle's metadata says it is, decision 6).
pub const FORMAT: u32 = 1;
/// Limits on what the footer may point at.
pub const MAX_META: u64 = 1 << 20;
pub const MAX_SIG: u64 = 64 << 10;
/// The trailer's parts start on 4 KiB boundaries.
const ALIGN: u64 = 4096;

/// Where the trailer's parts are, and the JSON's sha256. On disk (little-endian): magic (16),
/// version (u32), reserved (u32, 0), meta offset, meta length, signature offset, signature
/// length (u64 each), the meta's sha256 (32), then the sha256 of the 88 bytes before it, then
/// zeros to [`FOOTER_LEN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    pub meta_off: u64,
    pub meta_len: u64,
    pub sig_off: u64,
    pub sig_len: u64,
    pub meta_sha256: [u8; 32],
}

const BODY: usize = 16 + 4 + 4 + 8 * 4 + 32;

impl Footer {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(FOOTER_LEN as usize);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FOOTER_VERSION.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [self.meta_off, self.meta_len, self.sig_off, self.sig_len] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.meta_sha256);
        debug_assert_eq!(b.len(), BODY);
        let sum = Sha256::digest(&b);
        b.extend_from_slice(&sum);
        b.resize(FOOTER_LEN as usize, 0);
        b
    }

    /// The footer of an empty slot as the image writes it (`models_b` of a new card): a whole
    /// footer (magic, version, its own sha256) that points at nothing. Not zeros, so that
    /// flashing the image by its block map writes it and a card's old slot does not survive a
    /// reflash as "models_b" (the bmap skips runs of zeros).
    pub fn empty() -> Vec<u8> {
        Footer {
            meta_off: 0,
            meta_len: 0,
            sig_off: 0,
            sig_len: 0,
            meta_sha256: [0; 32],
        }
        .encode()
    }

    /// The footer of a slot of `slot_len` bytes, checked against it. `Ok(None)`: the slot
    /// holds no models (its last 4 KiB are zeros, or [`Footer::empty`]).
    pub fn decode(b: &[u8], slot_len: u64) -> Result<Option<Footer>> {
        ensure!(
            b.len() as u64 == FOOTER_LEN,
            "a models footer is {FOOTER_LEN} bytes, not {}",
            b.len()
        );
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        ensure!(
            &b[..16] == MAGIC,
            "not a kiln models slot: its last 4 KiB start {:?}, not {:?}",
            String::from_utf8_lossy(&b[..16]),
            String::from_utf8_lossy(MAGIC)
        );
        ensure!(
            Sha256::digest(&b[..BODY])[..] == b[BODY..BODY + 32],
            "the models footer is damaged (its own sha256 does not match)"
        );
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(16);
        ensure!(
            version == FOOTER_VERSION,
            "models footer version {version}: this kiln reads version {FOOTER_VERSION}"
        );
        let f = Footer {
            meta_off: u64_at(24),
            meta_len: u64_at(32),
            sig_off: u64_at(40),
            sig_len: u64_at(48),
            meta_sha256: b[56..88].try_into().expect("32 bytes"),
        };
        if b == Footer::empty() {
            return Ok(None);
        }
        f.check(slot_len)?;
        Ok(Some(f))
    }

    /// The parts lie inside the slot before the footer, do not overlap, and are not over the
    /// limits (the signature may be empty: a factory slot has none).
    fn check(&self, slot_len: u64) -> Result<()> {
        let end = slot_len
            .checked_sub(FOOTER_LEN)
            .context("a models slot smaller than its footer")?;
        ensure!(
            (1..=MAX_META).contains(&self.meta_len),
            "the models metadata is {} bytes (1 to {MAX_META} allowed)",
            self.meta_len
        );
        ensure!(
            self.sig_len <= MAX_SIG,
            "the models signature is {} bytes (at most {MAX_SIG})",
            self.sig_len
        );
        let within = |off: u64, len: u64, what: &str| -> Result<u64> {
            let stop = off
                .checked_add(len)
                .filter(|&s| s <= end)
                .with_context(|| {
                    format!("the models {what} at {off}+{len} runs past the slot's {end} bytes")
                })?;
            Ok(stop)
        };
        let meta_end = within(self.meta_off, self.meta_len, "metadata")?;
        let sig_end = within(self.sig_off, self.sig_len, "signature")?;
        ensure!(
            self.sig_len == 0 || meta_end <= self.sig_off || sig_end <= self.meta_off,
            "the models metadata and signature overlap"
        );
        Ok(())
    }
}

/// One model in the slot.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// Its file name under `/models`.
    pub name: String,
    pub size: u64,
    /// Hex.
    pub sha256: String,
}

/// `kiln-models.json`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// The models format the slot is (decision 6: a system refuses a format it cannot read).
    pub format: u32,
    pub models: Vec<Model>,
    /// How to map the slot's erofs: the hash tree follows it in the same slot.
    pub verity: crate::verity::Params,
    /// The self-check's known answers for these models, under the manifest's own keys
    /// (`known_matmul`, `known_nll`, …), computed when the slot was built.
    pub known_answers: serde_json::Map<String, serde_json::Value>,
}

impl Meta {
    /// Where the hash tree ends, from the verity parameters: the trailer starts at or after it.
    pub fn hash_tree_end(&self) -> Result<u64> {
        let v = &self.verity;
        ensure!(
            v.data_block_size == 4096 && v.hash_block_size == 4096,
            "the models verity parameters: 4096-byte blocks expected, got {}/{}",
            v.data_block_size,
            v.hash_block_size
        );
        ensure!(
            v.data_blocks >= 2,
            "the models verity parameters: {} data blocks (a tree needs 2 or more)",
            v.data_blocks
        );
        // As xtask's `disk::verity` writes it (no superblock): one level after another, 128
        // sha256 hashes to a 4 KiB block, until a level fits in one block.
        let mut blocks = 0u64;
        let mut level = v.data_blocks;
        loop {
            level = level.div_ceil(128);
            blocks += level;
            if level == 1 {
                break;
            }
        }
        v.hash_start_block
            .checked_add(blocks)
            .and_then(|b| b.checked_mul(4096))
            .context("the models verity parameters overflow")
    }
}

/// What [`read`] found in a slot.
#[derive(Clone, Debug)]
pub struct Slot {
    pub footer: Footer,
    /// The JSON's bytes as stored (what the signature covers).
    pub meta_bytes: Vec<u8>,
    pub meta: Meta,
    /// DER; empty for a factory slot.
    pub signature: Vec<u8>,
}

impl Slot {
    pub fn meta_sha256(&self) -> String {
        hex::encode(self.footer.meta_sha256)
    }
}

/// Find and parse the trailer of the slot on `dev` (a partition or a file). `Ok(None)`: an
/// empty slot. Nothing in it is trusted yet: see the module's text.
pub fn read(dev: &Path) -> Result<Option<Slot>> {
    let what = dev.display();
    let mut f = std::fs::File::open(dev).with_context(|| format!("opening {what}"))?;
    let len = f
        .seek(SeekFrom::End(0))
        .with_context(|| format!("{what}: its size"))?;
    parse(&mut f, 0, len, &what.to_string())
}

/// [`read`] of the slot that is the `len` bytes at `start` of `image` (a partition of a whole
/// disk image or card, read in place: `cargo xtask report`).
pub fn read_in(image: &Path, start: u64, len: u64, what: &str) -> Result<Option<Slot>> {
    let mut f =
        std::fs::File::open(image).with_context(|| format!("opening {}", image.display()))?;
    parse(&mut f, start, len, what)
}

/// The trailer of the slot at `start..start + len` of `f`; `what` names it in errors.
fn parse(f: &mut std::fs::File, start: u64, len: u64, what: &str) -> Result<Option<Slot>> {
    ensure!(
        len >= FOOTER_LEN,
        "{what}: {len} bytes, too small for a models slot"
    );
    let mut read_at = |off: u64, buf: &mut [u8]| -> std::io::Result<()> {
        f.seek(SeekFrom::Start(start + off))?;
        f.read_exact(buf)
    };
    let mut b = vec![0u8; FOOTER_LEN as usize];
    read_at(len - FOOTER_LEN, &mut b).with_context(|| format!("{what}: its footer"))?;
    let Some(footer) = Footer::decode(&b, len).with_context(|| what.to_string())? else {
        return Ok(None);
    };
    let mut meta_bytes = vec![0u8; footer.meta_len as usize];
    read_at(footer.meta_off, &mut meta_bytes)
        .with_context(|| format!("{what}: the models metadata"))?;
    ensure!(
        Sha256::digest(&meta_bytes)[..] == footer.meta_sha256,
        "{what}: its kiln-models.json does not match the sha256 its footer gives"
    );
    let meta: Meta =
        serde_json::from_slice(&meta_bytes).with_context(|| format!("{what}: kiln-models.json"))?;
    let tree_end = meta
        .hash_tree_end()
        .with_context(|| format!("{what}: kiln-models.json"))?;
    let first = if footer.sig_len == 0 {
        footer.meta_off
    } else {
        footer.meta_off.min(footer.sig_off)
    };
    ensure!(
        tree_end <= first,
        "{what}: the trailer at {first} starts inside the verity hash tree (which ends at {tree_end})"
    );
    let mut signature = vec![0u8; footer.sig_len as usize];
    read_at(footer.sig_off, &mut signature)
        .with_context(|| format!("{what}: the models signature"))?;
    Ok(Some(Slot {
        footer,
        meta_bytes,
        meta,
        signature,
    }))
}

/// Where the trailer of `meta_len` + `sig_len` bytes goes in a slot of `slot_len` bytes whose
/// hash tree ends at `tree_end`: the metadata on the next 4 KiB boundary, the signature on the
/// one after it, the footer last. An error when it does not fit.
pub fn layout(tree_end: u64, meta: &[u8], sig_len: u64, slot_len: u64) -> Result<Footer> {
    let meta_off = tree_end.next_multiple_of(ALIGN);
    let sig_off = (meta_off + meta.len() as u64).next_multiple_of(ALIGN);
    let f = Footer {
        meta_off,
        meta_len: meta.len() as u64,
        sig_off,
        sig_len,
        meta_sha256: Sha256::digest(meta).into(),
    };
    let need = sig_off + sig_len + FOOTER_LEN;
    ensure!(
        need <= slot_len,
        "the models, their hash tree and trailer need {need} bytes; the slot has {slot_len}"
    );
    f.check(slot_len)?;
    Ok(f)
}

/// Write the trailer and footer into `out` (a slot of `slot_len` bytes whose erofs and hash tree
/// are already there).
pub fn write_trailer(
    out: &mut (impl Write + Seek),
    slot_len: u64,
    footer: &Footer,
    meta: &[u8],
    sig: &[u8],
) -> Result<()> {
    ensure!(
        meta.len() as u64 == footer.meta_len && sig.len() as u64 == footer.sig_len,
        "the trailer's parts are not the sizes its footer gives"
    );
    for (off, bytes) in [
        (footer.meta_off, meta),
        (footer.sig_off, sig),
        (slot_len - FOOTER_LEN, &footer.encode()[..]),
    ] {
        out.seek(SeekFrom::Start(off))?;
        out.write_all(bytes)?;
    }
    out.flush()?;
    Ok(())
}

/// Sign `meta` (detached CMS, DER) with `key` and `cert`, as `openssl cms -sign` does; what
/// `cargo xtask bundle --models` puts in the slot. Not reproducible bytes (ECDSA draws a nonce):
/// the factory slot, which must be, carries no signature.
pub fn sign(meta: &[u8], cert: &Path, key: &Path) -> Result<Vec<u8>> {
    let mut cmd = Command::new("openssl");
    cmd.args([
        "cms", "-sign", "-binary", "-outform", "DER", "-md", "sha256",
    ])
    .arg("-signer")
    .arg(cert)
    .arg("-inkey")
    .arg(key);
    run_openssl(cmd, meta)
        .with_context(|| format!("signing kiln-models.json with {}", cert.display()))
}

/// Whether `sig` is a valid signature of `meta` by a certificate `keyring` (CA certificates,
/// and CRLs, in PEM: the file RAUC is given) trusts and does not revoke. The CRL is checked
/// when the keyring holds one, as RAUC's `check-crl` does. The error carries openssl's reason
/// (e.g. "certificate revoked", "content verify error").
pub fn verify_signature(meta: &[u8], sig: &[u8], keyring: &Path) -> Result<()> {
    ensure!(!sig.is_empty(), "the models slot is not signed");
    let ring = std::fs::read_to_string(keyring)
        .with_context(|| format!("reading the update keyring {}", keyring.display()))?;
    let dir = private_dir()?;
    let content = dir.path.join("kiln-models.json");
    std::fs::write(&content, meta).with_context(|| format!("writing {}", content.display()))?;
    let mut cmd = Command::new("openssl");
    cmd.args([
        "cms", "-verify", "-binary", "-inform", "DER", "-purpose", "any",
    ])
    .arg("-content")
    .arg(&content)
    .arg("-CAfile")
    .arg(keyring)
    .args(["-out", "/dev/null"]);
    if ring.contains("-----BEGIN X509 CRL-----") {
        cmd.arg("-crl_check");
    }
    run_openssl(cmd, sig)
        .map(|_| ())
        .with_context(|| format!("the models signature against {}", keyring.display()))
}

/// A 0700 directory of this process's own under the temporary directory, removed on drop.
struct PrivateDir {
    path: std::path::PathBuf,
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn private_dir() -> Result<PrivateDir> {
    use std::os::unix::fs::DirBuilderExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "kiln-models-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    Ok(PrivateDir { path })
}

/// Run openssl with `input` on its standard input; its standard output, or an error with what
/// it said.
fn run_openssl(mut cmd: Command, input: &[u8]) -> Result<Vec<u8>> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running openssl (is it installed?)")?;
    let mut stdin = child.stdin.take().context("openssl's standard input")?;
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().context("waiting for openssl")?;
    let _ = writer.join();
    if !out.status.success() {
        let said = String::from_utf8_lossy(&out.stderr);
        let said: Vec<&str> = said.lines().filter(|l| !l.trim().is_empty()).collect();
        bail!("openssl {}: {}", out.status, said.join("; "));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests;
