//! Composite ops and their backward ops: RMSNorm, RoPE, softmax, log-softmax, cross-entropy,
//! SwiGLU. Row statistics accumulate in f64.

use super::convert::Real;
use super::matmul::matmul;
use crate::ir::{HeadLayout, TensorType};
use crate::{Error, Result};

fn sigmoid<A: Real>(x: A) -> A {
    A::one() / (A::one() + (-x).exp())
}

/// `1 / sqrt(mean(x^2) + eps)` of one row.
fn rstd<A: Real>(row: &[A], eps: f64) -> A {
    let ms = row.iter().map(|v| v.f64() * v.f64()).sum::<f64>() / row.len() as f64;
    A::of(1.0 / (ms + eps).sqrt())
}

pub fn rms_norm<A: Real>(x: &[A], w: &[A], eps: f64) -> Vec<A> {
    let d = w.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let r = rstd(row, eps);
        y.extend(row.iter().zip(w).map(|(&v, &wi)| v * r * wi));
    }
    y
}

/// `dx = r*(w*dy) - x * r^3/D * sum(w*dy*x)`, `dw = sum over rows of dy*x*r`.
pub fn rms_norm_backward<A: Real>(x: &[A], w: &[A], dy: &[A], eps: f64) -> (Vec<A>, Vec<A>) {
    let d = w.len();
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = vec![0f64; d];
    for (row, g) in x.chunks(d).zip(dy.chunks(d)) {
        let r = rstd(row, eps).f64();
        let dot: f64 = (0..d).map(|i| w[i].f64() * g[i].f64() * row[i].f64()).sum();
        let c = r * r * r * dot / d as f64;
        for i in 0..d {
            dx.push(A::of(r * w[i].f64() * g[i].f64() - row[i].f64() * c));
            dw[i] += g[i].f64() * row[i].f64() * r;
        }
    }
    (dx, dw.into_iter().map(A::of).collect())
}

/// Rotate-half RoPE on `[B, H, T, D]` (`[B, T, H, D]` in layout `bthd`) at positions `0..T`:
/// for `j < D/2`, `out[j] = x[j] cos - x[j + D/2] sin` and `out[j + D/2] = x[j + D/2] cos +
/// x[j] sin`, with angle `t * inv_freq[j]` rounded to f32 (as Hugging Face computes it; the
/// table comes from `RopeScaling::inv_freq`).
pub fn rope<A: Real>(dims: &[usize], x: &[A], inv_freq: &[f32], inverse: bool, layout: HeadLayout) -> Vec<A> {
    let [_, h, t_len, d] = layout.bhtd(dims);
    // Rows of D between consecutive positions: 1 (bhtd) or H (bthd).
    let per_pos = match layout {
        HeadLayout::Bhtd => 1,
        HeadLayout::Bthd => h,
    };
    let half = d / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut out = vec![A::zero(); x.len()];
    for (row_i, (row, o)) in x.chunks(d).zip(out.chunks_mut(d)).enumerate() {
        let t = ((row_i / per_pos) % t_len) as f32;
        for j in 0..half {
            let ang = (t * inv_freq[j]) as f64;
            let (s, c) = (A::of(sign * ang.sin()), A::of(ang.cos()));
            o[j] = row[j] * c - row[j + half] * s;
            o[j + half] = row[j + half] * c + row[j] * s;
        }
    }
    out
}

/// Softmax (or log-softmax) of each row of length `d`.
pub fn softmax<A: Real>(d: usize, x: &[A], log: bool) -> Vec<A> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.f64()));
        let s: f64 = row.iter().map(|v| (v.f64() - m).exp()).sum();
        let lse = m + s.ln();
        out.extend(row.iter().map(|v| A::of(if log { v.f64() - lse } else { (v.f64() - lse).exp() })));
    }
    out
}

/// Softmax: `dx = y * (dy - sum(dy*y))`; log-softmax: `dx = dy - exp(y) * sum(dy)`.
pub fn softmax_backward<A: Real>(d: usize, y: &[A], dy: &[A], log: bool) -> Vec<A> {
    let mut out = Vec::with_capacity(y.len());
    for (yr, gr) in y.chunks(d).zip(dy.chunks(d)) {
        if log {
            let s: f64 = gr.iter().map(|g| g.f64()).sum();
            out.extend(yr.iter().zip(gr).map(|(y, g)| A::of(g.f64() - y.f64().exp() * s)));
        } else {
            let s: f64 = yr.iter().zip(gr).map(|(y, g)| y.f64() * g.f64()).sum();
            out.extend(yr.iter().zip(gr).map(|(y, g)| A::of(y.f64() * (g.f64() - s))));
        }
    }
    out
}

/// Index of each row's target, or `None` for ignored rows; out-of-range targets are errors.
fn targets(v: usize, t: &[i64], ignore: i64) -> Result<Vec<Option<usize>>> {
    t.iter()
        .enumerate()
        .map(|(i, &t)| {
            if t == ignore {
                Ok(None)
            } else if t < 0 || t as usize >= v {
                Err(Error::runtime(
                    "cross_entropy",
                    format!("target {t} at row {i} is outside 0..{v} (ignore_index {ignore})"),
                ))
            } else {
                Ok(Some(t as usize))
            }
        })
        .collect()
}

fn row_lse<A: Real>(row: &[A]) -> f64 {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.f64()));
    m + row.iter().map(|v| (v.f64() - m).exp()).sum::<f64>().ln()
}

/// Mean over non-ignored rows of `logsumexp(row) - row[target]`; 0 when all are ignored.
pub fn cross_entropy<A: Real>(v: usize, logits: &[A], t: &[i64], ignore: i64) -> Result<f64> {
    let tg = targets(v, t, ignore)?;
    let (mut sum, mut count) = (0.0, 0usize);
    for (row, t) in logits.chunks(v).zip(&tg) {
        if let Some(t) = t {
            sum += row_lse(row) - row[*t].f64();
            count += 1;
        }
    }
    Ok(sum / count.max(1) as f64)
}

/// `(softmax(row) - onehot(target)) * dloss / count` for non-ignored rows, 0 for the others.
pub fn cross_entropy_backward<A: Real>(v: usize, logits: &[A], t: &[i64], dloss: f64, ignore: i64) -> Result<Vec<A>> {
    let tg = targets(v, t, ignore)?;
    let count = tg.iter().filter(|t| t.is_some()).count().max(1) as f64;
    let lse: Vec<f64> = logits.chunks(v.max(1)).map(row_lse).collect();
    Ok(ce_rows_backward(v, logits, &tg, &lse, dloss / count))
}

/// `(exp(row - lse) - onehot(target)) * scale` for rows with a target, 0 for the others;
/// `lse` holds each row's log-sum-exp.
fn ce_rows_backward<A: Real>(v: usize, logits: &[A], tg: &[Option<usize>], lse: &[f64], scale: f64) -> Vec<A> {
    let mut out = Vec::with_capacity(logits.len());
    for ((row, t), &lse) in logits.chunks(v).zip(tg).zip(lse) {
        match t {
            None => out.extend(std::iter::repeat_n(A::zero(), v)),
            Some(t) => {
                out.extend(row.iter().enumerate().map(|(j, x)| {
                    let p = (x.f64() - lse).exp() - if j == *t { 1.0 } else { 0.0 };
                    A::of(p * scale)
                }));
            }
        }
    }
    out
}

pub fn swiglu<A: Real>(gate: &[A], up: &[A]) -> Vec<A> {
    gate.iter().zip(up).map(|(&g, &u)| g * sigmoid(g) * u).collect()
}

/// `dgate = dy * up * s * (1 + g * (1 - s))`, `dup = dy * silu(g)`, with `s = sigmoid(g)`.
pub fn swiglu_backward<A: Real>(gate: &[A], up: &[A], dy: &[A]) -> (Vec<A>, Vec<A>) {
    let one = A::one();
    let mut dg = Vec::with_capacity(gate.len());
    let mut du = Vec::with_capacity(gate.len());
    for ((&g, &u), &d) in gate.iter().zip(up).zip(dy) {
        let s = sigmoid(g);
        dg.push(d * u * s * (one + g * (one - s)));
        du.push(d * g * s);
    }
    (dg, du)
}

/// [`swiglu`] of each row `[gate | up]` of width `w` (`2F`): rows of `F`.
pub fn swiglu_packed<A: Real>(w: usize, x: &[A]) -> Vec<A> {
    let f = w / 2;
    x.chunks(w.max(1)).flat_map(|r| swiglu(&r[..f], &r[f..])).collect()
}

/// The gradient of [`swiglu_packed`]: rows `[dgate | dup]` of width `w`.
pub fn swiglu_packed_backward<A: Real>(w: usize, x: &[A], dy: &[A]) -> Vec<A> {
    let f = w / 2;
    let mut dx = Vec::with_capacity(x.len());
    for (r, d) in x.chunks(w.max(1)).zip(dy.chunks(f.max(1))) {
        let (dg, du) = swiglu_backward(&r[..f], &r[f..], d);
        dx.extend(dg);
        dx.extend(du);
    }
    dx
}

/// Rows `r0..r1` of `x @ w^T` (logits of one chunk), in the computation type.
fn chunk_logits<A: Real>(xt: &TensorType, x: &[A], wt: &TensorType, w: &[A], r0: usize, r1: usize) -> Vec<A> {
    let c = xt.dims()[1];
    matmul(&xt.with_shape([r1 - r0, c]), &x[r0 * c..r1 * c], wt, w, false, true)
}

/// `(cross_entropy(x @ w^T, t), lse)`, `chunk` rows of logits at a time; `lse` is every row's
/// log-sum-exp of its logits, ignored rows included.
pub fn linear_cross_entropy<A: Real>(
    xt: &TensorType,
    x: &[A],
    wt: &TensorType,
    w: &[A],
    t: &[i64],
    ignore: i64,
    chunk: usize,
) -> Result<(f64, Vec<f64>)> {
    let (n, v) = (xt.dims()[0], wt.dims()[0]);
    let tg = targets(v, t, ignore)?;
    let (mut sum, mut count) = (0.0, 0usize);
    let mut lse = Vec::with_capacity(n);
    for r0 in (0..n).step_by(chunk) {
        let r1 = (r0 + chunk).min(n);
        let logits = chunk_logits(xt, x, wt, w, r0, r1);
        for (row, t) in logits.chunks(v).zip(&tg[r0..r1]) {
            let l = row_lse(row);
            lse.push(l);
            if let Some(t) = t {
                sum += l - row[*t].f64();
                count += 1;
            }
        }
    }
    Ok((sum / count.max(1) as f64, lse))
}

/// `(dx, dw)` of `linear_cross_entropy`, recomputing each chunk's logits but taking each
/// row's log-sum-exp from the forward's `lse`.
pub fn linear_cross_entropy_backward<A: Real>(
    (xt, x): (&TensorType, &[A]),
    (wt, w): (&TensorType, &[A]),
    t: &[i64],
    lse: &[f64],
    dloss: f64,
    ignore: i64,
    chunk: usize,
) -> Result<(Vec<A>, Vec<A>)> {
    let (n, c, v) = (xt.dims()[0], xt.dims()[1], wt.dims()[0]);
    let tg = targets(v, t, ignore)?;
    let scale = dloss / tg.iter().filter(|t| t.is_some()).count().max(1) as f64;
    let mut dx = Vec::with_capacity(n * c);
    let mut dw = vec![0f64; v * c];
    for r0 in (0..n).step_by(chunk) {
        let r1 = (r0 + chunk).min(n);
        let logits = chunk_logits(xt, x, wt, w, r0, r1);
        let dl = ce_rows_backward(v, &logits, &tg[r0..r1], &lse[r0..r1], scale);
        let dlt = TensorType::new(xt.dtype, [r1 - r0, v]);
        dx.extend(matmul(&dlt, &dl, wt, w, false, false));
        let g = matmul(&dlt, &dl, &xt.with_shape([r1 - r0, c]), &x[r0 * c..r1 * c], true, false);
        for (acc, g) in dw.iter_mut().zip(g) {
            *acc += g.f64();
        }
    }
    Ok((dx, dw.into_iter().map(A::of).collect()))
}
