//! Quantized models: the committed tiny HF fixtures loaded with `--quantize` (the
//! matrices converted on the host while loading), and random preset models quantized on
//! the backend, against their unquantized selves.
//!
//! The fixtures' rows are 64 and 192 elements long, not multiples of the K-quants' 256,
//! so on them `q4_k`, `q5_k`, `q6_k` and the mixes fall back as llama.cpp does (Q4_K to
//! Q5_0, Q5_K to Q5_1, Q6_K to Q8_0): they exercise the fallback, the mixes' separate
//! q/k/v mul_mats, and the 32-element types. The K-quant kernels themselves run in
//! `random_presets_quantize_on_the_backend` on the `tiny` preset (rows of 256 and 768).
//!
//! Limits. Each quantized type's NMSE against HF's float32 logits was measured on the
//! CPU backend (the table in docs/benchmarks.md, `cargo test --test models
//! quant_model -- --nocapture`); each limit is about 4x the largest of the three fixtures (2x for Q4_0
//! and Q4_1, whose 4x would exceed 1), so a wrong scale or a mixed-up tensor (errors of
//! order 1) cannot pass. The fixtures' random weights (initializer range 0.2) make them
//! far more sensitive than trained models: Q4_0 reaches an NMSE of 0.3 here. For the
//! same reason the greedy comparison (steps whose HF margin is above 4x the RMS logit
//! error) covers 1 to 13 steps for the 8-bit types and none for the 4- and 5-bit ones,
//! whose error is larger than every margin of these fixtures.

use graft::backend::cpu::CpuBackend;
use graft::backend::Backend;
use graft::graph::DType;
use graft::models::{arch::presets, CacheTypes, LoadOptions, Logits, Model, QuantPlan, Role};

use reference::{check_model, has_experts, nmse, reference, FIXTURES};

use crate::{fixtures, reference};

/// The quantized plans of `--quantize` and the NMSE limit of each against HF (about 4x
/// the largest measured over the three fixtures, see the module docs).
const PLANS: [(QuantPlan, f64); 10] = [
    (QuantPlan::Q8_0, 5e-3),   // measured 8.1e-4 .. 1.3e-3
    (QuantPlan::Q4_0, 0.65),   // 0.20 .. 0.31 (2x: 4x would exceed 1)
    (QuantPlan::Q4_1, 0.45),   // 0.18 .. 0.21 (2x)
    (QuantPlan::Q5_0, 0.36),   // 0.066 .. 0.090
    (QuantPlan::Q5_1, 0.27),   // 0.045 .. 0.066
    (QuantPlan::Q4_K, 0.36),   // falls back to Q5_0 on these rows
    (QuantPlan::Q5_K, 0.27),   // falls back to Q5_1
    (QuantPlan::Q6_K, 5e-3),   // falls back to Q8_0
    (QuantPlan::Q4_K_M, 0.33), // 0.040 .. 0.081
    (QuantPlan::Q5_K_M, 0.25), // 0.030 .. 0.063
];

fn load(be: &mut dyn Backend, name: &str, plan: Option<QuantPlan>) -> Model {
    let opts = LoadOptions {
        ctx: Some(64),
        progress: false,
        quantize: plan,
        ..LoadOptions::default()
    };
    Model::load(&fixtures::fixture(name), be, &opts).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every fixture with every `--quantize` type: NMSE against HF within the type's limit,
/// HF's greedy tokens on the steps whose margin is clear of the logit error.
#[test]
fn quantized_fixtures_track_hf() {
    let mut be = CpuBackend::new();
    let be: &mut dyn Backend = &mut be;
    // Mixtures of experts are left out: their quantized routers pick other experts for
    // some tokens (qwen3moe-tiny-bf16 in Q8_0: NMSE 7.7e-3, from jumps in the logits that
    // no bound on the weights' rounding describes). Their block types are held to the
    // f64 oracle by tests/ops/mul_mat_id.rs, and their quantized GGUF files to
    // `--quantize` by tests/cli/gguf_model.rs.
    for name in FIXTURES.into_iter().filter(|n| !has_experts(n)) {
        let r = reference(name);
        for (plan, limit) in PLANS {
            let mut m = load(be, name, Some(plan));
            let (e, safe) = check_model(be, &mut m, &r);
            println!(
                "{name} {plan}: NMSE vs HF {e:.2e}, {safe}/{} greedy steps compared, {} weight bytes",
                r.greedy.len(),
                m.weights().bytes
            );
            assert!(e <= limit, "{name} {plan}: NMSE {e:e} > {limit:e}");
            m.release(be).unwrap();
        }
    }
}

/// What `--quantize` puts where on a fixture: Q4_K_M falls back per llama.cpp's rules,
/// gives layer 1 (the last eighth of 2 layers) more bits for attn_v and ffn_down, and
/// so splits that layer's q|k|v; norms stay F32.
#[test]
fn quantize_picks_ggml_types_with_fallbacks() {
    let mut be = CpuBackend::new();
    let be: &mut dyn Backend = &mut be;
    let m = load(be, "llama2-tiny-f32", Some(QuantPlan::Q4_K_M));
    let w = m.weights();
    let dt = |r, l| w.get(r, l).unwrap().dtype;
    let (l0, l1) = (Some(0), Some(1));
    assert_eq!(dt(Role::AttnQ, l0), DType::Q5_0, "Q4_K falls back to Q5_0");
    assert_eq!(dt(Role::AttnV, l0), DType::Q5_0);
    assert_eq!(dt(Role::AttnV, l1), DType::Q8_0, "Q6_K falls back to Q8_0");
    assert_eq!(dt(Role::FfnDown, l1), DType::Q8_0);
    assert_ne!(
        dt(Role::AttnQ, l1),
        dt(Role::AttnV, l1),
        "layer 1 splits q|k|v"
    );
    assert_eq!(
        dt(Role::Output, None),
        DType::Q8_0,
        "the head's rows do not fit Q6_K"
    );
    assert_eq!(dt(Role::TokEmbd, None), DType::Q5_0);
    assert_eq!(dt(Role::AttnNorm, l0), DType::F32);
    let q8 = load(be, "llama3-tiny-bf16", Some(QuantPlan::Q8_0));
    assert_eq!(q8.weights().matrix_dtype(q8.config()), Some(DType::Q8_0));
    // Without --quantize, matrices keep their dtype and norms become F32.
    let bf = load(be, "llama3-tiny-bf16", None);
    assert_eq!(bf.weights().matrix_dtype(bf.config()), Some(DType::BF16));
    let out_norm = bf.weights().get(Role::OutNorm, None).unwrap();
    assert_eq!(out_norm.dtype, DType::F32);
}

/// Random `tiny` preset models in each block type, quantized on the backend from the
/// F32 values of the same seed: their logits stay close to the F32 model's (the K-quant
/// mul_mats run here, rows of 256 and 768), and a quantized model reads fewer bytes.
#[test]
fn random_presets_quantize_on_the_backend() {
    let cfg = presets::preset("tiny").unwrap();
    let mut be = CpuBackend::new();
    let be: &mut dyn Backend = &mut be;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 311 + 5) % 4096).collect();
    let mut f32_model = Model::random(
        cfg.clone(),
        QuantPlan::F32,
        16,
        CacheTypes::default(),
        5,
        be,
    )
    .unwrap();
    let want = f32_model.prefill(be, &prompt, Logits::All).unwrap().logits;
    let f32_bytes = f32_model.weights().bytes_per_token(&cfg);
    f32_model.release(be).unwrap();
    for (plan, limit) in [
        // 4x the measured NMSE (1.0e-4, 2.5e-2, 2.1e-2, 5.3e-3, 1.0e-3, 1.3e-2; the mixes of
        // the low-bit types 4.0e-2, 6.5e-2, 1.6e-2, 7.5e-3, 1.2e-2, 1.1e-2: Q2_K's gives
        // attn_v Q4_K here, 4 query heads a KV head)
        (QuantPlan::Q8_0, 4e-4),
        (QuantPlan::Q4_0, 0.1),
        (QuantPlan::Q4_K, 0.085),
        (QuantPlan::Q5_K, 0.021),
        (QuantPlan::Q6_K, 4e-3),
        (QuantPlan::Q4_K_M, 0.053),
        (QuantPlan::Q2_K, 0.16),
        (QuantPlan::Q3_K_S, 0.26),
        (QuantPlan::Q3_K_M, 0.064),
        (QuantPlan::Q3_K_L, 0.03),
        (QuantPlan::IQ4_NL, 0.05),
        (QuantPlan::IQ4_XS, 0.043),
    ] {
        let mut m = Model::random(cfg.clone(), plan, 16, CacheTypes::default(), 5, be).unwrap();
        let got = m.prefill(be, &prompt, Logits::All).unwrap().logits;
        let e = nmse(&got, &want);
        let bytes = m.weights().bytes_per_token(&cfg);
        println!("tiny {plan}: NMSE vs F32 {e:.2e}, {bytes} bytes per token (F32 {f32_bytes})");
        assert!(e <= limit, "tiny {plan}: NMSE {e:e} > {limit:e}");
        assert!(bytes * 3 < f32_bytes, "{plan}: {bytes} bytes per token");
        m.release(be).unwrap();
    }
}
