//! Loading HF checkpoints: the bytes land where the fused layout says, and every broken
//! copy of a fixture (missing, extra, mis-shaped, wrong-dtype or truncated tensor, bad
//! index, bad config field) fails with an error naming the file, the tensor or field and
//! what was expected. Also the run-time errors of the inference API (bad token id,
//! context overflow, empty prompt) and the bound on the engine's loaded plans.

use std::collections::BTreeMap;
use std::path::Path;

use graft::backend::cpu::CpuBackend;
use graft::backend::Backend;
use graft::engine::{FinishReason, Request};
use graft::models::{LoadOptions, Model, SamplingParams};
use graft::Error;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::fixtures::{fixture, TempCopy};
use crate::runs::{engine, greedy, run};

/// Loader-test operations on a fixture copy.
impl TempCopy {
    /// Rewrites a safetensors file after editing its tensors.
    fn edit(
        &self,
        file: &str,
        f: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
    ) {
        let bytes = std::fs::read(self.path(file)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut map: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
            .collect();
        f(&mut map);
        let views: Vec<(String, TensorView)> = map
            .iter()
            .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(
            self.path(file),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
    }

    /// Rewrites config.json after editing it.
    fn edit_config(&self, f: impl FnOnce(&mut serde_json::Value)) {
        let text = std::fs::read_to_string(self.path("config.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        f(&mut v);
        let text = serde_json::to_string_pretty(&v).unwrap();
        std::fs::write(self.path("config.json"), text).unwrap();
    }

    fn load(&self) -> graft::Result<Model> {
        load_dir(Path::new(self.dir()))
    }
}

fn load_dir(dir: &Path) -> graft::Result<Model> {
    let mut be = CpuBackend::new();
    Model::load(
        dir,
        &mut be,
        &LoadOptions {
            ctx: Some(32),
            progress: false,
            ..LoadOptions::default()
        },
    )
}

/// The error message of a load that must fail, checked to contain every `needle`.
fn expect_err(r: graft::Result<Model>, needles: &[&str]) -> String {
    let msg = match r {
        Ok(_) => panic!("loading succeeded, expected an error mentioning {needles:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
    msg
}

/// Every weight lands at its slot's offset, byte for byte (q|k|v and gate|up fused).
#[test]
fn weights_land_at_their_slots() {
    for (name, files) in [
        ("llama2-tiny-f32", vec!["model.safetensors"]),
        (
            "llama3-tiny-f16",
            vec![
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ],
        ),
    ] {
        let mut be = CpuBackend::new();
        let m = Model::load(&fixture(name), &mut be, &LoadOptions::default()).unwrap();
        let w = m.weights();
        let mut checked = 0;
        for file in files {
            let bytes = std::fs::read(fixture(name).join(file)).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for slot in w.slots(m.config()) {
                let hf = (m.config().arch.spec().hf_source)(slot.role, slot.layer).name;
                let Ok(t) = st.tensor(&hf) else {
                    continue;
                };
                // Matrices are uploaded as they are; norms are widened to F32 (exactly).
                let want: Vec<u8> = match t.dtype() {
                    Dtype::F16 if slot.is_vector() => t
                        .data()
                        .chunks_exact(2)
                        .flat_map(|c| {
                            half::f16::from_le_bytes([c[0], c[1]])
                                .to_f32()
                                .to_le_bytes()
                        })
                        .collect(),
                    _ => t.data().to_vec(),
                };
                let mut out = vec![0u8; want.len()];
                be.read_buffer(w.buffer, slot.at.offset, &mut out).unwrap();
                assert_eq!(out, want, "{name}: {}", slot.name);
                checked += 1;
            }
        }
        assert_eq!(checked, w.slots(m.config()).len(), "{name}");
    }
}

#[test]
fn missing_tensor() {
    let t = TempCopy::of("llama2-tiny-f32");
    t.edit("model.safetensors", |m| {
        m.remove("model.layers.1.mlp.up_proj.weight");
    });
    expect_err(
        t.load(),
        &[
            "'model.layers.1.mlp.up_proj.weight' is missing",
            "[192, 64]",
        ],
    );
}

#[test]
fn extra_tensor() {
    let t = TempCopy::of("llama2-tiny-f32");
    t.edit("model.safetensors", |m| {
        m.insert(
            "model.layers.0.mlp.extra.weight".into(),
            (Dtype::F32, vec![2], vec![0; 8]),
        );
    });
    expect_err(
        t.load(),
        &[
            "model.safetensors",
            "unexpected tensor 'model.layers.0.mlp.extra.weight'",
        ],
    );
}

#[test]
fn untied_head_in_a_tied_model() {
    let t = TempCopy::of("llama3-tiny-bf16");
    t.edit("model.safetensors", |m| {
        let embd = m["model.embed_tokens.weight"].clone();
        m.insert("lm_head.weight".into(), embd);
    });
    expect_err(
        t.load(),
        &["unexpected tensor 'lm_head.weight'", "tie_word_embeddings"],
    );
}

/// Rope frequency buffers of old checkpoints are derived from the config and ignored.
#[test]
fn rotary_inv_freq_is_ignored() {
    let t = TempCopy::of("llama2-tiny-f32");
    t.edit("model.safetensors", |m| {
        let inv: Vec<u8> = (0..8).flat_map(|i: i32| (i as f32).to_le_bytes()).collect();
        m.insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            (Dtype::F32, vec![8], inv),
        );
    });
    assert!(t.load().is_ok());
}

#[test]
fn misshaped_tensor() {
    let t = TempCopy::of("llama3-tiny-bf16");
    t.edit("model.safetensors", |m| {
        m.get_mut("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .1 = vec![64, 128];
    });
    expect_err(
        t.load(),
        &[
            "model.safetensors",
            "'model.layers.0.self_attn.q_proj.weight' has shape [64, 128], expected [128, 64]",
            "'num_attention_heads'",
        ],
    );
}

/// The config and the weights disagree (the config's MLP is narrower than the file's).
#[test]
fn config_does_not_match_the_weights() {
    let t = TempCopy::of("llama2-tiny-f32");
    let cfg = std::fs::read_to_string(t.path("config.json")).unwrap();
    std::fs::write(
        t.path("config.json"),
        cfg.replace("\"intermediate_size\": 192", "\"intermediate_size\": 128"),
    )
    .unwrap();
    expect_err(
        t.load(),
        &[
            "'intermediate_size'",
            "mlp.gate_proj.weight' has shape [192, 64], expected [128, 64]",
        ],
    );
}

#[test]
fn wrong_dtype() {
    let t = TempCopy::of("llama3-tiny-bf16");
    t.edit("model.safetensors", |m| {
        let (_, shape, bytes) = m["model.layers.1.self_attn.k_proj.weight"].clone();
        let wide: Vec<u8> = bytes.chunks(2).flat_map(|_| 7i64.to_le_bytes()).collect();
        m.insert(
            "model.layers.1.self_attn.k_proj.weight".into(),
            (Dtype::I64, shape, wide),
        );
    });
    expect_err(
        t.load(),
        &["'model.layers.1.self_attn.k_proj.weight' has dtype I64; supported: F32, F16, BF16"],
    );
    let t = TempCopy::of("llama3-tiny-bf16");
    t.edit("model.safetensors", |m| {
        let (_, shape, bytes) = m["model.embed_tokens.weight"].clone();
        let wide: Vec<u8> = bytes.chunks(2).flat_map(|_| 7i64.to_le_bytes()).collect();
        m.insert(
            "model.embed_tokens.weight".into(),
            (Dtype::I64, shape, wide),
        );
    });
    expect_err(
        t.load(),
        &["'model.embed_tokens.weight' has dtype I64; supported: F32, F16, BF16"],
    );
}

#[test]
fn truncated_file() {
    let t = TempCopy::of("llama2-tiny-f32");
    let file = t.path("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    // The tensor stored last in the file is the one cut short.
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let last = st
        .tensors()
        .into_iter()
        .max_by_key(|(_, v)| v.data().as_ptr() as usize)
        .unwrap()
        .0;
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let msg = expect_err(
        t.load(),
        &[
            "model.safetensors is truncated",
            &format!("tensor '{last}'"),
        ],
    );
    assert!(
        msg.contains(&format!("the file has {} bytes", bytes.len() - 100)),
        "{msg}"
    );
    // Cut inside the header.
    std::fs::write(&file, &bytes[..100]).unwrap();
    expect_err(t.load(), &["model.safetensors", "the header claims"]);
    std::fs::write(&file, &bytes[..5]).unwrap();
    expect_err(t.load(), &["model.safetensors", "too short"]);
}

#[test]
fn sharded_index_errors() {
    let t = TempCopy::of("llama3-tiny-f16");
    std::fs::remove_file(t.path("model-00002-of-00002.safetensors")).unwrap();
    expect_err(t.load(), &["model-00002-of-00002.safetensors"]);

    let t = TempCopy::of("llama3-tiny-f16");
    let index = std::fs::read_to_string(t.path("model.safetensors.index.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&index).unwrap();
    let map = v["weight_map"].as_object_mut().unwrap();
    let (name, file) = map
        .iter()
        .next()
        .map(|(n, f)| (n.clone(), f.clone()))
        .unwrap();
    let other = if file == "model-00001-of-00002.safetensors" {
        "model-00002-of-00002.safetensors"
    } else {
        "model-00001-of-00002.safetensors"
    };
    map.insert(name.clone(), other.into());
    std::fs::write(t.path("model.safetensors.index.json"), v.to_string()).unwrap();
    expect_err(
        t.load(),
        &[&format!(
            "maps tensor '{name}' to {other}, which has no such tensor"
        )],
    );

    std::fs::write(t.path("model.safetensors.index.json"), "{\"metadata\": {}}").unwrap();
    expect_err(t.load(), &["model.safetensors.index.json", "'weight_map'"]);
}

#[test]
fn bad_config() {
    let t = TempCopy::of("llama2-tiny-f32");
    let cfg = std::fs::read_to_string(t.path("config.json")).unwrap();
    std::fs::write(
        t.path("config.json"),
        cfg.replace("\"hidden_size\": 64", "\"hidden_size\": \"sixty-four\""),
    )
    .unwrap();
    expect_err(
        t.load(),
        &["config.json", "field 'hidden_size'", "sixty-four"],
    );
    std::fs::write(
        t.path("config.json"),
        cfg.replace("\"num_hidden_layers\": 2,", ""),
    )
    .unwrap();
    expect_err(
        t.load(),
        &["config.json", "field 'num_hidden_layers' is missing"],
    );
    std::fs::write(t.path("config.json"), "{ not json").unwrap();
    expect_err(t.load(), &["config.json", "not valid JSON"]);
    std::fs::remove_file(t.path("config.json")).unwrap();
    let e = t.load().err().unwrap();
    assert!(
        matches!(e, Error::Io { ref path, .. } if path.ends_with("config.json")),
        "{e}"
    );
}

#[test]
fn missing_folder_or_weights() {
    expect_err(
        load_dir(Path::new("/nonexistent/graft-model")),
        &["/nonexistent/graft-model", "does not exist"],
    );
    let t = TempCopy::of("llama2-tiny-f32");
    std::fs::remove_file(t.path("model.safetensors")).unwrap();
    expect_err(
        t.load(),
        &["no model.safetensors or model.safetensors.index.json"],
    );
}

/// Errors of the inference API, checked on the host: a bad token id names itself, its
/// position and the vocabulary, for the forward pass and for a request; an empty prompt,
/// a prompt past the context; a request that fills the context exactly runs, one token
/// more is refused; the model and the engine stay usable.
#[test]
fn api_errors() {
    let mut be = CpuBackend::new();
    let be: &mut dyn Backend = &mut be;
    let opts = LoadOptions {
        ctx: Some(20),
        progress: false,
        ..LoadOptions::default()
    };
    let mut m = Model::load(&fixture("llama3-tiny-bf16"), be, &opts).unwrap();
    match m.forward(be, &[0, 5, 512, 7]) {
        Err(Error::IndexOutOfRange {
            index,
            position,
            limit,
            ..
        }) => {
            assert_eq!((index, position, limit), (512, 2, 512))
        }
        other => panic!(
            "expected a token id error, got {:?}",
            other.map(|o| o.argmax)
        ),
    }
    let e = m.forward(be, &[]).unwrap_err();
    assert!(e.to_string().contains("empty prompt"), "{e}");
    let e = m.forward(be, &[0; 21]).unwrap_err();
    assert!(e.to_string().contains("context of 20"), "{e}");
    assert_eq!(m.forward(be, &[0; 20]).unwrap().logits.len(), 20 * 512);
    m.release(be).unwrap();

    let mut e = engine(
        &fixture("llama3-tiny-bf16"),
        Box::new(CpuBackend::new()),
        &opts,
    );
    let err = e.add(Request::greedy(vec![0, 5, 9999], 3)).unwrap_err();
    assert!(
        err.to_string().contains("token 9999 at position 2"),
        "{err}"
    );
    let err = e.add(Request::greedy(vec![], 3)).unwrap_err();
    assert!(err.to_string().contains("prompt is empty"), "{err}");
    let err = e.add(Request::greedy(vec![0; 19], 2)).unwrap_err();
    assert!(
        err.to_string().contains("19 tokens") && err.to_string().contains("context of 20"),
        "{err}"
    );
    // Filling the context exactly works.
    let mut req = Request::greedy(vec![0; 19], 1);
    req.stop.ignore_eos = true;
    let r = run(&mut e, req);
    assert_eq!((r.tokens.len(), r.finish), (1, FinishReason::Length));
}

/// A run over many step shapes (prompts of every length bucket, greedy and sampled, so
/// with and without the device's candidates) builds more batch graphs than the engine
/// keeps: the least recently used ones are unloaded, so the loaded plans stay bounded,
/// and a greedy request gives the same tokens before and after the evictions.
#[test]
fn batch_plans_stay_bounded_over_a_long_run() {
    use graft::engine::runner::MAX_BATCH_PLANS;
    let opts = LoadOptions {
        ctx: Some(512),
        progress: false,
        ..LoadOptions::default()
    };
    let mut e = engine(
        &fixture("llama3-tiny-bf16"),
        Box::new(CpuBackend::new()),
        &opts,
    );
    // every prompt computed whole: each length its own shape
    e.set_prefix_cache(false);
    let prompt = |n: usize| -> Vec<u32> { (0..n).map(|i| (3 + i * 7 + n) as u32 % 500).collect() };
    let first = greedy(&mut e, &prompt(10), 4);
    for n in [1, 2, 3, 5, 9, 17, 33, 65, 129, 193, 257, 321, 385, 449] {
        greedy(&mut e, &prompt(n), 2);
        let mut req = Request::greedy(prompt(n), 2);
        req.sampling = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            seed: Some(n as u64),
            ..SamplingParams::greedy()
        };
        run(&mut e, req);
    }
    let (built, loaded) = e.plans();
    assert!(built > MAX_BATCH_PLANS, "only {built} shapes reached");
    assert_eq!(loaded, MAX_BATCH_PLANS);
    assert_eq!(greedy(&mut e, &prompt(10), 4), first);
}

/// A mixture of experts' checkpoint holds one tensor per expert: a missing expert, one of
/// another shape or dtype than its siblings, one too many, or a config whose expert
/// count or experts per token do not fit are errors naming the tensor or field.
#[test]
fn broken_experts() {
    let expert = "model.layers.1.mlp.experts.5.up_proj.weight";
    let t = TempCopy::of("qwen3moe-tiny-f32");
    t.edit("model.safetensors", |m| {
        m.remove(expert);
    });
    expect_err(t.load(), &[&format!("'{expert}' is missing"), "[32, 64]"]);

    let t = TempCopy::of("qwen3moe-tiny-f32");
    t.edit("model.safetensors", |m| {
        let (_, _, bytes) = m[expert].clone();
        m.insert(expert.into(), (Dtype::F32, vec![64, 32], bytes));
    });
    expect_err(
        t.load(),
        &[&format!("'{expert}' has shape [64, 32], expected [32, 64]")],
    );

    let t = TempCopy::of("qwen3moe-tiny-f32");
    t.edit("model.safetensors", |m| {
        let (_, shape, bytes) = m[expert].clone();
        let half: Vec<u8> = bytes.chunks(4).flat_map(|b| [b[2], b[3]]).collect();
        m.insert(expert.into(), (Dtype::BF16, shape, half));
    });
    expect_err(t.load(), &[expert, "the experts of a block need one dtype"]);

    let t = TempCopy::of("qwen3moe-tiny-f32");
    t.edit("model.safetensors", |m| {
        let extra = m[expert].clone();
        m.insert("model.layers.1.mlp.experts.8.up_proj.weight".into(), extra);
    });
    expect_err(
        t.load(),
        &["unexpected tensor 'model.layers.1.mlp.experts.8.up_proj.weight'"],
    );

    let t = TempCopy::of("mixtral-tiny-f32");
    t.edit_config(|c| c["num_local_experts"] = 6.into());
    expect_err(
        t.load(),
        &["num_local_experts", "6", "block_sparse_moe.gate.weight"],
    );
    let t = TempCopy::of("mixtral-tiny-f32");
    t.edit_config(|c| c["num_experts_per_tok"] = 9.into());
    expect_err(
        t.load(),
        &[
            "'num_local_experts' is 8 and 'num_experts_per_tok' is 9",
            "1 <= experts per token <= experts",
        ],
    );
    let t = TempCopy::of("qwen3moe-tiny-f32");
    t.edit_config(|c| c["mlp_only_layers"] = serde_json::json!([1]));
    expect_err(
        t.load(),
        &["mlp_only_layers", "every block is a mixture of experts"],
    );
}
