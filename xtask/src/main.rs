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
mod docs;
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

use clap::{CommandFactory as _, Parser};

/// kiln's host tool: set up the host, cross-build the runtime, test everything.
#[derive(Parser)]
#[command(name = "cargo xtask", version, about)]
enum Cli {
    /// List every host tool kiln needs, found or missing, with versions; install what is missing.
    ///
    /// Every `cargo xtask` command that needs host tools first asks this resolver for exactly those
    /// tools. As root on an apt-based system it installs what is missing (Debian packages, `rustup
    /// target add aarch64-unknown-linux-gnu`), printing each command it runs, and never takes
    /// anything away: it asks apt first what the install would remove and, if anything, stops
    /// naming the packages and the way out; it installs with `--no-remove`. Otherwise it stops with
    /// one line naming the tool, its package and the command to run (`KILN_NO_INSTALL=1` asks for
    /// that line instead of installing). `/usr/sbin` is searched even when a user's PATH lacks it.
    ///
    /// It also checks what a build as an ordinary user needs (unprivileged user namespaces,
    /// `newuidmap`, 65 536 subordinate ids for the user) and names what to enable
    /// (docs/rootless.md).
    Doctor(doctor::Args),
    /// Cross-build `kiln` for aarch64-unknown-linux-gnu (dynamic glibc) and print the artifact
    /// path.
    Build(build::Args),
    /// The one test command: fmt, clippy, host tests, aarch64 tests under qemu-user, QEMU boots,
    /// and more; the last line is `N passed, N failed[, N skipped …]`.
    ///
    /// The suite runs in two tiers from one table (docs/testing.md). The standard tier is what CI
    /// and every change run (budget 30 min on 2 cores): fmt, clippy, host tests, GGUF against
    /// gguf-py, kiln against llama.cpp, `kiln plan`, `kiln serve` against the openai client, the
    /// runtime's tests as aarch64 code under `qemu-aarch64-static` (cortex-a76 and a72), QEMU boots
    /// of the image (clean, NPU fault, the fault matrix, A/B with RAUC, the fleet and labgrid),
    /// flash to loop devices (root), image checks, U-Boot for rock-5b. `--full` adds the long
    /// proofs (the fresh machine, seeded and models power cuts, a fleet of boards, Gemma's window
    /// fault, a 30-minute soak, pins against Debian's archive), which a change to their area runs
    /// before it is done.
    ///
    /// Each stage prints its result and time; a failed stage does not stop the next. The run ends
    /// with where its time went against each stage's budget (also `target/test-times.json`;
    /// `--compare A B` sets two runs side by side) and exits non-zero if any stage failed.
    ///
    /// It runs as an ordinary user once the suite's reference tools are on the host (`cargo xtask
    /// doctor` names them and their packages). What needs root by nature ends SKIPPED with the
    /// reason, and the last line counts it: `flash` (loop devices), `fresh-machine` (a new root and
    /// a user of its own in it), and `image-checks`, whose every check runs but the reflash onto a
    /// loop device.
    Test(test::Args),
    /// Read the self-check report from the boot partition of an image or a card (read-only).
    ///
    /// Reads `kiln/report.json` from the boot slot of an image or a card (GPT and FAT parsed
    /// in-process, opened read-only, so a card needs no mounting; the first slot of `BOOT_ORDER`
    /// that has a report) and prints it, then `bootctl`'s `BOOT_ORDER`, each slot's tries left,
    /// good or bad, and each slot's last verdict, then the models slots: `MODELS_ORDER`, the one
    /// init maps next, and each models slot as its trailer describes it (`kiln-models.json`'s
    /// sha256, models, verity root; the factory models of which boot slot; signed or not; or
    /// empty).
    ///
    /// The report's `manifest=` is matched with what you flashed: whether the card's
    /// `kiln/manifest.json` still hashes to it, and which built image in `target/images/` has that
    /// manifest (its `kiln-<board>.manifest.sha256`), with that image's sha256.
    ///
    /// Exits non-zero on FAIL or when there is no report. The verdict is recounted from the checks,
    /// never taken from the stored field; a check the board's recipe requires (`[expect] checks`)
    /// that is missing is a FAIL.
    Report(report::Args),
    /// Boot a copy of the image under qemu-system-aarch64 through U-Boot and check its verdict.
    ///
    /// Builds the image (or takes `--image PATH` as is) and boots a copy
    /// (`target/boot-test/disk.img`) under the tools root's pinned `qemu-system-aarch64` (QEMU 7.2)
    /// through its pinned U-Boot 2023.01, with `kiln.mode=test` through U-Boot's environment;
    /// streams the serial console to `target/boot-test/serial.log`; requires the verdict within
    /// `--timeout` seconds and the report on the disk to equal the console's; prints the
    /// boot-to-verdict time. `cargo xtask report target/boot-test/disk.img` reads the copy's report
    /// afterwards.
    BootTest(boot_test::Args),
    /// The A/B slots under QEMU + U-Boot: updates, a failed update, a kernel that never reaches
    /// init, no good slot, and seeded power cuts (`--seeds N`).
    ///
    /// On copies of the built qemu-virt image under QEMU and Debian's U-Boot, rebooting as a board
    /// does (no `-no-reboot`): a new image boots A (PASS, marked good); `rauc install` on the board
    /// of a bundle of v2 (from a second disk, `kiln.update=`) into a blanked B, reboot, B PASS,
    /// marked good, `rauc status` agrees with kiln; bundles signed by another key (a system's and a
    /// models slot's), for another board, of a models format the board does not read, of systems
    /// that would not believe the models slot in use, with a flipped byte in the superblock,
    /// payload or signature, all named in one boot's `kiln.update=` list: each refused with its own
    /// reason, the sha256 of `boot_a`, `models_a` and `models_b` unchanged; v3 whose self-check
    /// fails boots B, FAIL, marked bad, reboot into A, PASS; v4 with a broken initramfs spends B's
    /// 3 tries, then A; no good slot: U-Boot boots the last marked good and the report says so.
    ///
    /// Then one power cut at each milestone of the update (A's boot, `rauc install`, the reboot,
    /// B's boot and its mark-good) and `--seeds N` more at seeded moments (CI runs 0: a fixed seed
    /// is a fixed moment): SIGKILL at a seeded moment of the update chain (phase printed), then
    /// boots until a PASS (at most 7), `fsck.vfat -n` on bootctl and the bootable slots, and the
    /// slot last marked good must have a PASS report.
    ///
    /// Then the fleet: the board's `kiln fleet` against a hawkBit DDI server on the host, with its
    /// power cuts and failures, and the models bundles it deploys (docs/ab-and-fleet.md). Stage
    /// `boot-qemu-ab` runs all this without seeded cuts; the seeded cuts, `--models-cuts` and
    /// `--boards` are long proofs (`cargo xtask test --full`).
    AbTest(ab_test::Args),
    /// Boot the image under qemu-system-aarch64 on this terminal: the self-check, then the board's
    /// console shell (Ctrl-A X quits).
    ///
    /// Builds the image if needed and boots a copy (`--persist`: the image itself, so its reports
    /// stay) under `qemu-system-aarch64` through U-Boot, not in test mode, the serial console on
    /// your terminal: U-Boot, the kernel, the self-check, then the board's shell (`cat
    /// /boot/kiln/report.txt`).
    ///
    /// After the verdict the board starts `kiln serve` on port 8080, as its recipe's `[serve]`
    /// says: with `--port-forward 8080:8080`, `curl localhost:8080/health` and any OpenAI client
    /// reach it; after a FAIL only `/health` and `/kiln/report` answer (docs/serving.md).
    Qemu(qemu::Args),
    /// Write an image to an SD card or eMMC: safety checks, bmap ranges only, read-back verify.
    ///
    /// Writes a raw or `.zst`/`.gz`/`.xz` image. Before a byte is written it refuses system,
    /// mounted, held, read-only and too-small disks (and, without `--force-non-removable` or
    /// `--force-large`, fixed or over-256 GB ones); then it writes only the `.bmap`'s ranges
    /// (`O_EXCL`, `O_DIRECT`), checks each range's sha256 and reads everything back past the page
    /// cache. Without `--device` it lists the candidates and asks.
    ///
    /// As an ordinary user it writes a device the user may write (e.g. through the `disk` group)
    /// and otherwise refuses before the prompt, naming the device's owner, group and mode and the
    /// way in (`usermod -aG disk`, or root); it never escalates by itself.
    ///
    /// `--api-key` and `--fleet-token` then put the board's own secrets on the card's `data`
    /// partition (root's, mode 0600; written with `debugfs -w`, read back, `e2fsck -fn` clean): the
    /// image stays the same bytes for every board. A fleet provisions each board's key at flashing;
    /// to rotate one, flash again with the new key or replace the file on `/data` (a board update
    /// never touches `data`).
    Flash(flash::Args),
    /// Build the bootable, reproducible disk image of a board into target/images/.
    ///
    /// Writes `target/images/kiln-<board>.img` (sparse GPT: `bootctl`, the boot slots `boot_a` and
    /// `boot_b` holding the same system, the models slots `models_a` and `models_b`, `data`), its
    /// `.img.bmap` and `.img.sha256`, `manifest.json` (every input with version and sha256, the
    /// partitions, the known answers), `kiln-<board>.manifest.sha256` (the sha256 the verdict line
    /// names) and its SBOMs (`kiln-<board>.spdx.json`, `.cdx.json`): bit-for-bit reproducible from
    /// the commit.
    ///
    /// Every step (kernel, runtime, initramfs, partitions, known answers, disk, bmap, manifest) is
    /// reused while the key of its inputs is the same and its outputs still have the sha256
    /// recorded when they were made, and the summary says which steps were made and which reused.
    /// Downloads go to `$XDG_CACHE_HOME/kiln/sha256/<hash>` and are re-verified on every use.
    ///
    /// rock-5b-vendor needs its vendor files first: the build lists each with how to supply it
    /// (`cargo xtask pins lock --input NAME=PATH`). A real board's image stops until its recipe
    /// names the fleet's update keyring (`[update] keyring = "…"`) or `--dev-keys` is given. In
    /// full: docs/image.md.
    Image(image::Args),
    /// Build a board's U-Boot alone from its recipe's [bootloader] (--twice: again, compared).
    ///
    /// Builds U-Boot in the tools root from the recipe's pinned public inputs (docs/rock-5b.md),
    /// checks the products (the RKNS header, the FIT's U-Boot and BL31 images, each BL31 segment
    /// the pinned `bl31.elf`'s) and prints their sha256. `--twice` builds again from a clean tree
    /// and requires the same bytes.
    Bootloader(image::loader::Args),
    /// Pinned inputs: check (resolve into the cache), update (re-pin Debian packages),
    /// update-tools-root, lock (a file you supply), seed (files fetched elsewhere).
    Pins(pins_cmd::Args),
    /// Measure speed: `cargo xtask bench image|gguf|matmul|model|serve|flash`.
    ///
    /// - `image`: cold build, no-op rebuild, runtime-change rebuild, kernel build alone, image and
    ///   initramfs sizes.
    ///
    /// - `gguf`: open+index of a sparse 4 GiB GGUF vs a 40 MiB one, their ratio, RSS growth.
    ///
    /// - `matmul`: CPU matmul at model shapes (F16, BF16, Q8_0, Q4_0, Q4_1; M = 1, 64, 512):
    ///   GFLOP/s, weight GB/s, measured read bandwidth, speed-up over the reference.
    ///
    /// - `model`: release `kiln bench` (`--backend cpu`, f16 KV) and llama.cpp (llama-cpp-python,
    ///   the `llama-cpp` stage's venv) on `--model` (default SmolLM2), same threads and lengths,
    ///   best of 3 alternating runs: prefill and decode tok/s of both, kiln ÷ llama.cpp, and each
    ///   side's anonymous RSS.
    ///
    /// - `serve`: `kiln serve` against `llama-server` (built once from the pinned llama-cpp-python
    ///   sdist's `vendor/llama.cpp`, AMX off where the CPU has it, into
    ///   `~/.cache/kiln/llama-server/<key>/`) on SmolLM2: `--parallel` = clients, same threads,
    ///   per-slot context 2048, f16 KV, no flash attention, one streamed `/v1/completions` per
    ///   client (temperature 0, `max_tokens` = `-n`); per client count, one server at a time,
    ///   alternating order, a warm-up round each: aggregate tok/s (all tokens ÷ the round's wall
    ///   time), median time to first token, and kiln ÷ llama-server.
    ///
    /// - `flash`: kiln vs `dd bs=4M oflag=direct` vs `bmaptool copy`, a 2 GiB image with 100 MiB
    ///   mapped, to a loop device (root).
    ///
    /// The figures: docs/speed.md.
    Bench(bench::Args),
    /// `cargo xtask soak serve --minutes N`: `kiln serve` under mixed clients for N minutes, its
    /// memory, descriptors and latency over time, and a verdict (not in CI).
    Soak(soak::Args),
    /// SPDX 2.3 and CycloneDX 1.6 SBOMs of the built image, from its manifest.json.
    ///
    /// Writes `target/images/kiln-<board>.spdx.json` (SPDX 2.3) and `.cdx.json` (CycloneDX 1.6),
    /// ids and dates from the commit and `SOURCE_DATE_EPOCH` (same manifest, same bytes),
    /// atomically. They hold the Debian packages (`pkg:deb/debian/…`, the licence their DEP-5
    /// `copyright` file declares, else `NOASSERTION` with the reason: not DEP-5, no copyright file
    /// in the package, a licence name with no SPDX id), the kernel with its Linux CPE and source
    /// package, `kiln` at its commit and the NPU stand-in, the Rust crates compiled into them
    /// (`pkg:cargo/…`, the `.crate` sha256 from Cargo.lock, the crate's SPDX licence expression;
    /// normal dependencies for aarch64, proc-macros marked compile-time only, build- and
    /// dev-dependencies left out), the models and fixtures with their GGUF `general.*` metadata
    /// (CycloneDX `machine-learning-model`), and the tools root's packages
    /// (`images/tools-root.toml`, `pkg:deb/debian/…?arch=amd64`, the .deb's sha256) as build tools,
    /// not contents (SPDX `BUILD_TOOL_OF` the image, CycloneDX `formulation`). The kernel's (and
    /// its source package's) and kiln's own licences are still `NOASSERTION`.
    ///
    /// `cargo xtask image` writes both beside the image too, and on the card (`kiln/sbom/`: made
    /// from the boot manifest, rooted at `kiln-<board> system` with no hash), beside the licence
    /// texts in `kiln/licenses/`. `cargo xtask test --stage sbom` validates both with their own
    /// tools (`pyspdxtools -i`, cyclonedx-python-lib's strict 1.6 schema validator, pinned in a
    /// venv) and shows that broken copies (no downloadLocation, a licence id not in the SPDX list,
    /// a component without name) are rejected; it reads the card's SBOMs from the image's boot
    /// partition and validates them the same way, and checks that every file under `kiln/sbom/` and
    /// `kiln/licenses/` on the card is in `boot.files` with its sha256.
    Sbom(sbom::Args),
    /// A signed RAUC bundle (verity) of the board's boot slot, or of a models slot (`--models`),
    /// for `rauc install` on the board.
    ///
    /// Made by Debian's `rauc` in the tools root (the image is built or reused first): `compatible`
    /// = `kiln-<board>`, version = the commit; signed without `--key` by kiln's public development
    /// key, with a warning. `<bundle>.json` beside it records the payload's sha256. Its hook
    /// refuses a system that would not believe the card's models slot in use. Every bundle is
    /// checked with `rauc info` against the keyring the board trusts, CRL included, so one the
    /// board would refuse never ships.
    ///
    /// With `--models M.gguf…` (or `--models-slot`: the `--model` files) it is a bundle of a models
    /// slot instead, and no system is built: `models.img` for the slot class `models` (the files
    /// and the self-check's fixtures in erofs, the dm-verity tree, `kiln-models.json` with the
    /// known answers — token ids, NLL, matmul outputs on real weights — computed by the image's own
    /// steps, the JSON's detached CMS signature by the bundle's key, checked against the board's
    /// keyring before it ships; `image-checks` extracts one and checks it). The board installs it
    /// into its models slot not in use (docs/models-slots.md).
    ///
    /// On the board: `rauc install /tmp/update.raucb && reboot` (docs/ab-and-fleet.md).
    Bundle(bundle::Args),
    /// kiln's labgrid suite (images/labgrid/) on the QEMU board, or with `--env` on a rack, or with
    /// `--remote` on the QEMU board as a remote place (coordinator, exporter, ser2net on loopback):
    /// write, boot, check lines against the report, an A/B update, a power cut.
    ///
    /// With pinned labgrid 26.0.1 (docs/farms.md): on the QEMU board by default (U-Boot's
    /// environment and the disk copy prepared), on a rack with `--env images/labgrid/rock-5b.yaml`
    /// and its `LG_*` variables; results in `target/labgrid/junit.xml`, the console in
    /// `target/labgrid/log/`. With `--remote` the results are in `target/labgrid-remote/`.
    Labgrid(farm::labgrid::Args),
    /// A fleet's own update keys, outside the checkout: `keys new` (a CA and a signing
    /// certificate), `keys sign` (a new signing certificate: rotation), `keys revoke` (retire one).
    ///
    /// Never written over existing files (private keys 0600; EC P-256 by `rcgen`, valid 1970–9999
    /// since a board may boot with its clock unset): `fleet-ca.pem`, `fleet-ca.key.pem` (keep it
    /// offline), `signing-cert.pem` + `signing-key.pem` for `cargo xtask bundle --key --cert`, and
    /// `keyring.pem` (the CA and its CRL: name it in the recipe, `[update] keyring =
    /// "…/keyring.pem"`; a keyring with a CRL turns on RAUC's `check-crl` on the board).
    ///
    /// To rotate the signing key: `keys sign` issues a new signing certificate from the same CA,
    /// which boards already trust. To retire a leaked one: `keys revoke` lists it in the CRL, then
    /// ship an image with the new `keyring.pem`, signed by a certificate still valid: boards refuse
    /// bundles the revoked one signed ("certificate revoked": with the tools root's RAUC 1.8 in
    /// `boot-qemu-ab`, and on the booted qemu-virt board, whose development keyring is a CA and CRL
    /// made the same way). To retire the CA, ship an update whose recipe names the new one, signed
    /// under the old.
    Keys(keys::Args),
    /// Write docs/commands.md from every command's `--help` (`cargo xtask`'s and the board's
    /// `kiln`'s, whose host build it runs), or print it.
    Docs(docs::Args),
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
        Cli::Docs(a) => docs::run(a, &Cli::command()),
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

    /// docs/commands.md's `cargo xtask` part is what `--help` says: a command, option or help
    /// text changed here is a failing test until `cargo xtask docs --write` puts it there.
    #[test]
    fn docs_commands_md_is_the_help() {
        use clap::CommandFactory as _;
        let path = crate::paths::project_root().join(crate::docs::PAGE);
        let doc = std::fs::read_to_string(&path).unwrap();
        let cli = super::Cli::command();
        let want =
            crate::docs::with_part(&doc, cli.get_name(), &crate::docs::xtask_part(&cli)).unwrap();
        assert!(
            doc == want,
            "docs/commands.md's `cargo xtask` part is not what `cargo xtask … --help` says: run \
             `cargo xtask docs --write`"
        );
    }
}
