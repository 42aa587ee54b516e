//! What can be wrong with a GGUF file: one variant per case, each with the byte offset where the
//! parser found it (in [`ParseError`]).

use super::ValueType;
use crate::quant::GgmlType;
use std::path::PathBuf;

/// A malformed file: where (byte offset into the file) and what.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("at byte {offset}: {kind}")]
pub struct ParseError {
    pub offset: u64,
    pub kind: ErrorKind,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ErrorKind {
    #[error("truncated: {field} needs {need} bytes, {have} left in the file")]
    Truncated {
        field: &'static str,
        need: u64,
        have: u64,
    },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("big-endian GGUF (version reads as {raw:#010x}, i.e. v{swapped} byte-swapped); only little-endian files are supported")]
    BigEndian { raw: u32, swapped: u32 },
    #[error("GGUF v1 is not supported (32-bit counts); convert the file to v3")]
    V1,
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("{what} count {count} cannot fit in the file (at most {max})")]
    CountTooLarge {
        what: &'static str,
        count: u64,
        max: u64,
    },
    #[error("{what} length {len} runs past the end of the file ({left} bytes left)")]
    StringPastEof {
        what: &'static str,
        len: u64,
        left: u64,
    },
    #[error("{what} is not valid UTF-8 ({bytes_hex})")]
    InvalidUtf8 {
        what: &'static str,
        bytes_hex: String,
    },
    #[error("empty metadata key")]
    EmptyKey,
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("unknown metadata value type id {id} for key {key:?}")]
    UnknownValueType { key: String, id: u32 },
    #[error("nested array in key {key:?} (arrays of arrays are not supported, as in llama.cpp)")]
    NestedArray { key: String },
    #[error("bool value {value} for key {key:?} is neither 0 nor 1")]
    BadBool { key: String, value: u8 },
    #[error("general.alignment must be UINT32, found {found}")]
    AlignmentNotU32 { found: ValueType },
    #[error("general.alignment {0} is not a non-zero power of two")]
    AlignmentNotPowerOfTwo(u32),
    #[error("tensor name {name:?} is {len} bytes, longer than 63")]
    NameTooLong { name: String, len: u64 },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {name:?} has {n_dims} dimensions, at most 4 are allowed")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor {name:?} has unknown ggml type id {id}")]
    UnknownTensorType { name: String, id: u32 },
    #[error("tensor {name:?}: ne0 = {ne0} is not a multiple of {ty}'s block of {block}")]
    RowNotBlockMultiple {
        name: String,
        ty: GgmlType,
        ne0: u64,
        block: u64,
    },
    #[error("tensor {name:?}: shape {ne:?} overflows its byte size")]
    ShapeOverflow { name: String, ne: [u64; 4] },
    #[error("tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {name:?}: bytes {start}..{end} lie past the end of the file ({file_len} bytes)"
    )]
    TensorPastEof {
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("tensors {first:?} (data bytes {first_range:?}) and {second:?} (from {second_start}) overlap")]
    TensorOverlap {
        first: String,
        first_range: (u64, u64),
        second: String,
        second_start: u64,
    },
}

/// Why [`super::GgufFile::open`] failed: one line naming the file (and, for a malformed file, the
/// byte offset and what was wrong).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Parse { path: PathBuf, source: ParseError },
}

impl OpenError {
    /// The parse error, if the file was read but malformed.
    pub fn parse_error(&self) -> Option<&ParseError> {
        match self {
            OpenError::Parse { source, .. } => Some(source),
            OpenError::Io { .. } => None,
        }
    }
}
