//! Runs of the batched engine for the model tests: an engine over a model, one request
//! run alone to its end (tokens, why it ended, the log-probability row of every token it
//! drew), the rows of every prefix of a sequence, and rows centered so that they compare
//! with logits. Included as a module by the tests that need it.
//!
//! The engine reports log-probabilities, `logits - logsumexp(logits)` for each row; a
//! row centered on its mean is the same for log-probabilities and for the logits they
//! come from, so [`centered`] rows compare with HF's logits without the unknown offset.

use std::path::Path;

use graft::backend::Backend;
use graft::engine::{Engine, EngineConfig, Event, FinishReason, Request};
use graft::models::LoadOptions;

/// An engine over the model at `path` on `be`: the context `opts.ctx` (64 when unset),
/// `opts`' weight and cache types, the default pool (four contexts), sequence cap and
/// step budget.
pub fn engine(path: &Path, be: Box<dyn Backend>, opts: &LoadOptions) -> Engine {
    let ctx = opts.ctx.unwrap_or(64);
    engine_with(path, be, opts, EngineConfig::new(ctx))
}

/// [`engine`] with the settings `cfg` (its cache types are `opts`').
pub fn engine_with(
    path: &Path,
    be: Box<dyn Backend>,
    opts: &LoadOptions,
    cfg: EngineConfig,
) -> Engine {
    let cfg = EngineConfig {
        cache: opts.cache,
        ..cfg
    };
    let opts = LoadOptions {
        ctx: Some(cfg.ctx),
        progress: false,
        ..*opts
    };
    Engine::load(path, be, &opts, cfg).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What one request gave.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The stop or end-of-sequence token that ended it.
    pub stop_token: Option<u32>,
    /// The log-probability row (one value per token id) of each generated token, when
    /// the request asked for the whole vocabulary's (a stop token is not generated).
    pub rows: Vec<Vec<f32>>,
}

/// Runs `req` alone to its end; an error event panics.
pub fn run(e: &mut Engine, req: Request) -> Run {
    let vocab = e.config().vocab_size;
    let id = e.add(req).unwrap_or_else(|err| panic!("add: {err}"));
    let (mut tokens, mut rows) = (Vec::new(), Vec::new());
    let mut row_of = |top: &[(u32, f32)]| {
        if top.len() == vocab {
            let mut row = vec![0f32; vocab];
            for &(t, lp) in top {
                row[t as usize] = lp;
            }
            rows.push(row);
        }
    };
    loop {
        for ev in e.step().unwrap() {
            assert_eq!(ev.id(), id, "only one request runs");
            match ev {
                Event::Token {
                    token, logprobs, ..
                } => {
                    tokens.push(token);
                    if let Some(lp) = logprobs {
                        row_of(&lp.top);
                    }
                }
                Event::Finished {
                    reason, stop_token, ..
                } => {
                    return Run {
                        tokens,
                        finish: reason,
                        stop_token,
                        rows,
                    }
                }
                Event::Error { error, .. } => panic!("{id}: {error}"),
            }
        }
    }
}

/// A greedy request for up to `n` tokens after `prompt`, with the whole vocabulary's
/// log-probabilities of each when `rows`.
pub fn greedy_request(prompt: &[u32], n: usize, rows: bool, vocab: usize) -> Request {
    Request {
        logprobs: rows.then_some(vocab),
        ..Request::greedy(prompt.to_vec(), n)
    }
}

/// Up to `n` greedy tokens after `prompt` (an end-of-sequence token ends them).
pub fn greedy(e: &mut Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    run(e, Request::greedy(prompt.to_vec(), n)).tokens
}

/// The log-probability rows of positions `from..seq.len()` of `seq`, flattened: each
/// prefix `seq[..=p]` one request of one token with the whole row's log-probabilities,
/// one after the other, so that with the prefix cache on each computes the one position
/// the previous did not (a decode step over the cached prefix), and with it off each
/// computes its whole prefix (in chunks of the step's token budget).
pub fn prefix_rows(e: &mut Engine, seq: &[u32], from: usize) -> Vec<f32> {
    let vocab = e.config().vocab_size;
    let mut all = Vec::with_capacity((seq.len() - from) * vocab);
    for p in from..seq.len() {
        let mut req = greedy_request(&seq[..=p], 1, true, vocab);
        req.stop.ignore_eos = true;
        let mut r = run(e, req);
        assert_eq!(r.rows.len(), 1, "position {p}: {r:?}");
        all.append(&mut r.rows[0]);
    }
    all
}

/// Each row of `v` (rows of `n` values) minus its mean, in f64.
pub fn centered(v: &[f32], n: usize) -> Vec<f64> {
    v.chunks(n)
        .flat_map(|row| {
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / row.len() as f64;
            row.iter().map(move |&x| x as f64 - mean)
        })
        .collect()
}

/// The largest absolute difference between `a` and `b`.
pub fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}
