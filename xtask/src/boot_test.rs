//! `cargo xtask boot-test [--board qemu-virt] [--inject FAULT]`: boot a copy of the image under
//! `qemu-system-aarch64` through U-Boot, from the image alone (no `-kernel`), and hold the board
//! to its own verdict. `kiln.mode=test` (and `kiln.inject=…`) reach the kernel command line
//! through U-Boot's environment (`${kiln_args}` in extlinux.conf), never by editing the image.
//!
//! Passes only when the console shows the report and a PASS verdict, the same report is on the
//! copy's boot partition (read in-process, GPT + FAT), and it names this image's manifest.

use crate::disk::fat;
pub use crate::tools_root::machine::{Disk, Machine, Start};
use anyhow::{bail, ensure, Context, Result};
pub use kiln_runtime::selftest::report::Verdict;
use kiln_runtime::selftest::report::{Report, VERDICT_PREFIX};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xshell::cmd;

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Board to boot (only qemu-virt can be emulated).
    #[arg(long, default_value = "qemu-virt")]
    pub board: String,
    /// Fault to inject at boot: error|untouched|wrong|stale (NPU stand-in) or a kiln self-check
    /// fault (copy). Passed as kiln.inject=FAULT.
    #[arg(long)]
    pub inject: Option<String>,
    /// Boot the existing image without running `cargo xtask image` first.
    #[arg(long)]
    pub no_build: bool,
    /// Boot this image file instead of the board's built one (never built, always booted from
    /// a copy), so a hand-edited or corrupted image is tested the same way.
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Seconds to wait for the verdict and the power-off.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// A GGUF model to put on the models partition when the image is built (repeatable), as
    /// `cargo xtask image --model`.
    #[arg(long = "model")]
    pub models: Vec<PathBuf>,
    /// After the self-check, the board runs `kiln run` greedy for N tokens on the first model of
    /// its models partition (the prompt "The capital of France is"; `kiln.run=N`): the text is on
    /// the console and in `kiln/run.json` on the boot partition.
    #[arg(long, value_name = "N")]
    pub run: Option<usize>,
}

/// The prompt of `kiln.run` (the same text is in `rootfs/overlay/init`).
pub const RUN_PROMPT: &str = "The capital of France is";

/// CONFIG_ENV_SIZE of U-Boot's qemu_arm64 build: the env sits at the start of pflash unit 1.
const ENV_SIZE: usize = 0x40000;
/// QEMU's virt machine wants each pflash unit to be exactly 64 MiB.
const PFLASH_SIZE: usize = 64 << 20;

/// What one boot showed.
#[derive(Debug)]
pub struct Boot {
    pub report: Report,
    pub verdict_line: String,
    /// From starting QEMU to the verdict line on the serial console.
    pub boot_to_verdict: Duration,
    pub serial_log: PathBuf,
    /// `kiln/run.json` from the boot partition, when `--run` asked for it.
    pub run: Option<serde_json::Value>,
}

pub fn image_path(board: &str) -> PathBuf {
    crate::paths::target_dir()
        .join("images")
        .join(format!("kiln-{board}.img"))
}

/// U-Boot's built-in default environment, as `name=value` strings: the NUL-separated block that
/// starts at `bootcmd=` in `u-boot.bin` and ends at the first empty string.
pub fn default_env(uboot: &[u8]) -> Result<Vec<(String, String)>> {
    let start = uboot
        .windows(8)
        .position(|w| w == b"bootcmd=")
        .context("u-boot.bin holds no default environment (no `bootcmd=`)")?;
    let mut out = Vec::new();
    for s in uboot[start..].split(|&b| b == 0) {
        if s.is_empty() {
            break;
        }
        let s = std::str::from_utf8(s).context("non-UTF-8 default environment")?;
        let (k, v) = s
            .split_once('=')
            .with_context(|| format!("default environment entry without `=`: {s:?}"))?;
        out.push((k.to_string(), v.to_string()));
    }
    // Either way of booting reads extlinux.conf from the disks in `boot_targets`: the distro boot
    // scripts (`run distro_bootcmd`, U-Boot 2023.01 in Debian 12) or standard boot (`bootflow
    // scan`, U-Boot 2025.01 in Debian 13, which has no distro_bootcmd).
    let bootcmd = out
        .iter()
        .find(|(k, _)| k == "bootcmd")
        .map(|(_, v)| v.as_str())
        .unwrap_or_default();
    ensure!(
        (bootcmd.contains("distro_bootcmd") && out.iter().any(|(k, _)| k == "distro_bootcmd"))
            || bootcmd.contains("bootflow scan"),
        "u-boot.bin's default bootcmd ({bootcmd:?}) is neither `run distro_bootcmd` nor \
         `bootflow scan`: it would not read extlinux.conf"
    );
    Ok(out)
}

/// The environment the boot test gives U-Boot: the default with no autoboot delay, no `preboot`
/// (Debian 13's starts USB), only the virtio disk scanned, and `kiln_args` for the kernel command
/// line.
pub fn boot_env(default: Vec<(String, String)>, kiln_args: &str) -> String {
    let mut env: Vec<(String, String)> = default
        .into_iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "bootdelay" | "boot_targets" | "kiln_args" | "preboot"
            )
        })
        .collect();
    env.push(("bootdelay".into(), "0".into()));
    env.push(("boot_targets".into(), "virtio0".into()));
    env.push(("kiln_args".into(), kiln_args.into()));
    env.sort();
    env.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

/// U-Boot's binary environment of `env_txt` (`name=value` lines) in `size` bytes, as
/// `mkenvimage -s SIZE` writes it (a host test holds it to mkenvimage's bytes): a little-endian
/// CRC32 of the data area, then `name=value\0` records, an empty record, erased-flash bytes
/// (0xff, mkenvimage's default padding) to the end: the runtime's encoder of `abstate.env`
/// (`slot::env`), not mkenvimage, so a host needs no u-boot-tools to boot.
fn env_image(env_txt: &str, size: usize) -> Result<Vec<u8>> {
    let mut records = Vec::new();
    for line in env_txt.lines().filter(|l| !l.is_empty()) {
        let r = line
            .split_once('=')
            .with_context(|| format!("U-Boot environment line {line:?} is not name=value"))?;
        records.push(r);
    }
    kiln_runtime::slot::env::encode_records(records, size, 0xff)
}

/// The env ([`env_image`] at `CONFIG_ENV_SIZE`), padded with erased-flash bytes to a 64 MiB
/// pflash image.
fn write_pflash(dir: &Path, env_txt: &str) -> Result<PathBuf> {
    let mut flash = env_image(env_txt, ENV_SIZE)?;
    flash.resize(PFLASH_SIZE, 0xff);
    let out = dir.join("pflash1.img");
    std::fs::write(&out, flash).with_context(|| format!("writing {}", out.display()))?;
    Ok(out)
}

/// The pflash unit U-Boot reads its environment from: the default env with `kiln_args` (see
/// [`boot_env`]), written under `dir`. Shared by `boot-test` and `qemu`.
pub fn pflash_with(dir: &Path, kiln_args: &str) -> Result<PathBuf> {
    let q = crate::tools_root::qemu_virt()?;
    let uboot =
        std::fs::read(&q.uboot).with_context(|| format!("reading {}", q.uboot.display()))?;
    write_pflash(dir, &boot_env(default_env(&uboot)?, kiln_args))
}

/// The image to boot: `image` if given (never built), else the board's, built first (in-process,
/// as `cargo xtask image`) unless `no_build`. Shared by `boot-test` and `qemu`.
pub fn ensure_image(
    board: &str,
    image: Option<&Path>,
    no_build: bool,
    models: &[PathBuf],
) -> Result<PathBuf> {
    let path = image.map_or_else(|| image_path(board), Path::to_path_buf);
    if !no_build && image.is_none() {
        // In-process, not by re-running our own binary: a `cargo test` earlier in the same
        // `cargo xtask test` may have rebuilt (and so deleted) the running xtask executable.
        crate::image::run(crate::image::Args {
            board: board.to_string(),
            models: models.to_vec(),
            offline: false,
            dev_keys: false,
        })
        .context("building the image (cargo xtask image)")?;
    }
    ensure!(
        path.exists(),
        "{} does not exist: run `cargo xtask image --board {board}`",
        path.display()
    );
    Ok(path)
}

/// The qemu-system-aarch64 command line of a qemu-virt boot through U-Boot from `disks` alone
/// (the image first; no `-kernel`), U-Boot's environment on `pflash`, the serial console on
/// stdio (`-nographic`: `mon:stdio`, Ctrl-A X quits); `nic` `None` for no network or user
/// networking's options after the model (e.g. ",hostfwd=tcp::8080-:8080"). The machine is the
/// recipe's `[qemu]` ([`crate::tools_root::machine`]). Shared by `boot-test`, `qemu`, the A/B and
/// fleet scenarios and the farm.
pub fn qemu_command(
    m: &Machine,
    pflash: &Path,
    disks: &[Disk],
    nic: Option<&str>,
    extra: &[&str],
) -> Result<Vec<String>> {
    let q = crate::tools_root::qemu_virt()?;
    Ok(q.command(
        m,
        Start::UBoot {
            pflash: Some(pflash),
        },
        disks,
        nic,
        extra,
    ))
}

/// The machine QEMU emulates for `board` (its recipe's `[qemu]`), or why it cannot.
pub fn emulated(board: &str) -> Result<Machine> {
    let b = crate::image::board::Board::load(board)?;
    b.qemu.with_context(|| {
        format!(
            "{} has no [qemu] table: QEMU does not emulate {board} (the emulated board is qemu-virt)",
            b.path.display()
        )
    })
}

/// The image `disk` as the machine's only disk.
pub fn only(disk: &Path) -> [Disk<'_>; 1] {
    [Disk {
        path: disk,
        options: "",
    }]
}

pub use crate::disk::copy_image;

/// Collect a child's console: a thread appends what `out` gives to the returned buffer (and to
/// `log`, when given) until it closes.
pub fn console_reader(
    mut out: impl Read + Send + 'static,
    mut log: Option<std::fs::File>,
) -> (Arc<Mutex<Vec<u8>>>, std::thread::JoinHandle<()>) {
    let seen: Arc<Mutex<Vec<u8>>> = Arc::default();
    let handle = {
        let seen = Arc::clone(&seen);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Some(l) = log.as_mut() {
                    let _ = l.write_all(&buf[..n]);
                }
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]);
            }
        })
    };
    (seen, handle)
}

/// Edit the A/B counters on `image`'s `bootctl` (read in-process, written back with mtools'
/// `mcopy -o` at the partition's offset), `work` holding the temporary file.
pub fn edit_ab_state(
    image: &Path,
    work: &Path,
    edit: impl FnOnce(&mut kiln_runtime::slot::State) -> Result<()>,
) -> Result<kiln_runtime::slot::State> {
    let parts = crate::disk::gpt::read(image)?;
    let ctl = parts
        .iter()
        .find(|p| p.name == "bootctl")
        .with_context(|| format!("{} has no bootctl partition", image.display()))?;
    let bytes = fat::read_file(
        image,
        ctl.start_bytes(),
        ctl.size_bytes(),
        crate::report::ABSTATE_PATH,
    )?;
    let mut st = kiln_runtime::slot::State::decode(&bytes, "bootctl's kiln/abstate.env")?;
    edit(&mut st)?;
    let tmp = work.join("abstate.env");
    std::fs::write(&tmp, st.encode()?).with_context(|| format!("writing {}", tmp.display()))?;
    let sh = crate::paths::shell()?;
    let target = format!("{}@@{}", image.display(), ctl.start_bytes());
    cmd!(sh, "mcopy -o -i {target} {tmp} ::kiln/abstate.env")
        .quiet()
        .run()
        .with_context(|| format!("writing kiln/abstate.env into {}", image.display()))?;
    Ok(st)
}

fn kiln_args(inject: Option<&str>, run: Option<usize>, serve: bool) -> Result<String> {
    let mut a = if serve {
        "kiln.mode=test-serve"
    } else {
        "kiln.mode=test"
    }
    .to_string();
    if let Some(n) = run {
        a.push_str(&format!(" kiln.run={n}"));
    }
    if let Some(f) = inject {
        ensure!(
            !f.is_empty()
                && f.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_,".contains(c)),
            "--inject {f:?}: letters, digits, '-', '_' and ',' only"
        );
        a.push_str(&format!(" kiln.inject={f}"));
    }
    Ok(a)
}

/// Boot once and return what the board said. A FAIL verdict is a result, not an error; a missing
/// report, a report on the card that differs from the console's, or a timeout are errors.
pub fn boot(args: &Args) -> Result<Boot> {
    boot_with(args, None)
}

/// What to ask of a booted board's `kiln serve` from the host: `runtime/tests/py/serve_board.py`
/// in `mode` (`pass` or `fail`) with the official openai client of `python`, against `expect`.
pub struct Probe {
    pub python: PathBuf,
    pub mode: &'static str,
    pub expect: serde_json::Value,
}

/// The port the recipe's `[serve]` listens on.
pub fn serve_port(board: &str) -> Result<u16> {
    let b = crate::image::board::Board::load(board)?;
    Ok(b.serve
        .with_context(|| format!("images/{board}.toml has no [serve]: the board serves nothing"))?
        .port)
}

/// A TCP port free on the host now (for QEMU's `hostfwd`).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")
        .context("finding a free local port")?
        .local_addr()?
        .port())
}

/// Run `probe` against the board's `kiln serve` at `base` (`http://127.0.0.1:PORT`); the bytes
/// it got from `GET /kiln/report`. Ends early, with the reason, when QEMU exits or the console
/// says that `kiln serve` exited.
pub fn run_probe(
    probe: &Probe,
    base: &str,
    dir: &Path,
    qemu: &mut std::process::Child,
    console: &dyn Fn() -> String,
) -> Result<Vec<u8>> {
    let script = crate::paths::project_root().join("runtime/tests/py/serve_board.py");
    let expect = dir.join("serve-expect.json");
    let got = dir.join("served-report.json");
    let _ = std::fs::remove_file(&got);
    std::fs::write(&expect, serde_json::to_vec_pretty(&probe.expect)?)
        .with_context(|| format!("writing {}", expect.display()))?;
    let mut child = std::process::Command::new(&probe.python)
        .arg(&script)
        .args([probe.mode, base])
        .arg(&got)
        .arg(&expect)
        .spawn()
        .with_context(|| format!("running {}", script.display()))?;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        let gone = if let Some(st) = qemu.try_wait()? {
            Some(format!("qemu exited ({st})"))
        } else {
            console()
                .lines()
                .find(|l| l.starts_with("kiln-init: kiln serve exited with"))
                .map(|l| format!("the board says `{}`", l.trim()))
        };
        if let Some(why) = gone {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{why} while the openai client was asking the board's kiln serve");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    ensure!(
        status.success(),
        "the board's kiln serve failed the openai client's checks ({}, {status})",
        probe.mode
    );
    std::fs::read(&got).with_context(|| format!("reading {}", got.display()))
}

/// Boot in `kiln.mode=test-serve` with a forwarded port when `probe` is given: once the report is
/// on the console, run the probe against the board's `kiln serve`, then end the machine (the
/// report was synced to the card before serve started) and require `/kiln/report`'s bytes to be
/// the card's `kiln/report.json`.
pub fn boot_with(args: &Args, probe: Option<&Probe>) -> Result<Boot> {
    let machine = emulated(&args.board)?;
    let image = ensure_image(
        &args.board,
        args.image.as_deref(),
        args.no_build,
        &args.models,
    )?;
    let dir = match &args.inject {
        None => crate::paths::target_dir().join("boot-test"),
        Some(f) => crate::paths::target_dir()
            .join("boot-test")
            .join(format!("inject-{f}")),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let pflash = pflash_with(
        &dir,
        &kiln_args(args.inject.as_deref(), args.run, probe.is_some())?,
    )?;
    let copy = dir.join("disk.img");
    copy_image(&image, &copy)?;
    if probe.is_some_and(|p| p.mode == "fail") {
        // A FAIL reboots into the other slot while that one is good: to see what a board with
        // no good slot left serves, slot B is marked bad first (as a failed update leaves it).
        edit_ab_state(&copy, &dir, |st| st.mark_bad(kiln_runtime::slot::Slot::B))?;
        println!("boot-test: slot B marked bad on the copy: the FAIL stays on slot A and serves");
    }
    let serial_log = dir.join("serial.log");

    let port = match probe {
        Some(_) => Some((free_port()?, serve_port(&args.board)?)),
        None => None,
    };
    let nic = port.map(|(host, guest)| format!(",hostfwd=tcp:127.0.0.1:{host}-:{guest}"));
    let argv = qemu_command(
        &machine,
        &pflash,
        &only(&copy),
        nic.as_deref(),
        &["-no-reboot"],
    )?;
    println!("boot-test: {}", argv.join(" "));
    println!(
        "boot-test: kernel command line gets `{}`",
        kiln_args(args.inject.as_deref(), args.run, probe.is_some())?
    );
    let mut command = std::process::Command::new(&argv[0]);
    command.args(&argv[1..]);
    // The build that came just before leaves gigabytes of dirty pages: written back while the
    // guest boots, they slowed boot-to-verdict by up to 1.4 s. Flush them first, so the figure
    // measures the boot, not the host's writeback.
    nix::unistd::sync();
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting qemu-system-aarch64")?;
    let mut out = child.stdout.take().context("qemu's stdout")?;
    let mut log = std::fs::File::create(&serial_log)
        .with_context(|| format!("creating {}", serial_log.display()))?;
    let seen: Arc<Mutex<(Vec<u8>, Option<Duration>)>> = Arc::default();
    let reader = {
        let seen = Arc::clone(&seen);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = log.write_all(&buf[..n]);
                let _ = log.flush();
                let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                s.0.extend_from_slice(&buf[..n]);
                if s.1.is_none() {
                    let text = String::from_utf8_lossy(&s.0);
                    if text.lines().any(|l| l.starts_with(VERDICT_PREFIX)) {
                        s.1 = Some(started.elapsed());
                    }
                }
            }
        })
    };
    let deadline = Duration::from_secs(args.timeout);
    let console_now = || {
        let s = seen.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&s.0).into_owned()
    };
    let mut served_report = None;
    let status = loop {
        if let Some(st) = child.try_wait().context("waiting for qemu")? {
            break Some(st);
        }
        if let (Some(p), Some((host, _)), None) = (probe, port, &served_report) {
            let console = console_now();
            if console.contains("kiln-init: $ kiln serve") {
                // A FAIL must be answered naming every check the console's report failed.
                let failed = Report::from_console(&console)
                    .map(|(r, _)| r.failed_ids().iter().map(|s| s.to_string()).collect())
                    .unwrap_or_else(|_| Vec::<String>::new());
                let p = Probe {
                    python: p.python.clone(),
                    mode: p.mode,
                    expect: if p.mode == "fail" {
                        serde_json::json!({ "failed": failed })
                    } else {
                        p.expect.clone()
                    },
                };
                let got = run_probe(
                    &p,
                    &format!("http://127.0.0.1:{host}"),
                    &dir,
                    &mut child,
                    &console_now,
                );
                // The report is on the card (init synced it before serve started): end the
                // machine either way, then judge.
                let _ = child.kill();
                let st = child.wait().context("waiting for qemu")?;
                served_report = Some(got?);
                break Some(st);
            }
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = reader.join();
    let (bytes, verdict_at) = {
        let s = seen.lock().unwrap_or_else(|e| e.into_inner());
        (s.0.clone(), s.1)
    };
    let console = String::from_utf8_lossy(&bytes);
    let Some(status) = status else {
        bail!(
            "timeout: no power-off within {} s (verdict {}); serial log: {}",
            args.timeout,
            if verdict_at.is_some() {
                "seen"
            } else {
                "not seen"
            },
            serial_log.display()
        );
    };
    let (report, verdict_line) = Report::from_console(&console)
        .with_context(|| format!("serial log: {}", serial_log.display()))?;
    match (probe, &served_report) {
        (None, _) => ensure!(
            status.success(),
            "qemu exited with {status} after the verdict (expected a clean PSCI power-off)"
        ),
        (Some(_), None) => bail!(
            "qemu exited ({status}) before the board started kiln serve; serial log: {}",
            serial_log.display()
        ),
        (Some(_), Some(_)) => {}
    }
    ensure!(
        verdict_line.trim() == report.verdict_line(),
        "the console's verdict line `{verdict_line}` does not match its report (`{}`)",
        report.verdict_line()
    );
    // The farm lines (`KILN-CHECK <id> <status> <ms>`), whole despite the kernel's console.
    report
        .check_lines_match(&console)
        .with_context(|| format!("serial log: {}", serial_log.display()))?;
    println!(
        "boot-test: {} KILN-CHECK lines on the console, each whole, the report's ids and statuses",
        report.checks.len()
    );
    // The card must say the same as the console.
    let (card_bytes, on_card) = crate::report::read_report(&copy)
        .with_context(|| format!("reading the report back from {}", copy.display()))?;
    ensure!(
        on_card == report,
        "kiln/report.json on the boot partition differs from the report on the console"
    );
    if let Some(served) = &served_report {
        ensure!(
            *served == card_bytes,
            "GET /kiln/report ({} bytes) is not byte-equal to kiln/report.json on the card ({} \
             bytes)",
            served.len(),
            card_bytes.len()
        );
        println!(
            "boot-test: GET /kiln/report is byte-equal to kiln/report.json on the card ({} bytes)",
            served.len()
        );
    }
    // And it must be about this image.
    let boot = crate::report::boot_partition(&copy)?;
    // (A copy edited to have no manifest must give a report about no image.)
    let manifest = fat::read_file(
        &copy,
        boot.start_bytes(),
        boot.size_bytes(),
        "kiln/manifest.json",
    );
    let sha = manifest.ok().map(|m| hex::encode(Sha256::digest(&m)));
    ensure!(
        report.manifest == sha,
        "the report names manifest {:?}, but kiln/manifest.json on the disk hashes to {sha:?}",
        report.manifest
    );
    let run = match args.run {
        None => None,
        Some(_) => {
            let bytes = fat::read_file(
                &copy,
                boot.start_bytes(),
                boot.size_bytes(),
                "kiln/run.json",
            )
            .with_context(|| {
                format!(
                    "kiln.run was asked for but kiln/run.json is not on the boot partition \
                         (serial log: {})",
                    serial_log.display()
                )
            })?;
            Some(
                serde_json::from_slice(&bytes)
                    .context("kiln/run.json on the boot partition is not JSON")?,
            )
        }
    };
    Ok(Boot {
        report,
        verdict_line,
        boot_to_verdict: verdict_at.context("verdict line found but not timed")?,
        serial_log,
        run,
    })
}

pub fn print_boot(b: &Boot) {
    print!("{}", b.report.to_text());
    println!("boot-test: console: {}", b.verdict_line);
    println!(
        "boot-test: boot-to-verdict {:.1} s; serial log {}",
        b.boot_to_verdict.as_secs_f64(),
        b.serial_log.display()
    );
}

pub fn run(args: Args) -> Result<()> {
    let b = boot(&args)?;
    print_boot(&b);
    if b.report.verdict == Verdict::Fail {
        bail!(
            "the board's self-check FAILED: {}",
            b.report.failed_ids().join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pflash environment is byte for byte what u-boot-tools' `mkenvimage -s 0x40000`
    /// writes from the same text (the reference; the host-tests stage installs it).
    #[test]
    fn env_image_is_what_mkenvimage_writes() {
        crate::doctor::ensure(&[&crate::doctor::UBOOT_TOOLS]).expect("mkenvimage (u-boot-tools)");
        let d = tempfile::tempdir().unwrap();
        let txt = d.path().join("env.txt");
        let bin = d.path().join("env.bin");
        let env = "boot_targets=virtio0\nbootcmd=run distro_bootcmd\nbootdelay=0\n\
                   kiln_args=kiln.mode=test kiln.inject=stale\n";
        std::fs::write(&txt, env).unwrap();
        let sh = xshell::Shell::new().unwrap();
        let size = format!("{ENV_SIZE:#x}");
        cmd!(sh, "mkenvimage -s {size} -o {bin} {txt}")
            .quiet()
            .run()
            .unwrap();
        let (ours, theirs) = (
            env_image(env, ENV_SIZE).unwrap(),
            std::fs::read(&bin).unwrap(),
        );
        assert_eq!(ours.len(), theirs.len());
        let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        assert_eq!(first, None, "first difference at byte {first:?}");
        assert!(env_image("no equals sign\n", ENV_SIZE).is_err());
        assert!(env_image(&"a=b\n".repeat(ENV_SIZE / 4), ENV_SIZE).is_err());
    }

    #[test]
    fn env_from_the_real_u_boot() {
        let bin = std::fs::read(crate::tools_root::qemu_virt().unwrap().uboot).unwrap();
        let env = boot_env(
            default_env(&bin).unwrap(),
            "kiln.mode=test kiln.inject=stale",
        );
        assert!(env.contains("\nbootdelay=0\n"), "{env}");
        assert!(env.contains("\nboot_targets=virtio0\n"));
        assert!(env.contains("\nkiln_args=kiln.mode=test kiln.inject=stale\n"));
        assert!(env.starts_with("bootcmd=") || env.contains("\nbootcmd="));
        assert!(!env.contains("preboot="));
        assert_eq!(env.matches("bootdelay=").count(), 1);
    }

    #[test]
    fn env_parsing_stops_at_the_double_nul() {
        let blob = b"junk\0bootcmd=run distro_bootcmd\0distro_bootcmd=x\0bootdelay=2\0\0tail=no\0";
        let env = default_env(blob).unwrap();
        assert_eq!(env.len(), 3);
        assert!(default_env(b"bootcmd=x\0\0").is_err());
        // Standard boot (U-Boot 2025.01, Debian 13): no distro_bootcmd.
        let std = b"bootcmd=bootflow scan -lb\0bootdelay=2\0preboot=usb start\0\0";
        let env = boot_env(default_env(std).unwrap(), "kiln.mode=test");
        assert_eq!(
            env,
            "boot_targets=virtio0\nbootcmd=bootflow scan -lb\nbootdelay=0\nkiln_args=kiln.mode=test\n"
        );
        // A bootcmd that reads no extlinux.conf is refused.
        assert!(default_env(b"bootcmd=run distro_bootcmd\0\0").is_err());
    }

    #[test]
    fn inject_names_are_checked() {
        assert_eq!(kiln_args(None, None, false).unwrap(), "kiln.mode=test");
        assert_eq!(
            kiln_args(Some("untouched"), Some(16), false).unwrap(),
            "kiln.mode=test kiln.run=16 kiln.inject=untouched"
        );
        assert_eq!(
            kiln_args(Some("untouched"), None, true).unwrap(),
            "kiln.mode=test-serve kiln.inject=untouched"
        );
        assert!(kiln_args(Some("x y"), None, false).is_err());
    }

    #[test]
    fn init_runs_the_same_prompt() {
        let init =
            std::fs::read_to_string(crate::paths::project_root().join("rootfs/overlay/init"))
                .unwrap();
        assert!(
            init.contains(&format!("run_prompt=\"{RUN_PROMPT}\"")),
            "rootfs/overlay/init's run_prompt is not RUN_PROMPT"
        );
    }
}
