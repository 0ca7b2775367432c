//! Text in and out of a model: tokenizers from `tokenizer.json` ([`tokenizer`]) or GGUF
//! metadata ([`gguf_tokenizer`]), chat templates ([`chat`]) and the multi-turn chat loop
//! over a model's cache ([`chat_session`]). Depends on the rooms below it (it drives a
//! [`runtime`](super::runtime) model); nothing below depends on it.

pub mod chat;
pub mod gguf_tokenizer;
pub mod tokenizer;
