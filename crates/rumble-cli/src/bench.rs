//! `rumble bench [WORKLOAD]`: times steps of a workload on random tokens. A step is a forward,
//! the objective and a backward producing every parameter gradient (the anchors' step), or with
//! `--train` the whole training step with the optimizer. Prints one JSON line with the keys
//! bench/compare.py reads. The benchmark issue (7) grows it: the CUDA executors, memory figures
//! from the plan.

use std::time::Instant;

use clap::Args;
use rumble_models::exec::executor;
use rumble_models::host::{self, HostTensor};
use rumble_models::rng::Rng;
use rumble_models::{
    Batch, DeviceChoice, LrSchedule, ModelError, Objective, Result, Trainer, Weights, build_train_step,
};
use serde_json::json;

use crate::common::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The workload: a preset or a config.json (same as --config).
    pub workload: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Include the optimizer step (AdamW by default) in each timed step.
    #[arg(long)]
    pub train: bool,
    /// Timed steps (after one untimed first step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print only the JSON line (the default prints it too, after a readable summary).
    #[arg(long)]
    pub json: bool,
}

/// One timed step: micro-batches in, loss out.
type StepFn = dyn FnMut(&[Batch]) -> Result<f32>;

pub fn run(mut a: BenchArgs) -> Result<()> {
    let device: DeviceChoice = a.device.parse()?;
    if let Some(w) = a.workload.take() {
        if a.model.config.is_some() {
            return Err(ModelError::Usage("give the workload once: as an argument or with --config".into()));
        }
        a.model.config = Some(w);
    }
    let r = a.model.resolve(None)?;
    let mut sc = r.step.clone();
    if !a.train {
        sc.optimizer = None;
    }
    let weights = Weights::init(&r.config, a.seed)?;
    let t_build = Instant::now();
    let mut step: Box<StepFn> = if a.train {
        let mut trainer = Trainer::new(r.config.clone(), sc.clone(), weights, LrSchedule::constant(r.lr), device)?;
        Box::new(move |b| Ok(trainer.step(b)?.loss))
    } else {
        let trace = build_train_step(&r.config, &sc)?.trace;
        let mut exec = executor(device, trace, weights.tensors)?;
        let causal = sc.objective == Objective::CausalLm;
        Box::new(move |batches| {
            let mut data: Vec<HostTensor> = Vec::new();
            for b in batches {
                data.push(host::from_i64s(&[b.batch, b.seq], &b.tokens)?);
                if causal {
                    data.push(host::from_i64s(&[b.batch * b.seq], &b.targets)?);
                }
            }
            let outs = exec.run(&data)?;
            host::item(outs.first().ok_or_else(|| ModelError::Usage("the step returned no loss".into()))?)
        })
    };
    let build_ms = t_build.elapsed().as_secs_f64() * 1e3;
    let mut rng = Rng::for_name(a.seed, "bench");
    let (mut first_ms, mut times, mut loss) = (0.0, Vec::new(), f32::NAN);
    for i in 0..=a.steps {
        let batches: Vec<Batch> =
            (0..sc.grad_accum).map(|_| Batch::random(&mut rng, r.config.vocab_size, sc.batch, sc.seq)).collect();
        let t = Instant::now();
        loss = step(&batches)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if i == 0 { first_ms = ms } else { times.push(ms) }
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(first_ms);
    let tokens = (sc.batch * sc.seq * sc.grad_accum) as f64;
    let device_name = match device {
        DeviceChoice::Cuda => "cuda",
        DeviceChoice::Cpu | DeviceChoice::Auto => "cpu",
    };
    let line = json!({
        "workload": r.name, "executor": format!("rumble-{device_name}"), "train": a.train,
        "batch": sc.batch, "seq": sc.seq, "grad_accum": sc.grad_accum, "steps": times.len(),
        "build_ms": round2(build_ms), "first_step_ms": round2(first_ms + build_ms), "median_step_ms": round2(median),
        "tokens_per_s": (tokens / median * 1e3).round(), "last_loss": loss,
    });
    if !a.json {
        eprintln!(
            "{} on {device_name}: median {median:.2} ms a step ({:.0} tokens/s) over {} steps; build {build_ms:.0} ms",
            r.name,
            tokens / median * 1e3,
            times.len()
        );
    }
    println!("{line}");
    Ok(())
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
