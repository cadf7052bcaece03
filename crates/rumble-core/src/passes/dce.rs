//! Dead-code elimination: drops nodes none of whose outputs reach a trace output.
//! Every op is pure, so this is always safe. Inputs stay (they are the calling convention), and
//! so do collectives: every rank must run the same ones, whatever this rank does with a result.

use crate::Result;
use crate::ir::{Op, Trace};

pub fn dce(trace: &Trace) -> Result<Trace> {
    let mut live = vec![false; trace.num_values()];
    for o in &trace.outputs {
        live[o.value.index()] = true;
    }
    let mut keep = vec![false; trace.nodes.len()];
    for (i, node) in trace.nodes.iter().enumerate().rev() {
        if node.outs.iter().any(|o| live[o.index()]) || matches!(node.op, Op::Collective { .. }) {
            keep[i] = true;
            node.args.iter().for_each(|a| live[a.index()] = true);
        }
    }
    let mut t = trace.clone();
    t.nodes = trace.nodes.iter().zip(&keep).filter(|(_, k)| **k).map(|(n, _)| n.clone()).collect();
    t.compact()?;
    Ok(t)
}
