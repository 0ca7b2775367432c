//! Raw host tensor views for the CPU reference kernels.
//!
//! A [`HostTensor`] is a pointer plus dtype, `ne` and `nb`: any strides, any dtype, and
//! possibly the same memory as another operand (in-place ops), which is why kernels go
//! through raw reads and writes rather than slices. Values are converted to and from
//! `f32` element by element (F16/BF16 through `half`); rows of a quantized type are
//! dequantized and quantized whole, block by block ([`crate::quant`]), so element access
//! ([`HostTensor::get`], [`load`]) is for plain types only and row access for every type.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::graph::{DType, Operand};

/// A strided tensor in host memory.
#[derive(Clone, Copy, Debug)]
pub struct HostTensor {
    /// First element.
    pub ptr: *mut u8,
    /// Element type.
    pub dtype: DType,
    /// Element counts.
    pub ne: [usize; 4],
    /// Byte strides.
    pub nb: [usize; 4],
}

// SAFETY: a HostTensor is a plain description of memory owned by the CPU backend for the
// duration of one step; kernels that share one across threads write disjoint elements.
unsafe impl Send for HostTensor {}
// SAFETY: as above.
unsafe impl Sync for HostTensor {}

impl HostTensor {
    /// A view of `op`'s layout at `ptr`.
    pub fn new(ptr: *mut u8, op: &Operand) -> Self {
        HostTensor {
            ptr,
            dtype: op.dtype,
            ne: op.ne,
            nb: op.nb,
        }
    }

    /// Byte offset of element `i`.
    #[inline]
    pub fn offset(&self, i: [usize; 4]) -> usize {
        i[0] * self.nb[0] + i[1] * self.nb[1] + i[2] * self.nb[2] + i[3] * self.nb[3]
    }

    /// Reads element `i` as f32.
    ///
    /// # Safety
    /// `i` must be inside `ne` and the memory must be valid for the whole tensor.
    #[inline]
    pub unsafe fn get(&self, i: [usize; 4]) -> f32 {
        // SAFETY: the caller guarantees `i` is in bounds of valid memory.
        unsafe { load(self.ptr.add(self.offset(i)), self.dtype) }
    }

    /// Writes element `i` from f32 (rounding to the tensor's dtype).
    ///
    /// # Safety
    /// As for [`HostTensor::get`], and nothing else may access the element concurrently.
    #[inline]
    pub unsafe fn set(&self, i: [usize; 4], v: f32) {
        // SAFETY: the caller guarantees `i` is in bounds of valid, exclusively used memory.
        unsafe { store(self.ptr.add(self.offset(i)), self.dtype, v) }
    }

    /// Reads element `i` of an I32 tensor.
    ///
    /// # Safety
    /// As for [`HostTensor::get`]; the tensor must be I32.
    #[inline]
    pub unsafe fn get_i32(&self, i: [usize; 4]) -> i32 {
        debug_assert_eq!(self.dtype, DType::I32);
        // SAFETY: the caller guarantees `i` is in bounds of valid memory.
        unsafe { (self.ptr.add(self.offset(i)) as *const i32).read_unaligned() }
    }

    /// Writes element `i` of an I32 tensor.
    ///
    /// # Safety
    /// As for [`HostTensor::set`]; the tensor must be I32.
    #[inline]
    pub unsafe fn set_i32(&self, i: [usize; 4], v: i32) {
        debug_assert_eq!(self.dtype, DType::I32);
        // SAFETY: the caller guarantees `i` is in bounds of valid, exclusively used memory.
        unsafe { (self.ptr.add(self.offset(i)) as *mut i32).write_unaligned(v) }
    }

    /// Copies row `(i1, i2, i3)` into `out` as f32 (`out.len() == ne[0]`).
    ///
    /// # Safety
    /// The row must be inside valid memory.
    #[inline]
    pub unsafe fn read_row(&self, i1: usize, i2: usize, i3: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.ne[0]);
        // SAFETY: the caller guarantees the row is valid memory.
        let base = unsafe { self.ptr.add(self.offset([0, i1, i2, i3])) };
        let nb0 = self.nb[0];
        match self.dtype {
            DType::Quant(q) => {
                let bytes = self.dtype.row_bytes(out.len());
                // SAFETY: a quantized row is `bytes` dense bytes (nb[0] is the block size)
                // inside valid memory.
                let row = unsafe { std::slice::from_raw_parts(base as *const u8, bytes) };
                crate::quant::dequantize_row(q, row, out).expect("row sizes agree");
            }
            DType::F32 if nb0 == 4 => {
                // SAFETY: a dense f32 row of out.len() elements starts at base.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        base as *const u8,
                        out.as_mut_ptr() as *mut u8,
                        out.len() * 4,
                    )
                }
            }
            DType::F16 if nb0 == 2 && (base as usize).is_multiple_of(2) => {
                // SAFETY: a dense, aligned f16 row of out.len() elements starts at base.
                let row = unsafe { std::slice::from_raw_parts(base as *const f16, out.len()) };
                // F16C conversion where the CPU has it (half detects it at run time).
                row.convert_to_f32_slice(out);
            }
            dt @ (DType::F32 | DType::F16 | DType::BF16 | DType::I32) => {
                for (j, o) in out.iter_mut().enumerate() {
                    // SAFETY: element j of the row is inside the tensor.
                    *o = unsafe { load(base.add(j * nb0), dt) };
                }
            }
        }
    }

    /// Writes `vals` (f32) into row `(i1, i2, i3)`.
    ///
    /// # Safety
    /// The row must be inside valid memory not accessed concurrently.
    #[inline]
    pub unsafe fn write_row(&self, i1: usize, i2: usize, i3: usize, vals: &[f32]) {
        debug_assert_eq!(vals.len(), self.ne[0]);
        // SAFETY: the caller guarantees the row is valid memory.
        let base = unsafe { self.ptr.add(self.offset([0, i1, i2, i3])) };
        let nb0 = self.nb[0];
        if let Some(q) = self.dtype.quant() {
            let bytes = self.dtype.row_bytes(vals.len());
            // SAFETY: a quantized row is `bytes` dense bytes inside valid memory that
            // nothing else accesses concurrently.
            let row = unsafe { std::slice::from_raw_parts_mut(base, bytes) };
            crate::quant::quantize_row(q, vals, row).expect("row sizes agree");
            return;
        }
        if self.dtype == DType::F32 && nb0 == 4 {
            // SAFETY: a dense f32 row of vals.len() elements starts at base; `vals` is the
            // caller's own buffer, so the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(vals.as_ptr() as *const u8, base, vals.len() * 4)
            };
            return;
        }
        if self.dtype == DType::F16 && nb0 == 2 && (base as usize).is_multiple_of(2) {
            // SAFETY: a dense, aligned f16 row of vals.len() elements starts at base, and
            // `vals` is the caller's own buffer.
            let row = unsafe { std::slice::from_raw_parts_mut(base as *mut f16, vals.len()) };
            // F16C conversion (round to nearest even, as `f16::from_f32`) where available.
            row.convert_from_f32_slice(vals);
            return;
        }
        for (j, &v) in vals.iter().enumerate() {
            // SAFETY: element j of the row is inside the tensor.
            unsafe { store(base.add(j * nb0), self.dtype, v) };
        }
    }
}

/// Loads one element of `dtype` at `p` as f32 (plain dtypes; a block type has no
/// addressable element, and the op builders keep them from element-wise kernels).
///
/// # Safety
/// `p` must point at a readable element of `dtype`.
#[inline]
pub unsafe fn load(p: *const u8, dtype: DType) -> f32 {
    // SAFETY: the caller guarantees p points at an element of dtype.
    unsafe {
        match dtype {
            DType::F32 => (p as *const f32).read_unaligned(),
            DType::F16 => f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            DType::BF16 => bf16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            DType::I32 => (p as *const i32).read_unaligned() as f32,
            DType::Quant(q) => unreachable!("element load from a {} block", q.name()),
        }
    }
}

/// Stores `v` as one element of `dtype` at `p` (round to nearest even; plain dtypes).
///
/// # Safety
/// `p` must point at a writable element of `dtype`.
#[inline]
pub unsafe fn store(p: *mut u8, dtype: DType, v: f32) {
    // SAFETY: the caller guarantees p points at a writable element of dtype.
    unsafe {
        match dtype {
            DType::F32 => (p as *mut f32).write_unaligned(v),
            DType::F16 => (p as *mut u16).write_unaligned(f16::from_f32(v).to_bits()),
            DType::BF16 => (p as *mut u16).write_unaligned(bf16::from_f32(v).to_bits()),
            DType::I32 => (p as *mut i32).write_unaligned(v as i32),
            DType::Quant(q) => unreachable!("element store into a {} block", q.name()),
        }
    }
}

/// Calls `f` for every index of `ne` in row-major order (dim 0 fastest).
#[inline]
pub fn for_each_index(ne: [usize; 4], mut f: impl FnMut([usize; 4])) {
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i0 in 0..ne[0] {
                    f([i0, i1, i2, i3]);
                }
            }
        }
    }
}

/// Calls `f` for every row index `(i1, i2, i3)` of `ne`.
#[inline]
pub fn for_each_row(ne: [usize; 4], mut f: impl FnMut(usize, usize, usize)) {
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                f(i1, i2, i3);
            }
        }
    }
}

/// Elements from which [`par_for_each_row`] splits the rows over rayon's threads
/// (below, the hand-off costs more than it saves).
pub const PAR_MIN_ELEMS: usize = 1 << 15;

/// [`for_each_row`] with the rows split over rayon's threads when `ne` holds at least
/// [`PAR_MIN_ELEMS`] elements; `f` gets a scratch value made by `init` once per thread's
/// run of rows. Each row must be independent of the others (every row op is: it reads
/// its source rows and writes its own destination row).
pub fn par_for_each_row<T>(
    ne: [usize; 4],
    init: impl Fn() -> T + Sync + Send,
    f: impl Fn(&mut T, usize, usize, usize) + Sync + Send,
) {
    use rayon::prelude::*;
    let rows = ne[1] * ne[2] * ne[3];
    if rows < 2 || ne[0] * rows < PAR_MIN_ELEMS {
        let mut t = init();
        for_each_row(ne, |i1, i2, i3| f(&mut t, i1, i2, i3));
        return;
    }
    (0..rows)
        .into_par_iter()
        .with_min_len(rows.div_ceil(8))
        .for_each_init(init, |t, r| {
            let (i1, i2, i3) = unflatten_row(ne, r);
            f(t, i1, i2, i3);
        });
}

/// The row index `(i1, i2, i3)` of flat row number `r` in `ne`.
#[inline]
pub fn unflatten_row(ne: [usize; 4], r: usize) -> (usize, usize, usize) {
    (r % ne[1], (r / ne[1]) % ne[2], r / (ne[1] * ne[2]))
}
