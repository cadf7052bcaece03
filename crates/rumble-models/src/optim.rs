//! Optimizers and gradient clipping, written as trace ops (Phase::Optimizer) so the optimizer
//! runs inside the same program as the forward and backward, and the planner sees it all.
//!
//! Numbers that change from step to step (the learning rate, Adam's bias corrections) are f32
//! scalar *inputs* of the trace, not constants: a captured program never changes. The update
//! math runs in f32 whatever the parameter dtype (bf16 parameters and states are read, updated
//! in f32, and rounded once when stored), as fused optimizers do.
//!
//! Semantics follow PyTorch's `torch.optim.AdamW` (decoupled weight decay, bias correction) and
//! `torch.optim.SGD` (momentum, dampening 0, L2 weight decay added to the gradient), and
//! `torch.nn.utils.clip_grad_norm_` (coefficient `min(1, max_norm / (norm + 1e-6))`).
//! Weight decay applies to matrices (embeddings, projections) and not to norms or biases.

use rumble_core::{DType, Graph, Tensor, TensorType};

use crate::error::Result;
use crate::host::{self, HostTensor};

/// An optimizer and its hyper-parameters (the learning rate comes per step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
    Sgd { momentum: f64, weight_decay: f64 },
}

impl Optimizer {
    /// The usual LLM settings: betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
    pub fn adamw() -> Self {
        Optimizer::AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
    pub fn sgd() -> Self {
        Optimizer::Sgd { momentum: 0.9, weight_decay: 0.0 }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::AdamW { .. } => "adamw",
            Optimizer::Sgd { .. } => "sgd",
        }
    }

    /// The names of the per-step scalar inputs, in trace order.
    pub fn hyper_names(&self) -> &'static [&'static str] {
        match self {
            Optimizer::AdamW { .. } => &["lr", "adamw.bias_correction1", "adamw.bias_correction2"],
            Optimizer::Sgd { .. } => &["lr"],
        }
    }

    /// Values of the scalar inputs for step `step` (1-based) at learning rate `lr`.
    pub fn hyper_values(&self, step: u64, lr: f64) -> Vec<HostTensor> {
        match *self {
            Optimizer::AdamW { beta1, beta2, .. } => {
                let t = step.max(1) as i32;
                vec![
                    host::scalar_f32(lr as f32),
                    host::scalar_f32((1.0 - beta1.powi(t)) as f32),
                    host::scalar_f32((1.0 - beta2.powi(t)) as f32),
                ]
            }
            Optimizer::Sgd { .. } => vec![host::scalar_f32(lr as f32)],
        }
    }

    /// The state tensors kept for a parameter called `name` of type `ty`: `(name, type)`.
    pub fn state_specs(&self, name: &str, ty: &TensorType) -> Vec<(String, TensorType)> {
        match *self {
            Optimizer::AdamW { .. } => {
                vec![(format!("adamw.exp_avg.{name}"), ty.clone()), (format!("adamw.exp_avg_sq.{name}"), ty.clone())]
            }
            Optimizer::Sgd { momentum, .. } if momentum != 0.0 => vec![(format!("sgd.momentum.{name}"), ty.clone())],
            Optimizer::Sgd { .. } => vec![],
        }
    }

    /// Declares the scalar inputs on `g`.
    pub fn declare_hyper(&self, g: &Graph) -> Result<Hyper> {
        let mut s = Vec::new();
        for name in self.hyper_names() {
            s.push(g.data(name, DType::F32, &[])?);
        }
        Ok(Hyper { scalars: s, derived: None })
    }

    /// Computes the scalars every parameter's update shares (once a step, not once a
    /// parameter): AdamW's `lr / bc1`, `1 / bc2` and `1 - lr * wd`. Call in the optimizer phase.
    pub fn derive(&self, hyper: &mut Hyper) -> Result<()> {
        if let (Optimizer::AdamW { weight_decay, .. }, [lr, bc1, bc2]) = (self, hyper.scalars.as_slice()) {
            hyper.derived = Some([
                lr.div(bc1)?,                                   // f32[]: lr / (1 - beta1^t)
                bc2.recip()?,                                   // f32[]: 1 / (1 - beta2^t)
                lr.mul_scalar(-weight_decay)?.add_scalar(1.0)?, // f32[]: 1 - lr * wd
            ]);
        }
        Ok(())
    }

    /// One parameter's update: returns the new parameter and new states (same types as the
    /// inputs). `grad` is in any float dtype; `grad_scale` (f32 `[]`, e.g. a clipping
    /// coefficient) multiplies it first.
    pub fn update(
        &self,
        hyper: &Hyper,
        param: &Tensor,
        grad: &Tensor,
        grad_scale: Option<&Tensor>,
        states: &[Tensor],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let dims = param.dims().to_vec();
        let dt = param.dtype();
        let bc = |s: &Tensor| s.broadcast_to(&dims); // f32[] -> f32[dims]
        let mut g = grad.cast(DType::F32)?; // f32[dims]
        if let Some(s) = grad_scale {
            g = g.mul(&bc(s)?)?;
        }
        let p = param.cast(DType::F32)?; // f32[dims]
        let decays = param.rank() >= 2;
        let lr = &hyper.scalars[0];
        match *self {
            Optimizer::AdamW { beta1, beta2, eps, weight_decay } => {
                let mut own = Hyper { scalars: hyper.scalars.clone(), derived: None };
                let [step_size, inv_bc2, keep] = match &hyper.derived {
                    Some(d) => d.clone(),
                    None => {
                        self.derive(&mut own)?;
                        own.derived.clone().ok_or_else(|| rumble_core::Error::msg("AdamW needs 3 scalars"))?
                    }
                };
                let m = states[0].cast(DType::F32)?.mul_scalar(beta1)?.add(&g.mul_scalar(1.0 - beta1)?)?;
                let v = states[1].cast(DType::F32)?.mul_scalar(beta2)?.add(&g.square()?.mul_scalar(1.0 - beta2)?)?;
                let p = if decays && weight_decay != 0.0 { p.mul(&bc(&keep)?)? } else { p }; // decoupled decay
                let denom = v.mul(&bc(&inv_bc2)?)?.sqrt()?.add_scalar(eps)?; // sqrt(v_hat) + eps
                let p = p.sub(&m.div(&denom)?.mul(&bc(&step_size)?)?)?;
                Ok((p.cast(dt)?, vec![m.cast(dt)?, v.cast(dt)?]))
            }
            Optimizer::Sgd { momentum, weight_decay } => {
                if decays && weight_decay != 0.0 {
                    g = g.add(&p.mul_scalar(weight_decay)?)?;
                }
                let (dir, new_states) = if momentum != 0.0 {
                    let buf = states[0].cast(DType::F32)?.mul_scalar(momentum)?.add(&g)?;
                    (buf.clone(), vec![buf.cast(dt)?])
                } else {
                    (g, vec![])
                };
                let p = p.sub(&dir.mul(&bc(lr)?)?)?;
                Ok((p.cast(dt)?, new_states))
            }
        }
    }
}

/// The per-step scalar inputs of an optimizer, in `hyper_names` order, and the scalars
/// derived from them once a step (see [`Optimizer::derive`]).
pub struct Hyper {
    pub scalars: Vec<Tensor>,
    pub derived: Option<[Tensor; 3]>,
}

/// The global L2 norm of `grads` (f32 `[]`), each squared and summed in f32 (one reduction a
/// gradient: the squares are never written).
pub fn global_norm(grads: &[Tensor]) -> Result<Tensor> {
    let mut total: Option<Tensor> = None;
    for g in grads {
        let axes: Vec<usize> = (0..g.rank()).collect();
        let ss = g.cast(DType::F32)?.sum_squares(&axes, false)?; // f32[]
        total = Some(match total {
            Some(t) => t.add(&ss)?,
            None => ss,
        });
    }
    let total = total.ok_or_else(|| rumble_core::Error::msg("global_norm of no gradients"))?;
    Ok(total.sqrt()?)
}

/// PyTorch's clipping coefficient `min(1, max_norm / (norm + 1e-6))` (f32 `[]`).
pub fn clip_coefficient(norm: &Tensor, max_norm: f64) -> Result<Tensor> {
    let one = norm.graph().scalar(1.0, DType::F32);
    Ok(norm.add_scalar(1e-6)?.recip()?.mul_scalar(max_norm)?.minimum(&one)?)
}
