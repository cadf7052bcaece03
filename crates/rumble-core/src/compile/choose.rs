//! Choices made against the cost model under a memory objective.
//!
//! A **variant** is the trace with its choices made: which of the passes' alternatives of the
//! trace (`compile` gives two where a decode step's norms and swiglus folded into its
//! projections: folded and not, so the fold stays only where the cost model says it pays), and
//! the rows of each fused linear cross-entropy chunk (`Op::LinearCrossEntropy{,Backward,Grad}`'s
//! `chunk`), from the whole batch (all the logits at once: the widest, fastest matmuls, the most
//! scratch) halving down to a few rows. Each variant is planned (schedule, place) and, where a budget asks for it,
//! rematerialised with the cost model (`passes::remat::remat_costed`: matmuls included,
//! cheapest seconds per byte first); its predicted time is the sum of its nodes' times
//! (`cost::trace_seconds`) and its peak is the plan's. The [`Budget`] then picks:
//!
//! - [`Budget::Fastest`] (the default): the fastest plan, recomputing nothing, but no bytes
//!   for speed the model cannot tell apart: among the plans within the speed tolerance of the
//!   fastest ([`LEAN_TOLERANCE`] for estimated times, [`MEASURED_LEAN_TOLERANCE`] where the
//!   cost model measures on the device: `CostModel::is_measured`), the fastest of those within
//!   [`PEAK_TOLERANCE`] of their smallest peak;
//! - [`Budget::Bytes`]: the fastest plan whose peak fits, recomputing where that is what
//!   makes it fit; where none of those fits, `Min`'s plan if it does (recomputing as much as
//!   lowers the peak can fit where recomputing just what the model priced as enough did not);
//!   an error naming the smallest feasible peak if none does;
//! - [`Budget::Auto`]: `Bytes` of the device's free memory less [`AUTO_MARGIN`] of it, or
//!   `Fastest` where the free memory is not known (the CPU);
//! - [`Budget::Min`]: the smallest peak (the recomputations that lower it most, as planned:
//!   `remat_costed` plans prefixes of its takes where taking them all measures higher), the
//!   fastest among peaks within [`PEAK_TOLERANCE`] of it.

use std::fmt;
use std::str::FromStr;

use crate::cost::{CostModel, trace_seconds};
use crate::ir::{Op, Trace};
use crate::passes::remat::Remat;
use crate::plan::Planned;
use crate::plan::report::fmt_bytes;
use crate::{Error, Result};

use super::{CompileOptions, plan};

/// `Budget::Fastest` counts plans within this fraction of the fastest as equally fast, and
/// takes the leanest of them (the accuracy asked of the predicted step time: a smaller gain is
/// not trusted, and not worth any bytes).
pub const LEAN_TOLERANCE: f64 = 0.10;
/// The same for times measured on the device the plan runs on: the variants differ in a few
/// nodes, each measured alone, so a gain this large is real.
pub const MEASURED_LEAN_TOLERANCE: f64 = 0.02;
/// Peaks within this fraction of each other count as the same memory.
pub const PEAK_TOLERANCE: f64 = 0.01;
/// `Budget::Auto` keeps this fraction of the device's free memory free.
pub const AUTO_MARGIN: f64 = 0.05;
/// The fewest rows a loss chunk is given (halving stops there).
const MIN_CHUNK_ROWS: usize = 8;

/// What the plan's peak (persistent + arena) must respect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Budget {
    /// The fastest plan.
    #[default]
    Fastest,
    /// The fastest plan whose peak is at most this many bytes.
    Bytes(usize),
    /// The device's free memory less a margin; `Fastest` where it is not known.
    Auto,
    /// The smallest peak.
    Min,
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Fastest => f.write_str("fastest"),
            Budget::Bytes(b) => write!(f, "{}", fmt_bytes(*b)),
            Budget::Auto => f.write_str("auto"),
            Budget::Min => f.write_str("min"),
        }
    }
}

impl FromStr for Budget {
    type Err = String;
    /// `auto`, `min`, `fastest` (or `none`), or bytes: `12e9`, `12000000000`, `12GB`,
    /// `11.5GiB`, `800MB`, `800MiB`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        match t {
            "auto" => return Ok(Budget::Auto),
            "min" => return Ok(Budget::Min),
            "fastest" | "none" => return Ok(Budget::Fastest),
            _ => {}
        }
        let units: [(&str, f64); 7] = [
            ("GiB", 1073741824.0),
            ("MiB", 1048576.0),
            ("KiB", 1024.0),
            ("GB", 1e9),
            ("MB", 1e6),
            ("KB", 1e3),
            ("B", 1.0),
        ];
        let (num, scale) =
            units.iter().find_map(|(u, k)| t.strip_suffix(u).map(|n| (n.trim(), *k))).unwrap_or((t, 1.0));
        match num.parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => Ok(Budget::Bytes((v * scale) as usize)),
            _ => Err(format!("`{s}` is not a memory budget (auto, min, fastest, or bytes: 12e9, 12GB, 11GiB)")),
        }
    }
}

/// One planned variant and what it costs.
pub struct Variant {
    pub planned: Planned,
    /// Predicted seconds of a step.
    pub seconds: f64,
    /// What was chosen (`linear_cross_entropy chunk 1024 rows (4 chunks)`), empty if nothing.
    pub label: String,
    /// Which alternative of the trace it plans.
    alt: usize,
}

/// One of the traces the passes made of a step, and what it is (empty for the first, the
/// passes' own).
pub type Alternative = (Trace, String);

/// `a` and `b` as one label.
fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}, {b}"),
    }
}

impl Variant {
    fn peak(&self) -> usize {
        self.planned.report.peak_bytes
    }

    /// The index of the alternative it plans.
    pub fn alt(&self) -> usize {
        self.alt
    }
}

/// The rows of the fused loss's chunk to try for `trace`: the whole batch, then halving down to
/// [`MIN_CHUNK_ROWS`], and the trace's own; empty without a fused loss.
pub fn chunk_candidates(trace: &Trace) -> Vec<usize> {
    let mut rows = 0;
    let mut own = Vec::new();
    for n in &trace.nodes {
        if let Op::LinearCrossEntropy { chunk, .. }
        | Op::LinearCrossEntropyBackward { chunk, .. }
        | Op::LinearCrossEntropyGrad { chunk, .. } = n.op
        {
            rows = rows.max(trace.ty(n.args[0]).dims()[0]);
            own.push(chunk.min(trace.ty(n.args[0]).dims()[0]).max(1));
        }
    }
    if rows == 0 {
        return Vec::new();
    }
    let mut out = own;
    let mut parts = 1;
    loop {
        let c = rows.div_ceil(parts);
        out.push(c);
        if c <= MIN_CHUNK_ROWS || parts >= rows {
            break;
        }
        parts *= 2;
    }
    out.sort_unstable_by(|a, b| b.cmp(a));
    out.dedup();
    out
}

/// `trace` with every fused loss working on `chunk` rows at a time.
pub fn with_chunk(trace: &Trace, chunk: usize) -> Trace {
    let mut t = trace.clone();
    for n in &mut t.nodes {
        if let Op::LinearCrossEntropy { chunk: c, .. }
        | Op::LinearCrossEntropyBackward { chunk: c, .. }
        | Op::LinearCrossEntropyGrad { chunk: c, .. } = &mut n.op
        {
            *c = chunk;
        }
    }
    t
}

/// Plans every variant of each alternative with `remat`, predicting each one's time with `cost`.
fn variants(alts: &[Alternative], opts: &CompileOptions, cost: &dyn CostModel, remat: Remat) -> Result<Vec<Variant>> {
    let mut out = Vec::new();
    for (alt, (trace, what)) in alts.iter().enumerate() {
        let o = CompileOptions { remat, ..opts.clone() };
        let chunks = if opts.choose { chunk_candidates(trace) } else { Vec::new() };
        let rows = trace
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::LinearCrossEntropy { .. } | Op::LinearCrossEntropyGrad { .. }))
            .map_or(0, |n| trace.ty(n.args[0]).dims()[0]);
        if chunks.is_empty() {
            let planned = plan(trace, &o)?;
            let seconds = trace_seconds(cost, &planned.trace);
            out.push(Variant { planned, seconds, label: what.clone(), alt });
        }
        for c in chunks {
            let planned = plan(&with_chunk(trace, c), &o)?;
            let seconds = trace_seconds(cost, &planned.trace);
            let label = format!("linear_cross_entropy chunk {c} rows ({} chunks)", rows.div_ceil(c.max(1)));
            out.push(Variant { planned, seconds, label: join(what, &label), alt });
        }
    }
    Ok(out)
}

/// The variant `budget` picks (see the module doc), and a line on each one weighed.
pub fn choose(alts: &[Alternative], opts: &CompileOptions, cost: &dyn CostModel) -> Result<(Variant, Vec<String>)> {
    let target = match opts.budget {
        Budget::Fastest => None,
        Budget::Bytes(b) => Some(b),
        Budget::Auto => opts.free_bytes.map(|f| f - (f as f64 * AUTO_MARGIN) as usize),
        Budget::Min => return min_peak(alts, opts, cost),
    };
    let plain = variants(alts, opts, cost, opts.remat)?;
    let Some(b) = target else {
        let lines = weighed(&plain);
        let lean = if cost.is_measured() { MEASURED_LEAN_TOLERANCE } else { LEAN_TOLERANCE };
        let i = fastest_lean(&plain.iter().map(|v| (v.seconds, v.peak())).collect::<Vec<_>>(), lean)
            .ok_or_else(|| Error::Plan("compile: no variant was planned".into()))?;
        let pick = plain.into_iter().nth(i).ok_or_else(|| Error::Plan("compile: no variant was planned".into()))?;
        return Ok((pick, lines));
    };
    let mut all = Vec::new();
    for v in plain {
        if v.peak() <= b {
            all.push(v);
        } else {
            // Recompute to fit, if that can (the trace of this variant, before planning).
            let again = variants_one(&v, alts, opts, cost, Remat::Budget { peak_bytes: b })?;
            all.push(v);
            all.push(again);
        }
    }
    let lines = weighed(&all);
    let fits = all.into_iter().filter(|v| v.peak() <= b).min_by(|x, y| x.seconds.total_cmp(&y.seconds));
    match fits {
        Some(mut v) => {
            v.planned.report.budget_bytes = Some(b);
            Ok((v, lines))
        }
        None => {
            // The smallest feasible peak (the `min` plan is within PEAK_TOLERANCE of it).
            let (mut least, least_lines) = min_peak(alts, opts, cost)?;
            // Recomputing everything that lowers the peak can fit where recomputing just
            // enough (as the model predicted it) did not.
            if least.peak() <= b {
                least.planned.report.budget_bytes = Some(b);
                return Ok((least, lines.into_iter().chain(least_lines).collect()));
            }
            Err(Error::Plan(format!(
                "the memory budget of {} cannot be met: the smallest feasible peak is {} ({} bytes{}{})",
                fmt_bytes(b),
                fmt_bytes(least.peak()),
                least.peak(),
                if least.label.is_empty() { "" } else { ", " },
                least.label
            )))
        }
    }
}

/// The index `Budget::Fastest` picks among `(seconds, peak)` variants (see the module doc):
/// among those within `lean_tolerance` of the fastest, the fastest of the peaks within
/// [`PEAK_TOLERANCE`] of their smallest.
pub fn fastest_lean(all: &[(f64, usize)], lean_tolerance: f64) -> Option<usize> {
    let fastest = all.iter().map(|v| v.0).fold(f64::INFINITY, f64::min);
    let near: Vec<(usize, (f64, usize))> =
        all.iter().copied().enumerate().filter(|v| v.1.0 <= fastest * (1.0 + lean_tolerance)).collect();
    let least = near.iter().map(|v| v.1.1).min()?;
    near.into_iter()
        .filter(|v| v.1.1 as f64 <= least as f64 * (1.0 + PEAK_TOLERANCE))
        .min_by(|x, y| x.1.0.total_cmp(&y.1.0).then(x.1.1.cmp(&y.1.1)))
        .map(|v| v.0)
}

/// Variant `v` planned again with `remat`.
fn variants_one(
    v: &Variant,
    alts: &[Alternative],
    opts: &CompileOptions,
    cost: &dyn CostModel,
    remat: Remat,
) -> Result<Variant> {
    let chunk = v.planned.trace.nodes.iter().find_map(|n| match n.op {
        Op::LinearCrossEntropy { chunk, .. } | Op::LinearCrossEntropyGrad { chunk, .. } => Some(chunk),
        _ => None,
    });
    let trace = &alts[v.alt].0;
    let t = match chunk {
        Some(c) => with_chunk(trace, c),
        None => trace.clone(),
    };
    let planned = plan(&t, &CompileOptions { remat, ..opts.clone() })?;
    let seconds = trace_seconds(cost, &planned.trace);
    let label = match &remat {
        Remat::Off => v.label.clone(),
        _ if v.label.is_empty() => "recomputation".to_string(),
        _ => format!("{}, recomputation", v.label),
    };
    Ok(Variant { planned, seconds, label, alt: v.alt })
}

/// Every variant, and those of least scratch again with every recomputation that lowers the
/// peak; picks the fastest within [`PEAK_TOLERANCE`] of the smallest peak.
fn min_peak(alts: &[Alternative], opts: &CompileOptions, cost: &dyn CostModel) -> Result<(Variant, Vec<String>)> {
    let mut all = variants(alts, opts, cost, Remat::Off)?;
    // Recompute on the variants of least scratch only: the others only add scratch at the
    // same saved values.
    let least = all.iter().map(|v| v.peak()).min().unwrap_or(0);
    let mut more = Vec::new();
    for v in all.iter().filter(|v| v.peak() as f64 <= least as f64 * (1.0 + PEAK_TOLERANCE)) {
        more.push(variants_one(v, alts, opts, cost, Remat::Budget { peak_bytes: 0 })?);
    }
    all.extend(more);
    let lines = weighed(&all);
    let least = all.iter().map(|v| v.peak()).min().unwrap_or(0);
    let pick = all
        .into_iter()
        .filter(|v| v.peak() as f64 <= least as f64 * (1.0 + PEAK_TOLERANCE))
        .min_by(|x, y| x.seconds.total_cmp(&y.seconds).then(x.peak().cmp(&y.peak())))
        .ok_or_else(|| Error::Plan("compile: no variant was planned".into()))?;
    Ok((pick, lines))
}

/// One line per variant: its choices, predicted time and peak.
fn weighed(all: &[Variant]) -> Vec<String> {
    all.iter()
        .map(|v| {
            format!(
                "{}: predicted {:.3} ms, peak {}",
                if v.label.is_empty() { "as traced" } else { &v.label },
                v.seconds * 1e3,
                fmt_bytes(v.peak())
            )
        })
        .collect()
}
