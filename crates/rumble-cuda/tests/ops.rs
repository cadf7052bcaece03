//! Every op of the IR on the GPU against the CPU reference (`rumble_core::cpu`), on random
//! inputs, f32, bf16 and f64 (f16 for a few), within per-dtype tolerances. Each case runs as a
//! one-node trace through the planned executor with the arena poisoned first, so an element a
//! kernel forgets to write shows up. Also: bad data on the device comes back as an error that
//! names the op. Prints one line per case (relative error, max abs error).

mod common;

use std::sync::Arc;

use common::{away_from_zero, compare, gpu, positive, randn, tolerance};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{
    Addend, BinaryOp, CmpOp, DType, Graph, HeadLayout, Op, ReduceOp, RopeScaling, TensorType, UnaryOp,
};
use rumble_core::plan::plan_naive;
use rumble_cuda::{Device, Executor, PlannedExecutor, Program};

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F64];

struct Case {
    op: Op,
    inputs: Vec<HostTensor>,
    /// Extra slack on the tolerance (ops whose spec rounds through f32, e.g. RoPE angles).
    tol_floor: f64,
}

fn case(op: Op, inputs: Vec<HostTensor>) -> Case {
    Case { op, inputs, tol_floor: 0.0 }
}

/// The one-node trace of `c`, with outputs `y0`, `y1`, ...
fn trace_of(c: &Case) -> Result<rumble_core::Trace, String> {
    let g = Graph::new(format!("case_{}", c.op.name()));
    let ins: Vec<_> = c
        .inputs
        .iter()
        .enumerate()
        .map(|(i, h)| g.data(&format!("x{i}"), h.ty.dtype, h.ty.dims()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let refs: Vec<_> = ins.iter().collect();
    let outs = g.apply(c.op.clone(), &refs).map_err(|e| e.to_string())?;
    for (i, o) in outs.iter().enumerate() {
        g.output(o, &format!("y{i}")).map_err(|e| e.to_string())?;
    }
    g.finish().map_err(|e| e.to_string())
}

/// Runs `c` on the GPU alone (planned executor, poisoned arena).
fn run_gpu(dev: &Arc<Device>, c: &Case) -> Result<Vec<HostTensor>, String> {
    let trace = trace_of(c)?;
    let prog = Arc::new(
        Program::compile(dev.clone(), trace.clone(), |t, ws| Ok(plan_naive(t, ws))).map_err(|e| e.to_string())?,
    );
    let mut ex = PlannedExecutor::new(prog, &[]).map_err(|e| e.to_string())?;
    ex.poison(0xff).map_err(|e| e.to_string())?;
    ex.step(&c.inputs).map_err(|e| e.to_string())?;
    (0..trace.outputs.len()).map(|i| ex.output(&format!("y{i}")).map_err(|e| e.to_string())).collect()
}

/// Runs `c` on the GPU and the CPU; returns a report line or the failure.
fn run(dev: &Arc<Device>, c: &Case) -> Result<String, String> {
    let want = cpu::eval(&trace_of(c)?, &c.inputs).map_err(|e| format!("cpu: {e}"))?;
    let gots = run_gpu(dev, c)?;
    let mut parts = Vec::new();
    for (i, (w, got)) in want.iter().zip(&gots).enumerate() {
        let tol = tolerance(w.ty.dtype).max(c.tol_floor);
        let (rel, max) = compare(got, w, tol).map_err(|e| format!("output {i}: {e}"))?;
        parts.push(format!("{rel:.2e} {max:.2e}"));
    }
    let types: Vec<String> = c.inputs.iter().map(|h| h.ty.to_string()).collect();
    Ok(format!("{:<24} {:<40} {}", c.op.name(), types.join(","), parts.join(" | ")))
}

fn check_all(dev: &Arc<Device>, cases: Vec<Case>) {
    let mut failures = Vec::new();
    for c in &cases {
        match run(dev, c) {
            Ok(line) => println!("ok   {line}"),
            Err(e) => {
                let types: Vec<String> = c.inputs.iter().map(|h| h.ty.to_string()).collect();
                let msg = format!("FAIL {} ({}): {e}", c.op.name(), types.join(","));
                println!("{msg}");
                failures.push(msg);
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Builds a test's cases from `Rng::new(seed)` and checks them all on the GPU.
fn check_cases(seed: u64, build: impl FnOnce(&mut Rng, &mut Vec<Case>)) {
    let dev = gpu();
    let mut cases = Vec::new();
    build(&mut Rng::new(seed), &mut cases);
    check_all(&dev, cases);
}

fn t(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, dims.to_vec())
}

fn ids(d: DType, dims: &[usize], hi: u64, rng: &mut Rng) -> HostTensor {
    HostTensor::randint(t(d, dims), hi, rng)
}

#[test]
#[ignore = "needs a CUDA device"]
fn elementwise_ops_match_cpu() {
    check_cases(1, |r, cases| {
        let s = [37, 65];
        for d in FLOATS.into_iter().chain([DType::F16]) {
            for u in UnaryOp::ALL {
                let x = match u {
                    UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => positive(t(d, &s), r),
                    UnaryOp::Recip => away_from_zero(t(d, &s), r),
                    _ => randn(t(d, &s), r),
                };
                cases.push(case(Op::Unary(u), vec![x]));
            }
            cases.push(case(Op::PowScalar { exponent: 2.5 }, vec![positive(t(d, &s), r)]));
            cases.push(case(Op::AddScalar { value: -0.375 }, vec![randn(t(d, &s), r)]));
            cases.push(case(Op::MulScalar { value: 1.0 / 3.0 }, vec![randn(t(d, &s), r)]));
            for b in BinaryOp::ALL {
                let y = if b == BinaryOp::Div { away_from_zero(t(d, &s), r) } else { randn(t(d, &s), r) };
                cases.push(case(Op::Binary(b), vec![randn(t(d, &s), r), y]));
            }
            cases.push(case(Op::Swiglu, vec![randn(t(d, &s), r), randn(t(d, &s), r)]));
            cases.push(case(Op::SwigluBackward, vec![randn(t(d, &s), r), randn(t(d, &s), r), randn(t(d, &s), r)]));
            // Gate and up side by side in rows of 2 x 37 (the last dim odd on each half).
            cases.push(case(Op::SwigluPacked, vec![randn(t(d, &[3, 5, 74]), r)]));
            cases.push(case(Op::SwigluPackedBackward, vec![randn(t(d, &[3, 5, 74]), r), randn(t(d, &[3, 5, 37]), r)]));
            // Rows a multiple of 8 wide: the 16-byte vector path.
            cases.push(case(Op::SwigluPacked, vec![randn(t(d, &[4, 6, 96]), r)]));
            cases.push(case(Op::SwigluPackedBackward, vec![randn(t(d, &[4, 6, 96]), r), randn(t(d, &[4, 6, 48]), r)]));
            let cond = randn(t(DType::F32, &s), r).cast(DType::Bool);
            cases.push(case(Op::Where, vec![cond, randn(t(d, &s), r), randn(t(d, &s), r)]));
            cases.push(case(Op::Full { value: -1.25, ty: t(d, &s) }, vec![]));
        }
        for d in [DType::I32, DType::I64] {
            for b in BinaryOp::ALL {
                let x = ids(d, &s, 1000, r);
                let y =
                    if b == BinaryOp::Div { ids(d, &s, 50, r).cast(DType::F64).cast(d) } else { ids(d, &s, 1000, r) };
                // Divisors in 1..=50.
                let y = if b == BinaryOp::Div {
                    HostTensor::from_i64(d, &s, &y.to_i64().iter().map(|v| v + 1).collect::<Vec<_>>()).unwrap()
                } else {
                    y
                };
                cases.push(case(Op::Binary(b), vec![x, y]));
            }
            cases.push(case(Op::Full { value: 7.9, ty: t(d, &s) }, vec![]));
        }
        for d in [DType::F32, DType::BF16, DType::I64] {
            for c in CmpOp::ALL {
                // Equal elements appear: compare x with a copy that shares half its values.
                let x = if d.is_float() { randn(t(d, &s), r) } else { ids(d, &s, 4, r) };
                let y = if d.is_float() { randn(t(d, &s), r) } else { ids(d, &s, 4, r) };
                cases.push(case(Op::Compare(c), vec![x, y]));
            }
        }
        for from in DType::ALL {
            for to in DType::ALL {
                let x = match from {
                    DType::Bool => randn(t(DType::F32, &s), r).cast(DType::Bool),
                    d if d.is_int() => {
                        HostTensor::from_i64(d, &s, &(0..37 * 65).map(|i| i * 7919 - 90000).collect::<Vec<_>>())
                            .unwrap()
                    }
                    d => HostTensor::from_f64(d, &s, &(0..37 * 65).map(|_| r.normal() * 1e3).collect::<Vec<_>>())
                        .unwrap(),
                };
                cases.push(case(Op::Cast { to }, vec![x]));
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn layout_and_reduction_ops_match_cpu() {
    check_cases(2, |r, cases| {
        for d in FLOATS {
            let x = || t(d, &[3, 50, 33]);
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::SumSquares] {
                for (axes, keepdim) in
                    [(vec![2], false), (vec![0], true), (vec![0, 2], false), (vec![0, 1, 2], false), (vec![1], true)]
                {
                    cases.push(case(Op::Reduce { op, axes, keepdim }, vec![randn(x(), r)]));
                }
            }
            // Few outputs over many elements: the split (two-pass) reduction, contiguous and not;
            // and over leading axes, by columns.
            for (op, dims, axes) in [
                (ReduceOp::Sum, vec![300, 1000], vec![0, 1]),
                (ReduceOp::Mean, vec![3, 70000], vec![1]),
                (ReduceOp::Max, vec![70000, 2], vec![0]),
                (ReduceOp::Sum, vec![2, 40000, 3], vec![1]),
                // Over the leading axes (a bias gradient): columns read by rows, in pieces.
                (ReduceOp::Sum, vec![4100, 300], vec![0]),
                (ReduceOp::Mean, vec![7, 999, 130], vec![0, 1]),
                // A gradient's squared norm (clipping), split; and by columns.
                (ReduceOp::SumSquares, vec![300, 1000], vec![0, 1]),
                (ReduceOp::SumSquares, vec![4100, 300], vec![0]),
                // By columns with 16-byte row loads (every dtype's width divides 1536), and
                // several column blocks; a max by columns with a ragged last block.
                (ReduceOp::Sum, vec![3000, 1536], vec![0]),
                (ReduceOp::Max, vec![2000, 264], vec![0]),
            ] {
                cases.push(case(Op::Reduce { op, axes, keepdim: false }, vec![randn(t(d, &dims), r)]));
            }
            cases.push(case(Op::Reshape { shape: [150, 33].into() }, vec![randn(x(), r)]));
            cases.push(case(Op::Permute { perm: vec![2, 0, 1] }, vec![randn(x(), r)]));
            cases.push(case(
                Op::Permute { perm: vec![0, 2, 1] },
                vec![randn(t(d, &[2, 3, 7, 5]).with_shape([2, 21, 5]), r)],
            ));
            cases.push(case(Op::Broadcast { shape: [4, 3, 50, 33].into() }, vec![randn(t(d, &[3, 1, 33]), r)]));
            cases.push(case(Op::Broadcast { shape: [6, 50, 33].into() }, vec![randn(t(d, &[50, 1]), r)]));
            cases.push(case(Op::Slice { axis: 1, start: 7, end: 41 }, vec![randn(x(), r)]));
            cases.push(case(
                Op::Concat { axis: 1 },
                vec![randn(t(d, &[3, 5, 33]), r), randn(x(), r), randn(t(d, &[3, 1, 33]), r)],
            ));
            for idt in [DType::I32, DType::I64] {
                cases.push(case(Op::Gather, vec![randn(t(d, &[40, 24]), r), ids(idt, &[3, 17], 40, r)]));
                // Repeated ids (30 positions into 11 rows; some rows never hit).
                cases.push(case(
                    Op::ScatterAdd { rows: 13 },
                    vec![ids(idt, &[2, 15], 11, r), randn(t(d, &[2, 15, 24]), r)],
                ));
                // Chains of the same id across many warps' scans, rows wider than a block.
                cases.push(case(
                    Op::ScatterAdd { rows: 300 },
                    vec![ids(idt, &[3, 400], 290, r), randn(t(d, &[3, 400, 300]), r)],
                ));
            }
        }
        for d in [DType::I32, DType::I64] {
            cases.push(case(
                Op::Reduce { op: ReduceOp::Max, axes: vec![1], keepdim: false },
                vec![ids(d, &[9, 40], 100000, r)],
            ));
            cases.push(case(Op::Permute { perm: vec![1, 0] }, vec![ids(d, &[9, 40], 100, r)]));
        }
        cases.push(case(
            Op::Slice { axis: 0, start: 1, end: 3 },
            vec![randn(t(DType::F32, &[4, 4]), r).cast(DType::Bool)],
        ));
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_and_composite_ops_match_cpu() {
    check_cases(3, |r, cases| {
        for d in FLOATS.into_iter().chain([DType::F16]) {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = if ta { t(d, &[2, 70, 33]) } else { t(d, &[2, 33, 70]) };
                let b = if tb { t(d, &[2, 45, 70]) } else { t(d, &[2, 70, 45]) };
                cases.push(case(Op::Matmul { ta, tb, out: None, acc: Addend::None }, vec![randn(a, r), randn(b, r)]));
            }
            cases.push(case(
                Op::Matmul { ta: false, tb: true, out: None, acc: Addend::None },
                vec![randn(t(d, &[96, 128]), r), randn(t(d, &[200, 128]), r)],
            ));
        }
        // Written in f32 from bf16 operands (`fold_casts`: weight gradients, the residual's
        // projections), batched and not.
        for (ta, tb) in [(true, false), (false, true)] {
            let (d, out) = (DType::BF16, Some(DType::F32));
            let a = if ta { t(d, &[2, 70, 33]) } else { t(d, &[2, 33, 70]) };
            let b = if tb { t(d, &[2, 45, 70]) } else { t(d, &[2, 70, 45]) };
            cases.push(case(Op::Matmul { ta, tb, out, acc: Addend::None }, vec![randn(a, r), randn(b, r)]));
            let a = if ta { t(d, &[300, 96]) } else { t(d, &[96, 300]) };
            let b = if tb { t(d, &[128, 300]) } else { t(d, &[300, 128]) };
            cases.push(case(Op::Matmul { ta, tb, out, acc: Addend::None }, vec![randn(a, r), randn(b, r)]));
        }
        // With an addend (`fold_addends`: residual connections, gradient sums), read from its own
        // buffer (cuBLASLt's C beside D); in place over it is the training tests' case. And with
        // a row added to every row (`fold_row_addends`: a bias; cuBLASLt's BIAS epilogue, or the
        // gemv kernels for decoding's few rows), of f64 too (where cuBLASLt may have no such
        // algorithm: the row broadcast into the result first).
        let pairs = [(DType::F32, None), (DType::BF16, None), (DType::BF16, Some(DType::F32)), (DType::F64, None)];
        for (acc, (d, out)) in [Addend::Full, Addend::Row].into_iter().flat_map(|acc| pairs.map(|p| (acc, p))) {
            let shapes = [(false, true, 1, 33), (true, false, 1, 33), (false, false, 2, 33), (false, true, 1, 3)];
            for (ta, tb, batch, m) in shapes {
                let (k, n) = (70, 45);
                let dims = |x: usize, y: usize| if batch > 1 { vec![batch, x, y] } else { vec![x, y] };
                let a = if ta { t(d, &dims(k, m)) } else { t(d, &dims(m, k)) };
                let b = if tb { t(d, &dims(n, k)) } else { t(d, &dims(k, n)) };
                let c = if acc == Addend::Row { t(out.unwrap_or(d), &[n]) } else { t(out.unwrap_or(d), &dims(m, n)) };
                cases.push(case(Op::Matmul { ta, tb, out, acc }, vec![randn(a, r), randn(b, r), randn(c, r)]));
            }
        }
        for d in FLOATS {
            // A decode step's rows (a block each, fewer rows than multiprocessors: 16-byte
            // loads, and a width they do not divide) and a prefill's (a warp each).
            for dims in [&[1, 2048][..], &[3, 1030], &[400, 96]] {
                let (x, w) = (t(d, dims), t(d, &dims[1..]));
                cases.push(case(Op::RmsNorm { eps: 1e-6 }, vec![randn(x, r), randn(w, r)]));
            }
            let (x, w) = (t(d, &[6, 7, 96]), t(d, &[96]));
            cases.push(case(Op::RmsNorm { eps: 1e-6 }, vec![randn(x.clone(), r), randn(w.clone(), r)]));
            let norm_bwd = |eps| Op::RmsNormBackward { eps, acc: false };
            cases.push(case(norm_bwd(1e-5), vec![randn(x.clone(), r), randn(w, r), randn(x, r)]));
            // Several rows a block of the one-pass backward (300 rows: a group of 8 or more
            // each), 16-byte loads and a width they do not divide; rows of more than 1024 chunks
            // in f32 and f64 (the `_wide` kernels, four chunks a thread), again 16-byte loads and
            // not; with an addend (`fold_norm_addends`), read beside dy.
            for (rows, width) in [(300, 1536), (300, 1030), (40, 4104), (40, 4099)] {
                let (x, w) = (t(d, &[rows, width]), t(d, &[width]));
                cases.push(case(norm_bwd(1e-6), vec![randn(x.clone(), r), randn(w.clone(), r), randn(x.clone(), r)]));
                let args = vec![randn(x.clone(), r), randn(w, r), randn(x.clone(), r), randn(x, r)];
                cases.push(case(Op::RmsNormBackward { eps: 1e-6, acc: true }, args));
            }
            let llama3 = RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0,
            };
            for (inverse, layout) in [false, true].into_iter().flat_map(|i| HeadLayout::ALL.map(|l| (i, l))) {
                // [B, H, T, D] or [B, T, H, D]: 3 heads, 37 positions; scaled when inverse.
                let dims = if layout == HeadLayout::Bhtd { [2, 3, 37, 64] } else { [2, 37, 3, 64] };
                let scaling = if inverse { llama3 } else { RopeScaling::None };
                let c = Case {
                    op: Op::Rope { theta: 10000.0, inverse, layout, scaling },
                    inputs: vec![randn(t(d, &dims), r)],
                    tol_floor: 2e-6,
                };
                cases.push(c);
            }
            let x = t(d, &[5, 9, 301]);
            cases.push(case(Op::Softmax, vec![randn(x.clone(), r)]));
            cases.push(case(Op::LogSoftmax, vec![randn(x.clone(), r)]));
            let y =
                cpu::eval(&one_node(Op::Softmax, std::slice::from_ref(&x)), &[randn(x.clone(), r)]).unwrap().remove(0);
            cases.push(case(Op::SoftmaxBackward, vec![y, randn(x.clone(), r)]));
            let y = cpu::eval(&one_node(Op::LogSoftmax, std::slice::from_ref(&x)), &[randn(x.clone(), r)])
                .unwrap()
                .remove(0);
            cases.push(case(Op::LogSoftmaxBackward, vec![y, randn(x, r)]));
            for idt in [DType::I32, DType::I64] {
                let logits = randn(t(d, &[45, 1000]), r);
                let mut tg = ids(idt, &[45], 1000, r).to_i64();
                tg[3] = -100;
                tg[17] = -100;
                let tg = HostTensor::from_i64(idt, &[45], &tg).unwrap();
                cases.push(case(Op::CrossEntropy { ignore_index: -100 }, vec![logits.clone(), tg.clone()]));
                let dloss = HostTensor::scalar(rumble_core::ir::stat_dtype(d), 0.7);
                cases.push(case(
                    Op::CrossEntropyBackward { ignore_index: -100 },
                    vec![logits, tg.clone(), dloss.clone()],
                ));
                // Fused last projection + loss: 45 rows in chunks of 16 (the last one partial).
                let (x, w) = (randn(t(d, &[45, 64]), r), randn(t(d, &[300, 64]), r));
                let tg = HostTensor::from_i64(
                    idt,
                    &[45],
                    &tg.to_i64().iter().map(|&v| if v < 0 { v } else { v % 300 }).collect::<Vec<_>>(),
                )
                .unwrap();
                // The forward (loss and each row's log-sum-exp), the backward given the CPU
                // forward's log-sum-exp, and both in one node.
                let lce = |cases: &mut Vec<Case>, x: HostTensor, w: HostTensor, tg: HostTensor| {
                    let fwd = case(Op::LinearCrossEntropy { ignore_index: -100, chunk: 16 }, vec![x, w, tg]);
                    let lse = cpu::eval(&trace_of(&fwd).unwrap(), &fwd.inputs).unwrap().remove(1);
                    let mut ins = fwd.inputs.clone();
                    ins.extend([lse, dloss.clone()]);
                    let mut both = fwd.inputs.clone();
                    both.push(dloss.clone());
                    cases.push(fwd);
                    cases.push(case(Op::LinearCrossEntropyBackward { ignore_index: -100, chunk: 16 }, ins));
                    cases.push(case(Op::LinearCrossEntropyGrad { ignore_index: -100, chunk: 16 }, both));
                };
                lce(cases, x, w, tg.clone());
                // A long vocabulary (each row's log-sum-exp split over several blocks), a head
                // size that is not a multiple of 8 (as in seed-qwen2's 28).
                let (x, w) = (randn(t(d, &[45, 28]), r), randn(t(d, &[20000, 28]), r));
                let tg = HostTensor::from_i64(
                    idt,
                    &[45],
                    &tg.to_i64().iter().map(|&v| if v < 0 { v } else { (v * 67) % 20000 }).collect::<Vec<_>>(),
                )
                .unwrap();
                lce(cases, x, w, tg);
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn attention_matches_cpu() {
    check_cases(4, |r, cases| {
        // (B, Hq, Hkv, T, S, D, causal)
        let shapes = [
            (2, 4, 2, 37, 37, 64, true),
            (1, 7, 1, 130, 130, 100, true),
            (1, 2, 2, 19, 45, 1, false),
            (2, 3, 3, 64, 64, 128, false),
            (1, 2, 1, 200, 200, 16, true),
        ];
        for (d, layout) in FLOATS.into_iter().flat_map(|d| HeadLayout::ALL.map(|l| (d, l))) {
            for &(b, hq, hkv, tq, s, hd, causal) in &shapes {
                let scale = 1.0 / (hd as f64).sqrt();
                let (q, k) = match layout {
                    HeadLayout::Bhtd => (t(d, &[b, hq, tq, hd]), t(d, &[b, hkv, s, hd])),
                    HeadLayout::Bthd => (t(d, &[b, tq, hq, hd]), t(d, &[b, s, hkv, hd])),
                };
                let fwd = Op::Attention { scale, causal, layout };
                let ins = vec![randn(q.clone(), r), randn(k.clone(), r), randn(k.clone(), r)];
                let outs = cpu::eval(&one_node(fwd.clone(), &[q.clone(), k.clone(), k.clone()]), &ins).unwrap();
                let tol = if d == DType::F64 { 1e-9 } else { 0.0 };
                cases.push(Case { op: fwd, inputs: ins.clone(), tol_floor: tol });
                let mut bw = ins;
                bw.extend([outs[0].clone(), outs[1].clone(), randn(q, r)]);
                cases.push(Case { op: Op::AttentionBackward { scale, causal, layout }, inputs: bw, tol_floor: tol });
            }
        }
    });
}

fn one_node(op: Op, args: &[TensorType]) -> rumble_core::Trace {
    let g = Graph::new("ref");
    let ins: Vec<_> =
        args.iter().enumerate().map(|(i, a)| g.data(&format!("x{i}"), a.dtype, a.dims()).unwrap()).collect();
    let refs: Vec<_> = ins.iter().collect();
    for (i, o) in g.apply(op, &refs).unwrap().iter().enumerate() {
        g.output(o, &format!("y{i}")).unwrap();
    }
    g.finish().unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_data_on_the_device_names_the_op() {
    let dev = gpu();
    let mut rng = Rng::new(5);
    let table = randn(t(DType::F32, &[10, 4]), &mut rng);
    let bad = HostTensor::from_i64(DType::I64, &[3], &[1, 12, 2]).unwrap();
    let e = run_gpu(&dev, &case(Op::Gather, vec![table, bad])).unwrap_err();
    assert!(e.contains("gather") && e.contains("12"), "{e}");
    let x = ids(DType::I32, &[8], 10, &mut rng);
    let zero = HostTensor::from_i64(DType::I32, &[8], &[1, 2, 3, 0, 5, 6, 7, 8]).unwrap();
    let e = run_gpu(&dev, &case(Op::Binary(BinaryOp::Div), vec![x, zero])).unwrap_err();
    assert!(e.contains("div") && e.contains("division by zero"), "{e}");
    let logits = randn(t(DType::F32, &[4, 10]), &mut rng);
    let tg = HostTensor::from_i64(DType::I64, &[4], &[1, 2, 33, 0]).unwrap();
    let e = run_gpu(&dev, &case(Op::CrossEntropy { ignore_index: -100 }, vec![logits, tg])).unwrap_err();
    assert!(e.contains("cross_entropy") && e.contains("33"), "{e}");
    let src = randn(t(DType::F32, &[4, 3]), &mut rng);
    let at = HostTensor::from_i64(DType::I64, &[4], &[1, 2, 17, 1]).unwrap();
    let e = run_gpu(&dev, &case(Op::ScatterAdd { rows: 5 }, vec![at, src])).unwrap_err();
    assert!(e.contains("scatter_add") && e.contains("17"), "{e}");
    println!("bad data errors: ok");
}

/// cuBLAS's classic gemm (one of the matmul candidates the tuner may pick) against the CPU and
/// against whatever the tuner chose, for every transpose pair, a batch of 2, each float dtype,
/// with no workspace and with 4 MiB, and accumulating (`beta = 1`).
#[test]
#[ignore = "needs a CUDA device"]
fn classic_cublas_matmul_matches_cpu() {
    use rumble_cuda::matmul::MatmulKey;
    use rumble_cuda::memory::{DeviceBuffer, download};
    let dev = gpu();
    let mut rng = Rng::new(11);
    let r = &mut rng;
    for d in FLOATS {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let at = if ta { t(d, &[2, 70, 33]) } else { t(d, &[2, 33, 70]) };
            let bt = if tb { t(d, &[2, 45, 70]) } else { t(d, &[2, 70, 45]) };
            let (a, b) = (randn(at.clone(), r), randn(bt.clone(), r));
            let op = Op::Matmul { ta, tb, out: None, acc: Addend::None };
            let want =
                cpu::eval(&one_node(op.clone(), &[at.clone(), bt.clone()]), &[a.clone(), b.clone()]).unwrap().remove(0);
            let key = MatmulKey::new(&at, &bt, ta, tb);
            let up = |h: &HostTensor| {
                let buf = DeviceBuffer::new(&dev, h.bytes.len(), "operand").unwrap();
                buf.upload(&dev, 0, &h.bytes).unwrap();
                buf
            };
            let (da, db) = (up(&a), up(&b));
            let c = DeviceBuffer::new(&dev, want.bytes.len(), "c").unwrap();
            let ws = DeviceBuffer::new(&dev, 4 << 20, "workspace").unwrap();
            let get = |what: &str| {
                let g = HostTensor::new(want.ty.clone(), download(&dev, c.ptr, c.bytes).unwrap()).unwrap();
                let (rel, _) = compare(&g, &want, tolerance(d)).unwrap_or_else(|e| panic!("{what} {d} {ta} {tb}: {e}"));
                println!("classic matmul {what} {d} ta={ta} tb={tb}: rel {rel:.2e}");
                g
            };
            for ws_bytes in [0, 4 << 20] {
                unsafe { dev.matmul_classic(&key, [da.ptr, db.ptr, c.ptr, ws.ptr], ws_bytes, 0.0) }.unwrap();
                get(&format!("ws={ws_bytes}"));
            }
            // Accumulating: c = a b + c, with c = a b already there.
            unsafe { dev.matmul_classic(&key, [da.ptr, db.ptr, c.ptr, ws.ptr], 0, 1.0) }.unwrap();
            let twice = HostTensor::new(want.ty.clone(), download(&dev, c.ptr, c.bytes).unwrap()).unwrap();
            let half: Vec<f64> = twice.to_f64().iter().map(|v| v / 2.0).collect();
            let half = HostTensor::from_f64(d, want.ty.dims(), &half).unwrap();
            compare(&half, &want, tolerance(d)).unwrap_or_else(|e| panic!("beta=1 {d} {ta} {tb}: {e}"));
            // The tuner's choice (cuBLASLt or classic) agrees too.
            let n = dev.matmul_workspace(&key).unwrap();
            let ws2 = DeviceBuffer::new(&dev, n.max(256), "workspace").unwrap();
            unsafe { dev.matmul(&key, [da.ptr, db.ptr, c.ptr, ws2.ptr], n, 0.0) }.unwrap();
            get(dev.matmul_algorithm(&key).unwrap());
            // An addend in its own buffer: d = a b + c, with c = a b.
            let dd = DeviceBuffer::new(&dev, want.bytes.len(), "d").unwrap();
            unsafe { dev.matmul_add(&key, [da.ptr, db.ptr, c.ptr, dd.ptr, ws2.ptr], n, 1.0) }.unwrap();
            let twice = HostTensor::new(want.ty.clone(), download(&dev, dd.ptr, dd.bytes).unwrap()).unwrap();
            let half: Vec<f64> = twice.to_f64().iter().map(|v| v / 2.0).collect();
            let half = HostTensor::from_f64(d, want.ty.dims(), &half).unwrap();
            compare(&half, &want, tolerance(d)).unwrap_or_else(|e| panic!("addend {d} {ta} {tb}: {e}"));
        }
    }
}

/// `kernels/gemv.cu` (decoding's matmuls, where the tuner finds one faster than cuBLASLt)
/// against the CPU, every kernel of each shape whatever the tuner picks: each row bucket, bf16
/// giving bf16 or f32 and f32, ragged N and K (a warp's chunks past an unrolled group), an
/// addend beside the result, in place, or a row added to every row (`row_addend`: a bias).
#[test]
#[ignore = "needs a CUDA device"]
fn gemv_matches_cpu() {
    use rumble_cuda::matmul::{MatmulKey, gemv_kernels};
    use rumble_cuda::memory::{DeviceBuffer, download};
    let dev = gpu();
    let mut rng = Rng::new(21);
    for (dtype, out, m, n, k, beta, in_place, row_addend) in [
        (DType::BF16, DType::BF16, 1, 2048, 2048, 0.0, false, false),
        (DType::BF16, DType::BF16, 1, 1000, 2056, 1.0, true, false),
        (DType::BF16, DType::BF16, 1, 515, 8192, 0.0, false, false),
        (DType::BF16, DType::BF16, 4, 77, 1544, 1.0, true, false),
        (DType::BF16, DType::F32, 3, 517, 896, 1.0, false, false),
        (DType::BF16, DType::BF16, 16, 130, 4096, 0.0, false, false),
        (DType::F32, DType::F32, 7, 33, 1001, 1.0, true, false),
        (DType::BF16, DType::BF16, 1, 896, 896, 1.0, false, true),
        (DType::BF16, DType::BF16, 4, 130, 896, 1.0, false, true),
        (DType::F32, DType::F32, 16, 33, 1001, 1.0, false, true),
    ] {
        let a = randn(TensorType::new(dtype, vec![m, k]), &mut rng);
        let b = randn(TensorType::new(dtype, vec![n, k]), &mut rng);
        let c = randn(TensorType::new(out, if row_addend { vec![n] } else { vec![m, n] }), &mut rng);
        let (af, bf, cf) = (a.to_f64(), b.to_f64(), c.to_f64());
        let want: Vec<f64> = (0..m * n)
            .map(|e| (0..k).map(|q| af[(e / n) * k + q] * bf[(e % n) * k + q]).sum::<f64>() + beta * cf[e % cf.len()])
            .collect();
        let key = MatmulKey { out, row_addend, ..MatmulKey::new(&a.ty, &b.ty, false, true) };
        let kernels = gemv_kernels(&dev, &key).unwrap();
        let buf = |h: &HostTensor| {
            let d = DeviceBuffer::new(&dev, h.bytes.len(), "gemv test").unwrap();
            d.upload(&dev, 0, &h.bytes).unwrap();
            d
        };
        for g in &kernels {
            let (da, db, dc) = (buf(&a), buf(&b), buf(&c));
            let d_bytes = m * n * out.size_in_bytes();
            let dd = if in_place { None } else { Some(DeviceBuffer::new(&dev, d_bytes, "gemv test").unwrap()) };
            let d_ptr = dd.as_ref().map_or(dc.ptr, |d| d.ptr);
            unsafe { dev.launch_gemv(&key, g, [da.ptr, db.ptr, dc.ptr, d_ptr], beta) }.unwrap();
            let got =
                HostTensor { ty: TensorType::new(out, vec![m, n]), bytes: download(&dev, d_ptr, d_bytes).unwrap() };
            let want = HostTensor::from_f64(out, &[m, n], &want).unwrap();
            let (rel, _) = compare(&got, &want, tolerance(out)).unwrap_or_else(|e| panic!("{} {key:?}: {e}", g.name));
            println!(
                "{} {dtype} -> {out} M{m} N{n} K{k} beta {beta} in place {in_place} row {row_addend}: rel {rel:.2e}",
                g.name
            );
        }
        assert_eq!(kernels.len(), if m <= 4 { 3 } else { 1 }, "gemv kernels of {key:?}");
    }
}
