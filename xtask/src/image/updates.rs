//! RAUC on the board. Debian's `rauc`, the `dbus-daemon` its client and service talk through,
//! and libubootenv's `fw_printenv`/`fw_setenv` (what RAUC's U-Boot backend runs) with exactly the
//! shared objects they load make the *updates tree*: 28 MB of files the self-check does not need,
//! so they are not in the initramfs (unpacking them would cost the boot about a second under
//! QEMU) but in `kiln/updates.erofs` on each boot slot, which init mounts on [`MOUNT`] once the
//! verdict is known. The initramfs holds what ties them to this board: `/etc/rauc/system.conf`
//! (the slots, `compatible`, the keyring), `/etc/fw_env.config` (the counters file on bootctl),
//! the bus's configuration, wrappers that run the tree's programs, and the tree's sha256
//! (`/etc/kiln/updates.sha256`), which init checks before it mounts the tree: the self-check
//! does not read 16 MiB it does not run before its verdict.

use super::context::Ctx;
use super::runner::{key_of, Step};
use super::Inputs;
use crate::pins::Sha256;
use crate::rootfs::{self, NodeKind, Tree};
use anyhow::{Context, Result};
use std::path::PathBuf;

/// Where init mounts the updates tree.
pub const MOUNT: &str = "/opt/updates";
/// The file on each boot slot.
pub const FILE: &str = "kiln/updates.erofs";
/// Its sha256 in the initramfs (`sha256sum -c` format); the runtime's image check names the
/// same path.
pub const SHA_FILE: &str = "/etc/kiln/updates.sha256";

/// The programs of the tree and the package of each.
const PROGRAMS: &[(&str, &str)] = &[
    ("usr/bin/rauc", "rauc"),
    ("usr/bin/dbus-daemon", "dbus-daemon"),
    ("usr/bin/fw_printenv", "libubootenv-tool"),
    ("usr/bin/fw_setenv", "libubootenv-tool"),
    // A models bundle's slot is believed by its signature (`openssl cms -verify` against the
    // keyring and its CRL): init mounts the tree before it maps such a slot.
    ("usr/bin/openssl", "openssl"),
];

/// Files the initramfs always has (the C library and its loader, which `kiln` and busybox's
/// neighbours load): the tree does not carry a second copy. The rest of glibc the programs
/// need (e.g. `libresolv.so.2`) comes along.
const IN_INITRAMFS: &[&str] = &["libc.so.6", "ld-linux-aarch64.so.1"];

/// The development keyring every image trusts unless its recipe names one
/// (`update-keys/README.md`): kiln's development CA and its CRL, made by `cargo xtask keys` as a
/// fleet's is, so that revocation is checked on every test board. The CRL lists
/// `update-keys/revoked-cert.pem`'s serial (`dev-revoked.txt`).
pub const DEV_KEYRING: &str = include_str!("update-keys/dev-keyring.pem");
/// The development signing certificate (issued by the development CA) and its key, which sign
/// bundles when no `--key` is given.
pub const DEV_CERT: &str = include_str!("update-keys/dev-cert.pem");
pub const DEV_KEY: &str = include_str!("update-keys/dev-key.pem");

/// The warning both `cargo xtask image` and `cargo xtask bundle` print while the development
/// key is in use.
pub const DEV_WARNING: &str = "the update keyring is kiln's public development certificate \
     (xtask/src/image/update-keys/): anyone can sign a bundle this board installs. For a fleet, \
     name your own certificate in the recipe ([update] keyring) and sign with its key \
     (cargo xtask bundle --key K --cert C)";

/// An image whose keyring is the development certificate builds only where that was asked for in
/// so many words: the recipe's `[update] dev_keys = true` (qemu-virt) or `--dev-keys`.
pub fn check_keys(board: &super::board::Board, dev_keys_flag: bool) -> Result<()> {
    if board.update.keyring.is_some() || board.update.dev_keys || dev_keys_flag {
        return Ok(());
    }
    anyhow::bail!(
        "{}: no [update] keyring, so this image would trust kiln's public development key, with \
         which anyone can sign a bundle the board installs. For a fleet: `cargo xtask keys new \
         --out DIR` and name DIR/keyring.pem in the recipe as [update] keyring = \"...\". For a \
         board on your desk: build with --dev-keys",
        board.path.display()
    )
}

/// The keyring (PEM certificates) the image trusts, and whether it is the development one.
pub fn keyring(ctx: &Ctx) -> Result<(Vec<u8>, bool)> {
    keyring_of(&ctx.board)
}

/// The keyring (PEM certificates) `board`'s images trust, and whether it is the development one.
pub fn keyring_of(board: &super::board::Board) -> Result<(Vec<u8>, bool)> {
    match &board.update.keyring {
        Some(p) => {
            let path = crate::paths::project_root().join(p);
            let bytes = std::fs::read(&path).with_context(|| {
                format!(
                    "{}: [update] keyring {}: cannot read it",
                    board.path.display(),
                    path.display()
                )
            })?;
            anyhow::ensure!(
                String::from_utf8_lossy(&bytes).contains("-----BEGIN CERTIFICATE-----"),
                "{}: [update] keyring {} holds no PEM certificate",
                board.path.display(),
                path.display()
            );
            Ok((bytes, false))
        }
        None => Ok((DEV_KEYRING.as_bytes().to_vec(), true)),
    }
}

/// The RAUC `compatible` of a board's images and bundles.
pub fn compatible(board: &str) -> String {
    format!("kiln-{board}")
}

/// `/etc/rauc/system.conf`: two boot slots, RAUC's U-Boot backend on the counters file, the
/// central status file on the data partition (a per-slot status file would change the slot's
/// file system, which must stay the bundle's bytes).
/// Whether a keyring (PEM) carries a CRL: then the board's RAUC checks it (`check-crl=true`), and
/// a bundle signed by a revoked certificate is refused. (With `check-crl` and no CRL, OpenSSL
/// refuses every bundle: "unable to get certificate CRL".)
pub fn has_crl(keyring: &[u8]) -> bool {
    String::from_utf8_lossy(keyring).contains("-----BEGIN X509 CRL-----")
}

pub fn system_conf(board: &str, check_crl: bool) -> String {
    format!(
        "# RAUC on kiln-{board} (made by cargo xtask image: xtask/src/image/updates.rs).\n\
         [system]\n\
         compatible={}\n\
         bootloader=uboot\n\
         data-directory=/data/rauc\n\
         bundle-formats=-plain\n\
         \n\
         [keyring]\n\
         path=/etc/rauc/keyring.pem\n\
         {}\
         \n\
         [slot.boot.0]\n\
         device=/dev/disk/by-partlabel/boot_a\n\
         type=vfat\n\
         bootname=A\n\
         \n\
         [slot.boot.1]\n\
         device=/dev/disk/by-partlabel/boot_b\n\
         type=vfat\n\
         bootname=B\n",
        compatible(board),
        if check_crl { "check-crl=true\n" } else { "" }
    )
}

/// `/etc/fw_env.config`: libubootenv's device line for the counters file (`slot::env::SIZE`).
pub const FW_ENV_CONFIG: &str =
    "# libubootenv: the A/B counters RAUC's U-Boot backend edits (p1 bootctl, kiln/abstate.env)\n\
     /bootctl/kiln/abstate.env 0x0 0x4000\n";

/// The system bus `rauc service` owns its name on. Everything on the board runs as root and
/// the bus listens on no network: one permissive policy, no user lookups.
pub const DBUS_CONF: &str = r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- kiln: the system bus of rauc service and its clients (xtask/src/image/updates.rs) -->
<busconfig>
  <type>system</type>
  <listen>unix:path=/run/dbus/system_bus_socket</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"#;

/// A wrapper in the initramfs's `/usr/bin` that runs the tree's program of the same name.
fn wrapper(program: &str) -> String {
    let base = program.rsplit('/').next().unwrap_or(program);
    let mut s = format!(
        "#!/bin/sh\n\
         # {base} from the updates tree ({FILE}, mounted by init on {MOUNT} after the self-check,\n\
         # or before it maps a models slot believed by its signature).\n\
         U={MOUNT}\n\
         if [ ! -x \"$U/{program}\" ]; then\n\
         \x20   echo \"{base}: the updates tree is not mounted on $U (init mounts /boot/{FILE} once the self-check has its verdict, or before it maps a models slot believed by its signature)\" >&2\n\
         \x20   exit 127\n\
         fi\n\
         export LD_LIBRARY_PATH=\"$U/usr/lib/aarch64-linux-gnu:$U/lib/aarch64-linux-gnu\"\n"
    );
    if base == "fw_setenv" {
        // bootctl is mounted read-only but while something writes it.
        s.push_str(&format!(
            "mount -o remount,rw /bootctl || exit 1\n\
             \"$U/{program}\" \"$@\"\n\
             rc=$?\n\
             sync\n\
             mount -o remount,ro /bootctl\n\
             exit $rc\n"
        ));
    } else {
        s.push_str(&format!("exec \"$U/{program}\" \"$@\"\n"));
    }
    s
}

/// Add to the initramfs what ties the updates tree to this board.
pub fn add_to_initramfs(
    t: &mut Tree,
    board: &str,
    keyring: &[u8],
    tree_sha: &Sha256,
) -> Result<()> {
    let origin = "xtask image::updates";
    let file = |b: &[u8]| NodeKind::File(b.to_vec());
    // What init checks the tree against before it mounts it (`sha256sum -c`); the self-check's
    // image.manifest holds it equal to the manifest's entry for the file.
    t.add(
        SHA_FILE.trim_start_matches('/'),
        0o644,
        file(format!("{tree_sha}  /boot/{FILE}\n").as_bytes()),
        origin,
    )?;
    t.add(
        "etc/rauc/system.conf",
        0o644,
        file(system_conf(board, has_crl(keyring)).as_bytes()),
        origin,
    )?;
    t.add("etc/rauc/keyring.pem", 0o644, file(keyring), origin)?;
    t.add(
        "etc/fw_env.config",
        0o644,
        file(FW_ENV_CONFIG.as_bytes()),
        origin,
    )?;
    t.add(
        "etc/kiln/dbus.conf",
        0o644,
        file(DBUS_CONF.as_bytes()),
        origin,
    )?;
    for (program, _) in PROGRAMS {
        let base = program.rsplit('/').next().unwrap_or(program);
        t.add(
            &format!("usr/bin/{base}"),
            0o755,
            file(wrapper(program).as_bytes()),
            origin,
        )?;
    }
    Ok(())
}

/// The updates tree: the programs and their shared-object closure from the pinned packages,
/// less what the initramfs has.
pub fn tree(inputs: &Inputs) -> Result<Tree> {
    let libs = super::context::rootfs_libs(inputs, &[])?;
    let mut t = Tree::default();
    for (program, package) in PROGRAMS {
        let node = libs.nodes.get(*program).with_context(|| {
            format!("the pinned package {package} (rootfs/packages.toml) has no /{program}")
        })?;
        t.add(program, 0o755, node.kind.clone(), package)?;
    }
    let roots: Vec<&str> = PROGRAMS.iter().map(|(p, _)| *p).collect();
    rootfs::add_shared_objects(&mut t, &libs, &roots)?;
    t.nodes
        .retain(|_, n| !IN_INITRAMFS.contains(&n.origin.as_str()));
    Ok(t)
}

/// The step making `updates.erofs` (lz4hc-compressed erofs of [`tree`]).
pub fn step(ctx: &Ctx) -> Step<'_> {
    let uuid = crate::disk::guid_from_seed(&ctx.seed, "updates-fs");
    let key = key_of(&[
        "updates-v4",
        &ctx.tools.key.to_string(),
        &ctx.epoch.to_string(),
        &uuid.to_string(),
        &super::context::rootfs_debs_key(ctx),
    ]);
    Step {
        name: "updates tree",
        key,
        outputs: vec![ctx.work.join("updates.erofs")],
        make: Box::new(move |tmp: &[PathBuf]| {
            let t = tree(&ctx.inputs)?;
            let stage = ctx.work.join("updates-staging");
            if stage.exists() {
                std::fs::remove_dir_all(&stage)?;
            }
            rootfs::write_dir(&t, &stage)?;
            crate::disk::erofs::build_compressed(
                &tmp[0],
                &stage,
                uuid,
                ctx.epoch,
                Some(&ctx.tools),
            )?;
            std::fs::remove_dir_all(&stage)?;
            let bytes: usize = t
                .nodes
                .values()
                .map(|n| match &n.kind {
                    NodeKind::File(b) => b.len(),
                    _ => 0,
                })
                .sum();
            Ok(format!(
                "rauc, dbus-daemon, fw_printenv/fw_setenv, openssl and {} shared objects: {:.1} MiB in \
                 {:.1} MiB of erofs (lz4hc), sha256 {}",
                t.nodes
                    .keys()
                    .filter(|p| p.contains(".so"))
                    .filter(|p| matches!(t.nodes[*p].kind, NodeKind::File(_)))
                    .count(),
                bytes as f64 / 1048576.0,
                std::fs::metadata(&tmp[0])?.len() as f64 / 1048576.0,
                Sha256::of_file(&tmp[0])?.short()
            ))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_real_board_with_the_development_keyring_needs_dev_keys() {
        for board in ["rock-5b", "rock-5b-vendor"] {
            // Refused before anything is resolved or built, naming the way out.
            let e = crate::image::build(&crate::image::Args {
                board: board.into(),
                models: vec![],
                offline: true,
                dev_keys: false,
            })
            .err()
            .unwrap_or_else(|| panic!("{board} built with the development keyring"));
            let e = format!("{e:#}");
            assert!(
                e.contains("--dev-keys") && e.contains("keys new"),
                "{board}: {e}"
            );
            let b = crate::image::board::Board::load(board).unwrap();
            assert!(check_keys(&b, true).is_ok());
        }
        let q = crate::image::board::Board::load("qemu-virt").unwrap();
        assert!(q.update.dev_keys && check_keys(&q, false).is_ok());
    }

    #[test]
    fn system_conf_names_both_slots_and_the_board() {
        let c = system_conf("qemu-virt", false);
        assert!(!c.contains("check-crl"));
        assert!(
            system_conf("qemu-virt", true).contains("path=/etc/rauc/keyring.pem\ncheck-crl=true\n")
        );
        assert!(c.contains("compatible=kiln-qemu-virt\n"));
        assert!(c.contains(
            "[slot.boot.0]\ndevice=/dev/disk/by-partlabel/boot_a\ntype=vfat\nbootname=A\n"
        ));
        assert!(c.contains(
            "[slot.boot.1]\ndevice=/dev/disk/by-partlabel/boot_b\ntype=vfat\nbootname=B\n"
        ));
        assert!(c.contains("bootloader=uboot\n"));
    }

    #[test]
    fn fw_setenv_wrapper_writes_bootctl_read_write_only_while_it_runs() {
        let w = wrapper("usr/bin/fw_setenv");
        let rw = w.find("remount,rw").unwrap();
        let run = w.find("\"$U/usr/bin/fw_setenv\" \"$@\"").unwrap();
        let ro = w.find("remount,ro").unwrap();
        assert!(rw < run && run < ro, "{w}");
        assert!(wrapper("usr/bin/rauc").contains("exec \"$U/usr/bin/rauc\" \"$@\""));
    }

    #[test]
    fn the_development_pair_matches() {
        assert!(DEV_CERT.contains("BEGIN CERTIFICATE"));
        assert!(DEV_KEY.contains("BEGIN PRIVATE KEY"));
    }

    /// The development keyring is a CA with its CRL (so qemu-virt's RAUC runs with
    /// `check-crl=true`), and the CRL's list is `revoked-cert.pem`'s serial, the certificate
    /// `ab-test` signs a bundle with for the board to refuse. RAUC itself checks the rest: every
    /// bundle `cargo xtask bundle` makes is verified against this keyring with its CRL.
    #[test]
    fn the_development_keyring_revokes_the_revoked_certificate() {
        assert!(has_crl(DEV_KEYRING.as_bytes()));
        let serial = |pem: &str| {
            let p = rcgen::CertificateParams::from_ca_cert_pem(pem).unwrap();
            hex::encode(p.serial_number.unwrap().as_ref())
        };
        let listed = include_str!("update-keys/dev-revoked.txt").trim();
        assert_eq!(listed, serial(include_str!("update-keys/revoked-cert.pem")));
        assert_ne!(listed, serial(DEV_CERT));
    }
}
