//! Elementwise code generation: an expression DAG over same-index elements of its inputs,
//! turned into one CUDA kernel. Every elementwise op of the IR is a one-node expression; a
//! chain of them (the coming `Op::Fused`) is one expression, so the chain becomes one kernel.
//!
//! Each node computes in its dtype's arithmetic type (f32 for f32/bf16/f16, f64 for f64, i64 for
//! integers, int for bool) and rounds to its dtype, so a fused chain gives bit for bit what its
//! ops give one by one (kernels compile with `--fmad=false` for the same reason).

use rumble_core::ir::{BinaryOp, CmpOp, DType, FusedBody, Op, TensorType, UnaryOp};

use crate::compile::fnv1a;
use crate::error::{CudaError, Result};

/// Elements a thread moves per run in the vector path (`EW_VEC` in kernels/prelude.cuh).
pub const RUN: usize = 8;

/// What a node computes from its `args` (earlier node indices).
#[derive(Clone, Debug, PartialEq)]
pub enum EOp {
    /// Kernel input `i`.
    Input(usize),
    Const(f64),
    Unary(UnaryOp),
    Pow(f64),
    AddScalar(f64),
    MulScalar(f64),
    Binary(BinaryOp),
    Compare(CmpOp),
    Where,
    /// Convert the operand to this node's dtype.
    Cast,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ENode {
    pub op: EOp,
    pub args: Vec<usize>,
    pub dtype: DType,
}

/// How a kernel input is indexed by the output's flat index `i`.
#[derive(Clone, Debug, PartialEq)]
pub enum Indexing {
    /// Same shape as the output: element `i`.
    Same,
    /// One element, broadcast.
    Scalar,
    /// Broadcast along some axes: a `Strides` struct (prelude.cuh), as 8-byte words, passed
    /// as a kernel parameter (so kernels do not depend on shapes).
    Strided(Vec<u64>),
}

/// An elementwise program: inputs (with their dtypes and indexing), nodes in dependency
/// order, and the nodes stored as outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Fused {
    pub inputs: Vec<DType>,
    pub scalar_inputs: Vec<Indexing>,
    pub nodes: Vec<ENode>,
    pub outputs: Vec<usize>,
}

/// The expression node of a one-node elementwise op (`None` for other ops, swiglu included).
fn eop_of(op: &Op) -> Option<EOp> {
    Some(match op {
        Op::Full { value, .. } => EOp::Const(*value),
        Op::Unary(u) => EOp::Unary(*u),
        Op::PowScalar { exponent } => EOp::Pow(*exponent),
        Op::AddScalar { value } => EOp::AddScalar(*value),
        Op::MulScalar { value } => EOp::MulScalar(*value),
        Op::Cast { .. } => EOp::Cast,
        Op::Binary(b) => EOp::Binary(*b),
        Op::Compare(c) => EOp::Compare(*c),
        Op::Where => EOp::Where,
        _ => return None,
    })
}

/// One `Input` node per operand dtype.
fn input_nodes(inputs: &[DType]) -> Vec<ENode> {
    inputs.iter().enumerate().map(|(i, &d)| ENode { op: EOp::Input(i), args: vec![], dtype: d }).collect()
}

impl Fused {
    /// The one-node expression of an elementwise IR op (`None` for other ops).
    pub fn of_op(op: &Op, args: &[&TensorType], outs: &[&TensorType]) -> Option<Fused> {
        let inputs: Vec<DType> = args.iter().map(|t| t.dtype).collect();
        let n = outs.first()?.numel();
        let scalar_inputs =
            args.iter().map(|t| if t.numel() == 1 && n != 1 { Indexing::Scalar } else { Indexing::Same }).collect();
        let mut nodes = input_nodes(&inputs);
        let all: Vec<usize> = (0..inputs.len()).collect();
        let out = outs[0].dtype;
        let eop = match op {
            Op::Swiglu => return Some(swiglu(inputs, scalar_inputs, false)),
            Op::SwigluBackward => return Some(swiglu(inputs, scalar_inputs, true)),
            _ => eop_of(op)?,
        };
        nodes.push(ENode { op: eop, args: all, dtype: out });
        let o = nodes.len() - 1;
        Some(Fused { inputs, scalar_inputs, nodes, outputs: vec![o] })
    }

    /// The expression of a fused body made by the core's fusion pass (operands smaller than
    /// the fused shape are broadcast; `full` instructions are scalar constants).
    pub fn of_body(body: &FusedBody) -> Result<Fused> {
        let out = body.shape.dims();
        let mut scalar_inputs = Vec::new();
        for t in &body.inputs {
            scalar_inputs.push(if t.shape == body.shape {
                Indexing::Same
            } else if t.numel() == 1 {
                Indexing::Scalar
            } else {
                if out.len() > 8 || t.rank() > out.len() {
                    return Err(CudaError::Unsupported(format!(
                        "fused operand {} broadcast to {}",
                        t.shape, body.shape
                    )));
                }
                let off = out.len() - t.rank();
                let st = t.shape.strides();
                let mut w = vec![0u64; 25];
                for (k, &d) in out.iter().enumerate() {
                    w[k] = d as u64;
                    w[8 + k] = if k < off || t.dims()[k - off] == 1 { 0 } else { st[k - off] as u64 };
                }
                w[24] = out.len() as u64;
                Indexing::Strided(w)
            });
        }
        let inputs: Vec<DType> = body.inputs.iter().map(|t| t.dtype).collect();
        let mut nodes = input_nodes(&inputs);
        for ins in &body.body {
            let op = eop_of(&ins.op)
                .ok_or_else(|| CudaError::Unsupported(format!("{} inside a fused body", ins.op.name())))?;
            nodes.push(ENode { op, args: ins.args.clone(), dtype: ins.dtype });
        }
        Ok(Fused { inputs, scalar_inputs, nodes, outputs: body.outputs.clone() })
    }

    /// The scalar constants of the expression, in the order the kernel takes them (they are
    /// kernel parameters, so expressions that differ only in constants share a kernel).
    pub fn consts(&self) -> Vec<f64> {
        self.nodes
            .iter()
            .filter_map(|n| match n.op {
                EOp::Const(v) | EOp::Pow(v) | EOp::AddScalar(v) | EOp::MulScalar(v) => Some(v),
                _ => None,
            })
            .collect()
    }

    /// The CUDA source of this expression's kernel and the kernel's name. The kernel takes the
    /// inputs, the outputs, the constants (`double`s), `n`, the status word and the node tag.
    pub fn source(&self, prelude: &str) -> Result<(String, String)> {
        let mut body = String::new();
        let mut k = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            let e = self.node_expr(n, &mut k)?;
            body.push_str(&format!("    {} v{i} = {e};\n", value_type(n.dtype)));
        }
        let mut params: Vec<String> = self
            .inputs
            .iter()
            .enumerate()
            // No __restrict__: the planner may compute a result in place over an operand.
            .map(|(i, d)| format!("const {}* in{i}", storage_type(*d)))
            .collect();
        let mut stores = String::new();
        for (k, &o) in self.outputs.iter().enumerate() {
            params.push(format!("{}* out{k}", storage_type(self.nodes[o].dtype)));
            stores.push_str(&format!("    st(&out{k}[i], v{o});\n"));
        }
        for (i, ix) in self.scalar_inputs.iter().enumerate() {
            if let Indexing::Strided(_) = ix {
                params.push(format!("Strides b{i}"));
            }
        }
        params.extend((0..k).map(|c| format!("double c{c}")));
        // Inputs indexed like the output are read as runs of EW_VEC elements (16-byte accesses)
        // when every such pointer is 16-byte aligned; the rest of `n` (and every element of a
        // misaligned call) goes through the scalar loop. A thread loads its whole run before it
        // stores, so a result computed in place over an operand stays correct.
        let same = |i: usize| !matches!(self.scalar_inputs.get(i), Some(Indexing::Scalar | Indexing::Strided(_)));
        let loads = |run: bool| -> String {
            (0..self.inputs.len())
                .map(|i| {
                    let at = match self.scalar_inputs.get(i) {
                        Some(Indexing::Scalar) => format!("in{i}[0]"),
                        Some(Indexing::Strided(_)) => format!("in{i}[bidx(i, b{i})]"),
                        _ if run => format!("r{i}[q]"),
                        _ => format!("in{i}[i]"),
                    };
                    format!("#define IN{i} ld({at})\n")
                })
                .collect()
        };
        let undefs: String = (0..self.inputs.len()).map(|i| format!("#undef IN{i}\n")).collect();
        let mut aligned: Vec<String> =
            (0..self.inputs.len()).filter(|&i| same(i)).map(|i| format!("ew_aligned(in{i})")).collect();
        aligned.extend((0..self.outputs.len()).map(|k| format!("ew_aligned(out{k})")));
        let mut run_loads = String::new();
        for (i, d) in self.inputs.iter().enumerate().filter(|&(i, _)| same(i)) {
            run_loads.push_str(&format!(
                "    __align__(16) {} r{i}[EW_VEC];\n    ld_run(r{i}, in{i} + i0);\n",
                storage_type(*d)
            ));
        }
        let mut run_outs = String::new();
        let mut run_stores = String::new();
        let mut elem_stores = String::new();
        for (k, &o) in self.outputs.iter().enumerate() {
            run_outs.push_str(&format!("    __align__(16) {} w{k}[EW_VEC];\n", storage_type(self.nodes[o].dtype)));
            elem_stores.push_str(&format!("      st(&w{k}[q], v{o});\n"));
            run_stores.push_str(&format!("    st_run(out{k} + i0, w{k});\n"));
        }
        let core = format!("{}{body}{stores}", loads(false));
        let name = format!("ew_{:016x}", fnv1a(&[b"run8", core.as_bytes(), params.join(",").as_bytes()]));
        let src = format!(
            "{prelude}\nextern \"C\" __global__ void {name}({params}, i64 n, int* status, int tag) {{\n  \
             pdl_enter();\n  \
             const i64 t0 = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;\n  \
             const i64 runs = ({aligned}) ? n / EW_VEC : 0;\n\
             {run_loads_def}  for (i64 r = t0; r < runs; r += stride) {{\n    const i64 i0 = r * EW_VEC;\n\
             {run_loads}{run_outs}#pragma unroll\n    for (int q = 0; q < EW_VEC; ++q) {{\n      const i64 i = i0 + q;\n      (void)i;\n\
             {body}{elem_stores}    }}\n{run_stores}  }}\n{undefs}{scalar_loads}  \
             for (i64 i = runs * EW_VEC + t0; i < n; i += stride) {{\n{body}{stores}  }}\n{undefs}}}\n",
            params = params.join(", "),
            aligned = if aligned.is_empty() { "true".to_string() } else { aligned.join(" && ") },
            run_loads_def = loads(true),
            scalar_loads = loads(false),
        );
        Ok((src, name))
    }

    fn node_expr(&self, n: &ENode, next_const: &mut usize) -> Result<String> {
        let a = |k: usize| format!("v{}", n.args[k]);
        let arg_dtype = |k: usize| self.nodes[n.args[k]].dtype;
        let d = n.dtype;
        let unsupported = |what: &str| CudaError::Unsupported(format!("elementwise {what} on {d}"));
        let f64t = d == DType::F64;
        let fl = |name: &str| if f64t { name.to_string() } else { format!("{name}f") };
        let c = if matches!(n.op, EOp::Const(_) | EOp::Pow(_) | EOp::AddScalar(_) | EOp::MulScalar(_)) {
            *next_const += 1;
            format!("c{}", *next_const - 1)
        } else {
            String::new()
        };
        let lit = |_v: f64| if f64t { c.clone() } else { format!("(float){c}") };
        let one = if f64t { "1.0" } else { "1.0f" };
        let raw = match &n.op {
            EOp::Input(i) => return Ok(format!("IN{i}")),
            EOp::Const(_) => {
                return Ok(match d {
                    DType::F32 => format!("to_f32v({c})"),
                    DType::F64 => c,
                    DType::BF16 => format!("to_bf16v({c})"),
                    DType::F16 => format!("to_f16v({c})"),
                    // Rust's `f64 as i64` saturates and maps NaN to 0, as PTX's cvt does.
                    DType::I64 => format!("to_i64v({c})"),
                    DType::I32 => format!("to_i32v({c})"),
                    DType::Bool => format!("to_boolv(to_i64v({c}))"),
                });
            }
            EOp::Cast => {
                let conv = match d {
                    DType::F32 => "to_f32v",
                    DType::F64 => "to_f64v",
                    DType::BF16 => "to_bf16v",
                    DType::F16 => "to_f16v",
                    DType::I64 => "to_i64v",
                    DType::I32 => "to_i32v",
                    DType::Bool => "to_boolv",
                };
                // Integer sources convert through f64 (as the CPU does: i64 -> f64 -> dtype).
                return Ok(format!("{conv}({})", a(0)));
            }
            EOp::Compare(c) => {
                let op = match c {
                    CmpOp::Eq => "==",
                    CmpOp::Ne => "!=",
                    CmpOp::Lt => "<",
                    CmpOp::Le => "<=",
                    CmpOp::Gt => ">",
                    CmpOp::Ge => ">=",
                };
                return Ok(format!("(int)({} {op} {})", a(0), a(1)));
            }
            EOp::Where => return Ok(format!("({} ? {} : {})", a(0), a(1), a(2))),
            EOp::Binary(b) if !d.is_float() => {
                if d == DType::Bool {
                    return Err(unsupported(b.name()));
                }
                let e = match b {
                    BinaryOp::Add => format!("(i64)((unsigned long long){} + (unsigned long long){})", a(0), a(1)),
                    BinaryOp::Sub => format!("(i64)((unsigned long long){} - (unsigned long long){})", a(0), a(1)),
                    BinaryOp::Mul => format!("(i64)((unsigned long long){} * (unsigned long long){})", a(0), a(1)),
                    BinaryOp::Div => format!(
                        "({b} == 0 ? (report(status, tag, 2, 0), (i64)0) : ({b} == -1 ? (i64)(0ULL - (unsigned long long){a}) : {a} / {b}))",
                        a = a(0),
                        b = a(1)
                    ),
                    BinaryOp::Maximum => format!("({0} > {1} ? {0} : {1})", a(0), a(1)),
                    BinaryOp::Minimum => format!("({0} < {1} ? {0} : {1})", a(0), a(1)),
                };
                return Ok(if d == DType::I32 { format!("to_i32v({e})") } else { e });
            }
            EOp::Binary(b) => match b {
                BinaryOp::Add => format!("{} + {}", a(0), a(1)),
                BinaryOp::Sub => format!("{} - {}", a(0), a(1)),
                BinaryOp::Mul => format!("{} * {}", a(0), a(1)),
                BinaryOp::Div => format!("{} / {}", a(0), a(1)),
                BinaryOp::Maximum | BinaryOp::Minimum => {
                    let f = fl(if *b == BinaryOp::Maximum { "fmax" } else { "fmin" });
                    let nan = if f64t { "F64_NAN" } else { "F32_NAN" };
                    format!("((nan_({0}) || nan_({1})) ? {nan} : {f}({0}, {1}))", a(0), a(1))
                }
            },
            _ if !d.is_float() || self.nodes[n.args[0]].dtype != d => {
                return Err(unsupported(&format!("{:?} of {}", n.op, arg_dtype(0))));
            }
            EOp::Unary(u) => {
                let x = a(0);
                match u {
                    UnaryOp::Neg => format!("-{x}"),
                    UnaryOp::Exp => format!("{}({x})", fl("exp")),
                    UnaryOp::Log => format!("{}({x})", fl("log")),
                    UnaryOp::Sqrt => format!("{}({x})", fl("sqrt")),
                    UnaryOp::Rsqrt => format!("{one} / {}({x})", fl("sqrt")),
                    UnaryOp::Sigmoid => format!("{one} / ({one} + {}(-{x}))", fl("exp")),
                    UnaryOp::Silu => format!("{x} / ({one} + {}(-{x}))", fl("exp")),
                    UnaryOp::Tanh => format!("{}({x})", fl("tanh")),
                    UnaryOp::Abs => format!("{}({x})", fl("fabs")),
                    UnaryOp::Recip => format!("{one} / {x}"),
                    UnaryOp::Square => format!("{x} * {x}"),
                }
            }
            EOp::Pow(e) => format!("{}({}, {})", fl("pow"), a(0), lit(*e)),
            EOp::AddScalar(v) => format!("{} + {}", a(0), lit(*v)),
            EOp::MulScalar(v) => format!("{} * {}", a(0), lit(*v)),
        };
        Ok(match d {
            DType::BF16 => format!("rnd_bf16({raw})"),
            DType::F16 => format!("rnd_f16({raw})"),
            _ => raw,
        })
    }
}

/// `silu(gate) * up`, and its backward `(dgate, dup)`, as expressions (the CPU's formulas).
fn swiglu(inputs: Vec<DType>, scalar_inputs: Vec<Indexing>, backward: bool) -> Fused {
    let d = inputs[0];
    let mut nodes = input_nodes(&inputs);
    // Intermediates stay in the arithmetic type: they are one op's temporaries, rounded once
    // at the end, like the CPU's. A wide dtype holds them exactly enough.
    let w = if d == DType::F64 { DType::F64 } else { DType::F32 };
    let mut push = |op: EOp, args: Vec<usize>, dtype: DType| {
        nodes.push(ENode { op, args, dtype });
        nodes.len() - 1
    };
    let g = push(EOp::Cast, vec![0], w);
    let u = push(EOp::Cast, vec![1], w);
    let s = push(EOp::Unary(UnaryOp::Sigmoid), vec![g], w);
    let outputs = if !backward {
        let gs = push(EOp::Binary(BinaryOp::Mul), vec![g, s], w);
        let y = push(EOp::Binary(BinaryOp::Mul), vec![gs, u], w);
        vec![push(EOp::Cast, vec![y], d)]
    } else {
        let dy = push(EOp::Cast, vec![2], w);
        let one_minus = push(EOp::MulScalar(-1.0), vec![s], w);
        let one_minus = push(EOp::AddScalar(1.0), vec![one_minus], w);
        let t = push(EOp::Binary(BinaryOp::Mul), vec![g, one_minus], w);
        let t = push(EOp::AddScalar(1.0), vec![t], w);
        let du0 = push(EOp::Binary(BinaryOp::Mul), vec![dy, u], w);
        let du0 = push(EOp::Binary(BinaryOp::Mul), vec![du0, s], w);
        let dg = push(EOp::Binary(BinaryOp::Mul), vec![du0, t], w);
        let dyg = push(EOp::Binary(BinaryOp::Mul), vec![dy, g], w);
        let du = push(EOp::Binary(BinaryOp::Mul), vec![dyg, s], w);
        vec![push(EOp::Cast, vec![dg], d), push(EOp::Cast, vec![du], d)]
    };
    Fused { inputs, scalar_inputs, nodes, outputs }
}

/// The C type a value of `d` is computed in.
pub fn value_type(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::BF16 | DType::F16 => "float",
        DType::F64 => "double",
        DType::I32 | DType::I64 => "i64",
        DType::Bool => "int",
    }
}

/// The C type a value of `d` is stored as.
pub fn storage_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::I32 => "int",
        DType::I64 => "i64",
        DType::Bool => "u8",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(op: Op, args: &[TensorType]) -> Fused {
        let at: Vec<&TensorType> = args.iter().collect();
        let out = op.infer(&at).unwrap();
        let ot: Vec<&TensorType> = out.iter().collect();
        Fused::of_op(&op, &at, &ot).unwrap()
    }

    #[test]
    fn generated_kernels_open_with_pdl_enter() {
        let t = TensorType::new(DType::BF16, [4, 6]);
        let (src, _) = one(Op::Binary(BinaryOp::Mul), &[t.clone(), t]).source("").unwrap();
        assert!(crate::kernels::kernels_without_pdl_enter(&src).is_empty(), "{src}");
    }

    #[test]
    fn run_length_matches_the_prelude() {
        assert!(crate::kernels::PRELUDE.contains(&format!("#define EW_VEC {RUN}\n")));
    }

    #[test]
    fn same_shape_operands_are_read_in_runs_and_broadcasts_per_element() {
        let t = |shape: &[usize]| TensorType::new(DType::BF16, shape.to_vec());
        let mut f = one(Op::Binary(BinaryOp::Mul), &[t(&[4, 6]), t(&[4, 6])]);
        f.scalar_inputs[1] = Indexing::Strided(vec![0; 25]);
        let (src, _) = f.source("").unwrap();
        // The same-shape operand and the output move as runs; the broadcast one per element.
        assert!(src.contains("ld_run(r0, in0 + i0)") && src.contains("st_run(out0 + i0, w0)"), "{src}");
        assert!(!src.contains("r1[") && src.contains("in1[bidx(i, b1)]"), "{src}");
        // Misaligned pointers take the scalar loop for every element.
        assert!(src.contains("(ew_aligned(in0) && ew_aligned(out0)) ? n / EW_VEC : 0"), "{src}");
        assert!(src.contains("for (i64 i = runs * EW_VEC + t0; i < n; i += stride)"), "{src}");
    }

    #[test]
    fn constants_are_parameters_so_kernels_are_shared() {
        let t = TensorType::new(DType::BF16, [4, 8]);
        let a = one(Op::AddScalar { value: 0.5 }, std::slice::from_ref(&t));
        let b = one(Op::AddScalar { value: -3.25 }, std::slice::from_ref(&t));
        let (sa, na) = a.source("").unwrap();
        let (sb, nb) = b.source("").unwrap();
        assert_eq!((sa, na), (sb, nb));
        assert_eq!(a.consts(), vec![0.5]);
        assert_eq!(b.consts(), vec![-3.25]);
    }

    #[test]
    fn bf16_nodes_round_once_and_outputs_store() {
        let t = TensorType::new(DType::BF16, [4, 8]);
        let f = one(Op::Binary(BinaryOp::Mul), &[t.clone(), t]);
        let (src, name) = f.source("").unwrap();
        assert!(name.starts_with("ew_"));
        assert!(src.contains("float v2 = rnd_bf16(v0 * v1);"), "{src}");
        assert!(src.contains("st(&out0[i], v2);"), "{src}");
    }

    #[test]
    fn swiglu_backward_has_two_outputs_and_no_intermediate_rounding() {
        let t = TensorType::new(DType::BF16, [2, 3]);
        let f = one(Op::SwigluBackward, &[t.clone(), t.clone(), t]);
        assert_eq!(f.outputs.len(), 2);
        let (src, _) = f.source("").unwrap();
        // Two outputs, each rounded once, in the run loop and in the scalar loop.
        assert_eq!(src.matches("to_bf16v(").count(), 4, "{src}");
        assert!(!src.contains("rnd_bf16"), "{src}");
        assert!(src.contains("out1"));
    }

    #[test]
    fn bool_arithmetic_is_refused() {
        let t = TensorType::new(DType::Bool, [2]);
        let f = Fused {
            inputs: vec![DType::Bool, DType::Bool],
            scalar_inputs: vec![Indexing::Same, Indexing::Same],
            nodes: vec![
                ENode { op: EOp::Input(0), args: vec![], dtype: t.dtype },
                ENode { op: EOp::Input(1), args: vec![], dtype: t.dtype },
                ENode { op: EOp::Binary(BinaryOp::Add), args: vec![0, 1], dtype: DType::Bool },
            ],
            outputs: vec![2],
        };
        let e = f.source("").unwrap_err().to_string();
        assert!(e.contains("add") && e.contains("bool"), "{e}");
    }
}
