//! Kernel argument structs and launch constants: the Rust mirror of `cuda/args.cuh`,
//! generated from that header by build.rs (`OUT_DIR/args.rs`), so the two sides cannot
//! drift apart: the same fields in the same order, and no struct with padding (build.rs
//! checks each struct's `static_assert` size against the sum of its fields). Every kernel
//! takes one `*Args` struct by value.

#[cfg(test)]
use std::any::TypeId;

use crate::graph::Operand;

include!(concat!(env!("OUT_DIR"), "/args.rs"));

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

impl IndexError {
    /// The record's bytes, for copies from the device.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: IndexError is plain data without padding (a generated struct, see
        // KernelArgs), exactly its size.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self as *mut Self).cast::<u8>(),
                std::mem::size_of::<Self>(),
            )
        }
    }
}

/// A kernel argument struct: `#[repr(C)]`, `Copy`, no implicit padding.
///
/// # Safety
/// Implementors must be plain data without padding bytes, laid out exactly like the C
/// struct the kernel takes (build.rs implements it for the generated `*Args` structs only).
pub unsafe trait KernelArgs: Copy + 'static {}

/// The bytes of one argument struct, 8-byte aligned, as the launch passes them, and the
/// struct's type.
#[derive(Clone, Debug)]
pub struct ArgBytes {
    words: Box<[u64]>,
    #[cfg(test)]
    ty: TypeId,
}

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
        ArgBytes {
            words,
            #[cfg(test)]
            ty: TypeId::of::<T>(),
        }
    }

    /// The struct, when it is a `T`.
    #[cfg(test)]
    pub fn get<T: KernelArgs>(&self) -> Option<T> {
        // SAFETY: the words hold a copy of a T (its type id says so), 8-byte aligned.
        (self.ty == TypeId::of::<T>()).then(|| unsafe { *self.words.as_ptr().cast::<T>() })
    }

    /// The struct's bytes as 8-byte words (the last one zero-padded).
    #[cfg(test)]
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// The address of the struct, as the driver's kernel parameter.
    pub fn as_param(&self) -> *mut std::ffi::c_void {
        self.words.as_ptr() as *mut std::ffi::c_void
    }
}
