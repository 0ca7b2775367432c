//! Host-side checks of the fused `moe_sum_f32` launch ([`super::lower_moe_sum`]), no GPU
//! needed: a mixture of experts' weighted sum over 1 to 8 expert slots and 1 to many
//! tokens, with dense or strided outputs, weights that are an input, a strided view or
//! computed (as the router's, whose memory the sum may be given), lowered with host
//! addresses and carried out by the host interpreter of the kernel's contract
//! (`MoeSumArgs`: each product and sum an f32 operation, in slot order; a staged launch
//! reads every weight before it writes), equals the CPU backend's result and the
//! unfused launches' bit for bit. Routed as the model routes (top_k, get_rows, soft_max)
//! and with the residual add after it, the weights made in the launch come out within
//! float rounding of the CPU's. The kernel itself is checked on a GPU
//! (tests/cuda/moe_sum.rs).

use crate::backend::cuda::args::MOE_SUM_STAGE;
use crate::backend::cuda::tests::run_on_host;
use crate::backend::fusion::{fuse, Fused, Target};
use crate::graph::{DType, Graph, TensorId};
use crate::models::arch::config::{Gating, Moe};
use crate::models::blocks::moe::{route, weighted_sum};

/// Where the experts' outputs come from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Outputs {
    /// Computed (as mul_mat_id's), dense: the mul runs in place on them.
    Computed,
    /// A permuted view of an input `[d, n, n_used]`: rows of slots `d * n` apart.
    Permuted,
}

/// Where the routing weights come from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Weights {
    /// An input `[1, n_used, n]`.
    Input,
    /// Every other element of an input `[2, n_used, n]`.
    Strided,
    /// Computed from an input `[n_used, n]`, as the router's: free after the mul.
    Computed,
}

/// The tail of a mixture of experts over `n` tokens: outputs `[d, n_used, n]` weighted
/// by routing weights `[1, n_used, n]` and summed over the slots in order, as the model
/// builds it; the graph, the sum and the inputs.
fn moe_tail(
    d: usize,
    n_used: usize,
    n: usize,
    outputs: Outputs,
    weights: Weights,
) -> (Graph, TensorId, Vec<TensorId>) {
    let mut g = Graph::new();
    let ys = match outputs {
        Outputs::Computed => g.input("ys0", DType::F32, &[d, n_used, n]).unwrap(),
        Outputs::Permuted => g.input("ys0", DType::F32, &[d, n, n_used]).unwrap(),
    };
    let w0 = match weights {
        Weights::Input => g.input("w0", DType::F32, &[1, n_used, n]).unwrap(),
        Weights::Strided => g.input("w0", DType::F32, &[2, n_used, n]).unwrap(),
        Weights::Computed => g.input("w0", DType::F32, &[n_used, n]).unwrap(),
    };
    let inputs = vec![ys, w0];
    let ys = match outputs {
        Outputs::Computed => g.scale(ys, 0.5).unwrap(),
        Outputs::Permuted => g.permute(ys, [0, 2, 1, 3]).unwrap(),
    };
    let w = match weights {
        Weights::Input => w0,
        Weights::Strided => g.view_3d(w0, 1, n_used, n, 8, 8 * n_used, 0).unwrap(),
        Weights::Computed => {
            let p = g.scale(w0, 0.25).unwrap();
            g.reshape(p, &[1, n_used, n]).unwrap()
        }
    };
    let sum = weighted_sum(&mut g, ys, w).unwrap();
    (g, sum, inputs)
}

/// Whether the plan of `sum` has a weighted sum the CUDA backend stages.
fn staged(g: &Graph, sum: TensorId) -> bool {
    let plan = g.plan(&[sum]).unwrap();
    let target = Target {
        q8_1: true,
        batched_cols: 0,
        batched_cols_32: 0,
        f16_copies: false,
        tensor_cols: 0,
        batched_from: usize::MAX,
        expert_decode_tokens: 0,
        moe_sum_stage: MOE_SUM_STAGE as usize,
    };
    let groups = fuse(&plan, &target);
    groups
        .iter()
        .any(|g| matches!(&g.fused, Fused::MoeSum(s) if s.staged))
}

/// The weighted sum fuses into one `moe_sum_f32` launch from 2 slots (1 slot is the mul
/// alone; a sum over more computed weights than the launch stages stays unfused), and its
/// result is the CPU's and the unfused launches' to the bit.
#[test]
fn moe_sum_matches_the_cpu_bit_for_bit() {
    let mut seed = 0;
    let mut staged_sums = 0;
    for (d, n_used, n) in [
        (64, 1, 1),
        (64, 2, 1),
        (40, 3, 2),
        (96, 8, 1),
        (64, 8, 5),
        (32, 4, 33),
    ] {
        for outputs in [Outputs::Computed, Outputs::Permuted] {
            for weights in [Weights::Input, Weights::Strided, Weights::Computed] {
                seed += 1;
                let what = format!("{d} x {n_used} x {n} {outputs:?} {weights:?}");
                let (g, sum, inputs) = moe_tail(d, n_used, n, outputs, weights);
                let (names, got, want) = run_on_host(&g, sum, &inputs, seed, true);
                let (unfused_names, unfused, _) = run_on_host(&g, sum, &inputs, seed, false);
                let staged = staged(&g, sum);
                staged_sums += usize::from(staged);
                assert!(!staged || weights == Weights::Computed, "{what}");
                let mut unfused_expect = match outputs {
                    Outputs::Computed => vec!["scale_f32"],
                    Outputs::Permuted => vec![],
                };
                if weights == Weights::Computed {
                    unfused_expect.push("scale_f32");
                }
                let mut expect = unfused_expect.clone();
                unfused_expect.push("mul_f32_f32");
                unfused_expect.extend(vec!["add_f32_f32"; n_used - 1]);
                let fused = names.iter().any(|k| k == "moe_sum_f32");
                match fused {
                    true => expect.push("moe_sum_f32"),
                    false => expect = unfused_expect.clone(),
                }
                // only one slot, or a sum over more computed weights than are staged
                let refused = n_used == 1
                    || (weights == Weights::Computed && n_used * n > MOE_SUM_STAGE as usize);
                assert!(fused || refused, "{what}: {names:?}");
                assert_eq!(names, expect, "{what}");
                assert_eq!(unfused_names, unfused_expect, "{what}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&got), bits(&want), "{what}: against the CPU");
                assert_eq!(
                    bits(&got),
                    bits(&unfused),
                    "{what}: against the unfused launches"
                );
            }
        }
    }
    assert!(
        staged_sums > 0,
        "some sum lies over the computed weights (the case staging is for)"
    );
}

/// A mixture of experts' tail routed as the model routes it (`top_k` of `n_expert` logits
/// a token, the softmax of the selected ones) with the residual add after the sum: the
/// fused launch covers the weights' `get_rows` and `soft_max` up to 64 weights (32
/// slots), and the add where its result is clear of the outputs; its result is the CPU's within float rounding (the weights are
/// made in another order of operations), as are the unfused launches'.
#[test]
fn routed_moe_sum_with_its_residual_matches_the_cpu() {
    let mut seed = 100;
    let mut residuals = 0;
    for (d, n_expert, n_used, n) in [
        (64, 16, 8, 1),
        (40, 12, 3, 7),
        (96, 128, 8, 8),
        (32, 8, 2, 40),
    ] {
        seed += 1;
        let what = format!("{d} x {n_used} of {n_expert} x {n}");
        let mut g = Graph::new();
        let ys0 = g.input("ys0", DType::F32, &[d, n_used, n]).unwrap();
        let logits = g.input("logits", DType::F32, &[n_expert, n]).unwrap();
        let r = g.input("r", DType::F32, &[d, n]).unwrap();
        let moe = Moe {
            n_expert,
            n_used,
            gating: Gating::Softmax,
            norm_topk: true,
        };
        let (_, w) = route(&mut g, logits, moe).unwrap();
        let ys = g.scale(ys0, 0.5).unwrap();
        let sum = weighted_sum(&mut g, ys, w).unwrap();
        let out = g.add(r, sum).unwrap();
        let inputs = [ys0, logits, r];
        let (names, got, want) = run_on_host(&g, out, &inputs, seed, true);
        let (unfused_names, unfused, _) = run_on_host(&g, out, &inputs, seed, false);
        residuals += usize::from(!names.contains(&"add_f32_f32".to_string()));
        match n_used * n <= MOE_SUM_STAGE as usize {
            // the residual add stays a launch where its result has the outputs' memory
            true => assert_eq!(
                names[..3],
                ["scale_f32", "top_k_warp_f32", "moe_sum_f32"],
                "{what}: {names:?}"
            ),
            false => {
                // the weights made as steps (the sum itself is fused where it need not
                // stage more weights than the launch holds)
                for kernel in ["get_rows_f32", "soft_max_f32"] {
                    assert!(names.iter().any(|k| k == kernel), "{what}: {names:?}");
                }
            }
        }
        for unfused_kernel in ["get_rows_f32", "soft_max_f32", "mul_f32_f32", "add_f32_f32"] {
            assert!(
                unfused_names.iter().any(|k| k == unfused_kernel),
                "{what}: {unfused_names:?}"
            );
        }
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (j, ((a, b), c)) in got.iter().zip(&want).zip(&unfused).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "{what}: element {j} is {a}, the CPU's {b}"
            );
            assert!(
                (c - b).abs() <= 1e-5 * scale,
                "{what}: unfused element {j} is {c}, the CPU's {b}"
            );
        }
    }
    assert!(residuals > 0, "some residual add fuses");
}
