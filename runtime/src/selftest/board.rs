//! The board file (`/etc/kiln/board.toml`, written by the image pipeline): what this board is and
//! what the build pinned for it. Parsed once, at the edge, into [`Board`].

use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::Path;

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Board {
    pub board: BoardInfo,
    #[serde(default)]
    pub expect: Expect,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct BoardInfo {
    pub name: String,
    /// True when the board has an RK3588-class NPU the checks must find.
    #[serde(default)]
    pub npu: bool,
    /// NPU memory for converted weights, MiB (from the board recipe; else the NPU backend's
    /// default, 1 GiB).
    #[serde(default)]
    pub npu_budget_mib: Option<u64>,
    /// On a board with an NPU its kernel cannot drive (`npu = false`): why, said by the npu
    /// checks instead of a bare "no NPU" (rock-5b: "mainline kernel: no NPU driver; …").
    #[serde(default)]
    pub npu_note: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct Expect {
    /// `uname -r` of the kernel the build pinned, e.g. `6.1.192-kiln`.
    #[serde(default)]
    pub kernel_release: Option<String>,
    /// The board's config fragment: `CONFIG_X=y`, `CONFIG_Y="s"`, `# CONFIG_Z is not set`.
    #[serde(default)]
    pub kernel_config: Vec<String>,
    /// `/proc/cpuinfo` feature names the fast paths need (`asimd`, `asimddp`, `fphp`, …).
    #[serde(default)]
    pub cpu_features: Vec<String>,
    /// rknpu driver version, e.g. `0.9.8`.
    #[serde(default)]
    pub npu_driver: Option<String>,
    /// librknnrt version, e.g. `2.3.2`.
    #[serde(default)]
    pub npu_runtime: Option<String>,
    /// The governor every cpufreq policy must have.
    #[serde(default)]
    pub governors: Option<String>,
    /// The DDR devfreq (dmc) governor.
    #[serde(default)]
    pub ddr_governor: Option<String>,
    /// cpufreq policy name → the rate it must run at (`scaling_cur_freq`, kHz).
    #[serde(default)]
    pub cpu_khz: std::collections::BTreeMap<String, u64>,
    /// The DDR devfreq rate (`cur_freq`, Hz).
    #[serde(default)]
    pub ddr_hz: Option<u64>,
    /// The check ids the report must hold (a report missing one is FAIL).
    #[serde(default)]
    pub checks: Vec<String>,
    /// The least memory read bandwidth `memory.bandwidth` may measure, GB/s.
    #[serde(default)]
    pub memory_read_gbs: Option<f64>,
}

impl Board {
    pub fn parse(text: &str) -> Result<Board> {
        let b: Board = toml::from_str(text)?;
        anyhow::ensure!(!b.board.name.is_empty(), "[board] name is empty");
        Ok(b)
    }

    pub fn load(path: &Path) -> Result<Board> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading board file {}", path.display()))?;
        Board::parse(&text).with_context(|| format!("parsing board file {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_qemu_board_file() {
        let b = Board::parse(
            r##"
[board]
name = "qemu-virt"
npu = false
[expect]
kernel_release = "6.1.192-kiln"
kernel_config = ["CONFIG_EROFS_FS=y", "# CONFIG_MODULES is not set"]
cpu_features = ["asimd", "asimddp"]
npu_runtime = "2.3.2"
governors = "performance"
"##,
        )
        .unwrap();
        assert_eq!(b.board.name, "qemu-virt");
        assert!(!b.board.npu);
        assert_eq!(b.expect.kernel_release.as_deref(), Some("6.1.192-kiln"));
        assert_eq!(b.expect.kernel_config.len(), 2);
        assert_eq!(b.expect.npu_driver, None);
    }

    #[test]
    fn rejects_a_board_without_a_name() {
        assert!(Board::parse("[expect]\nkernel_release = \"x\"\n").is_err());
    }
}
