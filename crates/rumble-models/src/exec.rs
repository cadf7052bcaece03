//! The CPU executor and the choice of executor. The [`Executor`] trait itself is
//! `rumble_core::exec`'s (one trait for every backend); here its error type is [`ModelError`]
//! ([`DynExecutor`]). The CUDA executor is in [`crate::cuda`], the bucketed one in
//! [`crate::buckets`].

use std::str::FromStr;

use rumble_core::compile::CompileOptions;
use rumble_core::ir::{InputRole, OutputRole};
use rumble_core::{TensorType, Trace};

use crate::cuda::{CudaExecutor, CudaMode};
use crate::error::{ModelError, Result};

pub use rumble_core::cpu::HostTensor;
pub use rumble_core::exec::{DeviceKind, ExecStats, Executor};

/// An executor of any backend, behind the models' error type.
pub type DynExecutor = dyn Executor<Error = ModelError>;

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

/// Why CUDA cannot be used on this machine, or `None` when it can.
pub fn cuda_unavailable() -> Option<String> {
    rumble_cuda::Device::new(0).err().map(|e| e.to_string())
}

impl DeviceChoice {
    /// The device this choice runs on: CUDA when asked for and usable (an error saying why
    /// not when asked for and not usable), the CPU when asked for or when `auto` finds no CUDA.
    pub fn resolve(self) -> Result<DeviceKind> {
        match self {
            DeviceChoice::Cpu => Ok(DeviceKind::Cpu),
            DeviceChoice::Cuda => match cuda_unavailable() {
                Some(why) => Err(ModelError::DeviceUnavailable { device: "cuda".into(), why }),
                None => Ok(DeviceKind::Cuda),
            },
            DeviceChoice::Auto => Ok(if cuda_unavailable().is_some() { DeviceKind::Cpu } else { DeviceKind::Cuda }),
        }
    }
}

/// The executor for `choice`: `auto` falls back to the CPU when CUDA is unavailable. `trace`
/// has been through `compile::PIPELINE`.
pub fn executor(choice: DeviceChoice, trace: Trace, persistent: Vec<(String, HostTensor)>) -> Result<Box<DynExecutor>> {
    executor_with(choice, trace, persistent, &CompileOptions { passes: false, ..Default::default() })
}

/// As [`executor`], CUDA compiling `trace` with `opts` (`compile::compile`: its memory budget,
/// say); the CPU evaluates the trace of `compile::optimize`.
pub fn executor_with(
    choice: DeviceChoice,
    trace: Trace,
    persistent: Vec<(String, HostTensor)>,
    opts: &CompileOptions,
) -> Result<Box<DynExecutor>> {
    let cpu = |trace: Trace, persistent| -> Result<Box<DynExecutor>> {
        Ok(Box::new(CpuExecutor::new(rumble_core::compile::optimize(&trace, opts)?.0, persistent)?))
    };
    match choice.resolve()? {
        DeviceKind::Cpu => cpu(trace, persistent),
        DeviceKind::Cuda => Ok(Box::new(CudaExecutor::with_options(trace, persistent, CudaMode::Graphed, opts)?)),
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
    /// Every output of the last step, in trace order (updates before they were written back).
    last: Vec<HostTensor>,
}

impl CpuExecutor {
    pub fn new(trace: Trace, persistent: Vec<(String, HostTensor)>) -> Result<CpuExecutor> {
        // Refused up front when a step cannot fit in the host memory free.
        let need = crate::guard::cpu_step_bytes(&trace);
        crate::guard::check_host_memory(&format!("a step of `{}` on the CPU", trace.name), need)?;
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
        Ok(CpuExecutor { trace, inputs, data, updates, last: Vec::new() })
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
    type Error = ModelError;

    fn device(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn step(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>> {
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
        self.last = rumble_core::cpu::eval(&self.trace, &self.inputs)?;
        let mut plain = Vec::new();
        for ((out, update), o) in self.last.iter().zip(&self.updates).zip(&self.trace.outputs) {
            match update {
                Some(i) => self.inputs[*i] = out.clone(),
                None if o.role == OutputRole::Output => plain.push(out.clone()),
                None => {}
            }
        }
        Ok(plain)
    }

    fn output(&self, name: &str) -> Result<HostTensor> {
        let i = self.trace.outputs.iter().position(|o| o.name == name);
        i.and_then(|i| self.last.get(i)).cloned().ok_or_else(|| {
            ModelError::Usage(format!("trace `{}`: no output `{name}` (or no step has run yet)", self.trace.name))
        })
    }

    fn persistent_names(&self) -> Vec<String> {
        self.trace.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| i.name.clone()).collect()
    }

    fn persistent(&self, name: &str) -> Result<HostTensor> {
        let i = self.trace.inputs.iter().position(|i| i.name == name && i.role.is_persistent());
        i.map(|i| self.inputs[i].clone())
            .ok_or_else(|| ModelError::Usage(format!("trace `{}` has no param/opt_state `{name}`", self.trace.name)))
    }
}
