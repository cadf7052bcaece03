//! The LLaMA / Qwen2 decoder, written with rumble_core's builder.
//!
//! It follows Hugging Face transformers' `modeling_llama.py` and `modeling_qwen2.py` (v5):
//! pre-norm blocks; RMSNorm with statistics in f32, the result cast back, then times the weight;
//! rotate-half RoPE on q and k (inverse frequencies rescaled as `rope_scaling` says:
//! `modeling_rope_utils`' linear and llama3); grouped-query causal attention scaled by `head_dim^-0.5`; a SwiGLU
//! MLP (`down(silu(gate(x)) * up(x))`); a final RMSNorm and the `lm_head` (or the embedding table
//! again when embeddings are tied). Parameter names are exactly Hugging Face's, so checkpoints
//! move between rumble and transformers unchanged.
//!
//! Shapes: B batch, T sequence, C hidden, Hq/Hkv query/key-value heads, D head size,
//! F MLP size, V vocabulary. The hidden state is kept as `(B*T, C)` between blocks.

use std::collections::HashMap;

use rumble_core::{DType, Graph, HeadLayout, Tensor, TensorType};

use crate::config::Config;
use crate::error::{ModelError, Result};

/// How a parameter is initialised (Hugging Face's `_init_weights`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation (`initializer_range`).
    Normal(f64),
    Ones,
    Zeros,
}

/// One parameter: its Hugging Face name, type and initialisation.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub ty: TensorType,
    pub init: Init,
}

/// The Hugging Face tensors a packed parameter stacks, in row order, or `None` for a parameter
/// stored as it is. rumble keeps `mlp.gate_proj` and `mlp.up_proj` as one `mlp.gate_up_proj`
/// `[2F, C]`: one matmul to 2F is faster than two to F (H200, f32, 2048 x 17280 x 3200: 4.50
/// against 2 x 2.41 ms), and swiglu reads both halves of each row (`swiglu_packed`).
/// Checkpoints keep Hugging Face's names ([`crate::Weights`] packs on load, splits on save).
pub fn hf_parts(name: &str) -> Option<[String; 2]> {
    let layer = name.strip_suffix("mlp.gate_up_proj.weight")?;
    Some([format!("{layer}mlp.gate_proj.weight"), format!("{layer}mlp.up_proj.weight")])
}

/// Every parameter of the model in a fixed order (the order of trace inputs and of checkpoint
/// listings). Tied embeddings appear once, as `model.embed_tokens.weight`; gate and up
/// projections are packed ([`hf_parts`]).
pub fn param_specs(cfg: &Config) -> Vec<ParamSpec> {
    let (c, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q_out, kv_out) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
    let normal = Init::Normal(cfg.initializer_range);
    let mut specs = Vec::new();
    let mut add = |name: String, dims: Vec<usize>, init: Init| {
        specs.push(ParamSpec { name, ty: TensorType::new(cfg.dtype, dims), init });
    };
    add("model.embed_tokens.weight".into(), vec![v, c], normal);
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (proj, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            add(p(&format!("self_attn.{proj}.weight")), vec![out, c], normal);
            if cfg.qkv_bias {
                add(p(&format!("self_attn.{proj}.bias")), vec![out], Init::Zeros);
            }
        }
        add(p("self_attn.o_proj.weight"), vec![c, q_out], normal);
        // gate_proj and up_proj stacked: one matmul to 2F (see `hf_parts`).
        add(p("mlp.gate_up_proj.weight"), vec![2 * f, c], normal);
        add(p("mlp.down_proj.weight"), vec![c, f], normal);
        add(p("input_layernorm.weight"), vec![c], Init::Ones);
        add(p("post_attention_layernorm.weight"), vec![c], Init::Ones);
    }
    add("model.norm.weight".into(), vec![c], Init::Ones);
    if !cfg.tie_word_embeddings {
        add("lm_head.weight".into(), vec![v, c], normal);
    }
    specs
}

/// The parameters as inputs of one graph, by name, in `param_specs` order.
pub struct Params {
    pub list: Vec<Tensor>,
    pub names: Vec<String>,
    index: HashMap<String, usize>,
    /// Under [`Params::autocast`] with tied embeddings: the embedding table cast for the output
    /// projection (the lookup reads the table itself).
    tied_head: Option<Tensor>,
}

impl Params {
    /// Declares every parameter of `cfg` as a `param` input of `g`.
    pub fn declare(g: &Graph, cfg: &Config) -> Result<Params> {
        let specs = param_specs(cfg);
        let mut list = Vec::with_capacity(specs.len());
        let mut names = Vec::with_capacity(specs.len());
        for s in &specs {
            list.push(g.param(&s.name, s.ty.dtype, s.ty.dims())?);
            names.push(s.name.clone());
        }
        let index = names.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect();
        Ok(Params { list, names, index, tied_head: None })
    }

    /// The compute copies of mixed precision, as PyTorch's autocast makes them: every matmul
    /// operand among the parameters (the projections' weights and biases, `lm_head` or, when
    /// tied, the embedding table as the head) cast to `dtype`; the norms' weights and the table
    /// the embedding lookup reads stay as they are. The model then runs each matmul in `dtype`
    /// and keeps everything between matmuls (the residual stream, the norms) in the masters'
    /// dtype (see [`linear`]). A parameter already of `dtype` is itself.
    pub fn autocast(&self, dtype: DType) -> Result<Params> {
        let list = self
            .list
            .iter()
            .zip(&self.names)
            .map(|(p, n)| if is_matmul_operand(n) { p.cast(dtype) } else { Ok(p.clone()) })
            .collect::<rumble_core::Result<Vec<_>>>()?;
        let tied_head = match self.index.get(EMBED) {
            Some(&i) if !self.index.contains_key(HEAD) => Some(self.list[i].cast(dtype)?),
            _ => None,
        };
        Ok(Params { list, names: self.names.clone(), index: self.index.clone(), tied_head })
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.index
            .get(name)
            .map(|&i| &self.list[i])
            .ok_or_else(|| ModelError::Usage(format!("the model has no parameter `{name}`")))
    }
}

const EMBED: &str = "model.embed_tokens.weight";
const HEAD: &str = "lm_head.weight";

/// Whether parameter `name` is a matmul operand (cast by [`Params::autocast`]).
fn is_matmul_operand(name: &str) -> bool {
    name.ends_with("_proj.weight") || name.ends_with("_proj.bias") || name == HEAD
}

/// `x @ w^T (+ b)`: a Hugging Face `nn.Linear` on `x (N, in)` with `w (out, in)`, computed in
/// `w`'s dtype (`x` is cast to it first under [`Params::autocast`]; the result stays in it).
pub(crate) fn linear(x: &Tensor, params: &Params, prefix: &str, bias: bool) -> Result<Tensor> {
    let w = params.get(&format!("{prefix}.weight"))?;
    let y = x.cast(w.dtype())?.matmul_t(w)?; // (N, out)
    if !bias {
        return Ok(y);
    }
    let b = params.get(&format!("{prefix}.bias"))?.broadcast_to(y.dims())?; // (N, out)
    Ok(y.add(&b)?)
}

/// Rotary embedding of `x (B, T, H, D)` (sequence-major, the `bthd` layout); returns the
/// rotated tensor and the factor by which its dot products grow relative to transformers' (see
/// below).
///
/// For even `D` this is the `rope` op. For `D == 1` transformers still builds `cos`/`sin` of
/// width 2 (`cat(freqs, freqs)` with one frequency, 1.0) and broadcasting makes q and k two
/// identical columns `x * (cos t - sin t)` (since `rotate_half(x) == -x`), so q.k doubles. We
/// keep one column and let the caller double the attention scale: same result, half the bytes.
/// `cos t - sin t` is column 0 of `rope(ones (1, T, 1, 2))`.
fn rotary(x: &Tensor, cfg: &Config) -> Result<(Tensor, f64)> {
    let (b, t, h, d) = (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]);
    let (theta, scaling) = (cfg.rope_theta, cfg.rope_scaling);
    if d != 1 {
        return Ok((x.rope_scaled(HeadLayout::Bthd, theta, scaling)?, 1.0)); // (B, T, H, D)
    }
    let ones = x.graph().full(1.0, x.dtype(), &[1, t, 1, 2]); // (1, T, 1, 2)
    let factor = ones.rope_scaled(HeadLayout::Bthd, theta, scaling)?.slice(3, 0, 1)?; // (1, T, 1, 1): cos t - sin t
    Ok((x.mul(&factor.broadcast_to(&[b, t, h, 1])?)?, 2.0)) // (B, T, H, 1)
}

/// One decoder layer on `x (B*T, C)`. Attention works on the projections as they come out of
/// the linear layers, `(B*T, H*D)` read as `(B, T, H, D)` (the `bthd` layout): no copies to
/// and from the head-major `(B, H, T, D)`.
fn block(cfg: &Config, params: &Params, x: &Tensor, l: usize, b: usize, t: usize) -> Result<Tensor> {
    let (hq, hkv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let p = |s: &str| format!("model.layers.{l}.{s}");

    // Attention.
    // Under autocast the norms' outputs are cast once for the matmuls that read them, and each
    // branch's result is cast back to the residual stream's dtype.
    let mm = params.get(&p("self_attn.q_proj.weight"))?.dtype();
    let h = x.rms_norm(params.get(&p("input_layernorm.weight"))?, eps)?.cast(mm)?; // (B*T, C)
    let heads = |y: Tensor, n: usize| -> Result<Tensor> {
        Ok(y.reshape(&[b, t, n, d])?) // (B, T, n, D)
    };
    let q = heads(linear(&h, params, &p("self_attn.q_proj"), cfg.qkv_bias)?, hq)?; // (B, T, Hq, D)
    let k = heads(linear(&h, params, &p("self_attn.k_proj"), cfg.qkv_bias)?, hkv)?; // (B, T, Hkv, D)
    let v = heads(linear(&h, params, &p("self_attn.v_proj"), cfg.qkv_bias)?, hkv)?; // (B, T, Hkv, D)
    let (q, grow) = rotary(&q, cfg)?; // (B, T, Hq, D)
    let (k, _) = rotary(&k, cfg)?; // (B, T, Hkv, D)
    let scale = grow / (d as f64).sqrt();
    let (o, _lse) = Tensor::attention_in(HeadLayout::Bthd, &q, &k, &v, scale, true)?; // (B, T, Hq, D), lse (B, Hq, T)
    let o = o.reshape(&[b * t, hq * d])?; // (B*T, Hq*D)
    let x = x.add(&linear(&o, params, &p("self_attn.o_proj"), false)?.cast(x.dtype())?)?; // (B*T, C)

    // MLP.
    let h = x.rms_norm(params.get(&p("post_attention_layernorm.weight"))?, eps)?.cast(mm)?; // (B*T, C)
    let gate_up = linear(&h, params, &p("mlp.gate_up_proj"), false)?; // (B*T, 2F): [gate | up]
    let m = linear(&gate_up.swiglu_packed()?, params, &p("mlp.down_proj"), false)?; // (B*T, C)
    Ok(x.add(&m.cast(x.dtype())?)?) // (B*T, C)
}

/// The final hidden state `(B*T, C)` (after the last RMSNorm) for token ids `tokens (B, T)`.
pub fn hidden(cfg: &Config, params: &Params, tokens: &Tensor) -> Result<Tensor> {
    let [b, t] = tokens.dims() else {
        return Err(ModelError::Usage(format!("tokens must be (B, T), got {:?}", tokens.ty())));
    };
    let (b, t) = (*b, *t);
    cfg.check_window(t, &format!("the sequence length {t}"))?;
    let embed = params.get(EMBED)?; // (V, C)
    let mut x = embed.gather(&tokens.reshape(&[b * t])?)?; // (B*T, C)
    for l in 0..cfg.num_hidden_layers {
        x = block(cfg, params, &x, l, b, t)?; // (B*T, C)
    }
    Ok(x.rms_norm(params.get("model.norm.weight")?, cfg.rms_norm_eps)?) // (B*T, C)
}

/// The output projection `(V, C)`: `lm_head.weight`, or the embedding table when tied.
pub fn head_weight<'p>(cfg: &Config, params: &'p Params) -> Result<&'p Tensor> {
    match &params.tied_head {
        Some(h) if cfg.tie_word_embeddings => Ok(h),
        _ => params.get(if cfg.tie_word_embeddings { EMBED } else { HEAD }),
    }
}

/// The logits `(B*T, V)` for token ids `tokens (B, T)` (i64).
pub fn logits(cfg: &Config, params: &Params, tokens: &Tensor) -> Result<Tensor> {
    let x = hidden(cfg, params, tokens)?; // (B*T, C)
    let head = head_weight(cfg, params)?; // (V, C)
    Ok(x.cast(head.dtype())?.matmul_t(head)?) // (B*T, V)
}

/// The scalar f32 loss of `logits (B*T, V)`: HF's causal-LM cross-entropy against `targets
/// (B*T)` (i64, `-100` ignored; the op reads logits in f32), or `logits.sum()` in f32.
pub fn loss(logits: &Tensor, targets: Option<&Tensor>) -> Result<Tensor> {
    Ok(match targets {
        Some(t) => logits.cross_entropy(t, IGNORE_INDEX)?, // f32[]
        None => logits.cast(DType::F32)?.sum_all()?,       // f32[]
    })
}

/// Rows of logits a fused head-and-loss op is traced with: about 64 MiB of f32 scratch. Where
/// the step is compiled (`rumble_core::compile::compile`), the chunk is chosen again per
/// workload by the cost model under the memory budget; this is the CPU's and the default.
pub fn loss_chunk(vocab: usize, rows: usize) -> usize {
    ((64 << 20) / (4 * vocab.max(1))).clamp(1, rows.max(1))
}

/// The model's objective on `tokens (B, T)`: f32 `[]`. With `fused` and targets, the last
/// projection and the cross-entropy are one `linear_cross_entropy` op that never holds all the
/// logits (same value as HF's loss up to rounding: the logits are not rounded to bf16 first).
pub fn objective(
    cfg: &Config,
    params: &Params,
    tokens: &Tensor,
    targets: Option<&Tensor>,
    fused: bool,
) -> Result<Tensor> {
    let head = head_weight(cfg, params)?; // (V, C)
    let x = hidden(cfg, params, tokens)?.cast(head.dtype())?; // (B*T, C)
    match targets {
        Some(t) if fused => {
            let chunk = loss_chunk(cfg.vocab_size, x.dims()[0]);
            Ok(x.linear_cross_entropy(head, t, IGNORE_INDEX, chunk)?) // f32[]
        }
        _ => loss(&x.matmul_t(head)?, targets), // logits (B*T, V) -> f32[]
    }
}

/// Hugging Face's ignore index for targets.
pub const IGNORE_INDEX: i64 = -100;

/// Hugging Face's targets for `labels = input_ids` (transformers 5 `ForCausalLMLoss`): each
/// row shifted left by one, the last position ignored. `tokens` is `(B, T)` row-major.
pub fn hf_causal_targets(tokens: &[i64], batch: usize, seq: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(batch * seq);
    for row in tokens.chunks(seq).take(batch) {
        out.extend_from_slice(&row[1..]);
        out.push(IGNORE_INDEX);
    }
    out
}
