//! Models through the library on the committed fixtures: golden logits and greedy tokens
//! against Hugging Face transformers (on the CPU, and on the GPU with `--features cuda`),
//! tensor parallelism, loading HF checkpoints and their broken copies, quantized models,
//! the context shift, the batched engine, the sampler chain, and the real default model
//! when it is in the cache.
//!
//! None of these runs the `graft` binary or reads the source tree (fixtures come from
//! `GRAFT_FIXTURES` when set), so the binary also runs from a GPU bundle
//! (scripts/gpu-bundle.sh).

#[allow(dead_code)] // only the tests of the default model use it
#[path = "../support/default_model.rs"]
mod cached_model;
#[allow(dead_code)] // not every helper is used
#[path = "../support/fixtures.rs"]
mod fixtures;
#[allow(dead_code)] // not every helper is used
#[path = "../support/reference.rs"]
mod reference;
#[allow(dead_code)] // not every helper is used
#[path = "../support/runs.rs"]
mod runs;

mod context_shift;
mod default_model;
mod engine;
mod llama_loader;
mod llama_quantize;
mod model_fixtures;
mod quant_model;
mod sampling;
mod tensor_parallel;
