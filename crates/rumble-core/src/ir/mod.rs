//! The trace IR: element types, ops, traces, the builder, the text form and the verifier.

mod addend;
mod builder;
mod collective;
mod decode;
mod dtype;
mod fused;
mod heads;
mod op;
mod text;
mod trace;
mod verify;

pub use addend::Addend;
pub use builder::{Graph, Tensor};
pub use collective::collective_joins;
pub use decode::{Prologue, RopeNew};
pub use dtype::{DType, MAX_BYTES, Shape, SizeOverflow, TensorType, mul_size, total_bytes};
pub use fused::{FusedBody, FusedInstr};
pub use heads::{HeadLayout, RopeScaling};
pub use op::{BinaryOp, CmpOp, CollectiveOp, Op, ReduceOp, UnaryOp, stat_dtype};
pub use text::{op_attrs, parse};
pub use trace::{Def, InputRole, Node, OutputRole, Phase, Trace, TraceInput, TraceOutput, ValueId};
pub use verify::verify;
