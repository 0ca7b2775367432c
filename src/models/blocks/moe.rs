//! The router of a mixture of experts, as a graph of existing ops: which experts each
//! token goes through and with which weights (llama.cpp's `build_moe_ffn` routing).
//!
//! From the router's logits `[n_expert, n]`, the ids are `top_k(logits, n_used)`
//! (softmax and sigmoid keep the order, so the logits rank like the probabilities);
//! the weights are the probabilities of those experts, gathered with `get_rows`:
//! - softmax: `softmax(logits)` at the ids, or, renormalised to sum to 1, the softmax of
//!   the selected logits alone (the same numbers: `p_i / sum_sel p_j` =
//!   `exp(l_i) / sum_sel exp(l_j)`), which needs no division op;
//! - sigmoid: `sigmoid(logits)` at the ids, or, renormalised, the softmax of
//!   `log_sigmoid` of the selected logits (`sigmoid(l_i) / sum_sel sigmoid(l_j)`).

use crate::error::Result;
use crate::graph::{Graph, TensorId};
use crate::models::arch::config::{Gating, Moe};
use crate::ops::UnaryOp;

/// The experts of each token and their weights from the router's `logits` `[n_expert,
/// n]`: ids I32 `[n_used, n]` (best first) and weights F32 `[1, n_used, n]` (the shape
/// that scales the experts' outputs `[n_embd, n_used, n]` by broadcasting).
pub(crate) fn route(g: &mut Graph, logits: TensorId, moe: Moe) -> Result<(TensorId, TensorId)> {
    let [n_expert, n, ..] = g.get(logits)?.ne;
    let ids = g.top_k(logits, moe.n_used)?;
    // each token's values at its experts: get_rows of a row of one value per expert
    let at_ids = |g: &mut Graph, p: TensorId| {
        let p = g.reshape(p, &[1, n_expert, n])?;
        g.get_rows(p, ids)
    };
    let weights = match (moe.gating, moe.norm_topk) {
        (Gating::Softmax, false) => {
            let p = g.soft_max(logits)?;
            at_ids(g, p)?
        }
        (Gating::Sigmoid, false) => {
            let p = g.unary(UnaryOp::Sigmoid, logits)?;
            at_ids(g, p)?
        }
        (gating, true) => {
            // the selected logits [n_used, n], softmax'd over each token's experts
            let sel = at_ids(g, logits)?;
            let sel = g.reshape(sel, &[moe.n_used, n])?;
            let sel = match gating {
                Gating::Softmax => sel,
                Gating::Sigmoid => g.unary(UnaryOp::LogSigmoid, sel)?,
            };
            g.soft_max(sel)?
        }
    };
    let weights = g.reshape(weights, &[1, moe.n_used, n])?;
    Ok((ids, weights))
}

/// The experts' outputs `ys` `[n_embd, n_used, n]` weighted by `weights` `[1, n_used, n]`
/// and summed over the experts in slot order: `[n_embd, n]` (a `mul`, then the `add`s of
/// its slot views, the pattern the CUDA backend fuses into one launch).
pub(crate) fn weighted_sum(g: &mut Graph, ys: TensorId, weights: TensorId) -> Result<TensorId> {
    let y = g.mul(ys, weights)?;
    let t = g.tensor(y);
    let ([n_embd, n_used, n, _], nb) = (t.ne, t.nb);
    let mut sum = g.view_2d(y, n_embd, n, nb[2], 0)?;
    for i in 1..n_used {
        let yi = g.view_2d(y, n_embd, n, nb[2], i * nb[1])?;
        sum = g.add(sum, yi)?;
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, BackendExt};
    use crate::graph::DType;

    /// Routes seeded logits on the CPU: (ids, weights) per token.
    fn run(moe: Moe, logits: &[f32], n: usize) -> (Vec<i32>, Vec<f32>) {
        let mut g = Graph::new();
        let x = g.input("logits", DType::F32, &[moe.n_expert, n]).unwrap();
        let (ids, w) = route(&mut g, x, moe).unwrap();
        let ids_out = g.cont(ids).unwrap();
        let plan = g.plan(&[ids_out, w]).unwrap();
        let mut be = CpuBackend::new();
        let exec = be.load(&plan).unwrap();
        be.set_input_f32(exec, x, logits).unwrap();
        be.compute(exec).unwrap();
        let k = moe.n_used * n;
        let mut ids_bytes = vec![0u8; k * 4];
        be.get_output(exec, ids_out, &mut ids_bytes).unwrap();
        let ids = bytemuck::cast_slice(&ids_bytes).to_vec();
        (ids, be.get_output_f32(exec, w, k).unwrap())
    }

    /// The weights against their definitions in f64: the selected probabilities of the
    /// softmax (or sigmoid) over all experts, divided by their sum when renormalised;
    /// the ids are the best experts in order.
    #[test]
    fn weights_follow_their_definition() {
        let (n_expert, n) = (12, 5);
        let logits: Vec<f32> = (0..n_expert * n)
            .map(|i| ((i * 7919 % 101) as f32 - 50.0) / 9.0)
            .collect();
        for (gating, norm_topk) in [
            (Gating::Softmax, true),
            (Gating::Softmax, false),
            (Gating::Sigmoid, false),
            (Gating::Sigmoid, true),
        ] {
            let moe = Moe {
                n_expert,
                n_used: 3,
                gating,
                norm_topk,
            };
            let (ids, w) = run(moe, &logits, n);
            for t in 0..n {
                let row: Vec<f64> = logits[t * n_expert..][..n_expert]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                let p: Vec<f64> = match gating {
                    Gating::Softmax => {
                        let z: f64 = row.iter().map(|v| v.exp()).sum();
                        row.iter().map(|v| v.exp() / z).collect()
                    }
                    Gating::Sigmoid => row.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
                };
                let mut order: Vec<usize> = (0..n_expert).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                let sel = &order[..3];
                let sum: f64 = sel.iter().map(|&e| p[e]).sum();
                for (j, &e) in sel.iter().enumerate() {
                    assert_eq!(ids[t * 3 + j], e as i32, "{gating:?} token {t}");
                    let want = if norm_topk { p[e] / sum } else { p[e] };
                    let got = f64::from(w[t * 3 + j]);
                    assert!(
                        (got - want).abs() < 1e-6,
                        "{gating:?} {norm_topk}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
