//! Where every weight of a model lives in backend memory: one buffer for the whole
//! model, each tensor at an aligned byte offset with its own dtype.
//!
//! Which tensors a model has follows from its architecture's spec ([`tensor_groups`]):
//! every model has the embedding table, per-layer norms, q/k/v, the attention output,
//! the MLP and the output norm; biases, LayerNorm biases, per-head q/k norms, the gate
//! and learned positions come with the architectures that have them. A mixture of
//! experts has, in place of the MLP, the router `ffn_gate_inp` and the experts' stacks
//! `ffn_{gate,up,down}_exps` (`[.., .., n_expert]`, one matrix per expert). Vectors (norm
//! weights, biases) are F32; each matrix has its own dtype (F32, F16, BF16 or a block
//! type, see [`QuantPlan`](crate::models::load::quant_plan::QuantPlan)). Two layouts differ from a
//! checkpoint's list of tensors when the parts share one dtype:
//! - `q | k | v` are stored as adjacent rows of one tensor `attn_qkv`
//!   [n_embd, n_q + 2 * n_kv_dim], so one mul_mat computes q, k and v (the graph then
//!   takes them as strided views of the result); their biases likewise form one vector;
//! - `gate | up` likewise form `ffn_gate_up` [n_embd, 2 * n_ff].
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

use crate::backend::{Backend, FrozenTensor};
use crate::error::{Error, Result};
use crate::graph::alloc::ALIGN;
use crate::graph::{BufferId, BufferRef, DType, Graph, TensorId};

use crate::models::arch::config::Config;
use crate::models::arch::role::Role;
use crate::models::arch::{MlpKind, NormKind, Positions};
use crate::quant::QType;

/// The tensors of a model shaped `cfg`, in buffer order, as groups laid out adjacently
/// (q|k|v, their biases, gate|up): the globals before the layers (`None`), each layer's
/// (`Some(layer)`, the same list for every layer), and the globals after them.
pub fn tensor_groups(cfg: &Config) -> [Vec<&'static [Role]>; 3] {
    let spec = cfg.arch.spec();
    let layer_norm = spec.norm == NormKind::Layer;
    let mut head: Vec<&'static [Role]> = vec![&[Role::TokEmbd]];
    if spec.positions == Positions::Learned {
        head.push(&[Role::PosEmbd]);
    }
    let mut layer: Vec<&'static [Role]> = vec![&[Role::AttnNorm]];
    let opt = |v: &mut Vec<&'static [Role]>, on: bool, g: &'static [Role]| {
        if on {
            v.push(g);
        }
    };
    opt(&mut layer, layer_norm, &[Role::AttnNormB]);
    layer.push(&[Role::AttnQ, Role::AttnK, Role::AttnV]);
    opt(
        &mut layer,
        spec.qkv_bias,
        &[Role::AttnQB, Role::AttnKB, Role::AttnVB],
    );
    opt(&mut layer, spec.qk_norm, &[Role::AttnQNorm]);
    opt(&mut layer, spec.qk_norm, &[Role::AttnKNorm]);
    layer.push(&[Role::AttnOut]);
    opt(&mut layer, spec.out_bias, &[Role::AttnOutB]);
    layer.push(&[Role::FfnNorm]);
    opt(&mut layer, layer_norm, &[Role::FfnNormB]);
    match (cfg.moe, spec.mlp) {
        (Some(_), _) => {
            layer.push(&[Role::FfnGateInp]);
            layer.push(&[Role::FfnGateExps]);
            layer.push(&[Role::FfnUpExps]);
            layer.push(&[Role::FfnDownExps]);
        }
        (None, MlpKind::SwiGlu) => layer.push(&[Role::FfnGate, Role::FfnUp]),
        (None, MlpKind::Gelu) => layer.push(&[Role::FfnUp]),
    }
    if cfg.moe.is_none() {
        opt(&mut layer, spec.mlp_bias, &[Role::FfnUpB]);
        layer.push(&[Role::FfnDown]);
        opt(&mut layer, spec.mlp_bias, &[Role::FfnDownB]);
    }
    let mut tail: Vec<&'static [Role]> = vec![&[Role::OutNorm]];
    opt(&mut tail, layer_norm, &[Role::OutNormB]);
    opt(&mut tail, !cfg.tie_word_embeddings, &[Role::Output]);
    [head, layer, tail]
}

/// One weight tensor in the buffer: where it starts and its dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightRef {
    /// Byte offset in the weight buffer.
    pub offset: usize,
    /// The tensor's dtype.
    pub dtype: DType,
}

/// One tensor of the model and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The GGUF-style name (`blk.0.attn_q.weight`), used in messages.
    pub name: String,
    /// What the tensor is.
    pub role: Role,
    /// Its block, for the per-layer tensors.
    pub layer: Option<usize>,
    /// The shape outermost first (`[out, in]` for a matrix, as HF writes it).
    pub shape: Vec<usize>,
    /// Where it is and its dtype.
    pub at: WeightRef,
}

impl Slot {
    /// Elements of the tensor.
    pub fn nelements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether this is a vector (norm weight or bias), not a matrix.
    pub fn is_vector(&self) -> bool {
        self.role.is_vector()
    }

    /// Elements of one row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.shape[self.shape.len() - 1]
    }

    /// Rows of the tensor (1 for a vector).
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

/// The weights of a model in one backend buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// The buffer holding every weight.
    pub buffer: BufferId,
    /// Size of the buffer.
    pub bytes: usize,
    /// The model-wide tensors (embeddings, output norm, output head), by role.
    pub globals: Vec<(Role, WeightRef)>,
    /// Per-block tensors, by role.
    pub layers: Vec<Vec<(Role, WeightRef)>>,
}

/// q, k and v (or their biases) of one block in a graph.
pub(crate) enum QkvLeaves {
    /// `attn_qkv` [n_embd, n_q + 2 * n_kv_dim] (biases: [n_q + 2 * n_kv_dim]).
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
    /// `ffn_up` alone (an MLP without gate).
    Up(TensorId),
}

/// A norm's weight and, for LayerNorm, its bias.
#[derive(Clone, Copy)]
pub(crate) struct NormLeaves {
    pub w: TensorId,
    pub b: Option<TensorId>,
}

/// The weight leaves of one block in a graph.
pub(crate) struct LayerLeaves {
    pub attn_norm: NormLeaves,
    pub qkv: QkvLeaves,
    pub qkv_b: Option<QkvLeaves>,
    pub q_norm: Option<TensorId>,
    pub k_norm: Option<TensorId>,
    pub attn_out: TensorId,
    pub attn_out_b: Option<TensorId>,
    pub ffn_norm: NormLeaves,
    pub ffn: FfnLeaves,
}

/// The MLP of one block in a graph.
pub(crate) enum FfnLeaves {
    /// One MLP.
    Dense {
        gate_up: GateUpLeaves,
        up_b: Option<TensorId>,
        down: TensorId,
        down_b: Option<TensorId>,
    },
    /// A mixture of experts: the router `ffn_gate_inp` [n_embd, n_expert] and the
    /// experts' `ffn_gate_exps`, `ffn_up_exps` [n_embd, n_ff, n_expert] and
    /// `ffn_down_exps` [n_ff, n_embd, n_expert].
    Experts {
        router: TensorId,
        gate: TensorId,
        up: TensorId,
        down: TensorId,
    },
}

/// The weight leaves of one graph.
pub(crate) struct Leaves {
    pub tok_embd: TensorId,
    pub pos_embd: Option<TensorId>,
    pub output: TensorId,
    pub out_norm: NormLeaves,
    pub layers: Vec<LayerLeaves>,
}

/// Hands out aligned offsets in a growing buffer.
struct Cursor<'a> {
    end: usize,
    cfg: &'a Config,
    dtype_of: &'a dyn Fn(Role, Option<usize>) -> DType,
}

impl Cursor<'_> {
    /// Room for tensors of the same row length: adjacent rows of one tensor when they
    /// share a dtype, separate aligned tensors otherwise.
    fn take_group(&mut self, roles: &[Role], layer: Option<usize>) -> Vec<(Role, WeightRef)> {
        let dtypes: Vec<DType> = roles.iter().map(|&r| (self.dtype_of)(r, layer)).collect();
        let fused = dtypes.windows(2).all(|p| p[0] == p[1]);
        let mut out = Vec::with_capacity(roles.len());
        for (&role, &dtype) in roles.iter().zip(&dtypes) {
            let ne = role.ne(self.cfg);
            let rows: usize = ne[1..].iter().product();
            let bytes = rows * dtype.row_bytes(ne[0]);
            out.push((
                role,
                WeightRef {
                    offset: self.end,
                    dtype,
                },
            ));
            self.end += bytes;
            if !fused {
                self.end = self.end.div_ceil(ALIGN) * ALIGN;
            }
        }
        self.end = self.end.div_ceil(ALIGN) * ALIGN;
        out
    }

    fn take_all(&mut self, groups: &[&[Role]], layer: Option<usize>) -> Vec<(Role, WeightRef)> {
        groups
            .iter()
            .flat_map(|g| self.take_group(g, layer))
            .collect()
    }
}

/// The dtype of every tensor of a model whose matrices are all `dtype`.
pub fn uniform(dtype: DType) -> impl Fn(Role, Option<usize>) -> DType {
    move |role, _| if role.is_vector() { DType::F32 } else { dtype }
}

/// The names a file format gives the size fields of a config, for errors.
#[derive(Clone, Debug)]
pub struct SizeFields {
    /// The layer count (`num_hidden_layers`, `llama.block_count`).
    pub layers: String,
    /// The residual width (`hidden_size`, `llama.embedding_length`).
    pub hidden: String,
    /// The vocabulary size.
    pub vocab: String,
    /// The query heads (times the head size: the width of `q`).
    pub heads: String,
    /// The key/value heads (times the head size: the width of `k` and `v`), if the
    /// architecture has them.
    pub kv_heads: Option<String>,
    /// The MLP width.
    pub intermediate: String,
    /// The expert count (of a mixture of experts).
    pub experts: String,
    /// Whether the format lists dimensions outermost first (safetensors' `shape`) rather
    /// than innermost first (ggml's `ne`), for the messages.
    pub outermost_first: bool,
}

impl SizeFields {
    /// The fields of a Hugging Face `config.json` of `cfg`'s architecture.
    pub fn hf(cfg: &Config) -> SizeFields {
        let k = cfg.arch.spec().hf_keys;
        SizeFields {
            layers: k.layers.into(),
            hidden: k.hidden.into(),
            vocab: "vocab_size".into(),
            heads: k.heads.into(),
            kv_heads: k.kv_heads.map(Into::into),
            intermediate: k.intermediate.into(),
            experts: cfg
                .arch
                .spec()
                .experts
                .map_or(String::new(), |e| e.hf_count.join(" / ")),
            outermost_first: true,
        }
    }

    /// The metadata keys of a GGUF file of `cfg`'s architecture.
    pub fn gguf(cfg: &Config) -> SizeFields {
        let a = cfg.arch.spec().gguf_arch;
        SizeFields {
            layers: format!("{a}.block_count"),
            hidden: format!("{a}.embedding_length"),
            vocab: format!("{a}.vocab_size"),
            heads: format!("{a}.attention.head_count"),
            kv_heads: Some(format!("{a}.attention.head_count_kv")),
            intermediate: format!(
                "{a}.{}",
                cfg.arch
                    .spec()
                    .experts
                    .map_or("feed_forward_length", |e| e.gguf_ff)
            ),
            experts: format!("{a}.expert_count"),
            outermost_first: false,
        }
    }
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
/// embedding table and layer 0's `q`, `k` (or the attention output where files fuse
/// q|k|v) and first MLP matrices (`ne_of(role)`: a label naming that tensor and its `ne`, an error when
/// it is missing). Errors (in `source`) name the field and the tensor.
pub fn check_sizes(
    cfg: &Config,
    fields: &SizeFields,
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
    let spec = cfg.arch.spec();
    // q (and k) where files store them alone, else the output projection's input width
    let heads = match spec.gguf_fused_qkv {
        false => (Role::AttnQ, 1, &fields.heads, cfg.n_q()),
        true => (Role::AttnOut, 0, &fields.heads, cfg.n_q()),
    };
    let mut checks = vec![
        (Role::TokEmbd, 0, &fields.hidden, cfg.hidden_size),
        (Role::TokEmbd, 1, &fields.vocab, cfg.vocab_size),
        heads,
    ];
    if let (Some(kv), false) = (&fields.kv_heads, spec.gguf_fused_qkv) {
        checks.push((Role::AttnK, 1, kv, cfg.n_kv_dim()));
    }
    match (cfg.moe, spec.mlp) {
        // the experts' width is checked with each expert's shape; the router's rows
        // are the experts
        (Some(m), _) => checks.push((Role::FfnGateInp, 1, &fields.experts, m.n_expert)),
        (None, MlpKind::SwiGlu) => checks.push((
            Role::FfnGate,
            1,
            &fields.intermediate,
            cfg.intermediate_size,
        )),
        (None, MlpKind::Gelu) => {
            checks.push((Role::FfnUp, 1, &fields.intermediate, cfg.intermediate_size))
        }
    }
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
    /// (vectors should be F32), in `buffer` (which need not exist yet: a graph can be
    /// built and planned against the layout alone, e.g. for a dump).
    pub fn layout(
        cfg: &Config,
        dtype_of: &dyn Fn(Role, Option<usize>) -> DType,
        buffer: BufferId,
    ) -> Weights {
        let [head, layer, tail] = tensor_groups(cfg);
        let mut c = Cursor {
            end: 0,
            cfg,
            dtype_of,
        };
        let mut globals = c.take_all(&head, None);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| c.take_all(&layer, Some(i)))
            .collect();
        globals.extend(c.take_all(&tail, None));
        Weights {
            buffer,
            bytes: c.end,
            globals,
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
        crate::models::load::fit::check_weights(bytes, be)?;
        let buffer = be.alloc_buffer(bytes)?;
        Ok(Weights::layout(cfg, dtype_of, buffer))
    }

    /// The tensor `role` of `layer` (`None`: a global), if the model has it. The output
    /// head of a model with tied embeddings is the embedding table.
    pub fn get(&self, role: Role, layer: Option<usize>) -> Option<WeightRef> {
        let list = match layer {
            Some(l) => self.layers.get(l)?,
            None => &self.globals,
        };
        let found = list.iter().find(|(r, _)| *r == role).map(|(_, w)| *w);
        match (found, role, layer) {
            (None, Role::Output, None) => self.get(Role::TokEmbd, None),
            (found, _, _) => found,
        }
    }

    /// The dtype shared by every matrix, if there is one.
    pub fn matrix_dtype(&self, cfg: &Config) -> Option<DType> {
        let slots = self.slots(cfg);
        let mut m = slots.iter().filter(|s| !s.is_vector()).map(|s| s.at.dtype);
        let first = m.next()?;
        m.all(|d| d == first).then_some(first)
    }

    /// Every tensor of the model with its shape, offset and dtype, in buffer order.
    pub fn slots(&self, cfg: &Config) -> Vec<Slot> {
        let slot = |role: Role, layer: Option<usize>, at: WeightRef| {
            let mut shape = role.ne(cfg);
            shape.reverse();
            Slot {
                name: role.gguf_name(layer),
                role,
                layer,
                shape,
                at,
            }
        };
        let n_head = self
            .globals
            .iter()
            .take_while(|(r, _)| *r != Role::OutNorm)
            .count();
        let (head, tail) = self.globals.split_at(n_head);
        let mut v: Vec<Slot> = head.iter().map(|&(r, at)| slot(r, None, at)).collect();
        for (i, l) in self.layers.iter().enumerate() {
            v.extend(l.iter().map(|&(r, at)| slot(r, Some(i), at)));
        }
        v.extend(tail.iter().map(|&(r, at)| slot(r, None, at)));
        v
    }

    /// Fills every weight with seeded uniform values made on the device (benchmarks):
    /// norm weights in [-1, 1), matrices and biases in [-1/sqrt(in), 1/sqrt(in)). A
    /// block-typed matrix gets F32 values in a temporary buffer first, quantized into its
    /// place by a one-op graph ([`quantize_on_backend`]), so the same code runs on every
    /// backend.
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
            let scale = if s.is_vector() {
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

    /// Declares every matrix but the embedding tables frozen on `be`
    /// ([`Backend::freeze_weights`]): the model only reads them as mul_mat weights from
    /// now on, so the backend may store them in its own layout (the CUDA backend splits
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K rows for its decode products, the CPU
    /// backend interleaves Q4_0 and IQ4_NL rows eight at a time). The embedding tables
    /// stay as they are: get_rows reads them, and with tied embeddings the output head is
    /// the token table. So do the experts' stacks, which mul_mat_id reads.
    pub fn freeze(&self, cfg: &Config, be: &mut dyn Backend) -> Result<()> {
        let tensors: Vec<FrozenTensor> = self
            .slots(cfg)
            .iter()
            .filter(|s| !s.is_vector() && !s.role.is_experts())
            .filter(|s| !matches!(s.role, Role::TokEmbd | Role::PosEmbd))
            .map(|s| FrozenTensor {
                name: s.gguf_name(),
                offset: s.at.offset,
                dtype: s.at.dtype,
                row_len: s.row_len(),
                rows: s.rows(),
            })
            .collect();
        be.freeze_weights(self.buffer, &tensors)
    }

    /// Bytes of weights read to decode one token: everything but the embedding tables,
    /// of which one row each is read (unless the token table is also the output head),
    /// and of the experts' stacks only the share of the experts a token goes through.
    pub fn bytes_per_token(&self, cfg: &Config) -> usize {
        let row_only = |s: &Slot| {
            s.role == Role::PosEmbd || (s.role == Role::TokEmbd && !cfg.tie_word_embeddings)
        };
        let used = cfg.moe.map_or(1, |m| m.n_used);
        self.slots(cfg)
            .iter()
            .map(|s| match (row_only(s), s.role.is_experts()) {
                (true, _) => s.at.dtype.row_bytes(s.row_len()),
                (false, true) => s.bytes() / cfg.n_expert().max(1) * used,
                (false, false) => s.bytes(),
            })
            .sum()
    }

    /// Weight leaves of a graph (ggml-style names).
    pub(crate) fn leaves(&self, g: &mut Graph, cfg: &Config) -> Result<Leaves> {
        let one = |g: &mut Graph, r: Role, layer: Option<usize>| -> Result<Option<TensorId>> {
            match self.get(r, layer) {
                Some(at) => self.role_leaf(g, cfg, r, layer, at).map(Some),
                None => Ok(None),
            }
        };
        let need = |g: &mut Graph, r: Role, layer: Option<usize>| -> Result<TensorId> {
            self.role_leaf(g, cfg, r, layer, self.need(r, layer)?)
        };
        let tok_embd = need(g, Role::TokEmbd, None)?;
        let output = match cfg.tie_word_embeddings {
            true => tok_embd,
            false => need(g, Role::Output, None)?,
        };
        let out_norm = NormLeaves {
            w: need(g, Role::OutNorm, None)?,
            b: one(g, Role::OutNormB, None)?,
        };
        let pos_embd = one(g, Role::PosEmbd, None)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for i in 0..self.layers.len() {
            let l = Some(i);
            let norm = |g: &mut Graph, w: Role, b: Role| -> Result<NormLeaves> {
                Ok(NormLeaves {
                    w: need(g, w, l)?,
                    b: one(g, b, l)?,
                })
            };
            let biases = [Role::AttnQB, Role::AttnKB, Role::AttnVB];
            layers.push(LayerLeaves {
                attn_norm: norm(g, Role::AttnNorm, Role::AttnNormB)?,
                qkv: self.qkv_leaves(g, cfg, i, [Role::AttnQ, Role::AttnK, Role::AttnV])?,
                qkv_b: match self.get(Role::AttnQB, l) {
                    Some(_) => Some(self.qkv_leaves(g, cfg, i, biases)?),
                    None => None,
                },
                q_norm: one(g, Role::AttnQNorm, l)?,
                k_norm: one(g, Role::AttnKNorm, l)?,
                attn_out: need(g, Role::AttnOut, l)?,
                attn_out_b: one(g, Role::AttnOutB, l)?,
                ffn_norm: norm(g, Role::FfnNorm, Role::FfnNormB)?,
                ffn: match cfg.moe {
                    Some(_) => FfnLeaves::Experts {
                        router: need(g, Role::FfnGateInp, l)?,
                        gate: need(g, Role::FfnGateExps, l)?,
                        up: need(g, Role::FfnUpExps, l)?,
                        down: need(g, Role::FfnDownExps, l)?,
                    },
                    None => FfnLeaves::Dense {
                        gate_up: self.gate_up_leaves(g, cfg, i)?,
                        up_b: one(g, Role::FfnUpB, l)?,
                        down: need(g, Role::FfnDown, l)?,
                        down_b: one(g, Role::FfnDownB, l)?,
                    },
                },
            });
        }
        Ok(Leaves {
            tok_embd,
            pos_embd,
            output,
            out_norm,
            layers,
        })
    }

    /// The tensor `role` of `layer`, which the layout must have.
    fn need(&self, role: Role, layer: Option<usize>) -> Result<WeightRef> {
        self.get(role, layer)
            .ok_or_else(|| Error::model(format!("internal: no tensor {}", role.gguf_name(layer))))
    }

    /// A weight leaf `name` of `ne` over the tensor at `at`.
    fn leaf(&self, g: &mut Graph, name: &str, at: WeightRef, ne: &[usize]) -> Result<TensorId> {
        let data = BufferRef {
            buffer: self.buffer,
            offset: at.offset,
        };
        g.weight(name, at.dtype, ne, data)
    }

    /// The leaf of tensor `role` of `layer` (at `at`), with its ggml name and `ne`.
    fn role_leaf(
        &self,
        g: &mut Graph,
        cfg: &Config,
        role: Role,
        layer: Option<usize>,
        at: WeightRef,
    ) -> Result<TensorId> {
        self.leaf(g, &role.ggml_base(layer), at, &role.ne(cfg))
    }

    /// The leaf or leaves of q|k|v (`roles`: the matrices or their biases) of layer `i`:
    /// one fused tensor when the three are adjacent rows of one dtype.
    fn qkv_leaves(
        &self,
        g: &mut Graph,
        cfg: &Config,
        i: usize,
        roles: [Role; 3],
    ) -> Result<QkvLeaves> {
        let l = Some(i);
        let [q, k, v] = roles.map(|r| self.need(r, l));
        let (q, k, v) = (q?, k?, v?);
        if q.dtype == k.dtype && k.dtype == v.dtype {
            let rows = cfg.n_q() + 2 * cfg.n_kv_dim();
            let (name, ne) = match roles[0].is_vector() {
                true => (format!("blk.{i}.attn_qkv.bias"), vec![rows]),
                false => (format!("blk.{i}.attn_qkv"), vec![cfg.hidden_size, rows]),
            };
            return Ok(QkvLeaves::Fused(self.leaf(g, &name, q, &ne)?));
        }
        Ok(QkvLeaves::Split {
            q: self.role_leaf(g, cfg, roles[0], l, q)?,
            k: self.role_leaf(g, cfg, roles[1], l, k)?,
            v: self.role_leaf(g, cfg, roles[2], l, v)?,
        })
    }

    /// The leaf or leaves of the MLP's input projections of layer `i`.
    fn gate_up_leaves(&self, g: &mut Graph, cfg: &Config, i: usize) -> Result<GateUpLeaves> {
        let l = Some(i);
        let up = self.need(Role::FfnUp, l)?;
        let Some(gate) = self.get(Role::FfnGate, l) else {
            return Ok(GateUpLeaves::Up(self.role_leaf(
                g,
                cfg,
                Role::FfnUp,
                l,
                up,
            )?));
        };
        if gate.dtype == up.dtype {
            let ne = [cfg.hidden_size, 2 * cfg.intermediate_size];
            let name = format!("blk.{i}.ffn_gate_up");
            return Ok(GateUpLeaves::Fused(self.leaf(g, &name, gate, &ne)?));
        }
        Ok(GateUpLeaves::Split {
            gate: self.role_leaf(g, cfg, Role::FfnGate, l, gate)?,
            up: self.role_leaf(g, cfg, Role::FfnUp, l, up)?,
        })
    }
}

/// Quantizes (or converts) the F32 matrix `ne` = `[row length, rows]` at the start of
/// `src` into `dtype` at `dst`, on the backend: a graph of one `cpy` from an F32 leaf
/// into a state leaf over the destination bytes. A block type the backend does not
/// quantize to (the CUDA backend's Q2_K, Q3_K, IQ4 and ternary types) is quantized on the
/// host instead ([`quantize_on_host`]).
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
    let plan = g.plan(&[out])?;
    if let Some(q) = dtype.quant() {
        if plan.steps.iter().any(|s| be.supports(s).is_err()) {
            return quantize_on_host(be, src, dst, q, ne);
        }
    }
    let exec = be.load(&plan)?;
    let run = be.compute(exec);
    be.unload(exec)?;
    run
}

/// [`quantize_on_backend`] through the host: the F32 rows read back, quantized by
/// [`crate::quant::quantize_row`] (an error for the types graft only reads), written to
/// `dst`.
fn quantize_on_host(
    be: &mut dyn Backend,
    src: BufferId,
    dst: BufferRef,
    q: QType,
    [k, rows]: [usize; 2],
) -> Result<()> {
    use rayon::prelude::*;
    let mut f32s = vec![0f32; k * rows];
    be.read_buffer(src, 0, bytemuck::cast_slice_mut(&mut f32s))?;
    let row_bytes = q.row_bytes(k)?;
    let mut out = vec![0u8; row_bytes * rows];
    out.par_chunks_mut(row_bytes)
        .zip(f32s.par_chunks(k))
        .try_for_each(|(o, x)| crate::quant::quantize_row(q, x, o))?;
    be.write_buffer(dst.buffer, dst.offset, &out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::models::arch::presets;
    use crate::models::load::quant_plan::QuantPlan;

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
                let at = |r| w.get(r, Some(0)).unwrap();
                let gated = w.get(Role::FfnGate, Some(0)).is_some();
                let end = |r: Role| {
                    let ne = r.ne(&cfg);
                    at(r).offset + ne[1] * at(r).dtype.row_bytes(ne[0])
                };
                let (q, k, v) = (at(Role::AttnQ), at(Role::AttnK), at(Role::AttnV));
                if q.dtype == k.dtype && k.dtype == v.dtype {
                    assert_eq!(k.offset, end(Role::AttnQ));
                    assert_eq!(v.offset, end(Role::AttnK));
                }
                if gated && at(Role::FfnGate).dtype == at(Role::FfnUp).dtype {
                    assert_eq!(at(Role::FfnUp).offset, end(Role::FfnGate));
                }
                assert!(s
                    .iter()
                    .filter(|s| s.is_vector())
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
        let dt = |r, l| w.get(r, l).unwrap().dtype;
        assert_ne!(dt(Role::AttnQ, Some(0)), dt(Role::AttnV, Some(0)));
        assert_eq!(dt(Role::AttnQ, Some(4)), dt(Role::AttnV, Some(4)));
        assert!((0..cfg.num_hidden_layers)
            .all(|l| dt(Role::FfnGate, Some(l)) == dt(Role::FfnUp, Some(l))));
        assert_eq!(dt(Role::FfnDown, Some(0)), DType::Q6_K);
        assert_eq!(dt(Role::Output, None), DType::Q6_K);
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
            let bound = if s.is_vector() {
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
