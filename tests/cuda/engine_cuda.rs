//! The batched engine on CUDA: random schedules (requests arriving at random steps with
//! random prompts, some sharing a beginning, some cancelled; token budgets that chunk the
//! prompts, with chunks past 64 tokens that take the tensor-core prefill kernel; pools
//! small enough to preempt) give each sequence the greedy tokens it gets alone, for F16
//! and Q4_0 weights and F16, Q8_0 and Q4_0 KV caches; afterwards no block is held.
//!
//! On the GPU a sequence's logits depend on the step it shares: a product over many
//! tokens takes other kernels (F16 operands on the tensor cores) than a decode step of
//! one, and the prefill kernel of paged attention rounds to F16 where the decode kernels
//! keep f32, so logits move by about 1e-3. Tokens are therefore compared up to the first
//! step whose margin in the run alone (top-1 minus top-2 log-probability) is not above
//! [`MARGIN`], where a flip would be rounding rather than a wrong result; a wrong block,
//! position or token moves logits by far more. At least half of all tokens must be
//! compared, so that a schedule cannot pass by comparing nothing.
//!
//! Needs a GPU: without one each test prints "skipped: no GPU" and passes, unless
//! `GRAFT_REQUIRE_GPU=1`.

use std::collections::HashMap;

use graft::engine::{
    Engine, EngineConfig, Event, FinishReason, KvBudget, Request, RequestId, SchedulerConfig,
};
use graft::graph::DType;
use graft::models::{CacheTypes, LoadOptions, QuantPlan};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{common, fixtures};

/// The smallest margin (in logits) at which a greedy step is compared.
const MARGIN: f32 = 0.02;

/// Schedules drawn per configuration.
const SCHEDULES: u64 = 6;

/// The context of every engine.
const CTX: usize = 256;

/// One request of a schedule.
#[derive(Clone, Debug)]
struct Planned {
    prompt: Vec<u32>,
    max_tokens: usize,
    /// The step it arrives at.
    arrival: usize,
    /// Cancelled after this many steps of its own.
    cancel: Option<usize>,
}

/// One drawn schedule.
#[derive(Clone, Debug)]
struct Schedule {
    requests: Vec<Planned>,
    kv: usize,
    max_seqs: usize,
    step_tokens: usize,
}

/// The schedule of `seed` over a vocabulary of `vocab` tokens.
fn schedule(seed: u64, vocab: u32) -> Schedule {
    let mut rng = StdRng::seed_from_u64(seed);
    let tokens = |rng: &mut StdRng, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.random_range(3..vocab)).collect()
    };
    // a few shared beginnings (a system prompt, a previous turn)
    let bases: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let n = rng.random_range(1..70);
            tokens(&mut rng, n)
        })
        .collect();
    let requests: Vec<Planned> = (0..rng.random_range(1..24))
        .map(|_| {
            let mut prompt = match rng.random_bool(0.5) {
                true => bases[rng.random_range(0..3)].clone(),
                false => Vec::new(),
            };
            let n = rng.random_range(1..90);
            prompt.extend(tokens(&mut rng, n));
            Planned {
                prompt,
                max_tokens: rng.random_range(1..24),
                arrival: rng.random_range(0..10),
                cancel: rng.random_bool(0.15).then(|| rng.random_range(0..12)),
            }
        })
        .collect();
    // a pool between the largest single need and room for all, mostly tight
    let need = |r: &Planned| r.prompt.len() + r.max_tokens + 16;
    let single = requests.iter().map(need).max().unwrap();
    let all: usize = requests.iter().map(need).sum();
    let tight = rng.random_range(0.0..1.0f64).powi(3);
    let kv = single + ((all - single) as f64 * tight) as usize;
    let max_seqs = rng.random_range(2..16);
    Schedule {
        requests,
        kv,
        max_seqs,
        step_tokens: rng.random_range(8..200usize).max(max_seqs),
    }
}

/// A model and its types.
#[derive(Clone, Copy, Debug)]
struct Setup {
    fixture: &'static str,
    weights: QuantPlan,
    cache: DType,
}

/// An engine of `setup` on a fresh GPU backend with the pool and scheduler settings
/// given, or `None` (after "skipped: no GPU") without a GPU.
fn engine(setup: Setup, kv: usize, scheduler: SchedulerConfig) -> Option<Engine> {
    let be = common::cuda_backend()?;
    let cache = CacheTypes {
        k: setup.cache,
        v: setup.cache,
        flash_attn: true,
    };
    let opts = LoadOptions {
        quantize: Some(setup.weights),
        ctx: Some(CTX),
        progress: false,
        cache,
    };
    let cfg = EngineConfig {
        kv: KvBudget::Tokens(kv),
        cache,
        scheduler,
        ..EngineConfig::new(CTX)
    };
    let path = fixtures::fixture(setup.fixture);
    Some(Engine::load(&path, Box::new(be), &opts, cfg).unwrap_or_else(|e| panic!("{setup:?}: {e}")))
}

/// A greedy request of `r` that runs to its length, with the top two log-probabilities of
/// each token when `margins`.
fn request(r: &Planned, margins: bool) -> Request {
    let mut req = Request::greedy(r.prompt.clone(), r.max_tokens);
    req.stop.ignore_eos = true;
    req.logprobs = margins.then_some(2);
    req
}

/// Runs `s` on `e`: requests join at their arrival steps, some are cancelled. Each
/// request's tokens and whether it was cancelled.
fn run_schedule(e: &mut Engine, s: &Schedule) -> Vec<(Vec<u32>, bool)> {
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut ids: Vec<Option<RequestId>> = vec![None; s.requests.len()];
    let mut cancelled = vec![false; s.requests.len()];
    let mut step = 0;
    loop {
        for (i, r) in s.requests.iter().enumerate() {
            if r.arrival == step {
                ids[i] = Some(e.add(request(r, false)).unwrap());
            }
            if let (Some(id), Some(c)) = (ids[i], r.cancel) {
                if step == r.arrival + c && e.cancel(id).is_some() {
                    cancelled[i] = true;
                }
            }
        }
        let arriving = s.requests.iter().any(|r| r.arrival > step);
        if !e.has_work() && !arriving {
            break;
        }
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { id, token, .. } => tokens.entry(id).or_default().push(token),
                Event::Finished { id, reason, .. } => {
                    assert_eq!(reason, FinishReason::Length, "{id}");
                }
                Event::Error { id, error } => panic!("{id}: {error}"),
            }
        }
        step += 1;
    }
    ids.iter()
        .zip(cancelled)
        .map(|(id, c)| (tokens.remove(&id.unwrap()).unwrap_or_default(), c))
        .collect()
}

/// The greedy tokens of `r` alone on `e` and the margin of each (top-1 minus top-2
/// log-probability).
fn alone(e: &mut Engine, r: &Planned) -> (Vec<u32>, Vec<f32>) {
    let id = e.add(request(r, true)).unwrap();
    let (mut tokens, mut margins) = (Vec::new(), Vec::new());
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token {
                    token, logprobs, ..
                } => {
                    let top = logprobs.unwrap().top;
                    tokens.push(token);
                    margins.push(top[0].1 - top[1].1);
                }
                Event::Finished { .. } => {}
                Event::Error { error, .. } => panic!("{id}: {error}"),
            }
        }
    }
    (tokens, margins)
}

/// Compares the batched tokens `got` of a request with its tokens alone `want` up to the
/// first step whose margin is not above [`MARGIN`] (a cancelled request: as far as it
/// got). The tokens compared.
fn compare(what: &str, got: &[u32], cancelled: bool, want: &[u32], margins: &[f32]) -> usize {
    let clear = margins.iter().take_while(|&&m| m > MARGIN).count();
    if !cancelled && clear == want.len() {
        assert_eq!(got, want, "{what}");
    }
    let n = clear.min(got.len());
    assert_eq!(got[..n], want[..n], "{what}: the first {n} tokens");
    assert!(got.len() <= want.len(), "{what}: {} tokens", got.len());
    n
}

/// Runs [`SCHEDULES`] drawn schedules of `setup` on the GPU, each against its requests
/// alone.
fn schedules_match_alone(setup: Setup) {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let solo = SchedulerConfig {
        max_seqs: 1,
        step_tokens: 512,
        prefix_cache: false,
        prefill_first: false,
    };
    let Some(mut one) = engine(setup, 2 * CTX, solo) else {
        return;
    };
    let vocab = one.config().vocab_size as u32;
    let (mut compared, mut total, mut preemptions) = (0, 0, 0);
    for seed in 0..SCHEDULES {
        let s = schedule(seed, vocab);
        let scheduler = SchedulerConfig {
            max_seqs: s.max_seqs,
            step_tokens: s.step_tokens,
            prefix_cache: true,
            prefill_first: false,
        };
        let mut e = engine(setup, s.kv, scheduler).expect("the GPU found before");
        let outcomes = run_schedule(&mut e, &s);
        let st = e.stats();
        assert_eq!(
            (st.running, st.waiting, st.blocks_used),
            (0, 0, 0),
            "{st:?}"
        );
        preemptions += st.preemptions;
        e.release().unwrap();
        for (i, (r, (got, cancelled))) in s.requests.iter().zip(&outcomes).enumerate() {
            let (want, margins) = alone(&mut one, r);
            let what = format!(
                "{setup:?} seed {seed} request {i} ({} prompt tokens)",
                r.prompt.len()
            );
            compared += compare(&what, got, *cancelled, &want, &margins);
            total += got.len();
        }
    }
    println!(
        "{setup:?}: {compared} of {total} batched tokens compared over {SCHEDULES} schedules, {preemptions} preemptions"
    );
    assert!(
        2 * compared >= total,
        "{setup:?}: {compared} of {total} tokens compared"
    );
    one.release().unwrap();
}

#[test]
fn f16_weights_batched_equal_alone() {
    schedules_match_alone(Setup {
        fixture: "llama3-tiny-bf16",
        weights: QuantPlan::F16,
        cache: DType::F16,
    });
}

#[test]
fn q4_0_weights_batched_equal_alone() {
    schedules_match_alone(Setup {
        fixture: "llama2-tiny-f32",
        weights: QuantPlan::Q4_0,
        cache: DType::F16,
    });
}

/// Q8_0 and Q4_0 K/V pools (the fixture with head dim 32: one block per head row).
#[test]
fn quantized_kv_caches_batched_equal_alone() {
    for (weights, cache) in [
        (QuantPlan::F16, DType::Q8_0),
        (QuantPlan::Q4_0, DType::Q4_0),
    ] {
        schedules_match_alone(Setup {
            fixture: "qwen3-tiny-bf16",
            weights,
            cache,
        });
    }
}
