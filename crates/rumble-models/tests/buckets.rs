//! BucketShape buckets on the CPU: a batch padded to its bucket (tokens by the pad token, targets by
//! the ignore index) gives the loss and the gradients of the unpadded batch, and the bucketed
//! executor trains exactly as one executor per exact shape does, steps of different shapes
//! alternating over the shared parameters and optimizer states.

use rumble_core::Trace;
use rumble_core::cpu::Rng;
use rumble_core::cpu::{HostTensor, eval};
use rumble_models::buckets::{PAD_TOKEN, pad_batch, pad_data};
use rumble_models::exec::CpuExecutor;
use rumble_models::{
    Batch, BucketShape, BucketedExecutor, Buckets, Config, DeviceChoice, DeviceKind, Executor, LrSchedule, Objective,
    Optimizer, StepConfig, Trainer, Weights, build_train_step, host, preset,
};

fn small_cfg() -> Config {
    Config { num_hidden_layers: 1, ..preset("tiny").unwrap().config }
}

fn sc(batch: usize, seq: usize, optimizer: Option<Optimizer>, fused_loss: bool) -> StepConfig {
    StepConfig { optimizer, fused_loss, ..StepConfig::new(batch, seq) }
}

/// Random tokens and random (corpus-like, never ignored) targets.
fn batch(rng: &mut Rng, vocab: usize, b: usize, t: usize) -> Batch {
    let tokens = (0..b * t).map(|_| rng.below(vocab) as i64).collect();
    let targets = (0..b * t).map(|_| rng.below(vocab) as i64).collect();
    Batch { batch: b, seq: t, tokens, targets }
}

/// `||a - b|| / ||b||` over float tensors of the same type.
fn rel(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.ty, b.ty);
    let (x, y) = (a.to_f64(), b.to_f64());
    let num: f64 = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum();
    let den: f64 = y.iter().map(|q| q * q).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Evaluates a step trace on `b` and the weights (and zero optimizer states, if any).
fn eval_step(trace: &Trace, w: &Weights, b: &Batch) -> Vec<HostTensor> {
    let mut inputs = Vec::new();
    for inp in &trace.inputs {
        let ty = trace.ty(inp.value);
        inputs.push(match inp.name.as_str() {
            "tokens" => host::from_i64s(&[b.batch, b.seq], &b.tokens).unwrap(),
            "targets" => host::from_i64s(&[b.batch * b.seq], &b.targets).unwrap(),
            n => w.tensors.iter().find(|(k, _)| k == n).map(|(_, t)| t.clone()).unwrap_or_else(|| host::zeros(ty)),
        });
    }
    eval(trace, &inputs).unwrap()
}

#[test]
fn the_smallest_bucket_that_holds_a_batch_is_chosen() {
    let shape = |batch, seq| BucketShape { batch, seq };
    let b = Buckets::new(vec![shape(2, 32), shape(4, 16), shape(2, 16)]).unwrap();
    assert_eq!(b.shapes(), &[shape(2, 16), shape(4, 16), shape(2, 32)]);
    assert_eq!(b.choose(2, 16).unwrap(), 0);
    assert_eq!(b.choose(1, 5).unwrap(), 0);
    assert_eq!(b.choose(3, 10).unwrap(), 1);
    assert_eq!(b.choose(2, 17).unwrap(), 2);
    assert_eq!(b.max(), shape(4, 32));
    let e = b.choose(3, 17).unwrap_err().to_string();
    assert!(e.contains("(3, 17)") && e.contains("(2, 32)"), "{e}");
    assert!(b.choose(0, 4).is_err());
    assert_eq!(Buckets::seqs(8, "512, 128,256").unwrap().shapes()[0], shape(8, 128));
    assert!(Buckets::seqs(8, "128,x").unwrap_err().to_string().contains("`x`"));
    assert!(Buckets::seqs(8, "128,128").unwrap_err().to_string().contains("twice"));
    assert!(Buckets::new(vec![]).is_err() && Buckets::new(vec![shape(0, 4)]).is_err());
}

#[test]
fn padding_fills_rows_ends_and_extra_rows() {
    let b = Batch { batch: 2, seq: 2, tokens: vec![5, 6, 7, 8], targets: vec![6, 9, 8, 1] };
    let p = pad_batch(&b, BucketShape { batch: 3, seq: 3 }).unwrap();
    let z = PAD_TOKEN;
    assert_eq!(p.tokens, vec![5, 6, z, 7, 8, z, z, z, z]);
    assert_eq!(p.targets, vec![6, 9, -100, 8, 1, -100, -100, -100, -100]);
    assert!(pad_batch(&b, BucketShape { batch: 1, seq: 3 }).is_err());
}

#[test]
fn padded_loss_and_gradients_equal_the_unpadded_ones() {
    let cfg = small_cfg();
    let w = Weights::init(&cfg, 3).unwrap();
    let mut rng = Rng::new(11);
    for fused in [false, true] {
        for (b, t, to) in [(2, 11, BucketShape { batch: 2, seq: 16 }), (1, 7, BucketShape { batch: 3, seq: 12 })] {
            let data = batch(&mut rng, cfg.vocab_size, b, t);
            let exact = build_train_step(&cfg, &sc(b, t, None, fused)).unwrap().trace;
            let padded = build_train_step(&cfg, &sc(to.batch, to.seq, None, fused)).unwrap().trace;
            let want = eval_step(&exact, &w, &data);
            let got = eval_step(&padded, &w, &pad_batch(&data, to).unwrap());
            assert_eq!(exact.outputs.len(), padded.outputs.len());
            let mut worst: f64 = 0.0;
            for ((o, g), x) in exact.outputs.iter().zip(&got).zip(&want) {
                let e = rel(g, x);
                assert!(e < 1e-5, "fused {fused} ({b}, {t}) -> {to}: {} differs by {e:.2e}", o.name);
                worst = worst.max(e);
            }
            let loss = want[0].to_f64()[0];
            println!(
                "fused {fused}: ({b}, {t}) padded to {to}: loss {loss:.6}, worst relative error {worst:.2e} over {} outputs",
                want.len()
            );
            assert!(loss > 4.0 && loss.is_finite(), "loss {loss}");
            // The check is sensitive: padded positions that were not ignored change the loss.
            let mut leaky = pad_batch(&data, to).unwrap();
            leaky.targets.iter_mut().filter(|x| **x == -100).for_each(|x| *x = 1);
            let wrong = eval_step(&padded, &w, &leaky)[0].to_f64()[0];
            assert!((wrong - loss).abs() > 1e-4, "padding not ignored still gives {wrong} vs {loss}");
        }
    }
}

#[test]
fn pad_data_pads_tokens_and_targets_and_checks_shapes() {
    let buckets = Buckets::seqs(2, "8,16").unwrap();
    let names: Vec<String> = ["tokens", "targets", "lr"].iter().map(|s| s.to_string()).collect();
    let data = vec![
        host::from_i64s(&[2, 9], &[3; 18]).unwrap(),
        host::from_i64s(&[18], &[4; 18]).unwrap(),
        host::scalar_f32(0.5),
    ];
    let (k, p) = pad_data(&buckets, &names, &data).unwrap();
    assert_eq!(k, 1);
    assert_eq!((p[0].ty.dims(), p[1].ty.dims(), &p[2]), (&[2usize, 16][..], &[32usize][..], &data[2]));
    assert_eq!(p[1].to_i64().iter().filter(|&&x| x == -100).count(), 14);
    let bad = vec![data[0].clone(), host::from_i64s(&[17], &[4; 17]).unwrap(), data[2].clone()];
    assert!(pad_data(&buckets, &names, &bad).unwrap_err().to_string().contains("targets"));
    let big =
        vec![host::from_i64s(&[2, 17], &[3; 34]).unwrap(), host::from_i64s(&[34], &[4; 34]).unwrap(), data[2].clone()];
    assert!(pad_data(&buckets, &names, &big).unwrap_err().to_string().contains("(2, 17)"));
}

#[test]
fn bucketed_executor_trains_as_exact_shapes_do() {
    let cfg = small_cfg();
    let w = Weights::init(&cfg, 5).unwrap();
    let opt = Optimizer::Sgd { momentum: 0.9, weight_decay: 0.0 };
    let buckets = Buckets::seqs(2, "8,16").unwrap();
    let traces: Vec<Trace> = buckets
        .shapes()
        .iter()
        .map(|s| build_train_step(&cfg, &sc(s.batch, s.seq, Some(opt), true)).unwrap().trace)
        .collect();
    let step0 = build_train_step(&cfg, &sc(2, 8, Some(opt), true)).unwrap();
    let mut start = w.tensors.clone();
    start.extend(step0.states.iter().map(|(n, ty)| (n.clone(), host::zeros(ty))));
    let mut bucketed = BucketedExecutor::new(buckets, traces, start.clone(), DeviceKind::Cpu).unwrap();
    // The reference: a fresh executor of each step's exact shape, given the current state.
    let mut state = start;
    let mut rng = Rng::new(21);
    let shapes = [(2, 13), (2, 8), (1, 5), (2, 16), (2, 3), (1, 16)];
    for (i, &(b, t)) in shapes.iter().enumerate() {
        let d = batch(&mut rng, cfg.vocab_size, b, t);
        let data = vec![
            host::from_i64s(&[b, t], &d.tokens).unwrap(),
            host::from_i64s(&[b * t], &d.targets).unwrap(),
            host::scalar_f32(0.1),
        ];
        let exact = build_train_step(&cfg, &sc(b, t, Some(opt), true)).unwrap();
        assert_eq!(exact.data_inputs, ["tokens", "targets", "lr"]);
        let mut reference = CpuExecutor::new(exact.trace, state).unwrap();
        let want = reference.step(&data).unwrap();
        state = reference.persistent_values().unwrap();
        let got = bucketed.step(&data).unwrap();
        let e = rel(&got[0], &want[0]);
        assert!(e < 1e-5, "step {i} ({b}, {t}): loss {:?} vs {:?}", got[0].to_f64(), want[0].to_f64());
        println!("step {i} ({b}, {t}): loss {:.6}, relative error {e:.2e}", want[0].to_f64()[0]);
    }
    let mut worst: f64 = 0.0;
    let got: std::collections::HashMap<_, _> = bucketed.persistent_values().unwrap().into_iter().collect();
    for (name, want) in &state {
        let e = rel(&got[name], want);
        assert!(e < 1e-5, "{name} differs by {e:.2e} after {} steps", shapes.len());
        worst = worst.max(e);
    }
    println!("{} parameters and states agree after {} steps (worst {worst:.2e})", state.len(), shapes.len());
    let reports = bucketed.buckets();
    assert_eq!(reports.iter().map(|r| r.steps).collect::<Vec<_>>(), vec![3, 3]);
}

#[test]
fn the_trainer_takes_batches_of_changing_length() {
    let cfg = small_cfg();
    let s = sc(2, 16, Some(Optimizer::adamw()), true);
    let buckets = Buckets::seqs(2, "8,16").unwrap();
    let schedule = LrSchedule::constant(3e-3);
    let w = Weights::init(&cfg, 1).unwrap();
    let opts = rumble_core::compile::CompileOptions::default();
    let mut tr =
        Trainer::with_buckets(cfg.clone(), s.clone(), buckets.clone(), w.clone(), schedule, DeviceChoice::Cpu, &opts)
            .unwrap();
    let mut rng = Rng::new(2);
    for t in [5, 16, 9, 8] {
        let st = tr.step(&[batch(&mut rng, cfg.vocab_size, 2, t)]).unwrap();
        assert!(st.loss.is_finite() && st.tokens == 2 * t, "{st:?}");
    }
    assert_eq!(tr.bucket_reports().iter().map(|r| r.steps).sum::<usize>(), 4);
    assert_eq!(tr.weights().unwrap().tensors.len(), w.tensors.len());
    let e = tr.step(&[batch(&mut rng, cfg.vocab_size, 2, 17)]).unwrap_err().to_string();
    assert!(e.contains("(2, 17)"), "{e}");
    let sum = StepConfig { objective: Objective::LogitsSum, ..s };
    let e = Trainer::with_buckets(cfg, sum, buckets, w, schedule, DeviceChoice::Cpu, &opts).err().expect("refused");
    assert!(e.to_string().contains("causal-LM"), "{e}");
}
