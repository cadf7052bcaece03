//! Scaled dot-product attention with grouped-query heads, computed exactly (all scores of a
//! row at once) in f64 per row. Saves only the output and the log-sum-exp, like the flash
//! kernels it specifies; the backward recomputes the probabilities from them.
//!
//! Operands are `[B, H, T, D]` or `[B, T, H, D]` (`HeadLayout`): each head's rows are read
//! through [`Dims::q_row`] / [`Dims::k_row`] into contiguous `[T, D]` blocks, computed on, and
//! written back the same way, so both layouts run the one computation below.

use rayon::prelude::*;

use super::convert::Real;
use crate::ir::HeadLayout;

/// `(B, Hq, T, D)` and `(B, Hkv, S, D)` unpacked, and the operands' layout.
pub struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
    layout: HeadLayout,
}

impl Dims {
    /// From the shapes of q and k in `layout`.
    pub fn new(layout: HeadLayout, q: &[usize], k: &[usize]) -> Self {
        let ([b, hq, t, d], [_, hkv, s, _]) = (layout.bhtd(q), layout.bhtd(k));
        Dims { b, hq, hkv, t, s, d, layout }
    }
    /// Keys visible to query `i`.
    fn visible(&self, i: usize, causal: bool) -> usize {
        if causal { i + 1 } else { self.s }
    }
    /// Offset of row `i` of query head `h` of batch `b` in q, o, do and dq.
    fn q_row(&self, b: usize, h: usize, i: usize) -> usize {
        let (hs, rs) = self.layout.strides(self.hq, self.t, self.d);
        b * self.hq * self.t * self.d + h * hs + i * rs
    }
    /// Offset of row `j` of key/value head `h` of batch `b` in k, v, dk and dv.
    fn k_row(&self, b: usize, h: usize, j: usize) -> usize {
        let (hs, rs) = self.layout.strides(self.hkv, self.s, self.d);
        b * self.hkv * self.s * self.d + h * hs + j * rs
    }
}

/// `n` rows of `d` starting at `row(i)`, as one contiguous `[n, d]` block.
fn gather<A: Copy>(x: &[A], n: usize, d: usize, row: impl Fn(usize) -> usize) -> Vec<A> {
    (0..n).flat_map(|i| x[row(i)..row(i) + d].iter().copied()).collect()
}

/// Writes a contiguous `[n, d]` block back to rows `row(i)` of `x`.
fn scatter<A: Copy>(x: &mut [A], block: &[A], d: usize, row: impl Fn(usize) -> usize) {
    if d == 0 {
        return;
    }
    for (i, r) in block.chunks(d).enumerate() {
        x[row(i)..row(i) + d].copy_from_slice(r);
    }
}

fn dot<A: Real>(a: &[A], b: &[A]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x.f64() * y.f64()).sum()
}

/// Scores `scale * q.k_j` of one query row and their log-sum-exp.
fn scores<A: Real>(qrow: &[A], k: &[A], d: usize, n: usize, scale: f64) -> (Vec<f64>, f64) {
    let s: Vec<f64> = (0..n).map(|j| scale * dot(qrow, &k[j * d..(j + 1) * d])).collect();
    let m = s.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
    let lse = m + s.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    (s, lse)
}

/// `(o, lse)`: o in the operands' layout, lse `[B, Hq, T]`.
pub fn forward<A: Real>(dm: &Dims, q: &[A], k: &[A], v: &[A], scale: f64, causal: bool) -> (Vec<A>, Vec<A>) {
    let (t, s, d) = (dm.t, dm.s, dm.d);
    let group = dm.hq / dm.hkv;
    let per_head: Vec<(Vec<A>, Vec<A>)> = (0..dm.b * dm.hq)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dm.hq, bh % dm.hq);
            let kh = gather(k, s, d, |j| dm.k_row(b, h / group, j)); // (S, D)
            let vh = gather(v, s, d, |j| dm.k_row(b, h / group, j)); // (S, D)
            let qh = gather(q, t, d, |i| dm.q_row(b, h, i)); // (T, D)
            let mut o = vec![A::zero(); t * d];
            let mut lses = vec![A::zero(); t];
            for i in 0..t {
                let qrow = &qh[i * d..(i + 1) * d];
                let (sc, lse) = scores(qrow, &kh, d, dm.visible(i, causal), scale);
                for c in 0..d {
                    let acc: f64 = sc.iter().enumerate().map(|(j, &x)| (x - lse).exp() * vh[j * d + c].f64()).sum();
                    o[i * d + c] = A::of(acc);
                }
                lses[i] = A::of(lse);
            }
            (o, lses)
        })
        .collect();
    let (mut o, mut lse) = (vec![A::zero(); q.len()], Vec::with_capacity(dm.b * dm.hq * t));
    for (bh, (oh, lh)) in per_head.into_iter().enumerate() {
        scatter(&mut o, &oh, d, |i| dm.q_row(bh / dm.hq, bh % dm.hq, i));
        lse.extend(lh);
    }
    (o, lse)
}

/// The operands of the backward: the forward's inputs, its saved output and log-sum-exp, and
/// the output's cotangent.
pub struct Grads<A> {
    pub q: Vec<A>,
    pub k: Vec<A>,
    pub v: Vec<A>,
    pub o: Vec<A>,
    pub lse: Vec<A>,
    pub dout: Vec<A>,
}

/// `p_j = exp(s_j - lse)`, `dp_j = do.v_j`, `ds_j = p_j (dp_j - do.o)`;
/// `dq = scale sum_j ds_j k_j`, `dk_j += scale ds_j q`, `dv_j += p_j do`. Each key/value head
/// sums over its query heads in a fixed order, so results are deterministic.
pub fn backward<A: Real>(dm: &Dims, g: &Grads<A>, scale: f64, causal: bool) -> (Vec<A>, Vec<A>, Vec<A>) {
    let (t, s, d) = (dm.t, dm.s, dm.d);
    let group = dm.hq / dm.hkv;
    let per_kv: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = (0..dm.b * dm.hkv)
        .into_par_iter()
        .map(|bk| {
            let (b, kvh) = (bk / dm.hkv, bk % dm.hkv);
            let kh = gather(&g.k, s, d, |j| dm.k_row(b, kvh, j)); // (S, D)
            let vh = gather(&g.v, s, d, |j| dm.k_row(b, kvh, j)); // (S, D)
            let mut dq = vec![0f64; group * t * d];
            let (mut dk, mut dv) = (vec![0f64; s * d], vec![0f64; s * d]);
            for gi in 0..group {
                let h = kvh * group + gi;
                let bh = b * dm.hq + h;
                let rows = |x: &[A]| gather(x, t, d, |i| dm.q_row(b, h, i)); // (T, D)
                let (qh, oh, doh) = (rows(&g.q), rows(&g.o), rows(&g.dout));
                for i in 0..t {
                    let row = i * d;
                    let (qrow, orow, dorow) = (&qh[row..row + d], &oh[row..row + d], &doh[row..row + d]);
                    let lse = g.lse[bh * t + i].f64();
                    let n = dm.visible(i, causal);
                    let delta = dot(dorow, orow);
                    for j in 0..n {
                        let (kj, vj) = (&kh[j * d..(j + 1) * d], &vh[j * d..(j + 1) * d]);
                        let p = (scale * dot(qrow, kj) - lse).exp();
                        let ds = p * (dot(dorow, vj) - delta);
                        for c in 0..d {
                            dq[(gi * t + i) * d + c] += scale * ds * kj[c].f64();
                            dk[j * d + c] += scale * ds * qrow[c].f64();
                            dv[j * d + c] += p * dorow[c].f64();
                        }
                    }
                }
            }
            (dq, dk, dv)
        })
        .collect();
    let mut dq = vec![A::zero(); g.q.len()];
    let (mut dk, mut dv) = (vec![A::zero(); g.k.len()], vec![A::zero(); g.v.len()]);
    let to_a = |x: Vec<f64>| -> Vec<A> { x.into_iter().map(A::of).collect() };
    for (bk, (dqg, dkh, dvh)) in per_kv.into_iter().enumerate() {
        let (b, kvh) = (bk / dm.hkv, bk % dm.hkv);
        let dqg = to_a(dqg);
        for (gi, dqh) in dqg.chunks((t * d).max(1)).enumerate().take(group) {
            scatter(&mut dq, dqh, d, |i| dm.q_row(b, kvh * group + gi, i));
        }
        scatter(&mut dk, &to_a(dkh), d, |j| dm.k_row(b, kvh, j));
        scatter(&mut dv, &to_a(dvh), d, |j| dm.k_row(b, kvh, j));
    }
    (dq, dk, dv)
}
