//! mul_mat_id with ggml's semantics: a matrix product whose weight is chosen per column
//! by an id, the expert MLPs of a mixture of experts.
//!
//! `as` [k, m, n_expert] holds one `[k, m]` matrix per expert, `b` [k, b1, n_tokens] the
//! inputs and `ids` I32 [n_used, n_tokens] the experts each token goes through; the F32
//! result [m, n_used, n_tokens] is
//!
//! `c[:, i, t] = as[:, :, ids[i, t]]^T b[:, i % b1, t]`
//!
//! so `b1` is either 1 (every expert of a token reads the same input: the gate and up
//! projections) or `n_used` (each its own: the down projection). An id outside
//! `0..n_expert` is an index error when the graph runs. The CPU kernel gathers the
//! columns of each expert and runs [`mul_mat`](super::mul_mat)'s kernel on them, so every
//! weight dtype of mul_mat (float and block types, both [`QuantDot`] paths) works here.

use super::host::HostTensor;
use super::mul_mat::QuantDot;
use super::{expect_dtype, expect_float_or_quant, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, Step, TensorId};

impl Graph {
    /// The experts' products: `as` [k, m, n_expert] (float or block type), `b` [k, b1,
    /// n_tokens] (F32 with a block-typed `as`), `ids` I32 [n_used, n_tokens] with `n_used`
    /// a multiple of `b1`; F32 [m, n_used, n_tokens] (see the module documentation).
    pub fn mul_mat_id(&mut self, r#as: TensorId, b: TensorId, ids: TensorId) -> Result<TensorId> {
        let (ta, tb, ti) = (self.get(r#as)?, self.get(b)?, self.get(ids)?);
        expect_float_or_quant("mul_mat_id", &ta.name, ta.dtype)?;
        let b_types: &[DType] = match ta.dtype.quant() {
            Some(_) => &[DType::F32],
            None => &DType::FLOATS,
        };
        expect_dtype("mul_mat_id", &tb.name, tb.dtype, b_types)?;
        expect_dtype("mul_mat_id", &ti.name, ti.dtype, &[DType::I32])?;
        let fits = ta.ne[3] == 1
            && tb.ne[3] == 1
            && ti.ne[2] == 1
            && ti.ne[3] == 1
            && ta.ne[0] == tb.ne[0]
            && ti.ne[1] == tb.ne[2]
            && ti.ne[0] % tb.ne[1] == 0;
        if !fits {
            return Err(Error::shape(
                "mul_mat_id",
                format!(
                    "experts '{}' {}, inputs '{}' {} and ids '{}' {} do not fit: expected [k, m, n_expert], [k, b1, n_tokens] and [n_used, n_tokens] with n_used a multiple of b1",
                    ta.name,
                    fmt_ne(&ta.ne),
                    tb.name,
                    fmt_ne(&tb.ne),
                    ti.name,
                    fmt_ne(&ti.ne)
                ),
            ));
        }
        let ne = [ta.ne[1], ti.ne[0], tb.ne[2], 1];
        Ok(self.new_node(Op::MulMatId, DType::F32, ne, &[r#as, b, ids]))
    }
}

/// The (slot, token) columns of each expert, in token order: `ids` checked against
/// `n_expert` (an error names the step, the id and its token).
pub fn columns_by_expert(
    step: &Step,
    ids: &HostTensor,
    n_expert: usize,
) -> Result<Vec<Vec<(usize, usize)>>> {
    let mut by_expert = vec![Vec::new(); n_expert];
    for t in 0..ids.ne[1] {
        for i in 0..ids.ne[0] {
            // SAFETY: (i, t) is inside ids' shape [n_used, n_tokens].
            let id = unsafe { ids.get_i32([i, t, 0, 0]) };
            match usize::try_from(id).ok().filter(|&e| e < n_expert) {
                Some(e) => by_expert[e].push((i, t)),
                None => {
                    return Err(Error::IndexOutOfRange {
                        op: "mul_mat_id",
                        node: step.name.clone(),
                        index: id as i64,
                        position: t,
                        limit: n_expert,
                    })
                }
            }
        }
    }
    Ok(by_expert)
}

/// A dense F32 `[rows, cols]` host tensor over `v`.
fn dense(v: &mut [f32], rows: usize, cols: usize) -> HostTensor {
    debug_assert_eq!(v.len(), rows * cols);
    let nb1 = rows * 4;
    HostTensor {
        ptr: v.as_mut_ptr() as *mut u8,
        dtype: DType::F32,
        ne: [rows, cols, 1, 1],
        nb: [4, nb1, nb1 * cols, nb1 * cols],
    }
}

/// CPU reference for mul_mat_id: for each expert that has columns, its inputs gathered
/// into a dense matrix, one mul_mat with the expert's `[k, m]` slice of `as`, and the
/// results scattered to their (slot, token) columns.
pub(crate) fn cpu(step: &Step, dst: HostTensor, src: &[HostTensor], quant: QuantDot) -> Result<()> {
    let (a, b, ids) = (src[0], src[1], src[2]);
    let (k, m) = (a.ne[0], a.ne[1]);
    let by_expert = columns_by_expert(step, &ids, a.ne[2])?;
    let (mut cols, mut out) = (Vec::new(), Vec::new());
    for (e, pairs) in by_expert.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
        let n = pairs.len();
        cols.resize(n * k, 0f32);
        for (col, &(i, t)) in cols.chunks_exact_mut(k).zip(pairs) {
            // SAFETY: (i % b1, t) is a row of b (t < n_tokens = b.ne[2]).
            unsafe { b.read_row(i % b.ne[1], t, 0, col) };
        }
        out.resize(n * m, 0f32);
        let expert = HostTensor {
            // SAFETY: e < n_expert, so the expert's matrix starts inside a's memory.
            ptr: unsafe { a.ptr.add(e * a.nb[2]) },
            ne: [k, m, 1, 1],
            ..a
        };
        super::mul_mat::cpu(
            dense(&mut out, m, n),
            &[expert, dense(&mut cols, k, n)],
            quant,
            super::mul_mat::WeightLayout::Ggml,
        )?;
        for (vals, &(i, t)) in out.chunks_exact(m).zip(pairs) {
            // SAFETY: (i, t) is a column of dst [m, n_used, n_tokens], written once.
            unsafe { dst.write_row(i, t, 0, vals) };
        }
    }
    Ok(())
}
