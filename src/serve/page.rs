//! `GET /`: a chat page, one static HTML file with plain JavaScript (no build step),
//! embedded in the binary. It keeps the conversation in the page and streams each reply
//! from `/v1/chat/completions`; an API key typed into it is sent as a bearer token.

use axum::http::header;
use axum::response::IntoResponse;

/// The page.
pub const PAGE: &str = include_str!("page.html");

/// `GET /`.
pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
}
