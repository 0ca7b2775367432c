//! The GGUF writer: [`GgufWriter`] collects metadata and tensors, checks them, and writes
//! a version 3 file.

use std::borrow::Cow;
use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path;

use super::reader::tensor_bytes;
use super::types::GgmlType;
use super::value::{Array, Metadata, Value};
use super::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::files::write_output_guarded;
use crate::{Error, Result};

/// The version this writer produces.
pub const WRITE_VERSION: u32 = 3;

/// The longest tensor name ggml accepts, in bytes (its name buffer holds 64 with the NUL).
pub const MAX_TENSOR_NAME: usize = 63;

/// A tensor waiting to be written.
struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Cow<'a, [u8]>,
}

/// Builds a GGUF v3 file from metadata and tensors.
///
/// The data alignment is `general.alignment` when the metadata has it (a `u32` power of
/// two, as llama.cpp requires; [`GgufWriter::set_alignment`] sets it), else 32. Tensors
/// are laid out in the order they were added, each padded to the alignment.
///
/// ```
/// use graft::gguf::{GgmlType, GgufFile, GgufWriter, Value};
/// let mut w = GgufWriter::new();
/// w.metadata_mut().insert("general.architecture", Value::String("llama".into()));
/// let data = [0u8; 16];
/// w.add_tensor("x", &[4], GgmlType::F32, &data[..]).unwrap();
/// let f = GgufFile::from_bytes("mem", w.to_bytes().unwrap()).unwrap();
/// assert_eq!(f.tensor_bytes("x").unwrap(), &data);
/// ```
#[derive(Default)]
pub struct GgufWriter<'a> {
    metadata: Metadata,
    tensors: Vec<PendingTensor<'a>>,
    names: HashSet<String>,
}

impl<'a> GgufWriter<'a> {
    /// A writer with no metadata and no tensors.
    pub fn new() -> GgufWriter<'a> {
        GgufWriter::default()
    }

    /// The metadata to write, to add or change pairs.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Sets `general.alignment` (a `u32`); it must be a non-zero power of two.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        if !alignment.is_power_of_two() {
            return Err(Error::GgufInput {
                field: format!("metadata key '{ALIGNMENT_KEY}'"),
                msg: format!("{alignment} is not a power of two"),
            });
        }
        self.metadata.insert(ALIGNMENT_KEY, Value::U32(alignment));
        Ok(())
    }

    /// Adds a tensor: its name (unique, at most 63 bytes), its dims innermost first (1 to
    /// 4, none zero, the first a multiple of the type's block size) and its bytes, whose
    /// length must be the size those dims and that type give.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<()> {
        let data = data.into();
        let bad = |msg: String| Error::GgufInput {
            field: format!("tensor '{name}'"),
            msg,
        };
        if name.len() > MAX_TENSOR_NAME {
            let n = name.len();
            return Err(bad(format!(
                "name of {n} bytes is longer than {MAX_TENSOR_NAME}"
            )));
        }
        if self.names.contains(name) {
            return Err(bad("duplicate name".to_string()));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
            return Err(bad(format!(
                "dims {dims:?}: 1 to {MAX_DIMS} dims, none zero"
            )));
        }
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        if elements.is_none_or(|e| e > i64::MAX as u64) {
            return Err(bad(format!(
                "dims {dims:?}: the element count overflows i64"
            )));
        }
        let n_bytes = tensor_bytes(dims, ty).map_err(|_| {
            bad(format!(
                "dims {dims:?}: dims[0] is not a multiple of the block size {} of {ty}, or the size overflows",
                ty.block_size()
            ))
        })?;
        if data.len() as u64 != n_bytes {
            let msg = format!("{} bytes given, {ty} {dims:?} takes {n_bytes}", data.len());
            return Err(bad(msg));
        }
        self.names.insert(name.to_string());
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(())
    }

    /// The alignment the file will use, checked.
    fn alignment(&self) -> Result<u64> {
        let bad = |msg: String| Error::GgufInput {
            field: format!("metadata key '{ALIGNMENT_KEY}'"),
            msg,
        };
        match self.metadata.get(ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
            Some(Value::U32(a)) => Err(bad(format!("{a} is not a power of two"))),
            Some(v) => Err(bad(format!("must be a u32, found {}", v.value_type()))),
        }
    }

    /// The whole file in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let alignment = self.alignment()?;
        let mut out = Vec::new();
        self.emit(&mut out, alignment)
            .map_err(|e| Error::io("<memory>", e))?;
        Ok(out)
    }

    /// Writes the file to `path` through [`write_output`](crate::files::write_output): a regular file or a new path is
    /// replaced only once the file is complete; a device or FIFO is written in place.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_file_guarded(path, &[])
    }

    /// [`write_file`](Self::write_file), refusing a `path` that is one of `inputs` (see
    /// [`write_output_guarded`]).
    pub fn write_file_guarded(
        &self,
        path: impl AsRef<Path>,
        inputs: &[std::path::PathBuf],
    ) -> Result<()> {
        let alignment = self.alignment()?;
        write_output_guarded(path.as_ref(), inputs, |w| self.emit(w, alignment))
    }

    /// Header, metadata, tensor infos, padding and data.
    fn emit(&self, w: &mut dyn Write, alignment: u64) -> std::io::Result<()> {
        let mut pos = Counter { inner: w, n: 0 };
        let w = &mut pos;
        w.write_all(MAGIC)?;
        w.write_all(&WRITE_VERSION.to_le_bytes())?;
        put_u64(w, self.tensors.len() as u64)?;
        put_u64(w, self.metadata.len() as u64)?;
        for (key, value) in self.metadata.iter() {
            put_str(w, key)?;
            w.write_all(&value.value_type().id().to_le_bytes())?;
            put_value(w, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(w, &t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for &d in &t.dims {
                put_u64(w, d)?;
            }
            w.write_all(&t.ty.id().to_le_bytes())?;
            put_u64(w, offset)?;
            offset = offset
                .checked_add(padded(t.data.len() as u64, alignment))
                .ok_or_else(|| std::io::Error::other("data section size overflows u64"))?;
        }
        pad(w, alignment)?;
        for t in &self.tensors {
            w.write_all(&t.data)?;
            pad(w, alignment)?;
        }
        w.flush()
    }
}

/// A writer that counts the bytes written, to place padding.
struct Counter<'w> {
    inner: &'w mut dyn Write,
    n: u64,
}

impl Write for Counter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `n` rounded up to a multiple of `alignment` (a power of two), saturating.
fn padded(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment).saturating_mul(alignment)
}

/// Zeros up to the next multiple of `alignment`.
fn pad(w: &mut Counter, alignment: u64) -> std::io::Result<()> {
    let n = padded(w.n, alignment).saturating_sub(w.n);
    std::io::copy(&mut std::io::repeat(0).take(n), w).map(|_| ())
}

fn put_u64(w: &mut dyn Write, v: u64) -> std::io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

fn put_str(w: &mut dyn Write, s: &str) -> std::io::Result<()> {
    put_u64(w, s.len() as u64)?;
    w.write_all(s.as_bytes())
}

/// A value without its type id.
fn put_value(w: &mut dyn Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&x.to_le_bytes()),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => put_str(w, s),
        Value::Array(a) => put_array(w, a),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// An array: element type id, count, elements.
fn put_array(w: &mut dyn Write, a: &Array) -> std::io::Result<()> {
    w.write_all(&a.element_type().id().to_le_bytes())?;
    put_u64(w, a.len() as u64)?;
    match a {
        Array::U8(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::I8(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::U16(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::I16(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::U32(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::I32(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::F32(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::Bool(v) => put_all(w, v, |x| [u8::from(*x)]),
        Array::String(v) => v.iter().try_for_each(|s| put_str(w, s)),
        Array::Array(v) => v.iter().try_for_each(|x| put_array(w, x)),
        Array::U64(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::I64(v) => put_all(w, v, |x| x.to_le_bytes()),
        Array::F64(v) => put_all(w, v, |x| x.to_le_bytes()),
    }
}

/// Fixed-size elements, each turned into its little-endian bytes by `le`.
fn put_all<T, const N: usize>(
    w: &mut dyn Write,
    v: &[T],
    le: impl Fn(&T) -> [u8; N],
) -> std::io::Result<()> {
    v.iter().try_for_each(|x| w.write_all(&le(x)))
}
