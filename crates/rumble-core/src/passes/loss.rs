//! Folds the fused loss's forward and backward into one node: `linear_cross_entropy` and the
//! `linear_cross_entropy_backward` reading its log-sum-exp become one
//! `linear_cross_entropy_grad` at the backward's place, which computes each chunk's logits once
//! for the loss, the log-sum-exp and the gradients (the backward alone computes them a second
//! time: a quarter of the loss's matmul work).
//!
//! It applies where the gradient's upstream `dloss` does not depend on the loss (the loss is
//! the objective: its cotangent is a constant), the log-sum-exp has no other reader, and every
//! other reader of the loss comes after the backward (so the loss may be computed there).

use crate::Result;
use crate::ir::{Def, Node, Op, Trace, ValueId};

pub fn fold_loss_grad(trace: &Trace) -> Result<Trace> {
    let defs = trace.defs();
    let users = trace.users();
    let node_of = |v: ValueId| match defs[v.index()] {
        Some(Def::Node { node, .. }) => Some(node),
        _ => None,
    };
    let is_output = |v: ValueId| trace.outputs.iter().any(|o| o.value == v);
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (b, bn) in trace.nodes.iter().enumerate() {
        let Op::LinearCrossEntropyBackward { ignore_index, chunk } = bn.op else { continue };
        let (lse, dloss) = (bn.args[3], bn.args[4]);
        let Some(f) = node_of(lse) else { continue };
        let fwd = &trace.nodes[f];
        let pairs = matches!(fwd.op, Op::LinearCrossEntropy { ignore_index: i, chunk: c } if i == ignore_index && c == chunk)
            && fwd.args[..] == bn.args[..3]
            && fwd.outs[1] == lse
            && users[lse.index()].len() == 1
            && !is_output(lse);
        let loss = fwd.outs[0];
        let later = users[loss.index()].iter().all(|&u| u > b);
        if !pairs || !later || depends_on(trace, &node_of, dloss, f) {
            continue;
        }
        t.nodes[b] = Node {
            op: Op::LinearCrossEntropyGrad { ignore_index, chunk },
            args: vec![bn.args[0], bn.args[1], bn.args[2], dloss],
            outs: vec![loss, bn.outs[0], bn.outs[1]],
            phase: bn.phase,
        };
        drop[f] = true;
    }
    super::without(t, &drop)
}

/// True if value `v` is computed from any result of node `f`.
fn depends_on(trace: &Trace, node_of: &dyn Fn(ValueId) -> Option<usize>, v: ValueId, f: usize) -> bool {
    let mut seen = vec![false; trace.nodes.len()];
    let mut stack: Vec<usize> = node_of(v).into_iter().collect();
    while let Some(n) = stack.pop() {
        if n == f {
            return true;
        }
        if std::mem::replace(&mut seen[n], true) {
            continue;
        }
        stack.extend(trace.nodes[n].args.iter().filter_map(|&a| node_of(a)));
    }
    false
}
