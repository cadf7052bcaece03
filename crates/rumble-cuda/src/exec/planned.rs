//! The planned executor: one arena and one persistent region, allocated once from the plan,
//! every node launched with its slots' addresses. [`Placed`] (the buffers and each node's
//! resolved addresses) is shared with the graphed executor; its buffers are reference-counted
//! so several programs (shape buckets) can be placed over the same arena and persistent region.

use std::sync::Arc;

use cudarc::driver::{result as drv, sys};
use rumble_core::cpu::HostTensor;
use rumble_core::plan::Region;

use super::{DeviceKind, Executor, MemoryStats, Program};
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::Buffers;
use crate::memory::{DeviceBuffer, download};

/// A program's buffers placed in device memory, with each node's addresses resolved.
pub(crate) struct Placed {
    pub prog: Arc<Program>,
    /// At least `plan.arena_bytes` (shape buckets share one sized for the largest).
    pub arena: Arc<DeviceBuffer>,
    /// At least `plan.persistent_bytes`, laid out as the plan says.
    pub persistent: Arc<DeviceBuffer>,
    /// Per node: operand and output addresses.
    pub addrs: Vec<(Vec<sys::CUdeviceptr>, Vec<sys::CUdeviceptr>)>,
    /// Free device bytes before the executor allocated anything.
    pub free_before: usize,
}

impl Placed {
    /// Refuses a plan larger than the free device memory before allocating or launching
    /// anything; then allocates and uploads the persistent inputs.
    pub fn new(prog: Arc<Program>, persistent: &[HostTensor]) -> Result<Placed> {
        let dev = prog.dev.clone();
        let (pers_idx, _) = prog.input_split();
        prog.check_inputs(&pers_idx, persistent, "persistent")?;
        let plan = &prog.plan;
        let (free, _) = dev.mem_info()?;
        let needed = plan.arena_bytes + plan.persistent_bytes;
        if needed > free {
            return Err(CudaError::OutOfMemory {
                what: format!(
                    "the plan of `{}` (arena {} + persistent {} bytes)",
                    prog.trace.name, plan.arena_bytes, plan.persistent_bytes
                ),
                needed,
                free,
            });
        }
        let arena = Arc::new(DeviceBuffer::new(&dev, plan.arena_bytes, "the arena")?);
        let pers = Arc::new(DeviceBuffer::new(&dev, plan.persistent_bytes, "the persistent region")?);
        for (&i, h) in pers_idx.iter().zip(persistent) {
            let s = plan.slot(prog.trace.inputs[i].value)?;
            pers.upload(&dev, s.offset, &h.bytes)?;
        }
        Placed::on(prog, arena, pers, free)
    }

    /// Places `prog` over buffers someone else allocated (and filled: nothing is uploaded);
    /// `free_before` is the free device memory before they were allocated.
    pub fn on(
        prog: Arc<Program>,
        arena: Arc<DeviceBuffer>,
        persistent: Arc<DeviceBuffer>,
        free_before: usize,
    ) -> Result<Placed> {
        let plan = &prog.plan;
        if arena.bytes < plan.arena_bytes || persistent.bytes < plan.persistent_bytes {
            return Err(CudaError::usage(format!(
                "`{}` needs an arena of {} and a persistent region of {} bytes; given {} and {}",
                prog.trace.name, plan.arena_bytes, plan.persistent_bytes, arena.bytes, persistent.bytes
            )));
        }
        let mut placed = Placed { prog: prog.clone(), arena, persistent, addrs: Vec::new(), free_before };
        let mut addrs = Vec::with_capacity(prog.trace.nodes.len());
        for node in &prog.trace.nodes {
            let a = node.args.iter().map(|v| placed.ptr(*v)).collect::<Result<Vec<_>>>()?;
            let o = node.outs.iter().map(|v| placed.ptr(*v)).collect::<Result<Vec<_>>>()?;
            addrs.push((a, o));
        }
        placed.addrs = addrs;
        Ok(placed)
    }

    pub fn ptr(&self, v: rumble_core::ValueId) -> Result<sys::CUdeviceptr> {
        let s = self.prog.plan.slot(v)?;
        let base = if s.region == Region::Arena { self.arena.ptr } else { self.persistent.ptr };
        Ok(base + s.offset as u64)
    }

    /// Enqueues nodes `range` (no allocation, no synchronisation: capturable).
    pub fn launch(&self, range: std::ops::Range<usize>) -> Result<()> {
        self.launch_each(range, &mut |_, _, _| Ok(()))
    }

    /// [`Placed::launch`] calling `hook(node, step, before)` just before and just after
    /// enqueuing each step of each launched node (see [`crate::launch::Recipe::launch_each`]).
    fn launch_each(
        &self,
        range: std::ops::Range<usize>,
        hook: &mut dyn FnMut(usize, usize, bool) -> Result<()>,
    ) -> Result<()> {
        let p = &self.prog;
        let main = p.dev.stream();
        for n in range.clone() {
            // Collectives of several ranks run beside the step until their join (`side.rs`).
            if let Some(s) = &p.side {
                // SAFETY: the device's own stream, in the context the side stream was made in.
                unsafe { s.join(main, n, &range)? };
            }
            if p.is_view_node(n) {
                continue;
            }
            let (args, outs) = &self.addrs[n];
            if let (Some(s), Some(crate::launch::Step::Collective(c))) = (&p.side, p.recipes[n].steps.first())
                && let Some(k) = s.at(n)
            {
                // SAFETY: as above.
                let stream = unsafe { s.fork(main)? };
                unsafe { c.launch_on(stream, args[0], outs[0])? };
                s.issued(k)?;
                continue;
            }
            let node = p.plan.scratch.get(n).copied().flatten().map_or(0, |s| self.arena.ptr + s.offset as u64);
            let (off, scratch_bytes) = p.scratch_range(n);
            let b = Buffers { args, outs, scratch: self.arena.ptr + off as u64, scratch_bytes, node };
            unsafe { p.recipes[n].launch_each(&p.dev, n + 1, &b, &mut |i, before| hook(n, i, before))? };
        }
        // Every collective of the range is joined by its end (a captured graph ends joined).
        if let Some(s) = &p.side {
            // SAFETY: as above.
            unsafe { s.join(main, range.end, &range)? };
        }
        Ok(())
    }

    /// Like [`Placed::launch`] but with a device event before and after every step of every
    /// launched node; synchronises and returns `(node, step, milliseconds)`, in launch order.
    pub fn launch_timed(&self, range: std::ops::Range<usize>) -> Result<Vec<(usize, usize, f64)>> {
        let p = &self.prog;
        let mut events: Vec<(usize, usize, sys::CUevent, sys::CUevent)> = Vec::new();
        let stream = p.dev.stream();
        let mut hook = |n: usize, i: usize, before: bool| -> Result<()> {
            let e = if before {
                let a = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx(|| "cuEventCreate".into())?;
                let z = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx(|| "cuEventCreate".into())?;
                events.push((n, i, a, z));
                a
            } else {
                events.last().map(|e| e.3).ok_or_else(|| CudaError::usage("profile: no open event"))?
            };
            unsafe { drv::event::record(e, stream) }.ctx(|| "cuEventRecord".into())
        };
        let result = self.launch_each(range, &mut hook).and_then(|()| p.dev.synchronize());
        // Every event is destroyed, whatever failed.
        let mut times = Vec::with_capacity(events.len());
        let mut result = result;
        for (n, i, a, z) in events {
            let ms = unsafe { drv::event::elapsed(a, z) }.ctx(|| "cuEventElapsedTime".into());
            unsafe {
                let _ = drv::event::destroy(a);
                let _ = drv::event::destroy(z);
            }
            match ms {
                Ok(ms) => times.push((n, i, ms as f64)),
                Err(e) if result.is_ok() => result = Err(e),
                Err(_) => {}
            }
        }
        result.map(|()| times)
    }

    /// Enqueues the plan's copy-backs of `Update` outputs into their persistent slots (an
    /// update computed elsewhere than its parameter's slot), one after another.
    pub fn write_back_updates(&self) -> Result<()> {
        for (out, of) in self.prog.copy_backs() {
            let (src, dst) = (self.ptr(out)?, self.ptr(of)?);
            let bytes = self.prog.trace.ty(of).size_in_bytes();
            if src != dst && bytes > 0 {
                unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.prog.dev.stream()) }
                    .ctx(|| "writing an update back to its parameter".into())?;
            }
        }
        Ok(())
    }

    pub fn read(&self, v: rumble_core::ValueId) -> Result<HostTensor> {
        let ty = self.prog.trace.ty(v).clone();
        let bytes = download(&self.prog.dev, self.ptr(v)?, ty.size_in_bytes())?;
        Ok(HostTensor { ty, bytes })
    }

    pub fn check(&self) -> Result<()> {
        let p = &self.prog;
        p.dev.check_status(|n| p.node_name(n))
    }

    pub fn stats(&self) -> MemoryStats {
        let held = self.arena.bytes + self.persistent.bytes;
        let rise = self.prog.dev.mem_info().map(|(f, _)| self.free_before.saturating_sub(f)).unwrap_or(0);
        MemoryStats { peak_bytes: held, reserved_bytes: held, device_rise_bytes: rise }
    }

    pub fn output(&self, name: &str) -> Result<HostTensor> {
        let i = self.prog.output_index(name)?;
        self.read(self.prog.trace.outputs[i].value)
    }

    pub fn persistent_value(&self, name: &str) -> Result<HostTensor> {
        let i = self.prog.persistent_index(name)?;
        self.read(self.prog.trace.inputs[i].value)
    }
}

/// Op by op in the plan's arena.
pub struct PlannedExecutor {
    placed: Placed,
    rise: usize,
}

impl PlannedExecutor {
    pub fn new(prog: Arc<Program>, persistent: &[HostTensor]) -> Result<Self> {
        Ok(PlannedExecutor { placed: Placed::new(prog, persistent)?, rise: 0 })
    }

    /// Fills the whole arena with `byte` (tests poison it, so an output a kernel fails to
    /// write shows up as NaN or garbage rather than a lucky zero).
    pub fn poison(&self, byte: u8) -> Result<()> {
        let a = &self.placed.arena;
        crate::memory::fill(&self.placed.prog.dev, a.ptr, byte, a.bytes)
    }
}

impl PlannedExecutor {
    fn upload(&self, inputs: &[HostTensor]) -> Result<()> {
        let pl = &self.placed;
        let p = &pl.prog;
        let (_, step_idx) = p.input_split();
        p.check_inputs(&step_idx, inputs, "per-step")?;
        p.dev.bind()?;
        for (&i, h) in step_idx.iter().zip(inputs) {
            let dst = pl.ptr(p.trace.inputs[i].value)?;
            if !h.bytes.is_empty() {
                unsafe { drv::memcpy_htod_async(dst, &h.bytes, p.dev.stream()) }.ctx(|| "uploading an input".into())?;
            }
        }
        // The copies read host memory asynchronously: wait before `inputs` can go away.
        p.dev.synchronize()
    }
}

impl Executor for PlannedExecutor {
    placed_executor_methods!();

    fn step_profiled(&mut self, inputs: &[HostTensor]) -> Result<Option<Vec<(usize, usize, f64)>>> {
        self.upload(inputs)?;
        let pl = &self.placed;
        let times = pl.launch_timed(0..pl.prog.trace.nodes.len())?;
        pl.write_back_updates()?;
        pl.check()?;
        Ok(Some(times))
    }

    fn step(&mut self, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
        self.upload(inputs)?;
        let pl = &self.placed;
        let p = pl.prog.clone();
        pl.launch(0..p.trace.nodes.len())?;
        pl.write_back_updates()?;
        pl.check()?;
        self.rise = self.rise.max(pl.stats().device_rise_bytes);
        p.returned().into_iter().map(|i| pl.read(p.trace.outputs[i].value)).collect()
    }
}
