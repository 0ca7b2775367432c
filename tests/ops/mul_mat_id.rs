//! mul_mat_id on the CPU against the f64 oracle of ggml's definition
//! (`tests/common/moe.rs`): random shapes, ids with repeats and unused experts, shared or
//! per-expert inputs, strided inputs, every weight dtype and both dot paths of block
//! types; ids outside the experts are index errors.

use graft::backend::cpu::CpuBackend;
use graft::graph::DType;
use graft::ops::mul_mat::QuantDot;
use graft::Error;
use proptest::prelude::*;

use crate::common::{config, nmse};
use crate::moe;

proptest! {
    #![proptest_config(config(96))]

    #[test]
    fn mul_mat_id_matches_the_oracle(c in moe::cases()) {
        let scale = moe::magnitudes(&c);
        for path in [QuantDot::Q8_1, QuantDot::F32] {
            // Block types on the Q8_1 path multiply Q8_1 activations: the oracle rounds
            // them the same way, and what remains is the rounding of their F16 block
            // sums (used by the types with an offset), at most about 2^-11 of each
            // output's terms (see moe::magnitudes). Elsewhere only the f32 sums' rounding
            // differs.
            let q8 = path == QuantDot::Q8_1 && c.dtype.quant().is_some();
            let want = moe::oracle(&c, q8);
            let mut be = CpuBackend::new();
            be.set_quant_dot(path);
            let got = moe::run(&c, &mut be).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let got: Vec<f64> = got.iter().map(|&v| f64::from(v)).collect();
            let rel = if q8 { 2e-3 } else { 1e-5 };
            for (j, ((g, w), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                prop_assert!((g - w).abs() <= rel * s, "{c:?} {path:?}: output {j} is {g}, expected {w} (terms {s})");
            }
            let e = nmse(&got, &want);
            prop_assert!(q8 || e <= 1e-9, "{c:?} {path:?}: NMSE {e:e}");
        }
    }
}

/// Each column is its own expert's product: an expert used twice by one token gives the
/// same column twice (with a shared input), and the result does not depend on which
/// other experts a token picked.
#[test]
fn repeated_ids_give_equal_columns() {
    let mut c = moe::MoeCase {
        dtype: DType::F32,
        k: 40,
        m: 5,
        n_expert: 4,
        n_used: 3,
        b1: 1,
        n_tokens: 2,
        b_pad: 0,
        w_offset: 0,
        ids: vec![2, 2, 0, 3, 1, 2],
        seed: 11,
    };
    let got = moe::run(&c, &mut CpuBackend::new()).unwrap();
    assert_eq!(got[0..5], got[5..10]);
    c.ids = vec![2, 1, 1, 0, 0, 0];
    let other = moe::run(&c, &mut CpuBackend::new()).unwrap();
    assert_eq!(got[0..5], other[0..5], "token 0's first expert, 2 in both");
    assert_ne!(got[5..10], other[5..10]);
}

#[test]
fn ids_outside_the_experts_are_index_errors() {
    for bad in [4, -1, i32::MAX] {
        let c = moe::MoeCase {
            dtype: DType::Q8_0,
            k: 32,
            m: 3,
            n_expert: 4,
            n_used: 2,
            b1: 2,
            n_tokens: 3,
            b_pad: 0,
            w_offset: 0,
            ids: vec![0, 1, 2, 3, bad, 0],
            seed: 5,
        };
        match moe::run(&c, &mut CpuBackend::new()) {
            Err(Error::IndexOutOfRange {
                op,
                index,
                limit,
                position,
                ..
            }) => {
                assert_eq!(
                    (op, index, limit, position),
                    ("mul_mat_id", bad as i64, 4, 2)
                );
            }
            other => panic!("id {bad}: {other:?}"),
        }
    }
}

/// Operands that do not fit ggml's shapes or types are refused by the builder, naming
/// them.
#[test]
fn builder_refuses_what_does_not_fit() {
    use graft::graph::Graph;
    let mut g = Graph::new();
    let w = g.input("experts", DType::F32, &[8, 4, 3]).unwrap();
    let x = g.input("x", DType::F32, &[8, 2, 5]).unwrap();
    let ids = g.input("ids", DType::I32, &[2, 5]).unwrap();
    assert!(g.mul_mat_id(w, x, ids).is_ok());
    let bad = [
        ("x", g.input("x7", DType::F32, &[7, 2, 5]).unwrap(), ids),
        ("x3", g.input("x3", DType::F32, &[8, 3, 5]).unwrap(), ids),
        ("ids", x, g.input("ids4", DType::I32, &[2, 4]).unwrap()),
        ("ids", x, g.input("idsf", DType::F32, &[2, 5]).unwrap()),
    ];
    for (what, x, ids) in bad {
        let err = g.mul_mat_id(w, x, ids).unwrap_err().to_string();
        assert!(err.contains("mul_mat_id") && err.contains(what), "{err}");
    }
    let q = g.input("xq", DType::F16, &[32, 1, 5]).unwrap();
    let wq = g.input("wq", DType::Q8_0, &[32, 4, 3]).unwrap();
    let err = g.mul_mat_id(wq, q, ids).unwrap_err().to_string();
    assert!(err.contains("xq"), "{err}");
}
