//! `cargo xtask ab-test [--seeds N]`: the A/B slots under real QEMU, real U-Boot (Debian's
//! `u-boot-qemu`, running `boot.scr` from `bootctl`) and the image's own init and self-check, on
//! copies of the built qemu-virt image (nothing is built here but the image, when missing).
//!
//! The machine runs *without* `-no-reboot`: a FAIL reboots into the other slot and a kernel that
//! never reaches init spends U-Boot's tries, exactly as on a board; a chain of boots ends when
//! init powers off after a verdict (`kiln.mode=test`). The console is split into boots at
//! `boot.scr`'s `kiln-boot: booting slot X` lines.
//!
//! Updates go through RAUC on the board: `kiln.update=vdb:/FILE` on the kernel command line and
//! an erofs second disk holding bundles made by `cargo xtask bundle` (signed with the public
//! development key, plus the ones RAUC must refuse). Scenarios that need a slot no bundle would
//! carry (a failing or unbootable system) write it from the host as `rauc install` does (the
//! target marked bad, its file system written, then marked active).
//!
//! Scenarios: a new image boots A and marks it good; `rauc install` of v2 from A into a blanked
//! B, B boots and is marked good with A kept behind it, and `rauc status` on the board reads the
//! counters as kiln does; bundles signed by another key (a system's and a models slot's), for
//! another board, needing models the
//! card does not hold, signed by a certificate the keyring's CRL revokes (the development keyring
//! is a CA and its CRL, as a fleet's from `cargo xtask keys`), with a byte flipped in the squashfs
//! superblock, in the payload or in the signature: each refused, `boot_a`, `models_a` and
//! `models_b` unchanged, the counters as they were; v3 in
//! B fails its self-check, is marked bad and the board reboots into A; v4 in B has a broken
//! initramfs, U-Boot spends B's three tries and boots A; with no good slot left U-Boot boots
//! the slot last marked good and the report says so.
//!
//! The fleet ([`fleet`]): the board's `kiln fleet` polls `hawkbit_mock` on the host, fetches
//! bundles from nginx, and reports an update's result only after the new slot's verdict.
//!
//! Power cuts: QEMU killed with SIGKILL at a seeded moment of the whole update chain (A's boot
//! and mark-good write, the verification and `rauc install` writing B, the reboot, B's boot and
//! mark-good write, the power-off), the phase printed; then the board is booted again until a
//! PASS, which must come within 7 boots, with `fsck.vfat -n` clean on `bootctl` and on every
//! slot U-Boot may boot (a slot RAUC had marked bad and was writing stays half written, out of
//! `BOOT_ORDER`, until the next install) and no slot marked good (the last marked good) whose
//! report is not a PASS.

mod fleet;

use crate::boot_test::{
    console_reader, copy_image, edit_ab_state, emulated, ensure_image, only, pflash_with,
    qemu_command, Disk,
};
use crate::disk::{fat, gpt};
use anyhow::{bail, ensure, Context, Result};
use kiln_runtime::selftest::report::{Report, Verdict, VERDICT_PREFIX};
use kiln_runtime::slot::{Slot, State};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// How many seeded power cuts beside the milestone cuts (0: the milestones only, as CI
    /// runs; a soak: `--seeds 200`).
    #[arg(long, default_value_t = 12)]
    pub seeds: u64,
    /// The first seed: `--first-seed 7 --seeds 1` runs seed 7 again.
    #[arg(long, default_value_t = 1)]
    pub first_seed: u64,
    /// Only the power cuts, not the scenarios.
    #[arg(long)]
    pub cuts_only: bool,
    /// Cut a models install instead of a system one (outside CI): `models.raucb` installed
    /// from A into `models_b`, the reboot, init's take of `models_b`'s one try and its verdict;
    /// after each cut the board must come up serving a models slot that passed, with `models_a`
    /// unchanged. Implies `--cuts-only`.
    #[arg(long, conflicts_with_all = ["fleet_only", "boards"])]
    pub models_cuts: bool,
    /// Only the fleet scenario (hawkBit DDI on the host, nginx serving the bundles).
    #[arg(long, conflicts_with = "cuts_only")]
    pub fleet_only: bool,
    /// With `--fleet-only`: a fault of `kiln fleet`'s for the board (`kiln.inject=fleet-NAME`),
    /// whose check must then fail the scenario: `early-success` (the success sent right after
    /// `rauc install`) fails with [`EARLY_SUCCESS`]. The suite's `ab-fleet-faults` runs it.
    #[arg(long, hide = true, requires = "fleet_only", value_parser = ["early-success"])]
    pub fleet_fault: Option<String>,
    /// The image (default: target/images/kiln-qemu-virt.img, built first when missing).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Only a fleet of N boards (N >= 3 makes sense; outside CI): N QEMU boards polling one
    /// hawkBit DDI server at once, the last given an update that FAILs; the results per board.
    #[arg(long, conflicts_with_all = ["cuts_only", "fleet_only"])]
    pub boards: Option<usize>,
}

/// The fleet scenario's failure when a success reached the DDI server before B's verdict (what
/// `--fleet-fault early-success` must give).
pub const EARLY_SUCCESS: &str = "a success feedback reached the server before B's verdict";

/// The boots a machine may take, in one chain, before it counts as a loop.
const MAX_BOOTS: usize = 8;
/// The boots a power cut may cost before a PASS (the bound).
const RECOVERY_BOOTS: usize = 7;
const BOOT_LINE: &str = "kiln-boot: booting slot ";
const NO_GOOD_LINE: &str = "kiln-boot: NO GOOD SLOT";

/// When to cut the power: at a moment, or as soon as a console line has appeared `n` times.
enum Cut {
    At(Duration),
    On(&'static str, usize),
}

/// The milestones of the update chain cut at as soon as they appear: what a seeded moment may
/// miss. The U-Boot line appears once per boot, so its second occurrence is B's first boot.
const MILESTONE_CUTS: &[(&str, usize, &str)] = &[
    ("update: rauc install", 1, "rauc install starts writing B"),
    (
        "update: installed; rebooting",
        1,
        "the install is done, before the reboot",
    ),
    (
        "kiln-boot: booting slot B",
        1,
        "U-Boot has counted B's first try",
    ),
    (
        "KILN-SELFTEST:",
        2,
        "B's verdict is out (the marks are written before it is printed), before the power-off",
    ),
];

/// The milestones of a models install chain from A (`models.raucb` into `models_b`).
const MODELS_MILESTONE_CUTS: &[(&str, usize, &str)] = &[
    (
        "update: rauc install",
        1,
        "rauc install starts writing models_b",
    ),
    (
        "update: installed; rebooting",
        1,
        "the install and its hook's mark are done, before the reboot",
    ),
    (
        "(took its try: MODELS_ORDER 'B A'",
        1,
        "init has taken models_b's one try, before mapping it",
    ),
    (
        "KILN-SELFTEST:",
        2,
        "the verdict on models_b is out (its mark written before it is printed), before the \
         power-off",
    ),
];

/// What a run of power cuts cuts: the update chain, its milestones and its boots uncut.
struct Plan {
    what: &'static str,
    bundle: &'static str,
    milestones: &'static [(&'static str, usize, &'static str)],
    uncut: &'static [(&'static str, Option<&'static str>)],
    /// A models install: the recovered board must serve a models slot that passed.
    models: bool,
}

const SYSTEM_PLAN: Plan = Plan {
    what: "rauc install of v2 from A",
    bundle: "v2.raucb",
    milestones: MILESTONE_CUTS,
    uncut: &[("A", Some("PASS")), ("B", Some("PASS"))],
    models: false,
};

const MODELS_PLAN: Plan = Plan {
    what: "rauc install of a models bundle from A into models_b",
    bundle: "models.raucb",
    milestones: MODELS_MILESTONE_CUTS,
    uncut: &[("A", Some("PASS")), ("A", Some("PASS"))],
    models: true,
};

/// One boot seen on the console.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    slot: String,
    /// PASS or FAIL, when the self-check gave a verdict.
    verdict: Option<String>,
    /// U-Boot found no slot with tries left.
    no_good: bool,
}

struct Chain {
    boots: Vec<Seen>,
    /// The serial console of the whole chain.
    console: String,
    /// QEMU was killed (a power cut), not powered off by init.
    killed: bool,
    secs: f64,
}

fn boots_of(console: &str) -> Vec<Seen> {
    let mut out: Vec<Seen> = Vec::new();
    let mut no_good = false;
    for l in console.lines().map(|l| l.trim_end_matches('\r')) {
        if l.starts_with(NO_GOOD_LINE) {
            no_good = true;
            if let Some(i) = l.find("booting slot ") {
                let slot = l[i + 13..].chars().next().unwrap_or('?').to_string();
                out.push(Seen {
                    slot,
                    verdict: None,
                    no_good,
                });
            }
            no_good = false;
        } else if let Some(rest) = l.strip_prefix(BOOT_LINE) {
            out.push(Seen {
                slot: rest.chars().next().unwrap_or('?').to_string(),
                verdict: None,
                no_good,
            });
        } else if let Some(rest) = l.strip_prefix(VERDICT_PREFIX) {
            if let Some(b) = out.last_mut() {
                b.verdict = rest.split_whitespace().next().map(str::to_string);
            }
        }
    }
    out
}

fn show(boots: &[Seen]) -> String {
    boots
        .iter()
        .map(|b| {
            format!(
                "{}{}:{}",
                if b.no_good { "(no good slot) " } else { "" },
                b.slot,
                b.verdict.as_deref().unwrap_or("no verdict")
            )
        })
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// A qemu-virt machine with its own disk and U-Boot environment.
struct Machine {
    dir: PathBuf,
    disk: PathBuf,
    pflash: PathBuf,
    /// What QEMU emulates (qemu-virt's `[qemu]`).
    qemu: crate::tools_root::machine::Machine,
}

impl Machine {
    fn new(dir: &Path, image: &Path) -> Result<Machine> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let pflash = pflash_with(dir, "kiln.mode=test")?;
        let disk = dir.join("disk.img");
        copy_image(image, &disk)?;
        Ok(Machine {
            dir: dir.to_path_buf(),
            disk,
            pflash,
            qemu: emulated("qemu-virt")?,
        })
    }

    /// Boot until init powers off (or `kill_after` passes: SIGKILL, a power cut).
    fn chain(&self, what: &str, kill_after: Option<Duration>) -> Result<Chain> {
        self.chain_with(what, kill_after.map(Cut::At), None)
    }

    /// [`Machine::chain`] with an update: `kiln.update=vdb:/FILE` on the kernel command line
    /// and `disk` (an erofs holding FILE) as the second virtio disk.
    fn chain_with(
        &self,
        what: &str,
        kill: Option<Cut>,
        update: Option<(&Path, &str)>,
    ) -> Result<Chain> {
        self.chain_words(what, kill, update, "")
    }

    /// [`Machine::chain_with`] with more words on the kernel command line (`kiln.probe=…`).
    fn chain_words(
        &self,
        what: &str,
        kill: Option<Cut>,
        update: Option<(&Path, &str)>,
        words: &str,
    ) -> Result<Chain> {
        let mut pflash = self.pflash.clone();
        let mut argv = if let Some((disk, file)) = update {
            let d = self.dir.join("update-flash");
            std::fs::create_dir_all(&d)?;
            pflash = pflash_with(
                &d,
                format!("kiln.mode=test kiln.update=vdb:/{file} {words}").trim_end(),
            )?;
            let disks = [
                Disk {
                    path: &self.disk,
                    options: "",
                },
                Disk {
                    path: disk,
                    options: "readonly=on",
                },
            ];
            qemu_command(&self.qemu, &pflash, &disks, None, &[])?
        } else {
            qemu_command(&self.qemu, &pflash, &only(&self.disk), None, &[])?
        };
        let argv = std::mem::take(&mut argv);
        let log_path = self.dir.join(format!("{what}.serial.log"));
        let mut child = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting qemu-system-aarch64")?;
        let out = child.stdout.take().context("qemu's stdout")?;
        let (seen, reader) = console_reader(out, None);
        let text = || {
            String::from_utf8_lossy(&seen.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
        };
        let started = Instant::now();
        let per_boot = Duration::from_secs(120);
        let mut killed = false;
        let mut failure = None;
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            let due = match &kill {
                Some(Cut::At(k)) => started.elapsed() >= *k,
                Some(Cut::On(marker, n)) => text().matches(marker).count() >= *n,
                None => false,
            };
            if due {
                child.kill().context("SIGKILL to qemu")?;
                killed = true;
                break;
            }
            let boots = boots_of(&text()).len();
            if boots > MAX_BOOTS {
                failure = Some(format!(
                    "more than {MAX_BOOTS} boots without a power-off: a boot loop"
                ));
            } else if started.elapsed() > per_boot * (boots.max(1) as u32) {
                failure = Some(format!(
                    "no power-off within {} s of boot {boots}",
                    per_boot.as_secs()
                ));
            }
            if failure.is_some() {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.wait();
        let _ = reader.join();
        let console = text();
        std::fs::write(&log_path, &console)
            .with_context(|| format!("writing {}", log_path.display()))?;
        if let Some(f) = failure {
            bail!("{what}: {f}; serial log {}", log_path.display());
        }
        Ok(Chain {
            boots: boots_of(&console),
            console: console.clone(),
            killed,
            secs: started.elapsed().as_secs_f64(),
        })
    }

    fn part(&self, name: &str) -> Result<gpt::PartitionEntryInfo> {
        gpt::read(&self.disk)?
            .into_iter()
            .find(|p| p.name == name)
            .with_context(|| format!("{} has no partition {name}", self.disk.display()))
    }

    fn read_part(&self, name: &str) -> Result<Vec<u8>> {
        let p = self.part(name)?;
        let f = std::fs::File::open(&self.disk)?;
        let mut b = vec![0u8; usize::try_from(p.size_bytes())?];
        f.read_exact_at(&mut b, p.start_bytes())
            .with_context(|| format!("reading {name} of {}", self.disk.display()))?;
        Ok(b)
    }

    fn write_part(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let p = self.part(name)?;
        ensure!(
            bytes.len() as u64 == p.size_bytes(),
            "{name}: {} bytes for a partition of {}",
            bytes.len(),
            p.size_bytes()
        );
        let f = std::fs::OpenOptions::new().write(true).open(&self.disk)?;
        f.write_all_at(bytes, p.start_bytes())?;
        f.sync_all()?;
        Ok(())
    }

    fn part_sha(&self, name: &str) -> Result<crate::pins::Sha256> {
        Ok(crate::pins::Sha256::of_bytes(&self.read_part(name)?))
    }

    fn state(&self) -> Result<State> {
        let p = self.part("bootctl")?;
        let b = fat::read_file(
            &self.disk,
            p.start_bytes(),
            p.size_bytes(),
            "kiln/abstate.env",
        )?;
        State::decode(&b, "bootctl's kiln/abstate.env")
    }

    fn report(&self, slot: Slot) -> Option<Report> {
        let p = self.part(part_of(slot)).ok()?;
        let b = fat::read_file(
            &self.disk,
            p.start_bytes(),
            p.size_bytes(),
            "kiln/report.json",
        )
        .ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// As `rauc install` into `slot`: mark it bad, write its file system, mark it active.
    fn install(&self, slot: Slot, fs: &[u8]) -> Result<()> {
        edit_ab_state(&self.disk, &self.dir, |st| st.mark_bad(slot))?;
        self.write_part(part_of(slot), fs)?;
        edit_ab_state(&self.disk, &self.dir, |st| st.mark_active(slot))?;
        Ok(())
    }

    /// `fsck.vfat -n` on the three FAT partitions: clean (init repairs a FAT a cut left
    /// inconsistent before it mounts it, and the chain ended in a clean power-off).
    fn fsck(&self) -> Result<()> {
        self.fsck_of(&["bootctl", "boot_a", "boot_b"])
    }

    /// [`Machine::fsck`] of bootctl and the slots U-Boot may boot (those in `BOOT_ORDER`); a
    /// slot out of it is one RAUC marked bad before writing it, and a cut during the write
    /// leaves it half written until the next install. Returns the slots left out.
    fn fsck_bootable(&self) -> Result<Vec<&'static str>> {
        let st = self.state()?;
        let order = st.order()?;
        let mut names = vec!["bootctl"];
        let mut skipped = vec![];
        for s in [Slot::A, Slot::B] {
            if order.contains(&s) {
                names.push(part_of(s));
            } else {
                skipped.push(part_of(s));
            }
        }
        self.fsck_of(&names)?;
        Ok(skipped)
    }

    fn fsck_of(&self, names: &[&str]) -> Result<()> {
        let sh = crate::paths::shell()?;
        for &name in names {
            let f = self.dir.join(format!("{name}.vfat"));
            std::fs::write(&f, self.read_part(name)?)?;
            let out = cmd!(sh, "fsck.vfat -n {f}")
                .quiet()
                .ignore_status()
                .output()?;
            ensure!(
                out.status.success(),
                "fsck.vfat -n finds {name} not clean (kept: {}): {}{}",
                f.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let _ = std::fs::remove_file(&f);
        }
        Ok(())
    }

    /// No slot marked good whose report is not a PASS.
    fn good_means_passed(&self) -> Result<()> {
        let st = self.state()?;
        if let Some(g) = st.env().get(kiln_runtime::slot::LAST_GOOD) {
            let slot = Slot::parse(g)?;
            let r = self.report(slot);
            ensure!(
                r.as_ref().is_some_and(|r| r.verdict == Verdict::Pass),
                "slot {g} is the last marked good, but its report is {:?}",
                r.map(|r| r.verdict)
            );
        }
        Ok(())
    }
}

fn part_of(slot: Slot) -> &'static str {
    match slot {
        Slot::A => "boot_a",
        Slot::B => "boot_b",
    }
}

fn expect(chain: &Chain, what: &str, want: &[(&str, Option<&str>)]) -> Result<()> {
    let got: Vec<(String, Option<String>)> = chain
        .boots
        .iter()
        .map(|b| (b.slot.clone(), b.verdict.clone()))
        .collect();
    let want: Vec<(String, Option<String>)> = want
        .iter()
        .map(|(s, v)| (s.to_string(), v.map(str::to_string)))
        .collect();
    ensure!(
        got == want,
        "{what}: boots {} (expected {})",
        show(&chain.boots),
        want.iter()
            .map(|(s, v)| format!("{s}:{}", v.as_deref().unwrap_or("no verdict")))
            .collect::<Vec<_>>()
            .join(" -> ")
    );
    println!(
        "ab-test: {what}: {} ({:.0} s)",
        show(&chain.boots),
        chain.secs
    );
    Ok(())
}

fn expect_state(m: &Machine, what: &str, order: &str, a: u32, b: u32) -> Result<()> {
    let st = m.state()?;
    let got = (
        st.env().get("BOOT_ORDER").unwrap_or("").to_string(),
        st.left(Slot::A)?,
        st.left(Slot::B)?,
    );
    ensure!(
        got == (order.to_string(), a, b),
        "{what}: BOOT_ORDER '{}', A {} left, B {} left; expected '{order}', {a}, {b}",
        got.0,
        got.1,
        got.2
    );
    Ok(())
}

/// A slot file system like `fs` with `path` replaced by `bytes` (mtools on a copy).
fn edited(work: &Path, fs: &[u8], path: &str, bytes: &[u8]) -> Result<Vec<u8>> {
    let img = work.join("edit.vfat");
    std::fs::write(&img, fs)?;
    crate::bundle::replace_in_fat(&img, path, bytes)?;
    Ok(std::fs::read(&img)?)
}

/// Where a cut chain was when the power went: the last milestone on its console.
fn phase_of(console: &str) -> String {
    const MILESTONES: &[(&str, &str)] = &[
        (BOOT_LINE, "U-Boot/kernel start"),
        ("kiln-init: started", "init, before the verdict"),
        (
            "kiln slot: models slot ",
            "init's take of a models slot, before the verdict",
        ),
        ("KILN-SELFTEST:", "the verdict and its mark-good/bad write"),
        ("updates: rauc service up", "RAUC up, before the install"),
        (
            "update: rauc install",
            "rauc install writing the other slot",
        ),
        (
            "update: installed; rebooting",
            "the reboot after the install",
        ),
        ("powering off", "the power-off"),
    ];
    let mut best: Option<(usize, &str)> = None;
    for (m, what) in MILESTONES {
        if let Some(at) = console.rfind(m) {
            if best.is_none_or(|(b, _)| at > b) {
                best = Some((at, what));
            }
        }
    }
    let boot = boots_of(console).len();
    match best {
        Some((_, what)) => format!("boot {boot}, {what}"),
        None => "before U-Boot".into(),
    }
}

/// splitmix64: the seeded moments, the same on every machine.
fn splitmix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn run(args: Args) -> Result<()> {
    let image = ensure_image("qemu-virt", args.image.as_deref(), false, &[])?;
    let work = crate::paths::target_dir().join("ab-test");
    std::fs::create_dir_all(&work)?;
    let t = Instant::now();
    let m = Machine::new(&work.join("scenarios"), &image)?;
    let v2 = m.read_part("boot_a")?;
    let ub = update_disk(&work)?;
    if let Some(n) = args.boards {
        fleet::boards(&work, &image, &work.join("bundles"), n)?;
        println!("ab-test: done in {:.0} s", t.elapsed().as_secs_f64());
        return Ok(());
    }
    if args.fleet_only {
        fleet::scenario(
            &work,
            &image,
            &work.join("bundles"),
            args.fleet_fault.as_deref(),
        )?;
        println!("ab-test: done in {:.0} s", t.elapsed().as_secs_f64());
        return Ok(());
    }
    if !args.cuts_only && !args.models_cuts {
        scenarios(&m, &v2, &ub)?;
        fleet::scenario(&work, &image, &work.join("bundles"), None)?;
    }
    cuts(&args, &work, &image, &ub)?;
    println!("ab-test: done in {:.0} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// The good bundle the run made (`v2.raucb`: this image's boot slot, signed with the development
/// key), which labgrid's suite installs after the run.
pub fn v2_bundle() -> PathBuf {
    crate::paths::target_dir().join("ab-test/bundles/v2.raucb")
}

/// The second model a models bundle carries (a seeded model of the llama fixture's shape).
const SECOND_MODEL: &str = "second-llama.gguf";

/// The erofs disk of the update scenarios: a bundle of this image (`v2.raucb`) and the bundles
/// RAUC must refuse.
fn update_disk(dir: &Path) -> Result<PathBuf> {
    let keys = crate::paths::project_root().join("xtask/src/image/update-keys");
    let bundles = dir.join("bundles");
    std::fs::create_dir_all(&bundles)?;
    let make = |name: &str, key: Option<(&str, &str)>, compatible: Option<&str>| {
        let pair = key.map(|(k, c)| (keys.join(k), keys.join(c)));
        crate::bundle::make(&crate::bundle::Args {
            compatible: compatible.map(str::to_string),
            // A bundle signed by another key is made to be refused by the board: it is checked
            // against its own certificate here, not the board's keyring.
            ..crate::bundle::Args::qemu_virt(pair.clone(), bundles.join(name), pair.map(|(_, c)| c))
        })
    };
    let good = make("v2.raucb", None, None)?;
    make(
        "other-key.raucb",
        Some(("other-key.pem", "other-cert.pem")),
        None,
    )?;
    // Signed by a certificate of the development CA that its CRL revokes: checked here against
    // the CA alone (no CRL), so that it is made; the board's keyring, with the CRL, refuses it.
    crate::bundle::make(&crate::bundle::Args::qemu_virt(
        Some((keys.join("revoked-key.pem"), keys.join("revoked-cert.pem"))),
        bundles.join("revoked.raucb"),
        Some(keys.join("dev-ca.pem")),
    ))?;
    make("other-board.raucb", None, Some("kiln-rock-5b"))?;
    // A models bundle of a second model (not the factory's): its slot carries its own known
    // answers, signed; and the same with its known NLL answer edited before signing.
    let second = bundles.join(SECOND_MODEL);
    std::fs::write(
        &second,
        kiln_runtime::model::fixture::gguf_seeded("kiln A/B test's second model", 0x5ec0)?,
    )?;
    let models_bundle = |name: &str, edit: fn(&mut crate::bundle::Args)| {
        let mut a = crate::bundle::Args::qemu_virt(None, bundles.join(name), None);
        a.models = vec![second.clone()];
        edit(&mut a);
        crate::bundle::make(&a)
    };
    models_bundle("models.raucb", |_| {})?;
    models_bundle("models-wrong-answer.raucb", |a| a.wrong_known_answer = true)?;
    // A models format the running system does not read: its hook refuses it (decision 6).
    models_bundle("models-format-2.raucb", |a| a.models_format = Some(2))?;
    // A models bundle signed by another key: RAUC refuses it as it refuses a system one, and
    // neither models slot is written.
    crate::bundle::make(&crate::bundle::Args {
        models_slot: true,
        ..crate::bundle::Args::qemu_virt(
            Some((keys.join("other-key.pem"), keys.join("other-cert.pem"))),
            bundles.join("models-other-key.raucb"),
            Some(keys.join("other-cert.pem")),
        )
    })?;
    // Systems that would not believe the models slot in use (the factory models_a): one reading
    // another models format, one naming another factory slot (decision 6).
    crate::bundle::make(&crate::bundle::Args {
        system_models_format: Some(2),
        ..crate::bundle::Args::qemu_virt(None, bundles.join("other-format.raucb"), None)
    })?;
    crate::bundle::make(&crate::bundle::Args {
        system_factory_models: Some("0".repeat(64)),
        ..crate::bundle::Args::qemu_virt(None, bundles.join("other-factory.raucb"), None)
    })?;
    // For the fleet: signed and installable, but its system FAILs its self-check.
    crate::bundle::make(&crate::bundle::Args {
        failing_system: true,
        ..crate::bundle::Args::qemu_virt(None, bundles.join("v3-fails.raucb"), None)
    })?;
    let bytes = std::fs::read(&good.path)?;
    let mut head = bytes.clone();
    head[0x20] ^= 0x01;
    std::fs::write(bundles.join("flipped-head.raucb"), &head)?;
    let mut mid = bytes.clone();
    let at = mid.len() / 2;
    mid[at] ^= 0x01;
    std::fs::write(bundles.join("flipped-payload.raucb"), &mid)?;
    let mut sig = bytes;
    let at = sig.len() - 200;
    sig[at] ^= 0x01;
    std::fs::write(bundles.join("flipped-sig.raucb"), &sig)?;
    let files: Vec<(String, PathBuf)> = [
        "v2.raucb",
        "models.raucb",
        "models-wrong-answer.raucb",
        "models-format-2.raucb",
        "models-other-key.raucb",
        "other-key.raucb",
        "revoked.raucb",
        "other-board.raucb",
        "other-format.raucb",
        "other-factory.raucb",
        "flipped-head.raucb",
        "flipped-payload.raucb",
        "flipped-sig.raucb",
    ]
    .iter()
    .map(|n| (n.to_string(), bundles.join(n)))
    .collect();
    let disk = dir.join("update.erofs");
    let tools = crate::tools_root::ensure(false)?;
    crate::disk::erofs::build_files(
        &disk,
        &files,
        crate::disk::guid_from_seed("ab-test", "update-disk"),
        0,
        Some(&tools),
    )?;
    Ok(disk)
}

/// `rauc status` on the board (printed by init under `kiln.mode=test`) reads the counters as
/// kiln does: the same good/bad per slot and the same primary.
fn rauc_agrees(c: &Chain, m: &Machine) -> Result<()> {
    let line = c
        .console
        .lines()
        .rev()
        .find_map(|l| l.split("kiln-rauc-status: ").nth(1))
        .context("no `kiln-rauc-status:` line on the console: RAUC did not run")?;
    let v: serde_json::Value = serde_json::from_str(line.trim())
        .with_context(|| format!("rauc status --output-format=json: {line}"))?;
    let st = m.state()?;
    let primary = st.primary()?.map(|s| match s {
        Slot::A => "boot.0",
        Slot::B => "boot.1",
    });
    ensure!(
        v["boot_primary"].as_str() == primary,
        "rauc status: primary {:?}, kiln: {primary:?}",
        v["boot_primary"]
    );
    let slots = v["slots"].as_array().context("rauc status: no slots")?;
    for (slot, name) in [(Slot::A, "boot.0"), (Slot::B, "boot.1")] {
        let s = slots
            .iter()
            .find_map(|o| o.get(name))
            .with_context(|| format!("rauc status: no slot {name}"))?;
        let good = st.is_good(slot)?;
        let rauc_good = s["boot_status"].as_str() == Some("good");
        ensure!(
            rauc_good == good,
            "rauc status: {name} boot_status {:?}, kiln: {}",
            s["boot_status"],
            if good { "good" } else { "bad" }
        );
    }
    Ok(())
}

fn scenarios(m: &Machine, v2: &[u8], ub: &Path) -> Result<()> {
    // A new image: A boots, passes, is marked good; B is untouched.
    let c = m.chain("1-new", None)?;
    expect(&c, "a new image", &[("A", Some("PASS"))])?;
    expect_state(m, "after the first boot", "A B", 3, 3)?;

    // v2 into B by RAUC on the board: `kiln.update=` a signed bundle of this image's boot slot
    // on a second disk. B is blanked first, so that B can only boot what RAUC wrote. A boots,
    // passes, installs, reboots; B boots first, passes, is marked good; A stays behind it.
    m.write_part("boot_b", &vec![0u8; v2.len()])?;
    let c = m.chain_with("2-v2-rauc", None, Some((ub, "v2.raucb")))?;
    expect(
        &c,
        "v2 installed by `rauc install` on A",
        &[("A", Some("PASS")), ("B", Some("PASS"))],
    )?;
    ensure!(
        c.console.contains("update: installed; rebooting into it"),
        "the console does not say the bundle was installed"
    );
    ensure!(
        c.console
            .contains("was tried before: installed from slot A"),
        "B's boot, with the same kiln.update word, does not say the bundle was already installed: \
         kiln.update must install once"
    );
    expect_state(m, "after v2", "B A", 3, 3)?;
    rauc_agrees(&c, m)?;
    // The comparison fails where the two disagree: the same console against counters edited
    // after it (A marked bad), then the counters put back.
    let ctl = m.read_part("bootctl")?;
    edit_ab_state(&m.disk, &m.dir, |st| st.mark_bad(Slot::A))?;
    ensure!(
        rauc_agrees(&c, m).is_err(),
        "rauc_agrees accepts counters other than the ones rauc status read"
    );
    m.write_part("bootctl", &ctl)?;
    println!("ab-test: RAUC installed the bundle into the blanked slot B; rauc status reads the counters as kiln does");

    // Bundles RAUC must refuse, all named in one boot's `kiln.update=` (init tries each in turn
    // and installs the first RAUC accepts): each refused with its own reason, nothing written to
    // the slot it would install into (A), the counters as they were. (B, booted, only gets its
    // new report.)
    let refused: &[(&str, &str, &str)] = &[
        (
            "other-key.raucb",
            "signed by a key the board does not trust",
            "signature verification failed",
        ),
        (
            "models-other-key.raucb",
            "of a models slot signed by a key the board does not trust",
            "signature verification failed",
        ),
        (
            "revoked.raucb",
            "signed by a certificate the keyring's CRL revokes",
            "certificate revoked",
        ),
        (
            "other-board.raucb",
            "made for another board (compatible kiln-rock-5b)",
            "Compatible mismatch",
        ),
        (
            "models-format-2.raucb",
            "of models in a format the running system does not read",
            "this models bundle is models format 2; the running system reads format 1",
        ),
        (
            "other-format.raucb",
            "whose system reads another models format than the slot in use",
            "this system reads models format 2; the models slot in use (/dev/vda4) is format 1",
        ),
        (
            "other-factory.raucb",
            "whose system names another factory models slot, with the unsigned factory slot in use",
            "kiln-models.json 0000000000000000000000000000000000000000000000000000000000000000; the models slot in use (/dev/vda4) is",
        ),
        (
            "flipped-head.raucb",
            "one byte flipped in its squashfs superblock",
            "dm-verity",
        ),
        (
            "flipped-payload.raucb",
            "one byte flipped in the middle of its payload",
            "does not read back as its signed manifest says",
        ),
        (
            "flipped-sig.raucb",
            "one byte flipped in its signature",
            // Where the flipped byte lands in the CMS decides which of the two RAUC says.
            "no valid CMS|signature verification failed",
        ),
    ];
    let parts = ["boot_a", "models_a", "models_b"];
    let before = parts
        .iter()
        .map(|p| m.part_sha(p))
        .collect::<Result<Vec<_>>>()?;
    let files: Vec<&str> = refused.iter().map(|r| r.0).collect();
    let c = m.chain_with("2-refuse", None, Some((ub, &files.join(","))))?;
    expect(&c, "bundles RAUC must refuse", &[("B", Some("PASS"))])?;
    for (p, was) in parts.iter().zip(&before) {
        ensure!(
            m.part_sha(p)? == *was,
            "{p} changed although RAUC refused every bundle"
        );
    }
    expect_state(m, "after the bundles RAUC refused", "B A", 3, 3)?;
    let n = refused.len();
    for (i, (file, why, reason)) in refused.iter().enumerate() {
        // This bundle's part of the console: from init's line naming it to the next one's.
        let start = format!("update: bundle {} of {n}: /mnt/update/{file}", i + 1);
        let part = c
            .console
            .split(&start)
            .nth(1)
            .with_context(|| format!("a bundle {why}: init never tried it (`{start}`)"))?;
        let part = part
            .split(&format!("update: bundle {} of {n}: ", i + 2))
            .next()
            .unwrap_or(part);
        ensure!(
            part.contains("update: RAUC refused"),
            "a bundle {why}: the console does not say RAUC refused it"
        );
        let said = part
            .lines()
            .map(|l| l.split("kiln-rauc: ").nth(1).unwrap_or(l))
            .find(|l| reason.split('|').any(|r| l.contains(r)))
            .with_context(|| {
                format!("a bundle {why}: refused, but RAUC's output does not name `{reason}`")
            })?;
        println!(
            "ab-test: refused, boot_a, models_a and models_b unchanged: a bundle {why}: {}",
            said.trim()
        );
    }
    ensure!(
        c.console.contains(&format!(
            "update: none of the {n} bundle(s) installed; booting on"
        )),
        "init did not say that none of the {n} bundles was installed"
    );

    // The models bundles that install and boot (success, and a slot the self-check blames) go
    // through the fleet client: `fleet::scenario`'s steps 4 and 5.

    // The updates tree on the booted slot with a flipped byte: the self-check does not read it
    // (nothing runs it before the verdict), so B still passes; init hashes it before mounting
    // it and refuses, so RAUC does not start and nothing is installed.
    let b_fs = m.read_part("boot_b")?;
    let tree = fat::read_file(
        &m.disk,
        m.part("boot_b")?.start_bytes(),
        m.part("boot_b")?.size_bytes(),
        "kiln/updates.erofs",
    )?;
    let mut bad = tree.clone();
    let at = bad.len() / 3;
    bad[at] ^= 0x01;
    m.write_part(
        "boot_b",
        &edited(&m.dir, &b_fs, "kiln/updates.erofs", &bad)?,
    )?;
    let a = m.part_sha("boot_a")?;
    let c = m.chain_with("2-updates-tree-flipped", None, Some((ub, "v2.raucb")))?;
    expect(
        &c,
        "the updates tree with a flipped byte",
        &[("B", Some("PASS"))],
    )?;
    ensure!(
        c.console
            .contains("does not match /etc/kiln/updates.sha256")
            && c.console.contains("RAUC is not running: nothing installed"),
        "a flipped byte in kiln/updates.erofs: init did not refuse to mount it"
    );
    ensure!(m.part_sha("boot_a")? == a, "boot_a changed");
    ensure!(
        c.console.contains("models slot A) on /models"),
        "the boot did not map the factory models slot models_a"
    );
    expect_state(m, "after the flipped updates tree", "B A", 3, 3)?;
    println!("ab-test: a flipped byte in B's kiln/updates.erofs: init refused to mount it, no RAUC, nothing installed");

    // v3 into B, a system whose manifest does not match its kernel: image.manifest fails.
    let manifest = fat::read_file(
        &m.disk,
        m.part("boot_a")?.start_bytes(),
        m.part("boot_a")?.size_bytes(),
        "kiln/manifest.json",
    )?;
    let mut mv: serde_json::Value = serde_json::from_slice(&manifest)?;
    let img = mv["boot"]["files"]["/Image"]["sha256"]
        .as_str()
        .context("manifest: no /Image sha256")?
        .to_string();
    mv["boot"]["files"]["/Image"]["sha256"] =
        serde_json::json!(img.chars().rev().collect::<String>());
    let v3 = edited(
        &m.dir,
        v2,
        "kiln/manifest.json",
        &serde_json::to_vec_pretty(&mv)?,
    )?;
    m.install(Slot::B, &v3)?;
    let c = m.chain("3-v3-fail", None)?;
    expect(
        &c,
        "v3 (fails its self-check) in B",
        &[("B", Some("FAIL")), ("A", Some("PASS"))],
    )?;
    expect_state(m, "after v3", "A", 3, 0)?;
    let rb = m.report(Slot::B).context("no report on boot_b after v3")?;
    let ra = m.report(Slot::A).context("no report on boot_a after v3")?;
    ensure!(
        rb.verdict == Verdict::Fail
            && rb.failed_ids().contains(&"image.manifest")
            && rb
                .slot
                .as_ref()
                .is_some_and(|d| d.action == "marked bad" && d.reboot_into.as_deref() == Some("A")),
        "boot_b's report does not say FAIL on image.manifest, marked bad, rebooting into A: {:?}",
        rb.slot
    );
    ensure!(
        ra.verdict == Verdict::Pass && ra.slot.as_ref().is_some_and(|d| d.action == "marked good"),
        "boot_a's report does not say PASS, marked good: {:?}",
        ra.slot
    );
    println!("ab-test: the card holds both boots: boot_b FAIL (image.manifest, marked bad), boot_a PASS (marked good)");

    // v4 into B, an initramfs the kernel cannot unpack: no init, no verdict; U-Boot spends
    // B's three tries and then boots A.
    let size = usize::try_from(
        mv["boot"]["files"]["/initramfs.cpio.gz"]["size"]
            .as_u64()
            .context("manifest: no initramfs size")?,
    )?;
    let v4 = edited(&m.dir, v2, "initramfs.cpio.gz", &vec![0x5a; size])?;
    m.install(Slot::B, &v4)?;
    let c = m.chain("4-v4-broken", None)?;
    expect(
        &c,
        "v4 (broken initramfs) in B",
        &[("B", None), ("B", None), ("B", None), ("A", Some("PASS"))],
    )?;
    expect_state(m, "after v4", "B A", 3, 0)?;

    // No good slot: both out of BOOT_ORDER. U-Boot boots the last marked good (A) and saves
    // nothing; the report says there is no good slot.
    edit_ab_state(&m.disk, &m.dir, |st| {
        st.mark_bad(Slot::A)?;
        st.mark_bad(Slot::B)
    })?;
    let c = m.chain("5-no-good", None)?;
    ensure!(
        c.boots.len() == 1
            && c.boots[0].no_good
            && c.boots[0].slot == "A"
            && c.boots[0].verdict.as_deref() == Some("PASS"),
        "no good slot: boots {} (expected one boot of A, said to be without a good slot, PASS)",
        show(&c.boots)
    );
    let ra = m.report(Slot::A).context("no report on boot_a")?;
    ensure!(
        ra.slot.as_ref().is_some_and(|d| d.no_good_slot),
        "boot_a's report does not say there is no good slot: {:?}",
        ra.slot
    );
    println!(
        "ab-test: no good slot: {} ({:.0} s); the report says NO GOOD SLOT",
        show(&c.boots),
        c.secs
    );
    m.fsck()?;
    println!("ab-test: fsck.vfat -n finds bootctl, boot_a and boot_b clean after the scenarios");
    Ok(())
}

/// Cut the power of `m`'s update chain at `kill`, then boot it again until a PASS; what it saw.
fn cut_and_recover(m: &Machine, ub: &Path, kill: Cut, plan: &Plan) -> Result<String> {
    // Only a models install's cuts check the factory models slot afterwards.
    let models_a = if plan.models {
        Some(m.part_sha("models_a")?)
    } else {
        None
    };
    let cut = m.chain_with("cut", Some(kill), Some((ub, plan.bundle)))?;
    let mut last_console = cut.console.clone();
    let mut boots = cut.boots.clone();
    // Power comes back: the board boots (again, without the update) until a PASS.
    let mut after: Vec<Seen> = Vec::new();
    let mut n = 0;
    while cut.killed && !after.iter().any(|b| b.verdict.as_deref() == Some("PASS")) {
        n += 1;
        ensure!(
            boots.len() <= RECOVERY_BOOTS,
            "no PASS within {RECOVERY_BOOTS} boots: {}",
            show(&boots)
        );
        let c = m.chain(&format!("after-{n}"), None)?;
        boots.extend(c.boots.clone());
        after.extend(c.boots);
        last_console = c.console;
    }
    let pass_at = after
        .iter()
        .position(|b| b.verdict.as_deref() == Some("PASS"))
        .unwrap_or(0);
    ensure!(
        pass_at < RECOVERY_BOOTS,
        "the PASS came at boot {} after the cut (more than {RECOVERY_BOOTS}): {}",
        pass_at + 1,
        show(&boots)
    );
    let skipped = m.fsck_bootable()?;
    m.good_means_passed()?;
    let served = if let Some(models_a) = models_a {
        ensure!(
            m.part_sha("models_a")? == models_a,
            "the factory models slot models_a changed"
        );
        format!("; {}", served_models_passed(m, &last_console)?)
    } else {
        String::new()
    };
    let st = m.state()?;
    Ok(format!(
        "{}{}; then BOOT_ORDER '{}', A {}, B {}{served}; fsck.vfat -n clean{}",
        if cut.killed {
            format!("in {}: ", phase_of(&cut.console))
        } else {
            "(finished before the cut) ".into()
        },
        show(&boots),
        st.env().get("BOOT_ORDER").unwrap_or(""),
        st.left(Slot::A)?,
        st.left(Slot::B)?,
        if skipped.is_empty() {
            String::new()
        } else {
            format!(
                " (bootctl and the bootable slots; {} marked bad, not checked)",
                skipped.join(", ")
            )
        }
    ))
}

/// The models slot the last boot of `console` (a PASS) mapped, which must be the one its verdict
/// marked good and is marked good in the counters now: the board serves a models slot that
/// passed.
fn served_models_passed(m: &Machine, console: &str) -> Result<String> {
    use kiln_runtime::slot::Class;
    let last = console.rsplit(BOOT_LINE).next().unwrap_or("");
    let mapped = last
        .lines()
        .find_map(|l| l.split("kiln slot: models slot ").nth(1))
        .and_then(|r| r.chars().next())
        .context("the last boot does not say which models slot init mapped")?;
    let slot = Slot::parse(&mapped.to_string())?;
    ensure!(
        last.contains(&format!("models slot {mapped}: marked good")),
        "the last boot mapped models slot {mapped}, but its verdict did not mark it good"
    );
    let st = m.state()?;
    ensure!(
        st.is_good_of(Class::Models, slot)?,
        "the last boot's models slot {mapped} is not good in the counters: {}",
        st.describe_of(Class::Models)
    );
    Ok(format!(
        "serving models slot {mapped} (passed; {})",
        st.describe_of(Class::Models)
    ))
}

fn cuts(args: &Args, work: &Path, image: &Path, ub: &Path) -> Result<()> {
    let plan = if args.models_cuts {
        &MODELS_PLAN
    } else {
        &SYSTEM_PLAN
    };
    let mut failures = Vec::new();
    if args.seeds > 0 {
        failures = seeded_cuts(args, work, image, ub, plan)?;
    }
    // And at each milestone of the chain the moments may miss (with `--seeds 0`, only these:
    // what CI runs).
    let mut missed = Vec::new();
    for (i, (marker, n, what)) in plan.milestones.iter().enumerate() {
        let m = Machine::new(&work.join(format!("cut-milestone-{i}")), image)?;
        match cut_and_recover(&m, ub, Cut::On(marker, *n), plan) {
            Ok(s) => {
                println!("ab-test: cut when {what}: {s}");
                let _ = std::fs::remove_file(&m.disk);
            }
            Err(e) => {
                println!("ab-test: cut when {what}: FAILED: {e:#}");
                missed.push(*what);
            }
        }
    }
    ensure!(
        failures.is_empty() && missed.is_empty(),
        "power cuts: seeds {failures:?} failed (rerun one with --first-seed N --seeds 1), \
         milestones {missed:?} failed"
    );
    println!(
        "ab-test: {} seeded and {} milestone power cuts of the {}: each reached a PASS within {RECOVERY_BOOTS} boots, FAT clean, no slot marked good without a PASS{}",
        args.seeds,
        plan.milestones.len(),
        plan.what,
        if plan.models {
            ", a models slot that passed served, models_a unchanged"
        } else {
            ""
        }
    );
    Ok(())
}

/// `args.seeds` power cuts at moments drawn from the span of an uncut chain: the seeds that
/// failed.
fn seeded_cuts(args: &Args, work: &Path, image: &Path, ub: &Path, plan: &Plan) -> Result<Vec<u64>> {
    // The uncut chain gives the span the moments are drawn from: A boots and passes, RAUC
    // installs the bundle into B (marks B bad, writes it, marks it active), the board reboots,
    // B boots, passes and is marked good. Run here, just before the cut chains, on a fresh
    // machine like theirs: the scenarios' v2 chain, tried as the span, ran at least 15 % longer
    // than a cut chain in CI (45.0 s; the cut chain was done before 39.2 s), and a seed drawn
    // past a chain's end cuts nothing.
    let reference = Machine::new(&work.join("cut-reference"), image)?;
    let c = reference.chain_with("reference", None, Some((ub, plan.bundle)))?;
    expect(&c, &format!("uncut reference ({})", plan.what), plan.uncut)?;
    let secs = c.secs;
    let span_ms = (secs * 1000.0) as u64;
    let mut failures = Vec::new();
    for seed in args.first_seed..args.first_seed + args.seeds {
        let at = Duration::from_millis(splitmix(seed) % span_ms.max(1));
        let m = Machine::new(&work.join(format!("cut-{seed}")), image)?;
        let r = cut_and_recover(&m, ub, Cut::At(at), plan);
        match r {
            Ok(s) => {
                println!(
                    "ab-test: seed {seed}: cut at {:.2} s of {:.1}: {s}",
                    at.as_secs_f64(),
                    secs
                );
                let _ = std::fs::remove_file(&m.disk);
            }
            Err(e) => {
                println!(
                    "ab-test: seed {seed}: cut at {:.2} s: FAILED: {e:#}",
                    at.as_secs_f64()
                );
                failures.push(seed);
            }
        }
    }
    Ok(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_splits_into_boots() {
        let log = "U-Boot\nkiln-boot: booting slot B (p3), BOOT_A_LEFT 3, BOOT_B_LEFT 2\nKILN-SELFTEST: FAIL 3/4 manifest=x\n\
                   kiln-boot: booting slot A (p2), BOOT_A_LEFT 2, BOOT_B_LEFT 0\nKILN-SELFTEST: PASS 4/4 manifest=x\n\
                   kiln-boot: NO GOOD SLOT (BOOT_ORDER '', A 0 left, B 0 left): booting slot A, the last\n";
        let b = boots_of(log);
        assert_eq!(show(&b), "B:FAIL -> A:PASS -> (no good slot) A:no verdict");
        assert_ne!(splitmix(1), splitmix(2));
    }
}
