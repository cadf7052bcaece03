//! Kernel scratch planned per node (`Program::plan_options`): a TinyLlama training step with
//! matmuls has no whole-step workspace, every node's recipe scratch lies in its own planned
//! range (checked by the core checker), the planned and graphed executors give the eager
//! executor's results bit for bit, the arena is no larger than with a whole-step workspace, and
//! a plan short of a node's scratch is refused naming the node. Skips without a GPU.

mod common;

use std::sync::Arc;

use common::{gpu, init_params, tiny_step, tiny_steps, train};
use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::Rng;
use rumble_core::ir::{DType, Op};
use rumble_core::plan::{PlanOptions, check::check};
use rumble_cuda::{EagerExecutor, Executor, GraphMode, GraphedExecutor, PlannedExecutor, Program};

#[test]
#[ignore = "needs a CUDA device"]
fn per_node_scratch_has_no_workspace_and_matches_eager_bit_for_bit() {
    let dev = gpu();
    for (dtype, c, trace) in tiny_steps() {
        let prog = Arc::new(Program::planned(dev.clone(), &trace, &PlanOptions::default()).expect("compile"));
        let (t, p) = (&prog.trace, &prog.plan);
        assert!(t.nodes.iter().any(|n| matches!(n.op, Op::Matmul { .. })));
        assert_eq!(p.workspace_bytes, 0, "{dtype}: the CUDA plan keeps no whole-step workspace");
        check(t, p).expect("the core checker accepts the plan");
        let mut with = Vec::new();
        for (n, r) in prog.recipes.iter().enumerate() {
            if r.scratch == 0 {
                continue;
            }
            let s = p.backend_scratch_slot(n).unwrap_or_else(|| panic!("node {n} ({}) has no scratch range", r.op));
            assert!(s.bytes >= r.scratch, "node {n} ({}): {} < {}", r.op, s.bytes, r.scratch);
            assert_eq!(prog.scratch_range(n), (s.offset, s.bytes));
            with.push(r.op);
        }
        assert!(!with.is_empty(), "{dtype}: some node should need kernel scratch");
        // The same step with one whole-step workspace of the most any node needs.
        let ws = Program::workspace_bytes(&dev, &trace).expect("workspace");
        let opts =
            CompileOptions { plan: PlanOptions { workspace_bytes: ws, ..Default::default() }, ..Default::default() };
        let whole = plan(&trace, &opts).expect("plan");
        println!(
            "{dtype}: {} nodes with kernel scratch ({with:?}); arena {} (LOAD {}) per node vs {} with a {ws}-byte \
             workspace",
            with.len(),
            p.arena_bytes,
            p.load_bytes,
            whole.plan.arena_bytes
        );
        assert!(p.arena_bytes <= whole.plan.arena_bytes, "{dtype}: per-node scratch made the arena larger");

        let params = init_params(t, &mut Rng::new(1));
        let steps = 5;
        // Each step's loss, then every output and persistent input after the last.
        let run =
            |ex: &mut dyn Executor<Error = rumble_cuda::CudaError>| train(ex, &prog.trace, steps, c.vocab as u64, 5);
        let mut eager = EagerExecutor::new(prog.clone(), &params).expect("eager");
        let want = run(&mut eager);
        let mut planned = PlannedExecutor::new(prog.clone(), &params).expect("planned");
        planned.poison(0xFF).expect("poison");
        let mut graphed = GraphedExecutor::new(prog.clone(), &params, GraphMode::Whole).expect("graphed");
        for (name, ex) in
            [("planned", &mut planned as &mut dyn Executor<Error = rumble_cuda::CudaError>), ("graphed", &mut graphed)]
        {
            let got = run(ex);
            assert_eq!(got.0, want.0, "{dtype} {name}: losses differ from eager");
            assert_eq!(got.1.len(), want.1.len());
            for (k, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
                assert!(a.bytes == b.bytes, "{dtype} {name}: tensor {k} ({}) differs from eager", a.ty);
            }
        }
        let (gm, em) = (graphed.memory(), eager.memory());
        assert_eq!(gm.peak_bytes, p.peak_bytes());
        println!("{dtype}: graphed peak {} B, eager peak {} B", gm.peak_bytes, em.peak_bytes);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_plan_short_of_a_nodes_scratch_is_refused() {
    let dev = gpu();
    let trace = tiny_step(DType::F32).1;
    let prog = Program::planned(dev.clone(), &trace, &PlanOptions::default()).expect("compile");
    let n = prog.recipes.iter().position(|r| r.scratch > 0).expect("a node with kernel scratch");
    let mut bad = prog.plan.clone();
    bad.backend_scratch[n] = 0;
    let e = Program::new(dev.clone(), prog.trace.clone(), bad).err().expect("refused").to_string();
    assert!(e.contains(&format!("node {n}")) && e.contains("scratch"), "{e}");
}
