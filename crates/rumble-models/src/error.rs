//! The error type of the models crate. Every variant names the file, the key or the tensor
//! that is wrong, so a user can fix a config or a checkpoint without reading code.

use std::path::PathBuf;

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A config.json key is missing, malformed or asks for something rumble does not do.
    #[error("{source_name}: config key `{key}`: {msg}")]
    Config { source_name: String, key: String, msg: String },

    /// A checkpoint lacks a tensor the model needs.
    #[error("{file}: missing tensor `{name}` (expected {expected})")]
    MissingTensor { file: PathBuf, name: String, expected: String },

    /// A checkpoint tensor has the wrong shape.
    #[error("{file}: tensor `{name}` has shape {got:?}, the model needs {expected:?}")]
    Shape { file: PathBuf, name: String, expected: Vec<usize>, got: Vec<usize> },

    /// A checkpoint tensor has the wrong dtype.
    #[error("{file}: tensor `{name}` is {got}, the model needs {expected}")]
    DType { file: PathBuf, name: String, expected: String, got: String },

    /// A checkpoint holds a tensor the model does not have (a config/checkpoint mismatch).
    #[error("{file}: unexpected tensor `{name}`: the config has no such parameter")]
    UnexpectedTensor { file: PathBuf, name: String },

    /// A checkpoint tensor holds NaN or infinity.
    #[error(
        "{file}: tensor `{name}` holds {value} at element {index}: rumble neither loads nor saves non-finite weights"
    )]
    NonFinite { file: PathBuf, name: String, index: usize, value: f64 },

    /// A training step produced a non-finite loss or gradient norm: the run stops there,
    /// before any checkpoint is written. `culprit` names the first non-finite parameter.
    #[error(
        "step {step}: {what}; {culprit}; the run stopped before writing a checkpoint (a lower --lr or --clip may help)"
    )]
    Diverged { step: u64, what: String, culprit: String },

    /// More memory is needed than the host or the device has free.
    #[error("{what} needs {}, {device} has {} free", crate::guard::fmt_bytes_of(.needed), crate::guard::fmt_bytes_of(.free))]
    OutOfMemory { what: String, device: String, needed: u64, free: u64 },

    /// A file rumble refuses to read (a device, a FIFO, a folder, too large, not text).
    #[error("{path}: {msg}")]
    BadFile { path: PathBuf, msg: String },

    /// A size computed from a config or an option overflows.
    #[error("{what}: {msg}")]
    TooLarge { what: String, msg: String },

    /// The file is not a readable safetensors file (truncated, bad header).
    #[error("{file}: not a valid safetensors file: {msg}")]
    Safetensors { file: PathBuf, msg: String },

    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    /// A tokenizer file that cannot be read, or text or ids it cannot encode or decode.
    #[error("{file}: tokenizer: {msg}")]
    Tokenizer { file: PathBuf, msg: String },

    /// A data file (text or JSONL) with a record rumble cannot use.
    #[error("{file}: {msg}")]
    Data { file: PathBuf, msg: String },

    /// An unknown preset, device or option value.
    #[error("{0}")]
    Usage(String),

    /// A device that this build or machine cannot use.
    #[error("device `{device}` is not available: {why}")]
    DeviceUnavailable { device: String, why: String },

    /// Compiling or running a trace on the GPU failed.
    #[error(transparent)]
    Cuda(#[from] rumble_cuda::CudaError),

    /// Building or running a trace failed in the core crate.
    #[error(transparent)]
    Core(#[from] rumble_core::Error),
}

impl ModelError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
    pub fn config(source_name: impl Into<String>, key: impl Into<String>, msg: impl Into<String>) -> Self {
        ModelError::Config { source_name: source_name.into(), key: key.into(), msg: msg.into() }
    }
}
