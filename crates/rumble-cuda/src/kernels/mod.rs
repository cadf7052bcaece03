//! The CUDA C sources of the kernels, compiled at run time by NVRTC ([`crate::compile`]): the
//! shared prelude (types, conversions, the status word), the fixed kernel files, each compiled
//! whole as one module ([`KernelFile`]), and the flash-attention files, which `crate::flash`
//! compiles per head-size bucket with its tile sizes put in front as `#define`s.

/// Types, conversions and helpers every kernel source starts with (`vec16.cuh`: 16-byte row
/// access, a file of its own so the CPU emulators can include it too).
pub const PRELUDE: &str = concat!(include_str!("prelude.cuh"), include_str!("vec16.cuh"));
pub(crate) const FLASH_COMMON: &str = include_str!("flash_common.cuh");
pub(crate) const FLASH_ATTN: &str = include_str!("flash_attn.cu");
pub(crate) const FLASH_WG: &str = include_str!("flash_wg.cuh");
pub(crate) const FLASH_FMA: &str = include_str!("flash_fma.cu");

/// A fixed kernel file: its kernels are named by op and dtype (`rms_norm_bf16`) and looked up
/// in its one module. (An enum, so a misspelt file is a compile error, not another file's
/// module.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelFile {
    /// Copies, gathers and scatters (`layout.cu`).
    Layout,
    /// Reductions over axes (`reduce.cu`).
    Reduce,
    /// Row-wise ops: norms, softmax, rope, cross-entropy, swiglu (`rows.cu`).
    Rows,
    /// The per-row attention kernels, the fallback of the flash ones (`attention.cu`).
    Attention,
    /// Decoding: RoPE at a position, KV-cache writes, attention over the cache, sampling
    /// (`decode.cu`).
    Decode,
    /// Matrix times a few vectors (`gemv.cu`): decoding's matmuls, where the matmul tuner finds
    /// it faster than cuBLASLt.
    Gemv,
}

impl KernelFile {
    pub const ALL: [KernelFile; 6] = [
        KernelFile::Layout,
        KernelFile::Reduce,
        KernelFile::Rows,
        KernelFile::Attention,
        KernelFile::Decode,
        KernelFile::Gemv,
    ];

    /// The module name (the file's stem).
    pub fn name(self) -> &'static str {
        match self {
            KernelFile::Layout => "layout",
            KernelFile::Reduce => "reduce",
            KernelFile::Rows => "rows",
            KernelFile::Attention => "attention",
            KernelFile::Decode => "decode",
            KernelFile::Gemv => "gemv",
        }
    }

    fn body(self) -> &'static str {
        match self {
            KernelFile::Layout => include_str!("layout.cu"),
            KernelFile::Reduce => include_str!("reduce.cu"),
            KernelFile::Rows => include_str!("rows.cu"),
            KernelFile::Attention => include_str!("attention.cu"),
            KernelFile::Decode => include_str!("decode.cu"),
            KernelFile::Gemv => include_str!("gemv.cu"),
        }
    }

    /// The full source NVRTC compiles (the prelude, then the file).
    pub fn source(self) -> String {
        format!("{PRELUDE}\n{}", self.body())
    }
}
