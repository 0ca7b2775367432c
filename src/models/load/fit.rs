//! Whether a model's weights fit the backend's memory, checked before their buffer is
//! allocated (the cache and plans are checked by the runtime's memory module).

use crate::backend::Backend;
use crate::error::{Error, Result};

/// Device memory left free beyond the planned buffers: cuBLAS workspaces, captured
/// graphs, the context's own allocations.
pub const HEADROOM: usize = 512 << 20;

/// Checks that `bytes` of weights fit in what `be` has free.
pub fn check_weights(bytes: usize, be: &mut dyn Backend) -> Result<()> {
    match be.free_memory()? {
        Some(free) if bytes.saturating_add(HEADROOM) > free => Err(Error::model(format!(
            "the weights need {bytes} bytes (+{HEADROOM} bytes of headroom) and {} has \
             {free} bytes free: use a smaller weight type (--quantize) or model",
            be.name()
        ))),
        Some(_) | None => Ok(()),
    }
}
