//! One VJP rule per op, in one place.
//!
//! A rule receives the node's operands and outputs as builder tensors, the cotangent of each
//! output (`None` is a symbolic zero) and which operands need a cotangent; it records the
//! backward ops and returns one cotangent per operand (`None` for zero or not needed).

use crate::ir::{Addend, BinaryOp, Op, ReduceOp, Tensor, UnaryOp};
use crate::{Error, Result};

fn zeros_like(x: &Tensor) -> Tensor {
    x.graph().full(0.0, x.dtype(), x.dims())
}

fn ones_like(x: &Tensor) -> Tensor {
    x.graph().full(1.0, x.dtype(), x.dims())
}

/// `ct` (shaped like a reduction's output) broadcast back to `x`'s shape.
fn unreduce(ct: &Tensor, x: &Tensor, axes: &[usize], keepdim: bool) -> Result<Tensor> {
    let kept: Vec<usize> = x.dims().iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let ct = if keepdim { ct.clone() } else { ct.reshape(&kept)? };
    ct.broadcast_to(x.dims())
}

/// The cotangents of `node`'s operands.
pub fn vjp(
    op: &Op,
    args: &[Tensor],
    outs: &[Tensor],
    cts: &[Option<Tensor>],
    need: &[bool],
) -> Result<Vec<Option<Tensor>>> {
    let none = || vec![None; args.len()];
    // Every op but attention and the fused loss has one output; their second, a log-sum-exp
    // kept for the backward, takes no gradient.
    if matches!(op, Op::Attention { .. } | Op::LinearCrossEntropy { .. }) && cts.get(1).is_some_and(|c| c.is_some()) {
        return Err(Error::Autodiff(format!(
            "{}: a gradient through the log-sum-exp output is not supported",
            op.name()
        )));
    }
    let Some(ct) = cts[0].clone() else {
        return Ok(none());
    };
    let y = &outs[0];
    let r: Vec<Option<Tensor>> = match op {
        Op::Full { .. } => none(),
        Op::Unary(u) => {
            let x = &args[0];
            let g = match u {
                UnaryOp::Neg => ct.neg()?,
                UnaryOp::Exp => ct.mul(y)?,
                UnaryOp::Log => ct.div(x)?,
                UnaryOp::Sqrt => ct.div(y)?.mul_scalar(0.5)?,
                UnaryOp::Rsqrt => ct.mul(&y.mul(y)?.mul(y)?)?.mul_scalar(-0.5)?,
                UnaryOp::Sigmoid => ct.mul(&y.sub(&y.square()?)?)?,
                UnaryOp::Silu => {
                    let s = x.sigmoid()?;
                    // s * (1 + x * (1 - s))
                    let d = s.mul(&x.mul(&s.neg()?.add_scalar(1.0)?)?.add_scalar(1.0)?)?;
                    ct.mul(&d)?
                }
                UnaryOp::Tanh => ct.mul(&y.square()?.neg()?.add_scalar(1.0)?)?,
                UnaryOp::Abs => {
                    let z = zeros_like(x);
                    let sign = x.gt(&z)?.select(&ones_like(x), &x.lt(&z)?.select(&ones_like(x).neg()?, &z)?)?;
                    ct.mul(&sign)?
                }
                UnaryOp::Recip => ct.mul(&y.square()?)?.neg()?,
                UnaryOp::Square => ct.mul(x)?.mul_scalar(2.0)?,
            };
            vec![Some(g)]
        }
        Op::PowScalar { exponent } => vec![Some(ct.mul(&args[0].powf(exponent - 1.0)?)?.mul_scalar(*exponent)?)],
        Op::AddScalar { .. } => vec![Some(ct)],
        Op::MulScalar { value } => vec![Some(ct.mul_scalar(*value)?)],
        Op::Cast { .. } => {
            let from = args[0].dtype();
            if from.is_float() { vec![Some(ct.cast(from)?)] } else { none() }
        }
        Op::Binary(b) => {
            let (a, c) = (&args[0], &args[1]);
            match b {
                BinaryOp::Add => vec![Some(ct.clone()), Some(ct)],
                BinaryOp::Sub => vec![Some(ct.clone()), Some(ct.neg()?)],
                BinaryOp::Mul => {
                    vec![if need[0] { Some(ct.mul(c)?) } else { None }, if need[1] { Some(ct.mul(a)?) } else { None }]
                }
                BinaryOp::Div => vec![
                    if need[0] { Some(ct.div(c)?) } else { None },
                    if need[1] { Some(ct.mul(y)?.div(c)?.neg()?) } else { None },
                ],
                BinaryOp::Maximum | BinaryOp::Minimum => {
                    if !a.dtype().is_float() {
                        return Ok(none());
                    }
                    // The winner takes the gradient; ties split it evenly (as PyTorch does).
                    let wins = if *b == BinaryOp::Maximum { a.gt(c)? } else { a.lt(c)? };
                    let ties = a.eq(c)?;
                    let z = zeros_like(&ct);
                    let half = ct.mul_scalar(0.5)?;
                    let ga = wins.select(&ct, &ties.select(&half, &z)?)?;
                    let gc = ct.sub(&ga)?;
                    vec![Some(ga), Some(gc)]
                }
            }
        }
        Op::Compare(_) => none(),
        Op::Where => {
            let z = zeros_like(&ct);
            let c = &args[0];
            vec![None, Some(c.select(&ct, &z)?), Some(c.select(&z, &ct)?)]
        }
        Op::Reduce { op, axes, keepdim } => {
            let x = &args[0];
            let ctb = unreduce(&ct, x, axes, *keepdim)?;
            let g = match op {
                ReduceOp::Sum => ctb,
                ReduceOp::SumSquares => ctb.mul(&x.mul_scalar(2.0)?)?,
                ReduceOp::Mean => {
                    let n: usize = axes.iter().map(|&a| x.dims()[a]).product();
                    ctb.mul_scalar(1.0 / n as f64)?
                }
                ReduceOp::Max => {
                    if !x.dtype().is_float() {
                        return Ok(none());
                    }
                    // Ties share the gradient evenly.
                    let mask = x.eq(&unreduce(y, x, axes, *keepdim)?)?.cast(x.dtype())?;
                    let count = unreduce(&mask.sum(axes, *keepdim)?, x, axes, *keepdim)?;
                    ctb.mul(&mask)?.div(&count)?
                }
            };
            vec![Some(g)]
        }
        Op::Reshape { .. } => vec![Some(ct.reshape(args[0].dims())?)],
        Op::Permute { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(ct.permute(&inv)?)]
        }
        Op::Broadcast { shape } => {
            let x = &args[0];
            let off = shape.rank() - x.rank();
            let axes: Vec<usize> =
                (0..shape.rank()).filter(|&a| a < off || (x.dims()[a - off] == 1 && shape.dims()[a] != 1)).collect();
            let g = if axes.is_empty() { ct } else { ct.sum(&axes, false)? };
            vec![Some(g.reshape(x.dims())?)]
        }
        Op::Slice { axis, start, end } => {
            let x = &args[0];
            let mut parts = Vec::new();
            let pad = |n: usize| {
                let mut dims = x.dims().to_vec();
                dims[*axis] = n;
                x.graph().full(0.0, ct.dtype(), &dims)
            };
            if *start > 0 {
                parts.push(pad(*start));
            }
            parts.push(ct.clone());
            if *end < x.dims()[*axis] {
                parts.push(pad(x.dims()[*axis] - end));
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            vec![Some(if refs.len() == 1 { ct } else { Tensor::concat(&refs, *axis)? })]
        }
        Op::Concat { axis } => {
            let mut start = 0;
            let mut r = Vec::new();
            for (a, &nd) in args.iter().zip(need) {
                let n = a.dims()[*axis];
                r.push(if nd { Some(ct.slice(*axis, start, start + n)?) } else { None });
                start += n;
            }
            r
        }
        Op::Gather => vec![Some(args[1].scatter_add(&ct, args[0].dims()[0])?), None],
        Op::ScatterAdd { .. } => vec![None, Some(ct.gather(&args[0])?)],
        Op::Matmul { out: Some(_), .. } | Op::Matmul { acc: Addend::Full | Addend::Row, .. } => {
            return Err(Error::Autodiff(
                "matmul with out= or acc=: made by folding, after differentiating; no VJP".into(),
            ));
        }
        Op::Matmul { ta, tb, out: None, acc: Addend::None } => {
            let (a, b) = (&args[0], &args[1]);
            let da = if !need[0] {
                None
            } else if !ta {
                Some(ct.matmul_opts(b, false, !tb)?)
            } else {
                Some(b.matmul_opts(&ct, *tb, true)?)
            };
            let db = if !need[1] {
                None
            } else if !tb {
                Some(a.matmul_opts(&ct, !ta, false)?)
            } else {
                Some(ct.matmul_opts(a, true, *ta)?)
            };
            vec![da, db]
        }
        Op::RmsNorm { eps } => {
            let mut r =
                args[0].graph().apply(Op::RmsNormBackward { eps: *eps, acc: false }, &[&args[0], &args[1], &ct])?;
            let dw = r.pop();
            vec![r.pop(), dw]
        }
        Op::Rope { theta, inverse, layout, scaling } => {
            let op = Op::Rope { theta: *theta, inverse: !inverse, layout: *layout, scaling: *scaling };
            vec![Some(args[0].graph().apply(op, &[&ct])?.remove(0))]
        }
        Op::Softmax => vec![Some(y.graph().apply(Op::SoftmaxBackward, &[y, &ct])?.remove(0))],
        Op::LogSoftmax => vec![Some(y.graph().apply(Op::LogSoftmaxBackward, &[y, &ct])?.remove(0))],
        Op::CrossEntropy { ignore_index } => {
            let g = args[0]
                .graph()
                .apply(Op::CrossEntropyBackward { ignore_index: *ignore_index }, &[&args[0], &args[1], &ct])?;
            vec![Some(g[0].clone()), None]
        }
        Op::LinearCrossEntropy { ignore_index, chunk } => {
            let op = Op::LinearCrossEntropyBackward { ignore_index: *ignore_index, chunk: *chunk };
            let mut r = args[0].graph().apply(op, &[&args[0], &args[1], &args[2], &outs[1], &ct])?;
            let dw = r.pop();
            vec![r.pop(), dw, None]
        }
        Op::Swiglu => {
            let mut r = args[0].graph().apply(Op::SwigluBackward, &[&args[0], &args[1], &ct])?;
            let du = r.pop();
            vec![r.pop(), du]
        }
        Op::SwigluPacked => vec![Some(args[0].graph().apply(Op::SwigluPackedBackward, &[&args[0], &ct])?.remove(0))],
        Op::Attention { scale, causal, layout } => {
            let (q, k, v) = (&args[0], &args[1], &args[2]);
            // dq, dk, dv in the layout of q, k, v.
            let op = Op::AttentionBackward { scale: *scale, causal: *causal, layout: *layout };
            let r = q.graph().apply(op, &[q, k, v, y, &outs[1], &ct])?;
            r.into_iter().map(Some).collect()
        }
        Op::Fused(_) => {
            return Err(Error::Autodiff("fused ops have no VJP: fuse after differentiating".into()));
        }
        Op::Collective { .. } => {
            return Err(Error::Autodiff(format!(
                "{}: a collective has no VJP; data_parallel inserts collectives after differentiating",
                op.name()
            )));
        }
        // Decoding ops: inference only.
        Op::RopeAt { .. }
        | Op::CacheWrite { .. }
        | Op::CacheWriteKv { .. }
        | Op::AttentionCached { .. }
        | Op::Sample { .. }
        | Op::MatmulPre { .. } => {
            return Err(Error::Autodiff(format!("{}: a decoding op, inference only: no VJP", op.name())));
        }
        Op::RmsNormBackward { .. }
        | Op::SoftmaxBackward
        | Op::LogSoftmaxBackward
        | Op::CrossEntropyBackward { .. }
        | Op::LinearCrossEntropyBackward { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::SwigluBackward
        | Op::SwigluPackedBackward
        | Op::AttentionBackward { .. } => {
            return Err(Error::Autodiff(format!("{}: second-order gradients are not supported", op.name())));
        }
    };
    // Drop cotangents that were not asked for, and any for non-float operands.
    Ok(r.into_iter().zip(need).zip(args).map(|((g, &n), a)| if n && a.dtype().is_float() { g } else { None }).collect())
}
