//! Mistral: Llama with sliding-window attention. The window (`sliding_window` in the
//! config, `llama.attention.sliding_window` in GGUF) limits what a query sees: key `j`
//! is visible to query `i` when `i - window < j <= i`. llama.cpp writes Mistral as a
//! `llama` GGUF file.

use super::Spec;

/// Mistral: Llama's blocks and names; the window comes from the config.
pub const SPEC: Spec = Spec {
    name: "mistral",
    hf_model_types: &["mistral"],
    ..super::llama::SPEC
};
