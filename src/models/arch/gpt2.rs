//! GPT-2: LayerNorm with bias, a GELU (tanh) MLP without gate, learned position
//! embeddings added to the token embeddings, multi-head attention, biases on every
//! projection, and the output head tied to the embedding table.
//!
//! Its HF checkpoints store q, k and v as one `c_attn` tensor and every projection as a
//! Conv1D, i.e. transposed (`[in, out]`); the [`Source`]s below say so and the loaders
//! split and transpose. Names may carry the `transformer.` prefix (GPT2LMHeadModel) or
//! not (the published `gpt2` files); both are accepted.

use super::{HfKeys, MlpKind, NormKind, Positions, Source, Spec};
use crate::models::arch::role::Role;

/// GPT-2.
pub const SPEC: Spec = Spec {
    name: "gpt2",
    hf_model_types: &["gpt2"],
    gguf_arch: "gpt2",
    norm: NormKind::Layer,
    mlp: MlpKind::Gelu,
    positions: Positions::Learned,
    qkv_bias: true,
    out_bias: true,
    mlp_bias: true,
    qk_norm: false,
    experts: None,
    hf_acts: &["gelu_new", "gelu_pytorch_tanh"],
    hf_keys: HfKeys {
        hidden: "n_embd",
        layers: "n_layer",
        heads: "n_head",
        kv_heads: None,
        intermediate: "n_inner",
        ff_default_4x: true,
        eps: "layer_norm_epsilon",
        max_pos: "n_positions",
    },
    hf_source,
    hf_optional_prefix: "transformer.",
    hf_ignored_suffixes: &[".attn.bias", ".attn.masked_bias"],
    gguf_fused_qkv: true,
    gguf_rope_permuted: false,
};

/// The HF tensor of `role` (names with the `transformer.` prefix).
fn hf_source(role: Role, layer: Option<usize>) -> Source {
    let l = layer.unwrap_or(0);
    let at = |s: &str| format!("transformer.h.{l}.{s}");
    // c_attn's output rows: q, k, v of n_embd each (GPT-2 has no GQA); a third each
    let third = |name: String, i: usize| Source {
        name,
        rows: Some((i, 3)),
        transposed: false,
    };
    let conv = |name: String| Source {
        name,
        rows: None,
        transposed: true,
    };
    match role {
        Role::TokEmbd => Source::whole("transformer.wte.weight"),
        Role::PosEmbd => Source::whole("transformer.wpe.weight"),
        Role::OutNorm => Source::whole("transformer.ln_f.weight"),
        Role::OutNormB => Source::whole("transformer.ln_f.bias"),
        Role::Output => Source::whole("lm_head.weight"),
        Role::AttnNorm => Source::whole(at("ln_1.weight")),
        Role::AttnNormB => Source::whole(at("ln_1.bias")),
        Role::AttnQ => Source {
            transposed: true,
            ..third(at("attn.c_attn.weight"), 0)
        },
        Role::AttnK => Source {
            transposed: true,
            ..third(at("attn.c_attn.weight"), 1)
        },
        Role::AttnV => Source {
            transposed: true,
            ..third(at("attn.c_attn.weight"), 2)
        },
        Role::AttnQB => third(at("attn.c_attn.bias"), 0),
        Role::AttnKB => third(at("attn.c_attn.bias"), 1),
        Role::AttnVB => third(at("attn.c_attn.bias"), 2),
        Role::AttnOut => conv(at("attn.c_proj.weight")),
        Role::AttnOutB => Source::whole(at("attn.c_proj.bias")),
        Role::FfnNorm => Source::whole(at("ln_2.weight")),
        Role::FfnNormB => Source::whole(at("ln_2.bias")),
        Role::FfnUp => conv(at("mlp.c_fc.weight")),
        Role::FfnUpB => Source::whole(at("mlp.c_fc.bias")),
        Role::FfnDown => conv(at("mlp.c_proj.weight")),
        Role::FfnDownB => Source::whole(at("mlp.c_proj.bias")),
        // not part of GPT-2 (no per-head norms, no gate, no experts)
        Role::AttnQNorm
        | Role::AttnKNorm
        | Role::FfnGate
        | Role::FfnGateInp
        | Role::FfnGateExps
        | Role::FfnUpExps
        | Role::FfnDownExps => Source::whole(""),
    }
}
