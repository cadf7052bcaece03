//! The one compile entry point: a traced step in, a planned program out.
//!
//! [`compile`] runs, in order: the cleanup and fusion passes ([`PIPELINE`]), the choices
//! ([`choose`]: variants of the trace, each scheduled, rematerialised where a memory budget
//! needs it, placed, and priced by the cost model, `crate::cost`; the [`Budget`] picks one),
//! and the memory planner (`crate::plan::plan_order`), with each node's backend scratch
//! ([`crate::plan::BackendScratch`] in [`PlanOptions`]). Every caller
//! (the trainer, shape buckets, the CUDA executor, `rumble plan`, `rumble bench`) goes through
//! it, so a choice made here is made for all of them. [`plan`] is the same without the passes
//! (a trace that is already clean), and [`optimize`] the passes alone (executors that run a
//! trace without a plan, like the CPU evaluator).
//!
//! This module sits above `passes` and `plan`: it calls both; the planner calls no pass.

use crate::Result;
pub mod choose;

use std::sync::Arc;

pub use choose::Budget;

use crate::cost::{Cost, CostModel, Roofline, step_node_times};
use crate::ir::{Trace, verify};
use crate::passes::data_parallel::{DataParallel, data_parallel};
use crate::passes::remat::{Remat, remat_costed};
use crate::passes::schedule::schedule;
use crate::passes::{self, Pass, PassLog};
use crate::plan::lifetimes::Lifetimes;
use crate::plan::report::OpTime;
use crate::plan::{LifetimeOptions, MemoryPlan, PlanOptions, PlanReport, Planned, plan_order};

/// The passes a step goes through before it is planned: dead code, common subexpressions (the
/// optimizer's shared scalars, repeated broadcasts), dead code again, widening casts and adds
/// folded into the matmuls (and norm backwards) they read (a broadcast bias read as its row),
/// a decode step's rotations folded into its cache write and attention, a layer's two cache
/// writes joined into one node, and its norms and swiglus into the projections reading them (a
/// layer's q, k and v then one node), the fused loss and its backward as one node, elementwise
/// fusion.
pub const PIPELINE: &[Pass] = &[
    ("dce", passes::dce),
    ("cse", passes::cse),
    ("dce", passes::dce),
    ("fold_casts", passes::fold_casts),
    ("fold_addends", passes::fold_addends),
    ("fold_row_addends", passes::fold_row_addends),
    ("fold_norm_addends", passes::fold_norm_addends),
    ("fold_rope_at", passes::fold_rope_at),
    ("fold_cache_writes", passes::fold_cache_writes),
    ("fold_prologues", passes::fold_prologues),
    ("fold_projections", passes::fold_projections),
    ("fold_loss_grad", passes::fold_loss_grad),
    ("fuse", passes::fuse),
];

/// The passes' decode folds whose worth depends on the kernels: a norm or swiglu made inside
/// the projections that read it (`fold_prologues`, then `fold_projections` joining them). Where
/// they fold anything, [`compile`] also weighs the step with only the norms folded, with only
/// the swiglus, and with neither (by the cost model: on the device, each node timed there), and
/// keeps the fastest.
const KERNEL_FOLDS: [&str; 2] = ["fold_prologues", "fold_projections"];

/// The alternatives of [`KERNEL_FOLDS`]: what stands for `fold_prologues` (`None`: it and
/// `fold_projections` left out), and the label.
const PARTIAL_FOLDS: [(Option<Pass>, &str); 3] = [
    (Some(("fold_prologues", passes::fold_norm_prologues)), "swiglus unfolded"),
    (Some(("fold_prologues", passes::fold_swiglu_prologues)), "norms unfolded"),
    (None, "norms and swiglus unfolded"),
];

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
    /// What the peak must respect; [`compile`] picks the fastest plan that does.
    pub budget: Budget,
    /// Weigh variants (the fused loss's chunk rows) by the cost model; off keeps the trace's.
    pub choose: bool,
    /// Predicted node times; `None`: the roofline of an H200 (`cost::DeviceRates::h200`).
    pub cost: Option<Cost>,
    /// The device's free memory, for [`Budget::Auto`] (`None` on the CPU).
    pub free_bytes: Option<usize>,
    /// Make the step rank `rank` of a data-parallel program (`passes::data_parallel`), before
    /// [`PIPELINE`] and with it (so only where `passes` is on).
    pub data_parallel: Option<DataParallel>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            passes: true,
            schedule: true,
            remat: Remat::Off,
            plan: PlanOptions::default(),
            budget: Budget::Fastest,
            choose: true,
            cost: None,
            free_bytes: None,
            data_parallel: None,
        }
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
    /// Predicted seconds of one step (`report.predicted_ms` too).
    pub seconds: f64,
}

impl Compiled {
    /// The timeline picture (SVG) of this plan.
    pub fn svg(&self) -> String {
        crate::plan::svg::timeline(&self.trace, &self.lifetimes, &self.report)
    }
}

/// Compiles `trace` as `opts` asks: passes, choices under the budget (schedule,
/// rematerialisation, plan of each variant), the chosen plan.
pub fn compile(trace: &Trace, opts: &CompileOptions) -> Result<Compiled> {
    let (t, logs) = optimize(trace, opts)?;
    let cost: Cost = opts.cost.clone().unwrap_or_else(|| Arc::new(Roofline::default()));
    let opts = CompileOptions { cost: Some(cost.clone()), ..opts.clone() };
    let folded = logs.iter().any(|l| KERNEL_FOLDS.contains(&l.pass) && l.nodes_after != l.nodes_before);
    let mut alts = vec![(t, String::new())];
    let mut logs = vec![logs];
    if opts.choose && folded {
        for (with, label) in PARTIAL_FOLDS {
            let pipeline: Vec<Pass> = PIPELINE
                .iter()
                .filter_map(|p| match (p.0, with) {
                    ("fold_prologues", w) => w,
                    ("fold_projections", None) => None,
                    _ => Some(*p),
                })
                .collect();
            let (u, ulogs) = optimize_with(trace, &opts, &pipeline)?;
            // A kind the step does not fold gives the same trace as another alternative.
            if alts.iter().any(|(a, _)| *a == u) {
                continue;
            }
            alts.push((u, label.to_string()));
            logs.push(ulogs);
        }
    }
    let (pick, weighed) = choose::choose(&alts, &opts, cost.as_ref())?;
    let logs = logs.swap_remove(pick.alt());
    let Planned { trace, plan, lifetimes, mut report } = pick.planned;
    report.predicted_ms = Some(pick.seconds * 1e3);
    report.cost_model = cost.describe();
    report.budget = opts.budget.to_string();
    if !pick.label.is_empty() {
        report.chosen = pick.label.clone();
    }
    if weighed.len() > 1 {
        report.weighed = weighed;
    }
    report.predicted_by_op = by_op(&trace, cost.as_ref());
    Ok(Compiled { trace, plan, lifetimes, report, passes: logs, seconds: pick.seconds })
}

/// The cost model's time for `trace` by op, slowest first (ties by name).
fn by_op(trace: &Trace, cost: &dyn CostModel) -> Vec<OpTime> {
    let mut ops: Vec<OpTime> = Vec::new();
    for (n, s) in trace.nodes.iter().zip(step_node_times(cost, trace)) {
        let op = n.op.name();
        match ops.iter_mut().find(|t| t.op == op) {
            Some(t) => {
                t.nodes += 1;
                t.ms += s * 1e3;
            }
            None => ops.push(OpTime { op: op.to_string(), nodes: 1, ms: s * 1e3 }),
        }
    }
    ops.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.op.cmp(&b.op)));
    ops
}

/// The trace-level part of [`compile`]: if `opts.passes`, the rank program of
/// `opts.data_parallel` (when set), then [`PIPELINE`]; nothing else.
pub fn optimize(trace: &Trace, opts: &CompileOptions) -> Result<(Trace, Vec<PassLog>)> {
    optimize_with(trace, opts, PIPELINE)
}

/// [`optimize`] with `pipeline` for [`PIPELINE`].
fn optimize_with(trace: &Trace, opts: &CompileOptions, pipeline: &[Pass]) -> Result<(Trace, Vec<PassLog>)> {
    if !opts.passes {
        return Ok((trace.clone(), Vec::new()));
    }
    match &opts.data_parallel {
        Some(dp) => passes::run(&data_parallel(trace, dp)?.0, pipeline),
        None => passes::run(trace, pipeline),
    }
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
        let (s, r) = remat_costed(&t, opts.remat, opts.plan.workspace_bytes + most, lt_opts, opts.cost.as_deref())?;
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
