//! Precision: bf16-mixed keeps f32 masters and f32 optimizer state inside the one step trace
//! and follows 32-true, where bf16-true stalls because its updates fall below bf16's
//! resolution (the tiny model stored in bf16, a learning rate small enough for that). The
//! validation program is the step's forward, casts included.

use std::path::Path;

use rumble_core::DType;
use rumble_core::cpu::Rng;
use rumble_core::ir::InputRole;
use rumble_models::step::Precision;
use rumble_models::{
    Config, Corpus, DeviceChoice, LrSchedule, Optimizer, StepConfig, Trainer, Weights, build_train_step, preset,
};

fn tiny_bf16() -> Config {
    Config { dtype: DType::BF16, ..preset("tiny").unwrap().config }
}

fn sc(precision: Precision) -> StepConfig {
    StepConfig {
        optimizer: Some(Optimizer::adamw()),
        clip: Some(1.0),
        precision: Some(precision),
        ..StepConfig::new(4, 32)
    }
}

/// Losses of `steps` steps at a constant `lr`, and the fraction of parameter elements whose
/// stored (bf16) value changed.
fn train(precision: Precision, lr: f64, steps: usize) -> (Vec<f32>, f64) {
    let cfg = tiny_bf16();
    let corpus = Corpus::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus.txt")).unwrap();
    let w0 = Weights::init(&cfg, 0).unwrap();
    let s = sc(precision);
    let mut t = Trainer::new(cfg, s.clone(), w0.clone(), LrSchedule::constant(lr), DeviceChoice::Cpu).unwrap();
    let mut rng = Rng::new(1);
    let losses =
        (0..steps).map(|_| t.step(&[corpus.sample(&mut rng, s.batch, s.seq).unwrap()]).unwrap().loss).collect();
    let w1 = t.model_weights().unwrap();
    let (mut changed, mut total) = (0usize, 0usize);
    for ((n, a), (_, b)) in w0.tensors.iter().zip(&w1.tensors) {
        assert_eq!(a.ty, b.ty, "{n}: the model folder keeps the config's dtype");
        changed += a.bytes.chunks(2).zip(b.bytes.chunks(2)).filter(|(x, y)| x != y).count();
        total += a.ty.numel();
    }
    (losses, changed as f64 / total as f64)
}

fn tail_mean(v: &[f32]) -> f32 {
    let k = 20;
    v[v.len() - k..].iter().sum::<f32>() / k as f32
}

#[test]
fn mixed_step_keeps_f32_masters_and_states() {
    let cfg = tiny_bf16();
    let step = build_train_step(&cfg, &sc(Precision::Bf16Mixed)).unwrap();
    let t = &step.trace;
    let params: Vec<_> = t.inputs.iter().filter(|i| i.role == InputRole::Param).collect();
    assert!(!params.is_empty());
    assert!(params.iter().all(|i| t.ty(i.value).dtype == DType::F32), "masters are f32");
    assert!(step.states.iter().all(|(_, ty)| ty.dtype == DType::F32), "optimizer states are f32");
    // The matmuls compute in bf16: the forward reads bf16 copies.
    let text = t.to_string();
    assert!(text.contains("cast") && text.contains("bf16["), "no bf16 copies in\n{text}");
    let truth = build_train_step(&cfg, &sc(Precision::Bf16True)).unwrap();
    let tp: Vec<_> = truth.trace.inputs.iter().filter(|i| i.role == InputRole::Param).collect();
    assert!(tp.iter().all(|i| truth.trace.ty(i.value).dtype == DType::BF16));
    assert!(truth.states.iter().all(|(_, ty)| ty.dtype == DType::BF16));
}

#[test]
fn bf16_mixed_follows_32_true_where_bf16_true_stalls() {
    // Adam moves each weight by about lr a step: 3e-5 is below half a bf16 ulp of every
    // weight of magnitude above 2^-7 (the norms' 1.0 among them), so bf16-true's updates mostly
    // round away, while f32 masters accumulate them.
    let (lr, steps) = (3e-5, 120);
    let t0 = std::time::Instant::now();
    // The three runs at once (each is one thread of small matmuls).
    let [(f32_losses, _), (mixed, mixed_changed), (truth, true_changed)] = std::thread::scope(|s| {
        [Precision::F32True, Precision::Bf16Mixed, Precision::Bf16True]
            .map(|p| s.spawn(move || train(p, lr, steps)))
            .map(|h| h.join().expect("a training thread"))
    });
    let (first, f, m, b) = (f32_losses[0], tail_mean(&f32_losses), tail_mean(&mixed), tail_mean(&truth));
    eprintln!(
        "first {first:.4}; after {steps} steps: 32-true {f:.4}, bf16-mixed {m:.4}, bf16-true {b:.4}; \
         stored weights changed: mixed {:.1}%, true {:.1}% ({:.1} s)",
        mixed_changed * 100.0,
        true_changed * 100.0,
        t0.elapsed().as_secs_f64()
    );
    assert!(first - f > 0.2, "32-true should learn at this lr: {first} -> {f}");
    assert!((m - f).abs() / f < 0.01, "bf16-mixed {m} is not within 1% of 32-true {f}");
    assert!(first - b < 0.5 * (first - f), "bf16-true should stall: {first} -> {b} (32-true: {f})");
    assert!(true_changed < 0.5 * mixed_changed, "bf16-true changed {true_changed}, mixed {mixed_changed}");
}

#[test]
fn eval_is_the_steps_forward_and_changes_nothing() {
    let cfg = tiny_bf16();
    let corpus = Corpus::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus.txt")).unwrap();
    for p in Precision::ALL {
        let s = sc(p);
        let mut t = Trainer::new(
            cfg.clone(),
            s.clone(),
            Weights::init(&cfg, 3).unwrap(),
            LrSchedule::constant(1e-3),
            DeviceChoice::Cpu,
        )
        .unwrap();
        let mut rng = Rng::new(9);
        for _ in 0..3 {
            t.step(&[corpus.sample(&mut rng, s.batch, s.seq).unwrap()]).unwrap();
        }
        let b = corpus.sample(&mut rng, s.batch, s.seq).unwrap();
        let before = t.weights().unwrap();
        let ev = t.eval(std::slice::from_ref(&b)).unwrap();
        assert_eq!(before, t.weights().unwrap(), "{p}: eval changed the parameters");
        // Another shape, and a mean over two batches.
        let short = corpus.sample(&mut rng, 2, 8).unwrap();
        let two = t.eval(&[b.clone(), short.clone()]).unwrap();
        let one_short = t.eval(std::slice::from_ref(&short)).unwrap();
        assert!(((ev + one_short) / 2.0 - two).abs() < 1e-6, "{p}: {ev} {one_short} {two}");
        // The step reports the loss of its forward, before its update: the same number.
        let step = t.step(&[b]).unwrap().loss;
        assert!((ev - step).abs() <= 1e-6 * step.abs(), "{p}: eval {ev}, step {step}");
    }
}

/// The step's inputs in trace order: random tokens, learning-rate scalars, the seeded weights
/// cast to the masters' dtype, zero states.
fn step_inputs(trace: &rumble_core::Trace, cfg: &Config) -> Vec<rumble_core::cpu::HostTensor> {
    use rumble_core::cpu::HostTensor;
    let w = Weights::init(cfg, 5).unwrap();
    let mut rng = Rng::new(2);
    trace
        .inputs
        .iter()
        .map(|i| {
            let ty = trace.ty(i.value);
            match (i.role, i.name.as_str()) {
                (InputRole::Param, n) => {
                    let t = w.get(n).unwrap();
                    let vals = t.to_f32().into_iter().map(f64::from).collect::<Vec<_>>();
                    HostTensor::from_f64(ty.dtype, ty.dims(), &vals).unwrap()
                }
                (InputRole::OptState, _) => HostTensor::zeros(ty.clone()),
                (_, "tokens" | "targets") => {
                    let v: Vec<i64> = (0..ty.numel()).map(|_| rng.below(256) as i64).collect();
                    HostTensor::from_i64(DType::I64, ty.dims(), &v).unwrap()
                }
                (_, "lr") => HostTensor::scalar(DType::F32, 1e-3),
                _ => HostTensor::scalar(DType::F32, 0.5), // Adam's bias corrections
            }
        })
        .collect()
}

#[test]
fn mixed_step_and_eval_plan_and_run_in_one_arena() {
    use rumble_core::compile::{CompileOptions, plan};
    let cfg = tiny_bf16();
    let s = sc(Precision::Bf16Mixed);
    let step = build_train_step(&cfg, &s).unwrap().trace;
    let eval = rumble_models::step::build_eval_step(&cfg, &s).unwrap();
    let mut persistent = Vec::new();
    for t in [step, eval] {
        let (t, _) = rumble_core::passes::run(&t, rumble_models::trainer::PIPELINE).unwrap();
        let inputs = step_inputs(&t, &cfg);
        let want = rumble_core::cpu::eval(&t, &inputs).unwrap();
        let p = plan(&t, &CompileOptions::default()).unwrap();
        rumble_core::plan::check::check(&p.trace, &p.plan).unwrap();
        let got = rumble_core::cpu::arena::eval(&p.trace, &p.plan, &inputs).unwrap();
        for (k, o) in t.outputs.iter().enumerate() {
            let g = p.trace.outputs.iter().position(|q| q.name == o.name).unwrap();
            assert!(want[k].bytes == got[g].bytes, "{}: output `{}` differs planned", t.name, o.name);
        }
        // The persistent inputs sit where the step's do (what sharing one region needs).
        persistent.push(
            p.trace
                .inputs
                .iter()
                .filter(|i| i.role.is_persistent())
                .map(|i| (i.name.clone(), p.plan.slot(i.value).unwrap().offset))
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(persistent[0], persistent[1]);
}
