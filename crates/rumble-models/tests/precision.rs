//! Precision: bf16-mixed keeps f32 masters and f32 optimizer state inside the one step trace
//! and follows 32-true, where bf16-true stalls because its updates fall below bf16's
//! resolution (the tiny model stored in bf16, a learning rate small enough for that). The
//! validation program is the step's forward, casts included.

use std::path::Path;

use rumble_core::DType;
use rumble_core::cpu::Rng;
use rumble_core::ir::{InputRole, Op};
use rumble_models::step::Precision;
use rumble_models::{
    Config, Corpus, DeviceChoice, LrSchedule, Optimizer, StepConfig, Trainer, Weights, build_train_step, preset,
};

fn tiny_bf16() -> Config {
    Config { dtype: DType::BF16, ..preset("tiny").unwrap().config }
}

/// The shipped corpus.
fn corpus() -> Corpus {
    Corpus::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus.txt")).unwrap()
}

/// A trainer of `cfg` at a constant learning rate of 1e-3, its weights drawn from `seed`.
fn trainer(cfg: &Config, s: &StepConfig, seed: u64, device: DeviceChoice) -> Trainer {
    Trainer::new(cfg.clone(), s.clone(), Weights::init(cfg, seed).unwrap(), LrSchedule::constant(1e-3), device).unwrap()
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
    let corpus = corpus();
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
    // As PyTorch's autocast: the matmuls compute in bf16 (on bf16 copies), the norms and the
    // residual stream in f32.
    let text = t.to_string();
    assert!(text.contains("cast") && text.contains("bf16["), "no bf16 copies in\n{text}");
    let (mut matmuls, mut norms) = (0, 0);
    for n in &t.nodes {
        let dtypes: Vec<DType> = n.args.iter().map(|&a| t.ty(a).dtype).collect();
        match n.op {
            Op::Matmul { .. } => {
                matmuls += 1;
                assert!(dtypes.iter().all(|&d| d == DType::BF16), "a matmul on {dtypes:?}");
            }
            Op::RmsNorm { .. } => {
                norms += 1;
                assert!(dtypes.iter().all(|&d| d == DType::F32), "an rms_norm on {dtypes:?}");
            }
            _ => {}
        }
    }
    assert!(matmuls > 0 && norms == 2 * cfg.num_hidden_layers + 1, "{matmuls} matmuls, {norms} norms");
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
    let (lr, steps) = (3e-5, 300);
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
    let corpus = corpus();
    for p in Precision::ALL {
        let s = sc(p);
        let mut t = trainer(&cfg, &s, 3, DeviceChoice::Cpu);
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

/// The checks `rumble_cuda::BucketedGraphs` runs before placing the step and its validation
/// program over one arena (what `Trainer::with_eval` does on CUDA), on the CPU: the two share
/// one persistent layout, take different per-step inputs (the step also takes its learning
/// rate and Adam's corrections) and return different outputs (the step its gradient norm),
/// and that is legal; the data the validation program takes picks it alone.
#[test]
fn step_and_eval_pass_the_shared_region_checks() {
    use rumble_core::compile::{CompileOptions, plan};
    let cfg = tiny_bf16();
    for p in Precision::ALL {
        let s = sc(p);
        let opts = CompileOptions::default();
        let step = build_train_step(&cfg, &s).unwrap().trace;
        let step = plan(&rumble_core::compile::optimize(&step, &opts).unwrap().0, &opts).unwrap();
        let eval = rumble_models::step::build_eval_step(&cfg, &StepConfig { seq: 16, ..s.clone() }).unwrap();
        let eval = plan(&rumble_core::compile::optimize(&eval, &opts).unwrap().0, &opts).unwrap();
        let (ts, te) = (&step.trace, &eval.trace);
        assert_ne!(rumble_cuda::exec::step_inputs(ts), rumble_cuda::exec::step_inputs(te), "{p}");
        let returned =
            |t: &rumble_core::Trace| t.outputs.iter().filter(|o| o.role == rumble_core::ir::OutputRole::Output).count();
        assert_ne!(returned(ts), returned(te), "{p}: the step returns its gradient norm too");
        rumble_cuda::exec::check_shared_layout(&[(ts, &step.plan), (te, &eval.plan)]).unwrap();
        rumble_cuda::exec::check_step_inputs(&[ts, te]).unwrap();
        let types: Vec<_> = rumble_cuda::exec::step_inputs(te).into_iter().map(|(_, t)| t).collect();
        assert_eq!(rumble_cuda::exec::bucket_taking(&[ts, te], &types).unwrap(), 1, "{p}");
        let types: Vec<_> = rumble_cuda::exec::step_inputs(ts).into_iter().map(|(_, t)| t).collect();
        assert_eq!(rumble_cuda::exec::bucket_taking(&[ts, te], &types).unwrap(), 0, "{p}");
        // A validation program of another model cannot share the step's region.
        let other = Config { hidden_size: cfg.hidden_size * 2, ..cfg.clone() };
        let bad = rumble_models::step::build_eval_step(&other, &s).unwrap();
        let bad = plan(&rumble_core::compile::optimize(&bad, &opts).unwrap().0, &opts).unwrap();
        let e = rumble_cuda::exec::check_shared_layout(&[(ts, &step.plan), (&bad.trace, &bad.plan)]).unwrap_err();
        assert!(e.to_string().contains("cannot share bucket 0's persistent region"), "{p}: {e}");
    }
}

/// On a GPU (ignored without one): a step and validation on CUDA (`Trainer::with_eval`: the
/// step and its forward-only program as two buckets of one arena) give the CPU's step losses
/// and validation losses, steps after an evaluation included, and evaluation changes nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_step_and_eval_give_the_cpus_validation_loss() {
    if let Some(why) = rumble_models::exec::cuda_unavailable() {
        panic!("this test needs a CUDA device (run with --include-ignored only on a GPU machine): {why}");
    }
    let corpus = corpus();
    let cfg = preset("tiny").unwrap().config; // f32: CPU and GPU agree closely
    let s = StepConfig { precision: None, ..sc(Precision::F32True) };
    let run = |device: DeviceChoice| {
        let mut t = trainer(&cfg, &s, 7, device).with_eval(s.batch, 16).unwrap();
        let mut rng = Rng::new(4);
        let val = corpus.sample(&mut Rng::new(99), s.batch, 16).unwrap();
        let (mut steps, mut evals) = (Vec::new(), Vec::new());
        for k in 0..6 {
            steps.push(t.step(&[corpus.sample(&mut rng, s.batch, s.seq).unwrap()]).unwrap().loss);
            if k % 2 == 1 {
                let before = t.weights().unwrap();
                evals.push(t.eval(std::slice::from_ref(&val)).unwrap());
                evals.push(t.eval(std::slice::from_ref(&val)).unwrap());
                assert_eq!(before, t.weights().unwrap(), "{device:?}: eval changed the parameters");
            }
        }
        (steps, evals)
    };
    let (cpu_steps, cpu_evals) = run(DeviceChoice::Cpu);
    let (gpu_steps, gpu_evals) = run(DeviceChoice::Cuda);
    let close = |a: f32, b: f32| (a - b).abs() <= 5e-3 * b.abs();
    for (k, (g, c)) in gpu_steps.iter().zip(&cpu_steps).enumerate() {
        assert!(close(*g, *c), "step {k}: CUDA loss {g}, CPU {c}");
    }
    for (k, (g, c)) in gpu_evals.iter().zip(&cpu_evals).enumerate() {
        assert!(close(*g, *c), "evaluation {k}: CUDA validation loss {g}, CPU {c}");
    }
    for w in gpu_evals.chunks(2) {
        assert_eq!(w[0], w[1], "two evaluations of the same batch differ on CUDA");
    }
    assert_eq!(gpu_evals.len(), 6);
    // Tighter, at the very same parameters: the CUDA trainer's evaluation (its program in the
    // step's arena) against the CPU reference over its weights.
    let mut gpu = trainer(&cfg, &s, 8, DeviceChoice::Cuda).with_eval(s.batch, 16).unwrap();
    let mut rng = Rng::new(5);
    for _ in 0..3 {
        gpu.step(&[corpus.sample(&mut rng, s.batch, s.seq).unwrap()]).unwrap();
    }
    let val = corpus.sample(&mut rng, s.batch, 16).unwrap();
    let on_gpu = gpu.eval(std::slice::from_ref(&val)).unwrap();
    let mut cpu =
        Trainer::new(cfg.clone(), s.clone(), gpu.weights().unwrap(), LrSchedule::constant(1e-3), DeviceChoice::Cpu)
            .unwrap();
    let on_cpu = cpu.eval(std::slice::from_ref(&val)).unwrap();
    assert!((on_gpu - on_cpu).abs() <= 1e-4 * on_cpu.abs(), "same weights: CUDA validation {on_gpu}, CPU {on_cpu}");
    // The step still runs after an evaluation (its graphs replayed over the arena the
    // validation program wrote).
    let after = gpu.step(&[corpus.sample(&mut rng, s.batch, s.seq).unwrap()]).unwrap().loss;
    assert!(after.is_finite(), "{after}");
}
