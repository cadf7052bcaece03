//! Flash attention: the recipes of `Op::Attention` and `Op::AttentionBackward` on the tiled
//! kernels of `kernels/flash_attn.cu` (bf16/f16 on the tensor cores, mma.sync m16n8k16 with
//! f32 accumulation) and `kernels/flash_fma.cu` (f32 with plain FMA and register-blocked
//! tiles; `RUMBLE_FLASH_FMA_CFG=b` picks its second tiling). Both keep their tiles
//! in shared memory and registers, save only o and the log-sum-exp, and need O(seq x head)
//! memory; the backward's only scratch is one f32 per query row (`delta = rowsum(dO * O)`),
//! part of the recipe's scratch and so of the plan's workspace.
//!
//! [`choose`] is the one place that decides between these kernels and the simple per-row
//! kernel of `kernels/attention.cu` (the fallback: f64, head sizes over 256, GPUs before
//! sm_80, or `RUMBLE_ATTENTION=naive`). One module is compiled per (dtype, padded head size).
//!
//! Deterministic: no atomics. The backward is three kernels: delta, then dK/dV (each block
//! owns a block of keys and walks its group's query heads and queries in a fixed order), then
//! dQ (each block owns a block of queries).

use cudarc::driver::{result as drv, sys};
use rumble_core::ir::{DType, Op, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::{Arg, Recipe, Step};
use crate::recipe::PRELUDE;

const MMA: &str = include_str!("kernels/flash_attn.cu");
const FMA: &str = include_str!("kernels/flash_fma.cu");
/// Threads per block of the tensor-core flash kernels (`fa::NT` of flash_attn.cu).
const THREADS: u32 = 128;
/// Threads per block of the FMA flash kernels (`fa::NT` of flash_fma.cu).
const FMA_THREADS: u32 = 256;
/// Opt-in shared memory per block on sm_90 (`fa::SMEM_MAX` of flash_fma.cu).
const SMEM_MAX: usize = 227 * 1024;
/// The largest head size the flash kernels take.
pub const MAX_HEAD: usize = 256;

/// Which flash kernels, for which padded head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Tensor cores: bf16 or f16 operands; `dp` = head size rounded up to 16 (at least 16).
    Mma { dtype: DType, dp: usize },
    /// f32 with FMA; `dp` = head size rounded up to 32; `big`: the second tiling (64-key
    /// forward and 64-query dK/dV tiles instead of 32, `RUMBLE_FLASH_FMA_CFG=b`).
    Fma { dp: usize, big: bool },
}

/// The flash kernels for `dtype` and head size `d` on a GPU of compute capability `cc`, or
/// `None` where the per-row kernel runs instead. The only place this choice is made.
pub fn choose(cc: (i32, i32), dtype: DType, d: usize) -> Option<Variant> {
    if std::env::var("RUMBLE_ATTENTION").is_ok_and(|v| v == "naive") || cc < (8, 0) || d == 0 || d > MAX_HEAD {
        return None;
    }
    match dtype {
        DType::BF16 | DType::F16 => Some(Variant::Mma { dtype, dp: d.div_ceil(16).max(1) * 16 }),
        DType::F32 => Some(Variant::Fma { dp: d.div_ceil(32) * 32, big: fma_big() }),
        _ => None,
    }
}

/// `RUMBLE_FLASH_FMA_CFG=b` selects the FMA kernels' second tiling (`a`, the default, the first).
fn fma_big() -> bool {
    std::env::var("RUMBLE_FLASH_FMA_CFG").is_ok_and(|v| v == "b")
}

/// The launch shape of a variant's kernels: mirrors the `FWD_ROWS` ... `SMEM_DKDV` constants
/// at the top of namespace `fa` in each kernel file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub fwd_rows: usize,
    pub dq_rows: usize,
    pub dkdv_keys: usize,
    /// dK/dV blocks per key block (head dims accumulated in chunks of at most 128).
    pub nchunk: usize,
    pub smem_fwd: usize,
    pub smem_dq: usize,
    pub smem_dkdv: usize,
}

impl Variant {
    pub fn dp(&self) -> usize {
        match *self {
            Variant::Mma { dp, .. } | Variant::Fma { dp, .. } => dp,
        }
    }

    /// Threads per block of every kernel of the variant.
    pub fn threads(&self) -> u32 {
        match self {
            Variant::Mma { .. } => THREADS,
            Variant::Fma { .. } => FMA_THREADS,
        }
    }

    /// Module name, e.g. `flash_bf16_d64` or `flash_f32_d128b` (FMA, second tiling).
    pub fn name(&self) -> String {
        match self {
            Variant::Mma { dtype, dp } => format!("flash_{}_d{dp}", dtype.name()),
            Variant::Fma { dp, big } => format!("flash_f32_d{dp}{}", if *big { "b" } else { "" }),
        }
    }

    /// The full source NVRTC compiles for this variant.
    pub fn source(&self) -> String {
        match self {
            Variant::Mma { dtype, dp } => {
                let f16 = (*dtype == DType::F16) as i32;
                format!("{PRELUDE}\n#define FT {}\n#define FLASH_F16 {f16}\n#define FDP {dp}\n{MMA}", dtype.name())
            }
            Variant::Fma { dp, big } => {
                format!("{PRELUDE}\n#define FDPF {dp}\n#define FLASH_FMA_CFG {}\n{FMA}", *big as i32)
            }
        }
    }

    pub fn shape(&self) -> Shape {
        match *self {
            Variant::Mma { dp, .. } => {
                let ld = dp + 8;
                let (br, bk) = (64, 64);
                let bc = if dp <= 128 { 64 } else { 32 };
                let fbr = if dp <= 128 { 128 } else { 64 };
                let fbc = if dp <= 64 { 64 } else { 32 };
                let bq = if dp <= 64 { 64 } else { 32 };
                let dc = dp.min(128);
                Shape {
                    fwd_rows: fbr,
                    dq_rows: br,
                    dkdv_keys: bk,
                    nchunk: dp.div_ceil(dc),
                    smem_fwd: (fbr + 4 * fbc) * ld * 2,
                    smem_dq: (2 * br + 4 * bc) * ld * 2,
                    smem_dkdv: (2 * bk + 4 * bq) * ld * 2 + 4 * bq * 4,
                }
            }
            Variant::Fma { dp, big } => {
                let ld = dp + 4;
                let fbr = if dp <= 128 { 128 } else { 64 };
                let fbc = if big { 64 } else { 32 };
                let lpf = fbc + 8;
                let dc = dp.min(128);
                let (qbc, lpq) = (32, 40);
                let (bk, ktx, bq) = (64, if dc % 64 == 0 { 16 } else { 8 }, if big && dp <= 128 { 64 } else { 32 });
                let lpk = bq + ktx;
                // Double-buffered (nb = 2) where that fits, as the kernel file decides.
                let fit = |f: &dyn Fn(usize) -> usize| if f(2) <= SMEM_MAX { f(2) } else { f(1) };
                Shape {
                    fwd_rows: fbr,
                    dq_rows: fbr,
                    dkdv_keys: bk,
                    nchunk: dp.div_ceil(dc),
                    smem_fwd: fit(&|nb| (fbr * ld + 2 * nb * fbc * ld + fbr * lpf) * 4),
                    smem_dq: fit(&|nb| (2 * fbr * ld + 2 * nb * qbc * ld + fbr * lpq) * 4),
                    smem_dkdv: fit(&|nb| (2 * bk * ld + 2 * nb * bq * ld + 2 * bk * lpk + 2 * nb * bq) * 4),
                }
            }
        }
    }

    /// Every variant the choice can make (for the offline compile test).
    pub fn all() -> Vec<Variant> {
        let mut v: Vec<Variant> = (1..=16).map(|i| Variant::Mma { dtype: DType::BF16, dp: 16 * i }).collect();
        v.extend((1..=16).map(|i| Variant::Mma { dtype: DType::F16, dp: 16 * i }));
        v.extend((1..=8).map(|i| Variant::Fma { dp: 32 * i, big: false }));
        v.extend((1..=8).map(|i| Variant::Fma { dp: 32 * i, big: true }));
        v
    }
}

/// Compile options of the flash modules (contraction into FMA allowed).
pub const OPTIONS: Options = Options { fmad: true };

/// The most dynamic shared memory a block may opt into on `dev`.
fn smem_limit(dev: &Device) -> Result<usize> {
    let a = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    let v = unsafe { drv::device::get_attribute(dev.cu_device(), a) }.ctx(|| "shared memory per block".into())?;
    Ok(v.max(0) as usize)
}

/// The flash recipe of `op` (attention or its backward) on operands `at`, or `None` where
/// [`choose`] (or the device's shared memory, or the grid's limits) leaves it to the
/// per-row kernels.
pub fn recipe(dev: &Device, op: &Op, at: &[&TensorType]) -> Option<Result<Recipe>> {
    let (scale, causal, backward) = match op {
        Op::Attention { scale, causal } => (*scale, *causal, false),
        Op::AttentionBackward { scale, causal } => (*scale, *causal, true),
        _ => return None,
    };
    let (q, k) = (at[0].dims(), at[1].dims());
    let variant = choose(dev.capability, at[0].dtype, q[3])?;
    let sh = variant.shape();
    let (b, hq, hkv, t, s, d) = (q[0], q[1], k[1], q[2], k[2], q[3]);
    if b * hq > 65535 || b * hkv > 65535 {
        return None;
    }
    let need = if backward { sh.smem_dq.max(sh.smem_dkdv) } else { sh.smem_fwd };
    match smem_limit(dev) {
        Ok(limit) if need > limit => return None,
        Ok(_) => {}
        Err(e) => return Some(Err(e)),
    }
    Some(build(dev, variant, sh, backward, scale, causal, [b, hq, hkv, t, s, d]))
}

fn build(
    dev: &Device,
    variant: Variant,
    sh: Shape,
    backward: bool,
    scale: f64,
    causal: bool,
    [b, hq, hkv, t, s, d]: [usize; 6],
) -> Result<Recipe> {
    let name = variant.name();
    let module = dev.module(&name, &variant.source(), OPTIONS)?;
    let kernel = |kname: &str, grid: (usize, usize), smem: usize, args: Vec<Arg>| -> Result<Step> {
        let func = module.function(kname)?;
        if smem > 48 * 1024 {
            dev.bind()?;
            let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            unsafe { drv::function::set_function_attribute(func.0, attr, smem as i32) }
                .ctx(|| format!("allowing {smem} bytes of shared memory to `{kname}` in `{name}`"))?;
        }
        let grid = (u32::try_from(grid.0).map_err(|_| CudaError::usage(format!("grid of {kname}")))?, grid.1 as u32, 1);
        let block = variant.threads();
        Ok(Step::Kernel { func, name: format!("{name}/{kname}"), grid, block, smem: smem as u32, args })
    };
    let dims = Arg::Blob([b, hq, hkv, t, s, d].iter().map(|&x| x as u64).collect());
    let (sc, ca) = (Arg::F64(scale), Arg::I32(causal as i32));
    let mut steps = Vec::new();
    let rows = b * hq * t;
    if !backward {
        if rows > 0 {
            let args = vec![Arg::In(0), Arg::In(1), Arg::In(2), Arg::Out(0), Arg::Out(1), dims, sc, ca];
            steps.push(kernel("flash_fwd", (t.div_ceil(sh.fwd_rows), b * hq), sh.smem_fwd, args)?);
        }
        return Ok(Recipe { op: "attention", steps, scratch: 0, node_scratch: 0 });
    }
    // Scratch: delta, one f32 per query row.
    if rows > 0 {
        let blocks = rows.div_ceil(variant.threads() as usize / 32).clamp(1, dev.multiprocessors.max(1) * 16);
        let args = vec![Arg::In(3), Arg::In(5), Arg::Scratch(0), Arg::I64(rows as i64), Arg::I64(d as i64)];
        steps.push(kernel("flash_bwd_delta", (blocks, 1), 0, args)?);
    }
    if b * hkv * s > 0 {
        let args = vec![
            Arg::In(0),
            Arg::In(1),
            Arg::In(2),
            Arg::In(4),
            Arg::In(5),
            Arg::Scratch(0),
            Arg::Out(1),
            Arg::Out(2),
            dims.clone(),
            sc.clone(),
            ca.clone(),
        ];
        steps.push(kernel("flash_bwd_dkdv", (s.div_ceil(sh.dkdv_keys) * sh.nchunk, b * hkv), sh.smem_dkdv, args)?);
    }
    if rows > 0 {
        let args = vec![
            Arg::In(0),
            Arg::In(1),
            Arg::In(2),
            Arg::In(4),
            Arg::In(5),
            Arg::Scratch(0),
            Arg::Out(0),
            dims,
            sc,
            ca,
        ];
        steps.push(kernel("flash_bwd_dq", (t.div_ceil(sh.dq_rows), b * hq), sh.smem_dq, args)?);
    }
    Ok(Recipe { op: "attention_backward", steps, scratch: (rows * 4).div_ceil(256) * 256, node_scratch: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_choice_covers_the_issue_matrix() {
        let h100 = (9, 0);
        for d in [1, 64, 100, 128, 256] {
            assert!(matches!(choose(h100, DType::BF16, d), Some(Variant::Mma { .. })), "bf16 d{d}");
            assert!(matches!(choose(h100, DType::F32, d), Some(Variant::Fma { .. })), "f32 d{d}");
        }
        assert_eq!(choose(h100, DType::BF16, 1), Some(Variant::Mma { dtype: DType::BF16, dp: 16 }));
        assert_eq!(choose(h100, DType::BF16, 100), Some(Variant::Mma { dtype: DType::BF16, dp: 112 }));
        assert!(matches!(choose(h100, DType::F32, 100), Some(Variant::Fma { dp: 128, .. })));
        assert_eq!(choose(h100, DType::F64, 64), None);
        assert_eq!(choose(h100, DType::BF16, 257), None);
        assert_eq!(choose((7, 5), DType::BF16, 64), None);
    }

    #[test]
    fn every_variant_fits_an_h100_block() {
        // 227 KiB of opt-in shared memory per block on sm_90.
        for v in Variant::all() {
            let s = v.shape();
            for (what, bytes) in [("fwd", s.smem_fwd), ("dq", s.smem_dq), ("dkdv", s.smem_dkdv)] {
                assert!(bytes <= 227 * 1024, "{} {what}: {bytes} bytes", v.name());
            }
        }
        // Spot values, computed by hand from the kernel files' formulas.
        let s = Variant::Mma { dtype: DType::BF16, dp: 128 }.shape();
        assert_eq!((s.fwd_rows, s.smem_fwd, s.smem_dq, s.smem_dkdv, s.nchunk), (128, 69632, 104448, 70144, 1));
        let s = Variant::Mma { dtype: DType::BF16, dp: 144 }.shape();
        assert_eq!(s.nchunk, 2);
        // FMA, d 100 -> 128: 128 queries (fwd, dq), 64 keys (dkdv), all double-buffered.
        let s = Variant::Fma { dp: 128, big: false }.shape();
        assert_eq!((s.fwd_rows, s.dq_rows, s.dkdv_keys, s.nchunk), (128, 128, 64, 1));
        assert_eq!((s.smem_fwd, s.smem_dq, s.smem_dkdv), (155648, 223232, 160256));
        // The second tiling: the fwd and dkdv buffers no longer fit twice.
        let s = Variant::Fma { dp: 128, big: true }.shape();
        assert_eq!((s.smem_fwd, s.smem_dq, s.smem_dkdv), (172032, 223232, 176640));
        assert_eq!(Variant::Fma { dp: 256, big: false }.shape().nchunk, 2);
        assert_eq!(Variant::Fma { dp: 128, big: true }.name(), "flash_f32_d128b");
    }
}
