//! The memory timeline as an SVG picture, written by hand: live arena bytes over the schedule,
//! stacked by class, with the arena size and LOAD as lines, the phase of every step along the
//! bottom, and the biggest buffers live at the peak listed beside it.

use std::fmt::Write as _;

use super::lifetimes::{Class, Lifetimes};
use super::report::{PlanReport, fmt_bytes};
use super::{ALIGN, Region, align_up};
use crate::ir::{Phase, Trace};

const W: f64 = 1500.0;
const H: f64 = 640.0;
const X0: f64 = 90.0; // plot area
const X1: f64 = 940.0;
const Y0: f64 = 80.0;
const Y1: f64 = 540.0;
/// Most columns drawn; longer schedules are binned, each bin showing its busiest step.
const MAX_COLUMNS: usize = 1200;

/// Stacking order, bottom first: what lives long sits low.
const STACK: [Class; 6] =
    [Class::Input, Class::Saved, Class::Gradient, Class::Output, Class::Temporary, Class::Scratch];

pub fn class_color(c: Class) -> &'static str {
    match c {
        Class::Param => "#4e79a7",
        Class::OptState => "#9c755f",
        Class::State => "#edc948",
        Class::Input => "#59a14f",
        Class::Saved => "#f28e2b",
        Class::Gradient => "#e15759",
        Class::Output => "#b07aa1",
        Class::Temporary => "#bab0ac",
        Class::Scratch => "#76b7b2",
    }
}

fn phase_color(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "#a0cbe8",
        Phase::Backward => "#ffbe7d",
        Phase::Optimizer => "#8cd17d",
    }
}

/// Live arena bytes of each class at each step `0..=end` (a buffer counts once per step, for
/// the member live there: the later one where two meet).
pub fn live_by_class(trace: &Trace, lt: &Lifetimes) -> Vec<[usize; Class::ALL.len()]> {
    let steps = lt.end + 1;
    let mut diff = vec![[0i64; Class::ALL.len()]; steps + 1];
    let scratch = Class::ALL.iter().position(|&c| c == Class::Scratch).unwrap_or(Class::ALL.len() - 1);
    for b in lt.buffers.iter().filter(|b| b.region == Region::Arena) {
        if b.scratch_of.is_some() {
            diff[b.start][scratch] += b.aligned() as i64;
            diff[b.end + 1][scratch] -= b.aligned() as i64;
        }
        for (k, &m) in b.members.iter().enumerate() {
            let life = &lt.values[m.index()];
            let stop = match b.members.get(k + 1) {
                Some(next) => lt.values[next.index()].def.saturating_sub(1).max(life.def),
                None => life.last,
            };
            let c = Class::ALL.iter().position(|&c| c == life.class).unwrap_or(6);
            let bytes = align_up(trace.ty(m).size_in_bytes().max(1), ALIGN) as i64;
            diff[life.def][c] += bytes;
            diff[stop + 1][c] -= bytes;
        }
    }
    let mut acc = [0i64; Class::ALL.len()];
    diff[..steps]
        .iter()
        .map(|d| {
            let mut row = [0usize; Class::ALL.len()];
            for c in 0..Class::ALL.len() {
                acc[c] += d[c];
                row[c] = acc[c].max(0) as usize;
            }
            row
        })
        .collect()
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A tick step near `span / 5` of the form 1, 2 or 5 times a power of ten.
fn nice_step(span: f64) -> f64 {
    let raw = (span / 5.0).max(1e-12);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|&s| s >= raw).unwrap_or(10.0 * p)
}

/// Draws the timeline of a plan (see the module docs).
pub fn timeline(trace: &Trace, lt: &Lifetimes, report: &PlanReport) -> String {
    let live = live_by_class(trace, lt);
    let steps = live.len();
    let total = |s: usize| live[s].iter().sum::<usize>();
    // Columns: each covers a run of steps and shows its busiest one.
    let cols = steps.clamp(1, MAX_COLUMNS);
    let column: Vec<usize> = (0..cols)
        .map(|c| {
            let (a, b) = (c * steps / cols, ((c + 1) * steps / cols).max(c * steps / cols + 1));
            (a..b.min(steps)).max_by_key(|&s| (total(s), std::cmp::Reverse(s))).unwrap_or(a)
        })
        .collect();
    let ymax = (report.arena_bytes.max(report.load_bytes).max(1) as f64) * 1.1;
    let (unit, uname) = unit_of(ymax);
    let x = |c: f64| X0 + (X1 - X0) * c / cols as f64;
    let y = |b: f64| Y1 - (Y1 - Y0) * b / ymax;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="Helvetica, Arial, sans-serif" font-size="13">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{X0}" y="28" font-size="19" font-weight="bold">Memory timeline of `{}`</text>"#,
        esc(&report.trace)
    );
    let _ = writeln!(
        s,
        r#"<text x="{X0}" y="52" font-size="14">arena {} = {:.3} × LOAD {}  ·  persistent {} (not drawn)  ·  peak {}  ·  {} nodes</text>"#,
        fmt_bytes(report.arena_bytes),
        report.ratio(),
        fmt_bytes(report.load_bytes),
        fmt_bytes(report.persistent_bytes),
        fmt_bytes(report.peak_bytes),
        report.nodes
    );

    // Grid and y ticks.
    let step_y = nice_step(ymax / unit);
    let mut t = 0.0;
    while t * unit <= ymax {
        let yy = y(t * unit);
        let _ = writeln!(s, r##"<line x1="{X0}" y1="{yy:.1}" x2="{X1}" y2="{yy:.1}" stroke="#e6e6e6"/>"##);
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{} {uname}</text>"#,
            X0 - 8.0,
            yy + 4.0,
            trim(t)
        );
        t += step_y;
    }

    // Stacked classes, bottom first, as step-shaped areas.
    let mut base = vec![0usize; cols];
    for class in STACK {
        let ci = Class::ALL.iter().position(|&c| c == class).unwrap_or(6);
        let top: Vec<usize> = (0..cols).map(|c| base[c] + live[column[c]][ci]).collect();
        if top == base {
            continue;
        }
        let mut d = String::new();
        for (c, &tc) in top.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.2},{:.2} L{:.2},{:.2} ",
                if c == 0 { "M" } else { "L" },
                x(c as f64),
                y(tc as f64),
                x(c as f64 + 1.0),
                y(tc as f64)
            );
        }
        for c in (0..cols).rev() {
            let _ = write!(
                d,
                "L{:.2},{:.2} L{:.2},{:.2} ",
                x(c as f64 + 1.0),
                y(base[c] as f64),
                x(c as f64),
                y(base[c] as f64)
            );
        }
        let _ = writeln!(s, r#"<path d="{d}Z" fill="{}" stroke="none"/>"#, class_color(class));
        base = top;
    }

    // Arena and LOAD lines.
    for (bytes, label, dash, dy) in
        [(report.arena_bytes, "arena", "8 4", -6.0), (report.load_bytes, "LOAD", "2 3", 14.0)]
    {
        let yy = y(bytes as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{X0}" y1="{yy:.1}" x2="{X1}" y2="{yy:.1}" stroke="#222" stroke-width="1.5" stroke-dasharray="{dash}"/>"##
        );
        let label_y = if report.arena_bytes == report.load_bytes && label == "LOAD" { yy - 20.0 } else { yy + dy };
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{label_y:.1}" text-anchor="end" font-weight="bold">{label} {}</text>"#,
            X1 - 4.0,
            fmt_bytes(bytes)
        );
    }

    // The peak.
    let peak_col = column.iter().position(|&st| st >= report.load_step).unwrap_or(0);
    let px = x(peak_col as f64 + 0.5);
    let _ = writeln!(s, r##"<line x1="{px:.1}" y1="{Y0}" x2="{px:.1}" y2="{Y1}" stroke="#c00" stroke-width="1.2"/>"##);
    let anchor = if px > (X0 + X1) / 2.0 { "end" } else { "start" };
    let tx = if anchor == "end" { px - 5.0 } else { px + 5.0 };
    let _ = writeln!(
        s,
        r##"<text x="{tx:.1}" y="{:.1}" fill="#c00" text-anchor="{anchor}">peak at step {}</text>"##,
        Y0 + 14.0,
        report.load_step
    );

    // Axes, x ticks and the phase strip.
    let _ = writeln!(s, r##"<line x1="{X0}" y1="{Y1}" x2="{X1}" y2="{Y1}" stroke="#222"/>"##);
    let _ = writeln!(s, r##"<line x1="{X0}" y1="{Y0}" x2="{X0}" y2="{Y1}" stroke="#222"/>"##);
    let step_x = nice_step(steps as f64).max(1.0);
    let mut t = 0.0;
    while t < steps as f64 {
        let xx = X0 + (X1 - X0) * t / steps as f64;
        let _ = writeln!(s, r##"<line x1="{xx:.1}" y1="{Y1}" x2="{xx:.1}" y2="{:.1}" stroke="#222"/>"##, Y1 + 4.0);
        let _ = writeln!(s, r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, Y1 + 17.0, trim(t));
        t += step_x;
    }
    let strip = Y1 + 26.0;
    for (c, &st) in column.iter().enumerate() {
        let phase = if st == 0 || st > trace.nodes.len() { None } else { Some(trace.nodes[st - 1].phase) };
        if let Some(p) = phase {
            let _ = writeln!(
                s,
                r#"<rect x="{:.2}" y="{strip}" width="{:.2}" height="10" fill="{}"/>"#,
                x(c as f64),
                (x(c as f64 + 1.0) - x(c as f64)).max(0.5),
                phase_color(p)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">phase</text>"#,
        X0 - 8.0,
        strip + 9.0
    );
    let mut lx = X0;
    for p in [Phase::Forward, Phase::Backward, Phase::Optimizer] {
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="10" fill="{}"/>"#,
            strip + 18.0,
            phase_color(p)
        );
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#, lx + 16.0, strip + 27.0, p.name());
        lx += 100.0;
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step (node i runs at step i + 1)</text>"#,
        (X0 + X1) / 2.0,
        strip + 27.0
    );

    // Legend and the biggest buffers at the peak.
    let rx = X1 + 30.0;
    let mut ry = Y0;
    let _ = writeln!(s, r#"<text x="{rx}" y="{ry}" font-weight="bold">bytes at the peak, by class</text>"#);
    ry += 8.0;
    for class in STACK.iter().rev() {
        let Some(cb) = report.classes.iter().find(|c| c.class == *class && c.values > 0) else { continue };
        ry += 20.0;
        let _ = writeln!(
            s,
            r#"<rect x="{rx}" y="{:.1}" width="14" height="14" fill="{}"/>"#,
            ry - 11.0,
            class_color(*class)
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{ry:.1}">{} — {}</text>"#,
            rx + 20.0,
            class.name().replace('_', " "),
            fmt_bytes(cb.at_peak)
        );
    }
    for class in [Class::Param, Class::OptState, Class::State] {
        let Some(cb) = report.classes.iter().find(|c| c.class == class && c.values > 0) else { continue };
        ry += 20.0;
        let _ = writeln!(
            s,
            r##"<rect x="{rx}" y="{:.1}" width="14" height="14" fill="none" stroke="{}" stroke-width="2"/>"##,
            ry - 11.0,
            class_color(class)
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{ry:.1}">{} — {} (persistent, not drawn)</text>"#,
            rx + 20.0,
            class.name().replace('_', " "),
            fmt_bytes(cb.at_peak)
        );
    }
    ry += 34.0;
    let _ = writeln!(s, r#"<text x="{rx}" y="{ry}" font-weight="bold">biggest buffers live at the peak</text>"#);
    let room = ((H - ry - 20.0) / 18.0).max(0.0) as usize;
    for p in report.at_peak.iter().take(room) {
        ry += 18.0;
        let _ = writeln!(
            s,
            r#"<rect x="{rx}" y="{:.1}" width="10" height="10" fill="{}"/>"#,
            ry - 9.0,
            class_color(p.class)
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{ry:.1}" font-size="12">{:>9}  {} = {} {} · steps {}–{}</text>"#,
            rx + 16.0,
            fmt_bytes(p.bytes),
            esc(&p.name),
            esc(&p.op),
            esc(&p.ty),
            p.def,
            p.last
        );
    }
    s.push_str("</svg>\n");
    s
}

fn unit_of(max: f64) -> (f64, &'static str) {
    let units = [(1024f64.powi(3), "GiB"), (1024f64.powi(2), "MiB"), (1024.0, "KiB")];
    units.into_iter().find(|(u, _)| max >= 2.0 * u).unwrap_or((1.0, "B"))
}

fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}
