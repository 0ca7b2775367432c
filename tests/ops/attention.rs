//! flash_attn_ext on the CPU backend against an f64 oracle written here (a plain softmax
//! over the whole score row, not the online one): random head dims from the supported
//! list, query and key counts that are not multiples of any tile, GQA ratios 1, 2, 4, 8,
//! causal and arbitrary masks with fully masked rows, softcapping and ALiBi on and off,
//! K/V as views into a larger cache at an offset, F32/F16/BF16/Q8_0/Q4_0 K/V (the cases
//! live in `common/attention.rs`, shared with the CUDA test in `tests/cuda/ops_cuda.rs`),
//! and with a NaN or an infinity in q, K or V, which must reach exactly the rows that see
//! it.

use common::attention::{case, check_expectations, poisoned_case, run, Case, MaskKind};
use common::nmse;
use graft::backend::cpu::CpuBackend;
use graft::graph::{DType, FlashAttnParams, Graph};
use proptest::prelude::*;

use crate::common;

proptest! {
    #![proptest_config(common::config(48))]

    /// The CPU reference against the f64 oracle on the same (rounded or dequantized)
    /// K/V values: only f32 arithmetic separates them.
    #[test]
    fn prop_flash_attn_ext(c in case()) {
        let r = run(&c, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
        let (got, want) = (r.got, r.want);
        prop_assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
        let e = nmse(&got, &want);
        prop_assert!(e <= 1e-9, "NMSE {e:e}");
    }
}

proptest! {
    #![proptest_config(common::config(48))]

    /// Decode steps on an F16 cache (at most 8 query rows): the CPU's AVX2 decode kernel
    /// where the CPU has one (K/V read in place, GQA rows sharing each key, key runs
    /// merged), against the same f64 oracle.
    #[test]
    fn prop_flash_attn_ext_decode_f16(c in case().prop_map(|mut c| {
        c.kv = DType::F16;
        c.n_q = c.n_q.min(8);
        c
    })) {
        let r = run(&c, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
        prop_assert!(r.got.iter().all(|x| x.is_finite()), "non-finite output");
        let e = nmse(&r.got, &r.want);
        prop_assert!(e <= 1e-9, "NMSE {e:e}");
    }
}

proptest! {
    #![proptest_config(common::config(64))]

    /// A NaN or an infinity in one element of q, or of a K or V row (written before the
    /// cache type's rounding or quantization: a quantized block holding it has a NaN
    /// scale): every row that sees it is non-finite, every row that does not is finite
    /// and as the oracle, a fully masked row gives zeros even with a NaN query. A row of
    /// NaN scores used to be taken for a fully masked one and give zeros.
    #[test]
    fn prop_non_finite_inputs_give_non_finite_rows(c in poisoned_case(case())) {
        let r = run(&c, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
        check_expectations(&c, &r, 1e-9).map_err(TestCaseError::fail)?;
    }

    /// The same through the AVX2 decode kernel (F16 cache, at most 8 query rows).
    #[test]
    fn prop_non_finite_inputs_give_non_finite_rows_decode_f16(
        c in poisoned_case(case().prop_map(|mut c| {
            c.kv = DType::F16;
            c.n_q = c.n_q.min(8);
            c
        }))
    ) {
        let r = run(&c, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
        check_expectations(&c, &r, 1e-9).map_err(TestCaseError::fail)?;
    }
}

/// Fully masked rows give zeros; builder errors name the operands.
#[test]
fn masked_rows_and_errors() {
    let c = Case {
        d: 64,
        n_q: 3,
        n_kv: 5,
        n_head_kv: 1,
        group: 2,
        batch: 1,
        ctx: 5,
        first: 0,
        kv: DType::F32,
        mask: MaskKind::Arbitrary,
        mask_f16: false,
        mask_pad: 0,
        mask_heads: 1,
        p: FlashAttnParams {
            scale: 0.125,
            max_bias: 0.0,
            softcap: 0.0,
        },
        seed: 7,
        poison: None,
    };
    let r = run(&c, &mut CpuBackend::new()).unwrap();
    assert!(nmse(&r.got, &r.want) <= 1e-9);

    let mut g = Graph::new();
    let p = FlashAttnParams {
        scale: 0.1,
        max_bias: 0.0,
        softcap: 0.0,
    };
    let q = g.input("q", DType::F32, &[64, 4, 6]).unwrap();
    let k = g.input("k", DType::F16, &[64, 10, 4]).unwrap();
    let v = g.input("v", DType::F16, &[64, 10, 4]).unwrap();
    let e = g.flash_attn_ext(q, k, v, None, p).unwrap_err().to_string();
    assert!(
        e.contains("multiple of the KV heads") && e.contains("'q'"),
        "{e}"
    );
    let k2 = g.input("k2", DType::F16, &[32, 10, 2]).unwrap();
    let e = g.flash_attn_ext(q, k2, v, None, p).unwrap_err().to_string();
    assert!(e.contains("head sizes"), "{e}");
    let k3 = g.input("k3", DType::F16, &[64, 10, 2]).unwrap();
    let v3 = g.input("v3", DType::F16, &[64, 10, 2]).unwrap();
    let m = g.input("m", DType::F32, &[9, 4]).unwrap();
    let e = g
        .flash_attn_ext(q, k3, v3, Some(m), p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("mask 'm'"), "{e}");
    let qi = g.input("qi", DType::I32, &[64, 4, 6]).unwrap();
    assert!(g.flash_attn_ext(qi, k3, v3, None, p).is_err());
    let bad = FlashAttnParams { softcap: -1.0, ..p };
    assert!(g.flash_attn_ext(q, k3, v3, None, bad).is_err());
    let y = g.flash_attn_ext(q, k3, v3, None, p).unwrap();
    assert_eq!(g.tensor(y).ne, [64, 6, 4, 1]);
}
