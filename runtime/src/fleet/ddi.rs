//! hawkBit's Direct Device Integration API, as the board speaks it: poll, `configData`,
//! `deploymentBase`, feedback, `cancelAction`, and artifact downloads.
//!
//! Why not the `hawkbit` crate (the DDI client of the `hawkbit_mock` project): it puts the token
//! in every request its `reqwest` client sends, so an artifact link to another host (a CDN, or a
//! hostile server's choice) gets the board's credentials; its download has no resume, and it
//! brings `reqwest` with aws-lc (a CMake build of C for the board). `ureq` (rustls on ring) is
//! a small blocking client whose every knob this needs is explicit: redirects never carry
//! `Authorization`, no `Accept-Encoding` is sent and no body is ever decompressed (a compressed
//! bomb is only bytes that fail their size and hash), a per-read timeout finds a stalled
//! download, and response bodies are read with a limit.

use super::config::{Config, TokenKind};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;
use ureq::http::Uri;

/// Largest DDI answer read (a deployment with many artifacts is a few KiB).
const JSON_LIMIT: u64 = 1 << 20;

pub struct Ddi {
    agent: ureq::Agent,
    /// `{server}/{tenant}/controller/v1/{controller}`
    pub base: String,
    /// `scheme://host[:port]` of the configured server, and its [`Origin`].
    root: String,
    origin: Origin,
    /// The path of `base`: every API link must lie under it.
    base_path: String,
    /// The origin the server names itself by in its links (behind a proxy, or a test server on
    /// another address than the board reaches it by): links there are links to the server.
    named: std::cell::RefCell<Option<Origin>>,
    auth: String,
}

/// scheme, host, port: what decides whether a URL is the configured server.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Origin(String, String, u16);

fn origin(url: &str) -> Result<Origin> {
    let u: Uri = url.parse().with_context(|| format!("{url:?}: not a URL"))?;
    let scheme = u
        .scheme_str()
        .with_context(|| format!("{url:?}: no scheme"))?;
    let host = u.host().with_context(|| format!("{url:?}: no host"))?;
    let port = u
        .port_u16()
        .unwrap_or(if scheme == "https" { 443 } else { 80 });
    Ok(Origin(
        scheme.to_ascii_lowercase(),
        host.to_ascii_lowercase(),
        port,
    ))
}

/// What a poll says.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Poll {
    pub sleep: Option<Duration>,
    pub config_data: Option<String>,
    pub deployment: Option<String>,
    pub cancel: Option<String>,
    pub confirmation: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    pub id: String,
    /// `skip`, `attempt` or `forced`.
    pub download: String,
    pub update: String,
    /// `maintenanceWindow`: `available`, `unavailable`, or none (no window set).
    pub maintenance: Option<String>,
    pub artifacts: Vec<Artifact>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Artifact {
    pub filename: String,
    pub size: u64,
    pub sha256: String,
    pub url: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Execution {
    Proceeding,
    Closed,
    Canceled,
    Rejected,
    Downloaded,
}

impl Execution {
    fn as_str(self) -> &'static str {
        match self {
            Execution::Proceeding => "proceeding",
            Execution::Closed => "closed",
            Execution::Canceled => "canceled",
            Execution::Rejected => "rejected",
            Execution::Downloaded => "downloaded",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    Success,
    Failure,
    None,
}

impl Finished {
    fn as_str(self) -> &'static str {
        match self {
            Finished::Success => "success",
            Finished::Failure => "failure",
            Finished::None => "none",
        }
    }
}

/// The body of a deployment or cancel feedback, as hawkBit's DDI documents it.
pub fn feedback_body(
    id: &str,
    execution: Execution,
    finished: Finished,
    details: &[String],
) -> Value {
    json!({
        "id": id,
        "status": {
            "execution": execution.as_str(),
            "result": { "finished": finished.as_str() },
            "details": details,
        }
    })
}

/// Why a download stopped.
#[derive(Debug)]
pub enum DownloadError {
    /// Try again later: the bytes so far are kept and resumed (a stall, a cut, a 5xx).
    Retry(String),
    /// The artifact is not what the deployment announced (size, sha256): nothing is kept, the
    /// action fails.
    Bad(String),
}

impl std::fmt::Display for DownloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DownloadError::Retry(m) => write!(f, "{m} (will resume)"),
            DownloadError::Bad(m) => write!(f, "{m}"),
        }
    }
}

impl Ddi {
    pub fn new(cfg: &Config, controller: &str, token: &str) -> Result<Ddi> {
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(ca) = &cfg.ca {
            let pem = std::fs::read(ca)
                .with_context(|| format!("reading the fleet CA {}", ca.display()))?;
            let certs: Vec<_> = ureq::tls::parse_pem(&pem)
                .filter_map(|i| match i {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                })
                .collect::<std::result::Result<_, _>>()
                .with_context(|| format!("{}: not PEM", ca.display()))?;
            if certs.is_empty() {
                bail!("{}: no certificate in it", ca.display());
            }
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .tls_config(tls.build())
            .https_only(cfg.https())
            .http_status_as_error(false)
            .max_redirects(5)
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::Never)
            .accept_encoding("")
            .user_agent(format!("kiln/{}", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(cfg.stall_timeout()))
            .build()
            .into();
        let base = format!(
            "{}/{}/controller/v1/{}",
            cfg.server.trim_end_matches('/'),
            cfg.tenant,
            controller
        );
        let kind = match cfg.token_kind {
            TokenKind::Target => "TargetToken",
            TokenKind::Gateway => "GatewayToken",
        };
        let u: Uri = base
            .parse()
            .with_context(|| format!("{base:?}: not a URL"))?;
        let root = format!(
            "{}://{}",
            u.scheme_str().unwrap_or("https"),
            u.authority().map(|a| a.as_str()).unwrap_or_default()
        );
        Ok(Ddi {
            agent,
            origin: origin(&base)?,
            base_path: u.path().to_string(),
            root,
            base,
            named: Default::default(),
            auth: format!("{kind} {token}"),
        })
    }

    /// The URL an API link is followed at: its path (under this controller's) on the configured
    /// server, whatever host the link names. A server behind a proxy that names itself otherwise
    /// still works, and the token goes nowhere but the configured server. The host a link names
    /// is remembered as the server's own name for its artifact links ([`Ddi::download`]).
    fn api_url(&self, href: &str) -> Result<String> {
        let u: Uri = href
            .parse()
            .with_context(|| format!("the server's link {href:?}: not a URL"))?;
        let path = u.path();
        if path != self.base_path && !path.starts_with(&format!("{}/", self.base_path)) {
            bail!(
                "the server's link {href:?} is not under this controller's {}: not followed",
                self.base_path
            );
        }
        if u.scheme().is_some() {
            let o = origin(href)?;
            if o != self.origin {
                self.named.borrow_mut().get_or_insert(o);
            }
        }
        Ok(format!(
            "{}{}",
            self.root,
            u.path_and_query().map(|p| p.as_str()).unwrap_or(path)
        ))
    }

    fn get_json(&self, href: &str) -> Result<Value> {
        let url = &self.api_url(href)?;
        let mut r = self
            .agent
            .get(url)
            .header("Authorization", &self.auth)
            .header("Accept", "application/hal+json, application/json")
            .call()
            .with_context(|| format!("GET {url}"))?;
        let status = r.status();
        if !status.is_success() {
            bail!("GET {url}: HTTP {status}{}", hint(status.as_u16()));
        }
        let bytes = r
            .body_mut()
            .with_config()
            .limit(JSON_LIMIT)
            .read_to_vec()
            .with_context(|| {
                format!("GET {url}: reading the answer (at most {JSON_LIMIT} bytes)")
            })?;
        serde_json::from_slice(&bytes).with_context(|| format!("GET {url}: the answer is not JSON"))
    }

    fn send_json(&self, method: &str, href: &str, body: &Value) -> Result<()> {
        let url = &self.api_url(href)?;
        let bytes = serde_json::to_vec(body)?;
        let req = match method {
            "PUT" => self.agent.put(url),
            _ => self.agent.post(url),
        };
        let r = req
            .header("Authorization", &self.auth)
            .header("Content-Type", "application/json")
            .send(&bytes[..])
            .with_context(|| format!("{method} {url}"))?;
        let status = r.status();
        if !status.is_success() {
            bail!("{method} {url}: HTTP {status}{}", hint(status.as_u16()));
        }
        Ok(())
    }

    pub fn poll(&self) -> Result<Poll> {
        let v = self.get_json(&self.base)?;
        parse_poll(&v).with_context(|| format!("GET {}: not a DDI poll answer", self.base))
    }

    pub fn put_config_data(&self, url: &str, data: &serde_json::Map<String, Value>) -> Result<()> {
        self.send_json("PUT", url, &json!({ "mode": "merge", "data": data }))
    }

    pub fn deployment(&self, url: &str) -> Result<Deployment> {
        let v = self.get_json(url)?;
        parse_deployment(&v, self.origin.0 == "https")
            .with_context(|| format!("GET {url}: not a DDI deployment"))
    }

    pub fn feedback(
        &self,
        id: &str,
        execution: Execution,
        finished: Finished,
        details: &[String],
    ) -> Result<()> {
        self.post_feedback("deploymentBase", id, execution, finished, details)
    }

    /// `POST {base}/{resource}/{id}/feedback`: a deployment's or a cancel's.
    fn post_feedback(
        &self,
        resource: &str,
        id: &str,
        execution: Execution,
        finished: Finished,
        details: &[String],
    ) -> Result<()> {
        let url = format!("{}/{resource}/{id}/feedback", self.base);
        self.send_json(
            "POST",
            &url,
            &feedback_body(id, execution, finished, details),
        )
    }

    /// The action a `cancelAction` link names: (its id, the id of the action to stop).
    pub fn cancel_action(&self, url: &str) -> Result<(String, String)> {
        let v = self.get_json(url)?;
        let id = id_of(&v["id"]).context("cancelAction: no id")?;
        let stop =
            id_of(&v["cancelAction"]["stopId"]).context("cancelAction: no cancelAction.stopId")?;
        Ok((id, stop))
    }

    pub fn cancel_feedback(
        &self,
        id: &str,
        execution: Execution,
        finished: Finished,
        details: &[String],
    ) -> Result<()> {
        self.post_feedback("cancelAction", id, execution, finished, details)
    }

    /// Download `a` to `dest`: resumed from `dest`'s `.part` file with a Range request, read
    /// with the stall timeout, never more than the announced size, then its sha256 checked.
    /// The token is sent only when the link is on the configured server. `progress` gets the
    /// bytes held after each read. Refused before any byte is fetched when the announced size
    /// does not fit the free space of `dest`'s file system.
    pub fn download(
        &self,
        a: &Artifact,
        dest: &Path,
        mut progress: impl FnMut(u64),
    ) -> std::result::Result<(), DownloadError> {
        let part = dest.with_extension("part");
        let retry = |m: String| DownloadError::Retry(m);
        // Downloaded and verified at an earlier poll (an install waiting for its maintenance
        // window): checked again, not fetched again.
        if std::fs::metadata(dest).is_ok_and(|m| m.len() == a.size) {
            match sha256_file(dest) {
                Ok(sum) if sum == a.sha256 => return Ok(()),
                _ => {
                    let _ = std::fs::remove_file(dest);
                }
            }
        }
        let mut have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if have > a.size {
            have = 0;
        }
        let resumed = have > 0;
        if have < a.size {
            // A size the data partition cannot hold is refused before a byte is fetched: the
            // server's word would otherwise fill `data` (logs, state, the keys) at every poll.
            let dir = part.parent().unwrap_or(Path::new("."));
            let free = free_bytes(dir).map_err(|e| {
                DownloadError::Retry(format!("free space on {}: {e}", dir.display()))
            })?;
            let need = a.size - have;
            if need > free {
                let _ = std::fs::remove_file(&part);
                return Err(DownloadError::Bad(format!(
                    "{} ({} bytes) does not fit on {}: {need} more bytes needed, {free} free; \
                     not downloaded",
                    a.filename,
                    a.size,
                    dir.display()
                )));
            }
            // A link to the server (as configured, or as it names itself) is fetched from the
            // configured server with the token; any other host gets no token.
            let o = origin(&a.url).map_err(|e| DownloadError::Bad(format!("{e:#}")))?;
            let same = o == self.origin || self.named.borrow().as_ref() == Some(&o);
            let url = if same {
                let u: Uri = a
                    .url
                    .parse()
                    .map_err(|e| DownloadError::Bad(format!("{:?}: {e}", a.url)))?;
                format!(
                    "{}{}",
                    self.root,
                    u.path_and_query().map(|p| p.as_str()).unwrap_or("/")
                )
            } else {
                a.url.clone()
            };
            let mut req = self.agent.get(&url);
            if same {
                req = req.header("Authorization", &self.auth);
            }
            if have > 0 {
                req = req.header("Range", &format!("bytes={have}-"));
            }
            let mut r = req.call().map_err(|e| retry(format!("GET {}: {e}", url)))?;
            let status = r.status().as_u16();
            let append = match status {
                206 => {
                    let start = r
                        .headers()
                        .get("content-range")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("bytes "))
                        .and_then(|v| v.split('-').next())
                        .and_then(|v| v.parse::<u64>().ok());
                    if start != Some(have) {
                        let _ = std::fs::remove_file(&part);
                        return Err(retry(format!("GET {}: asked from byte {have}, the server answered a range from {start:?}: starting over", url)));
                    }
                    true
                }
                200 => false,
                416 if have == a.size => true,
                _ => return Err(retry(format!("GET {}: HTTP {status}{}", url, hint(status)))),
            };
            if !append {
                have = 0;
            }
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(append)
                .truncate(!append)
                .open(&part)
                .map_err(|e| DownloadError::Bad(format!("{}: {e}", part.display())))?;
            let mut body = r.body_mut().with_config().limit(u64::MAX).reader();
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = match body.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) => {
                        let _ = f.sync_all();
                        return Err(retry(format!(
                            "GET {}: {e} after {have} of {} bytes",
                            url, a.size
                        )));
                    }
                };
                if have + n as u64 > a.size {
                    drop(f);
                    let _ = std::fs::remove_file(&part);
                    return Err(DownloadError::Bad(format!(
                        "{}: the server sent more than the {} bytes the deployment announced",
                        a.filename, a.size
                    )));
                }
                f.write_all(&buf[..n])
                    .map_err(|e| DownloadError::Bad(format!("{}: {e}", part.display())))?;
                // On disk every 4 MiB: what a power cut leaves is resumed, not fetched again
                // (unsynced, ext4 keeps little or none of it).
                if (have >> 22) != ((have + n as u64) >> 22) {
                    f.sync_data()
                        .map_err(|e| DownloadError::Bad(format!("{}: {e}", part.display())))?;
                }
                have += n as u64;
                progress(have);
            }
            f.sync_all()
                .map_err(|e| DownloadError::Bad(format!("{}: {e}", part.display())))?;
            if have < a.size {
                return Err(retry(format!(
                    "GET {}: the body ended after {have} of {} bytes",
                    url, a.size
                )));
            }
        }
        let sum = sha256_file(&part).map_err(|e| DownloadError::Bad(format!("{e:#}")))?;
        if sum != a.sha256 {
            let _ = std::fs::remove_file(&part);
            if resumed {
                // What a power cut left may hold other bytes than were written: once more from
                // the first byte before the artifact counts as bad.
                return Err(retry(format!(
                    "{}: the resumed download does not verify (sha256 {sum}): starting over",
                    a.filename
                )));
            }
            return Err(DownloadError::Bad(format!(
                "{}: sha256 {sum}, the deployment announced {}: deleted",
                a.filename, a.sha256
            )));
        }
        std::fs::rename(&part, dest)
            .map_err(|e| DownloadError::Bad(format!("{}: {e}", dest.display())))?;
        Ok(())
    }
}

fn hint(status: u16) -> &'static str {
    match status {
        401 | 403 => " (the server refuses the token: check the fleet token and the controller id)",
        404 => " (unknown to the server: is this controller id a target on it?)",
        500..=599 => " (the server's fault: retried later)",
        _ => "",
    }
}

pub fn sha256_file(p: &Path) -> Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", p.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// An action id: hawkBit sends strings; some servers numbers.
fn id_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s)
            if !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b)) =>
        {
            Some(s.clone())
        }
        Value::Number(n) => n.as_u64().map(|n| n.to_string()),
        _ => None,
    }
}

/// `HH:MM:SS`, as hawkBit's `config.polling.sleep`.
pub fn parse_sleep(s: &str) -> Option<Duration> {
    let p: Vec<&str> = s.split(':').collect();
    let [h, m, sec] = p[..] else { return None };
    let (h, m, sec): (u64, u64, u64) = (h.parse().ok()?, m.parse().ok()?, sec.parse().ok()?);
    if m > 59 || sec > 59 {
        return None;
    }
    Some(Duration::from_secs(h * 3600 + m * 60 + sec))
}

pub fn parse_poll(v: &Value) -> Result<Poll> {
    if !v.is_object() {
        bail!("not a JSON object");
    }
    let sleep = match v.pointer("/config/polling/sleep") {
        None => None,
        Some(Value::String(s)) => Some(
            parse_sleep(s).with_context(|| format!("config.polling.sleep {s:?}: not HH:MM:SS"))?,
        ),
        Some(o) => bail!("config.polling.sleep {o}: not a string"),
    };
    let link = |name: &str| -> Result<Option<String>> {
        match v.get("_links").and_then(|l| l.get(name)) {
            None => Ok(None),
            Some(l) => match l.get("href") {
                Some(Value::String(h)) => Ok(Some(h.clone())),
                _ => bail!("_links.{name}: no href"),
            },
        }
    };
    Ok(Poll {
        sleep,
        config_data: link("configData")?,
        deployment: link("deploymentBase")?,
        cancel: link("cancelAction")?,
        confirmation: link("confirmationBase")?,
    })
}

#[derive(Deserialize)]
struct RawArtifact {
    filename: String,
    size: u64,
    #[serde(default)]
    hashes: std::collections::BTreeMap<String, String>,
    #[serde(rename = "_links", default)]
    links: std::collections::BTreeMap<String, Value>,
}

pub fn parse_deployment(v: &Value, https: bool) -> Result<Deployment> {
    let id = id_of(&v["id"]).context("no id (a string of letters, digits, - and _)")?;
    let d = v.get("deployment").context("no deployment")?;
    let s = |k: &str| d.get(k).and_then(Value::as_str).map(str::to_string);
    let download = s("download").unwrap_or_else(|| "forced".into());
    let update = s("update").unwrap_or_else(|| "forced".into());
    for (k, val) in [("download", &download), ("update", &update)] {
        if !["skip", "attempt", "forced"].contains(&val.as_str()) {
            bail!("deployment.{k} {val:?}: skip, attempt or forced expected");
        }
    }
    let chunks = d
        .get("chunks")
        .and_then(Value::as_array)
        .context("deployment.chunks: not a list")?;
    let mut artifacts = Vec::new();
    for (ci, c) in chunks.iter().enumerate() {
        let list = c
            .get("artifacts")
            .and_then(Value::as_array)
            .with_context(|| format!("chunks[{ci}].artifacts: not a list"))?;
        for (ai, a) in list.iter().enumerate() {
            let r: RawArtifact = serde_json::from_value(a.clone())
                .with_context(|| format!("chunks[{ci}].artifacts[{ai}]"))?;
            let at = || format!("chunks[{ci}].artifacts[{ai}] ({:?})", r.filename);
            if r.filename.is_empty()
                || r.filename.contains(['/', '\0'])
                || r.filename.starts_with('.')
            {
                bail!("{}: not a plain file name", at());
            }
            let sha256 = r
                .hashes
                .get("sha256")
                .map(|h| h.to_ascii_lowercase())
                .with_context(|| {
                    format!(
                        "{}: no sha256 (kiln installs nothing it cannot verify)",
                        at()
                    )
                })?;
            if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                bail!("{}: sha256 {sha256:?} is not 64 hex digits", at());
            }
            let href = |k: &str| {
                r.links
                    .get(k)
                    .and_then(|l| l.get("href"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            };
            // https servers: only the https link; http (labs): either.
            let url = if https {
                href("download")
            } else {
                href("download-http").or_else(|| href("download"))
            }
            .with_context(|| {
                format!(
                    "{}: no {} link",
                    at(),
                    if https {
                        "download (https)"
                    } else {
                        "download or download-http"
                    }
                )
            })?;
            artifacts.push(Artifact {
                filename: r.filename,
                size: r.size,
                sha256,
                url,
            });
        }
    }
    let maintenance = match d.get("maintenanceWindow") {
        None => None,
        Some(Value::String(w)) if w == "available" || w == "unavailable" => Some(w.clone()),
        Some(w) => bail!("deployment.maintenanceWindow {w}: available or unavailable expected"),
    };
    Ok(Deployment {
        id,
        download,
        update,
        maintenance,
        artifacts,
    })
}

/// Bytes an unprivileged writer may still put on the file system holding `dir` (64-bit Linux:
/// both counts are u64).
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeps() {
        assert_eq!(parse_sleep("00:01:00"), Some(Duration::from_secs(60)));
        assert_eq!(parse_sleep("12:00:05"), Some(Duration::from_secs(43205)));
        for bad in ["1:2", "00:61:00", "a:b:c", "", "00:00:00:00"] {
            assert_eq!(parse_sleep(bad), None, "{bad}");
        }
    }

    #[test]
    fn malformed_answers_are_errors_naming_the_field() {
        for (v, word) in [
            (json!([]), "object"),
            (json!({"config": {"polling": {"sleep": 5}}}), "sleep"),
            (
                json!({"config": {"polling": {"sleep": "soon"}}}),
                "HH:MM:SS",
            ),
            (json!({"_links": {"deploymentBase": {}}}), "deploymentBase"),
        ] {
            let e = format!("{:#}", parse_poll(&v).unwrap_err());
            assert!(e.contains(word), "{v}: {e}");
        }
        let art = |extra: Value| {
            let mut a = json!({"filename": "u.raucb", "size": 3, "hashes": {"sha256": "a".repeat(64)},
                "_links": {"download": {"href": "https://h/x"}}});
            a.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            json!({"id": "7", "deployment": {"chunks": [{"artifacts": [a]}]}})
        };
        assert!(parse_deployment(&art(json!({})), true).is_ok());
        for (extra, word) in [
            (json!({"hashes": {"sha1": "x"}}), "no sha256"),
            (json!({"hashes": {"sha256": "zz"}}), "64 hex"),
            (json!({"filename": "../etc/passwd"}), "plain file name"),
            (
                json!({"_links": {"download-http": {"href": "http://h/x"}}}),
                "https",
            ),
            (json!({"size": -1}), "artifacts[0]"),
        ] {
            let e = format!(
                "{:#}",
                parse_deployment(&art(extra.clone()), true).unwrap_err()
            );
            assert!(e.contains(word), "{extra}: {e}");
        }
        let e = parse_deployment(&json!({"id": "1/../2", "deployment": {"chunks": []}}), true)
            .unwrap_err();
        assert!(format!("{e:#}").contains("no id"));
    }
}
