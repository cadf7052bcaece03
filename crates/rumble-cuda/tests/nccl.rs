//! The NCCL backend (`rumble_cuda::nccl`): where NCCL cannot be loaded the error says what was
//! looked for; on a GPU, a one-rank data-parallel step (the rank trace of
//! `rumble_core::passes::data_parallel`, its collectives launched through NCCL and captured in
//! the step's graph) is bit-identical to the plain graphed step over 20 steps (DDP, f32 and
//! bf16; these test steps output their gradients beside the SGD update, which ZeRO-1 refuses:
//! rumble-models' data-parallel tests run it on the real step); a collective on a device
//! without a communicator is refused with an error naming the op.

mod common;

use std::sync::Arc;

use common::{gpu, init_params, step_inputs, tiny_steps, train};
use rumble_core::cpu::Rng;
use rumble_core::ir::Op;
use rumble_core::passes::data_parallel::{DataParallel, Mode, data_parallel};
use rumble_core::plan::PlanOptions;
use rumble_cuda::nccl::{self, Comm};
use rumble_cuda::{Executor, GraphMode, GraphedExecutor, Program};

#[test]
fn a_missing_nccl_is_named_with_where_it_was_looked_for() {
    match nccl::available() {
        Ok(()) => println!("NCCL loads here (version {:?})", nccl::version()),
        Err(e) => {
            let m = e.to_string();
            assert!(m.contains("NCCL") && m.contains("libnccl.so"), "{m}");
            println!("as expected without NCCL: {m}");
        }
    }
}

/// A `libnccl.so.2` (PyTorch's wheel has no `libnccl.so`) is found in the folders given, in
/// order, and linked as `libnccl.so` in a folder of rumble's own, atomically and once; a
/// `libnccl.so` is taken where it is.
#[test]
fn a_libnccl_so_2_is_found_and_linked() {
    let root = std::env::temp_dir().join(format!("rumble-nccl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (a, b) = (root.join("a"), root.join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    assert_eq!(nccl::find_in(&[a.clone(), b.clone()]), None);
    std::fs::write(b.join("libnccl.so.2"), b"not really a library").unwrap();
    let lib = nccl::find_in(&[a.clone(), b.clone()]).expect("found");
    assert_eq!(lib, b.join("libnccl.so.2"));
    let dir = nccl::link_dir_for(&lib, &root.join("cache")).unwrap();
    assert_eq!(std::fs::read_link(dir.join("libnccl.so")).unwrap(), lib);
    assert_eq!(nccl::link_dir_for(&lib, &root.join("cache")).unwrap(), dir, "made once, then kept");
    std::fs::write(a.join("libnccl.so"), b"").unwrap();
    let first = nccl::find_in(&[a.clone(), b]).unwrap();
    assert_eq!((nccl::link_dir_for(&first, &root.join("cache")).unwrap(), first), (a.clone(), a.join("libnccl.so")));
    let _ = std::fs::remove_dir_all(&root);
}

/// What the GPU test below compares by name is there: every output and persistent input of
/// the plain step is one of the one-rank trace's.
#[test]
fn one_rank_traces_keep_the_plain_steps_names() {
    for (dtype, _, trace) in tiny_steps() {
        for mode in [Mode::Ddp] {
            let (dp, _) = data_parallel(&trace, &DataParallel { world: 1, rank: 0, mode, bucket_bytes: 1 << 14 })
                .expect("rank trace");
            for o in &trace.outputs {
                assert!(dp.outputs.iter().any(|x| x.name == o.name), "{dtype} {mode:?}: output {}", o.name);
            }
            let persistent = |t: &rumble_core::Trace| -> Vec<String> {
                t.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| i.name.clone()).collect()
            };
            assert_eq!(persistent(&dp), persistent(&trace), "{dtype} {mode:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device and NCCL"]
fn a_one_rank_nccl_step_is_bit_identical_to_the_plain_step() {
    let dev = gpu();
    for (dtype, c, trace) in tiny_steps() {
        let params = init_params(&trace, &mut Rng::new(1));
        let plain = Arc::new(Program::planned(dev.clone(), &trace, &PlanOptions::default()).expect("compile"));
        let mut ex = GraphedExecutor::new(plain.clone(), &params, GraphMode::Whole).expect("graphed");
        // No communicator yet: the first collective's launch is refused, naming it.
        let (dp0, _) =
            data_parallel(&trace, &DataParallel { world: 1, rank: 0, mode: Mode::Ddp, bucket_bytes: 1 << 14 })
                .expect("rank trace");
        let prog0 = Arc::new(Program::planned(dev.clone(), &dp0, &PlanOptions::default()).expect("compile"));
        if nccl::comm().is_none() {
            let mut e = rumble_cuda::PlannedExecutor::new(prog0.clone(), &params).expect("planned");
            let err = e.step(&step_inputs(&prog0.trace, c.vocab as u64, &mut Rng::new(3))).unwrap_err().to_string();
            assert!(err.contains("all_reduce") && err.contains("no NCCL communicator"), "{err}");
            let id = nccl::unique_id().expect("NCCL unique id");
            Comm::new(&dev, &id, 1, 0).expect("one-rank communicator").install();
            println!("NCCL {:?}: one-rank communicator", nccl::version());
        }
        let steps = 20;
        let (l_plain, f_plain) = train(&mut ex, &plain.trace, steps, c.vocab as u64, 77);
        for mode in [Mode::Ddp] {
            let (dp, plan) = data_parallel(&trace, &DataParallel { world: 1, rank: 0, mode, bucket_bytes: 1 << 14 })
                .expect("rank trace");
            let collectives = dp.nodes.iter().filter(|n| matches!(n.op, Op::Collective { .. })).count();
            assert!(collectives > plan.buckets.len(), "{mode:?}: {collectives} collectives");
            let prog = Arc::new(Program::planned(dev.clone(), &dp, &PlanOptions::default()).expect("compile"));
            // The rank's persistent inputs by name (SGD: the parameters alone).
            let by_name = |name: &str| {
                let at = plain.trace.inputs.iter().filter(|i| i.role.is_persistent()).position(|i| i.name == name);
                params[at.unwrap_or_else(|| panic!("{mode:?}: persistent input {name} is not the plain step's"))]
                    .clone()
            };
            let rank_params: Vec<_> =
                prog.trace.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| by_name(&i.name)).collect();
            let mut g = GraphedExecutor::new(prog.clone(), &rank_params, GraphMode::Whole).expect("graphed rank");
            let (l, f) = train(&mut g, &prog.trace, steps, c.vocab as u64, 77);
            assert_eq!(l, l_plain, "{dtype} {mode:?}: losses differ from the plain step");
            let names = |t: &rumble_core::Trace| -> Vec<String> {
                let mut v: Vec<String> = t.outputs.iter().map(|o| o.name.clone()).collect();
                v.extend(t.inputs.iter().filter(|i| i.role.is_persistent()).map(|i| i.name.clone()));
                v
            };
            let (want, got) = (names(&plain.trace), names(&prog.trace));
            for (k, name) in want.iter().enumerate() {
                let j = got.iter().position(|n| n == name).unwrap_or_else(|| panic!("{mode:?}: no {name}"));
                assert!(f[j] == f_plain[k], "{dtype} {mode:?}: {name} differs from the plain step");
            }
            println!("{dtype} {mode:?}: {steps} steps bit-identical ({collectives} collectives through NCCL)");
        }
    }
}
