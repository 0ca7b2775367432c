//! Lowering: each plan [`Step`] becomes the list of device operations ([`DevOp`]) that
//! computes it, with every kernel, grid, block and argument (device addresses included)
//! decided when the plan is loaded, so a run is a plain loop of launches.
//!
//! The same function answers [`Backend::supports`](crate::backend::Backend::supports):
//! lowering fails with a reason for any op, dtype or layout the kernels do not handle.
//! mul_mat has a file of its own ([`super::mul_mat`]).

use super::args::*;
use super::kernels::{k, Kernel};
use super::mul_mat::Gemm;
use crate::graph::{BufferId, DType, Loc, Operand, Step};
use crate::ops::{Op, RopeMode};

/// One device operation of a lowered step.
pub(crate) enum DevOp {
    /// A kernel launch.
    Kernel(Launch),
    /// A cuBLAS GEMM.
    Gemm(Gemm),
}

/// A kernel with its launch configuration and argument struct.
pub(crate) struct Launch {
    pub kernel: Kernel,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub args: ArgBytes,
}

impl DevOp {
    /// A launch of `kernel` with argument struct `args`.
    pub fn kernel<T: KernelArgs>(
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &T,
    ) -> DevOp {
        DevOp::Kernel(Launch {
            kernel,
            grid,
            block,
            args: ArgBytes::new(args),
        })
    }
}

/// What lowering needs to know about memory, and what it collects.
pub(crate) struct Lowering<'a> {
    /// Device address of a plan location (arena or buffer).
    pub resolve: &'a dyn Fn(Loc) -> u64,
    /// Device address of the plan's constant region.
    pub consts_base: u64,
    /// The constant region's contents, appended to by lowering (rope tables, GEMM
    /// pointer arrays), uploaded once at load.
    pub consts: Vec<u8>,
    /// Device address of the plan's scratch region.
    pub scratch_base: u64,
    /// Bytes of scratch the steps lowered so far need (each step starts at offset 0: the
    /// steps run one after another on one stream).
    pub scratch_need: usize,
    /// Device address of the index-error record.
    pub err: u64,
    /// Tag identifying the step being lowered in the index-error record.
    pub tag: i64,
    /// Buffers some step of the plan writes (the others are read-only while it runs).
    pub written: Vec<BufferId>,
}

/// Alignment of every block in the constant and scratch regions.
pub(crate) const REGION_ALIGN: usize = 256;

impl Lowering<'_> {
    /// The device address of `op`'s first element.
    pub fn addr(&self, op: &Operand) -> u64 {
        (self.resolve)(op.loc)
    }

    /// Whether `op` lives in a buffer no step of the plan writes (weights).
    pub fn read_only(&self, op: &Operand) -> bool {
        matches!(op.loc, Loc::Buffer(b, _) if !self.written.contains(&b))
    }

    /// `op` as a kernel tensor argument.
    pub fn t4(&self, op: &Operand) -> Tensor4 {
        Tensor4::new(self.addr(op), op)
    }

    /// Appends plain data to the constant region; returns its device address.
    pub fn push_consts(&mut self, bytes: &[u8]) -> u64 {
        let off = self.consts.len().next_multiple_of(REGION_ALIGN);
        self.consts.resize(off, 0);
        self.consts.extend_from_slice(bytes);
        self.consts_base + off as u64
    }
}

/// Index of a float dtype in the kernel tables below.
fn float_index(dt: DType) -> Option<usize> {
    match dt {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        DType::I32 => None,
    }
}

/// The kernel of `table` for a float dtype.
pub(crate) fn pick1(what: &str, dt: DType, table: [Kernel; 3]) -> Result<Kernel, String> {
    float_index(dt)
        .map(|i| table[i])
        .ok_or_else(|| format!("{what}: no kernel for dtype {dt}"))
}

/// The kernel of `table` for a pair of float dtypes.
pub(crate) fn pick2(
    what: &str,
    a: DType,
    b: DType,
    table: [[Kernel; 3]; 3],
) -> Result<Kernel, String> {
    match (float_index(a), float_index(b)) {
        (Some(i), Some(j)) => Ok(table[i][j]),
        _ => Err(format!("{what}: no kernel for dtypes {a}, {b}")),
    }
}

/// Checks that every element of `op` at `addr` is aligned to its size.
pub(crate) fn check_aligned(what: &str, op: &Operand, addr: u64) -> Result<(), String> {
    let es = op.dtype.block_bytes();
    let strides_ok = (0..4).all(|i| op.ne[i] == 1 || op.nb[i] % es == 0);
    if addr % es as u64 != 0 || !strides_ok {
        return Err(format!(
            "{what} (offset or strides {:?}) is not aligned to its {es}-byte elements",
            op.nb
        ));
    }
    Ok(())
}

/// Checks that `a` and `b` have one dtype.
fn same_dtype(what: &str, a: &Operand, b: &Operand) -> Result<(), String> {
    if a.dtype != b.dtype {
        return Err(format!(
            "{what}: result dtype {} differs from source dtype {}",
            b.dtype, a.dtype
        ));
    }
    Ok(())
}

/// Grid for kernels with one block per row (`rows` blocks on grid.x).
pub(crate) fn row_grid(rows: usize) -> Result<(u32, u32, u32), String> {
    u32::try_from(rows)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .map(|r| (r, 1, 1))
        .ok_or_else(|| format!("{rows} rows exceed the grid limit"))
}

/// Block for a row reduction: one warp for rows up to 256 elements, more for longer rows
/// (a decode step's soft_max has only one row per head: wide blocks keep it short).
fn reduce_block(ne0: usize) -> (u32, u32, u32) {
    let threads = if ne0 <= 256 {
        32
    } else if ne0 <= 2048 {
        128
    } else if ne0 <= 8192 {
        256
    } else {
        1024
    };
    (threads, 1, 1)
}

/// Block for a per-row loop over `work` items: a multiple of 32, at most 256.
fn loop_block(work: usize) -> (u32, u32, u32) {
    ((work.next_multiple_of(32)).clamp(32, 256) as u32, 1, 1)
}

/// Grid and block of `for_each_element` kernels: dim 0 on grid.x * block.x, rows on
/// grid.y (both strided in the kernel, so the sizes are capped).
pub(crate) fn elementwise_grid(ne: [usize; 4]) -> ((u32, u32, u32), (u32, u32, u32)) {
    let block = loop_block(ne[0]);
    let gx = ne[0].div_ceil(block.0 as usize).min(1 << 16) as u32;
    let rows = ne[1] * ne[2] * ne[3];
    ((gx, rows.min(65535) as u32, 1), block)
}

/// Grid and block of flat grid-stride loops over `n` elements.
pub(crate) fn flat_grid(n: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    ((n.div_ceil(256).clamp(1, 65535) as u32, 1, 1), (256, 1, 1))
}

const ADD: [[Kernel; 3]; 3] = [
    [k::ADD_F32_F32, k::ADD_F32_F16, k::ADD_F32_BF16],
    [k::ADD_F16_F32, k::ADD_F16_F16, k::ADD_F16_BF16],
    [k::ADD_BF16_F32, k::ADD_BF16_F16, k::ADD_BF16_BF16],
];
const MUL: [[Kernel; 3]; 3] = [
    [k::MUL_F32_F32, k::MUL_F32_F16, k::MUL_F32_BF16],
    [k::MUL_F16_F32, k::MUL_F16_F16, k::MUL_F16_BF16],
    [k::MUL_BF16_F32, k::MUL_BF16_F16, k::MUL_BF16_BF16],
];
pub(crate) const CPY: [[Kernel; 3]; 3] = [
    [k::CPY_F32_F32, k::CPY_F32_F16, k::CPY_F32_BF16],
    [k::CPY_F16_F32, k::CPY_F16_F16, k::CPY_F16_BF16],
    [k::CPY_BF16_F32, k::CPY_BF16_F16, k::CPY_BF16_BF16],
];
const SET_ROWS: [[Kernel; 3]; 3] = [
    [
        k::SET_ROWS_F32_F32,
        k::SET_ROWS_F32_F16,
        k::SET_ROWS_F32_BF16,
    ],
    [
        k::SET_ROWS_F16_F32,
        k::SET_ROWS_F16_F16,
        k::SET_ROWS_F16_BF16,
    ],
    [
        k::SET_ROWS_BF16_F32,
        k::SET_ROWS_BF16_F16,
        k::SET_ROWS_BF16_BF16,
    ],
];
/// Fill kernels of `Backend::fill_random`, by dtype.
pub(crate) const FILL_RANDOM: [Kernel; 3] =
    [k::FILL_RANDOM_F32, k::FILL_RANDOM_F16, k::FILL_RANDOM_BF16];

/// Lowers one step, or says why the CUDA backend cannot run it.
pub(crate) fn lower_step(step: &Step, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let dst = &step.dst;
    let src = &step.src;
    let dst_addr = lw.addr(dst);
    check_aligned("the result", dst, dst_addr)?;
    for (i, s) in src.iter().enumerate() {
        check_aligned(&format!("source {i}"), s, lw.addr(s))?;
    }
    let name = step.op.name();
    let ops = match step.op {
        Op::Leaf | Op::View | Op::Reshape | Op::Permute { .. } | Op::Transpose | Op::After => {
            Vec::new()
        }
        Op::GetRows => {
            let (table, ids) = (&src[0], &src[1]);
            let kernel = pick1(
                name,
                table.dtype,
                [k::GET_ROWS_F32, k::GET_ROWS_F16, k::GET_ROWS_BF16],
            )?;
            if ids.dtype != DType::I32 || dst.dtype != DType::F32 {
                return Err(format!(
                    "get_rows needs I32 ids and an F32 result, got {} and {}",
                    ids.dtype, dst.dtype
                ));
            }
            let args = RowsArgs {
                src: lw.t4(table),
                ids: lw.t4(ids),
                dst: lw.t4(dst),
                err: lw.err,
                tag: lw.tag,
            };
            vec![DevOp::kernel(
                kernel,
                row_grid(dst.nrows())?,
                loop_block(dst.ne[0]),
                &args,
            )]
        }
        Op::Add | Op::Mul => {
            let (a, b) = (&src[0], &src[1]);
            same_dtype(name, a, dst)?;
            let table = if step.op == Op::Add { ADD } else { MUL };
            let kernel = pick2(name, a.dtype, b.dtype, table)?;
            let args = BinaryArgs {
                a: lw.t4(a),
                b: lw.t4(b),
                dst: lw.t4(dst),
            };
            let (grid, block) = elementwise_grid(dst.ne);
            vec![DevOp::kernel(kernel, grid, block, &args)]
        }
        Op::Scale { .. } | Op::Silu | Op::Gelu => {
            let a = &src[0];
            same_dtype(name, a, dst)?;
            let (table, scale) = match step.op {
                Op::Scale { s } => ([k::SCALE_F32, k::SCALE_F16, k::SCALE_BF16], s),
                Op::Silu => ([k::SILU_F32, k::SILU_F16, k::SILU_BF16], 1.0),
                _ => ([k::GELU_F32, k::GELU_F16, k::GELU_BF16], 1.0),
            };
            let kernel = pick1(name, a.dtype, table)?;
            let args = UnaryArgs {
                src: lw.t4(a),
                dst: lw.t4(dst),
                scale,
                pad: 0.0,
            };
            let (grid, block) = elementwise_grid(dst.ne);
            vec![DevOp::kernel(kernel, grid, block, &args)]
        }
        Op::RmsNorm { eps } | Op::Norm { eps } => {
            let a = &src[0];
            same_dtype(name, a, dst)?;
            let table = if matches!(step.op, Op::RmsNorm { .. }) {
                [k::RMS_NORM_F32, k::RMS_NORM_F16, k::RMS_NORM_BF16]
            } else {
                [k::NORM_F32, k::NORM_F16, k::NORM_BF16]
            };
            let kernel = pick1(name, a.dtype, table)?;
            let args = NormArgs {
                src: lw.t4(a),
                dst: lw.t4(dst),
                eps,
                pad: 0.0,
            };
            vec![DevOp::kernel(
                kernel,
                row_grid(dst.nrows())?,
                reduce_block(dst.ne[0]),
                &args,
            )]
        }
        Op::Rope(p) => {
            let (a, pos) = (&src[0], &src[1]);
            same_dtype(name, a, dst)?;
            if pos.dtype != DType::I32 {
                return Err(format!("rope positions must be I32, got {}", pos.dtype));
            }
            if p.n_dims % 2 != 0 || p.n_dims > a.ne[0] {
                return Err(format!(
                    "rope n_dims {} does not fit rows of {}",
                    p.n_dims, a.ne[0]
                ));
            }
            let kernel = pick1(name, a.dtype, [k::ROPE_F32, k::ROPE_F16, k::ROPE_BF16])?;
            let freqs: Vec<u8> = p.inv_freqs().iter().flat_map(|f| f.to_ne_bytes()).collect();
            let freqs = lw.push_consts(&freqs);
            let args = RopeArgs {
                src: lw.t4(a),
                dst: lw.t4(dst),
                pos: lw.addr(pos),
                pos_nb0: pos.nb[0] as i64,
                freqs,
                n_dims: p.n_dims as i64,
                neox: i64::from(p.mode == RopeMode::Neox),
            };
            let work = (p.n_dims / 2).max(a.ne[0] - p.n_dims);
            vec![DevOp::kernel(
                kernel,
                row_grid(dst.nrows())?,
                loop_block(work),
                &args,
            )]
        }
        Op::Cpy | Op::Cont => vec![copy(lw, &src[0], dst)?],
        Op::SetRows => {
            let (s, ids) = (&src[0], &src[1]);
            if ids.dtype != DType::I32 {
                return Err(format!("set_rows ids must be I32, got {}", ids.dtype));
            }
            let kernel = pick2(name, s.dtype, dst.dtype, SET_ROWS)?;
            let args = RowsArgs {
                src: lw.t4(s),
                ids: lw.t4(ids),
                dst: lw.t4(dst),
                err: lw.err,
                tag: lw.tag,
            };
            let (grid, block) = flat_grid(s.nelements());
            vec![DevOp::kernel(kernel, grid, block, &args)]
        }
        Op::DiagMaskInf { n_past } => {
            let a = &src[0];
            same_dtype(name, a, dst)?;
            let kernel = pick1(
                name,
                a.dtype,
                [
                    k::DIAG_MASK_INF_F32,
                    k::DIAG_MASK_INF_F16,
                    k::DIAG_MASK_INF_BF16,
                ],
            )?;
            let args = DiagMaskArgs {
                src: lw.t4(a),
                dst: lw.t4(dst),
                n_past: n_past as i64,
            };
            let (grid, block) = elementwise_grid(dst.ne);
            vec![DevOp::kernel(kernel, grid, block, &args)]
        }
        Op::SoftMax { scale } => {
            let a = &src[0];
            same_dtype(name, a, dst)?;
            let mask = src.get(1);
            let table = match mask.map(|m| m.dtype) {
                None => [k::SOFT_MAX_F32, k::SOFT_MAX_F16, k::SOFT_MAX_BF16],
                Some(DType::F32) => [
                    k::SOFT_MAX_F32_MF32,
                    k::SOFT_MAX_F16_MF32,
                    k::SOFT_MAX_BF16_MF32,
                ],
                Some(DType::F16) => [
                    k::SOFT_MAX_F32_MF16,
                    k::SOFT_MAX_F16_MF16,
                    k::SOFT_MAX_BF16_MF16,
                ],
                Some(dt) => return Err(format!("soft_max: no kernel for a {dt} mask")),
            };
            let kernel = pick1(name, a.dtype, table)?;
            let args = SoftMaxArgs {
                src: lw.t4(a),
                mask: mask.map(|m| lw.t4(m)).unwrap_or_default(),
                dst: lw.t4(dst),
                scale,
                pad: 0.0,
            };
            vec![DevOp::kernel(
                kernel,
                row_grid(dst.nrows())?,
                reduce_block(dst.ne[0]),
                &args,
            )]
        }
        Op::Argmax => {
            let a = &src[0];
            if dst.dtype != DType::I32 {
                return Err(format!("argmax result must be I32, got {}", dst.dtype));
            }
            if a.ne[0] > i32::MAX as usize {
                return Err(format!("argmax over rows of {} elements", a.ne[0]));
            }
            let kernel = pick1(
                name,
                a.dtype,
                [k::ARGMAX_F32, k::ARGMAX_F16, k::ARGMAX_BF16],
            )?;
            let args = ArgmaxArgs {
                src: lw.t4(a),
                dst: lw.t4(dst),
            };
            vec![DevOp::kernel(
                kernel,
                row_grid(a.nrows())?,
                reduce_block(a.ne[0]),
                &args,
            )]
        }
        Op::MulMat => super::mul_mat::lower(step, lw)?,
    };
    Ok(ops)
}

/// A copy of `src` into the layout `dst` (elements matched in row-major order), with
/// conversion; `dst_addr` overrides where `dst` lives (scratch copies of mul_mat).
pub(crate) fn copy_to(
    lw: &Lowering,
    src: &Operand,
    dst: &Operand,
    dst_addr: u64,
) -> Result<DevOp, String> {
    let kernel = if src.dtype == DType::I32 && dst.dtype == DType::I32 {
        k::CPY_I32_I32
    } else {
        pick2("cpy", src.dtype, dst.dtype, CPY)?
    };
    let n = src.nelements();
    if n != dst.nelements() {
        return Err(format!(
            "cpy of {n} elements into {} elements",
            dst.nelements()
        ));
    }
    let mode = if src.is_contiguous() && dst.is_contiguous() {
        CPY_CONTIGUOUS
    } else if src.ne == dst.ne {
        CPY_SAME_SHAPE
    } else {
        CPY_RESHAPE
    };
    let args = CpyArgs {
        src: lw.t4(src),
        dst: Tensor4::new(dst_addr, dst),
        n: n as i64,
        mode,
    };
    let (grid, block) = flat_grid(n);
    Ok(DevOp::kernel(kernel, grid, block, &args))
}

fn copy(lw: &Lowering, src: &Operand, dst: &Operand) -> Result<DevOp, String> {
    copy_to(lw, src, dst, lw.addr(dst))
}
