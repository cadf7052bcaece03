//! The cost model: the predicted device time of each node for the shapes at hand, so that
//! `compile` can weigh a choice's time against its bytes (and `rumble plan` can say how long a
//! step should take on a machine without a GPU).
//!
//! [`CostModel`] is the one question: the seconds a node of op `op` on operands `args` giving
//! `outs` takes. Two answers:
//!
//! - [`Roofline`]: from FLOPs and bytes against a device's rates ([`DeviceRates`], data, not
//!   constants scattered in code): `max(flops / rate, bytes / bandwidth) + launches x
//!   overhead`. Matmuls add the tensor cores' tile and wave quantisation (a thin matmul fills
//!   few tiles, and a last wave may leave most multiprocessors idle), which is what makes a
//!   chunked loss of thin matmuls slower than a wide one; its weight is read once per chunk.
//!   Fused linear cross-entropy is priced chunk by chunk as the CUDA recipe runs it
//!   (`recipe/rows.rs`'s `linear_ce`: per chunk one logits matmul and two passes over the
//!   logits forward; a recomputation, one pass reading the forward's log-sum-exp and two
//!   gradient matmuls backward).
//! - [`Measured`]: times measured on the device (the matmul tuner records each shape it
//!   times), read from a file keyed by device, op, shapes and dtypes ([`matmul_key`],
//!   [`node_key`]); the roofline answers for anything not measured.
//!
//! A device kept busy for long runs its tensor cores at lower clocks than one probed for
//! milliseconds. A model that knows how much ([`CostModel::sustained`], `DeviceCost` measures
//! it) has its node times stretched inside a step ([`step_node_times`]), by a slowdown scaled
//! to the step's own tensor-core load: a step that drives them as hard as the measuring burn
//! slows by all of it, a step that rarely uses them by little, interpolated through a burn at
//! part load where one was measured ([`Sustained::slowdown_at`]).
//!
//! The FLOP counts are `passes::remat::flops`'s.

use std::collections::HashMap;
use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::ir::{CollectiveOp, DType, Op, TensorType, Trace, stat_dtype};
use crate::passes::remat::flops;
use crate::plan::view_offset;

/// A device's rates: what the roofline divides by.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceRates {
    /// The device's name (keys measured times).
    pub name: String,
    /// Dense matmul FLOP/s on bf16 and f16 operands (tensor cores, f32 accumulation).
    pub half_matmul: f64,
    /// Matmul FLOP/s on exact f32 operands (no TF32).
    pub f32_matmul: f64,
    /// Matmul FLOP/s on f64 operands.
    pub f64_matmul: f64,
    /// The fraction of the matmul rate the attention kernels reach.
    pub attention_efficiency: f64,
    /// FLOP/s of the vector units (elementwise, reductions).
    pub vector: f64,
    /// Device memory bandwidth, bytes/s.
    pub memory: f64,
    /// Seconds each kernel launch costs beyond its work (inside a graph: the gap between
    /// kernels).
    pub launch: f64,
    /// Streaming multiprocessors: one matmul tile each per wave.
    pub multiprocessors: usize,
    /// Rows and columns of the output tile a multiprocessor computes at once.
    pub tile: (usize, usize),
    /// Bytes/s a collective moves between the devices of a data-parallel run (NCCL's "bus
    /// bandwidth": an all-reduce of `n` bytes over `w` ranks moves `2 (w - 1) / w * n`).
    pub interconnect: f64,
}

impl DeviceRates {
    /// An NVIDIA H200 (SXM, 132 SMs) as measured: bf16 dense matmuls at about 790 TFLOP/s,
    /// cuBLAS's exact f32 at about 50, HBM3e at about 4.3 TB/s. The interconnect is NVLink 4's
    /// 450 GB/s a direction at 80%, not measured here (no machine of two GPUs has been lent).
    pub fn h200() -> Self {
        DeviceRates {
            name: "NVIDIA H200".into(),
            half_matmul: 790e12,
            f32_matmul: 50e12,
            f64_matmul: 50e12,
            attention_efficiency: 0.5,
            vector: 60e12,
            memory: 4.3e12,
            launch: 3e-6,
            multiprocessors: 132,
            tile: (128, 128),
            interconnect: 360e9,
        }
    }

    /// Matmul FLOP/s for operands of `dtype`.
    pub fn matmul_rate(&self, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 | DType::F16 => self.half_matmul,
            DType::F64 => self.f64_matmul,
            _ => self.f32_matmul,
        }
    }
}

impl Default for DeviceRates {
    fn default() -> Self {
        DeviceRates::h200()
    }
}

/// One matmul as the backends run it: `batch` products of `[m, k] x [k, n]` on `dtype`
/// operands giving `out` (transposes as flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulShape {
    pub dtype: DType,
    pub out: DType,
    pub ta: bool,
    pub tb: bool,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl MatmulShape {
    /// The shape of an `Op::Matmul { ta, tb, .. }` node on `a` and `b`.
    pub fn of(a: &TensorType, b: &TensorType, ta: bool, tb: bool) -> Self {
        let r = a.rank();
        let batch: usize = a.dims()[..r.saturating_sub(2)].iter().product();
        let (m, k) = if ta { (a.dims()[r - 1], a.dims()[r - 2]) } else { (a.dims()[r - 2], a.dims()[r - 1]) };
        let n = if tb { b.dims()[b.rank() - 2] } else { b.dims()[b.rank() - 1] };
        MatmulShape { dtype: a.dtype, out: a.dtype, ta, tb, batch, m, n, k }
    }
}

/// The key of a measured matmul time: `matmul bf16->f32 nt 1x4096x151936x896`.
pub fn matmul_key(s: &MatmulShape) -> String {
    let t = |x: bool| if x { 't' } else { 'n' };
    format!("matmul {}->{} {}{} {}x{}x{}x{}", s.dtype, s.out, t(s.ta), t(s.tb), s.batch, s.m, s.n, s.k)
}

/// The key of a measured node time: the op and its operand and result types, as the text form
/// writes them.
pub fn node_key(op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> String {
    let j = |ts: &[&TensorType]| ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ");
    let mut attrs: Vec<String> = crate::ir::op_attrs(op).into_iter().map(|(k, v)| format!(" {k}={v}")).collect();
    if let Op::Fused(body) = op {
        // The body itself, by a hash of its instructions (FNV-1a).
        let text = format!("{:?}", body.body);
        let mut h = fnv::FnvHasher::default();
        std::hash::Hasher::write(&mut h, text.as_bytes());
        let h = std::hash::Hasher::finish(&h);
        attrs.push(format!(" body={h:016x}"));
    }
    format!("{}{} ({}) -> ({})", op.name(), attrs.concat(), j(args), j(outs))
}

/// Predicted device time of nodes.
pub trait CostModel: Send + Sync + fmt::Debug {
    /// Seconds one node takes on the device.
    fn node_seconds(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64;
    /// What the model is (printed in reports): `roofline NVIDIA H200`.
    fn describe(&self) -> String;
    /// Whether its times are measured on the device the plan runs on (not estimated), so
    /// that small differences between variants can be trusted (`compile::choose`).
    fn is_measured(&self) -> bool {
        false
    }
    /// How the device's tensor cores slow under a long load, if known ([`step_node_times`]).
    fn sustained(&self) -> Option<Sustained> {
        None
    }
}

/// How a device's tensor cores slow when kept busy (`DeviceCost`'s burn: a large bf16 matmul
/// run back to back for seconds, timed before and after).
#[derive(Clone, Debug, PartialEq)]
pub struct Sustained {
    /// The burn's time after over its time before (1 or more).
    pub slowdown: f64,
    /// The burn's bf16 FLOP rate before: what "as busy as the burn" means.
    pub rate: f64,
    /// The burn at part load, where measured: the tensor load of its pattern (0 to 1: the
    /// matmul alternating with memory-bound work) and the matmul's slowdown in it. A device
    /// whose power limit such a load does not reach slows by little there.
    pub part: Option<(f64, f64)>,
    /// The roofline whose tensor shares and FLOPs say how much of each node slows.
    pub roofline: Roofline,
}

impl Sustained {
    /// Each node's time of `times` (`node_times` of `trace`) inside the step: the step's load
    /// (its bf16-equivalent tensor FLOPs over its time, over the burn's rate, at most 1) scales
    /// the slowdown, and each node's tensor-core share (`Roofline::tensor_share`) is stretched
    /// by that.
    pub fn stretch(&self, trace: &Trace, times: &[f64]) -> Vec<f64> {
        let (mut flops, mut shares) = (0.0, Vec::with_capacity(times.len()));
        for n in &trace.nodes {
            let a: Vec<&TensorType> = n.args.iter().map(|v| trace.ty(*v)).collect();
            let o: Vec<&TensorType> = n.outs.iter().map(|v| trace.ty(*v)).collect();
            flops += self.roofline.tensor_flops(&n.op, &a, &o);
            shares.push(self.roofline.tensor_share(&n.op, &a, &o));
        }
        let total: f64 = times.iter().sum();
        let load = if total > 0.0 && self.rate > 0.0 { (flops / total / self.rate).clamp(0.0, 1.0) } else { 0.0 };
        let slowdown = self.slowdown_at(load);
        times.iter().zip(shares).map(|(t, share)| t * (1.0 + (slowdown - 1.0) * share)).collect()
    }

    /// The slowdown of a step whose tensor load is `load` (0 to 1): none at rest, the burn's at
    /// the burn's load, and between them linear through the part-load measurement where there
    /// is one (its slowdown held between 1 and the burn's), else linear.
    pub fn slowdown_at(&self, load: f64) -> f64 {
        let full = self.slowdown.max(1.0);
        let load = load.clamp(0.0, 1.0);
        match self.part {
            Some((at, s)) if at > 0.0 && at < 1.0 => {
                let s = s.clamp(1.0, full);
                if load <= at { 1.0 + (s - 1.0) * load / at } else { s + (full - s) * (load - at) / (1.0 - at) }
            }
            _ => 1.0 + (full - 1.0) * load,
        }
    }
}

/// A shared cost model.
pub type Cost = Arc<dyn CostModel>;

/// Predicted seconds of every node of `trace`, in order.
pub fn node_times(model: &dyn CostModel, trace: &Trace) -> Vec<f64> {
    trace
        .nodes
        .iter()
        .map(|n| {
            let a: Vec<&TensorType> = n.args.iter().map(|v| trace.ty(*v)).collect();
            let o: Vec<&TensorType> = n.outs.iter().map(|v| trace.ty(*v)).collect();
            model.node_seconds(&n.op, &a, &o)
        })
        .collect()
}

/// Predicted seconds of every node of `trace` inside a step: [`node_times`], stretched where
/// the model knows how the device slows under the step's load ([`Sustained::stretch`]).
pub fn step_node_times(model: &dyn CostModel, trace: &Trace) -> Vec<f64> {
    let times = node_times(model, trace);
    match model.sustained() {
        Some(s) => s.stretch(trace, &times),
        None => times,
    }
}

/// Predicted seconds of one step of `trace` ([`step_node_times`]): the sum over its nodes, but for collectives of
/// several ranks, which run on a stream of their own from their node to their join
/// (`ir::collective_joins`, one after another there): the step's stream waits at a join only
/// for what of the collective the nodes between did not cover.
pub fn trace_seconds(model: &dyn CostModel, trace: &Trace) -> f64 {
    let times = step_node_times(model, trace);
    let joins = crate::ir::collective_joins(trace);
    if joins.is_empty() {
        return times.iter().sum();
    }
    let n = trace.nodes.len();
    // Per node: the collective it issues; per join position: the collectives it waits for.
    let mut issues = vec![None; n];
    let mut waits: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
    for (k, &(c, j)) in joins.iter().enumerate() {
        issues[c] = Some(k);
        waits[j].push(k);
    }
    let (mut now, mut side_free) = (0.0f64, 0.0f64);
    let mut done = vec![0.0f64; joins.len()];
    for (i, t) in times.iter().enumerate() {
        for &k in &waits[i] {
            now = now.max(done[k]);
        }
        match issues[i] {
            Some(k) => {
                side_free = side_free.max(now) + t;
                done[k] = side_free;
            }
            None => now += t,
        }
    }
    for &k in &waits[n] {
        now = now.max(done[k]);
    }
    now
}

/// FLOPs and bytes against a device's rates (see the module doc).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Roofline {
    pub rates: DeviceRates,
}

impl Roofline {
    pub fn new(rates: DeviceRates) -> Self {
        Roofline { rates }
    }

    /// Seconds of one matmul: the tensor cores' time at the tile-and-wave efficiency of its
    /// shape, or the time to stream its operands and result, whichever is longer, plus a
    /// launch. A dimension smaller than the tile gets a tile cut to it (in steps of 16, as
    /// libraries keep narrow tiles for skinny shapes); a last wave of tiles that leaves
    /// multiprocessors idle is filled by splitting `k` (split-K or stream-K: of the splits up to
    /// 16, at least 256 of `k` each, the one that wastes the fewest tile slots).
    pub fn matmul_seconds(&self, s: &MatmulShape) -> f64 {
        let r = &self.rates;
        if s.m == 0 || s.n == 0 || s.batch == 0 {
            return 0.0;
        }
        let compute = self.matmul_compute_seconds(s);
        let es = |d: DType| d.size_in_bytes() as f64;
        let bytes = (s.batch * (s.m * s.k + s.k * s.n)) as f64 * es(s.dtype) + (s.batch * s.m * s.n) as f64 * es(s.out);
        compute.max(bytes / r.memory) + r.launch
    }

    /// The tensor cores' part of [`Roofline::matmul_seconds`]: the FLOPs at the rate the
    /// shape's tiles and waves allow.
    pub fn matmul_compute_seconds(&self, s: &MatmulShape) -> f64 {
        let r = &self.rates;
        if s.m == 0 || s.n == 0 || s.batch == 0 {
            return 0.0;
        }
        let tm = r.tile.0.clamp(1, s.m.next_multiple_of(16));
        let tn = r.tile.1.clamp(1, s.n.next_multiple_of(16));
        let sms = r.multiprocessors.max(1);
        let tiles = s.batch * s.m.div_ceil(tm) * s.n.div_ceil(tn);
        // Split-K (or stream-K) over the deep dimension fills a last partial wave: the split of
        // at most 16 (and 256 of k a split) that wastes the fewest tile slots.
        let eff = |split: usize| {
            let slots = (tiles * split).div_ceil(sms) * sms * tm * tn;
            ((s.batch * s.m * s.n * split) as f64 / slots as f64).min(1.0)
        };
        let efficiency = (1..=(s.k / 256).clamp(1, 16)).map(eff).fold(0.0, f64::max);
        let flops = 2.0 * (s.batch * s.m * s.n * s.k) as f64;
        flops / (r.matmul_rate(s.dtype) * efficiency)
    }

    /// The share of a node's time its tensor-core work takes, 0 to 1: its FLOPs at the rate
    /// the roofline prices them (tiles and waves for matmuls, `attention_efficiency` for
    /// attention) over the whole roofline time, for the ops that run on them (matmuls,
    /// attention, the fused loss); 0 for the others. A device whose clocks drop under a long
    /// load slows this share of a node ([`Sustained::stretch`]).
    pub fn tensor_share(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64 {
        let Some(a) = args.first() else { return 0.0 };
        let rate = self.rates.matmul_rate(a.dtype);
        // The tensor cores' seconds, at the efficiency the roofline prices them at.
        let compute = match op {
            Op::Matmul { ta, tb, out, .. } if args.len() >= 2 => self.matmul_compute_seconds(&MatmulShape {
                out: out.unwrap_or(a.dtype),
                ..MatmulShape::of(a, args[1], *ta, *tb)
            }),
            Op::MatmulPre { pre, outs: n, .. } if args.len() >= pre.operands() + n => {
                let rows = TensorType::new(a.dtype, [a.dims()[0], args[pre.operands()].dims()[1]]);
                let ws = &args[pre.operands()..pre.operands() + n];
                ws.iter().map(|w| self.matmul_compute_seconds(&MatmulShape::of(&rows, w, false, true))).sum()
            }
            Op::Attention { .. } | Op::AttentionBackward { .. } => {
                flops(op, args, outs) as f64 / (rate * self.rates.attention_efficiency)
            }
            Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::LinearCrossEntropyGrad { .. } => flops(op, args, outs) as f64 / rate,
            _ => return 0.0,
        };
        let share = compute / self.node_seconds(op, args, outs);
        if share.is_finite() { share.clamp(0.0, 1.0) } else { 0.0 }
    }

    /// A node's tensor-core FLOPs in bf16 equivalents (FLOPs of another dtype weighed by the
    /// bf16 rate over theirs): the matmuls, attention and the fused loss; 0 for the others.
    pub fn tensor_flops(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64 {
        let Some(a) = args.first() else { return 0.0 };
        match op {
            Op::Matmul { .. }
            | Op::MatmulPre { .. }
            | Op::Attention { .. }
            | Op::AttentionBackward { .. }
            | Op::LinearCrossEntropy { .. }
            | Op::LinearCrossEntropyBackward { .. }
            | Op::LinearCrossEntropyGrad { .. } => {
                let weight = self.rates.matmul_rate(DType::BF16) / self.rates.matmul_rate(a.dtype);
                let f = flops(op, args, outs) as f64 * weight;
                if f.is_finite() { f } else { 0.0 }
            }
            _ => 0.0,
        }
    }

    /// Seconds of a kernel streaming `bytes` and doing `flops` on the vector units.
    pub fn stream_seconds(&self, bytes: f64, flops: f64, launches: usize) -> f64 {
        (bytes / self.rates.memory).max(flops / self.rates.vector) + launches as f64 * self.rates.launch
    }

    /// Seconds of a node, with `matmul` the price of each matmul it runs.
    pub fn node_seconds_with(
        &self,
        op: &Op,
        args: &[&TensorType],
        outs: &[&TensorType],
        matmul: &dyn Fn(&MatmulShape) -> f64,
    ) -> f64 {
        let bytes = |ts: &[&TensorType]| ts.iter().map(|t| t.size_in_bytes() as f64).sum::<f64>();
        let moved = bytes(args) + bytes(outs);
        let f = flops(op, args, outs) as f64;
        match op {
            Op::Reshape { .. } | Op::Permute { .. } | Op::Slice { .. } | Op::Broadcast { .. }
                if args.len() == 1 && outs.len() == 1 && view_offset(op, args[0], outs[0]).is_some() =>
            {
                0.0
            }
            Op::Full { .. } => self.stream_seconds(bytes(outs), 0.0, 1),
            Op::Matmul { ta, tb, out, acc } => {
                let t = matmul(&MatmulShape {
                    out: out.unwrap_or(args[0].dtype),
                    ..MatmulShape::of(args[0], args[1], *ta, *tb)
                });
                // The addend is read once more, by the same kernel.
                t + if acc.is_some() { args[2].size_in_bytes() as f64 / self.rates.memory } else { 0.0 }
            }
            // The matmuls of the prologue's rows as one launch (its operands are read once
            // more, and an addend).
            Op::MatmulPre { pre, outs, .. } => {
                let ws = &args[pre.operands()..pre.operands() + outs];
                let rows = TensorType::new(args[0].dtype, [args[0].dims()[0], ws[0].dims()[1]]);
                let t: f64 = ws.iter().map(|w| matmul(&MatmulShape::of(&rows, w, false, true))).sum();
                let others = bytes(args) - bytes(ws);
                t + others / self.rates.memory - outs.saturating_sub(1) as f64 * self.rates.launch
            }
            Op::Attention { .. } | Op::AttentionBackward { .. } => {
                let rate = self.rates.matmul_rate(args[0].dtype) * self.rates.attention_efficiency;
                let launches = if matches!(op, Op::AttentionBackward { .. }) { 3 } else { 1 };
                (f / rate).max(moved / self.rates.memory) + launches as f64 * self.rates.launch
            }
            Op::LinearCrossEntropy { chunk, .. } => self.linear_ce_seconds(args, *chunk, (true, false), matmul),
            Op::LinearCrossEntropyBackward { chunk, .. } => self.linear_ce_seconds(args, *chunk, (false, true), matmul),
            Op::LinearCrossEntropyGrad { chunk, .. } => self.linear_ce_seconds(args, *chunk, (true, true), matmul),
            Op::Reduce { .. } => self.stream_seconds(moved, f, 2),
            Op::Collective { op: c, world, .. } if *world > 1 => {
                // Ring algorithms: each rank sends and receives (w - 1) / w of the whole
                // buffer once per phase; an all-reduce is a reduce-scatter then an all-gather.
                let w = *world as f64;
                let (whole, phases) = match c {
                    CollectiveOp::AllReduce => (bytes(args), 2.0),
                    CollectiveOp::ReduceScatter => (bytes(args), 1.0),
                    CollectiveOp::AllGather => (bytes(outs), 1.0),
                };
                phases * (w - 1.0) / w * whole / self.rates.interconnect + self.rates.launch
            }
            _ => self.stream_seconds(moved, f, 1),
        }
    }

    /// Fused linear cross-entropy on `x [N, C]`, `w [V, C]`, `chunk` rows at a time, as the
    /// CUDA recipe runs it.
    fn linear_ce_seconds(
        &self,
        args: &[&TensorType],
        chunk: usize,
        (forward, backward): (bool, bool),
        matmul: &dyn Fn(&MatmulShape) -> f64,
    ) -> f64 {
        let (x, w) = (args[0], args[1]);
        let (n, c, v) = (x.dims()[0], x.dims()[1], w.dims()[0]);
        if n == 0 {
            return self.rates.launch;
        }
        let t = x.dtype;
        let s = stat_dtype(t);
        let chunk = chunk.clamp(1, n);
        let mm = |dtype: DType, out: DType, ta: bool, tb: bool, m: usize, nn: usize, k: usize| {
            matmul(&MatmulShape { dtype, out, ta, tb, batch: 1, m, n: nn, k })
        };
        let (ssz, tsz) = (s.size_in_bytes() as f64, t.size_in_bytes() as f64);
        let mut total = 0.0;
        let mut r0 = 0;
        while r0 < n {
            let rows = chunk.min(n - r0);
            let logits = (rows * v) as f64;
            total += mm(t, s, false, true, rows, v, c);
            if forward {
                // Split log-sum-exp statistics (one read of the logits), then each row's loss.
                total += self.stream_seconds(logits * ssz, 3.0 * logits, 2);
            }
            if backward {
                // The logit gradient in the operand dtype from the logits and the forward's
                // log-sum-exp (no statistics pass), then dx = dl w and dw += dl^T x.
                total += self.stream_seconds(logits * (ssz + tsz) + rows as f64 * ssz, 4.0 * logits, 1);
                total += mm(t, t, false, false, rows, c, v);
                total += mm(t, t, true, false, v, c, rows);
            }
            r0 += rows;
        }
        total + self.rates.launch
    }
}

impl CostModel for Roofline {
    fn node_seconds(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64 {
        self.node_seconds_with(op, args, outs, &|s| self.matmul_seconds(s))
    }

    fn describe(&self) -> String {
        format!("roofline {}", self.rates.name)
    }
}

/// Measured times where there are any (by [`matmul_key`] for matmuls, also inside fused ops,
/// and by [`node_key`] for whole nodes), the roofline elsewhere.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub roofline: Roofline,
    /// Seconds by key.
    pub times: HashMap<String, f64>,
}

impl Measured {
    /// The times measured on `rates.name` in `dir` (none if the file is missing or unreadable:
    /// the roofline answers).
    pub fn load(dir: &Path, rates: DeviceRates) -> Self {
        let file = times_file(dir, &rates.name);
        let mut times = HashMap::new();
        if let Ok(text) = std::fs::read_to_string(&file) {
            for line in text.lines() {
                if let Some((k, v)) = line.rsplit_once('\t')
                    && let Ok(s) = v.trim().parse::<f64>()
                    && s.is_finite()
                    && s >= 0.0
                {
                    times.insert(k.to_string(), s);
                }
            }
        }
        Measured { roofline: Roofline::new(rates), times }
    }

    /// Seconds measured for `key`, if any.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.times.get(key).copied()
    }
}

impl CostModel for Measured {
    fn node_seconds(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64 {
        // Times measured by events around launches include the gap between launches.
        if let Some(s) = self.get(&node_key(op, args, outs)) {
            return s;
        }
        self.roofline.node_seconds_with(op, args, outs, &|s| {
            self.get(&matmul_key(s)).unwrap_or_else(|| self.roofline.matmul_seconds(s))
        })
    }

    fn describe(&self) -> String {
        format!("measured {} ({} times), roofline elsewhere", self.roofline.rates.name, self.times.len())
    }
}

/// The file of measured times for device `device` in folder `dir`: `times3-<device>.txt`, one
/// `key<TAB>seconds` line each (the last line of a key wins). Version 3: times as probed (a
/// step's load stretches them, [`step_node_times`]), and the device's burn figures
/// ([`Sustained`]); version 2 held times stretched node by node, and is not read.
pub fn times_file(dir: &Path, device: &str) -> PathBuf {
    let name: String = device.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    dir.join(format!("times3-{name}.txt"))
}

/// Appends measured times to `device`'s file in `dir` (one whole line per write, so
/// concurrent processes at worst repeat a key). Errors are returned, not hidden.
pub fn record(dir: &Path, device: &str, times: &[(String, f64)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(times_file(dir, device))?;
    for (k, s) in times {
        if k.contains('\t') || k.contains('\n') || !s.is_finite() {
            continue;
        }
        f.write_all(format!("{k}\t{s:e}\n").as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Shape;

    fn ty(dtype: DType, dims: &[usize]) -> TensorType {
        TensorType::new(dtype, Shape::from(dims))
    }

    /// A bf16 `m x k` by `k x n` matmul with a bf16 result.
    fn bf16_nn(m: usize, n: usize, k: usize) -> MatmulShape {
        MatmulShape { dtype: DType::BF16, out: DType::BF16, ta: false, tb: false, batch: 1, m, n, k }
    }

    #[test]
    fn a_collective_costs_the_step_only_what_the_nodes_before_its_join_do_not_cover() {
        use crate::ir::{Graph, OutputRole};
        // x -> all_reduce -> (a long matmul chain beside it) -> y = ar + chain.
        let step = |work: usize| {
            let g = Graph::new("overlap");
            let x = g.data("x", DType::BF16, &[4096, 4096]).unwrap();
            let ar =
                g.apply(Op::Collective { op: CollectiveOp::AllReduce, world: 2, rank: 0 }, &[&x]).unwrap().remove(0);
            let mut h = x.clone();
            for _ in 0..work {
                h = h.matmul(&x).unwrap();
            }
            let y = ar.reshape(&[4096, 4096]).unwrap().add(&h).unwrap();
            g.output_with_role(&y, "y", OutputRole::Output).unwrap();
            g.finish().unwrap()
        };
        let r = Roofline::default();
        let (none, some, lots) = (step(0), step(1), step(40));
        let plain = |t: &Trace| node_times(&r, t).iter().sum::<f64>();
        // Nothing beside it: the collective's whole time counts.
        assert!((trace_seconds(&r, &none) - plain(&none)).abs() <= 1e-12);
        // A little work beside it hides that much; a lot hides all of it.
        assert!(trace_seconds(&r, &some) < plain(&some));
        let coll = node_times(&r, &lots)[crate::ir::collective_joins(&lots)[0].0];
        assert!((plain(&lots) - trace_seconds(&r, &lots) - coll).abs() <= 1e-9 * plain(&lots));
    }

    #[test]
    fn collectives_cost_what_their_rings_move_over_the_interconnect() {
        let r = Roofline::default();
        let (x, shard) = (ty(DType::F32, &[1 << 20]), ty(DType::F32, &[1 << 18]));
        let c = |op, world| Op::Collective { op, world, rank: 0 };
        let at = |op, world, a: &TensorType, o: &TensorType| r.node_seconds(&c(op, world), &[a], &[o]) - r.rates.launch;
        let per_byte = 1.0 / r.rates.interconnect;
        let n = x.size_in_bytes() as f64;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        // Four ranks: an all-reduce moves 2 * 3/4 of the buffer, a reduce-scatter or an
        // all-gather of the same whole buffer 3/4 of it.
        assert!(close(at(CollectiveOp::AllReduce, 4, &x, &x), 1.5 * n * per_byte));
        assert!(close(at(CollectiveOp::ReduceScatter, 4, &x, &shard), 0.75 * n * per_byte));
        assert!(close(at(CollectiveOp::AllGather, 4, &shard, &x), 0.75 * n * per_byte));
        // Two ranks move less of it than four; one rank is a copy on the device.
        assert!(at(CollectiveOp::AllReduce, 2, &x, &x) < at(CollectiveOp::AllReduce, 4, &x, &x));
        assert!(r.node_seconds(&c(CollectiveOp::AllReduce, 1), &[&x], &[&x]) < 2.0 * n / r.rates.memory + 1e-4);
    }

    #[test]
    fn a_thin_matmul_is_less_efficient_than_a_wide_one() {
        let r = Roofline::default();
        let at = |m| MatmulShape {
            dtype: DType::BF16,
            out: DType::F32,
            ta: false,
            tb: true,
            batch: 1,
            m,
            n: 151936,
            k: 896,
        };
        let wide = r.matmul_seconds(&at(4096));
        let thin: f64 = (0..32).map(|_| r.matmul_seconds(&at(128))).sum();
        assert!(thin > 1.3 * wide, "32 thin matmuls {thin:e} s vs one wide {wide:e} s");
        // A big square matmul runs near the bf16 rate.
        let rate = 2.0 * 8192f64.powi(3) / r.matmul_seconds(&bf16_nn(8192, 8192, 8192));
        assert!(rate > 0.9 * 790e12 && rate <= 790e12, "{rate:e}");
    }

    #[test]
    fn a_deep_matmuls_last_partial_wave_is_filled_by_splitting_k() {
        // The loss's dx matmul of Mistral-Nemo's shape (k = the vocabulary): a few waves of
        // tiles, the last one partial, at any chunk of rows; split-K (or stream-K) fills it, so
        // no chunk is priced far below the tensor cores' rate (a step where the tiles first
        // reach the multiprocessors' count would make chunk choices of it).
        let r = Roofline::default();
        for m in [128, 256, 384, 512, 1024, 2048] {
            let rate = 2.0 * (m * 5120 * 131072) as f64 / r.matmul_compute_seconds(&bf16_nn(m, 5120, 131072));
            let peak = r.rates.matmul_rate(DType::BF16);
            assert!(rate >= 0.9 * peak && rate <= peak * (1.0 + 1e-12), "{m} rows: {:.3} of the rate", rate / peak);
        }
    }

    #[test]
    fn wider_loss_chunks_are_predicted_faster() {
        let r = Roofline::default();
        let (x, w, t) = (ty(DType::BF16, &[4096, 896]), ty(DType::BF16, &[151936, 896]), ty(DType::I64, &[4096]));
        let out = ty(DType::F32, &[]);
        let time = |chunk| {
            let lse = ty(DType::F32, &[4096]);
            let f = r.node_seconds(&Op::LinearCrossEntropy { ignore_index: -100, chunk }, &[&x, &w, &t], &[&out, &lse]);
            let dl = ty(DType::F32, &[]);
            let b = r.node_seconds(
                &Op::LinearCrossEntropyBackward { ignore_index: -100, chunk },
                &[&x, &w, &t, &lse, &dl],
                &[&x, &w],
            );
            f + b
        };
        assert!(
            time(128) > time(1024) && time(1024) >= time(4096) * 0.99,
            "{} {} {}",
            time(128),
            time(1024),
            time(4096)
        );
    }

    #[test]
    fn measured_times_override_the_roofline_and_round_trip_through_the_file() {
        let dir = std::env::temp_dir().join(format!("rumble-cost-{}", std::process::id()));
        let s =
            MatmulShape { dtype: DType::BF16, out: DType::BF16, ta: false, tb: true, batch: 1, m: 64, n: 64, k: 64 };
        record(&dir, "Test GPU", &[(matmul_key(&s), 1e-3)]).unwrap();
        let m = Measured::load(&dir, DeviceRates { name: "Test GPU".into(), ..DeviceRates::h200() });
        let (a, b) = (ty(DType::BF16, &[64, 64]), ty(DType::BF16, &[64, 64]));
        let got = m.node_seconds(
            &Op::Matmul { ta: false, tb: true, out: None, acc: crate::ir::Addend::None },
            &[&a, &b],
            &[&a],
        );
        assert!((got - 1e-3).abs() < 1e-12, "{got}");
        let other = m.node_seconds(
            &Op::Matmul { ta: false, tb: false, out: None, acc: crate::ir::Addend::None },
            &[&a, &b],
            &[&a],
        );
        assert!(other < 1e-4, "unmeasured shapes fall back to the roofline: {other}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tensor_share_is_a_large_matmuls_nearly_all_and_a_norms_none() {
        let r = Roofline::default();
        let mm = Op::Matmul { ta: false, tb: true, out: None, acc: crate::ir::Addend::None };
        let (x, w, y) =
            (ty(DType::BF16, &[4096, 4096]), ty(DType::BF16, &[14336, 4096]), ty(DType::BF16, &[4096, 14336]));
        let big = r.tensor_share(&mm, &[&x, &w], &[&y]);
        assert!(big > 0.8 && big <= 1.0, "a large matmul is compute-bound: {big}");
        // One row: the weight's bytes, not the tensor cores, set its time.
        let (x1, y1) = (ty(DType::BF16, &[1, 4096]), ty(DType::BF16, &[1, 14336]));
        let thin = r.tensor_share(&mm, &[&x1, &w], &[&y1]);
        assert!(thin < 0.15, "a matrix-vector product is memory-bound: {thin}");
        let g = ty(DType::BF16, &[4096]);
        assert_eq!(r.tensor_share(&Op::RmsNorm { eps: 1e-5 }, &[&x, &g], &[&x]), 0.0);
        // Long attention is compute-bound: nearly all of it, at the efficiency it is priced at.
        let att = Op::Attention { scale: 0.088, causal: true, layout: crate::ir::HeadLayout::Bhtd };
        let q = ty(DType::BF16, &[1, 32, 4096, 128]);
        let (o, lse) = (q.clone(), ty(DType::F32, &[1, 32, 4096]));
        let share = r.tensor_share(&att, &[&q, &q, &q], &[&o, &lse]);
        assert!(share > 0.9 && share <= 1.0, "{share}");
    }

    /// A step of `mms` 4096-square bf16 matmuls and `adds` elementwise adds of 64M f32.
    fn load_step(mms: usize, adds: usize) -> Trace {
        use crate::ir::{Graph, OutputRole};
        let g = Graph::new("load");
        let x = g.data("x", DType::BF16, &[4096, 4096]).unwrap();
        let mut h = x.clone();
        for _ in 0..mms {
            h = h.matmul(&x).unwrap();
        }
        let v = g.data("v", DType::F32, &[1 << 26]).unwrap();
        let mut a = v.clone();
        for _ in 0..adds {
            a = a.add(&v).unwrap();
        }
        g.output_with_role(&h, "h", OutputRole::Output).unwrap();
        g.output_with_role(&a, "a", OutputRole::Output).unwrap();
        g.finish().unwrap()
    }

    /// The roofline, and a device that slows by `slowdown` at the roofline's own bf16 rate.
    #[derive(Debug)]
    struct Hot(Roofline, f64);

    impl CostModel for Hot {
        fn node_seconds(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64 {
            self.0.node_seconds(op, args, outs)
        }
        fn describe(&self) -> String {
            "hot".into()
        }
        fn sustained(&self) -> Option<Sustained> {
            Some(Sustained {
                slowdown: self.1,
                rate: self.0.rates.matmul_rate(DType::BF16),
                part: None,
                roofline: self.0.clone(),
            })
        }
    }

    #[test]
    fn the_slowdown_follows_the_part_load_measurement_between_rest_and_the_burn() {
        let at = |part| Sustained { slowdown: 1.2, rate: 1e15, part, roofline: Roofline::default() };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // Without it: linear from none to the burn's.
        let linear = at(None);
        assert!(close(linear.slowdown_at(0.0), 1.0) && close(linear.slowdown_at(0.5), 1.1));
        assert!(close(linear.slowdown_at(1.0), 1.2) && close(linear.slowdown_at(2.0), 1.2));
        // A device that does not slow at half load: nothing below it, then rising to the burn's.
        let late = at(Some((0.5, 1.0)));
        assert!(close(late.slowdown_at(0.3), 1.0) && close(late.slowdown_at(0.5), 1.0));
        assert!(close(late.slowdown_at(0.75), 1.1) && close(late.slowdown_at(1.0), 1.2));
        // One that slows early: most of it by half load.
        let early = at(Some((0.5, 1.15)));
        assert!(close(early.slowdown_at(0.25), 1.075) && close(early.slowdown_at(0.75), 1.175));
        // A part-load slowdown past the burn's (noise) is held to it, below 1 to none; a load
        // of 0 or 1 (no pattern measured) is ignored.
        assert!(close(at(Some((0.5, 1.4))).slowdown_at(0.5), 1.2));
        assert!(close(at(Some((0.5, 0.9))).slowdown_at(0.25), 1.0));
        assert!(close(at(Some((0.0, 1.1))).slowdown_at(0.5), 1.1));
        // In a step: a small model's load below the part load's stretches nothing.
        let t = load_step(8, 200);
        let hot = at(Some((0.9, 1.0)));
        let times = node_times(&Roofline::default(), &t);
        assert_eq!(hot.stretch(&t, &times), times);
    }

    #[test]
    fn a_step_slows_by_the_share_of_the_burn_its_own_tensor_load_reaches() {
        let hot = Hot(Roofline::default(), 1.2);
        let ratio = |t: &Trace| trace_seconds(&hot, t) / node_times(&hot, t).iter().sum::<f64>();
        // Matmuls alone, at the roofline's rate: nearly all of the slowdown.
        let mm = ratio(&load_step(8, 0));
        assert!(mm > 1.17 && mm <= 1.2, "{mm}");
        // The same matmuls in a step mostly of streaming adds: the load, and the share that
        // slows, are both small.
        let mixed = ratio(&load_step(8, 200));
        assert!(mixed > 1.0 && mixed < 1.02, "{mixed}");
        // No matmul: nothing slows.
        assert_eq!(ratio(&load_step(0, 10)), 1.0);
        // A model that knows no slowdown keeps its node times.
        let t = load_step(8, 20);
        let cool = Roofline::default();
        assert_eq!(step_node_times(&cool, &t), node_times(&cool, &t));
        // A slowdown below 1 (a faster device after the burn) is read as none.
        let odd = Hot(Roofline::default(), 0.9);
        assert_eq!(step_node_times(&odd, &t), node_times(&odd, &t));
    }

    #[test]
    fn tensor_flops_count_the_tensor_core_ops_in_bf16_equivalents() {
        let r = Roofline::default();
        let mm = Op::Matmul { ta: false, tb: false, out: None, acc: crate::ir::Addend::None };
        let (a, b) = (ty(DType::BF16, &[64, 128]), ty(DType::BF16, &[128, 32]));
        let y = ty(DType::BF16, &[64, 32]);
        assert_eq!(r.tensor_flops(&mm, &[&a, &b], &[&y]), (2 * 64 * 128 * 32) as f64);
        // An f32 matmul's FLOPs weigh as much more as its rate is lower.
        let (af, bf, yf) = (ty(DType::F32, &[64, 128]), ty(DType::F32, &[128, 32]), ty(DType::F32, &[64, 32]));
        let w = r.rates.matmul_rate(DType::BF16) / r.rates.matmul_rate(DType::F32);
        assert_eq!(r.tensor_flops(&mm, &[&af, &bf], &[&yf]), (2 * 64 * 128 * 32) as f64 * w);
        assert_eq!(r.tensor_flops(&Op::Binary(crate::ir::BinaryOp::Add), &[&y, &y], &[&y]), 0.0);
    }
}
