//! The engine thread: it owns the [`Engine`] (and so the backend), takes commands from
//! the request handlers over a channel (add a request with the sender of its updates,
//! cancel one), steps while there is work, sleeps in `recv` when there is none, and
//! forwards every event to its request's handler. A handler that went away (its
//! receiver dropped: the client disconnected) has its request cancelled, which frees
//! the request's KV blocks before the next step. Nothing here parses, renders or
//! serializes: the handlers do that on their own threads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::engine::{Engine, Event, Request, RequestId};
use crate::error::Error;

use super::metrics::Metrics;

/// What a handler hears about its request.
#[derive(Debug)]
pub enum Update {
    /// The engine took the request.
    Accepted,
    /// The engine refused it (the error names the field).
    Rejected(Error),
    /// A token, the end, or a failure of the request.
    Event(Event),
}

/// A command to the engine thread.
enum Command {
    Add {
        key: u64,
        request: Box<Request>,
        updates: UnboundedSender<Update>,
    },
    Cancel {
        key: u64,
    },
}

/// The handlers' side of the engine thread.
pub struct Worker {
    commands: mpsc::Sender<Command>,
    next_key: AtomicU64,
}

/// A request handed to the engine: its updates, and a guard that cancels it when
/// dropped before it finished.
pub struct Submission {
    /// The request's updates, in order.
    pub updates: UnboundedReceiver<Update>,
    cancel: CancelOnDrop,
}

struct CancelOnDrop {
    key: u64,
    commands: mpsc::Sender<Command>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // the engine thread is gone only when the process is ending
            let _ = self.commands.send(Command::Cancel { key: self.key });
        }
    }
}

impl Submission {
    /// The next update; `None` when the engine thread is gone.
    pub async fn next(&mut self) -> Option<Update> {
        let u = self.updates.recv().await;
        if let Some(
            Update::Rejected(_) | Update::Event(Event::Finished { .. } | Event::Error { .. }),
        ) = &u
        {
            self.cancel.armed = false;
        }
        u
    }
}

impl Worker {
    /// Starts the engine thread: it runs `load` (the engine is made on the thread that
    /// uses it), reports the outcome through `loaded`, then serves commands until every
    /// [`Worker`] handle is dropped and no request is left.
    pub fn start<T: Send + 'static>(
        load: impl FnOnce() -> crate::Result<(Engine, T)> + Send + 'static,
        loaded: tokio::sync::oneshot::Sender<crate::Result<T>>,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Worker> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("graft-engine".into())
            .spawn(move || match load() {
                Ok((engine, info)) => {
                    metrics.publish(&engine.stats(), engine.plans().0);
                    if loaded.send(Ok(info)).is_ok() {
                        run(engine, &rx, &metrics);
                    }
                }
                Err(e) => {
                    let _ = loaded.send(Err(e));
                }
            })?;
        Ok(Worker {
            commands: tx,
            next_key: AtomicU64::new(0),
        })
    }

    /// Hands `request` to the engine.
    pub fn submit(&self, request: Request) -> Submission {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let sent = self.commands.send(Command::Add {
            key,
            request: Box::new(request),
            updates: tx,
        });
        // a send fails only when the engine thread is gone: the receiver then ends at
        // once and the handler answers 503
        Submission {
            updates: rx,
            cancel: CancelOnDrop {
                key,
                commands: self.commands.clone(),
                armed: sent.is_ok(),
            },
        }
    }
}

/// The requests in the engine, by engine id and by handler key.
#[derive(Default)]
struct Live {
    by_id: HashMap<RequestId, (u64, UnboundedSender<Update>)>,
    by_key: HashMap<u64, RequestId>,
}

impl Live {
    fn apply(&mut self, engine: &mut Engine, c: Command) {
        match c {
            Command::Add {
                key,
                request,
                updates,
            } => match engine.add(*request) {
                Ok(id) => {
                    if updates.send(Update::Accepted).is_ok() {
                        self.by_id.insert(id, (key, updates));
                        self.by_key.insert(key, id);
                    } else {
                        engine.cancel(id);
                    }
                }
                Err(e) => {
                    let _ = updates.send(Update::Rejected(e));
                }
            },
            Command::Cancel { key } => {
                if let Some(id) = self.by_key.remove(&key) {
                    self.by_id.remove(&id);
                    engine.cancel(id);
                }
            }
        }
    }

    /// Forwards `events` and counts their tokens; a request whose handler is gone is
    /// cancelled.
    fn dispatch(&mut self, engine: &mut Engine, events: Vec<Event>, metrics: &Metrics) {
        let tokens = events
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
        metrics.generation_tokens.inc_by(tokens as u64);
        for ev in events {
            let id = ev.id();
            let last = matches!(ev, Event::Finished { .. } | Event::Error { .. });
            let Some((key, tx)) = self.by_id.get(&id) else {
                continue;
            };
            let gone = tx.send(Update::Event(ev)).is_err();
            if last || gone {
                self.by_key.remove(key);
                self.by_id.remove(&id);
            }
            if gone && !last {
                engine.cancel(id);
            }
        }
    }

    /// A failed step fails every request: each handler hears the error, and the
    /// requests leave the engine.
    fn fail_all(&mut self, engine: &mut Engine, e: &Error) {
        eprintln!("graft serve: a step failed, failing every running request: {e}");
        for (id, (_, tx)) in self.by_id.drain() {
            engine.cancel(id);
            let error = Error::model(format!("the engine failed: {e}"));
            let _ = tx.send(Update::Event(Event::Error { id, error }));
        }
        self.by_key.clear();
    }
}

/// The engine loop.
fn run(mut engine: Engine, rx: &mpsc::Receiver<Command>, metrics: &Metrics) {
    let mut live = Live::default();
    loop {
        if !engine.has_work() {
            match rx.recv() {
                Ok(c) => live.apply(&mut engine, c),
                Err(mpsc::RecvError) => break,
            }
        }
        while let Ok(c) = rx.try_recv() {
            live.apply(&mut engine, c);
        }
        let stepped = engine.has_work().then(|| engine.step());
        // published before the events go out: a client that has its answer finds the
        // counters past it
        metrics.publish(&engine.stats(), engine.plans().0);
        match stepped {
            Some(Ok(events)) => live.dispatch(&mut engine, events, metrics),
            Some(Err(e)) => {
                live.fail_all(&mut engine, &e);
                metrics.publish(&engine.stats(), engine.plans().0);
            }
            None => {}
        }
    }
    if let Err(e) = engine.release() {
        eprintln!("graft serve: releasing the engine: {e}");
    }
}
