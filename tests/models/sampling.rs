//! The sampler chain against a reference written from the samplers' definitions
//! (llama.cpp's order and rules, probabilities in f64): on random logits with fixed
//! seeds, the chain's draws must follow the reference distribution (a chi-square bound
//! over many draws, and never a token the reference gives probability 0); the device's
//! top candidates must give exactly the draws of the whole row; seeds reproduce; bad
//! rows are errors.

use graft::models::{Row, SamplerChain, SamplingParams};
use graft::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The probability the chain must give each token id (see the module documentation).
fn reference(p: &SamplingParams, logits: &[f32], history: &[u32]) -> Vec<f64> {
    // bias, then penalties over the window, in f32 as the definition says
    let mut l: Vec<f32> = logits.to_vec();
    for &(id, b) in &p.logit_bias {
        l[id as usize] += b;
    }
    let window = &history[history.len().saturating_sub(p.repeat_last_n)..];
    for (id, x) in l.iter_mut().enumerate() {
        let count = window.iter().filter(|&&t| t as usize == id).count();
        if count > 0 && p.repeat_last_n > 0 {
            let y = if *x > 0.0 {
                *x / p.repeat_penalty
            } else {
                *x * p.repeat_penalty
            };
            *x = y - count as f32 * p.frequency_penalty - p.presence_penalty;
        }
    }
    // the candidates: ids sorted by adjusted logit, largest first, lower id on ties
    let mut kept: Vec<usize> = (0..l.len()).collect();
    kept.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
    if p.top_k > 0 {
        kept.truncate(p.top_k);
    }
    let mut probs = vec![0.0; l.len()];
    if p.temperature == 0.0 {
        probs[kept[0]] = 1.0;
        return probs;
    }
    let soft = |ids: &[usize]| -> Vec<f64> {
        let m = ids.iter().map(|&i| l[i] as f64).fold(f64::MIN, f64::max);
        let e: Vec<f64> = ids.iter().map(|&i| (l[i] as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect()
    };
    if p.typical_p < 1.0 {
        let q = soft(&kept);
        let h: f64 = q.iter().filter(|&&x| x > 0.0).map(|&x| -x * x.ln()).sum();
        let mut order: Vec<usize> = (0..kept.len()).collect();
        order.sort_by(|&a, &b| {
            let (da, db) = ((-q[a].ln() - h).abs(), (-q[b].ln() - h).abs());
            da.partial_cmp(&db).unwrap().then(a.cmp(&b))
        });
        let mut mass = 0.0;
        let mut n = order.len();
        for (i, &o) in order.iter().enumerate() {
            mass += q[o];
            if mass > p.typical_p as f64 {
                n = i + 1;
                break;
            }
        }
        let mut picked: Vec<usize> = order[..n].iter().map(|&o| kept[o]).collect();
        picked.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
        kept = picked;
    }
    if p.top_p < 1.0 {
        let q = soft(&kept);
        let mut mass = 0.0;
        let n = q
            .iter()
            .position(|&x| {
                mass += x;
                mass >= p.top_p as f64
            })
            .map_or(kept.len(), |i| i + 1);
        kept.truncate(n);
    }
    if p.min_p > 0.0 {
        let q = soft(&kept);
        let top = q.iter().cloned().fold(0.0, f64::max);
        let keep: Vec<usize> = kept
            .iter()
            .zip(&q)
            .filter(|&(_, &x)| x >= p.min_p as f64 * top * (1.0 - 1e-12))
            .map(|(&i, _)| i)
            .collect();
        kept = keep;
    }
    let m = kept.iter().map(|&i| l[i] as f64).fold(f64::MIN, f64::max);
    let t = p.temperature as f64;
    let w: Vec<f64> = kept
        .iter()
        .map(|&i| ((l[i] as f64 - m) / t).exp())
        .collect();
    let s: f64 = w.iter().sum();
    for (&i, x) in kept.iter().zip(w) {
        probs[i] = x / s;
    }
    probs
}

/// The chi-square quantile of `df` degrees of freedom about 5 standard deviations out
/// (Wilson-Hilferty): a correct sampler passes with probability ~1 - 3e-7.
fn chi2_bound(df: usize) -> f64 {
    let d = df.max(1) as f64;
    let z = 5.0;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Draws `n` tokens from `row` with a chain of `p` and checks them against `want`:
/// tokens of probability 0 never drawn, the counts within the chi-square bound (bins
/// expected below 5 draws pooled).
fn check_draws(what: &str, p: &SamplingParams, row: Row, history: &[u32], want: &[f64]) {
    let n = 20_000;
    let mut chain = SamplerChain::new(p, want.len()).unwrap();
    let mut counts = vec![0usize; want.len()];
    for _ in 0..n {
        counts[chain.sample(row, history).unwrap() as usize] += 1;
    }
    let (mut x2, mut bins) = (0.0, 0usize);
    let (mut pooled_o, mut pooled_e) = (0.0, 0.0);
    for (id, (&o, &q)) in counts.iter().zip(want).enumerate() {
        if q == 0.0 {
            assert_eq!(o, 0, "{what}: token {id} has probability 0 but was drawn");
            continue;
        }
        let e = q * n as f64;
        if e < 5.0 {
            pooled_o += o as f64;
            pooled_e += e;
        } else {
            x2 += (o as f64 - e).powi(2) / e;
            bins += 1;
        }
    }
    if pooled_e > 0.0 {
        x2 += (pooled_o - pooled_e).powi(2) / pooled_e;
        bins += 1;
    }
    let bound = chi2_bound(bins.saturating_sub(1));
    assert!(
        x2 <= bound,
        "{what}: chi-square {x2:.1} > {bound:.1} over {bins} bins\n{p:?}"
    );
}

/// Random logits: normal-ish values with a few repeated ones (ties) and a wide spread.
fn random_logits(rng: &mut StdRng, vocab: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..vocab)
        .map(|_| {
            let u: f32 = (0..4).map(|_| rng.random_range(-1.0..1.0f32)).sum();
            (u * 2.0 * 8.0).round() / 8.0
        })
        .collect();
    if vocab > 3 {
        l[1] = l[0];
    }
    l
}

/// The settings under test: each sampler alone, then in combinations.
fn settings() -> Vec<(&'static str, SamplingParams)> {
    let base = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        ..SamplingParams::greedy()
    };
    let with = |f: &dyn Fn(&mut SamplingParams)| {
        let mut p = base.clone();
        f(&mut p);
        p
    };
    vec![
        ("temperature 1", base.clone()),
        ("temperature 0.5", with(&|p| p.temperature = 0.5)),
        ("temperature 2.5", with(&|p| p.temperature = 2.5)),
        // 1 / t overflows: the largest logit (ties shared), never another token
        ("temperature 1e-45", with(&|p| p.temperature = 1e-45)),
        (
            "temperature 1e-38, top-k 5, min-p 0.1",
            with(&|p| {
                p.temperature = 1e-38;
                p.top_k = 5;
                p.min_p = 0.1;
            }),
        ),
        ("top-k 5", with(&|p| p.top_k = 5)),
        ("top-p 0.8", with(&|p| p.top_p = 0.8)),
        ("min-p 0.1", with(&|p| p.min_p = 0.1)),
        ("typical-p 0.7", with(&|p| p.typical_p = 0.7)),
        ("repeat penalty 1.3", with(&|p| p.repeat_penalty = 1.3)),
        ("presence 0.8", with(&|p| p.presence_penalty = 0.8)),
        ("frequency 0.6", with(&|p| p.frequency_penalty = 0.6)),
        ("negative presence", with(&|p| p.presence_penalty = -1.0)),
        (
            "logit bias",
            with(&|p| p.logit_bias = vec![(0, 2.0), (2, -1.5), (1, f32::NEG_INFINITY)]),
        ),
        (
            "llama.cpp chat",
            SamplingParams {
                seed: Some(7),
                ..SamplingParams::chat()
            },
        ),
        (
            "everything",
            with(&|p| {
                p.temperature = 0.7;
                p.top_k = 12;
                p.typical_p = 0.9;
                p.top_p = 0.9;
                p.min_p = 0.02;
                p.repeat_penalty = 1.2;
                p.presence_penalty = 0.3;
                p.frequency_penalty = 0.1;
                p.repeat_last_n = 6;
                p.logit_bias = vec![(2, -0.5)];
            }),
        ),
    ]
}

#[test]
fn every_sampler_follows_the_reference_distribution() {
    let mut rng = StdRng::seed_from_u64(2024);
    for vocab in [3, 7, 50, 300] {
        let logits = random_logits(&mut rng, vocab);
        let history: Vec<u32> = (0..10).map(|_| rng.random_range(0..vocab as u32)).collect();
        for (name, p) in settings() {
            let want = reference(&p, &logits, &history);
            let what = format!("{name}, vocab {vocab}");
            check_draws(&what, &p, Row::Full(&logits), &history, &want);
        }
    }
}

/// top-p by hand: probabilities .5 .3 .11 .07 .02 (logits ln of them); p = 0.7 and 0.79
/// keep the first two, 0.81 the first three, 0 the first one.
#[test]
fn top_p_keeps_the_shortest_prefix_reaching_p() {
    let q = [0.5f32, 0.3, 0.11, 0.07, 0.02];
    let logits: Vec<f32> = q.iter().map(|x| x.ln()).collect();
    for (top_p, kept) in [(0.7, 2), (0.79, 2), (0.81, 3), (0.0, 1), (1.0, 5)] {
        let p = SamplingParams {
            temperature: 1.0,
            top_p,
            seed: Some(1),
            ..SamplingParams::greedy()
        };
        let mut chain = SamplerChain::new(&p, 5).unwrap();
        let seen: std::collections::BTreeSet<u32> = (0..4000)
            .map(|_| chain.sample(Row::Full(&logits), &[]).unwrap())
            .collect();
        assert_eq!(seen, (0..kept).collect(), "top-p {top_p}");
    }
}

/// The row's `n` largest logits as the device gives them.
fn top_of(logits: &[f32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    // -0 ranks with +0 (adding +0 turns -0 into +0), ties by the smaller id
    ids.sort_by(|&a, &b| {
        (logits[b as usize] + 0.0)
            .total_cmp(&(logits[a as usize] + 0.0))
            .then(a.cmp(&b))
    });
    ids.truncate(n);
    let vals = ids.iter().map(|&i| logits[i as usize]).collect();
    (ids, vals)
}

/// With top-k on, the chain's draws from its `candidates()` largest logits are exactly
/// its draws from the whole row (same seed, same history), whatever the penalties and
/// negative biases do; settings that need the whole row say so.
#[test]
fn top_candidates_give_exactly_the_draws_of_the_whole_row() {
    let mut rng = StdRng::seed_from_u64(99);
    for case in 0..300 {
        let vocab = rng.random_range(2..400);
        let mut logits = random_logits(&mut rng, vocab);
        // many ties in some rows
        if case % 3 == 0 {
            logits.iter_mut().for_each(|x| *x = (*x * 0.5).round());
        }
        let history: Vec<u32> = (0..rng.random_range(0..40))
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let p = SamplingParams {
            temperature: [0.0, 0.3, 1.0, 1.7][case % 4],
            top_k: rng.random_range(1..20),
            top_p: [1.0, 0.9, 0.5][case % 3],
            min_p: [0.0, 0.05][case % 2],
            typical_p: [1.0, 1.0, 0.8][case % 3],
            repeat_penalty: [1.0, 1.1, 1.8][case % 3],
            presence_penalty: [0.0, 0.5][case % 2],
            frequency_penalty: [0.0, 0.0, 0.7][case % 3],
            repeat_last_n: rng.random_range(0..30),
            seed: Some(case as u64),
            logit_bias: (0..case % 3)
                .map(|_| {
                    (
                        rng.random_range(0..vocab as u32),
                        -rng.random_range(0.0..3.0f32),
                    )
                })
                .collect(),
        };
        let k = SamplerChain::new(&p, vocab).unwrap().candidates().unwrap();
        let (ids, vals) = top_of(&logits, k);
        let top = Row::Top {
            ids: &ids,
            logits: &vals,
        };
        let mut a = SamplerChain::new(&p, vocab).unwrap();
        let mut b = SamplerChain::new(&p, vocab).unwrap();
        let mut seq = history.clone();
        for step in 0..20 {
            let from_row = a.sample(Row::Full(&logits), &seq).unwrap();
            let from_top = b.sample(top, &seq).unwrap();
            assert_eq!(from_row, from_top, "case {case} step {step}: {p:?}");
            seq.push(from_row);
        }
    }
}

#[test]
fn settings_that_need_the_whole_row_say_so() {
    let chat = SamplingParams::chat();
    let chain = |p: &SamplingParams| SamplerChain::new(p, 1000).unwrap();
    assert_eq!(chain(&chat).candidates(), Some(40 + 64));
    let no_top_k = SamplingParams {
        top_k: 0,
        ..chat.clone()
    };
    assert_eq!(chain(&no_top_k).candidates(), None);
    let raise = SamplingParams {
        logit_bias: vec![(5, 0.5)],
        ..chat.clone()
    };
    assert_eq!(chain(&raise).candidates(), None);
    let lower = SamplingParams {
        logit_bias: vec![(5, -0.5)],
        ..chat.clone()
    };
    assert_eq!(chain(&lower).candidates(), Some(40 + 64 + 1));
    let boost = SamplingParams {
        repeat_penalty: 0.9,
        ..chat.clone()
    };
    assert_eq!(chain(&boost).candidates(), None);
    let no_penalty = SamplingParams {
        repeat_penalty: 1.0,
        ..chat.clone()
    };
    assert_eq!(chain(&no_penalty).candidates(), Some(40));
    assert_eq!(chain(&SamplingParams::greedy()).candidates(), Some(1));
    let wide = SamplingParams {
        top_k: 5000,
        ..chat
    };
    assert_eq!(chain(&wide).candidates(), Some(1000));
}

#[test]
fn seeds_reproduce() {
    let logits: Vec<f32> = (0..64).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let draw = |seed| {
        let p = SamplingParams {
            seed,
            ..SamplingParams::chat()
        };
        let mut c = SamplerChain::new(&p, 64).unwrap();
        let s = c.seed();
        let toks: Vec<u32> = (0..64)
            .map(|_| c.sample(Row::Full(&logits), &[]).unwrap())
            .collect();
        (s, toks)
    };
    assert_eq!(draw(Some(3)), draw(Some(3)));
    assert_ne!(draw(Some(3)).1, draw(Some(4)).1);
    // without a seed one is drawn, and it reproduces the run
    let (seed, toks) = draw(None);
    assert_eq!(draw(Some(seed)).1, toks);
}

/// A temperature so small that `1 / t` overflows samples the largest logit; it once gave
/// the last id every step.
#[test]
fn any_finite_positive_temperature_samples_correctly() {
    let logits = [1.0, 0.0, 3.5, -2.0, 3.4999998, 0.25];
    for t in [1e-45, 1e-40, 1e-38, f32::MIN_POSITIVE, 1e-30, 1e-9] {
        let p = SamplingParams {
            temperature: t,
            seed: Some(9),
            ..SamplingParams::greedy()
        };
        let mut c = SamplerChain::new(&p, logits.len()).unwrap();
        assert!(!c.is_greedy());
        for _ in 0..50 {
            assert_eq!(
                c.sample(Row::Full(&logits), &[]).unwrap(),
                2,
                "temperature {t:e}"
            );
        }
    }
    // a huge temperature is uniform over what the filters keep, not NaN
    let p = SamplingParams {
        temperature: f32::MAX,
        seed: Some(1),
        ..SamplingParams::greedy()
    };
    let mut c = SamplerChain::new(&p, logits.len()).unwrap();
    let want = vec![1.0 / 6.0; 6];
    let mut counts = [0usize; 6];
    for _ in 0..6000 {
        counts[c.sample(Row::Full(&logits), &[]).unwrap() as usize] += 1;
    }
    assert!(counts.iter().all(|&n| n > 850), "{counts:?} vs {want:?}");
}

/// NaN or +inf logits are an error naming the position of the row; a row where every
/// token is banned is an error naming the setting.
#[test]
fn bad_rows_are_errors() {
    let p = SamplingParams {
        seed: Some(1),
        ..SamplingParams::chat()
    };
    let mut c = SamplerChain::new(&p, 4).unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let row = [0.5, bad, 1.0, -1.0];
        match c.sample(Row::Full(&row), &[3, 1, 2]) {
            Err(Error::NonFinite { position: 2, step }) => assert_eq!(step, "sampling"),
            other => panic!("{bad}: {other:?}"),
        }
        let ids = [1, 2, 0, 3];
        let vals = [bad, 1.0, 0.5, -1.0];
        let top = Row::Top {
            ids: &ids,
            logits: &vals,
        };
        assert!(matches!(
            c.sample(top, &[0]),
            Err(Error::NonFinite { position: 0, .. })
        ));
    }
    let banned = SamplingParams {
        logit_bias: (0..4).map(|i| (i, f32::NEG_INFINITY)).collect(),
        ..p.clone()
    };
    for t in [0.0, 0.8] {
        let banned = SamplingParams {
            temperature: t,
            ..banned.clone()
        };
        let mut c = SamplerChain::new(&banned, 4).unwrap();
        match c.sample(Row::Full(&[0.0, 1.0, 2.0, 3.0]), &[]) {
            Err(Error::Sampling { param, .. }) => assert_eq!(param, "logit_bias"),
            other => panic!("{other:?}"),
        }
    }
    // a row of the wrong length, too few candidates, an id outside the vocabulary
    assert!(c.sample(Row::Full(&[0.0; 3]), &[]).is_err());
    let few = Row::Top {
        ids: &[0, 1],
        logits: &[1.0, 0.5],
    };
    let mut c = SamplerChain::new(&p, 400).unwrap();
    assert!(c.sample(few, &[]).is_err());
    let outside = Row::Top {
        ids: &[400, 1],
        logits: &[1.0, 0.5],
    };
    let mut c = SamplerChain::new(
        &SamplingParams {
            top_k: 1,
            repeat_penalty: 1.0,
            ..p
        },
        400,
    )
    .unwrap();
    assert!(c.sample(outside, &[]).is_err());
}

/// The backends that run the device part of sampling: the CPU, and the GPU when there is
/// one (`GRAFT_REQUIRE_GPU=1` makes a missing GPU a failure).
fn backends() -> Vec<Box<dyn graft::backend::Backend>> {
    #[allow(unused_mut)] // pushed to with the cuda feature only
    let mut v: Vec<Box<dyn graft::backend::Backend>> =
        vec![Box::new(graft::backend::cpu::CpuBackend::new())];
    #[cfg(feature = "cuda")]
    match graft::backend::cuda::CudaBackend::new(0) {
        Ok(b) => v.push(Box::new(b)),
        Err(Error::NoDevice(msg)) if std::env::var("GRAFT_REQUIRE_GPU").as_deref() != Ok("1") => {
            eprintln!("cuda: skipped: no GPU ({msg})")
        }
        Err(e) => panic!("cuda backend: {e}"),
    }
    v
}

/// The device's candidates ([`sample_outputs`]) of logits `[vocab, n]` on each backend:
/// ids and values of every column's largest logits, in order; the chain's draws from them
/// equal its draws from the whole column for every sampler setting above, vocabularies
/// up to 150k included.
#[test]
fn device_candidates_give_the_draws_of_the_whole_row() {
    use graft::backend::BackendExt;
    use graft::graph::{DType, Graph};
    use graft::models::blocks::sample_outputs;
    let mut rng = StdRng::seed_from_u64(5);
    for mut be in backends() {
        let be = be.as_mut();
        for (vocab, n) in [(50, 3), (3000, 2), (151_936, 1)] {
            let logits: Vec<f32> = (0..n)
                .flat_map(|_| random_logits(&mut rng, vocab))
                .collect();
            for (name, p) in settings() {
                let p = SamplingParams {
                    top_k: p.top_k.max(8),
                    ..p
                };
                if p.logit_bias.iter().any(|b| b.1 > 0.0) || p.presence_penalty < 0.0 {
                    continue; // these need the whole row
                }
                let k = SamplerChain::new(&p, vocab).unwrap().candidates().unwrap();
                let mut g = Graph::new();
                let x = g.input("logits", DType::F32, &[vocab, n]).unwrap();
                let (ids, vals) = sample_outputs(&mut g, x, k).unwrap();
                let exec = be.load(&g.plan(&[ids, vals]).unwrap()).unwrap();
                be.set_input_f32(exec, x, &logits).unwrap();
                be.compute(exec).unwrap();
                let got_ids = be.get_output_i32(exec, ids, k * n).unwrap();
                let got_vals = be.get_output_f32(exec, vals, k * n).unwrap();
                be.unload(exec).unwrap();
                for c in 0..n {
                    let row = &logits[c * vocab..(c + 1) * vocab];
                    let (want_ids, want_vals) = top_of(row, k);
                    let ids: Vec<u32> = got_ids[c * k..(c + 1) * k]
                        .iter()
                        .map(|&i| i as u32)
                        .collect();
                    let what = format!("{} {name} vocab {vocab} column {c}", be.name());
                    assert_eq!(ids, want_ids, "{what}");
                    assert_eq!(got_vals[c * k..(c + 1) * k], want_vals[..], "{what}");
                    let top = Row::Top {
                        ids: &ids,
                        logits: &got_vals[c * k..(c + 1) * k],
                    };
                    let history: Vec<u32> = (0..12).map(|i| (i * 7 % vocab) as u32).collect();
                    let mut a = SamplerChain::new(&p, vocab).unwrap();
                    let mut b = SamplerChain::new(&p, vocab).unwrap();
                    for _ in 0..50 {
                        let full = a.sample(Row::Full(row), &history).unwrap();
                        assert_eq!(b.sample(top, &history).unwrap(), full, "{what}");
                    }
                }
            }
        }
    }
}

/// A model whose final norm is NaN: every way the engine reads a step (the device argmax
/// when greedy, the device's top candidates, the whole row) ends the request at the
/// prompt's last position with [`Error::NonFinite`], on every backend; the device's top-k
/// puts the NaN logits first, so the candidates never look finite.
#[test]
fn non_finite_logits_stop_every_read_path() {
    use graft::engine::{Event, Request};
    use graft::models::{LoadOptions, Logits};
    let t = crate::fixtures::TempCopy::with_tensor_bits(
        "llama3-tiny-bf16",
        "model.norm.weight",
        0x7fc0,
    );
    let prompt = [1u32, 2, 3];
    let chat = SamplingParams {
        seed: Some(1),
        ..SamplingParams::chat()
    };
    let settings = [
        (SamplingParams::greedy(), Logits::None),
        (chat.clone(), Logits::Top(40 + 64)),
        (
            SamplingParams {
                temperature: 1e-45,
                top_k: 3,
                repeat_penalty: 1.0,
                ..chat.clone()
            },
            Logits::Top(3),
        ),
        (SamplingParams { top_k: 0, ..chat }, Logits::Last),
    ];
    for be in backends() {
        let opts = LoadOptions {
            ctx: Some(16),
            progress: false,
            ..LoadOptions::default()
        };
        let mut e = crate::runs::engine(std::path::Path::new(t.dir()), be, &opts);
        let vocab = e.config().vocab_size;
        for (p, reads) in &settings {
            let chain = SamplerChain::new(p, vocab).unwrap();
            assert_eq!(chain.wants(), *reads, "{p:?}");
            let mut req = Request::greedy(prompt.to_vec(), 4);
            req.sampling = p.clone();
            let id = e.add(req).unwrap();
            let mut events = Vec::new();
            while e.has_work() {
                events.extend(e.step().unwrap());
            }
            match &events[..] {
                [Event::Error {
                    id: i,
                    error: Error::NonFinite { position: 2, .. },
                }] if *i == id => {}
                other => panic!("{} {reads:?}: {other:?}", e.backend().name()),
            }
        }
        e.release().unwrap();
    }
}
