//! Executors: what runs a training-step trace, step after step, on some device.
//!
//! An [`Executor`] is handed one trace and the starting values of its persistent inputs
//! (parameters and optimizer states, by name). Each [`Executor::run`] takes the per-step data
//! inputs, runs the trace, writes every `Update { of }` output back over its input (so the
//! parameters and states live inside the executor between steps, on the device) and returns the
//! other outputs. The CPU executor is here; the CUDA one plugs in behind the same trait.

use std::fmt;
use std::str::FromStr;

use rumble_core::compile::CompileOptions;
use rumble_core::ir::{InputRole, OutputRole};
use rumble_core::{TensorType, Trace};

use crate::buckets::BucketReport;
use crate::cuda::{CudaExecutor, CudaMode};
use crate::error::{ModelError, Result};

pub use rumble_core::cpu::HostTensor;

/// A device a trace runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        })
    }
}

/// What the user asked for: a device, or the best one available.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda,
    /// CUDA when this build and machine can use it, otherwise the CPU.
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda),
            "auto" => Ok(DeviceChoice::Auto),
            _ => Err(ModelError::Usage(format!("unknown device `{s}` (cpu, cuda or auto)"))),
        }
    }
}

/// Runs one trace repeatedly, keeping its persistent inputs between runs.
pub trait Executor {
    fn device(&self) -> Device;

    /// Runs one step. `data` holds the trace's `input`-role inputs, in trace order. Returns
    /// the plain (`Output`-role) outputs, such as the loss, in trace order; updates are written
    /// back, and gradients stay where the step left them.
    fn run(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>>;

    /// The current values of the persistent inputs (parameters, optimizer states), by name.
    fn persistent(&self) -> Result<Vec<(String, HostTensor)>>;

    /// Runs the validation program built with the executor (tokens and targets in, the loss
    /// out; parameters unchanged), or `None` when it has none: the caller then evaluates
    /// [`crate::step::build_eval_step`] itself on the CPU reference.
    fn eval(&mut self, _data: &[HostTensor]) -> Result<Option<Vec<HostTensor>>> {
        Ok(None)
    }

    /// Memory and plan figures, for executors that measure them.
    fn stats(&self) -> Option<ExecStats> {
        None
    }

    /// Per shape bucket: steps run and graph captures (empty for executors of one shape).
    fn buckets(&self) -> Vec<BucketReport> {
        Vec::new()
    }
}

/// What an executor reports about its memory (bytes) and set-up.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExecStats {
    /// Most bytes the framework held at once (what `torch.cuda.max_memory_allocated` counts).
    pub peak_allocated_bytes: usize,
    /// The device's own used-memory rise since the executor was made.
    pub device_used_bytes: usize,
    /// The plan's LOAD, arena, persistent region and peak (persistent + arena).
    pub load_bytes: usize,
    pub arena_bytes: usize,
    pub persistent_bytes: usize,
    pub plan_peak_bytes: usize,
    /// Seconds spent planning, compiling kernels and capturing graphs.
    pub build_secs: f64,
    /// The cost model's predicted milliseconds of a step (`compile::compile`), if priced.
    pub predicted_step_ms: Option<f64>,
    /// What `compile` chose (the loss's chunk rows, recomputation), empty if nothing.
    pub chosen: String,
}

/// Why CUDA cannot be used on this machine, or `None` when it can.
pub fn cuda_unavailable() -> Option<String> {
    rumble_cuda::Device::new(0).err().map(|e| e.to_string())
}

/// The executor for `choice`: `auto` falls back to the CPU when CUDA is unavailable. `trace`
/// has been through `compile::PIPELINE`.
pub fn executor(
    choice: DeviceChoice,
    trace: Trace,
    persistent: Vec<(String, HostTensor)>,
) -> Result<Box<dyn Executor>> {
    executor_with(choice, trace, persistent, &CompileOptions { passes: false, ..Default::default() })
}

/// As [`executor`], CUDA compiling `trace` with `opts` (`compile::compile`: its memory budget,
/// say); the CPU evaluates the trace of `compile::optimize`.
pub fn executor_with(
    choice: DeviceChoice,
    trace: Trace,
    persistent: Vec<(String, HostTensor)>,
    opts: &CompileOptions,
) -> Result<Box<dyn Executor>> {
    let cpu = |trace: Trace, persistent| -> Result<Box<dyn Executor>> {
        Ok(Box::new(CpuExecutor::new(rumble_core::compile::optimize(&trace, opts)?.0, persistent)?))
    };
    match choice {
        DeviceChoice::Cpu => cpu(trace, persistent),
        DeviceChoice::Cuda => match cuda_unavailable() {
            Some(why) => Err(ModelError::DeviceUnavailable { device: "cuda".into(), why }),
            None => Ok(Box::new(CudaExecutor::with_options(trace, persistent, CudaMode::Graphed, opts)?)),
        },
        DeviceChoice::Auto => match cuda_unavailable() {
            Some(_) => cpu(trace, persistent),
            None => Ok(Box::new(CudaExecutor::with_options(trace, persistent, CudaMode::Graphed, opts)?)),
        },
    }
}

/// The CPU executor: `rumble_core::cpu::eval` on host tensors.
pub struct CpuExecutor {
    trace: Trace,
    /// One value per trace input; data slots are refilled each step.
    inputs: Vec<HostTensor>,
    /// Indices (into `trace.inputs`) of the per-step data inputs.
    data: Vec<usize>,
    /// For each output: the input index it updates, if it is an update.
    updates: Vec<Option<usize>>,
}

impl CpuExecutor {
    pub fn new(trace: Trace, persistent: Vec<(String, HostTensor)>) -> Result<CpuExecutor> {
        let mut given: std::collections::HashMap<String, HostTensor> = persistent.into_iter().collect();
        let mut inputs = Vec::with_capacity(trace.inputs.len());
        let mut data = Vec::new();
        for (i, inp) in trace.inputs.iter().enumerate() {
            let ty = trace.ty(inp.value);
            if inp.role == InputRole::Input {
                data.push(i);
                inputs.push(crate::host::zeros(ty));
                continue;
            }
            let t = given.remove(&inp.name).ok_or_else(|| {
                ModelError::Usage(format!(
                    "trace `{}`: no value given for {} input `{}` ({ty})",
                    trace.name,
                    inp.role.name(),
                    inp.name
                ))
            })?;
            check_type(&trace, &inp.name, ty, &t)?;
            inputs.push(t);
        }
        if let Some(name) = given.into_keys().next() {
            return Err(ModelError::Usage(format!("trace `{}` has no input `{name}`", trace.name)));
        }
        let updates = trace
            .outputs
            .iter()
            .map(|o| match o.role {
                OutputRole::Update { of } => trace.inputs.iter().position(|i| i.value == of),
                _ => None,
            })
            .collect();
        Ok(CpuExecutor { trace, inputs, data, updates })
    }
}

pub(crate) fn check_type(trace: &Trace, name: &str, want: &TensorType, t: &HostTensor) -> Result<()> {
    if &t.ty != want || t.bytes.len() != want.size_in_bytes() {
        return Err(ModelError::Usage(format!(
            "trace `{}`: input `{name}` needs {want}, got {} ({} bytes)",
            trace.name,
            t.ty,
            t.bytes.len()
        )));
    }
    Ok(())
}

impl Executor for CpuExecutor {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn run(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>> {
        if data.len() != self.data.len() {
            return Err(ModelError::Usage(format!(
                "trace `{}` takes {} data inputs, got {}",
                self.trace.name,
                self.data.len(),
                data.len()
            )));
        }
        for (&i, t) in self.data.iter().zip(data) {
            let inp = &self.trace.inputs[i];
            check_type(&self.trace, &inp.name, self.trace.ty(inp.value), t)?;
            self.inputs[i] = t.clone();
        }
        let outs = rumble_core::cpu::eval(&self.trace, &self.inputs)?;
        let mut plain = Vec::new();
        for ((out, update), o) in outs.into_iter().zip(&self.updates).zip(&self.trace.outputs) {
            match update {
                Some(i) => self.inputs[*i] = out,
                None if o.role == OutputRole::Output => plain.push(out),
                None => {}
            }
        }
        Ok(plain)
    }

    fn persistent(&self) -> Result<Vec<(String, HostTensor)>> {
        Ok(self
            .trace
            .inputs
            .iter()
            .zip(&self.inputs)
            .filter(|(i, _)| i.role.is_persistent())
            .map(|(i, t)| (i.name.clone(), t.clone()))
            .collect())
    }
}
