//! What one node does on the device, as a list of steps prepared ahead of time (kernels
//! compiled, launch shapes and scalar arguments fixed) and run later with the node's buffer
//! addresses. The same [`Recipe`] serves the eager, planned and graphed executors, so they
//! launch exactly the same work.

use std::ffi::c_void;

use cudarc::driver::{result as drv, sys};

use crate::compile::Func;
use crate::device::Device;
use crate::error::{CudaError, DriverContext, Result};
use crate::matmul::MatmulKey;

/// One kernel argument.
#[derive(Clone, Debug)]
pub enum Arg {
    /// The address of operand `i`.
    In(usize),
    /// The address of output `i`.
    Out(usize),
    /// The address `offset` bytes into the node's recipe scratch ([`Recipe::scratch`] bytes:
    /// the backend's part of the node's planned scratch range, or the plan's workspace).
    Scratch(usize),
    /// The address `offset` bytes into the node's own scratch range of the plan
    /// (`MemoryPlan::scratch`, sized by `Op::scratch_bytes`), live during the node only.
    Node(usize),
    /// The address `offset` bytes into operand `i`.
    InAt(usize, usize),
    /// The address `offset` bytes into output `i`.
    OutAt(usize, usize),
    /// The device status word (see [`Device::check_status`]).
    Status,
    /// The device's block counters (`Device::counters_ptr`).
    Counters,
    /// The node's tag (its index + 1), written into the status word on bad data.
    Tag,
    I64(i64),
    I32(i32),
    F64(f64),
    /// A struct passed by value, as 8-byte words.
    Blob(Vec<u64>),
    /// A struct passed by value, as 8-byte words, with the address of each `(i, arg)`'s
    /// operand or result written into word `i` at launch (`matmul_pre`'s set of projections).
    Struct {
        words: Vec<u64>,
        addrs: Vec<(usize, Arg)>,
    },
}

impl Arg {
    /// `In(i)` for each operand index of `idx`, in order: a kernel's leading operands.
    pub fn ins(idx: &[usize]) -> Vec<Arg> {
        idx.iter().map(|&i| Arg::In(i)).collect()
    }
    /// `I64(v)` for each of `v`, in order: a kernel's trailing sizes.
    pub fn i64s(v: &[usize]) -> Vec<Arg> {
        v.iter().map(|&x| Arg::I64(x as i64)).collect()
    }
}

#[derive(Clone, Debug)]
pub enum Step {
    Kernel {
        func: Func,
        name: String,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: Vec<Arg>,
    },
    /// Zero output `out` (`bytes` bytes).
    ZeroOut {
        out: usize,
        bytes: usize,
    },
    /// Copy operand `src` to output `dst`; skipped when both are the same buffer (a view the
    /// planner aliased).
    Copy {
        src: usize,
        dst: usize,
        bytes: usize,
    },
    /// `c = op(a) op(b) + beta * c` through cuBLASLt, or `c = op(a) op(b) + addend` (read
    /// where it is, or in place when the planner put `c` over it; a row added to every row of
    /// `c` where `key.row_addend`); its workspace is `ws_bytes` of scratch at `ws`.
    Matmul {
        key: MatmulKey,
        a: Arg,
        b: Arg,
        c: Arg,
        addend: Option<Arg>,
        ws: usize,
        ws_bytes: usize,
        beta: f64,
    },
    /// cuDNN's fused attention (`crate::cudnn`): `args` are the node's operands then results
    /// in the plan's order, its scratch (`SdpaPlan::scratch` bytes) at `ws`.
    Cudnn {
        plan: std::sync::Arc<crate::cudnn::SdpaPlan>,
        args: Vec<Arg>,
        ws: usize,
    },
    /// An NCCL collective from operand 0 into output 0 on the process's communicator
    /// ([`crate::nccl`]).
    Collective(crate::nccl::Collective),
    /// The node runs on the host: the stream is synchronised, the operands downloaded, the CPU
    /// reference (`rumble_core::cpu::run_op`) run and the results uploaded into the node's
    /// output buffers. Never inside a graph: the graphed executor splits its graphs around it.
    Host {
        op: Box<rumble_core::ir::Op>,
        args: Vec<rumble_core::ir::TensorType>,
        outs: Vec<rumble_core::ir::TensorType>,
    },
}

/// Launches `func` on `stream`. With `pdl` (`Device::pdl`: sm_90 on, `RUMBLE_PDL` not 0) the
/// launch is a programmatic dependent launch: the kernel's blocks may be scheduled before the
/// kernel ahead of it in the stream has finished (once that kernel's blocks have all started,
/// or at once after a library kernel), overlapping its launch with the other's tail. That is
/// safe because every kernel rumble compiles opens with `pdl_enter()` (`kernels/prelude.cuh`),
/// which waits there until the kernel ahead has finished and its writes are visible;
/// `Device::module` refuses a source with a kernel that does not
/// (`kernels::kernels_without_pdl_enter`). Stream capture keeps the relation as a programmatic
/// edge of the graph.
///
/// # Safety
/// As `cuLaunchKernel`: `params` must match the kernel's parameters.
pub(crate) unsafe fn kernel(
    func: &Func,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
    pdl: bool,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    if !pdl {
        return unsafe { drv::launch_kernel(func.0, grid, block, smem, stream, params) };
    }
    // SAFETY: an all-zero attribute is a valid value of the C union; its id and value are set next.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    unsafe { sys::cuLaunchKernelEx(&config, func.0, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

/// The device address an address-valued [`Arg`] names.
fn addr(a: &Arg, b: &Buffers) -> Result<sys::CUdeviceptr> {
    Ok(match a {
        Arg::In(i) => b.args[*i],
        Arg::Out(i) => b.outs[*i],
        Arg::Scratch(off) => b.scratch + *off as u64,
        Arg::Node(off) => b.node + *off as u64,
        Arg::InAt(i, off) => b.args[*i] + *off as u64,
        Arg::OutAt(i, off) => b.outs[*i] + *off as u64,
        other => return Err(CudaError::usage(format!("{other:?} is not an address"))),
    })
}

/// [`Step::Host`]: the node `tag - 1` (op `name`) on the CPU reference, between device work.
fn run_on_host(
    dev: &Device,
    tag: usize,
    name: &str,
    op: &rumble_core::ir::Op,
    args: &[rumble_core::ir::TensorType],
    outs: &[rumble_core::ir::TensorType],
    b: &Buffers,
) -> Result<()> {
    let what = |why: String| CudaError::usage(format!("host node {} (`{name}`): {why}", tag.saturating_sub(1)));
    let capturing = unsafe { drv::stream::is_capturing(dev.stream()) }
        .map(|s| s != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        .unwrap_or(false);
    if capturing {
        return Err(what("cannot run inside a CUDA graph capture (the graphed executor splits around it)".into()));
    }
    let mut host = Vec::with_capacity(args.len());
    for (t, &p) in args.iter().zip(b.args) {
        host.push(crate::memory::download(dev, p, t.size_in_bytes())?);
    }
    let at: Vec<&rumble_core::ir::TensorType> = args.iter().collect();
    let ot: Vec<&rumble_core::ir::TensorType> = outs.iter().collect();
    let refs: Vec<&[u8]> = host.iter().map(|h| h.as_slice()).collect();
    let res = rumble_core::cpu::run_op(op, &at, &refs, &ot).map_err(|e| what(e.to_string()))?;
    for (bytes, &p) in res.iter().zip(b.outs) {
        if !bytes.is_empty() {
            crate::memory::upload(dev, p, bytes).map_err(|e| what(format!("uploading its results: {e}")))?;
        }
    }
    Ok(())
}

/// The prepared work of one node.
#[derive(Clone, Debug)]
pub struct Recipe {
    pub op: &'static str,
    pub steps: Vec<Step>,
    /// Scratch bytes the steps use through [`Arg::Scratch`], planned per node as the backend's
    /// part of the node's scratch range (`PlanOptions::backend_scratch`).
    pub scratch: usize,
    /// Bytes the steps use of the node's own scratch range (at most `Op::scratch_bytes`).
    pub node_scratch: usize,
}

/// Device addresses of one node's buffers.
pub struct Buffers<'a> {
    pub args: &'a [sys::CUdeviceptr],
    pub outs: &'a [sys::CUdeviceptr],
    /// The recipe's scratch ([`Arg::Scratch`]) and its size.
    pub scratch: sys::CUdeviceptr,
    pub scratch_bytes: usize,
    /// The node's own scratch range (0 when it needs none).
    pub node: sys::CUdeviceptr,
}

impl Recipe {
    /// True if the node runs on the host ([`Step::Host`]): graphs are split around it.
    pub fn is_host(&self) -> bool {
        self.steps.iter().any(|s| matches!(s, Step::Host { .. }))
    }

    /// Enqueues the node's steps on the device's stream (capturable: no allocation, no sync).
    ///
    /// # Safety
    /// The buffers must be live device allocations of the sizes the recipe was prepared for.
    pub unsafe fn launch(&self, dev: &Device, tag: usize, b: &Buffers) -> Result<()> {
        unsafe { self.launch_each(dev, tag, b, &mut |_, _| Ok(())) }
    }

    /// A short name of step `i` for profiles: the kernel's name, or the matmul's shape.
    pub fn step_name(&self, i: usize) -> String {
        match &self.steps[i] {
            Step::Kernel { name, .. } => name.clone(),
            Step::ZeroOut { .. } => "memset".into(),
            Step::Copy { .. } => "memcpy".into(),
            Step::Collective(c) => format!("nccl:{}", c.op.name()),
            Step::Cudnn { plan, .. } => {
                format!("cudnn:attention{}", if plan.graph.backward { "_backward" } else { "" })
            }
            Step::Host { .. } => format!("host:{}", self.op),
            Step::Matmul { key, .. } => format!(
                "matmul {}{}{}x{}x{}{}",
                key.dtype.name(),
                if key.batch > 1 { format!(" {}x ", key.batch) } else { " ".into() },
                key.m,
                key.n,
                key.k,
                if key.row_addend { " +row" } else { "" }
            ),
        }
    }

    /// [`Recipe::launch`] calling `hook(i, before)` just before and just after enqueuing each
    /// step `i` (profiles record events there).
    ///
    /// # Safety
    /// As for [`Recipe::launch`].
    pub unsafe fn launch_each(
        &self,
        dev: &Device,
        tag: usize,
        b: &Buffers,
        hook: &mut dyn FnMut(usize, bool) -> Result<()>,
    ) -> Result<()> {
        if b.scratch_bytes < self.scratch {
            return Err(CudaError::usage(format!(
                "op `{}` needs {} scratch bytes, got {}",
                self.op, self.scratch, b.scratch_bytes
            )));
        }
        let stream = dev.stream();
        for (i, step) in self.steps.iter().enumerate() {
            // A copy onto itself (the plan put source and result in one buffer) or of no bytes
            // enqueues nothing: no hook either, so a profile counts only what ran.
            let idle = match step {
                Step::Copy { src, dst, bytes } => b.args[*src] == b.outs[*dst] || *bytes == 0,
                Step::ZeroOut { bytes, .. } => *bytes == 0,
                _ => false,
            };
            if idle {
                continue;
            }
            hook(i, true)?;
            match step {
                Step::Kernel { func, name, grid, block, smem, args } => {
                    let mut words: Vec<Vec<u64>> = Vec::with_capacity(args.len());
                    for a in args {
                        words.push(match a {
                            Arg::In(_)
                            | Arg::Out(_)
                            | Arg::Scratch(_)
                            | Arg::Node(_)
                            | Arg::InAt(..)
                            | Arg::OutAt(..) => {
                                vec![addr(a, b)?]
                            }
                            Arg::Status => vec![dev.status_ptr()],
                            Arg::Counters => vec![dev.counters_ptr()],
                            Arg::Tag => vec![tag as u64],
                            Arg::I64(v) => vec![*v as u64],
                            Arg::I32(v) => vec![*v as u32 as u64],
                            Arg::F64(v) => vec![v.to_bits()],
                            Arg::Blob(w) => w.clone(),
                            Arg::Struct { words, addrs } => {
                                let mut w = words.clone();
                                for (i, x) in addrs {
                                    w[*i] = addr(x, b)?;
                                }
                                w
                            }
                        });
                    }
                    let mut ptrs: Vec<*mut c_void> = words.iter_mut().map(|w| w.as_mut_ptr() as *mut c_void).collect();
                    unsafe { kernel(func, *grid, (*block, 1, 1), *smem, stream, &mut ptrs, dev.pdl()) }.map_err(
                        |e| CudaError::Launch {
                            op: self.op.to_string(),
                            kernel: name.clone(),
                            err: crate::error::describe(&e),
                        },
                    )?;
                }
                Step::ZeroOut { out, bytes } => {
                    unsafe { drv::memset_d8_async(b.outs[*out], 0, *bytes, stream) }
                        .ctx(|| format!("zeroing the output of `{}`", self.op))?;
                }
                Step::Copy { src, dst, bytes } => {
                    unsafe { drv::memcpy_dtod_async(b.outs[*dst], b.args[*src], *bytes, stream) }
                        .ctx(|| format!("copying for `{}`", self.op))?;
                }
                Step::Matmul { key, a, b: bm, c, addend, ws, ws_bytes, beta } => unsafe {
                    let (pa, pb, pc) = (addr(a, b)?, addr(bm, b)?, addr(c, b)?);
                    let (pin, beta) = match addend {
                        Some(x) => (addr(x, b)?, 1.0),
                        None => (pc, *beta),
                    };
                    dev.matmul_add(key, [pa, pb, pin, pc, b.scratch + *ws as u64], *ws_bytes, beta)?
                },
                Step::Collective(c) => unsafe { c.launch(dev, b.args[0], b.outs[0])? },
                Step::Cudnn { plan, args, ws } => {
                    let ptrs = args.iter().map(|a| addr(a, b)).collect::<Result<Vec<_>>>()?;
                    unsafe { plan.execute(&ptrs, b.scratch + *ws as u64)? }
                }
                Step::Host { op, args, outs } => run_on_host(dev, tag, self.op, op, args, outs, b)?,
            }
            hook(i, false)?;
        }
        Ok(())
    }
}
