//! The CPU reference backend: the executable specification every other backend is checked
//! against. Clarity beats speed, but a tiny model trains on it in seconds.
//!
//! Values are little-endian host bytes ([`HostTensor`]). Each op decodes its operands into a
//! computation type (`f32` for f32/bf16/f16 storage, `f64` for f64, `i64` for integers),
//! computes, and encodes its results: bf16 is "bf16 storage, f32 arithmetic", rounded once per
//! op. Reductions accumulate in f64. Everything is deterministic: the same inputs give the same
//! bits whatever the thread count.
//!
//! [`run_op`] runs one node on bytes (used by every CPU executor); [`eval`] is the
//! per-op-allocation executor that frees each value after its last use.

pub mod arena;
mod attention;
pub mod collective;
mod composite;
mod convert;
pub mod decode;
mod elementwise;
mod layout;
mod matmul;
mod random;
mod reduce;

use crate::ir::{DType, HeadLayout, InputRole, Op, OutputRole, TensorType, Trace};
use crate::{Error, Result};

pub use convert::{Real, read_float, read_int, round_to, write_float, write_int};
pub use random::Rng;

/// A tensor in host memory: its type and its little-endian bytes.
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    pub ty: TensorType,
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vals = self.to_f64();
        let head: Vec<String> = vals.iter().take(8).map(|v| format!("{v:.4}")).collect();
        write!(f, "HostTensor({}, [{}{}])", self.ty, head.join(", "), if vals.len() > 8 { ", ..." } else { "" })
    }
}

impl HostTensor {
    /// Wraps bytes; their length must match the type.
    pub fn new(ty: TensorType, bytes: Vec<u8>) -> Result<Self> {
        if bytes.len() != ty.size_in_bytes() {
            return Err(Error::msg(format!("{} bytes do not hold a {ty} ({} bytes)", bytes.len(), ty.size_in_bytes())));
        }
        Ok(HostTensor { ty, bytes })
    }
    pub fn zeros(ty: TensorType) -> Self {
        let n = ty.size_in_bytes();
        HostTensor { ty, bytes: vec![0; n] }
    }
    /// Float (or int) values converted to `dtype` (rounded to nearest even, ints truncated).
    pub fn from_f64(dtype: DType, dims: &[usize], vals: &[f64]) -> Result<Self> {
        let ty = TensorType::new(dtype, dims.to_vec());
        if vals.len() != ty.numel() {
            return Err(Error::msg(format!("{} values do not fill a {ty}", vals.len())));
        }
        Ok(HostTensor { bytes: write_float::<f64>(dtype, vals), ty })
    }
    pub fn from_f32(dims: &[usize], vals: &[f32]) -> Result<Self> {
        Self::from_f64(DType::F32, dims, &vals.iter().map(|&v| v as f64).collect::<Vec<_>>())
    }
    pub fn from_i64(dtype: DType, dims: &[usize], vals: &[i64]) -> Result<Self> {
        let ty = TensorType::new(dtype, dims.to_vec());
        if vals.len() != ty.numel() {
            return Err(Error::msg(format!("{} values do not fill a {ty}", vals.len())));
        }
        Ok(HostTensor { bytes: write_int(dtype, vals), ty })
    }
    pub fn scalar(dtype: DType, v: f64) -> Self {
        HostTensor { ty: TensorType::scalar(dtype), bytes: write_float::<f64>(dtype, &[v]) }
    }
    /// Normal(0, std) values, from a seeded generator.
    pub fn randn(ty: TensorType, std: f64, rng: &mut Rng) -> Self {
        let vals: Vec<f64> = (0..ty.numel()).map(|_| rng.normal() * std).collect();
        HostTensor { bytes: write_float::<f64>(ty.dtype, &vals), ty }
    }
    /// Uniform integers in `0..hi`.
    pub fn randint(ty: TensorType, hi: u64, rng: &mut Rng) -> Self {
        let vals: Vec<i64> = (0..ty.numel()).map(|_| rng.below(hi) as i64).collect();
        HostTensor { bytes: write_int(ty.dtype, &vals), ty }
    }
    pub fn to_f64(&self) -> Vec<f64> {
        read_float::<f64>(self.ty.dtype, &self.bytes)
    }
    pub fn to_f32(&self) -> Vec<f32> {
        read_float::<f32>(self.ty.dtype, &self.bytes)
    }
    pub fn to_i64(&self) -> Vec<i64> {
        read_int(self.ty.dtype, &self.bytes)
    }
    /// The single value of a one-element tensor.
    pub fn item(&self) -> f64 {
        self.to_f64().first().copied().unwrap_or(f64::NAN)
    }
    /// Converted to another dtype (the `cast` op's semantics).
    pub fn cast(&self, to: DType) -> HostTensor {
        let ty = self.ty.with_dtype(to);
        HostTensor { bytes: elementwise::cast(&self.ty, &self.bytes, to), ty }
    }
}

/// Runs one op on host bytes. `args[i]` holds an operand of type `arg_types[i]`; the result
/// holds one byte vector per output type. Types are assumed checked (the verifier's job);
/// data-dependent errors (an index out of range) are returned.
pub fn run_op(op: &Op, arg_types: &[&TensorType], args: &[&[u8]], out_types: &[&TensorType]) -> Result<Vec<Vec<u8>>> {
    for (i, (t, a)) in arg_types.iter().zip(args).enumerate() {
        if t.size_in_bytes() != a.len() {
            return Err(Error::runtime(
                op.name(),
                format!("operand {i} has {} bytes, its type {t} needs {}", a.len(), t.size_in_bytes()),
            ));
        }
    }
    // f64 if any float operand or result is f64, else f32.
    let wide = arg_types.iter().chain(out_types).any(|t| t.dtype == DType::F64);
    if wide { dispatch::<f64>(op, arg_types, args, out_types) } else { dispatch::<f32>(op, arg_types, args, out_types) }
}

/// What `rope_at` (layout `bthd`) gives for `x` of type `ty` at positions `pos`, stored in the
/// dtype: the rows a decoding node with `rope` (`fold_rope_at`) reads in their place.
/// Adds a matmul's addend to its products `c`: elementwise where it has their length
/// (`Addend::Full`), else as a row added to every row (`Addend::Row`, `c.len()` a multiple).
fn add_addend<A: Real>(c: &mut [A], addend: &[A]) {
    if addend.is_empty() {
        return;
    }
    for row in c.chunks_mut(addend.len()) {
        row.iter_mut().zip(addend).for_each(|(c, &x)| *c = *c + x);
    }
}

fn rotate_rows<A: Real>(ty: &TensorType, x: &[A], pos: &[i64], r: &crate::ir::RopeNew) -> Result<Vec<u8>> {
    let inv_freq = r.scaling.inv_freq(r.theta, ty.dims()[3]);
    Ok(write_float(ty.dtype, &decode::rope_at::<A>(ty.dims(), x, pos, &inv_freq, HeadLayout::Bthd)?))
}

fn dispatch<A: Real>(op: &Op, at: &[&TensorType], args: &[&[u8]], ot: &[&TensorType]) -> Result<Vec<Vec<u8>>> {
    let one = |b: Vec<u8>| Ok(vec![b]);
    let f = |i: usize| read_float::<A>(at[i].dtype, args[i]);
    let out = |v: &[A]| write_float(ot[0].dtype, v);
    // The fused loss's backward on operands 0 (x) and 1 (w), given the targets and lse.
    let lce_backward = |t: &[i64], lse: &[f64], dloss: f64, ignore: i64, chunk: usize| {
        composite::linear_cross_entropy_backward::<A>((at[0], &f(0)), (at[1], &f(1)), t, lse, dloss, ignore, chunk)
    };
    match op {
        Op::Full { value, ty } => one(if ty.dtype.is_float() {
            write_float::<f64>(ty.dtype, &vec![*value; ty.numel()])
        } else {
            write_int(ty.dtype, &vec![*value as i64; ty.numel()])
        }),
        Op::Unary(u) => one(out(&elementwise::unary::<A>(*u, &f(0)))),
        Op::PowScalar { exponent } => one(out(&f(0).iter().map(|&x| x.powf(A::of(*exponent))).collect::<Vec<_>>())),
        Op::AddScalar { value } => one(out(&f(0).iter().map(|&x| x + A::of(*value)).collect::<Vec<_>>())),
        Op::MulScalar { value } => one(out(&f(0).iter().map(|&x| x * A::of(*value)).collect::<Vec<_>>())),
        Op::Cast { to } => one(elementwise::cast(at[0], args[0], *to)),
        Op::Binary(b) => one(elementwise::binary::<A>(*b, at[0], args[0], args[1])?),
        Op::Compare(c) => one(elementwise::compare(*c, at[0], args[0], args[1])),
        Op::Where => one(elementwise::select(at[1].dtype.size_in_bytes(), args[0], args[1], args[2])),
        Op::Reduce { op: r, axes, keepdim: _ } => one(reduce::reduce::<A>(*r, axes, at[0], args[0], ot[0])),
        Op::Reshape { .. } => one(args[0].to_vec()),
        Op::Permute { perm } => one(layout::permute(at[0], args[0], perm)),
        Op::Broadcast { shape } => one(layout::broadcast(at[0], args[0], shape.dims())),
        Op::Slice { axis, start, end } => one(layout::slice(at[0], args[0], *axis, *start, *end)),
        Op::Concat { axis } => one(layout::concat(at, args, *axis)),
        Op::Gather => one(layout::gather(at[0], args[0], at[1], args[1])?),
        Op::ScatterAdd { rows } => one(layout::scatter_add::<A>(at[0], args[0], at[1], args[1], *rows)?),
        Op::Matmul { ta, tb, acc, .. } => {
            let mut c = matmul::matmul::<A>(at[0], &f(0), at[1], &f(1), *ta, *tb);
            if acc.is_some() {
                // The addend joins the products before the one rounding to the result's dtype.
                add_addend(&mut c, &f(2));
            }
            one(out(&c))
        }
        Op::RmsNorm { eps } => one(out(&composite::rms_norm::<A>(&f(0), &f(1), *eps))),
        Op::MatmulPre { pre, acc, outs } => {
            // The prologue's rows rounded to the dtype (as its op's result is), then each `matmul`.
            let w = pre.operands();
            let rows_ty = TensorType::new(at[0].dtype, [at[0].dims()[0], at[w].dims()[1]]);
            let rows = run_op(&pre.op(), &at[..w], &args[..w], &[&rows_ty])?.remove(0);
            let rows = read_float::<A>(at[0].dtype, &rows);
            let mut res = Vec::with_capacity(*outs);
            for j in 0..*outs {
                let mut c = matmul::matmul::<A>(&rows_ty, &rows, at[w + j], &f(w + j), false, true);
                if acc.is_some() {
                    add_addend(&mut c, &f(w + outs + j));
                }
                res.push(write_float(ot[j].dtype, &c));
            }
            Ok(res)
        }
        Op::RmsNormBackward { eps, acc } => {
            let (mut dx, dw) = composite::rms_norm_backward::<A>(&f(0), &f(1), &f(2), *eps);
            if *acc {
                // The addend joins dx before its one rounding.
                dx.iter_mut().zip(f(3)).for_each(|(d, c)| *d = *d + c);
            }
            Ok(vec![out(&dx), write_float(ot[1].dtype, &dw)])
        }
        Op::Rope { theta, inverse, layout, scaling } => {
            let inv_freq = scaling.inv_freq(*theta, layout.bhtd(at[0].dims())[3]);
            one(out(&composite::rope::<A>(at[0].dims(), &f(0), &inv_freq, *inverse, *layout)))
        }
        Op::Softmax => one(out(&composite::softmax::<A>(at[0].shape.last(), &f(0), false))),
        Op::LogSoftmax => one(out(&composite::softmax::<A>(at[0].shape.last(), &f(0), true))),
        Op::SoftmaxBackward => one(out(&composite::softmax_backward::<A>(at[0].shape.last(), &f(0), &f(1), false))),
        Op::LogSoftmaxBackward => one(out(&composite::softmax_backward::<A>(at[0].shape.last(), &f(0), &f(1), true))),
        Op::CrossEntropy { ignore_index } => {
            let t = read_int(at[1].dtype, args[1]);
            let loss = composite::cross_entropy::<A>(at[0].dims()[1], &f(0), &t, *ignore_index)?;
            one(write_float::<f64>(ot[0].dtype, &[loss]))
        }
        Op::CrossEntropyBackward { ignore_index } => {
            let t = read_int(at[1].dtype, args[1]);
            let dloss = read_float::<f64>(at[2].dtype, args[2])[0];
            one(out(&composite::cross_entropy_backward::<A>(at[0].dims()[1], &f(0), &t, dloss, *ignore_index)?))
        }
        Op::LinearCrossEntropy { ignore_index, chunk } => {
            let t = read_int(at[2].dtype, args[2]);
            let (loss, lse) =
                composite::linear_cross_entropy::<A>(at[0], &f(0), at[1], &f(1), &t, *ignore_index, *chunk)?;
            Ok(vec![write_float::<f64>(ot[0].dtype, &[loss]), write_float::<f64>(ot[1].dtype, &lse)])
        }
        Op::LinearCrossEntropyBackward { ignore_index, chunk } => {
            let t = read_int(at[2].dtype, args[2]);
            let lse = read_float::<f64>(at[3].dtype, args[3]);
            let dloss = read_float::<f64>(at[4].dtype, args[4])[0];
            let (dx, dw) = lce_backward(&t, &lse, dloss, *ignore_index, *chunk)?;
            Ok(vec![out(&dx), write_float(ot[1].dtype, &dw)])
        }
        Op::LinearCrossEntropyGrad { ignore_index, chunk } => {
            // The forward then the backward, the log-sum-exp rounded to its dtype between them
            // as the two ops' interface does: the same bits as the pair.
            let t = read_int(at[2].dtype, args[2]);
            let (loss, lse) =
                composite::linear_cross_entropy::<A>(at[0], &f(0), at[1], &f(1), &t, *ignore_index, *chunk)?;
            let sd = ot[0].dtype;
            let lse = read_float::<f64>(sd, &write_float::<f64>(sd, &lse));
            let dloss = read_float::<f64>(at[3].dtype, args[3])[0];
            let (dx, dw) = lce_backward(&t, &lse, dloss, *ignore_index, *chunk)?;
            Ok(vec![write_float::<f64>(sd, &[loss]), write_float(ot[1].dtype, &dx), write_float(ot[2].dtype, &dw)])
        }
        Op::Swiglu => one(out(&composite::swiglu::<A>(&f(0), &f(1)))),
        Op::SwigluPacked => one(out(&composite::swiglu_packed::<A>(at[0].shape.last(), &f(0)))),
        Op::SwigluPackedBackward => one(out(&composite::swiglu_packed_backward::<A>(at[0].shape.last(), &f(0), &f(1)))),
        Op::SwigluBackward => {
            let (dg, du) = composite::swiglu_backward::<A>(&f(0), &f(1), &f(2));
            Ok(vec![out(&dg), out(&du)])
        }
        Op::Attention { scale, causal, layout } => {
            let shape = attention::Dims::new(*layout, at[0].dims(), at[1].dims());
            let (o, lse) = attention::forward::<A>(&shape, &f(0), &f(1), &f(2), *scale, *causal);
            Ok(vec![out(&o), write_float(ot[1].dtype, &lse)])
        }
        Op::Fused(body) => run_fused(body, args),
        Op::RopeAt { theta, layout, scaling } => {
            let pos = read_int(at[1].dtype, args[1]);
            let inv_freq = scaling.inv_freq(*theta, layout.bhtd(at[0].dims())[3]);
            one(out(&decode::rope_at::<A>(at[0].dims(), &f(0), &pos, &inv_freq, *layout)?))
        }
        Op::CacheWrite { rope } => {
            let pos = read_int(at[2].dtype, args[2]);
            let esize = at[0].dtype.size_in_bytes();
            // With `rope`, the rows `rope_at` would give are written.
            let rotated = match rope {
                Some(r) => Some(rotate_rows::<A>(at[1], &f(1), &pos, r)?),
                None => None,
            };
            let new = rotated.as_deref().unwrap_or(args[1]);
            one(decode::cache_write(at[0].dims(), args[0], at[1].dims()[1], new, &pos, esize)?)
        }
        // Two `cache_write`s: the keys (rotated with `rope`) and the values.
        Op::CacheWriteKv { rope } => {
            let pos = read_int(at[4].dtype, args[4]);
            let esize = at[0].dtype.size_in_bytes();
            let rotated = match rope {
                Some(r) => Some(rotate_rows::<A>(at[2], &f(2), &pos, r)?),
                None => None,
            };
            let k = rotated.as_deref().unwrap_or(args[2]);
            let t = at[2].dims()[1];
            let kc = decode::cache_write(at[0].dims(), args[0], t, k, &pos, esize)?;
            Ok(vec![kc, decode::cache_write(at[1].dims(), args[1], t, args[3], &pos, esize)?])
        }
        Op::AttentionCached { scale, rope } => {
            let pos = read_int(at[3].dtype, args[3]);
            // With `rope`, the queries `rope_at` would give attend.
            let q = match rope {
                Some(r) => read_float::<A>(at[0].dtype, &rotate_rows::<A>(at[0], &f(0), &pos, r)?),
                None => f(0),
            };
            one(out(&decode::attention_cached::<A>(at[0].dims(), at[1].dims(), &q, &f(1), &f(2), &pos, *scale)?))
        }
        Op::Sample { temperature, top_k, top_p } => {
            let key = read_int(at[1].dtype, args[1]);
            let ids = decode::sample::<A>(at[0].dims()[1], &f(0), &key, *temperature, *top_k, *top_p);
            one(write_int(ot[0].dtype, &ids))
        }
        // A world of one rank: every collective gives its operand back (flattened).
        Op::Collective { world: 1, .. } => one(out(&f(0))),
        // More: the process's communicator (one process per rank).
        Op::Collective { op, world, rank } => one(collective::run(*op, *world, *rank, at[0].dtype, args[0])?),
        Op::AttentionBackward { scale, causal, layout } => {
            let g = attention::Grads::<A> {
                q: f(0),
                k: f(1),
                v: f(2),
                o: f(3),
                lse: read_float(at[4].dtype, args[4]),
                dout: f(5),
            };
            let shape = attention::Dims::new(*layout, at[0].dims(), at[1].dims());
            let (dq, dk, dv) = attention::backward(&shape, &g, *scale, *causal);
            Ok(vec![out(&dq), out(&dk), out(&dv)])
        }
    }
}

/// Runs a fused body instruction by instruction, exactly as the unfused ops would.
fn run_fused(body: &crate::ir::FusedBody, args: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
    let full = |d: DType| TensorType { dtype: d, shape: body.shape.clone() };
    let mut vals: Vec<Vec<u8>> = body
        .inputs
        .iter()
        .zip(args)
        .map(|(t, a)| if t.shape == body.shape { a.to_vec() } else { layout::broadcast(t, a, body.shape.dims()) })
        .collect();
    for ins in &body.body {
        let out_ty = full(ins.dtype);
        let bytes = match &ins.op {
            Op::Full { value, .. } => run_op(&Op::Full { value: *value, ty: out_ty.clone() }, &[], &[], &[&out_ty])?,
            op => {
                let tys: Vec<TensorType> = ins.args.iter().map(|&a| full(body.dtype(a))).collect();
                let at: Vec<&TensorType> = tys.iter().collect();
                let av: Vec<&[u8]> = ins.args.iter().map(|&a| vals[a].as_slice()).collect();
                run_op(op, &at, &av, &[&out_ty])?
            }
        };
        vals.extend(bytes);
    }
    Ok(body.outputs.iter().map(|&o| vals[o].clone()).collect())
}

/// Checks `inputs` against the trace's input types, naming the input that differs.
pub fn check_inputs(trace: &Trace, inputs: &[HostTensor]) -> Result<()> {
    if inputs.len() != trace.inputs.len() {
        return Err(Error::msg(format!(
            "trace `{}` takes {} inputs, got {}",
            trace.name,
            trace.inputs.len(),
            inputs.len()
        )));
    }
    for (inp, t) in trace.inputs.iter().zip(inputs) {
        if t.ty != *trace.ty(inp.value) || t.bytes.len() != t.ty.size_in_bytes() {
            return Err(Error::msg(format!(
                "trace `{}`: input \"{}\" must be {}, got {} ({} bytes)",
                trace.name,
                inp.name,
                trace.ty(inp.value),
                t.ty,
                t.bytes.len()
            )));
        }
    }
    Ok(())
}

/// The per-op-allocation executor: runs `trace` on `inputs` (in `trace.inputs` order), giving
/// each result its own allocation and dropping every value after its last use. Returns the
/// outputs in `trace.outputs` order.
pub fn eval(trace: &Trace, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    check_inputs(trace, inputs)?;
    let mut vals: Vec<Option<Vec<u8>>> = vec![None; trace.num_values()];
    for (inp, t) in trace.inputs.iter().zip(inputs) {
        vals[inp.value.index()] = Some(t.bytes.clone());
    }
    // Last reader of each value; outputs are kept to the end.
    let mut last = vec![usize::MAX; trace.num_values()];
    for (n, node) in trace.nodes.iter().enumerate() {
        for a in &node.args {
            last[a.index()] = n;
        }
    }
    for o in &trace.outputs {
        last[o.value.index()] = usize::MAX - 1;
    }
    for (n, node) in trace.nodes.iter().enumerate() {
        let at = trace.arg_types(node);
        let ot: Vec<&TensorType> = node.outs.iter().map(|o| trace.ty(*o)).collect();
        let args = node
            .args
            .iter()
            .map(|a| {
                vals[a.index()].as_deref().ok_or_else(|| Error::runtime(node.op.name(), format!("{a} is not live")))
            })
            .collect::<Result<Vec<&[u8]>>>()?;
        let outs = run_op(&node.op, &at, &args, &ot)
            .map_err(|e| Error::runtime(node.op.name(), format!("node {n} of `{}`: {e}", trace.name)))?;
        for (o, b) in node.outs.iter().zip(outs) {
            vals[o.index()] = Some(b);
        }
        for a in &node.args {
            if last[a.index()] == n {
                vals[a.index()] = None;
            }
        }
    }
    trace
        .outputs
        .iter()
        .map(|o| {
            let bytes = vals[o.value.index()]
                .clone()
                .ok_or_else(|| Error::runtime("eval", format!("output \"{}\" was not computed", o.name)))?;
            Ok(HostTensor { ty: trace.ty(o.value).clone(), bytes })
        })
        .collect()
}

/// Values of a training-style trace fed back: each `Update { of }` output replaces its input.
/// Returns the inputs for the next step (a convenience for CPU training loops and tests).
pub fn apply_updates(trace: &Trace, inputs: &mut [HostTensor], outputs: &[HostTensor]) {
    for (o, t) in trace.outputs.iter().zip(outputs) {
        if let OutputRole::Update { of } = o.role
            && let Some(i) = trace.inputs.iter().position(|i| i.value == of && i.role != InputRole::Input)
        {
            inputs[i] = t.clone();
        }
    }
}
