//! The per-row attention kernels of `kernels/attention.cu`: the fallback where `flash::choose`
//! takes no flash kernel (f64, head sizes over 256, GPUs before sm_80, `RUMBLE_ATTENTION=naive`).
//! One block per query row (forward and dQ) or key row (dK/dV), any head size up to
//! [`ATTN_MAX_HEAD`].

use rumble_core::ir::{DType, Op, TensorType};

use super::{Builder, rows_grid, sfx};
use crate::error::{CudaError, Result};
use crate::kernels::KernelFile;
use crate::launch::Arg;

const ATTN_THREADS: u32 = 128;
const ATTN_MAX_HEAD: usize = 128 * 8;

/// The steps of attention or its backward on the per-row kernels (`dt`: the operands' dtype).
pub(super) fn prepare(b: &mut Builder, op: &Op, at: &[&TensorType], dt: DType) -> Result<()> {
    let dev = b.dev;
    let (Op::Attention { scale, causal, layout } | Op::AttentionBackward { scale, causal, layout }) = op else {
        return Err(CudaError::usage(format!("{} is not attention", op.name())));
    };
    let unsupported = |what: String| CudaError::Unsupported(format!("{} on {what}", op.name()));
    let ([qb, hq, t, d], [_, hkv, s, _]) = (layout.bhtd(at[0].dims()), layout.bhtd(at[1].dims()));
    if d > ATTN_MAX_HEAD {
        return Err(unsupported(format!("head size {d} (at most {ATTN_MAX_HEAD})")));
    }
    let q = [qb, hq, t, d];
    let k = [qb, hkv, s, d];
    let dims = crate::flash::dims_blob(*layout, [qb, hq, hkv, t, s, d]);
    let acc = if dt == DType::F64 { 8 } else { 4 };
    let smem = ((2 * d + 2 * ATTN_THREADS as usize) * acc) as u32;
    let (sc, ca) = (Arg::F64(*scale), Arg::I32(*causal as i32));
    let s = sfx(dt);
    let q_rows = q[0] * q[1] * q[2];
    if matches!(op, Op::Attention { .. }) {
        let args = [Arg::ins(&[0, 1, 2]), vec![Arg::Out(0), Arg::Out(1), dims, sc, ca]].concat();
        b.k(KernelFile::Attention, format!("attention_{s}"), rows_grid(dev, q_rows), ATTN_THREADS, smem, args)?;
    } else {
        let delta = b.scratch(q_rows * 8);
        // dQ (and delta) of each query row, then dK and dV of each key row.
        let tail = vec![dims, sc, ca];
        let dq = [Arg::ins(&[0, 1, 2, 3, 4, 5]), vec![Arg::Out(0), Arg::Scratch(delta)], tail.clone()].concat();
        let dkdv = [Arg::ins(&[0, 1, 2, 4, 5]), vec![Arg::Scratch(delta), Arg::Out(1), Arg::Out(2)], tail].concat();
        let kv_rows = k[0] * k[1] * k[2];
        for (name, rows, args) in [("dq", q_rows, dq), ("dkdv", kv_rows, dkdv)] {
            let (kernel, grid) = (format!("attention_backward_{name}_{s}"), rows_grid(dev, rows));
            b.k(KernelFile::Attention, kernel, grid, ATTN_THREADS, smem, args)?;
        }
    }
    Ok(())
}
