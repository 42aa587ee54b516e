//! The host prerequisites and their one resolver. Every command calls [`ensure`] with the tools it
//! needs before it runs: a missing tool is installed when this process can (root on an apt-based
//! distro) and the exact command is printed; otherwise we stop with one line naming the command.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use xshell::cmd;

#[derive(clap::Args)]
pub struct Args {
    /// Only report; install nothing.
    #[arg(long)]
    pub check: bool,
}

/// A host tool, how to see it and which Debian packages provide it.
pub struct Tool {
    pub name: &'static str,
    pub why: &'static str,
    /// The version line if the tool is present.
    pub probe: fn() -> Option<String>,
    pub apt: &'static [&'static str],
}

pub const AARCH64: &str = "aarch64-unknown-linux-gnu";
pub const SYSROOT: &str = "/usr/aarch64-linux-gnu";

/// First line of `prog args…` stdout (or stderr) if it runs and exits 0.
pub fn version_of(prog: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(prog).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    let s = String::from_utf8_lossy(&text);
    Some(s.lines().next().unwrap_or("").trim().to_string())
}

fn file_exists(p: &str) -> Option<String> {
    Path::new(p).exists().then(|| p.to_string())
}

pub const CROSS_GCC: Tool = Tool {
    name: "aarch64-linux-gnu-gcc",
    why: "links the aarch64 runtime",
    probe: || version_of("aarch64-linux-gnu-gcc", &["--version"]),
    apt: &["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"],
};

pub const AARCH64_SYSROOT: Tool = Tool {
    name: "aarch64 glibc sysroot",
    why: "lets qemu-user run the dynamically linked runtime (-L /usr/aarch64-linux-gnu): glibc \
          and libgcc_s, which `kiln` links (a new machine without the cross gcc lacked it)",
    probe: || {
        file_exists("/usr/aarch64-linux-gnu/lib/libgcc_s.so.1").and(file_exists(
            "/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1",
        ))
    },
    apt: &["libc6-arm64-cross", "libgcc-s1-arm64-cross"],
};

pub const QEMU_USER: Tool = Tool {
    name: "qemu-aarch64-static",
    why: "runs the runtime's tests as aarch64 code",
    probe: || version_of("qemu-aarch64-static", &["--version"]),
    apt: &["qemu-user-static"],
};

pub const PYTHON_VENV: Tool = Tool {
    name: "python3 -m venv",
    why: "installs llama.cpp's gguf-py, the independent GGUF reference",
    probe: || {
        version_of(
            "python3",
            &[
                "-c",
                "import venv, ensurepip; import sys; print(sys.version.split()[0])",
            ],
        )
    },
    apt: &["python3-venv"],
};

pub const BMAPTOOL: Tool = Tool {
    name: "bmaptool",
    why: "the independent reference for our .bmap files; `bench flash` compares against it",
    probe: || version_of("bmaptool", &["--version"]),
    apt: &["bmap-tools"],
};

pub const LSBLK: Tool = Tool {
    name: "lsblk",
    why: "`flash` reads the block devices (type, transport, size, mounts) from it",
    probe: || version_of("lsblk", &["--version"]),
    apt: &["util-linux"],
};

pub const MKFS_EROFS: Tool = Tool {
    name: "mkfs.erofs",
    why: "writes the models partition (erofs)",
    // mkfs.erofs 1.5 has no version flag; fsck.erofs from the same package says it.
    probe: || version_of("mkfs.erofs", &["--help"]).and_then(|_| version_of("fsck.erofs", &["-V"])),
    apt: &["erofs-utils"],
};

pub const MKE2FS: Tool = Tool {
    name: "mke2fs",
    why: "writes the data partition (ext4)",
    probe: || version_of("mke2fs", &["-V"]),
    apt: &["e2fsprogs"],
};

pub const SFDISK: Tool = Tool {
    name: "sfdisk",
    why: "judges our GPT in tests (sfdisk --json)",
    probe: || version_of("sfdisk", &["--version"]),
    apt: &["fdisk"],
};

pub const FSCK_VFAT: Tool = Tool {
    name: "fsck.vfat",
    why: "judges our FAT in tests (fsck.vfat -n)",
    probe: || version_of("fsck.vfat", &["--help"]),
    apt: &["dosfstools"],
};

pub const FSCK_EROFS: Tool = Tool {
    name: "fsck.erofs",
    why: "judges our erofs in tests",
    probe: || version_of("fsck.erofs", &["-V"]),
    apt: &["erofs-utils"],
};

pub const NGINX: Tool = Tool {
    name: "nginx",
    why: "serves update bundles to the QEMU board in the fleet test (Range requests, as RAUC's own tests use)",
    // /usr/sbin is not on every user's PATH.
    probe: || version_of("nginx", &["-v"]).or_else(|| version_of("/usr/sbin/nginx", &["-v"])),
    apt: &["nginx-light"],
};

pub const SER2NET: Tool = Tool {
    name: "ser2net",
    why: "exports the QEMU board's serial console for distributed labgrid (labgrid-exporter starts it; `labgrid --remote`, stage boot-qemu-ab)",
    // /usr/sbin is not on every user's PATH; labgrid's exporter looks there too.
    probe: || version_of("ser2net", &["-v"]).or_else(|| version_of("/usr/sbin/ser2net", &["-v"])),
    apt: &["ser2net"],
};

pub const E2FSCK: Tool = Tool {
    name: "e2fsck",
    why: "judges our ext4 in tests (e2fsck -fn)",
    probe: || version_of("e2fsck", &["-V"]),
    apt: &["e2fsprogs"],
};

pub const VERITYSETUP: Tool = Tool {
    name: "veritysetup",
    why: "judges the models partition's dm-verity tree in tests (veritysetup verify/format)",
    // /usr/sbin is not on every user's PATH.
    probe: || {
        version_of("veritysetup", &["--version"])
            .or_else(|| version_of("/usr/sbin/veritysetup", &["--version"]))
    },
    apt: &["cryptsetup-bin"],
};

pub const MTOOLS: Tool = Tool {
    name: "mtools (mdir, mcopy)",
    why: "list and read our FAT independently in tests",
    probe: || version_of("mdir", &["--version"]).and_then(|_| version_of("mcopy", &["--version"])),
    apt: &["mtools"],
};

pub const LOSETUP: Tool = Tool {
    name: "losetup",
    why: "`flash` tests and `bench flash` write to loop devices",
    probe: || version_of("losetup", &["--version"]),
    apt: &["mount"],
};

pub const CPIO: Tool = Tool {
    name: "cpio",
    why: "reads our initramfs back independently in tests",
    probe: || version_of("cpio", &["--version"]),
    apt: &["cpio"],
};

pub const KMOD: Tool = Tool {
    name: "kmod",
    why: "depmod and modprobe --show-depends: the independent reference for the initramfs's module closure in tests",
    probe: || version_of("kmod", &["--version"]),
    apt: &["kmod"],
};

pub const XZ: Tool = Tool {
    name: "xz",
    why: "`xz -dc` of Debian's modules: image-checks' independent reference for the initramfs's decompressed modules",
    probe: || version_of("xz", &["--version"]),
    apt: &["xz-utils"],
};

pub const APT_DOWNLOAD: Tool = Tool {
    name: "apt-get",
    why: "downloads the pinned Debian packages (kernel source, busybox, glibc)",
    probe: || version_of("apt-get", &["--version"]),
    apt: &["apt"],
};

pub const UBOOT_TOOLS: Tool = Tool {
    name: "mkenvimage",
    why: "the reference (host tests) for the boot test's pflash environment, which kiln writes, \
          and for the A/B counters file in the slot tests; mkimage for boot.scr",
    probe: || version_of("mkenvimage", &["-V"]),
    apt: &["u-boot-tools"],
};

pub const RAUC: Tool = Tool {
    name: "rauc (with dbus-daemon)",
    why: "the RAUC service whose mark-good/mark-bad/mark-active and status `kiln slot` and the \
          self-check's marks must equal (runtime/tests/slot_rauc.rs, on a private D-Bus bus)",
    probe: || {
        version_of("rauc", &["--version"])
            .and_then(|v| version_of("dbus-daemon", &["--version"]).map(|_| v))
    },
    apt: &["rauc", "dbus-daemon"],
};

pub const FW_PRINTENV: Tool = Tool {
    name: "fw_printenv",
    why: "reads/writes the A/B counters file as RAUC does (libubootenv's fw_printenv/fw_setenv, \
          the reference `kiln slot` is tested against)",
    // fw_printenv -V prints the version and exits 0 without reading an environment.
    probe: || version_of("fw_printenv", &["-V"]),
    apt: &["libubootenv-tool"],
};

pub const GIT: Tool = Tool {
    name: "git",
    why: "the commit is the image's SOURCE_DATE_EPOCH and seed",
    probe: || version_of("git", &["--version"]),
    apt: &["git"],
};

pub const CMAKE: Tool = Tool {
    name: "cmake",
    why: "`bench serve` builds llama-server from llama-cpp-python's vendored llama.cpp",
    probe: || version_of("cmake", &["--version"]),
    apt: &["cmake"],
};

pub const MAKE: Tool = Tool {
    name: "make",
    why: "cmake's default generator (`bench serve`'s llama-server)",
    probe: || version_of("make", &["--version"]),
    apt: &["make"],
};

pub const GXX: Tool = Tool {
    name: "g++",
    why: "compiles llama.cpp (the llama-cpp stage's wheel, `bench serve`'s llama-server)",
    probe: || version_of("g++", &["--version"]),
    apt: &["g++"],
};

/// Where `debian-archive-keyring` puts the key that signs bookworm (on Debian and Ubuntu alike).
pub const DEBIAN_KEYRING_PATH: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

pub const DEBIAN_KEYRING: Tool = Tool {
    name: "debian archive keyring",
    why: "verifies the Debian archive that kiln's private apt configuration resolves pins from",
    probe: || file_exists(DEBIAN_KEYRING_PATH),
    apt: &["debian-archive-keyring"],
};

pub const APT_HELPER: Tool = Tool {
    name: "apt-helper",
    why: "fetches a pinned package from the snapshot service when the live archive dropped it",
    probe: || file_exists("/usr/lib/apt/apt-helper"),
    apt: &["apt"],
};

pub const DEBOOTSTRAP: Tool = Tool {
    name: "debootstrap",
    why: "makes the tools root (the pinned Debian root the kernel build and mkfs.* run in); \
          the fresh-machine test stage bootstraps its Debian 13 root",
    probe: || version_of("debootstrap", &["--version"]),
    apt: &["debootstrap"],
};

/// The tools of each command that needs host tools, resolved by [`prepare`] before it runs.
pub const FOR_BUILD: &[&Tool] = &[&CROSS_GCC];
/// `pins …` resolves through kiln's private apt configuration.
pub const FOR_PINS: &[&Tool] = FOR_APT;
/// The image needs no kernel build tool and no mkfs of the host's: those run in the tools root,
/// which kiln makes itself from the pinned packages (`tools_root::make`). They are fetched through
/// kiln's private apt configuration where the host has apt ([`FOR_APT`], asked for then), else
/// directly (`http`).
pub const FOR_IMAGE: &[&Tool] = &[&GIT];
/// What kiln's private apt configuration needs, on a host that has apt.
pub const FOR_APT: &[&Tool] = &[&APT_DOWNLOAD, &APT_HELPER, &DEBIAN_KEYRING];
/// None of the host's: the qemu-virt board's QEMU and U-Boot are the tools root's
/// (`tools_root::qemu_virt`), pinned like every tool.
pub const FOR_BOOT: &[&Tool] = &[];
pub const FOR_FLASH: &[&Tool] = &[&LSBLK];
pub const FOR_BENCH_FLASH: &[&Tool] = &[&BMAPTOOL, &LOSETUP, &LSBLK];
/// Building llama-server (only when it is not in the cache yet).
pub const FOR_LLAMA_SERVER_BUILD: &[&Tool] = &[&CMAKE, &MAKE, &GXX];
/// `report` parses GPT and FAT in-process: it needs no host tool.
pub const FOR_REPORT: &[&Tool] = &[];

/// The one entry to prerequisites: every command that needs host tools calls this first with
/// exactly those tools (and `cross` when it cross-builds Rust), so that nothing fails later on a
/// tool the doctor knows how to install.
pub fn prepare(command: &str, tools: &[&Tool], cross: bool) -> Result<()> {
    ensure(tools).with_context(|| format!("`cargo xtask {command}` cannot start"))?;
    if cross {
        cross_toolchain().with_context(|| format!("`cargo xtask {command}` cannot start"))?;
    }
    Ok(())
}

/// Every tool any command needs, for `cargo xtask doctor`.
pub fn all_tools() -> Vec<&'static Tool> {
    vec![
        &CROSS_GCC,
        &AARCH64_SYSROOT,
        &QEMU_USER,
        &PYTHON_VENV,
        &MKFS_EROFS,
        &MKE2FS,
        &SFDISK,
        &FSCK_VFAT,
        &FSCK_EROFS,
        &E2FSCK,
        &VERITYSETUP,
        &NGINX,
        &SER2NET,
        &MTOOLS,
        &CPIO,
        &LOSETUP,
        &BMAPTOOL,
        &LSBLK,
        &UBOOT_TOOLS,
        &FW_PRINTENV,
        &RAUC,
        &APT_DOWNLOAD,
        &APT_HELPER,
        &DEBIAN_KEYRING,
        &GIT,
        &DEBOOTSTRAP,
        &CMAKE,
        &MAKE,
        &GXX,
        &XZ,
        &KMOD,
    ]
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// What a test stage returns (as its error) when this process is not root and the stage's checks
/// need root by their nature: loop devices, or a fresh machine's root and another user inside
/// it. `cargo xtask test` counts it as SKIPPED, names it and the reason in its summary, and still
/// exits 0: an ordinary user runs every other stage. As root (CI) a stage never says this.
#[derive(Debug)]
pub struct NeedsRoot(pub String);

impl std::fmt::Display for NeedsRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "needs root: {}", self.0)
    }
}

impl std::error::Error for NeedsRoot {}

/// [`NeedsRoot`] unless this process is root.
pub fn need_root(why: &str) -> Result<()> {
    if is_root() {
        return Ok(());
    }
    Err(NeedsRoot(why.to_string()).into())
}

/// Whether this process may install host packages: root on an apt-based system, unless
/// `KILN_NO_INSTALL=1` asks for the commands to be printed instead.
fn can_apt() -> bool {
    std::env::var_os("KILN_NO_INSTALL").is_none_or(|v| v.is_empty() || v == "0")
        && Path::new("/etc/debian_version").exists()
        && version_of("apt-get", &["--version"]).is_some()
}

static APT_UPDATED: AtomicBool = AtomicBool::new(false);

/// Install Debian packages, printing the exact commands; or stop with the command to run.
pub fn apt_install(pkgs: &[&str], for_what: &str) -> Result<()> {
    let line = format!(
        "apt-get install -y --no-install-recommends {}",
        pkgs.join(" ")
    );
    if !(is_root() && can_apt()) {
        bail!("missing {for_what}: run `sudo {line}` (or `sudo cargo xtask doctor`)");
    }
    let sh = xshell::Shell::new()?;
    sh.set_var("DEBIAN_FRONTEND", "noninteractive");
    if !APT_UPDATED.swap(true, Ordering::SeqCst) {
        println!("doctor: running `apt-get update`");
        cmd!(sh, "apt-get update -qq")
            .run()
            .context("apt-get update")?;
    }
    // apt removes a package that conflicts with what it installs without asking under -y (seen:
    // Debian 12's qemu-system-arm 7.2 took away an installed backports qemu-utils 10.0.2). The
    // doctor never takes anything away: it asks apt what the install would remove first, and
    // installs with --no-remove.
    let sim = cmd!(sh, "apt-get install -s --no-install-recommends {pkgs...}")
        .ignore_status()
        .output()
        .context("apt-get install -s (what the install would change)")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&sim.stdout),
        String::from_utf8_lossy(&sim.stderr)
    );
    let gone = removals(&text);
    if !gone.is_empty() || !sim.status.success() {
        bail!(
            "missing {for_what}, but installing {} would remove {}: kiln's doctor never takes \
             anything away. Decide yourself: `sudo apt-get install --no-install-recommends {}` \
             shows what apt would remove and asks; or provide the tools in another way (on PATH). \
             apt said: {}",
            pkgs.join(" "),
            if gone.is_empty() {
                "something (the simulation failed)".to_string()
            } else {
                gone.join(", ")
            },
            pkgs.join(" "),
            text.lines()
                .filter(|l| l.starts_with("E:") || l.starts_with("Remv "))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    println!("doctor: installing {for_what}: running `{line} --no-remove`");
    cmd!(
        sh,
        "apt-get install -y -qq --no-install-recommends --no-remove {pkgs...}"
    )
    .run()
    .with_context(|| format!("`{line} --no-remove` failed"))?;
    Ok(())
}

/// What `apt-get install -s` says it would remove: its `Remv NAME [VERSION]` lines, as
/// `NAME VERSION`.
fn removals(simulation: &str) -> Vec<String> {
    simulation
        .lines()
        .filter_map(|l| l.strip_prefix("Remv "))
        .map(|r| r.replace(['[', ']'], "").trim().to_string())
        .collect()
}

/// Make sure every tool in `tools` is present, installing what is missing (once, together).
pub fn ensure(tools: &[&Tool]) -> Result<()> {
    let missing: Vec<&&Tool> = tools.iter().filter(|t| (t.probe)().is_none()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut pkgs: Vec<&str> = missing.iter().flat_map(|t| t.apt.iter().copied()).collect();
    pkgs.sort();
    pkgs.dedup();
    let names: Vec<String> = missing
        .iter()
        .map(|t| format!("{} (package {})", t.name, t.apt.join(" ")))
        .collect();
    apt_install(&pkgs, &names.join(", "))?;
    for t in missing {
        if (t.probe)().is_none() {
            bail!(
                "{} is still missing after installing {}: is it on PATH ({})?",
                t.name,
                t.apt.join(" "),
                std::env::var("PATH").unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// Which compiler builds for aarch64, and how it got its standard library.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CrossToolchain {
    /// How the aarch64 std was found: `rustup (target already installed)`, `rustup target add`.
    /// Said in the build's log, never in the image: it does not shape the bytes.
    pub source: String,
    /// The aarch64 std's bytes: sha256 over the sorted `<sha256>  <path>` lines of every file
    /// under the sysroot's `lib/rustlib/aarch64-unknown-linux-gnu/` (what the manifest records:
    /// the same whether the std came with the toolchain or was added later).
    pub std_sha256: String,
    /// `RUSTC` for cargo, when it is not the one on PATH.
    pub rustc: Option<PathBuf>,
    /// The cargo to run for cross builds.
    pub cargo: PathBuf,
    pub rustc_version: String,
}

/// The aarch64 linker of cross builds when it is not the host's `aarch64-linux-gnu-gcc`: the image
/// links `kiln` with the tools root's ([`link_with`]), since the linker and the crt objects it adds
/// are bytes of the image.
/// The same root's `ar` goes with it: crates with C (ring, under `kiln fleet`'s TLS) compile it
/// with the root's gcc (`CC_aarch64_unknown_linux_gnu`) and archive it with its `ar`.
static CROSS_LINKER: std::sync::Mutex<Option<(PathBuf, PathBuf)>> = std::sync::Mutex::new(None);

/// Link (and compile the C of) every later cross build of this process with `linker` and `ar`.
pub fn link_with(linker: PathBuf, ar: PathBuf) {
    if let Ok(mut g) = CROSS_LINKER.lock() {
        *g = Some((linker, ar));
    }
}

impl CrossToolchain {
    /// A `cargo` command for aarch64 builds with the linker and (if needed) RUSTC set: what goes
    /// into an image. Built in this checkout's target/, never in the test suite's shared build
    /// directory (`test::share_build_dir`), so where its build writes (OUT_DIR) and so the
    /// image's bytes stay what they were.
    pub fn cargo<'a>(&self, sh: &'a xshell::Shell) -> xshell::Cmd<'a> {
        let root = CROSS_LINKER.lock().ok().and_then(|g| g.clone());
        let linker = root
            .as_ref()
            .map(|r| r.0.clone())
            .unwrap_or_else(|| PathBuf::from(CROSS_GCC.name));
        // Paths that end up in the binary (panic locations, debug info) must not depend on where
        // the checkout or the user's cargo home is: the checkout becomes /kiln, the crates'
        // sources /cargo, in rustc's objects and in the C compiled for the board alike.
        let (root_dir, home) = (crate::paths::project_root(), cargo_home());
        let mut c = self
            .cargo_linked_by(sh, &linker)
            .env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
                format!(
                    "--remap-path-prefix={}=/kiln --remap-path-prefix={}=/cargo",
                    root_dir.display(),
                    home.display()
                ),
            )
            .env(
                "CFLAGS_aarch64_unknown_linux_gnu",
                format!(
                    "-ffile-prefix-map={}=/kiln -ffile-prefix-map={}=/cargo",
                    root_dir.display(),
                    home.display()
                ),
            )
            .env_remove("CARGO_BUILD_BUILD_DIR");
        if let Some((_, ar)) = &root {
            c = c.env("AR_aarch64_unknown_linux_gnu", ar);
        }
        c
    }

    /// [`CrossToolchain::cargo`] for what no image holds (the tests under qemu-user, the NPU
    /// stand-in): the host's cross gcc ([`CROSS_GCC`]), which sees the test suite's shared build
    /// directory (the tools root's linker runs inside the root, which binds the checkout, not
    /// `~/.cache/kiln/cargo-build`), and no path remapping, so the flags, and with them the
    /// dependencies' builds, are the same for every checkout (`test::share_build_dir`).
    pub fn cargo_for_tests<'a>(&self, sh: &'a xshell::Shell) -> xshell::Cmd<'a> {
        self.cargo_linked_by(sh, Path::new(CROSS_GCC.name))
            .env_remove("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS")
            .env_remove("CFLAGS_aarch64_unknown_linux_gnu")
            .env_remove("AR_aarch64_unknown_linux_gnu")
    }

    /// The pinned cargo (and rustc) with `linker` as the aarch64 linker and as the C compiler
    /// for the board (ring): the same compiler as the link.
    fn cargo_linked_by<'a>(&self, sh: &'a xshell::Shell, linker: &Path) -> xshell::Cmd<'a> {
        let cargo = &self.cargo;
        let mut c = cmd!(sh, "{cargo}")
            .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", linker)
            .env("CC_aarch64_unknown_linux_gnu", linker);
        if let Some(rustc) = &self.rustc {
            c = c.env("RUSTC", rustc);
        }
        c
    }
}

/// `$CARGO_HOME` as cargo resolves it (default `~/.cargo`), without symlinks, as rustc sees the
/// crates' source paths.
pub fn cargo_home() -> PathBuf {
    let p = std::env::var_os("CARGO_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    p.canonicalize().unwrap_or(p)
}

/// The sysroot of the project's rustc (`rustc --print sysroot` from the project root).
pub fn rust_sysroot() -> Result<PathBuf> {
    rustc_in_project(&["--print", "sysroot"])
        .map(PathBuf::from)
        .context("`rustc --print sysroot` failed in the project root")
}

/// sha256 over the sorted `<sha256>  <relative path>` lines of every file below `dir`.
pub fn tree_sha256(dir: &Path) -> Result<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
        for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            let p = e?.path();
            let m = std::fs::symlink_metadata(&p)?;
            if m.is_dir() {
                walk(base, &p, out)?;
            } else {
                let bytes =
                    std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
                let rel = p.strip_prefix(base).unwrap_or(&p);
                out.push(format!("{}  {}\n", sha256_hex(&bytes), rel.display()));
            }
        }
        Ok(())
    }
    let mut lines = Vec::new();
    walk(dir, dir, &mut lines)?;
    lines.sort();
    Ok(sha256_hex(lines.concat().as_bytes()))
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

/// The aarch64 std's folder in the pinned toolchain's sysroot.
fn aarch64_std_dir() -> Option<PathBuf> {
    let sysroot = rustc_in_project(&["--print", "sysroot"])?;
    Some(Path::new(&sysroot).join("lib/rustlib").join(AARCH64))
}

fn rustup_has_target() -> bool {
    let Some(sysroot) = rustc_in_project(&["--print", "sysroot"]) else {
        return false;
    };
    Path::new(&sysroot)
        .join("lib/rustlib")
        .join(AARCH64)
        .join("lib")
        .is_dir()
}

/// `rustc ARGS` run from the project root, so rustup's proxy reads `rust-toolchain.toml` whatever
/// folder `cargo xtask` was started from.
fn rustc_in_project(args: &[&str]) -> Option<String> {
    let out = Command::new("rustc")
        .args(args)
        .current_dir(crate::paths::project_root())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The host's target triple, as the pinned rustc names it (`rustc -vV`'s `host:`).
pub fn host_triple() -> Result<String> {
    let v = rustc_in_project(&["-vV"]).context("rustc -vV failed")?;
    v.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(|h| h.trim().to_string())
        .context("rustc -vV names no host")
}

/// The Rust release `rust-toolchain.toml` pins (its `toolchain.channel`).
pub fn pinned_rust() -> Result<String> {
    let path = crate::paths::project_root().join("rust-toolchain.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc: toml::Value =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    doc.get("toolchain")
        .and_then(|t| t.get("channel"))
        .and_then(|c| c.as_str())
        .map(str::to_string)
        .with_context(|| format!("{}: no toolchain.channel", path.display()))
}

/// The rustc that will build kiln must be the pinned release: another rustc makes another `kiln`
/// binary, so another initramfs and image. Returns its `--version` line.
fn ensure_pinned_rustc() -> Result<String> {
    let pinned = pinned_rust()?;
    let install = format!(
        "rustup toolchain install {pinned} --profile minimal --component rustfmt,clippy \
         --target {AARCH64}"
    );
    let Some(found) = rustc_in_project(&["--version"]) else {
        bail!("no rustc on PATH: install rustup (https://rustup.rs), then run `{install}`");
    };
    if !found.starts_with(&format!("rustc {pinned} ")) {
        let why = match std::env::var("RUSTUP_TOOLCHAIN") {
            Ok(t) if !t.is_empty() => format!(" (RUSTUP_TOOLCHAIN={t} overrides it)"),
            _ => String::new(),
        };
        bail!(
            "`{found}` is not the pinned Rust {pinned} of rust-toolchain.toml{why}: with rustup, \
             run `{install}` and start `cargo xtask` without `+toolchain`; without rustup, \
             install rustup (https://rustup.rs) — a distribution's rustc builds other bytes"
        );
    }
    Ok(found)
}

fn toolchain_record() -> PathBuf {
    crate::paths::target_dir().join("kiln/toolchain.json")
}

/// The pinned rustc (`rust-toolchain.toml`) with its aarch64 std: rustup's toolchain already has
/// it, else `rustup target add`. Debian's `rustc-web` is not a way any more: it is another
/// release, so it would build other bytes. The one used is printed and recorded in
/// `target/kiln/toolchain.json`.
///
/// Found once per process: the steps that build for aarch64 each ask, and every asking ran
/// `rustc --version`, `rustc --print sysroot` and the cross gcc's `--version` again (0.1 s each
/// of a no-op image's 0.5 s). Nothing in one run changes the toolchain but this function itself.
pub fn cross_toolchain() -> Result<CrossToolchain> {
    static FOUND: std::sync::Mutex<Option<CrossToolchain>> = std::sync::Mutex::new(None);
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(tc) = found.as_ref() {
        return Ok(tc.clone());
    }
    let tc = find_cross_toolchain()?;
    *found = Some(tc.clone());
    Ok(tc)
}

/// The aarch64 linker is not checked here: the image's builds link with the tools root's
/// ([`link_with`]); what links with the host's asks for [`CROSS_GCC`] itself ([`FOR_BUILD`], the
/// qemu-user tests).
fn find_cross_toolchain() -> Result<CrossToolchain> {
    let rustc_version = ensure_pinned_rustc()?;
    let rustup_cargo = || -> PathBuf {
        std::env::var_os("CARGO")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("cargo"))
    };
    let tc = if rustup_has_target() {
        CrossToolchain {
            source: "rustup (target already installed)".into(),
            std_sha256: String::new(),
            rustc: None,
            cargo: rustup_cargo(),
            rustc_version,
        }
    } else if version_of("rustup", &["--version"]).is_some() && {
        println!("doctor: aarch64 std missing: running `rustup target add {AARCH64}`");
        let sh = crate::paths::shell()?;
        cmd!(sh, "rustup target add {AARCH64}").run().is_ok() && rustup_has_target()
    } {
        CrossToolchain {
            source: "rustup target add".into(),
            std_sha256: String::new(),
            rustc: None,
            cargo: rustup_cargo(),
            rustc_version,
        }
    } else {
        bail!("no aarch64 Rust std: run `rustup target add {AARCH64}`");
    };
    let std_dir = aarch64_std_dir().context("rustc --print sysroot failed")?;
    let tc = CrossToolchain {
        std_sha256: tree_sha256(&std_dir)
            .with_context(|| format!("hashing the aarch64 std in {}", std_dir.display()))?,
        ..tc
    };
    let rec = toolchain_record();
    if let Some(dir) = rec.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(&tc)?;
    let prev = std::fs::read_to_string(&rec).ok();
    if prev.as_deref() != Some(json.as_str()) {
        println!(
            "doctor: aarch64 std from {} ({}, files sha256 {})",
            tc.source, tc.rustc_version, tc.std_sha256
        );
        let tmp = rec.with_extension("json.tmp");
        std::fs::write(&tmp, &json).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &rec).with_context(|| format!("renaming to {}", rec.display()))?;
    }
    Ok(tc)
}

pub fn run(args: Args) -> Result<()> {
    let tools = all_tools();
    let mut missing = Vec::new();
    println!("{:<28} {:<8} version / why", "tool", "status");
    for t in &tools {
        match (t.probe)() {
            Some(v) => println!("{:<28} {:<8} {v}", t.name, "found"),
            None => {
                println!(
                    "{:<28} {:<8} ({}; apt: {})",
                    t.name,
                    "MISSING",
                    t.why,
                    t.apt.join(" ")
                );
                missing.push(*t);
            }
        }
    }
    let std_line = if rustup_has_target() {
        "found    rustup toolchain".to_string()
    } else {
        "MISSING  (resolved on first cross build: rustup target add)".to_string()
    };
    println!("{:<28} {std_line}", format!("rust std {AARCH64}"));
    // What a build as an ordinary user will need (docs/rootless.md; not built yet: builds run
    // as root today), as this host and user stand.
    println!("\nfor builds as an ordinary user (docs/rootless.md, not built yet):");
    if is_root() {
        println!("  (root builds as today: run `cargo xtask doctor` as the user who is to build)");
    } else {
        for l in crate::userns::lines(&crate::userns::report(&crate::userns::Host::this())) {
            println!("  {l}");
        }
    }
    if args.check {
        if !missing.is_empty() {
            bail!("{} tool(s) missing", missing.len());
        }
        return Ok(());
    }
    ensure(&missing)?;
    cross_toolchain()?;
    println!("doctor: everything kiln needs is present");
    Ok(())
}

/// A virtualenv `target/kiln/<name>` with `pins` (space-separated `pkg==version`) installed,
/// made again when the pins change; returns its python.
pub fn pinned_venv(name: &str, pins: &str) -> Result<std::path::PathBuf> {
    let dir = crate::paths::target_dir().join("kiln").join(name);
    let python = dir.join("bin/python");
    let stamp = dir.join("kiln-pins.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(pins) && python.exists() {
        return Ok(python);
    }
    let sh = crate::paths::shell()?;
    println!("{name}: installing {pins} into {}", dir.display());
    cmd!(sh, "python3 -m venv --clear {dir}")
        .run()
        .with_context(|| format!("creating the virtualenv {}", dir.display()))?;
    let list: Vec<&str> = pins.split_whitespace().collect();
    cmd!(
        sh,
        "{python} -m pip install --disable-pip-version-check -q {list...}"
    )
    .run()
    .with_context(|| format!("pip install {pins}"))?;
    std::fs::write(&stamp, pins).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

#[cfg(test)]
mod tests {
    use super::removals;

    /// Only a process that is not root is told a stage needs root, and the suite recognises the
    /// error as such through a context a stage may add: as root (CI) nothing can be SKIPPED.
    #[test]
    fn needs_root_only_when_not_root_and_is_found_under_context() {
        use anyhow::Context as _;
        let r = super::need_root("loop devices").context("the flash stage");
        assert_eq!(r.is_ok(), super::is_root());
        if let Err(e) = r {
            assert!(e.downcast_ref::<super::NeedsRoot>().is_some(), "{e:#}");
            assert!(
                format!("{e:#}").contains("needs root: loop devices"),
                "{e:#}"
            );
        }
    }

    #[test]
    fn removals_are_read_from_apt_simulation() {
        // apt-get -s install qemu-system-arm on a host with backports' qemu-utils (the case seen).
        let sim =
            "Reading package lists...\nThe following packages will be REMOVED:\n  qemu-utils\n\
                   Remv qemu-utils [1:10.0.2+ds-2+deb13u1~bpo12+1]\n\
                   Inst qemu-system-arm (1:7.2+dfsg-7+deb12u18 Debian:12.13/oldstable [amd64])\n\
                   Conf qemu-system-arm (1:7.2+dfsg-7+deb12u18 Debian:12.13/oldstable [amd64])\n";
        assert_eq!(removals(sim), ["qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1"]);
        assert!(removals("Inst a (1 x)\nConf a (1 x)\n").is_empty());
    }

    /// The real apt on this host: asking it to take an installed package away (`NAME-`) must
    /// show up as a removal (root and apt-get only; skipped, by name, elsewhere).
    #[test]
    fn a_real_apt_simulation_names_what_it_would_remove() {
        let installed = std::process::Command::new("dpkg-query")
            .args(["-W", "-f=${Package}", "kmod"])
            .output()
            .is_ok_and(|o| o.status.success() && o.stdout == b"kmod");
        if !installed {
            eprintln!("skipped: no dpkg or no kmod package here");
            return;
        }
        let sim = std::process::Command::new("apt-get")
            .args(["install", "-s", "--no-install-recommends", "kmod-"])
            .output()
            .expect("apt-get");
        let text = String::from_utf8_lossy(&sim.stdout);
        let gone = removals(&text);
        assert!(
            gone.iter().any(|g| g.starts_with("kmod ")),
            "apt's simulation removes kmod, but removals() read {gone:?} from:\n{text}"
        );
    }
}
