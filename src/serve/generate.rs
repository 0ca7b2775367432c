//! `POST /v1/chat/completions` and `POST /v1/completions`: read the body, turn it into
//! an engine request on a blocking thread ([`params::prepare`]), take a place in the
//! queue, hand the request to the engine thread, and answer with the whole response or
//! a stream ([`super::stream`]). A client that goes away drops the handler (or the
//! stream), whose [`Submission`] then cancels the request.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;

use crate::engine::Event;

use super::answer::{Answer, End};
use super::error::ApiError;
use super::params::{self, Job};
use super::wire::{self, Endpoint, GenerateBody};
use super::worker::{Submission, Update};
use super::{stream, App, Slot, TokenLog};

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(app): State<Arc<App>>,
    Extension(log): Extension<TokenLog>,
    req: Request,
) -> Response {
    generate(app, log, Endpoint::Chat, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(app): State<Arc<App>>,
    Extension(log): Extension<TokenLog>,
    req: Request,
) -> Response {
    generate(app, log, Endpoint::Completions, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn generate(
    app: Arc<App>,
    log: TokenLog,
    at: Endpoint,
    req: Request,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let model = app.model()?;
    let body = app.read_body(req).await?;
    let m = model.clone();
    let job = tokio::task::spawn_blocking(move || {
        let parsed: GenerateBody = wire::parse(&body)?;
        params::prepare(&m, at, parsed)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("preparing the request failed: {e}"),
        )
    })??;
    let slot = app.admission.enter()?;
    let Job {
        endpoint,
        request,
        stream: streamed,
        include_usage,
    } = job;
    let logprobs = request.logprobs.is_some();
    let mut sub = app.worker.submit(request);
    match sub.next().await {
        Some(Update::Accepted) => {}
        Some(Update::Rejected(e)) => return Err(e.into()),
        Some(Update::Event(_)) | None => return Err(engine_gone()),
    }
    let answer = Answer::new(
        endpoint,
        model,
        app.metrics.clone(),
        log,
        logprobs,
        include_usage,
        arrived,
    );
    Ok(match streamed {
        true => stream::respond(answer, sub, slot),
        false => collect(answer, sub, slot).await?,
    })
}

/// The 503 of a request the engine thread can no longer take.
pub fn engine_gone() -> ApiError {
    ApiError::unavailable(
        "engine_stopped",
        "the engine has stopped: the server is shutting down",
        5,
    )
}

/// Waits for the whole answer.
async fn collect(
    mut answer: Answer,
    mut sub: Submission,
    _slot: Slot,
) -> Result<Response, ApiError> {
    loop {
        match sub.next().await {
            Some(Update::Event(Event::Token {
                text,
                token,
                logprobs,
                ..
            })) => {
                answer.token();
                answer.keep(&text, token, logprobs);
            }
            Some(Update::Event(Event::Finished {
                reason,
                text,
                usage,
                ..
            })) => {
                answer.keep(&text, 0, None);
                answer.finish(usage);
                let body = answer.response(&End { reason, usage });
                return Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response());
            }
            Some(Update::Event(Event::Error { error, .. })) => return Err(error.into()),
            Some(Update::Accepted | Update::Rejected(_)) | None => return Err(engine_gone()),
        }
    }
}
