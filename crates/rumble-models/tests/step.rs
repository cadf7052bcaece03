//! The training step as one trace: its structure (names, phases, roles) for every preset, and
//! its numbers on the CPU (gradient accumulation and clipping agree with plain gradients).

use rumble_core::cpu::Rng;
use rumble_core::cpu::{HostTensor, eval};
use rumble_core::ir::{InputRole, OutputRole, Phase};
use rumble_core::{DType, Trace};
use rumble_models::{Batch, Config, Objective, Optimizer, PRESET_NAMES, StepConfig, Weights, build_train_step, preset};

fn small_cfg() -> Config {
    Config { num_hidden_layers: 1, ..preset("tiny").unwrap().config }
}

fn sc(objective: Objective, optimizer: Option<Optimizer>, grad_accum: usize, clip: Option<f64>) -> StepConfig {
    StepConfig {
        batch: 2,
        seq: 8,
        objective,
        optimizer,
        grad_accum,
        clip,
        fused_loss: false,
        precision: None,
        loss_weights: false,
    }
}

#[test]
fn every_preset_builds_a_whole_training_step() {
    for name in PRESET_NAMES {
        let p = preset(name).unwrap();
        // Short sequences: the trace's structure does not depend on them.
        let s = StepConfig {
            objective: p.objective,
            optimizer: Some(Optimizer::adamw()),
            clip: Some(1.0),
            ..StepConfig::new(1, 16)
        };
        let t = build_train_step(&p.config, &s).unwrap().trace;
        let fused = t.op_counts().into_iter().any(|(op, _)| op == "linear_cross_entropy");
        assert_eq!(fused, p.objective == Objective::CausalLm, "{name}");
        let phases: Vec<Phase> = [Phase::Forward, Phase::Backward, Phase::Optimizer]
            .into_iter()
            .filter(|ph| t.nodes.iter().any(|n| n.phase == *ph))
            .collect();
        assert_eq!(phases.len(), 3, "{name}");
        let params = t.inputs.iter().filter(|i| i.role == InputRole::Param).count();
        let states = t.inputs.iter().filter(|i| i.role == InputRole::OptState).count();
        let updates = t.outputs.iter().filter(|o| matches!(o.role, OutputRole::Update { .. })).count();
        assert_eq!((states, updates), (2 * params, 3 * params), "{name}");
        assert_eq!(t.outputs[0].name, "loss");
        assert_eq!(t.outputs[1].name, "grad_norm");
        assert!(t.input("model.layers.0.self_attn.q_proj.weight").is_some());
        assert!(t.input("model.embed_tokens.weight").is_some());
        assert_eq!(t.input("lm_head.weight").is_some(), !p.config.tie_word_embeddings, "{name}");
        assert_eq!(t.input("model.layers.0.self_attn.k_proj.bias").is_some(), p.config.qkv_bias, "{name}");
        assert_eq!(t.input("targets").is_some(), p.objective == Objective::CausalLm, "{name}");
        let ops: std::collections::HashMap<_, _> = t.op_counts().into_iter().collect();
        assert_eq!(ops.get("attention"), Some(&p.config.num_hidden_layers), "{name}");
        assert_eq!(ops.get("attention_backward"), Some(&p.config.num_hidden_layers), "{name}");
    }
}

#[test]
fn tied_embeddings_are_one_parameter_read_twice() {
    let cfg = small_cfg();
    assert!(cfg.tie_word_embeddings);
    let t = build_train_step(&cfg, &sc(Objective::CausalLm, None, 1, None)).unwrap().trace;
    let embed = t.input("model.embed_tokens.weight").unwrap().value;
    let forward_reads = t.nodes.iter().filter(|n| n.phase == Phase::Forward && n.args.contains(&embed)).count();
    assert_eq!(forward_reads, 2);
    assert!(
        t.outputs
            .iter()
            .any(|o| o.name == "grad.model.embed_tokens.weight" && o.role == OutputRole::Grad { of: embed })
    );
}

/// Runs a gradient-only step (no optimizer) on `batches`; returns the loss and the gradients.
fn grads(cfg: &Config, w: &Weights, batches: &[Batch], clip: Option<f64>) -> (Vec<HostTensor>, Trace) {
    grads_with(cfg, w, batches, StepConfig { clip, ..sc(Objective::CausalLm, None, batches.len(), None) })
}

fn grads_with(cfg: &Config, w: &Weights, batches: &[Batch], s: StepConfig) -> (Vec<HostTensor>, Trace) {
    let step = build_train_step(cfg, &s).unwrap();
    let mut inputs = Vec::new();
    for b in batches {
        inputs.push(HostTensor::from_i64(DType::I64, &[b.batch, b.seq], &b.tokens).unwrap());
        inputs.push(HostTensor::from_i64(DType::I64, &[b.batch * b.seq], &b.targets).unwrap());
    }
    inputs.extend(w.tensors.iter().map(|(_, t)| t.clone()));
    (eval(&step.trace, &inputs).unwrap(), step.trace)
}

#[test]
fn accumulated_gradients_are_the_mean_of_micro_batch_gradients() {
    let cfg = small_cfg();
    let w = Weights::init(&cfg, 5).unwrap();
    let mut rng = Rng::new(9);
    let (a, b) = (Batch::random(&mut rng, 256, 2, 8), Batch::random(&mut rng, 256, 2, 8));
    let (ga, _) = grads(&cfg, &w, std::slice::from_ref(&a), None);
    let (gb, _) = grads(&cfg, &w, std::slice::from_ref(&b), None);
    let (gab, t) = grads(&cfg, &w, &[a, b], None);
    assert_eq!(t.input("tokens.1").map(|i| i.role), Some(InputRole::Input));
    assert!((gab[0].item() - (ga[0].item() + gb[0].item()) / 2.0).abs() < 1e-5, "loss");
    for i in 1..ga.len() {
        let (x, y, z) = (ga[i].to_f64(), gb[i].to_f64(), gab[i].to_f64());
        let scale = z.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{}: zero gradient", t.outputs[i].name);
        for j in 0..z.len() {
            assert!((z[j] - (x[j] + y[j]) / 2.0).abs() <= 1e-4 * scale, "{} [{j}]", t.outputs[i].name);
        }
    }
}

#[test]
fn clipping_scales_gradients_to_the_max_norm() {
    let cfg = small_cfg();
    let w = Weights::init(&cfg, 6).unwrap();
    let b = Batch::random(&mut Rng::new(2), 256, 2, 8);
    let (plain, _) = grads(&cfg, &w, std::slice::from_ref(&b), None);
    let norm: f64 = plain[1..].iter().flat_map(|g| g.to_f64()).map(|x| x * x).sum::<f64>().sqrt();
    let max_norm = norm / 4.0;
    let (clipped, t) = grads(&cfg, &w, &[b], Some(max_norm));
    assert_eq!(t.outputs[1].name, "grad_norm");
    assert!((clipped[1].item() - norm).abs() < 1e-4 * norm, "grad_norm {} vs {norm}", clipped[1].item());
    let after: f64 = clipped[2..].iter().flat_map(|g| g.to_f64()).map(|x| x * x).sum::<f64>().sqrt();
    assert!((after - max_norm).abs() < 1e-4 * max_norm, "{after} vs {max_norm}");
}

#[test]
fn initial_loss_is_near_uniform_and_logits_sum_works() {
    let cfg = small_cfg();
    let w = Weights::init(&cfg, 0).unwrap();
    // 124 targets: the mean's spread over seeds is about 0.02 (0.04 for a 2 x 8 batch).
    let wide = Batch::random(&mut Rng::new(4), 256, 4, 32);
    let (out, _) =
        grads_with(&cfg, &w, &[wide], StepConfig { batch: 4, seq: 32, ..sc(Objective::CausalLm, None, 1, None) });
    assert!((out[0].item() - 256f64.ln()).abs() < 0.1, "{}", out[0].item());
    let b = Batch::random(&mut Rng::new(4), 256, 2, 8);
    // The seed objective: no targets input; the loss is the sum of the logits.
    let t = build_train_step(&cfg, &sc(Objective::LogitsSum, None, 1, None)).unwrap().trace;
    assert!(t.input("targets").is_none());
    let mut inputs = vec![HostTensor::from_i64(DType::I64, &[2, 8], &b.tokens).unwrap()];
    inputs.extend(w.tensors.iter().map(|(_, t)| t.clone()));
    let out = eval(&t, &inputs).unwrap();
    let fwd = rumble_models::build_forward(&cfg, 2, 8, Objective::LogitsSum, false).unwrap();
    let fwd_out = eval(&fwd, &inputs).unwrap();
    assert_eq!(out[0].item(), fwd_out[0].item());
    assert!(out[0].item().abs() > 0.0);
}

#[test]
fn bad_step_shapes_are_refused() {
    let cfg = small_cfg();
    let e =
        build_train_step(&cfg, &StepConfig { grad_accum: 0, ..sc(Objective::CausalLm, None, 1, None) }).unwrap_err();
    assert!(e.to_string().contains("grad_accum (0)"), "{e}");
    let e = build_train_step(&cfg, &sc(Objective::CausalLm, None, 1, Some(-1.0))).unwrap_err();
    assert!(e.to_string().contains("clip"), "{e}");
}

#[test]
fn fused_head_loss_matches_materialised_logits() {
    let cfg = Config { tie_word_embeddings: false, ..small_cfg() };
    let w = Weights::init(&cfg, 8).unwrap();
    let b = Batch::random(&mut Rng::new(3), 256, 2, 8);
    let plain = sc(Objective::CausalLm, None, 1, None);
    let (x, t) = grads_with(&cfg, &w, std::slice::from_ref(&b), plain.clone());
    let (y, u) = grads_with(&cfg, &w, &[b], StepConfig { fused_loss: true, ..plain });
    let has = |t: &Trace, op: &str| t.op_counts().iter().any(|(o, _)| *o == op);
    assert!(has(&u, "linear_cross_entropy") && !has(&t, "linear_cross_entropy") && has(&t, "cross_entropy"));
    assert!((x[0].item() - y[0].item()).abs() < 1e-5);
    for i in 1..x.len() {
        let (a, b) = (x[i].to_f64(), y[i].to_f64());
        let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() <= 1e-4 * scale), "{}", t.outputs[i].name);
    }
}
