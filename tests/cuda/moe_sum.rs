//! A mixture of experts' weighted sum (`y = mul(ys, weights)`, then the adds of its expert
//! slots, as `Builder::experts` ends) on the GPU: the CUDA backend fuses it into one
//! `moe_sum_f32` launch, which must give the CUDA backend's own unfused launches' result
//! bit for bit, and the CPU backend's (the unfused graph) too where the weights are inputs
//! (a softmax computed on the GPU may differ from the CPU's in the last bit): each product
//! and each sum is one f32 operation in the same order, so any other order, an fma, a
//! wrong stride or a slot missed shows as a difference. Random shapes: 1, 2, 8 and other numbers of
//! slots, 1 token to a few hundred, rows of any length; outputs dense (the mul in place)
//! or a permuted view; weights an input (several blocks) or computed like the router's
//! (a softmax, whose memory the allocator gives the sum: the one-block staged launch up to
//! 64 weights, unfused past that), or made as the model routes: `top_k` of router logits,
//! `get_rows` of the logits at those ids and a softmax (fused into the launch up to 64
//! weights); with or without the residual add after the sum (fused too). Each plan runs
//! twice (capture, then replay).
//! Without a GPU the test prints "skipped: no GPU" and passes, unless
//! `GRAFT_REQUIRE_GPU=1`.

use graft::backend::cpu::CpuBackend;
use graft::backend::cuda::CudaBackend;
use graft::backend::{Backend, BackendExt};
use graft::graph::{DType, Graph, Plan, TensorId};
use rand::{Rng, SeedableRng};

use crate::common;

/// Most weights (`n_used * n`) the staged launch takes (`MOE_SUM_STAGE` in cuda/args.cuh).
const STAGE: usize = 64;

/// One weighted sum.
#[derive(Clone, Copy, Debug)]
struct Case {
    d: usize,
    n_used: usize,
    n: usize,
    /// The outputs a permuted view of an input (else computed, the mul in place).
    permuted: bool,
    /// The weights a softmax of each token's logits (else an input).
    routed: bool,
    /// The routed weights at the `top_k` of 2 * n_used + 3 logits a token (as the model
    /// routes), not all of them.
    top_k: bool,
    /// A residual added to the sum.
    residual: bool,
}

/// The inputs of a case's graph: outputs, logits or weights, residual.
struct Inputs {
    ys0: TensorId,
    w0: TensorId,
    r: Option<TensorId>,
}

/// Logits a token of a `top_k` case.
fn n_expert(c: &Case) -> usize {
    2 * c.n_used + 3
}

/// The graph of `c`: the plan, the inputs and the result.
fn build(c: &Case) -> (Plan, Inputs, TensorId) {
    let (d, n_used, n) = (c.d, c.n_used, c.n);
    let mut g = Graph::new();
    let ys0 = match c.permuted {
        true => g.input("ys0", DType::F32, &[d, n, n_used]),
        false => g.input("ys0", DType::F32, &[d, n_used, n]),
    };
    let ys0 = ys0.unwrap();
    let w0 = match (c.routed, c.top_k) {
        (true, true) => g.input("logits", DType::F32, &[n_expert(c), n]),
        (true, false) => g.input("logits", DType::F32, &[n_used, n]),
        (false, _) => g.input("w0", DType::F32, &[1, n_used, n]),
    };
    let w0 = w0.unwrap();
    let ys = match c.permuted {
        true => g.permute(ys0, [0, 2, 1, 3]),
        false => g.scale(ys0, 1.5),
    };
    let ys = ys.unwrap();
    let w = match (c.routed, c.top_k) {
        (true, true) => {
            let ids = g.top_k(w0, n_used).unwrap();
            let rows = g.reshape(w0, &[1, n_expert(c), n]).unwrap();
            let sel = g.get_rows(rows, ids).unwrap();
            let sel = g.reshape(sel, &[n_used, n]).unwrap();
            let p = g.soft_max(sel).unwrap();
            g.reshape(p, &[1, n_used, n]).unwrap()
        }
        (true, false) => {
            let p = g.soft_max(w0).unwrap();
            g.reshape(p, &[1, n_used, n]).unwrap()
        }
        (false, _) => w0,
    };
    let y = g.mul(ys, w).unwrap();
    let nb = g.tensor(y).nb;
    let mut sum = g.view_2d(y, d, n, nb[2], 0).unwrap();
    for i in 1..n_used {
        let yi = g.view_2d(y, d, n, nb[2], i * nb[1]).unwrap();
        sum = g.add(sum, yi).unwrap();
    }
    let r = c
        .residual
        .then(|| g.input("r", DType::F32, &[d, n]).unwrap());
    let out = match r {
        Some(r) => g.add(r, sum).unwrap(),
        None => sum,
    };
    (g.plan(&[out]).unwrap(), Inputs { ys0, w0, r }, out)
}

/// Runs `plan` twice on `be` with `inputs`; both results.
fn run<B: Backend + ?Sized>(
    be: &mut B,
    plan: &Plan,
    inputs: &[(TensorId, Vec<f32>)],
    out: TensorId,
) -> [Vec<f32>; 2] {
    let n = plan.io(out).unwrap().operand.nelements();
    let e = be.load(plan).unwrap();
    let mut once = || {
        for (id, v) in inputs {
            be.set_input_f32(e, *id, v).unwrap();
        }
        be.compute(e).unwrap();
        be.get_output_f32(e, out, n).unwrap()
    };
    let results = [once(), once()];
    be.unload(e).unwrap();
    results
}

/// The kernels a profiled run of `plan` launches, joined.
fn kernels(
    cuda: &mut CudaBackend,
    plan: &Plan,
    inputs: &[(TensorId, Vec<f32>)],
    out: TensorId,
) -> String {
    cuda.set_profiling(true);
    run(cuda, plan, inputs, out);
    // the profile is taken before profiling is turned off, which drops it
    let rows = cuda.take_profile();
    cuda.set_profiling(false);
    rows.iter()
        .map(|r| r.kernels.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Checks one case: fused and unfused CUDA results against the CPU's, bit for bit, and
/// that a sum of 2 slots or more that fits the stage is one `moe_sum_f32` launch.
fn check(c: &Case, seed: u64, cuda: &mut CudaBackend) {
    let (plan, ins, sum) = build(c);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut values =
        |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| rng.random_range(-s..s)).collect() };
    let logits = if c.top_k { n_expert(c) } else { c.n_used };
    let mut inputs = vec![
        (ins.ys0, values(c.d * c.n_used * c.n, 4.0)),
        (ins.w0, values(logits * c.n, 2.0)),
    ];
    if let Some(r) = ins.r {
        inputs.push((r, values(c.d * c.n, 8.0)));
    }
    let want = run(&mut CpuBackend::new(), &plan, &inputs, sum);
    cuda.set_fusion(true);
    let fused = run(cuda, &plan, &inputs, sum);
    let names = kernels(cuda, &plan, &inputs, sum);
    cuda.set_fusion(false);
    let unfused = run(cuda, &plan, &inputs, sum);
    // Fused and unfused CUDA launches read the same device inputs: bit for bit.
    for (r, got) in fused.iter().enumerate() {
        if let Some(j) = (0..got.len()).find(|&j| got[j].to_bits() != unfused[r][j].to_bits()) {
            panic!(
                "{c:?} fused run {r}: element {j} is {}, unfused {} ({names})",
                got[j], unfused[r][j]
            );
        }
    }
    // Against the CPU: bit for bit when the weights are inputs; a computed softmax may
    // differ from the CPU's in the last bit, so routed weights are held to 1e-6 of the
    // largest result.
    let scale = want[0]
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    for (r, got) in fused.iter().enumerate() {
        let off = |j: usize| match c.routed {
            true => (got[j] - want[0][j]).abs() > 1e-6 * scale,
            false => got[j].to_bits() != want[0][j].to_bits(),
        };
        if let Some(j) = (0..got.len()).find(|&j| off(j)) {
            panic!(
                "{c:?} run {r}: element {j} is {}, the CPU's {} ({names})",
                got[j], want[0][j]
            );
        }
    }
    assert_eq!(bits(&want[0]), bits(&want[1]));
    let launched = names.contains("moe_sum_f32");
    let must = c.n_used >= 2 && (!c.routed || c.n_used * c.n <= STAGE);
    assert!(launched || !must, "{c:?}: {names}");
    if launched && !c.residual {
        assert!(!names.contains("add_f32_f32"), "{c:?}: {names}");
    }
    if launched && c.top_k && c.n_used * c.n <= STAGE {
        for unfused in ["get_rows_f32", "soft_max_f32"] {
            assert!(!names.contains(unfused), "{c:?}: {names}");
        }
    }
}

#[test]
fn moe_sum_matches_the_cpu_bit_for_bit() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut seed = 0;
    for n_used in [1, 2, 8, 3, 6] {
        for n in [1, 2, 4, 8, 9, 64, 300] {
            let kinds = [
                (false, false, false),
                (false, true, false),
                (true, false, false),
                (true, true, false),
                (false, true, true),
                (true, true, true),
            ];
            for (permuted, routed, top_k) in kinds {
                let d = match rng.random_range(0..3) {
                    0 => 2048,
                    1 => 64 * rng.random_range(1..20),
                    _ => rng.random_range(1..700),
                };
                seed += 1;
                let c = Case {
                    d,
                    n_used,
                    n,
                    permuted,
                    routed,
                    top_k,
                    residual: rng.random_bool(0.5),
                };
                check(&c, seed, &mut cuda);
            }
        }
    }
}
