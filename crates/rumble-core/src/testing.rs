//! Small LLaMA-style programs for tests and benchmarks of the core crate (the real models,
//! built from Hugging Face configs, live in `rumble-models`), and [`simulate`], the lockstep
//! CPU simulator of data-parallel rank traces.

mod simulate;
mod train;

pub use simulate::simulate;
pub use train::Optimizer;

use crate::Result;
use crate::cpu::{HostTensor, Rng};
use crate::ir::{DType, Graph, Tensor, Trace};

/// The Rust source files (`.rs`) below `dir`, skipping `target` folders: what the repository
/// hygiene tests read.
pub fn rust_sources(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for p in entries.flatten().map(|e| e.path()) {
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    todo.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Random values for every input of `trace`, in trace order: integer inputs (token ids,
/// targets) uniform below `vocab`, floating ones normal with standard deviation `std`.
pub fn random_inputs(trace: &Trace, vocab: u64, std: f64, rng: &mut Rng) -> Vec<HostTensor> {
    let mut out = Vec::with_capacity(trace.inputs.len());
    for i in &trace.inputs {
        let ty = trace.ty(i.value).clone();
        out.push(if ty.dtype.is_int() { HostTensor::randint(ty, vocab, rng) } else { HostTensor::randn(ty, std, rng) });
    }
    out
}

/// A training step's state at random: parameters normal with deviation `param_std`, optimizer
/// moments normal with `state_std` (second moments squared, so non-negative), and every other
/// input from `other`. Values are drawn in input order.
pub fn random_train_state(
    trace: &Trace,
    param_std: f64,
    state_std: f64,
    rng: &mut Rng,
    other: impl Fn(crate::ir::TensorType, &mut Rng) -> HostTensor,
) -> Vec<HostTensor> {
    use crate::ir::InputRole;
    let mut out = Vec::with_capacity(trace.inputs.len());
    for i in &trace.inputs {
        let ty = trace.ty(i.value).clone();
        out.push(match i.role {
            InputRole::Param => HostTensor::randn(ty, param_std, rng),
            InputRole::OptState if i.name.contains("exp_avg_sq") => {
                let v: Vec<f64> =
                    HostTensor::randn(ty.clone(), state_std, rng).to_f64().iter().map(|x| x * x).collect();
                HostTensor::from_f64(ty.dtype, ty.dims(), &v).expect("same shape")
            }
            InputRole::OptState => HostTensor::randn(ty, state_std, rng),
            _ => other(ty, rng),
        });
    }
    out
}

/// Proportions of a LLaMA-style decoder, small enough for CPU tests.
#[derive(Clone, Debug)]
pub struct TinyLlama {
    pub vocab: usize,
    pub dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hidden: usize,
    pub layers: usize,
    pub batch: usize,
    pub seq: usize,
    pub dtype: DType,
}

impl Default for TinyLlama {
    fn default() -> Self {
        TinyLlama {
            vocab: 32,
            dim: 16,
            heads: 4,
            kv_heads: 2,
            hidden: 24,
            layers: 1,
            batch: 2,
            seq: 5,
            dtype: DType::F64,
        }
    }
}

impl TinyLlama {
    fn linear(&self, g: &Graph, x: &Tensor, name: &str, out: usize, inp: usize) -> Result<Tensor> {
        let w = g.param(name, self.dtype, &[out, inp])?;
        x.matmul_t(&w)
    }

    /// One pre-norm decoder block on `x (B*T, C)`: attention with RoPE and grouped-query heads,
    /// then a SwiGLU MLP, each with a residual.
    pub fn block(&self, g: &Graph, x: &Tensor, l: usize) -> Result<Tensor> {
        let (b, t, c) = (self.batch, self.seq, self.dim);
        let (hq, hkv) = (self.heads, self.kv_heads);
        let d = c / hq;
        let p = |s: &str| format!("layers.{l}.{s}");
        let norm1 = g.param(&p("input_layernorm.weight"), self.dtype, &[c])?;
        let h = x.rms_norm(&norm1, 1e-6)?; // (B*T, C)
        let heads = |y: Tensor, n: usize| -> Result<Tensor> { y.reshape(&[b, t, n, d])?.permute(&[0, 2, 1, 3]) };
        let q = heads(self.linear(g, &h, &p("q_proj.weight"), hq * d, c)?, hq)?.rope(10000.0)?; // (B, Hq, T, D)
        let k = heads(self.linear(g, &h, &p("k_proj.weight"), hkv * d, c)?, hkv)?.rope(10000.0)?; // (B, Hkv, T, D)
        let v = heads(self.linear(g, &h, &p("v_proj.weight"), hkv * d, c)?, hkv)?; // (B, Hkv, T, D)
        let (o, _lse) = Tensor::attention(&q, &k, &v, 1.0 / (d as f64).sqrt(), true)?; // (B, Hq, T, D)
        let o = o.permute(&[0, 2, 1, 3])?.reshape(&[b * t, c])?; // (B*T, C)
        let x = x.add(&self.linear(g, &o, &p("o_proj.weight"), c, c)?)?;
        let norm2 = g.param(&p("post_attention_layernorm.weight"), self.dtype, &[c])?;
        let h = x.rms_norm(&norm2, 1e-6)?;
        let gate = self.linear(g, &h, &p("gate_proj.weight"), self.hidden, c)?; // (B*T, H)
        let up = self.linear(g, &h, &p("up_proj.weight"), self.hidden, c)?;
        let m = self.linear(g, &gate.swiglu(&up)?, &p("down_proj.weight"), c, self.hidden)?; // (B*T, C)
        x.add(&m)
    }

    /// The whole model with a causal-LM loss; outputs `loss`. Inputs: `tokens` and `targets`
    /// (i64 `[B*T]`), then the parameters.
    pub fn loss_graph(&self) -> Result<Graph> {
        let g = Graph::new("tiny_llama");
        let n = self.batch * self.seq;
        let tokens = g.data("tokens", DType::I64, &[n])?;
        let targets = g.data("targets", DType::I64, &[n])?;
        let embed = g.param("embed_tokens.weight", self.dtype, &[self.vocab, self.dim])?;
        let mut x = embed.gather(&tokens)?; // (B*T, C)
        for l in 0..self.layers {
            x = self.block(&g, &x, l)?;
        }
        let norm = g.param("norm.weight", self.dtype, &[self.dim])?;
        let x = x.rms_norm(&norm, 1e-6)?;
        let logits = self.linear(&g, &x, "lm_head.weight", self.vocab, self.dim)?; // (B*T, V)
        let loss = logits.cross_entropy(&targets, -100)?;
        g.output(&loss, "loss")?;
        Ok(g)
    }
}
