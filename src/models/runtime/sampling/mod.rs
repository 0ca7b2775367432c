//! Sampling: the settings ([`SamplingParams`]) and the chain that applies them to a
//! row of logits ([`SamplerChain`]), one chain per sequence, shared by `generate`,
//! `chat` and anything else that decodes.

pub mod chain;
pub mod params;

pub use chain::{Row, SamplerChain};
pub use params::SamplingParams;
