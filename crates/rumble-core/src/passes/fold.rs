//! Folds a widening cast into the matmul it reads: `cast(matmul(a, b)) to=f32`, where the
//! matmul's operands are bf16 or f16 and its result has no other use, becomes one matmul
//! writing f32 (`Op::Matmul`'s `out`; the pair every backend's matmul takes). The products
//! accumulate as before and are rounded once, to f32, instead of to the operands' dtype and then widened; the narrow
//! intermediate and the cast's launch are gone. In a bf16-mixed step these are the weight
//! gradients, which the optimizer reads in f32.

use crate::Result;
use crate::ir::{DType, Def, Op, Trace};

pub fn fold_casts(trace: &Trace) -> Result<Trace> {
    let defs = trace.defs();
    let users = trace.users();
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (c, node) in trace.nodes.iter().enumerate() {
        let Op::Cast { to } = node.op else { continue };
        let v = node.args[0];
        let Some(Def::Node { node: p, .. }) = defs[v.index()] else { continue };
        let m = &trace.nodes[p];
        let from = trace.ty(v).dtype;
        let folds = matches!(m.op, Op::Matmul { out: None, .. })
            && m.phase == node.phase
            && users[v.index()].len() == 1
            && !trace.outputs.iter().any(|o| o.value == v)
            && matches!(from, DType::BF16 | DType::F16)
            && to == DType::F32;
        if !folds {
            continue;
        }
        // The matmul now defines the cast's value (same shape, type `to`); the cast goes.
        if let Op::Matmul { out, .. } = &mut t.nodes[p].op {
            *out = Some(to);
        }
        t.nodes[p].outs[0] = node.outs[0];
        drop[c] = true;
    }
    let mut i = 0;
    t.nodes.retain(|_| {
        i += 1;
        !drop[i - 1]
    });
    t.compact()?;
    Ok(t)
}
