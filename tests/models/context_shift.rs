//! Generation past the context with a context shift (`Stop::context_shift`) on the
//! engine: the run keeps going in the memory of one context (each time the context
//! fills, its last half is kept and computed again), and every token it generates is the
//! one a fresh request whose prompt is the tokens then kept generates first (CPU, tiny
//! Llama 3 fixture, greedy, blocks of 4 positions).

use graft::backend::cpu::CpuBackend;
use graft::engine::{Engine, EngineConfig, Event, FinishReason, KvBudget, Request};
use graft::models::LoadOptions;

use crate::fixtures;
use crate::runs::{engine_with, run};

const CTX: usize = 16;
const BLOCK: usize = 4;

fn engine() -> Engine {
    let opts = LoadOptions {
        ctx: Some(CTX),
        progress: false,
        ..LoadOptions::default()
    };
    let cfg = EngineConfig {
        block_size: BLOCK,
        kv: KvBudget::Tokens(4 * CTX),
        ..EngineConfig::new(CTX)
    };
    let path = fixtures::fixture("llama3-tiny-bf16");
    engine_with(&path, Box::new(CpuBackend::new()), &opts, cfg)
}

/// A greedy request for `n` tokens after `prompt`, past end-of-sequence tokens, shifting
/// its context when `shift`.
fn request(prompt: &[u32], n: usize, shift: bool) -> Request {
    let mut r = Request::greedy(prompt.to_vec(), n);
    r.stop.ignore_eos = true;
    r.stop.context_shift = shift;
    r
}

#[test]
fn generation_goes_past_the_context_by_shifting() {
    let mut e = engine();
    let prompt = [1u32, 2, 3];
    let err = e.add(request(&prompt, 40, false)).unwrap_err().to_string();
    assert!(err.contains("exceeds the context"), "{err}");

    let id = e.add(request(&prompt, 40, true)).unwrap();
    let mut shifted = Vec::new();
    let mut finish = None;
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { token, .. } => shifted.push(token),
                Event::Finished { reason, .. } => finish = Some(reason),
                Event::Error { error, .. } => panic!("{id}: {error}"),
            }
        }
        let used = e.stats().blocks_used;
        assert!(
            used <= CTX / BLOCK,
            "{used} blocks held: more than one context"
        );
    }
    assert_eq!((shifted.len(), finish), (40, Some(FinishReason::Length)));

    // The tokens the sequence holds after each token: a full context keeps its last
    // half. Each token is the first greedy token of a fresh request of what was held.
    let mut fresh = engine();
    fresh.set_prefix_cache(false);
    let (mut held, mut shifts) = (prompt.to_vec(), 0);
    for (i, &t) in shifted.iter().enumerate() {
        let want = run(&mut fresh, request(&held, 1, false)).tokens;
        assert_eq!(want, [t], "token {i} after {held:?}");
        held.push(t);
        if held.len() >= CTX {
            held.drain(..held.len() - CTX / 2);
            shifts += 1;
        }
    }
    // the first shift after token 13 (3 + 13 = 16 tokens), then every 8 tokens
    assert_eq!(shifts, 4);
}
