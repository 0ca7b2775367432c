#!/usr/bin/env bash
# graft against llama.cpp on the same machine, on the same GGUF files, in one run: gets
# and builds llama.cpp (scripts/peer/fetch-llamacpp.sh, build-llamacpp.sh) when needed,
# writes random Llama-shaped files (make-random-gguf.py, then llama-quantize), runs
# llama-bench and `graft bench` on each file, and prints both figures side by side
# (table.py). The figures in docs/benchmarks.md come from this script.
#
#   scripts/peer/compare.sh [options]
#
#   --cpu             llama.cpp's CPU build and graft's CPU backend (default: CUDA, GPU 0)
#   --model FILE      time this GGUF file (repeatable) instead of random ones
#   --preset NAME     shape of the random files: llama2-7b (default), llama3-8b, tiny, or
#                     the mixtures of experts qwen3-30b-a3b and tiny-moe
#   --types "T ..."   their types (default "f16 q8_0 q4_0 q4_k_m"; F16 is written, the
#                     others quantized from it by llama-quantize; for a mixture of
#                     experts "q8_0 q4_k_m", Q8_0 written directly (the 30 B model is 61 GB
#                     in F16) and the others requantized from it). The types that need an
#                     importance matrix (iq3_xxs, iq2_*, iq1_*, q2_k_s) get a flat one
#                     (make-flat-imatrix.py: every column equally important)
#   -p N, -n N        prompt tokens and generated tokens (default 512 and 128)
#   --depth D         also time generation after D tokens (llama-bench -d D, before and
#                     after graft's run; graft bench -d D); the main tg runs from an
#                     empty context in both (llama-bench's tg, graft bench's default -d 0)
#   --cache TYPE      K/V cache type for both: f16 (default), q8_0 or q4_0
#   --reps R          llama-bench repetitions (default 3; 2 for each of the two runs at a
#                     depth)
#   --threads T       threads with --cpu (default: every core)
#   --src DIR         llama.cpp source (default .gpu/llama.cpp; fetched when absent)
#   --graft BIN       graft binary (default target/release/graft, built when absent)
#   --dry-run         print every command instead of running it
#
# PEER_DIR (default ${XDG_CACHE_HOME:-~/.cache}/graft-peer) holds the builds, the GGUF
# files and results/, the raw JSON of every run. Needs what the scripts above need, and
# for random files python3 with numpy and gguf (python3 -m pip install gguf numpy).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
die() { echo "compare: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
count() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 needs a positive whole number, got '$2'"; }

cpu=0 dry=0 models=() preset=llama2-7b types="" p=512 n=128 depth=""
cache=f16 reps=3 threads="$(nproc)" src="" graft=""
while [ $# -gt 0 ]; do
    opt="$1"
    case "$opt" in
        --cpu) cpu=1; shift; continue ;;
        --dry-run) dry=1; shift; continue ;;
        -h|--help) usage; exit 0 ;;
        --model|--preset|--types|-p|-n|--depth|--cache|--reps|--threads|--src|--graft)
            [ $# -ge 2 ] || die "$opt needs a value (--help)"
            val="$2"; shift 2 ;;
        *) die "unknown argument '$opt' (--help)" ;;
    esac
    case "$opt" in
        --model) models+=("$val") ;;
        --preset) case "$val" in llama2-7b|llama3-8b|tiny|qwen3-30b-a3b|tiny-moe) preset="$val" ;;
                  *) die "--preset $val: expected llama2-7b, llama3-8b, tiny, qwen3-30b-a3b or tiny-moe" ;; esac ;;
        --types) types="$val"; [ -n "$types" ] || die "--types needs at least one type" ;;
        -p) count -p "$val"; p="$val" ;;
        -n) count -n "$val"; n="$val" ;;
        --depth) count --depth "$val"; depth="$val" ;;
        --cache) case "$val" in f16|q8_0|q4_0) cache="$val" ;;
                 *) die "--cache $val: expected f16, q8_0 or q4_0" ;; esac ;;
        --reps) count --reps "$val"; reps="$val" ;;
        --threads) count --threads "$val"; threads="$val" ;;
        --src) src="$val" ;;
        --graft) graft="$val" ;;
    esac
done
for m in "${models[@]}"; do
    [ $dry = 1 ] || [ -f "$m" ] || die "--model $m: no such file"
done

PEER_DIR="${PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/graft-peer}"
kind=cuda; [ $cpu = 1 ] && kind=cpu
src="${src:-$ROOT/.gpu/llama.cpp}"
bin="$PEER_DIR/build-$kind/bin"
graft="${graft:-$ROOT/target/release/graft}"
raw="$PEER_DIR/results/$(date -u +%Y%m%dT%H%M%SZ)-$kind"

# Runs a command, its stdout into $1 (stdout and stderr for a .log file; the terminal
# for '-'); prints it instead with --dry-run.
run() {
    local to="$1"; shift
    if [ $dry = 1 ]; then
        printf '+'; printf ' %q' "$@"; [ "$to" = - ] || printf ' > %q' "$to"; echo
    elif [ "$to" = - ]; then
        "$@"
    elif [[ "$to" == *.log ]]; then
        "$@" > "$to" 2>&1
    else
        "$@" > "$to"
    fi
}

# llama.cpp: source and tools.
[ -f "$src/CMakeLists.txt" ] || run - "$HERE/fetch-llamacpp.sh" "$src"
build=("$HERE/build-llamacpp.sh"); [ $cpu = 1 ] && build+=(--cpu)
[ -x "$bin/llama-bench" ] || run - "${build[@]}" "$src" "$PEER_DIR/build-$kind"

# graft.
if [ ! -x "$graft" ]; then
    features=(); [ $cpu = 1 ] || features=(--features cuda)
    run - cargo build --release "${features[@]}" --manifest-path "$ROOT/Cargo.toml" --bin graft
fi

# The files: the base type written by make-random-gguf.py (F16; Q8_0 for a mixture of
# experts), the others quantized from it.
base=f16 requant=()
case "$preset" in qwen3-30b-a3b|tiny-moe) base=q8_0 requant=(--allow-requantize) ;; esac
[ -n "$types" ] || { [ $base = f16 ] && types="f16 q8_0 q4_0 q4_k_m" || types="q8_0 q4_k_m"; }
if [ ${#models[@]} -eq 0 ]; then
    first="$PEER_DIR/$preset-$base.gguf"
    if [ ! -f "$first" ]; then
        run - env PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}" \
            python3 "$HERE/make-random-gguf.py" "$first" --preset "$preset" --type "$base"
    fi
    for t in $types; do
        f="$PEER_DIR/$preset-$t.gguf"
        # the types llama-quantize makes only with an importance matrix: a flat one
        imatrix=()
        case "$t" in iq3_xxs|iq2_xxs|iq2_xs|iq2_s|iq1_s|iq1_m|q2_k_s)
            flat="$PEER_DIR/$preset-flat.imatrix"
            [ -f "$flat" ] || run - env PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}" \
                python3 "$HERE/make-flat-imatrix.py" "$first" "$flat"
            imatrix=(--imatrix "$flat") ;;
        esac
        if [ "$t" != $base ] && [ ! -f "$f" ]; then
            run "$PEER_DIR/quantize-$t.log" "$bin/llama-quantize" "${requant[@]}" "${imatrix[@]}" \
                "$first" "$f" "$t" "$(nproc)" \
                || die "llama-quantize to $t failed: $PEER_DIR/quantize-$t.log"
        fi
        models+=("$f")
    done
fi

# The runs: llama.cpp, then graft, on each file. Flash attention on in both (graft's
# default; on the CPU llama.cpp's own default, which turns it on where it can).
llama_dev=(-fa 1 -ngl 99) graft_dev=(--backend cuda) graft_env=()
if [ $cpu = 1 ]; then
    llama_dev=(-t "$threads") graft_dev=(--backend cpu) graft_env=(env "RAYON_NUM_THREADS=$threads")
fi
caches=(); gcaches=()
if [ "$cache" != f16 ]; then
    caches=(-ctk "$cache" -ctv "$cache") gcaches=(--cache-type-k "$cache" --cache-type-v "$cache")
fi
run - mkdir -p "$raw"
for m in "${models[@]}"; do
    stem="$(basename "$m" .gguf)"
    llama=("$bin/llama-bench" -m "$m" "${llama_dev[@]}" "${caches[@]}" -o json)
    ours=("${graft_env[@]}" "$graft" bench --model "$m" "${graft_dev[@]}" "${gcaches[@]}" --json)
    run "$raw/llama.$stem.main.json" "${llama[@]}" -r "$reps" -p "$p" -n "$n"
    run "$raw/graft.$stem.main.json" "${ours[@]}" -p "$p" -n "$n"
    if [ -n "$depth" ]; then
        run "$raw/llama.$stem.d$depth.a.json" "${llama[@]}" -r 2 -p 0 -n "$n" -d "$depth"
        run "$raw/graft.$stem.d$depth.json" "${ours[@]}" -p "$p" -d "$depth" -n "$n" --reps 1
        run "$raw/llama.$stem.d$depth.b.json" "${llama[@]}" -r 2 -p 0 -n "$n" -d "$depth"
    fi
done
# the commit the graft binary was built from (graft --version: "graft 0.1.0 (abc1234)"),
# else the tree's
rev="$("$graft" --version 2>/dev/null | sed -n 's/.*(\(.*\)).*/\1/p' || true)"
[ -n "$rev" ] && [ "$rev" != unknown ] || rev="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
run - python3 "$HERE/table.py" "$raw" --graft-rev "$rev"
