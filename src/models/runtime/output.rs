//! What a forward pass of any model hands back: the device argmax and the logits asked
//! for. Model-independent, so that sampling and the generation loop do not depend on a
//! particular architecture.

/// Which logits a forward pass reads back to the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: only the argmax of the last position (greedy decoding).
    None,
    /// The last position's logits.
    Last,
    /// Every position's logits (prefill only).
    All,
}

/// What a forward pass returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// The argmax of the last position's logits, computed on the device.
    pub argmax: u32,
    /// The logits asked for, `vocab` values per position (empty for [`Logits::None`]).
    pub logits: Vec<f32>,
}
