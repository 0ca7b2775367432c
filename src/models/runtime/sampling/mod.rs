//! Sampling: the settings ([`SamplingParams`]), where a run takes them from (flags,
//! the model's recommendation, defaults: [`settings`]) and the chain that applies them
//! to a row of logits ([`SamplerChain`]), one chain per sequence, shared by `generate`,
//! `chat` and anything else that decodes.

pub mod chain;
pub mod params;
pub mod settings;

pub use chain::{Row, SamplerChain};
pub use params::SamplingParams;
pub use settings::{resolve, ModelSampling, PartialSampling, Resolved, Source};
