//! The arena executor: runs a trace with every value at its planned place in two byte
//! buffers, the transient arena and the persistent region, exactly as a GPU executor will.
//!
//! Each node's results are computed by [`run_op`](super::run_op) and written at their slots;
//! a view (`alias_of`) runs nothing, its readers read its source's bytes in place; after the
//! last node, `copy_back` values are copied into their inputs' slots. Parameters and optimizer
//! state stay in the persistent region between steps, updated there. Before each node runs, its
//! scratch range (`MemoryPlan::scratch`: the op's part and the backend's) is filled with
//! garbage, as a backend using it would leave it.
//!
//! Its results must equal [`eval`](super::eval)'s bit for bit: any plan that lets two live
//! values share a byte shows up as a difference. The plan is checked (`plan::check`) when the
//! executor is made.

use super::{HostTensor, check_inputs, run_op};
use crate::ir::{TensorType, Trace, ValueId};
use crate::plan::{MemoryPlan, Region, Slot, check::check};
use crate::{Error, Result};

/// What a node's scratch holds when it starts (NaN in every float dtype: a value placed over
/// live scratch would show).
const SCRATCH_GARBAGE: u8 = 0xFF;

/// A trace, its plan, and the memory they run in.
pub struct ArenaExecutor<'a> {
    trace: &'a Trace,
    plan: &'a MemoryPlan,
    arena: Vec<u8>,
    persistent: Vec<u8>,
}

impl<'a> ArenaExecutor<'a> {
    /// Checks `plan` against `trace` and allocates its arena and persistent region (zeroed).
    pub fn new(trace: &'a Trace, plan: &'a MemoryPlan) -> Result<Self> {
        check(trace, plan)?;
        Ok(ArenaExecutor { trace, plan, arena: vec![0; plan.arena_bytes], persistent: vec![0; plan.persistent_bytes] })
    }

    fn bytes(&self, s: Slot) -> &[u8] {
        let region = if s.region == Region::Arena { &self.arena } else { &self.persistent };
        &region[s.offset..s.offset + s.bytes]
    }

    fn write(&mut self, s: Slot, b: &[u8]) {
        let region = if s.region == Region::Arena { &mut self.arena } else { &mut self.persistent };
        region[s.offset..s.offset + s.bytes].copy_from_slice(b);
    }

    /// Writes every input (persistent ones included) into its slot, in `trace.inputs` order.
    pub fn load(&mut self, inputs: &[HostTensor]) -> Result<()> {
        check_inputs(self.trace, inputs)?;
        for (inp, t) in self.trace.inputs.iter().zip(inputs) {
            let s = self.plan.slot(inp.value)?;
            self.write(s, &t.bytes);
        }
        Ok(())
    }

    /// Writes the per-step inputs (not parameters or optimizer state), `None` to skip one.
    /// A step may overwrite its inputs' bytes once they are dead, so load them before each.
    pub fn load_data(&mut self, inputs: &[Option<&HostTensor>]) -> Result<()> {
        for (inp, t) in self.trace.inputs.iter().zip(inputs) {
            let Some(t) = t else { continue };
            if inp.role.is_persistent() {
                return Err(Error::msg(format!("input \"{}\" is persistent: load it once with `load`", inp.name)));
            }
            if t.ty != *self.trace.ty(inp.value) {
                return Err(Error::msg(format!(
                    "input \"{}\" must be {}, got {}",
                    inp.name,
                    self.trace.ty(inp.value),
                    t.ty
                )));
            }
            let s = self.plan.slot(inp.value)?;
            self.write(s, &t.bytes);
        }
        Ok(())
    }

    /// Runs every node, returns the outputs (in `trace.outputs` order), then copies updates
    /// back into their inputs' slots.
    pub fn step(&mut self) -> Result<Vec<HostTensor>> {
        let (trace, plan) = (self.trace, self.plan);
        for (n, node) in trace.nodes.iter().enumerate() {
            if node.outs.iter().all(|o| plan.is_alias(*o)) {
                continue;
            }
            if let Some(s) = plan.scratch.get(n).copied().flatten() {
                self.arena[s.offset..s.offset + s.bytes].fill(SCRATCH_GARBAGE);
            }
            let at = trace.arg_types(node);
            let ot: Vec<&TensorType> = node.outs.iter().map(|o| trace.ty(*o)).collect();
            let slots = node.args.iter().map(|a| plan.slot(*a)).collect::<Result<Vec<_>>>()?;
            let args: Vec<&[u8]> = slots.iter().map(|s| self.bytes(*s)).collect();
            let outs = run_op(&node.op, &at, &args, &ot)
                .map_err(|e| Error::runtime(node.op.name(), format!("node {n} of `{}`: {e}", trace.name)))?;
            for (o, b) in node.outs.iter().zip(outs) {
                let s = plan.slot(*o)?;
                self.write(s, &b);
            }
        }
        let outputs = trace
            .outputs
            .iter()
            .map(|o| Ok(HostTensor { ty: trace.ty(o.value).clone(), bytes: self.bytes(plan.slot(o.value)?).to_vec() }))
            .collect::<Result<Vec<_>>>()?;
        for &(v, p) in &plan.copy_back {
            let b = self.bytes(plan.slot(v)?).to_vec();
            self.write(plan.slot(p)?, &b);
        }
        Ok(outputs)
    }

    /// The current bytes of value `v` (e.g. a parameter after some steps).
    pub fn value(&self, v: ValueId) -> Result<HostTensor> {
        Ok(HostTensor { ty: self.trace.ty(v).clone(), bytes: self.bytes(self.plan.slot(v)?).to_vec() })
    }
}

/// Runs `trace` once on `inputs` with every value at its place in `plan`; returns the outputs.
pub fn eval(trace: &Trace, plan: &MemoryPlan, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    let mut ex = ArenaExecutor::new(trace, plan)?;
    ex.load(inputs)?;
    ex.step()
}
