//! A board recipe, `images/<board>.toml`: its kernel, bootloader blobs, NPU runtime, partition
//! sizes and what the self-check expects. Parsed once into checked types.

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
}

/// Partition sizes in MiB. The models partition is as large as its erofs image needs.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partitions {
    pub boot_mib: u64,
    pub data_mib: u64,
}

impl Default for Partitions {
    fn default() -> Self {
        Partitions {
            boot_mib: 64,
            data_mib: 32,
        }
    }
}

/// A bootloader blob written raw at an LBA, outside the partition table.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBlob {
    pub input: String,
    pub lba: u64,
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
    pub partitions: Partitions,
    pub raw: Vec<RawBlob>,
    pub expect: Expect,
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
            if b.lba < 34 || b.lba >= FIRST_PARTITION_LBA {
                bail!(
                    "{}: blob {} at LBA {} must lie between the GPT (LBA 34) and the first \
                     partition (LBA {FIRST_PARTITION_LBA})",
                    path.display(),
                    b.input,
                    b.lba
                );
            }
        }
        Ok(Board {
            name: raw.board.name,
            path,
            npu: raw.board.npu,
            kernel,
            console: raw.board.console,
            npu_runtime,
            npu_budget_mib: raw.board.npu_budget_mib,
            partitions: raw.partitions,
            raw: raw.raw,
            expect: raw.expect,
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
        }
        let mut expect = self.expect.clone();
        expect.kernel_config = kernel_config;
        let body = toml::to_string(&Out {
            board: BoardOut {
                name: &self.name,
                npu: self.npu,
                npu_budget_mib: self.npu_budget_mib,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_boards_load() {
        let q = Board::load("qemu-virt").unwrap();
        assert_eq!(q.npu_runtime, NpuRuntime::Standin);
        assert!(q.raw.is_empty());
        let r = Board::load("rock-5b").unwrap();
        assert_eq!(
            r.raw.iter().map(|b| b.lba).collect::<Vec<_>>(),
            vec![64, 16384]
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
}
