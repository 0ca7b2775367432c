//! Reads of plan outputs that finish later ([`Backend::begin_read`]): a small ring of
//! page-locked host slots that device copies land in while the host goes on enqueuing
//! runs, each with an event that marks its copies done. A slot takes a copy of the output
//! and of the index-error record right after it, so that a bad index recorded by a run
//! before the read is reported when the read finishes.
//!
//! [`Backend::begin_read`]: crate::backend::Backend::begin_read

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use super::args::IndexError;
use super::device::driver_error;
use super::pinned::PinnedBytes;
use crate::error::{Error, Result};

/// Slots in the ring: a pipelined decode keeps at most two reads under way.
const READ_SLOTS: usize = 4;

/// One slot: the output bytes, the record, the event after their copies, and the
/// ticket of the read they belong to.
struct Slot {
    data: PinnedBytes,
    record: PinnedBytes,
    event: CudaEvent,
    ticket: u64,
}

/// The ring of read slots of one backend.
pub(crate) struct Reads {
    slots: Vec<Slot>,
    /// The ticket of the next read (reads take slots in turn).
    next: u64,
}

impl Reads {
    pub fn new() -> Self {
        Reads {
            slots: Vec::new(),
            next: 0,
        }
    }

    /// Enqueues on `stream` copies of the `len` device bytes at `src` and of the
    /// index-error record at `record` into the next slot; returns the slot and the
    /// read's ticket.
    pub fn begin(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        src: u64,
        len: usize,
        record: u64,
    ) -> Result<(usize, u64)> {
        let i = (self.next % READ_SLOTS as u64) as usize;
        if i == self.slots.len() {
            self.slots.push(Slot {
                data: PinnedBytes::alloc(len.max(64))?,
                record: PinnedBytes::alloc(std::mem::size_of::<IndexError>())?,
                event: ctx
                    .new_event(None)
                    .map_err(|e| driver_error("creating an event", e))?,
                ticket: u64::MAX,
            });
        }
        let slot = &mut self.slots[i];
        // The slot's earlier copies must have landed before it is reused or replaced.
        slot.event
            .synchronize()
            .map_err(|e| driver_error("waiting for an earlier read", e))?;
        if slot.data.len < len {
            slot.data = PinnedBytes::alloc(len)?;
        }
        let s = stream.cu_stream();
        // SAFETY: `src` is a device range of `len` bytes and `record` the record, both
        // owned by the backend; the host bytes belong to the slot, which is neither
        // read, reused nor freed before its event (recorded next) has been waited on.
        unsafe {
            result::memcpy_dtoh_async(&mut slot.data.bytes_mut()[..len], src, s)
                .and_then(|()| result::memcpy_dtoh_async(slot.record.bytes_mut(), record, s))
        }
        .map_err(|e| driver_error("copying from the device", e))?;
        slot.event
            .record(stream)
            .map_err(|e| driver_error("recording an event", e))?;
        slot.ticket = self.next;
        self.next += 1;
        Ok((i, slot.ticket))
    }

    /// Waits for read `ticket` in slot `i` and returns its `len` bytes and the
    /// index-error record copied after them. `failed` maps a driver error of the wait
    /// (an asynchronous fault of a run before the read).
    pub fn finish(
        &mut self,
        i: usize,
        ticket: u64,
        len: usize,
        failed: impl Fn(result::DriverError) -> Error,
    ) -> Result<(Vec<u8>, IndexError)> {
        let slot = self
            .slots
            .get_mut(i)
            .filter(|s| s.ticket == ticket && len <= s.data.len)
            .ok_or_else(|| {
                Error::plan(format!(
                    "read {ticket} was finished after {READ_SLOTS} later reads had begun"
                ))
            })?;
        slot.event.synchronize().map_err(failed)?;
        let data = slot.data.bytes_mut()[..len].to_vec();
        let mut rec = IndexError::default();
        rec.bytes_mut().copy_from_slice(slot.record.bytes_mut());
        Ok((data, rec))
    }
}
