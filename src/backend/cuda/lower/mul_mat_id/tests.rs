//! Host-side checks of mul_mat_id's lowering ([`super`]), no GPU needed: which kernels a
//! block's gate, up and down products take at decode and prefill widths, what they share
//! in scratch; and decode steps of every shape the decode kernels take, lowered with host
//! addresses and carried out by a host interpreter of the launches' contract
//! (`quantize_q8_1_f32`, `mul_mat_vec_id_q*_<type>`: each column's expert, input column
//! and output column as `QGemvIdArgs` says), against the CPU backend. The kernels' own
//! arithmetic is checked on a GPU (tests/cuda/mul_mat_id.rs).

use rand::{Rng, SeedableRng};

use super::DECODE_MAX_TOKENS;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::args::{
    CpyArgs, GluArgs, MmqIdArgs, MulMatIdArgs, QGemvIdArgs, GEMV_WARPS,
};
use crate::backend::cuda::decode::q8_1::q8_1_column_bytes;
use crate::backend::cuda::decode::quant::in_place_alignment;
use crate::backend::cuda::lower::mmq::tests::{
    lower_on_host, output_nmse, q8_1_column, read, run_quantize, write,
};
use crate::backend::cuda::lowering::{DevOp, Launch, Lowering, QuantPath, REGION_ALIGN};
use crate::backend::cuda::tests::{args, base, fake_addr_any, kernel_launches, lower_plan};
use crate::backend::{Backend, BackendExt};
use crate::graph::{BufferId, BufferRef, DType, Graph, Loc, Plan, TensorId};
use crate::ops::UnaryOp;
use crate::quant::{dequantize_row, quantize_row, QType};

const SCRATCH: u64 = 1 << 50;

/// A mixture's gate, up and down products over `n_tokens` tokens (8 experts of
/// 256 x 256 weights of `dt`, 2 a token), lowered.
fn experts_block(dt: DType, n_tokens: usize) -> Vec<Vec<DevOp>> {
    experts_block_of([dt; 3], n_tokens, QuantPath::Auto)
}

/// [`experts_block`] with gate, up and down weights of the dtypes `dts`, on `path`.
fn experts_block_of(dts: [DType; 3], n_tokens: usize, path: QuantPath) -> Vec<Vec<DevOp>> {
    experts_block_fused(dts, n_tokens, path, false)
}

/// [`experts_block_of`], the product `up * silu(gate)` as the model builds it, lowered
/// with fusion when `fused`.
fn experts_block_fused(
    dts: [DType; 3],
    n_tokens: usize,
    path: QuantPath,
    fused: bool,
) -> Vec<Vec<DevOp>> {
    let (k, m, n_expert, n_used) = (256, 256, 8, 2);
    let mut g = Graph::new();
    let at = |offset| BufferRef {
        buffer: BufferId(1),
        offset,
    };
    let bytes = dts.map(|dt| dt.row_bytes(k) * m * n_expert);
    let gate = g.weight("gate", dts[0], &[k, m, n_expert], at(0)).unwrap();
    let up = g
        .weight("up", dts[1], &[k, m, n_expert], at(bytes[0]))
        .unwrap();
    let down = g
        .weight("down", dts[2], &[m, k, n_expert], at(bytes[0] + bytes[1]))
        .unwrap();
    let x = g.input("x", DType::F32, &[k, 1, n_tokens]).unwrap();
    let ids = g.input("ids", DType::I32, &[n_used, n_tokens]).unwrap();
    let a = g.mul_mat_id(gate, x, ids).unwrap();
    let b = g.mul_mat_id(up, x, ids).unwrap();
    let a = g.unary(UnaryOp::Silu, a).unwrap();
    let h = match fused {
        true => g.mul(b, a).unwrap(),
        false => g.mul(a, b).unwrap(),
    };
    let y = g.mul_mat_id(down, h, ids).unwrap();
    let plan = g.plan(&[y]).unwrap();
    let mut lw = Lowering {
        scratch_base: SCRATCH,
        quant_path: path,
        ..Lowering::new(&fake_addr_any, true, 1)
    };
    lower_plan(&plan, &mut lw, fused, |_| 0).unwrap()
}

/// Fused, a decode step's block takes one launch for the up and gate products (the gate
/// in the grid's upper half of rows, the same Q8_1 inputs and ids), one SwiGLU launch
/// that writes the down product's Q8_1 inputs, and the down product; one token past the
/// decode kernels, or the tensor cores forced, and the pair is two launches again.
#[test]
fn fused_decode_experts_pair_up_and_gate() {
    for (dt, kernel) in [
        (DType::Q4_K, "mul_mat_vec_id_qd_q4_k"),
        (DType::Q4_0, "mul_mat_vec_id_q_q4_0"),
    ] {
        for n_tokens in 1..=DECODE_MAX_TOKENS {
            let ops = experts_block_fused([dt; 3], n_tokens, QuantPath::Auto, true);
            let launches = kernel_launches(&ops);
            let names: Vec<&str> = launches.iter().map(|l| l.kernel.name).collect();
            let quant = "quantize_q8_1_f32";
            assert_eq!(names, [quant, kernel, "swiglu_f32", kernel], "{dt}");
            let [up_gate, down]: [QGemvIdArgs; 2] = [1, 3].map(|i| args(launches[i]));
            let swiglu = args::<GluArgs>(launches[2]);
            let q = args::<CpyArgs>(launches[0]);
            assert_eq!(launches[1].grid.1, 2 * 2 * n_tokens as u32, "{dt}");
            assert_eq!(launches[3].grid.1, 2 * n_tokens as u32, "{dt}");
            // up first (the model's order), the gate's experts right before it
            let bytes = (dt.row_bytes(256) * 256 * 8) as u64;
            assert_eq!(up_gate.a2 + bytes, up_gate.a, "{dt}");
            assert_eq!(
                (up_gate.b, swiglu.up.data, swiglu.gate.data),
                (q.dst.data, up_gate.dst, up_gate.dst2)
            );
            assert_eq!((down.a2, down.b), (0, swiglu.q8), "{dt}");
        }
        for (n_tokens, path) in [
            (DECODE_MAX_TOKENS + 1, QuantPath::Auto),
            (1, QuantPath::Mmq),
        ] {
            let ops = experts_block_fused([dt; 3], n_tokens, path, true);
            let names: Vec<&str> = kernel_launches(&ops)
                .iter()
                .map(|l| l.kernel.name)
                .collect();
            assert!(
                !names.iter().any(|n| n.starts_with("mul_mat_vec_id")),
                "{names:?}"
            );
        }
    }
}

/// The launches of `ops` of mul_mat_id's own kernels and of the Q8_1 copies they read.
fn moe_launches(ops: &[Vec<DevOp>]) -> Vec<&Launch> {
    kernel_launches(ops)
        .into_iter()
        .filter(|l| {
            ["mul_mat_vec_id", "mul_mat_id", "mmq_id", "group", "quant"]
                .iter()
                .any(|p| l.kernel.name.starts_with(p))
        })
        .collect()
}

/// A prefill's products of block-quantized experts run on the tensor cores: one
/// grouping with its tiles for the three, one Q8_1 copy for the gate and up products'
/// shared inputs and one for the down product's, both past the grouping in scratch,
/// and every product reads the grouping and tiles the grouping wrote.
#[test]
fn prefill_experts_take_the_tensor_cores() {
    let ops = experts_block(DType::Q4_K, 64);
    let ours = moe_launches(&ops);
    let names: Vec<&str> = ours.iter().map(|l| l.kernel.name).collect();
    assert_eq!(
        names,
        [
            "group_by_expert",
            "quantize_q8_1_f32",
            "mmq_id_c16_q4_k",
            "mmq_id_c16_q4_k",
            "quantize_q8_1_f32",
            "mmq_id_c16_q4_k"
        ]
    );
    let group: MulMatIdArgs = args(ours[0]);
    // 128 columns of 8 experts: 128 / 8 = 16 a tile; at most 128 / 16 + 8 tiles
    assert_eq!((group.tile_bn, group.tiles), (16, 16));
    let end = [
        group.offsets,
        group.cols,
        group.tile_expert,
        group.tile_first,
    ]
    .iter()
    .max()
    .unwrap()
        + 16 * 4;
    let mmqs: Vec<MmqIdArgs> = [2, 3, 5].iter().map(|&i| args(ours[i])).collect();
    for p in &mmqs {
        assert_eq!(
            (p.offsets, p.cols, p.tile_expert, p.tile_first),
            (
                group.offsets,
                group.cols,
                group.tile_expert,
                group.tile_first
            )
        );
        assert!(p.b >= end, "the Q8_1 copy overlaps the grouping");
    }
    assert_eq!(mmqs[0].b, mmqs[1].b, "gate and up share their inputs' copy");
    assert_eq!((mmqs[0].b1, mmqs[2].b1, mmqs[2].n_used), (1, 2, 2));
    assert_eq!(ours[2].grid, (16, 4, 1));
}

/// Float experts and block types without tensor-core kernels keep the
/// dequantizing kernel, grouped once for the three products.
#[test]
fn other_experts_keep_the_dequantizing_kernel() {
    for (dt, kernel) in [
        (DType::F16, "mul_mat_id_f16"),
        (DType::IQ4_XS, "mul_mat_id_iq4_xs"),
    ] {
        let ops = experts_block(dt, 64);
        let names: Vec<&str> = kernel_launches(&ops)
            .iter()
            .map(|l| l.kernel.name)
            .filter(|n| n.starts_with("mul_mat_id") || n.starts_with("group"))
            .collect();
        assert_eq!(names, ["group_by_expert", kernel, kernel, kernel]);
    }
}

/// A decode step's products of block-quantized experts (up to `DECODE_MAX_TOKENS` tokens)
/// take the decode kernels, with no grouping: the gate's Q8_1 copy of the shared inputs
/// serves the up product, the down product quantizes its own, a grid row of blocks a
/// column (2 a token), the Q4_K and IQ4_XS experts' aligned rows read in place; one token more, or
/// the tensor cores forced, and they take the grouped tensor-core product.
#[test]
fn decode_experts_take_the_decode_kernels() {
    for (dt, kernel) in [
        (DType::Q4_K, "mul_mat_vec_id_qd_q4_k"),
        (DType::Q6_K, "mul_mat_vec_id_q_q6_k"),
        (DType::Q4_0, "mul_mat_vec_id_q_q4_0"),
        (DType::IQ4_XS, "mul_mat_vec_id_qd_iq4_xs"),
    ] {
        for n_tokens in 1..=DECODE_MAX_TOKENS {
            let ops = experts_block(dt, n_tokens);
            let ours = moe_launches(&ops);
            let names: Vec<&str> = ours.iter().map(|l| l.kernel.name).collect();
            let quant = "quantize_q8_1_f32";
            assert_eq!(names, [quant, kernel, kernel, quant, kernel], "{dt}");
            let [gate, up, down]: [QGemvIdArgs; 3] = [1, 2, 4].map(|i| args(ours[i]));
            let [qx, qh]: [CpyArgs; 2] = [0, 3].map(|i| args(ours[i]));
            assert_eq!(
                (gate.b, up.b, down.b),
                (qx.dst.data, qx.dst.data, qh.dst.data)
            );
            assert_eq!((gate.b1, down.b1, down.n_used), (1, 2, 2));
            assert_eq!(
                (gate.a_nb2, gate.n_expert),
                (dt.row_bytes(256) as i64 * 256, 8)
            );
            assert_eq!(gate.b_nb1, q8_1_column_bytes(256) as i64);
            for l in [1, 2, 4] {
                assert_eq!(
                    ours[l].grid,
                    (256 / GEMV_WARPS as u32, 2 * n_tokens as u32, 1)
                );
            }
        }
        let tiled = [DType::Q4_K, DType::Q6_K, DType::Q4_0].contains(&dt);
        for (n_tokens, path) in [
            (DECODE_MAX_TOKENS + 1, QuantPath::Auto),
            (1, QuantPath::Mmq),
        ] {
            let ops = experts_block_of([dt; 3], n_tokens, path);
            let names: Vec<&str> = moe_launches(&ops).iter().map(|l| l.kernel.name).collect();
            assert_eq!(names[0], "group_by_expert", "{dt} {n_tokens} {path:?}");
            let product = if tiled { "mmq_id_c8" } else { "mul_mat_id_" };
            assert!(
                names[1..].iter().any(|n| n.starts_with(product)),
                "{names:?}"
            );
            assert!(
                !names.iter().any(|n| n.starts_with("mul_mat_vec_id")),
                "{names:?}"
            );
        }
    }
}

/// Float experts keep the dequantizing kernel at decode widths too.
#[test]
fn float_decode_experts_keep_the_dequantizing_kernel() {
    let ops = experts_block(DType::F16, 1);
    let names: Vec<&str> = moe_launches(&ops).iter().map(|l| l.kernel.name).collect();
    let kernel = "mul_mat_id_f16";
    assert_eq!(names, ["group_by_expert", kernel, kernel, kernel]);
}

/// A decode product between two float ones over the same ids writes its Q8_1 copy where
/// the first one's grouping lies in scratch, so the last one groups the columns again
/// instead of reading what the copy left there; a decode product neither makes nor reads
/// a grouping.
#[test]
fn decode_experts_leave_no_stale_grouping() {
    let ops = experts_block_of([DType::F16, DType::Q4_K, DType::F16], 1, QuantPath::Auto);
    let ours = moe_launches(&ops);
    let names: Vec<&str> = ours.iter().map(|l| l.kernel.name).collect();
    assert_eq!(
        names,
        [
            "group_by_expert",
            "mul_mat_id_f16",
            "quantize_q8_1_f32",
            "mul_mat_vec_id_qd_q4_k",
            "group_by_expert",
            "mul_mat_id_f16",
        ]
    );
    let group: MulMatIdArgs = args(ours[0]);
    let copy: CpyArgs = args(ours[2]);
    assert!(
        copy.dst.data <= group.cols,
        "the copy at {:#x} does not overwrite the grouping at {:#x}",
        copy.dst.data,
        group.cols
    );
    let regroup: MulMatIdArgs = args(ours[4]);
    assert_eq!((regroup.offsets, regroup.cols), (group.offsets, group.cols));
}

/// A decode step's mul_mat_id of `n_expert` experts [k, m] of `q` (at byte `offset` of
/// their buffer) by `n_tokens` tokens of `n_used` experts each, with inputs shared by a
/// token's experts (`b1` 1) or one each (`b1` = `n_used`), `pad` elements apart.
#[derive(Debug)]
struct Decode {
    q: QType,
    k: usize,
    m: usize,
    n_expert: usize,
    n_used: usize,
    b1: usize,
    n_tokens: usize,
    pad: usize,
    offset: usize,
}

/// The plan of `c` over weights in `buf`: the plan, the inputs' and the ids' leaves.
fn decode_plan(c: &Decode, buf: BufferId) -> (Plan, TensorId, TensorId) {
    let mut g = Graph::new();
    let data = BufferRef {
        buffer: buf,
        offset: c.offset,
    };
    let shape = [c.k, c.m, c.n_expert];
    let w = g.weight("w", DType::Quant(c.q), &shape, data).unwrap();
    let kp = c.k + c.pad;
    let x = g.input("x", DType::F32, &[kp, c.b1, c.n_tokens]).unwrap();
    let xv = g
        .view_3d(x, c.k, c.b1, c.n_tokens, kp * 4, kp * c.b1 * 4, 0)
        .unwrap();
    let ids = g.input("ids", DType::I32, &[c.n_used, c.n_tokens]).unwrap();
    let y = g.mul_mat_id(w, xv, ids).unwrap();
    (g.plan(&[y]).unwrap(), x, ids)
}

impl Decode {
    /// Runs the case on the CPU and lowered through the interpreter with random weights,
    /// inputs and ids (repeats allowed); checks the results agree and returns the kernels.
    fn run(&self, seed: u64) -> Vec<&'static str> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let rows = self.m * self.n_expert;
        let vals: Vec<f32> = (0..self.k * rows)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let rb = self.q.row_bytes(self.k).unwrap();
        let mut bytes = vec![0u8; rb * rows];
        quantize_row(self.q, &vals, &mut bytes).unwrap();
        let x: Vec<f32> = (0..(self.k + self.pad) * self.b1 * self.n_tokens)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let ids: Vec<i32> = (0..self.n_used * self.n_tokens)
            .map(|_| rng.random_range(0..self.n_expert as i32))
            .collect();

        let mut cpu = CpuBackend::new();
        let buf = cpu.alloc_buffer(self.offset + bytes.len()).unwrap();
        let (plan, xt, idt) = decode_plan(self, buf);
        cpu.write_buffer(buf, self.offset, &bytes).unwrap();
        let e = cpu.load(&plan).unwrap();
        cpu.set_input_f32(e, xt, &x).unwrap();
        cpu.set_input_i32(e, idt, &ids).unwrap();
        cpu.compute(e).unwrap();
        let out = plan.outputs[0].operand.clone();
        let want = cpu.get_output_f32(e, out.id, out.nelements()).unwrap();

        let mut wmem = vec![0u64; (self.offset + bytes.len()).div_ceil(8) + REGION_ALIGN / 8];
        let wbase = base(&mut wmem).next_multiple_of(REGION_ALIGN as u64);
        // SAFETY: the weights' buffer lies in `wmem` from `wbase`.
        let wbuf =
            unsafe { std::slice::from_raw_parts_mut(wbase as *mut u8, self.offset + bytes.len()) };
        wbuf[self.offset..].copy_from_slice(&bytes);
        let (ops, mut arena, _scratch) = lower_on_host(&plan, wbase, &[], QuantPath::Auto);
        let leaf = |t: TensorId| match plan.inputs.iter().find(|io| io.operand.id == t) {
            Some(io) => match io.operand.loc {
                Loc::Arena(off) => off,
                Loc::Buffer(..) => unreachable!("inputs live in the arena"),
            },
            None => panic!("no input {t:?}"),
        };
        let (xoff, idoff) = (leaf(xt), leaf(idt));
        let mem = bytemuck::cast_slice_mut::<u64, u8>(&mut arena);
        mem[xoff..xoff + 4 * x.len()].copy_from_slice(bytemuck::cast_slice(&x));
        mem[idoff..idoff + 4 * ids.len()].copy_from_slice(bytemuck::cast_slice(&ids));
        let launches = kernel_launches(&ops);
        for l in &launches {
            match l.kernel.name {
                "quantize_q8_1_f32" => run_quantize(args(l)),
                name if name.starts_with("mul_mat_vec_id_") => run_gemv_id(name, l.grid, args(l)),
                name => panic!("a decode step launches no {name}"),
            }
        }
        let nmse = output_nmse(&arena, &out, &want);
        let names = launches.iter().map(|l| l.kernel.name).collect();
        // as in the mmq tests: about 1e-7 from the CPU's f16 offsets; a wrong expert, input
        // column or output column is of the order of 1
        assert!(
            nmse < 1e-5,
            "{self:?} {names:?}: NMSE {nmse:e} against the CPU"
        );
        names
    }
}

/// Host version of mul_mat_vec_id_q*_<q>: for each column j (grid.y), (i, t) = (j %
/// n_used, j / n_used), the rows of expert ids[i, t] (dequantized) by the Q8_1 column
/// (i % b1) + b1 t (dequantized) into dst[:, i, t]; checks the grid covers the rows and
/// that the in-place kernels get aligned rows.
fn run_gemv_id(name: &str, grid: (u32, u32, u32), p: QGemvIdArgs) {
    let q = name
        .strip_prefix("mul_mat_vec_id_qd_")
        .or_else(|| name.strip_prefix("mul_mat_vec_id_q_"))
        .and_then(DType::parse)
        .and_then(DType::quant)
        .unwrap();
    if name.starts_with("mul_mat_vec_id_qd_") {
        let align = in_place_alignment(DType::Quant(q)) as i64;
        assert!(
            p.a.is_multiple_of(align as u64) && p.a_nb1 % align == 0 && p.a_nb2 % align == 0,
            "{p:?}"
        );
    }
    let (k, m, rows) = (p.k as usize, p.m as usize, GEMV_WARPS as usize);
    assert!(grid.0 as usize * rows >= m && (grid.0 as usize - 1) * rows < m);
    // with a second product, the grid's upper half of rows computes it
    let cols = if p.a2 == 0 { grid.1 } else { grid.1 / 2 } as i64;
    assert_eq!(cols % p.n_used, 0);
    let rb = q.row_bytes(k).unwrap();
    let mut w = vec![0f32; k];
    for jj in 0..grid.1 as i64 {
        let (j, a, dst) = match jj < cols {
            true => (jj, p.a, p.dst),
            false => (jj - cols, p.a2, p.dst2),
        };
        let (i, t) = (j % p.n_used, j / p.n_used);
        // SAFETY: (i, t) is inside the ids' shape [n_used, grid.y / n_used].
        let id = unsafe { read::<i32>(p.ids, i * p.ids_nb0 + t * p.ids_nb1) } as i64;
        assert!((0..p.n_expert).contains(&id), "{p:?}: id {id}");
        let x = q8_1_column(p.b + ((i % p.b1 + p.b1 * t) * p.b_nb1) as u64, k, q);
        for r in 0..m as i64 {
            let at = a + (id * p.a_nb2 + r * p.a_nb1) as u64;
            // SAFETY: row r of expert id lies in the weights' host buffer.
            let src = unsafe { std::slice::from_raw_parts(at as *const u8, rb) };
            dequantize_row(q, src, &mut w).unwrap();
            let s: f64 = w.iter().zip(&x).map(|(&a, b)| f64::from(a) * b).sum();
            // SAFETY: dst[r, i, t] lies in the arena.
            unsafe { write(dst, 4 * r + i * p.dst_nb1 + t * p.dst_nb2, s as f32) };
        }
    }
}

/// Decode steps of 1 to `DECODE_MAX_TOKENS` tokens of 1 to 8 experts each, shared and
/// per-expert inputs, contiguous and strided, for block types of 32 and 256 elements
/// (Q4_K's and IQ4_XS's rows aligned or not: read in place or staged) compute the CPU's results
/// through the decode kernels' contract.
#[test]
fn decode_steps_match_the_cpu() {
    let mut seed = 0;
    for (q, offset, kernel) in [
        (QType::Q4_0, 0, "mul_mat_vec_id_q_q4_0"),
        (QType::Q8_0, 0, "mul_mat_vec_id_q_q8_0"),
        (QType::Q4_K, 0, "mul_mat_vec_id_qd_q4_k"),
        (QType::Q4_K, 2, "mul_mat_vec_id_q_q4_k"),
        (QType::Q6_K, 0, "mul_mat_vec_id_q_q6_k"),
        (QType::IQ4_XS, 8, "mul_mat_vec_id_qd_iq4_xs"),
        (QType::IQ4_XS, 2, "mul_mat_vec_id_q_iq4_xs"),
    ] {
        for n_tokens in 1..=DECODE_MAX_TOKENS {
            for (n_used, shared, pad) in [(1, true, 0), (3, false, 2), (8, true, 3), (8, false, 0)]
            {
                seed += 1;
                let c = Decode {
                    q,
                    k: if q.block_size() == 32 { 96 } else { 512 },
                    m: 10,
                    n_expert: 12,
                    n_used,
                    b1: if shared { 1 } else { n_used },
                    n_tokens,
                    pad,
                    offset,
                };
                let names = c.run(seed);
                assert_eq!(
                    names,
                    ["quantize_q8_1_f32", kernel],
                    "{q} {n_tokens} {n_used}"
                );
            }
        }
    }
}
