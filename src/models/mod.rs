//! Model graphs defined with graft's public graph API: Llama 2 / 3, Mistral, Qwen2,
//! Qwen3 and GPT-2, each an architecture spec over shared blocks. The code lives in rooms,
//! each depending only on the ones listed before it:
//!
//! - [`arch`]: the architecture specs (one short file each), hyper-parameters
//!   ([`Config`]), weight roles ([`Role`]), benchmark presets and the tensor-parallel split;
//! - [`load`]: weights into backend memory: the layout of every weight in one buffer,
//!   per-tensor dtypes ([`QuantPlan`]), safetensors folders, GGUF files, load options;
//! - [`blocks`]: the shared building blocks, the prefill, decode and trace graphs, and the
//!   KV cache's layout ([`KvCache`]);
//! - [`runtime`]: loading weights for a run, one sequence's forward pass ([`Model`]:
//!   every position's logits, traces), sampling, memory checks;
//! - [`text`]: tokenizers, chat templates and the chat loop.
//!
//! Beside the rooms: [`convert`] writes an HF folder as a GGUF file (`graft convert`;
//! it reads weights and tokenizers) and [`pull`] fetches the default model
//! (SmolLM2-135M-Instruct Q4_1).

pub mod arch;
pub mod blocks;
pub mod convert;
pub mod load;
pub mod pull;
pub mod runtime;
pub mod text;

pub use arch::config::Config;
pub use arch::role::Role;
pub use arch::Arch;
pub use blocks::kv_cache::KvCache;
pub use load::options::{CacheTypes, LoadOptions};
pub use load::quant_plan::QuantPlan;
pub use load::weights::Weights;
pub use runtime::model::{Model, TraceTensor};
pub use runtime::output::{Logits, Output};
pub use runtime::sampling::{Row, SamplerChain, SamplingParams};
pub use text::chat::{ChatTemplate, Message};
pub use text::gguf_tokenizer::TokenizerSpec;
pub use text::tokenizer::Tokenizer;
