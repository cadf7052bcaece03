//! Common-subexpression elimination: a node equal to an earlier one (same op, attributes and
//! operands) is dropped and its outputs replaced by the earlier node's. Collectives are never
//! merged: each is one exchange every rank runs.

use std::collections::HashMap;

use crate::Result;
use crate::ir::{Op, OutputRole, Trace, ValueId, op_attrs};

pub fn cse(trace: &Trace) -> Result<Trace> {
    let mut subst: HashMap<ValueId, ValueId> = HashMap::new();
    let mut seen: HashMap<(String, Vec<ValueId>), Vec<ValueId>> = HashMap::new();
    let mut t = trace.clone();
    t.nodes.clear();
    for node in &trace.nodes {
        let mut node = node.clone();
        for a in &mut node.args {
            *a = *subst.get(a).unwrap_or(a);
        }
        let attrs: Vec<String> = op_attrs(&node.op).into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        let key = (format!("{} {}", node.op.name(), attrs.join(" ")), node.args.clone());
        match seen.get(&key) {
            Some(prev) if !matches!(node.op, Op::Collective { .. }) => {
                for (o, p) in node.outs.iter().zip(prev) {
                    subst.insert(*o, *p);
                }
            }
            _ => {
                seen.insert(key, node.outs.clone());
                t.nodes.push(node);
            }
        }
    }
    for o in &mut t.outputs {
        o.value = *subst.get(&o.value).unwrap_or(&o.value);
        if let OutputRole::Grad { of } | OutputRole::Update { of } = &mut o.role {
            *of = *subst.get(of).unwrap_or(of);
        }
    }
    t.compact()?;
    Ok(t)
}
