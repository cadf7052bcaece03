//! Op -> [`Recipe`]: which kernels a node runs, with what launch shape and scalar arguments.
//! Every op of `rumble_core::ir::Op` has an arm here; the recipes of each family of fixed
//! kernels sit in their own module ([`layout`], [`reduce`], [`rows`], [`attention`], each for
//! the kernel file of its name, `kernels::KernelFile`), elementwise ops and fused bodies go to
//! generated kernels (`crate::fused`), matmuls to cuBLASLt, attention first to the flash kernels
//! (`crate::flash`). Kernel names derive from op names and dtypes (`rms_norm_bf16`).

mod attention;
mod layout;
mod reduce;
mod rows;

pub(crate) use rows::rope_freqs;

use rumble_core::ir::{Addend, DType, Op, Prologue, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::fused::Fused;
use crate::kernels::{KernelFile, PRELUDE};
use crate::launch::{Arg, Recipe, Step};
use crate::matmul::{GEMV_SETS, MatmulKey};

/// `f32`, `bf16`, ... as kernel-name suffixes.
fn sfx(d: DType) -> &'static str {
    d.name()
}

fn align(n: usize) -> usize {
    n.div_ceil(256) * 256
}

/// The kernel named `name` of the fixed kernel file `file`.
pub(crate) fn kernel(dev: &Device, file: KernelFile, name: &str) -> Result<crate::compile::Func> {
    let m = dev.module(file.name(), &file.source(), Options { fmad: false })?;
    m.function(name)
}

fn grid_for(dev: &Device, n: usize, block: u32) -> (u32, u32, u32) {
    let blocks = n.div_ceil(block as usize).clamp(1, dev.multiprocessors.max(1) * 32);
    (blocks as u32, 1, 1)
}

fn rows_grid(dev: &Device, rows: usize) -> (u32, u32, u32) {
    (rows.clamp(1, dev.multiprocessors.max(1) * 64) as u32, 1, 1)
}

/// Blocks of 256 threads for kernels that give each row a warp (8 rows a block).
fn warp_rows_grid(dev: &Device, rows: usize) -> (u32, u32, u32) {
    (rows.div_ceil(8).clamp(1, dev.multiprocessors.max(1) * 64) as u32, 1, 1)
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
        file: KernelFile,
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
    /// A cuBLASLt matmul `c = a op b (+ beta c)` with `ws_bytes` of workspace at scratch 0.
    fn matmul(&mut self, key: MatmulKey, a: Arg, b: Arg, c: Arg, ws_bytes: usize, beta: f64) {
        self.steps.push(Step::Matmul { key, a, b, c, addend: None, ws: 0, ws_bytes, beta });
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
        Op::Full { .. } | rumble_core::elementwise_ops!() | Op::Swiglu | Op::SwigluBackward => {
            let f = Fused::of_op(op, at, ot).ok_or_else(|| unsupported("this op".into()))?;
            return fused_recipe(dev, op.name(), &f, out_n);
        }
        Op::Fused(body) => return fused_recipe(dev, op.name(), &Fused::of_body(body)?, out_n),
        Op::RopeAt { .. }
        | Op::CacheWrite { .. }
        | Op::CacheWriteKv { .. }
        | Op::AttentionCached { .. }
        | Op::Sample { .. } => {
            return crate::decode::recipe(dev, op, at, ot);
        }
        // NCCL on the step's stream (crate::nccl), from the operand into the result.
        Op::Collective { op: c, world, rank } => {
            let c = crate::nccl::Collective::new(*c, *world, *rank, dt, at[0].numel())?;
            b.steps.push(Step::Collective(c));
        }
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Gather
        | Op::ScatterAdd { .. } => layout::prepare(&mut b, op, at, ot)?,
        Op::Reduce { op: r, axes, .. } => reduce::reduce(&mut b, *r, axes, at[0], out_n)?,
        Op::Matmul { ta, tb, acc, .. } => {
            let key = MatmulKey { out: ot[0].dtype, ..MatmulKey::new(at[0], at[1], *ta, *tb) };
            let key = MatmulKey { row_addend: *acc == Addend::Row, ..key };
            if out_n > 0 {
                matmul_steps(&mut b, key, (Arg::In(0), Arg::In(1)), 0, acc.is_some().then_some(2))?;
            }
        }
        Op::MatmulPre { pre, acc, outs } => matmul_pre(&mut b, *pre, *acc, *outs, at)?,
        Op::RmsNorm { .. }
        | Op::RmsNormBackward { .. }
        | Op::Rope { .. }
        | Op::SwigluPacked
        | Op::SwigluPackedBackward
        | Op::Softmax
        | Op::LogSoftmax
        | Op::SoftmaxBackward
        | Op::LogSoftmaxBackward
        | Op::CrossEntropy { .. }
        | Op::CrossEntropyBackward { .. }
        | Op::LinearCrossEntropy { .. }
        | Op::LinearCrossEntropyBackward { .. }
        | Op::LinearCrossEntropyGrad { .. } => rows::prepare(&mut b, op, at, dt)?,
        Op::Attention { .. } | Op::AttentionBackward { .. } => {
            // cuDNN where `cudnn::recipe` chooses it, the tiled kernels where `flash::choose`
            // takes them, the per-row kernels otherwise.
            if let Some(r) = crate::cudnn::recipe(dev, op, at) {
                return Ok(r);
            }
            if let Some(r) = crate::flash::recipe(dev, op, at) {
                return r;
            }
            attention::prepare(&mut b, op, at, dt)?
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

/// The steps of one matmul into output `out`, `key` its shape (with `row_addend` where its
/// addend is a row), `addend` the operand it adds, if any: the tuned matmul with its workspace
/// at scratch 0, or, with no products (`k == 0`), the addend alone (a copy, skipped where the
/// planner put the result over it, or the row broadcast). A row addend no candidate adds
/// (cuBLASLt without a `BIAS` algorithm for these types, and no gemv kernel) is broadcast into
/// the result first, and the matmul adds the result in place.
fn matmul_steps(b: &mut Builder, key: MatmulKey, (a, bm): (Arg, Arg), out: usize, addend: Option<usize>) -> Result<()> {
    let (rows, n) = ((key.batch.max(1) * key.m) as usize, key.n as usize);
    let bytes = rows * n * key.out.size_in_bytes();
    if key.k == 0 {
        match addend {
            None => b.steps.push(Step::ZeroOut { out, bytes }),
            Some(c) if key.row_addend => layout::broadcast_row(b, key.out, (c, out), rows, n)?,
            Some(c) => b.steps.push(Step::Copy { src: c, dst: out, bytes }),
        }
        return Ok(());
    }
    let unsupported = key.row_addend && matches!(b.dev.matmul_workspace(&key), Err(CudaError::Unsupported(_)));
    let (key, addend) = match addend {
        Some(c) if unsupported => {
            layout::broadcast_row(b, key.out, (c, out), rows, n)?;
            (MatmulKey { row_addend: false, ..key }, Some(Arg::Out(out)))
        }
        addend => (key, addend.map(Arg::In)),
    };
    let ws = b.dev.matmul_workspace(&key)?;
    b.scratch = b.scratch.max(ws);
    b.steps.push(Step::Matmul { key, a, b: bm, c: Arg::Out(out), addend, ws: 0, ws_bytes: ws, beta: 0.0 });
    Ok(())
}

/// `matmul_pre`: where the tuner runs the plain matmul of the made rows on gemv.cu for every
/// projection ([`crate::matmul::gemv_pre_kernel`]), one launch of a prologue kernel for all of
/// them, split as the widest one's was, its grid as many blocks as the device holds at once
/// (each makes the rows once, then takes block after block of weight rows); otherwise the prologue's own kernel writes the rows into
/// the node's scratch once, the tuned matmul of each projection without a prologue kernel reads
/// them, and the others each launch theirs.
fn matmul_pre(b: &mut Builder, pre: Prologue, acc: Addend, outs: usize, at: &[&TensorType]) -> Result<()> {
    let w = pre.operands();
    let (m, dt) = (at[0].dims()[0], at[0].dtype);
    let rows = TensorType::new(dt, [m, at[w].dims()[1]]);
    let k = rows.dims()[1];
    let (pname, g, eps) = match pre {
        Prologue::RmsNorm { eps } => ("norm", Arg::In(1), eps),
        Prologue::SwigluPacked => ("swiglu", Arg::I64(0), 0.0),
    };
    let row_addend = acc == Addend::Row;
    let keys: Vec<MatmulKey> =
        (0..outs).map(|j| MatmulKey { row_addend, ..MatmulKey::new(&rows, at[w + j], false, true) }).collect();
    let kernels = keys
        .iter()
        .map(|key| if key.k > 0 && key.n > 0 { crate::matmul::gemv_pre_kernel(b.dev, key, pname) } else { Ok(None) })
        .collect::<Result<Vec<_>>>()?;
    // One launch of `kernel` for the projections `js`.
    let launch = |b: &mut Builder, pre: crate::matmul::GemvPre, js: &[usize]| -> Result<()> {
        let kernel = pre.kernel;
        let (mut words, mut first) = (vec![0u64; 3 * GEMV_SETS], 0u64);
        let (mut ns, mut firsts) = (vec![0u64; GEMV_SETS], vec![0u64; GEMV_SETS + 1]);
        // Each addend's row stride: its width, or 0 for a row.
        let mut ldcs = vec![0u64; GEMV_SETS];
        let mut ptrs = Vec::new();
        for (slot, &j) in js.iter().enumerate() {
            ns[slot] = keys[j].n;
            ldcs[slot] = if row_addend { 0 } else { keys[j].n };
            firsts[slot] = first;
            first += keys[j].n.div_ceil(kernel.rows as u64);
            ptrs.push((slot, j));
        }
        for f in firsts.iter_mut().skip(js.len()) {
            *f = first;
        }
        words.extend(ns);
        words.extend(ldcs);
        words.extend(firsts);
        let grid = u32::try_from(first)
            .map_err(|_| CudaError::usage(format!("matmul_pre grid of {keys:?}")))?
            .min(pre.blocks.max(1));
        // The set's pointers (b, c, d of each slot) are the node's operands and results.
        let mut addrs = Vec::new();
        for &(slot, j) in &ptrs {
            let c = if acc.is_some() { Arg::In(w + outs + j) } else { Arg::Out(j) };
            addrs.extend([(slot, Arg::In(w + j)), (GEMV_SETS + slot, c), (2 * GEMV_SETS + slot, Arg::Out(j))]);
        }
        let set = Arg::Struct { words, addrs };
        let args = vec![set, Arg::In(0), g.clone(), Arg::I64(m as i64), Arg::I64(k as i64)]
            .into_iter()
            .chain([Arg::F64(if acc.is_some() { 1.0 } else { 0.0 }), Arg::F64(eps)])
            .collect();
        let name = format!("{}:{pname}", kernel.name);
        b.steps.push(Step::Kernel {
            func: kernel.func,
            name,
            grid: (grid, 1, 1),
            block: kernel.threads,
            smem: pre.smem,
            args,
        });
        Ok(())
    };
    let live: Vec<usize> = (0..outs).filter(|&j| keys[j].n > 0 && m > 0).collect();
    if live.iter().all(|&j| kernels[j].is_some()) {
        // Chunks of the set's size, each on the widest projection's split.
        for js in live.chunks(GEMV_SETS) {
            let widest = *js.iter().max_by_key(|&&j| keys[j].n).unwrap();
            launch(b, kernels[widest].unwrap(), js)?;
        }
        return Ok(());
    }
    // The rows into node scratch, as the prologue's op would make them.
    let node = b.node(rows.size_in_bytes());
    match pre {
        Prologue::RmsNorm { eps } => rows::rms_norm(b, dt, m, k, eps, Arg::Node(node))?,
        Prologue::SwigluPacked => rows::swiglu_packed(b, dt, m, k, Arg::Node(node))?,
    }
    for j in live {
        if let Some(kernel) = kernels[j] {
            launch(b, kernel, &[j])?;
            continue;
        }
        let addend = acc.is_some().then_some(w + outs + j);
        matmul_steps(b, keys[j], (Arg::Node(node), Arg::In(w + j)), j, addend)?;
    }
    Ok(())
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
        // A thread takes runs of `fused::RUN` elements, so that many times fewer threads cover `n`.
        vec![Step::Kernel {
            func,
            name,
            grid: grid_for(dev, n.div_ceil(crate::fused::RUN), 256),
            block: 256,
            smem: 0,
            args,
        }]
    };
    Ok(Recipe { op, steps, scratch: 0, node_scratch: 0 })
}
