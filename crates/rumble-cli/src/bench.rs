//! `rumble bench [WORKLOAD]`: times steps of a workload on random tokens. A step is a forward,
//! the objective and a backward producing every parameter gradient (the step bench/reference/torch_ref.py times), or with
//! `--train` the whole training step with the optimizer. On CUDA it times the eager, planned
//! and graphed executors in turn; each prints one JSON line with the keys bench/compare.py
//! reads (`executor`, `peak_allocated_bytes`, `device_used_bytes`, `load_bytes`,
//! `first_step_ms`, `median_step_ms`, ...). `--suite` runs the benchmark suite (suite.rs).

use std::time::Instant;

use clap::Args;
use rumble_core::Trace;
use rumble_core::compile::{CompileOptions, optimize};
use rumble_core::cpu::Rng;
use rumble_models::exec::{CpuExecutor, DeviceKind, cuda_unavailable};
use rumble_models::host::{self, HostTensor};
use rumble_models::trainer::cast_weights;
use rumble_models::{
    Batch, CudaExecutor, CudaMode, DeviceChoice, DynExecutor, ExecStats, LrSchedule, ModelError, Objective, Result,
    Trainer, Weights, build_train_step,
};
use serde_json::{Value, json};

use crate::common::{ModelArgs, Resolved};
use crate::suite::SuiteArgs;

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
    /// On CUDA, time only this executor (eager, planned, graphed, graphed-fwd-bwd); all but
    /// graphed-fwd-bwd by default.
    #[arg(long)]
    pub executor: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print only the JSON line (the default prints it too, after a readable summary).
    #[arg(long)]
    pub json: bool,
    /// Instead of timing steps, time each node of one step (planned executor on CUDA, device
    /// events around every launch) and print where the time goes: by op and the slowest nodes.
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub suite: SuiteArgs,
    /// The memory policy of the compiled step: bytes (`12GB`), `auto` (the device's free
    /// memory less a margin), `min` (the smallest peak) or `fastest` (the default); see
    /// `rumble plan --memory-budget`.
    #[arg(long, value_name = "BYTES|auto|min", default_value = "fastest", value_parser = crate::plan::parse_budget)]
    pub memory_budget: rumble_core::compile::Budget,
}

/// One timed step: micro-batches in, loss out.
type StepFn = dyn FnMut(&[Batch]) -> Result<f32>;

/// Which executors to time: on CUDA each of eager, planned and graphed; on the CPU its one.
fn executors(device: DeviceChoice, only: Option<&str>) -> Result<Vec<Option<CudaMode>>> {
    if device.resolve()? == DeviceKind::Cpu {
        return Ok(vec![None]);
    }
    let modes = [CudaMode::Eager, CudaMode::Planned, CudaMode::Graphed];
    match only {
        None => Ok(modes.into_iter().map(Some).collect()),
        Some(name) => CudaMode::ALL.into_iter().find(|m| m.name() == name).map(|m| vec![Some(m)]).ok_or_else(|| {
            ModelError::Usage(format!("unknown executor `{name}` (eager, planned, graphed, graphed-fwd-bwd)"))
        }),
    }
}

pub fn run(mut a: BenchArgs) -> Result<()> {
    if a.suite.suite.is_some() {
        return crate::suite::run(a);
    }
    if let Some(w) = a.workload.take() {
        if a.model.config.is_some() {
            return Err(ModelError::Usage("give the workload once: as an argument or with --config".into()));
        }
        a.model.config = Some(w);
    }
    let r = a.model.resolve(None)?;
    run_resolved(&a, r, &mut |line| crate::output::line(line))
}

/// Times one resolved workload; each executor's JSON line goes to `emit`.
pub fn run_resolved(a: &BenchArgs, r: Resolved, emit: &mut dyn FnMut(serde_json::Value) -> Result<()>) -> Result<()> {
    let device: DeviceChoice = a.device.parse()?;
    let mut sc = r.step.clone();
    if !a.train {
        sc.optimizer = None;
    }
    crate::common::check_weights_fit(&r.name, &r.config, &sc)?;
    crate::common::check_step_fits(&r, true)?;
    // In the step's master dtype (f32 under --precision bf16-mixed).
    let weights = cast_weights(Weights::init(&r.config, a.seed)?, sc.master_dtype(r.config.dtype))?;
    if a.profile {
        return profile(a, &r.name, &r.config, &sc, weights);
    }
    // The trace goes through the passes once (`optimize`); the CUDA executor compiles the rest.
    let opts = CompileOptions { budget: a.memory_budget, ..Default::default() };
    let exec_opts = CompileOptions { passes: false, ..opts.clone() };
    for mode in executors(device, a.executor.as_deref())? {
        let make = |trace: Trace, persistent: Vec<(String, HostTensor)>| -> Result<Box<DynExecutor>> {
            match mode {
                None => Ok(Box::new(CpuExecutor::new(trace, persistent)?)),
                Some(m) => Ok(Box::new(CudaExecutor::with_options(trace, persistent, m, &exec_opts)?)),
            }
        };
        let t_build = Instant::now();
        let (mut step, stats): (Box<StepFn>, Box<dyn Fn() -> Option<ExecStats>>) = if a.train {
            let trainer = Trainer::with_executor(
                r.config.clone(),
                sc.clone(),
                weights.clone(),
                LrSchedule::constant(r.lr),
                &opts,
                make,
            )?;
            let trainer = std::rc::Rc::new(std::cell::RefCell::new(trainer));
            let t2 = trainer.clone();
            (Box::new(move |b| Ok(trainer.borrow_mut().step(b)?.loss)), Box::new(move || t2.borrow().stats()))
        } else {
            let (trace, _) = optimize(&build_train_step(&r.config, &sc)?.trace, &opts)?;
            let exec = std::rc::Rc::new(std::cell::RefCell::new(make(trace, weights.tensors.clone())?));
            let e2 = exec.clone();
            let causal = sc.objective == Objective::CausalLm;
            (
                Box::new(move |batches| {
                    let mut data: Vec<HostTensor> = Vec::new();
                    for b in batches {
                        data.push(host::from_i64s(&[b.batch, b.seq], &b.tokens)?);
                        if causal {
                            data.push(host::from_i64s(&[b.batch * b.seq], &b.targets)?);
                        }
                    }
                    let outs = exec.borrow_mut().step(&data)?;
                    host::item(outs.first().ok_or_else(|| ModelError::Usage("the step returned no loss".into()))?)
                }),
                Box::new(move || e2.borrow().stats()),
            )
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
        // Each step's time in order, so a drift (a device slowing as it heats) shows.
        let in_order: Vec<f64> = times.iter().map(|&t| round2(t)).collect();
        times.sort_by(f64::total_cmp);
        let median = times.get(times.len() / 2).copied().unwrap_or(first_ms);
        let tokens = (sc.batch * sc.seq * sc.grad_accum) as f64;
        let executor = match mode {
            None => "rumble-cpu".to_string(),
            Some(m) => format!("rumble-{}", m.name()),
        };
        let mut line = json!({
            "workload": r.name, "executor": executor, "train": a.train,
            "batch": sc.batch, "seq": sc.seq, "grad_accum": sc.grad_accum, "steps": times.len(),
            "build_ms": round2(build_ms), "first_step_ms": round2(first_ms + build_ms), "median_step_ms": round2(median),
            "tokens_per_s": (tokens / median * 1e3).round(), "last_loss": loss, "step_ms": in_order,
        });
        // The executor's byte counts (peak_allocated_bytes, load_bytes, arena_bytes, ...), and
        // what compile chose under the memory budget, if priced.
        // The GPU's name, so bench/compare.py sets rumble beside references of the same GPU.
        if mode.is_some() {
            line["gpu"] = json!(rumble_cuda::Device::new(0)?.name.clone());
        }
        if let Some(s) = stats() {
            if let (Some(obj), Ok(Value::Object(m))) = (line.as_object_mut(), serde_json::to_value(&s)) {
                obj.extend(m);
            }
            if let Some(ms) = s.predicted_step_ms {
                line["predicted_step_ms"] = json!(round3(ms));
                line["chosen"] = json!(s.chosen);
                line["weighed"] = json!(s.weighed);
                line["memory_budget"] = json!(a.memory_budget.to_string());
            }
        }
        if !a.json {
            crate::note!(
                "{} {executor}: median {median:.2} ms a step ({:.0} tokens/s) over {} steps; build {build_ms:.0} ms",
                r.name,
                tokens / median * 1e3,
                times.len()
            );
        }
        emit(line)?;
    }
    Ok(())
}

/// `--profile`: one warm-up step, then one step timed node by node; prints a table by op and
/// the slowest nodes (or one JSON line with `--json`).
fn profile(
    a: &BenchArgs,
    name: &str,
    config: &rumble_models::Config,
    sc: &rumble_models::step::StepConfig,
    weights: Weights,
) -> Result<()> {
    if let Some(why) = cuda_unavailable() {
        return Err(ModelError::DeviceUnavailable { device: "cuda".into(), why });
    }
    let opts = CompileOptions { budget: a.memory_budget, ..Default::default() };
    let step = build_train_step(config, sc)?;
    let (trace, _) = optimize(&step.trace, &opts)?;
    let opts = CompileOptions { passes: false, ..opts };
    // With --train, the optimizer states start at zero (a first step's values).
    let persistent = rumble_models::trainer::persistent_values(config, sc, weights, &step.states)?;
    let mut exec = CudaExecutor::with_options(trace, persistent, CudaMode::Planned, &opts)?;
    // What the cost model predicted for each node, asked before the profile records its times.
    let predicted = exec.predicted_node_seconds()?;
    let causal = sc.objective == Objective::CausalLm;
    let mut rng = Rng::for_name(a.seed, "bench");
    let mut times = Vec::new();
    for _ in 0..2 {
        let mut data = Vec::new();
        for _ in 0..sc.grad_accum {
            let b = Batch::random(&mut rng, config.vocab_size, sc.batch, sc.seq);
            data.push(host::from_i64s(&[b.batch, b.seq], &b.tokens)?);
            if causal {
                data.push(host::from_i64s(&[b.batch * b.seq], &b.targets)?);
            }
        }
        // The optimizer's scalars (its first step, at a learning rate of 1e-4: the values do
        // not change the kernels' times).
        if let Some(opt) = &sc.optimizer {
            data.extend(opt.hyper_values(1, 1e-4));
        }
        times = exec.profile(&data)?.ok_or_else(|| ModelError::Usage("the planned executor gave no profile".into()))?;
    }
    let total: f64 = times.iter().map(|t| t.ms).sum();
    let mut by_op: std::collections::BTreeMap<(&str, String), (usize, f64)> = Default::default();
    for t in &times {
        let k = by_op.entry((t.op, kernel_family(&t.kernel))).or_default();
        k.0 += 1;
        k.1 += t.ms;
    }
    let mut by_op: Vec<_> = by_op.into_iter().collect();
    by_op.sort_by(|x, y| y.1.1.total_cmp(&x.1.1));
    // Measured against predicted, by op (a node's launches together).
    let mut by_node_op: std::collections::BTreeMap<&str, (usize, f64, f64)> = Default::default();
    let mut seen = vec![false; predicted.len()];
    for t in &times {
        let k = by_node_op.entry(t.op).or_default();
        k.1 += t.ms;
        if let Some(s) = seen.get_mut(t.node).filter(|s| !**s) {
            *s = true;
            k.0 += 1;
            k.2 += predicted[t.node] * 1e3;
        }
    }
    let mut by_node_op: Vec<_> = by_node_op.into_iter().collect();
    by_node_op.sort_by(|x, y| y.1.1.total_cmp(&x.1.1));
    let predicted_ms: f64 = predicted.iter().sum::<f64>() * 1e3;
    let mut top: Vec<_> = times.iter().collect();
    top.sort_by(|x, y| y.ms.total_cmp(&x.ms));
    top.truncate(20);
    if a.json {
        let ops: Vec<_> = by_op
            .iter()
            .map(|((op, k), (n, ms))| json!({"op": op, "kernel": k, "nodes": n, "ms": round3(*ms)}))
            .collect();
        let nodes: Vec<_> = top
            .iter()
            .map(|t| json!({"node": t.node, "op": t.op, "kernel": t.kernel, "out": t.out, "phase": t.phase, "ms": round3(t.ms)}))
            .collect();
        let predicted: Vec<_> = by_node_op
            .iter()
            .map(|(op, (n, ms, p))| json!({"op": op, "nodes": n, "ms": round3(*ms), "predicted_ms": round3(*p)}))
            .collect();
        crate::output::line(json!({
            "workload": name, "executor": "rumble-profile", "device_ms": round3(total),
            "predicted_ms": round3(predicted_ms), "by_op": ops, "predicted_by_op": predicted, "slowest": nodes
        }))?;
        return Ok(());
    }
    crate::outln!(
        "{name}: device time of one step, node by node (planned executor): {total:.3} ms over {} launches",
        times.len()
    )?;
    crate::outln!("{:<22} {:<40} {:>6} {:>10} {:>6}", "op", "kernel", "steps", "ms", "%")?;
    for ((op, k), (n, ms)) in &by_op {
        crate::outln!("{op:<22} {k:<40} {n:>6} {ms:>10.3} {:>5.1}%", 100.0 * ms / total.max(1e-9))?;
    }
    crate::outln!("\nmeasured against the cost model's prediction ({predicted_ms:.3} ms in all), by op:")?;
    crate::outln!("{:<22} {:>6} {:>10} {:>12} {:>8}", "op", "nodes", "ms", "predicted", "pred/ms")?;
    for (op, (n, ms, p)) in &by_node_op {
        crate::outln!("{op:<22} {n:>6} {ms:>10.3} {p:>12.3} {:>8.2}", p / ms.max(1e-9))?;
    }
    crate::outln!("\nslowest launches:")?;
    crate::outln!("{:>6} {:<9} {:<22} {:<40} {:<26} {:>9}", "node", "phase", "op", "kernel", "output", "ms")?;
    for t in top {
        crate::outln!("{:>6} {:<9} {:<22} {:<40} {:<26} {:>9.3}", t.node, t.phase, t.op, t.kernel, t.out, t.ms)?;
    }
    Ok(())
}

/// A kernel's row in the by-op table: generated elementwise kernels (`ew_<hash>`, one per
/// expression) count as one family; every other name stands as it is.
pub(crate) fn kernel_family(k: &str) -> String {
    if k.starts_with("ew_") { "generated elementwise".into() } else { k.to_string() }
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
