//! The engine's memory through the `graft` binary: a long prompt runs in chunks, in
//! bounded memory.

use crate::fixtures::fixture;

/// A long prompt is computed in chunks of `--ubatch` tokens: its memory is bounded by
/// the chunk, not by the prompt. A 6,000-token prompt on the tiny fixture peaks under
/// 64 MiB of resident memory (a whole-prompt prefill's mask alone would be 137 MiB).
#[test]
fn a_long_prompt_runs_in_bounded_memory() {
    let ids: Vec<String> = (0..6_000).map(|i| (3 + i % 500).to_string()).collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["generate", "--model"])
        .arg(fixture("llama3-tiny-bf16"))
        .args(["--ctx", "6100", "-n", "2", "--json", "--token-ids"])
        .arg(ids.join(","))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peak = j["host_peak_rss_bytes"]
        .as_u64()
        .expect("the peak is reported");
    assert!(peak < 64 << 20, "peak resident memory {} MiB", peak >> 20);
}
