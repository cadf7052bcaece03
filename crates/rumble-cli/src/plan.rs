//! `rumble plan`: builds a training step, runs the trainer's passes, plans its memory with
//! `rumble_core::plan::plan` (schedule, then one arena whose offsets are all fixed), and prints
//! the planner's report: LOAD (the most bytes live at once), the arena, the persistent region,
//! the buffers live at the peak. `--svg FILE` writes the timeline picture.

use std::path::PathBuf;

use clap::Args;
use rumble_core::plan::{PlanOptions, plan};
use rumble_models::weights::write_atomic;
use rumble_models::{Result, build_train_step};

use crate::common::ModelArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The workload: a preset (tiny, small, seed-llama, seed-qwen2) or a config.json (same as
    /// --config).
    pub workload: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Plan the forward and backward only (the anchors' step); same as `--optimizer none`.
    #[arg(long)]
    pub no_optimizer: bool,
    /// Keep the trace's own node order (no memory-aware scheduling).
    #[arg(long)]
    pub no_schedule: bool,
    /// Print the whole trace, as planned, in rumble's text form.
    #[arg(long)]
    pub trace: bool,
    /// Write the plan's timeline as an SVG picture.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(mut a: PlanArgs) -> Result<()> {
    if let Some(w) = a.workload.take() {
        if a.model.config.is_some() {
            return Err(rumble_models::ModelError::Usage(
                "give the workload once: as an argument or with --config".into(),
            ));
        }
        a.model.config = Some(w);
    }
    let r = a.model.resolve(None)?;
    let mut sc = r.step.clone();
    if a.no_optimizer {
        sc.optimizer = None;
    }
    let step = build_train_step(&r.config, &sc)?;
    let (trace, log) = rumble_core::passes::run(&step.trace, rumble_models::trainer::PIPELINE)?;
    let opts = PlanOptions { schedule: !a.no_schedule, ..Default::default() };
    let planned = plan(&trace, &opts)?;
    if a.trace {
        println!("{}", planned.trace);
    }
    if let Some(path) = &a.svg {
        write_atomic(path, planned.svg().as_bytes())?;
    }
    if a.json {
        println!("{}", planned.report.to_json());
        return Ok(());
    }
    println!(
        "{} ({}):",
        r.name,
        if sc.optimizer.is_some() { "forward, backward, optimizer" } else { "forward, backward" }
    );
    for l in &log {
        println!("  pass {l}");
    }
    print!("{}", planned.report);
    Ok(())
}
