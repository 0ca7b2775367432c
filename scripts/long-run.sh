#!/usr/bin/env bash
# Long-run memory check: generates N tokens (default 100,000) from the committed tiny Llama 3
# fixture with a small context (default 256) and --context-shift, so the run passes the
# context hundreds of times and visits every decode bucket over and over, and samples the
# process's resident memory (VmRSS) every SECONDS (default 2). Prints the samples, then the
# growth from the first sample after warm-up (a tenth of the run) to the last.
# Usage: scripts/long-run.sh [N] [CTX] [SECONDS]   (BACKEND=cuda for the GPU build;
# GRAFT_BIN names the binary, default target/release/graft, built when absent.)
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-100000}"; CTX="${2:-256}"; EVERY="${3:-2}"; BACKEND="${BACKEND:-cpu}"
BIN="${GRAFT_BIN:-target/release/graft}"
[ -x "$BIN" ] || cargo build --release
samples="$(mktemp)"
trap 'rm -f "$samples"' EXIT
start=$(date +%s)
"$BIN" generate --model tests/fixtures/llama3-tiny-bf16 --token-ids 1,2,3 -n "$N" --ctx "$CTX" \
    --context-shift --ignore-eos --temperature 0.8 --seed 7 --backend "$BACKEND" > /dev/null &
pid=$!
echo "| seconds | VmRSS (KiB) |"
echo "| ---: | ---: |"
while kill -0 "$pid" 2>/dev/null; do
    rss="$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)"
    if [ -n "$rss" ]; then
        echo "| $(( $(date +%s) - start )) | $rss |"
        echo "$rss" >> "$samples"
    fi
    sleep "$EVERY"
done
wait "$pid" || { echo "long-run: graft failed"; exit 1; }
secs=$(( $(date +%s) - start ))
count=$(wc -l < "$samples")
[ "$count" -ge 3 ] || { echo "long-run: too few samples ($count); use a larger N"; exit 1; }
warm=$(sed -n "$(( count / 10 + 1 ))p" "$samples")
last=$(tail -n 1 "$samples")
max=$(sort -n "$samples" | tail -n 1)
echo "long-run: $N tokens in ${secs} s on $BACKEND, context $CTX; VmRSS after warm-up ${warm} KiB," \
     "at the end ${last} KiB (growth $(( last - warm )) KiB), peak ${max} KiB"
