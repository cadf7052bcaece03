//! Flash attention on the GPU against the CPU reference (`rumble_core::cpu`), forward and
//! backward, on the issue-6 matrix: head sizes 1, 64, 100 and 128 (and 136, 256: two dK/dV
//! chunks), sequences that are and are not multiples of the tiles (64 and 32), GQA ratios 1
//! and 7, causal and not, f32 (FMA kernels) and bf16 (tensor cores), f16 for a few. Each case
//! is a one-node trace through the planned executor with the arena poisoned first. Also: the
//! backward is bit-identical from run to run. Prints one line per case.
//!
//! Every default-configuration case runs in both operand layouts: `[B, H, T, D]` and the
//! sequence-major `[B, T, H, D]` (`bthd`, strided rows) that the models use; the other
//! configurations and the per-row fallback (`RUMBLE_ATTENTION=naive`) run a few `bthd` shapes.
//!
//! The tensor-core kernels' default tiling configuration runs the whole matrix; every other
//! configuration (`RUMBLE_FLASH_CFG`, set here between cases) the bf16 cases whose padded
//! head size is one of `flash::SWEEP_DP` (1, 64, 128), which is where the kernel cache holds
//! them. Run with `--test-threads=1` (the variable is process-wide; a parallel test would
//! still pass, on whichever configuration it met).

mod common;

use std::sync::Arc;

use common::{compare, device, randn, tolerance};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, HeadLayout, Op, TensorType};
use rumble_core::plan::plan_naive;
use rumble_cuda::flash::{Cfg, DEFAULT_CFG, SWEEP_DP, choose};
use rumble_cuda::{Device, Executor, PlannedExecutor, Program};

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
fn flash_attention_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(61);
    let mut failures = Vec::new();
    let mut n = 0;
    for (d, layout) in [DType::F32, DType::BF16].into_iter().flat_map(|d| HeadLayout::ALL.map(|l| (d, l))) {
        for sh in issue_matrix() {
            let flash = choose(dev.capability, d, sh.5).is_some();
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
    // A few bthd shapes on every other configuration and on the per-row fallback.
    let bthd_few: [Shape; 3] = [(1, 7, 1, 77, 77, 64, true), (2, 7, 1, 77, 96, 1, false), (1, 7, 1, 77, 77, 128, true)];
    for cfg in Cfg::all().into_iter().filter(|c| *c != DEFAULT_CFG) {
        // SAFETY: read by `flash::choose` when a program is compiled; see the module comment.
        unsafe { std::env::set_var("RUMBLE_FLASH_CFG", cfg.name()) };
        for sh in issue_matrix().into_iter().filter(|sh| SWEEP_DP.contains(&(sh.5.div_ceil(16) * 16))) {
            let line = format!("bf16 {sh:?} cfg {}", cfg.name());
            match check(&dev, DType::BF16, sh, HeadLayout::Bhtd, &mut rng) {
                Ok(r) => println!("ok   {line}: {r}"),
                Err(e) => {
                    println!("FAIL {line}: {e}");
                    failures.push(format!("{line}: {e}"));
                }
            }
            n += 1;
        }
        for sh in bthd_few {
            let line = format!("bf16 bthd {sh:?} cfg {}", cfg.name());
            match check(&dev, DType::BF16, sh, HeadLayout::Bthd, &mut rng) {
                Ok(r) => println!("ok   {line}: {r}"),
                Err(e) => {
                    println!("FAIL {line}: {e}");
                    failures.push(format!("{line}: {e}"));
                }
            }
            n += 1;
        }
    }
    unsafe { std::env::remove_var("RUMBLE_FLASH_CFG") };
    // On an H100 / H200 dQ at head sizes 64 and 128 and the forward at 128 run on wgmma (flash::wgmma);
    // the mma.sync forward it replaces there, on the shapes it would take elsewhere.
    // SAFETY: as above.
    unsafe { std::env::set_var("RUMBLE_FLASH_WG", "0") };
    for sh in issue_matrix().into_iter().filter(|sh| [64, 128].contains(&(sh.5.div_ceil(16) * 16))) {
        let line = format!("bf16 {sh:?} RUMBLE_FLASH_WG=0");
        match check(&dev, DType::BF16, sh, HeadLayout::Bthd, &mut rng) {
            Ok(r) => println!("ok   {line}: {r}"),
            Err(e) => {
                println!("FAIL {line}: {e}");
                failures.push(format!("{line}: {e}"));
            }
        }
        n += 1;
    }
    unsafe { std::env::remove_var("RUMBLE_FLASH_WG") };
    // SAFETY: as above; `flash::choose` then leaves every case to the per-row kernels.
    unsafe { std::env::set_var("RUMBLE_ATTENTION", "naive") };
    for (d, sh) in [DType::F32, DType::BF16].into_iter().flat_map(|d| bthd_few.map(|sh| (d, sh))) {
        let line = format!("{} bthd {sh:?} per-row (RUMBLE_ATTENTION=naive)", d.name());
        match check(&dev, d, sh, HeadLayout::Bthd, &mut rng) {
            Ok(r) => println!("ok   {line}: {r}"),
            Err(e) => {
                println!("FAIL {line}: {e}");
                failures.push(format!("{line}: {e}"));
            }
        }
        n += 1;
    }
    unsafe { std::env::remove_var("RUMBLE_ATTENTION") };
    assert!(failures.is_empty(), "{} of {n} cases failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn flash_attention_backward_is_deterministic() {
    let Some(dev) = device() else { return };
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
