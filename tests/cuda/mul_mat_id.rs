//! mul_mat_id on the GPU against the f64 oracle (`common/moe.rs` draws the cases): every
//! weight dtype, random ids with repeats and unused experts, shared and per-expert
//! inputs, strided inputs; decode widths (a few columns per expert, one chunk) and
//! prefill widths (up to 96 tokens: many chunks of MMID_COLS columns per expert, more
//! than the grid's z). The kernel dequantizes the weights in registers and sums in f32,
//! so each output is held within relative 1e-5 of its terms' scale
//! (`moe::magnitudes`), as the CPU's f32 path; ids outside the experts are index errors.
//! Each plan runs twice (capture, then replay). Without a GPU every test prints
//! "skipped: no GPU" and passes, unless `GRAFT_REQUIRE_GPU=1`.

use std::cell::RefCell;

use graft::backend::cuda::CudaBackend;
use graft::graph::DType;
use graft::Error;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::{common, moe};

/// Runs `cases` cases of `strategy` on the GPU against the oracle.
fn on_gpu(strategy: impl Strategy<Value = moe::MoeCase>, cases: u32) {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    let config = Config {
        source_file: Some(file!()),
        ..common::config(cases)
    };
    let cuda = RefCell::new(&mut cuda);
    let result = TestRunner::new(config).run(&strategy, |c| {
        check(&c, &mut cuda.borrow_mut()).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// One case on the GPU, each output against the oracle.
fn check(c: &moe::MoeCase, cuda: &mut CudaBackend) -> Result<(), String> {
    let got = moe::run(c, cuda).map_err(|e| format!("{c:?}: {e}"))?;
    let (want, scale) = (moe::oracle(c, false), moe::magnitudes(c));
    for (j, ((&g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
        if (f64::from(g) - w).abs() > 1e-5 * s || !g.is_finite() {
            return Err(format!(
                "{c:?}: output {j} is {g}, expected {w} (terms {s})"
            ));
        }
    }
    Ok(())
}

#[test]
fn mul_mat_id_decode_widths() {
    on_gpu(moe::cases(), 128);
}

#[test]
fn mul_mat_id_prefill_widths() {
    on_gpu(moe::cases_with(96, 12, 70), 48);
}

#[test]
fn ids_outside_the_experts_are_index_errors() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    let c = moe::MoeCase {
        dtype: DType::Q4_K,
        k: 256,
        m: 40,
        n_expert: 4,
        n_used: 2,
        b1: 1,
        n_tokens: 3,
        b_pad: 0,
        ids: vec![0, 1, 2, 3, 7, 0],
        seed: 9,
    };
    match moe::run(&c, &mut cuda) {
        Err(Error::IndexOutOfRange { index, limit, .. }) => assert_eq!((index, limit), (7, 4)),
        other => panic!("{other:?}"),
    }
}
