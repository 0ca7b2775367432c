#!/usr/bin/env bash
# graft serve and llama-server on the same GGUF file, one after the other on this machine,
# each measured by `graft serve-bench` with the same requests (streamed greedy chat, ignore_eos,
# N output tokens, the same prompts). Both get the same sequences at once (the largest
# concurrency) and the same context per sequence (llama-server's -c is split across its -np
# slots, so it gets CTX times the slots).
# Usage: scripts/serve-vs-llama-server.sh GRAFT LLAMA_SERVER MODEL.gguf [cpu|cuda] [LEVELS] [N]
#   e.g. scripts/serve-vs-llama-server.sh target/release/graft ~/.cache/llamacpp-cpu-server/bin/llama-server \
#        ~/.cache/graft/SmolLM2-135M-Instruct.Q4_1.gguf cpu 1,8 128
set -euo pipefail
GRAFT="$1"; LLAMA="$2"; MODEL="$3"; BACKEND="${4:-cpu}"; LEVELS="${5:-1,8,32,64}"; N="${6:-128}"
CTX=1024
SLOTS=$(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -1)
GPORT=18180; LPORT=18181

# Waits for URL/health to answer 200 (the model loaded), up to 10 minutes.
wait_ready() {
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "no answer from $1/health" >&2; return 1
}

gpu_graft=(); gpu_llama=()
if [ "$BACKEND" = cuda ]; then gpu_graft=(--backend cuda); gpu_llama=(-ngl 99); fi

echo "## graft serve ($BACKEND)"
set -x
"$GRAFT" serve --model "$MODEL" "${gpu_graft[@]}" --port $GPORT --parallel "$SLOTS" --ctx $CTX \
  --kv-size $((SLOTS * CTX)) --alias model 2>/tmp/graft-serve.log &
{ set +x; } 2>/dev/null
gpid=$!
wait_ready http://127.0.0.1:$GPORT
"$GRAFT" serve-bench --url http://127.0.0.1:$GPORT -c "$LEVELS" -n "$N" --model model
kill -TERM $gpid; wait $gpid || true

echo; echo "## llama-server ($BACKEND)"
set -x
"$LLAMA" -m "$MODEL" "${gpu_llama[@]}" --port $LPORT -np "$SLOTS" -c $((SLOTS * CTX)) -fa on \
  --no-webui 2>/tmp/llama-server.log &
{ set +x; } 2>/dev/null
lpid=$!
wait_ready http://127.0.0.1:$LPORT
"$GRAFT" serve-bench --url http://127.0.0.1:$LPORT -c "$LEVELS" -n "$N"
kill -TERM $lpid; wait $lpid || true
