//! The f64 oracle: what every op must produce, derived here from the op definitions
//! (ggml semantics, HF formulas) without calling any of graft's own kernels or helpers.
//!
//! Operands are first turned into logical row-major f64 arrays by replaying the case's
//! view chain on a byte layout (ne, nb, offset); every op is then a few plain loops.

use graft::graph::DType;
use graft::ops::{BinaryOp, RopeMode, RopeParams, UnaryOp};

use super::case::{state_image, Case, Data, OpCase, Storage, ViewStep};

/// How results must match.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tol {
    /// Bit-for-bit equal values.
    Exact,
    /// Normalized mean squared error at most this.
    Nmse(f64),
}

/// The expected bytes of a state buffer after the run.
#[derive(Clone, Debug)]
pub struct StateExpect {
    /// Index of the state leaf.
    pub leaf: usize,
    /// The state's dtype.
    pub dtype: DType,
    /// The buffer before the run.
    pub init: Vec<u8>,
    /// Elements the op writes: byte offset in the buffer and value (unrounded).
    pub writes: Vec<(usize, f64)>,
    /// Byte range of the state tensor inside its buffer.
    pub tensor: (usize, usize),
}

/// What a correct backend produces for a case.
#[derive(Clone, Debug)]
pub struct Expected {
    /// The op's result in row-major order (None for ops writing a state).
    pub out: Option<Vec<f64>>,
    /// How results must match.
    pub tol: Tol,
    /// Every state leaf of the case.
    pub states: Vec<StateExpect>,
}

/// A strided layout in bytes, relative to the start of a leaf.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Layout {
    pub ne: [usize; 4],
    pub nb: [usize; 4],
    pub offs: usize,
}

/// Dense row-major strides.
pub fn dense(es: usize, ne: [usize; 4]) -> [usize; 4] {
    [
        es,
        es * ne[0],
        es * ne[0] * ne[1],
        es * ne[0] * ne[1] * ne[2],
    ]
}

/// The layout operand `i` of `case` has (its leaf's layout after the view chain).
pub fn arg_layout(case: &Case, i: usize) -> Layout {
    let arg = &case.args[i];
    let leaf = &case.leaves[arg.leaf];
    layout_of(leaf.ne, leaf.dtype.block_bytes(), &arg.steps)
}

/// The layout a view chain gives a contiguous leaf of `ne` elements of `es` bytes.
pub fn layout_of(ne: [usize; 4], es: usize, steps: &[ViewStep]) -> Layout {
    let mut l = Layout {
        ne,
        nb: dense(es, ne),
        offs: 0,
    };
    for s in steps {
        l = match *s {
            ViewStep::View { ne, nb, offs } => Layout {
                ne,
                nb,
                offs: l.offs + offs,
            },
            ViewStep::Permute(axes) => {
                let mut p = l;
                for (d, &to) in axes.iter().enumerate() {
                    p.ne[to] = l.ne[d];
                    p.nb[to] = l.nb[d];
                }
                p
            }
            ViewStep::Transpose => {
                let mut p = l;
                p.ne.swap(0, 1);
                p.nb.swap(0, 1);
                p
            }
            ViewStep::Reshape(ne) => Layout {
                ne,
                nb: dense(es, ne),
                offs: l.offs,
            },
        };
    }
    l
}

/// Byte offsets of every element of `l`, in row-major order.
pub fn offsets(l: &Layout) -> Vec<usize> {
    let mut v = Vec::with_capacity(l.ne.iter().product());
    for i3 in 0..l.ne[3] {
        for i2 in 0..l.ne[2] {
            for i1 in 0..l.ne[1] {
                for i0 in 0..l.ne[0] {
                    v.push(l.offs + i0 * l.nb[0] + i1 * l.nb[1] + i2 * l.nb[2] + i3 * l.nb[3]);
                }
            }
        }
    }
    v
}

/// The logical values of operand `i` in row-major order, with its shape.
pub fn arg_values(case: &Case, i: usize) -> (Vec<f64>, [usize; 4]) {
    let l = arg_layout(case, i);
    let leaf = &case.leaves[case.args[i].leaf];
    let es = leaf.dtype.block_bytes();
    let vals: Vec<f64> = match &leaf.data {
        Data::F(v) => v.iter().map(|&x| x as f64).collect(),
        Data::I(v) => v.iter().map(|&x| x as f64).collect(),
    };
    (offsets(&l).iter().map(|o| vals[o / es]).collect(), l.ne)
}

/// Row-major index of `[i0, i1, i2, i3]` in `ne`.
fn at(ne: [usize; 4], i: [usize; 4]) -> usize {
    i[0] + ne[0] * (i[1] + ne[1] * (i[2] + ne[2] * i[3]))
}

fn rows(ne: [usize; 4]) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..ne[3])
        .flat_map(move |i3| (0..ne[2]).flat_map(move |i2| (0..ne[1]).map(move |i1| (i1, i2, i3))))
}

/// The tolerance of a case: exact where the result is a plain copy or choice of input
/// values, else ggml's NMSE thresholds.
pub fn tolerance(case: &Case) -> Tol {
    let widening = |from: DType, to: DType| from == to || to == DType::F32;
    match &case.op {
        OpCase::Argmax
        | OpCase::TopK(_)
        | OpCase::GetRows
        | OpCase::DiagMaskInf(_)
        | OpCase::Cont => return Tol::Exact,
        OpCase::Cast(to) if widening(case.arg_dtype(0), *to) => return Tol::Exact,
        OpCase::Cpy if widening(case.arg_dtype(0), case.arg_dtype(1)) => return Tol::Exact,
        OpCase::SetRows if widening(case.arg_dtype(1), case.arg_dtype(0)) => return Tol::Exact,
        _ => {}
    }
    let half = (0..case.args.len())
        .map(|i| case.arg_dtype(i))
        .chain(std::iter::once(case.result_dtype()))
        .any(|d| matches!(d, DType::F16 | DType::BF16));
    match case.op {
        OpCase::MulMat => Tol::Nmse(5e-4),
        _ if half => Tol::Nmse(5e-4),
        OpCase::SoftMax(_) => Tol::Nmse(1e-6),
        _ => Tol::Nmse(1e-7),
    }
}

/// The expected result of `case`.
pub fn expected(case: &Case) -> Expected {
    let mut states: Vec<StateExpect> = case
        .leaves
        .iter()
        .enumerate()
        .filter_map(|(i, leaf)| match &leaf.storage {
            Storage::State { pad, .. } => Some(StateExpect {
                leaf: i,
                dtype: leaf.dtype,
                init: state_image(leaf),
                writes: Vec::new(),
                tensor: (
                    pad.len(),
                    pad.len() + leaf.ne.iter().product::<usize>() * leaf.dtype.block_bytes(),
                ),
            }),
            _ => None,
        })
        .collect();
    let out = match &case.op {
        OpCase::Cpy | OpCase::SetRows => {
            let si = case.op.state_arg().expect("writes a state");
            let writes = if case.op == OpCase::Cpy {
                cpy_writes(case)
            } else {
                set_rows_writes(case)
            };
            let leaf = case.args[si].leaf;
            let st = states
                .iter_mut()
                .find(|s| s.leaf == leaf)
                .expect("the destination is a state leaf");
            st.writes = writes
                .into_iter()
                .map(|(o, v)| (o + st.tensor.0, v))
                .collect();
            None
        }
        op => Some(compute(case, op)),
    };
    Expected {
        out,
        tol: tolerance(case),
        states,
    }
}

/// The f64 definition of each [`UnaryOp`], written from the op's definition: the oracle's
/// entry for an elementwise op (the strategies draw the ops from `UnaryOp::ALL`).
pub fn unary_ref(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        // 0.5 x (1 + tanh(u)); 1 + tanh(u) = 2 / (1 + exp(-2u)) keeps f64 exact where
        // tanh(u) rounds to -1 (x below about -6).
        UnaryOp::Gelu => {
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            x / (1.0 + (-2.0 * u).exp())
        }
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::LogSigmoid => -(-x).exp().ln_1p(),
    }
}

/// The f64 definition of each [`BinaryOp`].
pub fn binary_ref(op: BinaryOp, x: f64, y: f64) -> f64 {
    match op {
        BinaryOp::Add => x + y,
        BinaryOp::Mul => x * y,
    }
}

/// The result of every op that produces a fresh tensor.
fn compute(case: &Case, op: &OpCase) -> Vec<f64> {
    let (a, ne) = arg_values(case, 0);
    let map = |f: &dyn Fn(f64) -> f64| a.iter().map(|&x| f(x)).collect::<Vec<f64>>();
    match *op {
        OpCase::GetRows => {
            let (ids, ni) = arg_values(case, 1);
            let out_ne = [ne[0], ni[0], ni[1], ni[2]];
            let mut out = Vec::with_capacity(out_ne.iter().product());
            for (i1, i2, i3) in rows(out_ne) {
                let r = ids[at(ni, [i1, i2, i3, 0])] as usize;
                out.extend((0..ne[0]).map(|i0| a[at(ne, [i0, r, i2, i3])]));
            }
            out
        }
        OpCase::Binary(bop) => {
            let (b, nbe) = arg_values(case, 1);
            let mut out = Vec::with_capacity(a.len());
            for (i1, i2, i3) in rows(ne) {
                for i0 in 0..ne[0] {
                    let x = a[at(ne, [i0, i1, i2, i3])];
                    let bi = [i0 % nbe[0], i1 % nbe[1], i2 % nbe[2], i3 % nbe[3]];
                    let y = b[at(nbe, bi)];
                    out.push(binary_ref(bop, x, y));
                }
            }
            out
        }
        OpCase::Scale(s) => map(&|x| x * s as f64),
        OpCase::Unary(uop) => map(&|x| unary_ref(uop, x)),
        OpCase::RmsNorm(eps) => per_row(&a, ne[0], |r| {
            let ms = r.iter().map(|x| x * x).sum::<f64>() / r.len() as f64;
            let k = 1.0 / (ms + eps as f64).sqrt();
            r.iter().map(|x| x * k).collect()
        }),
        OpCase::Norm(eps) => per_row(&a, ne[0], |r| {
            let n = r.len() as f64;
            let mean = r.iter().sum::<f64>() / n;
            let var = r.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
            let k = 1.0 / (var + eps as f64).sqrt();
            r.iter().map(|x| (x - mean) * k).collect()
        }),
        OpCase::MulMat => {
            let (b, nbe) = arg_values(case, 1);
            let (r2, r3) = (nbe[2] / ne[2], nbe[3] / ne[3]);
            let out_ne = [ne[1], nbe[1], nbe[2], nbe[3]];
            let mut out = Vec::with_capacity(out_ne.iter().product());
            for (j, i2, i3) in rows(out_ne) {
                for i in 0..ne[1] {
                    let s: f64 = (0..ne[0])
                        .map(|l| a[at(ne, [l, i, i2 / r2, i3 / r3])] * b[at(nbe, [l, j, i2, i3])])
                        .sum();
                    out.push(s);
                }
            }
            out
        }
        OpCase::Rope(p) => {
            let (pos, _) = arg_values(case, 1);
            rope(&a, ne, &pos, &p)
        }
        OpCase::Cont | OpCase::Cast(_) => a,
        OpCase::DiagMaskInf(n_past) => {
            let mut out = a;
            for (i1, i2, i3) in rows(ne) {
                for i0 in (n_past + i1 + 1)..ne[0] {
                    out[at(ne, [i0, i1, i2, i3])] = f64::NEG_INFINITY;
                }
            }
            out
        }
        OpCase::SoftMax(scale) => {
            let mask = (case.args.len() > 1).then(|| arg_values(case, 1));
            let mut out = Vec::with_capacity(a.len());
            for (i1, i2, i3) in rows(ne) {
                let x: Vec<f64> = (0..ne[0])
                    .map(|i0| {
                        let v = a[at(ne, [i0, i1, i2, i3])] * scale as f64;
                        match &mask {
                            Some((m, nm)) => {
                                v + m[at(*nm, [i0, i1 % nm[1], i2 % nm[2], i3 % nm[3]])]
                            }
                            None => v,
                        }
                    })
                    .collect();
                let mx = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    out.extend(std::iter::repeat_n(0.0, x.len()));
                } else {
                    let e: Vec<f64> = x.iter().map(|v| (v - mx).exp()).collect();
                    let s: f64 = e.iter().sum();
                    out.extend(e.iter().map(|v| v / s));
                }
            }
            out
        }
        OpCase::Argmax => a
            .chunks(ne[0])
            .map(|r| {
                let mut best = 0;
                for (i, &v) in r.iter().enumerate() {
                    if v > r[best] {
                        best = i;
                    }
                }
                best as f64
            })
            .collect(),
        OpCase::TopK(k) => a.chunks(ne[0]).flat_map(|r| top_k_oracle(r, k)).collect(),
        OpCase::Cpy | OpCase::SetRows => unreachable!("state ops have no fresh result"),
    }
}

/// The indices of the `k` largest values of `row`: NaN before every number, then larger
/// values first (`-0 == +0`), ties by lower index.
fn top_k_oracle(row: &[f64], k: usize) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&i, &j| {
        let (a, b) = (row[i], row[j]);
        let by_value = match (a.is_nan(), b.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Less,
            (false, true) => std::cmp::Ordering::Greater,
            (false, false) => b.partial_cmp(&a).unwrap(),
        };
        by_value.then(i.cmp(&j))
    });
    idx[..k].iter().map(|&i| i as f64).collect()
}

fn per_row(a: &[f64], n0: usize, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    a.chunks(n0).flat_map(f).collect()
}

/// Inverse frequency of rotated pair `i` as HF transformers computes it
/// (`_compute_default_rope_parameters` / `_compute_llama3_parameters`), then the linear
/// position scaling.
pub fn rope_inv_freq(p: &RopeParams, i: usize) -> f64 {
    let dim = p.n_dims as f64;
    let inv_freq = 1.0 / (p.freq_base as f64).powf((2 * i) as f64 / dim);
    let f = match p.llama3 {
        None => inv_freq,
        Some(s) => {
            let factor = s.factor as f64;
            let low_freq_factor = s.low_freq_factor as f64;
            let high_freq_factor = s.high_freq_factor as f64;
            let old_context_len = s.original_max_position as f64;
            let low_freq_wavelen = old_context_len / low_freq_factor;
            let high_freq_wavelen = old_context_len / high_freq_factor;
            let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
            let inv_freq_llama = if wavelen > low_freq_wavelen {
                inv_freq / factor
            } else {
                inv_freq
            };
            let smooth_factor = (old_context_len / wavelen - low_freq_factor)
                / (high_freq_factor - low_freq_factor);
            let smoothed =
                (1.0 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
            // HF: is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
            if is_medium {
                smoothed
            } else {
                inv_freq_llama
            }
        }
    };
    f * p.freq_scale as f64
}

fn rope(a: &[f64], ne: [usize; 4], pos: &[f64], p: &RopeParams) -> Vec<f64> {
    let half = p.n_dims / 2;
    let inv: Vec<f64> = (0..half).map(|i| rope_inv_freq(p, i)).collect();
    let mut out = a.to_vec();
    for (i1, i2, i3) in rows(ne) {
        let base = at(ne, [0, i1, i2, i3]);
        for (i, f) in inv.iter().enumerate() {
            let theta = pos[i2] * f;
            let (j0, j1) = match p.mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::Neox => (i, i + half),
            };
            let (x0, x1) = (a[base + j0], a[base + j1]);
            out[base + j0] = x0 * theta.cos() - x1 * theta.sin();
            out[base + j1] = x0 * theta.sin() + x1 * theta.cos();
        }
    }
    out
}

/// cpy: the source's values, in row-major order, go to the destination's elements in
/// row-major order. Returns (byte offset in the state tensor, value).
fn cpy_writes(case: &Case) -> Vec<(usize, f64)> {
    let (src, _) = arg_values(case, 0);
    let dst = arg_layout(case, 1);
    offsets(&dst).into_iter().zip(src).collect()
}

/// set_rows: row r of the source (at every i2, i3) goes to row ids[r, i2 % n2, i3 % n3]
/// of the destination.
fn set_rows_writes(case: &Case) -> Vec<(usize, f64)> {
    let dst = arg_layout(case, 0);
    let (src, ns) = arg_values(case, 1);
    let (ids, ni) = arg_values(case, 2);
    let mut w = Vec::with_capacity(src.len());
    for (r, i2, i3) in rows(ns) {
        let id = ids[at(ni, [r, i2 % ni[1], i3 % ni[2], 0])] as usize;
        for i0 in 0..ns[0] {
            let off = dst.offs + i0 * dst.nb[0] + id * dst.nb[1] + i2 * dst.nb[2] + i3 * dst.nb[3];
            w.push((off, src[at(ns, [i0, r, i2, i3])]));
        }
    }
    w
}
