//! The JSON of the OpenAI API: request bodies, read strictly (an unknown field, a wrong
//! type or a missing field is a 400 naming the field), and the response bodies and
//! stream chunks of `/v1/chat/completions` and `/v1/completions`.
//!
//! Both endpoints read one body type, [`GenerateBody`]; the fields of the other endpoint
//! are refused by [`GenerateBody::check_fields`]. Fields whose JSON type varies (`prompt`,
//! `stop`, `logprobs`, a message's `content`) stay [`Value`]s here and are read by
//! [`super::params`], which names the field in its errors.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ApiError;

/// A body of `/v1/chat/completions` or `/v1/completions`: the OpenAI fields, and the
/// llama-server extensions `top_k`, `min_p`, `typical_p`, `repeat_penalty`,
/// `repeat_last_n`, `ignore_eos` and `cache_prompt` (accepted; the prefix cache is
/// always on).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub prompt: Option<Value>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u64>,
    pub echo: Option<bool>,
    pub best_of: Option<u64>,
    pub suffix: Option<String>,
    pub ignore_eos: Option<bool>,
    pub cache_prompt: Option<bool>,
    pub user: Option<String>,
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub store: Option<bool>,
    pub metadata: Option<Value>,
    pub service_tier: Option<String>,
}

/// Which endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl GenerateBody {
    /// Refuses the fields that belong to the other endpoint, and the features graft does
    /// not serve (tools, a structured response format, `echo`, `best_of` above 1).
    pub fn check_fields(&self, at: Endpoint) -> Result<(), ApiError> {
        let present = |name: &'static str, set: bool| set.then_some(name);
        let foreign = match at {
            Endpoint::Chat => [
                present("prompt", self.prompt.is_some()),
                present("echo", self.echo.is_some()),
                present("best_of", self.best_of.is_some()),
                present("suffix", self.suffix.is_some()),
            ],
            Endpoint::Completions => [
                present("messages", self.messages.is_some()),
                present(
                    "max_completion_tokens",
                    self.max_completion_tokens.is_some(),
                ),
                present("top_logprobs", self.top_logprobs.is_some()),
                present("tools", self.tools.is_some() || self.tool_choice.is_some()),
            ],
        };
        if let Some(name) = foreign.into_iter().flatten().next() {
            let path = match at {
                Endpoint::Chat => "/v1/chat/completions",
                Endpoint::Completions => "/v1/completions",
            };
            return Err(ApiError::bad(
                name,
                "unknown_parameter",
                format!("{name} is not a parameter of {path}"),
            ));
        }
        let unsupported = |param: &str, what: &str| {
            Err(ApiError::bad(
                param,
                "unsupported_parameter",
                format!("{param}: {what} is not supported by this server"),
            ))
        };
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return unsupported("tools", "tool calling");
        }
        if let Some(choice) = &self.tool_choice {
            if !matches!(choice.as_str(), Some("none" | "auto")) {
                return unsupported("tool_choice", "a tool choice other than none or auto");
            }
        }
        if self
            .response_format
            .as_ref()
            .is_some_and(|f| f.kind != "text")
        {
            return unsupported("response_format", "a response format other than text");
        }
        if self.echo == Some(true) {
            return unsupported("echo", "echoing the prompt");
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return unsupported("best_of", "best_of other than 1");
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return unsupported("suffix", "a suffix (insertion)");
        }
        Ok(())
    }
}

/// One message of a chat.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Value>,
    pub name: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send one more chunk with the usage before `[DONE]`.
    pub include_usage: Option<bool>,
    /// Accepted and ignored (padding against length side channels).
    pub include_obfuscation: Option<bool>,
}

/// `response_format`: only `{"type": "text"}` is served.
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
}

/// `/tokenize`'s body (llama-server's).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeBody {
    pub content: String,
    /// Add the tokenizer's special tokens (BOS); default off, as in llama-server.
    #[serde(default)]
    pub add_special: bool,
    /// Answer `[{"id", "piece"}]` instead of ids.
    #[serde(default)]
    pub with_pieces: bool,
}

/// `/detokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeBody {
    pub tokens: Vec<u32>,
}

/// Reads a JSON body into `T`: malformed JSON (or not UTF-8) is `invalid_json`; a body
/// that is not an object, a field of the wrong type, an unknown field or a missing one
/// is a 400 naming it. The JSON is read whole first, so a syntax error anywhere is
/// reported as one; of a key given twice, the last counts.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| body_error(".", &e))?;
    if !value.is_object() {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "invalid_type",
            "the body must be a JSON object",
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        body_error(&path, &e.into_inner())
    })
}

/// The 400 of a body that did not deserialize at `path` with `e`.
fn body_error(path: &str, e: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    let msg = e.to_string();
    match e.classify() {
        Category::Io | Category::Syntax | Category::Eof => ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is not valid JSON: {msg}"),
        ),
        Category::Data => {
            // serde names a missing or unknown field in backquotes
            let quoted = msg.split('`').nth(1).unwrap_or("");
            let (code, param) = if msg.starts_with("missing field") {
                ("missing_required_parameter", join(path, quoted))
            } else if msg.starts_with("unknown field") {
                ("unknown_parameter", path.to_string())
            } else if msg.starts_with("invalid type") {
                ("invalid_type", path.to_string())
            } else {
                ("invalid_value", path.to_string())
            };
            let param = match param.as_str() {
                "." | "" => None,
                _ => Some(param),
            };
            let message = match &param {
                Some(p) => format!("{p}: {msg}"),
                None => format!("the body: {msg}"),
            };
            ApiError {
                param,
                ..ApiError::new(axum::http::StatusCode::BAD_REQUEST, code, message)
            }
        }
    }
}

/// `parent.field`, or `field` at the top.
fn join(parent: &str, field: &str) -> String {
    match parent {
        "." | "" => field.to_string(),
        p => format!("{p}.{field}"),
    }
}

/// Token counts (`usage`).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

impl From<crate::engine::Usage> for UsageBody {
    fn from(u: crate::engine::Usage) -> UsageBody {
        UsageBody {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// The one choice of a chat completion.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// The reply.
#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

/// The choice of a chat chunk.
#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// What a chat chunk adds.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A chat choice's `logprobs`.
#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// One generated token's log-probability, with the most likely alternatives.
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative.
#[derive(Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Every answer body: a whole chat completion (`object: "chat.completion"`), a chunk of
/// a streamed one (`"chat.completion.chunk"`), or a text completion or a chunk of one
/// (`"text_completion"`); `C` is the endpoint's choice.
#[derive(Debug, Serialize)]
pub struct Envelope<'a, C> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    /// In a whole answer always; in a stream only with `include_usage` (`null` but on
    /// the last chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

/// The choice of a text completion.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub text: String,
    pub index: usize,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A text completion's `logprobs` (the legacy shape).
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    pub text_offset: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> ApiError {
        parse::<GenerateBody>(body.as_bytes()).unwrap_err()
    }

    #[test]
    fn errors_name_the_field() {
        let e = err(r#"{"temperature": "hot"}"#);
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("temperature"), "invalid_type")
        );
        let e = err(r#"{"max_tokens": -1}"#);
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("max_tokens"), "invalid_value")
        );
        let e = err(r#"{"bogus": 1}"#);
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("bogus"), "unknown_parameter")
        );
        let e = err(r#"{"messages": [{"role": "user", "content": "x", "extra": 1}]}"#);
        assert_eq!(e.code, "unknown_parameter");
        assert_eq!(e.param.as_deref(), Some("messages[0].extra"));
        let e = err(r#"{"messages": [{"content": "x"}]}"#);
        assert_eq!(e.code, "missing_required_parameter");
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        for bad in ["{", "[1,", "{} {}", "nul", "{\"a\" 1}"] {
            assert_eq!(err(bad).code, "invalid_json", "{bad}");
        }
        assert_eq!(
            parse::<GenerateBody>(b"{\"user\": \"\xff\"}")
                .unwrap_err()
                .code,
            "invalid_json"
        );
    }

    #[test]
    fn fields_of_the_other_endpoint_are_refused() {
        let b: GenerateBody = parse(br#"{"prompt": "x"}"#).unwrap();
        assert_eq!(
            b.check_fields(Endpoint::Chat).unwrap_err().param.as_deref(),
            Some("prompt")
        );
        assert!(b.check_fields(Endpoint::Completions).is_ok());
        let b: GenerateBody = parse(br#"{"tools": [{"type": "function"}]}"#).unwrap();
        assert_eq!(
            b.check_fields(Endpoint::Chat).unwrap_err().code,
            "unsupported_parameter"
        );
    }
}
