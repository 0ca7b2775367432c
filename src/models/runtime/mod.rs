//! Running a loaded model: the [`Model`](model::Model) on a backend (prefill, decode,
//! the generation loop), sampling ([`sampling`]), what a forward pass returns ([`output`]),
//! whether cache and plans fit the device ([`memory`]) and traces of every intermediate
//! ([`trace`]). Depends on [`arch`](super::arch), [`load`](super::load) and
//! [`blocks`](super::blocks).

pub mod memory;
pub mod model;
pub mod output;
pub mod sampling;
pub mod trace;
