//! The one [`Executor`] trait: what runs a training-step trace, step after step, on some device.
//!
//! An executor is handed one trace (or one per shape bucket) and the starting values of its
//! persistent inputs (parameters and optimizer states). Each [`Executor::step`] takes the
//! per-step inputs, runs the trace, writes every `Update { of }` output back over its input
//! (so the persistent values live inside the executor between steps, on its device) and returns
//! the `Output`-role outputs. Backends implement it: the CPU executors of `rumble-models`, the
//! eager, planned, graphed and bucketed executors of `rumble-cuda`; each names its own error
//! type ([`Executor::Error`]).

use std::fmt;

use serde::Serialize;

use crate::cpu::HostTensor;

/// The kind of device an executor runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Bytes an executor holds, comparable with PyTorch's accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Most bytes the framework held at once (arena + persistent for the planned executors,
    /// every node's scratch and any whole-step workspace being inside the arena; live
    /// allocator blocks, parameters included, for eager): what `torch.cuda.max_memory_allocated`
    /// counts.
    pub peak_bytes: usize,
    /// Bytes held from the driver at the peak (eager's cache included).
    pub reserved_bytes: usize,
    /// The device's own used-memory rise since the executor was created (cuMemGetInfo), which
    /// also counts graphs, library handles and fragmentation.
    pub device_rise_bytes: usize,
}

/// What an executor reports about its memory (bytes), its plan, its set-up and what
/// `compile` chose. Serialized (`rumble bench`'s JSON lines) with the byte counts only.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ExecStats {
    /// Most bytes the framework held at once ([`MemoryStats::peak_bytes`]).
    pub peak_allocated_bytes: usize,
    /// The device's own used-memory rise since the executor was made.
    pub device_used_bytes: usize,
    /// The plan's LOAD, arena, persistent region and peak (persistent + arena).
    pub load_bytes: usize,
    pub arena_bytes: usize,
    pub persistent_bytes: usize,
    pub plan_peak_bytes: usize,
    /// Seconds spent planning, compiling kernels and capturing graphs.
    #[serde(skip)]
    pub build_secs: f64,
    /// The cost model's predicted milliseconds of a step (`compile::compile`), if priced.
    #[serde(skip)]
    pub predicted_step_ms: Option<f64>,
    /// What `compile` chose (the loss's chunk rows, recomputation), empty if nothing.
    #[serde(skip)]
    pub chosen: String,
    /// Every variant `compile` weighed: its choices, predicted time and peak (empty if one).
    #[serde(skip)]
    pub weighed: Vec<String>,
}

/// What one shape bucket of a bucketed executor has done.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BucketStats {
    /// The bucket's trace name and per-step input types, e.g. `tokens i64[2, 16]`.
    pub shape: String,
    /// Its own plan's arena (every node's scratch included); 0 on the CPU.
    pub arena_bytes: usize,
    /// Its own plan's peak (persistent + arena, scratch included); 0 on the CPU.
    pub plan_peak_bytes: usize,
    /// Times its graphs were captured (0 before its first step, then 1: captures are cached;
    /// 0 on the CPU).
    pub captures: usize,
    /// Seconds spent placing the program and capturing, instantiating and uploading its graphs.
    pub capture_secs: f64,
    /// Steps it has run.
    pub steps: usize,
}

/// Runs one trace (or one per shape bucket) repeatedly, keeping its persistent inputs between
/// steps.
pub trait Executor {
    type Error;

    fn device(&self) -> DeviceKind;

    /// Runs one step on the per-step inputs (the trace's non-persistent inputs, in order) and
    /// returns the outputs whose role is `Output` (e.g. the loss), in order. Updates are written
    /// back; gradients stay where the step left them.
    fn step(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>, Self::Error>;

    /// Any trace output of the last step (a gradient, say), by name.
    fn output(&self, name: &str) -> Result<HostTensor, Self::Error>;

    /// The names of the persistent inputs (parameters, optimizer states), in trace order.
    fn persistent_names(&self) -> Vec<String>;

    /// A persistent input's current value, by name.
    fn persistent(&self, name: &str) -> Result<HostTensor, Self::Error>;

    /// Every persistent input's current value, by name, in trace order.
    fn persistent_values(&self) -> Result<Vec<(String, HostTensor)>, Self::Error> {
        self.persistent_names().into_iter().map(|n| self.persistent(&n).map(|t| (n, t))).collect()
    }

    /// Runs the validation program built beside the step (tokens and targets in, the loss
    /// out; persistent inputs unchanged), or `None` when the executor has none: the caller
    /// then evaluates its own forward-only trace over [`Executor::persistent_values`].
    #[allow(clippy::type_complexity)]
    fn eval(&mut self, inputs: &[HostTensor]) -> Result<Option<Vec<HostTensor>>, Self::Error> {
        let _ = inputs;
        Ok(None)
    }

    /// Bytes held (zero for executors that do not count them).
    fn memory(&self) -> MemoryStats {
        MemoryStats::default()
    }

    /// Memory, plan and set-up figures, for executors that plan (`None` otherwise).
    fn stats(&self) -> Option<ExecStats> {
        None
    }

    /// Per shape bucket, in bucket order: what it has done (empty for executors of one shape).
    fn buckets(&self) -> Vec<BucketStats> {
        Vec::new()
    }

    /// One step launched node by node with device events around each, where the executor
    /// can (planned): `(node, step of its recipe, milliseconds)` for every launch, in order.
    /// `None` where it cannot.
    #[allow(clippy::type_complexity)]
    fn step_profiled(&mut self, inputs: &[HostTensor]) -> Result<Option<Vec<(usize, usize, f64)>>, Self::Error> {
        let _ = inputs;
        Ok(None)
    }
}
