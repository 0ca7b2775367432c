//! Graph dumps for debugging: a text table with one row per node, and a Graphviz DOT
//! export (render with `dot -Tsvg graph.dot -o graph.svg`).
//!
//! Both show the plan's execution order with each node's op, name, dtype, `ne`, `nb`,
//! sources, and where its memory is: its own arena block, a block taken over in place,
//! a view of another tensor, or a backend buffer.

use std::fmt::Write as _;

use slotmap::SecondaryMap;

use super::alloc::{AllocInfo, AllocKind};
use super::{Flags, Graph, Plan, TensorId};
use crate::ops::OpKind;

fn shape(ne: &[usize; 4]) -> String {
    format!("[{},{},{},{}]", ne[0], ne[1], ne[2], ne[3])
}

/// Index of each node of the plan's order.
fn indices(plan: &Plan) -> SecondaryMap<TensorId, usize> {
    let mut idx = SecondaryMap::new();
    for (i, &id) in plan.forward.order.iter().enumerate() {
        idx.insert(id, i);
    }
    idx
}

/// The memory column: `input @off +size`, `arena @off +size`, `inplace(#i) @off`, ...
fn memory(g: &Graph, plan: &Plan, idx: &SecondaryMap<TensorId, usize>, id: TensorId) -> String {
    let t = g.tensor(id);
    let Some(&AllocInfo { kind, offset, size }) = plan.alloc.info.get(id) else {
        return "-".into();
    };
    let base_external = |b: TensorId| g.tensor(b).data;
    match kind {
        AllocKind::Arena if t.flags.contains(Flags::INPUT) => format!("input @{offset} +{size}"),
        AllocKind::Arena => format!("arena @{offset} +{size}"),
        AllocKind::InPlace(p) => format!("inplace(#{}) @{offset} +{size}", idx[p]),
        AllocKind::View(b) => match base_external(b) {
            Some(r) => format!(
                "view(#{}) buf{}@{} +{size}",
                idx[b],
                r.buffer.0,
                r.offset + t.view_offs
            ),
            None => format!("view(#{}) @{offset} +{size}", idx[b]),
        },
        AllocKind::External => {
            let r = t.data.expect("external tensors have data");
            let what = if t.flags.contains(Flags::STATE) {
                "state"
            } else {
                "weight"
            };
            format!("{what} buf{}@{} +{size}", r.buffer.0, r.offset)
        }
    }
}

/// A text table of the plan: one row per node in execution order.
pub fn text(g: &Graph, plan: &Plan) -> String {
    let idx = indices(plan);
    let r = plan.alloc.report;
    let mut rows: Vec<[String; 9]> = vec![[
        "idx", "op", "name", "dtype", "ne", "nb", "src", "memory", "params",
    ]
    .map(String::from)];
    for (i, &id) in plan.forward.order.iter().enumerate() {
        let t = g.tensor(id);
        let src = if t.src.is_empty() {
            "-".to_string()
        } else {
            t.src
                .iter()
                .map(|s| format!("#{}", idx[*s]))
                .collect::<Vec<_>>()
                .join(",")
        };
        rows.push([
            i.to_string(),
            t.op.name().to_string(),
            t.name.clone(),
            t.dtype.name().to_string(),
            shape(&t.ne),
            shape(&t.nb),
            src,
            memory(g, plan, &idx, id),
            t.op.params(),
        ]);
    }
    let mut width = [0usize; 9];
    for row in &rows {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let n_leaf = plan.forward.leaves(g).count();
    let mut out = format!(
        "# graft graph: {} nodes ({} leaves, {} steps), arena {} B planned, {} B naive, {} in place, {} views\n",
        plan.forward.order.len(),
        n_leaf,
        plan.steps.len(),
        r.peak_bytes,
        r.naive_bytes,
        r.n_inplace,
        r.n_views
    );
    for row in &rows {
        let mut line = String::new();
        for (k, (c, w)) in row.iter().zip(width).enumerate() {
            if k == 0 {
                let _ = write!(line, "{c:>w$}");
            } else {
                let _ = write!(line, "  {c:<w$}");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Escapes a string for a double-quoted DOT label.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Fill colour per op kind.
fn colour(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Leaf => "#ffffff",
        OpKind::View => "#eeeeee",
        OpKind::Data => "#c7e9c0",
        OpKind::Elementwise => "#c6dbef",
        OpKind::Row => "#fdd0a2",
        OpKind::MatMul => "#fcbba1",
    }
}

/// A Graphviz DOT description of the plan: nodes coloured by op kind, inputs as
/// ellipses, weights as folders, state as cylinders, views dashed; edges go from
/// sources to users and are labelled with the operand position.
pub fn dot(g: &Graph, plan: &Plan) -> String {
    let idx = indices(plan);
    let r = plan.alloc.report;
    let mut out = String::new();
    out.push_str("digraph graft {\n");
    let _ = writeln!(
        out,
        "  label=\"graft graph: {} nodes, arena {} B planned / {} B naive\";",
        plan.forward.order.len(),
        r.peak_bytes,
        r.naive_bytes
    );
    out.push_str("  rankdir=TB;\n  node [shape=box, style=\"rounded,filled\", fontname=\"monospace\", fontsize=10];\n  edge [fontsize=8, color=\"#555555\"];\n");
    for (i, &id) in plan.forward.order.iter().enumerate() {
        let t = g.tensor(id);
        let kind = t.op.kind();
        let (shape_attr, style) = if t.flags.contains(Flags::INPUT) {
            ("ellipse", "filled")
        } else if t.flags.contains(Flags::WEIGHT) {
            ("folder", "filled")
        } else if t.flags.contains(Flags::STATE) {
            ("cylinder", "filled")
        } else if kind == OpKind::View {
            ("box", "rounded,filled,dashed")
        } else {
            ("box", "rounded,filled")
        };
        let fill = if t.flags.contains(Flags::INPUT) {
            "#ffffb3"
        } else if t.flags.intersects(Flags::WEIGHT | Flags::STATE) {
            "#d9d9d9"
        } else {
            colour(kind)
        };
        let params = t.op.params();
        let mut label = format!(
            "#{i} {}\\n{} {} {}",
            esc(&t.name),
            t.op.name(),
            t.dtype,
            shape(&t.ne)
        );
        if !params.is_empty() {
            let _ = write!(label, "\\n{}", esc(&params));
        }
        let _ = write!(label, "\\n{}", esc(&memory(g, plan, &idx, id)));
        let pen = if t.flags.contains(Flags::OUTPUT) || plan.forward.outputs.contains(&id) {
            ", penwidth=2.5"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  n{i} [label=\"{label}\", shape={shape_attr}, style=\"{style}\", fillcolor=\"{fill}\"{pen}];"
        );
    }
    for (i, &id) in plan.forward.order.iter().enumerate() {
        for (k, s) in g.tensor(id).src.iter().enumerate() {
            let _ = writeln!(out, "  n{} -> n{i} [label=\"{k}\"];", idx[*s]);
        }
    }
    out.push_str("}\n");
    out
}
