//! Cases of mul_mat_id (the experts' products of a mixture of experts) for the CPU and
//! device tests: `as` [k, m, n_expert] in any weight dtype (F32, F16, BF16, every block
//! type), inputs `b` [k, b1, n_tokens] (`b1` 1 or `n_used`, optionally a strided view
//! of a wider leaf) and random ids [n_used, n_tokens], repeats allowed. [`run`] builds a
//! case on any backend; [`oracle`] is the f64 result of ggml's definition,
//! `c[:, i, t] = as[:, :, ids[i, t]]^T b[:, i % b1, t]`, from the weights as stored
//! (block types dequantized on the host by `graft::quant`; the types graft only reads as
//! random valid blocks).

use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferRef, DType, Graph};
use graft::quant;
use graft::Result;
use proptest::prelude::*;

use crate::common::quant_blocks;
use crate::quant_strategies::{values_with, weight_types};

/// One mul_mat_id case.
#[derive(Clone, Debug)]
pub struct MoeCase {
    /// The experts' dtype.
    pub dtype: DType,
    /// Row length (the contraction).
    pub k: usize,
    /// Rows of each expert (the output width).
    pub m: usize,
    pub n_expert: usize,
    pub n_used: usize,
    /// Inputs per token: 1 (shared by the token's experts) or `n_used`.
    pub b1: usize,
    pub n_tokens: usize,
    /// Elements of padding after each input column (a strided view when nonzero).
    pub b_pad: usize,
    /// Bytes before the experts in their buffer (2: block types' rows not 16-byte
    /// aligned).
    pub w_offset: usize,
    /// `[n_used, n_tokens]`, each in `0..n_expert` unless a test puts one outside.
    pub ids: Vec<i32>,
    pub seed: u64,
}

impl MoeCase {
    /// The dense f32 values of the experts `[k, m, n_expert]` before they are stored.
    fn weight_values(&self) -> Vec<f32> {
        values_with(self.seed, self.k * self.m * self.n_expert, 8.0)
    }

    /// The experts' bytes in their dtype.
    pub fn weight_bytes(&self) -> Vec<u8> {
        let x = self.weight_values();
        let rows = self.m * self.n_expert;
        let rb = self.dtype.row_bytes(self.k);
        let mut out = vec![0u8; rb * rows];
        for (r, (src, dst)) in x
            .chunks_exact(self.k)
            .zip(out.chunks_exact_mut(rb))
            .enumerate()
        {
            encode_row(self.dtype, src, dst, self.seed ^ r as u64);
        }
        out
    }

    /// The experts as stored, back in f32: `[k, m, n_expert]`.
    pub fn weights_stored(&self) -> Vec<f32> {
        let rb = self.dtype.row_bytes(self.k);
        let mut out = vec![0f32; self.k * self.m * self.n_expert];
        for (src, dst) in self
            .weight_bytes()
            .chunks_exact(rb)
            .zip(out.chunks_exact_mut(self.k))
        {
            decode_row(self.dtype, src, dst);
        }
        out
    }

    /// The inputs `[k + b_pad, b1, n_tokens]` (the view takes the first `k` of each
    /// column).
    pub fn inputs(&self) -> Vec<f32> {
        let len = (self.k + self.b_pad) * self.b1 * self.n_tokens;
        values_with(self.seed.wrapping_add(1), len, 8.0)
    }
}

/// `src` in `dtype`'s bytes (rounded to nearest; blocks quantized by `graft::quant`, or
/// random blocks of `src`'s magnitude for the types it only reads, see
/// [`quant_blocks::weight_row`]).
fn encode_row(dtype: DType, src: &[f32], dst: &mut [u8], seed: u64) {
    match dtype {
        DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        DType::F16 => {
            for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::Quant(q) => dst.copy_from_slice(&quant_blocks::weight_row(q, src, seed)),
        DType::I32 => panic!("no I32 weights"),
    }
}

/// The f32 values of a row of `dtype`'s bytes.
fn decode_row(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        DType::F16 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Quant(q) => quant::dequantize_row(q, src, dst).expect("whole blocks"),
        DType::I32 => panic!("no I32 weights"),
    }
}

/// Every weight dtype mul_mat_id takes: the floats and the block types.
pub fn weight_dtypes() -> Vec<DType> {
    let mut v = DType::FLOATS.to_vec();
    v.extend(weight_types().into_iter().map(DType::Quant));
    v
}

/// Random cases: every weight dtype, 1..=6 experts of 1..=9 rows, 1..=4 used (ids drawn
/// with repeats, so a token may use an expert twice and an expert may go unused), shared
/// or per-expert inputs, 1..=7 tokens, contiguous or strided inputs, block types' rows
/// 16-byte aligned or not.
pub fn cases() -> impl Strategy<Value = MoeCase> {
    cases_with(7, 6, 9)
}

/// [`cases`] with up to `max_tokens` tokens and `max_experts` experts of up to
/// `max_rows` rows (a prefill's many columns per expert).
pub fn cases_with(
    max_tokens: usize,
    max_experts: usize,
    max_rows: usize,
) -> impl Strategy<Value = MoeCase> {
    draw(weight_dtypes(), 1..=max_tokens, max_experts, max_rows, 4)
}

/// Decode steps of block-quantized experts (the CUDA backend's decode kernels): 1..=4
/// tokens of 1..=8 experts each out of 1..=12 (repeats allowed) of 1..=40 rows, shared or
/// per-expert inputs, rows 16-byte aligned or not.
pub fn decode_cases() -> impl Strategy<Value = MoeCase> {
    let blocks = weight_types().into_iter().map(DType::Quant).collect();
    draw(blocks, 1..=4, 12, 40, 8)
}

/// Cases of `dtypes`, `tokens` tokens of 1..=`max_used` experts each out of
/// 1..=`max_experts` of 1..=`max_rows` rows.
fn draw(
    dtypes: Vec<DType>,
    tokens: std::ops::RangeInclusive<usize>,
    max_experts: usize,
    max_rows: usize,
    max_used: usize,
) -> impl Strategy<Value = MoeCase> {
    (
        0..dtypes.len(),
        1usize..=3,
        1usize..=max_rows,
        1usize..=max_experts,
        1usize..=max_used,
        any::<bool>(),
        tokens,
        prop_oneof![Just(0usize), 1usize..=5],
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(
            move |(d, kb, m, n_expert, n_used, shared, n_tokens, b_pad, misalign, seed)| {
                let dtype = dtypes[d];
                let k = match dtype.quant() {
                    Some(_) => kb * dtype.block_size(),
                    None => kb * 13,
                };
                let ids = proptest::collection::vec(0..n_expert as i32, n_used * n_tokens);
                ids.prop_map(move |ids| MoeCase {
                    dtype,
                    k,
                    m,
                    n_expert,
                    n_used,
                    b1: if shared { 1 } else { n_used },
                    n_tokens,
                    b_pad,
                    w_offset: if misalign && dtype.quant().is_some() {
                        2
                    } else {
                        0
                    },
                    ids,
                    seed,
                })
            },
        )
}

/// Runs case `c` on `be` (twice: a backend may capture a graph and replay it) and
/// returns the F32 result `[m, n_used, n_tokens]`.
pub fn run(c: &MoeCase, be: &mut dyn Backend) -> Result<Vec<f32>> {
    let bytes = c.weight_bytes();
    let buf = be.alloc_buffer(c.w_offset + bytes.len())?;
    let out = (|| {
        be.write_buffer(buf, c.w_offset, &bytes)?;
        let mut g = Graph::new();
        let data = BufferRef {
            buffer: buf,
            offset: c.w_offset,
        };
        let w = g.weight("experts", c.dtype, &[c.k, c.m, c.n_expert], data)?;
        let kp = c.k + c.b_pad;
        let x = g.input("x", DType::F32, &[kp, c.b1, c.n_tokens])?;
        let xv = g.view_3d(x, c.k, c.b1, c.n_tokens, kp * 4, kp * c.b1 * 4, 0)?;
        let ids = g.input("ids", DType::I32, &[c.n_used, c.n_tokens])?;
        let y = g.mul_mat_id(w, xv, ids)?;
        let exec = be.load(&g.plan(&[y])?)?;
        let run = (|| {
            for _ in 0..2 {
                be.set_input_f32(exec, x, &c.inputs())?;
                be.set_input_i32(exec, ids, &c.ids)?;
                be.compute(exec)?;
            }
            be.get_output_f32(exec, y, c.m * c.n_used * c.n_tokens)
        })();
        be.unload(exec)?;
        run
    })();
    be.free_buffer(buf)?;
    out
}

/// The f64 result of case `c`, `[m, n_used, n_tokens]` dense; with `q8_1`, of the
/// inputs rounded to Q8_1 blocks first (the activations of the Q8_1 dot path of block
/// types, whose rounding is part of that path).
pub fn oracle(c: &MoeCase, q8_1: bool) -> Vec<f64> {
    let w = c.weights_stored();
    let mut x = c.inputs();
    if q8_1 {
        let kp = c.k + c.b_pad;
        let rb = DType::Q8_1.row_bytes(c.k);
        let mut bytes = vec![0u8; rb];
        for col in x.chunks_exact_mut(kp) {
            quant::quantize_row(quant::QType::Q8_1, &col[..c.k], &mut bytes).expect("blocks");
            quant::dequantize_row(quant::QType::Q8_1, &bytes, &mut col[..c.k]).expect("blocks");
        }
    }
    columns(c, &w, &x, |a, b| a * b)
}

/// `max |w| * sum |x|` over the terms of each output of case `c` (`max |w|` of the
/// expert's row): the scale of the rounding errors of a sum whose terms cancel, including
/// the offset terms of block types (`d * sum x` with `|d|` up to the row's largest weight).
pub fn magnitudes(c: &MoeCase) -> Vec<f64> {
    let mut w = c.weights_stored();
    for row in w.chunks_exact_mut(c.k) {
        let top = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        row.fill(top);
    }
    columns(c, &w, &c.inputs(), |a, b| (a * b).abs())
}

/// `sum_l f(w[l, r, e], x[l, i % b1, t])` for every output `(r, i, t)` of case `c`.
fn columns(c: &MoeCase, w: &[f32], x: &[f32], f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    let (k, m, kp) = (c.k, c.m, c.k + c.b_pad);
    let mut out = Vec::with_capacity(m * c.n_used * c.n_tokens);
    for t in 0..c.n_tokens {
        for i in 0..c.n_used {
            let e = c.ids[t * c.n_used + i] as usize;
            let col = &x[(t * c.b1 + i % c.b1) * kp..][..k];
            for r in 0..m {
                let row = &w[(e * m + r) * k..][..k];
                out.push(
                    row.iter()
                        .zip(col)
                        .map(|(&a, &b)| f(f64::from(a), f64::from(b)))
                        .sum(),
                );
            }
        }
    }
    out
}
