//! Attention forward + backward time on the GPU: the issue-6 shapes (bf16, B=1, 32 query heads,
//! 8 kv heads, causal, head size 64 and 128, seq 2048 and 4096) and the attention of the
//! `seed-qwen2` (bf16, head size 1, 28/4 heads, seq 4096) and `seed-llama` (f32, head size 100,
//! 32 heads, seq 2048) workloads. Kernels run straight on device buffers (no executor, no
//! host copies in the timed loop), prepared as the executors prepare them: `RUMBLE_ATTENTION`
//! decides (by default cuDNN's fused attention where it times faster for the shape, `flash`
//! for rumble's kernels alone). Prints a table; `RUMBLE_ATTN_ITERS` sets the timed
//! iterations, `RUMBLE_ATTN_SHAPES=name,name` picks shapes, `RUMBLE_ATTN_LAYOUT=bthd` runs the
//! operands in the sequence-major layout `[B, T, H, D]` the models use (default `bhtd`; the
//! dump below needs `bhtd`).
//!
//! With `RUMBLE_ATTN_DUMP=DIR` it also writes each shape's inputs (q, k, v, do) and rumble's
//! results (o, lse, dq, dk, dv) as raw little-endian files, and a line of `DIR/manifest.jsonl`
//! with the shape and the times, so `bench/reference/attention_ref.py DIR` can time PyTorch's
//! `scaled_dot_product_attention` on the same inputs, check rumble's results against it, and
//! print the ratio. Without a GPU it prints "skipped: no CUDA device".

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::time::Instant;

use rumble_core::cpu::{HostTensor, Rng};
use rumble_core::ir::{DType, HeadLayout, Op, TensorType};
use rumble_cuda::Device;
use rumble_cuda::flash::choose;
use rumble_cuda::launch::{Buffers, Recipe};
use rumble_cuda::memory::{DeviceBuffer, download};
use rumble_cuda::recipe::prepare;

struct AttnShape {
    name: &'static str,
    dtype: DType,
    hq: usize,
    hkv: usize,
    t: usize,
    d: usize,
}

fn shapes() -> Vec<AttnShape> {
    let s = |name, dtype, hq, hkv, t, d| AttnShape { name, dtype, hq, hkv, t, d };
    vec![
        s("d64-t2048", DType::BF16, 32, 8, 2048, 64),
        s("d128-t2048", DType::BF16, 32, 8, 2048, 128),
        s("d64-t4096", DType::BF16, 32, 8, 4096, 64),
        s("d128-t4096", DType::BF16, 32, 8, 4096, 128),
        s("qwen2-d1-t4096", DType::BF16, 28, 4, 4096, 1),
        s("llama-f32-d100-t2048", DType::F32, 32, 32, 2048, 100),
    ]
}

/// Milliseconds per run of `r`: the median of 5 means over `iters` runs each, after 5 warm-up
/// runs (as bench/reference/attention_ref.py times PyTorch).
fn time(dev: &Device, r: &Recipe, b: &Buffers, iters: usize) -> f64 {
    for _ in 0..5 {
        unsafe { r.launch(dev, 1, b) }.expect("launch");
    }
    dev.synchronize().expect("sync");
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..iters {
                unsafe { r.launch(dev, 1, b) }.expect("launch");
            }
            dev.synchronize().expect("sync");
            t0.elapsed().as_secs_f64() * 1e3 / iters as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// Mean device milliseconds of each step of `r` over `iters` runs (CUDA events around every
/// step): `(step name, ms)`, so the backward's kernels can be told apart.
fn step_times(dev: &Device, r: &Recipe, b: &Buffers, iters: usize) -> Vec<(String, f64)> {
    use cudarc::driver::{result as drv, sys};
    let mut sums = vec![0.0; r.steps.len()];
    for _ in 0..iters {
        let mut ev: Vec<(sys::CUevent, sys::CUevent)> = Vec::new();
        let mut hook = |_i: usize, before: bool| -> rumble_cuda::Result<()> {
            if before {
                let mk = || drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).expect("event");
                ev.push((mk(), mk()));
            }
            let e = ev.last().expect("event pair");
            unsafe { drv::event::record(if before { e.0 } else { e.1 }, dev.stream()) }.expect("record");
            Ok(())
        };
        unsafe { r.launch_each(dev, 1, b, &mut hook) }.expect("launch");
        dev.synchronize().expect("sync");
        for (i, (a, z)) in ev.into_iter().enumerate() {
            sums[i] += unsafe { drv::event::elapsed(a, z) }.expect("elapsed") as f64;
            unsafe {
                let _ = drv::event::destroy(a);
                let _ = drv::event::destroy(z);
            }
        }
    }
    (0..r.steps.len()).map(|i| (r.step_name(i), sums[i] / iters as f64)).collect()
}

/// What one shape's run gives: times and the outputs (o, lse, dq, dk, dv) as bytes.
struct Run {
    /// Per kernel of the forward, then of the backward: `(name, ms)`.
    steps: Vec<(String, f64)>,
    fwd_ms: f64,
    bwd_ms: f64,
    outs: Vec<Vec<u8>>,
    inputs: Vec<HostTensor>,
}

/// Forward and backward of `sh` on fresh random inputs (the same for the same `seed`).
fn run_shape(dev: &Device, sh: &AttnShape, iters: usize, seed: u64) -> Run {
    let mut rng = Rng::new(seed);
    let (dt, b, t, d) = (sh.dtype, 1, sh.t, sh.d);
    let scale = 1.0 / (d as f64).sqrt();
    let layout = layout();
    let (qt, kt) = match layout {
        HeadLayout::Bhtd => (TensorType::new(dt, [b, sh.hq, t, d]), TensorType::new(dt, [b, sh.hkv, t, d])),
        HeadLayout::Bthd => (TensorType::new(dt, [b, t, sh.hq, d]), TensorType::new(dt, [b, t, sh.hkv, d])),
    };
    let lt = TensorType::new(rumble_core::ir::stat_dtype(dt), [b, sh.hq, t]);
    let fwd_op = Op::Attention { scale, causal: true, layout };
    let bwd_op = Op::AttentionBackward { scale, causal: true, layout };
    let fwd = prepare(dev, &fwd_op, &[&qt, &kt, &kt], &[&qt, &lt]).expect("prepare forward");
    let bwd = prepare(dev, &bwd_op, &[&qt, &kt, &kt, &qt, &lt, &qt], &[&qt, &kt, &kt]).expect("prepare backward");
    let host: Vec<HostTensor> =
        [&qt, &kt, &kt, &qt].iter().map(|ty| HostTensor::randn((*ty).clone(), 1.0, &mut rng)).collect();
    let buf = |ty: &TensorType, what: &str| DeviceBuffer::new(dev, ty.size_in_bytes(), what).expect("alloc");
    let (q, k, v, g) = (buf(&qt, "q"), buf(&kt, "k"), buf(&kt, "v"), buf(&qt, "do"));
    for (bf, h) in [&q, &k, &v, &g].iter().zip(&host) {
        bf.upload(dev, 0, &h.bytes).expect("upload");
    }
    let (o, lse) = (buf(&qt, "o"), buf(&lt, "lse"));
    let (dq, dk, dv) = (buf(&qt, "dq"), buf(&kt, "dk"), buf(&kt, "dv"));
    let ws = fwd.scratch.max(bwd.scratch);
    let scratch = DeviceBuffer::new(dev, ws, "scratch").expect("scratch");
    let (fa, fo) = ([q.ptr, k.ptr, v.ptr], [o.ptr, lse.ptr]);
    let fb = Buffers { args: &fa, outs: &fo, scratch: scratch.ptr, scratch_bytes: ws, node: 0 };
    let fwd_ms = time(dev, &fwd, &fb, iters);
    let (ba, bo) = ([q.ptr, k.ptr, v.ptr, o.ptr, lse.ptr, g.ptr], [dq.ptr, dk.ptr, dv.ptr]);
    let bb = Buffers { args: &ba, outs: &bo, scratch: scratch.ptr, scratch_bytes: ws, node: 0 };
    let bwd_ms = time(dev, &bwd, &bb, iters);
    let mut steps = step_times(dev, &fwd, &fb, iters.min(5));
    steps.extend(step_times(dev, &bwd, &bb, iters.min(5)));
    dev.check_status(|_| "attention".into()).expect("device status");
    let outs = [&o, &lse, &dq, &dk, &dv].iter().map(|bf| download(dev, bf.ptr, bf.bytes).expect("download")).collect();
    Run { steps, fwd_ms, bwd_ms, outs, inputs: host }
}

/// `name ms, ...` with each kernel's name after its module's (`flash_bf16_d128_base/flash_fwd`
/// -> `fwd`).
fn kernel_times(steps: &[(String, f64)]) -> String {
    let short = |n: &str| n.rsplit('/').next().unwrap_or(n).trim_start_matches("flash_").to_string();
    steps.iter().map(|(n, ms)| format!("{} {ms:.3}", short(n))).collect::<Vec<_>>().join(", ")
}

/// `RUMBLE_ATTN_LAYOUT`: `bthd`, or `bhtd` (the default).
fn layout() -> HeadLayout {
    match std::env::var("RUMBLE_ATTN_LAYOUT").as_deref() {
        Ok("bthd") => HeadLayout::Bthd,
        Ok("bhtd") | Ok("") | Err(_) => HeadLayout::Bhtd,
        Ok(other) => panic!("RUMBLE_ATTN_LAYOUT={other:?}: expected bhtd or bthd"),
    }
}

fn main() {
    let Some(dev) = common::device() else { return };
    let iters: usize = std::env::var("RUMBLE_ATTN_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let pick = std::env::var("RUMBLE_ATTN_SHAPES").ok();
    let dump = std::env::var("RUMBLE_ATTN_DUMP").ok().map(std::path::PathBuf::from);
    if let Some(d) = &dump {
        assert_eq!(layout(), HeadLayout::Bhtd, "RUMBLE_ATTN_DUMP writes bhtd files: unset RUMBLE_ATTN_LAYOUT");
        std::fs::create_dir_all(d).expect("dump dir");
        let _ = std::fs::remove_file(d.join("manifest.jsonl"));
    }
    println!("device: {} ({}), {} SMs", dev.name, dev.arch, dev.multiprocessors);
    let chosen: Vec<AttnShape> =
        shapes().into_iter().filter(|s| pick.as_ref().is_none_or(|p| p.split(',').any(|x| x == s.name))).collect();
    println!(
        "attention fwd+bwd, B=1, causal, layout {} (ms; TFLOP/s counts causal matmul flops, bwd = 2.5 x fwd)",
        layout().name()
    );
    println!(
        "{:<22} {:<5} {:>3}/{:<3} {:>5} {:>4} {:>9} {:>9} {:>9} {:>8}  kernels",
        "shape", "dtype", "hq", "kv", "seq", "d", "fwd", "bwd", "total", "TFLOP/s"
    );
    for (i, sh) in chosen.iter().enumerate() {
        let (dt, b, t, d) = (sh.dtype, 1, sh.t, sh.d);
        let scale = 1.0 / (d as f64).sqrt();
        let Run { steps, fwd_ms, bwd_ms, outs, inputs } = run_shape(&dev, sh, iters, 7 + i as u64);
        let flops = 4.0 * (b * sh.hq) as f64 * (t as f64) * (t as f64) * d as f64 / 2.0;
        let tflops = 3.5 * flops / ((fwd_ms + bwd_ms) * 1e-3) / 1e12;
        let kind = match choose(dev.capability, dt, d, &dev.knobs()) {
            Some(v) => format!("flash {}", v.name()),
            None => "per-row".to_string(),
        };
        println!(
            "{:<22} {:<5} {:>3}/{:<3} {:>5} {:>4} {:>9.3} {:>9.3} {:>9.3} {:>8.1}  {kind}",
            sh.name,
            dt.name(),
            sh.hq,
            sh.hkv,
            t,
            d,
            fwd_ms,
            bwd_ms,
            fwd_ms + bwd_ms,
            tflops
        );
        println!("{:<22} kernels: {}", "", kernel_times(&steps));
        if let Some(dir) = &dump {
            let save = |name: &str, bytes: &[u8]| std::fs::write(dir.join(format!("{}.{name}.bin", sh.name)), bytes);
            for (name, h) in ["q", "k", "v", "do"].iter().zip(&inputs) {
                save(name, &h.bytes).expect("dump input");
            }
            for (name, bytes) in ["o", "lse", "dq", "dk", "dv"].iter().zip(&outs) {
                save(name, bytes).expect("dump output");
            }
            let line = serde_json::json!({
                "name": sh.name, "dtype": dt.name(), "b": b, "hq": sh.hq, "hkv": sh.hkv, "t": t, "d": d,
                "causal": true, "scale": scale, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "kernels": kind,
            });
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("manifest.jsonl"))
                .expect("manifest");
            writeln!(f, "{line}").expect("manifest line");
        }
    }
}
