//! rumble's CUDA backend.
//!
//! In the order work flows through it: [`device`] (libraries loaded at run time, context,
//! stream, status word) -> [`compile`] (NVRTC to the device's own architecture, cached) ->
//! [`fused`] (elementwise expressions to kernels), [`flash`] (tiled attention), [`cudnn`] (cuDNN's fused attention) and the fixed kernels
//! under `kernels/` ->
//! [`recipe`] (each IR op as prepared launch steps) and [`matmul`] (cuBLASLt) -> [`launch`] ->
//! [`exec`] (eager, planned and graphed executors over one [`exec::Program`]); [`nccl`] runs
//! data-parallel programs' collectives.
//!
//! The crate builds and its CPU-side code runs on machines without CUDA: nothing is linked,
//! and [`Device::new`] returns an error (never a panic) when the libraries or a GPU are missing.
//!
//! **Architecture Invariant**: the planned and graphed executors allocate nothing while a step
//! runs; every address is the plan's (arena or persistent region) or a pinned staging buffer
//! fixed when the executor was built.

pub mod compile;
pub mod cudnn;
pub mod decode;
pub mod device;
pub mod error;
pub mod exec;
pub mod flash;
pub mod fused;
pub mod kernels;
pub mod knobs;
pub mod launch;
pub mod matmul;
mod matmul_tune;
pub mod memory;
pub mod nccl;
pub mod recipe;
mod tune;

pub use device::{Device, available};
pub use error::{CudaError, Result};

pub use exec::{
    BucketedGraphs, DeviceCost, EagerExecutor, Executor, GraphMode, GraphedExecutor, MAX_SLOWDOWN, MemoryStats,
    PART_LOAD_KEY, PART_SLOWDOWN_KEY, PlannedExecutor, Program, RATE_KEY, SLOWDOWN_KEY,
};
