//! kiln's `abstate.env` codec and `kiln slot` against the independent tools that read and write
//! the same file: libubootenv's `fw_printenv`/`fw_setenv` (what RAUC runs; Debian's
//! libubootenv-tool) and U-Boot's `mkenvimage` (u-boot-tools). A missing tool skips its test with
//! a loud SKIPPED line, or fails it when `KILN_REQUIRE_TOOLS=1`.
//!
//! Byte for byte: the records (`name=value\0`…`\0`) are written in name order by both, and
//! libubootenv 0.3.2 keeps the padding it read (the bytes its old, longer records used become
//! 0x00; checked with xxd). kiln pads with 0x00 as U-Boot's `env export -c` does, so from a file
//! kiln (or U-Boot) wrote, `fw_setenv` and `kiln slot mark-*` give the same bytes, CRC included:
//! [`kiln_marks_equal_fw_setenv_edits`]. From an `mkenvimage` file (0xff padding by default) the
//! variables are the same, the padding and so the CRC are not.

mod slot_common;

use kiln_runtime::slot::env::SIZE;
use kiln_runtime::slot::{Slot, State};
use slot_common::*;
use std::path::Path;
use std::process::Command;

/// The records of an environment file: from after the CRC to the end marker (the second `\0`),
/// and the padding after it.
fn records_and_padding(bytes: &[u8]) -> (&[u8], &[u8]) {
    let data = &bytes[4..];
    let end = data
        .windows(2)
        .position(|w| w == [0, 0])
        .expect("no end marker")
        + 2;
    // An environment that starts with its end marker has one `\0` only.
    let end = if data[0] == 0 { 1 } else { end };
    (&data[..end], &data[end..])
}

#[test]
fn fw_printenv_reads_our_initial_state() {
    require_tools!(
        "fw_printenv_reads_our_initial_state",
        ("fw_printenv", "libubootenv-tool")
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("abstate.env");
    let st = State::initial();
    std::fs::write(&p, st.encode().unwrap()).unwrap();
    let got = fw_printenv(&fw_env_config(&p));
    assert_eq!(got, st.env().vars);
    assert_eq!(got["BOOT_ORDER"], "A B");
    assert_eq!((&*got["BOOT_A_LEFT"], &*got["BOOT_B_LEFT"]), ("3", "3"));
}

#[test]
fn mkenvimage_output_decodes_to_the_same_variables() {
    require_tools!(
        "mkenvimage_output_decodes_to_the_same_variables",
        ("mkenvimage", "u-boot-tools")
    );
    let dir = tempfile::tempdir().unwrap();
    let txt = dir.path().join("env.txt");
    // Not in name order, with a value holding '=' and spaces, and a variable kiln does not own.
    std::fs::write(
        &txt,
        "BOOT_ORDER=B A\nBOOT_B_LEFT=2\nBOOT_A_LEFT=0\nbootargs=console=ttyAMA0 rauc.slot=B\n",
    )
    .unwrap();
    for pad in [None, Some("0x00")] {
        let img = dir.path().join("abstate.env");
        let mut c = Command::new("mkenvimage");
        c.args(["-s", "0x4000", "-o"]).arg(&img);
        if let Some(p) = pad {
            c.args(["-p", p]);
        }
        ok(c.arg(&txt));
        let bytes = std::fs::read(&img).unwrap();
        assert_eq!(bytes.len(), SIZE);
        let st = State::decode(&bytes, "mkenvimage's").unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(st.order().unwrap(), vec![Slot::B, Slot::A]);
        assert_eq!(
            (st.left(Slot::A).unwrap(), st.left(Slot::B).unwrap()),
            (0, 2)
        );
        assert_eq!(
            st.env().get("bootargs"),
            Some("console=ttyAMA0 rauc.slot=B")
        );
        assert_eq!(st.env().vars.len(), 4);
        if pad.is_none() {
            // Our re-encoding: the same records, in name order, but zero padding.
            let ours = st.encode().unwrap();
            assert_eq!(records_and_padding(&bytes).1[0], 0xff);
            assert!(records_and_padding(&ours).1.iter().all(|&b| b == 0));
        }
    }
}

#[test]
fn fw_setenv_edits_are_read_by_our_decode() {
    require_tools!(
        "fw_setenv_edits_are_read_by_our_decode",
        ("fw_printenv", "libubootenv-tool"),
        ("fw_setenv", "libubootenv-tool")
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("abstate.env");
    std::fs::write(&p, State::initial().encode().unwrap()).unwrap();
    let cfg = fw_env_config(&p);
    fw_setenv(&cfg, "BOOT_ORDER", "B A");
    fw_setenv(&cfg, "BOOT_B_LEFT", "2");
    fw_setenv(&cfg, "KILN_NOTE", "set by fw_setenv");
    let bytes = std::fs::read(&p).unwrap();
    let st = State::decode(&bytes, "fw_setenv's").unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(st.order().unwrap(), vec![Slot::B, Slot::A]);
    assert_eq!(
        (st.left(Slot::A).unwrap(), st.left(Slot::B).unwrap()),
        (3, 2)
    );
    assert_eq!(st.primary().unwrap(), Some(Slot::B));
    assert_eq!(st.env().get("KILN_NOTE"), Some("set by fw_setenv"));
    assert_eq!(st.env().vars, fw_printenv(&cfg));
    // And kiln's status says so.
    let s = kiln_status(&p, None);
    assert_eq!(s["boot_order"], serde_json::json!(["B", "A"]));
    assert_eq!(s["slots"]["B"]["left"], 2);
}

/// `kiln slot mark-*` and the `fw_setenv` edits RAUC's uboot backend makes for the same mark,
/// from the same start (a file kiln wrote): the same bytes, CRC included. From an `mkenvimage`
/// start (0xff padding, which libubootenv keeps) the same variables and record bytes.
#[test]
fn kiln_marks_equal_fw_setenv_edits() {
    require_tools!(
        "kiln_marks_equal_fw_setenv_edits",
        ("fw_printenv", "libubootenv-tool"),
        ("fw_setenv", "libubootenv-tool"),
        ("mkenvimage", "u-boot-tools")
    );
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours").join("abstate.env");
    let theirs = dir.path().join("theirs").join("abstate.env");
    std::fs::create_dir_all(ours.parent().unwrap()).unwrap();
    std::fs::create_dir_all(theirs.parent().unwrap()).unwrap();
    let cfg = fw_env_config(&theirs);
    // A booted by U-Boot with one try spent; then good; B installed (bad, then active); B bad.
    // `kiln slot` arguments, and the fw_setenv edits RAUC makes for the same mark.
    type Step<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let steps: &[Step] = &[
        (&["mark-good", "A"], &[("BOOT_A_LEFT", "3")]),
        (
            &["mark-bad", "B"],
            &[("BOOT_ORDER", "A"), ("BOOT_B_LEFT", "0")],
        ),
        (
            &["mark-active", "B"],
            &[("BOOT_ORDER", "B A"), ("BOOT_B_LEFT", "3")],
        ),
        (
            &["mark-bad", "B"],
            &[("BOOT_ORDER", "A"), ("BOOT_B_LEFT", "0")],
        ),
    ];
    let mut first = State::initial().env().clone();
    first.set("BOOT_A_LEFT", "2");
    let bytes = first.encode().unwrap();
    std::fs::write(&ours, &bytes).unwrap();
    std::fs::write(&theirs, &bytes).unwrap();
    for (args, edits) in steps {
        let out = kiln_slot(&ours, None, args);
        assert!(
            out.status.success(),
            "kiln slot {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for (k, v) in *edits {
            fw_setenv(&cfg, k, v);
        }
        assert_eq!(decode(&ours), decode(&theirs), "after {args:?}");
        assert_eq!(decode(&ours).vars, fw_printenv(&cfg), "after {args:?}");
        let (a, b) = (
            std::fs::read(&ours).unwrap(),
            std::fs::read(&theirs).unwrap(),
        );
        assert!(a == b, "not byte for byte after {args:?}");
    }

    // From mkenvimage's 0xff padding, which libubootenv keeps and kiln does not.
    let txt = dir.path().join("env.txt");
    std::fs::write(&txt, "BOOT_ORDER=A B\nBOOT_A_LEFT=2\nBOOT_B_LEFT=3\n").unwrap();
    for p in [&ours, &theirs] {
        ok(Command::new("mkenvimage")
            .args(["-s", "0x4000", "-o"])
            .arg(p)
            .arg(&txt));
    }
    for (args, edits) in steps {
        let out = kiln_slot(&ours, None, args);
        assert!(out.status.success());
        for (k, v) in *edits {
            fw_setenv(&cfg, k, v);
        }
        let (a, b) = (
            std::fs::read(&ours).unwrap(),
            std::fs::read(&theirs).unwrap(),
        );
        assert_eq!(decode(&ours), decode(&theirs), "after {args:?}");
        let (ra, pa) = records_and_padding(&a);
        let (rb, pb) = records_and_padding(&b);
        assert_eq!(
            String::from_utf8_lossy(ra),
            String::from_utf8_lossy(rb),
            "records after {args:?}"
        );
        assert!(pa.iter().all(|&x| x == 0), "kiln pads with 0x00");
        assert_eq!(
            pb.last(),
            Some(&0xff),
            "libubootenv keeps mkenvimage's 0xff"
        );
        assert_ne!(a[..4], b[..4], "so the CRCs differ");
    }
}

/// A power cut before the rename (a stray `abstate.env.new`, garbage or half a file) and one
/// during U-Boot's in-place `save` (a damaged `abstate.env`), through the `kiln` binary; and
/// libubootenv (RAUC) agreeing on what is readable.
#[test]
fn power_cut_leftovers() {
    if slot_common::under_qemu_user("power_cut_leftovers") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("abstate.env");
    let stray = dir.path().join("abstate.env.new");
    let cmdline = dir.path().join("cmdline");
    std::fs::write(&cmdline, "console=ttyAMA0 rauc.slot=A\n").unwrap();
    std::fs::write(&p, State::initial().encode().unwrap()).unwrap();
    let full = {
        let mut st = State::initial();
        st.mark_bad(Slot::B).unwrap();
        st.encode().unwrap()
    };
    for leftover in [b"garbage".to_vec(), full[..4096].to_vec()] {
        std::fs::write(&stray, &leftover).unwrap();
        let s = kiln_status(&p, Some(&cmdline));
        assert_eq!(s["damaged"], serde_json::Value::Null, "{s}");
        assert_eq!(s["stray_new"], true);
        assert_eq!(s["boot_order"], serde_json::json!(["A", "B"]));
        let out = kiln_slot(&p, Some(&cmdline), &["mark-good"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!stray.exists(), "the next mark replaces the stray");
        assert_eq!(kiln_status(&p, Some(&cmdline))["stray_new"], false);
    }

    // U-Boot's fat_write cut short: the first 4 KiB of a new file over the old one.
    let mut torn = full[..4096].to_vec();
    torn.extend_from_slice(&State::initial().encode().unwrap()[4096..]);
    torn[4] ^= 1;
    std::fs::write(&p, &torn).unwrap();
    let s = kiln_status(&p, Some(&cmdline));
    assert!(s["damaged"].as_str().unwrap().contains("damaged"), "{s}");
    let out = kiln_slot(&p, Some(&cmdline), &["mark-good"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--reset"), "{err}");
    assert_eq!(
        std::fs::read(&p).unwrap(),
        torn,
        "a refused mark writes nothing"
    );
    if slot_common::tool(
        "fw_printenv",
        "libubootenv-tool",
        "power_cut_leftovers (libubootenv)",
    )
    .is_some()
    {
        // libubootenv refuses it too ("Cannot read environment"), so rauc cannot mark it.
        let out = Command::new("fw_printenv")
            .arg("-c")
            .arg(fw_env_config(&p))
            .output()
            .unwrap();
        assert!(!out.status.success());
    }
    let out = kiln_slot(&p, Some(&cmdline), &["mark-good", "--reset"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        kiln_status(&p, Some(&cmdline))["slots"]["A"],
        serde_json::json!({"left": 3, "in_order": true, "good": true})
    );
    assert!(Path::new(&p).exists() && !stray.exists());
}
