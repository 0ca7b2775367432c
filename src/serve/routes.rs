//! The router: every endpoint, the 404 and 405 answers in the OpenAI error shape, the
//! API-key check, and the layer that counts each request by status and logs one line
//! per request (method, path, status, tokens, time) to stderr when its response body is
//! done (a stream's at its end), or 499 when the client went away first.

use std::cell::Cell;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body::{Frame, SizeHint};
use serde_json::json;

use super::error::ApiError;
use super::wire::{self, DetokenizeBody, TokenizeBody};
use super::{generate, page, App, TokenLog};

/// Every route of the server over `app`.
pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(generate::chat))
        .route("/v1/completions", post(generate::completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(from_fn_with_state(app.clone(), auth));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/", get(page::page))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(from_fn_with_state(app.clone(), observe))
        .with_state(app)
}

/// `GET /health`: 200 once the model is loaded, 503 before.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.model() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models`: the one model served.
async fn models(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let m = app.model()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": "graft",
            "context_length": m.ctx,
        }],
    }))
    .into_response())
}

/// `GET /metrics`.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        app.metrics.render(),
    )
        .into_response()
}

/// `POST /tokenize` (llama-server's): `{"content"}` to `{"tokens": [...]}`.
async fn tokenize(State(app): State<Arc<App>>, req: Request) -> Result<Response, ApiError> {
    let m = app.model()?;
    let body = app.read_body(req).await?;
    let out = tokio::task::spawn_blocking(move || -> Result<serde_json::Value, ApiError> {
        let b: TokenizeBody = wire::parse(&body)?;
        let ids = m.tokenizer.encode_with(&b.content, b.add_special)?;
        Ok(match b.with_pieces {
            false => json!({ "tokens": ids }),
            true => {
                let pieces: Vec<_> = ids
                    .iter()
                    .map(|&id| json!({"id": id, "piece": m.tokenizer.decode(&[id]).unwrap_or_default()}))
                    .collect();
                json!({ "tokens": pieces })
            }
        })
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e.to_string()))??;
    Ok(Json(out).into_response())
}

/// `POST /detokenize`: `{"tokens": [...]}` to `{"content"}`.
async fn detokenize(State(app): State<Arc<App>>, req: Request) -> Result<Response, ApiError> {
    let m = app.model()?;
    let body = app.read_body(req).await?;
    let b: DetokenizeBody = wire::parse(&body)?;
    if let Some((i, t)) = b
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= m.vocab)
    {
        return Err(ApiError::invalid(
            format!("tokens[{i}]"),
            format!("token {t} is outside the vocabulary of {} tokens", m.vocab),
        ));
    }
    let content = m.tokenizer.decode(&b.tokens)?;
    Ok(Json(json!({ "content": content })).into_response())
}

/// Any other path.
async fn not_found(method: Method, req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no such endpoint: {method} {}", short(req.uri().path())),
    )
}

/// A known path with the wrong method.
async fn method_not_allowed(method: Method, req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", short(req.uri().path())),
    )
}

/// A path cut for messages and logs.
fn short(path: &str) -> &str {
    match path.char_indices().nth(120) {
        Some((i, _)) => &path[..i],
        None => path,
    }
}

/// The API key check (`--api-key`): `Authorization: Bearer <key>`.
async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.as_bytes(), key.as_bytes())) {
            let e = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "a valid API key is needed: send the header Authorization: Bearer <key>",
            );
            return e.into_response();
        }
    }
    next.run(req).await
}

/// Equality of two keys in a time that depends on their lengths only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts each request by status and logs it when its body is done; a request whose
/// client went away first (its handler or its body dropped unfinished) is logged and
/// counted with the status 499 (nginx's "client closed request").
async fn observe(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let tokens = TokenLog::default();
    let mut line = LogLine {
        app: app.clone(),
        started: Instant::now(),
        method: req.method().clone(),
        path: short(req.uri().path()).to_string(),
        status: None,
        ended: Cell::new(false),
        tokens: tokens.clone(),
    };
    req.extensions_mut().insert(tokens);
    let resp = next.run(req).await;
    line.status = Some(resp.status().as_u16());
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, Body::new(Logged { body, line }))
}

/// A request's log line, printed and counted when dropped (with its response body).
struct LogLine {
    app: Arc<App>,
    started: Instant,
    method: Method,
    path: String,
    /// The response's status, once the handler answered.
    status: Option<u16>,
    /// Whether the whole response body was handed over.
    ended: Cell<bool>,
    tokens: TokenLog,
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let tokens = match self.tokens.get() {
            Some((p, c)) => format!(" {p}+{c} tokens"),
            None => String::new(),
        };
        let (status, note) = match (self.status, self.ended.get()) {
            (Some(s), true) => (s, ""),
            (Some(_) | None, _) => {
                self.app.metrics.count_request(&self.path, 499);
                (499, " (the client went away)")
            }
        };
        eprintln!(
            "{} {} {status}{tokens} {:.3}s{note}",
            self.method,
            self.path,
            self.started.elapsed().as_secs_f64()
        );
    }
}

impl LogLine {
    /// The whole body was handed over: the request is counted (before its last bytes
    /// go out, so that a client that reads them finds it counted).
    fn end(&self) {
        if let (Some(status), false) = (self.status, self.ended.replace(true)) {
            self.app.metrics.count_request(&self.path, status);
        }
    }
}

/// A response body that carries its request's log line.
struct Logged {
    body: Body,
    line: LogLine,
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.line.end();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let end = self.body.is_end_stream();
        if end {
            self.line.end();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A JSON response.
struct Json(serde_json::Value);

impl IntoResponse for Json {
    fn into_response(self) -> Response {
        (
            [(header::CONTENT_TYPE, "application/json")],
            self.0.to_string(),
        )
            .into_response()
    }
}
