//! Kernel modules for the initramfs, from a Debian kernel image package (which ships no
//! `modules.dep`: Debian's postinst runs depmod). Every `.ko.xz` of the package is read once, its
//! `.modinfo` (`depends=`, `softdep=`, `alias=`) taken from the ELF; the closure of a recipe's
//! list is what kmod's `modprobe --show-depends` loads (hard dependencies, soft `pre:`/`post:`
//! dependencies resolved through aliases; built-in modules need nothing); the files are
//! decompressed and a `modules.dep` written in the format busybox `modprobe` reads (a module's
//! dependencies listed so that loading them last to first works, as depmod lists them).

use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

/// One module of the package.
#[derive(Clone, Debug, Default)]
pub struct Module {
    /// The module's name (`_` for `-`, as the kernel names it in `/proc/modules`).
    pub name: String,
    /// Its path under `lib/modules/<release>/`, without `.xz` (`kernel/fs/ext4/ext4.ko`).
    pub path: String,
    pub depends: Vec<String>,
    pub soft_pre: Vec<String>,
    pub soft_post: Vec<String>,
    pub aliases: Vec<String>,
    /// The `.ko.xz` as the package ships it.
    pub xz: Vec<u8>,
}

/// The modules of one kernel package.
#[derive(Debug, Default)]
pub struct Package {
    pub release: String,
    pub modules: BTreeMap<String, Module>,
    /// Built-in modules' names and aliases (`modules.builtin`, `modules.builtin.modinfo`).
    pub builtin: BTreeSet<String>,
    pub builtin_aliases: Vec<String>,
}

/// `dw_mmc-rockchip` → `dw_mmc_rockchip`.
pub fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The name of a module file: `kernel/drivers/mmc/host/dw_mmc-rockchip.ko.xz` → `dw_mmc_rockchip`.
fn name_of_path(p: &str) -> String {
    let f = p.rsplit('/').next().unwrap_or(p);
    normalize(f.trim_end_matches(".xz").trim_end_matches(".ko"))
}

/// The `key=value` strings of an ELF64 little-endian object's `.modinfo` section.
pub fn modinfo(elf: &[u8]) -> Result<Vec<(String, String)>> {
    let u16_at = |o: usize| -> Result<u16> {
        Ok(u16::from_le_bytes(
            elf.get(o..o + 2).context("truncated ELF")?.try_into()?,
        ))
    };
    let u32_at = |o: usize| -> Result<u32> {
        Ok(u32::from_le_bytes(
            elf.get(o..o + 4).context("truncated ELF")?.try_into()?,
        ))
    };
    let u64_at = |o: usize| -> Result<u64> {
        Ok(u64::from_le_bytes(
            elf.get(o..o + 8).context("truncated ELF")?.try_into()?,
        ))
    };
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) {
        bail!("not a 64-bit little-endian ELF object");
    }
    let shoff = usize::try_from(u64_at(0x28)?)?;
    let shentsize = usize::from(u16_at(0x3a)?);
    let shnum = usize::from(u16_at(0x3c)?);
    let shstrndx = usize::from(u16_at(0x3e)?);
    let section = |i: usize| -> Result<(u32, usize, usize)> {
        let h = shoff + i * shentsize;
        Ok((
            u32_at(h)?,
            usize::try_from(u64_at(h + 0x18)?)?,
            usize::try_from(u64_at(h + 0x20)?)?,
        ))
    };
    let (_, str_off, str_size) = section(shstrndx)?;
    let strtab = elf
        .get(str_off..str_off + str_size)
        .context("section names outside the file")?;
    for i in 0..shnum {
        let (name, off, size) = section(i)?;
        let n = strtab
            .get(name as usize..)
            .and_then(|s| s.split(|&b| b == 0).next())
            .unwrap_or_default();
        if n == b".modinfo" {
            let data = elf
                .get(off..off + size)
                .context(".modinfo outside the file")?;
            return Ok(data
                .split(|&b| b == 0)
                .filter_map(|kv| {
                    let kv = String::from_utf8_lossy(kv);
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_string(), v.to_string()))
                })
                .collect());
        }
    }
    bail!("no .modinfo section")
}

/// A module from its decompressed bytes (`rel`: its path under `lib/modules/<release>/`).
pub fn module_of(rel: &str, ko: &[u8], xz: Vec<u8>) -> Result<Module> {
    let mut m = Module {
        name: name_of_path(rel),
        path: rel.trim_end_matches(".xz").to_string(),
        xz,
        ..Module::default()
    };
    for (k, v) in modinfo(ko).with_context(|| format!("the .modinfo of {rel}"))? {
        match k.as_str() {
            "depends" => m
                .depends
                .extend(v.split(',').filter(|s| !s.is_empty()).map(normalize)),
            "alias" => m.aliases.push(v),
            // `softdep=pre: a b post: c`
            "softdep" => {
                let mut post = false;
                for w in v.split_whitespace() {
                    match w {
                        "pre:" => post = false,
                        "post:" => post = true,
                        w if post => m.soft_post.push(w.to_string()),
                        w => m.soft_pre.push(w.to_string()),
                    }
                }
            }
            _ => {}
        }
    }
    Ok(m)
}

/// Every module of a Debian kernel image package, read in one pass over its data.
pub fn read_package(deb: &Path, release: &str) -> Result<Package> {
    let prefix = format!("usr/lib/modules/{release}/");
    let mut pkg = Package {
        release: release.to_string(),
        ..Package::default()
    };
    crate::archive::with_data_tar(deb, |tar| {
        for e in tar.entries()? {
            let mut e = e?;
            let p = crate::archive::entry_path(&e)?;
            let Some(rel) = p.strip_prefix(&prefix) else {
                continue;
            };
            if rel.ends_with(".ko.xz") {
                let mut xz = Vec::new();
                e.read_to_end(&mut xz)?;
                let mut ko = Vec::new();
                xz2::read::XzDecoder::new(&xz[..])
                    .read_to_end(&mut ko)
                    .with_context(|| format!("decompressing {p}"))?;
                let m = module_of(rel, &ko, xz)?;
                pkg.modules.insert(m.name.clone(), m);
            } else if rel == "modules.builtin" {
                let mut s = String::new();
                e.read_to_string(&mut s)?;
                pkg.builtin.extend(s.lines().map(name_of_path));
            } else if rel == "modules.builtin.modinfo" {
                let mut b = Vec::new();
                e.read_to_end(&mut b)?;
                for kv in b.split(|&c| c == 0) {
                    let kv = String::from_utf8_lossy(kv);
                    if let Some((_, alias)) = kv.split_once(".alias=") {
                        pkg.builtin_aliases.push(alias.to_string());
                    }
                }
            } else if rel.ends_with(".ko") || rel.ends_with(".ko.gz") || rel.ends_with(".ko.zst") {
                bail!("{p}: only .ko.xz modules are read (Debian's compression)");
            }
        }
        Ok(())
    })?;
    if pkg.modules.is_empty() {
        bail!("{} holds no modules under /{prefix}", deb.display());
    }
    Ok(pkg)
}

/// `fnmatch` with `*` and `?` (module aliases' wildcards; `[…]` classes taken literally).
fn glob(pat: &str, s: &str) -> bool {
    let (p, s): (Vec<char>, Vec<char>) = (pat.chars().collect(), s.chars().collect());
    let (mut pi, mut si, mut star, mut mark) = (0, 0, None, 0);
    while si < s.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = si;
            pi += 1;
        } else if let Some(st) = star {
            pi = st + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

impl Package {
    /// What loading `name` means: the module of that name; nothing for a built-in one; else
    /// every module with a matching alias (none when a built-in alias matches).
    fn resolve(&self, name: &str) -> Result<Vec<String>> {
        let n = normalize(name);
        if self.modules.contains_key(&n) {
            return Ok(vec![n]);
        }
        if self.builtin.contains(&n) {
            return Ok(Vec::new());
        }
        let by_alias: Vec<String> = self
            .modules
            .values()
            .filter(|m| m.aliases.iter().any(|a| glob(a, name)))
            .map(|m| m.name.clone())
            .collect();
        if !by_alias.is_empty() {
            return Ok(by_alias);
        }
        if self.builtin_aliases.iter().any(|a| glob(a, name)) {
            return Ok(Vec::new());
        }
        bail!(
            "no module or alias {name:?} in the {} modules",
            self.release
        )
    }

    /// The modules loading `wanted` loads, in a load order (each after what it needs), as
    /// kmod's `modprobe` would: soft `pre:` dependencies, hard dependencies, the module, soft
    /// `post:` ones. A listed module that is built in is an error (the list would say nothing).
    pub fn closure(&self, wanted: &[String]) -> Result<Vec<String>> {
        let mut order = Vec::new();
        let mut seen = BTreeSet::new();
        for w in wanted {
            let n = normalize(w);
            if self.builtin.contains(&n) {
                bail!(
                    "module {w} is built into {}: drop it from the list",
                    self.release
                );
            }
            if !self.modules.contains_key(&n) {
                bail!("no module {w} in the {} modules", self.release);
            }
            self.visit(&n, &mut seen, &mut order, &mut Vec::new())?;
        }
        Ok(order)
    }

    fn visit(
        &self,
        n: &str,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<String>,
        path: &mut Vec<String>,
    ) -> Result<()> {
        if seen.contains(n) {
            return Ok(());
        }
        if path.iter().any(|p| p == n) {
            // A soft dependency cycle (e.g. a post: back to its module): kmod loads each once.
            return Ok(());
        }
        let m = self.modules.get(n).with_context(|| {
            format!(
                "{} needs module {n}, which the package lacks",
                path.join(" → ")
            )
        })?;
        path.push(n.to_string());
        for s in &m.soft_pre {
            for r in self
                .resolve(s)
                .with_context(|| format!("softdep pre: of {n}"))?
            {
                self.visit(&r, seen, order, path)?;
            }
        }
        for d in &m.depends {
            self.visit(d, seen, order, path)?;
        }
        path.pop();
        if seen.insert(n.to_string()) {
            order.push(n.to_string());
        }
        path.push(n.to_string());
        for s in &m.soft_post {
            for r in self
                .resolve(s)
                .with_context(|| format!("softdep post: of {n}"))?
            {
                self.visit(&r, seen, order, path)?;
            }
        }
        path.pop();
        Ok(())
    }

    /// The hard dependencies of `n`, transitively, each after the ones that need it (depmod's
    /// order: a loader goes from the last to the first).
    fn hard_deps(&self, n: &str) -> Vec<String> {
        fn post(p: &Package, n: &str, seen: &mut BTreeSet<String>, out: &mut Vec<String>) {
            if let Some(m) = p.modules.get(n) {
                for d in &m.depends {
                    if seen.insert(d.clone()) {
                        post(p, d, seen, out);
                        out.push(d.clone());
                    }
                }
            }
        }
        let mut out = Vec::new();
        post(self, n, &mut BTreeSet::new(), &mut out);
        out.reverse();
        out
    }

    /// `modules.dep` for `mods` (paths relative to `lib/modules/<release>/`, sorted by path).
    pub fn modules_dep(&self, mods: &[String]) -> String {
        let mut lines: Vec<String> = mods
            .iter()
            .filter_map(|n| self.modules.get(n))
            .map(|m| {
                let deps: Vec<&str> = self
                    .hard_deps(&m.name)
                    .iter()
                    .filter_map(|d| self.modules.get(d).map(|x| x.path.as_str()))
                    .collect();
                format!(
                    "{}:{}{}",
                    m.path,
                    if deps.is_empty() { "" } else { " " },
                    deps.join(" ")
                )
            })
            .collect();
        lines.sort();
        lines.iter().map(|l| format!("{l}\n")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(name: &str, depends: &[&str], pre: &[&str], aliases: &[&str]) -> Module {
        Module {
            name: normalize(name),
            path: format!("kernel/{name}.ko"),
            depends: depends.iter().map(|d| normalize(d)).collect(),
            soft_pre: pre.iter().map(|s| s.to_string()).collect(),
            aliases: aliases.iter().map(|s| s.to_string()).collect(),
            ..Module::default()
        }
    }

    fn pkg() -> Package {
        let mut p = Package {
            release: "6.12.118+deb13-arm64".into(),
            builtin: ["crc16_builtin".to_string()].into(),
            builtin_aliases: vec!["crypto-sha256".into()],
            ..Package::default()
        };
        for x in [
            m(
                "ext4",
                &["jbd2", "mbcache"],
                &["crypto-crc32c"],
                &["fs-ext4"],
            ),
            m("jbd2", &[], &["crypto-crc32c"], &[]),
            m("mbcache", &[], &[], &[]),
            m("crc32c_generic", &[], &[], &["crypto-crc32c", "crc32c"]),
            m(
                "dm-verity",
                &["dm-bufio", "dm-mod"],
                &["crypto-sha256"],
                &[],
            ),
            m("dm-bufio", &["dm-mod"], &[], &[]),
            m("dm-mod", &[], &[], &[]),
            m(
                "r8169",
                &["libphy"],
                &["realtek"],
                &["pci:v000010ECd00008125sv*"],
            ),
            m(
                "realtek",
                &["libphy"],
                &[],
                &["mdio:0000000000011100110010??????????"],
            ),
            m("libphy", &[], &[], &[]),
        ] {
            p.modules.insert(x.name.clone(), x);
        }
        p
    }

    /// Each module comes after everything it needs; soft dependencies through aliases; a
    /// built-in alias needs nothing.
    #[test]
    fn closure_orders_dependencies_first() {
        let p = pkg();
        let c = p
            .closure(&["ext4".into(), "dm-verity".into(), "r8169".into()])
            .unwrap();
        assert_eq!(
            c,
            [
                "crc32c_generic",
                "jbd2",
                "mbcache",
                "ext4",
                "dm_mod",
                "dm_bufio",
                "dm_verity",
                "libphy",
                "realtek",
                "r8169"
            ]
        );
        let pos = |n: &str| c.iter().position(|x| x == n).unwrap();
        for (a, b) in [
            ("dm_mod", "dm_bufio"),
            ("jbd2", "ext4"),
            ("realtek", "r8169"),
        ] {
            assert!(pos(a) < pos(b), "{a} before {b}");
        }
    }

    #[test]
    fn closure_refuses_unknown_and_builtin_names() {
        let p = pkg();
        let e = p.closure(&["no-such".into()]).unwrap_err().to_string();
        assert!(e.contains("no module no-such"), "{e}");
        let e = p
            .closure(&["crc16-builtin".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("built into"), "{e}");
        let mut q = pkg();
        q.modules
            .get_mut("ext4")
            .unwrap()
            .depends
            .push("gone".into());
        let e = format!("{:#}", q.closure(&["ext4".into()]).unwrap_err());
        assert!(e.contains("needs module gone"), "{e}");
    }

    /// busybox modprobe loads a line's dependencies last to first: dm_mod before dm_bufio.
    #[test]
    fn modules_dep_lists_dependents_first() {
        let p = pkg();
        let dep = p.modules_dep(&["dm_verity".into(), "dm_mod".into(), "dm_bufio".into()]);
        assert_eq!(
            dep,
            "kernel/dm-bufio.ko: kernel/dm-mod.ko\nkernel/dm-mod.ko:\n\
             kernel/dm-verity.ko: kernel/dm-bufio.ko kernel/dm-mod.ko\n"
        );
    }

    #[test]
    fn globs_match_like_fnmatch() {
        assert!(glob(
            "pci:v000010ECd00008125sv*",
            "pci:v000010ECd00008125sv0000"
        ));
        assert!(glob("a?c", "abc"));
        assert!(!glob("a?c", "abbc"));
        assert!(glob("*", ""));
        assert!(!glob("crc32c", "crc32"));
    }

    #[test]
    fn modinfo_reads_the_section() {
        // A minimal ELF64 LE with a section-name table and a .modinfo section.
        let shstr = b"\0.shstrtab\0.modinfo\0";
        let info = b"depends=jbd2,mbcache\0softdep=pre: crc32c post: x\0alias=fs-ext4\0";
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        let shstr_off = elf.len();
        elf.extend_from_slice(shstr);
        let info_off = elf.len();
        elf.extend_from_slice(info);
        let shoff = elf.len();
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        let sh = |name: u32, off: usize, size: usize| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            h
        };
        elf.extend(sh(0, 0, 0));
        elf.extend(sh(1, shstr_off, shstr.len()));
        elf.extend(sh(11, info_off, info.len()));
        let m = module_of("kernel/fs/ext4/ext4.ko.xz", &elf, Vec::new()).unwrap();
        assert_eq!(m.name, "ext4");
        assert_eq!(m.path, "kernel/fs/ext4/ext4.ko");
        assert_eq!(m.depends, ["jbd2", "mbcache"]);
        assert_eq!(m.soft_pre, ["crc32c"]);
        assert_eq!(m.soft_post, ["x"]);
        assert_eq!(m.aliases, ["fs-ext4"]);
        assert!(modinfo(&elf[..40]).is_err());
    }
}
