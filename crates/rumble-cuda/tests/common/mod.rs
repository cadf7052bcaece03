//! Helpers shared by the GPU tests and benches: the device (a test's, or a bench's printed skip), comparisons against the
//! CPU reference with per-dtype tolerances, random inputs, the tiny training step; and the
//! CPU emulator tests' setup.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rumble_core::cpu::{HostTensor, Rng};
use rumble_core::ir::{DType, TensorType};
use rumble_cuda::Device;

/// The GPU of a test that needs one. Such tests are `#[ignore = "needs a CUDA device"]`, so on a
/// machine without CUDA `cargo test` counts them as ignored, never as passed; on a GPU machine
/// run them with `cargo test -- --include-ignored` (`scripts/gpu tests` does). Included where there
/// is no device, they fail, saying why. The device runs deterministic kernels only
/// (`RUMBLE_DETERMINISTIC=1`): the tests compare executors, graphs and runs bit for bit; a test
/// of a non-deterministic kernel turns that off itself.
pub fn gpu() -> Arc<Device> {
    let dev = Device::new(0).unwrap_or_else(|e| {
        panic!("this test needs a CUDA device (run with --include-ignored only on a GPU machine): {e}")
    });
    dev.set_knobs(rumble_cuda::knobs::Knobs { deterministic: true, ..dev.knobs() });
    dev
}

/// The GPU, or `None` after printing why the bench is skipped (the benches, run by hand).
pub fn device() -> Option<Arc<Device>> {
    match Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// For a CPU emulator test: the folder `tests/{emu}` of its sources and a fresh build folder
/// under the temporary folder, or `None` after printing why the test is skipped (no `g++`, or
/// `{main}` missing: a test binary built on another machine).
pub fn emulator(emu: &str, main: &str) -> Option<(PathBuf, PathBuf)> {
    if Command::new("g++").arg("--version").output().is_err() {
        println!("skipped: no g++");
        return None;
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join(emu);
    if !here.join(main).exists() {
        println!("skipped: {} is not on this machine (a test binary built elsewhere)", here.display());
        return None;
    }
    let dir = std::env::temp_dir().join(format!("rumble-{}-{}", emu.replace('_', "-"), std::process::id()));
    std::fs::create_dir_all(&dir).expect("build dir");
    Some((here, dir))
}

/// Cuts `src` from the line starting `from` up to the one starting `to` into `dir/{header}`
/// (a kernel's text, without its entry points), then builds `here/{main}` with g++ into
/// `dir/{bin}` (the header found through `-I dir`); panics with g++'s errors.
pub fn build_emulator(here: &Path, dir: &Path, src: &str, [from, to]: [&str; 2], header: &str, main: &str) -> PathBuf {
    let (a, b) = (src.find(from).expect("start marker"), src.find(to).expect("end marker"));
    std::fs::write(dir.join(header), &src[a..b]).expect("kernel text");
    let bin = dir.join(main.trim_end_matches(".cpp"));
    let out = Command::new("g++")
        .args(["-std=c++20", "-O1", "-pthread", "-I"])
        .arg(dir)
        .arg("-o")
        .arg(&bin)
        .arg(here.join(main))
        .output()
        .expect("g++");
    assert!(out.status.success(), "g++:\n{}", String::from_utf8_lossy(&out.stderr));
    bin
}

/// Relative-error tolerance of each dtype: ||gpu - cpu|| / ||cpu||.
pub fn tolerance(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-10,
        DType::F32 => 2e-5,
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 0.0,
    }
}

/// `(relative error, max abs error)`; `Err` if types differ, NaNs appear where the
/// reference has none, or integers/bools differ.
pub fn compare(gpu: &HostTensor, cpu: &HostTensor, tol: f64) -> Result<(f64, f64), String> {
    if gpu.ty != cpu.ty {
        return Err(format!("types differ: gpu {} cpu {}", gpu.ty, cpu.ty));
    }
    if !gpu.ty.dtype.is_float() {
        let (g, c) = (gpu.to_i64(), cpu.to_i64());
        if let Some(i) = (0..g.len()).find(|&i| g[i] != c[i]) {
            return Err(format!("element {i}: gpu {} cpu {}", g[i], c[i]));
        }
        return Ok((0.0, 0.0));
    }
    let (g, c) = (gpu.to_f64(), cpu.to_f64());
    let (mut num, mut den, mut maxabs) = (0.0f64, 0.0f64, 0.0f64);
    for i in 0..g.len() {
        if g[i].is_nan() != c[i].is_nan() {
            return Err(format!("element {i}: gpu {} cpu {}", g[i], c[i]));
        }
        if c[i].is_nan() || (c[i].is_infinite() && g[i] == c[i]) {
            continue;
        }
        let d = g[i] - c[i];
        num += d * d;
        den += c[i] * c[i];
        maxabs = maxabs.max(d.abs());
    }
    let rel = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    if rel.is_nan() || rel > tol {
        return Err(format!("relative error {rel:.3e} over tolerance {tol:.1e} (max abs {maxabs:.3e})"));
    }
    Ok((rel, maxabs))
}

pub fn randn(ty: TensorType, rng: &mut Rng) -> HostTensor {
    HostTensor::randn(ty, 1.0, rng)
}

/// Normal values moved away from zero: `sign(x) * (|x| + 0.5)`.
pub fn away_from_zero(ty: TensorType, rng: &mut Rng) -> HostTensor {
    let v: Vec<f64> = (0..ty.numel())
        .map(|_| {
            let x = rng.normal();
            x.signum() * (x.abs() + 0.5)
        })
        .collect();
    HostTensor::from_f64(ty.dtype, ty.dims(), &v).expect("sizes match")
}

/// Positive values in `[0.1, 3.1)`.
pub fn positive(ty: TensorType, rng: &mut Rng) -> HostTensor {
    let v: Vec<f64> = (0..ty.numel()).map(|_| 0.1 + 3.0 * rng.uniform()).collect();
    HostTensor::from_f64(ty.dtype, ty.dims(), &v).expect("sizes match")
}

use rumble_core::autodiff;
use rumble_core::ir::{InputRole, OutputRole, Phase, Trace};
use rumble_core::testing::TinyLlama;

/// TinyLlama's training step as one trace: forward, backward (`grad.NAME` outputs) and, if
/// `lr` is given, an SGD update of every parameter (`new.NAME`, role `Update`).
pub fn training_step(cfg: &TinyLlama, lr: Option<f64>) -> Trace {
    let g = cfg.loss_graph().expect("tiny llama builds");
    let snap = g.snapshot();
    let loss = g.value(snap.output("loss").expect("loss output").value);
    let params: Vec<_> =
        snap.inputs.iter().filter(|i| i.role == InputRole::Param).map(|i| (i.name.clone(), g.value(i.value))).collect();
    let refs: Vec<_> = params.iter().map(|(_, t)| t).collect();
    let grads = autodiff::backward(&loss, &refs).expect("backward");
    for ((name, p), gr) in params.iter().zip(&grads) {
        g.output_with_role(gr, &format!("grad.{name}"), OutputRole::Grad { of: p.id() }).unwrap();
    }
    if let Some(lr) = lr {
        g.set_phase(Phase::Optimizer);
        for ((name, p), gr) in params.iter().zip(&grads) {
            let new = p.sub(&gr.mul_scalar(lr).unwrap()).unwrap();
            g.output_with_role(&new, &format!("new.{name}"), OutputRole::Update { of: p.id() }).unwrap();
        }
    }
    g.finish().expect("training step verifies")
}

/// Random parameters (std 0.1 / sqrt(fan-in)-ish) for every persistent input, in trace order.
pub fn init_params(trace: &Trace, rng: &mut Rng) -> Vec<HostTensor> {
    trace
        .inputs
        .iter()
        .filter(|i| i.role.is_persistent())
        .map(|i| {
            let ty = trace.ty(i.value).clone();
            if i.name.contains("norm") {
                let v: Vec<f64> = (0..ty.numel()).map(|_| 1.0 + 0.1 * rng.normal()).collect();
                HostTensor::from_f64(ty.dtype, ty.dims(), &v).unwrap()
            } else {
                let fan_in = *ty.dims().last().unwrap_or(&1) as f64;
                HostTensor::randn(ty, 1.0 / fan_in.sqrt(), rng)
            }
        })
        .collect()
}

/// Random per-step inputs (token ids and targets) for every non-persistent input.
pub fn step_inputs(trace: &Trace, vocab: u64, rng: &mut Rng) -> Vec<HostTensor> {
    trace
        .inputs
        .iter()
        .filter(|i| !i.role.is_persistent())
        .map(|i| HostTensor::randint(trace.ty(i.value).clone(), vocab, rng))
        .collect()
}

/// The TinyLlama the executor tests train: 2 layers, 4 query heads over 2 kv heads, 24 positions.
pub fn tiny(dtype: DType) -> TinyLlama {
    TinyLlama { vocab: 96, dim: 64, heads: 4, kv_heads: 2, hidden: 96, layers: 2, batch: 2, seq: 24, dtype }
}

/// [`tiny`] and its training step with an SGD update (learning rate 0.05).
pub fn tiny_step(dtype: DType) -> (TinyLlama, Trace) {
    let c = tiny(dtype);
    let trace = training_step(&c, Some(0.05));
    (c, trace)
}

/// [`tiny_step`] in each dtype the executor tests train in (f32, then bf16), with its dtype.
pub fn tiny_steps() -> impl Iterator<Item = (DType, TinyLlama, Trace)> {
    [DType::F32, DType::BF16].into_iter().map(|dtype| {
        let (c, trace) = tiny_step(dtype);
        (dtype, c, trace)
    })
}

/// `steps` training steps of `trace` on `ex`, each on new inputs drawn from `Rng::new(seed)`:
/// each step's loss bytes, then every output and persistent input after the last step.
pub fn train(
    ex: &mut dyn rumble_cuda::Executor<Error = rumble_cuda::CudaError>,
    trace: &Trace,
    steps: usize,
    vocab: u64,
    seed: u64,
) -> (Vec<Vec<u8>>, Vec<HostTensor>) {
    let mut rng = Rng::new(seed);
    let mut losses = Vec::new();
    for _ in 0..steps {
        losses.push(ex.step(&step_inputs(trace, vocab, &mut rng)).expect("step")[0].bytes.clone());
    }
    let mut fin: Vec<HostTensor> = trace.outputs.iter().map(|o| ex.output(&o.name).expect("output")).collect();
    fin.extend(trace.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| ex.persistent(&i.name).expect("param")));
    (losses, fin)
}
