//! flash_attn_ext on the CPU backend against an f64 oracle written here (a plain softmax
//! over the whole score row, not the online one): random head dims from the supported
//! list, query and key counts that are not multiples of any tile, GQA ratios 1, 2, 4, 8,
//! causal and arbitrary masks with fully masked rows, softcapping and ALiBi on and off,
//! K/V as views into a larger cache at an offset, F32/F16/BF16/Q8_0/Q4_0 K/V.

mod common;

use graft::backend::cpu::CpuBackend;
use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferRef, DType, FlashAttnParams, Graph};
use graft::quant::{dequantize_row, quantize_row};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Head sizes the kernels are written for.
const HEAD_DIMS: [usize; 6] = [64, 80, 96, 112, 128, 256];

/// One drawn case.
#[derive(Clone, Debug)]
struct Case {
    d: usize,
    n_q: usize,
    n_kv: usize,
    n_head_kv: usize,
    group: usize,
    batch: usize,
    /// Keys of the cache the K/V views live in (>= n_kv), and the first key viewed.
    ctx: usize,
    first: usize,
    kv: DType,
    mask: MaskKind,
    p: FlashAttnParams,
    seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum MaskKind {
    None,
    /// Query `i` sees keys `0..=n_kv - n_q + i`.
    Causal,
    /// Random entries of -inf (some rows entirely) and small biases.
    Arbitrary,
}

/// Values of `n` elements of `dt` as the backend stores them, and as f64 after the
/// rounding or quantization (what the oracle multiplies). Rows of `row` elements.
fn kv_values(rng: &mut StdRng, dt: DType, n: usize, row: usize) -> (Vec<u8>, Vec<f64>) {
    let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    match dt.quant() {
        Some(q) => {
            let rb = dt.row_bytes(row);
            let mut bytes = vec![0u8; n / row * rb];
            let mut back = vec![0f32; n];
            for (r, (xr, br)) in x.chunks(row).zip(bytes.chunks_mut(rb)).enumerate() {
                quantize_row(q, xr, br).unwrap();
                dequantize_row(q, br, &mut back[r * row..(r + 1) * row]).unwrap();
            }
            (bytes, back.iter().map(|&v| v as f64).collect())
        }
        None => {
            let bytes: Vec<u8> = x
                .iter()
                .flat_map(|&v| common::case::encode_value(dt, v))
                .collect();
            let vals = bytes
                .chunks(dt.block_bytes())
                .map(|c| common::case::decode_value(dt, c))
                .collect();
            (bytes, vals)
        }
    }
}

/// The mask [n_kv, n_q] of a case (F32 values; -inf hides a key).
fn mask_values(c: &Case, rng: &mut StdRng) -> Vec<f32> {
    let mut m = vec![0f32; c.n_kv * c.n_q];
    for i in 0..c.n_q {
        let fully_masked = c.mask == MaskKind::Arbitrary && rng.random_bool(0.1);
        for j in 0..c.n_kv {
            m[i * c.n_kv + j] = match c.mask {
                MaskKind::None => 0.0,
                MaskKind::Causal if j + c.n_q > c.n_kv + i => f32::NEG_INFINITY,
                MaskKind::Causal => 0.0,
                MaskKind::Arbitrary if fully_masked || rng.random_bool(0.3) => f32::NEG_INFINITY,
                MaskKind::Arbitrary => rng.random_range(-2.0..2.0),
            };
        }
    }
    m
}

/// The f64 oracle: result [d, n_head, n_q, batch].
fn oracle(c: &Case, q: &[f64], k: &[f64], v: &[f64], mask: &[f32]) -> Vec<f64> {
    let n_head = c.n_head_kv * c.group;
    let mut out = vec![0f64; c.d * n_head * c.n_q * c.batch];
    for b in 0..c.batch {
        for h in 0..n_head {
            let hk = h / c.group;
            let slope = c.p.slope(h, n_head) as f64;
            for i in 0..c.n_q {
                let qrow = &q[((b * n_head + h) * c.n_q + i) * c.d..][..c.d];
                let scores: Vec<f64> = (0..c.n_kv)
                    .map(|j| {
                        let key = &k[((b * c.n_head_kv + hk) * c.ctx + c.first + j) * c.d..][..c.d];
                        let mut s = c.p.scale as f64
                            * qrow.iter().zip(key).map(|(x, y)| x * y).sum::<f64>();
                        if c.p.softcap > 0.0 {
                            let cap = c.p.softcap as f64;
                            s = cap * (s / cap).tanh();
                        }
                        match c.mask {
                            MaskKind::None => s,
                            MaskKind::Causal | MaskKind::Arbitrary => {
                                s + slope * mask[i * c.n_kv + j] as f64
                            }
                        }
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let o = &mut out[((b * c.n_q + i) * n_head + h) * c.d..][..c.d];
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for (j, wj) in w.iter().enumerate() {
                    let val = &v[((b * c.n_head_kv + hk) * c.ctx + c.first + j) * c.d..][..c.d];
                    for (a, x) in o.iter_mut().zip(val) {
                        *a += wj / sum * x;
                    }
                }
            }
        }
    }
    out
}

/// Runs a case on the CPU backend; returns the result and the oracle's.
fn run(c: &Case) -> (Vec<f32>, Vec<f64>) {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let n_head = c.n_head_kv * c.group;
    let q: Vec<f32> = (0..c.d * c.n_q * n_head * c.batch)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let cache = c.d * c.ctx * c.n_head_kv * c.batch;
    let (kb, kf) = kv_values(&mut rng, c.kv, cache, c.d);
    let (vb, vf) = kv_values(&mut rng, c.kv, cache, c.d);
    let mask = mask_values(c, &mut rng);
    let mut be = CpuBackend::new();
    let mut g = Graph::new();
    let view = |g: &mut Graph, be: &mut CpuBackend, name: &str, bytes: &[u8]| {
        let buf = be.alloc_buffer(bytes.len()).unwrap();
        be.write_buffer(buf, 0, bytes).unwrap();
        let r = BufferRef {
            buffer: buf,
            offset: 0,
        };
        let whole = g
            .weight(name, c.kv, &[c.d, c.ctx, c.n_head_kv, c.batch], r)
            .unwrap();
        let nb1 = c.kv.row_bytes(c.d);
        let t = g.tensor(whole).nb;
        g.view_4d(
            whole,
            [c.d, c.n_kv, c.n_head_kv, c.batch],
            nb1,
            t[2],
            t[3],
            c.first * nb1,
        )
        .unwrap()
    };
    let k = view(&mut g, &mut be, "k", &kb);
    let v = view(&mut g, &mut be, "v", &vb);
    let qi = g
        .input("q", DType::F32, &[c.d, c.n_q, n_head, c.batch])
        .unwrap();
    let mi =
        (c.mask != MaskKind::None).then(|| g.input("mask", DType::F32, &[c.n_kv, c.n_q]).unwrap());
    let y = g.flash_attn_ext(qi, k, v, mi, c.p).unwrap();
    let plan = g.plan(&[y]).unwrap();
    let e = be.load(&plan).unwrap();
    be.set_input_f32(e, qi, &q).unwrap();
    if let Some(m) = mi {
        be.set_input_f32(e, m, &mask).unwrap();
    }
    be.compute(e).unwrap();
    let got = be
        .get_output_f32(e, y, c.d * n_head * c.n_q * c.batch)
        .unwrap();
    let qf: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    (got, oracle(c, &qf, &kf, &vf, &mask))
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    if norm == 0.0 {
        err
    } else {
        err / norm
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(HEAD_DIMS.to_vec()),
        1usize..300,
        1usize..2000,
        1usize..3,
        prop::sample::select(vec![1usize, 2, 4, 8]),
        1usize..3,
        (0usize..40, 0usize..40),
        prop::sample::select(vec![
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q4_0,
        ]),
        prop::sample::select(vec![MaskKind::None, MaskKind::Causal, MaskKind::Arbitrary]),
        (prop::bool::ANY, prop::bool::ANY),
        any::<u64>(),
    )
        .prop_map(
            |(
                d,
                n_q,
                n_kv,
                n_head_kv,
                group,
                batch,
                (extra, first),
                kv,
                mask,
                (cap, alibi),
                seed,
            )| {
                // Keep each case to a few million multiply-adds: shrink n_q and n_kv together.
                let work = d * n_head_kv * group * batch;
                let n_kv = n_kv.min(4_000_000 / (work * n_q.min(64)).max(1)).max(1);
                let n_q = n_q.min(4_000_000 / (work * n_kv).max(1)).max(1);
                // The quantized caches need whole 32-element blocks per row.
                let kv = if kv.quant().is_some() && d % 32 != 0 {
                    DType::F16
                } else {
                    kv
                };
                Case {
                    d,
                    n_q,
                    n_kv,
                    n_head_kv,
                    group,
                    batch,
                    ctx: n_kv + first + extra,
                    first,
                    kv,
                    mask,
                    p: FlashAttnParams {
                        scale: 1.0 / (d as f32).sqrt(),
                        max_bias: if alibi && mask != MaskKind::None {
                            8.0
                        } else {
                            0.0
                        },
                        softcap: if cap { 2.5 } else { 0.0 },
                    },
                    seed,
                }
            },
        )
}

proptest! {
    #![proptest_config(common::config(48))]

    /// The CPU reference against the f64 oracle on the same (rounded or dequantized)
    /// K/V values: only f32 arithmetic separates them.
    #[test]
    fn prop_flash_attn_ext(c in case()) {
        let (got, want) = run(&c);
        prop_assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
        let e = nmse(&got, &want);
        prop_assert!(e <= 1e-9, "NMSE {e:e}");
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
        p: FlashAttnParams {
            scale: 0.125,
            max_bias: 0.0,
            softcap: 0.0,
        },
        seed: 7,
    };
    let (got, want) = run(&c);
    assert!(nmse(&got, &want) <= 1e-9);

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
