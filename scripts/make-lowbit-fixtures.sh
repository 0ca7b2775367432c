#!/usr/bin/env bash
# Writes tests/fixtures/llama-quantize/: a random Llama-shaped F16 GGUF
# (scripts/peer/make-random-gguf.py --preset lowbit: one layer of rows of 256 elements, 64
# tokens) and llama.cpp's quantizations of it, one file per low-bit type, made the way
# published files are: llama-imatrix over a text of seeded random tokens, then
# llama-quantize with that importance matrix (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M need
# one; every type takes it). manifest.json lists each file's tensor types and the SHA-256
# of gguf-py's dequantization of each quantized tensor. tests/models/llama_quantize.rs
# loads each file, checks graft's dequantization against those, and compares its logits
# with the F16 file's, read into F32.
#
# mixes.json: the type llama-quantize --dry-run (no importance matrix, as graft quantizes)
# gives each tensor of two 16-layer shapes (make-random-gguf.py's mixes-gqa and mixes-mha)
# in each of ggml's mixes graft makes; src/models/load/quant_plan.rs checks its rules
# against it.
#
#   scripts/make-lowbit-fixtures.sh LLAMA_BIN [OUT]
#
# LLAMA_BIN: a folder with llama.cpp's llama-imatrix and llama-quantize (the bin folder of
# scripts/peer/build-llamacpp.sh --cpu). Needs numpy and the `gguf` package.
set -euo pipefail
die() { echo "make-lowbit-fixtures: error: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: $0 LLAMA_BIN [OUT]"
bin=$(realpath "$1")
out=${2:-tests/fixtures/llama-quantize}
for t in llama-imatrix llama-quantize; do
    [ -x "$bin/$t" ] || die "no $bin/$t: build llama.cpp's $t into that folder"
done
# The llama-quantize file types, one a file: each low-bit block type is the main type of one
# (IQ2_S of IQ2_M; llama-quantize's IQ2_S is mostly IQ2_XS).
TYPES="Q2_K Q3_K_M IQ4_NL IQ4_XS IQ3_XXS IQ3_S IQ2_XXS IQ2_XS IQ2_M IQ1_S IQ1_M TQ1_0 TQ2_0"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
rm -f "$out"/*.gguf
python3 scripts/peer/make-random-gguf.py "$out/f16.gguf" --preset lowbit --seed 7 --char-vocab
# 1,024 seeded random words of the vocabulary's characters (one piece each), no newline.
python3 -c '
import random, sys
r = random.Random(11)
chars = "abcdefghijklmnopqrstuvwxyz0123456789"
words = ("".join(r.choice(chars) for _ in range(r.randint(1, 7))) for _ in range(1024))
sys.stdout.write(" ".join(words))' > "$tmp/text.txt"
# Both tools run in $tmp with relative names: the files record the imatrix's and the text's
# names, which should not depend on where the temporary folder was.
src=$(realpath "$out/f16.gguf")
dst=$(realpath "$out")
(cd "$tmp" && "$bin/llama-imatrix" -m "$src" -f text.txt -o imatrix.gguf -c 128 -t 2 \
    > imatrix.log 2>&1) || { cat "$tmp/imatrix.log"; die "llama-imatrix failed"; }
for t in $TYPES; do
    f="$dst/$(echo "$t" | tr 'A-Z' 'a-z').gguf"
    (cd "$tmp" && "$bin/llama-quantize" --imatrix imatrix.gguf "$src" "$f" "$t" 2 \
        > quantize.log 2>&1) || { cat "$tmp/quantize.log"; die "llama-quantize $t failed"; }
done
MIXES="Q2_K Q3_K_S Q3_K_M Q3_K_L IQ4_NL IQ4_XS Q4_K_M Q5_K_M"
for shape in mixes-gqa mixes-mha; do
    python3 scripts/peer/make-random-gguf.py "$tmp/$shape.gguf" --preset "$shape" > /dev/null
    for t in $MIXES; do
        "$bin/llama-quantize" --dry-run "$tmp/$shape.gguf" "$t" > "$tmp/$shape-$t.log" 2>&1 \
            || { cat "$tmp/$shape-$t.log"; die "llama-quantize --dry-run $t failed"; }
    done
done
python3 - "$tmp" "$out/mixes.json" "$MIXES" <<'PY'
import json, re, sys
tmp, path, mixes = sys.argv[1], sys.argv[2], sys.argv[3].split()
# "[   3/ 146] token_embd.weight  - [ 256, 64, 1, 1], type = f16, size = ... -> ... (q3_K)"
line = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- .*\((\w+)\)\s*$")
shapes = {}
for shape, dims in (("mixes-gqa", (256, 512, 16, 8, 2, 64)), ("mixes-mha", (256, 288, 16, 4, 4, 64))):
    d, ff, layers, heads, kv, vocab = dims
    types = {}
    for t in mixes:
        with open(f"{tmp}/{shape}-{t}.log", errors="replace") as f:
            types[t] = {m[1]: m[2].upper() for m in map(line.match, f) if m}
    shapes[shape] = {"hidden": d, "ff": ff, "layers": layers, "heads": heads, "kv_heads": kv,
                     "vocab": vocab, "types": types}
with open(path, "w") as f:
    json.dump({"generator": "scripts/make-lowbit-fixtures.sh (llama-quantize --dry-run)",
               "shapes": shapes}, f, indent=1)
    f.write("\n")
PY
version=$(grep -m1 -o 'version: .*' "$tmp/quantize.log" || echo unknown)
python3 - "$out" "$version" "$TYPES" <<'EOF'
import hashlib, json, os, sys
import gguf
import numpy as np
out, version, types = sys.argv[1], sys.argv[2], sys.argv[3].split()
plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
files = {}
for t in types:
    name = t.lower() + ".gguf"
    r = gguf.GGUFReader(os.path.join(out, name))
    # gguf-py's dequantization of each block-quantized tensor, as the SHA-256 of its
    # little-endian F32 values.
    sha = {x.name: hashlib.sha256(gguf.quants.dequantize(x.data, x.tensor_type)
                                  .astype("<f4").tobytes()).hexdigest()
           for x in r.tensors if x.tensor_type not in plain}
    files[name] = {"ftype": t, "tensor_types": sorted({x.tensor_type.name for x in r.tensors}),
                   "dequantized_sha256": sha}
manifest = {
    "generator": "scripts/make-lowbit-fixtures.sh",
    "source": "f16.gguf: scripts/peer/make-random-gguf.py --preset lowbit --seed 7 --char-vocab",
    "llama.cpp": version,
    "imatrix": "llama-imatrix -c 128 over 1,024 seeded random words",
    "files": files,
}
with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")
EOF
du -sh "$out"
