#!/usr/bin/env python3
"""Writes the quantization test vectors of tests/quant.rs with llama.cpp's own gguf-py.

The vectors come from an implementation graft did not write: the `gguf` package's
`gguf.quants.quantize` / `gguf.quants.dequantize` (numpy ports of ggml's reference
code, kept bit-exact with ggml-quants.c by llama.cpp's own tests).

Written with gguf 0.19.0 and numpy 2.4. That gguf version
- quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (not Q8_1, and none of the K-quants);
- dequantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (not Q8_1).
The script asks the installed version what it supports and records it in the manifest,
so a newer gguf that quantizes more types adds their vectors on the next run. Q8_1 is
covered in the Rust test through Q8_0 (same `d` and quants; `s` is checked from its
definition).

Output, under tests/fixtures/quant/ (all little-endian):
- quantize-inputs.f32: ROWS x COLS f32 rows (random normal at several scales, outliers,
  all-equal rows, zero blocks, tiny and f16-subnormal magnitudes, exact rounding ties);
- <type>.quantized.bin: gguf's quantization of those rows, ROWS x row_bytes(COLS) bytes;
- <type>.blocks.bin: random *valid* blocks of the type (random bytes, every f16 field set
  to a finite value of a sane magnitude);
- <type>.dequantized.f32: gguf's dequantization of those blocks;
- manifest.json: the sizes, the seed, the gguf/numpy versions and which types each
  operation covered.

Re-run from the repository root (deterministic: same bytes for the same gguf/numpy):
    pip install gguf numpy
    python3 scripts/make-quant-vectors.py
"""

import json
import os
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
]

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


def random_blocks(rng, qtype, n):
    """n random valid blocks: random bytes, f16 fields finite with sane magnitudes."""
    _, size = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off, signed in F16_FIELDS[qtype]:
        v = np.exp(rng.uniform(np.log(1e-4), np.log(2.0), n))
        if signed:
            v *= rng.choice([-1.0, 1.0], n)
        v[0] = 0.0  # a zero scale / min
        blocks[:, off : off + 2] = v.astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks


def try_op(fn, *args):
    """gguf's result, or None where this gguf version does not implement the type."""
    try:
        return fn(*args)
    except NotImplementedError:
        return None


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(SEED)
    x = input_rows(rng)
    x.astype("<f4").tofile(os.path.join(OUT, "quantize-inputs.f32"))
    quantized, dequantized = [], []
    for qtype, n_blocks in TYPES:
        name = qtype.name.lower()
        q = try_op(quants.quantize, x, qtype)
        if q is not None:
            q.astype(np.uint8).tofile(os.path.join(OUT, f"{name}.quantized.bin"))
            quantized.append(name)
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
        "dequantized": dequantized,
    }
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
