//! The architectures graft runs, each stated in one short file as an [`Arch`] spec: which
//! shared blocks its layers use (norm kind, biases, per-head q/k norms, MLP kind, how
//! positions enter) and what its tensors and config keys are called in Hugging Face
//! folders and in GGUF files. Everything else (config parsing, weight layout, loading,
//! the graphs in [`blocks`](crate::models::blocks), the KV cache, sampling and the generation
//! loop in [`model`](crate::models::runtime::model)) is shared and reads the spec.
//!
//! - [`llama`]: Llama 2 / 3 (RMSNorm, SwiGLU, rope, GQA);
//! - [`mistral`]: Llama with sliding-window attention;
//! - [`qwen2`]: Llama with biases on q, k and v;
//! - [`qwen3`]: Llama with a per-head RMSNorm on q and k and an explicit head size;
//! - [`qwen3moe`]: Qwen3 with a mixture of experts in place of each MLP;
//! - [`mixtral`]: Mistral with a mixture of experts in place of each MLP;
//! - [`gpt2`]: LayerNorm with bias, GELU MLP, learned positions, fused `c_attn`, Conv1D
//!   (transposed) weights, biases everywhere.
//!
//! Beside the specs, what every architecture is described by: [`config`] (hyper-parameters
//! from a Hugging Face `config.json` or GGUF keys), [`role`] (what each weight tensor is and
//! what it is called), [`presets`] (benchmark shapes) and [`tp`] (how the tensors split over
//! the devices of a group). This room depends on no other room of `models`.

pub mod config;
pub mod gpt2;
pub mod llama;
pub mod mistral;
pub mod mixtral;
pub mod presets;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3moe;
pub mod role;
pub mod tp;

use std::fmt;

use crate::models::arch::role::Role;

/// How a block normalizes its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `rms_norm(x) * w`.
    Rms,
    /// `norm(x) * w + b` (LayerNorm with bias).
    Layer,
}

/// The MLP of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(gelu(up(x)))` with GELU's tanh approximation.
    Gelu,
}

/// How token positions enter the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positions {
    /// Rotary embeddings on q and k (NeoX pairing over the whole head).
    Rope,
    /// A learned table added to the token embeddings (`position_embd`).
    Learned,
}

/// How a format names a model's config fields (the HF `config.json` keys).
#[derive(Clone, Copy, Debug)]
pub struct HfKeys {
    /// Residual width.
    pub hidden: &'static str,
    /// Layer count.
    pub layers: &'static str,
    /// Query heads.
    pub heads: &'static str,
    /// Key/value heads, if the architecture has GQA.
    pub kv_heads: Option<&'static str>,
    /// MLP width (`None` in the file: `4 * hidden` when [`HfKeys::ff_default_4x`]).
    pub intermediate: &'static str,
    /// Whether a missing MLP width means `4 * hidden` (GPT-2's `n_inner`).
    pub ff_default_4x: bool,
    /// Norm epsilon.
    pub eps: &'static str,
    /// Longest trained context.
    pub max_pos: &'static str,
}

impl HfKeys {
    /// The keys of Llama-family configs (`hidden_size`, `num_hidden_layers`, ...).
    pub const LLAMA: HfKeys = HfKeys {
        hidden: "hidden_size",
        layers: "num_hidden_layers",
        heads: "num_attention_heads",
        kv_heads: Some("num_key_value_heads"),
        intermediate: "intermediate_size",
        ff_default_4x: false,
        eps: "rms_norm_eps",
        max_pos: "max_position_embeddings",
    };
}

/// How a mixture-of-experts architecture names its settings: every block's MLP is then
/// a router and `n_expert` SwiGLU experts of which each token goes through `n_used`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertKeys {
    /// HF: experts per block, the first of these fields present (published Qwen3-MoE
    /// configs say `num_experts`, transformers 5 writes `num_local_experts`, Mixtral's).
    pub hf_count: &'static [&'static str],
    /// HF: experts per token (`num_experts_per_tok`).
    pub hf_used: &'static str,
    /// HF: whether the selected experts' weights are scaled to sum to 1
    /// (`norm_topk_prob`, false when absent); `None`: always (Mixtral).
    pub hf_norm: Option<&'static str>,
    /// GGUF: the experts' MLP width under `{arch}.` (`expert_feed_forward_length`;
    /// llama.cpp's Mixtral files use `feed_forward_length`).
    pub gguf_ff: &'static str,
}

/// Where a weight of a file comes from: a tensor name, the part of its rows that is this
/// weight (for fused tensors of equal parts such as GPT-2's `c_attn` or GGUF's
/// `attn_qkv`), and whether the file stores the matrix transposed (`[in, out]`, GPT-2's
/// Conv1D).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The tensor's name in the file.
    pub name: String,
    /// `(i, n)` when this weight is part `i` of `n` equal row ranges of a fused tensor
    /// (for a vector: of its elements).
    pub rows: Option<(usize, usize)>,
    /// Whether the file's matrix is `[in, out]` (outermost first), i.e. transposed.
    pub transposed: bool,
}

impl Source {
    /// A whole, untransposed tensor.
    pub fn whole(name: impl Into<String>) -> Source {
        Source {
            name: name.into(),
            rows: None,
            transposed: false,
        }
    }
}

/// One architecture: what its blocks are made of and how its files name things.
#[derive(Clone, Copy)]
pub struct Spec {
    /// graft's name (`qwen3`).
    pub name: &'static str,
    /// HF `model_type` values that mean this architecture.
    pub hf_model_types: &'static [&'static str],
    /// llama.cpp's `general.architecture` written for it (Mistral is written as `llama`).
    pub gguf_arch: &'static str,
    /// The norm of every block and of the output.
    pub norm: NormKind,
    /// The MLP.
    pub mlp: MlpKind,
    /// How positions enter.
    pub positions: Positions,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on the attention output projection.
    pub out_bias: bool,
    /// Biases on the MLP's projections.
    pub mlp_bias: bool,
    /// A per-head RMSNorm on q and k before rope (Qwen3).
    pub qk_norm: bool,
    /// A mixture of experts in place of the MLP, and how its settings are named.
    pub experts: Option<ExpertKeys>,
    /// The HF activation names accepted (`hidden_act` / `activation_function`).
    pub hf_acts: &'static [&'static str],
    /// The HF config keys.
    pub hf_keys: HfKeys,
    /// The HF tensor of a weight (`role` of `layer`).
    pub hf_source: fn(Role, Option<usize>) -> Source,
    /// A prefix of the HF names that checkpoints may leave out (`transformer.`).
    pub hf_optional_prefix: &'static str,
    /// Suffixes of HF tensors that are derived buffers, not weights, and are ignored
    /// (`.rotary_emb.inv_freq`, GPT-2's `.attn.bias` causal mask).
    pub hf_ignored_suffixes: &'static [&'static str],
    /// Whether the GGUF file fuses q, k and v into `attn_qkv` (llama.cpp's GPT-2).
    pub gguf_fused_qkv: bool,
    /// Whether llama.cpp's converter permutes the Q and K rows for its interleaved rope
    /// (its `llama` architecture does, the NeoX-rope ones such as Qwen do not).
    pub gguf_rope_permuted: bool,
}

impl Spec {
    /// The GGUF tensor of `role` of `layer` (llama.cpp's names; q, k and v as thirds of
    /// `attn_qkv` where the architecture fuses them).
    pub fn gguf_source(&self, role: Role, layer: Option<usize>) -> Source {
        match (self.gguf_fused_qkv, role.qkv_part()) {
            (true, Some(i)) => {
                let suffix = if role.is_bias() { "bias" } else { "weight" };
                let l = layer.unwrap_or(0);
                Source {
                    name: format!("blk.{l}.attn_qkv.{suffix}"),
                    rows: Some((i, 3)),
                    transposed: false,
                }
            }
            (true, None) | (false, _) => Source::whole(role.gguf_name(layer)),
        }
    }

    /// The prefix of the HF names of the per-layer tensors (`model.layers.`), found
    /// from layer 0's first norm.
    pub fn hf_layer_prefix(&self) -> String {
        let name = (self.hf_source)(Role::AttnNorm, Some(0)).name;
        match name.find(".0.") {
            Some(i) => name[..=i].to_string(),
            None => name,
        }
    }
}

/// The architectures graft runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama 2 / Llama 3.
    Llama,
    /// Mistral (Llama with a sliding window).
    Mistral,
    /// Qwen2 / Qwen2.5.
    Qwen2,
    /// Qwen3 (dense).
    Qwen3,
    /// Qwen3 with a mixture of experts (Qwen3-30B-A3B).
    Qwen3Moe,
    /// Mixtral (Mistral with a mixture of experts).
    Mixtral,
    /// GPT-2.
    Gpt2,
}

impl Arch {
    /// Every architecture.
    pub const ALL: [Arch; 7] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Mixtral,
        Arch::Gpt2,
    ];

    /// The architecture's spec.
    pub fn spec(self) -> &'static Spec {
        match self {
            Arch::Llama => &llama::SPEC,
            Arch::Mistral => &mistral::SPEC,
            Arch::Qwen2 => &qwen2::SPEC,
            Arch::Qwen3 => &qwen3::SPEC,
            Arch::Qwen3Moe => &qwen3moe::SPEC,
            Arch::Mixtral => &mixtral::SPEC,
            Arch::Gpt2 => &gpt2::SPEC,
        }
    }

    /// graft's name for it.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The architecture of HF `model_type` `t`.
    pub fn from_hf_model_type(t: &str) -> Option<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.spec().hf_model_types.contains(&t))
    }

    /// The architecture of GGUF `general.architecture` `a` (`llama` files are Llama;
    /// Mistral files are `llama` files with a sliding window, Mixtral files `llama` files
    /// with experts).
    pub fn from_gguf(a: &str) -> Option<Arch> {
        [
            Arch::Llama,
            Arch::Qwen2,
            Arch::Qwen3,
            Arch::Qwen3Moe,
            Arch::Gpt2,
        ]
        .into_iter()
        .find(|x| x.spec().gguf_arch == a)
    }

    /// The names accepted, for error messages.
    pub fn list() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
