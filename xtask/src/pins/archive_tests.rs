//! Resolution against the real Debian archive through kiln's private apt configuration, and the
//! snapshot fallback against a local HTTP server serving a snapshot-shaped tree (the real
//! snapshot.debian.org is not reachable from the build machines). These need the network to
//! Debian's archive: `#[ignore]`d under plain `cargo test`, run by `cargo xtask test --stage
//! pins-archive`.

use super::*;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Mutex;

/// One private apt folder shared by these tests (its lists are big), used by one at a time.
static APT_DIR: Mutex<()> = Mutex::new(());

fn shared_apt() -> Apt {
    Apt::at(crate::paths::target_dir().join("kiln/apt-tests"))
}

/// The real pin of libgcc-s1 (small) from `rootfs/packages.toml`.
fn libgcc_pin() -> Input {
    read_inputs(&crate::paths::project_root().join("rootfs/packages.toml"))
        .unwrap()
        .into_iter()
        .find(|i| i.name == "libgcc-s1")
        .expect("rootfs/packages.toml pins libgcc-s1")
}

/// A tiny HTTP/1.1 server on 127.0.0.1 serving files under `root` (404 otherwise), in a
/// thread; returns its base URL.
fn serve(root: PathBuf) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let mut line = String::new();
            let mut r = BufReader::new(c.try_clone().unwrap());
            if r.read_line(&mut line).is_err() {
                continue;
            }
            loop {
                let mut h = String::new();
                if r.read_line(&mut h).map(|n| n == 0).unwrap_or(true) || h.trim().is_empty() {
                    break;
                }
            }
            let raw = line.split_whitespace().nth(1).unwrap_or("/");
            let path = crate::apt::percent_decode(raw).unwrap_or_else(|_| raw.to_string());
            let head = line.starts_with("HEAD ");
            let file = root.join(path.trim_start_matches('/'));
            let resp = match std::fs::read(&file) {
                Ok(body) if !path.contains("..") => {
                    let mut v = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: \
                         application/vnd.debian.binary-package\r\nConnection: close\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    if !head {
                        v.extend(body);
                    }
                    v
                }
                _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .to_vec(),
            };
            let _ = c.write_all(&resp);
        }
    });
    base
}

/// A pin of libgcc-s1 at a version the live archive does not serve (as after the archive moved
/// on), whose snapshot copy is `pool/main/g/gcc-12/…` at a fixed timestamp.
fn dropped_pin(sha: Sha256) -> Input {
    let mut i = libgcc_pin();
    i.version = "12.2.0-14+deb12u1~kiln.dropped1".into();
    i.sha256 = Some(sha);
    i.snapshot = Some(Snapshot {
        timestamp: "20261101T000000Z".into(),
        archive: "debian".into(),
        pool: "pool/main/g/gcc-12/libgcc-s1_12.2.0-14+deb12u1~kiln.dropped1_arm64.deb".into(),
    });
    i
}

/// Put `bytes` where the snapshot service keeps the dropped pin, under `root`.
fn snapshot_tree(root: &Path, input: &Input, bytes: &[u8]) {
    let sn = input.snapshot.as_ref().unwrap();
    let p = root
        .join("archive")
        .join(&sn.archive)
        .join(&sn.timestamp)
        .join(&sn.pool);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

/// A source whose snapshot service is a local server keeping `bytes` for `pin` under `dir`.
fn snapshot_source(dir: &Path, pin: &Input, bytes: &[u8]) -> DebSource {
    snapshot_tree(&dir.join("snap"), pin, bytes);
    DebSource {
        apt: shared_apt(),
        snapshot_base: serve(dir.join("snap")),
    }
}

fn resolve_with(src: &DebSource, cache: &Cache, input: &Input) -> Result<PathBuf> {
    resolve(cache, input, false, &|i: &Input, d: &Path| src.fetch(i, d))
}

fn temp_cache(dir: &Path) -> Cache {
    Cache {
        dir: dir.join("sha256"),
    }
}

#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn stale_lists_are_refreshed_then_the_pin_resolves() {
    let _g = APT_DIR.lock().unwrap_or_else(|e| e.into_inner());
    let src = DebSource {
        apt: shared_apt(),
        snapshot_base: "http://127.0.0.1:9".into(),
    };
    // The lists are gone (a machine that never ran `apt-get update`).
    let _ = std::fs::remove_dir_all(src.apt.dir.join("lists"));
    let _ = std::fs::remove_file(src.apt.dir.join("lists-updated"));
    let pin = libgcc_pin();
    assert!(!src.apt.lists_fresh(&[&pin.file]));
    let tmp = tempfile::tempdir().unwrap();
    let cache = temp_cache(tmp.path());
    let p = resolve_with(&src, &cache, &pin).unwrap();
    assert_eq!(Sha256::of_file(&p).unwrap(), pin.sha256.unwrap());
    assert!(
        src.apt.lists_fresh(&[&pin.file]),
        "the lists were refreshed"
    );
    // Lists older than the pins file count as stale too.
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(src.apt.dir.join("lists-updated"))
        .unwrap()
        .set_modified(old)
        .unwrap();
    let newer = tmp.path().join("pins.toml");
    std::fs::write(&newer, "").unwrap();
    assert!(!src.apt.lists_fresh(&[&newer]));
}

#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn dropped_version_comes_from_the_snapshot_and_is_verified() {
    let _g = APT_DIR.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let bytes = b"the pinned package, as the snapshot service keeps it".to_vec();
    let pin = dropped_pin(Sha256::of_bytes(&bytes));
    let src = snapshot_source(tmp.path(), &pin, &bytes);
    let cache = temp_cache(tmp.path());
    let p = resolve_with(&src, &cache, &pin).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), bytes);
    assert_eq!(p, cache.path(&pin.sha256.unwrap()));
}

#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn snapshot_serving_other_bytes_is_refused_naming_both_hashes() {
    let _g = APT_DIR.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let good = b"the pinned package".to_vec();
    let evil = b"not the pinned package".to_vec();
    let pin = dropped_pin(Sha256::of_bytes(&good));
    let src = snapshot_source(tmp.path(), &pin, &evil);
    let cache = temp_cache(tmp.path());
    let err = format!("{:#}", resolve_with(&src, &cache, &pin).unwrap_err());
    assert!(
        err.contains(&Sha256::of_bytes(&good).to_string())
            && err.contains(&Sha256::of_bytes(&evil).to_string()),
        "{err}"
    );
    assert!(err.contains("refused"), "{err}");
    assert!(!cache.path(&Sha256::of_bytes(&evil)).exists());
    assert!(!cache.path(&Sha256::of_bytes(&good)).exists());
}

#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn unreachable_snapshot_names_the_url_and_the_remedies() {
    let _g = APT_DIR.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let pin = dropped_pin(Sha256::of_bytes(b"x"));
    // A port nothing listens on.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let src = DebSource {
        apt: shared_apt(),
        snapshot_base: base.clone(),
    };
    let cache = temp_cache(tmp.path());
    let err = format!("{:#}", resolve_with(&src, &cache, &pin).unwrap_err());
    let url = pin.snapshot.as_ref().unwrap().url(&base);
    assert!(err.contains(&url), "{err}");
    assert!(err.contains("--offline"), "{err}");
    assert!(err.contains("cargo xtask pins update"), "{err}");
    // What the archive serves now is named: the real pinned version is among it.
    assert!(err.contains("12.2.0-14+deb12u1"), "{err}");
}

#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn pins_update_records_a_snapshot_for_the_served_version() {
    let _g = APT_DIR.lock().unwrap_or_else(|e| e.into_inner());
    let apt = shared_apt();
    apt.ensure_lists(&[]).unwrap();
    let pin = libgcc_pin();
    let spec = format!("libgcc-s1:arm64={}", pin.version);
    let (archive, pool) = apt.pool_path(&spec).unwrap();
    assert_eq!(archive, "debian");
    assert_eq!(
        pool,
        "pool/main/g/gcc-12/libgcc-s1_12.2.0-14+deb12u1_arm64.deb"
    );
    let ts = apt.release_timestamp(&archive).unwrap();
    assert!(ts.len() == 16 && ts.ends_with('Z'), "{ts}");
}

/// A `url` input named `name` at `url`, pinned to `sha`.
fn url_pin(name: &str, url: &str, sha: Sha256) -> Input {
    let raw = RawInput {
        name: name.into(),
        version: "v1".into(),
        kind: "url".into(),
        url: Some(url.into()),
        package: None,
        arch: None,
        how: None,
        identity: BTreeMap::new(),
        sha256: sha.to_string(),
        snapshot: None,
        distro: None,
        snapshot_path: None,
    };
    Input::parse(raw, Path::new("images/test.toml")).unwrap()
}

/// A url input is fetched over HTTP by the real downloader, verified, and cached by its hash;
/// the second resolve takes the cache and fetches nothing.
#[test]
fn url_input_is_fetched_verified_and_cached() {
    let web = tempfile::tempdir().unwrap();
    let bytes = b"a DDR init blob, in a test".to_vec();
    std::fs::write(web.path().join("blob.bin"), &bytes).unwrap();
    let base = serve(web.path().to_path_buf());
    let dir = tempfile::tempdir().unwrap();
    let cache = temp_cache(dir.path());
    let sha = Sha256::of_bytes(&bytes);
    let pin = url_pin("ddr", &format!("{base}/blob.bin"), sha);
    let p = resolve(&cache, &pin, false, &apt_fetch).unwrap();
    assert_eq!(p, cache.path(&sha));
    assert_eq!(std::fs::read(&p).unwrap(), bytes);
    let again = resolve(&cache, &pin, false, &|_: &Input, _: &Path| {
        bail!("fetched although the cache holds it")
    });
    assert_eq!(again.unwrap(), p);
}

/// A URL serving other bytes: refused, naming the input, the URL, both hashes and how to seed.
#[test]
fn url_serving_other_bytes_is_refused_naming_the_input_url_and_seed() {
    let web = tempfile::tempdir().unwrap();
    std::fs::write(web.path().join("blob.bin"), b"not the pinned blob").unwrap();
    let base = serve(web.path().to_path_buf());
    let dir = tempfile::tempdir().unwrap();
    let cache = temp_cache(dir.path());
    let want = Sha256::of_bytes(b"the pinned blob");
    let url = format!("{base}/blob.bin");
    let e = format!(
        "{:#}",
        resolve(&cache, &url_pin("ddr", &url, want), false, &apt_fetch).unwrap_err()
    );
    for s in [
        "input ddr v1",
        url.as_str(),
        &want.to_string(),
        &Sha256::of_bytes(b"not the pinned blob").to_string(),
        "cargo xtask pins seed",
    ] {
        assert!(e.contains(s), "{s:?} not in: {e}");
    }
    assert!(!cache.path(&want).exists());
}

/// An unreachable URL: the error names the input, the URL and how to seed the cache.
#[test]
fn unreachable_url_names_the_input_url_and_seed() {
    // A port nothing listens on (bound, then closed).
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/rk3588_ddr.bin");
    let dir = tempfile::tempdir().unwrap();
    let cache = temp_cache(dir.path());
    let sha = Sha256::of_bytes(b"x");
    let e = format!(
        "{:#}",
        resolve(&cache, &url_pin("ddr", &url, sha), false, &apt_fetch).unwrap_err()
    );
    for s in [
        "input ddr v1",
        "cannot fetch",
        url.as_str(),
        "cargo xtask pins seed",
        &cache.path(&sha).display().to_string(),
    ] {
        assert!(e.contains(s), "{s:?} not in: {e}");
    }
}

/// The recipe's url inputs parse; a url input needs `url`, an http(s) one, and its sha256.
#[test]
fn url_inputs_parse_and_are_checked() {
    let inputs = read_inputs(&crate::paths::project_root().join("images/rock-5b.toml")).unwrap();
    let ddr = inputs
        .iter()
        .find(|i| i.name == "rkbin-rk3588-ddr")
        .unwrap();
    assert!(
        matches!(&ddr.source, Source::Url { url } if url.starts_with("https://github.com/rockchip-linux/rkbin/raw/f43a462e"))
    );
    let raw = |f: &dyn Fn(&mut RawInput)| {
        let mut r = RawInput {
            name: "x".into(),
            version: "1".into(),
            kind: "url".into(),
            url: Some("https://example.org/x".into()),
            package: None,
            arch: None,
            how: None,
            identity: BTreeMap::new(),
            sha256: Sha256::of_bytes(b"x").to_string(),
            snapshot: None,
            snapshot_path: None,
            distro: None,
        };
        f(&mut r);
        Input::parse(r, Path::new("t.toml")).map(|_| ())
    };
    assert!(raw(&|_| {}).is_ok());
    assert!(raw(&|r| r.url = None).is_err());
    assert!(raw(&|r| r.url = Some("file:///etc/passwd".into())).is_err());
    assert!(raw(&|r| r.sha256 = String::new()).is_err());
    // `url` on another kind is refused, not ignored.
    assert!(raw(&|r| {
        r.kind = "deb".into();
        r.arch = Some("all".into());
    })
    .unwrap_err()
    .to_string()
    .contains("`url` belongs to kind"));
    // `distro` only on a deb, and only as debian-<number>.
    assert!(raw(&|r| r.distro = Some("debian-13".into()))
        .unwrap_err()
        .to_string()
        .contains("`distro` belongs to kind"));
    let deb = |d: &str| {
        raw(&|r| {
            r.kind = "deb".into();
            r.url = None;
            r.package = Some("x".into());
            r.arch = Some("arm64".into());
            r.distro = Some(d.into());
        })
    };
    assert!(deb("debian-13").is_ok());
    assert!(deb("trixie").is_err());
    assert!(deb("debian-").is_err());
}

/// Resolve `input` as a host without apt does ([`DebSource::fetch_without_apt`]).
fn resolve_without_apt(src: &DebSource, cache: &Cache, input: &Input) -> Result<PathBuf> {
    resolve(cache, input, false, &|i: &Input, d: &Path| {
        src.fetch_without_apt(i, &i.name, d)
    })
}

/// Without apt, the real pin's recorded pool path comes from Debian's live archive, over kiln's
/// own HTTP client, verified against the pinned sha256.
#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn without_apt_the_pinned_pool_path_comes_from_the_archive_and_is_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let pin = libgcc_pin();
    let src = DebSource {
        apt: shared_apt(),
        snapshot_base: "http://127.0.0.1:9".into(),
    };
    let cache = temp_cache(tmp.path());
    let p = resolve_without_apt(&src, &cache, &pin).unwrap();
    assert_eq!(p, cache.path(&pin.sha256.unwrap()));
    assert_eq!(Sha256::of_file(&p).unwrap(), pin.sha256.unwrap());
}

/// Without apt, a version the live archive no longer serves comes from the snapshot service;
/// other bytes there are refused naming both hashes; with neither serving it, both URLs and the
/// remedies are named.
#[test]
#[ignore = "needs Debian's archive: cargo xtask test --stage pins-archive"]
fn without_apt_a_dropped_version_comes_from_the_snapshot_or_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = b"the pinned package, as the snapshot service keeps it".to_vec();
    let pin = dropped_pin(Sha256::of_bytes(&bytes));
    let src = snapshot_source(tmp.path(), &pin, &bytes);
    let cache = temp_cache(tmp.path());
    let p = resolve_without_apt(&src, &cache, &pin).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), bytes);

    let evil = b"not the pinned package".to_vec();
    let other = tempfile::tempdir().unwrap();
    let src = snapshot_source(other.path(), &pin, &evil);
    let cache = temp_cache(other.path());
    let err = format!("{:#}", resolve_without_apt(&src, &cache, &pin).unwrap_err());
    assert!(
        err.contains(&Sha256::of_bytes(&bytes).to_string())
            && err.contains(&Sha256::of_bytes(&evil).to_string()),
        "{err}"
    );

    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let src = DebSource {
        apt: shared_apt(),
        snapshot_base: base.clone(),
    };
    let err = format!("{:#}", resolve_without_apt(&src, &cache, &pin).unwrap_err());
    let sn = pin.snapshot.as_ref().unwrap();
    assert!(err.contains(&sn.url(&base)), "{err}");
    assert!(
        err.contains(&format!("http://deb.debian.org/debian/{}", sn.pool)) && err.contains("404"),
        "{err}"
    );
    assert!(
        err.contains("--offline") && err.contains("cargo xtask pins update"),
        "{err}"
    );
}
