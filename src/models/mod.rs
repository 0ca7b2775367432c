//! Model graphs defined with graft's public graph API: Llama 2 / 3, Mistral, Qwen2,
//! Qwen3 and GPT-2, each an architecture spec over shared blocks.
//!
//! - [`arch`]: the architectures, one short file each (which blocks, which names);
//! - [`blocks`]: the shared building blocks and the prefill, decode and trace graphs;
//! - [`model`]: the inference API ([`Model`]): prefill, decode, the generation loop,
//!   traces;
//! - [`config`]: hyper-parameters from a Hugging Face `config.json`;
//! - [`weights`]: the layout of all weights in one backend buffer (a dtype per tensor;
//!   fused q|k|v and gate|up when the parts share it);
//! - [`quant_plan`]: which dtype each weight gets when quantized (one type, or ggml's
//!   K-quant mixes), [`rows`]: converting rows between dtypes on the host;
//! - [`loader`]: safetensors checkpoints (single file or sharded) into that buffer;
//! - [`gguf_model`]: GGUF files (hyper-parameters, weights, rope layout);
//! - [`convert`]: an HF folder written as a GGUF file (`graft convert`);
//! - [`kv_cache`]: the KV cache (F32/F16/BF16/Q8_0/Q4_0; V transposed or, for the fused
//!   attention, by position);
//! - [`memory`]: whether the cache and plans fit the device's memory, checked at load;
//! - [`output`]: what a forward pass returns ([`Output`], [`Logits`]);
//! - [`sampler`]: greedy, temperature, top-k and top-p sampling;
//! - [`tp`]: tensor parallelism: how the tensors split over the devices of a group;
//! - [`trace`]: trace files (every named intermediate) read, written and compared;
//! - [`tokenizer`]: `tokenizer.json` encoding and streaming decoding;
//! - [`gguf_tokenizer`]: tokenizers from GGUF metadata (`tokenizer.ggml.*`);
//! - [`chat`]: chat templates (Jinja) rendered into prompts;
//! - [`chat_session`]: the multi-turn chat loop over the KV cache (`graft chat`);
//! - [`presets`]: benchmark shapes (Llama 2 7B and 70B, Llama 3 8B, Qwen3 8B, Mistral 7B,
//!   GPT-2 XL, tiny);
//! - [`pull`]: the default model (SmolLM2-135M-Instruct Q4_1) and its cache.

pub mod arch;
pub mod blocks;
pub mod chat;
pub mod chat_session;
pub mod config;
pub mod convert;
pub mod gguf_model;
pub mod gguf_tokenizer;
pub mod kv_cache;
pub mod loader;
pub mod memory;
pub mod model;
pub mod output;
pub mod presets;
pub mod pull;
pub mod quant_plan;
pub mod rows;
pub mod sampler;
pub mod tokenizer;
pub mod tp;
pub mod trace;
pub mod weights;

pub use arch::Arch;
pub use chat::{ChatTemplate, Message};
pub use config::Config;
pub use gguf_tokenizer::TokenizerSpec;
pub use kv_cache::{CacheTypes, KvCache};
pub use model::{Generation, LoadOptions, Model, Stop, TraceTensor};
pub use output::{Logits, Output};
pub use quant_plan::QuantPlan;
pub use sampler::Sampler;
pub use tokenizer::Tokenizer;
pub use weights::{Role, Weights};
