//! rumble against Hugging Face transformers (5.24, torch 2.15). `reference/make_reference.py`
//! built small LLaMA and Qwen2 models with transformers, wrote them with `save_pretrained`, and
//! stored the float64 loss, logits and gradients for fixed token ids with `labels = input_ids`.
//! Here rumble reads transformers' own config.json and model.safetensors, runs the same step on
//! the CPU in f32, and must agree. A third folder went the other way (see its test).
//!
//! Where a GPU is usable the same step also runs on it (the graphed CUDA executor, fused loss)
//! and must agree with transformers as closely. `RUMBLE_REFERENCE_DIR=DIR` checks against
//! references made afresh (`make_reference.py DIR ...`, e.g. on the GPU machine with its own
//! transformers) instead of the committed ones; a case missing there fails.

use std::collections::HashMap;
use std::path::PathBuf;

use rumble_core::cpu::{HostTensor, eval};
use rumble_core::passes;
use rumble_core::{DType, Graph};
use rumble_models::exec::cuda_unavailable;
use rumble_models::model::{self, Params};
use rumble_models::weights::{read_safetensors, split_packed};
use rumble_models::{Config, CudaExecutor, CudaMode, Executor, PIPELINE, StepConfig, Weights, build_train_step};

fn close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: reference is all zero");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("{what}: max error {:.2e} of scale", worst / scale);
    assert!(worst <= rel * scale, "{what}: max error {worst:e} vs scale {scale:e}");
}

/// Checks case `name`; `rel` bounds the errors of the loss and logits, `rel_grad` of gradients,
/// both relative to the largest reference value of each tensor.
fn check_case(name: &str, rel: f64, rel_grad: f64) {
    let root = match std::env::var_os("RUMBLE_REFERENCE_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference"),
    };
    let dir = root.join(name);
    eprintln!("{name}: references from {}", dir.display());
    let cfg = Config::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::load(&dir.join("model.safetensors"), &cfg).unwrap();
    let reference: HashMap<String, HostTensor> =
        read_safetensors(&dir.join("reference.safetensors")).unwrap().into_iter().collect();
    let ids = &reference["input_ids"];
    let (b, t) = (ids.ty.dims()[0], ids.ty.dims()[1]);
    let tokens = ids.to_i64();
    let targets = model::hf_causal_targets(&tokens, b, t);
    let mut inputs = vec![
        HostTensor::from_i64(DType::I64, &[b, t], &tokens).unwrap(),
        HostTensor::from_i64(DType::I64, &[b * t], &targets).unwrap(),
    ];
    inputs.extend(weights.tensors.iter().map(|(_, w)| w.clone()));

    // Logits.
    let g = Graph::new("logits");
    let tok = g.data("tokens", DType::I64, &[b, t]).unwrap();
    let _targets = g.data("targets", DType::I64, &[b * t]).unwrap();
    let params = Params::declare(&g, &cfg).unwrap();
    g.output(&model::logits(&cfg, &params, &tok).unwrap(), "logits").unwrap();
    let out = eval(&g.finish().unwrap(), &inputs).unwrap();
    close(&out[0].to_f64(), &reference["logits"].to_f64(), rel, &format!("{name}: logits"));

    // Loss and every gradient, with the logits materialised and with the fused loss.
    for fused_loss in [false, true] {
        let step = build_train_step(&cfg, &step_config(b, t, fused_loss)).unwrap();
        let out = eval(&step.trace, &inputs).unwrap();
        let what = format!("{name} (fused {fused_loss})");
        check_step(&what, &step.trace, &reference, &out[0], |i, _| out[i].clone(), rel, rel_grad);
    }

    // The same step on the GPU, graphed, with the fused loss.
    if let Some(why) = cuda_unavailable() {
        eprintln!("{name}: CUDA check skipped: {why}");
        return;
    }
    let step = build_train_step(&cfg, &step_config(b, t, true)).unwrap();
    let (trace, _) = passes::run(&step.trace, PIPELINE).unwrap();
    let mut exec = CudaExecutor::new(trace, weights.tensors.clone(), CudaMode::Graphed).unwrap();
    let out = exec.step(&inputs[..2]).unwrap();
    let what = format!("{name} (CUDA graphed)");
    check_step(&what, &step.trace, &reference, &out[0], |_, n| exec.output(n).unwrap(), rel, rel_grad);
}

/// The causal-LM step without an optimizer (loss and every gradient).
fn step_config(batch: usize, seq: usize, fused_loss: bool) -> StepConfig {
    StepConfig { fused_loss, ..StepConfig::new(batch, seq) }
}

/// The loss and every gradient output of `trace` (the `i`-th output, named `n`, from
/// `output(i, n)`) against the reference; every reference gradient must be checked.
fn check_step(
    what: &str,
    trace: &rumble_core::Trace,
    reference: &HashMap<String, HostTensor>,
    loss: &HostTensor,
    output: impl Fn(usize, &str) -> HostTensor,
    rel: f64,
    rel_grad: f64,
) {
    close(&loss.to_f64(), &reference["loss"].to_f64(), rel, &format!("{what}: loss"));
    let mut checked = 0;
    for (i, o) in trace.outputs.iter().enumerate().skip(1) {
        // A packed parameter's gradient (gate | up) splits into transformers' two.
        let name = o.name.strip_prefix("grad.").unwrap_or(&o.name);
        for (part, got) in split_packed(name, &output(i, &o.name)) {
            let key = format!("grad.{part}");
            let want = reference.get(&key).unwrap_or_else(|| panic!("{what}: no reference for {key}"));
            close(&got.to_f64(), &want.to_f64(), rel_grad, &format!("{what}: {key}"));
            checked += 1;
        }
    }
    assert_eq!(checked, reference.keys().filter(|k| k.starts_with("grad.")).count(), "{what}");
}

/// One test per stored case: `name => case directory, tolerance on the loss and logits,
/// tolerance on the gradients`.
macro_rules! cases {
    ($($(#[$doc:meta])* $name:ident => $case:literal, $rel:expr, $rel_grad:expr;)*) => {$(
        $(#[$doc])*
        #[test]
        fn $name() {
            check_case($case, $rel, $rel_grad);
        }
    )*};
}

cases! {
    llama_with_grouped_query_attention_and_tied_embeddings_matches_transformers => "llama_gqa_tied", 1e-5, 1e-4;
    llama_with_full_heads_untied_matches_transformers => "llama_mha_untied", 1e-5, 1e-4;
    qwen2_with_seven_query_heads_per_kv_head_and_tied_embeddings_matches_transformers => "qwen2_gqa7_tied", 1e-5, 1e-4;
    qwen2_with_biases_and_head_dim_1_matches_transformers => "qwen2_head_dim_1", 1e-5, 1e-4;
    /// The other direction, in bf16: a checkpoint written by `rumble train` (rumble's config.json
    /// and safetensors) that transformers loaded with `from_pretrained` to make the reference.
    /// rumble rounds every bf16 activation, the reference is float64: bf16-sized tolerances.
    rumble_bf16_checkpoint_loads_in_transformers_and_agrees => "rumble_bf16_untied", 2e-2, 5e-2;
}

/// Llama 3.1's RoPE scaling: frequencies kept, blended and divided (transformers'
/// `_compute_llama3_parameters`). The same weights with the scaling dropped must not match,
/// so the check sees the scaling.
#[test]
fn llama3_rope_scaling_matches_transformers() {
    check_case("llama3_rope_scaled", 1e-5, 1e-4);
    assert_scaling_matters("llama3_rope_scaled");
}

#[test]
fn linear_rope_scaling_matches_transformers() {
    check_case("llama_rope_linear", 1e-5, 1e-4);
    assert_scaling_matters("llama_rope_linear");
}

/// The case's logits with plain RoPE are far from transformers' scaled ones.
fn assert_scaling_matters(name: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference").join(name);
    let mut cfg = Config::from_file(&dir.join("config.json")).unwrap();
    assert_ne!(cfg.rope_scaling, rumble_core::RopeScaling::None, "{name}");
    cfg.rope_scaling = rumble_core::RopeScaling::None;
    let weights = Weights::load(&dir.join("model.safetensors"), &cfg).unwrap();
    let reference: HashMap<String, HostTensor> =
        read_safetensors(&dir.join("reference.safetensors")).unwrap().into_iter().collect();
    let ids = &reference["input_ids"];
    let g = Graph::new("logits");
    let tok = g.data("tokens", DType::I64, ids.ty.dims()).unwrap();
    let params = Params::declare(&g, &cfg).unwrap();
    g.output(&model::logits(&cfg, &params, &tok).unwrap(), "logits").unwrap();
    let mut inputs = vec![ids.clone()];
    inputs.extend(weights.tensors.iter().map(|(_, w)| w.clone()));
    let got = eval(&g.finish().unwrap(), &inputs).unwrap()[0].to_f64();
    let want = reference["logits"].to_f64();
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("{name} without scaling: max error {:.2e} of scale", worst / scale);
    assert!(worst > 1e-3 * scale, "{name}: plain RoPE agrees too ({worst:e} of {scale:e})");
}
