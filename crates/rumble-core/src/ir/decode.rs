//! Type rules of the decoding ops (`rope_at`, `cache_write`, `cache_write_kv`,
//! `attention_cached`, `sample`, `matmul_pre`): the ops a generation step needs on top of the
//! training ops. Their specs are the variants' doc comments in `op.rs`; messages name the shapes
//! each op expects.

use super::dtype::{DType, TensorType};
use super::heads::{HeadLayout, RopeScaling};
use super::op::{float, int, rope_operand};

/// `pos` must be an int `[B]` for a batch of `b`.
fn positions(pos: &TensorType, b: usize) -> Result<(), String> {
    int(pos)?;
    if pos.dims() != [b] {
        return Err(format!("positions must be [B] = [{b}], got {}", pos.shape));
    }
    Ok(())
}

pub(super) fn rope_at(x: &TensorType, pos: &TensorType, layout: HeadLayout) -> Result<Vec<TensorType>, String> {
    rope_operand(x, layout)?;
    positions(pos, x.dims()[0])?;
    Ok(vec![x.clone()])
}

/// The RoPE a `cache_write` applies to its new rows before writing them, or `attention_cached`
/// to its queries before attending (their `rope`; `passes::fold_rope_at` folds a `rope_at` read
/// only by such a node into it): the rotation of `rope_at` with these attributes, layout
/// `bthd`, at the rows' positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeNew {
    pub theta: f64,
    pub scaling: RopeScaling,
}

pub(super) fn cache_write(
    cache: &TensorType,
    new: &TensorType,
    pos: &TensorType,
    rope: bool,
) -> Result<Vec<TensorType>, String> {
    float(cache)?;
    if rope {
        rope_operand(new, HeadLayout::Bthd)?;
    }
    let (c, n) = (cache.dims(), new.dims());
    if cache.rank() != 4 || new.rank() != 4 || cache.dtype != new.dtype || c[0] != n[0] || c[2..] != n[2..] {
        return Err(format!("needs cache [B, S, H, D] and new [B, T, H, D] of one dtype, got {cache} and {new}"));
    }
    if n[1] > c[1] {
        return Err(format!("{} new rows do not fit a cache of {} positions", n[1], c[1]));
    }
    positions(pos, c[0])?;
    Ok(vec![cache.clone()])
}

/// `cache_write_kv`'s operands `(k_cache, v_cache, k, v, pos)`: each pair a `cache_write`
/// (the keys rotated with `rope`), the two caches of one type and the new rows of one type.
pub(super) fn cache_write_kv(args: &[&TensorType], rope: bool) -> Result<Vec<TensorType>, String> {
    let [kc, vc, k, v, pos] = [args[0], args[1], args[2], args[3], args[4]];
    if kc != vc || k != v {
        return Err(format!(
            "needs caches of one type and new rows of one type, got caches {kc}, {vc} and rows {k}, {v}"
        ));
    }
    let mut out = cache_write(kc, k, pos, rope)?;
    out.extend(cache_write(vc, v, pos, false)?);
    Ok(out)
}

pub(super) fn attention_cached(
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    pos: &TensorType,
    rope: bool,
) -> Result<Vec<TensorType>, String> {
    float(q)?;
    if rope {
        rope_operand(q, HeadLayout::Bthd)?;
    }
    if q.rank() != 4 || k.rank() != 4 || k != v || q.dtype != k.dtype {
        return Err(format!("needs q [B, T, Hq, D] and k, v [B, S, Hkv, D] of one dtype, got q {q}, k {k}, v {v}"));
    }
    let ([b, _, hq, d], [kb, _, hkv, kd]) = (dims4(q), dims4(k));
    if b != kb || d != kd {
        return Err(format!("batch or head size differ: q {} vs k {}", q.shape, k.shape));
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(format!("{hq} query heads are not a multiple of {hkv} key/value heads"));
    }
    positions(pos, b)?;
    Ok(vec![q.clone()])
}

fn dims4(t: &TensorType) -> [usize; 4] {
    [t.dims()[0], t.dims()[1], t.dims()[2], t.dims()[3]]
}

pub(super) fn sample(
    logits: &TensorType,
    key: &TensorType,
    temperature: f64,
    top_p: f64,
) -> Result<Vec<TensorType>, String> {
    float(logits)?;
    if logits.rank() != 2 || logits.dims()[1] == 0 {
        return Err(format!("needs logits [B, V] with V > 0, got {}", logits.shape));
    }
    int(key)?;
    if key.dims() != [2] {
        return Err(format!("key must be [2] (seed, step), got {}", key.shape));
    }
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(format!("temperature must be finite and >= 0, got {temperature}"));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(format!("top_p must be in (0, 1], got {top_p}"));
    }
    Ok(vec![TensorType::new(DType::I64, [logits.dims()[0]])])
}

/// What `matmul_pre` does to its rows before the products (`passes::fold_prologues` folds such
/// a node into the decode-step projections it feeds): `rms_norm` with its weight (operands
/// `x [M, K]`, `g [K]`), or `swiglu_packed` (operand `x [M, 2K]`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Prologue {
    RmsNorm { eps: f64 },
    SwigluPacked,
}

impl Prologue {
    /// The op whose rows this prologue gives (its text name too).
    pub fn op(self) -> super::Op {
        match self {
            Prologue::RmsNorm { eps } => super::Op::RmsNorm { eps },
            Prologue::SwigluPacked => super::Op::SwigluPacked,
        }
    }
    /// Operands before the weight: the rows, and the norm's weight.
    pub fn operands(self) -> usize {
        match self {
            Prologue::RmsNorm { .. } => 2,
            Prologue::SwigluPacked => 1,
        }
    }
}

/// `matmul_pre`'s operands: the prologue's (`x [M, Kx]` and its weight), `outs` weights
/// `w_j [N_j, K]`, and with `acc` as many addends (`[M, N_j]`, or rows `[N_j]`); all of one
/// float dtype.
pub(super) fn matmul_pre(
    pre: Prologue,
    args: &[&TensorType],
    acc: super::Addend,
    outs: usize,
) -> Result<Vec<TensorType>, String> {
    let x = args[0];
    float(x)?;
    if outs == 0 {
        return Err("needs at least one weight (outs >= 1)".into());
    }
    if x.rank() != 2 {
        return Err(format!("needs rows x [M, K], got x {x}"));
    }
    let rows = pre.op().infer(&args[..pre.operands()])?.remove(0);
    let mut res = Vec::with_capacity(outs);
    for j in 0..outs {
        let w = args[pre.operands() + j];
        if w.rank() != 2 || w.dtype != x.dtype || rows.dims()[1] != w.dims()[1] {
            return Err(format!(
                "{} of x {x} gives rows {rows}: weight {j} must be {}[N, {}], got {w}",
                pre.op().name(),
                x.dtype,
                rows.dims()[1]
            ));
        }
        let out = TensorType::new(x.dtype, [x.dims()[0], w.dims()[0]]);
        if acc.is_some() {
            acc.check(args[pre.operands() + outs + j], &out).map_err(|e| format!("projection {j}: {e}"))?;
        }
        res.push(out);
    }
    Ok(res)
}
