//! Streamed answers as server-sent events: one `data: {chunk}` event per piece of
//! text (see [`Answer`]), the finish reason, the usage when `include_usage` asks for it,
//! and `data: [DONE]`. A failure mid-stream is sent as `data: {"error": {...}}` and
//! ends the stream. Dropping the stream (the client went away) drops the
//! [`Submission`], which cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;

use crate::engine::Event;

use super::answer::{Answer, End};
use super::error::ApiError;
use super::generate::engine_gone;
use super::worker::{Submission, Update};
use super::Slot;

/// What the stream holds between events.
struct State {
    answer: Answer,
    sub: Submission,
    _slot: Slot,
    /// Events made and not yet sent.
    ready: VecDeque<String>,
    done: bool,
}

impl State {
    /// Turns the next update into events; marks the stream done at its end.
    async fn pull(&mut self) {
        match self.sub.next().await {
            Some(Update::Event(Event::Token {
                text,
                token,
                logprobs,
                ..
            })) => {
                self.answer.token();
                self.ready
                    .extend(self.answer.token_chunk(text, token, logprobs));
            }
            Some(Update::Event(Event::Finished {
                reason,
                text,
                usage,
                ..
            })) => {
                self.answer.finish(usage);
                let end = End { reason, usage };
                self.ready.extend(self.answer.end_chunks(text, &end));
                self.ready.push_back("[DONE]".into());
                self.done = true;
            }
            Some(Update::Event(Event::Error { error, .. })) => self.fail(error.into()),
            Some(Update::Accepted | Update::Rejected(_)) | None => self.fail(engine_gone()),
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.ready.push_back(e.body());
        self.done = true;
    }
}

/// The streamed response to a request the engine has accepted.
pub fn respond(answer: Answer, sub: Submission, slot: Slot) -> Response {
    let ready: VecDeque<String> = answer.first_chunk().into_iter().collect();
    let state = State {
        answer,
        sub,
        _slot: slot,
        ready,
        done: false,
    };
    let events = stream::unfold(state, |mut s| async move {
        while s.ready.is_empty() && !s.done {
            s.pull().await;
        }
        let data = s.ready.pop_front()?;
        Some((Ok::<_, Infallible>(SseEvent::default().data(data)), s))
    });
    Sse::new(events).into_response()
}
