//! The lockstep CPU simulator of data-parallel training: runs every rank's trace together, in
//! one process, and carries out their collectives.
//!
//! Each rank runs its nodes on the CPU reference (`cpu::run_op`) up to its next collective;
//! when every rank waits at one, the simulator checks that they are the same collective
//! (op, world, operand type; rank `r`'s trace is `traces[r]` and says `rank=r`), exchanges the
//! buffers and lets every rank go on by `cpu::collective::combine`'s rule (sums in rank order
//! in f64, rounded once to the operand dtype), so a simulation is deterministic (NCCL's ring order rounds differently; with
//! `world = 1` every collective is exact).

use crate::cpu::{self, HostTensor};
use crate::ir::{Op, TensorType, Trace};
use crate::{Error, Result};

/// Runs `traces[r]` on `inputs[r]` for every rank `r < world` in lockstep; returns each rank's
/// outputs in its trace's output order.
pub fn simulate(world: usize, traces: &[Trace], inputs: &[Vec<HostTensor>]) -> Result<Vec<Vec<HostTensor>>> {
    if world == 0 || traces.len() != world || inputs.len() != world {
        return Err(Error::msg(format!(
            "simulate: world {world} needs one trace and one input list per rank, got {} and {}",
            traces.len(),
            inputs.len()
        )));
    }
    let mut ranks = Vec::with_capacity(world);
    for (r, (t, inp)) in traces.iter().zip(inputs).enumerate() {
        crate::ir::verify(t)?;
        cpu::check_inputs(t, inp)?;
        let mut vals = vec![None; t.num_values()];
        for (i, x) in t.inputs.iter().zip(inp) {
            vals[i.value.index()] = Some(x.bytes.clone());
        }
        for n in &t.nodes {
            if let Op::Collective { world: w, rank, op } = &n.op
                && (*w != world || *rank != r)
            {
                return Err(Error::msg(format!(
                    "simulate: trace `{}` is run as rank {r} of {world} but holds {}(world={w}, rank={rank})",
                    t.name,
                    op.name()
                )));
            }
        }
        ranks.push(Rank { trace: t, vals, pc: 0 });
    }
    loop {
        for r in ranks.iter_mut() {
            r.run_to_collective()?;
        }
        let done: Vec<bool> = ranks.iter().map(|r| r.pc == r.trace.nodes.len()).collect();
        if done.iter().all(|d| *d) {
            break;
        }
        if let Some(r) = done.iter().position(|d| *d) {
            let w = done.iter().position(|d| !*d).unwrap_or(0);
            return Err(Error::msg(format!(
                "simulate: rank {r} ended while rank {w} waits at {} (node {})",
                ranks[w].node().op.name(),
                ranks[w].pc
            )));
        }
        exchange(&mut ranks)?;
    }
    ranks
        .iter()
        .map(|r| {
            r.trace
                .outputs
                .iter()
                .map(|o| {
                    let bytes = r.vals[o.value.index()].clone().ok_or_else(|| {
                        Error::runtime(
                            "simulate",
                            format!("output \"{}\" of `{}` was not computed", o.name, r.trace.name),
                        )
                    })?;
                    HostTensor::new(r.trace.ty(o.value).clone(), bytes)
                })
                .collect()
        })
        .collect()
}

/// One rank's interpreter: its values and the next node to run.
struct Rank<'a> {
    trace: &'a Trace,
    vals: Vec<Option<Vec<u8>>>,
    pc: usize,
}

impl Rank<'_> {
    fn node(&self) -> &crate::ir::Node {
        &self.trace.nodes[self.pc]
    }
    fn arg(&self, v: crate::ir::ValueId) -> Result<&[u8]> {
        self.vals[v.index()].as_deref().ok_or_else(|| Error::runtime("simulate", format!("{v} is not computed")))
    }
    /// Runs nodes until the next collective (left unrun) or the end.
    fn run_to_collective(&mut self) -> Result<()> {
        while self.pc < self.trace.nodes.len() {
            let node = &self.trace.nodes[self.pc];
            if matches!(node.op, Op::Collective { .. }) {
                return Ok(());
            }
            let args = node.args.iter().map(|a| self.arg(*a)).collect::<Result<Vec<_>>>()?;
            let outs = cpu::run_op(&node.op, &self.trace.arg_types(node), &args, &self.trace.out_types(node)).map_err(
                |e| Error::runtime(node.op.name(), format!("node {} of `{}`: {e}", self.pc, self.trace.name)),
            )?;
            for (o, b) in node.outs.iter().zip(outs) {
                self.vals[o.index()] = Some(b);
            }
            self.pc += 1;
        }
        Ok(())
    }
}

/// Every rank waits at a collective: checks they agree, computes it, moves every rank on.
fn exchange(ranks: &mut [Rank]) -> Result<()> {
    let first = ranks[0].node();
    let Op::Collective { op, .. } = first.op else { unreachable!("run_to_collective stops at collectives") };
    let ty: TensorType = ranks[0].trace.ty(first.args[0]).clone();
    for (r, rk) in ranks.iter().enumerate() {
        let n = rk.node();
        let same = matches!(n.op, Op::Collective { op: o, .. } if o == op);
        if !same || *rk.trace.ty(n.args[0]) != ty {
            return Err(Error::msg(format!(
                "simulate: collectives differ: rank 0 runs {}({ty}) as its collective, rank {r} runs {}({})",
                op.name(),
                n.op.name(),
                rk.trace.ty(n.args[0])
            )));
        }
    }
    let parts: Vec<&[u8]> = ranks.iter().map(|rk| rk.arg(rk.node().args[0])).collect::<Result<_>>()?;
    let results = cpu::collective::combine(op, ty.dtype, &parts)?;
    for (rk, res) in ranks.iter_mut().zip(results) {
        let node = &rk.trace.nodes[rk.pc];
        rk.vals[node.outs[0].index()] = Some(res);
        rk.pc += 1;
    }
    Ok(())
}
