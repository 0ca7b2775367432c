//! Every shape and dtype error of every builder, view and leaf error, the errors of
//! running a plan (inputs, outputs, buffers) and the runtime index errors of get_rows and
//! set_rows: each asserts the exact error variant and that the message names the op and
//! the offending shape, parameter or tensor.

use graft::backend::cpu::CpuBackend;
use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferId, BufferRef, DType, Graph, TensorId};
use graft::ops::{Llama3Scaling, RopeMode, RopeParams};
use graft::{Error, Result};
use proptest::prelude::*;

use common::strategies as st;

use crate::common;

/// Asserts a shape error of `op` whose message names every needle.
#[track_caller]
fn shape_err<T: std::fmt::Debug>(r: Result<T>, op: &str, needles: &[&str]) {
    match r {
        Err(e @ Error::Shape { .. }) => {
            let Error::Shape { op: o, .. } = &e else {
                unreachable!()
            };
            let text = e.to_string();
            assert_eq!(*o, op, "wrong op in '{text}'");
            assert!(
                text.starts_with(&format!("{op}: ")),
                "'{text}' does not start with the op"
            );
            for n in needles {
                assert!(text.contains(n), "'{text}' does not name '{n}'");
            }
        }
        other => panic!("expected a {op} shape error naming {needles:?}, got {other:?}"),
    }
}

/// Asserts a dtype error of `op` about operand `operand` of dtype `found`.
#[track_caller]
fn dtype_err<T: std::fmt::Debug>(r: Result<T>, op: &str, operand: &str, found: DType) {
    match r {
        Err(e @ Error::DType { .. }) => {
            let Error::DType {
                op: o,
                operand: name,
                found: f,
                ..
            } = &e
            else {
                unreachable!()
            };
            let text = e.to_string();
            assert_eq!((*o, name.as_str(), *f), (op, operand, found), "'{text}'");
            assert!(text.starts_with(&format!("{op}: ")), "'{text}'");
            assert!(text.contains(&format!("'{operand}'")), "'{text}'");
            assert!(text.contains(found.name()), "'{text}'");
        }
        other => panic!("expected a {op} dtype error on '{operand}', got {other:?}"),
    }
}

/// Asserts a planning/execution error whose message names every needle.
#[track_caller]
fn plan_err<T: std::fmt::Debug>(r: Result<T>, needles: &[&str]) {
    match r {
        Err(e @ Error::Plan(_)) => {
            let text = e.to_string();
            for n in needles {
                assert!(text.contains(n), "'{text}' does not name '{n}'");
            }
        }
        other => panic!("expected a plan error naming {needles:?}, got {other:?}"),
    }
}

/// Asserts an unknown-tensor error naming `id`.
#[track_caller]
fn unknown_err<T: std::fmt::Debug>(r: Result<T>, id: TensorId) {
    match r {
        Err(e @ Error::UnknownTensor(_)) => {
            assert!(e.to_string().contains(&format!("{id:?}")), "'{e}'");
        }
        other => panic!("expected an unknown tensor error for {id:?}, got {other:?}"),
    }
}

fn input(g: &mut Graph, name: &str, dt: DType, shape: &[usize]) -> TensorId {
    g.input(name, dt, shape).unwrap()
}

/// A state leaf in a fresh CPU buffer.
fn state(be: &mut CpuBackend, g: &mut Graph, name: &str, dt: DType, shape: &[usize]) -> TensorId {
    let bytes = shape.iter().product::<usize>() * dt.block_bytes();
    let buffer = be.alloc_buffer(bytes).unwrap();
    g.state(name, dt, shape, BufferRef { buffer, offset: 0 })
        .unwrap()
}

#[test]
fn leaves_reject_bad_shapes() {
    let mut be = CpuBackend::new();
    let buffer = be.alloc_buffer(64).unwrap();
    let r = BufferRef { buffer, offset: 0 };
    let mut g = Graph::new();
    shape_err(g.input("x", DType::F32, &[]), "input", &["[]"]);
    shape_err(
        g.input("x", DType::F32, &[1, 2, 3, 4, 5]),
        "input",
        &["[1, 2, 3, 4, 5]"],
    );
    shape_err(g.input("x", DType::F32, &[4, 0]), "input", &["[4, 0]"]);
    shape_err(g.weight("w", DType::F16, &[0], r), "weight", &["[0]"]);
    shape_err(g.weight("w", DType::F16, &[], r), "weight", &["[]"]);
    shape_err(
        g.state("s", DType::F32, &[2, 3, 0, 1], r),
        "state",
        &["[2, 3, 0, 1]"],
    );
    shape_err(
        g.state("s", DType::F32, &[1, 1, 1, 1, 1], r),
        "state",
        &["[1, 1, 1, 1, 1]"],
    );
    // Absurd sizes are errors, not overflows.
    let huge = [1usize << 40, 1 << 40];
    shape_err(
        g.input("x", DType::F32, &huge),
        "input",
        &["[1099511627776, 1099511627776]"],
    );
    shape_err(
        g.state("s", DType::F16, &[usize::MAX, 2], r),
        "state",
        &[&usize::MAX.to_string()],
    );
    assert!(g.is_empty(), "failed leaves must not be added");
    let a = g.input("a", DType::F32, &[4]).unwrap();
    shape_err(
        g.reshape(a, &[1 << 62, 1 << 62, 0x10, 1]),
        "reshape",
        &["4611686018427387904"],
    );
}

#[test]
fn views_check_bounds_and_empty_dims() {
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F32, &[10]); // 40 bytes
    shape_err(
        g.view_1d(a, 11, 0),
        "view",
        &["'a'", "[11, 1, 1, 1]", "44", "40"],
    );
    shape_err(g.view_1d(a, 10, 4), "view", &["'a'", "offset 4"]);
    shape_err(g.view_2d(a, 3, 4, 12, 0), "view", &["'a'", "[3, 4, 1, 1]"]);
    shape_err(
        g.view_3d(a, 2, 2, 3, 8, 16, 0),
        "view",
        &["'a'", "[2, 2, 3, 1]"],
    );
    shape_err(
        g.view_4d(a, [1, 1, 1, 11], 4, 4, 4, 0),
        "view",
        &["'a'", "[1, 1, 1, 11]"],
    );
    shape_err(
        g.view(a, [3, 1, 1, 1], [24, 4, 4, 4], 0),
        "view",
        &["'a'", "[24, 4, 4, 4]", "52"],
    );
    shape_err(g.view_2d(a, 0, 2, 4, 0), "view", &["[0, 2, 1, 1]", "empty"]);
    shape_err(
        g.view_4d(a, [1, 1, 0, 1], 4, 4, 4, 0),
        "view",
        &["[1, 1, 0, 1]", "empty"],
    );
    // A view of a view is bounded by the base's memory, counting the first view's offset.
    let v = g.view_1d(a, 5, 20).unwrap();
    g.view_1d(v, 5, 0).unwrap();
    shape_err(g.view_1d(v, 2, 16), "view", &["[2, 1, 1, 1]", "offset 16"]);
    // Absurd sizes are errors, not overflows.
    shape_err(g.view_1d(a, usize::MAX / 2, 0), "view", &["'a'"]);
    shape_err(
        g.view_4d(a, [1, usize::MAX / 4, 4, 1], 1 << 40, 1, 1, 0),
        "view",
        &["'a'"],
    );
}

#[test]
fn reshape_permute_transpose_after_errors() {
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F32, &[4, 3]);
    let t = g.transpose(a).unwrap();
    shape_err(
        g.reshape(t, &[12]),
        "reshape",
        &["not contiguous", "[3, 4, 1, 1]"],
    );
    let w = g.view_2d(a, 2, 3, 16, 0).unwrap();
    shape_err(
        g.reshape(w, &[6]),
        "reshape",
        &["not contiguous", "[2, 3, 1, 1]"],
    );
    shape_err(
        g.reshape(a, &[5, 2]),
        "reshape",
        &["'a'", "[4, 3, 1, 1]", "12", "[5, 2, 1, 1]", "10"],
    );
    shape_err(g.reshape(a, &[12, 0]), "reshape", &["[12, 0]"]);
    shape_err(g.reshape(a, &[]), "reshape", &["[]"]);
    shape_err(g.permute(a, [0, 0, 1, 2]), "permute", &["[0, 0, 1, 2]"]);
    shape_err(g.permute(a, [0, 1, 2, 4]), "permute", &["[0, 1, 2, 4]"]);
    // Ids of another graph (slots this graph does not have).
    let mut other = Graph::new();
    let mut foreign = input(&mut other, "f", DType::F32, &[1]);
    for _ in 0..8 {
        foreign = input(&mut other, "f", DType::F32, &[1]);
    }
    unknown_err(g.transpose(foreign), foreign);
    unknown_err(g.permute(foreign, [1, 0, 2, 3]), foreign);
    unknown_err(g.reshape(foreign, &[1]), foreign);
    unknown_err(g.view_1d(foreign, 1, 0), foreign);
    unknown_err(g.after(foreign, &[a]), foreign);
    unknown_err(g.after(a, &[foreign]), foreign);
    unknown_err(g.get(foreign), foreign);
    unknown_err(g.set_name(foreign, "x"), foreign);
    unknown_err(g.set_output(foreign), foreign);
    unknown_err(g.plan(&[foreign]), foreign);
    unknown_err(g.build_forward(&[a, foreign]), foreign);
}

#[test]
fn builders_reject_ids_of_another_graph() {
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F32, &[4, 3]);
    let mut other = Graph::new();
    let mut x = input(&mut other, "x", DType::F32, &[4, 3]);
    for _ in 0..8 {
        x = input(&mut other, "x", DType::F32, &[4, 3]);
    }
    let p = RopeParams::new(RopeMode::Normal, 4, 1e4);
    unknown_err(g.get_rows(a, x), x);
    unknown_err(g.add(a, x), x);
    unknown_err(g.mul(x, a), x);
    unknown_err(g.scale(x, 2.0), x);
    unknown_err(g.silu(x), x);
    unknown_err(g.gelu(x), x);
    unknown_err(g.rms_norm(x, 1e-5), x);
    unknown_err(g.norm(x, 1e-5), x);
    unknown_err(g.mul_mat(a, x), x);
    unknown_err(g.rope(x, a, p), x);
    unknown_err(g.cpy(x, a), x);
    unknown_err(g.cont(x), x);
    unknown_err(g.cast(x, DType::F16), x);
    unknown_err(g.set_rows(x, a, a), x);
    unknown_err(g.diag_mask_inf(x, 0), x);
    unknown_err(g.soft_max(x), x);
    unknown_err(g.soft_max_ext(a, Some(x), 1.0), x);
    unknown_err(g.argmax(x), x);
    unknown_err(g.top_k(x, 1), x);
}

#[test]
fn get_rows_errors() {
    let mut g = Graph::new();
    let table = input(&mut g, "table", DType::F32, &[8, 10, 3]);
    let itable = input(&mut g, "itable", DType::I32, &[8, 10]);
    let ids = input(&mut g, "ids", DType::I32, &[5, 3]);
    let fids = input(&mut g, "fids", DType::F32, &[5, 3]);
    let bad = input(&mut g, "bad_ids", DType::I32, &[5, 2]);
    let bad4 = input(&mut g, "ids4", DType::I32, &[5, 3, 1, 2]);
    dtype_err(g.get_rows(itable, ids), "get_rows", "itable", DType::I32);
    dtype_err(g.get_rows(table, fids), "get_rows", "fids", DType::F32);
    shape_err(
        g.get_rows(table, bad),
        "get_rows",
        &["'bad_ids'", "[5, 2, 1, 1]", "'table'", "[8, 10, 3, 1]"],
    );
    shape_err(
        g.get_rows(table, bad4),
        "get_rows",
        &["'ids4'", "[5, 3, 1, 2]"],
    );
    let bad3 = input(&mut g, "ids3", DType::I32, &[5, 3, 2]);
    shape_err(
        g.get_rows(table, bad3),
        "get_rows",
        &["'ids3'", "[5, 3, 2, 1]", "[8, 10, 3, 1]"],
    );
    g.get_rows(table, ids).unwrap();
}

#[test]
fn binary_errors() {
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F32, &[4, 6, 2]);
    let i = input(&mut g, "i", DType::I32, &[4, 6, 2]);
    let b = input(&mut g, "b", DType::F16, &[4, 4]);
    let c = input(&mut g, "c", DType::F32, &[4, 6, 4]);
    for (op, name) in [(0, "add"), (1, "mul")] {
        let f = |g: &mut Graph, x, y| if op == 0 { g.add(x, y) } else { g.mul(x, y) };
        dtype_err(f(&mut g, i, a), name, "i", DType::I32);
        dtype_err(f(&mut g, a, i), name, "i", DType::I32);
        shape_err(
            f(&mut g, a, b),
            name,
            &["'b'", "[4, 4, 1, 1]", "'a'", "[4, 6, 2, 1]"],
        );
        shape_err(f(&mut g, a, c), name, &["'c'", "[4, 6, 4, 1]"]);
    }
}

#[test]
fn unary_and_norm_errors() {
    let mut g = Graph::new();
    let i = input(&mut g, "ints", DType::I32, &[4, 2]);
    let a = input(&mut g, "a", DType::BF16, &[4, 2]);
    dtype_err(g.scale(i, 2.0), "scale", "ints", DType::I32);
    dtype_err(g.silu(i), "silu", "ints", DType::I32);
    dtype_err(g.gelu(i), "gelu", "ints", DType::I32);
    dtype_err(g.rms_norm(i, 1e-5), "rms_norm", "ints", DType::I32);
    dtype_err(g.norm(i, 1e-5), "norm", "ints", DType::I32);
    for eps in [f32::NAN, -1e-6, f32::INFINITY] {
        shape_err(g.rms_norm(a, eps), "rms_norm", &["eps", &eps.to_string()]);
        shape_err(g.norm(a, eps), "norm", &["eps", &eps.to_string()]);
    }
    g.rms_norm(a, 0.0).unwrap();
}

#[test]
fn mul_mat_errors() {
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F16, &[8, 5, 2, 3]);
    let i = input(&mut g, "i", DType::I32, &[8, 5]);
    let k = input(&mut g, "k7", DType::F32, &[7, 4, 2, 3]);
    let r2 = input(&mut g, "odd_heads", DType::F32, &[8, 4, 3, 3]);
    let r3 = input(&mut g, "odd_batch", DType::F32, &[8, 4, 2, 4]);
    let ok = input(&mut g, "b", DType::F32, &[8, 4, 6, 6]);
    dtype_err(g.mul_mat(i, ok), "mul_mat", "i", DType::I32);
    dtype_err(g.mul_mat(a, i), "mul_mat", "i", DType::I32);
    shape_err(
        g.mul_mat(a, k),
        "mul_mat",
        &["'a'", "[8, 5, 2, 3]", "'k7'", "[7, 4, 2, 3]"],
    );
    shape_err(
        g.mul_mat(a, r2),
        "mul_mat",
        &["'odd_heads'", "[8, 4, 3, 3]"],
    );
    shape_err(
        g.mul_mat(a, r3),
        "mul_mat",
        &["'odd_batch'", "[8, 4, 2, 4]"],
    );
    // The broadcast goes one way only: the first operand is broadcast over the second.
    shape_err(g.mul_mat(ok, a), "mul_mat", &["'b'", "'a'"]);
    let y = g.mul_mat(a, ok).unwrap();
    assert_eq!(g.tensor(y).ne, [5, 4, 6, 6]);
}

#[test]
fn rope_errors() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", DType::F32, &[8, 2, 3]);
    let xi = input(&mut g, "xi", DType::I32, &[8, 2, 3]);
    let pos = input(&mut g, "pos", DType::I32, &[3]);
    let fpos = input(&mut g, "fpos", DType::F32, &[3]);
    let short = input(&mut g, "short_pos", DType::I32, &[2]);
    let pos2d = input(&mut g, "pos2d", DType::I32, &[3, 2]);
    let p = RopeParams::new(RopeMode::Neox, 8, 1e4);
    dtype_err(g.rope(xi, pos, p), "rope", "xi", DType::I32);
    dtype_err(g.rope(x, fpos, p), "rope", "fpos", DType::F32);
    shape_err(
        g.rope(x, short, p),
        "rope",
        &["'short_pos'", "[2, 1, 1, 1]", "'x'", "[8, 2, 3, 1]"],
    );
    shape_err(g.rope(x, pos2d, p), "rope", &["'pos2d'", "[3, 2, 1, 1]"]);
    for n_dims in [0, 3, 10] {
        let q = RopeParams { n_dims, ..p };
        shape_err(
            g.rope(x, pos, q),
            "rope",
            &[&format!("n_dims {n_dims}"), "'x'", "[8, 2, 3, 1]"],
        );
    }
    for freq_base in [0.0, -1e4, f32::NAN, f32::INFINITY] {
        let q = RopeParams { freq_base, ..p };
        shape_err(
            g.rope(x, pos, q),
            "rope",
            &[&format!("freq_base {freq_base}")],
        );
    }
    for freq_scale in [f32::NAN, f32::INFINITY, 0.0, -0.5] {
        let q = RopeParams { freq_scale, ..p };
        shape_err(
            g.rope(x, pos, q),
            "rope",
            &[&format!("freq_scale {freq_scale}")],
        );
    }
    let good = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    };
    g.rope(
        x,
        pos,
        RopeParams {
            llama3: Some(good),
            ..p
        },
    )
    .unwrap();
    let bad = [
        Llama3Scaling {
            factor: 0.0,
            ..good
        },
        Llama3Scaling {
            low_freq_factor: 4.0,
            ..good
        },
        Llama3Scaling {
            low_freq_factor: 0.0,
            ..good
        },
        Llama3Scaling {
            original_max_position: 0,
            ..good
        },
    ];
    for s in bad {
        let q = RopeParams {
            llama3: Some(s),
            ..p
        };
        shape_err(
            g.rope(x, pos, q),
            "rope",
            &["Llama 3", &format!("factor: {:?}", s.factor)],
        );
    }
}

#[test]
fn cpy_cont_cast_errors() {
    let mut be = CpuBackend::new();
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F32, &[4, 3]);
    let ai = input(&mut g, "ai", DType::I32, &[4, 3]);
    let cache = state(&mut be, &mut g, "cache", DType::F16, &[4, 8]);
    let icache = state(&mut be, &mut g, "icache", DType::I32, &[4, 8]);
    let dst = g.view_2d(cache, 4, 3, 8, 0).unwrap();
    let idst = g.view_2d(icache, 4, 3, 16, 0).unwrap();
    dtype_err(g.cpy(ai, dst), "cpy", "ai", DType::I32);
    let idst_name = g.tensor(idst).name.clone();
    dtype_err(g.cpy(a, idst), "cpy", &idst_name, DType::I32);
    let small = g.view_2d(cache, 4, 2, 8, 0).unwrap();
    let small_name = g.tensor(small).name.clone();
    shape_err(
        g.cpy(a, small),
        "cpy",
        &[
            "'a'",
            "[4, 3, 1, 1]",
            "12",
            &small_name,
            "[4, 2, 1, 1]",
            "8",
        ],
    );
    // Destinations that are not state: an input, a weight, a computed tensor, a view of
    // an input.
    let buffer = be.alloc_buffer(48).unwrap();
    let w = g
        .weight("w", DType::F32, &[4, 3], BufferRef { buffer, offset: 0 })
        .unwrap();
    let other = input(&mut g, "other", DType::F32, &[12]);
    let computed = g.scale(a, 2.0).unwrap();
    g.set_name(computed, "scaled").unwrap();
    let view_of_input = g.view_1d(other, 12, 0).unwrap();
    for (d, name) in [
        (other, "other"),
        (w, "w"),
        (computed, "scaled"),
        (view_of_input, "other"),
    ] {
        shape_err(g.cpy(a, d), "cpy", &["state", &format!("'{name}'")]);
    }
    g.cpy(a, dst).unwrap();
    // cast between float and integer dtypes.
    dtype_err(g.cast(a, DType::I32), "cast", "a", DType::F32);
    dtype_err(g.cast(ai, DType::F16), "cast", "ai", DType::I32);
    g.cont(ai).unwrap();
    g.cast(ai, DType::I32).unwrap();
}

#[test]
fn set_rows_errors() {
    let mut be = CpuBackend::new();
    let mut g = Graph::new();
    let cache = state(&mut be, &mut g, "cache", DType::F16, &[8, 16, 2, 3]);
    let icache = state(&mut be, &mut g, "icache", DType::I32, &[8, 16, 2, 3]);
    let src = input(&mut g, "src", DType::F32, &[8, 5, 2, 3]);
    let isrc = input(&mut g, "isrc", DType::I32, &[8, 5, 2, 3]);
    let ids = input(&mut g, "ids", DType::I32, &[5, 2, 3]);
    let fids = input(&mut g, "fids", DType::F32, &[5, 2, 3]);
    dtype_err(
        g.set_rows(icache, src, ids),
        "set_rows",
        "icache",
        DType::I32,
    );
    dtype_err(g.set_rows(cache, isrc, ids), "set_rows", "isrc", DType::I32);
    dtype_err(g.set_rows(cache, src, fids), "set_rows", "fids", DType::F32);
    let cases: [(&str, &[usize], &str, &[usize]); 7] = [
        ("src_ne0", &[7, 5, 2, 3], "ids", &[5, 2, 3]),
        ("src_ne2", &[8, 5, 1, 3], "ids", &[5, 1, 3]),
        ("src_ne3", &[8, 5, 2, 1], "ids", &[5, 2, 1]),
        ("src", &[8, 5, 2, 3], "ids_n", &[4, 2, 3]),
        ("src", &[8, 5, 2, 3], "ids_i2", &[5, 3, 3]),
        ("src", &[8, 5, 2, 3], "ids_i3", &[5, 2, 2]),
        ("src", &[8, 5, 2, 3], "ids_4d", &[5, 2, 3, 2]),
    ];
    for (sname, sshape, iname, ishape) in cases {
        let s = if sname == "src" {
            src
        } else {
            input(&mut g, sname, DType::F32, sshape)
        };
        let i = if iname == "ids" {
            ids
        } else {
            input(&mut g, iname, DType::I32, ishape)
        };
        let (sne, ine) = (g.tensor(s).ne, g.tensor(i).ne);
        shape_err(
            g.set_rows(cache, s, i),
            "set_rows",
            &[
                &format!("'{sname}'"),
                &graft::graph::fmt_ne(&sne),
                &format!("'{iname}'"),
                &graft::graph::fmt_ne(&ine),
                "'cache'",
                "[8, 16, 2, 3]",
            ],
        );
    }
    // Broadcast ids are fine.
    let bids = input(&mut g, "bids", DType::I32, &[5, 1, 3]);
    g.set_rows(cache, src, bids).unwrap();
    // Not a state.
    let not_state = input(&mut g, "not_state", DType::F32, &[8, 16, 2, 3]);
    shape_err(
        g.set_rows(not_state, src, ids),
        "set_rows",
        &["'not_state'", "state"],
    );
}

#[test]
fn attention_row_op_errors() {
    let mut g = Graph::new();
    let a = input(&mut g, "a", DType::F32, &[6, 4, 2]);
    let ai = input(&mut g, "ai", DType::I32, &[6, 4, 2]);
    let bmask = input(&mut g, "bmask", DType::BF16, &[6, 4]);
    let imask = input(&mut g, "imask", DType::I32, &[6, 4]);
    let wide = input(&mut g, "wide_mask", DType::F32, &[7, 4]);
    let rows3 = input(&mut g, "mask_rows3", DType::F16, &[6, 3]);
    let deep = input(&mut g, "deep_mask", DType::F32, &[6, 4, 3]);
    dtype_err(g.diag_mask_inf(ai, 1), "diag_mask_inf", "ai", DType::I32);
    dtype_err(g.soft_max(ai), "soft_max", "ai", DType::I32);
    dtype_err(
        g.soft_max_ext(a, Some(bmask), 1.0),
        "soft_max",
        "bmask",
        DType::BF16,
    );
    dtype_err(
        g.soft_max_ext(a, Some(imask), 1.0),
        "soft_max",
        "imask",
        DType::I32,
    );
    for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        shape_err(
            g.soft_max_ext(a, None, scale),
            "soft_max",
            &["scale", &scale.to_string()],
        );
    }
    for (m, name, ne) in [
        (wide, "wide_mask", "[7, 4, 1, 1]"),
        (rows3, "mask_rows3", "[6, 3, 1, 1]"),
        (deep, "deep_mask", "[6, 4, 3, 1]"),
    ] {
        shape_err(
            g.soft_max_ext(a, Some(m), 1.0),
            "soft_max",
            &[&format!("'{name}'"), ne, "'a'", "[6, 4, 2, 1]"],
        );
    }
    dtype_err(g.argmax(ai), "argmax", "ai", DType::I32);
    dtype_err(g.top_k(ai, 1), "top_k", "ai", DType::I32);
    // k in 1..=min(row, 1024)
    for k in [0, 7] {
        shape_err(
            g.top_k(a, k),
            "top_k",
            &[&format!("k = {k}"), "'a'", "[6, 4, 2, 1]", "1..=6"],
        );
    }
    let long = input(&mut g, "long", DType::F32, &[5000]);
    shape_err(g.top_k(long, 1025), "top_k", &["k = 1025", "1..=1024"]);
    assert!(g.top_k(long, 1024).is_ok());
}

#[test]
fn running_a_plan_errors() {
    let mut be = CpuBackend::new();
    let mut g = Graph::new();
    let x = input(&mut g, "x", DType::F32, &[4, 3]);
    let y = input(&mut g, "y", DType::F16, &[4, 3]);
    let buffer = be.alloc_buffer(48).unwrap();
    let w = g
        .weight("w", DType::F32, &[4, 3], BufferRef { buffer, offset: 0 })
        .unwrap();
    let s = g.add(x, y).unwrap();
    let s = g.add(s, w).unwrap();
    let mid = g.scale(s, 2.0).unwrap();
    let out = g.silu(mid).unwrap();
    g.set_name(out, "out").unwrap();
    let plan = g.plan(&[out]).unwrap();
    let e = be.load(&plan).unwrap();
    // Inputs: wrong length, not an input (an output, a weight, an intermediate).
    plan_err(
        be.set_input(e, x, &[0u8; 47]),
        &["'x'", "f32", "[4, 3, 1, 1]", "48", "47"],
    );
    plan_err(be.set_input(e, y, &[0u8; 48]), &["'y'", "f16", "24", "48"]);
    for id in [out, w, mid] {
        plan_err(
            be.set_input(e, id, &[0u8; 48]),
            &[&format!("{id:?}"), "not an input"],
        );
    }
    // Compute before every input was written.
    be.set_input_f32(e, x, &[1.0; 12]).unwrap();
    plan_err(be.compute(e), &["'y'", "never written"]);
    be.set_input(e, y, &[0u8; 24]).unwrap();
    be.compute(e).unwrap();
    // Outputs: not an output, wrong length.
    plan_err(
        be.get_output(e, mid, &mut [0u8; 48]),
        &[&format!("{mid:?}"), "not an output"],
    );
    plan_err(be.get_output(e, x, &mut [0u8; 48]), &["not an output"]);
    plan_err(
        be.get_output(e, out, &mut [0u8; 40]),
        &["'out'", "48", "40"],
    );
    be.get_output_f32(e, out, 12).unwrap();
    // A plan that is gone.
    be.unload(e).unwrap();
    plan_err(be.compute(e), &["no loaded plan"]);
    plan_err(be.unload(e), &["no loaded plan"]);
}

#[test]
fn reading_a_non_contiguous_output_errors() {
    let mut be = CpuBackend::new();
    let mut g = Graph::new();
    let buffer = be.alloc_buffer(4 * 8 * 2).unwrap();
    let cache = g
        .state(
            "cache",
            DType::F16,
            &[4, 8],
            BufferRef { buffer, offset: 0 },
        )
        .unwrap();
    let x = input(&mut g, "x", DType::F32, &[3, 2]);
    let dst = g.view_2d(cache, 3, 2, 8, 2).unwrap();
    let w = g.cpy(x, dst).unwrap();
    g.set_name(w, "written").unwrap();
    let plan = g.plan(&[w]).unwrap();
    let e = be.load(&plan).unwrap();
    be.set_input_f32(e, x, &[1.0; 6]).unwrap();
    be.compute(e).unwrap();
    plan_err(
        be.get_output(e, w, &mut [0u8; 12]),
        &["'written'", "not contiguous"],
    );
}

#[test]
fn plans_with_bad_buffers_do_not_load() {
    let mut be = CpuBackend::new();
    let mut other = CpuBackend::new();
    let theirs = other.alloc_buffer(48).unwrap();
    let small = be.alloc_buffer(40).unwrap();
    let freed = be.alloc_buffer(48).unwrap();
    be.free_buffer(freed).unwrap();
    let cases = [
        (
            "nobody",
            BufferRef {
                buffer: BufferId::fresh(),
                offset: 0,
            },
            "does not belong",
        ),
        (
            "theirs",
            BufferRef {
                buffer: theirs,
                offset: 0,
            },
            "does not belong",
        ),
        (
            "freed",
            BufferRef {
                buffer: freed,
                offset: 0,
            },
            "does not belong",
        ),
        (
            "too_small",
            BufferRef {
                buffer: small,
                offset: 0,
            },
            "which has 40",
        ),
        (
            "offset_past_end",
            BufferRef {
                buffer: small,
                offset: 16,
            },
            "which has 40",
        ),
        (
            "huge_offset",
            BufferRef {
                buffer: small,
                offset: usize::MAX - 8,
            },
            "which has 40",
        ),
    ];
    for (name, r, why) in cases {
        let mut g = Graph::new();
        let w = g.weight(name, DType::F32, &[4, 3], r).unwrap();
        let x = input(&mut g, "x", DType::F32, &[4, 3]);
        let y = g.add(x, w).unwrap();
        let plan = g.plan(&[y]).unwrap();
        plan_err(be.load(&plan), &[&format!("'{name}'"), why]);
    }
    // The same for a state written through a view.
    let mut g = Graph::new();
    let s = g
        .state(
            "kv",
            DType::F16,
            &[4, 8],
            BufferRef {
                buffer: small,
                offset: 0,
            },
        )
        .unwrap();
    let x = input(&mut g, "x", DType::F32, &[4]);
    let v = g.view_1d(s, 4, 48).unwrap();
    let c = g.cpy(x, v).unwrap();
    let plan = g.plan(&[c]).unwrap();
    plan_err(be.load(&plan), &["'kv'", "which has 40"]);
}

#[test]
fn buffer_access_errors() {
    let mut be = CpuBackend::new();
    let b = be.alloc_buffer(16).unwrap();
    let stranger = BufferId::fresh();
    plan_err(be.write_buffer(b, 12, &[0u8; 8]), &["12", "16"]);
    plan_err(be.read_buffer(b, 0, &mut [0u8; 17]), &["17", "16"]);
    plan_err(be.write_buffer(b, usize::MAX, &[0u8; 2]), &["16"]);
    plan_err(
        be.write_buffer(stranger, 0, &[0u8; 1]),
        &[&format!("{stranger:?}")],
    );
    plan_err(be.free_buffer(stranger), &[&format!("{stranger:?}")]);
    plan_err(be.fill_random(b, 0, DType::I32, 4, 1, 1.0), &["i32"]);
    plan_err(be.fill_random(b, 8, DType::F32, 4, 1, 1.0), &["16"]);
}

proptest! {
    #![proptest_config(common::config(48))]

    #[test]
    fn prop_get_rows_index_out_of_range(case in st::index_out_of_range(false)) {
        common::check_index_error(&case, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn prop_set_rows_index_out_of_range(case in st::index_out_of_range(true)) {
        common::check_index_error(&case, &mut CpuBackend::new()).map_err(TestCaseError::fail)?;
    }
}
