//! A request body turned into an engine [`Request`]: the prompt (a chat rendered with the
//! model's template, or a completion prompt as text or token ids) tokenized, the
//! sampling settings (the request's, the model's, the chat defaults), the OpenAI API's
//! ranges checked, the
//! stop conditions, the log-probabilities asked for. Runs on a blocking thread, never on
//! the engine's: rendering and tokenizing a long prompt takes a while.

use serde_json::Value;

use crate::engine::{Request, Stop};
use crate::models::runtime::sampling::{resolve, PartialSampling};
use crate::models::text::chat::Message;
use crate::models::SamplingParams;

use super::error::ApiError;
use super::wire::{ChatMessage, Endpoint, GenerateBody};
use super::ServedModel;

/// Stop strings a request may give (the OpenAI API's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// Alternatives per token `top_logprobs` / `logprobs` may ask for (the OpenAI API's
/// limit for chat).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// Tokens `/v1/completions` generates when the request does not say (the OpenAI API's
/// default); chat replies run to the end of the turn or of the context.
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// A request ready for the engine, and how to answer it.
#[derive(Debug)]
pub struct Job {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// What the engine runs.
    pub request: Request,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Send the usage in a last chunk of the stream.
    pub include_usage: bool,
}

/// Checks `body` for `at` against `model` and builds its [`Job`].
pub fn prepare(model: &ServedModel, at: Endpoint, body: GenerateBody) -> Result<Job, ApiError> {
    body.check_fields(at)?;
    if let Some(name) = body.model.as_deref().filter(|&m| m != model.id) {
        return Err(ApiError {
            status: axum::http::StatusCode::NOT_FOUND,
            ..ApiError::bad(
                "model",
                "model_not_found",
                format!(
                    "the model '{name}' does not exist: this server serves '{}' (GET /v1/models)",
                    model.id
                ),
            )
        });
    }
    if body.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad(
            "n",
            "unsupported_parameter",
            "n: only one choice per request is served (n = 1); send several requests instead",
        ));
    }
    let stream = body.stream.unwrap_or(false);
    if body.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    let include_usage = body
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let prompt = match at {
        Endpoint::Chat => chat_prompt(model, body.messages.as_deref())?,
        Endpoint::Completions => completion_prompt(model, body.prompt.as_ref())?,
    };
    let request = Request {
        prompt,
        sampling: sampling(&body, model)?,
        max_tokens: max_tokens(&body, at)?,
        stop: stop(&body, model)?,
        logprobs: logprobs(&body, at)?,
    };
    Ok(Job {
        endpoint: at,
        request,
        stream,
        include_usage,
    })
}

/// The most tokens to generate: `max_completion_tokens` or `max_tokens` (chat: up to
/// the context when neither; completions: [`DEFAULT_COMPLETION_TOKENS`]).
fn max_tokens(body: &GenerateBody, at: Endpoint) -> Result<Option<usize>, ApiError> {
    let (param, asked) = match (body.max_completion_tokens, body.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    match asked {
        Some(0) => Err(ApiError::invalid(
            param,
            format!("{param} must be at least 1"),
        )),
        // past usize: more than any context, refused by the engine's context check
        Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        None => Ok(match at {
            Endpoint::Chat => None,
            Endpoint::Completions => Some(DEFAULT_COMPLETION_TOKENS),
        }),
    }
}

/// `value` of `param` within `[lo, hi]`.
fn within(param: &str, value: f32, lo: f32, hi: f32) -> Result<f32, ApiError> {
    match value.is_finite() && (lo..=hi).contains(&value) {
        true => Ok(value),
        false => Err(ApiError::invalid(
            param,
            format!("{param} must be a number in [{lo}, {hi}], got {value}"),
        )),
    }
}

/// The sampling settings, each from the first of: the request, the server's flags and
/// the model's recommendation ([`ServedModel::sampling`]), the chat defaults
/// ([`SamplingParams::chat`]), merged by the sampler's [`resolve`] (so that temperature
/// 0 is the model's own argmax unless something sets a penalty). The flags' seed and
/// logit bias apply to a request that gives none. The OpenAI API's
/// ranges of the temperature, the penalties and the logit biases are checked here, the
/// rest by [`SamplingParams::validate`], naming the field.
fn sampling(b: &GenerateBody, model: &ServedModel) -> Result<SamplingParams, ApiError> {
    let ranged = |param: &str, v: Option<f32>, lo: f32, hi: f32| {
        v.map(|v| within(param, v, lo, hi)).transpose()
    };
    let mut logit_bias = Vec::new();
    for (key, &bias) in b.logit_bias.iter().flatten() {
        let param = format!("logit_bias.{key}");
        let id: u32 = key.parse().map_err(|_| {
            ApiError::invalid(
                &param,
                format!("'{key}' is not a token id (a whole number)"),
            )
        })?;
        logit_bias.push((id, within(&param, bias, -100.0, 100.0)?));
    }
    let count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    let asked = PartialSampling {
        temperature: ranged("temperature", b.temperature, 0.0, 2.0)?,
        top_k: b.top_k.map(|k| count(k.max(0) as u64)),
        top_p: b.top_p,
        min_p: b.min_p,
        typical_p: b.typical_p,
        repeat_penalty: b.repeat_penalty,
        presence_penalty: ranged("presence_penalty", b.presence_penalty, -2.0, 2.0)?,
        frequency_penalty: ranged("frequency_penalty", b.frequency_penalty, -2.0, 2.0)?,
        repeat_last_n: b.repeat_last_n.map(count),
        // any 64-bit integer; a negative one by its two's complement bits
        seed: b.seed.map(|s| s as u64),
        logit_bias,
    };
    let given = asked.or(&model.sampling);
    let params = resolve(&given, &PartialSampling::default(), &SamplingParams::chat()).params;
    params.validate(model.vocab)?;
    Ok(params)
}

/// The stop strings (a string or up to [`MAX_STOP_STRINGS`]), the tokenizer's end
/// tokens, and `ignore_eos`.
fn stop(b: &GenerateBody, model: &ServedModel) -> Result<Stop, ApiError> {
    let strings = match &b.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                Value::Null
                | Value::Bool(_)
                | Value::Number(_)
                | Value::Array(_)
                | Value::Object(_) => Err(ApiError::bad(
                    format!("stop[{i}]"),
                    "invalid_type",
                    format!("stop[{i}] must be a string"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Bool(_) | Value::Number(_) | Value::Object(_)) => {
            return Err(ApiError::bad(
                "stop",
                "invalid_type",
                "stop must be a string or a list of strings",
            ))
        }
    };
    if strings.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop holds {} strings; at most {MAX_STOP_STRINGS} are allowed",
                strings.len()
            ),
        ));
    }
    if strings.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "a stop string must not be empty"));
    }
    let ignore_eos = b.ignore_eos.unwrap_or(false);
    Ok(Stop {
        token_ids: match ignore_eos {
            true => Vec::new(),
            false => model.tokenizer.stop_ids().to_vec(),
        },
        strings,
        ignore_eos,
        context_shift: false,
    })
}

/// The alternatives per token asked for: chat's `logprobs: true` with `top_logprobs`,
/// or completions' `logprobs: N`.
fn logprobs(b: &GenerateBody, at: Endpoint) -> Result<Option<usize>, ApiError> {
    let top = |param: &str, n: u64| match n <= MAX_TOP_LOGPROBS {
        true => Ok(n as usize),
        false => Err(ApiError::invalid(
            param,
            format!("{param} must be in [0, {MAX_TOP_LOGPROBS}], got {n}"),
        )),
    };
    let wrong = |what: &str| {
        Err(ApiError::bad(
            "logprobs",
            "invalid_type",
            format!("logprobs must be {what} on this endpoint"),
        ))
    };
    match (at, &b.logprobs) {
        (Endpoint::Chat, None | Some(Value::Null) | Some(Value::Bool(false))) => {
            match b.top_logprobs {
                Some(n) if n > 0 => Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                )),
                Some(_) | None => Ok(None),
            }
        }
        (Endpoint::Chat, Some(Value::Bool(true))) => {
            Ok(Some(top("top_logprobs", b.top_logprobs.unwrap_or(0))?))
        }
        (Endpoint::Chat, Some(_)) => wrong("true or false"),
        (Endpoint::Completions, None | Some(Value::Null)) => Ok(None),
        (Endpoint::Completions, Some(Value::Number(n))) => match n.as_u64() {
            Some(n) => Ok(Some(top("logprobs", n)?)),
            None => wrong("a whole number from 0"),
        },
        (Endpoint::Completions, Some(_)) => wrong("a whole number (alternatives per token)"),
    }
}

/// The text of a message's `content`: a string, or a list of `{"type": "text", "text"}`
/// parts (joined by newlines); `null` only for an assistant's message.
fn content_text(i: usize, m: &ChatMessage) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    let parts = match &m.content {
        Some(Value::String(s)) => return Ok(s.clone()),
        None | Some(Value::Null) if m.role == "assistant" => return Ok(String::new()),
        Some(Value::Array(parts)) => parts,
        None | Some(Value::Null) | Some(Value::Bool(_) | Value::Number(_) | Value::Object(_)) => {
            return Err(ApiError::bad(
                param,
                "invalid_type",
                format!("messages[{i}].content must be a string or a list of text parts"),
            ))
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
            (Some(kind), _) if kind != "text" => {
                return Err(ApiError::bad(
                    format!("{param}[{j}].type"),
                    "unsupported_parameter",
                    format!(
                        "content parts of type '{kind}' are not supported: this server takes text"
                    ),
                ))
            }
            _ => {
                return Err(ApiError::bad(
                    format!("{param}[{j}]"),
                    "invalid_type",
                    "a content part must be {\"type\": \"text\", \"text\": \"...\"}",
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// The token ids of a chat: `messages` (system, developer as system, user, assistant)
/// rendered with the model's template up to the assistant's turn.
fn chat_prompt(
    model: &ServedModel,
    messages: Option<&[ChatMessage]>,
) -> Result<Vec<u32>, ApiError> {
    let messages = match messages {
        Some(m) if !m.is_empty() => m,
        Some(_) => return Err(ApiError::invalid("messages", "messages must not be empty")),
        None => {
            return Err(ApiError::bad(
                "messages",
                "missing_required_parameter",
                "messages is required: a list of {\"role\", \"content\"}",
            ))
        }
    };
    let mut chat = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("unknown role '{other}': use system, developer, user or assistant"),
                ))
            }
        };
        chat.push(Message::new(role, content_text(i, m)?));
    }
    let template = model.template.as_ref().map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("the model's chat template does not compile, so chats cannot be served: {e}"),
        )
    })?;
    let text = template.render(&chat, true)?;
    Ok(template.encode(&model.tokenizer, &text)?)
}

/// The token ids of a completion prompt: a string (tokenized with the tokenizer's BOS),
/// a list of token ids, or a list of one of either.
fn completion_prompt(model: &ServedModel, prompt: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let wrong = || {
        ApiError::bad(
            "prompt",
            "invalid_type",
            "prompt must be a string or a list of token ids (or a list of one of either)",
        )
    };
    let ids = |list: &[Value]| -> Result<Vec<u32>, ApiError> {
        list.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::bad(
                            format!("prompt[{i}]"),
                            "invalid_value",
                            format!("prompt[{i}] is not a token id: {v}"),
                        )
                    })
            })
            .collect()
    };
    match prompt {
        None | Some(Value::Null) => Err(ApiError::bad(
            "prompt",
            "missing_required_parameter",
            "prompt is required: a string or a list of token ids",
        )),
        Some(Value::String(text)) => Ok(model.tokenizer.encode(text)?),
        Some(Value::Array(list)) => match list.as_slice() {
            [Value::String(text)] => Ok(model.tokenizer.encode(text)?),
            [Value::Array(inner)] => ids(inner),
            [Value::String(_), ..] | [Value::Array(_), ..] => Err(ApiError::bad(
                "prompt",
                "unsupported_parameter",
                "a batch of prompts is not served: send one prompt per request",
            )),
            _ => ids(list),
        },
        Some(Value::Bool(_) | Value::Number(_) | Value::Object(_)) => Err(wrong()),
    }
}
