//! What a forward pass of any model hands back: the device argmax and the logits asked
//! for. Model-independent, so that sampling and the generation loop do not depend on a
//! particular architecture.

use crate::error::{Error, Result};
use crate::models::runtime::sampling::Row;

/// Which logits a forward pass reads back to the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: only the argmax of the last position (greedy decoding).
    None,
    /// The last position's logits.
    Last,
    /// Every position's logits (prefill only).
    All,
    /// The `k` largest logits of the last position with their token ids, selected on the
    /// device (`top_k`; `8 k` bytes read back instead of the row), for a sampler whose
    /// [`candidates`](crate::models::SamplerChain::candidates) are `k`.
    Top(usize),
}

/// The largest logits of one position with their token ids, largest first (ties: lower
/// id first).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopLogits {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Their logits.
    pub logits: Vec<f32>,
}

/// What a forward pass returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// The argmax of the last position's logits, computed on the device.
    pub argmax: u32,
    /// The logits asked for, `vocab` values per position (empty for [`Logits::None`] and
    /// [`Logits::Top`]).
    pub logits: Vec<f32>,
    /// The largest logits of the last position ([`Logits::Top`]).
    pub top: Option<TopLogits>,
}

impl Output {
    /// Only the argmax (what [`Logits::None`] reads).
    pub fn argmax(argmax: u32) -> Output {
        Output {
            argmax,
            logits: Vec::new(),
            top: None,
        }
    }

    /// The last position's logits to sample from: the top candidates when read, else the
    /// last `vocab` logits.
    pub fn row(&self, vocab: usize) -> Result<Row<'_>> {
        if let Some(t) = &self.top {
            return Ok(Row::Top {
                ids: &t.ids,
                logits: &t.logits,
            });
        }
        match self.logits.len().checked_sub(vocab) {
            Some(from) if vocab > 0 => Ok(Row::Full(&self.logits[from..])),
            _ => Err(Error::plan(format!(
                "sampling needs the logits of the last position, but the forward pass read back {} values (vocabulary {vocab})",
                self.logits.len()
            ))),
        }
    }
}
