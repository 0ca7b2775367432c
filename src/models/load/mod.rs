//! Getting a model's weights into backend memory: the layout of every weight in one buffer
//! ([`weights`]), which dtype each gets ([`quant_plan`]), host-side row conversion
//! ([`rows`]), Hugging Face safetensors folders ([`safetensors`]), GGUF files ([`gguf`])
//! the options of a load ([`options`]) and whether the weights fit the device ([`fit`]). Depends on [`arch`](super::arch) only.

pub mod fit;
pub mod gguf;
pub mod options;
pub mod quant_plan;
pub mod rows;
pub mod safetensors;
pub mod weights;
