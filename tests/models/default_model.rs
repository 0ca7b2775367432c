//! The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against Hugging Face
//! transformers on the same file (tests/fixtures/smollm2-reference, made by
//! scripts/make-smollm2-reference.py: transformers dequantizes the weights to float32).
//!
//! graft's tokenizer must give transformers' ids exactly; the engine's greedy tokens must
//! equal the reference's at every step whose top-1 minus top-2 margin is clear; the last
//! prompt position's logits (the engine's log-probabilities, rows centered) must be
//! close: with the weights dequantized to f32 for the dot products (`QuantDot::F32`, what
//! transformers computes) and an F32 KV cache at float precision, and with Q8_1
//! activations and the default F16 cache within the error that quantizing the
//! activations brings. Skips when the model is not in the cache.

use std::path::{Path, PathBuf};

use graft::backend::cpu::CpuBackend;
use graft::graph::DType;
use graft::models::{text::tokenizer, CacheTypes, LoadOptions};
use graft::ops::mul_mat::QuantDot;
use serde::Deserialize;

use crate::cached_model::cached_default_model;
use crate::fixtures::fixture;
use crate::reference::{f32_data, nmse};
use crate::runs::{centered, engine, greedy_request, run};

/// A greedy step whose reference margin is below this (in logits) may flip under the
/// quantized activations' error; agreement is required only up to the first such step.
const CLEAR_MARGIN: f32 = 0.5;

#[derive(Deserialize)]
struct Reference {
    tokenize: Vec<Tokenized>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Tokenized {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    margins: Vec<f32>,
}

fn reference_dir() -> PathBuf {
    fixture("smollm2-reference")
}

fn load_reference() -> (Reference, Vec<Vec<f32>>) {
    let dir = reference_dir();
    let json = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let r: Reference = serde_json::from_str(&json).unwrap();
    let bytes = std::fs::read(dir.join("logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!(t.shape()[0], r.cases.len());
    let vocab = t.shape()[1];
    let all = f32_data(&t);
    let logits = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    (r, logits)
}

#[test]
fn tokenizer_matches_transformers_on_the_real_file() {
    let Some(path) = cached_default_model() else {
        return;
    };
    let (r, _) = load_reference();
    let tok = tokenizer::for_model(&path).unwrap().unwrap().tokenizer;
    let mut failures = Vec::new();
    for t in &r.tokenize {
        let ids = tok.encode_with(&t.text, false).unwrap();
        if ids != t.ids {
            failures.push(format!("{:?}\n  got  {ids:?}\n  want {:?}", t.text, t.ids));
        }
    }
    for c in &r.cases {
        let ids = tok.encode(&c.text).unwrap();
        if ids != c.ids {
            failures.push(format!("{:?}\n  got  {ids:?}\n  want {:?}", c.text, c.ids));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Runs every reference case on the engine with the CPU's `dot` path and `cache`: the
/// NMSE of the last prompt position's log-probabilities against transformers' logits
/// (rows centered; returned, worst case), and greedy decoding compared step by step
/// while the reference margin is clear.
fn check_cases(path: &Path, dot: QuantDot, cache: CacheTypes, margin: f32) -> f64 {
    let (r, logits) = load_reference();
    let mut be = CpuBackend::new();
    be.set_quant_dot(dot);
    let opts = LoadOptions {
        ctx: Some(128),
        progress: false,
        cache,
        ..LoadOptions::default()
    };
    let mut e = engine(path, Box::new(be), &opts);
    let vocab = e.config().vocab_size;
    let mut worst = 0f64;
    for (c, want) in r.cases.iter().zip(&logits) {
        let clear = c.margins.iter().take_while(|&&m| m >= margin).count();
        let mut req = greedy_request(&c.ids, clear.max(1), true, vocab);
        req.stop.ignore_eos = true;
        let got = run(&mut e, req);
        let err = nmse(&centered(&got.rows[0], vocab), &centered(want, vocab));
        eprintln!("{dot:?} {:?}: last-position logits NMSE {err:.3e}", c.text);
        worst = worst.max(err);
        assert_eq!(
            got.tokens[..clear],
            c.greedy[..clear],
            "{dot:?} {:?}: greedy steps with a reference margin of at least {margin}",
            c.text
        );
    }
    e.release().unwrap();
    worst
}

#[test]
fn f32_dots_match_transformers() {
    let Some(path) = cached_default_model() else {
        return;
    };
    let f32_cache = CacheTypes {
        k: DType::F32,
        v: DType::F32,
        flash_attn: true,
    };
    let worst = check_cases(&path, QuantDot::F32, f32_cache, CLEAR_MARGIN);
    assert!(worst < 1e-9, "logits NMSE {worst:.3e}");
}

#[test]
fn q8_1_dots_match_transformers_within_the_activation_error() {
    let Some(path) = cached_default_model() else {
        return;
    };
    let worst = check_cases(&path, QuantDot::Q8_1, CacheTypes::default(), CLEAR_MARGIN);
    // Rounding activations to 8 bits is discontinuous: a change in the last bit of an f32
    // sum (the order of additions differs between the AVX2 and portable dot kernels) can
    // move a value to the next quant level, so this error is a sample, not a constant:
    // measured 1.1e-3 to 2.0e-3 over the four prompts with the AVX2 kernels (the engine's
    // decode steps, rows centered; a prefill read up to 7.7e-3 on the raw logits). The
    // precise check is the f32 test above.
    assert!(worst < 2e-2, "logits NMSE {worst:.3e}");
}

/// Every KV cache type with the fused attention (weights dequantized for the dots, so
/// the cache is the only rounding): greedy tokens equal while the margin is clear, and
/// the logits within each type's bound (docs/gguf.md has the measured figures).
#[test]
fn every_cache_type_matches_transformers_within_its_bound() {
    let Some(path) = cached_default_model() else {
        return;
    };
    let bounds = [
        (DType::F16, 1e-5, CLEAR_MARGIN),
        (DType::BF16, 2e-3, CLEAR_MARGIN),
        (DType::Q8_0, 3e-3, CLEAR_MARGIN),
        // This model's keys have a few channels far larger than the rest, so 4-bit
        // blocks of keys round the others away: measured 0.036 to 0.068 (rows centered;
        // 0.1 to 0.49 on a prefill's raw logits). Logits that far off can reorder two
        // tokens half a logit apart (a step of margin 0.51 did, with the f32 sums of the
        // attention added in another order), so the greedy steps are compared where the
        // reference's margin is at least a whole logit.
        (DType::Q4_0, 1.0, 1.0),
    ];
    for (dt, bound, margin) in bounds {
        let cache = CacheTypes {
            k: dt,
            v: dt,
            flash_attn: true,
        };
        let worst = check_cases(&path, QuantDot::F32, cache, margin);
        eprintln!("cache {dt}: worst last-position logits NMSE {worst:.3e}");
        assert!(
            worst < bound,
            "cache {dt}: logits NMSE {worst:.3e} >= {bound:e}"
        );
    }
}
