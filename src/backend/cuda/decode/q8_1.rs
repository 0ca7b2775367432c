//! Q8_1 activations of the products with block-quantized weights that read them (the
//! decode products on the `__dp4a` path, and the batched ones on int8 tensor cores,
//! `lower::mmq`): a column of `k` activations quantized to Q8_1 in scratch, in the layout
//! of the weights that read it ([`Q8Layout`]; `act_at` in `cuda/quant.cuh`), made by
//! `quantize_q8_1_f32` (`cuda/quantize.cu`) before the product, or by the fused step
//! before it ([`crate::backend::fusion::Q8For`]: a fused norm, SwiGLU, or the attention's
//! combine), and kept for the next products of the same activations
//! ([`Lowering::q8_1`]). The columns of activations with batches `[k, n, b2, b3]` follow
//! one another (column `i1 + n (i2 + b2 i3)`), as the products' columns do.

use super::ROWS;
use crate::backend::cuda::args::{CpyArgs, Tensor4, ACT_BLOCKS, ACT_F16, ACT_PAIRS};
use crate::backend::cuda::kernels::k;
use crate::backend::cuda::lower::mmq::f16_column_bytes;
use crate::backend::cuda::lowering::{DevOp, Lowering, MAX_GRID_YZ};
use crate::backend::fusion::{Q8For, Q8Layout};
use crate::graph::Operand;

/// A Q8_1 copy of F32 activations in scratch, as the products read them.
#[derive(Clone, Debug)]
pub struct Q8Copy {
    /// The activations.
    pub of: Operand,
    /// The copy's address.
    pub addr: u64,
    /// Its layout (by the weight type of the product that reads it).
    pub layout: Q8Layout,
}

/// A Q8_1 layout as the kernels take it (`mode`, `q8_layout`): `ACT_BLOCKS` or `ACT_PAIRS`
/// (or `ACT_F16`: an F16 copy, which the fused steps' `q8_layout` also takes).
pub(crate) fn act_code(layout: Q8Layout) -> i64 {
    match layout {
        Q8Layout::Blocks => ACT_BLOCKS,
        Q8Layout::Pairs => ACT_PAIRS,
        Q8Layout::F16 => ACT_F16,
    }
}

/// Bytes of one column of `k` activations quantized to Q8_1 for the products: the
/// `k` quants in groups of 16 blocks (512 bytes, the last one padded), then a (d, sum) f16
/// pair per 32 elements, padded to 16 bytes (cuda/quant.cuh, `act_at`), in either layout.
pub(crate) fn q8_1_column_bytes(k: usize) -> usize {
    (k.next_multiple_of(512) + k / 32 * 4).next_multiple_of(16)
}

/// Scratch at `*offset` for the Q8_1 copy in `layout` (or the F16 copy) of the F32 columns
/// `b` [k, n, b2, b3] that the products read: its address and column stride (bytes).
pub(crate) fn q8_1_copy(
    b: &Operand,
    layout: Q8Layout,
    offset: &mut usize,
    lw: &mut Lowering,
) -> (u64, usize) {
    let row = match layout {
        Q8Layout::F16 => f16_column_bytes(b.ne[0]),
        Q8Layout::Blocks | Q8Layout::Pairs => q8_1_column_bytes(b.ne[0]),
    };
    (lw.reserve_scratch(offset, row * b.nrows()), row)
}

/// The address of the Q8_1 copy of `b` in `layout` that an earlier step made, if any
/// ([`Lowering::q8_1`]).
pub(crate) fn made(b: &Operand, layout: Q8Layout, lw: &Lowering) -> Option<u64> {
    lw.q8_1
        .as_ref()
        .filter(|c| c.of == *b && c.layout == layout)
        .map(|c| c.addr)
}

/// The copy `q8` that a fused step writes of its result, in scratch from `*offset`: the
/// copy, and its address, column stride and layout as the kernel's arguments (zeros
/// without one).
pub(crate) fn written_by_fused(
    q8: Option<&Q8For>,
    offset: &mut usize,
    lw: &mut Lowering,
) -> ((u64, i64, i64), Option<Q8Copy>) {
    let Some(q8) = q8 else {
        return ((0, 0, 0), None);
    };
    let (addr, row) = q8_1_copy(q8.of, q8.layout, offset, lw);
    let copy = Q8Copy {
        of: q8.of.clone(),
        addr,
        layout: q8.layout,
    };
    ((addr, row as i64, act_code(q8.layout)), Some(copy))
}

/// `quantize_q8_1_f32` of the F32 columns `b` [k, n, b2, b3] into scratch at offset 0 (a
/// column of [`q8_1_column_bytes`] each, in the order of [`q8_1_copy`]), recorded as the
/// copy that later products of `b` read ([`Lowering::q8_1`]): the scratch address and the
/// launch.
pub(crate) fn quantize_q8_1(
    b: &Operand,
    layout: Q8Layout,
    lw: &mut Lowering,
) -> Result<(u64, DevOp), String> {
    quantize_q8_1_at(b, layout, 0, lw)
}

/// The address of the Q8_1 copy of `b` in `layout` a product reads: the one an earlier
/// step made ([`made`]), else one quantized into scratch from byte `offset`
/// ([`quantize_q8_1_at`]), its launch pushed onto `ops`.
pub(crate) fn copy_of(
    b: &Operand,
    layout: Q8Layout,
    offset: usize,
    lw: &mut Lowering,
    ops: &mut Vec<DevOp>,
) -> Result<u64, String> {
    if let Some(addr) = made(b, layout, lw) {
        return Ok(addr);
    }
    let (addr, op) = quantize_q8_1_at(b, layout, offset, lw)?;
    ops.push(op);
    Ok(addr)
}

/// [`quantize_q8_1`] into scratch from byte `offset` (past what the step keeps there).
fn quantize_q8_1_at(
    b: &Operand,
    layout: Q8Layout,
    mut offset: usize,
    lw: &mut Lowering,
) -> Result<(u64, DevOp), String> {
    let (kk, n, b2) = (b.ne[0], b.ne[1], b.ne[2]);
    let (addr, row) = q8_1_copy(b, layout, &mut offset, lw);
    let args = CpyArgs {
        src: lw.t4(b),
        dst: Tensor4 {
            data: addr,
            ne: b.ne.map(|x| x as i64),
            nb: [1, row, row * n, row * n * b2].map(|x| x as i64),
        },
        n: 0,
        mode: act_code(layout),
    };
    let grid = (
        u32::try_from((kk / 32).div_ceil(ROWS)).map_err(|_| format!("{kk} elements per row"))?,
        b.nrows().min(MAX_GRID_YZ) as u32,
        1,
    );
    lw.q8_1 = Some(Q8Copy {
        of: b.clone(),
        addr,
        layout,
    });
    Ok((
        addr,
        DevOp::kernel(
            k::QUANTIZE_Q8_1_F32,
            grid,
            ((ROWS * 32) as u32, 1, 1),
            &args,
        ),
    ))
}
