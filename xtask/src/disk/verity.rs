//! dm-verity's hash tree, appended to a read-only filesystem image (the models partition), so the
//! board's kernel checks every block against one root hash as it is read instead of the
//! self-check hashing whole files at boot.
//!
//! Format version 1 without a superblock, as `veritysetup format --no-superblock` writes it and
//! the kernel's `verity` target reads it (Documentation/admin-guide/device-mapper/verity.rst):
//! 4 KiB data and hash blocks, sha256, every hash `sha256(salt ‖ block)`; level 0 holds one hash
//! per data block, each next level one per block of the level below, 128 to a block, zero
//! padded; on disk the top level comes first. The tree starts right after the data, so one
//! partition carries both (`hash_start_block` = `data_blocks`).
//!
//! Written here rather than by `veritysetup` because the image pipeline (and a models bundle)
//! must know the tree's parameters to put them in the signed manifest, and the format is a few
//! dozen lines; `veritysetup verify` and the board's kernel are the independent judges of it
//! (the tests and every boot).

use anyhow::{ensure, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// Data and hash block size, bytes.
pub const BLOCK: u64 = 4096;
const HASH: usize = 32;
const PER_BLOCK: u64 = BLOCK / HASH as u64;

/// What the board needs to map the partition: the manifest's `models_verity`, as the board's
/// `kiln verity map` reads it.
pub use kiln_runtime::verity::Params as Verity;

fn hash(salt: &[u8], block: &[u8]) -> [u8; HASH] {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(block);
    h.finalize().into()
}

/// Pack hashes into zero-padded blocks.
fn pack(hashes: &[[u8; HASH]]) -> Vec<u8> {
    let blocks = (hashes.len() as u64).div_ceil(PER_BLOCK);
    let mut out = vec![0u8; (blocks * BLOCK) as usize];
    for (i, h) in hashes.iter().enumerate() {
        out[i * HASH..(i + 1) * HASH].copy_from_slice(h);
    }
    out
}

/// Pad the image at `path` with zeros to whole blocks, append its hash tree (salt `salt`) and
/// return the parameters. The file is changed in place: call it on a step's temporary output.
pub fn append(path: &Path, salt: &[u8; 32]) -> Result<Verity> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {} for its verity tree", path.display()))?;
    let len = f.metadata()?.len();
    let data_blocks = len.div_ceil(BLOCK);
    // The kernel takes one data block's hash as the root itself (no tree); never the case for a
    // filesystem image, so not written.
    ensure!(
        data_blocks >= 2,
        "{} is {len} bytes: too small for a verity tree",
        path.display()
    );
    f.set_len(data_blocks * BLOCK)?;
    f.seek(SeekFrom::Start(0))?;
    let mut level: Vec<[u8; HASH]> = Vec::with_capacity(data_blocks as usize);
    let mut buf = vec![0u8; BLOCK as usize];
    let mut r = std::io::BufReader::with_capacity(1 << 20, &mut f);
    for _ in 0..data_blocks {
        r.read_exact(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        level.push(hash(salt, &buf));
    }
    drop(r);
    // Levels bottom-up until one block; the root is the hash of that block.
    let mut levels: Vec<Vec<u8>> = Vec::new();
    loop {
        let packed = pack(&level);
        let top = packed.len() as u64 == BLOCK;
        level = packed
            .chunks(BLOCK as usize)
            .map(|b| hash(salt, b))
            .collect();
        levels.push(packed);
        if top {
            break;
        }
    }
    let root = level[0];
    f.seek(SeekFrom::Start(data_blocks * BLOCK))?;
    let mut w = std::io::BufWriter::new(&mut f);
    for l in levels.iter().rev() {
        w.write_all(l)?;
    }
    w.flush()
        .with_context(|| format!("writing the verity tree of {}", path.display()))?;
    drop(w);
    f.sync_all()?;
    Ok(Verity {
        version: 1,
        algorithm: "sha256".into(),
        data_block_size: BLOCK,
        hash_block_size: BLOCK,
        data_blocks,
        hash_start_block: data_blocks,
        salt: hex::encode(salt),
        root_hash: hex::encode(root),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn verify(file: &Path, v: &Verity, root: &str) -> std::process::Output {
        Command::new("veritysetup")
            .arg("verify")
            .arg("--no-superblock")
            .arg(format!("--hash-offset={}", v.hash_start_block * BLOCK))
            .arg(format!("--data-blocks={}", v.data_blocks))
            .arg(format!("--salt={}", v.salt))
            .args([file, file])
            .arg(root)
            .output()
            .expect("veritysetup (cryptsetup-bin) runs: `cargo xtask doctor`")
    }

    /// `veritysetup verify` accepts the tree for sizes of one, two and three levels, and the
    /// root hash is the one `veritysetup format` computes with the same salt; a flipped data
    /// byte is refused (the judge is not blind).
    #[test]
    fn veritysetup_accepts_the_tree() {
        crate::doctor::ensure(&[&crate::doctor::VERITYSETUP]).expect("veritysetup");
        let dir = tempfile::tempdir().unwrap();
        let salt = [7u8; 32];
        let mut two_levels = None;
        // 3 blocks; 129 blocks (2 levels, the second partial); 16 385 (3 levels), the last
        // one partial.
        for (n, bytes) in [
            (3u64, 3 * 4096 - 100),
            (129, 129 * 4096),
            (16_385, 16_385 * 4096),
        ] {
            let p = dir.path().join(format!("fs{n}"));
            let data: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
            std::fs::write(&p, &data).unwrap();
            let v = append(&p, &salt).unwrap();
            assert_eq!(v.data_blocks, n);
            let out = verify(&p, &v, &v.root_hash);
            assert!(
                out.status.success(),
                "{n} blocks: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            // The same data formatted by veritysetup: the same root hash.
            let d = dir.path().join(format!("data{n}"));
            let h = dir.path().join(format!("hash{n}"));
            let mut padded = data.clone();
            padded.resize((n * BLOCK) as usize, 0);
            std::fs::write(&d, &padded).unwrap();
            let out = Command::new("veritysetup")
                .args(["format", "--no-superblock"])
                .arg(format!("--salt={}", v.salt))
                .args([&d, &h])
                .output()
                .unwrap();
            assert!(out.status.success());
            let text = String::from_utf8_lossy(&out.stdout);
            let theirs = text
                .lines()
                .find_map(|l| l.strip_prefix("Root hash:"))
                .expect("veritysetup prints the root hash")
                .trim();
            assert_eq!(theirs, v.root_hash, "{n} blocks");
            // Their tree is ours, byte for byte.
            let ours = std::fs::read(&p).unwrap();
            assert_eq!(
                &ours[(n * BLOCK) as usize..],
                &std::fs::read(&h).unwrap()[..],
                "{n} blocks"
            );
            if n == 129 {
                two_levels = Some((p, v));
            }
        }
        // One flipped byte in the data of the two-level one: refused.
        let (p, v) = two_levels.expect("the 129-block case ran");
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[5000] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let out = verify(&p, &v, &v.root_hash);
        assert!(!out.status.success(), "a flipped byte passed veritysetup");
    }

    #[test]
    fn too_small_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("one");
        std::fs::write(&p, [1u8; 10]).unwrap();
        let e = append(&p, &[0; 32]).unwrap_err();
        assert!(format!("{e:#}").contains("too small"), "{e:#}");
    }
}
