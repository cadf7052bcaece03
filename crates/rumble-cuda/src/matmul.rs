//! Matmuls through cuBLASLt: exact fp32 (`CUBLAS_COMPUTE_32F`, no TF32 unless
//! `RUMBLE_CUDA_TF32=1`), bf16/f16 with f32 accumulation, f64. Row-major `C = op(A) op(B)` is
//! computed as the column-major `C^T = op(B)^T op(A)^T`.
//!
//! The algorithm for each shape is chosen once and cached: every executor then runs the same
//! algorithm, and the plan reserves exactly its workspace. cuBLASLt's heuristic proposes up to
//! [`candidates`] algorithms (workspace capped, in-place split-K reductions excluded); beside
//! them stands cuBLAS's classic `cublasGemmStridedBatchedEx` (its own heuristic: what PyTorch
//! runs for a plain matmul; on the H200 it was 12% faster than every cuBLASLt candidate on
//! seed-llama's 3200x3200x2048 weight gradient), once with no workspace and once with the
//! capped workspace; and, for a few rows against a transposed `b` (decoding's `x w^T`, M at most
//! 16), rumble's own kernels (`kernels/gemv.cu`, [`gemv_kernels`]: a block of rows sharing
//! `x`'s loads, or a warp per row or two with many loads in flight), which read each weight row
//! once for every row of `x`. A matmul whose addend is a row added to every row of the result
//! (`Addend::Row`, a linear layer's bias: [`MatmulKey::row_addend`]) runs on cuBLASLt with its
//! `BIAS` epilogue (the row is per row of the column-major `C^T`, which is what that epilogue
//! adds) or on the gemv kernels (the addend read with row stride 0); the classic gemm, which
//! has no such addend, is no candidate. Each candidate is timed on scratch buffers and the fastest kept if it beats
//! the heuristic's first choice by more than 2% (`RUMBLE_MATMUL_TUNE=0`: the first choice,
//! untimed; `RUMBLE_MATMUL_CLASSIC=0`: cuBLASLt only). The choice is written to the disk cache
//! (beside the compiled kernels, per GPU and cuBLASLt version), so later runs use the same
//! algorithm and give the same bits (both libraries are deterministic for a fixed algorithm and
//! workspace size).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::sys as dsys;
use rumble_core::ir::{DType, TensorType};

use crate::device::Device;
use crate::error::{CudaError, DriverContext, Result};
use crate::knobs::Knobs;

/// Most workspace a matmul may ask for by default (cuBLAS's recommendation for Hopper);
/// `RUMBLE_MATMUL_WORKSPACE_MB` sets another cap. Each matmul's workspace is planned as its
/// node's scratch, so a smaller cap can pack the arena tighter (fewer algorithms to choose from).
pub const MAX_WORKSPACE: usize = 32 << 20;

/// The workspace cap in force: [`MAX_WORKSPACE`] or `RUMBLE_MATMUL_WORKSPACE_MB`.
pub fn max_workspace(knobs: &Knobs) -> usize {
    knobs.matmul_workspace_mb.map_or(MAX_WORKSPACE, |mb| mb << 20)
}
/// Most algorithms the heuristic is asked for, to be timed, by default;
/// `RUMBLE_MATMUL_CANDIDATES` sets another count (1 to [`MAX_CANDIDATES`]).
pub const CANDIDATES: usize = 8;
/// The most candidates `RUMBLE_MATMUL_CANDIDATES` may ask for.
pub const MAX_CANDIDATES: usize = 64;

/// The candidate count in force: [`CANDIDATES`] or `RUMBLE_MATMUL_CANDIDATES`, clamped to
/// `1..=MAX_CANDIDATES`.
pub fn candidates(knobs: &Knobs) -> usize {
    knobs.matmul_candidates.map_or(CANDIDATES, |n| n.clamp(1, MAX_CANDIDATES))
}

/// The shape of one matmul: batch, row-major `M x K` times `K x N`, transposes, dtype, and
/// whether its addend is a row. Its `Debug` form names the tuner's remembered choices.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatmulKey {
    /// Operand dtype.
    pub dtype: DType,
    /// Result dtype (the operands' or, for bf16/f16 operands, f32).
    pub out: DType,
    pub ta: bool,
    pub tb: bool,
    pub batch: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// The addend is a row of `N` elements of the result's dtype added to every row of every
    /// batch (`Addend::Row`), given as `c` to [`Device::matmul_add`] with `beta = 1`: cuBLASLt
    /// runs its `BIAS` epilogue (chosen among algorithms that have one), the gemv kernels read
    /// `c` with row stride 0. Otherwise an addend, if any, has the result's shape and `beta`
    /// says whether it is read (one algorithm serves both).
    pub row_addend: bool,
}

/// Every field, `row_addend` only where set: the keys of matmuls without a row addend read as
/// they did before there was one, so choices remembered then still name them.
impl std::fmt::Debug for MatmulKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("MatmulKey");
        s.field("dtype", &self.dtype).field("out", &self.out).field("ta", &self.ta).field("tb", &self.tb);
        s.field("batch", &self.batch).field("m", &self.m).field("n", &self.n).field("k", &self.k);
        if self.row_addend {
            s.field("row_addend", &true);
        }
        s.finish()
    }
}

impl MatmulKey {
    pub fn new(a: &TensorType, b: &TensorType, ta: bool, tb: bool) -> Self {
        let r = a.rank();
        let batch: usize = a.dims()[..r - 2].iter().product();
        let (m, k) = if ta { (a.dims()[r - 1], a.dims()[r - 2]) } else { (a.dims()[r - 2], a.dims()[r - 1]) };
        let n = if tb { b.dims()[r - 2] } else { b.dims()[r - 1] };
        let (batch, m, n, k) = (batch as u64, m as u64, n as u64, k as u64);
        MatmulKey { dtype: a.dtype, out: a.dtype, ta, tb, batch, m, n, k, row_addend: false }
    }
}

/// How one matmul runs.
#[derive(Clone, Copy)]
pub(crate) enum Algo {
    /// A cuBLASLt algorithm from its heuristic.
    Lt(sys::cublasLtMatmulAlgo_t),
    /// cuBLAS's classic `cublasGemmStridedBatchedEx` with its own heuristic, given the plan's
    /// workspace (which steers that heuristic: 0 rules out split-K).
    Classic,
    /// rumble's own kernels for a few rows against a transposed `b` (`kernels/gemv.cu`,
    /// [`gemv_kernels`]), looked up once with the plan: decoding's matmuls. Candidates where
    /// [`gemv_rows`] allows.
    Gemv(GemvKernel),
}

/// One of `kernels/gemv.cu`'s kernels for a shape, with its launch shape: `rows` weight rows a
/// block of `threads` threads.
#[derive(Clone, Copy, Debug)]
pub struct GemvKernel {
    pub func: crate::compile::Func,
    pub name: &'static str,
    /// The kernel name's split (`gemv_tn`, `gemv_wr1`, `gemv_wr2`), which the prologue kernels
    /// of `matmul_pre` share.
    pub stem: &'static str,
    pub rows: u32,
    pub threads: u32,
}

/// The row bucket of `gemv.cu`'s kernel for `key`, where it applies: one batch, M at most 16,
/// `a` as stored and `b` transposed (a linear layer's `x w^T`), f32 / bf16 / f16 operands
/// giving their own dtype or f32.
pub fn gemv_rows(key: &MatmulKey) -> Option<usize> {
    let types = matches!(
        (key.dtype, key.out),
        (DType::F32, DType::F32) | (DType::BF16, DType::BF16 | DType::F32) | (DType::F16, DType::F16 | DType::F32)
    );
    if key.batch > 1 || key.ta || !key.tb || !types || key.n == 0 || key.k == 0 {
        return None;
    }
    [1, 4, 8, 16].into_iter().find(|&b| key.m <= b as u64)
}

/// `gemv.cu`'s kernels for `key`, every way of splitting the work that its row bucket has
/// (`gemv_tn_<dtype>_<out>_<rows>`: a block of 8 warps owns 4 weight rows; `gemv_wr<R>_...`, for
/// buckets of 1 and 4 rows: a warp owns R weight rows, 4 warps a block), compiled as every fixed
/// kernel file is (so the carried kernel cache holds them).
pub fn gemv_kernels(dev: &Device, key: &MatmulKey) -> Result<Vec<GemvKernel>> {
    let mm = gemv_rows(key).ok_or_else(|| CudaError::usage(format!("no gemv kernel for matmul {key:?}")))?;
    let (t, o) = (key.dtype.name(), key.out.name());
    let get = |name: String| crate::recipe::kernel(dev, crate::kernels::KernelFile::Gemv, &name);
    // Launch shapes: gemv.cu's GEMV_ROWS rows a block of GEMV_WARPS warps; GEMV_WR_WARPS warps
    // of R rows each.
    let func = get(format!("gemv_tn_{t}_{o}_{mm}"))?;
    let mut out = vec![GemvKernel { func, name: "gemv", stem: "gemv_tn", rows: 4, threads: 256 }];
    if mm <= 4 {
        for (r, name, stem) in [(1, "gemv-warp1", "gemv_wr1"), (2, "gemv-warp2", "gemv_wr2")] {
            out.push(GemvKernel { func: get(format!("{stem}_{t}_{o}_{mm}"))?, name, stem, rows: 4 * r, threads: 128 });
        }
    }
    Ok(out)
}

/// The projections one launch of a `matmul_pre` kernel takes (`GEMV_SETS` in `kernels/gemv.cu`).
pub const GEMV_SETS: usize = 4;

/// Rows a `matmul_pre` kernel makes at most (`GEMV_PRE_M` in `kernels/gemv.cu`; the buckets of
/// 1 and 4 rows).
pub const GEMV_PRE_M: u64 = 4;

/// Warps of a `matmul_pre` kernel's `gemv_wr` blocks (`GEMV_PRE_WR_WARPS`), and the threads of
/// every `matmul_pre` block (`GEMV_WARPS` warps for `gemv_tn`, as many for `gemv_wr`).
const GEMV_PRE_WR_WARPS: u32 = 8;
const GEMV_PRE_THREADS: u32 = 256;

/// A `matmul_pre` kernel of `kernels/gemv.cu` for one shape: its launch shape (`kernel.rows`
/// weight rows a block of its grid's loop, `kernel.threads` threads), the dynamic shared memory
/// its blocks make the rows in, and the most blocks its grid needs to fill the device.
#[derive(Clone, Copy, Debug)]
pub struct GemvPre {
    pub kernel: GemvKernel,
    pub smem: u32,
    pub blocks: u32,
}

/// The kernel of `kernels/gemv.cu` that runs `matmul_pre` with prologue `pre` (`norm` or
/// `swiglu`) for `key`, the plain matmul of the rows it makes: the way of splitting the work the
/// tuner chose for `key` (timed as that matmul), where it chose one of gemv.cu's kernels, the
/// bucket has prologue kernels (at most [`GEMV_PRE_M`] rows, the operands' dtype out) and the
/// rows fit a block's shared memory. `None` where not: cuBLAS is faster on that shape, there is
/// no such kernel, or the rows are too long.
pub fn gemv_pre_kernel(dev: &Device, key: &MatmulKey, pre: &str) -> Result<Option<GemvPre>> {
    let Some(mm) = gemv_rows(key).filter(|&mm| mm as u64 <= GEMV_PRE_M && key.out == key.dtype) else {
        return Ok(None);
    };
    let chosen = dev.matmul_algorithm(key)?;
    let Some(plain) = gemv_kernels(dev, key)?.into_iter().find(|g| g.name == chosen) else { return Ok(None) };
    let name = format!("{}_{pre}_{}_{mm}", plain.stem, key.dtype.name());
    let func = crate::recipe::kernel(dev, crate::kernels::KernelFile::Gemv, &name)?;
    // The made rows, beside the kernel's own shared memory, must fit a block.
    let smem = (key.m * key.k) as usize * key.dtype.size_in_bytes();
    if smem + func.static_shared_memory()? > dev.shared_memory_optin()? {
        return Ok(None);
    }
    // gemv_pre's blocks: gemv_tn's rows, or GEMV_PRE_WR_WARPS warps of the split's R rows each
    // (the plain kernel's block is GEMV_WR_WARPS = 4 such warps).
    let rows = if plain.stem == "gemv_tn" { plain.rows } else { GEMV_PRE_WR_WARPS * plain.rows / 4 };
    let kernel = GemvKernel { func, name: "gemv-pre", rows, threads: GEMV_PRE_THREADS, ..plain };
    func.allow_shared_memory(dev, smem, &format!("`{name}`"))?;
    let per_sm = unsafe {
        cudarc::driver::result::occupancy::max_active_block_per_multiprocessor(func.0, GEMV_PRE_THREADS as i32, smem)
    }
    .ctx(|| format!("the occupancy of `{name}`"))?;
    if per_sm < 1 {
        return Ok(None);
    }
    let blocks = (per_sm as usize * dev.multiprocessors.max(1)) as u32;
    let smem = smem as u32;
    Ok(Some(GemvPre { kernel, smem, blocks }))
}

/// One algorithm to time: how it runs and the workspace bytes it needs.
#[derive(Clone, Copy)]
pub(crate) struct Candidate {
    pub algo: Algo,
    pub workspace: usize,
}

/// Descriptors and the chosen algorithm of one shape.
pub struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    pub(crate) algo: Algo,
    /// Workspace bytes the algorithm needs.
    pub workspace: usize,
    /// Exact f32 through TF32 (`RUMBLE_CUDA_TF32=1`), for the classic call.
    tf32: bool,
    f64: bool,
}

#[derive(Default)]
pub struct Cache {
    plans: HashMap<MatmulKey, Plan>,
}

// The plans' cuBLASLt descriptors are host-side objects, only used under the device's mutex
// around this cache.
unsafe impl Send for Cache {}

impl crate::device::DeviceCache for Cache {
    fn release(&mut self) {
        self.clear();
    }
}

impl Cache {
    pub fn clear(&mut self) {
        self.plans.clear();
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn blas_err(what: &str) -> impl Fn(lt::CublasError) -> CudaError + '_ {
    move |e| CudaError::Blas { op: "matmul".into(), what: what.to_string(), err: e.to_string() }
}

/// `set_attr!(setter, handle, attribute, value, what)`: one cuBLASLt attribute set from a local
/// value (its address and size), a failure naming `what`. Inside `unsafe`.
macro_rules! set_attr {
    ($set:path, $h:expr, $attr:expr, $v:ident, $what:expr) => {
        $set($h, $attr, &$v as *const _ as *const c_void, std::mem::size_of_val(&$v)).map_err(blas_err($what))?
    };
}

fn layout(ty: sys::cudaDataType, rows: u64, cols: u64, batch: u64) -> Result<sys::cublasLtMatrixLayout_t> {
    let l = lt::create_matrix_layout(ty, rows, cols, rows as i64).map_err(blas_err("cublasLtMatrixLayoutCreate"))?;
    if batch > 1 {
        let count = batch as i32;
        let stride = (rows * cols) as i64;
        unsafe {
            set_attr!(
                lt::set_matrix_layout_attribute,
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                count,
                "batch count"
            );
            set_attr!(
                lt::set_matrix_layout_attribute,
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                stride,
                "batch stride"
            );
        }
    }
    Ok(l)
}

fn make_plan(dev: &Device, key: &MatmulKey) -> Result<Plan> {
    let knobs = dev.knobs();
    let (ty, compute, scale) = match key.dtype {
        DType::F32 => {
            let c = if knobs.tf32 {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
            };
            (sys::cudaDataType::CUDA_R_32F, c, sys::cudaDataType::CUDA_R_32F)
        }
        DType::BF16 => (
            sys::cudaDataType::CUDA_R_16BF,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        ),
        DType::F16 => {
            (sys::cudaDataType::CUDA_R_16F, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
        }
        DType::F64 => {
            (sys::cudaDataType::CUDA_R_64F, sys::cublasComputeType_t::CUBLAS_COMPUTE_64F, sys::cudaDataType::CUDA_R_64F)
        }
        d => return Err(CudaError::Unsupported(format!("matmul of {d}"))),
    };
    let MatmulKey { m, n, k, batch, ta, tb, .. } = *key;
    let out_ty = match (key.dtype, key.out) {
        (a, o) if a == o => ty,
        (DType::BF16 | DType::F16, DType::F32) => sys::cudaDataType::CUDA_R_32F,
        (a, o) => return Err(CudaError::Unsupported(format!("matmul of {a} giving {o}"))),
    };
    // Column-major view: C^T [N, M] = X [N, K] * Y [K, M], X from B, Y from A.
    let desc = lt::create_matmul_desc(compute, scale).map_err(blas_err("cublasLtMatmulDescCreate"))?;
    let (op_x, op_y) = (tb as i32, ta as i32);
    unsafe {
        set_attr!(
            lt::set_matmul_desc_attribute,
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            op_x,
            "transa"
        );
        set_attr!(
            lt::set_matmul_desc_attribute,
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            op_y,
            "transb"
        );
        if key.row_addend {
            // The row is added by the epilogue, to every column of the column-major C^T [N, M]
            // (a row of `N` elements: one per row of C^T) and of every batch.
            let (epilogue, stride) = (sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS, 0i64);
            set_attr!(
                lt::set_matmul_desc_attribute,
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                epilogue,
                "bias epilogue"
            );
            set_attr!(
                lt::set_matmul_desc_attribute,
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                stride,
                "bias batch stride"
            );
        }
    }
    // Stored shapes, column-major: B row-major [K, N] is [N, K] (or [K, N] when tb).
    let x = if tb { layout(ty, k, n, batch)? } else { layout(ty, n, k, batch)? };
    let y = if ta { layout(ty, m, k, batch)? } else { layout(ty, k, m, batch)? };
    let c = layout(out_ty, n, m, batch)?;
    // The plan owns its descriptors from here on (dropped on every early return).
    let mut plan = Plan {
        desc,
        a: x,
        b: y,
        c,
        algo: Algo::Classic,
        workspace: 0,
        tf32: compute == sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        f64: key.dtype == DType::F64,
    };
    let ws = max_workspace(&knobs) as u64;
    let heur = match heuristic(dev, key, &plan, ws, candidates(&knobs)) {
        // A row addend may also run on the gemv kernels: cuBLASLt having no algorithm with
        // the epilogue leaves those.
        Err(_) if key.row_addend => Vec::new(),
        h => h?,
    };
    let mut cands: Vec<Candidate> =
        heur.iter().map(|h| Candidate { algo: Algo::Lt(h.algo), workspace: h.workspaceSize }).collect();
    // rumble's kernels for a few rows (last: remembered choices keep their indices).
    let gemv = match gemv_rows(key) {
        Some(_) => gemv_kernels(dev, key)?,
        None => Vec::new(),
    };
    // Classic cuBLAS too, unless `RUMBLE_MATMUL_CLASSIC=0` or the addend is a row (the classic
    // gemm's C is the result itself).
    let classic = knobs.matmul_classic && !key.row_addend && dev.classic_blas().is_some();
    if classic && [m, n, k, batch].iter().all(|&v| v <= i32::MAX as u64) {
        cands.push(Candidate { algo: Algo::Classic, workspace: 0 });
        if ws > 0 {
            cands.push(Candidate { algo: Algo::Classic, workspace: ws as usize });
        }
    }
    cands.extend(gemv.into_iter().map(|g| Candidate { algo: Algo::Gemv(g), workspace: 0 }));
    if cands.is_empty() {
        // Only a row addend gets here: the recipe then broadcasts the row into the result and
        // runs the plain matmul over it.
        return Err(CudaError::Unsupported(format!("matmul {key:?}: no algorithm adds a row")));
    }
    plan.algo = cands[0].algo;
    plan.workspace = cands[0].workspace;
    if cands.len() > 1 {
        let pick = crate::matmul_tune::choose(dev, key, &mut plan, &cands);
        plan.algo = cands[pick].algo;
        plan.workspace = cands[pick].workspace;
    }
    Ok(plan)
}

/// cuBLASLt's heuristic's algorithms for `plan`'s descriptors (at most `want`, each needing at
/// most `ws` bytes of workspace, no in-place split-K reduction): at least one, or an error.
fn heuristic(
    dev: &Device,
    key: &MatmulKey,
    plan: &Plan,
    ws: u64,
    want: usize,
) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
    let none = |err: String| CudaError::Blas { op: "matmul".into(), what: format!("no algorithm for {key:?}"), err };
    let pref = lt::create_matmul_pref().map_err(blas_err("cublasLtMatmulPreferenceCreate"))?;
    // No in-place split-K reduction (it uses atomics: results would vary run to run).
    let mask: u32 = 0x7 & !0x1;
    let found = (|| -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        unsafe {
            set_attr!(
                lt::set_matmul_pref_attribute,
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                ws,
                "workspace preference"
            );
            set_attr!(
                lt::set_matmul_pref_attribute,
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                mask,
                "reduction preference"
            );
            let mut found = vec![std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed(); want];
            let mut count = 0i32;
            sys::cublasLtMatmulAlgoGetHeuristic(
                dev.blas(),
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref,
                want as i32,
                found.as_mut_ptr() as *mut sys::cublasLtMatmulHeuristicResult_t,
                &mut count,
            )
            .result()
            .map_err(|e| none(e.to_string()))?;
            Ok(found[..(count.max(0) as usize).min(want)]
                .iter()
                .map(|r| r.assume_init())
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .collect())
        }
    })();
    let _ = unsafe { lt::destroy_matmul_pref(pref) };
    let found = found?;
    if found.is_empty() {
        return Err(none("the heuristic returned none".into()));
    }
    Ok(found)
}

/// A gemm's `alpha = 1` and `beta` in both compute types, where cuBLAS reads them during the
/// call (so they must outlive it).
struct Scalars {
    f32s: [f32; 2],
    f64s: [f64; 2],
}

impl Scalars {
    fn new(beta: f64) -> Scalars {
        Scalars { f32s: [1.0, beta as f32], f64s: [1.0, beta] }
    }

    /// Pointers to `alpha` and `beta` as f64 or f32.
    fn ptrs(&self, f64: bool) -> (*const c_void, *const c_void) {
        if f64 {
            (&self.f64s[0] as *const f64 as *const c_void, &self.f64s[1] as *const f64 as *const c_void)
        } else {
            (&self.f32s[0] as *const f32 as *const c_void, &self.f32s[1] as *const f32 as *const c_void)
        }
    }
}

impl Device {
    /// Workspace bytes the cached algorithm of `key` needs (choosing it on first use).
    pub fn matmul_workspace(&self, key: &MatmulKey) -> Result<usize> {
        self.bind()?;
        let cache = self.cache::<Cache>();
        let mut cache = cache.lock().map_err(|_| CudaError::usage("matmul cache poisoned"))?;
        if !cache.plans.contains_key(key) {
            let p = make_plan(self, key)?;
            cache.plans.insert(*key, p);
        }
        Ok(cache.plans[key].workspace)
    }

    /// Launches `c = op(a) op(b) + beta * c` on the device's stream, the operands given as
    /// `[a, b, c, ws]`.
    ///
    /// # Safety
    /// `a`, `b`, `c` must point to device buffers of the key's shapes, `ws` to `ws_bytes` bytes.
    pub unsafe fn matmul(
        &self,
        key: &MatmulKey,
        [a, b, c, ws]: [dsys::CUdeviceptr; 4],
        ws_bytes: usize,
        beta: f64,
    ) -> Result<()> {
        unsafe { self.matmul_add(key, [a, b, c, c, ws], ws_bytes, beta) }
    }

    /// Launches `d = op(a) op(b) + beta * c` on the device's stream, the operands given as
    /// `[a, b, c, d, ws]`; `c` and `d` are the same buffer or do not overlap. cuBLASLt reads `c`
    /// where it is; the classic gemm (which has no separate `c`) copies it to `d` first. For a
    /// key with [`MatmulKey::row_addend`], `c` is the row added to every row of `d` (it never
    /// overlaps `d`) and `beta` must be 1.
    ///
    /// # Safety
    /// As [`Device::matmul`], with `c` and `d` both of the result's shape (`c` of `N` elements
    /// for a row addend).
    pub unsafe fn matmul_add(
        &self,
        key: &MatmulKey,
        [a, b, c, d, ws]: [dsys::CUdeviceptr; 5],
        ws_bytes: usize,
        beta: f64,
    ) -> Result<()> {
        self.matmul_workspace(key)?;
        let cache = self.cache::<Cache>();
        let cache = cache.lock().map_err(|_| CudaError::usage("matmul cache poisoned"))?;
        let p = &cache.plans[key];
        if ws_bytes < p.workspace {
            return Err(CudaError::usage(format!(
                "matmul {key:?} needs {} workspace bytes, the plan gave {ws_bytes}",
                p.workspace
            )));
        }
        unsafe { self.launch_plan(key, p, [a, b, c, d, ws], beta) }
    }

    /// The cuBLASLt algorithm or "classic" of `key`'s cached choice (for reports and tests).
    pub fn matmul_algorithm(&self, key: &MatmulKey) -> Result<&'static str> {
        self.matmul_workspace(key)?;
        let cache = self.cache::<Cache>();
        let cache = cache.lock().map_err(|_| CudaError::usage("matmul cache poisoned"))?;
        Ok(match cache.plans[key].algo {
            Algo::Lt(_) => "cublasLt",
            Algo::Classic => "cublas",
            Algo::Gemv(g) => g.name,
        })
    }

    /// Launches `p` (the plan of `key`, its algorithm as set) with `p.workspace` bytes at `ws`.
    ///
    /// # Safety
    /// As [`Device::matmul`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_plan(
        &self,
        key: &MatmulKey,
        p: &Plan,
        [a, b, c, d, ws]: [dsys::CUdeviceptr; 5],
        beta: f64,
    ) -> Result<()> {
        if key.row_addend && (beta != 1.0 || c == d) {
            return Err(CudaError::usage(format!("matmul {key:?} adds its row with beta = 1, from its own buffer")));
        }
        if let Algo::Gemv(g) = p.algo {
            return unsafe { self.launch_gemv(key, &g, [a, b, c, d], beta) };
        }
        let (c, beta) = if key.row_addend {
            // The epilogue adds the row; C, not read (beta = 0), is d itself.
            let bias = c as *const c_void;
            unsafe {
                set_attr!(
                    lt::set_matmul_desc_attribute,
                    p.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    bias,
                    "bias pointer"
                );
            }
            (d, 0.0)
        } else {
            (c, beta)
        };
        let reads_c = beta != 0.0 && c != d;
        let scalars = Scalars::new(beta);
        let (alpha, beta) = scalars.ptrs(p.f64);
        let algo = match p.algo {
            Algo::Lt(algo) => algo,
            Algo::Gemv(_) => unreachable!("launched above"),
            Algo::Classic if key.row_addend => {
                return Err(CudaError::usage(format!("matmul {key:?}: classic cuBLAS cannot add a row addend")));
            }
            Algo::Classic => {
                if reads_c {
                    let bytes = (key.batch.max(1) * key.m * key.n) as usize * key.out.size_in_bytes();
                    unsafe { cudarc::driver::result::memcpy_dtod_async(d, c, bytes, self.stream()) }
                        .ctx(|| format!("copying the addend of matmul {key:?}"))?;
                }
                return unsafe { self.launch_classic(key, p.workspace, p.tf32, [a, b, d, ws], alpha, beta) };
            }
        };
        unsafe {
            lt::matmul(
                self.blas(),
                p.desc,
                alpha,
                beta,
                b as *const c_void,
                p.a,
                a as *const c_void,
                p.b,
                c as *const c_void,
                p.c,
                d as *mut c_void,
                p.c,
                &algo,
                ws as *mut c_void,
                p.workspace,
                self.stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| CudaError::Blas {
            op: "matmul".into(),
            what: format!("cublasLtMatmul {key:?}"),
            err: e.to_string(),
        })
    }

    /// `d = a b^T + beta * c` through `g`, one of `kernels/gemv.cu`'s kernels for `key`
    /// ([`gemv_kernels`]), `c` a row of `N` added to every row where `key.row_addend` (read with
    /// row stride 0): what the matmul of `key` runs where the tuner picked it; public for the
    /// GPU tests, which compare each with the CPU whatever the tuner picks.
    ///
    /// # Safety
    /// As [`Device::matmul`].
    pub unsafe fn launch_gemv(
        &self,
        key: &MatmulKey,
        g: &GemvKernel,
        [a, b, c, d]: [dsys::CUdeviceptr; 4],
        beta: f64,
    ) -> Result<()> {
        let grid = u32::try_from(key.n.div_ceil(g.rows as u64))
            .map_err(|_| CudaError::usage(format!("gemv grid of {key:?}")))?;
        // The addend's row stride: N, or 0 for a row.
        let ldc = if key.row_addend { 0 } else { key.n };
        let mut words: [u64; 9] = [a, b, c, d, key.m, key.n, key.k, (beta as f32).to_bits() as u64, ldc];
        let mut ptrs: [*mut c_void; 9] = std::array::from_fn(|i| &mut words[i] as *mut u64 as *mut c_void);
        unsafe {
            crate::launch::kernel(&g.func, (grid, 1, 1), (g.threads, 1, 1), 0, self.stream(), &mut ptrs, self.pdl())
        }
        .map_err(|e| CudaError::Launch {
            op: "matmul".into(),
            kernel: format!("{} for {key:?}", g.name),
            err: crate::error::describe(&e),
        })
    }

    /// `c = op(a) op(b) + beta * c` through cuBLAS's classic gemm with `ws_bytes` of workspace
    /// at `ws`, whatever the cached choice of `key` is (for tests and benches: it must match
    /// [`Device::matmul`] within rounding).
    ///
    /// # Safety
    /// As [`Device::matmul`].
    pub unsafe fn matmul_classic(
        &self,
        key: &MatmulKey,
        operands: [dsys::CUdeviceptr; 4],
        ws_bytes: usize,
        beta: f64,
    ) -> Result<()> {
        if key.row_addend {
            return Err(CudaError::usage(format!("the classic gemm adds no row ({key:?})")));
        }
        self.bind()?;
        let tf32 = key.dtype == DType::F32 && self.knobs().tf32;
        let scalars = Scalars::new(beta);
        let (alpha, beta) = scalars.ptrs(key.dtype == DType::F64);
        unsafe { self.launch_classic(key, ws_bytes, tf32, operands, alpha, beta) }
    }

    /// `key` through cuBLAS's classic strided-batched gemm on the device's stream, with exactly
    /// `workspace` bytes at `ws` (set before every call: the handle holds no memory of its
    /// own, so a captured graph touches nothing outside the plan).
    ///
    /// # Safety
    /// As [`Device::matmul`]; `alpha`, `beta` point to scalars of the compute type.
    unsafe fn launch_classic(
        &self,
        key: &MatmulKey,
        workspace: usize,
        tf32: bool,
        [a, b, c, ws]: [dsys::CUdeviceptr; 4],
        alpha: *const c_void,
        beta: *const c_void,
    ) -> Result<()> {
        use cudarc::cublas::{result as cb, sys as cbsys};
        let err = |what: &str| {
            let what = format!("{what} {key:?}");
            move |e: cb::CublasError| CudaError::Blas { op: "matmul".into(), what, err: e.to_string() }
        };
        let h = self.classic_blas().ok_or_else(|| CudaError::Blas {
            op: "matmul".into(),
            what: format!("classic cuBLAS for {key:?}"),
            err: "libcublas is not available".into(),
        })?;
        let wsp = if workspace == 0 { std::ptr::null_mut() } else { ws as *mut c_void };
        unsafe { cbsys::cublasSetWorkspace_v2(h, wsp, workspace) }.result().map_err(err("cublasSetWorkspace"))?;
        let MatmulKey { m, n, k, batch, ta, tb, .. } = *key;
        let op =
            |t: bool| if t { cbsys::cublasOperation_t::CUBLAS_OP_T } else { cbsys::cublasOperation_t::CUBLAS_OP_N };
        // Column-major C^T [n, m] = op(B)^T [n, k] op(A)^T [k, m], as for cuBLASLt above.
        let ldb = if tb { k } else { n };
        let lda = if ta { m } else { k };
        use cbsys::cublasComputeType_t as C;
        use cbsys::cudaDataType as D;
        let of = |d: DType| match d {
            DType::BF16 => D::CUDA_R_16BF,
            DType::F16 => D::CUDA_R_16F,
            DType::F64 => D::CUDA_R_64F,
            _ => D::CUDA_R_32F,
        };
        let (ty, out) = (of(key.dtype), of(key.out));
        let compute = match key.dtype {
            DType::F64 => C::CUBLAS_COMPUTE_64F,
            DType::F32 if tf32 => C::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => C::CUBLAS_COMPUTE_32F,
        };
        unsafe {
            cb::gemm_strided_batched_ex(
                h,
                op(tb),
                op(ta),
                n as i32,
                m as i32,
                k as i32,
                alpha,
                b as *const c_void,
                ty,
                ldb as i32,
                (k * n) as i64,
                a as *const c_void,
                ty,
                lda as i32,
                (m * k) as i64,
                beta,
                c as *mut c_void,
                out,
                n as i32,
                (m * n) as i64,
                batch.max(1) as i32,
                compute,
                cbsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(err("cublasGemmStridedBatchedEx"))
    }
}

#[cfg(test)]
mod tests {
    /// One launch of a `matmul_pre` kernel takes as many projections as `fold_projections`
    /// joins, and the kernel's set has that many slots.
    #[test]
    fn a_prologue_launch_holds_every_joined_projection() {
        assert_eq!(super::GEMV_SETS, rumble_core::passes::PROJECTIONS);
        let src = crate::kernels::KernelFile::Gemv.source();
        assert!(src.contains(&format!("#define GEMV_SETS {}\n", super::GEMV_SETS)), "gemv.cu's GEMV_SETS");
        // gemv.cu has prologue kernels for the buckets of 1 and GEMV_PRE_M rows, of the launch
        // shape gemv_pre_kernel gives.
        assert!(rumble_core::passes::PROLOGUE_ROWS as u64 <= super::GEMV_PRE_M);
        for (define, v) in [
            ("GEMV_PRE_M", super::GEMV_PRE_M as u32),
            ("GEMV_PRE_WR_WARPS", super::GEMV_PRE_WR_WARPS),
            ("GEMV_WR_WARPS", 4),
            ("GEMV_WARPS", super::GEMV_PRE_THREADS / 32),
        ] {
            assert!(src.contains(&format!("#define {define} {v}\n")), "gemv.cu's {define}");
        }
        assert!(src.contains("__launch_bounds__(256)"), "gemv_pre's threads");
        // The set's words as `recipe::matmul_pre` writes them: b, c, d, n, ldc, first.
        let fields = ["const T* b[", "const T* c[", "T* d[", "i64 n[", "i64 ldc[", "i64 first["];
        let set = &src[src.find("struct GemvSet {").expect("gemv.cu's GemvSet")..];
        let at: Vec<usize> = fields.iter().map(|f| set.find(f).unwrap_or_else(|| panic!("GemvSet's `{f}`"))).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "GemvSet's fields in the order the recipe writes them");
    }
}
