//! The collective ops (`all_reduce`, `reduce_scatter`, `all_gather`): text round trip, no VJP,
//! and a clear error when one trace alone runs one on the CPU.

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
fn one_trace_alone_cannot_run_a_collective_on_the_cpu() {
    let (g, _x, y) = graph(CollectiveOp::ReduceScatter);
    g.output(&y, "y").unwrap();
    let t = g.finish().unwrap();
    let x = HostTensor::randn(t.ty(t.inputs[0].value).clone(), 1.0, &mut Rng::new(1));
    let err = cpu::eval(&t, &[x]).unwrap_err().to_string();
    assert!(err.contains("reduce_scatter") && err.contains("testing::simulate"), "{err}");
}
