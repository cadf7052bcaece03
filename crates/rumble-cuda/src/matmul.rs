//! Matmuls through cuBLASLt: exact fp32 (`CUBLAS_COMPUTE_32F`, no TF32 unless
//! `RUMBLE_CUDA_TF32=1`), bf16/f16 with f32 accumulation, f64. Row-major `C = op(A) op(B)` is
//! computed as the column-major `C^T = op(B)^T op(A)^T`.
//!
//! The algorithm for each shape is chosen once and cached: every executor then runs the same
//! algorithm, and the plan reserves exactly its workspace. cuBLASLt's heuristic proposes up to
//! [`candidates`] algorithms (workspace capped, split-K reductions that use atomics excluded, so
//! results are deterministic); each is timed once on scratch buffers and the fastest kept if it
//! beats the heuristic's first choice by more than 3% (`RUMBLE_MATMUL_TUNE=0`: the first
//! choice, untimed). The choice is written to the disk cache (beside the compiled kernels, per
//! GPU and cuBLASLt version), so later runs use the same algorithm and give the same bits.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::sys as dsys;
use rumble_core::ir::{DType, TensorType};

use crate::device::Device;
use crate::error::{CudaError, Result};

/// Most workspace a matmul may ask for by default (cuBLAS's recommendation for Hopper);
/// `RUMBLE_MATMUL_WORKSPACE_MB` sets another cap. Each matmul's workspace is planned as its
/// node's scratch, so a smaller cap can pack the arena tighter (fewer algorithms to choose from).
pub const MAX_WORKSPACE: usize = 32 << 20;

/// The workspace cap in force: [`MAX_WORKSPACE`] or `RUMBLE_MATMUL_WORKSPACE_MB`.
pub fn max_workspace() -> usize {
    std::env::var("RUMBLE_MATMUL_WORKSPACE_MB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(MAX_WORKSPACE, |mb| mb << 20)
}
/// Most algorithms the heuristic is asked for, to be timed, by default;
/// `RUMBLE_MATMUL_CANDIDATES` sets another count (1 to [`MAX_CANDIDATES`]).
pub const CANDIDATES: usize = 8;
/// The most candidates `RUMBLE_MATMUL_CANDIDATES` may ask for.
pub const MAX_CANDIDATES: usize = 64;

/// The candidate count in force: [`CANDIDATES`] or `RUMBLE_MATMUL_CANDIDATES`, clamped to
/// `1..=MAX_CANDIDATES`.
pub fn candidates() -> usize {
    std::env::var("RUMBLE_MATMUL_CANDIDATES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(CANDIDATES, |n| n.clamp(1, MAX_CANDIDATES))
}

/// The shape of one matmul: batch, row-major `M x K` times `K x N`, transposes, dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
}

impl MatmulKey {
    pub fn new(a: &TensorType, b: &TensorType, ta: bool, tb: bool) -> Self {
        let r = a.rank();
        let batch: usize = a.dims()[..r - 2].iter().product();
        let (m, k) = if ta { (a.dims()[r - 1], a.dims()[r - 2]) } else { (a.dims()[r - 2], a.dims()[r - 1]) };
        let n = if tb { b.dims()[r - 2] } else { b.dims()[r - 1] };
        MatmulKey { dtype: a.dtype, out: a.dtype, ta, tb, batch: batch as u64, m: m as u64, n: n as u64, k: k as u64 }
    }
}

/// Descriptors and the chosen algorithm of one shape.
pub struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    pub(crate) algo: sys::cublasLtMatmulAlgo_t,
    /// Workspace bytes the algorithm needs.
    pub workspace: usize,
    f64: bool,
}

#[derive(Default)]
pub struct Cache {
    plans: HashMap<MatmulKey, Plan>,
}

impl Cache {
    pub fn clear(&mut self) {
        for (_, p) in self.plans.drain() {
            unsafe {
                let _ = lt::destroy_matrix_layout(p.a);
                let _ = lt::destroy_matrix_layout(p.b);
                let _ = lt::destroy_matrix_layout(p.c);
                let _ = lt::destroy_matmul_desc(p.desc);
            }
        }
    }
}

fn blas_err(what: &str) -> impl Fn(lt::CublasError) -> CudaError + '_ {
    move |e| CudaError::Blas { op: "matmul".into(), what: what.to_string(), err: e.to_string() }
}

fn layout(ty: sys::cudaDataType, rows: u64, cols: u64, batch: u64) -> Result<sys::cublasLtMatrixLayout_t> {
    let l = lt::create_matrix_layout(ty, rows, cols, rows as i64).map_err(blas_err("cublasLtMatrixLayoutCreate"))?;
    if batch > 1 {
        let count = batch as i32;
        let stride = (rows * cols) as i64;
        unsafe {
            lt::set_matrix_layout_attribute(
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &count as *const i32 as *const c_void,
                4,
            )
            .map_err(blas_err("batch count"))?;
            lt::set_matrix_layout_attribute(
                l,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride as *const i64 as *const c_void,
                8,
            )
            .map_err(blas_err("batch stride"))?;
        }
    }
    Ok(l)
}

fn make_plan(dev: &Device, key: &MatmulKey) -> Result<Plan> {
    let (ty, compute, scale) = match key.dtype {
        DType::F32 => {
            let c = if std::env::var("RUMBLE_CUDA_TF32").is_ok_and(|v| v == "1") {
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
        lt::set_matmul_desc_attribute(
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &op_x as *const i32 as *const c_void,
            4,
        )
        .map_err(blas_err("transa"))?;
        lt::set_matmul_desc_attribute(
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &op_y as *const i32 as *const c_void,
            4,
        )
        .map_err(blas_err("transb"))?;
    }
    // Stored shapes, column-major: B row-major [K, N] is [N, K] (or [K, N] when tb).
    let x = if tb { layout(ty, k, n, batch)? } else { layout(ty, n, k, batch)? };
    let y = if ta { layout(ty, m, k, batch)? } else { layout(ty, k, m, batch)? };
    let c = layout(out_ty, n, m, batch)?;
    let pref = lt::create_matmul_pref().map_err(blas_err("cublasLtMatmulPreferenceCreate"))?;
    let ws = max_workspace() as u64;
    // No in-place split-K reduction (it uses atomics: results would vary run to run).
    let mask: u32 = 0x7 & !0x1;
    let heur = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const c_void,
            8,
        )
        .map_err(blas_err("workspace preference"))?;
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
            &mask as *const u32 as *const c_void,
            4,
        )
        .map_err(blas_err("reduction preference"))?;
        let want = candidates();
        let mut found = vec![std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed(); want];
        let mut count = 0i32;
        let h = sys::cublasLtMatmulAlgoGetHeuristic(
            dev.blas(),
            desc,
            x,
            y,
            c,
            c,
            pref,
            want as i32,
            found.as_mut_ptr() as *mut sys::cublasLtMatmulHeuristicResult_t,
            &mut count,
        )
        .result();
        let _ = lt::destroy_matmul_pref(pref);
        h.map_err(|e| CudaError::Blas {
            op: "matmul".into(),
            what: format!("no algorithm for {key:?}"),
            err: e.to_string(),
        })?;
        let found: Vec<_> = found[..(count.max(0) as usize).min(want)]
            .iter()
            .map(|r| r.assume_init())
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .collect();
        if found.is_empty() {
            return Err(CudaError::Blas {
                op: "matmul".into(),
                what: format!("no algorithm for {key:?}"),
                err: "the heuristic returned none".into(),
            });
        }
        found
    };
    let mut plan = Plan {
        desc,
        a: x,
        b: y,
        c,
        algo: heur[0].algo,
        workspace: heur[0].workspaceSize,
        f64: key.dtype == DType::F64,
    };
    if heur.len() > 1 {
        let pick = crate::matmul_tune::choose(dev, key, &mut plan, &heur);
        plan.algo = heur[pick].algo;
        plan.workspace = heur[pick].workspaceSize;
    }
    Ok(plan)
}

impl Device {
    /// Workspace bytes the cached algorithm of `key` needs (choosing it on first use).
    pub fn matmul_workspace(&self, key: &MatmulKey) -> Result<usize> {
        self.bind()?;
        let mut cache = self.matmul_cache.lock().map_err(|_| CudaError::usage("matmul cache poisoned"))?;
        if !cache.plans.contains_key(key) {
            let p = make_plan(self, key)?;
            cache.plans.insert(*key, p);
        }
        Ok(cache.plans[key].workspace)
    }

    /// Launches `c = op(a) op(b)` on the device's stream.
    ///
    /// # Safety
    /// `a`, `b`, `c` must point to device buffers of the key's shapes, `ws` to `ws_bytes` bytes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        key: &MatmulKey,
        a: dsys::CUdeviceptr,
        b: dsys::CUdeviceptr,
        c: dsys::CUdeviceptr,
        ws: dsys::CUdeviceptr,
        ws_bytes: usize,
        beta: f64,
    ) -> Result<()> {
        self.matmul_workspace(key)?;
        let cache = self.matmul_cache.lock().map_err(|_| CudaError::usage("matmul cache poisoned"))?;
        let p = &cache.plans[key];
        if ws_bytes < p.workspace {
            return Err(CudaError::usage(format!(
                "matmul {key:?} needs {} workspace bytes, the plan gave {ws_bytes}",
                p.workspace
            )));
        }
        unsafe { self.launch_plan(key, p, a, b, c, ws, beta) }
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
        a: dsys::CUdeviceptr,
        b: dsys::CUdeviceptr,
        c: dsys::CUdeviceptr,
        ws: dsys::CUdeviceptr,
        beta: f64,
    ) -> Result<()> {
        let (one32, zero32, one64, zero64) = (1f32, beta as f32, 1f64, beta);
        let (alpha, beta): (*const c_void, *const c_void) = if p.f64 {
            (&one64 as *const f64 as *const c_void, &zero64 as *const f64 as *const c_void)
        } else {
            (&one32 as *const f32 as *const c_void, &zero32 as *const f32 as *const c_void)
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
                c as *mut c_void,
                p.c,
                &p.algo,
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
}
