//! The block types through the graph on the CPU backend: mul_mat of block-typed weights
//! by F32 activations on both dot paths (against an f64 oracle on the dequantized
//! weights), quantizing and dequantizing casts, and get_rows from a block table; random
//! shapes (whole blocks along dim 0, odd row counts, broadcast batches) and weight rows
//! further apart than their bytes; set_rows into a block-typed state.

use graft::backend::cpu::CpuBackend;
use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferRef, DType, Graph};
use graft::ops::mul_mat::QuantDot;
use graft::quant::{dequantize_row, QType};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::nmse;
use common::quant_blocks::weight_row;

use crate::{common, quant_strategies};

/// Random values with a few outliers, as weights look.
fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x: f32 = rng.random_range(-1.0..1.0);
            if rng.random_bool(0.01) {
                x * 20.0
            } else {
                x
            }
        })
        .collect()
}

/// The quantized bytes of `rows` rows of `k` values, each row `stride` bytes apart (random
/// valid blocks for the types graft only reads), and the dequantized values (what the
/// oracle multiplies).
fn quantized(q: QType, x: &[f32], k: usize, stride: usize) -> (Vec<u8>, Vec<f32>) {
    let rows = x.len() / k;
    let row_bytes = DType::Quant(q).row_bytes(k);
    let mut bytes = vec![0u8; rows * stride];
    let mut deq = vec![0f32; x.len()];
    for r in 0..rows {
        let out = &mut bytes[r * stride..r * stride + row_bytes];
        out.copy_from_slice(&weight_row(q, &x[r * k..(r + 1) * k], r as u64));
        dequantize_row(q, out, &mut deq[r * k..(r + 1) * k]).unwrap();
    }
    (bytes, deq)
}

/// Weights [k, m, a2] of type `q` (rows `pad` blocks apart beyond their bytes) times
/// F32 [k, n, b2] on the CPU with `path`; returns the NMSE against the f64 oracle.
#[allow(clippy::too_many_arguments)]
fn mul_mat_nmse(
    q: QType,
    path: QuantDot,
    k: usize,
    m: usize,
    n: usize,
    a2: usize,
    b2: usize,
    pad: usize,
    seed: u64,
) -> f64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let dt = DType::Quant(q);
    let row_bytes = dt.row_bytes(k);
    let stride = row_bytes + pad * dt.block_bytes();
    let w = values(&mut rng, k * m * a2);
    let (bytes, deq) = quantized(q, &w, k, stride);
    // Activations without outliers (like ggml's op tests): a 20x outlier would make its
    // whole Q8_1 block 20x coarser, which is the Q8_1 path's known weakness, not a bug.
    let x: Vec<f32> = (0..k * n * b2)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut be = CpuBackend::new();
    be.set_quant_dot(path);
    let buf = be.alloc_buffer(bytes.len()).unwrap();
    be.write_buffer(buf, 0, &bytes).unwrap();
    let mut g = Graph::new();
    let r = BufferRef {
        buffer: buf,
        offset: 0,
    };
    // The weight leaf spans every padded row; the product reads a strided view of it.
    let whole = g
        .weight(
            "w",
            dt,
            &[stride / dt.block_bytes() * q.block_size(), m * a2],
            r,
        )
        .unwrap();
    let wv = g.view_3d(whole, k, m, a2, stride, stride * m, 0).unwrap();
    let xin = g.input("x", DType::F32, &[k, n, b2]).unwrap();
    let y = g.mul_mat(wv, xin).unwrap(); // [m, n, b2]
    let plan = g.plan(&[y]).unwrap();
    let e = be.load(&plan).unwrap();
    be.set_input_f32(e, xin, &x).unwrap();
    be.compute(e).unwrap();
    let got = be.get_output_f32(e, y, m * n * b2).unwrap();
    let mut want: Vec<f64> = Vec::with_capacity(m * n * b2);
    for c in 0..b2 {
        let wc = c / (b2 / a2);
        for j in 0..n {
            for i in 0..m {
                let wrow = &deq[(wc * m + i) * k..(wc * m + i + 1) * k];
                let xcol = &x[(c * n + j) * k..(c * n + j + 1) * k];
                want.push(
                    wrow.iter()
                        .zip(xcol)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum(),
                );
            }
        }
    }
    nmse(&got, &want)
}

fn qtype() -> impl Strategy<Value = QType> {
    prop::sample::select(QType::ALL.to_vec())
}

fn quantizable_qtype() -> impl Strategy<Value = QType> {
    prop::sample::select(quant_strategies::quantizable_types())
}

proptest! {
    #![proptest_config(common::config(64))]

    /// mul_mat with block-typed weights, both dot paths: NMSE <= 1e-5 with F32
    /// activations, <= 5e-4 on the Q8_1 path.
    #[test]
    fn prop_mul_mat_quant(
        q in qtype(),
        // At least 16 rows of 2 blocks: with a handful of short dot products, one that
        // nearly cancels would dominate the NMSE's denominator.
        blocks in 2usize..5,
        m in 16usize..40,
        n in 1usize..10,
        batch in prop::sample::select(vec![(1usize, 1usize), (1, 3), (2, 4)]),
        pad in 0usize..2,
        seed in any::<u64>(),
    ) {
        let k = blocks * q.block_size();
        let (a2, b2) = batch;
        let f = mul_mat_nmse(q, QuantDot::F32, k, m, n, a2, b2, pad, seed);
        prop_assert!(f <= 1e-5, "{q} f32 path: NMSE {f:e}");
        let q8 = mul_mat_nmse(q, QuantDot::Q8_1, k, m, n, a2, b2, pad, seed);
        prop_assert!(q8 <= 5e-4, "{q} Q8_1 path: NMSE {q8:e}");
    }

    /// cast F32 -> block type gives graft::quant's bytes; cast back gives its floats;
    /// get_rows from the block table gives the dequantized rows.
    #[test]
    fn prop_cast_and_get_rows_quant(
        q in quantizable_qtype(),
        blocks in 1usize..4,
        rows in 1usize..9,
        seed in any::<u64>(),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let k = blocks * q.block_size();
        let x = values(&mut rng, k * rows);
        let dt = DType::Quant(q);
        let (bytes, deq) = quantized(q, &x, k, dt.row_bytes(k));
        let mut g = Graph::new();
        let xin = g.input("x", DType::F32, &[k, rows]).unwrap();
        let xq = g.cast(xin, dt).unwrap();
        let back = g.cast(xq, DType::F32).unwrap();
        let ids = g.input("ids", DType::I32, &[rows]).unwrap();
        let picked = g.get_rows(xq, ids).unwrap();
        let plan = g.plan(&[xq, back, picked]).unwrap();
        let mut be = CpuBackend::new();
        let e = be.load(&plan).unwrap();
        be.set_input_f32(e, xin, &x).unwrap();
        let order: Vec<i32> = (0..rows as i32).rev().collect();
        be.set_input_i32(e, ids, &order).unwrap();
        be.compute(e).unwrap();
        let mut got_bytes = vec![0u8; bytes.len()];
        be.get_output(e, xq, &mut got_bytes).unwrap();
        prop_assert_eq!(&got_bytes, &bytes);
        prop_assert_eq!(be.get_output_f32(e, back, k * rows).unwrap(), deq.clone());
        let got = be.get_output_f32(e, picked, k * rows).unwrap();
        for (i, &r) in order.iter().enumerate() {
            let r = r as usize;
            prop_assert_eq!(&got[i * k..(i + 1) * k], &deq[r * k..(r + 1) * k]);
        }
    }
}

/// get_rows from a block table of every weight type (the read-only ones too: a llama-quantize
/// mix may store the embedding table as IQ3_S or Q2_K) and a cast of it to F32 or F16,
/// against the reference dequantization.
#[test]
fn prop_get_rows_and_dequantize_every_type() {
    use quant_strategies as qs;
    let cpu = std::cell::RefCell::new(CpuBackend::new());
    let mut runner = proptest::test_runner::TestRunner::new(common::config(128));
    let cases = prop_oneof![qs::get_rows(), qs::dequantize()];
    runner
        .run(&cases, |c| {
            let (dt, bytes) = qs::run(&c, &mut *cpu.borrow_mut())
                .map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
            let got = qs::decode_rows(dt, c.k, &bytes);
            let want = qs::oracle(&c);
            // F32 results are the reference's floats; F16 ones their rounding
            let tol = if dt == DType::F16 { 1e-6 } else { 0.0 };
            let e = qs::nmse(&got, &want);
            prop_assert!(e <= tol, "{c:?}: NMSE {e:e} against the oracle");
            Ok(())
        })
        .unwrap();
}

/// A block type's tensors need whole blocks along dim 0, and views may not move dim 0.
/// set_rows of F32 rows into a block-typed state (a quantized KV cache's write): the
/// written rows are the reference quantization of the inputs, the others untouched.
#[test]
fn prop_set_rows_into_block_table() {
    use quant_strategies as qs;
    let cpu = std::cell::RefCell::new(CpuBackend::new());
    let mut runner = proptest::test_runner::TestRunner::new(common::config(64));
    runner
        .run(&qs::set_rows(qs::quantizable_types()), |c| {
            let (dt, bytes) = qs::run(&c, &mut *cpu.borrow_mut())
                .map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
            let e = qs::nmse(&qs::decode_rows(dt, c.k, &bytes), &qs::oracle(&c));
            prop_assert!(e <= 1e-6, "{c:?}: NMSE {e:e} against the oracle");
            Ok(())
        })
        .unwrap();
}

#[test]
fn block_shapes_are_checked() {
    let mut g = Graph::new();
    let e = g
        .input("x", DType::Q4_K, &[100, 2])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'x'") && e.contains("100") && e.contains("256"),
        "{e}"
    );
    let x = g.input("x", DType::Q4_0, &[64, 2]).unwrap();
    assert!(g.transpose(x).unwrap_err().to_string().contains("q4_0"));
    assert!(g.permute(x, [1, 0, 2, 3]).is_err());
    let e = g.view_2d(x, 48, 1, 36, 0).unwrap_err().to_string();
    assert!(e.contains("48") && e.contains("32"), "{e}");
    let f = g.input("f", DType::F32, &[48, 2]).unwrap();
    assert!(g.cast(f, DType::Q4_0).is_err());
    // the lattice i-quants are read-only: no op writes them
    let f = g.input("f2", DType::F32, &[256, 2]).unwrap();
    let e = g
        .cast(f, DType::Quant(QType::IQ2_XS))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("iq2_xs") && e.contains("importance matrix"),
        "{e}"
    );
    let at = BufferRef {
        buffer: graft::graph::BufferId(0),
        offset: 0,
    };
    let state = g
        .state("s", DType::Quant(QType::IQ1_S), &[256, 2], at)
        .unwrap();
    assert!(g.cpy(f, state).is_err());
    let h = g.input("h", DType::F16, &[64, 3]).unwrap();
    let e = g.mul_mat(x, h).unwrap_err().to_string();
    assert!(e.contains("f16") && e.contains("f32"), "{e}");
}
