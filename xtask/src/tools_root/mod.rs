//! The tools root: a Debian bookworm amd64 root made from pinned packages only, in which every
//! external program that writes a byte of the image runs (the kernel build's cross gcc,
//! binutils, make, flex, bison, bc, perl; `mkfs.erofs`; `mke2fs`). The host's own versions of
//! them no longer matter.
//!
//! - The pin list `images/tools-root.toml` is the full closure (name, version, sha256, snapshot)
//!   of a minimal root plus [`TOOLS`], written by `cargo xtask pins update-tools-root` from kiln's
//!   private apt lists and changed only deliberately.
//! - Building ([`make`]): every pin resolved like any input (cache → live archive → snapshot,
//!   sha256 verified), unpacked by kiln, then installed by the root's own dpkg inside it: no
//!   debootstrap, apt or dpkg of the host's, and nothing unpinned can enter. Keyed by [`key`] (the hash
//!   of the pin list's packages), and checked at every use against the pins: the root's dpkg
//!   status must list exactly the pinned packages at their pinned versions. Kept in the user's
//!   cache (`~/.cache/kiln/tools-root/<key>/`), so every checkout shares it.
//! - Running ([`enter`]): as root, `unshare --mount`; as an ordinary user, a user namespace with
//!   its subordinate ids (`docs/rootless.md`); then bind mounts of the checkout and `target/` at
//!   the same paths + `chroot`, with an empty environment plus what the caller passes. A user
//!   whose host cannot map it is refused by name, with what to enable.

pub mod enter;
pub mod machine;
pub mod make;

use crate::apt::Apt;
use crate::pins::{self, Cache, Input, Sha256, Snapshot, Source};
use anyhow::{bail, ensure, Context, Result};
use enter::{quote, Entry};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The pin list, relative to the checkout.
pub const PINS: &str = "images/tools-root.toml";

/// The suite the root is made from (the private apt's `bookworm` lists).
pub const SUITE: &str = "bookworm";
pub const ARCH: &str = "amd64";

/// The packages the root exists for (their dependencies and a minimal root come along): every
/// external tool whose version shapes the image bytes.
pub const TOOLS: &[&str] = &[
    // The merged-/usr layout `make` lays out asks for it (else apt's closure picks `usrmerge`).
    "usr-is-merged",
    "gcc-aarch64-linux-gnu",
    // The aarch64 glibc headers, crt objects and libc.so the link of `kiln` needs; the kernel's
    // Kconfig also probes them (CONFIG_CC_CAN_LINK), so without them the .config differs.
    "libc6-dev-arm64-cross",
    "binutils-aarch64-linux-gnu",
    "make",
    "gcc",
    "libc6-dev",
    "flex",
    "bison",
    "bc",
    "perl",
    "libelf-dev",
    "libssl-dev",
    "erofs-utils",
    "e2fsprogs",
    // U-Boot (crate::bootloader): binman is Python and reads BL31's ELF segments (pyelftools);
    // its libfdt binding is built from U-Boot's own tree with swig against Python's headers;
    // the host tools link OpenSSL (mkimage), GnuTLS and libuuid (mkeficapsule), found by
    // pkg-config.
    "python3",
    "python3-dev",
    "python3-setuptools",
    "python3-pyelftools",
    "swig",
    "libgnutls28-dev",
    "uuid-dev",
    "pkgconf",
    // Debian's U-Boot source comes as a .tar.bz2, unpacked inside the root.
    "bzip2",
    // `cargo xtask bundle`: RAUC signs the boot slot's image into a verity bundle, whose payload
    // is a squashfs made by mksquashfs.
    "rauc",
    "squashfs-tools",
    // The qemu-virt board's machine and firmware (`cargo xtask qemu`, `boot-test`, the boot
    // stages): run from the root ([`ToolsRoot::qemu_virt`]), so every host boots with the same
    // QEMU and U-Boot, whatever its distribution ships.
    "qemu-system-arm",
    "u-boot-qemu",
];

/// The programs whose versions the manifest records, with the package that provides each.
pub const RECORDED: &[(&str, &str)] = &[
    ("aarch64-linux-gnu-gcc", "gcc-12-aarch64-linux-gnu"),
    ("aarch64-linux-gnu-ld", "binutils-aarch64-linux-gnu"),
    ("aarch64 glibc (crt, libc.so)", "libc6-dev-arm64-cross"),
    ("gcc", "gcc-12"),
    ("make", "make"),
    ("flex", "flex"),
    ("bison", "bison"),
    ("bc", "bc"),
    ("perl", "perl"),
    ("libelf", "libelf-dev"),
    ("openssl", "libssl-dev"),
    ("mkfs.erofs", "erofs-utils"),
    ("mke2fs", "e2fsprogs"),
    ("python3 (U-Boot's binman)", "python3"),
    ("pyelftools (binman)", "python3-pyelftools"),
    ("swig (U-Boot's pylibfdt)", "swig"),
    ("rauc", "rauc"),
    ("mksquashfs", "squashfs-tools"),
    ("qemu-system-aarch64 (the boot stages)", "qemu-system-arm"),
    ("U-Boot qemu_arm64 (the boot stages)", "u-boot-qemu"),
];

fn pins_path() -> PathBuf {
    crate::paths::project_root().join(PINS)
}

/// A made tools root.
#[derive(Clone)]
pub struct ToolsRoot {
    pub dir: PathBuf,
    pub key: Sha256,
    /// Pinned package → version.
    pub packages: BTreeMap<String, String>,
    /// The pins themselves (package, version, arch, the .deb's sha256), in pin-list order.
    pub pins: Vec<Input>,
    /// How this process enters it (root, or a user through a user namespace).
    pub entry: Entry,
}

/// QEMU and U-Boot of the qemu-virt board, from the tools root ([`ToolsRoot::qemu_virt`]).
#[derive(Clone, Debug)]
pub struct QemuVirt {
    /// Runs the root's `qemu-system-aarch64` (a script: give it to anything that wants a path).
    pub qemu: PathBuf,
    /// The root's `u-boot.bin` (Debian's `qemu_arm64` build).
    pub uboot: PathBuf,
    pub qemu_version: String,
    pub uboot_version: String,
}

/// The qemu-virt board's QEMU and U-Boot of the committed pin list (the root made first if it
/// is not yet), found once per process.
pub fn qemu_virt() -> Result<QemuVirt> {
    static FOUND: std::sync::Mutex<Option<QemuVirt>> = std::sync::Mutex::new(None);
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(q) = found.as_ref() {
        return Ok(q.clone());
    }
    let q = ensure(false)?.qemu_virt()?;
    println!(
        "qemu-virt: QEMU {} and U-Boot {} of the tools root ({})",
        q.qemu_version,
        q.uboot_version,
        q.qemu.display()
    );
    *found = Some(q.clone());
    Ok(q)
}

/// The key of a pin list: its packages, versions and hashes (comments and order do not count).
pub fn key_of(inputs: &[Input]) -> Sha256 {
    let mut lines: Vec<String> = inputs
        .iter()
        .map(|i| {
            let sha = i.sha256.map(|h| h.to_string()).unwrap_or_default();
            format!("{} {} {}\n", i.name, i.version, sha)
        })
        .collect();
    lines.sort();
    let text = format!("kiln-tools-root-v1 {SUITE} {ARCH}\n{}", lines.concat());
    Sha256::of_bytes(text.as_bytes())
}

/// The pinned inputs of the tools root.
pub fn inputs() -> Result<Vec<Input>> {
    let inputs = pins::read_inputs(&pins_path())?;
    ensure!(
        !inputs.is_empty(),
        "{} pins no package: run `cargo xtask pins update-tools-root`",
        PINS
    );
    for i in &inputs {
        ensure!(
            matches!(i.source, Source::Deb { .. }),
            "{}: {} is not a deb pin",
            PINS,
            i.name
        );
    }
    Ok(inputs)
}

/// Where made roots are kept: the user's cache (`~/.cache/kiln/tools-root/<key>`), shared by
/// every checkout, since the key is the pin list's packages and a root is checked against them at
/// every use. (It was `target/kiln/tools-root/`, made again by every new clone: about 3.5 minutes.)
fn root_dir() -> Result<PathBuf> {
    Ok(crate::paths::user_cache()?.join("tools-root"))
}

/// Per-checkout files of the root: the linker wrappers, which bind this checkout's paths.
fn checkout_dir() -> PathBuf {
    crate::paths::target_dir().join("kiln/tools-root")
}

/// The tools root of the committed pin list: reused when made and still matching its pins,
/// else made now (every pin resolved and verified first; `offline`: from the cache alone).
pub fn ensure(offline: bool) -> Result<ToolsRoot> {
    let entry = Entry::this()?;
    let inputs = inputs()?;
    let key = key_of(&inputs);
    let packages: BTreeMap<String, String> = inputs
        .iter()
        .map(|i| (i.name.clone(), i.version.clone()))
        .collect();
    let dir = root_dir()?.join(key.short());
    let root = ToolsRoot {
        dir,
        key,
        packages,
        pins: inputs.clone(),
        entry,
    };
    if root.dir.join(".kiln-tools-root").exists() {
        root.verify()?;
        return Ok(root);
    }
    let _lock = crate::paths::lock_exclusive(&root_dir()?.join(format!(".{}.lock", key.short())))?;
    // Another build may have made it while this one waited for the lock.
    if root.dir.join(".kiln-tools-root").exists() {
        root.verify()?;
        return Ok(root);
    }
    make::make(&root, &inputs, offline)?;
    root.verify()?;
    Ok(root)
}

/// `Package: … / Version: … / Status: …` of a dpkg status file.
fn dpkg_status(text: &str) -> Vec<(String, String, String)> {
    text.split("\n\n")
        .filter_map(|st| {
            let field = |k: &str| {
                st.lines()
                    .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()))
            };
            Some((field("Package:")?, field("Version:")?, field("Status:")?))
        })
        .collect()
}

impl ToolsRoot {
    /// The root's dpkg status must list exactly the pinned packages at their pinned versions,
    /// each installed: anything else (a tampered or half-made root) is an error naming it.
    pub fn verify(&self) -> Result<()> {
        let status_path = self.dir.join("var/lib/dpkg/status");
        let text = std::fs::read_to_string(&status_path)
            .with_context(|| format!("tools root: reading {}", status_path.display()))?;
        let mut wrong = Vec::new();
        let mut seen = BTreeMap::new();
        for (name, version, status) in dpkg_status(&text) {
            match self.packages.get(&name) {
                None => wrong.push(format!("{name} {version} is not pinned")),
                Some(v) if *v != version => wrong.push(format!("{name} is {version}, pinned {v}")),
                Some(_) if status != "install ok installed" => {
                    wrong.push(format!("{name} is `{status}`"))
                }
                Some(_) => {}
            }
            seen.insert(name, ());
        }
        for name in self.packages.keys() {
            if !seen.contains_key(name) {
                wrong.push(format!("{name} is pinned but not installed"));
            }
        }
        if !wrong.is_empty() {
            bail!(
                "tools root {} does not match {PINS}: {}; remove it (`{}`) and it is made again",
                self.dir.display(),
                wrong.join("; "),
                self.entry.removal(&self.dir)
            );
        }
        Ok(())
    }

    /// A command run inside the root ([`enter`]): its namespaces, the checkout and `target/`
    /// bound at their own paths, the device nodes and `/proc`, then `chroot` with only `env` set
    /// (plus `PATH`), in `cwd`.
    pub fn command(
        &self,
        cwd: &Path,
        env: &[(&str, String)],
        argv: &[String],
    ) -> std::process::Command {
        let binds = [crate::paths::project_root(), crate::paths::target_dir()];
        enter::chroot_command(&self.entry, &self.dir, &binds, cwd, env, argv)
    }

    /// Run a command inside the root; its output must be success. Stdout is returned.
    pub fn read(&self, cwd: &Path, env: &[(&str, String)], argv: &[&str]) -> Result<String> {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let out = self
            .command(cwd, env, &argv)
            .output()
            .with_context(|| format!("running {} in the tools root", argv.join(" ")))?;
        if !out.status.success() {
            bail!(
                "`{}` in the tools root {} failed ({}): {}",
                argv.join(" "),
                self.dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A linker for cargo (`CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER`) that runs the root's
    /// `aarch64-linux-gnu-gcc`: the checkout, `target/`, the Rust sysroot (std's rlibs), cargo's
    /// home and `/tmp` (rustc's link temporaries) bound at their own paths, the caller's folder
    /// kept. Written as `target/kiln/tools-root/<key>-aarch64-linux-gnu-gcc`.
    pub fn linker(&self, rust_sysroot: &Path, cargo_home: &Path) -> Result<PathBuf> {
        self.tool(rust_sysroot, cargo_home, "aarch64-linux-gnu-gcc")
    }

    /// [`ToolsRoot::linker`] for any of the root's tools (`aarch64-linux-gnu-ar` for the C of
    /// crates such as ring, which the image's `kiln` links: its objects are image bytes too).
    pub fn tool(&self, rust_sysroot: &Path, cargo_home: &Path, tool: &str) -> Result<PathBuf> {
        let binds = [
            crate::paths::project_root(),
            crate::paths::target_dir(),
            rust_sysroot.to_path_buf(),
            cargo_home.to_path_buf(),
            PathBuf::from("/tmp"),
        ];
        let r = quote(&self.dir.display().to_string());
        let mut inner = enter::mounts(&self.dir, &binds);
        inner.push_str(&format!(
            "d=\"$1\"; shift\nexec chroot {r} /usr/bin/env -i -C \"$d\" \
             PATH=/usr/bin:/bin LC_ALL=C TZ=UTC {tool} \"$@\"\n"
        ));
        let base = checkout_dir();
        let inner_path = base.join(format!("{}-{tool}.sh", self.key.short()));
        // Named `…-gcc`: rustc infers the linker flavor from the name.
        let outer_path = base.join(format!("{}-{tool}", self.key.short()));
        crate::atomic::write_atomic(&inner_path, inner.as_bytes())?;
        let unshare: Vec<String> = self.entry.unshare().iter().map(|a| quote(a)).collect();
        let outer = format!(
            "#!/bin/sh\n# {tool} of the kiln tools root {}, entered as {}\nexec {} -- sh {} \"$PWD\" \"$@\"\n",
            self.key,
            self.entry.describe(),
            unshare.join(" "),
            quote(&inner_path.display().to_string())
        );
        crate::atomic::write_atomic(&outer_path, outer.as_bytes())?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&outer_path, std::fs::Permissions::from_mode(0o755))?;
        Ok(outer_path)
    }

    /// The qemu-virt board's QEMU and U-Boot, pinned in the root (`qemu-system-arm`,
    /// `u-boot-qemu`) and run from it without entering it: `qemu-system-aarch64` is a script
    /// (`target/kiln/tools-root/<key>-qemu-system-aarch64`) that starts the root's binary with the
    /// root's own dynamic loader and libraries and its data files (`-L`), so it needs no
    /// namespace, sees every host path the caller names (disks, sockets, pflash) and runs the
    /// same on every host; U-Boot is the root's `u-boot.bin`, read where it lies.
    pub fn qemu_virt(&self) -> Result<QemuVirt> {
        let r = &self.dir;
        // The loader itself, not `usr/lib64/ld-linux-x86-64.so.2`: that is a link to an absolute
        // path, which would be the host's loader (on Debian 13, glibc 2.41's, with the root's
        // 2.36 libc: "stack smashing detected" before main).
        let loader = r.join("usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2");
        let bin = r.join("usr/bin/qemu-system-aarch64");
        let uboot = r.join("usr/lib/u-boot/qemu_arm64/u-boot.bin");
        for p in [&loader, &bin, &uboot] {
            ensure!(
                p.exists(),
                "the tools root {} has no {}: is {PINS} without qemu-system-arm and u-boot-qemu?",
                r.display(),
                p.display()
            );
        }
        ensure!(
            std::fs::symlink_metadata(&loader).is_ok_and(|m| m.file_type().is_file()),
            "{} is not a file of the root (a link would be resolved on the host)",
            loader.display()
        );
        let libs = r.join("usr/lib/x86_64-linux-gnu");
        let script = format!(
            "#!/bin/sh\n# qemu-system-aarch64 {} of the kiln tools root {}, run by the root's own \
             loader and libraries\nexec {} --library-path {} --argv0 qemu-system-aarch64 {} -L {} \"$@\"\n",
            self.packages.get("qemu-system-arm").map(String::as_str).unwrap_or("?"),
            self.key,
            quote(&loader.display().to_string()),
            quote(&libs.display().to_string()),
            quote(&bin.display().to_string()),
            quote(&r.join("usr/share/qemu").display().to_string()),
        );
        let path = checkout_dir().join(format!("{}-qemu-system-aarch64", self.key.short()));
        if std::fs::read_to_string(&path).ok().as_deref() != Some(script.as_str()) {
            crate::atomic::write_atomic(&path, script.as_bytes())?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(QemuVirt {
            qemu: path,
            uboot,
            qemu_version: self
                .packages
                .get("qemu-system-arm")
                .cloned()
                .unwrap_or_default(),
            uboot_version: self
                .packages
                .get("u-boot-qemu")
                .cloned()
                .unwrap_or_default(),
        })
    }

    /// Link every later aarch64 build of this process with the root's cross gcc
    /// ([`ToolsRoot::linker`]), as the image links `kiln`: a test that runs the image's binary
    /// then builds exactly it, and the image build reuses that build.
    pub fn link_cross_builds(&self) -> Result<()> {
        let sysroot = crate::doctor::rust_sysroot()?;
        let home = crate::doctor::cargo_home();
        crate::doctor::link_with(
            self.linker(&sysroot, &home)?,
            self.tool(&sysroot, &home, "aarch64-linux-gnu-ar")?,
        );
        Ok(())
    }

    /// For the manifest: the pin list's key, every recorded tool's package version, and every
    /// pinned package (`debs`: package, version, arch, the .deb's sha256; the SBOMs' build tools).
    pub fn describe(&self) -> serde_json::Value {
        let tools: BTreeMap<&str, serde_json::Value> = RECORDED
            .iter()
            .map(|(tool, pkg)| {
                (
                    *tool,
                    serde_json::json!({"package": pkg, "version": self.packages.get(*pkg)}),
                )
            })
            .collect();
        serde_json::json!({
            "pins": PINS,
            "key": self.key,
            "suite": SUITE,
            "arch": ARCH,
            "packages": self.packages.len(),
            "tools": tools,
            "debs": self.pins.iter().map(|i| {
                let (package, arch) = match &i.source {
                    Source::Deb { package, arch } => (package.as_str(), arch.as_str()),
                    Source::Supplied { .. } | Source::Url { .. } => (i.name.as_str(), ARCH),
                };
                serde_json::json!({
                    "name": package, "version": i.version, "arch": arch, "distro": i.distro,
                    "sha256": i.sha256.map(|h| h.to_string()),
                })
            }).collect::<Vec<_>>(),
        })
    }
}

/// The control file of `deb`, which must be the package `name` at `version`: a pin whose sha256
/// names another package's file is refused here (the cache is content-addressed, so it would
/// otherwise serve that other package under this pin's name).
fn check_control(deb: &Path, name: &str, version: &str) -> Result<String> {
    let control = crate::archive::deb_control(deb)?;
    let field = |f: &str| {
        control
            .lines()
            .find_map(|l| l.strip_prefix(f)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    let (p, v) = (field("Package"), field("Version"));
    ensure!(
        p == name && v == version,
        "{} is {p} {v}, not the pinned {name} {version}",
        deb.display()
    );
    Ok(control)
}

/// `cargo xtask pins update-tools-root`: the closure of a minimal root plus [`TOOLS`] as the
/// private lists serve it now, every package downloaded into the cache and pinned with its
/// sha256 and snapshot; the pin list rewritten whole. A deliberate change, like `pins update`.
pub fn update() -> Result<()> {
    let apt = Apt::kiln();
    let file = pins_path();
    apt.ensure_lists(&[&file])?;
    let mut seed = apt.required_packages(ARCH)?;
    seed.extend(TOOLS.iter().map(|s| s.to_string()));
    let specs: Vec<String> = seed.iter().map(|s| format!("{s}:{ARCH}")).collect();
    let mut closure = apt.simulate_install(&specs)?;
    closure.sort();
    closure.dedup();
    println!(
        "tools root: {} packages in the closure of {} required/essential + {} tools",
        closure.len(),
        seed.len() - TOOLS.len(),
        TOOLS.len()
    );
    let specs: Vec<String> = closure
        .iter()
        .map(|(n, v, _)| format!("{n}:{ARCH}={v}"))
        .collect();
    // apt prints the URIs in its own order, not the closure's: match them by the package name
    // that starts the file name (`name_version_arch.deb`).
    let mut where_: BTreeMap<String, (String, String, String)> = BTreeMap::new();
    for (archive, pool, file) in apt.pool_paths(&specs)? {
        let name = file
            .split('_')
            .next()
            .filter(|n| !n.is_empty())
            .with_context(|| format!("apt printed a file name without a package: {file}"))?
            .to_string();
        where_.insert(name, (archive, pool, file));
    }
    ensure!(
        where_.len() == specs.len(),
        "apt printed {} URIs for {} packages",
        where_.len(),
        specs.len()
    );
    let dl = tempfile::tempdir()?;
    apt.download_all(&specs, dl.path())?;
    let cache = Cache::user()?;
    let mut stamps = BTreeMap::new();
    let mut out = String::from(
        "# The tools root: a Debian bookworm amd64 root made from exactly these packages (the\n\
         # closure of a minimal root and the tools whose versions shape the image bytes), in which\n\
         # the kernel build and mkfs.* run. Written by `cargo xtask pins update-tools-root`; edit\n\
         # deliberately. Its key (the hash of these pins) keys the root and every step it runs.\n",
    );
    for (name, version, _) in &closure {
        let (archive, pool, file) = where_
            .get(name)
            .with_context(|| format!("apt printed no URI for {name} {version}"))?;
        let got = dl.path().join(file);
        check_control(&got, name, version)?;
        let (sha, _) = cache
            .put(name, &got, None)
            .with_context(|| format!("{name} {version}: downloaded {}", got.display()))?;
        if !stamps.contains_key(archive) {
            stamps.insert(archive.clone(), apt.release_timestamp(archive)?);
        }
        let snap = Snapshot {
            timestamp: stamps[archive].clone(),
            archive: archive.clone(),
            pool: pool.clone(),
        };
        out.push_str(&format!(
            "\n[[input]]\nname = {name:?}\nversion = {version:?}\nkind = \"deb\"\npackage = {name:?}\n\
             arch = {ARCH:?}\nsha256 = \"{sha}\"\nsnapshot = {:?}\nsnapshot_path = \"{}/{}\"\n",
            snap.timestamp, snap.archive, snap.pool
        ));
    }
    crate::atomic::write_atomic(&file, out.as_bytes())?;
    let inputs = pins::read_inputs(&file)?;
    println!(
        "tools root: wrote {} ({} packages, key {})",
        file.display(),
        inputs.len(),
        key_of(&inputs).short()
    );
    Ok(())
}

/// Run make (the kernel's, U-Boot's: `what` names it), printing a progress line (objects compiled, elapsed) every 20 s instead of
/// thousands of lines; the last lines are shown if it fails.
pub fn run_with_progress(mut c: std::process::Command, what: &str) -> Result<()> {
    use std::io::{BufRead as _, Read as _};
    use std::process::Stdio;
    let t = Instant::now();
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting make")?;
    let stderr = child.stderr.take().context("make stderr")?;
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::BufReader::new(stderr).read_to_string(&mut s);
        s
    });
    let stdout = child.stdout.take().context("make stdout")?;
    let (mut n, mut last) = (0usize, Instant::now());
    let mut tail = std::collections::VecDeque::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line?;
        if line.trim_start().starts_with("CC") {
            n += 1;
        }
        tail.push_back(line);
        if tail.len() > 20 {
            tail.pop_front();
        }
        if last.elapsed().as_secs() >= 20 {
            println!(
                "{what}: {n} objects compiled, {:.0} s",
                t.elapsed().as_secs_f64()
            );
            last = Instant::now();
        }
    }
    let status = child.wait()?;
    let err = errs.join().unwrap_or_default();
    if !status.success() {
        let lines: Vec<String> = tail.into_iter().collect();
        bail!(
            "make failed ({status}):\n{}\n{}",
            lines.join("\n"),
            err.lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    println!(
        "{what}: {n} objects compiled in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with(status: &str) -> (tempfile::TempDir, ToolsRoot) {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("var/lib/dpkg")).unwrap();
        std::fs::write(d.path().join("var/lib/dpkg/status"), status).unwrap();
        let packages = [("make", "4.3-4.1"), ("erofs-utils", "1.5-1")]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let r = ToolsRoot {
            dir: d.path().to_path_buf(),
            key: Sha256::of_bytes(b"k"),
            packages,
            pins: Vec::new(),
            entry: Entry::Root,
        };
        (d, r)
    }

    /// QEMU runs through the root's own loader: a root whose loader is a link (an absolute one
    /// would be resolved on the host: another glibc than the root's libraries) or without
    /// U-Boot is refused, naming the file, before any wrapper is written.
    #[test]
    fn qemu_virt_refuses_a_loader_link_and_a_missing_u_boot() {
        let (d, r) = root_with(OK);
        let lib = d.path().join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(d.path().join("usr/bin")).unwrap();
        let qemu = d.path().join("usr/bin/qemu-system-aarch64");
        std::fs::write(&qemu, b"elf").unwrap();
        // An absolute link to a file that exists, as the host's loader would be (but any host).
        let loader = lib.join("ld-linux-x86-64.so.2");
        std::os::unix::fs::symlink(&qemu, &loader).unwrap();
        let e = format!("{:#}", r.qemu_virt().unwrap_err());
        assert!(e.contains("u-boot.bin"), "{e}");
        let uboot = d.path().join("usr/lib/u-boot/qemu_arm64");
        std::fs::create_dir_all(&uboot).unwrap();
        std::fs::write(uboot.join("u-boot.bin"), b"u-boot").unwrap();
        let e = format!("{:#}", r.qemu_virt().unwrap_err());
        assert!(
            e.contains("ld-linux-x86-64.so.2 is not a file of the root"),
            "{e}"
        );
    }

    const OK: &str = "Package: make\nStatus: install ok installed\nVersion: 4.3-4.1\n\n\
                      Package: erofs-utils\nStatus: install ok installed\nVersion: 1.5-1\n";

    /// A .deb (ar: debian-binary, control.tar with ./control) of package `name` at `version`.
    fn deb(dir: &Path, name: &str, version: &str) -> PathBuf {
        let control = format!("Package: {name}\nVersion: {version}\nArchitecture: amd64\n");
        let mut t = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(control.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        t.append_data(&mut h, "./control", control.as_bytes())
            .unwrap();
        let tar = t.into_inner().unwrap();
        let path = dir.join(format!("{name}.deb"));
        let mut ar = ar::Builder::new(std::fs::File::create(&path).unwrap());
        for (id, data) in [("debian-binary", &b"2.0\n"[..]), ("control.tar", &tar[..])] {
            let h = ar::Header::new(id.as_bytes().to_vec(), data.len() as u64);
            ar.append(&h, data).unwrap();
        }
        path
    }

    /// A pin whose sha256 is another package's file (update-tools-root once zipped apt's URI
    /// order with the sorted closure) is refused, naming both packages.
    #[test]
    fn a_pin_that_names_another_packages_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = deb(d.path(), "mount", "2.38.1-5+deb12u3");
        assert!(check_control(&p, "mount", "2.38.1-5+deb12u3")
            .unwrap()
            .contains("Package: mount"));
        let e = check_control(&p, "login", "1:4.13+dfsg1-1+deb12u2").unwrap_err();
        assert!(
            e.to_string()
                .contains("is mount 2.38.1-5+deb12u3, not the pinned login 1:4.13+dfsg1-1+deb12u2"),
            "{e}"
        );
        assert!(check_control(&p, "mount", "2.38.1-5").is_err());
    }

    /// The root is checked against its pins: each kind of drift is refused and named.
    #[test]
    fn verify_refuses_a_root_that_drifted_from_its_pins() {
        root_with(OK).1.verify().unwrap();
        let cases = [
            (
                OK.replace("1.5-1", "1.7.1-1"),
                "erofs-utils is 1.7.1-1, pinned 1.5-1",
            ),
            (
                format!("{OK}\nPackage: mtools\nStatus: install ok installed\nVersion: 4\n"),
                "mtools 4 is not pinned",
            ),
            (
                OK.split("\n\n").next().unwrap().to_string(),
                "erofs-utils is pinned but not installed",
            ),
            (
                OK.replacen("install ok installed", "install ok unpacked", 1),
                "make is `install ok unpacked`",
            ),
        ];
        for (status, want) in cases {
            let e = format!("{:#}", root_with(&status).1.verify().unwrap_err());
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn key_follows_versions_and_hashes_not_order() {
        let f = Path::new("images/tools-root.toml");
        let mk = |name: &str, v: &str, sha: &str| {
            Input::parse(
                toml::from_str(&format!(
                    "name = {name:?}\nversion = {v:?}\nkind = \"deb\"\narch = \"amd64\"\nsha256 = {sha:?}\n"
                ))
                .unwrap(),
                f,
            )
            .unwrap()
        };
        let h1 = "11".repeat(32);
        let h2 = "22".repeat(32);
        let a = mk("make", "4.3", &h1);
        let b = mk("bc", "1.07", &h2);
        assert_eq!(
            key_of(&[a.clone(), b.clone()]),
            key_of(&[b.clone(), a.clone()])
        );
        assert_ne!(
            key_of(&[a.clone(), b.clone()]),
            key_of(&[mk("make", "4.4", &h1), b.clone()])
        );
        assert_ne!(
            key_of(&[a.clone(), b.clone()]),
            key_of(&[mk("make", "4.3", &h2), b])
        );
    }

    #[test]
    fn dpkg_status_reads_package_version_status() {
        let s = "Package: a\nStatus: install ok installed\nVersion: 1\n\nPackage: b\nStatus: \
                 deinstall ok config-files\nVersion: 2:3\n";
        assert_eq!(
            dpkg_status(s),
            vec![
                ("a".into(), "1".into(), "install ok installed".into()),
                ("b".into(), "2:3".into(), "deinstall ok config-files".into())
            ]
        );
    }
}
