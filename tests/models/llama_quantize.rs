//! Files llama.cpp's llama-quantize wrote (tests/fixtures/llama-quantize, made by
//! scripts/make-lowbit-fixtures.sh from a random one-layer Llama-shaped F16 file with an
//! importance matrix from llama-imatrix, as published files are made): every low-bit
//! block type loads from one, graft dequantizes every tensor of them to the bits of
//! llama.cpp's `gguf` package, and each file's logits, on every backend,
//!
//! - match the logits of the same file with its weights dequantized to F32 (what differs is
//!   the Q8_1 rounding of the activations in the quantized products, and the GPU
//!   prefill's F16 copy of the weights): NMSE at most 1e-3, measured 6.3e-5 .. 1.3e-4 on
//!   the CPU; a wrong grid, scale, sign or block offset in a product gives errors of
//!   order 1;
//! - stay within the type's error of the F32 model (the F16 file's weights read into
//!   F32): 3x the NMSE measured on the CPU, 2x where that is above 0.15 (the table in
//!   docs/benchmarks.md, `cargo test --test models llama_quantize -- --nocapture`). The
//!   weights are N(0, 0.02) noise, for which every type's relative error is its full
//!   rounding error (trained weights, whose outliers the types were made for, fare
//!   better); the ternary types round most of such weights to zero and keep little of
//!   the model, so their figure is near 1 and the check above is what tests them.
//!
//! Logits (log-probabilities, rows centered) are those of a 12-token prompt's last position
//! and 4 decode steps after it on the engine, so both the prefill products and the decode
//! products (Q8_1 activations) count.

use std::collections::HashSet;
use std::path::Path;

use graft::backend::Backend;
use graft::engine::{Engine, EngineConfig};
use graft::gguf::GgufFile;
use graft::models::{LoadOptions, QuantPlan};
use graft::quant::{dequantize_row, QType};
use sha2::{Digest, Sha256};

use crate::fixtures::fixture;
use crate::model_fixtures::backends;
use crate::reference::nmse;
use crate::runs::{centered, prefix_rows};

/// The files (llama-quantize's file type, lower case) and the NMSE limit of each against
/// the F32 model: 3x the CPU's figure (in the comment), 2x where that is above 0.15.
const FILES: [(&str, f64); 13] = [
    ("q2_k", 0.29),    // 0.143
    ("q3_k_m", 0.12),  // 0.0391
    ("iq4_nl", 0.057), // 0.0189
    ("iq4_xs", 0.053), // 0.0176
    ("iq3_xxs", 0.2),  // 0.0663
    ("iq3_s", 0.14),   // 0.0457
    ("iq2_xxs", 0.58), // 0.289
    ("iq2_xs", 0.42),  // 0.212
    ("iq2_m", 0.18),   // 0.0616
    ("iq1_s", 0.69),   // 0.345
    ("iq1_m", 0.73),   // 0.367
    // 1.07 on the engine's centered rows: the ternary types keep little of random
    // weights (see the module docs); their check is the one against their own F32 weights
    ("tq1_0", 1.5),
    ("tq2_0", 1.5),
];

/// The block types the files must hold between them.
const TYPES: [QType; 13] = [
    QType::Q2_K,
    QType::Q3_K,
    QType::IQ4_NL,
    QType::IQ4_XS,
    QType::IQ3_XXS,
    QType::IQ3_S,
    QType::IQ2_XXS,
    QType::IQ2_XS,
    QType::IQ2_S,
    QType::IQ1_S,
    QType::IQ1_M,
    QType::TQ1_0,
    QType::TQ2_0,
];

/// The log-probability rows (centered) of the file at `path` at the last position of a
/// 12-token prompt and 4 decode steps after it, on `be`, which comes back.
fn logits(
    be: Box<dyn Backend>,
    path: &Path,
    quantize: Option<QuantPlan>,
) -> (Vec<f64>, Box<dyn Backend>) {
    let opts = LoadOptions {
        progress: false,
        quantize,
        ..LoadOptions::default()
    };
    let mut e = Engine::load(path, be, &opts, EngineConfig::new(32))
        .unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let mut seq: Vec<u32> = (0..12).map(|i| (i * 23 + 5) % 64).collect();
    seq.extend([7, 42, 3, 60]);
    let rows = centered(&prefix_rows(&mut e, &seq, 11), e.config().vocab_size);
    (rows, e.into_backend().unwrap())
}

/// Checks graft's dequantization of every block-quantized tensor of file `name` against
/// the SHA-256 of gguf-py's (`manifest`), and gives the block types of the file.
fn check_dequantized(dir: &Path, name: &str, manifest: &serde_json::Value) -> HashSet<QType> {
    let path = dir.join(format!("{name}.gguf"));
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let want = &manifest["files"][format!("{name}.gguf")]["dequantized_sha256"];
    let mut types = HashSet::new();
    for t in f.tensors() {
        let Some(q) = QType::parse(t.ty.name()) else {
            continue;
        };
        types.insert(q);
        let mut values = vec![0f32; t.n_elements() as usize];
        dequantize_row(q, f.tensor_bytes(&t.name).unwrap(), &mut values).unwrap();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            Some(got.as_str()),
            want[&t.name].as_str(),
            "{name}: {} ({q}) dequantizes to other values than gguf-py's",
            t.name
        );
    }
    types
}

/// Every file dequantizes to gguf-py's values, and its logits match its dequantized self
/// and track the F32 model within its type's limit on every backend; the files hold
/// every type of [`TYPES`].
#[test]
fn llama_quantize_files_track_the_f32_model() {
    let dir = fixture("llama-quantize");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let mut seen = HashSet::new();
    for (name, _) in FILES {
        seen.extend(check_dequantized(&dir, name, &manifest));
    }
    let missing: Vec<_> = TYPES.iter().filter(|t| !seen.contains(t)).collect();
    assert!(missing.is_empty(), "no file holds {missing:?}");
    for be in backends() {
        let name_of = be.name().to_string();
        let (f32_model, mut be) = logits(be, &dir.join("f16.gguf"), Some(QuantPlan::F32));
        for (name, limit) in FILES {
            let path = dir.join(format!("{name}.gguf"));
            let (got, back) = logits(be, &path, None);
            let (own, back) = logits(back, &path, Some(QuantPlan::F32));
            be = back;
            let own = nmse(&got, &own);
            let e = nmse(&got, &f32_model);
            println!(
                "{name} on {name_of}: NMSE {own:.2e} against its weights in F32, {e:.2e} against the F32 model"
            );
            assert!(
                own <= 1e-3,
                "{name} on {name_of}: NMSE {own:e} against its weights in F32"
            );
            assert!(
                e <= limit,
                "{name} on {name_of}: NMSE {e:e} above {limit:e}"
            );
        }
    }
}

/// ggml's mixes that graft makes pick, for every tensor of two 16-layer shapes (4 query
/// heads a KV head; 1, with `ffn_down` rows of 288 elements that no 256-element block
/// fits), the type llama-quantize gives it (`mixes.json`: its `--dry-run` without an
/// importance matrix).
#[test]
fn mixes_pick_llama_quantize_types() {
    use graft::models::{arch::presets, Config, Role};
    let dir = fixture("llama-quantize");
    let mixes: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("mixes.json")).unwrap()).unwrap();
    let shapes = mixes["shapes"].as_object().unwrap();
    assert_eq!(shapes.len(), 2);
    for (shape, s) in shapes {
        let dim = |k: &str| s[k].as_u64().unwrap() as usize;
        let cfg = Config {
            hidden_size: dim("hidden"),
            intermediate_size: dim("ff"),
            num_hidden_layers: dim("layers"),
            num_attention_heads: dim("heads"),
            num_key_value_heads: dim("kv_heads"),
            head_dim: dim("hidden") / dim("heads"),
            vocab_size: dim("vocab"),
            tie_word_embeddings: false,
            ..presets::preset("llama2-7b").unwrap()
        };
        let tensors = |layer| {
            let roles = match layer {
                None => vec![Role::TokEmbd, Role::Output],
                Some(_) => vec![
                    Role::AttnQ,
                    Role::AttnK,
                    Role::AttnV,
                    Role::AttnOut,
                    Role::FfnGate,
                    Role::FfnUp,
                    Role::FfnDown,
                ],
            };
            roles.into_iter().map(move |r| (r, layer))
        };
        let all: Vec<(Role, Option<usize>)> = tensors(None)
            .chain((0..cfg.num_hidden_layers).flat_map(|l| tensors(Some(l))))
            .collect();
        let types = s["types"].as_object().unwrap();
        assert_eq!(types.len(), 8, "{shape}");
        for (mix, want) in types {
            let plan = QuantPlan::parse(mix).unwrap_or_else(|| panic!("no plan {mix}"));
            assert_eq!(want.as_object().unwrap().len(), all.len(), "{shape} {mix}");
            for &(role, layer) in &all {
                let name = role.gguf_name(layer);
                let got = plan
                    .pick(role, layer, &cfg)
                    .dtype
                    .to_string()
                    .to_uppercase();
                assert_eq!(
                    Some(got.as_str()),
                    want[&name].as_str(),
                    "{shape} {mix}: {name}"
                );
            }
        }
    }
}
