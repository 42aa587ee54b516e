//! `cargo xtask`: kiln's host tool, in the cargo-xtask convention (one module per subcommand,
//! external programs through `xshell::cmd!`, `anyhow` context at every step).

mod ab_test;
mod apt;
mod archive;
mod atomic;
mod bench;
mod bmap;
mod boot_test;
mod bootloader;
mod build;
mod bundle;
mod civil;
mod disk;
mod doctor;
mod farm;
mod flash;
mod fresh_machine;
mod http;
mod image;
mod kernel;
mod kernel_modules;
mod keys;
mod paths;
mod pins;
mod pins_cmd;
mod qemu;
mod readme;
mod report;
mod rootfs;
mod sbom;
mod soak;
mod test;
#[cfg(test)]
mod tidy;
mod tools_root;
mod userns;

use clap::Parser;

/// kiln's host tool: set up the host, cross-build the runtime, test everything.
#[derive(Parser)]
#[command(name = "cargo xtask", version, about)]
enum Cli {
    /// List every host tool kiln needs, found or missing, with versions; install what is missing.
    Doctor(doctor::Args),
    /// Cross-build `kiln` for aarch64-unknown-linux-gnu and print the artifact path.
    Build(build::Args),
    /// The one test command: fmt, clippy, host tests, aarch64 tests under qemu-user, and more.
    Test(test::Args),
    /// Read the self-check report from the boot partition of an image or a card (read-only).
    Report(report::Args),
    /// Boot a copy of the image under qemu-system-aarch64 through U-Boot and check its verdict.
    BootTest(boot_test::Args),
    /// The A/B slots under QEMU + U-Boot: updates, a failed update, a kernel that never reaches
    /// init, no good slot, and seeded power cuts (`--seeds N`).
    AbTest(ab_test::Args),
    /// Boot the image under qemu-system-aarch64 on this terminal: the self-check, then the
    /// board's console shell (Ctrl-A X quits).
    Qemu(qemu::Args),
    /// Write an image to an SD card or eMMC: safety checks, bmap ranges only, read-back verify.
    Flash(flash::Args),
    /// Build the bootable, reproducible disk image of a board into target/images/.
    Image(image::Args),
    /// Build a board's U-Boot alone from its recipe's [bootloader] (--twice: again, compared).
    Bootloader(image::loader::Args),
    /// Pinned inputs: check (resolve into the cache), update (re-pin Debian packages), lock.
    Pins(pins_cmd::Args),
    /// Measure speed: `cargo xtask bench flash|matmul|gguf|image|model|serve` (see README).
    Bench(bench::Args),
    /// `cargo xtask soak serve --minutes N`: `kiln serve` under mixed clients for N minutes, its
    /// memory, descriptors and latency over time, and a verdict (not in CI; see README).
    Soak(soak::Args),
    /// SPDX 2.3 and CycloneDX 1.6 SBOMs of the built image, from its manifest.json.
    Sbom(sbom::Args),
    /// A signed RAUC bundle (verity) of the board's boot slot, or of a models slot (`--models`), for
    /// `rauc install` on the board.
    Bundle(bundle::Args),
    /// kiln's labgrid suite (images/labgrid/) on the QEMU board, or with `--env` on a rack, or
    /// with `--remote` on the QEMU board as a remote place (coordinator, exporter, ser2net on
    /// loopback): write, boot, check lines against the report, an A/B update, a power cut.
    Labgrid(farm::labgrid::Args),
    /// A fleet's own update keys, outside the checkout: `keys new --out DIR` (a CA and a signing
    /// certificate), `keys sign --ca DIR --out DIR2` (a new signing certificate: rotation).
    Keys(keys::Args),
}

/// An expected error (a missing tool, a wrong pin) is one line: the cause chain and the remedy,
/// never a backtrace. Backtraces are for bugs: panics keep theirs.
fn main() {
    // Before any thread exists: what this process runs inherits it.
    if let Some(p) = std::env::var_os("PATH").and_then(|p| paths::with_sbin(&p)) {
        std::env::set_var("PATH", p);
    }
    if let Err(e) = dispatch(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Every command that needs host tools resolves exactly those through the doctor first.
fn dispatch(cli: Cli) -> anyhow::Result<()> {
    use doctor::prepare;
    match cli {
        Cli::Doctor(a) => doctor::run(a),
        Cli::Build(a) => {
            prepare("build", doctor::FOR_BUILD, true)?;
            build::run(a).map(|_| ())
        }
        Cli::Test(a) => test::run(a),
        Cli::Sbom(a) => sbom::run(a),
        Cli::Bundle(a) => bundle::run(a),
        Cli::Report(a) => {
            prepare("report", doctor::FOR_REPORT, false)?;
            report::run(a)
        }
        Cli::BootTest(a) => {
            prepare("boot-test", doctor::FOR_BOOT, false)?;
            // A given image (--image) or the last build (--no-build) needs no build tools.
            if !a.no_build && a.image.is_none() {
                prepare("boot-test", doctor::FOR_IMAGE, true)?;
            }
            boot_test::run(a)
        }
        Cli::AbTest(a) => {
            prepare("ab-test", doctor::FOR_BOOT, false)?;
            if a.image.is_none() {
                prepare("ab-test", doctor::FOR_IMAGE, true)?;
            }
            ab_test::run(a)
        }
        Cli::Qemu(a) => {
            prepare("qemu", doctor::FOR_BOOT, false)?;
            if !a.no_build && a.image.is_none() {
                prepare("qemu", doctor::FOR_IMAGE, true)?;
            }
            qemu::run(a)
        }
        Cli::Keys(a) => keys::run(a),
        Cli::Labgrid(a) => {
            prepare("labgrid", &[&doctor::PYTHON_VENV], false)?;
            farm::labgrid::run(a)
        }
        Cli::Flash(a) => {
            prepare("flash", doctor::FOR_FLASH, false)?;
            flash::run(a)
        }
        Cli::Image(a) => {
            prepare("image", doctor::FOR_IMAGE, true)?;
            image::run(a)
        }
        Cli::Bootloader(a) => {
            prepare("bootloader", doctor::FOR_IMAGE, false)?;
            image::loader::run(a)
        }
        Cli::Pins(a) => {
            prepare("pins", doctor::FOR_PINS, false)?;
            pins_cmd::run(a)
        }
        Cli::Bench(a) => {
            match a.what.as_str() {
                "flash" => prepare("bench flash", doctor::FOR_BENCH_FLASH, false)?,
                "image" => prepare("bench image", doctor::FOR_IMAGE, true)?,
                "matmul" | "gguf" => prepare(&format!("bench {}", a.what), &[], false)?,
                _ => {}
            }
            bench::run(a)
        }
        Cli::Soak(a) => soak::run(a),
    }
}

#[cfg(test)]
mod cli_tests {
    /// Every command's arguments are consistent (clap's own checks, which otherwise run only when
    /// that command is invoked: a clash in one subcommand panics at its first use).
    #[test]
    fn every_command_parses() {
        use clap::CommandFactory as _;
        super::Cli::command().debug_assert();
    }
}
