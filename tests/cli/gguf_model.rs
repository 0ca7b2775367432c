//! GGUF models: the committed HF fixtures converted by `graft convert` and loaded back
//! (`Model::load` on a `.gguf` path), and GGUF files with a missing tensor, a wrong
//! shape, an unsupported type or a missing key.
//!
//! The round trip goes through llama.cpp's layout (Q/K rows permuted for its rope,
//! un-permuted by graft's loader), so equal logits prove both permutations and every
//! metadata key graft reads back. F32 reproduces the HF folder's logits (NMSE <= 1e-10;
//! BF16 and F32 weights differ only in summation order); F16 stays within the F16
//! fixture's limit against HF's float32 logits (1e-5); a quantized file gives exactly
//! the logits of the HF folder loaded with `--quantize` of the same type (the same bytes).

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use graft::backend::cpu::CpuBackend;
use graft::backend::Backend;
use graft::gguf::{GgmlType, GgufFile, GgufWriter};
use graft::models::convert::convert;
use graft::models::{LoadOptions, Model, QuantPlan};

use reference::{has_experts, nmse, reference, FIXTURES};

use crate::{fixtures, reference};

/// A scratch file removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("graft-gguf-{}-{tag}.gguf", std::process::id()));
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn load(be: &mut dyn Backend, path: &Path, quantize: Option<QuantPlan>) -> graft::Result<Model> {
    let opts = LoadOptions {
        ctx: Some(64),
        progress: false,
        quantize,
        ..LoadOptions::default()
    };
    Model::load(path, be, &opts)
}

/// The prompt logits of the model at `path`.
fn logits(be: &mut dyn Backend, path: &Path, q: Option<QuantPlan>, tokens: &[u32]) -> Vec<f32> {
    let mut m = load(be, path, q).unwrap_or_else(|e| panic!("{e}"));
    let out = m.forward(be, tokens).unwrap().logits;
    m.release(be).unwrap();
    out
}

#[test]
fn hf_to_gguf_round_trip() {
    let mut be = CpuBackend::new();
    let be: &mut dyn Backend = &mut be;
    for name in FIXTURES {
        let r = reference(name);
        let hf = logits(be, &r.dir, None, &r.tokens);
        for plan in [
            QuantPlan::F32,
            QuantPlan::F16,
            QuantPlan::Q8_0,
            QuantPlan::Q4_0,
            QuantPlan::Q4_K_M,
            QuantPlan::Q6_K,
        ] {
            let out = Scratch::new(&format!("{name}-{plan}"));
            convert(&r.dir, plan, &out.0, None).unwrap();
            // the architecture and its settings come back from the metadata
            let (a, b) = (
                load(be, &r.dir, None).unwrap(),
                load(be, &out.0, None).unwrap(),
            );
            let (ca, cb) = (a.config(), b.config());
            assert_eq!(
                (
                    ca.arch,
                    ca.sliding_window,
                    ca.head_dim,
                    ca.tie_word_embeddings
                ),
                (
                    cb.arch,
                    cb.sliding_window,
                    cb.head_dim,
                    cb.tie_word_embeddings
                ),
                "{name} {plan}"
            );
            assert_eq!((ca.norm_eps, ca.rope_theta), (cb.norm_eps, cb.rope_theta));
            a.release(be).unwrap();
            b.release(be).unwrap();
            let got = logits(be, &out.0, None, &r.tokens);
            let vs_hf = nmse(&got, &r.logits);
            let vs_folder = nmse(&got, &hf);
            println!(
                "{name} {plan}: GGUF vs HF folder {vs_folder:.2e}, vs HF reference {vs_hf:.2e}"
            );
            match plan {
                QuantPlan::F32 => assert!(vs_folder <= 1e-10, "{name}: {vs_folder:e}"),
                // F16 weights move a mixture of experts' router logits by about 1e-3,
                // enough to change an expert somewhere (HF's own F16 run would too): the
                // GGUF file is held to the same F16 model loaded from the folder instead
                QuantPlan::F16 if !has_experts(name) => {
                    assert!(vs_hf <= 1e-5, "{name}: {vs_hf:e}")
                }
                QuantPlan::F16
                | QuantPlan::BF16
                | QuantPlan::Q8_0
                | QuantPlan::Q4_0
                | QuantPlan::Q4_1
                | QuantPlan::Q5_0
                | QuantPlan::Q5_1
                | QuantPlan::Q4_K
                | QuantPlan::Q5_K
                | QuantPlan::Q6_K
                | QuantPlan::Q4_K_M
                | QuantPlan::Q5_K_M
                | QuantPlan::Q2_K
                | QuantPlan::Q3_K_S
                | QuantPlan::Q3_K_M
                | QuantPlan::Q3_K_L
                | QuantPlan::IQ4_NL
                | QuantPlan::IQ4_XS => {
                    let q = logits(be, &r.dir, Some(plan), &r.tokens);
                    let e = nmse(&got, &q);
                    assert!(e <= 1e-12, "{name} {plan}: GGUF vs --quantize {e:e}");
                }
            }
        }
    }
}

/// The file graft writes: llama.cpp's names, types, keys and tokenizer metadata.
#[test]
fn converted_file_has_llama_cpp_metadata() {
    let out = Scratch::new("meta");
    let dir = fixtures::fixture("llama3-tiny-bf16");
    convert(&dir, QuantPlan::Q4_K_M, &out.0, Some("tiny")).unwrap();
    let f = GgufFile::open(&out.0).unwrap();
    let m = f.metadata();
    assert_eq!(m.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(m.get_str("general.name").unwrap(), "tiny");
    assert_eq!(m.get_u32("general.file_type").unwrap(), 15);
    assert_eq!(m.get_u32("general.alignment").unwrap(), 32);
    assert_eq!(m.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(m.get_u32("llama.attention.head_count_kv").unwrap(), 2);
    assert_eq!(m.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(m.get_str("tokenizer.ggml.pre").unwrap(), "gpt-2");
    assert_eq!(m.get_array_str("tokenizer.ggml.tokens").unwrap().len(), 512);
    assert!(f.tensor("output.weight").is_none(), "tied embeddings");
    assert_eq!(f.tensor("rope_freqs.weight").unwrap().dims, [8]);
    assert_eq!(f.tensor("token_embd.weight").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(f.tensor("blk.1.attn_v.weight").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(f.tensor("blk.0.attn_v.weight").unwrap().ty, GgmlType::Q5_0);
    assert_eq!(
        f.tensor("blk.0.attn_norm.weight").unwrap().ty,
        GgmlType::F32
    );
    assert_eq!(f.tensor("blk.0.attn_q.weight").unwrap().dims, [64, 128]);
}

/// The `convert` subcommand writes the same file as the library call.
#[test]
fn convert_command_line() {
    let out = Scratch::new("cli");
    let dir = fixtures::fixture("llama2-tiny-f32");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["convert", "--quiet", "--type", "q8_0", "--model"])
        .arg(&dir)
        .arg("--out")
        .arg(&out.0)
        .status()
        .unwrap();
    assert!(status.success());
    let f = GgufFile::open(&out.0).unwrap();
    assert_eq!(f.metadata().get_u32("general.file_type").unwrap(), 7);
    assert_eq!(
        f.metadata().get_str("tokenizer.ggml.model").unwrap(),
        "llama"
    );
}

/// Rewrites GGUF `src` into `dst` with `edit` applied to each tensor (name, dims, type,
/// bytes; `None` drops it) and key `drop_key` left out.
fn rewrite(
    src: &Path,
    dst: &Path,
    drop_key: Option<&str>,
    edit: impl Fn(&str, Vec<u64>, GgmlType, Vec<u8>) -> Option<(Vec<u64>, GgmlType, Vec<u8>)>,
) {
    let f = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata().iter() {
        if Some(k) != drop_key {
            w.metadata_mut().insert(k, v.clone());
        }
    }
    for t in f.tensors() {
        let bytes = f.tensor_bytes(&t.name).unwrap().to_vec();
        if let Some((dims, ty, data)) = edit(&t.name, t.dims.clone(), t.ty, bytes) {
            w.add_tensor(&t.name, &dims, ty, Cow::Owned(data)).unwrap();
        }
    }
    w.write_file(dst).unwrap();
}

fn expect_err(r: graft::Result<Model>, needles: &[&str]) {
    let msg = match r {
        Ok(_) => panic!("loading succeeded, expected an error mentioning {needles:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

#[test]
fn bad_gguf_files_name_what_is_wrong() {
    let mut be = CpuBackend::new();
    let be: &mut dyn Backend = &mut be;
    let good = Scratch::new("good");
    convert(
        &fixtures::fixture("llama2-tiny-f32"),
        QuantPlan::F32,
        &good.0,
        None,
    )
    .unwrap();
    let bad = Scratch::new("bad");
    let keep = |_: &str, d, t, b| Some((d, t, b));
    rewrite(&good.0, &bad.0, None, |n, d, t, b| {
        (n != "blk.1.ffn_up.weight").then_some((d, t, b))
    });
    expect_err(
        load(be, &bad.0, None),
        &["'blk.1.ffn_up.weight'", "missing"],
    );
    rewrite(&good.0, &bad.0, None, |n, d, t, b| {
        Some(if n == "blk.0.attn_k.weight" {
            (vec![32, 128], t, b)
        } else {
            (d, t, b)
        })
    });
    expect_err(
        load(be, &bad.0, None),
        &["'blk.0.attn_k.weight'", "[32, 128]", "[64, 64]"],
    );
    rewrite(&good.0, &bad.0, None, |n, d, t, b| {
        Some(if n == "blk.0.ffn_gate.weight" {
            let n = b.len() / 4;
            (d, GgmlType::I8, vec![0u8; n])
        } else {
            (d, t, b)
        })
    });
    expect_err(load(be, &bad.0, None), &["'blk.0.ffn_gate.weight'", "I8"]);
    for key in [
        "llama.block_count",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.embedding_length",
    ] {
        rewrite(&good.0, &bad.0, Some(key), keep);
        expect_err(load(be, &bad.0, None), &[key]);
    }
    rewrite(&good.0, &bad.0, None, keep);
    assert!(load(be, &bad.0, None).is_ok(), "an unchanged copy loads");
}

/// GGUF files split over simulated devices: the loader un-permutes llama's Q/K rows and
/// separates GPT-2's fused q|k|v on the whole tensor before cutting each device's part,
/// and a Q8_0 file's blocks are cut on block boundaries without conversion (a cut inside
/// a block is an error naming the tensor). Split and
/// unsplit logits agree to summation order (F32 file) or exactly up to the Q8_1
/// activation rounding (Q8_0 file, measured 0).
#[test]
fn gguf_files_split_over_devices() {
    use graft::backend::group::DeviceGroup;
    for (name, plan) in [
        ("llama2-tiny-f32", QuantPlan::F32),
        ("qwen3-tiny-f32", QuantPlan::F32),
        ("gpt2-tiny-f32", QuantPlan::F32),
        ("llama2-tiny-f32", QuantPlan::Q8_0),
    ] {
        let r = reference(name);
        let out = Scratch::new(&format!("tp-{name}-{}", plan.name()));
        convert(&r.dir, plan, &out.0, None).unwrap();
        let want = logits(&mut CpuBackend::new(), &out.0, None, &r.tokens);
        for n in [2, 4] {
            let mut group = DeviceGroup::cpu(n).unwrap();
            if plan == QuantPlan::Q8_0 && n == 4 {
                // attn_output's rows of 64 would be cut into 16s inside 32-element blocks
                let e = load(&mut group, &out.0, None).err().unwrap().to_string();
                assert!(
                    e.contains("blk.0.attn_output.weight") && e.contains("32-element blocks"),
                    "{e}"
                );
                continue;
            }
            let got = logits(&mut group, &out.0, None, &r.tokens);
            let e = nmse(&got, &want);
            println!("{name} {} tp={n}: NMSE {e:.2e}", plan.name());
            assert!(e <= 1e-6, "{name} {} tp={n}: NMSE {e:e}", plan.name());
        }
    }
}
