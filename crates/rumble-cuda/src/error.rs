//! The CUDA backend's error type. Every variant says where it happened: the op and kernel of a
//! failed launch, the kernel file of a failed compile, the bytes of a refused plan.

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable GPU: the driver library is missing, no device, or the device failed to start.
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),

    /// A CUDA library (driver, NVRTC, cuBLASLt) could not be loaded.
    #[error("CUDA library {lib} could not be loaded: {why}")]
    Library { lib: &'static str, why: String },

    /// A driver call failed; `what` names the call and the op/kernel it served.
    #[error("CUDA driver error in {what}: {err}")]
    Driver { what: String, err: String },

    /// NVRTC rejected a kernel source.
    #[error("NVRTC failed to compile `{kernel}` for {arch}: {err}\n{log}")]
    Compile { kernel: String, arch: String, err: String, log: String },

    /// A kernel launch failed (or the launch was asynchronous and a later check caught it).
    #[error("launching `{kernel}` for op `{op}` failed: {err}")]
    Launch { op: String, kernel: String, err: String },

    /// cuBLASLt failed or found no algorithm.
    #[error("cuBLASLt in op `{op}` ({what}): {err}")]
    Blas { op: String, what: String, err: String },

    /// cuDNN refused a descriptor or failed to run a plan.
    #[error("cuDNN ({what}): {err}")]
    Cudnn { what: String, err: String },

    /// A kernel reported bad data (an index out of range, integer division by zero).
    #[error("op `{op}` (node {node}) met bad data on the device: {msg}")]
    DeviceData { op: String, node: usize, msg: String },

    /// The plan (or an allocation) does not fit the device's free memory.
    #[error("out of device memory for {what}: needs {needed} bytes, {free} bytes free")]
    OutOfMemory { what: String, needed: usize, free: usize },

    /// Stream capture into a CUDA graph failed.
    #[error("CUDA graph capture of {what} failed: {why}")]
    Capture { what: String, why: String },

    /// This backend has no kernel for an op/dtype combination.
    #[error("the CUDA backend does not support {0}")]
    Unsupported(String),

    /// Wrong inputs handed to an executor, or a plan that does not fit the trace.
    #[error("{0}")]
    Usage(String),

    #[error(transparent)]
    Core(#[from] rumble_core::Error),
}

impl CudaError {
    pub fn usage(m: impl Into<String>) -> Self {
        CudaError::Usage(m.into())
    }
}

impl From<CudaError> for rumble_core::Error {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Core(c) => c,
            CudaError::Unsupported(what) => rumble_core::Error::Unsupported { backend: "cuda".into(), what },
            other => rumble_core::Error::Msg(other.to_string()),
        }
    }
}

/// Attaches a description to a raw driver result.
pub(crate) trait DriverContext<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| CudaError::Driver { what: what(), err: describe(&e) })
    }
}

/// `CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)`.
pub(crate) fn describe(e: &cudarc::driver::DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name} ({text})")
}
