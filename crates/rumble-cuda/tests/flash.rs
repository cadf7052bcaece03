//! Flash attention on the GPU against the CPU reference (`rumble_core::cpu`), forward and
//! backward, on the issue-6 matrix: head sizes 1, 64, 100 and 128 (and 136, 256: two dK/dV
//! chunks), sequences that are and are not multiples of the tiles (64 and 32), GQA ratios 1
//! and 7, causal and not, f32 (FMA kernels) and bf16 (tensor cores), f16 for a few. Each case
//! is a one-node trace through the planned executor with the arena poisoned first. Also: the
//! backward is bit-identical from run to run. Prints one line per case.
//!
//! Every case runs in both operand layouts: `[B, H, T, D]` and the sequence-major
//! `[B, T, H, D]` (`bthd`, strided rows) that the models use; a few `bthd` shapes also run with
//! the dK/dV split forced, without the wgmma kernels and on the per-row fallback (set through
//! `Device::set_knobs`, as `RUMBLE_FLASH_SPLIT`, `RUMBLE_FLASH_WG=0` and
//! `RUMBLE_ATTENTION=naive` would). These tests run the flash kernels (`RUMBLE_ATTENTION=flash`);
//! `cudnn_attention_matches_cpu` runs the same checks on cuDNN's fused attention.

mod common;

use std::sync::Arc;

use common::{compare, gpu, randn, tolerance};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, HeadLayout, Op, TensorType};
use rumble_core::plan::plan_naive;
use rumble_cuda::cudnn::Sdpa;
use rumble_cuda::flash::choose;
use rumble_cuda::knobs::{AttentionImpl, Knobs};
use rumble_cuda::{Device, Executor, PlannedExecutor, Program};

/// The GPU with attention on `attention` (and, for cuDNN, its non-deterministic backward allowed).
fn gpu_with(attention: AttentionImpl) -> Arc<Device> {
    let dev = gpu();
    let deterministic = attention != AttentionImpl::Cudnn;
    dev.set_knobs(Knobs { attention, deterministic, ..dev.knobs() });
    dev
}

/// `(B, Hq, Hkv, T, S, D, causal)`.
type Shape = (usize, usize, usize, usize, usize, usize, bool);

fn trace_of(op: &Op, inputs: &[HostTensor]) -> rumble_core::Trace {
    let g = Graph::new(format!("flash_{}", op.name()));
    let ins: Vec<_> =
        inputs.iter().enumerate().map(|(i, h)| g.data(&format!("x{i}"), h.ty.dtype, h.ty.dims()).unwrap()).collect();
    let refs: Vec<_> = ins.iter().collect();
    for (i, o) in g.apply(op.clone(), &refs).unwrap().iter().enumerate() {
        g.output(o, &format!("y{i}")).unwrap();
    }
    g.finish().unwrap()
}

fn run_gpu(dev: &Arc<Device>, op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>, String> {
    let trace = trace_of(op, inputs);
    let prog = Arc::new(
        Program::compile(dev.clone(), trace.clone(), |t, ws| Ok(plan_naive(t, ws))).map_err(|e| e.to_string())?,
    );
    let mut ex = PlannedExecutor::new(prog, &[]).map_err(|e| e.to_string())?;
    ex.poison(0xff).map_err(|e| e.to_string())?;
    ex.step(inputs).map_err(|e| e.to_string())?;
    (0..trace.outputs.len()).map(|i| ex.output(&format!("y{i}")).map_err(|e| e.to_string())).collect()
}

/// The types of q and k of shape `sh` in `layout`.
fn qk_types(d: DType, sh: Shape, layout: HeadLayout) -> (TensorType, TensorType) {
    let (b, hq, hkv, t, s, hd, _) = sh;
    match layout {
        HeadLayout::Bhtd => (TensorType::new(d, [b, hq, t, hd]), TensorType::new(d, [b, hkv, s, hd])),
        HeadLayout::Bthd => (TensorType::new(d, [b, t, hq, hd]), TensorType::new(d, [b, s, hkv, hd])),
    }
}

/// Forward and backward of one shape; a report line or the failure.
fn check(dev: &Arc<Device>, d: DType, sh: Shape, layout: HeadLayout, rng: &mut Rng) -> Result<String, String> {
    let (.., hd, causal) = sh;
    let scale = 1.0 / (hd as f64).sqrt();
    let (qt, kt) = qk_types(d, sh, layout);
    let fwd = Op::Attention { scale, causal, layout };
    let ins = vec![randn(qt.clone(), rng), randn(kt.clone(), rng), randn(kt, rng)];
    let want = cpu::eval(&trace_of(&fwd, &ins), &ins).map_err(|e| format!("cpu: {e}"))?;
    let got = run_gpu(dev, &fwd, &ins)?;
    let mut parts = Vec::new();
    for (name, (g, w)) in ["o", "lse"].iter().zip(got.iter().zip(&want)) {
        let (rel, _) = compare(g, w, tolerance(w.ty.dtype)).map_err(|e| format!("forward {name}: {e}"))?;
        parts.push(format!("{name} {rel:.1e}"));
    }
    let bwd = Op::AttentionBackward { scale, causal, layout };
    let mut bins = ins;
    bins.extend([want[0].clone(), want[1].clone(), randn(qt, rng)]);
    let want = cpu::eval(&trace_of(&bwd, &bins), &bins).map_err(|e| format!("cpu: {e}"))?;
    let got = run_gpu(dev, &bwd, &bins)?;
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let (rel, _) = compare(g, w, tolerance(w.ty.dtype)).map_err(|e| format!("backward {name}: {e}"))?;
        parts.push(format!("{name} {rel:.1e}"));
    }
    Ok(parts.join("  "))
}

fn issue_matrix() -> Vec<Shape> {
    let mut v = Vec::new();
    for hd in [1, 64, 100, 128] {
        // 128: a multiple of every tile; 77: of none.
        for t in [128, 77] {
            for (hq, hkv) in [(2, 2), (7, 1)] {
                v.push((1, hq, hkv, t, t, hd, true));
                v.push((2, hq, hkv, t, t + 19, hd, false));
            }
        }
    }
    // Two dK/dV chunks of head dims; the widest head; many tiles through the pipelines.
    v.extend([(1, 2, 1, 70, 70, 136, true), (1, 2, 2, 65, 40, 256, false), (1, 7, 1, 600, 600, 64, true)]);
    // Padded to 128 with zero columns: 16-byte loads (120) and element by element (127).
    v.extend([(1, 2, 1, 200, 200, 120, true), (1, 7, 1, 77, 96, 127, false)]);
    v
}

#[test]
#[ignore = "needs a CUDA device"]
fn flash_attention_matches_cpu() {
    let dev = gpu_with(AttentionImpl::Flash);
    let mut rng = Rng::new(61);
    let mut failures = Vec::new();
    let mut n = 0;
    for (d, layout) in [DType::F32, DType::BF16].into_iter().flat_map(|d| HeadLayout::ALL.map(|l| (d, l))) {
        for sh in issue_matrix() {
            let flash = choose(dev.capability, d, sh.5, &dev.knobs()).is_some();
            let res = check(&dev, d, sh, layout, &mut rng);
            let kind = if flash { "flash" } else { "per-row (fallback)" };
            let line = format!("{} {} {sh:?} {kind}", d.name(), layout.name());
            match res {
                Ok(r) => println!("ok   {line}: {r}"),
                Err(e) => {
                    println!("FAIL {line}: {e}");
                    failures.push(format!("{line}: {e}"));
                }
            }
            n += 1;
        }
    }
    for sh in [(1, 7, 1, 77, 77, 64, true), (1, 2, 2, 128, 147, 100, false)] {
        for layout in HeadLayout::ALL {
            match check(&dev, DType::F16, sh, layout, &mut rng) {
                Ok(r) => println!("ok   f16 {} {sh:?}: {r}", layout.name()),
                Err(e) => failures.push(format!("f16 {} {sh:?}: {e}", layout.name())),
            }
            n += 1;
        }
    }
    // A few bthd shapes with other settings (Device::set_knobs, for the programs compiled after
    // it): the dK/dV split forced (uneven: 3 of a group of 7); on an H100 / H200, the mma.sync
    // kernels the wgmma ones replace there (at padded head sizes 64 and 128); the per-row fallback.
    let bthd_few: [Shape; 3] = [(1, 7, 1, 77, 77, 64, true), (2, 7, 1, 77, 96, 1, false), (1, 7, 1, 77, 77, 128, true)];
    let knobs = dev.knobs();
    let split = rumble_cuda::knobs::Knobs { flash_split: Some(3), ..knobs.clone() };
    let no_wg = rumble_cuda::knobs::Knobs { flash_wgmma: false, ..knobs.clone() };
    let naive = rumble_cuda::knobs::Knobs { attention: rumble_cuda::knobs::AttentionImpl::Naive, ..knobs.clone() };
    let wg_shapes: Vec<Shape> =
        issue_matrix().into_iter().filter(|sh| [64, 128].contains(&(sh.5.div_ceil(16) * 16))).collect();
    let runs: [(&str, &rumble_cuda::knobs::Knobs, Vec<DType>, Vec<Shape>); 3] = [
        ("RUMBLE_FLASH_SPLIT=3", &split, vec![DType::BF16], bthd_few.to_vec()),
        ("RUMBLE_FLASH_WG=0", &no_wg, vec![DType::BF16], wg_shapes),
        ("per-row (RUMBLE_ATTENTION=naive)", &naive, vec![DType::F32, DType::BF16], bthd_few.to_vec()),
    ];
    for (what, k, dtypes, shapes) in runs {
        dev.set_knobs(k.clone());
        for (d, sh) in dtypes.iter().flat_map(|&d| shapes.iter().map(move |&sh| (d, sh))) {
            let line = format!("{} bthd {sh:?} {what}", d.name());
            match check(&dev, d, sh, HeadLayout::Bthd, &mut rng) {
                Ok(r) => println!("ok   {line}: {r}"),
                Err(e) => {
                    println!("FAIL {line}: {e}");
                    failures.push(format!("{line}: {e}"));
                }
            }
            n += 1;
        }
    }
    dev.set_knobs(knobs);
    assert!(failures.is_empty(), "{} of {n} cases failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA device"]
fn flash_attention_backward_is_deterministic() {
    let dev = gpu_with(AttentionImpl::Flash);
    let mut rng = Rng::new(62);
    for (d, layout) in [DType::BF16, DType::F32].into_iter().flat_map(|d| HeadLayout::ALL.map(|l| (d, l))) {
        let (q, k) = qk_types(d, (1, 7, 1, 300, 300, 64, true), layout);
        let (scale, causal) = (0.125, true);
        let ins = vec![randn(q.clone(), &mut rng), randn(k.clone(), &mut rng), randn(k, &mut rng)];
        let fw = run_gpu(&dev, &Op::Attention { scale, causal, layout }, &ins).unwrap();
        let mut bins = ins;
        bins.extend([fw[0].clone(), fw[1].clone(), randn(q, &mut rng)]);
        let bwd = Op::AttentionBackward { scale, causal, layout };
        let first = run_gpu(&dev, &bwd, &bins).unwrap();
        for _ in 0..3 {
            let again = run_gpu(&dev, &bwd, &bins).unwrap();
            for (a, b) in first.iter().zip(&again) {
                assert!(a.bytes == b.bytes, "{} {}: the backward differs between runs", d.name(), layout.name());
            }
        }
        println!("{} {}: backward bit-identical over 4 runs", d.name(), layout.name());
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cudnn_attention_matches_cpu() {
    let dev = gpu_with(AttentionImpl::Cudnn);
    let Some(version) = rumble_cuda::cudnn::version() else {
        panic!("cuDNN is not on the library path of this GPU machine");
    };
    let mut rng = Rng::new(63);
    let mut failures = Vec::new();
    // GQA 4 and 7, plain heads, not causal with S != T, a sequence of no tile multiple, d128.
    let shapes: [Shape; 6] = [
        (1, 8, 2, 128, 128, 64, true),
        (2, 7, 1, 128, 128, 128, true),
        (1, 4, 4, 256, 256, 128, true),
        (2, 4, 2, 128, 192, 64, false),
        (1, 4, 1, 77, 77, 64, true),
        (1, 14, 2, 512, 512, 64, true),
    ];
    for (d, layout) in [DType::BF16, DType::F16].into_iter().flat_map(|d| HeadLayout::ALL.map(|l| (d, l))) {
        for sh in shapes {
            let (qt, kt) = qk_types(d, sh, layout);
            let (causal, scale) = (sh.6, 1.0 / (sh.5 as f64).sqrt());
            let lse = TensorType::new(DType::F32, [sh.0, sh.1, sh.3]);
            let fwd = Sdpa::of(&Op::Attention { scale, causal, layout }, &[&qt, &kt, &kt]).and_then(|g| g.plan(&dev));
            let bwd = Op::AttentionBackward { scale, causal, layout };
            let bwd = Sdpa::of(&bwd, &[&qt, &kt, &kt, &qt, &lse, &qt]).and_then(|g| g.plan(&dev));
            let kind = format!("cuDNN {version}: forward {}, backward {}", plan_name(&fwd), plan_name(&bwd));
            let line = format!("{} {} {sh:?} {kind}", d.name(), layout.name());
            // The model's shapes (bf16, bthd, causal, T a multiple of 64) must have engines.
            if d == DType::BF16
                && layout == HeadLayout::Bthd
                && causal
                && sh.3 % 64 == 0
                && (fwd.is_none() || bwd.is_none())
            {
                failures.push(format!("{line}: no cuDNN plan"));
            }
            match check(&dev, d, sh, layout, &mut rng) {
                Ok(r) => println!("ok   {line}: {r}"),
                Err(e) => {
                    println!("FAIL {line}: {e}");
                    failures.push(format!("{line}: {e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
}

fn plan_name(p: &Option<Arc<rumble_cuda::cudnn::SdpaPlan>>) -> String {
    match p {
        Some(p) => format!("workspace {} B", p.workspace),
        None => "none (flash)".into(),
    }
}
