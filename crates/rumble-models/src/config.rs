//! Model configuration, read from and written to Hugging Face `config.json`.
//!
//! Three architectures: `LlamaForCausalLM`, `Qwen2ForCausalLM` (LLaMA plus q/k/v biases) and
//! `MistralForCausalLM` (LLaMA's computation with a sliding attention window: exactly LLaMA's
//! while every sequence fits the window, which [`Config::check_window`] makes sure of).
//! Both the transformers 4 spelling (`rope_theta`, `torch_dtype`) and the transformers 5 one
//! (`rope_parameters`, `dtype`) are read; RoPE scaling of type `linear` and `llama3` (Llama 3.1+)
//! is read from either. Keys that change the computation in a way rumble does not implement
//! (another RoPE scaling, a sliding window in use, `attention_bias` on LLaMA, another
//! activation...) are refused with an error naming the key; keys that do not change the
//! computation of a training step (token ids, `use_cache`...) are ignored.

use std::path::Path;

use rumble_core::{DType, RopeScaling};
use serde_json::{Map, Value, json};

use crate::error::{ModelError, Result};

/// The model family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
}

impl Arch {
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Mistral => "mistral",
        }
    }
}

/// Everything the forward pass needs; field names follow Hugging Face's.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Per-head size; `hidden_size / num_attention_heads` unless the config says otherwise.
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// RoPE's frequency scaling (`rope_scaling` / `rope_parameters`: `linear` or `llama3`).
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2 always; LLaMA never, here).
    pub qkv_bias: bool,
    /// Parameter dtype (`torch_dtype` / `dtype`).
    pub dtype: DType,
    /// Mistral's attention window (`sliding_window`): a query sees this many keys at most.
    /// rumble attends to every earlier key, so sequences must fit it ([`Config::check_window`]).
    pub sliding_window: Option<usize>,
    /// Standard deviation of the normal initialisation of weights.
    pub initializer_range: f64,
    pub max_position_embeddings: usize,
}

impl Config {
    /// Reads a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = crate::guard::read_metadata(path, "config")?;
        Config::from_json_str(&text, &path.display().to_string())
    }

    /// Parses config.json text; `source_name` (a file name) appears in errors.
    pub fn from_json_str(text: &str, source_name: &str) -> Result<Config> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::config(source_name, "<document>", format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(ModelError::config(source_name, "<document>", "expected a JSON object"));
        };
        Reader { map: &map, src: source_name }.config()
    }

    /// The config.json text that transformers reads back as the same model.
    pub fn to_json_string(&self) -> String {
        let mut m = Map::new();
        m.insert("architectures".into(), json!([self.arch.hf_class()]));
        m.insert("model_type".into(), json!(self.arch.model_type()));
        m.insert("vocab_size".into(), json!(self.vocab_size));
        m.insert("hidden_size".into(), json!(self.hidden_size));
        m.insert("intermediate_size".into(), json!(self.intermediate_size));
        m.insert("num_hidden_layers".into(), json!(self.num_hidden_layers));
        m.insert("num_attention_heads".into(), json!(self.num_attention_heads));
        m.insert("num_key_value_heads".into(), json!(self.num_key_value_heads));
        // Qwen2Config has no head_dim field: write it only when it is not the derived value.
        if self.arch == Arch::Llama || self.head_dim * self.num_attention_heads != self.hidden_size {
            m.insert("head_dim".into(), json!(self.head_dim));
        }
        m.insert("hidden_act".into(), json!("silu"));
        m.insert("rms_norm_eps".into(), json!(self.rms_norm_eps));
        m.insert("rope_theta".into(), json!(self.rope_theta));
        // transformers 5 reads rope_parameters, transformers 4 rope_scaling and rope_theta.
        let mut rope = json!({"rope_type": "default"});
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => rope = json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                rope = json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings as u64});
            }
        }
        let scaling = if self.rope_scaling == RopeScaling::None { Value::Null } else { rope.clone() };
        rope["rope_theta"] = json!(self.rope_theta);
        m.insert("rope_parameters".into(), rope);
        m.insert("rope_scaling".into(), scaling);
        m.insert("tie_word_embeddings".into(), json!(self.tie_word_embeddings));
        m.insert("initializer_range".into(), json!(self.initializer_range));
        m.insert("max_position_embeddings".into(), json!(self.max_position_embeddings));
        m.insert("attention_dropout".into(), json!(0.0));
        match self.arch {
            Arch::Llama => {
                m.insert("attention_bias".into(), json!(false));
                m.insert("mlp_bias".into(), json!(false));
            }
            Arch::Qwen2 => {
                m.insert("use_sliding_window".into(), json!(false));
            }
            Arch::Mistral => {
                m.insert("sliding_window".into(), self.sliding_window.map_or(Value::Null, |w| json!(w)));
            }
        }
        let dt = hf_dtype_name(self.dtype);
        m.insert("dtype".into(), json!(dt));
        m.insert("torch_dtype".into(), json!(dt));
        let mut s = serde_json::to_string_pretty(&Value::Object(m)).unwrap_or_default();
        s.push('\n');
        s
    }

    /// Number of parameter elements (tied embeddings counted once). Saturates for configs
    /// that [`Config::validate`] refuses.
    pub fn num_params(&self) -> usize {
        self.checked_num_params().unwrap_or(usize::MAX)
    }

    /// Number of parameter elements, computed with checked arithmetic (no walk over the
    /// layers, so a config of 10^9 layers answers at once): `None` past `isize::MAX` bytes.
    /// Equal to the sum over `model::param_specs` (tested).
    pub fn checked_num_params(&self) -> Option<usize> {
        use rumble_core::ir::mul_size as mul;
        let add = |a: usize, b: usize| a.checked_add(b);
        let (c, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = mul(self.num_attention_heads, self.head_dim)?;
        let kv = mul(self.num_key_value_heads, self.head_dim)?;
        // q, k, v (and biases), o, gate_up, down, two norms.
        let mut layer = mul(add(q, mul(2, kv)?)?, c)?;
        if self.qkv_bias {
            layer = add(layer, add(q, mul(2, kv)?)?)?;
        }
        layer = add(layer, mul(c, q)?)?;
        layer = add(layer, mul(mul(3, f)?, c)?)?;
        layer = add(layer, mul(2, c)?)?;
        let embeddings = mul(mul(if self.tie_word_embeddings { 1 } else { 2 }, v)?, c)?;
        let total = add(add(mul(layer, self.num_hidden_layers)?, embeddings)?, c)?;
        mul(total, self.dtype.size_in_bytes()).map(|_| total)
    }

    /// Bytes of the parameters in their dtype (`None` when that overflows).
    pub fn checked_param_bytes(&self) -> Option<usize> {
        rumble_core::ir::mul_size(self.checked_num_params()?, self.dtype.size_in_bytes())
    }

    /// Refuses a step of `batch` sequences of `seq` tokens, `grad_accum` micro-batches, whose
    /// token count or activation sizes (tokens times the widest row: hidden, 2 x intermediate,
    /// vocabulary; 8 bytes an element at most) overflow. Called before any trace is built, so
    /// no product of these numbers can wrap anywhere after.
    pub fn check_step_sizes(&self, batch: usize, seq: usize, grad_accum: usize) -> Result<()> {
        use rumble_core::ir::mul_size as mul;
        let too_large = |msg: String| ModelError::TooLarge { what: format!("batch {batch} x seq {seq}"), msg };
        let tokens = mul(batch, seq).ok_or_else(|| too_large("the token count overflows".into()))?;
        mul(tokens, grad_accum.max(1))
            .ok_or_else(|| too_large(format!("the tokens of {grad_accum} micro-batches overflow")))?;
        let widest = [
            self.hidden_size,
            self.intermediate_size.saturating_mul(2),
            self.vocab_size,
            self.num_attention_heads.saturating_mul(self.head_dim),
        ]
        .into_iter()
        .max()
        .unwrap_or(1);
        mul(tokens, widest).and_then(|n| mul(n, 8)).ok_or_else(|| {
            too_large(format!(
                "{tokens} tokens of rows of {widest} elements overflow the largest size (isize::MAX bytes)"
            ))
        })?;
        Ok(())
    }

    /// Checks the relations between fields (also run on presets and hand-built configs).
    /// Refuses sequences longer than Mistral's attention window (`sliding_window`): past it the
    /// model attends to fewer keys than rumble's attention does. `what` names the length
    /// (`--seq 8192`, `--max-length 8192`).
    pub fn check_window(&self, len: usize, what: &str) -> Result<()> {
        match self.sliding_window {
            Some(w) if len > w => Err(ModelError::config(
                "config.json",
                "sliding_window",
                format!(
                    "{w} is shorter than {what}: sliding-window attention is not supported, so sequences must fit the \
                     window ({len} > {w})"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The sizes of the model, each with its config.json key.
    fn sizes(&self) -> [(&'static str, usize); 7] {
        [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("head_dim", self.head_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ]
    }

    pub fn validate(&self, src: &str) -> Result<()> {
        let bad = |key: &str, msg: String| Err(ModelError::config(src, key, msg));
        for (key, v) in self.sizes() {
            if v == 0 {
                return bad(key, "must be at least 1".into());
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} attention heads are not a multiple of {} key/value heads",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            );
        }
        if self.head_dim != 1 && !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!(
                    "{} is odd: rotary embeddings need an even head size (or 1, as transformers allows)",
                    self.head_dim
                ),
            );
        }
        if !self.rms_norm_eps.is_finite() || self.rms_norm_eps <= 0.0 {
            return bad("rms_norm_eps", format!("{} must be positive and finite", self.rms_norm_eps));
        }
        if !self.rope_theta.is_finite() || self.rope_theta <= 0.0 {
            return bad("rope_theta", format!("{} must be positive and finite (the RoPE base)", self.rope_theta));
        }
        if !self.initializer_range.is_finite() || self.initializer_range < 0.0 {
            return bad("initializer_range", format!("{} must be finite and not negative", self.initializer_range));
        }
        if self.num_attention_heads.checked_mul(self.head_dim).is_none() {
            return bad("head_dim", format!("{} heads of {} overflow", self.num_attention_heads, self.head_dim));
        }
        if self.checked_num_params().is_none() {
            // Name the largest of the sizes that multiply (the key/value heads are at most the heads).
            let (key, _) = self
                .sizes()
                .into_iter()
                .filter(|&(k, _)| k != "num_key_value_heads")
                .max_by_key(|&(_, v)| v)
                .unwrap_or(("vocab_size", 0));
            return bad(
                key,
                format!(
                    "the parameter count overflows (vocab_size {}, hidden_size {}, intermediate_size {}, {} layers)",
                    self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers
                ),
            );
        }
        if !matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return bad("torch_dtype", format!("{} is not a parameter dtype rumble trains", self.dtype));
        }
        Ok(())
    }
}

/// The transformers name of a dtype.
pub fn hf_dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::Bool => "bool",
    }
}

struct Reader<'a> {
    map: &'a Map<String, Value>,
    src: &'a str,
}

impl Reader<'_> {
    fn err(&self, key: &str, msg: impl Into<String>) -> ModelError {
        ModelError::config(self.src, key, msg)
    }

    /// The value of `key`, treating JSON `null` as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        let v = self.get(key).ok_or_else(|| self.err(key, "missing"))?;
        v.as_u64().map(|x| x as usize).ok_or_else(|| self.err(key, format!("expected a non-negative integer, got {v}")))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_some() { self.usize_req(key) } else { Ok(default) }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.err(key, format!("expected a number, got {v}"))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(key, format!("expected true or false, got {v}"))),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.err(key, format!("expected a string, got {v}"))),
        }
    }

    fn arch(&self) -> Result<Arch> {
        let from_name = |n: &str| match n {
            "LlamaForCausalLM" | "llama" => Some(Arch::Llama),
            "Qwen2ForCausalLM" | "qwen2" => Some(Arch::Qwen2),
            "MistralForCausalLM" | "mistral" => Some(Arch::Mistral),
            _ => None,
        };
        if let Some(v) = self.get("architectures") {
            let list = v.as_array().ok_or_else(|| self.err("architectures", "expected a list"))?;
            let [one] = list.as_slice() else {
                return Err(self.err("architectures", format!("expected exactly one architecture, got {v}")));
            };
            let name = one.as_str().unwrap_or_default();
            return from_name(name).ok_or_else(|| {
                self.err(
                    "architectures",
                    format!("{one} is not supported (LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM)"),
                )
            });
        }
        match self.str_opt("model_type")? {
            Some(t) => from_name(t)
                .ok_or_else(|| self.err("model_type", format!("`{t}` is not supported (llama, qwen2 or mistral)"))),
            None => Err(self.err("architectures", "missing, and no `model_type` either")),
        }
    }

    /// `rope_theta` and the scaling, from `rope_parameters` (transformers 5) or `rope_scaling`
    /// plus `rope_theta` (transformers 4).
    fn rope(&self) -> Result<(f64, RopeScaling)> {
        let mut theta = self.f64_or("rope_theta", 10000.0)?;
        let mut scaling = RopeScaling::None;
        for key in ["rope_scaling", "rope_parameters"] {
            let Some(p) = self.get(key) else { continue };
            let obj = p.as_object().ok_or_else(|| self.err(key, format!("expected an object, got {p}")))?;
            if let Some(f) = obj.get("partial_rotary_factor").and_then(Value::as_f64)
                && f != 1.0
            {
                return Err(self.err(&format!("{key}.partial_rotary_factor"), format!("{f}: only 1.0")));
            }
            if let Some(t) = obj.get("rope_theta").filter(|t| !t.is_null()) {
                theta =
                    t.as_f64().ok_or_else(|| self.err(&format!("{key}.rope_theta"), format!("not a number: {t}")))?;
            }
            // rope_parameters (read last) wins over the legacy rope_scaling.
            scaling = self.rope_scaling(key, obj)?;
        }
        Ok((theta, scaling))
    }

    /// The scaling one `rope_scaling` / `rope_parameters` object asks for.
    fn rope_scaling(&self, key: &str, obj: &Map<String, Value>) -> Result<RopeScaling> {
        let (type_key, kind) = match (obj.get("rope_type"), obj.get("type")) {
            (Some(t), _) if !t.is_null() => ("rope_type", t),
            (_, Some(t)) if !t.is_null() => ("type", t),
            _ => return Ok(RopeScaling::None),
        };
        let num = |name: &str| -> Result<f64> {
            let full = format!("{key}.{name}");
            let v = obj.get(name).filter(|v| !v.is_null()).ok_or_else(|| self.err(&full, "missing"))?;
            match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.err(&full, format!("expected a positive number, got {v}"))),
            }
        };
        match kind.as_str() {
            Some("default") => Ok(RopeScaling::None),
            Some("linear") => Ok(RopeScaling::Linear { factor: num("factor")? }),
            Some("llama3") => {
                let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
                if high <= low {
                    return Err(self.err(
                        &format!("{key}.high_freq_factor"),
                        format!("{high} must be above low_freq_factor {low}"),
                    ));
                }
                Ok(RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                })
            }
            _ => Err(self.err(
                &format!("{key}.{type_key}"),
                format!("{kind} is not supported (\"default\", \"linear\" or \"llama3\")"),
            )),
        }
    }

    fn dtype(&self) -> Result<DType> {
        let (key, name) = match (self.str_opt("dtype")?, self.str_opt("torch_dtype")?) {
            (Some(d), _) => ("dtype", d),
            (None, Some(d)) => ("torch_dtype", d),
            (None, None) => return Ok(DType::F32),
        };
        match name.trim_start_matches("torch.") {
            "float32" | "float" => Ok(DType::F32),
            "bfloat16" => Ok(DType::BF16),
            "float16" | "half" => Ok(DType::F16),
            other => Err(self.err(key, format!("`{other}` is not supported (float32, bfloat16 or float16)"))),
        }
    }

    fn config(&self) -> Result<Config> {
        let arch = self.arch()?;
        if let Some(act) = self.str_opt("hidden_act")?
            && act != "silu"
        {
            return Err(self.err("hidden_act", format!("`{act}` is not supported; only silu (SwiGLU)")));
        }
        let f = self.f64_or("partial_rotary_factor", 1.0)?;
        if f != 1.0 {
            return Err(self.err("partial_rotary_factor", format!("{f}: only 1.0 (full rotary) is supported")));
        }
        let layers = self.usize_req("num_hidden_layers")?;
        let qkv_bias = match arch {
            Arch::Llama | Arch::Mistral => {
                for key in ["attention_bias", "mlp_bias"] {
                    if self.bool_or(key, false)? {
                        return Err(self.err(key, "biases in LLaMA projections are not supported"));
                    }
                }
                false
            }
            Arch::Qwen2 => {
                self.check_no_sliding_window(layers)?;
                true
            }
        };
        if let Some(v) = self.get("layer_types") {
            let types = v.as_array().ok_or_else(|| self.err("layer_types", "expected a list"))?;
            if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
                return Err(self.err("layer_types", format!("{t} layers are not supported; only full_attention")));
            }
        }
        let (rope_theta, rope_scaling) = self.rope()?;
        let hidden = self.usize_req("hidden_size")?;
        let heads = self.usize_req("num_attention_heads")?;
        let head_dim = match self.get("head_dim") {
            Some(_) => self.usize_req("head_dim")?,
            None if heads > 0 && hidden % heads == 0 => hidden / heads,
            None => {
                return Err(self.err(
                    "hidden_size",
                    format!("{hidden} is not a multiple of num_attention_heads {heads}, and no head_dim is given"),
                ));
            }
        };
        let cfg = Config {
            arch,
            vocab_size: self.usize_req("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: self.usize_req("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: self.usize_or("num_key_value_heads", heads)?,
            head_dim,
            rms_norm_eps: self.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self.bool_or("tie_word_embeddings", false)?,
            qkv_bias,
            dtype: self.dtype()?,
            initializer_range: self.f64_or("initializer_range", 0.02)?,
            max_position_embeddings: self.usize_or("max_position_embeddings", 2048)?,
            sliding_window: match arch {
                Arch::Mistral if self.get("sliding_window").is_some_and(|v| !v.is_null()) => {
                    Some(self.usize_req("sliding_window")?)
                }
                _ => None,
            },
        };
        cfg.validate(self.src)?;
        Ok(cfg)
    }

    /// Qwen2 uses a sliding window on layers `>= max_window_layers` when `use_sliding_window`.
    fn check_no_sliding_window(&self, layers: usize) -> Result<()> {
        if !self.bool_or("use_sliding_window", false)? || self.get("sliding_window").is_none() {
            return Ok(());
        }
        let first = self.usize_or("max_window_layers", 28)?;
        if first < layers {
            return Err(self.err(
                "use_sliding_window",
                format!("sliding-window attention (layers {first}..{layers}) is not supported"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN25_7B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
      "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
      "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
      "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 152064 }"#;

    #[test]
    fn reads_a_real_qwen2_config() {
        let c = Config::from_json_str(QWEN25_7B, "qwen.json").unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert_eq!((c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim), (3584, 28, 4, 128));
        assert_eq!((c.rope_theta, c.dtype, c.qkv_bias, c.tie_word_embeddings), (1e6, DType::BF16, true, false));
    }

    #[test]
    fn reads_mistral_and_refuses_sequences_past_its_window() {
        let text = r#"{"architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rope_theta": 10000.0, "sliding_window": 4096,
            "torch_dtype": "bfloat16", "hidden_act": "silu"}"#;
        let c = Config::from_json_str(text, "m.json").unwrap();
        assert_eq!((c.arch, c.sliding_window, c.qkv_bias, c.head_dim), (Arch::Mistral, Some(4096), false, 128));
        assert_eq!(Config::from_json_str(&c.to_json_string(), "back").unwrap(), c);
        c.check_window(4096, "--seq 4096").unwrap();
        let e = c.check_window(4097, "--seq 4097").unwrap_err().to_string();
        assert!(e.contains("`sliding_window`") && e.contains("--seq 4097"), "{e}");
        // No window (null) is LLaMA's attention at every length.
        let open = text.replace("\"sliding_window\": 4096", "\"sliding_window\": null");
        let c = Config::from_json_str(&open, "m.json").unwrap();
        assert_eq!(c.sliding_window, None);
        c.check_window(1 << 20, "--seq").unwrap();
        // LLaMA and Qwen2 configs never set it.
        assert_eq!(Config::from_json_str(QWEN25_7B, "q.json").unwrap().sliding_window, None);
    }

    #[test]
    fn reads_transformers5_spelling() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16",
            "tie_word_embeddings": true}"#;
        let c = Config::from_json_str(text, "c.json").unwrap();
        assert_eq!((c.rope_theta, c.dtype, c.num_key_value_heads, c.head_dim), (500000.0, DType::BF16, 4, 16));
        assert!(c.tie_word_embeddings && !c.qkv_bias);
    }

    #[test]
    fn reads_rope_scaling_in_both_spellings() {
        let llama3 = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let want = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let v4 = with_all(&[("rope_scaling", llama3.clone()), ("rope_theta", json!(500000.0))]);
        let mut p = llama3;
        p["rope_theta"] = json!(500000.0);
        let v5 = with_all(&[("rope_parameters", p), ("rope_theta", Value::Null)]);
        for text in [v4, v5] {
            let c = Config::from_json_str(&text, "l.json").unwrap();
            assert_eq!((c.rope_theta, c.rope_scaling), (500000.0, want));
            assert_eq!(Config::from_json_str(&c.to_json_string(), "back").unwrap(), c);
        }
        let linear = with("rope_scaling", json!({"type": "linear", "factor": 2.0}));
        let c = Config::from_json_str(&linear, "l.json").unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(Config::from_json_str(&c.to_json_string(), "back").unwrap(), c);
    }

    #[test]
    fn json_round_trips() {
        for name in crate::presets::PRESET_NAMES {
            let c = crate::presets::preset(name).unwrap().config;
            let back = Config::from_json_str(&c.to_json_string(), name).unwrap();
            assert_eq!(back, c, "{name}");
        }
    }

    fn with(key: &str, value: Value) -> String {
        with_all(&[(key, value)])
    }

    fn with_all(kv: &[(&str, Value)]) -> String {
        let mut v: Value = serde_json::from_str(QWEN25_7B).unwrap();
        for (key, value) in kv {
            v[*key] = value.clone();
        }
        v.to_string()
    }

    #[test]
    fn harmless_settings_are_accepted() {
        // A sliding window that no layer uses (every layer is below max_window_layers), and an
        // explicit null rope_scaling.
        let text = with_all(&[("use_sliding_window", json!(true)), ("rope_scaling", Value::Null)]);
        assert_eq!(Config::from_json_str(&text, "q.json").unwrap().num_hidden_layers, 28);
        let text = with("layer_types", json!(vec!["full_attention"; 28]));
        Config::from_json_str(&text, "q.json").unwrap();
    }

    #[test]
    fn parameter_count_is_the_sum_over_param_specs() {
        let mut configs: Vec<Config> =
            crate::presets::PRESET_NAMES.iter().map(|n| crate::presets::preset(n).unwrap().config).collect();
        configs.push(Config::from_json_str(QWEN25_7B, "q.json").unwrap());
        let mut tied = configs[0].clone();
        tied.tie_word_embeddings = !tied.tie_word_embeddings;
        configs.push(tied);
        for c in configs {
            let walked: usize = crate::model::param_specs(&c).iter().map(|p| p.ty.numel()).sum();
            assert_eq!(c.checked_num_params(), Some(walked), "{c:?}");
        }
    }

    #[test]
    fn huge_sizes_are_refused_by_key() {
        for big in [1u64 << 31, 1 << 32, 1 << 62, u64::MAX] {
            for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"] {
                let text = with(key, json!(big));
                match Config::from_json_str(&text, "big.json") {
                    // 2^31 and 2^32 fit in a count; their sizes are judged by the memory check.
                    Ok(c) => assert!(big <= 1 << 32 && c.checked_param_bytes().is_some(), "{key}={big}"),
                    Err(e) => assert!(e.to_string().starts_with("big.json: config key"), "{key}={big}: {e}"),
                }
            }
        }
        let c = Config::from_json_str(QWEN25_7B, "q.json").unwrap();
        for (b, t) in [(1usize << 32, 1usize << 32), (1 << 31, 1 << 31), (1 << 62, 1), (usize::MAX, 1)] {
            let e = c.check_step_sizes(b, t, 1).unwrap_err().to_string();
            assert!(e.contains(&format!("batch {b} x seq {t}")), "{e}");
        }
        c.check_step_sizes(4, 4096, 8).unwrap();
        assert!(c.check_step_sizes(1 << 20, 1 << 20, 1 << 30).is_err());
        for (key, v) in [("rope_theta", json!(-1.0)), ("rope_theta", json!(0.0)), ("rms_norm_eps", json!(0.0))] {
            let e = Config::from_json_str(&with(key, v), "c.json").unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{e}");
        }
    }

    #[test]
    fn unsupported_features_name_the_key() {
        let cases = [
            (with("rope_scaling", json!({"type": "yarn", "factor": 4.0})), "`rope_scaling.type`"),
            (with("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0})), "`rope_scaling.low_freq_factor`"),
            (with("rope_scaling", json!({"rope_type": "linear", "factor": -1.0})), "`rope_scaling.factor`"),
            (with_all(&[("use_sliding_window", json!(true)), ("max_window_layers", json!(4))]), "`use_sliding_window`"),
            (with("architectures", json!(["GemmaForCausalLM"])), "`architectures`"),
            (with("hidden_act", json!("gelu")), "`hidden_act`"),
            (with("num_key_value_heads", json!(5)), "`num_key_value_heads`"),
            (with("torch_dtype", json!("float8_e4m3fn")), "`torch_dtype`"),
            (
                with("rope_parameters", json!({"rope_type": "dynamic", "rope_theta": 1.0})),
                "`rope_parameters.rope_type`",
            ),
            (with("vocab_size", json!("many")), "`vocab_size`"),
            (with("layer_types", json!(["full_attention", "sliding_attention"])), "`layer_types`"),
            (with("head_dim", json!(3)), "`head_dim`"),
        ];
        for (text, key) in cases {
            let e = Config::from_json_str(&text, "cfg.json").unwrap_err().to_string();
            assert!(e.contains(key) && e.starts_with("cfg.json"), "{key}: {e}");
        }
        let llama_bias = r#"{"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "attention_bias": true}"#;
        let e = Config::from_json_str(llama_bias, "l.json").unwrap_err().to_string();
        assert!(e.contains("`attention_bias`"), "{e}");
        let missing = r#"{"model_type": "llama", "vocab_size": 8}"#;
        let e = Config::from_json_str(missing, "m.json").unwrap_err().to_string();
        assert!(e.contains("`num_hidden_layers`") && e.contains("missing"), "{e}");
    }
}
