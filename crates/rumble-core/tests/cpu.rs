//! The CPU backend's values on cases worked out by hand, its dtype semantics and its errors.

use rumble_core::autodiff;
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, HeadLayout, Op, Tensor, TensorType};

fn run1(g: &Graph, out: &Tensor, inputs: &[HostTensor]) -> HostTensor {
    g.output(out, "out").unwrap();
    cpu::eval(&g.finish().unwrap(), inputs).unwrap().remove(0)
}

#[test]
fn matmul_with_transposes() {
    // a = [[1,2,3],[4,5,6]], b = [[1,0],[0,1],[1,1]]: a@b = [[4,5],[10,11]].
    let a = HostTensor::from_f32(&[2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
    let b = HostTensor::from_f32(&[3, 2], &[1., 0., 0., 1., 1., 1.]).unwrap();
    let g = Graph::new("mm");
    let (ta, tb) = (g.data("a", DType::F32, &[2, 3]).unwrap(), g.data("b", DType::F32, &[3, 2]).unwrap());
    let out = run1(&g, &ta.matmul(&tb).unwrap(), &[a.clone(), b.clone()]);
    assert_eq!(out.to_f32(), vec![4., 5., 10., 11.]);
    // (a^T)^T @ (b^T)^T through the transpose flags.
    let g = Graph::new("mm_t");
    let (ta, tb) = (g.data("a", DType::F32, &[3, 2]).unwrap(), g.data("b", DType::F32, &[2, 3]).unwrap());
    let at = HostTensor::from_f32(&[3, 2], &[1., 4., 2., 5., 3., 6.]).unwrap();
    let bt = HostTensor::from_f32(&[2, 3], &[1., 0., 1., 0., 1., 1.]).unwrap();
    let out = run1(&g, &ta.matmul_opts(&tb, true, true).unwrap(), &[at, bt]);
    assert_eq!(out.to_f32(), vec![4., 5., 10., 11.]);
}

#[test]
fn bf16_is_rounded_storage_with_f32_arithmetic() {
    // 1 + 2^-9 is not a bf16 (8 bits of mantissa): the sum rounds to 1.
    let g = Graph::new("bf16");
    let x = g.data("x", DType::BF16, &[2]).unwrap();
    let y = g.data("y", DType::BF16, &[2]).unwrap();
    let xs = HostTensor::from_f64(DType::BF16, &[2], &[1.0, 3.0]).unwrap();
    let ys = HostTensor::from_f64(DType::BF16, &[2], &[2f64.powi(-9), 0.5]).unwrap();
    let out = run1(&g, &x.add(&y).unwrap(), &[xs, ys]);
    assert_eq!(out.to_f64(), vec![1.0, 3.5]);
    assert_eq!(out.ty, TensorType::new(DType::BF16, [2]));
}

#[test]
fn rope_rotates_by_position() {
    let mut r = Rng::new(1);
    let ty = TensorType::new(DType::F64, [1, 1, 3, 4]);
    let x = HostTensor::randn(ty.clone(), 1.0, &mut r);
    let g = Graph::new("rope");
    let t = g.data("x", DType::F64, &[1, 1, 3, 4]).unwrap();
    let out = run1(&g, &t.rope(10000.0).unwrap(), std::slice::from_ref(&x)).to_f64();
    let xv = x.to_f64();
    // Position 0: identity.
    assert_eq!(&out[..4], &xv[..4]);
    // Position 1, pair j=0 rotates by angle 1 (inverse frequency 1).
    let (c, s) = (1f64.cos(), 1f64.sin());
    assert!((out[4] - (xv[4] * c - xv[6] * s)).abs() < 1e-6);
    assert!((out[6] - (xv[6] * c + xv[4] * s)).abs() < 1e-6);
    // Norms are preserved.
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
    assert!((n(&out[8..]) - n(&xv[8..])).abs() < 1e-9);
}

#[test]
fn cross_entropy_values_and_bad_targets() {
    let g = Graph::new("ce");
    let l = g.data("logits", DType::F32, &[3, 4]).unwrap();
    let t = g.data("t", DType::I64, &[3]).unwrap();
    g.output(&l.cross_entropy(&t, -100).unwrap(), "loss").unwrap();
    let trace = g.finish().unwrap();
    let logits = HostTensor::from_f32(&[3, 4], &[0.; 12]).unwrap();
    // Uniform logits: every counted row costs ln 4; ignored rows do not count.
    let targets = HostTensor::from_i64(DType::I64, &[3], &[1, -100, 3]).unwrap();
    let loss = cpu::eval(&trace, &[logits.clone(), targets]).unwrap()[0].item();
    assert!((loss - 4f64.ln()).abs() < 1e-6);
    let all_ignored = HostTensor::from_i64(DType::I64, &[3], &[-100; 3]).unwrap();
    assert_eq!(cpu::eval(&trace, &[logits.clone(), all_ignored]).unwrap()[0].item(), 0.0);
    let bad = HostTensor::from_i64(DType::I64, &[3], &[1, 7, 0]).unwrap();
    let e = cpu::eval(&trace, &[logits, bad]).unwrap_err().to_string();
    assert!(e.contains("cross_entropy") && e.contains("target 7 at row 1 is outside 0..4"), "{e}");
}

#[test]
fn gather_checks_ids() {
    let g = Graph::new("emb");
    let table = g.data("table", DType::F32, &[3, 2]).unwrap();
    let ids = g.data("ids", DType::I32, &[2]).unwrap();
    g.output(&table.gather(&ids).unwrap(), "out").unwrap();
    let trace = g.finish().unwrap();
    let tv = HostTensor::from_f32(&[3, 2], &[1., 2., 3., 4., 5., 6.]).unwrap();
    let ok = HostTensor::from_i64(DType::I32, &[2], &[2, 0]).unwrap();
    assert_eq!(cpu::eval(&trace, &[tv.clone(), ok]).unwrap()[0].to_f32(), vec![5., 6., 1., 2.]);
    let bad = HostTensor::from_i64(DType::I32, &[2], &[0, 3]).unwrap();
    let e = cpu::eval(&trace, &[tv, bad]).unwrap_err().to_string();
    assert!(e.contains("gather") && e.contains("id 3 at position 1 is outside 0..3"), "{e}");
}

#[test]
fn causal_attention_first_query_sees_only_the_first_key() {
    let mut r = Rng::new(9);
    let ty = TensorType::new(DType::F32, [1, 2, 4, 3]);
    let (q, k, v) = (
        HostTensor::randn(ty.clone(), 1.0, &mut r),
        HostTensor::randn(ty.clone(), 1.0, &mut r),
        HostTensor::randn(ty.clone(), 1.0, &mut r),
    );
    let g = Graph::new("attn");
    let ins: Vec<Tensor> = ["q", "k", "v"].iter().map(|n| g.data(n, DType::F32, &[1, 2, 4, 3]).unwrap()).collect();
    let (o, lse) = Tensor::attention(&ins[0], &ins[1], &ins[2], 0.5, true).unwrap();
    g.output(&o, "o").unwrap();
    g.output(&lse, "lse").unwrap();
    let outs = cpu::eval(&g.finish().unwrap(), &[q.clone(), k.clone(), v.clone()]).unwrap();
    let (o, vv) = (outs[0].to_f32(), v.to_f32());
    assert_eq!(&o[..3], &vv[..3]);
    // lse of query 0 is its only score.
    let s0: f32 = (0..3).map(|c| q.to_f32()[c] * k.to_f32()[c]).sum::<f32>() * 0.5;
    assert!((outs[1].to_f32()[0] - s0).abs() < 1e-6);
}

/// RoPE and attention (forward, log-sum-exp and, through autodiff, the backward) in the
/// sequence-major layout `[B, T, H, D]` equal the head-major ops between permutes, bit for bit:
/// the same numbers are computed, only read and written at other offsets.
#[test]
fn bthd_layout_equals_bhtd_between_permutes() {
    // (B, Hq, Hkv, T, S, D, causal): GQA 1 and 7, head sizes 1, 2, 64, 100, lengths that are
    // multiples of nothing, T != S without the mask.
    let cases = [
        (1, 7, 1, 37, 37, 100, true),
        (2, 2, 2, 13, 13, 64, false),
        (1, 7, 1, 13, 13, 1, true),
        (2, 3, 3, 5, 11, 64, false),
        (1, 14, 2, 19, 19, 2, true),
        (2, 1, 1, 9, 9, 1, false),
    ];
    let mut r = Rng::new(31);
    for dtype in [DType::F32, DType::BF16] {
        for (b, hq, hkv, t, s, d, causal) in cases {
            let scale = 0.7 / (d as f64).sqrt();
            let rope = d % 2 == 0;
            let shapes = [[b, t, hq, d], [b, s, hkv, d], [b, s, hkv, d], [b, t, hq, d]];
            let vals: Vec<HostTensor> =
                shapes.iter().map(|sh| HostTensor::randn(TensorType::new(dtype, *sh), 1.0, &mut r)).collect();
            let run = |bthd: bool| -> Vec<HostTensor> {
                let g = Graph::new("attn");
                let ins: Vec<Tensor> =
                    ["q", "k", "v", "w"].iter().zip(&shapes).map(|(n, sh)| g.data(n, dtype, sh).unwrap()).collect();
                let (q, k, v) = if bthd {
                    let rot = |x: &Tensor| if rope { x.rope_in(HeadLayout::Bthd, 1e4) } else { Ok(x.clone()) };
                    (rot(&ins[0]).unwrap(), rot(&ins[1]).unwrap(), ins[2].clone())
                } else {
                    let p = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap();
                    let rot = |x: Tensor| if rope { x.rope(1e4).unwrap() } else { x };
                    (rot(p(&ins[0])), rot(p(&ins[1])), p(&ins[2]))
                };
                let layout = if bthd { HeadLayout::Bthd } else { HeadLayout::Bhtd };
                let (o, lse) = Tensor::attention_in(layout, &q, &k, &v, scale, causal).unwrap();
                let o = if bthd { o } else { o.permute(&[0, 2, 1, 3]).unwrap() }; // (B, T, Hq, D)
                let loss = o.mul(&ins[3]).unwrap().cast(DType::F32).unwrap().sum_all().unwrap();
                g.output(&o, "o").unwrap();
                g.output(&lse, "lse").unwrap();
                g.output(&loss, "loss").unwrap();
                let trace = g.finish().unwrap();
                assert_eq!(trace.to_string().contains("permute"), !bthd);
                let joint = autodiff::grad(&trace, "loss", &["q", "k", "v"]).unwrap();
                cpu::eval(&joint, &vals).unwrap()
            };
            let (got, want) = (run(true), run(false));
            let case = format!("{dtype} B{b} Hq{hq} Hkv{hkv} T{t} S{s} D{d} causal {causal}");
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.ty, w.ty, "{case}: output {i}");
                assert!(g.to_f64().iter().any(|x| *x != 0.0), "{case}: output {i} is all zero");
                assert!(g == w, "{case}: output {i} differs");
            }
        }
    }
}

#[test]
fn inputs_are_checked_by_name() {
    let g = Graph::new("t");
    let x = g.data("tokens", DType::I64, &[4]).unwrap();
    g.output(&x.cast(DType::F32).unwrap(), "y").unwrap();
    let trace = g.finish().unwrap();
    let e = cpu::eval(&trace, &[HostTensor::zeros(TensorType::new(DType::I32, [4]))]).unwrap_err().to_string();
    assert!(e.contains("input \"tokens\" must be i64[4], got i32[4]"), "{e}");
    let e = HostTensor::new(TensorType::new(DType::F32, [3]), vec![0; 5]).unwrap_err().to_string();
    assert!(e.contains("5 bytes do not hold a f32[3]"), "{e}");
}

#[test]
fn casts_truncate_and_round() {
    let x = HostTensor::from_f64(DType::F64, &[4], &[-1.7, 2.9, 0.0, 1e-3]).unwrap();
    assert_eq!(x.cast(DType::I32).to_i64(), vec![-1, 2, 0, 0]);
    assert_eq!(x.cast(DType::Bool).to_i64(), vec![1, 1, 0, 1]);
    assert_eq!(x.cast(DType::BF16).cast(DType::F64).to_f64()[1], 2.90625);
}

/// A fused-loss test's operands: random f64 `x [n, c]` and `w [v, c]`, and the targets `tv`.
fn loss_operands((n, c, v): (usize, usize, usize), seed: u64, tv: &[i64]) -> [HostTensor; 3] {
    let r = &mut Rng::new(seed);
    let xs = HostTensor::randn(TensorType::new(DType::F64, [n, c]), 1.0, r);
    let ws = HostTensor::randn(TensorType::new(DType::F64, [v, c]), 1.0, r);
    [xs, ws, HostTensor::from_i64(DType::I64, &[n], tv).unwrap()]
}

/// The fused loss's second output is each row's log-sum-exp of `x @ w^T` (ignored rows too),
/// whatever the chunk; its loss is the mean of `lse - logit[target]` over the kept rows.
#[test]
fn fused_loss_outputs_each_rows_log_sum_exp() {
    let (n, c, v) = (7, 5, 9);
    let tv = [3, -100, 0, 8, -100, 2, 1];
    let [xs, ws, ts] = loss_operands((n, c, v), 31, &tv);
    let (x, w) = (xs.to_f64(), ws.to_f64());
    let logit = |i: usize, j: usize| (0..c).map(|k| x[i * c + k] * w[j * c + k]).sum::<f64>();
    let want: Vec<f64> = (0..n).map(|i| (0..v).map(|j| logit(i, j).exp()).sum::<f64>().ln()).collect();
    let kept: Vec<usize> = (0..n).filter(|&i| tv[i] >= 0).collect();
    let loss = kept.iter().map(|&i| want[i] - logit(i, tv[i] as usize)).sum::<f64>() / kept.len() as f64;
    for chunk in [1, 3, 7, 100] {
        let g = Graph::new("lce");
        let x = g.data("x", DType::F64, &[n, c]).unwrap();
        let w = g.data("w", DType::F64, &[v, c]).unwrap();
        let t = g.data("t", DType::I64, &[n]).unwrap();
        let (l, lse) = x.linear_cross_entropy_lse(&w, &t, -100, chunk).unwrap();
        assert_eq!((l.dims(), lse.dims(), lse.dtype()), (&[][..], &[n][..], DType::F64));
        g.output(&l, "loss").unwrap();
        g.output(&lse, "lse").unwrap();
        let outs = cpu::eval(&g.finish().unwrap(), &[xs.clone(), ws.clone(), ts.clone()]).unwrap();
        assert!((outs[0].item() - loss).abs() < 1e-12, "chunk {chunk}: loss {} vs {loss}", outs[0].item());
        for (i, (got, want)) in outs[1].to_f64().iter().zip(&want).enumerate() {
            assert!((got - want).abs() < 1e-12, "chunk {chunk} row {i}: lse {got} vs {want}");
        }
    }
    // f32 operands give an f32 lse.
    let g = Graph::new("lce32");
    let x = g.data("x", DType::BF16, &[n, c]).unwrap();
    let w = g.data("w", DType::BF16, &[v, c]).unwrap();
    let t = g.data("t", DType::I32, &[n]).unwrap();
    assert_eq!(x.linear_cross_entropy_lse(&w, &t, -100, 2).unwrap().1.dtype(), DType::F32);
}

/// The fused loss's backward takes each row's log-sum-exp from its `lse` operand rather than
/// recomputing it: with `lse + ln 2` every softmax halves, so `2 dx' - dx = -dloss / count *
/// w[target]` on kept rows and 0 on ignored ones. A wrong-typed `lse` is a clear error.
#[test]
fn fused_loss_backward_reads_the_given_lse() {
    let (n, c, v) = (6, 4, 11);
    let tv = [4, 10, -100, 0, 7, 7];
    let [xs, ws, ts] = loss_operands((n, c, v), 32, &tv);
    let op = Op::LinearCrossEntropyBackward { ignore_index: -100, chunk: 4 };
    let g = Graph::new("lce");
    let x = g.data("x", DType::F64, &[n, c]).unwrap();
    let w = g.data("w", DType::F64, &[v, c]).unwrap();
    let t = g.data("t", DType::I64, &[n]).unwrap();
    let lse_in = g.data("lse", DType::F64, &[n]).unwrap();
    let dl = g.data("dloss", DType::F64, &[]).unwrap();
    let (_, lse) = x.linear_cross_entropy_lse(&w, &t, -100, 4).unwrap();
    g.output(&lse, "lse").unwrap();
    let grads = g.apply(op.clone(), &[&x, &w, &t, &lse_in, &dl]).unwrap();
    g.output(&grads[0], "dx").unwrap();
    let trace = g.finish().unwrap();
    let dloss = 0.8;
    let run = |lse: Option<&HostTensor>| {
        let zero = HostTensor::zeros(TensorType::new(DType::F64, [n]));
        let ins =
            [xs.clone(), ws.clone(), ts.clone(), lse.unwrap_or(&zero).clone(), HostTensor::scalar(DType::F64, dloss)];
        cpu::eval(&trace, &ins).unwrap()
    };
    let lse = run(None).remove(0);
    let dx = run(Some(&lse)).remove(1).to_f64();
    let shifted =
        HostTensor::from_f64(DType::F64, &[n], &lse.to_f64().iter().map(|l| l + 2f64.ln()).collect::<Vec<_>>())
            .unwrap();
    let dx2 = run(Some(&shifted)).remove(1).to_f64();
    let (w, count) = (ws.to_f64(), tv.iter().filter(|&&t| t >= 0).count() as f64);
    for i in 0..n {
        for k in 0..c {
            let want = if tv[i] < 0 { 0.0 } else { -dloss / count * w[tv[i] as usize * c + k] };
            let got = 2.0 * dx2[i * c + k] - dx[i * c + k];
            assert!((got - want).abs() < 1e-12, "row {i} col {k}: {got} vs {want}");
        }
    }
    // The lse operand's type is checked: wrong length, wrong dtype.
    let g = Graph::new("bad");
    let x = g.data("x", DType::BF16, &[n, c]).unwrap();
    let w = g.data("w", DType::BF16, &[v, c]).unwrap();
    let t = g.data("t", DType::I64, &[n]).unwrap();
    let dl = g.data("dloss", DType::F32, &[]).unwrap();
    for bad in [g.data("short", DType::F32, &[n - 1]).unwrap(), g.data("half", DType::BF16, &[n]).unwrap()] {
        let e = g.apply(op.clone(), &[&x, &w, &t, &bad, &dl]).unwrap_err().to_string();
        assert!(e.contains("linear_cross_entropy_backward") && e.contains("lse must be f32[6]"), "{e}");
        assert!(e.contains(&bad.ty().to_string()), "{e}");
    }
    let e = g.apply(op, &[&x, &w, &t, &dl]).unwrap_err().to_string();
    assert!(e.contains("takes 5 operands, got 4"), "{e}");
}
