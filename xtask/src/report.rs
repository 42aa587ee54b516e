//! `cargo xtask report IMAGE_OR_DEVICE [--json]`: the self-check report a board wrote to its boot
//! slot, read back on a laptop, with the A/B state (`BOOT_ORDER`, the counters) of `bootctl`.
//! GPT and FAT are parsed in-process and the image or device is only ever opened read-only, so
//! a card can be inspected without mounting it.
//!
//! Each slot (`boot_a`, `boot_b`) keeps the report of its own last boot. The one shown is the
//! report of the slot the board runs now: the first slot of `BOOT_ORDER` that has a report, else
//! any slot with one (A first). The other slot's verdict is listed under it.

use crate::disk::{fat, gpt};
use anyhow::{bail, Context, Result};
use kiln_runtime::selftest::report::{Report, Verdict};
use std::io::Write as _;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// An image file (target/images/kiln-<board>.img) or a block device (/dev/sdX).
    pub image: PathBuf,
    /// Print the report's JSON as stored instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Where the report lives on the boot partition.
pub const REPORT_PATH: &str = "kiln/report.json";

/// Where the A/B counters live on `bootctl`.
pub const ABSTATE_PATH: &str = "kiln/abstate.env";

/// The boot slots of the image: `(A, boot_a)`, `(B, boot_b)`; an image from before the A/B
/// layout has one partition `boot` (given as slot `-`).
pub fn slots(image: &Path) -> Result<Vec<(&'static str, gpt::PartitionEntryInfo)>> {
    let parts =
        gpt::read(image).with_context(|| format!("reading the GPT of {}", image.display()))?;
    let mut out = Vec::new();
    for (slot, name) in [("A", "boot_a"), ("B", "boot_b")] {
        if let Some(p) = parts.iter().find(|p| p.name == name) {
            out.push((slot, p.clone()));
        }
    }
    if out.is_empty() {
        if let Some(p) = parts.iter().find(|p| p.name == "boot") {
            out.push(("-", p.clone()));
        }
    }
    if out.is_empty() {
        bail!(
            "{} has no boot slot (no boot_a, boot_b or boot partition)",
            image.display()
        );
    }
    Ok(out)
}

/// The A/B counters on `bootctl`: None when the image has no `bootctl`, an error when the file
/// is missing or damaged (U-Boot then boots with RAUC's defaults).
pub fn ab_state(image: &Path) -> Option<Result<kiln_runtime::slot::State>> {
    let parts = gpt::read(image).ok()?;
    let ctl = parts.iter().find(|p| p.name == "bootctl")?;
    Some(
        fat::read_file(image, ctl.start_bytes(), ctl.size_bytes(), ABSTATE_PATH)
            .and_then(|b| kiln_runtime::slot::State::decode(&b, "bootctl's kiln/abstate.env")),
    )
}

/// The boot slot whose report is shown: the first of `BOOT_ORDER` that has a report, else the
/// first slot with a report, else the first slot.
pub fn boot_partition(image: &Path) -> Result<gpt::PartitionEntryInfo> {
    Ok(current_slot(image)?.1)
}

/// [`boot_partition`] with its slot name.
pub fn current_slot(image: &Path) -> Result<(&'static str, gpt::PartitionEntryInfo)> {
    let slots = slots(image)?;
    let has_report = |p: &gpt::PartitionEntryInfo| {
        fat::read_file(image, p.start_bytes(), p.size_bytes(), REPORT_PATH).is_ok()
    };
    let order: Vec<&'static str> = match ab_state(image) {
        Some(Ok(st)) => st
            .order()
            .unwrap_or_default()
            .iter()
            .map(|s| s.name())
            .collect(),
        _ => Vec::new(),
    };
    let first_in_order = order
        .iter()
        .find_map(|o| slots.iter().find(|(s, p)| s == o && has_report(p)));
    let pick = first_in_order
        .or_else(|| slots.iter().find(|(_, p)| has_report(p)))
        .unwrap_or(&slots[0]);
    Ok(pick.clone())
}

/// The lines that tell the A/B state: `BOOT_ORDER`, each slot's tries left and good or bad, and
/// the verdict of each slot's last report.
pub fn ab_lines(image: &Path) -> Vec<String> {
    let mut out = Vec::new();
    match ab_state(image) {
        None => return out,
        Some(Err(e)) => out.push(format!(
            "bootctl: {e:#} (U-Boot boots with RAUC's defaults: A B, 3 tries each)"
        )),
        Some(Ok(st)) => {
            let order = st.env().get("BOOT_ORDER").unwrap_or("").to_string();
            let mut l = format!("bootctl: BOOT_ORDER '{order}'");
            let mut any_good = false;
            for s in kiln_runtime::slot::Slot::ALL {
                let left = st.left(s).unwrap_or(0);
                let good = st.is_good(s).unwrap_or(false);
                any_good |= good;
                l.push_str(&format!(
                    ", {} {left} left ({})",
                    s.name(),
                    if good { "good" } else { "bad" }
                ));
            }
            if let Some(g) = st.env().get("KILN_LAST_GOOD") {
                l.push_str(&format!(", last marked good {g}"));
            }
            out.push(l);
            if !any_good {
                out.push("bootctl: NO GOOD SLOT: U-Boot boots the slot last marked good (or A) without counting".into());
            }
        }
    }
    let current = current_slot(image).ok().map(|(s, _)| s);
    for (slot, p) in slots(image).unwrap_or_default() {
        let what = match fat::read_file(image, p.start_bytes(), p.size_bytes(), REPORT_PATH)
            .ok()
            .and_then(|b| serde_json::from_slice::<Report>(&b).ok())
        {
            Some(r) => format!("last report {}", r.verdict.word()),
            None => "no report (not booted since written)".into(),
        };
        out.push(format!(
            "slot {slot} ({}): {what}{}",
            p.name,
            if Some(slot) == current {
                " <- shown above"
            } else {
                ""
            }
        ));
    }
    out
}

/// The lines that tell the models slots (issue 38): the counters in `bootctl` and the slot init
/// maps next, then each models slot's own description read from its trailer in place — its
/// `kiln-models.json` (sha256, format, models, verity root), which boot slot's manifest names it
/// (the factory slot) and whether it carries a signature — or that it is empty.
pub fn models_lines(image: &Path) -> Vec<String> {
    use kiln_runtime::slot::{Class, Slot};
    let Ok(parts) = gpt::read(image) else {
        return Vec::new();
    };
    let pair: Vec<(Slot, &gpt::PartitionEntryInfo)> = Slot::ALL
        .into_iter()
        .zip(kiln_runtime::models_slot::PARTITIONS)
        .filter_map(|(s, name)| parts.iter().find(|p| p.name == name).map(|p| (s, p)))
        .collect();
    if pair.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    if let Some(Ok(st)) = ab_state(image) {
        let next = st
            .primary_of(Class::Models)
            .ok()
            .flatten()
            .map_or("A (the factory slot: none has tries left)", |s| s.name());
        out.push(format!(
            "models: {}; init maps {next} next",
            st.describe_of(Class::Models)
        ));
    }
    // Which boot slot's manifest names which models slot JSON (the factory slot it vouches for).
    let named: Vec<(&str, String)> = slots(image)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(slot, p)| {
            let m = fat::read_file(image, p.start_bytes(), p.size_bytes(), MANIFEST_PATH).ok()?;
            let v: serde_json::Value = serde_json::from_slice(&m).ok()?;
            Some((slot, v["models_slot"]["meta_sha256"].as_str()?.to_string()))
        })
        .collect();
    for (s, p) in pair {
        let what = format!("models slot {} ({})", s.name(), p.name);
        let desc = match kiln_runtime::models_slot::read_in(
            image,
            p.start_bytes(),
            p.size_bytes(),
            &p.name,
        ) {
            Err(e) => format!("unreadable: {e:#}"),
            Ok(None) => "empty (no kiln-models.json: never written)".into(),
            Ok(Some(slot)) => {
                let sha = slot.meta_sha256();
                let by: Vec<&str> = named
                    .iter()
                    .filter(|(_, n)| *n == sha)
                    .map(|(b, _)| *b)
                    .collect();
                // The names are the card's bytes: escaped, so a hostile one cannot drive the
                // terminal.
                let names: Vec<String> = slot
                    .meta
                    .models
                    .iter()
                    .map(|m| m.name.escape_debug().to_string())
                    .collect();
                format!(
                    "kiln-models.json {}, format {}, {} model(s) ({}), verity root {}; {}; {}",
                    &sha[..12],
                    slot.meta.format,
                    names.len(),
                    names.join(", "),
                    slot.meta
                        .verity
                        .root_hash
                        .chars()
                        .take(12)
                        .collect::<String>()
                        .escape_debug(),
                    if by.is_empty() {
                        "named by no boot slot's manifest".to_string()
                    } else {
                        format!("the factory models of boot slot {}", by.join(" and "))
                    },
                    if slot.signature.is_empty() {
                        "unsigned".to_string()
                    } else {
                        format!("signed ({}-byte CMS signature)", slot.signature.len())
                    }
                )
            }
        };
        out.push(format!("{what}: {desc}"));
    }
    out
}

/// The raw bytes of `kiln/report.json` and the report parsed from them.
pub fn read_report(image: &Path) -> Result<(Vec<u8>, Report)> {
    let boot = boot_partition(image)?;
    let bytes = fat::read_file(image, boot.start_bytes(), boot.size_bytes(), REPORT_PATH)
        .with_context(|| {
            format!(
                "no self-check report on a boot slot of {} (has this image booted?)",
                image.display()
            )
        })?;
    let report: Report = serde_json::from_slice(&bytes)
        .with_context(|| format!("{REPORT_PATH} on {} is not a kiln report", image.display()))?;
    Ok((bytes, report))
}

/// The check ids the board requires, from `kiln/manifest.json` on the same boot partition (the
/// recipe's `[expect] checks`, as the build recorded it). No manifest: none can be required.
pub fn required_checks(image: &Path) -> Result<Vec<String>> {
    let boot = boot_partition(image)?;
    let Ok(bytes) = fat::read_file(image, boot.start_bytes(), boot.size_bytes(), MANIFEST_PATH)
    else {
        return Ok(Vec::new());
    };
    let m: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{MANIFEST_PATH} on {} is not JSON", image.display()))?;
    Ok(m["expect"]["expect"]["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect())
}

pub const MANIFEST_PATH: &str = "kiln/manifest.json";

/// The lines that match the report's `manifest=` with the files a user flashed: the hash the
/// report names, whether the card's own `kiln/manifest.json` still hashes to it, and which built
/// image in `images_dir` has that manifest (its `kiln-<board>.manifest.sha256` sidecar) with
/// that image's sha256 (`kiln-<board>.img.sha256`).
pub fn manifest_lines(image: &Path, report: &Report, images_dir: &Path) -> Vec<String> {
    let Some(named) = report.manifest.as_deref() else {
        return vec!["manifest=none (the board found no kiln/manifest.json)".into()];
    };
    let mut out = vec![format!("manifest={named}")];
    let on_card = boot_partition(image)
        .ok()
        .and_then(|b| fat::read_file(image, b.start_bytes(), b.size_bytes(), MANIFEST_PATH).ok());
    out.push(match on_card {
        None => format!("  {MANIFEST_PATH} is not on this boot partition now"),
        Some(m) => {
            let now = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&m));
            if now == named {
                format!("  {MANIFEST_PATH} on this boot partition hashes to the same")
            } else {
                format!("  {MANIFEST_PATH} on this boot partition now hashes to {now} (changed since the boot)")
            }
        }
    });
    let mut matched = false;
    let mut sidecars: Vec<PathBuf> = std::fs::read_dir(images_dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".manifest.sha256"))
        .collect();
    sidecars.sort();
    for side in sidecars {
        let first = |p: &Path| {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|t| t.split_whitespace().next().map(str::to_string))
        };
        if first(&side).as_deref() != Some(named) {
            continue;
        }
        matched = true;
        let img = side.with_extension("").with_extension("img");
        let sha = first(&img.with_extension("img.sha256"));
        out.push(format!(
            "  = the manifest of {} (image sha256 {})",
            img.display(),
            sha.as_deref()
                .unwrap_or("unknown: no .img.sha256 beside it")
        ));
    }
    if !matched {
        out.push(format!(
            "  no image in {} has this manifest (no *.manifest.sha256 there names it)",
            images_dir.display()
        ));
    }
    out
}

pub fn run(args: Args) -> Result<()> {
    let (bytes, report) = read_report(&args.image)?;
    let required = required_checks(&args.image)?;
    let mut text = if args.json {
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        report.to_text()
    };
    if !text.ends_with('\n') {
        text.push('\n');
    }
    if !args.json {
        let images = crate::paths::target_dir().join("images");
        for l in manifest_lines(&args.image, &report, &images)
            .into_iter()
            .chain(ab_lines(&args.image))
            .chain(models_lines(&args.image))
        {
            text.push_str(&l);
            text.push('\n');
        }
    }
    // `cargo xtask report … | head` closes the pipe early: not an error worth a panic.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.context("writing the report to stdout")?,
    }
    // The verdict is recounted from the checks, never taken from the stored field.
    let (verdict, why) = report.recount(&required);
    if verdict != report.verdict {
        bail!(
            "the report on {} says {:?} but its checks say {verdict:?}: {}",
            args.image.display(),
            report.verdict,
            why.join("; ")
        );
    }
    if verdict == Verdict::Fail {
        bail!(
            "the self-check on {} FAILED: {}",
            args.image.display(),
            why.join("; ")
        );
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::disk::guid_from_seed;
    use kiln_runtime::selftest::{CheckResult, Ctx, Outcome, Paths};

    /// A GPT disk whose FAT boot partition holds `files`, built with kiln's own writers; the
    /// reader side is the same in-process code, so the FAT is also checked with `fsck.vfat` by
    /// the disk tests, not here.
    pub(crate) fn disk_with(dir: &Path, files: &[(String, Vec<u8>)]) -> PathBuf {
        let fat = dir.join("boot.vfat");
        let size = 8 * 1024 * 1024;
        fat::build(&fat, size, 0x1234_5678, "BOOT", files, 1_700_000_000).unwrap();
        let img = dir.join("disk.img");
        let spec = gpt::PartitionSpec {
            name: "boot".into(),
            type_guid: gpt::types::efi_system(),
            unique_guid: guid_from_seed("test", "boot"),
            first_lba: 2048,
            size_bytes: size,
            attributes: 0,
        };
        gpt::assemble(
            &img,
            16 * 1024 * 1024,
            guid_from_seed("test", "disk"),
            &[(spec, fat)],
            &[],
        )
        .unwrap();
        img
    }

    fn report(fail: bool) -> Report {
        let mut checks = vec![CheckResult::new(
            "kernel.release",
            Outcome::pass(vec!["uname -r = 6.1.192-kiln".into()]),
            0.1,
        )];
        if fail {
            checks.push(CheckResult::new(
                "matmul.npu.f16",
                Outcome::fail("stale", vec![]),
                3.0,
            ));
        }
        Report::new(
            &Ctx {
                paths: Paths::under(Path::new("/nonexistent")),
                ..Ctx::default()
            },
            checks,
        )
    }

    /// A disk in the A/B layout: bootctl with `state`, boot_a and boot_b with their files.
    fn ab_disk(
        dir: &Path,
        state: &kiln_runtime::slot::State,
        a: &[(String, Vec<u8>)],
        b: &[(String, Vec<u8>)],
    ) -> PathBuf {
        let size = 8 * 1024 * 1024;
        let mut parts = Vec::new();
        let ctl_files = [("kiln/abstate.env".to_string(), state.encode().unwrap())];
        for (i, (name, files)) in [("bootctl", &ctl_files[..]), ("boot_a", a), ("boot_b", b)]
            .into_iter()
            .enumerate()
        {
            let fat = dir.join(format!("{name}.vfat"));
            fat::build(&fat, size, 0x1234_5678, "BOOT", files, 1_700_000_000).unwrap();
            let spec = gpt::PartitionSpec {
                name: name.into(),
                type_guid: gpt::types::basic_data(),
                unique_guid: guid_from_seed("test", name),
                first_lba: 2048 + i as u64 * (size / 512),
                size_bytes: size,
                attributes: 0,
            };
            parts.push((spec, fat));
        }
        let img = dir.join("ab.img");
        gpt::assemble(
            &img,
            32 * 1024 * 1024,
            guid_from_seed("test", "disk"),
            &parts,
            &[],
        )
        .unwrap();
        img
    }

    #[test]
    fn the_report_shown_is_the_first_slot_of_boot_order_with_one() {
        use kiln_runtime::slot::{Slot, State};
        let dir = tempfile::tempdir().unwrap();
        let rep = |fail: bool| {
            vec![(
                REPORT_PATH.to_string(),
                serde_json::to_vec(&report(fail)).unwrap(),
            )]
        };
        let mut st = State::initial();
        st.mark_active(Slot::B).unwrap();
        // B first in BOOT_ORDER, but only A has booted: A's report.
        let img = ab_disk(dir.path(), &st, &rep(false), &[]);
        assert_eq!(current_slot(&img).unwrap().0, "A");
        let lines = ab_lines(&img).join("\n");
        assert!(
            lines.contains("BOOT_ORDER 'B A', A 3 left (good), B 3 left (good)"),
            "{lines}"
        );
        assert!(lines.contains("slot B (boot_b): no report"), "{lines}");
        // Both booted: B's (the FAIL), as B is first.
        let img = ab_disk(dir.path(), &st, &rep(false), &rep(true));
        assert_eq!(current_slot(&img).unwrap().0, "B");
        assert_eq!(read_report(&img).unwrap().1.verdict, Verdict::Fail);
        // B marked bad: A's again; neither good: said.
        st.mark_bad(Slot::B).unwrap();
        let img = ab_disk(dir.path(), &st, &rep(false), &rep(true));
        assert_eq!(current_slot(&img).unwrap().0, "A");
        st.mark_bad(Slot::A).unwrap();
        let img = ab_disk(dir.path(), &st, &rep(false), &rep(true));
        assert!(ab_lines(&img).join("\n").contains("NO GOOD SLOT"));
    }

    #[test]
    fn reads_the_report_back_from_the_boot_partition() {
        let dir = tempfile::tempdir().unwrap();
        let r = report(false);
        let img = disk_with(
            dir.path(),
            &[(REPORT_PATH.into(), r.to_json_pretty().into_bytes())],
        );
        let (bytes, back) = read_report(&img).unwrap();
        assert_eq!(back, r);
        assert_eq!(bytes, r.to_json_pretty().into_bytes());
        run(Args {
            image: img,
            json: false,
        })
        .unwrap();
    }

    #[test]
    fn a_failed_verdict_or_no_report_exits_non_zero() {
        let dir = tempfile::tempdir().unwrap();
        let r = report(true);
        let img = disk_with(
            dir.path(),
            &[(REPORT_PATH.into(), r.to_json_pretty().into_bytes())],
        );
        let e = run(Args {
            image: img,
            json: true,
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("matmul.npu.f16"), "{e:#}");
        // A report whose stored verdict was edited to PASS is recounted: FAIL.
        let mut edited = report(true);
        edited.verdict = Verdict::Pass;
        let dir2 = tempfile::tempdir().unwrap();
        let img = disk_with(
            dir2.path(),
            &[(REPORT_PATH.into(), edited.to_json_pretty().into_bytes())],
        );
        let e = run(Args {
            image: img,
            json: false,
        })
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("says Pass but its checks say Fail"),
            "{e:#}"
        );
        let other = tempfile::tempdir().unwrap();
        let img = disk_with(other.path(), &[("hello.txt".into(), b"hi".to_vec())]);
        let e = read_report(&img).unwrap_err();
        assert!(format!("{e:#}").contains("no self-check report"), "{e:#}");
    }

    /// The report's `manifest=` is matched with the sidecar of the image it came from, and a
    /// card whose manifest changed since the boot says so.
    #[test]
    fn the_manifest_hash_is_matched_with_the_built_image() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = b"{\"board\": \"qemu-virt\"}\n".to_vec();
        // sha256sum of the bytes above, computed with the tool, not with our code.
        let sh = xshell::Shell::new().unwrap();
        let m = dir.path().join("m.json");
        std::fs::write(&m, &manifest).unwrap();
        let sum = xshell::cmd!(sh, "sha256sum {m}").read().unwrap();
        let sum = sum.split_whitespace().next().unwrap().to_string();
        let mut r = report(false);
        r.manifest = Some(sum.clone());
        let card = tempfile::tempdir().unwrap();
        let img = disk_with(
            card.path(),
            &[
                (REPORT_PATH.into(), r.to_json_pretty().into_bytes()),
                (MANIFEST_PATH.into(), manifest.clone()),
            ],
        );
        let images = dir.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::write(
            images.join("kiln-qemu-virt.manifest.sha256"),
            format!("{sum}  kiln/manifest.json\n"),
        )
        .unwrap();
        std::fs::write(
            images.join("kiln-qemu-virt.img.sha256"),
            "abc123  kiln-qemu-virt.img\n",
        )
        .unwrap();
        std::fs::write(
            images.join("kiln-rock-5b.manifest.sha256"),
            format!("{}  kiln/manifest.json\n", "0".repeat(64)),
        )
        .unwrap();
        let lines = manifest_lines(&img, &r, &images);
        assert_eq!(lines[0], format!("manifest={sum}"));
        assert!(lines[1].contains("hashes to the same"), "{lines:?}");
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[2].contains("kiln-qemu-virt.img (image sha256 abc123)"),
            "{lines:?}"
        );
        // Another hash: no image matches; the card's manifest differs from the report's.
        r.manifest = Some("f".repeat(64));
        let lines = manifest_lines(&img, &r, &images);
        assert!(
            lines[1].contains(&format!("now hashes to {sum}")),
            "{lines:?}"
        );
        assert!(lines[2].contains("no image in"), "{lines:?}");
    }

    #[test]
    fn a_required_check_missing_from_a_report_fails() {
        let dir = tempfile::tempdir().unwrap();
        let r = report(false);
        let manifest = serde_json::json!({"expect": {"expect": {"checks": ["kernel.release", "image.manifest"]}}});
        let img = disk_with(
            dir.path(),
            &[
                (REPORT_PATH.into(), r.to_json_pretty().into_bytes()),
                (MANIFEST_PATH.into(), serde_json::to_vec(&manifest).unwrap()),
            ],
        );
        assert_eq!(
            required_checks(&img).unwrap(),
            ["kernel.release", "image.manifest"]
        );
        let e = run(Args {
            image: img,
            json: false,
        })
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("required check image.manifest is missing"),
            "{e:#}"
        );
    }

    /// A models slot of `len` bytes: two data blocks, one tree block, the trailer of a JSON
    /// naming `model`, with `sig` as its signature.
    fn models_slot(len: u64, model: &str, sig: &[u8]) -> (Vec<u8>, String) {
        use kiln_runtime::models_slot as ms;
        let meta = ms::Meta {
            format: ms::FORMAT,
            models: vec![ms::Model {
                name: model.into(),
                size: 4096,
                sha256: "cd".repeat(32),
            }],
            verity: kiln_runtime::verity::Params {
                version: 1,
                algorithm: "sha256".into(),
                data_block_size: 4096,
                hash_block_size: 4096,
                data_blocks: 2,
                hash_start_block: 2,
                salt: "00".repeat(32),
                root_hash: "7e".repeat(32),
            },
            known_answers: Default::default(),
        };
        let bytes = serde_json::to_vec(&meta).unwrap();
        let footer =
            ms::layout(meta.hash_tree_end().unwrap(), &bytes, sig.len() as u64, len).unwrap();
        let mut c = std::io::Cursor::new(vec![0u8; len as usize]);
        ms::write_trailer(&mut c, len, &footer, &bytes, sig).unwrap();
        (c.into_inner(), hex::encode(footer.meta_sha256))
    }

    #[test]
    fn the_models_slots_are_listed_from_their_own_trailers() {
        use kiln_runtime::slot::{Class, Slot, State};
        let dir = tempfile::tempdir().unwrap();
        let size: u64 = 1 << 20;
        let (a, sha_a) = models_slot(size, "factory.gguf", &[]);
        let (b, sha_b) = models_slot(size, "new.gguf\u{1b}[2J", &[0x30; 700]);
        let mut st = State::initial();
        st.mark_active_with(Class::Models, Slot::B, 1).unwrap();
        let manifest = serde_json::json!({"models_slot": {"meta_sha256": sha_a}});
        let fats = [
            ("bootctl", vec![(ABSTATE_PATH.into(), st.encode().unwrap())]),
            (
                "boot_a",
                vec![(MANIFEST_PATH.into(), serde_json::to_vec(&manifest).unwrap())],
            ),
        ];
        let build = |b_bytes: &[u8]| {
            let mut parts = Vec::new();
            let mut lba = 2048;
            for (name, files) in &fats {
                let fat = dir.path().join(format!("{name}.vfat"));
                fat::build(&fat, size, 0x1234_5678, "BOOT", files, 1_700_000_000).unwrap();
                parts.push((name.to_string(), fat));
            }
            for (name, bytes) in [("models_a", &a[..]), ("models_b", b_bytes)] {
                let raw = dir.path().join(name);
                std::fs::write(&raw, bytes).unwrap();
                parts.push((name.to_string(), raw));
            }
            let parts: Vec<_> = parts
                .into_iter()
                .map(|(name, file)| {
                    let spec = gpt::PartitionSpec {
                        name: name.clone(),
                        type_guid: gpt::types::basic_data(),
                        unique_guid: guid_from_seed("test", &name),
                        first_lba: lba,
                        size_bytes: size,
                        attributes: 0,
                    };
                    lba += size / 512;
                    (spec, file)
                })
                .collect();
            let img = dir.path().join("models.img");
            gpt::assemble(&img, 8 << 20, guid_from_seed("test", "disk"), &parts, &[]).unwrap();
            models_lines(&img)
        };
        let lines = build(&b);
        assert_eq!(
            lines[0], "models: MODELS_ORDER 'B A', A 3 left, B 1 left; init maps B next",
            "{lines:?}"
        );
        assert!(
            lines[1].starts_with(&format!(
                "models slot A (models_a): kiln-models.json {}, format 1, 1 model(s) (factory.gguf), verity root 7e7e7e7e7e7e",
                &sha_a[..12]
            )) && lines[1].ends_with("the factory models of boot slot A; unsigned"),
            "{lines:?}"
        );
        assert!(
            lines[2].contains(&format!("kiln-models.json {}", &sha_b[..12]))
                && lines[2].contains("(new.gguf\\u{1b}[2J)")
                && lines[2]
                    .ends_with("named by no boot slot's manifest; signed (700-byte CMS signature)"),
            "{lines:?}"
        );
        // An empty models_b (a new image), and one whose trailer is damaged.
        let lines = build(&vec![0u8; size as usize]);
        assert_eq!(
            lines[2],
            "models slot B (models_b): empty (no kiln-models.json: never written)"
        );
        let mut bad = b.clone();
        // The JSON starts right after the one-block hash tree.
        let meta_at = 3 * 4096;
        bad[meta_at + 5] ^= 1;
        let lines = build(&bad);
        assert!(
            lines[2].starts_with("models slot B (models_b): unreadable: models_b: its kiln-models.json does not match"),
            "{lines:?}"
        );
    }
}
