//! Errors as the OpenAI API writes them: a status and
//! `{"error": {"message", "type", "param", "code"}}`, with `Retry-After` on a 503 and
//! `WWW-Authenticate` on a 401. [`ApiError::from`] maps graft's own errors: a request
//! the engine refuses, a sampling setting out of range and a chat template that rejects
//! the conversation are the client's (400, naming the field); anything else is the
//! server's (500).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::Error;

/// One error response.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong and what to do, for a person.
    pub message: String,
    /// The request field at fault (`temperature`, `messages[1].role`), if one is.
    pub param: Option<String>,
    /// The kind of problem, for a program (`context_length_exceeded`, `invalid_type`).
    pub code: &'static str,
    /// Seconds the client should wait before trying again (503).
    pub retry_after: Option<u64>,
}

/// The body's wire shape.
#[derive(Serialize)]
struct Body<'a> {
    error: Fields<'a>,
}

#[derive(Serialize)]
struct Fields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
}

impl ApiError {
    /// An error with `status` and `code`, about no field in particular.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code,
            retry_after: None,
        }
    }

    /// A 400 about request field `param`.
    pub fn bad(param: impl Into<String>, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..ApiError::new(StatusCode::BAD_REQUEST, code, message)
        }
    }

    /// A 400 `invalid_value` about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::bad(param, "invalid_value", message)
    }

    /// A 503 that asks the client to come back in `seconds`.
    pub fn unavailable(code: &'static str, message: impl Into<String>, seconds: u64) -> Self {
        ApiError {
            retry_after: Some(seconds),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
        }
    }

    /// The OpenAI error type of the status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            503 => "unavailable_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        let b = Body {
            error: Fields {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&b).unwrap_or_default()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        let message = e.to_string();
        match e {
            Error::Request { param, code, .. } => ApiError::bad(param, code, message),
            Error::Sampling { param, .. } => ApiError::invalid(param, message),
            Error::ChatTemplate { .. } => ApiError::invalid("messages", message),
            Error::Shape { .. }
            | Error::DType { .. }
            | Error::UnknownTensor(_)
            | Error::IndexOutOfRange { .. }
            | Error::Plan(_)
            | Error::Unsupported { .. }
            | Error::Abandoned
            | Error::NoDevice(_)
            | Error::Backend { .. }
            | Error::Model(_)
            | Error::Gguf { .. }
            | Error::GgufInput { .. }
            | Error::TokenizerSpec { .. }
            | Error::NonFinite { .. }
            | Error::Pull(_)
            | Error::Io { .. } => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_has_the_openai_shape() {
        let e = ApiError::invalid("temperature", "must be in [0, 2], got 3");
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "temperature");
        assert_eq!(v["error"]["code"], "invalid_value");
        assert_eq!(v["error"]["message"], "must be in [0, 2], got 3");
        let e = ApiError::from(Error::request("max_tokens", "context_length_exceeded", "x"));
        assert_eq!(
            (e.status.as_u16(), e.code),
            (400, "context_length_exceeded")
        );
        let e = ApiError::from(Error::model("broken"));
        assert_eq!(e.status.as_u16(), 500);
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert!(v["error"]["param"].is_null());
    }
}
