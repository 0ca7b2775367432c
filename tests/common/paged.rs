//! The paged_attn cases shared by the CPU test (against an f64 oracle) and the CUDA test
//! (against the CPU on the same inputs): a pool of blocks (16 or 32 positions) with K/V
//! of every cache type in the engine's layout (`[n_kv_dim, n_slots]` rows viewed as
//! `[d, n_slots, n_head_kv]`), random block tables (blocks in any order, blocks shared
//! between sequences), sequences of random lengths (an empty pool row too), query runs of
//! one token (decode) or many (prefill chunks) at random positions, tokens of a sequence
//! together or interleaved with others, padding tokens, GQA, sliding windows, softcapping;
//! [`run`] runs a case on any backend with the arena poisoned and guard bytes after every
//! block, and checks the sentinels after.

use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferRef, DType, Graph, PagedAttnParams, PlanOptions};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::attention::kv_values;
use super::case::{arena_violation, SENTINEL};
use super::GUARD_BYTES;

/// One drawn case.
#[derive(Clone, Debug)]
pub struct Case {
    pub d: usize,
    pub n_head_kv: usize,
    pub group: usize,
    pub k: DType,
    pub v: DType,
    pub p: PagedAttnParams,
    /// Blocks of the pool.
    pub n_blocks: usize,
    /// Columns of the block table (logical blocks per sequence).
    pub max_blocks: usize,
    /// Each sequence's cached positions (its queries see positions below this).
    pub lens: Vec<usize>,
    /// Each sequence's queries: the last `n` of its positions (0: the sequence has no
    /// token in the batch).
    pub queries: Vec<usize>,
    /// Padding tokens (sequence -1).
    pub padding: usize,
    /// Tokens shuffled (a sequence's tokens not adjacent) rather than in runs.
    pub shuffle: bool,
    pub seed: u64,
}

impl Case {
    pub fn n_head(&self) -> usize {
        self.n_head_kv * self.group
    }

    pub fn n_slots(&self) -> usize {
        self.n_blocks * self.p.block_size
    }

    fn n_kv_dim(&self) -> usize {
        self.d * self.n_head_kv
    }
}

/// The drawn inputs of a case.
pub struct Inputs {
    /// `[max_blocks, n_seqs]`.
    pub table: Vec<i32>,
    /// `[2, n_tokens]`: (sequence, position).
    pub seqs: Vec<i32>,
    /// `[d, n_head, n_tokens]`.
    pub q: Vec<f32>,
    pub k_bytes: Vec<u8>,
    pub v_bytes: Vec<u8>,
    /// K and V as the backends read them (rounded or dequantized), `[n_kv_dim, n_slots]`.
    pub k: Vec<f64>,
    pub v: Vec<f64>,
}

/// Draws the block table, the tokens and the values of a case.
pub fn inputs(c: &Case) -> Inputs {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let n_seqs = c.lens.len();
    // Each sequence's blocks: a random draw from the pool, so sequences share some.
    let mut table = vec![0i32; c.max_blocks * n_seqs];
    for s in 0..n_seqs {
        let mut ids: Vec<i32> = (0..c.n_blocks as i32).collect();
        ids.shuffle(&mut rng);
        for (b, id) in ids.iter().cycle().take(c.max_blocks).enumerate() {
            table[s * c.max_blocks + b] = *id;
        }
    }
    let mut tokens: Vec<(i32, i32)> = Vec::new();
    for (s, (&len, &n)) in c.lens.iter().zip(&c.queries).enumerate() {
        for pos in len - n..len {
            tokens.push((s as i32, pos as i32));
        }
    }
    for _ in 0..c.padding {
        let at = rng.random_range(0..=tokens.len());
        tokens.insert(at, (-1, 0));
    }
    if c.shuffle {
        tokens.shuffle(&mut rng);
    }
    let seqs = tokens.iter().flat_map(|&(s, p)| [s, p]).collect();
    let q = (0..c.d * c.n_head() * tokens.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let n = c.n_kv_dim() * c.n_slots();
    let (k_bytes, k) = kv_values(&mut rng, c.k, (n, c.d), None);
    let (v_bytes, v) = kv_values(&mut rng, c.v, (n, c.d), None);
    Inputs {
        table,
        seqs,
        q,
        k_bytes,
        v_bytes,
        k,
        v,
    }
}

/// The f64 oracle: `[d, n_head, n_tokens]`, a plain softmax over each query's visible
/// positions (zeros for padding).
pub fn oracle(c: &Case, x: &Inputs) -> Vec<f64> {
    let (d, n_head, bs) = (c.d, c.n_head(), c.p.block_size);
    let n_tokens = x.seqs.len() / 2;
    let mut out = vec![0f64; d * n_head * n_tokens];
    for t in 0..n_tokens {
        let (s, pos) = (x.seqs[2 * t], x.seqs[2 * t + 1] as usize);
        if s < 0 {
            continue;
        }
        let keys: Vec<usize> = (c.p.first_visible(pos)..=pos)
            .map(|j| x.table[s as usize * c.max_blocks + j / bs] as usize * bs + j % bs)
            .collect();
        for h in 0..n_head {
            let hk = h / c.group;
            let qrow = &x.q[(t * n_head + h) * d..][..d];
            let scores: Vec<f64> = keys
                .iter()
                .map(|&slot| {
                    let krow = &x.k[slot * c.n_kv_dim() + hk * d..][..d];
                    let dot: f64 = qrow.iter().zip(krow).map(|(&a, b)| a as f64 * b).sum();
                    let mut sc = c.p.scale as f64 * dot;
                    if c.p.softcap > 0.0 {
                        let cap = c.p.softcap as f64;
                        sc = cap * (sc / cap).tanh();
                    }
                    sc
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = w.iter().sum();
            let o = &mut out[(t * n_head + h) * d..][..d];
            for (wj, &slot) in w.iter().zip(&keys) {
                let vrow = &x.v[slot * c.n_kv_dim() + hk * d..][..d];
                o.iter_mut().zip(vrow).for_each(|(a, b)| *a += wj / sum * b);
            }
        }
    }
    out
}

/// Runs a case on `be` twice (a backend may replay a captured graph the second time),
/// the arena poisoned with [`SENTINEL`] before each run; fails when a byte outside every
/// tensor changed or an output element still holds the sentinel. Returns the result
/// `[d, n_head, n_tokens]`.
pub fn run(c: &Case, x: &Inputs, be: &mut dyn Backend) -> Result<Vec<f32>, String> {
    run_then(c, x, be, None)
}

/// A product of the attention's result: `w` (`[d * n_head, rows]`, used as F16 weights)
/// by the result seen as `[d * n_head, n_tokens]` columns.
pub struct Product<'a> {
    pub w: &'a [f32],
    pub rows: usize,
}

/// [`run`], with `then` the result of that product of the attention's result (`[rows,
/// n_tokens]`) instead.
pub fn run_then(
    c: &Case,
    x: &Inputs,
    be: &mut dyn Backend,
    then: Option<Product>,
) -> Result<Vec<f32>, String> {
    let e = |e: graft::Error| e.to_string();
    let (d, n_head) = (c.d, c.n_head());
    let n_tokens = x.seqs.len() / 2;
    let mut g = Graph::new();
    let mut buffers = Vec::new();
    let mut pool = |g: &mut Graph, be: &mut dyn Backend, name: &str, dt: DType, bytes: &[u8]| {
        let buf = be.alloc_buffer(bytes.len()).map_err(e)?;
        buffers.push(buf);
        be.write_buffer(buf, 0, bytes).map_err(e)?;
        let at = BufferRef {
            buffer: buf,
            offset: 0,
        };
        let rows = g
            .weight(name, dt, &[c.n_kv_dim(), c.n_slots()], at)
            .map_err(e)?;
        let (row, head) = (dt.row_bytes(c.n_kv_dim()), dt.row_bytes(d));
        g.view_3d(rows, d, c.n_slots(), c.n_head_kv, row, head, 0)
            .map_err(e)
    };
    let result = (|| {
        let k = pool(&mut g, be, "k_pool", c.k, &x.k_bytes)?;
        let v = pool(&mut g, be, "v_pool", c.v, &x.v_bytes)?;
        let q = g
            .input("q", DType::F32, &[d, n_head, n_tokens])
            .map_err(e)?;
        let table = g
            .input("table", DType::I32, &[c.max_blocks, c.lens.len()])
            .map_err(e)?;
        let seqs = g.input("seqs", DType::I32, &[2, n_tokens]).map_err(e)?;
        let y = g.paged_attn(q, (k, v), table, seqs, c.p).map_err(e)?;
        let (y, out_len, w) = match &then {
            None => (y, d * n_head * n_tokens, None),
            Some(p) => {
                let w = g.input("w", DType::F32, &[d * n_head, p.rows]).map_err(e)?;
                let w16 = g.cast(w, DType::F16).map_err(e)?;
                let cols = g.reshape(y, &[d * n_head, n_tokens]).map_err(e)?;
                let out = g.mul_mat(w16, cols).map_err(e)?;
                (out, p.rows * n_tokens, Some((w, p.w)))
            }
        };
        let plan = g
            .plan_with(
                &[y],
                &PlanOptions {
                    guard_bytes: GUARD_BYTES,
                },
            )
            .map_err(e)?;
        let exec = be.load(&plan).map_err(e)?;
        let ran = (|| {
            for _ in 0..2 {
                be.fill_arena(exec, SENTINEL)?;
                be.set_input_f32(exec, q, &x.q)?;
                be.set_input_i32(exec, table, &x.table)?;
                be.set_input_i32(exec, seqs, &x.seqs)?;
                if let Some((w, values)) = w {
                    be.set_input_f32(exec, w, values)?;
                }
                be.compute(exec)?;
            }
            let got = be.get_output_f32(exec, y, out_len)?;
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
        Ok(got)
    })();
    for buf in buffers {
        be.free_buffer(buf).map_err(e)?;
    }
    result
}

/// Writes a NaN into element `i` of a row-major buffer of `dt`: the element itself for
/// float types, the scale of its block for block types (a NaN block scale is what a
/// quantizer makes of a NaN row).
pub fn poison(bytes: &mut [u8], dt: DType, i: usize) {
    match dt {
        DType::F32 => bytes[i * 4..i * 4 + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
        DType::F16 => bytes[i * 2..i * 2 + 2].copy_from_slice(&half::f16::NAN.to_le_bytes()),
        DType::BF16 => bytes[i * 2..i * 2 + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes()),
        _ => {
            let block = i / dt.block_size() * dt.block_bytes();
            bytes[block..block + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
        }
    }
}

/// Cache types, with whole 32-element blocks per head for the block types.
fn cache_type(dt: DType, d: usize) -> DType {
    if dt.quant().is_some() && !d.is_multiple_of(32) {
        DType::F16
    } else {
        dt
    }
}

/// A random case: head dims of the kernels' list, 1-2 KV heads, GQA 1/2/4/8, blocks of 16
/// or 32, 1-8 sequences of 0..=max_blocks * block_size positions, each with 0 queries, one
/// (decode) or a chunk, some padding, sometimes shuffled, windows and softcapping on or
/// off, every cache type for K and V (independently).
pub fn case() -> impl Strategy<Value = Case> {
    let types = vec![
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
    ];
    (
        prop::sample::select(super::attention::HEAD_DIMS.to_vec()),
        (1usize..3, prop::sample::select(vec![1usize, 2, 4, 8])),
        (
            prop::sample::select(types.clone()),
            prop::sample::select(types),
        ),
        (
            prop::sample::select(vec![16usize, 32]),
            1usize..24,
            1usize..12,
        ),
        prop::collection::vec((0.0f64..=1.0, 0usize..3, 0.0f64..1.0), 1..9),
        (0usize..4, prop::bool::weighted(0.2), prop::bool::ANY),
        (prop::sample::select(vec![0usize, 0, 3, 40]), any::<u64>()),
    )
        .prop_map(
            |(d, (n_head_kv, group), (k, v), (bs, n_blocks, max_blocks), seqs, extra, w)| {
                let (padding, shuffle, cap) = extra;
                let (window, seed) = w;
                let limit = max_blocks * bs;
                let mut lens = Vec::new();
                let mut queries = Vec::new();
                for (fill, kind, share) in seqs {
                    let len = (fill * limit as f64) as usize;
                    let n = match kind {
                        _ if len == 0 => 0,
                        0 => 0,
                        1 => 1,
                        _ => ((share * len as f64) as usize).max(1),
                    };
                    lens.push(len);
                    queries.push(n);
                }
                Case {
                    d,
                    n_head_kv,
                    group,
                    k: cache_type(k, d),
                    v: cache_type(v, d),
                    p: PagedAttnParams {
                        scale: 1.0 / (d as f32).sqrt(),
                        softcap: if cap { 2.5 } else { 0.0 },
                        block_size: bs,
                        window,
                    },
                    n_blocks,
                    max_blocks,
                    lens,
                    queries,
                    padding,
                    shuffle,
                    seed,
                }
            },
        )
        .prop_filter("a batch of at least one token", |c| {
            c.padding + c.queries.iter().sum::<usize>() > 0
        })
}
