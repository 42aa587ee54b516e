//! p1 `bootctl`: `boot.scr`, the A/B slot chooser U-Boot's distro boot runs, and
//! `kiln/abstate.env`, the counters it keeps (RAUC's U-Boot contract; see
//! `kiln_runtime::slot`). The chooser is RAUC's `contrib/uboot.sh` logic on a file instead of
//! the U-Boot environment store (QEMU 7.2 cannot keep a pflash environment the guest writes):
//!
//! 1. load `kiln/abstate.env` from p1 and `env import -c` only `BOOT_ORDER`, `BOOT_A_LEFT`,
//!    `BOOT_B_LEFT`, `KILN_LAST_GOOD` and the models slots' `MODELS_ORDER`, `MODELS_A_LEFT`,
//!    `MODELS_B_LEFT` (which U-Boot only carries over: init reads them), nothing else (nothing
//!    on a FAT file may set `bootcmd` or `bootargs`); a missing or damaged file (bad CRC) gives
//!    RAUC's defaults `A B`, 3, 3;
//! 2. take the first slot of `BOOT_ORDER` with tries left (`test 0x${BOOT_x_LEFT} -gt 0`);
//! 3. decrement its counter *before* booting it and save the file (`env export -c` + `save`):
//!    a chain of `test`s, not `setexpr`, which the rock-5b U-Boot lacks; a count above 9 becomes
//!    9 (kiln writes 3);
//! 4. `sysboot` the slot's `extlinux/extlinux.conf`, whose `append` has `rauc.slot=${kiln_slot}`:
//!    both slots hold the same files, the slot name comes from here. A U-Boot built without
//!    `sysboot` (Debian 13's `qemu_arm64`, standard boot only) boots the same files directly:
//!    `load` the slot's `Image`, initramfs (and dtb) and `booti` them with extlinux.conf's
//!    `append` line (the same text, from [`super::append_line`]); the dtb is U-Boot's own
//!    (`${fdtcontroladdr}`) where the board ships none;
//! 5. no slot with tries left: boot the slot last marked good (`KILN_LAST_GOOD`, which
//!    `kiln slot mark-good` writes; RAUC does not), or A, saying so on the console, and save
//!    nothing: the board's report then says "no good slot". No reset loop.
//!
//! `boot.scr` is a legacy U-Boot script image (what `mkimage -A arm64 -O linux -T script -C none`
//! writes; the test holds it to mkimage's bytes), written here: 64 bytes of header.

use anyhow::{ensure, Result};

/// The script's name in its image header.
const NAME: &str = "kiln A/B slot chooser";

/// The partition numbers of the slots (see `layout::NAMES`).
const SLOTS: [(&str, u32); 2] = [("A", 2), ("B", 3)];

/// The text of the chooser; `append` is the kernel command line of extlinux.conf, `dtb` the
/// board's dtb file on the slot, if any.
pub fn script(append: &str, dtb: Option<&str>) -> String {
    let mut s = String::from(
        "# kiln A/B slot chooser (the U-Boot contract of RAUC, the counters in kiln/abstate.env of p1).\n\
         # Made by cargo xtask image: see xtask/src/image/bootscr.rs.\n\
         setenv kiln_slot\n\
         setenv kiln_part\n\
         setenv BOOT_ORDER\n\
         setenv BOOT_A_LEFT\n\
         setenv BOOT_B_LEFT\n\
         setenv KILN_LAST_GOOD\n\
         setenv MODELS_ORDER\n\
         setenv MODELS_A_LEFT\n\
         setenv MODELS_B_LEFT\n\
         setenv kiln_state ok\n\
         if load ${devtype} ${devnum}:1 ${kernel_addr_r} /kiln/abstate.env; then\n\
         \x20 if env import -c ${kernel_addr_r} 0x4000 BOOT_ORDER BOOT_A_LEFT BOOT_B_LEFT KILN_LAST_GOOD MODELS_ORDER MODELS_A_LEFT MODELS_B_LEFT; then\n\
         \x20   echo \"kiln-boot: abstate.env: BOOT_ORDER [${BOOT_ORDER}], A ${BOOT_A_LEFT} left, B ${BOOT_B_LEFT} left\"\n\
         \x20 else\n\
         \x20   setenv kiln_state damaged\n\
         \x20 fi\n\
         else\n\
         \x20 setenv kiln_state missing\n\
         fi\n\
         if test \"${kiln_state}\" != ok; then\n\
         \x20 echo \"kiln-boot: abstate.env ${kiln_state}: the defaults of RAUC, BOOT_ORDER [A B], 3 tries each\"\n\
         \x20 setenv BOOT_ORDER \"A B\"\n\
         \x20 setenv BOOT_A_LEFT 3\n\
         \x20 setenv BOOT_B_LEFT 3\n\
         fi\n\
         for s in \"${BOOT_ORDER}\"; do\n\
         \x20 if test -z \"${kiln_slot}\"; then\n",
    );
    for (i, (slot, part)) in SLOTS.iter().enumerate() {
        let kw = if i == 0 { "if" } else { "elif" };
        s.push_str(&format!(
            "    {kw} test \"${{s}}\" = {slot}; then\n\
             \x20     if test 0x${{BOOT_{slot}_LEFT}} -gt 0; then\n\
             \x20       setenv kiln_slot {slot}\n\
             \x20       setenv kiln_part {part}\n\
             \x20     fi\n"
        ));
    }
    s.push_str("    fi\n  fi\ndone\n");
    s.push_str("if test -n \"${kiln_slot}\"; then\n");
    for (i, (slot, _)) in SLOTS.iter().enumerate() {
        let kw = if i == 0 { "if" } else { "elif" };
        let v = format!("BOOT_{slot}_LEFT");
        s.push_str(&format!("  {kw} test \"${{kiln_slot}}\" = {slot}; then\n"));
        s.push_str(&format!(
            "    if test 0x${{{v}}} -gt 9; then\n      setenv {v} 9\n"
        ));
        for n in (1..=9).rev() {
            s.push_str(&format!(
                "    elif test 0x${{{v}}} -eq {n}; then\n      setenv {v} {}\n",
                n - 1
            ));
        }
        s.push_str("    fi\n");
    }
    s.push_str(
        "  fi\n\
         \x20 echo \"kiln-boot: booting slot ${kiln_slot} (p${kiln_part}), BOOT_A_LEFT ${BOOT_A_LEFT}, BOOT_B_LEFT ${BOOT_B_LEFT}\"\n\
         \x20 if env export -c -s 0x4000 ${kernel_addr_r} BOOT_ORDER BOOT_A_LEFT BOOT_B_LEFT KILN_LAST_GOOD MODELS_ORDER MODELS_A_LEFT MODELS_B_LEFT && save ${devtype} ${devnum}:1 ${kernel_addr_r} /kiln/abstate.env 0x4000; then\n\
         \x20   echo \"kiln-boot: counters saved\"\n\
         \x20 else\n\
         \x20   echo \"kiln-boot: WARNING: cannot save kiln/abstate.env: this try is not counted\"\n\
         \x20 fi\n\
         else\n\
         \x20 setenv kiln_slot A\n\
         \x20 setenv kiln_part 2\n\
         \x20 if test \"${KILN_LAST_GOOD}\" = B; then\n\
         \x20   setenv kiln_slot B\n\
         \x20   setenv kiln_part 3\n\
         \x20 fi\n\
         \x20 echo \"kiln-boot: NO GOOD SLOT (BOOT_ORDER [${BOOT_ORDER}], A ${BOOT_A_LEFT} left, B ${BOOT_B_LEFT} left): booting slot ${kiln_slot}, the last marked good (or A); nothing saved\"\n\
         fi\n\
         sysboot ${devtype} ${devnum}:${kiln_part} any ${pxefile_addr_r} /extlinux/extlinux.conf\n",
    );
    // No sysboot (or it returned): the same files and command line, booted directly.
    let (fdt_load, fdt) = match dtb {
        Some(d) => (
            format!("load ${{devtype}} ${{devnum}}:${{kiln_part}} ${{fdt_addr_r}} /{d} && "),
            "${fdt_addr_r}",
        ),
        None => (String::new(), "${fdtcontroladdr}"),
    };
    s.push_str(&format!(
        "echo \"kiln-boot: sysboot did not boot slot ${{kiln_slot}}: booting its Image directly with the append line of its extlinux.conf\"\n\
         setenv bootargs \"{append}\"\n\
         if {fdt_load}load ${{devtype}} ${{devnum}}:${{kiln_part}} ${{kernel_addr_r}} /Image && load ${{devtype}} ${{devnum}}:${{kiln_part}} ${{ramdisk_addr_r}} /initramfs.cpio.gz; then\n\
         \x20 booti ${{kernel_addr_r}} ${{ramdisk_addr_r}}:${{filesize}} {fdt}\n\
         fi\n\
         echo \"kiln-boot: slot ${{kiln_slot}} (p${{kiln_part}}) did not boot; resetting (the try is spent)\"\n\
         reset\n"
    ));
    s
}

/// `text` as a legacy U-Boot script image, as `mkimage -A arm64 -O linux -T script -C none -n
/// NAME` writes it with `SOURCE_DATE_EPOCH=epoch`.
pub fn uimage(text: &str, epoch: i64) -> Result<Vec<u8>> {
    let len = u32::try_from(text.len())?;
    let mut data = Vec::with_capacity(text.len() + 8);
    data.extend_from_slice(&len.to_be_bytes());
    data.extend_from_slice(&0u32.to_be_bytes());
    data.extend_from_slice(text.as_bytes());
    ensure!(NAME.len() < 32, "script name too long");
    let mut h = vec![0u8; 64];
    h[0..4].copy_from_slice(&0x2705_1956u32.to_be_bytes());
    h[8..12].copy_from_slice(&u32::try_from(epoch)?.to_be_bytes());
    h[12..16].copy_from_slice(&u32::try_from(data.len())?.to_be_bytes());
    h[24..28].copy_from_slice(&crc32fast::hash(&data).to_be_bytes());
    h[28] = 5; // IH_OS_LINUX
    h[29] = 22; // IH_ARCH_ARM64
    h[30] = 6; // IH_TYPE_SCRIPT
    h[31] = 0; // IH_COMP_NONE
    h[32..32 + NAME.len()].copy_from_slice(NAME.as_bytes());
    let hcrc = crc32fast::hash(&h);
    h[4..8].copy_from_slice(&hcrc.to_be_bytes());
    h.extend_from_slice(&data);
    Ok(h)
}

/// The files of p1 `bootctl` for a board whose slots boot with `append` (and `dtb`).
pub fn files(epoch: i64, append: &str, dtb: Option<&str>) -> Result<Vec<(String, Vec<u8>)>> {
    Ok(vec![
        ("boot.scr".into(), uimage(&script(append, dtb), epoch)?),
        (
            "kiln/abstate.env".into(),
            kiln_runtime::slot::State::initial().encode()?,
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte-equal to mkimage's (u-boot-tools, a host tool of `cargo xtask doctor`).
    #[test]
    fn boot_scr_is_what_mkimage_writes() {
        let sh = xshell::Shell::new().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("boot.cmd");
        let out = dir.path().join("boot.scr");
        for text in [script(A, None), "echo odd\n".to_string()] {
            std::fs::write(&src, &text).unwrap();
            xshell::cmd!(
                sh,
                "mkimage -A arm64 -O linux -T script -C none -n {NAME} -d {src} {out}"
            )
            .env("SOURCE_DATE_EPOCH", "1733300000")
            .quiet()
            .ignore_stdout()
            .run()
            .unwrap();
            assert_eq!(
                uimage(&text, 1733300000).unwrap(),
                std::fs::read(&out).unwrap()
            );
        }
    }

    #[test]
    fn chooser_counts_down_every_value_and_never_uses_setexpr() {
        let s = script(A, None);
        assert!(!s.contains("setexpr") && !s.contains("saveenv"));
        // U-Boot's hush takes a single quote inside double quotes as the start of a quote.
        assert!(!s.contains('\''), "no single quote anywhere in boot.scr");
        for slot in ["A", "B"] {
            for n in 1..=9 {
                assert!(s.contains(&format!(
                    "test 0x${{BOOT_{slot}_LEFT}} -eq {n}; then\n      setenv BOOT_{slot}_LEFT {}\n",
                    n - 1
                )));
            }
        }
        assert!(s.contains("sysboot ${devtype} ${devnum}:${kiln_part} any"));
        // Without sysboot: the same command line, U-Boot's dtb, or the board's from the slot.
        assert!(s.contains(&format!("setenv bootargs \"{A}\"\n")));
        assert!(
            s.contains("booti ${kernel_addr_r} ${ramdisk_addr_r}:${filesize} ${fdtcontroladdr}\n")
        );
        let r = script(A, Some("rk3588-rock-5b.dtb"));
        assert!(r.contains(
            "load ${devtype} ${devnum}:${kiln_part} ${fdt_addr_r} /rk3588-rock-5b.dtb && "
        ));
        assert!(r.contains("${filesize} ${fdt_addr_r}\n"));
    }

    const A: &str = "console=ttyAMA0 panic=-1 rauc.slot=${kiln_slot} ${kiln_args}";
}
