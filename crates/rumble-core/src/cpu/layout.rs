//! Data-movement kernels on raw bytes (dtype-agnostic): permute, broadcast, slice, concat,
//! and the embedding gather with its adjoint scatter-add.

use super::convert::{Real, read_float, read_int, write_float};
use crate::ir::{Shape, TensorType};
use crate::{Error, Result};

/// Row-major multi-index of flat index `i` in `dims`, written into `idx`.
fn unravel(mut i: usize, dims: &[usize], idx: &mut [usize]) {
    for a in (0..dims.len()).rev() {
        idx[a] = i % dims[a];
        i /= dims[a];
    }
}

pub fn permute(ty: &TensorType, x: &[u8], perm: &[usize]) -> Vec<u8> {
    let es = ty.dtype.size_in_bytes();
    let in_strides = ty.shape.strides();
    let out_dims: Vec<usize> = perm.iter().map(|&p| ty.dims()[p]).collect();
    let mut out = Vec::with_capacity(x.len());
    let mut idx = vec![0; out_dims.len()];
    for i in 0..ty.numel() {
        unravel(i, &out_dims, &mut idx);
        let src: usize = idx.iter().zip(perm).map(|(&j, &p)| j * in_strides[p]).sum();
        out.extend_from_slice(&x[src * es..(src + 1) * es]);
    }
    out
}

pub fn broadcast(ty: &TensorType, x: &[u8], out_dims: &[usize]) -> Vec<u8> {
    let es = ty.dtype.size_in_bytes();
    let off = out_dims.len() - ty.rank();
    let in_strides = ty.shape.strides();
    // Stride 0 along broadcast axes.
    let strides: Vec<usize> =
        (0..out_dims.len()).map(|a| if a < off || ty.dims()[a - off] == 1 { 0 } else { in_strides[a - off] }).collect();
    let n: usize = out_dims.iter().product();
    let mut out = Vec::with_capacity(n * es);
    let mut idx = vec![0; out_dims.len()];
    for i in 0..n {
        unravel(i, out_dims, &mut idx);
        let src: usize = idx.iter().zip(&strides).map(|(j, s)| j * s).sum();
        out.extend_from_slice(&x[src * es..(src + 1) * es]);
    }
    out
}

/// Sizes of (outer, axis, inner-bytes) blocks around `axis`.
fn blocks(dims: &[usize], axis: usize, es: usize) -> (usize, usize, usize) {
    (dims[..axis].iter().product(), dims[axis], dims[axis + 1..].iter().product::<usize>() * es)
}

pub fn slice(ty: &TensorType, x: &[u8], axis: usize, start: usize, end: usize) -> Vec<u8> {
    let (outer, d, inner) = blocks(ty.dims(), axis, ty.dtype.size_in_bytes());
    let mut out = Vec::with_capacity(outer * (end - start) * inner);
    for o in 0..outer {
        let base = o * d * inner;
        out.extend_from_slice(&x[base + start * inner..base + end * inner]);
    }
    out
}

pub fn concat(tys: &[&TensorType], xs: &[&[u8]], axis: usize) -> Vec<u8> {
    let es = tys[0].dtype.size_in_bytes();
    let (outer, _, inner) = blocks(tys[0].dims(), axis, es);
    let mut out = Vec::with_capacity(xs.iter().map(|x| x.len()).sum());
    for o in 0..outer {
        for (t, x) in tys.iter().zip(xs) {
            let chunk = t.dims()[axis] * inner;
            out.extend_from_slice(&x[o * chunk..(o + 1) * chunk]);
        }
    }
    out
}

fn check_id(op: &str, id: i64, pos: usize, rows: usize) -> Result<usize> {
    if id < 0 || id as usize >= rows {
        return Err(Error::runtime(op, format!("id {id} at position {pos} is outside 0..{rows}")));
    }
    Ok(id as usize)
}

pub fn gather(table_ty: &TensorType, table: &[u8], ids_ty: &TensorType, ids: &[u8]) -> Result<Vec<u8>> {
    let (rows, row_bytes) = (table_ty.dims()[0], table_ty.dims()[1] * table_ty.dtype.size_in_bytes());
    let ids = read_int(ids_ty.dtype, ids);
    let mut out = Vec::with_capacity(ids.len() * row_bytes);
    for (pos, &id) in ids.iter().enumerate() {
        let r = check_id("gather", id, pos, rows)?;
        out.extend_from_slice(&table[r * row_bytes..(r + 1) * row_bytes]);
    }
    Ok(out)
}

/// Sums rows of `src` into `rows` rows, in position order (deterministic).
pub fn scatter_add<A: Real>(
    ids_ty: &TensorType,
    ids: &[u8],
    src_ty: &TensorType,
    src: &[u8],
    rows: usize,
) -> Result<Vec<u8>> {
    let d = src_ty.shape.last();
    let ids = read_int(ids_ty.dtype, ids);
    let src = read_float::<A>(src_ty.dtype, src);
    let mut acc = vec![0f64; rows * d];
    for (pos, &id) in ids.iter().enumerate() {
        let r = check_id("scatter_add", id, pos, rows)?;
        for j in 0..d {
            acc[r * d + j] += src[pos * d + j].f64();
        }
    }
    let acc: Vec<A> = acc.into_iter().map(A::of).collect();
    Ok(write_float(src_ty.dtype, &acc))
}

/// The shape of a `[.., M, N]` matrix stack, for other kernels.
pub fn matrix_dims(s: &Shape) -> (usize, usize, usize) {
    let r = s.rank();
    (s.dims()[..r - 2].iter().product(), s.dims()[r - 2], s.dims()[r - 1])
}
