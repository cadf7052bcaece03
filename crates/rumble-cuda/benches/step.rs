//! Step time and memory of the three executors on TinyLlama-style training steps (forward +
//! backward producing every parameter gradient, no optimizer: the step bench/reference/torch_ref.py times). Prints a
//! table; `RUMBLE_BENCH=tiny,small` picks configurations, `RUMBLE_BENCH_STEPS` the timed steps.
//! Without a GPU it prints "skipped: no CUDA device".

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Instant;

use rumble_core::cpu::Rng;
use rumble_core::exec::MemoryStats;
use rumble_core::ir::DType;
use rumble_core::plan::{PlanOptions, plan_in_order};
use rumble_core::testing::TinyLlama;
use rumble_cuda::{EagerExecutor, Executor, GraphMode, GraphedExecutor, PlannedExecutor, Program};

fn configs() -> Vec<(&'static str, TinyLlama)> {
    vec![
        ("tiny", common::tiny(DType::BF16)),
        // The `small` preset: HF LLaMA, vocab 32000, hidden 768, 12 heads, MLP 2048, 12 layers, batch 1, seq 256, bf16.
        (
            "small",
            TinyLlama {
                vocab: 32000,
                dim: 768,
                heads: 12,
                kv_heads: 12,
                hidden: 2048,
                layers: 12,
                batch: 1,
                seq: 256,
                dtype: DType::BF16,
            },
        ),
    ]
}

fn mb(bytes: usize) -> f64 {
    bytes as f64 / 1048576.0
}

/// A row of the table: configuration, executor, median step time, memory figures and loss.
fn row(name: &str, label: &str, ms: f64, m: &MemoryStats, loss: f32) -> String {
    format!(
        "{name:<6} {label:<15} {ms:>9.3} {:>10.1} {:>10.1} {:>10.1} {loss:.4}",
        mb(m.peak_bytes),
        mb(m.reserved_bytes),
        mb(m.device_rise_bytes)
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(
    ex: &mut dyn Executor<Error = rumble_cuda::CudaError>,
    trace: &rumble_core::Trace,
    vocab: u64,
    steps: usize,
) -> (f64, f32) {
    let mut rng = Rng::new(5);
    let inputs: Vec<_> = (0..4).map(|_| common::step_inputs(trace, vocab, &mut rng)).collect();
    for i in 0..3 {
        ex.step(&inputs[i % 4]).expect("warm-up step");
    }
    let mut ts = Vec::new();
    let mut loss = 0.0;
    for i in 0..steps {
        let t0 = Instant::now();
        let out = ex.step(&inputs[i % 4]).expect("step");
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
        loss = f32::from_le_bytes(out[0].bytes[..4].try_into().unwrap());
    }
    (median(ts), loss)
}

/// Device time per op kind (events around each node of an eager step), largest first.
fn profile(e: &mut EagerExecutor, trace: &rumble_core::Trace, vocab: u64, name: &str) {
    let data = common::step_inputs(trace, vocab, &mut Rng::new(11));
    let mut by_op: std::collections::BTreeMap<&str, (usize, f64)> = Default::default();
    for _ in 0..3 {
        by_op.clear();
        let (_, times) = e.step_profiled(&data).expect("profiled step");
        for (op, ms) in times {
            let s = by_op.entry(op).or_default();
            s.0 += 1;
            s.1 += ms;
        }
    }
    let mut v: Vec<_> = by_op.into_iter().collect();
    v.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    let total: f64 = v.iter().map(|x| x.1.1).sum();
    println!("{name}: device time by op (eager, events around each node), total {total:.3} ms");
    for (op, (n, ms)) in v.iter().take(12) {
        println!("  {op:<24} {n:>4} nodes {ms:>9.3} ms");
    }
}

fn main() {
    let Some(dev) = common::device() else { return };
    let pick = std::env::var("RUMBLE_BENCH").unwrap_or_else(|_| "tiny,small".into());
    let steps: usize = std::env::var("RUMBLE_BENCH_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    println!("device: {} ({}), {} SMs, {} MiB", dev.name, dev.arch, dev.multiprocessors, dev.total_memory >> 20);
    let mut rows = Vec::new();
    for (name, cfg) in configs().into_iter().filter(|(n, _)| pick.split(',').any(|p| p == *n)) {
        let trace = common::training_step(&cfg, None);
        let t0 = Instant::now();
        let prog = Arc::new(Program::compile(dev.clone(), trace.clone(), plan_in_order).expect("compile"));
        let compile_s = t0.elapsed().as_secs_f64();
        let params = common::init_params(&trace, &mut Rng::new(1));
        let v = cfg.vocab as u64;
        println!(
            "{name}: {} nodes, plan arena {:.1} MiB (load {:.1}, workspace {:.1}), persistent {:.1} MiB, prepare {:.2}s",
            trace.nodes.len(),
            mb(prog.plan.arena_bytes),
            mb(prog.plan.load_bytes),
            mb(prog.plan.workspace_bytes),
            mb(prog.plan.persistent_bytes),
            compile_s
        );
        {
            let mut e = EagerExecutor::new(prog.clone(), &params).expect("eager");
            let (ms, loss) = time(&mut e, &trace, v, steps);
            let m = e.memory();
            profile(&mut e, &trace, v, name);
            rows.push(row(name, "eager", ms, &m, loss));
        }
        {
            let mut p = PlannedExecutor::new(prog.clone(), &params).expect("planned");
            let (ms, loss) = time(&mut p, &trace, v, steps);
            rows.push(row(name, "planned", ms, &p.memory(), loss));
        }
        // The same step planned with the memory-aware schedule (reordered nodes).
        let sched = Arc::new(Program::planned(dev.clone(), &trace, &PlanOptions::default()).expect("plan"));
        println!(
            "{name}: scheduled plan arena {:.1} MiB (load {:.1}), in-order plan arena {:.1} MiB (load {:.1})",
            mb(sched.plan.arena_bytes),
            mb(sched.plan.load_bytes),
            mb(prog.plan.arena_bytes),
            mb(prog.plan.load_bytes)
        );
        for (label, mode, p) in [
            ("graphed-whole", GraphMode::Whole, &prog),
            ("graphed-fwd-bwd", GraphMode::ForwardBackward, &prog),
            ("graphed-sched", GraphMode::Whole, &sched),
        ] {
            let mut g = match GraphedExecutor::new(p.clone(), &params, mode) {
                Ok(g) => g,
                Err(e) => {
                    rows.push(format!("{name:<6} {label:<15} failed: {e}"));
                    continue;
                }
            };
            let (ms, loss) = time(&mut g, &trace, v, steps);
            rows.push(format!(
                "{}   capture {:.3}s {:?}",
                row(name, label, ms, &g.memory(), loss),
                g.capture_secs,
                g.graphs()
            ));
        }
    }
    println!("\nconfig executor          step_ms   peak_MiB  resv_MiB  rise_MiB  loss");
    for r in rows {
        println!("{r}");
    }
}
