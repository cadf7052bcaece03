//! `passes::data_parallel` on a TinyLlama training step, run by the lockstep simulator
//! (`testing::simulate`): a global batch split over 2 and 4 ranks gives, after 3 AdamW steps,
//! the one-rank step's loss, parameters and optimizer state, under DDP and under ZeRO-1 (whose
//! state is gathered from the ranks' shards); ZeRO-1 keeps 1/world of the state per rank.

use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{InputRole, verify};
use rumble_core::passes::data_parallel::{DataParallel, DpPlan, Mode, data_parallel};
use rumble_core::testing::{Optimizer, TinyLlama, random_train_state, simulate};
use rumble_core::{DType, Trace};

const GLOBAL_BATCH: usize = 4;

fn model(batch: usize, dtype: DType) -> TinyLlama {
    TinyLlama { dtype, batch, layers: 2, ..TinyLlama::default() }
}

/// Norm-wise relative error of `a` against `b`.
fn rel_err(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.ty, b.ty);
    let (a, b) = (a.to_f64(), b.to_f64());
    let diff: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    diff / norm.max(1e-30)
}

fn rows(t: &HostTensor, rank: usize, world: usize) -> HostTensor {
    let n = t.ty.numel() / world;
    let v = t.to_i64();
    HostTensor::from_i64(t.ty.dtype, &[n], &v[rank * n..(rank + 1) * n]).unwrap()
}

fn by_name<'a>(t: &Trace, vals: &'a [HostTensor], name: &str) -> &'a HostTensor {
    &vals[t.inputs.iter().position(|i| i.name == name).unwrap_or_else(|| panic!("no input {name}"))]
}

/// Runs 3 steps on one rank and on `world` simulated ranks; compares everything. In f64 the
/// ranks must agree to 1e-12 (the pass's arithmetic is exact); in f32 to 1e-6, what rounding
/// the sums of fewer rows in another order leaves.
fn check(world: usize, mode: Mode, bucket_bytes: usize, dtype: DType) {
    let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
    let one = model(GLOBAL_BATCH, dtype).train_step(Optimizer::adamw(1e-2)).unwrap();
    let step = model(GLOBAL_BATCH / world, dtype).train_step(Optimizer::adamw(1e-2)).unwrap();
    let mut rng = Rng::new(11);
    // Parameters N(0, 0.2); moments small and random (exp_avg_sq non-negative).
    let mut inputs = random_train_state(&one, 0.2, 1e-2, &mut rng, |ty, rng| HostTensor::randn(ty, 1e-2, rng));
    let ranks: Vec<(Trace, DpPlan)> = (0..world)
        .map(|rank| {
            let (t, plan) = data_parallel(&step, &DataParallel { world, rank, mode, bucket_bytes }).unwrap();
            verify(&t).unwrap();
            (t, plan)
        })
        .collect();
    let traces: Vec<Trace> = ranks.iter().map(|(t, _)| t.clone()).collect();
    let plan = &ranks[0].1;
    assert!(plan.buckets.len() > 1 || bucket_bytes > 1 << 16, "{} buckets", plan.buckets.len());
    let count = |t: &Trace, name: &str| t.nodes.iter().filter(|n| n.op.name() == name).count();
    for t in &traces {
        match mode {
            Mode::Ddp => assert_eq!(count(t, "all_reduce"), plan.buckets.len() + 1, "buckets and the loss"),
            Mode::Zero1 => {
                assert_eq!(count(t, "reduce_scatter"), plan.buckets.len());
                assert_eq!(count(t, "all_gather"), plan.buckets.len());
            }
        }
    }
    // Each rank's inputs: its rows of the batch, the parameters, the (sharded) states.
    let mut rank_inputs: Vec<Vec<HostTensor>> = ranks
        .iter()
        .map(|(t, plan)| plan.rank_inputs(t, &|n| Some(by_name(&one, &inputs, n).clone())).unwrap())
        .collect();
    for s in 0..3 {
        let tokens = HostTensor::randint(one.ty(one.inputs[0].value).clone(), 32, &mut rng);
        let targets = HostTensor::randint(one.ty(one.inputs[1].value).clone(), 32, &mut rng);
        inputs[0] = tokens.clone();
        inputs[1] = targets.clone();
        for (r, ri) in rank_inputs.iter_mut().enumerate() {
            ri[0] = rows(&tokens, r, world);
            ri[1] = rows(&targets, r, world);
        }
        let want = cpu::eval(&one, &inputs).unwrap();
        cpu::apply_updates(&one, &mut inputs, &want);
        let got = simulate(world, &traces, &rank_inputs).unwrap();
        for (r, ((t, _), out)) in ranks.iter().zip(&got).enumerate() {
            cpu::apply_updates(t, &mut rank_inputs[r], out);
            let loss = &out[t.outputs.iter().position(|o| o.name == "loss").unwrap()];
            let e = rel_err(loss, &want[0]);
            assert!(
                e <= tol,
                "{dtype} {mode:?} world {world} step {s} rank {r}: loss {loss:?} vs {:?} ({e:e})",
                want[0]
            );
        }
    }
    // Parameters on every rank, and the optimizer state (gathered from the shards for ZeRO-1).
    let gathered = match mode {
        Mode::Zero1 => {
            let shards: Vec<Vec<HostTensor>> = ranks
                .iter()
                .zip(&rank_inputs)
                .map(|((t, plan), vals)| plan.shard_states.iter().map(|s| by_name(t, vals, &s.name).clone()).collect())
                .collect();
            plan.gather_states(&shards).unwrap()
        }
        Mode::Ddp => Vec::new(),
    };
    let mut checked = 0;
    for (i, want) in one.inputs.iter().zip(&inputs) {
        let gots: Vec<HostTensor> = match (i.role, mode) {
            (InputRole::Param, _) | (InputRole::OptState, Mode::Ddp) => {
                ranks.iter().zip(&rank_inputs).map(|((t, _), v)| by_name(t, v, &i.name).clone()).collect()
            }
            (InputRole::OptState, Mode::Zero1) => {
                vec![gathered.iter().find(|(n, _)| *n == i.name).expect("every state is gathered").1.clone()]
            }
            _ => continue,
        };
        for got in gots {
            let e = rel_err(&got, want);
            // The moments carry their gradients' rounding (the same rows summed in another order) from
            // every step, and v squares it: twice the tolerance.
            let tol = if i.role == InputRole::OptState { 2.0 * tol } else { tol };
            assert!(e <= tol, "{dtype} {mode:?} world {world}: `{}` differs after 3 steps (rel. err {e:e})", i.name);
            checked += 1;
        }
    }
    assert!(checked >= one.inputs.len() - 2, "checked {checked}");
}

#[test]
fn ddp_over_2_and_4_ranks_equals_one_rank() {
    check(2, Mode::Ddp, 1500, DType::F32);
    check(4, Mode::Ddp, 1500, DType::F32);
    check(4, Mode::Ddp, DataParallel::DEFAULT_BUCKET_BYTES, DType::F32);
    check(4, Mode::Ddp, 3000, DType::F64);
}

#[test]
fn zero1_over_2_and_4_ranks_equals_one_rank() {
    check(2, Mode::Zero1, 1500, DType::F32);
    check(4, Mode::Zero1, 1500, DType::F32);
    check(2, Mode::Zero1, DataParallel::DEFAULT_BUCKET_BYTES, DType::F32);
    check(4, Mode::Zero1, 3000, DType::F64);
    check(2, Mode::Zero1, 700, DType::F64);
}

#[test]
fn zero1_keeps_a_world_th_of_the_optimizer_state_per_rank() {
    let step = model(1, DType::F32).train_step(Optimizer::adamw(1e-2)).unwrap();
    let state: usize =
        step.inputs.iter().filter(|i| i.role == InputRole::OptState).map(|i| step.ty(i.value).numel()).sum();
    for world in [2, 3, 4] {
        for rank in 0..world {
            let (t, plan) =
                data_parallel(&step, &DataParallel { world, rank, mode: Mode::Zero1, bucket_bytes: 1500 }).unwrap();
            let mine: usize =
                t.inputs.iter().filter(|i| i.role == InputRole::OptState).map(|i| t.ty(i.value).numel()).sum();
            let padding: usize = plan.buckets.iter().map(|b| b.padded - b.numel).sum::<usize>() * 2; // 2 moments
            assert_eq!(mine * world, state + padding, "world {world} rank {rank}");
            assert!(padding < 2 * world * plan.buckets.len());
            assert!(t.inputs.iter().all(|i| !i.name.ends_with(".exp_avg")), "whole states are gone");
        }
    }
}

#[test]
fn gradients_come_last_layer_first() {
    let step = model(2, DType::F32).train_step(Optimizer::adamw(1e-2)).unwrap();
    let dp = DataParallel { world: 2, rank: 0, mode: Mode::Ddp, bucket_bytes: DataParallel::DEFAULT_BUCKET_BYTES };
    let (_, plan) = data_parallel(&step, &dp).unwrap();
    let names: Vec<&str> = plan.grads.iter().map(|g| g.param.as_str()).collect();
    let pos = |n: &str| names.iter().position(|x| *x == n).unwrap_or_else(|| panic!("{n} not in {names:?}"));
    assert_eq!(names.len(), step.inputs.iter().filter(|i| i.role == InputRole::Param).count());
    assert!(pos("lm_head.weight") < pos("layers.1.down_proj.weight"), "{names:?}");
    assert!(pos("layers.1.q_proj.weight") < pos("layers.0.down_proj.weight"), "{names:?}");
    assert_eq!(*names.last().unwrap(), "embed_tokens.weight", "{names:?}");
    assert_eq!(plan.grads[0].states.len(), 2, "AdamW's two moments");
    assert_eq!(plan.buckets.len(), 1);
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let adam = model(1, DType::F32).train_step(Optimizer::adamw(1e-2)).unwrap();
    let grads = model(1, DType::F32).train_step(Optimizer::None).unwrap();
    let dp = |world, rank, mode| DataParallel { world, rank, mode, bucket_bytes: 1 << 20 };
    let e = data_parallel(&adam, &dp(2, 2, Mode::Ddp)).unwrap_err().to_string();
    assert!(e.contains("rank 2 is not one of world 2"), "{e}");
    let e = data_parallel(&grads, &dp(2, 0, Mode::Zero1)).unwrap_err().to_string();
    assert!(e.contains("ZeRO-1") && e.contains("no optimizer update"), "{e}");
    let (once, _) = data_parallel(&adam, &dp(2, 0, Mode::Ddp)).unwrap();
    let e = data_parallel(&once, &dp(2, 0, Mode::Ddp)).unwrap_err().to_string();
    assert!(e.contains("already holds a collective"), "{e}");
    // No optimizer: DDP averages the gradient outputs.
    let (t, plan) = data_parallel(&grads, &dp(2, 1, Mode::Ddp)).unwrap();
    assert_eq!(
        plan.grads.len(),
        t.outputs.iter().filter(|o| matches!(o.role, rumble_core::ir::OutputRole::Grad { .. })).count()
    );
}

/// Every rank must meet the same collectives in the same order after `compile` (its schedule
/// reorders nodes for memory), and the compiled rank traces still equal the one-rank step.
#[test]
fn compiled_rank_traces_keep_one_collective_order() {
    use rumble_core::compile::{CompileOptions, compile};
    for (world, mode) in [(2, Mode::Ddp), (2, Mode::Zero1), (4, Mode::Zero1)] {
        let step = model(GLOBAL_BATCH / world, DType::F32).train_step(Optimizer::adamw(1e-2)).unwrap();
        let order = |t: &Trace| -> Vec<String> {
            t.nodes
                .iter()
                .filter(|n| matches!(n.op, rumble_core::ir::Op::Collective { .. }))
                .map(|n| format!("{}({})", n.op.name(), t.ty(n.args[0])))
                .collect()
        };
        let (mut orders, mut plain, mut compiled) = (Vec::new(), Vec::new(), Vec::new());
        for rank in 0..world {
            let (t, _) = data_parallel(&step, &DataParallel { world, rank, mode, bucket_bytes: 1500 }).unwrap();
            let c = compile(&t, &CompileOptions::default()).unwrap().trace;
            assert_eq!(order(&c).len(), order(&t).len(), "{mode:?}: compile dropped a collective");
            orders.push(order(&c));
            plain.push(t);
            compiled.push(c);
        }
        for (r, o) in orders.iter().enumerate() {
            assert_eq!(
                o, &orders[0],
                "{mode:?} world {world}: rank {r}'s collectives run in another order than rank 0's"
            );
        }
        // Same inputs (by name) through the plain and the compiled rank traces.
        let mut rng = Rng::new(3);
        let inputs: Vec<Vec<HostTensor>> = plain
            .iter()
            .map(|t| {
                let mut v = rumble_core::testing::random_inputs(t, 32, 0.1, &mut rng);
                for (i, x) in t.inputs.iter().zip(v.iter_mut()) {
                    if i.role == InputRole::OptState {
                        // Non-negative moments (exp_avg_sq must be; ZeRO-1's shards do not say which is which).
                        *x = HostTensor::from_f64(
                            x.ty.dtype,
                            x.ty.dims(),
                            &x.to_f64().iter().map(|a| a * a).collect::<Vec<_>>(),
                        )
                        .unwrap();
                    }
                }
                v
            })
            .collect();
        let reordered: Vec<Vec<HostTensor>> = compiled
            .iter()
            .zip(plain.iter().zip(&inputs))
            .map(|(c, (t, v))| c.inputs.iter().map(|i| by_name(t, v, &i.name).clone()).collect())
            .collect();
        let want = simulate(world, &plain, &inputs).unwrap();
        let got = simulate(world, &compiled, &reordered).unwrap();
        for r in 0..world {
            for (o, w) in plain[r].outputs.iter().zip(&want[r]) {
                let at = compiled[r].outputs.iter().position(|x| x.name == o.name).expect("same outputs");
                let e = rel_err(&got[r][at], w);
                assert!(e <= 1e-6, "{mode:?} world {world} rank {r}: compiled `{}` differs ({e:e})", o.name);
            }
        }
    }
}

/// Compiled DDP rank traces leave backward work between most gradient all-reduces and the first
/// node reading their result (a device overlaps the two; the scheduler takes that among its
/// lowest-LOAD orders, and an all-reduce computed over its bucket makes it free). In both modes
/// the plan keeps a collective's operand live until its join, and the independent checker
/// holds it to that. (ZeRO-1's reduce-scatters cannot run over their operand: on this small
/// model overlapping them would cost bytes, and is not taken.)
#[test]
fn compiled_all_reduces_overlap_the_backward_at_no_memory_cost() {
    use rumble_core::compile::{CompileOptions, compile};
    use rumble_core::ir::{Op, collective_joins};
    for mode in [Mode::Ddp, Mode::Zero1] {
        let step = model(GLOBAL_BATCH / 2, DType::F32).train_step(Optimizer::adamw(1e-2)).unwrap();
        let (t, plan) = data_parallel(&step, &DataParallel { world: 2, rank: 0, mode, bucket_bytes: 1500 }).unwrap();
        assert!(plan.buckets.len() > 2, "{mode:?}: {} buckets", plan.buckets.len());
        let c = compile(&t, &CompileOptions::default()).unwrap();
        rumble_core::plan::check::check(&c.trace, &c.plan).unwrap();
        let joins = collective_joins(&c.trace);
        let backward_between = |&(k, j): &(usize, usize)| {
            c.trace.nodes[k + 1..j].iter().filter(|n| n.phase == rumble_core::ir::Phase::Backward).count()
        };
        let overlapped = joins.iter().filter(|cj| backward_between(cj) > 0).count();
        if mode == Mode::Ddp {
            // Each all-reduce runs over its bucket, so deferring its join costs no bytes here.
            assert!(overlapped * 2 >= plan.buckets.len(), "{overlapped} of {} buckets overlap", plan.buckets.len());
        }
        // Every operand not under its result lives until the join.
        for &(k, j) in &joins {
            let (a, o) = (c.trace.nodes[k].args[0], c.trace.nodes[k].outs[0]);
            let life = &c.lifetimes.values;
            if life[o.index()].inplace_of != Some(a) {
                assert!(
                    life[a.index()].last > j,
                    "{mode:?}: collective {k}'s operand dies at {} before its join {j}",
                    life[a.index()].last
                );
            }
        }
        if mode == Mode::Ddp {
            let in_place = joins.iter().filter(|&&(k, _)| {
                let n = &c.trace.nodes[k];
                matches!(n.op, Op::Collective { .. })
                    && c.lifetimes.values[n.outs[0].index()].inplace_of == Some(n.args[0])
            });
            assert!(in_place.count() > 0, "no all_reduce computed over its bucket");
        }
    }
}

#[test]
fn rank_traces_print_and_parse_back() {
    let step = model(2, DType::F32).train_step(Optimizer::adamw(1e-2)).unwrap();
    for mode in [Mode::Ddp, Mode::Zero1] {
        let (t, _) = data_parallel(&step, &DataParallel { world: 2, rank: 1, mode, bucket_bytes: 1500 }).unwrap();
        assert_eq!(rumble_core::ir::parse(&t.to_string()).unwrap(), t, "{mode:?}");
    }
}

/// The planner's figures: DDP keeps the whole optimizer state on every rank, ZeRO-1 a
/// `1/world` shard of it (plus padding), so its persistent region is smaller by about half the
/// state at `world = 2`.
#[test]
fn zero1_plans_half_the_optimizer_state_at_world_2() {
    use rumble_core::compile::{CompileOptions, compile};
    let (world, b) = (2, 2);
    // Wide enough that alignment is a small part of each buffer.
    let m = TinyLlama { vocab: 256, dim: 64, hidden: 128, ..model(b, DType::F32) };
    let step = m.train_step(Optimizer::adamw(1e-2)).unwrap();
    let state_bytes: usize =
        step.inputs.iter().filter(|i| i.role == InputRole::OptState).map(|i| step.ty(i.value).size_in_bytes()).sum();
    let plan = |t: &Trace| compile(t, &CompileOptions::default()).unwrap().plan;
    let alone = plan(&step);
    let dp = |mode| data_parallel(&step, &DataParallel { world, rank: 0, mode, bucket_bytes: 40_000 }).unwrap();
    let ddp = plan(&dp(Mode::Ddp).0);
    let (z, zplan) = dp(Mode::Zero1);
    let zero1 = plan(&z);
    assert_eq!(ddp.persistent_bytes, alone.persistent_bytes, "DDP keeps every persistent buffer");
    let padding: usize = zplan.buckets.iter().map(|b| (b.padded - b.numel) * 4 * 2).sum();
    let saved = ddp.persistent_bytes - zero1.persistent_bytes;
    // Each buffer is aligned: many small whole states round up more than a few shards do.
    let states = step.inputs.iter().filter(|i| i.role == InputRole::OptState).count();
    let slack = padding + rumble_core::plan::ALIGN * states;
    assert!(
        saved.abs_diff(state_bytes / world) <= slack,
        "ZeRO-1 saves {saved} persistent bytes of {state_bytes} state bytes (slack {slack})"
    );
    assert!(slack * 20 < state_bytes, "the bound means something: slack {slack} of {state_bytes}");
}

/// ZeRO-1 replays only elementwise optimizer ops: anything else is refused, naming the node
/// and the parameter.
#[test]
fn zero1_refuses_an_optimizer_it_cannot_shard() {
    use rumble_core::Graph;
    use rumble_core::ir::{OutputRole, Phase};
    let g = Graph::new("odd_optimizer");
    let x = g.data("x", DType::F32, &[3, 4]).unwrap();
    let w = g.param("w", DType::F32, &[4, 4]).unwrap();
    let loss = x.matmul(&w).unwrap().sum_all().unwrap();
    let gw = rumble_core::autodiff::backward(&loss, &[&w]).unwrap().remove(0);
    g.set_phase(Phase::Optimizer);
    // An update that transposes its gradient: not elementwise.
    let new = w.sub(&gw.transpose(0, 1).unwrap().mul_scalar(0.1).unwrap()).unwrap();
    g.output(&loss, "loss").unwrap();
    g.output_with_role(&new, "new.w", OutputRole::Update { of: w.id() }).unwrap();
    let t = g.finish().unwrap();
    let dp = |mode| DataParallel { world: 2, rank: 0, mode, bucket_bytes: 1 << 20 };
    assert!(data_parallel(&t, &dp(Mode::Ddp)).is_ok(), "DDP leaves the optimizer alone");
    let e = data_parallel(&t, &dp(Mode::Zero1)).unwrap_err().to_string();
    assert!(e.contains("permute") && e.contains("`w`") && e.contains("elementwise"), "{e}");
}

/// A ZeRO-1 run resumes on another number of ranks: the shards of world 2 gathered into whole
/// states (what rank 0 would checkpoint) and cut again for world 4 continue the run as if it
/// had never stopped (f64, so any slip shows).
#[test]
fn zero1_state_moves_from_2_to_4_ranks() {
    let dtype = DType::F64;
    let one = model(GLOBAL_BATCH, dtype).train_step(Optimizer::adamw(1e-2)).unwrap();
    let mut rng = Rng::new(21);
    let mut inputs: Vec<HostTensor> = one
        .inputs
        .iter()
        .map(|i| {
            let ty = one.ty(i.value).clone();
            let x = HostTensor::randn(ty.clone(), 0.1, &mut rng);
            match i.role {
                InputRole::OptState => {
                    HostTensor::from_f64(dtype, ty.dims(), &x.to_f64().iter().map(|v| v * v).collect::<Vec<_>>())
                        .unwrap()
                }
                _ => x,
            }
        })
        .collect();
    let batches: Vec<(HostTensor, HostTensor)> = (0..3)
        .map(|_| {
            let ty = |k: usize| one.ty(one.inputs[k].value).clone();
            (HostTensor::randint(ty(0), 32, &mut rng), HostTensor::randint(ty(1), 32, &mut rng))
        })
        .collect();
    // Whole states by name, carried between the two worlds.
    let mut state: Vec<(String, HostTensor)> = one
        .inputs
        .iter()
        .zip(&inputs)
        .filter(|(i, _)| i.role == InputRole::OptState)
        .map(|(i, v)| (i.name.clone(), v.clone()))
        .collect();
    let mut params: Vec<(String, HostTensor)> = one
        .inputs
        .iter()
        .zip(&inputs)
        .filter(|(i, _)| i.role == InputRole::Param)
        .map(|(i, v)| (i.name.clone(), v.clone()))
        .collect();
    for (s, world) in [(0, 2), (1, 2), (2, 4)] {
        let step = model(GLOBAL_BATCH / world, dtype).train_step(Optimizer::adamw(1e-2)).unwrap();
        let ranks: Vec<(Trace, DpPlan)> = (0..world)
            .map(|rank| {
                data_parallel(&step, &DataParallel { world, rank, mode: Mode::Zero1, bucket_bytes: 1500 }).unwrap()
            })
            .collect();
        let find = |v: &[(String, HostTensor)], n: &str| v.iter().find(|(k, _)| k == n).map(|(_, t)| t.clone());
        let rank_inputs: Vec<Vec<HostTensor>> = ranks
            .iter()
            .enumerate()
            .map(|(r, (t, plan))| {
                let shards = plan.shard_states(&|n| find(&state, n)).unwrap();
                t.inputs
                    .iter()
                    .map(|i| match (i.name.as_str(), plan.shard_states.iter().position(|x| x.name == i.name)) {
                        ("tokens", _) => rows(&batches[s].0, r, world),
                        ("targets", _) => rows(&batches[s].1, r, world),
                        (_, Some(k)) => shards[k].clone(),
                        (n, None) => find(&params, n).unwrap(),
                    })
                    .collect()
            })
            .collect();
        let traces: Vec<Trace> = ranks.iter().map(|(t, _)| t.clone()).collect();
        let outs = simulate(world, &traces, &rank_inputs).unwrap();
        let (t0, plan0) = &ranks[0];
        let out = |n: &str| outs[0][t0.outputs.iter().position(|o| o.name == n).unwrap()].clone();
        params = params.iter().map(|(n, _)| (n.clone(), out(&format!("new.{n}")))).collect();
        let shards: Vec<Vec<HostTensor>> = ranks
            .iter()
            .zip(&outs)
            .map(|((t, plan), o)| {
                plan.shard_states
                    .iter()
                    .map(|x| o[t.outputs.iter().position(|y| y.name == format!("new.{}", x.name)).unwrap()].clone())
                    .collect()
            })
            .collect();
        state = plan0.gather_states(&shards).unwrap();
        // The one-rank step on the whole batch.
        inputs[0] = batches[s].0.clone();
        inputs[1] = batches[s].1.clone();
        let want = cpu::eval(&one, &inputs).unwrap();
        cpu::apply_updates(&one, &mut inputs, &want);
    }
    for (i, want) in one.inputs.iter().zip(&inputs) {
        let got = match i.role {
            InputRole::Param => params.iter().find(|(n, _)| *n == i.name).unwrap().1.clone(),
            InputRole::OptState => state.iter().find(|(n, _)| *n == i.name).unwrap().1.clone(),
            _ => continue,
        };
        let e = rel_err(&got, want);
        assert!(e <= 1e-12, "`{}` after 2 steps on 2 ranks and 1 on 4: rel. err {e:e}", i.name);
    }
}
