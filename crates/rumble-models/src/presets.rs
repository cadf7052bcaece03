//! Named workloads: a config plus the batch shape and objective it is measured with.
//!
//! `seed-llama`, `seed-qwen2` and `small` are the three preset workloads of BENCHMARKS.md
//! (measured beside PyTorch and Thunder by `bench/reference/torch_ref.py`); `tiny` trains on a
//! CPU in seconds and is what `rumble train` runs by default.

use rumble_core::{DType, RopeScaling};

use crate::config::{Arch, Config};
use crate::error::{ModelError, Result};

/// What the training step differentiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    /// Hugging Face's causal-LM loss: mean cross-entropy of next-token targets, positions with
    /// target `-100` ignored, logits read in f32.
    CausalLm,
    /// `logits.sum()` in f32: the seed reproduction's objective (no targets).
    LogitsSum,
}

impl Objective {
    pub fn name(self) -> &'static str {
        match self {
            Objective::CausalLm => "causal-lm",
            Objective::LogitsSum => "logits-sum",
        }
    }
}

/// A config and how it is run.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub config: Config,
    pub batch: usize,
    pub seq: usize,
    pub objective: Objective,
    /// A learning rate that trains this model well with AdamW.
    pub lr: f64,
    pub about: &'static str,
}

pub const PRESET_NAMES: [&str; 4] = ["tiny", "small", "seed-llama", "seed-qwen2"];

/// The preset called `name`.
pub fn preset(name: &str) -> Result<Preset> {
    let llama = |vocab, hidden, heads, inter, layers, dtype| Config {
        arch: Arch::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: heads,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: false,
        qkv_bias: false,
        dtype,
        initializer_range: 0.02,
        max_position_embeddings: 2048,
        sliding_window: None,
    };
    Ok(match name {
        "tiny" => Preset {
            name: "tiny",
            // Byte-level: 256 tokens. Two layers, grouped-query attention (4 query heads share
            // 2 key/value heads), tied embeddings: every feature of the family, at CPU size.
            config: Config {
                num_key_value_heads: 2,
                tie_word_embeddings: true,
                max_position_embeddings: 256,
                ..llama(256, 64, 4, 176, 2, DType::F32)
            },
            batch: 8,
            seq: 64,
            objective: Objective::CausalLm,
            lr: 3e-3,
            about: "byte-level LLaMA, 2 layers, hidden 64, GQA 4/2, tied; trains on a CPU in seconds",
        },
        "small" => Preset {
            name: "small",
            config: Config { max_position_embeddings: 1024, ..llama(32000, 768, 12, 2048, 12, DType::BF16) },
            batch: 1,
            seq: 256,
            objective: Objective::CausalLm,
            lr: 3e-4,
            about: "HF LLaMA, vocab 32000, hidden 768, 12 heads, MLP 2048, 12 layers, bf16 (launch-bound)",
        },
        "seed-llama" => Preset {
            name: "seed-llama",
            // litgpt open_llama_3b with n_layer=10; litgpt names map one-to-one onto HF's.
            config: llama(32000, 3200, 32, 8640, 10, DType::F32),
            batch: 1,
            seq: 2048,
            objective: Objective::LogitsSum,
            lr: 3e-4,
            about: "open_llama_3b with 10 layers, fp32, objective logits.sum() (the seed reproduction)",
        },
        "seed-qwen2" => Preset {
            name: "seed-qwen2",
            // Qwen2.5-7B's config, 5 layers, then hidden_size = 28: head_dim 1.
            config: Config {
                arch: Arch::Qwen2,
                vocab_size: 152064,
                hidden_size: 28,
                intermediate_size: 18944,
                num_hidden_layers: 5,
                num_attention_heads: 28,
                num_key_value_heads: 4,
                head_dim: 1,
                rms_norm_eps: 1e-6,
                rope_theta: 1e6,
                rope_scaling: RopeScaling::None,
                tie_word_embeddings: false,
                qkv_bias: true,
                dtype: DType::BF16,
                initializer_range: 0.02,
                max_position_embeddings: 32768,
                sliding_window: None,
            },
            batch: 1,
            seq: 4096,
            objective: Objective::CausalLm,
            lr: 3e-4,
            about: "Qwen2.5-7B shape, 5 layers, hidden 28 (head_dim 1), bf16, HF causal-LM loss",
        },
        other => {
            return Err(ModelError::Usage(format!(
                "unknown preset `{other}` (presets: {}; or give a config.json path)",
                PRESET_NAMES.join(", ")
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_anchor_sizes() {
        // seed-llama (litgpt's open_llama_3b, 10 layers) has 1,443,907,200 parameters.
        assert_eq!(preset("seed-llama").unwrap().config.num_params(), 1_443_907_200);
        // seed-qwen2 has about 16.5 M (two 152064 x 28 tables dominate, with the MLPs).
        let q = preset("seed-qwen2").unwrap().config.num_params();
        assert!((16_000_000..17_000_000).contains(&q), "{q}");
        for name in PRESET_NAMES {
            preset(name).unwrap().config.validate(name).unwrap();
        }
        assert!(preset("huge").unwrap_err().to_string().contains("unknown preset `huge`"));
    }
}
