//! `rumble train`: builds the step, runs it on the chosen device over corpus windows, shows a
//! progress bar (or prints JSON lines), and writes a checkpoint and a loss log.
//!
//! Every input is checked before the run folder is touched, and the folder before the first
//! step (`rundir.rs`). A step with a non-finite loss stops the run before any checkpoint. A
//! closed or full stdout stops the run too, after saving the checkpoint of the steps taken.
//!
//! Starting from a Hugging Face model folder (`--init-from DIR`: config.json, the weights,
//! single or sharded, and the tokenizer), `--data` text or JSONL documents are tokenized and
//! packed ([`rumble_models::Dataset`]); the checkpoint folder gets the tokenizer files copied
//! along. Without a tokenizer.json (the tiny preset) text is read as bytes, as before.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use rumble_core::cpu::Rng;
use rumble_models::data::Batch;
use rumble_models::folder::copy_tokenizer_files;
use rumble_models::{
    Buckets, Corpus, Dataset, DeviceChoice, Document, Loader, LrSchedule, ModelError, Result, ScheduleKind, Tokenizer,
    Trainer, Validation, Weights,
};
use serde_json::json;

use crate::common::{ModelArgs, human};
use crate::rundir::{RunDir, RunDirArgs};
use crate::{note, output};

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
    /// Start from these weights instead of a random initialisation: a Hugging Face model
    /// folder (config.json, model.safetensors or model.safetensors.index.json with its shards,
    /// tokenizer.json) or a .safetensors file (its folder's config.json is used).
    #[arg(long, value_name = "DIR|FILE.safetensors")]
    pub init_from: Option<PathBuf>,
    /// Data to train on: a JSONL file (`text`, or `prompt` and `response` with the loss on the
    /// response) or a text file, tokenized with the model folder's tokenizer.json (bytes
    /// without one). Default: the shipped corpus.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Validation documents (text or JSONL, as --data).
    #[arg(long, value_name = "FILE", conflicts_with = "val_fraction")]
    pub val_data: Option<PathBuf>,
    /// Hold out this fraction of the --data documents for validation (0 < F < 1).
    #[arg(long, value_name = "F")]
    pub val_fraction: Option<f64>,
    /// Where the checkpoint and the loss log go (default: runs/<model>). Must be empty or
    /// absent unless --overwrite or --resume.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub run_dir: RunDirArgs,
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
    /// The memory policy of the compiled step: bytes (`12GB`), `auto`, `min` or `fastest`
    /// (the default); see `rumble plan --memory-budget`.
    #[arg(long, value_name = "BYTES|auto|min", default_value = "fastest", value_parser = crate::plan::parse_budget)]
    pub memory_budget: rumble_core::compile::Budget,
    /// Every N steps print a short greedy sample after --prompt (CPU, byte-level models).
    #[arg(long, value_name = "N", requires = "prompt")]
    pub sample_every: Option<u64>,
    /// The prompt of --sample-every's samples.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
}

pub fn run(a: TrainArgs) -> Result<()> {
    if a.steps == 0 {
        return Err(ModelError::Usage("--steps must be at least 1".into()));
    }
    if a.run_dir.resume.is_some() {
        return Err(ModelError::Usage(
            "--resume: continuing a run from its checkpoint is not in this build yet (it comes with --save-every)"
                .into(),
        ));
    }
    let device: DeviceChoice = a.device.parse()?;
    // A folder's config.json is found as the sibling of a file in it.
    let beside = a.init_from.as_ref().map(|p| if p.is_dir() { p.join("config.json") } else { p.clone() });
    let r = a.model.resolve(beside.as_deref())?;
    let cfg = r.config.clone();
    let out = a.run_dir.folder(a.out.as_deref(), PathBuf::from("runs").join(&r.name))?;
    let mode = a.run_dir.mode();
    crate::rundir::check(&out, mode, a.init_from.as_deref())?;
    let model_dir = model_folder(a.init_from.as_deref(), a.model.config.as_deref());
    let tokenizer = match &model_dir {
        Some(d) => Tokenizer::from_folder(d)?,
        None => Tokenizer::bytes(),
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
    // Refused up front: windows longer than the data, hyper-parameters out of their domain,
    // parameters and optimizer state larger than the memory free.
    let longest = buckets.iter().flat_map(|b| b.shapes().iter().map(|s| s.seq)).max().unwrap_or(r.step.seq);
    if let Some(b) = &buckets {
        for s in b.shapes() {
            cfg.check_step_sizes(s.batch, s.seq, r.step.grad_accum)?;
        }
    }
    // The data is read (and its windows checked) before anything is allocated for the step.
    let mut data = DataSource::new(&a, &tokenizer, cfg.vocab_size, longest, &r.name)?;
    data.check_window(longest)?;
    rumble_models::trainer::check_hyper(&r.step, &schedule)?;
    crate::common::check_weights_fit(&r)?;
    crate::common::check_step_fits(&r, true)?;
    let weights = match &a.init_from {
        Some(p) => Weights::load(p, &cfg)?,
        None => Weights::init(&cfg, a.seed)?,
    };
    let opts = rumble_core::compile::CompileOptions { budget: a.memory_budget, ..Default::default() };
    let mut trainer = match &buckets {
        Some(b) => {
            Trainer::with_buckets_options(cfg.clone(), r.step.clone(), b.clone(), weights, schedule, device, &opts)?
        }
        None => Trainer::with_options(cfg.clone(), r.step.clone(), weights, schedule, device, &opts)?,
    };
    // With buckets: the largest bucket's shape.
    let sc = trainer.step_config().clone();
    let bucket_seqs: Vec<usize> = buckets.iter().flat_map(|b| b.shapes().iter().map(|s| s.seq)).collect();
    let mut run_dir = RunDir::open(&out, mode, a.init_from.as_deref())?;
    if run_dir.removed_temps > 0 {
        note!("removed {} temporary file(s) of killed runs from {}", run_dir.removed_temps, out.display());
    }
    let log_path = run_dir.log.path.clone();

    let mut start = json!({
        "event": "start", "model": r.name, "params": cfg.num_params(), "device": trainer.device().to_string(),
        "batch": sc.batch, "seq": sc.seq, "grad_accum": sc.grad_accum, "steps": a.steps,
        "optimizer": sc.optimizer.map(|o| o.name()), "lr": lr, "buckets": bucket_seqs,
    });
    data.describe(&mut start, &tokenizer);
    let bar = if a.json {
        output::line(&start)?;
        ProgressBar::hidden()
    } else {
        note!(
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
            note!("shape buckets: seq {bucket_seqs:?}; each step's length drawn from 1..={}", sc.seq);
        }
        let bar = ProgressBar::new(a.steps);
        let style =
            ProgressStyle::with_template("{bar:30.cyan/blue} {pos:>5}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
                .map_err(|e| ModelError::Usage(e.to_string()))?;
        bar.set_style(style);
        bar
    };

    let mut lengths = Rng::for_name(a.seed, "lengths");
    let t0 = Instant::now();
    let mut first_loss = None;
    let mut last = None;
    // A failed write to stdout or the log stops the run; the checkpoint is still saved.
    let mut stopped: Option<ModelError> = None;
    for i in 1..=a.steps {
        let seq = if buckets.is_some() { 1 + lengths.below(sc.seq) } else { sc.seq };
        let batches = (0..sc.grad_accum).map(|_| data.next(sc.batch, seq)).collect::<Result<Vec<_>>>()?;
        let ts = Instant::now();
        let s = trainer.step(&batches)?;
        let dt = ts.elapsed().as_secs_f64();
        let tps = s.tokens as f64 / dt.max(1e-9);
        first_loss.get_or_insert(s.loss);
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
            let written =
                run_dir.log.line(&line.to_string()).and_then(|_| if a.json { output::line(&line) } else { Ok(()) });
            if let Err(e) = written {
                stopped = Some(e);
                last = Some(s);
                break;
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
    bar.finish();
    trainer.save_checkpoint(&out)?;
    if let Some(d) = &model_dir {
        copy_tokenizer_files(d, &out)?;
    }
    if let Some(e) = stopped {
        note!("stopped after step {} ({e}); checkpoint of that step saved in {}", trainer.steps_done(), out.display());
        return Err(e);
    }
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
        output::line(
            json!({"event": "done", "first_loss": first_loss, "final_loss": final_loss, "elapsed_s": elapsed,
                   "checkpoint": out.join("model.safetensors"), "config": out.join("config.json"), "loss_log": log_path,
                   "buckets": reports}),
        )?;
    } else {
        note!(
            "loss {:.4} -> {:.4} in {elapsed:.1} s; checkpoint {} (+ config.json), loss log {}",
            first_loss.unwrap_or(f32::NAN),
            final_loss.unwrap_or(f32::NAN),
            out.join("model.safetensors").display(),
            log_path.display()
        );
        for b in trainer.bucket_reports() {
            note!(
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

/// The model folder whose tokenizer files a run uses and copies along: `--init-from`'s folder
/// (or the folder of its file), else `--config`'s folder.
fn model_folder(init_from: Option<&std::path::Path>, config: Option<&str>) -> Option<PathBuf> {
    let dir_of = |p: &std::path::Path| -> Option<PathBuf> {
        if p.is_dir() {
            Some(p.to_path_buf())
        } else if p.is_file() {
            p.parent().map(|d| if d.as_os_str().is_empty() { PathBuf::from(".") } else { d.to_path_buf() })
        } else {
            None
        }
    };
    init_from.and_then(dir_of).or_else(|| config.map(std::path::Path::new).and_then(dir_of))
}

/// Where batches come from: random windows of a byte corpus (the tiny preset's text), or
/// packed documents through a tokenizer.
enum DataSource {
    Corpus { corpus: Corpus, name: String, rng: Rng },
    Packed { train: Loader, val: Option<Loader> },
}

impl DataSource {
    fn new(a: &TrainArgs, tok: &Tokenizer, vocab: usize, seq: usize, model: &str) -> Result<DataSource> {
        let validation = match (&a.val_data, a.val_fraction) {
            (Some(p), _) => Validation::File(p.clone()),
            (None, Some(f)) => Validation::Fraction(f),
            (None, None) => Validation::None,
        };
        let jsonl = a.data.as_ref().is_some_and(|p| p.extension().is_some_and(|e| e == "jsonl"));
        if tok.is_bytes() && !jsonl && validation == Validation::None {
            if vocab < 256 {
                return Err(ModelError::Usage(format!(
                    "byte-level training needs a vocabulary of at least 256, `{model}` has {vocab}"
                )));
            }
            let corpus = match &a.data {
                Some(p) => Corpus::from_file(p)?,
                None => Corpus::new(CORPUS.to_vec()),
            };
            let name = a.data.as_ref().map_or("the shipped corpus".to_string(), |p| p.display().to_string());
            return Ok(DataSource::Corpus { corpus, name, rng: Rng::for_name(a.seed, "batches") });
        }
        let Dataset { train, val } = match &a.data {
            Some(path) => Dataset::load(path, &validation, tok, seq, vocab, a.seed)?,
            None => {
                // The shipped corpus as one document, through the model's tokenizer.
                let doc = Document::Text(String::from_utf8_lossy(CORPUS).into_owned());
                Dataset::new(vec![doc], "the shipped corpus", &validation, tok, seq, vocab, a.seed)?
            }
        };
        Ok(DataSource::Packed { train, val })
    }

    /// Refuses windows of `seq` tokens longer than a byte corpus (packed documents are checked
    /// when they are loaded).
    fn check_window(&self, seq: usize) -> Result<()> {
        match self {
            DataSource::Corpus { corpus, name, .. } => corpus.check_window(seq, name),
            DataSource::Packed { .. } => Ok(()),
        }
    }

    /// One micro-batch of `batch` rows of `seq` tokens (packed windows are cut to `seq`, for
    /// shape buckets).
    fn next(&mut self, batch: usize, seq: usize) -> Result<Batch> {
        match self {
            DataSource::Corpus { corpus, rng, .. } => corpus.sample(rng, batch, seq),
            DataSource::Packed { train, .. } => {
                let b = train.next_batch(batch);
                if b.seq == seq {
                    return Ok(b);
                }
                let cut = |v: &[i64]| v.chunks(b.seq).flat_map(|row| row[..seq].to_vec()).collect();
                Ok(Batch { batch, seq, tokens: cut(&b.tokens), targets: cut(&b.targets) })
            }
        }
    }

    /// Adds what the data is to the start line.
    fn describe(&self, start: &mut serde_json::Value, tok: &Tokenizer) {
        match self {
            DataSource::Corpus { corpus, .. } => start["corpus_bytes"] = json!(corpus.len()),
            DataSource::Packed { train, val } => {
                start["tokenizer"] = json!(tok.file().map(|f| f.display().to_string()).unwrap_or("bytes".into()));
                start["data_tokens"] = json!(train.tokens());
                start["data_windows"] = json!(train.windows());
                if let Some(v) = val {
                    start["val_tokens"] = json!(v.tokens());
                    start["val_windows"] = json!(v.windows());
                }
            }
        }
    }
}
