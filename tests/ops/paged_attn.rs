//! paged_attn on the CPU backend against an f64 oracle written here (a plain softmax over
//! each query's visible positions, keys found through the block table): random block
//! tables, sequence lengths, decode and prefill-chunk queries, padding, GQA, windows and
//! every cache type (the cases live in `common/paged.rs`, shared with the CUDA test), and
//! decode steps over F16 pools alone;
//! non-finite input; bad tables and positions; builder errors.

use crate::common;
use crate::common::nmse;
use crate::common::paged::{case, inputs, oracle, poison, run, Case};
use graft::backend::cpu::CpuBackend;
use graft::graph::{DType, Graph, PagedAttnParams};
use proptest::prelude::*;

proptest! {
    #![proptest_config(common::config(64))]

    /// The CPU reference against the f64 oracle on the same (rounded or dequantized)
    /// K/V values: only f32 arithmetic separates them.
    #[test]
    fn prop_paged_attn(c in case()) {
        let x = inputs(&c);
        let got = run(&c, &x, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
        let want = oracle(&c, &x);
        prop_assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
        let e = nmse(&got, &want);
        prop_assert!(e <= 1e-9, "NMSE {e:e}");
    }

    /// Decode steps over F16 pools (on x86-64 with AVX2, FMA and F16C the keys' raw rows
    /// go to flash_attn_ext's decode kernel): windows, softcapping, GQA and padding as
    /// above, every sequence with at most one query.
    #[test]
    fn prop_paged_attn_decode_f16(c in case()
        .prop_map(|mut c| {
            (c.k, c.v) = (DType::F16, DType::F16);
            c.queries.iter_mut().for_each(|q| *q = (*q).min(1));
            c
        })
        .prop_filter("a batch of at least one token", |c| {
            c.padding + c.queries.iter().sum::<usize>() > 0
        }))
    {
        let x = inputs(&c);
        let got = run(&c, &x, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
        let e = nmse(&got, &oracle(&c, &x));
        prop_assert!(e <= 1e-9, "NMSE {e:e}");
    }
}

/// A small fixed case: two sequences (one decoding, one with a chunk of 5), padding.
fn small(k: DType) -> Case {
    Case {
        d: 32,
        n_head_kv: 2,
        group: 2,
        k,
        v: k,
        p: PagedAttnParams {
            scale: 0.2,
            softcap: 0.0,
            block_size: 16,
            window: 0,
        },
        n_blocks: 6,
        max_blocks: 3,
        lens: vec![20, 37],
        queries: vec![1, 5],
        padding: 2,
        shuffle: false,
        seed: 7,
    }
}

/// Padding rows are exactly zero; every other row matches the oracle.
#[test]
fn padding_rows_are_zero() {
    let c = small(DType::F16);
    let x = inputs(&c);
    let got = run(&c, &x, &mut CpuBackend::new()).unwrap();
    let row = c.d * c.n_head();
    for (t, s) in x.seqs.chunks(2).enumerate() {
        let out = &got[t * row..(t + 1) * row];
        if s[0] < 0 {
            assert!(out.iter().all(|&v| v == 0.0), "padding token {t}");
        } else {
            assert!(out.iter().any(|&v| v != 0.0), "token {t}");
        }
    }
    assert!(nmse(&got, &oracle(&c, &x)) <= 1e-9);
}

/// A NaN in a query, in a visible K row or in a visible V row makes exactly the rows
/// that see it NaN, for every cache type; a NaN in a position no query sees changes
/// nothing.
#[test]
fn non_finite_input_is_never_finite_output() {
    for dt in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
    ] {
        let c = small(dt);
        let clean = inputs(&c);
        let base = run(&c, &clean, &mut CpuBackend::new()).unwrap();
        let row = c.d * c.n_head();
        let n_kv_dim = c.d * c.n_head_kv;
        let bs = c.p.block_size;
        // token 0 is sequence 0's decode query at position 19 (padding may come first)
        let t0 = clean.seqs.chunks(2).position(|s| s[0] == 0).unwrap();
        // 1. a NaN in token t0's query (head 1): head 1's row of t0 only
        let mut x = inputs(&c);
        x.q[t0 * row + c.d + 3] = f32::NAN;
        let got = run(&c, &x, &mut CpuBackend::new()).unwrap();
        for (i, (&a, &b)) in got.iter().zip(&base).enumerate() {
            let poisoned = i / c.d == t0 * c.n_head() + 1;
            assert_eq!(a.is_nan(), poisoned, "{dt} query NaN, element {i}");
            if !poisoned {
                assert_eq!(a, b, "{dt} element {i} changed");
            }
        }
        // 2. a NaN in sequence 0's K at position 4 (KV head 0): heads 0 and 1 of t0
        // 3. a NaN in its V at position 4 (KV head 1): heads 2 and 3 of t0
        for (which, hk) in [("K", 0usize), ("V", 1)] {
            let mut x = inputs(&c);
            let slot = x.table[4 / bs] as usize * bs + 4 % bs;
            let bytes = if which == "K" {
                &mut x.k_bytes
            } else {
                &mut x.v_bytes
            };
            poison(bytes, dt, slot * n_kv_dim + hk * c.d + 5);
            let got = run(&c, &x, &mut CpuBackend::new()).unwrap();
            for h in 0..c.n_head() {
                let r = &got[(t0 * c.n_head() + h) * c.d..][..c.d];
                let sees = h / c.group == hk;
                assert_eq!(
                    r.iter().any(|v| v.is_nan()),
                    sees,
                    "{dt} {which} NaN, head {h}"
                );
            }
        }
    }
}

/// An infinity in a query makes its row NaN with softcapping too, which would otherwise
/// cap the infinite scores to finite ones.
#[test]
fn an_infinite_query_is_a_nan_row_with_softcapping() {
    let mut c = small(DType::F32);
    c.p.softcap = 2.5;
    let mut x = inputs(&c);
    let t0 = x.seqs.chunks(2).position(|s| s[0] == 0).unwrap();
    let row = c.d * c.n_head();
    x.q[t0 * row + 3] = f32::INFINITY;
    let got = run(&c, &x, &mut CpuBackend::new()).unwrap();
    for (h, r) in got[t0 * row..(t0 + 1) * row].chunks(c.d).enumerate() {
        assert_eq!(r.iter().all(|v| v.is_nan()), h == 0, "head {h}");
    }
}

/// A block id outside the pool, a sequence outside the table and a position past the
/// table are index errors naming the op; builder errors name the operands.
#[test]
fn bad_tables_and_shapes_are_errors() {
    let c = small(DType::F32);
    let mut x = inputs(&c);
    x.table[1] = c.n_blocks as i32;
    let e = run(&c, &x, &mut CpuBackend::new()).unwrap_err();
    assert!(
        e.contains("paged_attn") && e.contains(&c.n_blocks.to_string()),
        "{e}"
    );
    for (field, value) in [(0usize, 2i32), (1, 3 * 16)] {
        let mut x = inputs(&c);
        let t = x.seqs.chunks(2).position(|s| s[0] >= 0).unwrap();
        x.seqs[2 * t + field] = value;
        let e = run(&c, &x, &mut CpuBackend::new()).unwrap_err();
        assert!(e.contains("paged_attn"), "{e}");
    }

    let mut g = Graph::new();
    let q = g.input("q", DType::F32, &[64, 4, 3]).unwrap();
    let k = g.input("k", DType::F16, &[64, 32, 2]).unwrap();
    let v = g.input("v", DType::F16, &[64, 32, 2]).unwrap();
    let table = g.input("table", DType::I32, &[2, 2]).unwrap();
    let seqs = g.input("seqs", DType::I32, &[2, 3]).unwrap();
    let p = PagedAttnParams {
        scale: 0.125,
        softcap: 0.0,
        block_size: 16,
        window: 0,
    };
    assert!(g.paged_attn(q, (k, v), table, seqs, p).is_ok());
    let bad_seqs = g.input("bad_seqs", DType::I32, &[2, 4]).unwrap();
    let e = g.paged_attn(q, (k, v), table, bad_seqs, p).unwrap_err();
    assert!(e.to_string().contains("bad_seqs"), "{e}");
    let odd = PagedAttnParams {
        block_size: 24,
        ..p
    };
    let e = g.paged_attn(q, (k, v), table, seqs, odd).unwrap_err();
    assert!(e.to_string().contains("whole blocks of 24"), "{e}");
    let q3 = g.input("q3", DType::F32, &[64, 3, 3]).unwrap();
    let e = g.paged_attn(q3, (k, v), table, seqs, p).unwrap_err();
    assert!(e.to_string().contains("multiple of the KV heads"), "{e}");
}
