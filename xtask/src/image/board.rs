//! A board recipe, `images/<board>.toml`: its kernel, bootloader blobs, NPU runtime, partition
//! sizes and what the self-check expects. Parsed once into checked types.

use crate::bootloader::BootloaderSpec;
use crate::kernel::KernelSpec;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBoard {
    board: RawBoardTable,
    #[serde(default)]
    partitions: Partitions,
    expect: Expect,
    #[serde(default)]
    raw: Vec<RawBlob>,
    /// U-Boot built from pinned inputs (`crate::bootloader`).
    bootloader: Option<BootloaderSpec>,
    serve: Option<Serve>,
    network: Option<Network>,
    #[serde(default)]
    update: Update,
    /// `[fleet]`: the hawkBit client (`kiln fleet`), checked here as the board parses it.
    fleet: Option<toml::Table>,
    #[serde(default)]
    modules: Modules,
    /// `[qemu]`: the machine the image boots on under emulation (only a board QEMU can boot
    /// whole: U-Boot, the disk, the NIC).
    qemu: Option<crate::tools_root::machine::Machine>,
    /// Supplied inputs (read by `pins`).
    #[serde(default)]
    #[allow(dead_code)]
    input: Vec<toml::Value>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBoardTable {
    name: String,
    npu: bool,
    kernel: String,
    console: String,
    /// `standin` (the rknn-standin crate, built here), an input name (a supplied
    /// `librknnrt.so`), or `none`.
    npu_runtime: String,
    /// NPU memory for converted weights, MiB (the runtime's default: 1024; cap 4096).
    #[serde(default)]
    npu_budget_mib: Option<u64>,
    /// With `npu = false` on a board that has one: why it is not used, which the npu checks say.
    #[serde(default)]
    npu_note: Option<String>,
}

/// `[update]`: what the board's RAUC trusts.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Update {
    /// PEM certificate(s) the board's RAUC accepts bundles signed under (a path from the project
    /// root). None: kiln's public development certificate, with a warning.
    pub keyring: Option<String>,
    /// The recipe's own "yes" to the development keyring (an emulated board on a desk): its
    /// images build with it without `--dev-keys`. A real board's recipe leaves it out.
    #[serde(default)]
    pub dev_keys: bool,
}

/// `[modules]`: kernel modules init loads before it looks for partitions (a kernel taken from a
/// Debian package: its MMC, PMIC and file system drivers are modules). Their dependency closure
/// goes into the initramfs ([`crate::kernel_modules`]).
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Modules {
    pub load: Vec<String>,
    /// Firmware files (paths below `/lib/firmware`) that modules of the closure request, from
    /// the pinned Debian package `firmware_input`: they go into the initramfs beside them.
    #[serde(default)]
    pub firmware: Vec<String>,
    #[serde(default)]
    pub firmware_input: Option<String>,
}

/// Partition sizes in MiB. The models partition is as large as its erofs image needs.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partitions {
    /// p1 `bootctl` (FAT): `boot.scr` and `kiln/abstate.env` only.
    #[serde(default = "default_bootctl_mib")]
    pub bootctl_mib: u64,
    /// Each of p2 `boot_a` and p3 `boot_b` (FAT): a whole system.
    pub boot_mib: u64,
    pub data_mib: u64,
}

fn default_bootctl_mib() -> u64 {
    8
}

impl Default for Partitions {
    fn default() -> Self {
        Partitions {
            bootctl_mib: default_bootctl_mib(),
            boot_mib: 64,
            data_mib: 32,
        }
    }
}

/// A bootloader blob written raw at an LBA, outside the partition table: a pinned input
/// (`input = NAME`) or a product of the recipe's `[bootloader]` build (`bootloader = FILE`, one
/// of `crate::bootloader::PRODUCTS`).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBlob {
    #[serde(default)]
    pub input: String,
    pub bootloader: Option<String>,
    pub lba: u64,
}

impl RawBlob {
    /// The input name, or the built product's file name.
    pub fn name(&self) -> &str {
        self.bootloader.as_deref().unwrap_or(&self.input)
    }
}

/// `[serve]`: what `/init` starts once the self-check has a verdict (`kiln serve`). After a PASS
/// it serves the model; after a FAIL it answers `/health` and `/kiln/report` only, with 503s that
/// name the failed checks.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Serve {
    /// A `*.gguf` file name on the models partition, or `auto`: the first one there that is not
    /// one of the self-check's fixtures (none: the report is served without a model).
    pub model: String,
    pub port: u16,
    #[serde(default = "default_parallel")]
    pub parallel: u32,
    /// KV cache length per sequence (default: the model's context length, at most 2048).
    pub ctx: Option<u32>,
    /// A file on the board holding the bearer key every request but `/health` must carry,
    /// provisioned per board, never in the image (default [`DEFAULT_API_KEY_FILE`], on `data`).
    /// Missing at boot: `kiln serve` listens on loopback only, unless `insecure`.
    pub api_key_file: Option<String>,
    /// Serve on the network without a key, said in so many words (a QEMU board behind the host's
    /// forwarded port, a closed lab). `/init` says so on the console and `/health` names it.
    #[serde(default)]
    pub insecure: bool,
}

/// Where a board's API key is looked for when the recipe names no other file: the `data`
/// partition, which no image or update writes (`cargo xtask flash --api-key FILE` puts it there).
pub const DEFAULT_API_KEY_FILE: &str = "/data/kiln/api-key";

fn default_parallel() -> u32 {
    4
}

/// `[network]`: how the board joins the network (for `kiln serve`; nothing else listens).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    pub interface: String,
    /// `dhcp` (busybox udhcpc) or `static` (`address`, `gateway`).
    pub mode: String,
    /// `a.b.c.d/prefix`, for `static`.
    pub address: Option<String>,
    pub gateway: Option<String>,
    /// Seconds DHCP may take; it runs beside the self-check and never delays it.
    #[serde(default = "default_net_timeout")]
    pub timeout_s: u32,
}

fn default_net_timeout() -> u32 {
    10
}

/// What the self-check expects of the running system (`[expect]`, copied into
/// `/etc/kiln/board.toml` with the fragment's options added).
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub kernel_release: String,
    #[serde(default)]
    pub kernel_config: Vec<String>,
    pub cpu_features: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub npu_driver: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub npu_runtime: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub governors: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ddr_governor: Option<String>,
    /// cpufreq policy → pinned rate (kHz); the DDR devfreq rate (Hz); the least read bandwidth
    /// (GB/s) `memory.bandwidth` may measure.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub cpu_khz: std::collections::BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ddr_hz: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_read_gbs: Option<f64>,
    /// The check ids the boot report must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NpuRuntime {
    /// The `rknn-standin` crate, cross-built and installed as `/usr/lib/librknnrt.so`.
    Standin,
    /// A supplied `librknnrt.so` (the named pinned input).
    Supplied(String),
    None,
}

#[derive(Clone, Debug)]
pub struct Board {
    pub name: String,
    pub path: PathBuf,
    pub npu: bool,
    pub kernel: KernelSpec,
    pub console: String,
    pub npu_runtime: NpuRuntime,
    pub npu_budget_mib: Option<u64>,
    pub npu_note: Option<String>,
    pub partitions: Partitions,
    pub raw: Vec<RawBlob>,
    pub bootloader: Option<BootloaderSpec>,
    pub expect: Expect,
    pub serve: Option<Serve>,
    pub network: Option<Network>,
    pub update: Update,
    /// `[fleet]` as `/etc/kiln/fleet.toml`, and the CA it names (copied to
    /// [`FLEET_CA_ON_BOARD`]).
    pub fleet: Option<Fleet>,
    /// `[modules] load`: empty for a kernel with everything built in.
    pub modules: Vec<String>,
    /// `[modules] firmware_input` and `firmware`: files below `/lib/firmware` for the modules.
    pub firmware: Option<(String, Vec<String>)>,
    /// The machine QEMU emulates for this board (`[qemu]`); `None`: the board is not emulated.
    pub qemu: Option<crate::tools_root::machine::Machine>,
}

/// `[fleet]` as the board gets it.
#[derive(Clone, Debug)]
pub struct Fleet {
    pub toml: String,
    pub ca: Option<Vec<u8>>,
}

/// Where the recipe's `[fleet] ca` (a PEM file beside the recipe) goes in the image.
pub const FLEET_CA_ON_BOARD: &str = "/etc/kiln/fleet-ca.pem";

/// The recipe's `[fleet]` table: its `ca` (a file relative to `images/`) read, the table as the
/// board's `kiln fleet` parses it (refused here, by name, if it would refuse it there).
fn fleet_of(recipe: &std::path::Path, t: toml::Table) -> Result<Fleet> {
    let mut t = t;
    let ca = match t.get("ca") {
        None => None,
        Some(toml::Value::String(rel)) => {
            let p = recipe
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join(rel);
            let pem = std::fs::read(&p)
                .with_context(|| format!("[fleet] ca: reading {}", p.display()))?;
            if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
                bail!("[fleet] ca {}: no PEM certificate in it", p.display());
            }
            t.insert("ca".into(), toml::Value::String(FLEET_CA_ON_BOARD.into()));
            Some(pem)
        }
        Some(v) => bail!("[fleet] ca = {v}: a file name beside the recipe expected"),
    };
    let text = toml::to_string(&t).context("[fleet]")?;
    kiln_runtime::fleet::config::Config::parse(&text, "[fleet]")?;
    Ok(Fleet { toml: text, ca })
}

/// The LBA where the first partition starts (16 MiB): room for RK3588's blobs below it.
pub const FIRST_PARTITION_LBA: u64 = 32768;

impl Board {
    pub fn load(name: &str) -> Result<Board> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            bail!("board name {name:?}: letters, digits and '-' only");
        }
        let path = crate::paths::project_root()
            .join("images")
            .join(format!("{name}.toml"));
        let text = std::fs::read_to_string(&path).with_context(|| {
            let known: Vec<String> = std::fs::read_dir(crate::paths::project_root().join("images"))
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter_map(|e| {
                            e.file_name()
                                .to_str()?
                                .strip_suffix(".toml")
                                .map(String::from)
                        })
                        .collect()
                })
                .unwrap_or_default();
            format!(
                "no board {name:?} ({} missing); boards: {}",
                path.display(),
                known.join(", ")
            )
        })?;
        let raw: RawBoard =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if raw.board.name != name {
            bail!("{} names board {:?}", path.display(), raw.board.name);
        }
        let kernel = KernelSpec::load(&raw.board.kernel)?;
        let npu_runtime = match raw.board.npu_runtime.as_str() {
            "standin" => NpuRuntime::Standin,
            "none" => NpuRuntime::None,
            other => NpuRuntime::Supplied(other.to_string()),
        };
        for b in &raw.raw {
            match (&b.bootloader, b.input.is_empty()) {
                (Some(p), true) => {
                    if raw.bootloader.is_none() {
                        bail!(
                            "{}: blob {p} is built by [bootloader], which the recipe lacks",
                            path.display()
                        );
                    }
                    if !crate::bootloader::PRODUCTS.contains(&p.as_str()) {
                        bail!(
                            "{}: [bootloader] builds {}, not {p}",
                            path.display(),
                            crate::bootloader::PRODUCTS.join(", ")
                        );
                    }
                }
                (None, false) => {}
                _ => bail!(
                    "{}: a [[raw]] blob is either `input = NAME` or `bootloader = FILE`",
                    path.display()
                ),
            }
            if b.lba < 34 || b.lba >= FIRST_PARTITION_LBA {
                bail!(
                    "{}: blob {} at LBA {} must lie between the GPT (LBA 34) and the first \
                     partition (LBA {FIRST_PARTITION_LBA})",
                    path.display(),
                    b.name(),
                    b.lba
                );
            }
        }
        if raw.board.npu && raw.board.npu_note.is_some() {
            bail!(
                "{}: npu_note says why an NPU is not used: only with npu = false",
                path.display()
            );
        }
        if raw.modules.firmware.is_empty() != raw.modules.firmware_input.is_none() {
            bail!(
                "{}: [modules] firmware and firmware_input go together",
                path.display()
            );
        }
        if !raw.modules.load.is_empty() && kernel.prebuilt_release.is_none() {
            bail!(
                "{}: [modules] is for a kernel taken from a Debian package (prebuilt_release)",
                path.display()
            );
        }
        let fleet = match raw.fleet {
            Some(t) => {
                Some(fleet_of(&path, t).with_context(|| format!("{}: [fleet]", path.display()))?)
            }
            None => None,
        };
        Ok(Board {
            firmware: raw
                .modules
                .firmware_input
                .map(|i| (i, raw.modules.firmware)),
            modules: raw.modules.load,
            name: raw.board.name,
            path,
            npu: raw.board.npu,
            kernel,
            console: raw.board.console,
            npu_runtime,
            npu_budget_mib: raw.board.npu_budget_mib,
            npu_note: raw.board.npu_note,
            partitions: raw.partitions,
            raw: raw.raw,
            bootloader: raw.bootloader,
            expect: raw.expect,
            serve: raw.serve,
            network: raw.network,
            update: raw.update,
            fleet,
            qemu: raw.qemu,
        })
        .and_then(|b| {
            b.serve_env()
                .with_context(|| format!("{}: [serve] / [network]", b.path.display()))?;
            Ok(b)
        })
    }

    /// Every pins file the board uses, in order: its kernel's pins, the rootfs packages, the
    /// board's own recipe (its supplied inputs).
    pub fn pin_files(&self) -> Vec<PathBuf> {
        let root = crate::paths::project_root();
        vec![
            root.join("kernel-config")
                .join(&self.kernel.name)
                .join("pins.toml"),
            root.join("rootfs/packages.toml"),
            self.path.clone(),
        ]
    }

    /// `/etc/kiln/board.toml`: the board and what the self-check must find.
    pub fn board_toml(&self, kernel_config: Vec<String>) -> Result<String> {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            board: BoardOut<'a>,
            expect: Expect,
        }
        #[derive(serde::Serialize)]
        struct BoardOut<'a> {
            name: &'a str,
            npu: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            npu_budget_mib: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            npu_note: Option<&'a str>,
        }
        let mut expect = self.expect.clone();
        expect.kernel_config = kernel_config;
        let body = toml::to_string(&Out {
            board: BoardOut {
                name: &self.name,
                npu: self.npu,
                npu_budget_mib: self.npu_budget_mib,
                npu_note: self.npu_note.as_deref(),
            },
            expect,
        })?;
        Ok(format!(
            "# Generated by `cargo xtask image` from images/{}.toml and kernel-config/{}: what \
             the self-check expects.\n{body}",
            self.name, self.kernel.fragment
        ))
    }
}

impl Board {
    /// `/etc/kiln/serve.env`: `[serve]` and `[network]` as shell assignments that `/init`
    /// sources. Every value is checked here (a name, a number, an address), so nothing in it
    /// needs quoting and the init script never evaluates recipe text.
    pub fn serve_env(&self) -> Result<String> {
        let mut out = format!(
            "# Generated by `cargo xtask image` from images/{}.toml [serve] and [network]; \
             sourced by /init.\n",
            self.name
        );
        let plain = |what: &str, v: &str, extra: &str| -> Result<()> {
            if v.is_empty()
                || !v
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c) || extra.contains(c))
            {
                bail!("{what} {v:?}: letters, digits, '.', '_', '-'{extra} only");
            }
            Ok(())
        };
        match &self.serve {
            None => out.push_str("KILN_SERVE=\n"),
            Some(s) => {
                if s.model != "auto" {
                    plain("serve.model", &s.model, "")?;
                    if !s.model.ends_with(".gguf") {
                        bail!("serve.model {:?}: a *.gguf file name or auto", s.model);
                    }
                }
                if s.port == 0 {
                    bail!("serve.port 0");
                }
                if !(1..=64).contains(&s.parallel) {
                    bail!("serve.parallel {}: 1 to 64", s.parallel);
                }
                let key = s.api_key_file.as_deref().unwrap_or(DEFAULT_API_KEY_FILE);
                plain("serve.api_key_file", key, "/")?;
                if !key.starts_with('/') {
                    bail!("serve.api_key_file {key:?}: an absolute path on the board");
                }
                out.push_str(&format!(
                    "KILN_SERVE=1\nKILN_SERVE_MODEL={}\nKILN_SERVE_PORT={}\n\
                     KILN_SERVE_PARALLEL={}\nKILN_SERVE_CTX={}\nKILN_SERVE_API_KEY_FILE={}\n\
                     KILN_SERVE_INSECURE={}\n",
                    s.model,
                    s.port,
                    s.parallel,
                    s.ctx.map(|c| c.to_string()).unwrap_or_default(),
                    key,
                    u8::from(s.insecure)
                ));
            }
        }
        match &self.network {
            None => out.push_str("KILN_NET=\n"),
            Some(n) => {
                if n.interface.is_empty()
                    || n.interface.len() > 15
                    || !n.interface.chars().all(|c| c.is_ascii_alphanumeric())
                {
                    bail!(
                        "network.interface {:?}: a kernel interface name",
                        n.interface
                    );
                }
                let (address, gateway) = match n.mode.as_str() {
                    "dhcp" => {
                        if n.address.is_some() || n.gateway.is_some() {
                            bail!("network: address and gateway are for mode = \"static\"");
                        }
                        (String::new(), String::new())
                    }
                    "static" => {
                        let a = n
                            .address
                            .as_deref()
                            .context("network.mode static needs address = \"a.b.c.d/prefix\"")?;
                        let (ip, prefix) = a
                            .split_once('/')
                            .with_context(|| format!("network.address {a:?}: no /prefix"))?;
                        ip.parse::<std::net::Ipv4Addr>()
                            .with_context(|| format!("network.address {a:?}"))?;
                        prefix
                            .parse::<u8>()
                            .ok()
                            .filter(|p| (1..=32).contains(p))
                            .with_context(|| format!("network.address {a:?}: prefix 1 to 32"))?;
                        let g = match &n.gateway {
                            Some(g) => {
                                g.parse::<std::net::Ipv4Addr>()
                                    .with_context(|| format!("network.gateway {g:?}"))?;
                                g.clone()
                            }
                            None => String::new(),
                        };
                        (a.to_string(), g)
                    }
                    m => bail!("network.mode {m:?}: dhcp or static"),
                };
                if !(1..=300).contains(&n.timeout_s) {
                    bail!("network.timeout_s {}: 1 to 300", n.timeout_s);
                }
                out.push_str(&format!(
                    "KILN_NET={}\nKILN_NET_IFACE={}\nKILN_NET_ADDRESS={address}\n\
                     KILN_NET_GATEWAY={gateway}\nKILN_NET_TIMEOUT={}\n",
                    n.mode, n.interface, n.timeout_s
                ));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_boards_load() {
        let q = Board::load("qemu-virt").unwrap();
        assert_eq!(q.npu_runtime, NpuRuntime::Standin);
        assert!(q.raw.is_empty());
        // rock-5b: no NPU driver in its kernel, said; no npu checks required, no DDR rate
        // pinned; rock-5b-vendor keeps them.
        let p = Board::load("rock-5b").unwrap();
        assert!(!p.npu && p.npu_runtime == NpuRuntime::None);
        assert_eq!(
            p.npu_note.as_deref(),
            Some("mainline kernel: no NPU driver; inference on the CPU; for the NPU use rock-5b-vendor")
        );
        assert!(p
            .board_toml(Vec::new())
            .unwrap()
            .contains("npu_note = \"mainline kernel"));
        assert!(p.expect.ddr_hz.is_none() && p.expect.ddr_governor.is_none());
        let npu_checks = |b: &Board| {
            b.expect
                .checks
                .iter()
                .filter(|c| c.contains(".npu"))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert!(npu_checks(&p).is_empty(), "{:?}", npu_checks(&p));
        let r = Board::load("rock-5b-vendor").unwrap();
        assert!(npu_checks(&r).contains(&"model.matmul.npu".to_string()));
        assert!(npu_checks(&r).contains(&"model.nll.npu".to_string()));
        assert_eq!(
            r.raw.iter().map(|b| (b.name(), b.lba)).collect::<Vec<_>>(),
            vec![("u-boot-rockchip.bin", 64)]
        );
        assert!(r.expect.npu_driver.is_some());
        assert_eq!(r.npu_budget_mib, Some(1024));
        assert!(Board::load("../etc").is_err());
    }

    #[test]
    fn board_toml_has_expectations() {
        let q = Board::load("qemu-virt").unwrap();
        let t = q.board_toml(vec!["CONFIG_EROFS_FS=y".into()]).unwrap();
        let v: toml::Value = toml::from_str(&t).unwrap();
        assert_eq!(v["board"]["name"].as_str(), Some("qemu-virt"));
        assert_eq!(v["board"]["npu"].as_bool(), Some(false));
        assert_eq!(
            v["expect"]["kernel_config"][0].as_str(),
            Some("CONFIG_EROFS_FS=y")
        );
        assert!(v["expect"].get("ddr_governor").is_none());
    }

    #[test]
    fn serve_env_is_checked_plain_shell() {
        let mut q = Board::load("qemu-virt").unwrap();
        let env = q.serve_env().unwrap();
        assert!(env.contains("\nKILN_SERVE=1\n"), "{env}");
        assert!(env.contains("\nKILN_SERVE_PORT=8080\n"), "{env}");
        assert!(env.contains("\nKILN_NET=dhcp\n"), "{env}");
        // Only NAME=value lines of plain characters (and the comment).
        for l in env.lines().skip(1) {
            let (k, v) = l.split_once('=').unwrap();
            assert!(k.starts_with("KILN_"), "{l}");
            assert!(
                v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "./_-".contains(c)),
                "{l}"
            );
        }
        let serve = q.serve.clone().unwrap();
        for bad in ["a b.gguf", "$(reboot).gguf", "x.bin", "../x.gguf;"] {
            q.serve = Some(Serve {
                model: bad.into(),
                ..serve.clone()
            });
            assert!(q.serve_env().is_err(), "{bad}");
        }
        q.serve = Some(Serve {
            api_key_file: Some("data/key".into()),
            ..serve.clone()
        });
        assert!(q.serve_env().is_err());
        q.serve = Some(serve);
        let net = q.network.clone().unwrap();
        for (mode, addr, gw) in [
            ("static", None, None),
            ("static", Some("10.0.0.5"), None),
            ("static", Some("10.0.0.5/33"), None),
            ("static", Some("10.0.0.5/24"), Some("gw")),
            ("dhcp", Some("10.0.0.5/24"), None),
            ("ppp", None, None),
        ] {
            q.network = Some(Network {
                mode: mode.into(),
                address: addr.map(String::from),
                gateway: gw.map(String::from),
                ..net.clone()
            });
            assert!(q.serve_env().is_err(), "{mode} {addr:?} {gw:?}");
        }
        q.network = Some(Network {
            mode: "static".into(),
            address: Some("192.168.1.50/24".into()),
            gateway: Some("192.168.1.1".into()),
            ..net
        });
        let env = q.serve_env().unwrap();
        assert!(env.contains("\nKILN_NET_ADDRESS=192.168.1.50/24\nKILN_NET_GATEWAY=192.168.1.1\n"));
    }
}
