//! Elementwise fusion: chains of elementwise ops of one shape and phase become one `fused`
//! node, so their intermediates never reach memory. `broadcast` and `full` operands are folded
//! into the body (read with broadcast indexing, or as scalar constants).
//!
//! A node joins the group of one of its operands' producers unless that would make a cycle
//! (an operand from outside the group that itself depends on the group). Fused nodes keep the
//! value ids of the outputs they replace, and the result is put back in a valid order
//! (topological, nearest the original).

use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};

use crate::Result;
use crate::ir::{FusedBody, FusedInstr, Node, Op, TensorType, Trace, ValueId};

/// Most operands and instructions one fused kernel takes.
const MAX_OPERANDS: usize = 16;
const MAX_BODY: usize = 64;

#[derive(Default)]
struct Group {
    members: Vec<usize>,
    operands: HashSet<ValueId>,
}

pub fn fuse(trace: &Trace) -> Result<Trace> {
    let n = trace.num_values();
    let defs = trace.defs();
    let producer = |v: ValueId| match defs[v.index()] {
        Some(crate::ir::Def::Node { node, .. }) => Some(node),
        _ => None,
    };
    // How a value is read inside a body: folded broadcast/full, or itself.
    let fold = |v: ValueId| -> Option<&Node> {
        let p = &trace.nodes[producer(v)?];
        match &p.op {
            Op::Broadcast { .. } => Some(p),
            Op::Full { .. } => Some(p),
            _ => None,
        }
    };

    // Groups are merged as nodes join them (union-find); `deps[v]` holds the (raw) ids of the
    // groups value `v` depends on, `ext[g]` those that group `g`'s outside operands depend on.
    let mut group_of: Vec<Option<usize>> = vec![None; trace.nodes.len()];
    let mut groups: Vec<Group> = Vec::new();
    let mut parent: Vec<usize> = Vec::new();
    let mut ext: Vec<BTreeSet<usize>> = Vec::new();
    let mut deps: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); n];
    fn find(parent: &[usize], mut g: usize) -> usize {
        while parent[g] != g {
            g = parent[g];
        }
        g
    }
    for (i, node) in trace.nodes.iter().enumerate() {
        let mut d: BTreeSet<usize> = BTreeSet::new();
        for a in &node.args {
            d.extend(deps[a.index()].iter().copied());
        }
        if node.op.is_elementwise() {
            let shape = &trace.ty(node.outs[0]).shape;
            let group_at =
                |a: &ValueId, parent: &[usize]| producer(*a).and_then(|p| group_of[p]).map(|g| find(parent, g));
            let mut cands: Vec<usize> = Vec::new();
            for a in &node.args {
                if let Some(g) = group_at(a, &parent) {
                    let first = &trace.nodes[groups[g].members[0]];
                    if !cands.contains(&g) && first.phase == node.phase && trace.ty(first.outs[0]).shape == *shape {
                        cands.push(g);
                    }
                }
            }
            // Can `node` join the union of `set` without a cycle or an oversized kernel?
            // Every group reachable from `start`: a group runs as one kernel, so a value made by
            // it depends on everything its outside operands depend on.
            let reach = |start: &BTreeSet<usize>, parent: &[usize]| -> BTreeSet<usize> {
                let mut seen: BTreeSet<usize> = BTreeSet::new();
                let mut todo: Vec<usize> = start.iter().map(|&g| find(parent, g)).collect();
                while let Some(g) = todo.pop() {
                    if seen.insert(g) {
                        todo.extend(ext[g].iter().map(|&e| find(parent, e)));
                    }
                }
                seen
            };
            let valid = |set: &[usize], parent: &[usize]| -> bool {
                let hits = |r: BTreeSet<usize>| r.iter().any(|g| set.contains(g));
                let node_ok = node.args.iter().all(|a| {
                    group_at(a, parent).is_some_and(|g| set.contains(&g)) || !hits(reach(&deps[a.index()], parent))
                });
                let groups_ok = set.iter().all(|&g| !hits(reach(&ext[g], parent)));
                let size: usize = set.iter().map(|&g| groups[g].members.len()).sum();
                let operands: HashSet<&ValueId> = set.iter().flat_map(|&g| &groups[g].operands).collect();
                node_ok && groups_ok && size < MAX_BODY && operands.len() + node.args.len() <= MAX_OPERANDS
            };
            let chosen: Vec<usize> = if !cands.is_empty() && valid(&cands, &parent) {
                cands.clone()
            } else {
                cands.iter().copied().find(|&g| valid(&[g], &parent)).into_iter().collect()
            };
            let g = match chosen.split_first() {
                Some((&r, rest)) => {
                    for &o in rest {
                        parent[o] = r;
                        let moved = std::mem::take(&mut groups[o]);
                        groups[r].members.extend(moved.members);
                        groups[r].operands.extend(moved.operands);
                        let e = std::mem::take(&mut ext[o]);
                        ext[r].extend(e);
                    }
                    groups[r].members.sort_unstable();
                    r
                }
                None => {
                    groups.push(Group::default());
                    parent.push(groups.len() - 1);
                    ext.push(BTreeSet::new());
                    groups.len() - 1
                }
            };
            for a in &node.args {
                if group_at(a, &parent) != Some(g) {
                    groups[g].operands.insert(*a);
                    ext[g].extend(deps[a.index()].iter().copied());
                }
            }
            groups[g].members.push(i);
            group_of[i] = Some(g);
            d.insert(g);
        }
        for o in &node.outs {
            deps[o.index()] = d.clone();
        }
    }
    // Resolve every node's group to its final representative.
    let group_of: Vec<Option<usize>> = group_of.iter().map(|g| g.map(|g| find(&parent, g))).collect();

    let out_values: HashSet<ValueId> = trace.outputs.iter().map(|o| o.value).collect();
    let users = trace.users();
    // Units of the new program: plain nodes, or fused groups, each with its defining position.
    let mut units: Vec<(usize, Node)> = Vec::new();
    for (i, node) in trace.nodes.iter().enumerate() {
        let Some(g) = group_of[i] else {
            units.push((i, node.clone()));
            continue;
        };
        let members = &groups[g].members;
        let folds = members.iter().flat_map(|&m| &trace.nodes[m].args).any(|a| fold(*a).is_some());
        if members.len() < 2 && !folds {
            units.push((i, node.clone()));
        } else if *members.last().expect("groups are not empty") == i {
            units.push((i, build(trace, members, &group_of, g, &fold, &users, &out_values)));
        }
    }

    // Topological order, nearest the original: ready units by position.
    let defined_by: HashMap<ValueId, usize> =
        units.iter().enumerate().flat_map(|(u, (_, nd))| nd.outs.iter().map(move |o| (*o, u))).collect();
    let mut waiting: Vec<usize> = vec![0; units.len()];
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
    for (u, (_, nd)) in units.iter().enumerate() {
        let producers: HashSet<usize> = nd.args.iter().filter_map(|a| defined_by.get(a).copied()).collect();
        waiting[u] = producers.len();
        producers.into_iter().for_each(|p| dependents[p].push(u));
    }
    let mut ready: BinaryHeap<std::cmp::Reverse<(usize, usize)>> =
        (0..units.len()).filter(|&u| waiting[u] == 0).map(|u| std::cmp::Reverse((units[u].0, u))).collect();
    let mut t = trace.clone();
    t.nodes.clear();
    while let Some(std::cmp::Reverse((_, u))) = ready.pop() {
        t.nodes.push(units[u].1.clone());
        for &d in &dependents[u] {
            waiting[d] -= 1;
            if waiting[d] == 0 {
                ready.push(std::cmp::Reverse((units[d].0, d)));
            }
        }
    }
    if t.nodes.len() != units.len() {
        return Err(crate::Error::msg(format!("fuse `{}`: internal error, the grouping made a cycle", trace.name)));
    }
    super::dce(&t)
}

/// The fused node for group `g`.
fn build<'a>(
    trace: &'a Trace,
    members: &[usize],
    group_of: &[Option<usize>],
    g: usize,
    fold: &dyn Fn(ValueId) -> Option<&'a Node>,
    users: &[Vec<usize>],
    out_values: &HashSet<ValueId>,
) -> Node {
    let mut operands: Vec<ValueId> = Vec::new();
    let mut inputs: Vec<TensorType> = Vec::new();
    let mut consts: Vec<(f64, crate::ir::DType, ValueId)> = Vec::new();
    let mut index: HashMap<ValueId, usize> = HashMap::new();
    let member_outs: HashSet<ValueId> = members.iter().flat_map(|&m| trace.nodes[m].outs.iter().copied()).collect();
    // Operands first (body values 0..k), then constants and instructions.
    for &m in members {
        for a in &trace.nodes[m].args {
            if member_outs.contains(a) || index.contains_key(a) {
                continue;
            }
            match fold(*a).map(|p| (&p.op, p.args.first().copied())) {
                Some((Op::Full { value, ty }, _)) => consts.push((*value, ty.dtype, *a)),
                Some((Op::Broadcast { .. }, Some(x))) if !member_outs.contains(&x) => {
                    let k = *index.entry(x).or_insert_with(|| {
                        operands.push(x);
                        inputs.push(trace.ty(x).clone());
                        operands.len() - 1
                    });
                    index.insert(*a, k);
                }
                _ => {
                    index.insert(*a, operands.len());
                    operands.push(*a);
                    inputs.push(trace.ty(*a).clone());
                }
            }
        }
    }
    let mut body = Vec::new();
    for (value, dtype, v) in consts {
        if index.contains_key(&v) {
            continue;
        }
        index.insert(v, inputs.len() + body.len());
        body.push(FusedInstr { op: Op::Full { value, ty: TensorType::scalar(dtype) }, args: vec![], dtype });
    }
    let mut outs = Vec::new();
    let mut returns = Vec::new();
    for &m in members {
        let node = &trace.nodes[m];
        let o = node.outs[0];
        index.insert(o, inputs.len() + body.len());
        body.push(FusedInstr {
            op: node.op.clone(),
            args: node.args.iter().map(|a| index[a]).collect(),
            dtype: trace.ty(o).dtype,
        });
        let used_outside = users[o.index()].iter().any(|&u| group_of[u] != Some(g));
        if used_outside || out_values.contains(&o) {
            outs.push(o);
            returns.push(index[&o]);
        }
    }
    let first = &trace.nodes[members[0]];
    let shape = trace.ty(first.outs[0]).shape.clone();
    Node {
        op: Op::Fused(Box::new(FusedBody { shape, inputs, body, outputs: returns })),
        args: operands,
        outs,
        phase: first.phase,
    }
}
