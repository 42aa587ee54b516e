//! `cargo xtask flash` end to end, on regular files and real loop devices. These need root (loop
//! devices, mount) and are run by `cargo xtask test --stage flash`, which says so when it is not
//! root; they fail, never skip, when a loop device cannot be made. The bmaps come from
//! `bmaptool create`, the independent reference.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const PATTERN: u8 = 0xA5;
const MIB: u64 = 1 << 20;

fn xtask() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("command runs");
    eprintln!(
        "$ {cmd:?}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn must(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?} failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn assert_root() {
    let uid = must(Command::new("id").arg("-u"));
    assert_eq!(uid, "0", "flash tests need root to make loop devices");
}

struct Dir(PathBuf);
impl Dir {
    fn new(tag: &str) -> Dir {
        let p = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("flash-{tag}"));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("mkdir");
        Dir(p)
    }
}
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loop device over a backing file, detached on drop.
struct Loop {
    dev: String,
}
impl Loop {
    fn new(backing: &Path, partscan: bool) -> Loop {
        let mut c = Command::new("losetup");
        c.arg("-f").arg("--show");
        if partscan {
            c.arg("-P");
        }
        let dev = must(c.arg(backing));
        assert!(dev.starts_with("/dev/loop"), "losetup gave {dev:?}");
        Loop { dev }
    }
}
impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

struct Mount(PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Data extents of the test image: (offset, length). One ends mid-block.
const EXTENTS: &[(u64, u64)] = &[(0, MIB), (5 * MIB, 300_000), (40 * MIB, 3 * MIB)];
const IMAGE: u64 = 64 * MIB;

fn bytes(seed: u64, n: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A sparse image and its bmap from `bmaptool create`.
fn image(dir: &Path) -> PathBuf {
    let img = dir.join("test.img");
    let f = File::create(&img).expect("create");
    f.set_len(IMAGE).expect("set_len");
    for (i, &(off, n)) in EXTENTS.iter().enumerate() {
        f.write_all_at(&bytes(i as u64 + 1, n), off).expect("write");
    }
    f.sync_all().expect("sync");
    must(
        Command::new("bmaptool")
            .arg("create")
            .arg("-o")
            .arg(dir.join("test.img.bmap"))
            .arg(&img),
    );
    img
}

fn prefilled(path: &Path, size: u64) {
    let mut f = File::create(path).expect("create");
    let chunk = vec![PATTERN; MIB as usize];
    for _ in 0..size / MIB {
        f.write_all(&chunk).expect("fill");
    }
    f.sync_all().expect("sync");
}

/// The blocks bmaptool mapped (4 KiB granular), as byte spans.
fn mapped_spans() -> Vec<(u64, u64)> {
    EXTENTS
        .iter()
        .map(|&(o, n)| (o / 4096 * 4096, ((o + n).div_ceil(4096) * 4096).min(IMAGE)))
        .collect()
}

/// Mapped spans of `target` equal the image; everything else still holds the pattern.
fn check_target(target: &[u8], img: &[u8]) {
    let spans = mapped_spans();
    for &(s, e) in &spans {
        assert!(
            target[s as usize..e as usize] == img[s as usize..e as usize],
            "mapped span {s}..{e} differs from the image"
        );
    }
    let mut pos = 0u64;
    for &(s, e) in spans.iter().chain([(target.len() as u64, 0)].iter()) {
        if let Some(k) = target[pos as usize..s as usize]
            .iter()
            .position(|&b| b != PATTERN)
        {
            panic!("unmapped byte {} was touched", pos + k as u64);
        }
        pos = e.max(pos);
    }
}

fn flash(image: &Path, device: &str, extra: &[&str]) -> Output {
    run(xtask()
        .arg("flash")
        .arg("--image")
        .arg(image)
        .arg("--device")
        .arg(device)
        .arg("--yes")
        .args(extra))
}

#[test]
fn to_regular_file_raw_and_compressed() {
    let d = Dir::new("file");
    let img = image(&d.0);
    let raw = std::fs::read(&img).expect("read image");
    let zst = d.0.join("test.img.zst");
    std::fs::write(&zst, zstd::encode_all(&raw[..], 3).expect("zstd")).expect("write");
    let gz = d.0.join("test.img.gz");
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(&raw).expect("gzip");
    std::fs::write(&gz, e.finish().expect("gzip")).expect("write");
    let xz = d.0.join("test.img.xz");
    let mut e = xz2::write::XzEncoder::new(Vec::new(), 1);
    e.write_all(&raw).expect("xz");
    std::fs::write(&xz, e.finish().expect("xz")).expect("write");
    for (i, src) in [&img, &zst, &gz, &xz].into_iter().enumerate() {
        let t = d.0.join(format!("target{i}.bin"));
        prefilled(&t, IMAGE + 8 * MIB);
        let out = flash(src, t.to_str().expect("utf-8"), &[]);
        assert!(out.status.success(), "{}", text(&out));
        assert!(text(&out).contains("every range matches"), "{}", text(&out));
        check_target(&std::fs::read(&t).expect("read target"), &raw);
    }
}

#[test]
fn without_bmap_everything_is_written() {
    let d = Dir::new("nobmap");
    let img = image(&d.0);
    std::fs::remove_file(d.0.join("test.img.bmap")).expect("rm bmap");
    let t = d.0.join("t.bin");
    prefilled(&t, IMAGE + MIB);
    let out = flash(&img, t.to_str().expect("utf-8"), &[]);
    assert!(out.status.success(), "{}", text(&out));
    let got = std::fs::read(&t).expect("read");
    assert!(got[..IMAGE as usize] == std::fs::read(&img).expect("read")[..]);
    assert!(got[IMAGE as usize..].iter().all(|&b| b == PATTERN));
}

#[test]
fn damaged_image_stops_the_write() {
    let d = Dir::new("damaged");
    let img = image(&d.0);
    // Change a mapped byte after bmaptool hashed it.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .expect("open");
    f.write_all_at(&[0x42], 40 * MIB + 17).expect("write");
    let t = d.0.join("t.bin");
    prefilled(&t, IMAGE);
    let out = flash(&img, t.to_str().expect("utf-8"), &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("damaged"), "{}", text(&out));
}

#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn to_loop_device() {
    assert_root();
    let d = Dir::new("loop");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, IMAGE + 16 * MIB);
    let lo = Loop::new(&back, false);
    // Without --allow-loop a loop device is refused and untouched.
    let out = flash(&img, &lo.dev, &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("loop device"), "{}", text(&out));
    // A script's pinned serial that does not match refuses (loop devices have none).
    let out = flash(
        &img,
        &lo.dev,
        &["--allow-loop", "--expect-serial", "0xaa5f3c21"],
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("not the expected"), "{}", text(&out));
    let out = flash(&img, &lo.dev, &["--allow-loop"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("every range matches"), "{}", text(&out));
    let mut got = vec![0u8; (IMAGE + 16 * MIB) as usize];
    File::open(&lo.dev)
        .expect("open loop")
        .read_exact_at(&mut got, 0)
        .expect("read loop");
    check_target(&got, &std::fs::read(&img).expect("read image"));
}

/// As an ordinary user (`nobody`, no `disk` group): the loop device (root:disk 0660) is refused
/// before the prompt, naming the group; nothing is written. Root's run then writes it.
#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn a_user_without_write_access_is_refused_naming_the_group() {
    assert_root();
    let d = Dir::new("user");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, IMAGE + 16 * MIB);
    let before = std::fs::read(&back).expect("read backing");
    let lo = Loop::new(&back, false);
    // As udev leaves a card reader on Debian (a container may leave root:root 0600).
    must(Command::new("chgrp").args(["disk", &lo.dev]));
    must(Command::new("chmod").args(["0660", &lo.dev]));
    // nobody must reach the image and the xtask binary: a world-readable copy of the image.
    let pubdir = std::env::temp_dir().join(format!("kiln-flash-user-{}", std::process::id()));
    std::fs::create_dir_all(&pubdir).expect("mkdir");
    let img2 = pubdir.join("user.img");
    std::fs::copy(&img, &img2).expect("copy image");
    std::fs::copy(img.with_extension("img.bmap"), pubdir.join("user.img.bmap")).ok();
    Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(&pubdir)
        .status()
        .expect("chmod");
    let as_nobody = |extra: &[&str]| {
        run(Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_xtask"))
            .args(["flash", "--image"])
            .arg(&img2)
            .args(["--device", &lo.dev, "--yes", "--allow-loop"])
            .args(extra)
            .env("HOME", &pubdir)
            // nobody's own folder: the checkout's may be out of its reach (a root's clone in
            // /root, mode 0700, on a fresh machine), and xtask runs its tools from its cwd.
            .current_dir(&pubdir))
    };
    // A dry run says what a real run would hit, and still shows its plan.
    let dry = as_nobody(&["--dry-run"]);
    let t = text(&dry);
    assert!(dry.status.success(), "{t}");
    assert!(
        t.contains("a real run would stop")
            && t.contains("not in its group `disk`")
            && t.contains("plan:"),
        "{t}"
    );
    let out = as_nobody(&[]);
    let _ = std::fs::remove_dir_all(&pubdir);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("permission denied for uid 65534")
            && t.contains("not in its group `disk`")
            && t.contains("never escalates"),
        "{t}"
    );
    drop(lo);
    assert!(
        std::fs::read(&back).expect("read backing") == before,
        "the user's refused run changed the device"
    );
}

#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn loop_with_mounted_partition_is_refused() {
    assert_root();
    let d = Dir::new("mounted");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, 128 * MIB);
    let lo = Loop::new(&back, true);
    let mut sf = Command::new("sfdisk")
        .arg(&lo.dev)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sfdisk");
    sf.stdin
        .take()
        .expect("stdin")
        .write_all(b"label: dos\nstart=2048, size=65536, type=83\n")
        .expect("feed sfdisk");
    assert!(sf.wait().expect("sfdisk").success(), "sfdisk failed");
    let part = format!("{}p1", lo.dev);
    if !Path::new(&part).exists() {
        // Kernels without the msdos partition parser: add it explicitly (BLKPG).
        must(Command::new("partx").arg("-a").arg(&lo.dev));
    }
    // ext4, not vfat: some kernels (this CI's) are built without vfat.
    must(Command::new("mkfs.ext4").arg("-q").arg("-F").arg(&part));
    let mnt = d.0.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    must(Command::new("mount").arg(&part).arg(&mnt));
    let _m = Mount(mnt.clone());
    let before = std::fs::read(&back).expect("read backing");
    let out = flash(
        &img,
        &lo.dev,
        &["--allow-loop", "--force-non-removable", "--force-large"],
    );
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("is mounted at") && t.contains(mnt.to_str().expect("utf-8")),
        "{t}"
    );
    // The partition itself is not a target either.
    let out = flash(&img, &part, &["--allow-loop"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("partition"), "{}", text(&out));
    // Nothing was written: compare outside the partition (1..33 MiB), which the mounted file
    // system itself may touch.
    let after = std::fs::read(&back).expect("read backing");
    let outside = |v: &[u8]| [v[..MIB as usize].to_vec(), v[33 * MIB as usize..].to_vec()];
    assert!(outside(&after) == outside(&before), "the disk was written");
}

#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn too_small_loop_is_refused() {
    assert_root();
    let d = Dir::new("small");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, 16 * MIB);
    let lo = Loop::new(&back, false);
    let out = flash(&img, &lo.dev, &["--allow-loop"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("too small"), "{}", text(&out));
    assert!(std::fs::read(&back)
        .expect("read")
        .iter()
        .all(|&b| b == PATTERN));
}

/// The disk under `/` (from /proc/self/mountinfo and sysfs) is refused with every override.
/// `--dry-run` makes sure a bug here could never write to it.
#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn root_disk_is_refused() {
    assert_root();
    let d = Dir::new("root");
    let img = image(&d.0);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let devno = mountinfo
        .lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.get(4) == Some(&"/"))
        .and_then(|f| f.get(2).map(|s| s.to_string()))
        .expect("/ in mountinfo");
    let sys =
        std::fs::canonicalize(format!("/sys/dev/block/{devno}")).expect("/ is on a block device");
    let disk = if sys.join("partition").exists() {
        sys.parent().expect("parent").to_path_buf()
    } else {
        sys
    };
    let name = disk
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let out = flash(
        &img,
        &format!("/dev/{name}"),
        &[
            "--dry-run",
            "--allow-loop",
            "--force-non-removable",
            "--force-large",
        ],
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("holds / "), "{}", text(&out));
}

#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn corruption_between_write_and_verify_is_found() {
    assert_root();
    let d = Dir::new("corrupt");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, IMAGE);
    let lo = Loop::new(&back, false);
    let at = 40 * MIB + 123_457;
    let out = flash(
        &img,
        &lo.dev,
        &["--allow-loop", "--test-corrupt-at", &at.to_string()],
    );
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("verify FAILED"), "{t}");
    assert!(
        t.contains(&format!("first differing byte at offset {at}")),
        "{t}"
    );
    assert!(t.contains(&format!("bytes {}..", 40 * MIB)), "{t}");
}

#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn interrupted_write_is_caught_by_verify() {
    assert_root();
    let d = Dir::new("interrupted");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, IMAGE);
    let lo = Loop::new(&back, false);
    let out = flash(&img, &lo.dev, &["--allow-loop", "--test-stop-after", "1"]);
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("verify FAILED: 2 of 3 ranges differ"), "{t}");
    assert!(t.contains("range 1, bytes 5242880.."), "{t}");
}

/// Without `--device`: the list offers the loop device (with `--allow-loop`), the answer picks it,
/// and a wrong confirmation writes nothing; the right one writes.
#[test]
#[ignore = "needs root and loop devices: `cargo xtask test --stage flash`"]
fn interactive_choice_and_confirmation() {
    assert_root();
    let d = Dir::new("interactive");
    let img = image(&d.0);
    let back = d.0.join("backing.bin");
    prefilled(&back, IMAGE);
    let lo = Loop::new(&back, false);
    let name = lo.dev.trim_start_matches("/dev/").to_string();
    let ask = |answers: String| -> Output {
        let mut c = xtask()
            .arg("flash")
            .arg("--image")
            .arg(&img)
            .arg("--allow-loop")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        c.stdin
            .take()
            .expect("stdin")
            .write_all(answers.as_bytes())
            .expect("answer");
        let out = c.wait_with_output().expect("wait");
        eprintln!("{}", text(&out));
        out
    };
    let out = ask(format!("{name}\nsda\n"));
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("Devices that may be written"), "{t}");
    assert!(t.contains(&format!("/dev/{name} ")), "{t}");
    assert!(t.contains("nothing written"), "{t}");
    assert!(std::fs::read(&back)
        .expect("read")
        .iter()
        .all(|&b| b == PATTERN));
    let out = ask(format!("{name}\n{name}\n"));
    assert!(out.status.success(), "{}", text(&out));
    let mut got = vec![0u8; IMAGE as usize];
    File::open(&lo.dev)
        .expect("open loop")
        .read_exact_at(&mut got, 0)
        .expect("read loop");
    check_target(&got, &std::fs::read(&img).expect("read image"));
}

/// A kiln-shaped disk: a GPT whose `data` partition (1 MiB in, 8 MiB) is an empty ext4, made by
/// sfdisk and mke2fs, with its bmap.
fn gpt_image(dir: &Path) -> PathBuf {
    let img = dir.join("gpt.img");
    File::create(&img)
        .and_then(|f| f.set_len(12 * MIB))
        .expect("create");
    let mut sf = Command::new("sfdisk")
        .arg("--quiet")
        .arg(&img)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("sfdisk");
    sf.stdin
        .take()
        .expect("stdin")
        .write_all(b"label: gpt\nstart=2048, size=16384, name=data\n")
        .expect("sfdisk script");
    assert!(sf.wait().expect("sfdisk").success());
    must(
        Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-E", "offset=1048576"])
            .arg(&img)
            .arg("8M"),
    );
    must(
        Command::new("bmaptool")
            .arg("create")
            .arg("-o")
            .arg(dir.join("gpt.img.bmap"))
            .arg(&img),
    );
    img
}

/// `--api-key`: the key lands on the data partition as kiln/api-key, mode 0600, root's, and
/// reads back through debugfs (an independent reader); a second flash replaces it. A key that is
/// no bearer token, or an image with no data partition, is refused before a byte is written.
#[test]
fn api_key_lands_on_the_data_partition() {
    let d = Dir::new("api-key");
    let img = gpt_image(&d.0);
    let t = d.0.join("card.bin");
    let spec = format!("{}?offset=1048576", t.display());
    let cat = |what: &str| {
        let o = run(Command::new("debugfs").args(["-R", what, &spec]));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    for key in [
        "0123456789abcdef0123456789abcdef",
        "a-second-key-rotated-in-0000",
    ] {
        let kf = d.0.join("key");
        std::fs::write(&kf, format!("{key}\n")).expect("key");
        prefilled(&t, 16 * MIB);
        let out = flash(
            &img,
            t.to_str().expect("utf-8"),
            &["--api-key", kf.to_str().expect("utf-8")],
        );
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            text(&out).contains("/data/kiln/api-key (mode 0600"),
            "{}",
            text(&out)
        );
        assert_eq!(cat("cat kiln/api-key"), format!("{key}\n"));
        let stat = cat("stat kiln/api-key");
        assert!(
            stat.contains("Mode:  0600") && stat.contains("User:     0"),
            "{stat}"
        );
        must(Command::new("e2fsck").args(["-fn", &spec]));
    }
    // Refused before a byte is written: the target keeps its pattern.
    let refused = |img: &Path, kf: &Path, why: &str| {
        prefilled(&t, 16 * MIB);
        let out = flash(
            img,
            t.to_str().expect("utf-8"),
            &["--api-key", kf.to_str().expect("utf-8")],
        );
        assert!(
            !out.status.success() && text(&out).contains(why),
            "{}",
            text(&out)
        );
        assert!(
            std::fs::read(&t)
                .expect("read")
                .iter()
                .all(|&b| b == PATTERN),
            "refused ({why}), yet the target was written"
        );
    };
    for (bad, why) in [
        ("short", "16 to 4096"),
        ("has a space in it 0123456789", "visible ASCII"),
    ] {
        let kf = d.0.join("bad-key");
        std::fs::write(&kf, bad).expect("key");
        refused(&img, &kf, why);
    }
    refused(
        &image(&d.0),
        &d.0.join("key"),
        "--api-key needs a kiln image",
    );
}
