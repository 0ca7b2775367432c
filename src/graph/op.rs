//! The op set: one [`Op`] enum with typed parameters is the dispatch table. Ops come in
//! families ([`ViewOp`], [`UnaryOp`], [`BinaryOp`], [`NormOp`], [`CopyOp`], [`MaskOp`]),
//! each a sub-enum whose name, kind and in-place rule live with its variants; backends
//! match on them with no catch-all arm, so adding an op makes the compiler list every place
//! to touch. The builders (shape and dtype inference) and the CPU kernels of each family
//! live in `crate::ops::<family>`.
//!
//! This file belongs to the graph layer: a [`Tensor`](super::Tensor) records the op that
//! produces it, so the op's type (and its parameter types, such as [`RopeParams`]) must
//! be known below the op builders.

use std::fmt;

/// Declares a family of parameterless ops: the enum, `ALL`, and `name()`, each variant's
/// name written next to it.
macro_rules! op_family {
    (
        $(#[$meta:meta])*
        pub enum $family:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $name:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $family {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $family {
            /// Every op of the family, in declaration order.
            pub const ALL: &'static [$family] = &[$($family::$variant),+];

            /// The op's name in dumps, error messages and kernel names.
            pub const fn name(self) -> &'static str {
                match self {
                    $( $family::$variant => $name, )+
                }
            }
        }

        impl fmt::Display for $family {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

op_family! {
    /// Elementwise functions of one float operand (same dtype in and out, any strides, in
    /// place allowed). The CPU scalar is `UnaryOp::apply` in `ops/unary.rs`; the CUDA
    /// functor of the same name in `cuda/unary.cu` (kernels generated per dtype).
    pub enum UnaryOp {
        /// `x * sigmoid(x)` (SiLU / swish).
        Silu = "silu",
        /// GELU with the tanh approximation (GPT-2).
        Gelu = "gelu",
        /// The hyperbolic tangent (logit softcapping: `c * tanh(x / c)`).
        Tanh = "tanh",
        /// `1 / (1 + exp(-x))` (sigmoid gating of a mixture of experts' router).
        Sigmoid = "sigmoid",
        /// `log(sigmoid(x))`, computed without overflow (renormalised sigmoid gating: the
        /// softmax of these is `sigmoid(x_i) / sum_j sigmoid(x_j)`).
        LogSigmoid = "log_sigmoid",
    }
}

op_family! {
    /// Elementwise functions of two float operands, the second broadcast over the first by
    /// ggml's rule `y[i % ky]` in all four dims. CPU scalar: `BinaryOp::apply` in
    /// `ops/binary.rs`; CUDA functor in `cuda/binary.cu`.
    pub enum BinaryOp {
        /// `a + b`.
        Add = "add",
        /// `a * b`.
        Mul = "mul",
    }
}

/// Ops that only reinterpret memory: no backend runs a kernel for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ViewOp {
    /// A strided window into `src[0]` at a byte offset (view_1d..view_4d).
    View,
    /// The same memory as `src[0]` (contiguous) with another shape.
    Reshape,
    /// `src[0]` with its dimensions reordered: result dim `axes[i]` is source dim `i`.
    Permute {
        /// Where each source dimension goes.
        axes: [usize; 4],
    },
    /// `src[0]` with dims 0 and 1 swapped.
    Transpose,
    /// The same memory and layout as `src[0]`, ordered after every other source (reads a
    /// KV cache after the writes into it).
    After,
}

impl ViewOp {
    /// The op's name in dumps and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            ViewOp::View => "view",
            ViewOp::Reshape => "reshape",
            ViewOp::Permute { .. } => "permute",
            ViewOp::Transpose => "transpose",
            ViewOp::After => "after",
        }
    }
}

/// Row normalizations over dim 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormOp {
    /// `x / sqrt(mean(x^2) + eps)`.
    RmsNorm {
        /// Added to the mean square.
        eps: f32,
    },
    /// `(x - mean) / sqrt(var + eps)` (LayerNorm without the affine part).
    Norm {
        /// Added to the variance.
        eps: f32,
    },
}

impl NormOp {
    /// The op's name in dumps and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            NormOp::RmsNorm { .. } => "rms_norm",
            NormOp::Norm { .. } => "norm",
        }
    }

    /// The epsilon of either norm.
    pub const fn eps(self) -> f32 {
        match self {
            NormOp::RmsNorm { eps } | NormOp::Norm { eps } => eps,
        }
    }
}

/// Copies and conversions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyOp {
    /// Copies `src[0]` into the memory of `src[1]` (a view of a state tensor), converting
    /// dtypes; elements are matched in row-major order. The result is a view of `src[1]`.
    Cpy,
    /// A fresh contiguous copy of `src[0]`, converted to the node's dtype (cont / cast).
    Cont,
    /// Writes row `r` of `src[0]` into row `src[1][r]` of `src[2]` (a state tensor or a
    /// view of one), converting dtypes. The result is a view of all of `src[2]`.
    SetRows,
}

impl CopyOp {
    /// The op's name in dumps and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            CopyOp::Cpy => "cpy",
            CopyOp::Cont => "cont",
            CopyOp::SetRows => "set_rows",
        }
    }
}

/// Attention row ops: masking and softmax.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MaskOp {
    /// Sets `x[i0, i1]` to -inf where `i0 > n_past + i1` (causal mask).
    DiagMaskInf {
        /// Keys before the first query row.
        n_past: usize,
    },
    /// Softmax over each row of `src[0] * scale (+ src[1])`, with an optional additive
    /// mask `src[1]` broadcast over rows and batches.
    SoftMax {
        /// Applied before the mask.
        scale: f32,
    },
}

impl MaskOp {
    /// The op's name in dumps and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            MaskOp::DiagMaskInf { .. } => "diag_mask_inf",
            MaskOp::SoftMax { .. } => "soft_max",
        }
    }
}

/// An operation and its parameters. Sources live in [`Tensor::src`](super::Tensor).
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// No computation: an input, weight or state tensor.
    Leaf,
    /// A view of `src[0]`'s memory.
    View(ViewOp),
    /// Rows of `src[0]` picked by the I32 ids of `src[1]` (embedding lookup). Result F32.
    GetRows,
    /// An elementwise function of `src[0]`.
    Unary(UnaryOp),
    /// `src[0] * s`.
    Scale {
        /// The factor.
        s: f32,
    },
    /// An elementwise function of `src[0]` and the broadcast `src[1]`.
    Binary(BinaryOp),
    /// A row normalization of `src[0]`.
    Norm(NormOp),
    /// ggml's mul_mat: contracts `src[0]` [k, m, a2, a3] with `src[1]` [k, n, b2, b3]
    /// over dim 0, giving F32 [m, n, b2, b3]; `src[0]` is broadcast over dims 2 and 3.
    MulMat,
    /// ggml's mul_mat_id: a product whose weight matrix is picked per column by an id.
    /// `src[0]` [k, m, n_expert] are the experts' matrices, `src[1]` [k, b1, n_tokens] the
    /// inputs and `src[2]` I32 [n_used, n_tokens] the experts of each token; the F32 result
    /// [m, n_used, n_tokens] holds `src[0][:, :, ids[i, t]]^T src[1][:, i % b1, t]`.
    MulMatId,
    /// Rotary position embedding; positions are the I32 `src[1]`.
    Rope(RopeParams),
    /// A copy or conversion.
    Copy(CopyOp),
    /// A causal mask or a softmax.
    Mask(MaskOp),
    /// Index of the largest element of each row, as I32.
    Argmax,
    /// Indices of the `k` largest elements of each row, as I32, largest first.
    TopK {
        /// Indices per row.
        k: usize,
    },
    /// Fused attention (ggml's flash_attn_ext): `softmax(scale * q k^T (+ slope * mask))
    /// v` per query and head with an online softmax; `src` = q, k, v and an optional mask.
    FlashAttnExt(FlashAttnParams),
    /// Fused attention over a KV cache in blocks of a shared pool, for a batch of
    /// sequences: `src` = q, k pool, v pool, block table, each token's (sequence,
    /// position); causal (and windowed) by positions, no mask tensor.
    PagedAttn(PagedAttnParams),
    /// The sum of `src[0]` over the devices of a group (tensor parallelism): every
    /// device's graph holds the node and gets the same sum.
    AllReduce(AllReduceParams),
}

/// Parameters of a collective op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReduceParams {
    /// Devices in the group.
    pub devices: usize,
}

/// Parameters of a fused attention op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashAttnParams {
    /// Factor applied to `q . k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// ALiBi: the largest bias slope exponent (0 for none); head `h`'s mask is
    /// multiplied by its slope.
    pub max_bias: f32,
    /// Logit softcapping `c * tanh(s / c)` of the scaled scores (0 for none).
    pub softcap: f32,
}

impl FlashAttnParams {
    /// The ALiBi slope of head `h` of `n_head` (1 when `max_bias` is 0), ggml's rule:
    /// powers of `2^(-max_bias / n)` for the first `n` heads (`n` the largest power of two
    /// <= `n_head`), odd powers of `2^(-max_bias / 2n)` for the rest.
    pub fn slope(&self, h: usize, n_head: usize) -> f32 {
        if self.max_bias <= 0.0 {
            return 1.0;
        }
        let n = 1usize << (usize::BITS - 1 - n_head.max(1).leading_zeros());
        let m0 = 2f32.powf(-self.max_bias / n as f32);
        let m1 = 2f32.powf(-self.max_bias / 2.0 / n as f32);
        if h < n {
            m0.powi(h as i32 + 1)
        } else {
            m1.powi(2 * (h - n) as i32 + 1)
        }
    }
}

/// Parameters of the paged attention op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedAttnParams {
    /// Factor applied to `q . k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Logit softcapping `c * tanh(s / c)` of the scaled scores (0 for none).
    pub softcap: f32,
    /// Positions per block of the pool.
    pub block_size: usize,
    /// A sliding window: the query at position `p` sees positions `p + 1 - window ..= p`
    /// (0 for none: every position up to `p`).
    pub window: usize,
}

impl PagedAttnParams {
    /// The first key position the query at position `pos` sees.
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.window {
            0 => 0,
            w => (pos + 1).saturating_sub(w),
        }
    }
}

impl fmt::Display for PagedAttnParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "scale={} block={}", self.scale, self.block_size)?;
        if self.softcap != 0.0 {
            write!(f, " softcap={}", self.softcap)?;
        }
        if self.window != 0 {
            write!(f, " window={}", self.window)?;
        }
        Ok(())
    }
}

impl fmt::Display for FlashAttnParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "scale={}", self.scale)?;
        if self.max_bias != 0.0 {
            write!(f, " max_bias={}", self.max_bias)?;
        }
        if self.softcap != 0.0 {
            write!(f, " softcap={}", self.softcap)?;
        }
        Ok(())
    }
}

/// Coarse grouping of ops, used to colour graph dumps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Inputs, weights, state.
    Leaf,
    /// No computation.
    View,
    /// Copies, conversions, gathers and scatters.
    Data,
    /// Elementwise arithmetic.
    Elementwise,
    /// Row-wise reductions and normalizations.
    Row,
    /// Matrix products.
    MatMul,
    /// Communication between the devices of a group.
    Collective,
}

impl Op {
    /// The op's name in dumps and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Leaf => "leaf",
            Op::View(v) => v.name(),
            Op::GetRows => "get_rows",
            Op::Unary(u) => u.name(),
            Op::Scale { .. } => "scale",
            Op::Binary(b) => b.name(),
            Op::Norm(n) => n.name(),
            Op::MulMat => "mul_mat",
            Op::MulMatId => "mul_mat_id",
            Op::Rope(_) => "rope",
            Op::Copy(c) => c.name(),
            Op::Mask(m) => m.name(),
            Op::Argmax => "argmax",
            Op::TopK { .. } => "top_k",
            Op::FlashAttnExt(_) => "flash_attn_ext",
            Op::PagedAttn(_) => "paged_attn",
            Op::AllReduce(_) => "all_reduce",
        }
    }

    /// The op's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Leaf => OpKind::Leaf,
            Op::View(_) => OpKind::View,
            Op::GetRows | Op::Copy(_) => OpKind::Data,
            Op::Unary(_) | Op::Scale { .. } | Op::Binary(_) => OpKind::Elementwise,
            Op::Norm(_) | Op::Rope(_) | Op::Mask(_) | Op::Argmax | Op::TopK { .. } => OpKind::Row,
            Op::MulMat | Op::MulMatId | Op::FlashAttnExt(_) | Op::PagedAttn(_) => OpKind::MatMul,
            Op::AllReduce(_) => OpKind::Collective,
        }
    }

    /// Whether this is a leaf.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Leaf)
    }

    /// Whether the op only reinterprets memory (no kernel runs for it).
    pub fn is_view(&self) -> bool {
        self.kind() == OpKind::View
    }

    /// Whether a backend must run a kernel for this node.
    pub fn computes(&self) -> bool {
        !self.is_leaf() && !self.is_view()
    }

    /// Whether the result may be written over `src[0]`'s memory when the layouts match:
    /// every output element depends only on the input elements of the same row that
    /// the kernel has read before writing it. True for whole families: elementwise ops,
    /// row normalizations, rope, masks and softmax.
    pub fn can_inplace(&self) -> bool {
        match self {
            Op::Unary(_)
            | Op::Scale { .. }
            | Op::Binary(_)
            | Op::Norm(_)
            | Op::Rope(_)
            | Op::Mask(_)
            | Op::AllReduce(_) => true,
            Op::Leaf
            | Op::View(_)
            | Op::GetRows
            | Op::MulMat
            | Op::MulMatId
            | Op::Copy(_)
            | Op::Argmax
            | Op::TopK { .. }
            | Op::FlashAttnExt(_)
            | Op::PagedAttn(_) => false,
        }
    }

    /// Whether the op reads indices from a tensor (rows, cache slots, experts), so that a
    /// backend must check them against their limit and report one outside it.
    pub fn reads_indices(&self) -> bool {
        match self {
            Op::GetRows | Op::Copy(CopyOp::SetRows) | Op::MulMatId | Op::PagedAttn(_) => true,
            Op::Leaf
            | Op::View(_)
            | Op::Unary(_)
            | Op::Scale { .. }
            | Op::Binary(_)
            | Op::Norm(_)
            | Op::MulMat
            | Op::Rope(_)
            | Op::Copy(CopyOp::Cpy | CopyOp::Cont)
            | Op::Mask(_)
            | Op::Argmax
            | Op::TopK { .. }
            | Op::FlashAttnExt(_)
            | Op::AllReduce(_) => false,
        }
    }

    /// The op's parameters, formatted for dumps (empty when it has none).
    pub fn params(&self) -> String {
        match self {
            Op::View(ViewOp::Permute { axes }) => format!("axes={axes:?}"),
            Op::Scale { s } => format!("s={s}"),
            Op::Norm(n) => format!("eps={:e}", n.eps()),
            Op::Rope(p) => p.to_string(),
            Op::Mask(MaskOp::DiagMaskInf { n_past }) => format!("n_past={n_past}"),
            Op::Mask(MaskOp::SoftMax { scale }) => format!("scale={scale}"),
            Op::FlashAttnExt(p) => p.to_string(),
            Op::PagedAttn(p) => p.to_string(),
            Op::AllReduce(p) => format!("devices={}", p.devices),
            Op::TopK { k } => format!("k={k}"),
            Op::View(ViewOp::View | ViewOp::Reshape | ViewOp::Transpose | ViewOp::After)
            | Op::Leaf
            | Op::GetRows
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::MulMat
            | Op::MulMatId
            | Op::Copy(_)
            | Op::Argmax => String::new(),
        }
    }
}

/// Which dimensions rope rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Pairs `(2i, 2i + 1)` (GPT-J, ggml's default).
    Normal,
    /// Pairs `(i, i + n_dims / 2)` (GPT-NeoX, HF "rotate_half").
    Neox,
}

/// Llama 3 frequency scaling (HF `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// Overall scaling of low frequencies.
    pub factor: f32,
    /// Wavelength threshold (as a fraction of the original context) for low frequencies.
    pub low_freq_factor: f32,
    /// Wavelength threshold for high frequencies.
    pub high_freq_factor: f32,
    /// The context length the model was trained with.
    pub original_max_position: usize,
}

/// Parameters of a rope op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Pairing of dimensions.
    pub mode: RopeMode,
    /// Rotated dimensions (the first `n_dims` of each row; the rest pass through).
    pub n_dims: usize,
    /// Frequency base (`rope_theta`).
    pub freq_base: f32,
    /// Linear scaling of positions (1.0 for none).
    pub freq_scale: f32,
    /// Llama 3 frequency scaling, if any.
    pub llama3: Option<Llama3Scaling>,
}

impl RopeParams {
    /// Plain rope in `mode` over `n_dims` dims with base `freq_base`.
    pub fn new(mode: RopeMode, n_dims: usize, freq_base: f32) -> Self {
        RopeParams {
            mode,
            n_dims,
            freq_base,
            freq_scale: 1.0,
            llama3: None,
        }
    }

    /// The inverse frequency of pair `i` (0 <= i < n_dims / 2), including linear and
    /// Llama 3 scaling. Computed in f32 like the HF reference.
    pub fn inv_freq(&self, i: usize) -> f32 {
        let base = self.freq_base.powf(-((2 * i) as f32) / self.n_dims as f32);
        let f = match self.llama3 {
            None => base,
            Some(s) => {
                let old = s.original_max_position as f32;
                let low_wavelen = old / s.low_freq_factor;
                let high_wavelen = old / s.high_freq_factor;
                let wavelen = 2.0 * std::f32::consts::PI / base;
                if wavelen < high_wavelen {
                    base
                } else if wavelen > low_wavelen {
                    base / s.factor
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * base / s.factor + smooth * base
                }
            }
        };
        f * self.freq_scale
    }

    /// The table of inverse frequencies, one per rotated pair.
    pub fn inv_freqs(&self) -> Vec<f32> {
        (0..self.n_dims / 2).map(|i| self.inv_freq(i)).collect()
    }
}

impl fmt::Display for RopeParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            RopeMode::Normal => "normal",
            RopeMode::Neox => "neox",
        };
        write!(
            f,
            "mode={mode} n_dims={} base={}",
            self.n_dims, self.freq_base
        )?;
        if self.freq_scale != 1.0 {
            write!(f, " scale={}", self.freq_scale)?;
        }
        if let Some(s) = self.llama3 {
            write!(
                f,
                " llama3(factor={} low={} high={} orig={})",
                s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
            )?;
        }
        Ok(())
    }
}
