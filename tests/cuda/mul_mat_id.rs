//! mul_mat_id on the GPU against the f64 oracle (`common/moe.rs` draws the cases): every
//! weight dtype, random ids with repeats and unused experts, shared and per-expert
//! inputs, strided inputs; decode widths (a few columns per expert, one chunk; block
//! types of up to 4 tokens on the decode kernels `mul_mat_vec_id_q*_<type>`, up to 8
//! experts a token, rows 16-byte aligned or not) and prefill widths (up to 96 tokens: many
//! chunks of MMID_COLS columns per expert, more than the grid's z, or many column tiles of
//! the int8 tensor-core product). A kernel that
//! dequantizes the weights in registers and sums in f32 is held within relative 1e-5 of
//! each output's terms' scale (`moe::magnitudes`), as the CPU's f32 path; a Q8_1 path of
//! block types (the tensor-core product, the decode kernels) within 1e-3 of it against
//! the oracle of the inputs rounded to Q8_1 (the f16 `d * sum` of a Q8_1 block is the
//! largest error left: 2^-11 of the offset terms). Ids outside the experts are index
//! errors.
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

/// One case on the GPU, every output against the oracle of the exact inputs, or for
/// block types every output against that of the inputs rounded to Q8_1.
fn check(c: &moe::MoeCase, cuda: &mut CudaBackend) -> Result<(), String> {
    let got = moe::run(c, cuda).map_err(|e| format!("{c:?}: {e}"))?;
    let scale = moe::magnitudes(c);
    let exact = within(&got, &moe::oracle(c, false), &scale, 1e-5);
    match (exact, c.dtype.quant()) {
        (Ok(()), _) => Ok(()),
        (Err(e), None) => Err(format!("{c:?}: {e}")),
        (Err(e), Some(_)) => within(&got, &moe::oracle(c, true), &scale, 1e-3)
            .map_err(|q| format!("{c:?}: {e}; against the Q8_1 inputs: {q}")),
    }
}

/// Whether every output is finite and within `tol` times its terms' scale of the oracle.
fn within(got: &[f32], want: &[f64], scale: &[f64], tol: f64) -> Result<(), String> {
    for (j, ((&g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        if (f64::from(g) - w).abs() > tol * s || !g.is_finite() {
            return Err(format!("output {j} is {g}, expected {w} (terms {s})"));
        }
    }
    Ok(())
}

#[test]
fn mul_mat_id_decode_widths() {
    on_gpu(moe::cases(), 128);
}

/// Decode steps of block-quantized experts: the decode kernels, every block type.
#[test]
fn mul_mat_id_decode_kernels() {
    on_gpu(moe::decode_cases(), 96);
}

#[test]
fn mul_mat_id_prefill_widths() {
    on_gpu(moe::cases_with(96, 12, 70), 48);
}

/// A bad id is an index error on the decode kernels (3 tokens) and on the grouped
/// products (6 tokens: `group_by_expert`), block-quantized and float.
#[test]
fn ids_outside_the_experts_are_index_errors() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    for (dtype, n_tokens) in [(DType::Q4_K, 3), (DType::Q4_K, 6), (DType::F16, 3)] {
        let mut ids = vec![0, 1, 2, 3, 7, 0];
        ids.resize(2 * n_tokens, 1);
        let c = moe::MoeCase {
            dtype,
            k: 256,
            m: 40,
            n_expert: 4,
            n_used: 2,
            b1: 1,
            n_tokens,
            b_pad: 0,
            w_offset: 0,
            ids,
            seed: 9,
        };
        match moe::run(&c, &mut cuda) {
            Err(Error::IndexOutOfRange {
                index,
                limit,
                position,
                ..
            }) => assert_eq!((index, limit, position), (7, 4, 2), "{c:?}"),
            other => panic!("{c:?}: {other:?}"),
        }
    }
}
