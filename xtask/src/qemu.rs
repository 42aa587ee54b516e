//! `cargo xtask qemu [--board qemu-virt] [--image PATH] [--model PATH]… [--port-forward H:G]…
//! [--persist]`: boot the image on your desk. Builds it if needed (as `boot-test` does), boots a
//! copy (or, with `--persist`, the image itself) under `qemu-system-aarch64` through U-Boot, the
//! serial console on the terminal, not in test mode: U-Boot, the kernel, the self-check report,
//! then the board's console shell. Ctrl-A X quits (QEMU's own key).
//!
//! The U-Boot environment, the image build and the qemu command line are `boot_test`'s own
//! ([`boot_test::pflash_with`], [`boot_test::ensure_image`], [`boot_test::qemu_command`]).

use crate::boot_test;
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Board to boot (only qemu-virt can be emulated).
    #[arg(long, default_value = "qemu-virt")]
    pub board: String,
    /// Boot this image file instead of the board's built one (never built).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// A GGUF model to put on the models partition when the image is built (repeatable), as
    /// `cargo xtask image --model`.
    #[arg(long = "model")]
    pub models: Vec<PathBuf>,
    /// Forward host TCP port HOST to the board's port GUEST (repeatable; QEMU user networking
    /// `hostfwd=tcp::HOST-:GUEST`, a virtio-net NIC; the board takes its address by DHCP).
    /// `--port-forward 8080:8080` reaches the board's `kiln serve`.
    #[arg(long = "port-forward", value_name = "HOST:GUEST")]
    pub port_forwards: Vec<String>,
    /// Boot the image itself, not a copy, so that slot state and the reports it writes survive
    /// between runs (`cargo xtask report` reads them back).
    #[arg(long)]
    pub persist: bool,
    /// Boot the existing image without running `cargo xtask image` first.
    #[arg(long)]
    pub no_build: bool,
}

/// User networking's options after the NIC model: none (no network), or every forward.
pub fn nic(port_forwards: &[String]) -> Result<Option<String>> {
    if port_forwards.is_empty() {
        return Ok(None);
    }
    let mut nic = String::new();
    for pf in port_forwards {
        let (h, g) = pf
            .split_once(':')
            .with_context(|| format!("--port-forward {pf:?}: expected HOST:GUEST"))?;
        let port = |p: &str| -> Result<u16> {
            p.parse::<u16>()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("--port-forward {pf:?}: {p:?} is not a port (1-65535)"))
        };
        nic.push_str(&format!(",hostfwd=tcp::{}-:{}", port(h)?, port(g)?));
    }
    Ok(Some(nic))
}

/// The qemu command line of an interactive boot, ready to run: the image built or found, the
/// copy made (unless `--persist`), U-Boot's environment written. Returned as argv so that the
/// terminal (`run`) and a test over pipes run the same command.
pub fn command(args: &Args) -> Result<Vec<String>> {
    let machine = boot_test::emulated(&args.board)?;
    let nic = nic(&args.port_forwards)?;
    let image = boot_test::ensure_image(
        &args.board,
        args.image.as_deref(),
        args.no_build,
        &args.models,
    )?;
    let dir = crate::paths::target_dir().join("qemu");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // No kiln.mode: init runs the self-check, then gives the console shell.
    let pflash = boot_test::pflash_with(&dir, "")?;
    let disk = if args.persist {
        image
    } else {
        let copy = dir.join("disk.img");
        boot_test::copy_image(&image, &copy)?;
        copy
    };
    boot_test::qemu_command(
        &machine,
        &pflash,
        &boot_test::only(&disk),
        nic.as_deref(),
        &[],
    )
}

/// A `std::process::Command` of an argv.
pub fn to_command(argv: &[String]) -> std::process::Command {
    let mut c = std::process::Command::new(&argv[0]);
    c.args(&argv[1..]);
    c
}

/// The disk file a qemu command line boots.
fn disk_of(argv: &[String]) -> Result<&Path> {
    argv.iter()
        .find_map(|a| a.strip_prefix("if=none,id=d0,file="))
        .and_then(|a| a.strip_suffix(",format=raw"))
        .map(Path::new)
        .context("the qemu command names no disk")
}

pub fn run(args: Args) -> Result<()> {
    let argv = command(&args)?;
    let disk = disk_of(&argv)?;
    println!("qemu: {}", argv.join(" "));
    println!(
        "qemu: booting {}{}",
        disk.display(),
        if args.persist {
            " itself (--persist: what the board writes stays)"
        } else {
            " (a copy: the board's writes are gone at the next run; --persist keeps them)"
        }
    );
    println!("qemu: Ctrl-A X quits (QEMU's own key); the console shell comes after the self-check");
    let status = to_command(&argv)
        .status()
        .context("starting qemu-system-aarch64")?;
    ensure!(status.success(), "qemu-system-aarch64 exited with {status}");
    Ok(())
}

/// Drive an interactive boot over pipes, as a user at the console would: wait for the PASS
/// verdict and the shell prompt, `cat /boot/kiln/report.txt`, see the report; with `probe`, the
/// board's `kiln serve` (started by init after the PASS) is asked through a forwarded port from
/// the host, and its `/kiln/report` must be the card's bytes; Ctrl-A X, see qemu exit. Returns
/// the console text. `boot-qemu-clean` runs it on the image it built.
pub fn drive(
    image: &Path,
    timeout: std::time::Duration,
    probe: Option<&boot_test::Probe>,
) -> Result<String> {
    use std::io::Write;
    use std::process::Stdio;

    use std::time::Instant;
    let host_port = match probe {
        Some(_) => Some(boot_test::free_port()?),
        None => None,
    };
    let port_forwards = match host_port {
        Some(h) => vec![format!("{h}:{}", boot_test::serve_port("qemu-virt")?)],
        None => vec![],
    };
    let argv = command(&Args {
        board: "qemu-virt".into(),
        image: Some(image.to_path_buf()),
        models: vec![],
        port_forwards,
        persist: false,
        no_build: true,
    })?;
    let disk = disk_of(&argv)?.to_path_buf();
    let log_path = crate::paths::target_dir().join("qemu/serial.log");
    println!(
        "qemu-drive: {} (serial log {})",
        argv.join(" "),
        log_path.display()
    );
    let mut child = to_command(&argv)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting qemu-system-aarch64")?;
    let mut stdin = child.stdin.take().context("qemu's stdin")?;
    let out = child.stdout.take().context("qemu's stdout")?;
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let (seen, reader) = boot_test::console_reader(out, Some(log));
    let text = || {
        let s = seen.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&s).into_owned()
    };
    let started = Instant::now();
    // Wait until `what` is in the console after `from`; returns where it ends.
    let wait_for = |from: usize, what: &str, child: &mut std::process::Child| -> Result<usize> {
        loop {
            let t = text();
            if let Some(i) = t.get(from..).and_then(|t| t.find(what)) {
                return Ok(from + i + what.len());
            }
            if let Some(st) = child.try_wait()? {
                anyhow::bail!(
                    "qemu exited ({st}) before the console showed {what:?}; serial log {}",
                    log_path.display()
                );
            }
            if started.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!(
                    "no {what:?} on the console within {} s; serial log {}",
                    timeout.as_secs(),
                    log_path.display()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    let at = wait_for(0, "KILN-SELFTEST: PASS", &mut child)?;
    // Not the harness's JSON line: the table a person reads, before the verdict.
    let before = text();
    let before = before.get(..at).unwrap_or_default();
    anyhow::ensure!(
        before.contains("self-check on qemu-virt: PASS") && !before.contains("KILN-REPORT-BEGIN"),
        "the console showed no report table before the verdict (or the harness's JSON); serial log {}",
        log_path.display()
    );
    let at = wait_for(at, "kiln-init: console shell", &mut child)?;
    let at = wait_for(at, "# ", &mut child)?;
    println!(
        "qemu-drive: PASS verdict and a shell prompt after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    stdin.write_all(b"cat /boot/kiln/report.txt\n")?;
    stdin.flush()?;
    let at = wait_for(at, "self-check on qemu-virt: PASS", &mut child)?;
    let at = wait_for(at, "KILN-SELFTEST: PASS", &mut child)?;
    let _ = wait_for(at, "# ", &mut child)?;
    println!("qemu-drive: `cat /boot/kiln/report.txt` showed the report");
    let served = match (probe, host_port) {
        (Some(p), Some(h)) => {
            anyhow::ensure!(
                text().contains("kiln-init: serve: kiln serve --host 0.0.0.0"),
                "init did not start kiln serve after the PASS; serial log {}",
                log_path.display()
            );
            let dir = crate::paths::target_dir().join("qemu");
            let got =
                boot_test::run_probe(p, &format!("http://127.0.0.1:{h}"), &dir, &mut child, &text);
            if got.is_err() {
                let _ = child.kill();
                let _ = child.wait();
            }
            Some(got?)
        }
        _ => None,
    };
    println!("qemu-drive: sending Ctrl-A X");
    stdin.write_all(&[0x01, b'x'])?;
    stdin.flush()?;
    let quit = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if quit.elapsed() > std::time::Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("qemu did not exit within 10 s of Ctrl-A X");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = reader.join();
    println!(
        "qemu-drive: qemu exited ({status}) {:.1} s after Ctrl-A X",
        quit.elapsed().as_secs_f64()
    );
    if let Some(served) = served {
        let (card, _) = crate::report::read_report(&disk)?;
        anyhow::ensure!(
            served == card,
            "GET /kiln/report ({} bytes) is not byte-equal to kiln/report.json on the card ({} \
             bytes)",
            served.len(),
            card.len()
        );
        println!(
            "qemu-drive: GET /kiln/report is byte-equal to kiln/report.json on the card ({} bytes)",
            served.len()
        );
    }
    Ok(text())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_forwards_become_hostfwd() {
        assert_eq!(nic(&[]).unwrap(), None);
        assert_eq!(
            nic(&["8080:80".into(), "2222:22".into()])
                .unwrap()
                .as_deref(),
            Some(",hostfwd=tcp::8080-:80,hostfwd=tcp::2222-:22")
        );
        for bad in ["8080", "x:80", "0:80", "8080:70000", ":"] {
            assert!(nic(&[bad.into()]).is_err(), "{bad}");
        }
    }

    /// `cargo test -p xtask -- --ignored qemu_console`: boots the built image (run `cargo xtask
    /// image` first) and drives its console over pipes.
    #[test]
    #[ignore]
    fn qemu_console_over_a_pipe() {
        let img = boot_test::image_path("qemu-virt");
        let console = drive(&img, std::time::Duration::from_secs(600), None).unwrap();
        assert!(console.contains("U-Boot"), "{console}");
    }
}
