//! How attention and RoPE read their rank-4 operands (`HeadLayout`) and how RoPE's frequencies
//! are rescaled for a longer context (`RopeScaling`): attributes of those ops in `op.rs`;
//! and attention's type rule, which speaks of the layout.

use super::dtype::TensorType;
use super::op::{float, stat_dtype};

/// Where the sequence axis sits in the rank-4 operands of attention and RoPE: `[B, H, T, D]`
/// (`Bhtd`, head-major, the default) or `[B, T, H, D]` (`Bthd`, sequence-major: what a linear
/// layer's `(B*T, H*D)` output is after a reshape, so no permute copy is needed). Either way a
/// head's row of D elements is contiguous; the log-sum-exp of attention is `[B, H, T]` in both.
/// The text form writes `layout=bthd`; `layout=bhtd` is implied when absent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HeadLayout {
    /// `[B, H, T, D]`.
    #[default]
    Bhtd,
    /// `[B, T, H, D]`.
    Bthd,
}

/// How RoPE's inverse frequencies are rescaled to stretch a model's context (the
/// `rope_scaling` / `rope_parameters` of a Hugging Face config; transformers'
/// `modeling_rope_utils`). `None` is plain RoPE: `inv_freq[j] = theta^(-2j/D)`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RopeScaling {
    #[default]
    None,
    /// Every inverse frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// Llama 3.1's: frequencies whose wavelength exceeds `original_max_position_embeddings /
    /// low_freq_factor` are divided by `factor`, those below `original / high_freq_factor` are
    /// kept, and those between are blended smoothly.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

impl RopeScaling {
    /// The inverse frequencies of head size `d` (`d / 2` of them), in f32 as transformers
    /// computes them: `theta^(-2j/D)` with f32 operands (the power evaluated in f64 and rounded
    /// once), then rescaled in f32. Every backend takes its angles `t * inv_freq[j]` from
    /// this one table.
    pub fn inv_freq(self, theta: f64, d: usize) -> Vec<f32> {
        (0..d / 2)
            .map(|j| {
                let exponent = (2 * j) as f32 / d as f32;
                let inv = 1.0f32 / (theta as f32 as f64).powf(exponent as f64) as f32;
                self.rescale(inv)
            })
            .collect()
    }

    /// One inverse frequency rescaled (f32 arithmetic, python floats rounded to f32 as torch
    /// does when it mixes them with an f32 tensor).
    fn rescale(self, inv: f32) -> f32 {
        match self {
            RopeScaling::None => inv,
            RopeScaling::Linear { factor } => inv / factor as f32,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings;
                let (low_wavelen, high_wavelen) = ((old / low_freq_factor) as f32, (old / high_freq_factor) as f32);
                let wavelen = (2.0 * std::f64::consts::PI) as f32 / inv;
                let scaled = if wavelen > low_wavelen { inv / factor as f32 } else { inv };
                if wavelen < high_wavelen || wavelen > low_wavelen {
                    return scaled;
                }
                let smooth =
                    (old as f32 / wavelen - low_freq_factor as f32) / (high_freq_factor - low_freq_factor) as f32;
                (1.0 - smooth) * scaled / factor as f32 + smooth * scaled
            }
        }
    }

    /// The text form: `linear:F`, `llama3:F:LOW:HIGH:ORIGINAL`; `None` for no scaling.
    pub fn text(self) -> Option<String> {
        match self {
            RopeScaling::None => None,
            RopeScaling::Linear { factor } => Some(format!("linear:{factor:?}")),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                Some(format!(
                    "llama3:{factor:?}:{low_freq_factor:?}:{high_freq_factor:?}:{original_max_position_embeddings:?}"
                ))
            }
        }
    }

    /// Reads [`RopeScaling::text`] back.
    pub fn parse(s: &str) -> Option<RopeScaling> {
        let mut parts = s.split(':');
        let kind = parts.next()?;
        let nums = parts.map(|p| p.parse::<f64>().ok()).collect::<Option<Vec<f64>>>()?;
        match (kind, nums.as_slice()) {
            ("linear", &[factor]) => Some(RopeScaling::Linear { factor }),
            ("llama3", &[factor, low_freq_factor, high_freq_factor, original_max_position_embeddings]) => {
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                })
            }
            _ => None,
        }
    }
}

impl HeadLayout {
    pub const ALL: [HeadLayout; 2] = [HeadLayout::Bhtd, HeadLayout::Bthd];

    pub fn name(self) -> &'static str {
        match self {
            HeadLayout::Bhtd => "bhtd",
            HeadLayout::Bthd => "bthd",
        }
    }

    /// The axis of the sequence (T): 2 in `Bhtd`, 1 in `Bthd`.
    pub fn seq_axis(self) -> usize {
        match self {
            HeadLayout::Bhtd => 2,
            HeadLayout::Bthd => 1,
        }
    }

    /// The axis of the heads (H): 1 in `Bhtd`, 2 in `Bthd`.
    pub fn head_axis(self) -> usize {
        3 - self.seq_axis()
    }

    /// `(B, H, T, D)` of a rank-4 shape in this layout.
    pub fn bhtd(self, dims: &[usize]) -> [usize; 4] {
        [dims[0], dims[self.head_axis()], dims[self.seq_axis()], dims[3]]
    }

    /// The shape as written in this layout, e.g. `[B, T, H, D]`, with `h` and `t` the names of
    /// the head and sequence dims (for error messages).
    pub fn pattern(self, h: &str, t: &str) -> String {
        match self {
            HeadLayout::Bhtd => format!("[B, {h}, {t}, D]"),
            HeadLayout::Bthd => format!("[B, {t}, {h}, D]"),
        }
    }

    /// Element strides `(between heads, between positions)` of a contiguous tensor of `h`
    /// heads, `t` positions and head size `d` in this layout (the batch stride is `h * t * d`
    /// in both). Backends index with these so one kernel serves both layouts.
    pub fn strides(self, h: usize, t: usize, d: usize) -> (usize, usize) {
        match self {
            HeadLayout::Bhtd => (t * d, d),
            HeadLayout::Bthd => (d, h * d),
        }
    }
}

/// Checks attention's q, k, v in `layout`; returns the type of the log-sum-exp `[B, Hq, T]`.
/// Messages name the layout and the shapes it expects.
pub(super) fn attention_operands(
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    causal: bool,
    layout: HeadLayout,
) -> Result<TensorType, String> {
    float(q)?;
    let l = layout.name();
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(format!(
            "layout {l} needs q {}, k and v {}; got q {}, k {}, v {}",
            layout.pattern("Hq", "T"),
            layout.pattern("Hkv", "S"),
            q.shape,
            k.shape,
            v.shape
        ));
    }
    if q.dtype != k.dtype || q.dtype != v.dtype {
        return Err(format!("q, k, v dtypes differ: {}, {}, {}", q.dtype, k.dtype, v.dtype));
    }
    if k.dims() != v.dims() {
        return Err(format!("k {} and v {} differ", k.shape, v.shape));
    }
    let ([b, hq, t, d], [kb, hkv, s, kd]) = (layout.bhtd(q.dims()), layout.bhtd(k.dims()));
    if b != kb || d != kd {
        return Err(format!(
            "batch or head size differ: q {} vs k {} (layout {l}: q {}, k {})",
            q.shape,
            k.shape,
            layout.pattern("Hq", "T"),
            layout.pattern("Hkv", "S")
        ));
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(format!(
            "{hq} query heads are not a multiple of {hkv} key/value heads (q {}, k {}, layout {l})",
            q.shape, k.shape
        ));
    }
    if causal && t != s {
        return Err(format!(
            "causal attention needs equal lengths, got {t} and {s} (q {}, k {}, layout {l})",
            q.shape, k.shape
        ));
    }
    Ok(TensorType::new(stat_dtype(q.dtype), [b, hq, t]))
}
