//! `rumble bench --suite [FILE]`: the benchmark suite of real model geometries.
//!
//! A suite file (default `bench/suite/suite.json`) lists cases: a name, a published Hugging Face
//! `config.json` (a path relative to the suite file: the file or its folder), the micro-batch
//! (`batch`, `seq`) and optionally `layers`, which overrides `num_hidden_layers` to time a few
//! layers of a large model. Weights are random (the config's dtype), tokens random. Each case
//! is timed as `rumble bench --config` times one (the same step: forward, loss and backward
//! producing every parameter gradient, `--train` adding the optimizer; on CUDA the graphed
//! executor unless `--executor` says otherwise) and prints the same JSON line, with the case's
//! `case`, `layers`, `tokens`, `params` and `flops_per_step` added, so bench/compare.py can
//! compute MFU. A case that fails (a config key rumble does not read yet, an out-of-memory...)
//! prints a JSON line with its `error` and the suite goes on; the exit status says how many
//! failed.
//!
//! `flops_per_step` counts model FLOPs of a forward and backward (BENCHMARKS.md): `6 * N * t`
//! for the `N` parameters outside the embeddings and `t` tokens, `6 * C * V * t` for the lm_head
//! (tied or not), and `6 * L * H * D * T^2` per sequence for causal attention (half of the
//! `12 * L * H * D * T^2` of full attention). With `--train` the optimizer is not counted.

use std::path::{Path, PathBuf};

use clap::Args;
use rumble_models::{Config, ModelError, Result};
use serde_json::{Value, json};

use crate::bench::{self, BenchArgs};

/// The suite file `--suite` reads when given no path (relative to the working directory).
pub const DEFAULT_SUITE: &str = "bench/suite/suite.json";

/// `rumble bench`'s suite options.
#[derive(Args, Debug, Clone, Default)]
pub struct SuiteArgs {
    /// Run every case of a suite file instead of one workload (default bench/suite/suite.json);
    /// one JSON line per case.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = DEFAULT_SUITE)]
    pub suite: Option<PathBuf>,
    /// With --suite: only the cases named (comma-separated).
    #[arg(long, value_name = "NAME[,NAME...]", requires = "suite")]
    pub suite_filter: Option<String>,
    /// With --suite: every case with this many layers (num_hidden_layers), e.g. 1 for a quick
    /// check; --batch and --seq likewise override the cases' own.
    #[arg(long, requires = "suite")]
    pub layers: Option<usize>,
}

/// One case of a suite file.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub name: String,
    /// The config.json (or its folder), resolved against the suite file's folder.
    pub config: PathBuf,
    pub batch: usize,
    pub seq: usize,
    /// Overrides the config's `num_hidden_layers`.
    pub layers: Option<usize>,
    /// The config key rumble does not read yet, when the suite file says so.
    pub pending: Option<String>,
}

/// Reads a suite file; errors name the file, the case and the key.
pub fn load(file: &Path) -> Result<Vec<Case>> {
    let text = std::fs::read_to_string(file).map_err(|e| ModelError::io(file, e))?;
    let bad = |what: String| ModelError::Usage(format!("{}: {what}", file.display()));
    let doc: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let list = doc.get("cases").and_then(Value::as_array).ok_or_else(|| bad("expected a list `cases`".into()))?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut cases: Vec<Case> = Vec::new();
    for (i, c) in list.iter().enumerate() {
        let name = c.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("case {i}: no string `name`")))?;
        let at = |key: &str| bad(format!("case `{name}`: `{key}`"));
        let count = |key: &str| -> Result<Option<usize>> {
            match c.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => Ok(Some(n as usize)),
                    _ => Err(bad(format!("case `{name}`: `{key}` must be a positive integer, got {v}"))),
                },
            }
        };
        let config = c.get("config").and_then(Value::as_str).ok_or_else(|| at("config"))?;
        let case = Case {
            name: name.to_string(),
            config: dir.join(config),
            batch: count("batch")?.ok_or_else(|| at("batch"))?,
            seq: count("seq")?.ok_or_else(|| at("seq"))?,
            layers: count("layers")?,
            pending: c.get("pending").and_then(Value::as_str).map(str::to_string),
        };
        if cases.iter().any(|k| k.name == case.name) {
            return Err(bad(format!("case `{name}` is listed twice")));
        }
        cases.push(case);
    }
    if cases.is_empty() {
        return Err(bad("no cases".into()));
    }
    Ok(cases)
}

/// The cases named by a comma-separated filter (all when none); a name matching no case is
/// an error listing the names there are.
pub fn select(cases: Vec<Case>, filter: Option<&str>) -> Result<Vec<Case>> {
    let Some(filter) = filter else { return Ok(cases) };
    let names: Vec<&str> = filter.split(',').map(str::trim).filter(|n| !n.is_empty()).collect();
    if let Some(missing) = names.iter().find(|n| !cases.iter().any(|c| c.name == **n)) {
        let all: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
        return Err(ModelError::Usage(format!("--suite-filter: no case `{missing}` (cases: {})", all.join(", "))));
    }
    Ok(cases.into_iter().filter(|c| names.contains(&c.name.as_str())).collect())
}

/// Model FLOPs of one forward and backward over `batch` sequences of `seq` tokens (the module
/// doc's formula).
pub fn flops_per_step(c: &Config, batch: usize, seq: usize) -> f64 {
    let embed = (c.vocab_size * c.hidden_size) as f64;
    let body = c.num_params() as f64 - if c.tie_word_embeddings { embed } else { 2.0 * embed };
    let tokens = (batch * seq) as f64;
    let attention = (c.num_hidden_layers * c.num_attention_heads * c.head_dim) as f64 * (seq * seq) as f64;
    6.0 * body * tokens + 6.0 * embed * tokens + 6.0 * attention * batch as f64
}

/// `rumble bench --suite`: every selected case in turn.
pub fn run(mut a: BenchArgs) -> Result<()> {
    if a.workload.is_some() || a.model.config.is_some() {
        return Err(ModelError::Usage("--suite runs the suite's configs: give no workload or --config".into()));
    }
    let file = a.suite.suite.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_SUITE));
    let cases = select(load(&file)?, a.suite.suite_filter.as_deref())?;
    if a.executor.is_none() && !a.profile {
        a.executor = Some("graphed".into());
    }
    let mut failed = Vec::new();
    for case in &cases {
        if let Err(e) = run_case(&a, case) {
            let error = e.to_string();
            // `pending` only when the error is the one the suite file expects.
            let pending = case.pending.as_ref().filter(|k| error.contains(&format!("`{k}`")));
            let line = json!({
                "case": case.name, "workload": case.name, "executor": "rumble", "error": error, "pending": pending,
            });
            println!("{line}");
            failed.push(case.name.as_str());
        }
    }
    match failed.len() {
        0 => Ok(()),
        n => Err(ModelError::Usage(format!("{n} of {} suite cases failed: {}", cases.len(), failed.join(", ")))),
    }
}

/// One case: its config with the overrides, then `rumble bench`'s timing with the case's keys
/// added to each line.
fn run_case(a: &BenchArgs, case: &Case) -> Result<()> {
    if !case.config.exists() {
        return Err(ModelError::Usage(format!("case `{}`: {} does not exist", case.name, case.config.display())));
    }
    let mut model = a.model.clone();
    model.config = Some(case.config.display().to_string());
    model.batch = Some(a.model.batch.unwrap_or(case.batch));
    model.seq = Some(a.model.seq.unwrap_or(case.seq));
    let mut r = model.resolve(None)?;
    if let Some(layers) = a.suite.layers.or(case.layers) {
        r.config.num_hidden_layers = layers;
    }
    r.name = case.name.clone();
    let sc = &r.step;
    let tokens = sc.batch * sc.seq * sc.grad_accum;
    let flops = flops_per_step(&r.config, sc.batch, sc.seq) * sc.grad_accum as f64;
    let extra = json!({
        "case": case.name, "config": case.config.display().to_string(), "layers": r.config.num_hidden_layers,
        "tokens": tokens, "params": r.config.num_params(), "flops_per_step": flops,
    });
    bench::run_resolved(a, r, &mut |mut line: Value| {
        if let (Some(l), Some(e)) = (line.as_object_mut(), extra.as_object()) {
            l.extend(e.clone());
        }
        println!("{line}");
    })
}
