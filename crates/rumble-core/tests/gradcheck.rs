//! Every op's VJP against central finite differences, in f64, on random non-zero inputs.
//!
//! Each case builds `out = f(inputs)`, reduces it to `loss = sum(out * w)` with a fixed random
//! `w` (so every output element matters), differentiates with `autodiff::grad`, runs the joint
//! trace on the CPU and compares each gradient element with `(L(x+h) - L(x-h)) / 2h`.

use rumble_core::autodiff;
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{DType, Graph, HeadLayout, RopeScaling, Tensor, TensorType};
use rumble_core::{Result, Trace};

struct Input {
    name: &'static str,
    value: HostTensor,
    differentiate: bool,
}

fn randn(dims: &[usize], rng: &mut Rng) -> HostTensor {
    HostTensor::randn(TensorType::new(DType::F64, dims.to_vec()), 1.0, rng)
}

/// Random values in `[lo, lo + 1)`, away from zero for log, sqrt and friends.
fn positive(dims: &[usize], lo: f64, rng: &mut Rng) -> HostTensor {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| lo + rng.uniform()).collect();
    HostTensor::from_f64(DType::F64, dims, &v).unwrap()
}

fn diff(name: &'static str, value: HostTensor) -> Input {
    Input { name, value, differentiate: true }
}

fn fixed(name: &'static str, value: HostTensor) -> Input {
    Input { name, value, differentiate: false }
}

/// Builds the loss trace for `f` on `inputs`.
fn loss_trace(inputs: &[Input], f: &dyn Fn(&[Tensor]) -> Result<Tensor>, rng: &mut Rng) -> (Trace, HostTensor) {
    let g = Graph::new("gradcheck");
    let ts: Vec<Tensor> = inputs.iter().map(|i| g.data(i.name, i.value.ty.dtype, i.value.ty.dims()).unwrap()).collect();
    let out = f(&ts).expect("building the case");
    let w = g.data("__w", out.dtype(), out.dims()).unwrap();
    let loss = out.mul(&w).unwrap().sum_all().unwrap().cast(DType::F64).unwrap();
    g.output(&loss, "loss").unwrap();
    let wv = HostTensor::randn(out.ty().clone(), 1.0, rng);
    (g.finish().unwrap(), wv)
}

fn eval_loss(trace: &Trace, vals: &[HostTensor]) -> f64 {
    cpu::eval(trace, vals).unwrap()[0].item()
}

#[track_caller]
fn gradcheck(case: &str, inputs: Vec<Input>, f: &dyn Fn(&[Tensor]) -> Result<Tensor>) {
    gradcheck_tol(case, inputs, f, 1e-6, 1e-6);
}

#[track_caller]
fn gradcheck_tol(case: &str, inputs: Vec<Input>, f: &dyn Fn(&[Tensor]) -> Result<Tensor>, h: f64, tol: f64) {
    let mut rng = Rng::new(case.len() as u64 * 7919);
    let (trace, w) = loss_trace(&inputs, f, &mut rng);
    let wrt: Vec<&str> = inputs.iter().filter(|i| i.differentiate).map(|i| i.name).collect();
    let joint = autodiff::grad(&trace, "loss", &wrt).unwrap();
    let mut vals: Vec<HostTensor> = inputs.iter().map(|i| i.value.clone()).collect();
    vals.push(w);
    let outs = cpu::eval(&joint, &vals).unwrap();
    for (k, inp) in inputs.iter().enumerate().filter(|(_, i)| i.differentiate) {
        let grad = outs[joint.outputs.iter().position(|o| o.name == format!("grad.{}", inp.name)).unwrap()].to_f64();
        let x = inp.value.to_f64();
        assert!(grad.iter().any(|g| *g != 0.0), "{case}: gradient of {} is all zero", inp.name);
        // Check at most 24 elements, spread over the tensor.
        let step = x.len().div_ceil(24).max(1);
        for i in (0..x.len()).step_by(step) {
            let probe = |d: f64| {
                let mut xs = x.clone();
                xs[i] += d;
                let mut v = vals.clone();
                v[k] = HostTensor::from_f64(DType::F64, inp.value.ty.dims(), &xs).unwrap();
                eval_loss(&trace, &v)
            };
            let fd = (probe(h) - probe(-h)) / (2.0 * h);
            let err = (fd - grad[i]).abs() / (1.0 + fd.abs().max(grad[i].abs()));
            assert!(err < tol, "{case}: d loss / d {}[{i}]: autodiff {} vs finite differences {fd}", inp.name, grad[i]);
        }
    }
}

fn rng() -> Rng {
    Rng::new(42)
}

#[test]
fn unary_ops() {
    let r = &mut rng();
    type F = fn(&Tensor) -> Result<Tensor>;
    let any: [(&str, F); 7] = [
        ("neg", |x| x.neg()),
        ("exp", |x| x.exp()),
        ("sigmoid", |x| x.sigmoid()),
        ("silu", |x| x.silu()),
        ("tanh", |x| x.tanh()),
        ("square", |x| x.square()),
        ("abs", |x| x.abs()),
    ];
    for (name, f) in any {
        gradcheck(name, vec![diff("x", randn(&[3, 4], r))], &|t| f(&t[0]));
    }
    let pos: [(&str, F); 5] = [
        ("log", |x| x.log()),
        ("sqrt", |x| x.sqrt()),
        ("rsqrt", |x| x.rsqrt()),
        ("recip", |x| x.recip()),
        ("pow_scalar", |x| x.powf(2.5)),
    ];
    for (name, f) in pos {
        gradcheck(name, vec![diff("x", positive(&[3, 4], 0.5, r))], &|t| f(&t[0]));
    }
    gradcheck("scalar ops", vec![diff("x", randn(&[5], r))], &|t| t[0].add_scalar(3.0)?.mul_scalar(-1.5));
    gradcheck_tol(
        "cast",
        vec![diff("x", randn(&[5], r))],
        &|t| t[0].cast(DType::F32)?.exp()?.cast(DType::F64),
        1e-2,
        1e-3,
    );
}

#[test]
fn binary_ops_and_where() {
    let r = &mut rng();
    let (a, b) = (randn(&[2, 3], r), positive(&[2, 3], 0.5, r));
    type F = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: [(&str, F); 6] = [
        ("add", |a, b| a.add(b)),
        ("sub", |a, b| a.sub(b)),
        ("mul", |a, b| a.mul(b)),
        ("div", |a, b| a.div(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
    ];
    for (name, f) in ops {
        gradcheck(name, vec![diff("a", a.clone()), diff("b", b.clone())], &|t| f(&t[0], &t[1]));
    }
    gradcheck("where", vec![diff("a", a.clone()), diff("b", b.clone())], &|t| {
        let cond = t[0].gt(&t[1].mul_scalar(0.0)?)?;
        cond.select(&t[0].exp()?, &t[1].square()?)
    });
    gradcheck("same operand twice", vec![diff("a", a)], &|t| t[0].mul(&t[0])?.add(&t[0]));
}

#[test]
fn reductions() {
    let r = &mut rng();
    let x = randn(&[2, 3, 4], r);
    for axes in [vec![0], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]] {
        for keepdim in [false, true] {
            let (a1, a2, a3, a4) = (axes.clone(), axes.clone(), axes.clone(), axes.clone());
            gradcheck("sum", vec![diff("x", x.clone())], &move |t| t[0].sum(&a1, keepdim));
            gradcheck("mean", vec![diff("x", x.clone())], &move |t| t[0].mean(&a2, keepdim));
            gradcheck("amax", vec![diff("x", x.clone())], &move |t| t[0].amax(&a3, keepdim));
            gradcheck("sum_squares", vec![diff("x", x.clone())], &move |t| t[0].sum_squares(&a4, keepdim));
        }
    }
}

#[test]
fn layout_ops() {
    let r = &mut rng();
    let x = randn(&[2, 3, 4], r);
    gradcheck("reshape", vec![diff("x", x.clone())], &|t| t[0].reshape(&[6, 4])?.exp());
    gradcheck("permute", vec![diff("x", x.clone())], &|t| t[0].permute(&[2, 0, 1])?.square());
    gradcheck("broadcast", vec![diff("x", randn(&[3, 1], r))], &|t| t[0].broadcast_to(&[2, 3, 4])?.square());
    for (axis, s, e) in [(0, 0, 1), (1, 1, 3), (2, 1, 2), (2, 0, 4)] {
        gradcheck("slice", vec![diff("x", x.clone())], &move |t| t[0].slice(axis, s, e)?.square());
    }
    gradcheck("concat", vec![diff("a", x.clone()), diff("b", randn(&[2, 2, 4], r))], &|t| {
        Tensor::concat(&[&t[0], &t[1], &t[0]], 1)?.square()
    });
}

#[test]
fn gather_scatter_matmul() {
    let r = &mut rng();
    let ids = HostTensor::from_i64(DType::I64, &[2, 3], &[4, 0, 4, 2, 1, 4]).unwrap();
    gradcheck("gather", vec![diff("table", randn(&[5, 3], r)), fixed("ids", ids.clone())], &|t| t[0].gather(&t[1]));
    gradcheck("scatter_add", vec![fixed("ids", ids), diff("src", randn(&[2, 3, 3], r))], &|t| {
        t[0].scatter_add(&t[1], 5)?.square()
    });
    for ta in [false, true] {
        for tb in [false, true] {
            let a = if ta { randn(&[2, 4, 3], r) } else { randn(&[2, 3, 4], r) };
            let b = if tb { randn(&[2, 5, 4], r) } else { randn(&[2, 4, 5], r) };
            gradcheck("matmul", vec![diff("a", a), diff("b", b)], &move |t| t[0].matmul_opts(&t[1], ta, tb));
        }
    }
}

#[test]
fn norms_rope_softmax_swiglu() {
    let r = &mut rng();
    gradcheck("rms_norm", vec![diff("x", randn(&[3, 8], r)), diff("w", randn(&[8], r))], &|t| {
        t[0].rms_norm(&t[1], 1e-6)
    });
    gradcheck("rope", vec![diff("x", randn(&[2, 3, 5, 8], r))], &|t| t[0].rope(10000.0));
    gradcheck("rope bthd", vec![diff("x", randn(&[2, 5, 3, 8], r))], &|t| t[0].rope_in(HeadLayout::Bthd, 10000.0));
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16.0,
    };
    gradcheck("rope llama3", vec![diff("x", randn(&[2, 5, 3, 8], r))], &|t| {
        t[0].rope_scaled(HeadLayout::Bthd, 10000.0, llama3)
    });
    gradcheck("softmax", vec![diff("x", randn(&[3, 7], r))], &|t| t[0].softmax());
    gradcheck("log_softmax", vec![diff("x", randn(&[3, 7], r))], &|t| t[0].log_softmax());
    gradcheck("swiglu", vec![diff("g", randn(&[4, 6], r)), diff("u", randn(&[4, 6], r))], &|t| t[0].swiglu(&t[1]));
    gradcheck("swiglu_packed", vec![diff("x", randn(&[2, 3, 10], r))], &|t| t[0].swiglu_packed());
}

#[test]
fn cross_entropy_with_ignored_targets() {
    let r = &mut rng();
    let t = HostTensor::from_i64(DType::I64, &[6], &[3, -100, 0, 6, -100, 2]).unwrap();
    gradcheck("cross_entropy", vec![diff("logits", randn(&[6, 7], r)), fixed("t", t)], &|t| {
        t[0].cross_entropy(&t[1], -100)
    });
    let t32 = HostTensor::from_i64(DType::I32, &[3], &[1, 1, 0]).unwrap();
    gradcheck("cross_entropy i32", vec![diff("logits", randn(&[3, 4], r)), fixed("t", t32)], &|t| {
        t[0].cross_entropy(&t[1], -1)
    });
}

#[test]
fn fused_linear_cross_entropy_equals_the_unfused_ops() {
    let r = &mut rng();
    let t = HostTensor::from_i64(DType::I64, &[7], &[3, -100, 0, 8, -100, 2, 1]).unwrap();
    for chunk in [1, 3, 7, 100] {
        gradcheck(
            "linear_cross_entropy",
            vec![diff("x", randn(&[7, 5], r)), diff("w", randn(&[9, 5], r)), fixed("t", t.clone())],
            &move |t| t[0].linear_cross_entropy(&t[1], &t[2], -100, chunk),
        );
    }
    // Same value as matmul + cross_entropy.
    let g = Graph::new("lce");
    let x = g.data("x", DType::F32, &[7, 5]).unwrap();
    let w = g.data("w", DType::F32, &[9, 5]).unwrap();
    let tt = g.data("t", DType::I64, &[7]).unwrap();
    g.output(&x.linear_cross_entropy(&w, &tt, -100, 3).unwrap(), "fused").unwrap();
    g.output(&x.matmul_t(&w).unwrap().cross_entropy(&tt, -100).unwrap(), "plain").unwrap();
    let mut r2 = Rng::new(8);
    let xs = HostTensor::randn(TensorType::new(DType::F32, [7, 5]), 1.0, &mut r2);
    let ws = HostTensor::randn(TensorType::new(DType::F32, [9, 5]), 1.0, &mut r2);
    let outs = cpu::eval(&g.finish().unwrap(), &[xs, ws, t]).unwrap();
    assert!((outs[0].item() - outs[1].item()).abs() < 1e-5, "{} vs {}", outs[0].item(), outs[1].item());
}

#[test]
fn attention_gqa_and_head_sizes() {
    let r = &mut rng();
    // (B, Hq, Hkv, T, D, causal)
    for (b, hq, hkv, t, d, causal) in
        [(1, 2, 2, 4, 1, true), (2, 4, 2, 5, 3, true), (1, 2, 1, 3, 64, true), (1, 3, 1, 4, 2, false)]
    {
        let q = randn(&[b, hq, t, d], r);
        let k = randn(&[b, hkv, t, d], r);
        let v = randn(&[b, hkv, t, d], r);
        let scale = 1.0 / (d as f64).sqrt();
        gradcheck("attention", vec![diff("q", q), diff("k", k), diff("v", v)], &move |t| {
            Ok(Tensor::attention(&t[0], &t[1], &t[2], scale, causal)?.0)
        });
    }
    // Sequence-major operands [B, T, H, D].
    for (b, hq, hkv, t, s, d, causal) in [(2, 4, 2, 5, 5, 3, true), (1, 7, 1, 3, 3, 2, true), (1, 2, 2, 3, 4, 4, false)]
    {
        let q = randn(&[b, t, hq, d], r);
        let k = randn(&[b, s, hkv, d], r);
        let v = randn(&[b, s, hkv, d], r);
        gradcheck("attention bthd", vec![diff("q", q), diff("k", k), diff("v", v)], &move |t| {
            Ok(Tensor::attention_in(HeadLayout::Bthd, &t[0], &t[1], &t[2], 0.6, causal)?.0)
        });
    }
}

#[test]
fn whole_llama_style_model() {
    let cfg = rumble_core::testing::TinyLlama::default();
    let g = cfg.loss_graph().unwrap();
    let trace = g.finish().unwrap();
    let params: Vec<&str> = trace.inputs.iter().skip(2).map(|i| i.name.as_str()).collect();
    let joint = autodiff::grad(&trace, "loss", &params).unwrap();
    let mut r = Rng::new(5);
    let n = cfg.batch * cfg.seq;
    let mut vals = vec![
        HostTensor::randint(TensorType::new(DType::I64, [n]), cfg.vocab as u64, &mut r),
        HostTensor::randint(TensorType::new(DType::I64, [n]), cfg.vocab as u64, &mut r),
    ];
    for i in &trace.inputs[2..] {
        vals.push(HostTensor::randn(trace.ty(i.value).clone(), 0.5, &mut r));
    }
    let outs = cpu::eval(&joint, &vals).unwrap();
    for (k, name) in params.iter().enumerate() {
        let gi = outs[joint.outputs.iter().position(|o| o.name == format!("grad.{name}")).unwrap()].to_f64();
        let x = vals[k + 2].to_f64();
        for i in [0, x.len() / 2, x.len() - 1] {
            let probe = |d: f64| {
                let mut xs = x.clone();
                xs[i] += d;
                let mut v = vals.clone();
                v[k + 2] = HostTensor::from_f64(DType::F64, vals[k + 2].ty.dims(), &xs).unwrap();
                eval_loss(&trace, &v)
            };
            let fd = (probe(1e-6) - probe(-1e-6)) / 2e-6;
            assert!((fd - gi[i]).abs() < 1e-6 * (1.0 + fd.abs()), "{name}[{i}]: autodiff {} vs fd {fd}", gi[i]);
        }
    }
}

/// Packed swiglu equals swiglu of the two halves of each row, forward and backward, exactly
/// (the same arithmetic on the same numbers), f32 and bf16.
#[test]
fn swiglu_packed_is_swiglu_of_the_row_halves() {
    use rumble_core::ir::Op;
    let r = &mut rng();
    for dt in [DType::F32, DType::BF16] {
        let (n, f) = (5, 7);
        let x = randn(&[n, 2 * f], r).cast(dt);
        let dy = randn(&[n, f], r).cast(dt);
        let xs = x.to_f64();
        let half =
            |o: usize| -> Vec<f64> { (0..n).flat_map(|i| xs[i * 2 * f + o..i * 2 * f + o + f].to_vec()).collect() };
        let g = HostTensor::from_f64(dt, &[n, f], &half(0)).unwrap();
        let u = HostTensor::from_f64(dt, &[n, f], &half(f)).unwrap();
        let one = |op: Op, args: &[HostTensor]| {
            let gr = Graph::new("one");
            let ins: Vec<Tensor> = args
                .iter()
                .enumerate()
                .map(|(i, a)| gr.data(&format!("a{i}"), a.ty.dtype, a.ty.dims()).unwrap())
                .collect();
            let refs: Vec<&Tensor> = ins.iter().collect();
            for (i, o) in gr.apply(op, &refs).unwrap().iter().enumerate() {
                gr.output(o, &format!("o{i}")).unwrap();
            }
            cpu::eval(&gr.finish().unwrap(), args).unwrap()
        };
        let packed = one(Op::SwigluPacked, std::slice::from_ref(&x)).remove(0);
        let plain = one(Op::Swiglu, &[g.clone(), u.clone()]).remove(0);
        assert_eq!(packed.ty, TensorType::new(dt, [n, f]));
        assert_eq!(packed.bytes, plain.bytes, "{dt} forward");
        let dx = one(Op::SwigluPackedBackward, &[x, dy.clone()]).remove(0).to_f64();
        let d = one(Op::SwigluBackward, &[g, u, dy]);
        let (dg, du) = (d[0].to_f64(), d[1].to_f64());
        for i in 0..n {
            assert_eq!(&dx[i * 2 * f..i * 2 * f + f], &dg[i * f..(i + 1) * f], "{dt} dgate row {i}");
            assert_eq!(&dx[i * 2 * f + f..(i + 1) * 2 * f], &du[i * f..(i + 1) * f], "{dt} dup row {i}");
        }
    }
}
