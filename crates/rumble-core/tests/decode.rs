//! The decoding ops on the CPU reference, checked against the training ops they specialise:
//! `rope_at` at positions `p + t` is `rope` of a longer sequence sliced; a prefix written with
//! `cache_write` and read by `attention_cached` one query at a time is causal `attention`; the
//! sampler is the argmax at temperature 0 and draws by the softmax otherwise. Also the text form,
//! the type rules, the missing VJP, and the `state` role planned in place.

use rumble_core::autodiff::backward;
use rumble_core::compile::{CompileOptions, plan};
use rumble_core::cpu::{HostTensor, Rng, decode, eval};
use rumble_core::ir::{DType, Graph, HeadLayout, InputRole, OutputRole, RopeScaling, Tensor, TensorType, parse};

fn randn(dims: &[usize], rng: &mut Rng) -> HostTensor {
    HostTensor::randn(TensorType::new(DType::F32, dims.to_vec()), 1.0, rng)
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-5, "{what}: max error {worst}");
}

#[test]
fn rope_at_is_rope_of_a_longer_sequence() {
    // Each sequence at its own offset, in both layouts, plain and with each frequency scaling:
    // llama3's wavelengths (2pi * theta^(2j/D): 6.3, 63, 628, 6283 at D = 8) straddle its
    // bounds (16 and 64 here), so one frequency is kept, one blended and two divided.
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64.0,
    };
    let mut rng = Rng::new(1);
    let (b, t, h, d, offs) = (2, 3, 2, 8, [5usize, 2]);
    let len = offs[0].max(offs[1]) + t;
    for layout in HeadLayout::ALL {
        let (seq, dims) = match layout {
            HeadLayout::Bthd => (1, [b, len, h, d]),
            HeadLayout::Bhtd => (2, [b, h, len, d]),
        };
        let x = randn(&dims, &mut rng);
        let mut plain = None;
        for scaling in [RopeScaling::None, RopeScaling::Linear { factor: 4.0 }, llama3] {
            let g = Graph::new("rope");
            let xi = g.data("x", DType::F32, &dims).unwrap();
            let pos = g.data("pos", DType::I64, &[b]).unwrap();
            g.output(&xi.rope_scaled(layout, 1e4, scaling).unwrap(), "full").unwrap();
            for (i, &off) in offs.iter().enumerate() {
                // Sequence i's rows off..off + T, at positions pos[i] = off.
                let xs = xi.slice(0, i, i + 1).unwrap().slice(seq, off, off + t).unwrap();
                let at = xs.rope_at_scaled(&pos.slice(0, i, i + 1).unwrap(), layout, 1e4, scaling).unwrap();
                g.output(&at, &format!("at{i}")).unwrap();
            }
            let p = HostTensor::from_i64(DType::I64, &[b], &offs.map(|o| o as i64)).unwrap();
            let outs = eval(&g.finish().unwrap(), &[x.clone(), p]).unwrap();
            let full = outs[0].to_f32();
            for (i, &off) in offs.iter().enumerate() {
                // Row (i, r) of the full rope, r in off..off + T, in the layout's order.
                let mut want = Vec::new();
                for a in 0..dims[1] {
                    for c in 0..dims[2] {
                        let r = if seq == 1 { a } else { c };
                        if (off..off + t).contains(&r) {
                            let at = ((i * dims[1] + a) * dims[2] + c) * d;
                            want.extend_from_slice(&full[at..at + d]);
                        }
                    }
                }
                let what = format!("{layout:?} {scaling:?} sequence {i}");
                assert_eq!(outs[1 + i].to_f32(), want, "{what}: same angles, same bits");
            }
            // The scaling changes the result (so a rope_at ignoring it would fail above).
            match &plain {
                None => plain = Some(full),
                Some(p) => assert!(p.iter().zip(&full).any(|(a, b)| (a - b).abs() > 1e-3), "{scaling:?}"),
            }
        }
    }
}

#[test]
fn cached_attention_one_token_at_a_time_is_causal_attention() {
    let mut rng = Rng::new(2);
    let (b, t, hq, hkv, d, s) = (2, 6, 4, 2, 8, 10);
    let (q, k, v) =
        (randn(&[b, t, hq, d], &mut rng), randn(&[b, t, hkv, d], &mut rng), randn(&[b, t, hkv, d], &mut rng));
    // Reference: causal attention over the T rows.
    let g = Graph::new("causal");
    let qi = g.data("q", DType::F32, &[b, t, hq, d]).unwrap();
    let ki = g.data("k", DType::F32, &[b, t, hkv, d]).unwrap();
    let vi = g.data("v", DType::F32, &[b, t, hkv, d]).unwrap();
    let (o, _) = Tensor::attention_in(HeadLayout::Bthd, &qi, &ki, &vi, 0.3, true).unwrap();
    g.output(&o, "o").unwrap();
    let want = eval(&g.finish().unwrap(), &[q.clone(), k.clone(), v.clone()]).unwrap().remove(0).to_f32();
    // Decode: row i of each sequence written at position i, then attended over the prefix.
    let g = Graph::new("decode");
    let kc = g.data("kc", DType::F32, &[b, s, hkv, d]).unwrap();
    let vc = g.data("vc", DType::F32, &[b, s, hkv, d]).unwrap();
    let (qi, ki, vi) = (
        g.data("q", DType::F32, &[b, 1, hq, d]).unwrap(),
        g.data("k", DType::F32, &[b, 1, hkv, d]).unwrap(),
        g.data("v", DType::F32, &[b, 1, hkv, d]).unwrap(),
    );
    let pos = g.data("pos", DType::I64, &[b]).unwrap();
    let (kn, vn) = (kc.cache_write(&ki, &pos).unwrap(), vc.cache_write(&vi, &pos).unwrap());
    let o = Tensor::attention_cached(&qi, &kn, &vn, &pos, 0.3).unwrap();
    for (x, n) in [(&o, "o"), (&kn, "k"), (&vn, "v")] {
        g.output(x, n).unwrap();
    }
    let step = g.finish().unwrap();
    let row = |x: &HostTensor, i: usize, h: usize| -> HostTensor {
        let w = h * d;
        let vals: Vec<f32> =
            (0..b).flat_map(|bb| x.to_f32()[(bb * t + i) * w..(bb * t + i + 1) * w].to_vec()).collect();
        HostTensor::from_f32(&[b, 1, h, d], &vals).unwrap()
    };
    let mut caches = (randn(&[b, s, hkv, d], &mut rng), randn(&[b, s, hkv, d], &mut rng)); // junk beyond the prefix
    let mut got = vec![0f32; want.len()];
    for i in 0..t {
        let pos = HostTensor::from_i64(DType::I64, &[b], &[i as i64; 2]).unwrap();
        let outs =
            eval(&step, &[caches.0.clone(), caches.1.clone(), row(&q, i, hq), row(&k, i, hkv), row(&v, i, hkv), pos])
                .unwrap();
        let o = outs[0].to_f32();
        for bb in 0..b {
            let w = hq * d;
            got[(bb * t + i) * w..(bb * t + i + 1) * w].copy_from_slice(&o[bb * w..(bb + 1) * w]);
        }
        caches = (outs[1].clone(), outs[2].clone());
    }
    close(&got, &want, "decode vs causal attention");
    // Out of range is an error naming the op.
    let e = eval(
        &step,
        &[
            caches.0.clone(),
            caches.1,
            row(&q, 0, hq),
            row(&k, 0, hkv),
            row(&v, 0, hkv),
            HostTensor::from_i64(DType::I64, &[b], &[0, s as i64]).unwrap(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cache_write") && e.contains("do not fit a cache of 10 positions"), "{e}");
}

#[test]
fn sampling_follows_the_softmax_and_greedy_is_the_argmax() {
    let logits: Vec<f32> = vec![0.0, 1.0, 2.0, 2.0, -1.0];
    assert_eq!(decode::sample(5, &logits, &[0, 0], 0.0, 0, 1.0), [2], "greedy: the lowest of equal maxima");
    // Frequencies over many steps at temperature 1 follow softmax(logits).
    let n = 20000;
    let mut counts = [0usize; 5];
    for step in 0..n {
        counts[decode::sample(5, &logits, &[42, step], 1.0, 0, 1.0)[0] as usize] += 1;
    }
    let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
    for (i, &c) in counts.iter().enumerate() {
        let p = (logits[i] as f64).exp() / z;
        let f = c as f64 / n as f64;
        assert!((f - p).abs() < 4.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-3, "token {i}: {f} vs {p}");
    }
    // Top-k 2 keeps both 2.0s (ties kept); top-p 0.5 keeps the top pair too (the mass above each is 0).
    for (k, p) in [(2, 1.0), (0, 0.5)] {
        let drawn: Vec<i64> = (0..200).map(|s| decode::sample(5, &logits, &[1, s], 1.0, k, p)[0]).collect();
        assert!(drawn.iter().all(|&t| t == 2 || t == 3) && drawn.contains(&2) && drawn.contains(&3), "k {k} p {p}");
    }
    assert_ne!(decode::uniform(1, 2, 3), decode::uniform(1, 2, 4));
    assert!((0..1000).map(|i| decode::uniform(9, i, 0)).all(|u| (0.0..1.0).contains(&u)));
}

#[test]
fn text_form_types_and_vjp() {
    let g = Graph::new("step");
    let cache = g.input("cache", TensorType::new(DType::F32, [2, 8, 1, 4]), InputRole::State).unwrap();
    let x = g.data("x", DType::F32, &[2, 1, 1, 4]).unwrap();
    let pos = g.data("pos", DType::I64, &[2]).unwrap();
    let key = g.data("key", DType::I64, &[2]).unwrap();
    let llama3 = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let xr = x.rope_at_scaled(&pos, HeadLayout::Bthd, 500000.0, llama3).unwrap();
    let c = cache.cache_write(&xr, &pos).unwrap();
    let o = Tensor::attention_cached(&xr, &c, &c, &pos, 0.5).unwrap();
    let next = o.reshape(&[2, 4]).unwrap().sample(&key, 0.7, 40, 0.95).unwrap();
    g.output_with_role(&c, "cache.new", OutputRole::Update { of: cache.id() }).unwrap();
    g.output(&next, "next").unwrap();
    let t = g.finish().unwrap();
    let text = t.to_string();
    for s in [
        "rope_at(%1, %2) theta=500000.0 layout=bthd scaling=llama3:32.0:1.0:4.0:8192.0",
        "cache_write(%0, %4, %2)",
        "attention_cached(",
        "sample(",
        "temperature=0.7 top_k=40 top_p=0.95",
        "\"cache\" state",
    ] {
        assert!(text.contains(s), "{s} in\n{text}");
    }
    assert_eq!(parse(&text).unwrap(), t, "round trip");
    // Linear scaling reads back too; unscaled prints no attribute; a bad one is named.
    let lin = text.replace("scaling=llama3:32.0:1.0:4.0:8192.0", "scaling=linear:2.0");
    assert_eq!(parse(&lin).unwrap().to_string(), lin);
    let plain = text.replace(" scaling=llama3:32.0:1.0:4.0:8192.0", "");
    assert_eq!(parse(&plain).unwrap().to_string(), plain);
    let e = parse(&text.replace("scaling=llama3:32.0:1.0:4.0:8192.0", "scaling=yarn:2.0")).unwrap_err().to_string();
    assert!(e.contains("bad value `yarn:2.0` for attribute `scaling`"), "{e}");
    // The cache is written in place: no copy back after the step.
    let p = plan(&t, &CompileOptions::default()).unwrap();
    assert!(p.plan.copy_back.is_empty(), "{:?}", p.plan.copy_back);
    // Type rules name what they expect.
    let e = cache.cache_write(&x.reshape(&[2, 1, 2, 2]).unwrap(), &pos).unwrap_err().to_string();
    assert!(e.contains("cache_write") && e.contains("needs cache [B, S, H, D] and new [B, T, H, D]"), "{e}");
    let e = o.reshape(&[2, 4]).unwrap().sample(&key.reshape(&[1, 2]).unwrap(), 1.0, 0, 1.0).unwrap_err().to_string();
    assert!(e.contains("key must be [2] (seed, step)"), "{e}");
    let e = o.reshape(&[2, 4]).unwrap().sample(&key, 1.0, 0, 0.0).unwrap_err().to_string();
    assert!(e.contains("top_p must be in (0, 1]"), "{e}");
    let e = x.rope_at(&key.reshape(&[1, 2]).unwrap(), HeadLayout::Bthd, 1e4).unwrap_err().to_string();
    assert!(e.contains("positions must be [B] = [2]"), "{e}");
    // No VJP: a clear error naming the op.
    let loss = xr.sum_all().unwrap();
    let e = backward(&loss, &[&x]).expect_err("no VJP").to_string();
    assert!(e.contains("rope_at") && e.contains("inference only"), "{e}");
}
