//! The device's own cost model: each node's time measured on the device the first time the
//! compiler asks for it.
//!
//! [`DeviceCost`] answers `CostModel::node_seconds` from, in order: the times already measured
//! on this device (`cost::Measured`, the `times3-<device>.txt` file in the kernel cache folder,
//! written by earlier probes, `--profile` and the matmul tuner); a **probe**, which runs the node
//! alone and records its time there; and the roofline, where a node cannot be probed (no cache
//! folder to remember it in, the stream is capturing a graph, its buffers would take more than
//! [`PROBE_MEMORY_FRACTION`] of the free memory, it failed to prepare, or it is a collective,
//! which alone would wait for the other ranks).
//!
//! A probe is the node as a one-node program (its operands as step inputs, its results as
//! outputs), prepared and planned like any program, in an arena filled with small numbers
//! whose low bits vary (`fill_small`: one repeated value would time matmuls fast, at the
//! clocks of tensor cores whose inputs never toggle) and zero integers (a valid index, position or
//! target for every op that reads one). It runs once to warm up, then back to back for
//! [`SUSTAIN_SECONDS`] (a step keeps the device busy at the clocks its power draw allows;
//! probed on a device at rest, the 7-8B suite cases' steps were predicted 11-16% short on an
//! H100), then [`PROBE_RUNS`] times
//! timed by CUDA events around each of its launches; before each timed run a buffer larger
//! than the L2 cache is overwritten, so the node reads its operands from device memory, as it
//! mostly does inside a step. The median run's sum of launch times is recorded. A time
//! measured by events includes the device's own gap between launches, so nothing is added
//! for launches (`cost::Measured` does the same).
//!
//! Fifty milliseconds of work is not a step's minute: a step that drives the tensor cores hard
//! keeps a device at its power limit, and the clocks sink further. So once per device a large
//! bf16 matmul is probed, run back to back for [`BURN_SECONDS`], and timed again
//! ([`sustained_slowdown`]); before that the same matmul alternates with memory-bound work for
//! as long, as a step's matmuls alternate with its norms, and is timed in that pattern
//! ([`part_load`]). The slowdowns, the burn's FLOP rate at rest and the pattern's load are
//! remembered in the times file ([`SLOWDOWN_KEY`], [`RATE_KEY`], [`PART_SLOWDOWN_KEY`],
//! [`PART_LOAD_KEY`]) and answer `CostModel::sustained`, so that `cost::step_node_times`
//! stretches a step's nodes by the slowdown at that step's own tensor-core load (a 7-8B step
//! slows by nearly all of it; a small model's, below the load at which the power limit bites,
//! by the part-load measurement's share). Probes
//! are recorded as timed; so are `--profile`'s times, measured in a step of a few hundred
//! milliseconds, and the matmul tuner's (they price a matmul inside a node only where that node
//! could not be probed).
//!
//! So the compiler weighs every variant (the fused loss's chunk rows, recomputation) by times
//! measured on the device it runs on, and `rumble plan`/`bench` predict the step from them.
//! The cost is one probe per distinct node (by `cost::node_key`: the layers of a model share
//! theirs), once per machine.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys};
use rumble_core::cost::{CostModel, DeviceRates, Measured, Roofline, Sustained, node_key, record};
use rumble_core::ir::{Addend, DType, InputRole, Op, OutputRole, Phase, TensorType, Trace, TraceInput, TraceOutput};
use rumble_core::plan::plan_naive;

use super::Program;
use super::planned::Placed;
use crate::device::Device;
use crate::error::{DriverContext, Result};
use crate::memory::DeviceBuffer;

/// Timed runs of each probe (after one warm-up); the median is kept.
pub const PROBE_RUNS: usize = 3;
/// A probe may take at most this fraction of the device's free memory.
pub const PROBE_MEMORY_FRACTION: f64 = 0.5;
/// Before its timed runs a probe runs its node back to back for this long (at most
/// [`SUSTAIN_LAUNCHES`] launches), so that it is timed at the clocks of a busy device.
const SUSTAIN_SECONDS: f64 = 0.05;
const SUSTAIN_LAUNCHES: usize = 400;
/// [`sustained_slowdown`]: how long its matmul keeps the device busy (at most
/// [`BURN_LAUNCHES`] launches), its size, and the most slowdown it reports.
const BURN_SECONDS: f64 = 1.5;
const BURN_LAUNCHES: usize = 20_000;
/// 4096 x 4096 x 4096 in bf16: 137 GFLOP, compute-bound on any GPU this runs on, three 32 MiB
/// operands.
const SLOWDOWN_DIM: usize = 4096;
pub const MAX_SLOWDOWN: f64 = 1.5;
/// The keys of the burn's slowdown and of its FLOP rate before it (FLOP/s), in the device's
/// times file.
pub const SLOWDOWN_KEY: &str = "sustained tensor-core slowdown";
pub const RATE_KEY: &str = "sustained tensor-core rate";
/// The keys of the burn at part load: the matmul's slowdown while it alternates with
/// memory-bound work, and that pattern's tensor load (the burn's FLOP rate at rest over the
/// pattern's, 0 to 1).
pub const PART_SLOWDOWN_KEY: &str = "sustained tensor-core slowdown at part load";
pub const PART_LOAD_KEY: &str = "sustained tensor-core part load";
/// The part-load burn's memory-bound work: an f32 add of this many elements (three 64 MiB
/// operands, past any current L2 cache), repeated for about as long as the matmul takes.
const FILLER_ELEMENTS: usize = 1 << 24;
/// Bytes overwritten before each timed run (more than any current GPU's L2 cache).
const SCRUB_BYTES: usize = 256 << 20;

/// Node times measured on the device on demand (see the module doc).
pub struct DeviceCost {
    dev: Arc<Device>,
    state: Mutex<State>,
}

struct State {
    measured: Measured,
    /// Keys whose probe failed (not retried).
    failed: HashSet<String>,
    probed: usize,
    scrub: Option<DeviceBuffer>,
    /// Measuring [`sustained_slowdown`] failed in this process (not retried). Once measured, its
    /// figures are in `measured` under [`SLOWDOWN_KEY`], [`RATE_KEY`], [`PART_SLOWDOWN_KEY`]
    /// and [`PART_LOAD_KEY`], like any time.
    slowdown_failed: bool,
}

impl std::fmt::Debug for DeviceCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl DeviceCost {
    /// The times measured on `dev` so far (in its kernel cache folder), over `rates`' roofline.
    pub fn new(dev: Arc<Device>, rates: DeviceRates) -> Self {
        let measured = match dev.knobs().cache {
            Some(dir) => Measured::load(&dir, rates),
            None => Measured { roofline: Roofline::new(rates), ..Default::default() },
        };
        DeviceCost {
            dev,
            state: Mutex::new(State {
                measured,
                failed: HashSet::new(),
                probed: 0,
                scrub: None,
                slowdown_failed: false,
            }),
        }
    }

    /// How many nodes this model has probed.
    pub fn probed(&self) -> usize {
        self.state.lock().map(|s| s.probed).unwrap_or(0)
    }

    fn can_probe(&self, args: &[&TensorType], outs: &[&TensorType]) -> bool {
        let capturing = unsafe { drv::stream::is_capturing(self.dev.stream()) }
            .map(|s| s != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            .unwrap_or(true);
        if capturing || self.dev.knobs().cache.is_none() {
            return false;
        }
        let bytes: usize = args.iter().chain(outs).map(|t| t.size_in_bytes()).sum();
        let free = self.dev.mem_info().map(|m| m.0).unwrap_or(0);
        ((bytes + SCRUB_BYTES) as f64) < PROBE_MEMORY_FRACTION * free as f64
    }
}

/// `cost::node_key`, and for attention which implementation runs it on `dev` (cuDNN's or the
/// flash kernels, `crate::cudnn::recipe`): a time measured for one is not the other's.
pub(crate) fn device_node_key(dev: &Device, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> String {
    let key = node_key(op, args, outs);
    match op {
        Op::Attention { .. } | Op::AttentionBackward { .. } => {
            let cudnn = crate::cudnn::recipe(dev, op, args).is_some();
            format!("{key} impl={}", if cudnn { "cudnn" } else { "kernels" })
        }
        _ => key,
    }
}

impl CostModel for DeviceCost {
    fn node_seconds(&self, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> f64 {
        let Ok(mut st) = self.state.lock() else {
            return Roofline::default().node_seconds(op, args, outs);
        };
        let key = device_node_key(&self.dev, op, args, outs);
        if let Some(s) = st.measured.get(&key) {
            return s;
        }
        // Views cost nothing in a plan (the roofline knows which nodes are views).
        let roofline = st.measured.node_seconds(op, args, outs);
        // A collective alone would wait for ranks that are not probing it.
        let collective = matches!(op, Op::Collective { .. });
        if roofline == 0.0 || collective || st.failed.contains(&key) || !self.can_probe(args, outs) {
            return roofline;
        }
        let scrub = match st.scrub.take() {
            Some(b) => Ok(b),
            None => DeviceBuffer::new(&self.dev, SCRUB_BYTES, "the cost probe's L2 scrub"),
        };
        let got = scrub.and_then(|b| {
            // Measured once per device, with the first probe, and remembered.
            self.burn(&mut st, &b);
            let r = probe(&self.dev, op, args, outs, &b);
            st.scrub = Some(b);
            r
        });
        match got {
            Ok(s) => {
                st.probed += 1;
                st.measured.times.insert(key.clone(), s);
                if let Some(dir) = self.dev.knobs().cache {
                    // A cache that cannot be written only loses the measurement.
                    let _ = record(&dir, &self.dev.name, &[(key, s)]);
                }
                s
            }
            Err(_) => {
                st.failed.insert(key);
                roofline
            }
        }
    }

    fn describe(&self) -> String {
        match self.state.lock() {
            Ok(s) => format!(
                "measured on {} ({} times, {} probed now, sustained slowdown {}), roofline elsewhere",
                s.measured.roofline.rates.name,
                s.measured.times.len(),
                s.probed,
                match s.measured.get(SLOWDOWN_KEY) {
                    Some(f) => format!("{f:.3}"),
                    None => "not measured".into(),
                }
            ),
            Err(_) => "measured on the device".into(),
        }
    }

    fn is_measured(&self) -> bool {
        true
    }

    fn sustained(&self) -> Option<Sustained> {
        let st = self.state.lock().ok()?;
        let (slowdown, rate) = (st.measured.get(SLOWDOWN_KEY)?, st.measured.get(RATE_KEY)?);
        let part = st.measured.get(PART_LOAD_KEY).zip(st.measured.get(PART_SLOWDOWN_KEY));
        Some(Sustained { slowdown, rate, part, roofline: st.measured.roofline.clone() })
    }
}

impl DeviceCost {
    /// Measures the device's slowdowns at full and part load and its burn rate
    /// ([`sustained_slowdown`]) unless all four figures are known or failed here before, and
    /// records them. A failure (too little free memory, say) is not retried in this process,
    /// whose steps are then not stretched.
    fn burn(&self, st: &mut State, scrub: &DeviceBuffer) {
        let keys = [SLOWDOWN_KEY, RATE_KEY, PART_SLOWDOWN_KEY, PART_LOAD_KEY];
        if st.slowdown_failed || keys.iter().all(|k| st.measured.get(k).is_some()) {
            return;
        }
        match sustained_slowdown(&self.dev, scrub) {
            Ok(b) => {
                let lines = [
                    (SLOWDOWN_KEY.to_string(), b.slowdown),
                    (RATE_KEY.to_string(), b.rate),
                    (PART_SLOWDOWN_KEY.to_string(), b.part_slowdown),
                    (PART_LOAD_KEY.to_string(), b.part_load),
                ];
                st.measured.times.extend(lines.iter().cloned());
                if let Some(dir) = self.dev.knobs().cache {
                    let _ = record(&dir, &self.dev.name, &lines);
                }
            }
            Err(_) => st.slowdown_failed = true,
        }
    }
}

/// Bytes of the pattern [`fill_small`] tiles a float operand with.
const PATTERN_BYTES: usize = 1 << 20;

/// Fills `bytes` at `p` with small floats of `dtype` whose low bits vary (a fixed
/// pseudo-random pattern, tiled): each element's high byte is 0x3c, so every value is small and
/// finite (0.008 to 0.03 in bf16 and f32, 1 to 1.25 in f16, about 1e-18 in f64, as the old
/// constant fill), and the other bytes are random. A tensor of one repeated value would time its matmuls fast: the tensor
/// cores draw less power on data whose bits do not change, and run at higher clocks than on a
/// step's real operands.
fn fill_small(dev: &Device, p: sys::CUdeviceptr, dtype: rumble_core::ir::DType, bytes: usize) -> Result<()> {
    let width = dtype.size_in_bytes().max(1);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut pattern = vec![0u8; PATTERN_BYTES.min(bytes).next_multiple_of(width)];
    for (i, b) in pattern.iter_mut().enumerate() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *b = if i % width == width - 1 { 0x3c } else { state as u8 };
    }
    pattern.truncate(bytes);
    crate::memory::upload(dev, p, &pattern)?;
    let mut off = pattern.len();
    while off < bytes {
        let n = pattern.len().min(bytes - off);
        unsafe { drv::memcpy_dtod_async(p + off as u64, p, n, dev.stream()) }
            .ctx(|| "probe: cuMemcpyDtoDAsync".into())?;
        off += n;
    }
    Ok(())
}

/// Seconds one run of `op` on operands of types `args` giving `outs` takes on `dev` (the
/// median of [`PROBE_RUNS`] runs; see the module doc), at the clocks of the probe
/// (`cost::step_node_times` stretches it for a node inside a step).
pub fn probe(
    dev: &Arc<Device>,
    op: &Op,
    args: &[&TensorType],
    outs: &[&TensorType],
    scrub: &DeviceBuffer,
) -> Result<f64> {
    let placed = probe_program(dev, op, args, outs)?;
    timed(dev, &placed, scrub)
}

/// How much slower the tensor cores run on a device kept busy for `BURN_SECONDS` than in a
/// probe, 1 to [`MAX_SLOWDOWN`], and the FLOP rate of that probe: a large bf16 matmul probed,
/// timed at part load first ([`part_load`]), run back to back for that long, then timed again
/// the probe's way. A step that drives the
/// tensor cores hard holds the device at its power limit for as long as it runs, and its clocks
/// sink below those a probe of tens of milliseconds sees (on an H100 the suite's 7-8B steps ran
/// 6-12% longer than their probed nodes summed, the matmuls and attention 5-16% longer, the
/// memory-bound kernels as probed).
fn sustained_slowdown(dev: &Arc<Device>, scrub: &DeviceBuffer) -> Result<Burn> {
    let t = TensorType::new(DType::BF16, [SLOWDOWN_DIM, SLOWDOWN_DIM]);
    let op = Op::Matmul { ta: false, tb: false, out: None, acc: Addend::None };
    let placed = probe_program(dev, &op, &[&t, &t], &[&t])?;
    let cold = timed(dev, &placed, scrub)?;
    let (part_load, part_slowdown) = part_load(dev, &placed, cold, scrub)?;
    for _ in 0..((BURN_SECONDS / cold.max(1e-6)) as usize).min(BURN_LAUNCHES) {
        placed.launch(0..1)?;
    }
    let hot = timed(dev, &placed, scrub)?;
    let flops = 2.0 * (SLOWDOWN_DIM as f64).powi(3);
    Ok(Burn { slowdown: (hot / cold).clamp(1.0, MAX_SLOWDOWN), rate: flops / cold.max(1e-9), part_load, part_slowdown })
}

/// What [`sustained_slowdown`] measures: the burn's slowdown and FLOP rate at rest, and at
/// part load the pattern's load and the matmul's slowdown in it.
struct Burn {
    slowdown: f64,
    rate: f64,
    part_load: f64,
    part_slowdown: f64,
}

/// The burn at part load: the matmul of `placed` (`cold` seconds at rest) alternating with
/// about as long of memory-bound work (an f32 add, [`FILLER_ELEMENTS`]), as a step alternates
/// its matmuls with norms and elementwise kernels, for [`BURN_SECONDS`]; then the matmul timed
/// inside the pattern. Returns the pattern's tensor load (`cold` over a cycle's time) and the
/// matmul's slowdown (at least 1, at most [`MAX_SLOWDOWN`]). A device whose power limit a half
/// load does not reach slows by little here, however much it slows under the full burn.
fn part_load(dev: &Arc<Device>, placed: &Placed, cold: f64, scrub: &DeviceBuffer) -> Result<(f64, f64)> {
    let x = TensorType::new(DType::F32, [FILLER_ELEMENTS]);
    let add = Op::Binary(rumble_core::ir::BinaryOp::Add);
    let filler = probe_program(dev, &add, &[&x, &x], &[&x])?;
    let fill = timed(dev, &filler, scrub)?;
    let reps = (cold / fill.max(1e-9)).round().max(1.0) as usize;
    let cycle = cold + reps as f64 * fill;
    for _ in 0..((BURN_SECONDS / cycle.max(1e-6)) as usize).min(BURN_LAUNCHES) {
        placed.launch(0..1)?;
        for _ in 0..reps {
            filler.launch(0..1)?;
        }
    }
    let mut runs = Vec::with_capacity(PROBE_RUNS);
    for _ in 0..PROBE_RUNS {
        for _ in 0..reps {
            filler.launch(0..1)?;
        }
        runs.push(placed.launch_timed(0..1)?.iter().map(|x| x.2).sum::<f64>() / 1e3);
    }
    placed.check()?;
    filler.check()?;
    runs.sort_by(f64::total_cmp);
    let mm = runs[runs.len() / 2];
    let load = (cold / (mm + reps as f64 * fill).max(1e-9)).clamp(0.0, 1.0);
    Ok((load, (mm / cold.max(1e-9)).clamp(1.0, MAX_SLOWDOWN)))
}

/// `op` as a one-node program placed in an arena, its operands filled (module doc).
fn probe_program(dev: &Arc<Device>, op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> Result<Placed> {
    let mut t = Trace::new(format!("probe {}", op.name()));
    let a: Vec<_> = args.iter().map(|ty| t.new_value((*ty).clone())).collect();
    let o: Vec<_> = outs.iter().map(|ty| t.new_value((*ty).clone())).collect();
    t.inputs = a
        .iter()
        .enumerate()
        .map(|(i, v)| TraceInput { value: *v, name: format!("arg{i}"), role: InputRole::Input })
        .collect();
    t.outputs = o
        .iter()
        .enumerate()
        .map(|(i, v)| TraceOutput { value: *v, name: format!("out{i}"), role: OutputRole::Output })
        .collect();
    t.nodes.push(rumble_core::ir::Node { op: op.clone(), args: a.clone(), outs: o, phase: Phase::Forward });
    let ws = Program::workspace_bytes(dev, &t)?;
    let prog = Arc::new(Program::new(dev.clone(), t.clone(), plan_naive(&t, ws))?);
    let placed = Placed::new(prog.clone(), &[])?;
    dev.bind()?;
    crate::memory::fill(dev, placed.arena.ptr, 0, placed.arena.bytes)?;
    // Integers count 0, 1, ... modulo the smallest leading dimension of the node's float
    // tensors: valid indices, positions and targets, spread as real ones are (all zeros would
    // make a scatter one long chain of collisions).
    let modulus = args
        .iter()
        .chain(outs)
        .filter(|t| t.dtype.is_float() && t.rank() > 0)
        .map(|t| t.dims()[0])
        .min()
        .unwrap_or(1)
        .max(1);
    for (v, ty) in a.iter().zip(args) {
        let bytes = ty.size_in_bytes();
        if bytes == 0 {
            continue;
        }
        let p = placed.ptr(*v)?;
        if ty.dtype.is_float() {
            fill_small(dev, p, ty.dtype, bytes)?;
        } else if ty.dtype.is_int() {
            let n = ty.numel();
            let host: Vec<u8> = match ty.dtype.size_in_bytes() {
                8 => (0..n).flat_map(|i| ((i % modulus) as i64).to_le_bytes()).collect(),
                4 => (0..n).flat_map(|i| ((i % modulus) as i32).to_le_bytes()).collect(),
                _ => continue,
            };
            crate::memory::upload(dev, p, &host)?;
        }
    }
    Ok(placed)
}

/// The probe's timing of the node of `placed`: warm-up, sustain, the median of [`PROBE_RUNS`].
fn timed(dev: &Device, placed: &Placed, scrub: &DeviceBuffer) -> Result<f64> {
    // Warm-up, then the node kept running for SUSTAIN_SECONDS: a step holds the device busy
    // for tens of milliseconds, at the clocks its power draw allows, not at the boost clock of
    // an idle device's first launches.
    let first: f64 = placed.launch_timed(0..1)?.iter().map(|x| x.2).sum::<f64>() / 1e3;
    let sustain = (SUSTAIN_SECONDS / first.max(1e-6)) as usize;
    for _ in 0..sustain.min(SUSTAIN_LAUNCHES) {
        placed.launch(0..1)?;
    }
    let mut runs = Vec::with_capacity(PROBE_RUNS);
    for _ in 0..PROBE_RUNS {
        unsafe { drv::memset_d8_async(scrub.ptr, 0, scrub.bytes, dev.stream()) }.ctx(|| "probe: scrub".into())?;
        let times = placed.launch_timed(0..1)?;
        runs.push(times.iter().map(|x| x.2).sum::<f64>() / 1e3);
    }
    placed.check()?;
    runs.sort_by(f64::total_cmp);
    Ok(runs[runs.len() / 2])
}
