//! Reductions along axes (sum, max, mean). Sums accumulate in f64.

use super::convert::{Real, read_float, read_int, write_float, write_int};
use crate::ir::{ReduceOp, TensorType};

/// For each input element, the flat index of the output element it reduces into.
fn out_index(ty: &TensorType, axes: &[usize]) -> (Vec<usize>, usize) {
    let dims = ty.dims();
    let kept: Vec<usize> = (0..dims.len()).filter(|a| !axes.contains(a)).collect();
    let out_n: usize = kept.iter().map(|&a| dims[a]).product();
    let in_strides = ty.shape.strides();
    let mut map = Vec::with_capacity(ty.numel());
    for i in 0..ty.numel() {
        let mut o = 0;
        for &a in &kept {
            o = o * dims[a] + (i / in_strides[a]) % dims[a];
        }
        map.push(o);
    }
    (map, out_n)
}

pub fn reduce<A: Real>(op: ReduceOp, axes: &[usize], ty: &TensorType, x: &[u8], out_ty: &TensorType) -> Vec<u8> {
    let (map, n) = out_index(ty, axes);
    let count = (ty.numel() / n.max(1)) as f64;
    if !ty.dtype.is_float() {
        let x = read_int(ty.dtype, x);
        let mut acc = vec![i64::MIN; n];
        for (&o, &v) in map.iter().zip(&x) {
            acc[o] = acc[o].max(v);
        }
        return write_int(out_ty.dtype, &acc);
    }
    let x = read_float::<A>(ty.dtype, x);
    let r: Vec<A> = match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            let mut acc = vec![0f64; n];
            for (&o, v) in map.iter().zip(&x) {
                acc[o] += v.f64();
            }
            let div = if op == ReduceOp::Mean { count } else { 1.0 };
            acc.into_iter().map(|s| A::of(s / div)).collect()
        }
        ReduceOp::SumSquares => {
            // Each square rounded to the compute dtype, as `square` then `sum` would.
            let mut acc = vec![0f64; n];
            for (&o, &v) in map.iter().zip(&x) {
                acc[o] += (v * v).f64();
            }
            acc.into_iter().map(A::of).collect()
        }
        ReduceOp::Max => {
            let mut acc = vec![A::neg_infinity(); n];
            for (&o, &v) in map.iter().zip(&x) {
                // NaN wins, as in PyTorch's amax.
                if !acc[o].is_nan() && (v.is_nan() || v > acc[o]) {
                    acc[o] = v;
                }
            }
            acc
        }
    };
    write_float(out_ty.dtype, &r)
}
