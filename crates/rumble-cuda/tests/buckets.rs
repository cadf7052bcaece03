//! Shape buckets on the GPU: TinyLlama steps of two sequence lengths as `BucketedGraphs` over
//! one arena and one persistent region. Alternating steps give bit-identical losses,
//! gradients and parameters to eager executors of each exact shape (no stale buffers between
//! buckets); the arena is allocated once at the largest bucket's size (not the sum); each
//! bucket is captured once, on its first step; mismatched programs and shapes are refused.

mod common;

use std::sync::Arc;

use common::{gpu, init_params, step_inputs, training_step};
use rumble_core::cpu::{HostTensor, Rng};
use rumble_core::ir::DType;
use rumble_core::plan::PlanOptions;
use rumble_core::testing::TinyLlama;
use rumble_cuda::{BucketedGraphs, Device, EagerExecutor, Executor, GraphMode, Program};

fn cfg(seq: usize, dtype: DType) -> TinyLlama {
    TinyLlama { vocab: 96, dim: 64, heads: 4, kv_heads: 2, hidden: 96, layers: 2, batch: 2, seq, dtype }
}

const SEQS: [usize; 2] = [16, 40];

/// One program per bucket (the memory-aware planner's schedule) of the step with `lr`.
fn programs(dev: &Arc<Device>, dtype: DType, lr: Option<f64>) -> Vec<Arc<Program>> {
    SEQS.iter()
        .map(|&s| {
            let t = training_step(&cfg(s, dtype), lr);
            Arc::new(Program::planned(dev.clone(), &t, &PlanOptions::default()).expect("compile"))
        })
        .collect()
}

/// Every output of the last step, by trace order.
fn outputs(ex: &dyn Executor, prog: &Program) -> Vec<HostTensor> {
    prog.trace.outputs.iter().map(|o| ex.output(&o.name).expect("output")).collect()
}

fn persistent(ex: &dyn Executor, prog: &Program) -> Vec<HostTensor> {
    prog.trace
        .inputs
        .iter()
        .filter(|i| i.role.is_persistent())
        .map(|i| ex.persistent(&i.name).expect("persistent"))
        .collect()
}

/// Bucket of each of the alternating steps.
const ORDER: [usize; 7] = [0, 1, 0, 0, 1, 1, 0];

#[test]
#[ignore = "needs a CUDA device"]
fn gradients_match_eager_per_shape_bit_for_bit() {
    let dev = gpu();
    for dtype in [DType::F32, DType::BF16] {
        let progs = programs(&dev, dtype, None);
        let params = init_params(&progs[0].trace, &mut Rng::new(1));
        let mut eager: Vec<EagerExecutor> =
            progs.iter().map(|p| EagerExecutor::new(p.clone(), &params).expect("eager")).collect();
        let mut b = BucketedGraphs::new(progs.clone(), &params, GraphMode::Whole).expect("bucketed");
        let mut rng = Rng::new(7);
        for (i, &k) in ORDER.iter().enumerate() {
            let data = step_inputs(&progs[k].trace, 96, &mut rng);
            let want = eager[k].step(&data).expect("eager step");
            let got = b.step(&data).expect("bucketed step");
            assert_eq!(got, want, "{dtype} step {i} (seq {}): losses differ", SEQS[k]);
            let (o_b, o_e) = (outputs(&b, &progs[k]), outputs(&eager[k], &progs[k]));
            for (j, (x, y)) in o_b.iter().zip(&o_e).enumerate() {
                assert!(
                    x == y,
                    "{dtype} step {i} (seq {}): output {} differs",
                    SEQS[k],
                    progs[k].trace.outputs[j].name
                );
            }
            println!("{dtype} step {i} seq {}: loss and {} gradients bit-identical to eager", SEQS[k], o_b.len() - 1);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn training_matches_eager_per_shape_bit_for_bit() {
    let dev = gpu();
    for mode in [GraphMode::Whole, GraphMode::ForwardBackward] {
        let progs = programs(&dev, DType::F32, Some(0.05));
        let start = init_params(&progs[0].trace, &mut Rng::new(2));
        let mut b = match BucketedGraphs::new(progs.clone(), &start, mode) {
            Ok(b) => b,
            Err(e) => panic!("{mode:?}: {e}"),
        };
        // The reference: a fresh eager executor of each step's shape, given the parameters the
        // previous reference step left.
        let mut params = start;
        let mut rng = Rng::new(8);
        for (i, &k) in ORDER.iter().enumerate() {
            let data = step_inputs(&progs[k].trace, 96, &mut rng);
            let mut e = EagerExecutor::new(progs[k].clone(), &params).expect("eager");
            let want = e.step(&data).expect("eager step");
            params = persistent(&e, &progs[k]);
            match b.step(&data) {
                Ok(got) => assert_eq!(got, want, "{mode:?} step {i} (seq {}): losses differ", SEQS[k]),
                Err(err) if mode == GraphMode::ForwardBackward && i == 0 => {
                    println!("{mode:?}: no forward/backward split ({err})");
                    break;
                }
                Err(err) => panic!("{mode:?} step {i}: {err}"),
            }
            let now = persistent(&b, &progs[k]);
            assert!(now == params, "{mode:?} step {i} (seq {}): parameters differ from eager", SEQS[k]);
            let loss = f32::from_le_bytes(want[0].bytes[..4].try_into().unwrap());
            println!("{mode:?} step {i} seq {}: loss {loss:.5}, parameters bit-identical to eager", SEQS[k]);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_arena_for_all_buckets_and_one_capture_each() {
    let dev = gpu();
    let progs = programs(&dev, DType::F32, Some(0.05));
    let params = init_params(&progs[0].trace, &mut Rng::new(3));
    let arenas: Vec<usize> = progs.iter().map(|p| p.plan.arena_bytes).collect();
    let peaks: Vec<usize> = progs.iter().map(|p| p.plan.peak_bytes()).collect();
    let (max_arena, sum_arena) = (*arenas.iter().max().unwrap(), arenas.iter().sum::<usize>());
    let pers = progs[0].plan.persistent_bytes;
    let mut b = BucketedGraphs::new(progs.clone(), &params, GraphMode::Whole).expect("bucketed");
    // Nothing captured before a bucket's first step.
    assert!(b.stats().iter().all(|s| s.captures == 0 && s.steps == 0));
    assert_eq!(b.device_bytes(), (max_arena, pers));
    let mut rng = Rng::new(9);
    b.step(&step_inputs(&progs[0].trace, 96, &mut rng)).expect("step");
    let s = b.stats();
    assert_eq!((s[0].captures, s[1].captures), (1, 0), "bucket 1 captured before its first step");
    for &k in &ORDER {
        b.step(&step_inputs(&progs[k].trace, 96, &mut rng)).expect("step");
    }
    let s = b.stats();
    for (k, st) in s.iter().enumerate() {
        assert_eq!(st.captures, 1, "bucket {k} captured {} times", st.captures);
        assert!(st.capture_secs > 0.0);
        println!(
            "bucket {k} ({}): {} steps, arena {} bytes, captured once in {:.1} ms",
            st.shape,
            st.steps,
            st.arena_bytes,
            st.capture_secs * 1e3
        );
    }
    assert_eq!(s.iter().map(|x| x.steps).sum::<usize>(), ORDER.len() + 1);
    let m = b.memory();
    assert_eq!(m.peak_bytes, max_arena + pers, "peak is not the largest arena + persistent");
    assert_eq!(m.peak_bytes, *peaks.iter().max().unwrap(), "peak is not the largest bucket's plan peak");
    assert!(max_arena < sum_arena);
    println!(
        "arenas {arenas:?}: one arena of {max_arena} bytes (sum would be {sum_arena}); peak {} = plan peaks {peaks:?} max; \
         device rise {} bytes; pinned {} bytes",
        m.peak_bytes,
        m.device_rise_bytes,
        b.pinned_bytes()
    );
    // A shape with no bucket is refused, naming the shapes.
    let other = training_step(&cfg(24, DType::F32), Some(0.05));
    let e = b.step(&step_inputs(&other, 96, &mut rng)).unwrap_err().to_string();
    assert!(e.contains("no shape bucket") && e.contains("i64[48]"), "{e}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn programs_of_another_model_or_duplicate_shapes_are_refused() {
    let dev = gpu();
    let a = training_step(&cfg(16, DType::F32), None);
    let wide = TinyLlama { dim: 96, ..cfg(32, DType::F32) };
    let b = training_step(&wide, None);
    let pa = Arc::new(Program::planned(dev.clone(), &a, &PlanOptions::default()).expect("a"));
    let pb = Arc::new(Program::planned(dev.clone(), &b, &PlanOptions::default()).expect("b"));
    let params = init_params(&a, &mut Rng::new(4));
    let e = BucketedGraphs::new(vec![pa.clone(), pb], &params, GraphMode::Whole).err().expect("refused");
    assert!(e.to_string().contains("persistent input"), "{e}");
    let e = BucketedGraphs::new(vec![pa.clone(), pa], &params, GraphMode::Whole).err().expect("refused");
    assert!(e.to_string().contains("one bucket per shape"), "{e}");
}
