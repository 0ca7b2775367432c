//! Host-side checks of the tensor-core products' lowering ([`super`]), no GPU needed: how
//! K is split into parts and which column tile a width takes; then products of every
//! weight type (ggml's blocks and split rows) by 1 to 300 F32 columns, strided and with
//! batches broadcast over one weight matrix, are lowered with host addresses; a host
//! interpreter of each launch's contract carries them out (`quantize_q8_1_f32`: the Q8_1
//! activations in the layout of the weight type; `cpy_f32_f16`: the F16 ones; `mmq_*`,
//! `mmh_*`, `mmr_*`: each part of K's sums over the weights as the kernel reads them;
//! `mmq_reduce`), and the result must be the CPU backend's. This checks the dispatch by
//! width and layout, the column tiles and the grid, the parts of K and their scratch, and
//! the activation copies; the kernels' own arithmetic is checked on a GPU
//! (tests/cuda/ops_cuda_quant.rs).

use half::f16;
use rand::{Rng, SeedableRng};

use super::{
    col_tile, f16_column_bytes, f16_from_cols, parts, parts_in_waves, MAX_PARTS, MIN_PART_CHUNKS,
    MMH_FROM_COLS, MMQ_FROM_COLS, MMQ_MAX_COLS,
};
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::args::{
    CpyArgs, MmqArgs, MmqReduceArgs, NormMulArgs, UnaryArgs, ACT_BLOCKS, ACT_F16, ACT_PAIRS, MMH_K,
    MMQ_K, MMQ_ROWS, MMR_K, MMR_ROWS,
};
use crate::backend::cuda::decode::q8_1::q8_1_column_bytes;
use crate::backend::cuda::lowering::{DevOp, Launch, Lowering, QuantPath, REGION_ALIGN};
use crate::backend::cuda::split::SplitRows;
use crate::backend::cuda::tests::{
    args, base, elem, fake_addr_any, kernel_launches, lower_plan, offset, run_cpy,
};
use crate::backend::fusion::batched_type;
use crate::backend::{Backend, BackendExt};
use crate::graph::{BufferId, BufferRef, DType, Graph, Loc, Operand, Plan, TensorId};
use crate::quant::split::{join_row, split_row};
use crate::quant::{dequantize_row, quantize_row, QType};

#[test]
fn parts_cover_k_and_fill_the_gpu() {
    // Llama-2-7B on 132 SMs, 3 blocks an SM: [4096, 4096] by up to 64 columns is 64
    // tiles, split in 7 parts of 5 chunks (the last 2); [11008, 4096] by 64, 172 tiles in
    // 3; 4 column tiles of [4096, 4096] (256 columns) in 2; 512 tiles not at all.
    let slots = 3 * 132;
    assert_eq!(parts(64, 32, slots, 128), (7, 5));
    assert_eq!(parts(172, 32, slots, 128), (3, 11));
    assert_eq!(parts(256, 32, slots, 128), (2, 16));
    assert_eq!(parts(512, 32, slots, 128), (1, 32));
    // mmr_*, 2 blocks an SM of 128 rows, by whole waves: [11008, 4096] (86 tiles) in 3
    // parts; [4096, 4096] (32 tiles) in 8 by 8 columns, 4 by 64 (the partial sums cost
    // more)
    let extra = |n: usize| 2.0 * n as f64 / 2304.0;
    assert_eq!(parts_in_waves(86, 32, 2 * 132, 128, extra(8)), (3, 11));
    assert_eq!(parts_in_waves(86, 32, 2 * 132, 128, extra(64)), (3, 11));
    assert_eq!(parts_in_waves(32, 32, 2 * 132, 128, extra(8)), (8, 4));
    assert_eq!(parts_in_waves(32, 32, 2 * 132, 128, extra(64)), (4, 8));
    // short rows: at most one part per MIN_PART_CHUNKS chunks
    assert_eq!(parts(1, 7, slots, 128), (1, 7));
    assert_eq!(parts(1, 1, slots, 128), (1, 1));
    for tiles in [1, 3, 64, 100, 400, 1000] {
        for chunks in 1..200 {
            let (n, per) = parts(tiles, chunks, slots, 128);
            assert!((1..=MAX_PARTS).contains(&n), "{tiles} {chunks}: {n}");
            // every part has a chunk, and the parts cover K
            assert!(
                (n - 1) * per < chunks && n * per >= chunks,
                "{tiles} {chunks}"
            );
            assert!(n == 1 || per >= MIN_PART_CHUNKS, "{tiles} {chunks}: {per}");
        }
    }
}

#[test]
fn column_tiles_are_the_narrowest_that_hold_the_columns() {
    assert_eq!(
        [1, 8, 9, 16, 17, 32, 33, 64].map(col_tile),
        [8, 8, 16, 16, 32, 32, 64, 64]
    );
    assert_eq!([65, 256, 300].map(col_tile), [64, 64, 64]);
}

/// Byte offset of element `e` (0..32) of sub-block `s` in a column of Q8_1 activations
/// (cuda/quant.cuh, `act_at`).
fn act_at(s: usize, e: usize, layout: i64) -> usize {
    if layout == ACT_PAIRS {
        512 * (s >> 4) + 256 * (s & 1) + 128 * (e >> 4) + 16 * ((s >> 1) & 7) + (e & 15)
    } else {
        256 * (s >> 3) + 128 * (e >> 4) + 16 * (s & 7) + (e & 15)
    }
}

/// Bytes of the quants of a column of `k` activations (`act_quant_bytes`).
fn act_quant_bytes(k: usize) -> usize {
    k.next_multiple_of(512)
}

/// Host version of quantize_q8_1_f32: every row of `src` quantized to Q8_1 by
/// `graft::quant`, its quants and (d, d * sum) pairs laid out as the kernel writes them.
pub(in crate::backend::cuda::lower) fn run_quantize(a: CpyArgs) {
    let k = a.src.ne[0] as usize;
    let rows = a.src.ne[1] * a.src.ne[2] * a.src.ne[3];
    let mut blocks = vec![0u8; k / 32 * 36];
    for r in 0..rows {
        let ix = elem([1, a.src.ne[1], a.src.ne[2], a.src.ne[3]], r);
        let x: Vec<f32> = (0..k as i64)
            // SAFETY: the row lies in the plan's memory with these strides.
            .map(|l| unsafe { read::<f32>(a.src.data, offset(a.src.nb, [l, ix[1], ix[2], ix[3]])) })
            .collect();
        quantize_row(QType::Q8_1, &x, &mut blocks).unwrap();
        let col = a.dst.data as i64 + offset(a.dst.nb, [0, ix[1], ix[2], ix[3]]);
        for (s, blk) in blocks.chunks_exact(36).enumerate() {
            // SAFETY: the column of the Q8_1 copy lies in scratch (q8_1_column_bytes).
            unsafe {
                for e in 0..32 {
                    write(col as u64, act_at(s, e, a.mode) as i64, blk[4 + e]);
                }
                let ds = [blk[0], blk[1], blk[2], blk[3]];
                write(col as u64, (act_quant_bytes(k) + 4 * s) as i64, ds);
            }
        }
    }
}

/// Host version of mmq_*, mmh_* and mmr_*: for each part z of K (grid.z), the sums over
/// its elements of the weights (dequantized from ggml's blocks, or from split rows joined
/// back) times the activations (mmq_*: Q8_1, dequantized; mmh_*, mmr_*: F16), into
/// dst + z m n;
/// checks that the grid covers the product.
fn run_batched(name: &str, grid: (u32, u32, u32), p: MmqArgs) {
    let (family, rest) = name.split_once('_').unwrap();
    let f16_acts = family != "mmq";
    let (split, rest) = match rest.strip_prefix("split_") {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let (bn, q) = rest.strip_prefix('c').unwrap().split_once('_').unwrap();
    let bn: usize = bn.parse().unwrap();
    let q = DType::parse(q).and_then(DType::quant).unwrap();
    let (k, m, n) = (p.k as usize, p.m as usize, p.n as usize);
    let (tiles, parts) = ((grid.0 as usize, grid.1 as usize), grid.2 as usize);
    let rows = match family {
        "mmr" => MMR_ROWS,
        _ => MMQ_ROWS,
    } as usize;
    assert!(
        tiles.0 * bn >= n && (tiles.0 - 1) * bn < n,
        "{name}: {tiles:?} for {n} columns"
    );
    assert!(
        tiles.1 * rows >= m && (tiles.1 - 1) * rows < m,
        "{name}: {tiles:?} for {m} rows"
    );
    let chunk = match family {
        "mmq" => MMQ_K,
        "mmh" => MMH_K,
        _ => MMR_K,
    };
    let part = p.chunks as usize * chunk as usize;
    assert!(
        parts * part >= k && (parts - 1) * part < k,
        "{name}: {parts} parts of {part}"
    );
    let col_bytes = match f16_acts {
        true => f16_column_bytes(k),
        false => q8_1_column_bytes(k),
    };
    assert_eq!(p.b_nb1 as usize, col_bytes);
    let rb = q.row_bytes(k).unwrap();
    let mut w = vec![0f32; m * k];
    for (r, wr) in w.chunks_exact_mut(k).enumerate() {
        let at = p.a + (r as i64 * p.a_nb1) as u64;
        // SAFETY: the weight rows lie in the weights' host buffer.
        let src = unsafe { std::slice::from_raw_parts(at as *const u8, rb) };
        let mut row = src.to_vec();
        if split {
            join_row(q, src, &mut row, at);
        }
        dequantize_row(q, &row, wr).unwrap();
    }
    let column = |c: usize| {
        let col = p.b + (c as i64 * p.b_nb1) as u64;
        match f16_acts {
            // SAFETY: the column of the F16 copy lies in scratch.
            true => (0..k)
                .map(|l| unsafe { f16::from_bits(read::<u16>(col, 2 * l as i64)) }.to_f64())
                .collect(),
            false => q8_1_column(col, k, q),
        }
    };
    let x: Vec<f64> = (0..n).flat_map(column).collect();
    assert!(
        p.res == 0 || parts == 1,
        "{name}: a residual with {parts} parts"
    );
    for z in 0..parts {
        let range = z * part..((z + 1) * part).min(k);
        for c in 0..n {
            for r in 0..m {
                let s: f64 = range
                    .clone()
                    .map(|l| f64::from(w[r * k + l]) * x[c * k + l])
                    .sum();
                let i = (c * m + r) as i64;
                // SAFETY: a residual holds m x n floats.
                let res = if p.res == 0 {
                    0.0
                } else {
                    unsafe { read::<f32>(p.res, 4 * i) }
                };
                // SAFETY: dst holds `parts` products of m x n floats.
                unsafe { write(p.dst, (4 * ((z * n + c) * m + r)) as i64, s as f32 + res) };
            }
        }
    }
}

/// The `k` values of the column of Q8_1 activations at `col` (in scratch) that a product
/// of weights `q` reads, dequantized.
pub(in crate::backend::cuda::lower) fn q8_1_column(col: u64, k: usize, q: QType) -> Vec<f64> {
    let layout = if q.block_size() == 256 {
        ACT_PAIRS
    } else {
        ACT_BLOCKS
    };
    (0..k)
        .map(|l| {
            // SAFETY: the column of the Q8_1 copy lies in scratch.
            let (qv, d) = unsafe {
                let qv = read::<i8>(col, act_at(l / 32, l % 32, layout) as i64);
                let d = read::<u16>(col, (act_quant_bytes(k) + 4 * (l / 32)) as i64);
                (qv, f16::from_bits(d))
            };
            f64::from(qv) * d.to_f64()
        })
        .collect()
}

/// Host version of scale_f32: every element of `src` times the factor into `dst`.
fn run_scale(a: UnaryArgs) {
    for r in 0..a.src.ne[1] * a.src.ne[2] * a.src.ne[3] {
        let ix = elem([1, a.src.ne[1], a.src.ne[2], a.src.ne[3]], r);
        for l in 0..a.src.ne[0] {
            let i = [l, ix[1], ix[2], ix[3]];
            // SAFETY: both rows lie in the plan's memory with these strides.
            unsafe {
                let x = read::<f32>(a.src.data, offset(a.src.nb, i));
                write(a.dst.data, offset(a.dst.nb, i), x * a.scale);
            }
        }
    }
}

/// Host version of mmq_reduce: the parts added in order.
fn run_reduce(p: MmqReduceArgs) {
    for i in 0..p.count {
        let mut s = 0f32;
        for z in 0..p.split {
            // SAFETY: `split` parts of `count` floats at `part`.
            s += unsafe { read::<f32>(p.part, 4 * (z * p.count + i)) };
        }
        if p.res != 0 {
            // SAFETY: a residual holds `count` floats.
            s += unsafe { read::<f32>(p.res, 4 * i) };
        }
        // SAFETY: dst holds `count` floats.
        unsafe { write(p.dst, 4 * i, s) };
    }
}

/// The value of type T at byte `off` from `at`.
///
/// # Safety
/// The bytes lie in memory the test owns.
pub(in crate::backend::cuda::lower) unsafe fn read<T: Copy>(at: u64, off: i64) -> T {
    ((at as i64 + off) as *const T).read_unaligned()
}

/// Writes `v` at byte `off` from `at`.
///
/// # Safety
/// As for [`read`].
pub(in crate::backend::cuda::lower) unsafe fn write<T: Copy>(at: u64, off: i64, v: T) {
    ((at as i64 + off) as *mut T).write_unaligned(v)
}

fn interpret(l: &Launch) {
    match l.kernel.name {
        "quantize_q8_1_f32" => run_quantize(args(l)),
        "mmq_reduce" => run_reduce(args(l)),
        "cpy_f32_f16" => run_cpy(l.kernel.name, args(l)),
        name if ["mmq_", "mmh_", "mmr_"].iter().any(|p| name.starts_with(p)) => {
            run_batched(name, l.grid, args(l))
        }
        "scale_f32" => run_scale(args(l)),
        name => panic!("the interpreter runs no {name}"),
    }
}

/// A product `w [k, m]` (of `q`, in a buffer; frozen in split rows when `split` and its rows
/// can be) by `x [k, n, b2, b3]` (F32 rows `pad` elements apart beyond k); with `residual`
/// (no batches), plus a residual `[m, n]` computed in the graph, so that the add runs in
/// place over it and fuses with the product ([`crate::backend::fusion::Fused::ProductAdd`]).
struct Case {
    q: QType,
    k: usize,
    m: usize,
    cols: [usize; 3],
    pad: usize,
    split: bool,
    residual: bool,
}

/// A case's plan, weight bytes (ggml's layout) and inputs (the activations, then the
/// residual's values when it has one).
type Built = (Plan, Vec<u8>, Vec<(TensorId, Vec<f32>)>);

impl Case {
    /// The plan, the weight bytes and the inputs.
    fn build(&self, buf: BufferId, seed: u64) -> Built {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (k, [n, b2, b3]) = (self.k, self.cols);
        let vals: Vec<f32> = (0..k * self.m)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut bytes = vec![0u8; self.q.row_bytes(k).unwrap() * self.m];
        quantize_row(self.q, &vals, &mut bytes).unwrap();
        let ke = k + self.pad;
        let x: Vec<f32> = (0..ke * n * b2 * b3)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut g = Graph::new();
        let data = BufferRef {
            buffer: buf,
            offset: 0,
        };
        let w = g
            .weight("w", DType::Quant(self.q), &[k, self.m], data)
            .unwrap();
        let xin = g.input("x", DType::F32, &[ke, n, b2, b3]).unwrap();
        let xv = g
            .view_4d(xin, [k, n, b2, b3], ke * 4, ke * 4 * n, ke * 4 * n * b2, 0)
            .unwrap();
        let y = g.mul_mat(w, xv).unwrap();
        let mut inputs = vec![(xin, x)];
        let y = match self.residual {
            false => y,
            true => {
                let r: Vec<f32> = (0..self.m * n)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let rin = g.input("r", DType::F32, &[self.m, n]).unwrap();
                inputs.push((rin, r));
                let r = g.scale(rin, 1.0).unwrap();
                g.add(r, y).unwrap()
            }
        };
        (g.plan(&[y]).unwrap(), bytes, inputs)
    }

    /// Runs the case on the CPU and lowered on `path` through the interpreter; checks the
    /// results agree and returns the launched kernels.
    fn run(&self, path: QuantPath, seed: u64) -> Vec<&'static str> {
        let mut cpu = CpuBackend::new();
        let rb = self.q.row_bytes(self.k).unwrap();
        let buf = cpu.alloc_buffer(rb * self.m).unwrap();
        let (plan, bytes, inputs) = self.build(buf, seed);
        cpu.write_buffer(buf, 0, &bytes).unwrap();
        let e = cpu.load(&plan).unwrap();
        for (id, values) in &inputs {
            cpu.set_input_f32(e, *id, values).unwrap();
        }
        cpu.compute(e).unwrap();
        let out = plan.outputs[0].operand.clone();
        let want = cpu.get_output_f32(e, out.id, out.nelements()).unwrap();

        // The weights in host memory, split when frozen so (the row addresses rotate Q6_K's).
        let mut wmem = vec![0u64; (rb * self.m).div_ceil(8) + 2 * REGION_ALIGN / 8];
        let wbase = base(&mut wmem).next_multiple_of(REGION_ALIGN as u64);
        let region =
            SplitRows::new("w", buf, wbase, 0, self.q, self.k, self.m).filter(|_| self.split);
        for (r, row) in bytes.chunks_exact(rb).enumerate() {
            let at = wbase + (r * rb) as u64;
            // SAFETY: row r of the weights in `wmem`.
            let dst = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, rb) };
            match region {
                Some(_) => split_row(self.q, row, dst, at),
                None => dst.copy_from_slice(row),
            }
        }
        let regions: Vec<SplitRows> = region.into_iter().collect();
        let (ops, mut arena, _scratch) = lower_on_host(&plan, wbase, &regions, path);
        for (id, values) in &inputs {
            let io = plan.inputs.iter().find(|i| i.operand.id == *id).unwrap();
            let Loc::Arena(off) = io.operand.loc else {
                unreachable!()
            };
            bytemuck::cast_slice_mut::<u64, f32>(&mut arena)[off / 4..off / 4 + values.len()]
                .copy_from_slice(values);
        }
        let launches = kernel_launches(&ops);
        let names: Vec<&str> = launches.iter().map(|l| l.kernel.name).collect();
        let tensor_cores = |p: &str| names.iter().any(|n| n.starts_with(p));
        let f16_cores = tensor_cores("mmh_") || tensor_cores("mmr_");
        if tensor_cores("mmq_") || f16_cores {
            // the residual's copy in the graph runs as a scale, its add in the product
            assert_eq!(names.contains(&"scale_f32"), self.residual, "{names:?}");
            assert!(!names.iter().any(|n| n.starts_with("add_")), "{names:?}");
            for l in &launches {
                interpret(l);
            }
            let nmse = output_nmse(&arena, &out, &want);
            // The CPU's Q8_1 offsets go through the f16 d * sum: about 1e-7 of difference
            // from the exact sums of the interpreter on Q8_1 activations. On F16 ones, the
            // CPU's Q8_1 rounding of the activations is the difference, about 5e-6. A
            // wrong column, row or part is 1.
            let bound = if f16_cores { 5e-5 } else { 1e-5 };
            assert!(nmse < bound, "{names:?}: NMSE {nmse:e} against the CPU");
        }
        names
    }
}

/// The NMSE of the F32 result `out` in the host arena against `want`.
pub(in crate::backend::cuda::lower) fn output_nmse(
    arena: &[u64],
    out: &Operand,
    want: &[f32],
) -> f64 {
    let Loc::Arena(off) = out.loc else {
        unreachable!("results live in the arena")
    };
    let got = &bytemuck::cast_slice::<u64, f32>(arena)[off / 4..off / 4 + want.len()];
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (f64::from(*g) - f64::from(*w)).powi(2);
        den += f64::from(*w).powi(2);
    }
    num / den
}

/// Lowers `plan` with host addresses (the arena and scratch in host memory, the weights'
/// buffer at `wbase`), twice like `load`: the operations, the arena and the scratch they
/// point into.
pub(in crate::backend::cuda::lower) fn lower_on_host(
    plan: &Plan,
    wbase: u64,
    split: &[SplitRows],
    path: QuantPath,
) -> (Vec<Vec<DevOp>>, Vec<u64>, Vec<u64>) {
    let lower = |arena: u64, scratch: u64| {
        let resolve = move |loc: Loc| match loc {
            Loc::Arena(off) => arena + off as u64,
            Loc::Buffer(_, off) => wbase + off as u64,
        };
        let mut lw = Lowering {
            scratch_base: scratch,
            split,
            quant_path: path,
            ..Lowering::new(&resolve, true, 1)
        };
        let ops = lower_plan(plan, &mut lw, true, |_| 0)
            .unwrap_or_else(|(s, e)| panic!("{} not supported: {e}", s.name));
        (ops, lw.scratch_need)
    };
    let (_, scratch) = lower(0, 0);
    let mut arena = vec![0u64; plan.arena_bytes.div_ceil(8)];
    let mut scratch_mem = vec![0u64; scratch.div_ceil(8) + 1];
    let (ops, need) = lower(base(&mut arena), base(&mut scratch_mem));
    assert_eq!(need, scratch);
    (ops, arena, scratch_mem)
}

/// Every weight type in ggml's blocks and in split rows, by column counts that take each
/// column tile, with parts of K (few row tiles, long rows) and without, rows past the last
/// whole chunk (the 32-element types at 416 elements), strided columns, batches of
/// activations broadcast over the weights, and residual adds taken by the product (one part
/// of K, and parts added by `mmq_reduce`): the CPU's results, and the split kernels
/// exactly when the rows are split.
#[test]
fn mmq_products_match_the_cpu() {
    // every block type with batched products (the others take the F16 copy for cuBLAS)
    let types = QType::ALL.into_iter().filter(|&q| batched_type(q));
    for (i, q) in types.enumerate() {
        let (whole, short) = if q.block_size() == 32 {
            (4096, 416)
        } else {
            (2304, 768)
        };
        // (k, rows, columns, padding, split rows, a residual add)
        let cases = [
            (whole, 70, [9, 1, 1], 0, true, true),
            (short, 130, [12, 1, 1], 3, false, false),
            (whole, 70, [20, 1, 1], 0, false, false),
            (short, 130, [40, 1, 1], 3, false, true),
            (short, 33, [5, 3, 2], 0, true, false),
            (whole, 100, [MMQ_MAX_COLS, 1, 1], 0, true, false),
        ];
        for (j, (k, m, cols, pad, split, residual)) in cases.into_iter().enumerate() {
            let case = Case {
                q,
                k,
                m,
                cols,
                pad,
                split,
                residual,
            };
            let names = case.run(QuantPath::Auto, (10 * i + j) as u64);
            let splits = split && crate::quant::split::splittable(q, k);
            let what = format!("{q} [{k}, {m}] by {cols:?}, split {split}: {names:?}");
            let product = names
                .iter()
                .find(|n| {
                    ["mmq_c", "mmq_s", "mmh_", "mmr_"]
                        .iter()
                        .any(|p| n.starts_with(p))
                })
                .expect(&what);
            assert_eq!(product.contains("_split_"), splits, "{what}");
            let n = cols.iter().product::<usize>();
            // on F16 tensor cores, the 32-element types unpack in registers
            let f16 = match q.block_size() {
                32 => "mmr_",
                _ => "mmh_",
            };
            let from = f16_from_cols(DType::Quant(q), true);
            assert_eq!(product.starts_with(f16), n >= from, "{what}");
            // a few tiles of long rows split K (2304 / 4096 elements: 18 / 32 chunks), short
            // rows (6 / 4 chunks) do not
            assert_eq!(names.contains(&"mmq_reduce"), k == whole, "{what}");
        }
    }
}

/// The widths each path takes: decode kernels below `MMQ_FROM_COLS` columns of one
/// matrix, the F16 tensor-core product from there (and in batches) up to `MMQ_MAX_COLS`
/// for Q4_0 (a type of `mmr_*`; the int8 one below `MMH_FROM_COLS` for the K-quants, or
/// with `mmr_*` off), cuBLAS on the F16 copy beyond; the forced paths take every width
/// they can, and the forced tensor-core products compute the CPU's results at widths Auto
/// gives to the others.
#[test]
fn quant_paths_follow_the_thresholds() {
    let case = |n: usize, b2: usize| Case {
        q: QType::Q4_0,
        k: 256,
        m: 40,
        cols: [n, b2, 1],
        pad: 0,
        split: false,
        residual: false,
    };
    let gemm = "cublasGemmEx";
    for (n, b2, auto, dequant, mmq) in [
        (
            1,
            1,
            "mul_mat_vec_q_c1_q4_0",
            "mul_mat_vec_q_c1_q4_0",
            "mmq_c8_q4_0",
        ),
        (
            MMQ_FROM_COLS - 1,
            1,
            "mul_mat_vec_q_c4_q4_0",
            "mul_mat_vec_q_c4_q4_0",
            "mmq_c8_q4_0",
        ),
        (
            MMQ_FROM_COLS,
            1,
            "mmr_c8_q4_0",
            "mul_mat_vec_q_c8_q4_0",
            "mmq_c8_q4_0",
        ),
        (8, 1, "mmr_c8_q4_0", "mul_mat_vec_q_c8_q4_0", "mmq_c8_q4_0"),
        (4, 2, "mmr_c8_q4_0", "cublasGemmBatchedEx", "mmq_c8_q4_0"),
        (9, 1, "mmr_c16_q4_0", gemm, "mmq_c16_q4_0"),
        (MMH_FROM_COLS - 1, 1, "mmr_c16_q4_0", gemm, "mmq_c16_q4_0"),
        (MMH_FROM_COLS, 1, "mmr_c16_q4_0", gemm, "mmq_c16_q4_0"),
        (MMQ_MAX_COLS, 1, "mmr_c64_q4_0", gemm, "mmq_c64_q4_0"),
        (MMQ_MAX_COLS + 1, 1, gemm, gemm, "mmq_c64_q4_0"),
    ] {
        let c = case(n, b2);
        let last = |path| lowered(&c, path, true).pop().expect("a launch");
        assert_eq!(last(QuantPath::Auto), auto, "{n} x {b2}");
        // with mmr_* off, the int8 product below MMH_FROM_COLS and mmh_* from there
        let without = lowered(&c, QuantPath::Auto, false).pop().expect("a launch");
        let want = match (n * b2, auto.strip_prefix("mmr_")) {
            (w, Some(rest)) if w < MMH_FROM_COLS => format!("mmq_{rest}"),
            (_, Some(rest)) => format!("mmh_{rest}"),
            (_, None) => auto.to_string(),
        };
        assert_eq!(without, want, "{n} x {b2}, mmr_* off");
        assert_eq!(last(QuantPath::Dequant), dequant, "{n} x {b2}");
        // run: the forced products must still be the CPU's
        let names = c.run(QuantPath::Mmq, 7);
        assert_eq!(names.last(), Some(&mmq), "{n} x {b2}: {names:?}");
        let names = c.run(QuantPath::Mmh, 7);
        let mmr = mmq.replace("mmq_", "mmr_");
        assert_eq!(names.last(), Some(&mmr.as_str()), "{n} x {b2}: {names:?}");
    }
}

/// The names of the operations `c` lowers to on `path`, with `mmr_*` or not (fake
/// addresses: nothing runs).
fn lowered(c: &Case, path: QuantPath, mmr: bool) -> Vec<&'static str> {
    let (plan, _, _) = c.build(BufferId(1), 1);
    let mut lw = Lowering {
        quant_path: path,
        mmr,
        ..Lowering::new(&fake_addr_any, true, 1)
    };
    let ops = lower_plan(&plan, &mut lw, true, |_| 0).unwrap();
    ops.iter().flatten().map(DevOp::name).collect()
}

/// The operations of `plan` lowered with fake addresses and scratch at 2^44.
fn lower_with_scratch(plan: &Plan) -> Vec<Vec<DevOp>> {
    let mut lw = Lowering {
        scratch_base: 1 << 44,
        ..Lowering::new(&fake_addr_any, true, 1)
    };
    lower_plan(plan, &mut lw, true, |_| 0).unwrap()
}

/// An RMS norm times its weight of an input [k, n] (what the fusion pass makes one step).
fn normed(g: &mut Graph, k: usize, n: usize) -> TensorId {
    let x = g.input("x", DType::F32, &[k, n]).unwrap();
    let nw = g.input("nw", DType::F32, &[k]).unwrap();
    let h = g.rms_norm(x, 1e-5).unwrap();
    g.mul(h, nw).unwrap()
}

/// A fused RMS norm whose result feeds an int8 tensor-core product writes the product's
/// Q8_1 activations itself (no quantizing launch), and the product's parts of K take
/// scratch after that copy, not over it.
#[test]
fn fused_norm_writes_the_mmq_activations() {
    let mut g = Graph::new();
    let (k, n) = (4096, 12);
    let h = normed(&mut g, k, n);
    let data = BufferRef {
        buffer: BufferId(1),
        offset: 0,
    };
    let w = g
        .weight("w", DType::Quant(QType::Q4_K), &[k, 64], data)
        .unwrap();
    let y = g.mul_mat(w, h).unwrap();
    let ops = lower_with_scratch(&g.plan(&[y]).unwrap());
    let launches = kernel_launches(&ops);
    let names: Vec<&str> = launches.iter().map(|l| l.kernel.name).collect();
    assert_eq!(
        names,
        ["rms_norm_mul_f32_f32", "mmq_c16_q4_k", "mmq_reduce"],
        "{names:?}"
    );
    let norm: NormMulArgs = args(launches[0]);
    let mmq: MmqArgs = args(launches[1]);
    assert_eq!((norm.q8, norm.q8_layout), (mmq.b, ACT_PAIRS));
    assert_eq!(norm.q8_nb1, mmq.b_nb1);
    // the partial sums start past the copy's n columns
    assert!(mmq.dst >= mmq.b + (n as u64) * mmq.b_nb1 as u64, "{mmq:?}");
}

/// Products on F16 tensor cores read an F16 copy of their activations, which the fused
/// norm before them writes (no copying launch, no Q8_1 copy), once for the products of the
/// same activations (a layer's gate and up), with the parts of K after it.
#[test]
fn f16_products_share_one_copy_of_their_activations() {
    let mut g = Graph::new();
    let (k, n) = (4096, 24);
    let h = normed(&mut g, k, n);
    let weight = |g: &mut Graph, name: &str, offset: usize| {
        let data = BufferRef {
            buffer: BufferId(1),
            offset,
        };
        g.weight(name, DType::Quant(QType::Q4_K), &[k, 64], data)
            .unwrap()
    };
    let (wg, wu) = (weight(&mut g, "gate", 0), weight(&mut g, "up", 1 << 20));
    let gate = g.mul_mat(wg, h).unwrap();
    let up = g.mul_mat(wu, h).unwrap();
    let y = g.mul(gate, up).unwrap();
    let ops = lower_with_scratch(&g.plan(&[y]).unwrap());
    let launches = kernel_launches(&ops);
    let names: Vec<&str> = launches.iter().map(|l| l.kernel.name).collect();
    let product = "mmh_c32_q4_k";
    assert_eq!(
        names[..5],
        [
            "rms_norm_mul_f32_f32",
            product,
            "mmq_reduce",
            product,
            "mmq_reduce"
        ],
        "{names:?}"
    );
    let norm: NormMulArgs = args(launches[0]);
    assert_eq!(norm.q8_layout, ACT_F16, "an F16 copy: {norm:?}");
    let (first, second): (MmqArgs, MmqArgs) = (args(launches[1]), args(launches[3]));
    assert_eq!((first.b, second.b), (norm.q8, norm.q8));
    assert_eq!(first.b_nb1 as usize, f16_column_bytes(k));
    assert_eq!(norm.q8_nb1, first.b_nb1);
    for p in [first, second] {
        assert!(p.dst >= p.b + (n as u64) * p.b_nb1 as u64, "{p:?}");
    }
}
