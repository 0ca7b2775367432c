//! A small transformer step (a few dozen mixed nodes: embedding lookup, norms, GEMV and
//! cuBLAS products, rope, a K cache written by set_rows at run-time rows, a transposed V
//! cache written by cpy, attention with a mask over GQA heads, soft_max, argmax) run on
//! the CPU, on the CUDA backend eagerly, and on the CUDA backend captured into a CUDA
//! graph and replayed with new inputs (token ids, positions, mask) every run.
//!
//! Checks: eager and replayed results are bit-identical for the same inputs (outputs and
//! the caches they wrote), both match the CPU (NMSE), the stats show one capture and
//! replays after it, and a bad token id or cache row is reported as IndexOutOfRange
//! after which the next valid run is right again.
//!
//! One token per run exercises the GEMV kernels (mul_mat_vec, p021, vec_nc); five tokens
//! exercise cuBLAS (converted activations, batched GQA products, F32 GEMM).
//! Without a GPU the tests print "skipped: no GPU" and pass (GRAFT_REQUIRE_GPU=1: fail).

use graft::backend::cpu::CpuBackend;
use graft::backend::cuda::CudaBackend;
use graft::backend::{Backend, BackendExt, ExecId};
use graft::graph::{BufferId, BufferRef, DType, Graph, Plan, TensorId};
use graft::ops::{Llama3Scaling, RopeMode, RopeParams};
use graft::Error;

const D: usize = 256;
const HD: usize = 64;
const N_HEAD: usize = 4;
const N_KV_HEAD: usize = 2;
const KV: usize = HD * N_KV_HEAD;
const FF: usize = 512;
const VOCAB: usize = 1000;
/// Cache positions (> 256 so that the decode V product takes the long-row kernel).
const CTX: usize = 320;
/// Where cpy writes V in the transposed cache (fixed when the graph is built).
const V_COL: usize = 17;

/// The graph and the handles a run needs.
struct Model {
    plan: Plan,
    tok: TensorId,
    pos: TensorId,
    rows: TensorId,
    mask: TensorId,
    outputs: Vec<(TensorId, usize, bool)>,
    caches: Vec<(BufferId, usize)>,
}

fn weight(
    be: &mut dyn Backend,
    g: &mut Graph,
    name: &str,
    dtype: DType,
    shape: &[usize],
    seed: u64,
    scale: f32,
) -> graft::Result<TensorId> {
    let n: usize = shape.iter().product();
    let buf = be.alloc_buffer(n * dtype.block_bytes())?;
    be.fill_random(buf, 0, dtype, n, seed, scale)?;
    g.weight(
        name,
        dtype,
        shape,
        BufferRef {
            buffer: buf,
            offset: 0,
        },
    )
}

fn state(
    be: &mut dyn Backend,
    g: &mut Graph,
    name: &str,
    dtype: DType,
    shape: &[usize],
    caches: &mut Vec<(BufferId, usize)>,
) -> graft::Result<TensorId> {
    let bytes = shape.iter().product::<usize>() * dtype.block_bytes();
    let buf = be.alloc_buffer(bytes)?;
    caches.push((buf, bytes));
    g.state(
        name,
        dtype,
        shape,
        BufferRef {
            buffer: buf,
            offset: 0,
        },
    )
}

/// One transformer block and the output head for `t` tokens, weights seeded identically
/// on every backend (fill_random is the same generator everywhere).
fn build(be: &mut dyn Backend, t: usize) -> graft::Result<Model> {
    let mut g = Graph::new();
    let mut caches = Vec::new();
    let tok = g.input("tok", DType::I32, &[t])?;
    let pos = g.input("pos", DType::I32, &[t])?;
    let rows = g.input("kv_rows", DType::I32, &[t])?;
    let mask = g.input("mask", DType::F32, &[CTX, t])?;

    let emb = weight(be, &mut g, "emb", DType::F16, &[D, VOCAB], 1, 1.0)?;
    let norm_w = weight(be, &mut g, "norm_w", DType::F32, &[D], 2, 1.0)?;
    let wq = weight(be, &mut g, "wq", DType::F16, &[D, D], 3, 0.1)?;
    let wk = weight(be, &mut g, "wk", DType::F16, &[D, KV], 4, 0.1)?;
    let wv = weight(be, &mut g, "wv", DType::BF16, &[D, KV], 5, 0.1)?;
    let wo = weight(be, &mut g, "wo", DType::F32, &[D, D], 6, 0.1)?;
    let w_up = weight(be, &mut g, "w_up", DType::F16, &[D, FF], 7, 0.1)?;
    let w_down = weight(be, &mut g, "w_down", DType::F16, &[FF, D], 8, 0.05)?;
    let w_out = weight(be, &mut g, "w_out", DType::F16, &[D, VOCAB], 9, 0.1)?;
    let kcache = state(be, &mut g, "kcache", DType::F16, &[KV, CTX], &mut caches)?;
    let vcache = state(
        be,
        &mut g,
        "vcache",
        DType::F16,
        &[CTX, HD, N_KV_HEAD],
        &mut caches,
    )?;
    let xstate = state(be, &mut g, "xstate", DType::F32, &[D, t], &mut caches)?;
    let rope = RopeParams {
        mode: RopeMode::Neox,
        n_dims: HD,
        freq_base: 500000.0,
        freq_scale: 1.0,
        llama3: Some(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        }),
    };

    let x = g.get_rows(emb, tok)?; // [D, t]
    let h = g.rms_norm(x, 1e-5)?;
    let h = g.mul(h, norm_w)?;
    let q = g.mul_mat(wq, h)?; // [D, t]
    let q = g.reshape(q, &[HD, N_HEAD, t])?;
    let q = g.rope(q, pos, rope)?;
    let k = g.mul_mat(wk, h)?; // [KV, t]
    let k = g.reshape(k, &[HD, N_KV_HEAD, t])?;
    let k = g.rope(k, pos, rope)?;
    let k = g.reshape(k, &[KV, t])?;
    let v = g.mul_mat(wv, h)?; // [KV, t]

    // K rows at run-time positions; V columns of the transposed cache at V_COL.
    let k_written = g.set_rows(kcache, k, rows)?;
    let vt = g.transpose(v)?; // [t, KV]
    let v_dst = g.view_2d(vcache, t, KV, CTX * 2, V_COL * 2)?;
    let v_written = g.cpy(vt, v_dst)?;

    let kview = g.view_3d(kcache, HD, CTX, N_KV_HEAD, KV * 2, HD * 2, 0)?; // [HD, CTX, kv heads]
    let kview = g.after(kview, &[k_written])?;
    let vview = g.view_3d(vcache, CTX, HD, N_KV_HEAD, CTX * 2, CTX * HD * 2, 0)?; // [CTX, HD, kv heads]
    let vview = g.after(vview, &[v_written])?;

    let qp = g.permute(q, [0, 2, 1, 3])?; // [HD, t, heads]
    let kq = g.mul_mat(kview, qp)?; // [CTX, t, heads]
    let probs = g.soft_max_ext(kq, Some(mask), 1.0 / (HD as f32).sqrt())?;
    let kqv = g.mul_mat(vview, probs)?; // [HD, t, heads]
    let o = g.permute(kqv, [0, 2, 1, 3])?; // [HD, heads, t]
    let o = g.cont(o)?;
    let o = g.reshape(o, &[D, t])?;
    let attn = g.mul_mat(wo, o)?;
    let x = g.add(x, attn)?;

    let h = g.rms_norm(x, 1e-5)?;
    let up = g.mul_mat(w_up, h)?; // [FF, t]
    let up = g.silu(up)?;
    let gate = g.gelu(up)?;
    let up = g.mul(up, gate)?;
    let down = g.mul_mat(w_down, up)?;
    let x = g.add(x, down)?;
    let x = g.scale(x, 0.5)?;
    let x_saved = g.cpy(x, xstate)?;

    let h = g.norm(x, 1e-5)?;
    let h = g.rms_norm(h, 1e-5)?;
    let logits = g.mul_mat(w_out, h)?; // [VOCAB, t]
    let am = g.argmax(logits)?; // [t]

    let plan = g.plan(&[x_saved, logits, am, probs])?;
    Ok(Model {
        plan,
        tok,
        pos,
        rows,
        mask,
        outputs: vec![
            (logits, VOCAB * t, false),
            (am, t, true),
            (probs, CTX * t * N_HEAD, false),
        ],
        caches,
    })
}

/// The inputs of run `r`: tokens, positions continuing from earlier runs, cache rows at
/// those positions, and the causal mask.
fn inputs(r: usize, t: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<f32>) {
    let tok: Vec<i32> = (0..t)
        .map(|i| ((r * 7919 + i * 104_729) % VOCAB) as i32)
        .collect();
    let pos: Vec<i32> = (0..t).map(|i| (40 + r * t + i) as i32).collect();
    let rows = pos.clone();
    let mut mask = vec![0f32; CTX * t];
    for (i, &p) in pos.iter().enumerate() {
        for j in 0..CTX {
            if j as i32 > p {
                mask[i * CTX + j] = f32::NEG_INFINITY;
            }
        }
    }
    (tok, pos, rows, mask)
}

/// Everything a run produced: outputs (F32 or I32 as bits) and cache contents.
#[derive(PartialEq)]
struct RunResult {
    outputs: Vec<Vec<u32>>,
    caches: Vec<Vec<u8>>,
}

fn set_inputs(
    be: &mut dyn Backend,
    m: &Model,
    e: ExecId,
    (tok, pos, rows, mask): &(Vec<i32>, Vec<i32>, Vec<i32>, Vec<f32>),
) -> graft::Result<()> {
    be.set_input_i32(e, m.tok, tok)?;
    be.set_input_i32(e, m.pos, pos)?;
    be.set_input_i32(e, m.rows, rows)?;
    be.set_input_f32(e, m.mask, mask)
}

fn run(
    be: &mut dyn Backend,
    m: &Model,
    e: ExecId,
    inp: &(Vec<i32>, Vec<i32>, Vec<i32>, Vec<f32>),
) -> graft::Result<RunResult> {
    set_inputs(be, m, e, inp)?;
    be.compute(e)?;
    let mut outputs = Vec::new();
    for &(id, n, _) in &m.outputs {
        let mut v = vec![0u32; n];
        be.get_output(e, id, bytemuck::cast_slice_mut(&mut v))?;
        outputs.push(v);
    }
    let mut caches = Vec::new();
    for &(buf, bytes) in &m.caches {
        let mut v = vec![0u8; bytes];
        be.read_buffer(buf, 0, &mut v)?;
        caches.push(v);
    }
    Ok(RunResult { outputs, caches })
}

use crate::common::nmse;

fn f16_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

fn compare_with_cpu(gpu: &RunResult, cpu: &RunResult, m: &Model, what: &str) {
    for (i, &(_, _, is_int)) in m.outputs.iter().enumerate() {
        if is_int {
            continue;
        }
        let g: &[f32] = bytemuck::cast_slice(&gpu.outputs[i]);
        let c: &[f32] = bytemuck::cast_slice(&cpu.outputs[i]);
        let e = nmse(g, c);
        assert!(
            e < 5e-4,
            "{what}: output {i} differs from the CPU: NMSE {e:e}"
        );
    }
    // argmax on the GPU is the argmax of the GPU's own logits.
    let logits: &[f32] = bytemuck::cast_slice(&gpu.outputs[0]);
    let am = &gpu.outputs[1];
    for (i, row) in logits.chunks_exact(VOCAB).enumerate() {
        let expect = graft::ops::argmax::argmax_row(row) as u32;
        assert_eq!(am[i], expect, "{what}: argmax of row {i}");
    }
    // K and V caches (F16), and the saved activations (F32).
    for (i, (g, c)) in gpu.caches.iter().zip(&cpu.caches).enumerate() {
        let (g, c) = if i < 2 {
            (f16_to_f32(g), f16_to_f32(c))
        } else {
            (
                bytemuck::cast_slice::<u8, f32>(g).to_vec(),
                bytemuck::cast_slice::<u8, f32>(c).to_vec(),
            )
        };
        let e = nmse(&g, &c);
        assert!(
            e < 5e-4,
            "{what}: cache {i} differs from the CPU: NMSE {e:e}"
        );
    }
}

fn eager_and_replayed_match_cpu(t: usize) {
    let Some(mut eager) = CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    let mut replayed = CudaBackend::new(0).unwrap();
    // Replayed without programmatic dependent launch: kernels strictly one after another.
    let mut serial = CudaBackend::new(0).unwrap();
    eager.set_graphs(false);
    replayed.set_graphs(true);
    serial.set_graphs(true);
    serial.set_pdl(false);
    assert!(
        replayed.graphs(),
        "GRAFT_CUDA_SYNC=1 turns graphs off; unset it for this test"
    );
    let mut cpu = CpuBackend::new();

    let mc = build(&mut cpu, t).unwrap();
    let me = build(&mut eager, t).unwrap();
    let mr = build(&mut replayed, t).unwrap();
    let ms = build(&mut serial, t).unwrap();
    let ec = cpu.load(&mc.plan).unwrap();
    let ee = eager.load(&me.plan).unwrap();
    let er = replayed.load(&mr.plan).unwrap();
    let es = serial.load(&ms.plan).unwrap();

    const RUNS: usize = 4;
    for r in 0..RUNS {
        let inp = inputs(r, t);
        let c = run(&mut cpu, &mc, ec, &inp).unwrap();
        let e = run(&mut eager, &me, ee, &inp).unwrap();
        let g = run(&mut replayed, &mr, er, &inp).unwrap();
        let sg = run(&mut serial, &ms, es, &inp).unwrap();
        assert!(e == g, "t={t} run {r}: eager and replayed results differ");
        assert!(
            sg == g,
            "t={t} run {r}: replays with and without PDL differ"
        );
        compare_with_cpu(&g, &c, &mr, &format!("t={t} run {r}"));
    }
    assert_eq!(eager.stats().eager_runs, RUNS as u64);
    assert_eq!(eager.stats().captures, 0);
    let s = replayed.stats();
    assert_eq!(
        (s.captures, s.replays, s.eager_runs),
        (1, RUNS as u64 - 1, 0),
        "{:?}",
        replayed.warnings()
    );
    assert!(replayed.warnings().is_empty(), "{:?}", replayed.warnings());

    // A bad token id: reported at the next synchronizing call, then cleared.
    let mut inp = inputs(RUNS, t);
    inp.0[t - 1] = (VOCAB + 5) as i32;
    match run(&mut replayed, &mr, er, &inp) {
        Err(Error::IndexOutOfRange {
            op,
            index,
            position,
            limit,
            ..
        }) => {
            assert_eq!(
                (op, index, position, limit),
                ("get_rows", VOCAB as i64 + 5, t - 1, VOCAB)
            );
        }
        other => panic!(
            "expected IndexOutOfRange from get_rows, got {:?}",
            other.err()
        ),
    }
    // A bad cache row, on the eager backend.
    let mut inp = inputs(RUNS, t);
    inp.2[0] = (CTX + 3) as i32;
    match run(&mut eager, &me, ee, &inp) {
        Err(Error::IndexOutOfRange {
            op,
            index,
            position,
            limit,
            ..
        }) => {
            assert_eq!(
                (op, index, position, limit),
                ("set_rows", CTX as i64 + 3, 0, CTX)
            );
        }
        other => panic!(
            "expected IndexOutOfRange from set_rows, got {:?}",
            other.err()
        ),
    }
    // The next valid run (same positions: it rewrites what the bad runs wrote) is right.
    let inp = inputs(RUNS, t);
    let c = run(&mut cpu, &mc, ec, &inp).unwrap();
    let e = run(&mut eager, &me, ee, &inp).unwrap();
    let g = run(&mut replayed, &mr, er, &inp).unwrap();
    assert!(
        e == g,
        "t={t}: eager and replayed differ after the index errors"
    );
    compare_with_cpu(&g, &c, &mr, &format!("t={t} after the index errors"));
    let s = replayed.stats();
    assert_eq!((s.captures, s.replays), (1, RUNS as u64 + 1));
}

#[test]
fn decode_one_token() {
    eager_and_replayed_match_cpu(1);
}

#[test]
fn prefill_five_tokens() {
    eager_and_replayed_match_cpu(5);
}

/// A plan whose buffers were freed refuses to run; unknown plans are errors.
#[test]
fn freed_buffer_and_unknown_plan() {
    let Some(mut be) = CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[8]).unwrap();
    let buf = be.alloc_buffer(8 * 4).unwrap();
    let w = g
        .weight(
            "w",
            DType::F32,
            &[8],
            BufferRef {
                buffer: buf,
                offset: 0,
            },
        )
        .unwrap();
    let y = g.mul(x, w).unwrap();
    let plan = g.plan(&[y]).unwrap();
    let e = be.load(&plan).unwrap();
    be.set_input_f32(e, x, &[1.0; 8]).unwrap();
    be.compute(e).unwrap();
    assert_eq!(be.get_output_f32(e, y, 8).unwrap(), vec![0.0; 8]);
    be.free_buffer(buf).unwrap();
    assert!(matches!(be.compute(e), Err(Error::Plan(_))));
    be.unload(e).unwrap();
    assert!(be.compute(e).is_err());
}

/// A token picked on the device feeds the next run on the device (`forward_output`),
/// reads started with `begin_read` finish with the bytes of the run before them while
/// later runs are already enqueued, a bad index a run records is reported by the read
/// after it (and the next valid run is right again), and a read overtaken by four later
/// ones is an error rather than someone else's bytes.
#[test]
fn forwarded_tokens_and_pending_reads() {
    let Some(mut be) = CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    const ROWS: usize = 16;
    const W: usize = ROWS;
    // Row r of the table peaks at element (5 r + 3) % ROWS: a token r leads to that one.
    let next = |r: usize| (5 * r + 3) % ROWS;
    let mut table = vec![0f32; W * ROWS];
    for r in 0..ROWS {
        for c in 0..W {
            table[r * W + c] = (r * W + c) as f32 * 1e-3 + if c == next(r) { 1.0 } else { 0.0 };
        }
    }
    let buf = be.alloc_buffer(table.len() * 4).unwrap();
    be.write_buffer(buf, 0, bytemuck::cast_slice(&table))
        .unwrap();
    let mut g = Graph::new();
    let ids = g.input("ids", DType::I32, &[1]).unwrap();
    let t = g
        .weight(
            "table",
            DType::F32,
            &[W, ROWS],
            BufferRef {
                buffer: buf,
                offset: 0,
            },
        )
        .unwrap();
    let row = g.get_rows(t, ids).unwrap(); // [W, 1]
    let am = g.argmax(row).unwrap(); // [1]
    let plan = g.plan(&[row, am]).unwrap();
    let e = be.load(&plan).unwrap();

    // Six chained runs from token 1, each read begun before the next run is enqueued.
    be.set_input_i32(e, ids, &[1]).unwrap();
    let mut reads = Vec::new();
    for i in 0..6 {
        if i > 0 {
            be.forward_output(e, am, e, ids, 4).unwrap();
        }
        be.compute(e).unwrap();
        reads.push(be.begin_read(e, am, 4).unwrap());
        if reads.len() == 2 {
            let first = reads.remove(0);
            let got = i32::from_le_bytes(be.finish_read(first).unwrap()[..].try_into().unwrap());
            let mut want = 1;
            for _ in 0..i {
                want = next(want);
            }
            assert_eq!(got as usize, want, "run {}", i - 1);
        }
    }
    let last = reads.pop().unwrap();
    let mut want = 1;
    for _ in 0..6 {
        want = next(want);
    }
    let got = i32::from_le_bytes(be.finish_read(last).unwrap()[..].try_into().unwrap());
    assert_eq!(got as usize, want, "the last run");

    // A bad token: the read after its run reports it, naming the index.
    be.set_input_i32(e, ids, &[ROWS as i32 + 7]).unwrap();
    be.compute(e).unwrap();
    let read = be.begin_read(e, row, W * 4).unwrap();
    match be.finish_read(read) {
        Err(Error::IndexOutOfRange { index, limit, .. }) => {
            assert_eq!((index, limit), (ROWS as i64 + 7, ROWS))
        }
        other => panic!("expected IndexOutOfRange, got {other:?}"),
    }
    be.set_input_i32(e, ids, &[2]).unwrap();
    be.compute(e).unwrap();
    let read = be.begin_read(e, row, W * 4).unwrap();
    let bytes = be.finish_read(read).unwrap();
    let got: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, table[2 * W..3 * W]);
    be.synchronize().unwrap();

    // Five reads under way: the first one's slot was taken by the fifth.
    let mut reads: Vec<_> = (0..5).map(|_| be.begin_read(e, am, 4).unwrap()).collect();
    let e1 = be.finish_read(reads.remove(0)).unwrap_err();
    assert!(e1.to_string().contains("later reads"), "{e1}");
    for r in reads {
        be.finish_read(r).unwrap();
    }
    be.unload(e).unwrap();
}

/// A profiled run times every step of the plan in order, computes the same bits as an
/// unprofiled eager run, and neither captures nor replays.
#[test]
fn profiled_run_times_every_step() {
    let Some(mut be) = CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    be.set_graphs(false);
    let m = build(&mut be, 5).unwrap();
    let e = be.load(&m.plan).unwrap();
    let inp = inputs(0, 5);
    let plain = run(&mut be, &m, e, &inp).unwrap();
    // The same inputs again (the caches were written by the first run; write them back
    // to what the first run saw by running on a fresh copy of the model).
    let mut be2 = CudaBackend::new(0).unwrap();
    let m2 = build(&mut be2, 5).unwrap();
    let e2 = be2.load(&m2.plan).unwrap();
    be2.set_profiling(true);
    let profiled = run(&mut be2, &m2, e2, &inp).unwrap();
    let rows = be2.take_profile();
    assert!(plain == profiled, "a profiled run computes other results");
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    let steps: Vec<&str> = m2.plan.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, steps);
    assert!(rows.iter().all(|r| r.us > 0.0 && r.us < 1e6), "{rows:?}");
    assert!(
        rows.iter().any(|r| r.kernels.contains("cublasGemm")),
        "{rows:?}"
    );
    let s = be2.stats();
    assert_eq!((s.captures, s.replays, s.eager_runs), (0, 0, 1));
}

/// `set_skip` (`GRAFT_CUDA_SKIP`) leaves the kernels it names out of the plans loaded
/// after it and warns that results are wrong: a profiled run launches none of them where
/// the same plan without the skip does, and still launches the others.
#[test]
fn skipped_kernels_are_not_launched() {
    let Some(mut be) = CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    let profile = |be: &mut CudaBackend| {
        be.set_graphs(false);
        be.set_profiling(true);
        let m = build(be, 1).unwrap();
        let e = be.load(&m.plan).unwrap();
        run(be, &m, e, &inputs(0, 1)).unwrap();
        be.take_profile()
    };
    let all = profile(&mut be);
    assert!(
        all.iter().any(|r| r.kernels.contains("rms_norm")),
        "{all:?}"
    );
    let mut be2 = CudaBackend::new(0).unwrap();
    be2.set_skip(vec!["rms_norm".into(), String::new()]);
    assert!(
        be2.warnings()
            .iter()
            .any(|w| w.contains("rms_norm") && w.contains("wrong")),
        "{:?}",
        be2.warnings()
    );
    let some = profile(&mut be2);
    assert_eq!(some.len(), all.len());
    assert!(
        some.iter().all(|r| !r.kernels.contains("rms_norm")),
        "{some:?}"
    );
    assert!(
        some.iter().any(|r| r.kernels.contains("mul_mat_vec")),
        "{some:?}"
    );
}

/// One case of [`attention_inputs_match_cpu`]: the weight type, the rope pairing, the
/// caches' type, whether V is cached transposed, whether the product's input is a
/// residual add and RMS norm (which the CUDA backend folds into the launches around the
/// product) rather than an input, and the tokens of the step.
struct QkvCase {
    w: DType,
    mode: RopeMode,
    cache: DType,
    v_transposed: bool,
    fold: bool,
    tokens: usize,
}

/// The cache slot of token `i` of a [`qkv_graph`] (distinct, out of order).
fn qkv_slot(i: usize) -> i32 {
    ((77 + 7 * i) % CTX) as i32
}

/// `n` values in [-1, 1) from `seed`, alike on every backend.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 50.0 - 1.0)
        .collect()
}

/// The F32 inputs of a [`qkv_graph`] with the values they take.
type Inputs = Vec<(TensorId, Vec<f32>)>;

/// A q|k|v product, its views, the ropes of q and k and the cache writes of k and v (the
/// steps of a layer's attention inputs) for `c.tokens` tokens at cache slots `slot`, the
/// product's input x an input or, with `c.fold`, `rms_norm(r + wo a) * wn` (r, a, wo, wn
/// F32 inputs; one token): the plan, its F32 inputs with their values, its other inputs
/// (pos, slot), its output (roped q) and the two caches.
fn qkv_graph(
    be: &mut dyn Backend,
    c: &QkvCase,
    caches: &mut Vec<(BufferId, usize)>,
) -> graft::Result<(Plan, Inputs, [TensorId; 3])> {
    const K: usize = 256;
    let (m, slots, n) = ((N_HEAD + 2 * N_KV_HEAD) * HD, CTX, c.tokens);
    let mut g = Graph::new();
    let mut inputs = Vec::new();
    let x = if c.fold {
        let mut input = |g: &mut Graph, name: &str, ne: &[usize], scale: f32| {
            let t = g.input(name, DType::F32, ne)?;
            let n = ne.iter().product();
            let v = values(n, inputs.len()).iter().map(|x| x * scale).collect();
            inputs.push((t, v));
            graft::Result::Ok(t)
        };
        let r = input(&mut g, "r", &[K, 1], 3.0)?;
        let a = input(&mut g, "a", &[K, 1], 1.0)?;
        let wo = input(&mut g, "wo", &[K, K], 0.1)?;
        let wn = input(&mut g, "wn", &[K], 1.0)?;
        let o = g.mul_mat(wo, a)?;
        let y = g.add(r, o)?;
        let n = g.rms_norm(y, 1e-5)?;
        g.mul(n, wn)?
    } else {
        let x = g.input("x", DType::F32, &[K, n])?;
        // many tokens' products may round x to F16 (cuBLAS): values F16 holds exactly
        let v = match n {
            1 => values(K, 0),
            _ => values(K * n, 0)
                .iter()
                .map(|x| (x * 64.0).round() / 64.0)
                .collect(),
        };
        inputs.push((x, v));
        x
    };
    let pos = g.input("pos", DType::I32, &[n])?;
    let slot = g.input("slot", DType::I32, &[n])?;
    // weights seeded alike on both backends, quantized on the host where they are blocks
    let vals: Vec<f32> = (0..K * m)
        .map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 5000.0 - 0.1)
        .collect();
    let bytes: Vec<u8> = match c.w {
        DType::Quant(q) => vals
            .chunks_exact(K)
            .flat_map(|row| {
                let mut b = vec![0u8; q.row_bytes(K).unwrap()];
                graft::quant::quantize_row(q, row, &mut b).unwrap();
                b
            })
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        dt => panic!("no weights of {dt} here"),
    };
    let wbuf = be.alloc_buffer(bytes.len())?;
    be.write_buffer(wbuf, 0, &bytes)?;
    let w = g.weight(
        "w_qkv",
        c.w,
        &[K, m],
        BufferRef {
            buffer: wbuf,
            offset: 0,
        },
    )?;
    let kc = state(be, &mut g, "k_cache", c.cache, &[KV, slots], caches)?;
    let vc = state(be, &mut g, "v_cache", c.cache, &[KV, slots], caches)?;
    let rope = RopeParams {
        mode: c.mode,
        n_dims: HD,
        freq_base: 10000.0,
        freq_scale: 1.0,
        llama3: None,
    };
    let qkv = g.mul_mat(w, x)?; // [m, n]
    let row = m * 4;
    let q = g.view_3d(qkv, HD, N_HEAD, n, HD * 4, row, 0)?;
    let k = g.view_3d(qkv, HD, N_KV_HEAD, n, HD * 4, row, N_HEAD * HD * 4)?;
    let v = g.view_2d(qkv, KV, n, row, (N_HEAD + N_KV_HEAD) * HD * 4)?;
    let q = g.rope(q, pos, rope)?;
    let k = g.rope(k, pos, rope)?;
    let k = g.reshape(k, &[KV, n])?;
    let k_written = g.set_rows(kc, k, slot)?;
    let es = c.cache.block_bytes();
    let v_written = match c.v_transposed {
        // the transposed cache as [1, slots, KV] (row p of matrix j is element (p, j))
        true => {
            let dst = g.view_3d(vc, 1, slots, KV, es, slots * es, 0)?;
            let src = g.view_3d(v, 1, n, KV, row, 4, 0)?;
            g.set_rows(dst, src, slot)?
        }
        false => g.set_rows(vc, v, slot)?,
    };
    let plan = g.plan(&[q, k_written, v_written])?;
    Ok((plan, inputs, [pos, slot, q]))
}

/// A step's attention inputs (a q|k|v product, the ropes of q and k, the cache writes of k
/// and v) on the CUDA backend, for one token (a decode step) and for 200 (a prompt's
/// chunk: several rows a block, and with dense rows the 16-byte path; F16 weights and
/// inputs F16 holds, so that the product is exact on any path): the product, then
/// one `rope_store` launch for the four steps after it, computing what the CPU does: roped q within 1e-9 NMSE, the
/// written cache rows within 1e-9 (F32), 1e-6 (F16) or 1e-4 (BF16: the two products' sums
/// can round apart), every other cache byte as it was (a wrong slot, row order or rotation
/// is off by order 1). Weights F16 and Q4_0 (the `__dp4a` kernel), NeoX and normal pairs,
/// F32, F16 and BF16 caches, V by position and transposed. With a residual add and RMS norm
/// before the product, the norm is folded: one `mul_mat_vec_fold_f32` launch for the
/// product before it, its add and the norm, the product as `mul_mat_vec_total_f16` (which
/// also makes the norm's factor), and `rope_store` scales q, k and v by that factor. A slot
/// outside the cache is an index error that names it and the cache's slots, and no cache
/// byte changes.
#[test]
fn attention_inputs_match_cpu() {
    use graft::quant::QType;
    let Some(mut gpu) = CudaBackend::new_or_skip(0).unwrap() else {
        return;
    };
    gpu.set_mmvq(Some(true));
    gpu.set_graphs(false);
    gpu.set_profiling(true);
    let q4 = DType::Quant(QType::Q4_0);
    let cases = [
        (q4, RopeMode::Neox, DType::F16, false, false, 1),
        (q4, RopeMode::Normal, DType::F32, true, false, 1),
        (q4, RopeMode::Neox, DType::BF16, true, false, 1),
        (DType::F16, RopeMode::Neox, DType::F16, false, false, 1),
        (DType::F16, RopeMode::Normal, DType::BF16, true, false, 1),
        (DType::F16, RopeMode::Neox, DType::F16, false, true, 1),
        (DType::F16, RopeMode::Normal, DType::F32, true, true, 1),
        (q4, RopeMode::Neox, DType::BF16, false, true, 1),
        (DType::F16, RopeMode::Neox, DType::F16, false, false, 200),
        (DType::F16, RopeMode::Normal, DType::F16, false, false, 200),
        (DType::F16, RopeMode::Normal, DType::F32, false, false, 200),
        (DType::F16, RopeMode::Neox, DType::BF16, false, false, 200),
        (DType::F16, RopeMode::Normal, DType::F16, true, false, 200),
    ];
    for (w, mode, cache, v_transposed, fold, tokens) in cases {
        let c = QkvCase {
            w,
            mode,
            cache,
            v_transposed,
            fold,
            tokens,
        };
        let what =
            format!("{w} {mode:?} {cache} transposed {v_transposed} fold {fold} {tokens} tokens");
        let slots: Vec<i32> = (0..tokens).map(qkv_slot).collect();
        let positions: Vec<i32> = (0..tokens as i32).map(|i| 1234 + i).collect();
        let mut results = Vec::new();
        for be in [&mut gpu as &mut dyn Backend, &mut CpuBackend::new()] {
            let mut caches = Vec::new();
            let (plan, inputs, [pos, slot, q]) = qkv_graph(be, &c, &mut caches).unwrap();
            // sentinels: every cache byte 0x5a before the run
            for &(buf, bytes) in &caches {
                be.write_buffer(buf, 0, &vec![0x5a; bytes]).unwrap();
            }
            let e = be.load(&plan).unwrap();
            for (id, v) in &inputs {
                be.set_input_f32(e, *id, v).unwrap();
            }
            be.set_input_i32(e, pos, &positions).unwrap();
            // slots outside the cache first: an index error (the GPU reports it when
            // it next waits for the device), nothing written
            be.set_input_i32(e, slot, &vec![CTX as i32 + 3; tokens])
                .unwrap();
            match be.compute(e).and_then(|()| be.synchronize()) {
                Err(Error::IndexOutOfRange { index, limit, .. }) => {
                    assert_eq!((index, limit), (CTX as i64 + 3, CTX), "{what}")
                }
                other => panic!("{what}: {} gave {other:?}", be.name()),
            }
            for &(buf, bytes) in &caches {
                let mut v = vec![0u8; bytes];
                be.read_buffer(buf, 0, &mut v).unwrap();
                assert!(v.iter().all(|&b| b == 0x5a), "{what}: a bad slot wrote");
            }
            be.set_input_i32(e, slot, &slots).unwrap();
            be.compute(e).unwrap();
            let mut qv = vec![0f32; HD * N_HEAD * tokens];
            be.get_output(e, q, bytemuck::cast_slice_mut(&mut qv))
                .unwrap();
            let mut cv = Vec::new();
            for &(buf, bytes) in &caches {
                let mut v = vec![0u8; bytes];
                be.read_buffer(buf, 0, &mut v).unwrap();
                cv.push(v);
            }
            results.push((qv, cv));
        }
        let rows = gpu.take_profile();
        let kernels: Vec<&str> = rows
            .iter()
            .map(|r| r.kernels.as_str())
            .filter(|k| !k.starts_with("(fused"))
            .collect();
        // two runs, each the product's step (with the activations' quantization for
        // Q4_0; with an F16 product after a norm, one step with the folded launch before
        // it), then one rope_store launch for the other four steps; a Q4_0 product after
        // a norm takes no fold (two more steps a run: the o product and the norm)
        let folds = fold && w == DType::F16;
        let folded = |k: &&str| k.starts_with("mul_mat_vec_fold_f32 + mul_mat_vec_total_f16");
        let product = |k: &&str| k.contains("mul_mat_vec_");
        let store = |k: &&str| k.starts_with(&format!("rope_store_{}", cache.name()));
        let unfolded = 4 * usize::from(fold && !folds);
        let count = |f: &dyn Fn(&&str) -> bool| kernels.iter().filter(|k| f(k)).count();
        // (a product of many tokens: whatever path it takes, then rope_store alone)
        let unfused = |k: &&str| k.contains("rope_f") || k.contains("set_rows");
        assert!(
            count(&unfused) == 0
                && (tokens > 1 || kernels.len() == 4 + unfolded)
                && count(&folded) == 2 * usize::from(folds)
                && (tokens > 1 || count(&product) == 2 + unfolded / 2)
                && count(&store) == 2,
            "{what}: {kernels:?}"
        );
        let ((gq, gc), (cq, cc)) = (&results[0], &results[1]);
        let e = nmse(gq, cq);
        assert!(e < 1e-9, "{what}: q NMSE {e:e}");
        let es = cache.block_bytes();
        for (i, (g, cpu)) in gc.iter().zip(cc).enumerate() {
            // the bytes of the tokens' slots: rows by position, columns transposed (V only)
            let at = |slot: usize| slots.contains(&(slot as i32));
            let written = |b: usize| match (i, v_transposed) {
                (1, true) => at(b % (CTX * es) / es),
                _ => at(b / (KV * es)),
            };
            let (mut gw, mut cw) = (Vec::new(), Vec::new());
            for (b, (&x, &y)) in g.iter().zip(cpu).enumerate() {
                if written(b) {
                    gw.push(x);
                    cw.push(y);
                } else {
                    assert!(x == 0x5a && y == 0x5a, "{what}: cache {i} byte {b} written");
                }
            }
            let floats = |v: &[u8]| -> Vec<f32> {
                match cache {
                    // (a byte vector need not be 4-byte aligned for a cast)
                    DType::F32 => v
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    DType::F16 => f16_to_f32(v),
                    _ => v
                        .chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                }
            };
            // the sums differ in order; a 16-bit cache can round them apart
            let limit = match cache {
                DType::F32 => 1e-9,
                DType::F16 => 1e-6,
                _ => 1e-4,
            };
            let e = nmse(&floats(&gw), &floats(&cw));
            assert!(e < limit, "{what}: cache {i} NMSE {e:e}");
        }
    }
}
