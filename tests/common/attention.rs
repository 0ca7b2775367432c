//! The flash_attn_ext cases shared by `tests/ops/attention.rs` (the CPU backend against an f64
//! oracle) and `tests/cuda/ops_cuda.rs` (CUDA against the CPU on the same inputs): the case
//! strategy (head dims from the kernels' list, query and key counts that are not multiples
//! of any tile, GQA ratios 1, 2, 4, 8, causal and arbitrary masks with fully masked rows,
//! F32 or F16 masks with padding rows, broadcast over the heads or with a row per head (or
//! per 2 heads), softcapping and ALiBi on and off, K/V as views into a larger cache at an
//! offset, F32/F16/BF16/Q8_0/Q4_0 K/V), the oracle, and [`run`], which runs a case on any
//! backend with the arena poisoned by [`SENTINEL`] and guard bytes after every block, and
//! checks the sentinels after. [`poisoned_case`] adds a NaN or an infinity to q, K or V,
//! and [`check_expectations`] holds each output row to what it must then be.

use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferRef, DType, FlashAttnParams, Graph, PlanOptions};
use graft::quant::{dequantize_row, quantize_row};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::case::{arena_violation, decode_value, encode_value, SENTINEL};
use super::GUARD_BYTES;

/// Head sizes the kernels are written for.
pub const HEAD_DIMS: [usize; 8] = [16, 32, 64, 80, 96, 112, 128, 256];

/// One drawn case.
#[derive(Clone, Debug)]
pub struct Case {
    pub d: usize,
    pub n_q: usize,
    pub n_kv: usize,
    pub n_head_kv: usize,
    pub group: usize,
    pub batch: usize,
    /// Keys of the cache the K/V views live in (>= n_kv), and the first key viewed.
    pub ctx: usize,
    pub first: usize,
    pub kv: DType,
    pub mask: MaskKind,
    /// The mask is F16 (else F32).
    pub mask_f16: bool,
    /// Mask rows beyond n_q (ggml pads the mask's rows).
    pub mask_pad: usize,
    /// The mask's heads (a divisor of the query heads; head h reads mask head
    /// h % mask_heads), each drawn on its own.
    pub mask_heads: usize,
    pub p: FlashAttnParams,
    pub seed: u64,
    /// A NaN or an infinity written into q, K or V before the run (see
    /// [`poisoned_case`]).
    pub poison: Option<Poison>,
}

/// A non-finite value written into one element of a query row, or of one key's K or V
/// row before K and V are rounded or quantized (as a cache write would store it).
#[derive(Clone, Copy, Debug)]
pub struct Poison {
    pub at: Poisoned,
    /// The element of the row (below the head size).
    pub elem: usize,
    /// NaN, +inf or -inf.
    pub value: f32,
}

/// Which row a [`Poison`] is written into.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Poisoned {
    /// Query `i` of head `h` in batch `b`.
    Q { h: usize, i: usize, b: usize },
    /// The K row of key `j` of the view, KV head `hk`, batch `b`.
    K { j: usize, hk: usize, b: usize },
    /// The V row of key `j` of the view, KV head `hk`, batch `b`.
    V { j: usize, hk: usize, b: usize },
}

/// What an output row must be after a run with a [`Poison`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowExpect {
    /// Finite (and as the oracle: the poison is not among what the row sees).
    Finite,
    /// Holding a NaN or an infinity: the row sees the poisoned value.
    NonFinite,
    /// Either: a row of the poisoned V row's head that does not see its key, whose V row
    /// the kernels that share V between rows multiply by a weight of 0 (NaN for a NaN).
    Any,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MaskKind {
    None,
    /// Query `i` sees keys `0..=n_kv - n_q + i`.
    Causal,
    /// Random entries of -inf (some rows entirely) and small biases.
    Arbitrary,
    /// Query `i` sees the `w` keys up to its causal position (a sliding window), except
    /// the queries of every 64-row group whose index is 3 modulo 7, which see none.
    Window(usize),
    /// Every query sees keys `0..v` (a decode graph over a KV-length bucket: the
    /// positions past those filled so far are masked; `v = 0`: no key).
    Visible(usize),
}

/// Values of `n` elements of `dt` as the backend stores them, and as f64 after the
/// rounding or quantization (what the oracle multiplies). Rows of `row` elements.
/// With `poison`, element `.0` is set to `.1` before the rounding.
pub fn kv_values(
    rng: &mut StdRng,
    dt: DType,
    (n, row): (usize, usize),
    poison: Option<(usize, f32)>,
) -> (Vec<u8>, Vec<f64>) {
    let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    if let Some((at, value)) = poison {
        x[at] = value;
    }
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
            let bytes: Vec<u8> = x.iter().flat_map(|&v| encode_value(dt, v)).collect();
            let vals = bytes
                .chunks(dt.block_bytes())
                .map(|c| decode_value(dt, c))
                .collect();
            (bytes, vals)
        }
    }
}

/// The mask [n_kv, n_q, mask_heads] of a case (F32 values; -inf hides a key).
fn mask_values(c: &Case, rng: &mut StdRng) -> Vec<f32> {
    let mut m = vec![0f32; c.n_kv * c.n_q * c.mask_heads];
    for (t, row) in m.chunks_mut(c.n_kv).enumerate() {
        let i = t % c.n_q;
        let fully_masked = c.mask == MaskKind::Arbitrary && rng.random_bool(0.1);
        for (j, x) in row.iter_mut().enumerate() {
            *x = match c.mask {
                MaskKind::None => 0.0,
                MaskKind::Causal if j + c.n_q > c.n_kv + i => f32::NEG_INFINITY,
                MaskKind::Causal => 0.0,
                MaskKind::Arbitrary if fully_masked || rng.random_bool(0.3) => f32::NEG_INFINITY,
                MaskKind::Arbitrary => rng.random_range(-2.0..2.0),
                MaskKind::Visible(v) if j >= v => f32::NEG_INFINITY,
                MaskKind::Visible(_) => 0.0,
                MaskKind::Window(w) => {
                    let last = c.n_kv - c.n_q + i;
                    if (i / 64) % 7 == 3 || j > last || last - j >= w {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                }
            };
        }
    }
    if c.mask_f16 {
        // The oracle multiplies the values the backends read.
        m.iter_mut()
            .for_each(|x| *x = decode_value(DType::F16, &encode_value(DType::F16, *x)) as f32);
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
                let mrow = mask
                    .get(((h % c.mask_heads) * c.n_q + i) * c.n_kv..)
                    .unwrap_or(&[]);
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
                            MaskKind::Causal
                            | MaskKind::Arbitrary
                            | MaskKind::Window(_)
                            | MaskKind::Visible(_)
                                if mrow[j] == f32::NEG_INFINITY =>
                            {
                                f64::NEG_INFINITY
                            }
                            MaskKind::Causal
                            | MaskKind::Arbitrary
                            | MaskKind::Window(_)
                            | MaskKind::Visible(_) => s + slope * mrow[j] as f64,
                        }
                    })
                    .collect();
                // the largest score, NaN when one is
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, |m, s| {
                    if m.is_nan() || m > s {
                        m
                    } else {
                        s
                    }
                });
                let o = &mut out[((b * c.n_q + i) * n_head + h) * c.d..][..c.d];
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for (j, wj) in w.iter().enumerate() {
                    if scores[j] == f64::NEG_INFINITY {
                        continue; // a masked key
                    }
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

/// What one backend made of a case.
pub struct Ran {
    /// The result [d, n_head, n_q, batch].
    pub got: Vec<f32>,
    /// The f64 oracle's result.
    pub want: Vec<f64>,
    /// With a [`Poison`], what each output row (`d` values) must be.
    pub expect: Vec<RowExpect>,
}

/// Runs a case on `be` twice (a backend may replay a captured graph the second time),
/// the arena poisoned with [`SENTINEL`] before each run, with guard bytes after every
/// arena block; fails when a byte outside every tensor changed or an output element
/// still holds the sentinel (a row no kernel wrote).
pub fn run(c: &Case, be: &mut dyn Backend) -> Result<Ran, String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let n_head = c.n_head_kv * c.group;
    let mut q: Vec<f32> = (0..c.d * c.n_q * n_head * c.batch)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let cache = c.d * c.ctx * c.n_head_kv * c.batch;
    let key_at = |j: usize, hk: usize, b: usize, elem: usize| {
        ((b * c.n_head_kv + hk) * c.ctx + c.first + j) * c.d + elem
    };
    let (mut k_poison, mut v_poison) = (None, None);
    if let Some(p) = c.poison {
        match p.at {
            Poisoned::Q { h, i, b } => q[((b * n_head + h) * c.n_q + i) * c.d + p.elem] = p.value,
            Poisoned::K { j, hk, b } => k_poison = Some((key_at(j, hk, b, p.elem), p.value)),
            Poisoned::V { j, hk, b } => v_poison = Some((key_at(j, hk, b, p.elem), p.value)),
        }
    }
    let (kb, kf) = kv_values(&mut rng, c.kv, (cache, c.d), k_poison);
    let (vb, vf) = kv_values(&mut rng, c.kv, (cache, c.d), v_poison);
    let mask = mask_values(c, &mut rng);
    let mut g = Graph::new();
    let mut buffers = Vec::new();
    let e = |e: graft::Error| e.to_string();
    let mut view = |g: &mut Graph, be: &mut dyn Backend, name: &str, bytes: &[u8]| {
        let buf = be.alloc_buffer(bytes.len()).map_err(e)?;
        buffers.push(buf);
        be.write_buffer(buf, 0, bytes).map_err(e)?;
        let r = BufferRef {
            buffer: buf,
            offset: 0,
        };
        let whole = g
            .weight(name, c.kv, &[c.d, c.ctx, c.n_head_kv, c.batch], r)
            .map_err(e)?;
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
        .map_err(e)
    };
    let result = (|| {
        let k = view(&mut g, be, "k", &kb)?;
        let v = view(&mut g, be, "v", &vb)?;
        let qi = g
            .input("q", DType::F32, &[c.d, c.n_q, n_head, c.batch])
            .map_err(e)?;
        let mask_dt = if c.mask_f16 { DType::F16 } else { DType::F32 };
        let rows = c.n_q + c.mask_pad;
        let mi = match c.mask {
            MaskKind::None => None,
            MaskKind::Causal | MaskKind::Arbitrary | MaskKind::Window(_) | MaskKind::Visible(_) => {
                Some(
                    g.input("mask", mask_dt, &[c.n_kv, rows, c.mask_heads])
                        .map_err(e)?,
                )
            }
        };
        let y = g.flash_attn_ext(qi, k, v, mi, c.p).map_err(e)?;
        let plan = g
            .plan_with(
                &[y],
                &PlanOptions {
                    guard_bytes: GUARD_BYTES,
                },
            )
            .map_err(e)?;
        let exec = be.load(&plan).map_err(e)?;
        let n_out = c.d * n_head * c.n_q * c.batch;
        let ran = (|| {
            for _ in 0..2 {
                be.fill_arena(exec, SENTINEL)?;
                be.set_input_f32(exec, qi, &q)?;
                if let Some(m) = mi {
                    // The padding rows are all -inf: no kernel may read them.
                    let pad = vec![f32::NEG_INFINITY; c.n_kv * c.mask_pad];
                    let bytes: Vec<u8> = mask
                        .chunks(c.n_kv * c.n_q)
                        .flat_map(|head| head.iter().chain(&pad))
                        .flat_map(|&x| encode_value(mask_dt, x))
                        .collect();
                    be.set_input(exec, m, &bytes)?;
                }
                be.compute(exec)?;
            }
            let got = be.get_output_f32(exec, y, n_out)?;
            let arena = be.read_arena(exec)?;
            Ok::<_, graft::Error>((got, arena))
        })();
        let unloaded = be.unload(exec);
        let (got, arena) = ran.map_err(e)?;
        unloaded.map_err(e)?;
        if let Some(v) = arena_violation(&plan, &g, &arena) {
            return Err(format!("sentinel overwritten: {v}"));
        }
        let poison = f32::from_ne_bytes([SENTINEL; 4]);
        if let Some(i) = got.iter().position(|x| x.to_bits() == poison.to_bits()) {
            return Err(format!("output element {i} was never written"));
        }
        let qf: Vec<f64> = q.iter().map(|&x| x as f64).collect();
        Ok(Ran {
            got,
            want: oracle(c, &qf, &kf, &vf, &mask),
            expect: expectations(c, &mask),
        })
    })();
    for buf in buffers {
        be.free_buffer(buf).map_err(e)?;
    }
    result
}

/// What each output row (`[d]` of `[d, n_head, n_q, batch]`) must be after a run of `c`
/// with its poison (all [`RowExpect::Finite`] without one): a row that sees the poisoned
/// value holds a NaN or an infinity, a row that does not is finite, except the rows of the
/// poisoned V row's KV head that do not see its key ([`RowExpect::Any`]). A fully masked
/// row sees nothing (zeros), even with a NaN query.
fn expectations(c: &Case, mask: &[f32]) -> Vec<RowExpect> {
    let n_head = c.n_head_kv * c.group;
    let sees = |h: usize, i: usize, j: usize| match c.mask {
        MaskKind::None => true,
        MaskKind::Causal | MaskKind::Arbitrary | MaskKind::Window(_) | MaskKind::Visible(_) => {
            mask[((h % c.mask_heads) * c.n_q + i) * c.n_kv + j] != f32::NEG_INFINITY
        }
    };
    let mut out = Vec::with_capacity(n_head * c.n_q * c.batch);
    for b in 0..c.batch {
        for i in 0..c.n_q {
            for h in 0..n_head {
                let seen = |yes, no| if yes { RowExpect::NonFinite } else { no };
                out.push(match c.poison.map(|p| p.at) {
                    None => RowExpect::Finite,
                    Some(Poisoned::Q {
                        h: h0,
                        i: i0,
                        b: b0,
                    }) if (h, i, b) == (h0, i0, b0) => {
                        seen((0..c.n_kv).any(|j| sees(h, i, j)), RowExpect::Finite)
                    }
                    Some(Poisoned::K { j, hk, b: b0 }) if (h / c.group, b) == (hk, b0) => {
                        seen(sees(h, i, j), RowExpect::Finite)
                    }
                    Some(Poisoned::V { j, hk, b: b0 }) if (h / c.group, b) == (hk, b0) => {
                        seen(sees(h, i, j), RowExpect::Any)
                    }
                    Some(Poisoned::Q { .. } | Poisoned::K { .. } | Poisoned::V { .. }) => {
                        RowExpect::Finite
                    }
                });
            }
        }
    }
    out
}

/// Holds a run's rows to their [`RowExpect`]: the non-finite ones hold a NaN or an
/// infinity, the finite ones are finite and within `bound` (NMSE, over those rows) of the
/// oracle. Returns how many rows were non-finite as expected.
pub fn check_expectations(c: &Case, r: &Ran, bound: f64) -> Result<usize, String> {
    let (mut got, mut want, mut poisoned) = (Vec::new(), Vec::new(), 0);
    let rows = r.got.chunks(c.d).zip(r.want.chunks(c.d));
    for (row, ((g, w), e)) in rows.zip(&r.expect).enumerate() {
        let finite = g.iter().all(|x| x.is_finite());
        match (e, finite) {
            (RowExpect::NonFinite, false) => poisoned += 1,
            (RowExpect::NonFinite, true) => {
                return Err(format!("row {row} sees the poison but is finite: {g:?}"))
            }
            (RowExpect::Finite, false) => {
                return Err(format!(
                    "row {row} does not see the poison but is not finite"
                ))
            }
            (RowExpect::Finite, true) => {
                got.extend_from_slice(g);
                want.extend_from_slice(w);
            }
            (RowExpect::Any, _) => {}
        }
    }
    let e = super::nmse(&got, &want);
    match e <= bound || got.is_empty() {
        true => Ok(poisoned),
        false => Err(format!("the finite rows: NMSE {e:e} (bound {bound:e})")),
    }
}

/// The cases of `cases` with a [`Poison`]: NaN, +inf or -inf in one element of a query
/// row, or of the K or V row of one key of the view (any key: seen by some rows or by
/// none).
pub fn poisoned_case(cases: impl Strategy<Value = Case>) -> impl Strategy<Value = Case> {
    (
        cases,
        0usize..3,
        prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
        any::<[u64; 4]>(),
    )
        .prop_map(|(mut c, what, value, r)| {
            let n_head = c.n_head_kv * c.group;
            let pick = |x: u64, n: usize| x as usize % n;
            let (b, elem) = (pick(r[0], c.batch), pick(r[1], c.d));
            let at = match what {
                0 => Poisoned::Q {
                    h: pick(r[2], n_head),
                    i: pick(r[3], c.n_q),
                    b,
                },
                1 => Poisoned::K {
                    j: pick(r[2], c.n_kv),
                    hk: pick(r[3], c.n_head_kv),
                    b,
                },
                _ => Poisoned::V {
                    j: pick(r[2], c.n_kv),
                    hk: pick(r[3], c.n_head_kv),
                    b,
                },
            };
            c.poison = Some(Poison { at, elem, value });
            c
        })
}

pub fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(HEAD_DIMS.to_vec()),
        // Half the cases in the decode range of the CUDA lowering.
        prop_oneof![1usize..9, 9usize..300],
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
        (
            any::<u64>(),
            prop::bool::ANY,
            0usize..4,
            // the mask's heads: 1 (broadcast), every query head (0), or 2
            prop::sample::select(vec![1usize, 1, 1, 0, 2]),
        ),
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
                (seed, mask_f16, mask_pad, mask_heads),
            )| {
                // Keep each case to a few million multiply-adds: shrink n_q and n_kv together.
                let work = d * n_head_kv * group * batch;
                let n_kv = n_kv.min(4_000_000 / (work * n_q.min(64)).max(1)).max(1);
                let n_q = n_q.min(4_000_000 / (work * n_kv).max(1)).max(1);
                let n_head = n_head_kv * group;
                let mask_heads = match mask_heads {
                    0 => n_head,
                    m if n_head % m == 0 => m,
                    _ => 1,
                };
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
                    mask_f16,
                    mask_pad,
                    mask_heads,
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
                    poison: None,
                }
            },
        )
}

/// One-query decode, MHA in half the cases and GQA (2, 4 or 8 query heads a KV head) in
/// the others (F16, BF16, Q8_0 or Q4_0 K/V, quantized only for head dims that are whole
/// 32-element blocks): the case of the CUDA one-row decode kernels and of the streamed
/// kernel's GQA over quantized caches, which [`case`] draws rarely (MHA decode about once
/// in 160 cases); this draws only it, with [`case`]'s other fields and its own key count
/// (1..2,000: [`case`] shrinks its keys for the query and head counts it drew, which this
/// case does not have).
/// A third of the cases see only a prefix of the keys (`MaskKind::Visible`, a decode over
/// a KV-length bucket), which the streamed kernel stops copying at.
pub fn one_query_decode_case() -> impl Strategy<Value = Case> {
    let kv = [DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0];
    (
        case(),
        prop::sample::select(kv.to_vec()),
        1usize..2000,
        0.0f64..1.5,
        prop::sample::select(vec![1, 1, 1, 2, 4, 8]),
    )
        .prop_map(|(mut c, kv, n_kv, seen, group)| {
            c.ctx = c.ctx - c.n_kv + n_kv;
            c.n_kv = n_kv;
            c.n_q = 1;
            // a mask per head stays one per head, a mask of 2 heads one of 2 where 2
            // divides the new head count (else one for all)
            if c.mask_heads == c.n_head_kv * c.group {
                c.mask_heads = c.n_head_kv * group;
            } else if (c.n_head_kv * group) % c.mask_heads != 0 {
                c.mask_heads = 1;
            }
            c.group = group;
            // the quantized caches need whole 32-element blocks per row
            c.kv = if kv.quant().is_some() && c.d % 32 != 0 {
                DType::F16
            } else {
                kv
            };
            if seen < 0.5 {
                // 0..=n_kv visible keys, all of them or none included
                c.mask = MaskKind::Visible(((seen * 2.0 * (n_kv + 1) as f64) as usize).min(n_kv));
            }
            c
        })
}
