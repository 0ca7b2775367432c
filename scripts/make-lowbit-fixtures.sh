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
#   scripts/make-lowbit-fixtures.sh LLAMA_BIN [OUT]
#
# LLAMA_BIN: a folder with llama.cpp's llama-imatrix and llama-quantize (the bin folder of
# scripts/peer/build-llamacpp.sh --cpu). Needs numpy and the `gguf` package.
set -euo pipefail
die() { echo "make-lowbit-fixtures: error: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: $0 LLAMA_BIN [OUT]"
bin=$1
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
"$bin/llama-imatrix" -m "$out/f16.gguf" -f "$tmp/text.txt" -o "$tmp/imatrix.gguf" -c 128 \
    -t 2 > "$tmp/imatrix.log" 2>&1 || { cat "$tmp/imatrix.log"; die "llama-imatrix failed"; }
for t in $TYPES; do
    f="$out/$(echo "$t" | tr 'A-Z' 'a-z').gguf"
    "$bin/llama-quantize" --imatrix "$tmp/imatrix.gguf" "$out/f16.gguf" "$f" "$t" 2 \
        > "$tmp/quantize.log" 2>&1 || { cat "$tmp/quantize.log"; die "llama-quantize $t failed"; }
done
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
