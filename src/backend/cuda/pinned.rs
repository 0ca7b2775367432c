//! Page-locked host memory, the staging area of the asynchronous copies between host and
//! device ([`super::reads`], [`super::writes`]).

use super::device::driver_error;
use crate::error::Result;
use cudarc::driver::result;

/// Page-locked host bytes, freed on drop.
pub(crate) struct PinnedBytes {
    ptr: *mut u8,
    pub(crate) len: usize,
}

impl PinnedBytes {
    /// `len` bytes of page-locked memory (cached: the host reads or writes them).
    pub(crate) fn alloc(len: usize) -> Result<Self> {
        // SAFETY: a plain page-locked allocation in the context the caller bound.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(|e| driver_error("allocating page-locked host memory", e))?;
        Ok(PinnedBytes {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `len` bytes owned by self; `&mut self` makes this view the
        // only one.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host, freed once. Copies into or out of it have
        // finished: a slot of a ring is only resized after waiting on its event, and the
        // backend synchronizes its stream before its fields drop.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}
