//! The emulated machine: a board recipe's `[qemu]` table (QEMU's machine, CPU, memory, cores, how
//! the disks and the NIC attach) and the one function that turns it into a QEMU command line
//! ([`QemuVirt::command`]) for every caller: the boot tests, `cargo xtask qemu`, the A/B and fleet
//! scenarios, the farm's power switch, the image's emulated boot of another board's kernel and the
//! disk tests. labgrid's environment (`images/labgrid/qemu-virt.yaml`) is held equal to it by a
//! test.

use super::QemuVirt;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A recipe's `[qemu]`: the machine its image boots on under emulation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    /// QEMU's `-M` (e.g. "virt").
    pub machine: String,
    /// QEMU's `-cpu` (e.g. "cortex-a76": NEON with dotprod, the RK3588's big cores).
    pub cpu: String,
    /// Memory in MiB (`-m`).
    pub memory_mib: u32,
    /// Cores (`-smp`).
    pub smp: u32,
    /// The device every disk attaches through (e.g. "virtio-blk-pci").
    pub disk: String,
    /// The NIC's model under user networking (e.g. "virtio-net-pci").
    pub nic: String,
}

impl Machine {
    /// The `[qemu]` table of the recipe file `recipe`, if it has one.
    pub fn of_recipe(recipe: &Path) -> Result<Option<Machine>> {
        #[derive(serde::Deserialize)]
        struct Only {
            qemu: Option<Machine>,
        }
        let text = std::fs::read_to_string(recipe)
            .with_context(|| format!("reading {}", recipe.display()))?;
        let only: Only = toml::from_str(&text)
            .with_context(|| format!("{}: the [qemu] table", recipe.display()))?;
        Ok(only.qemu)
    }
}

/// What the machine starts.
pub enum Start<'a> {
    /// U-Boot as its firmware (`-bios`), with its environment on a read-only second pflash when
    /// one is given.
    UBoot { pflash: Option<&'a Path> },
    /// A kernel and initramfs directly, with this command line; no reboot (a panic ends QEMU).
    Kernel {
        kernel: &'a Path,
        initrd: &'a Path,
        append: &'a str,
    },
}

/// A disk the machine sees, in order (the first is `vda`), with QEMU's drive options beyond the
/// file and format (e.g. "readonly=on", "snapshot=on").
pub struct Disk<'a> {
    pub path: &'a Path,
    pub options: &'a str,
}

impl QemuVirt {
    /// The command line (argv, QEMU first) of `m` starting `start` with `disks`; `nic` is `None`
    /// for no network or QEMU user networking's options after the model (e.g.
    /// ",hostfwd=tcp::8080-:8080"); `extra` goes before the firmware and disks.
    pub fn command(
        &self,
        m: &Machine,
        start: Start,
        disks: &[Disk],
        nic: Option<&str>,
        extra: &[&str],
    ) -> Vec<String> {
        let mut a: Vec<String> = vec![self.qemu.display().to_string()];
        let memory = m.memory_mib.to_string();
        let smp = m.smp.to_string();
        a.extend(
            [
                "-M",
                &m.machine,
                "-cpu",
                &m.cpu,
                "-m",
                &memory,
                "-smp",
                &smp,
                "-nographic",
            ]
            .map(String::from),
        );
        match nic {
            None => a.extend(["-nic".into(), "none".into()]),
            Some(opts) => a.extend([
                "-nic".into(),
                format!("user,model={}{opts}", m.nic),
                // No PXE option ROM for the NIC: U-Boot boots from the disk, and the ROM file
                // (efi-virtio.rom) is in a package (ipxe-qemu) that nothing else needs.
                "-global".into(),
                format!("{}.romfile=", m.nic),
            ]),
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        match start {
            Start::UBoot { pflash } => {
                a.extend(["-bios".into(), self.uboot.display().to_string()]);
                if let Some(p) = pflash {
                    a.extend([
                        "-drive".into(),
                        format!(
                            "if=pflash,unit=1,format=raw,file={},readonly=on",
                            p.display()
                        ),
                    ]);
                }
            }
            Start::Kernel {
                kernel,
                initrd,
                append,
            } => a.extend([
                "-no-reboot".into(),
                "-kernel".into(),
                kernel.display().to_string(),
                "-initrd".into(),
                initrd.display().to_string(),
                "-append".into(),
                append.to_string(),
            ]),
        }
        for (i, d) in disks.iter().enumerate() {
            let options = if d.options.is_empty() {
                String::new()
            } else {
                format!(",{}", d.options)
            };
            a.extend([
                "-drive".into(),
                format!(
                    "if=none,id=d{i},file={},format=raw{options}",
                    d.path.display()
                ),
                "-device".into(),
                format!("{},drive=d{i}", m.disk),
            ]);
        }
        a
    }
}

/// The qemu-virt recipe's machine (`images/qemu-virt.toml`'s `[qemu]`), for callers below the
/// image layer (the disk tests) and the kernel checks of boards that have none.
pub fn qemu_virt_machine() -> Result<Machine> {
    let recipe: PathBuf = crate::paths::project_root().join("images/qemu-virt.toml");
    Machine::of_recipe(&recipe)?
        .with_context(|| format!("{} has no [qemu] table", recipe.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q() -> QemuVirt {
        QemuVirt {
            qemu: "/q".into(),
            uboot: "/u-boot.bin".into(),
            qemu_version: String::new(),
            uboot_version: String::new(),
        }
    }

    #[test]
    fn the_qemu_virt_recipe_names_its_machine() {
        let m = qemu_virt_machine().unwrap();
        assert_eq!(
            (m.machine.as_str(), m.cpu.as_str(), m.memory_mib, m.smp),
            ("virt", "cortex-a76", 2048, 2)
        );
    }

    #[test]
    fn one_command_line_for_u_boot_and_for_a_kernel() {
        let m = qemu_virt_machine().unwrap();
        let pflash = Path::new("/p.img");
        let disk = Path::new("/d.img");
        let upd = Path::new("/u.img");
        let a = q()
            .command(
                &m,
                Start::UBoot {
                    pflash: Some(pflash),
                },
                &[
                    Disk {
                        path: disk,
                        options: "",
                    },
                    Disk {
                        path: upd,
                        options: "readonly=on",
                    },
                ],
                Some(",hostfwd=tcp::8080-:8080"),
                &["-monitor", "none"],
            )
            .join(" ");
        assert_eq!(
            a,
            "/q -M virt -cpu cortex-a76 -m 2048 -smp 2 -nographic \
             -nic user,model=virtio-net-pci,hostfwd=tcp::8080-:8080 \
             -global virtio-net-pci.romfile= -monitor none -bios /u-boot.bin \
             -drive if=pflash,unit=1,format=raw,file=/p.img,readonly=on \
             -drive if=none,id=d0,file=/d.img,format=raw -device virtio-blk-pci,drive=d0 \
             -drive if=none,id=d1,file=/u.img,format=raw,readonly=on -device virtio-blk-pci,drive=d1"
        );
        let k = q().command(
            &m,
            Start::Kernel {
                kernel: Path::new("/Image"),
                initrd: Path::new("/initrd"),
                append: "console=ttyAMA0 panic=-1",
            },
            &[],
            None,
            &[],
        );
        assert!(k.join(" ").ends_with(
            "-nic none -no-reboot -kernel /Image -initrd /initrd -append console=ttyAMA0 panic=-1"
        ));
        // The command line is one argument each, never split on spaces.
        assert!(k.iter().any(|s| s == "console=ttyAMA0 panic=-1"));
    }
}
