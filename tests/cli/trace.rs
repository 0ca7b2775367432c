//! `graft trace` and the trace library (`graft::models::runtime::trace`): graft's own trace has
//! every documented name in order with the documented shapes and the logits of a plain
//! prefill; a trace written with `--out` reads back whole; a fixture with two weights of
//! one layer swapped diverges exactly at that layer's MLP output, against graft's trace of
//! the unbroken model and against the HF transformers trace (`scripts/hf-trace.py`); the
//! unbroken models agree with HF's traces; and, with a GPU, the CPU and CUDA traces agree.

use std::path::Path;
use std::process::{Command, Output};

use graft::backend::cpu::CpuBackend;
use graft::graph::DType;
use graft::models::blocks::TRACE_NAMES;
use graft::models::runtime::trace::{self, compare, Trace, ORDER_KEY, SOURCE_KEY, TOKENS_KEY};
use graft::models::{CacheTypes, Config, LoadOptions, Model, TraceTensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::fixtures::{fixture, TempCopy};

/// The HF trace of a fixture, made by scripts/hf-trace.py (may not exist yet).
const HF_TRACE: &str = "trace.safetensors";

/// The prompt ids of a fixture (its reference.json).
fn tokens(name: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    j["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn graft(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(args)
        .output()
        .expect("run graft")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `graft trace` with `args` and `--json`, expecting exit status `code`; returns the
/// report.
fn trace_json(args: &[&str], code: i32) -> serde_json::Value {
    let mut all = vec!["trace", "--quiet", "--json"];
    all.extend_from_slice(args);
    let o = graft(&all);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "graft {all:?}: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("error:"),
        "{err}"
    );
    serde_json::from_str(text(&o.stdout).trim()).unwrap()
}

/// Loads fixture folder `dir` on `be` with the given cache.
fn load(be: &mut CpuBackend, dir: &Path, n: usize, cache: CacheTypes) -> Model {
    let opts = LoadOptions {
        ctx: Some(n),
        progress: false,
        cache,
        ..LoadOptions::default()
    };
    Model::load(dir, be, &opts).unwrap()
}

/// The size a `TRACE_NAMES` layout symbol stands for.
fn dim(sym: &str, cfg: &Config, n: usize) -> usize {
    match sym.trim() {
        "n" => n,
        "n_embd" => cfg.hidden_size,
        "n_head" => cfg.num_attention_heads,
        "n_kv_head" => cfg.num_key_value_heads,
        "head_dim" => cfg.head_dim,
        "n_head * head_dim" => cfg.num_attention_heads * cfg.head_dim,
        "vocab" => cfg.vocab_size,
        other => panic!("TRACE_NAMES layout symbol {other:?} unknown to this test"),
    }
}

/// The documented names and shapes of a trace, in execution order.
fn documented(cfg: &Config, n: usize) -> Vec<(String, Vec<usize>)> {
    let shape = |layout: &str| -> Vec<usize> {
        let inner = &layout[1..layout.find(']').unwrap()];
        inner.split(", ").map(|s| dim(s, cfg, n)).collect()
    };
    let mut want = vec![(TRACE_NAMES[0].0.to_string(), shape(TRACE_NAMES[0].1))];
    let (layer, head): (Vec<_>, Vec<_>) = TRACE_NAMES[1..]
        .iter()
        .partition(|(name, _)| name.contains("{i}"));
    for i in 0..cfg.num_hidden_layers {
        for (name, layout) in &layer {
            want.push((name.replace("{i}", &i.to_string()), shape(layout)));
        }
    }
    want.extend(head.iter().map(|(name, l)| (name.to_string(), shape(l))));
    want
}

fn nmse(a: &[f32], b: &[f32]) -> f64 {
    trace::diff(a, b).nmse
}

#[test]
fn own_trace_has_every_documented_tensor_and_the_prefill_logits() {
    let name = "llama2-tiny-f32";
    let ids = tokens(name);
    let n = ids.len();
    let mut be = CpuBackend::new();
    let mut model = load(&mut be, &fixture(name), n, CacheTypes::default());
    let got = model.trace(&mut be, &ids).unwrap();
    let want = documented(model.config(), n);
    assert_eq!(want.len(), 1 + 10 * model.config().num_hidden_layers + 2);
    let got_names: Vec<(String, Vec<usize>)> = got
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    assert_eq!(got_names, want);
    for t in &got {
        assert_eq!(
            t.data.len(),
            t.shape.iter().product::<usize>(),
            "{}",
            t.name
        );
        assert!(t.data.iter().all(|x| x.is_finite()), "{}", t.name);
    }

    let out = model.forward(&mut be, &ids).unwrap();
    let logits = &got.last().unwrap().data;
    let e = nmse(logits, &out.logits);
    assert!(
        logits == &out.logits || e < 1e-12,
        "trace vs prefill logits: nmse {e:.2e}"
    );
}

#[test]
fn out_file_round_trips() {
    let name = "llama2-tiny-f32";
    let ids = tokens(name);
    let t = TempCopy::of(name);
    let out = t.path("graft-trace.safetensors");
    let o = graft(&[
        "trace",
        "--model",
        t.dir(),
        "--tokens",
        &csv(&ids),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(o.stdout.is_empty(), "--out printed {}", text(&o.stdout));

    // Read with the safetensors crate directly, then through the library.
    let bytes = std::fs::read(&out).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta[TOKENS_KEY], csv(&ids));
    assert_eq!(meta[SOURCE_KEY], format!("graft {} cpu", t.dir()));
    let mut be = CpuBackend::new();
    let want = load(
        &mut be,
        Path::new(t.dir()),
        ids.len(),
        CacheTypes::default(),
    )
    .trace(&mut be, &ids)
    .unwrap();
    let order: Vec<&str> = want.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(meta[ORDER_KEY], order.join(","));
    assert_eq!(st.len(), want.len());
    for w in &want {
        let v = st.tensor(&w.name).unwrap();
        assert_eq!(v.dtype(), Dtype::F32, "{}", w.name);
        assert_eq!(v.shape(), w.shape.as_slice(), "{}", w.name);
    }
    let read = Trace::read(&out).unwrap();
    assert_eq!(read.tokens, ids);
    assert_eq!(read.tensors.len(), want.len());
    for (r, w) in read.tensors.iter().zip(&want) {
        assert_eq!((&r.name, &r.shape), (&w.name, &w.shape));
        let e = nmse(&r.data, &w.data);
        assert!(r.data == w.data || e < 1e-12, "{}: nmse {e:.2e}", r.name);
    }
    // The same trace is the same bytes.
    assert_eq!(read.to_safetensors().unwrap(), bytes);
}

/// Swaps two tensors of equal shape in a copy's model.safetensors.
fn swap_tensors(t: &TempCopy, a: &str, b: &str) {
    let path = t.path("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView)> = st.tensors();
    let ia = tensors.iter().position(|(n, _)| n == a).unwrap();
    let ib = tensors.iter().position(|(n, _)| n == b).unwrap();
    assert_eq!(tensors[ia].1.shape(), tensors[ib].1.shape());
    let (va, vb) = (tensors[ia].1.clone(), tensors[ib].1.clone());
    tensors[ia].1 = vb;
    tensors[ib].1 = va;
    std::fs::write(&path, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

/// Checks a report of the broken copy: exit 1, the first divergence at `blk.1.ffn_out`,
/// every tensor before it within the threshold.
fn assert_diverges_at_layer_1_mlp(report: &serde_json::Value) {
    let first = &report["first_divergence"];
    assert_eq!(first["name"], "blk.1.ffn_out", "{report}");
    assert!(first["nmse"].as_f64().unwrap() > 1e-2, "{first}");
    assert!(first["position"]["token"].is_u64(), "{first}");
    for s in ["ours", "reference"] {
        assert!(first["stats"][s]["rms"].as_f64().unwrap() > 0.0, "{first}");
    }
    let compared = report["compared"].as_array().unwrap();
    let at = compared
        .iter()
        .position(|c| c["name"] == "blk.1.ffn_out")
        .unwrap();
    for c in &compared[..at] {
        assert_eq!(c["diverged"], false, "{c}");
    }
    assert_eq!(at, 1 + 10 + 8, "blk.1.ffn_out is the 20th tensor");
}

const LLAMA_GATE: &str = "model.layers.1.mlp.gate_proj.weight";
const LLAMA_UP: &str = "model.layers.1.mlp.up_proj.weight";

#[test]
fn swapped_layer_weights_diverge_at_that_layers_mlp() {
    let name = "llama2-tiny-f32";
    let ids = csv(&tokens(name));
    let t = TempCopy::of(name);
    let good = t.path("graft-trace.safetensors");
    let good = good.to_str().unwrap();
    let o = graft(&[
        "trace",
        "--model",
        t.dir(),
        "--tokens",
        &ids,
        "--out",
        good,
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));

    // Unbroken against its own trace: bit-equal, exit 0.
    let r = trace_json(
        &["--model", t.dir(), "--tokens", &ids, "--against", good],
        0,
    );
    assert!(r["first_divergence"].is_null(), "{r}");
    assert_eq!(r["compared"].as_array().unwrap().len(), 23);
    assert!(r["not_compared"].as_array().unwrap().is_empty());
    assert!(r["compared"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["nmse"] == 0.0));

    swap_tensors(&t, LLAMA_GATE, LLAMA_UP);
    let r = trace_json(
        &["--model", t.dir(), "--tokens", &ids, "--against", good],
        1,
    );
    assert_diverges_at_layer_1_mlp(&r);

    // The text report: lines up to the divergence, then its block; exit 1, no error.
    let o = graft(&[
        "trace",
        "--model",
        t.dir(),
        "--tokens",
        &ids,
        "--against",
        good,
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let out = text(&o.stdout);
    assert!(o.stderr.is_empty(), "{}", text(&o.stderr));
    assert!(
        out.contains("first divergence: blk.1.ffn_out [15, 64]"),
        "{out}"
    );
    assert!(out.contains("largest |diff|"), "{out}");
    let marked: Vec<&str> = out.lines().filter(|l| l.ends_with("<- diverges")).collect();
    assert_eq!(marked.len(), 1, "{out}");
    assert!(marked[0].starts_with("blk.1.ffn_out "), "{out}");
    assert!(
        !out.contains("\nblk.1.out "),
        "lines stop at the divergence: {out}"
    );
    eprintln!("{out}");
}

/// Fixtures whose HF trace (scripts/hf-trace.py) is present.
fn with_hf_trace() -> Vec<&'static str> {
    let all = [
        "llama2-tiny-f32",
        "llama3-tiny-bf16",
        "llama3-tiny-f16",
        "mistral-tiny-f32",
        "qwen2-tiny-f32",
        "qwen3-tiny-f32",
        "qwen3-tiny-bf16",
        "gpt2-tiny-f32",
        "qwen3moe-tiny-f32",
        "qwen3moe-tiny-bf16",
        "mixtral-tiny-f32",
    ];
    all.into_iter()
        .filter(|n| {
            let here = fixture(n).join(HF_TRACE).is_file();
            if !here {
                eprintln!("{n}: skipped: no {HF_TRACE} (scripts/hf-trace.py makes it)");
            }
            here
        })
        .collect()
}

/// With an F32 KV cache graft computes what HF's float32 forward does, up to summation
/// order: measured NMSE <= 2e-12 on every tensor of every fixture (largest at a layer-1
/// attention or MLP output), so 1e-5 leaves a wide margin.
#[test]
fn graft_matches_the_hf_traces() {
    for name in with_hf_trace() {
        let dir = fixture(name);
        let ids = csv(&tokens(name));
        let against = dir.join(HF_TRACE);
        let r = trace_json(
            &[
                "--model",
                dir.to_str().unwrap(),
                "--tokens",
                &ids,
                "--against",
                against.to_str().unwrap(),
                "--cache-type-k",
                "f32",
                "--cache-type-v",
                "f32",
                "--threshold",
                "1e-5",
            ],
            0,
        );
        assert!(r["first_divergence"].is_null(), "{name}: {r}");
        let compared = r["compared"].as_array().unwrap();
        assert!(compared.len() >= 23, "{name}: {r}");
        assert!(
            r["not_compared"].as_array().unwrap().is_empty(),
            "{name}: {r}"
        );
        let worst = compared
            .iter()
            .max_by(|a, b| {
                a["nmse"]
                    .as_f64()
                    .unwrap()
                    .total_cmp(&b["nmse"].as_f64().unwrap())
            })
            .unwrap();
        eprintln!(
            "{name}: largest nmse {} at {}",
            worst["nmse"], worst["name"]
        );
    }
}

#[test]
fn swapped_layer_weights_diverge_against_the_hf_trace() {
    let name = "qwen3-tiny-f32";
    if !fixture(name).join(HF_TRACE).is_file() {
        eprintln!("{name}: skipped: no {HF_TRACE} (scripts/hf-trace.py makes it)");
        return;
    }
    let ids = csv(&tokens(name));
    let t = TempCopy::of(name);
    swap_tensors(&t, LLAMA_GATE, LLAMA_UP);
    let against = t.path(HF_TRACE);
    let r = trace_json(
        &[
            "--model",
            t.dir(),
            "--tokens",
            &ids,
            "--against",
            against.to_str().unwrap(),
            "--cache-type-k",
            "f32",
            "--cache-type-v",
            "f32",
            "--threshold",
            "1e-5",
        ],
        1,
    );
    assert_diverges_at_layer_1_mlp(&r);
}

#[test]
fn against_checks_the_file_and_its_tokens() {
    let name = "llama2-tiny-f32";
    let dir = fixture(name);
    let t = TempCopy::of(name);
    let good = t.path("good.safetensors");
    let o = graft(&[
        "trace",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--out",
        good.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let fails = |args: &[&str], needles: &[&str]| {
        let mut all = vec!["trace", "--model", dir.to_str().unwrap(), "--quiet"];
        all.extend_from_slice(args);
        let o = graft(&all);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{all:?}: {err}");
        assert!(
            err.starts_with("error: ") && !err.contains("panicked"),
            "{err}"
        );
        assert!(o.stdout.is_empty(), "{all:?}: {}", text(&o.stdout));
        for n in needles {
            assert!(err.contains(n), "{all:?}: {err:?} lacks {n:?}");
        }
    };
    let good = good.to_str().unwrap();
    fails(
        &["--tokens", "1,2,4", "--against", good],
        &[good, "other tokens", "[1, 2, 3]", "[1, 2, 4]"],
    );
    let weights = t.path("model.safetensors");
    let weights = weights.to_str().unwrap();
    fails(
        &["--tokens", "1,2,3", "--against", weights],
        &[weights, TOKENS_KEY],
    );
    let config = t.path("config.json");
    let config = config.to_str().unwrap();
    fails(
        &["--tokens", "1,2,3", "--against", config],
        &[config, "not a safetensors file"],
    );
    fails(
        &[
            "--tokens",
            "1,2,3",
            "--against",
            "/nonexistent/t.safetensors",
        ],
        &["/nonexistent"],
    );
    // --out never overwrites an input: the model's files, or the --against file.
    let model_file = dir.join("model.safetensors");
    fails(
        &["--tokens", "1,2,3", "--out", model_file.to_str().unwrap()],
        &["refusing to overwrite"],
    );
    fails(
        &["--tokens", "1,2,3", "--against", good, "--out", good],
        &["refusing to overwrite", good],
    );
    fails(
        &["--tokens", "1,2,3", "--threshold", "-1"],
        &["--threshold"],
    );
    fails(
        &["--tokens", "1,2,3", "--backends", "cpu,cpu,cpu"],
        &["--backends"],
    );
    fails(
        &[
            "--tokens",
            "1,2,3",
            "--backends",
            "cpu,cpu",
            "--against",
            good,
        ],
        &["--against"],
    );
    #[cfg(not(feature = "cuda"))]
    fails(
        &["--tokens", "1,2,3", "--backends", "cpu,cuda"],
        &["--features cuda"],
    );
}

#[test]
fn two_cpu_runs_agree_and_the_summary_lists_every_tensor() {
    let dir = fixture("llama2-tiny-f32");
    let r = trace_json(
        &[
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--backends",
            "cpu,cpu",
        ],
        0,
    );
    assert!(r["first_divergence"].is_null(), "{r}");
    let o = graft(&[
        "trace",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hello",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert_eq!(out.lines().count(), 2 + 23, "{out}");
    assert!(out.lines().nth(2).unwrap().starts_with("embd "), "{out}");
}

fn tensor(name: &str, shape: &[usize], data: &[f32]) -> TraceTensor {
    TraceTensor {
        name: name.into(),
        shape: shape.to_vec(),
        data: data.to_vec(),
    }
}

#[test]
fn nmse_and_divergence_rules() {
    // Zero reference: 0 when equal, infinite otherwise; NaN anywhere diverges.
    assert_eq!(trace::diff(&[0.0, 0.0], &[0.0, 0.0]).nmse, 0.0);
    assert_eq!(trace::diff(&[0.0, 1.0], &[0.0, 0.0]).nmse, f64::INFINITY);
    let d = trace::diff(&[1.0, f32::NAN, 5.0], &[1.0, 2.0, 3.0]);
    assert!(d.nmse.is_nan());
    assert_eq!(
        d.at,
        Some(1),
        "the non-finite difference is the one to show"
    );
    let d = trace::diff(&[1.0, 2.0, 4.0, 0.0], &[1.0, 2.0, 3.0, 1.0]);
    assert!((d.nmse - 2.0 / 15.0).abs() < 1e-15);
    assert_eq!((d.max_abs, d.at), (1.0, Some(2)));

    let reference = [
        tensor("a", &[2, 2], &[1.0, 2.0, 3.0, 4.0]),
        tensor("b", &[2, 2], &[1.0, 2.0, 3.0, 4.0]),
        tensor("c", &[2, 2], &[1.0, 2.0, 3.0, 4.0]),
        tensor("theirs", &[1], &[1.0]),
    ];
    let ours = [
        tensor("a", &[2, 2], &[1.0, 2.0, 3.0, 4.0]),
        tensor("mine", &[1], &[1.0]),
        tensor("b", &[2, 2], &[1.0, 2.0, 3.0, 5.0]),
        tensor("c", &[4], &[1.0, 2.0, 3.0, 4.0]),
    ];
    let c = compare(&ours, &reference, 1e-4);
    assert_eq!(c.first_divergence, Some(1));
    let b = c.divergence().unwrap();
    assert_eq!(b.name, "b");
    let p = b.position.unwrap();
    assert_eq!((p.token, p.flat, p.ours, p.reference), (1, 3, 5.0, 4.0));
    assert!(
        c.compared[2].diverged && c.compared[2].diff.is_none(),
        "shape mismatch"
    );
    assert_eq!(c.only_ours, ["mine"]);
    assert_eq!(c.only_reference, ["theirs"]);
    let s = trace::stats(&[1.0, f32::INFINITY, 3.0]);
    assert_eq!((s.mean, s.min, s.max, s.non_finite), (2.0, 1.0, 3.0, 1));
    assert!((s.rms - 5f64.sqrt()).abs() < 1e-12 && (s.std - 1.0).abs() < 1e-12);
}

#[test]
fn trace_files_are_checked() {
    let t = Trace {
        tensors: vec![tensor("a", &[1, 2], &[1.0, 2.0]), tensor("b", &[1], &[3.0])],
        tokens: vec![7],
        source: "test".into(),
    };
    let bytes = t.to_safetensors().unwrap();
    assert_eq!(Trace::from_safetensors(&bytes, "x").unwrap(), t);

    let write = |views: Vec<(&str, TensorView)>, meta: &[(&str, &str)]| {
        let meta = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        safetensors::serialize(views, Some(meta)).unwrap()
    };
    let f32s: Vec<u8> = [1f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = || TensorView::new(Dtype::F32, vec![2], &f32s).unwrap();
    let err = |bytes: &[u8]| {
        Trace::from_safetensors(bytes, "t.st")
            .unwrap_err()
            .to_string()
    };
    let e = err(&write(vec![("a", view())], &[(ORDER_KEY, "a")]));
    assert!(e.starts_with("t.st: ") && e.contains(TOKENS_KEY), "{e}");
    let e = err(&write(vec![("a", view())], &[(TOKENS_KEY, "1,x")]));
    assert!(e.contains("'x' is not a token id"), "{e}");
    let e = err(&write(
        vec![("a", view())],
        &[(TOKENS_KEY, "1"), (ORDER_KEY, "a,b")],
    ));
    assert!(e.contains("'b', a tensor the file lacks"), "{e}");
    let e = err(&write(vec![], &[(TOKENS_KEY, "1")]));
    assert!(e.contains("no tensors"), "{e}");
    let i32s = TensorView::new(Dtype::I32, vec![2], &f32s).unwrap();
    let e = err(&write(vec![("a", i32s)], &[(TOKENS_KEY, "1")]));
    assert!(e.contains("tensor 'a' is I32"), "{e}");
    assert!(err(b"not safetensors").contains("not a safetensors file"));
    // F16 and BF16 tensors read as f32, and without an order the data's order is taken.
    let h: Vec<u8> = [half::f16::from_f32(1.5)]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let read = Trace::from_safetensors(
        &write(
            vec![("h", TensorView::new(Dtype::F16, vec![1], &h).unwrap())],
            &[(TOKENS_KEY, "1")],
        ),
        "t",
    )
    .unwrap();
    assert_eq!(read.tensors[0].data, [1.5]);
}

/// CPU and CUDA traces of the same model agree (the CLI's `--backends cpu,cuda`; on CUDA
/// the prefill rounds operands of its tensor-core products to F16/BF16).
#[cfg(feature = "cuda")]
#[test]
fn cpu_and_cuda_traces_agree() {
    let Some(be) = graft::backend::cuda::CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    drop(be);
    let name = "llama2-tiny-f32";
    let dir = fixture(name);
    let r = trace_json(
        &[
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            &csv(&tokens(name)),
            "--backends",
            "cpu,cuda",
        ],
        0,
    );
    assert!(r["first_divergence"].is_null(), "{r}");
    assert_eq!(r["reference"], format!("graft {} cpu", dir.display()));
    assert_eq!(r["ours"], format!("graft {} cuda", dir.display()));
    let worst = r["compared"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["nmse"].as_f64().unwrap())
        .fold(0f64, f64::max);
    eprintln!("{name}: cuda vs cpu, largest nmse {worst:.2e}");
}

/// The trace names are the ones scripts/hf-trace.py writes: a cache type other than the
/// default does not change them, and the F16 cache traces differ from F32 ones only
/// slightly (a sanity check of the cache option this file's HF comparisons rely on).
#[test]
fn cache_type_changes_values_not_names() {
    let name = "llama2-tiny-f32";
    let ids = tokens(name);
    let mut be = CpuBackend::new();
    let f32_cache = CacheTypes {
        k: DType::F32,
        v: DType::F32,
        flash_attn: true,
    };
    let a = load(&mut be, &fixture(name), ids.len(), f32_cache)
        .trace(&mut be, &ids)
        .unwrap();
    let b = load(&mut be, &fixture(name), ids.len(), CacheTypes::default())
        .trace(&mut be, &ids)
        .unwrap();
    let c = compare(&b, &a, 1e-4);
    assert!(c.first_divergence.is_none() && c.only_ours.is_empty());
    let w = c.worst().unwrap().diff.unwrap().nmse;
    assert!(
        w > 0.0 && w < 1e-5,
        "F16 vs F32 cache: largest nmse {w:.2e}"
    );
}

/// A trace over a sliding-window ring cache (Mistral at --ctx 300: 96 slots) writes its
/// keys at their slots and masks by the positions they hold, so it equals the trace
/// over a plain cache.
#[test]
fn ring_cache_traces_like_a_plain_cache() {
    let name = "mistral-tiny-f32";
    let ids = tokens(name);
    let mut be = CpuBackend::new();
    let mut plain = load(&mut be, &fixture(name), ids.len(), CacheTypes::default());
    let mut ring = load(&mut be, &fixture(name), 300, CacheTypes::default());
    assert!(ring.cache().is_ring() && !plain.cache().is_ring());
    let a = plain.trace(&mut be, &ids).unwrap();
    let b = ring.trace(&mut be, &ids).unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.name, y.name);
        let e = nmse(&y.data, &x.data);
        assert!(e < 1e-12, "{}: nmse {e:e}", x.name);
    }
}
