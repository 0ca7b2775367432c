//! Fusion, a pass over a plan's steps: [`fuse`] turns the step list into [`Group`]s of
//! consecutive steps, each one step as it is ([`Fused::Step`]) or a matched sequence as
//! one explicit fused step that a backend lowers to one launch (or a few). The CUDA
//! backend lowers the groups (`backend::cuda::lower::fused`, matching [`Fused`] with no
//! catch-all arm); the pass itself knows no kernel, so it runs, and is tested, without
//! the `cuda` feature. Steps fuse only when each middle result is read by the next step
//! alone (no other step, no view, not an output), so that skipping its write changes
//! nothing a caller or a later step can see:
//!
//! | steps | fused step |
//! | --- | --- |
//! | `rms_norm(x)`, `mul(that, w)`, `w` one row broadcast | [`Fused::RmsNormMul`] |
//! | `silu(gate)`, `mul(that, up)` or `mul(up, that)`, same shape | [`Fused::SwiGlu`] |
//! | decode product `mul_mat(w, v)` ([`decode_product`]), `add(r, that)` or `add(that, r)`, same shape | [`Fused::GemvAdd`] |
//! | any other product of one weight matrix by columns, `add(r, that)` or `add(that, r)`, same shape, the result in `r`'s memory (the add in place) | [`Fused::ProductAdd`] |
//! | [`rope(q)`], `rope(k)`, `set_rows(k_cache, k, ids)`, [`set_rows(v_cache, v, ids)`] (a decode or ring step's attention inputs; q and v when they fit) | [`Fused::RopeStore`] |
//! | `rms_norm(q)`, `mul(that, wq)`, `rope(that)`, `rms_norm(k)`, `mul(that, wk)`, then the steps of a [`Fused::RopeStore`] of k with no q (Qwen3's q and k norms) | [`Fused::RopeStore`] with [`RowNorm`]s |
//! | `flash_attn_ext` or `paged_attn`, then a product of its result that reads Q8_1 activations ([`q8_1_input`]) | [`Fused::Attention`]: the attention alone, asked to write the product's Q8_1 activations too |
//! | float decode product `mul_mat(a, v)`, `add(r, that)`, `rms_norm(y)`, `mul(that, w)`, then a float decode product of the norm's result whose every use the next fused step reads | [`Fused::NormFold`]; the next [`Fused::RopeStore`] or [`Fused::SwiGlu`] is `folded` |
//! | `mul_mat_id(w1, x, ids)`, `mul_mat_id(w2, x, ids)`, both on the decode kernels ([`Target::expert_decode_tokens`]), experts of one type and shape (a mixture of experts' up and gate) | [`Fused::ExpertPair`] |
//! | [`get_rows(logits, ids)`, `soft_max` of it], `mul(ys, w)`, `w` [1, n_used, n] broadcast, then the `n_used - 1` adds of its expert slots in slot order (a mixture of experts' weighted sum), [`add(r, that)`] | [`Fused::MoeSum`] (with its routing weights when `ids` are a `top_k` of the logits, and its residual add) |
//!
//! When the step after a fused norm or SwiGLU is a product with block-quantized weights
//! that reads Q8_1 activations ([`q8_1_input`]: a decode product, [`Target::q8_1`], or a
//! batched one, [`Target::batched_cols`]), the fused step also writes its result as those
//! activations ([`Q8For`]), and the product has no quantizing launch. Where the product
//! reads an F16 copy of them instead ([`Target::f16_copies`]), the fused step writes that.
//! (Folding the norm into the GEMV that reads it, each warp summing x^2 itself, measured
//! no faster on an H100 and was dropped; so was a fold whose second product read the
//! block sums itself, slower than the norm's launch on an H200: docs/benchmarks.md,
//! "Tried and measured". In the kept fold one block of the second product adds the sums.)
//!
//! A fused kernel still reads the first step's sources while it writes the later steps'
//! results, which the allocator may have placed in memory one of those sources had (free
//! once the first step was done): so steps fuse only when a result overlaps no source it
//! is read alongside, except the exact same layout for sources read element by element at
//! the index being written (`x`, `gate`, `up`, `r`, q's rope), which is the in-place case.

use std::collections::HashMap;

use crate::graph::{
    AllocKind, BinaryOp, BufferId, CopyOp, DType, Loc, MaskOp, NormOp, Op, Operand, Plan,
    RopeParams, Step, TensorId, UnaryOp,
};
use crate::quant::QType;

#[cfg(test)]
mod tests;

/// Consecutive steps of a plan lowered together: `plan.steps[first..first + len]`.
#[derive(Debug)]
pub struct Group<'p> {
    /// Index of the group's first step in the plan.
    pub first: usize,
    /// Steps the group covers (1 for [`Fused::Step`] and [`Fused::Attention`]).
    pub len: usize,
    /// What the steps become.
    pub fused: Fused<'p>,
}

/// What a [`Group`]'s steps become.
#[derive(Debug)]
pub enum Fused<'p> {
    /// The step as it is.
    Step,
    /// `y = rms_norm(x) * w`, one launch.
    RmsNormMul(RmsNormMul<'p>),
    /// `y = silu(gate) * up`, one launch.
    SwiGlu(SwiGlu<'p>),
    /// A decode product with its residual add: `y = a v + r`, one launch.
    GemvAdd(ProductAdd<'p>),
    /// Another product with its residual add, written over the residual: `y = a b + r`,
    /// `r` added where the product writes its result.
    ProductAdd(ProductAdd<'p>),
    /// A decode step's attention inputs: q and k roped, k and v written into the caches,
    /// one launch.
    RopeStore(RopeStore<'p>),
    /// An attention step (`flash_attn_ext`, `paged_attn`) as it is, which also writes the
    /// Q8_1 activations of the decode product after it where its decode ends in a combine
    /// (the backend decides).
    Attention(Q8For<'p>),
    /// A decode RMS norm between two float decode products folded into the launches
    /// around the second one (see [`NormFold`]).
    NormFold(NormFold<'p>),
    /// A mixture of experts' outputs weighted and summed over its expert slots, one
    /// launch (see [`MoeSum`]).
    MoeSum(MoeSum<'p>),
    /// Two decode products of experts with the same inputs and ids, one launch (see
    /// [`ExpertPair`]).
    ExpertPair(ExpertPair<'p>),
}

impl<'p> Fused<'p> {
    /// Whether this fused step applies the factor of the [`Fused::NormFold`] before it.
    pub fn folded(&self) -> bool {
        match self {
            Fused::SwiGlu(s) => s.folded,
            Fused::RopeStore(s) => s.folded,
            Fused::Step
            | Fused::RmsNormMul(_)
            | Fused::GemvAdd(_)
            | Fused::ProductAdd(_)
            | Fused::Attention(_)
            | Fused::NormFold(_)
            | Fused::MoeSum(_)
            | Fused::ExpertPair(_) => false,
        }
    }

    /// The Q8_1 activations of the next product this fused step writes (for
    /// [`Fused::Attention`], where its decode ends in a combine).
    pub fn q8(&self) -> Option<&Q8For<'p>> {
        match self {
            Fused::RmsNormMul(n) => n.q8.as_ref(),
            Fused::SwiGlu(s) => s.q8.as_ref(),
            Fused::Attention(q8) => Some(q8),
            Fused::Step
            | Fused::GemvAdd(_)
            | Fused::ProductAdd(_)
            | Fused::RopeStore(_)
            | Fused::NormFold(_)
            | Fused::MoeSum(_)
            | Fused::ExpertPair(_) => None,
        }
    }
}

/// The Q8_1 (or F16) activations of the product after a fused step ([`q8_1_input`]),
/// which the fused step writes too (so the product needs no quantizing or copying launch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Q8For<'p> {
    /// The product's F32 activations (the fused step's result, or for attention the
    /// product's operand, which may be the result seen as columns).
    pub of: &'p Operand,
    /// The layout the product reads them in.
    pub layout: Q8Layout,
}

/// The order of a Q8_1 activation copy's blocks, by the weight type of the product that
/// reads it: `cuda/quant.cuh`'s `ACT_BLOCKS` and `ACT_PAIRS`; or an F16 copy (`ACT_F16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q8Layout {
    /// One 32-element block a lane (the 32-element types).
    Blocks,
    /// Two neighbouring blocks a lane (the 256-element types, whose lanes take sub-blocks
    /// in pairs).
    Pairs,
    /// Not Q8_1: the F16 activations, dense columns padded to 16 bytes, of a product on
    /// F16 tensor cores or cuBLAS ([`Target::f16_copies`]).
    F16,
}

impl Q8Layout {
    /// The layout a product with weights of `dt` reads (decode and batched alike): pairs
    /// for the 256-element block types, blocks for the 32-element ones and floats.
    pub fn of(dt: DType) -> Q8Layout {
        match dt.quant() {
            Some(q) if q.block_size() == 256 => Q8Layout::Pairs,
            _ => Q8Layout::Blocks,
        }
    }
}

/// `y = rms_norm(x) * w` (F32 rows, `w` one row).
#[derive(Debug)]
pub struct RmsNormMul<'p> {
    pub x: &'p Operand,
    pub w: &'p Operand,
    pub y: &'p Operand,
    pub eps: f32,
    /// `y` as the Q8_1 activations of the product after it.
    pub q8: Option<Q8For<'p>>,
}

/// `y = silu(gate) * up` (F32, one shape).
#[derive(Debug)]
pub struct SwiGlu<'p> {
    pub gate: &'p Operand,
    pub up: &'p Operand,
    pub y: &'p Operand,
    /// `y` as the Q8_1 activations of the product after it.
    pub q8: Option<Q8For<'p>>,
    /// Whether `gate` and `up` are the result of a [`Fused::NormFold`] just before, whose
    /// norm's factor this launch multiplies them by.
    pub folded: bool,
}

/// `y = a b + r`: a product and its residual add, the launches adding `r` where they write
/// the result. As a [`Fused::GemvAdd`], a decode product ([`decode_product`]) whose kernel
/// adds it; as a [`Fused::ProductAdd`], with `y` in `r`'s memory, a product that is not a
/// decode product (or one the backend runs as a batched product,
/// [`Target::batched_from`]) of one weight matrix by columns (a kernel's epilogue, a
/// reduction of parts of K, cuBLAS's beta).
#[derive(Debug)]
pub struct ProductAdd<'p> {
    pub a: &'p Operand,
    pub b: &'p Operand,
    /// The product's own result (never written: the launches write `y`).
    pub product: &'p Operand,
    pub r: &'p Operand,
    pub y: &'p Operand,
}

/// The steps of one `rope_store` launch: rope `p` at positions `pos` of q (source,
/// result) and of k (`[hd, heads, n]` F32) into the rows `ids` of the K cache
/// (`[hd * heads, slots]`), and v (source, `set_rows` result) into the V cache at `ids`.
#[derive(Clone, Debug)]
pub struct RopeStore<'p> {
    pub p: &'p RopeParams,
    pub pos: &'p Operand,
    pub ids: &'p Operand,
    pub q: Option<(&'p Operand, &'p Operand)>,
    pub k: (&'p Operand, &'p Operand),
    pub v: Option<(&'p Operand, &'p Operand)>,
    /// Index in the plan of the step writing k's rows (an id outside the cache is
    /// reported as its; the V write has the same ids).
    pub k_write: usize,
    /// Whether its sources include the result of a [`Fused::NormFold`] just before, whose
    /// norm's factor this launch multiplies q, k and v by.
    pub folded: bool,
    /// q's per-row RMS norm and weight, which the launch applies before the rope (q's
    /// source is then the norm's input).
    pub q_norm: Option<RowNorm<'p>>,
    /// Likewise for k.
    pub k_norm: Option<RowNorm<'p>>,
}

/// The RMS norm of each row and its weight, `mul(rms_norm(x), w)` with `w` one dense F32
/// row (the q and k norms of Qwen3), applied by a [`RopeStore`] launch before the rope.
#[derive(Clone, Copy, Debug)]
pub struct RowNorm<'p> {
    pub w: &'p Operand,
    pub eps: f32,
}

impl<'p> RopeStore<'p> {
    /// The tensors the launch reads element by element: k, and q and v when it has them.
    pub fn sources(&self) -> Vec<&'p Operand> {
        let q = self.q.map(|(src, _)| src);
        let v = self.v.map(|(src, _)| src);
        [Some(self.k.0), q, v].into_iter().flatten().collect()
    }

    /// What the launch reads and writes.
    fn memory(&self) -> (Vec<&'p Operand>, Vec<&'p Operand>) {
        let mut reads = vec![self.k.0, self.pos, self.ids];
        reads.extend([self.q_norm, self.k_norm].iter().flatten().map(|n| n.w));
        let mut writes = vec![self.k.1];
        for (src, dst) in self.q.iter().chain(&self.v) {
            reads.push(src);
            writes.push(dst);
        }
        (reads, writes)
    }
}

/// A decode RMS norm folded into the launches around the product after it: the steps
/// are a float decode product `mul_mat(a, v)`, `y = add(r, that)`, `rms_norm(y)` and
/// `xn = mul(that, w)` (`w` one dense F32 row), and the next step the float decode
/// product `out = next_a xn`, whose every use the next fused step
/// ([`Fused::RopeStore`] or [`Fused::SwiGlu`], `folded`) reads. The first four steps
/// become one launch that writes `y`, `rw = y * w` and the sum of `y^2` over each of its
/// blocks; the next product reads `rw` in place of `xn`, and one of its blocks adds the
/// sums into the norm's factor `1 / sqrt(sum / n + eps)`; the fused step after it
/// multiplies its inputs by that factor first: the products are linear, so this is the
/// product of the normalized vector, and the norm's own launch is saved.
#[derive(Debug)]
pub struct NormFold<'p> {
    pub a: &'p Operand,
    pub v: &'p Operand,
    /// The first product's own result (never written: the launch writes `y`).
    pub product: &'p Operand,
    pub r: &'p Operand,
    pub y: &'p Operand,
    pub w: &'p Operand,
    pub eps: f32,
    pub xn: &'p Operand,
    /// The second product's step (`mul_mat(next_a, xn)`).
    pub next: &'p Step,
}

/// A mixture of experts' weighted sum: the steps are `y = mul(ys, w)` (F32 `ys`
/// [n_embd, n_used, n], F32 routing weights `w` [1, n_used, n] broadcast along dim 0)
/// and the `n_used - 1` adds of its expert slots (the 2-d views `y[:, i, :]`) in slot
/// order, `sum = ((y0 + y1) + y2) + ...` [n_embd, n]; then, when it fits, the residual
/// add `out = r + sum` (either order). Before them may come the steps that make `w`
/// ([`MoeRoute`]). The launch computes each product and each sum in that order, so its
/// result is the steps' bit for bit; it never writes `y`, the partial sums, nor a fused
/// `sum` or `w`, which nothing else reads.
#[derive(Clone, Copy, Debug)]
pub struct MoeSum<'p> {
    pub ys: &'p Operand,
    pub w: &'p Operand,
    /// The launch's result: the sum, or with a residual the add's result.
    pub out: &'p Operand,
    /// The residual added to the sum, when its add is fused.
    pub residual: Option<&'p Operand>,
    /// The steps that make `w`, when they are fused.
    pub route: Option<MoeRoute<'p>>,
    /// Whether the launch finds every weight before it writes: one block stages them
    /// ([`Target::moe_sum_stage`]), as it must when `out` overlaps `w` (the allocator may
    /// give the first add the memory the weights had, free once the mul was done) and
    /// when it makes them ([`MoeSum::route`]).
    pub staged: bool,
}

impl MoeSum<'_> {
    /// The steps the launch covers.
    pub fn steps(&self) -> usize {
        let route = if self.route.is_some() { 2 } else { 0 };
        route + self.ys.ne[1] + usize::from(self.residual.is_some())
    }
}

/// The routing weights of a [`MoeSum`] as two steps make them: `sel = get_rows(logits,
/// ids)` (the F32 router logits seen as rows of one value, [1, n_expert, n], at the I32
/// `ids` [n_used, n] a `top_k` of the same logits made, so every id is in range), then
/// `w = soft_max(sel)` over each token's `n_used <= 32` values (no scale, no mask).
#[derive(Clone, Copy, Debug)]
pub struct MoeRoute<'p> {
    pub logits: &'p Operand,
    pub ids: &'p Operand,
}

/// Two `mul_mat_id` steps of a decode step on the decode kernels ([`expert_decode`]) with
/// the same inputs and ids and experts of one type and shape (a mixture of experts' up
/// and gate products), whose results are clear of each other and of everything the other
/// reads: one launch computes both.
#[derive(Clone, Copy, Debug)]
pub struct ExpertPair<'p> {
    pub first: &'p Step,
    pub second: &'p Step,
}

/// What the backend's kernels take, which decides some patterns.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// Whether decode products with block-quantized weights read their activations as
    /// Q8_1 (the CUDA backend's `__dp4a` kernels): then a fused step before one writes
    /// them ([`Q8For`]).
    pub q8_1: bool,
    /// Most activation columns, batches included, of the other products with
    /// block-quantized weights of a 256-element [`batched_type`] in the batched layout
    /// ([`quant_batched_layout`]) that read their activations as Q8_1 (the CUDA backend's
    /// int8 tensor-core product); 0: none does. A fused step before such a product writes
    /// them too.
    pub batched_cols: usize,
    /// The same for the 32-element batched types.
    pub batched_cols_32: usize,
    /// Whether the other products of F32 activations with F16 weights (but the float
    /// decode products) or block-quantized ones read an F16 copy of the activations (the
    /// CUDA backend's F16 tensor-core products and cuBLAS; with block-quantized weights,
    /// up to [`Target::tensor_cols`] columns). A fused step before such a product writes
    /// it.
    pub f16_copies: bool,
    /// Most activation columns of the batched products of a [`batched_type`] on tensor
    /// cores (int8 or F16); wider ones read the activations as their dequantized weights'
    /// cuBLAS product does.
    pub tensor_cols: usize,
    /// Fewest activation columns from which a decode product with weights of a
    /// [`batched_type`] takes the batched product rather than the decode kernels
    /// (`usize::MAX`: never). Such a product's residual add fuses as a
    /// [`Fused::ProductAdd`] (where it runs in place), not a [`Fused::GemvAdd`] (the
    /// decode kernels' epilogue).
    pub batched_from: usize,
    /// Most tokens of a `mul_mat_id` with block-quantized experts that runs on the decode
    /// kernels, which read the inputs as Q8_1 (0: none does); a fused step before one
    /// writes them ([`q8_1_input`]).
    pub expert_decode_tokens: usize,
    /// Most routing weights (`n_used * n`) a [`Fused::MoeSum`] launch reads before it
    /// writes anything (the CUDA backend's one block, which stages them in shared
    /// memory), for a sum that overlaps them; a larger one is not fused (0: none is).
    pub moe_sum_stage: usize,
}

impl Target {
    /// Whether `a b` can run on the tensor cores: weights of a [`batched_type`] in the
    /// batched layout up to [`Target::tensor_cols`] columns.
    fn tensor(&self, a: &Operand, b: &Operand) -> bool {
        a.dtype.quant().is_some_and(batched_type) && quant_batched_layout(a, b, self.tensor_cols)
    }

    /// Whether `a b` runs on the tensor cores although its layout is a decode product's
    /// ([`Target::batched_from`]).
    fn batched_decode(&self, a: &Operand, b: &Operand) -> bool {
        b.nrows() >= self.batched_from && self.tensor(a, b)
    }

    /// The activations a product `a b` reads as a copy (Q8_1 in a layout, or F16), if
    /// any: see [`q8_1_input`].
    fn copy_read(&self, a: &Operand, b: &Operand) -> Option<Q8Layout> {
        let f16 = || (self.f16_copies && f16_copy_layout(a, b)).then_some(Q8Layout::F16);
        let Some(q) = a.dtype.quant() else {
            return if a.dtype == DType::F16 && !float_gemv(a, b) {
                f16()
            } else {
                None
            };
        };
        let (n, decode) = (b.nrows(), quant_decode_layout(a, b));
        let tensor = match decode {
            true => self.batched_decode(a, b),
            false => self.tensor(a, b),
        };
        let q8 = match q.block_size() {
            32 => self.batched_cols_32,
            _ => self.batched_cols,
        };
        match (tensor, decode) {
            (true, _) if n <= q8 => Some(Q8Layout::of(a.dtype)),
            (true, _) => f16(),
            (false, true) => (self.q8_1 && decode_type(q)).then_some(Q8Layout::of(a.dtype)),
            (false, false) => None,
        }
    }
}

/// Whether a product of one weight matrix `a` reads its F32 activations `b` (dense rows of
/// `a`'s length) as columns one after the other, which an F16 copy of padded columns
/// stands for.
fn f16_copy_layout(a: &Operand, b: &Operand) -> bool {
    b.dtype == DType::F32 && b.rows_contiguous() && b.ne[0] == a.ne[0] && single(a)
}

/// Most activation columns of a decode product (the backend's decode kernels take 1 to 8).
pub const MAX_DECODE_COLS: usize = 8;

/// Cache types a `rope_store` launch writes (the CUDA backend's `rope_store_<dtype>`
/// kernels; a test there checks the two agree).
pub const ROPE_STORE_CACHES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Whether block type `q` has decode-product kernels (every type but Q8_1, the
/// activations' own format; a test of the CUDA backend checks its kernel sets agree).
pub fn decode_type(q: QType) -> bool {
    match q {
        QType::Q4_0
        | QType::Q4_1
        | QType::Q5_0
        | QType::Q5_1
        | QType::Q8_0
        | QType::Q2_K
        | QType::Q3_K
        | QType::Q4_K
        | QType::Q5_K
        | QType::Q6_K
        | QType::IQ4_NL
        | QType::IQ4_XS
        | QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M
        | QType::TQ1_0
        | QType::TQ2_0 => true,
        QType::Q8_1 => false,
    }
}

/// Whether block type `q` has batched products that read Q8_1 activations (the CUDA
/// backend's int8 tensor-core products: the legacy types and Q4_K, Q5_K, Q6_K; the other
/// types' batched products read F32 activations, with an F16 copy of the weights for
/// cuBLAS; a test of the CUDA backend checks its kernel sets agree).
pub fn batched_type(q: QType) -> bool {
    match q {
        QType::Q4_0
        | QType::Q4_1
        | QType::Q5_0
        | QType::Q5_1
        | QType::Q8_0
        | QType::Q4_K
        | QType::Q5_K
        | QType::Q6_K => true,
        QType::Q8_1
        | QType::Q2_K
        | QType::Q3_K
        | QType::IQ4_NL
        | QType::IQ4_XS
        | QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M
        | QType::TQ1_0
        | QType::TQ2_0 => false,
    }
}

/// Whether `x` is one matrix (no batch dims).
fn single(x: &Operand) -> bool {
    x.ne[2] == 1 && x.ne[3] == 1
}

/// Whether `a b` with float weights `a` is a float decode product (a GEMV): one column,
/// every other dim 1, rows of `a` dense (any row stride), `b` an F32 vector with dense
/// elements.
pub fn float_gemv(a: &Operand, b: &Operand) -> bool {
    a.dtype.quant().is_none()
        && a.ne[0] < i32::MAX as usize
        && b.dtype == DType::F32
        && b.rows_contiguous()
        && b.ne[1] == 1
        && b.ne[0] == a.ne[0]
        && single(a)
        && single(b)
        && a.rows_contiguous()
}

/// Whether `a b` with block-quantized `a` has the layout of a batched product: one weight
/// matrix with whole blocks a row, F32 activations with dense rows whose columns, batches
/// included, are 1 to `max_cols` (one after the other: column `i1 + n (i2 + b2 i3)`).
pub fn quant_batched_layout(a: &Operand, b: &Operand, max_cols: usize) -> bool {
    let kk = a.ne[0];
    a.dtype.quant().is_some()
        && (1..=max_cols).contains(&b.nrows())
        && kk < i32::MAX as usize
        && kk.is_multiple_of(a.dtype.block_size())
        && b.dtype == DType::F32
        && b.ne[0] == kk
        && b.rows_contiguous()
        && a.rows_contiguous()
        && single(a)
}

/// Whether `a b` with block-quantized `a` has a decode layout: the batched layout
/// ([`quant_batched_layout`]) with 1 to [`MAX_DECODE_COLS`] columns and no batches.
pub fn quant_decode_layout(a: &Operand, b: &Operand) -> bool {
    single(b) && quant_batched_layout(a, b, MAX_DECODE_COLS)
}

/// Whether `a b` is a decode product: a float GEMV ([`float_gemv`]) or a product with
/// block-quantized weights of a [`decode_type`] in a decode layout
/// ([`quant_decode_layout`]).
pub fn decode_product(a: &Operand, b: &Operand) -> bool {
    match a.dtype.quant() {
        Some(q) => decode_type(q) && quant_decode_layout(a, b),
        None => float_gemv(a, b),
    }
}

/// The activations `step` reads as Q8_1 when it is lowered, and their layout: its `b`
/// when it is a product of block-quantized weights that the target runs on Q8_1
/// activations: a decode product ([`Target::q8_1`], weights of a [`decode_type`]; from
/// [`Target::batched_from`] columns the batched product's) or another one in the batched
/// layout ([`Target::batched_cols`], [`Target::batched_cols_32`], of a [`batched_type`]).
/// Or its `b` as an F16 copy ([`Q8Layout::F16`]) when the target reads one
/// ([`Target::f16_copies`]): the batched products of more columns on tensor cores, and
/// every product of F16 weights but the decode GEMV.
/// Also a decode step's `mul_mat_id` that the target runs on its decode kernels
/// ([`expert_decode`]).
/// A step before it that computes `b` anyway can write that copy itself.
pub fn q8_1_input<'p>(step: &'p Step, target: &Target) -> Option<Q8For<'p>> {
    let (a, b) = (step.src.first()?, step.src.get(1)?);
    if step.op == Op::MulMatId {
        return expert_decode(step, target).then_some(Q8For {
            of: b,
            layout: Q8Layout::of(a.dtype),
        });
    }
    if step.op != Op::MulMat {
        return None;
    }
    Some(Q8For {
        of: b,
        layout: target.copy_read(a, b)?,
    })
}

/// Whether `step` is a `mul_mat_id` that the target runs on its decode kernels, which
/// read the inputs as Q8_1: experts of a [`decode_type`] in whole blocks a row, F32
/// inputs and results dense along dim 0, and 1 to [`Target::expert_decode_tokens`] tokens.
fn expert_decode(step: &Step, target: &Target) -> bool {
    let [w, b, ids] = &step.src[..] else {
        return false;
    };
    let kk = w.ne[0];
    step.op == Op::MulMatId
        && w.dtype.quant().is_some_and(decode_type)
        && kk % w.dtype.block_size() == 0
        && kk < i32::MAX as usize
        && w.rows_contiguous()
        && b.dtype == DType::F32
        && b.nb[0] == 4
        && step.dst.dtype == DType::F32
        && step.dst.nb[0] == 4
        && (1..=target.expert_decode_tokens).contains(&ids.ne[1])
}

/// The memory `x` spans: (arena or buffer, first byte, one past the last).
fn span(x: &Operand) -> (Option<BufferId>, usize, usize) {
    match x.loc {
        Loc::Arena(off) => (None, off, off + x.nbytes()),
        Loc::Buffer(b, off) => (Some(b), off, off + x.nbytes()),
    }
}

/// Whether `x` and `y` share no byte.
pub fn disjoint(x: &Operand, y: &Operand) -> bool {
    let ((mx, x0, x1), (my, y0, y1)) = (span(x), span(y));
    mx != my || x1 <= y0 || y1 <= x0
}

/// Whether `x` and `y` share no byte or are the very same elements.
fn disjoint_or_same(x: &Operand, y: &Operand) -> bool {
    disjoint(x, y) || same(x, y)
}

/// Whether `x` and `y` are the very same elements (one place, one layout).
fn same(x: &Operand, y: &Operand) -> bool {
    x.loc == y.loc && x.ne == y.ne && x.nb == y.nb
}

/// `loc` moved `by` bytes on.
fn shifted(loc: Loc, by: usize) -> Loc {
    match loc {
        Loc::Arena(off) => Loc::Arena(off + by),
        Loc::Buffer(b, off) => Loc::Buffer(b, off + by),
    }
}

fn dense_f32(x: &Operand) -> bool {
    x.dtype == DType::F32 && x.is_contiguous()
}

/// Each step as it is: the groups of a plan lowered without fusion.
pub fn unfused(plan: &Plan) -> Vec<Group<'_>> {
    (0..plan.steps.len())
        .map(|first| Group {
            first,
            len: 1,
            fused: Fused::Step,
        })
        .collect()
}

/// The plan's steps in groups, every sequence that starts a pattern (see the module docs)
/// fused, in order and covering every step once.
pub fn fuse<'p>(plan: &'p Plan, target: &Target) -> Vec<Group<'p>> {
    let cx = Context {
        plan,
        readers: readers(plan),
        target: *target,
    };
    let mut groups: Vec<Group<'p>> = Vec::with_capacity(plan.steps.len());
    let mut first = 0;
    while first < plan.steps.len() {
        let folded = matches!(
            groups.last(),
            Some(Group {
                fused: Fused::NormFold(_),
                ..
            })
        );
        let (fused, len) = cx.at(first, folded).unwrap_or((Fused::Step, 1));
        groups.push(Group { first, len, fused });
        first += len;
    }
    groups
}

/// What the patterns look at: the plan, how often each tensor's memory is read, the target.
struct Context<'p> {
    plan: &'p Plan,
    readers: HashMap<TensorId, usize>,
    target: Target,
}

/// The tensor whose memory `id` is (itself, or the base of a view).
fn base(plan: &Plan, id: TensorId) -> TensorId {
    match plan.alloc.info.get(id).map(|i| i.kind) {
        Some(AllocKind::View(b)) => b,
        _ => id,
    }
}

/// How many times each tensor's memory is read: by step sources (through views too) and
/// as a plan output.
fn readers(plan: &Plan) -> HashMap<TensorId, usize> {
    let mut n = HashMap::new();
    let srcs = plan.steps.iter().flat_map(|s| s.src.iter());
    for op in srcs.chain(plan.outputs.iter().map(|io| &io.operand)) {
        *n.entry(base(plan, op.id)).or_insert(0) += 1;
    }
    n
}

impl<'p> Context<'p> {
    /// Whether the memory of `t` is read once.
    fn read_once(&self, t: &Operand) -> bool {
        self.readers.get(&t.id) == Some(&1)
    }

    /// The fused step that starts at step `first` and how many steps it covers, or None.
    /// `folded`: the group before is a [`Fused::NormFold`], whose factor this one applies.
    fn at(&self, first: usize, folded: bool) -> Option<(Fused<'p>, usize)> {
        let window = &self.plan.steps[first..];
        if let Some((store, used)) = self.normed_rope_store(window, first).filter(|_| !folded) {
            return Some((Fused::RopeStore(store), used));
        }
        if let Some((mut store, used)) = self.rope_store(window, first) {
            store.folded = folded;
            return Some((Fused::RopeStore(store), used));
        }
        if let Some(fold) = self.norm_fold(window) {
            return Some((Fused::NormFold(fold), 5));
        }
        if let Some(sum) = self.moe_sum(window) {
            let used = sum.steps();
            return Some((Fused::MoeSum(sum), used));
        }
        if let Some(pair) = self.expert_pair(window) {
            return Some((Fused::ExpertPair(pair), 2));
        }
        let (one, two) = (window.first()?, window.get(1)?);
        if let Op::FlashAttnExt(_) | Op::PagedAttn(_) = one.op {
            return Some((Fused::Attention(q8_1_input(two, &self.target)?), 1));
        }
        let fused = self.pair(one, two, window.get(2), folded)?;
        Some((fused, 2))
    }

    /// The other operand `r` of `add`, when `add` adds the dense F32 result of `mm` (read by
    /// it alone) and a dense F32 `r` of the same shape into a dense F32 result.
    fn residual_of(&self, mm: &Step, add: &'p Step) -> Option<&'p Operand> {
        let mid = &mm.dst;
        if add.op != Op::Binary(BinaryOp::Add) || !self.read_once(mid) {
            return None;
        }
        let residual = match (&add.src[0], &add.src[1]) {
            (r, m) | (m, r) if m.id == mid.id && r.id != mid.id => r,
            _ => return None,
        };
        (dense_f32(residual) && dense_f32(&add.dst) && dense_f32(mid) && residual.ne == mid.ne)
            .then_some(residual)
    }

    /// A [`NormFold`] of the first five steps of `window` (see there), when the steps
    /// after them start a fused step that reads every use of the second product's result.
    fn norm_fold(&self, window: &'p [Step]) -> Option<NormFold<'p>> {
        let [mm, add, norm, mul, next, rest @ ..] = window else {
            return None;
        };
        let (a, v) = (mm.src.first()?, mm.src.get(1)?);
        let next_a = next.src.first()?;
        let r = self.residual_of(mm, add)?;
        let (Op::MulMat, Op::Norm(NormOp::RmsNorm { eps }), Op::Binary(BinaryOp::Mul), Op::MulMat) =
            (&mm.op, &norm.op, &mul.op, &next.op)
        else {
            return None;
        };
        let (y, xn, w) = (&add.dst, &mul.dst, mul.src.get(1)?);
        let fits = float_gemv(a, v)
            && norm.src[0] == *y
            && self.read_once(&norm.dst)
            && mul.src[0].id == norm.dst.id
            && self.read_once(xn)
            && next.src.get(1).is_some_and(|b| b.id == xn.id)
            && float_gemv(next_a, xn)
            && dense_f32(w)
            && dense_f32(xn)
            && w.ne == y.ne
            && xn.ne == y.ne
            && y.nrows() == 1
            && disjoint_or_same(y, r)
            && disjoint(y, v)
            && disjoint(y, a)
            && disjoint(y, w)
            && self.folds_into(rest, &next.dst);
        fits.then_some(NormFold {
            a,
            v,
            product: &mm.dst,
            r,
            y,
            w,
            eps: *eps,
            xn,
            next,
        })
    }

    /// An [`ExpertPair`] of the first two steps of `window`.
    fn expert_pair(&self, window: &'p [Step]) -> Option<ExpertPair<'p>> {
        let [first, second, ..] = window else {
            return None;
        };
        if !(expert_decode(first, &self.target) && expert_decode(second, &self.target)) {
            return None;
        }
        let (w1, w2) = (&first.src[0], &second.src[0]);
        let (d1, d2) = (&first.dst, &second.dst);
        let reads = [w1, w2, &first.src[1], &first.src[2]];
        let fits = first.src[1..] == second.src[1..]
            && (w1.dtype, w1.ne, w1.nb) == (w2.dtype, w2.ne, w2.nb)
            && (d1.ne, d1.nb) == (d2.ne, d2.nb)
            && disjoint(d1, d2)
            && reads.iter().all(|r| disjoint(d1, r) && disjoint(d2, r));
        fits.then_some(ExpertPair { first, second })
    }

    /// A [`MoeSum`] of the first steps of `window`: with its routing weights' two steps
    /// ([`Context::moe_route`]) when they fit, else from the mul ([`Context::weighted_sum`]).
    fn moe_sum(&self, window: &'p [Step]) -> Option<MoeSum<'p>> {
        if let [get, soft, rest @ ..] = window {
            if let Some(sum) = self.moe_route(get, soft, rest) {
                return Some(sum);
            }
        }
        self.weighted_sum(window)
    }

    /// A [`MoeSum`] whose weights `get` (`get_rows`) and `soft` (`soft_max`) make, fused
    /// with them ([`MoeRoute`]): the two results read by the next step alone, the sum
    /// ([`Context::weighted_sum`] of `rest`) reading the softmax as its weights, at most
    /// 32 slots and [`Target::moe_sum_stage`] weights (the launch stages what it makes).
    fn moe_route(&self, get: &'p Step, soft: &'p Step, rest: &'p [Step]) -> Option<MoeSum<'p>> {
        let (logits, ids, sel, w) = (get.src.first()?, get.src.get(1)?, &get.dst, &soft.dst);
        let fits = get.op == Op::GetRows
            && soft.op == Op::Mask(MaskOp::SoftMax { scale: 1.0 })
            && soft.src.len() == 1
            && [logits, sel, w].iter().all(|t| t.dtype == DType::F32)
            && ids.dtype == DType::I32
            && logits.ne[0] == 1
            && logits.ne[3] == 1
            && ids.ne[2] == 1
            && ids.ne[3] == 1
            && self.read_once(sel)
            && self.read_once(w)
            && soft.src[0].loc == sel.loc
            && soft.src[0].ne == [ids.ne[0], ids.ne[1], 1, 1]
            && sel.is_contiguous()
            && soft.src[0].is_contiguous()
            && self.top_k_of(ids, logits);
        if !fits {
            return None;
        }
        let mut sum = self.weighted_sum(rest)?;
        let (n_used, n) = (sum.ys.ne[1], sum.ys.ne[2]);
        let fits = base(self.plan, sum.w.id) == w.id
            && sum.w.loc == w.loc
            && sum.w.is_contiguous()
            && w.is_contiguous()
            && ids.ne[..2] == [n_used, n]
            && logits.ne[2] == n
            && n_used <= 32
            && n_used * n <= self.target.moe_sum_stage;
        if !fits {
            return None;
        }
        sum.route = Some(MoeRoute { logits, ids });
        sum.staged = true;
        Some(sum)
    }

    /// Whether `ids` are the result of a `top_k` over the logits that `logits` views.
    fn top_k_of(&self, ids: &Operand, logits: &Operand) -> bool {
        let of = base(self.plan, logits.id);
        self.plan.steps.iter().any(|s| {
            matches!(s.op, Op::TopK { .. })
                && s.dst.id == ids.id
                && s.dst.loc == ids.loc
                && s.src.first().is_some_and(|x| base(self.plan, x.id) == of)
        })
    }

    /// A [`MoeSum`] of the first `n_used` steps of `window` (and the residual add after
    /// them when it fits): the mul by the weights, read through its `n_used` expert slots
    /// alone, then the adds, each of the partial sum so far (read by the next add alone)
    /// and the next slot, either operand first (an f32 add is commutative); never another
    /// order, stride or offset of the slots, another dtype or shape of the weights, or a
    /// result that overlaps the outputs or (past [`Target::moe_sum_stage`] of them) the
    /// weights.
    fn weighted_sum(&self, window: &'p [Step]) -> Option<MoeSum<'p>> {
        let (mul, rest) = window.split_first()?;
        let (ys, w, y) = (mul.src.first()?, mul.src.get(1)?, &mul.dst);
        let n_used = ys.ne[1];
        let adds = rest.get(..n_used.checked_sub(1)?)?;
        let fits = mul.op == Op::Binary(BinaryOp::Mul)
            && n_used >= 2
            && [ys, w, y].iter().all(|t| t.dtype == DType::F32)
            && ys.ne[3] == 1
            && w.ne == [1, n_used, ys.ne[2], 1]
            && self.readers.get(&y.id) == Some(&n_used);
        if !fits {
            return None;
        }
        let mut sum: Option<&'p Operand> = None;
        for (i, add) in (1..).zip(adds) {
            let (a, b) = (add.src.first()?, add.src.get(1)?);
            // the partial sum so far: slot 0 alone before the first add
            let prev = |x: &Operand| sum.map_or(self.slot_of(y, x) == Some(0), |s| x == s);
            let slot = |x: &Operand| self.slot_of(y, x) == Some(i);
            let chained = (prev(a) && slot(b)) || (slot(a) && prev(b));
            let last = i + 1 == n_used;
            if add.op != Op::Binary(BinaryOp::Add)
                || !chained
                || add.dst.dtype != DType::F32
                || !(last || self.read_once(&add.dst))
            {
                return None;
            }
            sum = Some(&add.dst);
        }
        let sum = sum?;
        if sum.ne != [ys.ne[0], ys.ne[2], 1, 1] {
            return None;
        }
        let plain = MoeSum {
            ys,
            w,
            out: sum,
            residual: None,
            route: None,
            staged: false,
        };
        let residual = rest.get(n_used - 1).and_then(|add| {
            let r = self.residual_of(&adds[n_used - 2], add)?;
            Some((r, &add.dst))
        });
        let with_residual = residual.map(|(r, out)| MoeSum {
            out,
            residual: Some(r),
            ..plain
        });
        [with_residual, Some(plain)]
            .into_iter()
            .flatten()
            .find_map(|s| self.staged_if_needed(s))
    }

    /// `s` with [`MoeSum::staged`] set when its result overlaps the weights, or None when
    /// its result overlaps the outputs, a residual other than in place, or more weights
    /// than the launch stages.
    fn staged_if_needed(&self, mut s: MoeSum<'p>) -> Option<MoeSum<'p>> {
        s.staged = !disjoint(s.out, s.w);
        let n_used = s.ys.ne[1];
        let fits = disjoint(s.out, s.ys)
            && s.residual.is_none_or(|r| disjoint_or_same(s.out, r))
            && (!s.staged || n_used * s.ys.ne[2] <= self.target.moe_sum_stage);
        fits.then_some(s)
    }

    /// Which expert slot of `y` [n_embd, n_used, n] the operand `x` is: the 2-d view
    /// `y[:, i, :]` (its rows `y.nb[2]` apart, `i * y.nb[1]` bytes in).
    fn slot_of(&self, y: &Operand, x: &Operand) -> Option<usize> {
        let fits = x.id != y.id
            && base(self.plan, x.id) == y.id
            && x.dtype == y.dtype
            && x.ne == [y.ne[0], y.ne[2], 1, 1]
            && x.nb[..2] == [y.nb[0], y.nb[2]];
        (0..y.ne[1]).find(|&i| fits && x.loc == shifted(y.loc, i * y.nb[1]))
    }

    /// Whether the fused step that `steps` start with reads every use of `out` and can
    /// scale them by a folded norm's factor: a `rope_store` launch or a SwiGLU pair.
    fn folds_into(&self, steps: &'p [Step], out: &Operand) -> bool {
        let plan = self.plan;
        let of = base(plan, out.id);
        let uses = |srcs: &[&Operand]| srcs.iter().filter(|t| base(plan, t.id) == of).count();
        let read = match (self.rope_store(steps, 0), steps) {
            (Some((store, _)), _) => uses(&store.sources()),
            (None, [silu, mul, ..]) => self
                .swiglu_of(silu, mul)
                .map_or(0, |(g, u, _)| uses(&[g, u])),
            (None, _) => 0,
        };
        read > 0 && self.readers.get(&of) == Some(&read)
    }

    /// `silu(gate)` then `mul(that, up)` (or `mul(up, that)`) as one SwiGLU launch: (gate,
    /// up, result), when the silu is read by the multiplication alone and all are F32 of one shape whose result
    /// touches no source it is read alongside (the same layout is fine).
    fn swiglu_of(
        &self,
        silu: &'p Step,
        mul: &'p Step,
    ) -> Option<(&'p Operand, &'p Operand, &'p Operand)> {
        if (&silu.op, &mul.op) != (&Op::Unary(UnaryOp::Silu), &Op::Binary(BinaryOp::Mul))
            || !self.read_once(&silu.dst)
        {
            return None;
        }
        // the product either way round: f32 multiplication commutes exactly
        let up = match (mul.src.first()?, mul.src.get(1)?) {
            (s, u) | (u, s) if s.id == silu.dst.id && u.id != silu.dst.id => u,
            _ => return None,
        };
        let (gate, y) = (silu.src.first()?, &mul.dst);
        let fits = [gate, up, y].iter().all(|t| t.dtype == DType::F32)
            && up.ne == gate.ne
            && y.ne == gate.ne
            && disjoint_or_same(y, gate)
            && disjoint_or_same(y, up);
        fits.then_some((gate, up, y))
    }

    /// Where a fused step's result `y` also goes as Q8_1 activations, when `next` is a
    /// product of `y` that reads them (whole 32-element blocks of a dense `y`).
    fn q8_for(&self, y: &'p Operand, next: Option<&'p Step>) -> Option<Q8For<'p>> {
        let q8 = q8_1_input(next?, &self.target)?;
        (q8.of == y && y.is_contiguous() && y.ne[0].is_multiple_of(32))
            .then_some(Q8For { of: y, ..q8 })
    }

    /// The fused step of `one` then `two` (`next` the step after them), or None when the
    /// pair is not a pattern. `folded`: as for [`Context::at`].
    fn pair(
        &self,
        one: &'p Step,
        two: &'p Step,
        next: Option<&'p Step>,
        folded: bool,
    ) -> Option<Fused<'p>> {
        if let Some((gate, up, y)) = self.swiglu_of(one, two) {
            return Some(Fused::SwiGlu(SwiGlu {
                gate,
                up,
                y,
                q8: self.q8_for(y, next),
                folded,
            }));
        }
        let mid = &one.dst;
        if !self.read_once(mid) {
            return None;
        }
        match (&one.op, &two.op) {
            (Op::Norm(NormOp::RmsNorm { eps }), Op::Binary(BinaryOp::Mul)) => {
                let (x, w, y) = (&one.src[0], &two.src[1], &two.dst);
                let one_row = w.ne[1] * w.ne[2] * w.ne[3] == 1 && w.ne[0] == x.ne[0];
                let fits = two.src[0].id == mid.id
                    && x.dtype == DType::F32
                    && y.dtype == DType::F32
                    && one_row
                    && y.ne == x.ne
                    && disjoint_or_same(y, x)
                    && disjoint(y, w);
                fits.then(|| {
                    Fused::RmsNormMul(RmsNormMul {
                        x,
                        w,
                        y,
                        eps: *eps,
                        q8: self.q8_for(y, next),
                    })
                })
            }
            (Op::MulMat, Op::Binary(BinaryOp::Add)) => {
                let r = self.residual_of(one, two)?;
                let (a, v, y) = (&one.src[0], &one.src[1], &two.dst);
                if !disjoint(y, v) || !disjoint(y, a) {
                    return None;
                }
                let add = ProductAdd {
                    a,
                    b: v,
                    product: mid,
                    r,
                    y,
                };
                if disjoint_or_same(y, r)
                    && decode_product(a, v)
                    && !self.target.batched_decode(a, v)
                {
                    return Some(Fused::GemvAdd(add));
                }
                let fits = same(y, r) && single(a) && single(v) && v.nrows() > 1;
                fits.then_some(Fused::ProductAdd(add))
            }
            _ => None,
        }
    }

    /// A decode (or ring) step's attention inputs as one `rope_store` launch: the rope of
    /// k read by its cache write alone (`set_rows` of k's rows, one dense row per token),
    /// with the rope of q (same positions and parameters) and the V cache write (same ids)
    /// when they are next to that pair, before or after it (the plan's order depends on
    /// the attention's graph), and touch nothing the launch writes. Returns the launch and
    /// how many steps it covers (`window[..n]`, whose first step is step `first` of the
    /// plan).
    fn rope_store(&self, window: &'p [Step], first: usize) -> Option<(RopeStore<'p>, usize)> {
        let w = &window[..window.len().min(4)];
        (0..3).find_map(|at| {
            let (rk, sk) = (w.get(at)?, w.get(at + 1)?);
            let mut store = self.store_core(rk, sk, first + at + 1)?;
            // the steps before the pair must all join; after it, as many as do
            if !w[..at].iter().all(|s| join(&mut store, s)) {
                return None;
            }
            let used = at
                + 2
                + w[at + 2..]
                    .iter()
                    .take_while(|s| join(&mut store, s))
                    .count();
            Some((store, used))
        })
    }

    /// A `rope_store` launch that also applies the per-row RMS norms of q and k before
    /// their ropes (Qwen3's q and k norms): the steps are q's `rms_norm` and `mul` by its
    /// weight, q's rope, k's `rms_norm` and `mul`, then a [`Context::rope_store`] of k's
    /// rope (with its cache writes) that has no q of its own. Each middle result is read
    /// by the next step alone; q's rope has the store's parameters and positions; what the
    /// launch writes is clear of what it reads (q's result may be its input, in place).
    fn normed_rope_store(
        &self,
        window: &'p [Step],
        first: usize,
    ) -> Option<(RopeStore<'p>, usize)> {
        let [nq, mq, rq, nk, mk, rest @ ..] = window else {
            return None;
        };
        let ((xq, q_norm), (xk, k_norm)) = (self.row_norm(nq, mq)?, self.row_norm(nk, mk)?);
        let (mut store, used) = self.rope_store(rest, first + 5)?;
        let Op::Rope(p) = &rq.op else {
            return None;
        };
        let (q_in, q_out) = (rq.src.first()?, &rq.dst);
        let fits = store.q.is_none()
            && !store.folded
            && *store.k.0 == mk.dst
            && *q_in == mq.dst
            && p == store.p
            && rq.src.get(1) == Some(store.pos)
            && [xq, xk, q_out].iter().all(|t| t.dtype == DType::F32)
            && xq.ne == q_out.ne
            && xq.ne[0] == xk.ne[0]
            && xq.ne[2..] == xk.ne[2..];
        if !fits {
            return None;
        }
        store.q = Some((xq, q_out));
        store.k.0 = xk;
        store.q_norm = Some(q_norm);
        store.k_norm = Some(k_norm);
        let (reads, writes) = store.memory();
        let clear = writes.iter().all(|w| {
            reads
                .iter()
                .all(|r| disjoint(w, r) || (*w == q_out && r == &xq && disjoint_or_same(w, r)))
        });
        clear.then_some((store, 5 + used))
    }

    /// `mul(rms_norm(x), w)` with `w` one dense F32 row, both results read by the next
    /// step alone: `x` and the norm.
    fn row_norm(&self, norm: &'p Step, mul: &'p Step) -> Option<(&'p Operand, RowNorm<'p>)> {
        let Op::Norm(NormOp::RmsNorm { eps }) = norm.op else {
            return None;
        };
        let (x, w) = (norm.src.first()?, mul.src.get(1)?);
        let fits = mul.op == Op::Binary(BinaryOp::Mul)
            && mul.src[0].id == norm.dst.id
            && self.read_once(&norm.dst)
            && self.read_once(&mul.dst)
            && x.dtype == DType::F32
            && dense_f32(w)
            && w.ne == [x.ne[0], 1, 1, 1]
            && mul.dst.ne == x.ne;
        fits.then_some((x, RowNorm { w, eps }))
    }

    /// The core of a `rope_store` launch: `rk` ropes k, `sk` (step `k_write` of the plan)
    /// writes its rows into the cache, and nothing else reads the roped k.
    fn store_core(&self, rk: &'p Step, sk: &'p Step, k_write: usize) -> Option<RopeStore<'p>> {
        let (Op::Rope(p), Op::Copy(CopyOp::SetRows)) = (&rk.op, &sk.op) else {
            return None;
        };
        let (k, pos, roped) = (&rk.src[0], &rk.src[1], &rk.dst);
        let (rows, ids, cache) = (sk.src.first()?, sk.src.get(1)?, &sk.dst);
        let fits = self.read_once(roped)
            && k.dtype == DType::F32
            && roped.dtype == DType::F32
            && rows.loc == roped.loc
            && roped.is_contiguous()
            && rows.is_contiguous()
            && k.ne[3] == 1
            && rows.ne == [k.ne[0] * k.ne[1], k.ne[2], 1, 1]
            && ids.dtype == DType::I32
            && ids.ne == [k.ne[2], 1, 1, 1]
            && cache.ne[0] == rows.ne[0]
            && cache.ne[2] == 1
            && cache.ne[3] == 1
            && ROPE_STORE_CACHES.contains(&cache.dtype);
        fits.then_some(RopeStore {
            p,
            pos,
            ids,
            k: (k, cache),
            q: None,
            v: None,
            k_write,
            folded: false,
            q_norm: None,
            k_norm: None,
        })
    }
}

/// Adds `s` to `st` when it is the rope of q or the V cache write of this token and the
/// launch has none yet, and its memory keeps clear of the rest; whether it joined.
fn join<'p>(st: &mut RopeStore<'p>, s: &'p Step) -> bool {
    let (src, dst) = match s.src.first() {
        Some(src) => (src, &s.dst),
        None => return false,
    };
    let joins = if let Op::Rope(p) = &s.op {
        st.q.is_none()
            && p == st.p
            && s.src.get(1) == Some(st.pos)
            && src.ne[0] == st.k.0.ne[0]
            && src.dtype == DType::F32
            && dst.dtype == DType::F32
            && disjoint_or_same(dst, src)
    } else {
        s.op == Op::Copy(CopyOp::SetRows)
            && st.v.is_none()
            && s.src.get(1) == Some(st.ids)
            && src.dtype == DType::F32
            && dst.dtype == st.k.1.dtype
    };
    let (reads, writes) = st.memory();
    if !joins
        || !writes.iter().all(|w| disjoint(src, w) && disjoint(dst, w))
        || !reads.iter().all(|r| disjoint(dst, r))
    {
        return false;
    }
    if matches!(s.op, Op::Rope(_)) {
        st.q = Some((src, dst));
    } else {
        st.v = Some((src, dst));
    }
    true
}
