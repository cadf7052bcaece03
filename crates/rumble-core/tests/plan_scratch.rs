//! A backend's scratch per node (`PlanOptions::backend_scratch`): planned inside the node's
//! scratch range after the op's own, live at that node's step only, reused between nodes (so
//! the arena is smaller than with one whole-step workspace of the largest), verified by the
//! independent checker, and harmless to the values: the arena executor fills every node's
//! scratch with garbage before it runs and still matches `cpu::eval` bit for bit.

use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, InputRole, Op, TensorType, Trace};
use rumble_core::passes::remat::Remat;
use rumble_core::plan::{ALIGN, BackendScratch, Class, PlanOptions, Planned, check::check, node_scratch_bytes};
use rumble_core::testing::{Optimizer, TinyLlama};

/// Scratch the fake backend asks for each matmul: bigger than any value of [`two_matmuls`].
const MATMUL_SCRATCH: usize = 96 << 10;

/// A backend that wants `MATMUL_SCRATCH` bytes for every matmul and nothing else.
fn matmul_backend() -> BackendScratch {
    BackendScratch::new(|op, _, _| Ok(if matches!(op, Op::Matmul { .. }) { MATMUL_SCRATCH } else { 0 }))
}

/// `x @ w1`, then a 64 KiB temporary in between (the values' peak, at no matmul), then `@ w2`:
/// two big-scratch nodes far apart.
fn two_matmuls() -> Trace {
    let g = Graph::new("two_matmuls");
    let x = g.data("x", DType::F32, &[16, 16]).unwrap();
    let w1 = g.param("w1", DType::F32, &[16, 16]).unwrap();
    let w2 = g.param("w2", DType::F32, &[16, 16]).unwrap();
    let a = x.matmul(&w1).unwrap(); // (16, 16)
    let big = a.broadcast_to(&[64, 16, 16]).unwrap().exp().unwrap(); // (64, 16, 16): 64 KiB
    let s = big.sum(&[0], false).unwrap().mul_scalar(1.0 / 64.0).unwrap(); // (16, 16)
    let b = s.matmul(&w2).unwrap(); // (16, 16)
    g.output(&b.sum_all().unwrap(), "loss").unwrap();
    g.finish().unwrap()
}

/// [`two_matmuls`] planned in trace order with [`matmul_backend`]'s scratch.
fn plan_two_matmuls() -> Planned {
    let opts = CompileOptions {
        schedule: false,
        plan: PlanOptions { backend_scratch: Some(matmul_backend()), ..Default::default() },
        ..Default::default()
    };
    plan(&two_matmuls(), &opts).unwrap()
}

fn matmul_nodes(t: &Trace) -> Vec<usize> {
    (0..t.nodes.len()).filter(|&i| matches!(t.nodes[i].op, Op::Matmul { .. })).collect()
}

fn random_inputs(trace: &Trace, seed: u64) -> Vec<HostTensor> {
    rumble_core::testing::random_inputs(trace, 32, 0.5, &mut Rng::new(seed))
}

/// The arena executor (every node's scratch filled with garbage before it runs) gives
/// `cpu::eval`'s outputs bit for bit.
fn assert_runs_like_eval(p: &Planned) {
    let inputs = random_inputs(&p.trace, 11);
    let want = cpu::eval(&p.trace, &inputs).unwrap();
    let got = cpu::arena::eval(&p.trace, &p.plan, &inputs).unwrap();
    for ((o, w), g) in p.trace.outputs.iter().zip(&want).zip(&got) {
        assert!(w.bytes == g.bytes, "output \"{}\" differs", o.name);
    }
}

#[test]
fn backend_scratch_is_placed_live_at_its_node_and_reused() {
    let p = plan_two_matmuls();
    check(&p.trace, &p.plan).unwrap();
    let mm = matmul_nodes(&p.trace);
    assert_eq!(mm.len(), 2);
    for &n in &mm {
        assert_eq!(p.plan.backend_scratch[n], MATMUL_SCRATCH);
        let s = p.plan.scratch[n].expect("a matmul has scratch");
        assert_eq!(s.bytes, node_scratch_bytes(0, MATMUL_SCRATCH));
        let b = p.plan.backend_scratch_slot(n).unwrap();
        assert_eq!((b.offset, b.bytes), (s.offset, MATMUL_SCRATCH));
        assert_eq!(b.offset % ALIGN, 0);
        // Its buffer lives at the node's step only.
        let buf = p.lifetimes.buffers.iter().find(|b| b.scratch_of == Some(n)).unwrap();
        assert_eq!((buf.start, buf.end), (n + 1, n + 1));
        // And shares no byte with anything the node reads or writes.
        for v in p.trace.nodes[n].args.iter().chain(&p.trace.nodes[n].outs) {
            let vs = p.plan.slot(*v).unwrap();
            let apart = vs.region != s.region || vs.offset + vs.bytes <= s.offset || s.offset + s.bytes <= vs.offset;
            assert!(apart, "{v} overlaps node {n}'s scratch");
        }
    }
    for n in (0..p.trace.nodes.len()).filter(|n| !mm.contains(n)) {
        assert_eq!((p.plan.scratch[n], p.plan.backend_scratch[n]), (None, 0), "node {n}");
    }
    assert_eq!(p.plan.workspace_bytes, 0);
    // The two matmuls' scratch reuses bytes: one range's worth, not two, and less than the
    // values plus a whole-step workspace of the same size.
    let ws = plan(
        &two_matmuls(),
        &CompileOptions {
            schedule: false,
            plan: PlanOptions { workspace_bytes: MATMUL_SCRATCH, ..Default::default() },
            ..Default::default()
        },
    )
    .unwrap();
    check(&ws.trace, &ws.plan).unwrap();
    let (per_node, whole_step) = (p.plan.arena_bytes, ws.plan.arena_bytes);
    println!(
        "two matmuls, {MATMUL_SCRATCH} B of backend scratch each: arena {per_node} B per node (LOAD {}), \
         {whole_step} B with a whole-step workspace (values {})",
        p.plan.load_bytes,
        ws.plan.values_bytes()
    );
    assert!(per_node < whole_step, "per-node scratch {per_node} should beat the workspace {whole_step}");
    assert!(per_node < ws.plan.values_bytes() + 2 * MATMUL_SCRATCH);
    let (s0, s1) = (p.plan.scratch[mm[0]].unwrap(), p.plan.scratch[mm[1]].unwrap());
    assert!(s0.offset < s1.offset + s1.bytes && s1.offset < s0.offset + s0.bytes, "no reuse: {s0:?} {s1:?}");
    // LOAD counts backend scratch (a buffer of class scratch), so the arena stays at LOAD.
    assert!(p.report.load_bytes >= MATMUL_SCRATCH);
    assert!(p.report.ratio() <= 1.02, "arena {} vs LOAD {}", p.report.arena_bytes, p.report.load_bytes);
    let c = p.report.classes.iter().find(|c| c.class == Class::Scratch).unwrap();
    assert_eq!(c.values, 2);
    assert_eq!(c.bytes, 2 * MATMUL_SCRATCH);
    assert!(p.svg().contains("scratch"));
    assert_runs_like_eval(&p);
}

#[test]
fn backend_scratch_adds_to_the_ops_own() {
    // linear_cross_entropy has scratch of its own; the backend's part follows it.
    let g = Graph::new("lce");
    let (n, c, v) = (24, 16, 40);
    let x = g.data("x", DType::F32, &[n, c]).unwrap();
    let targets = g.data("targets", DType::I64, &[n]).unwrap();
    let head = g.param("head", DType::F32, &[v, c]).unwrap();
    let loss = x.linear_cross_entropy(&head, &targets, -100, 8).unwrap();
    g.output(&loss, "loss").unwrap();
    let trace = g.finish().unwrap();
    let extra = 1000; // not a multiple of ALIGN: the planner rounds it up
    let backend = BackendScratch::new(move |op, at, _| Ok(if op.scratch_bytes(at) > 0 { extra } else { 0 }));
    let p = plan(
        &trace,
        &CompileOptions {
            plan: PlanOptions { backend_scratch: Some(backend), ..Default::default() },
            ..Default::default()
        },
    )
    .unwrap();
    check(&p.trace, &p.plan).unwrap();
    let i = p.trace.nodes.iter().position(|n| n.op.name() == "linear_cross_entropy").unwrap();
    let at: Vec<&TensorType> = p.trace.nodes[i].args.iter().map(|a| p.trace.ty(*a)).collect();
    let own = p.trace.nodes[i].op.scratch_bytes(&at);
    let s = p.plan.scratch[i].unwrap();
    assert_eq!(p.plan.backend_scratch[i], 1024);
    assert_eq!(s.bytes, own.div_ceil(ALIGN) * ALIGN + 1024);
    let b = p.plan.backend_scratch_slot(i).unwrap();
    assert!(b.offset >= s.offset + own, "the backend part overlaps the op's");
    assert_eq!(b.offset + b.bytes, s.offset + s.bytes);
    assert!(p.report.at_peak.iter().any(|b| b.ty.contains("1024 backend")), "{:?}", p.report.at_peak);
    assert_runs_like_eval(&p);
}

#[test]
fn checker_verifies_backend_scratch() {
    let p = plan_two_matmuls();
    let (t, good) = (&p.trace, &p.plan);
    check(t, good).unwrap();
    let n = matmul_nodes(t)[1];
    let expect_err = |bad: &rumble_core::plan::MemoryPlan, what: &str| {
        let e = check(t, bad).expect_err(what).to_string();
        assert!(e.contains("scratch"), "{what}: {e}");
    };
    // Smaller than the backend asked for.
    let mut bad = good.clone();
    bad.scratch[n].as_mut().unwrap().bytes -= ALIGN;
    expect_err(&bad, "a short range");
    // A backend part bigger than the range holds.
    let mut bad = good.clone();
    bad.backend_scratch[n] += ALIGN;
    expect_err(&bad, "backend part over the range");
    // Not aligned.
    let mut bad = good.clone();
    bad.backend_scratch[n] = MATMUL_SCRATCH - 8;
    expect_err(&bad, "unaligned backend part");
    // Missing entries.
    let mut bad = good.clone();
    bad.backend_scratch.pop();
    expect_err(&bad, "too few entries");
    // No range at all.
    let mut bad = good.clone();
    bad.scratch[n] = None;
    expect_err(&bad, "no range");
    // Moved onto the matmul's own operand, live at its step.
    let mut bad = good.clone();
    let arg = t.nodes[n].args.iter().find(|a| good.slot(**a).unwrap().region == rumble_core::plan::Region::Arena);
    bad.scratch[n].as_mut().unwrap().offset = good.slot(*arg.unwrap()).unwrap().offset;
    expect_err(&bad, "scratch over a live operand");
    // More than asked for is fine: a bigger range of its own at the end of the arena.
    let mut big = good.clone();
    let s = big.scratch[n].as_mut().unwrap();
    s.offset = good.arena_bytes;
    s.bytes += 4 * ALIGN;
    big.arena_bytes += s.bytes;
    check(t, &big).unwrap();
    let b = big.backend_scratch_slot(n).unwrap();
    assert_eq!((b.offset % ALIGN, b.bytes), (0, MATMUL_SCRATCH));
}

#[test]
fn backend_errors_name_the_node() {
    let trace = two_matmuls();
    let backend = BackendScratch::new(|op, at, _| {
        if matches!(op, Op::Reduce { .. }) {
            Err(rumble_core::Error::Unsupported { backend: "test".into(), what: format!("reduce of {}", at[0]) })
        } else {
            Ok(0)
        }
    });
    let e = plan(
        &trace,
        &CompileOptions {
            plan: PlanOptions { backend_scratch: Some(backend), ..Default::default() },
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("backend scratch of node") && e.contains("reduce") && e.contains("f32[64,16,16]"), "{e}");
}

/// A backend keyed by op and types, like the CUDA one: matmuls ask for a workspace that depends
/// on their shape, RMSNorm's backward for partial sums, cross-entropy for row statistics.
fn shape_backend() -> BackendScratch {
    BackendScratch::new(|op, at, _| {
        Ok(match op {
            Op::Matmul { .. } => (at[0].numel() + at[1].numel()) * 4 + 1000,
            Op::RmsNormBackward { .. } => at[0].numel() / at[0].shape.last() * 4 + 64 * at[0].shape.last() * 4,
            Op::CrossEntropy { .. } | Op::CrossEntropyBackward { .. } => at[0].dims()[0] * 12,
            _ => 0,
        })
    })
}

#[test]
fn scheduled_and_rematerialised_steps_keep_each_nodes_scratch() {
    let cfg = TinyLlama { layers: 2, dtype: DType::F32, ..TinyLlama::default() };
    let backend = shape_backend();
    for opt in [Optimizer::Sgd { lr: 0.1 }, Optimizer::adamw(1e-3)] {
        let trace = cfg.train_step(opt).unwrap();
        for remat in [Remat::Off, Remat::Auto] {
            let opts = CompileOptions {
                remat,
                plan: PlanOptions { backend_scratch: Some(backend.clone()), ..Default::default() },
                ..Default::default()
            };
            let p = plan(&trace, &opts).unwrap();
            check(&p.trace, &p.plan).unwrap();
            // The planned trace is reordered; every node still has its own op's scratch.
            let want = backend.per_node(&p.trace).unwrap();
            assert_eq!(p.plan.backend_scratch, want);
            assert!(want.iter().filter(|&&b| b > 0).count() >= 2 * cfg.layers);
            for (n, &b) in want.iter().enumerate() {
                if b > 0 {
                    assert_eq!(p.plan.backend_scratch_slot(n).unwrap().bytes, b);
                }
            }
            assert!(p.report.ratio() <= 1.02, "{opt:?} {remat:?}: arena/LOAD {}", p.report.ratio());
            assert_runs_like_eval(&p);
        }
    }
}

#[test]
fn per_node_scratch_beats_a_whole_step_workspace_on_a_training_step() {
    let cfg = TinyLlama {
        vocab: 512,
        dim: 128,
        heads: 4,
        kv_heads: 2,
        hidden: 344,
        layers: 3,
        batch: 2,
        seq: 64,
        dtype: DType::BF16,
    };
    let trace = cfg.train_step(Optimizer::adamw(1e-3)).unwrap();
    let backend = shape_backend();
    let p = plan(
        &trace,
        &CompileOptions {
            plan: PlanOptions { backend_scratch: Some(backend.clone()), ..Default::default() },
            ..Default::default()
        },
    )
    .unwrap();
    check(&p.trace, &p.plan).unwrap();
    let most = backend.per_node(&trace).unwrap().into_iter().max().unwrap();
    let ws = plan(
        &trace,
        &CompileOptions { plan: PlanOptions { workspace_bytes: most, ..Default::default() }, ..Default::default() },
    )
    .unwrap();
    println!(
        "tiny llama bf16 x3: per-node scratch arena {} (LOAD {}, ratio {:.3}); whole-step workspace {} + values {} = {}",
        p.plan.arena_bytes,
        p.report.load_bytes,
        p.report.ratio(),
        ws.plan.workspace_bytes,
        ws.plan.values_bytes(),
        ws.plan.arena_bytes
    );
    assert!(p.plan.arena_bytes < ws.plan.arena_bytes);
    assert!(p.report.ratio() <= 1.02);
    assert_eq!(p.report.peak_bytes, p.report.persistent_bytes + p.report.arena_bytes);
    // The inputs were not reordered.
    assert!(p.trace.inputs.iter().zip(&trace.inputs).all(|(a, b)| a.name == b.name && a.role == b.role));
    assert!(p.trace.inputs.iter().any(|i| i.role == InputRole::Param));
}

/// The fused loss's chunk buffers: the logits in the statistics dtype (f32 for bf16 operands),
/// their gradient in the operands' dtype (what the matmuls after it read), nothing wider.
#[test]
fn linear_cross_entropy_scratch_holds_the_gradient_in_the_operand_dtype() {
    let a = |n: usize| n.div_ceil(256) * 256;
    let (n, c, v, chunk) = (64, 32, 1000, 16);
    for (dt, tsz, ssz) in [(DType::BF16, 2, 4), (DType::F32, 4, 4), (DType::F64, 8, 8)] {
        let x = TensorType::new(dt, vec![n, c]);
        let w = TensorType::new(dt, vec![v, c]);
        let tg = TensorType::new(DType::I64, vec![n]);
        let dloss = TensorType::scalar(if dt == DType::F64 { DType::F64 } else { DType::F32 });
        let (logits, grad) = (a(chunk * v * ssz), a(chunk * v * tsz));
        let fwd = Op::LinearCrossEntropy { ignore_index: -100, chunk };
        assert_eq!(fwd.scratch_bytes(&[&x, &w, &tg]), logits + a(n * 8) + a(n * 4), "{dt:?} forward");
        let lse = TensorType::new(dloss.dtype, vec![n]);
        let bwd = Op::LinearCrossEntropyBackward { ignore_index: -100, chunk };
        assert_eq!(bwd.scratch_bytes(&[&x, &w, &tg, &lse, &dloss]), logits + grad + a(4), "{dt:?} backward");
        let both = Op::LinearCrossEntropyGrad { ignore_index: -100, chunk };
        let want = logits + grad + a(4) + a(n * 8) + a(n * 4) + a(n * ssz);
        assert_eq!(both.scratch_bytes(&[&x, &w, &tg, &dloss]), want, "{dt:?} fused gradient");
    }
}
