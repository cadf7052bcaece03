//! `fold_cache_writes`: a layer's key and value `cache_write`s become one `cache_write_kv` node
//! (one launch), which reads back from the text form, computes the same bits on the CPU, is
//! refused by the type rule and the verifier where its caches or rows differ in type, and is
//! planned with each result over its own cache (the checker refuses the two swapped).

use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{
    DType, Graph, HeadLayout, InputRole, Op, OutputRole, RopeScaling, Tensor, TensorType, parse, verify,
};
use rumble_core::{Trace, passes};

/// Two layers' writes that join (rotated keys with values, then plain keys with values) and
/// seven that stay: at other positions, into a cache of another shape, two rotating writes,
/// a write whose rows are read from those two, and two writes of one cache. Layer 0's caches
/// are state updated in place; layer 1's are made by nodes (arena buffers).
fn writes() -> Trace {
    let g = Graph::new("kv_writes");
    let ty = TensorType::new(DType::BF16, [2, 9, 2, 8]);
    let state = |name: &str| g.input(name, ty.clone(), InputRole::State).unwrap();
    let (kc0, vc0) = (state("kc0"), state("vc0"));
    let [kc1, vc1, kc2, vc2, kc3, vc3, kc4] = ["kc1", "vc1", "kc2", "vc2", "kc3", "vc3", "kc4"].map(|n| {
        let c = g.param(n, DType::BF16, &[2, 9, 2, 8]).unwrap();
        c.mul_scalar(0.5).unwrap()
    });
    let oc = g.param("oc", DType::BF16, &[2, 9, 1, 8]).unwrap();
    let (k, v) = (g.param("k", DType::BF16, &[2, 3, 2, 8]).unwrap(), g.param("v", DType::BF16, &[2, 3, 2, 8]).unwrap());
    let k1 = g.param("k1", DType::BF16, &[2, 3, 1, 8]).unwrap();
    let [pos, other, third] = ["pos", "other", "third"].map(|n| g.data(n, DType::I64, &[2]).unwrap());
    let scaling = RopeScaling::Linear { factor: 2.0 };
    let rot = |x: &Tensor| x.rope_at_scaled(&pos, HeadLayout::Bthd, 5e5, scaling).unwrap();
    // Layer 0: the keys' rotation folds into their write (`fold_rope_at`); a reader of the new
    // key cache stands between the two writes.
    let k0 = kc0.cache_write(&rot(&k), &pos).unwrap();
    let early = k0.sum_all().unwrap();
    let v0 = vc0.cache_write(&v, &pos).unwrap();
    // Layer 1: nothing rotated.
    let k1w = kc1.cache_write(&k, &pos).unwrap();
    let v1w = vc1.cache_write(&v.neg().unwrap(), &pos).unwrap();
    // Stay.
    let elsewhere = kc2.cache_write(&k, &other).unwrap();
    let narrow = oc.cache_write(&k1, &pos).unwrap();
    let r1 = kc3.cache_write(&rot(&k), &pos).unwrap();
    let r2 = vc3.cache_write(&rot(&v), &pos).unwrap();
    let from_both = r1.slice(1, 0, 3).unwrap().add(&r2.slice(1, 0, 3).unwrap()).unwrap();
    let reads_them = vc2.cache_write(&from_both, &pos).unwrap();
    let once = kc4.cache_write(&k, &third).unwrap();
    let twice = kc4.cache_write(&v, &third).unwrap();
    g.output_with_role(&k0, "kc0.new", OutputRole::Update { of: kc0.id() }).unwrap();
    g.output_with_role(&v0, "vc0.new", OutputRole::Update { of: vc0.id() }).unwrap();
    for (i, t) in [&early, &k1w, &v1w, &elsewhere, &narrow, &r1, &r2, &reads_them, &once, &twice].iter().enumerate() {
        g.output(t, &format!("y{i}")).unwrap();
    }
    g.finish().unwrap()
}

fn count(t: &Trace, f: impl Fn(&Op) -> bool) -> usize {
    t.nodes.iter().filter(|n| f(&n.op)).count()
}

#[test]
fn key_and_value_writes_join_into_one_node_of_the_same_bits() {
    let trace = passes::fold_rope_at(&writes()).unwrap();
    let joined = passes::fold_cache_writes(&trace).unwrap();
    verify(&joined).unwrap();
    assert_eq!(count(&joined, |op| matches!(op, Op::CacheWriteKv { rope: Some(_) })), 1, "{joined}");
    assert_eq!(count(&joined, |op| matches!(op, Op::CacheWriteKv { rope: None })), 1, "{joined}");
    assert_eq!(count(&joined, |op| matches!(op, Op::CacheWrite { .. })), 7, "{joined}");
    // The rotating write is the keys: operands (k cache, v cache, k, v, pos).
    let input = |name: &str| joined.inputs.iter().find(|i| i.name == name).unwrap().value;
    let kv = joined.nodes.iter().find(|n| matches!(n.op, Op::CacheWriteKv { rope: Some(_) })).unwrap();
    assert_eq!(kv.args, [input("kc0"), input("vc0"), input("k"), input("v"), input("pos")]);
    let text = joined.to_string();
    assert!(text.contains("cache_write_kv(") && text.contains("theta=500000.0 scaling=linear:2.0"), "{text}");
    assert_eq!(parse(&text).unwrap(), joined, "round trip");
    // Nothing more to join: the pass is idempotent.
    assert_eq!(passes::fold_cache_writes(&joined).unwrap(), joined);
    let rng = &mut Rng::new(21);
    let mut inputs: Vec<HostTensor> =
        trace.inputs.iter().map(|i| HostTensor::randn(trace.ty(i.value).clone(), 1.0, rng)).collect();
    let at = |name: &str| trace.inputs.iter().position(|i| i.name == name).unwrap();
    for (name, p) in [("pos", [0, 6]), ("other", [4, 1]), ("third", [2, 3])] {
        inputs[at(name)] = HostTensor::from_i64(DType::I64, &[2], &p).unwrap();
    }
    let (a, b) = (cpu::eval(&trace, &inputs).unwrap(), cpu::eval(&joined, &inputs).unwrap());
    assert_eq!(a, b, "the joined writes compute the same bits");
    // The keys are rotated, the values not (sequence 0's second row, at position 1).
    let row = |t: &HostTensor| t.to_f64()[16..32].to_vec();
    assert_ne!(row(&a[0]), row(&inputs[at("k")]));
    assert_eq!(row(&a[1]), row(&inputs[at("v")]));
}

#[test]
fn the_type_rule_and_the_verifier_refuse_caches_or_rows_of_two_types() {
    let g = Graph::new("bad");
    let kc = g.param("kc", DType::F32, &[2, 9, 2, 8]).unwrap();
    let vc = g.param("vc", DType::F32, &[2, 9, 2, 8]).unwrap();
    let oc = g.param("oc", DType::F32, &[2, 9, 1, 8]).unwrap();
    let k = g.param("k", DType::F32, &[2, 1, 2, 8]).unwrap();
    let v2 = g.param("v2", DType::F32, &[2, 2, 2, 8]).unwrap();
    let pos = g.data("pos", DType::I64, &[2]).unwrap();
    let op = Op::CacheWriteKv { rope: None };
    let e = g.apply(op.clone(), &[&kc, &oc, &k, &k, &pos]).unwrap_err().to_string();
    assert!(e.contains("cache_write_kv") && e.contains("needs caches of one type and new rows of one type"), "{e}");
    let e = g.apply(op.clone(), &[&kc, &vc, &k, &v2, &pos]).unwrap_err().to_string();
    assert!(e.contains("caches f32[2,9,2,8], f32[2,9,2,8] and rows f32[2,1,2,8], f32[2,2,2,8]"), "{e}");
    // Each pair is still a cache write: rows that do not fit the caches are named.
    let e = g.apply(op.clone(), &[&oc, &oc, &k, &k, &pos]).unwrap_err().to_string();
    assert!(e.contains("needs cache [B, S, H, D] and new [B, T, H, D]"), "{e}");
    let ys = g.apply(op, &[&kc, &vc, &k, &k, &pos]).unwrap();
    g.output(&ys[0], "k").unwrap();
    g.output(&ys[1], "v").unwrap();
    let mut t = g.finish().unwrap();
    verify(&t).unwrap();
    // The verifier: the value cache swapped for one of another shape, and in the text form.
    let text = t.to_string();
    let n = t.nodes.iter().position(|n| matches!(n.op, Op::CacheWriteKv { .. })).unwrap();
    t.nodes[n].args[1] = t.inputs.iter().find(|i| i.name == "oc").unwrap().value;
    let e = verify(&t).unwrap_err().to_string();
    assert!(e.contains("cache_write_kv") && e.contains("needs caches of one type"), "{e}");
    let bad = text.replace("cache_write_kv(%0, %1,", "cache_write_kv(%0, %2,");
    assert_ne!(bad, text, "{text}");
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("needs caches of one type"), "{e}");
}

#[test]
fn each_result_is_planned_over_its_own_cache() {
    let joined = passes::fold_cache_writes(&passes::fold_rope_at(&writes()).unwrap()).unwrap();
    let p = plan(&joined, &CompileOptions::default()).unwrap();
    rumble_core::plan::check::check(&p.trace, &p.plan).unwrap();
    assert!(p.plan.copy_back.is_empty(), "{:?}", p.plan.copy_back);
    let kvs: Vec<_> = p.trace.nodes.iter().filter(|n| matches!(n.op, Op::CacheWriteKv { .. })).collect();
    assert_eq!(kvs.len(), 2);
    // Layer 0 over its state inputs (their updates), layer 1 over the arena values it reads.
    for n in &kvs {
        for j in 0..2 {
            assert_eq!(p.plan.inplace_of[n.outs[j].index()], Some(n.args[j]), "result {j} of {:?}", n.op);
            assert_eq!(p.plan.slots[n.outs[j].index()], p.plan.slots[n.args[j].index()]);
        }
    }
    // Each result over the other's cache is refused by the checker.
    let mut swapped = p.plan.clone();
    let (o, a) = (&kvs[1].outs, &kvs[1].args);
    swapped.inplace_of[o[0].index()] = Some(a[1]);
    swapped.inplace_of[o[1].index()] = Some(a[0]);
    swapped.slots.swap(o[0].index(), o[1].index());
    let e = rumble_core::plan::check::check(&p.trace, &swapped).unwrap_err().to_string();
    assert!(e.contains("is marked in place over") && e.contains("not pointwise on it"), "{e}");
}
