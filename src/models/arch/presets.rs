//! Named model shapes for benchmarks (`graft bench --preset NAME`): the published
//! configurations of Llama 2 7B and 70B, Llama 3 8B, Qwen3 8B, Qwen3-30B-A3B (128 experts, 8
//! per token), Mistral 7B (v0.1, with its 4096 sliding window) and GPT-2 XL, and a tiny Llama 3
//! style model and a tiny Qwen3-MoE that run anywhere.
//! Benchmarks fill them with seeded random weights on the device.

use crate::ops::Llama3Scaling;

use crate::models::arch::config::{Config, Gating, Moe};
use crate::models::arch::Arch;

/// Every preset name.
pub const NAMES: [&str; 9] = [
    "tiny",
    "tiny-moe",
    "llama2-7b",
    "llama2-70b",
    "llama3-8b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "mistral-7b",
    "gpt2-xl",
];

/// The configuration of preset `name`, if it exists.
pub fn preset(name: &str) -> Option<Config> {
    let llama2_7b = Config {
        arch: Arch::Llama,
        hidden_size: 4096,
        intermediate_size: 11008,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 32,
        head_dim: 128,
        norm_eps: 1e-5,
        vocab_size: 32000,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        dtype: None,
        rope_theta: 10_000.0,
        rope_scaling: None,
        sliding_window: None,
        moe: None,
        tp: 1,
    };
    let qwen3_8b = Config {
        arch: Arch::Qwen3,
        intermediate_size: 12288,
        num_hidden_layers: 36,
        num_key_value_heads: 8,
        norm_eps: 1e-6,
        vocab_size: 151_936,
        max_position_embeddings: 40_960,
        bos_token_id: Some(151_643),
        eos_token_ids: vec![151_645, 151_643],
        rope_theta: 1_000_000.0,
        ..llama2_7b.clone()
    };
    let qwen3_30b_a3b = Config {
        arch: Arch::Qwen3Moe,
        hidden_size: 2048,
        intermediate_size: 768,
        num_hidden_layers: 48,
        num_key_value_heads: 4,
        moe: Some(Moe {
            n_expert: 128,
            n_used: 8,
            gating: Gating::Softmax,
            norm_topk: true,
        }),
        ..qwen3_8b.clone()
    };
    match name {
        "llama2-7b" => Some(llama2_7b),
        // 68.98 B parameters: 138 GB in F16, which only a split over GPUs holds
        "llama2-70b" => Some(Config {
            hidden_size: 8192,
            intermediate_size: 28672,
            num_hidden_layers: 80,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            ..llama2_7b
        }),
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
        "qwen3-8b" => Some(qwen3_8b),
        "qwen3-30b-a3b" => Some(qwen3_30b_a3b),
        "tiny-moe" => Some(Config {
            hidden_size: 256,
            intermediate_size: 128,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            num_key_value_heads: 2,
            head_dim: 32,
            vocab_size: 4096,
            max_position_embeddings: 2048,
            moe: Some(Moe {
                n_expert: 16,
                n_used: 4,
                gating: Gating::Softmax,
                norm_topk: true,
            }),
            ..qwen3_30b_a3b
        }),
        "mistral-7b" => Some(Config {
            arch: Arch::Mistral,
            intermediate_size: 14336,
            num_key_value_heads: 8,
            max_position_embeddings: 32_768,
            sliding_window: Some(4096),
            ..llama2_7b
        }),
        "gpt2-xl" => Some(Config {
            arch: Arch::Gpt2,
            hidden_size: 1600,
            intermediate_size: 6400,
            num_hidden_layers: 48,
            num_attention_heads: 25,
            num_key_value_heads: 25,
            head_dim: 64,
            vocab_size: 50_257,
            max_position_embeddings: 1024,
            tie_word_embeddings: true,
            bos_token_id: Some(50_256),
            eos_token_ids: vec![50_256],
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
    use crate::models::load::weights::{uniform, Weights};

    /// The published parameter counts: 6.74 B for Llama 2 7B, 68.98 B for Llama 2 70B,
    /// 8.03 B for Llama 3 8B,
    /// 8.19 B for Qwen3 8B, 30.53 B for Qwen3-30B-A3B, 7.24 B for Mistral 7B, 1.56 B for
    /// GPT-2 XL.
    #[test]
    fn parameter_counts_match_the_published_models() {
        let published = [
            ("llama2-7b", 6.74),
            ("llama2-70b", 68.98),
            ("llama3-8b", 8.03),
            ("qwen3-8b", 8.19),
            ("qwen3-30b-a3b", 30.53),
            ("mistral-7b", 7.24),
            ("gpt2-xl", 1.56),
        ];
        for (name, billions) in published {
            let cfg = preset(name).unwrap();
            let w = Weights::layout(&cfg, &uniform(DType::F16), BufferId(0));
            let params: usize = w.slots(&cfg).iter().map(|s| s.nelements()).sum();
            let b = params as f64 / 1e9;
            assert!((b - billions).abs() < 0.01, "{name}: {b} B parameters");
        }
        assert!(preset("nope").is_none());
    }

    /// Qwen3-30B-A3B reads about 3 B parameters a token (its 3.3 B activated, less the
    /// embedding table, of which one row is read): 8 of 128 experts' stacks.
    #[test]
    fn a_token_reads_its_experts_share() {
        let cfg = preset("qwen3-30b-a3b").unwrap();
        let w = Weights::layout(&cfg, &uniform(DType::F16), BufferId(0));
        let b = w.bytes_per_token(&cfg) as f64 / 2.0 / 1e9;
        assert!((b - 3.04).abs() < 0.01, "{b} B parameters a token");
    }
}
