//! `rumble train`: builds the step, runs it on the chosen device over corpus windows, shows a
//! progress bar (or prints JSON lines, or off a terminal one plain line per logged step), and
//! writes a checkpoint and a loss log.
//!
//! Every input is checked before the run folder is touched, and the folder before the first
//! step (`rundir.rs`). A step with a non-finite loss stops the run before any checkpoint. A
//! closed or full stdout stops the run too, after saving the checkpoint of the steps taken.
//!
//! Starting from a Hugging Face model folder (`--init-from DIR`: config.json, the weights,
//! single or sharded, and the tokenizer), `--data` text or JSONL documents are tokenized and
//! packed ([`rumble_models::Dataset`]); the checkpoint folder gets the tokenizer files copied
//! along. Without a tokenizer.json (the tiny preset) text is read as bytes, as before.
//!
//! Runs that lose nothing: `--save-every N` writes `OUT/checkpoint-STEP/` folders (the last
//! `--keep-last K` kept), SIGINT/SIGTERM finish the step, save at OUT's root and exit non-zero,
//! and `--resume DIR` continues the run in DIR from its newest complete checkpoint
//! (`rumble_models::checkpoint`) bit for bit: parameters, optimizer state, step, schedule and
//! the data position.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use rumble_core::cpu::Rng;
use rumble_core::passes::data_parallel::{DataParallel, Mode};
use rumble_models::checkpoint::{self, TrainerState};
use rumble_models::data::Batch;
use rumble_models::folder::copy_tokenizer_files;
use rumble_models::{
    Buckets, DeviceChoice, DeviceKind, LrSchedule, ModelError, Precision, Result, ScheduleKind, Tokenizer, Trainer,
    Weights,
};
use serde_json::{Value, json};

use crate::common::{ModelArgs, human};
use crate::launch::LaunchSource;
use crate::rundir::{RunDir, RunDirArgs};
use crate::train_data::DataSource;
use crate::{note, output};

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
    /// Data-parallel training on N GPUs of this host, one process each, --batch rows split
    /// over them (under torchrun, whose RANK, WORLD_SIZE, ... are read instead, leave it out;
    /// on the CPU, start the ranks that way).
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,
    /// Build the step as the one rank of a one-rank data-parallel (DDP) program, as each rank
    /// of --gpus N does: its collectives are identities on the CPU and run through NCCL on
    /// CUDA (which must then load). Losses and weights are those of the plain step, bit for bit.
    #[arg(long)]
    pub data_parallel: bool,
    /// ZeRO stage 1: each rank keeps 1/N of the optimizer state (gradients reduce-scattered,
    /// parameters all-gathered); checkpoints still hold the whole state. Implies
    /// --data-parallel.
    #[arg(long)]
    pub zero1: bool,
    /// Start from these weights instead of a random initialisation.
    #[arg(long, value_name = "CHECKPOINT.safetensors")]
    pub init_from: Option<PathBuf>,
    /// Text to train on, read as bytes (default: the shipped corpus).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
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

    /// Validation documents (text or JSONL, as --data).
    #[arg(long, value_name = "FILE", conflicts_with = "val_fraction")]
    pub val_data: Option<PathBuf>,
    /// Hold out this fraction of the --data documents for validation (0 < F < 1).
    #[arg(long, value_name = "F")]
    pub val_fraction: Option<f64>,
    /// Every N steps print a short greedy sample after --prompt (64 tokens, with the run's
    /// tokenizer; computed on the CPU, so slow for large models).
    #[arg(long, value_name = "N", requires = "prompt")]
    pub sample_every: Option<u64>,
    /// The prompt of --sample-every's samples.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,

    // Saving, resuming, validation (--precision is with the model's flags).
    /// Save a checkpoint every N steps into OUT/checkpoint-STEP/ (the model folder, the
    /// optimizer state and trainer_state.json), each written whole before it appears.
    #[arg(long, value_name = "N")]
    pub save_every: Option<u64>,
    /// Keep only the newest K checkpoint-STEP folders (default: all).
    #[arg(long, value_name = "K")]
    pub keep_last: Option<usize>,
    /// Report the validation loss every N steps (and after the last), on the held-out last
    /// tenth of the corpus (then not trained on).
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub eval_batches: usize,
}

/// What the run's timed steps did, for the `done` line: every step but the run's first (which
/// captures the CUDA graphs) when there are several, so the figures are the steady state.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Throughput {
    steps: u64,
    tokens: f64,
    /// Model FLOPs ([`crate::suite::flops_per_step`]) of those steps.
    flops: f64,
    secs: f64,
    /// The run's first step, kept apart until a second one comes.
    first: Option<(f64, f64, f64)>,
}

impl Throughput {
    fn add(&mut self, tokens: f64, flops: f64, secs: f64) {
        if self.first.is_none() && self.steps == 0 {
            self.first = Some((tokens, flops, secs));
            return;
        }
        self.steps += 1;
        (self.tokens, self.flops, self.secs) = (self.tokens + tokens, self.flops + flops, self.secs + secs);
    }

    /// `(tokens per second, model FLOPs per second)` over the timed steps (the first step alone
    /// when it is the only one); `None` before any step.
    fn rates(&self) -> Option<(f64, f64)> {
        let (t, f, s) = if self.steps > 0 { (self.tokens, self.flops, self.secs) } else { self.first? };
        Some((t / s.max(1e-9), f / s.max(1e-9)))
    }

    /// The `done` line's `tokens_per_s`, `peak_bytes` (the device's arena and persistent region,
    /// `None` off a GPU) and `mfu` (model FLOP/s over `peak_flops`, the device's dense bf16
    /// peak; `None` off a GPU or for a step not computed in bf16).
    fn done_fields(&self, peak_bytes: Option<usize>, peak_flops: Option<f64>) -> serde_json::Value {
        let rates = self.rates();
        json!({
            "tokens_per_s": rates.map(|(t, _)| t.round()),
            "timed_steps": if self.steps > 0 { self.steps } else { u64::from(self.first.is_some()) },
            "peak_bytes": peak_bytes,
            "mfu": rates.zip(peak_flops).map(|((_, f), p)| (f / p * 1e4).round() / 1e4),
        })
    }
}

/// The dense bf16 tensor-core peak (FLOP/s) of a device, from NVIDIA's data sheets, by name;
/// `None` for devices not listed (no MFU is shown then).
fn bf16_peak(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    let sheet: [(&str, f64); 5] =
        [("H200", 989.4e12), ("H100 PCIE", 756.0e12), ("H100", 989.4e12), ("A100", 312.0e12), ("L40S", 362.1e12)];
    sheet.iter().find(|(k, _)| n.contains(k)).map(|&(_, v)| v)
}

/// Checks that every rank of a run was given the flags that shape it (`args`): rank 0 gathers
/// them and names the first rank whose differ, and what; every rank then stops with an error.
fn agree_on_flags(g: &rumble_models::group::Group, args: &BTreeMap<String, Value>) -> Result<()> {
    let mine = serde_json::to_vec(args).map_err(|e| ModelError::Usage(format!("the run's flags: {e}")))?;
    let mut why = None;
    if let Some(all) = g.gather(&mine)? {
        for (r, theirs) in all.iter().enumerate().skip(1) {
            let theirs: BTreeMap<String, Value> = serde_json::from_slice(theirs).unwrap_or_default();
            let diff = checkpoint::mismatches(args, &theirs);
            if !diff.is_empty() {
                why = Some(format!("rank {r} was started with other flags than rank 0 ({})", diff.join(", ")));
                break;
            }
        }
    }
    if g.agree(u64::from(why.is_some()))? == 0 {
        return Ok(());
    }
    Err(ModelError::Usage(
        why.unwrap_or_else(|| "the ranks were started with different flags (see rank 0's error)".into()),
    ))
}

/// The signal that asked the run to stop (0: none), set by the SIGINT/SIGTERM handlers.
fn stop_flag() -> Result<Arc<AtomicUsize>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let flag = Arc::new(AtomicUsize::new(0));
    for sig in [SIGINT, SIGTERM] {
        // A second signal while the first is being handled ends the process at once.
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let err = |e: std::io::Error| ModelError::Usage(format!("cannot handle signal {sig}: {e}"));
        signal_hook::flag::register_conditional_shutdown(sig, 130, armed.clone()).map_err(err)?;
        signal_hook::flag::register(sig, armed).map_err(err)?;
        signal_hook::flag::register_usize(sig, flag.clone(), sig as usize).map_err(err)?;
    }
    Ok(flag)
}

/// The agreed flag of a step after which rank 0 stopped the run (a failed write); a signal's
/// flag is its number.
const LEAD_STOPPED: u64 = u64::MAX;

pub fn run(a: TrainArgs) -> Result<()> {
    if a.steps == 0 {
        return Err(ModelError::Usage("--steps must be at least 1".into()));
    }
    let device: DeviceChoice = a.device.parse()?;
    let launch = crate::launch::resolve(a.gpus, &|v| std::env::var(v).ok()).map_err(ModelError::Usage)?;
    if launch.source == LaunchSource::Gpus && launch.world > 1 {
        // This process starts the ranks and waits for them.
        if device == DeviceChoice::Cpu {
            return Err(ModelError::Usage(format!(
                "--gpus {} starts a process per GPU; on the CPU start the ranks with torchrun's variables \
                 (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)",
                launch.world
            )));
        }
        // Counted without a context: this process holds no memory on the ranks' GPUs.
        let present = |i: usize| match rumble_cuda::Device::count() {
            Ok(n) if i < n => Ok(()),
            Ok(n) => Err(format!("device {i} asked for, {n} present")),
            Err(e) => Err(e.to_string()),
        };
        crate::launch::check_gpus(&launch, &present).map_err(ModelError::Usage)?;
        let exe = std::env::current_exe().map_err(|e| ModelError::Usage(format!("this program's path: {e}")))?;
        let args = crate::launch::rank_args(&std::env::args_os().skip(1).collect::<Vec<_>>());
        let lib_dir = crate::launch::nccl_dir()?;
        let code =
            crate::launch::run_ranks(launch.world, &exe, &args, lib_dir.as_deref()).map_err(ModelError::Usage)?;
        if code != 0 {
            std::process::exit(code);
        }
        return Ok(());
    }
    let (rank, world) = (launch.rank, launch.world);
    train(a, device, &launch).map_err(|e| if world > 1 { ModelError::Usage(format!("rank {rank}: {e}")) } else { e })
}

/// One process's run: the whole run, or rank `launch.rank` of a data-parallel one.
fn train(a: TrainArgs, device: DeviceChoice, launch: &crate::launch::Launch) -> Result<()> {
    let (rank, world) = (launch.rank, launch.world);
    // Rank 0 leads: it alone writes the run folder, the log, checkpoints and stdout.
    let lead = rank == 0;
    // A rank meets the others before reading anything, so a rank that fails a check ends the
    // run at the readiness agreement below rather than leaving the others waiting.
    let joined = if world > 1 { Some(crate::launch::join(launch, device)?) } else { None };
    let group = joined.as_ref().map(|j| j.group.clone());
    let device = match joined.as_ref().map(|j| j.kind) {
        Some(DeviceKind::Cuda) => DeviceChoice::Cuda,
        Some(DeviceKind::Cpu) => DeviceChoice::Cpu,
        None => device,
    };
    // --resume: the newest complete checkpoint of the run, whose config.json is the model.
    let resume = match &a.run_dir.resume {
        Some(_) if a.init_from.is_some() => {
            return Err(ModelError::Usage("give --resume or --init-from, not both".into()));
        }
        Some(dir) => {
            crate::rundir::check(dir, crate::rundir::Mode::Resume, None)?;
            Some(checkpoint::newest(dir)?)
        }
        None => None,
    };
    // A folder's config.json is found as the sibling of a file in it.
    let beside = resume
        .as_ref()
        .map(|n| n.dir.join("model.safetensors"))
        .or_else(|| a.init_from.as_ref().map(|p| if p.is_dir() { p.join("config.json") } else { p.clone() }));
    let mut r = a.model.resolve(beside.as_deref())?;
    // A resumed run keeps the name it started with: its config.json now sits in the run's own
    // folder, whose name is not the model's (`--init-from path/to/Qwen2.5-0.5B --out runs/ft`).
    if let Some(name) = resume.as_ref().and_then(|n| n.state.args.get("model")).and_then(Value::as_str) {
        r.name = name.to_string();
    }
    let cfg = r.config.clone();
    let out = a.run_dir.folder(a.out.as_deref(), PathBuf::from("runs").join(&r.name))?;
    let mode = a.run_dir.mode();
    if lead {
        crate::rundir::check(&out, mode, a.init_from.as_deref())?;
    }
    let precision: Precision = match r.step.precision {
        Some(p) => p,
        None => Precision::default_for(cfg.dtype)
            .ok_or_else(|| ModelError::Usage(format!("`{}` is stored in {}: give --precision", r.name, cfg.dtype)))?,
    };
    let mut step_cfg = r.step.clone();
    step_cfg.precision = Some(precision);
    // --batch is the global batch: each rank steps on its share of the rows.
    let global_batch = step_cfg.batch;
    if !global_batch.is_multiple_of(world) {
        return Err(ModelError::Usage(format!(
            "--batch {global_batch} (the global batch) does not split over {world} ranks: give a multiple of {world}"
        )));
    }
    step_cfg.batch = global_batch / world;
    // Ranks may count different numbers of targets (prompt tokens masked): each weighs its
    // loss by its share, so their mean is the global batch's.
    step_cfg.loss_weights = world > 1;
    let model_dir = model_folder(beside.as_deref(), a.model.config.as_deref());
    let tokenizer = match &model_dir {
        Some(d) => Tokenizer::from_folder(d)?,
        None => Tokenizer::bytes(),
    };
    let lr = a.lr.unwrap_or(r.lr);
    let warmup = a.warmup.unwrap_or((a.steps / 10).min(100));
    let kind = match a.schedule {
        ScheduleArg::Constant => ScheduleKind::Constant,
        ScheduleArg::Cosine => ScheduleKind::Cosine,
    };
    let schedule = LrSchedule { peak: lr, warmup, total: a.steps, kind };
    let buckets = match &a.buckets {
        Some(_) if a.model.seq.is_some() => {
            return Err(ModelError::Usage("give --buckets or --seq, not both".into()));
        }
        Some(list) => Some(Buckets::seqs(step_cfg.batch, list)?),
        None => None,
    };
    // Refused up front: windows longer than the data, hyper-parameters out of their domain,
    // parameters and optimizer state larger than the memory free.
    let longest = buckets.iter().flat_map(|b| b.shapes().iter().map(|s| s.seq)).max().unwrap_or(step_cfg.seq);
    if let Some(b) = &buckets {
        for s in b.shapes() {
            cfg.check_step_sizes(s.batch, s.seq, step_cfg.grad_accum)?;
        }
    }
    // The data is read (and its windows checked) before anything is allocated for the step.
    let mut data = DataSource::new(&a, &tokenizer, cfg.vocab_size, longest, &r.name)?;
    data.check_window(longest)?;
    if longest > cfg.max_position_embeddings {
        note!(
            "note: sequences of {longest} tokens are longer than the model's max_position_embeddings ({}): it meets \
             positions it was not trained on (RoPE extrapolates)",
            cfg.max_position_embeddings
        );
    }
    rumble_models::trainer::check_hyper(&step_cfg, &schedule)?;
    crate::common::check_weights_fit(&r.name, &cfg, &step_cfg)?;
    crate::common::check_step_fits(&r, true)?;
    // What shapes the step and the run: a resumed run must be given the same.
    let args: BTreeMap<String, Value> = [
        ("model", json!(r.name)),
        ("batch", json!(global_batch)),
        ("seq", json!(step_cfg.seq)),
        ("grad_accum", json!(step_cfg.grad_accum)),
        ("optimizer", json!(format!("{:?}", step_cfg.optimizer))),
        ("objective", json!(step_cfg.objective.name())),
        ("clip", json!(step_cfg.clip)),
        ("fused_loss", json!(step_cfg.fused_loss)),
        ("precision", json!(precision.name())),
        ("lr", json!(lr)),
        ("warmup", json!(warmup)),
        ("schedule", json!(format!("{kind:?}"))),
        ("seed", json!(a.seed)),
        ("buckets", json!(a.buckets)),
        ("data", json!(a.data.as_ref().map(|p| p.display().to_string()))),
        ("eval_every", json!(a.eval_every)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();

    // Every rank must have been started with the same flags.
    if let Some(g) = &group {
        agree_on_flags(g, &args)?;
    }
    let mut lengths = Rng::for_name(a.seed, "lengths");
    let (weights, schedule, done) = match &resume {
        Some(n) => {
            let diff = checkpoint::mismatches(&n.state.args, &args);
            if !diff.is_empty() {
                return Err(ModelError::Usage(format!(
                    "--resume {}: this command changes what the run was started with ({}); give the same flags",
                    n.dir.display(),
                    diff.join(", ")
                )));
            }
            if a.steps <= n.state.step {
                return Err(ModelError::Usage(format!(
                    "--resume {}: the run is at step {}; --steps is the total, give more",
                    n.dir.display(),
                    n.state.step
                )));
            }
            let pos = &n.state.data;
            let Some(l) = Rng::from_state(&pos["lengths"]) else {
                return Err(ModelError::Usage(format!("{}: no data position in trainer_state.json", n.dir.display())));
            };
            data.restore(&pos["batches"], &n.dir)?;
            lengths = l;
            (checkpoint::load(&n.dir, &cfg)?, n.state.schedule.schedule(a.steps)?, n.state.step)
        }
        None => {
            let w = match &a.init_from {
                Some(p) => Weights::load(p, &cfg)?,
                None => Weights::init(&cfg, a.seed)?,
            };
            (w, schedule, 0)
        }
    };
    let data_parallel = (a.data_parallel || a.zero1 || world > 1).then_some(DataParallel {
        world,
        rank,
        mode: if a.zero1 { Mode::Zero1 } else { Mode::Ddp },
        bucket_bytes: DataParallel::DEFAULT_BUCKET_BYTES,
    });
    // On CUDA the collectives need the process's communicator: a world of one here (a rank of
    // several joined its run above). The device made for it is held while the run lasts (its
    // context is the executor's).
    let _nccl_device = match data_parallel.filter(|_| world == 1).map(|_| device.resolve()).transpose()? {
        Some(DeviceKind::Cuda) => {
            let dev = rumble_cuda::Device::new(0)?;
            rumble_cuda::nccl::install_single(&dev)?;
            Some(dev)
        }
        _ => None,
    };
    let opts = rumble_core::compile::CompileOptions { budget: a.memory_budget, data_parallel, ..Default::default() };
    let mut trainer = match &buckets {
        Some(b) => Trainer::with_buckets(cfg.clone(), step_cfg.clone(), b.clone(), weights, schedule, device, &opts)?,
        None => Trainer::with_options(cfg.clone(), step_cfg.clone(), weights, schedule, device, &opts)?,
    };
    trainer.set_steps_done(done);
    if let Some(g) = &group {
        trainer = trainer.with_group(g.clone());
    }
    // Rank 0's checkpoints gather a ZeRO-1 run's sharded state from every rank.
    let gathers = a.zero1 && world > 1;
    // With buckets: the largest bucket's shape.
    let sc = trainer.step_config().clone();
    // Validation windows: the step's batch shape, shorter when the held-out text is.
    let val_seq = data.val_seq(sc.seq);
    if let Some(seq) = val_seq {
        trainer = trainer.with_eval(sc.batch, seq)?;
    }
    let bucket_seqs: Vec<usize> = buckets.iter().flat_map(|b| b.shapes().iter().map(|s| s.seq)).collect();
    let mut run_dir = if lead { Some(RunDir::open(&out, mode, a.init_from.as_deref())?) } else { None };
    if let Some(rd) = run_dir.as_mut() {
        if rd.removed_temps > 0 {
            note!("removed {} temporary file(s) of killed runs from {}", rd.removed_temps, out.display());
        }
        if let Some(n) = &resume {
            // A resumed run rewrites what came after its checkpoint.
            rd.log.keep_through(n.state.step)?;
        }
    }
    let log_path = run_dir.as_ref().map(|rd| rd.log.path.clone());
    let stop = stop_flag()?;
    // Model FLOPs utilisation, on a GPU whose bf16 peak is known, for a bf16 step: the run's
    // FLOPs over every rank's GPU.
    let peak_flops = match trainer.device() {
        DeviceKind::Cuda if precision.compute() == rumble_core::DType::BF16 => {
            rumble_cuda::Device::new(0).ok().and_then(|d| bf16_peak(&d.name)).map(|p| p * world as f64)
        }
        _ => None,
    };
    let mut timed = Throughput::default();

    let mut start = json!({
        "event": "start", "model": r.name, "params": cfg.num_params(), "device": trainer.device().to_string(),
        "batch": sc.batch, "seq": sc.seq, "grad_accum": sc.grad_accum, "steps": a.steps,
        "optimizer": sc.optimizer.map(|o| o.name()), "lr": lr, "precision": precision.name(),
        "buckets": bucket_seqs,
        "resumed_from": resume.as_ref().map(|n| n.dir.display().to_string()), "start_step": done,
        "data_parallel": data_parallel.map(|d| json!({"world": d.world, "rank": d.rank,
            "mode": if d.mode == Mode::Zero1 { "zero1" } else { "ddp" }})),
        "global_batch": global_batch,
    });
    data.describe(&mut start, &tokenizer);
    // Off a terminal (a log file, a pipe): one plain line per logged step instead of a bar.
    let plain = !a.json && !std::io::stderr().is_terminal();
    let bar = if !lead {
        ProgressBar::hidden()
    } else if a.json {
        output::line(&start)?;
        ProgressBar::hidden()
    } else {
        note!(
            "training {} ({} parameters) on {}: batch {} x seq {} x {} micro-batch(es), {} steps, {} lr {lr}, {} \
             (parameters and optimizer state {}, compute {})",
            r.name,
            human(cfg.num_params() as f64),
            trainer.device(),
            sc.batch,
            sc.seq,
            sc.grad_accum,
            a.steps,
            sc.optimizer.map(|o| o.name()).unwrap_or("-"),
            precision,
            precision.master(),
            precision.compute(),
        );
        if let Some(n) = &resume {
            note!("resuming from {} at step {}", n.dir.display(), n.state.step);
            for why in &n.skipped {
                note!("passed over a newer checkpoint: {why}");
            }
        }
        if buckets.is_some() {
            note!("shape buckets: seq {bucket_seqs:?}; each step's length drawn from 1..={}", sc.seq);
        }
        if plain {
            ProgressBar::hidden()
        } else {
            let bar = ProgressBar::new(a.steps);
            bar.set_position(done);
            let style = ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos:>5}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .map_err(|e| ModelError::Usage(e.to_string()))?;
            bar.set_style(style);
            bar
        }
    };

    let state = |trainer: &Trainer, data: &DataSource, lengths: &Rng, lr: f64| TrainerState {
        step: trainer.steps_done(),
        precision: Some(precision.name().to_string()),
        schedule: trainer.schedule().into(),
        lr,
        seed: a.seed,
        data: json!({"batches": data.state(), "lengths": lengths.state()}),
        args: args.clone(),
        files: BTreeMap::new(),
    };
    let val_batches = |trainer: &mut Trainer, data: &DataSource| -> Result<Option<f32>> {
        let Some(seq) = val_seq else { return Ok(None) };
        let Some(bs) = data.val_batches(a.seed, (sc.batch, seq, a.eval_batches.max(1)), rank, world)? else {
            return Ok(None);
        };
        let Some(g) = &group else { return trainer.eval(&bs).map(Some) };
        // Each rank evaluates its rows of every batch; a batch's loss is the mean over all its
        // targets, as one process counts them (the ranks' means weighted by their targets).
        let mut total = 0.0;
        for (b, loss) in bs.iter().zip(trainer.eval_losses(&bs)?) {
            let n = b.counted_targets() as f64;
            let s = g.sum(&[if n > 0.0 { loss * n } else { 0.0 }, n])?;
            total += s[0] / s[1].max(1.0);
        }
        Ok(Some((total / bs.len() as f64) as f32))
    };
    // Every rank is ready: one that failed a check above has left, and the others learn it here.
    if let Some(g) = &group {
        g.agree(0)?;
    }
    let t0 = Instant::now();
    let mut first_loss = None;
    let mut last = None;
    // A failed write to stdout or the log stops the run; the checkpoint is still saved.
    let mut stopped: Option<ModelError> = None;
    let mut last_val = None;
    let mut last_lr = trainer.schedule().at(done.max(1));
    let mut interrupted = 0;
    for i in done + 1..=a.steps {
        let seq = if buckets.is_some() { 1 + lengths.below(sc.seq) } else { sc.seq };
        let (batches, weights): (Vec<Batch>, Vec<f64>) = (0..sc.grad_accum)
            .map(|_| data.next(sc.batch, seq, rank, world))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let ts = Instant::now();
        let s = trainer.step_weighted(&batches, step_cfg.loss_weights.then_some(&weights[..]))?;
        let dt = ts.elapsed().as_secs_f64();
        // The run's figures: every rank's tokens and FLOPs.
        let tokens = (s.tokens * world) as f64;
        let tps = tokens / dt.max(1e-9);
        let flops = crate::suite::flops_per_step(&cfg, global_batch, seq) * sc.grad_accum as f64;
        timed.add(tokens, flops, dt);
        last_lr = s.lr;
        first_loss.get_or_insert(s.loss);
        let val_loss = match a.eval_every {
            Some(n) if i % n.max(1) == 0 || i == a.steps => val_batches(&mut trainer, &data)?,
            _ => None,
        };
        last_val = val_loss.or(last_val);
        if lead && (i == done + 1 || i == a.steps || i % a.log_every.max(1) == 0 || val_loss.is_some()) {
            let mut line = json!({
                "event": "step", "step": s.step, "loss": s.loss, "lr": s.lr, "tokens_per_s": tps.round(),
                "step_ms": (dt * 1e3 * 100.0).round() / 100.0, "elapsed_s": (t0.elapsed().as_secs_f64() * 100.0).round() / 100.0,
            });
            if let Some(g) = s.grad_norm {
                line["grad_norm"] = json!(g);
            }
            if let Some(v) = val_loss {
                line["val_loss"] = json!(v);
            }
            if buckets.is_some() {
                line["seq"] = json!(seq);
            }
            let peak = trainer.stats().map(|st| st.peak_allocated_bytes).filter(|&b| b > 0);
            if let Some(b) = peak {
                line["peak_bytes"] = json!(b);
            }
            let mfu = peak_flops.map(|p| flops / dt.max(1e-9) / p);
            if let Some(m) = mfu {
                line["mfu"] = json!((m * 1e4).round() / 1e4);
            }
            let written = match run_dir.as_mut() {
                Some(rd) => rd.log.line(&line.to_string()),
                None => Ok(()),
            }
            .and_then(|_| if a.json { output::line(&line) } else { Ok(()) });
            if let Err(e) = written {
                stopped = Some(e);
            }
            if plain && stopped.is_none() {
                note!(
                    "step {i}/{}  loss {:.4}{}  lr {:.3e}  {} tok/s{}{}",
                    a.steps,
                    s.loss,
                    val_loss.map(|v| format!("  val_loss {v:.4}")).unwrap_or_default(),
                    s.lr,
                    human(tps),
                    peak.map(|b| format!("  peak {}B", human(b as f64))).unwrap_or_default(),
                    mfu.map(|m| format!("  MFU {:.1}%", m * 100.0)).unwrap_or_default(),
                );
            }
        }
        if let (Some(n), Some(p)) = (a.sample_every, &a.prompt)
            && lead
            && stopped.is_none()
            && n > 0
            && (i % n == 0 || i == a.steps)
        {
            let text = crate::generate::sample_text(&cfg, &trainer.model_weights()?, &tokenizer, p, 64)?;
            let line = json!({"event": "sample", "step": i, "prompt": p, "text": text});
            if a.json { output::line(&line)? } else { bar.println(format!("step {i}: {p}{text}")) }
        }
        bar.set_message(match last_val {
            Some(v) => format!("loss {:.4}  val {v:.4}  {} tok/s", s.loss, human(tps)),
            None => format!("loss {:.4}  {} tok/s", s.loss, human(tps)),
        });
        bar.inc(1);
        last = Some(s);
        interrupted = stop.load(Ordering::SeqCst);
        if a.save_every.is_some_and(|n| i % n.max(1) == 0) && i != a.steps && !lead && gathers {
            trainer.snapshot()?;
        }
        if lead && a.save_every.is_some_and(|n| i % n.max(1) == 0) && i != a.steps {
            let dir = checkpoint::save_step(&out, &trainer, &state(&trainer, &data, &lengths, last_lr), a.keep_last)?;
            if a.json {
                if let Err(e) = output::line(json!({"event": "checkpoint", "step": i, "dir": dir})) {
                    stopped = Some(e);
                }
            } else if plain {
                note!("saved {}", dir.display());
            }
        }
        // Every rank stops after the same step: the largest of their flags.
        if let Some(g) = &group {
            let mine = if stopped.is_some() { LEAD_STOPPED } else { interrupted as u64 };
            match g.agree(mine)? {
                0 => {}
                LEAD_STOPPED if !lead => {
                    if gathers {
                        // Rank 0 still saves the run's checkpoint.
                        trainer.snapshot()?;
                    }
                    return Err(ModelError::Usage(format!("rank 0 stopped the run after step {i} (see its error)")));
                }
                LEAD_STOPPED => {}
                sig => interrupted = interrupted.max(sig as usize),
            }
        }
        if interrupted != 0 || stopped.is_some() {
            break;
        }
    }
    if !lead {
        if gathers {
            trainer.snapshot()?;
        }
        if interrupted != 0 {
            std::process::exit(128 + interrupted as i32);
        }
        return Ok(());
    }
    let log_path = log_path.unwrap_or_default();
    let saving = Instant::now();
    checkpoint::save(&out, &trainer, &state(&trainer, &data, &lengths, last_lr))?;
    let save_s = saving.elapsed().as_secs_f64();
    if let Some(d) = model_dir.as_ref().filter(|d| d.as_path() != out.as_path()) {
        copy_tokenizer_files(d, &out)?;
    }
    if let Some(e) = stopped {
        bar.abandon();
        note!("stopped after step {} ({e}); checkpoint of that step saved in {}", trainer.steps_done(), out.display());
        return Err(e);
    }
    if interrupted != 0 {
        bar.abandon();
        let name = if interrupted == signal_hook::consts::SIGTERM as usize { "SIGTERM" } else { "SIGINT" };
        let msg = format!(
            "interrupted by {name} after step {} of {}: saved {} (model, optimizer state, trainer_state.json); \
             continue with `rumble train --resume {} --steps {}` and the same flags",
            trainer.steps_done(),
            a.steps,
            out.display(),
            out.display(),
            a.steps
        );
        if a.json {
            // The process ends here either way; a closed stdout loses only this line.
            let _ =
                output::line(json!({"event": "interrupted", "signal": name, "step": trainer.steps_done(), "dir": out}));
        }
        note!("{msg}");
        std::process::exit(128 + interrupted as i32);
    }
    bar.finish();
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
        let mut done = json!({"event": "done", "first_loss": first_loss, "final_loss": final_loss, "val_loss": last_val,
               "elapsed_s": elapsed, "checkpoint": out.join("model.safetensors"), "config": out.join("config.json"),
               "loss_log": log_path, "buckets": reports, "save_s": (save_s * 100.0).round() / 100.0});
        let peak = match trainer.device() {
            DeviceKind::Cuda => trainer.stats().map(|st| st.peak_allocated_bytes),
            DeviceKind::Cpu => None,
        };
        if let (Some(d), serde_json::Value::Object(f)) = (done.as_object_mut(), timed.done_fields(peak, peak_flops)) {
            d.extend(f);
        }
        output::line(done)?;
    } else {
        note!(
            "loss {:.4} -> {:.4}{} in {elapsed:.1} s; checkpoint {} (+ config.json, optimizer state, trainer_state.json), \
             loss log {}",
            first_loss.unwrap_or(f32::NAN),
            final_loss.unwrap_or(f32::NAN),
            last_val.map(|v| format!(" (validation {v:.4})")).unwrap_or_default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_by_name_and_flops_per_step() {
        assert_eq!(bf16_peak("NVIDIA H200"), Some(989.4e12));
        assert_eq!(bf16_peak("NVIDIA H100 PCIe"), Some(756.0e12));
        assert_eq!(bf16_peak("NVIDIA H100 80GB HBM3"), Some(989.4e12));
        assert_eq!(bf16_peak("Some GPU"), None);
        let cfg = rumble_models::preset("tiny").unwrap().config;
        // Tied: every parameter is a matmul weight (or a norm), counted 6 times a token; causal
        // attention 2 * 2 * T * T * D * H / 2 a layer and sequence forward, 3 times that with
        // the backward.
        let (l, h, d, t, b) = (2.0, 4.0, 16.0, 64.0, 3.0);
        let want = 6.0 * cfg.num_params() as f64 * b * t + 3.0 * (2.0 * 2.0 * t * t * d * h / 2.0) * l * b;
        assert_eq!(crate::suite::flops_per_step(&cfg, 3, 64), want);
        assert_eq!((cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim), (2, 4, 16));
    }

    #[test]
    fn the_done_figures_leave_the_first_step_out() {
        let mut t = Throughput::default();
        assert_eq!(
            t.done_fields(None, None),
            json!({"tokens_per_s": null, "timed_steps": 0, "peak_bytes": null, "mfu": null})
        );
        t.add(100.0, 1e12, 10.0); // the first step: graph capture
        assert_eq!(t.rates(), Some((10.0, 1e11)), "one step: itself");
        t.add(100.0, 1e12, 0.5);
        t.add(300.0, 3e12, 1.5);
        assert_eq!(t.rates(), Some((200.0, 2e12)));
        let f = t.done_fields(Some(1 << 30), Some(1e13));
        assert_eq!(f, json!({"tokens_per_s": 200.0, "timed_steps": 2, "peak_bytes": 1u64 << 30, "mfu": 0.2}));
        assert_eq!(t.done_fields(None, None)["mfu"], json!(null));
    }
}
