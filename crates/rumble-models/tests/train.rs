//! The tiny model learns: its loss on the shipped corpus falls well below where it starts
//! within a hundred CPU steps (below half of it).

use std::path::Path;

use rumble_core::cpu::Rng;
use rumble_models::{Corpus, DeviceChoice, LrSchedule, ScheduleKind, StepConfig, Trainer, Weights, preset};

#[test]
fn tiny_model_loss_falls_on_the_corpus() {
    let p = preset("tiny").unwrap();
    let corpus = Corpus::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus.txt")).unwrap();
    let steps = 100;
    let sc = StepConfig {
        objective: p.objective,
        optimizer: Some(rumble_models::Optimizer::adamw()),
        clip: Some(1.0),
        ..StepConfig::new(4, 64)
    };
    let schedule = LrSchedule { peak: p.lr, warmup: 20, total: steps, kind: ScheduleKind::Cosine };
    let weights = Weights::init(&p.config, 0).unwrap();
    let mut trainer = Trainer::new(p.config.clone(), sc.clone(), weights, schedule, DeviceChoice::Cpu).unwrap();
    let mut rng = Rng::new(1);
    let mut losses = Vec::new();
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        let b = corpus.sample(&mut rng, sc.batch, sc.seq).unwrap();
        let s = trainer.step(&[b]).unwrap();
        assert!(s.loss.is_finite() && s.grad_norm.is_some_and(f32::is_finite), "{s:?}");
        losses.push(s.loss);
    }
    let first = losses[0];
    let last: f32 = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
    eprintln!("loss {first:.3} -> {last:.3} over {steps} steps in {:.1} s", t0.elapsed().as_secs_f64());
    // Uniform over 256 bytes is ln 256 = 5.55; letter frequencies alone give about 3.
    assert!((first - 256f32.ln()).abs() < 0.3, "initial loss {first}");
    assert!(last < 0.5 * first, "loss went from {first} to {last}");
}

/// `StepConfig::loss_weights`: a weight of 1 is the unweighted step bit for bit; a weight of
/// 0.5 halves the loss and the gradient (its norm, with clipping off the mark).
#[test]
fn a_loss_weight_scales_the_loss_and_its_gradients() {
    let p = preset("tiny").unwrap();
    let sc = StepConfig {
        objective: p.objective,
        optimizer: Some(rumble_models::Optimizer::adamw()),
        clip: Some(1e6),
        grad_accum: 2,
        ..StepConfig::new(2, 16)
    };
    let schedule = LrSchedule::constant(1e-3);
    let mut rng = Rng::new(3);
    let batches: Vec<_> = (0..2).map(|_| rumble_models::data::Batch::random(&mut rng, 256, 2, 16)).collect();
    let step = |weighted: bool, w: Option<&[f64]>| {
        let sc = StepConfig { loss_weights: weighted, ..sc.clone() };
        let weights = Weights::init(&p.config, 0).unwrap();
        let mut t = Trainer::new(p.config.clone(), sc, weights, schedule, DeviceChoice::Cpu).unwrap();
        t.step_weighted(&batches, w).unwrap()
    };
    let plain = step(false, None);
    let one = step(true, Some(&[1.0, 1.0]));
    assert_eq!(
        (plain.loss.to_bits(), plain.grad_norm.map(f32::to_bits)),
        (one.loss.to_bits(), one.grad_norm.map(f32::to_bits))
    );
    let half = step(true, Some(&[0.5, 0.5]));
    assert!((half.loss - plain.loss / 2.0).abs() <= 1e-6 * plain.loss, "{half:?} vs {plain:?}");
    let (g, h) = (plain.grad_norm.unwrap(), half.grad_norm.unwrap());
    assert!((h - g / 2.0).abs() <= 1e-5 * g, "{h} vs {g}");
    // Only the first micro-batch counts: its loss alone, halved by the mean over the two.
    let first = step(true, Some(&[1.0, 0.0]));
    assert!(first.loss < plain.loss && first.loss > 0.0, "{first:?}");
}
