//! Host nodes: a TinyLlama training step with some ops forced onto the host (the CPU reference,
//! `Device::set_host_ops`). The graphed executor splits its graphs around them, all over the
//! one arena; whole-step and forward/backward graphs give bit-identical losses, gradients and
//! parameters to the planned executor with the same host nodes, over steps whose inputs change,
//! and stay within tolerance of the program with every node on the device.

mod common;

use std::sync::Arc;

use common::{compare, gpu, init_params, step_inputs, tiny_steps, tolerance, train};
use rumble_core::cpu::Rng;
use rumble_core::plan::PlanOptions;
use rumble_cuda::{Executor, GraphMode, GraphedExecutor, PlannedExecutor, Program};

const HOST_OPS: [&str; 3] = ["rms_norm", "rms_norm_backward", "cross_entropy"];

#[test]
#[ignore = "needs a CUDA device"]
fn graphs_split_around_host_nodes_and_agree_bit_for_bit() {
    let dev = gpu();
    for (dtype, c, trace) in tiny_steps() {
        dev.set_host_ops(&HOST_OPS);
        let prog = Program::planned(dev.clone(), &trace, &PlanOptions::default());
        dev.set_host_ops(&[]);
        let prog = Arc::new(prog.expect("compile with host nodes"));
        let on_device = Arc::new(Program::planned(dev.clone(), &trace, &PlanOptions::default()).expect("compile"));
        let hosts = prog.recipes.iter().filter(|r| r.is_host()).count();
        let want_hosts = prog.trace.nodes.iter().filter(|n| HOST_OPS.contains(&n.op.name())).count();
        assert!(want_hosts >= 3, "{dtype}: the tiny step has {want_hosts} nodes of {HOST_OPS:?}");
        assert_eq!(hosts, want_hosts, "{dtype}: every node of a host op runs on the host");
        assert_eq!(on_device.recipes.iter().filter(|r| r.is_host()).count(), 0);

        let trace = prog.trace.clone();
        let params = init_params(&trace, &mut Rng::new(1));
        let steps = 8;
        let mut planned = PlannedExecutor::new(prog.clone(), &params).expect("planned");
        let (l_p, f_p) = train(&mut planned, &trace, steps, c.vocab as u64, 5);
        for mode in [GraphMode::Whole, GraphMode::ForwardBackward] {
            let mut g = GraphedExecutor::new(prog.clone(), &params, mode).expect("graphed with host nodes");
            let parts = g.graphs();
            let host_parts = parts.iter().filter(|p| p.0.starts_with("host:")).count();
            let graph_parts = parts.len() - host_parts;
            assert_eq!(host_parts, hosts, "{dtype} {mode:?}: {parts:?}");
            assert!(graph_parts > hosts / 2 && graph_parts >= 2, "{dtype} {mode:?}: {parts:?}");
            let (l, f) = train(&mut g, &trace, steps, c.vocab as u64, 5);
            assert_eq!(l, l_p, "{dtype} {mode:?}: losses differ from planned");
            for (k, (a, b)) in f.iter().zip(&f_p).enumerate() {
                assert!(a == b, "{dtype} {mode:?}: final tensor {k} ({}) differs from planned", a.ty);
            }
            println!(
                "{dtype} {mode:?}: {graph_parts} graphs around {host_parts} host nodes, {steps} steps bit-identical"
            );
        }
        // forward() then backward() is the same step as step().
        let mut fb = GraphedExecutor::new(prog.clone(), &params, GraphMode::ForwardBackward).expect("graphed");
        let mut pl = PlannedExecutor::new(prog.clone(), &params).expect("planned");
        let mut rng = Rng::new(11);
        for _ in 0..3 {
            let data = step_inputs(&trace, c.vocab as u64, &mut rng);
            let loss = fb.forward(&data).expect("forward");
            fb.backward().expect("backward");
            assert_eq!(loss[0].bytes, pl.step(&data).expect("step")[0].bytes, "{dtype}: forward() loss");
        }
        // Against every node on the device: the first step within tolerance.
        let data = step_inputs(&trace, c.vocab as u64, &mut Rng::new(3));
        let mut a = PlannedExecutor::new(prog.clone(), &params).expect("planned");
        let dev_params = init_params(&on_device.trace, &mut Rng::new(1));
        let mut b = PlannedExecutor::new(on_device.clone(), &dev_params).expect("planned");
        a.step(&data).expect("host step");
        b.step(&step_inputs(&on_device.trace, c.vocab as u64, &mut Rng::new(3))).expect("device step");
        let tol = tolerance(dtype) * 20.0;
        for o in &trace.outputs {
            let (x, y) = (a.output(&o.name).expect("out"), b.output(&o.name).expect("out"));
            compare(&x, &y, tol).unwrap_or_else(|e| panic!("{dtype} {}: host vs device: {e}", o.name));
        }
    }
}
