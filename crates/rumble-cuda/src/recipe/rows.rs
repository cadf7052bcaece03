//! Recipes of the row-wise ops on `kernels/rows.cu`: RMS norm (and its backward's per-group
//! weight-gradient pieces), RoPE (its cos/sin table computed once per node into scratch),
//! packed SwiGLU, softmax, cross-entropy, and the fused linear cross-entropy.

use rumble_core::ir::{DType, HeadLayout, Op, TensorType};

use super::{Builder, grid_for, rows_grid, sfx, warp_rows_grid};
use crate::error::{CudaError, Result};
use crate::kernels::KernelFile;
use crate::launch::{Arg, Step};

/// `rms_norm` of `rows` rows of `d` (operands 0 and 1) into `y`: a block a row where there are
/// fewer rows than multiprocessors (a warp each would leave a row's loads queued), else a warp a
/// row. Also `matmul_pre`'s rows where cuBLAS runs its products.
pub(super) fn rms_norm(b: &mut Builder, dt: DType, rows: usize, d: usize, eps: f64, y: Arg) -> Result<()> {
    let args = vec![Arg::In(0), Arg::In(1), y, Arg::I64(rows as i64), Arg::I64(d as i64), Arg::F64(eps)];
    if rows < b.dev.multiprocessors {
        let grid = (rows.max(1) as u32, 1, 1);
        b.k(KernelFile::Rows, format!("rms_norm_block_{}", sfx(dt)), grid, 256, 0, args)
    } else {
        let grid = warp_rows_grid(b.dev, rows);
        b.k(KernelFile::Rows, format!("rms_norm_{}", sfx(dt)), grid, 256, 0, args)
    }
}

/// `swiglu_packed` of `rows` rows of `2f` (operand 0) into `y`. Also `matmul_pre`'s rows where
/// cuBLAS runs its products.
pub(super) fn swiglu_packed(b: &mut Builder, dt: DType, rows: usize, f: usize, y: Arg) -> Result<()> {
    if rows * f == 0 {
        return Ok(());
    }
    let args = [vec![Arg::In(0), y], Arg::i64s(&[rows, f])].concat();
    b.k(KernelFile::Rows, format!("swiglu_packed_{}", sfx(dt)), grid_for(b.dev, rows * f, 256), 256, 0, args)
}

/// The 16-byte chunks a thread of `rms_norm_backward_wide_*` takes (rows.cu's RMS_BWD_WIDE).
const RMS_BWD_WIDE: usize = 4;

/// The steps of a row-wise op (`dt`: its first operand's dtype).
pub(super) fn prepare(b: &mut Builder, op: &Op, at: &[&TensorType], dt: DType) -> Result<()> {
    let dev = b.dev;
    match op {
        Op::LinearCrossEntropy { ignore_index, chunk } => linear_ce(b, at, *ignore_index, *chunk, Pass::Forward)?,
        Op::LinearCrossEntropyBackward { ignore_index, chunk } => {
            linear_ce(b, at, *ignore_index, *chunk, Pass::Backward)?
        }
        Op::LinearCrossEntropyGrad { ignore_index, chunk } => linear_ce(b, at, *ignore_index, *chunk, Pass::Both)?,
        Op::RmsNorm { eps } => {
            let d = at[0].shape.last();
            rms_norm(b, dt, at[0].numel() / d.max(1), d, *eps, Arg::Out(0))?;
        }
        Op::RmsNormBackward { eps, acc: add } => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            if d == 0 {
                return Ok(());
            }
            let acc = if dt == DType::F64 { 8 } else { 4 };
            // One pass (rows.cu's rms_norm_bwd): a block per row group, a thread per 16-byte
            // chunk of the width (RMS_BWD_WIDE chunks a thread past 1024 of them).
            let chunks = d.div_ceil(16 / dt.size_in_bytes());
            let (wide, per_thread) = if chunks <= 1024 { ("", 1) } else { ("_wide", RMS_BWD_WIDE) };
            if chunks > 1024 * per_thread {
                return Err(CudaError::Unsupported(format!(
                    "rms_norm_backward on CUDA: rows of {d} {dt:?} elements (at most {} in one block)",
                    1024 * per_thread * (16 / dt.size_in_bytes())
                )));
            }
            let threads = chunks.div_ceil(per_thread).next_multiple_of(32);
            // Row groups: a resident wave of blocks (about 1024 threads a multiprocessor), each
            // of at least 8 rows, so that the dw partials stay a few percent of the bytes; at
            // most 1024, so that a thread of the sum (32 warps a block of columns) reads at
            // most 32 of them, its loads a few rounds of eight in flight.
            let wave = dev.multiprocessors.max(1) * (1024 / threads).max(1);
            let groups = rows.div_ceil(8).min(wave).clamp(1, 1024);
            let part = b.scratch(groups * d * acc);
            let s = sfx(dt);
            let (r, dd) = (Arg::I64(rows as i64), Arg::I64(d as i64));
            // With an addend (`fold_norm_addends`), dx = the gradient + operand 3.
            let (name, ins) = if *add { ("_acc", &[0, 1, 2, 3][..]) } else { ("", &[0, 1, 2][..]) };
            b.k(
                KernelFile::Rows,
                format!("rms_norm_backward{wide}{name}_{s}"),
                (groups as u32, 1, 1),
                threads as u32,
                0,
                [Arg::ins(ins), vec![Arg::Out(0), Arg::Scratch(part), r, dd.clone(), Arg::F64(*eps)]].concat(),
            )?;
            b.k(
                KernelFile::Rows,
                format!("rms_norm_backward_dw_sum_{s}"),
                (d.div_ceil(32) as u32, 1, 1),
                1024,
                0,
                vec![Arg::Scratch(part), Arg::Out(1), Arg::I64(groups as i64), dd],
            )?;
        }
        Op::Rope { theta, inverse, layout, scaling } => {
            let [_, h, t, d] = layout.bhtd(at[0].dims());
            // Rows of D between consecutive positions: 1 in [B, H, T, D], H in [B, T, H, D].
            let per_pos = match layout {
                HeadLayout::Bhtd => 1,
                HeadLayout::Bthd => h,
            };
            let rows = at[0].numel() / d.max(1);
            let half = d / 2;
            if rows * half > 0 {
                // (cos, sign * sin) per position and frequency, in the accumulation type.
                let acc = if dt == DType::F64 { 8 } else { 4 };
                let tab = b.scratch(t * half * 2 * acc);
                let sign = if *inverse { -1.0 } else { 1.0 };
                let freqs = rope_freqs("rope", &scaling.inv_freq(*theta, d))?;
                let args =
                    vec![Arg::Scratch(tab), Arg::I64(t as i64), Arg::I64(d as i64), Arg::Blob(freqs), Arg::F64(sign)];
                b.k(KernelFile::Rows, format!("rope_table_{}", sfx(dt)), grid_for(dev, t * half, 256), 256, 0, args)?;
                let args =
                    [vec![Arg::In(0), Arg::Out(0), Arg::Scratch(tab)], Arg::i64s(&[rows, t, d, per_pos])].concat();
                b.k(KernelFile::Rows, format!("rope_{}", sfx(dt)), grid_for(dev, rows * half, 256), 256, 0, args)?;
            }
        }
        Op::SwigluPacked | Op::SwigluPackedBackward => {
            let f = at[0].shape.last() / 2;
            let rows = at[0].numel() / (2 * f).max(1);
            if matches!(op, Op::SwigluPacked) {
                swiglu_packed(b, dt, rows, f, Arg::Out(0))?;
            } else if rows * f > 0 {
                let args = [Arg::ins(&[0, 1]), vec![Arg::Out(0)], Arg::i64s(&[rows, f])].concat();
                let name = format!("swiglu_packed_backward_{}", sfx(dt));
                b.k(KernelFile::Rows, name, grid_for(dev, rows * f, 256), 256, 0, args)?;
            }
        }
        Op::Softmax | Op::LogSoftmax => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            let log = matches!(op, Op::LogSoftmax) as i32;
            let args = vec![Arg::In(0), Arg::Out(0), Arg::I64(rows as i64), Arg::I64(d as i64), Arg::I32(log)];
            b.k(KernelFile::Rows, format!("softmax_{}", sfx(dt)), rows_grid(dev, rows), 256, 0, args)?;
        }
        Op::SoftmaxBackward | Op::LogSoftmaxBackward => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            let log = matches!(op, Op::LogSoftmaxBackward) as i32;
            let args =
                vec![Arg::In(0), Arg::In(1), Arg::Out(0), Arg::I64(rows as i64), Arg::I64(d as i64), Arg::I32(log)];
            b.k(KernelFile::Rows, format!("softmax_backward_{}", sfx(dt)), rows_grid(dev, rows), 256, 0, args)?;
        }
        Op::CrossEntropy { ignore_index } => {
            let (rows, v) = (at[0].dims()[0], at[0].dims()[1]);
            let loss = b.scratch(rows * 8);
            let valid = b.scratch(rows * 4);
            let name = format!("cross_entropy_rows_{}_{}", sfx(dt), sfx(at[1].dtype));
            let outs = vec![Arg::Scratch(loss), Arg::Scratch(valid)];
            let checked = vec![Arg::I64(*ignore_index), Arg::Status, Arg::Tag];
            let args = [Arg::ins(&[0, 1]), outs, Arg::i64s(&[rows, v]), checked].concat();
            b.k(KernelFile::Rows, name, rows_grid(dev, rows), 256, 0, args)?;
            let args = vec![Arg::Scratch(loss), Arg::Scratch(valid), Arg::Out(0), Arg::I64(rows as i64)];
            let stat = if dt == DType::F64 { "f64" } else { "f32" };
            b.k(KernelFile::Rows, format!("cross_entropy_mean_{stat}"), (1, 1, 1), 256, 0, args)?;
        }
        Op::CrossEntropyBackward { ignore_index } => {
            let (rows, v) = (at[0].dims()[0], at[0].dims()[1]);
            let count = b.scratch(4);
            let args = vec![Arg::In(1), Arg::Scratch(count), Arg::I64(rows as i64), Arg::I64(*ignore_index)];
            b.k(KernelFile::Rows, format!("cross_entropy_count_{}", sfx(at[1].dtype)), (1, 1, 1), 256, 0, args)?;
            let name = format!("cross_entropy_backward_{}_{}", sfx(dt), sfx(at[1].dtype));
            let checked = vec![Arg::I64(*ignore_index), Arg::Status, Arg::Tag];
            let args =
                [Arg::ins(&[0, 1, 2]), vec![Arg::Scratch(count), Arg::Out(0)], Arg::i64s(&[rows, v]), checked].concat();
            b.k(KernelFile::Rows, name, rows_grid(dev, rows), 256, 0, args)?;
        }
        _ => return Err(CudaError::usage(format!("{} is not a row-wise op", op.name()))),
    }
    Ok(())
}

/// `linear_cross_entropy` (and its backward) a chunk of rows at a time: each chunk's logits
/// `x_c @ w^T` (f32, f64 for f64) go to the node's scratch through cuBLASLt. The forward
/// computes each row's log-sum-exp in pieces over several blocks (`ce_split_*` in rows.cu), so
/// a chunk of ~100 rows of a 150k vocabulary still fills the GPU, and writes it to its second
/// output. The backward recomputes the chunk's logits, writes their gradient in the operand
/// dtype from them and that log-sum-exp (no statistics pass) and multiplies it back
/// (`dx_c = dl @ w`, `dw += dl^T @ x_c`). Workspace: the matmuls', and the forward's pieces'
/// statistics.
/// Which of the fused loss's passes a node runs over each chunk of logits.
#[derive(Clone, Copy, PartialEq)]
enum Pass {
    /// `linear_cross_entropy`: the loss and each row's log-sum-exp.
    Forward,
    /// `linear_cross_entropy_backward`: the gradients, from the forward's log-sum-exp.
    Backward,
    /// `linear_cross_entropy_grad`: both, each chunk's logits computed once.
    Both,
}

fn linear_ce(b: &mut Builder, at: &[&TensorType], ignore: i64, chunk: usize, pass: Pass) -> Result<()> {
    let (forward, backward) = (pass != Pass::Backward, pass != Pass::Forward);
    let (x, w, tg) = (at[0], at[1], at[2]);
    let (n, c, v) = (x.dims()[0], x.dims()[1], w.dims()[0]);
    let t = x.dtype;
    let s = rumble_core::ir::stat_dtype(t);
    let (tsz, ssz, isz) = (t.size_in_bytes(), s.size_in_bytes(), tg.dtype.size_in_bytes());
    let chunk = chunk.clamp(1, n.max(1));
    let starts: Vec<usize> = (0..n).step_by(chunk).collect();
    // Every matmul shape first: the workspace is the most any of them needs.
    let key = |dtype: DType, out: DType, ta: bool, tb: bool, m: usize, nn: usize, k: usize| crate::matmul::MatmulKey {
        dtype,
        out,
        ta,
        tb,
        batch: 1,
        m: m as u64,
        n: nn as u64,
        k: k as u64,
        row_addend: false,
    };
    let mut ws = 0;
    for &r0 in &starts {
        let rows = chunk.min(n - r0);
        ws = ws.max(b.dev.matmul_workspace(&key(t, s, false, true, rows, v, c))?);
        if backward {
            ws = ws.max(b.dev.matmul_workspace(&key(t, t, false, false, rows, c, v))?);
            ws = ws.max(b.dev.matmul_workspace(&key(t, t, true, false, v, c, rows))?);
        }
    }
    b.scratch(ws);
    // Each row's log-sum-exp in `splits` pieces of `span` columns (ce_split_* in rows.cu):
    // enough blocks to fill the GPU even when a chunk has fewer rows than there are SMs. The
    // backward's gradient kernel works on the same pieces.
    let sms = b.dev.multiprocessors.max(1);
    // Pieces a multiple of 4 wide where the rows are (the kernels then read float4).
    let splits = (sms * 8).div_ceil(chunk).clamp(1, v.div_ceil(4096).max(1));
    let mut span = v.div_ceil(splits).max(1);
    if v % 4 == 0 {
        span = span.next_multiple_of(4);
    }
    let splits = v.div_ceil(span).max(1);
    let piece_grid = |rows: usize| ((rows * splits).clamp(1, sms * 64) as u32, 1, 1);
    // The chunk buffers live in the node's own scratch range (Op::scratch_bytes lays it out
    // the same way), so the planner overlaps them with buffers dead at this node.
    let logits = b.node(chunk * v * ssz);
    let s_name = sfx(s);
    let i_name = sfx(tg.dtype);
    // What ends the arguments of the per-row kernels: the ignored target, the status word, the tag.
    let checked = vec![Arg::I64(ignore), Arg::Status, Arg::Tag];
    // Rows [r0, r0 + rows): their logits.
    let chunk_logits = |b: &mut Builder, r0: usize, rows: usize| {
        let k = key(t, s, false, true, rows, v, c);
        b.matmul(k, Arg::InAt(0, r0 * c * tsz), Arg::In(1), Arg::Node(logits), ws, 0.0);
    };
    // Node scratch in Op::scratch_bytes's order: the logits; the backward's logit gradient
    // (written straight in the operand dtype, which the matmuls after it read) and count of
    // targets; the forward's per-row losses and flags; both passes' log-sum-exp.
    let (mut dl, mut count) = (0, 0);
    if backward {
        dl = b.node(chunk * v * tsz);
        count = b.node(4);
        let args = vec![Arg::In(2), Arg::Node(count), Arg::I64(n as i64), Arg::I64(ignore)];
        b.k(KernelFile::Rows, format!("cross_entropy_count_{i_name}"), (1, 1, 1), 256, 0, args)?;
    }
    let (mut stats, mut loss, mut valid) = (0, 0, 0);
    if forward {
        stats = b.scratch(chunk * splits * 2 * ssz);
        loss = b.node(n * 8);
        valid = b.node(n * 4);
    }
    // Operand and result indices: (x, w, targets, lse, dloss) -> (dx, dw) for the backward;
    // (x, w, targets, dloss) -> (loss, dx, dw) for both.
    let lse_node = if pass == Pass::Both { b.node(n * ssz) } else { 0 };
    let lse_at = |r0: usize| match pass {
        Pass::Forward => Arg::OutAt(1, r0 * ssz),
        Pass::Backward => Arg::InAt(3, r0 * ssz),
        Pass::Both => Arg::Node(lse_node + r0 * ssz),
    };
    let (dloss, dx, dw) = if pass == Pass::Both { (3, 1, 2) } else { (4, 0, 1) };
    if backward && n == 0 {
        b.steps.push(Step::ZeroOut { out: dw, bytes: v * c * tsz });
    }
    for &r0 in &starts {
        let rows = chunk.min(n - r0);
        chunk_logits(b, r0, rows);
        if forward {
            let args = [vec![Arg::Node(logits), Arg::Scratch(stats)], Arg::i64s(&[rows, v, splits, span])].concat();
            b.k(KernelFile::Rows, format!("ce_split_stats_{s_name}"), piece_grid(rows), 256, 0, args)?;
            let ins = vec![Arg::Node(logits), Arg::InAt(2, r0 * isz), Arg::Scratch(stats)];
            let outs = vec![Arg::Node(loss + r0 * 8), Arg::Node(valid + r0 * 4), lse_at(r0)];
            let args = [ins, outs, Arg::i64s(&[rows, v, splits]), checked.clone()].concat();
            let grid = (rows.div_ceil(128) as u32, 1, 1);
            b.k(KernelFile::Rows, format!("ce_split_rows_{s_name}_{i_name}"), grid, 128, 0, args)?;
        }
        if backward {
            // The logits, the targets and the log-sum-exp of rows r0..
            let ins = vec![Arg::Node(logits), Arg::InAt(2, r0 * isz), lse_at(r0)];
            let mid = vec![Arg::In(dloss), Arg::Node(count), Arg::Node(dl)];
            let args = [ins, mid, Arg::i64s(&[rows, v, splits, span]), checked.clone()].concat();
            let name = format!("ce_split_backward_{s_name}_{}_{i_name}", sfx(t));
            b.k(KernelFile::Rows, name, piece_grid(rows), 256, 0, args)?;
            let kx = key(t, t, false, false, rows, c, v);
            b.matmul(kx, Arg::Node(dl), Arg::In(1), Arg::OutAt(dx, r0 * c * tsz), ws, 0.0);
            let kw = key(t, t, true, false, v, c, rows);
            let beta = if r0 == 0 { 0.0 } else { 1.0 };
            b.matmul(kw, Arg::Node(dl), Arg::InAt(0, r0 * c * tsz), Arg::Out(dw), ws, beta);
        }
    }
    if forward {
        let args = vec![Arg::Node(loss), Arg::Node(valid), Arg::Out(0), Arg::I64(n as i64)];
        b.k(KernelFile::Rows, format!("cross_entropy_mean_{s_name}"), (1, 1, 1), 256, 0, args)?;
    }
    Ok(())
}

/// Inverse frequencies the RoPE kernels take by value (`RopeFreqs` in the prelude: head sizes
/// up to 512).
const ROPE_MAX_HALF: usize = 256;

/// The `RopeFreqs` struct of the kernel prelude as 8-byte words: f32 `inv` entries, two a word
/// (little endian), zero past the table. Both `rope` (rows.cu) and `rope_at` (decode.cu) take
/// it; `op` names the op in the error for a head size past the table.
pub(crate) fn rope_freqs(op: &str, inv: &[f32]) -> Result<Vec<u64>> {
    if inv.len() > ROPE_MAX_HALF {
        return Err(CudaError::Unsupported(format!(
            "{op} on head size {} (at most {})",
            2 * inv.len(),
            2 * ROPE_MAX_HALF
        )));
    }
    let mut w = vec![0u64; ROPE_MAX_HALF / 2];
    for (i, f) in inv.iter().enumerate() {
        w[i / 2] |= (f.to_bits() as u64) << (32 * (i % 2));
    }
    Ok(w)
}
