//! The lowering machinery shared by every op family: a plan [`Step`](crate::graph::Step)
//! becomes the list of device operations ([`DevOp`]) that computes it, with every kernel,
//! grid, block and argument (device addresses included) decided when the plan is loaded,
//! so a run is a plain loop of launches.
//!
//! This file holds what the family files in [`super::lower`] share: the [`Lowering`]
//! context (addresses, constant and scratch regions), launch shapes with the grid limits
//! as named constants, and the alignment rule of each dtype. It imports no family file.

use super::args::{ArgBytes, KernelArgs, Tensor4};
use super::decode::q8_1::Q8Copy;
use super::gemm::Gemm;
use super::kernels::{Kernel, KernelId};
use super::lower::mmq::F16Copy;
use super::split::SplitRows;
use crate::backend::fusion::{disjoint, Q8Layout};
use crate::graph::{BufferId, DType, Loc, Operand};

/// One device operation of a lowered step.
pub(crate) enum DevOp {
    /// A kernel launch.
    Kernel(Launch),
    /// A cuBLAS GEMM.
    Gemm(Gemm),
    /// An NCCL all-reduce (sum of F32 values) over the backend's device group.
    AllReduce(AllReduce),
}

/// The device ranges of an all-reduce: `count` F32 values from `send` summed into `recv`
/// (the same address when in place).
pub(crate) struct AllReduce {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
}

/// A kernel with its launch configuration and argument struct.
pub(crate) struct Launch {
    pub kernel: KernelId,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub args: ArgBytes,
    /// Whether the kernel may launch while its predecessor runs (programmatic dependent
    /// launch, where the backend uses it); see [`DevOp::in_order`].
    pub early: bool,
    /// At most this many blocks on one SM ([`DevOp::at_most_per_sm`]); 0: as many as fit.
    pub per_sm: u32,
}

impl DevOp {
    /// What runs, for profiles and reports: the kernel's name, the cuBLAS or NCCL call.
    pub fn name(&self) -> &'static str {
        match self {
            DevOp::Kernel(l) => l.kernel.name,
            DevOp::Gemm(g) if g.batch > 1 => "cublasGemmBatchedEx",
            DevOp::Gemm(_) => "cublasGemmEx",
            DevOp::AllReduce(_) => "ncclAllReduce",
        }
    }

    /// A launch of `kernel` with its argument struct `args` (a kernel declared with
    /// another struct does not compile).
    pub fn kernel<A: KernelArgs>(
        kernel: Kernel<A>,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &A,
    ) -> DevOp {
        DevOp::Kernel(Launch {
            kernel: kernel.id,
            grid,
            block,
            args: ArgBytes::new(args),
            early: true,
            per_sm: 0,
        })
    }

    /// This launch without programmatic dependent launch: its blocks become resident only
    /// once the previous kernel has ended. For kernels whose many blocks, each holding
    /// much shared memory, would otherwise sit waiting on SMs that the kernels before
    /// them still need (measured: the decode attention's 768 one-warp blocks of 35 KB
    /// resident during the q|k|v product cost Llama-2-7B's decode 5%; the combine after
    /// it, launched early, let the o product's blocks in during it: Llama-3-8B 7%).
    pub fn in_order(mut self) -> Self {
        if let DevOp::Kernel(l) = &mut self {
            l.early = false;
        }
        self
    }

    /// This launch with at most `n` of its blocks on one SM: it reserves dynamic shared
    /// memory that leaves no room for another (see `KernelTable::smem_cap`). For grids
    /// sized to fill every SM with `n` blocks at once: launched while the kernel before
    /// still runs, their blocks otherwise crowd onto the SMs freed first, and those SMs
    /// then set the kernel's time.
    pub fn at_most_per_sm(mut self, n: u32) -> Self {
        if let DevOp::Kernel(l) = &mut self {
            l.per_sm = n;
        }
        self
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
    /// Decode products with block-quantized weights take the Q8_1 + `__dp4a` path
    /// (`mul_mat_vec_q_*`) when true, the dequantize-in-registers path
    /// (`mul_mat_vec_dq_*`) when false (`CudaBackend::set_mmvq`).
    pub mmvq: bool,
    /// With `mmvq`: small decode products whose activations have no Q8_1 copy yet
    /// dequantize in registers all the same (one launch instead of two; see
    /// `decode::quant`). Off unless the backend picks the path itself.
    pub small_dq: bool,
    /// GPUs in the backend's device group (1 outside a group): the size an `all_reduce`
    /// must have.
    pub devices: usize,
    /// Streaming multiprocessors of the GPU (the backend reads them from the device;
    /// [`DEFAULT_SMS`] otherwise): the grids that must fit the GPU at once are sized for
    /// them (the decode attention's split, the one-wave decode products).
    pub sms: usize,
    /// The Q8_1 copy of activations made last (by a decode product, or by the fused step
    /// before it, [`Lowering::step_done`]): the next decode product of the same
    /// activations (a layer's q, k and v when a mix gives them different types, so that
    /// they are not one fused matrix) reads it instead of quantizing again when it takes
    /// the same layout. It is forgotten when a step writes memory the activations occupy
    /// ([`Lowering::wrote`]) or another step takes scratch ([`Lowering::reserve_scratch`]).
    pub q8_1: Option<Q8Copy>,
    /// The F16 copy of activations made last by a batched product on F16 tensor cores
    /// ([`super::lower::mmq`]): the next such product of the same activations reads it.
    /// Forgotten like [`Lowering::q8_1`].
    pub f16: Option<F16Copy>,
    /// The columns of the last mul_mat_id grouped by expert in scratch: the next
    /// mul_mat_id over the same ids (a block's gate, up and down products) reads them
    /// instead of grouping again. Forgotten like [`Lowering::q8_1`]: when a step writes
    /// the ids' memory or another step takes scratch.
    pub experts: Option<ExpertGroups>,
    /// Whether a step lowered before the current one has launches: a kernel of the plan
    /// then runs before it, so that data no step of the plan writes can be read before
    /// waiting on the previous kernel (which might be another plan's otherwise).
    pub launched: bool,
    /// The frozen Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K weights stored in split rows (see
    /// [`super::split`]).
    pub split: &'a [SplitRows],
    /// Which kernels run products of block-quantized weights (see `lower::mul_mat_q`):
    /// [`QuantPath::Auto`] but where the op benchmark or a test picks one.
    pub quant_path: QuantPath,
    /// Whether products of the 32-element types on F16 tensor cores take `mmr_*` (the
    /// weights unpacked in registers) rather than `mmh_*` (`lower::mmq`).
    pub mmr: bool,
}

/// How products of block-quantized weights run (`lower::mul_mat_q` has the thresholds of
/// [`QuantPath::Auto`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantPath {
    /// By the number of activation columns: the decode kernels for a few, the int8
    /// tensor-core product (`mmq_*`) below `f16_from_cols` (the K-quants' `MMH_FROM_COLS`;
    /// none for the 32-element types), the F16 one (`mmr_*` for the 32-element types,
    /// `mmh_*` for the others) up to `MMQ_MAX_COLS`, the weights dequantized to F16 for
    /// cuBLAS beyond.
    #[default]
    Auto,
    /// The int8 tensor-core product for every product it takes, the decode widths
    /// included (a decode product fused with its residual add keeps its decode kernel).
    Mmq,
    /// The F16 tensor-core product (`mmr_*` or `mmh_*`) for every product it takes,
    /// likewise.
    Mmh,
    /// The weights dequantized to F16 for cuBLAS for every product the decode kernels do
    /// not take.
    Dequant,
}

/// The columns of a mul_mat_id grouped by expert (`group_by_expert`, cuda/mul_mat_id.cu).
#[derive(Clone, Debug)]
pub struct ExpertGroups {
    /// The ids they were grouped from.
    pub ids: Operand,
    /// The experts (the offsets' length less one).
    pub n_expert: usize,
    /// Each expert's first column in `cols` (I32, `n_expert + 1`).
    pub offsets: u64,
    /// The columns, grouped by expert (I32).
    pub cols: u64,
    /// Each expert's columns in tiles for `mmq_id_*`, when listed.
    pub tiles: Option<ExpertTiles>,
    /// Scratch bytes the grouping takes (from offset 0).
    pub end: usize,
}

/// The tiles of [`ExpertGroups`]: each expert's columns in tiles of `bn` (I32 `count`
/// entries each: the tile's expert, -1 past the last tile, and its first index into
/// the columns).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertTiles {
    pub bn: usize,
    pub count: usize,
    pub expert: u64,
    pub first: u64,
}

/// Alignment of every block in the constant and scratch regions.
pub(crate) const REGION_ALIGN: usize = 256;
/// Most blocks on grid.x.
pub(crate) const MAX_GRID_X: usize = i32::MAX as usize;
/// Most blocks on grid.y and grid.z.
pub(crate) const MAX_GRID_YZ: usize = 65535;
/// Most threads of a block.
pub(crate) const MAX_BLOCK: usize = 1024;
/// Threads of a warp.
pub(crate) const WARP: usize = 32;
/// Streaming multiprocessors a lowering without a GPU at hand sizes grids for (host tests):
/// those of an H100 SXM or an H200. The backend's lowerings use the device's count.
pub(crate) const DEFAULT_SMS: usize = 132;

impl<'a> Lowering<'a> {
    /// A lowering context with every region at address 0 and nothing collected yet
    /// (`load` then sets the real bases of the constants, the scratch and the index
    /// record; `supports` only asks whether a step lowers).
    pub fn new(resolve: &'a dyn Fn(Loc) -> u64, mmvq: bool, devices: usize) -> Self {
        Lowering {
            resolve,
            consts_base: 0,
            consts: Vec::new(),
            scratch_base: 0,
            scratch_need: 0,
            err: 0,
            tag: 0,
            written: Vec::new(),
            mmvq,
            small_dq: false,
            devices,
            sms: DEFAULT_SMS,
            q8_1: None,
            f16: None,
            experts: None,
            launched: false,
            split: &[],
            quant_path: QuantPath::Auto,
            mmr: true,
        }
    }
}

impl Lowering<'_> {
    /// The device address of `op`'s first element.
    pub fn addr(&self, op: &Operand) -> u64 {
        (self.resolve)(op.loc)
    }

    /// Whether the mul_mat weights `a` are whole rows of a frozen weight in split rows
    /// (an error when they touch one otherwise).
    pub fn weights_split(&self, a: &Operand) -> Result<bool, String> {
        super::split::weights_split(self.split, a)
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

    /// Reserves `bytes` of scratch at `*offset` (advanced past them); returns the address.
    pub fn reserve_scratch(&mut self, offset: &mut usize, bytes: usize) -> u64 {
        self.q8_1 = None;
        self.f16 = None;
        self.experts = None;
        let addr = self.scratch_base + *offset as u64;
        *offset = (*offset + bytes).next_multiple_of(REGION_ALIGN);
        self.scratch_need = self.scratch_need.max(*offset);
        addr
    }

    /// Reserves `bytes` of scratch past the `len` bytes at `addr`, the Q8_1 or F16 copy the
    /// current step reads (which stays the copy later products read); returns the address.
    pub fn reserve_past_copy(&mut self, addr: u64, len: usize, bytes: usize) -> u64 {
        let (q8, f16) = (self.q8_1.take(), self.f16.take());
        let mut offset = (addr - self.scratch_base) as usize + len;
        let at = self.reserve_scratch(&mut offset, bytes);
        (self.q8_1, self.f16) = (q8, f16);
        at
    }

    /// A step wrote `dst`: the Q8_1 copy of activations it overlaps is stale.
    pub fn wrote(&mut self, dst: &Operand) {
        if self.q8_1.as_ref().is_some_and(|c| !disjoint(&c.of, dst)) {
            self.q8_1 = None;
        }
        if self.f16.as_ref().is_some_and(|c| !disjoint(&c.of, dst)) {
            self.f16 = None;
        }
        if self
            .experts
            .as_ref()
            .is_some_and(|g| !disjoint(&g.ids, dst))
        {
            self.experts = None;
        }
    }

    /// The steps just lowered (one group) wrote `dsts`: stale Q8_1 copies are forgotten
    /// ([`Lowering::wrote`]), and the copy `made` of their own result, if any, is the one
    /// the next product reads (an F16 one in [`Lowering::f16`]).
    pub fn step_done<'o>(
        &mut self,
        dsts: impl IntoIterator<Item = &'o Operand>,
        made: Option<Q8Copy>,
    ) {
        for dst in dsts {
            self.wrote(dst);
        }
        match made {
            Some(c) if c.layout == Q8Layout::F16 => {
                self.f16 = Some(F16Copy {
                    of: c.of,
                    addr: c.addr,
                })
            }
            Some(c) => self.q8_1 = Some(c),
            None => {}
        }
    }
}

/// The alignment, in bytes, that the kernels need for an element (or block) of `dt`: its
/// widest scalar field.
pub(crate) const fn elem_align(dt: DType) -> usize {
    match dt {
        DType::F32 | DType::I32 => 4,
        DType::F16 | DType::BF16 => 2,
        // Every block type starts with (or, Q6_K, ends in) f16 fields and has an even
        // size; kernels read its quants in 16-bit pieces.
        DType::Quant(_) => 2,
    }
}

/// Checks that every element of `op` at `addr` is aligned as [`elem_align`] says.
pub(crate) fn check_aligned(what: &str, op: &Operand, addr: u64) -> Result<(), String> {
    let a = elem_align(op.dtype);
    let strides_ok = (0..4).all(|i| op.ne[i] == 1 || op.nb[i].is_multiple_of(a));
    if !addr.is_multiple_of(a as u64) || !strides_ok {
        return Err(format!(
            "{what} (offset or strides {:?}) is not aligned to {a} bytes for its {} elements",
            op.nb, op.dtype
        ));
    }
    Ok(())
}

/// Checks that `a` and `b` have one dtype.
pub(crate) fn same_dtype(what: &str, a: &Operand, b: &Operand) -> Result<(), String> {
    if a.dtype != b.dtype {
        return Err(format!(
            "{what}: result dtype {} differs from source dtype {}",
            b.dtype, a.dtype
        ));
    }
    Ok(())
}

/// Checks that `op` is I32 (ids, positions, argmax results).
pub(crate) fn expect_i32(what: &str, op: &Operand) -> Result<(), String> {
    if op.dtype != DType::I32 {
        return Err(format!("{what} must be I32, got {}", op.dtype));
    }
    Ok(())
}

/// Grid for kernels with one block per row (`rows` blocks on grid.x).
pub(crate) fn row_grid(rows: usize) -> Result<(u32, u32, u32), String> {
    if rows > MAX_GRID_X {
        return Err(format!("{rows} rows exceed the grid limit of {MAX_GRID_X}"));
    }
    Ok((rows as u32, 1, 1))
}

/// Block for a row reduction: one warp for rows up to 256 elements, more for longer rows
/// (a decode step's soft_max has only one row per head: wide blocks keep it short).
pub(crate) fn reduce_block(ne0: usize) -> (u32, u32, u32) {
    let threads = if ne0 <= 256 {
        WARP
    } else if ne0 <= 2048 {
        128
    } else if ne0 <= 8192 {
        256
    } else {
        MAX_BLOCK
    };
    (threads as u32, 1, 1)
}

/// Block for a per-row loop over `work` items: a multiple of 32, at most 256.
pub(crate) fn loop_block(work: usize) -> (u32, u32, u32) {
    ((work.next_multiple_of(WARP)).clamp(WARP, 256) as u32, 1, 1)
}

/// Elements of a row per thread of `for_each_row` kernels over many rows (a prefill's
/// activations): each thread finds its row's addresses once for these. Tensors of a few
/// rows (decode) keep one element per thread, for the shortest latency.
const ELEMS_PER_THREAD: usize = 4;
const MANY_ROWS: usize = 32;

/// Grid and block of `for_each_row` kernels: dim 0 on grid.x * block.x, rows on
/// grid.y (both strided in the kernel, so the sizes are capped).
pub(crate) fn elementwise_grid(ne: [usize; 4]) -> ((u32, u32, u32), (u32, u32, u32)) {
    let block = loop_block(ne[0]);
    let rows = ne[1] * ne[2] * ne[3];
    let per_thread = if rows >= MANY_ROWS {
        ELEMS_PER_THREAD
    } else {
        1
    };
    let gx = ne[0].div_ceil(block.0 as usize * per_thread).min(1 << 16) as u32;
    ((gx, rows.min(MAX_GRID_YZ) as u32, 1), block)
}

/// Grid and block of flat grid-stride loops over `n` elements.
pub(crate) fn flat_grid(n: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    (
        (n.div_ceil(256).clamp(1, MAX_GRID_YZ) as u32, 1, 1),
        (256, 1, 1),
    )
}
