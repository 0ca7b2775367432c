#!/usr/bin/env python3
"""Writes the quantization test vectors of tests/ops/quant.rs with llama.cpp's own gguf-py.

The vectors come from an implementation graft did not write: the `gguf` package's
`gguf.quants.quantize` / `gguf.quants.dequantize` (numpy ports of ggml's reference
code, kept bit-exact with ggml-quants.c by llama.cpp's own tests).

Written with gguf 0.19.0 and numpy 2.4. That gguf version
- quantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0 and TQ2_0 (not Q8_1, the K-quants or
  the i-quants);
- dequantizes every type here but Q8_1.
The script asks the installed version what it supports and records it in the manifest,
so a newer gguf that quantizes more types adds their vectors on the next run. Q8_1 is
covered in the Rust test through Q8_0 (same `d` and quants; `s` is checked from its
definition).

gguf-py cannot quantize to Q8_1, the K-quants or IQ4_NL/IQ4_XS, so with `--ggml-src DIR`
(a ggml source folder: the one that has src/ggml-quants.c and include/) the script also
compiles ggml's own quantizers from that folder with the system C compiler, in a
temporary folder outside the repository and with `-ffp-contract=off` (no fused
multiply-adds, the reference semantics; an FMA build of ggml can differ in the last bit of
a search), and writes their bytes for Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and
IQ4_XS too: `quantize_row_*_ref`, and for IQ4_NL/IQ4_XS `quantize_iq4_nl` /
`quantize_iq4_xs` without an importance matrix (what llama-quantize calls; IQ4_NL's
`_ref` searches fewer scales); it first checks that ggml's bytes equal gguf-py's for the
types both quantize. The lattice i-quants (IQ1_S .. IQ3_S) have dequantize vectors only:
ggml quantizes them with an importance matrix. Their random blocks index every point of
their grid, so the vectors check every entry of graft's tables (scripts/make-iq-tables.py). The committed vectors were made with the
ggml 0.25.3 sources vendored in the llama-cpp-python 0.3.36 sdist
(`pip download llama-cpp-python==0.3.36 --no-deps --no-binary llama-cpp-python`, then
`--ggml-src <unpacked>/vendor/llama.cpp/ggml`).

Output, under tests/fixtures/quant/ (all little-endian):
- quantize-inputs.f32: ROWS x COLS f32 rows (random normal at several scales, outliers,
  all-equal rows, zero blocks, tiny and f16-subnormal magnitudes, exact rounding ties);
- <type>.quantized.bin: gguf's quantization of those rows, ROWS x row_bytes(COLS) bytes
  (ggml's C reference for the types gguf-py cannot quantize);
- <type>.blocks.bin: random *valid* blocks of the type (random bytes, every f16 field set
  to a finite value of a sane magnitude);
- <type>.dequantized.f32: gguf's dequantization of those blocks;
- manifest.json: the sizes, the seed, the gguf/numpy versions and which types each
  operation covered.

Re-run from the repository root (deterministic: same bytes for the same gguf/numpy):
    pip install gguf numpy
    python3 scripts/make-quant-vectors.py [--ggml-src DIR]
"""

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
from importlib.metadata import version

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = os.path.join("tests", "fixtures", "quant")
SEED = 20261123
ROWS, COLS = 32, 256

# (type, random blocks for the dequantize vectors)
TYPES = [
    (T.Q4_0, 64),
    (T.Q4_1, 64),
    (T.Q5_0, 64),
    (T.Q5_1, 64),
    (T.Q8_0, 64),
    (T.Q8_1, 64),
    (T.Q4_K, 16),
    (T.Q5_K, 16),
    (T.Q6_K, 16),
    (T.Q2_K, 16),
    (T.Q3_K, 16),
    (T.IQ4_NL, 64),
    (T.IQ4_XS, 16),
    (T.IQ2_XXS, 16),
    (T.IQ2_XS, 16),
    (T.IQ2_S, 32),
    (T.IQ3_XXS, 16),
    (T.IQ3_S, 16),
    (T.IQ1_S, 64),
    (T.IQ1_M, 64),
    (T.TQ1_0, 16),
    (T.TQ2_0, 16),
]

# (elements, bytes) per block. gguf-py's table still gives Q8_1 its old layout with f32
# `d` and `s` (40 bytes); ggml's block_q8_1 has been two f16 (36 bytes) for long.
SIZES = {**quants.GGML_QUANT_SIZES, T.Q8_1: (32, 36)}

# Byte offsets of the f16 fields in each block, and whether the field may be negative.
F16_FIELDS = {
    T.Q4_0: [(0, True)],
    T.Q4_1: [(0, False), (2, True)],
    T.Q5_0: [(0, True)],
    T.Q5_1: [(0, False), (2, True)],
    T.Q8_0: [(0, True)],
    T.Q8_1: [(0, False), (2, True)],
    T.Q4_K: [(0, False), (2, False)],
    T.Q5_K: [(0, False), (2, False)],
    T.Q6_K: [(208, True)],
    T.Q2_K: [(80, False), (82, False)],
    T.Q3_K: [(108, True)],
    T.IQ4_NL: [(0, True)],
    T.IQ4_XS: [(0, True)],
    T.IQ2_XXS: [(0, False)],
    T.IQ2_XS: [(0, False)],
    T.IQ2_S: [(0, False)],
    T.IQ3_XXS: [(0, False)],
    T.IQ3_S: [(0, False)],
    T.IQ1_S: [(0, False)],
    T.IQ1_M: [],  # its d is spread over the scales' top nibbles: see random_blocks
    T.TQ1_0: [(52, False)],
    T.TQ2_0: [(64, False)],
}


def u16_field(blocks, off):
    return blocks[:, off].astype(np.uint32) | (blocks[:, off + 1].astype(np.uint32) << 8)


def set_u16_field(blocks, off, v):
    blocks[:, off] = v & 0xFF
    blocks[:, off + 1] = (v >> 8) & 0xFF


def set_bits(blocks, off, shift, width, v):
    """Bits shift..shift + width of byte off of every block to v."""
    mask = ((1 << width) - 1) << shift
    blocks[:, off] = (blocks[:, off] & (0xFF ^ mask)) | ((v << shift) & mask)


def iq_index_setters():
    """Per lattice type: (grid points, slots per block, set(blocks, slot, index))."""

    def iq2_xxs(b, k, v):
        b[:, 2 + 8 * (k // 4) + k % 4] = v

    def iq2_xs(b, k, v):
        off = 2 + 2 * k
        set_u16_field(b, off, (u16_field(b, off) & (0xFFFF ^ 511)) | v)

    def iq2_s(b, k, v):
        ib, l = divmod(k, 4)
        b[:, 2 + k] = v & 0xFF
        set_bits(b, 66 + ib, 2 * l, 2, v >> 8)

    def iq3_xxs(b, k, v):
        b[:, 2 + k] = v

    def iq3_s(b, k, v):
        ib, r = divmod(k, 8)
        b[:, 2 + k] = v & 0xFF
        set_bits(b, 66 + ib, r, 1, v >> 8)

    def iq1_s(b, k, v):
        ib, l = divmod(k, 4)
        b[:, 2 + k] = v & 0xFF
        off = 34 + 2 * ib
        h = u16_field(b, off)
        set_u16_field(b, off, (h & (0xFFFF ^ (7 << (3 * l)))) | ((v >> 8) << (3 * l)))

    def iq1_m(b, k, v):
        ib, l = divmod(k, 4)
        b[:, k] = v & 0xFF
        set_bits(b, 32 + 2 * ib + l // 2, 4 * (l % 2), 3, v >> 8)

    return {
        T.IQ2_XXS: (256, 32, iq2_xxs),
        T.IQ2_XS: (512, 32, iq2_xs),
        T.IQ2_S: (1024, 32, iq2_s),
        T.IQ3_XXS: (256, 64, iq3_xxs),
        T.IQ3_S: (512, 64, iq3_s),
        T.IQ1_S: (2048, 32, iq1_s),
        T.IQ1_M: (2048, 32, iq1_m),
    }


def input_rows(rng):
    """ROWS x COLS f32 values covering the cases where quantizers differ."""
    rows = []
    for scale in (1e-3, 0.02, 1.0, 100.0):
        rows.append(rng.normal(0.0, scale, COLS))
        rows.append(rng.normal(0.5 * scale, scale, COLS))  # shifted: mins matter
    for _ in range(4):  # outliers
        r = rng.normal(0.0, 1.0, COLS)
        idx = rng.choice(COLS, 6, replace=False)
        r[idx] *= rng.choice([-60.0, 40.0, 25.0], 6)
        rows.append(r)
    for c in (0.0, 1.0, -3.25, 7e-4, 12345.0):  # all-equal rows
        rows.append(np.full(COLS, c))
    for _ in range(3):  # zero blocks between random ones
        r = rng.normal(0.0, 1.0, COLS)
        for b in rng.choice(COLS // 32, 3, replace=False):
            r[32 * b : 32 * b + 32] = 0.0
        rows.append(r)
    rows.append(rng.normal(0.0, 1e-6, COLS))  # scales in f16's subnormal range
    rows.append(rng.normal(0.0, 1e-9, COLS))  # scales that round to zero in f16
    rows.append(rng.uniform(-1.0, 1.0, COLS) ** 3)  # many values near zero
    # Exact ties for every rounding rule: multiples of 0.5 with amax 127 (Q8_0's d = 1),
    # and of 1/16 with the largest magnitude -8 (Q4_0's d = 1).
    r = rng.integers(-254, 255, COLS) * 0.5
    r[::32] = 127.0
    rows.append(r)
    r = rng.integers(-128, 129, COLS) / 16.0
    r[5::32] = -8.0
    rows.append(r)
    r = rng.normal(0.0, 1.0, COLS)
    r[::2] = -r[1::2]  # symmetric pairs: the first of equal magnitudes wins
    rows.append(r)
    rows.append(rng.standard_t(2.0, COLS))  # heavy tails
    rows.append(np.abs(rng.normal(0.0, 1.0, COLS)) + 2.0)  # all positive, min > 0
    rows.append(-np.abs(rng.normal(0.0, 1.0, COLS)) - 2.0)  # all negative
    rows.append(rng.normal(0.0, 1e4, COLS))  # large magnitudes (f16 scales stay finite)
    # every 32-element block at its own scale: the K-quants' sub-block scales differ
    rows.append(rng.normal(0.0, 1.0, COLS) * np.repeat(10.0 ** rng.uniform(-3, 2, COLS // 32), 32))
    r = np.zeros(COLS)  # one non-zero value per 16 elements
    r[rng.integers(0, 16) :: 16] = rng.normal(0.0, 1.0, COLS // 16)
    rows.append(r)
    assert len(rows) == ROWS, len(rows)
    return np.stack(rows).astype(np.float32)


def sane_f16(rng, n, signed):
    """n f16 scales of sane magnitudes as u16 bits, the first one zero."""
    v = np.exp(rng.uniform(np.log(1e-4), np.log(2.0), n))
    if signed:
        v *= rng.choice([-1.0, 1.0], n)
    v[0] = 0.0  # a zero scale / min
    return v.astype(np.float16).view(np.uint16).astype(np.uint32)


def random_blocks(rng, qtype, n):
    """n random valid blocks: random bytes, f16 fields finite with sane magnitudes; the
    lattice types' indices a shuffled run over every grid point."""
    _, size = SIZES[qtype]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off, signed in F16_FIELDS[qtype]:
        set_u16_field(blocks, off, sane_f16(rng, n, signed))
    if qtype == T.IQ1_M:  # d's nibbles at the top of the four u16 scales
        d = sane_f16(rng, n, False)
        for i in range(4):
            set_bits(blocks, 48 + 2 * i + 1, 4, 4, (d >> (4 * i)) & 0xF)
    if qtype in iq_index_setters():
        points, slots, put = iq_index_setters()[qtype]
        assert n * slots >= points, f"{qtype.name}: {n} blocks cannot index every point"
        order = np.concatenate([rng.permutation(points) for _ in range(-(-n * slots // points))])
        for k in range(slots):
            put(blocks, k, order[k::slots][:n].astype(np.uint32))
    return blocks


def try_op(fn, *args):
    """gguf's result, or None where this gguf version does not implement the type."""
    try:
        return fn(*args)
    except NotImplementedError:
        return None


# Stand-ins for the few ggml.c functions that ggml-quants.c links against; the reference
# row quantizers never call them.
GGML_STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) {
    fprintf(stderr, "ggml_abort at %s:%d\n", file, line);
    abort();
}
size_t ggml_row_size(int type, long long ne) {
    switch (type) {  /* the types whose quantize_* asks: Q2_K and Q3_K */
        case 10: return (size_t) ne / 256 * 84;
        case 11: return (size_t) ne / 256 * 110;
        default: abort();
    }
}
size_t ggml_type_size(int type) { (void) type; abort(); }
const char *ggml_type_name(int type) { (void) type; return "?"; }
"""

# The reference quantizers this script calls, by type.
GGML_REF = {
    T.Q4_0: "quantize_row_q4_0_ref",
    T.Q4_1: "quantize_row_q4_1_ref",
    T.Q5_0: "quantize_row_q5_0_ref",
    T.Q5_1: "quantize_row_q5_1_ref",
    T.Q8_0: "quantize_row_q8_0_ref",
    T.Q8_1: "quantize_row_q8_1_ref",
    T.Q4_K: "quantize_row_q4_K_ref",
    T.Q5_K: "quantize_row_q5_K_ref",
    T.Q6_K: "quantize_row_q6_K_ref",
    T.Q2_K: "quantize_row_q2_K_ref",
    T.Q3_K: "quantize_row_q3_K_ref",
    T.IQ4_NL: "quantize_iq4_nl",
    T.IQ4_XS: "quantize_iq4_xs",
    T.TQ1_0: "quantize_row_tq1_0_ref",
    T.TQ2_0: "quantize_row_tq2_0_ref",
}

# The quantizers above that take (src, dst, nrow, n_per_row, imatrix), llama-quantize's
# entry points; the others take (src, dst, n).
GGML_CHUNK = {T.IQ4_NL, T.IQ4_XS}


def build_ggml_ref(src, tmp):
    """Compiles src/ggml-quants.c of the ggml folder `src` into a shared library."""
    stubs = os.path.join(tmp, "stubs.c")
    with open(stubs, "w") as f:
        f.write(GGML_STUBS)
    lib = os.path.join(tmp, "libggml-quants-ref.so")
    inc = [f"-I{os.path.join(src, d)}" for d in ("include", "src", os.path.join("src", "ggml-cpu"))]
    cmd = ["cc", "-O2", "-ffp-contract=off", "-fPIC", "-shared", *inc,
           os.path.join(src, "src", "ggml-quants.c"), stubs, "-o", lib, "-lm"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(lib)


def ggml_quantize(lib, qtype, x):
    """ggml's reference quantization of the rows of x."""
    block, size = SIZES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // block * size, dtype=np.uint8)
    fn = getattr(lib, GGML_REF[qtype])
    if qtype in GGML_CHUNK:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = ctypes.c_size_t
        fn(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], None)
    else:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        fn(x.ctypes.data, out.ctypes.data, x.size)
    return out.reshape(x.shape[0], -1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml-src", help="a ggml source folder, for the types gguf-py cannot quantize")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(SEED)
    x = input_rows(rng)
    x.astype("<f4").tofile(os.path.join(OUT, "quantize-inputs.f32"))
    tmp = tempfile.TemporaryDirectory()
    lib = build_ggml_ref(args.ggml_src, tmp.name) if args.ggml_src else None
    quantized, quantized_ggml, dequantized = [], [], []
    for qtype, n_blocks in TYPES:
        name = qtype.name.lower()
        q = try_op(quants.quantize, x, qtype)
        ref = ggml_quantize(lib, qtype, x) if lib is not None and qtype in GGML_REF else None
        if q is not None and ref is not None and not np.array_equal(q, ref):
            raise SystemExit(f"{name}: gguf-py and ggml's reference disagree")
        if q is not None:
            quantized.append(name)
        elif ref is not None:
            q = ref
            quantized_ggml.append(name)
        if q is not None:
            q.astype(np.uint8).tofile(os.path.join(OUT, f"{name}.quantized.bin"))
        blocks = random_blocks(rng, qtype, n_blocks)
        y = try_op(quants.dequantize, blocks, qtype)
        if y is not None:
            blocks.tofile(os.path.join(OUT, f"{name}.blocks.bin"))
            y.astype("<f4").tofile(os.path.join(OUT, f"{name}.dequantized.f32"))
            dequantized.append(name)
    manifest = {
        "generator": "scripts/make-quant-vectors.py",
        "gguf": version("gguf"),
        "numpy": np.__version__,
        "seed": SEED,
        "rows": ROWS,
        "cols": COLS,
        "quantized": quantized,
        "quantized_by_ggml_ref": quantized_ggml,
        "ggml_ref_flags": "-O2 -ffp-contract=off" if lib is not None else None,
        "dequantized": dequantized,
    }
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
