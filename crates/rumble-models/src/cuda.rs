//! The CUDA executor behind the one [`Executor`] trait: plans the trace with the core
//! planner (memory-aware schedule, in-place updates, one arena), compiles it for the GPU and
//! runs it eagerly, op by op in the arena, or replayed as CUDA graphs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use rumble_core::Trace;
use rumble_core::compile::{CompileOptions, compile};
use rumble_core::cpu::HostTensor;
use rumble_core::exec::{DeviceKind, ExecStats, Executor, MemoryStats};
use rumble_core::plan::PlanReport;
use rumble_cuda::{EagerExecutor, GraphMode, GraphedExecutor, PlannedExecutor, Program};

use crate::error::{ModelError, Result};

/// How the GPU runs the planned program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaMode {
    /// Op by op, each value from a caching allocator (the baseline).
    Eager,
    /// Op by op in the plan's arena.
    Planned,
    /// The whole step captured as one CUDA graph and replayed.
    Graphed,
    /// Forward and backward as two graphs sharing the arena.
    GraphedForwardBackward,
}

impl CudaMode {
    pub const ALL: [CudaMode; 4] =
        [CudaMode::Eager, CudaMode::Planned, CudaMode::Graphed, CudaMode::GraphedForwardBackward];
    pub fn name(self) -> &'static str {
        match self {
            CudaMode::Eager => "eager",
            CudaMode::Planned => "planned",
            CudaMode::Graphed => "graphed",
            CudaMode::GraphedForwardBackward => "graphed-fwd-bwd",
        }
    }
}

/// A training-step trace on the GPU.
pub struct CudaExecutor {
    inner: Box<dyn Executor<Error = rumble_cuda::CudaError>>,
    prog: Arc<Program>,
    report: PlanReport,
    /// The cost model the compile weighed its choices by.
    cost: Option<rumble_core::cost::Cost>,
    /// Seconds spent planning, compiling and capturing.
    pub build_secs: f64,
}

impl CudaExecutor {
    /// Plans `trace` (already through `compile::PIPELINE`), compiles it on device 0 and
    /// uploads `persistent` (parameters and optimizer states, by name).
    pub fn new(trace: Trace, persistent: Vec<(String, HostTensor)>, mode: CudaMode) -> Result<CudaExecutor> {
        Self::with_options(trace, persistent, mode, &CompileOptions { passes: false, ..Default::default() })
    }

    /// As `new`, compiling `trace` with `opts` (`compile::compile`; the passes run only if
    /// `opts.passes`). Each node's kernel scratch is planned with the node (no whole-step
    /// workspace).
    pub fn with_options(
        trace: Trace,
        persistent: Vec<(String, HostTensor)>,
        mode: CudaMode,
        opts: &CompileOptions,
    ) -> Result<CudaExecutor> {
        let t0 = Instant::now();
        let dev = rumble_cuda::Device::new(0)?;
        let opts = Program::compile_options(&dev, opts)?;
        let compiled = compile(&trace, &opts)?;
        let report = compiled.report.clone();
        // Refused before the first allocation when the device lacks the memory: the plan's
        // peak (eager holds at least LOAD plus the persistent region).
        let need = match mode {
            CudaMode::Eager => report.load_bytes.saturating_add(report.persistent_bytes),
            _ => report.peak_bytes,
        } as u64;
        let (free, _) = dev.mem_info()?;
        if need > free as u64 {
            return Err(ModelError::OutOfMemory {
                what: format!("the {} executor of `{}` (the plan's peak)", mode.name(), trace.name),
                device: "cuda device 0".into(),
                needed: need,
                free: free as u64,
            });
        }
        let prog = Arc::new(Program::new(dev, compiled.trace, compiled.plan)?);
        let mut given: HashMap<String, HostTensor> = persistent.into_iter().collect();
        let (pers_idx, _) = prog.input_split();
        let mut values = Vec::with_capacity(pers_idx.len());
        for &i in &pers_idx {
            let inp = &prog.trace.inputs[i];
            let t = given.remove(&inp.name).ok_or_else(|| {
                ModelError::Usage(format!(
                    "trace `{}`: no value given for {} `{}`",
                    prog.trace.name,
                    inp.role.name(),
                    inp.name
                ))
            })?;
            values.push(t);
        }
        if let Some(name) = given.into_keys().next() {
            return Err(ModelError::Usage(format!("trace `{}` has no input `{name}`", prog.trace.name)));
        }
        let inner: Box<dyn Executor<Error = rumble_cuda::CudaError>> = match mode {
            CudaMode::Eager => Box::new(EagerExecutor::new(prog.clone(), &values)?),
            CudaMode::Planned => Box::new(PlannedExecutor::new(prog.clone(), &values)?),
            CudaMode::Graphed => Box::new(GraphedExecutor::new(prog.clone(), &values, GraphMode::Whole)?),
            CudaMode::GraphedForwardBackward => {
                Box::new(GraphedExecutor::new(prog.clone(), &values, GraphMode::ForwardBackward)?)
            }
        };
        Ok(CudaExecutor { inner, prog, report, cost: opts.cost.clone(), build_secs: t0.elapsed().as_secs_f64() })
    }

    /// The planner's report on the program (LOAD, arena, classes).
    pub fn report(&self) -> &PlanReport {
        &self.report
    }

    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// Each node's time inside the step as the cost model the compile weighed its choices by
    /// predicts it (`cost::step_node_times`), in node order (what it measured is in memory:
    /// nothing is probed again). Asked before a
    /// profile, it shows which nodes the prediction misses (a profile records its own times for
    /// later models).
    pub fn predicted_node_seconds(&self) -> Result<Vec<f64>> {
        let cost = self.cost.as_ref().ok_or_else(|| ModelError::Usage("no cost model".into()))?;
        Ok(rumble_core::cost::step_node_times(cost.as_ref(), &self.prog.trace))
    }

    /// One step timed launch by launch (device events around each kernel or matmul): `None` unless the
    /// executor launches node by node (planned). Each node's time is recorded for the cost model
    /// (`Program::record_times`). Launch gaps are not counted, so the sum is
    /// the device time a graph replay cannot hide.
    pub fn profile(&mut self, data: &[HostTensor]) -> Result<Option<Vec<NodeTime>>> {
        let Some(times) = self.inner.step_profiled(data)? else { return Ok(None) };
        // Each node's launches summed, recorded for the cost model (a cache that cannot be
        // written only loses the measurements).
        let mut per_node: Vec<(usize, f64)> = Vec::new();
        for &(n, _, ms) in &times {
            match per_node.last_mut() {
                Some((m, s)) if *m == n => *s += ms / 1e3,
                _ => per_node.push((n, ms / 1e3)),
            }
        }
        let _ = self.prog.record_times(&per_node);
        let t = &self.prog.trace;
        Ok(Some(
            times
                .into_iter()
                .map(|(n, i, ms)| {
                    let node = &t.nodes[n];
                    let r = &self.prog.recipes[n];
                    let out = node.outs.first().map(|o| t.ty(*o).to_string()).unwrap_or_default();
                    NodeTime { node: n, op: r.op, kernel: r.step_name(i), out, phase: format!("{:?}", node.phase), ms }
                })
                .collect(),
        ))
    }
}

/// One node's device time in a profiled step.
#[derive(Clone, Debug)]
pub struct NodeTime {
    pub node: usize,
    /// The op's name (e.g. `matmul`, `fused`, `attention_backward`).
    pub op: &'static str,
    /// The step: a kernel's name, or a matmul's dtype and m x n x k.
    pub kernel: String,
    /// The first output's type, e.g. `bf16[4096, 18944]`.
    pub out: String,
    pub phase: String,
    pub ms: f64,
}

/// The [`Executor`] methods of an executor here that runs a rumble-cuda executor held in field
/// `$inner` (its errors become [`ModelError`]s): the device, outputs, persistent values and
/// memory figures are the inner executor's.
macro_rules! cuda_executor_methods {
    ($inner:ident) => {
        type Error = ModelError;

        fn device(&self) -> DeviceKind {
            DeviceKind::Cuda
        }
        fn output(&self, name: &str) -> Result<HostTensor> {
            Ok(self.$inner.output(name)?)
        }
        fn persistent_names(&self) -> Vec<String> {
            self.$inner.persistent_names()
        }
        fn persistent(&self, name: &str) -> Result<HostTensor> {
            Ok(self.$inner.persistent(name)?)
        }
        fn memory(&self) -> MemoryStats {
            self.$inner.memory()
        }
    };
}
pub(crate) use cuda_executor_methods;

impl Executor for CudaExecutor {
    cuda_executor_methods!(inner);

    fn step(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>> {
        Ok(self.inner.step(data)?)
    }

    fn stats(&self) -> Option<ExecStats> {
        cuda_stats(self.memory(), std::slice::from_ref(&self.report), None, self.build_secs)
    }
}

/// The figures of CUDA programs over one arena and one persistent region (a
/// [`CudaExecutor`]'s one program, or the buckets of a `BucketedGraphs`): the memory measured,
/// the arena, LOAD and persistent bytes of the plan with the largest arena, the highest planned
/// peak, and the predicted time and choices of `step` (default: that largest plan). `None`
/// without plans.
pub(crate) fn cuda_stats(
    m: MemoryStats,
    plans: &[PlanReport],
    step: Option<&PlanReport>,
    build_secs: f64,
) -> Option<ExecStats> {
    let big = plans.iter().max_by_key(|r| r.arena_bytes)?;
    let step = step.unwrap_or(big);
    Some(ExecStats {
        peak_allocated_bytes: m.peak_bytes,
        device_used_bytes: m.device_rise_bytes,
        load_bytes: big.load_bytes,
        arena_bytes: big.arena_bytes,
        persistent_bytes: big.persistent_bytes,
        plan_peak_bytes: plans.iter().map(|r| r.peak_bytes).max().unwrap_or(0),
        build_secs,
        predicted_step_ms: step.predicted_ms,
        chosen: step.chosen.clone(),
        weighed: step.weighed.clone(),
    })
}
