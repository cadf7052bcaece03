//! The verifier: checks every invariant a trace must hold, and says what is wrong and where.
//!
//! Checked, in order:
//! 1. every value id is within the type table;
//! 2. SSA: every value is defined exactly once (by an input or a node output) and every use
//!    comes after its definition;
//! 3. each node has the op's number of operands and its declared output types equal the op's
//!    type rule applied to its operand types (shapes and dtypes);
//! 4. input and output names are unique and non-empty;
//! 5. every value's size fits (`TensorType::checked_size_in_bytes`), and so does the sum of all
//!    of them (so no planner sum of sizes can wrap);
//! 6. `grad_of` names an input whose type equals the gradient's; `update_of` names a
//!    persistent input (param or opt_state) of the same type;
//! 7. every collective has the same `world` and `rank` (a trace is one rank's program).
//!
//! It is cheap (one pass) and can run after every pass.

use std::collections::HashSet;

use super::op::Op;
use super::trace::{OutputRole, Trace, ValueId};
use crate::{Error, Result};

pub fn verify(t: &Trace) -> Result<()> {
    let err = |at: String, msg: String| Error::Verify { trace: t.name.clone(), at, msg };
    let n = t.types.len();
    let mut sizes = Vec::with_capacity(n);
    for (i, ty) in t.types.iter().enumerate() {
        sizes.push(ty.checked_size_in_bytes().map_err(|e| err(format!("value %{i}"), e.to_string()))?);
    }
    // Each size rounded up to a generous alignment, so aligned sums cannot wrap either.
    super::dtype::total_bytes(sizes.iter().map(|s| s.saturating_add(4096)), "all values together")
        .map_err(|e| err("the trace".into(), e.to_string()))?;
    let mut defined = vec![false; n];
    let define = |defined: &mut Vec<bool>, v: ValueId, at: &dyn Fn() -> String| -> Result<()> {
        if v.index() >= n {
            return Err(err(at(), format!("{v} is not in the type table ({n} values)")));
        }
        if std::mem::replace(&mut defined[v.index()], true) {
            return Err(err(at(), format!("{v} is defined twice")));
        }
        Ok(())
    };
    let mut collective: Option<(usize, usize, usize)> = None;
    let mut names = HashSet::new();
    for inp in &t.inputs {
        let at = || format!("input \"{}\"", inp.name);
        define(&mut defined, inp.value, &at)?;
        if inp.name.is_empty() || !names.insert(inp.name.as_str()) {
            return Err(err(at(), "input names must be unique and non-empty".into()));
        }
    }
    for (i, node) in t.nodes.iter().enumerate() {
        let at = || format!("node {i} ({})", node.op.name());
        for a in &node.args {
            if a.index() >= n || !defined[a.index()] {
                return Err(err(at(), format!("operand {a} is used before it is defined")));
            }
        }
        if let Op::Collective { world, rank, .. } = node.op {
            match collective {
                None => collective = Some((i, world, rank)),
                Some((j, w, r)) if (w, r) != (world, rank) => {
                    return Err(err(
                        at(),
                        format!(
                            "runs as rank {rank} of {world}, but node {j} runs as rank {r} of {w}: one trace is one rank's"
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        let arg_types: Vec<_> = node.args.iter().map(|a| t.ty(*a)).collect();
        let want = node.op.infer(&arg_types).map_err(|m| {
            let args: Vec<String> = arg_types.iter().map(|t| t.to_string()).collect();
            err(at(), format!("{}({}): {m}", node.op.name(), args.join(", ")))
        })?;
        if want.len() != node.outs.len() {
            return Err(err(at(), format!("defines {} values, the op makes {}", node.outs.len(), want.len())));
        }
        for (o, w) in node.outs.iter().zip(&want) {
            define(&mut defined, *o, &at)?;
            if t.ty(*o) != w {
                return Err(err(at(), format!("{o} is declared {} but the op makes {w}", t.ty(*o))));
            }
        }
    }
    let mut out_names = HashSet::new();
    for out in &t.outputs {
        let at = || format!("output \"{}\"", out.name);
        if out.value.index() >= n || !defined[out.value.index()] {
            return Err(err(at(), format!("{} is not defined", out.value)));
        }
        if out.name.is_empty() || !out_names.insert(out.name.as_str()) {
            return Err(err(at(), "output names must be unique and non-empty".into()));
        }
        match out.role {
            OutputRole::Grad { of } | OutputRole::Update { of } => {
                let Some(inp) = t.inputs.iter().find(|i| i.value == of) else {
                    return Err(err(at(), format!("{of} is not an input of the trace")));
                };
                if t.ty(of) != t.ty(out.value) {
                    return Err(err(at(), format!("type {} differs from its input's {}", t.ty(out.value), t.ty(of))));
                }
                if matches!(out.role, OutputRole::Update { .. }) && !inp.role.is_persistent() {
                    return Err(err(
                        at(),
                        format!("update_of names \"{}\", which is not a param, opt_state or state", inp.name),
                    ));
                }
            }
            OutputRole::Output | OutputRole::Saved => {}
        }
    }
    Ok(())
}
