//! The quantized block formats against llama.cpp's gguf-py (vectors written by
//! `scripts/make-quant-vectors.py` under tests/fixtures/quant/), and property tests of the
//! round trip and the dot products against f64 oracles.

use graft::quant::dot::dot_dequantized;
use graft::quant::{dequantize_row, quantize_row, vec_dot_f32, vec_dot_q8_1, QType};
use half::f16;
use proptest::prelude::*;
use std::path::PathBuf;

use crate::common;

// ---------------------------------------------------------------------------------------
// Vectors from gguf-py
// ---------------------------------------------------------------------------------------

/// The types gguf-py quantizes (the script's manifest must list at least these).
const GGUF_QUANTIZED: [QType; 7] = [
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::TQ1_0,
    QType::TQ2_0,
];

/// The types gguf-py cannot quantize, whose vectors come from ggml's C reference
/// (`quantize_row_*_ref`, and llama-quantize's `quantize_iq4_nl` / `quantize_iq4_xs`
/// without an importance matrix, compiled by the script with `--ggml-src`).
const GGML_REF_QUANTIZED: [QType; 8] = [
    QType::Q8_1,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
    QType::Q2_K,
    QType::Q3_K,
    QType::IQ4_NL,
    QType::IQ4_XS,
];

/// The types gguf-py dequantizes: all but Q8_1. The lattice types' vectors index every
/// point of their grids.
fn gguf_dequantized() -> impl Iterator<Item = QType> {
    QType::ALL.into_iter().filter(|&q| q != QType::Q8_1)
}

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/make-quant-vectors.py)",
            path.display()
        )
    })
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The manifest's sizes and covered types.
struct Manifest {
    rows: usize,
    cols: usize,
    quantized: Vec<String>,
    quantized_by_ggml_ref: Vec<String>,
    dequantized: Vec<String>,
}

fn manifest() -> Manifest {
    let v: serde_json::Value =
        serde_json::from_slice(&fixture("manifest.json")).expect("manifest.json is JSON");
    let list = |k: &str| -> Vec<String> {
        v[k].as_array()
            .expect("a list")
            .iter()
            .filter_map(|s| s.as_str().map(String::from))
            .collect()
    };
    let size = |k: &str| v[k].as_u64().expect("a size") as usize;
    Manifest {
        rows: size("rows"),
        cols: size("cols"),
        quantized: list("quantized"),
        quantized_by_ggml_ref: list("quantized_by_ggml_ref"),
        dequantized: list("dequantized"),
    }
}

/// The committed quantized rows of `q`, checked for size.
fn gguf_quantized(q: QType, m: &Manifest) -> Vec<u8> {
    let bytes = fixture(&format!("{}.quantized.bin", q.name()));
    assert_eq!(
        bytes.len(),
        m.rows * q.row_bytes(m.cols).expect("whole blocks"),
        "{q}: vector size"
    );
    bytes
}

/// Index of the first block where `a` and `b` differ, with both blocks in hex.
fn first_block_diff(a: &[u8], b: &[u8], block: usize) -> Option<String> {
    a.chunks(block)
        .zip(b.chunks(block))
        .position(|(x, y)| x != y)
        .map(|i| {
            let hex = |s: &[u8]| s.iter().map(|v| format!("{v:02x}")).collect::<String>();
            format!(
                "block {i}: graft {} expected {}",
                hex(&a[i * block..][..block]),
                hex(&b[i * block..][..block])
            )
        })
}

#[test]
fn manifest_covers_the_types_gguf_supports() {
    let m = manifest();
    for q in GGUF_QUANTIZED {
        assert!(
            m.quantized.iter().any(|n| n == q.name()),
            "{q} missing from the quantize vectors"
        );
    }
    for q in GGML_REF_QUANTIZED {
        assert!(
            m.quantized_by_ggml_ref.iter().any(|n| n == q.name()),
            "{q} missing from the quantize vectors of ggml's reference"
        );
    }
    for q in gguf_dequantized() {
        assert!(
            m.dequantized.iter().any(|n| n == q.name()),
            "{q} missing from the dequantize vectors"
        );
    }
}

/// graft's quantization of the vector inputs is byte-equal to the committed vectors of
/// `types` (gguf-py's, or ggml's C reference's).
fn check_quantize_vectors(types: &[QType], source: &str) {
    let m = manifest();
    let x = f32s(&fixture("quantize-inputs.f32"));
    assert_eq!(x.len(), m.rows * m.cols);
    for &q in types {
        let want = gguf_quantized(q, &m);
        let mut got = vec![0u8; want.len()];
        let rb = q.row_bytes(m.cols).expect("whole blocks");
        for (row, out) in x.chunks_exact(m.cols).zip(got.chunks_exact_mut(rb)) {
            quantize_row(q, row, out).expect("sizes match");
        }
        if let Some(d) = first_block_diff(&got, &want, q.block_bytes()) {
            panic!("{q} quantize differs from {source} at {d}");
        }
    }
}

#[test]
fn quantize_gives_gguf_s_bytes() {
    check_quantize_vectors(&GGUF_QUANTIZED, "gguf-py");
}

/// Q8_1, the K-quants and IQ4_NL/IQ4_XS (ggml's scale searches) against ggml's own C.
#[test]
fn quantize_gives_ggml_reference_bytes() {
    check_quantize_vectors(&GGML_REF_QUANTIZED, "ggml's reference");
}

/// gguf-py has no Q8_1; its `d` and quants are Q8_0's (same rule), and `s` is
/// `f16(d * sum(q))` with `d` before its f16 rounding.
#[test]
fn q8_1_quantize_is_q8_0_plus_its_sum() {
    let m = manifest();
    let x = f32s(&fixture("quantize-inputs.f32"));
    let q8_0 = gguf_quantized(QType::Q8_0, &m);
    let mut got = vec![0u8; x.len() / 32 * 36];
    quantize_row(QType::Q8_1, &x, &mut got).expect("sizes match");
    for (i, ((g, w), xb)) in got
        .chunks_exact(36)
        .zip(q8_0.chunks_exact(34))
        .zip(x.chunks_exact(32))
        .enumerate()
    {
        assert_eq!(&g[0..2], &w[0..2], "q8_1 block {i}: d");
        assert_eq!(&g[4..], &w[2..], "q8_1 block {i}: quants");
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let sum: i32 = w[2..].iter().map(|&v| i32::from(v as i8)).sum();
        let s = f16::from_f32(sum as f32 * (amax / 127.0));
        assert_eq!(&g[2..4], &s.to_le_bytes(), "q8_1 block {i}: s");
    }
}

#[test]
fn dequantize_gives_gguf_s_floats() {
    for q in gguf_dequantized() {
        let blocks = fixture(&format!("{}.blocks.bin", q.name()));
        let want = f32s(&fixture(&format!("{}.dequantized.f32", q.name())));
        assert_eq!(
            want.len() / q.block_size() * q.block_bytes(),
            blocks.len(),
            "{q}: vector sizes"
        );
        let mut got = vec![f32::NAN; want.len()];
        dequantize_row(q, &blocks, &mut got).expect("sizes match");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{q} element {i} (block {}): graft {g} gguf {w}",
                i / q.block_size()
            );
        }
    }
}

/// gguf-py has no Q8_1: its blocks with Q8_0's `d` and quants (and any `s`) dequantize to
/// Q8_0's values.
#[test]
fn q8_1_dequantize_matches_gguf_q8_0() {
    let blocks = fixture("q8_0.blocks.bin");
    let want = f32s(&fixture("q8_0.dequantized.f32"));
    let q8_1: Vec<u8> = blocks
        .chunks_exact(34)
        .enumerate()
        .flat_map(|(i, b)| [&b[0..2], &[i as u8, 0x3c], &b[2..]].concat())
        .collect();
    let mut got = vec![f32::NAN; want.len()];
    dequantize_row(QType::Q8_1, &q8_1, &mut got).expect("sizes match");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want));
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

#[test]
fn wrong_lengths_are_errors_naming_the_sizes() {
    for q in QType::ALL {
        let (bs, bb) = (q.block_size(), q.block_bytes());
        let cases: [(usize, usize); 4] = [(bs + 1, bb), (bs, bb + 1), (2 * bs, bb), (bs - 1, 0)];
        for (n, bytes) in cases {
            let x = vec![0.5f32; n];
            let mut buf = vec![0u8; bytes];
            let e = quantize_row(q, &x, &mut buf).expect_err("quantize with wrong sizes");
            let msg = e.to_string();
            assert!(
                msg.contains(q.name()) && msg.contains(&n.to_string()),
                "{q}: {msg}"
            );
            let mut y = vec![0.0f32; n];
            let e = dequantize_row(q, &buf, &mut y).expect_err("dequantize with wrong sizes");
            assert!(e.to_string().contains(&n.to_string()), "{q}: {e}");
        }
        match q.can_quantize() {
            true => assert!(
                quantize_row(q, &[], &mut []).is_ok(),
                "{q}: an empty row is zero blocks"
            ),
            false => {
                let x = vec![0.5f32; bs];
                let e = quantize_row(q, &x, &mut vec![0u8; bb]).expect_err("read-only type");
                assert!(e.to_string().contains("importance matrix"), "{q}: {e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------

/// Bits per quant of each type.
fn bits(q: QType) -> i32 {
    match q {
        QType::IQ1_S | QType::IQ1_M => 1,
        QType::Q2_K
        | QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::TQ1_0
        | QType::TQ2_0 => 2,
        QType::Q3_K | QType::IQ3_XXS | QType::IQ3_S => 3,
        QType::Q4_0 | QType::Q4_1 | QType::Q4_K | QType::IQ4_NL | QType::IQ4_XS => 4,
        QType::Q5_0 | QType::Q5_1 | QType::Q5_K => 5,
        QType::Q6_K => 6,
        QType::Q8_0 | QType::Q8_1 => 8,
    }
}

/// One 32-element group of test values: uniform at a random scale (optionally shifted
/// so that mins matter), with outliers, all equal, all zero, or tiny.
fn group() -> impl Strategy<Value = Vec<f32>> {
    let uniform = (
        prop::collection::vec(-1.0f32..1.0, 32),
        -3i32..=3,
        -1.0f32..1.0,
    )
        .prop_map(|(v, e, shift)| {
            let s = 10f32.powi(e);
            v.into_iter().map(|x| (x + shift) * s).collect()
        });
    let outliers = (
        prop::collection::vec(-1.0f32..1.0, 32),
        prop::collection::vec((0usize..32, -60.0f32..60.0), 1..4),
    )
        .prop_map(|(mut v, out)| {
            for (i, x) in out {
                v[i] = x;
            }
            v
        });
    prop_oneof![
        4 => uniform,
        2 => outliers,
        1 => (-100.0f32..100.0).prop_map(|c| vec![c; 32]),
        1 => Just(vec![0.0f32; 32]),
        1 => prop::collection::vec(-1e-4f32..1e-4, 32),
    ]
}

/// A row of `q`: 1..=8 blocks (1..=3 super-blocks), built from [`group`]s.
fn row(q: QType) -> impl Strategy<Value = Vec<f32>> {
    let groups = q.block_size() / 32;
    let max_blocks: usize = if groups == 1 { 8 } else { 3 };
    (1usize..=max_blocks)
        .prop_flat_map(move |nb| prop::collection::vec(group(), nb * groups))
        .prop_map(|g| g.concat())
}

fn quantize(q: QType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; q.row_bytes(x.len()).expect("whole blocks")];
    quantize_row(q, x, &mut out).expect("sizes match");
    out
}

fn dequantize(q: QType, b: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    dequantize_row(q, b, &mut out).expect("sizes match");
    out
}

/// The largest error the round trip of block `x` may make.
///
/// With `amax` the block's largest magnitude and `b` the type's bits, the step of a
/// symmetric quantizer is `amax / 2^(b-1)` (`amax / 127` for the 8-bit types) and
/// that of an affine one `(max - min) / (2^b - 1)`:
/// - Q8_0/Q8_1, Q4_1, Q5_1 round to the nearest level: half a step;
/// - Q4_0/Q5_0 map the value of largest magnitude to the end level `-2^(b-1)`, so a value
///   of the same magnitude and opposite sign clamps to `2^(b-1) - 1`: one step;
/// - the K-quants: one symmetric step of the super-block's `amax` (sub-block scales are
///   fitted finer, then cost at most their 4- or 6-bit rounding);
/// - TQ1_0/TQ2_0 round `x / amax` to -1, 0, 1: half of `amax`, one 2-bit step;
/// - IQ4_NL/IQ4_XS: two 4-bit steps (their levels are up to 24 / 127 of the scale apart,
///   and the fitted scale may clamp the largest value by as much).
///
/// Plus the f16 rounding of the stored scale and min (`2^-11` relative, `2^-25` absolute
/// when subnormal) times the largest level: for Q4_K, Q5_K, Q6_K and IQ4_XS the largest
/// product of a sub-block's integer scale and a quant (up to 127 * 32), since a tiny
/// super-block's scale can round to zero and take every value of it along.
fn block_bound(q: QType, x: &[f32]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let (min, max) = x
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let half = 2f32.powi(bits(q) - 1);
    let quant = match q {
        QType::Q8_0 | QType::Q8_1 => 0.5 * amax / 127.0,
        QType::Q4_1 | QType::Q5_1 => 0.5 * (max - min) / (2.0 * half - 1.0),
        QType::Q4_0
        | QType::Q5_0
        | QType::Q2_K
        | QType::Q3_K
        | QType::Q4_K
        | QType::Q5_K
        | QType::Q6_K
        | QType::TQ1_0
        | QType::TQ2_0 => amax / half,
        QType::IQ4_NL | QType::IQ4_XS => 2.0 * amax / half,
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M => unreachable!("{q} is read-only: no round trip"),
    };
    let largest = match q {
        QType::Q4_K | QType::Q5_K | QType::Q6_K | QType::IQ4_XS => 4096.0,
        _ => 256.0,
    };
    let f16 = 2.0 * amax * 2f32.powi(-11) + largest * 2f32.powi(-25);
    quant * 1.0001 + f16
}

use common::nmse;

fn check_round_trip(q: QType, x: &[f32]) -> Result<(), TestCaseError> {
    let y = dequantize(q, &quantize(q, x), x.len());
    for (b, (xb, yb)) in x
        .chunks(q.block_size())
        .zip(y.chunks(q.block_size()))
        .enumerate()
    {
        let bound = block_bound(q, xb);
        for (i, (&u, &v)) in xb.iter().zip(yb).enumerate() {
            prop_assert!(
                (u - v).abs() <= bound,
                "{q} block {b} element {i}: {u} -> {v}, error {} > bound {bound}",
                (u - v).abs()
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::config(64))]

    #[test]
    fn prop_round_trip_q4_0(x in row(QType::Q4_0)) { check_round_trip(QType::Q4_0, &x)?; }
    #[test]
    fn prop_round_trip_q4_1(x in row(QType::Q4_1)) { check_round_trip(QType::Q4_1, &x)?; }
    #[test]
    fn prop_round_trip_q5_0(x in row(QType::Q5_0)) { check_round_trip(QType::Q5_0, &x)?; }
    #[test]
    fn prop_round_trip_q5_1(x in row(QType::Q5_1)) { check_round_trip(QType::Q5_1, &x)?; }
    #[test]
    fn prop_round_trip_q8_0(x in row(QType::Q8_0)) { check_round_trip(QType::Q8_0, &x)?; }
    #[test]
    fn prop_round_trip_q8_1(x in row(QType::Q8_1)) { check_round_trip(QType::Q8_1, &x)?; }
    #[test]
    fn prop_round_trip_q4_k(x in row(QType::Q4_K)) { check_round_trip(QType::Q4_K, &x)?; }
    #[test]
    fn prop_round_trip_q5_k(x in row(QType::Q5_K)) { check_round_trip(QType::Q5_K, &x)?; }
    #[test]
    fn prop_round_trip_q6_k(x in row(QType::Q6_K)) { check_round_trip(QType::Q6_K, &x)?; }
    #[test]
    fn prop_round_trip_q2_k(x in row(QType::Q2_K)) { check_round_trip(QType::Q2_K, &x)?; }
    #[test]
    fn prop_round_trip_q3_k(x in row(QType::Q3_K)) { check_round_trip(QType::Q3_K, &x)?; }
    #[test]
    fn prop_round_trip_iq4_nl(x in row(QType::IQ4_NL)) { check_round_trip(QType::IQ4_NL, &x)?; }
    #[test]
    fn prop_round_trip_iq4_xs(x in row(QType::IQ4_XS)) { check_round_trip(QType::IQ4_XS, &x)?; }
    #[test]
    fn prop_round_trip_tq1_0(x in row(QType::TQ1_0)) { check_round_trip(QType::TQ1_0, &x)?; }
    #[test]
    fn prop_round_trip_tq2_0(x in row(QType::TQ2_0)) { check_round_trip(QType::TQ2_0, &x)?; }
}

/// Gaussian values from a seed (Box-Muller over a xorshift generator).
fn gaussian(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        })
        .collect()
}

/// The NMSE bound of Gaussian rows: `c * 4^-(b-1)`, the squared symmetric step at `b` bits
/// relative to an `amax` of about one standard deviation, with `c` a tenth over the worst
/// seen on 40,000 rows of 256 and 512 values, the shortest drawn, whose error varies most
/// (symmetric 0.77, affine 0.64, K-quants 0.55, Q2_K 0.57, Q3_K 0.58, IQ4_NL 0.52, IQ4_XS
/// 0.53, TQ1_0/TQ2_0 3.67). A scale off by a factor of two quadruples the error, past
/// every bound.
fn nmse_bound(q: QType) -> f64 {
    let c = match q {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 | QType::Q8_1 => 0.85,
        QType::Q4_1 | QType::Q5_1 => 0.71,
        QType::Q4_K | QType::Q5_K | QType::Q6_K => 0.61,
        QType::Q2_K | QType::Q3_K | QType::IQ4_NL | QType::IQ4_XS => 0.64,
        // ternary: values below half the largest round to 0 (about 0.68 on these rows)
        QType::TQ1_0 | QType::TQ2_0 => 4.05,
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M => unreachable!("{q} is read-only: no round trip"),
    };
    c * 4f64.powi(-(bits(q) - 1))
}

proptest! {
    #![proptest_config(common::config(64))]

    #[test]
    fn prop_gaussian_nmse(seed in any::<u64>(), units in 1usize..=8) {
        for q in QType::ALL.into_iter().filter(|q| q.can_quantize()) {
            let x = gaussian(seed, 256 * units);
            let e = nmse(&dequantize(q, &quantize(q, &x), x.len()), &x);
            prop_assert!(e <= nmse_bound(q), "{q}: NMSE {e:.3e} > {:.3e}", nmse_bound(q));
        }
    }
}

/// The weight row of `q` for the values `w`: quantized, or for the read-only types
/// random blocks of `w`'s magnitude (seeded by `w`).
fn weights(q: QType, w: &[f32]) -> Vec<u8> {
    let seed = w.iter().fold(w.len() as u64, |h, v| {
        h.rotate_left(5) ^ u64::from(v.to_bits())
    });
    common::quant_blocks::weight_row(q, w, seed)
}

/// A weight row of `q` and an activation row of the same length.
fn dot_case(q: QType) -> impl Strategy<Value = (Vec<f32>, Vec<f32>)> {
    row(q).prop_flat_map(|w| {
        let n = w.len() / 32;
        (
            Just(w),
            prop::collection::vec(group(), n).prop_map(|g| g.concat()),
        )
    })
}

/// `vec_dot_q8_1` against the f64 dot of the dequantized weights and the dequantized
/// Q8_1 activations. It differs from that dot where it applies a weight block's offset
/// (at most twice the block's largest magnitude `W`) through the Q8_1 block's `s` instead
/// of `d * sum(q)`: `s` is rounded to f16 (`2^-11` relative, `2^-25` absolute) and was
/// computed with `d` before its own f16 rounding (another `2^-11`), so by at most
/// `2 * W * (2^-10 * A + 2^-25 * (1 + 32 * 127))` per block, with `A` the Q8_1 block's
/// sum of magnitudes (the `2^-25` terms: f16 subnormals, for `d` times up to `32 * 127`);
/// and by the f32 rounding of the per-block terms (`2^-20 * W * A`) and of their sum.
fn check_dot_q8_1(q: QType, w: &[f32], a: &[f32]) -> Result<(), TestCaseError> {
    let wq = weights(q, w);
    let aq = quantize(QType::Q8_1, a);
    let (wd, ad) = (
        dequantize(q, &wq, w.len()),
        dequantize(QType::Q8_1, &aq, a.len()),
    );
    let got = vec_dot_q8_1(q, &wq, &aq);
    let exact: f64 = wd
        .iter()
        .zip(&ad)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum();
    let mut tol = 1e-30;
    for (wb, ab) in wd.chunks(q.block_size()).zip(ad.chunks(q.block_size())) {
        let wmax = wb.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
        for g in ab.chunks(32) {
            let asum: f64 = g.iter().map(|&v| f64::from(v).abs()).sum();
            tol +=
                2.0 * wmax * (asum * (2f64.powi(-10) + 2f64.powi(-20)) + 2f64.powi(-25) * 4065.0);
        }
    }
    let abs: f64 = wd
        .iter()
        .zip(&ad)
        .map(|(&x, &y)| (f64::from(x) * f64::from(y)).abs())
        .sum();
    tol += 1e-5 * abs;
    prop_assert!(
        (f64::from(got) - exact).abs() <= tol,
        "{q} n={}: vec_dot_q8_1 {got} vs exact {exact}, tolerance {tol:.3e}",
        w.len()
    );
    Ok(())
}

/// `vec_dot_f32` against the f64 dot of the dequantized weights and `x`: f32 products
/// and sums of `n` terms, within `n * 2^-24` of the sum of magnitudes.
fn check_dot_f32(q: QType, w: &[f32], x: &[f32]) -> Result<(), TestCaseError> {
    let wq = weights(q, w);
    let wd = dequantize(q, &wq, w.len());
    let got = vec_dot_f32(q, &wq, x);
    let exact: f64 = wd
        .iter()
        .zip(x)
        .map(|(&u, &v)| f64::from(u) * f64::from(v))
        .sum();
    let abs: f64 = wd
        .iter()
        .zip(x)
        .map(|(&u, &v)| (f64::from(u) * f64::from(v)).abs())
        .sum();
    let tol = (x.len() as f64 + 2.0) * 2f64.powi(-24) * abs + 1e-30;
    prop_assert!(
        (f64::from(got) - exact).abs() <= tol,
        "{q} n={}: vec_dot_f32 {got} vs exact {exact}, tolerance {tol:.3e}",
        w.len()
    );
    // a product of several columns dequantizes the row once: the same sums, the same bits
    let once = dot_dequantized(&wd, x);
    prop_assert!(
        once.to_bits() == got.to_bits(),
        "{q} n={}: dot_dequantized {once} vs vec_dot_f32 {got}",
        w.len()
    );
    Ok(())
}

proptest! {
    #![proptest_config(common::config(64))]

    #[test]
    fn prop_dot_q4_0((w, a) in dot_case(QType::Q4_0)) {
        check_dot_q8_1(QType::Q4_0, &w, &a)?;
        check_dot_f32(QType::Q4_0, &w, &a)?;
    }
    #[test]
    fn prop_dot_q4_1((w, a) in dot_case(QType::Q4_1)) {
        check_dot_q8_1(QType::Q4_1, &w, &a)?;
        check_dot_f32(QType::Q4_1, &w, &a)?;
    }
    #[test]
    fn prop_dot_q5_0((w, a) in dot_case(QType::Q5_0)) {
        check_dot_q8_1(QType::Q5_0, &w, &a)?;
        check_dot_f32(QType::Q5_0, &w, &a)?;
    }
    #[test]
    fn prop_dot_q5_1((w, a) in dot_case(QType::Q5_1)) {
        check_dot_q8_1(QType::Q5_1, &w, &a)?;
        check_dot_f32(QType::Q5_1, &w, &a)?;
    }
    #[test]
    fn prop_dot_q8_0((w, a) in dot_case(QType::Q8_0)) {
        check_dot_q8_1(QType::Q8_0, &w, &a)?;
        check_dot_f32(QType::Q8_0, &w, &a)?;
    }
    #[test]
    fn prop_dot_q8_1((w, a) in dot_case(QType::Q8_1)) {
        check_dot_q8_1(QType::Q8_1, &w, &a)?;
        check_dot_f32(QType::Q8_1, &w, &a)?;
    }
    #[test]
    fn prop_dot_q4_k((w, a) in dot_case(QType::Q4_K)) {
        check_dot_q8_1(QType::Q4_K, &w, &a)?;
        check_dot_f32(QType::Q4_K, &w, &a)?;
    }
    #[test]
    fn prop_dot_q5_k((w, a) in dot_case(QType::Q5_K)) {
        check_dot_q8_1(QType::Q5_K, &w, &a)?;
        check_dot_f32(QType::Q5_K, &w, &a)?;
    }
    #[test]
    fn prop_dot_q6_k((w, a) in dot_case(QType::Q6_K)) {
        check_dot_q8_1(QType::Q6_K, &w, &a)?;
        check_dot_f32(QType::Q6_K, &w, &a)?;
    }
}

/// The low-bit K-quants, the i-quants and the ternary types (the others have a test
/// each above): a type drawn with each case.
fn new_type() -> impl Strategy<Value = QType> {
    let older = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q8_1,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
    ];
    let types: Vec<QType> = QType::ALL
        .into_iter()
        .filter(|q| !older.contains(q))
        .collect();
    prop::sample::select(types)
}

proptest! {
    #![proptest_config(common::config(256))]

    #[test]
    fn prop_dot_k_and_i_quants((q, (w, a)) in new_type().prop_flat_map(|q| (Just(q), dot_case(q)))) {
        check_dot_q8_1(q, &w, &a)?;
        check_dot_f32(q, &w, &a)?;
    }
}
