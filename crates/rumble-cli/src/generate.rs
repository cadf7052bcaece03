//! `rumble generate`: text from a model folder with a KV cache (prefill, then one decode step
//! per token, sampled on the device), streamed to stdout; `--prompts FILE.jsonl` decodes a
//! batch of prompts together; `--bench` times a workload on random weights and prints one
//! JSON line (time to first token, decode tokens/s, memory); `--bench --profile` times one
//! prefill and one decode step kernel by kernel instead (`generate_profile`). The work is in
//! `rumble_models::generate`.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use rumble_core::cpu::Rng;
use rumble_models::Tokenizer;
use rumble_models::generate::tokens::{self, Detokenizer};
use rumble_models::generate::{GenConfig, Generator, Sampling};
use rumble_models::{Config, DeviceChoice, ModelError, Result, Weights, preset};
use serde_json::json;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A model folder: config.json and model.safetensors (what `rumble train` writes).
    #[arg(long, value_name = "DIR", required_unless_present = "bench")]
    pub model: Option<PathBuf>,
    /// The prompt.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// A batch of prompts: one JSON object a line with a "prompt" string; prints one JSON
    /// line per prompt with its completion.
    #[arg(long, value_name = "FILE.jsonl", conflicts_with = "prompt")]
    pub prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_new_tokens: usize,
    /// Positions the KV cache holds (default: the longest prompt plus --max-new-tokens).
    #[arg(long, value_name = "N")]
    pub max_length: Option<usize>,
    /// 0 is greedy (the most likely token each step).
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub temperature: f64,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub top_k: usize,
    /// Sample among the most likely tokens holding P of the probability (1: all).
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    pub top_p: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or auto (cuda when usable, else cpu).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Print the result as one JSON line (tokens, text, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Time a workload on random weights instead: --config PRESET|FILE, --batch, --prompt-len,
    /// --max-new-tokens; prints one JSON line.
    #[arg(long)]
    pub bench: bool,
    /// With --bench: a preset or a config.json (file or folder).
    #[arg(long, value_name = "FILE|PRESET", default_value = "tiny")]
    pub config: String,
    /// With --bench: sequences decoded together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// With --bench: tokens of each (random) prompt.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub prompt_len: usize,
    /// With --bench: instead of timing a generation, time one prefill and one decode step
    /// launch by launch; prints device time by kernel family (one JSON line with --json).
    #[arg(long, requires = "bench")]
    pub profile: bool,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let device: DeviceChoice = a.device.parse()?;
    let sampling = Sampling { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed };
    if a.bench {
        return bench(&a, device, sampling);
    }
    let dir = a.model.clone().ok_or_else(|| ModelError::Usage("generate: --model DIR is required".into()))?;
    let cfg = Config::from_file(&dir.join("config.json"))?;
    // The folder: one model.safetensors, or shards and their index.
    let weights = Weights::load(&dir, &cfg)?;
    let tok = tokens::load(&dir, &cfg)?;
    let eos = tokens::eos_ids(&dir)?;
    let texts = match (&a.prompt, &a.prompts) {
        (_, Some(file)) => read_prompts(file)?,
        (Some(p), None) => vec![p.clone()],
        (None, None) => return Err(ModelError::Usage("generate: give --prompt TEXT or --prompts FILE.jsonl".into())),
    };
    let prompts = texts.iter().map(|t| tokens::encode_prompt(&tok, t, &cfg)).collect::<Result<Vec<_>>>()?;
    let opts = GenConfig::for_prompts(&prompts, a.max_new_tokens, a.max_length, sampling)?;
    let mut g = Generator::new(&cfg, weights.tensors, opts, device)?;
    let stream = texts.len() == 1 && !a.json;
    let mut out = std::io::stdout().lock();
    if stream {
        let _ = out.write_all(texts[0].as_bytes());
        let _ = out.flush();
    }
    let mut detok = Detokenizer::new(&tok, &prompts[0]);
    let mut failed = None;
    let done = g.generate(&prompts, a.max_new_tokens, &eos, |_, id| {
        if stream {
            match detok.push(id) {
                Ok(bytes) => {
                    let _ = out.write_all(&bytes);
                    let _ = out.flush();
                }
                Err(e) => failed = failed.take().or(Some(e)),
            }
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    // Ids the tokenizer has no text for, said once a sequence (after its text).
    let notes = || {
        for (i, generated) in done.tokens.iter().enumerate() {
            if let Some(past) = tokens::past_vocabulary(&tok, generated) {
                let which = if texts.len() > 1 { format!(" (prompt {})", i + 1) } else { String::new() };
                eprintln!("{}{which}", tokens::past_vocabulary_note(&tok, past));
            }
        }
    };
    if stream {
        let _ = out.write_all(&detok.finish()?);
        let _ = writeln!(out);
        let _ = out.flush();
        notes();
        eprintln!(
            "{} tokens on {}: first after {:.1} ms, then {:.1} tokens/s",
            done.tokens[0].len(),
            g.device(),
            done.first_token_s * 1e3,
            done.decode_steps as f64 / done.decode_s.max(1e-9)
        );
        return Ok(());
    }
    for (i, text) in texts.iter().enumerate() {
        let bytes = tokens::decode_generated(&tok, &prompts[i], &done.tokens[i])?;
        let line = json!({"prompt": text, "completion": String::from_utf8_lossy(&bytes), "tokens": done.tokens[i],
                          "first_token_ms": done.first_token_s * 1e3, "device": g.device().to_string()});
        let _ = writeln!(out, "{line}");
    }
    let _ = out.flush();
    notes();
    Ok(())
}

/// The "prompt" of each line of a JSONL file.
fn read_prompts(file: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file).map_err(|e| ModelError::io(file, e))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |m: &str| ModelError::Usage(format!("{}:{}: {m}", file.display(), n + 1));
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&format!("not JSON: {e}")))?;
        let p = v.get("prompt").and_then(|p| p.as_str()).ok_or_else(|| bad("needs a \"prompt\" string"))?;
        out.push(p.to_string());
    }
    if out.is_empty() {
        return Err(ModelError::Usage(format!("{}: no prompts", file.display())));
    }
    Ok(out)
}

/// `--bench`: random weights and prompts; a warm-up generation (captures, matmul choices),
/// then a timed one. Decode tokens/s counts every sequence's tokens.
fn bench(a: &GenerateArgs, device: DeviceChoice, sampling: Sampling) -> Result<()> {
    let path = Path::new(&a.config);
    let cfg = if path.exists() {
        Config::from_file(&if path.is_dir() { path.join("config.json") } else { path.to_path_buf() })?
    } else {
        preset(&a.config)?.config
    };
    let weights = Weights::init(&cfg, a.seed)?;
    let weight_bytes = weights.num_bytes();
    let mut rng = Rng::for_name(a.seed, "prompts");
    let prompts: Vec<Vec<i64>> =
        (0..a.batch).map(|_| (0..a.prompt_len).map(|_| rng.below(cfg.vocab_size) as i64).collect()).collect();
    let new = a.max_new_tokens;
    let opts = GenConfig::for_prompts(&prompts, new, a.max_length, sampling)?;
    let max_length = opts.max_length;
    let esize = cfg.dtype.size_in_bytes();
    let kv_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * esize; // K and V, one position
    if a.profile {
        if device == DeviceChoice::Cpu {
            return Err(ModelError::Usage("generate --profile times CUDA launches: use --device cuda".into()));
        }
        // The profiled decode step attends to the prompt and its own token.
        let read = weight_bytes as f64 + (a.batch * kv_row * (a.prompt_len + 1)) as f64;
        return crate::generate_profile::run(&a.config, &cfg, &weights.tensors, &opts, a.prompt_len, read, a.json);
    }
    let mut g = Generator::new(&cfg, weights.tensors, opts, device)?;
    g.generate(&prompts, new.min(8), &[], |_, _| {})?;
    let r = g.generate(&prompts, new, &[], |_, _| {})?;
    let kv_bytes = a.batch * max_length * kv_row;
    let step_s = r.decode_s / r.decode_steps.max(1) as f64;
    // Bytes a decode step reads: every weight once, and each sequence's cache up to its
    // position (on average the prompt plus half the new tokens). No decode step ran (one new
    // token): no fraction.
    let read = weight_bytes as f64 + (a.batch * kv_row) as f64 * (a.prompt_len as f64 + new as f64 / 2.0);
    let hbm_fraction = (r.decode_steps > 0).then(|| read / step_s.max(1e-12) / 4.8e12);
    let mut line = json!({
        "event": "generate_bench", "config": a.config, "device": g.device().to_string(), "dtype": cfg.dtype.name(),
        "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": new, "decode_steps": r.decode_steps,
        "time_to_first_token_ms": r.first_token_s * 1e3, "decode_step_ms": (r.decode_steps > 0).then_some(step_s * 1e3),
        "decode_tokens_per_s": (a.batch * r.decode_steps) as f64 / r.decode_s.max(1e-12),
        "bytes_read_per_step": read, "hbm_fraction_at_4_8_tb_s": hbm_fraction,
        "weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes, "build_s": g.build_secs(), "prefill_chunk": g.prefill_chunk(),
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
    });
    if let Some((peak, rise, arena, pers)) = g.memory() {
        // On a GPU: its name, as `rumble bench` gives it.
        line["gpu"] = json!(rumble_cuda::Device::new(0)?.name.clone());
        line["peak_bytes"] = json!(peak);
        line["device_rise_bytes"] = json!(rise);
        line["arena_bytes"] = json!(arena);
        line["persistent_bytes"] = json!(pers);
        line["peak_over_weights_and_cache"] = json!(peak as f64 / (weight_bytes + kv_bytes) as f64);
    }
    println!("{line}");
    Ok(())
}

/// A short greedy sample of `n` tokens after `prompt` from `weights` with the run's tokenizer
/// `tok` (stopping at its end-of-sequence token, where it has one), on the CPU: what
/// `rumble train --sample-every` prints.
pub fn sample_text(cfg: &Config, weights: &Weights, tok: &Tokenizer, prompt: &str, n: usize) -> Result<String> {
    let p = vec![tokens::encode_prompt(tok, prompt, cfg)?];
    let opts = GenConfig::for_prompts(&p, n, None, Sampling::greedy())?;
    let mut g = Generator::new(cfg, weights.tensors.clone(), opts, DeviceChoice::Cpu)?;
    let eos: Vec<i64> = if tok.is_bytes() { Vec::new() } else { tok.eos().map(i64::from).into_iter().collect() };
    let out = g.generate(&p, n, &eos, |_, _| {})?;
    let bytes = tokens::decode_generated(tok, &p[0], &out.tokens[0])?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}
