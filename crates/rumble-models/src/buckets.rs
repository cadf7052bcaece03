//! BucketShape buckets: training on batches whose sequence length (or batch size) changes, with one
//! compiled step per bucket shape instead of one per batch shape.
//!
//! A batch of `(b, t)` runs in the smallest bucket `(B, T)` with `b <= B` and `t <= T`. Its
//! tokens are padded at the end of each row (and with whole rows) by [`PAD_TOKEN`], its targets
//! by [`IGNORE_INDEX`]. The loss is the mean over non-ignored targets (`Op::CrossEntropy` and
//! `Op::LinearCrossEntropy` divide by the count of targets `!= ignore_index`, on the CPU and
//! the GPU), and attention is causal: a padded position is never attended to by a real one,
//! and its own loss is ignored, so its gradient is zero. The padded step therefore computes the
//! loss and the gradients of the unpadded batch (up to float summation order). Only the
//! causal-LM objective can be padded: `logits.sum()` would count padded positions.
//!
//! [`BucketedExecutor`] holds one trace per bucket and one set of persistent values (the
//! parameters and optimizer states shared by every bucket): on the CPU it evaluates the
//! bucket's trace; on CUDA it is `rumble_cuda::BucketedGraphs` (one graph set per bucket,
//! captured on first use, one arena sized for the largest bucket).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use rumble_core::compile::{CompileOptions, compile, optimize};
use rumble_core::ir::{InputRole, OutputRole};
use rumble_core::plan::PlanReport;
use rumble_core::{DType, Trace};
use rumble_cuda::{BucketedGraphs, GraphMode, Program};

use crate::data::Batch;
use crate::error::{ModelError, Result};
use rumble_core::exec::{BucketStats, DeviceKind, ExecStats, Executor, MemoryStats};

use crate::exec::{HostTensor, check_type};
use crate::model::IGNORE_INDEX;

/// The token id written into padded positions (any id in the vocabulary: its loss is ignored).
pub const PAD_TOKEN: i64 = 0;

/// A batch shape: sequences and tokens per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketShape {
    pub batch: usize,
    pub seq: usize,
}

impl fmt::Display for BucketShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.batch, self.seq)
    }
}

/// The bucket shapes, smallest first (by tokens, then sequence length).
#[derive(Clone, Debug, PartialEq)]
pub struct Buckets {
    shapes: Vec<BucketShape>,
}

impl Buckets {
    pub fn new(mut shapes: Vec<BucketShape>) -> Result<Buckets> {
        if shapes.is_empty() {
            return Err(ModelError::Usage("shape buckets: none given".into()));
        }
        if let Some(s) = shapes.iter().find(|s| s.batch == 0 || s.seq == 0) {
            return Err(ModelError::Usage(format!("shape bucket {s}: batch and seq must be at least 1")));
        }
        shapes.sort_by_key(|s| (s.batch * s.seq, s.seq, s.batch));
        if let Some(w) = shapes.windows(2).find(|w| w[0] == w[1]) {
            return Err(ModelError::Usage(format!("shape bucket {} is given twice", w[0])));
        }
        Ok(Buckets { shapes })
    }

    /// Buckets of `batch` sequences of each length in `list` (e.g. `"128,256,512"`).
    pub fn seqs(batch: usize, list: &str) -> Result<Buckets> {
        let seqs = list
            .split(',')
            .map(|s| {
                s.trim().parse::<usize>().map_err(|_| {
                    ModelError::Usage(format!("--buckets: `{s}` is not a sequence length (e.g. 128,256,512)"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Buckets::new(seqs.into_iter().map(|seq| BucketShape { batch, seq }).collect())
    }

    pub fn shapes(&self) -> &[BucketShape] {
        &self.shapes
    }

    /// The most sequences and the longest sequence of any bucket.
    pub fn max(&self) -> BucketShape {
        BucketShape {
            batch: self.shapes.iter().map(|s| s.batch).max().unwrap_or(0),
            seq: self.shapes.iter().map(|s| s.seq).max().unwrap_or(0),
        }
    }

    /// The index of the smallest bucket that holds a batch of `(batch, seq)`.
    pub fn choose(&self, batch: usize, seq: usize) -> Result<usize> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::Usage(format!("an empty batch ({batch}, {seq}) has no bucket")));
        }
        self.shapes.iter().position(|s| batch <= s.batch && seq <= s.seq).ok_or_else(|| {
            let all: Vec<String> = self.shapes.iter().map(|s| s.to_string()).collect();
            ModelError::Usage(format!(
                "no shape bucket holds a batch of ({batch}, {seq}); the buckets are {}",
                all.join(", ")
            ))
        })
    }
}

/// `b` padded to `to`: tokens by [`PAD_TOKEN`], targets by [`IGNORE_INDEX`], at the end of
/// each row and in whole extra rows.
pub fn pad_batch(b: &Batch, to: BucketShape) -> Result<Batch> {
    let tokens = pad_rows(&b.tokens, b.batch, b.seq, to, PAD_TOKEN, "tokens")?;
    let targets = pad_rows(&b.targets, b.batch, b.seq, to, IGNORE_INDEX, "targets")?;
    Ok(Batch { batch: to.batch, seq: to.seq, tokens, targets })
}

/// Row-major `(batch, seq)` values padded with `fill` to `(to.batch, to.seq)`.
fn pad_rows(v: &[i64], batch: usize, seq: usize, to: BucketShape, fill: i64, what: &str) -> Result<Vec<i64>> {
    if v.len() != batch * seq || batch > to.batch || seq > to.seq {
        return Err(ModelError::Usage(format!(
            "cannot pad {what} of {} values as ({batch}, {seq}) to the bucket {to}",
            v.len()
        )));
    }
    let mut out = vec![fill; to.batch * to.seq];
    for (r, row) in v.chunks(seq.max(1)).enumerate().take(batch) {
        out[r * to.seq..r * to.seq + seq].copy_from_slice(row);
    }
    Ok(out)
}

/// What a per-step data input holds, by the names `step::build_train_step` gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DataKind {
    Tokens,
    Targets,
    Other,
}

fn kind(name: &str) -> DataKind {
    let stem = name.split('.').next().unwrap_or(name);
    match stem {
        "tokens" => DataKind::Tokens,
        "targets" => DataKind::Targets,
        _ => DataKind::Other,
    }
}

/// Pads the per-step data (named `names`, unpadded) to its bucket: returns the bucket and the
/// padded data. Every `tokens` input must be i64 `[b, t]` with the same `(b, t)`, every
/// `targets` input i64 `[b*t]`; other inputs (learning rate, ...) pass unchanged.
pub fn pad_data(buckets: &Buckets, names: &[String], data: &[HostTensor]) -> Result<(usize, Vec<HostTensor>)> {
    if names.len() != data.len() {
        return Err(ModelError::Usage(format!("the step takes {} data inputs, got {}", names.len(), data.len())));
    }
    let mut shape: Option<BucketShape> = None;
    for (n, t) in names.iter().zip(data) {
        if kind(n) == DataKind::Tokens {
            let s = match t.ty.dims() {
                [b, s] if t.ty.dtype == DType::I64 => BucketShape { batch: *b, seq: *s },
                _ => return Err(ModelError::Usage(format!("input `{n}` must be i64 [batch, seq], got {}", t.ty))),
            };
            if shape.is_some_and(|x| x != s) {
                return Err(ModelError::Usage(format!(
                    "input `{n}` is {s} but an earlier tokens input is {}: one shape per step",
                    shape.unwrap_or(s)
                )));
            }
            shape = Some(s);
        }
    }
    let s = shape.ok_or_else(|| ModelError::Usage("shape buckets: the step has no `tokens` input".into()))?;
    let k = buckets.choose(s.batch, s.seq)?;
    let to = buckets.shapes[k];
    let mut out = Vec::with_capacity(data.len());
    for (n, t) in names.iter().zip(data) {
        out.push(match kind(n) {
            DataKind::Other => t.clone(),
            k @ (DataKind::Tokens | DataKind::Targets) => {
                let want = if k == DataKind::Tokens { vec![s.batch, s.seq] } else { vec![s.batch * s.seq] };
                if t.ty.dtype != DType::I64 || t.ty.dims() != want.as_slice() {
                    return Err(ModelError::Usage(format!("input `{n}` must be i64 {want:?}, got {}", t.ty)));
                }
                let fill = if k == DataKind::Tokens { PAD_TOKEN } else { IGNORE_INDEX };
                let padded = pad_rows(&t.to_i64(), s.batch, s.seq, to, fill, n)?;
                let dims = if k == DataKind::Tokens { vec![to.batch, to.seq] } else { vec![to.batch * to.seq] };
                HostTensor::from_i64(DType::I64, &dims, &padded)?
            }
        });
    }
    Ok((k, out))
}

/// A bucket's shape and what it has done (from the executor's [`BucketStats`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BucketReport {
    pub shape: BucketShape,
    pub steps: usize,
    /// Times its CUDA graphs were captured (1 after its first step; 0 on the CPU).
    pub captures: usize,
    pub capture_secs: f64,
    /// Its own plan's arena (every node's scratch included); 0 on the CPU.
    pub arena_bytes: usize,
}

impl BucketReport {
    pub fn new(shape: BucketShape, s: &BucketStats) -> BucketReport {
        BucketReport {
            shape,
            steps: s.steps,
            captures: s.captures,
            capture_secs: s.capture_secs,
            arena_bytes: s.arena_bytes,
        }
    }
}

enum Backend {
    /// `last`: the last step's bucket and every output of it.
    Cpu {
        traces: Vec<Trace>,
        state: HashMap<String, HostTensor>,
        steps: Vec<usize>,
        last: Option<(usize, Vec<HostTensor>)>,
    },
    Cuda {
        graphs: Box<BucketedGraphs>,
        reports: Vec<PlanReport>,
        build_secs: f64,
    },
}

/// One step trace per bucket, one set of persistent values; see the module doc.
pub struct BucketedExecutor {
    buckets: Buckets,
    /// The data inputs' names, in trace order (the same in every bucket's trace).
    names: Vec<String>,
    /// The persistent inputs' names, in trace order.
    persistent_names: Vec<String>,
    backend: Backend,
}

impl BucketedExecutor {
    /// `traces[i]` is the step for `buckets.shapes()[i]` (already through
    /// `compile::PIPELINE`); `persistent` holds the starting parameters and optimizer states by
    /// name. `DeviceKind::Cuda` plans and compiles every trace (capturing later, on each
    /// bucket's first step).
    pub fn new(
        buckets: Buckets,
        traces: Vec<Trace>,
        persistent: Vec<(String, HostTensor)>,
        device: DeviceKind,
    ) -> Result<BucketedExecutor> {
        Self::with_options(buckets, traces, persistent, device, &CompileOptions { passes: false, ..Default::default() })
    }

    /// As `new`, compiling each trace with `opts` (`compile::compile` on CUDA, the passes of
    /// `compile::optimize` on the CPU).
    pub fn with_options(
        buckets: Buckets,
        traces: Vec<Trace>,
        persistent: Vec<(String, HostTensor)>,
        device: DeviceKind,
        opts: &CompileOptions,
    ) -> Result<BucketedExecutor> {
        let t0 = Instant::now();
        if traces.len() != buckets.shapes.len() {
            return Err(ModelError::Usage(format!(
                "{} traces for {} shape buckets",
                traces.len(),
                buckets.shapes.len()
            )));
        }
        let names_of = |t: &Trace, pers: bool| -> Vec<String> {
            t.inputs.iter().filter(|i| i.role.is_persistent() == pers).map(|i| i.name.clone()).collect()
        };
        let names = names_of(&traces[0], false);
        let persistent_names = names_of(&traces[0], true);
        for (t, s) in traces.iter().zip(&buckets.shapes) {
            if names_of(t, false) != names || names_of(t, true) != persistent_names {
                return Err(ModelError::Usage(format!(
                    "trace `{}` (bucket {s}) has other inputs than `{}`",
                    t.name, traces[0].name
                )));
            }
            if !names.iter().any(|n| kind(n) == DataKind::Targets) {
                return Err(ModelError::Usage(format!(
                    "trace `{}`: shape buckets need the causal-LM objective (targets to ignore); \
                     padding would change a logits.sum() objective",
                    t.name
                )));
            }
            for inp in t.inputs.iter().filter(|i| i.role == InputRole::Input && kind(&i.name) == DataKind::Tokens) {
                if t.ty(inp.value).dims() != [s.batch, s.seq] {
                    return Err(ModelError::Usage(format!(
                        "trace `{}`: input `{}` is {}, its bucket is {s}",
                        t.name,
                        inp.name,
                        t.ty(inp.value)
                    )));
                }
            }
        }
        let mut given: HashMap<String, HostTensor> = persistent.into_iter().collect();
        let mut state = HashMap::new();
        let mut values = Vec::new();
        for inp in traces[0].inputs.iter().filter(|i| i.role.is_persistent()) {
            let t = given.remove(&inp.name).ok_or_else(|| {
                ModelError::Usage(format!(
                    "trace `{}`: no value given for {} `{}`",
                    traces[0].name,
                    inp.role.name(),
                    inp.name
                ))
            })?;
            check_type(&traces[0], &inp.name, traces[0].ty(inp.value), &t)?;
            values.push(t.clone());
            state.insert(inp.name.clone(), t);
        }
        if let Some(name) = given.into_keys().next() {
            return Err(ModelError::Usage(format!("trace `{}` has no input `{name}`", traces[0].name)));
        }
        let backend = match device {
            DeviceKind::Cpu => {
                let traces = traces.iter().map(|t| Ok(optimize(t, opts)?.0)).collect::<Result<Vec<_>>>()?;
                Backend::Cpu { steps: vec![0; traces.len()], traces, state, last: None }
            }
            DeviceKind::Cuda => {
                let dev = rumble_cuda::Device::new(0)?;
                let (mut progs, mut reports) = (Vec::new(), Vec::new());
                let opts = Program::compile_options(&dev, opts)?;
                for t in &traces {
                    let compiled = compile(t, &opts)?;
                    reports.push(compiled.report.clone());
                    progs.push(Arc::new(Program::new(dev.clone(), compiled.trace, compiled.plan)?));
                }
                // The planner may reorder nodes, never the inputs: values stay in trace order.
                let graphs = BucketedGraphs::new(progs, &values, GraphMode::Whole)?;
                Backend::Cuda { graphs: Box::new(graphs), reports, build_secs: t0.elapsed().as_secs_f64() }
            }
        };
        Ok(BucketedExecutor { buckets, names, persistent_names, backend })
    }

    /// The bucket shapes, smallest first.
    pub fn shapes(&self) -> &[BucketShape] {
        self.buckets.shapes()
    }
}

impl Executor for BucketedExecutor {
    type Error = ModelError;

    fn device(&self) -> DeviceKind {
        match self.backend {
            Backend::Cpu { .. } => DeviceKind::Cpu,
            Backend::Cuda { .. } => DeviceKind::Cuda,
        }
    }

    /// `data` is unpadded (any shape some bucket holds); it is padded to its bucket here.
    fn step(&mut self, data: &[HostTensor]) -> Result<Vec<HostTensor>> {
        let (k, padded) = pad_data(&self.buckets, &self.names, data)?;
        match &mut self.backend {
            Backend::Cuda { graphs, .. } => Ok(graphs.step_bucket(k, &padded)?),
            Backend::Cpu { traces, state, steps, last } => {
                let t = &traces[k];
                let mut d = padded.into_iter();
                let mut inputs = Vec::with_capacity(t.inputs.len());
                for inp in &t.inputs {
                    inputs.push(if inp.role.is_persistent() {
                        state
                            .get(&inp.name)
                            .cloned()
                            .ok_or_else(|| ModelError::Usage(format!("bucketed executor lost `{}`", inp.name)))?
                    } else {
                        d.next().ok_or_else(|| ModelError::Usage("too few data inputs".into()))?
                    });
                }
                let outs = rumble_core::cpu::eval(t, &inputs)?;
                let mut plain = Vec::new();
                for (o, v) in t.outputs.iter().zip(&outs) {
                    match o.role {
                        OutputRole::Update { of } => {
                            if let Some(inp) = t.inputs.iter().find(|i| i.value == of) {
                                state.insert(inp.name.clone(), v.clone());
                            }
                        }
                        OutputRole::Output => plain.push(v.clone()),
                        _ => {}
                    }
                }
                steps[k] += 1;
                *last = Some((k, outs));
                Ok(plain)
            }
        }
    }

    fn output(&self, name: &str) -> Result<HostTensor> {
        match &self.backend {
            Backend::Cuda { graphs, .. } => Ok(graphs.output(name)?),
            Backend::Cpu { traces, last, .. } => last
                .as_ref()
                .and_then(|(k, outs)| traces[*k].outputs.iter().position(|o| o.name == name).map(|i| outs[i].clone()))
                .ok_or_else(|| ModelError::Usage(format!("bucketed executor: no output `{name}` (or no step yet)"))),
        }
    }

    fn persistent_names(&self) -> Vec<String> {
        self.persistent_names.clone()
    }

    fn persistent(&self, name: &str) -> Result<HostTensor> {
        match &self.backend {
            Backend::Cpu { state, .. } => state
                .get(name)
                .cloned()
                .ok_or_else(|| ModelError::Usage(format!("bucketed executor has no param/opt_state `{name}`"))),
            Backend::Cuda { graphs, .. } => Ok(graphs.persistent(name)?),
        }
    }

    fn memory(&self) -> MemoryStats {
        match &self.backend {
            Backend::Cpu { .. } => MemoryStats::default(),
            Backend::Cuda { graphs, .. } => graphs.memory(),
        }
    }

    fn stats(&self) -> Option<ExecStats> {
        let Backend::Cuda { reports, build_secs, .. } = &self.backend else { return None };
        crate::cuda::cuda_stats(self.memory(), reports, None, *build_secs)
    }

    fn buckets(&self) -> Vec<BucketStats> {
        match &self.backend {
            Backend::Cpu { traces, steps, .. } => traces
                .iter()
                .zip(steps)
                .map(|(t, &steps)| BucketStats { shape: t.name.clone(), steps, ..BucketStats::default() })
                .collect(),
            Backend::Cuda { graphs, .. } => graphs.buckets(),
        }
    }
}
