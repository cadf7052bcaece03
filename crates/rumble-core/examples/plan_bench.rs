//! Planner benchmark: plans one training step (forward, backward, AdamW) of a 32-layer
//! LLaMA-7B-shaped model and prints how long each stage takes and the memory report.
//!
//! `cargo run --release -p rumble-core --example plan_bench [-- LAYERS [SVG_FILE [none|sgd|adamw]]]`

use std::time::Instant;

use rumble_core::compile::{CompileOptions, plan};
use rumble_core::ir::DType;
use rumble_core::passes::remat::Remat;
use rumble_core::plan::{PlanOptions, check::check, plan_order};
use rumble_core::testing::{Optimizer, TinyLlama};

fn main() -> rumble_core::Result<()> {
    let mut args = std::env::args().skip(1);
    let layers = args.next().and_then(|a| a.parse().ok()).unwrap_or(32);
    let svg = args.next().filter(|s| s != "-");
    let opt = match args.next().as_deref() {
        None | Some("adamw") => Optimizer::adamw(1e-4),
        Some("sgd") => Optimizer::Sgd { lr: 1e-3 },
        Some("none") => Optimizer::None,
        Some(o) => return Err(rumble_core::Error::msg(format!("unknown optimizer `{o}` (none, sgd, adamw)"))),
    };
    // LLaMA-2-7B's proportions: width 4096, 32 heads of 128, SwiGLU MLP 11008, vocab 32000.
    let cfg = TinyLlama {
        vocab: 32000,
        dim: 4096,
        heads: 32,
        kv_heads: 32,
        hidden: 11008,
        layers,
        batch: 1,
        seq: 2048,
        dtype: DType::BF16,
    };
    let t0 = Instant::now();
    let trace = cfg.train_step(opt)?;
    let build = t0.elapsed();
    println!(
        "{layers}-layer step traced with its backward and {opt:?} in {:.1} ms: {} nodes",
        ms(build),
        trace.nodes.len()
    );

    let t = Instant::now();
    let fixed = plan_order(&trace, &PlanOptions::default())?;
    println!(
        "plan in autodiff order: {:.1} ms (LOAD {}, arena {})",
        ms(t.elapsed()),
        fixed.report.load_bytes,
        fixed.report.arena_bytes
    );

    let t = Instant::now();
    let planned = plan(&trace, &CompileOptions::default())?;
    println!("schedule + plan: {:.1} ms", ms(t.elapsed()));

    let t = Instant::now();
    check(&planned.trace, &planned.plan)?;
    println!("independent check: {:.1} ms", ms(t.elapsed()));

    let t = Instant::now();
    let remat = plan(&trace, &CompileOptions { remat: Remat::Auto, ..Default::default() })?;
    println!("remat + schedule + plan: {:.1} ms", ms(t.elapsed()));

    // A budget halfway between the plain and the fully rematerialised peak.
    let budget = (planned.report.peak_bytes + remat.report.peak_bytes) / 2;
    let t = Instant::now();
    let fit = plan(&trace, &CompileOptions { remat: Remat::Budget { peak_bytes: budget }, ..Default::default() })?;
    println!("remat to a budget of {budget} bytes + schedule + plan: {:.1} ms", ms(t.elapsed()));
    if let Some(r) = fit.report.passes.iter().find(|p| p.pass == "remat") {
        println!("  {}; peak {} bytes", r.detail, fit.report.peak_bytes);
    }

    println!("\n{}", planned.report);
    println!("with remat:\n{}", remat.report);
    if let Some(path) = svg {
        std::fs::write(&path, planned.svg())
            .map_err(|source| rumble_core::Error::Io { path: path.clone().into(), source })?;
        println!("timeline written to {path}");
    }
    Ok(())
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
