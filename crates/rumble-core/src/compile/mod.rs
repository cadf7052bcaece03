//! The one compile entry point: a traced step in, a planned program out.
//!
//! [`compile`] runs, in order: the cleanup and fusion passes ([`PIPELINE`]), the memory-aware
//! schedule, rematerialisation, and the memory planner (`crate::plan::plan_order`), with each
//! node's backend scratch ([`crate::plan::BackendScratch`] in [`PlanOptions`]). Every caller
//! (the trainer, shape buckets, the CUDA executor, `rumble plan`, `rumble bench`) goes through
//! it, so a choice made here is made for all of them. [`plan`] is the same without the passes
//! (a trace that is already clean), and [`optimize`] the passes alone (executors that run a
//! trace without a plan, like the CPU evaluator).
//!
//! This module sits above `passes` and `plan`: it calls both; the planner calls no pass.

use crate::Result;
use crate::ir::{Trace, verify};
use crate::passes::remat::{Remat, remat};
use crate::passes::schedule::schedule;
use crate::passes::{self, Pass, PassLog};
use crate::plan::lifetimes::Lifetimes;
use crate::plan::{LifetimeOptions, MemoryPlan, PlanOptions, PlanReport, Planned, plan_order};

/// The passes a step goes through before it is planned: dead code, common subexpressions (the
/// optimizer's shared scalars, repeated broadcasts), dead code again, elementwise fusion.
pub const PIPELINE: &[Pass] =
    &[("dce", passes::dce), ("cse", passes::cse), ("dce", passes::dce), ("fuse", passes::fuse)];

/// What [`compile`] does besides placing buffers.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Run [`PIPELINE`] first (`compile` only; [`plan`] never runs it).
    pub passes: bool,
    /// Reorder nodes to lower LOAD first (`passes::schedule`).
    pub schedule: bool,
    /// Recompute values in the backward instead of saving them (`passes::remat`).
    pub remat: Remat,
    /// How the planner places buffers (in-place results, scratch, workspace).
    pub plan: PlanOptions,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions { passes: true, schedule: true, remat: Remat::Off, plan: PlanOptions::default() }
    }
}

/// A compiled step: the trace as it will run (after the passes, scheduling and
/// rematerialisation, so its value ids are the ones the plan speaks of), its plan, its
/// lifetimes, the planner's report, and what each pass did.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub trace: Trace,
    pub plan: MemoryPlan,
    pub lifetimes: Lifetimes,
    pub report: PlanReport,
    /// The passes of [`PIPELINE`] (empty without `passes`).
    pub passes: Vec<PassLog>,
}

impl Compiled {
    /// The timeline picture (SVG) of this plan.
    pub fn svg(&self) -> String {
        crate::plan::svg::timeline(&self.trace, &self.lifetimes, &self.report)
    }
}

/// Compiles `trace` as `opts` asks: passes, schedule, rematerialisation, plan.
pub fn compile(trace: &Trace, opts: &CompileOptions) -> Result<Compiled> {
    let (t, logs) = optimize(trace, opts)?;
    let Planned { trace, plan, lifetimes, report } = plan(&t, opts)?;
    Ok(Compiled { trace, plan, lifetimes, report, passes: logs })
}

/// The trace-level part of [`compile`]: [`PIPELINE`] if `opts.passes`, and nothing else.
pub fn optimize(trace: &Trace, opts: &CompileOptions) -> Result<(Trace, Vec<PassLog>)> {
    if opts.passes { passes::run(trace, PIPELINE) } else { Ok((trace.clone(), Vec::new())) }
}

/// Plans `trace` (no [`PIPELINE`]): schedules and rematerialises it as `opts` asks, then places
/// every value. The trace must verify.
pub fn plan(trace: &Trace, opts: &CompileOptions) -> Result<Planned> {
    verify(trace)?;
    let lt_opts = LifetimeOptions { inplace: opts.plan.inplace };
    let mut t = trace.clone();
    let mut logs = Vec::new();
    if opts.schedule {
        let (s, r) = schedule(&t, lt_opts)?;
        t = s;
        logs.push(r);
    }
    if opts.remat != Remat::Off {
        // The budget counts the largest backend scratch as if it were a whole-step workspace
        // (remat's lifetimes do not see it): conservative, never over the budget for it.
        let most = match &opts.plan.backend_scratch {
            Some(b) => b.per_node(&t)?.into_iter().max().unwrap_or(0),
            None => 0,
        };
        let (s, r) = remat(&t, opts.remat, opts.plan.workspace_bytes + most, lt_opts)?;
        let changed = s != t;
        t = s;
        logs.push(r);
        if opts.schedule && changed {
            let (s, r) = schedule(&t, lt_opts)?;
            t = s;
            logs.push(r);
        }
    }
    let mut planned = plan_order(&t, &opts.plan)?;
    planned.report.passes = logs;
    if let Remat::Budget { peak_bytes } = opts.remat {
        planned.report.budget_bytes = Some(peak_bytes);
    }
    Ok(planned)
}
