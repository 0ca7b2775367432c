//! Proptest strategies, one or more per op. Proptest draws the shapes, dtypes and op
//! parameters (so failures shrink towards small shapes); a seed drawn with them picks the
//! operand layouts (contiguous, reshaped, permuted, a window at an offset into a larger
//! leaf, or a permuted window), the storage (input, weight, state) and the values.

use graft::graph::DType;
use graft::ops::{BinaryOp, Llama3Scaling, RopeMode, RopeParams, UnaryOp};
use proptest::prelude::*;
use proptest::strategy::BoxedStrategy;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::case::{Arg, Case, Data, Leaf, OpCase, Storage, ViewStep};
use super::oracle::{dense, layout_of, offsets};

/// How values are drawn.
#[derive(Clone, Copy, Debug)]
pub enum Dist {
    /// Uniform in `[-s, s)`.
    Uniform(f32),
    /// Magnitude uniform in `[0.25, 2]`, random sign (for normalizations).
    AwayFromZero,
    /// Multiples of 0.5 in `[-1.5, 1.5]`: many ties.
    Ties,
}

/// Which layouts an operand may get.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shape {
    /// The leaf itself.
    Contiguous,
    /// Anything: contiguous, reshaped, permuted, transposed, a window, a permuted window.
    Any,
    /// Only layouts that are not the plain leaf: permuted, a window, a permuted window.
    Strided,
}

/// Where an operand's leaf lives.
#[derive(Clone, Copy, Debug)]
pub enum Mem {
    /// An input.
    Input,
    /// A weight with this probability, else an input.
    WeightSometimes(f64),
    /// A state buffer with random padding around it.
    State,
}

/// Builds the leaves and operands of one case from a seed.
pub struct Gen {
    /// The generator every random choice comes from.
    pub rng: StdRng,
    seed: u64,
    leaves: Vec<Leaf>,
    args: Vec<Arg>,
}

/// Rounds `x` to the nearest value of `dtype`.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F32 | DType::I32 => x,
        DType::Quant(q) => panic!("values are not rounded to {q} one by one"),
    }
}

impl Gen {
    /// A generator for one case.
    pub fn new(seed: u64) -> Self {
        Gen {
            rng: StdRng::seed_from_u64(seed),
            seed,
            leaves: Vec::new(),
            args: Vec::new(),
        }
    }

    /// One value of `dist`.
    pub fn value(&mut self, dist: Dist) -> f32 {
        match dist {
            Dist::Uniform(s) => self.rng.random_range(-s..s),
            Dist::AwayFromZero => {
                let m = self.rng.random_range(0.25f32..=2.0);
                if self.rng.random_bool(0.5) {
                    m
                } else {
                    -m
                }
            }
            Dist::Ties => self.rng.random_range(-3i32..=3) as f32 * 0.5,
        }
    }

    /// A divisor of `n`: often `n` itself or 1, else a random one.
    pub fn divisor(&mut self, n: usize) -> usize {
        let r: f64 = self.rng.random();
        if r < 0.35 {
            n
        } else if r < 0.65 {
            1
        } else {
            let d: Vec<usize> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
            d[self.rng.random_range(0..d.len())]
        }
    }

    /// A random 4-d shape with `n` elements.
    pub fn factorization(&mut self, n: usize) -> [usize; 4] {
        let mut ne = [1usize; 4];
        let mut rem = n;
        for d in ne.iter_mut().take(3) {
            *d = self.divisor(rem);
            rem /= *d;
        }
        ne[3] = rem;
        ne.shuffle(&mut self.rng);
        ne
    }

    /// `n` distinct values of `0..limit` (n <= limit) in random order.
    pub fn distinct(&mut self, n: usize, limit: usize) -> Vec<i32> {
        let mut all: Vec<i32> = (0..limit as i32).collect();
        all.shuffle(&mut self.rng);
        all.truncate(n);
        all
    }

    fn permutation(&mut self) -> [usize; 4] {
        let mut axes = [0, 1, 2, 3];
        axes.shuffle(&mut self.rng);
        axes
    }

    /// A leaf somewhat larger than `w` and a view of `w` into it at a nonzero offset.
    fn window(&mut self, w: [usize; 4], es: usize) -> ([usize; 4], ViewStep) {
        let mut extra = [0usize; 4];
        let mut start = [0usize; 4];
        for d in 0..4 {
            extra[d] = self.rng.random_range(0..=2);
            start[d] = self.rng.random_range(0..=extra[d]);
        }
        if start == [0; 4] {
            let d = self.rng.random_range(0..4);
            extra[d] = extra[d].max(1);
            start[d] = self.rng.random_range(1..=extra[d]);
        }
        let leaf_ne = [0, 1, 2, 3].map(|d| w[d] + extra[d]);
        let nb = dense(es, leaf_ne);
        let offs = (0..4).map(|d| start[d] * nb[d]).sum();
        (leaf_ne, ViewStep::View { ne: w, nb, offs })
    }

    /// The leaf shape and view chain giving an operand of shape `ne`.
    pub fn layout(
        &mut self,
        ne: [usize; 4],
        es: usize,
        shape: Shape,
    ) -> ([usize; 4], Vec<ViewStep>) {
        let r = self.rng.random_range(0..100);
        let pick = match shape {
            Shape::Contiguous => 0,
            Shape::Any => r,
            Shape::Strided => 30 + r * 70 / 100,
        };
        match pick {
            0..20 => (ne, vec![]),
            20..30 => {
                let n = ne.iter().product();
                (self.factorization(n), vec![ViewStep::Reshape(ne)])
            }
            30..50 => {
                let axes = self.permutation();
                let leaf_ne = axes.map(|a| ne[a]);
                let step = if axes == [1, 0, 2, 3] && self.rng.random_bool(0.5) {
                    ViewStep::Transpose
                } else {
                    ViewStep::Permute(axes)
                };
                (leaf_ne, vec![step])
            }
            50..75 => {
                let (leaf_ne, v) = self.window(ne, es);
                (leaf_ne, vec![v])
            }
            _ => {
                let axes = self.permutation();
                let (leaf_ne, v) = self.window(axes.map(|a| ne[a]), es);
                (leaf_ne, vec![v, ViewStep::Permute(axes)])
            }
        }
    }

    fn storage(&mut self, mem: Mem) -> Storage {
        match mem {
            Mem::Input => Storage::Input,
            Mem::WeightSometimes(p) => {
                if self.rng.random_bool(p) {
                    Storage::Weight {
                        pad: [0, 256][self.rng.random_range(0..2)],
                    }
                } else {
                    Storage::Input
                }
            }
            Mem::State => {
                let pad_len = [0, 16, 64, 256][self.rng.random_range(0..4)];
                let tail_len = [0, 2, 16, 64][self.rng.random_range(0..4)];
                let mut bytes = |n: usize| (0..n).map(|_| self.rng.random::<u8>()).collect();
                Storage::State {
                    pad: bytes(pad_len),
                    tail: bytes(tail_len),
                }
            }
        }
    }

    /// Adds a leaf, returning its index.
    pub fn push_leaf(&mut self, leaf: Leaf) -> usize {
        self.leaves.push(leaf);
        self.leaves.len() - 1
    }

    /// Adds an operand, returning its index.
    pub fn push_arg(&mut self, leaf: usize, steps: Vec<ViewStep>) -> usize {
        self.args.push(Arg { leaf, steps });
        self.args.len() - 1
    }

    /// A leaf of random values of `dist` (rounded to `dtype`).
    pub fn float_leaf(
        &mut self,
        name: &str,
        ne: [usize; 4],
        dtype: DType,
        dist: Dist,
        mem: Mem,
    ) -> usize {
        let n = ne.iter().product();
        let data = (0..n).map(|_| round_to(dtype, self.value(dist))).collect();
        let storage = self.storage(mem);
        self.push_leaf(Leaf {
            name: name.into(),
            dtype,
            ne,
            storage,
            data: Data::F(data),
        })
    }

    /// An operand whose logical values (row-major) are `values`, seen through `steps` of
    /// a leaf of shape `leaf_ne`. The leaf's other elements are poison a correct kernel
    /// never reads: NaN in float inputs and weights, hugely negative ids in I32 inputs;
    /// a state's other elements are finite random values.
    pub fn view_arg(
        &mut self,
        name: &str,
        leaf_ne: [usize; 4],
        steps: Vec<ViewStep>,
        dtype: DType,
        values: Data,
        mem: Mem,
    ) -> usize {
        let n = leaf_ne.iter().product();
        let storage = self.storage(mem);
        let offs = offsets(&layout_of(leaf_ne, dtype.block_bytes(), &steps));
        let es = dtype.block_bytes();
        let data = match values {
            Data::F(v) => {
                let mut d: Vec<f32> = match storage {
                    Storage::State { .. } => (0..n)
                        .map(|_| round_to(dtype, self.value(Dist::Uniform(1.0))))
                        .collect(),
                    _ => vec![f32::NAN; n],
                };
                for (o, x) in offs.iter().zip(v) {
                    d[o / es] = x;
                }
                Data::F(d)
            }
            Data::I(v) => {
                let mut d: Vec<i32> = (0..n)
                    .map(|_| self.rng.random_range(-2_000_000_000..-1_000_000))
                    .collect();
                for (o, x) in offs.iter().zip(v) {
                    d[o / es] = x;
                }
                Data::I(d)
            }
        };
        let leaf = self.push_leaf(Leaf {
            name: name.into(),
            dtype,
            ne: leaf_ne,
            storage,
            data,
        });
        self.push_arg(leaf, steps)
    }

    /// A float operand of shape `ne` with random values of `dist` and a layout of `shape`.
    pub fn float_arg(
        &mut self,
        name: &str,
        ne: [usize; 4],
        dtype: DType,
        dist: Dist,
        shape: Shape,
        mem: Mem,
    ) -> usize {
        let n = ne.iter().product();
        let vals = (0..n).map(|_| round_to(dtype, self.value(dist))).collect();
        self.float_arg_with(name, ne, dtype, vals, shape, mem)
    }

    /// A float operand of shape `ne` holding `values` with a layout of `shape`.
    pub fn float_arg_with(
        &mut self,
        name: &str,
        ne: [usize; 4],
        dtype: DType,
        values: Vec<f32>,
        shape: Shape,
        mem: Mem,
    ) -> usize {
        let (leaf_ne, steps) = self.layout(ne, dtype.block_bytes(), shape);
        self.view_arg(name, leaf_ne, steps, dtype, Data::F(values), mem)
    }

    /// An I32 input operand of shape `ne` holding `values` with a layout of `shape`.
    pub fn int_arg(&mut self, name: &str, ne: [usize; 4], values: &[i32], shape: Shape) -> usize {
        let (leaf_ne, steps) = self.layout(ne, 4, shape);
        self.view_arg(
            name,
            leaf_ne,
            steps,
            DType::I32,
            Data::I(values.to_vec()),
            Mem::Input,
        )
    }

    /// The finished case; an op that can run in place gets a contiguous copy of its first
    /// operand in a quarter of the cases, so that it runs in place over that copy.
    pub fn finish(mut self, op: OpCase, family: &'static str, read_back: bool) -> Case {
        let inplace = matches!(
            op,
            OpCase::Binary(_)
                | OpCase::Scale(_)
                | OpCase::Unary(_)
                | OpCase::RmsNorm(_)
                | OpCase::Norm(_)
                | OpCase::Rope(_)
                | OpCase::DiagMaskInf(_)
                | OpCase::SoftMax(_)
        ) && self.rng.random_bool(0.25);
        Case {
            inplace,
            op,
            family,
            leaves: self.leaves,
            args: self.args,
            read_back,
            seed: self.seed,
        }
    }
}

/// A dimension up to `max`: often 1, often small, sometimes large and odd.
pub fn dim(max: usize) -> BoxedStrategy<usize> {
    prop_oneof![3 => Just(1usize), 4 => 1..=max.min(8), 3 => 1..=max].boxed()
}

/// Halves the largest dimension until the shape has at most `budget` elements.
pub fn fit(mut ne: [usize; 4], budget: usize) -> [usize; 4] {
    while ne.iter().product::<usize>() > budget {
        let i = (0..4).max_by_key(|&i| ne[i]).expect("four dims");
        ne[i] = ne[i].div_ceil(2);
    }
    ne
}

/// A shape with dims up to `max` and at most `budget` elements.
pub fn shape(max: [usize; 4], budget: usize) -> BoxedStrategy<[usize; 4]> {
    (dim(max[0]), dim(max[1]), dim(max[2]), dim(max[3]))
        .prop_map(move |(a, b, c, d)| fit([a, b, c, d], budget))
        .boxed()
}

/// A shape for a row op: usually as [`shape`], sometimes a few wide rows of 256 to 5000
/// elements (where GPU kernels loop over a row with a whole block).
pub fn row_shape(max: [usize; 4], budget: usize) -> BoxedStrategy<[usize; 4]> {
    prop_oneof![
        4 => shape(max, budget),
        1 => (256..=5000usize, 1..=3usize, 1..=2usize).prop_map(|(n0, n1, n2)| [n0, n1, n2, 1]),
    ]
    .boxed()
}

/// The family name of a row-op case of shape `ne`.
fn row_family(ne: [usize; 4]) -> &'static str {
    if ne[0] >= 256 {
        "wide"
    } else {
        "general"
    }
}

/// F32 (most often), F16 or BF16.
pub fn float_dtype() -> BoxedStrategy<DType> {
    prop_oneof![2 => Just(DType::F32), 1 => Just(DType::F16), 1 => Just(DType::BF16)].boxed()
}

/// get_rows: a float table (input or weight, any layout) and I32 ids (any layout).
pub fn get_rows() -> BoxedStrategy<Case> {
    (
        prop_oneof![4 => 1..=70usize, 1 => 256..=4096usize],
        dim(40),
        dim(3),
        1..=2usize,
        1..=20usize,
        float_dtype(),
        any::<u64>(),
    )
        .prop_map(|(ne0, rows, t2, t3, n, dt, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "table",
                [ne0, rows, t2, t3],
                dt,
                Dist::Uniform(1.0),
                Shape::Any,
                Mem::WeightSometimes(0.3),
            );
            let ids: Vec<i32> = (0..n * t2 * t3)
                .map(|_| g.rng.random_range(0..rows as i32))
                .collect();
            g.int_arg("ids", [n, t2, t3, 1], &ids, Shape::Any);
            g.finish(OpCase::GetRows, row_family([ne0, 1, 1, 1]), false)
        })
        .boxed()
}

/// get_rows or set_rows with exactly one id out of range (negative or >= rows), ids
/// of up to three dims (broadcast over the source for set_rows).
pub fn index_out_of_range(set_rows: bool) -> BoxedStrategy<Case> {
    (
        (1..=16usize, 1..=12usize, 1..=12usize),
        (1..=3usize, 1..=2usize),
        float_dtype(),
        any::<u64>(),
    )
        .prop_map(move |((ne0, rows, n), (d2, d3), dt, seed)| {
            let mut g = Gen::new(seed);
            let n = if set_rows { n.min(rows) } else { n };
            // ids [n, i2, i3]: for get_rows the table's dims 2, 3; for set_rows divisors.
            let (i2, i3) = if set_rows {
                (g.divisor(d2), g.divisor(d3))
            } else {
                (d2, d3)
            };
            let mut ids = Vec::with_capacity(n * i2 * i3);
            for _ in 0..i2 * i3 {
                if set_rows {
                    ids.extend(g.distinct(n, rows));
                } else {
                    ids.extend((0..n).map(|_| g.rng.random_range(0..rows as i32)));
                }
            }
            let bad = g.rng.random_range(0..ids.len());
            ids[bad] = if g.rng.random_bool(0.5) {
                rows as i32 + g.rng.random_range(0..3)
            } else {
                -1 - g.rng.random_range(0..3)
            };
            let (mem, shape) = if set_rows {
                (Mem::State, Shape::Contiguous)
            } else {
                (Mem::WeightSometimes(0.5), Shape::Any)
            };
            let name = if set_rows { "cache" } else { "table" };
            g.float_arg(
                name,
                [ne0, rows, d2, d3],
                dt,
                Dist::Uniform(1.0),
                shape,
                mem,
            );
            if set_rows {
                let src_ne = [ne0, n, d2, d3];
                g.float_arg(
                    "src",
                    src_ne,
                    DType::F32,
                    Dist::Uniform(1.0),
                    Shape::Any,
                    Mem::Input,
                );
            }
            g.int_arg("ids", [n, i2, i3, 1], &ids, Shape::Any);
            let op = if set_rows {
                OpCase::SetRows
            } else {
                OpCase::GetRows
            };
            g.finish(op, "out_of_range", false)
        })
        .boxed()
}

/// A [`BinaryOp`] (drawn from `BinaryOp::ALL`): `b` broadcast over `a` with a random
/// divisor per dim, any dtypes/layouts.
pub fn binary() -> BoxedStrategy<Case> {
    (
        prop::sample::select(BinaryOp::ALL),
        shape([70, 24, 6, 3], 3000),
        float_dtype(),
        float_dtype(),
        any::<u64>(),
    )
        .prop_map(move |(op, ne, da, db, seed)| {
            let mut g = Gen::new(seed);
            let nb = ne.map(|d| g.divisor(d));
            g.float_arg(
                "a",
                ne,
                da,
                Dist::Uniform(2.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            g.float_arg(
                "b",
                nb,
                db,
                Dist::Uniform(2.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            g.finish(OpCase::Binary(op), "general", false)
        })
        .boxed()
}

/// A case of one of the [`UnaryOp`]s (drawn from `UnaryOp::ALL`, so a new op is covered
/// once the oracle knows it).
pub fn unary() -> BoxedStrategy<Case> {
    prop::sample::select(UnaryOp::ALL)
        .prop_flat_map(|op| elementwise(OpCase::Unary(op)))
        .boxed()
}

/// A case of scale by a drawn factor.
pub fn scale() -> BoxedStrategy<Case> {
    (-3.0f32..3.0)
        .prop_flat_map(|s| elementwise(OpCase::Scale(s)))
        .boxed()
}

/// A case of the one-operand elementwise `op`.
fn elementwise(op: OpCase) -> BoxedStrategy<Case> {
    (shape([70, 24, 6, 3], 4000), float_dtype(), any::<u64>())
        .prop_map(move |(ne, dt, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "a",
                ne,
                dt,
                Dist::Uniform(4.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            g.finish(op.clone(), "general", false)
        })
        .boxed()
}

/// rms_norm or norm with values away from zero and a random eps.
pub fn norm(rms: bool) -> BoxedStrategy<Case> {
    // Model-sized eps, and large ones that visibly change the result.
    let eps = prop_oneof![Just(1e-6f32), Just(1e-5f32), 1e-7f32..1e-3, 0.01f32..1.0];
    (
        row_shape([130, 24, 4, 2], 4000),
        float_dtype(),
        eps,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(move |(ne, dt, eps, zero_eps, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "a",
                ne,
                dt,
                Dist::AwayFromZero,
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            let op = if rms {
                OpCase::RmsNorm(if zero_eps { 0.0 } else { eps })
            } else {
                OpCase::Norm(eps)
            };
            g.finish(op, row_family(ne), false)
        })
        .boxed()
}

/// mul_mat on random shapes and layouts with GQA broadcast (b2 = a2 * r2, b3 = a3 * r3);
/// src0 any float (sometimes a weight), src1 mostly F32.
pub fn mul_mat() -> BoxedStrategy<Case> {
    let b_dtype = prop_oneof![5 => Just(DType::F32), 1 => Just(DType::F16), 1 => Just(DType::BF16)];
    (
        (1..=70usize, dim(40), dim(12)),
        (1..=3usize, 1..=2usize, 1..=3usize, 1..=2usize),
        float_dtype(),
        b_dtype,
        any::<u64>(),
    )
        .prop_map(|((k, m, n), (a2, a3, r2, r3), da, db, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "a",
                [k, m, a2, a3],
                da,
                Dist::Uniform(1.0),
                Shape::Any,
                Mem::WeightSometimes(0.3),
            );
            g.float_arg(
                "b",
                [k, n, a2 * r2, a3 * r3],
                db,
                Dist::Uniform(1.0),
                Shape::Any,
                Mem::Input,
            );
            g.finish(OpCase::MulMat, "general", false)
        })
        .boxed()
}

/// Decode GEMV: contiguous src0 [k, m] (F32/F16/BF16, k a multiple of 8 or odd) times an
/// F32 vector [k, 1].
pub fn mul_mat_gemv() -> BoxedStrategy<Case> {
    let k = prop_oneof![
        2 => (1..=40usize).prop_map(|x| 8 * x),
        2 => (0..=160usize).prop_map(|x| 2 * x + 1),
        1 => 1000..=4100usize,
    ];
    (k, 1..=64usize, float_dtype(), any::<u64>())
        .prop_map(|(k, m, da, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "w",
                [k, m, 1, 1],
                da,
                Dist::Uniform(1.0),
                Shape::Contiguous,
                Mem::WeightSometimes(0.5),
            );
            g.float_arg(
                "x",
                [k, 1, 1, 1],
                DType::F32,
                Dist::Uniform(1.0),
                Shape::Contiguous,
                Mem::Input,
            );
            g.finish(OpCase::MulMat, "gemv", false)
        })
        .boxed()
}

/// Attention dimensions: head size, KV heads, GQA ratio, context, used KV length.
fn attn_dims() -> BoxedStrategy<(usize, usize, usize, usize, usize)> {
    let hd = prop_oneof![Just(64usize), Just(128usize), 1..=64usize];
    (
        hd,
        1..=4usize,
        1..=4usize,
        2..=48usize,
        any::<prop::sample::Index>(),
    )
        .prop_map(|(hd, nkvh, ratio, ctx, kv)| (hd, nkvh, ratio, ctx, 1 + kv.index(ctx - 1)))
        .boxed()
}

/// The dtype of a KV cache: mostly F16.
fn cache_dtype() -> BoxedStrategy<DType> {
    prop_oneof![6 => Just(DType::F16), 1 => Just(DType::BF16), 1 => Just(DType::F32)].boxed()
}

/// A K cache [hd * nkvh, ctx] (input or state) and the permuted view
/// [hd, n_kv, nkvh] with nb1 = hd * nkvh * es, nb2 = hd * es ("p021").
fn k_cache_view(g: &mut Gen, dt: DType, hd: usize, nkvh: usize, ctx: usize, n_kv: usize) {
    let mem = if g.rng.random_bool(0.4) {
        Mem::State
    } else {
        Mem::Input
    };
    let es = dt.block_bytes();
    let nb = [es, hd * es, hd * nkvh * es, hd * nkvh * n_kv * es];
    let view = ViewStep::View {
        ne: [hd, nkvh, n_kv, 1],
        nb,
        offs: 0,
    };
    let vals = random_values(g, hd * n_kv * nkvh, dt);
    g.view_arg(
        "k_cache",
        [hd * nkvh, ctx, 1, 1],
        vec![view, ViewStep::Permute([0, 2, 1, 3])],
        dt,
        vals,
        mem,
    );
}

/// A transposed V cache [ctx, hd * nkvh] (input or state) and the view [n_kv, hd, nkvh]
/// with nb1 = ctx * es, nb2 = ctx * hd * es ("vec_nc").
fn v_cache_view(g: &mut Gen, dt: DType, hd: usize, nkvh: usize, ctx: usize, n_kv: usize) {
    let mem = if g.rng.random_bool(0.4) {
        Mem::State
    } else {
        Mem::Input
    };
    let es = dt.block_bytes();
    let nb = [es, ctx * es, ctx * hd * es, ctx * hd * nkvh * es];
    let view = ViewStep::View {
        ne: [n_kv, hd, nkvh, 1],
        nb,
        offs: 0,
    };
    let vals = random_values(g, n_kv * hd * nkvh, dt);
    g.view_arg("v_cache", [ctx, hd * nkvh, 1, 1], vec![view], dt, vals, mem);
}

/// Queries [d, n_head, n_tok] permuted to [d, n_tok, n_head] (F32).
fn permuted_q(g: &mut Gen, name: &str, d: usize, n_head: usize, n_tok: usize) {
    let leaf = g.float_leaf(
        name,
        [d, n_head, n_tok, 1],
        DType::F32,
        Dist::Uniform(1.0),
        Mem::Input,
    );
    g.push_arg(leaf, vec![ViewStep::Permute([0, 2, 1, 3])]);
}

/// `n` uniform values in [-1, 1) rounded to `dtype`.
fn random_values(g: &mut Gen, n: usize, dtype: DType) -> Data {
    Data::F(
        (0..n)
            .map(|_| round_to(dtype, g.value(Dist::Uniform(1.0))))
            .collect(),
    )
}

/// Decode attention scores: the permuted K cache view times one permuted query per head
/// ("p021"): [hd, n_kv, nkvh] x [hd, 1, n_head] -> [n_kv, 1, n_head].
pub fn mul_mat_p021() -> BoxedStrategy<Case> {
    (attn_dims(), cache_dtype(), any::<u64>())
        .prop_map(|((hd, nkvh, ratio, ctx, n_kv), dt, seed)| {
            let mut g = Gen::new(seed);
            k_cache_view(&mut g, dt, hd, nkvh, ctx, n_kv);
            permuted_q(&mut g, "q", hd, nkvh * ratio, 1);
            g.finish(OpCase::MulMat, "p021", false)
        })
        .boxed()
}

/// Decode attention output: the transposed V cache view times the probabilities
/// ("vec_nc"): [n_kv, hd, nkvh] x [n_kv, 1, n_head] -> [hd, 1, n_head].
pub fn mul_mat_vec_nc() -> BoxedStrategy<Case> {
    (attn_dims(), cache_dtype(), any::<bool>(), any::<u64>())
        .prop_map(|((hd, nkvh, ratio, ctx, n_kv), dt, permuted, seed)| {
            let mut g = Gen::new(seed);
            v_cache_view(&mut g, dt, hd, nkvh, ctx, n_kv);
            if permuted {
                permuted_q(&mut g, "kq", n_kv, nkvh * ratio, 1);
            } else {
                let n_head = nkvh * ratio;
                g.float_arg(
                    "kq",
                    [n_kv, 1, n_head, 1],
                    DType::F32,
                    Dist::Uniform(1.0),
                    Shape::Contiguous,
                    Mem::Input,
                );
            }
            g.finish(OpCase::MulMat, "vec_nc", false)
        })
        .boxed()
}

/// Prefill attention with GQA broadcast: K view x permuted q [hd, n_tok, n_head], or the
/// V view x probabilities [n_kv, n_tok, n_head] (contiguous or a window).
pub fn mul_mat_prefill() -> BoxedStrategy<Case> {
    (
        attn_dims(),
        2..=12usize,
        cache_dtype(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|((hd, nkvh, ratio, ctx, n_kv), n_tok, dt, kq, seed)| {
            let mut g = Gen::new(seed);
            let n_head = nkvh * ratio;
            if kq {
                k_cache_view(&mut g, dt, hd, nkvh, ctx, n_kv);
                permuted_q(&mut g, "q", hd, n_head, n_tok);
            } else {
                v_cache_view(&mut g, dt, hd, nkvh, ctx, n_kv);
                let shape = if g.rng.random_bool(0.5) {
                    Shape::Contiguous
                } else {
                    Shape::Strided
                };
                g.float_arg(
                    "kq",
                    [n_kv, n_tok, n_head, 1],
                    DType::F32,
                    Dist::Uniform(1.0),
                    shape,
                    Mem::Input,
                );
            }
            g.finish(OpCase::MulMat, "prefill", false)
        })
        .boxed()
}

/// rope: normal and NeoX, partial rotation, random base, sometimes linear and Model 3
/// frequency scaling; positions from a (possibly strided) I32 vector.
pub fn rope() -> BoxedStrategy<Case> {
    let scale = prop_oneof![2 => Just(1.0f32), 1 => 0.1f32..1.0];
    let llama3 = prop_oneof![
        2 => Just(None),
        1 => (1.0f32..16.0, 0.5f32..2.0, 1.0f32..4.0, prop::sample::select(vec![64usize, 512, 8192]))
            .prop_map(|(factor, low, gap, orig)| Some(Llama3Scaling {
                factor,
                low_freq_factor: low,
                high_freq_factor: low + gap,
                original_max_position: orig,
            })),
    ];
    (
        (
            prop_oneof![4 => 2..=64usize, 1 => Just(128usize)],
            dim(8),
            dim(8),
            1..=2usize,
        ),
        float_dtype(),
        any::<bool>(),
        (2.0f64..6.0).prop_map(|e| 10f64.powf(e) as f32),
        scale,
        llama3,
        any::<u64>(),
    )
        .prop_map(
            |((ne0, heads, tokens, ne3), dt, neox, base, freq_scale, llama3, seed)| {
                let mut g = Gen::new(seed);
                let n_dims = if g.rng.random_bool(0.5) {
                    ne0 / 2 * 2
                } else {
                    2 * g.rng.random_range(1..=ne0 / 2)
                };
                let max_pos = if g.rng.random_bool(0.7) { 512 } else { 4096 };
                let pos: Vec<i32> = (0..tokens)
                    .map(|_| g.rng.random_range(0..max_pos))
                    .collect();
                g.float_arg(
                    "x",
                    [ne0, heads, tokens, ne3],
                    dt,
                    Dist::Uniform(1.0),
                    Shape::Any,
                    Mem::WeightSometimes(0.1),
                );
                g.int_arg("pos", [tokens, 1, 1, 1], &pos, Shape::Any);
                let mode = if neox {
                    RopeMode::Neox
                } else {
                    RopeMode::Normal
                };
                let p = RopeParams {
                    mode,
                    n_dims,
                    freq_base: base,
                    freq_scale,
                    llama3,
                };
                g.finish(OpCase::Rope(p), "general", false)
            },
        )
        .boxed()
}

/// cpy into a view of a state tensor: any float dtypes, both sides possibly
/// non-contiguous, shapes that differ with equal element counts.
pub fn cpy() -> BoxedStrategy<Case> {
    (
        shape([40, 12, 4, 3], 1500),
        float_dtype(),
        float_dtype(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(ne, ds, dd, read_back, seed)| {
            let mut g = Gen::new(seed);
            let n = ne.iter().product();
            let dst_ne = match g.rng.random_range(0..3) {
                0 => ne,
                1 => {
                    let mut p = ne;
                    p.shuffle(&mut g.rng);
                    p
                }
                _ => g.factorization(n),
            };
            g.float_arg(
                "src",
                ne,
                ds,
                Dist::Uniform(1.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            g.float_arg(
                "cache",
                dst_ne,
                dd,
                Dist::Uniform(1.0),
                Shape::Any,
                Mem::State,
            );
            g.finish(OpCase::Cpy, "general", read_back)
        })
        .boxed()
}

/// cont of any dtype (I32 included), mostly from non-contiguous layouts.
pub fn cont() -> BoxedStrategy<Case> {
    let dtype = prop_oneof![3 => float_dtype(), 1 => Just(DType::I32)];
    (shape([40, 16, 4, 3], 3000), dtype, any::<u64>())
        .prop_map(|(ne, dt, seed)| {
            let mut g = Gen::new(seed);
            let shape = if g.rng.random_bool(0.8) {
                Shape::Strided
            } else {
                Shape::Any
            };
            if dt == DType::I32 {
                let n: usize = ne.iter().product();
                let vals: Vec<i32> = (0..n).map(|_| g.rng.random()).collect();
                g.int_arg("a", ne, &vals, shape);
            } else {
                g.float_arg(
                    "a",
                    ne,
                    dt,
                    Dist::Uniform(1e3),
                    shape,
                    Mem::WeightSometimes(0.1),
                );
            }
            g.finish(OpCase::Cont, "general", false)
        })
        .boxed()
}

/// cast between every pair of float dtypes, any layout.
pub fn cast() -> BoxedStrategy<Case> {
    (
        shape([40, 16, 4, 3], 3000),
        float_dtype(),
        float_dtype(),
        any::<u64>(),
    )
        .prop_map(|(ne, from, to, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "a",
                ne,
                from,
                Dist::Uniform(4.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            g.finish(OpCase::Cast(to), "general", false)
        })
        .boxed()
}

/// set_rows into a state (or a window of one) with ids broadcast over dims 2 and 3,
/// distinct within each broadcast slice; any float dtypes and layouts.
pub fn set_rows() -> BoxedStrategy<Case> {
    (
        (1..=64usize, 1..=24usize, dim(3), 1..=2usize),
        any::<prop::sample::Index>(),
        float_dtype(),
        float_dtype(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|((ne0, rows, ne2, ne3), n, dd, ds, read_back, seed)| {
            let mut g = Gen::new(seed);
            let n = 1 + n.index(rows);
            let (i2, i3) = (g.divisor(ne2), g.divisor(ne3));
            let mut ids = Vec::new();
            for _ in 0..i2 * i3 {
                ids.extend(g.distinct(n, rows));
            }
            // ids are [n, i2, i3]: the ids of each (i2, i3) column are contiguous in
            // dim 0, which is how `distinct` laid them out.
            let dst_shape = if g.rng.random_bool(0.5) {
                Shape::Contiguous
            } else {
                Shape::Strided
            };
            g.float_arg(
                "cache",
                [ne0, rows, ne2, ne3],
                dd,
                Dist::Uniform(1.0),
                dst_shape,
                Mem::State,
            );
            g.float_arg(
                "src",
                [ne0, n, ne2, ne3],
                ds,
                Dist::Uniform(1.0),
                Shape::Any,
                Mem::Input,
            );
            g.int_arg("ids", [n, i2, i3, 1], &ids, Shape::Any);
            g.finish(OpCase::SetRows, "general", read_back)
        })
        .boxed()
}

/// set_rows into a transposed V cache: state [ctx, D], destination view [1, ctx, D]
/// (nb1 = es, nb2 = ctx * es), source view [1, n, D] of a [D, n] tensor (nb1 = D * es,
/// nb2 = es).
pub fn set_rows_v_transposed() -> BoxedStrategy<Case> {
    let src_dtype = prop_oneof![3 => Just(DType::F32), 1 => Just(DType::F16)];
    (
        1..=48usize,
        1..=64usize,
        any::<prop::sample::Index>(),
        cache_dtype(),
        src_dtype,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(ctx, d, n, dd, ds, read_back, seed)| {
            let mut g = Gen::new(seed);
            let n = 1 + n.index(ctx);
            let ids = g.distinct(n, ctx);
            let cache = g.float_leaf(
                "v_cache",
                [ctx, d, 1, 1],
                dd,
                Dist::Uniform(1.0),
                Mem::State,
            );
            let e = dd.block_bytes();
            g.push_arg(
                cache,
                vec![ViewStep::View {
                    ne: [1, ctx, d, 1],
                    nb: [e, e, ctx * e, ctx * d * e],
                    offs: 0,
                }],
            );
            let e = ds.block_bytes();
            let view = ViewStep::View {
                ne: [1, n, d, 1],
                nb: [e, d * e, e, d * n * e],
                offs: 0,
            };
            let vals = random_values(&mut g, n * d, ds);
            g.view_arg("v", [d, n, 1, 1], vec![view], ds, vals, Mem::Input);
            g.int_arg("ids", [n, 1, 1, 1], &ids, Shape::Any);
            g.finish(OpCase::SetRows, "v_transposed", read_back)
        })
        .boxed()
}

/// diag_mask_inf with a random n_past.
pub fn diag_mask_inf() -> BoxedStrategy<Case> {
    (
        shape([48, 24, 4, 2], 3000),
        float_dtype(),
        any::<prop::sample::Index>(),
        any::<u64>(),
    )
        .prop_map(|(ne, dt, n_past, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "a",
                ne,
                dt,
                Dist::Uniform(2.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            g.finish(
                OpCase::DiagMaskInf(n_past.index(ne[0] + 2)),
                "general",
                false,
            )
        })
        .boxed()
}

/// soft_max with a random scale and no mask, or an F32/F16 mask broadcast over rows and
/// batches that holds some -inf (and sometimes a row of them).
pub fn soft_max() -> BoxedStrategy<Case> {
    let mask =
        prop_oneof![1 => Just(None), 1 => Just(Some(DType::F32)), 1 => Just(Some(DType::F16))];
    let scale = prop_oneof![1 => Just(1.0f32), 3 => -2.0f32..2.0];
    (
        row_shape([70, 24, 4, 2], 4000),
        float_dtype(),
        mask,
        scale,
        any::<u64>(),
    )
        .prop_map(|(ne, dt, mask, scale, seed)| {
            let mut g = Gen::new(seed);
            g.float_arg(
                "a",
                ne,
                dt,
                Dist::Uniform(3.0),
                Shape::Any,
                Mem::WeightSometimes(0.1),
            );
            if let Some(mdt) = mask {
                let mne = [ne[0], g.divisor(ne[1]), g.divisor(ne[2]), g.divisor(ne[3])];
                let n: usize = mne.iter().product();
                let dead_row = g
                    .rng
                    .random_bool(0.2)
                    .then(|| g.rng.random_range(0..n / ne[0]));
                let vals: Vec<f32> = (0..n)
                    .map(|i| {
                        if dead_row == Some(i / ne[0]) || g.rng.random_bool(0.1) {
                            f32::NEG_INFINITY
                        } else {
                            round_to(mdt, g.rng.random_range(-2.0..2.0))
                        }
                    })
                    .collect();
                g.float_arg_with("mask", mne, mdt, vals, Shape::Any, Mem::Input);
            }
            g.finish(OpCase::SoftMax(scale), row_family(ne), false)
        })
        .boxed()
}

/// argmax of distinct values or of values with many ties (no NaN).
pub fn argmax() -> BoxedStrategy<Case> {
    (
        row_shape([70, 16, 4, 2], 4000),
        float_dtype(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(ne, dt, ties, seed)| {
            let mut g = Gen::new(seed);
            let dist = if ties {
                Dist::Ties
            } else {
                Dist::Uniform(10.0)
            };
            g.float_arg("a", ne, dt, dist, Shape::Any, Mem::WeightSometimes(0.1));
            let family = match (ties, row_family(ne)) {
                (true, "wide") => "wide ties",
                (true, _) => "ties",
                (false, f) => f,
            };
            g.finish(OpCase::Argmax, family, false)
        })
        .boxed()
}

/// top_k: rows of 1 to 200k elements (vocabularies), k from 1 to 1024, distinct values
/// or many ties, with -inf, +inf, -0 and NaN sprinkled in some cases.
pub fn top_k() -> BoxedStrategy<Case> {
    let ne = prop_oneof![
        3 => row_shape([70, 8, 3, 2], 2000),
        1 => (1024..=20_000usize, 1..=3usize).prop_map(|(n0, n1)| [n0, n1, 1, 1]),
        1 => (100_000..=200_000usize).prop_map(|n0| [n0, 1, 1, 1]),
        // a mixture of experts' router logits, up to the warp kernel's 256 and past it
        1 => (100..=300usize, 1..=40usize).prop_map(|(n0, n1)| [n0, n1, 1, 1]),
    ];
    (ne, float_dtype(), 0..4usize, any::<u64>())
        .prop_map(|(ne, dt, values, seed)| {
            let mut g = Gen::new(seed);
            let k = match g.rng.random_range(0..5) {
                0 => 1,
                1 => ne[0].min(1024),
                // up to a warp's 32, as a router picks
                2 => g.rng.random_range(1..=ne[0].min(32)),
                _ => g.rng.random_range(1..=ne[0].min(1024)),
            };
            let n: usize = ne.iter().product();
            let dist = if values == 1 {
                Dist::Ties
            } else {
                Dist::Uniform(10.0)
            };
            let specials = [f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, f32::NAN];
            let vals: Vec<f32> = (0..n)
                .map(|_| match values >= 2 && g.rng.random_bool(0.2) {
                    true => specials[g.rng.random_range(0..specials.len() - (3 - values))],
                    false => round_to(dt, g.value(dist)),
                })
                .collect();
            g.float_arg_with("a", ne, dt, vals, Shape::Any, Mem::WeightSometimes(0.1));
            let family = match (values, ne[0] >= 100_000) {
                (_, true) => "vocabulary",
                (1, false) => "ties",
                (2, false) => "infinities",
                (3, false) => "nan",
                _ => row_family(ne),
            };
            g.finish(OpCase::TopK(k), family, false)
        })
        .boxed()
}

/// A case of any op and layout family.
pub fn any_op() -> BoxedStrategy<Case> {
    prop_oneof![
        get_rows(),
        binary(),
        scale(),
        unary(),
        norm(true),
        norm(false),
        mul_mat(),
        mul_mat_gemv(),
        mul_mat_p021(),
        mul_mat_vec_nc(),
        mul_mat_prefill(),
        rope(),
        cpy(),
        cont(),
        cast(),
        set_rows(),
        set_rows_v_transposed(),
        diag_mask_inf(),
        soft_max(),
        argmax(),
        top_k(),
    ]
    .boxed()
}
