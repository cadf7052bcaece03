//! Shape buckets: several programs of one model (another batch or sequence length each) run as
//! CUDA graphs over ONE persistent region and ONE arena.
//!
//! - The persistent region (parameters, optimizer state) is shared, so every bucket's plan must
//!   put each persistent input at the same offset with the same type: [`check_shared_layout`]
//!   says which value differs first when they do not.
//! - The arena is allocated once, at the largest bucket's `arena_bytes` (every node's scratch
//!   included: it is planned per node, inside the arena); a smaller bucket uses its start. Buckets never run at the same time, and every
//!   step writes each arena value before reading it, so nothing stale crosses buckets.
//! - A bucket's graphs are captured on its first step and cached; the capture's seconds are
//!   reported per bucket ([`BucketStats`]).
//! - Buckets may be different programs over the same persistent values: their per-step inputs
//!   and returned outputs are their own (a training step takes the learning rate and returns
//!   the gradient norm; its forward-only validation program takes tokens and targets and
//!   returns the loss). [`check_step_inputs`] refuses only a bucket given twice (the same
//!   program, the same per-step inputs); [`BucketedGraphs::bucket_of`] refuses inputs that
//!   more than one bucket takes (the caller then names the bucket: `step_bucket`).
//!
//! **Architecture Invariant**: a bucketed executor holds `max(arena) + persistent` device bytes
//! (the largest bucket's plan peak), never the sum over buckets.

use std::sync::Arc;
use std::time::Instant;

use rumble_core::cpu::HostTensor;
use rumble_core::ir::{TensorType, Trace};
use rumble_core::plan::{MemoryPlan, Region};

use super::graphed::{GraphMode, GraphedExecutor};
use super::planned::Placed;
use super::{BucketStats, DeviceKind, Executor, MemoryStats, Program};
use crate::error::{CudaError, Result};
use crate::memory::{DeviceBuffer, download};

/// Checks that every `(trace, plan)` lays its persistent inputs out exactly as the first:
/// the same names, roles and types at the same offsets, and the same region size. The error
/// names the bucket and the first value that differs.
pub fn check_shared_layout(buckets: &[(&Trace, &MemoryPlan)]) -> Result<()> {
    let Some(&(t0, p0)) = buckets.first() else {
        return Err(CudaError::usage("shape buckets: no program given"));
    };
    let layout = |t: &Trace, p: &MemoryPlan| -> Result<Vec<(String, String, usize, usize)>> {
        let mut out = Vec::new();
        for i in t.inputs.iter().filter(|i| i.role.is_persistent()) {
            let s = p.slot(i.value)?;
            if s.region != Region::Persistent {
                return Err(CudaError::usage(format!(
                    "`{}`: {} \"{}\" is not in the persistent region",
                    t.name,
                    i.role.name(),
                    i.name
                )));
            }
            out.push((i.name.clone(), format!("{} {}", i.role.name(), t.ty(i.value)), s.offset, s.bytes));
        }
        Ok(out)
    };
    let first = layout(t0, p0)?;
    for (k, &(t, p)) in buckets.iter().enumerate().skip(1) {
        let mine = layout(t, p)?;
        let bad = |m: String| {
            CudaError::usage(format!("shape bucket {k} (`{}`) cannot share bucket 0's persistent region: {m}", t.name))
        };
        for (n, (name, what, off, bytes)) in first.iter().enumerate() {
            let Some((_, w, o, b)) = mine.iter().find(|x| &x.0 == name) else {
                return Err(bad(format!("it has no persistent input \"{name}\" ({what})")));
            };
            if (w, o, b) != (what, off, bytes) {
                return Err(bad(format!(
                    "persistent input {n} \"{name}\" is {what} at offset {off} ({bytes} bytes) in bucket 0 \
                     but {w} at offset {o} ({b} bytes) here"
                )));
            }
        }
        if let Some((name, w, ..)) = mine.iter().find(|x| !first.iter().any(|f| f.0 == x.0)) {
            return Err(bad(format!("bucket 0 has no persistent input \"{name}\" ({w})")));
        }
        if p.persistent_bytes != p0.persistent_bytes {
            return Err(bad(format!(
                "its persistent region is {} bytes, bucket 0's {}",
                p.persistent_bytes, p0.persistent_bytes
            )));
        }
    }
    Ok(())
}

struct Bucket {
    prog: Arc<Program>,
    graphs: Option<GraphedExecutor>,
    captures: usize,
    capture_secs: f64,
    steps: usize,
}

/// One CUDA-graph set per shape bucket, captured lazily, over one shared arena and one shared
/// persistent region. [`Executor::step`] picks the bucket whose per-step input types equal the
/// inputs' (padding to a bucket is the caller's business).
pub struct BucketedGraphs {
    buckets: Vec<Bucket>,
    mode: GraphMode,
    arena: Arc<DeviceBuffer>,
    persistent: Arc<DeviceBuffer>,
    free_before: usize,
    /// The bucket of the last step (whose outputs `output` reads).
    last: Option<usize>,
    rise: usize,
}

impl BucketedGraphs {
    /// Checks that `progs` (one per bucket, same device) can share their persistent region,
    /// refuses `max(arena) + persistent` bytes larger than the free device memory, allocates
    /// both once and uploads `persistent` (the persistent inputs in trace order). Nothing is
    /// captured yet.
    pub fn new(progs: Vec<Arc<Program>>, persistent: &[HostTensor], mode: GraphMode) -> Result<Self> {
        let pairs: Vec<_> = progs.iter().map(|p| (&p.trace, &p.plan)).collect();
        check_shared_layout(&pairs)?;
        let p0 = progs[0].clone();
        let dev = p0.dev.clone();
        for (k, p) in progs.iter().enumerate().skip(1) {
            if !Arc::ptr_eq(&p.dev, &dev) {
                return Err(CudaError::usage(format!("shape bucket {k} (`{}`) is on another device", p.trace.name)));
            }
        }
        let traces: Vec<&Trace> = progs.iter().map(|p| &p.trace).collect();
        check_step_inputs(&traces)?;
        let (pers_idx, _) = p0.input_split();
        p0.check_inputs(&pers_idx, persistent, "persistent")?;
        let arena_bytes = progs.iter().map(|p| p.plan.arena_bytes).max().unwrap_or(0);
        let pers_bytes = p0.plan.persistent_bytes;
        let (free, _) = dev.mem_info()?;
        if arena_bytes + pers_bytes > free {
            return Err(CudaError::OutOfMemory {
                what: format!(
                    "{} shape buckets of `{}` (largest arena {arena_bytes} + persistent {pers_bytes} bytes)",
                    progs.len(),
                    p0.trace.name
                ),
                needed: arena_bytes + pers_bytes,
                free,
            });
        }
        let arena = Arc::new(DeviceBuffer::new(&dev, arena_bytes, "the shared arena of the shape buckets")?);
        let pers = Arc::new(DeviceBuffer::new(&dev, pers_bytes, "the persistent region")?);
        for (&i, h) in pers_idx.iter().zip(persistent) {
            pers.upload(&dev, p0.plan.slot(p0.trace.inputs[i].value)?.offset, &h.bytes)?;
        }
        let buckets = progs
            .into_iter()
            .map(|prog| Bucket { prog, graphs: None, captures: 0, capture_secs: 0.0, steps: 0 })
            .collect();
        Ok(BucketedGraphs { buckets, mode, arena, persistent: pers, free_before: free, last: None, rise: 0 })
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    pub fn program(&self, k: usize) -> Option<&Arc<Program>> {
        self.buckets.get(k).map(|b| &b.prog)
    }

    /// The bucket whose per-step inputs have exactly the types of `inputs`; an error when none
    /// or several do ([`bucket_taking`]).
    pub fn bucket_of(&self, inputs: &[HostTensor]) -> Result<usize> {
        let traces: Vec<&Trace> = self.buckets.iter().map(|b| &b.prog.trace).collect();
        let types: Vec<&TensorType> = inputs.iter().map(|h| &h.ty).collect();
        bucket_taking(&traces, &types)
    }

    /// Captures bucket `k`'s graphs unless they already are (a warm-up before timing).
    pub fn capture(&mut self, k: usize) -> Result<()> {
        let n = self.buckets.len();
        let b = self.buckets.get_mut(k).ok_or_else(|| CudaError::usage(format!("no shape bucket {k} (of {n})")))?;
        if b.graphs.is_none() {
            let t0 = Instant::now();
            let placed = Placed::on(b.prog.clone(), self.arena.clone(), self.persistent.clone(), self.free_before)?;
            b.graphs = Some(GraphedExecutor::with_placed(placed, self.mode)?);
            b.captures += 1;
            b.capture_secs += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// One step in bucket `k` (captured first if needed).
    pub fn step_bucket(&mut self, k: usize, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.capture(k)?;
        let b = &mut self.buckets[k];
        let g = b.graphs.as_mut().ok_or_else(|| CudaError::usage("bucket not captured"))?;
        self.last = None;
        let out = g.step(inputs)?;
        self.rise = self.rise.max(g.memory().device_rise_bytes);
        b.steps += 1;
        self.last = Some(k);
        Ok(out)
    }

    /// Bytes of the one arena (the largest bucket's) and of the persistent region.
    pub fn device_bytes(&self) -> (usize, usize) {
        (self.arena.bytes, self.persistent.bytes)
    }

    /// Pinned host bytes of the captured buckets' input and output staging buffers.
    pub fn pinned_bytes(&self) -> usize {
        self.buckets.iter().filter_map(|b| b.graphs.as_ref()).map(|g| g.pinned_bytes()).sum()
    }
}

/// A trace's per-step inputs (every input that is not persistent), as `(name, type)` in trace
/// order.
pub fn step_inputs(t: &Trace) -> Vec<(&str, &TensorType)> {
    t.inputs.iter().filter(|i| !i.role.is_persistent()).map(|i| (i.name.as_str(), t.ty(i.value))).collect()
}

/// Checks that no bucket is given twice (the same program over the same per-step inputs).
/// Different programs (a step and its validation program) may take and return whatever they
/// need, even the same data; only their persistent layouts must agree
/// ([`check_shared_layout`]).
pub fn check_step_inputs(traces: &[&Trace]) -> Result<()> {
    for (k, t) in traces.iter().enumerate() {
        if let Some(j) = traces[..k].iter().position(|q| step_inputs(q) == step_inputs(t) && *q == *t) {
            return Err(CudaError::usage(format!(
                "shape buckets {j} and {k} are the same program `{}` taking {}: one bucket per shape",
                t.name,
                signature(t)
            )));
        }
    }
    Ok(())
}

/// The one bucket among `traces` whose per-step inputs have exactly the types `given`: an
/// error naming the buckets when none does, or when several do (a step and a program with the
/// same data inputs, say: the caller must then pick the bucket itself).
pub fn bucket_taking(traces: &[&Trace], given: &[&TensorType]) -> Result<usize> {
    let fits = |t: &Trace| {
        let s = step_inputs(t);
        s.len() == given.len() && s.iter().zip(given).all(|((_, ty), g)| ty == g)
    };
    let all: Vec<usize> = (0..traces.len()).filter(|&k| fits(traces[k])).collect();
    let types = || given.iter().map(|t| t.to_string()).collect::<Vec<_>>();
    match all.as_slice() {
        [k] => Ok(*k),
        [] => {
            let have: Vec<String> = traces.iter().map(|t| signature(t)).collect();
            Err(CudaError::usage(format!("no shape bucket takes inputs {:?}; the buckets take {have:?}", types())))
        }
        many => {
            let which: Vec<String> = many.iter().map(|&k| format!("{k} (`{}`)", traces[k].name)).collect();
            Err(CudaError::usage(format!(
                "inputs {:?} fit shape buckets {}: name the bucket to run (step_bucket)",
                types(),
                which.join(" and ")
            )))
        }
    }
}

/// `trace: name type, ...` of a bucket's per-step inputs.
fn signature(t: &Trace) -> String {
    let tys: Vec<String> = step_inputs(t).iter().map(|(n, ty)| format!("{n} {ty}")).collect();
    format!("{}: {}", t.name, tys.join(", "))
}

impl Executor for BucketedGraphs {
    type Error = CudaError;

    fn device(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn persistent_names(&self) -> Vec<String> {
        self.buckets[0].prog.persistent_names()
    }

    fn step(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        let k = self.bucket_of(inputs)?;
        self.step_bucket(k, inputs)
    }

    fn output(&self, name: &str) -> Result<HostTensor> {
        let g = self
            .last
            .and_then(|k| self.buckets[k].graphs.as_ref())
            .ok_or_else(|| CudaError::usage(format!("output \"{name}\": no step has run yet")))?;
        g.output(name)
    }

    fn persistent(&self, name: &str) -> Result<HostTensor> {
        let p = &self.buckets[0].prog;
        let i = p.persistent_index(name)?;
        let v = p.trace.inputs[i].value;
        let ty = p.trace.ty(v).clone();
        let off = p.plan.slot(v)?.offset;
        let bytes = download(&p.dev, self.persistent.ptr + off as u64, ty.size_in_bytes())?;
        Ok(HostTensor { ty, bytes })
    }

    fn memory(&self) -> MemoryStats {
        let held = self.arena.bytes + self.persistent.bytes;
        let dev = &self.buckets[0].prog.dev;
        let now = dev.mem_info().map(|(f, _)| self.free_before.saturating_sub(f)).unwrap_or(0);
        MemoryStats { peak_bytes: held, reserved_bytes: held, device_rise_bytes: self.rise.max(now) }
    }

    fn buckets(&self) -> Vec<BucketStats> {
        self.buckets
            .iter()
            .map(|b| BucketStats {
                shape: signature(&b.prog.trace),
                arena_bytes: b.prog.plan.arena_bytes,
                plan_peak_bytes: b.prog.plan.peak_bytes(),
                captures: b.captures,
                capture_secs: b.capture_secs,
                steps: b.steps,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumble_core::compile::{CompileOptions, plan};
    use rumble_core::ir::DType;
    use rumble_core::testing::TinyLlama;

    fn planned(batch: usize, seq: usize, dim: usize) -> (Trace, MemoryPlan) {
        let c =
            TinyLlama { vocab: 64, dim, heads: 4, kv_heads: 2, hidden: 48, layers: 2, batch, seq, dtype: DType::F32 };
        let t = c.loss_graph().expect("builds").finish().expect("verifies");
        let p = plan(&t, &CompileOptions::default()).expect("plans");
        (p.trace, p.plan)
    }

    #[test]
    fn buckets_of_one_model_share_the_persistent_layout() {
        let (a, b, c) = (planned(2, 16, 32), planned(2, 32, 32), planned(4, 8, 32));
        check_shared_layout(&[(&a.0, &a.1), (&b.0, &b.1), (&c.0, &c.1)]).expect("same model, same layout");
        // Another shape does change the arena.
        assert_ne!(a.1.arena_bytes, b.1.arena_bytes);
    }

    #[test]
    fn another_model_is_refused_naming_the_first_difference() {
        let (a, b) = (planned(2, 16, 32), planned(2, 16, 48));
        let e = check_shared_layout(&[(&a.0, &a.1), (&b.0, &b.1)]).unwrap_err().to_string();
        let first = a.0.inputs.iter().find(|i| i.role.is_persistent()).expect("a param").name.clone();
        assert!(e.contains("shape bucket 1") && e.contains(&format!("\"{first}\"")), "{e}");
        assert!(e.contains("param f32[64,32] at offset 0") && e.contains("param f32[64,48] at offset 0"), "{e}");
        assert!(check_shared_layout(&[]).is_err());
    }

    fn tiny(batch: usize, seq: usize) -> TinyLlama {
        TinyLlama { vocab: 64, dim: 32, heads: 4, kv_heads: 2, hidden: 48, layers: 2, batch, seq, dtype: DType::F32 }
    }

    /// A training step (SGD: its update written over the parameters, nothing per step but the
    /// data) and its forward-only program: two programs over one persistent region, with
    /// different outputs. Both are legal buckets; with the same data inputs, picking one by
    /// the inputs' types alone is refused, naming both.
    #[test]
    fn a_step_and_its_forward_may_share_the_region_with_other_outputs() {
        use rumble_core::testing::Optimizer;
        let opts = CompileOptions::default();
        let step = plan(&tiny(2, 16).train_step(Optimizer::Sgd { lr: 0.1 }).unwrap(), &opts).unwrap();
        let fwd = plan(&tiny(2, 16).loss_graph().unwrap().finish().unwrap(), &opts).unwrap();
        assert_ne!(step.trace.outputs.len(), fwd.trace.outputs.len(), "the step returns its updates too");
        check_shared_layout(&[(&step.trace, &step.plan), (&fwd.trace, &fwd.plan)]).expect("one persistent layout");
        check_step_inputs(&[&step.trace, &fwd.trace]).expect("two programs, each its own inputs and outputs");
        let ty = |d: &[usize]| TensorType::new(DType::I64, d);
        let (toks, tgts) = (ty(&[32]), ty(&[32]));
        let e = bucket_taking(&[&step.trace, &fwd.trace], &[&toks, &tgts]).unwrap_err().to_string();
        assert!(e.contains("fit shape buckets 0") && e.contains("and 1") && e.contains("step_bucket"), "{e}");
        // The same program given twice is refused; another shape of it is a bucket.
        let again = plan(&tiny(2, 16).train_step(Optimizer::Sgd { lr: 0.1 }).unwrap(), &opts).unwrap();
        let e = check_step_inputs(&[&step.trace, &fwd.trace, &again.trace]).unwrap_err().to_string();
        assert!(e.contains("shape buckets 0 and 2") && e.contains("one bucket per shape"), "{e}");
        let longer = plan(&tiny(2, 32).loss_graph().unwrap().finish().unwrap(), &opts).unwrap();
        check_step_inputs(&[&step.trace, &fwd.trace, &longer.trace]).expect("another shape");
        assert_eq!(bucket_taking(&[&step.trace, &longer.trace], &[&ty(&[64]), &ty(&[64])]).unwrap(), 1);
        let e = bucket_taking(&[&step.trace, &longer.trace], &[&ty(&[8])]).unwrap_err().to_string();
        assert!(e.contains("no shape bucket takes inputs [\"i64[8]\"]") && e.contains("tokens i64[64]"), "{e}");
    }
}
