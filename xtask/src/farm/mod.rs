//! Farms: the LAVA jobs in `images/lava/` held to LAVA's own job schema and to a real console;
//! labgrid's environments and kiln's board suite in [`labgrid`], the QEMU board as a remote place
//! (coordinator, exporter, ser2net on loopback) in [`remote`].
//!
//! The schema is lava-common's (`lava_common.schemas.validate`, voluptuous), taken from Debian
//! bookworm's `lava-common` package (pinned by version and sha256, fetched through kiln's private
//! apt configuration into the download cache, unpacked with `dpkg-deb -x`) without installing
//! LAVA: its only dependencies, voluptuous and PyYAML, go into a venv. Each job must validate,
//! and a broken copy of each (no `device_type`; a monitor without its `pattern`) must not. Then
//! each job's monitor regex, applied as LAVA's monitor applies it (Python `re.search` line by
//! line between `start` and `end`), must turn a boot's serial console into exactly the report's
//! checks as test cases, `pass`/`fail`/`skip` through its `fixupdict`.

pub mod labgrid;
pub mod remote;

use crate::apt::{Apt, Download};
use crate::pins::{Cache, Sha256};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use xshell::cmd;

const LAVA_COMMON: &str = "lava-common";
const LAVA_COMMON_VERSION: &str = "2023.01-2";
const LAVA_COMMON_SHA256: &str = "fb91e37f3d45b1183a7af91ee1e19e9314b95cd3f05658ebfd71da312b1a6876";
/// What lava-common 2023.01-2 depends on (python3-voluptuous 0.12.2-1 in bookworm).
const PY_PINS: &str = "voluptuous==0.12.2 PyYAML==6.0.2";

/// The LAVA jobs kiln ships, one per board with a LAVA device type.
pub const JOBS: &[&str] = &["qemu-virt.yaml", "rock-5b.yaml"];

fn jobs_dir() -> PathBuf {
    crate::paths::project_root().join("images/lava")
}

/// lava-common's Python package, unpacked under `target/kiln/lava-common/`.
fn lava_common() -> Result<PathBuf> {
    let want: Sha256 = LAVA_COMMON_SHA256.parse()?;
    let name = format!("{LAVA_COMMON} {LAVA_COMMON_VERSION}");
    let cache = Cache::user()?;
    let deb = match cache.get(&name, &want)? {
        Some(p) => p,
        None => {
            let apt = Apt::kiln();
            apt.ensure_lists(&[])?;
            let tmp = tempfile::tempdir().context("a directory for apt-get download")?;
            let spec = format!("{LAVA_COMMON}={LAVA_COMMON_VERSION}");
            match apt.download(&spec, tmp.path())? {
                Download::Got(p) => cache.put(&name, &p, Some(&want))?.1,
                Download::NotFound(e) => bail!("{spec} is not in Debian's archive: {e}"),
            }
        }
    };
    let dir = crate::paths::target_dir().join("kiln/lava-common");
    let pkg = dir.join("usr/lib/python3/dist-packages");
    let stamp = dir.join("kiln-sha256.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(LAVA_COMMON_SHA256) {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let sh = crate::paths::shell()?;
        cmd!(sh, "dpkg-deb -x {deb} {dir}")
            .run()
            .context("unpacking lava-common")?;
        std::fs::write(&stamp, LAVA_COMMON_SHA256)?;
    }
    Ok(pkg)
}

/// The jobs against LAVA's schema and against `console` (a boot's serial log), whose report's
/// checks (`ids`, `statuses` as `pass`/`fail`/`skip`) the monitors must find, all and only.
pub fn check_lava_jobs(console: &Path, checks: &[(String, String)]) -> Result<()> {
    let pkg = lava_common()?;
    let python = crate::doctor::pinned_venv("lava-schema-venv", PY_PINS)?;
    let script = crate::paths::project_root().join("xtask/tests/lava_jobs.py");
    let want = checks
        .iter()
        .map(|(id, st)| format!("{id}={st}"))
        .collect::<Vec<_>>()
        .join(",");
    let dir = jobs_dir();
    let jobs: Vec<PathBuf> = JOBS.iter().map(|j| dir.join(j)).collect();
    let sh = crate::paths::shell()?;
    cmd!(sh, "{python} {script} {console} {want} {jobs...}")
        .env("PYTHONPATH", &pkg)
        .run()
        .context("the LAVA jobs against lava-common's schema and a boot's console")
}
