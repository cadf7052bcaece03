//! The optimizers, run as traces on the CPU, against updates computed by hand in f64.

use rumble_core::cpu::{HostTensor, eval};
use rumble_core::ir::{InputRole, OutputRole};
use rumble_core::{DType, Graph, TensorType};
use rumble_models::Optimizer;

/// Runs `opt.update` for one parameter as a trace; returns the new parameter and states.
fn step(
    opt: &Optimizer,
    dims: &[usize],
    p: &[f64],
    g: &[f64],
    states: &[Vec<f64>],
    t: u64,
    lr: f64,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let gr = Graph::new("opt");
    let grad = gr.data("grad", DType::F32, dims).unwrap();
    let hyper = opt.declare_hyper(&gr).unwrap();
    let param = gr.param("w", DType::F32, dims).unwrap();
    let ty = TensorType::new(DType::F32, dims.to_vec());
    let specs = opt.state_specs("w", &ty);
    let st: Vec<_> = specs.iter().map(|(n, ty)| gr.input(n, ty.clone(), InputRole::OptState).unwrap()).collect();
    let (np, ns) = opt.update(&hyper, &param, &grad, None, &st).unwrap();
    gr.output_with_role(&np, "new.w", OutputRole::Update { of: param.id() }).unwrap();
    for ((n, _), (old, new)) in specs.iter().zip(st.iter().zip(&ns)) {
        gr.output_with_role(new, &format!("new.{n}"), OutputRole::Update { of: old.id() }).unwrap();
    }
    let trace = gr.finish().unwrap();
    let mut inputs = vec![HostTensor::from_f64(DType::F32, dims, g).unwrap()];
    inputs.extend(opt.hyper_values(t, lr));
    inputs.push(HostTensor::from_f64(DType::F32, dims, p).unwrap());
    inputs.extend(states.iter().map(|s| HostTensor::from_f64(DType::F32, dims, s).unwrap()));
    let outs = eval(&trace, &inputs).unwrap();
    (outs[0].to_f64(), outs[1..].iter().map(|o| o.to_f64()).collect())
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}[{i}]: got {x}, want {y}");
    }
}

const P: [f64; 6] = [0.5, -1.25, 2.0, 0.75, -0.3, 1.1];
const GRADS: [[f64; 6]; 3] =
    [[0.1, -0.2, 0.3, -0.05, 0.6, -1.5], [0.4, 0.1, -0.2, 0.25, -0.3, 0.9], [-0.3, 0.5, 0.05, -0.7, 0.2, 0.33]];

#[test]
fn adamw_first_step_by_hand() {
    // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps) = lr * sign(g), after
    // the decoupled decay p * (1 - lr * wd). With lr 0.1, wd 0.1: p -> 0.99 p - 0.1 sign(g).
    let opt = Optimizer::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let (p, s) = step(&opt, &[2, 3], &P, &GRADS[0], &[vec![0.0; 6], vec![0.0; 6]], 1, 0.1);
    let want: Vec<f64> = P.iter().zip(&GRADS[0]).map(|(p, g)| 0.99 * p - 0.1 * g.signum()).collect();
    close(&p, &want, 1e-6, "p");
    close(&s[0], &GRADS[0].map(|g| 0.1 * g), 1e-6, "exp_avg");
    close(&s[1], &GRADS[0].map(|g| 0.001 * g * g), 1e-6, "exp_avg_sq");
}

#[test]
fn adamw_matches_a_reference_over_three_steps() {
    let (b1, b2, eps, wd, lr) = (0.9, 0.95, 1e-8, 0.1, 0.01);
    let opt = Optimizer::AdamW { beta1: b1, beta2: b2, eps, weight_decay: wd };
    for dims in [vec![2, 3], vec![6]] {
        // Matrices decay; vectors (norms, biases) do not.
        let decay = if dims.len() >= 2 { wd } else { 0.0 };
        let (mut p, mut m, mut v) = (P.to_vec(), vec![0.0; 6], vec![0.0; 6]);
        let (mut rp, mut rm, mut rv) = (P.to_vec(), vec![0.0; 6], vec![0.0; 6]);
        for (t, g) in GRADS.iter().enumerate() {
            let t = t as u64 + 1;
            let (np, ns) = step(&opt, &dims, &p, g, &[m.clone(), v.clone()], t, lr);
            (p, m, v) = (np, ns[0].clone(), ns[1].clone());
            for i in 0..6 {
                rm[i] = b1 * rm[i] + (1.0 - b1) * g[i];
                rv[i] = b2 * rv[i] + (1.0 - b2) * g[i] * g[i];
                let m_hat = rm[i] / (1.0 - b1.powi(t as i32));
                let v_hat = rv[i] / (1.0 - b2.powi(t as i32));
                rp[i] = rp[i] * (1.0 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps);
            }
            close(&p, &rp, 1e-6, &format!("p{dims:?} step {t}"));
            close(&m, &rm, 1e-6, "exp_avg");
            close(&v, &rv, 1e-6, "exp_avg_sq");
        }
    }
}

#[test]
fn sgd_with_momentum_matches_by_hand() {
    let opt = Optimizer::Sgd { momentum: 0.9, weight_decay: 0.0 };
    let (p1, s1) = step(&opt, &[6], &P, &GRADS[0], &[vec![0.0; 6]], 1, 0.1);
    // Step 1: buf = g, p -= lr g.
    close(&s1[0], &GRADS[0], 1e-7, "buf1");
    close(&p1, &std::array::from_fn::<f64, 6, _>(|i| P[i] - 0.1 * GRADS[0][i]), 1e-7, "p1");
    // Step 2: buf = 0.9 g1 + g2, p -= lr buf.
    let (p2, s2) = step(&opt, &[6], &p1, &GRADS[1], &s1, 2, 0.1);
    let buf2: Vec<f64> = (0..6).map(|i| 0.9 * GRADS[0][i] + GRADS[1][i]).collect();
    close(&s2[0], &buf2, 1e-6, "buf2");
    close(&p2, &(0..6).map(|i| p1[i] - 0.1 * buf2[i]).collect::<Vec<_>>(), 1e-6, "p2");
    // L2 weight decay on a matrix: g + wd p; no momentum state when momentum is 0.
    let plain = Optimizer::Sgd { momentum: 0.0, weight_decay: 0.5 };
    let (p, s) = step(&plain, &[2, 3], &P, &GRADS[2], &[], 1, 0.2);
    assert!(s.is_empty());
    close(&p, &(0..6).map(|i| P[i] - 0.2 * (GRADS[2][i] + 0.5 * P[i])).collect::<Vec<_>>(), 1e-6, "p");
}

#[test]
fn bf16_parameters_update_in_f32_and_round_once() {
    let opt = Optimizer::Sgd { momentum: 0.0, weight_decay: 0.0 };
    let gr = Graph::new("bf16");
    let grad = gr.data("grad", DType::BF16, &[3]).unwrap();
    let hyper = opt.declare_hyper(&gr).unwrap();
    let param = gr.param("w", DType::BF16, &[3]).unwrap();
    let (np, _) = opt.update(&hyper, &param, &grad, None, &[]).unwrap();
    assert_eq!(np.dtype(), DType::BF16);
    gr.output_with_role(&np, "new.w", OutputRole::Update { of: param.id() }).unwrap();
    let trace = gr.finish().unwrap();
    let inputs = vec![
        HostTensor::from_f64(DType::BF16, &[3], &[1.0, -2.0, 0.5]).unwrap(),
        HostTensor::scalar(DType::F32, 0.25),
        HostTensor::from_f64(DType::BF16, &[3], &[1.0, 1.0, 1.0]).unwrap(),
    ];
    let out = eval(&trace, &inputs).unwrap();
    assert_eq!(out[0].to_f64(), vec![0.75, 1.5, 0.875]);
}

#[test]
fn clipping_coefficient_is_pytorchs() {
    let gr = Graph::new("clip");
    let a = gr.data("a", DType::F32, &[2]).unwrap();
    let b = gr.data("b", DType::BF16, &[1]).unwrap();
    let norm = rumble_models::optim::global_norm(&[a, b]).unwrap();
    let coef = rumble_models::optim::clip_coefficient(&norm, 1.0).unwrap();
    let loose = rumble_models::optim::clip_coefficient(&norm, 100.0).unwrap();
    gr.output(&norm, "norm").unwrap();
    gr.output(&coef, "coef").unwrap();
    gr.output(&loose, "loose").unwrap();
    let trace = gr.finish().unwrap();
    let inputs = vec![
        HostTensor::from_f64(DType::F32, &[2], &[3.0, 0.0]).unwrap(),
        HostTensor::from_f64(DType::BF16, &[1], &[4.0]).unwrap(),
    ];
    let out = eval(&trace, &inputs).unwrap();
    assert_eq!(out[0].item(), 5.0);
    assert!((out[1].item() - 1.0 / (5.0 + 1e-6)).abs() < 1e-7);
    assert_eq!(out[2].item(), 1.0);
}
