//! The text form, the verifier, the cleanup passes and the forward/backward split.

use rumble_core::autodiff;
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{
    DType, Graph, HeadLayout, InputRole, Node, Op, OutputRole, RopeScaling, Tensor, TensorType, UnaryOp, ValueId,
    parse, verify,
};
use rumble_core::passes;
use rumble_core::testing::{TinyLlama, random_inputs};
use rumble_core::{Trace, ValueId as V};

fn llama_joint() -> (Trace, Trace) {
    let cfg = TinyLlama { layers: 2, dtype: DType::BF16, ..Default::default() };
    let trace = cfg.loss_graph().unwrap().finish().unwrap();
    let params: Vec<&str> = trace.inputs.iter().skip(2).map(|i| i.name.as_str()).collect();
    let joint = autodiff::grad(&trace, "loss", &params).unwrap();
    (trace, joint)
}

#[test]
fn print_then_parse_gives_the_same_trace() {
    let (fwd, joint) = llama_joint();
    let split = autodiff::split(&joint).unwrap();
    for t in [&fwd, &joint, &split.forward, &split.backward] {
        let text = t.to_string();
        let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(&back, t);
        assert_eq!(back.to_string(), text);
    }
    // The joint trace has a backward section and gradient outputs.
    let text = joint.to_string();
    assert!(text.contains("  -- backward\n"));
    assert!(text.contains("attention_backward("));
    assert!(text.contains("grad_of=%"));
}

#[test]
fn text_form_reads_as_documented() {
    let g = Graph::new("block");
    let x = g.data("x", DType::F32, &[2, 3]).unwrap();
    let w = g.param("norm.weight", DType::F32, &[3]).unwrap();
    let y = x.rms_norm(&w, 1e-6).unwrap();
    g.output(&y, "y").unwrap();
    let t = g.finish().unwrap();
    let want = "trace \"block\" {\n  input %0: f32[2,3] \"x\" input\n  input %1: f32[3] \"norm.weight\" param\n  \
                %2: f32[2,3] = rms_norm(%0, %1) eps=1e-6\n  output %2 \"y\"\n}\n";
    assert_eq!(t.to_string(), want);
}

/// Attention and RoPE carry their layout: `layout=bthd` in the text form, nothing for `bhtd`
/// (text written before the attribute existed parses as `bhtd`); the verifier names the layout
/// and the shapes it wants.
#[test]
fn head_layouts_in_the_text_form_and_the_verifier() {
    let g = Graph::new("attn");
    let q = g.data("q", DType::BF16, &[2, 5, 7, 4]).unwrap(); // (B, T, Hq, D)
    let k = g.data("k", DType::BF16, &[2, 5, 1, 4]).unwrap(); // (B, S, Hkv, D)
    let q = q.rope_in(HeadLayout::Bthd, 1e4).unwrap();
    let (o, lse) = Tensor::attention_in(HeadLayout::Bthd, &q, &k, &k, 0.5, true).unwrap();
    assert_eq!((o.dims(), lse.dims()), (&[2, 5, 7, 4][..], &[2, 7, 5][..]));
    g.output(&o.cast(DType::F32).unwrap().sum_all().unwrap(), "loss").unwrap();
    let trace = g.finish().unwrap();
    let joint = autodiff::grad(&trace, "loss", &["q", "k"]).unwrap();
    let text = joint.to_string();
    assert!(text.contains("rope(%0) theta=10000.0 inverse=false layout=bthd"), "{text}");
    assert!(text.contains("inverse=true layout=bthd"), "{text}");
    assert!(text.contains("scale=0.5 causal=true layout=bthd"), "{text}");
    assert!(text.contains("attention_backward(") && !text.contains("permute"), "{text}");
    assert_eq!(parse(&text).unwrap(), joint);

    // Old text: no layout attribute means bhtd.
    let old = "trace \"t\" {\n  input %0: f32[1,2,3,4] \"q\" input\n  \
               %1: f32[1,2,3,4], %2: f32[1,2,3] = attention(%0, %0, %0) scale=0.5 causal=true\n  \
               %3: f32[1,2,3,4] = rope(%1) theta=10000.0 inverse=false\n  output %3 \"o\"\n}\n";
    let t = parse(old).unwrap();
    assert_eq!(t.nodes[0].op, Op::Attention { scale: 0.5, causal: true, layout: HeadLayout::Bhtd });
    let rope = Op::Rope { theta: 1e4, inverse: false, layout: HeadLayout::Bhtd, scaling: RopeScaling::None };
    assert_eq!(t.nodes[1].op, rope);
    assert_eq!(t.to_string(), old);
    // A scaled rope prints its scaling and reads it back; a bad one is named.
    let scaled = old.replace("inverse=false", "inverse=false scaling=llama3:8.0:1.0:4.0:8192.0");
    let t = parse(&scaled).unwrap();
    let Op::Rope { scaling, .. } = t.nodes[1].op else { panic!("{:?}", t.nodes[1].op) };
    let want = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    assert_eq!((scaling, t.to_string()), (want, scaled.clone()));
    let e = parse_err(&old.replace("inverse=false", "inverse=false scaling=yarn:2.0"));
    assert!(e.contains("bad value `yarn:2.0` for attribute `scaling`"), "{e}");
    let e = parse_err(&old.replace("causal=true", "causal=true layout=tbhd"));
    assert!(e.contains("bad value `tbhd` for attribute `layout`") && e.contains("bthd"), "{e}");

    // bhtd-shaped operands given to a bthd attention: the lse (and o) types disagree, and a
    // mismatch of heads is named with the layout's pattern.
    let e = parse_err(&old.replace("causal=true", "causal=true layout=bthd"));
    assert!(e.contains("attention") && e.contains("declared f32[1,2,3] but the op makes f32[1,3,2]"), "{e}");
    let g = Graph::new("bad");
    let q = g.data("q", DType::F32, &[1, 6, 4, 8]).unwrap();
    let k = g.data("k", DType::F32, &[1, 6, 3, 8]).unwrap();
    let e = Tensor::attention_in(HeadLayout::Bthd, &q, &k, &k, 1.0, true).unwrap_err().to_string();
    assert!(e.contains("attention") && e.contains("4 query heads are not a multiple of 3"), "{e}");
    assert!(e.contains("f32[1,6,4,8]") && e.contains("layout bthd"), "{e}");
    let k = g.data("k2", DType::F32, &[1, 5, 2, 8]).unwrap();
    let e = Tensor::attention_in(HeadLayout::Bthd, &q, &k, &k, 1.0, true).unwrap_err().to_string();
    assert!(e.contains("causal attention needs equal lengths, got 6 and 5"), "{e}");
    let x = g.data("x", DType::F32, &[1, 6, 4]).unwrap();
    let e = x.rope_in(HeadLayout::Bthd, 1e4).unwrap_err().to_string();
    assert!(e.contains("rope") && e.contains("layout bthd needs [B, T, H, D] with D even"), "{e}");
    let e = Tensor::attention_in(HeadLayout::Bthd, &x, &x, &x, 1.0, false).unwrap_err().to_string();
    assert!(e.contains("q [B, T, Hq, D], k and v [B, S, Hkv, D]"), "{e}");
}

/// The fused loss prints as two outputs (loss, lse) and its backward as five operands (the
/// lse among them); both read back. A gradient through the lse is an error, as attention's.
#[test]
fn fused_loss_and_its_lse_in_the_text_form() {
    let g = Graph::new("lce");
    let x = g.param("x", DType::BF16, &[6, 4]).unwrap();
    let w = g.param("w", DType::BF16, &[10, 4]).unwrap();
    let t = g.data("t", DType::I32, &[6]).unwrap();
    let loss = x.linear_cross_entropy(&w, &t, -100, 4).unwrap();
    g.output(&loss, "loss").unwrap();
    let trace = g.finish().unwrap();
    let joint = autodiff::grad(&trace, "loss", &["x", "w"]).unwrap();
    let text = joint.to_string();
    assert!(
        text.contains("%3: f32[], %4: f32[6] = linear_cross_entropy(%0, %1, %2) ignore_index=-100 chunk=4"),
        "{text}"
    );
    assert!(text.contains("= linear_cross_entropy_backward(%0, %1, %2, %4, "), "{text}");
    let back = parse(&text).unwrap();
    assert_eq!(back, joint);
    assert_eq!(back.to_string(), text);
    // A backward whose lse is not f32[N] does not read back.
    let e = parse_err(
        &text.replace("linear_cross_entropy_backward(%0, %1, %2, %4,", "linear_cross_entropy_backward(%0, %1, %2, %3,"),
    );
    assert!(
        e.contains("linear_cross_entropy_backward") && e.contains("lse must be f32[6]") && e.contains("got f32[]"),
        "{e}"
    );

    let g = Graph::new("lse_grad");
    let x = g.param("x", DType::F32, &[6, 4]).unwrap();
    let w = g.param("w", DType::F32, &[10, 4]).unwrap();
    let t = g.data("t", DType::I64, &[6]).unwrap();
    let (_, lse) = x.linear_cross_entropy_lse(&w, &t, -100, 4).unwrap();
    g.output(&lse.sum_all().unwrap(), "loss").unwrap();
    let e = autodiff::grad(&g.finish().unwrap(), "loss", &["x"]).unwrap_err().to_string();
    assert!(e.contains("linear_cross_entropy: a gradient through the log-sum-exp output is not supported"), "{e}");
}

fn parse_err(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

#[test]
fn parser_errors_name_the_line() {
    let e = parse_err("trace \"t\" {\n  input %0: f32[2] \"x\" input\n  %1: f32[2] = frobnicate(%0)\n}\n");
    assert!(e.contains("line 3") && e.contains("unknown op `frobnicate`"), "{e}");
    let e = parse_err("trace \"t\" {\n  %1: f32[2] = exp(%0)\n}\n");
    assert!(e.contains("line 2") && e.contains("%0 is used before it is defined"), "{e}");
    let e = parse_err("trace \"t\" {\n  input %0: f32[2] \"x\" input\n  %1: f32[2] = pow_scalar(%0)\n}\n");
    assert!(e.contains("missing attribute `exponent`"), "{e}");
    let e = parse_err("trace \"t\" {\n  input %0: f33[2] \"x\" input\n}\n");
    assert!(e.contains("unknown dtype `f33`"), "{e}");
    let e = parse_err("trace \"t\" {\n  input %0: f32[2] \"x\" input\n");
    assert!(e.contains("missing closing"), "{e}");
}

#[test]
fn verifier_rejects_malformed_traces() {
    let g = Graph::new("v");
    let x = g.data("x", DType::F32, &[2, 3]).unwrap();
    let w = g.param("w", DType::F32, &[4, 3]).unwrap();
    let y = x.matmul_t(&w).unwrap();
    g.output(&y, "y").unwrap();
    let good = g.finish().unwrap();
    verify(&good).unwrap();

    let check = |t: &Trace, want: &[&str]| {
        let e = verify(t).unwrap_err().to_string();
        for w in want {
            assert!(e.contains(w), "`{e}` lacks `{w}`");
        }
    };
    // A declared type that the op does not make.
    let mut t = good.clone();
    t.types[2] = TensorType::new(DType::F32, [2, 5]);
    check(&t, &["node 0 (matmul)", "declared f32[2,5] but the op makes f32[2,4]"]);
    // Operands of the wrong shape.
    let mut t = good.clone();
    t.types[1] = TensorType::new(DType::F32, [4, 2]);
    check(&t, &["node 0 (matmul)", "inner dims differ"]);
    // Use before definition.
    let mut t = good.clone();
    t.nodes
        .insert(0, Node { op: Op::Unary(UnaryOp::Exp), args: vec![V(2)], outs: vec![V(3)], phase: Default::default() });
    t.types.push(TensorType::new(DType::F32, [2, 4]));
    check(&t, &["node 0 (exp)", "used before it is defined"]);
    // A value defined twice.
    let mut t = good.clone();
    t.nodes.push(t.nodes[0].clone());
    check(&t, &["node 1 (matmul)", "defined twice"]);
    // Wrong number of operands.
    let mut t = good.clone();
    t.nodes[0].args.pop();
    check(&t, &["takes 2 operands, got 1"]);
    // Output of an undefined value; update of a plain input; grad of a non-input.
    let mut t = good.clone();
    t.outputs[0].value = ValueId(9);
    check(&t, &["output \"y\"", "%9 is not defined"]);
    let mut t = good.clone();
    t.outputs[0].role = OutputRole::Update { of: V(0) };
    check(&t, &["type f32[2,4] differs"]);
    let mut t = good.clone();
    t.outputs.push(t.outputs[0].clone());
    check(&t, &["names must be unique"]);
    let mut t = good.clone();
    t.inputs[1].role = InputRole::Input;
    t.outputs.push(rumble_core::ir::TraceOutput {
        value: V(1),
        name: "w2".into(),
        role: OutputRole::Update { of: V(1) },
    });
    check(&t, &["update_of names \"w\", which is not a param"]);
}

#[test]
fn dce_and_cse() {
    let g = Graph::new("p");
    let x = g.data("x", DType::F32, &[4]).unwrap();
    let a = x.exp().unwrap();
    let b = x.exp().unwrap(); // same as a
    let _dead = x.tanh().unwrap().sigmoid().unwrap();
    let y = a.add(&b).unwrap();
    g.output(&y, "y").unwrap();
    let t = g.finish().unwrap();
    assert_eq!(t.nodes.len(), 5);
    let (clean, logs) = passes::run(&t, passes::CLEANUP).unwrap();
    assert_eq!(clean.op_counts(), vec![("add", 1), ("exp", 1)]);
    assert_eq!(logs.len(), 3);
    let v = HostTensor::from_f32(&[4], &[0.5, -1.0, 2.0, 0.25]).unwrap();
    assert_eq!(cpu::eval(&t, std::slice::from_ref(&v)).unwrap(), cpu::eval(&clean, &[v]).unwrap());
}

#[test]
fn split_forward_then_backward_equals_joint() {
    let (_, joint) = llama_joint();
    let split = autodiff::split(&joint).unwrap();
    assert!(!split.saved.is_empty() && split.saved_bytes > 0);
    assert!(split.forward.nodes.iter().all(|n| !n.op.name().ends_with("_backward")));
    let mut r = Rng::new(3);
    let inputs = random_inputs(&joint, 32, 0.3, &mut r);
    let want = cpu::eval(&joint, &inputs).unwrap();
    let by_name = |t: &Trace, name: &str| t.inputs.iter().position(|i| i.name == name);
    let fwd_in: Vec<HostTensor> =
        split.forward.inputs.iter().map(|i| inputs[by_name(&joint, &i.name).unwrap()].clone()).collect();
    let fwd_out = cpu::eval(&split.forward, &fwd_in).unwrap();
    let bwd_in: Vec<HostTensor> = split
        .backward
        .inputs
        .iter()
        .map(|i| match split.forward.outputs.iter().position(|o| o.name == i.name) {
            Some(k) => fwd_out[k].clone(),
            None => inputs[by_name(&joint, &i.name).unwrap()].clone(),
        })
        .collect();
    let bwd_out = cpu::eval(&split.backward, &bwd_in).unwrap();
    for (o, w) in joint.outputs.iter().zip(&want) {
        let got = match split.backward.outputs.iter().position(|b| b.name == o.name) {
            Some(k) => &bwd_out[k],
            None => &fwd_out[split.forward.outputs.iter().position(|f| f.name == o.name).unwrap()],
        };
        assert_eq!(got, w, "output {} differs", o.name);
    }
}

#[test]
fn fusion_keeps_results_and_round_trips() {
    // An AdamW-like update: scalars broadcast into a chain of elementwise ops.
    let g = Graph::new("adamw");
    let p = g.param("p", DType::F32, &[4, 8]).unwrap();
    let grad = g.data("g", DType::F32, &[4, 8]).unwrap();
    let m = g.input("m", TensorType::new(DType::F32, [4, 8]), InputRole::OptState).unwrap();
    let lr = g.data("lr", DType::F32, &[]).unwrap();
    let m2 = m.mul_scalar(0.9).unwrap().add(&grad.mul_scalar(0.1).unwrap()).unwrap();
    let step = m2.mul(&lr.broadcast_to(&[4, 8]).unwrap()).unwrap();
    let decay = p.mul(&g.full(0.99, DType::F32, &[4, 8])).unwrap();
    let p2 = decay.sub(&step).unwrap();
    g.output_with_role(&p2, "p.new", OutputRole::Update { of: p.id() }).unwrap();
    g.output_with_role(&m2, "m.new", OutputRole::Update { of: m.id() }).unwrap();
    let t = g.finish().unwrap();
    let fused = passes::fuse(&t).unwrap();
    assert_eq!(fused.op_counts(), vec![("fused", 1)], "{fused}");
    let text = fused.to_string();
    assert_eq!(parse(&text).unwrap(), fused, "{text}");
    let mut r = Rng::new(4);
    let inputs: Vec<HostTensor> =
        t.inputs.iter().map(|i| HostTensor::randn(t.ty(i.value).clone(), 1.0, &mut r)).collect();
    assert_eq!(cpu::eval(&t, &inputs).unwrap(), cpu::eval(&fused, &inputs).unwrap());

    // A whole training step: fewer nodes, identical bits.
    let (_, joint) = llama_joint();
    let fused = passes::fuse(&joint).unwrap();
    assert!(fused.nodes.len() < joint.nodes.len());
    assert_eq!(parse(&fused.to_string()).unwrap(), fused);
    let inputs = random_inputs(&joint, 32, 0.3, &mut r);
    assert_eq!(cpu::eval(&joint, &inputs).unwrap(), cpu::eval(&fused, &inputs).unwrap());
}

#[test]
fn fusion_never_makes_a_cycle_through_a_later_merge() {
    // Found by the planner's random-graph tests: t2 and t3 start two groups; t3's group later
    // absorbs an add that depends (through a matmul) on t2's group, so t2's group must not
    // also absorb a node that reads t3.
    let g = Graph::new("cycle");
    let x = g.data("x", DType::F32, &[4, 4]).unwrap();
    let w = g.data("w", DType::F32, &[4, 4]).unwrap();
    let t2 = x.tanh().unwrap();
    let t3 = x.tanh().unwrap();
    let t4 = t2.tanh().unwrap();
    let t5 = t4.matmul(&w).unwrap();
    let t6 = t5.add(&t3).unwrap();
    let t7 = t2.add(&t3).unwrap();
    g.output(&t6, "a").unwrap();
    g.output(&t7, "b").unwrap();
    let t = g.finish().unwrap();
    let fused = passes::fuse(&t).unwrap();
    verify(&fused).unwrap();
    let mut r = Rng::new(2);
    let inputs: Vec<HostTensor> =
        t.inputs.iter().map(|i| HostTensor::randn(t.ty(i.value).clone(), 1.0, &mut r)).collect();
    assert_eq!(cpu::eval(&t, &inputs).unwrap(), cpu::eval(&fused, &inputs).unwrap());
}

/// `fold_casts`: a widening cast that is a bf16 matmul's only use becomes the matmul's `out`
/// (one rounding, to f32: closer to the exact product than bf16-then-f32); a matmul read
/// elsewhere too, or a narrowing cast, stays as it was. `out=` reads back from the text form,
/// and a narrower `out` is refused.
#[test]
fn widening_casts_fold_into_the_matmul_they_read() {
    let g = Graph::new("fold");
    let a = g.param("a", DType::BF16, &[5, 7]).unwrap();
    let b = g.param("b", DType::BF16, &[7, 3]).unwrap();
    let wide = a.matmul(&b).unwrap().cast(DType::F32).unwrap(); // folds
    let shared = a.matmul(&b.cast(DType::F32).unwrap().cast(DType::BF16).unwrap()).unwrap();
    let kept = shared.cast(DType::F32).unwrap().add(&shared.cast(DType::F32).unwrap()).unwrap(); // read twice
    g.output(&wide, "wide").unwrap();
    g.output(&kept, "kept").unwrap();
    let trace = g.finish().unwrap();
    let folded = passes::fold_casts(&trace).unwrap();
    let text = folded.to_string();
    assert_eq!(text.matches("out=f32").count(), 1, "{text}");
    assert_eq!(folded.nodes.iter().filter(|n| matches!(n.op, Op::Cast { .. })).count(), 4, "{text}");
    assert_eq!(parse(&text).unwrap(), folded);

    let r = &mut Rng::new(5);
    let inputs = [
        HostTensor::randn(TensorType::new(DType::BF16, [5, 7]), 1.0, r),
        HostTensor::randn(TensorType::new(DType::BF16, [7, 3]), 1.0, r),
    ];
    let (x, y) = (inputs[0].to_f64(), inputs[1].to_f64());
    let exact: Vec<f64> = (0..15).map(|e| (0..7).map(|k| x[(e / 3) * 7 + k] * y[k * 3 + e % 3]).sum()).collect();
    let before = cpu::eval(&trace, &inputs).unwrap()[0].to_f64();
    let after = cpu::eval(&folded, &inputs).unwrap()[0].to_f64();
    let err = |v: &[f64]| v.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(err(&after) <= 1e-5 * exact.iter().fold(1.0f64, |m, v| m.max(v.abs())), "{after:?} vs {exact:?}");
    assert!(err(&after) < err(&before), "one rounding to f32 beats bf16 then f32");
    assert_eq!(cpu::eval(&trace, &inputs).unwrap()[1], cpu::eval(&folded, &inputs).unwrap()[1]);

    // f32 operands widened to f64 stay as they are (no backend's matmul writes that pair).
    let g = Graph::new("f64");
    let a = g.param("a", DType::F32, &[2, 2]).unwrap();
    g.output(&a.matmul(&a).unwrap().cast(DType::F64).unwrap(), "y").unwrap();
    let t = g.finish().unwrap();
    assert_eq!(passes::fold_casts(&t).unwrap(), t);
    // A narrowing `out` is refused, naming the op.
    let g = Graph::new("narrow");
    let a = g.param("a", DType::F32, &[2, 2]).unwrap();
    g.output(&a.matmul(&a).unwrap(), "y").unwrap();
    let text = g.finish().unwrap().to_string();
    let line = text.lines().find(|l| l.contains("= matmul(")).unwrap();
    let narrow = line.replace("f32[2,2] = matmul", "bf16[2,2] = matmul").replace("tb=false", "tb=false out=bf16");
    let e = parse_err(&text.replace(line, &narrow));
    assert!(e.contains("matmul") && e.contains("out=bf16 must be a float at least as wide as f32"), "{e}");
}

/// Runs a fold `pass` on `trace`: `n` adds go, `n` nodes print `acc=true`, the text reads back;
/// returns the folded trace and random inputs for both.
fn folds_adds(
    trace: &Trace,
    pass: fn(&Trace) -> rumble_core::Result<Trace>,
    n: usize,
    rng: &mut Rng,
) -> (Trace, Vec<HostTensor>) {
    let folded = pass(trace).unwrap();
    let text = folded.to_string();
    assert_eq!(text.matches("acc=true").count(), n, "{text}");
    let adds = |t: &Trace| t.nodes.iter().filter(|n| n.op.name() == "add").count();
    assert_eq!(adds(trace) - adds(&folded), n, "{text}");
    assert_eq!(parse(&text).unwrap(), folded);
    let inputs = trace.inputs.iter().map(|i| HostTensor::randn(trace.ty(i.value).clone(), 1.0, rng)).collect();
    (folded, inputs)
}

/// `fold_addends`: `r + x w` becomes one matmul reading `r` (`acc=true`), the sum rounded once
/// (closer to the exact value in bf16); of two matmuls summed, the later folds and reads the
/// other; a broadcast bias is an addend like any other; a matmul read elsewhere and `m + m`
/// stay adds. `acc=true` reads back from the text form, and an addend of another type is
/// refused.
#[test]
fn adds_fold_into_the_matmul_they_read() {
    let g = Graph::new("acc");
    let x = g.param("x", DType::BF16, &[5, 7]).unwrap();
    let w = g.param("w", DType::BF16, &[7, 7]).unwrap();
    let u = g.param("u", DType::BF16, &[7, 7]).unwrap();
    let r = g.param("r", DType::BF16, &[5, 7]).unwrap();
    let bias = g.param("bias", DType::BF16, &[7]).unwrap();
    let y = r.add(&x.matmul(&w).unwrap()).unwrap(); // folds, r the addend
    let z = x.matmul(&w).unwrap().add(&x.matmul(&u).unwrap()).unwrap(); // x u folds, reads x w
    let m = x.matmul(&u).unwrap().mul_scalar(0.5).unwrap();
    let kept = m.add(&m).unwrap(); // the same value twice
    let shared = x.matmul(&w).unwrap().mul_scalar(0.25).unwrap();
    let used_twice = shared.add(&x.matmul(&u).unwrap()).unwrap().add(&shared).unwrap(); // x u folds, reading `shared`
    let biased = x.matmul(&w).unwrap().add(&bias.broadcast_to(&[5, 7]).unwrap()).unwrap(); // folds
    for (v, name) in [(&y, "y"), (&z, "z"), (&kept, "kept"), (&used_twice, "twice"), (&biased, "biased")] {
        g.output(v, name).unwrap();
    }
    let trace = g.finish().unwrap();
    let rng = &mut Rng::new(9);
    let (folded, inputs) = folds_adds(&trace, passes::fold_addends, 4, rng);
    let before = cpu::eval(&trace, &inputs).unwrap();
    let after = cpu::eval(&folded, &inputs).unwrap();
    let (xs, ws, rs) = (inputs[0].to_f64(), inputs[1].to_f64(), inputs[3].to_f64());
    let exact: Vec<f64> =
        (0..35).map(|e| rs[e] + (0..7).map(|k| xs[(e / 7) * 7 + k] * ws[k * 7 + e % 7]).sum::<f64>()).collect();
    let err = |v: &[f64]| v.iter().zip(&exact).map(|(a, b)| (a - b).abs()).sum::<f64>();
    assert!(err(&after[0].to_f64()) < err(&before[0].to_f64()), "one rounding beats two");
    for (i, name) in [(1, "z"), (3, "twice"), (4, "biased")] {
        let (a, b) = (after[i].to_f64(), before[i].to_f64());
        let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        assert!(a.iter().zip(&b).all(|(a, b)| (a - b).abs() <= 2.0 * scale / 128.0), "{name}: {a:?} vs {b:?}");
    }
    assert_eq!(after[2], before[2]);

    // In f32 the sum is the unfolded one bit for bit (both round the product, then the sum).
    let g = Graph::new("f32");
    let x = g.param("x", DType::F32, &[3, 4]).unwrap();
    let w = g.param("w", DType::F32, &[4, 4]).unwrap();
    g.output(&x.add(&x.matmul(&w).unwrap()).unwrap(), "y").unwrap();
    let t = g.finish().unwrap();
    let f = passes::fold_addends(&t).unwrap();
    assert!(f.to_string().contains("acc=true"));
    let inputs: Vec<HostTensor> = t.inputs.iter().map(|i| HostTensor::randn(t.ty(i.value).clone(), 1.0, rng)).collect();
    assert_eq!(cpu::eval(&t, &inputs).unwrap(), cpu::eval(&f, &inputs).unwrap());
    // An addend of another dtype is refused, naming the op.
    let text = f.to_string();
    let line = text.lines().find(|l| l.contains("acc=true")).unwrap();
    let bad = line.replace("f32[3,4] = matmul", "f64[3,4] = matmul").replace("tb=false", "tb=false out=f64");
    let e = parse_err(&text.replace(line, &bad));
    assert!(e.contains("matmul") && e.contains("addend f32[3,4] must be the result's type f64[3,4]"), "{e}");
}

/// `fold_norm_addends`: in a pre-norm block's backward, `dh + dx` (the residual gradient plus the
/// norm backward's `dx`) becomes the norm backward reading `dh` (`acc=true`), which reads back
/// from the text form and gives the unfolded values (f32: bit for bit); a `dx` read twice, or
/// an addend defined after the norm's backward, stays an add.
#[test]
fn adds_fold_into_the_norm_backward_they_read() {
    let g = Graph::new("norm_acc");
    let x = g.param("x", DType::F32, &[6, 16]).unwrap();
    let w = g.param("w", DType::F32, &[16]).unwrap();
    let dy = g.param("dy", DType::F32, &[6, 16]).unwrap();
    let dh = g.param("dh", DType::F32, &[6, 16]).unwrap();
    let nb =
        |dy: &rumble_core::ir::Tensor| g.apply(Op::RmsNormBackward { eps: 1e-6, acc: false }, &[&x, &w, dy]).unwrap();
    let first = nb(&dy);
    let y = dh.add(&first[0]).unwrap(); // folds: dh is a parameter
    let second = nb(&y);
    let z = second[0].add(&first[1].broadcast_to(&[6, 16]).unwrap()).unwrap(); // the addend comes later: stays
    let third = nb(&dh);
    let twice = third[0].add(&dy).unwrap().add(&third[0]).unwrap(); // dx read twice: stays
    for (v, name) in [(&y, "y"), (&z, "z"), (&twice, "twice"), (&first[1], "dw1"), (&second[1], "dw2")] {
        g.output(v, name).unwrap();
    }
    let trace = g.finish().unwrap();
    let (folded, inputs) = folds_adds(&trace, passes::fold_norm_addends, 1, &mut Rng::new(5));
    assert_eq!(cpu::eval(&trace, &inputs).unwrap(), cpu::eval(&folded, &inputs).unwrap());
}

/// `fold_rope_at`: a decode step's `cache_write(c, rope_at(k, pos), pos)` and
/// `attention_cached(rope_at(q, pos), k, v, pos)` become the node rotating its rows itself
/// (`rope`), which reads back from the text form and computes the same bits (bf16, llama3
/// scaling, positions that differ per sequence); a rotation read twice, at other positions, or
/// in the `bhtd` layout stays.
#[test]
fn key_and_query_rotations_fold_into_their_readers() {
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64.0,
    };
    let g = Graph::new("rope_write");
    let cache = g.param("cache", DType::BF16, &[2, 9, 2, 8]).unwrap();
    let k = g.param("k", DType::BF16, &[2, 3, 2, 8]).unwrap();
    let pos = g.data("pos", DType::I64, &[2]).unwrap();
    let other = g.data("other", DType::I64, &[2]).unwrap();
    let rot = |x: &Tensor, p: &Tensor, l: HeadLayout| x.rope_at_scaled(p, l, 5e5, scaling).unwrap();
    let folds = cache.cache_write(&rot(&k, &pos, HeadLayout::Bthd), &pos).unwrap();
    let twice_k = rot(&k, &pos, HeadLayout::Bthd); // a second rotation, also an output: read twice
    let read_twice = cache.cache_write(&twice_k, &pos).unwrap();
    let elsewhere = cache.cache_write(&rot(&k, &other, HeadLayout::Bthd), &pos).unwrap();
    let kb = g.param("kb", DType::BF16, &[2, 2, 3, 8]).unwrap();
    let bhtd = cache.cache_write(&rot(&kb, &pos, HeadLayout::Bhtd).permute(&[0, 2, 1, 3]).unwrap(), &pos).unwrap();
    // Queries: 4 heads over the 2 cached ones, attending to the cache just written.
    let q = g.param("q", DType::BF16, &[2, 3, 4, 8]).unwrap();
    let attends = Tensor::attention_cached(&rot(&q, &pos, HeadLayout::Bthd), &folds, &folds, &pos, 0.3).unwrap();
    let q_elsewhere = Tensor::attention_cached(&rot(&q, &other, HeadLayout::Bthd), &folds, &folds, &pos, 0.3).unwrap();
    for (v, name) in [
        (&folds, "a"),
        (&read_twice, "b"),
        (&twice_k, "k2"),
        (&elsewhere, "c"),
        (&bhtd, "d"),
        (&attends, "o"),
        (&q_elsewhere, "o2"),
    ] {
        g.output(v, name).unwrap();
    }
    let trace = g.finish().unwrap();
    let folded = passes::fold_rope_at(&trace).unwrap();
    let count = |t: &Trace, name: &str| t.nodes.iter().filter(|n| n.op.name() == name).count();
    assert_eq!(count(&trace, "rope_at") - count(&folded, "rope_at"), 2, "{folded}");
    let writes = folded.nodes.iter().filter(|n| matches!(n.op, Op::CacheWrite { rope: Some(_) })).count();
    let attentions = folded.nodes.iter().filter(|n| matches!(n.op, Op::AttentionCached { rope: Some(_), .. })).count();
    assert_eq!((writes, attentions), (1, 1), "{folded}");
    assert_eq!(parse(&folded.to_string()).unwrap(), folded);
    verify(&folded).unwrap();
    let rng = &mut Rng::new(9);
    let mut inputs: Vec<HostTensor> =
        trace.inputs.iter().map(|i| HostTensor::randn(trace.ty(i.value).clone(), 1.0, rng)).collect();
    let at = |name: &str| trace.inputs.iter().position(|i| i.name == name).unwrap();
    inputs[at("pos")] = HostTensor::from_i64(DType::I64, &[2], &[0, 6]).unwrap();
    inputs[at("other")] = HostTensor::from_i64(DType::I64, &[2], &[4, 1]).unwrap();
    let (a, b) = (cpu::eval(&trace, &inputs).unwrap(), cpu::eval(&folded, &inputs).unwrap());
    assert_eq!(a, b, "the folded write computes the same bits");
    // The rows written are rotated: not the raw keys (sequence 0's second row, at position 1).
    let (written, raw) = (a[0].to_f64(), inputs[at("k")].to_f64());
    assert_ne!(written[16..32], raw[16..32]);
}

/// `fold_prologues`: in a decode step (a row or two), the norm read by three projections and the
/// swiglu read by the down projection (itself added to the stream: `acc`) become `matmul_pre`
/// nodes, which read back from the text form and compute the same bits (bf16); a norm also read
/// by another op, one of more than `PROLOGUE_ROWS` rows, and a norm read as a matmul's right
/// operand stay. `fold_projections` then joins the three projections of the norm (and the
/// gate/up one, which reads the same rows) into one node of four results, placed where the last
/// stood with the readers of the others after it: the same bits again.
#[test]
fn norms_and_swiglus_fold_into_the_projections_they_feed() {
    let g = Graph::new("prologues");
    let x = g.param("x", DType::BF16, &[2, 16]).unwrap();
    let gw = g.param("g", DType::BF16, &[16]).unwrap();
    let [wq, wk, wv] = ["wq", "wk", "wv"].map(|n| g.param(n, DType::BF16, &[24, 16]).unwrap());
    let gu_w = g.param("w_gate_up", DType::BF16, &[40, 16]).unwrap();
    let down = g.param("w_down", DType::BF16, &[16, 20]).unwrap();
    let h = x.rms_norm(&gw, 1e-5).unwrap();
    let [q, k, v] = [&wq, &wk, &wv].map(|w| h.matmul_t(w).unwrap());
    let gate_up = h.matmul_t(&gu_w).unwrap();
    let y = x.add(&gate_up.swiglu_packed().unwrap().matmul_t(&down).unwrap()).unwrap();
    // Stays: a norm also read elementwise, a norm of 5 rows, a norm as the right operand.
    let h2 = x.rms_norm(&gw, 1e-6).unwrap();
    let shared = h2.matmul_t(&wq).unwrap().sum(&[0, 1], false).unwrap().add(&h2.sum(&[0, 1], false).unwrap()).unwrap();
    let x5 = g.param("x5", DType::BF16, &[5, 16]).unwrap();
    let tall = x5.rms_norm(&gw, 1e-5).unwrap().matmul_t(&wq).unwrap();
    let right = wq.matmul_t(&x.rms_norm(&gw, 1e-4).unwrap()).unwrap();
    for (t, name) in [(&q, "q"), (&k, "k"), (&v, "v"), (&y, "y"), (&shared, "s"), (&tall, "t"), (&right, "r")] {
        g.output(t, name).unwrap();
    }
    // The residual add folds first (`fold_addends`, as the pipeline runs them): its matmul reads
    // the swiglu.
    let trace = passes::fold_addends(&g.finish().unwrap()).unwrap();
    let folded = passes::fold_prologues(&trace).unwrap();
    let count = |t: &Trace, name: &str| t.nodes.iter().filter(|n| n.op.name() == name).count();
    assert_eq!(count(&folded, "matmul_pre"), 5, "{folded}");
    assert_eq!((count(&folded, "rms_norm"), count(&folded, "swiglu_packed")), (3, 0), "{folded}");
    assert!(folded.to_string().contains("pre=swiglu_packed acc=true"), "{folded}");
    assert_eq!(parse(&folded.to_string()).unwrap(), folded);
    verify(&folded).unwrap();
    let rng = &mut Rng::new(13);
    let inputs: Vec<HostTensor> =
        trace.inputs.iter().map(|i| HostTensor::randn(trace.ty(i.value).clone(), 1.0, rng)).collect();
    assert_eq!(cpu::eval(&trace, &inputs).unwrap(), cpu::eval(&folded, &inputs).unwrap());
    let joined = passes::fold_projections(&folded).unwrap();
    assert_eq!(count(&joined, "matmul_pre"), 2, "{joined}");
    assert!(joined.to_string().contains("outs=4"), "{joined}");
    assert_eq!(parse(&joined.to_string()).unwrap(), joined);
    verify(&joined).unwrap();
    assert_eq!(cpu::eval(&trace, &inputs).unwrap(), cpu::eval(&joined, &inputs).unwrap());
    // A weight of another width is refused, naming the op and the shapes.
    let text = joined.to_string();
    let e = parse_err(&text.replace("bf16[40,16]", "bf16[40,15]"));
    assert!(e.contains("matmul_pre") && e.contains("weight 3 must be bf16[N, 16], got bf16[40,15]"), "{e}");
}

/// `fold_loss_grad`: the fused loss and its backward become one `linear_cross_entropy_grad`
/// computing the same bits (the objective's cotangent is a constant); it reads back from the
/// text form. Where the cotangent depends on the loss (`loss * loss`), or the log-sum-exp is
/// read elsewhere, the pair stays.
#[test]
fn the_fused_loss_and_its_backward_fold_into_one_node() {
    let build = |square: bool, lse_out: bool| {
        let g = Graph::new("lce");
        let x = g.param("x", DType::BF16, &[13, 8]).unwrap();
        let w = g.param("w", DType::BF16, &[37, 8]).unwrap();
        let t = g.data("t", DType::I64, &[13]).unwrap();
        let (loss, lse) = x.mul_scalar(1.5).unwrap().linear_cross_entropy_lse(&w, &t, -100, 4).unwrap();
        let obj = if square { loss.mul(&loss).unwrap() } else { loss };
        g.output(&obj, "loss").unwrap();
        if lse_out {
            g.output(&lse, "lse").unwrap();
        }
        autodiff::grad(&g.finish().unwrap(), "loss", &["x", "w"]).unwrap()
    };
    let count = |t: &Trace, name: &str| t.nodes.iter().filter(|n| n.op.name() == name).count();
    let joint = build(false, false);
    let folded = passes::fold_loss_grad(&joint).unwrap();
    let text = folded.to_string();
    assert_eq!(count(&folded, "linear_cross_entropy_grad"), 1, "{text}");
    assert_eq!(count(&folded, "linear_cross_entropy") + count(&folded, "linear_cross_entropy_backward"), 0, "{text}");
    assert_eq!(parse(&text).unwrap(), folded);
    let rng = &mut Rng::new(3);
    let mut inputs: Vec<HostTensor> =
        joint.inputs.iter().map(|i| HostTensor::randn(joint.ty(i.value).clone(), 1.0, rng)).collect();
    let tv: Vec<i64> = (0..13).map(|i| if i % 5 == 2 { -100 } else { (i * 7) % 37 }).collect();
    inputs[2] = HostTensor::from_i64(DType::I64, &[13], &tv).unwrap();
    let (a, b) = (cpu::eval(&joint, &inputs).unwrap(), cpu::eval(&folded, &inputs).unwrap());
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "the folded node computes the same bits");
    assert!(a[1].to_f64().iter().any(|v| *v != 0.0) && a[2].to_f64().iter().any(|v| *v != 0.0));
    for (square, lse_out) in [(true, false), (false, true)] {
        let j = build(square, lse_out);
        assert_eq!(passes::fold_loss_grad(&j).unwrap(), j, "square {square}, lse read {lse_out}");
    }
}
