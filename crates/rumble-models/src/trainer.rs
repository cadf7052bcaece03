//! The `Trainer`: one built training step on one executor, fed batch after batch.
//!
//! It owns the schedule of the learning rate (an input of the trace each step), the step count
//! (Adam's bias corrections), and writes checkpoints as Hugging Face folders
//! (`model.safetensors` and `config.json`, in the config's dtype whatever the precision) plus,
//! through [`crate::checkpoint`], the state a run resumes from.
//!
//! Weights are given in the config's dtype and cast to the step's master dtype
//! ([`StepConfig::master_dtype`]); optimizer states start at zero unless the weights given carry
//! them by name (a resumed run: [`crate::checkpoint::load`]).
//!
//! Compiled as a rank of a ZeRO-1 program (`CompileOptions::data_parallel` in `Mode::Zero1`),
//! the trainer keeps this rank's shards of the optimizer states, cut from the whole ones it is
//! given; [`Trainer::snapshot`] gathers every rank's shards at rank 0 (through the run's
//! [`Group`], [`Trainer::with_group`]) and gives the whole states back under their own names,
//! so a checkpoint is the same whatever the number of ranks, and resumes on any.

use std::path::Path;
use std::sync::Arc;

pub use rumble_core::compile::PIPELINE;
use rumble_core::compile::{CompileOptions, optimize};
use rumble_core::passes::data_parallel::{DpPlan, Mode, data_parallel};
use rumble_core::{DType, TensorType, Trace};

use crate::buckets::{BucketReport, BucketedExecutor, Buckets};
use crate::config::Config;
use crate::data::Batch;
use crate::error::{ModelError, Result};
use crate::exec::{DeviceChoice, DeviceKind, DynExecutor, ExecStats, Executor, executor_with};
use crate::group::Group;
use crate::host::{self, HostTensor};
use crate::model::param_specs;
use crate::optim::Optimizer;
use crate::paired::StepWithEval;
use crate::presets::Objective;
use crate::step::{StepConfig, TrainStep, build_eval_step, build_train_step};
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
    /// Validation programs by batch shape, built on first use (run on the CPU reference).
    evals: Vec<((usize, usize), Trace)>,
    /// The batch shape of the executor's own validation program ([`Trainer::with_eval`]).
    eval_shape: Option<(usize, usize)>,
    /// The options the step was compiled with (the validation program gets the same).
    opts: CompileOptions,
    /// A ZeRO-1 rank: the plan of its sharded states.
    zero1: Option<DpPlan>,
    /// The run's links to the other ranks (ZeRO-1 gathers the states through them).
    group: Option<Arc<Group>>,
}

/// Stands in for an executor between dropping one and building the next (so their device
/// memory is never held twice); every call is an error.
struct Released;

impl Executor for Released {
    type Error = ModelError;

    fn device(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn step(&mut self, _: &[HostTensor]) -> Result<Vec<HostTensor>> {
        Err(ModelError::Usage("the trainer's executor was released".into()))
    }
    fn output(&self, name: &str) -> Result<HostTensor> {
        Err(ModelError::Usage(format!("the trainer's executor was released (output `{name}`)")))
    }
    fn persistent_names(&self) -> Vec<String> {
        Vec::new()
    }
    fn persistent(&self, name: &str) -> Result<HostTensor> {
        Err(ModelError::Usage(format!("the trainer's executor was released (`{name}`)")))
    }
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
        let zero1 = zero1_plan(&trace, opts)?;
        let (trace, _log) = optimize(&trace, &CompileOptions { passes: true, ..opts.clone() })?;
        let persistent = shard(zero1.as_ref(), persistent_values(&cfg, &sc, weights, &states)?)?;
        let exec = make(trace, persistent)?;
        Ok(Trainer {
            cfg,
            sc,
            optimizer,
            data_inputs,
            exec,
            schedule,
            step: 0,
            buckets: None,
            evals: Vec::new(),
            eval_shape: None,
            opts: CompileOptions { passes: false, ..opts.clone() },
            zero1,
            group: None,
        })
    }

    /// As `new`, with one step per shape bucket (`sc`'s batch and seq are replaced by each
    /// bucket's) sharing the parameters and optimizer states: [`Trainer::step`] then takes
    /// batches of any shape a bucket holds, every micro-batch of a step the same shape. CUDA
    /// runs them as `rumble_cuda::BucketedGraphs` (graphs captured on a bucket's first step).
    /// Each bucket's step is compiled with `opts`.
    pub fn with_buckets(
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
        let device = device.resolve()?;
        let mut traces = Vec::new();
        let mut first: Option<TrainStep> = None;
        for s in buckets.shapes() {
            let step = build_train_step(&cfg, &StepConfig { batch: s.batch, seq: s.seq, ..sc.clone() })?;
            traces.push(optimize(&step.trace, &CompileOptions { passes: true, ..opts.clone() })?.0);
            first.get_or_insert(step);
        }
        let TrainStep { trace, data_inputs, states } =
            first.ok_or_else(|| ModelError::Usage("shape buckets: none given".into()))?;
        // Every bucket's plan shards the same parameters alike: the first one's serves all.
        let zero1 = zero1_plan(&trace, opts)?;
        let persistent = shard(zero1.as_ref(), persistent_values(&cfg, &sc, weights, &states)?)?;
        let opts = CompileOptions { passes: false, ..opts.clone() };
        let exec = BucketedExecutor::with_options(buckets.clone(), traces, persistent, device, &opts)?;
        let max = buckets.max();
        let sc = StepConfig { batch: max.batch, seq: max.seq, ..sc };
        Ok(Trainer {
            cfg,
            sc,
            optimizer,
            data_inputs,
            exec: Box::new(exec),
            schedule,
            step: 0,
            buckets: Some(buckets),
            evals: Vec::new(),
            eval_shape: None,
            opts,
            zero1,
            group: None,
        })
    }

    /// The run's links to the other ranks: a ZeRO-1 rank of several gathers the optimizer
    /// states through them ([`Trainer::snapshot`]).
    pub fn with_group(mut self, group: Arc<Group>) -> Trainer {
        self.group = Some(group);
        self
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

    /// Continues a run after `step` steps (a resumed run): the next step is `step + 1`, for the
    /// schedule and Adam's bias corrections.
    pub fn set_steps_done(&mut self, step: u64) {
        self.step = step;
    }

    pub fn schedule(&self) -> &LrSchedule {
        &self.schedule
    }

    /// The optimizer states, by name, in trace order.
    pub fn optimizer_states(&self) -> Result<Vec<(String, HostTensor)>> {
        Ok(self.snapshot()?.1)
    }

    /// The parameters (as [`Trainer::weights`]) and the optimizer states (as
    /// [`Trainer::optimizer_states`]) from one read-back of the executor's persistent values:
    /// a checkpoint reads the device once.
    ///
    /// A ZeRO-1 rank of several gathers every rank's shards: every rank must call this at the
    /// same point of the run; rank 0 gets the whole states, the others none.
    pub fn snapshot(&self) -> Result<(Weights, Vec<(String, HostTensor)>)> {
        let (params, mut held) = self.read_back()?;
        let Some(plan) = &self.zero1 else { return Ok((params, held)) };
        let mut mine = Vec::with_capacity(plan.shard_states.len());
        for s in &plan.shard_states {
            let k = held
                .iter()
                .position(|(n, _)| *n == s.name)
                .ok_or_else(|| ModelError::Usage(format!("the executor lost optimizer shard `{}`", s.name)))?;
            mine.push(held.remove(k).1);
        }
        let world = plan.dp.world;
        let shards = if world == 1 {
            vec![mine]
        } else {
            let g = self.group.as_ref().ok_or_else(|| {
                ModelError::Usage(format!("a ZeRO-1 rank of {world} needs the run's group to gather its states"))
            })?;
            let bytes: Vec<u8> = mine.iter().flat_map(|t| t.bytes.iter().copied()).collect();
            let Some(parts) = g.gather(&bytes)? else { return Ok((params, held)) };
            parts
                .into_iter()
                .map(|p| {
                    let mut at = 0;
                    plan.shard_states
                        .iter()
                        .map(|s| {
                            let n = s.ty.size_in_bytes();
                            let t = HostTensor::new(s.ty.clone(), p.get(at..at + n).unwrap_or_default().to_vec());
                            at += n;
                            t.map_err(ModelError::from)
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?
        };
        held.extend(plan.gather_states(&shards)?);
        Ok((params, held))
    }

    /// The parameters and every other persistent value, as this process's executor holds them.
    fn read_back(&self) -> Result<(Weights, Vec<(String, HostTensor)>)> {
        let specs = param_specs(&self.cfg);
        let params: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        let (mut all, states): (std::collections::HashMap<String, HostTensor>, Vec<_>) = {
            let (p, o): (Vec<_>, Vec<_>) =
                self.exec.persistent_values()?.into_iter().partition(|(n, _)| params.contains(n.as_str()));
            (p.into_iter().collect(), o)
        };
        let mut tensors = Vec::with_capacity(specs.len());
        for spec in &specs {
            let t = all
                .remove(&spec.name)
                .ok_or_else(|| ModelError::Usage(format!("the executor lost parameter `{}`", spec.name)))?;
            tensors.push((spec.name.clone(), t));
        }
        Ok((Weights { tensors }, states))
    }

    /// One optimizer step over `batches` (one per micro-batch); a step built with
    /// [`StepConfig::loss_weights`] weighs each by 1.
    pub fn step(&mut self, batches: &[Batch]) -> Result<StepStats> {
        self.step_weighted(batches, None)
    }

    /// One optimizer step over `batches`, micro-batch `i`'s loss weighted by `weights[i]`
    /// (a step built with [`StepConfig::loss_weights`]; a data-parallel rank's share).
    pub fn step_weighted(&mut self, batches: &[Batch], weights: Option<&[f64]>) -> Result<StepStats> {
        if let Some(w) = weights {
            if !self.sc.loss_weights {
                return Err(ModelError::Usage("loss weights given to a step built without them".into()));
            }
            if w.len() != batches.len() || w.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(ModelError::Usage(format!(
                    "{} loss weights {w:?} for {} micro-batches: one finite, non-negative weight each",
                    w.len(),
                    batches.len()
                )));
            }
        }
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
        for (i, batch) in batches.iter().enumerate() {
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
            if self.sc.loss_weights {
                data.push(HostTensor::scalar(DType::F32, weights.map_or(1.0, |w| w[i])));
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

    /// Builds the validation program for batches of `(batch, seq)` beside the step: on CUDA
    /// (without shape buckets) the executor becomes a [`StepWithEval`], the step and the
    /// program as CUDA graphs over one persistent region and one arena. Elsewhere nothing
    /// changes ([`Trainer::eval`] runs on the CPU reference).
    pub fn with_eval(mut self, batch: usize, seq: usize) -> Result<Trainer> {
        if self.exec.device() != DeviceKind::Cuda || self.buckets.is_some() || self.eval_shape.is_some() {
            return Ok(self);
        }
        let sc = StepConfig { batch, seq, grad_accum: 1, ..self.sc.clone() };
        // The step's own passes and compile options (its memory budget, say), for both.
        let passes = CompileOptions { passes: true, ..self.opts.clone() };
        // The forward alone has no gradients to exchange: each rank evaluates its own batches.
        let eval_passes = CompileOptions { data_parallel: None, ..passes.clone() };
        let eval = optimize(&build_eval_step(&self.cfg, &sc)?, &eval_passes)?.0;
        let step = optimize(&build_train_step(&self.cfg, &self.sc)?.trace, &passes)?.0;
        let values = self.exec.persistent_values()?;
        drop(std::mem::replace(&mut self.exec, Box::new(Released)));
        self.exec = Box::new(StepWithEval::new(step, eval, values, &self.opts)?);
        self.eval_shape = Some((batch, seq));
        Ok(self)
    }

    /// The mean validation loss over `batches` (any shapes; causal-LM), the current parameters
    /// unchanged: the step's forward only ([`crate::step::build_eval_step`]).
    ///
    /// Batches of the shape given to [`Trainer::with_eval`] run on the executor's own program
    /// (on the GPU, in the step's arena); others on the CPU reference with the executor's
    /// current persistent values (copied off the device on CUDA: correct, but slow for a large
    /// model).
    pub fn eval(&mut self, batches: &[Batch]) -> Result<f32> {
        let losses = self.eval_losses(batches)?;
        Ok((losses.iter().sum::<f64>() / losses.len() as f64) as f32)
    }

    /// Each batch's validation loss, as [`Trainer::eval`] averages them (a data-parallel rank
    /// weighs its batches' losses by their counted targets before the ranks' mean).
    pub fn eval_losses(&mut self, batches: &[Batch]) -> Result<Vec<f64>> {
        if batches.is_empty() {
            return Err(ModelError::Usage("validation over no batches".into()));
        }
        let mut values: Option<std::collections::HashMap<String, HostTensor>> = None;
        let mut losses = Vec::with_capacity(batches.len());
        for batch in batches {
            let shape = (batch.batch, batch.seq);
            if batch.tokens.len() != shape.0 * shape.1 || batch.targets.len() != batch.tokens.len() {
                return Err(ModelError::Usage(format!(
                    "validation batch ({}, {}) holds {} tokens and {} targets",
                    shape.0,
                    shape.1,
                    batch.tokens.len(),
                    batch.targets.len()
                )));
            }
            let vocab = self.cfg.vocab_size as i64;
            if let Some(bad) = batch.tokens.iter().find(|&&x| x < 0 || x >= vocab) {
                return Err(ModelError::Usage(format!(
                    "validation token id {bad} is outside the vocabulary 0..{vocab}"
                )));
            }
            if self.eval_shape == Some(shape) {
                let data = [
                    host::from_i64s(&[shape.0, shape.1], &batch.tokens)?,
                    host::from_i64s(&[shape.0 * shape.1], &batch.targets)?,
                ];
                if let Some(outs) = self.exec.eval(&data)? {
                    let loss = outs.first().ok_or_else(|| ModelError::Usage("validation returned no loss".into()))?;
                    losses.push(host::item(loss)? as f64);
                    continue;
                }
            }
            if values.is_none() {
                values = Some(self.exec.persistent_values()?.into_iter().collect());
            }
            let values = values.as_ref().ok_or_else(|| ModelError::Usage("validation: no values".into()))?;
            if !self.evals.iter().any(|(s, _)| *s == shape) {
                let sc = StepConfig { batch: shape.0, seq: shape.1, grad_accum: 1, ..self.sc.clone() };
                let trace = optimize(&build_eval_step(&self.cfg, &sc)?, &CompileOptions::default())?.0;
                self.evals.push((shape, trace));
            }
            let trace =
                &self.evals.iter().find(|(s, _)| *s == shape).ok_or_else(|| ModelError::Usage("eval".into()))?.1;
            let mut inputs = Vec::with_capacity(trace.inputs.len());
            for inp in &trace.inputs {
                inputs.push(match inp.name.as_str() {
                    "tokens" => host::from_i64s(&[shape.0, shape.1], &batch.tokens)?,
                    "targets" => host::from_i64s(&[shape.0 * shape.1], &batch.targets)?,
                    n => values
                        .get(n)
                        .cloned()
                        .ok_or_else(|| ModelError::Usage(format!("validation: the executor has no `{n}`")))?,
                });
            }
            let outs = rumble_core::cpu::eval(trace, &inputs)?;
            losses.push(host::item(
                outs.first().ok_or_else(|| ModelError::Usage("validation returned no loss".into()))?,
            )? as f64);
        }
        Ok(losses)
    }

    /// The current parameters as the step keeps them (in the master dtype: f32 under
    /// bf16-mixed).
    pub fn weights(&self) -> Result<Weights> {
        Ok(self.read_back()?.0)
    }

    /// The current parameters in the config's dtype (what a model folder stores).
    pub fn model_weights(&self) -> Result<Weights> {
        cast_weights(self.weights()?, self.cfg.dtype)
    }

    /// Writes `dir/model.safetensors` and `dir/config.json` (a folder transformers loads), in
    /// the config's dtype. Refuses (writing nothing) when a parameter holds NaN or infinity,
    /// naming it.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        save_checkpoint(dir, &self.cfg, &self.model_weights()?)
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

/// Every tensor of `w` cast to `dtype` (e.g. a model's weights to a step's master dtype).
pub fn cast_weights(w: Weights, dtype: DType) -> Result<Weights> {
    Ok(Weights { tensors: w.tensors.into_iter().map(|(n, t)| cast(t, dtype).map(|t| (n, t))).collect::<Result<_>>()? })
}

/// `t` cast to `dtype` (a float tensor; rounded to nearest even when narrowing).
pub fn cast(t: HostTensor, dtype: DType) -> Result<HostTensor> {
    if t.ty.dtype == dtype {
        return Ok(t);
    }
    if !t.ty.dtype.is_float() || !dtype.is_float() {
        return Err(ModelError::Usage(format!("cannot cast a {} tensor to {dtype}", t.ty)));
    }
    Ok(t.cast(dtype))
}

/// The starting persistent values of a step: `weights`' parameters (in the config's dtype, or
/// already in the master dtype) cast to the step's master dtype, then every optimizer state
/// of `states`, taken from `weights` where it holds one of that name and type (a resumed run)
/// and zero otherwise. Anything else in `weights` is an error naming it.
pub fn persistent_values(
    cfg: &Config,
    sc: &StepConfig,
    weights: Weights,
    states: &[(String, TensorType)],
) -> Result<Vec<(String, HostTensor)>> {
    let master = sc.master_dtype(cfg.dtype);
    let mut given: std::collections::HashMap<String, HostTensor> = weights.tensors.into_iter().collect();
    let mut out = Vec::with_capacity(given.len() + states.len());
    for spec in param_specs(cfg) {
        let t = given
            .remove(&spec.name)
            .ok_or_else(|| ModelError::Usage(format!("no value given for parameter `{}` ({})", spec.name, spec.ty)))?;
        out.push((spec.name, cast(t, master)?));
    }
    for (name, ty) in states {
        let t = match given.remove(name) {
            Some(t) if &t.ty == ty => t,
            Some(t) => {
                return Err(ModelError::Usage(format!("optimizer state `{name}` is {}, the step keeps {ty}", t.ty)));
            }
            None => host::zeros(ty),
        };
        out.push((name.clone(), t));
    }
    let mut extra: Vec<String> = given.into_keys().collect();
    extra.sort();
    if let Some(name) = extra.first() {
        return Err(ModelError::Usage(format!("`{name}` is neither a parameter nor an optimizer state of this step")));
    }
    Ok(out)
}

/// The plan of a ZeRO-1 rank's program of `trace` under `opts` (`None` for any other).
fn zero1_plan(trace: &Trace, opts: &CompileOptions) -> Result<Option<DpPlan>> {
    match opts.data_parallel {
        Some(dp) if dp.mode == Mode::Zero1 => Ok(Some(data_parallel(trace, &dp)?.1)),
        _ => Ok(None),
    }
}

/// `persistent` with the whole optimizer states a ZeRO-1 `plan` shards replaced by this rank's
/// shards of them.
fn shard(plan: Option<&DpPlan>, persistent: Vec<(String, HostTensor)>) -> Result<Vec<(String, HostTensor)>> {
    let Some(plan) = plan else { return Ok(persistent) };
    let sharded: std::collections::HashSet<&str> =
        plan.shard_states.iter().flat_map(|s| s.members.iter().map(|(n, _)| n.as_str())).collect();
    let whole: std::collections::HashMap<&str, &HostTensor> =
        persistent.iter().filter(|(n, _)| sharded.contains(n.as_str())).map(|(n, t)| (n.as_str(), t)).collect();
    let shards = plan.shard_states(&|n| whole.get(n).map(|t| (*t).clone()))?;
    let mut out: Vec<(String, HostTensor)> =
        persistent.iter().filter(|(n, _)| !sharded.contains(n.as_str())).cloned().collect();
    out.extend(plan.shard_states.iter().map(|s| s.name.clone()).zip(shards));
    Ok(out)
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
