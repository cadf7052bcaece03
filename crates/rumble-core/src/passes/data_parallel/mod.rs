//! Data-parallel training (issue 20): one training-step trace becomes the program of one of
//! `world` ranks, which exchange gradients through collective ops (`Op::Collective`). Every
//! rank runs the same step on its own rows of the global batch; [`data_parallel`] makes rank
//! `rank`'s trace, and every rank's trace holds the same collectives in the same order.
//!
//! The pass reads a training step as `autodiff` and the optimizers build it: nodes of
//! `Phase::Optimizer` compute `Update` outputs of the parameters (or, with no optimizer, the
//! parameters have `Grad` outputs). The gradient of a parameter is the one value made before
//! the optimizer phase, of the parameter's size, that its update (or `Grad` output) reads
//! through optimizer nodes of non-scalar values (scalars such as a clipping coefficient are
//! shared by every parameter and are not followed); its optimizer states are the `opt_state`
//! inputs that update reads. The gradients, in the order the backward produces them, are
//! grouped into buckets ([`buckets`]); each bucket's collective follows the node that makes its
//! last gradient, so on a device it overlaps the rest of the backward.
//!
//! - [`Mode::Ddp`]: each bucket is flattened, concatenated, `all_reduce`d and scaled by
//!   `1/world` (the mean over ranks of the per-rank mean gradients, the global batch's mean
//!   when ranks have equal rows), then split back; the optimizer runs unchanged on the whole
//!   gradient (so clipping sees the global norm).
//! - [`Mode::Zero1`]: each bucket, padded to a multiple of `world`, is `reduce_scatter`ed and
//!   scaled by `1/world`; this rank keeps its flat shard. The optimizer nodes are replayed on
//!   the shard, parameter by parameter over the part of the shard each one covers: the
//!   gradient, the parameter (flattened and sliced) and the optimizer states are then flat
//!   pieces. The states become persistent inputs of shard size, one per bucket and state slot
//!   (`zero1.b{bucket}.s{slot}`, described by [`ShardState`]), so each rank keeps `1/world` of
//!   them. The updated parameter shards are `all_gather`ed and split back into the parameters'
//!   `Update` outputs. Only elementwise optimizer ops replay (AdamW, SGD); a sum of every
//!   element (the squared norm of clipping) becomes a partial sum over the shard, and the
//!   first op that reads more than sums of such partials reads their `all_reduce` instead, so
//!   the global gradient norm is exact.
//! - In both modes a scalar float `Output` that depends on no gradient (the loss) is
//!   `all_reduce`d and scaled by `1/world`: every rank reports the global mean.
//!
//! What an NCCL backend needs from this: the collectives are ordinary nodes with planned
//! operand and result buffers, so each becomes one `ncclAllReduce` / `ncclReduceScatter` /
//! `ncclAllGather` (sum) on a communicator made once per process (`world`, `rank`, the unique
//! id exchanged by the launcher), launched on the step's stream (or a second stream with
//! events, to overlap the backward) and captured in the step's CUDA graph; no buffer of its own.

pub mod buckets;

use std::collections::{HashMap, HashSet};
use std::ops::Range;

pub use buckets::{Bucket, GradSpec, Member, plan_buckets};

use crate::cpu::HostTensor;
use crate::ir::{
    BinaryOp, CollectiveOp, DType, Def, Graph, InputRole, Op, OutputRole, Phase, ReduceOp, Tensor, TensorType, Trace,
    ValueId,
};
use crate::{Error, Result};

/// How gradients and optimizer state are split over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Gradients all-reduced, optimizer state replicated (PyTorch's DDP).
    Ddp,
    /// Gradients reduce-scattered, optimizer state sharded, parameters all-gathered (ZeRO stage 1).
    Zero1,
}

/// The settings of [`data_parallel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataParallel {
    pub world: usize,
    pub rank: usize,
    pub mode: Mode,
    /// The most gradient bytes a bucket holds (a larger gradient is a bucket of its own).
    pub bucket_bytes: usize,
}

impl DataParallel {
    /// PyTorch DDP's default bucket size, 25 MiB.
    pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;
}

/// A parameter's gradient as the pass found it.
#[derive(Clone, Debug, PartialEq)]
pub struct GradInfo {
    /// The parameter input's name and type.
    pub param: String,
    pub param_ty: TensorType,
    /// The gradient's dtype (the bucket's).
    pub dtype: DType,
    /// The optimizer state inputs its update reads, in input order.
    pub states: Vec<String>,
}

/// A ZeRO-1 state input: slot `slot` of bucket `bucket`, this rank's shard.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardState {
    pub name: String,
    pub bucket: usize,
    pub slot: usize,
    /// `[shard]`, in the states' dtype.
    pub ty: TensorType,
    /// Per bucket member, in order: the state input it replaces, with its type.
    pub members: Vec<(String, TensorType)>,
}

/// What [`data_parallel`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct DpPlan {
    pub dp: DataParallel,
    /// In the order the backward produces them; `Member::grad` indexes this.
    pub grads: Vec<GradInfo>,
    pub buckets: Vec<Bucket>,
    /// ZeRO-1 only: the state inputs of shard size, in input order (after every other input).
    pub shard_states: Vec<ShardState>,
}

impl DpPlan {
    /// This rank's shard inputs cut from the whole optimizer states (looked up by name), in
    /// `shard_states` order; padding is zero.
    pub fn shard_states(&self, full: &dyn Fn(&str) -> Option<HostTensor>) -> Result<Vec<HostTensor>> {
        let mut out = Vec::new();
        for s in &self.shard_states {
            let b = &self.buckets[s.bucket];
            let mut flat = vec![0.0f64; b.padded];
            for ((name, ty), m) in s.members.iter().zip(&b.members) {
                let t = full(name).ok_or_else(|| Error::msg(format!("shard_states: no state `{name}`")))?;
                if t.ty != *ty {
                    return Err(Error::msg(format!("shard_states: state `{name}` is {}, expected {ty}", t.ty)));
                }
                flat[m.offset..m.offset + m.numel].copy_from_slice(&t.to_f64());
            }
            let r = b.shard_range(self.dp.world, self.dp.rank);
            out.push(HostTensor::from_f64(s.ty.dtype, s.ty.dims(), &flat[r])?);
        }
        Ok(out)
    }

    /// The whole optimizer states (name, tensor) from every rank's shards: `shards[r]` holds
    /// rank `r`'s values of `shard_states`, in order (any rank's plan gathers).
    pub fn gather_states(&self, shards: &[Vec<HostTensor>]) -> Result<Vec<(String, HostTensor)>> {
        let world = self.dp.world;
        if shards.len() != world || shards.iter().any(|s| s.len() != self.shard_states.len()) {
            return Err(Error::msg(format!(
                "gather_states: wants {world} ranks of {} shards each",
                self.shard_states.len()
            )));
        }
        let mut out = Vec::new();
        for (k, s) in self.shard_states.iter().enumerate() {
            let flat: Vec<f64> = shards.iter().flat_map(|r| r[k].to_f64()).collect();
            for ((name, ty), m) in s.members.iter().zip(&self.buckets[s.bucket].members) {
                out.push((
                    name.clone(),
                    HostTensor::from_f64(ty.dtype, ty.dims(), &flat[m.offset..m.offset + m.numel])?,
                ));
            }
        }
        Ok(out)
    }
}

/// Rank `dp.rank`'s program of the training step `trace` (see the module docs), and the plan.
pub fn data_parallel(trace: &Trace, dp: &DataParallel) -> Result<(Trace, DpPlan)> {
    let err = |m: String| Error::msg(format!("data_parallel `{}`: {m}", trace.name));
    if dp.world == 0 || dp.rank >= dp.world {
        return Err(err(format!("rank {} is not one of world {}'s ranks", dp.rank, dp.world)));
    }
    if let Some(n) = trace.nodes.iter().find(|n| matches!(n.op, Op::Collective { .. })) {
        return Err(err(format!("the trace already holds a collective ({}): it is a rank's program", n.op.name())));
    }
    let found = find_grads(trace).map_err(err)?;
    if found.is_empty() {
        return Err(err("no parameter has a gradient (a `Grad` output or an optimizer `Update`)".into()));
    }
    if dp.mode == Mode::Zero1
        && let Some(f) = found.iter().find(|f| !f.by_update)
    {
        return Err(err(format!(
            "ZeRO-1 shards the optimizer, but parameter `{}` has a gradient output and no optimizer update",
            trace.inputs[f.param].name
        )));
    }
    let grads: Vec<GradInfo> = found
        .iter()
        .map(|f| GradInfo {
            param: trace.inputs[f.param].name.clone(),
            param_ty: trace.ty(trace.inputs[f.param].value).clone(),
            dtype: trace.ty(f.grad).dtype,
            states: f.states.iter().map(|&s| trace.inputs[s].name.clone()).collect(),
        })
        .collect();
    let specs: Vec<GradSpec> = grads
        .iter()
        .zip(&found)
        .map(|(g, f)| GradSpec { name: g.param.clone(), dtype: g.dtype, numel: trace.ty(f.grad).numel() })
        .collect();
    let buckets = plan_buckets(&specs, dp.world, dp.bucket_bytes)?;
    let plan = DpPlan { dp: *dp, grads, buckets, shard_states: Vec::new() };
    Rewriter::new(trace, plan, found)?.run()
}

/// A gradient found in the trace.
struct Found {
    /// Input index of the parameter.
    param: usize,
    grad: ValueId,
    /// The node and output index defining the gradient (its production order).
    def: (usize, usize),
    /// Input indices of its optimizer states.
    states: Vec<usize>,
    /// Found through an `Update` (an optimizer), not a `Grad` output.
    by_update: bool,
}

/// Values that `start` reads through optimizer nodes of non-scalar values: those made before
/// the optimizer phase, and the inputs (by index).
fn cone(t: &Trace, defs: &[Option<Def>], start: ValueId) -> (Vec<ValueId>, Vec<usize>) {
    let (mut seen, mut stack) = (HashSet::new(), vec![start]);
    let (mut made, mut inputs) = (Vec::new(), Vec::new());
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        match defs[v.index()] {
            Some(Def::Input(i)) => inputs.push(i),
            Some(Def::Node { node, .. }) if t.nodes[node].phase == Phase::Optimizer => {
                stack.extend(t.nodes[node].args.iter().filter(|a| t.ty(**a).rank() > 0));
            }
            Some(Def::Node { .. }) => made.push(v),
            None => {}
        }
    }
    inputs.sort_unstable();
    (made, inputs)
}

fn find_grads(t: &Trace) -> Result<Vec<Found>, String> {
    let defs = t.defs();
    let mut found: Vec<Found> = Vec::new();
    for o in &t.outputs {
        let (of, by_update) = match o.role {
            OutputRole::Grad { of } => (of, false),
            OutputRole::Update { of } => (of, true),
            OutputRole::Output | OutputRole::Saved => continue,
        };
        let Some(Def::Input(p)) = defs[of.index()] else { continue };
        if t.inputs[p].role != InputRole::Param || found.iter().any(|f| f.param == p) {
            continue;
        }
        let pname = &t.inputs[p].name;
        let (made, inputs) = cone(t, &defs, o.value);
        let numel = t.ty(of).numel();
        let cands: Vec<ValueId> = made.into_iter().filter(|v| t.ty(*v).numel() == numel).collect();
        let [grad] = cands.as_slice() else {
            return Err(format!(
                "output \"{}\" of parameter `{pname}` reads {} values of its size made before the optimizer; \
                 expected one gradient",
                o.name,
                cands.len()
            ));
        };
        if let Some(f) = found.iter().find(|f| f.grad == *grad) {
            return Err(format!("parameters `{}` and `{pname}` read the same gradient {grad}", t.inputs[f.param].name));
        }
        let Some(Def::Node { node, out }) = defs[grad.index()] else { unreachable!("cone returns node values") };
        let states: Vec<usize> = inputs.into_iter().filter(|&i| t.inputs[i].role == InputRole::OptState).collect();
        found.push(Found { param: p, grad: *grad, def: (node, out), states, by_update });
    }
    found.sort_by_key(|f| f.def);
    Ok(found)
}

/// How ZeRO-1 holds a value of the optimizer phase.
#[derive(Clone)]
enum Sh {
    /// A flat piece of gradient `grad`'s parameter (`None`: this rank's shard covers none of it).
    Piece(usize, Option<Tensor>),
    /// This rank's part of a sum over every element of gradients (`None`: no part).
    Partial(Option<Tensor>),
}

/// Where gradient `grad` lies: bucket, member index, and the part of it this rank's shard
/// holds (in the gradient's flat coordinates).
#[derive(Clone)]
struct Place {
    bucket: usize,
    member: Member,
    piece: Option<Range<usize>>,
}

struct Rewriter<'a> {
    t: &'a Trace,
    plan: DpPlan,
    found: Vec<Found>,
    g: Graph,
    /// Old value -> new value, as non-optimizer nodes read it.
    m: Vec<Option<Tensor>>,
    /// What optimizer nodes read instead (DDP: averaged gradients; ZeRO-1: all-reduced partials).
    opt: HashMap<ValueId, Tensor>,
    /// ZeRO-1: values held as pieces or partial sums.
    sh: HashMap<ValueId, Sh>,
    places: Vec<Place>,
    /// ZeRO-1: old param / state input value -> (gradient index, None for the parameter or the state slot).
    lazy: HashMap<ValueId, (usize, Option<usize>)>,
    /// ZeRO-1: the shard state inputs, per bucket and slot.
    shard_inputs: Vec<Vec<Tensor>>,
    /// Values that depend on a gradient.
    grad_dep: Vec<bool>,
}

impl<'a> Rewriter<'a> {
    fn new(t: &'a Trace, mut plan: DpPlan, found: Vec<Found>) -> Result<Self> {
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

    fn err(&self, m: String) -> Error {
        Error::msg(format!("data_parallel `{}`: {m}", self.t.name))
    }

    fn dp(&self) -> DataParallel {
        self.plan.dp
    }

    fn collective(&self, op: CollectiveOp, x: &Tensor) -> Result<Tensor> {
        let DataParallel { world, rank, .. } = self.dp();
        Ok(self.g.apply(Op::Collective { op, world, rank }, &[x])?.remove(0))
    }

    /// The new value of old `v` as a non-optimizer node reads it.
    fn plain(&self, v: ValueId) -> Result<Tensor> {
        self.m[v.index()].clone().ok_or_else(|| {
            self.err(format!("{v} ({}) is read outside the optimizer but ZeRO-1 replaced it", self.t.ty(v)))
        })
    }

    /// The new value of old `v` as an optimizer node reads it (not a ZeRO-1 piece).
    fn opt_plain(&self, v: ValueId) -> Result<Tensor> {
        match self.opt.get(&v) {
            Some(t) => Ok(t.clone()),
            None => self.plain(v),
        }
    }

    fn run(mut self) -> Result<(Trace, DpPlan)> {
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
    fn total(&mut self, v: ValueId, p: Option<Tensor>) -> Result<Tensor> {
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

    /// ZeRO-1's view of old `v` read by an optimizer node (a parameter or state becomes a piece
    /// the first time it is read).
    fn sharded(&mut self, v: ValueId) -> Result<Option<Sh>> {
        if let Some(s) = self.sh.get(&v) {
            return Ok(Some(s.clone()));
        }
        let Some(&(gi, slot)) = self.lazy.get(&v) else { return Ok(None) };
        let place = self.places[gi].clone();
        let piece = match (&place.piece, slot) {
            (None, _) => None,
            (Some(r), None) => Some(slice_or_all(&self.plain(v)?.reshape(&[place.member.numel])?, r.start, r.end)?),
            (Some(r), Some(j)) => {
                let bucket = &self.plan.buckets[place.bucket];
                let lo = bucket.shard_range(self.dp().world, self.dp().rank).start;
                let input = self.shard_inputs[place.bucket][j].clone();
                Some(slice_or_all(&input, place.member.offset + r.start - lo, place.member.offset + r.end - lo)?)
            }
        };
        let s = Sh::Piece(gi, piece);
        self.sh.insert(v, s.clone());
        Ok(Some(s))
    }

    /// Replays optimizer node `n` under ZeRO-1 (see the module docs).
    fn zero1_node(&mut self, n: usize) -> Result<()> {
        let t = self.t;
        let node = &t.nodes[n];
        let mut kinds = Vec::new();
        for a in &node.args {
            kinds.push(self.sharded(*a)?);
        }
        if node.op == Op::Binary(BinaryOp::Add)
            && let [Some(Sh::Partial(x)), Some(Sh::Partial(y))] = kinds.as_slice()
        {
            let sum = match (x, y) {
                (Some(x), Some(y)) => Some(x.add(y)?),
                (x, y) => x.clone().or(y.clone()),
            };
            self.sh.insert(node.outs[0], Sh::Partial(sum));
            return Ok(());
        }
        for (a, k) in node.args.iter().zip(kinds.iter_mut()) {
            if let Some(Sh::Partial(p)) = k {
                let p = p.clone();
                self.total(*a, p)?;
                *k = None;
            }
        }
        let owners: HashSet<usize> =
            kinds.iter().filter_map(|k| if let Some(Sh::Piece(gi, _)) = k { Some(*gi) } else { None }).collect();
        let name = |gi: &usize| self.plan.grads[*gi].param.clone();
        if owners.is_empty() {
            let args = node.args.iter().map(|a| self.opt_plain(*a)).collect::<Result<Vec<_>>>()?;
            let outs = self.g.apply(node.op.clone(), &args.iter().collect::<Vec<_>>())?;
            for (o, v) in node.outs.iter().zip(outs) {
                self.m[o.index()] = Some(v);
            }
            return Ok(());
        }
        if owners.len() > 1 {
            let names: Vec<String> = owners.iter().map(name).collect();
            return Err(self.err(format!(
                "optimizer node {n} ({}) mixes parameters {}",
                node.op.name(),
                names.join(", ")
            )));
        }
        let gi = *owners.iter().next().expect("one owner");
        let is_sum_all = |op: &Op| {
            matches!(op, Op::Reduce { op: ReduceOp::Sum, axes, keepdim: false }
                if *axes == (0..t.ty(node.args[0]).rank()).collect::<Vec<_>>())
        };
        let piece_len = self.places[gi].piece.as_ref().map(|r| r.len());
        let Some(len) = piece_len else {
            let s = if is_sum_all(&node.op) { Sh::Partial(None) } else { Sh::Piece(gi, None) };
            node.outs.iter().for_each(|o| {
                self.sh.insert(*o, s.clone());
            });
            return Ok(());
        };
        let defs = t.defs();
        let mut args = Vec::new();
        for (a, k) in node.args.iter().zip(&kinds) {
            args.push(match k {
                Some(Sh::Piece(_, Some(p))) => p.clone(),
                Some(_) => unreachable!("partials are totals by now and absent pieces returned early"),
                None if t.ty(*a).rank() == 0 => self.opt_plain(*a)?,
                None => {
                    let src = match defs[a.index()] {
                        Some(Def::Node { node: d, .. }) if t.nodes[d].phase == Phase::Optimizer => Some(&t.nodes[d]),
                        _ => None,
                    };
                    match src.map(|s| (&s.op, &s.args)) {
                        Some((Op::Broadcast { .. }, sa)) if t.ty(sa[0]).rank() == 0 => {
                            self.opt_plain(sa[0])?.broadcast_to(&[len])?
                        }
                        Some((Op::Full { value, ty }, _)) => self.g.full(*value, ty.dtype, &[len]),
                        _ => {
                            return Err(self.err(format!(
                                "ZeRO-1 cannot shard optimizer node {n} ({}) of parameter `{}`: operand {a} ({}) is \
                                 neither a piece of the parameter nor a broadcast scalar",
                                node.op.name(),
                                name(&gi),
                                t.ty(*a)
                            )));
                        }
                    }
                }
            });
        }
        let argr: Vec<&Tensor> = args.iter().collect();
        if node.op.is_elementwise() {
            let outs = self.g.apply(node.op.clone(), &argr)?;
            for (o, v) in node.outs.iter().zip(outs) {
                self.sh.insert(*o, Sh::Piece(gi, Some(v)));
            }
        } else if is_sum_all(&node.op) {
            let s = self.g.apply(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &argr)?.remove(0);
            self.sh.insert(node.outs[0], Sh::Partial(Some(s)));
        } else {
            return Err(self.err(format!(
                "ZeRO-1 replays only elementwise optimizer ops and sums of every element; node {n} ({}) of \
                 parameter `{}` is neither",
                node.op.name(),
                name(&gi)
            )));
        }
        Ok(())
    }

    /// The piece of old value `v` (an update of gradient `gi`'s parameter or state).
    fn piece_of(&self, v: ValueId, gi: usize, what: &str) -> Result<Option<Tensor>> {
        match self.sh.get(&v) {
            Some(Sh::Piece(g, p)) if *g == gi => Ok(p.clone()),
            _ => Err(self.err(format!(
                "the update of {what} of `{}` is not an elementwise function of its gradient",
                self.plan.grads[gi].param
            ))),
        }
    }

    fn update_of(&self, input: usize) -> Result<ValueId> {
        let of = self.t.inputs[input].value;
        self.t
            .outputs
            .iter()
            .find(|o| o.role == OutputRole::Update { of })
            .map(|o| o.value)
            .ok_or_else(|| self.err(format!("`{}` has no update output", self.t.inputs[input].name)))
    }

    /// ZeRO-1: every bucket's updated parameter shard all-gathered and split back; old
    /// parameter value -> its new value.
    fn gather_params(&mut self) -> Result<HashMap<ValueId, Tensor>> {
        let DataParallel { world, rank, .. } = self.dp();
        let mut out = HashMap::new();
        for (b, bucket) in self.plan.buckets.clone().iter().enumerate() {
            let r = bucket.shard_range(world, rank);
            let pty = self.plan.grads[bucket.members[0].grad].param_ty.dtype;
            let mut parts = Vec::new();
            for m in &bucket.members {
                let f = &self.found[m.grad];
                let info = &self.plan.grads[m.grad];
                if info.param_ty.dtype != pty {
                    return Err(self.err(format!(
                        "ZeRO-1 bucket {b} mixes parameter dtypes {pty} and {} (`{}`)",
                        info.param_ty.dtype, info.param
                    )));
                }
                if let Some(p) = self.piece_of(self.update_of(f.param)?, m.grad, "the parameter")? {
                    parts.push(p);
                }
            }
            if r.end > bucket.numel {
                parts.push(self.g.full(0.0, pty, &[r.end - r.start.max(bucket.numel)]));
            }
            let shard =
                if parts.len() == 1 { parts.remove(0) } else { Tensor::concat(&parts.iter().collect::<Vec<_>>(), 0)? };
            let all = self.collective(CollectiveOp::AllGather, &shard)?;
            for m in &bucket.members {
                let info = &self.plan.grads[m.grad];
                let p = slice_or_all(&all, m.offset, m.offset + m.numel)?.reshape(info.param_ty.dims())?;
                out.insert(self.t.inputs[self.found[m.grad].param].value, p);
            }
        }
        Ok(out)
    }

    /// ZeRO-1: the new shard states (value, name, role), in `shard_states` order.
    fn shard_state_updates(&mut self) -> Result<Vec<(Tensor, String, OutputRole)>> {
        let DataParallel { world, rank, .. } = self.dp();
        let mut out = Vec::new();
        for s in self.plan.shard_states.clone() {
            let bucket = &self.plan.buckets[s.bucket];
            let r = bucket.shard_range(world, rank);
            let input = self.shard_inputs[s.bucket][s.slot].clone();
            let mut parts = Vec::new();
            for m in &bucket.members {
                let st = self.found[m.grad].states[s.slot];
                if let Some(p) = self.piece_of(self.update_of(st)?, m.grad, "a state")? {
                    parts.push(p);
                }
            }
            if r.end > bucket.numel {
                parts.push(slice_or_all(&input, r.start.max(bucket.numel) - r.start, r.len())?);
            }
            let new =
                if parts.len() == 1 { parts.remove(0) } else { Tensor::concat(&parts.iter().collect::<Vec<_>>(), 0)? };
            out.push((new, format!("new.{}", s.name), OutputRole::Update { of: input.id() }));
        }
        Ok(out)
    }
}

/// `x[start..end]` of a flat `x`, or `x` itself when that is all of it.
fn slice_or_all(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    if start == 0 && end == x.dims()[0] { Ok(x.clone()) } else { x.slice(0, start, end) }
}
