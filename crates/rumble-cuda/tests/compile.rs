//! Every kernel source compiles with NVRTC for sm_90 (no GPU needed, only libnvrtc): the
//! fixed kernel files, the generated kernel of every elementwise op on every dtype, and every
//! flash-attention module.

mod common;

use rumble_core::ir::{BinaryOp, CmpOp, DType, Op, TensorType, UnaryOp};
use rumble_core::testing::TinyLlama;
use rumble_cuda::compile::{Options, compile_cubin, nvrtc_available, ptxas_report};
use rumble_cuda::fused::Fused;
use rumble_cuda::kernels::{KernelFile, PRELUDE};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

fn elementwise_cases() -> Vec<(Op, Vec<TensorType>)> {
    let t = |d: DType| TensorType::new(d, [3, 5]);
    let mut cases = Vec::new();
    for d in FLOATS {
        for u in UnaryOp::ALL {
            cases.push((Op::Unary(u), vec![t(d)]));
        }
        cases.push((Op::PowScalar { exponent: 1.5 }, vec![t(d)]));
        cases.push((Op::AddScalar { value: -0.25 }, vec![t(d)]));
        cases.push((Op::MulScalar { value: 3.0 }, vec![t(d)]));
        cases.push((Op::Swiglu, vec![t(d), t(d)]));
        cases.push((Op::SwigluBackward, vec![t(d), t(d), t(d)]));
        cases.push((Op::Where, vec![t(DType::Bool), t(d), t(d)]));
        cases.push((Op::Full { value: 0.5, ty: t(d) }, vec![]));
    }
    for d in DType::ALL {
        for b in BinaryOp::ALL {
            if d != DType::Bool {
                cases.push((Op::Binary(b), vec![t(d), t(d)]));
            }
        }
        for c in CmpOp::ALL {
            cases.push((Op::Compare(c), vec![t(d), t(d)]));
        }
        for to in DType::ALL {
            cases.push((Op::Cast { to }, vec![t(d)]));
        }
    }
    cases
}

#[test]
fn every_kernel_compiles_for_sm90() {
    if !nvrtc_available() {
        println!("skipped: no NVRTC");
        return;
    }
    for file in KernelFile::ALL {
        if let Err(e) = compile_cubin("sm_90", file.name(), &file.source(), Options { fmad: false }) {
            panic!("{e}");
        }
    }
    let cases = elementwise_cases();
    for (op, args) in &cases {
        let at: Vec<&TensorType> = args.iter().collect();
        let out = op.infer(&at).unwrap_or_else(|e| panic!("{}: {e}", op.name()));
        let ot: Vec<&TensorType> = out.iter().collect();
        let f = Fused::of_op(op, &at, &ot).expect("elementwise");
        let (src, name) = f.source(PRELUDE).expect("codegen");
        if let Err(e) = compile_cubin("sm_90", &name, &src, Options { fmad: false }) {
            panic!("{} on {:?}: {e}\n{src}", op.name(), args);
        }
    }
    println!("compiled 4 kernel files and {} elementwise kernels", cases.len());
    // The elementwise and fused kernels of the training steps the GPU tests and bench run
    // (so `scripts/gpu-build` can put them in the kernel cache).
    let mut n = 0;
    for dtype in [DType::F32, DType::BF16] {
        let cfg =
            TinyLlama { vocab: 96, dim: 64, heads: 4, kv_heads: 2, hidden: 96, layers: 2, batch: 2, seq: 24, dtype };
        let t = common::training_step(&cfg, Some(0.05));
        let f = rumble_core::passes::fuse(&t).expect("fuse");
        for trace in [&t, &f] {
            for node in &trace.nodes {
                let at: Vec<&TensorType> = node.args.iter().map(|a| trace.ty(*a)).collect();
                let ot: Vec<&TensorType> = node.outs.iter().map(|o| trace.ty(*o)).collect();
                let fz = match &node.op {
                    Op::Fused(body) => Some(Fused::of_body(body).expect("fused body")),
                    op => Fused::of_op(op, &at, &ot),
                };
                if let Some(fz) = fz {
                    let (src, name) = fz.source(PRELUDE).expect("codegen");
                    compile_cubin("sm_90", &name, &src, Options { fmad: false })
                        .unwrap_or_else(|e| panic!("{e}\n{src}"));
                    n += 1;
                }
            }
        }
    }
    println!("compiled the {n} elementwise/fused nodes of the test training steps");
}

/// Every flash-attention module (bf16/f16 tensor-core kernels per head size rounded to 16,
/// f32 FMA kernels per head size rounded to 32), with the options and source the recipes use.
#[test]
fn every_flash_attention_variant_compiles_for_sm90() {
    if !nvrtc_available() {
        println!("skipped: no NVRTC");
        return;
    }
    let all = rumble_cuda::flash::Variant::all();
    for v in &all {
        compile_cubin(&v.arch("sm_90"), &v.name(), &v.source(), rumble_cuda::flash::OPTIONS)
            .unwrap_or_else(|e| panic!("{}: {e}", v.name()));
    }
    println!("compiled {} flash-attention modules", all.len());
}

/// Registers, stack and spills of every kernel of every flash-attention module, from ptxas
/// (`cargo test -p rumble-cuda --test compile -- --ignored --nocapture`, with libnvrtc on the
/// library path: slow, every module compiled again).
#[test]
#[ignore = "a report, not a check: compiles every flash module again with ptxas -v"]
fn flash_kernel_resources() {
    if !nvrtc_available() {
        println!("skipped: no NVRTC");
        return;
    }
    for v in rumble_cuda::flash::Variant::all() {
        let log = ptxas_report(&v.arch("sm_90"), &v.name(), &v.source(), rumble_cuda::flash::OPTIONS)
            .unwrap_or_else(|e| panic!("{}: {e}", v.name()));
        // "Compiling entry function 'flash_fwd'", then "... bytes stack frame, N bytes spill
        // stores, M bytes spill loads", then "Used R registers".
        let (mut kernel, mut frame, mut parts) = ("?", String::new(), Vec::new());
        for line in log.lines() {
            if let Some(k) = line.split("entry function '").nth(1) {
                kernel = k.split('\'').next().unwrap_or("?");
            } else if line.contains("bytes stack frame") {
                frame = line.split(':').next_back().unwrap_or("").trim().to_string();
            } else if let Some(r) = line.split("Used ").nth(1) {
                let regs = r.split(' ').next().unwrap_or("?");
                parts.push(format!("{} {regs} regs ({frame})", kernel.trim_start_matches("flash_")));
            }
        }
        println!("{}: {}", v.name(), parts.join("; "));
    }
}
