//! Where the self-check finds the mapped models slot, and the known answers its `model.*` checks
//! compare with (decision 3 of `docs/models-slots.md`): a models bundle's slot carries its own,
//! signed with it; the factory slot's are in the manifest that names it. Never the manifest's
//! for models it does not name.

use super::{Ctx, Outcome, Paths};
use crate::models_slot::trust;
use std::path::{Path, PathBuf};

/// The models slot `/models` is mapped from.
pub struct MappedSlot {
    /// The kernel's name of the partition beneath the mapping (`vda5`).
    pub part: String,
    /// Its GPT name (`models_a`, `models_b`).
    pub partname: String,
    /// `major:minor` of the mapping and of the partition.
    pub dev: String,
    pub part_dev: String,
}

impl MappedSlot {
    /// `A` or `B`.
    pub fn letter(&self) -> String {
        self.partname.trim_start_matches("models_").to_uppercase()
    }
}

/// The folder the models are read from (`/models`).
pub fn models_dir(ctx: &Ctx) -> PathBuf {
    models_dir_in(&ctx.paths)
}

fn models_dir_in(paths: &Paths) -> PathBuf {
    paths
        .models
        .first()
        .cloned()
        .unwrap_or_else(|| paths.root.join("models"))
}

/// The models slot `models_dir` is mounted from through the dm-verity mapping
/// [`crate::verity::NAME`], found through the kernel (mountinfo, sysfs), or why not.
pub fn mapped_slot(paths: &Paths, models_dir: &Path) -> Result<MappedSlot, String> {
    use crate::verity;
    let mountinfo = paths.proc.join("self/mountinfo");
    let mnt = models_dir.display().to_string();
    let dev = verity::mounted_from(&mountinfo, &mnt)
        .ok_or_else(|| format!("{mnt} is not mounted (models partition not mapped?)"))?;
    let sys = |rel: String| std::fs::read_to_string(paths.sys.join(rel));
    let name = sys(format!("dev/block/{dev}/dm/name")).unwrap_or_default();
    if name.trim() != verity::NAME {
        return Err(format!(
            "{mnt} is mounted from {dev}, not from the dm-verity mapping {} (the models are \
             not proved)",
            verity::NAME
        ));
    }
    // The one device beneath the mapping must be one of the GPT partitions of the models slots.
    let slaves: Vec<String> = std::fs::read_dir(paths.sys.join(format!("dev/block/{dev}/slaves")))
        .map_err(|e| format!("{} beneath {dev}: {e}", verity::NAME))?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    let [part] = slaves.as_slice() else {
        return Err(format!(
            "{} maps {} devices ({slaves:?}), 1 expected",
            verity::NAME,
            slaves.len()
        ));
    };
    let uevent = sys(format!("class/block/{part}/uevent")).unwrap_or_default();
    let Some(partname) = uevent
        .lines()
        .filter_map(|l| l.strip_prefix("PARTNAME="))
        .find(|n| crate::models_slot::PARTITIONS.contains(n))
        .map(str::to_string)
    else {
        return Err(format!(
            "{} maps /dev/{part}, which is not a models slot (a partition named {})",
            verity::NAME,
            crate::models_slot::PARTITIONS.join(" or ")
        ));
    };
    let part_dev = sys(format!("class/block/{part}/dev"))
        .map_err(|e| format!("/dev/{part}: {e}"))?
        .trim()
        .to_string();
    Ok(MappedSlot {
        part: part.clone(),
        partname,
        dev,
        part_dev,
    })
}

/// The models slot `/models` is mapped from now (`A`/`B`) and the sha256 of its
/// `kiln-models.json` (`None` when its trailer cannot be read), or why none is.
pub fn mapped(paths: &Paths) -> Result<(crate::slot::Slot, Option<String>), String> {
    let ms = mapped_slot(paths, &models_dir_in(paths))?;
    let slot = crate::slot::Slot::parse(&ms.letter()).map_err(|e| format!("{e:#}"))?;
    let json = crate::models_slot::read(&paths.dev.join(&ms.part))
        .ok()
        .flatten()
        .map(|s| s.meta_sha256());
    Ok((slot, json))
}

pub use crate::models_slot::trust::View;

/// [`View`] of the slot on `/dev/{part}` for the booted system (`manifest`: its JSON) and its
/// update keyring.
pub fn view(ctx: &Ctx, manifest: &serde_json::Value, part: &str) -> Result<View, String> {
    let keyring = ctx.paths.root.join(trust::KEYRING.trim_start_matches('/'));
    trust::view(
        &ctx.paths.dev.join(part),
        trust::factory_sha(manifest),
        &keyring,
    )
}

/// The known answers the `model.*` checks compare with, and where they came from.
pub struct Known {
    /// The `known_answers` object (`nll`, `matmul`, …).
    pub answers: serde_json::Value,
    /// Where they came from, for the evidence and the errors.
    pub source: String,
}

/// The known answers for the models on `/models`: the mapped slot's own when it carries them
/// (a models bundle's, believed by its signature), the manifest's when the mapped slot is the
/// factory slot the manifest names. Without a board (a host run of the checks) or a manifest
/// without dm-verity, the manifest's. `Err` is the outcome to give.
pub fn answers(ctx: &Ctx) -> Result<Known, Outcome> {
    let path = ctx.paths.manifest();
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if ctx.board.is_none() => {
            return Err(Outcome::skip(format!(
                "no manifest {}: {e}",
                path.display()
            )))
        }
        Err(e) => {
            return Err(Outcome::fail(
                format!("manifest {} is missing or unreadable: {e}", path.display()),
                vec![],
            ))
        }
    };
    let m: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Outcome::fail(format!("{}: not JSON: {e}", path.display()), vec![]))?;
    let from_manifest = |why: &str| Known {
        answers: m["known_answers"].clone(),
        source: format!("{} ({why})", path.display()),
    };
    if ctx.board.is_none() || m.get("models_verity").is_none() {
        return Ok(from_manifest("no mapped models slot to take them from"));
    }
    let dir = models_dir(ctx);
    let slot = mapped_slot(&ctx.paths, &dir).map_err(|e| Outcome::fail(e, vec![]))?;
    let t = match view(ctx, &m, &slot.part) {
        Ok(View::Trusted(t)) => t,
        Ok(View::Damaged(why)) => {
            return Ok(from_manifest(&format!(
                "models slot {}'s own description is damaged ({why}): init mapped it with the \
                 manifest's models_verity, so the manifest's answers",
                slot.letter()
            )))
        }
        Err(e) => {
            return Err(Outcome::fail(
                format!("models slot {}: {e}", slot.letter()),
                vec![],
            ))
        }
    };
    if t.has_answers() {
        return Ok(Known {
            answers: serde_json::Value::Object(t.slot.meta.known_answers.clone()),
            source: format!(
                "models slot {}'s kiln-models.json (sha256 {}, {})",
                slot.letter(),
                &t.slot.meta_sha256()[..12],
                match t.basis {
                    trust::Basis::Factory => "named by the manifest",
                    trust::Basis::Signed(_) => "signed",
                }
            ),
        });
    }
    Ok(from_manifest(&format!(
        "models slot {} is the factory slot it names",
        slot.letter()
    )))
}

#[cfg(test)]
mod tests {
    use super::super::board::Board;
    use super::super::testutil::FakeRoot;
    use super::super::{Paths, Status};
    use super::*;
    use crate::models_slot as ms;

    fn keys() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/src/image/update-keys")
    }

    /// A 64 KiB slot whose JSON carries `answers`, signed by `signer` (a key pair of the key
    /// directory) or not; and its JSON's sha256.
    fn slot(answers: serde_json::Value, signer: Option<&str>) -> (Vec<u8>, String) {
        let meta = ms::Meta {
            format: ms::FORMAT,
            models: vec![],
            verity: crate::verity::Params {
                version: 1,
                algorithm: "sha256".into(),
                data_block_size: 4096,
                hash_block_size: 4096,
                data_blocks: 3,
                hash_start_block: 3,
                salt: "00".repeat(32),
                root_hash: "11".repeat(32),
            },
            known_answers: serde_json::from_value(answers).unwrap(),
        };
        let json = serde_json::to_vec(&meta).unwrap();
        let sig = signer.map_or(Vec::new(), |w| {
            ms::sign(
                &json,
                &keys().join(format!("{w}-cert.pem")),
                &keys().join(format!("{w}-key.pem")),
            )
            .unwrap()
        });
        let len = 64u64 << 10;
        let footer =
            ms::layout(meta.hash_tree_end().unwrap(), &json, sig.len() as u64, len).unwrap();
        let mut c = std::io::Cursor::new(vec![0u8; len as usize]);
        ms::write_trailer(&mut c, len, &footer, &json, &sig).unwrap();
        (c.into_inner(), hex::encode(footer.meta_sha256))
    }

    /// A board root whose /models is mapped from models_b (vda5), the manifest naming
    /// `factory` and recording `manifest_answers`.
    fn board(factory: &str, manifest_answers: serde_json::Value) -> (FakeRoot, Ctx) {
        let root = FakeRoot::new();
        root.file(
            "boot/kiln/manifest.json",
            serde_json::to_vec(&serde_json::json!({
                "models_verity": {},
                "models_slot": {"meta_sha256": factory},
                "known_answers": manifest_answers,
            }))
            .unwrap(),
        );
        root.map_models("vda5", 5, "models_b");
        root.file(
            "etc/rauc/keyring.pem",
            std::fs::read(keys().join("dev-keyring.pem")).unwrap(),
        );
        let ctx = Ctx {
            paths: Paths::under(&root),
            board: Some(Board::parse("[board]\nname = \"test\"\n").unwrap()),
            ..Ctx::default()
        };
        (root, ctx)
    }

    /// A bundle's slot is judged by its own answers, never the manifest's; the factory slot by
    /// the manifest's; a slot believed by neither gives no answers at all.
    #[test]
    fn answers_come_from_the_slot_that_is_mapped() {
        let mine = serde_json::json!({"nll": ["the bundle's"]});
        let theirs = serde_json::json!({"nll": ["the manifest's"]});
        // A signed bundle slot: its own answers, whatever the manifest says.
        let (bytes, sha) = slot(mine.clone(), Some("dev"));
        let (root, ctx) = board(&"00".repeat(32), theirs.clone());
        assert_eq!(
            mapped(&ctx.paths),
            Ok((crate::slot::Slot::B, None)),
            "no trailer yet"
        );
        root.file("dev/vda5", &bytes);
        // What the report's `slot.models_slot`/`models_json` record for the fleet client.
        assert_eq!(mapped(&ctx.paths), Ok((crate::slot::Slot::B, Some(sha))));
        let k = answers(&ctx).map_err(|o| format!("{o:?}")).unwrap();
        assert_eq!(k.answers, mine);
        assert!(
            k.source.starts_with("models slot B's kiln-models.json")
                && k.source.ends_with("signed)"),
            "{}",
            k.source
        );
        // The factory slot (no answers of its own, named by the manifest): the manifest's.
        let (bytes, sha) = slot(serde_json::json!({}), None);
        let (root, ctx) = board(&sha, theirs.clone());
        root.file("dev/vda5", &bytes);
        let k = answers(&ctx).map_err(|o| format!("{o:?}")).unwrap();
        assert_eq!(k.answers, theirs);
        assert!(
            k.source.contains("is the factory slot it names"),
            "{}",
            k.source
        );
        // A damaged description: init mapped it with the manifest's parameters; the manifest's
        // answers (image.manifest FAILs on the damage).
        let (mut bytes, sha) = slot(serde_json::json!({}), None);
        let n = bytes.len();
        let f = ms::Footer::decode(&bytes[n - 4096..], n as u64)
            .unwrap()
            .unwrap();
        bytes[(f.meta_off + f.meta_len / 2) as usize] ^= 1;
        let (root, ctx) = board(&sha, theirs.clone());
        root.file("dev/vda5", &bytes);
        let k = answers(&ctx).map_err(|o| format!("{o:?}")).unwrap();
        assert_eq!(k.answers, theirs);
        assert!(
            k.source.contains("own description is damaged"),
            "{}",
            k.source
        );
        // Signed by a foreign key, or unsigned and not named: FAIL naming the slot.
        for (signer, why) in [
            (Some("other"), "its signature is refused"),
            (None, "is not signed and is not the factory slot"),
        ] {
            let (bytes, _) = slot(mine.clone(), signer);
            let (root, ctx) = board(&"00".repeat(32), theirs.clone());
            root.file("dev/vda5", &bytes);
            let o = answers(&ctx).err().expect("refused");
            assert_eq!(o.status, Status::Fail);
            let r = o.reason.unwrap();
            assert!(r.starts_with("models slot B: ") && r.contains(why), "{r}");
        }
    }
}
