//! Rematerialisation: recompute cheap forward values in the backward instead of saving them.
//!
//! A candidate is a saved-for-backward value made by a cheap op (elementwise, cast, copies,
//! gather, reductions, norms, RoPE, softmax, SwiGLU: never a matmul or attention). Recomputing
//! it clones its node into the backward, just before its first backward reader, and points
//! every backward reader (through views, which are cloned too) at the clone. The forward value
//! then dies at its last forward read; the clone's operands must live until the clone runs,
//! which may cost bytes of its own.
//!
//! Choosing is done on a model of the live-bytes curve (a segment tree with range add and
//! global max, and how many steps reach it): removing a value's gap between forward and
//! backward subtracts its bytes there; keeping an operand alive longer adds its bytes. Both
//! modes take one candidate at a time while one lowers (LOAD, steps at LOAD), the count letting
//! a run of takes wear down a plateau no single one can lower, and keep the takes up to the
//! last that lowered LOAD. [`Remat::Auto`] takes the candidate removing most LOAD;
//! [`Remat::Budget`] the one removing most per extra FLOP, and stops once the step fits. Given
//! a cost model ([`remat_costed`]), a budget also weighs matmuls (a `[4096, 37888]` product of
//! a 28-wide input costs microseconds to recompute and saves 296 MiB), each candidate priced
//! by its predicted seconds: most bytes removed per second first. Rewrites go latest value first, so a
//! recomputed value may itself read recomputed operands. The exact LOAD of the result is
//! measured, and the input is returned unchanged if it is not lower.

use std::collections::HashMap;
use std::time::Instant;

use crate::cost::CostModel;
use crate::ir::{Def, Node, Op, Phase, TensorType, Trace, ValueId};
use crate::plan::lifetimes::{Class, LifetimeOptions, Storage, lifetimes};
use crate::plan::report::{PassReport, fmt_bytes};
use crate::plan::{ALIGN, Region, align_up};
use crate::{Error, Result};

/// What the rematerialisation pass aims at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Remat {
    /// Recompute nothing.
    #[default]
    Off,
    /// Recompute every cheap value whose recomputation lowers LOAD.
    Auto,
    /// Recompute as little as needed for persistent + arena + workspace to fit `peak_bytes`.
    Budget { peak_bytes: usize },
}

/// True for ops cheap enough to run twice: everything but matmul, attention and the losses
/// (whose results are small anyway: a scalar, and the fused loss's `[N]` log-sum-exp).
pub fn is_cheap(op: &Op) -> bool {
    !matches!(
        op,
        Op::Matmul { .. }
            | Op::MatmulPre { .. }
            | Op::Attention { .. }
            | Op::AttentionBackward { .. }
            | Op::CrossEntropy { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::LinearCrossEntropyGrad { .. }
    )
}

/// Floating-point operations of one node, roughly (copies count zero).
pub fn flops(op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> u64 {
    let out = outs.first().map_or(0, |t| t.numel()) as u64;
    let inp = args.first().map_or(0, |t| t.numel()) as u64;
    match op {
        Op::Full { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Gather
        | Op::Cast { .. } => 0,
        Op::Unary(_) | Op::PowScalar { .. } | Op::AddScalar { .. } | Op::MulScalar { .. } => out,
        Op::Binary(_) | Op::Compare(_) | Op::Where => out,
        Op::Reduce { .. } | Op::ScatterAdd { .. } => inp,
        Op::RmsNorm { .. } => 4 * out,
        Op::RmsNormBackward { .. } => 8 * inp,
        Op::Rope { .. } | Op::RopeAt { .. } => 3 * out,
        Op::CacheWrite { .. } | Op::CacheWriteKv { .. } => 0,
        // Sums of `world` buffers (the exchange is the collective's cost, not FLOPs).
        Op::Collective { world, .. } => *world as u64 * inp,
        Op::Sample { .. } => 8 * inp,
        Op::AttentionCached { .. } => {
            // q [B, T, Hq, D] over at most S keys.
            let (q, k) = (args[0].dims(), args[1].dims());
            4 * (q[0] * q[1] * q[2] * k[1] * q[3]) as u64
        }
        Op::Softmax | Op::LogSoftmax => 5 * out,
        Op::SoftmaxBackward | Op::LogSoftmaxBackward => 4 * out,
        Op::Swiglu => 5 * out,
        Op::SwigluBackward => 10 * inp,
        Op::SwigluPacked => 5 * out,
        Op::SwigluPackedBackward => 5 * inp,
        Op::CrossEntropy { .. } | Op::CrossEntropyBackward { .. } => 6 * inp,
        Op::LinearCrossEntropy { .. } | Op::LinearCrossEntropyBackward { .. } | Op::LinearCrossEntropyGrad { .. } => {
            // x [N, C], w [V, C]: the logits' matmul, and in the backward their recomputation
            // and the two gradient matmuls (the fused gradient: the logits once, then those two).
            let (x, w) = (args[0].dims(), args[1].dims());
            let f = 2 * (x[0] * x[1] * w[0]) as u64;
            if matches!(op, Op::LinearCrossEntropy { .. }) { f } else { 3 * f }
        }
        Op::Fused(body) => (body.body.len() * body.shape.numel()) as u64,
        Op::Matmul { ta, .. } => {
            let a = args[0].dims();
            let k = if *ta { a[a.len() - 2] } else { a[a.len() - 1] };
            2 * out * k as u64
        }
        // The products over w [N, K], and the prologue's rows.
        Op::MatmulPre { pre, .. } => {
            let all: usize = outs.iter().map(|t| t.numel()).sum();
            2 * all as u64 * args[pre.operands()].dims()[1] as u64 + 5 * inp
        }
        Op::Attention { causal, layout, .. } | Op::AttentionBackward { causal, layout, .. } => {
            let ([b, hq, t, d], [_, _, s, _]) = (layout.bhtd(args[0].dims()), layout.bhtd(args[1].dims()));
            let f = 4 * (b * hq * t * s * d) as u64;
            let f = if *causal { f / 2 } else { f };
            if matches!(op, Op::AttentionBackward { .. }) { 5 * f / 2 } else { f }
        }
    }
}

/// Total FLOPs of a trace, roughly.
pub fn trace_flops(trace: &Trace) -> u64 {
    trace.nodes.iter().map(|n| flops(&n.op, &trace.arg_types(n), &trace.out_types(n))).sum()
}

/// Rematerialises cheap saved values of `trace` as `mode` asks (`workspace_bytes` counts
/// toward a budget). Returns the new trace and what it did.
pub fn remat(trace: &Trace, mode: Remat, workspace_bytes: usize, opts: LifetimeOptions) -> Result<(Trace, PassReport)> {
    remat_costed(trace, mode, workspace_bytes, opts, None)
}

/// True for ops a budget may recompute when a cost model prices them: every op with one
/// result but the losses (a scalar, and the fused loss's `[N]` log-sum-exp: nothing to save).
fn is_recomputable(op: &Op) -> bool {
    // A collective recomputed on one rank would wait for ranks that do not run it again.
    !matches!(
        op,
        Op::Collective { .. }
            | Op::CrossEntropy { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::LinearCrossEntropyGrad { .. }
    )
}

/// How many evenly spaced prefixes of a round's takes [`remat_costed`] plans where the whole
/// sequence misses its target.
const PREFIXES: usize = 16;

/// [`remat`], with `cost` pricing each candidate in a budget (and letting the budget recompute
/// matmuls); `None` prices by FLOPs and keeps to cheap ops.
pub fn remat_costed(
    trace: &Trace,
    mode: Remat,
    workspace_bytes: usize,
    opts: LifetimeOptions,
    cost: Option<&dyn CostModel>,
) -> Result<(Trace, PassReport)> {
    let t0 = Instant::now();
    let cost = if matches!(mode, Remat::Budget { .. }) { cost } else { None };
    let lt = lifetimes(trace, opts);
    let before = lt.load().0;
    let mut report = PassReport { pass: "remat".into(), load_before: before, load_after: before, ..Default::default() };
    if mode == Remat::Off {
        report.detail = "off".into();
        return Ok((trace.clone(), report));
    }
    let persistent: usize = lt.buffers.iter().filter(|b| b.region == Region::Persistent).map(|b| b.aligned()).sum();
    let fixed = persistent + align_up(workspace_bytes, ALIGN);
    // Auto: the most LOAD removed first; budget: the most per FLOP (copies count one FLOP per
    // 64 bytes moved). The model is an estimate, so a budget that the measured result misses
    // is tried again with a goal lowered by the miss.
    let (target, price): (usize, &dyn Fn(&Cand) -> f64) = match (mode, cost) {
        (Remat::Budget { peak_bytes }, Some(_)) => (peak_bytes.saturating_sub(fixed), &|c: &Cand| c.seconds + 1e-9),
        (Remat::Budget { peak_bytes }, None) => {
            (peak_bytes.saturating_sub(fixed), &|c: &Cand| c.flops as f64 + c.bytes as f64 / 64.0 + 1.0)
        }
        _ => (0, &|_: &Cand| 1.0),
    };
    let mut goal = target;
    let mut best: Option<Outcome> = None;
    let mut candidates = 0;
    for _round in 0..4 {
        let mut model = Model::new(trace, &lt, cost);
        candidates = model.cands.len();
        let chosen = model.choose(goal, price);
        let mut round = apply(trace, &model, &chosen, opts)?;
        // The model's LOAD falls with every take, the measured one need not: where the whole
        // sequence misses the target, a shorter prefix of it (the takes a higher goal would
        // make) may measure lower. Try a few: the shortest that meets the target (the fewest
        // recomputations), else the lowest.
        if round.load > target && mode != Remat::Auto && chosen.len() > 1 {
            for i in 1..PREFIXES {
                let k = chosen.len() * i / PREFIXES;
                if k == 0 {
                    continue;
                }
                let r = apply(trace, &model, &chosen[..k], opts)?;
                if r.load <= target {
                    round = r;
                    break;
                }
                if r.load < round.load {
                    round = r;
                }
            }
        }
        let after = round.load;
        let better = best.as_ref().is_none_or(|b| after < b.load);
        let done = after <= target || chosen.len() == candidates || mode == Remat::Auto;
        if better {
            best = Some(round);
        }
        if done || !better {
            break;
        }
        goal = goal.saturating_sub(after - target);
    }
    let Some(Outcome { trace: out, load: after, extra, seconds, counts, chosen: n_chosen }) = best else {
        return Err(Error::Plan("remat: no round ran".into()));
    };
    let kinds: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    let fits = match mode {
        Remat::Budget { peak_bytes } => format!(
            "; peak about {} (before rescheduling) for a budget of {}",
            fmt_bytes(fixed + after.min(before)),
            fmt_bytes(peak_bytes)
        ),
        _ => String::new(),
    };
    report.millis = t0.elapsed().as_secs_f64() * 1e3;
    if n_chosen == 0 || after >= before {
        report.detail = format!("recomputed nothing ({candidates} candidates){fits}");
        return Ok((trace.clone(), report));
    }
    let total = trace_flops(trace).max(1);
    report.load_after = after;
    report.extra_flops = extra;
    let predicted = if cost.is_some() { format!(", +{:.3} ms predicted", seconds * 1e3) } else { String::new() };
    report.detail = format!(
        "recomputed {} values ({}), +{:.2}% of the step's {:.3e} FLOPs{predicted}{fits}",
        n_chosen,
        kinds.join(", "),
        100.0 * extra as f64 / total as f64,
        total as f64
    );
    Ok((out, report))
}

/// A trace with some values recomputed, and what it cost.
struct Outcome {
    trace: Trace,
    /// Its exact LOAD.
    load: usize,
    extra: u64,
    /// Predicted seconds of the recomputations (0 without a cost model).
    seconds: f64,
    /// Values recomputed per op.
    counts: Vec<(&'static str, usize)>,
    chosen: usize,
}

/// `trace` with the candidates `chosen` recomputed.
fn apply(trace: &Trace, model: &Model, chosen: &[usize], opts: LifetimeOptions) -> Result<Outcome> {
    let mut out = trace.clone();
    let mut order = chosen.to_vec();
    order.sort_by_key(|&c| std::cmp::Reverse(model.cands[c].def));
    let mut extra = 0;
    let mut seconds = 0.0;
    let mut counts: HashMap<&'static str, usize> = HashMap::new();
    for &c in &order {
        extra += rematerialise(&mut out, model.cands[c].value)?;
        seconds += model.cands[c].seconds;
        *counts.entry(model.cands[c].op).or_default() += 1;
    }
    out.compact()?;
    let mut counts: Vec<(&'static str, usize)> = counts.into_iter().collect();
    counts.sort();
    let load = lifetimes(&out, opts).load().0;
    Ok(Outcome { trace: out, load, extra, seconds, counts, chosen: chosen.len() })
}

/// [`remat`] in [`Remat::Auto`] mode with default options, as a plain pass for `passes::run`.
pub fn remat_pass(trace: &Trace) -> Result<Trace> {
    Ok(remat(trace, Remat::Auto, 0, LifetimeOptions::default())?.0)
}

/// Clones the node defining `v` into the backward before its first non-forward reader and
/// points those readers (through cloned views) at the clone. Returns the clone's FLOPs.
fn rematerialise(t: &mut Trace, v: ValueId) -> Result<u64> {
    let defs = t.defs();
    let Some(Def::Node { node: k, .. }) = defs[v.index()] else {
        return Err(Error::Plan(format!("remat: {v} is not defined by a node")));
    };
    // Views of v (transitively), in definition order: value -> (source, node).
    let mut in_group = vec![false; t.num_values()];
    in_group[v.index()] = true;
    let mut views = Vec::new();
    for (i, n) in t.nodes.iter().enumerate() {
        if n.args.len() == 1 && n.outs.len() == 1 && in_group[n.args[0].index()] {
            let (a, o) = (n.args[0], n.outs[0]);
            if crate::plan::view_offset(&n.op, t.ty(a), t.ty(o)).is_some() {
                in_group[o.index()] = true;
                views.push((o, i));
            }
        }
    }
    let first = t
        .nodes
        .iter()
        .position(|n| n.phase != Phase::Forward && n.args.iter().any(|a| in_group[a.index()]))
        .ok_or_else(|| Error::Plan(format!("remat: {v} has no backward reader")))?;
    let node = t.nodes[k].clone();
    let mut new_nodes = Vec::new();
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let v2 = t.new_value(t.ty(v).clone());
    map.insert(v, v2);
    new_nodes.push(Node { op: node.op.clone(), args: node.args.clone(), outs: vec![v2], phase: Phase::Backward });
    let extra = { flops(&node.op, &t.arg_types(&node), &[t.ty(v)]) };
    // Clone the views that a backward node reads (and the views they are made from).
    let mut needed = vec![false; t.num_values()];
    for n in t.nodes.iter().filter(|n| n.phase != Phase::Forward) {
        for a in n.args.iter().filter(|a| in_group[a.index()]) {
            needed[a.index()] = true;
        }
    }
    for &(o, i) in views.iter().rev() {
        if needed[o.index()] {
            needed[t.nodes[i].args[0].index()] = true;
        }
    }
    for &(o, i) in &views {
        if needed[o.index()] {
            let o2 = t.new_value(t.ty(o).clone());
            let src = *map
                .get(&t.nodes[i].args[0])
                .ok_or_else(|| Error::Plan(format!("remat: view {o} of {v} lost its source")))?;
            new_nodes.push(Node { op: t.nodes[i].op.clone(), args: vec![src], outs: vec![o2], phase: Phase::Backward });
            map.insert(o, o2);
        }
    }
    for n in t.nodes.iter_mut().filter(|n| n.phase != Phase::Forward) {
        for a in n.args.iter_mut() {
            if let Some(&b) = map.get(a) {
                *a = b;
            }
        }
    }
    t.nodes.splice(first..first, new_nodes);
    Ok(extra)
}

/// One candidate for recomputation and its lifetime facts.
struct Cand {
    value: ValueId,
    op: &'static str,
    def: usize,
    bytes: usize,
    /// Last forward read and first backward read of it or its views.
    fwd_last: usize,
    bwd_first: usize,
    /// Arena roots its node reads.
    args: Vec<usize>,
    flops: u64,
    /// Predicted seconds of recomputing it (0 without a cost model).
    seconds: f64,
}

/// The live-bytes curve and the liveness of every root, as recomputation would change them.
struct Model {
    tree: MaxTree,
    cands: Vec<Cand>,
    /// Per root value: live segments `(start, end)` (one, or two once recomputed).
    segs: Vec<Vec<(usize, usize)>>,
    bytes: Vec<usize>,
    arena: Vec<bool>,
    taken: Vec<bool>,
}

impl Model {
    fn new(trace: &Trace, lt: &crate::plan::Lifetimes, cost: Option<&dyn CostModel>) -> Self {
        let n = trace.num_values();
        let defs = trace.defs();
        let root = |v: ValueId| match lt.values[v.index()].storage {
            Storage::View { root, .. } => root,
            Storage::Buffer(_) => v,
        };
        let bytes: Vec<usize> = (0..n).map(|i| align_up(trace.types[i].size_in_bytes().max(1), ALIGN)).collect();
        let arena: Vec<bool> = (0..n)
            .map(|i| match lt.values[i].storage {
                Storage::Buffer(b) => lt.buffers[b].region == Region::Arena,
                Storage::View { .. } => false,
            })
            .collect();
        let segs = (0..n).map(|i| vec![(lt.values[i].def, lt.values[i].last)]).collect();
        let (mut fwd_last, mut bwd_first) = (vec![0; n], vec![usize::MAX; n]);
        for (i, node) in trace.nodes.iter().enumerate() {
            for a in &node.args {
                let r = root(*a).index();
                if node.phase == Phase::Forward {
                    fwd_last[r] = fwd_last[r].max(i + 1);
                } else {
                    bwd_first[r] = bwd_first[r].min(i + 1);
                }
            }
        }
        let outputs: Vec<ValueId> = trace.outputs.iter().map(|o| root(o.value)).collect();
        let mut cands = Vec::new();
        for (i, life) in lt.values.iter().enumerate() {
            let v = ValueId(i as u32);
            let Some(Def::Node { node, .. }) = defs[i] else { continue };
            let nd = &trace.nodes[node];
            let Storage::Buffer(b) = life.storage else { continue };
            let single = lt.buffers[b].members.len() == 1 && lt.buffers[b].region == Region::Arena;
            if life.class != Class::Saved
                || nd.phase != Phase::Forward
                || nd.outs.len() != 1
                || !(is_cheap(&nd.op) || (cost.is_some() && is_recomputable(&nd.op)))
                || !single
                || outputs.contains(&v)
                || bwd_first[i] == usize::MAX
            {
                continue;
            }
            let a = trace.arg_types(nd);
            let mut args: Vec<usize> = nd.args.iter().map(|x| root(*x).index()).filter(|&r| arena[r]).collect();
            args.dedup();
            let o = [trace.ty(v)];
            let seconds = cost.map_or(0.0, |m| m.node_seconds(&nd.op, &a, &o));
            cands.push(Cand {
                value: v,
                op: nd.op.name(),
                def: life.def,
                bytes: bytes[i],
                fwd_last: fwd_last[i].max(life.def),
                bwd_first: bwd_first[i],
                args,
                flops: flops(&nd.op, &a, &o),
                seconds,
            });
        }
        Model { tree: MaxTree::new(&lt.live_bytes()), cands, segs, bytes, arena, taken: vec![false; n] }
    }

    /// Range updates recomputing candidate `c` makes: `(from, to, delta)`, and the segment
    /// changes to apply if it is taken.
    #[allow(clippy::type_complexity)]
    fn effect(&self, c: usize) -> (Vec<(usize, usize, i64)>, Vec<(usize, Vec<(usize, usize)>)>) {
        let cand = &self.cands[c];
        let v = cand.value.index();
        let mut adds = Vec::new();
        let mut new_segs = Vec::new();
        let (end_v, first_b) = (self.segs[v].last().map_or(cand.def, |s| s.1), cand.bwd_first);
        if first_b > cand.fwd_last + 1 {
            adds.push((cand.fwd_last + 1, first_b - 1, -(cand.bytes as i64)));
        }
        new_segs.push((v, vec![(cand.def, cand.fwd_last), (first_b, end_v)]));
        for &r in &cand.args {
            if !self.arena[r] {
                continue;
            }
            let segs = &self.segs[r];
            if segs.iter().any(|&(a, b)| a <= first_b && first_b <= b) {
                continue;
            }
            // Extend the latest segment that starts before the clone runs, or pull the next
            // one earlier, whichever adds fewer steps.
            let mut s = segs.clone();
            let Some(before) = s.iter().rposition(|&(a, _)| a <= first_b) else { continue };
            let gap_before = first_b.saturating_sub(s[before].1);
            if before + 1 < s.len() && s[before + 1].0.saturating_sub(first_b) < gap_before {
                adds.push((first_b, s[before + 1].0 - 1, self.bytes[r] as i64));
                s[before + 1].0 = first_b;
            } else {
                adds.push((s[before].1 + 1, first_b, self.bytes[r] as i64));
                s[before].1 = first_b;
            }
            new_segs.push((r, s));
        }
        (adds, new_segs)
    }

    fn take(&mut self, c: usize) {
        let (adds, segs) = self.effect(c);
        for (a, b, d) in adds {
            self.tree.add(a, b, d);
        }
        for (r, s) in segs {
            self.segs[r] = s;
        }
        self.taken[self.cands[c].value.index()] = true;
    }

    fn is_open(&self, c: usize) -> bool {
        !self.taken[self.cands[c].value.index()]
    }

    /// `(LOAD, steps at LOAD)` if candidate `c` were taken.
    fn try_load(&mut self, c: usize) -> (usize, usize) {
        let (adds, _) = self.effect(c);
        for &(a, b, d) in &adds {
            self.tree.add(a, b, d);
        }
        let now = self.tree.top();
        for &(a, b, d) in &adds {
            self.tree.add(a, b, -d);
        }
        now
    }

    /// Takes candidates one at a time while one lowers `(LOAD, steps at LOAD)`; the count lets
    /// a run of takes wear down a plateau that no single one can lower. Among the improving
    /// candidates it takes the one removing most LOAD (else most peak steps) per unit of
    /// `cost`. Stops once LOAD is at most `target`, and drops the takes after the last one that
    /// lowered LOAD.
    fn choose(&mut self, target: usize, cost: &dyn Fn(&Cand) -> f64) -> Vec<usize> {
        let mut chosen = Vec::new();
        let mut best_at = (self.tree.top().0, 0); // (LOAD, takes that reached it)
        loop {
            let now = self.tree.top();
            if now.0 <= target {
                break;
            }
            let mut best: Option<((f64, f64), usize)> = None;
            for c in 0..self.cands.len() {
                if !self.is_open(c) {
                    continue;
                }
                let after = self.try_load(c);
                if after < now {
                    let k = cost(&self.cands[c]);
                    let score = ((now.0 - after.0) as f64 / k, (now.1 as f64 - after.1 as f64) / k);
                    if best.is_none_or(|(s, _)| score > s) {
                        best = Some((score, c));
                    }
                }
            }
            let Some((_, c)) = best else { break };
            self.take(c);
            chosen.push(c);
            if self.tree.top().0 < best_at.0 {
                best_at = (self.tree.top().0, chosen.len());
            }
        }
        chosen.truncate(best_at.1);
        chosen
    }
}

/// A segment tree over steps with range add, global maximum and how many steps reach it.
struct MaxTree {
    n: usize,
    max: Vec<i64>,
    count: Vec<usize>,
    lazy: Vec<i64>,
}

impl MaxTree {
    fn new(values: &[usize]) -> Self {
        let n = values.len().max(1);
        let mut t = MaxTree { n, max: vec![0; 4 * n], count: vec![0; 4 * n], lazy: vec![0; 4 * n] };
        t.build(1, 0, n - 1, values);
        t
    }
    fn pull(&mut self, i: usize) {
        let (l, r) = (2 * i, 2 * i + 1);
        let m = self.max[l].max(self.max[r]);
        let c = if self.max[l] == m { self.count[l] } else { 0 } + if self.max[r] == m { self.count[r] } else { 0 };
        self.max[i] = m + self.lazy[i];
        self.count[i] = c;
    }
    fn build(&mut self, i: usize, lo: usize, hi: usize, v: &[usize]) {
        if lo == hi {
            self.max[i] = v.get(lo).copied().unwrap_or(0) as i64;
            self.count[i] = 1;
            return;
        }
        let mid = (lo + hi) / 2;
        self.build(2 * i, lo, mid, v);
        self.build(2 * i + 1, mid + 1, hi, v);
        self.pull(i);
    }
    fn add(&mut self, a: usize, b: usize, d: i64) {
        if a <= b && a < self.n {
            self.add_at(1, 0, self.n - 1, a, b.min(self.n - 1), d);
        }
    }
    fn add_at(&mut self, i: usize, lo: usize, hi: usize, a: usize, b: usize, d: i64) {
        if b < lo || hi < a {
            return;
        }
        if a <= lo && hi <= b {
            self.max[i] += d;
            self.lazy[i] += d;
            return;
        }
        let mid = (lo + hi) / 2;
        self.add_at(2 * i, lo, mid, a, b, d);
        self.add_at(2 * i + 1, mid + 1, hi, a, b, d);
        self.pull(i);
    }
    /// `(max, steps at max)`.
    fn top(&self) -> (usize, usize) {
        (self.max[1].max(0) as usize, self.count[1])
    }
}

#[cfg(test)]
mod tests {
    use super::MaxTree;

    #[test]
    fn max_tree_tracks_max_and_its_count_under_range_adds() {
        let v = [3, 1, 4, 1, 5, 9, 2, 6];
        let mut t = MaxTree::new(&v);
        assert_eq!(t.top(), (9, 1));
        t.add(0, 3, 5); // 8 6 9 6 5 9 2 6
        assert_eq!(t.top(), (9, 2));
        t.add(5, 5, -3); // 8 6 9 6 5 6 2 6
        assert_eq!(t.top(), (9, 1));
        t.add(2, 2, -1); // 8 6 8 6 5 6 2 6
        assert_eq!(t.top(), (8, 2));
        t.add(2, 2, 1);
        t.add(5, 5, 3);
        t.add(0, 3, -5);
        assert_eq!(t.top(), (9, 1));
    }
}
