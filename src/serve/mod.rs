//! `graft serve`: an OpenAI-compatible HTTP server on the batched [`Engine`].
//!
//! axum on a tokio runtime handles HTTP; one engine thread ([`worker`]) owns the engine
//! and its backend, steps the batch while there is work and forwards each request's
//! events to its handler over a channel. Handlers parse ([`wire`]), check and tokenize
//! ([`params`]) on blocking threads, so the engine thread does nothing but schedule,
//! compute and sample.
//!
//! - [`routes`]: the endpoints, 404/405 answers, the API key, the request log and counts;
//! - [`generate`] and [`stream`]: the two generation endpoints, whole or as server-sent
//!   events; [`answer`] builds both from the same events;
//! - [`error`]: errors in the OpenAI shape; [`metrics`]: `/metrics`; [`page`]: the chat
//!   page at `/`.
//!
//! The server binds first and loads the model on the engine thread: `/health` answers
//! 503 until the model is loaded. Requests beyond `--parallel` wait in a queue of at most
//! `--max-queue`; past it a request gets 503 with `Retry-After`. SIGINT or SIGTERM stops
//! accepting connections and lets running requests finish within `--shutdown-timeout`.

pub mod answer;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod page;
pub mod params;
pub mod routes;
pub mod stream;
pub mod wire;
pub mod worker;

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::serve::ListenerExt;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::models::runtime::sampling::PartialSampling;
use crate::models::text::chat::ChatTemplate;
use crate::models::Tokenizer;

use error::ApiError;
use metrics::Metrics;
use worker::Worker;

/// The server's settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on (`--host`).
    pub host: String,
    /// Port (`--port`; 0 picks a free one, printed at start).
    pub port: u16,
    /// The key clients must send as `Authorization: Bearer` (`--api-key`).
    pub api_key: Option<String>,
    /// Largest request body in bytes (`--max-body`).
    pub max_body: usize,
    /// Longest wait for a request body (`--timeout`).
    pub read_timeout: Duration,
    /// Sequences computed at once (`--parallel`).
    pub parallel: usize,
    /// Requests that may wait beyond `parallel` (`--max-queue`).
    pub max_queue: usize,
    /// How long running requests may take to finish after SIGINT/SIGTERM.
    pub shutdown_timeout: Duration,
}

/// The model being served, as the handlers see it.
pub struct ServedModel {
    /// Its name in requests and `/v1/models`.
    pub id: String,
    /// When it was loaded (Unix seconds).
    pub created: u64,
    /// Its tokenizer (special tokens in text parsed as such).
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template, or why it does not compile.
    pub template: std::result::Result<ChatTemplate, String>,
    /// Positions per sequence.
    pub ctx: usize,
    /// Token ids.
    pub vocab: usize,
    /// The settings a request leaves out: the server's flags over the model's
    /// recommendation (the chat defaults under both).
    pub sampling: PartialSampling,
}

/// What every handler shares.
pub struct App {
    cfg: ServeConfig,
    model: OnceLock<Arc<ServedModel>>,
    worker: Worker,
    admission: Admission,
    metrics: Arc<Metrics>,
}

impl App {
    /// The model, or 503 while it loads.
    pub fn model(&self) -> std::result::Result<Arc<ServedModel>, ApiError> {
        self.model
            .get()
            .cloned()
            .ok_or_else(|| ApiError::unavailable("model_loading", "the model is loading", 1))
    }

    /// The request body: at most `--max-body` bytes (else 413), within `--timeout`
    /// (else 408). A body over the limit is still read (up to [`DRAIN_LIMIT`]) and
    /// dropped, so that the client, still sending it, reads the 413 rather than a reset
    /// connection.
    pub async fn read_body(&self, req: Request) -> std::result::Result<Bytes, ApiError> {
        use http_body_util::BodyExt;
        let limit = self.cfg.max_body;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut keep = declared.is_none_or(|n| n <= limit as u64);
        let mut body = req.into_body();
        let read = async {
            let (mut buf, mut seen) = (Vec::new(), 0usize);
            while let Some(frame) = body.frame().await {
                let Ok(data) = frame?.into_data() else {
                    continue;
                };
                seen = seen.saturating_add(data.len());
                keep &= seen <= limit;
                if keep {
                    buf.extend_from_slice(&data);
                } else if seen > DRAIN_LIMIT.max(limit) {
                    break;
                }
            }
            Ok::<_, axum::Error>((buf, keep))
        };
        match tokio::time::timeout(self.cfg.read_timeout, read).await {
            Ok(Ok((buf, true))) => Ok(Bytes::from(buf)),
            Ok(Ok((_, false))) => Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                format!("the request body is larger than {limit} bytes (--max-body)"),
            )),
            Ok(Err(e)) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_body",
                format!("the request body could not be read: {e}"),
            )),
            Err(_) => Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!(
                    "the request body did not arrive within {} s (--timeout)",
                    self.cfg.read_timeout.as_secs_f64()
                ),
            )),
        }
    }
}

/// Bytes of a body over `--max-body` read and dropped before the 413 (past them the
/// connection is closed).
pub const DRAIN_LIMIT: usize = 64 << 20;

/// The count of generation requests in the server, against `--parallel` +
/// `--max-queue`.
struct Admission {
    in_flight: Arc<AtomicUsize>,
    limit: usize,
}

/// A generation request's place; given back when dropped.
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    /// A place, or 503 when `--parallel` requests run and `--max-queue` wait.
    fn enter(&self) -> std::result::Result<Slot, ApiError> {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.in_flight.clone());
        if before >= self.limit {
            return Err(ApiError::unavailable(
                "server_overloaded",
                format!(
                    "the server is full: {before} requests are running or waiting (--parallel + --max-queue = {})",
                    self.limit
                ),
                1,
            ));
        }
        Ok(slot)
    }
}

/// A request's token counts for its log line, set when it finishes.
#[derive(Clone, Default)]
pub struct TokenLog(Arc<Mutex<Option<(usize, usize)>>>);

impl TokenLog {
    /// Records `prompt` and `completion` tokens.
    pub fn set(&self, prompt: usize, completion: usize) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((prompt, completion));
    }

    /// The counts, if recorded.
    pub fn get(&self) -> Option<(usize, usize)> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Serves until SIGINT/SIGTERM: binds `cfg.host:cfg.port`, prints the address, runs
/// `load` on the engine thread (the engine, and the model as the handlers see it), and
/// answers 503 on `/health` until it returns. An error of `load` ends the server with
/// that error.
pub fn run<L>(cfg: ServeConfig, load: L) -> Result<()>
where
    L: FnOnce() -> Result<(Engine, ServedModel)> + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("graft-http")
        .build()
        .map_err(|e| Error::io("the tokio runtime", e))?;
    let r = rt.block_on(serve(cfg, load));
    // blocking tasks still tokenizing a prompt are not waited for
    rt.shutdown_timeout(Duration::from_millis(100));
    r
}

async fn serve<L>(cfg: ServeConfig, load: L) -> Result<()>
where
    L: FnOnce() -> Result<(Engine, ServedModel)> + Send + 'static,
{
    let at = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&at)
        .await
        .map_err(|e| Error::io(&at, e))?;
    let addr: SocketAddr = listener.local_addr().map_err(|e| Error::io(&at, e))?;
    let metrics = Arc::new(Metrics::new());
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel();
    let load = move || {
        let (mut engine, model) = load()?;
        engine.set_detokenizer(model.tokenizer.clone());
        Ok((engine, model))
    };
    let worker = Worker::start(load, loaded_tx, metrics.clone())
        .map_err(|e| Error::io("the engine thread", e))?;
    let app = Arc::new(App {
        admission: Admission {
            in_flight: Arc::new(AtomicUsize::new(0)),
            limit: cfg.parallel.saturating_add(cfg.max_queue),
        },
        cfg: cfg.clone(),
        model: OnceLock::new(),
        worker,
        metrics,
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        stop_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&s| s).await;
    };
    let listener = listener.tap_io(|tcp| {
        // small stream chunks go out at once
        let _ = tcp.set_nodelay(true);
    });
    let server = axum::serve(listener, routes::router(app.clone()))
        .with_graceful_shutdown(stopped(stop_rx.clone()));
    let server = tokio::spawn(server.into_future());
    eprintln!("graft serve: listening on http://{addr} (loading the model)");
    tokio::select! {
        r = loaded_rx => {
            let model = r.map_err(|_| Error::model("the engine thread ended while loading the model"))??;
            let (id, ctx) = (model.id.clone(), model.ctx);
            // set before the line that says so: a client that read it finds the model
            let _ = app.model.set(Arc::new(model));
            eprintln!("graft serve: ready: http://{addr}/ serves '{id}' (context {ctx} positions per sequence)");
        }
        () = stopped(stop_rx.clone()) => {
            eprintln!("graft serve: stopped while loading the model");
            return Ok(());
        }
    }
    stopped(stop_rx).await;
    let running = app.admission.in_flight.load(Ordering::Acquire);
    eprintln!(
        "graft serve: stopping: no new connections; {running} requests may finish within {} s (--shutdown-timeout)",
        cfg.shutdown_timeout.as_secs_f64()
    );
    tokio::select! {
        r = tokio::time::timeout(cfg.shutdown_timeout, server) => match r {
            Ok(_) => eprintln!("graft serve: every request finished; bye"),
            Err(_) => eprintln!(
                "graft serve: --shutdown-timeout passed with {} requests unfinished; they are cut off",
                app.admission.in_flight.load(Ordering::Acquire)
            ),
        },
        () = stop_signal() => eprintln!("graft serve: a second signal: stopping now"),
    }
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}
