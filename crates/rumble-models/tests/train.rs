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
