#!/usr/bin/env bash
# Builds scripts/decode-chain.cu (what bounds a small decode product in a replayed graph:
# the tree's Q4_0 products in chains of dependent nodes, the floor of an empty node with
# the same grid, and the variants docs/benchmarks.md reports) into one static binary that
# needs only the GPU driver, so it can be carried to a GPU machine and run there:
#   scripts/decode-chain.sh [OUT]       build OUT (default .gpu/decode-chain)
#   OUT [NODES]                         on the GPU machine: markdown tables, exit 1 when a
#                                       variant's result differs from the tree's kernel
# Needs nvcc 13.0 (scripts/install-cuda-toolchain.sh; NVCC or CUDA_HOME, else its folder)
# and rustc.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/.gpu/decode-chain}"
die() { echo "decode-chain: error: $*" >&2; exit 1; }
NVCC="${NVCC:-}"
if [ -z "$NVCC" ]; then
    for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" "$HOME/.cache/graft-cuda-13.0/cuda/bin/nvcc"; do
        if [ -n "$c" ] && [ -x "$c" ]; then NVCC="$c"; break; fi
    done
fi
[ -n "$NVCC" ] || die "nvcc not found: run scripts/install-cuda-toolchain.sh"
HOME_DIR="$(cd "$(dirname "$NVCC")/.." && pwd)"
mkdir -p "$(dirname "$OUT")"
# The headers build.rs generates for cuda/ (the kernel instances, the argument layout):
# build.rs built on its own writes them.
GEN="$(mktemp -d)"
trap 'rm -rf "$GEN"' EXIT
command -v rustc >/dev/null || die "rustc not found (it builds build.rs, which writes the generated headers)"
rustc --edition 2021 "$ROOT/build.rs" -o "$GEN/gen" || die "rustc failed on build.rs"
"$GEN/gen" "$ROOT/cuda" "$GEN/cuda-gen" || die "build.rs could not write the generated headers"
"$NVCC" -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -I"$ROOT/cuda" -I"$GEN/cuda-gen" "$ROOT/scripts/decode-chain.cu" \
    -o "$OUT" -cudart static -L"$HOME_DIR/lib" -L"$HOME_DIR/lib64" \
    || die "nvcc failed"
strip "$OUT"
echo "decode-chain: built $OUT"
