//! A trace: SSA values of static type, a list of nodes in execution order, named inputs and
//! outputs with roles.
//!
//! **Invariant**: every value is defined once, by an input or by one node's output, before any
//! use. `Trace::compact` numbers values in definition order; traces made by the builder, the
//! parser and every pass are compact, so equal programs compare equal.

use std::collections::HashMap;
use std::fmt;

use super::dtype::TensorType;
use super::op::Op;

/// An SSA value, printed `%7`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Which part of a training step a node belongs to. The planner uses it to class buffers
/// (a forward value read in the backward is saved-for-backward).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Phase {
    #[default]
    Forward,
    Backward,
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// What a trace input holds; the planner and executors treat each kind differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputRole {
    /// Data fed each step (token ids, targets, scalars such as a learning rate).
    Input,
    /// A model parameter: persistent, updated in place by the optimizer.
    Param,
    /// Optimizer state (momentum, Adam moments): persistent.
    OptState,
    /// A value the forward saved for the backward (inputs of a split backward trace).
    Saved,
    /// An incoming cotangent (inputs of a split backward trace).
    Cotangent,
    /// Persistent state that is not a parameter (a KV cache): kept between runs like a
    /// parameter, rewritten by its `Update` output.
    State,
}

impl InputRole {
    pub const ALL: [InputRole; 6] = [
        InputRole::Input,
        InputRole::Param,
        InputRole::OptState,
        InputRole::Saved,
        InputRole::Cotangent,
        InputRole::State,
    ];
    pub fn name(self) -> &'static str {
        match self {
            InputRole::Input => "input",
            InputRole::Param => "param",
            InputRole::OptState => "opt_state",
            InputRole::Saved => "saved",
            InputRole::Cotangent => "cotangent",
            InputRole::State => "state",
        }
    }
    /// Lives across steps (outside the transient arena).
    pub fn is_persistent(self) -> bool {
        matches!(self, InputRole::Param | InputRole::OptState | InputRole::State)
    }
}

/// What a trace output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputRole {
    /// A plain result (a loss, logits).
    Output,
    /// The gradient of the input `of`.
    Grad { of: ValueId },
    /// The new value of the persistent input `of` (a parameter or optimizer state after the
    /// step). Executors write it back to the input's buffer; the planner may compute it there
    /// directly.
    Update { of: ValueId },
    /// A forward value that a split backward trace reads.
    Saved,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TraceInput {
    pub value: ValueId,
    pub name: String,
    pub role: InputRole,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TraceOutput {
    pub value: ValueId,
    pub name: String,
    pub role: OutputRole,
}

/// One op applied to operands `args`, defining values `outs`.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub args: Vec<ValueId>,
    pub outs: Vec<ValueId>,
    pub phase: Phase,
}

/// A program of static shape: see the module docs for its invariant.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Trace {
    pub name: String,
    /// The type of every value, indexed by `ValueId`.
    pub types: Vec<TensorType>,
    pub inputs: Vec<TraceInput>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<TraceOutput>,
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Def {
    /// The `i`th trace input.
    Input(usize),
    /// Output `out` of node `node`.
    Node { node: usize, out: usize },
}

impl Trace {
    pub fn new(name: impl Into<String>) -> Self {
        Trace { name: name.into(), ..Default::default() }
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.types[v.index()]
    }

    /// The types of `node`'s operands, in order (what `Op::infer` and the cost model take).
    pub fn arg_types(&self, node: &Node) -> Vec<&TensorType> {
        node.args.iter().map(|&a| self.ty(a)).collect()
    }

    /// The types of `node`'s results, in order.
    pub fn out_types(&self, node: &Node) -> Vec<&TensorType> {
        node.outs.iter().map(|&o| self.ty(o)).collect()
    }

    pub fn num_values(&self) -> usize {
        self.types.len()
    }

    /// Adds a value of type `ty` (not yet defined by anything).
    pub fn new_value(&mut self, ty: TensorType) -> ValueId {
        self.types.push(ty);
        ValueId(self.types.len() as u32 - 1)
    }

    pub fn input(&self, name: &str) -> Option<&TraceInput> {
        self.inputs.iter().find(|i| i.name == name)
    }

    pub fn output(&self, name: &str) -> Option<&TraceOutput> {
        self.outputs.iter().find(|o| o.name == name)
    }

    /// The definition of every value (`None` for values nothing defines).
    pub fn defs(&self) -> Vec<Option<Def>> {
        let mut defs = vec![None; self.types.len()];
        for (i, inp) in self.inputs.iter().enumerate() {
            defs[inp.value.index()] = Some(Def::Input(i));
        }
        for (n, node) in self.nodes.iter().enumerate() {
            for (o, v) in node.outs.iter().enumerate() {
                defs[v.index()] = Some(Def::Node { node: n, out: o });
            }
        }
        defs
    }

    /// For every value, the nodes that read it, in order (a node reading a value twice is
    /// listed twice).
    pub fn users(&self) -> Vec<Vec<usize>> {
        let mut users = vec![Vec::new(); self.types.len()];
        for (n, node) in self.nodes.iter().enumerate() {
            for a in &node.args {
                users[a.index()].push(n);
            }
        }
        users
    }

    /// Renumbers values in definition order (inputs first, then node outputs) and drops types
    /// of values that nothing defines. Equal programs then print and compare equal.
    pub fn compact(&mut self) -> crate::Result<()> {
        let name = self.name.clone();
        let undefined = |v: ValueId, at: String| crate::Error::Verify {
            trace: name.clone(),
            at,
            msg: format!("{v} is used but never defined"),
        };
        let old = std::mem::take(&mut self.types);
        let mut map: HashMap<ValueId, ValueId> = HashMap::new();
        let mut types = Vec::with_capacity(old.len());
        let mut def = |v: ValueId| {
            let id = ValueId(types.len() as u32);
            types.push(old[v.index()].clone());
            map.insert(v, id);
            id
        };
        for inp in &mut self.inputs {
            inp.value = def(inp.value);
        }
        for node in &mut self.nodes {
            for o in &mut node.outs {
                *o = def(*o);
            }
        }
        for (n, node) in self.nodes.iter_mut().enumerate() {
            for a in &mut node.args {
                *a = *map.get(a).ok_or_else(|| undefined(*a, format!("node {n} ({})", node.op.name())))?;
            }
        }
        for out in &mut self.outputs {
            let at = format!("output \"{}\"", out.name);
            out.value = *map.get(&out.value).ok_or_else(|| undefined(out.value, at.clone()))?;
            match &mut out.role {
                OutputRole::Grad { of } | OutputRole::Update { of } => {
                    *of = *map.get(of).ok_or_else(|| undefined(*of, at))?
                }
                OutputRole::Output | OutputRole::Saved => {}
            }
        }
        self.types = types;
        Ok(())
    }

    /// Total bytes of the values defined by nodes (not inputs): a rough size measure.
    pub fn node_bytes(&self) -> usize {
        self.nodes.iter().flat_map(|n| &n.outs).map(|v| self.ty(*v).size_in_bytes()).sum()
    }

    /// Counts nodes per op name, sorted by name: handy in tests and reports.
    pub fn op_counts(&self) -> Vec<(&'static str, usize)> {
        let mut m: HashMap<&'static str, usize> = HashMap::new();
        for n in &self.nodes {
            *m.entry(n.op.name()).or_default() += 1;
        }
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort();
        v
    }
}
