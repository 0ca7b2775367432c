#!/usr/bin/env bash
# Builds the release GPU test binaries (the test crates `cuda`, tests/cuda, and `models`,
# tests/models: the model fixtures and tensor parallelism on the GPU; the crates `cli`,
# `ops` and `text_io` spawn the graft binary or read the source tree, so they run with
# cargo) and the `graft` binary with the `cuda` feature, strips them, and puts them with
# runner scripts into one folder that runs on a GPU machine without cargo:
#   BUNDLE/tests/NAME      test binaries
#   BUNDLE/bin/graft
#   BUNDLE/run-tests.sh    every test binary (GRAFT_REQUIRE_GPU=1), a summary table;
#                          --bench also runs the op benchmark
#   BUNDLE/run-sanitizer.sh TOOL  the test binaries under compute-sanitizer (memcheck,
#                          racecheck, synccheck, initcheck); run-memcheck.sh = memcheck
#   BUNDLE/run-tp-bench.sh  --tp over the machine's GPUs: llama2-7b F16 at --tp 1 and 2,
#                          llama2-70b F16 at --tp 2 (needs 2 GPUs of 80+ GB each)
#   BUNDLE/env.sh          sourced by the runners: CUDA's and NCCL's libraries on the
#                          loader's path (a libnccl.so link to the libnccl.so.2 of
#                          NVIDIA's nvidia-nccl wheel where the system has none), and
#                          GRAFT_REQUIRE_GPUS set to the GPUs present
#   BUNDLE.tar.xz          all of it packed, the file to carry to the GPU machine
#
# Usage: scripts/gpu-bundle.sh [BUNDLE]   (default .gpu/bundle)
# Needs nvcc (see scripts/install-cuda-toolchain.sh); GRAFT_BUNDLE_TESTS, a regular
# expression over test crate names, replaces the default "^(cuda|models)$". Run the
# bundle from the repository root (the fixture tests read tests/fixtures there).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUNDLE="${1:-$ROOT/.gpu/bundle}"
PATTERN="${GRAFT_BUNDLE_TESTS:-^(cuda|models)\$}"
cd "$ROOT"

die() { echo "gpu-bundle: error: $*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 is needed to read cargo's JSON"

echo "gpu-bundle: building release test binaries (cargo test --release --features cuda --no-run)"
json="$(mktemp)"
trap 'rm -f "$json"' EXIT
cargo test --release --features cuda --no-run --message-format=json > "$json" \
    || die "cargo test --no-run failed"
echo "gpu-bundle: building graft"
cargo build --release --features cuda --bin graft \
    || die "cargo build failed"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/tests" "$BUNDLE/bin"

# name<TAB>path of every integration test executable whose name matches PATTERN.
python3 - "$json" "$PATTERN" > "$BUNDLE/.tests" <<'PY'
import json, re, sys
pattern = re.compile(sys.argv[2])
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if not m.get("profile", {}).get("test"):
        continue
    t = m["target"]
    if "test" not in t.get("kind", []) or not pattern.search(t["name"]):
        continue
    if t["name"] not in seen:
        seen.add(t["name"])
        print(f'{t["name"]}\t{m["executable"]}')
PY
[ -s "$BUNDLE/.tests" ] || die "no test binary matches '$PATTERN'"
while IFS=$'\t' read -r name path; do
    cp "$path" "$BUNDLE/tests/$name"
done < "$BUNDLE/.tests"
rm "$BUNDLE/.tests"
cp target/release/graft "$BUNDLE/bin/graft"
strip "$BUNDLE"/tests/* "$BUNDLE"/bin/*

cat > "$BUNDLE/env.sh" <<'RUN'
# Sourced by the bundle's runners (see gpu-bundle.sh).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL for --tp over GPUs: cudarc asks the loader for libnccl.so; NVIDIA's wheel (and
# most packages) install only libnccl.so.2, so a link to it goes into the bundle.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
    nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)"
    [ -f "$nccl" ] || nccl="$(ldconfig -p 2>/dev/null | sed -nE 's/.*libnccl\.so\.2 .*=> (.*)/\1/p' | head -n 1)"
    if [ -f "$nccl" ]; then
        mkdir -p "$HERE/nccl"
        ln -sf "$nccl" "$HERE/nccl/libnccl.so"
        export LD_LIBRARY_PATH="$HERE/nccl:$LD_LIBRARY_PATH"
    fi
fi
# NVLink multicast off whatever the caller set (graft also forces it before NCCL starts).
export NCCL_NVLS_ENABLE=0
GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
export GRAFT_REQUIRE_GPUS="${GPUS:-0}"
RUN

cat > "$BUNDLE/run-tp-bench.sh" <<'RUN'
#!/usr/bin/env bash
# Tensor parallelism over the GPUs of this machine, as benchmark figures: Llama-2-7B F16
# at --tp 1 and --tp 2 (the speed-up), and Llama-2-70B F16 (140 GB: it fits only split)
# at --tp 2 against the two GPUs' combined copy bandwidth. Random weights made on the
# GPUs. Extra arguments go to every bench (e.g. -n 64).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/env.sh"
LOGS="${OUT:-$HERE/logs}"
mkdir -p "$LOGS"
[ "$GRAFT_REQUIRE_GPUS" -ge 2 ] || { echo "run-tp-bench: needs 2 GPUs, found $GRAFT_REQUIRE_GPUS"; exit 1; }
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(-p 512 -n 128)
status=0
for run in "llama2-7b 1" "llama2-7b 2" "llama2-70b 2"; do
    read -r preset tp <<< "$run"
    echo "=== graft bench --preset $preset --dtype f16 --backend cuda --tp $tp ${ARGS[*]}"
    "$HERE/bin/graft" bench --preset "$preset" --dtype f16 --backend cuda --tp "$tp" "${ARGS[@]}" \
        --json > "$LOGS/tp-$preset-$tp.json" || { status=1; continue; }
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("prompt %.1f tok/s, generation %.1f tok/s, %d devices, roofline %s" % (d["prompt_tokens_per_s"], d["gen_tokens_per_s"], d["devices"], "%.1f%%" % (100*d["roofline_fraction"]) if d["roofline_fraction"] else "?"))' "$LOGS/tp-$preset-$tp.json"
done
exit $status
RUN

cat > "$BUNDLE/run-tests.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every GPU test binary of this bundle (failing loudly), prints a summary table;
# with --bench, then runs the op benchmark. Logs go to $OUT (if set) or ./logs.
# Extra arguments after the options are passed to every test binary (e.g. a filter).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BENCH=0
if [ "${1:-}" = "--bench" ]; then BENCH=1; shift; fi
source "$HERE/env.sh"
export GRAFT_REQUIRE_GPU=1
export RUST_BACKTRACE=1
[ -d tests/fixtures ] && export GRAFT_FIXTURES="$PWD/tests/fixtures"
LOGS="${OUT:-$HERE/logs}"
mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

status=0
rows=()
for t in "$HERE"/tests/*; do
    name="$(basename "$t")"
    log="$LOGS/$name.log"
    start=$(date +%s)
    "$t" --test-threads=1 "$@" > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    result="$(grep -E '^test result:' "$log" | tail -n 1)"
    passed="$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<< "$result")"
    failed="$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<< "$result")"
    if [ $rc -ne 0 ]; then
        status=1
        echo "=== FAILED: $name (exit $rc), last lines of $log:"
        tail -n 80 "$log"
    fi
    if grep -q "skipped: no GPU" "$log"; then status=1; echo "=== $name skipped its GPU tests"; fi
    rows+=("$(printf '| %-24s | %6s | %6s | %5s | %4ss |' "$name" "${passed:-?}" "${failed:-?}" "$rc" "$secs")")
done

echo
echo "| test binary              | passed | failed |  exit | time |"
echo "| ------------------------ | -----: | -----: | ----: | ---: |"
printf '%s\n' "${rows[@]}"
if [ $status -eq 0 ]; then echo "ALL GPU TESTS PASSED"; else echo "GPU TESTS FAILED"; fi

if [ $BENCH -eq 1 ]; then
    echo
    "$HERE/bin/graft" bench-ops --json-out "$LOGS/bench.json" || status=1
fi
exit $status
RUN

cat > "$BUNDLE/run-sanitizer.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU test binaries of this bundle under one compute-sanitizer tool (memcheck,
# racecheck, synccheck or initcheck; slow). BINARIES, a regular expression over binary
# names, narrows the binaries (default all); further arguments go to every test binary
# (a test-name filter). Fails when any tool run reports an error.
#   run-sanitizer.sh initcheck
#   BINARIES='^cuda$' run-sanitizer.sh racecheck ops_cuda_quant::
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
TOOL="${1:?usage: run-sanitizer.sh memcheck|racecheck|synccheck|initcheck [TEST_FILTER]}"
shift
source "$HERE/env.sh"
export GRAFT_REQUIRE_GPU=1
[ -d tests/fixtures ] && export GRAFT_FIXTURES="$PWD/tests/fixtures"
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
[ -x "$SAN" ] || { echo "run-sanitizer: compute-sanitizer not found"; exit 1; }
case "$TOOL" in
    memcheck) opts=(--leak-check no) ;;
    racecheck) opts=(--racecheck-report hazard) ;;
    synccheck|initcheck) opts=() ;;
    *) echo "run-sanitizer: unknown tool '$TOOL'"; exit 2 ;;
esac
LOGS="${OUT:-$HERE/logs}"
mkdir -p "$LOGS"
status=0
for t in "$HERE"/tests/*; do
    name="$(basename "$t")"
    [[ "$name" =~ ${BINARIES:-.} ]] || continue
    log="$LOGS/$name.$TOOL.log"
    start=$(date +%s)
    "$SAN" --tool "$TOOL" "${opts[@]}" --error-exitcode 99 "$t" --test-threads=1 "$@" > "$log" 2>&1
    rc=$?
    summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)"
    printf '%-24s %-9s exit %3s %5ss  %s\n' "$name" "$TOOL" "$rc" "$(( $(date +%s) - start ))" "${summary:-no summary}"
    if [ $rc -ne 0 ]; then status=1; tail -n 60 "$log"; fi
done
[ $status -eq 0 ] && echo "${TOOL^^} CLEAN" || echo "${TOOL^^} FOUND ERRORS"
exit $status
RUN

cat > "$BUNDLE/run-memcheck.sh" <<'RUN'
#!/usr/bin/env bash
# compute-sanitizer memcheck over every GPU test binary (see run-sanitizer.sh).
exec "$(dirname "$0")/run-sanitizer.sh" memcheck "$@"
RUN
chmod +x "$BUNDLE/run-tests.sh" "$BUNDLE/run-memcheck.sh" "$BUNDLE/run-sanitizer.sh" \
    "$BUNDLE/run-tp-bench.sh"

echo "gpu-bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE:"
ls -la "$BUNDLE/tests" "$BUNDLE/bin"
# What travels to the GPU machine: the folder packed with xz (about a fifth of its size),
# unpacked there with `tar xJf BUNDLE.tar.xz -C PARENT`.
tar cJf "$BUNDLE.tar.xz" -C "$(dirname "$BUNDLE")" "$(basename "$BUNDLE")"
size=$(du -sm "$BUNDLE.tar.xz" | cut -f1)
echo "gpu-bundle: $BUNDLE.tar.xz is ${size} MiB"
# Kept under 56 MiB, so that with what travels beside it (the packed llama.cpp source of
# scripts/peer/fetch-llamacpp.sh is about 4.5) it fits a 64 MiB transfer to a GPU machine.
[ "$size" -lt 56 ] || die "the packed bundle is ${size} MiB, over the 56 MiB budget"
