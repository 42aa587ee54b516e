//! GGUF v2/v3 (little-endian): a parser over a byte slice ([`Gguf::parse`]) and a file type that
//! owns the `memmap2` mapping and hands out tensor views borrowing it ([`GgufFile`]).
//!
//! Opening reads only the header; no tensor byte is read or copied. Every tensor is a
//! [`TensorView`] whose `data` is a slice of the mapping, and the ownership ledger records it as
//! borrowed.

mod error;
pub mod fault;
mod parse;
mod value;
pub mod writer;

pub use error::{ErrorKind, OpenError, ParseError};
pub use parse::{ALIGNMENT_KEY, MAGIC};
pub use value::{Value, ValueType};

use crate::backend::Weight;
use crate::quant::{dequantize_row, GgmlType, QuantError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The alignment of the data section and of each tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// `GGML_MAX_NAME` (64) less the terminating NUL.
pub const MAX_NAME_LEN: usize = 63;
/// The backend that owns every weight until the matmul backends claim theirs.
pub const DEFAULT_OWNER: &str = "CPU";

/// One tensor info from the header, checked: known type, whole blocks per row, aligned, inside
/// the file and overlapping no other tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ne0 (row length, fastest-varying) … ne3; dimensions past `n_dims` are 1.
    pub ne: [u64; 4],
    pub n_dims: u32,
    /// Offset of the tensor's bytes from the start of the data section.
    pub offset: u64,
    pub n_bytes: u64,
    /// Where the tensor info starts in the file (for error messages).
    pub info_offset: u64,
    offset_field_at: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// The shape as written, `n_dims` long.
    pub fn dims(&self) -> &[u64] {
        &self.ne[..self.n_dims as usize]
    }
}

/// A parsed GGUF header. It owns the metadata and tensor infos and borrows nothing; tensor
/// bytes are reached through [`Gguf::view`] with the buffer it was parsed from.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub alignment: u64,
    /// Where the data section starts: the end of the tensor infos rounded up to the alignment.
    pub data_offset: u64,
    pub file_len: u64,
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl Gguf {
    /// Parse and validate the header of a GGUF file held in `buf`.
    pub fn parse(buf: &[u8]) -> Result<Gguf, ParseError> {
        parse::parse(buf)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> impl ExactSizeIterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Tensor infos in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// An integer hparam at any width, range-checked into `T`. `Ok(None)` if the key is absent.
    pub fn get_int<T: TryFrom<i128>>(&self, key: &str) -> Result<Option<T>, String> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.to_int::<T>() {
            None => Err(format!("{key} is {}, not an integer", v.value_type())),
            Some(Err(i)) => Err(format!(
                "{key} = {i} is out of range for {}",
                std::any::type_name::<T>()
            )),
            Some(Ok(t)) => Ok(Some(t)),
        }
    }

    /// The view of `info` into `buf`, the buffer this header was parsed from; `None` if `buf`
    /// is shorter than the file the header describes.
    pub fn view<'a>(&self, buf: &'a [u8], info: &'a TensorInfo) -> Option<TensorView<'a>> {
        // parse() checked data_offset + offset + n_bytes <= file_len, so these do not overflow.
        let start = usize::try_from(self.data_offset + info.offset).ok()?;
        let end = start.checked_add(usize::try_from(info.n_bytes).ok()?)?;
        Some(TensorView {
            name: &info.name,
            ty: info.ty,
            ne: info.ne,
            n_dims: info.n_dims,
            offset: info.offset,
            data: buf.get(start..end)?,
        })
    }

    /// (type, tensors, bytes) per ggml type, by type id.
    pub fn totals_by_type(&self) -> Vec<(GgmlType, usize, u64)> {
        let mut m: std::collections::BTreeMap<GgmlType, (usize, u64)> = Default::default();
        for t in &self.tensors {
            let e = m.entry(t.ty).or_default();
            e.0 += 1;
            e.1 += t.n_bytes;
        }
        m.into_iter().map(|(t, (n, b))| (t, n, b)).collect()
    }
}

/// A tensor as a view into the mapping: no byte is copied.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub ne: [u64; 4],
    pub n_dims: u32,
    /// Offset of `data` from the start of the data section.
    pub offset: u64,
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Dequantise the whole tensor to f32 (ne0 fastest) with the scalar reference code.
    pub fn to_f32(&self) -> Result<Vec<f32>, QuantError> {
        let n = usize::try_from(self.n_elements()).map_err(|_| QuantError::PartialBlock {
            ty: self.ty,
            elems: usize::MAX,
            block: self.ty.block_elems(),
        })?;
        let mut out = vec![0f32; n];
        dequantize_row(self.ty, self.data, &mut out)?;
        Ok(out)
    }

    /// The tensor as a matmul weight (`k = ne0`, `n = ne1`), if it is 2-D.
    pub fn as_weight(&self) -> Option<Weight<'a>> {
        if self.n_dims != 2 {
            return None;
        }
        Some(Weight {
            name: self.name,
            ty: self.ty,
            k: usize::try_from(self.ne[0]).ok()?,
            n: usize::try_from(self.ne[1]).ok()?,
            data: self.data,
        })
    }
}

/// A GGUF file mapped read-only; tensor views borrow the mapping.
pub struct GgufFile {
    path: PathBuf,
    /// Read errors inside the mapping (SIGBUS), caught and named ([`fault`]). Before `map`: it
    /// stops watching before the mapping goes.
    fault: fault::FaultGuard,
    map: memmap2::Mmap,
    gguf: Gguf,
    /// Keeps the mapping's address range known to the ownership ledger while it lives.
    _registered: crate::ledger::MappingGuard,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Map `path` and parse its header. Only the header pages are touched.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, OpenError> {
        let path = path.as_ref().to_path_buf();
        let io = |error| OpenError::Io {
            path: path.clone(),
            error,
        };
        let file = std::fs::File::open(&path).map_err(io)?;
        if !file.metadata().map_err(io)?.is_file() {
            return Err(io(std::io::Error::other("not a regular file")));
        }
        // SAFETY: the mapping is read-only and kiln's model files are not modified while a model
        // is loaded (they live on a read-only erofs partition on the board). A file truncated
        // under us would fault on access, as it would for llama.cpp.
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io)?;
        // Before the header is read: its pages can fault too.
        let fault = fault::watch(&map, &path);
        let gguf = match Gguf::parse(&map) {
            Ok(g) => g,
            // A header page that could not be read parses as zeros: say so, not "bad magic".
            Err(_) if fault.faults().is_some() => {
                let e = fault.error(&path).unwrap_or_default();
                return Err(io(std::io::Error::other(e)));
            }
            Err(error) => {
                return Err(OpenError::Parse {
                    path: path.clone(),
                    error,
                })
            }
        };
        let _registered = crate::ledger::register_mapping(&map, &path);
        Ok(GgufFile {
            path,
            map,
            gguf,
            _registered,
            fault,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pages of the file that could not be read since it was opened (the self-check recovers
    /// from them, [`fault::set_recover`]), as an error naming the file and the first offset.
    pub fn io_error(&self) -> Option<String> {
        self.fault.error(&self.path)
    }

    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// The whole mapping.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.gguf.get(key)
    }

    /// Views of every tensor, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> + '_ {
        // Every view exists: the header was parsed from this very mapping.
        self.gguf
            .tensor_infos()
            .iter()
            .filter_map(|t| self.gguf.view(&self.map, t))
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.gguf.tensor_info(name)?;
        self.gguf.view(&self.map, info)
    }
}

#[cfg(test)]
mod tests {
    use super::writer::GgufWriter;
    use super::*;

    fn file() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.add("n.u32", Value::U32(300)).unwrap();
        w.add("n.neg", Value::I32(-1)).unwrap();
        w.add("f", Value::F32(0.5)).unwrap();
        w.tensor_f32("vec", &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        w.tensor_f32("mat", &[2, 3], &[0.0; 6]).unwrap();
        w.tensor_f32("cube", &[1, 1, 2], &[0.0; 2]).unwrap();
        w.to_bytes()
    }

    #[test]
    fn hparams_are_read_at_any_width_and_range_checked() {
        let b = file();
        let g = Gguf::parse(&b).unwrap();
        assert_eq!(g.get_int::<u64>("n.u32"), Ok(Some(300)));
        assert_eq!(g.get_int::<u16>("n.u32"), Ok(Some(300)));
        assert!(g
            .get_int::<u8>("n.u32")
            .unwrap_err()
            .contains("out of range"));
        assert!(g.get_int::<u32>("n.neg").is_err());
        assert_eq!(g.get_int::<i64>("n.neg"), Ok(Some(-1)));
        assert!(g
            .get_int::<u32>("f")
            .unwrap_err()
            .contains("not an integer"));
        assert_eq!(g.get_int::<u32>("absent"), Ok(None));
    }

    #[test]
    fn only_2d_tensors_are_weights_and_views_borrow_the_buffer() {
        let b = file();
        let g = Gguf::parse(&b).unwrap();
        let view = |n| g.view(&b, g.tensor_info(n).unwrap()).unwrap();
        let w = view("mat").as_weight().unwrap();
        assert_eq!((w.k, w.n, w.ty, w.data.len()), (2, 3, GgmlType::F32, 24));
        assert!(view("vec").as_weight().is_none());
        assert!(view("cube").as_weight().is_none());
        let v = view("vec");
        let start = v.data.as_ptr() as usize - b.as_ptr() as usize;
        assert_eq!(start as u64, g.data_offset + v.offset);
        assert_eq!(v.to_f32().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        // A buffer shorter than the file the header describes gives no view.
        let cube = g.tensor_info("cube").unwrap();
        let end = (g.data_offset + cube.offset + cube.n_bytes) as usize;
        assert!(g.view(&b[..end], cube).is_some());
        assert!(g.view(&b[..end - 1], cube).is_none());
    }
}
