//! Passes: `Trace -> Trace` rewrites. Each keeps the program's meaning, returns a verified,
//! compact trace, and can be run through [`run`], which logs who made each trace, how long it
//! took and what it changed.
//!
//! - [`dce`], [`cse`]: dead code and common subexpressions;
//! - [`fold_casts`], [`fold_addends`]: a widening cast or an add folded into the matmul it reads;
//! - [`fold_row_addends`]: a matmul's addend that is a broadcast row read as the row itself;
//! - [`fold_norm_addends`]: an add folded into the `rms_norm_backward` whose `dx` it reads;
//! - [`fold_rope_at`]: a `rope_at` folded into the `cache_write` or `attention_cached` that reads it;
//! - [`fold_cache_writes`]: a layer's key and value `cache_write`s joined into one node;
//! - [`fold_prologues`]: a decode step's `rms_norm` or `swiglu_packed` folded into the
//!   projections that read it (`matmul_pre`), and [`fold_projections`]: such projections of the
//!   same rows joined into one node;
//! - [`fold_loss_grad`]: the fused loss and its backward as one node (the logits computed once);
//! - [`fuse`]: elementwise fusion;
//! - [`schedule`]: a memory-aware topological reorder that lowers LOAD;
//! - [`remat`]: recompute cheap forward values in the backward instead of saving them;
//! - [`data_parallel`]: a training step split over ranks, with collectives (bucket plan).

mod cse;
pub mod data_parallel;
mod dce;
mod fold;
mod fuse;
mod loss;
pub mod remat;
pub mod schedule;

use std::time::Instant;

pub use cse::cse;
pub use dce::dce;
pub use fold::{
    PROJECTIONS, PROLOGUE_ROWS, fold_addends, fold_cache_writes, fold_casts, fold_norm_addends, fold_norm_prologues,
    fold_projections, fold_prologues, fold_rope_at, fold_row_addends, fold_swiglu_prologues,
};
pub use fuse::fuse;
pub use loss::fold_loss_grad;

use crate::Result;
use crate::ir::{Trace, verify};

/// `t` without the nodes `drop` marks, compacted: what a fold returns once the nodes it
/// merged away are marked.
fn without(mut t: Trace, drop: &[bool]) -> Result<Trace> {
    let mut i = 0;
    t.nodes.retain(|_| {
        i += 1;
        !drop[i - 1]
    });
    t.compact()?;
    Ok(t)
}

/// A named pass.
pub type Pass = (&'static str, fn(&Trace) -> Result<Trace>);

/// What one pass did.
#[derive(Clone, Debug)]
pub struct PassLog {
    pub pass: &'static str,
    pub micros: u128,
    pub nodes_before: usize,
    pub nodes_after: usize,
}

impl std::fmt::Display for PassLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:<12} {:>6} -> {:>6} nodes  {:>8} us", self.pass, self.nodes_before, self.nodes_after, self.micros)
    }
}

/// Runs `passes` in order, verifying after each one.
pub fn run(trace: &Trace, passes: &[Pass]) -> Result<(Trace, Vec<PassLog>)> {
    let mut t = trace.clone();
    let mut logs = Vec::new();
    for (name, pass) in passes {
        let start = Instant::now();
        let next = pass(&t)?;
        verify(&next)?;
        logs.push(PassLog {
            pass: name,
            micros: start.elapsed().as_micros(),
            nodes_before: t.nodes.len(),
            nodes_after: next.nodes.len(),
        });
        t = next;
    }
    Ok((t, logs))
}

/// The default cleanup: dead code, then common subexpressions, then dead code again.
pub const CLEANUP: &[Pass] = &[("dce", dce), ("cse", cse), ("dce", dce)];
