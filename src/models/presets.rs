//! Named model shapes for benchmarks (`graft bench --preset NAME`): the published
//! configurations of Llama 2 7B and Llama 3 8B, and a tiny Llama 3 style model that runs
//! anywhere. Benchmarks fill them with seeded random weights on the device.

use crate::ops::Llama3Scaling;

use super::config::Config;

/// Every preset name.
pub const NAMES: [&str; 3] = ["tiny", "llama2-7b", "llama3-8b"];

/// The configuration of preset `name`, if it exists.
pub fn preset(name: &str) -> Option<Config> {
    let llama2_7b = Config {
        hidden_size: 4096,
        intermediate_size: 11008,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 32,
        head_dim: 128,
        rms_norm_eps: 1e-5,
        vocab_size: 32000,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        dtype: None,
        rope_theta: 10_000.0,
        rope_scaling: None,
    };
    match name {
        "llama2-7b" => Some(llama2_7b),
        "llama3-8b" => Some(Config {
            num_key_value_heads: 8,
            intermediate_size: 14336,
            vocab_size: 128_256,
            max_position_embeddings: 131_072,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001, 128_009],
            rope_theta: 500_000.0,
            rope_scaling: Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }),
            ..llama2_7b
        }),
        "tiny" => Some(Config {
            hidden_size: 256,
            intermediate_size: 768,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            num_key_value_heads: 2,
            head_dim: 32,
            vocab_size: 4096,
            max_position_embeddings: 2048,
            tie_word_embeddings: true,
            bos_token_id: Some(0),
            eos_token_ids: vec![1],
            rope_theta: 500_000.0,
            rope_scaling: Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 256,
            }),
            ..llama2_7b
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{BufferId, DType};
    use crate::models::weights::{uniform, Weights};

    /// The published parameter counts: 6.74 B for Llama 2 7B, 8.03 B for Llama 3 8B.
    #[test]
    fn parameter_counts_match_the_published_models() {
        for (name, billions) in [("llama2-7b", 6.74), ("llama3-8b", 8.03)] {
            let cfg = preset(name).unwrap();
            let w = Weights::layout(&cfg, &uniform(DType::F16), BufferId(0));
            let params: usize = w.slots(&cfg).iter().map(|s| s.nelements()).sum();
            let b = params as f64 / 1e9;
            assert!((b - billions).abs() < 0.01, "{name}: {b} B parameters");
        }
        assert!(preset("nope").is_none());
    }
}
