//! The GGUF header parser over a byte slice. It reads the header only (magic to the end of the
//! tensor infos); tensor bytes are checked for bounds against the slice length, never read.
//!
//! Written by hand rather than with a GGUF crate: the ones on crates.io either copy tensor data
//! (candle), accept only v3 (ggus), or stop at the first problem without the offset and the
//! specific error per case that kiln reports.

use super::error::{ErrorKind, ParseError};
use super::{Gguf, TensorInfo, Value, ValueType, DEFAULT_ALIGNMENT, MAX_NAME_LEN};
use crate::quant::GgmlType;
use std::collections::HashMap;

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Fewest bytes of one KV pair (empty key length, type, one-byte value) and of one tensor info
/// (name length, n_dims, type, offset): bound the counts before anything is allocated.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn err(&self, at: usize, kind: ErrorKind) -> ParseError {
        ParseError {
            offset: at as u64,
            kind,
        }
    }

    fn take(&mut self, n: u64, field: &'static str) -> Result<&'a [u8], ParseError> {
        let have = self.left();
        if n > have {
            return Err(self.err(
                self.pos,
                ErrorKind::Truncated {
                    field,
                    need: n,
                    have,
                },
            ));
        }
        // n <= have <= usize::MAX here.
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ParseError> {
        let s = self.take(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, ParseError> {
        self.array(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, ParseError> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A GGUF string: u64 length, then UTF-8 bytes. Returns the start offset with the text.
    fn string(
        &mut self,
        len_field: &'static str,
        what: &'static str,
    ) -> Result<(usize, &'a str), ParseError> {
        let at = self.pos;
        let len = self.u64(len_field)?;
        let left = self.left();
        if len > left {
            return Err(self.err(at, ErrorKind::StringPastEof { what, len, left }));
        }
        let bytes_at = self.pos;
        let bytes = self.take(len, what)?;
        let s = std::str::from_utf8(bytes).map_err(|_| {
            let hex: String = bytes.iter().take(64).map(|b| format!("{b:02x}")).collect();
            self.err(
                bytes_at,
                ErrorKind::InvalidUtf8 {
                    what,
                    bytes_hex: hex,
                },
            )
        })?;
        Ok((at, s))
    }

    /// Bound a count read from the file: more items of at least `min` bytes than the whole file
    /// could hold is an error; otherwise the capacity to reserve, capped by the bytes left, so
    /// no allocation exceeds what the file can back. (A count that fits the file but not what is
    /// left of it is reported as truncation by the read that runs out.)
    fn bound_count(
        &self,
        at: usize,
        what: &'static str,
        count: u64,
        min: u64,
    ) -> Result<usize, ParseError> {
        let max = self.buf.len() as u64 / min;
        if count > max {
            return Err(self.err(at, ErrorKind::CountTooLarge { what, count, max }));
        }
        // Both are at most the file length, which fits in usize.
        Ok(count.min(self.left() / min) as usize)
    }

    fn value(&mut self, ty: ValueType, key: &str) -> Result<Value, ParseError> {
        let at = self.pos;
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>("UINT8 value")?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("INT8 value")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("UINT16 value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("INT16 value")?)),
            ValueType::U32 => Value::U32(self.u32("UINT32 value")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("INT32 value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("FLOAT32 value")?)),
            ValueType::U64 => Value::U64(self.u64("UINT64 value")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("INT64 value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("FLOAT64 value")?)),
            ValueType::Bool => match self.array::<1>("BOOL value")?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                value => {
                    return Err(self.err(
                        at,
                        ErrorKind::BadBool {
                            key: key.to_string(),
                            value,
                        },
                    ))
                }
            },
            ValueType::String => {
                Value::String(self.string("string length", "string value")?.1.to_string())
            }
            ValueType::Array => {
                let id = self.u32("array element type")?;
                let elem = ValueType::from_id(id).ok_or_else(|| {
                    self.err(
                        at,
                        ErrorKind::UnknownValueType {
                            key: key.to_string(),
                            id,
                        },
                    )
                })?;
                if elem == ValueType::Array {
                    return Err(self.err(
                        at,
                        ErrorKind::NestedArray {
                            key: key.to_string(),
                        },
                    ));
                }
                let count_at = self.pos;
                let count = self.u64("array length")?;
                let cap = self.bound_count(count_at, "array element", count, elem.min_size())?;
                let mut items = Vec::with_capacity(cap);
                for _ in 0..count {
                    items.push(self.value(elem, key)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

pub(super) fn parse(buf: &[u8]) -> Result<Gguf, ParseError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(c.err(0, ErrorKind::BadMagic { found: magic }));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err(c.err(4, ErrorKind::V1)),
        // A byte-swapped version has its low 16 bits zero (how gguf.cpp and gguf-py detect BE).
        v if v & 0xFFFF == 0 && v != 0 => {
            return Err(c.err(
                4,
                ErrorKind::BigEndian {
                    raw: v,
                    swapped: v.swap_bytes(),
                },
            ))
        }
        v => return Err(c.err(4, ErrorKind::UnsupportedVersion(v))),
    }
    let tensor_count = c.u64("tensor_count")?;
    let kv_count = c.u64("kv_count")?;
    let tensor_cap = c.bound_count(8, "tensor", tensor_count, MIN_TENSOR_INFO_BYTES)?;
    let kv_cap = c.bound_count(16, "metadata key-value", kv_count, MIN_KV_BYTES)?;

    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(kv_cap);
    let mut index: HashMap<String, usize> = HashMap::with_capacity(kv_cap);
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..kv_count {
        let (key_at, key) = c.string("key length", "key")?;
        if key.is_empty() {
            return Err(c.err(key_at, ErrorKind::EmptyKey));
        }
        if index.contains_key(key) {
            return Err(c.err(key_at, ErrorKind::DuplicateKey(key.to_string())));
        }
        let type_at = c.pos;
        let id = c.u32("value type")?;
        let ty = ValueType::from_id(id).ok_or_else(|| {
            c.err(
                type_at,
                ErrorKind::UnknownValueType {
                    key: key.to_string(),
                    id,
                },
            )
        })?;
        let value = c.value(ty, key)?;
        if key == ALIGNMENT_KEY {
            match value {
                Value::U32(a) if a.is_power_of_two() => alignment = u64::from(a),
                Value::U32(a) => return Err(c.err(type_at, ErrorKind::AlignmentNotPowerOfTwo(a))),
                ref other => {
                    return Err(c.err(
                        type_at,
                        ErrorKind::AlignmentNotU32 {
                            found: other.value_type(),
                        },
                    ))
                }
            }
        }
        index.insert(key.to_string(), metadata.len());
        metadata.push((key.to_string(), value));
    }

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(tensor_cap);
    let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(tensor_cap);
    for _ in 0..tensor_count {
        let (info_at, name) = c.string("tensor name length", "tensor name")?;
        if name.len() > MAX_NAME_LEN {
            return Err(c.err(
                info_at,
                ErrorKind::NameTooLong {
                    name: name.to_string(),
                    len: name.len() as u64,
                },
            ));
        }
        if tensor_index.contains_key(name) {
            return Err(c.err(info_at, ErrorKind::DuplicateTensor(name.to_string())));
        }
        let dims_at = c.pos;
        let n_dims = c.u32("n_dims")?;
        if n_dims > 4 {
            return Err(c.err(
                dims_at,
                ErrorKind::TooManyDims {
                    name: name.to_string(),
                    n_dims,
                },
            ));
        }
        let mut ne = [1u64; 4];
        for d in ne.iter_mut().take(n_dims as usize) {
            *d = c.u64("dimension")?;
        }
        let type_at = c.pos;
        let id = c.u32("tensor type")?;
        let ty = GgmlType::from_id(id).ok_or_else(|| {
            c.err(
                type_at,
                ErrorKind::UnknownTensorType {
                    name: name.to_string(),
                    id,
                },
            )
        })?;
        let offset_at = c.pos;
        let offset = c.u64("tensor offset")?;

        let block = ty.block_elems() as u64;
        if ne[0] % block != 0 {
            return Err(c.err(
                dims_at,
                ErrorKind::RowNotBlockMultiple {
                    name: name.to_string(),
                    ty,
                    ne0: ne[0],
                    block,
                },
            ));
        }
        let n_bytes = ty
            .row_bytes(ne[0])
            .and_then(|r| r.checked_mul(ne[1]))
            .and_then(|r| r.checked_mul(ne[2]))
            .and_then(|r| r.checked_mul(ne[3]))
            // ggml keeps element counts in int64_t.
            .filter(|_| {
                ne.iter()
                    .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                    .is_some_and(|n| n <= i64::MAX as u64)
            })
            .ok_or_else(|| {
                c.err(
                    dims_at,
                    ErrorKind::ShapeOverflow {
                        name: name.to_string(),
                        ne,
                    },
                )
            })?;
        tensor_index.insert(name.to_string(), tensors.len());
        tensors.push(TensorInfo {
            name: name.to_string(),
            ty,
            ne,
            n_dims,
            offset,
            n_bytes,
            info_offset: info_at as u64,
            offset_field_at: offset_at as u64,
        });
    }

    let file_len = buf.len() as u64;
    let info_end = c.pos as u64;
    // info_end <= file_len and alignment <= 2^31: no overflow.
    let data_offset = info_end.div_ceil(alignment) * alignment;

    for t in &tensors {
        let at = t.offset_field_at as usize;
        if t.offset % alignment != 0 {
            return Err(c.err(
                at,
                ErrorKind::MisalignedTensor {
                    name: t.name.clone(),
                    offset: t.offset,
                    alignment,
                },
            ));
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        match (start, end) {
            (Some(_), Some(end)) if end <= file_len => {}
            _ => {
                return Err(c.err(
                    at,
                    ErrorKind::TensorPastEof {
                        name: t.name.clone(),
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        file_len,
                    },
                ))
            }
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Both lie inside the file, so these sums do not overflow.
        if a.offset + a.n_bytes > b.offset {
            return Err(c.err(
                b.offset_field_at as usize,
                ErrorKind::TensorOverlap {
                    first: a.name.clone(),
                    first_range: (a.offset, a.offset + a.n_bytes),
                    second: b.name.clone(),
                    second_start: b.offset,
                },
            ));
        }
    }

    Ok(Gguf {
        version,
        alignment,
        data_offset,
        file_len,
        metadata,
        index,
        tensors,
        tensor_index,
    })
}
