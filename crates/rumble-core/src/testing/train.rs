//! A whole training step for [`TinyLlama`]: forward, the backward from `autodiff::backward`,
//! and an optimizer (none, SGD or AdamW) whose new parameters and moments are `update_of`
//! outputs. The planner's tests and benchmark plan these joint traces.

use super::TinyLlama;
use crate::Result;
use crate::autodiff::backward;
use crate::ir::{InputRole, OutputRole, Phase, Tensor, Trace};

/// The optimizer appended to a training step (constants baked in; AdamW at step 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// No update: the gradients are outputs (`grad_of`).
    None,
    Sgd {
        lr: f64,
    },
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
}

impl Optimizer {
    pub fn adamw(lr: f64) -> Self {
        Optimizer::AdamW { lr, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

impl TinyLlama {
    /// The joint trace of one training step: outputs `loss`, then per parameter either its
    /// gradient (`Optimizer::None`) or its update (and its moments' updates for AdamW).
    pub fn train_step(&self, opt: Optimizer) -> Result<Trace> {
        let g = self.loss_graph()?;
        let snap = g.snapshot();
        let loss = snap.output("loss").map(|o| g.value(o.value)).ok_or_else(|| crate::Error::msg("no loss"))?;
        let params: Vec<(String, Tensor)> = snap
            .inputs
            .iter()
            .filter(|i| i.role == InputRole::Param)
            .map(|i| (i.name.clone(), g.value(i.value)))
            .collect();
        let refs: Vec<&Tensor> = params.iter().map(|(_, p)| p).collect();
        let grads = backward(&loss, &refs)?;
        g.set_phase(Phase::Optimizer);
        for ((name, p), gr) in params.iter().zip(&grads) {
            match opt {
                Optimizer::None => g.output_with_role(gr, &format!("grad.{name}"), OutputRole::Grad { of: p.id() })?,
                Optimizer::Sgd { lr } => {
                    let new = p.sub(&gr.mul_scalar(lr)?)?;
                    g.output_with_role(&new, &format!("new.{name}"), OutputRole::Update { of: p.id() })?;
                }
                Optimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                    let m = g.input(&format!("{name}.exp_avg"), p.ty().clone(), InputRole::OptState)?;
                    let v = g.input(&format!("{name}.exp_avg_sq"), p.ty().clone(), InputRole::OptState)?;
                    let m2 = m.mul_scalar(beta1)?.add(&gr.mul_scalar(1.0 - beta1)?)?;
                    let v2 = v.mul_scalar(beta2)?.add(&gr.square()?.mul_scalar(1.0 - beta2)?)?;
                    let denom = v2.mul_scalar(1.0 / (1.0 - beta2))?.sqrt()?.add_scalar(eps)?;
                    let step = m2.div(&denom)?.mul_scalar(lr / (1.0 - beta1))?;
                    let new = p.mul_scalar(1.0 - lr * weight_decay)?.sub(&step)?;
                    g.output_with_role(&new, &format!("new.{name}"), OutputRole::Update { of: p.id() })?;
                    g.output_with_role(&m2, &format!("new.{name}.exp_avg"), OutputRole::Update { of: m.id() })?;
                    g.output_with_role(&v2, &format!("new.{name}.exp_avg_sq"), OutputRole::Update { of: v.id() })?;
                }
            }
        }
        g.set_phase(Phase::Forward);
        g.finish()
    }
}
