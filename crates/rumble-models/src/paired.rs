//! A training step and its validation program on the GPU over ONE persistent region and ONE
//! arena: `rumble_cuda::BucketedGraphs` with two programs, the step (bucket 0) and the
//! forward-only eval trace of [`crate::step::build_eval_step`] (bucket 1), whose persistent
//! inputs are the step's own in the same order and types, so the parameters are never copied
//! and validation costs no device memory beyond the larger of the two arenas. The two take
//! different per-step inputs (the step also its learning rate and Adam's corrections) and
//! return different outputs (the step also its gradient norm): buckets may
//! (`rumble_cuda::exec::check_step_inputs`); only the persistent layout must agree. Each is
//! run by its bucket index, never picked by its inputs' types.

use std::sync::Arc;
use std::time::Instant;

use rumble_core::Trace;
use rumble_core::compile::{CompileOptions, compile};
use rumble_core::plan::PlanReport;
use rumble_cuda::{BucketedGraphs, GraphMode, Program};

use crate::error::{ModelError, Result};
use crate::exec::{DeviceKind, ExecStats, Executor, HostTensor};
use rumble_core::exec::MemoryStats;

/// The step and its validation program as CUDA graphs over one arena; see the module doc.
pub struct StepWithEval {
    graphs: BucketedGraphs,
    reports: [PlanReport; 2],
    build_secs: f64,
}

impl StepWithEval {
    /// Compiles `step` and `eval` with `opts` for device 0 and uploads `persistent` (every
    /// persistent input of `step`, by name). Refuses an `eval` whose persistent inputs differ
    /// from the step's, naming the first.
    pub fn new(
        step: Trace,
        eval: Trace,
        persistent: Vec<(String, HostTensor)>,
        opts: &CompileOptions,
    ) -> Result<StepWithEval> {
        let t0 = Instant::now();
        let dev = rumble_cuda::Device::new(0)?;
        let names: Vec<String> =
            step.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| i.name.clone()).collect();
        let mut given: std::collections::HashMap<String, HostTensor> = persistent.into_iter().collect();
        let values = names
            .iter()
            .map(|n| {
                given.remove(n).ok_or_else(|| ModelError::Usage(format!("trace `{}`: no value for `{n}`", step.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut progs = Vec::new();
        let mut reports = Vec::new();
        let opts = Program::compile_options(&dev, opts)?;
        for t in [&step, &eval] {
            let compiled = compile(t, &opts)?;
            reports.push(compiled.report.clone());
            progs.push(Arc::new(Program::new(dev.clone(), compiled.trace, compiled.plan)?));
        }
        let graphs = BucketedGraphs::new(progs, &values, GraphMode::Whole)?;
        let reports: [PlanReport; 2] =
            reports.try_into().map_err(|_| ModelError::Usage("step and eval: two plans expected".into()))?;
        Ok(StepWithEval { graphs, reports, build_secs: t0.elapsed().as_secs_f64() })
    }
}

impl Executor for StepWithEval {
    crate::cuda::cuda_executor_methods!(graphs);

    fn step(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>> {
        Ok(self.graphs.step_bucket(0, data)?)
    }

    fn eval(&mut self, data: &[HostTensor]) -> Result<Option<Vec<HostTensor>>> {
        Ok(Some(self.graphs.step_bucket(1, data)?))
    }

    fn stats(&self) -> Option<ExecStats> {
        crate::cuda::cuda_stats(self.graphs.memory(), &self.reports, Some(&self.reports[0]), self.build_secs)
    }
}
