//! Property tests of the memory planner on random DAG traces: views, in-place chains, updates
//! of parameters and optimizer state, values read across phases. For every trace and option
//! set (per-node backend scratch included; and after fusion), the independent checker
//! accepts the plan, the arena is at least LOAD, the passes keep the program's results, and
//! the arena executor matches `cpu::eval` bit for bit.

use proptest::prelude::*;
use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, InputRole, OutputRole, Phase, Tensor, Trace, verify};
use rumble_core::passes::remat::Remat;
use rumble_core::plan::{BackendScratch, PlanOptions, check::check};

/// Builds a random trace from `choices` (each `(kind, a, b)` picks an op and two operands).
fn random_trace(choices: &[(u8, u16, u16)], updates: u8) -> Trace {
    let g = Graph::new("random");
    let f = DType::F32;
    let x = g.data("x", f, &[4, 8]).unwrap();
    let p0 = g.param("p0", f, &[4, 8]).unwrap();
    let p1 = g.param("p1", f, &[8, 8]).unwrap();
    let s0 = g.input("s0", rumble_core::TensorType::new(f, [4, 8]), InputRole::OptState).unwrap();
    let mut pool: Vec<Tensor> = vec![x, p0.clone(), p1.clone(), s0.clone()];
    let n = choices.len();
    for (k, &(kind, a, b)) in choices.iter().enumerate() {
        g.set_phase(if k < n / 2 { Phase::Forward } else { Phase::Backward });
        let a = pool[a as usize % pool.len()].clone();
        let same = |b: u16| {
            let start = b as usize % pool.len();
            (0..pool.len()).map(|i| &pool[(start + i) % pool.len()]).find(|t| t.ty() == a.ty()).cloned()
        };
        let dims = a.dims().to_vec();
        let r = dims.len();
        let t = match kind % 13 {
            0 => a.tanh(),
            1 => a.add(&same(b).unwrap_or_else(|| a.clone())),
            2 => a.mul(&same(b).unwrap_or_else(|| a.clone())),
            3 if b % 2 == 0 => a.reshape(&[a.ty().numel()]),
            3 => a.reshape(&[&[1][..], &dims[..]].concat()),
            4 if dims[0] > 1 => a.slice(0, (b as usize) % (dims[0] - 1), dims[0]),
            5 if r >= 2 && dims[r - 1] > 1 => a.slice(r - 1, 0, 1 + (b as usize) % (dims[r - 1] - 1)),
            6 if r >= 2 => a.transpose(r - 2, r - 1),
            7 if r == 2 => {
                let m = pool.iter().find(|t| t.rank() == 2 && t.dims()[0] == dims[1]).cloned();
                match m {
                    Some(m) => a.matmul(&m),
                    None => a.matmul_t(&a),
                }
            }
            8 if r >= 1 => a.sum(&[r - 1], true).and_then(|s| s.broadcast_to(&dims)),
            9 => a.mul_scalar(0.5 + (b % 4) as f64),
            10 if r >= 1 => {
                let w = g.param(&format!("w{k}"), f, &[dims[r - 1]]).unwrap();
                a.rms_norm(&w, 1e-6)
            }
            11 if r >= 1 => Tensor::concat(&[&a, &a], 0),
            12 if r == 2 => a.reshape(&[dims[0], 1, dims[1]]).and_then(|t| t.transpose(0, 1)),
            _ => a.sigmoid(),
        }
        .unwrap();
        pool.push(t);
    }
    g.set_phase(Phase::Optimizer);
    let last = pool.last().unwrap().clone();
    g.output(&last, "out").unwrap();
    if let Some(extra) = pool.get(pool.len() / 2) {
        let _ = g.output(extra, "mid");
    }
    let like = |t: &Tensor| pool.iter().rev().find(|q| q.ty() == t.ty() && q.id() != t.id()).cloned();
    if updates & 1 != 0 {
        // An in-place-able SGD-like update.
        let d = like(&p0).unwrap_or_else(|| p0.clone());
        let new = p0.sub(&d.mul_scalar(0.1).unwrap()).unwrap();
        g.output_with_role(&new, "new.p0", OutputRole::Update { of: p0.id() }).unwrap();
    }
    if updates & 2 != 0 {
        let d = like(&s0).unwrap_or_else(|| s0.clone());
        let new = s0.mul_scalar(0.9).unwrap().add(&d).unwrap();
        g.output_with_role(&new, "new.s0", OutputRole::Update { of: s0.id() }).unwrap();
    }
    if updates & 4 != 0 {
        // An update that is some other value: copied back unless it happens to chain.
        let d = like(&p1).unwrap_or_else(|| p1.clone());
        g.output_with_role(&d, "new.p1", OutputRole::Update { of: p1.id() }).unwrap();
    }
    if updates & 8 != 0 {
        // A parameter that is also read after its update is computed.
        let new = p1.mul_scalar(0.5).unwrap();
        let after = new.add(&p1).unwrap();
        let _ = g.output(&after, "after");
        let _ = g.output_with_role(&new, "new2.p1", OutputRole::Update { of: p1.id() });
    }
    g.finish().unwrap()
}

fn inputs(trace: &Trace, seed: u64) -> Vec<HostTensor> {
    let mut rng = Rng::new(seed);
    trace.inputs.iter().map(|i| HostTensor::randn(trace.ty(i.value).clone(), 0.7, &mut rng)).collect()
}

fn option_sets() -> Vec<CompileOptions> {
    vec![
        CompileOptions { schedule: false, ..Default::default() },
        CompileOptions {
            schedule: false,
            plan: PlanOptions { inplace: false, ..Default::default() },
            ..Default::default()
        },
        CompileOptions::default(),
        CompileOptions {
            remat: Remat::Auto,
            plan: PlanOptions { workspace_bytes: 300, ..Default::default() },
            ..Default::default()
        },
        CompileOptions { remat: Remat::Budget { peak_bytes: 4096 }, ..Default::default() },
        // Backend scratch per node, sized from the op and its types (unaligned sizes too).
        CompileOptions {
            plan: PlanOptions {
                backend_scratch: Some(BackendScratch::new(|op, at, ot| {
                    Ok(match op.name().len() % 3 {
                        0 => 0,
                        1 => at.iter().map(|t| t.size_in_bytes()).sum::<usize>() + 12,
                        _ => ot.first().map_or(0, |t| 3 * t.size_in_bytes() + 1),
                    })
                })),
                ..Default::default()
            },
            ..Default::default()
        },
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn plans_of_random_dags_check_and_run(
        choices in prop::collection::vec((any::<u8>(), any::<u16>(), any::<u16>()), 1..40),
        updates in 0u8..16,
        seed in any::<u64>(),
    ) {
        let unfused = random_trace(&choices, updates);
        let want = cpu::eval(&unfused, &inputs(&unfused, seed)).unwrap();
        let fused = Some(rumble_core::passes::fuse(&unfused).expect("fusion keeps every random graph acyclic"));
        let variants = option_sets().into_iter().map(|o| (&unfused, o));
        for (trace, opts) in variants.chain(fused.iter().map(|f| (f, CompileOptions::default()))) {
            let p = plan(trace, &opts).unwrap();
            verify(&p.trace).unwrap();
            check(&p.trace, &p.plan).map_err(|e| TestCaseError::fail(format!("{e}\n{}", p.trace)))?;
            let r = &p.report;
            prop_assert!(r.arena_bytes >= r.load_bytes, "arena {} < LOAD {}", r.arena_bytes, r.load_bytes);
            prop_assert!(r.arena_bytes <= r.no_reuse_bytes);
            let got = cpu::arena::eval(&p.trace, &p.plan, &inputs(&p.trace, seed)).unwrap();
            for o in &unfused.outputs {
                let k = p.trace.outputs.iter().position(|q| q.name == o.name).unwrap();
                let w = &want[unfused.outputs.iter().position(|q| q.name == o.name).unwrap()];
                prop_assert!(w.bytes == got[k].bytes, "output \"{}\" differs\n{}", o.name, p.trace);
            }
        }
    }
}

#[test]
fn checker_rejects_broken_plans() {
    let trace = random_trace(&[(0, 0, 0), (1, 4, 0), (7, 5, 2), (3, 6, 0), (0, 7, 0), (9, 8, 1)], 3);
    let good = plan(&trace, &CompileOptions { schedule: false, ..Default::default() }).unwrap();
    let t = &good.trace;
    check(t, &good.plan).unwrap();
    let owners: Vec<usize> = (0..t.num_values())
        .filter(|&i| {
            good.plan.alias_of[i].is_none() && good.plan.slots[i].unwrap().region == rumble_core::plan::Region::Arena
        })
        .collect();
    // Moving any arena buffer onto another live at the same time must be caught.
    let mut caught = 0;
    for &a in &owners {
        for &b in &owners {
            let (sa, sb) = (good.plan.slots[a].unwrap(), good.plan.slots[b].unwrap());
            if a == b || sa.bytes != sb.bytes || sa.offset == sb.offset {
                continue;
            }
            let mut bad = good.plan.clone();
            bad.slots[a] = Some(sb);
            bad.inplace_of[a] = None;
            if check(t, &bad).is_err() {
                caught += 1;
            }
        }
    }
    assert!(caught > 0, "no collision was caught");
    // An alias pointing at the wrong offset.
    if let Some(v) = (0..t.num_values()).find(|&i| good.plan.alias_of[i].is_some()) {
        let mut bad = good.plan.clone();
        bad.slots[v].as_mut().unwrap().offset += 4;
        assert!(check(t, &bad).unwrap_err().to_string().contains("view"));
    }
    // A value without a slot.
    let mut bad = good.plan.clone();
    bad.slots[0] = None;
    assert!(check(t, &bad).unwrap_err().to_string().contains("no slot"));
}

/// The generator is only worth its cases if they exercise what can go wrong: views (slices at
/// an offset among them), in-place results, updates in their parameter's slot, copies back.
#[test]
fn random_dags_exercise_views_inplace_and_updates() {
    let mut rng = Rng::new(3);
    let (mut views, mut inplace, mut copy, mut chains, mut slices) = (0, 0, 0, 0, 0);
    for _ in 0..300 {
        let n = 1 + rng.below(40) as usize;
        let choices: Vec<(u8, u16, u16)> =
            (0..n).map(|_| (rng.below(256) as u8, rng.below(65536) as u16, rng.below(65536) as u16)).collect();
        let t = random_trace(&choices, rng.below(16) as u8);
        let p = plan(&t, &CompileOptions::default()).unwrap();
        views += (p.report.views > 0) as usize;
        inplace += (p.report.inplace > 0) as usize;
        copy += (p.report.copy_back > 0) as usize;
        let slot = |v: rumble_core::ValueId| p.plan.slot(v).unwrap();
        slices += p.trace.nodes.iter().any(|n| {
            n.op.name() == "slice" && p.plan.is_alias(n.outs[0]) && slot(n.outs[0]).offset != slot(n.args[0]).offset
        }) as usize;
        chains += p.trace.inputs.iter().filter(|i| i.role.is_persistent()).any(|i| {
            p.trace.outputs.iter().any(|o| {
                o.role == OutputRole::Update { of: i.value } && o.value != i.value && slot(o.value) == slot(i.value)
            })
        }) as usize;
    }
    println!(
        "of 300 traces: {views} with views, {slices} with offset slices, {inplace} in place, {chains} updates in place, {copy} copies back"
    );
    for (what, n) in
        [("views", views), ("offset slices", slices), ("in place", inplace), ("chains", chains), ("copies", copy)]
    {
        assert!(n >= 30, "only {n} of 300 random traces have {what}");
    }
}

#[test]
fn degenerate_traces_plan_and_run() {
    let texts = [
        // No nodes: an input returned as is, a parameter "updated" to itself.
        r#"trace "empty" {
  input %0: f32[3] "x" input
  input %1: f32[2,2] "p" param
  output %0 "y"
  output %1 "new.p" update_of=%1
}"#,
        // An update that is a view of all of its parameter, and one that is another parameter.
        r#"trace "views" {
  input %0: f32[2,2] "p" param
  input %1: f32[4] "q" param
  input %2: f32[4] "r" param
  %3: f32[4] = reshape(%0) shape=[4]
  %4: f32[2,2] = reshape(%3) shape=[2,2]
  output %4 "new.p" update_of=%0
  output %2 "new.q" update_of=%1
  output %3 "flat"
}"#,
        // A parameter read after its update is computed: no in-place update, a copy back.
        r#"trace "late" {
  input %0: f32[4] "p" param
  %1: f32[4] = mul_scalar(%0) value=0.5
  %2: f32[4] = add(%1, %0)
  output %1 "new.p" update_of=%0
  output %2 "sum"
}"#,
    ];
    for text in texts {
        let t = rumble_core::ir::parse(text).unwrap();
        for opts in option_sets() {
            let p = plan(&t, &opts).unwrap();
            check(&p.trace, &p.plan).unwrap();
            let ins = inputs(&p.trace, 1);
            let want = cpu::eval(&p.trace, &ins).unwrap();
            let mut ex = cpu::arena::ArenaExecutor::new(&p.trace, &p.plan).unwrap();
            ex.load(&ins).unwrap();
            let got = ex.step().unwrap();
            assert!(want.iter().zip(&got).all(|(a, b)| a.bytes == b.bytes), "{}", t.name);
            // After the step each parameter holds its update.
            let mut next = ins.clone();
            cpu::apply_updates(&p.trace, &mut next, &want);
            for (i, inp) in p.trace.inputs.iter().enumerate() {
                assert!(ex.value(inp.value).unwrap().bytes == next[i].bytes, "{}: \"{}\"", t.name, inp.name);
            }
        }
    }
}
