//! GGUF, llama.cpp's model file format: a reader ([`GgufFile`]) and a writer
//! ([`GgufWriter`], which writes version 3 through [`write_output`]).
//!
//! # The format
//! All numbers are little-endian (big-endian files exist and are refused). A file is:
//!
//! 1. **Header**: the magic `GGUF` (4 bytes), the version (`u32`: 2 or 3 here; version 1
//!    used 32-bit counts and is refused), the tensor count (`u64`) and the metadata pair
//!    count (`u64`).
//! 2. **Metadata**: that many key-value pairs. A key is a string (a `u64` byte length and
//!    UTF-8 bytes, no terminator); then a value type id (`u32`, see [`ValueType`]) and the
//!    value: fixed-size integers, floats and bools (one byte, 0 or 1), strings, and arrays
//!    (element type id `u32`, count `u64`, then the elements without their type ids; the
//!    elements of an array of arrays carry their own element type and count, so nested
//!    arrays may differ in type and length). llama.cpp itself refuses nested arrays.
//! 3. **Tensor infos**: for each tensor its name (a string), `n_dims` (`u32`, 1 to 4
//!    here), the dims (`u64` each, innermost first: ggml's `ne`), the ggml type id (`u32`,
//!    see [`GgmlType`]) and the offset of its data (`u64`) from the start of the data
//!    section.
//! 4. **Padding** to the data alignment: `general.alignment` (a `u32` power of two) or 32.
//! 5. **Data**: each tensor's bytes at its offset, which is a multiple of the alignment.
//!    A tensor of `ne` elements of a type with blocks of `B` elements and `S` bytes takes
//!    `ne[0] / B * S * ne[1] * ne[2] * ne[3]` bytes (`ne[0]` a multiple of `B`).
//!
//! # What the reader checks
//! Every count, length, dimension, product of dimensions, type id and offset is checked
//! against the bytes left in the file before it is used, with checked arithmetic, and
//! nothing is allocated from a length before the length is known to fit the file. A bad
//! file gets an [`Error::Gguf`](crate::Error::Gguf) naming the field (`tensor 3
//! ('blk.0.attn_q.weight') dims[1]`, `metadata key 'tokenizer.ggml.tokens' array count`)
//! and its byte offset. Duplicate keys and tensor names, dims of 0, more than 4 dims,
//! unknown value or tensor types, misaligned or overlapping tensor data and data past
//! the end of the file are all refused. Strings must be UTF-8.

mod reader;
mod types;
mod value;
mod writer;

use std::fmt;
use std::path::Path;

pub use crate::files::{write_output, write_output_guarded};
pub use reader::{GgufFile, TensorInfo};
pub use types::GgmlType;
pub use value::{Array, Metadata, Value, ValueType};
pub use writer::{GgufWriter, MAX_TENSOR_NAME, WRITE_VERSION};

use crate::Result;

/// The four bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";

/// The metadata key that sets the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// The data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The most dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;

/// Characters of a string value shown by [`inspect`] before it is cut.
const SHORT_STRING: usize = 60;

/// A readable listing of the GGUF file at `path`: header, every metadata pair (type and
/// short value) and the tensor table (name, shape, type, offset, bytes).
pub fn inspect(path: impl AsRef<Path>) -> Result<String> {
    Ok(GgufFile::open(path)?.to_string())
}

impl fmt::Display for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: GGUF v{}, {} bytes, alignment {}, data at byte {}",
            self.path(),
            self.version(),
            self.file_len(),
            self.alignment(),
            self.data_start()
        )?;
        writeln!(f, "metadata ({} keys):", self.metadata().len())?;
        for (key, value) in self.metadata().iter() {
            let t = match value {
                Value::Array(a) => format!("array<{}>", a.element_type()),
                other @ (Value::U8(_)
                | Value::I8(_)
                | Value::U16(_)
                | Value::I16(_)
                | Value::U32(_)
                | Value::I32(_)
                | Value::F32(_)
                | Value::Bool(_)
                | Value::String(_)
                | Value::U64(_)
                | Value::I64(_)
                | Value::F64(_)) => other.value_type().to_string(),
            };
            writeln!(f, "  {key}: {t} = {}", value.short(SHORT_STRING))?;
        }
        writeln!(f, "tensors ({}):", self.tensors().len())?;
        let width = self
            .tensors()
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(0);
        for t in self.tensors() {
            let shape: Vec<String> = t.dims.iter().map(u64::to_string).collect();
            let shape = shape.join(", ");
            writeln!(
                f,
                "  {:width$}  [{shape}]  {}  offset {}  {} bytes",
                t.name, t.ty, t.offset, t.n_bytes
            )?;
        }
        Ok(())
    }
}
