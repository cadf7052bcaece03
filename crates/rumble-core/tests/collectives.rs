//! The collective ops (`all_reduce`, `reduce_scatter`, `all_gather`): text round trip, no VJP,
//! a clear error when one trace alone runs one on the CPU, and the lockstep simulator
//! (`testing::simulate`) running them over several rank traces.

use rumble_core::autodiff::backward;
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{CollectiveOp, Op, parse};
use rumble_core::{DType, Graph};

fn graph(c: CollectiveOp) -> (Graph, rumble_core::Tensor, rumble_core::Tensor) {
    let g = Graph::new("dp");
    let x = g.param("x", DType::F32, &[4, 6]).unwrap();
    let y = g.apply(Op::Collective { op: c, world: 2, rank: 1 }, &[&x]).unwrap().remove(0);
    (g, x, y)
}

#[test]
fn collectives_print_and_parse_back() {
    for c in CollectiveOp::ALL {
        let g = Graph::new("dp");
        let x = g.data("x", DType::F32, &[8]).unwrap();
        let y = g.apply(Op::Collective { op: c, world: 2, rank: 1 }, &[&x]).unwrap().remove(0);
        g.output(&y, "y").unwrap();
        let t = g.finish().unwrap();
        let text = t.to_string();
        assert!(text.contains(&format!("{}(%0) world=2 rank=1", c.name())), "{text}");
        assert_eq!(parse(&text).unwrap(), t);
    }
}

#[test]
fn collectives_have_no_vjp() {
    let (_g, x, y) = graph(CollectiveOp::AllReduce);
    let loss = y.sum_all().unwrap();
    let err = backward(&loss, &[&x]).unwrap_err().to_string();
    assert!(err.contains("all_reduce") && err.contains("no VJP"), "{err}");
}

#[test]
fn one_trace_alone_cannot_run_a_collective_on_the_cpu_but_a_world_of_one() {
    let (g, _x, y) = graph(CollectiveOp::ReduceScatter);
    g.output(&y, "y").unwrap();
    let t = g.finish().unwrap();
    let x = HostTensor::randn(t.ty(t.inputs[0].value).clone(), 1.0, &mut Rng::new(1));
    let err = cpu::eval(&t, &[x]).unwrap_err().to_string();
    assert!(err.contains("reduce_scatter") && err.contains("testing::simulate"), "{err}");
    // A world of one rank: each collective alone gives its operand back, flattened.
    for c in CollectiveOp::ALL {
        let g = Graph::new("one");
        let x = g.data("x", DType::F32, &[3, 4]).unwrap();
        let x = if c == CollectiveOp::AllGather { x.reshape(&[12]).unwrap() } else { x };
        let y = g.apply(Op::Collective { op: c, world: 1, rank: 0 }, &[&x]).unwrap().remove(0);
        g.output(&y, "y").unwrap();
        let t = g.finish().unwrap();
        let x = HostTensor::randn(t.ty(t.inputs[0].value).clone(), 1.0, &mut Rng::new(2));
        let y = cpu::eval(&t, std::slice::from_ref(&x)).unwrap().remove(0);
        assert_eq!((y.ty.numel(), &y.bytes), (12, &x.bytes), "{}", c.name());
    }
}

/// One rank's trace: `y = collective(x * 2)` then `y + 1`, so ops run on both sides.
fn rank_trace(c: CollectiveOp, world: usize, rank: usize, n: usize) -> rumble_core::Trace {
    let g = Graph::new(format!("rank{rank}"));
    let x = g.data("x", DType::F32, &[n]).unwrap();
    let x2 = x.mul_scalar(2.0).unwrap();
    let y = g.apply(Op::Collective { op: c, world, rank }, &[&x2]).unwrap().remove(0);
    g.output(&y.add_scalar(1.0).unwrap(), "y").unwrap();
    g.finish().unwrap()
}

#[test]
fn simulate_runs_every_collective_in_lockstep() {
    let (world, n) = (3, 6);
    let mut rng = Rng::new(7);
    let xs: Vec<HostTensor> =
        (0..world).map(|_| HostTensor::randn(rumble_core::TensorType::new(DType::F32, [n]), 1.0, &mut rng)).collect();
    let vals: Vec<Vec<f64>> = xs.iter().map(|x| x.to_f64()).collect();
    let sum: Vec<f64> = (0..n).map(|i| vals.iter().map(|v| 2.0 * v[i]).sum()).collect();
    for c in CollectiveOp::ALL {
        let traces: Vec<_> = (0..world).map(|r| rank_trace(c, world, r, n)).collect();
        let inputs: Vec<Vec<HostTensor>> = xs.iter().map(|x| vec![x.clone()]).collect();
        let outs = rumble_core::testing::simulate(world, &traces, &inputs).unwrap();
        for (r, o) in outs.iter().enumerate() {
            let got = o[0].to_f64();
            let want: Vec<f64> = match c {
                CollectiveOp::AllReduce => sum.clone(),
                CollectiveOp::ReduceScatter => sum[r * 2..r * 2 + 2].to_vec(),
                CollectiveOp::AllGather => vals.iter().flat_map(|v| v.iter().map(|x| 2.0 * x)).collect(),
            };
            assert_eq!(got.len(), want.len(), "{} rank {r}", c.name());
            for (g, w) in got.iter().zip(&want) {
                assert!((g - (w + 1.0)).abs() <= 1e-5 * (1.0 + w.abs()), "{} rank {r}: {g} vs {}", c.name(), w + 1.0);
            }
        }
    }
}

#[test]
fn simulate_refuses_ranks_that_disagree() {
    let x = HostTensor::randn(rumble_core::TensorType::new(DType::F32, [4]), 1.0, &mut Rng::new(3));
    let inputs = vec![vec![x.clone()], vec![x]];
    let mixed = [rank_trace(CollectiveOp::AllReduce, 2, 0, 4), rank_trace(CollectiveOp::AllGather, 2, 1, 4)];
    let err = rumble_core::testing::simulate(2, &mixed, &inputs).unwrap_err().to_string();
    assert!(err.contains("all_reduce") && err.contains("all_gather") && err.contains("rank 1"), "{err}");
    let swapped = [rank_trace(CollectiveOp::AllReduce, 2, 1, 4), rank_trace(CollectiveOp::AllReduce, 2, 0, 4)];
    let err = rumble_core::testing::simulate(2, &swapped, &inputs).unwrap_err().to_string();
    assert!(err.contains("rank 0 of 2") && err.contains("rank=1"), "{err}");
}

#[test]
fn the_verifier_wants_one_world_and_rank_per_trace() {
    let g = Graph::new("mixed");
    let x = g.data("x", DType::F32, &[4]).unwrap();
    let a = g.apply(Op::Collective { op: CollectiveOp::AllReduce, world: 2, rank: 0 }, &[&x]).unwrap().remove(0);
    let b = g.apply(Op::Collective { op: CollectiveOp::AllReduce, world: 2, rank: 1 }, &[&a]).unwrap().remove(0);
    g.output(&b, "y").unwrap();
    let err = g.finish().unwrap_err().to_string();
    assert!(err.contains("node 1 (all_reduce)") && err.contains("rank 1 of 2") && err.contains("rank 0 of 2"), "{err}");
}

#[test]
fn simulate_refuses_a_rank_that_ends_while_others_wait() {
    let x = HostTensor::randn(rumble_core::TensorType::new(DType::F32, [4]), 1.0, &mut Rng::new(4));
    let g = Graph::new("no_collective");
    let a = g.data("x", DType::F32, &[4]).unwrap();
    g.output(&a.mul_scalar(3.0).unwrap(), "y").unwrap();
    let lone = g.finish().unwrap();
    let traces = [lone, rank_trace(CollectiveOp::AllReduce, 2, 1, 4)];
    let err = rumble_core::testing::simulate(2, &traces, &[vec![x.clone()], vec![x]]).unwrap_err().to_string();
    assert!(err.contains("rank 0 ended while rank 1 waits at all_reduce"), "{err}");
}
