//! What a weight tensor is ([`Role`]): the names a spec, a checkpoint and a GGUF file give
//! it, whether it is a vector or a matrix, and which part of a fused tensor it is.

use crate::models::arch::config::Config;

/// What a weight tensor is: picks its dtype and names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// `token_embd` [n_embd, vocab].
    TokEmbd,
    /// `position_embd` [n_embd, n_ctx_train] (learned positions).
    PosEmbd,
    /// `attn_norm` [n_embd].
    AttnNorm,
    /// `attn_norm.bias` [n_embd] (LayerNorm).
    AttnNormB,
    /// `attn_q` [n_embd, n_q].
    AttnQ,
    /// `attn_k` [n_embd, n_kv_dim].
    AttnK,
    /// `attn_v` [n_embd, n_kv_dim].
    AttnV,
    /// `attn_q.bias` [n_q].
    AttnQB,
    /// `attn_k.bias` [n_kv_dim].
    AttnKB,
    /// `attn_v.bias` [n_kv_dim].
    AttnVB,
    /// `attn_q_norm` [head_dim] (per-head RMSNorm of q).
    AttnQNorm,
    /// `attn_k_norm` [head_dim] (per-head RMSNorm of k).
    AttnKNorm,
    /// `attn_output` [n_q, n_embd].
    AttnOut,
    /// `attn_output.bias` [n_embd].
    AttnOutB,
    /// `ffn_norm` [n_embd].
    FfnNorm,
    /// `ffn_norm.bias` [n_embd] (LayerNorm).
    FfnNormB,
    /// `ffn_gate` [n_embd, n_ff].
    FfnGate,
    /// `ffn_up` [n_embd, n_ff].
    FfnUp,
    /// `ffn_up.bias` [n_ff].
    FfnUpB,
    /// `ffn_down` [n_ff, n_embd].
    FfnDown,
    /// `ffn_down.bias` [n_embd].
    FfnDownB,
    /// `ffn_gate_inp` [n_embd, n_expert]: the router of a mixture of experts.
    FfnGateInp,
    /// `ffn_gate_exps` [n_embd, n_ff, n_expert]: every expert's gate projection.
    FfnGateExps,
    /// `ffn_up_exps` [n_embd, n_ff, n_expert].
    FfnUpExps,
    /// `ffn_down_exps` [n_ff, n_embd, n_expert].
    FfnDownExps,
    /// `output_norm` [n_embd].
    OutNorm,
    /// `output_norm.bias` [n_embd] (LayerNorm).
    OutNormB,
    /// `output` [n_embd, vocab].
    Output,
}

/// The weights of a mixture of experts (see [`Role::expert_part`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPart {
    /// The router, `ffn_gate_inp`.
    Router,
    /// The experts' gate projections, `ffn_gate_exps`.
    Gate,
    /// The experts' up projections, `ffn_up_exps`.
    Up,
    /// The experts' down projections, `ffn_down_exps`.
    Down,
}

impl Role {
    /// Whether this is a vector (a norm weight or a bias), always F32.
    pub fn is_vector(self) -> bool {
        self.ne_rank() == 1
    }

    fn ne_rank(self) -> usize {
        match self {
            Role::TokEmbd
            | Role::PosEmbd
            | Role::AttnQ
            | Role::AttnK
            | Role::AttnV
            | Role::AttnOut
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnDown
            | Role::FfnGateInp
            | Role::Output => 2,
            Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps => 3,
            Role::AttnNorm
            | Role::AttnNormB
            | Role::AttnQB
            | Role::AttnKB
            | Role::AttnVB
            | Role::AttnQNorm
            | Role::AttnKNorm
            | Role::AttnOutB
            | Role::FfnNorm
            | Role::FfnNormB
            | Role::FfnUpB
            | Role::FfnDownB
            | Role::OutNorm
            | Role::OutNormB => 1,
        }
    }

    /// Which third of q|k|v this weight or bias is (0 for q, 1 for k, 2 for v).
    pub fn qkv_part(self) -> Option<usize> {
        match self {
            Role::AttnQ | Role::AttnQB => Some(0),
            Role::AttnK | Role::AttnKB => Some(1),
            Role::AttnV | Role::AttnVB => Some(2),
            Role::TokEmbd
            | Role::PosEmbd
            | Role::AttnNorm
            | Role::AttnNormB
            | Role::AttnQNorm
            | Role::AttnKNorm
            | Role::AttnOut
            | Role::AttnOutB
            | Role::FfnNorm
            | Role::FfnNormB
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnUpB
            | Role::FfnDown
            | Role::FfnDownB
            | Role::FfnGateInp
            | Role::FfnGateExps
            | Role::FfnUpExps
            | Role::FfnDownExps
            | Role::OutNorm
            | Role::OutNormB
            | Role::Output => None,
        }
    }

    /// Which part of a mixture of experts this weight is, if any.
    pub fn expert_part(self) -> Option<ExpertPart> {
        match self {
            Role::FfnGateInp => Some(ExpertPart::Router),
            Role::FfnGateExps => Some(ExpertPart::Gate),
            Role::FfnUpExps => Some(ExpertPart::Up),
            Role::FfnDownExps => Some(ExpertPart::Down),
            Role::TokEmbd
            | Role::PosEmbd
            | Role::AttnNorm
            | Role::AttnNormB
            | Role::AttnQ
            | Role::AttnK
            | Role::AttnV
            | Role::AttnQB
            | Role::AttnKB
            | Role::AttnVB
            | Role::AttnQNorm
            | Role::AttnKNorm
            | Role::AttnOut
            | Role::AttnOutB
            | Role::FfnNorm
            | Role::FfnNormB
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnUpB
            | Role::FfnDown
            | Role::FfnDownB
            | Role::OutNorm
            | Role::OutNormB
            | Role::Output => None,
        }
    }

    /// Whether this is a stack of one matrix per expert (`[.., .., n_expert]`), which a
    /// Hugging Face checkpoint stores as one tensor per expert.
    pub fn is_experts(self) -> bool {
        self.ne_rank() == 3
    }

    /// Whether this is a bias (named `.bias` in files).
    pub fn is_bias(self) -> bool {
        matches!(
            self,
            Role::AttnNormB
                | Role::AttnQB
                | Role::AttnKB
                | Role::AttnVB
                | Role::AttnOutB
                | Role::FfnNormB
                | Role::FfnUpB
                | Role::FfnDownB
                | Role::OutNormB
        )
    }

    /// `ne` of the tensor: `[row length, rows]` for a matrix, `[row length, rows,
    /// n_expert]` for the experts' stacks, `[n]` for a vector.
    pub fn ne(self, cfg: &Config) -> Vec<usize> {
        let (n_embd, vocab, n_ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        match self {
            Role::TokEmbd | Role::Output => vec![n_embd, vocab],
            Role::PosEmbd => vec![n_embd, cfg.max_position_embeddings],
            Role::AttnNorm
            | Role::AttnNormB
            | Role::FfnNorm
            | Role::FfnNormB
            | Role::OutNorm
            | Role::OutNormB
            | Role::AttnOutB
            | Role::FfnDownB => vec![n_embd],
            Role::AttnQ => vec![n_embd, cfg.n_q()],
            Role::AttnK | Role::AttnV => vec![n_embd, cfg.n_kv_dim()],
            Role::AttnQB => vec![cfg.n_q()],
            Role::AttnKB | Role::AttnVB => vec![cfg.n_kv_dim()],
            Role::AttnQNorm | Role::AttnKNorm => vec![cfg.head_dim],
            Role::AttnOut => vec![cfg.n_q(), n_embd],
            Role::FfnGate | Role::FfnUp => vec![n_embd, n_ff],
            Role::FfnUpB => vec![n_ff],
            Role::FfnDown => vec![n_ff, n_embd],
            Role::FfnGateInp => vec![n_embd, cfg.n_expert()],
            Role::FfnGateExps | Role::FfnUpExps => vec![n_embd, n_ff, cfg.n_expert()],
            Role::FfnDownExps => vec![n_ff, n_embd, cfg.n_expert()],
        }
    }

    /// Elements of one row (`ne[0]`).
    pub fn row_len(self, cfg: &Config) -> usize {
        self.ne(cfg)[0]
    }

    /// The ggml (GGUF) base name without `.weight` / `.bias` (`blk.0.attn_q`).
    pub fn ggml_base(self, layer: Option<usize>) -> String {
        let l = layer.unwrap_or(0);
        let blk = |s: &str| format!("blk.{l}.{s}");
        match self {
            Role::TokEmbd => "token_embd".into(),
            Role::PosEmbd => "position_embd".into(),
            Role::OutNorm | Role::OutNormB => "output_norm".into(),
            Role::Output => "output".into(),
            Role::AttnNorm | Role::AttnNormB => blk("attn_norm"),
            Role::AttnQ | Role::AttnQB => blk("attn_q"),
            Role::AttnK | Role::AttnKB => blk("attn_k"),
            Role::AttnV | Role::AttnVB => blk("attn_v"),
            Role::AttnQNorm => blk("attn_q_norm"),
            Role::AttnKNorm => blk("attn_k_norm"),
            Role::AttnOut | Role::AttnOutB => blk("attn_output"),
            Role::FfnNorm | Role::FfnNormB => blk("ffn_norm"),
            Role::FfnGate => blk("ffn_gate"),
            Role::FfnUp | Role::FfnUpB => blk("ffn_up"),
            Role::FfnDown | Role::FfnDownB => blk("ffn_down"),
            Role::FfnGateInp => blk("ffn_gate_inp"),
            Role::FfnGateExps => blk("ffn_gate_exps"),
            Role::FfnUpExps => blk("ffn_up_exps"),
            Role::FfnDownExps => blk("ffn_down_exps"),
        }
    }

    /// The GGUF tensor name (`blk.0.attn_q.weight`, `blk.0.attn_q.bias`).
    pub fn gguf_name(self, layer: Option<usize>) -> String {
        let suffix = if self.is_bias() { "bias" } else { "weight" };
        format!("{}.{suffix}", self.ggml_base(layer))
    }
}
