//! Kernel argument structs, `#[repr(C)]` mirrors of the structs in `cuda/common.cuh`
//! (every kernel takes one of them by value). Sizes are asserted here and there, and no
//! struct has implicit padding, so its bytes can be handed to the driver as they are.

use crate::graph::Operand;

/// `Tensor4`: first element, element counts, byte strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tensor4 {
    /// Device address of element (0, 0, 0, 0).
    pub data: u64,
    /// Element counts.
    pub ne: [i64; 4],
    /// Byte strides.
    pub nb: [i64; 4],
}

impl Tensor4 {
    /// `op`'s layout at device address `data`.
    pub fn new(data: u64, op: &Operand) -> Self {
        Tensor4 {
            data,
            ne: op.ne.map(|n| n as i64),
            nb: op.nb.map(|n| n as i64),
        }
    }
}

/// `IndexError`: the first out-of-range id of a run (`flag` != 0 when set).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexError {
    /// 0 while clear.
    pub flag: i32,
    /// Unused.
    pub pad: i32,
    /// Which step recorded it (see `exec::error_tag`).
    pub tag: i64,
    /// The bad id.
    pub index: i64,
    /// Its position (dim 0 of the ids).
    pub position: i64,
    /// The number of rows it had to stay below.
    pub limit: i64,
}

/// `UnaryArgs`: scale, silu, gelu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnaryArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub scale: f32,
    pub pad: f32,
}

/// `BinaryArgs`: add, mul.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BinaryArgs {
    pub a: Tensor4,
    pub b: Tensor4,
    pub dst: Tensor4,
}

/// `NormArgs`: rms_norm, norm.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NormArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub eps: f32,
    pub pad: f32,
}

/// `RopeArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RopeArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub pos: u64,
    pub pos_nb0: i64,
    pub freqs: u64,
    pub n_dims: i64,
    pub neox: i64,
}

/// `CpyArgs` and its modes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CpyArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub n: i64,
    pub mode: i64,
}

/// Same shape, any strides.
pub const CPY_SAME_SHAPE: i64 = 0;
/// Different shapes, elements matched in row-major order.
pub const CPY_RESHAPE: i64 = 1;
/// Both dense.
pub const CPY_CONTIGUOUS: i64 = 2;

/// `RowsArgs`: get_rows, set_rows.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RowsArgs {
    pub src: Tensor4,
    pub ids: Tensor4,
    pub dst: Tensor4,
    pub err: u64,
    pub tag: i64,
}

/// `DiagMaskArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DiagMaskArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub n_past: i64,
}

/// `SoftMaxArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SoftMaxArgs {
    pub src: Tensor4,
    pub mask: Tensor4,
    pub dst: Tensor4,
    pub scale: f32,
    pub pad: f32,
}

/// `ArgmaxArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ArgmaxArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
}

/// `GemvArgs`: mul_mat_vec_*, mul_mat_vec_nc_f16_f32, mul_mat_p021_f16_f32.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemvArgs {
    pub a: u64,
    pub b: u64,
    pub dst: u64,
    pub k: i64,
    pub m: i64,
    pub channels: i64,
    pub a_nb1: i64,
    pub a_nb2: i64,
    pub b_nb2: i64,
    pub dst_nb2: i64,
    pub ratio: i64,
    pub vec: i64,
    /// F32 `[m]` added to the result (a fused residual add), or 0.
    pub add: u64,
    /// 1 when `a` is read-only in the plan: its first loads may overlap the previous kernel.
    pub prefetch: i64,
}

/// `FillRandomArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FillRandomArgs {
    pub dst: u64,
    pub n: i64,
    pub seed: u64,
    pub scale: f32,
    pub pad: f32,
}

/// `NormMulArgs`: rms_norm fused with the multiplication by its weight.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NormMulArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub w: Tensor4,
    pub eps: f32,
    pub pad: f32,
}

/// `SplitArgs`: the BF16 hi/lo split of a GEMM operand.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SplitArgs {
    pub src: Tensor4,
    pub dst: Tensor4,
    pub n: i64,
    pub lo_offset: i64,
}

/// `SpinArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SpinArgs {
    pub ns: i64,
}

/// A kernel argument struct: `#[repr(C)]`, `Copy`, no implicit padding.
///
/// # Safety
/// Implementors must be plain data without padding bytes, laid out exactly like the C
/// struct the kernel takes.
pub unsafe trait KernelArgs: Copy + 'static {}

macro_rules! kernel_args {
    ($($t:ty = $size:expr),* $(,)?) => {
        $(
            const _: () = assert!(std::mem::size_of::<$t>() == $size);
            // SAFETY: repr(C), fields of 8 bytes or f32 pairs, size asserted equal to the
            // static_assert in cuda/common.cuh, so no padding and the same layout.
            unsafe impl KernelArgs for $t {}
        )*
    };
}

kernel_args!(
    UnaryArgs = 152,
    BinaryArgs = 216,
    NormArgs = 152,
    RopeArgs = 184,
    CpyArgs = 160,
    RowsArgs = 232,
    DiagMaskArgs = 152,
    SoftMaxArgs = 224,
    ArgmaxArgs = 144,
    GemvArgs = 112,
    FillRandomArgs = 32,
    SpinArgs = 8,
    SplitArgs = 160,
    NormMulArgs = 224,
);
const _: () = assert!(std::mem::size_of::<Tensor4>() == 72);
const _: () = assert!(std::mem::size_of::<IndexError>() == 40);

/// The bytes of one argument struct, 8-byte aligned, as the launch passes them.
#[derive(Clone, Debug)]
pub struct ArgBytes(Box<[u64]>);

impl ArgBytes {
    /// Copies `args`.
    pub fn new<T: KernelArgs>(args: &T) -> Self {
        let size = std::mem::size_of::<T>();
        let mut words = vec![0u64; size.div_ceil(8)].into_boxed_slice();
        // SAFETY: T is plain data without padding (KernelArgs), so all `size` bytes are
        // initialized; `words` has at least `size` bytes; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (args as *const T).cast::<u8>(),
                words.as_mut_ptr().cast::<u8>(),
                size,
            )
        };
        ArgBytes(words)
    }

    /// The address of the struct, as the driver's kernel parameter.
    pub fn as_param(&self) -> *mut std::ffi::c_void {
        self.0.as_ptr() as *mut std::ffi::c_void
    }
}
