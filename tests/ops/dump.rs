//! The text and DOT dumps: snapshots of a small fixed graph (checked-in files under
//! tests/snapshots, rewritten with `UPDATE_SNAPSHOTS=1`), structural checks that do not
//! depend on the snapshot, and a Graphviz run over a transformer block (skipped when
//! `dot` is not installed, unless `GRAFT_REQUIRE_DOT=1`).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use graft::graph::dump::{dot, text};
use graft::graph::{AllocKind, BufferId, BufferRef, DType, Graph, Plan, TensorId};

#[path = "../../examples/dump_block.rs"]
#[allow(dead_code)] // the example's main() is not used here
mod dump_block;

/// The small graph of the snapshots: two inputs, a weight in buffer 7 at offset 64, a
/// mul_mat, a strided view, a permute, a cont, an in-place silu, an add and an output;
/// one name with a space and quotes.
fn small_graph() -> (Graph, Plan) {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[4, 3]).unwrap();
    let w = g
        .weight(
            "w",
            DType::F32,
            &[4, 6],
            BufferRef {
                buffer: BufferId(7),
                offset: 64,
            },
        )
        .unwrap();
    let bias = g.input("bias", DType::F32, &[3]).unwrap();
    let y = g.mul_mat(w, x).unwrap(); // [6, 3]
    let nb1 = g.tensor(y).nb[1];
    let win = g.view_2d(y, 4, 3, nb1, 8).unwrap(); // [4, 3], columns 2..6
    let win = g.set_name(win, "y window").unwrap();
    let t = g.permute(win, [1, 0, 2, 3]).unwrap(); // [3, 4], not contiguous
    let c = g.cont(t).unwrap(); // [3, 4]
    let s = g.silu(c).unwrap(); // in place over c
    let s = g.set_name(s, "act \"silu\"").unwrap();
    let out = g.add(s, bias).unwrap(); // [3, 4] + [3], in place over s
    let out = g.set_name(out, "out").unwrap();
    g.set_output(out).unwrap();
    let plan = g.plan(&[out]).unwrap();
    (g, plan)
}

fn snapshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name)
}

/// Compares `actual` with the checked-in snapshot; with `UPDATE_SNAPSHOTS=1` rewrites
/// the file instead of failing.
fn check_snapshot(name: &str, actual: &str) {
    let path = snapshot_path(name);
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected == actual {
        return;
    }
    if std::env::var("UPDATE_SNAPSHOTS").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        eprintln!("updated snapshot {}", path.display());
        return;
    }
    let (exp, act): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    let mut diff = String::new();
    for i in 0..exp.len().max(act.len()) {
        let (e, a) = (exp.get(i), act.get(i));
        if e != a {
            if let Some(e) = e {
                diff.push_str(&format!("-{:>4} {e}\n", i + 1));
            }
            if let Some(a) = a {
                diff.push_str(&format!("+{:>4} {a}\n", i + 1));
            }
        }
    }
    panic!(
        "snapshot {} differs (- expected, + actual, by line):\n{diff}\nrerun with UPDATE_SNAPSHOTS=1 to accept the new output",
        path.display()
    );
}

#[test]
fn text_snapshot() {
    let (g, plan) = small_graph();
    check_snapshot("small.txt", &text(&g, &plan));
}

#[test]
fn dot_snapshot() {
    let (g, plan) = small_graph();
    check_snapshot("small.dot", &dot(&g, &plan));
}

/// The text dump has a header, a title row and one row per node with its index, op,
/// name, dtype, shape, sources and memory, whatever the snapshot says.
#[test]
fn text_has_one_row_per_node() {
    let (g, plan) = small_graph();
    let out = text(&g, &plan);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), plan.forward.order.len() + 2);
    assert!(lines[0].starts_with("# graft graph:"));
    let pos = |id: TensorId| plan.forward.order.iter().position(|&x| x == id).unwrap();
    for (i, &id) in plan.forward.order.iter().enumerate() {
        let t = g.tensor(id);
        let row = lines[i + 2];
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[0], i.to_string(), "row {row}");
        assert_eq!(cols[1], t.op.name(), "row {row}");
        assert!(row.contains(t.dtype.name()), "row {row}");
        let ne = format!("[{},{},{},{}]", t.ne[0], t.ne[1], t.ne[2], t.ne[3]);
        assert!(row.contains(&ne), "row {row} lacks {ne}");
        for s in &t.src {
            assert!(row.contains(&format!("#{}", pos(*s))), "row {row}");
        }
        let a = plan.alloc.info[id];
        let mem = match a.kind {
            AllocKind::InPlace(p) => format!("inplace(#{}) @{}", pos(p), a.offset),
            AllocKind::View(b) if g.tensor(b).data.is_none() => {
                format!("view(#{}) @{}", pos(b), a.offset)
            }
            AllocKind::View(b) => format!("view(#{})", pos(b)),
            AllocKind::Arena if t.op.is_leaf() => format!("input @{}", a.offset),
            AllocKind::Arena => format!("arena @{}", a.offset),
            AllocKind::External => "weight buf7@64".to_string(),
        };
        assert!(row.contains(&mem), "row {row} lacks {mem}");
    }
    assert!(
        out.contains("\"act \\\"silu\\\"\""),
        "odd name quoted:\n{out}"
    );
    assert!(out.contains("output"), "output marked:\n{out}");
    assert!(plan.steps.iter().filter(|s| s.inplace).count() >= 2);
}

/// The DOT dump has a node per tensor and an edge per source, with escaped labels.
#[test]
fn dot_has_a_node_per_tensor_and_an_edge_per_source() {
    let (g, plan) = small_graph();
    let out = dot(&g, &plan);
    assert!(out.starts_with("digraph graft {\n") && out.ends_with("}\n"));
    let pos = |id: TensorId| plan.forward.order.iter().position(|&x| x == id).unwrap();
    let mut n_edges = 0;
    for (i, &id) in plan.forward.order.iter().enumerate() {
        assert_eq!(out.matches(&format!("  n{i} [label=\"#{i} ")).count(), 1);
        for (k, s) in g.tensor(id).src.iter().enumerate() {
            let edge = format!("  n{} -> n{i} [label=\"{k}\"", pos(*s));
            assert!(out.contains(&edge), "missing {edge}");
            n_edges += 1;
        }
    }
    assert_eq!(out.matches(" -> n").count(), n_edges);
    assert!(out.contains(" act \\\"silu\\\"\\n"), "quotes escaped");
    assert!(out.contains("subgraph cluster_legend"));
}

/// Runs `dot -Tsvg` on `src`. `None` when Graphviz is not installed (a failure when
/// `GRAFT_REQUIRE_DOT=1`).
fn render_svg(src: &str) -> Option<String> {
    let child = Command::new("dot")
        .arg("-Tsvg")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::env::var("GRAFT_REQUIRE_DOT").as_deref() == Ok("1") {
                panic!("GRAFT_REQUIRE_DOT=1 but graphviz `dot` is not on PATH");
            }
            println!("skipped: graphviz not installed");
            return None;
        }
        Err(e) => panic!("could not start dot: {e}"),
    };
    let mut stdin = child.stdin.take().unwrap();
    let input = src.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "dot failed ({}):\n{stderr}",
        out.status
    );
    assert!(
        !stderr.to_lowercase().contains("warning"),
        "dot warned:\n{stderr}"
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

#[test]
fn graphviz_renders_a_transformer_block() {
    let c = dump_block::BlockConfig::small();
    let mut g = Graph::new();
    let mut next = 100;
    let block = dump_block::build_block(&mut g, &c, |_, _| {
        next += 1;
        Ok(BufferRef {
            buffer: BufferId(next),
            offset: 0,
        })
    })
    .unwrap();
    let [kw, vw] = block.cache_writes;
    let plan = g.plan(&[kw, vw, block.out]).unwrap();
    assert!(
        plan.forward.order.len() >= 30,
        "{} nodes",
        plan.forward.order.len()
    );
    let src = dot(&g, &plan);
    let Some(svg) = render_svg(&src) else {
        return;
    };
    assert!(svg.contains("<svg"), "no <svg in dot's output");
    // Every node made it into the picture.
    for i in 0..plan.forward.order.len() {
        assert!(
            svg.contains(&format!("<title>n{i}</title>")),
            "node n{i} missing"
        );
    }
}

#[test]
fn graphviz_accepts_odd_names() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[4]).unwrap();
    let y = g.silu(x).unwrap();
    let y = g
        .set_name(y, "quote\" back\\slash\nnewline {braces} <angle> |bar|")
        .unwrap();
    let z = g.scale(y, 2.0).unwrap();
    let z = g.set_name(z, "").unwrap();
    let plan = g.plan(&[z]).unwrap();
    let table = text(&g, &plan);
    assert_eq!(
        table.lines().count(),
        plan.forward.order.len() + 2,
        "{table}"
    );
    if let Some(svg) = render_svg(&dot(&g, &plan)) {
        assert!(svg.contains("<svg"));
    }
}
