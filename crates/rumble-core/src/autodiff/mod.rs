//! Reverse-mode autodiff over traces.
//!
//! [`backward`] appends the backward of a scalar loss to the loss's graph (phase `Backward`)
//! and returns the gradients of the chosen values, like `torch.autograd.grad`: the training
//! step then continues in the same graph with the optimizer, so the planner sees one program.
//! [`grad`] does the same on a finished trace, and [`split`] cuts a joint trace into a forward
//! and a backward trace whose interface, the saved-for-backward values, is explicit.
//!
//! Zero cotangents stay symbolic (`None`): no tensor of zeros is made unless a requested
//! gradient is zero.

mod split;
mod vjp;

use std::collections::HashMap;

pub use split::{Split, split};

use crate::ir::{DType, OutputRole, Phase, Tensor, Trace, ValueId};
use crate::{Error, Result};

/// Records the backward of scalar float `loss` with respect to each of `wrt` and returns their
/// gradients (same types as `wrt`). Nodes are recorded with `Phase::Backward`.
pub fn backward(loss: &Tensor, wrt: &[&Tensor]) -> Result<Vec<Tensor>> {
    if loss.rank() != 0 || !loss.dtype().is_float() {
        return Err(Error::Autodiff(format!("the loss must be a float scalar, got {}", loss.ty())));
    }
    if let Some(w) = wrt.iter().find(|w| !w.dtype().is_float()) {
        return Err(Error::Autodiff(format!("cannot differentiate with respect to {} ({})", w.id(), w.ty())));
    }
    let g = loss.graph().clone();
    let trace = g.snapshot();
    let n = trace.num_values();

    // Nodes that depend on a wrt value and on which the loss depends.
    let mut depends = vec![false; n];
    for w in wrt {
        depends[w.id().index()] = true;
    }
    for node in &trace.nodes {
        if node.args.iter().any(|a| depends[a.index()]) {
            node.outs.iter().for_each(|o| depends[o.index()] = true);
        }
    }
    let mut feeds = vec![false; n];
    feeds[loss.id().index()] = true;
    for node in trace.nodes.iter().rev() {
        if node.outs.iter().any(|o| feeds[o.index()]) {
            node.args.iter().for_each(|a| feeds[a.index()] = true);
        }
    }

    let saved_phase = g.phase();
    g.set_phase(Phase::Backward);
    let result = (|| {
        let mut cts: HashMap<ValueId, Tensor> = HashMap::new();
        cts.insert(loss.id(), g.scalar(1.0, loss.dtype()));
        for node in trace.nodes.iter().rev() {
            if !node.outs.iter().any(|o| feeds[o.index()] && depends[o.index()]) {
                continue;
            }
            let out_cts: Vec<Option<Tensor>> = node.outs.iter().map(|o| cts.get(o).cloned()).collect();
            if out_cts.iter().all(Option::is_none) {
                continue;
            }
            let args: Vec<Tensor> = node.args.iter().map(|a| g.value(*a)).collect();
            let outs: Vec<Tensor> = node.outs.iter().map(|o| g.value(*o)).collect();
            let need: Vec<bool> =
                node.args.iter().map(|a| depends[a.index()] && trace.ty(*a).dtype.is_float()).collect();
            let arg_cts = vjp::vjp(&node.op, &args, &outs, &out_cts, &need)
                .map_err(|e| Error::Autodiff(format!("VJP of {} ({}): {e}", node.op.name(), trace.node_text(node))))?;
            for (a, ct) in node.args.iter().zip(arg_cts) {
                let Some(ct) = ct else { continue };
                let acc = match cts.remove(a) {
                    Some(prev) => prev.add(&ct)?,
                    None => ct,
                };
                cts.insert(*a, acc);
            }
        }
        wrt.iter()
            .map(|w| Ok(cts.get(&w.id()).cloned().unwrap_or_else(|| g.full(0.0, w.dtype(), w.dims()))))
            .collect::<Result<Vec<Tensor>>>()
    })();
    g.set_phase(saved_phase);
    result
}

/// The joint forward+backward trace of `trace`: its outputs, plus `grad.NAME` outputs (role
/// `Grad`) holding the gradient of output `loss` with respect to each input named in `wrt`.
pub fn grad(trace: &Trace, loss: &str, wrt: &[&str]) -> Result<Trace> {
    let g = crate::ir::Graph::from_trace(trace.clone());
    let l =
        trace.output(loss).ok_or_else(|| Error::Autodiff(format!("trace `{}` has no output `{loss}`", trace.name)))?;
    let loss_t = g.value(l.value);
    let ws: Vec<Tensor> = wrt
        .iter()
        .map(|name| {
            trace
                .input(name)
                .map(|i| g.value(i.value))
                .ok_or_else(|| Error::Autodiff(format!("trace `{}` has no input `{name}`", trace.name)))
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = ws.iter().collect();
    let grads = backward(&loss_t, &refs)?;
    for ((name, w), gr) in wrt.iter().zip(&ws).zip(&grads) {
        g.output_with_role(gr, &format!("grad.{name}"), OutputRole::Grad { of: w.id() })?;
    }
    g.finish()
}

/// The names of all float inputs of a trace (handy for `grad`).
pub fn float_inputs(trace: &Trace) -> Vec<&str> {
    trace
        .inputs
        .iter()
        .filter(|i| trace.ty(i.value).dtype != DType::Bool && trace.ty(i.value).dtype.is_float())
        .map(|i| i.name.as_str())
        .collect()
}
