//! The LLaMA family on rumble: models built from Hugging Face `config.json`, weights in
//! safetensors with Hugging Face names, and the whole training step as one trace.
//!
//! In the order data flows: [`config`] and [`presets`] (what model) -> [`weights`] (its
//! numbers: seeded init, safetensors load/save) and [`folder`] (model folders, sharded) ->
//! [`model`] (the forward pass, built with rumble_core's builder) -> [`step`] with [`optim`]
//! (loss, backward, clipping, optimizer in one trace) -> executors of
//! `rumble_core::exec::Executor`: [`exec`] (the CPU one, and the choice of one), [`cuda`] (the
//! CUDA one), [`buckets`] (one step per shape bucket, batches padded to it), [`paired`] (a step and its validation program over one GPU arena) ->
//! [`trainer`] (steps, learning-rate schedule; [`checkpoint`]: the state a run resumes from), fed by [`data`] (byte-level corpus windows;
//! text and JSONL documents through a [`tokenizer`]); [`guard`] holds the checks on user input;
//! [`generate`] samples text with a KV cache (prefill and decode traces); [`rendezvous`] shares
//! rank 0's NCCL unique id with the other ranks of a data-parallel run over TCP, whose
//! connections become the run's host links ([`group`]).

pub mod buckets;
pub mod checkpoint;
pub mod config;
pub mod cuda;
pub mod data;
pub mod error;
pub mod exec;
pub mod folder;
pub mod generate;
pub mod group;
pub mod guard;
pub mod host;
pub mod model;
pub mod optim;
pub mod paired;
pub mod presets;
pub mod rendezvous;
pub mod step;
pub mod tokenizer;
pub mod trainer;
pub mod weights;

pub use buckets::{BucketReport, BucketShape, BucketedExecutor, Buckets};
pub use config::{Arch, Config};
pub use cuda::{CudaExecutor, CudaMode};
pub use data::packed::{Dataset, Document, Loader, LoaderState, Validation};
pub use data::{Batch, Corpus};
pub use error::{ModelError, Result};
pub use exec::{DeviceChoice, DeviceKind, DynExecutor, ExecStats, Executor, HostTensor};
pub use optim::Optimizer;
pub use presets::{Objective, PRESET_NAMES, Preset, preset};
pub use step::{Precision, StepConfig, TrainStep, build_forward, build_train_step};
pub use tokenizer::Tokenizer;
pub use trainer::{LrSchedule, PIPELINE, ScheduleKind, StepStats, Trainer, save_checkpoint};
pub use weights::{OnDtypeMismatch, Weights};
