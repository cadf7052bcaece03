//! `rumble train`: builds the step, runs it on the chosen device over corpus windows, shows a
//! progress bar (or prints JSON lines), and writes a checkpoint and a loss log.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use rumble_models::rng::Rng;
use rumble_models::{Buckets, Corpus, DeviceChoice, LrSchedule, ModelError, Result, ScheduleKind, Trainer, Weights};
use serde_json::json;

use crate::common::{ModelArgs, human};

/// The corpus shipped in the repository (data/corpus.txt), built into the binary.
const CORPUS: &[u8] = include_bytes!("../../../data/corpus.txt");

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    Constant,
    Cosine,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Optimizer steps to take.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Peak learning rate (default: the preset's).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Learning-rate schedule after warmup.
    #[arg(long, value_enum, default_value_t = ScheduleArg::Cosine)]
    pub schedule: ScheduleArg,
    /// Warmup steps (default: a tenth of the steps, at most 100).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// cpu, cuda or auto (cuda when usable, else cpu).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Start from these weights instead of a random initialisation.
    #[arg(long, value_name = "CHECKPOINT.safetensors")]
    pub init_from: Option<PathBuf>,
    /// Text to train on, read as bytes (default: the shipped corpus).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Where the checkpoint and the loss log go (default: runs/<model>).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Seed of the initialisation and of the batch sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object a line (a `step` line per logged step) instead of a progress bar.
    #[arg(long)]
    pub json: bool,
    /// Log every N steps (the loss log and --json lines; the first and last step always).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub log_every: u64,
    /// Shape buckets: sequence lengths (e.g. 128,256,512), one compiled step (one CUDA graph
    /// set, captured on first use, all sharing one arena) per length. Each step then samples
    /// windows of a length drawn uniformly from 1 to the largest bucket, padded up to the
    /// smallest bucket that holds it (padded targets are ignored by the loss). Replaces --seq.
    #[arg(long, value_name = "SEQ,SEQ,...")]
    pub buckets: Option<String>,
    /// Every N steps print a short greedy sample after --prompt (CPU, byte-level models).
    #[arg(long, value_name = "N", requires = "prompt")]
    pub sample_every: Option<u64>,
    /// The prompt of --sample-every's samples.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
}

pub fn run(a: TrainArgs) -> Result<()> {
    let device: DeviceChoice = a.device.parse()?;
    let r = a.model.resolve(a.init_from.as_deref())?;
    let cfg = r.config.clone();
    let corpus = match &a.data {
        Some(p) => Corpus::from_file(p)?,
        None => Corpus::new(CORPUS.to_vec()),
    };
    if cfg.vocab_size < 256 {
        return Err(ModelError::Usage(format!(
            "byte-level training needs a vocabulary of at least 256, `{}` has {}",
            r.name, cfg.vocab_size
        )));
    }
    let weights = match &a.init_from {
        Some(p) => Weights::load(p, &cfg)?,
        None => Weights::init(&cfg, a.seed)?,
    };
    let lr = a.lr.unwrap_or(r.lr);
    let schedule = LrSchedule {
        peak: lr,
        warmup: a.warmup.unwrap_or((a.steps / 10).min(100)),
        total: a.steps,
        kind: match a.schedule {
            ScheduleArg::Constant => ScheduleKind::Constant,
            ScheduleArg::Cosine => ScheduleKind::Cosine,
        },
    };
    let buckets = match &a.buckets {
        Some(_) if a.model.seq.is_some() => {
            return Err(ModelError::Usage("give --buckets or --seq, not both".into()));
        }
        Some(list) => Some(Buckets::seqs(r.step.batch, list)?),
        None => None,
    };
    let mut trainer = match &buckets {
        Some(b) => Trainer::with_buckets(cfg.clone(), r.step.clone(), b.clone(), weights, schedule, device)?,
        None => Trainer::new(cfg.clone(), r.step.clone(), weights, schedule, device)?,
    };
    // With buckets: the largest bucket's shape.
    let sc = trainer.step_config().clone();
    let bucket_seqs: Vec<usize> = buckets.iter().flat_map(|b| b.shapes().iter().map(|s| s.seq)).collect();
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(&r.name));
    std::fs::create_dir_all(&out).map_err(|e| ModelError::io(&out, e))?;
    let log_path = out.join("loss.jsonl");
    let mut log = std::io::BufWriter::new(std::fs::File::create(&log_path).map_err(|e| ModelError::io(&log_path, e))?);

    let start = json!({
        "event": "start", "model": r.name, "params": cfg.num_params(), "device": trainer.device().to_string(),
        "batch": sc.batch, "seq": sc.seq, "grad_accum": sc.grad_accum, "steps": a.steps,
        "optimizer": sc.optimizer.map(|o| o.name()), "lr": lr, "corpus_bytes": corpus.len(),
        "buckets": bucket_seqs,
    });
    let bar = if a.json {
        println!("{start}");
        ProgressBar::hidden()
    } else {
        eprintln!(
            "training {} ({} parameters) on {}: batch {} x seq {} x {} micro-batch(es), {} steps, {} lr {lr}",
            r.name,
            human(cfg.num_params() as f64),
            trainer.device(),
            sc.batch,
            sc.seq,
            sc.grad_accum,
            a.steps,
            sc.optimizer.map(|o| o.name()).unwrap_or("-"),
        );
        if buckets.is_some() {
            eprintln!("shape buckets: seq {bucket_seqs:?}; each step's length drawn from 1..={}", sc.seq);
        }
        let bar = ProgressBar::new(a.steps);
        let style =
            ProgressStyle::with_template("{bar:30.cyan/blue} {pos:>5}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
                .map_err(|e| ModelError::Usage(e.to_string()))?;
        bar.set_style(style);
        bar
    };

    let mut rng = Rng::for_name(a.seed, "batches");
    let mut lengths = Rng::for_name(a.seed, "lengths");
    let t0 = Instant::now();
    let mut first_loss = None;
    let mut last = None;
    for i in 1..=a.steps {
        let seq = if buckets.is_some() { 1 + lengths.below(sc.seq) } else { sc.seq };
        let batches = (0..sc.grad_accum).map(|_| corpus.sample(&mut rng, sc.batch, seq)).collect::<Result<Vec<_>>>()?;
        let ts = Instant::now();
        let s = trainer.step(&batches)?;
        let dt = ts.elapsed().as_secs_f64();
        let tps = s.tokens as f64 / dt.max(1e-9);
        first_loss.get_or_insert(s.loss);
        if !s.loss.is_finite() {
            bar.abandon();
            return Err(ModelError::Usage(format!("the loss diverged at step {i} ({}); try a lower --lr", s.loss)));
        }
        if i == 1 || i == a.steps || i % a.log_every.max(1) == 0 {
            let mut line = json!({
                "event": "step", "step": s.step, "loss": s.loss, "lr": s.lr, "tokens_per_s": tps.round(),
                "step_ms": (dt * 1e3 * 100.0).round() / 100.0, "elapsed_s": (t0.elapsed().as_secs_f64() * 100.0).round() / 100.0,
            });
            if let Some(g) = s.grad_norm {
                line["grad_norm"] = json!(g);
            }
            if buckets.is_some() {
                line["seq"] = json!(seq);
            }
            writeln!(log, "{line}").map_err(|e| ModelError::io(&log_path, e))?;
            if a.json {
                println!("{line}");
            }
        }
        if let (Some(n), Some(p)) = (a.sample_every, &a.prompt)
            && n > 0
            && (i % n == 0 || i == a.steps)
        {
            let text = crate::generate::sample_text(&cfg, &trainer.weights()?, p, 64)?;
            let line = json!({"event": "sample", "step": i, "prompt": p, "text": text});
            if a.json { println!("{line}") } else { bar.println(format!("step {i}: {p}{text}")) }
        }
        bar.set_message(format!("loss {:.4}  {} tok/s", s.loss, human(tps)));
        bar.inc(1);
        last = Some(s);
    }
    log.flush().map_err(|e| ModelError::io(&log_path, e))?;
    bar.finish();
    trainer.save_checkpoint(&out)?;
    let elapsed = t0.elapsed().as_secs_f64();
    let final_loss = last.map(|s| s.loss);
    let reports: Vec<_> = trainer
        .bucket_reports()
        .iter()
        .map(|b| {
            json!({"batch": b.shape.batch, "seq": b.shape.seq, "steps": b.steps, "captures": b.captures,
                   "capture_s": b.capture_secs, "arena_bytes": b.arena_bytes})
        })
        .collect();
    if a.json {
        println!(
            "{}",
            json!({"event": "done", "first_loss": first_loss, "final_loss": final_loss, "elapsed_s": elapsed,
                   "checkpoint": out.join("model.safetensors"), "config": out.join("config.json"), "loss_log": log_path,
                   "buckets": reports})
        );
    } else {
        eprintln!(
            "loss {:.4} -> {:.4} in {elapsed:.1} s; checkpoint {} (+ config.json), loss log {}",
            first_loss.unwrap_or(f32::NAN),
            final_loss.unwrap_or(f32::NAN),
            out.join("model.safetensors").display(),
            log_path.display()
        );
        for b in trainer.bucket_reports() {
            eprintln!(
                "bucket {}: {} steps, {} capture(s) in {:.1} ms, arena {} bytes",
                b.shape,
                b.steps,
                b.captures,
                b.capture_secs * 1e3,
                b.arena_bytes
            );
        }
    }
    Ok(())
}
