//! The one enum of ops, with each op's name, attributes and type rule.
//!
//! Adding an op means adding a variant here; rustc then lists every `match` that must learn
//! about it (type rule, text form, VJP, CPU kernel, CUDA kernel).
//!
//! Rules shared by all ops: no implicit broadcasting (use `broadcast`), no implicit type
//! promotion (use `cast`), static shapes only. Composite ops that need their own kernels for
//! speed or memory (RMSNorm, RoPE, softmax, cross-entropy, SwiGLU, attention) stay whole, and
//! their backward passes are ops too.

use super::dtype::{DType, Shape, TensorType};
use super::fused::FusedBody;
use super::heads::{HeadLayout, RopeScaling, attention_operands};

/// The elementwise ops ([`Op::is_elementwise`]) as one pattern, for matches that treat them
/// alike and stay exhaustive: `match op { elementwise_ops!() | Op::Full { .. } => ..., ... }`.
#[macro_export]
macro_rules! elementwise_ops {
    () => {
        $crate::ir::Op::Unary(_)
            | $crate::ir::Op::PowScalar { .. }
            | $crate::ir::Op::AddScalar { .. }
            | $crate::ir::Op::MulScalar { .. }
            | $crate::ir::Op::Cast { .. }
            | $crate::ir::Op::Binary(_)
            | $crate::ir::Op::Compare(_)
            | $crate::ir::Op::Where
    };
}

/// Elementwise functions of one float tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Sigmoid,
    Silu,
    Tanh,
    Abs,
    Recip,
    Square,
}

/// Elementwise functions of two tensors of the same type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

/// Elementwise comparisons; the result is `bool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// Reductions along axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Mean,
    /// The sum of the squares (each square taken in the accumulation dtype): a norm's
    /// `square` and `sum` in one pass, the squares never written.
    SumSquares,
}

/// The collective operations of data-parallel training (see `Op::Collective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// `(x) -> x`: the elementwise sum of every rank's `x`.
    AllReduce,
    /// `(x) -> [numel(x) / world]`: the elementwise sum of every rank's `x`, flattened and cut
    /// into `world` equal shards; rank `r` keeps shard `r`. `numel(x)` must divide by `world`.
    ReduceScatter,
    /// `(x [n]) -> [world * n]`: every rank's `x`, concatenated in rank order.
    AllGather,
}

impl CollectiveOp {
    pub const ALL: [CollectiveOp; 3] = [CollectiveOp::AllReduce, CollectiveOp::ReduceScatter, CollectiveOp::AllGather];
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllGather => "all_gather",
        }
    }
}

/// One operation of a trace. Attributes are part of the op; operands are value ids held by the
/// node (see `trace::Node`).
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `() -> ty`: every element equals `value`.
    Full { value: f64, ty: TensorType },
    /// `(x) -> x`, float only.
    Unary(UnaryOp),
    /// `x ** exponent`, float only.
    PowScalar { exponent: f64 },
    /// `x + value`, float only.
    AddScalar { value: f64 },
    /// `x * value`, float only.
    MulScalar { value: f64 },
    /// `(x) -> x as to`. Float to int truncates toward zero.
    Cast { to: DType },
    /// `(a, b) -> a`, same dtype and shape.
    Binary(BinaryOp),
    /// `(a, b) -> bool`, same dtype and shape.
    Compare(CmpOp),
    /// `(cond: bool, a, b) -> a`, all the same shape.
    Where,
    /// Reduce along `axes` (sorted, unique); `keepdim` keeps them as size 1.
    Reduce { op: ReduceOp, axes: Vec<usize>, keepdim: bool },
    /// Same elements in row-major order, another shape.
    Reshape { shape: Shape },
    /// `out.dims[i] = x.dims[perm[i]]`.
    Permute { perm: Vec<usize> },
    /// Numpy-style expansion, explicit: dims align on the right; each input dim equals the
    /// output's or is 1.
    Broadcast { shape: Shape },
    /// `x[.., start..end, ..]` along `axis`.
    Slice { axis: usize, start: usize, end: usize },
    /// Join along `axis`; every operand has the same dtype and the same other dims.
    Concat { axis: usize },
    /// Embedding lookup: `(table [V, D], ids int [...]) -> [..., D]`.
    Gather,
    /// The adjoint of `gather`: `(ids int [...], src [..., D]) -> [rows, D]`, rows summed.
    ScatterAdd { rows: usize },
    /// Batched matmul: `a [.., M, K]` (`[.., K, M]` if `ta`) times `b [.., K, N]`
    /// (`[.., N, K]` if `tb`) gives `[.., M, N]`; batch dims must be equal. `out`: the result's
    /// dtype where it is not the operands' (a wider float: the products accumulate as always
    /// and are rounded once, to `out`); `passes::fold_casts` sets it to f32 where a bf16 or f16
    /// matmul's only use is a cast to f32 (the pair the CUDA matmul writes). `acc`: a third
    /// operand `c` is added ([`super::Addend`]), the sum taken with the products' accumulation
    /// and rounded once: of the result's type (`Full`, cuBLAS's `beta = 1`; the result may be
    /// computed over `c`), set by `passes::fold_addends` where a matmul's only use is such an
    /// add (residual connections, gradient sums); or a row `[N]` added to every row (`Row`, a
    /// linear layer's bias), set by `passes::fold_row_addends` where that addend is a broadcast
    /// row.
    Matmul { ta: bool, tb: bool, out: Option<DType>, acc: super::Addend },
    /// `(x [..., D], w [D]) -> x * rsqrt(mean(x^2) + eps) * w`, statistics in f32.
    RmsNorm { eps: f64 },
    /// `(x, w, dy) -> (dx, dw)`. `acc`: a fourth operand `c` of `x`'s type is added to `dx`
    /// before its one rounding; `passes::fold_norm_addends` sets it where `dx`'s only use is
    /// such an add (the residual stream's gradient). `dx` may be computed over `c`.
    RmsNormBackward { eps: f64, acc: bool },
    /// Rotary position embedding of `x [B, H, T, D]` (`[B, T, H, D]` in layout `bthd`) at
    /// positions `0..T` along the layout's sequence axis, rotate-half form (Hugging Face LLaMA,
    /// litgpt). `inverse` rotates by minus the angle (its VJP). The angle of position `t` and
    /// frequency `j` is `t * scaling.inv_freq(theta, D)[j]` (see [`RopeScaling`]).
    Rope { theta: f64, inverse: bool, layout: HeadLayout, scaling: RopeScaling },
    /// Softmax along the last axis.
    Softmax,
    /// `(y, dy) -> dx` for `y = softmax(x)`.
    SoftmaxBackward,
    /// Log-softmax along the last axis.
    LogSoftmax,
    /// `(y, dy) -> dx` for `y = log_softmax(x)`.
    LogSoftmaxBackward,
    /// `(logits [N, V], targets int [N]) -> f32[]` (`f64[]` for f64 logits): mean over
    /// targets != ignore_index of `logsumexp(logits) - logits[target]`, computed in f32 (f64)
    /// whatever the logits' dtype. All targets ignored gives 0.
    CrossEntropy { ignore_index: i64 },
    /// `(logits, targets, dloss) -> dlogits`; `dloss` has the loss's type.
    CrossEntropyBackward { ignore_index: i64 },
    /// The last projection and the loss in one op, never materialising all the logits:
    /// `(x [N, C], w [V, C], targets int [N]) -> (loss, lse [N])`, `loss` equal to
    /// `cross_entropy(x @ w^T, targets)` and `lse` each row's log-sum-exp of its logits
    /// `x @ w^T` (every row's, ignored rows included), both in f32 (f64 for f64 operands).
    /// Backends work on `chunk` rows at a time, so their scratch is `chunk x V` (see
    /// `Op::scratch_bytes`); the backward recomputes each chunk's logits instead of saving
    /// them, but takes each row's log-sum-exp from `lse` (as attention's backward does).
    LinearCrossEntropy { ignore_index: i64, chunk: usize },
    /// `(x, w, targets, lse, dloss) -> (dx, dw)`, `lse` the forward's second output.
    LinearCrossEntropyBackward { ignore_index: i64, chunk: usize },
    /// The fused loss and its gradient in one pass over the chunks, each chunk's logits
    /// computed once: `(x, w, targets, dloss) -> (loss, dx, dw)`, equal to
    /// `linear_cross_entropy` then `linear_cross_entropy_backward` with `dloss`.
    /// `passes::fold_loss_grad` makes it where `dloss` does not depend on the loss (the loss is
    /// the objective): the backward's recomputation of the logits is gone.
    LinearCrossEntropyGrad { ignore_index: i64, chunk: usize },
    /// `(gate, up) -> silu(gate) * up`.
    Swiglu,
    /// `(gate, up, dy) -> (dgate, dup)`.
    SwigluBackward,
    /// Swiglu of gate and up packed side by side in each row, as one projection to `2F` gives
    /// them: `x [..., 2F] -> silu(x[..., :F]) * x[..., F:]`, `[..., F]`.
    SwigluPacked,
    /// `(x [..., 2F], dy [..., F]) -> dx [..., 2F]` (dgate in the first half of each row, dup in
    /// the second).
    SwigluPackedBackward,
    /// Scaled dot-product attention with grouped-query heads:
    /// `(q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, D]) -> (o [B, Hq, T, D], lse [B, Hq, T])`
    /// in layout `bhtd`; in layout `bthd` q, k, v and o are `[B, T, Hq, D]`, `[B, S, Hkv, D]`
    /// and `[B, T, Hq, D]`, and lse is still `[B, Hq, T]`. `lse` in f32 (f64 for f64 operands).
    /// Query head `h` reads key/value head `h / (Hq / Hkv)`. `causal` needs `T == S`.
    /// Only `o` and the log-sum-exp `lse` are kept for the backward (flash style).
    Attention { scale: f64, causal: bool, layout: HeadLayout },
    /// `(q, k, v, o, lse, do) -> (dq, dk, dv)`, all but `lse` in the layout of the forward.
    AttentionBackward { scale: f64, causal: bool, layout: HeadLayout },
    /// A chain of elementwise ops run as one kernel (made by the fusion pass; see
    /// `ir::fused`).
    Fused(Box<FusedBody>),
    // Decoding (inference only: no VJP). Type rules in `ir::decode`.
    /// RoPE like `rope`, but row `t` of sequence `b` sits at position `pos[b] + t`:
    /// `(x, pos int [B]) -> x`, x `[B, T, H, D]` in layout `bthd` (`[B, H, T, D]` in `bhtd`),
    /// D even. One decode step's new token is rotated at its sequence's own position. The
    /// angle of position `p` and frequency `j` is `p * scaling.inv_freq(theta, D)[j]`, as in
    /// `rope`, so a row at position `p` equals row `p` of `rope` with the same attributes.
    RopeAt { theta: f64, layout: HeadLayout, scaling: RopeScaling },
    /// A KV-cache write: `(cache [B, S, H, D], new [B, T, H, D], pos int [B]) -> cache` with
    /// rows `pos[b] .. pos[b] + T` of sequence `b` replaced by `new[b]`, every other element
    /// kept. `pos[b] + T > S` is an error (the CPU says so; a device kernel skips such rows).
    /// The planner may compute the result over the cache (`Op::may_overwrite`), and then a
    /// backend writes the `T` new rows only. With `rope` the new rows are rotated first, as
    /// `rope_at` (layout `bthd`, D even) would: `cache_write(c, rope_at(n, pos), pos)` exactly.
    CacheWrite { rope: Option<super::decode::RopeNew> },
    /// A layer's key and value cache writes as one node: `(k_cache, v_cache [B, S, H, D], k,
    /// v [B, T, H, D], pos int [B]) -> (k_cache, v_cache)`, exactly `cache_write(k_cache, k, pos)`
    /// with `rope` and `cache_write(v_cache, v, pos)` (never rotated); the caches of one type,
    /// `k` and `v` of one type. Result `j` may be computed over cache `j` only. Made by
    /// `passes::fold_cache_writes` (one launch a layer instead of two).
    CacheWriteKv { rope: Option<super::decode::RopeNew> },
    /// Attention of `T` new queries per sequence over a cache: `(q [B, T, Hq, D],
    /// k [B, S, Hkv, D], v [B, S, Hkv, D], pos int [B]) -> o [B, T, Hq, D]` (sequence-major);
    /// query `t` of sequence `b` sees keys `0 ..= pos[b] + t` (fewer when that passes `S`),
    /// query head `h` reads key/value head `h / (Hq / Hkv)`. Scores and softmax in f32 (f64
    /// for f64).
    /// With `rope` the queries are rotated first, as `rope_at` (layout `bthd`) would at the
    /// same positions: `attention_cached(rope_at(q, pos), k, v, pos)` exactly.
    AttentionCached { scale: f64, rope: Option<super::decode::RopeNew> },
    /// `outs` projections of rows made by `pre` (see [`super::Prologue`]): `(x, [g,] w_1 ..
    /// w_outs [N_j, K][, c_1 .. c_outs]) -> pre(x) w_j^T (+ c_j)`, each `[M, N_j]`, exactly
    /// `matmul(pre(x), w_j, tb=true)` with the prologue's rows rounded to the dtype as that op's
    /// result is (and `acc` as `matmul`'s, one kind for every projection: `c_j` is `[M, N_j]`
    /// or, `Row`, `[N_j]`). Made by `passes::fold_prologues` for a decode step's
    /// few rows (the norm or swiglu's launch and intermediate gone), and joined by
    /// `passes::fold_projections` where several read the same rows (a layer's q, k and v).
    MatmulPre { pre: super::Prologue, acc: super::Addend, outs: usize },
    /// Draws the next token of each row: `(logits [B, V] float, key int [2]) -> ids i64 [B]`,
    /// `key = (seed, step)`. `temperature == 0`: the argmax (lowest index among equals).
    /// Otherwise, with `z = logits / temperature` and `w = exp(z - max z)`: `top_k > 0` keeps
    /// `i` iff fewer than `top_k` tokens have `z_j > z_i`; `top_p < 1` then keeps `i` iff the
    /// kept tokens with `z_j > z_i` hold less than `top_p` of the kept mass; the token is the
    /// first kept `i` (index order) whose running kept sum of `w` passes `u * total`, with `u`
    /// in [0, 1) from a counter-based hash of (seed, step, row) (`cpu::decode::uniform`), so a
    /// replayed step with another `key` draws anew and the same key draws the same.
    Sample { temperature: f64, top_k: usize, top_p: f64 },
    /// A collective of data-parallel training over `world` ranks, run by rank `rank` (see
    /// [`CollectiveOp`] for each one's rule; float operands only). Every rank's trace holds the
    /// same collectives in the same order. Inserted after autodiff (`passes::data_parallel`):
    /// no VJP. A single trace cannot run one alone: the CPU runs them through
    /// `testing::simulate`, which runs every rank's trace in lockstep.
    Collective { op: CollectiveOp, world: usize, rank: usize },
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 11] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Sigmoid,
        UnaryOp::Silu,
        UnaryOp::Tanh,
        UnaryOp::Abs,
        UnaryOp::Recip,
        UnaryOp::Square,
    ];
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Silu => "silu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Abs => "abs",
            UnaryOp::Recip => "recip",
            UnaryOp::Square => "square",
        }
    }
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 6] =
        [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Maximum, BinaryOp::Minimum];
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

impl CmpOp {
    pub const ALL: [CmpOp; 6] = [CmpOp::Eq, CmpOp::Ne, CmpOp::Lt, CmpOp::Le, CmpOp::Gt, CmpOp::Ge];
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "amax",
            ReduceOp::Mean => "mean",
            ReduceOp::SumSquares => "sum_squares",
        }
    }
}

impl Op {
    /// The op's name: used by the text form, error messages, and kernel names.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Full { .. } => "full",
            Op::Unary(u) => u.name(),
            Op::PowScalar { .. } => "pow_scalar",
            Op::AddScalar { .. } => "add_scalar",
            Op::MulScalar { .. } => "mul_scalar",
            Op::Cast { .. } => "cast",
            Op::Binary(b) => b.name(),
            Op::Compare(c) => c.name(),
            Op::Where => "where",
            Op::Reduce { op, .. } => op.name(),
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Broadcast { .. } => "broadcast",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Gather => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Matmul { .. } => "matmul",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormBackward { .. } => "rms_norm_backward",
            Op::Rope { .. } => "rope",
            Op::Softmax => "softmax",
            Op::SoftmaxBackward => "softmax_backward",
            Op::LogSoftmax => "log_softmax",
            Op::LogSoftmaxBackward => "log_softmax_backward",
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Op::LinearCrossEntropy { .. } => "linear_cross_entropy",
            Op::LinearCrossEntropyBackward { .. } => "linear_cross_entropy_backward",
            Op::LinearCrossEntropyGrad { .. } => "linear_cross_entropy_grad",
            Op::Swiglu => "swiglu",
            Op::SwigluBackward => "swiglu_backward",
            Op::SwigluPacked => "swiglu_packed",
            Op::SwigluPackedBackward => "swiglu_packed_backward",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::Fused(_) => "fused",
            Op::RopeAt { .. } => "rope_at",
            Op::CacheWrite { .. } => "cache_write",
            Op::CacheWriteKv { .. } => "cache_write_kv",
            Op::AttentionCached { .. } => "attention_cached",
            Op::Sample { .. } => "sample",
            Op::MatmulPre { .. } => "matmul_pre",
            Op::Collective { op, .. } => op.name(),
        }
    }

    /// Number of operands, or `None` for variadic ops (`concat`, one or more).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Full { .. } => 0,
            Op::MatmulPre { pre, acc, outs } => pre.operands() + outs * (1 + acc.operands()),
            Op::SwigluPacked => 1,
            Op::SwigluPackedBackward => 2,
            Op::Unary(_)
            | Op::PowScalar { .. }
            | Op::AddScalar { .. }
            | Op::MulScalar { .. }
            | Op::Cast { .. }
            | Op::Collective { .. }
            | Op::Reduce { .. }
            | Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Broadcast { .. }
            | Op::Slice { .. }
            | Op::Rope { .. }
            | Op::Softmax
            | Op::LogSoftmax => 1,
            Op::Binary(_)
            | Op::Compare(_)
            | Op::Gather
            | Op::ScatterAdd { .. }
            | Op::Matmul { acc: super::Addend::None, .. }
            | Op::RmsNorm { .. }
            | Op::SoftmaxBackward
            | Op::LogSoftmaxBackward
            | Op::CrossEntropy { .. }
            | Op::RopeAt { .. }
            | Op::Sample { .. }
            | Op::Swiglu => 2,
            Op::Where
            | Op::RmsNormBackward { acc: false, .. }
            | Op::CrossEntropyBackward { .. }
            | Op::SwigluBackward
            | Op::LinearCrossEntropy { .. }
            | Op::CacheWrite { .. }
            | Op::Matmul { acc: super::Addend::Full | super::Addend::Row, .. }
            | Op::Attention { .. } => 3,
            Op::AttentionCached { .. } | Op::LinearCrossEntropyGrad { .. } | Op::RmsNormBackward { acc: true, .. } => 4,
            Op::LinearCrossEntropyBackward { .. } | Op::CacheWriteKv { .. } => 5,
            Op::AttentionBackward { .. } => 6,
            Op::Concat { .. } | Op::Fused(_) => return None,
        })
    }

    /// True for ops that map each output element to the same-index elements of their
    /// operands (candidates for elementwise fusion and for writing in place): the ops of
    /// [`elementwise_ops!`](crate::elementwise_ops).
    pub fn is_elementwise(&self) -> bool {
        matches!(self, crate::elementwise_ops!())
    }

    /// True if result `out` may be computed over operand `i` (same buffer): pointwise ops any
    /// result over any operand of its shape, `cache_write` over its cache (operand 0) only,
    /// `cache_write_kv` each result over its own cache (result `j` over operand `j`), a
    /// matmul with an addend of its type (`acc=true`, never a row) over it (operand 2) where no
    /// other operand shares its bytes, an
    /// `rms_norm_backward` with `acc` (its `dx`, result 0) over its addend (operand 3) likewise,
    /// an `all_reduce` over its operand (NCCL's in-place form).
    /// The planner does so when the operand dies at this node; kernels must allow it.
    pub fn may_overwrite(&self, out: usize, i: usize) -> bool {
        match self {
            Op::CacheWrite { .. } => i == 0,
            Op::CacheWriteKv { .. } => i == out,
            Op::Collective { op: CollectiveOp::AllReduce, .. } => i == 0,
            Op::Matmul { acc, .. } => *acc == super::Addend::Full && i == 2,
            Op::MatmulPre { pre, acc, outs } => *acc == super::Addend::Full && *outs == 1 && i == pre.operands() + 1,
            Op::RmsNormBackward { acc, .. } => *acc && out == 0 && i == 3,
            op => op.is_elementwise() || matches!(op, Op::Fused(_)),
        }
    }

    /// Bytes of scratch memory a backend may use while running this op (planned as a temporary
    /// live during the node). Only the chunked ops need any.
    pub fn scratch_bytes(&self, args: &[&TensorType]) -> usize {
        match self {
            // One chunk of logits in the statistics dtype, per-row losses (8 bytes) and flags
            // (4 bytes); the backward holds the chunk's logits and their gradient (in the
            // operands' dtype, as the matmuls after it read it), and a count; the fused
            // gradient all of these and each row's log-sum-exp. Each piece 256-byte aligned, in
            // this order (the CUDA recipe lays it out so).
            Op::LinearCrossEntropy { chunk, .. }
            | Op::LinearCrossEntropyBackward { chunk, .. }
            | Op::LinearCrossEntropyGrad { chunk, .. } => {
                let a = |n: usize| n.div_ceil(256) * 256;
                let (n, v) = (args[0].dims()[0], args[1].dims()[0]);
                let (tsz, ssz) = (args[0].dtype.size_in_bytes(), stat_dtype(args[0].dtype).size_in_bytes());
                let rows = (*chunk).clamp(1, n.max(1));
                let (logits, grad) = (a(rows * v * ssz), a(rows * v * tsz));
                match self {
                    Op::LinearCrossEntropy { .. } => logits + a(n * 8) + a(n * 4),
                    Op::LinearCrossEntropyBackward { .. } => logits + grad + a(4),
                    _ => logits + grad + a(4) + a(n * 8) + a(n * 4) + a(n * ssz),
                }
            }
            // The prologue's rows, where a backend makes them before a library matmul.
            Op::MatmulPre { pre, .. } => {
                (args[0].dims()[0] * args[pre.operands()].dims()[1] * args[0].dtype.size_in_bytes()).div_ceil(256) * 256
            }
            _ => 0,
        }
    }

    /// The output types for operands of types `args`, or a message saying why they don't fit.
    /// Callers wrap the message with the op name and operand types (`Error::Op`).
    pub fn infer(&self, args: &[&TensorType]) -> Result<Vec<TensorType>, String> {
        match self.arity() {
            Some(n) if n != args.len() => return Err(format!("takes {n} operands, got {}", args.len())),
            None if args.is_empty() && !matches!(self, Op::Fused(_)) => {
                return Err("takes at least one operand".into());
            }
            _ => {}
        }
        let one = |t: TensorType| Ok(vec![t]);
        match self {
            Op::Fused(body) => body.infer(args),
            Op::Full { ty, .. } => one(ty.clone()),
            Op::Unary(_) | Op::PowScalar { .. } | Op::AddScalar { .. } | Op::MulScalar { .. } => {
                float(args[0])?;
                one(args[0].clone())
            }
            Op::Cast { to } => one(args[0].with_dtype(*to)),
            Op::Binary(_) => {
                same_type(args[0], args[1])?;
                if args[0].dtype == DType::Bool {
                    return Err("arithmetic on bool; cast first".into());
                }
                one(args[0].clone())
            }
            Op::Compare(_) => {
                same_type(args[0], args[1])?;
                one(args[0].with_dtype(DType::Bool))
            }
            Op::Where => {
                if args[0].dtype != DType::Bool {
                    return Err(format!("condition must be bool, got {}", args[0].dtype));
                }
                same_type(args[1], args[2])?;
                if args[0].shape != args[1].shape {
                    return Err(format!("condition shape {} differs from {}", args[0].shape, args[1].shape));
                }
                one(args[1].clone())
            }
            Op::Reduce { op, axes, keepdim } => {
                let x = args[0];
                if axes.is_empty() {
                    return Err("no axes to reduce".into());
                }
                if axes.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(format!("axes {axes:?} must be sorted and unique"));
                }
                if let Some(&a) = axes.iter().find(|&&a| a >= x.rank()) {
                    return Err(format!("axis {a} out of range for rank {}", x.rank()));
                }
                match op {
                    ReduceOp::Sum | ReduceOp::Mean | ReduceOp::SumSquares => float(x)?,
                    ReduceOp::Max if x.dtype == DType::Bool => return Err("amax of bool".into()),
                    ReduceOp::Max => {}
                }
                let dims: Vec<usize> = x
                    .dims()
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &d)| match (axes.contains(&i), keepdim) {
                        (false, _) => Some(d),
                        (true, true) => Some(1),
                        (true, false) => None,
                    })
                    .collect();
                one(x.with_shape(dims))
            }
            Op::Reshape { shape } => {
                if shape.numel() != args[0].numel() {
                    return Err(format!(
                        "cannot reshape {} ({} elements) to {} ({} elements)",
                        args[0].shape,
                        args[0].numel(),
                        shape,
                        shape.numel()
                    ));
                }
                one(args[0].with_shape(shape.clone()))
            }
            Op::Permute { perm } => {
                let x = args[0];
                let mut seen = vec![false; x.rank()];
                if perm.len() != x.rank()
                    || perm.iter().any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true))
                {
                    return Err(format!("{perm:?} is not a permutation of the {} axes", x.rank()));
                }
                one(x.with_shape(perm.iter().map(|&p| x.dims()[p]).collect::<Vec<_>>()))
            }
            Op::Broadcast { shape } => {
                let x = args[0];
                if x.rank() > shape.rank() {
                    return Err(format!("cannot broadcast {} to lower rank {}", x.shape, shape));
                }
                let off = shape.rank() - x.rank();
                for (i, &d) in x.dims().iter().enumerate() {
                    if d != 1 && d != shape.dims()[off + i] {
                        return Err(format!("cannot broadcast {} to {}: dim {i} is {d}", x.shape, shape));
                    }
                }
                one(x.with_shape(shape.clone()))
            }
            Op::Slice { axis, start, end } => {
                let x = args[0];
                if *axis >= x.rank() {
                    return Err(format!("axis {axis} out of range for rank {}", x.rank()));
                }
                let d = x.dims()[*axis];
                if start >= end || *end > d {
                    return Err(format!("range {start}..{end} is empty or outside 0..{d} on axis {axis}"));
                }
                let mut dims = x.dims().to_vec();
                dims[*axis] = end - start;
                one(x.with_shape(dims))
            }
            Op::Concat { axis } => {
                let x = args[0];
                if *axis >= x.rank() {
                    return Err(format!("axis {axis} out of range for rank {}", x.rank()));
                }
                let mut total = 0;
                for a in args {
                    if a.dtype != x.dtype || a.rank() != x.rank() {
                        return Err(format!("operands differ: {x} vs {a}"));
                    }
                    for i in 0..x.rank() {
                        if i != *axis && a.dims()[i] != x.dims()[i] {
                            return Err(format!("operands differ off axis {axis}: {x} vs {a}"));
                        }
                    }
                    total += a.dims()[*axis];
                }
                let mut dims = x.dims().to_vec();
                dims[*axis] = total;
                one(x.with_shape(dims))
            }
            Op::Gather => {
                let (table, ids) = (args[0], args[1]);
                float(table)?;
                if table.rank() != 2 {
                    return Err(format!("table must be [V, D], got {}", table.shape));
                }
                int(ids)?;
                let mut dims = ids.dims().to_vec();
                dims.push(table.dims()[1]);
                one(table.with_shape(dims))
            }
            Op::ScatterAdd { rows } => {
                let (ids, src) = (args[0], args[1]);
                int(ids)?;
                float(src)?;
                if src.rank() != ids.rank() + 1 || src.dims()[..ids.rank()] != *ids.dims() {
                    return Err(format!("src {} must be ids' shape {} plus one trailing dim", src.shape, ids.shape));
                }
                one(src.with_shape([*rows, src.shape.last()]))
            }
            Op::Matmul { ta, tb, out, acc } => {
                let (a, b) = (args[0], args[1]);
                float(a)?;
                if let Some(o) = out
                    && (!o.is_float() || o.size_in_bytes() < a.dtype.size_in_bytes())
                {
                    return Err(format!("out={o} must be a float at least as wide as {}", a.dtype));
                }
                if a.dtype != b.dtype {
                    return Err(format!("dtypes differ: {} vs {}", a.dtype, b.dtype));
                }
                if a.rank() < 2 || a.rank() != b.rank() {
                    return Err("operands must have the same rank, at least 2".into());
                }
                let r = a.rank();
                if a.dims()[..r - 2] != b.dims()[..r - 2] {
                    return Err("batch dims differ".into());
                }
                let (m, ka) = if *ta { (a.dims()[r - 1], a.dims()[r - 2]) } else { (a.dims()[r - 2], a.dims()[r - 1]) };
                let (kb, n) = if *tb { (b.dims()[r - 1], b.dims()[r - 2]) } else { (b.dims()[r - 2], b.dims()[r - 1]) };
                if ka != kb {
                    return Err(format!("inner dims differ: {ka} vs {kb}"));
                }
                let mut dims = a.dims()[..r - 2].to_vec();
                dims.extend([m, n]);
                let res = TensorType::new(out.unwrap_or(a.dtype), dims);
                if acc.is_some() {
                    acc.check(args[2], &res)?;
                }
                one(res)
            }
            Op::RmsNorm { .. } => {
                let (x, w) = (args[0], args[1]);
                norm_operands(x, w)?;
                one(x.clone())
            }
            Op::RmsNormBackward { acc, .. } => {
                let (x, w, dy) = (args[0], args[1], args[2]);
                norm_operands(x, w)?;
                same_type(x, dy)?;
                if *acc {
                    same_type(x, args[3])?;
                }
                Ok(vec![x.clone(), w.clone()])
            }
            Op::Rope { layout, .. } => {
                rope_operand(args[0], *layout)?;
                one(args[0].clone())
            }
            Op::Softmax | Op::LogSoftmax => {
                float(args[0])?;
                if args[0].rank() == 0 {
                    return Err("needs at least one axis".into());
                }
                one(args[0].clone())
            }
            Op::SoftmaxBackward | Op::LogSoftmaxBackward | Op::Swiglu => {
                float(args[0])?;
                same_type(args[0], args[1])?;
                one(args[0].clone())
            }
            Op::SwigluPacked | Op::SwigluPackedBackward => {
                let x = args[0];
                float(x)?;
                if x.rank() == 0 || !x.shape.last().is_multiple_of(2) {
                    return Err(format!("needs [..., 2F] (gate and up side by side), got {}", x.shape));
                }
                let mut half = x.dims().to_vec();
                *half.last_mut().unwrap() /= 2;
                let y = x.with_shape(half);
                if matches!(self, Op::SwigluPacked) {
                    return one(y);
                }
                if *args[1] != y {
                    return Err(format!("dy must be {y}, got {}", args[1]));
                }
                one(x.clone())
            }
            Op::SwigluBackward => {
                float(args[0])?;
                same_type(args[0], args[1])?;
                same_type(args[0], args[2])?;
                Ok(vec![args[0].clone(), args[1].clone()])
            }
            Op::CrossEntropy { .. } => {
                ce_operands(args[0], args[1])?;
                one(TensorType::scalar(stat_dtype(args[0].dtype)))
            }
            Op::CrossEntropyBackward { .. } => {
                ce_operands(args[0], args[1])?;
                let want = TensorType::scalar(stat_dtype(args[0].dtype));
                if *args[2] != want {
                    return Err(format!("dloss must be {want}, got {}", args[2]));
                }
                one(args[0].clone())
            }
            Op::LinearCrossEntropy { chunk, .. } => {
                let lse = linear_ce_operands(args[0], args[1], args[2], *chunk)?;
                Ok(vec![TensorType::scalar(lse.dtype), lse])
            }
            Op::LinearCrossEntropyBackward { chunk, .. } => {
                let lse = linear_ce_operands(args[0], args[1], args[2], *chunk)?;
                if *args[3] != lse {
                    return Err(format!("lse must be {lse} (each row's log-sum-exp, [N]), got {}", args[3]));
                }
                let want = TensorType::scalar(lse.dtype);
                if *args[4] != want {
                    return Err(format!("dloss must be {want}, got {}", args[4]));
                }
                Ok(vec![args[0].clone(), args[1].clone()])
            }
            Op::LinearCrossEntropyGrad { chunk, .. } => {
                let lse = linear_ce_operands(args[0], args[1], args[2], *chunk)?;
                let want = TensorType::scalar(lse.dtype);
                if *args[3] != want {
                    return Err(format!("dloss must be {want}, got {}", args[3]));
                }
                Ok(vec![want, args[0].clone(), args[1].clone()])
            }
            Op::Attention { causal, layout, .. } => {
                let lse = attention_operands(args[0], args[1], args[2], *causal, *layout)?;
                Ok(vec![args[0].clone(), lse])
            }
            Op::AttentionBackward { causal, layout, .. } => {
                let (q, k, v, o, lse, dout) = (args[0], args[1], args[2], args[3], args[4], args[5]);
                let want = attention_operands(q, k, v, *causal, *layout)?;
                let (o_ok, do_ok) = (same_type(q, o), same_type(q, dout));
                if o_ok.is_err() || do_ok.is_err() {
                    return Err(format!("o {o} and do {dout} must both have q's type {q} (layout {})", layout.name()));
                }
                if *lse != want {
                    return Err(format!("lse must be {want} ([B, Hq, T]), got {lse} (layout {})", layout.name()));
                }
                Ok(vec![q.clone(), k.clone(), v.clone()])
            }
            Op::RopeAt { layout, .. } => super::decode::rope_at(args[0], args[1], *layout),
            Op::CacheWrite { rope } => super::decode::cache_write(args[0], args[1], args[2], rope.is_some()),
            Op::CacheWriteKv { rope } => super::decode::cache_write_kv(args, rope.is_some()),
            Op::AttentionCached { rope, .. } => {
                super::decode::attention_cached(args[0], args[1], args[2], args[3], rope.is_some())
            }
            Op::Sample { temperature, top_k: _, top_p } => {
                super::decode::sample(args[0], args[1], *temperature, *top_p)
            }
            Op::MatmulPre { pre, acc, outs } => super::decode::matmul_pre(*pre, args, *acc, *outs),
            Op::Collective { op, world, rank } => super::collective::infer(*op, *world, *rank, args[0]),
        }
    }
}

/// The dtype of row statistics (log-sum-exp, losses): f32, or f64 for f64 data.
pub fn stat_dtype(d: DType) -> DType {
    if d == DType::F64 { DType::F64 } else { DType::F32 }
}

pub(super) fn float(t: &TensorType) -> Result<(), String> {
    if t.dtype.is_float() { Ok(()) } else { Err(format!("needs a float dtype, got {}", t.dtype)) }
}

/// RoPE's rotated operand (`rope`, `rope_at`): a float `[B, H, T, D]` (or `[B, T, H, D]`) with D even.
pub(super) fn rope_operand(x: &TensorType, layout: HeadLayout) -> Result<(), String> {
    float(x)?;
    if x.rank() != 4 || !x.dims()[3].is_multiple_of(2) {
        return Err(format!(
            "layout {} needs {} with D even, got {}",
            layout.name(),
            layout.pattern("H", "T"),
            x.shape
        ));
    }
    Ok(())
}

pub(super) fn int(t: &TensorType) -> Result<(), String> {
    if t.dtype.is_int() { Ok(()) } else { Err(format!("indices must be i32 or i64, got {}", t.dtype)) }
}

pub(super) fn same_type(a: &TensorType, b: &TensorType) -> Result<(), String> {
    if a == b { Ok(()) } else { Err(format!("operand types differ: {a} vs {b}")) }
}

fn norm_operands(x: &TensorType, w: &TensorType) -> Result<(), String> {
    float(x)?;
    if x.rank() == 0 || w.dtype != x.dtype || w.dims() != [x.shape.last()] {
        return Err(format!("weight must be {}[{}], got {w}", x.dtype, x.shape.last()));
    }
    Ok(())
}

fn ce_operands(logits: &TensorType, targets: &TensorType) -> Result<(), String> {
    float(logits)?;
    int(targets)?;
    if logits.rank() != 2 || targets.dims() != [logits.dims()[0]] {
        return Err(format!("needs logits [N, V] and targets [N], got {} and {}", logits.shape, targets.shape));
    }
    Ok(())
}

/// Checks the fused loss's x, w and targets; returns the type of the log-sum-exp `[N]`.
fn linear_ce_operands(x: &TensorType, w: &TensorType, t: &TensorType, chunk: usize) -> Result<TensorType, String> {
    float(x)?;
    if x.dtype != w.dtype || x.rank() != 2 || w.rank() != 2 || x.dims()[1] != w.dims()[1] {
        return Err(format!("needs x [N, C] and w [V, C] of one dtype, got {x} and {w}"));
    }
    ce_operands(&x.with_shape([x.dims()[0], w.dims()[0]]), t)?;
    if chunk == 0 {
        return Err("chunk must be at least 1 row".into());
    }
    Ok(TensorType::new(stat_dtype(x.dtype), [x.dims()[0]]))
}
