//! The builder: write a model in Rust with tensor methods, and a trace is recorded.
//!
//! ```
//! use rumble_core::ir::{DType, Graph};
//! let g = Graph::new("mlp");
//! let x = g.data("x", DType::F32, &[4, 8]).unwrap();          // (N, C)
//! let w = g.param("w", DType::F32, &[16, 8]).unwrap();        // (H, C)
//! let y = x.matmul_t(&w).unwrap().silu().unwrap();            // (N, H)
//! g.output(&y, "y").unwrap();
//! let trace = g.finish().unwrap();
//! assert_eq!(trace.nodes.len(), 2);
//! ```
//! Shape and dtype mistakes are errors at build time that name the op and the operand types.

use std::cell::RefCell;
use std::rc::Rc;

use super::dtype::{DType, Shape, TensorType};
use super::heads::{HeadLayout, RopeScaling};
use super::op::{BinaryOp, CmpOp, Op, ReduceOp, UnaryOp};
use super::trace::{InputRole, Node, OutputRole, Phase, Trace, TraceInput, TraceOutput, ValueId};
use crate::{Error, Result};

struct State {
    trace: Trace,
    phase: Phase,
}

/// A trace under construction. Cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Graph(Rc<RefCell<State>>);

/// A value of a `Graph`: its id and static type. Methods record ops.
#[derive(Clone)]
pub struct Tensor {
    id: ValueId,
    ty: TensorType,
    graph: Graph,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.id, self.ty)
    }
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Self {
        Graph::from_trace(Trace::new(name))
    }

    /// Continues building on an existing trace (autodiff and optimizers append to traces).
    pub fn from_trace(trace: Trace) -> Self {
        Graph(Rc::new(RefCell::new(State { trace, phase: Phase::Forward })))
    }

    /// Adds a trace input. Names must be unique.
    pub fn input(&self, name: &str, ty: TensorType, role: InputRole) -> Result<Tensor> {
        let mut s = self.0.borrow_mut();
        if name.is_empty() || s.trace.input(name).is_some() {
            return Err(Error::msg(format!("trace `{}`: input name `{name}` is empty or taken", s.trace.name)));
        }
        ty.checked_size_in_bytes().map_err(|e| Error::msg(format!("trace `{}`: input `{name}`: {e}", s.trace.name)))?;
        let id = s.trace.new_value(ty.clone());
        s.trace.inputs.push(TraceInput { value: id, name: name.to_string(), role });
        drop(s);
        Ok(Tensor { id, ty, graph: self.clone() })
    }

    /// A model parameter.
    pub fn param(&self, name: &str, dtype: DType, dims: &[usize]) -> Result<Tensor> {
        self.input(name, TensorType::new(dtype, dims.to_vec()), InputRole::Param)
    }

    /// Per-step data (token ids, targets, a learning rate).
    pub fn data(&self, name: &str, dtype: DType, dims: &[usize]) -> Result<Tensor> {
        self.input(name, TensorType::new(dtype, dims.to_vec()), InputRole::Input)
    }

    /// A tensor whose every element is `value`.
    pub fn full(&self, value: f64, dtype: DType, dims: &[usize]) -> Tensor {
        let ty = TensorType::new(dtype, dims.to_vec());
        // `full` takes the dims of an existing value (or `[]`): those were checked when it was made.
        self.apply(Op::Full { value, ty }, &[]).expect("full of an existing value's dims").remove(0)
    }

    /// A scalar (`[]`) constant.
    pub fn scalar(&self, value: f64, dtype: DType) -> Tensor {
        self.full(value, dtype, &[])
    }

    /// A handle to an existing value of the trace.
    pub fn value(&self, id: ValueId) -> Tensor {
        let ty = self.0.borrow().trace.ty(id).clone();
        Tensor { id, ty, graph: self.clone() }
    }

    /// The phase recorded on the nodes added from now on.
    pub fn set_phase(&self, phase: Phase) {
        self.0.borrow_mut().phase = phase;
    }

    pub fn phase(&self) -> Phase {
        self.0.borrow().phase
    }

    /// Records `op` on `args`; checks the op's type rule first.
    pub fn apply(&self, op: Op, args: &[&Tensor]) -> Result<Vec<Tensor>> {
        for a in args {
            if !Rc::ptr_eq(&a.graph.0, &self.0) {
                return Err(Error::Op {
                    op: op.name().into(),
                    args: a.ty.to_string(),
                    msg: "operand belongs to another graph".into(),
                });
            }
        }
        let tys: Vec<&TensorType> = args.iter().map(|a| &a.ty).collect();
        let outs = op
            .infer(&tys)
            .and_then(|outs| match outs.iter().find_map(|t| t.checked_size_in_bytes().err()) {
                Some(e) => Err(format!("output {e}")),
                None => Ok(outs),
            })
            .map_err(|msg| Error::Op {
                op: op.name().into(),
                args: tys.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "),
                msg,
            })?;
        let mut s = self.0.borrow_mut();
        let ids: Vec<ValueId> = outs.iter().map(|t| s.trace.new_value(t.clone())).collect();
        let phase = s.phase;
        s.trace.nodes.push(Node { op, args: args.iter().map(|a| a.id).collect(), outs: ids.clone(), phase });
        drop(s);
        Ok(ids.into_iter().zip(outs).map(|(id, ty)| Tensor { id, ty, graph: self.clone() }).collect())
    }

    fn apply1(&self, op: Op, args: &[&Tensor]) -> Result<Tensor> {
        Ok(self.apply(op, args)?.remove(0))
    }

    /// Marks `t` as a plain output called `name`.
    pub fn output(&self, t: &Tensor, name: &str) -> Result<()> {
        self.output_with_role(t, name, OutputRole::Output)
    }

    pub fn output_with_role(&self, t: &Tensor, name: &str, role: OutputRole) -> Result<()> {
        let mut s = self.0.borrow_mut();
        if s.trace.output(name).is_some() {
            return Err(Error::msg(format!("trace `{}`: output name `{name}` is taken", s.trace.name)));
        }
        s.trace.outputs.push(TraceOutput { value: t.id, name: name.to_string(), role });
        Ok(())
    }

    /// A copy of the trace as recorded so far (not verified, not compacted).
    pub fn snapshot(&self) -> Trace {
        self.0.borrow().trace.clone()
    }

    /// Changes the recorded trace in place (for passes that rewrite outputs).
    pub fn with_trace<R>(&self, f: impl FnOnce(&mut Trace) -> R) -> R {
        f(&mut self.0.borrow_mut().trace)
    }

    /// The finished trace: verified and compactly numbered.
    pub fn finish(&self) -> Result<Trace> {
        let mut t = self.snapshot();
        super::verify(&t)?;
        t.compact()?;
        Ok(t)
    }
}

macro_rules! unary {
    ($($name:ident => $op:ident),* $(,)?) => {$(
        pub fn $name(&self) -> Result<Tensor> {
            self.graph.apply1(Op::Unary(UnaryOp::$op), &[self])
        }
    )*};
}

macro_rules! binary {
    ($($name:ident => $op:expr),* $(,)?) => {$(
        pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> {
            self.graph.apply1($op, &[self, rhs])
        }
    )*};
}

impl Tensor {
    pub fn id(&self) -> ValueId {
        self.id
    }
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }
    pub fn dims(&self) -> &[usize] {
        self.ty.dims()
    }
    pub fn rank(&self) -> usize {
        self.ty.rank()
    }
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    unary!(neg => Neg, exp => Exp, log => Log, sqrt => Sqrt, rsqrt => Rsqrt, sigmoid => Sigmoid,
           silu => Silu, tanh => Tanh, abs => Abs, recip => Recip, square => Square);

    binary!(add => Op::Binary(BinaryOp::Add), sub => Op::Binary(BinaryOp::Sub),
            mul => Op::Binary(BinaryOp::Mul), div => Op::Binary(BinaryOp::Div),
            maximum => Op::Binary(BinaryOp::Maximum), minimum => Op::Binary(BinaryOp::Minimum),
            eq => Op::Compare(CmpOp::Eq), ne => Op::Compare(CmpOp::Ne), lt => Op::Compare(CmpOp::Lt),
            le => Op::Compare(CmpOp::Le), gt => Op::Compare(CmpOp::Gt), ge => Op::Compare(CmpOp::Ge),
            swiglu => Op::Swiglu);

    /// `silu(gate) * up` with gate and up side by side in each row: `[..., 2F] -> [..., F]`.
    pub fn swiglu_packed(&self) -> Result<Tensor> {
        self.graph.apply1(Op::SwigluPacked, &[self])
    }
    pub fn powf(&self, exponent: f64) -> Result<Tensor> {
        self.graph.apply1(Op::PowScalar { exponent }, &[self])
    }
    pub fn add_scalar(&self, value: f64) -> Result<Tensor> {
        self.graph.apply1(Op::AddScalar { value }, &[self])
    }
    pub fn mul_scalar(&self, value: f64) -> Result<Tensor> {
        self.graph.apply1(Op::MulScalar { value }, &[self])
    }
    pub fn cast(&self, to: DType) -> Result<Tensor> {
        if to == self.dtype() {
            return Ok(self.clone());
        }
        self.graph.apply1(Op::Cast { to }, &[self])
    }

    /// `self ? a : b` elementwise; `self` is bool.
    pub fn select(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.graph.apply1(Op::Where, &[self, a, b])
    }

    fn reduce(&self, op: ReduceOp, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        let mut axes = axes.to_vec();
        axes.sort_unstable();
        self.graph.apply1(Op::Reduce { op, axes, keepdim }, &[self])
    }
    pub fn sum(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, axes, keepdim)
    }
    pub fn mean(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Mean, axes, keepdim)
    }
    pub fn amax(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, axes, keepdim)
    }
    /// `square` then `sum` over `axes`, in one reduction (the squares are never written).
    pub fn sum_squares(&self, axes: &[usize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::SumSquares, axes, keepdim)
    }
    /// Sum of every element, as a scalar `[]`.
    pub fn sum_all(&self) -> Result<Tensor> {
        if self.rank() == 0 {
            return Ok(self.clone());
        }
        self.sum(&(0..self.rank()).collect::<Vec<_>>(), false)
    }

    pub fn reshape(&self, dims: &[usize]) -> Result<Tensor> {
        if dims == self.dims() {
            return Ok(self.clone());
        }
        self.graph.apply1(Op::Reshape { shape: Shape::new(dims.to_vec()) }, &[self])
    }
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        self.graph.apply1(Op::Permute { perm: perm.to_vec() }, &[self])
    }
    /// Swaps axes `a` and `b`.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        if a >= perm.len() || b >= perm.len() {
            return Err(Error::Op {
                op: "permute".into(),
                args: self.ty.to_string(),
                msg: format!("cannot swap axes {a} and {b}"),
            });
        }
        perm.swap(a, b);
        self.permute(&perm)
    }
    pub fn broadcast_to(&self, dims: &[usize]) -> Result<Tensor> {
        if dims == self.dims() {
            return Ok(self.clone());
        }
        self.graph.apply1(Op::Broadcast { shape: Shape::new(dims.to_vec()) }, &[self])
    }
    pub fn broadcast_as(&self, other: &Tensor) -> Result<Tensor> {
        self.broadcast_to(other.dims())
    }
    pub fn slice(&self, axis: usize, start: usize, end: usize) -> Result<Tensor> {
        self.graph.apply1(Op::Slice { axis, start, end }, &[self])
    }
    pub fn concat(parts: &[&Tensor], axis: usize) -> Result<Tensor> {
        let first = parts.first().ok_or_else(|| Error::msg("concat of nothing"))?;
        first.graph.apply1(Op::Concat { axis }, parts)
    }

    /// Embedding lookup: `self` is the table `[V, D]`, `ids` any int shape.
    pub fn gather(&self, ids: &Tensor) -> Result<Tensor> {
        self.graph.apply1(Op::Gather, &[self, ids])
    }
    /// `self` holds ids; rows of `src` are summed into a `[rows, D]` table.
    pub fn scatter_add(&self, src: &Tensor, rows: usize) -> Result<Tensor> {
        self.graph.apply1(Op::ScatterAdd { rows }, &[self, src])
    }

    /// `self @ rhs` over the last two axes.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.matmul_opts(rhs, false, false)
    }
    /// `self @ rhs^T`: a linear layer with weight `rhs [out, in]`.
    pub fn matmul_t(&self, rhs: &Tensor) -> Result<Tensor> {
        self.matmul_opts(rhs, false, true)
    }
    pub fn matmul_opts(&self, rhs: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
        self.graph.apply1(Op::Matmul { ta, tb, out: None, acc: super::Addend::None }, &[self, rhs])
    }

    pub fn rms_norm(&self, w: &Tensor, eps: f64) -> Result<Tensor> {
        self.graph.apply1(Op::RmsNorm { eps }, &[self, w])
    }
    /// RoPE of `self [B, H, T, D]`.
    pub fn rope(&self, theta: f64) -> Result<Tensor> {
        self.rope_in(HeadLayout::Bhtd, theta)
    }
    /// RoPE of `self` in `layout` (`[B, T, H, D]` for `Bthd`: positions along axis 1).
    pub fn rope_in(&self, layout: HeadLayout, theta: f64) -> Result<Tensor> {
        self.rope_scaled(layout, theta, RopeScaling::None)
    }
    /// RoPE of `self` in `layout` with inverse frequencies rescaled by `scaling`.
    pub fn rope_scaled(&self, layout: HeadLayout, theta: f64, scaling: RopeScaling) -> Result<Tensor> {
        self.graph.apply1(Op::Rope { theta, inverse: false, layout, scaling }, &[self])
    }
    pub fn softmax(&self) -> Result<Tensor> {
        self.graph.apply1(Op::Softmax, &[self])
    }
    pub fn log_softmax(&self) -> Result<Tensor> {
        self.graph.apply1(Op::LogSoftmax, &[self])
    }
    /// Mean cross-entropy of logits `self [N, V]` against `targets [N]`, as f32 `[]`.
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: i64) -> Result<Tensor> {
        self.graph.apply1(Op::CrossEntropy { ignore_index }, &[self, targets])
    }
    /// `cross_entropy(self @ w^T, targets)` without materialising the logits: `self [N, C]`,
    /// `w [V, C]`; backends work on `chunk` rows at a time.
    pub fn linear_cross_entropy(
        &self,
        w: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        chunk: usize,
    ) -> Result<Tensor> {
        Ok(self.linear_cross_entropy_lse(w, targets, ignore_index, chunk)?.0)
    }
    /// [`Tensor::linear_cross_entropy`] and its second output, each row's log-sum-exp `[N]`
    /// (what the backward reads instead of recomputing it).
    pub fn linear_cross_entropy_lse(
        &self,
        w: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        chunk: usize,
    ) -> Result<(Tensor, Tensor)> {
        let mut outs = self.graph.apply(Op::LinearCrossEntropy { ignore_index, chunk }, &[self, w, targets])?;
        let lse = outs.pop().expect("linear_cross_entropy has two outputs");
        Ok((outs.pop().expect("linear_cross_entropy has two outputs"), lse))
    }
    /// Causal or full attention on `[B, H, T, D]` operands; returns the output and the
    /// log-sum-exp per query.
    pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<(Tensor, Tensor)> {
        Tensor::attention_in(HeadLayout::Bhtd, q, k, v, scale, causal)
    }
    /// Attention with operands in `layout` (`Bthd`: q `[B, T, Hq, D]`, k and v `[B, S, Hkv, D]`,
    /// the output like q); the log-sum-exp is `[B, Hq, T]` in either layout.
    pub fn attention_in(
        layout: HeadLayout,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        causal: bool,
    ) -> Result<(Tensor, Tensor)> {
        let mut outs = q.graph.apply(Op::Attention { scale, causal, layout }, &[q, k, v])?;
        let lse = outs.pop().expect("attention has two outputs");
        Ok((outs.pop().expect("attention has two outputs"), lse))
    }

    /// RoPE of `self` in `layout` with row `t` of sequence `b` at position `pos[b] + t`
    /// (`pos` int `[B]`).
    pub fn rope_at(&self, pos: &Tensor, layout: HeadLayout, theta: f64) -> Result<Tensor> {
        self.rope_at_scaled(pos, layout, theta, RopeScaling::None)
    }
    /// [`Tensor::rope_at`] with inverse frequencies rescaled by `scaling` (as
    /// [`Tensor::rope_scaled`]'s are).
    pub fn rope_at_scaled(&self, pos: &Tensor, layout: HeadLayout, theta: f64, scaling: RopeScaling) -> Result<Tensor> {
        self.graph.apply1(Op::RopeAt { theta, layout, scaling }, &[self, pos])
    }
    /// `self` (a cache `[B, S, H, D]`) with rows `pos[b] .. pos[b] + T` replaced by `new
    /// [B, T, H, D]`.
    pub fn cache_write(&self, new: &Tensor, pos: &Tensor) -> Result<Tensor> {
        self.graph.apply1(Op::CacheWrite { rope: None }, &[self, new, pos])
    }
    /// Attention of queries `q [B, T, Hq, D]` over caches `k, v [B, S, Hkv, D]`, query `t` of
    /// sequence `b` seeing keys `0 ..= pos[b] + t`.
    pub fn attention_cached(q: &Tensor, k: &Tensor, v: &Tensor, pos: &Tensor, scale: f64) -> Result<Tensor> {
        q.graph.apply1(Op::AttentionCached { scale, rope: None }, &[q, k, v, pos])
    }
    /// One token id per row of logits `self [B, V]` (i64 `[B]`), drawn with `key = (seed,
    /// step)` (int `[2]`); see `Op::Sample`.
    pub fn sample(&self, key: &Tensor, temperature: f64, top_k: usize, top_p: f64) -> Result<Tensor> {
        self.graph.apply1(Op::Sample { temperature, top_k, top_p }, &[self, key])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_errors_name_the_op_and_types() {
        let g = Graph::new("t");
        let a = g.data("a", DType::F32, &[2, 3]).unwrap();
        let b = g.data("b", DType::F32, &[4, 5]).unwrap();
        let e = a.matmul(&b).unwrap_err().to_string();
        assert!(e.contains("matmul(f32[2,3], f32[4,5])") && e.contains("inner dims differ"), "{e}");
        let c = g.data("c", DType::BF16, &[2, 3]).unwrap();
        let e = a.add(&c).unwrap_err().to_string();
        assert!(e.contains("add(f32[2,3], bf16[2,3])"), "{e}");
        assert!(g.data("a", DType::F32, &[1]).is_err(), "duplicate input name");
    }

    #[test]
    fn operands_from_another_graph_are_refused() {
        let g1 = Graph::new("one");
        let g2 = Graph::new("two");
        let a = g1.data("a", DType::F32, &[2]).unwrap();
        let b = g2.data("b", DType::F32, &[2]).unwrap();
        assert!(a.add(&b).unwrap_err().to_string().contains("another graph"));
    }
}
