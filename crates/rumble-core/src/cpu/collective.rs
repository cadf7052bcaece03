//! The collectives of data-parallel training on host bytes: [`combine`], the rule every host
//! implementation follows (the lockstep simulator, `testing::simulate`, and a process's
//! [`HostComm`]), and the process-global communicator through which the CPU reference runs
//! the collectives of a trace of `world > 1` ranks (one process per rank, as `rumble train`
//! starts them).
//!
//! Sums run in rank order in f64 and are rounded once to the operand dtype, so every rank
//! gets the same bits and a run is deterministic whatever the transport.

use std::sync::{Arc, RwLock};

use super::{read_float, write_float};
use crate::ir::{CollectiveOp, DType};
use crate::{Error, Result};

/// Every rank's result of collective `op` over `parts[r]`, rank `r`'s operand bytes in `dtype`
/// (all the same length; for `ReduceScatter` a multiple of `parts.len()` elements). The
/// results are bytes in `dtype`, in rank order.
pub fn combine(op: CollectiveOp, dtype: DType, parts: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
    let world = parts.len();
    let Some(first) = parts.first() else {
        return Err(Error::runtime(op.name(), "no rank's operand"));
    };
    if let Some(r) = parts.iter().position(|p| p.len() != first.len()) {
        return Err(Error::runtime(
            op.name(),
            format!("rank {r} gives {} bytes, rank 0 gives {}: the ranks' traces differ", parts[r].len(), first.len()),
        ));
    }
    let data: Vec<Vec<f64>> = parts.iter().map(|b| read_float::<f64>(dtype, b)).collect();
    let numel = data[0].len();
    let sum = || {
        let mut acc = vec![0.0f64; numel];
        for d in &data {
            acc.iter_mut().zip(d).for_each(|(a, x)| *a += x);
        }
        acc
    };
    let results: Vec<Vec<f64>> = match op {
        CollectiveOp::AllReduce => vec![sum(); world],
        CollectiveOp::ReduceScatter => {
            if !numel.is_multiple_of(world) {
                return Err(Error::runtime(op.name(), format!("{numel} elements do not split into {world} shards")));
            }
            let s = sum();
            let n = numel / world;
            (0..world).map(|r| s[r * n..(r + 1) * n].to_vec()).collect()
        }
        CollectiveOp::AllGather => vec![data.concat(); world],
    };
    Ok(results.iter().map(|r| write_float::<f64>(dtype, r)).collect())
}

/// A process's link to the other ranks of its run, for the collectives the CPU reference
/// meets in a rank's trace. Every rank calls [`HostComm::collective`] for the same
/// collectives in the same order (the traces guarantee it).
pub trait HostComm: Send + Sync {
    fn world(&self) -> usize;
    fn rank(&self) -> usize;
    /// This rank's result of `op` over every rank's `x` (bytes in `dtype`), by [`combine`]'s
    /// rule; blocks until every rank has given its operand.
    fn collective(&self, op: CollectiveOp, dtype: DType, x: &[u8]) -> Result<Vec<u8>>;
}

static COMM: RwLock<Option<Arc<dyn HostComm>>> = RwLock::new(None);

/// Makes `comm` the process's communicator (replacing any other).
pub fn install(comm: Arc<dyn HostComm>) {
    *COMM.write().unwrap_or_else(|e| e.into_inner()) = Some(comm);
}

/// Removes the process's communicator.
pub fn uninstall() {
    *COMM.write().unwrap_or_else(|e| e.into_inner()) = None;
}

/// The process's communicator, if one is installed.
pub fn comm() -> Option<Arc<dyn HostComm>> {
    COMM.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Runs a collective of a rank's trace (`world`, `rank` from its op) through the installed
/// communicator, which must be that rank's.
pub(super) fn run(op: CollectiveOp, world: usize, rank: usize, dtype: DType, x: &[u8]) -> Result<Vec<u8>> {
    let Some(c) = comm() else {
        return Err(Error::runtime(
            op.name(),
            format!(
                "rank {rank} of {world}: a collective exchanges buffers between ranks and this process has no \
                 communicator (start the ranks with `rumble train --gpus N` or torchrun's variables, or run \
                 every rank's trace through testing::simulate)"
            ),
        ));
    };
    if (c.world(), c.rank()) != (world, rank) {
        return Err(Error::runtime(
            op.name(),
            format!(
                "the trace is rank {rank} of {world}, this process's communicator rank {} of {}",
                c.rank(),
                c.world()
            ),
        ));
    }
    c.collective(op, dtype, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        write_float::<f32>(DType::F32, v)
    }

    #[test]
    fn combine_sums_in_rank_order_and_cuts_shards() {
        let (a, b) = (f32s(&[1.0, 2.0, 3.0, 4.0]), f32s(&[10.0, 20.0, 30.0, 40.0]));
        let parts = [&a[..], &b[..]];
        let all = combine(CollectiveOp::AllReduce, DType::F32, &parts).unwrap();
        assert_eq!(all, vec![f32s(&[11.0, 22.0, 33.0, 44.0]); 2]);
        let rs = combine(CollectiveOp::ReduceScatter, DType::F32, &parts).unwrap();
        assert_eq!(rs, vec![f32s(&[11.0, 22.0]), f32s(&[33.0, 44.0])]);
        let ag = combine(CollectiveOp::AllGather, DType::F32, &parts).unwrap();
        assert_eq!(ag[1], f32s(&[1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]));
        // bf16 operands are summed in f64 and rounded once: 256 + 1 + 1 is 258 (two roundings
        // of 256 + 1 would give 256).
        let bf = |v: f64| write_float::<f64>(DType::BF16, &[v]);
        let (x, y, z) = (bf(256.0), bf(1.0), bf(1.0));
        let s = combine(CollectiveOp::AllReduce, DType::BF16, &[&x, &y, &z]).unwrap();
        assert_eq!(read_float::<f64>(DType::BF16, &s[0]), vec![258.0]);
        let e = combine(CollectiveOp::AllReduce, DType::F32, &[&a, &a[..4]]).unwrap_err().to_string();
        assert!(e.contains("rank 1 gives 4 bytes, rank 0 gives 16"), "{e}");
        let three = [&a[..], &a[..], &a[..]];
        assert!(combine(CollectiveOp::ReduceScatter, DType::F32, &three).unwrap_err().to_string().contains("3 shards"));
    }
}
