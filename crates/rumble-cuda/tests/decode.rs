//! The decoding ops' kernels (`kernels/decode.cu`) against the CPU reference, one node at a
//! time in the planned executor over a poisoned arena: RoPE at positions, the cache write (not
//! in place here: the copy, then the rows; also rotating the rows it writes; and a layer's keys
//! and values in one launch, `cache_write_kv`), attention over a
//! cache prefix (caches up to 4096 positions, split one to many ways, grouped heads in one or
//! two blocks; also rotating its queries), and the sampler
//! (greedy exactly; with temperature, top-k and top-p the same token on these well-separated
//! rows); and `matmul_pre` (a norm or swiglu folded into a projection) on both of its paths.
//! Skipped without a GPU.

mod common;

use std::sync::Arc;

use common::{compare, gpu, randn, tolerance};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, HeadLayout, Op, RopeScaling, TensorType};
use rumble_core::plan::plan_naive;
use rumble_cuda::decode::attention_split;
use rumble_cuda::{Device, Executor, PlannedExecutor, Program};

fn one_node(dev: &Arc<Device>, op: Op, inputs: &[HostTensor]) -> (HostTensor, HostTensor) {
    outputs(dev, op, inputs).remove(0)
}

fn ids(vals: &[i64]) -> HostTensor {
    HostTensor::from_i64(DType::I64, &[vals.len()], vals).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn decoding_ops_match_cpu() {
    let dev = gpu();
    let mut rng = Rng::new(11);
    let t = |d: DType, dims: &[usize]| TensorType::new(d, dims.to_vec());
    for d in [DType::F32, DType::BF16, DType::F16] {
        let tol = tolerance(d).max(if d == DType::F32 { 1e-5 } else { 0.0 });
        let check = |op: Op, inputs: Vec<HostTensor>| {
            let name = op.name();
            let (got, want) = one_node(&dev, op, &inputs);
            let r = compare(&got, &want, tol).unwrap_or_else(|e| panic!("{name} {d}: {e}"));
            println!("{name:<18} {d:<5} rel {:.2e} max {:.2e}", r.0, r.1);
        };
        for layout in HeadLayout::ALL {
            let dims = if layout == HeadLayout::Bthd { [3, 2, 4, 16] } else { [3, 4, 2, 16] };
            // Plain and rescaled frequencies (llama3's bounds 16 and 64 keep, blend and divide
            // some of D = 16's), at positions past the original context too.
            let llama3 = RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0,
            };
            for scaling in [RopeScaling::None, RopeScaling::Linear { factor: 4.0 }, llama3] {
                let op = Op::RopeAt { theta: 1e4, layout, scaling };
                check(op, vec![randn(t(d, &dims), &mut rng), ids(&[0, 7, 130])]);
            }
        }
        let cache = randn(t(d, &[3, 20, 2, 8]), &mut rng);
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16.0,
        };
        // Plain, and rotating the new rows as they are written (`fold_rope_at`'s result).
        for rope in [None, Some(rumble_core::ir::RopeNew { theta: 5e5, scaling: llama3 })] {
            let op = Op::CacheWrite { rope };
            check(op.clone(), vec![cache.clone(), randn(t(d, &[3, 4, 2, 8]), &mut rng), ids(&[0, 9, 16])]);
            check(op, vec![cache.clone(), randn(t(d, &[3, 1, 2, 8]), &mut rng), ids(&[19, 0, 5])]);
            // A layer's keys and values in one launch (`fold_cache_writes`' node): both results.
            let values = randn(t(d, &[3, 20, 2, 8]), &mut rng);
            for (rows, pos) in [(4, [0, 9, 16]), (1, [19, 0, 5])] {
                let (k, v) = (randn(t(d, &[3, rows, 2, 8]), &mut rng), randn(t(d, &[3, rows, 2, 8]), &mut rng));
                let inputs = [cache.clone(), values.clone(), k, v, ids(&pos)];
                for (j, (got, want)) in outputs(&dev, Op::CacheWriteKv { rope }, &inputs).iter().enumerate() {
                    let r = compare(got, want, tol).unwrap_or_else(|e| panic!("cache_write_kv {d}, result {j}: {e}"));
                    println!("cache_write_kv     {d:<5} result {j} rel {:.2e} max {:.2e}", r.0, r.1);
                }
            }
        }
        for (tq, hd) in [(1, 64), (3, 64), (1, 1), (2, 128)] {
            let q = randn(t(d, &[2, tq, 6, hd]), &mut rng);
            let (k, v) = (randn(t(d, &[2, 1500, 2, hd]), &mut rng), randn(t(d, &[2, 1500, 2, hd]), &mut rng));
            check(Op::AttentionCached { scale: 0.125, rope: None }, vec![q, k, v, ids(&[1200, 37])]);
        }
        // Long caches, split several ways (flash-decoding): (batch, query rows, q heads, kv
        // heads, cache, head size, positions). Positions past the cache see all of it.
        let cases: [([usize; 6], &[i64]); 9] = [
            ([1, 1, 32, 8, 4096, 64], &[4000]),
            ([1, 1, 14, 2, 1000, 64], &[999]),
            ([16, 1, 14, 2, 1000, 64], &[0, 1, 63, 64, 127, 128, 129, 500, 998, 999, 5000, 7, 300, 640, 256, 42]),
            ([4, 1, 8, 1, 4096, 128], &[4095, 130, 2049, 9000]),
            ([2, 1, 32, 1, 1000, 32], &[777, 12]),
            ([1, 1, 16, 2, 4096, 256], &[3333]),
            ([2, 4, 6, 2, 1000, 64], &[996, 5]),
            ([2, 160, 6, 2, 1000, 64], &[800, 5]),
            // Enough row blocks to fill the device unsplit (bf16, f16: the flash forward).
            ([2, 600, 6, 2, 1000, 64], &[300, 0]),
        ];
        let mut splits = std::collections::BTreeSet::new();
        for (dims, pos) in cases {
            let [b, tq, hq, hkv, s, hd] = dims;
            let q = randn(t(d, &[b, tq, hq, hd]), &mut rng);
            let (k, v) = (randn(t(d, &[b, s, hkv, hd]), &mut rng), randn(t(d, &[b, s, hkv, hd]), &mut rng));
            let scale = 1.0 / (hd as f64).sqrt();
            let op = Op::AttentionCached { scale, rope: None };
            // The split the recipe runs (timed per shape), one split where the flash forward does.
            let tys = [q.ty.clone(), k.ty.clone(), v.ty.clone(), t(DType::I64, &[b])];
            let split = attention_split(&dev, &op, &tys.iter().collect::<Vec<_>>()).expect("the split");
            splits.insert(split.map_or(1, |p| p.splits));
            println!("attention_cached b {b} t {tq} hq {hq} hkv {hkv} s {s} d {hd}: {split:?}");
            check(op, vec![q, k, v, ids(pos)]);
        }
        // The queries rotated by the node itself (`fold_rope_at`'s result): one decode row on
        // the flash-decoding kernel, a few rows, and prefill chunks on the flash forward (bf16,
        // f16), whose queries a rope_at step rotates into scratch first.
        let rope = Some(rumble_core::ir::RopeNew { theta: 5e5, scaling: llama3 });
        for (dims, pos) in [
            ([2, 1, 32, 8, 1000, 64], &[999i64, 40][..]),
            ([2, 3, 6, 2, 1000, 128], &[996, 5]),
            ([2, 160, 6, 2, 1000, 64], &[800, 5]),
        ] {
            let [b, tq, hq, hkv, s, hd] = dims;
            let q = randn(t(d, &[b, tq, hq, hd]), &mut rng);
            let (k, v) = (randn(t(d, &[b, s, hkv, hd]), &mut rng), randn(t(d, &[b, s, hkv, hd]), &mut rng));
            check(Op::AttentionCached { scale: 0.125, rope }, vec![q, k, v, ids(pos)]);
        }
        assert!(splits.len() >= 3 && splits.contains(&1), "split counts covered: {splits:?}");
        // Rows with one clear winner each, so every sampler setting agrees with the CPU.
        let (rows, vocab) = (4, 5000);
        let mut logits: Vec<f64> = (0..rows * vocab).map(|_| rng.normal()).collect();
        for r in 0..rows {
            logits[r * vocab + (r * 977 + 13) % vocab] = 40.0;
        }
        let lg = HostTensor::from_f64(d, &[rows, vocab], &logits).unwrap();
        let key = HostTensor::from_i64(DType::I64, &[2], &[3, 9]).unwrap();
        for (temperature, top_k, top_p) in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.5)]
        {
            let op = Op::Sample { temperature, top_k, top_p };
            let (got, want) = one_node(&dev, op, &[lg.clone(), key.clone()]);
            assert_eq!(got.to_i64(), want.to_i64(), "sample T={temperature} k={top_k} p={top_p} {d}");
        }
    }
    // Ties go to the lowest index, as on the CPU.
    let tied = HostTensor::from_f64(
        DType::F32,
        &[1, 3000],
        &(0..3000).map(|i| if i % 1000 == 7 { 2.0 } else { 0.0 }).collect::<Vec<_>>(),
    )
    .unwrap();
    let key = HostTensor::from_i64(DType::I64, &[2], &[0, 0]).unwrap();
    let (got, _) = one_node(&dev, Op::Sample { temperature: 0.0, top_k: 0, top_p: 1.0 }, &[tied, key]);
    assert_eq!(got.to_i64(), [7]);
}

/// `matmul_pre` against the CPU: each prologue, without addends, with addends of the results'
/// types and with rows added to every row (a bias), one projection and a
/// set of three (widths N, N / 2 + 1 and 7), on gemv.cu's prologue kernels where the tuner runs
/// the plain matmuls there, and on the prologue's kernel then cuBLAS where it does not (8 rows:
/// no prologue kernel).
#[test]
#[ignore = "needs a CUDA device"]
fn matmul_pre_matches_cpu() {
    use rumble_core::ir::{Addend, Prologue};
    use rumble_cuda::matmul::{MatmulKey, gemv_pre_kernel};
    let dev = gpu();
    let mut rng = Rng::new(12);
    let t = |d: DType, dims: &[usize]| TensorType::new(d, dims.to_vec());
    let mut paths = std::collections::BTreeSet::new();
    for d in [DType::F32, DType::BF16, DType::F16] {
        let tol = tolerance(d).max(if d == DType::F32 { 1e-5 } else { 0.0 });
        // (rows, K, N): a decode row against a wide and a narrow weight, a few rows, a ragged K.
        for (m, k, n) in [(1, 2048, 4096), (1, 896, 128), (3, 1000, 77), (1, 200, 9), (8, 512, 64)] {
            for pre in [Prologue::RmsNorm { eps: 1e-5 }, Prologue::SwigluPacked] {
                for (acc, outs) in [Addend::None, Addend::Full, Addend::Row].into_iter().flat_map(|a| [(a, 1), (a, 3)])
                {
                    let widths = [n, n / 2 + 1, 7];
                    let kx = if pre == Prologue::SwigluPacked { 2 * k } else { k };
                    let mut inputs = vec![randn(t(d, &[m, kx]), &mut rng)];
                    if let Prologue::RmsNorm { .. } = pre {
                        inputs.push(randn(t(d, &[k]), &mut rng));
                    }
                    for &nj in &widths[..outs] {
                        inputs.push(randn(t(d, &[nj, k]), &mut rng));
                    }
                    for &nj in &widths[..outs * acc.operands()] {
                        let dims = if acc == Addend::Row { vec![nj] } else { vec![m, nj] };
                        inputs.push(randn(t(d, &dims), &mut rng));
                    }
                    let key = MatmulKey {
                        row_addend: acc == Addend::Row,
                        ..MatmulKey::new(&t(d, &[m, k]), &t(d, &[n, k]), false, true)
                    };
                    let name = if pre == Prologue::SwigluPacked { "swiglu" } else { "norm" };
                    let path = match gemv_pre_kernel(&dev, &key, name).unwrap() {
                        Some(_) => "gemv.cu prologue kernel",
                        None => "prologue kernel, then the tuned matmul",
                    };
                    paths.insert(path);
                    let what = format!("matmul_pre {name} acc {acc:?} outs {outs} {d} {m}x{n}x{k} ({path})");
                    for (j, (got, want)) in outputs(&dev, Op::MatmulPre { pre, acc, outs }, &inputs).iter().enumerate()
                    {
                        let r = compare(got, want, tol).unwrap_or_else(|e| panic!("{what}, result {j}: {e}"));
                        println!("{what}, result {j}: rel {:.2e}", r.0);
                    }
                }
            }
        }
    }
    assert_eq!(paths.len(), 2, "both paths taken: {paths:?}");
}

/// One node run in the planned executor over a poisoned arena: each result and the CPU's.
fn outputs(dev: &Arc<Device>, op: Op, inputs: &[HostTensor]) -> Vec<(HostTensor, HostTensor)> {
    let g = Graph::new(format!("case_{}", op.name()));
    let ins: Vec<_> =
        inputs.iter().enumerate().map(|(i, h)| g.data(&format!("x{i}"), h.ty.dtype, h.ty.dims()).unwrap()).collect();
    let refs: Vec<_> = ins.iter().collect();
    let ys = g.apply(op, &refs).unwrap();
    for (j, y) in ys.iter().enumerate() {
        g.output(y, &format!("y{j}")).unwrap();
    }
    let trace = g.finish().unwrap();
    let want = cpu::eval(&trace, inputs).unwrap();
    let prog = Arc::new(Program::compile(dev.clone(), trace, |t, ws| Ok(plan_naive(t, ws))).unwrap());
    let mut ex = PlannedExecutor::new(prog, &[]).unwrap();
    ex.poison(0xff).unwrap();
    ex.step(inputs).unwrap();
    want.into_iter().enumerate().map(|(j, w)| (ex.output(&format!("y{j}")).unwrap(), w)).collect()
}
