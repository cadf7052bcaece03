//! The rewrite of [`super::data_parallel`]: the new trace built node by node, each bucket's
//! collective after its last gradient, DDP's averaged gradients read by the optimizer, the
//! loss averaged; ZeRO-1's replay of the optimizer is in `zero1.rs`.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use super::{DataParallel, DpPlan, Found, Member, Mode, ShardState};
use crate::ir::{CollectiveOp, Graph, InputRole, Op, OutputRole, Phase, Tensor, TensorType, Trace, ValueId};
use crate::{Error, Result};

/// How ZeRO-1 holds a value of the optimizer phase.
#[derive(Clone)]
pub(super) enum Sh {
    /// A flat piece of gradient `grad`'s parameter (`None`: this rank's shard covers none of it).
    Piece(usize, Option<Tensor>),
    /// This rank's part of a sum over every element of gradients (`None`: no part).
    Partial(Option<Tensor>),
}

/// Where gradient `grad` lies: bucket, member index, and the part of it this rank's shard
/// holds (in the gradient's flat coordinates).
#[derive(Clone)]
pub(super) struct Place {
    pub(super) bucket: usize,
    pub(super) member: Member,
    pub(super) piece: Option<Range<usize>>,
}

pub(super) struct Rewriter<'a> {
    pub(super) t: &'a Trace,
    pub(super) plan: DpPlan,
    pub(super) found: Vec<Found>,
    pub(super) g: Graph,
    /// Old value -> new value, as non-optimizer nodes read it.
    pub(super) m: Vec<Option<Tensor>>,
    /// What optimizer nodes read instead (DDP: averaged gradients; ZeRO-1: all-reduced partials).
    pub(super) opt: HashMap<ValueId, Tensor>,
    /// ZeRO-1: values held as pieces or partial sums.
    pub(super) sh: HashMap<ValueId, Sh>,
    pub(super) places: Vec<Place>,
    /// ZeRO-1: old param / state input value -> (gradient index, None for the parameter or the state slot).
    pub(super) lazy: HashMap<ValueId, (usize, Option<usize>)>,
    /// ZeRO-1: the shard state inputs, per bucket and slot.
    pub(super) shard_inputs: Vec<Vec<Tensor>>,
    /// Values that depend on a gradient.
    pub(super) grad_dep: Vec<bool>,
}

impl<'a> Rewriter<'a> {
    pub(super) fn new(t: &'a Trace, mut plan: DpPlan, found: Vec<Found>) -> Result<Self> {
        let dp = plan.dp;
        let zero1 = dp.mode == Mode::Zero1;
        let g = Graph::new(format!("{}_rank{}of{}", t.name, dp.rank, dp.world));
        let mut places = vec![None; found.len()];
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let r = bucket.shard_range(dp.world, dp.rank);
            for m in &bucket.members {
                let (lo, hi) = (r.start.max(m.offset), r.end.min(m.offset + m.numel));
                let piece = (lo < hi).then(|| lo - m.offset..hi - m.offset);
                places[m.grad] = Some(Place { bucket: b, member: *m, piece });
            }
        }
        let places: Vec<Place> = places.into_iter().map(|p| p.expect("every gradient is in a bucket")).collect();
        // ZeRO-1: the states each bucket slot gathers, checked alike across the bucket.
        let mut lazy = HashMap::new();
        let mut replaced = HashSet::new();
        if zero1 {
            for (b, bucket) in plan.buckets.iter().enumerate() {
                let first = &found[bucket.members[0].grad];
                for m in &bucket.members {
                    let f = &found[m.grad];
                    let pname = &t.inputs[f.param].name;
                    if f.states.len() != first.states.len() {
                        return Err(Error::msg(format!(
                            "data_parallel `{}`: ZeRO-1 bucket {b} mixes parameters with {} and {} optimizer states (`{}`, `{pname}`)",
                            t.name,
                            first.states.len(),
                            f.states.len(),
                            t.inputs[first.param].name
                        )));
                    }
                    lazy.insert(t.inputs[f.param].value, (m.grad, None));
                    for (j, &s) in f.states.iter().enumerate() {
                        let (sty, fty) = (t.ty(t.inputs[s].value), t.ty(t.inputs[first.states[j]].value));
                        if sty.numel() != m.numel || sty.dtype != fty.dtype {
                            return Err(Error::msg(format!(
                                "data_parallel `{}`: ZeRO-1 state `{}` ({sty}) does not match parameter `{pname}` or its bucket's {}",
                                t.name, t.inputs[s].name, fty.dtype
                            )));
                        }
                        if !replaced.insert(s) {
                            return Err(Error::msg(format!(
                                "data_parallel `{}`: state `{}` is read by the updates of two parameters",
                                t.name, t.inputs[s].name
                            )));
                        }
                        lazy.insert(t.inputs[s].value, (m.grad, Some(j)));
                    }
                }
                for j in 0..first.states.len() {
                    let dtype = t.ty(t.inputs[first.states[j]].value).dtype;
                    let members = bucket
                        .members
                        .iter()
                        .map(|m| {
                            let s = found[m.grad].states[j];
                            (t.inputs[s].name.clone(), t.ty(t.inputs[s].value).clone())
                        })
                        .collect();
                    plan.shard_states.push(ShardState {
                        name: format!("zero1.b{b}.s{j}"),
                        bucket: b,
                        slot: j,
                        ty: TensorType::new(dtype, [bucket.shard(dp.world)]),
                        members,
                    });
                }
            }
        }
        let mut m = vec![None; t.num_values()];
        for (i, inp) in t.inputs.iter().enumerate() {
            if !replaced.contains(&i) {
                m[inp.value.index()] = Some(g.input(&inp.name, t.ty(inp.value).clone(), inp.role)?);
            }
        }
        let mut shard_inputs = vec![Vec::new(); plan.buckets.len()];
        for s in &plan.shard_states {
            shard_inputs[s.bucket].push(g.input(&s.name, s.ty.clone(), InputRole::OptState)?);
        }
        let mut grad_dep = vec![false; t.num_values()];
        for f in &found {
            grad_dep[f.grad.index()] = true;
        }
        for n in &t.nodes {
            if n.args.iter().any(|a| grad_dep[a.index()]) {
                n.outs.iter().for_each(|o| grad_dep[o.index()] = true);
            }
        }
        Ok(Rewriter {
            t,
            plan,
            found,
            g,
            m,
            opt: HashMap::new(),
            sh: HashMap::new(),
            places,
            lazy,
            shard_inputs,
            grad_dep,
        })
    }

    pub(super) fn err(&self, m: String) -> Error {
        Error::msg(format!("data_parallel `{}`: {m}", self.t.name))
    }

    pub(super) fn dp(&self) -> DataParallel {
        self.plan.dp
    }

    pub(super) fn collective(&self, op: CollectiveOp, x: &Tensor) -> Result<Tensor> {
        let DataParallel { world, rank, .. } = self.dp();
        Ok(self.g.apply(Op::Collective { op, world, rank }, &[x])?.remove(0))
    }

    /// The new value of old `v` as a non-optimizer node reads it.
    pub(super) fn plain(&self, v: ValueId) -> Result<Tensor> {
        self.m[v.index()].clone().ok_or_else(|| {
            self.err(format!("{v} ({}) is read outside the optimizer but ZeRO-1 replaced it", self.t.ty(v)))
        })
    }

    /// The new value of old `v` as an optimizer node reads it (not a ZeRO-1 piece).
    pub(super) fn opt_plain(&self, v: ValueId) -> Result<Tensor> {
        match self.opt.get(&v) {
            Some(t) => Ok(t.clone()),
            None => self.plain(v),
        }
    }

    pub(super) fn run(mut self) -> Result<(Trace, DpPlan)> {
        let t = self.t;
        let zero1 = self.dp().mode == Mode::Zero1;
        // Bucket b is ready after the node defining its last gradient.
        let ready: Vec<usize> = self.plan.buckets.iter().map(|b| self.found[b.last_grad()].def.0).collect();
        for (n, node) in t.nodes.iter().enumerate() {
            self.g.set_phase(node.phase);
            if node.phase == Phase::Optimizer && zero1 {
                self.zero1_node(n)?;
            } else {
                let read =
                    |s: &Self, a: ValueId| if node.phase == Phase::Optimizer { s.opt_plain(a) } else { s.plain(a) };
                let args = node.args.iter().map(|a| read(&self, *a)).collect::<Result<Vec<_>>>()?;
                let outs = self.g.apply(node.op.clone(), &args.iter().collect::<Vec<_>>())?;
                for (o, v) in node.outs.iter().zip(outs) {
                    self.m[o.index()] = Some(v);
                }
            }
            for b in (0..ready.len()).filter(|&b| ready[b] == n) {
                self.reduce_bucket(b)?;
            }
        }
        self.g.set_phase(Phase::Optimizer);
        let mut outputs = Vec::new();
        let gathered = if zero1 { self.gather_params()? } else { HashMap::new() };
        let replaced: HashSet<ValueId> = self.lazy.iter().filter(|(_, l)| l.1.is_some()).map(|(v, _)| *v).collect();
        for o in &t.outputs {
            let (value, role) = match o.role {
                OutputRole::Update { of } if replaced.contains(&of) => continue,
                OutputRole::Update { of } if gathered.contains_key(&of) => {
                    (gathered[&of].clone(), OutputRole::Update { of: self.plain(of)?.id() })
                }
                OutputRole::Grad { of } | OutputRole::Update { of } => {
                    let v = self.resolve(o.value, &o.name)?;
                    let of = self.plain(of)?.id();
                    (
                        v,
                        if matches!(o.role, OutputRole::Grad { .. }) {
                            OutputRole::Grad { of }
                        } else {
                            OutputRole::Update { of }
                        },
                    )
                }
                OutputRole::Output | OutputRole::Saved => {
                    let v = self.resolve(o.value, &o.name)?;
                    let ty = t.ty(o.value);
                    if o.role == OutputRole::Output
                        && ty.rank() == 0
                        && ty.dtype.is_float()
                        && !self.grad_dep[o.value.index()]
                    {
                        let inv = 1.0 / self.dp().world as f64;
                        (self.collective(CollectiveOp::AllReduce, &v)?.mul_scalar(inv)?, o.role)
                    } else {
                        (v, o.role)
                    }
                }
            };
            outputs.push((value, o.name.clone(), role));
        }
        if zero1 {
            outputs.extend(self.shard_state_updates()?);
        }
        for (v, name, role) in &outputs {
            self.g.output_with_role(v, name, *role)?;
        }
        let trace = crate::passes::dce(&self.g.finish()?)?;
        Ok((trace, self.plan))
    }

    /// The new value of old `v` as an output: ZeRO-1 partial sums are all-reduced; pieces refused.
    fn resolve(&mut self, v: ValueId, name: &str) -> Result<Tensor> {
        match self.sh.get(&v).cloned() {
            Some(Sh::Partial(p)) => self.total(v, p),
            Some(Sh::Piece(..)) => {
                Err(self.err(format!("output \"{name}\" is a per-parameter value that ZeRO-1 shards")))
            }
            None => self.opt_plain(v),
        }
    }

    /// The all-reduce of a partial sum `p` (old value `v`), made once.
    pub(super) fn total(&mut self, v: ValueId, p: Option<Tensor>) -> Result<Tensor> {
        let p = p.unwrap_or_else(|| self.g.scalar(0.0, self.t.ty(v).dtype));
        let total = self.collective(CollectiveOp::AllReduce, &p)?;
        self.sh.remove(&v);
        self.opt.insert(v, total.clone());
        Ok(total)
    }

    /// Emits bucket `b`'s collective: DDP's averaged gradients, or ZeRO-1's pieces.
    fn reduce_bucket(&mut self, b: usize) -> Result<()> {
        let bucket = self.plan.buckets[b].clone();
        let DataParallel { world, rank, mode, .. } = self.dp();
        let phase = self.g.phase();
        self.g.set_phase(Phase::Backward);
        let mut flat = Vec::new();
        for m in &bucket.members {
            flat.push(self.plain(self.found[m.grad].grad)?.reshape(&[m.numel])?);
        }
        let inv = 1.0 / world as f64;
        match mode {
            Mode::Ddp => {
                let buf =
                    if flat.len() == 1 { flat.remove(0) } else { Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)? };
                let avg = self.collective(CollectiveOp::AllReduce, &buf)?.mul_scalar(inv)?;
                for m in &bucket.members {
                    let gv = self.found[m.grad].grad;
                    let part = if bucket.members.len() == 1 {
                        avg.clone()
                    } else {
                        avg.slice(0, m.offset, m.offset + m.numel)?
                    };
                    self.opt.insert(gv, part.reshape(self.t.ty(gv).dims())?);
                }
            }
            Mode::Zero1 => {
                if bucket.padded > bucket.numel {
                    flat.push(self.g.full(0.0, bucket.dtype, &[bucket.padded - bucket.numel]));
                }
                let buf =
                    if flat.len() == 1 { flat.remove(0) } else { Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)? };
                let shard = self.collective(CollectiveOp::ReduceScatter, &buf)?.mul_scalar(inv)?;
                let lo = bucket.shard_range(world, rank).start;
                for m in &bucket.members {
                    let place = self.places[m.grad].clone();
                    let piece = match place.piece {
                        Some(r) => Some(slice_or_all(&shard, m.offset + r.start - lo, m.offset + r.end - lo)?),
                        None => None,
                    };
                    self.sh.insert(self.found[m.grad].grad, Sh::Piece(m.grad, piece));
                }
            }
        }
        self.g.set_phase(phase);
        Ok(())
    }
}

/// `x[start..end]` of a flat `x`, or `x` itself when that is all of it.
pub(super) fn slice_or_all(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    if start == 0 && end == x.dims()[0] { Ok(x.clone()) } else { x.slice(0, start, end) }
}
