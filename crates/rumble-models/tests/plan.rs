//! The anchor workloads' steps, planned as the CUDA backend plans them (a cuBLASLt workspace in
//! every matmul's scratch), fit their arena within 2% of LOAD, the goal the graphed executor's
//! peak is held to on the GPU. The test holds them to 1%: the planner reaches LOAD on all of
//! them but one (seed-llama trained with AdamW and no workspace: 1.0081 since gate and up are
//! one packed projection; it was 1.0000), and before the lowest-first placement `seed-llama`
//! stood at 1.018 (1.023 with the workspace), inside the goal's slack but not a good plan.

use rumble_core::compile::{Budget, CompileOptions, compile, plan};
use rumble_core::ir::Op;
use rumble_core::plan::check::check;
use rumble_core::plan::{BackendScratch, PlanOptions};
use rumble_models::{PRESET_NAMES, StepConfig, build_train_step, preset};

/// The most workspace the CUDA backend gives a matmul by default (`matmul::MAX_WORKSPACE`).
const MATMUL_WORKSPACE: usize = 32 << 20;

#[test]
fn presets_plan_within_two_percent_of_load() {
    for name in PRESET_NAMES {
        for optimizer in [None, Some(rumble_models::Optimizer::adamw())] {
            let step = step_of(name, optimizer);
            let (trace, _) = rumble_core::passes::run(&step, rumble_models::trainer::PIPELINE).unwrap();
            for ws in [0, MATMUL_WORKSPACE] {
                let backend =
                    BackendScratch::new(move |op, _, _| Ok(if matches!(op, Op::Matmul { .. }) { ws } else { 0 }));
                let plan_opts = PlanOptions { backend_scratch: Some(backend), ..Default::default() };
                let opts = CompileOptions { plan: plan_opts, ..Default::default() };
                let r = plan(&trace, &opts).unwrap().report;
                let ratio = r.arena_bytes as f64 / r.load_bytes as f64;
                println!(
                    "{name} optimizer {} workspace {ws}: arena/LOAD {ratio:.4} ({})",
                    optimizer.is_some(),
                    r.order
                );
                assert!(ratio <= 1.01, "{name}: arena {} vs LOAD {}", r.arena_bytes, r.load_bytes);
            }
        }
    }
}

/// The preset's training step (fused loss, no accumulation or clipping).
fn step_of(name: &str, optimizer: Option<rumble_models::Optimizer>) -> rumble_core::Trace {
    let p = preset(name).unwrap();
    let sc = StepConfig { objective: p.objective, optimizer, ..StepConfig::new(p.batch, p.seq) };
    build_train_step(&p.config, &sc).unwrap().trace
}

/// `rumble plan seed-qwen2 --optimizer none --memory-budget 1.5GB`: recomputing the five
/// `[4096, 37888]` MLP products of a 28-wide input (matmuls) brings the peak under 1.5e9 bytes.
#[test]
fn seed_qwen2_fits_one_and_a_half_gigabytes() {
    let trace = step_of("seed-qwen2", None);
    let budget = 1_500_000_000;
    let c = compile(&trace, &CompileOptions { budget: Budget::Bytes(budget), ..Default::default() }).unwrap();
    check(&c.trace, &c.plan).unwrap();
    println!("{}", c.report);
    assert!(c.report.peak_bytes <= budget, "peak {} over {budget}", c.report.peak_bytes);
    let remat = c.report.passes.iter().find(|p| p.pass == "remat").expect("remat ran");
    assert!(remat.detail.contains("matmul"), "matmuls are recomputed: {}", remat.detail);
}

/// The default policy never raises a preset's peak (within 1%) over its fixed chunking, and
/// trades at most what the cost model cannot tell apart (`LEAN_TOLERANCE` of the predicted time:
/// these are estimated, CPU-side) for a lower one.
#[test]
fn the_default_policy_keeps_the_presets_peaks() {
    for name in PRESET_NAMES {
        for optimizer in [None, Some(rumble_models::Optimizer::adamw())] {
            let trace = step_of(name, optimizer);
            let chosen = compile(&trace, &CompileOptions::default()).unwrap().report;
            let kept = compile(&trace, &CompileOptions { choose: false, ..Default::default() }).unwrap().report;
            println!(
                "{name} optimizer {}: peak {} (was {}), predicted {:.3} ms, {}",
                optimizer.is_some(),
                chosen.peak_bytes,
                kept.peak_bytes,
                chosen.predicted_ms.unwrap_or(0.0),
                chosen.chosen
            );
            assert!(chosen.peak_bytes as f64 <= kept.peak_bytes as f64 * 1.01, "{name}: the default raised the peak");
            let (ms, was) = (chosen.predicted_ms.unwrap(), kept.predicted_ms.unwrap());
            let tolerance = rumble_core::compile::choose::LEAN_TOLERANCE;
            assert!(ms <= was * (1.0 + tolerance), "{name}: the default is predicted {ms} ms against {was}");
            assert!(ms <= was || chosen.peak_bytes < kept.peak_bytes, "{name}: slower for no bytes");
        }
    }
}
