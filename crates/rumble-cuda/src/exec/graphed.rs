//! The graphed executor: the planned program captured into CUDA graphs once, then replayed.
//!
//! - [`GraphMode::Whole`]: the whole step (forward, backward, optimizer) is one graph.
//! - [`GraphMode::ForwardBackward`]: the forward nodes are one graph and the backward and
//!   optimizer nodes another; both use the one arena, so saved-for-backward values stay where
//!   the forward wrote them.
//!
//! Per-step inputs are copied from pinned host buffers into their arena slots by the first
//! graph; returned outputs (the loss) are copied into pinned host buffers by the graph that
//! computes them; `Update` outputs are copied to their parameters' slots at the end of the
//! last graph where the plan placed them elsewhere. A capture that fails is an error that says
//! why; nothing falls back to uncaptured launches.
//!
//! Host nodes (ops run on the CPU reference: `Device::set_host_ops`, `RUMBLE_HOST_OPS`, or ops
//! with no CUDA kernel) split the graphs: the step replays the graphs before a host node, runs
//! it (the stream synchronised, operands read from and results written into their arena
//! slots), then replays the graphs after it ([`parts`]). All graphs share the one arena. The
//! first and the last part are always graphs (empty ones if need be): the first copies the
//! inputs in, the last writes the updates back.

use std::sync::Arc;

use cudarc::driver::{result as drv, sys};
use rumble_core::cpu::HostTensor;
use rumble_core::ir::Phase;
use rumble_core::plan::align_up;

use super::planned::Placed;
use super::{DeviceKind, Executor, MemoryStats, Program};
use crate::error::{CudaError, Result, describe};
use crate::memory::PinnedBuffer;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphMode {
    /// One graph for the whole step.
    Whole,
    /// A forward graph and a backward (+ optimizer) graph over the same arena.
    ForwardBackward,
}

/// One part of a step, in replay order: a captured graph of nodes `range` (named), or a host
/// node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Graph(String, std::ops::Range<usize>),
    Host(usize),
}

/// The parts of a step of `n` nodes: `regions` (name, nodes) cover 0..n in order (the whole step,
/// or forward and backward); each is cut around the nodes with `host[node]` set. Graph parts of
/// a region cut in several are numbered (`forward.0`, `forward.1`, ...). A host node first or
/// last gets an empty graph before or after it.
pub fn parts(regions: &[(&str, std::ops::Range<usize>)], host: &[bool]) -> Vec<Part> {
    let mut out = Vec::new();
    for (name, r) in regions {
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        let mut start = r.start;
        let mut hosts = Vec::new();
        for i in r.clone() {
            if host.get(i).copied().unwrap_or(false) {
                runs.push(start..i);
                hosts.push(i);
                start = i + 1;
            }
        }
        runs.push(start..r.end);
        let numbered = runs.len() > 1;
        for (k, run) in runs.into_iter().enumerate() {
            // Empty runs between or around host nodes are dropped, except the step's first and
            // last (added below).
            if !run.is_empty() || !numbered {
                let label = if numbered { format!("{name}.{k}") } else { name.to_string() };
                out.push(Part::Graph(label, run));
            }
            if let Some(&h) = hosts.get(k) {
                out.push(Part::Host(h));
            }
        }
    }
    if !matches!(out.first(), Some(Part::Graph(..))) {
        out.insert(0, Part::Graph("inputs".into(), 0..0));
    }
    if !matches!(out.last(), Some(Part::Graph(..))) {
        let n = regions.last().map_or(0, |r| r.1.end);
        out.push(Part::Graph("updates".into(), n..n));
    }
    out
}

struct Segment {
    name: String,
    nodes: std::ops::Range<usize>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    graph_nodes: usize,
}

pub struct GraphedExecutor {
    placed: Placed,
    /// The captured graphs, in replay order.
    segments: Vec<Segment>,
    /// The step in order: `Ok(k)` replays `segments[k]`, `Err(node)` runs host node `node`.
    order: Vec<std::result::Result<usize, usize>>,
    /// How many entries of `order` belong to the forward (mode `ForwardBackward`).
    forward_len: usize,
    /// Per-step inputs: (trace input index, offset in `pinned_in`, bytes).
    ins: Vec<(usize, usize, usize)>,
    /// Returned outputs: (trace output index, offset in `pinned_out`, bytes).
    outs: Vec<(usize, usize, usize)>,
    pinned_in: PinnedBuffer,
    pinned_out: PinnedBuffer,
    /// Seconds spent capturing and instantiating the graphs.
    pub capture_secs: f64,
    rise: usize,
}

impl GraphedExecutor {
    pub fn new(prog: Arc<Program>, persistent: &[HostTensor], mode: GraphMode) -> Result<Self> {
        Self::with_placed(Placed::new(prog, persistent)?, mode)
    }

    /// Captures the graphs of a program already placed (its buffers possibly shared with
    /// other programs: shape buckets).
    pub(crate) fn with_placed(placed: Placed, mode: GraphMode) -> Result<Self> {
        let prog = placed.prog.clone();
        let dev = prog.dev.clone();
        let t = &prog.trace;
        let n = t.nodes.len();
        let regions: Vec<(&str, std::ops::Range<usize>)> = match mode {
            GraphMode::Whole => vec![("step", 0..n)],
            GraphMode::ForwardBackward => {
                let cut = t.nodes.iter().position(|x| x.phase != Phase::Forward).unwrap_or(n);
                if let Some(bad) = t.nodes[cut..].iter().position(|x| x.phase == Phase::Forward) {
                    return Err(CudaError::usage(format!(
                        "`{}`: forward node {} comes after backward node {cut}; cannot split into two graphs",
                        t.name,
                        cut + bad
                    )));
                }
                vec![("forward", 0..cut), ("backward", cut..n)]
            }
        };
        let host: Vec<bool> = prog.recipes.iter().map(|r| r.is_host()).collect();
        let plan = parts(&regions, &host);
        let fwd_end = if mode == GraphMode::ForwardBackward { regions[0].1.end } else { n };
        // The forward's parts: those of its nodes (and the empty input graph before them).
        let forward_len = plan
            .iter()
            .rposition(|p| match p {
                Part::Graph(_, r) => r.start < fwd_end || r.end == 0,
                Part::Host(h) => *h < fwd_end,
            })
            .map_or(0, |i| i + 1);
        let (_, step_idx) = prog.input_split();
        let mut ins = Vec::new();
        let mut off = 0;
        for &i in &step_idx {
            let bytes = t.ty(t.inputs[i].value).size_in_bytes();
            ins.push((i, off, bytes));
            off = align_up(off + bytes, 256);
        }
        let pinned_in = PinnedBuffer::new(&dev, off)?;
        let mut outs = Vec::new();
        let mut off = 0;
        for i in prog.returned() {
            let bytes = t.ty(t.outputs[i].value).size_in_bytes();
            outs.push((i, off, bytes));
            off = align_up(off + bytes, 256);
        }
        let pinned_out = PinnedBuffer::new(&dev, off)?;
        let mut g = GraphedExecutor {
            placed,
            segments: Vec::new(),
            order: Vec::new(),
            forward_len,
            ins,
            outs,
            pinned_in,
            pinned_out,
            capture_secs: 0.0,
            rise: 0,
        };
        let t0 = std::time::Instant::now();
        let graphs = plan.iter().filter(|p| matches!(p, Part::Graph(..))).count();
        for part in plan {
            match part {
                Part::Graph(name, range) => {
                    let k = g.segments.len();
                    let seg = g.capture(&name, range, k == 0, k + 1 == graphs)?;
                    g.segments.push(seg);
                    g.order.push(Ok(k));
                }
                Part::Host(node) => g.order.push(Err(node)),
            }
        }
        g.capture_secs = t0.elapsed().as_secs_f64();
        g.rise = g.placed.stats().device_rise_bytes;
        Ok(g)
    }

    /// The segment of node `n` (inputs count as segment 0).
    fn defined_in(&self, v: rumble_core::ValueId, ranges: &std::ops::Range<usize>) -> bool {
        let t = &self.placed.prog.trace;
        match t.nodes.iter().position(|x| x.outs.contains(&v)) {
            Some(n) => ranges.contains(&n),
            None => ranges.start == 0,
        }
    }

    fn capture(&self, name: &str, range: std::ops::Range<usize>, first: bool, last: bool) -> Result<Segment> {
        let p = &self.placed.prog;
        let dev = &p.dev;
        dev.bind()?;
        let stream = dev.stream();
        let what = format!("the {name} graph of `{}`", p.trace.name);
        let cap_err = |why: String| CudaError::Capture { what: what.clone(), why };
        unsafe { drv::stream::begin_capture(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(|e| cap_err(format!("cuStreamBeginCapture: {}", describe(&e))))?;
        let body = (|| -> Result<()> {
            if first {
                for &(i, off, bytes) in &self.ins {
                    let dst = self.placed.ptr(p.trace.inputs[i].value)?;
                    if bytes > 0 {
                        let src = unsafe { self.pinned_in.ptr.add(off) } as *const std::ffi::c_void;
                        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream) }
                            .result()
                            .map_err(|e| cap_err(format!("input copy: {}", describe(&e))))?;
                    }
                }
            }
            self.placed.launch(range.clone())?;
            if last {
                self.placed.write_back_updates()?;
            }
            for &(i, off, bytes) in &self.outs {
                let v = p.trace.outputs[i].value;
                if bytes > 0 && self.defined_in(v, &range) {
                    let dst = unsafe { self.pinned_out.ptr.add(off) } as *mut std::ffi::c_void;
                    unsafe { sys::cuMemcpyDtoHAsync_v2(dst, self.placed.ptr(v)?, bytes, stream) }
                        .result()
                        .map_err(|e| cap_err(format!("output copy: {}", describe(&e))))?;
                }
            }
            Ok(())
        })();
        let ended = unsafe { drv::stream::end_capture(stream) };
        let graph = match (body, ended) {
            (Ok(()), Ok(g)) => g,
            (Err(e), g) => {
                if let Ok(g) = g {
                    unsafe {
                        let _ = drv::graph::destroy(g);
                    }
                }
                return Err(cap_err(format!("while recording: {e}")));
            }
            (Ok(()), Err(e)) => return Err(cap_err(format!("cuStreamEndCapture: {}", describe(&e)))),
        };
        let mut count = 0usize;
        unsafe {
            let _ = sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count);
        }
        let exec = match unsafe { drv::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(x) => x,
            Err(e) => {
                unsafe {
                    let _ = drv::graph::destroy(graph);
                }
                return Err(cap_err(format!("cuGraphInstantiate: {}", describe(&e))));
            }
        };
        unsafe { drv::graph::upload(exec, stream) }.map_err(|e| cap_err(format!("cuGraphUpload: {}", describe(&e))))?;
        Ok(Segment { name: name.to_string(), nodes: range, graph, exec, graph_nodes: count })
    }

    /// Bytes of pinned host memory holding the per-step inputs and the returned outputs.
    pub fn pinned_bytes(&self) -> usize {
        self.pinned_in.bytes + self.pinned_out.bytes
    }

    /// `(name, IR nodes, CUDA graph nodes)` of each part of the step in order: the captured
    /// graphs, and host nodes as `host:<op>` (one IR node, no graph node).
    pub fn graphs(&self) -> Vec<(String, usize, usize)> {
        self.order
            .iter()
            .map(|o| match *o {
                Ok(k) => {
                    let s = &self.segments[k];
                    (s.name.clone(), s.nodes.len(), s.graph_nodes)
                }
                Err(n) => (format!("host:{}", self.placed.prog.recipes[n].op), 1, 0),
            })
            .collect()
    }

    /// Runs parts `range` of the step in order.
    fn run_parts(&self, range: std::ops::Range<usize>) -> Result<()> {
        for i in range {
            match self.order[i] {
                Ok(k) => self.replay(k)?,
                Err(n) => self.run_host(n)?,
            }
        }
        Ok(())
    }

    /// Host node `n`: its recipe synchronises, reads its operands from the arena, runs the CPU
    /// reference and writes its results back; a returned output it computes goes straight to
    /// its pinned slot.
    fn run_host(&self, n: usize) -> Result<()> {
        self.placed.launch(n..n + 1)?;
        let p = &self.placed.prog;
        for &(i, off, bytes) in &self.outs {
            let v = p.trace.outputs[i].value;
            if bytes > 0 && p.trace.nodes[n].outs.contains(&v) {
                let dst = unsafe { std::slice::from_raw_parts_mut(self.pinned_out.ptr.add(off), bytes) };
                unsafe { drv::memcpy_dtoh_sync(dst, self.placed.ptr(v)?) }
                    .map_err(|e| CudaError::usage(format!("output copy after host node {n}: {}", describe(&e))))?;
            }
        }
        Ok(())
    }

    fn stage_inputs(&mut self, inputs: &[HostTensor]) -> Result<()> {
        let p = self.placed.prog.clone();
        let (_, step_idx) = p.input_split();
        p.check_inputs(&step_idx, inputs, "per-step")?;
        let buf = self.pinned_in.as_mut_slice();
        for (&(_, off, bytes), h) in self.ins.iter().zip(inputs) {
            buf[off..off + bytes].copy_from_slice(&h.bytes);
        }
        Ok(())
    }

    fn replay(&self, k: usize) -> Result<()> {
        let s = &self.segments[k];
        let dev = &self.placed.prog.dev;
        unsafe { drv::graph::launch(s.exec, dev.stream()) }.map_err(|e| CudaError::Launch {
            op: format!("{} graph", s.name),
            kernel: "cuGraphLaunch".into(),
            err: describe(&e),
        })
    }

    fn returned(&self) -> Result<Vec<HostTensor>> {
        let p = &self.placed.prog;
        let buf = self.pinned_out.as_slice();
        Ok(self
            .outs
            .iter()
            .map(|&(i, off, bytes)| HostTensor {
                ty: p.trace.ty(p.trace.outputs[i].value).clone(),
                bytes: buf[off..off + bytes].to_vec(),
            })
            .collect())
    }

    /// Replays the forward graph only (mode `ForwardBackward`): returns the returned outputs
    /// computed in the forward (the loss).
    pub fn forward(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        if self.forward_len == self.order.len() {
            return Err(CudaError::usage("forward() needs GraphMode::ForwardBackward"));
        }
        self.stage_inputs(inputs)?;
        self.placed.prog.dev.bind()?;
        self.run_parts(0..self.forward_len)?;
        self.placed.check()?;
        self.returned()
    }

    /// Replays the backward graph (and its host nodes) after [`forward`](Self::forward).
    pub fn backward(&mut self) -> Result<()> {
        self.run_parts(self.forward_len..self.order.len())?;
        self.placed.check()
    }
}

impl Executor for GraphedExecutor {
    placed_executor_methods!();

    fn step(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.stage_inputs(inputs)?;
        self.placed.prog.dev.bind()?;
        self.run_parts(0..self.order.len())?;
        self.placed.check()?;
        self.rise = self.rise.max(self.placed.stats().device_rise_bytes);
        self.returned()
    }
}

impl Drop for GraphedExecutor {
    fn drop(&mut self) {
        let _ = self.placed.prog.dev.bind();
        let _ = self.placed.prog.dev.synchronize();
        for s in self.segments.drain(..) {
            unsafe {
                let _ = drv::graph::exec_destroy(s.exec);
                let _ = drv::graph::destroy(s.graph);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Part, parts};

    fn g(name: &str, r: std::ops::Range<usize>) -> Part {
        Part::Graph(name.into(), r)
    }

    #[test]
    fn graphs_split_around_host_nodes() {
        let none = vec![false; 6];
        assert_eq!(parts(&[("step", 0..6)], &none), vec![g("step", 0..6)]);
        let mut h = none.clone();
        h[2] = true;
        assert_eq!(parts(&[("step", 0..6)], &h), vec![g("step.0", 0..2), Part::Host(2), g("step.1", 3..6)]);
        // Forward and backward, a host node in each; two host nodes side by side.
        h[4] = true;
        h[5] = false;
        let fb = [("forward", 0..3), ("backward", 3..6)];
        assert_eq!(
            parts(&fb, &h),
            vec![g("forward.0", 0..2), Part::Host(2), g("backward.0", 3..4), Part::Host(4), g("backward.1", 5..6)]
        );
        // Host nodes first and last: empty graphs carry the inputs in and the updates back.
        let ends = vec![true, false, false, true];
        assert_eq!(
            parts(&[("step", 0..4)], &ends),
            vec![g("inputs", 0..0), Part::Host(0), g("step.1", 1..3), Part::Host(3), g("updates", 4..4)]
        );
        let pair = vec![false, true, true, false];
        assert_eq!(
            parts(&[("step", 0..4)], &pair),
            vec![g("step.0", 0..1), Part::Host(1), Part::Host(2), g("step.2", 3..4)]
        );
    }
}
