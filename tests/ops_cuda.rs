//! Per-op property tests of the CUDA backend: every case of the CPU tests runs on the
//! GPU and on the CPU, and the GPU result is compared with the f64 oracle and with the
//! CPU result (same thresholds), with sentinel checks of the GPU arena and state
//! buffers. Each plan runs twice (the second run may replay a captured graph); see
//! `common::cross_check`.
//!
//! A case the CUDA backend reports as unsupported is counted and the count printed per
//! op; it fails the test when the case is of a layout every backend must support (see
//! `Case::required_everywhere`). Without a GPU every test prints "skipped: no GPU" and
//! passes, unless `GRAFT_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use std::cell::{Cell, RefCell};
use std::sync::Mutex;

use common::strategies as st;
use common::Case;
use graft::backend::cpu::CpuBackend;
use graft::graph::{BinaryOp, UnaryOp};
use proptest::strategy::{BoxedStrategy, Strategy};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The GPU tests run one at a time.
static GPU: Mutex<()> = Mutex::new(());

/// Runs `cases` cases of `strategy` on the GPU (if there is one) and prints how many
/// the CUDA backend ran and how many it does not support.
fn on_gpu(name: &str, strategy: BoxedStrategy<Case>, cases: u32) {
    let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cuda) = common::cuda_backend() else {
        return;
    };
    let cuda = RefCell::new(cuda);
    let cpu = RefCell::new(CpuBackend::new());
    let (ran, unsupported) = (Cell::new(0usize), Cell::new(0usize));
    let config = Config {
        source_file: Some(file!()),
        ..common::config(cases)
    };
    let result = TestRunner::new(config).run(&strategy, |case| {
        let on = common::cross_check(&case, &mut *cuda.borrow_mut(), &mut *cpu.borrow_mut())
            .map_err(TestCaseError::fail)?;
        let counter = match on {
            common::Device::Ran => &ran,
            common::Device::Unsupported => &unsupported,
        };
        counter.set(counter.get() + 1);
        Ok(())
    });
    common::report(&format!(
        "{name}: {} cases ran on cuda, {} unsupported by the CUDA backend",
        ran.get(),
        unsupported.get()
    ));
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

/// Runs out-of-range cases on the GPU: each must fail with an index error.
fn index_errors_on_gpu(name: &str, strategy: BoxedStrategy<Case>, cases: u32) {
    let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cuda) = common::cuda_backend() else {
        return;
    };
    let cuda = RefCell::new(cuda);
    let config = Config {
        source_file: Some(file!()),
        ..common::config(cases)
    };
    let result = TestRunner::new(config).run(&strategy, |case| {
        common::check_index_error(&case, &mut *cuda.borrow_mut()).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

#[test]
fn prop_get_rows() {
    on_gpu("get_rows", st::get_rows(), 128);
}

/// Every [`BinaryOp`]: 128 cases per op.
#[test]
fn prop_binary() {
    on_gpu("binary", st::binary(), 128 * BinaryOp::ALL.len() as u32);
}

#[test]
fn prop_scale() {
    on_gpu("scale", st::scale(), 128);
}

/// Every [`UnaryOp`]: 128 cases per op.
#[test]
fn prop_unary() {
    on_gpu("unary", st::unary(), 128 * UnaryOp::ALL.len() as u32);
}

#[test]
fn prop_rms_norm() {
    on_gpu("rms_norm", st::norm(true), 128);
}

#[test]
fn prop_norm() {
    on_gpu("norm", st::norm(false), 128);
}

#[test]
fn prop_mul_mat() {
    on_gpu("mul_mat", st::mul_mat(), 128);
}

#[test]
fn prop_mul_mat_gemv() {
    on_gpu("mul_mat gemv", st::mul_mat_gemv(), 128);
}

#[test]
fn prop_mul_mat_p021() {
    on_gpu("mul_mat p021", st::mul_mat_p021(), 128);
}

#[test]
fn prop_mul_mat_vec_nc() {
    on_gpu("mul_mat vec_nc", st::mul_mat_vec_nc(), 128);
}

#[test]
fn prop_mul_mat_prefill() {
    on_gpu("mul_mat prefill", st::mul_mat_prefill(), 128);
}

#[test]
fn prop_rope() {
    on_gpu("rope", st::rope(), 128);
}

#[test]
fn prop_cpy() {
    on_gpu("cpy", st::cpy(), 128);
}

#[test]
fn prop_cont() {
    on_gpu("cont", st::cont(), 128);
}

#[test]
fn prop_cast() {
    on_gpu("cast", st::cast(), 128);
}

#[test]
fn prop_set_rows() {
    on_gpu("set_rows", st::set_rows(), 128);
}

#[test]
fn prop_set_rows_v_transposed() {
    on_gpu("set_rows v_transposed", st::set_rows_v_transposed(), 128);
}

#[test]
fn prop_diag_mask_inf() {
    on_gpu("diag_mask_inf", st::diag_mask_inf(), 128);
}

#[test]
fn prop_soft_max() {
    on_gpu("soft_max", st::soft_max(), 128);
}

#[test]
fn prop_argmax() {
    on_gpu("argmax", st::argmax(), 128);
}

#[test]
fn prop_top_k() {
    on_gpu("top_k", st::top_k(), 256);
}

#[test]
fn prop_get_rows_index_out_of_range() {
    index_errors_on_gpu("get_rows", st::index_out_of_range(false), 48);
}

#[test]
fn prop_set_rows_index_out_of_range() {
    index_errors_on_gpu("set_rows", st::index_out_of_range(true), 48);
}

/// NMSE bound of flash_attn_ext on CUDA against the CPU backend and the f64 oracle, per
/// K/V dtype. Both backends read the same (rounded or quantized) K/V bytes, so the
/// quantization error cancels; what remains is the prefill kernel's F16 rounding of q,
/// of K/V (dequantized values of Q8_0/Q4_0 rounded to F16 too) and of the probabilities,
/// about 2^-11 relative per value (the CPU stays within 1e-9 of the oracle). 5e-4 is
/// ggml's threshold for attention; the quantized types get twice that as margin for
/// their dequantized products, not measured yet.
fn flash_attn_bound(kv: graft::graph::DType) -> f64 {
    if kv.quant().is_some() {
        1e-3
    } else {
        5e-4
    }
}

/// flash_attn_ext over a long prefill (4,096 queries x 4,096 keys, the size from which the
/// lowering runs `fattn_kv_range` first and the prefill kernel visits only the key tiles
/// its rows see): a causal F16 mask, and an F32 sliding-window mask with groups of rows
/// that see no key (empty ranges, ranges that start past key 0), against the f64 oracle
/// with sentinels around the output.
#[test]
fn flash_attn_ext_long_prefill_skips_masked_tiles() {
    use common::attention::{run, Case, MaskKind};
    let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    for (d, mask, mask_f16) in [
        (64, MaskKind::Causal, true),
        (128, MaskKind::Window(700), false),
    ] {
        let c = Case {
            d,
            n_q: 4096,
            n_kv: 4096,
            n_head_kv: 1,
            group: 2,
            batch: 1,
            ctx: 4096,
            first: 0,
            kv: graft::graph::DType::F16,
            mask,
            mask_f16,
            mask_pad: 0,
            mask_heads: 1,
            p: graft::graph::FlashAttnParams {
                scale: 1.0 / (d as f32).sqrt(),
                max_bias: 0.0,
                softcap: 0.0,
            },
            seed: 11,
        };
        let r = run(&c, &mut cuda).unwrap_or_else(|e| panic!("{mask:?}: {e}"));
        assert!(
            r.got.iter().all(|x| x.is_finite()),
            "{mask:?}: non-finite output"
        );
        let err = common::nmse(&r.got, &r.want);
        let bound = flash_attn_bound(c.kv);
        assert!(
            err <= bound,
            "{mask:?}: NMSE {err:e} vs the oracle (bound {bound:e})"
        );
        // the rows that see no key give zeros
        if let MaskKind::Window(_) = mask {
            let row = 3 * 64 * 2 * d; // query 192 (group 3), both heads
            assert!(r.got[row..row + 2 * d].iter().all(|&x| x == 0.0));
        }
    }
}

/// flash_attn_ext: every case of `tests/attention.rs` on CUDA and on the CPU, with the
/// arena poisoned and its sentinels checked (`common::attention::run`); the CUDA result
/// must be finite and within [`flash_attn_bound`] of both the CPU result and the oracle.
/// Every case must be supported (head dims, dtypes and views are the kernels' own).
#[test]
fn prop_flash_attn_ext() {
    flash_attn_cases(common::attention::case(), 64);
}

/// flash_attn_ext as [`prop_flash_attn_ext`], one-query decode only (MHA in half the
/// cases, GQA in the others), over F16, BF16, Q8_0 and Q4_0 caches: the one-row decode
/// kernels, streamed or not, and the streamed GQA over quantized caches.
#[test]
fn prop_flash_attn_ext_one_query_decode() {
    flash_attn_cases(common::attention::one_query_decode_case(), 64);
}

/// Runs `cases` cases of `strategy` on CUDA and on the CPU and holds the CUDA result to
/// the CPU's and to the oracle.
fn flash_attn_cases(strategy: impl Strategy<Value = common::attention::Case>, cases: u32) {
    use common::attention::run;
    use common::nmse;
    let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cuda) = common::cuda_backend() else {
        return;
    };
    let cuda = RefCell::new(cuda);
    let cpu = RefCell::new(CpuBackend::new());
    let config = Config {
        source_file: Some(file!()),
        ..common::config(cases)
    };
    let result = TestRunner::new(config).run(&strategy, |c| {
        let on_cpu = run(&c, &mut *cpu.borrow_mut()).map_err(TestCaseError::fail)?;
        let on_gpu = run(&c, &mut *cuda.borrow_mut())
            .map_err(|e| TestCaseError::fail(format!("cuda: {e}")))?;
        if let Some(i) = on_gpu.got.iter().position(|x| !x.is_finite()) {
            return Err(TestCaseError::fail(format!(
                "cuda: element {i} is {}",
                on_gpu.got[i]
            )));
        }
        let bound = flash_attn_bound(c.kv);
        let want_cpu: Vec<f64> = on_cpu.got.iter().map(|&x| f64::from(x)).collect();
        let (vs_cpu, vs_oracle) = (
            nmse(&on_gpu.got, &want_cpu),
            nmse(&on_gpu.got, &on_gpu.want),
        );
        if vs_cpu > bound || vs_oracle > bound {
            return Err(TestCaseError::fail(format!(
                "cuda NMSE {vs_cpu:e} vs cpu, {vs_oracle:e} vs oracle (bound {bound:e})"
            )));
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("flash_attn_ext: {e}");
    }
}
