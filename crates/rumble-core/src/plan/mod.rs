//! The memory planner: every buffer's place is decided before the first kernel runs.
//!
//! A [`MemoryPlan`] gives each value of a trace a [`Slot`]: a byte range in the transient
//! **arena** (activations, saved-for-backward tensors, gradients, per-step inputs, outputs) or in
//! the **persistent** region (parameters, optimizer state). Executors on every backend read
//! slots and nothing else.
//!
//! **Architecture Invariant**: no two values whose lifetimes overlap share a byte of the arena
//! (checked independently by `check`).
//!
//! This first version (`plan_naive`) gives every value its own range: correct, no reuse. The
//! lifetime-based planner replaces its internals behind the same types.

use crate::ir::{InputRole, Trace};
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
    /// Bytes of the transient arena.
    pub arena_bytes: usize,
    /// Bytes of the persistent region.
    pub persistent_bytes: usize,
    /// Bytes a backend library needs as scratch (e.g. cuBLASLt's workspace), planned as its own
    /// range at the end of the arena.
    pub workspace_bytes: usize,
    /// The most bytes of arena values live at once: the lower bound for `arena_bytes`.
    pub load_bytes: usize,
    /// Indexed by `ValueId`; `None` for values that are never materialised.
    pub slots: Vec<Option<Slot>>,
}

impl MemoryPlan {
    pub fn slot(&self, v: crate::ir::ValueId) -> Result<Slot> {
        self.slots.get(v.index()).copied().flatten().ok_or_else(|| Error::Plan(format!("{v} has no slot")))
    }
    /// Offset of the library workspace inside the arena.
    pub fn workspace_offset(&self) -> usize {
        self.arena_bytes - self.workspace_bytes
    }
    /// All the step needs from the device at its peak.
    pub fn peak_bytes(&self) -> usize {
        self.arena_bytes + self.persistent_bytes
    }
}

pub fn align_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Every value its own aligned range, nothing reused.
pub fn plan_naive(trace: &Trace, workspace_bytes: usize) -> MemoryPlan {
    let mut slots = vec![None; trace.num_values()];
    let (mut arena, mut persistent) = (0, 0);
    let mut place = |v: crate::ir::ValueId, region: Region| {
        let bytes = trace.ty(v).size_in_bytes();
        let cursor = if region == Region::Arena { &mut arena } else { &mut persistent };
        slots[v.index()] = Some(Slot { region, offset: *cursor, bytes });
        *cursor += align_up(bytes.max(1), ALIGN);
    };
    for inp in &trace.inputs {
        let region = if inp.role == InputRole::Param || inp.role == InputRole::OptState {
            Region::Persistent
        } else {
            Region::Arena
        };
        place(inp.value, region);
    }
    for node in &trace.nodes {
        for o in &node.outs {
            place(*o, Region::Arena);
        }
    }
    let load = arena;
    let workspace = align_up(workspace_bytes, ALIGN);
    MemoryPlan {
        arena_bytes: arena + workspace,
        persistent_bytes: persistent,
        workspace_bytes: workspace,
        load_bytes: load,
        slots,
    }
}
