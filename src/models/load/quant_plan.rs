//! Which dtype each weight of a model gets when it is converted or quantized:
//! [`QuantPlan`], graft's names for llama.cpp's file types.
//!
//! Vectors (norm weights, biases) always stay F32. The float plans (`f32`, `f16`, `bf16`) and the single
//! block types (`q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `q4_k`, `q5_k`, `q6_k`) give every
//! matrix the same type, the embedding table and the output head included (what
//! `llama-quantize --pure` does; llama-quantize's own Q4_0 .. Q6_K also put the output
//! head in Q6_K, a choice graft leaves out so that a single-type model reads one type).
//!
//! The mixes follow ggml's rules (llama.cpp's `llama-quant.cpp`, run without an importance
//! matrix) for a Llama model. Each puts the output head (the embedding table when it is
//! tied to the output) in Q6_K and the untied embedding table in its main type, and:
//! - `q4_k_m`: Q4_K, but Q6_K for `attn_v` and `ffn_down` in the layers where ggml "uses
//!   more bits": the first eighth, the last eighth, and every third layer in between
//!   ([`use_more_bits`]). `q5_k_m`: the same with Q5_K in place of Q4_K.
//! - `q2_k`: Q2_K, but Q3_K for `attn_output`, `ffn_down` and `attn_v` (Q4_K for `attn_v`
//!   with 4 or more query heads a KV head).
//! - `q3_k_s`: Q3_K. `q3_k_m`: Q3_K, but Q4_K for `attn_output`, `ffn_down` (Q5_K in the
//!   first sixteenth of the layers) and `attn_v` (Q5_K in layers 0 and 1). `q3_k_l`: Q3_K,
//!   but Q5_K for `attn_output`, `attn_v` and `ffn_down`.
//! - `iq4_nl`, `iq4_xs`: IQ4_NL or IQ4_XS, but Q5_K for `ffn_down` in the first eighth of
//!   the layers and for `attn_v` with 4 or more query heads a KV head.
//!
//! A mixture of experts' `ffn_down_exps` counts as `ffn_down`; its router stays F32.
//! (llama.cpp also gives 70B models' `attn_v`, 8-expert models and fused q|k|v tensors
//! rules of their own: graft does not.)
//!
//! A type needs rows whose length is a multiple of its block (32 elements, 256 for the
//! K-quants and IQ4_XS). When a row does not fit, the tensor falls back like llama.cpp's:
//! Q2_K and Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to IQ4_NL, and a
//! 32-element type (or a fallback that still does not fit) to F16. The output head of a
//! mix whose row is not a multiple of its main type's block takes Q8_0 directly (ggml's
//! rule for the output). [`Pick::fallback_from`] says when this happened, so the loader
//! can say so.

use crate::graph::DType;

use crate::models::arch::config::Config;
use crate::models::arch::role::Role;

/// A conversion of every weight: one type, or one of ggml's mixes.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantPlan {
    /// Every matrix F32.
    F32,
    /// Every matrix F16.
    F16,
    /// Every matrix BF16.
    BF16,
    /// Every matrix Q8_0.
    Q8_0,
    /// Every matrix Q4_0.
    Q4_0,
    /// Every matrix Q4_1.
    Q4_1,
    /// Every matrix Q5_0.
    Q5_0,
    /// Every matrix Q5_1.
    Q5_1,
    /// Every matrix Q4_K.
    Q4_K,
    /// Every matrix Q5_K.
    Q5_K,
    /// Every matrix Q6_K.
    Q6_K,
    /// ggml's Q4_K_M mix (Q4_K, Q6_K for the output and half the attn_v/ffn_down).
    Q4_K_M,
    /// ggml's Q5_K_M mix (Q5_K, Q6_K for the output and half the attn_v/ffn_down).
    Q5_K_M,
    /// ggml's Q2_K mix (Q2_K, Q3_K for attn_output/ffn_down/attn_v, Q6_K for the output).
    Q2_K,
    /// ggml's Q3_K_S mix (Q3_K, Q6_K for the output).
    Q3_K_S,
    /// ggml's Q3_K_M mix (Q3_K, Q4_K/Q5_K for attn_output/ffn_down/attn_v, Q6_K output).
    Q3_K_M,
    /// ggml's Q3_K_L mix (Q3_K, Q5_K for attn_output/ffn_down/attn_v, Q6_K output).
    Q3_K_L,
    /// ggml's IQ4_NL mix (IQ4_NL, Q6_K for the output, Q5_K for some ffn_down/attn_v).
    IQ4_NL,
    /// ggml's IQ4_XS mix (IQ4_XS, Q6_K for the output, Q5_K for some ffn_down/attn_v).
    IQ4_XS,
}

/// The dtype chosen for one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    /// The dtype the tensor gets.
    pub dtype: DType,
    /// The dtype the rules wanted, when its block does not divide the row length.
    pub fallback_from: Option<DType>,
}

/// ggml's `use_more_bits`: the first eighth of the layers, the last eighth, and every
/// third layer in between get more bits in the K-quant mixes.
pub fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    let eighth = n_layers / 8;
    layer < eighth || layer >= 7 * n_layers / 8 || (layer - eighth) % 3 == 2
}

impl QuantPlan {
    /// Every plan, in the order the command line lists them.
    pub const ALL: [QuantPlan; 19] = [
        QuantPlan::F32,
        QuantPlan::F16,
        QuantPlan::BF16,
        QuantPlan::Q8_0,
        QuantPlan::Q4_0,
        QuantPlan::Q4_1,
        QuantPlan::Q5_0,
        QuantPlan::Q5_1,
        QuantPlan::Q4_K,
        QuantPlan::Q5_K,
        QuantPlan::Q6_K,
        QuantPlan::Q4_K_M,
        QuantPlan::Q5_K_M,
        QuantPlan::Q2_K,
        QuantPlan::Q3_K_S,
        QuantPlan::Q3_K_M,
        QuantPlan::Q3_K_L,
        QuantPlan::IQ4_NL,
        QuantPlan::IQ4_XS,
    ];

    /// The lowercase name (`q4_k_m`).
    pub const fn name(self) -> &'static str {
        match self {
            QuantPlan::F32 => "f32",
            QuantPlan::F16 => "f16",
            QuantPlan::BF16 => "bf16",
            QuantPlan::Q8_0 => "q8_0",
            QuantPlan::Q4_0 => "q4_0",
            QuantPlan::Q4_1 => "q4_1",
            QuantPlan::Q5_0 => "q5_0",
            QuantPlan::Q5_1 => "q5_1",
            QuantPlan::Q4_K => "q4_k",
            QuantPlan::Q5_K => "q5_k",
            QuantPlan::Q6_K => "q6_k",
            QuantPlan::Q4_K_M => "q4_k_m",
            QuantPlan::Q5_K_M => "q5_k_m",
            QuantPlan::Q2_K => "q2_k",
            QuantPlan::Q3_K_S => "q3_k_s",
            QuantPlan::Q3_K_M => "q3_k_m",
            QuantPlan::Q3_K_L => "q3_k_l",
            QuantPlan::IQ4_NL => "iq4_nl",
            QuantPlan::IQ4_XS => "iq4_xs",
        }
    }

    /// The plan named `name` (case-insensitive).
    pub fn parse(name: &str) -> Option<QuantPlan> {
        let lower = name.to_ascii_lowercase();
        QuantPlan::ALL.into_iter().find(|p| p.name() == lower)
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`) of a file made with this plan
    /// (`q4_k` and `q5_k` have none of their own: the nearest, Q4_K_S and Q5_K_S).
    pub const fn llama_ftype(self) -> u32 {
        match self {
            QuantPlan::F32 => 0,
            QuantPlan::F16 => 1,
            QuantPlan::Q4_0 => 2,
            QuantPlan::Q4_1 => 3,
            QuantPlan::Q8_0 => 7,
            QuantPlan::Q5_0 => 8,
            QuantPlan::Q5_1 => 9,
            QuantPlan::Q4_K => 14,
            QuantPlan::Q4_K_M => 15,
            QuantPlan::Q5_K => 16,
            QuantPlan::Q5_K_M => 17,
            QuantPlan::Q6_K => 18,
            QuantPlan::BF16 => 32,
            QuantPlan::Q2_K => 10,
            QuantPlan::Q3_K_S => 11,
            QuantPlan::Q3_K_M => 12,
            QuantPlan::Q3_K_L => 13,
            QuantPlan::IQ4_NL => 25,
            QuantPlan::IQ4_XS => 30,
        }
    }

    /// The type of most matrices.
    pub const fn base(self) -> DType {
        match self {
            QuantPlan::F32 => DType::F32,
            QuantPlan::F16 => DType::F16,
            QuantPlan::BF16 => DType::BF16,
            QuantPlan::Q8_0 => DType::Q8_0,
            QuantPlan::Q4_0 => DType::Q4_0,
            QuantPlan::Q4_1 => DType::Q4_1,
            QuantPlan::Q5_0 => DType::Q5_0,
            QuantPlan::Q5_1 => DType::Q5_1,
            QuantPlan::Q4_K | QuantPlan::Q4_K_M => DType::Q4_K,
            QuantPlan::Q5_K | QuantPlan::Q5_K_M => DType::Q5_K,
            QuantPlan::Q6_K => DType::Q6_K,
            QuantPlan::Q2_K => DType::Q2_K,
            QuantPlan::Q3_K_S | QuantPlan::Q3_K_M | QuantPlan::Q3_K_L => DType::Q3_K,
            QuantPlan::IQ4_NL => DType::IQ4_NL,
            QuantPlan::IQ4_XS => DType::IQ4_XS,
        }
    }

    /// Whether this is one of ggml's mixes (the single types give every matrix one type).
    const fn is_mix(self) -> bool {
        matches!(
            self,
            QuantPlan::Q4_K_M
                | QuantPlan::Q5_K_M
                | QuantPlan::Q2_K
                | QuantPlan::Q3_K_S
                | QuantPlan::Q3_K_M
                | QuantPlan::Q3_K_L
                | QuantPlan::IQ4_NL
                | QuantPlan::IQ4_XS
        )
    }

    /// The type this mix gives matrix `role` of block `layer` (not the output head) of a
    /// model shaped `cfg`: its main type, or more bits where ggml's rules say so.
    fn mix_type(self, role: Role, layer: Option<usize>, cfg: &Config) -> DType {
        let n = cfg.num_hidden_layers;
        let l = layer.unwrap_or(0);
        // ggml's n_gqa() >= 4: 4 or more query heads a KV head.
        let gqa4 = cfg.num_attention_heads >= 4 * cfg.num_key_value_heads.max(1);
        let (v, down, out) = (
            role == Role::AttnV,
            matches!(role, Role::FfnDown | Role::FfnDownExps),
            role == Role::AttnOut,
        );
        let more = match self {
            QuantPlan::Q4_K_M | QuantPlan::Q5_K_M => {
                let more_bits = layer.is_some_and(|l| use_more_bits(l, n));
                ((v || down) && more_bits).then_some(DType::Q6_K)
            }
            QuantPlan::Q2_K if v && gqa4 => Some(DType::Q4_K),
            QuantPlan::Q2_K => (v || down || out).then_some(DType::Q3_K),
            QuantPlan::Q3_K_M if (v && l < 2) || (down && l < n / 16) => Some(DType::Q5_K),
            QuantPlan::Q3_K_M => (v || down || out).then_some(DType::Q4_K),
            QuantPlan::Q3_K_L => (v || down || out).then_some(DType::Q5_K),
            QuantPlan::IQ4_NL | QuantPlan::IQ4_XS => {
                ((v && gqa4) || (down && l < n / 8)).then_some(DType::Q5_K)
            }
            QuantPlan::Q3_K_S
            | QuantPlan::F32
            | QuantPlan::F16
            | QuantPlan::BF16
            | QuantPlan::Q8_0
            | QuantPlan::Q4_0
            | QuantPlan::Q4_1
            | QuantPlan::Q5_0
            | QuantPlan::Q5_1
            | QuantPlan::Q4_K
            | QuantPlan::Q5_K
            | QuantPlan::Q6_K => None,
        };
        more.unwrap_or(self.base())
    }

    /// The dtype of tensor `role` (of block `layer`) of a model shaped `cfg`, and
    /// whether it fell back from the type the rules wanted.
    pub fn pick(self, role: Role, layer: Option<usize>, cfg: &Config) -> Pick {
        let plain = Pick {
            dtype: DType::F32,
            fallback_from: None,
        };
        // the router of a mixture of experts stays F32 like the vectors (llama.cpp's
        // converter and quantizer keep ffn_gate_inp so)
        if role.is_vector() || role == Role::FfnGateInp {
            return plain;
        }
        // A file that fuses q|k|v (GPT-2's attn_qkv) stores them in one type: v's.
        let role = match (cfg.arch.spec().gguf_fused_qkv, role) {
            (true, Role::AttnQ | Role::AttnK) => Role::AttnV,
            (_, role) => role,
        };
        let row = role.row_len(cfg);
        let is_output = role == Role::Output || (role == Role::TokEmbd && cfg.tie_word_embeddings);
        let wanted = if !self.is_mix() {
            self.base()
        } else if is_output {
            // ggml: the output head takes Q6_K, or Q8_0 when the mix's block does not fit.
            if row % self.base().block_size() != 0 {
                return Pick {
                    dtype: DType::Q8_0,
                    ..plain
                };
            }
            DType::Q6_K
        } else {
            self.mix_type(role, layer, cfg)
        };
        fit(wanted, row)
    }
}

/// `wanted` if its block divides `row`, else llama.cpp's fallback.
fn fit(wanted: DType, row: usize) -> Pick {
    if row.is_multiple_of(wanted.block_size()) {
        return Pick {
            dtype: wanted,
            fallback_from: None,
        };
    }
    let next = match wanted {
        DType::Q2_K | DType::Q3_K => DType::Q4_0,
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        DType::IQ4_XS => DType::IQ4_NL,
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::Quant(_) => DType::F16,
    };
    let dtype = if row.is_multiple_of(next.block_size()) {
        next
    } else {
        DType::F16
    };
    Pick {
        dtype,
        fallback_from: Some(wanted),
    }
}

impl std::fmt::Display for QuantPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::arch::presets;

    #[test]
    fn use_more_bits_matches_ggml_for_32_layers() {
        // 32 layers: 0..4, 28..32, and 4 + 3k + 2 = 6, 9, ..., 27.
        let more: Vec<usize> = (0..32).filter(|&l| use_more_bits(l, 32)).collect();
        let mut want: Vec<usize> = (0..4).chain(28..32).collect();
        want.extend((6..28).step_by(3));
        want.sort();
        assert_eq!(more, want);
        assert_eq!(more.len(), 16, "half the layers");
    }

    #[test]
    fn q4_k_m_on_llama2_7b() {
        let cfg = presets::preset("llama2-7b").unwrap();
        let p = |role, layer| QuantPlan::Q4_K_M.pick(role, layer, &cfg).dtype;
        assert_eq!(p(Role::Output, None), DType::Q6_K);
        assert_eq!(p(Role::TokEmbd, None), DType::Q4_K);
        assert_eq!(p(Role::AttnNorm, Some(0)), DType::F32);
        assert_eq!(p(Role::AttnV, Some(0)), DType::Q6_K);
        assert_eq!(p(Role::AttnV, Some(4)), DType::Q4_K);
        assert_eq!(p(Role::FfnDown, Some(6)), DType::Q6_K);
        assert_eq!(p(Role::FfnDown, Some(7)), DType::Q4_K);
        assert_eq!(p(Role::AttnQ, Some(0)), DType::Q4_K);
        assert_eq!(
            QuantPlan::Q5_K_M.pick(Role::AttnK, Some(0), &cfg).dtype,
            DType::Q5_K
        );
        assert_eq!(
            QuantPlan::Q4_0.pick(Role::Output, None, &cfg).dtype,
            DType::Q4_0
        );
    }

    #[test]
    fn rows_that_do_not_fit_fall_back_like_llama_cpp() {
        assert_eq!(fit(DType::Q4_K, 64).dtype, DType::Q5_0);
        assert_eq!(fit(DType::Q5_K, 192).dtype, DType::Q5_1);
        assert_eq!(fit(DType::Q6_K, 64).dtype, DType::Q8_0);
        assert_eq!(fit(DType::Q4_0, 48).dtype, DType::F16);
        assert_eq!(fit(DType::Q6_K, 48).dtype, DType::F16);
        assert_eq!(fit(DType::Q4_K, 512).fallback_from, None);
        assert_eq!(fit(DType::Q4_K, 64).fallback_from, Some(DType::Q4_K));
        // A tied output head whose rows do not fit the K block: Q8_0 by rule, no fallback.
        let mut cfg = presets::preset("tiny").unwrap();
        cfg.hidden_size = 64;
        let out = QuantPlan::Q4_K_M.pick(Role::TokEmbd, None, &cfg);
        assert_eq!((out.dtype, out.fallback_from), (DType::Q8_0, None));
    }

    #[test]
    fn names_parse_back() {
        for p in QuantPlan::ALL {
            assert_eq!(QuantPlan::parse(p.name()), Some(p));
        }
        assert_eq!(QuantPlan::parse("Q4_K_M"), Some(QuantPlan::Q4_K_M));
        assert_eq!(QuantPlan::parse("q3_k"), None);
    }
}
