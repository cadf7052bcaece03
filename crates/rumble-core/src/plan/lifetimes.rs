//! Lifetimes: when each value of a scheduled trace is written and last read, what class of
//! buffer it is, and which values share one buffer.
//!
//! **Time.** Step 0 is "inputs are written", node `i` runs at step `i + 1`, and step `n + 1`
//! (`end`) is "outputs are read and updates written back". A value is live over the closed
//! interval `[def, last]`: a node's operands and results are live together at its step.
//!
//! **Views.** `reshape`, a `slice` that is contiguous (every axis before `axis` has size 1),
//! a `permute` that only moves size-1 axes and a `broadcast` that only adds size-1 axes read
//! their operand's bytes in place: they get no buffer, only a byte offset into their source's,
//! and they keep the source alive as long as they are read.
//!
//! **Buffers.** A buffer holds one value, or a chain of values computed in place: a pointwise
//! node (elementwise, or a fused body) may write a result over an operand of the same shape
//! whose last read is that node. A parameter's or optimizer state's buffer is persistent; the chain in it must end
//! in the input's `update_of` output, so that the new value is found there after the step.
//! Everything else lives in the transient arena, and so does a node's scratch memory (what
//! its op asks for, `Op::scratch_bytes`, plus what the backend asks for, see
//! [`lifetimes_with_scratch`]): a buffer of no value, live at its node's step only.
//!
//! **Classes** are derived, not declared: see [`Class`].

use crate::ir::{
    Addend, CollectiveOp, Def, InputRole, Op, OutputRole, Phase, TensorType, Trace, ValueId, collective_joins,
};
use crate::plan::{ALIGN, Region, align_up, node_scratch_bytes};

/// What a buffer is for, as the memory report groups bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// A model parameter (persistent).
    Param,
    /// Optimizer state (persistent).
    OptState,
    /// Other persistent state: a KV cache (input role `state`).
    State,
    /// Per-step data fed to the trace.
    Input,
    /// A forward value read by the backward (or an input of a split backward trace).
    Saved,
    /// A backward value consumed by the optimizer or returned as `grad_of` (or a cotangent input).
    Gradient,
    /// A trace output (loss, logits, a new parameter awaiting its copy back).
    Output,
    /// Everything else: dies within its phase.
    Temporary,
    /// A node's scratch memory (`Op::scratch_bytes` plus the backend's), live during its node
    /// only.
    Scratch,
}

impl Class {
    pub const ALL: [Class; 9] = [
        Class::Param,
        Class::OptState,
        Class::State,
        Class::Input,
        Class::Saved,
        Class::Gradient,
        Class::Output,
        Class::Temporary,
        Class::Scratch,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Class::Param => "parameter",
            Class::OptState => "optimizer_state",
            Class::State => "state",
            Class::Input => "input",
            Class::Saved => "saved_for_backward",
            Class::Gradient => "gradient",
            Class::Output => "output",
            Class::Temporary => "temporary",
            Class::Scratch => "scratch",
        }
    }
}

/// Where a value's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// A member of buffer `buffer` (its first value, or one computed in place over the last).
    Buffer(usize),
    /// A view of `of` (the node's operand); its bytes start `byte_offset` bytes into `root`'s.
    View { of: ValueId, root: ValueId, byte_offset: usize },
}

/// The lifetime facts of one value.
#[derive(Clone, Debug)]
pub struct ValueLife {
    /// Step that writes it.
    pub def: usize,
    /// Last step that reads it, through any view of it, `end` for outputs; `def` if unread.
    pub last: usize,
    pub class: Class,
    pub storage: Storage,
    /// For a value computed in place: the operand whose bytes it overwrites.
    pub inplace_of: Option<ValueId>,
}

/// One buffer: the values that occupy it, one after another.
#[derive(Clone, Debug)]
pub struct Buffer {
    pub region: Region,
    /// Bytes of its largest member (all members of a chain have equal size).
    pub bytes: usize,
    /// First and last step at which some member is live.
    pub start: usize,
    pub end: usize,
    /// Members in time order; each after the first is computed in place over the one before.
    /// Empty for scratch.
    pub members: Vec<ValueId>,
    /// For an op's scratch memory: the node (index) it belongs to.
    pub scratch_of: Option<usize>,
}

impl Buffer {
    /// Size as placed: aligned, and never zero so that every buffer has its own address.
    pub fn aligned(&self) -> usize {
        align_up(self.bytes.max(1), ALIGN)
    }
}

/// Lifetimes of every value of one trace, in its current node order.
#[derive(Clone, Debug)]
pub struct Lifetimes {
    /// The last step (`nodes + 1`).
    pub end: usize,
    /// Indexed by `ValueId`.
    pub values: Vec<ValueLife>,
    pub buffers: Vec<Buffer>,
    /// `(value, input)`: after the last node, copy `value` into persistent `input`'s buffer
    /// (an `update_of` output that could not be computed in place).
    pub copy_back: Vec<(ValueId, ValueId)>,
}

/// Options that change how buffers are formed.
#[derive(Clone, Copy, Debug)]
pub struct LifetimeOptions {
    /// Let pointwise nodes write over a dying operand of the same shape.
    pub inplace: bool,
}

impl Default for LifetimeOptions {
    fn default() -> Self {
        LifetimeOptions { inplace: true }
    }
}

/// True for ops that compute each result element from the same-index elements of their
/// operands: elementwise ops and fused elementwise bodies. Such a node may write a result over
/// an operand read unbroadcast (same shape) with the same element size.
pub fn is_pointwise(op: &Op) -> bool {
    op.is_elementwise() || matches!(op, Op::Fused(_))
}

/// True if the op may compute a result over some operand (`Op::may_overwrite`).
fn may_overwrite_any(op: &Op) -> bool {
    is_pointwise(op)
        || matches!(
            op,
            Op::CacheWrite { .. }
                | Op::CacheWriteKv { .. }
                | Op::Matmul { acc: Addend::Full, .. }
                | Op::MatmulPre { acc: Addend::Full, .. }
                | Op::RmsNormBackward { acc: true, .. }
                | Op::Collective { op: CollectiveOp::AllReduce, .. }
        )
}

/// Byte offset into its operand at which a view op's result starts, or `None` if the op
/// copies. `arg` and `out` are the operand and result types.
pub fn view_offset(op: &Op, arg: &TensorType, out: &TensorType) -> Option<usize> {
    match op {
        Op::Reshape { .. } => Some(0),
        Op::Slice { axis, start, .. } => {
            let dims = arg.dims();
            if dims[..*axis].iter().all(|&d| d == 1) {
                let inner: usize = dims[axis + 1..].iter().product();
                Some(start * inner * arg.dtype.size_in_bytes())
            } else {
                None
            }
        }
        Op::Permute { perm } => {
            let moved: Vec<usize> = perm.iter().copied().filter(|&p| arg.dims()[p] != 1).collect();
            moved.windows(2).all(|w| w[0] < w[1]).then_some(0)
        }
        Op::Broadcast { .. } => (arg.numel() == out.numel()).then_some(0),
        _ => None,
    }
}

/// Computes the lifetimes, classes and buffers of `trace` in its node order. The trace must
/// be verified (every value defined once, before use).
pub fn lifetimes(trace: &Trace, opts: LifetimeOptions) -> Lifetimes {
    lifetimes_with_scratch(trace, opts, &[])
}

/// [`lifetimes`] with `backend[i]` more bytes of scratch for node `i` (missing entries: 0),
/// placed after the op's own (`plan::node_scratch_bytes`) in the node's one scratch buffer.
pub fn lifetimes_with_scratch(trace: &Trace, opts: LifetimeOptions, backend: &[usize]) -> Lifetimes {
    let n = trace.num_values();
    let end = trace.nodes.len() + 1;
    let defs = trace.defs();
    let step_of = |v: ValueId| match defs[v.index()] {
        Some(Def::Node { node, .. }) => node + 1,
        _ => 0,
    };
    let node_of = |v: ValueId| match defs[v.index()] {
        Some(Def::Node { node, .. }) => Some(node),
        _ => None,
    };

    // Views: each resolves to a root value and a byte offset into it.
    let mut view: Vec<Option<(ValueId, ValueId, usize)>> = vec![None; n]; // (of, root, offset)
    for node in &trace.nodes {
        if node.args.len() != 1 || node.outs.len() != 1 {
            continue;
        }
        let (a, o) = (node.args[0], node.outs[0]);
        if let Some(off) = view_offset(&node.op, trace.ty(a), trace.ty(o)) {
            let (root, base) = match view[a.index()] {
                Some((_, r, b)) => (r, b),
                None => (a, 0),
            };
            view[o.index()] = Some((a, root, base + off));
        }
    }
    let root = |v: ValueId| view[v.index()].map_or(v, |(_, r, _)| r);

    // Own last reads, then each root's last read over its views.
    let mut last: Vec<usize> = (0..n).map(|i| step_of(ValueId(i as u32))).collect();
    for (i, node) in trace.nodes.iter().enumerate() {
        for a in &node.args {
            last[a.index()] = last[a.index()].max(i + 1);
        }
    }
    for out in &trace.outputs {
        last[out.value.index()] = end;
    }
    let mut root_last = last.clone();
    for (v, &l) in last.iter().enumerate() {
        let r = root(ValueId(v as u32)).index();
        root_last[r] = root_last[r].max(l);
    }

    let classes = classify(trace, &defs, &root);
    let mut values: Vec<ValueLife> = (0..n)
        .map(|i| {
            let v = ValueId(i as u32);
            let storage = match view[i] {
                Some((of, root, byte_offset)) => Storage::View { of, root, byte_offset },
                None => Storage::Buffer(usize::MAX),
            };
            let last = if view[i].is_some() { last[i] } else { root_last[i] };
            ValueLife { def: step_of(v), last, class: classes[root(v).index()], storage, inplace_of: None }
        })
        .collect();

    let mut b = Builder { trace, values: &mut values, buffers: Vec::new(), view: &view, node_of: &node_of };
    // Persistent inputs first, with the in-place chains that end in their updates.
    for inp in trace.inputs.iter().filter(|i| i.role.is_persistent()) {
        let id = b.new_buffer(Region::Persistent, inp.value);
        b.buffers[id].end = end;
        if opts.inplace
            && let Some(u) = update_of(trace, inp.value)
            && let Some(chain) = b.persistent_chain(inp.value, u)
        {
            for (prev, v) in chain {
                b.values[v.index()].inplace_of = Some(prev);
                b.values[v.index()].class = b.values[inp.value.index()].class;
                b.join(id, v);
            }
            b.buffers[id].end = end;
        }
    }
    for inp in trace.inputs.iter().filter(|i| !i.role.is_persistent()) {
        b.new_buffer(Region::Arena, inp.value);
    }
    for (i, node) in trace.nodes.iter().enumerate() {
        for &o in &node.outs {
            if view[o.index()].is_some() || b.values[o.index()].storage != Storage::Buffer(usize::MAX) {
                continue;
            }
            let over = if opts.inplace && may_overwrite_any(&node.op) { b.arena_inplace(i, o) } else { None };
            match over {
                Some((arg, buf)) => {
                    b.values[o.index()].inplace_of = Some(arg);
                    b.join(buf, o);
                }
                None => {
                    b.new_buffer(Region::Arena, o);
                }
            }
        }
    }
    let mut buffers = b.buffers;
    // A collective of several ranks runs beside the nodes up to its join: unless its result is
    // computed over its operand, the operand (and what it views) is read until then.
    for (c, join) in collective_joins(trace) {
        let (a, o) = (trace.nodes[c].args[0], trace.nodes[c].outs[0]);
        if values[o.index()].inplace_of == Some(a) {
            continue;
        }
        let until = join + 1;
        values[a.index()].last = values[a.index()].last.max(until);
        let r = root(a);
        values[r.index()].last = values[r.index()].last.max(until);
        if let Storage::Buffer(buf) = values[r.index()].storage {
            buffers[buf].end = buffers[buf].end.max(until);
        }
    }
    for (i, node) in trace.nodes.iter().enumerate() {
        let at = trace.arg_types(node);
        let bytes = node_scratch_bytes(node.op.scratch_bytes(&at), backend.get(i).copied().unwrap_or(0));
        if bytes > 0 {
            let (start, end) = (i + 1, i + 1);
            buffers.push(Buffer { region: Region::Arena, bytes, start, end, members: Vec::new(), scratch_of: Some(i) });
        }
    }

    // Updates not found in their input's buffer are copied back after the last node (only the
    // first update of an input counts).
    let mut copy_back = Vec::new();
    let mut seen = Vec::new();
    for out in &trace.outputs {
        let OutputRole::Update { of } = out.role else { continue };
        if seen.contains(&of) {
            continue;
        }
        seen.push(of);
        let u = out.value;
        let in_place = values[u.index()].storage == values[of.index()].storage;
        let same_bytes = view[u.index()].is_some_and(|(_, r, off)| r == of && off == 0);
        if u != of && !in_place && !same_bytes {
            copy_back.push((u, of));
        }
    }
    Lifetimes { end, values, buffers, copy_back }
}

/// The first `update_of` output naming persistent input `p`.
fn update_of(trace: &Trace, p: ValueId) -> Option<ValueId> {
    trace.outputs.iter().find(|o| o.role == OutputRole::Update { of: p }).map(|o| o.value)
}

struct Builder<'a, F> {
    trace: &'a Trace,
    values: &'a mut Vec<ValueLife>,
    buffers: Vec<Buffer>,
    view: &'a [Option<(ValueId, ValueId, usize)>],
    node_of: &'a F,
}

impl<F: Fn(ValueId) -> Option<usize>> Builder<'_, F> {
    fn bytes(&self, v: ValueId) -> usize {
        self.trace.ty(v).size_in_bytes()
    }

    fn new_buffer(&mut self, region: Region, v: ValueId) -> usize {
        let life = &self.values[v.index()];
        let (start, end) = (life.def, life.last);
        self.buffers.push(Buffer { region, bytes: self.bytes(v), start, end, members: vec![v], scratch_of: None });
        self.values[v.index()].storage = Storage::Buffer(self.buffers.len() - 1);
        self.buffers.len() - 1
    }

    fn join(&mut self, buf: usize, v: ValueId) {
        let last = self.values[v.index()].last;
        let b = &mut self.buffers[buf];
        b.members.push(v);
        b.end = b.end.max(last);
        self.values[v.index()].storage = Storage::Buffer(buf);
    }

    /// `(root, offset)` of `a`'s bytes.
    fn resolve(&self, a: ValueId) -> (ValueId, usize) {
        self.view[a.index()].map_or((a, 0), |(_, r, off)| (r, off))
    }

    /// True if `a` may be overwritten in place by `o`, a result of pointwise node `node` whose
    /// last read of `a`'s root `r` is this node: `a` has `o`'s shape and element size (it is
    /// read unbroadcast) and covers all of `r` at offset 0, and every other operand of the node
    /// that reads `r` does so with the same layout (pointwise nodes; any other node, a matmul
    /// over its addend, must read `r` through that one operand alone, not also as `a` or `b`).
    fn overwritable(&self, node: usize, a: ValueId, o: ValueId, r: ValueId) -> bool {
        let (ta, to) = (self.trace.ty(a), self.trace.ty(o));
        let args = &self.trace.nodes[node].args;
        let same = |x: ValueId| {
            let (xr, off) = self.resolve(x);
            xr != r || off == 0 && self.bytes(x) == self.bytes(r) && self.trace.ty(x).dtype == ta.dtype
        };
        let readers = args.iter().filter(|&&x| self.resolve(x).0 == r).count();
        ta.shape == to.shape
            && ta.dtype.size_in_bytes() == to.dtype.size_in_bytes()
            && self.values[r.index()].last == node + 1
            && (is_pointwise(&self.trace.nodes[node].op) || readers == 1)
            && args.iter().all(|&x| same(x))
            && same(a)
    }

    /// An operand of node `node` whose arena buffer `o` may continue in place.
    fn arena_inplace(&self, node: usize, o: ValueId) -> Option<(ValueId, usize)> {
        let nd = &self.trace.nodes[node];
        let j = nd.outs.iter().position(|&x| x == o)?;
        for (k, &a) in nd.args.iter().enumerate() {
            let (r, _) = self.resolve(a);
            if !nd.op.may_overwrite(j, k) {
                continue;
            }
            let Storage::Buffer(buf) = self.values[r.index()].storage else { continue };
            let b = self.buffers.get(buf)?;
            let is_output = self.trace.outputs.iter().any(|out| out.value == r);
            if b.region == Region::Arena
                && b.members.last() == Some(&r)
                && !is_output
                && self.overwritable(node, a, o, r)
            {
                return Some((a, buf));
            }
        }
        None
    }

    /// A chain `p -> t1 -> ... -> u` of pointwise nodes, each computing its value in place
    /// over the one before, ending in `u`, the update of persistent input `p`. Returns the
    /// `(operand, value)` pairs from `t1` on, or `None` if there is none.
    fn persistent_chain(&self, p: ValueId, u: ValueId) -> Option<Vec<(ValueId, ValueId)>> {
        let mut chain = Vec::new();
        self.chain_to(p, u, &mut chain, 0).then(|| {
            chain.reverse();
            chain
        })
    }

    fn chain_to(&self, p: ValueId, cur: ValueId, chain: &mut Vec<(ValueId, ValueId)>, depth: usize) -> bool {
        let Some(node) = (self.node_of)(cur) else { return false };
        let nd = &self.trace.nodes[node];
        if depth > 16 || !may_overwrite_any(&nd.op) || self.view[cur.index()].is_some() {
            return false;
        }
        if self.values[cur.index()].storage != Storage::Buffer(usize::MAX) {
            return false; // already placed
        }
        let Some(j) = nd.outs.iter().position(|&x| x == cur) else { return false };
        for (k, &a) in nd.args.iter().enumerate() {
            let (r, _) = self.resolve(a);
            if !nd.op.may_overwrite(j, k) || !self.overwritable(node, a, cur, r) {
                continue;
            }
            chain.push((a, cur));
            if r == p {
                return true;
            }
            let is_output = self.trace.outputs.iter().any(|out| out.value == r);
            if (self.node_of)(r).is_some() && !is_output && self.chain_to(p, r, chain, depth + 1) {
                return true;
            }
            chain.pop();
        }
        false
    }
}

/// The class of every root value (views take their root's class).
fn classify(trace: &Trace, defs: &[Option<Def>], root: &dyn Fn(ValueId) -> ValueId) -> Vec<Class> {
    let n = trace.num_values();
    let phase_of = |v: ValueId| match defs[v.index()] {
        Some(Def::Node { node, .. }) => Some(trace.nodes[node].phase),
        _ => None,
    };
    // Phases that read each root (through any view).
    let (mut read_bwd, mut read_opt) = (vec![false; n], vec![false; n]);
    for node in &trace.nodes {
        for a in &node.args {
            let r = root(*a).index();
            match node.phase {
                Phase::Backward => read_bwd[r] = true,
                Phase::Optimizer => read_opt[r] = true,
                Phase::Forward => {}
            }
        }
    }
    let (mut grad_out, mut plain_out) = (vec![false; n], vec![false; n]);
    for out in &trace.outputs {
        let r = root(out.value).index();
        match out.role {
            OutputRole::Grad { .. } => grad_out[r] = true,
            OutputRole::Output | OutputRole::Update { .. } | OutputRole::Saved => plain_out[r] = true,
        }
    }
    let mut class = vec![Class::Temporary; n];
    for inp in &trace.inputs {
        class[inp.value.index()] = match inp.role {
            InputRole::Param => Class::Param,
            InputRole::OptState => Class::OptState,
            InputRole::State => Class::State,
            InputRole::Input => Class::Input,
            InputRole::Saved => Class::Saved,
            InputRole::Cotangent => Class::Gradient,
        };
    }
    for (i, c) in class.iter_mut().enumerate() {
        let Some(phase) = phase_of(ValueId(i as u32)) else { continue };
        *c = if grad_out[i] || (phase == Phase::Backward && read_opt[i]) {
            Class::Gradient
        } else if plain_out[i] {
            Class::Output
        } else if phase == Phase::Forward && (read_bwd[i] || read_opt[i]) {
            Class::Saved
        } else {
            Class::Temporary
        };
    }
    class
}

impl Lifetimes {
    /// Live arena bytes (aligned sizes) at every step `0..=end`.
    pub fn live_bytes(&self) -> Vec<usize> {
        let mut diff = vec![0i64; self.end + 2];
        for b in self.buffers.iter().filter(|b| b.region == Region::Arena) {
            diff[b.start] += b.aligned() as i64;
            diff[b.end + 1] -= b.aligned() as i64;
        }
        let mut acc = 0i64;
        diff[..=self.end]
            .iter()
            .map(|d| {
                acc += d;
                acc as usize
            })
            .collect()
    }

    /// LOAD: the most arena bytes live at once, and the first step where it is reached.
    pub fn load(&self) -> (usize, usize) {
        let live = self.live_bytes();
        let mut best = (0, 0);
        for (s, &b) in live.iter().enumerate() {
            if b > best.0 {
                best = (b, s);
            }
        }
        best
    }

    /// The member of `buf` live at `step` (the later one where two touch), if any.
    pub fn member_at(&self, buf: usize, step: usize) -> Option<ValueId> {
        self.buffers[buf]
            .members
            .iter()
            .rev()
            .find(|m| self.values[m.index()].def <= step && step <= self.values[m.index()].last)
            .copied()
    }
}
