//! The GGUF reader: [`GgufFile::open`] maps a file, checks every field against the bytes
//! that are there, and gives the metadata, the tensor infos and each tensor's bytes.

use std::collections::HashMap;
use std::path::Path;

use memmap2::Mmap;

use super::types::GgmlType;
use super::value::{Array, Metadata, Value, ValueType};
use super::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::files::open_regular;
use crate::{Error, Result};

/// How deep arrays of arrays may nest (each level costs only 12 bytes of file, so the
/// limit keeps a crafted file from exhausting the stack).
const MAX_ARRAY_DEPTH: usize = 32;

/// The most elements reserved up front for an array, whatever its count says; a longer
/// array grows as its elements are actually read.
const PREALLOC_MAX: usize = 1 << 12;

/// The fewest bytes one tensor info takes: name length, n_dims, type and offset.
const MIN_TENSOR_INFO: usize = 8 + 4 + 4 + 8;

/// The fewest bytes one metadata pair takes: key length, type and a one-byte value.
const MIN_KV: usize = 8 + 4 + 1;

/// One tensor of a GGUF file, as described by its tensor info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// The dimensions, innermost first (ggml's `ne`): 1 to 4 of them, none zero.
    pub dims: Vec<u64>,
    /// The element type.
    pub ty: GgmlType,
    /// The byte offset of the data from the start of the data section.
    pub offset: u64,
    /// The byte size of the data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The number of elements (the product of the dimensions; it fits an `i64`).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The bytes of a file: mapped, or owned (an empty file, or bytes given by the caller).
enum Storage {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Map(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A GGUF file whose header, metadata and tensor infos have been read and checked.
///
/// Opening checks that every tensor's data lies inside the file, aligned, without
/// overlapping another's, so [`GgufFile::tensor_bytes`] only slices.
pub struct GgufFile {
    path: String,
    storage: Storage,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

/// What the parse of a file's bytes gives.
struct Parsed {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl GgufFile {
    /// Opens and checks the GGUF file at `path` (memory-mapped). Only regular files are
    /// opened: a directory, FIFO or device is an error.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = open_regular(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this value; its bytes are only
            // read through bounds-checked slices. As with any file map, another process
            // truncating or rewriting the file while it is open is outside what graft can
            // guard against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            Storage::Map(map)
        };
        GgufFile::with_storage(path.display().to_string(), storage)
    }

    /// Reads GGUF bytes held in memory; `name` stands for the path in error messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::with_storage(name.to_string(), Storage::Owned(bytes))
    }

    fn with_storage(path: String, storage: Storage) -> Result<GgufFile> {
        let p = Parser {
            path: &path,
            buf: storage.bytes(),
            pos: 0,
            alignment_at: 0,
        }
        .parse()?;
        Ok(GgufFile {
            path,
            storage,
            version: p.version,
            metadata: p.metadata,
            tensors: p.tensors,
            by_name: p.by_name,
            alignment: p.alignment,
            data_start: p.data_start,
        })
    }

    /// The path the file was opened from (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The metadata, in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of the tensor called `name`, if there is one.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The data alignment (`general.alignment`, 32 by default).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The byte offset in the file where the data section starts.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// The bytes of the tensor called `name`, borrowed from the file.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor(name).ok_or_else(|| Error::GgufInput {
            field: format!("tensor '{name}'"),
            msg: format!("not in {}", self.path),
        })?;
        let start = self.data_start.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(info.n_bytes));
        let range = start
            .zip(end)
            .and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?));
        range
            .and_then(|r| self.storage.bytes().get(r))
            .ok_or_else(|| Error::Gguf {
                path: self.path.clone(),
                field: format!("tensor '{name}' offset"),
                offset: self.data_start,
                msg: "data range is outside the file".to_string(),
            })
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .finish()
    }
}

/// A cursor over the file's bytes that turns every short read into an error naming the
/// field and its offset.
struct Parser<'a> {
    path: &'a str,
    buf: &'a [u8],
    pos: usize,
    /// Where the value of `general.alignment` starts, for its error.
    alignment_at: usize,
}

/// A field name, built only when an error needs it.
type Field<'f> = &'f dyn Fn() -> String;

impl<'a> Parser<'a> {
    fn err(&self, field: String, offset: usize, msg: String) -> Error {
        Error::Gguf {
            path: self.path.to_string(),
            field,
            offset: offset as u64,
            msg,
        }
    }

    fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// The next `n` bytes.
    fn take(&mut self, n: usize, field: Field) -> Result<&'a [u8]> {
        let at = self.pos;
        let bytes = at
            .checked_add(n)
            .and_then(|end| self.buf.get(at..end))
            .ok_or_else(|| {
                let msg = format!("truncated: needs {n} bytes, {} left", self.left());
                self.err(field(), at, msg)
            })?;
        self.pos = at + n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, field: Field) -> Result<[u8; N]> {
        let at = self.pos;
        let b = self.take(N, field)?;
        b.first_chunk::<N>()
            .copied()
            .ok_or_else(|| self.err(field(), at, "truncated".to_string()))
    }

    fn u32(&mut self, field: Field) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: Field) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A `u64` length or count of items of at least `min_size` bytes each, checked
    /// against the bytes left in the file.
    fn count(&mut self, min_size: usize, field: Field) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(field)?;
        let needed = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_size));
        match needed {
            Some(bytes) if bytes <= self.left() => Ok(n as usize),
            Some(_) | None => Err(self.err(
                field(),
                at,
                format!(
                    "{n} items of at least {min_size} bytes do not fit the {} bytes left",
                    self.left()
                ),
            )),
        }
    }

    /// A string: a `u64` byte length and UTF-8 bytes.
    fn string(&mut self, field: Field) -> Result<String> {
        let len = self.count(1, &|| format!("{} length", field()))?;
        let at = self.pos;
        let bytes = self.take(len, field)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.err(field(), at, format!("not valid UTF-8: {e}")))
    }

    /// The whole file: header, metadata, tensor infos, data layout.
    fn parse(mut self) -> Result<Parsed> {
        let version = self.header()?;
        let n_tensors = self.count(MIN_TENSOR_INFO, &|| "header tensor count".into())?;
        let n_kv = self.count(MIN_KV, &|| "header metadata count".into())?;
        let metadata = self.metadata(n_kv)?;
        let alignment = self.alignment(&metadata)?;
        let (tensors, by_name, offset_at) = self.tensor_infos(n_tensors)?;
        let data_start = align_up(self.pos as u64, alignment)
            .ok_or_else(|| self.err("data section".into(), self.pos, "overflow".into()))?;
        self.check_layout(&tensors, &offset_at, alignment, data_start)?;
        Ok(Parsed {
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_start,
        })
    }

    /// The magic and the version; only little-endian versions 2 and 3 pass.
    fn header(&mut self) -> Result<u32> {
        let magic = self.array::<4>(&|| "header magic".into())?;
        if &magic != MAGIC {
            let msg = format!("{magic:02x?} is not the GGUF magic (\"GGUF\"): not a GGUF file");
            return Err(self.err("header magic".into(), 0, msg));
        }
        let at = self.pos;
        let v = self.u32(&|| "header version".into())?;
        let msg = match v {
            2 | 3 => return Ok(v),
            1 => "GGUF version 1 is no longer supported (only versions 2 and 3 are)".into(),
            _ if v != 0 && v & 0xffff == 0 => format!(
                "version reads as {v:#010x}: a big-endian GGUF file (version {}); only \
                 little-endian files are supported",
                v.swap_bytes()
            ),
            _ => format!("unsupported GGUF version {v} (only versions 2 and 3 are)"),
        };
        Err(self.err("header version".into(), at, msg))
    }

    /// `n` key-value pairs.
    fn metadata(&mut self, n: usize) -> Result<Metadata> {
        let mut md = Metadata::new();
        for i in 0..n {
            let at = self.pos;
            let key = self.string(&|| format!("metadata {i} key"))?;
            if md.contains_key(&key) {
                let msg = "duplicate key".to_string();
                return Err(self.err(format!("metadata {i} key '{key}'"), at, msg));
            }
            let t = self.value_type(&|| format!("metadata key '{key}' type"))?;
            if key == ALIGNMENT_KEY {
                self.alignment_at = self.pos;
            }
            let value = self.value(t, 0, &|| format!("metadata key '{key}'"))?;
            md.insert(key, value);
        }
        Ok(md)
    }

    fn value_type(&mut self, field: Field) -> Result<ValueType> {
        let at = self.pos;
        let id = self.u32(field)?;
        ValueType::from_id(id)
            .ok_or_else(|| self.err(field(), at, format!("unknown value type {id}")))
    }

    /// One value of type `t`; `depth` counts the arrays it is nested in.
    fn value(&mut self, t: ValueType, depth: usize, field: Field) -> Result<Value> {
        let v = match t {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(field)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(field)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(field)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::Bool => Value::Bool(self.bool(field)?),
            ValueType::String => Value::String(self.string(field)?),
            ValueType::Array => Value::Array(self.array_value(depth, field)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(field)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(field)?)),
        };
        Ok(v)
    }

    fn bool(&mut self, field: Field) -> Result<bool> {
        let at = self.pos;
        match self.array::<1>(field)? {
            [0] => Ok(false),
            [1] => Ok(true),
            [b] => Err(self.err(field(), at, format!("bool byte {b} is neither 0 nor 1"))),
        }
    }

    /// An array: element type, count, elements.
    fn array_value(&mut self, depth: usize, field: Field) -> Result<Array> {
        let et_field = || format!("{} array element type", field());
        let at = self.pos;
        let et = self.value_type(&et_field)?;
        if et == ValueType::Array && depth + 1 >= MAX_ARRAY_DEPTH {
            let msg = format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels");
            return Err(self.err(et_field(), at, msg));
        }
        let n = self.count(et.min_size(), &|| format!("{} array count", field()))?;
        let el = |i: usize| move || format!("{} array element {i}", field());
        let a = match et {
            ValueType::U8 => Array::U8(self.fixed(n, u8::from_le_bytes, field)?),
            ValueType::I8 => Array::I8(self.fixed(n, i8::from_le_bytes, field)?),
            ValueType::U16 => Array::U16(self.fixed(n, u16::from_le_bytes, field)?),
            ValueType::I16 => Array::I16(self.fixed(n, i16::from_le_bytes, field)?),
            ValueType::U32 => Array::U32(self.fixed(n, u32::from_le_bytes, field)?),
            ValueType::I32 => Array::I32(self.fixed(n, i32::from_le_bytes, field)?),
            ValueType::F32 => Array::F32(self.fixed(n, f32::from_le_bytes, field)?),
            ValueType::U64 => Array::U64(self.fixed(n, u64::from_le_bytes, field)?),
            ValueType::I64 => Array::I64(self.fixed(n, i64::from_le_bytes, field)?),
            ValueType::F64 => Array::F64(self.fixed(n, f64::from_le_bytes, field)?),
            ValueType::Bool => Array::Bool(self.each(n, |p, i| p.bool(&el(i)))?),
            ValueType::String => Array::String(self.each(n, |p, i| p.string(&el(i)))?),
            ValueType::Array => {
                Array::Array(self.each(n, |p, i| p.array_value(depth + 1, &el(i)))?)
            }
        };
        Ok(a)
    }

    /// `n` fixed-size little-endian elements (their bytes were checked by `count`).
    fn fixed<T, const N: usize>(
        &mut self,
        n: usize,
        conv: fn([u8; N]) -> T,
        field: Field,
    ) -> Result<Vec<T>> {
        let len = n.saturating_mul(N);
        let bytes = self.take(len, &|| format!("{} array data", field()))?;
        Ok(bytes
            .chunks_exact(N)
            .filter_map(|c| c.first_chunk::<N>())
            .map(|a| conv(*a))
            .collect())
    }

    /// `n` elements read one by one by `read`.
    fn each<T>(
        &mut self,
        n: usize,
        mut read: impl FnMut(&mut Self, usize) -> Result<T>,
    ) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(n.min(PREALLOC_MAX));
        for i in 0..n {
            v.push(read(self, i)?);
        }
        Ok(v)
    }

    /// `general.alignment`: an integer that fits `u32`, non-zero, a power of two.
    fn alignment(&self, md: &Metadata) -> Result<u64> {
        let Some(v) = md.get(ALIGNMENT_KEY) else {
            return Ok(DEFAULT_ALIGNMENT);
        };
        let a = v.as_integer().and_then(|i| u32::try_from(i).ok());
        match a {
            Some(a) if a.is_power_of_two() => Ok(u64::from(a)),
            Some(_) | None => Err(self.err(
                format!("metadata key '{ALIGNMENT_KEY}'"),
                self.alignment_at,
                format!(
                    "{} ({}) is not a power of two that fits u32",
                    v.short(20),
                    v.value_type()
                ),
            )),
        }
    }
}

/// `x` rounded up to a multiple of the power of two `a`.
fn align_up(x: u64, a: u64) -> Option<u64> {
    Some(x.checked_add(a - 1)? & !(a - 1))
}

impl Parser<'_> {
    /// `n` tensor infos, their index by name, and the file offset of each one's `offset`
    /// field.
    #[allow(clippy::type_complexity)]
    fn tensor_infos(
        &mut self,
        n: usize,
    ) -> Result<(Vec<TensorInfo>, HashMap<String, usize>, Vec<usize>)> {
        let mut tensors = Vec::with_capacity(n.min(PREALLOC_MAX));
        let mut by_name = HashMap::new();
        let mut offset_at = Vec::with_capacity(n.min(PREALLOC_MAX));
        for i in 0..n {
            let at = self.pos;
            let name = self.string(&|| format!("tensor {i} name"))?;
            if let Some(j) = by_name.get(&name) {
                let msg = format!("duplicate name, also tensor {j}");
                return Err(self.err(format!("tensor {i} ('{name}') name"), at, msg));
            }
            let label = format!("tensor {i} ('{name}')");
            let (dims, ty, n_bytes) = self.shape_and_type(&label)?;
            offset_at.push(self.pos);
            let offset = self.u64(&|| format!("{label} offset"))?;
            by_name.insert(name.clone(), i);
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_bytes,
            });
        }
        Ok((tensors, by_name, offset_at))
    }

    /// n_dims, the dims and the type of a tensor, and its byte size.
    fn shape_and_type(&mut self, label: &str) -> Result<(Vec<u64>, GgmlType, u64)> {
        let at = self.pos;
        let n_dims = self.u32(&|| format!("{label} n_dims"))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            let msg = format!("{n_dims} is outside 1..={MAX_DIMS}");
            return Err(self.err(format!("{label} n_dims"), at, msg));
        }
        let mut dims = Vec::with_capacity(MAX_DIMS);
        let mut dims_at = Vec::with_capacity(MAX_DIMS);
        let mut elements: u64 = 1;
        for j in 0..n_dims as usize {
            let field = || format!("{label} dims[{j}]");
            let at = self.pos;
            let d = self.u64(&field)?;
            elements = elements.saturating_mul(d);
            let msg = if d == 0 {
                "dimension is 0".to_string()
            } else if elements > i64::MAX as u64 {
                format!("{d} makes the element count overflow i64")
            } else {
                dims.push(d);
                dims_at.push(at);
                continue;
            };
            return Err(self.err(field(), at, msg));
        }
        let at = self.pos;
        let id = self.u32(&|| format!("{label} type"))?;
        let ty = GgmlType::from_id(id).ok_or_else(|| {
            self.err(
                format!("{label} type"),
                at,
                format!("unknown ggml type id {id}"),
            )
        })?;
        let n_bytes = tensor_bytes(&dims, ty).map_err(|j| {
            let d = dims.get(j).copied().unwrap_or(0);
            let msg = if j == 0 && d % u64::from(ty.block_size()) != 0 {
                format!(
                    "{d} is not a multiple of the block size {} of {ty}",
                    ty.block_size()
                )
            } else {
                format!("{d} makes the byte size of {ty} overflow")
            };
            self.err(
                format!("{label} dims[{j}]"),
                dims_at.get(j).copied().unwrap_or(at),
                msg,
            )
        })?;
        Ok((dims, ty, n_bytes))
    }

    /// Every tensor's data aligned, inside the file and apart from the others'.
    fn check_layout(
        &self,
        tensors: &[TensorInfo],
        offset_at: &[usize],
        alignment: u64,
        data_start: u64,
    ) -> Result<()> {
        let file_len = self.buf.len() as u64;
        for (i, (t, &at)) in tensors.iter().zip(offset_at).enumerate() {
            let field = || format!("tensor {i} ('{}') offset", t.name);
            if t.offset % alignment != 0 {
                let msg = format!(
                    "{} is not a multiple of the alignment {alignment}",
                    t.offset
                );
                return Err(self.err(field(), at, msg));
            }
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|e| e > file_len) {
                let msg = format!(
                    "data of {} bytes at {} + {} is past the end of the file ({file_len} bytes)",
                    t.n_bytes, data_start, t.offset
                );
                return Err(self.err(field(), at, msg));
            }
        }
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| tensors.get(i).map(|t| t.offset));
        for pair in order.windows(2) {
            let (Some(&a), Some(&b)) = (pair.first(), pair.get(1)) else {
                continue;
            };
            let (Some(ta), Some(tb)) = (tensors.get(a), tensors.get(b)) else {
                continue;
            };
            // Both ranges were checked to end inside the file, so no overflow here.
            if ta.offset + ta.n_bytes > tb.offset {
                let msg = format!(
                    "data at {}..{} overlaps tensor {a} ('{}') at {}..{}",
                    tb.offset,
                    tb.offset + tb.n_bytes,
                    ta.name,
                    ta.offset,
                    ta.offset + ta.n_bytes
                );
                let at = offset_at.get(b).copied().unwrap_or(0);
                return Err(self.err(format!("tensor {b} ('{}') offset", tb.name), at, msg));
            }
        }
        Ok(())
    }
}

/// The byte size of a tensor, or the index of the dimension that makes it invalid (the
/// first when it is not a whole number of blocks, or the one where the size overflows).
pub(super) fn tensor_bytes(dims: &[u64], ty: GgmlType) -> std::result::Result<u64, usize> {
    let mut bytes = ty
        .row_bytes(dims.first().copied().unwrap_or(0))
        .ok_or(0usize)?;
    for (j, &d) in dims.iter().enumerate().skip(1) {
        bytes = bytes.checked_mul(d).ok_or(j)?;
    }
    Ok(bytes)
}
