//! Execution order: `Graph::build_forward` on random DAGs, checked against petgraph.
//!
//! The reference is computed independently of `forward.rs`: petgraph's DFS gives the set
//! of nodes reachable from each output, and the order must be a topological order of
//! exactly the nodes reachable from all outputs, with the nodes first reachable from
//! output `i` before those first reachable from output `i + 1`.

use std::collections::HashMap;

use graft::graph::{DType, Graph, TensorId};
use graft::Error;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::Dfs;
use proptest::prelude::*;

/// One node of a random DAG: an op code and two operand picks (taken modulo the number
/// of tensors made so far).
#[derive(Clone, Debug)]
struct NodeSpec {
    op: u8,
    a: usize,
    b: usize,
}

/// A random DAG: inputs, nodes in creation order, and output picks.
#[derive(Clone, Debug)]
struct DagSpec {
    n_inputs: usize,
    nodes: Vec<NodeSpec>,
    outputs: Vec<usize>,
}

fn dag_spec() -> impl Strategy<Value = DagSpec> {
    (
        1usize..5,
        prop::collection::vec(
            (0u8..6, any::<usize>(), any::<usize>()).prop_map(|(op, a, b)| NodeSpec { op, a, b }),
            0..48,
        ),
        prop::collection::vec(any::<usize>(), 1..6),
    )
        .prop_map(|(n_inputs, nodes, outputs)| DagSpec {
            n_inputs,
            nodes,
            outputs,
        })
}

/// Builds the DAG; every tensor is F32 [3, 3] so any two can be combined. Returns the
/// graph, every tensor in creation order, and the outputs (duplicates possible).
fn build(spec: &DagSpec) -> (Graph, Vec<TensorId>, Vec<TensorId>) {
    let mut g = Graph::new();
    let mut all = Vec::new();
    for i in 0..spec.n_inputs {
        all.push(g.input(&format!("in{i}"), DType::F32, &[3, 3]).unwrap());
    }
    for n in &spec.nodes {
        let a = all[n.a % all.len()];
        let b = all[n.b % all.len()];
        let t = match n.op {
            0 => g.add(a, b),
            1 => g.mul(a, b),
            2 => g.silu(a),
            3 => g.view_2d(a, 3, 3, 12, 0), // a view: no kernel, shares a's memory
            4 => g.transpose(a).and_then(|t| g.cont(t)),
            _ => g.after(a, &[b]),
        }
        .unwrap();
        all.push(t);
    }
    let outputs = spec.outputs.iter().map(|&o| all[o % all.len()]).collect();
    (g, all, outputs)
}

/// The whole graph as a petgraph DiGraph with an edge from each source to its user.
fn to_petgraph(g: &Graph) -> (DiGraph<TensorId, ()>, HashMap<TensorId, NodeIndex>) {
    let mut pg = DiGraph::new();
    let mut ix = HashMap::new();
    for (id, _) in g.iter() {
        ix.insert(id, pg.add_node(id));
    }
    for (id, t) in g.iter() {
        for s in &t.src {
            pg.add_edge(ix[s], ix[&id], ());
        }
    }
    (pg, ix)
}

/// Checks every property of a forward order against petgraph.
fn check_order(g: &Graph, outputs: &[TensorId]) -> Result<(), TestCaseError> {
    let fwd = g.build_forward(outputs).unwrap();
    prop_assert_eq!(&fwd.outputs, &outputs.to_vec());
    let (pg, ix) = to_petgraph(g);
    prop_assert!(!petgraph::algo::is_cyclic_directed(&pg));
    // Nodes reachable from output i, walking edges backwards (user -> source).
    let rev = petgraph::visit::Reversed(&pg);
    let mut first_out: HashMap<TensorId, usize> = HashMap::new();
    for (i, &o) in outputs.iter().enumerate() {
        let mut dfs = Dfs::new(rev, ix[&o]);
        while let Some(n) = dfs.next(rev) {
            first_out.entry(pg[n]).or_insert(i);
        }
    }
    // Once each, and exactly the reachable nodes.
    let mut pos: HashMap<TensorId, usize> = HashMap::new();
    for (p, &id) in fwd.order.iter().enumerate() {
        prop_assert!(
            pos.insert(id, p).is_none(),
            "node {:?} appears twice in the order",
            id
        );
    }
    prop_assert_eq!(
        pos.len(),
        first_out.len(),
        "order has unreachable or missing nodes"
    );
    for id in first_out.keys() {
        prop_assert!(pos.contains_key(id), "reachable node {:?} missing", id);
    }
    // Topological: every edge of the reachable subgraph goes forward in the order.
    for e in pg.raw_edges() {
        let (s, u) = (pg[e.source()], pg[e.target()]);
        if let Some(&pu) = pos.get(&u) {
            let ps = pos.get(&s).copied();
            prop_assert!(
                ps.is_some_and(|ps| ps < pu),
                "source {:?} of {:?} is not before it",
                s,
                u
            );
        }
    }
    // Outputs in the order given: what output i needs first comes before what output
    // i + 1 adds.
    for w in fwd.order.windows(2) {
        prop_assert!(
            first_out[&w[0]] <= first_out[&w[1]],
            "node first needed by output {} comes after one first needed by output {}",
            first_out[&w[0]],
            first_out[&w[1]]
        );
    }
    // Each output is in the order (a leaf output included).
    for o in outputs {
        prop_assert!(pos.contains_key(o));
    }
    // compute_nodes and leaves split the order as documented.
    let n_compute = fwd.compute_nodes(g).count();
    let n_leaves = fwd.leaves(g).count();
    let n_views = fwd
        .order
        .iter()
        .filter(|&&id| g.tensor(id).op.is_view())
        .count();
    prop_assert_eq!(n_compute + n_leaves + n_views, fwd.order.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn forward_is_a_topological_order_of_the_reachable_nodes(spec in dag_spec()) {
        let (g, _, outputs) = build(&spec);
        check_order(&g, &outputs)?;
    }

    #[test]
    fn forward_with_outputs_reversed_is_also_valid(spec in dag_spec()) {
        let (g, _, mut outputs) = build(&spec);
        outputs.reverse();
        check_order(&g, &outputs)?;
    }
}

#[test]
fn order_follows_outputs_and_source_order() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[4]).unwrap();
    let y = g.input("y", DType::F32, &[4]).unwrap();
    let a = g.silu(x).unwrap(); // only output 0 needs a
    let b = g.gelu(y).unwrap(); // only output 1 needs b
    let c = g.add(b, a).unwrap(); // sources in op order: b first
    let fwd = g.build_forward(&[a, c]).unwrap();
    assert_eq!(fwd.order, vec![x, a, y, b, c]);
    let fwd = g.build_forward(&[c, a]).unwrap();
    assert_eq!(fwd.order, vec![y, b, x, a, c]);
    // A repeated output is visited once.
    let fwd = g.build_forward(&[a, a, b]).unwrap();
    assert_eq!(fwd.order, vec![x, a, y, b]);
}

#[test]
fn a_long_chain_does_not_overflow_the_stack() {
    let mut g = Graph::new();
    let mut t = g.input("x", DType::F32, &[2]).unwrap();
    let first = t;
    for _ in 0..200_000 {
        t = g.scale(t, 0.5).unwrap();
    }
    let fwd = g.build_forward(&[t]).unwrap();
    assert_eq!(fwd.order.len(), 200_001);
    assert_eq!(fwd.order[0], first);
    assert_eq!(*fwd.order.last().unwrap(), t);
}

#[test]
fn unknown_ids_are_an_error() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[4]).unwrap();
    let mut big = Graph::new();
    let mut foreign = big.input("z", DType::F32, &[4]).unwrap();
    for _ in 0..8 {
        foreign = big.silu(foreign).unwrap();
    }
    for ids in [
        vec![TensorId::default()],
        vec![x, TensorId::default()],
        vec![foreign],
        vec![x, foreign],
    ] {
        match g.build_forward(&ids) {
            Err(Error::UnknownTensor(_)) => {}
            other => panic!("build_forward({ids:?}) gave {other:?}, expected UnknownTensor"),
        }
        assert!(matches!(g.plan(&ids), Err(Error::UnknownTensor(_))));
    }
    assert!(g.build_forward(&[x]).is_ok());
}
