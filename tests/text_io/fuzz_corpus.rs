//! The fuzzers' seed corpora (`fuzz/corpus/<target>/seed-*`) and every regression they
//! found (`fuzz/regressions/<target>/*`), run through the same entry points as the
//! cargo-fuzz targets ([`graft::fuzz`]): none may panic, and the seeds that are valid
//! files must load, so a change that breaks the loaders shows here too.
//!
//! `cargo test --test text_io make_seeds -- --ignored` rewrites the seeds from the
//! committed fixtures.

use std::path::{Path, PathBuf};

use graft::fuzz::{join_pair, run, TARGETS};

use crate::fixtures;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of `fuzz/<kind>/<target>`, sorted (none when the folder is absent).
fn files(kind: &str, target: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(fuzz_dir().join(kind).join(target)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

#[test]
fn seeds_and_regressions_never_panic() {
    for target in TARGETS {
        let seeds = files("corpus", target);
        assert!(seeds.len() >= 2, "{target}: no seed corpus");
        let mut loaded = Vec::new();
        for path in seeds.iter().chain(&files("regressions", target)) {
            let name = path.file_name().unwrap().to_string_lossy();
            let data = match std::fs::read(path) {
                Ok(data) => data,
                // a fuzzer running meanwhile may replace corpus files it found; the
                // committed seeds (`seed-*`) and regressions must be there
                Err(_)
                    if !name.starts_with("seed-")
                        && path.starts_with(fuzz_dir().join("corpus")) =>
                {
                    continue
                }
                Err(e) => panic!("{}: {e}", path.display()),
            };
            if run(target, &data).is_ok() {
                loaded.push(path.file_name().unwrap().to_string_lossy().into_owned());
            }
        }
        // Seeds named `seed-ok-*` are valid inputs: they must load.
        for s in &seeds {
            let name = s.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("seed-ok-") {
                assert!(
                    loaded.contains(&name),
                    "{target}: valid seed {name} failed: {:?}",
                    run(target, &std::fs::read(s).unwrap())
                );
            }
        }
    }
}

/// Malformed variants of each valid seed (cut, bytes flipped) return errors, not panics.
#[test]
fn damaged_seeds_never_panic() {
    for target in TARGETS {
        for path in files("corpus", target) {
            // a fuzzer running meanwhile may replace corpus files it found (its own, not
            // the committed seeds): one that is gone since the listing is skipped
            let Ok(data) = std::fs::read(&path) else {
                continue;
            };
            for cut in [
                0,
                1,
                7,
                8,
                9,
                24,
                data.len() / 2,
                data.len().saturating_sub(1),
            ] {
                let _ = run(target, &data[..cut.min(data.len())]);
            }
            for at in (0..data.len()).step_by(data.len() / 64 + 1) {
                let mut d = data.clone();
                d[at] ^= 0xff;
                let _ = run(target, &d);
            }
        }
    }
}

/// A config of the shape of the fixture llama3-tiny-bf16, shrunk: 1 layer, width 8.
fn mini_config() -> serde_json::Value {
    let text =
        std::fs::read_to_string(fixtures::fixture("llama3-tiny-bf16").join("config.json")).unwrap();
    let mut c: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (k, v) in [
        ("hidden_size", 8),
        ("intermediate_size", 16),
        ("num_hidden_layers", 1),
        ("num_attention_heads", 2),
        ("num_key_value_heads", 1),
        ("head_dim", 4),
        ("vocab_size", 16),
        ("max_position_embeddings", 32),
    ] {
        c[k] = v.into();
    }
    c["eos_token_id"] = 1.into();
    c["rope_parameters"]["original_max_position_embeddings"] = 16.into();
    c
}

/// The safetensors file of [`mini_config`]: F32 values taken from the fixture's bytes.
fn mini_safetensors() -> Vec<u8> {
    use safetensors::tensor::TensorView;
    let shapes: [(&str, Vec<usize>); 9] = [
        ("model.embed_tokens.weight", vec![16, 8]),
        ("model.norm.weight", vec![8]),
        ("model.layers.0.input_layernorm.weight", vec![8]),
        ("model.layers.0.post_attention_layernorm.weight", vec![8]),
        ("model.layers.0.self_attn.q_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.k_proj.weight", vec![4, 8]),
        ("model.layers.0.self_attn.v_proj.weight", vec![4, 8]),
        ("model.layers.0.self_attn.o_proj.weight", vec![8, 8]),
        ("model.layers.0.mlp.gate_proj.weight", vec![16, 8]),
    ];
    let more = [
        ("model.layers.0.mlp.up_proj.weight", vec![16, 8]),
        ("model.layers.0.mlp.down_proj.weight", vec![8, 16]),
    ];
    let datas: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .chain(more)
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = (0..n)
                .map(|j| (((i * 31 + j * 7) % 23) as f32 - 11.0) / 20.0)
                .collect();
            (
                name.to_string(),
                shape,
                bytemuck::cast_slice(&vals).to_vec(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView)> = datas
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// A GGUF copy of `gguf` holding only its metadata (no tensors).
fn metadata_only(path: &Path) -> Vec<u8> {
    let f = graft::gguf::GgufFile::open(path).unwrap();
    let mut w = graft::gguf::GgufWriter::new();
    for (k, v) in f.metadata().iter() {
        w.metadata_mut().insert(k, v.clone());
    }
    w.to_bytes().unwrap()
}

/// Writes the seed corpora from the fixtures (run by hand, see the module docs).
#[test]
#[ignore]
fn make_seeds() {
    let corpus = fuzz_dir().join("corpus");
    let put = |target: &str, name: &str, data: &[u8]| {
        let d = corpus.join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(name), data).unwrap();
    };
    let config = mini_config().to_string();
    let st = mini_safetensors();
    put(
        "safetensors_config",
        "seed-ok-mini",
        &join_pair(config.as_bytes(), &st),
    );
    let fx = fixtures::fixture("llama3-tiny-bf16");
    let fixture_cfg = std::fs::read(fx.join("config.json")).unwrap();
    let fixture_st = std::fs::read(fx.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(fixture_st[..8].try_into().unwrap()) as usize;
    put(
        "safetensors_config",
        "seed-fixture-header",
        &join_pair(&fixture_cfg, &fixture_st[..8 + n + 256]),
    );

    let tmp = std::env::temp_dir().join(format!("graft-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("config.json"), &config).unwrap();
    std::fs::write(tmp.join("model.safetensors"), &st).unwrap();
    std::fs::copy(fx.join("tokenizer.json"), tmp.join("tokenizer.json")).unwrap();
    let g = tmp.join("mini.gguf");
    graft::models::convert::convert(&tmp, graft::models::QuantPlan::Q8_0, &g, Some("mini"))
        .unwrap();
    put("gguf_tokenizer", "seed-ok-llama3-gpt2", &metadata_only(&g));
    std::fs::remove_file(tmp.join("tokenizer.json")).unwrap();
    graft::models::convert::convert(&tmp, graft::models::QuantPlan::F32, &g, Some("mini")).unwrap();
    put("gguf", "seed-ok-mini-f32", &std::fs::read(&g).unwrap());
    let l2 = fixtures::fixture("llama2-tiny-f32");
    std::fs::copy(l2.join("tokenizer.json"), tmp.join("tokenizer.json")).unwrap();
    graft::models::convert::convert(&tmp, graft::models::QuantPlan::F32, &g, Some("mini")).unwrap();
    put("gguf_tokenizer", "seed-ok-llama2-spm", &metadata_only(&g));
    for name in ["aligned-1", "aligned-64", "all-values"] {
        let p = fixtures::fixture("gguf").join(format!("{name}.gguf"));
        put("gguf", &format!("seed-{name}"), &std::fs::read(p).unwrap());
    }
    let _ = std::fs::remove_dir_all(&tmp);

    let smol =
        std::fs::read_to_string(fixtures::fixture("tokenizer/smollm2-135m-instruct.json")).unwrap();
    let smol: serde_json::Value = serde_json::from_str(&smol).unwrap();
    let templates = [
        ("seed-ok-chatml", graft::models::text::chat::CHATML.to_string()),
        ("seed-ok-smollm2", smol["spec"]["chat_template"].as_str().unwrap().to_string()),
        ("seed-ok-llama3", "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% set c = m.content | trim %}{% else %}{% set c = m.content %}{% endif %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ c }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}".to_string()),
        ("seed-raise", "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ messages | length }}".to_string()),
    ];
    for (name, t) in templates {
        put("chat_template", name, t.as_bytes());
    }
}
