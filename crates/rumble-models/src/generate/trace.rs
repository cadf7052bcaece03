//! The traces of generation: a prefill (the prompts, `T` tokens each, padded at the end) and a
//! decode step (one token per sequence), built with the same layers as `model.rs` but reading
//! and writing a KV cache.
//!
//! Both take the same per-step inputs, so they run as shape buckets of one program set
//! (`rumble_cuda::BucketedGraphs`: one arena, one persistent region):
//! - `tokens` i64 `(B, T)`: the prompts (prefill) or the last token of each sequence (decode);
//! - `pos` i64 `(B)`: the position of each sequence's first row in `tokens` (0 in a prefill);
//! - `last` i64 `(B)`: the row of `(B*T, C)` whose logits give each sequence's next token
//!   (`b*T + len_b - 1` in a prefill, `b` in a decode step);
//! - `key` i64 `(2)`: `(seed, step)` for the sampler.
//!
//! Persistent inputs: the parameters (`param`, `param_specs` order), then `cache.{l}.k` and
//! `cache.{l}.v` (`state`, `(B, S, Hkv, D)` in the model's dtype, S = the maximum length),
//! each rewritten by a `cache_write` whose result is its `Update` output (planned in place, so
//! a step writes only its new rows; `passes::fold_cache_writes` joins a layer's two into one
//! node). Outputs: `next` i64 `(B)` (the sampled tokens) and, when
//! asked, `logits` `(B, V)`.
//!
//! A prefill attends causally within its own rows (flash attention, positions `0..T`); a
//! decode step rotates its token at `pos` (`rope_at`), writes it to the cache, and attends
//! over the cache's first `pos + 1` rows (`attention_cached`). Rows of a prefill past a
//! prompt's end write junk to the cache at positions the decode steps overwrite before any
//! query can see them.

use rumble_core::{DType, Graph, HeadLayout, Tensor, Trace};

use crate::config::Config;
use crate::error::Result;
use crate::model::{Params, head_weight, linear};

/// What the sampler does (the `sample` op's attributes); `temperature == 0` is greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f64,
    /// 0: no top-k filter.
    pub top_k: usize,
    /// 1: no top-p filter.
    pub top_p: f64,
    pub seed: u64,
}

impl Sampling {
    pub fn greedy() -> Sampling {
        Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

/// One generation trace's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepShape {
    /// Sequences.
    pub batch: usize,
    /// Rows per sequence in `tokens`: the prompt bucket (prefill) or 1 (decode).
    pub rows: usize,
    /// Positions the KV cache holds.
    pub max_length: usize,
    /// A prefill (causal attention within the rows, from position 0) or a decode step.
    pub prefill: bool,
}

/// The names of layer `l`'s key and value caches.
pub fn cache_names(l: usize) -> [String; 2] {
    [format!("cache.{l}.k"), format!("cache.{l}.v")]
}

/// Builds the prefill or decode trace of `cfg` for `shape`; `logits` adds the `(B, V)` logits
/// as an output.
pub fn build(cfg: &Config, shape: StepShape, sampling: &Sampling, logits: bool) -> Result<Trace> {
    let (b, t, s) = (shape.batch, shape.rows, shape.max_length);
    cfg.check_window(s, &format!("the maximum length {s}"))?;
    let kind = if shape.prefill { "prefill" } else { "decode" };
    let g = Graph::new(format!("{kind}_b{b}_t{t}_s{s}"));
    let tokens = g.data("tokens", DType::I64, &[b, t])?;
    let pos = g.data("pos", DType::I64, &[b])?;
    let last = g.data("last", DType::I64, &[b])?;
    let key = g.data("key", DType::I64, &[2])?;
    let params = Params::declare(&g, cfg)?;
    let (hkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
    let mut caches = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let [kn, vn] = cache_names(l);
        let ty = rumble_core::TensorType::new(cfg.dtype, [b, s, hkv, d]);
        let k = g.input(&kn, ty.clone(), rumble_core::ir::InputRole::State)?;
        let v = g.input(&vn, ty, rumble_core::ir::InputRole::State)?;
        caches.push((k, v));
    }

    let embed = params.get("model.embed_tokens.weight")?; // (V, C)
    let mut x = embed.gather(&tokens.reshape(&[b * t])?)?; // (B*T, C)
    for (l, (kc, vc)) in caches.iter().enumerate() {
        let (y, k_new, v_new) = block(cfg, &params, &x, l, shape, &pos, kc, vc)?;
        x = y;
        let [kn, vn] = cache_names(l);
        g.output_with_role(&k_new, &format!("{kn}.new"), rumble_core::ir::OutputRole::Update { of: kc.id() })?;
        g.output_with_role(&v_new, &format!("{vn}.new"), rumble_core::ir::OutputRole::Update { of: vc.id() })?;
    }
    let h = x.gather(&last)?; // (B, C): the rows that predict
    let h = h.rms_norm(params.get("model.norm.weight")?, cfg.rms_norm_eps)?; // (B, C)
    let lg = h.matmul_t(head_weight(cfg, &params)?)?; // (B, V)
    let next = lg.sample(&key, sampling.temperature, sampling.top_k, sampling.top_p)?; // i64 (B)
    g.output(&next, "next")?;
    if logits {
        g.output(&lg, "logits")?;
    }
    Ok(g.finish()?)
}

/// RoPE of `x (B, T, H, D)` at positions `0..T` (prefill) or `pos[b] + t` (decode), with the
/// model's `rope_theta` and `rope_scaling` (as training's `model::rotary`), and the factor by
/// which the attention scale grows (2 for D == 1, as `model::rotary` explains).
fn rotary(x: &Tensor, shape: StepShape, pos: &Tensor, cfg: &Config) -> Result<(Tensor, f64)> {
    let (b, t, h, d) = (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]);
    let (theta, scaling) = (cfg.rope_theta, cfg.rope_scaling);
    let rope = |y: &Tensor| -> Result<Tensor> {
        Ok(if shape.prefill {
            y.rope_scaled(HeadLayout::Bthd, theta, scaling)?
        } else {
            y.rope_at_scaled(pos, HeadLayout::Bthd, theta, scaling)?
        })
    };
    if d != 1 {
        return Ok((rope(x)?, 1.0)); // (B, T, H, D)
    }
    let ones = x.graph().full(1.0, x.dtype(), &[b, t, 1, 2]); // (B, T, 1, 2)
    let factor = rope(&ones)?.slice(3, 0, 1)?; // (B, T, 1, 1): cos p - sin p
    Ok((x.mul(&factor.broadcast_to(&[b, t, h, 1])?)?, 2.0)) // (B, T, H, 1)
}

/// One decoder layer on `x (B*T, C)`; returns the new hidden state and the layer's caches with
/// this step's keys and values written.
#[allow(clippy::too_many_arguments)]
fn block(
    cfg: &Config,
    params: &Params,
    x: &Tensor,
    l: usize,
    shape: StepShape,
    pos: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t) = (shape.batch, shape.rows);
    let (hq, hkv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let p = |s: &str| format!("model.layers.{l}.{s}");

    let h = x.rms_norm(params.get(&p("input_layernorm.weight"))?, cfg.rms_norm_eps)?; // (B*T, C)
    let proj = |name: &str, n: usize| -> Result<Tensor> {
        Ok(linear(&h, params, &p(&format!("self_attn.{name}")), cfg.qkv_bias)?.reshape(&[b, t, n, d])?)
    };
    let (q, grow) = rotary(&proj("q_proj", hq)?, shape, pos, cfg)?; // (B, T, Hq, D)
    let (k, _) = rotary(&proj("k_proj", hkv)?, shape, pos, cfg)?; // (B, T, Hkv, D)
    let v = proj("v_proj", hkv)?; // (B, T, Hkv, D)
    let k_new = k_cache.cache_write(&k, pos)?; // (B, S, Hkv, D)
    let v_new = v_cache.cache_write(&v, pos)?; // (B, S, Hkv, D)
    let scale = grow / (d as f64).sqrt();
    let o = if shape.prefill {
        Tensor::attention_in(HeadLayout::Bthd, &q, &k, &v, scale, true)?.0 // (B, T, Hq, D)
    } else {
        Tensor::attention_cached(&q, &k_new, &v_new, pos, scale)? // (B, T, Hq, D)
    };
    let o = o.reshape(&[b * t, hq * d])?; // (B*T, Hq*D)
    let x = x.add(&linear(&o, params, &p("self_attn.o_proj"), false)?)?; // (B*T, C)

    let h = x.rms_norm(params.get(&p("post_attention_layernorm.weight"))?, cfg.rms_norm_eps)?; // (B*T, C)
    let gate_up = linear(&h, params, &p("mlp.gate_up_proj"), false)?; // (B*T, 2F)
    let m = linear(&gate_up.swiglu_packed()?, params, &p("mlp.down_proj"), false)?; // (B*T, C)
    Ok((x.add(&m)?, k_new, v_new))
}
