//! Input writes that do not wait ([`Backend::set_input`]): the bytes are copied into the
//! next of a small ring of page-locked host slots and the device copy is enqueued from
//! there, so the call returns at once and the copy runs in stream order behind the runs
//! enqueued so far. (From pageable memory the driver may wait for the stream before it
//! stages the bytes, which would leave the GPU idle while the host enqueues the next
//! step.) A slot is reused only after the event recorded behind its last copy has passed.
//!
//! [`Backend::set_input`]: crate::backend::Backend::set_input

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use super::device::driver_error;
use super::pinned::PinnedBytes;
use crate::error::Result;

/// Slots in the ring: a step writes one or two inputs, and the host runs a step ahead.
const WRITE_SLOTS: usize = 8;

/// Largest write staged through the ring; larger ones (rare: inputs are token ids and
/// positions) copy from pageable memory.
pub(crate) const MAX_STAGED: usize = 1 << 20;

/// One slot: its bytes and the event behind its last copy.
struct Slot {
    data: PinnedBytes,
    event: CudaEvent,
}

/// The ring of write slots of one backend.
pub(crate) struct Writes {
    slots: Vec<Slot>,
    /// The slot of the next write (writes take slots in turn).
    next: usize,
}

impl Writes {
    pub fn new() -> Self {
        Writes {
            slots: Vec::new(),
            next: 0,
        }
    }

    /// Enqueues on `stream` a copy of `data` (at most [`MAX_STAGED`] bytes) to the device
    /// bytes at `dst`, through the next slot.
    pub fn write(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        dst: u64,
        data: &[u8],
    ) -> Result<()> {
        debug_assert!(data.len() <= MAX_STAGED);
        let i = self.next % WRITE_SLOTS;
        if i == self.slots.len() {
            self.slots.push(Slot {
                data: PinnedBytes::alloc(data.len().max(4096))?,
                event: ctx
                    .new_event(None)
                    .map_err(|e| driver_error("creating an event", e))?,
            });
        }
        let slot = &mut self.slots[i];
        // The slot's last copy must have left it before it is overwritten or replaced.
        slot.event
            .synchronize()
            .map_err(|e| driver_error("waiting for an earlier input copy", e))?;
        if slot.data.len < data.len() {
            slot.data = PinnedBytes::alloc(data.len())?;
        }
        let staged = &mut slot.data.bytes_mut()[..data.len()];
        staged.copy_from_slice(data);
        // SAFETY: `dst` is a device range of `data.len()` bytes owned by the backend (the
        // caller's check); the host bytes belong to the slot, which is neither written,
        // replaced nor freed before the event recorded next has passed.
        unsafe { result::memcpy_htod_async(dst, staged, stream.cu_stream()) }
            .map_err(|e| driver_error("copying to the device", e))?;
        slot.event
            .record(stream)
            .map_err(|e| driver_error("recording an event", e))?;
        self.next += 1;
        Ok(())
    }
}
