//! ZeRO-1's replay of the optimizer on this rank's flat shard (see the module docs of
//! `data_parallel`): gradients, parameters and states as flat pieces, sums of every element
//! as partial sums all-reduced where read, the updated shards all-gathered.

use std::collections::{HashMap, HashSet};

use super::rewrite::{Rewriter, Sh, slice_or_all};
use crate::Result;
use crate::ir::{BinaryOp, CollectiveOp, Def, Op, OutputRole, Phase, ReduceOp, Tensor, ValueId};
use crate::passes::data_parallel::DataParallel;

impl Rewriter<'_> {
    /// ZeRO-1's view of old `v` read by an optimizer node (a parameter or state becomes a piece
    /// the first time it is read).
    pub(super) fn sharded(&mut self, v: ValueId) -> Result<Option<Sh>> {
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
    pub(super) fn zero1_node(&mut self, n: usize) -> Result<()> {
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
            matches!(op, Op::Reduce { op: ReduceOp::Sum | ReduceOp::SumSquares, axes, keepdim: false }
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
        } else if let Op::Reduce { op, .. } = &node.op
            && is_sum_all(&node.op)
        {
            let s = self.g.apply(Op::Reduce { op: *op, axes: vec![0], keepdim: false }, &argr)?.remove(0);
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
    pub(super) fn gather_params(&mut self) -> Result<HashMap<ValueId, Tensor>> {
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
    pub(super) fn shard_state_updates(&mut self) -> Result<Vec<(Tensor, String, OutputRole)>> {
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
