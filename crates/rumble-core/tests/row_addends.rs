//! A matmul's row addend (`acc=row`, `Addend::Row`: a bias added to every row) and the fold
//! that makes it (`passes::fold_row_addends`), on the CPU reference: a Qwen2-style decode step
//! (a norm read by the q, k and v projections, each with a bias, and a residual projection)
//! goes through the compile pipeline with no broadcast left, its biases read as rows by the
//! joined projection, and computes the unfolded step's values; the fold alone computes the bits
//! of the broadcast addend it replaces, and leaves broadcasts that are no row or are read twice;
//! the text form reads `acc=row` back; the type rule (the verifier's) refuses a row of another
//! length or dtype; a row addend is never computed over and has no VJP.

use rumble_core::autodiff;
use rumble_core::compile::PIPELINE;
use rumble_core::cpu::{self, HostTensor, Rng};
use rumble_core::ir::{Addend, DType, Graph, Op, Trace, parse, verify};
use rumble_core::passes;

/// Random inputs of `t`, none of them zero (a bias of zeros would hide a missing add).
fn inputs(t: &Trace, rng: &mut Rng) -> Vec<HostTensor> {
    t.inputs.iter().map(|i| HostTensor::randn(t.ty(i.value).clone(), 1.0, rng)).collect()
}

/// The projections of a Qwen2 attention block in a decode step of `rows` rows, as
/// `rumble_models::model::linear` writes them: `h = rms_norm(x)`, then `h w^T +
/// broadcast(bias)` for q (width 24), k and v (width 8), and the residual `x + h w_o^T`.
fn qwen_decode(dtype: DType, rows: usize) -> Trace {
    let c = 16;
    let g = Graph::new("qwen_decode");
    let x = g.data("x", dtype, &[rows, c]).unwrap(); // (B*T, C), the residual stream
    let norm = g.param("input_layernorm.weight", dtype, &[c]).unwrap();
    let h = x.rms_norm(&norm, 1e-6).unwrap(); // (B*T, C)
    for (name, n) in [("q", 24), ("k", 8), ("v", 8)] {
        let w = g.param(&format!("{name}_proj.weight"), dtype, &[n, c]).unwrap();
        let b = g.param(&format!("{name}_proj.bias"), dtype, &[n]).unwrap();
        let y = h.matmul_t(&w).unwrap(); // (B*T, n)
        g.output(&y.add(&b.broadcast_to(y.dims()).unwrap()).unwrap(), name).unwrap();
    }
    let wo = g.param("o_proj.weight", dtype, &[c, c]).unwrap();
    g.output(&x.add(&h.matmul_t(&wo).unwrap()).unwrap(), "residual").unwrap();
    g.finish().unwrap()
}

/// How many projections add a row: a `matmul` with `acc=row` is one, a `matmul_pre` its `outs`.
fn row_projections(t: &Trace) -> usize {
    t.nodes
        .iter()
        .map(|n| match n.op {
            Op::Matmul { acc: Addend::Row, .. } => 1,
            Op::MatmulPre { acc: Addend::Row, outs, .. } => outs,
            _ => 0,
        })
        .sum()
}

fn count(t: &Trace, name: &str) -> usize {
    t.nodes.iter().filter(|n| n.op.name() == name).count()
}

/// Through the pipeline, the three biases are the joined projection's rows (one node, no
/// broadcast), the residual stays an addend of its type, and the values are the unfolded
/// step's: bit for bit in f32 (both round the products, then the sum), within bf16's rounding
/// in bf16 (the folded sum is rounded once, not twice).
#[test]
fn a_decode_steps_biases_become_row_addends_of_its_projections() {
    let rng = &mut Rng::new(5);
    for (dtype, rows) in [(DType::F32, 1), (DType::F32, 3), (DType::BF16, 2)] {
        let t = qwen_decode(dtype, rows);
        let (p, logs) = passes::run(&t, PIPELINE).unwrap();
        let text = p.to_string();
        assert!(logs.iter().any(|l| l.pass == "fold_row_addends" && l.nodes_after + 3 == l.nodes_before), "{logs:?}");
        assert_eq!(count(&p, "broadcast"), 0, "{text}");
        assert_eq!(row_projections(&p), 3, "{text}");
        let joined = p.nodes.iter().filter(|n| matches!(n.op, Op::MatmulPre { acc: Addend::Row, outs: 3, .. }));
        assert_eq!(joined.count(), 1, "q, k and v in one node: {text}");
        assert!(p.nodes.iter().any(|n| matches!(n.op, Op::MatmulPre { acc: Addend::Full, outs: 1, .. })), "{text}");
        assert!(text.contains("acc=row"), "{text}");
        assert_eq!(parse(&text).unwrap(), p);
        let ins = inputs(&t, rng);
        let (want, got) = (cpu::eval(&t, &ins).unwrap(), cpu::eval(&p, &ins).unwrap());
        if dtype == DType::F32 {
            assert_eq!(got, want, "{dtype} rows {rows}");
            continue;
        }
        for (g, w) in got.iter().zip(&want) {
            let (g, w) = (g.to_f64(), w.to_f64());
            let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 2.0 * scale / 128.0), "{g:?} vs {w:?}");
        }
    }
}

/// `fold_row_addends` alone, after `fold_addends`: a broadcast `[N]` or `[1, N]` bias becomes
/// the matmul's row and the broadcast goes, the same bits (bf16); a broadcast read by two
/// matmuls, a column broadcast over the columns and a broadcast over a batch dim only stay.
#[test]
fn broadcast_rows_fold_and_other_broadcasts_stay() {
    let g = Graph::new("rows");
    let d = DType::BF16;
    let x = g.param("x", d, &[5, 7]).unwrap();
    let w = g.param("w", d, &[6, 7]).unwrap();
    let bias = g.param("bias", d, &[6]).unwrap();
    let bias2 = g.param("bias2", d, &[1, 6]).unwrap();
    let col = g.param("col", d, &[5, 1]).unwrap();
    let xb = g.param("xb", d, &[3, 5, 7]).unwrap();
    let wb = g.param("wb", d, &[3, 6, 7]).unwrap();
    let plane = g.param("plane", d, &[5, 6]).unwrap();
    let mm = || x.matmul_t(&w).unwrap(); // (5, 6)
    let row = mm().add(&bias.broadcast_to(&[5, 6]).unwrap()).unwrap(); // folds
    let row2 = mm().add(&bias2.broadcast_to(&[5, 6]).unwrap()).unwrap(); // folds ([1, N])
    let shared = bias.mul_scalar(2.0).unwrap().broadcast_to(&[5, 6]).unwrap();
    let twice = mm().add(&shared).unwrap().add(&mm().add(&shared).unwrap()).unwrap(); // stays
    let column = mm().add(&col.broadcast_to(&[5, 6]).unwrap()).unwrap(); // stays
    let batch = xb.matmul_t(&wb).unwrap().add(&plane.broadcast_to(&[3, 5, 6]).unwrap()).unwrap(); // stays
    for (v, name) in [(&row, "row"), (&row2, "row2"), (&twice, "twice"), (&column, "column"), (&batch, "batch")] {
        g.output(v, name).unwrap();
    }
    let t = passes::fold_addends(&g.finish().unwrap()).unwrap();
    let f = passes::fold_row_addends(&t).unwrap();
    verify(&f).unwrap();
    let text = f.to_string();
    assert_eq!(row_projections(&f), 2, "{text}");
    assert_eq!(count(&t, "broadcast") - count(&f, "broadcast"), 2, "{text}");
    assert_eq!(parse(&text).unwrap(), f);
    let ins = inputs(&t, &mut Rng::new(8));
    assert_eq!(cpu::eval(&f, &ins).unwrap(), cpu::eval(&t, &ins).unwrap(), "the same bits");
    // Nothing left to fold: the pass is the identity.
    assert_eq!(passes::fold_row_addends(&f).unwrap(), f);
}

/// The row's type rule, through the text form (the verifier applies it): a row of another
/// length or dtype, an `[M, N]` addend where a row is named, and an unknown `acc` are refused,
/// naming the op; a row addend is never computed over and has no VJP.
#[test]
fn row_addends_are_typed_kept_apart_and_not_differentiated() {
    let g = Graph::new("bias");
    let x = g.param("x", DType::F32, &[3, 8]).unwrap();
    let w = g.param("w", DType::F32, &[5, 8]).unwrap();
    let b = g.param("b", DType::F32, &[5]).unwrap();
    let y = g.apply(Op::Matmul { ta: false, tb: true, out: None, acc: Addend::Row }, &[&x, &w, &b]).unwrap().remove(0);
    g.output(&y.sum_all().unwrap(), "loss").unwrap();
    let t = g.finish().unwrap();
    let text = t.to_string();
    assert!(text.contains("acc=row"), "{text}");
    assert_eq!(parse(&text).unwrap(), t);
    let parse_err = |s: &str| parse(s).map(|_| ()).unwrap_err().to_string();
    let e = parse_err(&text.replace("f32[5]", "f32[4]"));
    assert!(e.contains("matmul") && e.contains("row addend f32[4] must be f32[5]"), "{e}");
    let e = parse_err(&text.replace("f32[5]", "f64[5]"));
    assert!(e.contains("matmul") && e.contains("row addend f64[5] must be f32[5]"), "{e}");
    let e = parse_err(&text.replace("f32[5]", "f32[3,5]"));
    assert!(e.contains("row addend f32[3,5]"), "{e}");
    let e = parse_err(&text.replace("acc=row", "acc=rows"));
    assert!(e.contains("bad value `rows` for attribute `acc`"), "{e}");
    // Evaluated: x w^T + b in every row.
    let ins = inputs(&t, &mut Rng::new(2));
    let (xs, ws, bs) = (ins[0].to_f64(), ins[1].to_f64(), ins[2].to_f64());
    let want: f64 =
        (0..15).map(|e| bs[e % 5] + (0..8).map(|k| xs[(e / 5) * 8 + k] * ws[(e % 5) * 8 + k]).sum::<f64>()).sum();
    let got = cpu::eval(&t, &ins).unwrap()[0].to_f64()[0];
    assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "{got} vs {want}");
    let mm = |acc| Op::Matmul { ta: false, tb: true, out: None, acc };
    assert!(!mm(Addend::Row).may_overwrite(0, 2) && mm(Addend::Full).may_overwrite(0, 2));
    assert_eq!(mm(Addend::Row).arity(), Some(3));
    let e = autodiff::grad(&t, "loss", &["w"]).unwrap_err().to_string();
    assert!(e.contains("no VJP"), "{e}");
}
