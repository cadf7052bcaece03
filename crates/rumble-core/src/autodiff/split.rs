//! Cutting a joint trace into a forward trace and a backward trace.
//!
//! The forward trace runs the `Forward` nodes and returns the joint's forward outputs plus every
//! forward value a later node reads: the saved-for-backward set, as outputs with role `Saved`
//! named `saved.N`. The backward trace takes those (role `Saved`) and the joint inputs it reads
//! (parameters, targets) and runs the `Backward` and `Optimizer` nodes.

use std::collections::HashSet;

use crate::ir::{InputRole, OutputRole, Phase, Trace, TraceInput, TraceOutput, ValueId, verify};
use crate::{Error, Result};

/// A joint trace cut in two, with the interface between them spelled out.
#[derive(Clone, Debug)]
pub struct Split {
    pub forward: Trace,
    pub backward: Trace,
    /// Names of the saved-for-backward values, in the order the forward returns them.
    pub saved: Vec<String>,
    /// Bytes of the saved-for-backward values.
    pub saved_bytes: usize,
}

pub fn split(joint: &Trace) -> Result<Split> {
    verify(joint)?;
    let err = |m: String| Error::Autodiff(format!("split of `{}`: {m}", joint.name));
    let n = joint.num_values();
    let mut fwd_def = vec![false; n];
    for (i, node) in joint.nodes.iter().enumerate() {
        if node.phase == Phase::Forward {
            if let Some(a) =
                node.args.iter().find(|a| !fwd_def[a.index()] && joint.inputs.iter().all(|i| i.value != **a))
            {
                return Err(err(format!(
                    "forward node {i} ({}) reads {a}, which a later phase defines",
                    node.op.name()
                )));
            }
            node.outs.iter().for_each(|o| fwd_def[o.index()] = true);
        }
    }
    let is_input = |v: ValueId| joint.inputs.iter().any(|i| i.value == v);
    let (fwd_nodes, bwd_nodes): (Vec<_>, Vec<_>) =
        joint.nodes.iter().cloned().partition(|nd| nd.phase == Phase::Forward);

    // Saved: forward values read by the backward, in definition order.
    let mut read_by_bwd = HashSet::new();
    for node in &bwd_nodes {
        read_by_bwd.extend(node.args.iter().copied());
    }
    let mut saved: Vec<ValueId> = Vec::new();
    for node in &fwd_nodes {
        saved.extend(node.outs.iter().filter(|o| read_by_bwd.contains(o)));
    }
    let saved_name = |v: ValueId| format!("saved.{}", v.0);

    let fwd_used: HashSet<ValueId> = fwd_nodes.iter().flat_map(|n| n.args.iter().copied()).collect();
    let bwd_out = |o: &TraceOutput| !fwd_def[o.value.index()] && !is_input(o.value);

    let mut forward = Trace::new(format!("{}.forward", joint.name));
    forward.types = joint.types.clone();
    forward.inputs = joint.inputs.iter().filter(|i| fwd_used.contains(&i.value)).cloned().collect();
    forward.nodes = fwd_nodes;
    forward.outputs = joint.outputs.iter().filter(|o| !bwd_out(o)).cloned().collect();
    for o in &forward.outputs {
        if !matches!(o.role, OutputRole::Output | OutputRole::Saved) {
            return Err(err(format!("output \"{}\" is a gradient or update computed in the forward", o.name)));
        }
        if is_input(o.value) && !forward.inputs.iter().any(|i| i.value == o.value) {
            let inp = joint.inputs.iter().find(|i| i.value == o.value).expect("checked by is_input");
            forward.inputs.push(inp.clone());
        }
    }
    forward.outputs.extend(saved.iter().map(|&v| TraceOutput {
        value: v,
        name: saved_name(v),
        role: OutputRole::Saved,
    }));

    let mut backward = Trace::new(format!("{}.backward", joint.name));
    backward.types = joint.types.clone();
    backward.inputs =
        saved.iter().map(|&v| TraceInput { value: v, name: saved_name(v), role: InputRole::Saved }).collect();
    let outputs: Vec<TraceOutput> = joint.outputs.iter().filter(|o| bwd_out(o)).cloned().collect();
    let mut needed: HashSet<ValueId> = read_by_bwd;
    for o in &outputs {
        if let OutputRole::Grad { of } | OutputRole::Update { of } = o.role {
            needed.insert(of);
        }
    }
    backward.inputs.extend(joint.inputs.iter().filter(|i| needed.contains(&i.value)).cloned());
    backward.nodes = bwd_nodes;
    backward.outputs = outputs;

    for t in [&mut forward, &mut backward] {
        t.compact()?;
        verify(t)?;
    }
    let saved_bytes = saved.iter().map(|v| joint.ty(*v).size_in_bytes()).sum();
    Ok(Split { forward, backward, saved: saved.into_iter().map(saved_name).collect(), saved_bytes })
}
