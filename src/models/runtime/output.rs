//! What a forward pass hands back ([`Output`]: the device argmax and the logits), and
//! what a sampler needs read back to pick a token ([`Logits`]). Model-independent, so
//! that sampling does not depend on a particular architecture.

/// What a forward pass must read back to the host for a sampler to pick the next token
/// ([`SamplerChain::wants`](crate::models::SamplerChain::wants)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: only the argmax (greedy decoding).
    None,
    /// The whole row of logits.
    Last,
    /// The `k` largest logits of the row with their token ids, selected on the device
    /// (`top_k`; `8 k` bytes read back instead of the row), for a sampler whose
    /// [`candidates`](crate::models::SamplerChain::candidates) are `k`.
    Top(usize),
}

/// What a forward pass returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// The argmax of the last position's logits, computed on the device.
    pub argmax: u32,
    /// Every position's logits, `vocab` values per position.
    pub logits: Vec<f32>,
}
