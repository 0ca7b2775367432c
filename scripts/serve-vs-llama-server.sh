#!/usr/bin/env bash
# graft serve and llama-server on the same GGUF file, one after the other on this machine,
# each measured by `graft serve-bench` with the same requests: streamed greedy requests
# with ignore_eos, N output tokens each, the same prompts, at each concurrency level. Both
# get as many sequences at once as the largest level and the same context per sequence
# (llama-server's -c is split across its -np slots, so it gets CTX times the slots). Needs
# no network: only the two binaries and the file.
#
#   scripts/serve-vs-llama-server.sh --llama-server BIN --model FILE.gguf [options]
#
#   --llama-server BIN  llama.cpp's server (scripts/peer/build-llamacpp.sh builds one)
#   --model FILE        the GGUF file both serve
#   --graft BIN         graft binary (default target/release/graft; built with
#                       --features cuda when absent, unless --cpu)
#   --cpu               both on the CPU (default: CUDA, all layers on GPU 0)
#   -c LEVELS           concurrency levels (default 1,8,32,64)
#   -n N                output tokens per request (default 128)
#   --prompt-tokens P   prompts of P token ids drawn from [3, --vocab) (default 128); the
#                       right choice for random-weight files, whose vocabulary is synthetic
#   --vocab V           (default 32000, Llama 2's; fits Llama 3's)
#   --words W           chat prompts of W words instead of token ids (real models)
#   --ctx C             context per sequence (default 2048)
#   --out DIR           both servers' logs and tables (default: a new folder in /tmp)
#
# e.g. on an H200, with a random Llama-2-7B file from scripts/peer/make-random-gguf.py:
#   scripts/serve-vs-llama-server.sh --llama-server ~/.cache/graft-peer/build-cuda/bin/llama-server \
#       --model ~/.cache/graft-peer/llama2-7b-q4_0.gguf
# Prints one serve-bench table per server (output tok/s, TTFT and TPOT at p50/p99) and
# keeps them and both servers' logs in --out.
set -euo pipefail
die() { echo "serve-vs-llama-server: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

llama="" model="" graft="" cpu=0 levels=1,8,32,64 n=128 tokens=128 vocab=32000 words=""
ctx=2048 out=""
while [ $# -gt 0 ]; do
    opt="$1"
    [ $# -ge 2 ] || case "$opt" in --cpu|-h|--help) ;; *) die "$opt needs a value (--help)" ;; esac
    case "$opt" in
        --llama-server) llama="$2"; shift ;;
        --model) model="$2"; shift ;;
        --graft) graft="$2"; shift ;;
        --cpu) cpu=1 ;;
        -c) levels="$2"; shift ;;
        -n) n="$2"; shift ;;
        --prompt-tokens) tokens="$2"; shift ;;
        --vocab) vocab="$2"; shift ;;
        --words) words="$2"; shift ;;
        --ctx) ctx="$2"; shift ;;
        --out) out="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $opt (--help)" ;;
    esac
    shift
done
[ -n "$llama" ] || die "--llama-server BIN is required (--help)"
[ -n "$model" ] || die "--model FILE.gguf is required (--help)"
[ -x "$llama" ] || die "--llama-server $llama is not an executable file"
[ -f "$model" ] || die "--model $model is not a file"
for v in n tokens vocab ctx; do
    [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive whole number, got '${!v}'"
done
[[ "$levels" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "-c must be like 1,8,32,64, got '$levels'"
slots=$(tr ',' '\n' <<<"$levels" | sort -n | tail -1)
out="${out:-$(mktemp -d /tmp/serve-vs-llama-server.XXXXXX)}"
mkdir -p "$out"

if [ -z "$graft" ]; then
    graft="$ROOT/target/release/graft"
    if [ ! -x "$graft" ]; then
        features=(); [ $cpu = 1 ] || features=(--features cuda)
        (cd "$ROOT" && cargo build --release "${features[@]}")
    fi
fi
[ -x "$graft" ] || die "--graft $graft is not an executable file"

gpu_graft=(--backend cuda); gpu_llama=(-ngl 99)
[ $cpu = 0 ] || { gpu_graft=(--backend cpu); gpu_llama=(-ngl 0); }
prompts=(--prompt-tokens "$tokens" --vocab "$vocab")
[ -z "$words" ] || prompts=(--prompt-words "$words")
bench=("$graft" serve-bench -c "$levels" -n "$n" "${prompts[@]}" --wait 900)

# run NAME PORT SERVER-COMMAND...: starts the server, benchmarks it (the table into
# $out/NAME.md too), stops it; a server that exits first fails the run.
run() {
    local name="$1" port="$2"
    shift 2
    echo "## $name: $*"
    "$@" --port "$port" >"$out/$name.log" 2>&1 &
    local pid=$!
    "${bench[@]}" --url "http://127.0.0.1:$port" >"$out/$name.md" &
    local bpid=$! rc=0
    while kill -0 "$bpid" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            kill "$bpid" 2>/dev/null || true
            die "$name exited before the benchmark ended; its log: $out/$name.log"
        fi
        sleep 1
    done
    wait "$bpid" || rc=$?
    cat "$out/$name.md"
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    [ $rc = 0 ] || die "serve-bench against $name failed (exit $rc); its log: $out/$name.log"
    echo
}

run graft 18180 "$graft" serve --model "$model" "${gpu_graft[@]}" --parallel "$slots" \
    --ctx "$ctx" --kv-size $((slots * ctx)) --alias model
run llama-server 18181 "$llama" -m "$model" "${gpu_llama[@]}" -np "$slots" \
    -c $((slots * ctx)) -fa on --no-webui
echo "logs and tables in $out"
