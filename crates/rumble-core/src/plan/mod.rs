//! The memory planner: every buffer's place is decided before the first kernel runs.
//!
//! A [`MemoryPlan`] gives each value of a trace a [`Slot`]: a byte range in the transient
//! **arena** (activations, saved-for-backward tensors, gradients, per-step inputs, outputs) or in
//! the **persistent** region (parameters, optimizer state). Executors on every backend read
//! slots and nothing else.
//!
//! In pipeline order: [`lifetimes`] (when each value is written and last read, its class, which
//! values share a buffer: views and in-place results) -> [`assign`] (offsets in one arena,
//! best-fit over several orders) -> [`report`] (bytes per class, LOAD, peak, what is live there)
//! -> [`svg`] (the timeline as a picture). [`check`] verifies a plan without trusting any of
//! them. [`plan_order`] places a trace in its own order; `crate::compile` (the one compile
//! entry point) runs the memory-aware scheduler and rematerialisation (`crate::passes`)
//! first and calls it. The planner calls no pass.
//!
//! **Architecture Invariant**: no two values whose lifetimes overlap share a byte of the arena
//! (checked independently by [`check::check`]).
//!
//! **Architecture Invariant**: an executor runs no kernel for a value with `alias_of` set (a
//! view: its slot lies inside its source's), and after the last node it copies each
//! `copy_back` value into its persistent input's slot; nothing else moves.
//!
//! How an executor uses a plan: allocate `arena_bytes` and `persistent_bytes`; write each input
//! at its slot (parameters and optimizer state once, per-step data before every step: a step
//! may overwrite dead inputs); run the nodes in order, each reading its operands' slots and
//! writing its results at theirs (a result with `inplace_of` set shares its operand's slot: the
//! node is pointwise, so element `i` is read before it is written), skipping views, and giving
//! a node with `scratch[node]` that range as scratch; then copy back. Every `update_of` output
//! not in `copy_back` already sits in its input's slot. `cpu::arena` is the reference
//! implementation.
//!
//! **Scratch.** A node's scratch range holds two parts, both live at its step only and placed
//! by best fit like any value: first the op's own (`Op::scratch_bytes`, the chunk buffers of
//! the fused ops), then, from the next `ALIGN` boundary, what the backend asks for that node
//! ([`BackendScratch`] in [`PlanOptions`]: cuBLASLt's workspace, reduction partials, ...),
//! found by [`MemoryPlan::backend_scratch_slot`]. The two parts are summed, not maxed: a
//! backend may use both at once. `workspace_bytes` is the older alternative, one range at the
//! end of the arena live for the whole step (the most any node needs); the CUDA backend plans
//! per node and leaves it 0.

pub mod assign;
pub mod check;
pub mod lifetimes;
mod pipeline;
pub mod report;
pub mod svg;

pub use lifetimes::{Class, LifetimeOptions, Lifetimes, view_offset};
pub use pipeline::{BackendScratch, PlanOptions, Planned, plan_in_order, plan_order};
pub use report::PlanReport;

use crate::ir::{OutputRole, Trace, ValueId};
use crate::{Error, Result};

/// GPU-friendly alignment of every slot, in bytes.
pub const ALIGN: usize = 256;

/// Which region a slot lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Region {
    /// The one transient arena, reused within a step.
    Arena,
    /// Parameters and optimizer state: alive across steps.
    Persistent,
}

/// Where one value lives: `bytes` bytes at `offset` of `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    pub region: Region,
    pub offset: usize,
    pub bytes: usize,
}

/// Placement of every value of one trace.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Bytes of the transient arena, workspace included: what an executor allocates.
    pub arena_bytes: usize,
    /// Bytes of the persistent region.
    pub persistent_bytes: usize,
    /// Bytes of a whole-step library workspace, planned as its own range at the end of the
    /// arena and live for the whole step (0 where the backend's scratch is planned per node,
    /// in `backend_scratch`).
    pub workspace_bytes: usize,
    /// The most bytes of arena values live at once: the lower bound for `arena_bytes`.
    pub load_bytes: usize,
    /// Indexed by `ValueId`; `None` for values that are never materialised.
    pub slots: Vec<Option<Slot>>,
    /// Indexed by `ValueId`: for a view, the value whose bytes it reads. No kernel runs for it.
    pub alias_of: Vec<Option<ValueId>>,
    /// Indexed by `ValueId`: for a value computed in place, the operand whose bytes it
    /// overwrites (same slot; the node is elementwise).
    pub inplace_of: Vec<Option<ValueId>>,
    /// `(value, input)`: after the last node, copy `value`'s bytes into persistent `input`'s
    /// slot (an `update_of` output that could not be computed in place).
    pub copy_back: Vec<(ValueId, ValueId)>,
    /// Indexed by node: the arena range of the node's scratch memory (`Op::scratch_bytes`, then
    /// `backend_scratch[node]` bytes from the next `ALIGN` boundary), live at its step only;
    /// `None` for nodes that need none.
    pub scratch: Vec<Option<Slot>>,
    /// Indexed by node: bytes of its scratch range the backend asked for (see
    /// [`MemoryPlan::backend_scratch_slot`]); 0 for none.
    pub backend_scratch: Vec<usize>,
}

impl MemoryPlan {
    pub fn slot(&self, v: ValueId) -> Result<Slot> {
        self.slots.get(v.index()).copied().flatten().ok_or_else(|| Error::Plan(format!("{v} has no slot")))
    }
    /// The backend's part of node `node`'s scratch range (after the op's own part), `None`
    /// where the backend asked for none.
    pub fn backend_scratch_slot(&self, node: usize) -> Option<Slot> {
        let bytes = self.backend_scratch.get(node).copied().unwrap_or(0);
        let s = self.scratch.get(node).copied().flatten()?;
        (bytes > 0 && bytes <= s.bytes).then(|| Slot { region: s.region, offset: s.offset + s.bytes - bytes, bytes })
    }
    /// Offset of the library workspace inside the arena.
    pub fn workspace_offset(&self) -> usize {
        self.arena_bytes - self.workspace_bytes
    }
    /// All the step needs from the device at its peak.
    pub fn peak_bytes(&self) -> usize {
        self.arena_bytes + self.persistent_bytes
    }
    /// Bytes of the arena that hold values (the arena less the workspace): compare with LOAD.
    pub fn values_bytes(&self) -> usize {
        self.arena_bytes - self.workspace_bytes
    }
    /// True if `v` is a view: executors read its source's bytes and run no kernel for it.
    pub fn is_alias(&self, v: ValueId) -> bool {
        self.alias_of.get(v.index()).copied().flatten().is_some()
    }
}

pub fn align_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Bytes of a node's scratch range: the op's own `op_bytes`, then `backend_bytes` from the next
/// `ALIGN` boundary (the backend's part ends the range).
pub fn node_scratch_bytes(op_bytes: usize, backend_bytes: usize) -> usize {
    if backend_bytes == 0 { op_bytes } else { align_up(op_bytes, ALIGN) + backend_bytes }
}

/// Every value its own aligned range, nothing reused, nothing aliased; updates are copied back.
pub fn plan_naive(trace: &Trace, workspace_bytes: usize) -> MemoryPlan {
    let mut slots = vec![None; trace.num_values()];
    let (mut arena, mut persistent) = (0, 0);
    let take = |cursor: &mut usize, region: Region, bytes: usize| {
        let s = Slot { region, offset: *cursor, bytes };
        *cursor += align_up(bytes.max(1), ALIGN);
        s
    };
    for inp in &trace.inputs {
        let bytes = trace.ty(inp.value).size_in_bytes();
        slots[inp.value.index()] = Some(if inp.role.is_persistent() {
            take(&mut persistent, Region::Persistent, bytes)
        } else {
            take(&mut arena, Region::Arena, bytes)
        });
    }
    let mut scratch = Vec::with_capacity(trace.nodes.len());
    for node in &trace.nodes {
        for o in &node.outs {
            slots[o.index()] = Some(take(&mut arena, Region::Arena, trace.ty(*o).size_in_bytes()));
        }
        let at = trace.arg_types(node);
        let bytes = node.op.scratch_bytes(&at);
        scratch.push((bytes > 0).then(|| take(&mut arena, Region::Arena, bytes)));
    }
    let load = arena;
    let workspace = align_up(workspace_bytes, ALIGN);
    let mut copy_back: Vec<(ValueId, ValueId)> = Vec::new();
    for out in &trace.outputs {
        if let OutputRole::Update { of } = out.role
            && out.value != of
            && !copy_back.iter().any(|&(_, d)| d == of)
        {
            copy_back.push((out.value, of));
        }
    }
    MemoryPlan {
        arena_bytes: arena + workspace,
        persistent_bytes: persistent,
        workspace_bytes: workspace,
        load_bytes: load,
        slots,
        alias_of: vec![None; trace.num_values()],
        inplace_of: vec![None; trace.num_values()],
        copy_back,
        backend_scratch: vec![0; scratch.len()],
        scratch,
    }
}
