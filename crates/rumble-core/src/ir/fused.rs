//! The body of a `fused` op: a chain of elementwise ops run as one kernel.
//!
//! Operands may be smaller than the fused shape and are broadcast (numpy rules, the same as the
//! `broadcast` op) when read; every body value has the fused shape. Body value `i` is operand
//! `i` for `i < inputs.len()`, then instruction `i - inputs.len()`. A `full` instruction is a
//! scalar constant (its type is `dtype[]`).
//!
//! Backends run a body exactly as the unfused ops would (each instruction rounds to its dtype),
//! so fusing never changes results; GPUs keep the intermediates in registers.

use super::dtype::{DType, Shape, TensorType};
use super::op::Op;

/// One instruction of a fused body.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedInstr {
    pub op: Op,
    pub args: Vec<usize>,
    pub dtype: DType,
}

/// A fused elementwise program (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct FusedBody {
    pub shape: Shape,
    pub inputs: Vec<TensorType>,
    pub body: Vec<FusedInstr>,
    pub outputs: Vec<usize>,
}

impl FusedBody {
    /// The dtype of body value `v`.
    pub fn dtype(&self, v: usize) -> DType {
        if v < self.inputs.len() { self.inputs[v].dtype } else { self.body[v - self.inputs.len()].dtype }
    }

    /// Checks the body against operand types `args` and returns the output types.
    pub fn infer(&self, args: &[&TensorType]) -> Result<Vec<TensorType>, String> {
        if args.len() != self.inputs.len() {
            return Err(format!("takes {} operands, got {}", self.inputs.len(), args.len()));
        }
        for (i, (a, want)) in args.iter().zip(&self.inputs).enumerate() {
            if *a != want {
                return Err(format!("operand {i} must be {want}, got {a}"));
            }
            Op::Broadcast { shape: self.shape.clone() }.infer(&[a]).map_err(|m| format!("operand {i}: {m}"))?;
        }
        let full = |d: DType| TensorType { dtype: d, shape: self.shape.clone() };
        for (i, ins) in self.body.iter().enumerate() {
            let at = || format!("body instruction {i} ({})", ins.op.name());
            let id = self.inputs.len() + i;
            if let Some(&a) = ins.args.iter().find(|&&a| a >= id) {
                return Err(format!("{}: operand ${a} is not defined before it", at()));
            }
            let made = match &ins.op {
                Op::Full { ty, .. } if ty.rank() == 0 && ins.args.is_empty() => ty.dtype,
                op if op.is_elementwise() => {
                    let tys: Vec<TensorType> = ins.args.iter().map(|&a| full(self.dtype(a))).collect();
                    let refs: Vec<&TensorType> = tys.iter().collect();
                    op.infer(&refs).map_err(|m| format!("{}: {m}", at()))?.remove(0).dtype
                }
                op => {
                    return Err(format!("{}: only elementwise ops and scalar constants fuse, not {}", at(), op.name()));
                }
            };
            if made != ins.dtype {
                return Err(format!("{}: declared {} but the op makes {made}", at(), ins.dtype));
            }
        }
        if self.outputs.is_empty() {
            return Err("a fused body returns nothing".into());
        }
        let n = self.inputs.len() + self.body.len();
        self.outputs
            .iter()
            .map(|&o| if o < n { Ok(full(self.dtype(o))) } else { Err(format!("returns ${o}, which is not defined")) })
            .collect()
    }
}
