#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for SECONDS_PER_TARGET seconds (default 60) and
# prints each one's executions and findings. Needs cargo-fuzz (`cargo install cargo-fuzz`);
# stable rustc runs libFuzzer's sanitizer flags with RUSTC_BOOTSTRAP=1.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Seeds: fuzz/corpus/<target>/seed-* (committed); libFuzzer adds what it finds to the
# same folder (ignored by git). A crash lands in fuzz/artifacts/<target>/: copy it to
# fuzz/regressions/<target>/ with the fix, and `cargo test --test text_io fuzz_corpus` replays it.
set -uo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors_config gguf gguf_tokenizer chat_template)
export RUSTC_BOOTSTRAP=1
status=0
summary=()
for t in "${targets[@]}"; do
    log="$(mktemp)"
    mkdir -p "corpus/$t" "artifacts/$t"
    before=$(ls "artifacts/$t" | wc -l)
    # -rss_limit_mb: an input may not make graft allocate more than 2 GB;
    # -timeout: one input may not take more than 10 s (a hang is a finding).
    cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 \
        -timeout=10 -max_len=65536 -print_final_stats=1 >"$log" 2>&1
    rc=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    after=$(ls "artifacts/$t" | wc -l)
    found=$((after - before))
    summary+=("$t: ${execs:-?} executions in ${secs}s, $found findings (exit $rc)")
    if [ "$rc" -ne 0 ] || [ "$found" -ne 0 ]; then
        status=1
        tail -40 "$log"
    fi
    rm -f "$log"
done
printf '%s\n' "${summary[@]}"
exit $status
