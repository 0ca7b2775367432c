//! The quantized block formats against llama.cpp's gguf-py (vectors written by
//! `scripts/make-quant-vectors.py` under tests/fixtures/quant/), and property tests of the
//! round trip and the dot products against f64 oracles.

mod common;

use graft::quant::{dequantize_row, quantize_row, vec_dot_f32, vec_dot_q8_1, QType};
use half::f16;
use proptest::prelude::*;
use std::path::PathBuf;

// ---------------------------------------------------------------------------------------
// Vectors from gguf-py
// ---------------------------------------------------------------------------------------

/// The types gguf-py quantizes (the script's manifest must list at least these).
const GGUF_QUANTIZED: [QType; 5] = [
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
];

/// The types gguf-py dequantizes.
const GGUF_DEQUANTIZED: [QType; 8] = [
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
];

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
        dequantized: list("dequantized"),
    }
}

/// The gguf-quantized rows of `q`, checked for size.
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
                "block {i}: graft {} gguf {}",
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
    for q in GGUF_DEQUANTIZED {
        assert!(
            m.dequantized.iter().any(|n| n == q.name()),
            "{q} missing from the dequantize vectors"
        );
    }
}

#[test]
fn quantize_gives_gguf_s_bytes() {
    let m = manifest();
    let x = f32s(&fixture("quantize-inputs.f32"));
    assert_eq!(x.len(), m.rows * m.cols);
    for q in GGUF_QUANTIZED {
        let want = gguf_quantized(q, &m);
        let mut got = vec![0u8; want.len()];
        let rb = q.row_bytes(m.cols).expect("whole blocks");
        for (row, out) in x.chunks_exact(m.cols).zip(got.chunks_exact_mut(rb)) {
            quantize_row(q, row, out).expect("sizes match");
        }
        if let Some(d) = first_block_diff(&got, &want, q.block_bytes()) {
            panic!("{q} quantize differs from gguf at {d}");
        }
    }
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
    for q in GGUF_DEQUANTIZED {
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
        assert!(
            quantize_row(q, &[], &mut []).is_ok(),
            "{q}: an empty row is zero blocks"
        );
    }
}
