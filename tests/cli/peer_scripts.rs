//! The scripts that compare graft with llama.cpp (`scripts/peer/`) pass their own checks
//! (`selftest.sh`: table.py on recorded results, the commands compare.sh and
//! build-llamacpp.sh would run, their refusals of bad arguments, the random GGUF files and
//! the flat importance matrix read back), so they cannot drift from the tools between the
//! runs on a GPU machine that use them. Needs bash; the checks that need python3's `gguf`
//! package or shellcheck say "skipped" without them.

use std::process::Command;

#[test]
fn the_peer_scripts_pass_their_self_test() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/peer/selftest.sh"))
        .current_dir(root)
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "selftest.sh failed:\n{stdout}\n{stderr}"
    );
    let summary = stdout.lines().last().unwrap_or("");
    assert!(
        summary.ends_with(" passed, 0 failed") && !summary.starts_with("0 passed"),
        "selftest.sh summary: {summary:?}\n{stderr}"
    );
}
