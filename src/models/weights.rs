//! Where every Llama weight lives in backend memory: one buffer for the whole model,
//! each tensor at an aligned byte offset with its own dtype.
//!
//! Norm weights are F32; each matrix has its own dtype (F32, F16, BF16 or a block type,
//! see [`QuantPlan`](super::quant_plan::QuantPlan)). Two layouts differ from the HF
//! checkpoint's list of tensors when the parts share one dtype:
//! - `q_proj | k_proj | v_proj` are stored as adjacent rows of one tensor
//!   `attn_qkv` [n_embd, n_q + 2 * n_kv_dim], so one mul_mat computes q, k and v (the
//!   graph then takes them as strided views of the result);
//! - `gate_proj | up_proj` likewise form `ffn_gate_up` [n_embd, 2 * n_ff].
//!
//! When the parts differ (ggml's Q4_K_M gives `attn_v` Q6_K in half the layers), they
//! are separate tensors and the graph runs one mul_mat each ([`QkvLeaves::Split`],
//! [`GateUpLeaves::Split`]).
//!
//! An HF `[out, in]` matrix is row-major with `in` contiguous, which is graft's `ne`
//! `[in, out]`: a row is `in` elements (`row_bytes` of its dtype, whole blocks for a
//! block type), and stacking along `out` is concatenating the bytes. This halves the
//! number of mul_mats per block (one GEMV launch instead of three, one instead of two),
//! the layout the CUDA GEMV kernel is written for. With tied embeddings the output
//! projection is the embedding table (same bytes).

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::graph::alloc::ALIGN;
use crate::graph::{BufferId, BufferRef, DType, Graph, TensorId};

use super::config::Config;

/// What a weight tensor is: picks its dtype and names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// `embed_tokens` / `token_embd` [n_embd, vocab].
    TokEmbd,
    /// `input_layernorm` / `attn_norm` [n_embd].
    AttnNorm,
    /// `q_proj` / `attn_q` [n_embd, n_q].
    AttnQ,
    /// `k_proj` / `attn_k` [n_embd, n_kv_dim].
    AttnK,
    /// `v_proj` / `attn_v` [n_embd, n_kv_dim].
    AttnV,
    /// `o_proj` / `attn_output` [n_q, n_embd].
    AttnOut,
    /// `post_attention_layernorm` / `ffn_norm` [n_embd].
    FfnNorm,
    /// `gate_proj` / `ffn_gate` [n_embd, n_ff].
    FfnGate,
    /// `up_proj` / `ffn_up` [n_embd, n_ff].
    FfnUp,
    /// `down_proj` / `ffn_down` [n_ff, n_embd].
    FfnDown,
    /// `norm` / `output_norm` [n_embd].
    OutNorm,
    /// `lm_head` / `output` [n_embd, vocab].
    Output,
}

impl Role {
    /// Whether this is a norm weight (a vector).
    pub fn is_norm(self) -> bool {
        matches!(self, Role::AttnNorm | Role::FfnNorm | Role::OutNorm)
    }

    /// `ne` of the tensor: `[row length, rows]` for a matrix, `[n]` for a norm.
    pub fn ne(self, cfg: &Config) -> Vec<usize> {
        let (n_embd, vocab, n_ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        match self {
            Role::TokEmbd | Role::Output => vec![n_embd, vocab],
            Role::AttnNorm | Role::FfnNorm | Role::OutNorm => vec![n_embd],
            Role::AttnQ => vec![n_embd, cfg.n_q()],
            Role::AttnK | Role::AttnV => vec![n_embd, cfg.n_kv_dim()],
            Role::AttnOut => vec![cfg.n_q(), n_embd],
            Role::FfnGate | Role::FfnUp => vec![n_embd, n_ff],
            Role::FfnDown => vec![n_ff, n_embd],
        }
    }

    /// Elements of one row (`ne[0]`).
    pub fn row_len(self, cfg: &Config) -> usize {
        self.ne(cfg)[0]
    }

    /// The HF tensor name (`model.layers.0.self_attn.q_proj.weight`).
    pub fn hf_name(self, layer: Option<usize>) -> String {
        let l = layer.unwrap_or(0);
        match self {
            Role::TokEmbd => "model.embed_tokens.weight".into(),
            Role::OutNorm => "model.norm.weight".into(),
            Role::Output => "lm_head.weight".into(),
            Role::AttnNorm => format!("model.layers.{l}.input_layernorm.weight"),
            Role::AttnQ => format!("model.layers.{l}.self_attn.q_proj.weight"),
            Role::AttnK => format!("model.layers.{l}.self_attn.k_proj.weight"),
            Role::AttnV => format!("model.layers.{l}.self_attn.v_proj.weight"),
            Role::AttnOut => format!("model.layers.{l}.self_attn.o_proj.weight"),
            Role::FfnNorm => format!("model.layers.{l}.post_attention_layernorm.weight"),
            Role::FfnGate => format!("model.layers.{l}.mlp.gate_proj.weight"),
            Role::FfnUp => format!("model.layers.{l}.mlp.up_proj.weight"),
            Role::FfnDown => format!("model.layers.{l}.mlp.down_proj.weight"),
        }
    }

    /// The ggml (GGUF) base name without `.weight` (`blk.0.attn_q`).
    pub fn ggml_base(self, layer: Option<usize>) -> String {
        let l = layer.unwrap_or(0);
        match self {
            Role::TokEmbd => "token_embd".into(),
            Role::OutNorm => "output_norm".into(),
            Role::Output => "output".into(),
            Role::AttnNorm => format!("blk.{l}.attn_norm"),
            Role::AttnQ => format!("blk.{l}.attn_q"),
            Role::AttnK => format!("blk.{l}.attn_k"),
            Role::AttnV => format!("blk.{l}.attn_v"),
            Role::AttnOut => format!("blk.{l}.attn_output"),
            Role::FfnNorm => format!("blk.{l}.ffn_norm"),
            Role::FfnGate => format!("blk.{l}.ffn_gate"),
            Role::FfnUp => format!("blk.{l}.ffn_up"),
            Role::FfnDown => format!("blk.{l}.ffn_down"),
        }
    }

    /// The GGUF tensor name (`blk.0.attn_q.weight`).
    pub fn gguf_name(self, layer: Option<usize>) -> String {
        format!("{}.weight", self.ggml_base(layer))
    }
}

/// One weight tensor in the buffer: where it starts and its dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightRef {
    /// Byte offset in the weight buffer.
    pub offset: usize,
    /// The tensor's dtype.
    pub dtype: DType,
}

/// One block's weights inside the weight buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerWeights {
    /// `input_layernorm` `[n_embd]`, F32.
    pub attn_norm: WeightRef,
    /// `q_proj` [n_embd, n_q]; `k_proj` and `v_proj` follow it directly when the three
    /// share a dtype (then they form `attn_qkv` [n_embd, n_q + 2 * n_kv_dim]).
    pub attn_q: WeightRef,
    /// `k_proj` [n_embd, n_kv_dim].
    pub attn_k: WeightRef,
    /// `v_proj` [n_embd, n_kv_dim].
    pub attn_v: WeightRef,
    /// `o_proj` [n_q, n_embd].
    pub attn_out: WeightRef,
    /// `post_attention_layernorm` `[n_embd]`, F32.
    pub ffn_norm: WeightRef,
    /// `gate_proj` [n_embd, n_ff]; `up_proj` follows it directly when both share a dtype
    /// (then they form `ffn_gate_up` [n_embd, 2 * n_ff]).
    pub ffn_gate: WeightRef,
    /// `up_proj` [n_embd, n_ff].
    pub ffn_up: WeightRef,
    /// `down_proj` [n_ff, n_embd].
    pub ffn_down: WeightRef,
}

impl LayerWeights {
    /// Whether q, k and v form one fused tensor (they share a dtype).
    pub fn qkv_fused(&self) -> bool {
        self.attn_q.dtype == self.attn_k.dtype && self.attn_k.dtype == self.attn_v.dtype
    }

    /// Whether gate and up form one fused tensor (they share a dtype).
    pub fn gate_up_fused(&self) -> bool {
        self.ffn_gate.dtype == self.ffn_up.dtype
    }
}

/// One tensor of the checkpoint and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The HF name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// What the tensor is.
    pub role: Role,
    /// Its block, for the per-layer tensors.
    pub layer: Option<usize>,
    /// The HF shape, outermost first (`[out, in]` for a matrix).
    pub shape: Vec<usize>,
    /// Where it is and its dtype.
    pub at: WeightRef,
}

impl Slot {
    /// Elements of the tensor.
    pub fn nelements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether this is a norm weight (a vector), not a matrix.
    pub fn is_norm(&self) -> bool {
        self.role.is_norm()
    }

    /// Elements of one row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.shape[self.shape.len() - 1]
    }

    /// Rows of the tensor (1 for a norm).
    pub fn rows(&self) -> usize {
        self.nelements() / self.row_len()
    }

    /// Bytes of the tensor in its dtype.
    pub fn bytes(&self) -> usize {
        self.rows() * self.at.dtype.row_bytes(self.row_len())
    }

    /// The GGUF tensor name (`blk.0.attn_q.weight`).
    pub fn gguf_name(&self) -> String {
        self.role.gguf_name(self.layer)
    }
}

/// The weights of a Llama model in one backend buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// The buffer holding every weight.
    pub buffer: BufferId,
    /// Size of the buffer.
    pub bytes: usize,
    /// `embed_tokens` [n_embd, vocab].
    pub tok_embd: WeightRef,
    /// `lm_head` [n_embd, vocab] (equal to `tok_embd` when tied).
    pub output: WeightRef,
    /// `norm` `[n_embd]`, F32.
    pub out_norm: WeightRef,
    /// Per-block weights.
    pub layers: Vec<LayerWeights>,
}

/// q, k and v of one block in a graph.
pub(crate) enum QkvLeaves {
    /// `attn_qkv` [n_embd, n_q + 2 * n_kv_dim].
    Fused(TensorId),
    /// `attn_q` [n_embd, n_q], `attn_k` and `attn_v` [n_embd, n_kv_dim].
    Split {
        q: TensorId,
        k: TensorId,
        v: TensorId,
    },
}

/// gate and up of one block in a graph.
pub(crate) enum GateUpLeaves {
    /// `ffn_gate_up` [n_embd, 2 * n_ff].
    Fused(TensorId),
    /// `ffn_gate` and `ffn_up` [n_embd, n_ff].
    Split { gate: TensorId, up: TensorId },
}

/// The weight leaves of one block in a graph.
pub(crate) struct LayerLeaves {
    pub attn_norm: TensorId,
    pub qkv: QkvLeaves,
    pub attn_out: TensorId,
    pub ffn_norm: TensorId,
    pub gate_up: GateUpLeaves,
    pub ffn_down: TensorId,
}

/// The weight leaves of one graph.
pub(crate) struct Leaves {
    pub tok_embd: TensorId,
    pub output: TensorId,
    pub out_norm: TensorId,
    pub layers: Vec<LayerLeaves>,
}

/// Hands out aligned offsets in a growing buffer.
struct Cursor<'a> {
    end: usize,
    cfg: &'a Config,
    dtype_of: &'a dyn Fn(Role, Option<usize>) -> DType,
}

impl Cursor<'_> {
    /// Room for one tensor.
    fn take(&mut self, role: Role, layer: Option<usize>) -> WeightRef {
        self.take_group(&[role], layer)[0]
    }

    /// Room for tensors of the same row length: adjacent rows of one tensor when they
    /// share a dtype, separate aligned tensors otherwise.
    fn take_group(&mut self, roles: &[Role], layer: Option<usize>) -> Vec<WeightRef> {
        let dtypes: Vec<DType> = roles.iter().map(|&r| (self.dtype_of)(r, layer)).collect();
        let fused = dtypes.windows(2).all(|p| p[0] == p[1]);
        let mut out = Vec::with_capacity(roles.len());
        for (&role, &dtype) in roles.iter().zip(&dtypes) {
            let ne = role.ne(self.cfg);
            let rows: usize = ne[1..].iter().product();
            let bytes = rows * dtype.row_bytes(ne[0]);
            out.push(WeightRef {
                offset: self.end,
                dtype,
            });
            self.end += bytes;
            if !fused {
                self.end = self.end.div_ceil(ALIGN) * ALIGN;
            }
        }
        self.end = self.end.div_ceil(ALIGN) * ALIGN;
        out
    }
}

/// The dtype of every tensor of a model whose matrices are all `dtype`.
pub fn uniform(dtype: DType) -> impl Fn(Role, Option<usize>) -> DType {
    move |role, _| if role.is_norm() { DType::F32 } else { dtype }
}

/// The names a file format gives the size fields of a config, for errors.
#[derive(Clone, Copy, Debug)]
pub struct SizeFields {
    /// The layer count (`num_hidden_layers`, `llama.block_count`).
    pub layers: &'static str,
    /// The residual width (`hidden_size`, `llama.embedding_length`).
    pub hidden: &'static str,
    /// The vocabulary size.
    pub vocab: &'static str,
    /// The query heads (times the head size: the width of `q`).
    pub heads: &'static str,
    /// The key/value heads (times the head size: the width of `k` and `v`).
    pub kv_heads: &'static str,
    /// The MLP width.
    pub intermediate: &'static str,
    /// Whether the format lists dimensions outermost first (safetensors' `shape`) rather
    /// than innermost first (ggml's `ne`), for the messages.
    pub outermost_first: bool,
}

impl SizeFields {
    /// The fields of a Hugging Face `config.json`.
    pub const HF: SizeFields = SizeFields {
        layers: "num_hidden_layers",
        hidden: "hidden_size",
        vocab: "vocab_size",
        heads: "num_attention_heads",
        kv_heads: "num_key_value_heads",
        intermediate: "intermediate_size",
        outermost_first: true,
    };
    /// The metadata keys of a `llama` GGUF file.
    pub const GGUF: SizeFields = SizeFields {
        layers: "llama.block_count",
        hidden: "llama.embedding_length",
        vocab: "llama.vocab_size",
        heads: "llama.attention.head_count",
        kv_heads: "llama.attention.head_count_kv",
        intermediate: "llama.feed_forward_length",
        outermost_first: false,
    };
}

/// The number of layers whose tensors are named in `names` (`{prefix}{layer}.…`): one
/// more than the highest layer index found.
pub fn layers_named<'a>(names: impl Iterator<Item = &'a str>, prefix: &str) -> usize {
    names
        .filter_map(|n| {
            n.strip_prefix(prefix)?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map(|l| l.saturating_add(1))
        .max()
        .unwrap_or(0)
}

/// Checks `cfg`'s sizes against the tensors a file actually holds, before anything is
/// sized by them: the layer count against `layers_found`, and the widths against the
/// embedding table and layer 0's `q`, `k` and `gate` matrices (`ne_of(role)`: a label
/// naming that tensor and its `ne`, an error when it is missing). Errors (in `source`)
/// name the field and the tensor.
pub fn check_sizes(
    cfg: &Config,
    fields: SizeFields,
    source: &str,
    layers_found: usize,
    ne_of: &dyn Fn(Role) -> Result<(String, Vec<usize>)>,
) -> Result<()> {
    if cfg.num_hidden_layers > layers_found {
        return Err(Error::model(format!(
            "{source}: field '{}' is {} but the weights have tensors for {layers_found} layers",
            fields.layers, cfg.num_hidden_layers
        )));
    }
    let checks = [
        (Role::TokEmbd, 0, fields.hidden, cfg.hidden_size),
        (Role::TokEmbd, 1, fields.vocab, cfg.vocab_size),
        (Role::AttnQ, 1, fields.heads, cfg.n_q()),
        (Role::AttnK, 1, fields.kv_heads, cfg.n_kv_dim()),
        (Role::FfnGate, 1, fields.intermediate, cfg.intermediate_size),
    ];
    for (role, dim, field, want) in checks {
        let (label, ne) = ne_of(role)?;
        if ne.len() != 2 || ne[dim] != want {
            let (mut got, mut expected) = (ne, role.ne(cfg));
            let word = match fields.outermost_first {
                true => {
                    got.reverse();
                    expected.reverse();
                    "shape"
                }
                false => "ne",
            };
            return Err(Error::model(format!(
                "{source}: field '{field}' gives a size of {want}, but {label} has {word} {got:?}, expected {expected:?}"
            )));
        }
    }
    Ok(())
}

impl Weights {
    /// The layout of `cfg`'s weights with the dtype `dtype_of(role, layer)` per tensor
    /// (norms should be F32), in `buffer` (which need not exist yet: a graph can be
    /// built and planned against the layout alone, e.g. for a dump).
    pub fn layout(
        cfg: &Config,
        dtype_of: &dyn Fn(Role, Option<usize>) -> DType,
        buffer: BufferId,
    ) -> Weights {
        let mut c = Cursor {
            end: 0,
            cfg,
            dtype_of,
        };
        let tok_embd = c.take(Role::TokEmbd, None);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = Some(i);
                let attn_norm = c.take(Role::AttnNorm, l);
                let qkv = c.take_group(&[Role::AttnQ, Role::AttnK, Role::AttnV], l);
                let attn_out = c.take(Role::AttnOut, l);
                let ffn_norm = c.take(Role::FfnNorm, l);
                let gu = c.take_group(&[Role::FfnGate, Role::FfnUp], l);
                LayerWeights {
                    attn_norm,
                    attn_q: qkv[0],
                    attn_k: qkv[1],
                    attn_v: qkv[2],
                    attn_out,
                    ffn_norm,
                    ffn_gate: gu[0],
                    ffn_up: gu[1],
                    ffn_down: c.take(Role::FfnDown, l),
                }
            })
            .collect();
        let out_norm = c.take(Role::OutNorm, None);
        let output = if cfg.tie_word_embeddings {
            tok_embd
        } else {
            c.take(Role::Output, None)
        };
        Weights {
            buffer,
            bytes: c.end,
            tok_embd,
            output,
            out_norm,
            layers,
        }
    }

    /// Allocates the (zero-filled) weight buffer for `cfg` with `dtype_of`'s dtypes on
    /// `be`.
    pub fn alloc(
        cfg: &Config,
        dtype_of: &dyn Fn(Role, Option<usize>) -> DType,
        be: &mut dyn Backend,
    ) -> Result<Weights> {
        let bytes = Weights::layout(cfg, dtype_of, BufferId(0)).bytes;
        crate::models::memory::check_weights(bytes, be)?;
        let buffer = be.alloc_buffer(bytes)?;
        Ok(Weights::layout(cfg, dtype_of, buffer))
    }

    /// The dtype shared by every matrix, if there is one.
    pub fn matrix_dtype(&self, cfg: &Config) -> Option<DType> {
        let slots = self.slots(cfg);
        let mut m = slots.iter().filter(|s| !s.is_norm()).map(|s| s.at.dtype);
        let first = m.next()?;
        m.all(|d| d == first).then_some(first)
    }

    /// Every tensor of the checkpoint with its shape, offset and dtype, in buffer order.
    pub fn slots(&self, cfg: &Config) -> Vec<Slot> {
        let slot = |role: Role, layer: Option<usize>, at: WeightRef| {
            let mut shape = role.ne(cfg);
            shape.reverse();
            Slot {
                name: role.hf_name(layer),
                role,
                layer,
                shape,
                at,
            }
        };
        let mut v = vec![slot(Role::TokEmbd, None, self.tok_embd)];
        for (i, l) in self.layers.iter().enumerate() {
            let at = Some(i);
            v.push(slot(Role::AttnNorm, at, l.attn_norm));
            v.push(slot(Role::AttnQ, at, l.attn_q));
            v.push(slot(Role::AttnK, at, l.attn_k));
            v.push(slot(Role::AttnV, at, l.attn_v));
            v.push(slot(Role::AttnOut, at, l.attn_out));
            v.push(slot(Role::FfnNorm, at, l.ffn_norm));
            v.push(slot(Role::FfnGate, at, l.ffn_gate));
            v.push(slot(Role::FfnUp, at, l.ffn_up));
            v.push(slot(Role::FfnDown, at, l.ffn_down));
        }
        v.push(slot(Role::OutNorm, None, self.out_norm));
        if !cfg.tie_word_embeddings {
            v.push(slot(Role::Output, None, self.output));
        }
        v
    }

    /// Fills every weight with seeded uniform values made on the device (benchmarks):
    /// norm weights in [-1, 1), matrices in [-1/sqrt(in), 1/sqrt(in)). A block-typed
    /// matrix gets F32 values in a temporary buffer first, quantized into its place by a
    /// one-op graph ([`quantize_on_backend`]), so the same code runs on every backend.
    pub fn fill_random(&self, cfg: &Config, be: &mut dyn Backend, seed: u64) -> Result<()> {
        let slots = self.slots(cfg);
        let scratch = slots
            .iter()
            .filter(|s| s.at.dtype.quant().is_some())
            .map(|s| s.nelements() * DType::F32.block_bytes())
            .max();
        let tmp = match scratch {
            Some(bytes) => Some(be.alloc_buffer(bytes)?),
            None => None,
        };
        let filled = self.fill_slots(&slots, be, seed, tmp);
        if let Some(tmp) = tmp {
            be.free_buffer(tmp)?;
        }
        filled
    }

    fn fill_slots(
        &self,
        slots: &[Slot],
        be: &mut dyn Backend,
        seed: u64,
        tmp: Option<BufferId>,
    ) -> Result<()> {
        for (i, s) in slots.iter().enumerate() {
            let scale = if s.is_norm() {
                1.0
            } else {
                1.0 / (s.row_len() as f32).sqrt()
            };
            let (n, seed) = (s.nelements(), seed ^ ((i as u64) << 32));
            match (s.at.dtype.quant(), tmp) {
                (Some(_), Some(tmp)) => {
                    be.fill_random(tmp, 0, DType::F32, n, seed, scale)?;
                    let dst = BufferRef {
                        buffer: self.buffer,
                        offset: s.at.offset,
                    };
                    let ne = [s.row_len(), s.rows()];
                    quantize_on_backend(be, tmp, dst, s.at.dtype, ne, &s.gguf_name())?;
                }
                (Some(_), None) | (None, _) => {
                    be.fill_random(self.buffer, s.at.offset, s.at.dtype, n, seed, scale)?
                }
            }
        }
        Ok(())
    }

    /// Bytes of weights read to decode one token: everything but the embedding table,
    /// of which one row is read (unless it is also the output projection).
    pub fn bytes_per_token(&self, cfg: &Config) -> usize {
        let total: usize = self.slots(cfg).iter().map(Slot::bytes).sum();
        if cfg.tie_word_embeddings {
            total
        } else {
            let row = self.tok_embd.dtype.row_bytes(cfg.hidden_size);
            total - cfg.vocab_size * row + row
        }
    }

    /// Weight leaves of a graph (ggml-style names).
    pub(crate) fn leaves(&self, g: &mut Graph, cfg: &Config) -> Result<Leaves> {
        let n_embd = cfg.hidden_size;
        let leaf = |g: &mut Graph, name: &str, at: WeightRef, ne: &[usize]| {
            let data = BufferRef {
                buffer: self.buffer,
                offset: at.offset,
            };
            g.weight(name, at.dtype, ne, data)
        };
        let tok_embd = leaf(g, "token_embd", self.tok_embd, &Role::TokEmbd.ne(cfg))?;
        let output = if cfg.tie_word_embeddings {
            tok_embd
        } else {
            leaf(g, "output", self.output, &Role::Output.ne(cfg))?
        };
        let out_norm = leaf(g, "output_norm", self.out_norm, &[n_embd])?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let name = |r: Role| r.ggml_base(Some(i));
            let one = |g: &mut Graph, r: Role, at: WeightRef| leaf(g, &name(r), at, &r.ne(cfg));
            let qkv = if l.qkv_fused() {
                let rows = cfg.n_q() + 2 * cfg.n_kv_dim();
                let nm = format!("blk.{i}.attn_qkv");
                QkvLeaves::Fused(leaf(g, &nm, l.attn_q, &[n_embd, rows])?)
            } else {
                QkvLeaves::Split {
                    q: one(g, Role::AttnQ, l.attn_q)?,
                    k: one(g, Role::AttnK, l.attn_k)?,
                    v: one(g, Role::AttnV, l.attn_v)?,
                }
            };
            let gate_up = if l.gate_up_fused() {
                let nm = format!("blk.{i}.ffn_gate_up");
                let ne = [n_embd, 2 * cfg.intermediate_size];
                GateUpLeaves::Fused(leaf(g, &nm, l.ffn_gate, &ne)?)
            } else {
                GateUpLeaves::Split {
                    gate: one(g, Role::FfnGate, l.ffn_gate)?,
                    up: one(g, Role::FfnUp, l.ffn_up)?,
                }
            };
            layers.push(LayerLeaves {
                attn_norm: one(g, Role::AttnNorm, l.attn_norm)?,
                qkv,
                attn_out: one(g, Role::AttnOut, l.attn_out)?,
                ffn_norm: one(g, Role::FfnNorm, l.ffn_norm)?,
                gate_up,
                ffn_down: one(g, Role::FfnDown, l.ffn_down)?,
            });
        }
        Ok(Leaves {
            tok_embd,
            output,
            out_norm,
            layers,
        })
    }
}

/// Quantizes (or converts) the F32 matrix `ne` = `[row length, rows]` at the start of
/// `src` into `dtype` at `dst`, on the backend: a graph of one `cpy` from an F32 leaf
/// into a state leaf over the destination bytes.
pub fn quantize_on_backend(
    be: &mut dyn Backend,
    src: BufferId,
    dst: BufferRef,
    dtype: DType,
    ne: [usize; 2],
    name: &str,
) -> Result<()> {
    let mut g = Graph::new();
    let x = g.weight(
        &format!("{name} (f32)"),
        DType::F32,
        &ne,
        BufferRef {
            buffer: src,
            offset: 0,
        },
    )?;
    let w = g.state(name, dtype, &ne, dst)?;
    let out = g.cpy(x, w)?;
    let exec = be.load(&g.plan(&[out])?)?;
    let run = be.compute(exec);
    be.unload(exec)?;
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::models::presets;
    use crate::models::quant_plan::QuantPlan;

    #[test]
    fn slots_tile_the_buffer_without_overlap() {
        for name in presets::NAMES {
            let cfg = presets::preset(name).unwrap();
            for plan in QuantPlan::ALL {
                let pick = |r, l| plan.pick(r, l, &cfg).dtype;
                let w = Weights::layout(&cfg, &pick, BufferId(0));
                let s = w.slots(&cfg);
                let mut spans: Vec<(usize, usize)> = s
                    .iter()
                    .map(|s| (s.at.offset, s.at.offset + s.bytes()))
                    .collect();
                spans.sort();
                for pair in spans.windows(2) {
                    assert!(pair[0].1 <= pair[1].0, "{name} {plan}: {pair:?} overlap");
                }
                assert!(spans.last().unwrap().1 <= w.bytes);
                // q|k|v and gate|up are adjacent rows of one tensor when fused.
                let l = &w.layers[0];
                if l.qkv_fused() {
                    assert_eq!(s[3].at.offset, s[2].at.offset + s[2].bytes());
                    assert_eq!(s[4].at.offset, s[3].at.offset + s[3].bytes());
                }
                if l.gate_up_fused() {
                    assert_eq!(s[8].at.offset, s[7].at.offset + s[7].bytes());
                }
                assert!(s
                    .iter()
                    .filter(|s| s.is_norm())
                    .all(|s| s.at.dtype == DType::F32));
            }
        }
    }

    /// Q4_K_M splits attn_v from q|k in the layers that use more bits, and ffn_down
    /// changes type without touching gate|up.
    #[test]
    fn q4_k_m_splits_qkv_where_v_differs() {
        let cfg = presets::preset("llama2-7b").unwrap();
        let pick = |r, l| QuantPlan::Q4_K_M.pick(r, l, &cfg).dtype;
        let w = Weights::layout(&cfg, &pick, BufferId(0));
        assert!(!w.layers[0].qkv_fused());
        assert!(w.layers[4].qkv_fused());
        assert!(w.layers.iter().all(LayerWeights::gate_up_fused));
        assert_eq!(w.layers[0].ffn_down.dtype, DType::Q6_K);
        assert_eq!(w.output.dtype, DType::Q6_K);
        // Fewer bytes than Q6_K everywhere, more than Q4_K everywhere.
        let bytes = |d| Weights::layout(&cfg, &uniform(d), BufferId(0)).bytes_per_token(&cfg);
        let mixed = w.bytes_per_token(&cfg);
        assert!(bytes(DType::Q4_K) < mixed && mixed < bytes(DType::Q6_K));
    }

    #[test]
    fn fill_random_writes_every_slot() {
        let cfg = presets::preset("tiny").unwrap();
        let mut be = CpuBackend::new();
        let w = Weights::alloc(&cfg, &uniform(DType::F32), &mut be).unwrap();
        w.fill_random(&cfg, &mut be, 7).unwrap();
        for s in w.slots(&cfg) {
            let mut out = vec![0u8; s.nelements() * 4];
            be.read_buffer(w.buffer, s.at.offset, &mut out).unwrap();
            let vals: &[f32] = bytemuck::cast_slice(&out);
            let bound = if s.is_norm() {
                1.0
            } else {
                1.0 / (s.row_len() as f32).sqrt()
            };
            assert!(vals.iter().all(|v| v.abs() <= bound), "{}", s.name);
            assert!(
                vals.iter().filter(|v| **v != 0.0).count() > vals.len() / 2,
                "{}",
                s.name
            );
        }
    }

    /// A block-typed random model holds the quantization of the F32 model with the same
    /// seed: its dequantized rows are within the type's error of the F32 values.
    #[test]
    fn fill_random_quantizes_on_the_backend() {
        let cfg = presets::preset("tiny").unwrap();
        let mut be = CpuBackend::new();
        let f = Weights::alloc(&cfg, &uniform(DType::F32), &mut be).unwrap();
        f.fill_random(&cfg, &mut be, 3).unwrap();
        let q = Weights::alloc(&cfg, &uniform(DType::Q8_0), &mut be).unwrap();
        q.fill_random(&cfg, &mut be, 3).unwrap();
        for (sf, sq) in f.slots(&cfg).iter().zip(q.slots(&cfg)) {
            let mut a = vec![0u8; sf.bytes()];
            be.read_buffer(f.buffer, sf.at.offset, &mut a).unwrap();
            let mut b = vec![0u8; sq.bytes()];
            be.read_buffer(q.buffer, sq.at.offset, &mut b).unwrap();
            let a: &[f32] = bytemuck::cast_slice(&a);
            let deq: Vec<f32> = match sq.at.dtype.quant() {
                None => bytemuck::cast_slice(&b).to_vec(),
                Some(qt) => {
                    let mut d = vec![0f32; sq.nelements()];
                    crate::quant::dequantize_row(qt, &b, &mut d).unwrap();
                    d
                }
            };
            let bound = 1.0 / (sf.row_len() as f32).sqrt() / 127.0;
            let worst = a
                .iter()
                .zip(&deq)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            // half a quant step, plus the F16 rounding of the scale (127 steps x 2^-11)
            assert!(
                worst <= bound * 0.57,
                "{}: {worst} > 0.57 x {bound}",
                sq.name
            );
        }
    }
}
