//! Scaled dot-product attention with grouped-query heads, computed exactly (all scores of a
//! row at once) in f64 per row. Saves only the output and the log-sum-exp, like the flash
//! kernels it specifies; the backward recomputes the probabilities from them.

use rayon::prelude::*;

use super::convert::Real;

/// `(B, Hq, T, D)` and `(B, Hkv, S, D)` unpacked.
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
}

impl Dims {
    fn new(q: &[usize], k: &[usize]) -> Self {
        Dims { b: q[0], hq: q[1], hkv: k[1], t: q[2], s: k[2], d: q[3] }
    }
    /// Keys visible to query `i`.
    fn visible(&self, i: usize, causal: bool) -> usize {
        if causal { i + 1 } else { self.s }
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

pub fn forward<A: Real>(
    qd: &[usize],
    kd: &[usize],
    q: &[A],
    k: &[A],
    v: &[A],
    scale: f64,
    causal: bool,
) -> (Vec<A>, Vec<A>) {
    let dm = Dims::new(qd, kd);
    let (t, s, d) = (dm.t, dm.s, dm.d);
    let group = dm.hq / dm.hkv;
    let per_head: Vec<(Vec<A>, Vec<A>)> = (0..dm.b * dm.hq)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dm.hq, bh % dm.hq);
            let kv = (b * dm.hkv + h / group) * s * d;
            let (kh, vh) = (&k[kv..kv + s * d], &v[kv..kv + s * d]);
            let mut o = vec![A::zero(); t * d];
            let mut lses = vec![A::zero(); t];
            for i in 0..t {
                let qrow = &q[(bh * t + i) * d..(bh * t + i + 1) * d];
                let (sc, lse) = scores(qrow, kh, d, dm.visible(i, causal), scale);
                for c in 0..d {
                    let acc: f64 = sc.iter().enumerate().map(|(j, &x)| (x - lse).exp() * vh[j * d + c].f64()).sum();
                    o[i * d + c] = A::of(acc);
                }
                lses[i] = A::of(lse);
            }
            (o, lses)
        })
        .collect();
    let (mut o, mut lse) = (Vec::with_capacity(q.len()), Vec::with_capacity(dm.b * dm.hq * t));
    for (oh, lh) in per_head {
        o.extend(oh);
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
pub fn backward<A: Real>(
    qd: &[usize],
    kd: &[usize],
    g: &Grads<A>,
    scale: f64,
    causal: bool,
) -> (Vec<A>, Vec<A>, Vec<A>) {
    let dm = Dims::new(qd, kd);
    let (t, s, d) = (dm.t, dm.s, dm.d);
    let group = dm.hq / dm.hkv;
    let per_kv: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = (0..dm.b * dm.hkv)
        .into_par_iter()
        .map(|bk| {
            let b = bk / dm.hkv;
            let kv = bk * s * d;
            let (kh, vh) = (&g.k[kv..kv + s * d], &g.v[kv..kv + s * d]);
            let mut dq = vec![0f64; group * t * d];
            let (mut dk, mut dv) = (vec![0f64; s * d], vec![0f64; s * d]);
            for gi in 0..group {
                let bh = b * dm.hq + (bk % dm.hkv) * group + gi;
                for i in 0..t {
                    let row = (bh * t + i) * d;
                    let (qrow, orow, dorow) = (&g.q[row..row + d], &g.o[row..row + d], &g.dout[row..row + d]);
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
    let (mut dk, mut dv) = (Vec::with_capacity(g.k.len()), Vec::with_capacity(g.v.len()));
    for (bk, (dqg, dkh, dvh)) in per_kv.into_iter().enumerate() {
        let (b, kvh) = (bk / dm.hkv, bk % dm.hkv);
        let start = ((b * dm.hq + kvh * group) * t) * d;
        for (dst, src) in dq[start..start + group * t * d].iter_mut().zip(dqg) {
            *dst = A::of(src);
        }
        dk.extend(dkh.into_iter().map(A::of));
        dv.extend(dvh.into_iter().map(A::of));
    }
    (dq, dk, dv)
}
