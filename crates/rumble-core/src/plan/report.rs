//! The memory report of a plan: bytes per class, LOAD, arena, their ratio, persistent bytes,
//! the peak, the biggest buffers live at the peak, and what the passes did. Printed for people
//! by `Display`, for scripts by [`PlanReport::to_json`] (keys `load_bytes`, `arena_bytes`,
//! `persistent_bytes`, `peak_bytes`, ...).

use std::fmt;

use serde::{Serialize, Serializer};

use super::MemoryPlan;
use super::lifetimes::{Class, Lifetimes, Storage};
use super::{ALIGN, Region, align_up};
use crate::ir::{Def, Trace, ValueId};

/// Bytes of one class of buffers.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassBytes {
    #[serde(serialize_with = "class_name")]
    pub class: Class,
    /// Values of the class that own bytes (views excluded).
    pub values: usize,
    /// Their aligned bytes, summed over the step.
    pub bytes: usize,
    /// Their aligned bytes live at the LOAD step (persistent classes: all of them).
    #[serde(rename = "at_peak_bytes")]
    pub at_peak: usize,
}

/// One buffer live at the LOAD step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeakBuffer {
    /// `None` for an op's scratch memory.
    #[serde(serialize_with = "value_text")]
    pub value: Option<ValueId>,
    /// `%12`, or the input's or output's name.
    pub name: String,
    /// The op that defines it (`input` for trace inputs).
    pub op: String,
    /// Its type, `f32[2048,3200]`.
    #[serde(rename = "type")]
    pub ty: String,
    #[serde(serialize_with = "class_name")]
    pub class: Class,
    pub phase: String,
    /// Aligned bytes.
    pub bytes: usize,
    #[serde(rename = "def_step")]
    pub def: usize,
    #[serde(rename = "last_step")]
    pub last: usize,
    pub offset: usize,
}

/// The cost model's time for one op's nodes together (`PlanReport::predicted_by_op`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpTime {
    pub op: String,
    pub nodes: usize,
    pub ms: f64,
}

/// What one pass did to LOAD.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PassReport {
    pub pass: String,
    pub load_before: usize,
    pub load_after: usize,
    /// Extra floating-point operations per step the pass adds (recomputation).
    pub extra_flops: u64,
    /// One line on what it did.
    pub detail: String,
    pub millis: f64,
}

/// The report of one plan. `arena_bytes` here is the arena's values part (compare with LOAD):
/// every buffer, scratch included (the op's and the backend's per-node scratch are buffers of
/// class `scratch`, counted in LOAD), less a whole-step `workspace_bytes` if the plan has one
/// (0 on CUDA); `peak_bytes = persistent_bytes + arena_bytes + workspace_bytes`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanReport {
    pub trace: String,
    pub nodes: usize,
    pub values: usize,
    pub load_bytes: usize,
    /// First step at which LOAD is reached (node `i` runs at step `i + 1`).
    pub load_step: usize,
    pub arena_bytes: usize,
    pub workspace_bytes: usize,
    pub persistent_bytes: usize,
    pub peak_bytes: usize,
    /// The arena if no bytes were reused (every buffer its own range).
    pub no_reuse_bytes: usize,
    /// The assignment order that gave the smallest arena.
    pub order: String,
    pub views: usize,
    pub inplace: usize,
    pub copy_back: usize,
    pub copy_back_bytes: usize,
    pub classes: Vec<ClassBytes>,
    pub at_peak: Vec<PeakBuffer>,
    pub passes: Vec<PassReport>,
    /// The memory budget asked for (`Remat::Budget`), if any; compare with `peak_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<usize>,
    pub plan_millis: f64,
    /// Predicted milliseconds of one step (`compile::compile`'s cost model), if priced. This
    /// and the four fields after it are in the JSON only when priced (`predicted_step_ms`).
    #[serde(skip)]
    pub predicted_ms: Option<f64>,
    /// The cost model that priced it.
    #[serde(skip)]
    pub cost_model: String,
    /// The memory policy (`compile::Budget`) it was chosen under.
    #[serde(skip)]
    pub budget: String,
    /// What `compile` chose (`linear_cross_entropy chunk 1024 rows (4 chunks)`).
    #[serde(skip)]
    pub chosen: String,
    /// Every variant weighed: its choices, predicted time and peak (empty if only one).
    #[serde(skip)]
    pub weighed: Vec<String>,
    /// The chosen plan's predicted time by op, slowest first (each op's nodes summed).
    #[serde(skip)]
    pub predicted_by_op: Vec<OpTime>,
}

impl PlanReport {
    /// Builds the report of `plan`, listing up to `top` buffers live at the peak.
    pub fn new(trace: &Trace, lt: &Lifetimes, plan: &MemoryPlan, order: &str, top: usize) -> Self {
        let (load, load_step) = lt.load();
        let defs = trace.defs();
        let mut classes: Vec<ClassBytes> =
            Class::ALL.iter().map(|&class| ClassBytes { class, values: 0, bytes: 0, at_peak: 0 }).collect();
        let mut no_reuse = 0;
        for (bi, b) in lt.buffers.iter().enumerate() {
            if b.scratch_of.is_some() {
                let c = &mut classes[class_index(Class::Scratch)];
                c.values += 1;
                c.bytes += b.aligned();
                no_reuse += b.aligned();
                if b.start <= load_step && load_step <= b.end {
                    c.at_peak += b.aligned();
                }
                continue;
            }
            let live_member = lt.member_at(bi, load_step).filter(|_| b.region == Region::Arena);
            for &m in &b.members {
                let aligned = align_up(trace.ty(m).size_in_bytes().max(1), ALIGN);
                let c = &mut classes[class_index(lt.values[m.index()].class)];
                c.values += 1;
                if b.region == Region::Arena || m == b.members[0] {
                    c.bytes += aligned;
                }
                if b.region == Region::Persistent && m == b.members[0] {
                    c.at_peak += aligned;
                }
                if live_member == Some(m) {
                    c.at_peak += aligned;
                }
                if b.region == Region::Arena {
                    no_reuse += aligned;
                }
            }
        }
        let mut at_peak: Vec<PeakBuffer> = lt
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.region == Region::Arena && b.start <= load_step && load_step <= b.end)
            .filter_map(|(bi, b)| {
                if let Some(n) = b.scratch_of {
                    let offset = plan.scratch.get(n).copied().flatten().map_or(0, |s| s.offset);
                    let backend = plan.backend_scratch.get(n).copied().unwrap_or(0);
                    let ty = if backend > 0 {
                        format!("{} bytes ({backend} backend)", b.bytes)
                    } else {
                        format!("{} bytes", b.bytes)
                    };
                    return Some(PeakBuffer {
                        value: None,
                        name: format!("scratch of node {n}"),
                        op: trace.nodes[n].op.name().to_string(),
                        ty,
                        class: Class::Scratch,
                        phase: trace.nodes[n].phase.name().to_string(),
                        bytes: b.aligned(),
                        def: b.start,
                        last: b.end,
                        offset,
                    });
                }
                let m = lt.member_at(bi, load_step)?;
                let offset = plan.slots[m.index()].map_or(0, |s| s.offset);
                Some(describe(trace, &defs, lt, m, b.aligned(), offset))
            })
            .collect();
        at_peak.sort_by_key(|p| (std::cmp::Reverse(p.bytes), p.value));
        at_peak.truncate(top);
        let views = lt.values.iter().filter(|v| matches!(v.storage, Storage::View { .. })).count();
        let inplace = lt.values.iter().filter(|v| v.inplace_of.is_some()).count();
        let copy_back_bytes = plan.copy_back.iter().map(|&(v, _)| trace.ty(v).size_in_bytes()).sum();
        PlanReport {
            trace: trace.name.clone(),
            nodes: trace.nodes.len(),
            values: trace.num_values(),
            load_bytes: load,
            load_step,
            arena_bytes: plan.values_bytes(),
            workspace_bytes: plan.workspace_bytes,
            persistent_bytes: plan.persistent_bytes,
            peak_bytes: plan.peak_bytes(),
            no_reuse_bytes: no_reuse,
            order: order.to_string(),
            views,
            inplace,
            copy_back: plan.copy_back.len(),
            copy_back_bytes,
            classes,
            at_peak,
            passes: Vec::new(),
            budget_bytes: None,
            plan_millis: 0.0,
            predicted_ms: None,
            cost_model: String::new(),
            budget: String::new(),
            chosen: String::new(),
            weighed: Vec::new(),
            predicted_by_op: Vec::new(),
        }
    }

    /// Arena over LOAD (1.0 is a perfect placement).
    pub fn ratio(&self) -> f64 {
        if self.load_bytes == 0 { 1.0 } else { self.arena_bytes as f64 / self.load_bytes as f64 }
    }

    /// One JSON object with every field (byte counts as integers), and `arena_over_load`; under
    /// a budget, `fits_budget`; if priced, `predicted_step_ms`, `cost_model`, `budget`, `chosen`
    /// `weighed` and `predicted_by_op`.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Priced<'a> {
            predicted_step_ms: f64,
            cost_model: &'a str,
            budget: &'a str,
            chosen: &'a str,
            weighed: &'a [String],
            predicted_by_op: &'a [OpTime],
        }
        #[derive(Serialize)]
        struct Json<'a> {
            #[serde(flatten)]
            report: &'a PlanReport,
            arena_over_load: f64,
            #[serde(skip_serializing_if = "Option::is_none")]
            fits_budget: Option<bool>,
            #[serde(flatten)]
            priced: Option<Priced<'a>>,
        }
        let fits_budget = self.budget_bytes.map(|b| self.peak_bytes <= b);
        // Serializing plain structs of numbers and strings cannot fail.
        let priced = self.predicted_ms.map(|ms| Priced {
            predicted_step_ms: ms,
            cost_model: &self.cost_model,
            budget: &self.budget,
            chosen: &self.chosen,
            weighed: &self.weighed,
            predicted_by_op: &self.predicted_by_op,
        });
        serde_json::to_string(&Json { report: self, arena_over_load: self.ratio(), fits_budget, priced })
            .unwrap_or_default()
    }
}

fn class_name<S: Serializer>(c: &Class, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(c.name())
}

fn value_text<S: Serializer>(v: &Option<ValueId>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_str(&v.to_string()),
        None => s.serialize_none(),
    }
}

fn class_index(c: Class) -> usize {
    Class::ALL.iter().position(|&k| k == c).unwrap_or(Class::ALL.len() - 1)
}

/// How the report names value `v`.
pub fn value_name(trace: &Trace, v: ValueId) -> String {
    if let Some(i) = trace.inputs.iter().find(|i| i.value == v) {
        return i.name.clone();
    }
    if let Some(o) = trace.outputs.iter().find(|o| o.value == v) {
        return o.name.clone();
    }
    v.to_string()
}

fn describe(
    trace: &Trace,
    defs: &[Option<Def>],
    lt: &Lifetimes,
    v: ValueId,
    bytes: usize,
    offset: usize,
) -> PeakBuffer {
    let (op, phase) = match defs[v.index()] {
        Some(Def::Node { node, .. }) => {
            let n = &trace.nodes[node];
            (n.op.name().to_string(), n.phase.name().to_string())
        }
        _ => ("input".to_string(), "input".to_string()),
    };
    let life = &lt.values[v.index()];
    PeakBuffer {
        value: Some(v),
        name: value_name(trace, v),
        op,
        ty: trace.ty(v).to_string(),
        class: life.class,
        phase,
        bytes,
        def: life.def,
        last: life.last,
        offset,
    }
}

/// `1.5 GiB`, `12.0 MiB`, `768 B`: binary units, three significant digits.
pub fn fmt_bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else if x >= 100.0 {
        format!("{x:.0} {}", UNITS[u])
    } else if x >= 10.0 {
        format!("{x:.1} {}", UNITS[u])
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = fmt_bytes;
        writeln!(f, "memory plan of `{}`: {} nodes, {} values", self.trace, self.nodes, self.values)?;
        writeln!(f, "  LOAD        {:>11}  at step {} of {}", b(self.load_bytes), self.load_step, self.nodes + 1)?;
        writeln!(
            f,
            "  arena       {:>11}  = {:.3} x LOAD (best order: {})",
            b(self.arena_bytes),
            self.ratio(),
            self.order
        )?;
        writeln!(f, "  workspace   {:>11}", b(self.workspace_bytes))?;
        writeln!(f, "  persistent  {:>11}  (parameters, optimizer state)", b(self.persistent_bytes))?;
        writeln!(f, "  peak        {:>11}  = persistent + arena + workspace", b(self.peak_bytes))?;
        if let Some(ms) = self.predicted_ms {
            writeln!(f, "  step        {ms:>8.3} ms  predicted ({}; budget {})", self.cost_model, self.budget)?;
            if !self.chosen.is_empty() {
                writeln!(f, "  chosen      {}", self.chosen)?;
            }
            for w in &self.weighed {
                writeln!(f, "    weighed   {w}")?;
            }
            // The ops that take most of it (the rest summed).
            const SHOWN: usize = 6;
            let mut by_op: Vec<String> = self
                .predicted_by_op
                .iter()
                .take(SHOWN)
                .map(|t| format!("{} {:.2} ({})", t.op, t.ms, t.nodes))
                .collect();
            if self.predicted_by_op.len() > SHOWN {
                let rest: f64 = self.predicted_by_op[SHOWN..].iter().map(|t| t.ms).sum();
                by_op.push(format!("{} others {rest:.2}", self.predicted_by_op.len() - SHOWN));
            }
            if !by_op.is_empty() {
                writeln!(f, "  by op (ms)  {}", by_op.join(", "))?;
            }
        }
        if let Some(budget) = self.budget_bytes {
            let verdict = if self.peak_bytes <= budget { "fits" } else { "does NOT fit" };
            writeln!(f, "  budget      {:>11}  {verdict}", b(budget))?;
        }
        writeln!(f, "  no reuse    {:>11}  (the arena if every buffer had its own bytes)", b(self.no_reuse_bytes))?;
        writeln!(
            f,
            "  {} views, {} computed in place, {} updates copied back ({})",
            self.views,
            self.inplace,
            self.copy_back,
            b(self.copy_back_bytes)
        )?;
        writeln!(f, "  {:<20} {:>7} {:>11} {:>11}", "class", "values", "bytes", "at peak")?;
        for c in self.classes.iter().filter(|c| c.values > 0) {
            writeln!(f, "  {:<20} {:>7} {:>11} {:>11}", c.class.name(), c.values, b(c.bytes), b(c.at_peak))?;
        }
        if !self.at_peak.is_empty() {
            writeln!(f, "  biggest buffers live at the peak (step {}):", self.load_step)?;
            for p in &self.at_peak {
                writeln!(
                    f,
                    "    {:>11}  {:<18} {} = {} {} ({}, steps {}..{})",
                    b(p.bytes),
                    p.class.name(),
                    p.name,
                    p.op,
                    p.ty,
                    p.phase,
                    p.def,
                    p.last
                )?;
            }
        }
        for p in &self.passes {
            write!(f, "  pass {}: LOAD {} -> {}", p.pass, b(p.load_before), b(p.load_after))?;
            if p.extra_flops > 0 {
                write!(f, ", {:.3e} extra FLOPs", p.extra_flops as f64)?;
            }
            writeln!(f, ", {:.1} ms; {}", p.millis, p.detail)?;
        }
        writeln!(f, "  planned in {:.1} ms", self.plan_millis)
    }
}
