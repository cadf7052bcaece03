//! `rumble bench`: times training steps of a workload on random tokens and prints one JSON
//! line (median step time, tokens/s). The benchmark issue (7) grows it: peak memory from the
//! plan, comparison with the anchors, several workloads in one run.

use std::time::Instant;

use clap::Args;
use rumble_models::rng::Rng;
use rumble_models::{Batch, DeviceChoice, LrSchedule, Result, Trainer, Weights};
use serde_json::json;

use crate::common::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Timed steps (after one untimed warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(a: BenchArgs) -> Result<()> {
    let device: DeviceChoice = a.device.parse()?;
    let r = a.model.resolve(None)?;
    let sc = r.step.clone();
    let weights = Weights::init(&r.config, a.seed)?;
    let t_build = Instant::now();
    let mut trainer = Trainer::new(r.config.clone(), sc.clone(), weights, LrSchedule::constant(r.lr), device)?;
    let build_s = t_build.elapsed().as_secs_f64();
    let mut rng = Rng::for_name(a.seed, "bench");
    let mut times = Vec::new();
    let mut loss = f32::NAN;
    for i in 0..=a.steps {
        let batches: Vec<Batch> =
            (0..sc.grad_accum).map(|_| Batch::random(&mut rng, r.config.vocab_size, sc.batch, sc.seq)).collect();
        let t = Instant::now();
        loss = trainer.step(&batches)?.loss;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let tokens = (sc.batch * sc.seq * sc.grad_accum) as f64;
    println!(
        "{}",
        json!({"model": r.name, "device": trainer.device().to_string(), "batch": sc.batch, "seq": sc.seq,
               "grad_accum": sc.grad_accum, "steps": times.len(), "median_step_ms": (median * 100.0).round() / 100.0,
               "tokens_per_s": (tokens / median * 1e3).round(), "build_s": build_s, "last_loss": loss})
    );
    Ok(())
}
