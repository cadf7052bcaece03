//! The device's cost model (`DeviceCost`): a node's time is probed on the device the first time
//! it is asked for, recorded in the cache folder, and read back from there by a later model;
//! a view costs nothing and is never probed; compiling a training step with the device's
//! options prices every node by measurement. Ignored without a GPU.

mod common;

use std::sync::Arc;

use common::{gpu, tiny_step};
use rumble_core::compile::{CompileOptions, compile};
use rumble_core::cost::{CostModel, DeviceRates, node_key, times_file};
use rumble_core::ir::{DType, Op, Shape, TensorType};
use rumble_cuda::{DeviceCost, MAX_SLOWDOWN, PART_LOAD_KEY, PART_SLOWDOWN_KEY, Program, RATE_KEY, SLOWDOWN_KEY};

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, Shape::from(dims))
}

fn with_cache(name: &str) -> (Arc<rumble_cuda::Device>, std::path::PathBuf) {
    let dev = gpu();
    let dir = std::env::temp_dir().join(format!("rumble-probe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dev.set_knobs(rumble_cuda::knobs::Knobs { cache: Some(dir.clone()), ..dev.knobs() });
    (dev, dir)
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_node_is_probed_once_and_remembered() {
    let (dev, dir) = with_cache("once");
    let rates = DeviceRates { name: dev.name.clone(), ..DeviceRates::h200() };
    let cost = DeviceCost::new(dev.clone(), rates.clone());
    let (a, b) = (ty(DType::BF16, &[2048, 1024]), ty(DType::BF16, &[1024, 4096]));
    let out = ty(DType::BF16, &[2048, 4096]);
    let mm = Op::Matmul { ta: false, tb: false, out: None, acc: rumble_core::ir::Addend::None };
    let s = cost.node_seconds(&mm, &[&a, &b], &[&out]);
    assert_eq!(cost.probed(), 1);
    // 17 GFLOP: more than a microsecond, less than 100 ms on any GPU this runs on.
    assert!(s > 1e-6 && s < 0.1, "{s}");
    let again = cost.node_seconds(&mm, &[&a, &b], &[&out]);
    assert_eq!((again, cost.probed()), (s, 1), "asked twice, probed once");

    // An elementwise add streams 3 x 16 MiB: at least 10 microseconds' worth at 5 TB/s.
    let x = ty(DType::F32, &[1 << 22]);
    let add = Op::Binary(rumble_core::ir::BinaryOp::Add);
    let t = cost.node_seconds(&add, &[&x, &x], &[&x]);
    assert!(t > 1e-5 && t < 0.05, "{t}");
    assert_eq!(cost.probed(), 2);

    // A view is free and never probed.
    let r = Op::Reshape { shape: Shape::from(&[1024usize, 4096][..]) };
    assert_eq!(cost.node_seconds(&r, &[&x], &[&ty(DType::F32, &[1024, 4096])]), 0.0);
    assert_eq!(cost.probed(), 2);

    // The file has both keys, and the device's sustained slowdown, burn rate and part-load burn, measured
    // with the first probe; a new model reads them instead of probing.
    let text = std::fs::read_to_string(times_file(&dir, &dev.name)).expect("times file");
    assert!(text.contains(&node_key(&mm, &[&a, &b], &[&out])), "{text}");
    let read = |key: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}\t")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{key} in the times file"))
    };
    let (slowdown, rate) = (read(SLOWDOWN_KEY), read(RATE_KEY));
    assert!((1.0..=MAX_SLOWDOWN).contains(&slowdown), "{slowdown}");
    // A bf16 matmul of 4096: tens to a few thousand TFLOP/s on any GPU this runs on.
    assert!((1e13..5e15).contains(&rate), "{rate}");
    // The burn at part load: a load strictly between rest and the burn's, a slowdown in range.
    let (part_load, part_slowdown) = (read(PART_LOAD_KEY), read(PART_SLOWDOWN_KEY));
    assert!(part_load > 0.05 && part_load < 0.95, "{part_load}");
    assert!((1.0..=MAX_SLOWDOWN).contains(&part_slowdown), "{part_slowdown}");
    let sustained = cost.sustained().expect("the model knows how the device slows");
    assert_eq!((sustained.slowdown, sustained.rate), (slowdown, rate));
    assert_eq!(sustained.part, Some((part_load, part_slowdown)));
    let said = cost.describe();
    assert!(said.contains("sustained slowdown") && !said.contains("not measured"), "{said}");
    let later = DeviceCost::new(dev.clone(), rates);
    let s2 = later.node_seconds(&mm, &[&a, &b], &[&out]);
    assert_eq!(later.probed(), 0);
    assert!((s2 - s).abs() <= 1e-9 * s.max(1.0), "{s2} vs {s}");
    assert!(later.sustained().is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_training_step_compiles_against_measured_times() {
    let (dev, dir) = with_cache("step");
    let (_, t) = tiny_step(DType::BF16);
    let opts = Program::compile_options(&dev, &CompileOptions::default()).expect("options");
    assert!(opts.cost.as_ref().is_some_and(|c| c.is_measured()));
    let c = compile(&t, &opts).expect("compile");
    assert!(c.report.cost_model.starts_with("measured on"), "{}", c.report.cost_model);
    let ms = c.report.predicted_ms.expect("a prediction");
    // A two-layer step of a few hundred tiny nodes: microseconds each.
    assert!(ms > 0.01 && ms < 100.0, "{ms}");
    let text = std::fs::read_to_string(times_file(&dir, &dev.name)).expect("times file");
    assert!(text.lines().count() >= 10, "{} lines", text.lines().count());
    let _ = std::fs::remove_dir_all(&dir);
}
