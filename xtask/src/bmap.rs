//! bmaptool's block map (`.bmap`, XML format 2.0): which 4 KiB blocks of a sparse raw image hold
//! data, with a sha256 per range and a sha256 of the file itself. Written and read by hand because
//! the one Rust crate for it (`bmap-parser`) only reads, and the format is a dozen lines of XML.
//!
//! Compatibility with bmaptool 3.x (`BmapCreate.py`, `BmapCopy.py`):
//! - `BmapFileChecksum` is the sha256 of the whole file with that field's text set to 64 ASCII
//!   `0`s; a reader finds the first occurrence of the stated checksum and zeroes it to check.
//! - A range's checksum covers its blocks' bytes, the last block cut at `ImageSize`.

use anyhow::{bail, ensure, Context, Result};
use nix::unistd::{lseek, Whence};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::path::Path;

/// The block size we write; bmaptool's default too.
pub const BLOCK_SIZE: u64 = 4096;
const FORMAT_VERSION: &str = "2.0";
const ZERO_CHECKSUM: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Inclusive block range `first..=last` and the sha256 of its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    pub first: u64,
    pub last: u64,
    pub sha256: [u8; 32],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bmap {
    pub image_size: u64,
    pub block_size: u64,
    pub blocks_count: u64,
    pub mapped_blocks: u64,
    pub ranges: Vec<Range>,
}

impl Bmap {
    /// Byte span `[start, end)` of a range in the image (the last block cut at the image size).
    pub fn byte_span(&self, r: &Range) -> (u64, u64) {
        let start = r.first * self.block_size;
        let end = ((r.last + 1) * self.block_size).min(self.image_size);
        (start, end)
    }

    /// Bytes the ranges cover (what a bmap copy writes).
    pub fn mapped_bytes(&self) -> u64 {
        self.ranges
            .iter()
            .map(|r| {
                let (s, e) = self.byte_span(r);
                e - s
            })
            .sum()
    }
}

/// The data extents of `f` as block ranges, from `SEEK_DATA`/`SEEK_HOLE` (what bmaptool's
/// `FilemapSeek` does), merged where they touch.
fn mapped_block_ranges(f: &File, size: u64, path: &Path) -> Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut pos: i64 = 0;
    let size_i = i64::try_from(size).context("image size overflows off_t")?;
    while pos < size_i {
        let data = match lseek(f.as_raw_fd(), pos, Whence::SeekData) {
            Ok(d) => d,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e).with_context(|| format!("SEEK_DATA in {}", path.display())),
        };
        let hole = lseek(f.as_raw_fd(), data, Whence::SeekHole)
            .with_context(|| format!("SEEK_HOLE in {}", path.display()))?
            .min(size_i);
        let first = data as u64 / BLOCK_SIZE;
        let last = (hole as u64).div_ceil(BLOCK_SIZE) - 1;
        match out.last_mut() {
            Some(prev) if first <= prev.1 + 1 => prev.1 = prev.1.max(last),
            _ => out.push((first, last)),
        }
        pos = hole;
    }
    Ok(out)
}

fn sha256_of_span(f: &mut File, start: u64, end: u64, path: &Path) -> Result<[u8; 32]> {
    f.seek(SeekFrom::Start(start))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = end - start;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.read_exact(&mut buf[..n])
            .with_context(|| format!("reading {} at {}", path.display(), end - left))?;
        h.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(h.finalize().into())
}

/// bmaptool's `human_size`, for the comments.
fn human_size(size: u64) -> String {
    if size == 1 {
        return "1 byte".into();
    }
    if size < 512 {
        return format!("{size} bytes");
    }
    let mut s = size as f64;
    for unit in ["KiB", "MiB", "GiB", "TiB"] {
        s /= 1024.0;
        if s < 1024.0 {
            return format!("{s:.1} {unit}");
        }
    }
    format!("{s:.1} EiB")
}

/// The map of `img` (which must be sparse: holes are what is left out).
pub fn scan(img: &Path) -> Result<Bmap> {
    let mut f = File::open(img).with_context(|| format!("opening image {}", img.display()))?;
    let image_size = f
        .metadata()
        .with_context(|| format!("stat {}", img.display()))?
        .len();
    let blocks_count = image_size.div_ceil(BLOCK_SIZE);
    let mut ranges = Vec::new();
    let mut mapped_blocks = 0;
    for (first, last) in mapped_block_ranges(&f, image_size, img)? {
        let start = first * BLOCK_SIZE;
        let end = ((last + 1) * BLOCK_SIZE).min(image_size);
        let sha256 = sha256_of_span(&mut f, start, end, img)?;
        mapped_blocks += last - first + 1;
        ranges.push(Range {
            first,
            last,
            sha256,
        });
    }
    Ok(Bmap {
        image_size,
        block_size: BLOCK_SIZE,
        blocks_count,
        mapped_blocks,
        ranges,
    })
}

/// The `.bmap` text of `b`, with its `BmapFileChecksum` filled in.
pub fn render(b: &Bmap) -> String {
    let mapped_size = b.mapped_blocks * b.block_size;
    let percent = if b.blocks_count == 0 {
        0.0
    } else {
        b.mapped_blocks as f64 * 100.0 / b.blocks_count as f64
    };
    let mut x = String::new();
    x.push_str("<?xml version=\"1.0\" ?>\n");
    x.push_str(
        "<!-- The block map of an image file: the blocks that hold data (partition tables, \
         file-system metadata, files) and must be copied; the others are holes. Written by kiln in \
         bmaptool's format. -->\n\n",
    );
    // `write!` into a String cannot fail.
    let _ = write!(
        x,
        "<bmap version=\"{FORMAT_VERSION}\">\n    <!-- Image size in bytes: {} -->\n    \
         <ImageSize> {} </ImageSize>\n\n    <!-- Size of a block in bytes -->\n    \
         <BlockSize> {} </BlockSize>\n\n    <!-- Count of blocks in the image file -->\n    \
         <BlocksCount> {} </BlocksCount>\n\n    <!-- Count of mapped blocks: {} or {:.1}%   -->\n    \
         <MappedBlocksCount> {} </MappedBlocksCount>\n\n    \
         <!-- Type of checksum used in this file -->\n    <ChecksumType> sha256 </ChecksumType>\n\n    \
         <!-- The checksum of this bmap file. When it is calculated, the value of\n         \
         the checksum has be zero (all ASCII \"0\" symbols).  -->\n    \
         <BmapFileChecksum> {ZERO_CHECKSUM} </BmapFileChecksum>\n\n    \
         <!-- The block map which consists of elements which may either be a\n         \
         range of blocks or a single block. The 'chksum' attribute\n         \
         (if present) is the checksum of this blocks range. -->\n    <BlockMap>\n",
        human_size(b.image_size),
        b.image_size,
        b.block_size,
        b.blocks_count,
        human_size(mapped_size),
        percent,
        b.mapped_blocks,
    );
    for r in &b.ranges {
        let sum = hex::encode(r.sha256);
        if r.first == r.last {
            let _ = writeln!(x, "        <Range chksum=\"{sum}\"> {} </Range>", r.first);
        } else {
            let _ = writeln!(
                x,
                "        <Range chksum=\"{sum}\"> {}-{} </Range>",
                r.first, r.last
            );
        }
    }
    x.push_str("    </BlockMap>\n</bmap>\n");
    let sum = hex::encode(Sha256::digest(x.as_bytes()));
    x.replacen(ZERO_CHECKSUM, &sum, 1)
}

/// Write the `.bmap` of the sparse raw image `img` to `out`.
pub fn create(img: &Path, out: &Path) -> Result<()> {
    let b = scan(img)?;
    crate::atomic::write_atomic(out, render(&b).as_bytes())
        .with_context(|| format!("writing the bmap of {}", img.display()))
}

fn child_text<'a>(root: roxmltree::Node<'a, 'a>, tag: &str) -> Result<&'a str> {
    root.children()
        .find(|n| n.has_tag_name(tag))
        .with_context(|| format!("no <{tag}>"))?
        .text()
        .map(str::trim)
        .with_context(|| format!("<{tag}> is empty"))
}

fn child_u64(root: roxmltree::Node, tag: &str) -> Result<u64> {
    let t = child_text(root, tag)?;
    t.parse()
        .with_context(|| format!("<{tag}> is not a number: {t:?}"))
}

fn parse_sha256(s: &str) -> Result<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).with_context(|| format!("not a sha256: {s:?}"))?;
    Ok(out)
}

/// Parse and check bmap text (version 2.x, sha256): the file checksum, the counts, the ranges
/// (in order, inside the image, each with a checksum).
pub fn parse_str(text: &str) -> Result<Bmap> {
    let doc = roxmltree::Document::parse(text).context("not XML")?;
    let root = doc.root_element();
    ensure!(root.has_tag_name("bmap"), "root element is not <bmap>");
    let version = root.attribute("version").context("<bmap> has no version")?;
    ensure!(
        version.split('.').next() == Some("2"),
        "bmap format version {version} is not supported (only 2.x)"
    );
    let cs_type = child_text(root, "ChecksumType")?;
    ensure!(
        cs_type == "sha256",
        "checksum type {cs_type:?} is not supported (only sha256)"
    );
    let stated = child_text(root, "BmapFileChecksum")?;
    ensure!(
        stated.len() == 64,
        "BmapFileChecksum {stated:?} is not a sha256"
    );
    let zeroed = text.replacen(stated, ZERO_CHECKSUM, 1);
    let actual = hex::encode(Sha256::digest(zeroed.as_bytes()));
    if actual != stated.to_ascii_lowercase() {
        bail!(
            "bmap file checksum mismatch: the file says {stated}, its content hashes to {actual}"
        );
    }
    let image_size = child_u64(root, "ImageSize")?;
    ensure!(
        image_size <= 1 << 60,
        "ImageSize {image_size} is not a disk image size"
    );
    let block_size = child_u64(root, "BlockSize")?;
    ensure!(
        block_size > 0 && block_size % 512 == 0 && block_size <= 1 << 30,
        "block size {block_size} is not a multiple of 512"
    );
    let blocks_count = child_u64(root, "BlocksCount")?;
    ensure!(
        blocks_count == image_size.div_ceil(block_size),
        "BlocksCount {blocks_count} does not match ImageSize {image_size} / BlockSize {block_size}"
    );
    let mapped_blocks = child_u64(root, "MappedBlocksCount")?;
    let map = root
        .children()
        .find(|n| n.has_tag_name("BlockMap"))
        .context("no <BlockMap>")?;
    let mut ranges = Vec::new();
    for n in map.children().filter(|n| n.has_tag_name("Range")) {
        let t = n.text().map(str::trim).unwrap_or("");
        let (a, b) = t.split_once('-').unwrap_or((t, t));
        let first: u64 = a
            .trim()
            .parse()
            .with_context(|| format!("bad range {t:?}"))?;
        let last: u64 = b
            .trim()
            .parse()
            .with_context(|| format!("bad range {t:?}"))?;
        ensure!(first <= last, "range {t:?} is backwards");
        ensure!(
            last < blocks_count,
            "range {t:?} ends past the image ({blocks_count} blocks)"
        );
        if let Some(prev) = ranges.last() {
            let prev: &Range = prev;
            ensure!(
                first > prev.last,
                "range {t:?} overlaps or precedes the one before"
            );
        }
        let sum = n
            .attribute("chksum")
            .with_context(|| format!("range {t:?} has no chksum"))?;
        ranges.push(Range {
            first,
            last,
            sha256: parse_sha256(sum).with_context(|| format!("range {t:?}"))?,
        });
    }
    let counted: u64 = ranges.iter().map(|r| r.last - r.first + 1).sum();
    ensure!(
        counted == mapped_blocks,
        "MappedBlocksCount {mapped_blocks} but the ranges cover {counted} blocks"
    );
    Ok(Bmap {
        image_size,
        block_size,
        blocks_count,
        mapped_blocks,
        ranges,
    })
}

/// Read and check a `.bmap` file.
pub fn parse(path: &Path) -> Result<Bmap> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_str(&text).with_context(|| format!("bmap {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::process::Command;

    struct TempDir(std::path::PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = crate::paths::target_dir()
                .join("kiln/test-tmp")
                .join(format!("bmap-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("creating a test directory under target/");
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A sparse 64 MiB image with data at the start, in the middle (unaligned end), and a
    /// partial last block — 6 extents, one of them two touching writes.
    fn sparse_image(path: &Path, size: u64) {
        let f = File::create(path).expect("create image");
        f.set_len(size).expect("set_len");
        let chunk = |n: usize, seed: u8| -> Vec<u8> {
            (0..n)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect()
        };
        f.write_all_at(&chunk(3 * 4096 + 100, 1), 0).expect("write");
        f.write_all_at(&chunk(70_000, 2), 1 << 20).expect("write");
        f.write_all_at(&chunk(8192, 3), (1 << 20) + 70_000)
            .expect("write");
        f.write_all_at(&chunk(5000, 4), 40 << 20).expect("write");
        f.write_all_at(&chunk(300, 5), size - 300).expect("write");
        f.sync_all().expect("sync");
    }

    fn bmaptool(args: &[&str]) -> std::process::Output {
        Command::new("bmaptool")
            .args(args)
            .output()
            .expect("bmaptool runs (doctor installs bmap-tools)")
    }

    fn ensure_bmaptool() {
        crate::doctor::ensure(&[&crate::doctor::BMAPTOOL]).expect("bmaptool available");
    }

    #[test]
    fn round_trip_and_bmaptool_agrees() {
        ensure_bmaptool();
        let d = TempDir::new("agree");
        let img = d.0.join("a.img");
        // Not a multiple of 4096: the last block is partial.
        let size = (64 << 20) + 1234;
        sparse_image(&img, size);
        let ours = d.0.join("ours.bmap");
        create(&img, &ours).expect("create");
        let b = parse(&ours).expect("parse our own");
        assert_eq!(b.image_size, size);
        assert_eq!(b.blocks_count, size.div_ceil(4096));
        assert!(b.ranges.len() >= 4, "{:?}", b.ranges);
        assert!(b.mapped_bytes() < size / 10);

        // bmaptool's own map of the same image has the same ranges and checksums.
        let theirs = d.0.join("theirs.bmap");
        let out = bmaptool(&[
            "create",
            "-o",
            theirs.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
        ]);
        assert!(out.status.success(), "{out:?}");
        let t = parse(&theirs).expect("we parse bmaptool's bmap");
        assert_eq!(t.ranges, b.ranges);
        assert_eq!(t.mapped_blocks, b.mapped_blocks);
        assert_eq!(t.image_size, b.image_size);

        // bmaptool copies with our map (checking our file and range checksums) and reproduces
        // the image byte for byte.
        let copy = d.0.join("copy.img");
        let out = bmaptool(&[
            "copy",
            "--bmap",
            ours.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
            copy.to_str().expect("utf-8"),
        ]);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            std::fs::read(&copy).expect("read copy"),
            std::fs::read(&img).expect("read image")
        );
    }

    #[test]
    fn corrupted_file_checksum_refused_by_both() {
        ensure_bmaptool();
        let d = TempDir::new("corrupt");
        let img = d.0.join("a.img");
        sparse_image(&img, 48 << 20);
        let good = d.0.join("good.bmap");
        create(&img, &good).expect("create");
        let text = std::fs::read_to_string(&good).expect("read");
        // Flip one digit of the first range's first block number: the XML stays valid.
        let bad_text = text.replacen("> 0-", "> 1-", 1);
        assert_ne!(bad_text, text);
        let bad = d.0.join("bad.bmap");
        std::fs::write(&bad, &bad_text).expect("write");
        let err = parse(&bad).expect_err("we refuse it");
        assert!(format!("{err:#}").contains("checksum mismatch"), "{err:#}");
        let copy = d.0.join("copy.img");
        let out = bmaptool(&[
            "copy",
            "--bmap",
            bad.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
            copy.to_str().expect("utf-8"),
        ]);
        assert!(!out.status.success(), "bmaptool accepted a corrupted bmap");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("checksum mismatch"),
            "{out:?}"
        );
    }

    #[test]
    fn range_checksum_is_checked_by_bmaptool() {
        ensure_bmaptool();
        let d = TempDir::new("range");
        let img = d.0.join("a.img");
        sparse_image(&img, 16 << 20);
        let bm = d.0.join("a.bmap");
        create(&img, &bm).expect("create");
        // Change the image after mapping: bmaptool must see the range no longer matches.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .expect("open");
        f.write_all_at(b"X", 5).expect("write");
        let out = bmaptool(&[
            "copy",
            "--bmap",
            bm.to_str().expect("utf-8"),
            img.to_str().expect("utf-8"),
            d.0.join("c.img").to_str().expect("utf-8"),
        ]);
        assert!(!out.status.success(), "{out:?}");
    }

    #[test]
    fn empty_and_fully_sparse_images() {
        let d = TempDir::new("empty");
        let img = d.0.join("e.img");
        File::create(&img)
            .expect("create")
            .set_len(1 << 20)
            .expect("set_len");
        let bm = d.0.join("e.bmap");
        create(&img, &bm).expect("create");
        let b = parse(&bm).expect("parse");
        assert_eq!(b.mapped_blocks, 0);
        assert!(b.ranges.is_empty());
        assert_eq!(b.blocks_count, 256);
    }

    #[test]
    fn malformed_bmaps_are_refused() {
        assert!(parse_str("not xml").is_err());
        assert!(parse_str("<bmap version=\"1.3\"></bmap>").is_err());
        let b = Bmap {
            image_size: 8192,
            block_size: 4096,
            blocks_count: 2,
            mapped_blocks: 1,
            ranges: vec![Range {
                first: 1,
                last: 1,
                sha256: [7; 32],
            }],
        };
        let good = render(&b);
        assert_eq!(parse_str(&good).expect("parse"), b);
        // A range past the end, rendered with a valid file checksum, is still refused.
        let mut past = b.clone();
        past.ranges[0].first = 2;
        past.ranges[0].last = 2;
        let e = parse_str(&render(&past)).expect_err("past the end");
        assert!(format!("{e:#}").contains("past the image"), "{e:#}");
    }
}
