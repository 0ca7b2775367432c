//! Fused attention, ggml's `flash_attn_ext`: for every query row and head,
//! `softmax(scale * q k^T (+ slope * mask)) v` in one op, with no `[n_kv, n_q, heads]`
//! score tensor. Shapes (ggml's):
//!
//! | operand | shape | dtype |
//! | --- | --- | --- |
//! | q | `[d, n_q, n_head, batch]` | F32 |
//! | k | `[d, n_kv, n_head_kv, batch]` (any strides a cache view has) | F32, F16, BF16, Q8_0, Q4_0 |
//! | v | `[d_v, n_kv, n_head_kv, batch]` | as k |
//! | mask (optional) | `[n_kv, >= n_q, m2, m3]`, `m2 \| n_head`, `m3 \| batch` | F32, F16 |
//! | result | `[d_v, n_head, n_q, batch]` | F32 |
//!
//! The result is laid out head-major within a query, so `reshape` to `[d_v * n_head,
//! n_q]` is the attention output ready for the output projection. Heads share KV heads
//! by broadcast (GQA: head `h` reads KV head `h / (n_head / n_head_kv)`). The score of
//! key `j` is `s = scale * q . k_j`, then `softcap * tanh(s / softcap)` when softcapping,
//! then `+ slope_h * mask[j, i]` (ALiBi slopes when `max_bias > 0`, else 1).
//!
//! The CPU reference is FlashAttention's online softmax: a running maximum `M` and sum
//! `S` per row and an accumulator of `v` rows, rescaled by `exp(M_old - M_new)` whenever
//! the maximum grows, so each key is visited once. A row whose keys are all masked
//! (`-inf`) gives zeros.

use rayon::prelude::*;

use super::host::HostTensor;
use super::{expect_dtype, FlashAttnParams, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};

/// Dtypes the K and V operands may have.
pub const KV_DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
];

impl Graph {
    /// Fused attention of `q` over `k`, `v` with an optional additive `mask` (see the
    /// module docs for shapes); every shape and dtype is checked with a typed error.
    pub fn flash_attn_ext(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        mask: Option<TensorId>,
        p: FlashAttnParams,
    ) -> Result<TensorId> {
        const OP: &str = "flash_attn_ext";
        let (tq, tk, tv) = (self.get(q)?, self.get(k)?, self.get(v)?);
        expect_dtype(OP, &tq.name, tq.dtype, &[DType::F32])?;
        expect_dtype(OP, &tk.name, tk.dtype, &KV_DTYPES)?;
        expect_dtype(OP, &tv.name, tv.dtype, &KV_DTYPES)?;
        let shapes = || {
            format!(
                "q '{}' {}, k '{}' {}, v '{}' {}",
                tq.name,
                fmt_ne(&tq.ne),
                tk.name,
                fmt_ne(&tk.ne),
                tv.name,
                fmt_ne(&tv.ne)
            )
        };
        if tk.ne[0] != tq.ne[0] {
            return Err(Error::shape(OP, format!("head sizes differ: {}", shapes())));
        }
        if tv.ne[1] != tk.ne[1] || tv.ne[2] != tk.ne[2] || tv.ne[3] != tk.ne[3] {
            return Err(Error::shape(
                OP,
                format!(
                    "k and v must have the same keys, KV heads and batch: {}",
                    shapes()
                ),
            ));
        }
        if tq.ne[2] % tk.ne[2] != 0 || tq.ne[3] != tk.ne[3] {
            return Err(Error::shape(
                OP,
                format!(
                    "the query heads must be a multiple of the KV heads and the batches equal: {}",
                    shapes()
                ),
            ));
        }
        let finite = |x: f32| x.is_finite();
        let ok = finite(p.scale)
            && p.max_bias >= 0.0
            && finite(p.max_bias)
            && p.softcap >= 0.0
            && finite(p.softcap);
        if !ok {
            return Err(Error::shape(
                OP,
                format!("scale, max_bias >= 0 and softcap >= 0 must be finite: {p}"),
            ));
        }
        let (d_v, n_q, n_head, batch) = (tv.ne[0], tq.ne[1], tq.ne[2], tq.ne[3]);
        let mut src = vec![q, k, v];
        if let Some(m) = mask {
            self.check_attn_mask(m, tk.ne[1], n_q, n_head, batch)?;
            src.push(m);
        }
        Ok(self.new_node(
            Op::FlashAttnExt(p),
            DType::F32,
            [d_v, n_head, n_q, batch],
            &src,
        ))
    }

    fn check_attn_mask(
        &self,
        m: TensorId,
        n_kv: usize,
        n_q: usize,
        n_head: usize,
        batch: usize,
    ) -> Result<()> {
        let tm = self.get(m)?;
        expect_dtype(
            "flash_attn_ext",
            &tm.name,
            tm.dtype,
            &[DType::F32, DType::F16],
        )?;
        if tm.ne[0] != n_kv || tm.ne[1] < n_q || n_head % tm.ne[2] != 0 || batch % tm.ne[3] != 0 {
            return Err(Error::shape(
                "flash_attn_ext",
                format!(
                    "mask '{}' {} must be [{n_kv}, >= {n_q}, a divisor of {n_head}, a divisor of {batch}]",
                    tm.name,
                    fmt_ne(&tm.ne)
                ),
            ));
        }
        Ok(())
    }
}

/// CPU reference: the online softmax, one task per (query, head, batch) row.
pub(crate) fn cpu(p: &FlashAttnParams, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (q, k, v) = (src[0], src[1], src[2]);
    let mask = src.get(3).copied();
    let (d, n_kv, n_head_kv) = (k.ne[0], k.ne[1], k.ne[2]);
    let (d_v, n_q, n_head, batch) = (v.ne[0], q.ne[1], q.ne[2], q.ne[3]);
    let group = n_head / n_head_kv;
    let rows = n_q * n_head * batch;
    let results: Vec<(usize, Vec<f32>)> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let (i, h, b) = (r % n_q, (r / n_q) % n_head, r / (n_q * n_head));
            let mut qrow = vec![0f32; d];
            // SAFETY: (i, h, b) is inside q's shape; the plan guarantees valid memory.
            unsafe { q.read_row(i, h, b, &mut qrow) };
            let row = Row {
                q: &qrow,
                i,
                h,
                b,
                hk: h / group,
                n_kv,
                n_head,
            };
            (r, attend(p, &row, k, v, mask, d_v))
        })
        .collect();
    for (r, out) in results {
        let (i, h, b) = (r % n_q, (r / n_q) % n_head, r / (n_q * n_head));
        // SAFETY: the result is [d_v, n_head, n_q, batch]; (h, i, b) is inside it and each
        // row is written once.
        unsafe { dst.write_row(h, i, b, &out) };
    }
    Ok(())
}

/// One query row of one head.
struct Row<'a> {
    q: &'a [f32],
    i: usize,
    h: usize,
    b: usize,
    hk: usize,
    n_kv: usize,
    n_head: usize,
}

/// The attention output of one query row: the online softmax over every key.
fn attend(
    p: &FlashAttnParams,
    row: &Row,
    k: HostTensor,
    v: HostTensor,
    mask: Option<HostTensor>,
    d_v: usize,
) -> Vec<f32> {
    let slope = p.slope(row.h, row.n_head);
    // The bias of every key: slope * mask, or 0 without a mask.
    let mut bias = vec![0f32; row.n_kv];
    if let Some(m) = mask {
        // SAFETY: the mask broadcasts over heads and batches; the row index is inside it.
        unsafe { m.read_row(row.i, row.h % m.ne[2], row.b % m.ne[3], &mut bias) };
        bias.iter_mut().for_each(|b| *b *= slope);
    }
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    let mut acc = vec![0f32; d_v];
    let (mut krow, mut vrow) = (vec![0f32; row.q.len()], vec![0f32; d_v]);
    for (j, &bias) in bias.iter().enumerate() {
        if bias == f32::NEG_INFINITY {
            continue;
        }
        // SAFETY: key j of KV head hk in batch b is inside k.
        unsafe { k.read_row(j, row.hk, row.b, &mut krow) };
        let mut s = p.scale * super::mul_mat::dot_f32(row.q, &krow);
        if p.softcap > 0.0 {
            s = p.softcap * (s / p.softcap).tanh();
        }
        s += bias;
        if s > max {
            // The running maximum grows: rescale what was summed so far.
            let c = (max - s).exp();
            sum *= c;
            acc.iter_mut().for_each(|a| *a *= c);
            max = s;
        }
        let w = (s - max).exp();
        // SAFETY: value row j of KV head hk in batch b is inside v.
        unsafe { v.read_row(j, row.hk, row.b, &mut vrow) };
        acc.iter_mut().zip(&vrow).for_each(|(a, x)| *a += w * x);
        sum += w;
    }
    if sum > 0.0 {
        acc.iter_mut().for_each(|a| *a /= sum);
    }
    acc
}
