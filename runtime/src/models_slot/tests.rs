//! The slot format against independent judges: `openssl cms` with kiln's development CA, its
//! CRL and a certificate it revokes; `veritysetup format` for where the hash tree ends.

use super::*;
use std::path::PathBuf;

fn keys() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/src/image/update-keys")
}

fn meta(data_blocks: u64) -> Meta {
    Meta {
        format: FORMAT,
        models: vec![Model {
            name: "m.gguf".into(),
            size: 12_288,
            sha256: "ab".repeat(32),
        }],
        verity: crate::verity::Params {
            version: 1,
            algorithm: "sha256".into(),
            data_block_size: 4096,
            hash_block_size: 4096,
            data_blocks,
            hash_start_block: data_blocks,
            salt: "00".repeat(32),
            root_hash: "11".repeat(32),
        },
        known_answers: serde_json::from_str(r#"{"known_nll": {"nll": 1.5}}"#).unwrap(),
    }
}

const SLOT: u64 = 64 << 10;

/// A 64 KiB slot: 3 data blocks of 0x5a, one tree block of 0x33, then the trailer of `m`
/// signed by `signer` (a `dev-…`/`revoked-…` pair of the key directory) or unsigned.
fn slot(m: &Meta, signer: Option<&str>) -> (tempfile::NamedTempFile, Footer, Vec<u8>) {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(SLOT).unwrap();
    f.write_all(&[0x5a; 3 * 4096]).unwrap();
    f.write_all(&[0x33; 4096]).unwrap();
    let bytes = serde_json::to_vec_pretty(m).unwrap();
    let sig = signer.map_or(Vec::new(), |who| {
        sign(
            &bytes,
            &keys().join(format!("{who}-cert.pem")),
            &keys().join(format!("{who}-key.pem")),
        )
        .expect("openssl signs")
    });
    let footer = layout(m.hash_tree_end().unwrap(), &bytes, sig.len() as u64, SLOT).unwrap();
    write_trailer(f.as_file_mut(), SLOT, &footer, &bytes, &sig).unwrap();
    (f, footer, bytes)
}

fn keyring() -> PathBuf {
    keys().join("dev-keyring.pem")
}

#[test]
fn a_signed_slot_reads_back_and_verifies() {
    let m = meta(3);
    let (f, footer, bytes) = slot(&m, Some("dev"));
    let s = read(f.path()).unwrap().expect("a slot");
    assert_eq!(s.meta, m);
    assert_eq!(s.footer, footer);
    assert_eq!(s.meta_bytes, bytes);
    assert_eq!(footer.meta_off, 4 * 4096, "right after the tree");
    assert_eq!(s.meta_sha256(), hex::encode(Sha256::digest(&bytes)));
    verify_signature(&s.meta_bytes, &s.signature, &keyring()).expect("the dev CA trusts it");
}

#[test]
fn an_empty_slot_holds_no_models() {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(SLOT).unwrap();
    assert!(read(f.path()).unwrap().is_none());
    let e = read(Path::new("/nonexistent/kiln-slot")).unwrap_err();
    assert!(format!("{e:#}").contains("/nonexistent/kiln-slot"), "{e:#}");
}

/// A changed byte of the JSON: the footer's sha256 refuses it; rewritten with a footer that
/// matches (anyone can), the signature refuses it. An unsigned slot is refused by name.
#[test]
fn changed_metadata_is_refused() {
    let m = meta(3);
    let (mut f, footer, bytes) = slot(&m, Some("dev"));
    let at = bytes.windows(3).position(|w| w == b"1.5").unwrap() as u64;
    f.as_file_mut()
        .seek(SeekFrom::Start(footer.meta_off + at))
        .unwrap();
    f.as_file_mut().write_all(b"0").unwrap();
    let e = format!("{:#}", read(f.path()).unwrap_err());
    assert!(e.contains("does not match the sha256"), "{e}");

    let mut forged = bytes.clone();
    forged[at as usize] = b'0';
    let again = Footer {
        meta_sha256: Sha256::digest(&forged).into(),
        ..footer
    };
    let sig = read_sig(f.path(), &footer);
    write_trailer(f.as_file_mut(), SLOT, &again, &forged, &sig).unwrap();
    let s = read(f.path()).unwrap().expect("parses");
    assert_eq!(s.meta.known_answers["known_nll"]["nll"], 0.5);
    let e = format!(
        "{:#}",
        verify_signature(&s.meta_bytes, &s.signature, &keyring()).unwrap_err()
    );
    assert!(e.contains("content verify error"), "openssl's reason: {e}");

    let (f, _, _) = slot(&m, None);
    let s = read(f.path()).unwrap().expect("parses");
    let e = format!(
        "{:#}",
        verify_signature(&s.meta_bytes, &s.signature, &keyring()).unwrap_err()
    );
    assert!(e.contains("not signed"), "{e}");
}

fn read_sig(p: &Path, footer: &Footer) -> Vec<u8> {
    let mut f = std::fs::File::open(p).unwrap();
    let mut b = vec![0; footer.sig_len as usize];
    f.seek(SeekFrom::Start(footer.sig_off)).unwrap();
    f.read_exact(&mut b).unwrap();
    b
}

/// Signed by the certificate the development CRL revokes, or by a key the CA never certified.
#[test]
fn a_revoked_or_foreign_signer_is_refused() {
    let m = meta(3);
    for (who, why) in [
        ("revoked", "certificate revoked"),
        ("other", "Verify error: self-signed certificate"),
    ] {
        let (f, _, _) = slot(&m, Some(who));
        let s = read(f.path()).unwrap().expect("parses");
        let e = format!(
            "{:#}",
            verify_signature(&s.meta_bytes, &s.signature, &keyring()).unwrap_err()
        );
        assert!(e.contains(why), "{who}: {e}");
    }
}

/// The footer's bounds, field by field.
#[test]
fn a_footer_pointing_anywhere_is_refused() {
    let good = Footer {
        meta_off: 16384,
        meta_len: 100,
        sig_off: 20480,
        sig_len: 500,
        meta_sha256: [7; 32],
    };
    assert_eq!(
        Footer::decode(&good.encode(), SLOT).unwrap(),
        Some(good),
        "round trip"
    );
    let end = SLOT - FOOTER_LEN;
    for (f, why) in [
        (
            Footer {
                meta_off: end - 99,
                ..good
            },
            "runs past",
        ),
        (
            Footer {
                meta_off: u64::MAX - 10,
                ..good
            },
            "runs past",
        ),
        (
            Footer {
                sig_off: end,
                ..good
            },
            "runs past",
        ),
        (
            Footer {
                meta_len: 0,
                ..good
            },
            "metadata is 0 bytes",
        ),
        (
            Footer {
                meta_len: MAX_META + 1,
                ..good
            },
            "1 to",
        ),
        (
            Footer {
                sig_len: MAX_SIG + 1,
                ..good
            },
            "at most",
        ),
        (
            Footer {
                sig_off: 16384 + 50,
                ..good
            },
            "overlap",
        ),
    ] {
        let e = format!("{:#}", Footer::decode(&f.encode(), SLOT).unwrap_err());
        assert!(e.contains(why), "{f:?}: {e}");
    }
    let e = format!("{:#}", Footer::decode(&good.encode(), 100).unwrap_err());
    assert!(e.contains("smaller than its footer"), "{e}");
    let mut b = good.encode();
    b[30] ^= 1;
    let e = format!("{:#}", Footer::decode(&b, SLOT).unwrap_err());
    assert!(e.contains("damaged"), "{e}");
    let mut b = good.encode();
    b[..16].copy_from_slice(b"EFI PART\0\0\0\0\0\0\0\0");
    let e = format!("{:#}", Footer::decode(&b, SLOT).unwrap_err());
    assert!(e.contains("not a kiln models slot"), "{e}");
    let mut b = good.encode();
    b[16] = 2;
    let sum = Sha256::digest(&b[..BODY]);
    b[BODY..BODY + 32].copy_from_slice(&sum);
    let e = format!("{:#}", Footer::decode(&b, SLOT).unwrap_err());
    assert!(e.contains("version 2"), "{e}");
}

/// Whatever the footer's fields, decoding returns, and what it accepts lies inside the slot.
#[test]
fn any_footer_decodes_or_is_refused_and_never_panics() {
    use proptest::prelude::*;
    proptest!(|(a in any::<u64>(), c in any::<u64>(), d in any::<u64>(),
                small in 0u64..70_000, slot_len in 0u64..(1 << 40))| {
        let f = Footer { meta_off: a % (1 << 41), meta_len: small, sig_off: c, sig_len: d % 70_000, meta_sha256: [0; 32] };
        if let Ok(Some(g)) = Footer::decode(&f.encode(), slot_len) {
            prop_assert!(g.meta_off + g.meta_len <= slot_len - FOOTER_LEN);
            prop_assert!(g.sig_off + g.sig_len <= slot_len - FOOTER_LEN);
        }
    });
}

/// A trailer that starts inside the hash tree its own parameters give is refused.
#[test]
fn a_trailer_inside_the_hash_tree_is_refused() {
    let m = meta(3);
    let (mut f, footer, bytes) = slot(&m, None);
    let lying = Footer {
        meta_off: 3 * 4096,
        ..footer
    };
    write_trailer(f.as_file_mut(), SLOT, &lying, &bytes, &[]).unwrap();
    let e = format!("{:#}", read(f.path()).unwrap_err());
    assert!(e.contains("inside the verity hash tree"), "{e}");
}

/// Where the hash tree ends, against `veritysetup format --no-superblock` (the tree xtask's
/// `disk::verity` writes has its layout): its hash file is the tree.
#[test]
fn the_hash_tree_ends_where_veritysetup_puts_it() {
    let dir = tempfile::tempdir().unwrap();
    for blocks in [2u64, 128, 129, 16_385] {
        let data = dir.path().join("data");
        let hash = dir.path().join("hash");
        std::fs::File::create(&data)
            .unwrap()
            .set_len(blocks * 4096)
            .unwrap();
        let _ = std::fs::remove_file(&hash);
        let out = Command::new("veritysetup")
            .args(["format", "--no-superblock"])
            .arg(&data)
            .arg(&hash)
            .output()
            .expect("veritysetup (cryptsetup-bin) runs");
        assert!(out.status.success(), "{out:?}");
        let tree = std::fs::metadata(&hash).unwrap().len();
        assert_eq!(
            meta(blocks).hash_tree_end().unwrap(),
            blocks * 4096 + tree,
            "{blocks} data blocks"
        );
    }
}

/// The empty footer a new image's `models_b` ends with reads as an empty slot; one flipped bit
/// in it is a damaged footer, not an empty slot.
#[test]
fn the_empty_footer_is_an_empty_slot() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(SLOT).unwrap();
    let empty = Footer::empty();
    assert_eq!(empty.len() as u64, FOOTER_LEN);
    assert!(empty.iter().any(|&b| b != 0), "not zeros: a bmap maps it");
    f.seek(SeekFrom::Start(SLOT - FOOTER_LEN)).unwrap();
    f.write_all(&empty).unwrap();
    assert!(read(f.path()).unwrap().is_none());
    let mut bad = empty.clone();
    bad[40] ^= 1;
    f.seek(SeekFrom::Start(SLOT - FOOTER_LEN)).unwrap();
    f.write_all(&bad).unwrap();
    let e = format!("{:#}", read(f.path()).unwrap_err());
    assert!(e.contains("damaged"), "{e}");
}

/// The one rule init's `kiln verity map` and the self-check apply (decision 3): the factory slot
/// the manifest names, or a slot signed by a key the keyring trusts (and not revoked) that
/// carries its own known answers, in a format this system reads. Everything else is refused,
/// naming why.
#[test]
fn trust_is_the_manifest_or_a_signature_with_answers() {
    use super::trust::{trust, Basis};
    let what = "/dev/vda5";
    let good = meta(3);
    // Signed by the development key, with answers: believed by its signature.
    let (f, _, _) = slot(&good, Some("dev"));
    let s = read(f.path()).unwrap().unwrap();
    let t = trust(s.clone(), Some(&"00".repeat(32)), &keyring(), what).unwrap();
    assert_eq!(t.basis, Basis::Signed(keyring()));
    assert!(t.has_answers());
    assert!(
        t.describe().contains("signed: its") && t.describe().contains("dev-keyring.pem"),
        "{}",
        t.describe()
    );
    // The same slot named by the manifest is the factory slot: no signature needed.
    let sha = s.meta_sha256();
    let t = trust(s, Some(&sha), Path::new("/nonexistent"), what).unwrap();
    assert_eq!(t.basis, Basis::Factory);
    // Unsigned and not named; signed by a revoked or foreign certificate; signed without
    // answers; a models format this system does not read.
    let (f, _, _) = slot(&good, None);
    let e = format!(
        "{:#}",
        trust(read(f.path()).unwrap().unwrap(), None, &keyring(), what).unwrap_err()
    );
    assert!(
        e.contains("is not signed and is not the factory slot this system's manifest names (none)"),
        "{e}"
    );
    for (who, why) in [
        ("revoked", "certificate revoked"),
        ("other", "self-signed certificate"),
    ] {
        let (f, _, _) = slot(&good, Some(who));
        let e = format!(
            "{:#}",
            trust(read(f.path()).unwrap().unwrap(), None, &keyring(), what).unwrap_err()
        );
        assert!(
            e.contains("its signature is refused") && e.contains(why),
            "{who}: {e}"
        );
    }
    let mut bare = meta(3);
    bare.known_answers.clear();
    let (f, _, _) = slot(&bare, Some("dev"));
    let e = format!(
        "{:#}",
        trust(read(f.path()).unwrap().unwrap(), None, &keyring(), what).unwrap_err()
    );
    assert!(e.contains("carries no known answers"), "{e}");
    let mut newer = meta(3);
    newer.format = FORMAT + 1;
    let (f, _, _) = slot(&newer, Some("dev"));
    let s = read(f.path()).unwrap().unwrap();
    let sha = s.meta_sha256();
    let e = format!("{:#}", trust(s, Some(&sha), &keyring(), what).unwrap_err());
    assert!(
        e.contains(&format!(
            "format {}; this system reads format {FORMAT}",
            FORMAT + 1
        )),
        "{e}"
    );
}
