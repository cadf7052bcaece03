//! Options shared by the subcommands: which model (a preset or a config.json), the batch
//! shape, the optimizer; and turning them into a `Config` and a `StepConfig`.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use rumble_models::{Config, ModelError, Objective, Optimizer, PRESET_NAMES, Result, StepConfig, preset};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    Adamw,
    Sgd,
    /// No optimizer: forward and backward only (train needs one).
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ObjectiveArg {
    /// The causal-LM cross-entropy loss.
    Loss,
    /// `logits.sum()` in f32 (the seed reproduction's objective).
    Sum,
}

/// Which model and how a step is shaped.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A preset (tiny, small, seed-llama, seed-qwen2), a config.json file, or a folder holding
    /// one. A preset's name always means the preset, even where a file of that name exists:
    /// write `./tiny` for the file. Default: tiny, or the config.json beside --init-from.
    #[arg(long, value_name = "FILE|PRESET")]
    pub config: Option<String>,
    /// Sequences per micro-batch (default: the preset's, 1 for a config file).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence (default: the preset's, 256 for a config file).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Micro-batches accumulated into one optimizer step.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub grad_accum: usize,
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub optimizer: OptimizerArg,
    /// The objective (default: the preset's; `loss` for config files).
    #[arg(long, value_enum)]
    pub objective: Option<ObjectiveArg>,
    /// Weight decay (AdamW: decoupled; SGD: L2). Default 0.1 for AdamW, 0 for SGD.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Clip the global gradient norm to this value.
    #[arg(long, value_name = "MAX_NORM")]
    pub clip: Option<f64>,
    /// Compute the logits as a tensor and then the loss (as transformers does), instead of
    /// the fused projection-and-loss op that never holds all the logits.
    #[arg(long)]
    pub materialize_logits: bool,
    /// bf16-mixed (f32 master weights and optimizer state, bf16 compute), bf16-true or 32-true.
    /// Default: train uses bf16-mixed for a bf16 model and 32-true for an f32 one; plan and
    /// bench run the model as stored.
    #[arg(long, value_name = "PRECISION")]
    pub precision: Option<String>,
}

/// A resolved model choice.
pub struct Resolved {
    pub name: String,
    pub config: Config,
    pub step: StepConfig,
    /// The preset's learning rate (3e-4 for config files).
    pub lr: f64,
}

impl ModelArgs {
    /// Resolves the config; `beside` is a checkpoint whose folder may hold a config.json.
    pub fn resolve(&self, beside: Option<&Path>) -> Result<Resolved> {
        let sibling = beside.and_then(|p| p.parent()).map(|d| d.join("config.json")).filter(|p| p.is_file());
        let (name, config, batch, seq, objective, lr) = match (&self.config, sibling) {
            (Some(c), _) if !PRESET_NAMES.contains(&c.as_str()) && Path::new(c).exists() => {
                let (name, cfg) = config_from_path(Path::new(c))?;
                (name, cfg, 1, 256, Objective::CausalLm, 3e-4)
            }
            (None, Some(file)) => {
                // A checkpoint of a preset (same config) keeps the preset's step shape and
                // learning rate; any other config gets the config-file defaults.
                let (name, cfg) = config_from_path(&file)?;
                match PRESET_NAMES.iter().filter_map(|n| preset(n).ok()).find(|p| p.config == cfg) {
                    Some(p) => (p.name.to_string(), cfg, p.batch, p.seq, p.objective, p.lr),
                    None => (name, cfg, 1, 256, Objective::CausalLm, 3e-4),
                }
            }
            (c, _) => {
                let p = preset(c.as_deref().unwrap_or("tiny"))?;
                (p.name.to_string(), p.config, p.batch, p.seq, p.objective, p.lr)
            }
        };
        let optimizer = match self.optimizer {
            OptimizerArg::Adamw => Some(match (Optimizer::adamw(), self.weight_decay) {
                (Optimizer::AdamW { beta1, beta2, eps, .. }, Some(wd)) => {
                    Optimizer::AdamW { beta1, beta2, eps, weight_decay: wd }
                }
                (o, _) => o,
            }),
            OptimizerArg::Sgd => {
                Some(Optimizer::Sgd { momentum: self.momentum, weight_decay: self.weight_decay.unwrap_or(0.0) })
            }
            OptimizerArg::None => None,
        };
        let objective = match self.objective {
            None => objective,
            Some(ObjectiveArg::Loss) => Objective::CausalLm,
            Some(ObjectiveArg::Sum) => Objective::LogitsSum,
        };
        let step = StepConfig {
            batch: self.batch.unwrap_or(batch),
            seq: self.seq.unwrap_or(seq),
            objective,
            optimizer,
            grad_accum: self.grad_accum,
            clip: self.clip,
            fused_loss: !self.materialize_logits,
            precision: self.precision.as_deref().map(str::parse).transpose()?,
            loss_weights: false,
        };
        config.check_step_sizes(step.batch, step.seq, step.grad_accum)?;
        Ok(Resolved { name, config, step, lr })
    }
}

fn config_from_path(p: &Path) -> Result<(String, Config)> {
    let file: PathBuf = if p.is_dir() { p.join("config.json") } else { p.to_path_buf() };
    let cfg = Config::from_file(&file)?;
    // A model folder's config.json is named after the folder; any other file after itself.
    let named = if file.file_name().is_some_and(|n| n == "config.json") {
        file.parent().and_then(|d| d.file_name())
    } else {
        file.file_stem()
    };
    let name =
        named.map(|n| n.to_string_lossy().into_owned()).filter(|n| !n.is_empty()).unwrap_or_else(|| "model".into());
    Ok((name, cfg))
}

/// Host bytes of the weights a run holds before its step is built: the parameters in the
/// step's master dtype (f32 under bf16-mixed, whatever the model is stored in), the optimizer
/// state in the same dtype (AdamW's two moments, SGD's momentum: each a copy of the
/// parameters), and, when the masters are cast from another stored dtype, the stored copy
/// the cast reads. `None` when the count overflows.
pub fn weight_bytes(cfg: &Config, sc: &StepConfig) -> Option<u64> {
    let states: u64 = match sc.optimizer {
        Some(Optimizer::AdamW { .. }) => 2,
        Some(Optimizer::Sgd { momentum, .. }) if momentum != 0.0 => 1,
        _ => 0,
    };
    let n = cfg.checked_num_params()? as u64;
    let master = sc.master_dtype(cfg.dtype);
    let stored = if master == cfg.dtype { 0 } else { cfg.dtype.size_in_bytes() as u64 };
    let per_param = (master.size_in_bytes() as u64).checked_mul(1 + states)?.checked_add(stored)?;
    n.checked_mul(per_param)
}

/// Refuses, before any weight is allocated, the weights of [`weight_bytes`] larger than the
/// host memory free. `sc` is the step as it will run (its precision resolved).
pub fn check_weights_fit(name: &str, cfg: &Config, sc: &StepConfig) -> Result<()> {
    let bytes = weight_bytes(cfg, sc).ok_or_else(|| ModelError::TooLarge {
        what: format!("the parameters of `{name}`"),
        msg: "their size overflows".into(),
    })?;
    let master = sc.master_dtype(cfg.dtype);
    rumble_models::guard::check_host_memory(
        &format!(
            "`{name}`: {} parameters and optimizer state in {master}{}",
            human(cfg.num_params() as f64),
            if master == cfg.dtype { String::new() } else { format!(" (cast from {})", cfg.dtype) }
        ),
        bytes,
    )
}

/// Refuses, before the step is built, micro-batches whose token data (ids and targets, 8 bytes
/// each) and trace (about 50 nodes a layer forward and backward, a few hundred bytes a node, per
/// micro-batch) would not fit in the host memory free. `with_data`: the step will run (not
/// only be planned), so its token data is counted too.
pub fn check_step_fits(r: &Resolved, with_data: bool) -> Result<()> {
    let k = r.step.grad_accum as u64;
    let tokens = (r.step.batch as u64).saturating_mul(r.step.seq as u64);
    let data = if with_data { tokens.saturating_mul(16).saturating_mul(k) } else { 0 };
    let nodes = (r.config.num_hidden_layers as u64).saturating_mul(50).saturating_add(50).saturating_mul(k);
    rumble_models::guard::check_host_memory(
        &format!(
            "`{}`: {k} micro-batch(es) of {} x {} tokens (their data and trace)",
            r.name, r.step.batch, r.step.seq
        ),
        data.saturating_add(nodes.saturating_mul(512)),
    )
}

/// `12.3 M`-style counts.
pub fn human(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.2} G", n / 1e9),
        n if n >= 1e6 => format!("{:.2} M", n / 1e6),
        n if n >= 1e3 => format!("{:.1} k", n / 1e3),
        n => format!("{n:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumble_core::DType;
    use rumble_models::Precision;

    fn bf16_model() -> Config {
        Config { dtype: DType::BF16, ..preset("small").unwrap().config }
    }

    fn step(optimizer: Option<Optimizer>, precision: Option<Precision>) -> StepConfig {
        StepConfig {
            batch: 1,
            seq: 8,
            objective: Objective::CausalLm,
            optimizer,
            grad_accum: 1,
            clip: None,
            fused_loss: true,
            precision,
            loss_weights: false,
        }
    }

    #[test]
    fn weight_bytes_count_the_master_dtype_and_the_state() {
        let cfg = bf16_model();
        let n = cfg.num_params() as u64;
        let adam = Some(Optimizer::adamw());
        // bf16-mixed: f32 masters and two f32 moments, and the bf16 checkpoint they are cast from.
        assert_eq!(weight_bytes(&cfg, &step(adam, Some(Precision::Bf16Mixed))), Some(n * (3 * 4 + 2)));
        assert_eq!(weight_bytes(&cfg, &step(adam, Some(Precision::Bf16True))), Some(n * 3 * 2));
        assert_eq!(weight_bytes(&cfg, &step(adam, Some(Precision::F32True))), Some(n * (3 * 4 + 2)));
        assert_eq!(weight_bytes(&cfg, &step(adam, None)), Some(n * 3 * 2), "no precision: as stored");
        let f32_cfg = Config { dtype: DType::F32, ..cfg.clone() };
        assert_eq!(weight_bytes(&f32_cfg, &step(adam, Some(Precision::F32True))), Some(n * 3 * 4));
        let sgd = Some(Optimizer::Sgd { momentum: 0.9, weight_decay: 0.0 });
        assert_eq!(weight_bytes(&cfg, &step(sgd, Some(Precision::Bf16Mixed))), Some(n * (2 * 4 + 2)));
        let plain = Some(Optimizer::Sgd { momentum: 0.0, weight_decay: 0.0 });
        assert_eq!(weight_bytes(&cfg, &step(plain, Some(Precision::Bf16True))), Some(n * 2));
        assert_eq!(weight_bytes(&cfg, &step(None, Some(Precision::Bf16Mixed))), Some(n * (4 + 2)));
    }

    #[test]
    fn a_model_too_large_for_the_host_is_refused_naming_the_master_dtype() {
        // A vocabulary of 2^40 rows: terabytes of masters, more than any host has free.
        let cfg = Config { vocab_size: 1 << 40, ..bf16_model() };
        let e = check_weights_fit("huge", &cfg, &step(Some(Optimizer::adamw()), Some(Precision::Bf16Mixed)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`huge`") && e.contains("in f32 (cast from bf16)"), "{e}");
        let big = Config { vocab_size: usize::MAX / 2, ..bf16_model() };
        assert!(weight_bytes(&big, &step(Some(Optimizer::adamw()), Some(Precision::Bf16Mixed))).is_none());
    }
}
