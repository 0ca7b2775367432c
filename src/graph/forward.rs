//! Execution order: [`Graph::build_forward`] collects the nodes some outputs depend on,
//! each once, in an order where every node comes after all of its sources (a depth-first
//! post-order from the outputs, taken in the order given, sources in op order).

use slotmap::SecondaryMap;

use super::{Graph, TensorId};
use crate::error::Result;

/// A topologically ordered list of the nodes that some outputs need.
#[derive(Clone, Debug)]
pub struct Forward {
    /// Every needed node (leaves and views included), sources before users.
    pub order: Vec<TensorId>,
    /// The outputs asked for, in the order given.
    pub outputs: Vec<TensorId>,
}

impl Forward {
    /// Nodes that compute something (neither leaves nor pure views).
    pub fn compute_nodes<'a>(&'a self, g: &'a Graph) -> impl Iterator<Item = TensorId> + 'a {
        self.order
            .iter()
            .copied()
            .filter(move |&id| g.tensor(id).op.computes())
    }

    /// Leaf nodes (inputs, weights, state).
    pub fn leaves<'a>(&'a self, g: &'a Graph) -> impl Iterator<Item = TensorId> + 'a {
        self.order
            .iter()
            .copied()
            .filter(move |&id| g.tensor(id).op.is_leaf())
    }
}

impl Graph {
    /// Collects the nodes that `outputs` depend on in a valid execution order, once each.
    /// Outputs are visited in the order given, so side-effect nodes (a KV-cache write)
    /// listed first run first.
    pub fn build_forward(&self, outputs: &[TensorId]) -> Result<Forward> {
        self.check_ids(outputs)?;
        let mut visited: SecondaryMap<TensorId, ()> = SecondaryMap::new();
        let mut order = Vec::new();
        // Iterative DFS: (node, index of the next source to visit).
        let mut stack: Vec<(TensorId, usize)> = Vec::new();
        for &out in outputs {
            if visited.contains_key(out) {
                continue;
            }
            visited.insert(out, ());
            stack.push((out, 0));
            while let Some(&mut (id, ref mut next)) = stack.last_mut() {
                let src = &self.tensor(id).src;
                if *next < src.len() {
                    let s = src[*next];
                    *next += 1;
                    if !visited.contains_key(s) {
                        visited.insert(s, ());
                        stack.push((s, 0));
                    }
                } else {
                    order.push(id);
                    stack.pop();
                }
            }
        }
        Ok(Forward {
            order,
            outputs: outputs.to_vec(),
        })
    }
}
