//! The recipe of `Op::Reduce` on `kernels/reduce.cu`: one block per output, or, for few outputs
//! over many elements, each range split into fixed pieces over the whole GPU and summed in a
//! second pass (deterministic); over leading axes (a bias gradient's sum over the tokens),
//! threads own columns and read rows, in fixed pieces summed in a second pass.

use rumble_core::ir::{ReduceOp, TensorType};

use super::layout::{contiguous, strides_blob};
use super::{Builder, sfx};
use crate::error::Result;
use crate::kernels::KernelFile;
use crate::launch::Arg;

pub(super) fn reduce(b: &mut Builder, r: ReduceOp, axes: &[usize], x: &TensorType, n_out: usize) -> Result<()> {
    let xs = contiguous(x.dims());
    let (mut kd, mut ks, mut rd, mut rs) = (vec![], vec![], vec![], vec![]);
    for (i, &d) in x.dims().iter().enumerate() {
        if axes.contains(&i) {
            rd.push(d);
            rs.push(xs[i]);
        } else {
            kd.push(d);
            ks.push(xs[i]);
        }
    }
    let n_red: usize = rd.iter().product();
    let kept = strides_blob(&kd, &ks, &ks)?;
    let red = strides_blob(&rd, &rs, &rs)?;
    let block = (n_red.next_power_of_two() as u32).clamp(32, 256);
    let sms = b.dev.multiprocessors.max(1);
    let grid = (n_out.clamp(1, sms * 64) as u32, 1, 1);
    if n_out == 0 {
        return Ok(());
    }
    let mode = match r {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::SumSquares => 3,
    };
    // The reduced axes are the trailing ones: element r of an output's range is at base + r.
    let contig = axes.iter().all(|&a| a >= x.rank() - axes.len());
    // The reduced axes are the leading ones (a [R, C] summed over R, C = n_out > 1): each
    // lane folds 16 bytes of adjacent columns over its warp's rows of a fixed piece (8 warps a
    // block, 16-byte loads of rows), then reduce_cols_fin folds each column's pieces in order.
    let leading = axes.iter().all(|&a| a < axes.len());
    if x.dtype.is_float() && leading && n_out > 1 && n_red > 1 {
        let cols_per_block = 32 * (16 / x.dtype.size_in_bytes());
        let blocks_x = n_out.div_ceil(cols_per_block);
        // About 4 blocks per SM over all, each warp at least 8 rows of its piece, at most 512
        // pieces (the second pass's warps fold an eighth of them each, in order).
        let parts = (sms * 4).div_ceil(blocks_x).clamp(1, 512).min(n_red.div_ceil(64)).max(1);
        let chunk = n_red.div_ceil(parts);
        let parts = n_red.div_ceil(chunk);
        let acc = rumble_core::ir::stat_dtype(x.dtype).size_in_bytes(); // Acc<T> of the kernels
        let part = b.scratch(n_out * parts * acc);
        let sfx = sfx(x.dtype);
        let args =
            [vec![Arg::In(0), Arg::Scratch(part)], Arg::i64s(&[n_red, n_out, parts, chunk]), vec![Arg::I32(mode)]]
                .concat();
        let grid = (blocks_x as u32, parts as u32, 1);
        b.k(KernelFile::Reduce, format!("reduce_cols_part_{sfx}"), grid, 256, 0, args)?;
        let args =
            [vec![Arg::Scratch(part), Arg::Out(0)], Arg::i64s(&[n_out, n_red, parts]), vec![Arg::I32(mode)]].concat();
        let grid = (n_out.div_ceil(32).min(sms * 8) as u32, 1, 1);
        return b.k(KernelFile::Reduce, format!("reduce_cols_fin_{sfx}"), grid, 256, 0, args);
    }
    // Few outputs, each over many elements: split each range into fixed pieces so that the
    // whole GPU works on it (one block per output would leave all but a few SMs idle).
    let pieces = (sms * 8).div_ceil(n_out);
    if x.dtype.is_float() && n_red >= 1 << 16 && pieces > 1 {
        let chunk = n_red.div_ceil(pieces).max(1 << 14);
        let parts = n_red.div_ceil(chunk);
        let acc = rumble_core::ir::stat_dtype(x.dtype).size_in_bytes(); // Acc<T> of the kernels
        let part = b.scratch(n_out * parts * acc);
        let sfx = sfx(x.dtype);
        // Each piece's partial result, then each output from its pieces.
        let ins = vec![Arg::In(0), Arg::Scratch(part), Arg::Blob(kept), Arg::Blob(red)];
        let modes = vec![Arg::I32(mode), Arg::I32(contig as i32)];
        let args = [ins, Arg::i64s(&[n_out, n_red, parts, chunk]), modes].concat();
        let grid = ((n_out * parts).min(sms * 64) as u32, 1, 1);
        b.k(KernelFile::Reduce, format!("reduce_part_{sfx}"), grid, 256, 0, args)?;
        let args =
            [vec![Arg::Scratch(part), Arg::Out(0)], Arg::i64s(&[n_out, n_red, parts]), vec![Arg::I32(mode)]].concat();
        let grid = (n_out.div_ceil(256).min(sms * 8) as u32, 1, 1);
        return b.k(KernelFile::Reduce, format!("reduce_fin_{sfx}"), grid, 256, 0, args);
    }
    let mut args =
        [vec![Arg::In(0), Arg::Out(0), Arg::Blob(kept), Arg::Blob(red)], Arg::i64s(&[n_out, n_red])].concat();
    let name = if x.dtype.is_float() {
        args.push(Arg::I32(mode));
        args.push(Arg::I32(contig as i32));
        format!("reduce_{}", sfx(x.dtype))
    } else {
        format!("reduce_max_{}", sfx(x.dtype))
    };
    b.k(KernelFile::Reduce, name, grid, block, 0, args)
}
