//! GGUF metadata values ([`Value`], [`Array`]) and the ordered key-value map
//! ([`Metadata`]) with typed getters.
//!
//! The getters match one wanted variant and turn every other one into a typed error
//! naming the key and both types, so their `other =>` arms are the point, not a missing
//! case: the crate's wildcard lint is allowed here.
#![allow(clippy::wildcard_enum_match_arm)]

use std::collections::HashMap;
use std::fmt;

use crate::{Error, Result};

/// The type id of a metadata value, as stored in the file (a `u32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// Every value type, in id order.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The type with this id, or `None` when the id is unknown.
    pub fn from_id(id: u32) -> Option<ValueType> {
        usize::try_from(id)
            .ok()
            .and_then(|i| ValueType::ALL.get(i))
            .copied()
    }

    /// The id stored in the file.
    pub fn id(self) -> u32 {
        match self {
            ValueType::U8 => 0,
            ValueType::I8 => 1,
            ValueType::U16 => 2,
            ValueType::I16 => 3,
            ValueType::U32 => 4,
            ValueType::I32 => 5,
            ValueType::F32 => 6,
            ValueType::Bool => 7,
            ValueType::String => 8,
            ValueType::Array => 9,
            ValueType::U64 => 10,
            ValueType::I64 => 11,
            ValueType::F64 => 12,
        }
    }

    /// Bytes of one value of a fixed-size type; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => Some(1),
            ValueType::U16 | ValueType::I16 => Some(2),
            ValueType::U32 | ValueType::I32 | ValueType::F32 => Some(4),
            ValueType::U64 | ValueType::I64 | ValueType::F64 => Some(8),
            ValueType::String | ValueType::Array => None,
        }
    }

    /// The fewest bytes one value of this type takes in a file (a string is at least its
    /// `u64` length, an array at least its element type and count).
    pub fn min_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            ValueType::U8
            | ValueType::I8
            | ValueType::Bool
            | ValueType::U16
            | ValueType::I16
            | ValueType::U32
            | ValueType::I32
            | ValueType::F32
            | ValueType::U64
            | ValueType::I64
            | ValueType::F64 => self.fixed_size().unwrap_or(1),
        }
    }

    /// The lower-case name used in messages (`"u32"`, `"string"`).
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all elements have one type. The elements of an array of arrays are
/// arrays of any element types and lengths.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value as an `i128` when it is of an integer type.
    pub fn as_integer(&self) -> Option<i128> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => Some(v.into()),
            Value::I64(v) => Some(v.into()),
            Value::F32(_) | Value::Bool(_) | Value::String(_) | Value::Array(_) | Value::F64(_) => {
                None
            }
        }
    }

    /// A short, one-line rendering for listings: strings quoted and cut after `max`
    /// characters, arrays as their type and length with their first elements.
    pub fn short(&self, max: usize) -> String {
        match self {
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::F32(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
            Value::String(s) => quote_short(s, max),
            Value::Array(a) => a.short(max),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
        }
    }
}

/// `s` in double quotes with escapes, cut to `max` characters with an ellipsis.
fn quote_short(s: &str, max: usize) -> String {
    let escaped: String = s.escape_debug().collect();
    if escaped.chars().count() <= max {
        format!("\"{escaped}\"")
    } else {
        let cut: String = escaped.chars().take(max).collect();
        format!("\"{cut}\"...")
    }
}

/// Elements shown by [`Array::short`].
const SHORT_ELEMENTS: usize = 4;

impl Array {
    /// The type of the elements.
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An empty array of elements of type `t`.
    pub fn empty(t: ValueType) -> Array {
        match t {
            ValueType::U8 => Array::U8(Vec::new()),
            ValueType::I8 => Array::I8(Vec::new()),
            ValueType::U16 => Array::U16(Vec::new()),
            ValueType::I16 => Array::I16(Vec::new()),
            ValueType::U32 => Array::U32(Vec::new()),
            ValueType::I32 => Array::I32(Vec::new()),
            ValueType::F32 => Array::F32(Vec::new()),
            ValueType::Bool => Array::Bool(Vec::new()),
            ValueType::String => Array::String(Vec::new()),
            ValueType::Array => Array::Array(Vec::new()),
            ValueType::U64 => Array::U64(Vec::new()),
            ValueType::I64 => Array::I64(Vec::new()),
            ValueType::F64 => Array::F64(Vec::new()),
        }
    }

    /// `[type; len] [first elements, ...]`, on one line.
    pub fn short(&self, max: usize) -> String {
        let items: Vec<String> = match self {
            Array::U8(v) => first(v, |x| x.to_string()),
            Array::I8(v) => first(v, |x| x.to_string()),
            Array::U16(v) => first(v, |x| x.to_string()),
            Array::I16(v) => first(v, |x| x.to_string()),
            Array::U32(v) => first(v, |x| x.to_string()),
            Array::I32(v) => first(v, |x| x.to_string()),
            Array::F32(v) => first(v, |x| x.to_string()),
            Array::Bool(v) => first(v, |x| x.to_string()),
            Array::String(v) => first(v, |x| quote_short(x, max)),
            Array::Array(v) => first(v, |x| x.short(max)),
            Array::U64(v) => first(v, |x| x.to_string()),
            Array::I64(v) => first(v, |x| x.to_string()),
            Array::F64(v) => first(v, |x| x.to_string()),
        };
        let more = if self.len() > SHORT_ELEMENTS {
            ", ..."
        } else {
            ""
        };
        format!(
            "[{}; {}] [{}{more}]",
            self.element_type(),
            self.len(),
            items.join(", ")
        )
    }
}

/// The first [`SHORT_ELEMENTS`] elements of `v`, rendered by `f`.
fn first<T>(v: &[T], f: impl Fn(&T) -> String) -> Vec<String> {
    v.iter().take(SHORT_ELEMENTS).map(f).collect()
}

/// Metadata key-value pairs in file order, with lookup by key. Keys are unique.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

/// The error of a typed getter: the key, what was expected and what was found.
fn key_error(key: &str, msg: String) -> Error {
    Error::GgufInput {
        field: format!("metadata key '{key}'"),
        msg,
    }
}

/// The error of a getter that found a value of another type.
fn wrong_type(key: &str, want: ValueType, found: &Value) -> Error {
    key_error(
        key,
        format!("expected {want}, found {}", found.value_type()),
    )
}

macro_rules! int_getter {
    ($(#[$doc:meta])* $name:ident, $t:ty) => {
        $(#[$doc])*
        pub fn $name(&self, key: &str) -> Result<$t> {
            self.get_int(key, stringify!($t))
        }
    };
}

macro_rules! array_getter {
    ($(#[$doc:meta])* $name:ident, $variant:ident, $t:ty) => {
        $(#[$doc])*
        pub fn $name(&self, key: &str) -> Result<&[$t]> {
            match self.get_array(key)? {
                Array::$variant(v) => Ok(v),
                other => Err(key_error(
                    key,
                    format!(
                        "expected an array of {}, found an array of {}",
                        ValueType::$variant,
                        other.element_type()
                    ),
                )),
            }
        }
    };
}

impl Metadata {
    /// An empty map.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// The number of pairs.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sets `key` to `value`: a new key goes last, an existing key keeps its place.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.index.get(&key).and_then(|&i| self.entries.get_mut(i)) {
            Some(entry) => entry.1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index
            .get(key)
            .and_then(|&i| self.entries.get(i))
            .map(|(_, v)| v)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// The pairs in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of `key`, or an error naming the missing key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| key_error(key, "missing".to_string()))
    }

    /// An integer of any type whose value fits `T`.
    fn get_int<T: TryFrom<i128>>(&self, key: &str, want: &str) -> Result<T> {
        let v = self.require(key)?;
        let Some(i) = v.as_integer() else {
            return Err(key_error(
                key,
                format!("expected {want}, found {}", v.value_type()),
            ));
        };
        T::try_from(i).map_err(|_| {
            key_error(
                key,
                format!("value {i} ({}) does not fit {want}", v.value_type()),
            )
        })
    }

    int_getter!(
        /// An integer of any type whose value fits `u8`.
        get_u8, u8
    );
    int_getter!(
        /// An integer of any type whose value fits `i8`.
        get_i8, i8
    );
    int_getter!(
        /// An integer of any type whose value fits `u16`.
        get_u16, u16
    );
    int_getter!(
        /// An integer of any type whose value fits `i16`.
        get_i16, i16
    );
    int_getter!(
        /// An integer of any type whose value fits `u32` (`get_u32("llama.block_count")`).
        get_u32, u32
    );
    int_getter!(
        /// An integer of any type whose value fits `i32`.
        get_i32, i32
    );
    int_getter!(
        /// An integer of any type whose value fits `u64`.
        get_u64, u64
    );
    int_getter!(
        /// An integer of any type whose value fits `i64`.
        get_i64, i64
    );

    /// An `f32` value.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.require(key)? {
            Value::F32(v) => Ok(*v),
            other => Err(wrong_type(key, ValueType::F32, other)),
        }
    }

    /// An `f64` value, or an `f32` one widened (exactly).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        match self.require(key)? {
            Value::F64(v) => Ok(*v),
            Value::F32(v) => Ok(f64::from(*v)),
            other => Err(wrong_type(key, ValueType::F64, other)),
        }
    }

    /// A `bool` value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(v) => Ok(*v),
            other => Err(wrong_type(key, ValueType::Bool, other)),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(v) => Ok(v),
            other => Err(wrong_type(key, ValueType::String, other)),
        }
    }

    /// An array value of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.require(key)? {
            Value::Array(v) => Ok(v),
            other => Err(wrong_type(key, ValueType::Array, other)),
        }
    }

    array_getter!(
        /// An array of strings (`tokenizer.ggml.tokens`).
        get_array_str, String, String
    );
    array_getter!(
        /// An array of `f32` (`tokenizer.ggml.scores`).
        get_array_f32, F32, f32
    );
    array_getter!(
        /// An array of `i32` (`tokenizer.ggml.token_type`).
        get_array_i32, I32, i32
    );
    array_getter!(
        /// An array of `u32`.
        get_array_u32, U32, u32
    );
}
