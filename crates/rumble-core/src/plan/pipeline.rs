//! The planner's entry points: [`plan_order`] (place the trace in the order it is given) and
//! [`plan_in_order`]. Scheduling and rematerialisation before placing are `crate::compile`'s.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use super::assign::{Item, assign};
use super::lifetimes::{LifetimeOptions, Lifetimes, Storage, lifetimes_with_scratch};
use super::report::PlanReport;
use super::{ALIGN, MemoryPlan, Region, Slot, align_up};
use crate::ir::{Op, TensorType, Trace, ValueId, verify};
use crate::{Error, Result};

/// The signature of a [`BackendScratch`] function: a node's op, operand types and result
/// types in, the scratch bytes the backend needs while running it out.
pub type BackendScratchFn = dyn Fn(&Op, &[&TensorType], &[&TensorType]) -> Result<usize> + Send + Sync;

/// How much scratch a backend needs for each node beyond the op's own (`Op::scratch_bytes`),
/// decided from the node's op and types alone. Keyed by op and types rather than by node
/// index because `compile::plan` reorders nodes and rematerialisation adds some.
#[derive(Clone)]
pub struct BackendScratch(pub Arc<BackendScratchFn>);

impl BackendScratch {
    pub fn new(f: impl Fn(&Op, &[&TensorType], &[&TensorType]) -> Result<usize> + Send + Sync + 'static) -> Self {
        BackendScratch(Arc::new(f))
    }

    /// The backend's bytes for every node of `trace`, each rounded up to `ALIGN`; an error
    /// names the node and its op.
    pub fn per_node(&self, trace: &Trace) -> Result<Vec<usize>> {
        trace
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let at = trace.arg_types(node);
                let ot: Vec<&TensorType> = node.outs.iter().map(|o| trace.ty(*o)).collect();
                (self.0)(&node.op, &at, &ot)
                    .map(|b| align_up(b, ALIGN))
                    .map_err(|e| Error::Plan(format!("backend scratch of node {i} ({}): {e}", node.op.name())))
            })
            .collect()
    }
}

impl fmt::Debug for BackendScratch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BackendScratch(..)")
    }
}

/// How the planner places buffers (scheduling and rematerialisation are
/// `compile::CompileOptions`').
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Bytes of a whole-step library workspace, given its own range at the end of the arena and
    /// live for the whole step. Prefer `backend_scratch`, which plans scratch per node.
    pub workspace_bytes: usize,
    /// The backend's scratch per node, planned with the node's own scratch (see the `plan`
    /// module doc): live at its node's step only, reused like any buffer. The scheduler does not
    /// see it (it is transient); a memory budget for rematerialisation counts the largest.
    pub backend_scratch: Option<BackendScratch>,
    /// Let elementwise nodes write over a dying operand (and updates over their parameter).
    pub inplace: bool,
    /// How many of the biggest buffers live at the peak the report lists.
    pub peak_buffers: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { workspace_bytes: 0, backend_scratch: None, inplace: true, peak_buffers: 12 }
    }
}

/// A planned trace: the trace as it will run (after scheduling and rematerialisation, so its
/// value ids are the ones the plan speaks of), its plan, its lifetimes and its report.
#[derive(Clone, Debug)]
pub struct Planned {
    pub trace: Trace,
    pub plan: MemoryPlan,
    pub lifetimes: Lifetimes,
    pub report: PlanReport,
}

impl Planned {
    /// The timeline picture (SVG) of this plan.
    pub fn svg(&self) -> String {
        super::svg::timeline(&self.trace, &self.lifetimes, &self.report)
    }
}

/// The plan of `trace` in its own node order with in-place results, and nothing else: the
/// drop-in replacement for `plan_naive` where the trace's order must not change.
pub fn plan_in_order(trace: &Trace, workspace_bytes: usize) -> Result<MemoryPlan> {
    let opts = PlanOptions { workspace_bytes, ..Default::default() };
    Ok(plan_order(trace, &opts)?.plan)
}

/// Places every value of `trace` in its node order (no passes run). The trace must verify.
pub fn plan_order(trace: &Trace, opts: &PlanOptions) -> Result<Planned> {
    let t0 = Instant::now();
    verify(trace)?;
    let backend = match &opts.backend_scratch {
        Some(b) => b.per_node(trace)?,
        None => vec![0; trace.nodes.len()],
    };
    let lt = lifetimes_with_scratch(trace, LifetimeOptions { inplace: opts.inplace }, &backend);

    // Persistent buffers one after another in input order; arena buffers by best fit.
    let mut buf_offset = vec![0; lt.buffers.len()];
    let mut persistent = 0;
    let mut arena_ids = Vec::new();
    let mut items = Vec::new();
    for (i, b) in lt.buffers.iter().enumerate() {
        match b.region {
            Region::Persistent => {
                buf_offset[i] = persistent;
                persistent += b.aligned();
            }
            Region::Arena => {
                arena_ids.push(i);
                items.push(Item { start: b.start, end: b.end, size: b.aligned() });
            }
        }
    }
    let placement = assign(&items);
    for (k, &i) in arena_ids.iter().enumerate() {
        buf_offset[i] = placement.offsets[k];
    }

    let n = trace.num_values();
    let mut slots = vec![None; n];
    let mut alias_of = vec![None; n];
    let mut inplace_of = vec![None; n];
    for (i, life) in lt.values.iter().enumerate() {
        let bytes = trace.types[i].size_in_bytes();
        // (Scratch buffers have no members, so no value refers to them.)
        let (buf, extra) = match life.storage {
            Storage::Buffer(b) => (b, 0),
            Storage::View { of, root, byte_offset } => {
                alias_of[i] = Some(of);
                match lt.values[root.index()].storage {
                    Storage::Buffer(b) => (b, byte_offset),
                    Storage::View { .. } => {
                        return Err(Error::Plan(format!("view %{i}'s root {root} is itself a view")));
                    }
                }
            }
        };
        let b = lt.buffers.get(buf).ok_or_else(|| Error::Plan(format!("%{i} was given no buffer")))?;
        slots[i] = Some(Slot { region: b.region, offset: buf_offset[buf] + extra, bytes });
        inplace_of[i] = life.inplace_of;
    }
    let mut scratch = vec![None; trace.nodes.len()];
    for (i, b) in lt.buffers.iter().enumerate() {
        if let Some(n) = b.scratch_of {
            scratch[n] = Some(Slot { region: Region::Arena, offset: buf_offset[i], bytes: b.bytes });
        }
    }
    let workspace = align_up(opts.workspace_bytes, ALIGN);
    let plan = MemoryPlan {
        arena_bytes: placement.size + workspace,
        persistent_bytes: persistent,
        workspace_bytes: workspace,
        load_bytes: lt.load().0,
        slots,
        alias_of,
        inplace_of,
        copy_back: lt.copy_back.clone(),
        scratch,
        backend_scratch: backend,
    };
    check_copy_back(trace, &plan)?;
    let mut report = PlanReport::new(trace, &lt, &plan, placement.order, opts.peak_buffers);
    report.plan_millis = t0.elapsed().as_secs_f64() * 1e3;
    Ok(Planned { trace: trace.clone(), plan, lifetimes: lt, report })
}

/// Copies back run one after another, so none may read bytes another one writes.
fn check_copy_back(trace: &Trace, plan: &MemoryPlan) -> Result<()> {
    let name = |v: ValueId| trace.inputs.iter().find(|i| i.value == v).map_or(v.to_string(), |i| i.name.clone());
    for &(src, of) in &plan.copy_back {
        let s = plan.slot(src)?;
        for &(_, dst) in &plan.copy_back {
            let d = plan.slot(dst)?;
            if s.region == d.region && s.offset < d.offset + d.bytes && d.offset < s.offset + s.bytes {
                return Err(Error::Plan(format!(
                    "the update of \"{}\" is {src}, which lies in the slot of \"{}\", itself overwritten by an update",
                    name(of),
                    name(dst)
                )));
            }
        }
    }
    Ok(())
}
