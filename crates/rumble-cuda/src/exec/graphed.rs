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

use std::sync::Arc;

use cudarc::driver::{result as drv, sys};
use rumble_core::cpu::HostTensor;
use rumble_core::ir::Phase;
use rumble_core::plan::align_up;

use super::planned::Placed;
use super::{Executor, MemoryStats, Program};
use crate::error::{CudaError, Result, describe};
use crate::memory::PinnedBuffer;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphMode {
    /// One graph for the whole step.
    Whole,
    /// A forward graph and a backward (+ optimizer) graph over the same arena.
    ForwardBackward,
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
    segments: Vec<Segment>,
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
        let ranges = match mode {
            GraphMode::Whole => vec![("step".to_string(), 0..n)],
            GraphMode::ForwardBackward => {
                let cut = t.nodes.iter().position(|x| x.phase != Phase::Forward).unwrap_or(n);
                if let Some(bad) = t.nodes[cut..].iter().position(|x| x.phase == Phase::Forward) {
                    return Err(CudaError::usage(format!(
                        "`{}`: forward node {} comes after backward node {cut}; cannot split into two graphs",
                        t.name,
                        cut + bad
                    )));
                }
                vec![("forward".to_string(), 0..cut), ("backward".to_string(), cut..n)]
            }
        };
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
            ins,
            outs,
            pinned_in,
            pinned_out,
            capture_secs: 0.0,
            rise: 0,
        };
        let t0 = std::time::Instant::now();
        let last = ranges.len() - 1;
        for (k, (name, range)) in ranges.into_iter().enumerate() {
            let seg = g.capture(&name, range, k == 0, k == last)?;
            g.segments.push(seg);
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

    /// `(name, IR nodes, CUDA graph nodes)` of each captured graph.
    pub fn graphs(&self) -> Vec<(String, usize, usize)> {
        self.segments.iter().map(|s| (s.name.clone(), s.nodes.len(), s.graph_nodes)).collect()
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
        if self.segments.len() < 2 {
            return Err(CudaError::usage("forward() needs GraphMode::ForwardBackward"));
        }
        self.stage_inputs(inputs)?;
        self.placed.prog.dev.bind()?;
        self.replay(0)?;
        self.placed.check()?;
        self.returned()
    }

    /// Replays the backward graph after [`forward`](Self::forward).
    pub fn backward(&mut self) -> Result<()> {
        for k in 1..self.segments.len() {
            self.replay(k)?;
        }
        self.placed.check()
    }
}

impl Executor for GraphedExecutor {
    fn step(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.stage_inputs(inputs)?;
        self.placed.prog.dev.bind()?;
        for k in 0..self.segments.len() {
            self.replay(k)?;
        }
        self.placed.check()?;
        self.rise = self.rise.max(self.placed.stats().device_rise_bytes);
        self.returned()
    }
    fn output(&self, name: &str) -> Result<HostTensor> {
        self.placed.output(name)
    }
    fn persistent(&self, name: &str) -> Result<HostTensor> {
        self.placed.persistent_value(name)
    }
    fn memory(&self) -> MemoryStats {
        MemoryStats { device_rise_bytes: self.rise, ..self.placed.stats() }
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
