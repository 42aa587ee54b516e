//! The `fresh-machine` test stage, the cross-distribution and rootless proof: the README's
//! commands on a machine of another Debian release than the tools root's, as an ordinary user,
//! with only what the README says a fresh machine needs. A minimal Debian 13 (trixie) root is
//! bootstrapped (`debootstrap --variant=minbase`, plus the prerequisites of running `cargo` at
//! all: a C linker, git and CA certificates, and `uidmap` for the user's subordinate ids); the
//! user `kiln` (uid 1000, subordinate ids 100000–165535, no sudo, not in `disk`) is added, and
//! apt, dpkg and debootstrap are removed before it builds ([`REMOVED`]). The user's rustup holds
//! the pinned toolchain copied *without* its aarch64 std, so the build adds it as on a new
//! machine, and the image must not show it ([`user_rustup`]). Bind-mounted read-only: rustup's
//! proxies (`~/.cargo/bin`), another toolchain as the user's default, and the download cache
//! (`~/.cache/kiln/sha256`, content-addressed and re-verified on every use: sharing it saves
//! downloads, it is not what the stage proves). No registry, no target dir, no tools root, no apt
//! lists of the host. The commit is cloned to `/home/kiln/src/kiln`; the root becomes a private
//! mount namespace's own (`pivot_root`: a chrooted process may not make the user namespace the
//! build needs), and as `kiln`, `cargo xtask image` exactly as the README writes it (which makes
//! the bookworm tools root inside trixie through a user namespace and builds the kernel in it),
//! then `cargo xtask boot-test` (the tools root's QEMU and U-Boot). The image's sha256 must equal
//! the one root builds outside, in this checkout, and so must the bytes of the SBOMs beside it
//! (`kiln-qemu-virt.{spdx,cdx}.json`): the same bytes across users, distribution releases, host
//! compilers, paths, time zones (`TZ=CHAST-12:45CHADT`), umasks (077), times and the user's
//! default Rust toolchain (inside, rustup's default is another release than the pinned one when
//! the host has a second toolchain: `rust-toolchain.toml` must win).
//!
//! In the whole suite the root's half runs in the background from the start ([`Background`]);
//! `--stage fresh-machine` alone runs both halves in the foreground ([`stage`]).

use crate::doctor;
use crate::pins::Sha256;
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;
use xshell::cmd;

/// What a fresh machine has besides Debian's minimal base: what `cargo` itself needs before any
/// `cargo xtask` can run (a C linker for build scripts and the final link, git to clone, CA
/// certificates for crates.io over HTTPS), and `newuidmap`/`newgidmap` (`uidmap`), through which
/// an ordinary user's namespace gets its subordinate ids (`docs/rootless.md`). Nothing else: apt,
/// dpkg and debootstrap are removed before the user builds ([`REMOVED`]).
pub const FRESH_PACKAGES: &str = "ca-certificates,gcc,libc6-dev,git,uidmap";

/// The user the README's commands run as: not root, no sudo (the root has none), not in the
/// `disk` group; subordinate ids 100000–165535.
const USER: &str = "kiln";
const UID: u32 = 1000;

/// Removed from the root once it is made, so that nothing of the build can lean on them: every
/// Debian package kiln needs comes pinned, fetched and unpacked by kiln itself.
const REMOVED: &str = "/usr/bin/apt /usr/bin/apt-get /usr/bin/apt-cache /usr/bin/apt-config \
    /usr/bin/apt-mark /usr/bin/apt-key /usr/lib/apt /usr/bin/dpkg /usr/bin/dpkg-deb \
    /usr/bin/dpkg-query /usr/bin/dpkg-split /usr/bin/dpkg-divert /usr/bin/dpkg-trigger \
    /usr/bin/dpkg-statoverride /usr/bin/dpkg-realpath /usr/bin/dpkg-maintscript-helper \
    /usr/sbin/debootstrap /usr/share/debootstrap";

/// The commands run inside the root, as the README writes them.
const README_FIRST: &str = "cargo xtask image";
const THEN: &str = "cargo xtask boot-test";

/// The fresh machine's release: not the tools root's (bookworm), so that nothing of the host's
/// compilers or mkfs can shape the image unnoticed.
pub const SUITE: &str = "trixie";

fn root_dir() -> PathBuf {
    crate::paths::target_dir().join("kiln/fresh-machine")
}

/// Is anything mounted at or below `dir` (in this mount namespace)?
fn mounted_below(dir: &Path) -> Result<Vec<String>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let d = dir.to_string_lossy().to_string();
    Ok(info
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4).map(str::to_string))
        .filter(|m| *m == d || m.starts_with(&format!("{d}/")))
        .collect())
}

/// Remove a previous root, refusing if anything is still mounted inside it.
fn clean(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let m = mounted_below(dir)?;
    if !m.is_empty() {
        bail!(
            "{} still has mounts ({}): unmount them first",
            dir.display(),
            m.join(", ")
        );
    }
    let sh = xshell::Shell::new()?;
    cmd!(sh, "rm -rf --one-file-system {dir}")
        .run()
        .with_context(|| format!("removing {}", dir.display()))
}

/// The whole stage in the foreground: the root's build, then the comparison.
pub fn stage() -> Result<()> {
    inside()?;
    compare()
}

/// The root's half of the stage: bootstrap the root, clone HEAD into it and run the README's
/// commands inside. Leaves the root for [`compare`].
pub fn inside() -> Result<()> {
    // Reached as a user only through the internal `--fresh-machine-root` (the suite does not
    // run this stage as a user).
    doctor::need_root("the fresh-machine stage makes a Debian root and a user of its own in it")?;
    doctor::ensure(&[&doctor::DEBOOTSTRAP, &doctor::DEBIAN_KEYRING, &doctor::GIT])?;
    let t_all = Instant::now();
    let proot = crate::paths::project_root();
    let sh = xshell::Shell::new()?;
    sh.change_dir(&proot);
    let head = cmd!(sh, "git rev-parse HEAD").quiet().read()?;
    if !cmd!(sh, "git status --porcelain --untracked-files=no")
        .quiet()
        .read()?
        .is_empty()
    {
        bail!(
            "uncommitted changes: the root builds HEAD {} and the image outside would differ; \
             commit first",
            &head[..12]
        );
    }

    // The root.
    let base = root_dir();
    clean(&base)?;
    let root = base.join("root");
    std::fs::create_dir_all(&root)?;
    let t = Instant::now();
    let keyring = format!("--keyring={}", doctor::DEBIAN_KEYRING_PATH);
    let include = format!("--include={FRESH_PACKAGES}");
    println!(
        "fresh-machine: debootstrap --variant=minbase {include} {SUITE} {}",
        root.display()
    );
    cmd!(
        sh,
        "debootstrap --variant=minbase {include} {keyring} {SUITE} {root} http://deb.debian.org/debian"
    )
    .quiet()
    .run()
    .with_context(|| format!("debootstrap of the fresh {SUITE} root"))?;
    let release = std::fs::read_to_string(root.join("etc/debian_version")).unwrap_or_default();
    println!("fresh-machine: the root is Debian {}", release.trim());
    let t_boot = t.elapsed().as_secs_f64();
    println!("fresh-machine: root bootstrapped in {t_boot:.0} s");
    // The network configuration of the machine (DNS, and the local CA certificates a TLS proxy
    // on the way to crates.io may need); nothing else of the host's.
    std::fs::copy("/etc/resolv.conf", root.join("etc/resolv.conf"))
        .context("copying /etc/resolv.conf into the root")?;
    let local_ca = Path::new("/usr/local/share/ca-certificates");
    if local_ca.is_dir() {
        let r = root.display().to_string();
        cmd!(
            sh,
            "cp -a {local_ca}/. {r}/usr/local/share/ca-certificates/"
        )
        .run()?;
        cmd!(sh, "chroot {r} update-ca-certificates")
            .quiet()
            .run()?;
    }

    // The commit, cloned.
    let src = root.join("home/kiln/src/kiln");
    cmd!(sh, "git clone -q --no-hardlinks {proot} {src}").run()?;
    {
        let sh = xshell::Shell::new()?;
        sh.change_dir(&src);
        cmd!(sh, "git checkout -q --detach {head}").run()?;
    }
    // The user, with its subordinate ids; its home (the clone) is its own.
    {
        let r = root.display().to_string();
        let uid = UID.to_string();
        cmd!(
            sh,
            "chroot {r} useradd --no-create-home --home-dir /home/{USER} --shell /bin/sh --uid {uid} --user-group {USER}"
        )
        .quiet()
        .run()
        .context("adding the fresh machine's user")?;
        for f in ["etc/subuid", "etc/subgid"] {
            std::fs::write(root.join(f), format!("{USER}:100000:65536\n"))
                .with_context(|| format!("writing {f} in the root"))?;
        }
    }

    // The toolchain: the pinned one copied without its aarch64 std, as a new machine's rustup
    // has it (the build must `rustup target add` it, and the image must not say so); any other
    // toolchain read-only, as the user's default. Nothing else of the host's.
    let home = PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?);
    let rustup = home.join(".rustup");
    let cargo_bin = home.join(".cargo/bin");
    for p in [&rustup, &cargo_bin] {
        if !p.is_dir() {
            bail!(
                "{} is missing: the fresh-machine stage copies a rustup toolchain",
                p.display()
            );
        }
    }
    std::fs::create_dir_all(root.join("home/kiln/.cargo/bin"))?;
    let cache = crate::pins::Cache::user()?;
    std::fs::create_dir_all(&cache.dir)?;
    std::fs::create_dir_all(root.join("home/kiln/.cache/kiln/sha256"))?;
    let extra_binds = user_rustup(&sh, &rustup, &root.join("home/kiln/.rustup"))?;
    let r = root.display().to_string();
    let owner = format!("{UID}:{UID}");
    cmd!(sh, "chown -R {owner} {r}/home/{USER}").run()?;
    let show_default = if extra_binds.other_default {
        "echo \"fresh-machine: inside: default $(cd /home/kiln && rustc --version), in the \
         checkout $(rustc --version)\" && "
    } else {
        ""
    };
    let inside = format!(
        "umask 077 && cd /home/{USER}/src/kiln && echo \"fresh-machine: inside as $(id)\" && \
         test \"$(id -u)\" != 0 && {show_default}\
         echo \"fresh-machine: inside: $ {README_FIRST}\" && \
         {README_FIRST} && echo \"fresh-machine: inside: $ {THEN}\" && {THEN}"
    );
    // A private mount namespace: every mount goes away with the last process in it. The root
    // becomes the namespace's own (`pivot_root`), not a chroot: a process in a chroot may not
    // make a user namespace, and the user's build makes one.
    std::fs::create_dir_all(root.join(".old-root"))?;
    let script = format!(
        "set -e\n\
         mount --make-rprivate /\n\
         mount --bind '{r}' '{r}'\n\
         mount -t proc proc '{r}/proc'\n\
         mount -t sysfs sys '{r}/sys'\n\
         mount --rbind /dev '{r}/dev'\n\
         mount --bind '{cb}' '{r}/home/{USER}/.cargo/bin'\n\
         mount -o remount,bind,ro '{r}/home/{USER}/.cargo/bin'\n\
         mount --bind '{kc}' '{r}/home/{USER}/.cache/kiln/sha256'\n\
         mount -o remount,bind,ro '{r}/home/{USER}/.cache/kiln/sha256'\n\
         {binds}\
         cd '{r}'\n\
         pivot_root . .old-root\n\
         umount -l /.old-root\n\
         rmdir /.old-root\n\
         cd /\n\
         rm -rf {REMOVED}\n\
         for p in apt apt-get dpkg dpkg-deb debootstrap; do if command -v $p; then echo \"fresh-machine: $p is still here\"; exit 1; fi; done\n\
         echo 'fresh-machine: apt, dpkg and debootstrap removed from the root'\n\
         exec setpriv --reuid={UID} --regid={UID} --clear-groups /usr/bin/env -i HOME=/home/{USER} \
           USER={USER} PATH=/home/{USER}/.cargo/bin:/usr/local/bin:/usr/bin:/bin \
           TZ=CHAST-12:45CHADT LANG=C.UTF-8 TERM=dumb /bin/sh -c '{inside}'\n",
        cb = cargo_bin.display(),
        binds = extra_binds.binds,
        kc = cache.dir.display(),
    );
    let t = Instant::now();
    let run = cmd!(sh, "unshare --mount --fork sh -c {script}").run();
    let t_inside = t.elapsed().as_secs_f64();
    run.with_context(|| {
        format!("inside the fresh root: `{README_FIRST}` then `{THEN}` ({t_inside:.0} s)")
    })?;
    let left = mounted_below(&root)?;
    if !left.is_empty() {
        bail!("mounts left in the root after the run: {}", left.join(", "));
    }
    println!(
        "fresh-machine: bootstrap {t_boot:.0} s, `{README_FIRST}` + `{THEN}` inside {t_inside:.0} s, \
         root's half {:.0} s",
        t_all.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The comparison's half: the image built in this checkout must be the root's, byte for byte,
/// and so must the SBOMs beside it. Removes the root when they are.
pub fn compare() -> Result<()> {
    let base = root_dir();
    let src = base.join("root/home/kiln/src/kiln");
    // The image outside the root, in this checkout (reused when it is up to date; built after
    // the root's so that a failure inside shows first).
    let t = Instant::now();
    let outside = crate::image::build(&crate::image::Args {
        board: "qemu-virt".into(),
        models: Vec::new(),
        offline: false,
        dev_keys: false,
    })
    .context("building the image outside the root")?;
    println!(
        "fresh-machine: outside the root: sha256 {} ({:.0} s)",
        outside.sha256,
        t.elapsed().as_secs_f64()
    );

    let sha_file = src.join("target/images/kiln-qemu-virt.img.sha256");
    let text = std::fs::read_to_string(&sha_file)
        .with_context(|| format!("reading {}", sha_file.display()))?;
    let inside_sha: Sha256 = text.split_whitespace().next().unwrap_or("").parse()?;
    if inside_sha != outside.sha256 {
        let a = crate::image::checks::read_json(&outside.manifest)?;
        let b = crate::image::checks::read_json(&src.join("target/images/manifest.json"))?;
        let mut diffs = Vec::new();
        crate::image::checks::json_diff(&a, &b, "", &mut diffs, 40);
        bail!(
            "the image built on the fresh machine differs: {} outside vs {inside_sha} inside; \
             differing manifest entries (outside vs inside):\n  {}\n(root kept in {} for \
             inspection)",
            outside.sha256,
            diffs.join("\n  "),
            base.display()
        );
    }
    println!("fresh-machine: the fresh machine built the same image: {inside_sha}");
    // Two builds from two clones: the same SBOM bytes beside the image.
    for ext in ["spdx.json", "cdx.json"] {
        let name = format!("kiln-qemu-virt.{ext}");
        let inside = src.join("target/images").join(&name);
        let outside_f = crate::paths::target_dir().join("images").join(&name);
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let (a, b) = (read(&outside_f)?, read(&inside)?);
        if a != b {
            let mut diffs = Vec::new();
            crate::image::checks::json_diff(
                &crate::image::checks::read_json(&outside_f)?,
                &crate::image::checks::read_json(&inside)?,
                "",
                &mut diffs,
                40,
            );
            bail!(
                "the same image, but the SBOM {name} built on the fresh machine differs from the \
                 one built outside ({} vs {}); differing entries (outside vs inside):\n  {}\n\
                 (root kept in {} for inspection)",
                outside_f.display(),
                inside.display(),
                diffs.join("\n  "),
                base.display()
            );
        }
        println!(
            "fresh-machine: {name}: the same {} bytes from both builds",
            a.len()
        );
    }
    clean(&base)?;
    Ok(())
}

/// What [`user_rustup`] leaves to mount inside, and whether the user's default toolchain is
/// another release than the pinned one.
struct UserRustup {
    binds: String,
    other_default: bool,
}

/// The user's `~/.rustup` at `to`: the pinned toolchain (rust-toolchain.toml) copied from the
/// host's `rustup` and its aarch64 std removed by rustup itself (checked gone), so the build
/// inside starts as on a new machine; another toolchain of the host's, if any, bound read-only
/// (the lines returned) and made the user's default, so `rust-toolchain.toml` must win.
fn user_rustup(sh: &xshell::Shell, rustup: &Path, to: &Path) -> Result<UserRustup> {
    let pinned = doctor::pinned_rust()?;
    let host = doctor::host_triple()?;
    let name = format!("{pinned}-{host}");
    let from = rustup.join("toolchains").join(&name);
    let from = std::fs::canonicalize(&from).with_context(|| {
        format!(
            "the pinned toolchain {} (run `rustup toolchain install {pinned}`)",
            from.display()
        )
    })?;
    let into = to.join("toolchains").join(&name);
    std::fs::create_dir_all(&into)?;
    cmd!(sh, "cp -a {from}/. {into}/")
        .run()
        .context("copying the pinned toolchain")?;
    rustup_settings(to, &name)?;
    let target = doctor::AARCH64;
    cmd!(sh, "rustup target remove --toolchain {name} {target}")
        .env("RUSTUP_HOME", to)
        .run()
        .context("removing the aarch64 std from the fresh machine's toolchain")?;
    let std_dir = into.join("lib/rustlib").join(target);
    ensure!(
        !std_dir.exists(),
        "{} is still there after `rustup target remove`",
        std_dir.display()
    );
    println!("fresh-machine: the user's {name} has no aarch64 std: the build must add it");
    let mut out = UserRustup {
        binds: String::new(),
        other_default: false,
    };
    if let Some((other, version)) = other_toolchain(rustup)? {
        let src = std::fs::canonicalize(rustup.join("toolchains").join(&other))?;
        let at = to.join("toolchains").join(&other);
        std::fs::create_dir_all(&at)?;
        out.binds = format!(
            "mount --bind '{s}' '{a}'\nmount -o remount,bind,ro '{a}'\n",
            s = src.display(),
            a = at.display()
        );
        rustup_settings(to, &other)?;
        println!("fresh-machine: the user's default toolchain inside is {other} ({version})");
        out.other_default = true;
    } else {
        println!(
            "fresh-machine: no second Rust toolchain in {}: the default toolchain inside is the \
             pinned one (install another, e.g. `rustup toolchain install nightly --profile \
             minimal`, to vary it too)",
            rustup.display()
        );
    }
    Ok(out)
}

/// rustup's `settings.toml` in `home` with `default` as the default toolchain.
fn rustup_settings(home: &Path, default: &str) -> Result<()> {
    let p = home.join("settings.toml");
    std::fs::write(
        &p,
        format!(
            "version = \"12\"\ndefault_toolchain = \"{default}\"\nprofile = \"minimal\"\n\
             auto_self_update = \"disable\"\n\n[overrides]\n"
        ),
    )
    .with_context(|| format!("writing {}", p.display()))
}

/// A toolchain of `rustup`'s other than the pinned release (`rust-toolchain.toml`): its name and
/// `rustc --version`.
fn other_toolchain(rustup: &Path) -> Result<Option<(String, String)>> {
    let pinned = doctor::pinned_rust()?;
    let mut names: Vec<String> = std::fs::read_dir(rustup.join("toolchains"))
        .with_context(|| format!("reading {}", rustup.join("toolchains").display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        let rustc = rustup.join("toolchains").join(&name).join("bin/rustc");
        let Ok(out) = std::process::Command::new(&rustc).arg("--version").output() else {
            continue;
        };
        let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !version.starts_with(&format!("rustc {pinned} ")) {
            return Ok(Some((name, version)));
        }
    }
    Ok(None)
}

/// The root's half ([`inside`]) run by a child `xtask test --fresh-machine-root` while the
/// suite's other stages run: it is nearly all compiling (cargo, the kernel) and waiting on the
/// network, and the boot stages leave most of a core idle, so the child runs at nice 19 and
/// idle I/O priority, taking only what the foreground leaves. Its output goes to
/// `target/kiln/fresh-machine.log`, shown when the suite reaches the stage, which then waits
/// for it and does the comparison ([`compare`]) in the foreground, where nothing else builds an
/// image. Dropped before that (a failure, Ctrl-C), it kills the child's process group.
pub struct Background {
    child: Option<std::process::Child>,
    log: PathBuf,
    started: Instant,
}

impl Background {
    pub fn start() -> Result<Background> {
        use std::os::unix::process::CommandExt;
        let log = crate::paths::target_dir().join("kiln/fresh-machine.log");
        if let Some(d) = log.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let exe = std::env::current_exe().context("the path of this xtask binary")?;
        let mut c = std::process::Command::new(&exe);
        c.args(["test", "--fresh-machine-root"])
            .current_dir(crate::paths::project_root())
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err);
        // SAFETY: only async-signal-safe calls (setpgid, setpriority, ioprio_set, prctl) between
        // fork and exec.
        unsafe {
            c.pre_exec(|| {
                // Its own process group, so that everything it starts can be killed at once.
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::setpriority(libc::PRIO_PROCESS, 0, 19) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // IOPRIO_WHO_PROCESS, this process, IOPRIO_CLASS_IDLE: best effort (not every
                // I/O scheduler honours it).
                libc::syscall(libc::SYS_ioprio_set, 1, 0, 3 << 13);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = c
            .spawn()
            .with_context(|| format!("starting {} test --fresh-machine-root", exe.display()))?;
        // Ctrl-C (or a TERM) reaches the foreground's process group only: the background group
        // is killed by hand before this process goes the way the signal says.
        BACKGROUND_GROUP.store(child.id() as i32, std::sync::atomic::Ordering::SeqCst);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: the handler only calls async-signal-safe functions.
            unsafe {
                libc::signal(sig, on_signal as *const () as libc::sighandler_t);
            }
        }
        println!(
            "fresh-machine: the root's half started in the background (pid {}, nice 19, idle I/O), \
             output in {}",
            child.id(),
            log.display()
        );
        Ok(Background {
            child: Some(child),
            log,
            started: Instant::now(),
        })
    }

    /// Follow the child's output until it ends, then compare.
    pub fn finish(mut self) -> Result<()> {
        use std::io::{Read, Write};
        println!(
            "fresh-machine: the root's half has run for {:.0} s in the background; its output \
             ({}):",
            self.started.elapsed().as_secs_f64(),
            self.log.display()
        );
        let t = Instant::now();
        let mut f = std::fs::File::open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut buf = Vec::new();
        let mut stdout = std::io::stdout();
        // The child stays in `self` until it has ended: an error here drops `self`, whose Drop
        // kills the group rather than leaving it running.
        let status = loop {
            let done = self
                .child
                .as_mut()
                .context("the background child was already taken")?
                .try_wait()?;
            buf.clear();
            f.read_to_end(&mut buf)?;
            stdout.write_all(&buf)?;
            stdout.flush()?;
            if let Some(s) = done {
                self.child = None;
                break s;
            }
            std::thread::sleep(std::time::Duration::from_secs(1));
        };
        restore_signals();
        println!(
            "fresh-machine: the root's half ended after {:.0} s in all, {:.0} s of it waited for \
             here: {status}",
            self.started.elapsed().as_secs_f64(),
            t.elapsed().as_secs_f64()
        );
        if !status.success() {
            bail!(
                "the root's half failed ({status}): its output is above and in {}",
                self.log.display()
            );
        }
        compare()
    }
}

/// The background child's process group, for [`on_signal`]; 0 when there is none.
static BACKGROUND_GROUP: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Kill the background group, then take the signal's default action (end this process).
extern "C" fn on_signal(sig: libc::c_int) {
    let g = BACKGROUND_GROUP.load(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: kill, signal and raise are async-signal-safe.
    unsafe {
        if g > 0 {
            libc::kill(-g, libc::SIGKILL);
        }
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// The signals' default actions back, once no background group is left.
fn restore_signals() {
    BACKGROUND_GROUP.store(0, std::sync::atomic::Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: restoring the default disposition.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        restore_signals();
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill has no memory preconditions; the group is the child's own.
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.wait();
            println!(
                "fresh-machine: the background root's half was stopped (its output: {})",
                self.log.display()
            );
        }
    }
}
