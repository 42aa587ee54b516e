//! `/etc/kiln/fleet.toml` (the recipe's `[fleet]` table, written by `cargo xtask image`) and the
//! board's own secret, the DDI token on `data` (never in the image: the same commit gives the same
//! image bytes whatever the token).

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where `cargo xtask image` puts the `[fleet]` table on the board.
pub const CONFIG_PATH: &str = "/etc/kiln/fleet.toml";
/// The token's default file (`cargo xtask flash --fleet-token FILE` writes it).
pub const DEFAULT_TOKEN_FILE: &str = "/data/kiln/fleet-token";
/// The action's state and the downloads, on `data` (survives updates and power cuts).
pub const DEFAULT_STATE_DIR: &str = "/data/kiln/fleet";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `https://host[:port]` (or `http://` for a lab): the hawkBit server's DDI root.
    pub server: String,
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// PEM file of the CA(s) that sign the server's certificate; without it, Mozilla's roots.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// How the controller id is derived: `serial` (the device tree's `serial-number`, RK3588's
    /// OTP serial), `mac:IFACE` (that interface's MAC), or `fixed:NAME` (labs).
    #[serde(default = "default_controller_id")]
    pub controller_id: String,
    /// Prepended to the derived id (`kiln-` gives `kiln-3a9f…`).
    #[serde(default)]
    pub controller_prefix: String,
    /// `target` (one token per board: hawkBit's target token) or `gateway` (one per tenant).
    #[serde(default = "default_token_kind")]
    pub token_kind: TokenKind,
    #[serde(default = "default_token_file")]
    pub token_file: PathBuf,
    /// The poll interval until the server names one (its `config.polling.sleep` wins after).
    #[serde(default = "default_poll")]
    pub poll_default_s: u64,
    /// An upper bound on the server's sleep (labs and tests; default: none).
    #[serde(default)]
    pub poll_max_s: Option<u64>,
    /// A download read that gets no byte for this long is a stall: resumed later (Range).
    #[serde(default = "default_stall")]
    pub stall_timeout_s: u64,
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenKind {
    Target,
    Gateway,
}

fn default_tenant() -> String {
    "DEFAULT".into()
}
fn default_controller_id() -> String {
    "serial".into()
}
fn default_token_kind() -> TokenKind {
    TokenKind::Target
}
fn default_token_file() -> PathBuf {
    DEFAULT_TOKEN_FILE.into()
}
fn default_poll() -> u64 {
    300
}
fn default_stall() -> u64 {
    60
}
fn default_state_dir() -> PathBuf {
    DEFAULT_STATE_DIR.into()
}

impl Config {
    pub fn parse(text: &str, what: &str) -> Result<Config> {
        let c: Config =
            toml::from_str(text).with_context(|| format!("{what}: not a fleet table"))?;
        c.check().with_context(|| format!("{what}: invalid"))?;
        Ok(c)
    }

    pub fn load(path: &Path) -> Result<Config> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Config::parse(&text, &path.display().to_string())
    }

    pub fn check(&self) -> Result<()> {
        let (scheme, rest) = self
            .server
            .split_once("://")
            .with_context(|| format!("server {:?}: no scheme (https://…)", self.server))?;
        if scheme != "https" && scheme != "http" {
            bail!(
                "server {:?}: scheme {scheme:?}, not https or http",
                self.server
            );
        }
        if rest.is_empty() || rest.contains(['?', '#', ' ']) {
            bail!("server {:?}: not host[:port][/path]", self.server);
        }
        if self.ca.is_some() && scheme != "https" {
            bail!("ca is set but server {:?} is not https", self.server);
        }
        id_part("tenant", &self.tenant)?;
        if !self.controller_prefix.is_empty() {
            id_part("controller_prefix", &self.controller_prefix)?;
        }
        match self.controller_id.split_once(':') {
            None if self.controller_id == "serial" => {}
            Some(("mac", iface)) if !iface.is_empty() && !iface.contains('/') => {}
            Some(("fixed", name)) => id_part("controller_id fixed:", name)?,
            _ => bail!(
                "controller_id {:?}: serial, mac:IFACE or fixed:NAME",
                self.controller_id
            ),
        }
        if self.poll_default_s == 0 || self.stall_timeout_s == 0 || self.poll_max_s == Some(0) {
            bail!("poll_default_s, poll_max_s and stall_timeout_s must be at least 1 second");
        }
        Ok(())
    }

    pub fn https(&self) -> bool {
        self.server.starts_with("https://")
    }

    pub fn stall_timeout(&self) -> Duration {
        Duration::from_secs(self.stall_timeout_s)
    }

    /// The controller id: the prefix, then what `controller_id` names, read under `root` (`/` on
    /// the board; a test's folder otherwise).
    pub fn controller(&self, root: &Path) -> Result<String> {
        let raw = match self.controller_id.split_once(':') {
            Some(("fixed", name)) => name.to_string(),
            Some(("mac", iface)) => {
                let p = root.join("sys/class/net").join(iface).join("address");
                let mac = std::fs::read_to_string(&p).with_context(|| {
                    format!("controller_id mac:{iface}: reading {}", p.display())
                })?;
                let mac: String = mac.trim().chars().filter(|c| *c != ':').collect();
                if mac.len() != 12
                    || mac.chars().any(|c| !c.is_ascii_hexdigit())
                    || mac == "000000000000"
                {
                    bail!(
                        "controller_id mac:{iface}: {} holds no MAC address",
                        p.display()
                    );
                }
                mac.to_ascii_lowercase()
            }
            _ => {
                let p = root.join("proc/device-tree/serial-number");
                let s = std::fs::read(&p).with_context(|| {
                    format!("controller_id serial: reading {} (a board without a serial number: use mac:IFACE)", p.display())
                })?;
                let s = String::from_utf8_lossy(&s);
                let s = s.trim_matches(|c: char| c == '\0' || c.is_whitespace());
                if s.is_empty() {
                    bail!("controller_id serial: {} is empty", p.display());
                }
                s.to_string()
            }
        };
        let id = format!("{}{raw}", self.controller_prefix);
        id_part("controller id", &id)?;
        Ok(id)
    }

    /// The token from `token_file`: one line of visible ASCII.
    pub fn token(&self) -> Result<String> {
        let p = &self.token_file;
        let t = std::fs::read_to_string(p).with_context(|| {
            format!(
                "no fleet token at {} (cargo xtask flash --fleet-token FILE puts it there)",
                p.display()
            )
        })?;
        let t = t.trim_end_matches(['\n', '\r']);
        if t.is_empty() || t.len() > 4096 || !t.bytes().all(|b| b.is_ascii_graphic()) {
            bail!(
                "{}: the token must be one line of 1 to 4096 visible ASCII characters",
                p.display()
            );
        }
        Ok(t.to_string())
    }
}

/// A tenant or controller id goes into the DDI URL's path: letters, digits, `.`, `_`, `-` only.
fn id_part(what: &str, s: &str) -> Result<()> {
    if s.is_empty()
        || s.len() > 128
        || !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        || s.starts_with('.')
    {
        bail!("{what} {s:?}: 1 to 128 of A-Z a-z 0-9 . _ - expected");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Result<Config> {
        Config::parse(
            &format!("server = \"https://hb.example.com\"\n{extra}"),
            "test",
        )
    }

    #[test]
    fn defaults_and_refusals_by_name() {
        let c = cfg("").unwrap();
        assert_eq!(c.tenant, "DEFAULT");
        assert_eq!(c.token_kind, TokenKind::Target);
        assert_eq!(c.token_file, Path::new(DEFAULT_TOKEN_FILE));
        for (bad, word) in [
            ("tenant = \"a/b\"", "tenant"),
            ("controller_id = \"uuid\"", "controller_id"),
            ("controller_id = \"mac:../x\"", "controller_id"),
            ("poll_default_s = 0", "poll_default_s"),
            ("surprise = 1", "surprise"),
            ("token_kind = \"bearer\"", "bearer"),
        ] {
            let e = format!("{:#}", cfg(bad).unwrap_err());
            assert!(e.contains(word), "{bad}: {e}");
        }
        let e = Config::parse("server = \"ftp://x\"", "t").unwrap_err();
        assert!(format!("{e:#}").contains("ftp"));
        let e = Config::parse("server = \"http://x\"\nca = \"/c.pem\"", "t").unwrap_err();
        assert!(format!("{e:#}").contains("not https"));
    }

    #[test]
    fn controller_ids() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("proc/device-tree")).unwrap();
        std::fs::write(
            d.path().join("proc/device-tree/serial-number"),
            b"9f3a1c0b7e\0",
        )
        .unwrap();
        std::fs::create_dir_all(d.path().join("sys/class/net/eth0")).unwrap();
        std::fs::write(
            d.path().join("sys/class/net/eth0/address"),
            "52:54:00:12:34:AB\n",
        )
        .unwrap();
        let c = cfg("controller_prefix = \"kiln-\"").unwrap();
        assert_eq!(c.controller(d.path()).unwrap(), "kiln-9f3a1c0b7e");
        let c = cfg("controller_id = \"mac:eth0\"").unwrap();
        assert_eq!(c.controller(d.path()).unwrap(), "5254001234ab");
        let c = cfg("controller_id = \"mac:eth1\"").unwrap();
        assert!(format!("{:#}", c.controller(d.path()).unwrap_err()).contains("eth1"));
        std::fs::write(d.path().join("proc/device-tree/serial-number"), b"\0").unwrap();
        let c = cfg("").unwrap();
        assert!(format!("{:#}", c.controller(d.path()).unwrap_err()).contains("empty"));
    }

    #[test]
    fn token_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        let c = cfg(&format!("token_file = {:?}", p.display().to_string())).unwrap();
        assert!(format!("{:#}", c.token().unwrap_err()).contains("--fleet-token"));
        std::fs::write(&p, "abc123\n").unwrap();
        assert_eq!(c.token().unwrap(), "abc123");
        std::fs::write(&p, "two words\n").unwrap();
        assert!(c.token().is_err());
    }
}
