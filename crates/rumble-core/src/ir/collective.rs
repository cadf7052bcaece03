//! The type rule of the collectives (`Op::Collective`: data-parallel training's `all_reduce`,
//! `reduce_scatter`, `all_gather`).

use super::dtype::TensorType;
use super::op::{CollectiveOp, Op, float};
use super::trace::Trace;

/// Where each collective of more than one rank completes, on a device that runs it beside the
/// nodes after it (NCCL on a second stream, overlapping the backward): `(node, join)`, `join`
/// the first later node that reads its result, or `trace.nodes.len()` (the step's end) when no
/// node does. Until its join a collective may still read its operand and write its result, so
/// the planner keeps both live until then.
pub fn collective_joins(trace: &Trace) -> Vec<(usize, usize)> {
    let n = trace.nodes.len();
    // One pass: each collective's result waits for its first reader.
    let mut waiting: Vec<Option<usize>> = vec![None; trace.num_values()];
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, node) in trace.nodes.iter().enumerate() {
        for a in &node.args {
            if let Some(k) = waiting[a.index()].take() {
                out[k].1 = i;
            }
        }
        if matches!(node.op, Op::Collective { world, .. } if world > 1) {
            waiting[node.outs[0].index()] = Some(out.len());
            out.push((i, n));
        }
    }
    out
}

/// The type rule of the collectives: `world >= 1`, `rank < world`, a float operand.
pub(super) fn infer(op: CollectiveOp, world: usize, rank: usize, x: &TensorType) -> Result<Vec<TensorType>, String> {
    if world == 0 || rank >= world {
        return Err(format!("rank {rank} is not one of world {world}'s ranks"));
    }
    float(x)?;
    match op {
        CollectiveOp::AllReduce => Ok(vec![x.clone()]),
        CollectiveOp::ReduceScatter => {
            if !x.numel().is_multiple_of(world) {
                return Err(format!("{} ({} elements) does not split into {world} equal shards", x.shape, x.numel()));
            }
            Ok(vec![x.with_shape([x.numel() / world])])
        }
        CollectiveOp::AllGather => {
            if x.rank() != 1 {
                return Err(format!("gathers flat shards [n], got {}", x.shape));
            }
            Ok(vec![x.with_shape([x.numel() * world])])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Op};

    #[test]
    fn a_collective_joins_at_its_first_reader_or_the_end() {
        use crate::ir::{Graph, OutputRole};
        let g = Graph::new("joins");
        let x = g.data("x", DType::F32, &[8]).unwrap();
        let c =
            |op, w, t: &crate::ir::Tensor| g.apply(Op::Collective { op, world: w, rank: 0 }, &[t]).unwrap().remove(0);
        let a = c(CollectiveOp::AllReduce, 2, &x); // node 0
        let b = c(CollectiveOp::AllReduce, 2, &x); // node 1, never read: joins at the end
        let y = x.add(&x).unwrap().add(&a).unwrap().mul(&a).unwrap(); // nodes 2, 3 (first reads `a`), 4
        g.output_with_role(&y, "y", OutputRole::Output).unwrap();
        g.output_with_role(&b, "b", OutputRole::Output).unwrap();
        let t = g.finish().unwrap();
        assert_eq!(collective_joins(&t), vec![(0, 3), (1, t.nodes.len())]);
    }

    #[test]
    fn collective_type_rules() {
        let x = TensorType::new(DType::F32, [4, 6]);
        let op = |c, world, rank| Op::Collective { op: c, world, rank };
        assert_eq!(op(CollectiveOp::AllReduce, 2, 1).infer(&[&x]).unwrap(), vec![x.clone()]);
        let shard = op(CollectiveOp::ReduceScatter, 3, 0).infer(&[&x]).unwrap();
        assert_eq!(shard, vec![TensorType::new(DType::F32, [8])]);
        assert_eq!(
            op(CollectiveOp::AllGather, 3, 2).infer(&[&shard[0]]).unwrap(),
            vec![TensorType::new(DType::F32, [24])]
        );
        assert!(op(CollectiveOp::ReduceScatter, 5, 0).infer(&[&x]).unwrap_err().contains("5 equal shards"));
        assert!(op(CollectiveOp::AllGather, 2, 0).infer(&[&x]).unwrap_err().contains("flat shards"));
        assert!(op(CollectiveOp::AllReduce, 2, 2).infer(&[&x]).unwrap_err().contains("rank 2"));
        assert!(op(CollectiveOp::AllReduce, 2, 0).infer(&[&x.with_dtype(DType::I64)]).is_err());
    }
}
