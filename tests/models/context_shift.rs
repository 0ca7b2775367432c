//! Generation past the context with [`Model::set_context_shift`]: the run keeps going in
//! the memory of one context, and what it generates after a shift is what a fresh run
//! from the kept tokens generates (CPU, tiny Model 3 fixture, greedy).

use graft::backend::cpu::CpuBackend;
use graft::models::{LoadOptions, Model, SamplerChain};

use crate::fixtures;

const CTX: usize = 16;

fn load(be: &mut CpuBackend) -> Model {
    let opts = LoadOptions {
        ctx: Some(CTX),
        progress: false,
        ..LoadOptions::default()
    };
    let mut m = Model::load(&fixtures::fixture("llama3-tiny-bf16"), be, &opts).unwrap();
    m.set_ignore_eos(true);
    m
}

fn greedy(m: &mut Model, be: &mut CpuBackend, prompt: &[u32], n: usize) -> Vec<u32> {
    m.generate(be, prompt, n, &mut SamplerChain::greedy(), &mut |_| Ok(()))
        .unwrap()
        .tokens
}

#[test]
fn generation_goes_past_the_context_by_shifting() {
    let mut be = CpuBackend::new();
    let mut m = load(&mut be);
    let prompt = [1u32, 2, 3];
    let e = m
        .generate(
            &mut be,
            &prompt,
            40,
            &mut SamplerChain::greedy(),
            &mut |_| Ok(()),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("exceeds the context"), "{e}");

    m.set_context_shift(true);
    let shifted = greedy(&mut m, &mut be, &prompt, 40);
    assert_eq!(shifted.len(), 40);
    assert!(m.n_past() <= CTX);

    // Token i is decoded at position 3 + i, so the first shift comes before token 13
    // (position 16) is decoded: the cache then holds the last 8 tokens up to token 13,
    // and the tokens from 14 on come from them until the next shift (8 of them fit a
    // fresh run's context after those 8).
    let mut fresh = load(&mut be);
    let unshifted = greedy(&mut fresh, &mut be, &prompt, CTX - prompt.len());
    assert_eq!(shifted[..unshifted.len()], unshifted[..]);
    let history: Vec<u32> = prompt.iter().chain(&shifted).copied().collect();
    let kept = &history[prompt.len() + 13 + 1 - CTX / 2..prompt.len() + 13 + 1];
    let after = greedy(&mut fresh, &mut be, kept, CTX - kept.len());
    assert_eq!(shifted[14..22], after[..], "kept {kept:?}");
}
