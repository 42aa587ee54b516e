//! Writing an image's mapped ranges to a target and reading them back. Block devices are opened
//! `O_EXCL | O_DIRECT` (writes bypass the page cache, and the kernel refuses if anything holds the
//! disk); regular files are written through the cache and read back after dropping it.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// O_DIRECT needs buffers, offsets and lengths aligned to the logical block size; 4096 covers
/// every SD card, eMMC and 4Kn disk.
pub const ALIGN: u64 = 4096;
const CHUNK: usize = 4 << 20;
/// fsync this often: bounds how much a pulled card loses and keeps the progress bar honest.
const SYNC_EVERY: u64 = 64 << 20;

nix::ioctl_none!(blkrrpart, 0x12, 95);
nix::ioctl_none!(blkflsbuf, 0x12, 97);
nix::ioctl_read!(blkgetsize64, 0x12, 114, u64);

/// A byte span of the image to write, with the sha256 it must have (from the bmap), if known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub start: u64,
    pub end: u64,
    pub sha256: Option<[u8; 32]>,
}

/// A heap buffer whose usable part starts on an [`ALIGN`] boundary. Over-allocating a `Vec` and
/// slicing keeps this free of `unsafe`.
struct AlignedBuf {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let v = vec![0u8; len + ALIGN as usize];
        let off = v.as_ptr().align_offset(ALIGN as usize);
        AlignedBuf { v, off, len }
    }
    fn get(&mut self, n: usize) -> &mut [u8] {
        &mut self.v[self.off..self.off + n.min(self.len)]
    }
}

/// The image as a forward stream of its raw bytes (decompressed on the fly).
pub struct Source {
    reader: Box<dyn Read>,
    /// The raw image file when it is not compressed: holes are skipped by seeking.
    raw: Option<File>,
    pos: u64,
    pub path: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Zstd,
    Gzip,
    Xz,
}

pub fn compression_of(path: &Path) -> Compression {
    match path.extension().and_then(|e| e.to_str()) {
        Some("zst") => Compression::Zstd,
        Some("gz") => Compression::Gzip,
        Some("xz") => Compression::Xz,
        _ => Compression::None,
    }
}

impl Source {
    pub fn open(path: &Path) -> Result<Source> {
        let f = File::open(path).with_context(|| format!("opening image {}", path.display()))?;
        let ctx = || format!("starting to decompress {}", path.display());
        let (reader, raw): (Box<dyn Read>, Option<File>) = match compression_of(path) {
            Compression::None => (
                Box::new(f.try_clone().with_context(ctx)?),
                Some(f.try_clone().with_context(ctx)?),
            ),
            Compression::Zstd => (
                Box::new(zstd::stream::read::Decoder::new(f).with_context(ctx)?),
                None,
            ),
            Compression::Gzip => (
                Box::new(flate2::read::MultiGzDecoder::new(std::io::BufReader::new(
                    f,
                ))),
                None,
            ),
            Compression::Xz => (
                Box::new(xz2::read::XzDecoder::new_multi_decoder(
                    std::io::BufReader::new(f),
                )),
                None,
            ),
        };
        Ok(Source {
            reader,
            raw,
            pos: 0,
            path: path.to_path_buf(),
        })
    }

    fn skip_to(&mut self, off: u64) -> Result<()> {
        if off < self.pos {
            bail!("ranges out of order: at {} asked for {off}", self.pos);
        }
        if let Some(f) = &mut self.raw {
            // `reader` is a clone of `f`: they share the file offset.
            f.seek(SeekFrom::Start(off))?;
        } else {
            let n = std::io::copy(
                &mut (&mut self.reader).take(off - self.pos),
                &mut std::io::sink(),
            )
            .with_context(|| format!("decompressing {}", self.path.display()))?;
            if n != off - self.pos {
                bail!(
                    "{} ends at {} but the bmap has data at {off}",
                    self.path.display(),
                    self.pos + n
                );
            }
        }
        self.pos = off;
        Ok(())
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        self.reader.read_exact(buf).with_context(|| {
            format!(
                "reading {} bytes of {} at {}",
                buf.len(),
                self.path.display(),
                self.pos
            )
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    /// The decompressed size, by reading the stream once (xz and gzip have no reliable header).
    pub fn measure(path: &Path) -> Result<u64> {
        let mut s = Source::open(path)?;
        if let Some(f) = &s.raw {
            return Ok(f.metadata()?.len());
        }
        std::io::copy(&mut s.reader, &mut std::io::sink())
            .with_context(|| format!("decompressing {} to measure it", path.display()))
    }
}

/// Where the image goes.
pub struct Target {
    pub path: PathBuf,
    pub is_block: bool,
    file: File,
    /// A second, buffered descriptor for an unaligned tail on a block device.
    tail: Option<File>,
}

impl Target {
    pub fn open(path: &Path, is_block: bool) -> Result<Target> {
        let file = if is_block {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_EXCL | libc::O_DIRECT)
                .open(path)
                .with_context(|| {
                    format!(
                        "opening {} exclusively (O_EXCL): is something using it?",
                        path.display()
                    )
                })?
        } else {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?
        };
        Ok(Target {
            path: path.to_path_buf(),
            is_block,
            file,
            tail: None,
        })
    }

    /// The size the kernel reports for a block device (`BLKGETSIZE64`).
    pub fn device_size(&self) -> Result<u64> {
        let mut n: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which lives for the call.
        unsafe { blkgetsize64(self.file.as_raw_fd(), &mut n) }
            .with_context(|| format!("BLKGETSIZE64 on {}", self.path.display()))?;
        Ok(n)
    }

    fn tail_fd(&mut self) -> Result<&File> {
        if self.tail.is_none() {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.path)
                .with_context(|| {
                    format!("opening {} for its unaligned tail", self.path.display())
                })?;
            self.tail = Some(f);
        }
        self.tail
            .as_ref()
            .context("tail descriptor vanished after opening")
    }

    /// Write `data` at `off`; on a block device the 4096-aligned part goes through O_DIRECT.
    fn write_at(&mut self, data: &[u8], off: u64) -> Result<()> {
        // A bmap with blocks smaller than ALIGN can start a range off the O_DIRECT grid: such
        // a piece goes through the buffered descriptor.
        let direct_len = if !self.is_block {
            data.len()
        } else if off % ALIGN != 0 {
            0
        } else {
            data.len() - data.len() % ALIGN as usize
        };
        self.file
            .write_all_at(&data[..direct_len], off)
            .with_context(|| format!("writing {} at byte {off}", self.path.display()))?;
        if direct_len < data.len() {
            let rest = &data[direct_len..];
            let at = off + direct_len as u64;
            let p = self.path.display().to_string();
            let t = self.tail_fd()?;
            t.write_all_at(rest, at)
                .with_context(|| format!("writing {p} at byte {at}"))?;
            t.sync_data().with_context(|| format!("fsync {p}"))?;
        }
        Ok(())
    }

    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_all()
            .with_context(|| format!("fsync {}", self.path.display()))
    }

    /// Ask the kernel to re-read the partition table (`BLKRRPART`).
    pub fn reread_partitions(&self) -> Result<()> {
        // SAFETY: BLKRRPART takes no argument.
        unsafe { blkrrpart(self.file.as_raw_fd()) }
            .with_context(|| format!("BLKRRPART on {}", self.path.display()))?;
        Ok(())
    }

    /// Test hook: flip one byte at `off` on the target, below the page cache where there is one.
    pub fn corrupt_byte(&mut self, off: u64) -> Result<()> {
        let base = off - off % ALIGN;
        let mut buf = AlignedBuf::new(ALIGN as usize);
        let b = buf.get(ALIGN as usize);
        self.file
            .read_exact_at(b, base)
            .with_context(|| format!("reading {} at {base}", self.path.display()))?;
        b[(off - base) as usize] ^= 0xff;
        self.file
            .write_all_at(b, base)
            .with_context(|| format!("writing {} at {base}", self.path.display()))?;
        self.sync()
    }
}

fn bar(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix:>7} [{bar:40}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} ETA {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(what.to_string());
    pb
}

pub struct WriteReport {
    /// The extents with the sha256 of the bytes that were written (for those written).
    pub written: Vec<Extent>,
    pub bytes: u64,
    pub elapsed: Duration,
}

/// Write `plan` from `src` to `t`. Each extent's sha256 is checked as it is read from the image
/// (a mismatch stops the write: the image or its bmap is wrong). `stop_after` is a test hook
/// that simulates an interrupted write.
pub fn write(
    src: &mut Source,
    t: &mut Target,
    plan: &[Extent],
    stop_after: Option<usize>,
) -> Result<WriteReport> {
    let total: u64 = plan.iter().map(|e| e.end - e.start).sum();
    let pb = bar(total, "write");
    let t0 = Instant::now();
    let mut buf = AlignedBuf::new(CHUNK);
    let mut since_sync = 0u64;
    let mut written = Vec::with_capacity(plan.len());
    let mut bytes = 0u64;
    for (i, e) in plan.iter().enumerate() {
        if stop_after == Some(i) {
            pb.suspend(|| eprintln!("flash: test hook: stopping the write after {i} range(s)"));
            break;
        }
        src.skip_to(e.start)?;
        let mut h = Sha256::new();
        let mut off = e.start;
        while off < e.end {
            let n = ((e.end - off) as usize).min(CHUNK);
            let b = buf.get(n);
            src.read_exact(b)?;
            h.update(&*b);
            t.write_at(b, off)?;
            off += n as u64;
            bytes += n as u64;
            since_sync += n as u64;
            pb.inc(n as u64);
            if since_sync >= SYNC_EVERY {
                t.sync()?;
                since_sync = 0;
            }
        }
        let got: [u8; 32] = h.finalize().into();
        if let Some(want) = e.sha256 {
            if got != want {
                pb.abandon();
                bail!(
                    "{} bytes {}..{} (range {i}) hash to {} but the bmap says {}: the image or \
                     its bmap is damaged; the target is now partly written",
                    src.path.display(),
                    e.start,
                    e.end,
                    hex::encode(got),
                    hex::encode(want)
                );
            }
        }
        written.push(Extent {
            start: e.start,
            end: e.end,
            sha256: Some(got),
        });
    }
    t.sync()?;
    pb.finish_and_clear();
    Ok(WriteReport {
        written,
        bytes,
        elapsed: t0.elapsed(),
    })
}

/// Read `[start, end)` of the target without the page cache and hash it; calls `each` on every
/// chunk (for locating a difference).
fn read_back(
    direct: Option<&File>,
    buffered: &File,
    start: u64,
    end: u64,
    buf: &mut AlignedBuf,
    mut each: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<[u8; 32]> {
    let mut h = Sha256::new();
    let mut off = start;
    while off < end {
        let n = ((end - off) as usize).min(CHUNK);
        let b = buf.get(n);
        let aligned = if off % ALIGN == 0 {
            n - n % ALIGN as usize
        } else {
            0
        };
        match direct {
            Some(d) if aligned > 0 => {
                d.read_exact_at(&mut b[..aligned], off)?;
                buffered.read_exact_at(&mut b[aligned..], off + aligned as u64)?;
            }
            _ => buffered.read_exact_at(b, off)?,
        }
        h.update(&*b);
        each(off, b)?;
        off += n as u64;
    }
    Ok(h.finalize().into())
}

pub struct VerifyReport {
    pub bytes: u64,
    pub elapsed: Duration,
}

/// Re-read every extent of `plan` from the target, bypassing the page cache, and compare with
/// the sha256 the bmap gives (or, without a bmap, the one computed while writing). On a mismatch,
/// the first bad range is reported with its byte offsets and, where the raw image can be re-read,
/// the first differing byte.
pub fn verify(
    target: &Path,
    is_block: bool,
    plan: &[Extent],
    image: &Path,
) -> Result<VerifyReport> {
    let buffered =
        File::open(target).with_context(|| format!("opening {} to verify", target.display()))?;
    let direct = if is_block {
        Some(
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(target)
                .with_context(|| format!("opening {} O_DIRECT to verify", target.display()))?,
        )
    } else {
        None
    };
    // Drop what the cache holds so that reads come from the medium (and, for a device, its
    // buffer cache too: BLKFLSBUF).
    posix_fadvise(
        buffered.as_raw_fd(),
        0,
        0,
        PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .with_context(|| format!("posix_fadvise(DONTNEED) on {}", target.display()))?;
    if is_block {
        // SAFETY: BLKFLSBUF takes no argument.
        unsafe { blkflsbuf(buffered.as_raw_fd()) }
            .with_context(|| format!("BLKFLSBUF on {}", target.display()))?;
    }
    let total: u64 = plan.iter().map(|e| e.end - e.start).sum();
    let pb = bar(total, "verify");
    let t0 = Instant::now();
    let mut buf = AlignedBuf::new(CHUNK);
    let mut bad: Vec<usize> = Vec::new();
    for (i, e) in plan.iter().enumerate() {
        let got = read_back(
            direct.as_ref(),
            &buffered,
            e.start,
            e.end,
            &mut buf,
            |_, _| Ok(()),
        )
        .with_context(|| format!("reading back {} at {}", target.display(), e.start))?;
        pb.inc(e.end - e.start);
        if Some(got) != e.sha256 {
            bad.push(i);
        }
    }
    pb.finish_and_clear();
    let elapsed = t0.elapsed();
    if let Some(&i) = bad.first() {
        let e = &plan[i];
        let first_byte = match first_difference(direct.as_ref(), &buffered, image, e) {
            Ok(Some(off)) => format!("; first differing byte at offset {off}"),
            Ok(None) => String::new(),
            Err(err) => format!("; (could not locate the byte: {err:#})"),
        };
        bail!(
            "verify FAILED: {} of {} ranges differ on {}; the first is range {i}, bytes {}..{} \
             (offset {}){first_byte}",
            bad.len(),
            plan.len(),
            target.display(),
            e.start,
            e.end,
            e.start
        );
    }
    Ok(VerifyReport {
        bytes: total,
        elapsed,
    })
}

/// Where exactly extent `e` differs, by re-reading a raw (uncompressed) image.
fn first_difference(
    direct: Option<&File>,
    buffered: &File,
    image: &Path,
    e: &Extent,
) -> Result<Option<u64>> {
    if compression_of(image) != Compression::None {
        return Ok(None);
    }
    let img = File::open(image)?;
    let mut want = vec![0u8; CHUNK];
    let mut found = None;
    let mut buf = AlignedBuf::new(CHUNK);
    read_back(direct, buffered, e.start, e.end, &mut buf, |off, got| {
        if found.is_none() {
            let w = &mut want[..got.len()];
            img.read_exact_at(w, off)?;
            if let Some(k) = got.iter().zip(w.iter()).position(|(a, b)| a != b) {
                found = Some(off + k as u64);
            }
        }
        Ok(())
    })?;
    Ok(found)
}
