//! A small GGUF v3 writer for fixtures (tests, the self-check's deterministic model). It lays
//! files out as gguf-py's `GGUFWriter` does: metadata in insertion order, tensor infos, zero
//! padding to the alignment, then each tensor's bytes followed by zero padding to the alignment,
//! offsets sequential.

use super::{Value, ValueType, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_NAME_LEN};
use crate::quant::GgmlType;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashSet;
use std::io::Write as _;
use std::path::Path;

struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes the file in one go.
#[derive(Default)]
pub struct GgufWriter {
    alignment: Option<u32>,
    kvs: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

fn check_value(key: &str, v: &Value, nested: bool) -> Result<()> {
    if let Value::Array(elem, items) = v {
        ensure!(!nested, "{key}: nested arrays are not supported");
        ensure!(
            *elem != ValueType::Array,
            "{key}: nested arrays are not supported"
        );
        for item in items {
            ensure!(
                item.value_type() == *elem,
                "{key}: array of {elem} holds a {}",
                item.value_type()
            );
            check_value(key, item, true)?;
        }
    }
    Ok(())
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Use a custom alignment, written as the `general.alignment` UINT32 key (as gguf-py's
    /// `add_custom_alignment` does).
    pub fn alignment(&mut self, alignment: u32) -> Result<&mut Self> {
        ensure!(
            alignment.is_power_of_two(),
            "alignment {alignment} is not a power of two"
        );
        ensure!(self.alignment.is_none(), "alignment set twice");
        self.add(ALIGNMENT_KEY, Value::U32(alignment))?;
        Ok(self)
    }

    /// Add a metadata pair. Keys are unique; arrays are of one non-array type.
    pub fn add(&mut self, key: impl Into<String>, value: Value) -> Result<&mut Self> {
        let key = key.into();
        ensure!(!key.is_empty(), "empty metadata key");
        ensure!(!self.keys.contains(&key), "duplicate metadata key {key:?}");
        check_value(&key, &value, false)?;
        if key == ALIGNMENT_KEY {
            match value {
                Value::U32(a) if a.is_power_of_two() => self.alignment = Some(a),
                _ => bail!("{ALIGNMENT_KEY} must be a UINT32 power of two, got {value:?}"),
            }
        }
        self.keys.insert(key.clone());
        self.kvs.push((key, value));
        Ok(self)
    }

    /// Add a tensor of type `ty` with shape `dims` (ne0 first) and its raw bytes.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: impl Into<Vec<u8>>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let data = data.into();
        ensure!(
            name.len() <= MAX_NAME_LEN,
            "tensor name {name:?} is longer than {MAX_NAME_LEN} bytes"
        );
        ensure!(
            !self.names.contains(&name),
            "duplicate tensor name {name:?}"
        );
        ensure!(
            (1..=4).contains(&dims.len()),
            "tensor {name:?}: {} dimensions, expected 1 to 4",
            dims.len()
        );
        let want = ty
            .row_bytes(dims[0])
            .and_then(|r| dims[1..].iter().try_fold(r, |acc, &d| acc.checked_mul(d)))
            .with_context(|| {
                format!(
                    "tensor {name:?}: ne0 {} is not a whole number of {ty} blocks",
                    dims[0]
                )
            })?;
        ensure!(
            want == data.len() as u64,
            "tensor {name:?}: {ty} {dims:?} takes {want} bytes, got {}",
            data.len()
        );
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data,
        });
        Ok(self)
    }

    /// Add an F32 tensor from values.
    pub fn tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
    ) -> Result<&mut Self> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, GgmlType::F32, dims, bytes)
    }

    fn align(&self) -> u64 {
        self.alignment.map_or(DEFAULT_ALIGNMENT, u64::from)
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.align();
        let pad = |n: u64| n.div_ceil(align) * align;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += pad(t.data.len() as u64);
        }
        out.resize(pad(out.len() as u64) as usize, 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(pad(out.len() as u64) as usize, 0);
        }
        out
    }

    /// Write the file atomically (a temporary file in the same folder, then a rename).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file_name = path
            .file_name()
            .with_context(|| format!("{} has no file name", path.display()))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(file_name);
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(&self.to_bytes())
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(elem, items) => {
            out.extend_from_slice(&elem.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;

    #[test]
    fn round_trips_through_the_parser() {
        let mut w = GgufWriter::new();
        w.alignment(64).unwrap();
        w.add("a.u8", Value::U8(7)).unwrap();
        w.add(
            "a.strs",
            Value::Array(
                ValueType::String,
                vec![Value::String("x".into()), Value::String("yz".into())],
            ),
        )
        .unwrap();
        w.tensor_f32("t0", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        w.tensor("t1", GgmlType::Q8_0, &[32], vec![0u8; 34])
            .unwrap();
        let bytes = w.to_bytes();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_offset % 64, 0);
        assert_eq!(g.get("a.u8"), Some(&Value::U8(7)));
        let t1 = g.tensor_info("t1").unwrap();
        assert_eq!((t1.offset, t1.n_bytes), (64, 34));
        assert_eq!(bytes.len() as u64, g.data_offset + 128);
        let v = g.view(&bytes, g.tensor_info("t0").unwrap()).unwrap();
        assert_eq!(&v.data[4..8], &2.0f32.to_le_bytes());
    }

    #[test]
    fn refuses_what_the_parser_would_reject() {
        let mut w = GgufWriter::new();
        assert!(w.add("", Value::U8(0)).is_err());
        w.add("k", Value::U8(0)).unwrap();
        assert!(w.add("k", Value::U8(1)).is_err());
        assert!(w
            .add("m", Value::Array(ValueType::U8, vec![Value::I8(1)]))
            .is_err());
        assert!(w.add(ALIGNMENT_KEY, Value::U64(32)).is_err());
        assert!(w.tensor("q", GgmlType::Q4_0, &[16], vec![0; 9]).is_err());
        assert!(w.tensor("f", GgmlType::F32, &[2], vec![0; 4]).is_err());
        assert!(w
            .tensor("x".repeat(64), GgmlType::F32, &[1], vec![0; 4])
            .is_err());
    }
}
