//! `rumble plan`: builds a training step, runs the trainer's passes, plans its memory with
//! `rumble_core::plan::plan` (schedule, then one arena whose offsets are all fixed), and prints
//! the planner's report: LOAD (the most bytes live at once), the arena, the persistent region,
//! the buffers live at the peak. `--svg FILE` writes the timeline picture.

use std::path::PathBuf;

use clap::Args;
use rumble_core::passes::remat::Remat;
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
    /// Recompute cheap values in the backward instead of saving them: `auto` (wherever it
    /// lowers LOAD) or `off`.
    #[arg(long, default_value = "off", value_parser = ["off", "auto"])]
    pub remat: String,
    /// Recompute as little as needed for the step's peak (persistent + arena) to fit this
    /// many bytes (`12e9`, `12GB`, `11GiB`); the report says whether it fits and the extra
    /// FLOPs.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub memory_budget: Option<usize>,
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
    crate::common::check_step_fits(&r, false)?;
    let step = build_train_step(&r.config, &sc)?;
    let (trace, log) = rumble_core::passes::run(&step.trace, rumble_models::trainer::PIPELINE)?;
    let remat = match (a.memory_budget, a.remat.as_str()) {
        (Some(peak_bytes), _) => Remat::Budget { peak_bytes },
        (None, "auto") => Remat::Auto,
        _ => Remat::Off,
    };
    let opts = PlanOptions { schedule: !a.no_schedule, remat, ..Default::default() };
    let planned = plan(&trace, &opts)?;
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
    for l in &log {
        crate::outln!("  pass {l}")?;
    }
    crate::output::text(&planned.report)?;
    Ok(())
}

/// `12e9`, `12000000000`, `12GB`, `11.5GiB`, `800MB`, `800MiB` -> bytes.
fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let units: [(&str, f64); 7] =
        [("GiB", 1073741824.0), ("MiB", 1048576.0), ("KiB", 1024.0), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)];
    let (num, scale) = units.iter().find_map(|(u, k)| t.strip_suffix(u).map(|n| (n.trim(), *k))).unwrap_or((t, 1.0));
    match num.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok((v * scale) as usize),
        _ => Err(format!("`{s}` is not a byte count (e.g. 12e9, 12GB, 11GiB)")),
    }
}
