//! Text generation with a KV cache: a prefill of the prompts, then one decode step per token,
//! sampling on the device so the host reads only the new token ids.
//!
//! [`trace`] builds the two traces (prefill for the prompts' length bucket, decode for one
//! token per sequence); [`Generator`] runs them on the CPU reference (`cpu::eval`) or on CUDA as
//! two shape buckets of `rumble_cuda::BucketedGraphs`: the parameters and the KV cache in one
//! persistent region, prefill and decode in one arena, the decode step captured once and
//! replayed for every token (its positions and sampling key are inputs, not constants).
//! Prompts of different lengths share a batch: each is padded at its end to the bucket, and
//! each sequence decodes at its own position (`pos`), so padding is never attended to.
//! [`tokens`] is where a tokenizer plugs in (byte-level for now). [`profile`] times one prefill
//! and one decode step launch by launch (`rumble generate --bench --profile`).

pub mod tokens;
pub mod trace;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use rumble_core::cpu::HostTensor;
use rumble_core::ir::{InputRole, OutputRole};
use rumble_core::{DType, Trace};
use rumble_cuda::{BucketedGraphs, GraphMode, Program};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::exec::{DeviceChoice, cuda_unavailable};
use crate::host;
use rumble_core::exec::DeviceKind;

pub use trace::{Sampling, StepShape, cache_names};

/// What a [`Generator`] is built for.
#[derive(Clone, Debug, PartialEq)]
pub struct GenConfig {
    /// Sequences decoded together.
    pub batch: usize,
    /// Rows of the prefill (the prompts are padded at their end to this many tokens).
    pub prompt_rows: usize,
    /// Positions the KV cache holds: prompt plus new tokens never pass it.
    pub max_length: usize,
    pub sampling: Sampling,
    /// Return each step's `(B, V)` logits too (tests; costs a download per token).
    pub logits: bool,
    /// Prefill the prompts this many positions at a time (at least 2), through the decode
    /// step's attention over the cache, instead of all at once. `None`: all at once on the CPU;
    /// on CUDA, all at once unless that step's planned arena is over [`ARENA_SHARE`] of the
    /// parameters and cache, then the longest power-of-two chunk whose arena is within it.
    pub prefill_chunk: Option<usize>,
}

/// The most a generator's arena may add to its parameters and KV cache (as a share of them)
/// before the prefill is done in chunks.
pub const ARENA_SHARE: f64 = 0.05;

impl GenConfig {
    /// For `prompts`: the prefill bucket is the next power of two of the longest prompt (at
    /// least 8; at most `max_length`), the cache holds `max_length` positions (the longest
    /// prompt plus `max_new` when `None`).
    pub fn for_prompts(
        prompts: &[Vec<i64>],
        max_new: usize,
        max_length: Option<usize>,
        sampling: Sampling,
    ) -> Result<Self> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
            return Err(ModelError::Usage("generate: every prompt needs at least one token".into()));
        }
        // At least one position past the prompt, so the prefill never has the decode step's shape.
        let need = longest + max_new.max(1);
        let max_length = max_length.unwrap_or(need);
        if need > max_length {
            return Err(ModelError::Usage(format!(
                "generate: the longest prompt ({longest} tokens) plus {max_new} new tokens needs {need} positions, \
                 --max-length is {max_length}"
            )));
        }
        let prompt_rows = longest.next_power_of_two().max(8).min(max_length);
        Ok(GenConfig { batch: prompts.len(), prompt_rows, max_length, sampling, logits: false, prefill_chunk: None })
    }
}

/// What a generation produced and how long it took.
#[derive(Clone, Debug, Default)]
pub struct Generated {
    /// The new tokens of each sequence (up to and including its end-of-sequence token).
    pub tokens: Vec<Vec<i64>>,
    /// Each step's logits `(B, V)` as f32, when asked for ([`GenConfig::logits`]).
    pub logits: Vec<Vec<f32>>,
    /// Seconds from the start of the prefill to its tokens on the host.
    pub first_token_s: f64,
    /// Seconds of the decode steps, and how many ran.
    pub decode_s: f64,
    pub decode_steps: usize,
}

/// Runs the prefill and decode traces of one model, keeping the parameters and the KV cache.
pub struct Generator {
    cfg: Config,
    opts: GenConfig,
    engine: Engine,
    /// Names of the step inputs, `tokens pos last key`, checked once.
    build_secs: f64,
}

enum Engine {
    /// `cpu::eval` on each trace; inputs held per trace, caches copied between them.
    Cpu {
        traces: Vec<Trace>,
        inputs: Vec<Vec<HostTensor>>,
    },
    Cuda(Box<BucketedGraphs>),
}

/// `trace` through the one compile entry point (`rumble_core::compile`: passes, schedule, plan
/// with each node's backend scratch on `dev`); `Program::new` then builds its kernels.
fn plan(dev: &Arc<rumble_cuda::Device>, trace: &Trace) -> Result<rumble_core::compile::Compiled> {
    let opts = Program::compile_options(dev, &rumble_core::compile::CompileOptions::default())?;
    Ok(rumble_core::compile::compile(trace, &opts)?)
}

impl Generator {
    /// Builds the traces for `opts` and loads `weights` (by name, `param_specs` order or any)
    /// and a zero KV cache onto `device`.
    pub fn new(
        cfg: &Config,
        weights: Vec<(String, HostTensor)>,
        opts: GenConfig,
        device: DeviceChoice,
    ) -> Result<Self> {
        let t0 = Instant::now();
        let mut opts = opts;
        let shape =
            |prefill: bool, rows: usize| StepShape { batch: opts.batch, rows, max_length: opts.max_length, prefill };
        // The first trace: the whole prefill, or one chunk of it (the decode step's shape with
        // `chunk` rows: positions and attention over the cache, causal within the chunk).
        let first = |chunk: Option<usize>| match chunk {
            Some(c) if c < opts.prompt_rows => trace::build(cfg, shape(false, c), &opts.sampling, opts.logits),
            _ => trace::build(cfg, shape(true, opts.prompt_rows), &opts.sampling, opts.logits),
        };
        if let Some(c) = opts.prefill_chunk
            && c < 2
        {
            return Err(ModelError::Usage(format!(
                "generate: a prefill chunk of {c} position(s); it takes at least 2"
            )));
        }
        let mut traces = [first(opts.prefill_chunk)?, trace::build(cfg, shape(false, 1), &opts.sampling, opts.logits)?];
        let mut given: HashMap<String, HostTensor> = weights.into_iter().collect();
        for inp in traces[0].inputs.iter().filter(|i| i.role == InputRole::State) {
            given.insert(inp.name.clone(), host::zeros(traces[0].ty(inp.value)));
        }
        let use_cuda = device.resolve()? == DeviceKind::Cuda;
        let persistent = |t: &Trace| -> Result<Vec<(usize, HostTensor)>> {
            let mut out = Vec::new();
            for (i, inp) in t.inputs.iter().enumerate().filter(|(_, i)| i.role.is_persistent()) {
                let v = given.get(&inp.name).ok_or_else(|| {
                    ModelError::Usage(format!("generate: no value given for {} `{}`", inp.role.name(), inp.name))
                })?;
                crate::exec::check_type(t, &inp.name, t.ty(inp.value), v)?;
                out.push((i, v.clone()));
            }
            Ok(out)
        };
        let engine = if use_cuda {
            let dev = rumble_cuda::Device::new(0)?;
            // Chunk the prefill where its arena would pass the share (the planner knows it
            // before any kernel is built): halve the chunk until the arena fits, 16 rows at least.
            let over = |p: &rumble_core::compile::Compiled| {
                p.plan.arena_bytes as f64 > ARENA_SHARE * p.plan.persistent_bytes as f64
            };
            // Each trace is planned once; the plan kept is the one its program is built from.
            let mut planned = traces.iter().map(|t| plan(&dev, t)).collect::<Result<Vec<_>>>()?;
            if opts.prefill_chunk.is_none() && over(&planned[0]) {
                let mut c = (opts.prompt_rows / 2).next_power_of_two();
                while c >= 16 {
                    let t = first(Some(c))?;
                    let p = plan(&dev, &t)?;
                    let fits = !over(&p);
                    (traces[0], planned[0], opts.prefill_chunk) = (t, p, Some(c));
                    if fits {
                        break;
                    }
                    c /= 2;
                }
            }
            let progs = planned
                .into_iter()
                .map(|c| Ok(Arc::new(Program::new(dev.clone(), c.trace, c.plan)?)))
                .collect::<Result<Vec<_>>>()?;
            let values: Vec<HostTensor> = persistent(&progs[0].trace)?.into_iter().map(|(_, v)| v).collect();
            let mut g = BucketedGraphs::new(progs, &values, GraphMode::Whole)?;
            g.capture(0)?;
            g.capture(1)?;
            Engine::Cuda(Box::new(g))
        } else {
            // The traces the CUDA engine would run (through the passes: folds, fusion), so the
            // CPU checks what the compiler does to them too.
            let copts = rumble_core::compile::CompileOptions::default();
            let traces =
                traces.iter().map(|t| Ok(rumble_core::compile::optimize(t, &copts)?.0)).collect::<Result<Vec<_>>>()?;
            let mut inputs = Vec::new();
            for t in &traces {
                let mut v: Vec<HostTensor> = t.inputs.iter().map(|i| host::zeros(t.ty(i.value))).collect();
                for (i, h) in persistent(t)? {
                    v[i] = h;
                }
                inputs.push(v);
            }
            Engine::Cpu { traces, inputs }
        };
        Ok(Generator { cfg: cfg.clone(), opts, engine, build_secs: t0.elapsed().as_secs_f64() })
    }

    pub fn device(&self) -> DeviceKind {
        match self.engine {
            Engine::Cpu { .. } => DeviceKind::Cpu,
            Engine::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// The positions a prefill step takes per sequence when the prompts are prefilled in
    /// chunks ([`GenConfig::prefill_chunk`], or what the arena share chose); `None`: at once.
    pub fn prefill_chunk(&self) -> Option<usize> {
        self.opts.prefill_chunk.filter(|&c| c < self.opts.prompt_rows)
    }

    /// Seconds spent building, planning, compiling and capturing.
    pub fn build_secs(&self) -> f64 {
        self.build_secs
    }

    /// Device bytes: `(peak held, device-used rise, arena, persistent)` on CUDA.
    pub fn memory(&self) -> Option<(usize, usize, usize, usize)> {
        match &self.engine {
            Engine::Cpu { .. } => None,
            Engine::Cuda(g) => {
                use rumble_cuda::Executor as _;
                let m = g.memory();
                let (arena, pers) = g.device_bytes();
                Some((m.peak_bytes, m.device_rise_bytes, arena, pers))
            }
        }
    }

    /// Runs trace `k` (0 prefill, 1 decode) on the step inputs; returns `next` and the logits.
    fn step(&mut self, k: usize, data: [HostTensor; 4]) -> Result<(Vec<i64>, Option<Vec<f32>>)> {
        let outs = match &mut self.engine {
            Engine::Cuda(g) => g.step_bucket(k, &data)?,
            Engine::Cpu { traces, inputs } => {
                let t = &traces[k];
                let data_idx = t.inputs.iter().enumerate().filter(|(_, i)| i.role == InputRole::Input).map(|(i, _)| i);
                for (i, d) in data_idx.zip(data) {
                    crate::exec::check_type(t, &t.inputs[i].name, t.ty(t.inputs[i].value), &d)?;
                    inputs[k][i] = d;
                }
                let outs = rumble_core::cpu::eval(t, &inputs[k])?;
                let mut plain = Vec::new();
                for (o, h) in t.outputs.iter().zip(outs) {
                    match o.role {
                        OutputRole::Update { of } => {
                            let name = &t.inputs.iter().find(|i| i.value == of).expect("verified update").name;
                            for (j, tj) in traces.iter().enumerate() {
                                if let Some(p) = tj.inputs.iter().position(|i| &i.name == name) {
                                    inputs[j][p] = h.clone();
                                }
                            }
                        }
                        OutputRole::Output => plain.push(h),
                        _ => {}
                    }
                }
                plain
            }
        };
        let next = outs.first().map(|h| h.to_i64()).unwrap_or_default();
        let logits = if self.opts.logits { outs.get(1).map(|h| h.to_f32()) } else { None };
        Ok((next, logits))
    }

    /// Generates up to `max_new` tokens after each of `prompts` (at most the batch it was
    /// built for; fewer are padded with copies of the first), stopping a sequence at any of
    /// `eos` and the whole batch when every sequence has stopped. `on_token(seq, id)` sees
    /// each new token as soon as the host has it.
    pub fn generate(
        &mut self,
        prompts: &[Vec<i64>],
        max_new: usize,
        eos: &[i64],
        mut on_token: impl FnMut(usize, i64),
    ) -> Result<Generated> {
        let (b, rows, s) = (self.opts.batch, self.opts.prompt_rows, self.opts.max_length);
        let v = self.cfg.vocab_size as i64;
        if prompts.is_empty() || prompts.len() > b {
            return Err(ModelError::Usage(format!("generate: {} prompts for a batch of {b}", prompts.len())));
        }
        for (i, p) in prompts.iter().enumerate() {
            if p.is_empty() || p.len() > rows || p.len() + max_new > s {
                return Err(ModelError::Usage(format!(
                    "generate: prompt {i} has {} tokens; this generator takes 1 to {rows}, plus {max_new} new within {s}",
                    p.len()
                )));
            }
            if let Some(&t) = p.iter().find(|&&t| t < 0 || t >= v) {
                return Err(ModelError::Usage(format!(
                    "generate: prompt {i} has token {t}, outside the vocabulary 0..{v}"
                )));
            }
        }
        let padded: Vec<&Vec<i64>> = (0..b).map(|i| prompts.get(i).unwrap_or(&prompts[0])).collect();
        let chunk = self.opts.prefill_chunk.filter(|&c| c < rows);
        let mut out = Generated { tokens: vec![Vec::new(); prompts.len()], ..Default::default() };
        if max_new == 0 {
            return Ok(out);
        }
        let seed = self.opts.sampling.seed as i64;
        let key = |step: usize| HostTensor::from_i64(DType::I64, &[2], &[seed, step as i64]);
        let mut tokens = vec![0i64; b * rows];
        for (i, p) in padded.iter().enumerate() {
            tokens[i * rows..i * rows + p.len()].copy_from_slice(p);
        }
        let lens: Vec<i64> = padded.iter().map(|p| p.len() as i64).collect();
        let t0 = Instant::now();
        let (mut next, lg) = match chunk {
            None => {
                let last: Vec<i64> = (0..b).map(|i| (i * rows) as i64 + lens[i] - 1).collect();
                self.step(
                    0,
                    [
                        HostTensor::from_i64(DType::I64, &[b, rows], &tokens)?,
                        HostTensor::from_i64(DType::I64, &[b], &vec![0; b])?,
                        HostTensor::from_i64(DType::I64, &[b], &last)?,
                        key(0)?,
                    ],
                )?
            }
            // Chunk by chunk, every sequence at the chunk's positions; a sequence's first token
            // (and logits row) comes from the chunk that holds its last prompt token.
            Some(c) => {
                let (mut next, mut lg) = (vec![0i64; b], None::<Vec<f32>>);
                // The last chunk ends at the bucket's end (overlapping the one before where `c`
                // does not divide it: those positions' keys and values are computed again, the
                // same).
                for c0 in (0..rows).step_by(c).map(|c0| c0.min(rows - c)) {
                    let ids: Vec<i64> =
                        (0..b).flat_map(|i| tokens[i * rows + c0..i * rows + c0 + c].to_vec()).collect();
                    let at = |i: usize| (lens[i] - 1 - c0 as i64).clamp(0, c as i64 - 1);
                    let last: Vec<i64> = (0..b).map(|i| (i * c) as i64 + at(i)).collect();
                    let (n, l) = self.step(
                        0,
                        [
                            HostTensor::from_i64(DType::I64, &[b, c], &ids)?,
                            HostTensor::from_i64(DType::I64, &[b], &vec![c0 as i64; b])?,
                            HostTensor::from_i64(DType::I64, &[b], &last)?,
                            key(0)?,
                        ],
                    )?;
                    let v = self.cfg.vocab_size;
                    for i in (0..b).filter(|&i| (c0..c0 + c).contains(&((lens[i] - 1) as usize))) {
                        next[i] = n[i];
                        if let Some(l) = &l {
                            lg.get_or_insert_with(|| vec![0.0; b * v])[i * v..(i + 1) * v]
                                .copy_from_slice(&l[i * v..(i + 1) * v]);
                        }
                    }
                }
                (next, lg)
            }
        };
        out.first_token_s = t0.elapsed().as_secs_f64();
        out.logits.extend(lg);
        let mut done = vec![false; prompts.len()];
        let rows_b: Vec<i64> = (0..b as i64).collect();
        let t1 = Instant::now();
        for step in 0..max_new {
            for (i, d) in done.iter_mut().enumerate() {
                if !*d {
                    out.tokens[i].push(next[i]);
                    on_token(i, next[i]);
                    *d = eos.contains(&next[i]);
                }
            }
            if step + 1 == max_new || done.iter().all(|&d| d) {
                break;
            }
            let pos: Vec<i64> = lens.iter().map(|&l| l + step as i64).collect();
            let (n, lg) = self.step(
                1,
                [
                    HostTensor::from_i64(DType::I64, &[b, 1], &next)?,
                    HostTensor::from_i64(DType::I64, &[b], &pos)?,
                    HostTensor::from_i64(DType::I64, &[b], &rows_b)?,
                    key(step + 1)?,
                ],
            )?;
            next = n;
            out.logits.extend(lg);
            out.decode_steps += 1;
        }
        out.decode_s = t1.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// One step of the prefill and one of the decode trace for `opts`, each on its own planned
/// executor (node by node, device events around each launch; the second of two runs is kept),
/// with `weights`, a zero cache and prompts of `prompt_len` tokens (`1..=opts.prompt_rows`).
/// The decode step runs at position `prompt_len`, as the first real one does.
pub fn profile(
    cfg: &Config,
    weights: &[(String, HostTensor)],
    opts: &GenConfig,
    prompt_len: usize,
) -> Result<Vec<(&'static str, Vec<crate::cuda::NodeTime>)>> {
    if let Some(why) = cuda_unavailable() {
        return Err(ModelError::DeviceUnavailable { device: "cuda".into(), why });
    }
    let (b, rows) = (opts.batch, opts.prompt_rows);
    if prompt_len == 0 || prompt_len > rows || prompt_len >= opts.max_length {
        return Err(ModelError::Usage(format!(
            "generate --profile: a prompt of {prompt_len} tokens needs 1 to {rows}, under {} positions",
            opts.max_length
        )));
    }
    let ids = |dims: &[usize], v: Vec<i64>| HostTensor::from_i64(DType::I64, dims, &v);
    let key = ids(&[2], vec![opts.sampling.seed as i64, 0])?;
    let mut out = Vec::new();
    for (name, prefill) in [("prefill", true), ("decode", false)] {
        let r = if prefill { rows } else { 1 };
        let shape = StepShape { batch: b, rows: r, max_length: opts.max_length, prefill };
        let t = trace::build(cfg, shape, &opts.sampling, opts.logits)?;
        let mut given = weights.to_vec();
        for inp in t.inputs.iter().filter(|i| i.role == InputRole::State) {
            given.push((inp.name.clone(), host::zeros(t.ty(inp.value))));
        }
        let data = if prefill {
            let tokens = (0..b * rows).map(|i| ((i * 7919) % cfg.vocab_size) as i64).collect();
            let last = (0..b).map(|i| (i * rows + prompt_len - 1) as i64).collect();
            [ids(&[b, rows], tokens)?, ids(&[b], vec![0; b])?, ids(&[b], last)?, key.clone()]
        } else {
            let pos = vec![prompt_len as i64; b];
            [ids(&[b, 1], vec![1; b])?, ids(&[b], pos)?, ids(&[b], (0..b as i64).collect())?, key.clone()]
        };
        let copts = rumble_core::compile::CompileOptions::default();
        let mut exec = crate::cuda::CudaExecutor::with_options(t, given, crate::cuda::CudaMode::Planned, &copts)?;
        let mut times = Vec::new();
        for _ in 0..2 {
            times = exec
                .profile(&data)?
                .ok_or_else(|| ModelError::Usage("generate --profile: the planned executor gave no profile".into()))?;
        }
        out.push((name, times));
    }
    Ok(out)
}
