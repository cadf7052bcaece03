//! The memory-aware scheduler: a topological reorder of a trace's nodes that lowers LOAD.
//!
//! Several list schedules are built and measured with the planner's own lifetimes; the one with
//! the lowest LOAD wins, and the input order is kept unless one beats it. Each list schedule
//! walks the dependence graph, at every step choosing among the ready nodes:
//! - **optimizer first** (optional): an optimizer node that waits on the backward runs as soon
//!   as it can, so a gradient is consumed, and its parameter updated in place, right after the
//!   backward computes it;
//! - **frees first**: a node whose results take no more bytes than the operands it is the last
//!   reader of runs at once (this frees saved tensors as early as the backward allows, and puts
//!   a weight-gradient matmul where it frees its saved input);
//! - otherwise either the earliest node of the input order, or the node that adds the fewest
//!   bytes (ties: input order).
//!
//! Nodes that depend on no other node (constants, and ops on inputs alone such as an
//! embedding lookup or `beta * moment`) are never scheduled on their own: each is emitted just
//! before its first reader. A parameter updated in place needs every other reader of it to run
//! before the chain that overwrites it: such anti-dependences are added as edges, so the
//! in-place update stays legal in every order tried. Collectives keep their order (each waits
//! on the one before): every rank must meet them in the same order, and ranks whose traces
//! differ (ZeRO-1's shards) would otherwise be scheduled apart.
//!
//! A collective of several ranks runs beside the nodes after it, up to its *join* (the first
//! node reading its result; `ir::collective_joins`), so a device overlaps it with the rest of
//! the backward. Each strategy is then also tried deferring joins, as DDP pipelines its buckets:
//! a node reading collective `k`'s result waits until collective `k + 1` has been issued (the
//! backward that makes the next bucket overlaps collective `k`), the last one's until nothing
//! else is ready. Among the orders of the lowest LOAD the one that leaves the most nodes
//! between the collectives and their joins is kept: overlap is taken where it costs no memory.

use std::time::Instant;

use crate::Result;
use crate::ir::{Def, OutputRole, Phase, Trace, ValueId};
use crate::plan::lifetimes::{LifetimeOptions, is_pointwise, lifetimes, view_offset};
use crate::plan::report::PassReport;
use crate::plan::{ALIGN, align_up};

/// Reorders `trace` to lower LOAD; returns the new trace (compactly numbered) and what changed.
pub fn schedule(trace: &Trace, opts: LifetimeOptions) -> Result<(Trace, PassReport)> {
    let t0 = Instant::now();
    let before = lifetimes(trace, opts).load().0;
    let g = DepGraph::new(trace);
    let async_collectives = g.join_of.iter().any(Option::is_some);
    // (LOAD, nodes overlapping collectives, name, order): the lowest LOAD, then the most overlap.
    let mut best: (usize, usize, String, Option<Trace>) = (before, overlap(trace), "input order".into(), None);
    let strategies = [
        ("optimizer first, frees first, input order", true, false),
        ("optimizer first, fewest bytes", true, true),
        ("frees first, input order", false, false),
        ("fewest bytes", false, true),
    ];
    for defer_joins in [false, true] {
        if defer_joins && !async_collectives {
            break;
        }
        for (name, optimizer_first, min_net) in strategies {
            let order = g.list_schedule(Strategy { optimizer_first, min_net, defer_joins });
            let t = reorder(trace, &order)?;
            let load = lifetimes(&t, opts).load().0;
            let over = if async_collectives { overlap(&t) } else { 0 };
            if load < best.0 || (load == best.0 && over > best.1) {
                let name = if defer_joins { format!("{name}, joins deferred") } else { name.to_string() };
                best = (load, over, name, Some(t));
            }
        }
    }
    let (after, _, name, t) = best;
    let report = PassReport {
        pass: "schedule".into(),
        load_before: before,
        load_after: after,
        extra_flops: 0,
        detail: format!("kept {name}"),
        millis: t0.elapsed().as_secs_f64() * 1e3,
    };
    Ok((t.unwrap_or_else(|| trace.clone()), report))
}

/// [`schedule`] with default options, as a plain pass for `passes::run`.
pub fn schedule_pass(trace: &Trace) -> Result<Trace> {
    Ok(schedule(trace, LifetimeOptions::default())?.0)
}

/// `trace` with its nodes in `order` (a permutation of node indices), renumbered.
pub fn reorder(trace: &Trace, order: &[usize]) -> Result<Trace> {
    let mut t = trace.clone();
    t.nodes = order.iter().map(|&i| trace.nodes[i].clone()).collect();
    t.compact()?;
    Ok(t)
}

#[derive(Clone, Copy)]
struct Strategy {
    optimizer_first: bool,
    min_net: bool,
    /// Run a node that reads collective `k`'s result only once collective `k + 1` has been
    /// issued, or when no other node is ready.
    defer_joins: bool,
}

/// Nodes between each collective of several ranks and its join, summed: the work a device can
/// overlap the collectives with.
fn overlap(trace: &Trace) -> usize {
    crate::ir::collective_joins(trace).iter().map(|&(c, j)| j - c - 1).sum()
}

/// The dependence graph of a trace's nodes, with what each node allocates and reads.
struct DepGraph {
    preds: Vec<Vec<usize>>,
    succs: Vec<Vec<usize>>,
    /// Aligned bytes of each node's results that own arena bytes (not views, not updates
    /// computed in their parameter's slot).
    alloc: Vec<usize>,
    /// Storage roots each node reads (deduplicated).
    reads: Vec<Vec<usize>>,
    /// Readers of each root (nodes, deduplicated per node), and whether it can be freed.
    readers: Vec<usize>,
    freeable: Vec<bool>,
    root_bytes: Vec<usize>,
    /// Nodes with no predecessor, emitted just before their first reader.
    glued: Vec<bool>,
    /// Optimizer nodes that (transitively) wait on a backward node.
    eager: Vec<bool>,
    /// For a node reading the result of a collective of several ranks, the position (in trace
    /// order) of the first such collective it reads.
    join_of: Vec<Option<usize>>,
    /// Collectives of several ranks.
    is_collective: Vec<bool>,
}

impl DepGraph {
    fn new(trace: &Trace) -> Self {
        let n = trace.nodes.len();
        let nv = trace.num_values();
        let defs = trace.defs();
        let node_of = |v: ValueId| match defs[v.index()] {
            Some(Def::Node { node, .. }) => Some(node),
            _ => None,
        };
        // Storage roots through views.
        let mut root: Vec<usize> = (0..nv).collect();
        let mut is_view = vec![false; nv];
        for node in &trace.nodes {
            if node.args.len() == 1 && node.outs.len() == 1 {
                let (a, o) = (node.args[0], node.outs[0]);
                if view_offset(&node.op, trace.ty(a), trace.ty(o)).is_some() {
                    root[o.index()] = root[a.index()];
                    is_view[o.index()] = true;
                }
            }
        }
        let bytes = |v: usize| align_up(trace.types[v].size_in_bytes().max(1), ALIGN);
        let mut freeable = vec![true; nv];
        for inp in trace.inputs.iter().filter(|i| i.role.is_persistent()) {
            freeable[inp.value.index()] = false;
        }
        for out in &trace.outputs {
            freeable[root[out.value.index()]] = false;
        }
        let chains = inplace_chains(trace, &root, &node_of);
        let mut in_persistent = vec![false; nv];
        let (mut preds, mut succs) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        let edge = |a: usize, b: usize, preds: &mut Vec<Vec<usize>>, succs: &mut Vec<Vec<usize>>| {
            if a != b && !preds[b].contains(&a) {
                preds[b].push(a);
                succs[a].push(b);
            }
        };
        for (i, node) in trace.nodes.iter().enumerate() {
            for a in &node.args {
                if let Some(p) = node_of(*a) {
                    edge(p, i, &mut preds, &mut succs);
                }
            }
        }
        // Collectives in trace order: every rank runs the same sequence.
        let collectives: Vec<usize> =
            (0..n).filter(|&i| matches!(trace.nodes[i].op, crate::ir::Op::Collective { .. })).collect();
        for w in collectives.windows(2) {
            edge(w[0], w[1], &mut preds, &mut succs);
        }
        // Anti-dependences: every other reader of a parameter updated in place runs before the
        // chain's first node, unless it depends on that node.
        let mut reads: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut readers = vec![0; nv];
        for (i, node) in trace.nodes.iter().enumerate() {
            for a in &node.args {
                let r = root[a.index()];
                if !reads[i].contains(&r) {
                    reads[i].push(r);
                    readers[r] += 1;
                }
            }
        }
        for (p, first, members) in chains {
            for m in members {
                in_persistent[m] = true;
            }
            let after = descendants(&succs, first);
            let others: Vec<usize> = (0..n).filter(|&i| i != first && reads[i].contains(&p) && !after[i]).collect();
            for o in others {
                edge(o, first, &mut preds, &mut succs);
            }
        }
        let alloc = trace
            .nodes
            .iter()
            .map(|node| {
                node.outs
                    .iter()
                    .filter(|o| !is_view[o.index()] && !in_persistent[o.index()])
                    .map(|o| bytes(o.index()))
                    .sum()
            })
            .collect();
        // Each collective of several ranks by its position in trace order, and its result.
        let mut is_collective = vec![false; n];
        let mut result_of: Vec<Option<usize>> = vec![None; nv];
        let mut k = 0;
        for (i, node) in trace.nodes.iter().enumerate() {
            if matches!(node.op, crate::ir::Op::Collective { world, .. } if world > 1) {
                is_collective[i] = true;
                result_of[node.outs[0].index()] = Some(k);
                k += 1;
            }
        }
        let join_of: Vec<Option<usize>> =
            trace.nodes.iter().map(|nd| nd.args.iter().filter_map(|a| result_of[a.index()]).min()).collect();
        DepGraph {
            join_of,
            is_collective,
            glued: preds.iter().map(|p| p.is_empty()).collect(),
            eager: after_backward(trace, &preds),
            preds,
            succs,
            alloc,
            reads,
            readers,
            freeable,
            root_bytes: (0..nv).map(bytes).collect(),
        }
    }

    /// Bytes node `i` adds if run now (`left` = readers of each root not yet run).
    fn net(&self, i: usize, left: &[usize]) -> i64 {
        let freed: usize =
            self.reads[i].iter().filter(|&&r| self.freeable[r] && left[r] == 1).map(|&r| self.root_bytes[r]).sum();
        self.alloc[i] as i64 - freed as i64
    }

    fn list_schedule(&self, s: Strategy) -> Vec<usize> {
        let n = self.preds.len();
        // Glued nodes are emitted with their first reader, so they do not count as predecessors.
        let mut waiting: Vec<usize> =
            (0..n).map(|i| self.preds[i].iter().filter(|&&p| !self.glued[p]).count()).collect();
        let mut ready: Vec<usize> = (0..n).filter(|&i| !self.glued[i] && waiting[i] == 0).collect();
        let mut done = vec![false; n];
        let mut left = self.readers.clone();
        let mut order = Vec::with_capacity(n);
        // Collectives issued so far (they run in trace order).
        let mut issued = 0;
        let emit = |i: usize, order: &mut Vec<usize>, left: &mut Vec<usize>, done: &mut Vec<bool>| {
            done[i] = true;
            order.push(i);
            for &r in &self.reads[i] {
                left[r] -= 1;
            }
        };
        while !ready.is_empty() {
            let pick = self.pick(&ready, &left, s, issued);
            let i = ready.swap_remove(pick);
            for &p in &self.preds[i] {
                if self.glued[p] && !done[p] {
                    emit(p, &mut order, &mut left, &mut done);
                }
            }
            emit(i, &mut order, &mut left, &mut done);
            if self.is_collective[i] {
                issued += 1;
            }
            for &su in &self.succs[i] {
                waiting[su] -= 1;
                if waiting[su] == 0 && !self.glued[su] {
                    ready.push(su);
                }
            }
        }
        // Glued nodes nothing reads.
        order.extend((0..n).filter(|&i| !done[i]));
        order
    }

    /// Index into `ready` of the node to run next.
    fn pick(&self, ready: &[usize], left: &[usize], s: Strategy, issued: usize) -> usize {
        // Deferring joins: collective k's once collective k + 1 is issued; any when nothing
        // else is ready.
        let waits = |i: usize| self.join_of[i].is_some_and(|k| k + 1 >= issued);
        let only_waiting = ready.iter().all(|&i| waits(i));
        let allowed = |i: usize| !s.defer_joins || only_waiting || !waits(i);
        let by = |f: &dyn Fn(usize) -> Option<(i64, usize)>| {
            ready
                .iter()
                .enumerate()
                .filter(|&(_, &i)| allowed(i))
                .filter_map(|(k, &i)| f(i).map(|key| (key, k)))
                .min()
                .map(|(_, k)| k)
        };
        if s.optimizer_first
            && let Some(k) = by(&|i| self.eager[i].then_some((0, i)))
        {
            return k;
        }
        if let Some(k) = by(&|i| {
            let net = self.net(i, left);
            (net <= 0).then_some((net, i))
        }) {
            return k;
        }
        if s.min_net { by(&|i| Some((self.net(i, left), i))) } else { by(&|i| Some((0, i))) }.unwrap_or(0)
    }
}

/// Optimizer nodes with a backward node among their (transitive) predecessors.
fn after_backward(trace: &Trace, preds: &[Vec<usize>]) -> Vec<bool> {
    // Predecessors may come later in the node list (anti-dependences), so iterate to a fixpoint
    // over a topological order.
    let order = topo(preds);
    let mut waits = vec![false; preds.len()];
    for &i in &order {
        waits[i] = preds[i].iter().any(|&p| trace.nodes[p].phase == Phase::Backward || waits[p]);
    }
    (0..preds.len()).map(|i| waits[i] && trace.nodes[i].phase == Phase::Optimizer).collect()
}

/// A topological order of the graph given by `preds` (Kahn's algorithm).
fn topo(preds: &[Vec<usize>]) -> Vec<usize> {
    let n = preds.len();
    let mut succs = vec![Vec::new(); n];
    let mut waiting: Vec<usize> = preds.iter().map(|p| p.len()).collect();
    for (i, ps) in preds.iter().enumerate() {
        for &p in ps {
            succs[p].push(i);
        }
    }
    let mut stack: Vec<usize> = (0..n).filter(|&i| waiting[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = stack.pop() {
        order.push(i);
        for &s in &succs[i] {
            waiting[s] -= 1;
            if waiting[s] == 0 {
                stack.push(s);
            }
        }
    }
    order
}

/// Nodes reachable from `from` (itself included).
fn descendants(succs: &[Vec<usize>], from: usize) -> Vec<bool> {
    let mut seen = vec![false; succs.len()];
    let mut stack = vec![from];
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut seen[i], true) {
            stack.extend(&succs[i]);
        }
    }
    seen
}

/// For each persistent input updated by a pointwise chain (each link reading the one before
/// with the same shape, each intermediate read only by the next link): `(input root, first node
/// of the chain, values of the chain)`.
fn inplace_chains(
    trace: &Trace,
    root: &[usize],
    node_of: &dyn Fn(ValueId) -> Option<usize>,
) -> Vec<(usize, usize, Vec<usize>)> {
    let mut uses = vec![0usize; trace.num_values()];
    for node in &trace.nodes {
        for a in &node.args {
            uses[root[a.index()]] += 1;
        }
    }
    for out in &trace.outputs {
        uses[root[out.value.index()]] += 2; // an output is never an intermediate
    }
    let mut out = Vec::new();
    for inp in trace.inputs.iter().filter(|i| i.role.is_persistent()) {
        let p = inp.value.index();
        let Some(u) = trace.outputs.iter().find(|o| o.role == OutputRole::Update { of: inp.value }) else {
            continue;
        };
        let mut cur = u.value;
        let mut members = Vec::new();
        for _ in 0..16 {
            let Some(k) = node_of(cur) else { break };
            let node = &trace.nodes[k];
            if !is_pointwise(&node.op) || root[cur.index()] != cur.index() {
                break;
            }
            members.push(cur.index());
            let ty = trace.ty(cur);
            let same = |a: &ValueId| {
                let t = trace.ty(*a);
                t.shape == ty.shape && t.dtype.size_in_bytes() == ty.dtype.size_in_bytes()
            };
            if node.args.iter().any(|a| root[a.index()] == p && same(a)) {
                out.push((p, k, members));
                break;
            }
            let next = node.args.iter().find(|a| {
                let r = root[a.index()];
                same(a) && r == a.index() && uses[r] == 1 && node_of(**a).is_some()
            });
            match next {
                Some(a) => cur = *a,
                None => break,
            }
        }
    }
    out
}
