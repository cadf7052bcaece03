//! Executors: what runs a training-step trace, step after step, on some device.
//!
//! An [`Executor`] is handed one trace and the starting values of its persistent inputs
//! (parameters and optimizer states, by name). Each [`Executor::run`] takes the per-step data
//! inputs, runs the trace, writes every `Update { of }` output back over its input (so the
//! parameters and states live inside the executor between steps, on the device) and returns the
//! other outputs. The CPU executor is here; the CUDA one plugs in behind the same trait.

use std::fmt;
use std::str::FromStr;

use rumble_core::ir::{InputRole, OutputRole};
use rumble_core::{TensorType, Trace};

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
    /// every output that is not an `Update`, in trace order; updates are written back.
    fn run(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>>;

    /// The current values of the persistent inputs (parameters, optimizer states), by name.
    fn persistent(&self) -> Result<Vec<(String, HostTensor)>>;
}

/// Why CUDA cannot be used by this build, or `None` when it can.
pub fn cuda_unavailable() -> Option<String> {
    Some("this build has no CUDA executor yet (the rumble-cuda backend, issue 5, has not landed)".into())
}

/// The executor for `choice`: `auto` falls back to the CPU when CUDA is unavailable.
pub fn executor(
    choice: DeviceChoice,
    trace: Trace,
    persistent: Vec<(String, HostTensor)>,
) -> Result<Box<dyn Executor>> {
    match choice {
        DeviceChoice::Cpu => Ok(Box::new(CpuExecutor::new(trace, persistent)?)),
        DeviceChoice::Cuda => Err(ModelError::DeviceUnavailable {
            device: "cuda".into(),
            why: cuda_unavailable().unwrap_or_else(|| "the CUDA executor is not wired into rumble-models yet".into()),
        }),
        // Until a CUDA executor exists, `auto` is the CPU.
        DeviceChoice::Auto => Ok(Box::new(CpuExecutor::new(trace, persistent)?)),
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

fn check_type(trace: &Trace, name: &str, want: &TensorType, t: &HostTensor) -> Result<()> {
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
        for (out, update) in outs.into_iter().zip(&self.updates) {
            match update {
                Some(i) => self.inputs[*i] = out,
                None => plain.push(out),
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
