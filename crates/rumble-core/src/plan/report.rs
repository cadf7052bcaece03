//! The memory report of a plan: bytes per class, LOAD, arena, their ratio, persistent bytes,
//! the peak, the biggest buffers live at the peak, and what the passes did. Printed for people
//! by `Display`, for scripts by [`PlanReport::to_json`] (keys `load_bytes`, `arena_bytes`,
//! `persistent_bytes`, `peak_bytes`, ...).

use std::fmt::{self, Write as _};

use super::MemoryPlan;
use super::lifetimes::{Class, Lifetimes, Storage};
use super::{ALIGN, Region, align_up};
use crate::ir::{Def, Trace, ValueId};

/// Bytes of one class of buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassBytes {
    pub class: Class,
    /// Values of the class that own bytes (views excluded).
    pub values: usize,
    /// Their aligned bytes, summed over the step.
    pub bytes: usize,
    /// Their aligned bytes live at the LOAD step (persistent classes: all of them).
    pub at_peak: usize,
}

/// One buffer live at the LOAD step.
#[derive(Clone, Debug, PartialEq)]
pub struct PeakBuffer {
    /// `None` for an op's scratch memory.
    pub value: Option<ValueId>,
    /// `%12`, or the input's or output's name.
    pub name: String,
    /// The op that defines it (`input` for trace inputs).
    pub op: String,
    /// Its type, `f32[2048,3200]`.
    pub ty: String,
    pub class: Class,
    pub phase: String,
    /// Aligned bytes.
    pub bytes: usize,
    pub def: usize,
    pub last: usize,
    pub offset: usize,
}

/// What one pass did to LOAD.
#[derive(Clone, Debug, Default, PartialEq)]
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
#[derive(Clone, Debug, PartialEq)]
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
    pub budget_bytes: Option<usize>,
    pub plan_millis: f64,
    /// Predicted milliseconds of one step (`compile::compile`'s cost model), if priced.
    pub predicted_ms: Option<f64>,
    /// The cost model that priced it.
    pub cost_model: String,
    /// The memory policy (`compile::Budget`) it was chosen under.
    pub budget: String,
    /// What `compile` chose (`linear_cross_entropy chunk 1024 rows (4 chunks)`).
    pub chosen: String,
    /// Every variant weighed: its choices, predicted time and peak (empty if only one).
    pub weighed: Vec<String>,
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
        }
    }

    /// Arena over LOAD (1.0 is a perfect placement).
    pub fn ratio(&self) -> f64 {
        if self.load_bytes == 0 { 1.0 } else { self.arena_bytes as f64 / self.load_bytes as f64 }
    }

    /// One JSON object with every field (byte counts as integers).
    pub fn to_json(&self) -> String {
        let mut o = Obj::default();
        o.str("trace", &self.trace);
        for (k, v) in [
            ("nodes", self.nodes),
            ("values", self.values),
            ("load_bytes", self.load_bytes),
            ("load_step", self.load_step),
            ("arena_bytes", self.arena_bytes),
            ("workspace_bytes", self.workspace_bytes),
            ("persistent_bytes", self.persistent_bytes),
            ("peak_bytes", self.peak_bytes),
            ("no_reuse_bytes", self.no_reuse_bytes),
            ("views", self.views),
            ("inplace", self.inplace),
            ("copy_back", self.copy_back),
            ("copy_back_bytes", self.copy_back_bytes),
        ] {
            o.num(k, v as u64);
        }
        o.float("arena_over_load", self.ratio());
        if let Some(b) = self.budget_bytes {
            o.num("budget_bytes", b as u64);
            o.raw("fits_budget", if self.peak_bytes <= b { "true" } else { "false" });
        }
        o.str("order", &self.order);
        let classes: Vec<String> = self
            .classes
            .iter()
            .map(|c| {
                let mut j = Obj::default();
                j.str("class", c.class.name());
                j.num("values", c.values as u64);
                j.num("bytes", c.bytes as u64);
                j.num("at_peak_bytes", c.at_peak as u64);
                j.finish()
            })
            .collect();
        o.raw("classes", &format!("[{}]", classes.join(",")));
        let peak: Vec<String> = self
            .at_peak
            .iter()
            .map(|p| {
                let mut j = Obj::default();
                match p.value {
                    Some(v) => j.str("value", &v.to_string()),
                    None => j.raw("value", "null"),
                }
                j.str("name", &p.name);
                j.str("op", &p.op);
                j.str("type", &p.ty);
                j.str("class", p.class.name());
                j.str("phase", &p.phase);
                j.num("bytes", p.bytes as u64);
                j.num("def_step", p.def as u64);
                j.num("last_step", p.last as u64);
                j.num("offset", p.offset as u64);
                j.finish()
            })
            .collect();
        o.raw("at_peak", &format!("[{}]", peak.join(",")));
        let passes: Vec<String> = self
            .passes
            .iter()
            .map(|p| {
                let mut j = Obj::default();
                j.str("pass", &p.pass);
                j.num("load_before", p.load_before as u64);
                j.num("load_after", p.load_after as u64);
                j.num("extra_flops", p.extra_flops);
                j.str("detail", &p.detail);
                j.float("millis", p.millis);
                j.finish()
            })
            .collect();
        o.raw("passes", &format!("[{}]", passes.join(",")));
        o.float("plan_millis", self.plan_millis);
        if let Some(ms) = self.predicted_ms {
            o.float("predicted_step_ms", ms);
            o.str("cost_model", &self.cost_model);
            o.str("budget", &self.budget);
            o.str("chosen", &self.chosen);
            let w: Vec<String> = self.weighed.iter().map(|l| quote(l)).collect();
            o.raw("weighed", &format!("[{}]", w.join(",")));
        }
        o.finish()
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

/// A JSON object written by hand (the core crate has no serde).
#[derive(Default)]
struct Obj(Vec<String>);

impl Obj {
    fn raw(&mut self, k: &str, v: &str) {
        self.0.push(format!("{}:{v}", quote(k)));
    }
    fn str(&mut self, k: &str, v: &str) {
        self.raw(k, &quote(v));
    }
    fn num(&mut self, k: &str, v: u64) {
        self.raw(k, &v.to_string());
    }
    fn float(&mut self, k: &str, v: f64) {
        self.raw(k, &if v.is_finite() { format!("{v}") } else { "null".to_string() });
    }
    fn finish(self) -> String {
        format!("{{{}}}", self.0.join(","))
    }
}

fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(q, "\\u{:04x}", c as u32);
            }
            c => q.push(c),
        }
    }
    q.push('"');
    q
}
