//! The `Trainer`: one built training step on one executor, fed batch after batch.
//!
//! It owns the schedule of the learning rate (an input of the trace each step), the step count
//! (Adam's bias corrections), and writes checkpoints as Hugging Face folders
//! (`model.safetensors` and `config.json`).

use std::path::Path;

use rumble_core::Trace;
pub use rumble_core::compile::PIPELINE;
use rumble_core::compile::{CompileOptions, optimize};

use crate::buckets::{BucketReport, BucketedExecutor, Buckets};
use crate::config::Config;
use crate::data::Batch;
use crate::error::{ModelError, Result};
use crate::exec::{DeviceChoice, DeviceKind, DynExecutor, ExecStats, cuda_unavailable, executor_with};
use crate::host::{self, HostTensor};
use crate::model::param_specs;
use crate::optim::Optimizer;
use crate::presets::Objective;
use crate::step::{StepConfig, TrainStep, build_train_step};
use crate::weights::Weights;

/// How the learning rate moves over a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScheduleKind {
    Constant,
    /// Cosine decay from the peak to a tenth of it at the last step.
    Cosine,
}

/// Linear warmup over `warmup` steps, then `kind`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup: u64,
    pub total: u64,
    pub kind: ScheduleKind,
}

impl LrSchedule {
    pub fn constant(lr: f64) -> Self {
        LrSchedule { peak: lr, warmup: 0, total: 1, kind: ScheduleKind::Constant }
    }

    /// The learning rate of step `step` (1-based).
    pub fn at(&self, step: u64) -> f64 {
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.peak,
            ScheduleKind::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1) as f64;
                let frac = ((step - self.warmup) as f64 / span).min(1.0);
                let min = 0.1 * self.peak;
                min + (self.peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * frac).cos())
            }
        }
    }
}

/// What one step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct StepStats {
    pub step: u64,
    pub loss: f32,
    /// The global gradient norm before clipping (when clipping).
    pub grad_norm: Option<f32>,
    pub lr: f64,
    /// Tokens processed this step (all micro-batches).
    pub tokens: usize,
}

pub struct Trainer {
    cfg: Config,
    sc: StepConfig,
    optimizer: Optimizer,
    data_inputs: Vec<String>,
    exec: Box<DynExecutor>,
    schedule: LrSchedule,
    step: u64,
    /// Shape buckets: batches of any shape a bucket holds, padded to it by the executor.
    buckets: Option<Buckets>,
}

impl Trainer {
    /// Builds the step for `cfg` and `sc` (which must have an optimizer) and loads `weights`
    /// onto the chosen device, optimizer states starting at zero.
    pub fn new(
        cfg: Config,
        sc: StepConfig,
        weights: Weights,
        schedule: LrSchedule,
        device: DeviceChoice,
    ) -> Result<Trainer> {
        Self::with_options(cfg, sc, weights, schedule, device, &CompileOptions::default())
    }

    /// As `new`, compiled with `opts` (its memory budget, say; see `rumble_core::compile`).
    pub fn with_options(
        cfg: Config,
        sc: StepConfig,
        weights: Weights,
        schedule: LrSchedule,
        device: DeviceChoice,
        opts: &CompileOptions,
    ) -> Result<Trainer> {
        let opts = CompileOptions { passes: false, ..opts.clone() };
        Self::with_executor(cfg, sc, weights, schedule, &opts, |trace, persistent| {
            executor_with(device, trace, persistent, &opts)
        })
    }

    /// As `new`, with the executor made by `make` from the step's trace (after the passes of
    /// `compile::optimize` with `opts`) and its persistent values.
    pub fn with_executor(
        cfg: Config,
        sc: StepConfig,
        weights: Weights,
        schedule: LrSchedule,
        opts: &CompileOptions,
        make: impl FnOnce(Trace, Vec<(String, HostTensor)>) -> Result<Box<DynExecutor>>,
    ) -> Result<Trainer> {
        let optimizer = sc.optimizer.ok_or_else(|| ModelError::Usage("a Trainer needs an optimizer".into()))?;
        check_hyper(&sc, &schedule)?;
        let TrainStep { trace, data_inputs, states } = build_train_step(&cfg, &sc)?;
        let (trace, _log) = optimize(&trace, &CompileOptions { passes: true, ..opts.clone() })?;
        let mut persistent = weights.tensors;
        persistent.extend(states.iter().map(|(name, ty)| (name.clone(), host::zeros(ty))));
        let exec = make(trace, persistent)?;
        Ok(Trainer { cfg, sc, optimizer, data_inputs, exec, schedule, step: 0, buckets: None })
    }

    /// As `new`, with one step per shape bucket (`sc`'s batch and seq are replaced by each
    /// bucket's) sharing the parameters and optimizer states: [`Trainer::step`] then takes
    /// batches of any shape a bucket holds, every micro-batch of a step the same shape. CUDA
    /// runs them as `rumble_cuda::BucketedGraphs` (graphs captured on a bucket's first step).
    pub fn with_buckets(
        cfg: Config,
        sc: StepConfig,
        buckets: Buckets,
        weights: Weights,
        schedule: LrSchedule,
        device: DeviceChoice,
    ) -> Result<Trainer> {
        Self::with_buckets_options(cfg, sc, buckets, weights, schedule, device, &CompileOptions::default())
    }

    /// As `with_buckets`, each bucket's step compiled with `opts`.
    pub fn with_buckets_options(
        cfg: Config,
        sc: StepConfig,
        buckets: Buckets,
        weights: Weights,
        schedule: LrSchedule,
        device: DeviceChoice,
        opts: &CompileOptions,
    ) -> Result<Trainer> {
        let optimizer = sc.optimizer.ok_or_else(|| ModelError::Usage("a Trainer needs an optimizer".into()))?;
        check_hyper(&sc, &schedule)?;
        if sc.objective != Objective::CausalLm {
            return Err(ModelError::Usage(
                "shape buckets need the causal-LM objective (padding would change logits.sum())".into(),
            ));
        }
        let device = match device {
            DeviceChoice::Cpu => DeviceKind::Cpu,
            DeviceChoice::Cuda => match cuda_unavailable() {
                Some(why) => return Err(ModelError::DeviceUnavailable { device: "cuda".into(), why }),
                None => DeviceKind::Cuda,
            },
            DeviceChoice::Auto => {
                if cuda_unavailable().is_some() {
                    DeviceKind::Cpu
                } else {
                    DeviceKind::Cuda
                }
            }
        };
        let mut traces = Vec::new();
        let mut first: Option<TrainStep> = None;
        for s in buckets.shapes() {
            let step = build_train_step(&cfg, &StepConfig { batch: s.batch, seq: s.seq, ..sc.clone() })?;
            traces.push(optimize(&step.trace, &CompileOptions { passes: true, ..opts.clone() })?.0);
            first.get_or_insert(step);
        }
        let TrainStep { data_inputs, states, .. } =
            first.ok_or_else(|| ModelError::Usage("shape buckets: none given".into()))?;
        let mut persistent = weights.tensors;
        persistent.extend(states.iter().map(|(name, ty)| (name.clone(), host::zeros(ty))));
        let opts = CompileOptions { passes: false, ..opts.clone() };
        let exec = BucketedExecutor::with_options(buckets.clone(), traces, persistent, device, &opts)?;
        let max = buckets.max();
        let sc = StepConfig { batch: max.batch, seq: max.seq, ..sc };
        Ok(Trainer { cfg, sc, optimizer, data_inputs, exec: Box::new(exec), schedule, step: 0, buckets: Some(buckets) })
    }

    /// Per shape bucket: steps run, graph captures and their seconds (empty without buckets).
    pub fn bucket_reports(&self) -> Vec<BucketReport> {
        let Some(b) = &self.buckets else { return Vec::new() };
        b.shapes().iter().zip(self.exec.buckets()).map(|(&shape, s)| BucketReport::new(shape, &s)).collect()
    }

    pub fn device(&self) -> DeviceKind {
        self.exec.device()
    }

    /// The executor's memory and plan figures, where it has them.
    pub fn stats(&self) -> Option<ExecStats> {
        self.exec.stats()
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn step_config(&self) -> &StepConfig {
        &self.sc
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// One optimizer step over `batches` (one per micro-batch).
    pub fn step(&mut self, batches: &[Batch]) -> Result<StepStats> {
        if batches.len() != self.sc.grad_accum {
            return Err(ModelError::Usage(format!(
                "the step takes {} micro-batches, got {}",
                self.sc.grad_accum,
                batches.len()
            )));
        }
        // With buckets, any shape a bucket holds (the executor pads it), one shape per step.
        let (b, t) = match (&self.buckets, batches.first()) {
            (Some(_), Some(first)) => (first.batch, first.seq),
            _ => (self.sc.batch, self.sc.seq),
        };
        let mut data: Vec<HostTensor> = Vec::with_capacity(self.data_inputs.len());
        for batch in batches {
            if (batch.batch, batch.seq) != (b, t) {
                return Err(ModelError::Usage(format!(
                    "batch of shape ({}, {}) given to a step {} ({b}, {t})",
                    batch.batch,
                    batch.seq,
                    if self.buckets.is_some() { "whose first micro-batch is" } else { "built for" }
                )));
            }
            if batch.tokens.len() != b * t || batch.targets.len() != b * t {
                return Err(ModelError::Usage(format!(
                    "batch ({b}, {t}) holds {} tokens and {} targets, not {}",
                    batch.tokens.len(),
                    batch.targets.len(),
                    b * t
                )));
            }
            let vocab = self.cfg.vocab_size as i64;
            if let Some(bad) = batch.tokens.iter().find(|&&x| x < 0 || x >= vocab) {
                return Err(ModelError::Usage(format!("token id {bad} is outside the vocabulary 0..{vocab}")));
            }
            data.push(host::from_i64s(&[b, t], &batch.tokens)?);
            if self.sc.objective == Objective::CausalLm {
                data.push(host::from_i64s(&[b * t], &batch.targets)?);
            }
        }
        let step = self.step + 1;
        let lr = self.schedule.at(step);
        data.extend(self.optimizer.hyper_values(step, lr));
        let outs = self.exec.step(&data)?;
        self.step = step;
        let loss = host::item(outs.first().ok_or_else(|| ModelError::Usage("the step returned no loss".into()))?)?;
        let grad_norm = match self.sc.clip {
            Some(_) => Some(host::item(
                outs.get(1).ok_or_else(|| ModelError::Usage("the step returned no grad_norm".into()))?,
            )?),
            None => None,
        };
        // The finite check: the loss (and the gradient norm when clipping) are outputs the
        // step returns anyway, so checking them costs no device work. A non-finite one stops
        // the run here, before any checkpoint; the parameters are then scanned on the host to
        // name the first one that went bad.
        let what = match (loss.is_finite(), grad_norm) {
            (false, _) => Some(format!("the loss is {loss}")),
            (true, Some(g)) if !g.is_finite() => Some(format!("the gradient norm is {g}")),
            _ => None,
        };
        if let Some(what) = what {
            return Err(ModelError::Diverged { step, what, culprit: self.first_non_finite_parameter() });
        }
        Ok(StepStats { step, loss, grad_norm, lr, tokens: b * t * batches.len() })
    }

    /// The current parameters.
    pub fn weights(&self) -> Result<Weights> {
        let mut all: std::collections::HashMap<String, HostTensor> =
            self.exec.persistent_values()?.into_iter().collect();
        let mut tensors = Vec::new();
        for spec in param_specs(&self.cfg) {
            let t = all
                .remove(&spec.name)
                .ok_or_else(|| ModelError::Usage(format!("the executor lost parameter `{}`", spec.name)))?;
            tensors.push((spec.name, t));
        }
        Ok(Weights { tensors })
    }

    /// Writes `dir/model.safetensors` and `dir/config.json` (a folder transformers loads).
    /// Refuses (writing nothing) when a parameter holds NaN or infinity, naming it.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        save_checkpoint(dir, &self.cfg, &self.weights()?)
    }

    /// Names the first parameter (in `param_specs` order) holding a non-finite value, read
    /// back from the executor; for error messages after a non-finite step.
    fn first_non_finite_parameter(&self) -> String {
        match self.weights() {
            Ok(w) => match crate::guard::first_non_finite_tensor(w.tensors.iter().map(|(n, t)| (n.as_str(), t))) {
                Some((name, i, v)) => format!("first non-finite parameter: `{name}` ({v} at element {i})"),
                None => "every parameter is still finite".into(),
            },
            Err(e) => format!("the parameters could not be read back ({e})"),
        }
    }
}

/// Refuses hyper-parameters outside their domain, before anything is built: a negative or
/// non-finite learning rate, weight decay, epsilon; AdamW betas or SGD momentum outside
/// [0, 1); a clip that is not positive and finite; a warmup longer than the run.
pub fn check_hyper(sc: &StepConfig, schedule: &LrSchedule) -> Result<()> {
    let bad = |name: &str, v: f64, domain: &str| Err(ModelError::Usage(format!("{name} must be {domain}, got {v}")));
    if !schedule.peak.is_finite() || schedule.peak < 0.0 {
        return bad("the learning rate (--lr)", schedule.peak, "finite and not negative");
    }
    if schedule.warmup > schedule.total {
        return Err(ModelError::Usage(format!(
            "the warmup ({} steps) is longer than the run ({} steps)",
            schedule.warmup, schedule.total
        )));
    }
    if let Some(c) = sc.clip
        && (!c.is_finite() || c <= 0.0)
    {
        return bad("the gradient clip (--clip)", c, "positive and finite");
    }
    let unit = |v: f64| v.is_finite() && (0.0..1.0).contains(&v);
    let non_negative = |v: f64| v.is_finite() && v >= 0.0;
    match sc.optimizer {
        Some(Optimizer::AdamW { beta1, beta2, eps, weight_decay }) => {
            if !unit(beta1) {
                return bad("AdamW beta1", beta1, "in [0, 1)");
            }
            if !unit(beta2) {
                return bad("AdamW beta2", beta2, "in [0, 1)");
            }
            if !eps.is_finite() || eps <= 0.0 {
                return bad("AdamW eps", eps, "positive and finite");
            }
            if !non_negative(weight_decay) {
                return bad("the weight decay (--weight-decay)", weight_decay, "finite and not negative");
            }
        }
        Some(Optimizer::Sgd { momentum, weight_decay }) => {
            if !unit(momentum) {
                return bad("the SGD momentum (--momentum)", momentum, "in [0, 1)");
            }
            if !non_negative(weight_decay) {
                return bad("the weight decay (--weight-decay)", weight_decay, "finite and not negative");
            }
        }
        None => {}
    }
    Ok(())
}

/// Writes a Hugging Face model folder: `config.json` and `model.safetensors` (sharded with an
/// index past `save_pretrained`'s default limit), each file atomically. Refuses (writing
/// nothing) weights holding NaN or infinity, naming the first such tensor.
pub fn save_checkpoint(dir: &Path, cfg: &Config, weights: &Weights) -> Result<()> {
    if let Some((name, index, value)) =
        crate::guard::first_non_finite_tensor(weights.tensors.iter().map(|(n, t)| (n.as_str(), t)))
    {
        return Err(ModelError::NonFinite { file: dir.join("model.safetensors"), name, index, value });
    }
    crate::folder::save_folder(dir, cfg, weights, crate::folder::DEFAULT_MAX_SHARD_BYTES).map(|_| ())
}
