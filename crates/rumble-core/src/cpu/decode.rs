//! The decoding ops on the CPU: `rope_at`, `cache_write`, `attention_cached` and `sample`
//! (their specs are in `ir/op.rs`). Attention accumulates in f64 like `attention.rs`;
//! sampling works in f64 and draws its uniform number with [`uniform`].

use super::convert::Real;
use crate::ir::HeadLayout;
use crate::{Error, Result};

/// RoPE of `x` (layout `layout`, dims `[B, ., ., D]`) with row `t` of sequence `b` at position
/// `pos[b] + t`; the angle is computed as `rope`'s is (f32 product of position and frequency,
/// `inv_freq` from `RopeScaling::inv_freq`).
pub fn rope_at<A: Real>(dims: &[usize], x: &[A], pos: &[i64], inv_freq: &[f32], layout: HeadLayout) -> Result<Vec<A>> {
    let [b_len, h, t_len, d] = layout.bhtd(dims);
    if let Some(p) = pos.iter().find(|&&p| p < 0) {
        return Err(Error::runtime("rope_at", format!("negative position {p}")));
    }
    let half = d / 2;
    let mut out = vec![A::zero(); x.len()];
    for (b, &start) in pos.iter().enumerate().take(b_len) {
        for hh in 0..h {
            for t in 0..t_len {
                let (hs, rs) = layout.strides(h, t_len, d);
                let at = b * h * t_len * d + hh * hs + t * rs;
                let p = (start + t as i64) as f32;
                let (row, o) = (&x[at..at + d], &mut out[at..at + d]);
                for j in 0..half {
                    let ang = (p * inv_freq[j]) as f64;
                    let (s, c) = (A::of(ang.sin()), A::of(ang.cos()));
                    o[j] = row[j] * c - row[j + half] * s;
                    o[j + half] = row[j + half] * c + row[j] * s;
                }
            }
        }
    }
    Ok(out)
}

/// The cache `[B, S, H, D]` (raw bytes, `esize` per element) with rows `pos[b]..pos[b] + T` of
/// each sequence replaced by `new [B, T, H, D]`.
pub fn cache_write(
    cache_dims: &[usize],
    cache: &[u8],
    new_t: usize,
    new: &[u8],
    pos: &[i64],
    esize: usize,
) -> Result<Vec<u8>> {
    let (b_len, s) = (cache_dims[0], cache_dims[1]);
    let row = cache_dims[2] * cache_dims[3] * esize; // bytes of one position
    let mut out = cache.to_vec();
    for (b, &p) in pos.iter().enumerate().take(b_len) {
        if p < 0 || p as usize + new_t > s {
            return Err(Error::runtime(
                "cache_write",
                format!("sequence {b}: rows {p}..{} do not fit a cache of {s} positions", p + new_t as i64),
            ));
        }
        let dst = (b * s + p as usize) * row;
        let src = b * new_t * row;
        out[dst..dst + new_t * row].copy_from_slice(&new[src..src + new_t * row]);
    }
    Ok(out)
}

/// `o [B, T, Hq, D]` of `q [B, T, Hq, D]` over `k, v [B, S, Hkv, D]`, query `t` of sequence `b`
/// seeing keys `0 ..= pos[b] + t` (at most S).
pub fn attention_cached<A: Real>(
    qd: &[usize],
    kd: &[usize],
    q: &[A],
    k: &[A],
    v: &[A],
    pos: &[i64],
    scale: f64,
) -> Result<Vec<A>> {
    let ([b_len, t_len, hq, d], [_, s, hkv, _]) = ([qd[0], qd[1], qd[2], qd[3]], [kd[0], kd[1], kd[2], kd[3]]);
    if let Some(p) = pos.iter().find(|&&p| p < 0) {
        return Err(Error::runtime("attention_cached", format!("negative position {p}")));
    }
    let group = hq / hkv;
    let mut o = vec![A::zero(); q.len()];
    let mut sc = Vec::with_capacity(s);
    for (b, &p) in pos.iter().enumerate().take(b_len) {
        for t in 0..t_len {
            let n = (p as usize + t + 1).min(s);
            for h in 0..hq {
                let qa = ((b * t_len + t) * hq + h) * d;
                let qrow = &q[qa..qa + d];
                let krow = |j: usize| ((b * s + j) * hkv + h / group) * d;
                sc.clear();
                sc.extend((0..n).map(|j| {
                    let kr = &k[krow(j)..krow(j) + d];
                    scale * qrow.iter().zip(kr).map(|(x, y)| x.f64() * y.f64()).sum::<f64>()
                }));
                let m = sc.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for c in 0..d {
                    let acc: f64 = sc.iter().enumerate().map(|(j, x)| (x - m).exp() * v[krow(j) + c].f64()).sum();
                    o[qa + c] = A::of(acc / z);
                }
            }
        }
    }
    Ok(o)
}

/// SplitMix64's finaliser: a bijection of 64-bit words that mixes every bit.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform number in [0, 1) that `sample` draws for `row` at `(seed, step)`:
/// `mix64(mix64(mix64(seed) ^ step) ^ row) >> 11`, times 2^-53. Counter-based: no state, so a
/// captured step given another step index draws anew. Backends compute the same bits.
pub fn uniform(seed: u64, step: u64, row: u64) -> f64 {
    (mix64(mix64(mix64(seed) ^ step) ^ row) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The `sample` op on logits `[B, V]` with key `(seed, step)`: one token id per row.
pub fn sample<A: Real>(v: usize, logits: &[A], key: &[i64], temperature: f64, top_k: usize, top_p: f64) -> Vec<i64> {
    logits
        .chunks(v)
        .enumerate()
        .map(|(row, x)| {
            if temperature == 0.0 {
                return argmax(x) as i64;
            }
            let z: Vec<f64> = x.iter().map(|a| a.f64() / temperature).collect();
            let m = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            let w: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
            let mut keep = vec![true; v];
            if top_k > 0 && top_k < v {
                // Keep i iff fewer than k tokens are strictly larger: the k-th largest and up.
                let mut sorted = z.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let kth = sorted[top_k - 1];
                keep.iter_mut().zip(&z).for_each(|(k, &zi)| *k = zi >= kth);
            }
            if top_p < 1.0 {
                let total: f64 = (0..v).filter(|&i| keep[i]).map(|i| w[i]).sum();
                // Mass strictly above each kept value: sort kept by value, descending.
                let mut order: Vec<usize> = (0..v).filter(|&i| keep[i]).collect();
                order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
                let mut above = 0.0;
                let mut i = 0;
                while i < order.len() {
                    let mut j = i; // the run of equal values order[i..j]
                    let mut run = 0.0;
                    while j < order.len() && z[order[j]] == z[order[i]] {
                        run += w[order[j]];
                        j += 1;
                    }
                    let kept = above / total < top_p;
                    order[i..j].iter().for_each(|&t| keep[t] = kept);
                    above += run;
                    i = j;
                }
            }
            let total: f64 = (0..v).filter(|&i| keep[i]).map(|i| w[i]).sum();
            let target = uniform(key[0] as u64, key[1] as u64, row as u64) * total;
            let mut acc = 0.0;
            let mut last = 0;
            for i in (0..v).filter(|&i| keep[i]) {
                acc += w[i];
                last = i;
                if acc > target {
                    break;
                }
            }
            last as i64
        })
        .collect()
}

/// The index of the largest value, the lowest among equals (NaN is never chosen over a number).
pub fn argmax<A: Real>(x: &[A]) -> usize {
    let mut best = 0;
    for (i, a) in x.iter().enumerate() {
        if a.f64() > x[best].f64() || x[best].f64().is_nan() && !a.f64().is_nan() {
            best = i;
        }
    }
    best
}
