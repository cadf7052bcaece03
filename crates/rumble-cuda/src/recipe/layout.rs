//! Recipes of the data-movement ops on `kernels/layout.cu`: strided copies (permute, slice,
//! concat, broadcast) with jointly contiguous axes merged and 32-bit indexing where offsets fit,
//! gather, and scatter_add (each position linked to the next with the same id, each chain walked
//! in position order: deterministic, no atomics).

use rumble_core::ir::{DType, Op, TensorType};

use super::{Builder, grid_for, rows_grid, sfx};
use crate::error::{CudaError, Result};
use crate::kernels::KernelFile;
use crate::launch::{Arg, Step};

const MAX_RANK: usize = 8;

/// Strides struct (see prelude.cuh) as 8-byte words.
pub(super) fn strides_blob(dims: &[usize], inp: &[i64], out: &[i64]) -> Result<Vec<u64>> {
    if dims.len() > MAX_RANK {
        return Err(CudaError::Unsupported(format!("layout ops of rank {} (at most {MAX_RANK})", dims.len())));
    }
    let mut w = vec![0u64; 3 * MAX_RANK + 1];
    for (i, &d) in dims.iter().enumerate() {
        w[i] = d as u64;
        w[MAX_RANK + i] = inp[i] as u64;
        w[2 * MAX_RANK + i] = out[i] as u64;
    }
    w[3 * MAX_RANK] = dims.len() as u64;
    Ok(w)
}

pub(super) fn contiguous(dims: &[usize]) -> Vec<i64> {
    rumble_core::Shape::new(dims.to_vec()).strides().into_iter().map(|s| s as i64).collect()
}

/// The steps of a layout op (reshape, permute, broadcast, slice, concat, gather, scatter_add).
pub(super) fn prepare(b: &mut Builder, op: &Op, at: &[&TensorType], ot: &[&TensorType]) -> Result<()> {
    let dev = b.dev;
    match op {
        Op::Reshape { .. } => b.steps.push(Step::Copy { src: 0, dst: 0, bytes: at[0].size_in_bytes() }),
        Op::Permute { perm } => {
            let ins = contiguous(at[0].dims());
            let inp: Vec<i64> = perm.iter().map(|&p| ins[p]).collect();
            copy(b, at[0].dtype, ot[0].dims(), &inp, &contiguous(ot[0].dims()), (0, 0), 0, 0)?;
        }
        Op::Broadcast { shape } => {
            let (x, od) = (at[0].dims(), shape.dims());
            let xs = contiguous(x);
            let off = od.len() - x.len();
            let inp: Vec<i64> =
                (0..od.len()).map(|i| if i < off || x[i - off] == 1 { 0 } else { xs[i - off] }).collect();
            copy(b, at[0].dtype, od, &inp, &contiguous(od), (0, 0), 0, 0)?;
        }
        Op::Slice { axis, start, .. } => {
            let xs = contiguous(at[0].dims());
            let off = *start as i64 * xs[*axis];
            copy(b, at[0].dtype, ot[0].dims(), &xs, &contiguous(ot[0].dims()), (0, 0), off, 0)?;
        }
        Op::Concat { axis } => {
            let os = contiguous(ot[0].dims());
            let mut at_axis = 0i64;
            for (i, t) in at.iter().enumerate() {
                copy(b, t.dtype, t.dims(), &contiguous(t.dims()), &os, (i, 0), 0, at_axis * os[*axis])?;
                at_axis += t.dims()[*axis] as i64;
            }
        }
        Op::Gather => {
            let (rows, d) = (at[0].dims()[0], at[0].dims()[1]);
            let n = at[1].numel();
            let name = format!("gather_{}_{}", at[0].dtype.size_in_bytes(), sfx(at[1].dtype));
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::Out(0),
                Arg::I64(n as i64),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
                Arg::Status,
                Arg::Tag,
            ];
            b.k(KernelFile::Layout, name, grid_for(dev, n * d, 256), 256, 0, args)?;
        }
        Op::ScatterAdd { rows } => {
            let n = at[0].numel();
            let d = at[1].shape.last();
            if n > i32::MAX as usize {
                return Err(CudaError::Unsupported(format!(
                    "scatter_add over {n} positions (the CUDA kernel links positions with 32-bit ints)"
                )));
            }
            b.steps.push(Step::ZeroOut { out: 0, bytes: ot[0].size_in_bytes() });
            if n > 0 {
                let links = b.scratch(n * 8);
                let args = vec![
                    Arg::In(0),
                    Arg::Scratch(links),
                    Arg::I64(n as i64),
                    Arg::I64(*rows as i64),
                    Arg::Status,
                    Arg::Tag,
                ];
                // One warp per position.
                b.k(
                    KernelFile::Layout,
                    format!("scatter_links_{}", sfx(at[0].dtype)),
                    grid_for(dev, n * 32, 256),
                    256,
                    0,
                    args,
                )?;
                let name = format!("scatter_sum_{}_{}", sfx(at[1].dtype), sfx(at[0].dtype));
                let args = vec![
                    Arg::In(0),
                    Arg::Scratch(links),
                    Arg::In(1),
                    Arg::Out(0),
                    Arg::I64(n as i64),
                    Arg::I64(d as i64),
                ];
                b.k(KernelFile::Layout, name, rows_grid(dev, n), 256, 0, args)?;
            }
        }
        _ => return Err(CudaError::usage(format!("{} is not a layout op", op.name()))),
    }
    Ok(())
}

/// A strided copy's index space made simpler without changing which element goes where: axes
/// of extent 1 dropped, and neighbouring axes merged where both the input and the output step
/// over them as one (`in[k] == in[k+1] * dims[k+1]`, the same for `out`).
fn simplify_copy(dims: &[usize], inp: &[i64], out: &[i64]) -> (Vec<usize>, Vec<i64>, Vec<i64>) {
    let (mut d, mut i, mut o): (Vec<usize>, Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..dims.len() {
        if dims[k] == 1 {
            continue;
        }
        if let (Some(&li), Some(&lo)) = (i.last(), o.last())
            && li == inp[k] * dims[k] as i64
            && lo == out[k] * dims[k] as i64
        {
            *d.last_mut().unwrap() *= dims[k];
            *i.last_mut().unwrap() = inp[k];
            *o.last_mut().unwrap() = out[k];
            continue;
        }
        d.push(dims[k]);
        i.push(inp[k]);
        o.push(out[k]);
    }
    (d, i, o)
}

/// True when every element index and offset of the copy fits in 31 bits (the `copy32_*`
/// kernels' unsigned arithmetic; strides and offsets are never negative here, but a negative
/// one keeps the 64-bit kernel).
fn copy_fits_i32(dims: &[usize], inp: &[i64], out: &[i64], in_off: i64, out_off: i64) -> bool {
    let n: usize = dims.iter().product();
    let last = |st: &[i64], off: i64| dims.iter().zip(st).map(|(&d, &s)| (d as i64 - 1) * s).sum::<i64>() + off;
    let non_negative = inp.iter().chain(out).chain([&in_off, &out_off]).all(|&s| s >= 0);
    non_negative && n < i32::MAX as usize && last(inp, in_off) < i32::MAX as i64 && last(out, out_off) < i32::MAX as i64
}

/// `rows` copies of the row operand `src` (`n` elements of `dt`) into output `dst`, `[rows, n]`:
/// a matmul's row addend where the matmul itself cannot add it (`recipe::matmul_steps`).
pub(super) fn broadcast_row(
    b: &mut Builder,
    dt: DType,
    (src, dst): (usize, usize),
    rows: usize,
    n: usize,
) -> Result<()> {
    copy(b, dt, &[rows, n], &[0, 1], &[n as i64, 1], (src, dst), 0, 0)
}

/// A strided copy of operand `src` into output `dst`.
#[allow(clippy::too_many_arguments)]
fn copy(
    b: &mut Builder,
    dt: DType,
    dims: &[usize],
    inp: &[i64],
    out: &[i64],
    (src, dst): (usize, usize),
    in_off: i64,
    out_off: i64,
) -> Result<()> {
    let n: usize = dims.iter().product();
    if n == 0 {
        return Ok(());
    }
    let (dims, inp, out) = simplify_copy(dims, inp, out);
    let blob = strides_blob(&dims, &inp, &out)?;
    let args =
        vec![Arg::In(src), Arg::Out(dst), Arg::Blob(blob), Arg::I64(n as i64), Arg::I64(in_off), Arg::I64(out_off)];
    let grid = grid_for(b.dev, n, 256);
    let kind = if copy_fits_i32(&dims, &inp, &out, in_off, out_off) { "copy32" } else { "copy" };
    b.k(KernelFile::Layout, format!("{kind}_{}", dt.size_in_bytes()), grid, 256, 0, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element's (input, output) offset pair of a strided copy, in index order.
    fn pairs(dims: &[usize], inp: &[i64], out: &[i64]) -> Vec<(i64, i64)> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|mut e| {
                let (mut a, mut b) = (0, 0);
                for k in (0..dims.len()).rev() {
                    let idx = (e % dims[k]) as i64;
                    e /= dims[k];
                    a += idx * inp[k];
                    b += idx * out[k];
                }
                (a, b)
            })
            .collect()
    }

    #[test]
    fn simplified_copies_move_the_same_elements() {
        // [1, T, H, D] -> [1, H, T, D] (attention's head split), a broadcast, a slice, a
        // transpose, and a copy that is contiguous throughout.
        type Case = (Vec<usize>, Vec<i64>, Vec<i64>, usize);
        let cases: Vec<Case> = vec![
            (vec![1, 7, 3, 5], vec![105, 5, 35, 1], vec![105, 15, 5, 1], 3),
            (vec![4, 1, 6, 5], vec![0, 0, 5, 1], vec![30, 30, 5, 1], 2),
            (vec![3, 4, 5], vec![40, 5, 1], vec![20, 5, 1], 2),
            (vec![6, 9], vec![1, 6], vec![9, 1], 2),
            (vec![2, 3, 4], vec![12, 4, 1], vec![12, 4, 1], 1),
        ];
        for (dims, inp, out, rank) in cases {
            let (d, i, o) = simplify_copy(&dims, &inp, &out);
            assert_eq!(d.len(), rank, "{dims:?}: {d:?}");
            assert_eq!(pairs(&d, &i, &o), pairs(&dims, &inp, &out), "{dims:?}");
        }
        assert!(copy_fits_i32(&[1 << 20, 1024], &[1024, 1], &[1024, 1], 0, 0));
        assert!(!copy_fits_i32(&[1 << 21, 1024], &[1024, 1], &[1024, 1], 0, 0));
        assert!(!copy_fits_i32(&[1 << 10, 1024], &[1 << 22, 1], &[1024, 1], 0, 0));
    }
}
