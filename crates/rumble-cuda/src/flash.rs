//! Flash attention: the recipes of `Op::Attention` and `Op::AttentionBackward` on the tiled
//! kernels of `kernels/flash_attn.cu` (bf16/f16 on the tensor cores, mma.sync m16n8k16 with
//! f32 accumulation; on sm_90 some on the warpgroup MMA of `kernels/flash_wg.cuh`) and
//! `kernels/flash_fma.cu` (f32 with plain FMA and register-blocked tiles). Both keep their
//! tiles in shared memory and registers, save only o and the log-sum-exp, and need
//! O(seq x head) memory; the backward's only scratch is one f32 per query row
//! (`delta = rowsum(dO * O)`), part of the recipe's scratch and so of the node's planned scratch
//! range.
//!
//! [`choose`] is the one place that decides between these kernels and the simple per-row
//! kernel of `kernels/attention.cu` (the fallback: f64, head sizes over 256, GPUs before
//! sm_80, or `RUMBLE_ATTENTION=naive`). One module is compiled per (dtype, padded head size):
//! the tile sizes of its head-size bucket ([`Tiles`], here and nowhere else) and the launch
//! shape they give ([`Launch`]) go into the source as `#define`s ([`Variant::source`]), so the
//! kernel files hold no tile decision of their own.
//!
//! Deterministic: no atomics. The backward is three kernels, delta, then dK/dV (each block
//! owns a block of keys and walks its group's query heads and queries in a fixed order), then
//! dQ (each block owns a block of queries).
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

use rumble_core::ir::{DType, HeadLayout, Op, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::{FLASH_ATTN, FLASH_COMMON, FLASH_FMA, FLASH_WG, PRELUDE};
use crate::knobs::Knobs;
use crate::launch::{Arg, Recipe, Step};

/// Threads per block of the tensor-core kernels on mma.sync (4 warps), and of the delta and
/// partial-sum kernels.
const THREADS: usize = 128;
/// Threads per block of the wgmma kernels (two warpgroups).
const WG_THREADS: usize = 256;
/// Threads per block of the FMA flash kernels.
const FMA_THREADS: usize = 256;
/// Opt-in shared memory per block on sm_90 (what the FMA tiles are sized against).
const SMEM_MAX: usize = 227 * 1024;
/// The largest head size the flash kernels take.
pub const MAX_HEAD: usize = 256;

/// The tile sizes of the tensor-core kernels for one bucket of padded head sizes (the only
/// place they are set; [`Variant::source`] writes them into the kernel source as `#define`s).
/// Every kernel on mma.sync has 4 warps; a warp owns 16 rows of each product per m-tile.
///
/// These are the tiles of `pair`, the fastest of the tilings timed on the H200 per kernel and
/// head size (the others were removed after commit 6633b94, which holds them and their sweep):
/// S and dP computed in one interleaved loop; 64-key forward steps at d in (64, 128] but 112
/// (where ptxas spills); 64-query dK/dV tiles up to d128; 32 queries a warp in dQ at d16 and
/// (64, 128].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Forward: queries per block (4 warps of `fwd_rows / 64` m-tiles each).
    pub fwd_rows: usize,
    /// Forward: keys per shared-memory stage (two stages, double-buffered).
    pub fwd_keys: usize,
    /// Forward: keys per online-softmax step (a divisor of `fwd_keys`).
    pub fwd_step: usize,
    /// dK/dV: queries per tile (64 keys a block, 16 a warp).
    pub dkdv_queries: usize,
    /// dQ: queries per block (4 warps of `dq_rows / 64` m-tiles each).
    pub dq_rows: usize,
    /// dQ: keys per tile.
    pub dq_keys: usize,
    /// On sm_90, the forward on the warpgroup MMA ([`WG_FWD`]) instead, where the padded head
    /// size is 64 or 128 (the wgmma kernels' swizzled rows).
    pub fwd_wg: bool,
    /// On sm_90, dQ on the warpgroup MMA ([`WG_DQ`]), likewise.
    pub dq_wg: bool,
}

/// Padded head size 16 (head sizes 1..=16).
pub const D16: Tiles = Tiles {
    fwd_rows: 128,
    fwd_keys: 128,
    fwd_step: 64,
    dkdv_queries: 64,
    dq_rows: 128,
    dq_keys: 64,
    fwd_wg: false,
    dq_wg: false,
};
/// Padded head sizes 32..=64. On the H200 the wgmma forward was slower here than mma.sync
/// (0.34 against 0.32 ms at seq 4096); its dQ faster (0.36 against 0.38).
pub const D64: Tiles = Tiles { dq_rows: 64, dq_wg: true, ..D16 };
/// Padded head sizes 80, 96 and 128: 64-key forward steps (each Q fragment read feeds 16 mma),
/// 32 queries a warp in dQ. On the H200 at d128 x seq 4096 the wgmma forward took 0.44 against
/// 0.52 ms, the wgmma dQ 0.55 against 0.64. dK/dV stays on mma.sync: a wgmma dK/dV of two
/// warpgroups over 128 keys took 1.43 against 0.97 ms (H200); one of one warpgroup over 64 keys,
/// two blocks a multiprocessor, P^T computed while dP^T ran and dS^T while dV's product ran
/// (commit f1bd7c6), took 0.970 against 0.955 ms at d128 x 4096 and 0.298 against 0.279 at
/// d128 x 2048, 0.188 against 0.172 at d64 x 2048 (H100, bthd): both removed.
pub const D128: Tiles = Tiles { fwd_keys: 64, dq_keys: 32, fwd_wg: true, dq_wg: true, ..D16 };
/// Padded head size 112: D128's tiles but 32-key forward steps (64 spill 84 bytes there).
pub const D112: Tiles = Tiles { fwd_keys: 32, fwd_step: 32, fwd_wg: false, dq_wg: false, ..D128 };
/// Padded head sizes 144..=256: one m-tile a warp, 32-key and 32-query tiles; dK/dV in head-dim
/// chunks of 128.
pub const D256: Tiles = Tiles {
    fwd_rows: 64,
    fwd_keys: 32,
    fwd_step: 32,
    dkdv_queries: 32,
    dq_rows: 64,
    dq_keys: 32,
    fwd_wg: false,
    dq_wg: false,
};

/// The wgmma forward's block (`fwd_wg`): 128 queries by two warpgroups, 64-key stages.
pub const WG_FWD: (usize, usize) = (128, 64);
/// The wgmma dQ's block (`bwd_dq_wg`): 128 queries by two warpgroups, 64-key stages.
pub const WG_DQ: (usize, usize) = (128, 64);

impl Tiles {
    /// The bucket of padded head size `dp` (a multiple of 16 up to [`MAX_HEAD`]).
    pub fn of(dp: usize) -> Tiles {
        match dp {
            0..=16 => D16,
            17..=64 => D64,
            112 => D112,
            65..=111 | 113..=128 => D128,
            _ => D256,
        }
    }
}

/// Which flash kernels, for which padded head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Tensor cores: bf16 or f16 operands; `dp` = head size rounded up to 16 (at least 16);
    /// `wg`: the device takes Hopper's warpgroup MMA (sm_90, [`wgmma`]), so the bucket's wgmma
    /// kernels run where it has them.
    Mma { dtype: DType, dp: usize, wg: bool },
    /// f32 with FMA; `dp` = head size rounded up to 32.
    Fma { dp: usize },
}

/// The flash kernels for `dtype` and head size `d` on a GPU of compute capability `cc` with
/// `knobs`, or `None` where the per-row kernel runs instead. The only place this choice is made.
pub fn choose(cc: (i32, i32), dtype: DType, d: usize, knobs: &Knobs) -> Option<Variant> {
    if knobs.attention == crate::knobs::AttentionImpl::Naive || cc < (8, 0) || d == 0 || d > MAX_HEAD {
        return None;
    }
    match dtype {
        DType::BF16 | DType::F16 => Some(Variant::Mma { dtype, dp: d.div_ceil(16) * 16, wg: wgmma(cc, knobs) }),
        DType::F32 => Some(Variant::Fma { dp: d.div_ceil(32) * 32 }),
        _ => None,
    }
}

/// Whether the device runs the wgmma kernels: sm_90 (H100, H200; `wgmma` is an sm_90a
/// feature, not in later architectures), unless `RUMBLE_FLASH_WG=0`.
pub fn wgmma(cc: (i32, i32), knobs: &Knobs) -> bool {
    cc == (9, 0) && knobs.flash_wgmma
}

/// `("FA_FIELD", value)` for each named field of a [`Launch`] (flags as 0 or 1): a define is
/// its field's name in capitals, so the kernel files and the struct cannot drift apart.
macro_rules! launch_defines {
    ($s:ident; $($field:ident),* $(,)?) => {
        [$((concat!("FA_", stringify!($field)).to_uppercase(), ($s.$field as usize).to_string())),*]
    };
}

/// The launch shape of a variant's kernels, from its [`Tiles`] (or the FMA tiling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub fwd_rows: usize,
    /// Forward: keys per shared stage and per softmax step.
    pub fwd_keys: usize,
    pub fwd_step: usize,
    pub dq_rows: usize,
    pub dq_keys: usize,
    pub dkdv_keys: usize,
    pub dkdv_queries: usize,
    /// dK/dV: head dims accumulated per block, and so blocks per key block (`nchunk`).
    pub dkdv_dims: usize,
    pub nchunk: usize,
    pub smem_fwd: usize,
    pub smem_dq: usize,
    pub smem_dkdv: usize,
    /// Threads per block of each kernel.
    pub fwd_threads: usize,
    pub dq_threads: usize,
    pub dkdv_threads: usize,
    /// The forward and dQ on the warpgroup MMA (`kernels/flash_wg.cuh`, sm_90a).
    pub fwd_wg: bool,
    pub dq_wg: bool,
    /// The FMA kernels' buffers of streamed tiles (1 or 2) in the forward, dQ and dK/dV.
    pub stages: [usize; 3],
    /// dK/dV blocks that run at once on a multiprocessor (registers and shared memory).
    pub dkdv_per_sm: usize,
}

impl Variant {
    pub fn dp(&self) -> usize {
        match *self {
            Variant::Mma { dp, .. } | Variant::Fma { dp } => dp,
        }
    }

    /// Threads per block of the delta and partial-sum kernels.
    pub fn threads(&self) -> usize {
        match self {
            Variant::Mma { .. } => THREADS,
            Variant::Fma { .. } => FMA_THREADS,
        }
    }

    /// Module name, e.g. `flash_bf16_d64`, `flash_bf16_d128_wg` (some kernels on wgmma), or
    /// `flash_f32_d128`.
    pub fn name(&self) -> String {
        match self {
            Variant::Mma { dtype, dp, .. } => {
                let s = self.shape();
                format!("flash_{}_d{dp}{}", dtype.name(), if s.fwd_wg || s.dq_wg { "_wg" } else { "" })
            }
            Variant::Fma { dp } => format!("flash_f32_d{dp}"),
        }
    }

    /// The `#define`s that configure the kernel file for this variant: its type, padded head
    /// size, and the tiles and launch shape of [`Variant::shape`] (`FA_*`). (The CPU emulator
    /// of tests/flash_emu/ compiles the kernel files with these too.)
    pub fn defines(&self) -> String {
        let s = self.shape();
        let mut d: Vec<(String, String)> = match self {
            Variant::Mma { dtype, dp, .. } => {
                vec![
                    ("FT".into(), dtype.name().to_string()),
                    ("FLASH_F16".into(), ((*dtype == DType::F16) as i32).to_string()),
                    ("FDP".into(), dp.to_string()),
                ]
            }
            Variant::Fma { dp } => vec![("FDPF".into(), dp.to_string())],
        };
        let stages = |name: &str, i: usize| (format!("FA_{name}_STAGES"), s.stages[i].to_string());
        d.push(("FA_THREADS".into(), self.threads().to_string()));
        d.extend(launch_defines!(s; fwd_rows, fwd_keys, fwd_step, fwd_threads, fwd_wg));
        d.push(stages("FWD", 0));
        d.extend(launch_defines!(s; smem_fwd, dq_rows, dq_keys, dq_threads, dq_wg));
        d.push(stages("DQ", 1));
        d.extend(launch_defines!(s; smem_dq, dkdv_keys, dkdv_queries, dkdv_dims, nchunk, dkdv_threads));
        d.push(stages("DKDV", 2));
        d.extend(launch_defines!(s; smem_dkdv));
        d.iter().map(|(k, v)| format!("#define {k} {v}\n")).collect()
    }

    /// The full source NVRTC compiles for this variant: the prelude, [`Variant::defines`],
    /// `flash_common.cuh` and the kernel file (`flash_attn.cu`, then `flash_wg.cuh` where a
    /// kernel runs on wgmma; or `flash_fma.cu`).
    pub fn source(&self) -> String {
        let s = self.shape();
        let body = match self {
            Variant::Mma { .. } if s.fwd_wg || s.dq_wg => format!("{FLASH_ATTN}\n{FLASH_WG}"),
            Variant::Mma { .. } => FLASH_ATTN.to_string(),
            Variant::Fma { .. } => FLASH_FMA.to_string(),
        };
        format!("{PRELUDE}\n{}{FLASH_COMMON}\n{body}", self.defines())
    }

    pub fn shape(&self) -> Launch {
        match *self {
            Variant::Mma { dp, wg, .. } => {
                let t = Tiles::of(dp);
                let ld = dp + 8; // shared row stride (elements) of the mma.sync kernels
                let swizzled = dp % 64 == 0; // the wgmma kernels' 64-column swizzled rows
                let (fwd_wg, dq_wg) = (wg && swizzled && t.fwd_wg, wg && swizzled && t.dq_wg);
                // Q, then two stages of K and V; the wgmma kernels' tiles unpadded plus 1 KiB to
                // align them to 1024 bytes.
                let (fwd_rows, fwd_keys, fwd_step, fwd_threads, smem_fwd) = if fwd_wg {
                    let (r, k) = WG_FWD;
                    (r, k, k, WG_THREADS, (r + 4 * k) * dp * 2 + 1024)
                } else {
                    (t.fwd_rows, t.fwd_keys, t.fwd_step, THREADS, (t.fwd_rows + 4 * t.fwd_keys) * ld * 2)
                };
                // Q and dO, then two stages of K and V.
                let (dq_rows, dq_keys, dq_threads, smem_dq) = if dq_wg {
                    let (r, k) = WG_DQ;
                    (r, k, WG_THREADS, (2 * r + 4 * k) * dp * 2 + 1024)
                } else {
                    (t.dq_rows, t.dq_keys, THREADS, (2 * t.dq_rows + 4 * t.dq_keys) * ld * 2)
                };
                // K and V, two stages of Q and dO, and two of lse and delta (f32).
                let (bk, bq, dc) = (THREADS / 2, t.dkdv_queries, dp.min(128));
                Launch {
                    fwd_rows,
                    fwd_keys,
                    fwd_step,
                    dq_rows,
                    dq_keys,
                    dkdv_keys: bk,
                    dkdv_queries: bq,
                    dkdv_dims: dc,
                    nchunk: dp.div_ceil(dc),
                    smem_fwd,
                    smem_dq,
                    smem_dkdv: (2 * bk + 4 * bq) * ld * 2 + 4 * bq * 4,
                    fwd_threads,
                    dq_threads,
                    dkdv_threads: THREADS,
                    fwd_wg,
                    dq_wg,
                    stages: [2, 2, 2],
                    dkdv_per_sm: 2,
                }
            }
            Variant::Fma { dp } => {
                // 64-key forward and 64-query dK/dV tiles (32 above head size 128); on the H200
                // 5.24 ms fwd+bwd at seed-llama's attention against 5.92 for 32 and 32 (the
                // tiling removed after commit 6633b94).
                let ld = dp + 4;
                let fbr = if dp <= 128 { 128 } else { 64 };
                let (fbc, qbc) = (64, 32);
                let dc = dp.min(128);
                let (bk, ktx, bq) = (64, if dc % 64 == 0 { 16 } else { 8 }, if dp <= 128 { 64 } else { 32 });
                // Shared bytes with nb buffers of the streamed tiles: two where they fit.
                let fwd = |nb: usize| (fbr * ld + 2 * nb * fbc * ld + fbr * (fbc + 8)) * 4;
                let dq = |nb: usize| (2 * fbr * ld + 2 * nb * qbc * ld + fbr * (qbc + 8)) * 4;
                let dkdv = |nb: usize| (2 * bk * ld + 2 * nb * bq * ld + 2 * bk * (bq + ktx) + 2 * nb * bq) * 4;
                let nb = |f: &dyn Fn(usize) -> usize| if f(2) <= SMEM_MAX { 2 } else { 1 };
                let stages = [nb(&fwd), nb(&dq), nb(&dkdv)];
                Launch {
                    fwd_rows: fbr,
                    fwd_keys: fbc,
                    fwd_step: fbc,
                    dq_rows: fbr,
                    dq_keys: qbc,
                    dkdv_keys: bk,
                    dkdv_queries: bq,
                    dkdv_dims: dc,
                    nchunk: dp.div_ceil(dc),
                    smem_fwd: fwd(stages[0]),
                    smem_dq: dq(stages[1]),
                    smem_dkdv: dkdv(stages[2]),
                    fwd_threads: FMA_THREADS,
                    dq_threads: FMA_THREADS,
                    dkdv_threads: FMA_THREADS,
                    fwd_wg: false,
                    dq_wg: false,
                    stages,
                    dkdv_per_sm: 1,
                }
            }
        }
    }

    /// The NVRTC architecture of the variant's module on a device of architecture `arch`
    /// (`sm_90`): `sm_90a` where a kernel runs on wgmma.
    pub fn arch(&self, arch: &str) -> String {
        let s = self.shape();
        if s.fwd_wg || s.dq_wg { format!("{arch}a") } else { arch.to_string() }
    }

    /// Every variant [`choose`] can make, on sm_90 and before (for the offline compile test,
    /// which also fills the kernel cache the GPU machine starts from).
    pub fn all() -> Vec<Variant> {
        let mut v = Vec::new();
        for dtype in [DType::BF16, DType::F16] {
            for i in 1..=MAX_HEAD / 16 {
                let dp = 16 * i;
                v.push(Variant::Mma { dtype, dp, wg: false });
                let wg = Variant::Mma { dtype, dp, wg: true };
                if wg.name() != v[v.len() - 1].name() {
                    v.push(wg);
                }
            }
        }
        v.extend((1..=MAX_HEAD / 32).map(|i| Variant::Fma { dp: 32 * i }));
        v
    }
}

/// Compile options of the flash modules (contraction into FMA allowed).
pub const OPTIONS: Options = Options { fmad: true };

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
    let knobs = dev.knobs();
    let variant = choose(dev.capability, at[0].dtype, d, &knobs)?;
    let sh = variant.shape();
    if let Err(e) = fits(dev, layout, sh, backward, [b, hq, hkv, t, s, d])? {
        return Some(Err(e));
    }
    let mode = if backward { Mode::Backward } else { Mode::Forward };
    Some(build(dev, &knobs, variant, sh, mode, (scale, causal, layout), [b, hq, hkv, t, s, d]))
}

/// The flash forward of `attention_cached` (q `[b, t, hq, d]` at the cache positions `pos`
/// `[b]`, k and v the caches `[b, s, hkv, d]`): a prefill chunk's queries on the tensor cores
/// (`flash_fwd_cached`), or `None` where no tensor-core tiling takes the head size and dtype.
/// Its log-sum-exp goes to the recipe's scratch.
pub fn cached_recipe(dev: &Device, at: &[&TensorType], scale: f64) -> Option<Result<Recipe>> {
    let (q, k) = (at[0].dims(), at[1].dims());
    let ([b, t, hq, d], [s, hkv]) = ([q[0], q[1], q[2], q[3]], [k[1], k[2]]);
    let knobs = dev.knobs();
    let variant = choose(dev.capability, at[0].dtype, d, &knobs)?;
    if !matches!(variant, Variant::Mma { .. }) {
        return None;
    }
    let sh = variant.shape();
    if let Err(e) = fits(dev, HeadLayout::Bthd, sh, false, [b, hq, hkv, t, s, d])? {
        return Some(Err(e));
    }
    Some(build(dev, &knobs, variant, sh, Mode::Cached, (scale, true, HeadLayout::Bthd), [b, hq, hkv, t, s, d]))
}

/// Whether the kernels take these shapes: `None` where they do not (grid rows, 32-bit tile and
/// position offsets, shared memory), `Some(Err)` where the device could not say.
fn fits(
    dev: &Device,
    layout: HeadLayout,
    sh: Launch,
    backward: bool,
    [b, hq, hkv, t, s, d]: [usize; 6],
) -> Option<Result<()>> {
    // The kernels' tile loads offset rows within a tile (at most 256 rows) in 32 bits.
    let rs = layout.strides(hq, t, d).1.max(layout.strides(hkv, s, d).1);
    // The wgmma forward indexes positions in 32 bits.
    if b * hq > 65535 || b * hkv > 65535 || rs.saturating_mul(256) > i32::MAX as usize || t.max(s) >= 1 << 30 {
        return None;
    }
    let need = if backward { sh.smem_dq.max(sh.smem_dkdv) } else { sh.smem_fwd };
    match dev.shared_memory_optin() {
        Ok(limit) if need > limit => None,
        Ok(_) => Some(Ok(())),
        Err(e) => Some(Err(e)),
    }
}

/// What [`build`] launches: the attention's forward or backward, or the forward over a cache.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Forward,
    Backward,
    Cached,
}

/// The `Dims` blob of every attention kernel (flash and per-row): `b, hq, hkv, t, s, d`, then
/// the element strides between heads and between positions of q, o, dO, dQ and of k, v, dK, dV
/// in `layout` (`HeadLayout::strides`).
pub fn dims_blob(layout: HeadLayout, [b, hq, hkv, t, s, d]: [usize; 6]) -> Arg {
    let (qhs, qrs) = layout.strides(hq, t, d);
    let (khs, krs) = layout.strides(hkv, s, d);
    Arg::Blob([b, hq, hkv, t, s, d, qhs, qrs, khs, krs].iter().map(|&x| x as u64).collect())
}

#[allow(clippy::too_many_arguments)]
fn build(
    dev: &Device,
    knobs: &Knobs,
    variant: Variant,
    sh: Launch,
    mode: Mode,
    (scale, causal, layout): (f64, bool, HeadLayout),
    [b, hq, hkv, t, s, d]: [usize; 6],
) -> Result<Recipe> {
    let name = variant.name();
    let module = dev.module_on(&variant.arch(&dev.arch), &name, &variant.source(), OPTIONS)?;
    let mma = matches!(variant, Variant::Mma { .. });
    let kernel = |kname: &str, grid: (usize, usize), smem: usize, args: Vec<Arg>| -> Result<Step> {
        let func = module.function(kname)?;
        func.allow_shared_memory(dev, smem, &format!("`{kname}` in `{name}`"))?;
        let grid = (u32::try_from(grid.0).map_err(|_| CudaError::usage(format!("grid of {kname}")))?, grid.1 as u32, 1);
        let block = match kname {
            "flash_fwd" | "flash_fwd_cached" => sh.fwd_threads,
            "flash_bwd_dkdv" => sh.dkdv_threads,
            "flash_bwd_dq" => sh.dq_threads,
            _ => variant.threads(),
        } as u32;
        Ok(Step::Kernel { func, name: format!("{name}/{kname}"), grid, block, smem: smem as u32, args })
    };
    let sms = dev.multiprocessors.max(1);
    let cols = |n: usize, rows: usize| grid_columns(causal, n, rows, sms);
    let dims = dims_blob(layout, [b, hq, hkv, t, s, d]);
    let (sc, ca) = (Arg::F64(scale), Arg::I32(causal as i32));
    let mut steps = Vec::new();
    let rows = b * hq * t;
    if mode == Mode::Cached {
        if rows > 0 {
            let args = [Arg::ins(&[0, 1, 2, 3]), vec![Arg::Out(0), Arg::Scratch(0), dims, sc]].concat();
            steps.push(kernel("flash_fwd_cached", (cols(t.div_ceil(sh.fwd_rows), b * hq), b * hq), sh.smem_fwd, args)?);
        }
        return Ok(Recipe {
            op: "attention_cached",
            steps,
            scratch: (rows * 4).next_multiple_of(256),
            node_scratch: 0,
        });
    }
    if mode == Mode::Forward {
        if rows > 0 {
            let args = [Arg::ins(&[0, 1, 2]), vec![Arg::Out(0), Arg::Out(1), dims, sc, ca]].concat();
            steps.push(kernel("flash_fwd", (cols(t.div_ceil(sh.fwd_rows), b * hq), b * hq), sh.smem_fwd, args)?);
        }
        return Ok(Recipe { op: "attention", steps, scratch: 0, node_scratch: 0 });
    }
    // Scratch: delta, one f32 per query row, from its own kernel.
    if rows > 0 {
        let blocks = rows.div_ceil(variant.threads() / 32).clamp(1, dev.multiprocessors.max(1) * 16);
        let args = vec![Arg::In(3), Arg::In(5), Arg::Scratch(0), dims.clone()];
        steps.push(kernel("flash_bwd_delta", (blocks, 1), 0, args)?);
    }
    let mut dq_step = None;
    if rows > 0 {
        let args =
            [Arg::ins(&[0, 1, 2, 4, 5]), vec![Arg::Scratch(0), Arg::Out(0), dims.clone(), sc.clone(), ca.clone()]]
                .concat();
        dq_step = Some(kernel("flash_bwd_dq", (cols(t.div_ceil(sh.dq_rows), b * hq), b * hq), sh.smem_dq, args)?);
    }
    // Scratch: delta, then (the tensor-core kernels with their group's heads split) the f32
    // partial sums of dK and dV.
    let delta_bytes = (rows * 4).div_ceil(256) * 256;
    let mut scratch = delta_bytes;
    if b * hkv * s > 0 {
        let kblocks = s.div_ceil(sh.dkdv_keys);
        let plane = b * hkv * s * d;
        let nsplit = if mma {
            dkdv_split(hq / hkv, kblocks * b * hkv, plane, sms * sh.dkdv_per_sm, causal, knobs.flash_split)
        } else {
            1
        };
        let mut args = [Arg::ins(&[0, 1, 2, 4, 5]), vec![Arg::Scratch(0), Arg::Out(1), Arg::Out(2)]].concat();
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
            let blocks = plane.div_ceil(THREADS).clamp(1, sms * 8);
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
/// `group` query heads: `force` (`RUMBLE_FLASH_SPLIT`) if set (clamped to 1..=group), else the smallest
/// divisor of the group that gives at least two blocks of keys per CTA slot (`slots`: blocks
/// that run at once on the whole device; the causal grid then pairs, two blocks a CTA) where
/// there are fewer than one and a half, with
/// the partial sums (`2 x split x plane` f32) under [`SPLIT_MAX_BYTES`]. `blocks`: blocks of
/// keys without a split (key blocks x batch x kv heads); `plane`: elements of dK.
pub fn dkdv_split(
    group: usize,
    blocks: usize,
    plane: usize,
    slots: usize,
    causal: bool,
    force: Option<usize>,
) -> usize {
    let fits = |n: usize| n == 1 || 2 * n * plane * 4 <= SPLIT_MAX_BYTES;
    if let Some(n) = force {
        return n.clamp(1, group.max(1));
    }
    // Causal blocks differ in work (paired, two per CTA): with three blocks per multiprocessor
    // (two CTA slots each) already there (seq 4096, 8 kv heads: 512 blocks) the split did not
    // pay for its partial sums on the H200 (d64: 1.425 ms fwd+bwd unsplit against 1.456 split
    // in two); with 256 blocks a split of 4 took dK/dV from 0.65 to 0.38 ms at d128 x 2048.
    // Without a mask the blocks are equal: one CTA per multiprocessor's worth is enough.
    let (enough, want) = if causal { (3 * slots / 2, 2 * slots) } else { (slots / 2, slots) };
    if blocks >= enough {
        return 1;
    }
    let n = (1..=group.max(1)).find(|&n| group.is_multiple_of(n) && blocks * n >= want).unwrap_or(group.max(1));
    (1..=n).rev().find(|&m| group.is_multiple_of(m) && fits(m)).unwrap_or(1)
}

/// Grid columns for `n` blocks of causal work per row of the grid (`rows` rows): block `i`
/// sees about `n - i` tiles, so while half as many CTAs still give every multiprocessor one,
/// each CTA runs two blocks, `i` and `n - 1 - i`, and all do about the same work (the kernels
/// see `gridDim.x < n` and pair). Without a mask all blocks are equal: one per CTA.
pub fn grid_columns(causal: bool, n: usize, rows: usize, sms: usize) -> usize {
    if causal && n >= 2 && n.div_ceil(2) * rows >= sms { n.div_ceil(2) } else { n }
}

#[cfg(test)]
#[path = "flash_tests.rs"]
mod tests;
