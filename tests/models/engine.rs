//! The batched engine on the CPU backend with the tiny fixtures: random schedules
//! (sequences arriving and leaving at random steps, shared prefixes, cancellations, a
//! pool small enough to preempt, small token budgets that chunk every prompt) give each
//! sequence exactly the greedy tokens it gets alone; prefix sharing gives the logits of a
//! recomputation; bad requests fail alone; every block comes back.

use std::collections::HashMap;
use std::path::PathBuf;

use graft::backend::cpu::CpuBackend;
use graft::engine::{
    Engine, EngineConfig, Event, FinishReason, KvBudget, Request, RequestId, SchedulerConfig,
};
use graft::graph::DType;
use graft::models::{CacheTypes, LoadOptions, SamplingParams};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn fixture(name: &str) -> PathBuf {
    crate::fixtures::fixture(name)
}

/// The fixtures' vocabulary.
const VOCAB: usize = 512;

/// Fixtures of every attention kind: GQA with llama3 rope, a sliding window, q/k norms,
/// learned positions.
const FIXTURES: [&str; 4] = [
    "llama3-tiny-bf16",
    "mistral-tiny-f32",
    "qwen3-tiny-f32",
    "gpt2-tiny-f32",
];

fn engine(name: &str, cfg: EngineConfig) -> Engine {
    let opts = LoadOptions {
        quantize: None,
        ctx: Some(cfg.ctx),
        progress: false,
        cache: cfg.cache,
    };
    Engine::load(&fixture(name), Box::new(CpuBackend::new()), &opts, cfg).unwrap()
}

fn config(ctx: usize, kv: usize, max_seqs: usize, step_tokens: usize) -> EngineConfig {
    EngineConfig {
        kv: KvBudget::Tokens(kv),
        scheduler: SchedulerConfig {
            max_seqs,
            step_tokens,
            prefix_cache: true,
            prefill_first: false,
        },
        ..EngineConfig::new(ctx)
    }
}

/// What a request produced.
#[derive(Clone, Debug, Default, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    /// The error it failed with (sampled schedules only).
    error: Option<String>,
    /// The log-probability row (by token id) of each token, when the request asked for
    /// the whole vocabulary's.
    rows: Vec<Vec<f32>>,
}

/// Steps until nothing is left, collecting every request's tokens.
fn drain(e: &mut Engine, out: &mut HashMap<RequestId, Outcome>) {
    while e.has_work() {
        for ev in e.step().unwrap() {
            record(ev, out);
        }
    }
}

fn record(ev: Event, out: &mut HashMap<RequestId, Outcome>) {
    match ev {
        Event::Token {
            id,
            token,
            logprobs,
            ..
        } => {
            let o = out.entry(id).or_default();
            o.tokens.push(token);
            if let Some(lp) = logprobs.filter(|lp| lp.top.len() == VOCAB) {
                let mut row = vec![0f32; VOCAB];
                for (t, x) in lp.top {
                    row[t as usize] = x;
                }
                o.rows.push(row);
            }
        }
        Event::Finished { id, reason, .. } => out.entry(id).or_default().finish = Some(reason),
        Event::Error { id, error } => panic!("{id}: {error}"),
    }
}

/// [`record`], errors included.
fn record_errors(ev: Event, out: &mut HashMap<RequestId, Outcome>) {
    match ev {
        Event::Error { id, error } => out.entry(id).or_default().error = Some(error.to_string()),
        ev => record(ev, out),
    }
}

/// The greedy tokens of `prompt` alone in a fresh engine with room to spare.
fn alone(name: &str, prompt: &[u32], max_tokens: usize) -> Outcome {
    let mut e = engine(name, config(256, 1024, 4, 64));
    let id = e.add(Request::greedy(prompt.to_vec(), max_tokens)).unwrap();
    let mut out = HashMap::new();
    drain(&mut e, &mut out);
    out.remove(&id).unwrap()
}

/// One drawn schedule.
#[derive(Clone, Debug)]
struct Schedule {
    fixture: &'static str,
    /// (prompt, max tokens, arrival step, cancel after this many steps of its own)
    requests: Vec<(Vec<u32>, usize, usize, Option<usize>)>,
    kv: usize,
    max_seqs: usize,
    step_tokens: usize,
    /// Each request's sampling settings and log-probabilities (all greedy when empty).
    sampling: Vec<(SamplingParams, Option<usize>)>,
    /// The KV pool's types.
    cache: CacheTypes,
}

fn schedule() -> impl Strategy<Value = Schedule> {
    (
        prop::sample::select(FIXTURES.to_vec()),
        1usize..24,
        any::<u64>(),
        (1usize..12, 4usize..64),
        0.0f64..1.0,
    )
        .prop_map(|(fixture, n, seed, (max_seqs, step_tokens), tight)| {
            let mut rng = StdRng::seed_from_u64(seed);
            // a few shared beginnings (a system prompt, a previous turn)
            let bases: Vec<Vec<u32>> = (0..3)
                .map(|_| {
                    (0..rng.random_range(1..40))
                        .map(|_| rng.random_range(3..500))
                        .collect()
                })
                .collect();
            let requests: Vec<_> = (0..n)
                .map(|_| {
                    let mut p = match rng.random_bool(0.5) {
                        true => bases[rng.random_range(0..3)].clone(),
                        false => Vec::new(),
                    };
                    p.extend((0..rng.random_range(1..50)).map(|_| rng.random_range(3..500)));
                    let cancel = rng.random_bool(0.15).then(|| rng.random_range(0..12));
                    (p, rng.random_range(1..20), rng.random_range(0..10), cancel)
                })
                .collect();
            // a pool between the largest single need and room for all
            let need = |r: &(Vec<u32>, usize, usize, Option<usize>)| r.0.len() + r.1 + 16;
            let single = requests.iter().map(need).max().unwrap();
            let all: usize = requests.iter().map(need).sum();
            let kv = single + ((all - single) as f64 * tight) as usize;
            Schedule {
                fixture,
                requests,
                kv,
                max_seqs,
                step_tokens: step_tokens.max(max_seqs),
                sampling: Vec::new(),
                cache: CacheTypes::default(),
            }
        })
}

/// A schedule whose requests sample with random settings: seeds, temperatures, top-k
/// below and above the vocabulary (512), top-p, min-p, typical-p, penalties that lower
/// and that raise logits, biases that ban, lower and raise tokens, log-probabilities.
fn sampled_schedule() -> impl Strategy<Value = Schedule> {
    (schedule(), any::<u64>()).prop_map(|(mut s, seed)| {
        let mut rng = StdRng::seed_from_u64(seed);
        s.sampling = (0..s.requests.len())
            .map(|_| {
                (
                    random_sampling(&mut rng),
                    rng.random_bool(0.15).then_some(3),
                )
            })
            .collect();
        s
    })
}

/// One random sampler setting (see [`sampled_schedule`]).
fn random_sampling(rng: &mut StdRng) -> SamplingParams {
    let mut p = SamplingParams {
        seed: Some(rng.random()),
        temperature: [0.0, rng.random_range(0.2..2.0)][rng.random_range(0..2)],
        top_k: [0, rng.random_range(1..50), rng.random_range(50..700)][rng.random_range(0..3)],
        ..SamplingParams::greedy()
    };
    if rng.random_bool(0.4) {
        p.top_p = rng.random_range(0.3..1.0);
    }
    if rng.random_bool(0.3) {
        p.min_p = rng.random_range(0.0..0.3);
    }
    if rng.random_bool(0.2) {
        p.typical_p = rng.random_range(0.3..1.0);
    }
    if rng.random_bool(0.5) {
        p.repeat_penalty = rng.random_range(0.8..1.6);
        p.presence_penalty = [0.0, rng.random_range(-0.5..1.0)][rng.random_range(0..2)];
        p.frequency_penalty = [0.0, rng.random_range(-0.5..1.0)][rng.random_range(0..2)];
        p.repeat_last_n = rng.random_range(0..80);
    }
    for _ in 0..rng.random_range(0..4) {
        let bias = [
            f32::NEG_INFINITY,
            rng.random_range(-3.0..0.0),
            rng.random_range(0.0..2.0),
        ];
        p.logit_bias
            .push((rng.random_range(0..512), bias[rng.random_range(0..3)]));
    }
    p
}

/// The request of `s`'s request `i`: greedy, or with its sampling settings.
fn request_of(s: &Schedule, i: usize) -> Request {
    let r = &s.requests[i];
    let mut req = Request::greedy(r.0.clone(), r.1);
    if let Some((p, logprobs)) = s.sampling.get(i) {
        req.sampling = p.clone();
        req.logprobs = *logprobs;
    }
    req
}

/// Runs `s`: requests join at their arrival steps, some are cancelled; returns each
/// request's outcome (cancelled ones without a finish reason) and the engine. Samplers
/// draw from the device's candidates when `candidates`, else from whole rows.
fn run_schedule(s: &Schedule, candidates: bool) -> (Vec<(Outcome, bool)>, Engine) {
    let cfg = EngineConfig {
        cache: s.cache,
        ..config(256, s.kv, s.max_seqs, s.step_tokens)
    };
    let mut e = engine(s.fixture, cfg);
    e.set_candidates(candidates);
    let mut out = HashMap::new();
    let mut ids: Vec<Option<RequestId>> = vec![None; s.requests.len()];
    let mut cancelled = vec![false; s.requests.len()];
    let mut step = 0;
    loop {
        for (i, r) in s.requests.iter().enumerate() {
            if r.2 == step {
                ids[i] = Some(e.add(request_of(s, i)).unwrap());
            }
            if let (Some(id), Some(c)) = (ids[i], r.3) {
                if step == r.2 + c && e.cancel(id).is_some() {
                    cancelled[i] = true;
                }
            }
        }
        let arriving = s.requests.iter().any(|r| r.2 > step);
        if !e.has_work() && !arriving {
            break;
        }
        for ev in e.step().unwrap() {
            record_errors(ev, &mut out);
        }
        step += 1;
    }
    let outcomes = ids
        .iter()
        .zip(cancelled)
        .map(|(id, c)| (out.remove(&id.unwrap()).unwrap_or_default(), c))
        .collect();
    (outcomes, e)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Every sequence of a random schedule gets, bit for bit, the greedy tokens it gets
    /// alone (a cancelled one a prefix of them); afterwards no block is held.
    #[test]
    fn batched_greedy_equals_alone(s in schedule()) {
        let (outcomes, e) = run_schedule(&s, true);
        for ((prompt, max, _, _), (got, cancelled)) in s.requests.iter().zip(&outcomes) {
            let want = alone(s.fixture, prompt, *max);
            if *cancelled {
                prop_assert!(want.tokens.starts_with(&got.tokens), "cancelled: {got:?} vs {want:?}");
            } else {
                prop_assert_eq!(got, &want, "prompt {:?}", prompt);
            }
        }
        let st = e.stats();
        prop_assert_eq!((st.running, st.waiting, st.blocks_used), (0, 0, 0));
    }

    /// Sampled tokens are the same, for the same seeds, whether each sampler draws from
    /// the device's top candidates of its row or from the whole row read back, over
    /// random settings and schedules (a step mixes samplers that take candidates, ones
    /// that need the row, greedy ones and ones asking for log-probabilities); the draws
    /// took the candidates wherever a sampler could.
    #[test]
    fn sampled_tokens_are_the_same_from_candidates_and_rows(s in sampled_schedule()) {
        let (top, e_top) = run_schedule(&s, true);
        let (rows, e_rows) = run_schedule(&s, false);
        prop_assert_eq!(&top, &rows);
        let (a, b) = (e_top.stats(), e_rows.stats());
        prop_assert_eq!(b.sampled_from_candidates, 0);
        let draws = |st: graft::engine::EngineStats| st.sampled_from_candidates + st.sampled_from_rows;
        prop_assert_eq!(draws(a), draws(b));
        // a request whose sampler can take candidates and asks for no log-probabilities
        // drew from them unless a row was read for another sequence of the same step
        let could = s.sampling.iter().zip(&top).any(|((p, lp), (o, _))| {
            let chain = graft::models::SamplerChain::new(p, 512).unwrap();
            lp.is_none() && matches!(chain.wants(), graft::models::Logits::Top(_)) && !o.tokens.is_empty()
        });
        let rowless = s.sampling.iter().all(|(p, lp)| {
            let chain = graft::models::SamplerChain::new(p, 512).unwrap();
            lp.is_none() && !matches!(chain.wants(), graft::models::Logits::Last)
        });
        if could && rowless {
            prop_assert!(a.sampled_from_candidates > 0, "{:?}", a);
            prop_assert_eq!(a.sampled_from_rows, 0);
        }
    }

    /// Every step a sampled sequence took, in a random schedule (each step launched with
    /// the tokens drawn after the previous one, its other inputs staged before the draw),
    /// computed the logits of the sequence it drew: each token's reported
    /// log-probabilities are those of the one-sequence forward pass over the prompt and
    /// the tokens before it (rows centered). F32 K/V: the two paths differ in the order
    /// of their sums only (an F16 cache could round one of their K/V values either way).
    #[test]
    fn sampled_steps_compute_the_drawn_sequence(s in sampled_schedule()) {
        let mut s = s;
        for (_, logprobs) in &mut s.sampling {
            *logprobs = Some(VOCAB);
        }
        s.cache = CacheTypes {
            k: DType::F32,
            v: DType::F32,
            flash_attn: true,
        };
        let (outcomes, _) = run_schedule(&s, true);
        let mut be = CpuBackend::new();
        let opts = LoadOptions {
            ctx: Some(256),
            progress: false,
            cache: s.cache,
            ..LoadOptions::default()
        };
        let mut m = graft::models::Model::load(&fixture(s.fixture), &mut be, &opts).unwrap();
        for ((prompt, ..), (o, _)) in s.requests.iter().zip(&outcomes) {
            if o.error.is_some() || o.tokens.is_empty() {
                continue;
            }
            prop_assert_eq!(o.rows.len(), o.tokens.len());
            let mut seq = prompt.clone();
            seq.extend(&o.tokens[..o.tokens.len() - 1]);
            let all = m.forward(&mut be, &seq).unwrap().logits;
            let want = &all[(prompt.len() - 1) * VOCAB..];
            let got: Vec<f32> = o.rows.concat();
            let e = crate::reference::nmse(
                &crate::runs::centered(&got, VOCAB),
                &crate::runs::centered(want, VOCAB),
            );
            prop_assert!(e < 1e-10, "{} tokens after {:?}: NMSE {e:e}", o.tokens.len(), prompt);
        }
        m.release(&mut be).unwrap();
    }
}

/// A pool that holds one sequence at a time forces preemption; the results do not
/// change and the preemptions are counted.
#[test]
fn preemption_recomputes_without_changing_results() {
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..30).map(|j| 10 + i * 40 + j).collect())
        .collect();
    let mut e = engine("llama3-tiny-bf16", config(256, 64, 4, 64));
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| e.add(Request::greedy(p.clone(), 30)).unwrap())
        .collect();
    let mut out = HashMap::new();
    drain(&mut e, &mut out);
    assert!(e.stats().preemptions > 0, "{:?}", e.stats());
    for (p, id) in prompts.iter().zip(ids) {
        assert_eq!(out[&id], alone("llama3-tiny-bf16", p, 30));
    }
}

/// The logprobs of a request whose prompt is served from the prefix cache (full blocks
/// shared, a partly filled block copied) equal those of a recomputation, and the cache
/// hit is counted.
#[test]
fn prefix_sharing_gives_the_logits_of_a_recomputation() {
    let first: Vec<u32> = (0..37).map(|i| 5 + i * 7 % 400).collect();
    let mut second = first.clone();
    second.extend([11, 12, 13]);
    let with_logprobs = |p: &[u32]| Request {
        logprobs: Some(5),
        ..Request::greedy(p.to_vec(), 6)
    };
    let logprobs = |e: &mut Engine, p: &[u32]| {
        let id = e.add(with_logprobs(p)).unwrap();
        let mut lps = Vec::new();
        while e.has_work() {
            for ev in e.step().unwrap() {
                if let Event::Token {
                    id: i, logprobs, ..
                } = ev
                {
                    assert_eq!(i, id);
                    lps.push(logprobs.unwrap());
                }
            }
        }
        lps
    };
    let mut shared = engine("llama3-tiny-bf16", config(256, 1024, 4, 64));
    logprobs(&mut shared, &first);
    let hit_before = shared.stats().prefix_hit_tokens;
    let got = logprobs(&mut shared, &second);
    let hits = shared.stats().prefix_hit_tokens - hit_before;
    // 37 tokens were computed: two full blocks of 16 and 5 more (copied)
    assert_eq!(hits, 37, "{:?}", shared.stats());
    let mut fresh = engine("llama3-tiny-bf16", config(256, 1024, 4, 64));
    assert_eq!(got, logprobs(&mut fresh, &second));
}

/// Bad requests are refused alone with the field named; the others run unharmed.
#[test]
fn bad_requests_fail_alone() {
    let mut e = engine("llama3-tiny-bf16", config(64, 128, 4, 64));
    let good = e.add(Request::greedy(vec![5, 6, 7], 8)).unwrap();
    let cases: Vec<(Request, &str)> = vec![
        (Request::greedy(vec![], 4), "prompt"),
        (Request::greedy(vec![5, 100_000], 4), "prompt"),
        (Request::greedy(vec![5; 10], 0), "max_tokens"),
        (Request::greedy(vec![5; 60], 10), "context"),
        (Request::greedy(vec![5; 64], 1), "context"),
        (
            Request {
                sampling: SamplingParams {
                    temperature: -1.0,
                    ..SamplingParams::default()
                },
                ..Request::greedy(vec![5], 4)
            },
            "temperature",
        ),
    ];
    for (req, what) in cases {
        let e2 = e.add(req).unwrap_err().to_string();
        assert!(e2.contains(what), "{e2} should name {what}");
    }
    let mut out = HashMap::new();
    drain(&mut e, &mut out);
    assert_eq!(out[&good], alone("llama3-tiny-bf16", &[5, 6, 7], 8));
    // a request longer than the whole pool (but within the context)
    let mut small = engine("llama3-tiny-bf16", config(256, 32, 4, 64));
    let e3 = small
        .add(Request::greedy(vec![5; 40], 20))
        .unwrap_err()
        .to_string();
    assert!(e3.contains("KV pool"), "{e3}");
}

/// Cancelling mid-prompt (a long prompt chunked over several steps) frees its blocks at
/// once.
#[test]
fn cancelling_mid_prefill_frees_the_blocks() {
    let mut e = engine("llama3-tiny-bf16", config(256, 512, 4, 16));
    let id = e
        .add(Request::greedy((0..100).map(|i| 3 + i).collect(), 4))
        .unwrap();
    e.step().unwrap();
    assert!(e.stats().blocks_used > 0);
    let usage = e.cancel(id).unwrap();
    assert_eq!(usage.completion_tokens, 0);
    assert_eq!(e.stats().blocks_used, 0);
    assert!(!e.has_work());
    assert!(e.cancel(id).is_none());
}

/// A prompt whose cached prefix ends in a partly filled block, admitted when that block
/// is the only one left to hand out: the cached block is held while the copy's block is
/// taken (never copied onto itself), and the output is the request's alone.
#[test]
fn a_partial_prefix_block_evicted_for_its_own_copy() {
    let name = "llama3-tiny-bf16";
    // two blocks of 16 positions
    let mut e = engine(name, config(64, 32, 1, 64));
    let prompt: Vec<u32> = (0..20).map(|i| 3 + i * 11 % 400).collect();
    let first = e.add(Request::greedy(prompt.clone(), 1)).unwrap();
    let mut out = HashMap::new();
    drain(&mut e, &mut out);
    assert!(out[&first].finish.is_some());
    let mut longer = prompt.clone();
    longer.push(42);
    let id = e.add(Request::greedy(longer.clone(), 4)).unwrap();
    drain(&mut e, &mut out);
    assert_eq!(out.remove(&id).unwrap(), alone(name, &longer, 4));
}

/// With a context shift a generation runs past the context: at the end of the context
/// the last half of the tokens is computed again, and what follows is what a fresh
/// request with those tokens as its prompt gives.
#[test]
fn context_shift_goes_on_with_the_last_half() {
    let prompt: Vec<u32> = (0..10).map(|i| 20 + 3 * i).collect();
    let mut e = engine("llama3-tiny-bf16", config(64, 256, 4, 64));
    let mut req = Request::greedy(prompt.clone(), 100);
    req.stop.context_shift = true;
    req.stop.ignore_eos = true;
    let id = e.add(req).unwrap();
    let mut out = HashMap::new();
    drain(&mut e, &mut out);
    let got = &out[&id];
    assert_eq!(
        (got.tokens.len(), got.finish),
        (100, Some(FinishReason::Length))
    );
    // the shift came when prompt + generated reached 64 tokens: 54 generated; the last
    // of them not computed yet, the last 32 tokens kept
    let all: Vec<u32> = prompt.iter().chain(&got.tokens).copied().collect();
    let kept = &all[64 - 32..64];
    let mut fresh = engine("llama3-tiny-bf16", config(64, 256, 4, 64));
    let mut req = Request::greedy(kept.to_vec(), 20);
    req.stop.ignore_eos = true;
    let id = fresh.add(req).unwrap();
    let mut again = HashMap::new();
    drain(&mut fresh, &mut again);
    assert_eq!(again[&id].tokens, all[64..84]);
}
