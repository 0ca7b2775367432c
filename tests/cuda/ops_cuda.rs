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

use std::cell::{Cell, RefCell};

use common::strategies as st;
use common::Case;
use graft::backend::cpu::CpuBackend;
use graft::graph::{BinaryOp, UnaryOp};
use proptest::strategy::{BoxedStrategy, Strategy};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::common;

/// Runs `cases` cases of `strategy` on the GPU (if there is one) and prints how many
/// the CUDA backend ran and how many it does not support.
fn on_gpu(name: &str, strategy: BoxedStrategy<Case>, cases: u32) {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
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
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
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

/// soft_max of `x * 0.5 + mask`, `x` and `mask` both `[n, rows]`, on `be`.
fn soft_max_rows(
    be: &mut dyn graft::backend::Backend,
    n: usize,
    x: &[f32],
    mask: &[f32],
) -> Vec<f32> {
    use graft::backend::BackendExt;
    use graft::graph::{DType, Graph};
    let rows = x.len() / n;
    let mut g = Graph::new();
    let xi = g.input("x", DType::F32, &[n, rows]).unwrap();
    let mi = g.input("mask", DType::F32, &[n, rows]).unwrap();
    let y = g.soft_max_ext(xi, Some(mi), 0.5).unwrap();
    let exec = be.load(&g.plan(&[y]).unwrap()).unwrap();
    be.set_input_f32(exec, xi, x).unwrap();
    be.set_input_f32(exec, mi, mask).unwrap();
    be.compute(exec).unwrap();
    let out = be.get_output_f32(exec, y, x.len()).unwrap();
    be.unload(exec).unwrap();
    out
}

/// soft_max keeps a NaN: a row holding a NaN (in x or in the mask) or a +inf is NaN on
/// CUDA as on the CPU, at row lengths of one warp and of many (the block's maximum), and a
/// fully masked row is zeros. fmaxf passes over a NaN, so a maximum built on it once made
/// such rows finite.
#[test]
fn soft_max_keeps_nan_rows() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    let mut cpu = CpuBackend::new();
    for n in [7, 32, 1000, 5000] {
        let rows = 6;
        let mut x: Vec<f32> = (0..n * rows)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 10.0)
            .collect();
        let mut mask = vec![0.0f32; n * rows];
        x[n + n / 2] = f32::NAN; // row 1: one NaN
        x[2 * n..3 * n].fill(f32::NAN); // row 2: all NaN
        mask[3 * n..4 * n].fill(f32::NEG_INFINITY); // row 3: fully masked
        x[4 * n + n - 1] = f32::INFINITY; // row 4: +inf
        mask[5 * n] = f32::NAN; // row 5: a NaN in the mask
        let want = soft_max_rows(&mut cpu, n, &x, &mask);
        let got = soft_max_rows(&mut cuda, n, &x, &mask);
        for (r, (w, g)) in want.chunks(n).zip(got.chunks(n)).enumerate() {
            let nan = matches!(r, 1 | 2 | 4 | 5);
            assert!(
                w.iter().all(|v| v.is_nan() == nan),
                "cpu n {n} row {r}: {w:?}"
            );
            assert!(
                g.iter().all(|v| v.is_nan() == nan),
                "cuda n {n} row {r}: {g:?}"
            );
            if r == 3 {
                assert!(w.iter().chain(g).all(|&v| v == 0.0), "n {n}: masked row");
            }
            for (a, b) in w.iter().zip(g).filter(|(a, _)| a.is_finite()) {
                assert!((a - b).abs() <= 1e-6, "n {n} row {r}: {a} vs {b}");
            }
        }
    }
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
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
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
            poison: None,
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

/// flash_attn_ext: every case of `tests/ops/attention.rs` on CUDA and on the CPU, with the
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

/// flash_attn_ext with a NaN or an infinity in q, K or V (`common::attention::
/// poisoned_case`), over every kernel: prefill (tensor cores), the decode kernels (vector,
/// streamed, tensor-core decode, split and combined) and every cache type (a quantized
/// block holding the value is written with a NaN scale): on CUDA and on the CPU, every row
/// that sees the value is non-finite, every row that does not is finite and as the oracle.
#[test]
fn prop_flash_attn_ext_non_finite_inputs() {
    use common::attention::{case, one_query_decode_case, poisoned_case};
    non_finite_cases(poisoned_case(case()), 64);
    non_finite_cases(poisoned_case(one_query_decode_case()), 64);
}

/// Runs `cases` poisoned cases of `strategy` on CUDA and on the CPU, each held to its rows'
/// expectations.
fn non_finite_cases(strategy: impl Strategy<Value = common::attention::Case>, cases: u32) {
    use common::attention::{check_expectations, run};
    attention_cases(
        "flash_attn_ext with non-finite inputs",
        strategy,
        cases,
        |c, cuda, cpu| {
            let bound = flash_attn_bound(c.kv);
            let check = |name: &str, be: &mut dyn graft::backend::Backend| {
                run(c, be)
                    .and_then(|r| check_expectations(c, &r, bound))
                    .map_err(|e| TestCaseError::fail(format!("{name}: {e}")))
            };
            check("cpu", cpu)?;
            check("cuda", cuda)?;
            Ok(())
        },
    );
}

/// Runs `cases` cases of `strategy` on CUDA and on the CPU and holds the CUDA result to
/// the CPU's and to the oracle.
fn flash_attn_cases(strategy: impl Strategy<Value = common::attention::Case>, cases: u32) {
    use common::attention::run;
    use common::nmse;
    attention_cases("flash_attn_ext", strategy, cases, |c, cuda, cpu| {
        let on_cpu = run(c, cpu).map_err(TestCaseError::fail)?;
        let on_gpu = run(c, cuda).map_err(|e| TestCaseError::fail(format!("cuda: {e}")))?;
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
}

/// Runs `cases` cases of `strategy` through `check(case, cuda, cpu)`, one GPU test at a
/// time; panics naming `what` at the first failure.
fn attention_cases(
    what: &str,
    strategy: impl Strategy<Value = common::attention::Case>,
    cases: u32,
    check: impl Fn(
        &common::attention::Case,
        &mut dyn graft::backend::Backend,
        &mut dyn graft::backend::Backend,
    ) -> Result<(), TestCaseError>,
) {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
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
        check(&c, &mut *cuda.borrow_mut(), &mut *cpu.borrow_mut())
    });
    if let Err(e) = result {
        panic!("{what}: {e}");
    }
}

/// paged_attn on CUDA against the CPU backend and the f64 oracle of `common/paged.rs`
/// (every case with the arena poisoned and guard bytes checked): the drawn cases of the CPU
/// test, NaN input for every cache type on the decode and the tensor-core prefill kernels,
/// bad tables, and large batches (64 sequences, one long sequence, a 512-token chunk, a
/// mixed batch) that split the keys over blocks and take the tensor-core kernels.
mod paged_attn {
    use std::cell::RefCell;

    use graft::backend::Backend;
    use graft::graph::{DType, PagedAttnParams};
    use proptest::test_runner::{Config, TestCaseError, TestRunner};

    use super::{flash_attn_bound, CpuBackend};
    use crate::common::paged::{case, inputs, oracle, poison, run, Case, Inputs};
    use crate::common::{self, nmse};
    use crate::GPU;

    /// Every cache type.
    const TYPES: [DType; 5] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
    ];

    /// The NMSE bound of a case's CUDA result against the CPU's and the oracle's. The
    /// tensor-core kernels round q, K/V and the probabilities to F16 ([`flash_attn_bound`]):
    /// `fattn_paged_dec` (GQA over F16 caches) and `fattn_paged_mma` (runs of a batch of
    /// more than 64 tokens, K and V of one type), at head dims 64, 128 and 256. The CUDA-core
    /// decode kernels compute in F32 from the same K/V values as the CPU; only the order of
    /// the additions and exp2 against exp differ.
    fn bound(c: &Case, n_tokens: usize) -> f64 {
        let dims = matches!(c.d, 64 | 128 | 256);
        let dec = c.k == DType::F16 && c.v == DType::F16 && c.group > 1;
        let prefill = c.k == c.v && n_tokens > 64;
        if dims && (dec || prefill) {
            flash_attn_bound(c.k).max(flash_attn_bound(c.v))
        } else {
            1e-8
        }
    }

    /// Runs a case on the CPU and on CUDA: the CUDA result must be finite, within
    /// [`bound`] of the CPU's (and of the oracle's, when `with_oracle`), and exactly zero in
    /// padding rows.
    fn compare(
        c: &Case,
        x: &Inputs,
        cuda: &mut dyn Backend,
        cpu: &mut dyn Backend,
        with_oracle: bool,
    ) -> Result<(), String> {
        let want = run(c, x, cpu).map_err(|e| format!("cpu: {e}"))?;
        let got = run(c, x, cuda).map_err(|e| format!("cuda: {e}"))?;
        if let Some(i) = got.iter().position(|v| !v.is_finite()) {
            return Err(format!("cuda: element {i} is {}", got[i]));
        }
        let n_tokens = x.seqs.len() / 2;
        let b = bound(c, n_tokens);
        let vs_cpu = nmse(&got, &want);
        let vs_oracle = if with_oracle {
            nmse(&got, &oracle(c, x))
        } else {
            0.0
        };
        if vs_cpu > b || vs_oracle > b {
            return Err(format!(
                "cuda NMSE {vs_cpu:e} vs cpu, {vs_oracle:e} vs oracle (bound {b:e})"
            ));
        }
        let row = c.d * c.n_head();
        for (t, s) in x.seqs.chunks(2).enumerate() {
            if s[0] < 0 && got[t * row..(t + 1) * row].iter().any(|&v| v != 0.0) {
                return Err(format!("cuda: padding token {t} is not zeros"));
            }
        }
        Ok(())
    }

    /// The cases of `tests/paged_attn.rs` (random tables, decode and chunk queries in runs
    /// or shuffled, padding, GQA, windows, softcapping, every cache type for K and V).
    #[test]
    fn prop_paged_attn() {
        let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
        let Some(cuda) = common::cuda_backend() else {
            return;
        };
        let (cuda, cpu) = (RefCell::new(cuda), RefCell::new(CpuBackend::new()));
        let config = Config {
            source_file: Some(file!()),
            ..common::config(128)
        };
        let result = TestRunner::new(config).run(&case(), |c| {
            let x = inputs(&c);
            compare(
                &c,
                &x,
                &mut *cuda.borrow_mut(),
                &mut *cpu.borrow_mut(),
                true,
            )
            .map_err(TestCaseError::fail)
        });
        if let Err(e) = result {
            panic!("paged_attn: {e}");
        }
    }

    /// A decode batch's attention read by a product of F16 weights (its activations an F16
    /// copy): with the keys in one chunk (a table of 96 positions) the decode kernel writes
    /// the copy itself, the product launches no copy of its own, and it agrees with the
    /// CPU's (the padding token's column zeros); with the keys split (1,024 positions) the
    /// combine writes it.
    #[test]
    fn decode_writes_the_f16_copy_of_the_next_product() {
        use crate::common::paged::{run_then, Product};
        let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut cuda) = common::cuda_backend() else {
            return;
        };
        let mut cpu = CpuBackend::new();
        for max_blocks in [6, 64] {
            // head dim 128 over F16 caches as two_sequences, 4 KV heads with no GQA (the
            // streamed kernel), 6 sequences decoding
            let c = Case {
                n_head_kv: 4,
                group: 1,
                n_blocks: 48,
                max_blocks,
                lens: vec![40, 96, 17, 60, 5, 80],
                queries: vec![1; 6],
                padding: 1,
                seed: 11,
                ..two_sequences(DType::F16, false)
            };
            let x = inputs(&c);
            let rows = 48;
            let w: Vec<f32> = (0..c.d * c.n_head() * rows)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
                .collect();
            let product = || Some(Product { w: &w, rows });
            let want = run_then(&c, &x, &mut cpu, product()).unwrap();
            cuda.set_profiling(true);
            let got = run_then(&c, &x, &mut cuda, product());
            let kernels: Vec<String> = cuda.take_profile().into_iter().map(|s| s.kernels).collect();
            cuda.set_profiling(false);
            let got = got.unwrap();
            let e = nmse(&got, &want);
            assert!(e < 1e-5, "{max_blocks} blocks: NMSE {e:e} vs cpu");
            let pad = x.seqs.chunks(2).position(|s| s[0] < 0).unwrap();
            assert!(got[pad * rows..(pad + 1) * rows].iter().all(|&v| v == 0.0));
            // the steps' launches: the weights' cast, the attention, then the product
            // alone (no copy of its activations of its own)
            let at = kernels
                .iter()
                .position(|k| k.starts_with("fattn_paged_vec_d128_f16"));
            let at = at.unwrap_or_else(|| panic!("{kernels:?}"));
            let split = kernels[at].contains("fattn_paged_combine");
            assert_eq!(split, max_blocks == 64, "{kernels:?}");
            assert_eq!(
                kernels.get(at + 1).map(String::as_str),
                Some("cublasGemmEx"),
                "{max_blocks} blocks: {kernels:?}"
            );
        }
    }

    /// Two sequences over blocks of their own (n_blocks = 2 x max_blocks, see
    /// [`own_blocks`]), head dim 128, GQA (2 KV heads of 2 query heads), 2 padding tokens:
    /// sequence 0 decodes at position 19 and sequence 1 at 36 (4 tokens: the decode
    /// kernels), or sequence 1 takes a chunk of 90 tokens at positions 60..149 (93 tokens:
    /// the tensor-core prefill kernel takes its runs).
    fn two_sequences(dt: DType, chunk: bool) -> Case {
        let (lens, queries) = if chunk {
            (vec![20, 150], vec![1, 90])
        } else {
            (vec![20, 37], vec![1, 1])
        };
        Case {
            d: 128,
            n_head_kv: 2,
            group: 2,
            k: dt,
            v: dt,
            p: PagedAttnParams {
                scale: 0.09,
                softcap: 0.0,
                block_size: 16,
                window: 0,
            },
            n_blocks: 20,
            max_blocks: 10,
            lens,
            queries,
            padding: 2,
            shuffle: false,
            seed: 7,
        }
    }

    /// The inputs of a case with sequence s on blocks s * max_blocks.. of its own, so that a
    /// poisoned slot belongs to one sequence's position only.
    fn own_blocks(c: &Case) -> Inputs {
        let mut x = inputs(c);
        for (i, b) in x.table.iter_mut().enumerate() {
            *b = i as i32;
        }
        assert!(c.n_blocks >= c.lens.len() * c.max_blocks);
        x
    }

    /// Whether each (token, head) row of a result holds a NaN.
    fn nan_rows(out: &[f32], d: usize) -> Vec<bool> {
        out.chunks(d)
            .map(|r| r.iter().any(|v| v.is_nan()))
            .collect()
    }

    /// A NaN in a query, in a visible K row or in a visible V row, for every cache type, on
    /// the decode kernels and on the tensor-core prefill kernel (a K row inside the chunk,
    /// seen by its later tokens only; a V row of the prefix, seen by all), and an infinity
    /// in a query with softcapping: exactly the rows the CPU makes NaN are NaN on CUDA, the
    /// others agree with the CPU's, padding is zeros.
    #[test]
    fn non_finite_input_is_never_finite_output() {
        let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut cuda) = common::cuda_backend() else {
            return;
        };
        let mut cpu = CpuBackend::new();
        for dt in TYPES {
            for chunk in [false, true] {
                let c = two_sequences(dt, chunk);
                let row = c.d * c.n_head();
                let n_kv_dim = c.d * c.n_head_kv;
                // (what, sequence, position, V?, KV head) of each poisoned K/V element
                let rows = [
                    ("K of sequence 0", 0, 4, false, 0),
                    ("V of sequence 0", 0, 4, true, 1),
                    ("K inside sequence 1", 1, c.lens[1] - 20, false, 1),
                    ("V of sequence 1's prefix", 1, 10, true, 0),
                ];
                let mut variants: Vec<(String, Inputs)> = Vec::new();
                let mut x = own_blocks(&c);
                let t1 = x.seqs.chunks(2).position(|s| s[0] == 1).unwrap();
                x.q[t1 * row + c.d + 3] = f32::NAN;
                variants.push(("q of sequence 1, head 1".into(), x));
                for (what, seq, pos, is_v, hk) in rows {
                    let mut x = own_blocks(&c);
                    let bs = c.p.block_size;
                    let slot = x.table[seq * c.max_blocks + pos / bs] as usize * bs + pos % bs;
                    let bytes = if is_v { &mut x.v_bytes } else { &mut x.k_bytes };
                    poison(bytes, dt, slot * n_kv_dim + hk * c.d + 5);
                    variants.push((format!("{what} at {pos}, KV head {hk}"), x));
                }
                for (what, x) in variants {
                    let label = format!("{dt} {} tokens, NaN in {what}", x.seqs.len() / 2);
                    let want = run(&c, &x, &mut cpu).unwrap();
                    let got = run(&c, &x, &mut cuda).unwrap_or_else(|e| panic!("{label}: {e}"));
                    let (wn, gn) = (nan_rows(&want, c.d), nan_rows(&got, c.d));
                    assert!(wn.iter().any(|&n| n), "{label}: no NaN row on the CPU");
                    assert_eq!(gn, wn, "{label}: the rows holding a NaN");
                    let clean = |o: &[f32]| -> Vec<f32> {
                        o.chunks(c.d)
                            .zip(&wn)
                            .filter(|(_, &n)| !n)
                            .flat_map(|(r, _)| r.to_vec())
                            .collect()
                    };
                    let e = nmse(&clean(&got), &clean(&want));
                    let b = bound(&c, x.seqs.len() / 2);
                    assert!(e <= b, "{label}: NMSE {e:e} (bound {b:e})");
                    for (t, s) in x.seqs.chunks(2).enumerate() {
                        let r = &got[t * row..(t + 1) * row];
                        assert!(
                            s[0] >= 0 || r.iter().all(|&v| v == 0.0),
                            "{label}: padding {t}"
                        );
                    }
                }
                // an infinity in q with softcapping: NaN rows, not capped finite scores
                let mut capped = c.clone();
                capped.p.softcap = 2.5;
                let mut x = own_blocks(&capped);
                x.q[t1 * row + 3] = f32::INFINITY;
                let want = nan_rows(&run(&capped, &x, &mut cpu).unwrap(), c.d);
                let got = nan_rows(&run(&capped, &x, &mut cuda).unwrap(), c.d);
                assert!(want.iter().any(|&n| n), "{dt}: an infinite q, softcapped");
                assert_eq!(got, want, "{dt}: an infinite q, softcapped");
            }
        }
    }

    /// A block id outside the pool in a table entry a token sees, a sequence outside the
    /// table and a position past it are index errors naming the op and the index, on the
    /// decode kernels and with the tensor-core prefill kernel.
    #[test]
    fn bad_tables_are_index_errors() {
        let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut cuda) = common::cuda_backend() else {
            return;
        };
        let expect = |r: Result<Vec<f32>, String>, index: i32, what: &str| match r {
            Err(e) => assert!(
                e.contains("paged_attn") && e.contains(&format!("index {index} ")),
                "{what}: {e}"
            ),
            Ok(_) => panic!("{what}: no error"),
        };
        for chunk in [false, true] {
            let c = two_sequences(DType::F16, chunk);
            let what = |w: &str| format!("{w} ({} queries of sequence 1)", c.queries[1]);
            // sequence 1's block of positions 16..31, seen by all its tokens
            let mut x = own_blocks(&c);
            x.table[c.max_blocks + 1] = c.n_blocks as i32;
            let bad = c.n_blocks as i32;
            expect(
                run(&c, &x, &mut cuda),
                bad,
                &what("a block outside the pool"),
            );
            let max_pos = (c.max_blocks * c.p.block_size) as i32;
            for (field, value, w) in [
                (0, 2, "a sequence outside"),
                (1, max_pos, "a position past"),
            ] {
                let mut x = own_blocks(&c);
                let t = x.seqs.chunks(2).rposition(|s| s[0] == 1).unwrap();
                x.seqs[2 * t + field] = value;
                expect(
                    run(&c, &x, &mut cuda),
                    value,
                    &what(&format!("{w} the table")),
                );
            }
            // and the backend runs the clean case after them
            let x = own_blocks(&c);
            compare(&c, &x, &mut cuda, &mut CpuBackend::new(), true)
                .unwrap_or_else(|e| panic!("{}: {e}", what("after the errors")));
        }
    }

    /// A case of head dim 128 over blocks of 16 positions, the pool as large as the longest
    /// sequence's blocks (sequences share blocks, in a random order each).
    fn large(
        dt: DType,
        (n_head_kv, group): (usize, usize),
        lens: Vec<usize>,
        queries: Vec<usize>,
        (window, softcap): (usize, f32),
    ) -> Case {
        let bs = 16;
        let max_blocks = lens.iter().max().unwrap().div_ceil(bs);
        Case {
            d: 128,
            n_head_kv,
            group,
            k: dt,
            v: dt,
            p: PagedAttnParams {
                scale: 1.0 / (128f32).sqrt(),
                softcap,
                block_size: bs,
                window,
            },
            n_blocks: max_blocks,
            max_blocks,
            lens,
            queries,
            padding: 3,
            shuffle: false,
            seed: 21,
        }
    }

    /// Large batches against the CPU (the oracle would take minutes): 64 sequences of 1 to
    /// 4,000 positions decoding (GQA over F16 on the tensor-core decode kernel, Q8_0 on the
    /// streamed one over 4 heads, MHA over Q4_0 one head a block), one sequence of 16,000
    /// positions decoding (its keys split over many blocks), a 512-token chunk over 3,000
    /// cached positions (the tensor-core prefill kernel; F16 through cp.async, Q4_0 converted
    /// with a window and softcapping), and a mixed batch of chunks and decode tokens (BF16).
    #[test]
    fn large_batches() {
        let _serial = GPU.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut cuda) = common::cuda_backend() else {
            return;
        };
        let mut cpu = CpuBackend::new();
        let many: Vec<usize> = (0..64).map(|i| 1 + i * 3999 / 63).collect();
        let ones = vec![1; 64];
        let plain = (0, 0.0);
        let cases = [
            (
                "64 decodes, F16 GQA",
                large(DType::F16, (8, 4), many.clone(), ones.clone(), plain),
            ),
            (
                "64 decodes, Q8_0 GQA",
                large(DType::Q8_0, (8, 4), many.clone(), ones.clone(), plain),
            ),
            (
                "64 decodes, Q4_0 MHA",
                large(DType::Q4_0, (16, 1), many, ones, plain),
            ),
            (
                "16,000 positions, F16 GQA",
                large(DType::F16, (8, 4), vec![16_000], vec![1], plain),
            ),
            (
                "16,000 positions, F16 MHA",
                large(DType::F16, (16, 1), vec![16_000], vec![1], plain),
            ),
            (
                "512-token chunk, F16",
                large(DType::F16, (8, 4), vec![3512], vec![512], plain),
            ),
            (
                "512-token chunk, Q4_0, window, softcap",
                large(DType::Q4_0, (8, 4), vec![3512], vec![512], (1000, 30.0)),
            ),
            (
                "mixed batch, BF16",
                large(
                    DType::BF16,
                    (8, 4),
                    vec![3000, 1, 700, 2500, 64, 900],
                    vec![300, 1, 1, 1, 64, 40],
                    plain,
                ),
            ),
        ];
        for (name, c) in cases {
            let x = inputs(&c);
            compare(&c, &x, &mut cuda, &mut cpu, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
