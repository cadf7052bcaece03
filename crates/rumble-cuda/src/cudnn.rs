//! cuDNN's fused attention, through its graph API (backend descriptors), as a second
//! implementation of `Op::Attention` and `Op::AttentionBackward` beside the flash kernels
//! (`crate::flash`): bf16 or f16, grouped-query heads, either `HeadLayout` (cuDNN takes any
//! strides whose head dimension is contiguous), causal or not.
//!
//! A graph is cuDNN's matmul, elementwise and reduction operations in the pattern its fused
//! attention engines take:
//! - forward: `s = scale * q k^T`, the causal mask (kept where row index >= column index, else
//!   -inf), `m = rowmax(s)`, `e = exp(s - m)`, `l = rowsum(e)`, `lse = m + ln l` (f32,
//!   `[B, Hq, T]`: the statistic the flash forward saves, so either backward follows either
//!   forward), `o = (e / l) v`;
//! - backward: `p = exp(scale * q k^T - lse)` masked, `delta = rowsum(dO * O)` into a buffer of
//!   its own, `dS = p (dO v^T - delta) scale`, `dQ = dS k` through an f32 accumulator
//!   `[B, Hq, T, D]`, `dK = dS^T q` and `dV = p^T dO` per query head, summed over each group.
//!
//! The engines accumulate dQ with atomics, so the backward is not deterministic (the last bits
//! of dQ vary from run to run): [`Knobs::deterministic`](crate::knobs::Knobs) keeps it out.
//! The forward is deterministic.
//!
//! Plans are made once per shape ([`Sdpa::plan`]: heuristic mode A, the first engine
//! configuration that finalizes) and kept per device with the cuDNN handle (`CudnnCache`); a
//! shape no engine takes has no plan, and the flash kernels run it. `recipe` decides per
//! shape (`RUMBLE_ATTENTION`): `auto` times both on scratch buffers once and keeps cuDNN only if
//! it is faster by more than 2%, remembered in `attention-<gpu>-<cudnn version>.txt` in the
//! kernel cache folder like the matmul tuner's choices. cuDNN's workspace, the delta rows and
//! the dQ accumulator are the recipe's scratch, planned with the node.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cudnn::sys as cs;
use cudarc::driver::sys as dsys;
use rumble_core::ir::{DType, HeadLayout, Op, TensorType};

use cs::cudnnBackendAttributeName_t as A;
use cs::cudnnBackendAttributeType_t as Ty;
use cs::cudnnBackendDescriptorType_t as D;
use cs::cudnnDataType_t as Dt;
use cs::cudnnPointwiseMode_t as Pw;

use crate::device::{Device, DeviceCache};
use crate::error::{CudaError, Result};
use crate::knobs::AttentionImpl;
use crate::launch::{Arg, Buffers, Recipe, Step};
use crate::memory::DeviceBuffer;
use crate::tune;

/// The oldest cuDNN whose engines take this graph (9.10: -inf as the mask value).
const MIN_VERSION: usize = 91000;
/// How much faster cuDNN must run a shape than the flash kernels to be chosen.
const MARGIN: f64 = 0.98;
/// Timed runs of each implementation (after one warm-up).
const RUNS: usize = 3;
/// Alignment of each part of the scratch.
const ALIGN: usize = 256;

fn check(status: cs::cudnnStatus_t, what: impl FnOnce() -> String) -> Result<()> {
    if status == cs::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cudnnGetErrorString returns a static C string for every status.
    let text = unsafe { std::ffi::CStr::from_ptr(cs::cudnnGetErrorString(status)) };
    Err(CudaError::Cudnn { what: what(), err: format!("{status:?} ({})", text.to_string_lossy()) })
}

/// One backend descriptor, destroyed on drop.
struct Desc(cs::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once.
        unsafe {
            let _ = cs::cudnnBackendDestroyDescriptor(self.0);
        }
    }
}

impl Desc {
    fn new(t: D) -> Result<Desc> {
        let mut d = std::ptr::null_mut();
        check(unsafe { cs::cudnnBackendCreateDescriptor(t, &mut d) }, || format!("creating a {t:?}"))?;
        Ok(Desc(d))
    }

    fn set<T>(&self, name: A, ty: Ty, vals: &[T]) -> Result<()> {
        // SAFETY: `vals` holds `len` elements of the C type `ty` names (each caller pairs them).
        let st = unsafe {
            cs::cudnnBackendSetAttribute(self.0, name, ty, vals.len() as i64, vals.as_ptr() as *const c_void)
        };
        check(st, || format!("setting {name:?}"))
    }

    fn i64s(&self, name: A, v: &[i64]) -> Result<()> {
        self.set(name, Ty::CUDNN_TYPE_INT64, v)
    }

    fn descs(&self, name: A, v: &[&Desc]) -> Result<()> {
        let raw: Vec<cs::cudnnBackendDescriptor_t> = v.iter().map(|d| d.0).collect();
        self.set(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }

    fn dtype(&self, name: A, t: Dt) -> Result<()> {
        self.set(name, Ty::CUDNN_TYPE_DATA_TYPE, &[t])
    }

    fn finalize(self, what: &str) -> Result<Desc> {
        check(unsafe { cs::cudnnBackendFinalize(self.0) }, || format!("finalizing {what}"))?;
        Ok(self)
    }
}

/// The operands' roles, as unique ids in the graphs and the variant pack.
mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const LSE: i64 = 5;
    pub const DO: i64 = 6;
    pub const DQ: i64 = 7;
    pub const DK: i64 = 8;
    pub const DV: i64 = 9;
    pub const SCALE: i64 = 10;
    pub const NEG_INF: i64 = 11;
    pub const ONE: i64 = 12;
    pub const DELTA: i64 = 13;
    pub const DQ_ACC: i64 = 14;
    /// Virtual tensors count up from here.
    pub const FIRST_VIRTUAL: i64 = 100;
}

/// What one attention graph computes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sdpa {
    pub backward: bool,
    pub dtype: DType,
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Queries and keys per sequence.
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub layout: HeadLayout,
    pub causal: bool,
    /// The softmax scale's f64 bits.
    pub scale: u64,
}

impl Sdpa {
    /// The graph `op` runs on operands `at`, or `None` where cuDNN has no engine for it (f32,
    /// f64, head sizes over 128 or not a multiple of 8).
    pub fn of(op: &Op, at: &[&TensorType]) -> Option<Sdpa> {
        let (Op::Attention { scale, causal, layout } | Op::AttentionBackward { scale, causal, layout }) = op else {
            return None;
        };
        let (q, k) = (at.first()?, at.get(1)?);
        if !matches!(q.dtype, DType::BF16 | DType::F16) || q.shape.rank() != 4 || k.shape.rank() != 4 {
            return None;
        }
        let (qd, kd) = (q.shape.dims(), k.shape.dims());
        let ((b, t, hq, d), (s, hkv)) = match layout {
            HeadLayout::Bhtd => ((qd[0], qd[2], qd[1], qd[3]), (kd[2], kd[1])),
            HeadLayout::Bthd => ((qd[0], qd[1], qd[2], qd[3]), (kd[1], kd[2])),
        };
        if d == 0 || d > 128 || d % 8 != 0 || hkv == 0 || hq % hkv != 0 || (*causal && t != s) {
            return None;
        }
        Some(Sdpa {
            backward: matches!(op, Op::AttentionBackward { .. }),
            dtype: q.dtype,
            batch: b,
            q_heads: hq,
            kv_heads: hkv,
            t,
            s,
            d,
            layout: *layout,
            causal: *causal,
            scale: scale.to_bits(),
        })
    }

    /// Dims `[B, H, rows, D]` and element strides of a q-like (`H` = Hq, rows = T) or k-like
    /// operand in the op's layout.
    fn operand(&self, heads: usize, rows: usize) -> ([i64; 4], [i64; 4]) {
        let (h, r, d) = (heads as i64, rows as i64, self.d as i64);
        let dims = [self.batch as i64, h, r, d];
        let strides = match self.layout {
            HeadLayout::Bhtd => [h * r * d, r * d, d, 1],
            HeadLayout::Bthd => [r * h * d, d, h * d, 1],
        };
        (dims, strides)
    }

    fn io(&self) -> Dt {
        if self.dtype == DType::F16 { Dt::CUDNN_DATA_HALF } else { Dt::CUDNN_DATA_BFLOAT16 }
    }

    /// Bytes of the delta rows and of the dQ accumulator (the backward's buffers), each aligned.
    fn buffers(&self) -> (usize, usize) {
        if !self.backward {
            return (0, 0);
        }
        let rows = self.batch * self.q_heads * self.t;
        (align(rows * 4), align(rows * self.d * 4))
    }
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// A graph under construction: its descriptors (kept alive with the plan) and operations.
struct Graph {
    keep: Vec<Desc>,
    ops: Vec<usize>,
    next: i64,
}

/// A tensor of the graph: the index of its descriptor in `Graph::keep`.
#[derive(Clone, Copy)]
struct T(usize);

impl Graph {
    fn tensor(&mut self, id: i64, t: Dt, dims: [i64; 4], strides: [i64; 4], virt: bool, by_value: bool) -> Result<T> {
        let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.dtype(A::CUDNN_ATTR_TENSOR_DATA_TYPE, t)?;
        d.i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
        d.i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
        d.i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
        d.i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
        d.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, Ty::CUDNN_TYPE_BOOLEAN, &[virt])?;
        if by_value {
            d.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, Ty::CUDNN_TYPE_BOOLEAN, &[true])?;
        }
        self.keep.push(d.finalize("a tensor descriptor")?);
        Ok(T(self.keep.len() - 1))
    }

    /// A real (non-virtual) tensor with the given uid.
    fn real(&mut self, id: i64, t: Dt, dims: [i64; 4], strides: [i64; 4]) -> Result<T> {
        self.tensor(id, t, dims, strides, false, false)
    }

    /// A virtual tensor (an intermediate the engine keeps on chip).
    fn virt(&mut self, t: Dt, dims: [i64; 4], strides: [i64; 4]) -> Result<T> {
        self.next += 1;
        self.tensor(self.next, t, dims, strides, true, false)
    }

    /// An f32 scalar passed by value (a host pointer in the variant pack).
    fn scalar(&mut self, id: i64) -> Result<T> {
        self.tensor(id, Dt::CUDNN_DATA_FLOAT, [1; 4], [1; 4], false, true)
    }

    fn op(&mut self, d: Desc, what: &str) -> Result<()> {
        self.keep.push(d.finalize(what)?);
        self.ops.push(self.keep.len() - 1);
        Ok(())
    }

    /// `y = mode(x, b)`, or `y = t ? x : b` for `BINARY_SELECT` (`b`'s second field: `t`).
    fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        x: T,
        b: (Option<T>, Option<T>),
        y: T,
        axis: Option<i64>,
    ) -> Result<()> {
        let (b, sel) = b;
        let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(A::CUDNN_ATTR_POINTWISE_MODE, Ty::CUDNN_TYPE_POINTWISE_MODE, &[mode])?;
        pw.dtype(A::CUDNN_ATTR_POINTWISE_MATH_PREC, prec)?;
        if let Some(a) = axis {
            pw.i64s(A::CUDNN_ATTR_POINTWISE_AXIS, &[a])?;
        }
        self.keep.push(pw.finalize("a pointwise descriptor")?);
        let pwi = self.keep.len() - 1;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&self.keep[pwi]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[&self.keep[x.0]])?;
        if let Some(b) = b {
            op.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[&self.keep[b.0]])?;
        }
        if let Some(t) = sel {
            op.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[&self.keep[t.0]])?;
        }
        op.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[&self.keep[y.0]])?;
        self.op(op, &format!("a {mode:?} operation"))
    }

    fn f32(&mut self, mode: Pw, x: T, b: Option<T>, y: T) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, x, (b, None), y, None)
    }

    fn reduction(&mut self, r: cs::cudnnReduceTensorOp_t, x: T, y: T) -> Result<()> {
        let rd = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        rd.set(A::CUDNN_ATTR_REDUCTION_OPERATOR, Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &[r])?;
        rd.dtype(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?;
        self.keep.push(rd.finalize("a reduction descriptor")?);
        let ri = self.keep.len() - 1;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[&self.keep[x.0]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[&self.keep[y.0]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&self.keep[ri]])?;
        self.op(op, &format!("a {r:?} reduction"))
    }

    /// `c = a b` over the last two dims, batched over the first two (`b`'s heads broadcast
    /// over groups of `a`'s).
    fn matmul(&mut self, a: T, b: T, c: T) -> Result<()> {
        let md = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        md.dtype(A::CUDNN_ATTR_MATMUL_COMP_TYPE, Dt::CUDNN_DATA_FLOAT)?;
        self.keep.push(md.finalize("a matmul descriptor")?);
        let mi = self.keep.len() - 1;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.descs(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[&self.keep[a.0]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[&self.keep[b.0]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[&self.keep[c.0]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&self.keep[mi]])?;
        self.op(op, "a matmul operation")
    }

    fn reshape(&mut self, x: T, y: T) -> Result<()> {
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.descs(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[&self.keep[x.0]])?;
        op.descs(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[&self.keep[y.0]])?;
        self.op(op, "a reshape operation")
    }

    /// `scores` with everything above the diagonal set to -inf (unchanged when not causal).
    fn causal_mask(&mut self, g: &Sdpa, scores: T, dims: [i64; 4], strides: [i64; 4]) -> Result<T> {
        if !g.causal {
            return Ok(scores);
        }
        let col = self.virt(Dt::CUDNN_DATA_INT32, dims, strides)?;
        let row = self.virt(Dt::CUDNN_DATA_INT32, dims, strides)?;
        let keep = self.virt(Dt::CUDNN_DATA_BOOLEAN, dims, strides)?;
        let neg_inf = self.scalar(uid::NEG_INF)?;
        let masked = self.virt(Dt::CUDNN_DATA_FLOAT, dims, strides)?;
        let f = Dt::CUDNN_DATA_FLOAT;
        self.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, f, scores, (None, None), col, Some(3))?;
        self.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, f, scores, (None, None), row, Some(2))?;
        self.pointwise(Pw::CUDNN_POINTWISE_CMP_GE, Dt::CUDNN_DATA_BOOLEAN, row, (Some(col), None), keep, None)?;
        self.pointwise(Pw::CUDNN_POINTWISE_BINARY_SELECT, f, scores, (Some(neg_inf), Some(keep)), masked, None)?;
        Ok(masked)
    }

    /// The operations of `g`'s forward.
    fn forward(&mut self, g: &Sdpa) -> Result<()> {
        use cs::cudnnReduceTensorOp_t::{CUDNN_REDUCE_TENSOR_ADD, CUDNN_REDUCE_TENSOR_MAX};
        let f = Dt::CUDNN_DATA_FLOAT;
        let (b, hq, t, s) = (g.batch as i64, g.q_heads as i64, g.t as i64, g.s as i64);
        let (qdims, qstr) = g.operand(g.q_heads, g.t);
        let (kdims, kstr) = g.operand(g.kv_heads, g.s);
        let q = self.real(uid::Q, g.io(), qdims, qstr)?;
        let kt = self.real(uid::K, g.io(), [kdims[0], kdims[1], kdims[3], kdims[2]], [kstr[0], kstr[1], 1, kstr[2]])?;
        let v = self.real(uid::V, g.io(), kdims, kstr)?;
        let o = self.real(uid::O, g.io(), qdims, qstr)?;
        let sdims = [b, hq, t, s];
        let sstr = [hq * t * s, t * s, s, 1];
        let (rdims, rstr) = ([b, hq, t, 1], [hq * t, t, 1, 1]);
        let raw = self.virt(f, sdims, sstr)?;
        let scale = self.scalar(uid::SCALE)?;
        let scaled = self.virt(f, sdims, sstr)?;
        self.matmul(q, kt, raw)?;
        self.f32(Pw::CUDNN_POINTWISE_MUL, raw, Some(scale), scaled)?;
        let masked = self.causal_mask(g, scaled, sdims, sstr)?;
        let lse = self.real(uid::LSE, f, rdims, rstr)?;
        let p = self.virt(g.io(), sdims, sstr)?;
        let max = self.virt(f, rdims, rstr)?;
        let shifted = self.virt(f, sdims, sstr)?;
        let e = self.virt(f, sdims, sstr)?;
        let sum = self.virt(f, rdims, rstr)?;
        let log = self.virt(f, rdims, rstr)?;
        self.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, max)?;
        self.f32(Pw::CUDNN_POINTWISE_SUB, masked, Some(max), shifted)?;
        self.f32(Pw::CUDNN_POINTWISE_EXP, shifted, None, e)?;
        self.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum)?;
        self.f32(Pw::CUDNN_POINTWISE_LOG, sum, None, log)?;
        self.f32(Pw::CUDNN_POINTWISE_ADD, max, Some(log), lse)?;
        self.f32(Pw::CUDNN_POINTWISE_DIV, e, Some(sum), p)?;
        self.matmul(p, v, o)
    }

    /// The operations of `g`'s backward.
    fn backward(&mut self, g: &Sdpa) -> Result<()> {
        use cs::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD;
        let f = Dt::CUDNN_DATA_FLOAT;
        let (b, hq, t, s, d) = (g.batch as i64, g.q_heads as i64, g.t as i64, g.s as i64, g.d as i64);
        let grouped = g.q_heads != g.kv_heads;
        let (qdims, qstr) = g.operand(g.q_heads, g.t);
        let (kdims, kstr) = g.operand(g.kv_heads, g.s);
        let transposed =
            |dims: [i64; 4], str: [i64; 4]| ([dims[0], dims[1], dims[3], dims[2]], [str[0], str[1], 1, str[2]]);
        let (ktd, kts) = transposed(kdims, kstr);
        let q = self.real(uid::Q, g.io(), qdims, qstr)?;
        let kt = self.real(uid::K, g.io(), ktd, kts)?;
        let vt = self.real(uid::V, g.io(), ktd, kts)?;
        let o = self.real(uid::O, g.io(), qdims, qstr)?;
        let dout = self.real(uid::DO, g.io(), qdims, qstr)?;
        let dq = self.real(uid::DQ, g.io(), qdims, qstr)?;
        let dk = self.real(uid::DK, g.io(), kdims, kstr)?;
        let dv = self.real(uid::DV, g.io(), kdims, kstr)?;
        let (rdims, rstr) = ([b, hq, t, 1], [hq * t, t, 1, 1]);
        let lse = self.real(uid::LSE, f, rdims, rstr)?;
        let delta = self.real(uid::DELTA, f, rdims, rstr)?;
        let dq_acc = self.real(uid::DQ_ACC, f, qdims, [hq * t * d, t * d, d, 1])?;
        let scale = self.scalar(uid::SCALE)?;
        let one = self.scalar(uid::ONE)?;
        let sdims = [b, hq, t, s];
        let sstr = [hq * t * s, t * s, s, 1];
        let (tdims, tstr) = ([b, hq, s, t], [hq * t * s, t * s, 1, s]);
        let full = ([b, hq, s, d], [hq * s * d, s * d, d, 1]);

        let dp = self.virt(f, sdims, sstr)?;
        self.matmul(dout, vt, dp)?;
        let raw = self.virt(f, sdims, sstr)?;
        self.matmul(q, kt, raw)?;
        let prod = self.virt(f, qdims, [hq * t * d, t * d, qstr[2], 1])?;
        self.f32(Pw::CUDNN_POINTWISE_MUL, dout, Some(o), prod)?;
        let k_rows = self.virt(f, kdims, kstr)?;
        self.reshape(kt, k_rows)?;
        let scaled = self.virt(f, sdims, sstr)?;
        self.f32(Pw::CUDNN_POINTWISE_MUL, raw, Some(scale), scaled)?;
        let shifted = self.virt(f, sdims, sstr)?;
        self.f32(Pw::CUDNN_POINTWISE_SUB, scaled, Some(lse), shifted)?;
        let masked = self.causal_mask(g, shifted, sdims, sstr)?;
        let p = self.virt(f, sdims, sstr)?;
        self.f32(Pw::CUDNN_POINTWISE_EXP, masked, None, p)?;
        let pt = self.virt(g.io(), tdims, tstr)?;
        self.reshape(p, pt)?;
        let dv_heads = if grouped { self.virt(g.io(), full.0, full.1)? } else { dv };
        self.matmul(pt, dout, dv_heads)?;
        let rowsum = self.virt(f, rdims, rstr)?;
        self.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, rowsum)?;
        self.f32(Pw::CUDNN_POINTWISE_MUL, rowsum, Some(one), delta)?;
        let centered = self.virt(f, sdims, sstr)?;
        self.f32(Pw::CUDNN_POINTWISE_SUB, dp, Some(delta), centered)?;
        let ds_unscaled = self.virt(f, sdims, sstr)?;
        self.f32(Pw::CUDNN_POINTWISE_MUL, centered, Some(p), ds_unscaled)?;
        let ds = self.virt(f, sdims, sstr)?;
        self.f32(Pw::CUDNN_POINTWISE_MUL, ds_unscaled, Some(scale), ds)?;
        self.matmul(ds, k_rows, dq_acc)?;
        self.f32(Pw::CUDNN_POINTWISE_IDENTITY, dq_acc, None, dq)?;
        let dst = self.virt(g.io(), tdims, tstr)?;
        self.reshape(ds, dst)?;
        let dk_heads = if grouped { self.virt(g.io(), full.0, full.1)? } else { dk };
        self.matmul(dst, q, dk_heads)?;
        if grouped {
            self.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_heads, dk)?;
            self.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_heads, dv)?;
        }
        Ok(())
    }
}

/// A finalized execution plan for one [`Sdpa`] graph.
pub struct SdpaPlan {
    pub graph: Sdpa,
    /// Bytes of cuDNN's own workspace.
    pub workspace: usize,
    plan: Desc,
    /// The descriptors the plan was made from, alive as long as it is.
    _keep: Vec<Desc>,
    handle: cs::cudnnHandle_t,
    /// The by-value scalars: scale, -inf, 1 (read through host pointers at each execution).
    scalars: Box<[f32; 3]>,
}

// The handle and descriptors are only used with the device's context current, and cuDNN's
// descriptors are not mutated after finalization.
unsafe impl Send for SdpaPlan {}
unsafe impl Sync for SdpaPlan {}

impl std::fmt::Debug for SdpaPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SdpaPlan({:?}, workspace {})", self.graph, self.workspace)
    }
}

impl SdpaPlan {
    /// Bytes of scratch the recipe needs: workspace, delta rows, dQ accumulator.
    pub fn scratch(&self) -> usize {
        let (delta, acc) = self.graph.buffers();
        align(self.workspace) + delta + acc
    }

    /// Enqueues the plan on the device's stream: `ptrs` are the op's operands then results
    /// (forward: q, k, v, o, lse; backward: q, k, v, o, lse, do, dq, dk, dv), `scratch` holds
    /// [`SdpaPlan::scratch`] bytes.
    ///
    /// # Safety
    /// The addresses must be live device allocations of the graph's shapes.
    pub unsafe fn execute(&self, ptrs: &[dsys::CUdeviceptr], scratch: dsys::CUdeviceptr) -> Result<()> {
        let roles: &[i64] = if self.graph.backward {
            &[uid::Q, uid::K, uid::V, uid::O, uid::LSE, uid::DO, uid::DQ, uid::DK, uid::DV]
        } else {
            &[uid::Q, uid::K, uid::V, uid::O, uid::LSE]
        };
        if ptrs.len() != roles.len() {
            return Err(CudaError::usage(format!(
                "cuDNN attention: {} buffers for {} operands",
                ptrs.len(),
                roles.len()
            )));
        }
        let mut ids: Vec<i64> = roles.to_vec();
        let mut data: Vec<*mut c_void> = ptrs.iter().map(|&p| p as *mut c_void).collect();
        ids.push(uid::SCALE);
        data.push(&self.scalars[0] as *const f32 as *mut c_void);
        if self.graph.causal {
            ids.push(uid::NEG_INF);
            data.push(&self.scalars[1] as *const f32 as *mut c_void);
        }
        let ws = scratch;
        if self.graph.backward {
            let (delta, _) = self.graph.buffers();
            let at = scratch + align(self.workspace) as u64;
            ids.extend([uid::ONE, uid::DELTA, uid::DQ_ACC]);
            data.push(&self.scalars[2] as *const f32 as *mut c_void);
            data.push(at as *mut c_void);
            data.push((at + delta as u64) as *mut c_void);
        }
        let vp = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        vp.i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &ids)?;
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, Ty::CUDNN_TYPE_VOID_PTR, &data)?;
        vp.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, Ty::CUDNN_TYPE_VOID_PTR, &[ws as *mut c_void])?;
        let vp = vp.finalize("the variant pack")?;
        check(unsafe { cs::cudnnBackendExecute(self.handle, self.plan.0, vp.0) }, || {
            format!("running attention {:?}", self.graph)
        })
    }
}

/// The cuDNN handle of a device (on its stream) and the plans made so far (`None`: no engine).
#[derive(Default)]
pub(crate) struct CudnnCache {
    handle: Option<Handle>,
    /// Whether cuDNN was looked for and is unusable (missing, too old, no handle).
    absent: bool,
    plans: HashMap<Sdpa, Option<Arc<SdpaPlan>>>,
    /// Choices made by timing this process (`true`: cuDNN).
    chosen: HashMap<Sdpa, bool>,
}

struct Handle(cs::cudnnHandle_t);
unsafe impl Send for Handle {}

impl DeviceCache for CudnnCache {
    fn release(&mut self) {
        self.plans.clear();
        if let Some(h) = self.handle.take() {
            unsafe {
                let _ = cs::cudnnDestroy(h.0);
            }
        }
    }
}

/// cuDNN's version (e.g. 91400), or `None` when its library cannot be loaded.
pub fn version() -> Option<usize> {
    std::panic::catch_unwind(|| unsafe {
        if !cs::is_culib_present() {
            return None;
        }
        Some(cs::cudnnGetVersion())
    })
    .ok()
    .flatten()
}

fn handle(dev: &Device, cache: &mut CudnnCache) -> Option<cs::cudnnHandle_t> {
    if cache.absent {
        return None;
    }
    if let Some(h) = &cache.handle {
        return Some(h.0);
    }
    let made = (|| {
        if version()? < MIN_VERSION {
            return None;
        }
        dev.bind().ok()?;
        let mut h = std::ptr::null_mut();
        unsafe {
            if cs::cudnnCreate(&mut h) != cs::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                return None;
            }
            if cs::cudnnSetStream(h, dev.stream() as cs::cudaStream_t) != cs::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                let _ = cs::cudnnDestroy(h);
                return None;
            }
        }
        Some(h)
    })();
    match made {
        Some(h) => {
            cache.handle = Some(Handle(h));
            Some(h)
        }
        None => {
            cache.absent = true;
            None
        }
    }
}

impl Sdpa {
    /// The execution plan of this graph on `dev`: made on first use and kept; `None` where
    /// cuDNN is missing, older than 9.10, or none of its engines takes the graph.
    pub fn plan(&self, dev: &Device) -> Option<Arc<SdpaPlan>> {
        let cache = dev.cache::<CudnnCache>();
        let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = c.plans.get(self) {
            return p.clone();
        }
        let h = handle(dev, &mut c)?;
        let plan = self.build(h).ok().map(Arc::new);
        c.plans.insert(self.clone(), plan.clone());
        plan
    }

    fn build(&self, handle: cs::cudnnHandle_t) -> Result<SdpaPlan> {
        let mut g = Graph { keep: Vec::new(), ops: Vec::new(), next: uid::FIRST_VIRTUAL };
        if self.backward {
            g.backward(self)?
        } else {
            g.forward(self)?
        }
        let og = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        og.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle])?;
        let ops: Vec<&Desc> = g.ops.iter().map(|&i| &g.keep[i]).collect();
        og.descs(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
        let og = og.finalize("the attention graph")?;
        let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.descs(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&og])?;
        heur.set(
            A::CUDNN_ATTR_ENGINEHEUR_MODE,
            Ty::CUDNN_TYPE_HEUR_MODE,
            &[cs::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
        )?;
        let heur = heur.finalize("the engine heuristic")?;
        let results = A::CUDNN_ATTR_ENGINEHEUR_RESULTS;
        let bd = Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR;
        let mut n = 0i64;
        check(unsafe { cs::cudnnBackendGetAttribute(heur.0, results, bd, 0, &mut n, std::ptr::null_mut()) }, || {
            "counting engine configurations".into()
        })?;
        let cfgs = (0..n).map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)).collect::<Result<Vec<_>>>()?;
        let mut raw: Vec<cs::cudnnBackendDescriptor_t> = cfgs.iter().map(|c| c.0).collect();
        let mut got = 0i64;
        check(
            unsafe { cs::cudnnBackendGetAttribute(heur.0, results, bd, n, &mut got, raw.as_mut_ptr() as *mut c_void) },
            || "reading engine configurations".into(),
        )?;
        let mut last = CudaError::Cudnn { what: format!("{self:?}"), err: "no engine configuration".into() };
        for cfg in cfgs.iter().take(got.max(0) as usize) {
            let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle])?;
            plan.descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[cfg])?;
            let plan = match plan.finalize("an execution plan") {
                Ok(p) => p,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let mut ws = 0i64;
            let mut cnt = 0i64;
            check(
                unsafe {
                    cs::cudnnBackendGetAttribute(
                        plan.0,
                        A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                        Ty::CUDNN_TYPE_INT64,
                        1,
                        &mut cnt,
                        &mut ws as *mut i64 as *mut c_void,
                    )
                },
                || "reading the workspace size".into(),
            )?;
            let mut keep = g.keep;
            keep.extend([og, heur]);
            keep.extend(cfgs);
            let scale = f64::from_bits(self.scale) as f32;
            return Ok(SdpaPlan {
                graph: self.clone(),
                workspace: ws.max(0) as usize,
                plan,
                _keep: keep,
                handle,
                scalars: Box::new([scale, f32::NEG_INFINITY, 1.0]),
            });
        }
        Err(last)
    }
}

/// The recipe of an attention node on cuDNN, where `RUMBLE_ATTENTION` and the shape choose it
/// (module doc); `None`: the flash kernels run it.
pub(crate) fn recipe(dev: &Device, op: &Op, at: &[&TensorType]) -> Option<Recipe> {
    let knobs = dev.knobs();
    let mode = knobs.attention;
    if matches!(mode, AttentionImpl::Flash | AttentionImpl::Naive) {
        return None;
    }
    let g = Sdpa::of(op, at)?;
    if g.backward && knobs.deterministic {
        return None;
    }
    let plan = g.plan(dev)?;
    let r = cudnn_recipe(op, plan);
    if mode == AttentionImpl::Cudnn || choose(dev, &g, &r, op, at) {
        return Some(r);
    }
    None
}

fn cudnn_recipe(op: &Op, plan: Arc<SdpaPlan>) -> Recipe {
    let (n_in, n_out) = if plan.graph.backward { (6, 3) } else { (3, 2) };
    let mut args: Vec<Arg> = (0..n_in).map(Arg::In).collect();
    args.extend((0..n_out).map(Arg::Out));
    let scratch = plan.scratch();
    Recipe { op: op.name(), steps: vec![Step::Cudnn { plan, args, ws: 0 }], scratch, node_scratch: 0 }
}

/// Whether cuDNN runs `g` (its recipe `r`) faster than the flash kernels, timed once per shape
/// and remembered (module doc).
fn choose(dev: &Device, g: &Sdpa, r: &Recipe, op: &Op, at: &[&TensorType]) -> bool {
    let cache = dev.cache::<CudnnCache>();
    if let Some(&c) = cache.lock().unwrap_or_else(|e| e.into_inner()).chosen.get(g) {
        return c;
    }
    let key = format!("{g:?}");
    let file = tune::cache_file(dev, "attention", version().unwrap_or(0));
    let pick = match file.as_ref().and_then(|f| tune::remembered(f, &key)).as_deref() {
        Some("cudnn") => true,
        Some("flash") => false,
        _ => {
            if tune::capturing(dev) {
                return false;
            }
            let Some(Ok(flash)) = crate::flash::recipe(dev, op, at) else { return true };
            match (time(dev, &flash, op, at), time(dev, r, op, at)) {
                (Ok(f), Ok(c)) => {
                    let p = c < MARGIN * f;
                    if let Some(f) = &file {
                        tune::remember(f, &key, if p { "cudnn" } else { "flash" });
                    }
                    p
                }
                // A timing that failed (scratch buffers that did not fit, say) decides for this
                // process only: nothing is remembered that a later process would not re-time.
                (Err(_), Ok(_)) => true,
                _ => false,
            }
        }
    };
    cache.lock().unwrap_or_else(|e| e.into_inner()).chosen.insert(g.clone(), pick);
    pick
}

/// Milliseconds per run of `r` on scratch buffers of the op's shapes (filled with about 0.0115
/// everywhere: a uniform softmax, no overflow in the backward's exp).
fn time(dev: &Device, r: &Recipe, op: &Op, at: &[&TensorType]) -> Result<f64> {
    let outs = op.infer(at).map_err(|e| CudaError::usage(format!("timing attention: {e}")))?;
    let mut bufs = Vec::new();
    for t in at.iter().copied().chain(outs.iter()) {
        let b = DeviceBuffer::new(dev, t.size_in_bytes(), "timing attention")?;
        crate::memory::fill(dev, b.ptr, 0x3c, t.size_in_bytes())?;
        bufs.push(b);
    }
    let scratch = DeviceBuffer::new(dev, r.scratch.max(1), "timing attention")?;
    let node = DeviceBuffer::new(dev, op.scratch_bytes(at).max(1), "timing attention")?;
    let ptrs: Vec<dsys::CUdeviceptr> = bufs.iter().map(|b| b.ptr).collect();
    let (args, outp) = ptrs.split_at(at.len());
    let b = Buffers { args, outs: outp, scratch: scratch.ptr, scratch_bytes: scratch.bytes, node: node.ptr };
    tune::time_ms(dev, RUNS, "attention timing", || unsafe { r.launch(dev, 0, &b) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tt(dtype: DType, dims: &[usize]) -> TensorType {
        TensorType::new(dtype, dims.to_vec())
    }

    #[test]
    fn graphs_are_read_from_either_layout() {
        let op = Op::Attention { scale: 0.125, causal: true, layout: HeadLayout::Bthd };
        let (q, k) = (tt(DType::BF16, &[2, 64, 8, 64]), tt(DType::BF16, &[2, 64, 2, 64]));
        let g = Sdpa::of(&op, &[&q, &k, &k]).unwrap();
        assert_eq!((g.batch, g.q_heads, g.kv_heads, g.t, g.s, g.d), (2, 8, 2, 64, 64, 64));
        // bthd: heads are D apart, positions H * D apart.
        assert_eq!(g.operand(8, 64), ([2, 8, 64, 64], [64 * 8 * 64, 64, 8 * 64, 1]));
        let op = Op::AttentionBackward { scale: 0.125, causal: false, layout: HeadLayout::Bhtd };
        let (q, k) = (tt(DType::F16, &[1, 4, 32, 128]), tt(DType::F16, &[1, 4, 48, 128]));
        let g = Sdpa::of(&op, &[&q, &k, &k, &q, &tt(DType::F32, &[1, 4, 32]), &q]).unwrap();
        assert!(g.backward && g.s == 48 && g.t == 32);
        assert_eq!(g.operand(4, 48), ([1, 4, 48, 128], [4 * 48 * 128, 48 * 128, 128, 1]));
        // Delta rows and the f32 dQ accumulator, each aligned.
        assert_eq!(g.buffers(), (align(4 * 32 * 4), 4 * 32 * 128 * 4));
    }

    #[test]
    fn shapes_without_an_engine_stay_on_the_flash_kernels() {
        let op = Op::Attention { scale: 0.1, causal: true, layout: HeadLayout::Bhtd };
        let f32s = tt(DType::F32, &[1, 2, 16, 64]);
        assert!(Sdpa::of(&op, &[&f32s, &f32s, &f32s]).is_none(), "f32");
        let wide = tt(DType::BF16, &[1, 2, 16, 256]);
        assert!(Sdpa::of(&op, &[&wide, &wide, &wide]).is_none(), "head size 256");
        let odd = tt(DType::BF16, &[1, 2, 16, 36]);
        assert!(Sdpa::of(&op, &[&odd, &odd, &odd]).is_none(), "head size not a multiple of 8");
        let (q, k) = (tt(DType::BF16, &[1, 2, 16, 64]), tt(DType::BF16, &[1, 2, 32, 64]));
        assert!(Sdpa::of(&op, &[&q, &k, &k]).is_none(), "causal with T != S");
        assert!(Sdpa::of(&Op::Softmax, &[&q]).is_none());
    }
}
