//! Distributed labgrid on loopback (`cargo xtask labgrid --remote`): the QEMU board made a
//! remote place, driven through `labgrid-coordinator`, `labgrid-exporter` and `labgrid-client`
//! the way a rack's board is.
//!
//! labgrid cannot export a `QEMUDriver` board: a driver is never exported (the exporter exports
//! resources; `remote/exporter.py`'s `exports` has no QEMU entry) and 26.0.1's `QEMUDriver`
//! binds no resource, so a `RemotePlace` has nothing of it to hand over (labgrid PR #1892). What
//! a rack exports — the board's serial console — can be exported, so the QEMU board is split the
//! way a rack's board is:
//!
//! - the **serial adapter**: a pseudo-terminal that lives for the whole run, like a USB serial
//!   adapter that stays plugged in while the board's power is cut. A thread here copies between
//!   its master side and a unix socket QEMU connects to at power-on (`-chardev socket`, QEMU the
//!   client); the slave (`/dev/pts/N`) is exported as a `RawSerialPort`, for which the exporter
//!   starts `ser2net` (RFC 2217) when the place is acquired: the client's `RemotePlace` sees a
//!   `NetworkSerialPort`.
//! - the board's **network**: QEMU forwards the board's HTTP port to a loopback port; the
//!   exporter exports the address as a `NetworkService`.
//! - **power**: labgrid's `ExternalPowerDriver` runs `images/labgrid/qemu_pdu.py on|off`, which
//!   starts QEMU (the same machine as the boot tests, [`crate::boot_test::qemu_command`]) or kills
//!   it (SIGKILL: a power cut). It stands in for a rack's PDU.
//! - **writing the card**: the strategy copies the image to the disk file QEMU boots (the
//!   exporter and the client share this host); a rack exports its SD mux instead.
//!
//! Every process started here (coordinator, exporter and the `ser2net` it starts, QEMU) is in
//! one process group, led by a watchdog whose stdin is a pipe from this process: when the
//! [`Farm`] is dropped — or this process dies in any way, Ctrl-C and SIGKILL included, and the
//! pipe closes — the watchdog kills the group. Each piece logs under `target/labgrid-remote/remote/`,
//! and an error names the piece and its log.

use anyhow::{bail, ensure, Context, Result};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use xshell::cmd;

/// The place `--remote` creates and the exporter's name and group for the board's resources.
pub const PLACE: &str = "kiln-qemu";
const EXPORTER: &str = "kiln-loopback";
const GROUP: &str = "kiln-qemu";

/// What the distributed run needs from the local preparation ([`super::labgrid::suite`]).
pub struct Board<'a> {
    pub python: &'a Path,
    /// `target/labgrid/`: the run's directory; the farm's logs go to `remote/` under it.
    pub work: &'a Path,
    /// The file QEMU boots (the strategy writes the image there).
    pub disk: &'a Path,
    /// U-Boot's environment (the second pflash).
    pub pflash: &'a Path,
}

/// The running farm. Dropping it stops every process it started.
pub struct Farm {
    dir: PathBuf,
    python: PathBuf,
    coordinator: String,
    http_port: u16,
    pdu: String,
    acquired: bool,
    /// Stopped in `drop`: QEMU, the exporter (and its ser2net), the coordinator, the rest of
    /// the group by the watchdog, the serial adapter.
    watchdog: Option<Watchdog>,
    pieces: Vec<Piece>,
    relay: Option<Relay>,
    _sock_dir: tempfile::TempDir,
}

impl Farm {
    /// Coordinator, serial adapter, exporter, and the place created and acquired.
    pub fn start(b: &Board) -> Result<Farm> {
        let dir = b.work.join("remote");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // A short path for the console socket (a unix socket's path has 108 bytes at most).
        let sock_dir = tempfile::Builder::new()
            .prefix("kiln-lg")
            .tempdir()
            .context("a directory for the console socket")?;
        let sock = sock_dir.path().join("console.sock");
        let port = crate::boot_test::free_port()?;
        let coordinator = format!("127.0.0.1:{port}");
        let watchdog = Watchdog::start(&dir.join("watchdog.log"))?;
        let group = watchdog.group;
        let mut farm = Farm {
            watchdog: Some(watchdog),
            python: b.python.to_path_buf(),
            coordinator: coordinator.clone(),
            http_port: crate::boot_test::free_port()?,
            pdu: String::new(),
            acquired: false,
            pieces: Vec::new(),
            relay: None,
            _sock_dir: sock_dir,
            dir: dir.clone(),
        };

        // The coordinator keeps its places in its working directory: ours, not the checkout.
        let py = b.python;
        let sh = crate::paths::shell()?;
        let c: Command = cmd!(
            sh,
            "{py} -m labgrid.remote.coordinator --listen {coordinator}"
        )
        .into();
        let mut c = c;
        c.current_dir(&dir);
        farm.pieces.push(Piece::spawn(
            "labgrid-coordinator",
            c,
            group,
            dir.join("coordinator.log"),
        )?);
        farm.wait_coordinator(port)?;

        let relay = Relay::start(&sock).context("the board's serial adapter (a pty)")?;
        let tty = relay.tty.clone();
        farm.relay = Some(relay);

        let exporter_yaml = dir.join("exporter.yaml");
        std::fs::write(&exporter_yaml, exporter_config(&tty))
            .with_context(|| format!("writing {}", exporter_yaml.display()))?;
        let c: Command = cmd!(
            sh,
            "{py} -m labgrid.remote.exporter --coordinator {coordinator} --name {EXPORTER} --hostname 127.0.0.1 {exporter_yaml}"
        )
        .into();
        let mut c = c;
        // ser2net is in /usr/sbin, which is not on every user's PATH.
        c.env("PATH", path_with_sbin());
        farm.pieces.push(Piece::spawn(
            "labgrid-exporter",
            c,
            group,
            dir.join("exporter.log"),
        )?);
        farm.wait_exported()?;

        farm.client(&["create"])?;
        farm.client(&["add-match", &format!("{EXPORTER}/{GROUP}/*")])?;
        farm.client(&["acquire"])?;
        farm.acquired = true;
        farm.wait_ser2net()?;

        // The power switch: QEMU's command line for qemu_pdu.py.
        let serve = crate::boot_test::serve_port("qemu-virt")?;
        let nic = format!(",hostfwd=tcp:127.0.0.1:{}-:{serve}", farm.http_port);
        let chardev = format!("socket,id=console,path={}", sock.display());
        let argv = crate::boot_test::qemu_command(
            &crate::boot_test::emulated("qemu-virt")?,
            b.pflash,
            &crate::boot_test::only(b.disk),
            Some(&nic),
            &[
                "-monitor",
                "none",
                "-chardev",
                &chardev,
                "-serial",
                "chardev:console",
            ],
        )?;
        // QEMU joins the farm's process group: the watchdog kills it with the rest.
        let state = serde_json::json!({
            "argv": argv,
            "log": dir.join("qemu.log"),
            "process_group": group.as_raw(),
        });
        let json = dir.join("qemu.json");
        std::fs::write(&json, serde_json::to_vec_pretty(&state)?)
            .with_context(|| format!("writing {}", json.display()))?;
        let script = crate::paths::project_root().join("images/labgrid/qemu_pdu.py");
        farm.pdu = [b.python, &script, &dir]
            .iter()
            .map(|p| sh_quote(&p.display().to_string()))
            .collect::<Vec<_>>()
            .join(" ");
        Ok(farm)
    }

    /// The environment of the pytest run (`qemu-virt-remote.yaml`'s `LG_*`).
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LG_COORDINATOR", self.coordinator.clone()),
            ("LG_PLACE", PLACE.to_string()),
            ("LG_KILN_PDU", self.pdu.clone()),
            ("LG_KILN_HTTP_PORT", self.http_port.to_string()),
        ]
    }

    /// The pieces that are no longer running, each with its log: empty when all are up.
    pub fn dead(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for p in &mut self.pieces {
            if let Some(st) = p.exited() {
                out.push(format!("{} exited ({st})", p.describe()));
            }
        }
        if let Some(w) = &mut self.watchdog {
            if let Ok(Some(st)) = w.child.try_wait() {
                out.push(format!("the farm's watchdog exited ({st})"));
            }
        }
        if let Some(r) = &self.relay {
            if r.thread.as_ref().is_some_and(|t| t.is_finished()) {
                out.push(format!("the serial adapter ({}) stopped", r.tty.display()));
            }
        }
        out
    }

    /// Where each piece logs, for a message after a failed run.
    pub fn logs(&self) -> String {
        let mut l: Vec<String> = self.pieces.iter().map(|p| p.describe()).collect();
        l.push(format!(
            "QEMU (log {})",
            self.dir.join("qemu.log").display()
        ));
        l.push(format!(
            "labgrid-client (log {})",
            self.dir.join("client.log").display()
        ));
        l.join("; ")
    }

    fn piece_failed(&mut self, what: &str) -> anyhow::Error {
        let dead = self.dead();
        if dead.is_empty() {
            anyhow::anyhow!("{what} (still running: {})", self.logs())
        } else {
            anyhow::anyhow!("{what}: {}", dead.join("; "))
        }
    }

    fn wait_coordinator(&mut self, port: u16) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.pieces[0].exited() {
                bail!("{} exited at start ({st})", self.pieces[0].describe());
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} does not listen on {} after 30 s",
                    self.pieces[0].describe(),
                    self.coordinator
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Until the coordinator lists the exporter's serial port.
    fn wait_exported(&mut self) -> Result<()> {
        let want = format!("{EXPORTER}/{GROUP}/NetworkSerialPort");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if !self.dead().is_empty() {
                return Err(self.piece_failed("exporting the board"));
            }
            if self.client_out(&["resources"], false)?.contains(&want) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(
                    self.piece_failed(&format!("the coordinator lists no {want} after 30 s"))
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Until the acquired serial port has a TCP port: the exporter's ser2net runs.
    fn wait_ser2net(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = self.client_out(&["-v", "resources", "-a"], false)?;
            if let Some(port) = serial_port_of(&out) {
                return self
                    .wait_tcp(port)
                    .with_context(|| format!("ser2net on 127.0.0.1:{port}"));
            }
            if Instant::now() > deadline || !self.dead().is_empty() {
                return Err(self.piece_failed(
                    "the acquired place's serial port has no TCP port: the exporter did not start ser2net",
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn wait_tcp(&mut self, port: u16) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err(self.piece_failed("nothing listens there after 10 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// `labgrid-client -x COORDINATOR -p PLACE ARGS…`, which must succeed.
    fn client(&mut self, args: &[&str]) -> Result<()> {
        self.client_out(args, true).map(drop)
    }

    /// `labgrid-client`'s output (logged to client.log); with `check`, a failure is an error.
    fn client_out(&mut self, args: &[&str], check: bool) -> Result<String> {
        let log = self.dir.join("client.log");
        let out = client_run(&self.python, &self.coordinator, args, &log)?;
        if check && !out.0 {
            return Err(self.piece_failed(&format!(
                "labgrid-client {} failed (log {}): {}",
                args.join(" "),
                log.display(),
                out.1.trim()
            )));
        }
        Ok(out.1)
    }
}

impl Drop for Farm {
    fn drop(&mut self) {
        // Power off: QEMU killed (qemu_pdu.py's own `off`, which knows its pid), whatever the
        // tests left.
        if !self.pdu.is_empty() {
            if let Err(e) = pdu_off(&self.dir) {
                eprintln!("labgrid --remote: stopping QEMU: {e:#}");
            }
        }
        if self.acquired {
            let log = self.dir.join("client.log");
            if let Err(e) = client_run(&self.python, &self.coordinator, &["release"], &log) {
                eprintln!("labgrid --remote: releasing the place: {e:#}");
            }
        }
        // Exporter first (SIGTERM: it stops its ser2net), then the coordinator; then whatever
        // is left in the group.
        while let Some(p) = self.pieces.pop() {
            drop(p);
        }
        self.watchdog.take();
        self.relay.take();
    }
}

/// The leader of the farm's process group: `sh`, reading its stdin (a pipe from this process)
/// until it closes, then killing its group (SIGTERM, then SIGKILL 2 s later; it ignores the
/// SIGTERM itself). The pipe closes when the watchdog is dropped, or when this process dies.
struct Watchdog {
    group: Pid,
    child: Child,
}

/// The watchdog's program: fixed text, no input in it.
const WATCHDOG_SH: &str = "trap '' TERM; read _; kill -TERM 0; sleep 2; kill -KILL 0";

impl Watchdog {
    fn start(log: &Path) -> Result<Watchdog> {
        let f =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new("sh")
            .args(["-c", WATCHDOG_SH])
            .stdin(Stdio::piped())
            .stdout(f.try_clone()?)
            .stderr(f)
            .process_group(0)
            .spawn()
            .context("starting the farm's watchdog (sh)")?;
        let group = Pid::from_raw(i32::try_from(child.id()).context("a pid beyond i32")?);
        Ok(Watchdog { group, child })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !matches!(self.child.try_wait(), Ok(Some(_))) {
            if Instant::now() > deadline {
                let _ = killpg(self.group, Signal::SIGKILL);
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The exporter's configuration: one group, the board's console and its network.
fn exporter_config(tty: &Path) -> String {
    format!(
        "{{# kiln's QEMU board on loopback (cargo xtask labgrid --remote): the serial adapter's\n\
         pty, exported through ser2net, and the board's HTTP port forwarded to 127.0.0.1. (The\n\
         exporter reads this file as a Jinja2 template, where `#` starts a line statement.) #}}\n\
         {GROUP}:\n  location: loopback\n  RawSerialPort:\n    port: {}\n    speed: 115200\n  \
         NetworkService:\n    address: 127.0.0.1\n    username: root\n",
        tty.display()
    )
}

/// The port of the acquired `NetworkSerialPort` in `labgrid-client -v resources -a`'s output
/// (`'port': 35157,`), once ser2net has one.
fn serial_port_of(out: &str) -> Option<u16> {
    let i = out.find("'cls': 'NetworkSerialPort'")?;
    let rest = &out[i..];
    let j = rest.find("'port': ")? + "'port': ".len();
    let digits: String = rest[j..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

fn path_with_sbin() -> std::ffi::OsString {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .collect();
    for d in ["/usr/sbin", "/sbin"] {
        if !dirs.iter().any(|p| p == Path::new(d)) {
            dirs.push(d.into());
        }
    }
    std::env::join_paths(dirs).unwrap_or_default()
}

/// A word for `shlex.split` (ExternalPowerDriver splits its commands so).
fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\"'\"'"))
    }
}

/// Run `labgrid-client`, bounded in time (a hung coordinator must not hang the run): whether it
/// succeeded, and its output; both also appended to `log`.
fn client_run(
    python: &Path,
    coordinator: &str,
    args: &[&str],
    log: &Path,
) -> Result<(bool, String)> {
    let sh = crate::paths::shell()?;
    let c: Command = cmd!(
        sh,
        "{python} -m labgrid.remote.client -x {coordinator} -p {PLACE} {args...}"
    )
    .into();
    let mut c = c;
    let out_path = log.with_extension("out.tmp");
    let out_file = std::fs::File::create(&out_path)
        .with_context(|| format!("creating {}", out_path.display()))?;
    c.stdin(Stdio::null())
        .stdout(out_file.try_clone()?)
        .stderr(out_file);
    let mut child = c
        .spawn()
        .with_context(|| format!("starting labgrid-client {}", args.join(" ")))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    writeln!(
        f,
        "$ labgrid-client -x {coordinator} -p {PLACE} {}",
        args.join(" ")
    )?;
    f.write_all(text.as_bytes())?;
    match status {
        None => bail!(
            "labgrid-client {} did not finish in 30 s (log {})",
            args.join(" "),
            log.display()
        ),
        Some(st) => Ok((st.success(), text)),
    }
}

/// `qemu_pdu.py`'s `off`, run from here at the end (the pid file names the QEMU it started).
fn pdu_off(dir: &Path) -> Result<()> {
    let pid_file = dir.join("qemu.pid");
    let Ok(text) = std::fs::read_to_string(&pid_file) else {
        return Ok(());
    };
    let pid: i32 = text
        .trim()
        .parse()
        .with_context(|| format!("{}: not a pid", pid_file.display()))?;
    // Only the process qemu_pdu.py started: its command line is the one in qemu.json.
    let json = dir.join("qemu.json");
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&json).with_context(|| format!("reading {}", json.display()))?,
    )
    .with_context(|| format!("parsing {}", json.display()))?;
    let argv: Vec<&str> = state["argv"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let ours = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .skip(1)
        .eq(argv.iter().skip(1).map(|a| a.as_bytes()));
    if ours && !argv.is_empty() {
        nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL)
            .with_context(|| format!("killing QEMU (pid {pid})"))?;
        println!("labgrid --remote: QEMU (pid {pid}) killed at the end of the run");
    }
    let _ = std::fs::remove_file(&pid_file);
    Ok(())
}

/// A long-running process of the farm, in the farm's process group, its output in `log`.
struct Piece {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Piece {
    fn spawn(name: &'static str, mut c: Command, group: Pid, log: PathBuf) -> Result<Piece> {
        let f =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        c.stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .process_group(group.as_raw());
        let child = c
            .spawn()
            .with_context(|| format!("starting {name} (log {})", log.display()))?;
        println!(
            "labgrid --remote: {name} started (pid {}, log {})",
            child.id(),
            log.display()
        );
        Ok(Piece { name, child, log })
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn describe(&self) -> String {
        format!(
            "{} (pid {}, log {})",
            self.name,
            self.child.id(),
            self.log.display()
        )
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        // SIGTERM first: the exporter stops its ser2net on it.
        if let Ok(raw) = i32::try_from(self.child.id()) {
            if self.exited().is_none() {
                let _ = nix::sys::signal::kill(Pid::from_raw(raw), Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.exited().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The board's serial adapter: a pty whose slave (`tty`) stays open here for the whole run (so
/// its master never hangs up while ser2net reopens it), and a thread that copies between the
/// master and the QEMU connected to `sock`. Bytes with no one to take them are dropped, as a
/// UART's are.
struct Relay {
    tty: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    _slave: OwnedFd,
}

impl Relay {
    fn start(sock: &Path) -> Result<Relay> {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let pty = nix::pty::openpty(None, None).context("openpty")?;
        for fd in [&pty.master, &pty.slave] {
            fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).context("FD_CLOEXEC")?;
        }
        fcntl(pty.master.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
            .context("O_NONBLOCK on the pty master")?;
        // Raw: no echo back to the board, no line editing, no CR/LF translation.
        let mut t = tcgetattr(&pty.slave).context("tcgetattr")?;
        cfmakeraw(&mut t);
        tcsetattr(&pty.slave, SetArg::TCSANOW, &t).context("tcsetattr")?;
        let tty = std::fs::read_link(format!("/proc/self/fd/{}", pty.slave.as_raw_fd()))
            .context("the pty's name")?;
        ensure!(
            tty.starts_with("/dev/"),
            "the pty is {} (labgrid exports /dev/ paths only)",
            tty.display()
        );
        let listener =
            UnixListener::bind(sock).with_context(|| format!("listening on {}", sock.display()))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let master = std::fs::File::from(pty.master);
        let thread = std::thread::Builder::new()
            .name("serial-adapter".into())
            .spawn(move || relay(master, listener, &s))
            .context("starting the serial adapter's thread")?;
        Ok(Relay {
            tty,
            stop,
            thread: Some(thread),
            _slave: pty.slave,
        })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn relay(mut master: std::fs::File, listener: UnixListener, stop: &AtomicBool) {
    let mut conn: Option<UnixStream> = None;
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        let (l_ready, m_ready, c_ready) = {
            let mut fds = vec![
                PollFd::new(listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(master.as_fd(), PollFlags::POLLIN),
            ];
            if let Some(c) = &conn {
                fds.push(PollFd::new(c.as_fd(), PollFlags::POLLIN));
            }
            match nix::poll::poll(&mut fds, PollTimeout::from(200u16)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    eprintln!("serial adapter: poll: {e}");
                    return;
                }
            }
            let any = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
            (any(&fds[0]), any(&fds[1]), fds.get(2).is_some_and(any))
        };
        if l_ready {
            if let Ok((c, _)) = listener.accept() {
                // A new QEMU (powered on again): the old connection is gone with the old one.
                if c.set_nonblocking(false).is_ok() {
                    conn = Some(c);
                }
            }
        }
        if c_ready {
            let n = conn.as_mut().map_or(Ok(0), |c| c.read(&mut buf));
            match n {
                Ok(0) | Err(_) => conn = None,
                Ok(n) => match master.write(&buf[..n]) {
                    // No one reads the console now: a UART drops what it cannot send.
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => {
                        eprintln!("serial adapter: writing the pty: {e}");
                        return;
                    }
                },
            }
        }
        if m_ready {
            match master.read(&mut buf) {
                Ok(n) if n > 0 => {
                    if let Some(c) = conn.as_mut() {
                        if c.write_all(&buf[..n]).is_err() {
                            conn = None;
                        }
                    }
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => {
                    eprintln!("serial adapter: reading the pty: {e}");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serial_port_is_read_from_the_clients_resource_listing() {
        // `labgrid-client -v resources -a` of labgrid 26.0.1, as seen here.
        let out = r#"Exporter 'kiln-loopback':
  Group 'kiln-qemu' (kiln-loopback/kiln-qemu/*):
    Resource 'NetworkService' (kiln-loopback/kiln-qemu/NetworkService[/NetworkService]):
      {'acquired': 'kiln-qemu',
       'avail': True,
       'cls': 'NetworkService',
       'params': {'address': '127.0.0.1',
                  'extra': {'proxy': 'localhost', 'proxy_required': False},
                  'username': 'root'}}
    Resource 'RawSerialPort' (kiln-loopback/kiln-qemu/NetworkSerialPort[/RawSerialPort]):
      {'acquired': 'kiln-qemu',
       'avail': True,
       'cls': 'NetworkSerialPort',
       'params': {'extra': {'path': '/dev/pts/0',
                            'proxy': 'localhost',
                            'proxy_required': False},
                  'host': '127.0.0.1',
                  'port': 35157,
                  'speed': 115200}}
"#;
        assert_eq!(serial_port_of(out), Some(35157));
        let unstarted = out.replace("'port': 35157", "'port': None");
        assert_eq!(serial_port_of(&unstarted), None);
        assert_eq!(serial_port_of("no resources"), None);
    }

    #[test]
    fn power_commands_survive_shlex() {
        assert_eq!(sh_quote("/a/b.py"), "/a/b.py");
        assert_eq!(sh_quote("/a b/it's"), "'/a b/it'\"'\"'s'");
    }

    /// The serial adapter carries bytes both ways between a connected "board" and its pty, and
    /// takes a new board after the first one went away (a power cycle).
    #[test]
    fn the_serial_adapter_outlives_a_power_cycle() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s");
        let relay = Relay::start(&sock).unwrap();
        use std::os::unix::fs::OpenOptionsExt;
        let mut tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&relay.tty)
            .unwrap();
        for round in 0..2 {
            let mut board = UnixStream::connect(&sock).unwrap();
            board
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            // The adapter must have taken the connection before the board talks.
            std::thread::sleep(Duration::from_millis(400));
            let msg = format!("KILN-CHECK x PASS {round}\r\n");
            board.write_all(msg.as_bytes()).unwrap();
            assert_eq!(read_within(&mut tty, msg.len()), msg.as_bytes());
            tty.write_all(b"reboot\n").unwrap();
            let mut back = [0u8; 7];
            board.read_exact(&mut back).unwrap();
            assert_eq!(&back, b"reboot\n");
            drop(board);
        }
        drop(relay);
    }

    /// `n` bytes from a non-blocking `f`, or a failed test after 5 s (never a hung one).
    fn read_within(f: &mut std::fs::File, n: usize) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while got.len() < n {
            assert!(Instant::now() < deadline, "only {got:?} in 5 s");
            match f.read(&mut buf) {
                Ok(k) => got.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("reading the pty: {e}"),
            }
        }
        got
    }
}
