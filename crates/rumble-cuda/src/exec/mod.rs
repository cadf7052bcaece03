//! Three executors over one compiled [`Program`] (a trace, its memory plan and every node's
//! prepared [`Recipe`]):
//!
//! - [`EagerExecutor`]: op by op, each value from a caching allocator and freed after its last
//!   use: the baseline for memory and time;
//! - [`PlannedExecutor`]: op by op in the plan's one arena and persistent region;
//! - [`GraphedExecutor`]: the planned launches captured into CUDA graphs (the whole step, or
//!   forward and backward as two graphs over the same arena) and replayed, inputs and returned
//!   outputs moving through pinned host buffers inside the graphs;
//! - [`BucketedGraphs`]: several programs of one model (shape buckets: another batch or
//!   sequence length) as graphs captured on first use, over one shared arena and persistent
//!   region (`buckets.rs`).
//!
//! All three launch the same recipes in the same order, so they compute the same bits.
//!
//! **Scratch.** A recipe's own scratch (`Recipe::scratch`: cuBLASLt's workspace, attention's
//! delta rows, split reductions' partials, cross-entropy's statistics) is planned per node:
//! [`Program::plan_options`] hands the planner a `BackendScratch` that prepares each node's
//! recipe, and the plan gives every node one scratch range live at its step only, the op's
//! part (`Op::scratch_bytes`, [`crate::launch::Arg::Node`]) first and the recipe's part
//! ([`crate::launch::Arg::Scratch`], `MemoryPlan::backend_scratch_slot`) after it. The plan's
//! whole-step workspace is then 0. A plan made with only a workspace size
//! ([`Program::compile`] with `plan_naive` or `plan_in_order`) still runs: a node with no
//! backend part of its own uses the workspace at the end of the arena. The eager executor
//! allocates each node's scratch while the node runs.
//! Persistent inputs (params, optimizer state) are given once when an executor is built; each
//! step takes the other inputs, in trace order. `Update` outputs are written back to their
//! input's persistent buffer at the end of the step (unless the plan computed them there).

/// The [`Executor`] methods the planned and graphed executors share: both hold a `placed:
/// Placed` (the program over its arena) and `rise` (the most the device's use rose in a step).
macro_rules! placed_executor_methods {
    () => {
        type Error = CudaError;

        fn device(&self) -> DeviceKind {
            DeviceKind::Cuda
        }
        fn persistent_names(&self) -> Vec<String> {
            self.placed.prog.persistent_names()
        }
        fn output(&self, name: &str) -> Result<HostTensor> {
            self.placed.output(name)
        }
        fn persistent(&self, name: &str) -> Result<HostTensor> {
            self.placed.persistent_value(name)
        }
        fn memory(&self) -> MemoryStats {
            MemoryStats { device_rise_bytes: self.rise, ..self.placed.stats() }
        }
    };
}

mod buckets;
mod eager;
mod graphed;
mod planned;
mod probe;
mod side;

use std::sync::Arc;

use rumble_core::compile::CompileOptions;
use rumble_core::cost::{Cost, DeviceRates, Roofline};
use rumble_core::cpu::HostTensor;
use rumble_core::ir::{InputRole, OutputRole, Trace, ValueId, verify};
use rumble_core::plan::{BackendScratch, MemoryPlan, PlanOptions, Region};

use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::launch::Recipe;
use crate::recipe::prepare;

pub use buckets::{BucketedGraphs, bucket_taking, check_shared_layout, check_step_inputs, step_inputs};
pub use eager::EagerExecutor;
pub use graphed::{GraphMode, GraphedExecutor};
pub use planned::PlannedExecutor;
pub use probe::{
    DeviceCost, MAX_SLOWDOWN, PART_LOAD_KEY, PART_SLOWDOWN_KEY, PROBE_MEMORY_FRACTION, PROBE_RUNS, RATE_KEY,
    SLOWDOWN_KEY, probe,
};
pub use side::SideStream;

// The one executor trait and its figures live in rumble-core; every executor here implements it.
pub use rumble_core::exec::{BucketStats, DeviceKind, Executor, MemoryStats};

/// A trace ready to run on one device: its plan and every node's prepared launches.
pub struct Program {
    pub dev: Arc<Device>,
    pub trace: Trace,
    pub plan: MemoryPlan,
    pub recipes: Vec<Recipe>,
    /// The most recipe scratch (`Recipe::scratch`) any node needs.
    pub scratch_bytes: usize,
    /// For each value, the last node that reads it (`None`: no node reads it).
    pub last_use: Vec<Option<usize>>,
    /// Seconds spent preparing (compiling kernels, choosing matmul algorithms).
    pub prepare_secs: f64,
    /// The stream and events of collectives of several ranks, which run beside the step up to
    /// their joins (`side.rs`); `None` without them.
    side: Option<side::SideStream>,
}

impl Program {
    /// The most recipe scratch any node of `trace` needs on `dev`: the whole-step workspace a
    /// planner that takes only a size must reserve ([`Program::compile`]).
    pub fn workspace_bytes(dev: &Device, trace: &Trace) -> Result<usize> {
        let mut most = 0;
        for node in &trace.nodes {
            let at: Vec<_> = node.args.iter().map(|a| trace.ty(*a)).collect();
            let ot: Vec<_> = node.outs.iter().map(|o| trace.ty(*o)).collect();
            most = most.max(prepare(dev, &node.op, &at, &ot)?.scratch);
        }
        Ok(most)
    }

    /// Planner options that plan each node's recipe scratch on `dev` as part of that node's
    /// scratch range (`PlanOptions::backend_scratch`), `base`'s otherwise. A node the CUDA
    /// backend cannot prepare fails planning with the reason.
    pub fn plan_options(dev: &Arc<Device>, base: &PlanOptions) -> PlanOptions {
        let dev = dev.clone();
        let backend = BackendScratch::new(move |op, at, ot| match prepare(&dev, op, at, ot) {
            Ok(r) => Ok(r.scratch),
            Err(e) => Err(rumble_core::Error::msg(e.to_string())),
        });
        PlanOptions { backend_scratch: Some(backend), ..base.clone() }
    }

    /// `base` made for `dev`: each node's recipe scratch planned with the node
    /// ([`Program::plan_options`]), the device's free memory (for `Budget::Auto`), and, unless
    /// `base` has one, the device's cost model ([`DeviceCost`]: node times measured on this
    /// device, probed on first use and remembered in the kernel cache folder, over an H200's
    /// roofline with this device's multiprocessors; the roofline alone without a cache folder).
    pub fn compile_options(dev: &Arc<Device>, base: &CompileOptions) -> Result<CompileOptions> {
        let cost = base.cost.clone().or_else(|| {
            let rates =
                DeviceRates { name: dev.name.clone(), multiprocessors: dev.multiprocessors, ..DeviceRates::h200() };
            let m: Cost = match dev.knobs().cache {
                Some(_) => Arc::new(DeviceCost::new(dev.clone(), rates)),
                None => Arc::new(Roofline::new(rates)),
            };
            Some(m)
        });
        Ok(CompileOptions {
            plan: Self::plan_options(dev, &base.plan),
            free_bytes: base.free_bytes.or(Some(dev.mem_info()?.0)),
            cost,
            ..base.clone()
        })
    }

    /// Records measured device seconds of whole nodes (`(node, seconds)`, as `--profile` times
    /// them) for the cost model, keyed by `cost::node_key`, in the kernel cache folder. The
    /// fused loss is left out: its variants (chunk rows) are weighed against each other, so it
    /// is priced from its matmuls' measured times, never half measured and half estimated.
    pub fn record_times(&self, times: &[(usize, f64)]) -> std::io::Result<()> {
        let Some(dir) = self.dev.knobs().cache else { return Ok(()) };
        let t = &self.trace;
        let lines: Vec<(String, f64)> = times
            .iter()
            .filter_map(|&(n, s)| {
                let node = t.nodes.get(n)?;
                if matches!(
                    node.op,
                    rumble_core::ir::Op::LinearCrossEntropy { .. }
                        | rumble_core::ir::Op::LinearCrossEntropyBackward { .. }
                        | rumble_core::ir::Op::LinearCrossEntropyGrad { .. }
                ) {
                    return None;
                }
                let at: Vec<_> = node.args.iter().map(|a| t.ty(*a)).collect();
                let ot: Vec<_> = node.outs.iter().map(|o| t.ty(*o)).collect();
                Some((probe::device_node_key(&self.dev, &node.op, &at, &ot), s))
            })
            .collect();
        rumble_core::cost::record(&dir, &self.dev.name, &lines)
    }

    /// Plans `trace` with `planner(trace, workspace_bytes)` (e.g. `plan_in_order`, or
    /// `|t, ws| Ok(plan_naive(t, ws))`) and prepares it. The scratch is then one whole-step
    /// workspace of the most any node needs; [`Program::planned`] plans it per node instead.
    pub fn compile(
        dev: Arc<Device>,
        trace: Trace,
        planner: impl Fn(&Trace, usize) -> rumble_core::Result<MemoryPlan>,
    ) -> Result<Program> {
        let ws = Self::workspace_bytes(&dev, &trace)?;
        let plan = planner(&trace, ws)?;
        Self::new(dev, trace, plan)
    }

    /// Plans `trace` with the core planner (`compile::plan`: memory-aware schedule, views,
    /// in-place results, best-fit reuse, each node's recipe scratch planned as part of its
    /// scratch range: [`Program::plan_options`]) and prepares the trace as planned (its node
    /// order may differ).
    pub fn planned(dev: Arc<Device>, trace: &Trace, opts: &PlanOptions) -> Result<Program> {
        let opts = CompileOptions { plan: Self::plan_options(&dev, opts), ..Default::default() };
        let planned = rumble_core::compile::plan(trace, &opts)?;
        Self::new(dev, planned.trace, planned.plan)
    }

    /// Where node `n`'s recipe scratch lies in the arena, `(offset, bytes)`: the backend part of
    /// its scratch range, or the plan's whole-step workspace if it has none.
    pub fn scratch_range(&self, n: usize) -> (usize, usize) {
        match self.plan.backend_scratch_slot(n) {
            Some(s) => (s.offset, s.bytes),
            None => (self.plan.workspace_offset(), self.plan.workspace_bytes),
        }
    }

    /// Prepares every node of `trace` (compiling kernels) and checks `plan` against it.
    pub fn new(dev: Arc<Device>, trace: Trace, plan: MemoryPlan) -> Result<Program> {
        let t0 = std::time::Instant::now();
        verify(&trace)?;
        let mut recipes = Vec::with_capacity(trace.nodes.len());
        for (n, node) in trace.nodes.iter().enumerate() {
            let at: Vec<_> = node.args.iter().map(|a| trace.ty(*a)).collect();
            let ot: Vec<_> = node.outs.iter().map(|o| trace.ty(*o)).collect();
            let r = prepare(&dev, &node.op, &at, &ot).map_err(|e| match e {
                CudaError::Unsupported(w) => CudaError::Unsupported(format!("node {n}: {w}")),
                other => other,
            })?;
            recipes.push(r);
        }
        let scratch_bytes = recipes.iter().map(|r| r.scratch).max().unwrap_or(0);
        let mut last_use = vec![None; trace.num_values()];
        for (n, node) in trace.nodes.iter().enumerate() {
            for a in &node.args {
                last_use[a.index()] = Some(n);
            }
        }
        dev.bind()?;
        let side = side::SideStream::new(&rumble_core::ir::collective_joins(&trace), trace.nodes.len())?;
        let p = Program { dev, trace, plan, recipes, scratch_bytes, last_use, prepare_secs: 0.0, side };
        p.check_plan()?;
        Ok(Program { prepare_secs: t0.elapsed().as_secs_f64(), ..p })
    }

    fn check_plan(&self) -> Result<()> {
        let (t, p) = (&self.trace, &self.plan);
        let bad = |m: String| CudaError::usage(format!("plan of `{}`: {m}", t.name));
        if p.slots.len() < t.num_values() {
            return Err(bad(format!("{} slots for {} values", p.slots.len(), t.num_values())));
        }
        if p.scratch.len() != t.nodes.len() || p.backend_scratch.len() != t.nodes.len() {
            return Err(bad(format!(
                "{} scratch and {} backend scratch entries for {} nodes",
                p.scratch.len(),
                p.backend_scratch.len(),
                t.nodes.len()
            )));
        }
        for (n, r) in self.recipes.iter().enumerate() {
            let (_, bytes) = self.scratch_range(n);
            if bytes < r.scratch {
                return Err(bad(format!(
                    "node {n} ({}) needs {} bytes of scratch, the plan gives {bytes} (plan with \
                     Program::plan_options, or a workspace of Program::workspace_bytes)",
                    r.op, r.scratch
                )));
            }
            let own = p.scratch[n].map_or(0, |s| s.bytes.saturating_sub(p.backend_scratch[n]));
            if own < r.node_scratch {
                return Err(bad(format!(
                    "node {n} ({}) uses {} bytes of its own scratch, the plan gives {own}",
                    r.op, r.node_scratch
                )));
            }
        }
        let mut values: Vec<ValueId> = t.inputs.iter().map(|i| i.value).collect();
        values.extend(t.nodes.iter().flat_map(|n| n.outs.iter().copied()));
        for v in values {
            let s = p.slot(v)?;
            let limit = if s.region == Region::Arena { p.workspace_offset() } else { p.persistent_bytes };
            if s.bytes < t.ty(v).size_in_bytes() || s.offset + s.bytes > limit {
                return Err(bad(format!("slot {s:?} of {v} ({}) does not fit", t.ty(v))));
            }
        }
        for i in &t.inputs {
            let persistent = p.slot(i.value)?.region == Region::Persistent;
            if persistent != i.role.is_persistent() {
                return Err(bad(format!("input \"{}\" ({}) is in the wrong region", i.name, i.role.name())));
            }
        }
        Ok(())
    }

    /// The persistent inputs' names, in trace order ([`Executor::persistent_names`]).
    pub fn persistent_names(&self) -> Vec<String> {
        self.trace.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| i.name.clone()).collect()
    }

    /// Indices into `trace.inputs` of the persistent inputs and of the per-step inputs.
    pub fn input_split(&self) -> (Vec<usize>, Vec<usize>) {
        (0..self.trace.inputs.len()).partition(|&i| self.trace.inputs[i].role.is_persistent())
    }

    /// Checks `given` against the inputs at `which`.
    fn check_inputs(&self, which: &[usize], given: &[HostTensor], kind: &str) -> Result<()> {
        if which.len() != given.len() {
            return Err(CudaError::usage(format!(
                "trace `{}` takes {} {kind} inputs, got {}",
                self.trace.name,
                which.len(),
                given.len()
            )));
        }
        for (&i, h) in which.iter().zip(given) {
            let inp = &self.trace.inputs[i];
            if h.ty != *self.trace.ty(inp.value) || h.bytes.len() != h.ty.size_in_bytes() {
                return Err(CudaError::usage(format!(
                    "input \"{}\" of `{}` must be {}, got {} ({} bytes)",
                    inp.name,
                    self.trace.name,
                    self.trace.ty(inp.value),
                    h.ty,
                    h.bytes.len()
                )));
            }
        }
        Ok(())
    }

    /// `(value, persistent input)` pairs to copy after the last node: the plan's `copy_back`
    /// (updates it could not compute in their input's slot).
    fn copy_backs(&self) -> Vec<(ValueId, ValueId)> {
        self.plan.copy_back.clone()
    }

    /// True when node `n` computes only views (its outputs alias an operand's bytes): the
    /// planned executors run nothing for it.
    fn is_view_node(&self, n: usize) -> bool {
        let outs = &self.trace.nodes[n].outs;
        !outs.is_empty() && outs.iter().all(|o| self.plan.is_alias(*o))
    }

    /// `(output value, persistent input value)` of every `Update` output.
    fn updates(&self) -> Vec<(ValueId, ValueId)> {
        self.trace
            .outputs
            .iter()
            .filter_map(|o| match o.role {
                OutputRole::Update { of } => Some((o.value, of)),
                _ => None,
            })
            .collect()
    }

    /// Indices into `trace.outputs` of the outputs a step returns (role `Output`).
    fn returned(&self) -> Vec<usize> {
        (0..self.trace.outputs.len()).filter(|&i| self.trace.outputs[i].role == OutputRole::Output).collect()
    }

    fn node_name(&self, n: usize) -> String {
        self.trace.nodes.get(n).map(|x| x.op.name().to_string()).unwrap_or_else(|| "?".into())
    }

    fn output_index(&self, name: &str) -> Result<usize> {
        self.trace
            .outputs
            .iter()
            .position(|o| o.name == name)
            .ok_or_else(|| CudaError::usage(format!("trace `{}` has no output \"{name}\"", self.trace.name)))
    }

    fn persistent_index(&self, name: &str) -> Result<usize> {
        self.trace
            .inputs
            .iter()
            .position(|i| i.name == name && i.role.is_persistent())
            .ok_or_else(|| CudaError::usage(format!("trace `{}` has no param/opt_state \"{name}\"", self.trace.name)))
    }
}

/// Splits all inputs of a trace (in trace order) into (persistent, per-step), the way the
/// executors take them.
pub fn split_inputs(trace: &Trace, all: &[HostTensor]) -> (Vec<HostTensor>, Vec<HostTensor>) {
    let (mut p, mut s) = (Vec::new(), Vec::new());
    for (inp, h) in trace.inputs.iter().zip(all) {
        if inp.role.is_persistent() { p.push(h.clone()) } else { s.push(h.clone()) }
    }
    (p, s)
}

/// Whether an input role is fed each step.
pub fn is_step_input(r: InputRole) -> bool {
    !r.is_persistent()
}
