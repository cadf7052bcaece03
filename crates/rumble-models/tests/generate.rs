//! `generate` on the CPU reference: the KV-cache prefill and decode traces against the
//! full-sequence forward (every generated token is the argmax of the forward's logits at its
//! position, and the logits agree), against transformers' `generate(do_sample=False)` (token
//! ids from `reference/make_generate_reference.py`), the sampler's determinism, and the plan
//! (the cache written in place, in the persistent region).

use std::path::PathBuf;

use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::{HostTensor, eval};
use rumble_core::ir::Op;
use rumble_core::{DType, Graph};
use rumble_models::generate::trace::{StepShape, build};
use rumble_models::generate::{GenConfig, Generator, Sampling};
use rumble_models::model::{self, Params};
use rumble_models::{Config, DeviceChoice, Weights};

/// The reference folders: `RUMBLE_REFERENCE_DIR`, else this crate's `tests/reference` (from
/// the build's path, or relative to a repository root as on the GPU machine).
fn reference_root() -> PathBuf {
    if let Some(d) = std::env::var_os("RUMBLE_REFERENCE_DIR") {
        return PathBuf::from(d);
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference");
    if built.is_dir() { built } else { PathBuf::from("crates/rumble-models/tests/reference") }
}

fn fixture(name: &str) -> (Config, Weights) {
    let dir = reference_root().join(name);
    let cfg = Config::from_file(&dir.join("config.json")).unwrap();
    let w = Weights::load(&dir.join("model.safetensors"), &cfg).unwrap();
    (cfg, w)
}

/// Logits `(T, V)` of the full forward on one sequence.
fn forward(cfg: &Config, w: &Weights, seq: &[i64]) -> Vec<f32> {
    let g = Graph::new("forward");
    let tok = g.data("tokens", DType::I64, &[1, seq.len()]).unwrap();
    let params = Params::declare(&g, cfg).unwrap();
    let lg = model::logits(cfg, &params, &tok).unwrap();
    g.output(&lg, "logits").unwrap();
    let t = g.finish().unwrap();
    let mut inputs = vec![HostTensor::from_i64(DType::I64, &[1, seq.len()], seq).unwrap()];
    inputs.extend(w.tensors.iter().map(|(_, t)| t.clone()));
    eval(&t, &inputs).unwrap().remove(0).to_f32()
}

fn argmax(x: &[f32]) -> i64 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as i64
}

fn prompts(v: i64) -> Vec<Vec<i64>> {
    vec![vec![3 % v, 17 % v, 5, 9, 1], (0..11).map(|i| (i * 7 + 2) % v).collect(), vec![8, 4]]
}

/// Greedy generate with logits, then the full forward on prompt + generated tokens: every
/// token is the forward's argmax at its position and the logits agree to f32 rounding. Also
/// with the prompts prefilled 3 positions at a time (the 16-row bucket in chunks at 0, 3, ...,
/// 12 and a last one at 13 overlapping the one before; each prompt's last token in a different
/// chunk).
fn self_consistent(name: &str) {
    self_consistent_with(name, None);
    self_consistent_with(name, Some(3));
}

fn self_consistent_with(name: &str, prefill_chunk: Option<usize>) {
    let (cfg, w) = fixture(name);
    let ps = prompts(cfg.vocab_size as i64);
    let new = 10;
    let mut opts = GenConfig::for_prompts(&ps, new, None, Sampling::greedy()).unwrap();
    opts.logits = true;
    opts.prefill_chunk = prefill_chunk;
    let name = &format!("{name} (prefill chunk {prefill_chunk:?})");
    let mut g = Generator::new(&cfg, w.tensors.clone(), opts, DeviceChoice::Cpu).unwrap();
    let mut streamed = vec![Vec::new(); ps.len()];
    let out = g.generate(&ps, new, &[], |i, t| streamed[i].push(t)).unwrap();
    assert_eq!(out.tokens, streamed, "streamed tokens are the returned ones");
    assert_eq!(out.logits.len(), new, "one logits row set per step");
    let v = cfg.vocab_size;
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(out.tokens[i].len(), new);
        let seq: Vec<i64> = p.iter().chain(&out.tokens[i]).copied().collect();
        let full = forward(&cfg, &w, &seq);
        let scale = full.iter().fold(0f32, |m, x| m.max(x.abs()));
        for s in 0..new {
            let at = p.len() - 1 + s;
            let want = &full[at * v..(at + 1) * v];
            assert_eq!(out.tokens[i][s], argmax(want), "{name}: sequence {i}, step {s}");
            let got = &out.logits[s][i * v..(i + 1) * v];
            let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-4 * scale, "{name}: sequence {i}, step {s}: logits differ by {worst} of {scale}");
        }
    }
}

#[test]
fn cpu_generate_equals_the_full_forward_llama() {
    self_consistent("llama_gqa_tied");
}

#[test]
fn cpu_generate_equals_the_full_forward_qwen2_biases_head_dim_1() {
    self_consistent("qwen2_head_dim_1");
}

#[test]
fn cpu_generate_equals_the_full_forward_qwen2_gqa7() {
    self_consistent("qwen2_gqa7_tied");
}

/// Llama 3.1's RoPE scaling (its blended and divided frequencies reached by these positions):
/// the prefill and decode rotations must be the forward's rescaled ones.
#[test]
fn cpu_generate_equals_the_full_forward_llama3_rope_scaled() {
    self_consistent("llama3_rope_scaled");
}

/// Linear RoPE scaling (every frequency divided by 4).
#[test]
fn cpu_generate_equals_the_full_forward_llama_rope_linear() {
    self_consistent("llama_rope_linear");
}

/// The ids transformers' greedy `generate` wrote (`make_generate_reference.py`): the first
/// line of `generate/CASE.txt` holds the prompt ids, the second the 64 new ids.
#[test]
fn greedy_tokens_equal_transformers_generate() {
    let root = reference_root().join("generate");
    let mut checked = 0;
    for name in ["llama_gqa_tied", "llama_mha_untied", "qwen2_gqa7_tied", "qwen2_head_dim_1"] {
        let Ok(text) = std::fs::read_to_string(root.join(format!("{name}.txt"))) else { continue };
        let lines: Vec<Vec<i64>> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
            .collect();
        let (prompt, want) = (&lines[0], &lines[1]);
        let (cfg, w) = fixture(name);
        let opts = GenConfig::for_prompts(std::slice::from_ref(prompt), want.len(), None, Sampling::greedy()).unwrap();
        let mut g = Generator::new(&cfg, w.tensors, opts, DeviceChoice::Cpu).unwrap();
        let out = g.generate(std::slice::from_ref(prompt), want.len(), &[], |_, _| {}).unwrap();
        assert_eq!(&out.tokens[0], want, "{name}: rumble's greedy tokens vs transformers'");
        checked += 1;
    }
    assert!(checked > 0, "no reference ids in {}: run make_generate_reference.py", root.display());
}

#[test]
fn sampling_is_seeded_and_top_k_one_is_greedy() {
    let (cfg, w) = fixture("llama_mha_untied");
    let ps = prompts(cfg.vocab_size as i64);
    let run = |s: Sampling| {
        let opts = GenConfig::for_prompts(&ps, 16, None, s).unwrap();
        let mut g = Generator::new(&cfg, w.tensors.clone(), opts, DeviceChoice::Cpu).unwrap();
        g.generate(&ps, 16, &[], |_, _| {}).unwrap().tokens
    };
    let hot = Sampling { temperature: 1.5, top_k: 0, top_p: 1.0, seed: 7 };
    let a = run(hot);
    assert_eq!(a, run(hot), "same seed, same tokens");
    assert_ne!(a, run(Sampling { seed: 8, ..hot }), "another seed draws other tokens");
    assert_ne!(a, run(Sampling::greedy()), "temperature 1.5 is not greedy");
    assert_eq!(run(Sampling { top_k: 1, ..hot }), run(Sampling::greedy()), "top-k 1 is greedy");
    assert_eq!(run(Sampling { top_p: 1e-6, ..hot }), run(Sampling::greedy()), "a tiny top-p is greedy");
    let nucleus = run(Sampling { top_k: 5, top_p: 0.8, ..hot });
    assert!(nucleus.iter().flatten().all(|&t| t >= 0 && t < cfg.vocab_size as i64));
}

#[test]
fn eos_stops_a_sequence_and_bad_prompts_are_refused() {
    let (cfg, w) = fixture("llama_gqa_tied");
    let ps = prompts(cfg.vocab_size as i64);
    let opts = GenConfig::for_prompts(&ps, 12, None, Sampling::greedy()).unwrap();
    let mut g = Generator::new(&cfg, w.tensors.clone(), opts.clone(), DeviceChoice::Cpu).unwrap();
    let free = g.generate(&ps, 12, &[], |_, _| {}).unwrap().tokens;
    let stop = free[0][3];
    let mut g = Generator::new(&cfg, w.tensors.clone(), opts, DeviceChoice::Cpu).unwrap();
    let cut = g.generate(&ps, 12, &[stop], |_, _| {}).unwrap().tokens;
    for (f, c) in free.iter().zip(&cut) {
        let end = f.iter().position(|&t| t == stop).map_or(f.len(), |i| i + 1);
        assert_eq!(c, &f[..end].to_vec(), "a sequence stops at its end-of-sequence token, inclusive");
    }
    let e = g.generate(&[vec![1, 99]], 4, &[], |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("token 99") && e.contains("0..64"), "{e}");
    let e = GenConfig::for_prompts(&ps, 100, Some(64), Sampling::greedy()).unwrap_err().to_string();
    assert!(e.contains("--max-length is 64"), "{e}");
}

#[test]
fn the_decode_plan_writes_the_cache_in_place() {
    let (cfg, _) = fixture("llama_gqa_tied");
    let shape = StepShape { batch: 2, rows: 1, max_length: 32, prefill: false };
    let t = build(&cfg, shape, &Sampling::greedy(), false).unwrap();
    let p = plan(&t, &CompileOptions::default()).unwrap();
    assert!(p.plan.copy_back.is_empty(), "every cache update is computed in its input's slot: {:?}", p.plan.copy_back);
    let cache = 2 * 32 * cfg.num_key_value_heads * cfg.head_dim * 4 * 2 * cfg.num_hidden_layers;
    let weights: usize = model::param_specs(&cfg).iter().map(|s| s.ty.size_in_bytes()).sum();
    assert!(p.plan.persistent_bytes >= weights + cache, "{} < {weights} + {cache}", p.plan.persistent_bytes);
    let writes = p.trace.nodes.iter().filter(|n| n.op.name() == "cache_write").count();
    assert_eq!(writes, 2 * cfg.num_hidden_layers);
    for n in p.trace.nodes.iter().filter(|n| n.op.name() == "cache_write") {
        assert_eq!(p.plan.inplace_of[n.outs[0].index()], Some(n.args[0]), "cache_write over its cache");
    }
    // Through the passes, each layer's key and query rotations are folded into its cache write
    // and its attention (two launches fewer a layer), its two cache writes are one node (one
    // launch fewer), and the caches are still written in place.
    let c = rumble_core::compile::compile(&t, &CompileOptions::default()).unwrap();
    let count = |f: &dyn Fn(&Op) -> bool| c.trace.nodes.iter().filter(|n| f(&n.op)).count();
    assert_eq!(count(&|op| matches!(op, Op::CacheWriteKv { rope: Some(_) })), cfg.num_hidden_layers);
    assert_eq!(count(&|op| matches!(op, Op::CacheWrite { .. })), 0);
    assert_eq!(count(&|op| matches!(op, Op::AttentionCached { rope: Some(_), .. })), cfg.num_hidden_layers);
    assert_eq!(count(&|op| matches!(op, Op::RopeAt { .. })), 0);
    // Each layer's two norms and its swiglu are made by the projections reading them (q, k and
    // v as one node, gate/up, down: `matmul_pre`), and so is the final norm by the head.
    assert_eq!(count(&|op| matches!(op, Op::RmsNorm { .. } | Op::SwigluPacked)), 0);
    assert_eq!(count(&|op| matches!(op, Op::MatmulPre { .. })), 3 * cfg.num_hidden_layers + 1);
    assert_eq!(count(&|op| matches!(op, Op::MatmulPre { outs: 3, .. })), cfg.num_hidden_layers);
    assert!(c.plan.copy_back.is_empty());
}

/// `fold_cache_writes` on decode steps of Llama, Qwen2 and Qwen2 of head size 1 (its keys
/// rotated by a factor, so no rotation folds into their write): each layer's key and value
/// cache writes are one `cache_write_kv` node, rotating the keys where `fold_rope_at` folded
/// their rotation, each result planned over its own cache; and the step compiled with the pass
/// computes the same bits (the next tokens, the logits, every cache) on the CPU as without it.
#[test]
fn decode_steps_write_a_layers_keys_and_values_in_one_node() {
    use rumble_core::compile::PIPELINE;
    use rumble_core::cpu::Rng;
    use rumble_core::ir::InputRole;
    use rumble_core::passes::{self, Pass};
    for (name, rotates) in [("llama_gqa_tied", true), ("qwen2_gqa7_tied", true), ("qwen2_head_dim_1", false)] {
        let (cfg, w) = fixture(name);
        let shape = StepShape { batch: 2, rows: 1, max_length: 32, prefill: false };
        let t = build(&cfg, shape, &Sampling::greedy(), true).unwrap();
        let layers = cfg.num_hidden_layers;
        let c = rumble_core::compile::compile(&t, &CompileOptions::default()).unwrap();
        let joined: Vec<_> = c.trace.nodes.iter().filter(|n| matches!(n.op, Op::CacheWriteKv { .. })).collect();
        assert_eq!(joined.len(), layers, "{name}: {}", c.trace);
        assert!(!c.trace.nodes.iter().any(|n| matches!(n.op, Op::CacheWrite { .. })), "{name}: {}", c.trace);
        for n in &joined {
            assert_eq!(matches!(n.op, Op::CacheWriteKv { rope: Some(_) }), rotates, "{name}");
            for j in 0..2 {
                assert_eq!(c.plan.inplace_of[n.outs[j].index()], Some(n.args[j]), "{name}: result {j} over its cache");
            }
        }
        assert!(c.plan.copy_back.is_empty(), "{name}: {:?}", c.plan.copy_back);
        let without: Vec<Pass> = PIPELINE.iter().copied().filter(|(p, _)| *p != "fold_cache_writes").collect();
        let (plain, _) = passes::run(&t, &without).unwrap();
        let (folded, _) = passes::run(&t, PIPELINE).unwrap();
        assert_eq!(plain.nodes.iter().filter(|n| matches!(n.op, Op::CacheWrite { .. })).count(), 2 * layers);
        // Random caches (the step attends over them), the fixture's weights, tokens in range.
        let rng = &mut Rng::new(4);
        let weights: std::collections::HashMap<_, _> = w.tensors.iter().cloned().collect();
        let inputs: Vec<HostTensor> = t
            .inputs
            .iter()
            .map(|i| match (i.role, i.name.as_str()) {
                (InputRole::Param, n) => weights[n].clone(),
                (InputRole::State, _) => HostTensor::randn(t.ty(i.value).clone(), 1.0, rng),
                (_, "tokens") => HostTensor::from_i64(DType::I64, &[2, 1], &[3, cfg.vocab_size as i64 - 1]).unwrap(),
                (_, "pos") => HostTensor::from_i64(DType::I64, &[2], &[7, 31]).unwrap(),
                (_, "last") => HostTensor::from_i64(DType::I64, &[2], &[0, 1]).unwrap(),
                (_, _) => HostTensor::from_i64(DType::I64, &[2], &[0, 0]).unwrap(),
            })
            .collect();
        let (a, b) = (eval(&plain, &inputs).unwrap(), eval(&folded, &inputs).unwrap());
        assert_eq!(a.len(), 2 * layers + 2, "{name}: the caches, next and logits");
        assert_eq!(a, b, "{name}: the same bits with and without fold_cache_writes");
    }
}

/// A Qwen2 decode step's q, k and v biases are added by their projections as rows
/// (`fold_row_addends`, `acc=row`): the compiled step makes no broadcast for any matmul to
/// read. (`self_consistent` checks its values against the full forward.)
#[test]
fn the_qwen2_decode_step_adds_its_biases_as_rows() {
    use rumble_core::ir::{Addend, Def};
    let (cfg, _) = fixture("qwen2_gqa7_tied");
    assert!(cfg.qkv_bias);
    let shape = StepShape { batch: 2, rows: 1, max_length: 32, prefill: false };
    let t = build(&cfg, shape, &Sampling::greedy(), false).unwrap();
    let broadcasts = |t: &rumble_core::Trace| t.nodes.iter().filter(|n| matches!(n.op, Op::Broadcast { .. })).count();
    assert!(broadcasts(&t) >= 3 * cfg.num_hidden_layers, "the model writes a broadcast per bias");
    let c = rumble_core::compile::compile(&t, &CompileOptions::default()).unwrap();
    let rows: usize = c
        .trace
        .nodes
        .iter()
        .map(|n| match n.op {
            Op::Matmul { acc: Addend::Row, .. } => 1,
            Op::MatmulPre { acc: Addend::Row, outs, .. } => outs,
            _ => 0,
        })
        .sum();
    assert_eq!(rows, 3 * cfg.num_hidden_layers, "{}", c.trace);
    let defs = c.trace.defs();
    for n in c.trace.nodes.iter().filter(|n| matches!(n.op, Op::Matmul { .. } | Op::MatmulPre { .. })) {
        for a in &n.args {
            let made_by = match defs[a.index()] {
                Some(Def::Node { node, .. }) => Some(&c.trace.nodes[node].op),
                _ => None,
            };
            assert!(!matches!(made_by, Some(Op::Broadcast { .. })), "a matmul reads a broadcast: {}", c.trace);
        }
    }
}

/// On a GPU (ignored without one): the graphed prefill and decode (one arena, one persistent
/// region, the decode step captured once) give the CPU's greedy tokens on every fixture, the
/// sampler draws valid tokens deterministically, and the device memory held is the plan's
/// (the largest arena plus the persistent region: weights and KV cache).
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_generate_equals_cpu() {
    if let Some(why) = rumble_models::exec::cuda_unavailable() {
        panic!("this test needs a CUDA device (run with --include-ignored only on a GPU machine): {why}");
    }
    let fixtures = [
        "llama_gqa_tied",
        "llama_mha_untied",
        "qwen2_gqa7_tied",
        "qwen2_head_dim_1",
        "llama3_rope_scaled",
        "llama_rope_linear",
    ];
    for name in fixtures {
        let (cfg, w) = fixture(name);
        let ps = prompts(cfg.vocab_size as i64);
        let run = |device: DeviceChoice, s: Sampling| {
            let mut opts = GenConfig::for_prompts(&ps, 24, None, s).unwrap();
            opts.logits = true;
            let mut g = Generator::new(&cfg, w.tensors.clone(), opts, device).unwrap();
            let out = g.generate(&ps, 24, &[], |_, _| {}).unwrap();
            (out, g.memory())
        };
        let (cpu, _) = run(DeviceChoice::Cpu, Sampling::greedy());
        let (gpu, mem) = run(DeviceChoice::Cuda, Sampling::greedy());
        assert_eq!(gpu.tokens, cpu.tokens, "{name}: CUDA greedy tokens vs the CPU's");
        for (s, (a, b)) in gpu.logits.iter().zip(&cpu.logits).enumerate() {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-3 * scale, "{name}: step {s}: logits differ by {worst} of {scale}");
        }
        let (peak, rise, arena, pers) = mem.expect("CUDA reports memory");
        assert_eq!(peak, arena + pers, "{name}: held bytes are the arena and the persistent region");
        println!("{name}: peak {peak} (arena {arena} + persistent {pers}), device rise {rise}");
        let hot = Sampling { temperature: 1.0, top_k: 8, top_p: 0.9, seed: 5 };
        let (a, _) = run(DeviceChoice::Cuda, hot);
        let (b, _) = run(DeviceChoice::Cuda, hot);
        assert_eq!(a.tokens, b.tokens, "{name}: same seed, same tokens on the GPU");
        assert!(a.tokens.iter().flatten().all(|&t| t >= 0 && t < cfg.vocab_size as i64));
    }
}

/// A prefill chunk under 2 positions (the decode step's own shape) is refused, naming it.
#[test]
fn a_prefill_chunk_of_one_is_refused() {
    let (cfg, w) = fixture("llama_gqa_tied");
    let ps = prompts(cfg.vocab_size as i64);
    let mut opts = GenConfig::for_prompts(&ps, 4, None, Sampling::greedy()).unwrap();
    opts.prefill_chunk = Some(1);
    let e = Generator::new(&cfg, w.tensors.clone(), opts, DeviceChoice::Cpu).err().unwrap().to_string();
    assert!(e.contains("a prefill chunk of 1 position(s); it takes at least 2"), "{e}");
}
