//! Graph dumps for debugging: a text table with one row per node, and a Graphviz DOT
//! export (render with `dot -Tsvg graph.dot -o graph.svg`).
//!
//! Both show the plan's execution order with each node's op, name, role (input, output,
//! weight, state), dtype, `ne`, `nb`, sources, and where its memory is: its own arena
//! block, a block taken over in place, a view of another tensor, or a backend buffer.
//! Names are printed escaped, so a name with spaces, quotes or control characters cannot
//! break a table row or a DOT label.

use std::fmt::Write as _;

use slotmap::SecondaryMap;

use super::alloc::{AllocInfo, AllocKind};
use super::OpKind;
use super::{Flags, Graph, Plan, TensorId};

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

/// The node's role: its flags, with `output` added for outputs passed to the plan.
fn role(plan: &Plan, id: TensorId, flags: Flags) -> String {
    let flags = if plan.forward.outputs.contains(&id) {
        flags | Flags::OUTPUT
    } else {
        flags
    };
    format!("{flags:?}")
}

/// Whether the node is an output (flagged, or passed to the plan).
fn is_output(plan: &Plan, id: TensorId, flags: Flags) -> bool {
    flags.contains(Flags::OUTPUT) || plan.forward.outputs.contains(&id)
}

/// A name for the text table: as is, or quoted and escaped when it is empty or holds
/// whitespace, quotes, backslashes or control characters.
fn text_name(name: &str) -> String {
    let plain = !name.is_empty()
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '\\');
    if plain {
        name.to_string()
    } else {
        format!("{name:?}")
    }
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
    let mut rows: Vec<[String; 10]> = vec![[
        "idx", "op", "name", "role", "dtype", "ne", "nb", "src", "memory", "params",
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
            text_name(&t.name),
            role(plan, id, t.flags),
            t.dtype.name().to_string(),
            shape(&t.ne),
            shape(&t.nb),
            src,
            memory(g, plan, &idx, id),
            t.op.params(),
        ]);
    }
    let mut width = [0usize; 10];
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

/// Escapes a string for a double-quoted DOT label: control characters become visible
/// escapes (`\n` shows as the two characters `\n`, not as a line break), then
/// backslashes and quotes are escaped for DOT.
fn esc(s: &str) -> String {
    let mut visible = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            visible.extend(c.escape_debug());
        } else {
            visible.push(c);
        }
    }
    visible.replace('\\', "\\\\").replace('"', "\\\"")
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
        OpKind::Collective => "#dadaeb",
    }
}

/// Fill of input leaves.
const INPUT_FILL: &str = "#ffffb3";
/// Fill of weight and state leaves.
const BUFFER_FILL: &str = "#d9d9d9";
/// Outline of outputs and colour of in-place edges.
const MARK: &str = "#d62728";

/// Shape, style and fill of a node: inputs are ellipses, weights folders, state
/// cylinders, views dashed boxes, everything else a rounded box coloured by op kind.
fn node_style(flags: Flags, kind: OpKind) -> (&'static str, &'static str, &'static str) {
    if flags.contains(Flags::INPUT) {
        ("ellipse", "filled", INPUT_FILL)
    } else if flags.contains(Flags::WEIGHT) {
        ("folder", "filled", BUFFER_FILL)
    } else if flags.contains(Flags::STATE) {
        ("cylinder", "filled", BUFFER_FILL)
    } else if kind == OpKind::View {
        ("box", "rounded,filled,dashed", colour(kind))
    } else {
        ("box", "rounded,filled", colour(kind))
    }
}

/// The legend: one sample node per style, stacked with invisible edges.
fn legend(out: &mut String) {
    out.push_str(
        "  subgraph cluster_legend {\n    label=\"legend\";\n    style=\"dashed\";\n    color=\"#999999\";\n",
    );
    let samples: [(&str, Flags, OpKind); 9] = [
        ("input", Flags::INPUT, OpKind::Leaf),
        ("weight", Flags::WEIGHT, OpKind::Leaf),
        ("state", Flags::STATE, OpKind::Leaf),
        ("view (no kernel)", Flags::NONE, OpKind::View),
        ("copy / gather", Flags::NONE, OpKind::Data),
        ("elementwise", Flags::NONE, OpKind::Elementwise),
        ("row op", Flags::NONE, OpKind::Row),
        ("mul_mat", Flags::NONE, OpKind::MatMul),
        ("output", Flags::OUTPUT, OpKind::Elementwise),
    ];
    for (k, (label, flags, kind)) in samples.iter().enumerate() {
        let (shape, style, fill) = node_style(*flags, *kind);
        let mark = if flags.contains(Flags::OUTPUT) {
            format!(", penwidth=2.5, color=\"{MARK}\"")
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "    legend{k} [label=\"{label}\", shape={shape}, style=\"{style}\", fillcolor=\"{fill}\"{mark}];"
        );
    }
    let _ = writeln!(
        out,
        "    legend_edges [label=\"edge label: operand position\\lred edge: written in place over it\\ldashed edge: a view of it\\l\", shape=plaintext, style=solid];"
    );
    for k in 0..samples.len() {
        let next = if k + 1 < samples.len() {
            format!("legend{}", k + 1)
        } else {
            "legend_edges".to_string()
        };
        let _ = writeln!(out, "    legend{k} -> {next} [style=invis];");
    }
    out.push_str("  }\n");
}

/// A Graphviz DOT description of the plan, with a legend: nodes coloured by op kind,
/// inputs as ellipses, weights as folders, state as cylinders, views dashed, outputs
/// outlined in red; labels show index, name, op, dtype, shape, strides when not
/// contiguous, parameters and memory. Edges go from sources to users, labelled with the
/// operand position; the edge a node took its memory over from is red, edges into views
/// are dashed.
pub fn dot(g: &Graph, plan: &Plan) -> String {
    let idx = indices(plan);
    let r = plan.alloc.report;
    let mut out = String::new();
    out.push_str("digraph graft {\n");
    let _ = writeln!(
        out,
        "  label=\"graft graph: {} nodes ({} steps), arena {} B planned / {} B naive, {} in place, {} views\";",
        plan.forward.order.len(),
        plan.steps.len(),
        r.peak_bytes,
        r.naive_bytes,
        r.n_inplace,
        r.n_views
    );
    out.push_str("  labelloc=t;\n  rankdir=TB;\n  node [shape=box, style=\"rounded,filled\", fontname=\"monospace\", fontsize=10];\n  edge [fontsize=8, color=\"#555555\"];\n");
    legend(&mut out);
    for (i, &id) in plan.forward.order.iter().enumerate() {
        let t = g.tensor(id);
        let (shape_attr, style, fill) = node_style(t.flags, t.op.kind());
        let output = is_output(plan, id, t.flags);
        let mut label = format!(
            "#{i} {}\\n{} {} {}",
            esc(&t.name),
            t.op.name(),
            t.dtype,
            shape(&t.ne)
        );
        if !t.is_contiguous() {
            let _ = write!(label, "\\nnb={}", shape(&t.nb));
        }
        let params = t.op.params();
        if !params.is_empty() {
            let _ = write!(label, "\\n{}", esc(&params));
        }
        let _ = write!(label, "\\n{}", esc(&memory(g, plan, &idx, id)));
        if output {
            label.push_str("\\noutput");
        }
        let mark = if output {
            format!(", penwidth=2.5, color=\"{MARK}\"")
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  n{i} [label=\"{label}\", shape={shape_attr}, style=\"{style}\", fillcolor=\"{fill}\"{mark}];"
        );
    }
    for (i, &id) in plan.forward.order.iter().enumerate() {
        let t = g.tensor(id);
        let inplace = match plan.alloc.info.get(id).map(|a| a.kind) {
            Some(AllocKind::InPlace(p)) => Some(p),
            _ => None,
        };
        for (k, s) in t.src.iter().enumerate() {
            let attrs = if k == 0 && inplace == Some(*s) {
                format!(", color=\"{MARK}\", penwidth=2")
            } else if t.op.is_view() && k == 0 {
                ", style=dashed".to_string()
            } else {
                String::new()
            };
            let _ = writeln!(out, "  n{} -> n{i} [label=\"{k}\"{attrs}];", idx[*s]);
        }
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::{esc, text_name};

    #[test]
    fn odd_names_are_escaped() {
        assert_eq!(text_name("attn.q"), "attn.q");
        assert_eq!(text_name("a b"), "\"a b\"");
        assert_eq!(text_name(""), "\"\"");
        assert_eq!(text_name("x\ny"), "\"x\\ny\"");
        assert_eq!(esc("plain"), "plain");
        assert_eq!(esc("say \"hi\""), "say \\\"hi\\\"");
        assert_eq!(esc("back\\slash"), "back\\\\slash");
        assert_eq!(esc("two\nlines"), "two\\\\nlines");
    }
}
