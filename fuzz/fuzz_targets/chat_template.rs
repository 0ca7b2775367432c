//! Fuzz target: `graft::fuzz::chat_template` (errors are fine; a panic, abort or hang is a finding).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = graft::fuzz::chat_template(data);
});
