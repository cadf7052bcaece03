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
//!   gradient (so clipping sees the global norm). An all-reduce needs no equal shards, so DDP
//!   leaves the bucket unpadded.
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
//! The averages are the global mean where every rank counts as many targets (corpus windows);
//! where they do not (prompt tokens masked, padded shape buckets) the step weighs each rank's
//! loss by its share of the counted targets before its backward (`rumble_models`'
//! `StepConfig::loss_weights`, a scalar input the host computes from the global batch).
//! Every pass after this one keeps the collectives in order (`passes::schedule` chains them;
//! `cse`, `dce`, `remat` leave them alone), so compiled rank traces still meet them alike.
//!
//! What an NCCL backend needs from this: the collectives are ordinary nodes with planned
//! operand and result buffers, so each becomes one `ncclAllReduce` / `ncclReduceScatter` /
//! `ncclAllGather` (sum) on a communicator made once per process (`world`, `rank`, the unique
//! id exchanged by the launcher), launched on the step's stream (or a second stream with
//! events, to overlap the backward) and captured in the step's CUDA graph; no buffer of its own.

pub mod buckets;
mod rewrite;
mod zero1;

use std::collections::HashSet;

pub use buckets::{Bucket, GradSpec, Member, plan_buckets};

use crate::cpu::HostTensor;
use crate::ir::{DType, Def, InputRole, Op, OutputRole, Phase, TensorType, Trace, ValueId};
use crate::{Error, Result};
use rewrite::Rewriter;

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

    /// Every input of this rank's trace `rank_trace`, looked up by name among `full`: the
    /// shard of each sharded optimizer state, the value itself for everything else (data
    /// inputs the caller then replaces by this rank's rows).
    pub fn rank_inputs(
        &self,
        rank_trace: &Trace,
        full: &dyn Fn(&str) -> Option<HostTensor>,
    ) -> Result<Vec<HostTensor>> {
        let shards = self.shard_states(full)?;
        rank_trace
            .inputs
            .iter()
            .map(|i| match self.shard_states.iter().position(|s| s.name == i.name) {
                Some(k) => Ok(shards[k].clone()),
                None => full(&i.name).ok_or_else(|| Error::msg(format!("rank_inputs: no input `{}`", i.name))),
            })
            .collect()
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
