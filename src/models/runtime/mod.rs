//! Running a loaded model: weights loaded for a run and one sequence's forward pass
//! ([`model`]: every position's logits, traces), sampling ([`sampling`]), what a forward
//! pass returns and what a sampler reads ([`output`]), whether cache and plans fit the
//! device ([`memory`]) and the comparison of traces ([`trace`]). Generation runs on the
//! batched engine ([`crate::engine`]). Depends on [`arch`](super::arch), [`load`](super::load) and
//! [`blocks`](super::blocks).

pub mod memory;
pub mod model;
pub mod output;
pub mod sampling;
pub mod trace;
