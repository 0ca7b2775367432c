//! The GGUF reader and writer.
//!
//! - the files of `scripts/make-gguf-vectors.py` (written by llama.cpp's `gguf` package)
//!   read back exactly as its JSON says they were written;
//! - a small file built here byte by byte, with every field's position known, is
//!   corrupted field by field: each corruption must be an error naming that field, never a
//!   panic, a hang or a huge allocation;
//! - random byte mutations never panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use graft::gguf::{Array, GgmlType, GgufFile, Value};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{json, Value as Json};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

fn fixture(name: &str) -> PathBuf {
    fixture_dir().join(name)
}

fn load_json(path: &Path) -> Json {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// The JSON form the script writes for a value.
fn value_json(v: &Value) -> Json {
    match v {
        Value::Array(a) => json!({"type": "array", "array": array_json(a)}),
        other => json!({"type": other.value_type().name(), "value": scalar_json(other)}),
    }
}

fn scalar_json(v: &Value) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::F32(x) => json!(f64::from(*x)),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::Array(a) => array_json(a),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
    }
}

fn array_json(a: &Array) -> Json {
    let items: Json = match a {
        Array::U8(v) => json!(v),
        Array::I8(v) => json!(v),
        Array::U16(v) => json!(v),
        Array::I16(v) => json!(v),
        Array::U32(v) => json!(v),
        Array::I32(v) => json!(v),
        Array::F32(v) => json!(v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()),
        Array::Bool(v) => json!(v),
        Array::String(v) => json!(v),
        Array::Array(v) => Json::Array(v.iter().map(array_json).collect()),
        Array::U64(v) => json!(v),
        Array::I64(v) => json!(v),
        Array::F64(v) => json!(v),
    };
    json!({"element_type": a.element_type().name(), "items": items})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every file the script wrote reads back as its JSON describes.
#[test]
fn gguf_py_fixtures_read_back_exactly() {
    let names = [
        "all-values",
        "all-ggml-types",
        "aligned-1",
        "aligned-64",
        "aligned-256",
    ];
    for name in names {
        let want = load_json(&fixture(&format!("{name}.json")));
        let f = GgufFile::open(fixture(&format!("{name}.gguf")))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(f.version(), 3, "{name}");
        assert_eq!(json!(f.alignment()), want["alignment"], "{name}");
        let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k).collect();
        assert_eq!(json!(keys), want["keys"], "{name}: keys in file order");
        for (key, value) in f.metadata().iter() {
            assert_eq!(value_json(value), want["metadata"][key], "{name}: {key}");
        }
        let tensors = want["tensors"].as_array().expect("tensors");
        assert_eq!(f.tensors().len(), tensors.len(), "{name}");
        for (t, w) in f.tensors().iter().zip(tensors) {
            assert_eq!(json!(t.name), w["name"], "{name}");
            assert_eq!(json!(t.ty.name()), w["type"], "{name}: {}", t.name);
            assert_eq!(json!(t.dims), w["dims"], "{name}: {}", t.name);
            assert_eq!(json!(t.n_bytes), w["n_bytes"], "{name}: {}", t.name);
            assert_eq!(t.offset % f.alignment(), 0, "{name}: {}", t.name);
            let data = f.tensor_bytes(&t.name).expect("tensor bytes");
            assert_eq!(json!(hex(data)), w["data"], "{name}: {}", t.name);
        }
    }
}

/// The script writes one tensor of every type gguf knows: graft knows them all, with the
/// same block sizes (the byte counts above come from gguf's own table).
#[test]
fn every_ggml_type_of_gguf_py_is_known() {
    let f = GgufFile::open(fixture("all-ggml-types.gguf")).expect("open");
    let mut seen: Vec<GgmlType> = f.tensors().iter().map(|t| t.ty).collect();
    seen.sort_by_key(|t| t.id());
    assert_eq!(seen, GgmlType::ALL.to_vec());
}

#[test]
fn typed_getters_convert_integers_and_name_the_key() {
    let f = GgufFile::open(fixture("all-values.gguf")).expect("open");
    let md = f.metadata();
    assert_eq!(md.get_u32("llama.block_count").expect("u32"), 2);
    // An u8 value read as wider or signed integers, as llama.cpp allows.
    assert_eq!(md.get_u32("llama.context_length").expect("u8 as u32"), 128);
    assert_eq!(md.get_i64("llama.context_length").expect("u8 as i64"), 128);
    assert_eq!(md.get_i64("test.i8").expect("i8 as i64"), -128);
    assert_eq!(md.get_u64("test.u64").expect("u64"), u64::MAX);
    assert_eq!(md.get_f32("test.f32").expect("f32"), -1.5);
    assert_eq!(md.get_f64("test.f32").expect("f32 as f64"), -1.5);
    assert!(md.get_bool("test.bool_true").expect("bool"));
    assert_eq!(md.get_str("test.string_empty").expect("str"), "");
    let tokens = md.get_array_str("test.array.string").expect("strings");
    assert_eq!(tokens.len(), 4);
    assert_eq!(
        md.get_array_i32("test.array.i32").expect("i32s"),
        &[-5, 0, 5]
    );

    let cases: [(graft::Result<String>, &str, &str); 6] = [
        (
            md.get_u8("test.u16").map(|v| v.to_string()),
            "test.u16",
            "does not fit u8",
        ),
        (
            md.get_u32("test.i8").map(|v| v.to_string()),
            "test.i8",
            "does not fit u32",
        ),
        (
            md.get_u32("test.string").map(|v| v.to_string()),
            "test.string",
            "expected u32, found string",
        ),
        (
            md.get_str("test.u32").map(str::to_string),
            "test.u32",
            "expected string, found u32",
        ),
        (
            md.get_f32("test.f64").map(|v| v.to_string()),
            "test.f64",
            "expected f32, found f64",
        ),
        (
            md.get_str("no.such.key").map(str::to_string),
            "no.such.key",
            "missing",
        ),
    ];
    for (got, key, msg) in cases {
        let e = got.expect_err(key).to_string();
        assert!(
            e.contains(&format!("'{key}'")) && e.contains(msg),
            "{key}: {e}"
        );
    }
    let e = md
        .get_array_str("test.array.u8")
        .expect_err("u8 array")
        .to_string();
    assert!(
        e.contains("expected an array of string, found an array of u8"),
        "{e}"
    );
}

#[test]
fn big_endian_and_version_1_are_refused_and_version_2_is_read() {
    let e = GgufFile::open(fixture("big-endian.gguf")).expect_err("big-endian");
    assert!(e.to_string().contains("big-endian"), "{e}");
    let good = std::fs::read(fixture("aligned-64.gguf")).expect("read");
    let with_version = |v: u32| {
        let mut b = good.clone();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        GgufFile::from_bytes("v", b)
    };
    let v2 = with_version(2).expect("version 2");
    let v3 = with_version(3).expect("version 3");
    assert_eq!(v2.metadata(), v3.metadata());
    assert_eq!(v2.tensors(), v3.tensors());
    for (v, msg) in [(1, "version 1"), (0, "unsupported"), (4, "unsupported")] {
        let e = with_version(v).expect_err("refused").to_string();
        assert!(e.contains("header version") && e.contains(msg), "{v}: {e}");
    }
}

#[test]
fn only_regular_files_are_opened() {
    let e = GgufFile::open(fixture_dir()).expect_err("a directory");
    assert!(
        e.to_string().contains("not a regular file (a directory)"),
        "{e}"
    );
    #[cfg(unix)]
    {
        let e = GgufFile::open("/dev/null").expect_err("a device");
        assert!(e.to_string().contains("a device"), "{e}");
        let dir = tempdir("fifo");
        let fifo = dir.join("pipe.gguf");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // Opening a FIFO for reading would block until a writer came: it must not.
            let e = GgufFile::open(&fifo).expect_err("a FIFO");
            assert!(e.to_string().contains("a FIFO"), "{e}");
        } else {
            eprintln!("skipped the FIFO case: mkfifo is not available");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
    let e = GgufFile::open(fixture("no-such-file.gguf")).expect_err("missing");
    assert!(e.to_string().contains("no-such-file.gguf"), "{e}");
}

/// A fresh empty folder under the target directory's temporary folder.
fn tempdir(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "gguf-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A GGUF file built byte by byte, remembering where each field starts.
#[derive(Clone, Default)]
struct Built {
    bytes: Vec<u8>,
    at: HashMap<String, usize>,
}

impl Built {
    fn mark(&mut self, field: &str) {
        self.at.insert(field.to_string(), self.bytes.len());
    }
    fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    /// A string whose length field is marked `field`.
    fn string(&mut self, field: &str, s: &str) {
        self.mark(field);
        self.u64(s.len() as u64);
        self.bytes.extend_from_slice(s.as_bytes());
    }
    fn pad(&mut self, alignment: usize) {
        while !self.bytes.len().is_multiple_of(alignment) {
            self.bytes.push(0);
        }
    }
    /// The offset of a marked field.
    fn pos(&self, field: &str) -> usize {
        *self
            .at
            .get(field)
            .unwrap_or_else(|| panic!("no field {field}"))
    }
    /// A copy with the `u64` at `field` replaced.
    fn with_u64(&self, field: &str, v: u64) -> Vec<u8> {
        let mut b = self.bytes.clone();
        let p = self.pos(field);
        b[p..p + 8].copy_from_slice(&v.to_le_bytes());
        b
    }
    /// A copy with the `u32` at `field` replaced.
    fn with_u32(&self, field: &str, v: u32) -> Vec<u8> {
        let mut b = self.bytes.clone();
        let p = self.pos(field);
        b[p..p + 4].copy_from_slice(&v.to_le_bytes());
        b
    }
}

/// The small valid file of the corruption tests: alignment 32, four metadata pairs (a
/// string, a u32 array, an array of arrays, a bool) and two tensors (F32 [4, 2] and Q8_0
/// [32]), plus the end of the last tensor's data.
fn small_file() -> (Built, usize) {
    let mut b = Built::default();
    b.bytes.extend_from_slice(b"GGUF");
    b.u32(3);
    b.mark("n_tensors");
    b.u64(2);
    b.mark("n_kv");
    b.u64(5);
    b.string("key0 len", "general.alignment");
    b.mark("alignment type");
    b.u32(4);
    b.mark("alignment");
    b.u32(32);
    b.string("key1 len", "t.str");
    b.mark("t.str type");
    b.u32(8);
    b.string("t.str len", "hello");
    b.string("key2 len", "t.arr");
    b.u32(9);
    b.mark("t.arr element type");
    b.u32(4);
    b.mark("t.arr count");
    b.u64(3);
    for v in [1, 2, 3] {
        b.u32(v);
    }
    b.string("key3 len", "t.nested");
    b.u32(9);
    b.u32(9);
    b.mark("t.nested count");
    b.u64(2);
    b.u32(0); // [u8; 2]
    b.mark("t.nested 0 count");
    b.u64(2);
    b.bytes.extend_from_slice(&[7, 8]);
    b.u32(8); // [string; 1]
    b.mark("t.nested 1 count");
    b.u64(1);
    b.string("t.nested 1 0 len", "x");
    b.string("key4 len", "t.flag");
    b.u32(7);
    b.mark("t.flag");
    b.bytes.push(1);
    tensor_info(&mut b, "w", &[4, 2], 0, 0);
    tensor_info(&mut b, "q", &[32], 8, 32);
    b.pad(32);
    let data_start = b.bytes.len();
    b.bytes.extend((0..32u8).map(|i| i * 3));
    b.pad(32);
    b.bytes.extend((0..34u8).map(|i| i ^ 0x5a));
    let end = b.bytes.len();
    b.pad(32);
    assert_eq!(data_start % 32, 0);
    (b, end)
}

/// A tensor info whose fields are marked `<name> len|n_dims|dims[j]|type|offset`.
fn tensor_info(b: &mut Built, name: &str, dims: &[u64], ty: u32, offset: u64) {
    b.string(&format!("{name} len"), name);
    b.mark(&format!("{name} n_dims"));
    b.u32(dims.len() as u32);
    for (j, &d) in dims.iter().enumerate() {
        b.mark(&format!("{name} dims[{j}]"));
        b.u64(d);
    }
    b.mark(&format!("{name} type"));
    b.u32(ty);
    b.mark(&format!("{name} offset"));
    b.u64(offset);
}

/// `bytes` must be refused with a message containing every one of `parts`.
#[track_caller]
fn refused(bytes: Vec<u8>, parts: &[&str]) {
    match GgufFile::from_bytes("bad.gguf", bytes) {
        Ok(_) => panic!("accepted a file that should fail with {parts:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with("bad.gguf: ") && msg.contains(" at byte "),
                "{msg}"
            );
            for p in parts {
                assert!(msg.contains(p), "expected {p:?} in: {msg}");
            }
        }
    }
}

#[test]
fn the_small_file_is_valid() {
    let (b, end) = small_file();
    let f = GgufFile::from_bytes("small", b.bytes.clone()).expect("valid");
    let md = f.metadata();
    assert_eq!(md.get_str("t.str").expect("str"), "hello");
    assert_eq!(md.get_array_u32("t.arr").expect("arr"), &[1, 2, 3]);
    let nested = Array::Array(vec![
        Array::U8(vec![7, 8]),
        Array::String(vec!["x".to_string()]),
    ]);
    assert_eq!(md.get_array("t.nested").expect("nested"), &nested);
    assert!(md.get_bool("t.flag").expect("bool"));
    let w = f.tensor("w").expect("w");
    assert_eq!(
        (w.ty, w.dims.as_slice(), w.n_bytes),
        (GgmlType::F32, &[4, 2][..], 32)
    );
    assert_eq!(f.tensor_bytes("q").expect("q").len(), 34);
    assert_eq!(f.data_start() as usize + 32 + 34, end);
    assert!(f.tensor_bytes("nope").is_err());
}

/// Every truncation before the end of the last tensor's data is an error; past it only
/// padding is cut, which is fine.
#[test]
fn every_truncation_is_an_error() {
    let (b, end) = small_file();
    for len in 0..b.bytes.len() {
        let cut = b.bytes[..len].to_vec();
        match GgufFile::from_bytes("cut", cut) {
            Ok(_) => assert!(len >= end, "truncated to {len} bytes was accepted"),
            Err(e) => {
                assert!(len < end, "{len}: {e}");
                assert!(e.to_string().contains(" at byte "), "{len}: {e}");
            }
        }
    }
}

/// Each length or count field set to huge values: an error naming that field, at once.
#[test]
fn huge_lengths_and_counts_name_their_field() {
    let (b, _) = small_file();
    let too_long = b.bytes.len() as u64 + 1;
    let fields = [
        ("n_tensors", "header tensor count"),
        ("n_kv", "header metadata count"),
        ("key0 len", "metadata 0 key length"),
        ("key3 len", "metadata 3 key length"),
        ("t.str len", "metadata key 't.str' length"),
        ("t.arr count", "metadata key 't.arr' array count"),
        ("t.nested count", "metadata key 't.nested' array count"),
        (
            "t.nested 0 count",
            "metadata key 't.nested' array element 0 array count",
        ),
        (
            "t.nested 1 count",
            "metadata key 't.nested' array element 1 array count",
        ),
        (
            "t.nested 1 0 len",
            "'t.nested' array element 1 array element 0 length",
        ),
        ("w len", "tensor 0 name length"),
        ("q len", "tensor 1 name length"),
    ];
    for (field, name) in fields {
        for v in [u64::MAX, 1 << 62, too_long] {
            let start = std::time::Instant::now();
            refused(b.with_u64(field, v), &[name, "do not fit"]);
            assert!(start.elapsed().as_secs() < 1, "{field} = {v} was slow");
        }
    }
}

#[test]
fn huge_and_zero_dims_name_their_field() {
    let (b, _) = small_file();
    let len = b.bytes.len() as u64;
    refused(
        b.with_u64("w dims[0]", 0),
        &["tensor 0 ('w') dims[0]", "is 0"],
    );
    refused(
        b.with_u64("w dims[1]", 0),
        &["tensor 0 ('w') dims[1]", "is 0"],
    );
    refused(
        b.with_u64("w dims[0]", u64::MAX),
        &["tensor 0 ('w') dims[0]", "overflow"],
    );
    refused(
        b.with_u64("w dims[1]", 1 << 62),
        &["tensor 0 ('w') dims[1]", "overflow"],
    );
    // Representable, but far larger than the file.
    refused(
        b.with_u64("w dims[1]", len + 1),
        &["tensor 0 ('w') offset", "past the end"],
    );
    // An element count that fits i64 while the byte count overflows u64.
    refused(
        b.with_u64("w dims[0]", 1 << 61),
        &["tensor 0 ('w') dims[1]", "byte size"],
    );
    refused(
        b.with_u64("q dims[0]", 16),
        &["tensor 1 ('q') dims[0]", "block size 32 of Q8_0"],
    );
    for n in [0, 5, u32::MAX] {
        refused(
            b.with_u32("w n_dims", n),
            &["tensor 0 ('w') n_dims", "outside 1..=4"],
        );
    }
}

#[test]
fn unknown_types_name_their_field() {
    let (b, _) = small_file();
    for id in [13, 9999, u32::MAX] {
        refused(
            b.with_u32("t.str type", id),
            &["metadata key 't.str' type", "unknown value type"],
        );
        refused(
            b.with_u32("t.arr element type", id),
            &["metadata key 't.arr' array element type", &id.to_string()],
        );
    }
    for id in [4, 5, 31, 36, 42, u32::MAX] {
        let id_text = format!("unknown ggml type id {id}");
        refused(b.with_u32("w type", id), &["tensor 0 ('w') type", &id_text]);
    }
    let mut bad_bool = b.bytes.clone();
    bad_bool[b.pos("t.flag")] = 2;
    refused(bad_bool, &["metadata key 't.flag'", "neither 0 nor 1"]);
}

#[test]
fn misplaced_tensor_data_names_the_offset() {
    let (b, _) = small_file();
    refused(
        b.with_u64("q offset", 33),
        &[
            "tensor 1 ('q') offset",
            "not a multiple of the alignment 32",
        ],
    );
    refused(
        b.with_u64("q offset", 0),
        &["tensor 1 ('q') offset", "overlaps tensor 0 ('w')"],
    );
    refused(
        b.with_u64("w offset", 32),
        &["tensor 1 ('q') offset", "overlaps tensor 0 ('w')"],
    );
    for off in [64, 1 << 62, u64::MAX - 31] {
        refused(
            b.with_u64("q offset", off),
            &["tensor 1 ('q') offset", "past the end"],
        );
    }
}

#[test]
fn bad_alignments_name_the_key() {
    let (b, _) = small_file();
    for a in [0, 3, 48, u32::MAX] {
        refused(
            b.with_u32("alignment", a),
            &["metadata key 'general.alignment'", "power of two"],
        );
    }
    // 64 is valid, but then the second tensor's offset 32 is misaligned.
    refused(
        b.with_u32("alignment", 64),
        &["tensor 1 ('q') offset", "alignment 64"],
    );
    // An i32 holding 32 is accepted like the u32; a float is not.
    let as_i32 = GgufFile::from_bytes("i32", b.with_u32("alignment type", 5)).expect("i32");
    assert_eq!(as_i32.alignment(), 32);
    refused(
        b.with_u32("alignment type", 6),
        &["metadata key 'general.alignment'", "f32"],
    );
}

#[test]
fn bad_headers_duplicates_and_text_are_refused() {
    let (b, _) = small_file();
    let mut magic = b.bytes.clone();
    magic[0] = b'X';
    refused(magic, &["header magic", "not a GGUF file"]);
    let mut big = b.bytes.clone();
    big[4..8].copy_from_slice(&3u32.to_be_bytes());
    refused(big, &["header version", "big-endian"]);
    let mut dup_key = b.bytes.clone();
    let (k1, k2) = (b.pos("key1 len") + 8, b.pos("key2 len") + 8);
    dup_key.copy_within(k1..k1 + 5, k2); // "t.arr" becomes "t.str"
    refused(dup_key, &["metadata 2 key 't.str'", "duplicate key"]);
    let mut dup_tensor = b.bytes.clone();
    let q = b.pos("q len") + 8;
    dup_tensor[q] = b'w';
    refused(dup_tensor, &["tensor 1 ('w') name", "duplicate name"]);
    let mut not_utf8 = b.bytes.clone();
    not_utf8[b.pos("key1 len") + 8] = 0xff;
    refused(not_utf8, &["metadata 1 key", "UTF-8"]);
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let mut b = Built::default();
    b.bytes.extend_from_slice(b"GGUF");
    b.u32(3);
    b.u64(0);
    b.u64(1);
    b.string("key", "deep");
    b.u32(9);
    for _ in 0..100_000 {
        b.u32(9);
        b.u64(1);
    }
    b.u32(0);
    b.u64(0);
    refused(b.bytes, &["metadata key 'deep'", "nested deeper than"]);
}

/// Values of `v` at random positions, and random truncations.
fn mutated() -> impl Strategy<Value = (Vec<(usize, u8)>, Option<usize>)> {
    (
        prop::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        prop::option::of(any::<usize>()),
    )
}

fn apply(base: &[u8], edits: &[(usize, u8)], cut: Option<usize>) -> Vec<u8> {
    let mut b = base.to_vec();
    for &(i, v) in edits {
        let n = b.len();
        b[i % n] = v;
    }
    if let Some(c) = cut {
        b.truncate(c % (base.len() + 1));
    }
    b
}

/// A file that reads must give every tensor's bytes at their stated size.
fn read_all(bytes: Vec<u8>) {
    if let Ok(f) = GgufFile::from_bytes("fuzz", bytes) {
        let _ = f.to_string();
        for t in f.tensors() {
            let data = f.tensor_bytes(&t.name).expect("a checked tensor's bytes");
            assert_eq!(data.len() as u64, t.n_bytes);
        }
    }
}

/// `cases` proptest cases, failing cases saved next to this file (`gguf.regressions`)
/// and replayed first on later runs.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn random_mutations_never_panic((edits, cut) in mutated()) {
        let (b, _) = small_file();
        read_all(apply(&b.bytes, &edits, cut));
        let fixture = std::fs::read(fixture("all-values.gguf")).expect("fixture");
        read_all(apply(&fixture, &edits, cut));
    }

    /// Length-sized fields overwritten with extreme `u64`s at any offset.
    #[test]
    fn extreme_words_never_panic(at in any::<usize>(), pick in 0usize..4) {
        let (b, _) = small_file();
        let v = [u64::MAX, 1 << 62, 1 << 32, b.bytes.len() as u64 + 1][pick];
        let mut bytes = b.bytes.clone();
        let p = at % (bytes.len() - 8);
        bytes[p..p + 8].copy_from_slice(&v.to_le_bytes());
        read_all(bytes);
    }
}

// ---------------------------------------------------------------------------------------
// The writer.

use graft::gguf::{write_output, GgufWriter, Metadata, ValueType};

/// One value of every type, extremes included, empty strings and arrays of every element
/// type (empty too), and nested arrays of mixed element types and depths.
fn every_value() -> Metadata {
    let mut md = Metadata::new();
    let scalars = [
        Value::U8(u8::MAX),
        Value::I8(i8::MIN),
        Value::U16(u16::MAX),
        Value::I16(i16::MIN),
        Value::U32(u32::MAX),
        Value::I32(i32::MIN),
        Value::F32(f32::MIN_POSITIVE),
        Value::Bool(true),
        Value::String("ünïcode ✓ 你好\n\t\"".to_string()),
        Value::U64(u64::MAX),
        Value::I64(i64::MIN),
        Value::F64(-f64::MAX),
    ];
    for (i, v) in scalars.into_iter().enumerate() {
        md.insert(format!("scalar.{i}.{}", v.value_type()), v);
    }
    md.insert("scalar.empty_string", Value::String(String::new()));
    md.insert("scalar.false", Value::Bool(false));
    for t in ValueType::ALL {
        md.insert(format!("empty.{t}"), Value::Array(Array::empty(t)));
    }
    let arrays = [
        Array::U8(vec![0, 255]),
        Array::I8(vec![-1, 1]),
        Array::U16(vec![1, 2, 3]),
        Array::I16(vec![-300]),
        Array::U32(vec![u32::MAX, 0]),
        Array::I32(vec![i32::MAX, i32::MIN]),
        Array::F32(vec![0.5, -0.0, f32::MAX]),
        Array::Bool(vec![false, true, true]),
        Array::String(vec![String::new(), "a".into(), "▁b".into()]),
        Array::U64(vec![u64::MAX]),
        Array::I64(vec![i64::MIN, 0]),
        Array::F64(vec![1e-300, 2.5]),
    ];
    for a in arrays {
        md.insert(format!("array.{}", a.element_type()), Value::Array(a));
    }
    let nested = Array::Array(vec![
        Array::U8(vec![1, 2]),
        Array::String(vec!["x".into()]),
        Array::Array(vec![Array::F64(vec![0.25]), Array::empty(ValueType::Bool)]),
        Array::empty(ValueType::Array),
    ]);
    md.insert("array.nested", Value::Array(nested));
    md
}

/// Tensors of several types: (name, dims, type, bytes).
fn some_tensors() -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let specs: [(&str, &[u64], GgmlType); 6] = [
        ("token_embd.weight", &[4, 3], GgmlType::F32),
        ("blk.0.attn_norm.weight", &[5], GgmlType::F16),
        ("blk.0.attn_q.weight", &[64, 2], GgmlType::Q8_0),
        ("blk.0.ffn_down.weight", &[256, 1, 1, 2], GgmlType::Q4_K),
        ("blk.0.bias", &[3, 1, 2], GgmlType::BF16),
        ("ids", &[1], GgmlType::I64),
    ];
    specs
        .iter()
        .enumerate()
        .map(|(i, &(name, dims, ty))| {
            let bytes =
                dims.iter().skip(1).product::<u64>() * ty.row_bytes(dims[0]).expect("whole blocks");
            let data = (0..bytes)
                .map(|b| (b as u8).wrapping_mul(31) ^ i as u8)
                .collect();
            (name.to_string(), dims.to_vec(), ty, data)
        })
        .collect()
}

fn writer_with<'a>(
    md: &Metadata,
    tensors: &'a [(String, Vec<u64>, GgmlType, Vec<u8>)],
) -> GgufWriter<'a> {
    let mut w = GgufWriter::new();
    for (k, v) in md.iter() {
        w.metadata_mut().insert(k, v.clone());
    }
    for (name, dims, ty, data) in tensors {
        w.add_tensor(name, dims, *ty, data.as_slice())
            .expect("valid tensor");
    }
    w
}

/// The file reads back with the same metadata (in order) and tensors.
fn assert_reads_back(
    f: &GgufFile,
    md: &Metadata,
    tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)],
) {
    assert_eq!(f.version(), 3);
    assert_eq!(f.metadata(), md);
    assert_eq!(f.data_start() % f.alignment(), 0);
    assert_eq!(f.tensors().len(), tensors.len());
    for (t, (name, dims, ty, data)) in f.tensors().iter().zip(tensors) {
        assert_eq!((&t.name, &t.dims, t.ty), (name, dims, *ty));
        assert_eq!(t.offset % f.alignment(), 0, "{name}");
        assert_eq!(
            f.tensor_bytes(name).expect("bytes"),
            data.as_slice(),
            "{name}"
        );
    }
}

#[test]
fn every_value_type_round_trips_at_every_alignment() {
    let tensors = some_tensors();
    for shift in 0..=8 {
        let alignment = 1u32 << shift;
        let mut md = every_value();
        md.insert("general.alignment", Value::U32(alignment));
        let mut w = writer_with(&md, &tensors);
        w.set_alignment(alignment).expect("power of two");
        let f = GgufFile::from_bytes("mem", w.to_bytes().expect("write")).expect("read");
        assert_eq!(f.alignment(), u64::from(alignment));
        assert_reads_back(&f, &md, &tensors);
    }
}

#[test]
fn empty_files_round_trip() {
    let none =
        GgufFile::from_bytes("empty", GgufWriter::new().to_bytes().expect("write")).expect("read");
    assert!(none.metadata().is_empty() && none.tensors().is_empty());
    let md = every_value();
    let f =
        GgufFile::from_bytes("md", writer_with(&md, &[]).to_bytes().expect("write")).expect("read");
    assert_reads_back(&f, &md, &[]);
    let tensors = some_tensors();
    let f = GgufFile::from_bytes(
        "t",
        writer_with(&Metadata::new(), &tensors)
            .to_bytes()
            .expect("write"),
    )
    .expect("read");
    assert_reads_back(&f, &Metadata::new(), &tensors);
}

/// graft's writer lays a file out exactly as llama.cpp's gguf package does: copying each
/// gguf-py file through it gives the same bytes.
#[test]
fn rewriting_gguf_py_files_gives_the_same_bytes() {
    for name in [
        "all-values",
        "all-ggml-types",
        "aligned-1",
        "aligned-64",
        "aligned-256",
    ] {
        let path = fixture(&format!("{name}.gguf"));
        let f = GgufFile::open(&path).expect("open");
        let mut w = GgufWriter::new();
        for (k, v) in f.metadata().iter() {
            w.metadata_mut().insert(k, v.clone());
        }
        for t in f.tensors() {
            let data = f.tensor_bytes(&t.name).expect("bytes");
            w.add_tensor(&t.name, &t.dims, t.ty, data).expect("add");
        }
        let ours = w.to_bytes().expect("write");
        assert!(
            ours == std::fs::read(&path).expect("read"),
            "{name}: bytes differ"
        );
    }
}

#[test]
fn the_writer_refuses_inconsistent_tensors_and_alignments() {
    let data = [0u8; 64];
    let cases: [(&str, &[u64], GgmlType, usize, &str); 7] = [
        ("no_dims", &[], GgmlType::F32, 0, "1 to 4 dims"),
        (
            "five_dims",
            &[1, 1, 1, 1, 1],
            GgmlType::F32,
            4,
            "1 to 4 dims",
        ),
        ("zero_dim", &[4, 0], GgmlType::F32, 0, "none zero"),
        (
            "short",
            &[4, 2],
            GgmlType::F32,
            16,
            "16 bytes given, F32 [4, 2] takes 32",
        ),
        (
            "partial_block",
            &[16],
            GgmlType::Q8_0,
            17,
            "block size 32 of Q8_0",
        ),
        (
            "overflow",
            &[1 << 40, 1 << 40],
            GgmlType::F32,
            4,
            "overflows i64",
        ),
        (
            "a_name_longer_than_ggml_takes_which_is_sixty_three_bytes_at_most__",
            &[1],
            GgmlType::F32,
            4,
            "longer than 63",
        ),
    ];
    let mut w = GgufWriter::new();
    for (name, dims, ty, len, msg) in cases {
        let e = w
            .add_tensor(name, dims, ty, &data[..len])
            .expect_err(name)
            .to_string();
        assert!(
            e.contains(&format!("tensor '{name}'")) && e.contains(msg),
            "{e}"
        );
    }
    w.add_tensor("x", &[1], GgmlType::F32, &data[..4])
        .expect("valid");
    let e = w
        .add_tensor("x", &[1], GgmlType::F32, &data[..4])
        .expect_err("dup");
    assert!(e.to_string().contains("duplicate name"), "{e}");
    for a in [0, 3, 96] {
        let e = w
            .set_alignment(a)
            .expect_err("not a power of two")
            .to_string();
        assert!(
            e.contains("general.alignment") && e.contains("power of two"),
            "{e}"
        );
    }
    w.metadata_mut().insert("general.alignment", Value::I32(32));
    let e = w.to_bytes().expect_err("an i32 alignment").to_string();
    assert!(
        e.contains("general.alignment") && e.contains("must be a u32, found i32"),
        "{e}"
    );
}

fn arb_array() -> impl Strategy<Value = Array> {
    let leaf = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..4).prop_map(Array::U8),
        prop::collection::vec(any::<i16>(), 0..4).prop_map(Array::I16),
        prop::collection::vec(any::<u64>(), 0..4).prop_map(Array::U64),
        prop::collection::vec(prop::num::f32::NORMAL, 0..4).prop_map(Array::F32),
        prop::collection::vec(any::<bool>(), 0..4).prop_map(Array::Bool),
        prop::collection::vec(".{0,6}", 0..4).prop_map(Array::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop::collection::vec(inner, 0..4).prop_map(Array::Array)
    })
}

fn arb_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i8>().prop_map(Value::I8),
        any::<u32>().prop_map(Value::U32),
        any::<i64>().prop_map(Value::I64),
        prop::num::f64::NORMAL.prop_map(Value::F64),
        ".{0,12}".prop_map(Value::String),
        arb_array().prop_map(Value::Array),
    ]
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn random_metadata_round_trips(
        pairs in prop::collection::vec(("[a-z.]{1,10}", arb_value()), 0..8),
        shift in 0u32..9,
    ) {
        let mut md = Metadata::new();
        for (k, v) in pairs {
            md.insert(k, v);
        }
        let mut w = writer_with(&md, &[]);
        w.set_alignment(1 << shift).expect("power of two");
        md.insert("general.alignment", Value::U32(1 << shift));
        let f = GgufFile::from_bytes("mem", w.to_bytes().expect("write")).expect("read");
        prop_assert_eq!(f.metadata(), &md);
    }
}

#[test]
fn write_file_replaces_regular_files_and_keeps_their_mode() {
    let dir = tempdir("write");
    let path = dir.join("model.gguf");
    let tensors = some_tensors();
    let md = every_value();
    writer_with(&md, &tensors)
        .write_file(&path)
        .expect("new file");
    assert_reads_back(&GgufFile::open(&path).expect("open"), &md, &tensors);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        writer_with(&Metadata::new(), &tensors)
            .write_file(&path)
            .expect("replace");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
        // A symlink stays a link; the file it points to gets the new content.
        let link = dir.join("link.gguf");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        writer_with(&md, &[])
            .write_file(&link)
            .expect("through the link");
        assert!(std::fs::symlink_metadata(&link)
            .expect("lstat")
            .file_type()
            .is_symlink());
        assert_eq!(GgufFile::open(&path).expect("open").metadata(), &md);
    }
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(
        names.iter().all(|n| !n.to_string_lossy().contains(".tmp-")),
        "{names:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_write_leaves_the_target_untouched() {
    let dir = tempdir("fail");
    let path = dir.join("out.gguf");
    std::fs::write(&path, b"precious").expect("write");
    let e = write_output(&path, |w: &mut dyn std::io::Write| {
        w.write_all(b"half")?;
        Err(std::io::Error::other("disk on fire"))
    })
    .expect_err("the write fails");
    assert!(e.to_string().contains("disk on fire"), "{e}");
    assert_eq!(std::fs::read(&path).expect("read"), b"precious");
    assert_eq!(
        std::fs::read_dir(&dir).expect("ls").count(),
        1,
        "a temporary file was left"
    );
    let e = write_output(&dir, |_: &mut dyn std::io::Write| Ok(())).expect_err("a directory");
    assert!(e.to_string().contains("is a directory"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Devices and FIFOs are written in place, never replaced by a regular file.
#[cfg(unix)]
#[test]
fn devices_and_fifos_are_written_in_place() {
    use std::os::unix::fs::FileTypeExt;
    let tensors = some_tensors();
    writer_with(&every_value(), &tensors)
        .write_file("/dev/null")
        .expect("/dev/null");
    assert!(std::fs::metadata("/dev/null")
        .expect("stat")
        .file_type()
        .is_char_device());
    let dir = tempdir("fifo-out");
    let fifo = dir.join("pipe.gguf");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("skipped the FIFO case: mkfifo is not available");
        return;
    }
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).expect("read the FIFO"))
    };
    let w = writer_with(&every_value(), &tensors);
    w.write_file(&fifo).expect("write the FIFO");
    let got = reader.join().expect("reader thread");
    assert_eq!(got, w.to_bytes().expect("bytes"));
    assert!(std::fs::metadata(&fifo)
        .expect("stat")
        .file_type()
        .is_fifo());
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------
// llama.cpp's gguf package reads graft's files (skipped when python3 or gguf is missing).

/// What gguf's reader reports as a field's types: the array types down the first elements.
fn gguf_py_types(v: &Value) -> Vec<String> {
    fn array_types(a: &Array, out: &mut Vec<String>) {
        out.push("array".into());
        match a {
            Array::Array(v) => {
                if let Some(first) = v.first() {
                    array_types(first, out);
                }
            }
            other if !other.is_empty() => out.push(other.element_type().name().into()),
            _ => {}
        }
    }
    let mut out = Vec::new();
    match v {
        Value::Array(a) => array_types(a, &mut out),
        other => out.push(other.value_type().name().into()),
    }
    out
}

/// What gguf's reader reports as a field's contents: scalars, or an array's leaf values
/// flattened.
fn gguf_py_contents(v: &Value) -> Json {
    fn leaves(a: &Array, out: &mut Vec<Json>) {
        match a {
            Array::Array(v) => v.iter().for_each(|x| leaves(x, out)),
            other => {
                if let Json::Object(o) = array_json(other) {
                    if let Some(Json::Array(items)) = o.get("items") {
                        out.extend(items.iter().cloned());
                    }
                }
            }
        }
    }
    match v {
        Value::Array(a) => {
            let mut out = Vec::new();
            leaves(a, &mut out);
            Json::Array(out)
        }
        other => scalar_json(other),
    }
}

/// Equal JSON, floats to 1e-15 relative (serde_json's float parsing may be off by an ulp).
fn json_close(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            x == y || (x - y).abs() <= 1e-15 * x.abs().max(y.abs())
        }
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_close(x, y))
        }
        _ => a == b,
    }
}

#[test]
fn gguf_py_reads_graft_files() {
    let dir = tempdir("py");
    let path = dir.join("graft.gguf");
    // gguf's reader flattens nested arrays by the types of their first elements, so the
    // nested arrays here keep one leaf type.
    let mut md = every_value();
    md.insert(
        "array.nested",
        Value::Array(Array::Array(vec![
            Array::Array(vec![Array::I32(vec![1, 2])]),
            Array::Array(vec![Array::I32(vec![3]), Array::I32(vec![])]),
        ])),
    );
    md.insert("general.alignment", Value::U32(64));
    let tensors = some_tensors();
    writer_with(&md, &tensors).write_file(&path).expect("write");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/make-gguf-vectors.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg("check")
        .arg(&path)
        .arg("--json")
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        Ok(o) if String::from_utf8_lossy(&o.stderr).contains("gguf package is missing") => {
            eprintln!("skipped: the python gguf package is not installed (pip install gguf numpy)");
            return;
        }
        Ok(o) => panic!(
            "gguf could not read graft's file: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            eprintln!("skipped: python3 cannot be run ({e})");
            return;
        }
    };
    let report: Json = serde_json::from_slice(&out.stdout).expect("JSON from the script");
    assert_eq!(report["alignment"], json!(64));
    let keys = report["metadata"].as_object().expect("metadata").len();
    assert_eq!(keys, md.len());
    for (key, v) in md.iter() {
        let got = &report["metadata"][key];
        assert_eq!(got["types"], json!(gguf_py_types(v)), "{key}");
        let want = gguf_py_contents(v);
        assert!(
            json_close(&got["value"], &want),
            "{key}: {} vs {want}",
            got["value"]
        );
    }
    let got = report["tensors"].as_array().expect("tensors");
    assert_eq!(got.len(), tensors.len());
    for (g, (name, dims, ty, data)) in got.iter().zip(&tensors) {
        assert_eq!(g["name"], json!(name));
        assert_eq!(g["type"], json!(ty.name()), "{name}");
        assert_eq!(g["dims"], json!(dims), "{name}");
        assert_eq!(g["data"], json!(hex(data)), "{name}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn inspect_lists_metadata_and_tensors() {
    let path = fixture("all-values.gguf");
    let text = graft::gguf::inspect(&path).expect("inspect");
    let f = GgufFile::open(&path).expect("open");
    assert!(
        text.starts_with(&format!("{}: GGUF v3, ", path.display())),
        "{text}"
    );
    assert_eq!(
        text.lines().count(),
        3 + f.metadata().len() + f.tensors().len()
    );
    for line in [
        "  llama.block_count: u32 = 2",
        "  test.string: string = \"héllo, wörld ✓ 你好\"",
        "  test.array.string: array<string> = [string; 4] [\"<s>\", \"\", \"▁the\", \"日本\"]",
        "  test.nested.i32: array<array> = [array; 3] [[i32; 3] [1, 2, 3], [i32; 1] [4], [i32; 2] [5, 6]]",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
    }
    for t in f.tensors() {
        let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
        let row = text
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{} ", t.name)));
        let row = row.unwrap_or_else(|| panic!("no row for {}:\n{text}", t.name));
        let want = format!(
            "[{}]  {}  offset {}  {} bytes",
            dims.join(", "),
            t.ty,
            t.offset,
            t.n_bytes
        );
        assert!(row.ends_with(&want), "{row:?} vs {want:?}");
    }
    let e = graft::gguf::inspect(fixture("big-endian.gguf")).expect_err("big-endian");
    assert!(e.to_string().contains("big-endian"), "{e}");
}
