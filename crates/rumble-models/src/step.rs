//! The training step as one trace: forward, loss, backward, gradient accumulation, clipping and
//! the optimizer, so the planner and the CUDA-graph executor see the whole program.
//!
//! **Gradient accumulation** puts the `k` micro-batches in the same trace, one after another:
//! forward 1, backward 1, forward 2, backward 2, ..., then the optimizer. Each backward is
//! appended right after its forward, so micro-batch `i`'s activations die before micro-batch
//! `i+1`'s are born and the planner reuses their memory; only the running gradient sums (f32 when
//! `k > 1`) live across micro-batches. We chose this over a separate "accumulate" program and an
//! "apply" program because one program is one replay a step, keeps the gradient sums in the
//! transient arena instead of persistent buffers, and lets the planner see every lifetime; the
//! cost is a trace `k` times longer, which is fine for the small `k` used in practice.
//! The loss is the mean of the micro-batch losses and the gradient is the mean of theirs, which
//! equals the full-batch mean when every micro-batch has as many counted targets (always true
//! for corpus windows and for Hugging Face's `labels = input_ids`).
//!
//! **Precision** ([`Precision`], litgpt's names): `32-true` and `bf16-true` keep parameters and
//! optimizer state in the compute dtype. `bf16-mixed` keeps f32 *master* parameters and f32
//! optimizer state and computes as PyTorch's autocast does: the step's first forward ops cast
//! each matmul weight to a bf16 copy (values of the arena, like any activation), every matmul
//! and the attention run in bf16, while the embedding lookup, the norms (with their f32 weights)
//! and the residual stream stay in f32 ([`crate::model::Params::autocast`]). Gradients flow back
//! through the casts' VJPs to the f32 masters (the micro-batch sums are f32), which the optimizer
//! updates in f32. Everything stays one trace, planned once.
//!
//! Trace inputs, in order: per micro-batch `tokens` (i64 `[B, T]`), for the causal-LM
//! objective `targets` (i64 `[B*T]`) and with [`StepConfig::loss_weights`] `loss_weight` (f32
//! `[]`), named `tokens.{i}`/`targets.{i}`/`loss_weight.{i}` when `k > 1`; the
//! optimizer's scalars (`lr`, ...); the parameters (Hugging Face names); the optimizer states.
//! Outputs: `loss` (f32 `[]`), `grad_norm` when clipping, then `new.{name}` updates of every
//! parameter and state. Without an optimizer the outputs are `loss` and `grad.{name}` (role
//! `Grad`): the benchmark workloads' forward + backward.

use std::fmt;
use std::str::FromStr;

use rumble_core::ir::{InputRole, OutputRole, Phase};
use rumble_core::{DType, Graph, Tensor, TensorType, Trace};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::model::{self, Params};
use crate::optim::{self, Optimizer};
use crate::presets::Objective;

/// How parameters are stored and computed with (PyTorch Lightning / litgpt's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 master parameters and optimizer state; the forward and backward run on bf16 copies.
    Bf16Mixed,
    /// Parameters, optimizer state and compute in bf16 (updates below bf16's resolution vanish).
    Bf16True,
    /// Everything in f32.
    F32True,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::Bf16Mixed, Precision::Bf16True, Precision::F32True];

    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Bf16True => "bf16-true",
            Precision::F32True => "32-true",
        }
    }

    /// The dtype the forward and backward compute in.
    pub fn compute(self) -> DType {
        match self {
            Precision::Bf16Mixed | Precision::Bf16True => DType::BF16,
            Precision::F32True => DType::F32,
        }
    }

    /// The dtype of the parameters (masters) and optimizer state the step keeps.
    pub fn master(self) -> DType {
        match self {
            Precision::Bf16True => DType::BF16,
            Precision::Bf16Mixed | Precision::F32True => DType::F32,
        }
    }

    /// The default for a checkpoint stored in `dtype`: bf16-mixed for bf16, 32-true for f32;
    /// `None` for other dtypes (their step runs as stored).
    pub fn default_for(dtype: DType) -> Option<Precision> {
        match dtype {
            DType::BF16 => Some(Precision::Bf16Mixed),
            DType::F32 => Some(Precision::F32True),
            _ => None,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| ModelError::Usage(format!("unknown precision `{s}` (bf16-mixed, bf16-true or 32-true)")))
    }
}

/// The shape of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepConfig {
    pub batch: usize,
    pub seq: usize,
    pub objective: Objective,
    /// `None`: forward and backward only, gradients as outputs.
    pub optimizer: Option<Optimizer>,
    /// Micro-batches per step (1: no accumulation).
    pub grad_accum: usize,
    /// Clip the global gradient norm to this value.
    pub clip: Option<f64>,
    /// Compute the last projection and the cross-entropy as one `linear_cross_entropy` op
    /// (never materialising the `(B*T, V)` logits) instead of `matmul` + `cross_entropy`.
    pub fused_loss: bool,
    /// `None`: parameters, optimizer state and compute all in the config's dtype. `Some(p)`:
    /// parameters and state in `p.master()`, compute in `p.compute()` (the config's dtype is
    /// then only the dtype checkpoints are stored in).
    pub precision: Option<Precision>,
    /// Multiply each micro-batch's loss by a scalar f32 input `loss_weight` (`loss_weight.{i}`
    /// when `grad_accum > 1`) before its backward. A rank of a data-parallel run gets
    /// `n_r * world / N` (its counted targets `n_r` of the global micro-batch's `N`), so the
    /// ranks' mean of their weighted losses and gradients is the global micro-batch's mean
    /// over its counted targets, even where the ranks count different numbers (prompt tokens
    /// masked, padding).
    pub loss_weights: bool,
}

impl StepConfig {
    /// A causal-LM step of `batch` sequences of `seq` tokens: no optimizer, no accumulation or
    /// clipping, the fused loss, the config's dtype throughout. Other settings by struct update:
    /// `StepConfig { clip: Some(1.0), ..StepConfig::new(4, 32) }`.
    pub fn new(batch: usize, seq: usize) -> StepConfig {
        StepConfig {
            batch,
            seq,
            objective: Objective::CausalLm,
            optimizer: None,
            grad_accum: 1,
            clip: None,
            fused_loss: true,
            precision: None,
            loss_weights: false,
        }
    }

    /// The dtype of the step's parameter inputs (and optimizer state) for a model stored in
    /// `stored`.
    pub fn master_dtype(&self, stored: DType) -> DType {
        self.precision.map_or(stored, Precision::master)
    }

    /// The dtype the step computes in for a model stored in `stored`.
    pub fn compute_dtype(&self, stored: DType) -> DType {
        self.precision.map_or(stored, Precision::compute)
    }
}

/// A built step and what its inputs are.
#[derive(Debug)]
pub struct TrainStep {
    pub trace: Trace,
    /// Names of the per-step data inputs, in trace order.
    pub data_inputs: Vec<String>,
    /// Optimizer states: name and type, in trace order.
    pub states: Vec<(String, TensorType)>,
}

/// The trace of a forward pass and its loss (output `loss`); no backward.
pub fn build_forward(cfg: &Config, batch: usize, seq: usize, objective: Objective, fused_loss: bool) -> Result<Trace> {
    cfg.check_step_sizes(batch, seq, 1)?;
    let g = Graph::new(format!("{}_forward", cfg.arch.model_type()));
    let tokens = g.data("tokens", DType::I64, &[batch, seq])?;
    let targets = match objective {
        Objective::CausalLm => Some(g.data("targets", DType::I64, &[batch * seq])?),
        Objective::LogitsSum => None,
    };
    let params = Params::declare(&g, cfg)?;
    let loss = model::objective(cfg, &params, &tokens, targets.as_ref(), fused_loss)?; // f32[]
    g.output(&loss, "loss")?;
    Ok(g.finish()?)
}

/// The validation program of the step `sc` (causal-LM): `tokens` and `targets` in, `loss` out,
/// forward only. Its persistent inputs are the step's own, in the same order and types
/// (parameters in the master dtype, cast to the compute dtype as the step does; the optimizer
/// states, unused), so it can share the step's persistent region and arena.
pub fn build_eval_step(cfg: &Config, sc: &StepConfig) -> Result<Trace> {
    if sc.objective != Objective::CausalLm {
        return Err(ModelError::Usage("validation needs the causal-LM objective".into()));
    }
    let g = Graph::new(format!("{}_eval", cfg.arch.model_type()));
    let (b, t) = (sc.batch, sc.seq);
    let tokens = g.data("tokens", DType::I64, &[b, t])?;
    let targets = g.data("targets", DType::I64, &[b * t])?;
    let params = Params::declare(&g, &Config { dtype: sc.master_dtype(cfg.dtype), ..cfg.clone() })?;
    if let Some(opt) = &sc.optimizer {
        for (name, p) in params.names.iter().zip(&params.list) {
            for (sname, ty) in opt.state_specs(name, p.ty()) {
                g.input(&sname, ty, InputRole::OptState)?;
            }
        }
    }
    g.set_phase(Phase::Forward);
    let compute_cfg = Config { dtype: sc.compute_dtype(cfg.dtype), ..cfg.clone() };
    let compute = params.autocast(compute_cfg.dtype)?;
    let loss = model::objective(&compute_cfg, &compute, &tokens, Some(&targets), sc.fused_loss)?; // f32[]
    g.output(&loss, "loss")?;
    Ok(g.finish()?)
}

/// Builds the whole step described by `sc` for `cfg`.
pub fn build_train_step(cfg: &Config, sc: &StepConfig) -> Result<TrainStep> {
    let k = sc.grad_accum;
    if k == 0 || sc.batch == 0 || sc.seq == 0 {
        return Err(ModelError::Usage(format!(
            "batch ({}), seq ({}) and grad_accum ({k}) must be at least 1",
            sc.batch, sc.seq
        )));
    }
    cfg.check_step_sizes(sc.batch, sc.seq, k)?;
    if sc.clip.is_some_and(|c| c.is_nan() || c <= 0.0) {
        return Err(ModelError::Usage(format!("clip must be positive, got {:?}", sc.clip)));
    }
    let kind = if sc.optimizer.is_some() { "train_step" } else { "grad_step" };
    let g = Graph::new(format!("{}_{kind}", cfg.arch.model_type()));
    let (b, t) = (sc.batch, sc.seq);

    // Inputs: data, optimizer scalars, parameters, optimizer states.
    let mut data_inputs = Vec::new();
    let mut micro = Vec::new();
    for i in 0..k {
        let name = |s: &str| if k == 1 { s.to_string() } else { format!("{s}.{i}") };
        let tokens = g.data(&name("tokens"), DType::I64, &[b, t])?;
        data_inputs.push(name("tokens"));
        let targets = match sc.objective {
            Objective::CausalLm => {
                data_inputs.push(name("targets"));
                Some(g.data(&name("targets"), DType::I64, &[b * t])?)
            }
            Objective::LogitsSum => None,
        };
        let weight = if sc.loss_weights {
            data_inputs.push(name("loss_weight"));
            Some(g.data(&name("loss_weight"), DType::F32, &[])?)
        } else {
            None
        };
        micro.push((tokens, targets, weight));
    }
    let hyper = match &sc.optimizer {
        Some(opt) => {
            data_inputs.extend(opt.hyper_names().iter().map(|s| s.to_string()));
            Some(opt.declare_hyper(&g)?)
        }
        None => None,
    };
    // Parameters as stored (masters), and the copies the model computes with.
    let compute_cfg = Config { dtype: sc.compute_dtype(cfg.dtype), ..cfg.clone() };
    let params = Params::declare(&g, &Config { dtype: sc.master_dtype(cfg.dtype), ..cfg.clone() })?;
    g.set_phase(Phase::Forward);
    let compute = params.autocast(compute_cfg.dtype)?; // each matmul weight cast once, at the step's start
    let cfg = &compute_cfg;
    let mut states = Vec::new();
    let mut state_tensors = Vec::new();
    if let Some(opt) = &sc.optimizer {
        for (name, p) in params.names.iter().zip(&params.list) {
            let mut mine = Vec::new();
            for (sname, ty) in opt.state_specs(name, p.ty()) {
                mine.push((sname.clone(), g.input(&sname, ty.clone(), InputRole::OptState)?));
                states.push((sname, ty));
            }
            state_tensors.push(mine);
        }
    }

    // Forward and backward of each micro-batch; gradient sums.
    let wrt: Vec<&Tensor> = params.list.iter().collect();
    let mut sums: Vec<Tensor> = Vec::new();
    let mut losses = Vec::new();
    for (tokens, targets, weight) in &micro {
        g.set_phase(Phase::Forward);
        let mut loss = model::objective(cfg, &compute, tokens, targets.as_ref(), sc.fused_loss)?; // f32[]
        if let Some(w) = weight {
            loss = loss.mul(w)?;
        }
        let grads = rumble_core::autodiff::backward(&loss, &wrt)?;
        g.set_phase(Phase::Backward);
        sums = if sums.is_empty() && k == 1 {
            grads
        } else if sums.is_empty() {
            grads.iter().map(|gr| gr.cast(DType::F32)).collect::<rumble_core::Result<_>>()?
        } else {
            sums.iter().zip(&grads).map(|(s, gr)| s.add(&gr.cast(DType::F32)?)).collect::<rumble_core::Result<_>>()?
        };
        losses.push(loss);
    }

    g.set_phase(Phase::Optimizer);
    let mut loss = losses[0].clone();
    for l in &losses[1..] {
        loss = loss.add(l)?;
    }
    if k > 1 {
        loss = loss.mul_scalar(1.0 / k as f64)?;
    }
    g.output(&loss, "loss")?;

    // Mean over micro-batches and clipping, folded into one f32 scale of the summed gradients.
    let mut scale: Option<Tensor> = None;
    if let Some(max_norm) = sc.clip {
        let norm = optim::global_norm(&sums)?.mul_scalar(1.0 / k as f64)?; // f32[]: norm of the mean gradient
        g.output(&norm, "grad_norm")?;
        scale = Some(optim::clip_coefficient(&norm, max_norm)?);
    }
    if k > 1 {
        let inv_k = g.scalar(1.0 / k as f64, DType::F32);
        scale = Some(match scale {
            Some(s) => s.mul(&inv_k)?,
            None => inv_k,
        });
    }

    match (&sc.optimizer, hyper) {
        (Some(opt), Some(mut hyper)) => {
            opt.derive(&mut hyper)?;
            let mut new_states = Vec::new();
            for (i, p) in params.list.iter().enumerate() {
                let old: Vec<Tensor> = state_tensors[i].iter().map(|(_, s)| s.clone()).collect();
                let (np, ns) = opt.update(&hyper, p, &sums[i], scale.as_ref(), &old)?;
                g.output_with_role(&np, &format!("new.{}", params.names[i]), OutputRole::Update { of: p.id() })?;
                new_states.extend(state_tensors[i].iter().zip(ns));
            }
            for ((name, old), new) in new_states {
                g.output_with_role(&new, &format!("new.{name}"), OutputRole::Update { of: old.id() })?;
            }
        }
        _ => {
            for (i, p) in params.list.iter().enumerate() {
                let mut gr = sums[i].clone();
                if let Some(s) = &scale {
                    gr = gr.cast(DType::F32)?.mul(&s.broadcast_to(gr.dims())?)?;
                }
                let gr = gr.cast(p.dtype())?;
                g.output_with_role(&gr, &format!("grad.{}", params.names[i]), OutputRole::Grad { of: p.id() })?;
            }
        }
    }
    let trace = g.finish()?;
    Ok(TrainStep { trace, data_inputs, states })
}
