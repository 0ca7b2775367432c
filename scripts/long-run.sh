#!/usr/bin/env bash
# Long-run memory check: generates N tokens (default 100,000) from the committed tiny Llama 3
# fixture with a small context (default 256) and --context-shift, so the run passes the
# context hundreds of times and visits every decode bucket over and over, and samples the
# process's resident memory (VmRSS) every SECONDS (default 2). Prints the samples, then the
# growth from the first sample after warm-up (a tenth of the run) to the last.
# Usage: scripts/long-run.sh [N] [CTX] [SECONDS]   (BACKEND=cuda for the GPU build;
# GRAFT_BIN names the binary, default target/release/graft, built when absent;
# MODEL_ARGS replaces the model, e.g. MODEL_ARGS="--preset mistral-7b --quantize q4_k_m"
# for a 7B preset with random weights; CHAT=K runs `graft chat` instead: N/200 turns of
# up to 200 tokens, a /reset every K turns.) On CUDA the samples also give the process's GPU
# memory (nvidia-smi's memory.used of GPU 0, which the run
# is assumed to have to itself).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-100000}"; CTX="${2:-256}"; EVERY="${3:-2}"; BACKEND="${BACKEND:-cpu}"
BIN="${GRAFT_BIN:-target/release/graft}"
[ -x "$BIN" ] || cargo build --release
samples="$(mktemp)"
trap 'rm -f "$samples"' EXIT
start=$(date +%s)
MODEL_ARGS="${MODEL_ARGS:---model tests/fixtures/llama3-tiny-bf16}"
# shellcheck disable=SC2086 # MODEL_ARGS is a list of arguments
if [ -n "${CHAT:-}" ]; then
    # a conversation: N / 200 user turns of up to 200 reply tokens each, a /reset every
    # CHAT turns (keep CHAT * ~210 below CTX); the chat prints its reply and token totals
    turns="$(mktemp)"
    trap 'rm -f "$samples" "$turns"' EXIT
    for ((t = 1; t <= N / 200; t++)); do
        echo "tell me about turn $t"
        (( t % CHAT == 0 )) && echo "/reset"
    done > "$turns"
    "$BIN" chat $MODEL_ARGS -n 200 --ctx "$CTX" --temperature 0.8 --seed 7 \
        --backend "$BACKEND" < "$turns" > /dev/null &
else
    "$BIN" generate $MODEL_ARGS --token-ids 1,2,3 -n "$N" --ctx "$CTX" \
        --context-shift --ignore-eos --temperature 0.8 --seed 7 --backend "$BACKEND" > /dev/null &
fi
pid=$!
gpu_mib() {
    [ "$BACKEND" = cuda ] || { echo "-"; return; }
    # the whole GPU's used memory: the run is the only process on the device
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null || echo "-"
}
echo "| seconds | VmRSS (KiB) | GPU memory (MiB) |"
echo "| ---: | ---: | ---: |"
while kill -0 "$pid" 2>/dev/null; do
    rss="$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)"
    if [ -n "$rss" ]; then
        gpu="$(gpu_mib)"
        echo "| $(( $(date +%s) - start )) | $rss | $gpu |"
        echo "$rss $gpu" >> "$samples"
    fi
    sleep "$EVERY"
done
wait "$pid" || { echo "long-run: graft failed"; exit 1; }
secs=$(( $(date +%s) - start ))
count=$(wc -l < "$samples")
[ "$count" -ge 3 ] || { echo "long-run: too few samples ($count); use a larger N"; exit 1; }
warm_line=$(sed -n "$(( count / 10 + 1 ))p" "$samples")
last_line=$(tail -n 1 "$samples")
warm=${warm_line% *}; last=${last_line% *}
max=$(cut -d' ' -f1 "$samples" | sort -n | tail -n 1)
echo "long-run: $N tokens in ${secs} s on $BACKEND, context $CTX; VmRSS after warm-up ${warm} KiB," \
     "at the end ${last} KiB (growth $(( last - warm )) KiB), peak ${max} KiB"
if [ "$BACKEND" = cuda ]; then
    echo "long-run: GPU memory after warm-up ${warm_line#* } MiB, at the end ${last_line#* } MiB," \
         "peak $(cut -d' ' -f2 "$samples" | grep -v '^-$' | sort -n | tail -n 1) MiB"
fi
