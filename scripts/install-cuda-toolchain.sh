#!/usr/bin/env bash
# Installs the CUDA compiler (nvcc 13.0.88, ptxas, fatbinary, NVVM) and the CUDA headers
# from PyPI wheels into a local folder, so the `cuda` feature builds on a machine without a
# CUDA toolkit. No GPU or driver is needed to compile.
#
# Why 13.0.88: the GPU machines run driver 580 (CUDA 13.0). Kernels are embedded as SASS
# plus PTX; a newer nvcc emits PTX that this driver refuses to JIT.
#
# Usage: scripts/install-cuda-toolchain.sh [DIR]
#   DIR defaults to $GRAFT_CUDA_DIR, else $HOME/.cache/graft-cuda-13.0.
# At the end it prints the `export CUDA_HOME=...` line to use; build.rs also finds the
# toolchain in the default folder without it (through the DIR/cuda link made here).
set -euo pipefail

VERSION=13.0.88
DIR="${1:-${GRAFT_CUDA_DIR:-$HOME/.cache/graft-cuda-13.0}}"
PYTHON="${PYTHON:-python3}"

die() { echo "install-cuda-toolchain: error: $*" >&2; exit 1; }

# The wheels put the toolkit under lib/pythonX.Y/site-packages/nvidia/cu13.
find_cuda_home() {
    local d
    for d in "$DIR"/lib/python3*/site-packages/nvidia/cu13; do
        if [ -x "$d/bin/nvcc" ]; then echo "$d"; return 0; fi
    done
    return 1
}

nvcc_ok() {
    local home="$1"
    "$home/bin/nvcc" --version 2>/dev/null | grep -q "release 13.0, V$VERSION"
}

if home="$(find_cuda_home)" && nvcc_ok "$home"; then
    echo "install-cuda-toolchain: nvcc $VERSION already installed in $home"
else
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=...)"
    echo "install-cuda-toolchain: installing nvcc $VERSION into $DIR (about 500 MB)"
    mkdir -p "$DIR"
    if [ ! -x "$DIR/bin/pip" ]; then
        "$PYTHON" -m venv "$DIR" || die "could not create a virtual environment in $DIR"
    fi
    "$DIR/bin/pip" install --disable-pip-version-check -q \
        "nvidia-cuda-nvcc==$VERSION" "nvidia-nvvm==$VERSION" \
        "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" \
        || die "pip install of the CUDA wheels failed"
    home="$(find_cuda_home)" || die "nvcc not found under $DIR after installing the wheels"
    nvcc_ok "$home" || die "$home/bin/nvcc does not report version $VERSION: $("$home/bin/nvcc" --version 2>&1 | tail -n 2)"
fi

# A stable path for build.rs's fallback search.
ln -sfn "$home" "$DIR/cuda"

# Smoke test: compile a trivial kernel for sm_90.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
printf '#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* x) { x[0] = __float2half(1.0f); }\n' > "$tmp/k.cu"
"$home/bin/nvcc" --fatbin -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 "$tmp/k.cu" -o "$tmp/k.fatbin" \
    || die "nvcc could not compile a test kernel (is a host C++ compiler, g++, installed?)"

echo "install-cuda-toolchain: ok: $("$home/bin/nvcc" --version | tail -n 1)"
echo "export CUDA_HOME=$home"
