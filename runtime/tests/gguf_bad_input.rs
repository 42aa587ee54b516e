//! The malformed-GGUF corpus: every case gets its own error variant, at the byte offset where it
//! is found, and `GgufFile::open` reports it in one line naming the file. Plus a property test:
//! mutated valid files never panic and never yield a view outside the file.

mod support;

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::gguf::{ErrorKind, Gguf, GgufFile, ParseError, Value, ValueType};
use kiln_runtime::quant::GgmlType;
use proptest::prelude::*;

/// A hand-built GGUF, recording where each field starts and the parser's name for it.
#[derive(Default, Clone)]
struct Raw {
    buf: Vec<u8>,
    marks: Vec<(usize, &'static str, Expect)>,
}

/// What a cut at the start of a field must report.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Expect {
    Truncated,
    /// Cutting the bytes of a string reports the string's length field: it runs past EOF.
    StringPastEof(&'static str),
}

impl Raw {
    fn mark(&mut self, field: &'static str) {
        self.marks.push((self.buf.len(), field, Expect::Truncated));
    }
    fn bytes(&mut self, field: &'static str, b: &[u8]) -> &mut Self {
        self.mark(field);
        self.buf.extend_from_slice(b);
        self
    }
    fn u32(&mut self, field: &'static str, v: u32) -> &mut Self {
        self.bytes(field, &v.to_le_bytes())
    }
    fn u64(&mut self, field: &'static str, v: u64) -> &mut Self {
        self.bytes(field, &v.to_le_bytes())
    }
    fn str(&mut self, len_field: &'static str, what: &'static str, s: &[u8]) -> &mut Self {
        self.u64(len_field, s.len() as u64);
        if !s.is_empty() {
            self.marks
                .push((self.buf.len(), what, Expect::StringPastEof(what)));
            self.buf.extend_from_slice(s);
        }
        self
    }
    fn header(&mut self, version: u32, tensors: u64, kvs: u64) -> &mut Self {
        self.bytes("magic", b"GGUF")
            .u32("version", version)
            .u64("tensor_count", tensors)
            .u64("kv_count", kvs)
    }
    fn key(&mut self, k: &str, ty: ValueType) -> &mut Self {
        self.str("key length", "key", k.as_bytes())
            .u32("value type", ty.id())
    }
    fn tensor_info(&mut self, name: &[u8], dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str("tensor name length", "tensor name", name)
            .u32("n_dims", dims.len() as u32);
        for d in dims {
            self.u64("dimension", *d);
        }
        self.u32("tensor type", ty).u64("tensor offset", offset)
    }
    /// Zero padding to `align`, then `n` bytes of tensor data.
    fn data(&mut self, align: usize, n: usize) -> &mut Self {
        let padded = self.buf.len().div_ceil(align) * align;
        self.buf.resize(padded + n, 0);
        self
    }
}

fn err(bytes: &[u8]) -> ParseError {
    match Gguf::parse(bytes) {
        Ok(g) => panic!("parsed a bad file: {g:?}"),
        Err(e) => e,
    }
}

fn one_tensor_file(kv: impl Fn(&mut Raw)) -> Raw {
    let mut r = Raw::default();
    r.header(3, 1, 1);
    kv(&mut r);
    r.tensor_info(b"t", &[8], GgmlType::F32.id(), 0);
    r.data(32, 32);
    r
}

/// Writes one metadata pair into a [`Raw`].
type KvWriter = dyn Fn(&mut Raw);

#[test]
fn truncated_at_every_header_field() {
    let kvs: Vec<Box<KvWriter>> = vec![
        Box::new(|r| {
            r.key("k.u32", ValueType::U32).u32("UINT32 value", 7);
        }),
        Box::new(|r| {
            r.key("k.f64", ValueType::F64).u64("FLOAT64 value", 0);
        }),
        Box::new(|r| {
            r.key("k.str", ValueType::String)
                .str("string length", "string value", b"hello");
        }),
        Box::new(|r| {
            r.key("k.arr", ValueType::Array)
                .u32("array element type", ValueType::I16.id())
                .u64("array length", 2)
                .bytes("INT16 value", &[1, 0])
                .bytes("INT16 value", &[2, 0]);
        }),
        Box::new(|r| {
            r.key("k.strs", ValueType::Array)
                .u32("array element type", ValueType::String.id())
                .u64("array length", 1)
                .str("string length", "string value", b"tok");
        }),
    ];
    let mut fields = std::collections::BTreeSet::new();
    for kv in &kvs {
        let r = one_tensor_file(kv);
        Gguf::parse(&r.buf).expect("the uncut file is valid");
        for &(at, field, expect) in &r.marks {
            fields.insert(field);
            let e = err(&r.buf[..at]);
            match expect {
                Expect::Truncated => assert_eq!(
                    e,
                    ParseError {
                        offset: at as u64,
                        kind: ErrorKind::Truncated {
                            field,
                            need: e_need(&e),
                            have: 0
                        }
                    },
                    "cut at {at}, the start of {field}"
                ),
                Expect::StringPastEof(what) => {
                    assert_eq!(e.offset, at as u64 - 8, "cut at {at}, in {what}");
                    assert!(
                        matches!(e.kind, ErrorKind::StringPastEof { what: w, left: 0, .. } if w == what),
                        "cut at {at}: {e}"
                    );
                }
            }
            // One byte into a multi-byte field: still that field, with what is left.
            if expect == Expect::Truncated && e_need(&e) > 1 {
                let e = err(&r.buf[..at + 1]);
                assert!(
                    matches!(e.kind, ErrorKind::Truncated { field: f, have: 1, .. } if f == field),
                    "cut at {}: {e}",
                    at + 1
                );
            }
        }
        // Cut inside the data: the tensor lies past the end.
        let e = err(&r.buf[..r.buf.len() - 1]);
        assert!(matches!(e.kind, ErrorKind::TensorPastEof { .. }), "{e}");
    }
    for f in [
        "magic",
        "version",
        "tensor_count",
        "kv_count",
        "key length",
        "key",
        "value type",
        "UINT32 value",
        "FLOAT64 value",
        "string length",
        "string value",
        "array element type",
        "array length",
        "INT16 value",
        "tensor name length",
        "tensor name",
        "n_dims",
        "dimension",
        "tensor type",
        "tensor offset",
    ] {
        assert!(fields.contains(f), "no cut at {f}");
    }
}

fn e_need(e: &ParseError) -> u64 {
    match e.kind {
        ErrorKind::Truncated { need, .. } => need,
        _ => 0,
    }
}

#[test]
fn bad_magic_v1_big_endian_and_unknown_versions() {
    let mut r = Raw::default();
    r.header(3, 0, 0);
    let mut b = r.buf.clone();
    b[..4].copy_from_slice(b"GGML");
    assert_eq!(err(&b).kind, ErrorKind::BadMagic { found: *b"GGML" });

    let mut v1 = Raw::default();
    // v1 had u32 counts: this is what one looks like.
    v1.bytes("magic", b"GGUF")
        .u32("version", 1)
        .u32("", 0)
        .u32("", 0);
    assert_eq!(
        err(&v1.buf),
        ParseError {
            offset: 4,
            kind: ErrorKind::V1
        }
    );

    let mut be = Raw::default();
    be.bytes("magic", b"GGUF")
        .bytes("version", &3u32.to_be_bytes());
    be.bytes("", &0u64.to_be_bytes())
        .bytes("", &0u64.to_be_bytes());
    assert_eq!(
        err(&be.buf),
        ParseError {
            offset: 4,
            kind: ErrorKind::BigEndian {
                raw: 0x0300_0000,
                swapped: 3
            }
        }
    );
    assert!(err(&be.buf).to_string().contains("big-endian"));

    let mut v4 = Raw::default();
    v4.header(4, 0, 0);
    assert_eq!(err(&v4.buf).kind, ErrorKind::UnsupportedVersion(4));
    // v2 is accepted.
    let mut v2 = Raw::default();
    v2.header(2, 0, 0);
    assert_eq!(Gguf::parse(&v2.buf).unwrap().version, 2);
}

#[test]
fn counts_of_2_pow_63() {
    let mut r = Raw::default();
    r.header(3, 1 << 63, 0).data(32, 64);
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: 8,
            kind: ErrorKind::CountTooLarge {
                what: "tensor",
                count: 1 << 63,
                max: 96 / 24
            }
        }
    );
    let mut r = Raw::default();
    r.header(3, 0, 1 << 63).data(32, 64);
    let e = err(&r.buf);
    assert_eq!(e.offset, 16);
    assert!(
        matches!(e.kind, ErrorKind::CountTooLarge { what: "metadata key-value", count, .. } if count == 1 << 63)
    );

    let mut r = Raw::default();
    r.header(3, 0, 1)
        .key("arr", ValueType::Array)
        .u32("", ValueType::U64.id());
    let count_at = r.buf.len();
    r.u64("", 1 << 63).data(32, 64);
    let e = err(&r.buf);
    assert_eq!(e.offset, count_at as u64);
    assert!(
        matches!(
            e.kind,
            ErrorKind::CountTooLarge {
                what: "array element",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn string_lengths_past_eof() {
    for len in [1u64 << 63, u64::MAX, 100] {
        let mut r = Raw::default();
        r.header(3, 0, 1).u64("", len).bytes("", b"short");
        assert_eq!(
            err(&r.buf),
            ParseError {
                offset: 24,
                kind: ErrorKind::StringPastEof {
                    what: "key",
                    len,
                    left: 5
                }
            }
        );
    }
    let mut r = Raw::default();
    r.header(3, 0, 1).key("s", ValueType::String);
    let at = r.buf.len();
    r.u64("", 1 << 40).bytes("", b"abc");
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: at as u64,
            kind: ErrorKind::StringPastEof {
                what: "string value",
                len: 1 << 40,
                left: 3
            }
        }
    );
}

#[test]
fn tensor_offsets_past_eof() {
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"w", &[8], GgmlType::F32.id(), 1 << 62);
    let offset_at = r.buf.len() - 8;
    r.data(32, 32);
    let e = err(&r.buf);
    assert_eq!(e.offset, offset_at as u64);
    assert!(
        matches!(&e.kind, ErrorKind::TensorPastEof { name, .. } if name == "w"),
        "{e}"
    );
    // An offset whose sum with the data start overflows u64.
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"w", &[8], GgmlType::F32.id(), u64::MAX - 31)
        .data(32, 32);
    assert!(matches!(err(&r.buf).kind, ErrorKind::TensorPastEof { .. }));
    // A shape whose bytes overflow.
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"w", &[1 << 40, 1 << 40], GgmlType::F32.id(), 0)
        .data(32, 32);
    assert!(
        matches!(err(&r.buf).kind, ErrorKind::ShapeOverflow { .. }),
        "{}",
        err(&r.buf)
    );
}

#[test]
fn overlapping_and_misaligned_tensors() {
    let mut r = Raw::default();
    r.header(3, 2, 0)
        .tensor_info(b"a", &[16], GgmlType::F32.id(), 0)
        .tensor_info(b"b", &[8], GgmlType::F32.id(), 32)
        .data(32, 96);
    assert_eq!(
        err(&r.buf).kind,
        ErrorKind::TensorOverlap {
            first: "a".into(),
            first_range: (0, 64),
            second: "b".into(),
            second_start: 32
        }
    );
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"a", &[8], GgmlType::F32.id(), 16)
        .data(32, 64);
    assert_eq!(
        err(&r.buf).kind,
        ErrorKind::MisalignedTensor {
            name: "a".into(),
            offset: 16,
            alignment: 32
        }
    );
    // With a custom alignment of 16 the same offset is fine.
    let mut r = Raw::default();
    r.header(3, 1, 1)
        .key("general.alignment", ValueType::U32)
        .u32("", 16)
        .tensor_info(b"a", &[8], GgmlType::F32.id(), 16)
        .data(16, 64);
    let g = Gguf::parse(&r.buf).unwrap();
    assert_eq!((g.alignment, g.data_offset % 16), (16, 0));
}

#[test]
fn invalid_utf8_names_and_keys() {
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"bad\xff\xfe", &[8], GgmlType::F32.id(), 0)
        .data(32, 32);
    let e = err(&r.buf);
    assert_eq!(e.offset, 32);
    assert!(
        matches!(
            e.kind,
            ErrorKind::InvalidUtf8 {
                what: "tensor name",
                ..
            }
        ),
        "{e}"
    );
    let mut r = Raw::default();
    r.header(3, 0, 1)
        .key("k\u{0}", ValueType::U8)
        .bytes("", &[1]);
    let at = 32;
    r.buf[at + 1] = 0xC0; // an overlong-encoding lead byte followed by nothing valid
    let e = err(&r.buf);
    assert!(
        matches!(e.kind, ErrorKind::InvalidUtf8 { what: "key", .. }),
        "{e}"
    );
    assert_eq!(e.offset, at as u64);
}

#[test]
fn unknown_type_ids() {
    for id in [4u32, 5, 31, 36, 43, 1000, u32::MAX] {
        let mut r = Raw::default();
        r.header(3, 1, 0)
            .tensor_info(b"w", &[32], id, 0)
            .data(32, 128);
        assert_eq!(
            err(&r.buf).kind,
            ErrorKind::UnknownTensorType {
                name: "w".into(),
                id
            },
            "tensor type {id}"
        );
    }
    let mut r = Raw::default();
    r.header(3, 0, 1)
        .str("", "", b"k")
        .u32("", 13)
        .bytes("", &[0; 8]);
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: 33,
            kind: ErrorKind::UnknownValueType {
                key: "k".into(),
                id: 13
            }
        }
    );
    let mut r = Raw::default();
    r.header(3, 0, 1)
        .key("k", ValueType::Array)
        .u32("", 99)
        .u64("", 0);
    assert!(matches!(
        err(&r.buf).kind,
        ErrorKind::UnknownValueType { id: 99, .. }
    ));
}

#[test]
fn nested_arrays() {
    let mut r = Raw::default();
    r.header(3, 0, 1)
        .key("nest", ValueType::Array)
        .u32("", ValueType::Array.id())
        .u64("", 1)
        .u32("", ValueType::U8.id())
        .u64("", 1)
        .bytes("", &[1]);
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: 40,
            kind: ErrorKind::NestedArray { key: "nest".into() }
        }
    );
}

#[test]
fn alignment_must_be_a_u32_power_of_two() {
    for (ty, bytes) in [
        (ValueType::U64, 32u64.to_le_bytes().to_vec()),
        (ValueType::I32, 32i32.to_le_bytes().to_vec()),
        (ValueType::U16, 32u16.to_le_bytes().to_vec()),
    ] {
        let mut r = Raw::default();
        r.header(3, 0, 1)
            .key("general.alignment", ty)
            .bytes("", &bytes);
        assert_eq!(
            err(&r.buf),
            ParseError {
                offset: 49,
                kind: ErrorKind::AlignmentNotU32 { found: ty }
            }
        );
    }
    for a in [0u32, 3, 48] {
        let mut r = Raw::default();
        r.header(3, 0, 1)
            .key("general.alignment", ValueType::U32)
            .u32("", a);
        assert_eq!(err(&r.buf).kind, ErrorKind::AlignmentNotPowerOfTwo(a));
    }
}

#[test]
fn duplicates_empty_keys_and_bad_bools() {
    let mut r = Raw::default();
    r.header(3, 0, 2)
        .key("k", ValueType::U8)
        .bytes("", &[1])
        .key("k", ValueType::U8)
        .bytes("", &[2]);
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: 38,
            kind: ErrorKind::DuplicateKey("k".into())
        }
    );
    let mut r = Raw::default();
    r.header(3, 2, 0)
        .tensor_info(b"w", &[8], GgmlType::F32.id(), 0)
        .tensor_info(b"w", &[8], GgmlType::F32.id(), 32)
        .data(32, 64);
    assert_eq!(err(&r.buf).kind, ErrorKind::DuplicateTensor("w".into()));
    let mut r = Raw::default();
    r.header(3, 0, 1).key("", ValueType::U8).bytes("", &[1]);
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: 24,
            kind: ErrorKind::EmptyKey
        }
    );
    let mut r = Raw::default();
    r.header(3, 0, 1).key("b", ValueType::Bool).bytes("", &[2]);
    assert_eq!(
        err(&r.buf).kind,
        ErrorKind::BadBool {
            key: "b".into(),
            value: 2
        }
    );
}

#[test]
fn tensor_info_limits() {
    let long = vec![b'x'; 64];
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(&long, &[8], GgmlType::F32.id(), 0)
        .data(32, 32);
    assert!(matches!(
        err(&r.buf).kind,
        ErrorKind::NameTooLong { len: 64, .. }
    ));
    // 63 bytes is the limit, and fine.
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(&long[..63], &[8], GgmlType::F32.id(), 0)
        .data(32, 32);
    Gguf::parse(&r.buf).unwrap();

    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"w", &[1, 1, 1, 1, 1], GgmlType::F32.id(), 0)
        .data(32, 32);
    assert_eq!(
        err(&r.buf),
        ParseError {
            offset: 33,
            kind: ErrorKind::TooManyDims {
                name: "w".into(),
                n_dims: 5
            }
        }
    );
}

#[test]
fn ne0_must_be_a_multiple_of_the_block() {
    for (ty, ne0, block) in [
        (GgmlType::Q4_0, 48u64, 32u64),
        (GgmlType::Q4K, 128, 256),
        (GgmlType::Q8_0, 1, 32),
    ] {
        let mut r = Raw::default();
        r.header(3, 1, 0)
            .tensor_info(b"q", &[ne0, 2], ty.id(), 0)
            .data(32, 1024);
        assert_eq!(
            err(&r.buf).kind,
            ErrorKind::RowNotBlockMultiple {
                name: "q".into(),
                ty,
                ne0,
                block
            }
        );
    }
}

#[test]
fn open_reports_one_line_naming_the_file_and_offset() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bad-input");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("misaligned.gguf");
    let mut r = Raw::default();
    r.header(3, 1, 0)
        .tensor_info(b"a", &[8], GgmlType::F32.id(), 16)
        .data(32, 64);
    std::fs::write(&p, &r.buf).unwrap();
    let e = GgufFile::open(&p).unwrap_err();
    let msg = e.to_string();
    assert_eq!(
        msg,
        format!(
            "{}: at byte 49: tensor \"a\": offset 16 is not a multiple of the alignment 32",
            p.display()
        )
    );
    assert!(!msg.contains('\n'));
    // An empty file and a missing one are errors too, not panics.
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = GgufFile::open(&empty).unwrap_err();
    assert!(
        e.to_string().starts_with(&empty.display().to_string()),
        "{e}"
    );
    let e = GgufFile::open(dir.join("missing.gguf")).unwrap_err();
    assert!(e.to_string().contains("missing.gguf"), "{e}");

    // And the CLI prints that one line and exits non-zero.
    let out = support::kiln_cmd().arg("inspect").arg(&p).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("at byte 49"), "{stderr}");
}

/// A valid file with several types, metadata of several kinds and a custom alignment: the seed
/// of the mutation test.
fn seed_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.alignment(64).unwrap();
    w.add("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add("n", Value::U32(30)).unwrap();
    w.add(
        "toks",
        Value::Array(
            ValueType::String,
            vec![Value::String("a".into()), Value::String("bc".into())],
        ),
    )
    .unwrap();
    w.add("f", Value::Array(ValueType::F32, vec![Value::F32(1.0); 3]))
        .unwrap();
    w.tensor_f32("w0", &[8, 2], &[0.5; 16]).unwrap();
    w.tensor("w1", GgmlType::Q8_0, &[32, 2], vec![0u8; 68])
        .unwrap();
    w.tensor("w2", GgmlType::Q4_0, &[64], vec![0u8; 36])
        .unwrap();
    w.to_bytes()
}

fn check_no_oob(bytes: &[u8]) {
    if let Ok(g) = Gguf::parse(bytes) {
        assert!(g.data_offset % g.alignment == 0);
        for t in g.tensor_infos() {
            let v = g
                .view(bytes, t)
                .expect("every tensor of a parsed file has a view");
            assert_eq!(v.data.len() as u64, t.n_bytes);
            let start = v.data.as_ptr() as usize - bytes.as_ptr() as usize;
            assert!(start as u64 >= g.data_offset);
            assert!(start + v.data.len() <= bytes.len());
            // Dequantising a view never panics either.
            let _ = v.to_f32();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic_or_read_out_of_bounds(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
        wide in any::<bool>(),
        wide_val in prop_oneof![Just(u64::MAX), Just(1u64 << 63), Just(0u64), any::<u64>()],
        wide_at in any::<prop::sample::Index>(),
    ) {
        let mut b = seed_file();
        for (i, v) in &edits {
            let i = i.index(b.len());
            b[i] = *v;
        }
        if wide {
            let i = wide_at.index(b.len() - 8);
            b[i..i + 8].copy_from_slice(&wide_val.to_le_bytes());
        }
        if do_cut {
            let n = cut.index(b.len() + 1);
            b.truncate(n);
        }
        check_no_oob(&b);
    }
}

#[test]
fn the_seed_file_is_valid() {
    let b = seed_file();
    let g = Gguf::parse(&b).unwrap();
    assert_eq!(g.tensor_infos().len(), 3);
    check_no_oob(&b);
}
