//! Checkpoints a run resumes from: saving and loading continue a run bit for bit (parameters,
//! f32 masters, optimizer state, step, schedule, data position); periodic checkpoints keep the
//! last K; a save cut short is passed over for the newest complete checkpoint.

use std::path::{Path, PathBuf};

use rumble_core::DType;
use rumble_core::cpu::Rng;
use rumble_models::checkpoint::{self, STATE_FILE, TrainerState};
use rumble_models::{
    Config, Corpus, DeviceChoice, LrSchedule, Optimizer, Precision, ScheduleKind, StepConfig, Trainer, Weights, preset,
};
use serde_json::json;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rumble-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn corpus() -> Corpus {
    Corpus::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus.txt")).unwrap()
}

fn setup(precision: Precision) -> (Config, StepConfig, LrSchedule) {
    let cfg = Config { dtype: DType::BF16, ..preset("tiny").unwrap().config };
    let sc = StepConfig {
        optimizer: Some(Optimizer::adamw()),
        clip: Some(1.0),
        precision: Some(precision),
        ..StepConfig::new(2, 16)
    };
    let schedule = LrSchedule { peak: 3e-3, warmup: 3, total: 20, kind: ScheduleKind::Cosine };
    (cfg, sc, schedule)
}

fn state(t: &Trainer, rng: &Rng) -> TrainerState {
    TrainerState {
        step: t.steps_done(),
        precision: t.step_config().precision.map(|p| p.name().to_string()),
        schedule: t.schedule().into(),
        lr: t.schedule().at(t.steps_done()),
        seed: 0,
        data: json!({"batches": rng.state()}),
        args: [("batch".to_string(), json!(2))].into_iter().collect(),
        files: Default::default(),
    }
}

fn steps(t: &mut Trainer, rng: &mut Rng, c: &Corpus, n: usize) -> Vec<(u64, u32, f64)> {
    let sc = t.step_config().clone();
    (0..n)
        .map(|_| {
            let s = t.step(&[c.sample(rng, sc.batch, sc.seq).unwrap()]).unwrap();
            (s.step, s.loss.to_bits(), s.lr)
        })
        .collect()
}

fn resume_matches_one_run(precision: Precision) {
    let (cfg, sc, schedule) = setup(precision);
    let c = corpus();
    let w = Weights::init(&cfg, 0).unwrap();
    let mut one = Trainer::new(cfg.clone(), sc.clone(), w.clone(), schedule, DeviceChoice::Cpu).unwrap();
    let mut rng = Rng::new(5);
    let straight = steps(&mut one, &mut rng, &c, 20);

    let dir = tmp(&format!("resume-{precision}"));
    let mut first = Trainer::new(cfg.clone(), sc.clone(), w, schedule, DeviceChoice::Cpu).unwrap();
    let mut rng = Rng::new(5);
    let mut halves = steps(&mut first, &mut rng, &c, 10);
    checkpoint::save(&dir, &first, &state(&first, &rng)).unwrap();
    drop(first);

    let newest = checkpoint::newest(&dir).unwrap();
    assert_eq!((newest.dir.as_path(), newest.state.step), (dir.as_path(), 10));
    let loaded = checkpoint::load(&dir, &Config::from_file(&dir.join("config.json")).unwrap()).unwrap();
    let sched = newest.state.schedule.schedule(20).unwrap();
    assert_eq!(sched, schedule);
    let mut second = Trainer::new(cfg.clone(), sc, loaded, sched, DeviceChoice::Cpu).unwrap();
    second.set_steps_done(newest.state.step);
    let mut rng = Rng::from_state(&newest.state.data["batches"]).unwrap();
    halves.extend(steps(&mut second, &mut rng, &c, 10));
    assert_eq!(straight, halves, "{precision}: 20 steps and 10 + 10 resumed differ");
    assert_eq!(one.weights().unwrap(), second.weights().unwrap());
    assert_eq!(one.optimizer_states().unwrap(), second.optimizer_states().unwrap());
    // The model folder is in the config's dtype; the exact masters ride in the optimizer file.
    let model = rumble_models::weights::read_safetensors(&dir.join("model.safetensors")).unwrap();
    assert!(model.iter().all(|(_, t)| t.ty.dtype == DType::BF16));
    let opt = rumble_models::weights::read_safetensors(&dir.join(checkpoint::OPTIMIZER_FILE)).unwrap();
    let masters = opt.iter().filter(|(n, _)| n.starts_with(checkpoint::MASTER_PREFIX)).count();
    assert_eq!(masters > 0, precision == Precision::Bf16Mixed, "{precision}: {masters} masters stored");
    assert!(opt.iter().all(|(_, t)| t.ty.dtype == precision.master()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_is_bit_identical_under_bf16_mixed() {
    resume_matches_one_run(Precision::Bf16Mixed);
}

#[test]
fn resume_is_bit_identical_under_bf16_true() {
    resume_matches_one_run(Precision::Bf16True);
}

#[test]
fn periodic_checkpoints_keep_the_last_k_and_a_torn_save_is_passed_over() {
    let (cfg, sc, schedule) = setup(Precision::Bf16Mixed);
    let c = corpus();
    let mut t = Trainer::new(cfg.clone(), sc, Weights::init(&cfg, 0).unwrap(), schedule, DeviceChoice::Cpu).unwrap();
    let mut rng = Rng::new(1);
    let out = tmp("keep");
    for _ in 0..4 {
        steps(&mut t, &mut rng, &c, 1);
        let d = checkpoint::save_step(&out, &t, &state(&t, &rng), Some(2)).unwrap();
        assert!(d.join(STATE_FILE).is_file() && d.join("model.safetensors").is_file());
    }
    let kept: Vec<u64> = checkpoint::step_dirs(&out).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(kept, vec![3, 4]);
    let hidden: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "temporary folders left behind: {hidden:?}");

    // A root save at step 5 whose model file was then cut short (a kill during the save).
    steps(&mut t, &mut rng, &c, 1);
    checkpoint::save(&out, &t, &state(&t, &rng)).unwrap();
    assert_eq!(checkpoint::newest(&out).unwrap().state.step, 5);
    let model = out.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let n = checkpoint::newest(&out).unwrap();
    assert_eq!((n.state.step, n.dir.file_name().unwrap().to_str().unwrap()), (4, "checkpoint-4"));
    assert!(n.skipped.iter().any(|w| w.contains("model.safetensors") && w.contains("cut short")), "{:?}", n.skipped);
    // ... and the checkpoint it picks loads.
    checkpoint::load(&n.dir, &cfg).unwrap();

    let none = tmp("none");
    std::fs::create_dir_all(&none).unwrap();
    let e = checkpoint::newest(&none).unwrap_err().to_string();
    assert!(e.contains("no complete checkpoint"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&none);
}

#[test]
fn mismatched_arguments_are_named() {
    let a = [("batch".to_string(), json!(8)), ("lr".to_string(), json!(0.003))].into_iter().collect();
    let b = [("batch".to_string(), json!(8)), ("lr".to_string(), json!(0.01))].into_iter().collect();
    assert_eq!(checkpoint::mismatches(&a, &b), vec!["lr: 0.003 -> 0.01".to_string()]);
    assert!(checkpoint::mismatches(&a, &a).is_empty());
}
