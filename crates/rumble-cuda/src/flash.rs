//! Flash attention: the recipes of `Op::Attention` and `Op::AttentionBackward` on the tiled
//! kernels of `kernels/flash_attn.cu` (bf16/f16 on the tensor cores, mma.sync m16n8k16 with
//! f32 accumulation) and `kernels/flash_fma.cu` (f32 with plain FMA and register-blocked
//! tiles; `RUMBLE_FLASH_FMA_CFG=b` picks its second tiling). Both keep their tiles
//! in shared memory and registers, save only o and the log-sum-exp, and need O(seq x head)
//! memory; the backward's only scratch is one f32 per query row (`delta = rowsum(dO * O)`),
//! part of the recipe's scratch and so of the node's planned scratch range.
//!
//! [`choose`] is the one place that decides between these kernels and the simple per-row
//! kernel of `kernels/attention.cu` (the fallback: f64, head sizes over 256, GPUs before
//! sm_80, or `RUMBLE_ATTENTION=naive`). One module is compiled per (dtype, padded head size),
//! and for the tensor-core kernels per tiling configuration [`Cfg`]: a few named sets of
//! compile-time tile sizes (`FCFG` in the kernel file), [`DEFAULT_CFG`] unless
//! `RUMBLE_FLASH_CFG=<name>` picks another (so one GPU run can time them all: the attention
//! bench's `RUMBLE_FLASH_SWEEP=1`).
//!
//! On sm_90 ([`wgmma`]) dQ at padded head sizes 64 and 128, and the forward at 128, run on the
//! warpgroup MMA (`wgmma.mma_async`, sm_90a; those modules are compiled for `sm_90a`).
//!
//! Deterministic: no atomics. The backward is three kernels, delta, then dK/dV (each block
//! owns a block of keys and walks its group's query heads and queries in a fixed order), then
//! dQ (each block owns a block of queries); or, where the configuration computes delta inside
//! the dQ kernel (each dQ block owns its rows' delta), two: dQ, then dK/dV.
//!
//! Grouped-query heads: a dK/dV block owns a block of keys of one kv head and sums over the
//! query heads of its group. Where that leaves the device short of blocks (seq 2048, 8 kv
//! heads: 256 blocks of very unequal causal work), [`dkdv_split`] splits each group over
//! several block rows, which write f32 partial sums into the recipe's scratch; a last kernel
//! (`flash_bwd_dkdv_sum`) adds them in split order, so the result stays deterministic (though
//! it may differ in the last bits between split counts). `RUMBLE_FLASH_SPLIT=n` forces n.
//!
//! Both operand layouts of `HeadLayout` run on the same kernels: the `Dims` blob carries the
//! element strides between heads and between positions of q/o/dO/dQ and of k/v/dK/dV
//! ([`dims_blob`]); rows of D stay contiguous, so the 16-byte loads stay valid (the row stride
//! is a multiple of D, and the kernels take the vectorised path only when D is a multiple of 8
//! for bf16/f16 or of 4 for f32, which keeps every row 16-byte aligned in either layout).
//!
//! Causal grids are paired ([`grid_columns`]): a CTA runs query (or key) block `i` and then
//! `n - 1 - i`, so every CTA does about the same work; unpaired, the longest blocks left a
//! third of the device idle at the end of the dK/dV kernel (ncu, H200, d128 x seq 4096).

use cudarc::driver::{result as drv, sys};
use rumble_core::ir::{DType, HeadLayout, Op, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::{Arg, Recipe, Step};
use crate::recipe::PRELUDE;

const MMA: &str = include_str!("kernels/flash_attn.cu");
const FMA: &str = include_str!("kernels/flash_fma.cu");
/// Threads per block of the tensor-core flash kernels (the forward's and dK/dV's come from its
/// [`Shape`]).
const THREADS: u32 = 128;
/// Threads per block of `fa2`'s dK/dV kernel (`fa::NT2` of flash_attn.cu).
const FA2_THREADS: usize = 256;
/// Threads per block of the FMA flash kernels (`fa::NT` of flash_fma.cu).
const FMA_THREADS: u32 = 256;
/// Opt-in shared memory per block on sm_90 (`fa::SMEM_MAX` of flash_fma.cu).
const SMEM_MAX: usize = 227 * 1024;
/// The largest head size the flash kernels take.
pub const MAX_HEAD: usize = 256;

/// A named tiling configuration of the tensor-core kernels: `FCFG` in kernels/flash_attn.cu,
/// whose comment describes each one. [`Variant::shape`] mirrors its launch shapes (checked by
/// a `static_assert` in the kernel file against the values [`Variant::source`] puts in).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cfg(u8);

/// The configurations' names, by `FCFG` number.
pub const CFG_NAMES: [&str; 8] = ["base", "wide", "deep", "w8", "pair", "fa2", "pair8", "paird"];
/// The configuration used unless `RUMBLE_FLASH_CFG` names another: `pair` (4). Once the tile
/// loads became cheap (unrolled, 32-bit, predicated cp.async) and dK/dV split a group's heads
/// ([`dkdv_split`]), `pair` was faster than `fa2` (5, an 8-warp dK/dV kernel that passes P and
/// dS through shared memory, capped at 128 registers and spilling at d128) on every shape of
/// the attention bench on the H200, 2026-12-03 (bench/results/2026-12-03-session6/run1, bthd):
/// fwd+bwd 0.439 vs 0.454 ms (d64 x 2048), 0.747 vs 0.786 (d128 x 2048), 1.402 vs 1.456 (d64 x
/// 4096), 2.538 vs 2.681 (d128 x 4096), 1.178 vs 1.182 (head size 1, GQA 7). (Before those
/// two changes fa2 had been the faster one at head size 1 and d64.)
///
/// Since 2026-12-04 (bench/results/2026-12-04-session7) pair takes 64-key forward softmax
/// steps and 64-query dK/dV tiles at d in (64, 128] (d128 x 4096: forward 0.50 vs 0.58 ms,
/// dK/dV 0.96 vs 1.14), and on sm_90 its dQ (d64, d128) and forward (d128) run on wgmma
/// ([`wgmma`]). Measured and dropped that day: dQ inside dK/dV with f32 atomics (dK/dV 2.04
/// ms against 1.14 + 0.63), dV and dK interleaved (no change), a wgmma dK/dV (1.43 vs 0.97).
///
/// `pair` (4) came from the H200 sweep of 2026-12-02 (bench/results/2026-12-02-session3/run3-sweep):
/// per kernel the fastest tiles of the others (wide's forward at d <= 64, 0.34 vs 0.36 ms;
/// wide's dQ at d = 16 and d128, 0.36 vs 0.47 and 0.79 vs 0.85 ms; base's dK/dV), and S and
/// dP interleaved in the backward (2.86 vs 2.91 ms at d128 x seq 4096 with base's tiles).
pub const DEFAULT_CFG: Cfg = Cfg(4);
/// The padded head sizes at which every configuration is compiled ahead ([`Variant::all`]),
/// tested on the GPU and timed by the attention bench (others compile on first use).
pub const SWEEP_DP: [usize; 3] = [16, 64, 128];

impl Cfg {
    /// Every configuration (for sweeps and tests).
    pub fn all() -> Vec<Cfg> {
        (0..CFG_NAMES.len() as u8).map(Cfg).collect()
    }

    pub fn name(self) -> &'static str {
        CFG_NAMES[self.0 as usize]
    }

    /// The configuration called `name`.
    pub fn parse(name: &str) -> Result<Cfg> {
        match CFG_NAMES.iter().position(|n| *n == name) {
            Some(i) => Ok(Cfg(i as u8)),
            None => Err(CudaError::usage(format!(
                "RUMBLE_FLASH_CFG={name:?}: not a flash-attention configuration (one of {})",
                CFG_NAMES.join(", ")
            ))),
        }
    }

    /// `RUMBLE_FLASH_CFG` if set (an error for an unknown name), else [`DEFAULT_CFG`].
    pub fn from_env() -> Result<Cfg> {
        match std::env::var("RUMBLE_FLASH_CFG") {
            Ok(v) if !v.is_empty() => Cfg::parse(&v),
            _ => Ok(DEFAULT_CFG),
        }
    }
}

/// Which flash kernels, for which padded head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Tensor cores: bf16 or f16 operands; `dp` = head size rounded up to 16 (at least 16);
    /// the tiling configuration; `wg`: dQ (where the configuration computes delta apart) and, at
    /// `dp` 128, the forward on Hopper's warpgroup MMA (`wgmma`, sm_90a only; [`wgmma`])
    /// instead of the configuration's mma.sync kernels.
    Mma { dtype: DType, dp: usize, cfg: Cfg, wg: bool },
    /// f32 with FMA; `dp` = head size rounded up to 32; `big`: the second tiling (64-key
    /// forward and 64-query dK/dV tiles instead of 32, `RUMBLE_FLASH_FMA_CFG=b`).
    Fma { dp: usize, big: bool },
}

/// The flash kernels for `dtype` and head size `d` on a GPU of compute capability `cc`, or
/// `None` where the per-row kernel runs instead. The only place this choice is made. (An unknown
/// `RUMBLE_FLASH_CFG` falls back to [`DEFAULT_CFG`] here; [`recipe`] reports it as an error.)
pub fn choose(cc: (i32, i32), dtype: DType, d: usize) -> Option<Variant> {
    if std::env::var("RUMBLE_ATTENTION").is_ok_and(|v| v == "naive") || cc < (8, 0) || d == 0 || d > MAX_HEAD {
        return None;
    }
    match dtype {
        DType::BF16 | DType::F16 => {
            let dp = d.div_ceil(16).max(1) * 16;
            Some(Variant::Mma { dtype, dp, cfg: Cfg::from_env().unwrap_or(DEFAULT_CFG), wg: wgmma(cc, dp) })
        }
        DType::F32 => Some(Variant::Fma { dp: d.div_ceil(32) * 32, big: fma_big() }),
        _ => None,
    }
}

/// Whether some kernels run on the warpgroup MMA (`bwd_dq_wg` and, at padded head size 128,
/// `fwd_wg` in kernels/flash_attn.cu): on sm_90 (H100, H200: `wgmma` is an sm_90a feature, not
/// in later architectures) at padded head sizes 64 and 128, unless `RUMBLE_FLASH_WG=0`. On the
/// H200 (2026-12-04, bench/results/2026-12-04-session7/run3, d128 x seq 4096, 32/8 heads,
/// causal): dQ 0.55 against 0.64 ms for pair's mma.sync kernel (d64: 0.36 against 0.38), the
/// forward 0.44 against 0.52 (at d64 0.34 against 0.32: not taken there). A first wgmma dK/dV
/// (two warpgroups, 128 keys, synchronous) took 1.43 ms against 0.97 and was dropped (commit
/// d003ebd holds it).
pub fn wgmma(cc: (i32, i32), dp: usize) -> bool {
    cc == (9, 0) && WGMMA_DP.contains(&dp) && !std::env::var("RUMBLE_FLASH_WG").is_ok_and(|v| v == "0")
}

/// The padded head sizes the wgmma kernels take (`FWG` in kernels/flash_attn.cu).
pub const WGMMA_DP: [usize; 2] = [64, 128];

/// The FMA kernels' tiling: the second (`b`, 64-key forward and 64-query dK/dV tiles) unless
/// `RUMBLE_FLASH_FMA_CFG=a`. On the H200 (2026-12-02) `b` took 5.24 ms fwd+bwd on seed-llama's
/// attention against 5.92 ms for `a`.
fn fma_big() -> bool {
    !std::env::var("RUMBLE_FLASH_FMA_CFG").is_ok_and(|v| v == "a")
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
    /// Threads per block of the forward kernel.
    pub fwd_threads: usize,
    /// The dQ kernel computes delta (and runs before dK/dV); no delta kernel.
    pub fused_delta: bool,
    /// Threads per block of the dK/dV kernel.
    pub dkdv_threads: usize,
    /// Threads per block of the dQ kernel.
    pub dq_threads: usize,
    /// dK/dV blocks that run at once on a multiprocessor (registers and shared memory).
    pub dkdv_per_sm: usize,
}

impl Variant {
    pub fn dp(&self) -> usize {
        match *self {
            Variant::Mma { dp, .. } | Variant::Fma { dp, .. } => dp,
        }
    }

    /// Threads per block of the variant's kernels but the tensor-core forward, dK/dV and dQ (see
    /// [`Shape`]).
    pub fn threads(&self) -> u32 {
        match self {
            Variant::Mma { .. } => THREADS,
            Variant::Fma { .. } => FMA_THREADS,
        }
    }

    /// Module name, e.g. `flash_bf16_d64_wide`, or `flash_f32_d128b` (FMA, second tiling).
    pub fn name(&self) -> String {
        match self {
            Variant::Mma { dtype, dp, cfg, wg } => {
                format!("flash_{}_d{dp}_{}{}", dtype.name(), cfg.name(), if *wg { "_wg" } else { "" })
            }
            Variant::Fma { dp, big } => format!("flash_f32_d{dp}{}", if *big { "b" } else { "" }),
        }
    }

    /// The full source NVRTC compiles for this variant.
    pub fn source(&self) -> String {
        match self {
            Variant::Mma { dtype, dp, cfg, wg } => {
                let f16 = (*dtype == DType::F16) as i32;
                let s = self.shape();
                let expect = [
                    ("FWD_ROWS", s.fwd_rows),
                    ("DQ_ROWS", s.dq_rows),
                    ("DKDV_KEYS", s.dkdv_keys),
                    ("NCHUNK", s.nchunk),
                    ("SMEM_FWD", s.smem_fwd),
                    ("SMEM_DQ", s.smem_dq),
                    ("SMEM_DKDV", s.smem_dkdv),
                    ("FWD_THREADS", s.fwd_threads),
                    ("FUSED_DELTA", s.fused_delta as usize),
                    ("DKDV_THREADS", s.dkdv_threads),
                    ("DQ_THREADS", s.dq_threads),
                ]
                .iter()
                .map(|(k, v)| format!("#define FEXPECT_{k} {v}\n"))
                .collect::<String>();
                format!(
                    "{PRELUDE}\n#define FT {}\n#define FLASH_F16 {f16}\n#define FDP {dp}\n#define FCFG {}\n#define FWG {}\n#define FEXPECT 1\n{expect}{MMA}",
                    dtype.name(),
                    cfg.0,
                    *wg as i32
                )
            }
            Variant::Fma { dp, big } => {
                format!("{PRELUDE}\n#define FDPF {dp}\n#define FLASH_FMA_CFG {}\n{FMA}", *big as i32)
            }
        }
    }

    pub fn shape(&self) -> Shape {
        match *self {
            Variant::Mma { dp, cfg, wg, .. } => {
                // The FCFG table at the top of namespace `fa` in kernels/flash_attn.cu.
                // `pair` (4): base's (0) tiles but wide's forward at d <= 64 and wide's dQ
                // tiles at d = 16 and d in (64, 128]. `fa2` (5): pair, but for d <= 128 the
                // 8-warp dK/dV kernel: 64 keys, query tiles of 64 (d <= 64) / 32, double-buffered
                // Q and dO, and [64][q2 + 8] tiles of P^T and dS^T.
                let pair = cfg.0 >= 4;
                // pair8 (6): pair with 8 warps (128 keys) in dK/dV.
                let dknw = if cfg.0 == 6 { 8 } else { 4 };
                let fa2 = cfg.0 == 5 && dp <= 128;
                let q2 = if dp <= 64 { 64 } else { 32 };
                let (c, ld) = (if pair { 0 } else { cfg.0 }, dp + 8);
                let fnw = if c == 3 { 8 } else { 4 };
                let fmt = if dp > 128 || (c == 3 && dp > 64) { 1 } else { 2 };
                // pair8 takes wide's forward tiles.
                let fw = c != 0 || cfg.0 == 6;
                // pair (and fa2, paird) at d in (64, 128] but 112: 64-key forward stages in one step.
                let pf = pair && cfg.0 != 6 && dp > 64 && dp <= 128 && dp != 112;
                let fbc = match (fw, dp) {
                    _ if pf => 64,
                    _ if pair && dp <= 64 => 128,
                    (false, ..=64) => 64,
                    (false, _) => 32,
                    (_, ..=64) => 128,
                    (_, ..=128) => 64,
                    _ => 32,
                };
                let (d64, d128) = (dp <= 64, dp <= 128);
                let pq2 = pair && d128 && (dp <= 16 || !d64);
                let kmt = if c != 0 && d64 { 2 } else { 1 };
                let bq = match c {
                    0 if d64 || (pair && d128) => 64,
                    2 if d64 => 16,
                    _ => 32,
                };
                let qmt = match c {
                    _ if pq2 => 2,
                    0 => 1,
                    2 if d64 => 2,
                    2 => 1,
                    _ if d128 => 2,
                    _ => 1,
                };
                let bc = match c {
                    _ if pq2 && d64 => 64,
                    _ if pq2 => 32,
                    0 if d128 => 64,
                    2 if d64 => 32,
                    2 if d128 => 64,
                    1 | 3 if d64 => 64,
                    _ => 32,
                };
                // paird (7): pair with delta inside the dQ kernel.
                let fused_delta = c != 0 || cfg.0 == 7;
                let (fbr, br, bk, dc) = (fnw * 16 * fmt, 64 * qmt, dknw * 16 * kmt, dp.min(128));
                // The wgmma forward (at dp 128): 128 queries, 256 threads, Q and two stages of 64
                // keys of K and V unpadded (swizzled) plus 1 KiB to align them.
                let (fwd_rows, smem_fwd, fwd_threads) = if wg && dp == 128 {
                    (128, (128 + 4 * 64) * dp * 2 + 1024, 256)
                } else {
                    (fbr, (fbr + 4 * fbc) * ld * 2, 32 * fnw)
                };
                // And dQ (but where the configuration computes delta in it): 128 queries, 256
                // threads, Q, dO and two stages of K and V.
                let (dq_rows, smem_dq, dq_threads) = if wg && !fused_delta {
                    (128, (2 * 128 + 4 * 64) * dp * 2 + 1024, 256)
                } else {
                    (br, (2 * br + 4 * bc) * ld * 2 + if fused_delta { br * 4 } else { 0 }, THREADS as usize)
                };
                Shape {
                    fwd_rows,
                    dq_rows,
                    dkdv_keys: if fa2 { 64 } else { bk },
                    nchunk: if fa2 { 1 } else { dp.div_ceil(dc) },
                    smem_fwd,
                    smem_dq,
                    smem_dkdv: if fa2 {
                        (2 * 64 + 4 * q2) * ld * 2 + 2 * 64 * (q2 + 8) * 2 + 4 * q2 * 4
                    } else {
                        (2 * bk + 4 * bq) * ld * 2 + 4 * bq * 4
                    },
                    fwd_threads,
                    fused_delta,
                    dkdv_threads: if fa2 { FA2_THREADS } else { 32 * dknw },
                    dq_threads,
                    dkdv_per_sm: if dknw == 8 && !fa2 { 1 } else { 2 },
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
                    fwd_threads: FMA_THREADS as usize,
                    fused_delta: false,
                    dkdv_threads: FMA_THREADS as usize,
                    dq_threads: FMA_THREADS as usize,
                    dkdv_per_sm: 1,
                }
            }
        }
    }

    /// The NVRTC architecture of the variant's module on a device of architecture `arch`
    /// (`sm_90`): `sm_90a` for the wgmma kernels.
    pub fn arch(&self, arch: &str) -> String {
        match self {
            Variant::Mma { wg: true, .. } => format!("{arch}a"),
            _ => arch.to_string(),
        }
    }

    /// Every variant the default choice can make on sm_90 and before, and every other
    /// configuration at the padded head sizes [`SWEEP_DP`] (for the offline compile test, which
    /// also fills the kernel cache the GPU machine starts from).
    pub fn all() -> Vec<Variant> {
        let mma = |dtype, dp, cfg, wg| Variant::Mma { dtype, dp, cfg, wg };
        let wg = |dp: usize| WGMMA_DP.contains(&dp);
        let mut v = Vec::new();
        for dtype in [DType::BF16, DType::F16] {
            for i in 1..=16 {
                v.push(mma(dtype, 16 * i, DEFAULT_CFG, false));
                if wg(16 * i) {
                    v.push(mma(dtype, 16 * i, DEFAULT_CFG, true));
                }
            }
        }
        for cfg in Cfg::all().into_iter().filter(|c| *c != DEFAULT_CFG) {
            for dp in SWEEP_DP {
                v.push(mma(DType::BF16, dp, cfg, false));
                if wg(dp) {
                    v.push(mma(DType::BF16, dp, cfg, true));
                }
            }
        }
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
    let (scale, causal, layout, backward) = match op {
        Op::Attention { scale, causal, layout } => (*scale, *causal, *layout, false),
        Op::AttentionBackward { scale, causal, layout } => (*scale, *causal, *layout, true),
        _ => return None,
    };
    let ([b, hq, t, d], [_, hkv, s, _]) = (layout.bhtd(at[0].dims()), layout.bhtd(at[1].dims()));
    let variant = choose(dev.capability, at[0].dtype, d)?;
    if let (Variant::Mma { .. }, Err(e)) = (variant, Cfg::from_env()) {
        return Some(Err(e));
    }
    let sh = variant.shape();
    // The kernels' tile loads offset rows within a tile (at most 256 rows) in 32 bits.
    let rs = layout.strides(hq, t, d).1.max(layout.strides(hkv, s, d).1);
    // The wgmma forward indexes positions in 32 bits.
    if b * hq > 65535 || b * hkv > 65535 || rs.saturating_mul(256) > i32::MAX as usize || t.max(s) >= 1 << 30 {
        return None;
    }
    let need = if backward { sh.smem_dq.max(sh.smem_dkdv) } else { sh.smem_fwd };
    match smem_limit(dev) {
        Ok(limit) if need > limit => return None,
        Ok(_) => {}
        Err(e) => return Some(Err(e)),
    }
    Some(build(dev, variant, sh, backward, (scale, causal, layout), [b, hq, hkv, t, s, d]))
}

/// The `Dims` blob of every attention kernel (flash and per-row): `b, hq, hkv, t, s, d`, then
/// the element strides between heads and between positions of q, o, dO, dQ and of k, v, dK, dV
/// in `layout` (`HeadLayout::strides`).
pub fn dims_blob(layout: HeadLayout, [b, hq, hkv, t, s, d]: [usize; 6]) -> Arg {
    let (qhs, qrs) = layout.strides(hq, t, d);
    let (khs, krs) = layout.strides(hkv, s, d);
    Arg::Blob([b, hq, hkv, t, s, d, qhs, qrs, khs, krs].iter().map(|&x| x as u64).collect())
}

fn build(
    dev: &Device,
    variant: Variant,
    sh: Shape,
    backward: bool,
    (scale, causal, layout): (f64, bool, HeadLayout),
    [b, hq, hkv, t, s, d]: [usize; 6],
) -> Result<Recipe> {
    let name = variant.name();
    let module = dev.module_on(&variant.arch(&dev.arch), &name, &variant.source(), OPTIONS)?;
    let mma = matches!(variant, Variant::Mma { .. });
    let kernel = |kname: &str, grid: (usize, usize), smem: usize, args: Vec<Arg>| -> Result<Step> {
        let func = module.function(kname)?;
        if smem > 48 * 1024 {
            dev.bind()?;
            let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            unsafe { drv::function::set_function_attribute(func.0, attr, smem as i32) }
                .ctx(|| format!("allowing {smem} bytes of shared memory to `{kname}` in `{name}`"))?;
        }
        let grid = (u32::try_from(grid.0).map_err(|_| CudaError::usage(format!("grid of {kname}")))?, grid.1 as u32, 1);
        let block = match kname {
            "flash_fwd" => sh.fwd_threads as u32,
            "flash_bwd_dkdv" => sh.dkdv_threads as u32,
            "flash_bwd_dq" => sh.dq_threads as u32,
            _ => variant.threads(),
        };
        Ok(Step::Kernel { func, name: format!("{name}/{kname}"), grid, block, smem: smem as u32, args })
    };
    let sms = dev.multiprocessors.max(1);
    let cols = |n: usize, rows: usize| grid_columns(causal, n, rows, sms);
    let dims = dims_blob(layout, [b, hq, hkv, t, s, d]);
    let (sc, ca) = (Arg::F64(scale), Arg::I32(causal as i32));
    let mut steps = Vec::new();
    let rows = b * hq * t;
    if !backward {
        if rows > 0 {
            let args = vec![Arg::In(0), Arg::In(1), Arg::In(2), Arg::Out(0), Arg::Out(1), dims, sc, ca];
            steps.push(kernel("flash_fwd", (cols(t.div_ceil(sh.fwd_rows), b * hq), b * hq), sh.smem_fwd, args)?);
        }
        return Ok(Recipe { op: "attention", steps, scratch: 0, node_scratch: 0 });
    }
    // Scratch: delta, one f32 per query row: from its own kernel, or (`fused_delta`) from the
    // dQ kernel, which then runs first.
    if rows > 0 && !sh.fused_delta {
        let blocks = rows.div_ceil(variant.threads() as usize / 32).clamp(1, dev.multiprocessors.max(1) * 16);
        let args = vec![Arg::In(3), Arg::In(5), Arg::Scratch(0), dims.clone()];
        steps.push(kernel("flash_bwd_delta", (blocks, 1), 0, args)?);
    }
    let mut dq_step = None;
    if rows > 0 {
        // The tensor-core dQ kernel also takes o (for the fused delta).
        let mut args = vec![Arg::In(0), Arg::In(1), Arg::In(2)];
        if mma {
            args.push(Arg::In(3));
        }
        args.extend([Arg::In(4), Arg::In(5), Arg::Scratch(0), Arg::Out(0), dims.clone(), sc.clone(), ca.clone()]);
        dq_step = Some(kernel("flash_bwd_dq", (cols(t.div_ceil(sh.dq_rows), b * hq), b * hq), sh.smem_dq, args)?);
    }
    if sh.fused_delta {
        steps.extend(dq_step.take());
    }
    // Scratch: delta, then (the tensor-core kernels with their group's heads split) the f32
    // partial sums of dK and dV.
    let delta_bytes = (rows * 4).div_ceil(256) * 256;
    let mut scratch = delta_bytes;
    if b * hkv * s > 0 {
        let kblocks = s.div_ceil(sh.dkdv_keys);
        let plane = b * hkv * s * d;
        let nsplit =
            if mma { dkdv_split(hq / hkv, kblocks * b * hkv, plane, sms * sh.dkdv_per_sm, causal)? } else { 1 };
        let mut args =
            vec![Arg::In(0), Arg::In(1), Arg::In(2), Arg::In(4), Arg::In(5), Arg::Scratch(0), Arg::Out(1), Arg::Out(2)];
        if mma {
            args.extend([Arg::Scratch(delta_bytes), Arg::I32(nsplit as i32)]);
        }
        args.extend([dims.clone(), sc, ca]);
        let y = b * hkv * nsplit;
        if y > 65535 {
            return Err(CudaError::usage(format!("attention backward: {y} dK/dV block rows (limit 65535)")));
        }
        steps.push(kernel("flash_bwd_dkdv", (cols(kblocks, y) * sh.nchunk, y), sh.smem_dkdv, args)?);
        if nsplit > 1 {
            scratch += 2 * nsplit * plane * 4;
            let blocks = plane.div_ceil(THREADS as usize).clamp(1, sms * 8);
            let args = vec![Arg::Scratch(delta_bytes), Arg::Out(1), Arg::Out(2), dims, Arg::I32(nsplit as i32)];
            steps.push(kernel("flash_bwd_dkdv_sum", (blocks, 1), 0, args)?);
        }
    }
    steps.extend(dq_step);
    Ok(Recipe { op: "attention_backward", steps, scratch, node_scratch: 0 })
}

/// The most bytes of f32 partial sums the dK/dV split may take (a cap; it halves the split
/// until under it).
const SPLIT_MAX_BYTES: usize = 256 << 20;

/// Into how many block rows the tensor-core dK/dV kernel splits each kv head's group of
/// `group` query heads: `RUMBLE_FLASH_SPLIT` if set (clamped to 1..=group), else the smallest
/// divisor of the group that gives at least two blocks of keys per CTA slot (`slots`: blocks
/// that run at once on the whole device; the causal grid then pairs, two blocks a CTA) where
/// there are fewer than one and a half, with
/// the partial sums (`2 x split x plane` f32) under [`SPLIT_MAX_BYTES`]. `blocks`: blocks of
/// keys without a split (key blocks x batch x kv heads); `plane`: elements of dK.
pub fn dkdv_split(group: usize, blocks: usize, plane: usize, slots: usize, causal: bool) -> Result<usize> {
    let fits = |n: usize| n == 1 || 2 * n * plane * 4 <= SPLIT_MAX_BYTES;
    if let Ok(v) = std::env::var("RUMBLE_FLASH_SPLIT")
        && !v.is_empty()
    {
        let n: usize = v
            .parse()
            .map_err(|_| CudaError::usage(format!("RUMBLE_FLASH_SPLIT={v:?}: not a whole number of splits")))?;
        return Ok(n.clamp(1, group.max(1)));
    }
    // Causal blocks differ in work (paired, two per CTA): with three blocks per multiprocessor
    // (two CTA slots each) already there (seq 4096, 8 kv heads: 512 blocks) the split did not pay for its partial
    // sums on the H200 (d64: 1.425 ms fwd+bwd unsplit against 1.456 split in two; 2026-12-03,
    // bench/results/2026-12-03-session6/run1); with 256 blocks a split of 4 took dK/dV from
    // 0.65 to 0.38 ms at d128 x 2048. Without a mask the blocks are equal: one CTA per
    // multiprocessor's worth is enough.
    let (enough, want) = if causal { (3 * slots / 2, 2 * slots) } else { (slots / 2, slots) };
    if blocks >= enough {
        return Ok(1);
    }
    let n = (1..=group.max(1)).find(|&n| group.is_multiple_of(n) && blocks * n >= want).unwrap_or(group.max(1));
    Ok((1..=n).rev().find(|&m| group.is_multiple_of(m) && fits(m)).unwrap_or(1))
}

/// Grid columns for `n` blocks of causal work per row of the grid (`rows` rows): block `i`
/// sees about `n - i` tiles, so while half as many CTAs still give every multiprocessor one,
/// each CTA runs two blocks, `i` and `n - 1 - i`, and all do about the same work (the kernels
/// see `gridDim.x < n` and pair). Without a mask all blocks are equal: one per CTA.
pub fn grid_columns(causal: bool, n: usize, rows: usize, sms: usize) -> usize {
    if causal && n >= 2 && n.div_ceil(2) * rows >= sms { n.div_ceil(2) } else { n }
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
        let cfg = Cfg::from_env().unwrap_or(DEFAULT_CFG);
        let wg = false;
        assert_eq!(choose(h100, DType::BF16, 1), Some(Variant::Mma { dtype: DType::BF16, dp: 16, cfg, wg }));
        assert_eq!(choose(h100, DType::BF16, 100), Some(Variant::Mma { dtype: DType::BF16, dp: 112, cfg, wg }));
        // The wgmma kernels: sm_90 only, head sizes padded to 64 or 128 (unless RUMBLE_FLASH_WG=0).
        let wg = !std::env::var("RUMBLE_FLASH_WG").is_ok_and(|v| v == "0");
        assert_eq!(choose(h100, DType::BF16, 120), Some(Variant::Mma { dtype: DType::BF16, dp: 128, cfg, wg }));
        assert_eq!(choose(h100, DType::F16, 64), Some(Variant::Mma { dtype: DType::F16, dp: 64, cfg, wg }));
        let wg = false;
        assert_eq!(choose((8, 0), DType::BF16, 128), Some(Variant::Mma { dtype: DType::BF16, dp: 128, cfg, wg }));
        assert_eq!(choose((10, 0), DType::BF16, 64), Some(Variant::Mma { dtype: DType::BF16, dp: 64, cfg, wg }));
        assert!(matches!(choose(h100, DType::F32, 100), Some(Variant::Fma { dp: 128, .. })));
        assert_eq!(choose(h100, DType::F64, 64), None);
        assert_eq!(choose(h100, DType::BF16, 257), None);
        assert_eq!(choose((7, 5), DType::BF16, 64), None);
    }

    #[test]
    fn configurations_have_names() {
        for c in Cfg::all() {
            assert_eq!(Cfg::parse(c.name()).unwrap(), c);
        }
        assert_eq!(Cfg::parse("base").unwrap(), Cfg(0));
        let e = Cfg::parse("huge").unwrap_err().to_string();
        assert!(e.contains("huge") && e.contains("wide"), "{e}");
        let a = Variant::Mma { dtype: DType::BF16, dp: 64, cfg: Cfg(0), wg: false };
        let b = Variant::Mma { dtype: DType::BF16, dp: 64, cfg: Cfg(1), wg: false };
        let c = Variant::Mma { dtype: DType::BF16, dp: 64, cfg: Cfg(1), wg: true };
        assert_ne!(a.name(), b.name());
        assert_ne!(b.name(), c.name());
        assert!(b.source().contains("#define FCFG 1\n") && b.source().contains("#define FWG 0\n"));
        assert!(c.source().contains("#define FWG 1\n"));
        assert_eq!((b.arch("sm_90"), c.arch("sm_90")), ("sm_90".to_string(), "sm_90a".to_string()));
    }

    #[test]
    fn causal_grids_pair_blocks_while_the_device_stays_full() {
        // 32 query blocks x 32 heads on 132 multiprocessors: 16 CTA columns, two blocks each.
        assert_eq!(grid_columns(true, 32, 32, 132), 16);
        assert_eq!(grid_columns(true, 33, 32, 132), 17);
        // Without a mask every block does the same work; too few CTAs: keep them all.
        assert_eq!(grid_columns(false, 32, 32, 132), 32);
        assert_eq!(grid_columns(true, 8, 4, 132), 8);
        assert_eq!(grid_columns(true, 1, 1000, 132), 1);
    }

    #[test]
    fn the_dkdv_split_fills_the_device_within_its_memory_cap() {
        if std::env::var("RUMBLE_FLASH_SPLIT").is_ok() {
            println!("skipped: RUMBLE_FLASH_SPLIT is set");
            return;
        }
        // GQA 4, 8 kv heads, seq 2048 (32 blocks of 64 keys): 256 blocks, 4 x 132 wanted.
        let plane = 8 * 2048 * 128;
        assert_eq!(dkdv_split(4, 256, plane, 264, true).unwrap(), 4);
        // seq 4096: 512 blocks, enough without a split; 300 blocks: split in two.
        assert_eq!(dkdv_split(4, 512, 2 * plane, 264, true).unwrap(), 1);
        assert_eq!(dkdv_split(4, 300, 2 * plane, 264, true).unwrap(), 2);
        // Without a mask, one CTA per multiprocessor is enough.
        assert_eq!(dkdv_split(4, 132, 2 * plane, 264, false).unwrap(), 1);
        assert_eq!(dkdv_split(4, 100, 2 * plane, 264, false).unwrap(), 4);
        // Only divisors of the group: 7 heads split 7 ways (qwen2, head size 1), or not at all.
        assert_eq!(dkdv_split(7, 256, 4 * 4096, 264, true).unwrap(), 7);
        assert_eq!(dkdv_split(1, 16, plane, 264, true).unwrap(), 1);
        // One 8-warp block per multiprocessor (pair8, 128 keys): 256 blocks at seq 4096 are
        // enough; 128 at seq 2048 split four ways.
        assert_eq!(dkdv_split(4, 256, plane, 132, true).unwrap(), 1);
        assert_eq!(dkdv_split(4, 128, plane, 132, true).unwrap(), 4);
        // The partial sums stay under the cap: 2 x 4 x 64 Mi elements x 4 bytes is too much.
        assert_eq!(dkdv_split(4, 256, 64 << 20, 264, true).unwrap(), 1);
        assert_eq!(dkdv_split(4, 256, 8 << 20, 264, true).unwrap(), 4);
        assert_eq!(dkdv_split(4, 256, 16 << 20, 264, true).unwrap(), 2);
    }

    #[test]
    fn every_variant_fits_an_h100_block() {
        // 227 KiB of opt-in shared memory per block on sm_90; every configuration at every size.
        let mut all = Variant::all();
        for cfg in Cfg::all() {
            all.extend((1..=16).map(|i| Variant::Mma { dtype: DType::BF16, dp: 16 * i, cfg, wg: false }));
            all.extend(WGMMA_DP.map(|dp| Variant::Mma { dtype: DType::BF16, dp, cfg, wg: true }));
        }
        for v in all {
            let s = v.shape();
            for (what, bytes) in [("fwd", s.smem_fwd), ("dq", s.smem_dq), ("dkdv", s.smem_dkdv)] {
                assert!(bytes <= 227 * 1024, "{} {what}: {bytes} bytes", v.name());
            }
            assert!(s.fwd_threads <= 1024 && s.fwd_threads % 32 == 0, "{}", v.name());
            assert!(s.dkdv_threads <= 1024 && s.dkdv_threads % 32 == 0, "{}", v.name());
        }
        // Spot values, computed by hand from the kernel file's formulas.
        let mma = |dp, c| Variant::Mma { dtype: DType::BF16, dp, cfg: Cfg(c), wg: false }.shape();
        // The wgmma forward: 128 queries by 256 threads, (128 + 4 x 64) x 128 x 2 + 1024 bytes;
        // at dp 64 only dQ.
        let w64 = Variant::Mma { dtype: DType::BF16, dp: 64, cfg: Cfg(4), wg: true }.shape();
        assert_eq!(
            (w64.fwd_rows, w64.smem_fwd, w64.dq_rows, w64.dq_threads),
            (mma(64, 4).fwd_rows, mma(64, 4).smem_fwd, 128, 256)
        );
        let w = Variant::Mma { dtype: DType::BF16, dp: 128, cfg: Cfg(4), wg: true }.shape();
        assert_eq!((w.fwd_rows, w.fwd_threads, w.smem_fwd), (128, 256, 99328));
        // And dQ: 128 queries by 256 threads, (2 x 128 + 4 x 64) x 128 x 2 + 1024 bytes; not where
        // delta is computed in dQ (paird).
        assert_eq!((w.dq_rows, w.dq_threads, w.smem_dq, w.smem_dkdv), (128, 256, 132096, mma(128, 4).smem_dkdv));
        let w7 = Variant::Mma { dtype: DType::BF16, dp: 128, cfg: Cfg(7), wg: true }.shape();
        assert_eq!((w7.dq_rows, w7.dq_threads, w7.smem_dq), (mma(128, 7).dq_rows, 128, mma(128, 7).smem_dq));
        let s = mma(128, 0);
        assert_eq!((s.fwd_rows, s.smem_fwd, s.smem_dq, s.smem_dkdv, s.nchunk), (128, 69632, 104448, 70144, 1));
        assert!(!s.fused_delta);
        // wide, d64: 128 queries x (128 + 4 x 128 keys); dq 128 rows, 64-key tiles, + delta;
        // dk/dv 128 keys, 32-query tiles.
        let s = mma(64, 1);
        assert_eq!((s.fwd_rows, s.smem_fwd, s.dq_rows, s.smem_dq), (128, 92160, 128, 74240));
        assert_eq!((s.dkdv_keys, s.smem_dkdv, s.fwd_threads), (128, 55808, 128));
        assert!(s.fused_delta);
        let s = mma(128, 3);
        assert_eq!((s.fwd_rows, s.fwd_threads, s.smem_fwd), (128, 256, 104448));
        assert_eq!(mma(144, 1).nchunk, 2);
        // fa2: pair but for dK/dV at d <= 128: 256 threads, 64 keys, one chunk; d128: (2 x 64 +
        // 4 x 32) x 136 x 2 + 2 x 64 x 40 x 2 + 4 x 32 x 4; d64: 64-query tiles; above 128 pair's.
        let (p, s) = (mma(128, 4), mma(128, 5));
        assert_eq!((s.fwd_rows, s.dq_rows, s.smem_fwd, s.smem_dq), (p.fwd_rows, p.dq_rows, p.smem_fwd, p.smem_dq));
        assert_eq!((s.dkdv_threads, s.dkdv_keys, s.nchunk, s.smem_dkdv), (256, 64, 1, 80384));
        assert_eq!((mma(64, 5).smem_dkdv, mma(64, 5).dkdv_threads), (74752, 256));
        assert_eq!(mma(144, 5), mma(144, 4));
        // pair8: pair with 8 warps (128 keys) in dK/dV: (2 x 128 + 4 x 64) x 136 x 2 + 4 x 64 x 4
        // at d128 (64-query tiles, as pair).
        let s = mma(128, 6);
        assert_eq!((s.dkdv_keys, s.dkdv_threads, s.smem_dkdv, s.nchunk), (128, 256, 140288, 1));
        assert_eq!((s.fwd_rows, s.dq_rows, s.smem_dq), (p.fwd_rows, p.dq_rows, p.smem_dq));
        assert_eq!((s.smem_fwd, mma(128, 1).smem_fwd), (104448, 104448)); // wide's forward: 64-key stages
        assert_eq!(mma(64, 6).smem_dkdv, 74752);
        assert_eq!(mma(256, 5), mma(256, 4));
        assert_eq!(p.dkdv_threads, 128);
        // pair at d128: 64-key forward stages, (128 + 4 x 64) x 136 x 2; 64-query dK/dV tiles,
        // (2 x 64 + 4 x 64) x 136 x 2 + 4 x 64 x 4. paird: and delta in dQ (128 rows x 4 bytes).
        assert_eq!((p.smem_fwd, mma(64, 4).smem_fwd, mma(256, 4).smem_fwd), (104448, 92160, 101376));
        assert_eq!((p.smem_dkdv, p.dkdv_keys, p.fused_delta), (105472, 64, false));
        let q = mma(128, 7);
        assert_eq!(
            (q.smem_dkdv, q.smem_fwd, q.smem_dq, q.fused_delta),
            (p.smem_dkdv, p.smem_fwd, p.smem_dq + 512, true)
        );
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
