//! Folds into a matmul what its only reader does to it: a widening cast ([`fold_casts`]) and an
//! add ([`fold_addends`]), whose addend, where it is a broadcast row, the matmul then reads
//! unbroadcast ([`fold_row_addends`]); an add into the `rms_norm_backward` whose `dx` it reads
//! ([`fold_norm_addends`]); and a `rope_at` into the `cache_write` or `attention_cached` that
//! reads it ([`fold_rope_at`]), and a layer's key and value cache writes into one node
//! ([`fold_cache_writes`]); a decode step's `rms_norm` or `swiglu_packed` into the
//! projections that read it ([`fold_prologues`]), and such projections of the same rows into one
//! node ([`fold_projections`]).
//!
//! [`fold_casts`] folds a widening cast into the matmul it reads: `cast(matmul(a, b)) to=f32`, where the
//! matmul's operands are bf16 or f16 and its result has no other use, becomes one matmul
//! writing f32 (`Op::Matmul`'s `out`; the pair every backend's matmul takes). The products
//! accumulate as before and are rounded once, to f32, instead of to the operands' dtype and then widened; the narrow
//! intermediate and the cast's launch are gone. In a bf16-mixed step these are the weight
//! gradients, which the optimizer reads in f32.

use crate::Result;
use crate::ir::{Addend, DType, Def, Op, Trace};

pub fn fold_casts(trace: &Trace) -> Result<Trace> {
    let defs = trace.defs();
    let users = trace.users();
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (c, node) in trace.nodes.iter().enumerate() {
        let Op::Cast { to } = node.op else { continue };
        let v = node.args[0];
        let Some(Def::Node { node: p, .. }) = defs[v.index()] else { continue };
        let m = &trace.nodes[p];
        let from = trace.ty(v).dtype;
        let folds = matches!(m.op, Op::Matmul { out: None, acc: Addend::None, .. })
            && m.phase == node.phase
            && users[v.index()].len() == 1
            && !trace.outputs.iter().any(|o| o.value == v)
            && matches!(from, DType::BF16 | DType::F16)
            && to == DType::F32;
        if !folds {
            continue;
        }
        // The matmul now defines the cast's value (same shape, type `to`); the cast goes.
        if let Op::Matmul { out, .. } = &mut t.nodes[p].op {
            *out = Some(to);
        }
        t.nodes[p].outs[0] = node.outs[0];
        drop[c] = true;
    }
    super::without(t, &drop)
}

/// Folds an add into the matmul it reads: `add(matmul(a, b), c)` (either order), where the
/// matmul's result has no other use and `c` has the sum's type (read unbroadcast), becomes one
/// matmul `a b + c` (`Op::Matmul`'s `acc`; cuBLAS's `beta = 1`), at the add's place in the order
/// (where `c` is defined). The sum is taken before the result is rounded; the matmul's
/// intermediate and the add's launch are gone. These are residual connections, a projection
/// added to the stream, and gradient sums, `dq Wq + dk Wk + dv Wv`. Where both operands are such
/// matmuls, the later one folds and reads the other.
pub fn fold_addends(trace: &Trace) -> Result<Trace> {
    let (defs, users) = (trace.defs(), trace.users());
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (c, node, [x, y]) in plain_adds(trace) {
        let foldable = |v: crate::ir::ValueId| -> Option<usize> {
            let Some(Def::Node { node: p, .. }) = defs[v.index()] else { return None };
            let m = &trace.nodes[p];
            let ok =
                matches!(m.op, Op::Matmul { acc: Addend::None, .. }) && !drop[p] && only_use(trace, &users, v, m, node);
            ok.then_some(p)
        };
        let pick = match (foldable(x), foldable(y)) {
            (Some(px), Some(py)) => Some(if px > py { (px, y) } else { (py, x) }),
            (Some(px), None) => Some((px, y)),
            (None, Some(py)) => Some((py, x)),
            (None, None) => None,
        };
        let Some((p, addend)) = pick else { continue };
        let m = &trace.nodes[p];
        let Op::Matmul { ta, tb, out, .. } = m.op else { unreachable!() };
        t.nodes[c] = crate::ir::Node {
            op: Op::Matmul { ta, tb, out, acc: Addend::Full },
            args: vec![m.args[0], m.args[1], addend],
            outs: node.outs.clone(),
            phase: node.phase,
        };
        drop[p] = true;
    }
    super::without(t, &drop)
}

/// Folds a broadcast row into the matmul that adds it: `matmul(a, b, broadcast(r))` with
/// `acc=true` (what [`fold_addends`] makes of `x w^T + broadcast(bias)`), where `r` is `[N]` (or
/// `[1, N]`, `N` the result's last dim) and the broadcast has no other use, becomes
/// `matmul(a, b, r)` with `acc=row` (`Addend::Row`): the same sum, without the broadcast's
/// launch and its `[M, N]` intermediate (a decode step of Qwen2 made one for each of its q, k
/// and v biases, every layer). Runs after differentiation, as every fold does: a matmul with
/// an addend has no VJP.
pub fn fold_row_addends(trace: &Trace) -> Result<Trace> {
    let (defs, users) = (trace.defs(), trace.users());
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (c, node) in trace.nodes.iter().enumerate() {
        let Op::Matmul { ta, tb, out, acc: Addend::Full } = node.op else { continue };
        let addend = node.args[2];
        let Some(Def::Node { node: p, .. }) = defs[addend.index()] else { continue };
        let bcast = &trace.nodes[p];
        if !matches!(bcast.op, Op::Broadcast { .. }) || !only_use(trace, &users, addend, bcast, node) {
            continue;
        }
        let row = bcast.args[0];
        if Addend::Row.check(trace.ty(row), trace.ty(node.outs[0])).is_err() {
            continue;
        }
        t.nodes[c].op = Op::Matmul { ta, tb, out, acc: Addend::Row };
        t.nodes[c].args[2] = row;
        drop[p] = true;
    }
    super::without(t, &drop)
}

/// Folds an add into the `rms_norm_backward` whose `dx` it reads: `add(dx, c)` (either order),
/// where `dx` has no other use and `c` has its type and is defined before the norm's backward,
/// becomes that node with `c` as its addend (`Op::RmsNormBackward`'s `acc`), at its place in the
/// order. These are the residual stream's gradient sums of a pre-norm block, `dh + norm'(dy)`:
/// the add's launch and its pass over both operands are gone (the kernel reads `c` beside `dy`).
/// Where both operands are such `dx`, the later norm folds, reading the earlier one's.
pub fn fold_norm_addends(trace: &Trace) -> Result<Trace> {
    let (defs, users) = (trace.defs(), trace.users());
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    // Where each value is defined in the order (inputs and constants before every node).
    let at = |v: crate::ir::ValueId| match defs[v.index()] {
        Some(Def::Node { node, .. }) => Some(node),
        _ => None,
    };
    for (c, node, [x, y]) in plain_adds(trace) {
        // The norm backward defining `v` as its dx, when it may take the other operand.
        let foldable = |v: crate::ir::ValueId, other: crate::ir::ValueId| -> Option<usize> {
            let Some(Def::Node { node: p, out: 0 }) = defs[v.index()] else { return None };
            let m = &trace.nodes[p];
            let ok = matches!(m.op, Op::RmsNormBackward { acc: false, .. })
                && !drop[p]
                && only_use(trace, &users, v, m, node)
                && at(other).is_none_or(|q| q < p);
            ok.then_some(p)
        };
        let Some((p, addend)) = foldable(x, y).map(|p| (p, y)).or_else(|| foldable(y, x).map(|p| (p, x))) else {
            continue;
        };
        let m = &trace.nodes[p];
        let Op::RmsNormBackward { eps, .. } = m.op else { unreachable!() };
        t.nodes[p] = crate::ir::Node {
            op: Op::RmsNormBackward { eps, acc: true },
            args: vec![m.args[0], m.args[1], m.args[2], addend],
            outs: vec![node.outs[0], m.outs[1]],
            phase: m.phase,
        };
        drop[c] = true;
    }
    super::without(t, &drop)
}

/// Folds a `rope_at` into the decoding node it feeds: `cache_write(c, rope_at(k, pos), pos)`
/// and `attention_cached(rope_at(q, pos), k, v, pos)`, where the rotated rows have no other use
/// and the layout is `bthd` (a step's rows), become the node reading `k` (`q`) with the rotation
/// as its `rope` (`Op::CacheWrite`, `Op::AttentionCached`): the same bits, one launch and one
/// intermediate fewer. These are a decode step's keys and queries.
pub fn fold_rope_at(trace: &Trace) -> Result<Trace> {
    let (defs, users) = (trace.defs(), trace.users());
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (c, node) in trace.nodes.iter().enumerate() {
        // The operand that may be a rotation, and the positions.
        let (slot, pos) = match node.op {
            Op::CacheWrite { rope: None } => (1, node.args[2]),
            Op::AttentionCached { rope: None, .. } => (0, node.args[3]),
            _ => continue,
        };
        let rows = node.args[slot];
        let Some(Def::Node { node: p, .. }) = defs[rows.index()] else { continue };
        let r = &trace.nodes[p];
        let Op::RopeAt { theta, layout: crate::ir::HeadLayout::Bthd, scaling } = r.op else { continue };
        if r.args[1] != pos || !only_use(trace, &users, rows, r, node) {
            continue;
        }
        let rope = Some(crate::ir::RopeNew { theta, scaling });
        t.nodes[c].op = match node.op {
            Op::AttentionCached { scale, .. } => Op::AttentionCached { scale, rope },
            _ => Op::CacheWrite { rope },
        };
        t.nodes[c].args[slot] = r.args[0];
        drop[p] = true;
    }
    super::without(t, &drop)
}

/// Joins a layer's two cache writes into one node: `cache_write(kc, k, pos)` (rotating or not)
/// and `cache_write(vc, v, pos)` (not rotating), with the same `pos`, caches of one type and new
/// rows of one type, in one phase, become `cache_write_kv(kc, vc, k, v, pos)` (`Op::CacheWriteKv`,
/// the rotating one as the keys): one launch writing both caches, each result still planned
/// over its own cache. Writes are paired in order, each with the first earlier unpaired one it
/// may join; never two rotating writes, two writes of one cache, or a write that reads the
/// other's result (its operands made from it). The joined node stands where the later write
/// stood; nodes that read the earlier one's result move after it, the order kept otherwise.
/// Traces with collectives are left as they are (their order is not only data).
pub fn fold_cache_writes(trace: &Trace) -> Result<Trace> {
    if trace.nodes.iter().any(|n| matches!(n.op, Op::Collective { .. })) {
        return Ok(trace.clone());
    }
    let key = |n: &crate::ir::Node| (n.args[2], trace.ty(n.args[0]), trace.ty(n.args[1]), n.phase);
    let (mut open, mut pairs): (Vec<usize>, Vec<[usize; 2]>) = (Vec::new(), Vec::new());
    for (i, n) in trace.nodes.iter().enumerate() {
        let Op::CacheWrite { rope } = n.op else { continue };
        let joins = |&j: &usize| {
            let m = &trace.nodes[j];
            let Op::CacheWrite { rope: other } = m.op else { return false };
            key(m) == key(n) && !(rope.is_some() && other.is_some()) && m.args[0] != n.args[0] && !reads(trace, j, i)
        };
        match open.iter().position(joins) {
            Some(p) => pairs.push([open.remove(p), i]),
            None => open.push(i),
        }
    }
    if pairs.is_empty() {
        return Ok(trace.clone());
    }
    let mut nodes: Vec<Option<crate::ir::Node>> = trace.nodes.iter().cloned().map(Some).collect();
    for [a, b] in pairs {
        let later_rotates = matches!(trace.nodes[b].op, Op::CacheWrite { rope: Some(_) });
        let (k, v) =
            if later_rotates { (&trace.nodes[b], &trace.nodes[a]) } else { (&trace.nodes[a], &trace.nodes[b]) };
        let Op::CacheWrite { rope } = k.op else { unreachable!() };
        let joined = crate::ir::Node {
            op: Op::CacheWriteKv { rope },
            args: vec![k.args[0], v.args[0], k.args[1], v.args[1], k.args[2]],
            outs: vec![k.outs[0], v.outs[0]],
            phase: k.phase,
        };
        nodes[a] = None;
        nodes[b] = Some(joined);
    }
    let mut t = trace.clone();
    t.nodes = stable_order(nodes.into_iter().flatten().collect());
    t.compact()?;
    Ok(t)
}

/// Whether node `later` reads, through any chain of nodes, a result of node `earlier`.
fn reads(trace: &Trace, earlier: usize, later: usize) -> bool {
    let mut made = vec![false; trace.num_values()];
    for &o in &trace.nodes[earlier].outs {
        made[o.index()] = true;
    }
    for n in &trace.nodes[earlier + 1..later] {
        if n.args.iter().any(|a| made[a.index()]) {
            for &o in &n.outs {
                made[o.index()] = true;
            }
        }
    }
    trace.nodes[later].args.iter().any(|a| made[a.index()])
}

/// The most rows a prologue folds for ([`fold_prologues`]): a decode step of a few sequences,
/// whose projections are matrix-vector products bound by reading the weights, so that the
/// prologue's own launch is a large share of each and recomputing it per projection is free.
pub const PROLOGUE_ROWS: usize = 4;

/// Folds a decode step's `rms_norm` or `swiglu_packed` of at most [`PROLOGUE_ROWS`] rows into
/// the projections that read it: where every reader of its result is a `matmul(h, w, tb=true)`
/// (with or without `acc`) taking it as `h`, in the same phase, and the result is no output,
/// each reader becomes `matmul_pre` (`Op::MatmulPre`) on the prologue's operands, and the
/// prologue goes. A norm read by the query, key and value projections is then made by each of
/// the three, inside its kernel: a launch and an intermediate fewer, the same values (the rows
/// are rounded to the dtype as the prologue's result was). Training steps keep theirs: the
/// backward reads the rows too.
pub fn fold_prologues(trace: &Trace) -> Result<Trace> {
    fold_prologues_of(trace, true, true)
}

/// [`fold_prologues`] of the norms only (`compile` weighs each kind of fold on its own).
pub fn fold_norm_prologues(trace: &Trace) -> Result<Trace> {
    fold_prologues_of(trace, true, false)
}

/// [`fold_prologues`] of the swiglus only.
pub fn fold_swiglu_prologues(trace: &Trace) -> Result<Trace> {
    fold_prologues_of(trace, false, true)
}

fn fold_prologues_of(trace: &Trace, norms: bool, swiglus: bool) -> Result<Trace> {
    let users = trace.users();
    let mut t = trace.clone();
    let mut drop = vec![false; trace.nodes.len()];
    for (p, node) in trace.nodes.iter().enumerate() {
        let pre = match node.op {
            Op::RmsNorm { eps } if norms => crate::ir::Prologue::RmsNorm { eps },
            Op::SwigluPacked if swiglus => crate::ir::Prologue::SwigluPacked,
            _ => continue,
        };
        let h = node.outs[0];
        let ty = trace.ty(h);
        let readers = &users[h.index()];
        let folds = ty.rank() == 2
            && ty.dims()[0] <= PROLOGUE_ROWS
            && !readers.is_empty()
            && !trace.outputs.iter().any(|o| o.value == h)
            && readers.iter().all(|&r| {
                let m = &trace.nodes[r];
                matches!(m.op, Op::Matmul { ta: false, tb: true, out: None, .. })
                    && m.phase == node.phase
                    && m.args[0] == h
                    && m.args[1..].iter().all(|&a| a != h)
            });
        if !folds {
            continue;
        }
        for &r in readers {
            let m = &trace.nodes[r];
            let Op::Matmul { acc, .. } = m.op else { unreachable!() };
            let mut args = node.args.clone();
            args.extend_from_slice(&m.args[1..]);
            t.nodes[r].op = Op::MatmulPre { pre, acc, outs: 1 };
            t.nodes[r].args = args;
        }
        drop[p] = true;
    }
    super::without(t, &drop)
}

/// The most projections [`fold_projections`] joins into one node (a layer's q, k and v).
pub const PROJECTIONS: usize = 4;

/// Joins `matmul_pre` nodes that make the same rows (the same prologue of the same operands,
/// alike in `acc`: no addends, addends of their types, or rows; in one phase) into one node of
/// several results, at most [`PROJECTIONS`]: a
/// layer's query, key and value projections become one node, whose kernel makes the rows once
/// for all three and reads the three weights in one launch. The joined node stands where the
/// last of them stood; nodes that read an earlier one's result move after it, the order kept
/// otherwise. Traces with collectives are left as they are (their order is not only data).
pub fn fold_projections(trace: &Trace) -> Result<Trace> {
    if trace.nodes.iter().any(|n| matches!(n.op, Op::Collective { .. })) {
        return Ok(trace.clone());
    }
    type Key = (crate::ir::Prologue, Addend, crate::ir::Phase, Vec<crate::ir::ValueId>);
    let mut groups: Vec<(Key, Vec<usize>)> = Vec::new();
    for (i, n) in trace.nodes.iter().enumerate() {
        let Op::MatmulPre { pre, acc, outs: 1 } = n.op else { continue };
        let key = (pre, acc, n.phase, n.args[..pre.operands()].to_vec());
        match groups.iter_mut().find(|(k, g)| *k == key && g.len() < PROJECTIONS) {
            Some((_, g)) => g.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    let mut nodes: Vec<Option<crate::ir::Node>> = trace.nodes.iter().cloned().map(Some).collect();
    let mut joined = false;
    for ((pre, acc, phase, rows), members) in groups.into_iter().filter(|(_, g)| g.len() > 1) {
        let m: Vec<&crate::ir::Node> = members.iter().map(|&i| &trace.nodes[i]).collect();
        let mut args = rows.clone();
        args.extend(m.iter().map(|n| n.args[rows.len()]));
        if acc.is_some() {
            args.extend(m.iter().map(|n| n.args[rows.len() + 1]));
        }
        let outs = m.iter().map(|n| n.outs[0]).collect();
        let op = Op::MatmulPre { pre, acc, outs: members.len() };
        for &i in &members {
            nodes[i] = None;
        }
        nodes[*members.last().unwrap()] = Some(crate::ir::Node { op, args, outs, phase });
        joined = true;
    }
    if !joined {
        return Ok(trace.clone());
    }
    let mut t = trace.clone();
    t.nodes = stable_order(nodes.into_iter().flatten().collect());
    t.compact()?;
    Ok(t)
}

/// `nodes` in a topological order of their data, each as early in the given order as its
/// operands allow (Kahn's algorithm taking the lowest index ready).
fn stable_order(nodes: Vec<crate::ir::Node>) -> Vec<crate::ir::Node> {
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, HashMap};
    let def: HashMap<crate::ir::ValueId, usize> =
        nodes.iter().enumerate().flat_map(|(i, n)| n.outs.iter().map(move |&v| (v, i))).collect();
    let mut succs = vec![Vec::new(); nodes.len()];
    let mut waiting = vec![0usize; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        let mut preds: Vec<usize> = n.args.iter().filter_map(|a| def.get(a).copied()).collect();
        preds.sort_unstable();
        preds.dedup();
        waiting[i] = preds.len();
        for p in preds {
            succs[p].push(i);
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..nodes.len()).filter(|&i| waiting[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &s in &succs[i] {
            waiting[s] -= 1;
            if waiting[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    let mut nodes: Vec<Option<crate::ir::Node>> = nodes.into_iter().map(Some).collect();
    order.into_iter().filter_map(|i| nodes[i].take()).collect()
}

/// Whether `v` (a result of `producer`) is read by `reader` alone, in the same phase, and is no
/// output of the trace: what a fold into its producer needs.
fn only_use(
    trace: &Trace,
    users: &[Vec<usize>],
    v: crate::ir::ValueId,
    producer: &crate::ir::Node,
    reader: &crate::ir::Node,
) -> bool {
    producer.phase == reader.phase && users[v.index()].len() == 1 && !trace.outputs.iter().any(|o| o.value == v)
}

/// The adds a fold may take: `(index, node, [x, y])` where `x` and `y` are two values of the
/// sum's type (read unbroadcast).
fn plain_adds(trace: &Trace) -> impl Iterator<Item = (usize, &crate::ir::Node, [crate::ir::ValueId; 2])> {
    trace.nodes.iter().enumerate().filter_map(move |(c, node)| {
        let sum = trace.ty(node.outs[0]);
        let [x, y] = [*node.args.first()?, *node.args.get(1)?];
        let plain = matches!(node.op, Op::Binary(crate::ir::BinaryOp::Add))
            && x != y
            && trace.ty(x) == sum
            && trace.ty(y) == sum;
        plain.then_some((c, node, [x, y]))
    })
}
