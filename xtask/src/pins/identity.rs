//! Identities of the RK3588 vendor blobs that `pins lock` accepts: what a file must be, read
//! from its structure, not only a string it contains.
//! - `librknnrt`: an aarch64 ELF shared object exporting the rknn matmul API kiln loads, with
//!   the pinned version string, and not kiln's stand-in (whose version string says SIMULATOR).
//! - `idbloader`: a Rockchip boot image with the v2 header RK3568/RK3588 boot ROMs read, magic
//!   `RKNS` at byte 0 (u-boot `tools/rkcommon.c`, `RK_MAGIC_V2`), not the RC4-scrambled v1
//!   header of older SoCs.
//! - `u-boot-itb`: a FIT (flattened device tree, magic `d00dfeed`) with an image node whose
//!   `os` is U-Boot, named by a configuration's `firmware` or `loadables`.

use anyhow::{bail, ensure, Context, Result};

/// The symbols kiln's NPU backend resolves (`runtime/src/backend/npu`): without them the
/// library is not one kiln can use.
pub const RKNN_MATMUL_SYMBOLS: &[&str] = &[
    "rknn_matmul_create",
    "rknn_matmul_set_io_mem",
    "rknn_matmul_run",
    "rknn_matmul_destroy",
    "rknn_create_mem",
    "rknn_destroy_mem",
    "rknn_mem_sync",
];

/// What only kiln's stand-in says about itself (`runtime/rknn-standin`).
pub const STANDIN_MARKER: &str = "kiln-standin";

/// `bytes` is the real `librknnrt.so` of `version`.
pub fn librknnrt(bytes: &[u8], version: &str) -> Result<()> {
    let elf = goblin::elf::Elf::parse(bytes).context("not an ELF file")?;
    ensure!(
        elf.header.e_machine == goblin::elf::header::EM_AARCH64,
        "an ELF for machine {} ({}), not aarch64",
        elf.header.e_machine,
        goblin::elf::header::machine_to_str(elf.header.e_machine)
    );
    ensure!(
        elf.header.e_type == goblin::elf::header::ET_DYN,
        "not a shared object (ELF type {})",
        elf.header.e_type
    );
    let exported: std::collections::BTreeSet<&str> = elf
        .dynsyms
        .iter()
        .filter(|s| !s.is_import())
        .filter_map(|s| elf.dynstrtab.get_at(s.st_name))
        .collect();
    let missing: Vec<&str> = RKNN_MATMUL_SYMBOLS
        .iter()
        .copied()
        .filter(|s| !exported.contains(s))
        .collect();
    ensure!(
        missing.is_empty(),
        "does not export the rknn matmul API: missing {}",
        missing.join(", ")
    );
    if find(bytes, STANDIN_MARKER.as_bytes()).is_some() {
        bail!(
            "this is kiln's NPU stand-in (it carries {STANDIN_MARKER:?}), not Rockchip's librknnrt"
        );
    }
    let want = format!("librknnrt version: {version}");
    ensure!(
        find(bytes, want.as_bytes()).is_some(),
        "does not contain {want:?}"
    );
    Ok(())
}

/// The v2 Rockchip boot header's magic, as stored (little-endian 0x534e4b52).
pub const RKNS: &[u8; 4] = b"RKNS";

/// `bytes` is an idbloader for RK3588: the v2 boot header (`RKNS`) and something after it.
pub fn idbloader(bytes: &[u8]) -> Result<()> {
    let head = bytes.get(..4).context("shorter than a boot header")?;
    ensure!(
        head == RKNS,
        "starts with {}, not the Rockchip v2 boot header magic RKNS ({}): RK3588's boot ROM \
         reads only that header",
        hex::encode(head),
        hex::encode(RKNS)
    );
    // The header fills the first 2 KiB (`struct header0_info_v2`); the image follows it.
    ensure!(
        bytes.len() > 2048,
        "{} bytes: a v2 header with no loader after it",
        bytes.len()
    );
    Ok(())
}

/// A node of a flattened device tree: its path and properties (name, raw value).
#[derive(Debug, Default)]
struct Node {
    path: String,
    props: Vec<(String, Vec<u8>)>,
    /// Where each property's value starts in the device tree, in `props` order.
    offsets: Vec<usize>,
}

impl Node {
    fn strings(&self, name: &str) -> Vec<String> {
        self.props
            .iter()
            .filter(|(n, _)| n == name)
            .flat_map(|(_, v)| {
                v.split(|b| *b == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

fn be32(b: &[u8], at: usize) -> Result<u32> {
    let s = b
        .get(at..at + 4)
        .with_context(|| format!("device tree cut at byte {at}"))?;
    Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

/// Every node of the FDT in `b`, in order (devicetree specification v0.4, ch. 5).
fn fdt_nodes(b: &[u8]) -> Result<Vec<Node>> {
    ensure!(
        be32(b, 0)? == 0xd00d_feed,
        "not a flattened device tree (no d00dfeed magic)"
    );
    let off_struct = be32(b, 8)? as usize;
    let off_strings = be32(b, 12)? as usize;
    let (mut at, mut stack, mut nodes) = (off_struct, Vec::<String>::new(), Vec::<Node>::new());
    let mut open: Vec<usize> = Vec::new();
    loop {
        let token = be32(b, at)?;
        at += 4;
        match token {
            1 => {
                let rest = b.get(at..).context("device tree cut in a node name")?;
                let len = rest
                    .iter()
                    .position(|c| *c == 0)
                    .context("node name without its NUL")?;
                let name = String::from_utf8_lossy(&rest[..len]).into_owned();
                at += (len + 1).div_ceil(4) * 4;
                stack.push(name);
                open.push(nodes.len());
                nodes.push(Node {
                    path: stack.join("/"),
                    props: Vec::new(),
                    offsets: Vec::new(),
                });
            }
            2 => {
                stack
                    .pop()
                    .context("device tree closes a node it never opened")?;
                open.pop();
            }
            3 => {
                let len = be32(b, at)? as usize;
                let nameoff = be32(b, at + 4)? as usize;
                let value = b
                    .get(at + 8..at + 8 + len)
                    .context("property value outside the device tree")?
                    .to_vec();
                at += 8 + len.div_ceil(4) * 4;
                let names = b
                    .get(off_strings + nameoff..)
                    .context("property name outside")?;
                let nlen = names
                    .iter()
                    .position(|c| *c == 0)
                    .context("property name")?;
                let name = String::from_utf8_lossy(&names[..nlen]).into_owned();
                let node = *open.last().context("property outside any node")?;
                nodes[node].props.push((name, value));
                nodes[node].offsets.push(at - len.div_ceil(4) * 4);
            }
            4 => {}
            9 => break,
            t => bail!("device tree token {t:#x} at byte {}", at - 4),
        }
    }
    Ok(nodes)
}

/// `bytes` is a U-Boot FIT: an `/images` node whose `os` is U-Boot, named by a configuration's
/// `firmware` or `loadables`.
pub fn uboot_itb(bytes: &[u8]) -> Result<()> {
    let nodes = fdt_nodes(bytes).context("not a FIT image")?;
    let images: Vec<&Node> = nodes
        .iter()
        .filter(|n| n.path.starts_with("/images/") && n.path.matches('/').count() == 2)
        .collect();
    ensure!(
        !images.is_empty(),
        "a device tree with no /images: not a FIT"
    );
    let uboot: Vec<&str> = images
        .iter()
        .filter(|n| {
            n.strings("os")
                .iter()
                .any(|o| o.eq_ignore_ascii_case("u-boot"))
        })
        .filter_map(|n| n.path.rsplit('/').next())
        .collect();
    ensure!(
        !uboot.is_empty(),
        "no image of the FIT has os = \"u-boot\" (images: {})",
        images
            .iter()
            .filter_map(|n| n.path.rsplit('/').next())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let named = nodes
        .iter()
        .filter(|n| n.path.starts_with("/configurations/"))
        .flat_map(|n| [n.strings("firmware"), n.strings("loadables")].concat())
        .any(|name| uboot.contains(&name.as_str()));
    ensure!(
        named,
        "the U-Boot image(s) {} are not any configuration's firmware or loadables",
        uboot.join(", ")
    );
    Ok(())
}

/// One image of a FIT: its node name, `os`, `type`, load address and where its data lies in the
/// bytes that were read.
#[derive(Clone, Debug)]
pub struct FitImage {
    pub name: String,
    pub os: String,
    pub kind: String,
    pub load: Option<u64>,
    pub data: std::ops::Range<usize>,
}

/// What [`rockchip_loader`] read: where the FIT starts, its images (those some configuration
/// loads), and the end of the loader (the FIT's last data byte) in the bytes read.
#[derive(Clone, Debug)]
pub struct RockchipLoader {
    pub fit_offset: usize,
    pub images: Vec<FitImage>,
    pub end: usize,
}

impl RockchipLoader {
    pub fn with_os(&self, os: &str) -> Vec<&FitImage> {
        self.images
            .iter()
            .filter(|i| i.os.eq_ignore_ascii_case(os))
            .collect()
    }
}

/// A big-endian cell list (`<hi lo>` or `<lo>`) as one number.
fn cells(v: &[u8]) -> Option<u64> {
    match v.len() {
        4 => Some(u32::from_be_bytes(v.try_into().ok()?) as u64),
        8 => Some(u64::from_be_bytes(v.try_into().ok()?)),
        _ => None,
    }
}

/// `bytes` (from the RK3588 loader's first sector, LBA 64) is a mainline U-Boot
/// `u-boot-rockchip.bin`: the v2 boot header `RKNS` (TPL + SPL) and, after it on a sector
/// boundary, a FIT whose configurations load an `os = "u-boot"` image and at least one
/// `os = "arm-trusted-firmware"` image (BL31), each with its data inside `bytes` (embedded
/// `data`, or external `data-offset`/`data-position` + `data-size` as binman writes them).
pub fn rockchip_loader(bytes: &[u8]) -> Result<RockchipLoader> {
    idbloader(bytes).context("the loader's boot header")?;
    // The first device tree on a sector boundary that has `/images` (SPL carries its own plain
    // device tree, which is no FIT).
    let fit_offset = (4..bytes.len() / 512)
        .map(|s| s * 512)
        .filter(|&at| bytes[at..].starts_with(&[0xd0, 0x0d, 0xfe, 0xed]))
        .find(|&at| {
            fdt_nodes(&bytes[at..]).is_ok_and(|n| n.iter().any(|n| n.path.starts_with("/images/")))
        })
        .context(
            "no FIT (a device tree with /images, on a sector boundary) after the boot header",
        )?;
    let fit = &bytes[fit_offset..];
    let nodes = fdt_nodes(fit).with_context(|| format!("the FIT at byte {fit_offset:#x}"))?;
    let totalsize = be32(fit, 4)? as usize;
    let external_base = fit_offset + totalsize.div_ceil(4) * 4;
    let loaded: std::collections::BTreeSet<String> = nodes
        .iter()
        .filter(|n| n.path.starts_with("/configurations/"))
        .flat_map(|n| [n.strings("firmware"), n.strings("loadables")].concat())
        .collect();
    let mut images = Vec::new();
    for n in nodes
        .iter()
        .filter(|n| n.path.starts_with("/images/") && n.path.matches('/').count() == 2)
    {
        let name = n.path.rsplit('/').next().unwrap_or_default().to_string();
        if !loaded.contains(&name) {
            continue;
        }
        let prop = |k: &str| {
            n.props
                .iter()
                .find(|(p, _)| p == k)
                .map(|(_, v)| v.as_slice())
        };
        let data = if let Some(i) = n.props.iter().position(|(p, _)| p == "data") {
            // Embedded: the value's place inside the FIT.
            let start = fit_offset + n.offsets[i];
            start..start + n.props[i].1.len()
        } else {
            let size = prop("data-size")
                .and_then(cells)
                .with_context(|| format!("FIT image {name}: no data and no data-size"))?
                as usize;
            let start = if let Some(o) = prop("data-offset").and_then(cells) {
                external_base + o as usize
            } else {
                fit_offset
                    + prop("data-position")
                        .and_then(cells)
                        .with_context(|| format!("FIT image {name}: no data-offset"))?
                        as usize
            };
            start..start + size
        };
        ensure!(
            data.end <= bytes.len(),
            "FIT image {name}: its data ({:#x}..{:#x}) lies beyond the loader's {} bytes",
            data.start,
            data.end,
            bytes.len()
        );
        images.push(FitImage {
            os: n.strings("os").into_iter().next().unwrap_or_default(),
            kind: n.strings("type").into_iter().next().unwrap_or_default(),
            load: prop("load").and_then(cells),
            name,
            data,
        });
    }
    let loader = RockchipLoader {
        fit_offset,
        end: images
            .iter()
            .map(|i| i.data.end)
            .max()
            .unwrap_or(external_base)
            .max(fit_offset + totalsize),
        images,
    };
    let names = || {
        loader
            .images
            .iter()
            .map(|i| format!("{} (os {:?})", i.name, i.os))
            .collect::<Vec<_>>()
            .join(", ")
    };
    ensure!(
        !loader.with_os("u-boot").is_empty(),
        "the FIT at byte {fit_offset:#x} loads no os = \"u-boot\" image (loads: {})",
        names()
    );
    ensure!(
        !loader.with_os("arm-trusted-firmware").is_empty(),
        "the FIT at byte {fit_offset:#x} loads no os = \"arm-trusted-firmware\" image: no BL31 \
         (loads: {})",
        names()
    );
    Ok(loader)
}

/// Every loadable segment of the BL31 ELF `elf` is, byte for byte, the data of one of the
/// loader's BL31 images loaded at its physical address (binman splits BL31 that way).
pub fn bl31_in_loader(bytes: &[u8], loader: &RockchipLoader, elf: &[u8]) -> Result<usize> {
    let e = goblin::elf::Elf::parse(elf).context("BL31 is not an ELF file")?;
    let atf = loader.with_os("arm-trusted-firmware");
    let mut n = 0;
    for ph in e
        .program_headers
        .iter()
        .filter(|p| p.p_type == goblin::elf::program_header::PT_LOAD && p.p_filesz > 0)
    {
        let seg = elf
            .get(ph.p_offset as usize..(ph.p_offset + ph.p_filesz) as usize)
            .context("a BL31 segment lies outside its ELF")?;
        let img = atf
            .iter()
            .find(|i| i.load == Some(ph.p_paddr))
            .with_context(|| {
                format!(
                    "no BL31 image of the FIT loads at {:#x} (BL31 segment of {} bytes)",
                    ph.p_paddr, ph.p_filesz
                )
            })?;
        ensure!(
            &bytes[img.data.clone()] == seg,
            "FIT image {} (load {:#x}) is not the pinned BL31's segment at that address",
            img.name,
            ph.p_paddr
        );
        n += 1;
    }
    ensure!(n > 0, "BL31 has no loadable segment");
    Ok(n)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use xshell::cmd;

    fn mkimage(dir: &Path, args: &[&str], out: &str) -> Vec<u8> {
        let sh = xshell::Shell::new().unwrap();
        sh.change_dir(dir);
        cmd!(sh, "mkimage {args...} {out}")
            .quiet()
            .ignore_stdout()
            .run()
            .unwrap();
        std::fs::read(dir.join(out)).unwrap()
    }

    #[test]
    fn idbloader_is_the_v2_rockchip_header() {
        let dir = tempfile::tempdir().unwrap();
        let spl: Vec<u8> = (0..30000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(dir.path().join("spl.bin"), &spl).unwrap();
        // U-Boot's own mkimage (u-boot-tools 2023.01 knows rk3568, whose boot ROM reads the
        // same v2 header as RK3588's).
        let v2 = mkimage(
            dir.path(),
            &["-n", "rk3568", "-T", "rksd", "-d", "spl.bin"],
            "v2.img",
        );
        idbloader(&v2).unwrap();
        // An RK3399 idbloader: the RC4-scrambled v1 header.
        let v1 = mkimage(
            dir.path(),
            &["-n", "rk3399", "-T", "rksd", "-d", "spl.bin"],
            "v1.img",
        );
        let e = idbloader(&v1).unwrap_err().to_string();
        assert!(
            e.contains("not the Rockchip v2 boot header magic RKNS"),
            "{e}"
        );
        // A FIT is not an idbloader either.
        std::fs::write(dir.path().join("ub.bin"), &spl).unwrap();
        let fit = mkimage(
            dir.path(),
            &[
                "-f", "auto", "-A", "arm64", "-O", "u-boot", "-T", "firmware", "-C", "none", "-a",
                "0x200000", "-d", "ub.bin",
            ],
            "u.itb",
        );
        assert!(idbloader(&fit).is_err());
        assert!(uboot_itb(&v2).is_err());
    }

    #[test]
    fn uboot_itb_is_a_fit_naming_u_boot() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ub.bin"), vec![0x5au8; 20000]).unwrap();
        let base = [
            "-f", "auto", "-A", "arm64", "-C", "none", "-a", "0x200000", "-d", "ub.bin",
        ];
        let uboot = mkimage(
            dir.path(),
            &[&base[..], &["-O", "u-boot", "-T", "firmware"]].concat(),
            "u.itb",
        );
        uboot_itb(&uboot).unwrap();
        // A FIT that carries a Linux kernel: the FDT magic alone would have accepted it.
        let kernel = mkimage(
            dir.path(),
            &[
                &base[..],
                &["-O", "linux", "-T", "kernel", "-e", "0x200000"],
            ]
            .concat(),
            "k.itb",
        );
        assert_eq!(&kernel[..4], &[0xd0, 0x0d, 0xfe, 0xed]);
        let e = uboot_itb(&kernel).unwrap_err().to_string();
        assert!(e.contains("no image of the FIT has os = \"u-boot\""), "{e}");
    }

    /// A real aarch64 shared object built with the cross compiler, exporting `symbols` and
    /// holding `text`.
    fn so(dir: &Path, name: &str, symbols: &[&str], text: &str) -> Vec<u8> {
        let mut c = format!("const char kiln_test_version[] = \"{text}\";\n");
        for s in symbols {
            c.push_str(&format!("int {s}(void) {{ return 0; }}\n"));
        }
        let src = dir.join(format!("{name}.c"));
        std::fs::write(&src, c).unwrap();
        let out = dir.join(format!("{name}.so"));
        let sh = xshell::Shell::new().unwrap();
        cmd!(sh, "aarch64-linux-gnu-gcc -shared -fPIC -o {out} {src}")
            .quiet()
            .run()
            .unwrap();
        std::fs::read(out).unwrap()
    }

    #[test]
    fn librknnrt_is_aarch64_with_the_matmul_api_and_not_the_standin() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let real = so(
            d,
            "real",
            RKNN_MATMUL_SYMBOLS,
            "librknnrt version: 2.3.2 (c3fde2ed3@2025-03-14T16:29:21)",
        );
        librknnrt(&real, "2.3.2").unwrap();
        // The stand-in's version string, same symbols: refused by its marker.
        let standin = so(
            d,
            "standin",
            RKNN_MATMUL_SYMBOLS,
            "librknnrt version: 2.3.2 (kiln-standin SIMULATOR)",
        );
        let e = librknnrt(&standin, "2.3.2").unwrap_err().to_string();
        assert!(e.contains("kiln's NPU stand-in"), "{e}");
        // The version string but not the matmul API.
        let partial = so(
            d,
            "partial",
            &["rknn_init", "rknn_matmul_create"],
            "librknnrt version: 2.3.2 (x)",
        );
        let e = librknnrt(&partial, "2.3.2").unwrap_err().to_string();
        assert!(e.contains("missing rknn_matmul_set_io_mem"), "{e}");
        // Another version.
        let e = librknnrt(&real, "2.1.0").unwrap_err().to_string();
        assert!(
            e.contains("does not contain \"librknnrt version: 2.1.0\""),
            "{e}"
        );
        // The host's own ELF (x86_64): not aarch64.
        let host = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let e = librknnrt(&host, "2.3.2").unwrap_err().to_string();
        assert!(e.contains("not aarch64"), "{e}");
    }
}
