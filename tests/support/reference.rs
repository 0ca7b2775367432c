//! The HF reference data of a committed model fixture (`reference.json` and
//! `reference.safetensors`, made by scripts/make-fixtures.py) and the error measures the
//! model tests compare with. Included as a module by the tests that need it.

use std::path::PathBuf;

/// One fixture folder and its reference data.
pub struct Reference {
    pub name: &'static str,
    pub dir: PathBuf,
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// HF's greedy continuation.
    pub greedy: Vec<u32>,
    /// HF's top-1 minus top-2 logit at each greedy step.
    pub margins: Vec<f32>,
    /// HF float32 logits of every prompt position, `[n_tokens][vocab]` flattened.
    pub logits: Vec<f32>,
}

/// The committed fixtures.
pub const FIXTURES: [&str; 11] = [
    "llama2-tiny-f32",
    "llama3-tiny-bf16",
    "llama3-tiny-f16",
    "qwen3-tiny-f32",
    "qwen3-tiny-bf16",
    "qwen2-tiny-f32",
    "mistral-tiny-f32",
    "gpt2-tiny-f32",
    "qwen3moe-tiny-f32",
    "qwen3moe-tiny-bf16",
    "mixtral-tiny-f32",
];

/// Whether fixture `name` is a mixture of experts (which runs on one device: no
/// tensor parallelism).
pub fn has_experts(name: &str) -> bool {
    name.starts_with("qwen3moe") || name.starts_with("mixtral")
}

/// Fixture `name`'s folder, its `reference.json` and the bytes of its
/// `reference.safetensors`.
pub fn reference_files(name: &str) -> (PathBuf, serde_json::Value, Vec<u8>) {
    let dir = super::fixtures::fixture(name);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    (dir, json, bytes)
}

/// The token ids of `reference.json`'s list `key`.
pub fn ids(json: &serde_json::Value, key: &str) -> Vec<u32> {
    json[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Reads fixture `name`'s reference data.
pub fn reference(name: &'static str) -> Reference {
    let (dir, json, bytes) = reference_files(name);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    Reference {
        name,
        tokens: ids(&json, "tokens"),
        greedy: ids(&json, "greedy_tokens"),
        margins: json["greedy_margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect(),
        logits: f32_data(&logits),
        dir,
    }
}

/// The values of an F32 safetensors tensor.
pub fn f32_data(t: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[path = "metrics.rs"]
mod metrics;
pub use metrics::nmse;
