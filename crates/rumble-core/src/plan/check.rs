//! The plan checker: verifies a [`MemoryPlan`] against its trace without trusting the planner.
//! It recomputes every lifetime itself from the node order and shares no code with
//! `lifetimes` or `assign`.
//!
//! Checked, in order:
//! 1. the plan has a slot for every value; a slot's size is its type's; arena slots end before
//!    the workspace, persistent slots within the persistent region; a slot that owns bytes (not
//!    a view) starts on an `ALIGN` boundary;
//! 2. parameters and optimizer state live in the persistent region, other inputs in the arena;
//! 3. aliases: a value with `alias_of = s` is defined by a view op (`reshape`, contiguous
//!    `slice`, a `permute` of size-1 axes, a `broadcast` adding size-1 axes) of `s`, lies in
//!    `s`'s region at `s`'s offset plus the view's byte offset, and within `s`'s bytes;
//! 4. in place: a value with `inplace_of = a` is a result of a pointwise node (elementwise or
//!    fused; or a `cache_write` over its cache, each result of a `cache_write_kv` over its own
//!    cache, a matmul over its addend: `Op::may_overwrite` of that result and operand)
//!    reading `a` unbroadcast (same shape), has `a`'s exact slot and element size, and every
//!    operand of that node that touches those bytes reads them with the same layout (a
//!    pointwise node), or is `a` itself (any other node);
//! 5. the arena: any two storage groups (a value owning bytes plus every view of it, or a
//!    node's scratch, live at its step) whose byte ranges meet are never live at the same step,
//!    except an operand and the result computed in place over it, which meet at exactly the
//!    step of that node; a node's scratch is aligned, in the arena, and holds at least what
//!    its op asks for (`Op::scratch_bytes`) and, from the next `ALIGN` boundary, the plan's
//!    `backend_scratch` for it (the backend's part, which ends the range);
//! 6. the persistent region: inputs' slots are disjoint; every other value there sits exactly
//!    in one input's slot as a chain of in-place results that starts at the input, where each
//!    link dies at the step the next is written, and ends in that input's `update_of` output;
//! 7. every `update_of` output reaches its input's slot: computed there, the input itself, a
//!    view of all of it, or listed in `copy_back` (and then the input's slot holds no chain).
//!
//! A collective of more than one rank counts as reading its operand until the first later node
//! that reads its result (the step's end if none), unless its result is computed over the
//! operand: a device may run it beside those nodes.

use crate::ir::{Op, OutputRole, Trace, ValueId};
use crate::plan::{ALIGN, MemoryPlan, Region, Slot, node_scratch_bytes};
use crate::{Error, Result};

/// Checks `plan` for `trace`; the error says which rule broke, for which values.
pub fn check(trace: &Trace, plan: &MemoryPlan) -> Result<()> {
    Checker::new(trace, plan)?.run()
}

struct Checker<'a> {
    trace: &'a Trace,
    plan: &'a MemoryPlan,
    slots: Vec<Slot>,
    /// Step writing each value: 0 for inputs, `i + 1` for node `i`'s results.
    step: Vec<usize>,
    /// The node defining each value.
    node: Vec<Option<usize>>,
    /// Last step reading each value (its own reads; `end` for outputs).
    read: Vec<usize>,
    end: usize,
}

fn err(msg: String) -> Error {
    Error::Plan(format!("check: {msg}"))
}

fn meet(a: &Slot, b: &Slot) -> bool {
    a.region == b.region && a.offset < b.offset + b.bytes.max(1) && b.offset < a.offset + a.bytes.max(1)
}

impl<'a> Checker<'a> {
    fn new(trace: &'a Trace, plan: &'a MemoryPlan) -> Result<Self> {
        let n = trace.num_values();
        if plan.slots.len() != n || plan.alias_of.len() != n || plan.inplace_of.len() != n {
            return Err(err(format!(
                "plan covers {} slots, {} aliases, {} in-place marks for {n} values",
                plan.slots.len(),
                plan.alias_of.len(),
                plan.inplace_of.len()
            )));
        }
        let slots = (0..n)
            .map(|i| plan.slots[i].ok_or_else(|| err(format!("%{i} has no slot"))))
            .collect::<Result<Vec<_>>>()?;
        let end = trace.nodes.len() + 1;
        let (mut step, mut node) = (vec![0; n], vec![None; n]);
        for (i, nd) in trace.nodes.iter().enumerate() {
            for o in &nd.outs {
                step[o.index()] = i + 1;
                node[o.index()] = Some(i);
            }
        }
        let mut read = step.clone();
        for (i, nd) in trace.nodes.iter().enumerate() {
            for a in &nd.args {
                read[a.index()] = read[a.index()].max(i + 1);
            }
        }
        for o in &trace.outputs {
            read[o.value.index()] = end;
        }
        // A collective of several ranks may run beside the nodes after it until the first that
        // reads its result: its operand is read until then, unless the result is over it.
        for (i, nd) in trace.nodes.iter().enumerate() {
            let Op::Collective { world, .. } = nd.op else { continue };
            let (a, o) = (nd.args[0], nd.outs[0]);
            if world < 2 || plan.inplace_of[o.index()] == Some(a) {
                continue;
            }
            let first = trace.nodes.iter().enumerate().skip(i + 1).find(|(_, x)| x.args.contains(&o));
            let until = first.map_or(end, |(j, _)| j + 1);
            read[a.index()] = read[a.index()].max(until);
        }
        Ok(Checker { trace, plan, slots, step, node, read, end })
    }

    fn run(&self) -> Result<()> {
        self.sizes()?;
        self.aliases()?;
        self.inplace()?;
        let (root, group_end) = self.groups()?;
        self.arena(&root, &group_end)?;
        self.persistent(&root, &group_end)?;
        self.updates(&root)
    }

    /// Rules 1 and 2.
    fn sizes(&self) -> Result<()> {
        let p = self.plan;
        if p.workspace_bytes > p.arena_bytes {
            return Err(err(format!("workspace {} exceeds the arena {}", p.workspace_bytes, p.arena_bytes)));
        }
        let values_end = p.arena_bytes - p.workspace_bytes;
        for (i, s) in self.slots.iter().enumerate() {
            let want = self.trace.types[i].size_in_bytes();
            if s.bytes != want {
                return Err(err(format!("%{i} has {} bytes, its type {} needs {want}", s.bytes, self.trace.types[i])));
            }
            let limit = if s.region == Region::Arena { values_end } else { p.persistent_bytes };
            if s.offset + s.bytes > limit {
                return Err(err(format!("%{i} at {}+{} overruns its region ({limit} bytes)", s.offset, s.bytes)));
            }
            if p.alias_of[i].is_none() && s.offset % ALIGN != 0 {
                return Err(err(format!("%{i} at offset {} is not {ALIGN}-byte aligned", s.offset)));
            }
        }
        for inp in &self.trace.inputs {
            let want = if inp.role.is_persistent() { Region::Persistent } else { Region::Arena };
            if self.slots[inp.value.index()].region != want {
                return Err(err(format!("input \"{}\" ({}) is not in the {want:?} region", inp.name, inp.role.name())));
            }
        }
        Ok(())
    }

    /// Rule 3.
    fn aliases(&self) -> Result<()> {
        for (i, a) in self.plan.alias_of.iter().enumerate() {
            let Some(src) = *a else { continue };
            let nd = self.node[i].map(|k| &self.trace.nodes[k]);
            let Some(nd) = nd.filter(|nd| nd.args.len() == 1 && nd.args[0] == src) else {
                return Err(err(format!("%{i} is marked a view of {src} but is not defined by an op on it")));
            };
            let (st, vt) = (self.trace.ty(src), &self.trace.types[i]);
            let off = match &nd.op {
                Op::Reshape { .. } => 0,
                Op::Slice { axis, start, .. } if st.dims().iter().take(*axis).product::<usize>() == 1 => {
                    start * st.shape.strides()[*axis] * st.dtype.size_in_bytes()
                }
                Op::Permute { perm } if keeps_order(st.dims(), perm) => 0,
                Op::Broadcast { .. } if st.numel() == vt.numel() => 0,
                op => return Err(err(format!("%{i} = {}({src}) is marked a view but copies", op.name()))),
            };
            let (s, v) = (self.slots[src.index()], self.slots[i]);
            if v.region != s.region || v.offset != s.offset + off || v.offset + v.bytes > s.offset + s.bytes {
                return Err(err(format!(
                    "view %{i} at {:?}+{} does not sit {off} bytes into {src} at {:?}+{}",
                    v.region, v.offset, s.region, s.offset
                )));
            }
        }
        Ok(())
    }

    /// Rule 4.
    fn inplace(&self) -> Result<()> {
        for (i, a) in self.plan.inplace_of.iter().enumerate() {
            let Some(a) = *a else { continue };
            let nd = self.node[i].map(|k| &self.trace.nodes[k]);
            // Pointwise ops over any operand; `cache_write` over its cache (`cache_write_kv`
            // each result over its own), a matmul over its addend (`Op::may_overwrite`).
            let out = ValueId(i as u32);
            let over = |nd: &crate::ir::Node| {
                let j = nd.outs.iter().position(|&x| x == out);
                j.is_some_and(|j| nd.args.iter().enumerate().any(|(k, &x)| x == a && nd.op.may_overwrite(j, k)))
            };
            let Some(nd) = nd.filter(|nd| over(nd)) else {
                return Err(err(format!("%{i} is marked in place over {a}, but is not pointwise on it")));
            };
            if self.trace.ty(a).shape != self.trace.types[i].shape {
                return Err(err(format!("%{i} is computed in place over {a}, which its node broadcasts")));
            }
            let v = self.slots[i];
            let esize = |x: ValueId| self.trace.ty(x).dtype.size_in_bytes();
            if self.slots[a.index()] != v || esize(a) != self.trace.types[i].dtype.size_in_bytes() {
                return Err(err(format!("%{i} is computed in place over {a} but their slots or element sizes differ")));
            }
            // A matmul over its addend reads its other operands while writing: none may share
            // bytes with the result, the addend itself included where it is also `a` or `b`.
            let pointwise = crate::plan::lifetimes::is_pointwise(&nd.op);
            let readers = nd.args.iter().filter(|&&x| meet(&self.slots[x.index()], &v)).count();
            for &x in &nd.args {
                if meet(&self.slots[x.index()], &v)
                    && (self.slots[x.index()] != v || esize(x) != esize(a) || (!pointwise && readers > 1))
                {
                    return Err(err(format!(
                        "%{i} overwrites {a} in place while the same node reads {x} from other bytes"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The root (owner of bytes) of every value, and the last step any view reads each root.
    fn groups(&self) -> Result<(Vec<ValueId>, Vec<usize>)> {
        let n = self.slots.len();
        let mut root: Vec<ValueId> = (0..n as u32).map(ValueId).collect();
        // Views are defined after their sources, so one pass in definition order suffices;
        // chase anyway in case ids are not in definition order.
        for (i, root_i) in root.iter_mut().enumerate() {
            let mut r = ValueId(i as u32);
            let mut hops = 0;
            while let Some(s) = self.plan.alias_of[r.index()] {
                r = s;
                hops += 1;
                if hops > n {
                    return Err(err(format!("%{i}'s aliases form a cycle")));
                }
            }
            *root_i = r;
        }
        let mut group_end: Vec<usize> = (0..n).map(|i| self.read[i].max(self.step[i])).collect();
        for (r, &read) in root.iter().zip(&self.read) {
            group_end[r.index()] = group_end[r.index()].max(read);
        }
        Ok((root, group_end))
    }

    /// Rule 5.
    fn arena(&self, root: &[ValueId], group_end: &[usize]) -> Result<()> {
        // (slot, first step, last step, value or `None` for scratch, node of scratch)
        let mut owners: Vec<(Slot, usize, usize, Option<usize>, usize)> = (0..self.slots.len())
            .filter(|&i| self.plan.alias_of[i].is_none() && self.slots[i].region == Region::Arena)
            .map(|i| (self.slots[i], self.step[i], group_end[i], Some(i), 0))
            .collect();
        let nodes = self.trace.nodes.len();
        if self.plan.scratch.len() != nodes || self.plan.backend_scratch.len() != nodes {
            return Err(err(format!(
                "{} scratch and {} backend scratch entries for {nodes} nodes",
                self.plan.scratch.len(),
                self.plan.backend_scratch.len(),
            )));
        }
        let values_end = self.plan.arena_bytes - self.plan.workspace_bytes;
        for (n, node) in self.trace.nodes.iter().enumerate() {
            let at = self.trace.arg_types(node);
            let backend = self.plan.backend_scratch[n];
            let want = node_scratch_bytes(node.op.scratch_bytes(&at), backend);
            if !backend.is_multiple_of(ALIGN) {
                return Err(err(format!("backend scratch of node {n} ({backend} bytes) is not {ALIGN}-byte aligned")));
            }
            match self.plan.scratch[n] {
                None if want == 0 => {}
                Some(s) if s.bytes >= want && s.region == Region::Arena && s.offset % ALIGN == 0 => {
                    if s.offset + s.bytes > values_end {
                        return Err(err(format!("scratch of node {n} overruns the arena")));
                    }
                    if !(s.offset + s.bytes - backend).is_multiple_of(ALIGN) {
                        return Err(err(format!(
                            "the backend's part of node {n}'s scratch (the last {backend} of {}+{}) is not \
                             {ALIGN}-byte aligned",
                            s.offset, s.bytes
                        )));
                    }
                    owners.push((s, n + 1, n + 1, None, n));
                }
                s => {
                    return Err(err(format!(
                        "node {n} ({}) needs {want} bytes of aligned arena scratch ({backend} of them the \
                         backend's), the plan gives {s:?}",
                        node.op.name()
                    )));
                }
            }
        }
        owners.sort_by_key(|o| o.0.offset);
        let succeeds = |later: Option<usize>, earlier: Option<usize>| match (later, earlier) {
            (Some(l), Some(e)) => {
                self.plan.inplace_of[l].is_some_and(|a| root[a.index()].index() == e) && group_end[e] == self.step[l]
            }
            _ => false,
        };
        let name = |o: &(Slot, usize, usize, Option<usize>, usize)| match o.3 {
            Some(i) => format!("%{i}"),
            None => format!("the scratch of node {}", o.4),
        };
        for (k, a) in owners.iter().enumerate() {
            for b in &owners[k + 1..] {
                if b.0.offset >= a.0.offset + a.0.bytes.max(1) {
                    break;
                }
                if a.2 < b.1 || b.2 < a.1 || succeeds(b.3, a.3) || succeeds(a.3, b.3) {
                    continue;
                }
                return Err(err(format!(
                    "{} (steps {}..{}, bytes {}+{}) and {} (steps {}..{}, bytes {}+{}) share arena bytes while both live",
                    name(a),
                    a.1,
                    a.2,
                    a.0.offset,
                    a.0.bytes,
                    name(b),
                    b.1,
                    b.2,
                    b.0.offset,
                    b.0.bytes
                )));
            }
        }
        Ok(())
    }

    /// Rule 6.
    fn persistent(&self, root: &[ValueId], group_end: &[usize]) -> Result<()> {
        let inputs: Vec<ValueId> =
            self.trace.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| i.value).collect();
        for (k, &p) in inputs.iter().enumerate() {
            for &q in &inputs[k + 1..] {
                if meet(&self.slots[p.index()], &self.slots[q.index()]) {
                    return Err(err(format!("persistent inputs {p} and {q} share bytes")));
                }
            }
        }
        for i in 0..self.slots.len() {
            let v = ValueId(i as u32);
            if self.slots[i].region != Region::Persistent || self.plan.alias_of[i].is_some() || inputs.contains(&v) {
                continue;
            }
            if !inputs.iter().any(|p| self.slots[p.index()] == self.slots[i]) {
                return Err(err(format!("{v} is in the persistent region but not exactly in an input's slot")));
            }
        }
        for &p in &inputs {
            let mut chain: Vec<usize> = (0..self.slots.len())
                .filter(|&i| {
                    self.plan.alias_of[i].is_none() && i != p.index() && self.slots[i] == self.slots[p.index()]
                })
                .collect();
            chain.sort_by_key(|&i| self.step[i]);
            let mut prev = p.index();
            for &m in &chain {
                let from = self.plan.inplace_of[m].map(|a| root[a.index()].index());
                if from != Some(prev) || group_end[prev] != self.step[m] {
                    return Err(err(format!(
                        "%{m} sits in {p}'s persistent slot but is not computed in place over %{prev} as it dies"
                    )));
                }
                prev = m;
            }
            if let Some(&tail) = chain.last() {
                let update = self.update_of(p);
                if update != Some(ValueId(tail as u32)) || group_end[tail] != self.end {
                    return Err(err(format!(
                        "{p}'s persistent slot ends the step holding %{tail}, not its update {update:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Rule 7.
    fn updates(&self, root: &[ValueId]) -> Result<()> {
        for &(v, p) in &self.plan.copy_back {
            if self.update_of(p) != Some(v) {
                return Err(err(format!("copy back of {v} into {p}, which is not {p}'s update")));
            }
            let holds_chain = (0..self.slots.len())
                .any(|i| self.plan.alias_of[i].is_none() && i != p.index() && self.slots[i] == self.slots[p.index()]);
            if holds_chain {
                return Err(err(format!("{p}'s slot holds an in-place result and a copy back")));
            }
        }
        for inp in self.trace.inputs.iter().filter(|i| i.role.is_persistent()) {
            let p = inp.value;
            let Some(u) = self.update_of(p) else { continue };
            // In its slot: computed there (rule 6 checked the chain) or a view of all of it.
            let in_slot = self.slots[u.index()] == self.slots[p.index()]
                && (root[u.index()] == p || self.plan.alias_of[u.index()].is_none());
            let copied = self.plan.copy_back.contains(&(u, p));
            if !(u == p || in_slot || copied) {
                return Err(err(format!("the update {u} of \"{}\" never reaches its slot", inp.name)));
            }
        }
        Ok(())
    }

    fn update_of(&self, p: ValueId) -> Option<ValueId> {
        self.trace.outputs.iter().find(|o| o.role == OutputRole::Update { of: p }).map(|o| o.value)
    }
}

/// True if permuting `dims` by `perm` leaves the elements in the same memory order: the axes
/// longer than 1 keep their relative order.
fn keeps_order(dims: &[usize], perm: &[usize]) -> bool {
    let mut last = None;
    for &p in perm {
        if dims[p] > 1 {
            if last.is_some_and(|l| l > p) {
                return false;
            }
            last = Some(p);
        }
    }
    true
}
