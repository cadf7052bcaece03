//! The memory planner on LLaMA-style training steps: every plan passes the independent checker,
//! the arena stays within 2% of LOAD, updates happen in place, and the arena executor gives
//! the per-op executor's results bit for bit, step after step.

use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::{self, HostTensor, Rng, arena::ArenaExecutor};
use rumble_core::ir::{DType, InputRole, OutputRole, Phase, Trace, verify};
use rumble_core::passes::remat::Remat;
use rumble_core::plan::lifetimes::{LifetimeOptions, lifetimes};
use rumble_core::plan::{Class, PlanOptions, check::check, plan_order};
use rumble_core::testing::{Optimizer, TinyLlama, random_inputs};

/// Small but with LLaMA's proportions: MLP about 2.7x the width, grouped-query heads.
fn proportioned(layers: usize, dtype: DType) -> TinyLlama {
    TinyLlama { vocab: 512, dim: 128, heads: 4, kv_heads: 2, hidden: 344, layers, batch: 2, seq: 64, dtype }
}

fn optimizers() -> [Optimizer; 3] {
    [Optimizer::None, Optimizer::Sgd { lr: 0.01 }, Optimizer::adamw(1e-3)]
}

#[test]
fn training_steps_plan_within_two_percent_of_load() {
    for opt in optimizers() {
        for layers in [1, 3] {
            let trace = proportioned(layers, DType::BF16).train_step(opt).unwrap();
            let p = plan(&trace, &CompileOptions::default()).unwrap();
            check(&p.trace, &p.plan).unwrap();
            let r = &p.report;
            println!("{opt:?}, {layers} layers\n{r}");
            assert!(r.arena_bytes >= r.load_bytes);
            assert!(r.ratio() <= 1.02, "{opt:?}/{layers}: arena {} vs LOAD {}", r.arena_bytes, r.load_bytes);
            assert_eq!(r.peak_bytes, r.persistent_bytes + r.arena_bytes + r.workspace_bytes);
            assert!(r.arena_bytes < r.no_reuse_bytes / 2, "reuse should at least halve the arena");
            if opt != Optimizer::None {
                assert!(p.plan.copy_back.is_empty(), "{opt:?}: every update should be computed in place");
            }
        }
    }
}

#[test]
fn classes_are_derived_from_phases_and_roles() {
    let trace = proportioned(1, DType::F32).train_step(Optimizer::Sgd { lr: 0.1 }).unwrap();
    let lt = lifetimes(&trace, LifetimeOptions::default());
    let class = |v: rumble_core::ValueId| lt.values[v.index()].class;
    for inp in &trace.inputs {
        let want = match inp.role {
            InputRole::Param => Class::Param,
            InputRole::Input => Class::Input,
            _ => unreachable!("the SGD step has params and data only"),
        };
        assert_eq!(class(inp.value), want, "{}", inp.name);
    }
    // The swiglu output is read by the backward (down_proj's weight gradient): saved.
    let defs = trace.defs();
    let swiglu = trace.nodes.iter().find(|n| n.op.name() == "swiglu").unwrap().outs[0];
    assert_eq!(class(swiglu), Class::Saved);
    // Each SGD update reads its gradient: gradients are backward values read by the optimizer.
    let mut grads = 0;
    for n in trace.nodes.iter().filter(|n| n.phase == Phase::Optimizer) {
        for a in &n.args {
            if let Some(rumble_core::ir::Def::Node { node, .. }) = defs[a.index()]
                && trace.nodes[node].phase == Phase::Backward
            {
                assert_eq!(class(*a), Class::Gradient);
                grads += 1;
            }
        }
    }
    assert!(grads >= 9, "one gradient per parameter, got {grads}");
    let loss = trace.output("loss").unwrap().value;
    assert_eq!(class(loss), Class::Output);
}

#[test]
fn scheduler_never_raises_load_and_keeps_the_program() {
    for opt in optimizers() {
        let trace = proportioned(2, DType::BF16).train_step(opt).unwrap();
        let (s, r) = rumble_core::passes::schedule::schedule(&trace, LifetimeOptions::default()).unwrap();
        verify(&s).unwrap();
        assert_eq!(s.nodes.len(), trace.nodes.len());
        assert_eq!(s.op_counts(), trace.op_counts());
        let before = lifetimes(&trace, LifetimeOptions::default()).load().0;
        assert_eq!(r.load_before, before);
        assert_eq!(r.load_after, lifetimes(&s, LifetimeOptions::default()).load().0);
        assert!(r.load_after <= r.load_before);
        println!("{opt:?}: LOAD {} -> {} ({})", r.load_before, r.load_after, r.detail);
        if opt != Optimizer::None {
            assert!(r.load_after < r.load_before, "{opt:?}: running each update right after its gradient should help");
        }
    }
}

#[test]
fn remat_lowers_load_and_recomputes_in_the_backward() {
    let trace = proportioned(2, DType::BF16).train_step(Optimizer::None).unwrap();
    let base = plan(&trace, &CompileOptions::default()).unwrap();
    let opts = CompileOptions { remat: Remat::Auto, ..Default::default() };
    let p = plan(&trace, &opts).unwrap();
    check(&p.trace, &p.plan).unwrap();
    let r = p.report.passes.iter().find(|r| r.pass == "remat").unwrap();
    println!("{}", p.report);
    assert!(r.load_after < r.load_before, "{r:?}");
    assert!(r.extra_flops > 0);
    assert!(p.report.load_bytes < base.report.load_bytes);
    assert!(p.trace.nodes.len() > trace.nodes.len());
    // Every node added runs in the backward and is cheap.
    let count = |t: &Trace, phase: Phase| t.nodes.iter().filter(|n| n.phase == phase).count();
    assert_eq!(count(&p.trace, Phase::Forward), count(&trace, Phase::Forward));
    for (name, n) in p.trace.op_counts() {
        let before = trace.op_counts().iter().find(|(k, _)| *k == name).map_or(0, |(_, n)| *n);
        if n > before {
            assert!(!["matmul", "attention"].contains(&name), "{name} was recomputed");
        }
    }
}

#[test]
fn remat_budget_reports_fit_and_cost() {
    let trace = proportioned(2, DType::BF16).train_step(Optimizer::None).unwrap();
    let base = plan(&trace, &CompileOptions::default()).unwrap().report;
    let auto = plan(&trace, &CompileOptions { remat: Remat::Auto, ..Default::default() }).unwrap().report;
    // A budget between the two: something must be recomputed, not necessarily everything.
    let budget = (base.peak_bytes + auto.peak_bytes) / 2;
    let p =
        plan(&trace, &CompileOptions { remat: Remat::Budget { peak_bytes: budget }, ..Default::default() }).unwrap();
    let r = p.report.passes.iter().find(|r| r.pass == "remat").unwrap();
    println!("{}", p.report);
    assert!(r.extra_flops > 0 && r.load_after < r.load_before, "{r:?}");
    assert!(r.detail.contains("budget"), "{}", r.detail);
    assert_eq!(p.report.budget_bytes, Some(budget));
    assert!(p.report.peak_bytes <= budget, "{} > {budget}", p.report.peak_bytes);
    assert!(p.report.to_json().contains("\"fits_budget\":true"));
    // A budget below the persistent bytes cannot be met, and says so.
    let p = plan(&trace, &CompileOptions { remat: Remat::Budget { peak_bytes: 1 }, ..Default::default() }).unwrap();
    assert!(p.report.to_string().contains("does NOT fit"), "{}", p.report);
    assert!(p.report.to_json().contains("\"fits_budget\":false"));
}

/// Random inputs for `trace` (ids within the vocabulary, floats ~ N(0, 0.5), second moments
/// the squares of such).
fn inputs(trace: &Trace, vocab: u64, seed: u64) -> Vec<HostTensor> {
    let mut v = random_inputs(trace, vocab, 0.5, &mut Rng::new(seed));
    for (t, i) in v.iter_mut().zip(&trace.inputs) {
        if i.role == InputRole::OptState && i.name.ends_with("exp_avg_sq") {
            let sq: Vec<f64> = t.to_f64().iter().map(|x| x * x).collect();
            *t = HostTensor::from_f64(t.ty.dtype, t.ty.dims(), &sq).unwrap();
        }
    }
    v
}

/// Three steps with the arena executor and with `cpu::eval`; every output, every step, and
/// the parameters afterwards agree bit for bit.
fn assert_arena_matches_eval(trace: &Trace, opts: &CompileOptions, vocab: u64) {
    let p = plan(trace, opts).unwrap();
    let t = &p.trace;
    let mut state = inputs(t, vocab, 7);
    let mut ex = ArenaExecutor::new(t, &p.plan).unwrap();
    ex.load(&state).unwrap();
    for step in 0..3 {
        if step > 0 {
            let fresh = inputs(t, vocab, 100 + step);
            for (i, inp) in t.inputs.iter().enumerate() {
                if !inp.role.is_persistent() {
                    state[i] = fresh[i].clone();
                }
            }
            let data: Vec<Option<&HostTensor>> =
                t.inputs.iter().zip(&state).map(|(i, s)| (!i.role.is_persistent()).then_some(s)).collect();
            ex.load_data(&data).unwrap();
        }
        let want = cpu::eval(t, &state).unwrap();
        let got = ex.step().unwrap();
        for ((o, w), g) in t.outputs.iter().zip(&want).zip(&got) {
            assert!(w.bytes == g.bytes, "step {step}: output \"{}\" differs: {w:?} vs {g:?}", o.name);
        }
        cpu::apply_updates(t, &mut state, &want);
    }
    for (inp, s) in t.inputs.iter().zip(&state) {
        if inp.role.is_persistent() {
            assert!(ex.value(inp.value).unwrap().bytes == s.bytes, "\"{}\" differs after 3 steps", inp.name);
        }
    }
    // The rewritten trace computes what the input trace did.
    if opts.remat != Remat::Off || opts.schedule {
        let a = cpu::eval(trace, &inputs(trace, vocab, 7)).unwrap();
        let b = cpu::eval(t, &inputs(t, vocab, 7)).unwrap();
        for (o, x) in trace.outputs.iter().zip(&a) {
            let k = t.outputs.iter().position(|q| q.name == o.name).unwrap();
            assert!(x.bytes == b[k].bytes, "output \"{}\" changed under the passes", o.name);
        }
    }
}

#[test]
fn arena_executor_matches_eval_bit_for_bit() {
    let cfg = TinyLlama { layers: 2, dtype: DType::F32, ..TinyLlama::default() };
    for opt in optimizers() {
        for opts in [
            CompileOptions { schedule: false, ..Default::default() },
            CompileOptions::default(),
            CompileOptions {
                remat: Remat::Auto,
                plan: PlanOptions { workspace_bytes: 1000, ..Default::default() },
                ..Default::default()
            },
            CompileOptions {
                schedule: false,
                plan: PlanOptions { inplace: false, ..Default::default() },
                ..Default::default()
            },
        ] {
            let trace = cfg.train_step(opt).unwrap();
            assert_arena_matches_eval(&trace, &opts, cfg.vocab as u64);
        }
    }
    let bf16 = TinyLlama { layers: 1, dtype: DType::BF16, ..TinyLlama::default() };
    let trace = bf16.train_step(Optimizer::adamw(1e-2)).unwrap();
    assert_arena_matches_eval(&trace, &CompileOptions { remat: Remat::Auto, ..Default::default() }, bf16.vocab as u64);
}

#[test]
fn report_json_has_the_keys_scripts_read() {
    let trace = proportioned(1, DType::BF16).train_step(Optimizer::adamw(1e-3)).unwrap();
    let p = plan(
        &trace,
        &CompileOptions { plan: PlanOptions { workspace_bytes: 4 << 20, ..Default::default() }, ..Default::default() },
    )
    .unwrap();
    let j = p.report.to_json();
    for key in ["\"load_bytes\":", "\"arena_bytes\":", "\"persistent_bytes\":", "\"peak_bytes\":", "\"at_peak\":["] {
        assert!(j.contains(key), "{key} missing from {j}");
    }
    assert!(j.contains(&format!("\"peak_bytes\":{}", p.report.peak_bytes)));
    assert_eq!(p.report.workspace_bytes, 4 << 20);
    assert_eq!(p.plan.workspace_offset(), p.report.arena_bytes);
    // Persistent bytes: parameters and two AdamW moments, each aligned.
    let persistent: usize = trace
        .inputs
        .iter()
        .filter(|i| i.role.is_persistent())
        .map(|i| trace.ty(i.value).size_in_bytes().div_ceil(256) * 256)
        .sum();
    assert_eq!(p.report.persistent_bytes, persistent);
    let classes: usize = p.report.classes.iter().map(|c| c.at_peak).sum();
    assert_eq!(classes, p.report.load_bytes + p.report.persistent_bytes);
}

#[test]
fn timeline_svg_names_what_is_live_at_the_peak() {
    let trace = proportioned(2, DType::BF16).train_step(Optimizer::Sgd { lr: 0.1 }).unwrap();
    let p = plan(&trace, &CompileOptions::default()).unwrap();
    let svg = p.svg();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for needle in ["arena", "LOAD", "peak at step", "saved for backward", "biggest buffers live at the peak"] {
        assert!(svg.contains(needle), "{needle} missing");
    }
    let top = &p.report.at_peak[0];
    assert!(svg.contains(&top.ty), "the biggest buffer at the peak ({}) should be labelled", top.ty);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::write(dir.join("timeline_sgd.svg"), &svg).unwrap();
}

#[test]
fn plan_order_keeps_the_order_and_updates_in_place() {
    let trace = proportioned(1, DType::F32).train_step(Optimizer::adamw(1e-3)).unwrap();
    let p = plan_order(&trace, &PlanOptions::default()).unwrap();
    assert_eq!(p.trace, trace);
    check(&trace, &p.plan).unwrap();
    // In the autodiff order the optimizer runs after the whole backward, when every parameter
    // is dead: all updates (params and moments) are computed in their slots.
    assert!(p.plan.copy_back.is_empty());
    for out in trace.outputs.iter() {
        if let OutputRole::Update { of } = out.role {
            assert_eq!(p.plan.slot(out.value).unwrap(), p.plan.slot(of).unwrap(), "{}", out.name);
        }
    }
}

#[test]
fn fused_training_steps_update_in_place_and_match_bit_for_bit() {
    let cfg = TinyLlama { layers: 2, dtype: DType::F32, ..TinyLlama::default() };
    for opt in optimizers() {
        let trace = rumble_core::passes::fuse(&cfg.train_step(opt).unwrap()).unwrap();
        assert!(trace.nodes.iter().any(|n| n.op.name() == "fused"));
        let p = plan(&trace, &CompileOptions::default()).unwrap();
        check(&p.trace, &p.plan).unwrap();
        if opt != Optimizer::None {
            // AdamW's update of a parameter and its two moments is one fused node with three
            // results, each written over its own input.
            assert!(p.plan.copy_back.is_empty(), "{opt:?}: {:?}", p.plan.copy_back);
        }
        for opts in [CompileOptions::default(), CompileOptions { remat: Remat::Auto, ..Default::default() }] {
            assert_arena_matches_eval(&trace, &opts, cfg.vocab as u64);
        }
    }
    let big = rumble_core::passes::fuse(&proportioned(3, DType::BF16).train_step(Optimizer::adamw(1e-3)).unwrap());
    let r = plan(&big.unwrap(), &CompileOptions::default()).unwrap().report;
    assert!(r.ratio() <= 1.02, "fused: arena {} vs LOAD {}", r.arena_bytes, r.load_bytes);
}

#[test]
fn op_scratch_is_planned_live_at_its_node_only() {
    use rumble_core::ir::Graph;
    let g = Graph::new("lce");
    let (n, c, v) = (24, 16, 40);
    let tokens = g.data("tokens", DType::I64, &[n]).unwrap();
    let targets = g.data("targets", DType::I64, &[n]).unwrap();
    let embed = g.param("embed", DType::F32, &[v, c]).unwrap();
    let norm = g.param("norm", DType::F32, &[c]).unwrap();
    let head = g.param("head", DType::F32, &[v, c]).unwrap();
    let x = embed.gather(&tokens).unwrap().rms_norm(&norm, 1e-6).unwrap();
    let loss = x.linear_cross_entropy(&head, &targets, -100, 8).unwrap();
    g.output(&loss, "loss").unwrap();
    let params = [&embed, &norm, &head];
    let grads = rumble_core::autodiff::backward(&loss, &params).unwrap();
    g.set_phase(Phase::Optimizer);
    for (p, gr) in params.iter().zip(&grads) {
        let new = p.sub(&gr.mul_scalar(0.1).unwrap()).unwrap();
        g.output_with_role(&new, &format!("new.{}", p.id()), OutputRole::Update { of: p.id() }).unwrap();
    }
    let trace = g.finish().unwrap();
    let p = plan(&trace, &CompileOptions::default()).unwrap();
    check(&p.trace, &p.plan).unwrap();
    let with_scratch: Vec<usize> = (0..p.trace.nodes.len()).filter(|&i| p.plan.scratch[i].is_some()).collect();
    assert_eq!(with_scratch.len(), 2, "forward and backward of linear_cross_entropy");
    for &i in &with_scratch {
        let node = &p.trace.nodes[i];
        let at: Vec<_> = node.args.iter().map(|a| p.trace.ty(*a)).collect();
        assert_eq!(p.plan.scratch[i].unwrap().bytes, node.op.scratch_bytes(&at));
    }
    assert!(p.report.classes.iter().any(|c| c.class == Class::Scratch && c.bytes > 0));
    assert_arena_matches_eval(&trace, &CompileOptions::default(), v as u64);
    // Scratch moved onto an operand of its own node is caught.
    let i = with_scratch[1];
    let arg =
        p.trace.nodes[i].args.iter().find(|a| p.plan.slot(**a).unwrap().region == rumble_core::plan::Region::Arena);
    let mut bad = p.plan.clone();
    let s = bad.scratch[i].as_mut().unwrap();
    s.offset = p.plan.slot(*arg.unwrap()).unwrap().offset;
    let e = check(&p.trace, &bad).unwrap_err().to_string();
    assert!(e.contains("scratch"), "{e}");
}

/// A training step whose residual adds and gradient sums were folded into matmuls
/// (`fold_addends`) plans with some of those matmuls computed over their addends, passes the
/// checker, and runs in the arena as `cpu::eval` does, bit for bit.
#[test]
fn matmuls_with_addends_plan_in_place_and_match_bit_for_bit() {
    let cfg = TinyLlama { layers: 2, dtype: DType::F32, ..TinyLlama::default() };
    let trace = rumble_core::passes::fold_addends(&cfg.train_step(Optimizer::adamw(1e-3)).unwrap()).unwrap();
    let accs = trace
        .nodes
        .iter()
        .filter(|n| matches!(n.op, rumble_core::ir::Op::Matmul { acc: rumble_core::ir::Addend::Full, .. }))
        .count();
    assert!(accs >= 4 * cfg.layers, "{accs} folded matmuls");
    let p = plan(&trace, &CompileOptions::default()).unwrap();
    check(&p.trace, &p.plan).unwrap();
    let over = p
        .trace
        .nodes
        .iter()
        .filter(|n| matches!(n.op, rumble_core::ir::Op::Matmul { acc: rumble_core::ir::Addend::Full, .. }))
        .filter(|n| p.plan.inplace_of[n.outs[0].index()] == Some(n.args[2]))
        .count();
    assert!(over > 0, "no matmul was planned over its addend");
    assert_arena_matches_eval(&trace, &CompileOptions::default(), cfg.vocab as u64);
}

/// In a training step every residual gradient sum but the last block's folds into its norm
/// backward (`fold_norm_addends`); the step plans with some of them computed over their
/// addends, passes the checker, and runs in the arena as `cpu::eval` does, bit for bit.
#[test]
fn norm_backwards_with_addends_plan_in_place_and_match_bit_for_bit() {
    let cfg = TinyLlama { layers: 2, dtype: DType::F32, ..TinyLlama::default() };
    let step = rumble_core::passes::fold_addends(&cfg.train_step(Optimizer::adamw(1e-3)).unwrap()).unwrap();
    let trace = rumble_core::passes::fold_norm_addends(&step).unwrap();
    let is = |n: &rumble_core::ir::Node, acc| matches!(n.op, rumble_core::ir::Op::RmsNormBackward { acc: a, .. } if a == acc);
    let accs = trace.nodes.iter().filter(|n| is(n, true)).count();
    // Per block two norms (attention, MLP) and the final one; the first block's input norm has
    // no residual gradient to add (the embedding's gradient comes from it alone).
    assert_eq!(accs, 2 * cfg.layers, "{accs} folded norm backwards");
    let p = plan(&trace, &CompileOptions::default()).unwrap();
    check(&p.trace, &p.plan).unwrap();
    let over =
        p.trace.nodes.iter().filter(|n| is(n, true) && p.plan.inplace_of[n.outs[0].index()] == Some(n.args[3])).count();
    assert!(over > 0, "no norm backward was planned over its addend");
    assert_arena_matches_eval(&trace, &CompileOptions::default(), cfg.vocab as u64);
}

/// A matmul whose addend is also its `a` operand (`x w + x`) is never computed over it: cuBLAS
/// would read `x` while writing. The planner keeps them apart, and the checker refuses a plan
/// that puts them together.
#[test]
fn a_matmul_never_overwrites_an_addend_it_also_multiplies() {
    let g = rumble_core::ir::Graph::new("xwx");
    let p = g.param("p", DType::F32, &[6, 6]).unwrap();
    let w = g.param("w", DType::F32, &[6, 6]).unwrap();
    let x = p.mul_scalar(2.0).unwrap(); // in the arena, last read by the matmul
    g.output(&x.add(&x.matmul(&w).unwrap()).unwrap().exp().unwrap(), "y").unwrap();
    let trace = rumble_core::passes::fold_addends(&g.finish().unwrap()).unwrap();
    let mm = trace
        .nodes
        .iter()
        .find(|n| matches!(n.op, rumble_core::ir::Op::Matmul { acc: rumble_core::ir::Addend::Full, .. }))
        .unwrap();
    assert_eq!((mm.args[0], mm.args[2]), (mm.args[2], mm.args[0]), "x is both a and the addend");
    let (y, xv) = (mm.outs[0], mm.args[2]);
    let p = plan(&trace, &CompileOptions::default()).unwrap();
    check(&p.trace, &p.plan).unwrap();
    assert_eq!(p.plan.inplace_of[y.index()], None);
    assert_arena_matches_eval(&trace, &CompileOptions::default(), 2);
    let mut bad = p.plan.clone();
    bad.slots[y.index()] = bad.slots[xv.index()];
    bad.inplace_of[y.index()] = Some(xv);
    let e = check(&p.trace, &bad).unwrap_err().to_string();
    assert!(e.contains("in place") && e.contains("reads"), "{e}");
}
