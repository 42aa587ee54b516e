//! Downloads without apt: a host with no apt (Fedora, Arch, a container without it, the
//! `fresh-machine` stage's root once apt is removed) fetches the pinned files itself, over HTTP(S)
//! with ureq and rustls (the crate `kiln fleet` already uses on the board). The caller verifies
//! the sha256 the pins record, which is the trust: an HTTP mirror serves Debian's pool unsigned,
//! apt would check the lists' signature only to reach the same sha256.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;
use std::time::Duration;

/// Does the host have the apt kiln's private configuration drives (`apt-get`, `apt-helper`)?
/// Without it, inputs are fetched by [`download`].
pub fn host_has_apt() -> bool {
    Path::new("/usr/lib/apt/apt-helper").exists()
        && std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .any(|d| d.join("apt-get").is_file())
}

/// Download `url` to `dest` (written as `dest.part`, renamed when whole): the size in bytes.
/// A status other than 200, a cut connection or a stall of 60 s is an error naming the URL.
pub fn download(url: &str, dest: &Path) -> Result<u64> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(5)
        .user_agent(format!("kiln-xtask/{}", env!("CARGO_PKG_VERSION")))
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .timeout_per_read(Some(Duration::from_secs(60)))
        .build()
        .into();
    let mut resp = agent
        .get(url)
        .call()
        .with_context(|| format!("fetching {url}"))?;
    let status = resp.status();
    if status != 200 {
        bail!("fetching {url}: the server answered {status}");
    }
    let part = dest.with_extension("part");
    let mut f =
        std::fs::File::create(&part).with_context(|| format!("creating {}", part.display()))?;
    let mut body = resp.body_mut().with_config().limit(u64::MAX).reader();
    let n = std::io::copy(&mut body, &mut f).with_context(|| format!("fetching {url}"))?;
    f.flush()?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&part, dest).with_context(|| format!("renaming into {}", dest.display()))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A one-request HTTP server on loopback answering `status` with `body`.
    fn serve(status: &'static str, body: &'static [u8]) -> String {
        serve_cut(status, body, body.len())
    }

    /// [`serve`] announcing `announced` bytes of body and closing after `body`: a connection
    /// cut mid-file when `announced` is larger.
    fn serve_cut(status: &'static str, body: &'static [u8], announced: usize) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut b).unwrap();
                assert!(n > 0, "the client closed before its request's end");
                head.extend_from_slice(&b[..n]);
            }
            write!(
                s,
                "HTTP/1.1 {status}\r\nContent-Length: {announced}\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            s.write_all(body).unwrap();
        });
        format!("http://{addr}/pool/x.deb")
    }

    #[test]
    fn a_file_is_downloaded_whole_and_a_refusal_is_an_error_naming_the_url() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("x.deb");
        let url = serve("200 OK", b"0123456789");
        assert_eq!(download(&url, &dest).unwrap(), 10);
        assert_eq!(std::fs::read(&dest).unwrap(), b"0123456789");
        let url = serve("404 Not Found", b"gone");
        let e = format!("{:#}", download(&url, &d.path().join("y.deb")).unwrap_err());
        assert!(e.contains(&url) && e.contains("404"), "{e}");
        assert!(!d.path().join("y.deb").exists());
    }

    /// A connection cut before the announced length is an error, and nothing is left under the
    /// file's name (a later build would otherwise find half a file there).
    #[test]
    fn a_cut_download_is_an_error_and_leaves_no_file() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("x.deb");
        let url = serve_cut("200 OK", b"01234", 10);
        let e = format!("{:#}", download(&url, &dest).unwrap_err());
        assert!(e.contains(&url), "{e}");
        assert!(!dest.exists());
    }
}
