//! `rumble plan`: builds a training step, compiles it with `rumble_core::compile::compile`
//! (the trainer's passes, schedule, then one arena whose offsets are all fixed), and prints
//! the planner's report: LOAD (the most bytes live at once), the arena, the persistent region,
//! the buffers live at the peak. `--svg FILE` writes the timeline picture.

use std::path::PathBuf;

use clap::Args;
use rumble_core::compile::{Budget, CompileOptions, compile};
use rumble_core::passes::data_parallel::{DataParallel, Mode};
use rumble_core::passes::remat::Remat;
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
    /// Plan this many layers of the model (overrides `num_hidden_layers`, as the benchmark
    /// suite's `layers` does: a few layers of a model too large to plan whole here).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Plan the forward and backward only (the step bench/reference/torch_ref.py times); same as `--optimizer none`.
    #[arg(long)]
    pub no_optimizer: bool,
    /// Keep the trace's own node order (no memory-aware scheduling).
    #[arg(long)]
    pub no_schedule: bool,
    /// Recompute cheap values in the backward instead of saving them: `auto` (wherever it
    /// lowers LOAD) or `off`.
    #[arg(long, default_value = "off", value_parser = ["off", "auto"])]
    pub remat: String,
    /// The memory policy: the fastest plan whose peak (persistent + arena) fits this many
    /// bytes (`12e9`, `12GB`, `11GiB`; recomputing, matmuls included, where that is what fits),
    /// `min` (the smallest peak), `auto` (on the CPU: the fastest) or `fastest` (the default).
    /// The report names the choice, its predicted step time and its peak.
    #[arg(long, value_name = "BYTES|auto|min", default_value = "fastest", value_parser = parse_budget)]
    pub memory_budget: Budget,
    /// Plan rank 0 of `rumble train --gpus N`: its share of the global --batch, the gradient
    /// collectives in its trace.
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,
    /// With --gpus: ZeRO-1, each rank keeping 1/N of the optimizer state.
    #[arg(long, requires = "gpus")]
    pub zero1: bool,
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
    let mut r = a.model.resolve(None)?;
    if let Some(n) = a.layers {
        if n == 0 {
            return Err(rumble_models::ModelError::Usage("--layers: at least one layer".into()));
        }
        r.config.num_hidden_layers = n;
    }
    let mut sc = r.step.clone();
    if a.no_optimizer {
        sc.optimizer = None;
    }
    let data_parallel = match a.gpus {
        None => None,
        Some(0) => return Err(rumble_models::ModelError::Usage("--gpus must be at least 1".into())),
        Some(n) => {
            if !sc.batch.is_multiple_of(n) {
                return Err(rumble_models::ModelError::Usage(format!(
                    "--batch {} (the global batch) does not split over {n} ranks: give a multiple of {n}",
                    sc.batch
                )));
            }
            sc.batch /= n;
            sc.loss_weights = n > 1;
            r.step.batch = sc.batch;
            let mode = if a.zero1 { Mode::Zero1 } else { Mode::Ddp };
            Some(DataParallel { world: n, rank: 0, mode, bucket_bytes: DataParallel::DEFAULT_BUCKET_BYTES })
        }
    };
    crate::common::check_step_fits(&r, false)?;
    let step = build_train_step(&r.config, &sc)?;
    let remat = if a.remat == "auto" { Remat::Auto } else { Remat::Off };
    let opts = CompileOptions {
        schedule: !a.no_schedule,
        remat,
        budget: a.memory_budget,
        data_parallel,
        ..Default::default()
    };
    let planned = compile(&step.trace, &opts)?;
    if a.trace {
        crate::output::line(&planned.trace)?;
    }
    if let Some(path) = &a.svg {
        write_atomic(path, planned.svg().as_bytes())?;
    }
    if a.json {
        crate::output::line(planned.report.to_json())?;
        return Ok(());
    }
    crate::outln!(
        "{} ({}):",
        r.name,
        if sc.optimizer.is_some() { "forward, backward, optimizer" } else { "forward, backward" }
    )?;
    for l in &planned.passes {
        crate::outln!("  pass {l}")?;
    }
    crate::output::text(&planned.report)?;
    Ok(())
}

/// `--memory-budget`'s values (`rumble_core::compile::Budget`).
pub fn parse_budget(s: &str) -> std::result::Result<Budget, String> {
    s.parse()
}
