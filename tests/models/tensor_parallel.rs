//! Tensor parallelism on simulated devices: every fixture split over N CPU devices (a
//! `DeviceGroup` of CPU backends joined by an in-process all-reduce) gives the unsplit
//! model's logits (the forward pass, either attention) and, on the engine, its
//! log-probabilities and greedy tokens. Heads, KV heads (replicated when N exceeds them)
//! and the MLP's width are divided, and each device's graph sums its partial projections
//! with `all_reduce`. Only the order of the f32 sums differs from the unsplit model, so
//! the bound is tight: NMSE <= 1e-6 (measured: about 1e-13 with an F32 cache).
//!
//! With the `cuda` feature the same splits run over GPUs joined by NCCL, against one GPU
//! (NMSE <= 1e-5, the same greedy tokens). They need two GPUs and libnccl: with fewer they
//! say "skipped", unless `GRAFT_REQUIRE_GPUS=2` (or more) makes that a failure.

use graft::backend::cpu::CpuBackend;
use graft::backend::group::DeviceGroup;
use graft::backend::{Backend, ExecId};
use graft::graph::{BufferId, DType, TensorId};
use graft::models::blocks::batch::{build_batch, BatchShape};
use graft::models::{CacheTypes, KvCache, LoadOptions, Model, QuantPlan};

use crate::reference::{has_experts, nmse, reference, FIXTURES};
use crate::runs::{centered, engine, greedy, prefix_rows};

fn opts(cache: CacheTypes, quantize: Option<QuantPlan>) -> LoadOptions {
    LoadOptions {
        ctx: Some(96),
        progress: false,
        cache,
        quantize,
    }
}

/// F32 K/V, so that the split and unsplit runs differ only in summation order.
fn f32_cache(flash_attn: bool) -> CacheTypes {
    CacheTypes {
        k: DType::F32,
        v: DType::F32,
        flash_attn,
    }
}

/// What a model gives on one backend: the forward pass's logits of the prompt, and with
/// the fused attention the engine's log-probabilities of every prompt position (rows
/// centered) and 6 greedy tokens.
struct Outputs {
    logits: Vec<f32>,
    engine: Option<(Vec<f64>, Vec<u32>)>,
}

/// [`Outputs`] of fixture `name` on `be`, and the backend back.
fn run(
    name: &'static str,
    mut be: Box<dyn Backend>,
    o: &LoadOptions,
) -> (Outputs, Box<dyn Backend>) {
    let r = reference(name);
    let mut m = Model::load(&r.dir, be.as_mut(), o).unwrap_or_else(|e| panic!("{name}: {e}"));
    if let Some(q) = o.quantize {
        let dtype = m.weights().matrix_dtype(m.shard());
        assert_eq!(
            dtype,
            Some(q.base()),
            "{name}: every matrix in {}",
            q.name()
        );
    }
    let logits = m.forward(be.as_mut(), &r.tokens).unwrap().logits;
    m.release(be.as_mut()).unwrap();
    if !o.cache.flash_attn {
        let out = Outputs {
            logits,
            engine: None,
        };
        return (out, be);
    }
    let mut e = engine(&r.dir, be, o);
    let vocab = e.config().vocab_size;
    let rows = centered(&prefix_rows(&mut e, &r.tokens, 0), vocab);
    let tokens = greedy(&mut e, &r.tokens, 6);
    let out = Outputs {
        logits,
        engine: Some((rows, tokens)),
    };
    (out, e.into_backend().unwrap())
}

/// Checks `got` (split over `n` devices) against `want` (one device) within `bound`.
fn check_split(what: &str, got: &Outputs, want: &Outputs, bound: f64) {
    let e = nmse(&got.logits, &want.logits);
    println!("{what}: forward NMSE {e:.2e}");
    assert!(e <= bound, "{what}: forward NMSE {e:e}");
    if let (Some((rows, tokens)), Some((want_rows, want_tokens))) = (&got.engine, &want.engine) {
        let e = nmse(rows, want_rows);
        println!("{what}: engine NMSE {e:.2e}");
        assert!(e <= bound, "{what}: engine NMSE {e:e}");
        assert_eq!(tokens, want_tokens, "{what}: greedy tokens");
    }
}

/// N = 2 and 4 on every fixture, both attention paths: logits within NMSE 1e-6 of the
/// unsplit model's, and on the engine the same log-probabilities and greedy tokens.
#[test]
fn split_models_match_the_unsplit_model() {
    for name in FIXTURES.into_iter().filter(|n| !has_experts(n)) {
        for flash in [true, false] {
            let o = opts(f32_cache(flash), None);
            let (want, _) = run(name, Box::new(CpuBackend::new()), &o);
            for n in [2, 4] {
                let (got, _) = run(name, Box::new(DeviceGroup::cpu(n).unwrap()), &o);
                check_split(&format!("{name} flash={flash} tp={n}"), &got, &want, 1e-6);
            }
        }
    }
}

/// The default F16 cache and a quantized model split too (Q8_0 rows of 32-element
/// blocks cut on block boundaries): the same logits as unsplit within the bound.
#[test]
fn default_cache_and_quantized_weights_split() {
    let name = "llama2-tiny-f32";
    for q in [None, Some(QuantPlan::Q8_0)] {
        let o = opts(CacheTypes::default(), q);
        let (want, _) = run(name, Box::new(CpuBackend::new()), &o);
        let (got, _) = run(name, Box::new(DeviceGroup::cpu(2).unwrap()), &o);
        check_split(&format!("{name} {q:?} tp=2"), &got, &want, 1e-6);
    }
}

/// Sizes that do not divide are refused at load with the size named; a block type
/// whose rows would be cut inside a block names the tensor.
#[test]
fn indivisible_splits_are_named_errors() {
    let r = reference("llama2-tiny-f32"); // 4 heads, intermediate 192
    let o = opts(CacheTypes::default(), None);
    let group = Box::new(DeviceGroup::cpu(3).unwrap());
    let cfg = graft::engine::EngineConfig::new(96);
    let e = graft::engine::Engine::load(&r.dir, group, &o, cfg)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("--tp 3") && e.contains("attention heads (4)"),
        "{e}"
    );
    let e = DeviceGroup::cpu(0).err().unwrap().to_string();
    assert!(e.contains("--tp 0"), "{e}");
}

/// Each device's batch graph (what the engine runs) holds an all_reduce after the
/// attention output and after the MLP's down projection of every layer, and nothing
/// else collective.
#[test]
fn graphs_hold_two_all_reduces_per_layer() {
    let r = reference("qwen2-tiny-f32");
    let mut group = DeviceGroup::cpu(2).unwrap();
    let o = opts(CacheTypes::default(), None);
    let m = Model::load(&r.dir, &mut group, &o).unwrap();
    let layers = m.config().num_hidden_layers;
    let pool = KvCache::pool(m.shard(), 64, o.cache, BufferId(0));
    let shape = BatchShape {
        n_tokens: 8,
        n_seqs: 4,
        max_blocks: 6,
        candidates: 16,
        decode: false,
    };
    let g = build_batch(m.shard(), m.weights(), &pool, 16, shape).unwrap();
    let plan = g.plan().unwrap();
    let ops: Vec<&str> = plan.steps.iter().map(|s| s.op.name()).collect();
    assert_eq!(
        ops.iter().filter(|o| **o == "all_reduce").count(),
        2 * layers
    );
    // each follows an output projection: attention's, then the MLP's down
    for (i, _) in ops.iter().enumerate().filter(|(_, o)| **o == "all_reduce") {
        assert_eq!(ops[i - 1], "mul_mat", "{ops:?}");
    }
    let (full, shard) = (m.config(), m.shard());
    assert_eq!(shard.num_attention_heads * 2, full.num_attention_heads);
    assert_eq!(shard.intermediate_size * 2, full.intermediate_size);
    assert_eq!(shard.tp, 2);
    m.release(&mut group).unwrap();
}

/// A plan on a 2-device group whose devices each take one row of a table, add `x` and
/// sum over the group: device 0 holds row index 1, device 1 the out-of-range 9. Returns
/// the loaded plan (its input written), its sum and the buffer holding the indices (at
/// byte 32).
fn bad_index_on_device_1(group: &mut DeviceGroup) -> (ExecId, TensorId, BufferId) {
    use graft::backend::BackendExt;
    use graft::graph::{BufferRef, Graph};
    let mut g = Graph::new();
    let buf = group.alloc_buffer(4 * 8 + 4).unwrap();
    let at = |offset| BufferRef {
        buffer: buf,
        offset,
    };
    // table: [2, 4] F32 at 0; idx: I32 [1] at 32
    let table = g.weight("table", DType::F32, &[2, 4], at(0)).unwrap();
    let idx = g.weight("idx", DType::I32, &[1], at(32)).unwrap();
    let x = g.input("x", DType::F32, &[2]).unwrap();
    let row = g.get_rows(table, idx).unwrap();
    let row = g.add(row, x).unwrap();
    let sum = g.all_reduce(row, 2).unwrap();
    let plan = g.plan(&[sum]).unwrap();
    let rows: Vec<f32> = (0..8).map(|i| i as f32).collect();
    group
        .write_buffer(buf, 0, bytemuck::cast_slice(&rows))
        .unwrap();
    group
        .write_buffer_on(0, buf, 32, &1i32.to_le_bytes())
        .unwrap();
    group
        .write_buffer_on(1, buf, 32, &9i32.to_le_bytes())
        .unwrap();
    let e = group.load(&plan).unwrap();
    group.set_input_f32(e, x, &[0.5, 0.5]).unwrap();
    (e, sum, buf)
}

/// Device 1's index fixed: both read row 1 ([2, 3]) plus x, summed over the two devices.
fn fix_device_1_and_run(group: &mut DeviceGroup, e: ExecId, sum: TensorId, buf: BufferId) {
    use graft::backend::BackendExt;
    group
        .write_buffer_on(1, buf, 32, &1i32.to_le_bytes())
        .unwrap();
    group.compute(e).unwrap();
    assert_eq!(group.get_output_f32(e, sum, 2).unwrap(), vec![5.0, 7.0]);
}

/// A member that fails before an all-reduce does not leave the others waiting: the
/// group returns that member's own error (not the others' "abandoned"), and the next run
/// works.
#[test]
fn a_failing_member_does_not_hang_the_group() {
    let mut group = DeviceGroup::cpu(2).unwrap();
    let (e, sum, buf) = bad_index_on_device_1(&mut group);
    let err = group.compute(e).unwrap_err();
    assert!(matches!(err, graft::Error::IndexOutOfRange { .. }), "{err}");
    fix_device_1_and_run(&mut group, e, sum, buf);
}

/// `DeviceGroup::cuda(n)`, or `None` (after saying why) where this machine has fewer GPUs
/// or no NCCL, unless `GRAFT_REQUIRE_GPUS` asks for at least `n`.
#[cfg(feature = "cuda")]
fn gpus(n: usize) -> Option<DeviceGroup> {
    match DeviceGroup::cuda(n) {
        Ok(g) => Some(g),
        Err(e) => {
            let required = std::env::var("GRAFT_REQUIRE_GPUS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            assert!(required < n, "GRAFT_REQUIRE_GPUS={required}: {e}");
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "skipped: --tp {n} on GPUs ({e})");
            None
        }
    }
}

/// Every fixture split over 2 GPUs (NCCL all-reduces captured in each GPU's graph)
/// against one GPU, both attention paths, F32 and the default F16 cache: logits within
/// NMSE 1e-5, and on the engine log-probabilities within it and the same greedy tokens.
#[cfg(feature = "cuda")]
#[test]
fn split_over_gpus_matches_one_gpu() {
    use graft::backend::cuda::CudaBackend;
    let Some(g) = gpus(2) else { return };
    let mut group: Box<dyn Backend> = Box::new(g);
    let mut one: Box<dyn Backend> = Box::new(CudaBackend::new(0).expect("GPU 0"));
    for name in FIXTURES.into_iter().filter(|n| !has_experts(n)) {
        for (flash, cache) in [
            (true, f32_cache(true)),
            (false, f32_cache(false)),
            (true, CacheTypes::default()),
        ] {
            let o = opts(cache, None);
            let (want, b) = run(name, one, &o);
            one = b;
            let (got, b) = run(name, group, &o);
            group = b;
            let what = format!("{name} flash={flash} cache={:?} tp=2 on GPUs", cache.k);
            check_split(&what, &got, &want, 1e-5);
        }
    }
    let stats = group.stats();
    assert!(stats.captures > 0 && stats.replays > 0, "{stats:?}");
}

/// A bad row index on one GPU is reported by the read after the run (the collectives
/// ran, so the group stays usable), and the next run gives the sum over both GPUs.
#[cfg(feature = "cuda")]
#[test]
fn a_bad_index_on_one_gpu_is_reported_and_the_group_goes_on() {
    use graft::backend::BackendExt;
    let Some(mut group) = gpus(2) else { return };
    let (e, sum, buf) = bad_index_on_device_1(&mut group);
    group.compute(e).unwrap();
    let err = group.get_output_f32(e, sum, 2).unwrap_err();
    assert!(matches!(err, graft::Error::IndexOutOfRange { .. }), "{err}");
    fix_device_1_and_run(&mut group, e, sum, buf);
}

/// A mixture of experts is not split: loading one over a group is an error that says so.
#[test]
fn mixtures_of_experts_refuse_a_split() {
    for name in FIXTURES.into_iter().filter(|n| has_experts(n)) {
        let mut group = DeviceGroup::cpu(2).unwrap();
        let o = opts(f32_cache(true), None);
        let err = Model::load(&reference(name).dir, &mut group, &o)
            .err()
            .unwrap_or_else(|| panic!("{name} loaded over 2 devices"))
            .to_string();
        assert!(
            err.contains("--tp 2") && err.contains("mixture of experts"),
            "{name}: {err}"
        );
    }
}
