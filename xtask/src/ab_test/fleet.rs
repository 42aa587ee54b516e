//! The fleet scenario of `cargo xtask ab-test`: the qemu-virt board's `kiln fleet` (hawkBit's DDI)
//! against `hawkbit_mock` on the host (`runtime/tests/fleet_ddi.rs`'s `ddi_stand_in`, driven on
//! its stdin), with the bundles served by Debian's `nginx` (the DDI download link redirects there,
//! so the token stays on the DDI server). User networking: the host is 10.0.2.2 for the board.
//!
//! 1. v2 (`v2.raucb`): A boots and passes, the client downloads; the power is cut during the
//!    download (the next boot resumes it: a Range request in nginx's log) and while RAUC writes
//!    B (the next boot, on A, installs again); then it installs and reboots, B boots and passes,
//!    and only then `closed`/`success` with B's manifest sha256, exactly once. The DDI server is
//!    asked at the reboot whether a success came already (it must not have).
//! 2. A bundle signed by another key, to the board now on B: RAUC refuses it (`rauc info`, before
//!    any install); `closed`/`failure` with RAUC's reason; both slots' bytes unchanged. The
//!    server expects the words the host's own `rauc info` (the board's release) gives for the
//!    same file against the image's keyring, found before the board boots; the console says the
//!    same.
//!
//! With `--fleet-fault NAME` the board's `kiln fleet` is given a fault (`kiln.inject=fleet-NAME`)
//! and the scenario must fail on the check that catches it: `early-success` (success sent right
//! after `rauc install`) at action 1's reboot, with [`super::EARLY_SUCCESS`].
//! 3. v3 (`v3-fails.raucb`, signed, installable, its manifest records another `/Image` hash): A
//!    boots and FAILs, falls back to B, and B sends `closed`/`failure` naming A's failed check.
//! 4. A models bundle (`models.raucb`, issue 38: a second model with its own signed known
//!    answers): RAUC writes `models_b`, the same system boots again mapping it, passes, serves the
//!    second model (`kiln.probe=models`), and only then `closed`/`success` naming models slot B
//!    and its `kiln-models.json`; the boot slots' systems and `models_a` untouched.
//! 5. A models bundle whose signed known answer is wrong (`models-wrong-answer.raucb`), with one
//!    bit of the llama fixture flipped in it before its first boot: RAUC writes the slot not in
//!    use (`models_a` now), the boot that maps it FAILs `model.nll` naming both, marks it bad
//!    (not the system) and boots again on `models_b`, which passes and serves; that boot sends
//!    `closed`/`failure` naming the checks from the FAIL report kept beside its own.

use super::{boots_of, part_of, show, Machine, EARLY_SUCCESS};
use crate::boot_test::{console_reader, only, pflash_with, qemu_command};
use anyhow::{ensure, Context, Result};
use kiln_runtime::slot::Slot;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// QEMU's default virtio-net MAC 52:54:00:12:34:56 under qemu-virt's `controller_id = "mac:eth0"`
/// and `controller_prefix = "kiln-"`.
const CONTROLLER: &str = "kiln-525400123456";

/// `hawkbit_mock` on the host.
struct StandIn {
    child: Child,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
    url: String,
}

impl StandIn {
    fn start() -> Result<StandIn> {
        StandIn::start_for(&[CONTROLLER.to_string()])
    }

    /// The stand-in serving one target per controller id in `targets`.
    fn start_for(targets: &[String]) -> Result<StandIn> {
        let mut child = Command::new(env!("CARGO"))
            .args([
                "test",
                "-q",
                "--workspace",
                "--test",
                "fleet_ddi",
                "--locked",
                "--",
                "--ignored",
                "--exact",
                "ddi_stand_in",
                "--nocapture",
            ])
            .current_dir(crate::paths::project_root())
            .env("KILN_DDI_TARGET", targets.join(","))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the DDI stand-in (cargo test … ddi_stand_in)")?;
        let stdin = child.stdin.take().context("the stand-in's stdin")?;
        let out = child.stdout.take().context("the stand-in's stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
                if let Some(r) = l.strip_prefix("DDI ") {
                    if tx.send(r.to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(900))
            .context("the DDI stand-in did not start (its build or start took over 15 min)")?;
        let url = first
            .strip_prefix("url ")
            .with_context(|| format!("the DDI stand-in said {first:?}"))?
            .to_string();
        Ok(StandIn {
            child,
            stdin,
            lines,
            url,
        })
    }

    fn ask(&mut self, cmd: &str) -> Result<String> {
        writeln!(self.stdin, "{cmd}").context("writing to the DDI stand-in")?;
        let r = self
            .lines
            .recv_timeout(Duration::from_secs(30))
            .with_context(|| format!("the DDI stand-in did not answer {cmd:?}"))?;
        ensure!(!r.starts_with("error"), "the DDI stand-in: {r}");
        Ok(r)
    }

    /// Register a feedback the board must send, word for word; its handle.
    fn expect(&mut self, id: &str, exec: &str, fin: &str, details: &[String]) -> Result<usize> {
        self.expect_on("", id, exec, fin, details)
    }

    /// [`StandIn::expect`] for `target` (`""`: the first).
    fn expect_on(
        &mut self,
        target: &str,
        id: &str,
        exec: &str,
        fin: &str,
        details: &[String],
    ) -> Result<usize> {
        let r = self.ask(&format!(
            "{}expect {id} {exec} {fin} {}",
            at(target),
            serde_json::to_string(details)?
        ))?;
        r.strip_prefix("expect ")
            .and_then(|k| k.parse().ok())
            .with_context(|| format!("the DDI stand-in said {r:?}"))
    }

    fn calls(&mut self, k: usize) -> Result<usize> {
        let r = self.ask(&format!("calls {k}"))?;
        r.rsplit(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("the DDI stand-in said {r:?}"))
    }

    fn port(&self) -> Result<u16> {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .with_context(|| format!("no port in {}", self.url))
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The stand-in's prefix of a command for `target` (`""`: none, the first target).
fn at(target: &str) -> String {
    if target.is_empty() {
        String::new()
    } else {
        format!("@{target} ")
    }
}

/// nginx serving `root` on 127.0.0.1 (the board's 10.0.2.2).
struct Nginx {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Nginx {
    fn start(dir: &Path, root: &Path) -> Result<Nginx> {
        crate::doctor::ensure(&[&crate::doctor::NGINX])?;
        std::fs::create_dir_all(dir.join("tmp"))?;
        let _ = std::fs::remove_file(dir.join("access.log"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let d = dir.display();
        // As root, nginx's workers would drop to `nobody`, which cannot read a checkout under a
        // 0700 home (a root's clone in /root on a fresh machine: every bundle a 403): they stay
        // the invoking user, as they do anyway when it is not root. Loopback only.
        let user = if crate::doctor::is_root() {
            "user root root;\n"
        } else {
            ""
        };
        let conf = format!(
            "{user}worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\nhttp {{\n  access_log {d}/access.log;\n  \
             client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n  fastcgi_temp_path {d}/tmp;\n  \
             uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n  \
             server {{ listen 127.0.0.1:{port}; root {}; }}\n}}\n",
            root.display()
        );
        let cf = dir.join("nginx.conf");
        std::fs::write(&cf, conf)?;
        let bin = if Path::new("/usr/sbin/nginx").exists() {
            "/usr/sbin/nginx"
        } else {
            "nginx"
        };
        let child = Command::new(bin)
            .args(["-e", &format!("{d}/error.log"), "-p"])
            .arg(dir)
            .arg("-c")
            .arg(&cf)
            .spawn()
            .context("starting nginx")?;
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            ensure!(
                t.elapsed() < Duration::from_secs(10),
                "nginx did not listen on 127.0.0.1:{port} in 10 s: {}",
                std::fs::read_to_string(dir.join("error.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Nginx {
            child,
            port,
            dir: dir.to_path_buf(),
        })
    }

    /// The access log's lines for `file`.
    fn fetches(&self, file: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("access.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(file))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Boot until the board's final feedback for action `id` is acknowledged: it must be a
/// `failure` (never a success) whose details `check` accepts, which the DDI server then expects
/// word for word (the board retries an unacknowledged final feedback at each poll) and receives
/// exactly once. The console and the details.
fn failure_of(
    m: &Machine,
    pflash: &Path,
    ddi: &mut StandIn,
    id: &str,
    what: &str,
    check: impl Fn(&[String]) -> Result<()>,
) -> Result<(String, Vec<String>)> {
    final_as(m, pflash, ddi, id, ("failure", None), what, check)
}

/// [`failure_of`] for a final feedback `want.0` (`success` or `failure`; the other is refused
/// as soon as the console shows it). With `want.1`, the details are known before the boot (from
/// a reference of the host's): the server expects them word for word from the start, and the
/// console must say the same (a second witness); without, they are learned from the console.
fn final_as(
    m: &Machine,
    pflash: &Path,
    ddi: &mut StandIn,
    id: &str,
    (want, known): (&str, Option<&[String]>),
    what: &str,
    check: impl Fn(&[String]) -> Result<()>,
) -> Result<(String, Vec<String>)> {
    // Known before the boot: the server expects it before the board can send it.
    let known = match known {
        Some(d) => Some((ddi.expect(id, "closed", want, d)?, d)),
        None => None,
    };
    let mut fin: Option<(usize, Vec<String>)> = None;
    let other = if want == "success" {
        "failure"
    } else {
        "success"
    };
    let c = boot(m, pflash, what, Duration::from_secs(600), |c| {
        ensure!(
            !c.contains(&format!("kiln-fleet: action {id}: {other}")),
            "action {id} was reported as a {other}: {:?}",
            final_of(c, id).map(|f| f.1)
        );
        if fin.is_none() {
            if let Some((word, details)) = final_of(c, id) {
                ensure!(word == want, "action {id} reported as {word}: {details:?}");
                let k = match known {
                    Some((k, d)) => {
                        ensure!(
                            details == d,
                            "action {id}'s {want} on the console is not what the host's \
                             reference expects: the board says {details:?}, expected {d:?}"
                        );
                        k
                    }
                    None => ddi.expect(id, "closed", want, &details)?,
                };
                check(&details)?;
                fin = Some((k, details));
            }
        }
        Ok(c.contains(&format!(
            "kiln-fleet: action {id}: final feedback acknowledged by the server"
        )))
    })?;
    let (k, details) =
        fin.with_context(|| format!("no final feedback for action {id} on the console"))?;
    let n = ddi.calls(k)?;
    ensure!(
        n == 1,
        "action {id}'s {want} {details:?} reached the server {n} times, not once"
    );
    Ok((c, details))
}

/// What the board's `kiln fleet` must report when RAUC refuses bundle `name` of `bundles` on a
/// board where slot `runs`, found on the host before any boot: the host's own `rauc info`
/// (Debian's, the release the board runs) on the same file, against the keyring the image
/// trusts, under the image's own `system.conf` (its keyring and data directory moved to a
/// temporary folder). RAUC's error (the one line of its stderr that is not a GLib message) and
/// its exit status, in the client's words (`fleet::refuse`, `fleet::board::bundle_kind`).
fn refusal_by_host_rauc(bundles: &Path, name: &str, runs: Slot) -> Result<Vec<String>> {
    use crate::image::updates;
    crate::doctor::ensure(&[&crate::doctor::RAUC])?;
    let board = crate::image::board::Board::load("qemu-virt")?;
    let (keyring, _) = updates::keyring_of(&board)?;
    let tmp = tempfile::tempdir().context("a temporary folder for the host's rauc")?;
    let ring = tmp.path().join("keyring.pem");
    std::fs::write(&ring, &keyring)?;
    let conf = updates::system_conf("qemu-virt", updates::has_crl(&keyring));
    let (board_ring, board_data) = (
        "path=/etc/rauc/keyring.pem\n",
        "data-directory=/data/rauc\n",
    );
    ensure!(
        conf.contains(board_ring) && conf.contains(board_data),
        "the image's system.conf no longer names {board_ring:?} and {board_data:?}: {conf}"
    );
    let conf = conf
        .replace(board_ring, &format!("path={}\n", ring.display()))
        .replace(
            board_data,
            &format!("data-directory={}\n", tmp.path().join("data").display()),
        );
    let cf = tmp.path().join("system.conf");
    std::fs::write(&cf, conf)?;
    let bundle = bundles.join(name);
    let out = Command::new("rauc")
        .arg(format!("--conf={}", cf.display()))
        .args(["info", "--output-format=json"])
        .arg(&bundle)
        .env("LC_ALL", "C")
        .output()
        .context("running the host's rauc info")?;
    ensure!(
        !out.status.success(),
        "the host's rauc info accepts {}: the board would install it",
        bundle.display()
    );
    let code = out
        .status
        .code()
        .with_context(|| format!("the host's rauc info ended by a signal: {}", out.status))?;
    let err = String::from_utf8_lossy(&out.stderr);
    let said: Vec<&str> = err
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("rauc-Message:"))
        .collect();
    let [reason] = said[..] else {
        anyhow::bail!("the host's rauc info on {name} said {said:?}, not one error line: {err}");
    };
    Ok(vec![
        format!("RAUC refused {name}: {reason} (rauc info exited {code})"),
        format!("slot {} runs", runs.name()),
    ])
}

/// Boot `m` with `pflash` and user networking; `watch` sees the console after each new line and
/// says when to cut the power (`Ok(true)`). The console, and the boots seen.
fn boot(
    m: &Machine,
    pflash: &Path,
    what: &str,
    limit: Duration,
    watch: impl FnMut(&str) -> Result<bool>,
) -> Result<String> {
    boot_nic(m, pflash, "", what, limit, watch)
}

/// [`boot`] with user networking, `nic` its options after the model (e.g. ",mac=…").
fn boot_nic(
    m: &Machine,
    pflash: &Path,
    nic: &str,
    what: &str,
    limit: Duration,
    mut watch: impl FnMut(&str) -> Result<bool>,
) -> Result<String> {
    let argv = qemu_command(&m.qemu, pflash, &only(&m.disk), Some(nic), &[])?;
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting qemu-system-aarch64")?;
    let out = child.stdout.take().context("qemu's stdout")?;
    let (seen, reader) = console_reader(out, None);
    let text =
        || String::from_utf8_lossy(&seen.lock().unwrap_or_else(|e| e.into_inner())).into_owned();
    let t = Instant::now();
    let mut len = 0;
    let r = loop {
        if child.try_wait()?.is_some() {
            break Err(anyhow::anyhow!(
                "{what}: QEMU exited (a power-off?) before the scenario ended"
            ));
        }
        if t.elapsed() > limit {
            break Err(anyhow::anyhow!(
                "{what}: not done within {} s",
                limit.as_secs()
            ));
        }
        let c = text();
        if c.len() != len {
            len = c.len();
            match watch(&c) {
                Ok(true) => break Ok(()),
                Ok(false) => {}
                Err(e) => break Err(e),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    let console = text();
    let log = m.dir.join(format!("{what}.serial.log"));
    std::fs::write(&log, &console).with_context(|| format!("writing {}", log.display()))?;
    r.with_context(|| format!("serial log {}", log.display()))?;
    Ok(console)
}

/// The details of the board's final feedback for `id`, as its log line gives them.
fn final_of(console: &str, id: &str) -> Option<(String, Vec<String>)> {
    let p = format!("kiln-fleet: action {id}: ");
    console.lines().find_map(|l| {
        let rest = l.trim_end_matches('\r').split(&p).nth(1)?;
        let (word, json) = rest.split_once(' ')?;
        if word != "success" && word != "failure" {
            return None;
        }
        Some((word.to_string(), serde_json::from_str(json).ok()?))
    })
}

/// The scenario; with `fault` (`kiln fleet`'s, `kiln.inject=fleet-FAULT`), the check that must
/// catch it fails it.
pub fn scenario(work: &Path, image: &Path, bundles: &Path, fault: Option<&str>) -> Result<()> {
    let t0 = Instant::now();
    let dir = work.join("fleet");
    let m = Machine::new(&dir, image)?;
    // Action 2's failure, as the host's own RAUC refuses the bundle, before the board boots at
    // all: what the server expects is not learned from the board.
    let refused = refusal_by_host_rauc(bundles, "other-key.raucb", Slot::B)?;
    // The board's token, written as `flash --fleet-token` does (hawkbit_mock's: Key<name>).
    crate::flash::key::provision_file(
        &m.disk,
        crate::flash::key::FLEET_TOKEN_PATH,
        format!("Key{CONTROLLER}").as_bytes(),
    )?;
    let nginx = Nginx::start(&dir.join("nginx"), bundles)?;
    let mut ddi = StandIn::start()?;
    std::fs::create_dir_all(dir.join("flash"))?;
    let pflash = pflash_with(
        &dir.join("flash"),
        &format!(
            "kiln.fleet.server=http://10.0.2.2:{} kiln.fleet.poll_max=2{}",
            ddi.port()?,
            fault
                .map(|f| format!(" kiln.inject=fleet-{f}"))
                .unwrap_or_default()
        ),
    )?;
    if let Some(f) = fault {
        println!("ab-test: fleet: `kiln fleet` told to inject fault {f} (kiln.inject=fleet-{f})");
    }

    // 1. v2: success only after B's verdict.
    v2_after_verdict(&m, &pflash, &mut ddi, (&nginx, bundles), t0)?;
    // 2. Signed by another key, to the board on B.
    other_key(&m, &pflash, &mut ddi, (&nginx, bundles), &refused)?;
    // 3. v3: signed and installable, but its system FAILs its self-check. RAUC writes A, A
    // boots and FAILs, is marked bad and falls back to B; B (the good slot) reports `failure`
    // naming the check from A's report — never a success.
    deploy(&mut ddi, bundles, &nginx, "3", "v3-fails.raucb")?;
    let t2 = Instant::now();
    let (c, details) = failure_of(&m, &pflash, &mut ddi, "3", "3-v3-fails", |details| {
        ensure!(
            details
                .first()
                .is_some_and(|d| d.starts_with("self-check FAIL on slot A: ")
                    && d.contains("image.manifest"))
                && details.get(1).map(String::as_str) == Some("slot B runs"),
            "action 3's failure does not name A's failed image.manifest, from B: {details:?}"
        );
        Ok(())
    })?;
    let boots = boots_of(&c);
    ensure!(
        show(&boots) == "B:PASS -> A:FAIL -> B:PASS",
        "action 3: boots {}, want B:PASS -> A:FAIL -> B:PASS",
        show(&boots)
    );
    println!(
        "ab-test: fleet: v3 whose system FAILs: {}; failure {:?} sent from B, once ({:.0} s)",
        show(&boots),
        details[0],
        t2.elapsed().as_secs_f64()
    );
    models(&m, &dir, &mut ddi, bundles, &nginx)
}

/// Step 1 of [`scenario`]: v2 to the board on A through two power cuts; `success` only after
/// B's verdict, exactly once, never before the reboot.
fn v2_after_verdict(
    m: &Machine,
    pflash: &Path,
    ddi: &mut StandIn,
    (nginx, bundles): (&Nginx, &Path),
    t0: Instant,
) -> Result<()> {
    let manifest = {
        let p = m.part(part_of(Slot::A))?;
        let b = crate::disk::fat::read_file(
            &m.disk,
            p.start_bytes(),
            p.size_bytes(),
            "kiln/manifest.json",
        )?;
        crate::pins::Sha256::of_bytes(&b).to_string()
    };
    let size = deploy(ddi, bundles, nginx, "1", "v2.raucb")?;
    let (steps, success) = v2_expectations(ddi, size, &manifest)?;
    let (c, at_reboot) = v2_boots(m, pflash, ddi, success)?;
    // The install the power cut is redone from A (the cut left B marked bad, half written); a
    // cut that came just after RAUC finished finds B active, and B's PASS ends the action.
    let boots = boots_of(&c);
    let path: Vec<(&str, Option<&str>)> = boots
        .iter()
        .map(|b| (b.slot.as_str(), b.verdict.as_deref()))
        .collect();
    let reinstalled = c.contains("kiln-fleet: rauc: installing");
    ensure!(
        (reinstalled && path == [("A", Some("PASS")), ("B", Some("PASS"))])
            || (!reinstalled && path == [("B", Some("PASS"))]),
        "v2 through the fleet after the cuts: boots {}, installed again: {reinstalled}",
        show(&boots)
    );
    // The boot judged the successes at the reboot (none may have come); no reboot to ask at only
    // when the cut came after RAUC finished (B booted straight away).
    ensure!(
        at_reboot.is_some() || !reinstalled,
        "action 1 was installed again but its boot never said it reboots into B: no moment to \
         ask the server whether a success came early"
    );
    // Proceeding feedback is sent again after each cut: at least once each.
    for k in steps {
        ensure!(
            ddi.calls(k)? >= 1,
            "proceeding feedback {k} of action 1 never came"
        );
    }
    ensure!(
        ddi.calls(success)? == 1,
        "action 1's success did not reach the server exactly once"
    );
    // The order on the console too: B's verdict, then the success.
    let verdict_at = c
        .rfind(kiln_runtime::selftest::report::VERDICT_PREFIX)
        .unwrap_or(0);
    let success_at = c.find("kiln-fleet: action 1: success").unwrap_or(0);
    ensure!(
        verdict_at < success_at,
        "the success line precedes B's verdict on the console"
    );
    let ranged = nginx
        .fetches("/v2.raucb")
        .iter()
        .filter(|l| l.contains("\" 206 "))
        .count();
    ensure!(
        ranged >= 1,
        "the download cut by the power was not resumed with a Range request (nginx: {:?})",
        nginx.fetches("/v2.raucb")
    );
    let fetched = nginx.fetches("/v2.raucb");
    println!(
        "ab-test: fleet: v2 by hawkBit DDI, the power cut during its download and during its \
         install ({}): then {}; success after B's PASS (0 at the reboot, 1 after), manifest sha256 {}; \
         nginx served it {} time(s), {ranged} resumed ({:.0} s)",
        if reinstalled { "installed again from A" } else { "the cut came after RAUC finished" },
        show(&boots),
        &manifest[..16],
        fetched.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The feedback of action 1 (v2, `size` bytes, `manifest` its manifest's sha256) the server is
/// told to expect: the three proceeding steps, and the success.
fn v2_expectations(ddi: &mut StandIn, size: u64, manifest: &str) -> Result<([usize; 3], usize)> {
    let s = strings;
    let steps = [
        ddi.expect(
            "1",
            "proceeding",
            "none",
            &s(&[&format!("downloading v2.raucb ({size} bytes)")]),
        )?,
        ddi.expect(
            "1",
            "proceeding",
            "none",
            &s(&["installing v2.raucb into slot B"]),
        )?,
        ddi.expect(
            "1",
            "proceeding",
            "none",
            &s(&["installed into slot B; rebooting into it: its self-check decides"]),
        )?,
    ];
    let success = ddi.expect(
        "1",
        "closed",
        "success",
        &s(&[
            "self-check PASS on slot B",
            &format!("manifest sha256 {manifest}"),
        ]),
    )?;
    Ok((steps, success))
}

/// The boots of action 1: the power cut during the download and during RAUC's write of B, then
/// the boot that ends with the final feedback acknowledged. Its console, and how many successes
/// the server had when the board said it reboots into B (none when it did not reboot).
fn v2_boots(
    m: &Machine,
    pflash: &Path,
    ddi: &mut StandIn,
    success: usize,
) -> Result<(String, Option<usize>)> {
    // The power is cut twice on the way: during the download (the next boot resumes it with a
    // Range request) and while RAUC writes B (the next boot, on A, installs again).
    let no_failure = |c: &str| -> Result<()> {
        ensure!(
            !c.contains("kiln-fleet: action 1: failure"),
            "the board reported action 1 as a failure"
        );
        Ok(())
    };
    boot(
        m,
        pflash,
        "1a-cut-download",
        Duration::from_secs(300),
        |c| {
            no_failure(c)?;
            // The third progress line: at least 6 MiB, past the 4 MiB the client syncs at.
            Ok(c.matches("kiln-fleet: downloaded ").count() >= 3)
        },
    )?;
    boot(m, pflash, "1b-cut-install", Duration::from_secs(300), |c| {
        no_failure(c)?;
        Ok(c.contains("Copying image to boot.1"))
    })?;
    // B has not booted yet: no success may have come (a cut just after RAUC finished would
    // leave no reboot in the next boot to ask at).
    let early = ddi.calls(success)?;
    ensure!(early == 0, "{EARLY_SUCCESS} ({early} before B ever booted)");
    let mut at_reboot = None;
    let c = boot(m, pflash, "1c-v2", Duration::from_secs(420), |c| {
        if at_reboot.is_none() && c.contains("kiln-fleet: action 1: installed; rebooting into it") {
            // Asked at the reboot, and judged at once (the boot ends on a success sent early).
            at_reboot = Some(ddi.calls(success)?);
            ensure!(
                at_reboot == Some(0),
                "{EARLY_SUCCESS} ({at_reboot:?} at the reboot)"
            );
        }
        no_failure(c)?;
        Ok(c.contains("kiln-fleet: action 1: final feedback acknowledged by the server"))
    })?;
    Ok((c, at_reboot))
}

/// Step 2 of [`scenario`]: a bundle signed by another key, to the board on B: refused by RAUC
/// before any install, with `refused` (the host's RAUC's words) word for word, once; A (where it
/// would go) untouched.
fn other_key(
    m: &Machine,
    pflash: &Path,
    ddi: &mut StandIn,
    (nginx, bundles): (&Nginx, &Path),
    refused: &[String],
) -> Result<()> {
    let s = strings;
    let before = m.part_sha("boot_a")?;
    let size = deploy(ddi, bundles, nginx, "2", "other-key.raucb")?;
    let downloading = ddi.expect(
        "2",
        "proceeding",
        "none",
        &s(&[&format!("downloading other-key.raucb ({size} bytes)")]),
    )?;
    let installing = ddi.expect(
        "2",
        "proceeding",
        "none",
        &s(&["installing other-key.raucb into slot A"]),
    )?;
    let t1 = Instant::now();
    // The server expects the host's words; the console (and this looser reading of it) is the
    // second witness.
    let (c, details) = final_as(
        m,
        pflash,
        ddi,
        "2",
        ("failure", Some(refused)),
        "2-other-key",
        |details| {
            ensure!(
                details.first().is_some_and(|d| d
                    .starts_with("RAUC refused other-key.raucb: signature verification failed"))
                    && details.get(1).map(String::as_str) == Some("slot B runs"),
                "action 2's failure does not say RAUC refused it on slot B: {details:?}"
            );
            Ok(())
        },
    )?;
    let boots = boots_of(&c);
    ensure!(
        boots.len() == 1 && boots[0].slot == "B",
        "action 2: boots {}",
        show(&boots)
    );
    // `rauc info` refused it (its signature) before anything was written: no install at all.
    ensure!(
        details[0].contains("(rauc info exited") && !c.contains("kiln-fleet: rauc: "),
        "action 2 was refused by `rauc install`, not before it by `rauc info`: {details:?}"
    );
    ensure!(
        ddi.calls(downloading)? == 1 && ddi.calls(installing)? == 0,
        "action 2: the download's proceeding feedback did not come once, or an install was \
         announced for a bundle RAUC refused"
    );
    let after = m.part_sha("boot_a")?;
    ensure!(
        before == after,
        "a refused bundle changed slot A: {before} -> {after}"
    );
    println!(
        "ab-test: fleet: a bundle signed by another key: failure {:?}, word for word as the \
         host's rauc info refuses it, once; boot_a unchanged ({:.0} s)",
        details[0],
        t1.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Owned strings of `v`.
fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Offer bundle `name` as action `id`: the DDI server gives its sha256 and size, nginx serves it.
/// Its size.
fn deploy(ddi: &mut StandIn, bundles: &Path, nginx: &Nginx, id: &str, name: &str) -> Result<u64> {
    let p = bundles.join(name);
    let b = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    let sha = crate::pins::Sha256::of_bytes(&b);
    ddi.ask(&format!(
        "deploy {id} {} {sha} http://10.0.2.2:{}/{name}",
        p.display(),
        nginx.port
    ))?;
    Ok(b.len() as u64)
}

/// The models slot on `part` of `m`'s card, as its trailer describes it.
fn slot_on(m: &Machine, part: &str) -> Result<kiln_runtime::models_slot::Slot> {
    let dir = tempfile::tempdir_in(&m.dir)?;
    let f = dir.path().join(part);
    std::fs::write(&f, m.read_part(part)?)?;
    kiln_runtime::models_slot::read(&f)?.with_context(|| format!("{part} holds no models slot"))
}

/// The console from the line `after` on, and a lookup of its lines holding a needle.
fn after<'a>(c: &'a str, marker: &str) -> &'a str {
    c.split(marker).nth(1).unwrap_or("")
}

fn lines_with(text: &str, needle: &str) -> String {
    text.lines()
        .filter(|l| l.contains(needle))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Steps 4 and 5 of [`scenario`]: models bundles through the fleet client, on the board the
/// system steps left on B.
fn models(m: &Machine, dir: &Path, ddi: &mut StandIn, bundles: &Path, nginx: &Nginx) -> Result<()> {
    use kiln_runtime::slot::Class;
    const SECOND: &str = super::SECOND_MODEL;
    let id_second = format!("\"id\":\"{}\"", SECOND.trim_end_matches(".gguf"));
    std::fs::create_dir_all(dir.join("flash-probe"))?;
    let pflash = pflash_with(
        &dir.join("flash-probe"),
        &format!(
            "kiln.fleet.server=http://10.0.2.2:{} kiln.fleet.poll_max=2 kiln.probe=models",
            ddi.port()?
        ),
    )?;
    let s = strings;

    // 4. The second model: success only after the boot that maps models_b passed.
    let t0 = Instant::now();
    let untouched = [m.part_sha("boot_a")?, m.part_sha("models_a")?];
    let systems = m.state()?.describe();
    let size = deploy(ddi, bundles, nginx, "4", "models.raucb")?;
    let steps = [
        ddi.expect(
            "4",
            "proceeding",
            "none",
            &s(&[&format!("downloading models.raucb ({size} bytes)")]),
        )?,
        ddi.expect(
            "4",
            "proceeding",
            "none",
            &s(&["installing models.raucb into models slot B"]),
        )?,
        ddi.expect(
            "4",
            "proceeding",
            "none",
            &s(&["installed into models slot B; rebooting to map it: the self-check decides"]),
        )?,
    ];
    let (c, details) = final_as(m, &pflash, ddi, "4", ("success", None), "4-models", |_| {
        Ok(())
    })?;
    let boots = boots_of(&c);
    ensure!(
        show(&boots) == "B:PASS -> B:PASS",
        "action 4: boots {}, want B:PASS -> B:PASS (the same system, the new models)",
        show(&boots)
    );
    for k in steps {
        ensure!(
            ddi.calls(k)? == 1,
            "proceeding feedback {k} of action 4 did not come once"
        );
    }
    let sb = slot_on(m, "models_b")?;
    ensure!(
        details
            == [
                "self-check PASS on models slot B".to_string(),
                format!("kiln-models.json sha256 {}", sb.meta_sha256()),
            ],
        "action 4's success does not name models slot B and what RAUC wrote there: {details:?}"
    );
    let second = after(&c, "kiln-fleet: action 4: installed; rebooting into it");
    ensure!(
        second.contains("models slot B) on /models")
            && second.contains("is signed: its")
            && second.contains("known answers from models slot B's kiln-models.json")
            && second.contains(&format!("{SECOND} [cpu]: ")),
        "the boot after the models install did not map models_b, believe it by its signature \
         and judge it by its own answers: {}",
        lines_with(second, "models")
    );
    let probe = lines_with(second, "kiln-probe /v1/models:");
    ensure!(
        probe.contains(&id_second),
        "the board does not serve the second model after action 4: {probe:?}"
    );
    let verdict_at = second
        .rfind(kiln_runtime::selftest::report::VERDICT_PREFIX)
        .unwrap_or(usize::MAX);
    ensure!(
        verdict_at < second.find("kiln-fleet: action 4: success").unwrap_or(0),
        "the success of action 4 precedes the verdict of the boot on models_b"
    );
    ensure!(
        [m.part_sha("boot_a")?, m.part_sha("models_a")?] == untouched,
        "a models bundle changed boot_a or the factory models slot"
    );
    let st = m.state()?;
    ensure!(
        st.order_of(Class::Models)? == vec![Slot::B, Slot::A]
            && st.left_of(Class::Models, Slot::B)? == 3
            && st.describe() == systems,
        "after action 4: {}, {} (before: {systems}), not models B first and marked good with the \
         systems' counters as they were",
        st.describe_of(Class::Models),
        st.describe()
    );
    ensure!(
        !sb.signature.is_empty()
            && sb.meta.models.iter().any(|x| x.name == SECOND)
            && sb.meta.known_answers["nll"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x["model"] == SECOND)),
        "models_b is not the bundle's signed slot of the second model with its answers"
    );
    let lines = crate::report::models_lines(&m.disk);
    ensure!(
        lines.len() == 3
            && lines[0].ends_with("init maps B next")
            && lines[1].contains("the factory models of boot slot")
            && lines[1].ends_with("; unsigned")
            && lines[2].contains(&format!("kiln-models.json {}", &sb.meta_sha256()[..12]))
            && lines[2].contains(SECOND)
            && lines[2].ends_with(&format!(
                "signed ({}-byte CMS signature)",
                sb.signature.len()
            )),
        "cargo xtask report does not tell the models slots as they are: {lines:#?}"
    );
    println!(
        "ab-test: fleet: a models bundle of {SECOND}: RAUC wrote models_b (signed \
         kiln-models.json {}), {}: mapped, judged by its own answers, served; success {:?} after \
         that verdict; boot_a and models_a untouched ({:.0} s)",
        &sb.meta_sha256()[..12],
        show(&boots),
        details[0],
        t0.elapsed().as_secs_f64()
    );

    // 5. A wrong signed answer, and a flipped bit, into the slot not in use (models_a now): the
    // boot that maps it FAILs, blames it, and the same system boots again on models_b.
    let t1 = Instant::now();
    deploy(ddi, bundles, nginx, "5", "models-wrong-answer.raucb")?;
    boot(
        m,
        &pflash,
        "5a-models-install",
        Duration::from_secs(300),
        |c| {
            ensure!(
                final_of(c, "5").is_none(),
                "action 5 ended before its slot was booted: {:?}",
                final_of(c, "5")
            );
            // Cut at the reboot: the bit is flipped in what RAUC wrote before its first boot.
            Ok(c.contains("kiln-fleet: action 5: installed; rebooting into it"))
        },
    )?;
    let st = m.state()?;
    ensure!(
        st.order_of(Class::Models)? == vec![Slot::A, Slot::B]
            && st.left_of(Class::Models, Slot::A)? == 1,
        "after installing the wrong-answer bundle: {}, not models A first with one try",
        st.describe_of(Class::Models)
    );
    let sa = slot_on(m, "models_a")?;
    let fixture = kiln_runtime::model::fixture::gguf()?;
    let block = 4096usize;
    let at_file = fixture.len() / 2 / block * block;
    let needle = &fixture[at_file..at_file + block];
    let mut part = m.read_part("models_a")?;
    let data_end = usize::try_from(sa.meta.verity.data_blocks * 4096)?;
    let hits: Vec<usize> = (0..data_end.saturating_sub(block))
        .step_by(block)
        .filter(|&o| &part[o..o + block] == needle)
        .collect();
    ensure!(
        hits.len() == 1,
        "the llama fixture's block at offset {at_file} is {} times in models_a (want once)",
        hits.len()
    );
    part[hits[0] + block / 2] ^= 0x10;
    m.write_part("models_a", &part)?;
    let (c, details) = failure_of(m, &pflash, ddi, "5", "5-models-blamed", |d| {
        ensure!(
            d.first()
                .is_some_and(|x| x.starts_with("self-check FAIL on models slot A: ")
                    && x.contains("model.nll"))
                && d.get(1).map(String::as_str) == Some("models slot B runs"),
            "action 5's failure does not name models slot A's failed model.nll, from models \
             slot B: {d:?}"
        );
        Ok(())
    })?;
    let boots = boots_of(&c);
    ensure!(
        show(&boots) == "B:FAIL -> B:PASS",
        "action 5: boots {}, want B:FAIL -> B:PASS (the models slot blamed, not the system)",
        show(&boots)
    );
    // init's line (the report's own header says the same words earlier, before its table).
    let blamed = "self-check FAILED on models slot A: marked bad, the system not; rebooting to \
                  map models slot B";
    ensure!(
        c.contains(blamed),
        "init did not say models slot A was blamed and models slot B is mapped next"
    );
    // The report's table (text on this console): the second model's NLL against its wrong signed
    // answer, and dm-verity's I/O error naming the fixture.
    let fail = c.split(blamed).next().unwrap_or("");
    let wrong = lines_with(fail, &format!("{SECOND} [cpu]: "));
    ensure!(
        wrong.contains("mean NLL")
            && wrong.contains("vs recorded")
            && fail.contains("I/O error reading /models/kiln-llama-fixture.gguf"),
        "the FAIL does not name both the second model's wrong known answer and the fixture with \
         the flipped bit: {wrong:?}"
    );
    let again = after(&c, blamed);
    let probe = lines_with(again, "kiln-probe /v1/models:");
    ensure!(
        again.contains("models slot B) on /models") && probe.contains(&id_second),
        "after the blamed slot, the board does not map models_b and serve the second model again: \
         {probe:?}"
    );
    let st = m.state()?;
    ensure!(
        st.order_of(Class::Models)? == vec![Slot::B]
            && st.left_of(Class::Models, Slot::A)? == 0
            && st.describe() == systems,
        "after the blamed models slot: {}, {} (before: {systems}), not MODELS_ORDER 'B' with A \
         marked bad and the systems as they were",
        st.describe_of(Class::Models),
        st.describe()
    );
    // The FAIL the client reported from: kept beside the PASS that replaced report.json.
    let p = m.part(part_of(Slot::B))?;
    let kept = crate::disk::fat::read_file(
        &m.disk,
        p.start_bytes(),
        p.size_bytes(),
        "kiln/report-models-a.json",
    )
    .context("boot_b holds no kiln/report-models-a.json")?;
    let kept: kiln_runtime::selftest::report::Report = serde_json::from_slice(&kept)?;
    let d = kept.slot.context("the kept report has no slot decision")?;
    ensure!(
        kept.verdict == kiln_runtime::selftest::report::Verdict::Fail
            && d.models_slot.as_deref() == Some("A")
            && d.models_json.as_deref() == Some(sa.meta_sha256().as_str()),
        "kiln/report-models-a.json is not the FAIL of models slot A's kiln-models.json {}",
        &sa.meta_sha256()[..12]
    );
    let lines = crate::report::models_lines(&m.disk);
    ensure!(
        lines
            .first()
            .is_some_and(|l| l.ends_with("init maps B next")),
        "cargo xtask report does not say models slot B is mapped next: {lines:#?}"
    );
    println!(
        "ab-test: fleet: a models bundle with a wrong (signed) known answer and a flipped bit: \
         {}; failure {:?} from the kept report, once; models_a marked bad, the systems not; \
         models_b served again ({:.0} s)",
        show(&boots),
        details[0],
        t1.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One board of [`boards`]: its number, controller id and MAC, and the bundle it is given.
struct Board {
    n: usize,
    controller: String,
    mac: String,
    bundle: &'static str,
}

/// What the server saw of one board's action.
struct Outcome {
    word: String,
    details: Vec<String>,
    boots: String,
    finals: usize,
    polls: String,
}

/// `cargo xtask ab-test --boards N` (outside CI): N qemu-virt boards, each with its own MAC (so
/// its own controller id under `mac:eth0`, and its own token), polling one DDI server at once,
/// the bundles from one nginx. Every board but the last is given v2, the last v3 whose system
/// FAILs. Each board runs (its own thread, its own QEMU) until its action's final feedback is
/// acknowledged; v2's must be `success` from B after B's PASS, v3's `failure` from A naming B's
/// failed check, each exactly once. Then the per-board results as the server saw them.
pub fn boards(work: &Path, image: &Path, bundles: &Path, n: usize) -> Result<()> {
    ensure!(
        (1..=64).contains(&n),
        "--boards {n}: 1 to 64 boards (each a QEMU with 2 GiB)"
    );
    let t0 = Instant::now();
    let dir = work.join("boards");
    let list: Vec<Board> = (0..n)
        .map(|i| Board {
            n: i + 1,
            controller: format!("kiln-5254001235{i:02x}"),
            mac: format!("52:54:00:12:35:{i:02x}"),
            bundle: if i + 1 == n && n > 1 {
                "v3-fails.raucb"
            } else {
                "v2.raucb"
            },
        })
        .collect();
    let nginx = Nginx::start(&dir.join("nginx"), bundles)?;
    let ids: Vec<String> = list.iter().map(|b| b.controller.clone()).collect();
    let ddi = std::sync::Mutex::new(StandIn::start_for(&ids)?);
    let port = ddi
        .lock()
        .map_err(|_| anyhow::anyhow!("the DDI stand-in's lock"))?
        .port()?;
    let run = |b: &Board| -> Result<Outcome> {
        let m = Machine::new(&dir.join(format!("board-{}", b.n)), image)?;
        crate::flash::key::provision_file(
            &m.disk,
            crate::flash::key::FLEET_TOKEN_PATH,
            format!("Key{}", b.controller).as_bytes(),
        )?;
        std::fs::create_dir_all(m.dir.join("flash"))?;
        let pflash = pflash_with(
            &m.dir.join("flash"),
            &format!("kiln.fleet.server=http://10.0.2.2:{port} kiln.fleet.poll_max=2"),
        )?;
        let ask = |line: String| -> Result<String> {
            ddi.lock()
                .map_err(|_| anyhow::anyhow!("the DDI stand-in's lock"))?
                .ask(&line)
        };
        let p = bundles.join(b.bundle);
        let bytes = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
        let sha = crate::pins::Sha256::of_bytes(&bytes);
        ask(format!(
            "{}deploy 1 {} {sha} http://10.0.2.2:{}/{}",
            at(&b.controller),
            p.display(),
            nginx.port,
            b.bundle
        ))?;
        // The final feedback, once the console shows it: the server is then told to expect it
        // word for word (the board retries it until acknowledged), and counts it.
        let mut fin: Option<(String, Vec<String>, usize)> = None;
        let c = boot_nic(
            &m,
            &pflash,
            &format!(",mac={}", b.mac),
            "boards",
            Duration::from_secs(900 + 300 * n as u64),
            |c| {
                if fin.is_none() {
                    if let Some((word, details)) = final_of(c, "1") {
                        let k = ddi
                            .lock()
                            .map_err(|_| anyhow::anyhow!("the DDI stand-in's lock"))?
                            .expect_on(&b.controller, "1", "closed", &word, &details)?;
                        fin = Some((word, details, k));
                    }
                }
                Ok(c.contains("kiln-fleet: action 1: final feedback acknowledged by the server"))
            },
        )?;
        let (word, details, k) = fin.context("no final feedback on the console")?;
        let finals = ask(format!("calls {k}"))?
            .rsplit(' ')
            .next()
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        let polls = ask(format!("{}polls", at(&b.controller)))?;
        Ok(Outcome {
            word,
            details,
            boots: show(&boots_of(&c)),
            finals,
            polls: polls.rsplit(' ').next().unwrap_or("?").to_string(),
        })
    };
    let results: Vec<Result<Outcome>> = std::thread::scope(|s| {
        let hs: Vec<_> = list.iter().map(|b| s.spawn(|| run(b))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the board's thread panicked")))
            })
            .collect()
    });
    let mut bad = Vec::new();
    println!("ab-test: boards: {n} boards, one DDI server, as the server saw them:");
    for (b, r) in list.iter().zip(results) {
        let (want_word, want_boots, want_detail) = if b.bundle == "v2.raucb" {
            ("success", "A:PASS -> B:PASS", "self-check PASS on slot B")
        } else {
            (
                "failure",
                "A:PASS -> B:FAIL -> A:PASS",
                "self-check FAIL on slot B: ",
            )
        };
        match r {
            Ok(seen) => {
                let ok = seen.word == want_word
                    && seen.boots == want_boots
                    && seen.finals == 1
                    && seen
                        .details
                        .first()
                        .is_some_and(|d| d.starts_with(want_detail));
                println!(
                    "  board {} {} ({}): {} {:?}, {} final feedback(s) received, {} polls; boots {}{}",
                    b.n,
                    b.controller,
                    b.bundle,
                    seen.word,
                    seen.details,
                    seen.finals,
                    seen.polls,
                    seen.boots,
                    if ok { "" } else { "  <- WRONG" }
                );
                if !ok {
                    bad.push(format!(
                        "board {}: {} with boots {} ({} received), want {want_word} \
                         ({want_detail}…) with boots {want_boots}, once",
                        b.n, seen.word, seen.boots, seen.finals
                    ));
                }
            }
            Err(e) => {
                println!(
                    "  board {} {} ({}): FAILED: {e:#}",
                    b.n, b.controller, b.bundle
                );
                bad.push(format!("board {}: {e:#}", b.n));
            }
        }
    }
    ensure!(bad.is_empty(), "boards: {}", bad.join("; "));
    println!(
        "ab-test: boards: all {n} boards ended their action as the server expected ({:.0} s)",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
