#!/usr/bin/env bash
# Builds llama.cpp's tools from a source folder (scripts/peer/fetch-llamacpp.sh makes one):
# llama-bench, llama-batched-bench, llama-server, llama-quantize and llama-imatrix, static, into
# BUILD/bin. A second run rebuilds only what changed.
#
#   scripts/peer/build-llamacpp.sh [--cpu] [--dry-run] SRC [BUILD]
#
#   --cpu      no CUDA: the CPU backend only (default BUILD: $PEER_DIR/build-cpu)
#   (default)  CUDA for the architectures in CUDA_ARCHS (default 90; BUILD: $PEER_DIR/build-cuda)
#   --dry-run  print the cmake commands instead of running them
#
# PEER_DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/graft-peer. Needs cmake and a C++
# compiler (and nvcc for CUDA: scripts/install-cuda-toolchain.sh installs one). On 16
# cores a CUDA build takes about 5 minutes; on 2 cores a CPU build about 10.
set -euo pipefail
die() { echo "build-llamacpp: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

cpu=0 dry=0 args=()
for a in "$@"; do
    case "$a" in
        --cpu) cpu=1 ;;
        --dry-run) dry=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $a (options: --cpu, --dry-run)" ;;
        *) args+=("$a") ;;
    esac
done
[ ${#args[@]} -ge 1 ] && [ ${#args[@]} -le 2 ] || die "expected SRC [BUILD], got ${#args[@]} arguments (--help)"
SRC="${args[0]}"
[ -f "$SRC/CMakeLists.txt" ] && [ -d "$SRC/tools/llama-bench" ] \
    || die "$SRC is not a llama.cpp source folder (run scripts/peer/fetch-llamacpp.sh)"
PEER_DIR="${PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/graft-peer}"
kind=cuda; [ $cpu = 1 ] && kind=cpu
BUILD="${args[1]:-$PEER_DIR/build-$kind}"

opts=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF)
if [ $cpu = 1 ]; then
    # Every vector extension this CPU has, named one by one: GGML_NATIVE would also turn on
    # AMX where the CPU reports it, and llama.cpp's AMX path crashed on a 2-core Xeon
    # that reports it (2026-12-02).
    opts+=(-DGGML_CUDA=OFF -DGGML_NATIVE=OFF)
    for flag in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512_vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        if grep -qw "${flag%%:*}" /proc/cpuinfo 2>/dev/null; then opts+=("-DGGML_${flag#*:}=ON"); fi
    done
else
    opts+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90}" -DGGML_NATIVE=ON)
fi
targets=(llama-bench llama-batched-bench llama-server llama-quantize llama-imatrix)
configure=(cmake -S "$SRC" -B "$BUILD" "${opts[@]}")
build=(cmake --build "$BUILD" -j "$(nproc)" --target "${targets[@]}")

if [ $dry = 1 ]; then
    echo "${configure[*]}"
    echo "${build[*]}"
    exit 0
fi
command -v cmake >/dev/null || die "cmake not found (apt-get install cmake, or python3 -m pip install cmake)"
mkdir -p "$BUILD"
start=$SECONDS
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    "${configure[@]}" > "$BUILD/configure.log" 2>&1 \
        || { tail -n 30 "$BUILD/configure.log" >&2; die "cmake configure failed ($BUILD/configure.log)"; }
fi
"${build[@]}" > "$BUILD/build.log" 2>&1 \
    || { grep -m 20 -i 'error' "$BUILD/build.log" >&2; die "build failed ($BUILD/build.log)"; }
for t in "${targets[@]}"; do [ -x "$BUILD/bin/$t" ] || die "the build made no $BUILD/bin/$t"; done
echo "build-llamacpp: $kind tools in $BUILD/bin ($((SECONDS - start)) s)"
