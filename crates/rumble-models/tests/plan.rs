//! The anchor workloads' steps, planned as the CUDA backend plans them (a cuBLASLt workspace in
//! every matmul's scratch), fit their arena within 2% of LOAD, the goal the graphed executor's
//! peak is held to on the GPU. The test holds them to 1%: the planner reaches LOAD on all of
//! them but one (seed-llama trained with AdamW and no workspace: 1.0081 since gate and up are
//! one packed projection; it was 1.0000), and before the lowest-first placement `seed-llama`
//! stood at 1.018 (1.023 with the workspace), inside the goal's slack but not a good plan.

use rumble_core::ir::Op;
use rumble_core::plan::{BackendScratch, PlanOptions, plan};
use rumble_models::{PRESET_NAMES, StepConfig, build_train_step, preset};

/// The most workspace the CUDA backend gives a matmul by default (`matmul::MAX_WORKSPACE`).
const MATMUL_WORKSPACE: usize = 32 << 20;

#[test]
fn presets_plan_within_two_percent_of_load() {
    for name in PRESET_NAMES {
        let p = preset(name).unwrap();
        for optimizer in [None, Some(rumble_models::Optimizer::adamw())] {
            let sc = StepConfig {
                batch: p.batch,
                seq: p.seq,
                objective: p.objective,
                optimizer,
                grad_accum: 1,
                clip: None,
                fused_loss: true,
                precision: None,
            };
            let step = build_train_step(&p.config, &sc).unwrap();
            let (trace, _) = rumble_core::passes::run(&step.trace, rumble_models::trainer::PIPELINE).unwrap();
            for ws in [0, MATMUL_WORKSPACE] {
                let backend =
                    BackendScratch::new(move |op, _, _| Ok(if matches!(op, Op::Matmul { .. }) { ws } else { 0 }));
                let opts = PlanOptions { backend_scratch: Some(backend), ..Default::default() };
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
