//! Recipes of the decoding ops (`rope_at`, `cache_write`, `attention_cached`, `sample`), whose
//! kernels are in `kernels/decode.cu`. All four are graph-capturable: positions and the
//! sampling key are read from device memory, so one captured decode step serves every token.
//!
//! - `cache_write` copies the cache to its result first unless the plan put them in one buffer
//!   (the planner does, `Op::may_overwrite`), then writes the new rows only.
//! - `attention_cached`: one block per query row and head; keys a tile at a time with an online
//!   softmax, accumulated in f32.
//! - `sample`: one block of 1024 threads per row; greedy is one argmax pass, top-k and top-p
//!   each a 32-step search over the logits' float keys, the draw one pass in index order.
//!
//! f64 operands, positions or keys other than i64, and head sizes over 256 have no kernel:
//! those nodes run on the host (the CPU reference), like any op without one.

use rumble_core::ir::{DType, HeadLayout, Op, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::KernelFile;
use crate::launch::{Arg, Recipe, Step};

const THREADS: u32 = 256;

/// The kernel file as NVRTC compiles it (prelude included), for compile checks.
pub fn source() -> String {
    KernelFile::Decode.source()
}

/// The recipe of a decoding op.
pub fn recipe(dev: &Device, op: &Op, at: &[&TensorType], ot: &[&TensorType]) -> Result<Recipe> {
    let unsupported = |what: &str| Err(CudaError::Unsupported(format!("{} on {what}", op.name())));
    let dt = at[0].dtype;
    let sfx = match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => return unsupported(&format!("{d} (kernels take f32, bf16, f16)")),
    };
    let ints = at.iter().skip(1).filter(|t| t.dtype.is_int());
    if let Some(t) = ints.clone().find(|t| t.dtype != DType::I64) {
        return unsupported(&format!("{} positions or keys (kernels take i64)", t.dtype));
    }
    let m = dev.module(KernelFile::Decode.name(), &source(), Options { fmad: false })?;
    let mut steps = Vec::new();
    let mut kernel = |name: &str, grid: u32, block: u32, args: Vec<Arg>| -> Result<()> {
        let name = format!("{name}_{sfx}");
        steps.push(Step::Kernel { func: m.function(&name)?, name, grid: (grid.max(1), 1, 1), block, smem: 0, args });
        Ok(())
    };
    let blocks = |n: usize| n.div_ceil(THREADS as usize).clamp(1, dev.multiprocessors.max(1) * 32) as u32;
    match op {
        Op::RopeAt { theta, layout } => {
            let x = at[0].dims();
            let (rows, d) = (at[0].numel() / x[3].max(1), x[3]);
            let seq_first = matches!(layout, HeadLayout::Bthd) as i32;
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::Out(0),
                Arg::I64(rows as i64),
                Arg::I64(x[1] as i64),
                Arg::I64(x[2] as i64),
                Arg::I32(seq_first),
                Arg::I64(d as i64),
                Arg::F64(*theta),
            ];
            kernel("rope_at", blocks(rows * d / 2), THREADS, args)?;
        }
        Op::CacheWrite => {
            let (c, n) = (at[0].dims(), at[1].dims());
            let r = c[2] * c[3];
            let mut s = vec![Step::Copy { src: 0, dst: 0, bytes: at[0].size_in_bytes() }];
            let args = vec![
                Arg::Out(0),
                Arg::In(1),
                Arg::In(2),
                Arg::I64(c[0] as i64),
                Arg::I64(c[1] as i64),
                Arg::I64(n[1] as i64),
                Arg::I64(r as i64),
                Arg::Status,
                Arg::Tag,
            ];
            kernel("cache_write", blocks(at[1].numel()), THREADS, args)?;
            s.append(&mut steps);
            steps = s;
        }
        Op::AttentionCached { scale } => {
            let (q, k) = (at[0].dims(), at[1].dims());
            if q[3] > THREADS as usize {
                return unsupported(&format!("head size {} (at most {THREADS})", q[3]));
            }
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::In(2),
                Arg::In(3),
                Arg::Out(0),
                Arg::I64(q[1] as i64),
                Arg::I64(q[2] as i64),
                Arg::I64(k[1] as i64),
                Arg::I64(k[2] as i64),
                Arg::I64(q[3] as i64),
                Arg::F64(*scale),
            ];
            kernel("attention_cached", (q[0] * q[1] * q[2]) as u32, THREADS, args)?;
        }
        Op::Sample { temperature, top_k, top_p } => {
            let (rows, v) = (at[0].dims()[0], at[0].dims()[1]);
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::Out(0),
                Arg::I64(v as i64),
                Arg::F64(*temperature),
                Arg::I64(*top_k as i64),
                Arg::F64(*top_p),
            ];
            kernel("sample", rows as u32, 1024, args)?;
        }
        _ => return unsupported("this op (not a decoding op)"),
    }
    let _ = ot;
    Ok(Recipe { op: op.name(), steps, scratch: 0, node_scratch: 0 })
}
