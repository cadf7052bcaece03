//! The one text form of a trace: `Display` prints it, `parse` reads it back.
//!
//! ```text
//! trace block {
//!   input %0: f32[2,16,64] "x" input
//!   input %1: f32[64] "norm.weight" param
//!   %2: f32[2,16,64] = rms_norm(%0, %1) eps=1e-6
//!   -- backward
//!   %4: f32[2,16,64], %5: f32[64] = rms_norm_backward(%0, %1, %3) eps=1e-6
//!   output %2 "y"
//!   output %5 "grad.norm.weight" grad_of=%1
//! }
//! ```
//! One op a line with its output types; attributes follow as `key=value` with no spaces inside a
//! value; `-- backward` / `-- optimizer` / `-- forward` lines switch the phase of the nodes that
//! follow. Floats print in Rust's shortest round-trip form, so print-then-parse is exact.

use std::collections::HashMap;
use std::fmt::{self, Write as _};

use super::dtype::{DType, Shape, TensorType};
use super::fused::{FusedBody, FusedInstr};
use super::heads::{HeadLayout, RopeScaling};
use super::op::{BinaryOp, CmpOp, CollectiveOp, Op, ReduceOp, UnaryOp};
use super::trace::{InputRole, Node, OutputRole, Phase, Trace, TraceInput, TraceOutput, ValueId};
use crate::{Error, Result};

/// The attributes of an op as `(key, value text)` pairs, in print order.
pub fn op_attrs(op: &Op) -> Vec<(&'static str, String)> {
    let f = |x: f64| format!("{x:?}");
    let list = |l: &[usize]| Shape::new(l.to_vec()).to_string();
    match op {
        Op::Full { value, ty } => vec![("value", f(*value)), ("type", ty.to_string())],
        Op::PowScalar { exponent } => vec![("exponent", f(*exponent))],
        Op::AddScalar { value } | Op::MulScalar { value } => vec![("value", f(*value))],
        Op::Cast { to } => vec![("to", to.to_string())],
        Op::Reduce { axes, keepdim, .. } => vec![("axes", list(axes)), ("keepdim", keepdim.to_string())],
        Op::Reshape { shape } | Op::Broadcast { shape } => vec![("shape", shape.to_string())],
        Op::Permute { perm } => vec![("perm", list(perm))],
        Op::Slice { axis, start, end } => {
            vec![("axis", axis.to_string()), ("start", start.to_string()), ("end", end.to_string())]
        }
        Op::Concat { axis } => vec![("axis", axis.to_string())],
        Op::ScatterAdd { rows } => vec![("rows", rows.to_string())],
        Op::Matmul { ta, tb, out, acc } => {
            let mut a = vec![("ta", ta.to_string()), ("tb", tb.to_string())];
            a.extend(out.map(|o| ("out", o.to_string())));
            a.extend(acc.text().map(|v| ("acc", v.to_string())));
            a
        }
        Op::RmsNorm { eps } | Op::RmsNormBackward { eps, acc: false } => vec![("eps", f(*eps))],
        Op::MatmulPre { pre, acc, outs } => {
            let mut a = vec![("pre", pre.op().name().to_string())];
            if let super::Prologue::RmsNorm { eps } = pre {
                a.push(("eps", f(*eps)));
            }
            a.extend(acc.text().map(|v| ("acc", v.to_string())));
            if *outs != 1 {
                a.push(("outs", outs.to_string()));
            }
            a
        }
        Op::RmsNormBackward { eps, acc: true } => vec![("eps", f(*eps)), ("acc", "true".into())],
        Op::Rope { theta, inverse, layout, scaling } => {
            let mut a = vec![("theta", f(*theta)), ("inverse", inverse.to_string())];
            a.extend(layout_attr(*layout));
            a.extend(scaling.text().map(|s| ("scaling", s)));
            a
        }
        Op::CrossEntropy { ignore_index } | Op::CrossEntropyBackward { ignore_index } => {
            vec![("ignore_index", ignore_index.to_string())]
        }
        Op::LinearCrossEntropy { ignore_index, chunk }
        | Op::LinearCrossEntropyBackward { ignore_index, chunk }
        | Op::LinearCrossEntropyGrad { ignore_index, chunk } => {
            vec![("ignore_index", ignore_index.to_string()), ("chunk", chunk.to_string())]
        }
        Op::Attention { scale, causal, layout } | Op::AttentionBackward { scale, causal, layout } => {
            let mut a = vec![("scale", f(*scale)), ("causal", causal.to_string())];
            a.extend(layout_attr(*layout));
            a
        }
        Op::Fused(body) => vec![("shape", body.shape.to_string())],
        Op::RopeAt { theta, layout, scaling } => {
            let mut a = vec![("theta", f(*theta))];
            a.extend(layout_attr(*layout));
            a.extend(scaling.text().map(|s| ("scaling", s)));
            a
        }
        Op::AttentionCached { scale, rope } => {
            let mut a = vec![("scale", f(*scale))];
            if let Some(r) = rope {
                a.push(("theta", f(r.theta)));
                a.extend(r.scaling.text().map(|s| ("scaling", s)));
            }
            a
        }
        Op::Sample { temperature, top_k, top_p } => {
            vec![("temperature", f(*temperature)), ("top_k", top_k.to_string()), ("top_p", f(*top_p))]
        }
        Op::Collective { world, rank, .. } => vec![("world", world.to_string()), ("rank", rank.to_string())],
        Op::CacheWrite { rope } | Op::CacheWriteKv { rope } => rope.map_or_else(Vec::new, |r| {
            let mut a = vec![("theta", f(r.theta))];
            a.extend(r.scaling.text().map(|s| ("scaling", s)));
            a
        }),
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Where
        | Op::Gather
        | Op::Softmax
        | Op::SoftmaxBackward
        | Op::LogSoftmax
        | Op::LogSoftmaxBackward
        | Op::Swiglu
        | Op::SwigluBackward
        | Op::SwigluPacked
        | Op::SwigluPackedBackward => vec![],
    }
}

/// `layout=bthd`, or nothing for the default `bhtd` (so traces written before the attribute
/// existed print and parse unchanged).
fn layout_attr(layout: HeadLayout) -> Option<(&'static str, String)> {
    (layout != HeadLayout::default()).then(|| ("layout", layout.name().to_string()))
}

/// The attributes of one parsed line, read on demand by key and type.
struct Attrs<'a> {
    map: HashMap<&'a str, &'a str>,
}

impl<'a> Attrs<'a> {
    fn get(&self, key: &str) -> Result<&'a str, String> {
        self.map.get(key).copied().ok_or_else(|| format!("missing attribute `{key}`"))
    }
    fn parse<T: std::str::FromStr>(&self, key: &str) -> Result<T, String> {
        let v = self.get(key)?;
        v.parse().map_err(|_| format!("bad value `{v}` for attribute `{key}`"))
    }
    fn f64(&self, key: &str) -> Result<f64, String> {
        self.parse(key)
    }
    fn usize(&self, key: &str) -> Result<usize, String> {
        self.parse(key)
    }
    fn bool(&self, key: &str) -> Result<bool, String> {
        self.parse(key)
    }
    fn list(&self, key: &str) -> Result<Vec<usize>, String> {
        let v = self.get(key)?;
        parse_list(v).ok_or_else(|| format!("bad list `{v}` for attribute `{key}`"))
    }
    fn ty(&self, key: &str) -> Result<TensorType, String> {
        self.get(key)?.parse()
    }
    /// `scaling`, none when absent.
    fn rope_scaling(&self) -> Result<RopeScaling, String> {
        match self.map.get("scaling") {
            None => Ok(RopeScaling::None),
            Some(v) => RopeScaling::parse(v).ok_or_else(|| {
                format!("bad value `{v}` for attribute `scaling` (linear:F or llama3:F:LOW:HIGH:ORIGINAL)")
            }),
        }
    }
    /// A decoding op's `rope`: `theta` (and `scaling`) when present, none when absent.
    fn rope_new(&self) -> Result<Option<super::decode::RopeNew>, String> {
        if !self.map.contains_key("theta") {
            return Ok(None);
        }
        Ok(Some(super::decode::RopeNew { theta: self.f64("theta")?, scaling: self.rope_scaling()? }))
    }
    /// `layout`, `bhtd` when absent.
    fn layout(&self) -> Result<HeadLayout, String> {
        let Some(v) = self.map.get("layout") else {
            return Ok(HeadLayout::default());
        };
        HeadLayout::ALL.into_iter().find(|l| l.name() == *v).ok_or_else(|| {
            let names: Vec<_> = HeadLayout::ALL.iter().map(|l| l.name()).collect();
            format!("bad value `{v}` for attribute `layout` (one of {})", names.join(", "))
        })
    }
}

fn parse_list(v: &str) -> Option<Vec<usize>> {
    let inner = v.strip_prefix('[')?.strip_suffix(']')?;
    if inner.is_empty() {
        return Some(Vec::new());
    }
    inner.split(',').map(|d| d.parse().ok()).collect()
}

/// Builds the op called `name` from its attributes (the inverse of `op_attrs`).
fn op_from_text(name: &str, a: &Attrs) -> Result<Op, String> {
    if let Some(u) = UnaryOp::ALL.into_iter().find(|u| u.name() == name) {
        return Ok(Op::Unary(u));
    }
    if let Some(b) = BinaryOp::ALL.into_iter().find(|b| b.name() == name) {
        return Ok(Op::Binary(b));
    }
    if let Some(c) = CmpOp::ALL.into_iter().find(|c| c.name() == name) {
        return Ok(Op::Compare(c));
    }
    let reduce =
        |op| -> Result<Op, String> { Ok(Op::Reduce { op, axes: a.list("axes")?, keepdim: a.bool("keepdim")? }) };
    Ok(match name {
        "full" => Op::Full { value: a.f64("value")?, ty: a.ty("type")? },
        "pow_scalar" => Op::PowScalar { exponent: a.f64("exponent")? },
        "add_scalar" => Op::AddScalar { value: a.f64("value")? },
        "mul_scalar" => Op::MulScalar { value: a.f64("value")? },
        "cast" => Op::Cast { to: a.get("to")?.parse::<DType>()? },
        "where" => Op::Where,
        "sum" => reduce(ReduceOp::Sum)?,
        "amax" => reduce(ReduceOp::Max)?,
        "mean" => reduce(ReduceOp::Mean)?,
        "sum_squares" => reduce(ReduceOp::SumSquares)?,
        "reshape" => Op::Reshape { shape: Shape::new(a.list("shape")?) },
        "broadcast" => Op::Broadcast { shape: Shape::new(a.list("shape")?) },
        "permute" => Op::Permute { perm: a.list("perm")? },
        "slice" => Op::Slice { axis: a.usize("axis")?, start: a.usize("start")?, end: a.usize("end")? },
        "concat" => Op::Concat { axis: a.usize("axis")? },
        "gather" => Op::Gather,
        "scatter_add" => Op::ScatterAdd { rows: a.usize("rows")? },
        "matmul" => Op::Matmul {
            ta: a.bool("ta")?,
            tb: a.bool("tb")?,
            out: a.map.get("out").map(|v| v.parse::<DType>()).transpose()?,
            acc: a.map.get("acc").map_or(Ok(super::Addend::None), |v| super::Addend::parse(v))?,
        },
        "rms_norm" => Op::RmsNorm { eps: a.f64("eps")? },
        "matmul_pre" => Op::MatmulPre {
            pre: match a.get("pre")? {
                "rms_norm" => super::Prologue::RmsNorm { eps: a.f64("eps")? },
                "swiglu_packed" => super::Prologue::SwigluPacked,
                v => return Err(format!("bad value `{v}` for attribute `pre` (rms_norm or swiglu_packed)")),
            },
            acc: a.map.get("acc").map_or(Ok(super::Addend::None), |v| super::Addend::parse(v))?,
            outs: if a.map.contains_key("outs") { a.usize("outs")? } else { 1 },
        },
        "rms_norm_backward" => {
            Op::RmsNormBackward { eps: a.f64("eps")?, acc: a.map.contains_key("acc") && a.bool("acc")? }
        }
        "rope" => Op::Rope {
            theta: a.f64("theta")?,
            inverse: a.bool("inverse")?,
            layout: a.layout()?,
            scaling: a.rope_scaling()?,
        },
        "softmax" => Op::Softmax,
        "softmax_backward" => Op::SoftmaxBackward,
        "log_softmax" => Op::LogSoftmax,
        "log_softmax_backward" => Op::LogSoftmaxBackward,
        "cross_entropy" => Op::CrossEntropy { ignore_index: a.parse("ignore_index")? },
        "cross_entropy_backward" => Op::CrossEntropyBackward { ignore_index: a.parse("ignore_index")? },
        "linear_cross_entropy" => {
            Op::LinearCrossEntropy { ignore_index: a.parse("ignore_index")?, chunk: a.usize("chunk")? }
        }
        "linear_cross_entropy_backward" => {
            Op::LinearCrossEntropyBackward { ignore_index: a.parse("ignore_index")?, chunk: a.usize("chunk")? }
        }
        "linear_cross_entropy_grad" => {
            Op::LinearCrossEntropyGrad { ignore_index: a.parse("ignore_index")?, chunk: a.usize("chunk")? }
        }
        "swiglu" => Op::Swiglu,
        "swiglu_backward" => Op::SwigluBackward,
        "swiglu_packed" => Op::SwigluPacked,
        "swiglu_packed_backward" => Op::SwigluPackedBackward,
        "attention" => Op::Attention { scale: a.f64("scale")?, causal: a.bool("causal")?, layout: a.layout()? },
        "attention_backward" => {
            Op::AttentionBackward { scale: a.f64("scale")?, causal: a.bool("causal")?, layout: a.layout()? }
        }
        "rope_at" => Op::RopeAt { theta: a.f64("theta")?, layout: a.layout()?, scaling: a.rope_scaling()? },
        "cache_write" => Op::CacheWrite { rope: a.rope_new()? },
        "cache_write_kv" => Op::CacheWriteKv { rope: a.rope_new()? },
        "attention_cached" => Op::AttentionCached { scale: a.f64("scale")?, rope: a.rope_new()? },
        "sample" => Op::Sample { temperature: a.f64("temperature")?, top_k: a.usize("top_k")?, top_p: a.f64("top_p")? },
        "all_reduce" | "reduce_scatter" | "all_gather" => Op::Collective {
            op: CollectiveOp::ALL.into_iter().find(|c| c.name() == name).unwrap_or(CollectiveOp::AllReduce),
            world: a.usize("world")?,
            rank: a.usize("rank")?,
        },
        // The body follows on the next lines; `Parser` fills it in.
        "fused" => Op::Fused(Box::new(FusedBody {
            shape: Shape::new(a.list("shape")?),
            inputs: Vec::new(),
            body: Vec::new(),
            outputs: Vec::new(),
        })),
        _ => return Err(format!("unknown op `{name}`")),
    })
}

fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

impl Trace {
    /// One node in the text form, with its output types.
    pub fn node_text(&self, node: &Node) -> String {
        let mut s = String::new();
        for (i, o) in node.outs.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "{o}: {}", self.ty(*o));
        }
        let args: Vec<String> = node.args.iter().map(|a| a.to_string()).collect();
        let _ = write!(s, " = {}({})", node.op.name(), args.join(", "));
        for (k, v) in op_attrs(&node.op) {
            let _ = write!(s, " {k}={v}");
        }
        if let Op::Fused(body) = &node.op {
            s.push_str(" {\n");
            for (i, ins) in body.body.iter().enumerate() {
                let args: Vec<String> = ins.args.iter().map(|a| format!("${a}")).collect();
                let _ =
                    write!(s, "    ${}: {} = {}({})", body.inputs.len() + i, ins.dtype, ins.op.name(), args.join(", "));
                for (k, v) in op_attrs(&ins.op) {
                    let _ = write!(s, " {k}={v}");
                }
                s.push('\n');
            }
            let outs: Vec<String> = body.outputs.iter().map(|o| format!("${o}")).collect();
            let _ = write!(s, "    return {}\n  }}", outs.join(", "));
        }
        s
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "trace {} {{", quote(&self.name))?;
        for inp in &self.inputs {
            writeln!(f, "  input {}: {} {} {}", inp.value, self.ty(inp.value), quote(&inp.name), inp.role.name())?;
        }
        let mut phase = Phase::Forward;
        for node in &self.nodes {
            if node.phase != phase {
                phase = node.phase;
                writeln!(f, "  -- {}", phase.name())?;
            }
            writeln!(f, "  {}", self.node_text(node))?;
        }
        for out in &self.outputs {
            write!(f, "  output {} {}", out.value, quote(&out.name))?;
            match out.role {
                OutputRole::Output => {}
                OutputRole::Grad { of } => write!(f, " grad_of={of}")?,
                OutputRole::Update { of } => write!(f, " update_of={of}")?,
                OutputRole::Saved => write!(f, " saved")?,
            }
            writeln!(f)?;
        }
        writeln!(f, "}}")
    }
}

/// Reads a trace from its text form, verifies it and numbers its values compactly.
pub fn parse(text: &str) -> Result<Trace> {
    let mut p =
        Parser { trace: Trace::default(), ids: HashMap::new(), phase: Phase::Forward, saw_header: false, fused: None };
    let mut closed = false;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        let err = |msg: String| Error::Parse { line: i + 1, text: raw.to_string(), msg };
        if closed {
            return Err(err("text after the closing `}`".into()));
        }
        if line == "}" && p.fused.is_none() {
            closed = true;
            continue;
        }
        p.line(line).map_err(err)?;
    }
    if !p.saw_header {
        return Err(Error::Parse { line: 1, text: String::new(), msg: "no `trace NAME {` header".into() });
    }
    if p.fused.is_some() {
        return Err(Error::Parse {
            line: text.lines().count(),
            text: String::new(),
            msg: "unclosed fused body".into(),
        });
    }
    if !closed {
        return Err(Error::Parse {
            line: text.lines().count(),
            text: String::new(),
            msg: "missing closing `}`".into(),
        });
    }
    let mut trace = p.trace;
    crate::ir::verify(&trace)?;
    trace.compact()?;
    Ok(trace)
}

struct Parser {
    trace: Trace,
    ids: HashMap<u32, ValueId>,
    phase: Phase,
    saw_header: bool,
    /// The fused node whose body is being read, if any.
    fused: Option<FusedBody>,
}

impl Parser {
    fn line(&mut self, line: &str) -> Result<(), String> {
        if let Some(body) = &mut self.fused {
            return body_line(body, line).map(|done| {
                if done {
                    let body = self.fused.take().expect("checked above");
                    self.trace.nodes.last_mut().expect("a fused node precedes its body").op = Op::Fused(Box::new(body));
                }
            });
        }
        if !self.saw_header {
            let rest = line.strip_prefix("trace ").ok_or("expected `trace NAME {`")?;
            let rest = rest.strip_suffix('{').ok_or("expected `{` at the end of the header")?.trim();
            let (name, tail) = read_string(rest)?;
            if !tail.trim().is_empty() {
                return Err(format!("unexpected `{tail}` after the trace name"));
            }
            self.trace.name = name;
            self.saw_header = true;
            return Ok(());
        }
        if let Some(p) = line.strip_prefix("-- ") {
            self.phase = match p.trim() {
                "forward" => Phase::Forward,
                "backward" => Phase::Backward,
                "optimizer" => Phase::Optimizer,
                other => return Err(format!("unknown phase `{other}`")),
            };
            return Ok(());
        }
        if let Some(rest) = line.strip_prefix("input ") {
            // %0: f32[2,3] "name" role
            let (decl, rest) = rest.split_once(' ').ok_or("expected `input %N: TYPE \"name\" role`")?;
            let (id, ty) = self.decl(decl, rest)?;
            let ty_len = ty.len();
            let ty: TensorType = ty.parse()?;
            let rest = rest[ty_len..].trim();
            let (name, role) = read_string(rest)?;
            let role = role.trim();
            let role = InputRole::ALL
                .into_iter()
                .find(|r| r.name() == role)
                .ok_or_else(|| format!("unknown input role `{role}`"))?;
            let value = self.define(id, ty)?;
            self.trace.inputs.push(TraceInput { value, name, role });
            return Ok(());
        }
        if let Some(rest) = line.strip_prefix("output ") {
            let (v, rest) = rest.split_once(' ').ok_or("expected `output %N \"name\"`")?;
            let value = self.use_(v)?;
            let (name, tail) = read_string(rest.trim())?;
            let tail = tail.trim();
            let role = if tail.is_empty() {
                OutputRole::Output
            } else if tail == "saved" {
                OutputRole::Saved
            } else if let Some(of) = tail.strip_prefix("grad_of=") {
                OutputRole::Grad { of: self.use_(of)? }
            } else if let Some(of) = tail.strip_prefix("update_of=") {
                OutputRole::Update { of: self.use_(of)? }
            } else {
                return Err(format!("unknown output role `{tail}`"));
            };
            self.trace.outputs.push(TraceOutput { value, name, role });
            return Ok(());
        }
        // %4: f32[2,3], %5: f32[3] = op(%1, %2) key=value ...
        let (lhs, rhs) = line.split_once(" = ").ok_or("expected `%N: TYPE = op(...)`")?;
        let open = rhs.find('(').ok_or("expected `op(`")?;
        let close = rhs.find(')').ok_or("expected `)` after the operands")?;
        let name = rhs[..open].trim();
        let args_text = rhs[open + 1..close].trim();
        let args = if args_text.is_empty() {
            Vec::new()
        } else {
            args_text.split(',').map(|a| self.use_(a.trim())).collect::<Result<Vec<_>, _>>()?
        };
        let mut map = HashMap::new();
        let mut attrs = rhs[close + 1..].trim();
        let opens_body = attrs.ends_with('{');
        if opens_body {
            attrs = attrs[..attrs.len() - 1].trim();
            if name != "fused" {
                return Err(format!("only `fused` has a body, not `{name}`"));
            }
        } else if name == "fused" {
            return Err("`fused` needs a body: `... {`".into());
        }
        for kv in attrs.split_whitespace() {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("attribute `{kv}` is not key=value"))?;
            if map.insert(k, v).is_some() {
                return Err(format!("attribute `{k}` given twice"));
            }
        }
        let op = op_from_text(name, &Attrs { map })?;
        let mut outs = Vec::new();
        for decl in split_top_level(lhs) {
            let decl = decl.trim();
            let (id, ty) = decl.split_once(':').ok_or_else(|| format!("output `{decl}` lacks `: TYPE`"))?;
            let ty: TensorType = ty.trim().parse()?;
            outs.push(self.define(id.trim(), ty)?);
        }
        if opens_body {
            let inputs = args.iter().map(|a| self.trace.ty(*a).clone()).collect();
            self.fused = Some(FusedBody {
                shape: Shape::new(map_list(&attrs_of(attrs), "shape")?),
                inputs,
                body: Vec::new(),
                outputs: Vec::new(),
            });
        }
        self.trace.nodes.push(Node { op, args, outs, phase: self.phase });
        Ok(())
    }

    /// Splits `%3: f32[2,3]` from an `input` line into the id and the type text.
    fn decl<'b>(&self, decl: &'b str, rest: &'b str) -> Result<(&'b str, &'b str), String> {
        let id = decl.strip_suffix(':').ok_or_else(|| format!("expected `%N:`, got `{decl}`"))?;
        let ty = rest.split_whitespace().next().ok_or("missing type")?;
        Ok((id, ty))
    }

    fn number(v: &str) -> Result<u32, String> {
        v.strip_prefix('%').and_then(|n| n.parse().ok()).ok_or_else(|| format!("expected a value like `%3`, got `{v}`"))
    }

    fn define(&mut self, v: &str, ty: TensorType) -> Result<ValueId, String> {
        let n = Self::number(v)?;
        if self.ids.contains_key(&n) {
            return Err(format!("{v} is defined twice"));
        }
        let id = self.trace.new_value(ty);
        self.ids.insert(n, id);
        Ok(id)
    }

    fn use_(&self, v: &str) -> Result<ValueId, String> {
        let n = Self::number(v)?;
        self.ids.get(&n).copied().ok_or_else(|| format!("{v} is used before it is defined"))
    }
}

fn attrs_of(text: &str) -> HashMap<&str, &str> {
    text.split_whitespace().filter_map(|kv| kv.split_once('=')).collect()
}

fn map_list(map: &HashMap<&str, &str>, key: &str) -> Result<Vec<usize>, String> {
    Attrs { map: map.clone() }.list(key)
}

/// Reads one line of a fused body (`$3: f32 = exp($2)` or `return $3`); true at its closing `}`.
fn body_line(body: &mut FusedBody, line: &str) -> Result<bool, String> {
    if line == "}" {
        if body.outputs.is_empty() {
            return Err("fused body without `return`".into());
        }
        return Ok(true);
    }
    let dollar = |v: &str| -> Result<usize, String> {
        v.trim().strip_prefix('$').and_then(|n| n.parse().ok()).ok_or_else(|| format!("expected `$N`, got `{v}`"))
    };
    if let Some(rest) = line.strip_prefix("return ") {
        body.outputs = rest.split(',').map(dollar).collect::<Result<_, _>>()?;
        return Ok(false);
    }
    let (lhs, rhs) = line.split_once(" = ").ok_or("expected `$N: DTYPE = op(...)` in a fused body")?;
    let (id, dtype) = lhs.split_once(':').ok_or("expected `$N: DTYPE`")?;
    if dollar(id)? != body.inputs.len() + body.body.len() {
        return Err(format!("body values must be numbered in order, got `{id}`"));
    }
    let dtype: DType = dtype.trim().parse()?;
    let open = rhs.find('(').ok_or("expected `op(`")?;
    let close = rhs.find(')').ok_or("expected `)`")?;
    let args_text = rhs[open + 1..close].trim();
    let args =
        if args_text.is_empty() { Vec::new() } else { args_text.split(',').map(dollar).collect::<Result<_, _>>()? };
    let op = op_from_text(rhs[..open].trim(), &Attrs { map: attrs_of(&rhs[close + 1..]) })?;
    body.body.push(FusedInstr { op, args, dtype });
    Ok(false)
}

/// Reads a leading `"..."` string; returns it and the rest of the line.
fn read_string(s: &str) -> Result<(String, &str), String> {
    let mut chars = s.char_indices();
    if chars.next().map(|c| c.1) != Some('"') {
        return Err(format!("expected a quoted name, got `{s}`"));
    }
    let mut out = String::new();
    let mut escaped = false;
    for (i, c) in chars {
        match (escaped, c) {
            (true, 'n') => {
                out.push('\n');
                escaped = false
            }
            (true, c) => {
                out.push(c);
                escaped = false
            }
            (false, '\\') => escaped = true,
            (false, '"') => return Ok((out, &s[i + 1..])),
            (false, c) => out.push(c),
        }
    }
    Err(format!("unterminated string `{s}`"))
}

/// Splits on commas that are not inside `[...]`.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}
