#!/usr/bin/env bash
# Gets llama.cpp's source, the peer graft is measured against, from PyPI: the sdist of
# llama-cpp-python carries a copy of llama.cpp in vendor/llama.cpp. The copy is trimmed to
# what a build of llama-bench, llama-batched-bench, llama-quantize and llama-server needs
# (about 30 MB), so it can travel to a GPU machine with the repository.
#
#   scripts/peer/fetch-llamacpp.sh [DEST]      default DEST: .gpu/llama.cpp (ignored by git)
#
# LLAMA_CPP_PYTHON (default 0.3.36, which vendors the llama.cpp of 2026-10) picks the sdist.
# Needs python3 with pip and access to PyPI; replaces DEST if it exists.
set -euo pipefail
die() { echo "fetch-llamacpp: error: $*" >&2; exit 1; }
[ $# -le 1 ] || die "expected at most one argument (DEST), got $#"
DEST="${1:-.gpu/llama.cpp}"
VERSION="${LLAMA_CPP_PYTHON:-0.3.36}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest "$work" \
    "llama-cpp-python==$VERSION" || die "pip could not download llama-cpp-python==$VERSION"
sdist="$(find "$work" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)"
[ -n "$sdist" ] || die "no llama_cpp_python sdist among what pip downloaded into $work"
tar -xzf "$sdist" -C "$work"
vendored="$(find "$work" -mindepth 3 -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -n 1)"
[ -n "$vendored" ] || die "$sdist has no vendor/llama.cpp"

rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
cp -r "$vendored" "$DEST"
cd "$DEST"

# Not needed to build the tools: models, docs, examples, tests, CI files.
rm -rf models docs benches examples tests media pocs skills ci .devops
# Backends other than the CPU's and CUDA's: empty folders keep their CMake paths valid.
for backend in cann et hexagon metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
    rm -rf "ggml/src/ggml-$backend"
    mkdir -p "ggml/src/ggml-$backend"
done
# llama-server embeds a web UI built with npm. Keep its CMake files and put a placeholder
# page, plus the file names the embedding step looks for, where the built UI would be.
rm -rf tools/server/webui
if [ -d tools/ui ]; then
    find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name 'ui.*.in' \
        ! -name sources.cmake -exec rm -rf {} +
    mkdir -p tools/ui/dist
    echo '<!doctype html><title>llama-server</title>' > tools/ui/dist/index.html
    for f in manifest.webmanifest sw.js build.json version.json bundle.js bundle.css workbox.js; do
        echo '{}' > "tools/ui/dist/$f"
    done
fi
echo "fetch-llamacpp: llama.cpp from llama-cpp-python $VERSION in $DEST ($(du -sh . | cut -f1))"
