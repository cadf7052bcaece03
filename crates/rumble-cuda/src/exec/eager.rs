//! The eager executor: the baseline. Launches node by node; every value gets a block from a
//! caching allocator when it is computed and gives it back after its last use, as PyTorch's
//! eager mode does. Parameters live in allocator blocks too, so its peak counts what
//! `torch.cuda.max_memory_allocated` would.

use std::sync::Arc;

use cudarc::driver::{result as drv, sys};
use rumble_core::cpu::HostTensor;

use super::{DeviceKind, Executor, MemoryStats, Program};
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::Buffers;
use crate::memory::{Block, CachingAllocator, download};

/// `(op name, milliseconds)` of each node, in node order.
pub type OpTimes = Vec<(&'static str, f64)>;

pub struct EagerExecutor {
    prog: Arc<Program>,
    alloc: CachingAllocator,
    /// The block of every live value.
    live: Vec<Option<Block>>,
    free_before: usize,
    rise: usize,
    /// Synchronise after every node (`RUMBLE_CUDA_SYNC=1`), so an asynchronous fault names
    /// its node.
    sync_each: bool,
}

impl EagerExecutor {
    pub fn new(prog: Arc<Program>, persistent: &[HostTensor]) -> Result<Self> {
        let dev = prog.dev.clone();
        let (pers_idx, _) = prog.input_split();
        prog.check_inputs(&pers_idx, persistent, "persistent")?;
        let (free_before, _) = dev.mem_info()?;
        let mut e = EagerExecutor {
            alloc: CachingAllocator::default(),
            live: vec![None; prog.trace.num_values()],
            free_before,
            rise: 0,
            sync_each: dev.knobs().sync_each,
            prog: prog.clone(),
        };
        for (&i, h) in pers_idx.iter().zip(persistent) {
            let inp = &prog.trace.inputs[i];
            let b = e.alloc.alloc(&dev, h.bytes.len(), &format!("parameter \"{}\"", inp.name))?;
            crate::memory::upload(&dev, b.ptr, &h.bytes)
                .map_err(|e| CudaError::usage(format!("uploading \"{}\": {e}", inp.name)))?;
            e.live[inp.value.index()] = Some(b);
        }
        Ok(e)
    }

    /// Value `v`, downloaded.
    fn read(&self, v: rumble_core::ValueId) -> Result<HostTensor> {
        let ty = self.prog.trace.ty(v).clone();
        let bytes = download(&self.prog.dev, self.ptr(v)?, ty.size_in_bytes())?;
        Ok(HostTensor { ty, bytes })
    }

    fn ptr(&self, v: rumble_core::ValueId) -> Result<sys::CUdeviceptr> {
        self.live[v.index()].map(|b| b.ptr).ok_or_else(|| CudaError::usage(format!("{v} is not live")))
    }

    fn release(&mut self, v: rumble_core::ValueId) {
        if let Some(b) = self.live[v.index()].take() {
            self.alloc.free(b);
        }
    }

    fn is_persistent(&self, v: rumble_core::ValueId) -> bool {
        self.prog.trace.inputs.iter().any(|i| i.value == v && i.role.is_persistent())
    }
}

impl EagerExecutor {
    /// One step with device events around every node: returns the step's outputs and each
    /// node's `(op name, milliseconds)`, in node order.
    pub fn step_profiled(&mut self, inputs: &[HostTensor]) -> Result<(Vec<HostTensor>, OpTimes)> {
        let mut events = Vec::new();
        let out = self.run(inputs, Some(&mut events))?;
        let mut times = Vec::with_capacity(events.len());
        for (n, a, b) in events {
            let ms = unsafe { drv::event::elapsed(a, b) }.ctx(|| "cuEventElapsedTime".into());
            unsafe {
                let _ = drv::event::destroy(a);
                let _ = drv::event::destroy(b);
            }
            times.push((self.prog.recipes[n].op, ms? as f64));
        }
        Ok((out, times))
    }

    fn run(
        &mut self,
        inputs: &[HostTensor],
        mut events: Option<&mut Vec<(usize, sys::CUevent, sys::CUevent)>>,
    ) -> Result<Vec<HostTensor>> {
        let p = self.prog.clone();
        let dev = p.dev.clone();
        dev.bind()?;
        let (_, step_idx) = p.input_split();
        p.check_inputs(&step_idx, inputs, "per-step")?;
        // Values kept from the last step (its outputs) go back to the allocator now.
        for v in 0..self.live.len() {
            let id = rumble_core::ValueId(v as u32);
            if !self.is_persistent(id) {
                self.release(id);
            }
        }
        for (&i, h) in step_idx.iter().zip(inputs) {
            let inp = &p.trace.inputs[i];
            let b = self.alloc.alloc(&dev, h.bytes.len(), &format!("input \"{}\"", inp.name))?;
            if !h.bytes.is_empty() {
                unsafe { drv::memcpy_htod_async(b.ptr, &h.bytes, dev.stream()) }.ctx(|| "uploading an input".into())?;
            }
            self.live[inp.value.index()] = Some(b);
        }
        dev.synchronize()?;
        let kept: Vec<bool> = {
            let mut k = vec![false; p.trace.num_values()];
            p.trace.outputs.iter().for_each(|o| k[o.value.index()] = true);
            p.trace.inputs.iter().filter(|i| i.role.is_persistent()).for_each(|i| k[i.value.index()] = true);
            k
        };
        for (n, node) in p.trace.nodes.iter().enumerate() {
            let r = &p.recipes[n];
            let mut outs = Vec::with_capacity(node.outs.len());
            for o in &node.outs {
                let bytes = p.trace.ty(*o).size_in_bytes();
                let b = self.alloc.alloc(&dev, bytes, &format!("output of node {n} ({})", r.op))?;
                self.live[o.index()] = Some(b);
                outs.push(b.ptr);
            }
            let scratch = if r.scratch > 0 { Some(self.alloc.alloc(&dev, r.scratch, "scratch")?) } else { None };
            let node_scratch =
                if r.node_scratch > 0 { Some(self.alloc.alloc(&dev, r.node_scratch, "node scratch")?) } else { None };
            let args = node.args.iter().map(|a| self.ptr(*a)).collect::<Result<Vec<_>>>()?;
            let b = Buffers {
                args: &args,
                outs: &outs,
                scratch: scratch.map(|s| s.ptr).unwrap_or(0),
                scratch_bytes: scratch.map(|s| s.size).unwrap_or(0),
                node: node_scratch.map(|s| s.ptr).unwrap_or(0),
            };
            let ev = match events.as_deref_mut() {
                Some(list) => {
                    let a = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx(|| "cuEventCreate".into())?;
                    let z = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx(|| "cuEventCreate".into())?;
                    unsafe { drv::event::record(a, dev.stream()) }.ctx(|| "cuEventRecord".into())?;
                    list.push((n, a, z));
                    Some(z)
                }
                None => None,
            };
            unsafe { r.launch(&dev, n + 1, &b)? };
            if let Some(z) = ev {
                unsafe { drv::event::record(z, dev.stream()) }.ctx(|| "cuEventRecord".into())?;
            }
            if self.sync_each {
                dev.synchronize().map_err(|e| CudaError::Launch {
                    op: r.op.to_string(),
                    kernel: format!("node {n}"),
                    err: e.to_string(),
                })?;
            }
            for s in scratch.into_iter().chain(node_scratch) {
                self.alloc.free(s);
            }
            for v in node.args.iter().chain(&node.outs) {
                if !kept[v.index()] && p.last_use[v.index()].is_none_or(|l| l <= n) {
                    self.release(*v);
                }
            }
        }
        for (out, of) in p.updates() {
            let (src, dst) = (self.ptr(out)?, self.ptr(of)?);
            let bytes = p.trace.ty(of).size_in_bytes();
            if src != dst && bytes > 0 {
                unsafe { drv::memcpy_dtod_async(dst, src, bytes, dev.stream()) }
                    .ctx(|| "writing back an update".into())?;
            }
        }
        dev.check_status(|n| p.node_name(n))?;
        if let Ok((f, _)) = dev.mem_info() {
            self.rise = self.rise.max(self.free_before.saturating_sub(f));
        }
        p.returned().into_iter().map(|i| self.output(&p.trace.outputs[i].name)).collect()
    }
}

impl Executor for EagerExecutor {
    type Error = CudaError;

    fn device(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn persistent_names(&self) -> Vec<String> {
        self.prog.persistent_names()
    }

    fn step(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.run(inputs, None)
    }

    fn output(&self, name: &str) -> Result<HostTensor> {
        let i = self.prog.output_index(name)?;
        self.read(self.prog.trace.outputs[i].value)
    }

    fn persistent(&self, name: &str) -> Result<HostTensor> {
        let i = self.prog.persistent_index(name)?;
        self.read(self.prog.trace.inputs[i].value)
    }

    fn memory(&self) -> MemoryStats {
        MemoryStats {
            peak_bytes: self.alloc.peak_allocated,
            reserved_bytes: self.alloc.peak_reserved,
            device_rise_bytes: self.rise,
        }
    }
}

impl Drop for EagerExecutor {
    fn drop(&mut self) {
        for v in 0..self.live.len() {
            self.release(rumble_core::ValueId(v as u32));
        }
        let _ = self.alloc.release_cached(&self.prog.dev);
    }
}
