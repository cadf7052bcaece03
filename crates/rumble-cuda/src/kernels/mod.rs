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

/// The kernels (`__global__` functions) of `src` whose body does not open with `pdl_enter();`,
/// by the text that declares them: each would race with the kernel launched before it
/// (`launch::kernel` launches every kernel with programmatic dependent launch on sm_90);
/// `Device::module` refuses a source that has one. Calls of a function whose name ends in
/// `_prefetch` may come before it: an L2 prefetch reads nothing into the kernel (weights start
/// streaming while the kernel ahead runs).
pub(crate) fn kernels_without_pdl_enter(src: &str) -> Vec<String> {
    let mut missing = Vec::new();
    let mut from = 0;
    while let Some(i) = src[from..].find("__global__").map(|i| i + from) {
        from = i + "__global__".len();
        let line = &src[src[..i].rfind('\n').map_or(0, |l| l + 1)..i];
        if line.trim_start().starts_with("//") {
            continue;
        }
        // The body opens at the first `{` outside parentheses (past `__launch_bounds__(..)`
        // and the parameter list).
        let (mut depth, mut open, mut params) = (0i32, None, i);
        for (j, c) in src[i..].char_indices() {
            match c {
                '(' => {
                    if depth == 0 {
                        params = i + j;
                    }
                    depth += 1
                }
                ')' => depth -= 1,
                '{' if depth == 0 => {
                    open = Some(i + j + 1);
                    break;
                }
                _ => {}
            }
        }
        let skip = |t: &str| t.trim_start_matches(|c: char| c.is_whitespace() || c == '\\').to_string();
        let mut first = open.map(|o| skip(&src[o..]));
        // L2 prefetches may come first: they read nothing into the kernel.
        while let Some(f) = first.as_deref().filter(|f| prefetch_call(f)) {
            first = f.find(';').map(|e| skip(&f[e + 1..]));
        }
        if !first.is_some_and(|f| f.starts_with("pdl_enter();")) {
            missing.push(src[i..params].split_whitespace().last().unwrap_or("?").to_string());
        }
    }
    missing
}

/// Whether statement text `f` opens with a call of a `*_prefetch` function.
fn prefetch_call(f: &str) -> bool {
    let name: String = f.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    name.ends_with("_prefetch") && f[name.len()..].trim_start().starts_with(['(', '<'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_opens_with_pdl_enter() {
        let mut sources: Vec<(&str, String)> = KernelFile::ALL.iter().map(|f| (f.name(), f.source())).collect();
        for (name, text) in [("flash_attn", FLASH_ATTN), ("flash_wg", FLASH_WG), ("flash_fma", FLASH_FMA)] {
            sources.push((name, text.to_string()));
        }
        let mut kernels = 0;
        for (name, src) in &sources {
            kernels += src.matches("__global__").count();
            let missing = kernels_without_pdl_enter(src);
            assert!(missing.is_empty(), "{name}: kernels without pdl_enter(): {missing:?}");
        }
        assert!(kernels >= 57, "{kernels} kernels found");
        // The checker itself: a kernel without it is named, a comment is not a kernel.
        let bad =
            "// a __global__ kernel\nextern \"C\" __global__ void __launch_bounds__(256) k(int* x) {\n  x[0] = 1;\n}";
        assert_eq!(kernels_without_pdl_enter(bad), ["k"]);
        let good = "#define K \\\n  extern \"C\" __global__ void k(int* x) { \\\n    pdl_enter(); \\\n  }";
        assert!(kernels_without_pdl_enter(good).is_empty());
        // Prefetches may come first; anything else may not.
        let pre = "__global__ void k(int* x) {\n  w_prefetch<4>(x, 2);\n  l2_prefetch(x);\n  pdl_enter();\n}";
        assert!(kernels_without_pdl_enter(pre).is_empty());
        let late = "__global__ void k(int* x) {\n  w_prefetch(x);\n  x[0] = 1;\n  pdl_enter();\n}";
        assert_eq!(kernels_without_pdl_enter(late), ["k"]);
    }
}
