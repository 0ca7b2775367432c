#!/usr/bin/env python3
"""GGUF test vectors for graft, made and read with llama.cpp's `gguf` Python package.

    python3 scripts/make-gguf-vectors.py make [--out tests/fixtures/gguf]
        Writes small GGUF files (every metadata type, nested arrays, custom alignments,
        tensors of every ggml type gguf knows, a big-endian file) and, for each, a JSON
        file with what was written, which tests/text_io/gguf.rs compares graft's reading against.

    python3 scripts/make-gguf-vectors.py check FILE [--json]
        Reads FILE (for instance one graft wrote) with gguf's GGUFReader, checks its
        tensor layout, and prints the metadata and tensors (as JSON with --json). Exits
        with status 1 and a message when the file cannot be read or is inconsistent.

Needs `pip install gguf numpy`.
"""

import argparse
import json
import sys
from pathlib import Path

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT
except ImportError:
    sys.exit("the gguf package is missing: pip install gguf numpy")

# graft's lower-case names of the value types.
TYPE_NAMES = {
    VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16",
    VT.UINT32: "u32", VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool",
    VT.STRING: "string", VT.ARRAY: "array", VT.UINT64: "u64", VT.INT64: "i64",
    VT.FLOAT64: "f64",
}

# Scalars: (key, type, value), with the extremes of each integer type. The floats are
# exactly representable in f32 so the JSON comparison can be exact.
SCALARS = [
    ("test.u8", VT.UINT8, 255),
    ("test.i8", VT.INT8, -128),
    ("test.u16", VT.UINT16, 65535),
    ("test.i16", VT.INT16, -32768),
    ("test.u32", VT.UINT32, 4294967295),
    ("test.i32", VT.INT32, -2147483648),
    ("test.f32", VT.FLOAT32, -1.5),
    ("test.bool_true", VT.BOOL, True),
    ("test.bool_false", VT.BOOL, False),
    ("test.string", VT.STRING, "héllo, wörld ✓ 你好"),
    ("test.string_empty", VT.STRING, ""),
    ("test.u64", VT.UINT64, 18446744073709551615),
    ("test.i64", VT.INT64, -9223372036854775808),
    ("test.f64", VT.FLOAT64, 3.141592653589793),
    ("llama.block_count", VT.UINT32, 2),
    ("llama.context_length", VT.UINT8, 128),
]

# Flat arrays: (key, element type, values).
ARRAYS = [
    ("test.array.u8", VT.UINT8, [0, 1, 255]),
    ("test.array.i8", VT.INT8, [-128, 0, 127]),
    ("test.array.u16", VT.UINT16, [0, 65535]),
    ("test.array.i16", VT.INT16, [-32768, 32767]),
    ("test.array.u32", VT.UINT32, [0, 7, 4294967295]),
    ("test.array.i32", VT.INT32, [-5, 0, 5]),
    ("test.array.f32", VT.FLOAT32, [0.25, -2.0, 1e-3]),
    ("test.array.bool", VT.BOOL, [True, False, True]),
    ("test.array.string", VT.STRING, ["<s>", "", "▁the", "日本"]),
    ("test.array.u64", VT.UINT64, [0, 18446744073709551615]),
    ("test.array.i64", VT.INT64, [-9223372036854775808, 9223372036854775807]),
    ("test.array.f64", VT.FLOAT64, [0.1, -1e300]),
]

# Nested arrays: gguf infers the inner element type from the Python values (int -> i32,
# str -> string, float -> f32).
NESTED = [
    ("test.nested.i32", [[1, 2, 3], [4], [5, 6]]),
    ("test.nested.string", [["a", "bc"], ["déf"]]),
    ("test.nested.deep", [[[1.5, 2.5], [3.5]], [[4.5]]]),
]


def f32(x):
    return float(np.float32(x))


def describe_value(vtype, value):
    """The JSON form of a value: its graft type name and its value (arrays nested)."""
    if vtype == VT.ARRAY:
        return {"type": "array", "array": describe_array(value)}
    if vtype == VT.FLOAT32:
        value = f32(value)
    return {"type": TYPE_NAMES[vtype], "value": value}


def describe_array(values, etype=None):
    if etype is None:
        etype = VT.get_type(values[0])
    if etype == VT.ARRAY:
        return {"element_type": "array", "items": [describe_array(v) for v in values]}
    if etype == VT.FLOAT32:
        values = [f32(v) for v in values]
    return {"element_type": TYPE_NAMES[etype], "items": list(values)}


def write_file(path, kv, tensors, alignment=None, endian=gguf.GGUFEndian.LITTLE):
    """kv: [(key, vtype, value, sub_type)], tensors: [(name, np array, raw qtype or None)]."""
    w = gguf.GGUFWriter(str(path), arch="llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vtype, value, sub in kv:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def expected(kv, tensors, alignment):
    meta = {"general.architecture": {"type": "string", "value": "llama"}}
    if alignment is not None:
        meta["general.alignment"] = {"type": "u32", "value": alignment}
    for key, vtype, value, sub in kv:
        if vtype == VT.ARRAY:
            meta[key] = {"type": "array", "array": describe_array(value, sub)}
        else:
            meta[key] = describe_value(vtype, value)
    ts = []
    for name, arr, raw in tensors:
        qtype = raw if raw is not None else {
            np.dtype(np.float32): QT.F32, np.dtype(np.float16): QT.F16,
            np.dtype(np.float64): QT.F64, np.dtype(np.int8): QT.I8,
            np.dtype(np.int16): QT.I16, np.dtype(np.int32): QT.I32,
            np.dtype(np.int64): QT.I64,
        }[arr.dtype]
        shape = list(arr.shape)
        if raw is not None:
            shape = list(gguf.quant_shape_from_byte_shape(shape, raw))
        ts.append({
            "name": name, "type": qtype.name, "dims": shape[::-1],
            "n_bytes": int(arr.nbytes), "data": arr.tobytes().hex(),
        })
    return {"alignment": alignment or 32, "keys": list(meta), "metadata": meta, "tensors": ts}


def make_all_values():
    kv = [(k, t, v, None) for k, t, v in SCALARS]
    kv += [(k, VT.ARRAY, v, t) for k, t, v in ARRAYS]
    kv += [(k, VT.ARRAY, v, None) for k, v in NESTED]
    rng = np.random.default_rng(1)
    tensors = [
        ("token_embd.weight", rng.standard_normal((3, 4)).astype(np.float32), None),
        ("blk.0.attn_norm.weight", rng.standard_normal(4).astype(np.float16), None),
        ("blk.0.ids", np.arange(-3, 3, dtype=np.int8).reshape(2, 3), None),
        ("blk.0.pos", np.arange(5, dtype=np.int32), None),
        ("blk.0.big", np.arange(2, dtype=np.int64), None),
        ("blk.0.wide", np.linspace(0, 1, 3).astype(np.float64), None),
        ("blk.0.short", np.arange(3, dtype=np.int16), None),
    ]
    return kv, tensors


def make_all_ggml_types():
    tensors = []
    for i, qtype in enumerate(gguf.GGML_QUANT_SIZES):
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(100 + i)
        n_blocks = 1 + i % 2
        raw = rng.integers(0, 256, size=(2, n_blocks * block_bytes), dtype=np.uint8)
        tensors.append((f"t.{qtype.name.lower()}", raw, qtype))
    return [("test.note", VT.STRING, "one tensor per ggml type", None)], tensors


def make_aligned(alignment):
    rng = np.random.default_rng(alignment)
    tensors = [
        ("a", rng.standard_normal(3).astype(np.float32), None),
        ("b", rng.standard_normal((2, 5)).astype(np.float16), None),
        ("q", rng.integers(0, 256, size=(1, 34), dtype=np.uint8), QT.Q8_0),
    ]
    return [("test.alignment_note", VT.UINT32, alignment, None)], tensors


def make(out):
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "all-values": (*make_all_values(), None),
        "all-ggml-types": (*make_all_ggml_types(), None),
        "aligned-1": (*make_aligned(1), 1),
        "aligned-64": (*make_aligned(64), 64),
        "aligned-256": (*make_aligned(256), 256),
    }
    for name, (kv, tensors, alignment) in files.items():
        write_file(out / f"{name}.gguf", kv, tensors, alignment)
        with open(out / f"{name}.json", "w", encoding="utf-8") as f:
            json.dump(expected(kv, tensors, alignment), f, indent=1, ensure_ascii=False)
            f.write("\n")
    kv, tensors = make_aligned(32)[0], make_aligned(32)[1][:1]
    write_file(out / "big-endian.gguf", kv, tensors, None, gguf.GGUFEndian.BIG)
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {len(files) + 1} GGUF files to {out} ({total} bytes with the JSON)")


def field_types(field):
    return [TYPE_NAMES[t] for t in field.types]


def check(path, as_json):
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any failure of the reader is the answer
        sys.exit(f"{path}: gguf cannot read it: {type(e).__name__}: {e}")
    problems = []
    tensors = []
    for t in r.tensors:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        dims = [int(d) for d in t.shape]
        if dims[0] % block_size != 0:
            problems.append(f"tensor {t.name}: dims[0] {dims[0]} is not a multiple of {block_size}")
        if t.data_offset % r.alignment != 0:
            problems.append(f"tensor {t.name}: data at {t.data_offset} is not aligned to {r.alignment}")
        tensors.append({
            "name": t.name, "type": t.tensor_type.name, "dims": dims,
            "n_bytes": int(t.n_bytes), "data_offset": int(t.data_offset),
            "data": np.asarray(t.data).tobytes().hex(),
        })
    metadata = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float) and not np.isfinite(value):
            value = repr(value)
        metadata[key] = {"types": field_types(field), "value": value}
    if problems:
        sys.exit(f"{path}: " + "; ".join(problems))
    report = {"alignment": int(r.alignment), "metadata": metadata, "tensors": tensors}
    if as_json:
        json.dump(report, sys.stdout, ensure_ascii=False)
        print()
        return
    print(f"{path}: alignment {r.alignment}, {len(metadata)} keys, {len(tensors)} tensors")
    for key, m in metadata.items():
        print(f"  {key}: {'/'.join(m['types'])} = {str(m['value'])[:70]}")
    for t in tensors:
        print(f"  {t['name']}: {t['type']} {t['dims']} at {t['data_offset']} ({t['n_bytes']} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the test vectors")
    m.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/gguf")
    c = sub.add_parser("check", help="read a GGUF file with gguf and print it")
    c.add_argument("file")
    c.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.out)
    else:
        check(a.file, a.json)


if __name__ == "__main__":
    main()
