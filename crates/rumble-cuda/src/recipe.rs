//! Op -> [`Recipe`]: which kernels a node runs, with what launch shape and scalar arguments.
//! Every op of `rumble_core::ir::Op` has an arm here; kernel names derive from op names and
//! dtypes (`rms_norm_bf16`).

use rumble_core::ir::{DType, HeadLayout, Op, ReduceOp, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::fused::Fused;
use crate::launch::{Arg, Recipe, Step};
use crate::matmul::MatmulKey;

pub const PRELUDE: &str = include_str!("kernels/prelude.cuh");
const LAYOUT: &str = include_str!("kernels/layout.cu");
const REDUCE: &str = include_str!("kernels/reduce.cu");
const ROWS: &str = include_str!("kernels/rows.cu");
const ATTENTION: &str = include_str!("kernels/attention.cu");

const MAX_RANK: usize = 8;
const ATTN_THREADS: u32 = 128;
const ATTN_MAX_HEAD: usize = 128 * 8;

/// `f32`, `bf16`, ... as kernel-name suffixes.
fn sfx(d: DType) -> &'static str {
    d.name()
}

fn align(n: usize) -> usize {
    n.div_ceil(256) * 256
}

/// The fixed kernel files, each as the full source NVRTC compiles (prelude included).
pub fn fixed_sources() -> Vec<(&'static str, String)> {
    [("layout", LAYOUT), ("reduce", REDUCE), ("rows", ROWS), ("attention", ATTENTION)]
        .into_iter()
        .map(|(n, body)| (n, format!("{PRELUDE}\n{body}")))
        .chain(std::iter::once(("decode", crate::decode::source())))
        .collect()
}

/// The kernel named `name` of one of the fixed kernel files.
fn kernel(dev: &Device, file: &'static str, name: &str) -> Result<crate::compile::Func> {
    let (src, body) = match file {
        "layout" => ("layout", LAYOUT),
        "reduce" => ("reduce", REDUCE),
        "rows" => ("rows", ROWS),
        _ => ("attention", ATTENTION),
    };
    let m = dev.module(src, &format!("{PRELUDE}\n{body}"), Options { fmad: false })?;
    m.function(name)
}

/// Strides struct (see prelude.cuh) as 8-byte words.
fn strides_blob(dims: &[usize], inp: &[i64], out: &[i64]) -> Result<Vec<u64>> {
    if dims.len() > MAX_RANK {
        return Err(CudaError::Unsupported(format!("layout ops of rank {} (at most {MAX_RANK})", dims.len())));
    }
    let mut w = vec![0u64; 3 * MAX_RANK + 1];
    for (i, &d) in dims.iter().enumerate() {
        w[i] = d as u64;
        w[MAX_RANK + i] = inp[i] as u64;
        w[2 * MAX_RANK + i] = out[i] as u64;
    }
    w[3 * MAX_RANK] = dims.len() as u64;
    Ok(w)
}

fn contiguous(dims: &[usize]) -> Vec<i64> {
    rumble_core::Shape::new(dims.to_vec()).strides().into_iter().map(|s| s as i64).collect()
}

fn grid_for(dev: &Device, n: usize, block: u32) -> (u32, u32, u32) {
    let blocks = n.div_ceil(block as usize).clamp(1, dev.multiprocessors.max(1) * 32);
    (blocks as u32, 1, 1)
}

fn rows_grid(dev: &Device, rows: usize) -> (u32, u32, u32) {
    (rows.clamp(1, dev.multiprocessors.max(1) * 64) as u32, 1, 1)
}

struct Builder<'a> {
    dev: &'a Device,
    op: &'static str,
    steps: Vec<Step>,
    scratch: usize,
    node: usize,
}

impl Builder<'_> {
    fn k(
        &mut self,
        file: &'static str,
        name: String,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: Vec<Arg>,
    ) -> Result<()> {
        let func = kernel(self.dev, file, &name)?;
        self.steps.push(Step::Kernel { func, name, grid, block, smem, args });
        Ok(())
    }
    /// Reserves `bytes` of the node's own scratch range and returns its offset.
    fn node(&mut self, bytes: usize) -> usize {
        let off = self.node;
        self.node += align(bytes);
        off
    }
    /// Reserves `bytes` of scratch and returns its offset.
    fn scratch(&mut self, bytes: usize) -> usize {
        let off = self.scratch;
        self.scratch += align(bytes);
        off
    }
}

/// Prepares the work of `op` on operands of types `at` giving outputs of types `ot`,
/// compiling its kernels now (never during graph capture).
///
/// Ops named by [`Device::set_host_ops`] (or `RUMBLE_HOST_OPS`) and ops with no CUDA kernel
/// for these types become host nodes ([`Step::Host`]: the CPU reference between device work;
/// the latter with a note on stderr, once per op and types).
pub fn prepare(dev: &Device, op: &Op, at: &[&TensorType], ot: &[&TensorType]) -> Result<Recipe> {
    let host = || Recipe {
        op: op.name(),
        steps: vec![Step::Host {
            op: Box::new(op.clone()),
            args: at.iter().map(|t| (*t).clone()).collect(),
            outs: ot.iter().map(|t| (*t).clone()).collect(),
        }],
        scratch: 0,
        node_scratch: 0,
    };
    if dev.is_host_op(op.name()) {
        return Ok(host());
    }
    match prepare_device(dev, op, at, ot) {
        Err(CudaError::Unsupported(why)) => {
            static NOTED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
            if let Ok(mut n) = NOTED.lock()
                && !n.contains(&why)
            {
                eprintln!("rumble: no CUDA kernel for {why}: this node runs on the host (CPU reference)");
                n.push(why);
            }
            Ok(host())
        }
        other => other,
    }
}

/// [`prepare`] on the device only.
fn prepare_device(dev: &Device, op: &Op, at: &[&TensorType], ot: &[&TensorType]) -> Result<Recipe> {
    let mut b = Builder { dev, op: op.name(), steps: Vec::new(), scratch: 0, node: 0 };
    let out_n = ot.first().map(|t| t.numel()).unwrap_or(0);
    let dt = at.first().map(|t| t.dtype).unwrap_or(ot[0].dtype);
    let unsupported = |what: String| CudaError::Unsupported(format!("{} on {what}", op.name()));
    match op {
        Op::Full { .. }
        | Op::Unary(_)
        | Op::PowScalar { .. }
        | Op::AddScalar { .. }
        | Op::MulScalar { .. }
        | Op::Cast { .. }
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Where
        | Op::Swiglu
        | Op::SwigluBackward => {
            let f = Fused::of_op(op, at, ot).ok_or_else(|| unsupported("this op".into()))?;
            return fused_recipe(dev, op.name(), &f, out_n);
        }
        Op::Fused(body) => return fused_recipe(dev, op.name(), &Fused::of_body(body)?, out_n),
        Op::RopeAt { .. } | Op::CacheWrite | Op::AttentionCached { .. } | Op::Sample { .. } => {
            return crate::decode::recipe(dev, op, at, ot);
        }
        Op::LinearCrossEntropy { ignore_index, chunk } => linear_ce(&mut b, at, *ignore_index, *chunk, false)?,
        Op::LinearCrossEntropyBackward { ignore_index, chunk } => linear_ce(&mut b, at, *ignore_index, *chunk, true)?,
        Op::Reshape { .. } => b.steps.push(Step::Copy { src: 0, dst: 0, bytes: at[0].size_in_bytes() }),
        Op::Permute { perm } => {
            let ins = contiguous(at[0].dims());
            let inp: Vec<i64> = perm.iter().map(|&p| ins[p]).collect();
            copy(&mut b, at[0].dtype, ot[0].dims(), &inp, &contiguous(ot[0].dims()), 0, 0, 0)?;
        }
        Op::Broadcast { shape } => {
            let (x, od) = (at[0].dims(), shape.dims());
            let xs = contiguous(x);
            let off = od.len() - x.len();
            let inp: Vec<i64> =
                (0..od.len()).map(|i| if i < off || x[i - off] == 1 { 0 } else { xs[i - off] }).collect();
            copy(&mut b, at[0].dtype, od, &inp, &contiguous(od), 0, 0, 0)?;
        }
        Op::Slice { axis, start, .. } => {
            let xs = contiguous(at[0].dims());
            let off = *start as i64 * xs[*axis];
            copy(&mut b, at[0].dtype, ot[0].dims(), &xs, &contiguous(ot[0].dims()), 0, off, 0)?;
        }
        Op::Concat { axis } => {
            let os = contiguous(ot[0].dims());
            let mut at_axis = 0i64;
            for (i, t) in at.iter().enumerate() {
                copy(&mut b, t.dtype, t.dims(), &contiguous(t.dims()), &os, i, 0, at_axis * os[*axis])?;
                at_axis += t.dims()[*axis] as i64;
            }
        }
        Op::Reduce { op: r, axes, .. } => reduce(&mut b, *r, axes, at[0], out_n)?,
        Op::Gather => {
            let (rows, d) = (at[0].dims()[0], at[0].dims()[1]);
            let n = at[1].numel();
            let name = format!("gather_{}_{}", at[0].dtype.size_in_bytes(), sfx(at[1].dtype));
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::Out(0),
                Arg::I64(n as i64),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
                Arg::Status,
                Arg::Tag,
            ];
            b.k("layout", name, grid_for(dev, n * d, 256), 256, 0, args)?;
        }
        Op::ScatterAdd { rows } => {
            let n = at[0].numel();
            let d = at[1].shape.last();
            if n > i32::MAX as usize {
                return Err(CudaError::Unsupported(format!(
                    "scatter_add over {n} positions (the CUDA kernel links positions with 32-bit ints)"
                )));
            }
            b.steps.push(Step::ZeroOut { out: 0, bytes: ot[0].size_in_bytes() });
            if n > 0 {
                let links = b.scratch(n * 8);
                let args = vec![
                    Arg::In(0),
                    Arg::Scratch(links),
                    Arg::I64(n as i64),
                    Arg::I64(*rows as i64),
                    Arg::Status,
                    Arg::Tag,
                ];
                // One warp per position.
                b.k("layout", format!("scatter_links_{}", sfx(at[0].dtype)), grid_for(dev, n * 32, 256), 256, 0, args)?;
                let name = format!("scatter_sum_{}_{}", sfx(at[1].dtype), sfx(at[0].dtype));
                let args = vec![
                    Arg::In(0),
                    Arg::Scratch(links),
                    Arg::In(1),
                    Arg::Out(0),
                    Arg::I64(n as i64),
                    Arg::I64(d as i64),
                ];
                b.k("layout", name, rows_grid(dev, n), 256, 0, args)?;
            }
        }
        Op::Matmul { ta, tb } => {
            let key = MatmulKey::new(at[0], at[1], *ta, *tb);
            if key.k == 0 {
                b.steps.push(Step::ZeroOut { out: 0, bytes: ot[0].size_in_bytes() });
            } else if out_n > 0 {
                let ws = dev.matmul_workspace(&key)?;
                b.scratch = ws;
                b.steps.push(Step::Matmul {
                    key,
                    a: Arg::In(0),
                    b: Arg::In(1),
                    c: Arg::Out(0),
                    ws: 0,
                    ws_bytes: ws,
                    beta: 0.0,
                });
            }
        }
        Op::RmsNorm { eps } => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            let args =
                vec![Arg::In(0), Arg::In(1), Arg::Out(0), Arg::I64(rows as i64), Arg::I64(d as i64), Arg::F64(*eps)];
            b.k("rows", format!("rms_norm_{}", sfx(dt)), rows_grid(dev, rows), 256, 0, args)?;
        }
        Op::RmsNormBackward { eps } => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            let acc = if dt == DType::F64 { 8 } else { 4 };
            let groups = rows.clamp(1, 64);
            let rstd = b.scratch(rows * acc);
            let part = b.scratch(groups * d * acc);
            let s = sfx(dt);
            let (r, dd) = (Arg::I64(rows as i64), Arg::I64(d as i64));
            b.k(
                "rows",
                format!("rms_norm_backward_dx_{s}"),
                rows_grid(dev, rows),
                256,
                0,
                vec![
                    Arg::In(0),
                    Arg::In(1),
                    Arg::In(2),
                    Arg::Out(0),
                    Arg::Scratch(rstd),
                    r.clone(),
                    dd.clone(),
                    Arg::F64(*eps),
                ],
            )?;
            let cols = d.div_ceil(128) as u32;
            b.k(
                "rows",
                format!("rms_norm_backward_dw_part_{s}"),
                (cols, groups as u32, 1),
                128,
                0,
                vec![Arg::In(0), Arg::In(2), Arg::Scratch(rstd), Arg::Scratch(part), r, dd.clone()],
            )?;
            b.k(
                "rows",
                format!("rms_norm_backward_dw_sum_{s}"),
                (cols, 1, 1),
                128,
                0,
                vec![Arg::Scratch(part), Arg::Out(1), Arg::I64(groups as i64), dd],
            )?;
        }
        Op::Rope { theta, inverse, layout } => {
            let [_, h, t, d] = layout.bhtd(at[0].dims());
            // Rows of D between consecutive positions: 1 in [B, H, T, D], H in [B, T, H, D].
            let per_pos = match layout {
                HeadLayout::Bhtd => 1,
                HeadLayout::Bthd => h,
            };
            let rows = at[0].numel() / d.max(1);
            let half = d / 2;
            if rows * half > 0 {
                // (cos, sign * sin) per position and frequency, in the accumulation type.
                let acc = if dt == DType::F64 { 8 } else { 4 };
                let tab = b.scratch(t * half * 2 * acc);
                let sign = if *inverse { -1.0 } else { 1.0 };
                let args =
                    vec![Arg::Scratch(tab), Arg::I64(t as i64), Arg::I64(d as i64), Arg::F64(*theta), Arg::F64(sign)];
                b.k("rows", format!("rope_table_{}", sfx(dt)), grid_for(dev, t * half, 256), 256, 0, args)?;
                let args = vec![
                    Arg::In(0),
                    Arg::Out(0),
                    Arg::Scratch(tab),
                    Arg::I64(rows as i64),
                    Arg::I64(t as i64),
                    Arg::I64(d as i64),
                    Arg::I64(per_pos as i64),
                ];
                b.k("rows", format!("rope_{}", sfx(dt)), grid_for(dev, rows * half, 256), 256, 0, args)?;
            }
        }
        Op::SwigluPacked | Op::SwigluPackedBackward => {
            let f = at[0].shape.last() / 2;
            let rows = at[0].numel() / (2 * f).max(1);
            if rows * f > 0 {
                let (name, mut args) = if matches!(op, Op::SwigluPacked) {
                    ("swiglu_packed", vec![Arg::In(0), Arg::Out(0)])
                } else {
                    ("swiglu_packed_backward", vec![Arg::In(0), Arg::In(1), Arg::Out(0)])
                };
                args.extend([Arg::I64(rows as i64), Arg::I64(f as i64)]);
                b.k("rows", format!("{name}_{}", sfx(dt)), grid_for(dev, rows * f, 256), 256, 0, args)?;
            }
        }
        Op::Softmax | Op::LogSoftmax => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            let log = matches!(op, Op::LogSoftmax) as i32;
            let args = vec![Arg::In(0), Arg::Out(0), Arg::I64(rows as i64), Arg::I64(d as i64), Arg::I32(log)];
            b.k("rows", format!("softmax_{}", sfx(dt)), rows_grid(dev, rows), 256, 0, args)?;
        }
        Op::SoftmaxBackward | Op::LogSoftmaxBackward => {
            let d = at[0].shape.last();
            let rows = at[0].numel() / d.max(1);
            let log = matches!(op, Op::LogSoftmaxBackward) as i32;
            let args =
                vec![Arg::In(0), Arg::In(1), Arg::Out(0), Arg::I64(rows as i64), Arg::I64(d as i64), Arg::I32(log)];
            b.k("rows", format!("softmax_backward_{}", sfx(dt)), rows_grid(dev, rows), 256, 0, args)?;
        }
        Op::CrossEntropy { ignore_index } => {
            let (rows, v) = (at[0].dims()[0], at[0].dims()[1]);
            let loss = b.scratch(rows * 8);
            let valid = b.scratch(rows * 4);
            let name = format!("cross_entropy_rows_{}_{}", sfx(dt), sfx(at[1].dtype));
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::Scratch(loss),
                Arg::Scratch(valid),
                Arg::I64(rows as i64),
                Arg::I64(v as i64),
                Arg::I64(*ignore_index),
                Arg::Status,
                Arg::Tag,
            ];
            b.k("rows", name, rows_grid(dev, rows), 256, 0, args)?;
            let args = vec![Arg::Scratch(loss), Arg::Scratch(valid), Arg::Out(0), Arg::I64(rows as i64)];
            let stat = if dt == DType::F64 { "f64" } else { "f32" };
            b.k("rows", format!("cross_entropy_mean_{stat}"), (1, 1, 1), 256, 0, args)?;
        }
        Op::CrossEntropyBackward { ignore_index } => {
            let (rows, v) = (at[0].dims()[0], at[0].dims()[1]);
            let count = b.scratch(4);
            let args = vec![Arg::In(1), Arg::Scratch(count), Arg::I64(rows as i64), Arg::I64(*ignore_index)];
            b.k("rows", format!("cross_entropy_count_{}", sfx(at[1].dtype)), (1, 1, 1), 256, 0, args)?;
            let name = format!("cross_entropy_backward_{}_{}", sfx(dt), sfx(at[1].dtype));
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::In(2),
                Arg::Scratch(count),
                Arg::Out(0),
                Arg::I64(rows as i64),
                Arg::I64(v as i64),
                Arg::I64(*ignore_index),
                Arg::Status,
                Arg::Tag,
            ];
            b.k("rows", name, rows_grid(dev, rows), 256, 0, args)?;
        }
        Op::Attention { scale, causal, layout } | Op::AttentionBackward { scale, causal, layout } => {
            // The tiled kernels where `flash::choose` takes them; the per-row kernels below otherwise.
            if let Some(r) = crate::flash::recipe(dev, op, at) {
                return r;
            }
            let ([qb, hq, t, d], [_, hkv, s, _]) = (layout.bhtd(at[0].dims()), layout.bhtd(at[1].dims()));
            if d > ATTN_MAX_HEAD {
                return Err(unsupported(format!("head size {d} (at most {ATTN_MAX_HEAD})")));
            }
            let q = [qb, hq, t, d];
            let k = [qb, hkv, s, d];
            let dims = crate::flash::dims_blob(*layout, [qb, hq, hkv, t, s, d]);
            let acc = if dt == DType::F64 { 8 } else { 4 };
            let smem = ((2 * d + 2 * ATTN_THREADS as usize) * acc) as u32;
            let (sc, ca) = (Arg::F64(*scale), Arg::I32(*causal as i32));
            let s = sfx(dt);
            let q_rows = q[0] * q[1] * q[2];
            if matches!(op, Op::Attention { .. }) {
                let args = vec![Arg::In(0), Arg::In(1), Arg::In(2), Arg::Out(0), Arg::Out(1), dims, sc, ca];
                b.k("attention", format!("attention_{s}"), rows_grid(dev, q_rows), ATTN_THREADS, smem, args)?;
            } else {
                let delta = b.scratch(q_rows * 8);
                let args = vec![
                    Arg::In(0),
                    Arg::In(1),
                    Arg::In(2),
                    Arg::In(3),
                    Arg::In(4),
                    Arg::In(5),
                    Arg::Out(0),
                    Arg::Scratch(delta),
                    dims.clone(),
                    sc.clone(),
                    ca.clone(),
                ];
                b.k(
                    "attention",
                    format!("attention_backward_dq_{s}"),
                    rows_grid(dev, q_rows),
                    ATTN_THREADS,
                    smem,
                    args,
                )?;
                let kv_rows = k[0] * k[1] * k[2];
                let args = vec![
                    Arg::In(0),
                    Arg::In(1),
                    Arg::In(2),
                    Arg::In(4),
                    Arg::In(5),
                    Arg::Scratch(delta),
                    Arg::Out(1),
                    Arg::Out(2),
                    dims,
                    sc,
                    ca,
                ];
                b.k(
                    "attention",
                    format!("attention_backward_dkdv_{s}"),
                    rows_grid(dev, kv_rows),
                    ATTN_THREADS,
                    smem,
                    args,
                )?;
            }
        }
    }
    let want = op.scratch_bytes(at);
    if b.node > want {
        return Err(CudaError::usage(format!(
            "{}: the kernels need {} bytes of node scratch, Op::scratch_bytes plans {want}",
            b.op, b.node
        )));
    }
    Ok(Recipe { op: b.op, steps: b.steps, scratch: b.scratch, node_scratch: b.node })
}

/// The recipe of an elementwise expression (one kernel).
pub fn fused_recipe(dev: &Device, op: &'static str, f: &Fused, n: usize) -> Result<Recipe> {
    let (src, name) = f.source(PRELUDE)?;
    let m = dev.module(&name, &src, Options { fmad: false })?;
    let func = m.function(&name)?;
    let mut args: Vec<Arg> = (0..f.inputs.len()).map(Arg::In).collect();
    args.extend((0..f.outputs.len()).map(Arg::Out));
    for ix in &f.scalar_inputs {
        if let crate::fused::Indexing::Strided(w) = ix {
            args.push(Arg::Blob(w.clone()));
        }
    }
    args.extend(f.consts().into_iter().map(Arg::F64));
    args.extend([Arg::I64(n as i64), Arg::Status, Arg::Tag]);
    let steps = if n == 0 {
        vec![]
    } else {
        vec![Step::Kernel { func, name, grid: grid_for(dev, n, 256), block: 256, smem: 0, args }]
    };
    Ok(Recipe { op, steps, scratch: 0, node_scratch: 0 })
}

/// A strided copy's index space made simpler without changing which element goes where: axes
/// of extent 1 dropped, and neighbouring axes merged where both the input and the output step
/// over them as one (`in[k] == in[k+1] * dims[k+1]`, the same for `out`).
fn simplify_copy(dims: &[usize], inp: &[i64], out: &[i64]) -> (Vec<usize>, Vec<i64>, Vec<i64>) {
    let (mut d, mut i, mut o): (Vec<usize>, Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..dims.len() {
        if dims[k] == 1 {
            continue;
        }
        if let (Some(&li), Some(&lo)) = (i.last(), o.last())
            && li == inp[k] * dims[k] as i64
            && lo == out[k] * dims[k] as i64
        {
            *d.last_mut().unwrap() *= dims[k];
            *i.last_mut().unwrap() = inp[k];
            *o.last_mut().unwrap() = out[k];
            continue;
        }
        d.push(dims[k]);
        i.push(inp[k]);
        o.push(out[k]);
    }
    (d, i, o)
}

/// True when every element index and offset of the copy fits in 31 bits (the `copy32_*`
/// kernels' unsigned arithmetic; strides and offsets are never negative here, but a negative
/// one keeps the 64-bit kernel).
fn copy_fits_i32(dims: &[usize], inp: &[i64], out: &[i64], in_off: i64, out_off: i64) -> bool {
    let n: usize = dims.iter().product();
    let last = |st: &[i64], off: i64| dims.iter().zip(st).map(|(&d, &s)| (d as i64 - 1) * s).sum::<i64>() + off;
    let non_negative = inp.iter().chain(out).chain([&in_off, &out_off]).all(|&s| s >= 0);
    non_negative && n < i32::MAX as usize && last(inp, in_off) < i32::MAX as i64 && last(out, out_off) < i32::MAX as i64
}

#[allow(clippy::too_many_arguments)]
fn copy(
    b: &mut Builder,
    dt: DType,
    dims: &[usize],
    inp: &[i64],
    out: &[i64],
    arg: usize,
    in_off: i64,
    out_off: i64,
) -> Result<()> {
    let n: usize = dims.iter().product();
    if n == 0 {
        return Ok(());
    }
    let (dims, inp, out) = simplify_copy(dims, inp, out);
    let blob = strides_blob(&dims, &inp, &out)?;
    let args =
        vec![Arg::In(arg), Arg::Out(0), Arg::Blob(blob), Arg::I64(n as i64), Arg::I64(in_off), Arg::I64(out_off)];
    let grid = grid_for(b.dev, n, 256);
    let kind = if copy_fits_i32(&dims, &inp, &out, in_off, out_off) { "copy32" } else { "copy" };
    b.k("layout", format!("{kind}_{}", dt.size_in_bytes()), grid, 256, 0, args)
}

fn reduce(b: &mut Builder, r: ReduceOp, axes: &[usize], x: &TensorType, n_out: usize) -> Result<()> {
    let xs = contiguous(x.dims());
    let (mut kd, mut ks, mut rd, mut rs) = (vec![], vec![], vec![], vec![]);
    for (i, &d) in x.dims().iter().enumerate() {
        if axes.contains(&i) {
            rd.push(d);
            rs.push(xs[i]);
        } else {
            kd.push(d);
            ks.push(xs[i]);
        }
    }
    let n_red: usize = rd.iter().product();
    let kept = strides_blob(&kd, &ks, &ks)?;
    let red = strides_blob(&rd, &rs, &rs)?;
    let block = (n_red.next_power_of_two() as u32).clamp(32, 256);
    let sms = b.dev.multiprocessors.max(1);
    let grid = (n_out.clamp(1, sms * 64) as u32, 1, 1);
    if n_out == 0 {
        return Ok(());
    }
    let mode = match r {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
    };
    // The reduced axes are the trailing ones: element r of an output's range is at base + r.
    let contig = axes.iter().all(|&a| a >= x.rank() - axes.len());
    // Few outputs, each over many elements: split each range into fixed pieces so that the
    // whole GPU works on it (one block per output would leave all but a few SMs idle).
    let pieces = (sms * 8).div_ceil(n_out);
    if x.dtype.is_float() && n_red >= 1 << 16 && pieces > 1 {
        let chunk = n_red.div_ceil(pieces).max(1 << 14);
        let parts = n_red.div_ceil(chunk);
        let acc = rumble_core::ir::stat_dtype(x.dtype).size_in_bytes(); // Acc<T> of the kernels
        let part = b.scratch(n_out * parts * acc);
        let sfx = sfx(x.dtype);
        let args = vec![
            Arg::In(0),
            Arg::Scratch(part),
            Arg::Blob(kept),
            Arg::Blob(red),
            Arg::I64(n_out as i64),
            Arg::I64(n_red as i64),
            Arg::I64(parts as i64),
            Arg::I64(chunk as i64),
            Arg::I32(mode),
            Arg::I32(contig as i32),
        ];
        b.k("reduce", format!("reduce_part_{sfx}"), ((n_out * parts).min(sms * 64) as u32, 1, 1), 256, 0, args)?;
        let args = vec![
            Arg::Scratch(part),
            Arg::Out(0),
            Arg::I64(n_out as i64),
            Arg::I64(n_red as i64),
            Arg::I64(parts as i64),
            Arg::I32(mode),
        ];
        return b.k(
            "reduce",
            format!("reduce_fin_{sfx}"),
            (n_out.div_ceil(256).min(sms * 8) as u32, 1, 1),
            256,
            0,
            args,
        );
    }
    let mut args =
        vec![Arg::In(0), Arg::Out(0), Arg::Blob(kept), Arg::Blob(red), Arg::I64(n_out as i64), Arg::I64(n_red as i64)];
    let name = if x.dtype.is_float() {
        args.push(Arg::I32(mode));
        args.push(Arg::I32(contig as i32));
        format!("reduce_{}", sfx(x.dtype))
    } else {
        format!("reduce_max_{}", sfx(x.dtype))
    };
    b.k("reduce", name, grid, block, 0, args)
}

/// `linear_cross_entropy` (and its backward) a chunk of rows at a time: each chunk's logits
/// `x_c @ w^T` (f32, f64 for f64) go to the node's scratch through cuBLASLt; each row's
/// log-sum-exp is computed in pieces over several blocks (`ce_split_*` in rows.cu), so a chunk
/// of ~100 rows of a 150k vocabulary still fills the GPU. The backward recomputes the chunk's
/// logits, writes their gradient in the operand dtype and multiplies it back
/// (`dx_c = dl @ w`, `dw += dl^T @ x_c`). Workspace: the matmuls' and the pieces' statistics.
fn linear_ce(b: &mut Builder, at: &[&TensorType], ignore: i64, chunk: usize, backward: bool) -> Result<()> {
    let (x, w, tg) = (at[0], at[1], at[2]);
    let (n, c, v) = (x.dims()[0], x.dims()[1], w.dims()[0]);
    let t = x.dtype;
    let s = rumble_core::ir::stat_dtype(t);
    let (tsz, ssz, isz) = (t.size_in_bytes(), s.size_in_bytes(), tg.dtype.size_in_bytes());
    let chunk = chunk.clamp(1, n.max(1));
    let starts: Vec<usize> = (0..n).step_by(chunk).collect();
    // Every matmul shape first: the workspace is the most any of them needs.
    let key = |dtype: DType, out: DType, ta: bool, tb: bool, m: usize, nn: usize, k: usize| crate::matmul::MatmulKey {
        dtype,
        out,
        ta,
        tb,
        batch: 1,
        m: m as u64,
        n: nn as u64,
        k: k as u64,
    };
    let mut ws = 0;
    for &r0 in &starts {
        let rows = chunk.min(n - r0);
        ws = ws.max(b.dev.matmul_workspace(&key(t, s, false, true, rows, v, c))?);
        if backward {
            ws = ws.max(b.dev.matmul_workspace(&key(t, t, false, false, rows, c, v))?);
            ws = ws.max(b.dev.matmul_workspace(&key(t, t, true, false, v, c, rows))?);
        }
    }
    b.scratch(ws);
    // Each row's log-sum-exp in `splits` pieces (ce_split_* in rows.cu): enough blocks to fill
    // the GPU even when a chunk has fewer rows than there are SMs.
    let sms = b.dev.multiprocessors.max(1);
    let splits = (sms * 8).div_ceil(chunk).clamp(1, v.div_ceil(4096).max(1));
    let span = v.div_ceil(splits).max(1);
    let stats = b.scratch(chunk * splits * 2 * ssz);
    let piece_grid = |rows: usize| ((rows * splits).clamp(1, sms * 64) as u32, 1, 1);
    // The chunk buffers live in the node's own scratch range (Op::scratch_bytes lays it out
    // the same way), so the planner overlaps them with buffers dead at this node.
    let logits = b.node(chunk * v * ssz);
    let s_name = sfx(s);
    let i_name = sfx(tg.dtype);
    let stats_args = |rows: usize| {
        vec![
            Arg::Node(logits),
            Arg::Scratch(stats),
            Arg::I64(rows as i64),
            Arg::I64(v as i64),
            Arg::I64(splits as i64),
            Arg::I64(span as i64),
        ]
    };
    if !backward {
        let loss = b.node(n * 8);
        let valid = b.node(n * 4);
        for &r0 in &starts {
            let rows = chunk.min(n - r0);
            let k = key(t, s, false, true, rows, v, c);
            b.steps.push(Step::Matmul {
                key: k,
                a: Arg::InAt(0, r0 * c * tsz),
                b: Arg::In(1),
                c: Arg::Node(logits),
                ws: 0,
                ws_bytes: ws,
                beta: 0.0,
            });
            b.k("rows", format!("ce_split_stats_{s_name}"), piece_grid(rows), 256, 0, stats_args(rows))?;
            let args = vec![
                Arg::Node(logits),
                Arg::InAt(2, r0 * isz),
                Arg::Scratch(stats),
                Arg::Node(loss + r0 * 8),
                Arg::Node(valid + r0 * 4),
                Arg::I64(rows as i64),
                Arg::I64(v as i64),
                Arg::I64(splits as i64),
                Arg::I64(ignore),
                Arg::Status,
                Arg::Tag,
            ];
            b.k("rows", format!("ce_split_rows_{s_name}_{i_name}"), (rows.div_ceil(128) as u32, 1, 1), 128, 0, args)?;
        }
        let args = vec![Arg::Node(loss), Arg::Node(valid), Arg::Out(0), Arg::I64(n as i64)];
        return b.k("rows", format!("cross_entropy_mean_{s_name}"), (1, 1, 1), 256, 0, args);
    }
    // The logit gradient, written straight in the operand dtype (its slot is sized for the
    // f32 logits, so it also fits them).
    let dl = b.node(chunk * v * ssz);
    let count = b.node(4);
    let args = vec![Arg::In(2), Arg::Node(count), Arg::I64(n as i64), Arg::I64(ignore)];
    b.k("rows", format!("cross_entropy_count_{i_name}"), (1, 1, 1), 256, 0, args)?;
    if n == 0 {
        b.steps.push(Step::ZeroOut { out: 1, bytes: v * c * tsz });
    }
    for &r0 in &starts {
        let rows = chunk.min(n - r0);
        let k = key(t, s, false, true, rows, v, c);
        b.steps.push(Step::Matmul {
            key: k,
            a: Arg::InAt(0, r0 * c * tsz),
            b: Arg::In(1),
            c: Arg::Node(logits),
            ws: 0,
            ws_bytes: ws,
            beta: 0.0,
        });
        b.k("rows", format!("ce_split_stats_{s_name}"), piece_grid(rows), 256, 0, stats_args(rows))?;
        let args = vec![
            Arg::Node(logits),
            Arg::InAt(2, r0 * isz),
            Arg::Scratch(stats),
            Arg::In(3),
            Arg::Node(count),
            Arg::Node(dl),
            Arg::I64(rows as i64),
            Arg::I64(v as i64),
            Arg::I64(splits as i64),
            Arg::I64(span as i64),
            Arg::I64(ignore),
            Arg::Status,
            Arg::Tag,
        ];
        b.k("rows", format!("ce_split_backward_{s_name}_{}_{i_name}", sfx(t)), piece_grid(rows), 256, 0, args)?;
        let kx = key(t, t, false, false, rows, c, v);
        b.steps.push(Step::Matmul {
            key: kx,
            a: Arg::Node(dl),
            b: Arg::In(1),
            c: Arg::OutAt(0, r0 * c * tsz),
            ws: 0,
            ws_bytes: ws,
            beta: 0.0,
        });
        let kw = key(t, t, true, false, v, c, rows);
        let beta = if r0 == 0 { 0.0 } else { 1.0 };
        b.steps.push(Step::Matmul {
            key: kw,
            a: Arg::Node(dl),
            b: Arg::InAt(0, r0 * c * tsz),
            c: Arg::Out(1),
            ws: 0,
            ws_bytes: ws,
            beta,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element's (input, output) offset pair of a strided copy, in index order.
    fn pairs(dims: &[usize], inp: &[i64], out: &[i64]) -> Vec<(i64, i64)> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|mut e| {
                let (mut a, mut b) = (0, 0);
                for k in (0..dims.len()).rev() {
                    let idx = (e % dims[k]) as i64;
                    e /= dims[k];
                    a += idx * inp[k];
                    b += idx * out[k];
                }
                (a, b)
            })
            .collect()
    }

    #[test]
    fn simplified_copies_move_the_same_elements() {
        // [1, T, H, D] -> [1, H, T, D] (attention's head split), a broadcast, a slice, a
        // transpose, and a copy that is contiguous throughout.
        type Case = (Vec<usize>, Vec<i64>, Vec<i64>, usize);
        let cases: Vec<Case> = vec![
            (vec![1, 7, 3, 5], vec![105, 5, 35, 1], vec![105, 15, 5, 1], 3),
            (vec![4, 1, 6, 5], vec![0, 0, 5, 1], vec![30, 30, 5, 1], 2),
            (vec![3, 4, 5], vec![40, 5, 1], vec![20, 5, 1], 2),
            (vec![6, 9], vec![1, 6], vec![9, 1], 2),
            (vec![2, 3, 4], vec![12, 4, 1], vec![12, 4, 1], 1),
        ];
        for (dims, inp, out, rank) in cases {
            let (d, i, o) = simplify_copy(&dims, &inp, &out);
            assert_eq!(d.len(), rank, "{dims:?}: {d:?}");
            assert_eq!(pairs(&d, &i, &o), pairs(&dims, &inp, &out), "{dims:?}");
        }
        assert!(copy_fits_i32(&[1 << 20, 1024], &[1024, 1], &[1024, 1], 0, 0));
        assert!(!copy_fits_i32(&[1 << 21, 1024], &[1024, 1], &[1024, 1], 0, 0));
        assert!(!copy_fits_i32(&[1 << 10, 1024], &[1 << 22, 1], &[1024, 1], 0, 0));
    }
}
