//! Elementwise kernels: unary math, binary arithmetic, comparisons, `where`, casts.

use super::convert::{Real, read_float, read_int, write_float, write_int};
use crate::ir::{BinaryOp, CmpOp, DType, TensorType, UnaryOp};
use crate::{Error, Result};

pub fn unary<A: Real>(u: UnaryOp, x: &[A]) -> Vec<A> {
    let one = A::one();
    let f = |x: A| match u {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => one / x.sqrt(),
        UnaryOp::Sigmoid => one / (one + (-x).exp()),
        UnaryOp::Silu => x / (one + (-x).exp()),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Recip => one / x,
        UnaryOp::Square => x * x,
    };
    x.iter().map(|&v| f(v)).collect()
}

pub fn binary<A: Real>(b: BinaryOp, ty: &TensorType, x: &[u8], y: &[u8]) -> Result<Vec<u8>> {
    if ty.dtype.is_float() {
        let (x, y) = (read_float::<A>(ty.dtype, x), read_float::<A>(ty.dtype, y));
        let r: Vec<A> = x
            .iter()
            .zip(&y)
            .map(|(&a, &b2)| match b {
                BinaryOp::Add => a + b2,
                BinaryOp::Sub => a - b2,
                BinaryOp::Mul => a * b2,
                BinaryOp::Div => a / b2,
                // NaN propagates, as in PyTorch's maximum/minimum.
                BinaryOp::Maximum => {
                    if a.is_nan() || b2.is_nan() {
                        A::nan()
                    } else {
                        a.max(b2)
                    }
                }
                BinaryOp::Minimum => {
                    if a.is_nan() || b2.is_nan() {
                        A::nan()
                    } else {
                        a.min(b2)
                    }
                }
            })
            .collect();
        return Ok(write_float(ty.dtype, &r));
    }
    let (x, y) = (read_int(ty.dtype, x), read_int(ty.dtype, y));
    let r = x
        .iter()
        .zip(&y)
        .map(|(&a, &c)| {
            Ok(match b {
                BinaryOp::Add => a.wrapping_add(c),
                BinaryOp::Sub => a.wrapping_sub(c),
                BinaryOp::Mul => a.wrapping_mul(c),
                BinaryOp::Div if c == 0 => return Err(Error::runtime("div", "integer division by zero")),
                BinaryOp::Div => a.wrapping_div(c),
                BinaryOp::Maximum => a.max(c),
                BinaryOp::Minimum => a.min(c),
            })
        })
        .collect::<Result<Vec<i64>>>()?;
    Ok(write_int(ty.dtype, &r))
}

pub fn compare(c: CmpOp, ty: &TensorType, x: &[u8], y: &[u8]) -> Vec<u8> {
    fn cmp<T: PartialOrd>(c: CmpOp, a: T, b: T) -> bool {
        match c {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }
    if ty.dtype.is_float() {
        let (x, y) = (read_float::<f64>(ty.dtype, x), read_float::<f64>(ty.dtype, y));
        x.iter().zip(&y).map(|(&a, &b)| cmp(c, a, b) as u8).collect()
    } else {
        let (x, y) = (read_int(ty.dtype, x), read_int(ty.dtype, y));
        x.iter().zip(&y).map(|(&a, &b)| cmp(c, a, b) as u8).collect()
    }
}

/// `cond ? a : b`, element by element, for elements of `es` bytes.
pub fn select(es: usize, cond: &[u8], a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(a.len());
    for (i, &c) in cond.iter().enumerate() {
        let src = if c != 0 { a } else { b };
        out.extend_from_slice(&src[i * es..(i + 1) * es]);
    }
    out
}

/// Converts between any two dtypes: float->int truncates toward zero (NaN gives 0), anything
/// -> bool is `!= 0`, float->float rounds to nearest even.
pub fn cast(from: &TensorType, x: &[u8], to: DType) -> Vec<u8> {
    if from.dtype == to {
        return x.to_vec();
    }
    match (from.dtype.is_float(), to.is_float()) {
        (_, true) => write_float::<f64>(to, &read_float::<f64>(from.dtype, x)),
        (true, false) if to == DType::Bool => {
            read_float::<f64>(from.dtype, x).iter().map(|&v| (v != 0.0) as u8).collect()
        }
        (true, false) => write_int(to, &read_float::<f64>(from.dtype, x).iter().map(|&v| v as i64).collect::<Vec<_>>()),
        (false, false) => write_int(to, &read_int(from.dtype, x)),
    }
}
