//! The batched engine on CUDA: random schedules (requests arriving at random steps with
//! random prompts, some sharing a beginning, some cancelled; token budgets that chunk the
//! prompts, with chunks past 64 tokens that take the tensor-core prefill kernel; pools
//! small enough to preempt) give each sequence the greedy tokens it gets alone, for F16
//! and Q4_0 weights and F16, Q8_0 and Q4_0 KV caches; afterwards no block is held.
//!
//! On the GPU a sequence's logits depend on the step it shares: a product over many
//! tokens takes other kernels (F16 operands on the tensor cores, or the activations
//! quantized to Q8_1 for the int8 ones) than a decode step of one, and the prefill kernel
//! of paged attention rounds to F16 where the decode kernels keep f32. With F16 weights
//! that moves logits by about 1e-3; with block-quantized weights more, since every product
//! quantizes its activations to Q8_1 again and a value moved by rounding can cross to the
//! next quantum. So each setup states a bound ([`Setup::dev`]) on how far the
//! log-probability of a greedy token may move between the run in a batch and the run
//! alone, checked at every step up to the first differing token; the tokens must be equal
//! up to a first difference where the margin alone (top-1 minus top-2 log-probability) is
//! at most twice that bound, a flip that rounding explains (a wrong block, position or
//! token moves logits by far more), and nothing after that step is compared. At least
//! half of all tokens must be compared, so that a schedule cannot pass by comparing
//! nothing.
//!
//! The bounds are measured, not derived. Over these schedules on an H200 (2026-12-02) a
//! greedy token's log-probability moved by at most 0.008 with F16 weights and cache, 0.014
//! with a Q8_0 cache, and by 0.134 (Q8_1 activations throughout) and 0.148 (cuBLAS on F16
//! activations for the batched products) in the first schedules with Q4_0 weights; with
//! Q4_0 weights and cache by 0.119 while the int8 tensor-core product took 9 columns and
//! more, and by 0.216 and 0.253 in two builds where it takes 5 and more (one request of
//! one schedule, the same step in both). In the requests printed, the moves came at steps shared
//! with other sequences' prompt chunks, while steps of decode tokens alone gave the bits of
//! the run alone.
//!
//! Needs a GPU: without one each test prints "skipped: no GPU" and passes, unless
//! `GRAFT_REQUIRE_GPU=1`.

use std::collections::HashMap;

use graft::backend::cuda::QuantPath;
use graft::engine::{
    Engine, EngineConfig, Event, FinishReason, KvBudget, Request, RequestId, SchedulerConfig,
};
use graft::graph::DType;
use graft::models::{CacheTypes, LoadOptions, QuantPlan};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{common, fixtures};

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

/// A model, its types, and the kernels of its products with block-quantized weights.
#[derive(Clone, Copy, Debug)]
struct Setup {
    fixture: &'static str,
    weights: QuantPlan,
    cache: DType,
    path: QuantPath,
    /// The most a greedy token's log-probability may differ between a batch and alone.
    dev: f32,
}

/// [`Setup::dev`] with F16 weights and an F16 cache.
const F16_DEV: f32 = 0.01;
/// [`Setup::dev`] with a Q8_0 cache.
const Q8_0_CACHE_DEV: f32 = 0.03;
/// [`Setup::dev`] with Q4_0 weights (Q8_1 activations).
const Q4_0_DEV: f32 = 0.2;
/// [`Setup::dev`] with Q4_0 weights and a Q4_0 cache, whose 4-bit K and V steps turn a
/// rounding difference of a product into a whole quantum.
const Q4_0_CACHE_DEV: f32 = 0.35;

/// The greedy tokens of one request and the top two log-probabilities of each, when
/// asked for (else NaN).
#[derive(Default)]
struct Greedy {
    tokens: Vec<u32>,
    top: Vec<(f32, f32)>,
}

impl Greedy {
    fn push(&mut self, token: u32, logprobs: Option<graft::engine::TokenLogprobs>) {
        self.tokens.push(token);
        self.top
            .push(logprobs.map_or((f32::NAN, f32::NAN), |l| (l.top[0].1, l.top[1].1)));
    }
}

/// An engine of `setup` on a fresh GPU backend with the pool and scheduler settings
/// given, or `None` (after "skipped: no GPU") without a GPU.
fn engine(setup: Setup, kv: usize, scheduler: SchedulerConfig) -> Option<Engine> {
    let mut be = common::cuda_backend()?;
    be.set_quant_path(setup.path);
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
/// each token when `logprobs`.
fn request(r: &Planned, logprobs: bool) -> Request {
    let mut req = Request::greedy(r.prompt.clone(), r.max_tokens);
    req.stop.ignore_eos = true;
    req.logprobs = logprobs.then_some(2);
    req
}

/// Runs `s` on `e`: requests join at their arrival steps, some are cancelled. Each
/// request's tokens and whether it was cancelled.
fn run_schedule(e: &mut Engine, s: &Schedule) -> Vec<(Greedy, bool)> {
    let mut tokens: HashMap<RequestId, Greedy> = HashMap::new();
    let mut ids: Vec<Option<RequestId>> = vec![None; s.requests.len()];
    let mut cancelled = vec![false; s.requests.len()];
    let mut step = 0;
    loop {
        for (i, r) in s.requests.iter().enumerate() {
            if r.arrival == step {
                // every other request without log-probabilities: its tokens take the
                // device's argmax path
                ids[i] = Some(e.add(request(r, i % 2 == 0)).unwrap());
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
                Event::Token {
                    id,
                    token,
                    logprobs,
                    ..
                } => tokens.entry(id).or_default().push(token, logprobs),
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

/// The greedy tokens of `r` alone on `e`.
fn alone(e: &mut Engine, r: &Planned) -> Greedy {
    let id = e.add(request(r, true)).unwrap();
    let mut run = Greedy::default();
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token {
                    token, logprobs, ..
                } => run.push(token, logprobs),
                Event::Finished { .. } => {}
                Event::Error { error, .. } => panic!("{id}: {error}"),
            }
        }
    }
    run
}

/// Compares the batched tokens `got` of a request with its tokens alone `want`: equal up
/// to the first step where they differ, where the margin alone must be at most `2 dev` (a
/// near-tie), and the log-probabilities (where `got` has them) within `dev` before it.
/// Requests run to their length unless cancelled. The tokens compared (those before the
/// first difference) and the largest log-probability difference seen.
fn compare(what: &str, got: &Greedy, cancelled: bool, want: &Greedy, dev: f32) -> (usize, f32) {
    let (g, w) = (&got.tokens, &want.tokens);
    assert!(g.len() <= w.len(), "{what}: {} tokens", g.len());
    if !cancelled {
        assert_eq!(g.len(), w.len(), "{what}: {g:?} against {w:?}");
    }
    let same = g.iter().zip(w).take_while(|(a, b)| a == b).count();
    let worst = (0..same)
        .filter(|&i| !got.top[i].0.is_nan())
        .map(|i| (got.top[i].0 - want.top[i].0).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= dev,
        "{what}: a greedy token's log-probability moved by {worst} (at most {dev}): batched {:?}, alone {:?}",
        &got.top[..same],
        &want.top[..same]
    );
    if same < g.len() {
        let margin = want.top[same].0 - want.top[same].1;
        assert!(
            margin <= 2.0 * dev,
            "{what}: token {same} is {} batched and {} alone, where the margin alone is {margin} (a near-tie is at most {}; batched {g:?}, alone {w:?})",
            g[same],
            w[same],
            2.0 * dev
        );
    }
    (same, worst)
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
    let (mut compared, mut total, mut preemptions, mut worst) = (0, 0, 0, 0.0f32);
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
            let want = alone(&mut one, r);
            let what = format!(
                "{setup:?} seed {seed} request {i} ({} prompt tokens)",
                r.prompt.len()
            );
            let (n, dev) = compare(&what, got, *cancelled, &want, setup.dev);
            compared += n;
            worst = worst.max(dev);
            total += got.tokens.len();
        }
    }
    println!(
        "{setup:?}: {compared} of {total} batched tokens compared over {SCHEDULES} schedules, {preemptions} preemptions, log-probabilities within {worst}"
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
        path: QuantPath::Auto,
        dev: F16_DEV,
    });
}

/// Q4_0 weights with `path` for their products.
fn q4_0(path: QuantPath) -> Setup {
    Setup {
        fixture: "llama2-tiny-f32",
        weights: QuantPlan::Q4_0,
        cache: DType::F16,
        path,
        dev: Q4_0_DEV,
    }
}

/// By width: decode kernels, the int8 tensor-core product, cuBLAS.
#[test]
fn q4_0_weights_batched_equal_alone() {
    schedules_match_alone(q4_0(QuantPath::Auto));
}

/// The int8 tensor-core product for every width.
#[test]
fn q4_0_weights_on_tensor_cores_batched_equal_alone() {
    schedules_match_alone(q4_0(QuantPath::Mmq));
}

/// cuBLAS for every width the decode kernels do not take.
#[test]
fn q4_0_weights_on_cublas_batched_equal_alone() {
    schedules_match_alone(q4_0(QuantPath::Dequant));
}

/// A Q8_0 K/V pool (the fixture with head dim 32: one block per head row).
#[test]
fn q8_0_kv_cache_batched_equal_alone() {
    schedules_match_alone(Setup {
        fixture: "qwen3-tiny-bf16",
        weights: QuantPlan::F16,
        cache: DType::Q8_0,
        path: QuantPath::Auto,
        dev: Q8_0_CACHE_DEV,
    });
}

/// A Q4_0 K/V pool with Q4_0 weights.
#[test]
fn q4_0_kv_cache_batched_equal_alone() {
    schedules_match_alone(Setup {
        fixture: "qwen3-tiny-bf16",
        weights: QuantPlan::Q4_0,
        cache: DType::Q4_0,
        path: QuantPath::Auto,
        dev: Q4_0_CACHE_DEV,
    });
}
