"""Puts rumble's and the references' measurements side by side.

usage: python3 bench/compare.py RESULTS.jsonl|-        the tables (markdown)
       python3 bench/compare.py --brief RESULTS.jsonl|-  one short line for the lines given

Reads JSON lines from `rumble bench --json` and bench/reference/torch_ref.py (keys: workload,
executor, peak_allocated_bytes, device_used_bytes, first_step_ms, median_step_ms; rumble's also
load_bytes and arena_bytes; lines with "failed": true stand for a process that printed none).

Lines without a `case` key (the presets) make one table per workload, then the ratios of
rumble's graphed executor to the best reference (below 1.0: rumble is better). Lines with a
`case` key (the suite, `rumble bench --suite` and `torch_ref.py --suite`) make one table, a row
per case: each executor's median step and peak, rumble's ratios to torch.compile
mode="reduce-overhead" (RO), and the model FLOPs utilisation (MFU) of each, from the line's
`flops_per_step` (the formula is in BENCHMARKS.md) against the H200's dense bf16 peak.
A reference's peak is the larger of its first-step and later peaks (RO allocates its graph pool
on the steps after the first). Each case takes its last rumble line and, where that line names
its `gpu`, the last reference lines of the same GPU only (older rumble lines name none).
"""
import json
import statistics
import sys

MB = 1e6
GB = 1e9
PEAK_FLOPS = 989e12  # H200 SXM, dense bf16 tensor cores


def fmt(v, scale=1.0, digits=1):
    return "" if v is None else f"{v / scale:,.{digits}f}"


def read(path):
    rows = []
    for line in sys.stdin if path == "-" else open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def peak(r):
    """The most bytes allocated at once in the process's steps."""
    vals = [r.get(k) for k in ("peak_allocated_bytes", "peak_allocated_later_bytes")]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def mfu(r):
    f, ms = r.get("flops_per_step"), r.get("median_step_ms")
    return f / (ms / 1e3) / PEAK_FLOPS if f and ms else None


def brief(rows):
    parts = []
    for r in rows:
        if r.get("failed") or r.get("error"):
            parts.append(f"{r.get('executor')}: {r.get('error', 'failed')}"[:160])
            continue
        s = f"{r.get('executor')} {fmt(r.get('median_step_ms'), digits=2)} ms"
        if peak(r) is not None:
            s += f" peak {fmt(peak(r), GB, 2)} GB"
        if mfu(r) is not None:
            s += f" MFU {100 * mfu(r):.0f}%"
        parts.append(s)
    return "; ".join(parts)


def presets(rows):
    workloads = []
    for r in rows:
        if r.get("workload") not in workloads:
            workloads.append(r.get("workload"))
    for w in workloads:
        print(f"\n### {w}\n")
        print("| executor | peak allocated MB | device used MB | LOAD MB | arena/LOAD | first step ms | median step ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        mine = [r for r in rows if r.get("workload") == w]
        for r in mine:
            if r.get("failed"):
                print(f"| {r['executor']} | failed: {r.get('error', '')} | | | | | |")
                continue
            ratio = ""
            if r.get("load_bytes") and r.get("arena_bytes"):
                ratio = f"{r['arena_bytes'] / r['load_bytes']:.3f}"
            print(f"| {r['executor']} | {fmt(r.get('peak_allocated_bytes'), MB)} | {fmt(r.get('device_used_bytes'), MB)} "
                  f"| {fmt(r.get('load_bytes'), MB)} | {ratio} | {fmt(r.get('first_step_ms'))} "
                  f"| {fmt(r.get('median_step_ms'), digits=2)} |")
        graphed = next((r for r in mine if r.get("executor") == "rumble-graphed" and not r.get("failed")), None)
        refs = [r for r in mine if not r.get("executor", "").startswith("rumble") and not r.get("failed")]
        if graphed and refs:
            best_peak = min(refs, key=lambda r: r["peak_allocated_bytes"])
            best_step = min(refs, key=lambda r: r["median_step_ms"] or float("inf"))
            print(f"\nrumble-graphed / best reference: peak {graphed['peak_allocated_bytes'] / best_peak['peak_allocated_bytes']:.2f}x "
                  f"(vs {best_peak['executor']}), step {graphed['median_step_ms'] / best_step['median_step_ms']:.2f}x "
                  f"(vs {best_step['executor']})")


def suite(rows):
    cases = []
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
    execs = []
    for r in rows:
        e = r.get("executor", "?")
        if e.startswith("rumble"):
            continue
        if e not in execs:
            execs.append(e)

    def get(c, pred, gpu=None):
        # The last line of a case and executor: files keep older sessions above newer ones.
        # With `gpu` (rumble's line names its GPU), only lines of that GPU: a ratio is between
        # runs on one kind of card.
        hits = [r for r in rows if r["case"] == c and pred(r.get("executor", ""))
                and not budgeted(r) and (gpu is None or r.get("gpu") == gpu)]
        return hits[-1] if hits else None

    def cell(r):
        if r is None:
            return " | "
        if r.get("failed") or r.get("error"):
            return f"error: {str(r.get('error', 'failed'))[:60]} | "
        return f"{fmt(r.get('median_step_ms'), digits=2)} | {fmt(peak(r), GB, 2)}"

    print("\n### suite\n")
    head = "| case | batch x seq | layers | GFLOP/step | rumble ms | rumble GB |"
    for e in execs:
        head += f" {e} ms | {e} GB |"
    head += " step / RO | peak / RO | MFU rumble | MFU RO |"
    print(head)
    print("| " + " | ".join(["---"] + ["---:"] * (head.count("|") - 2)) + " |")
    ratios, peaks, mfus, mfus_ro = [], [], [], []
    for c in cases:
        mine = get(c, lambda e: e.startswith("rumble"))
        gpu = mine.get("gpu") if mine else None
        ro = get(c, lambda e: e == "torch-compile-ro", gpu)
        ok = [r for r in (mine, ro) if r and not r.get("failed") and not r.get("error")]
        shape = next((r for r in ok), None) or next((r for r in rows if r["case"] == c and "batch" in r), {})
        flops = shape.get("flops_per_step")
        line = (f"| {c} | {shape.get('batch', '')} x {shape.get('seq', '')} | {shape.get('layers', '')} "
                f"| {fmt(flops, 1e9, 0)} | {cell(mine)} |")
        for e in execs:
            line += f" {cell(get(c, lambda x, e=e: x == e, gpu))} |"
        good = mine in ok and ro in ok
        if good:
            r_step = mine["median_step_ms"] / ro["median_step_ms"]
            r_peak = peak(mine) / peak(ro) if peak(mine) and peak(ro) else None
            ratios.append(r_step)
            if r_peak is not None:
                peaks.append(r_peak)
            line += f" {r_step:.2f} | {fmt(r_peak, 1, 2)} |"
        else:
            line += " | |"
        m, m_ro = (mfu(mine) if mine in ok else None), (mfu(ro) if ro in ok else None)
        if m is not None:
            mfus.append(m)
        if m_ro is not None:
            mfus_ro.append(m_ro)
        line += f" {'' if m is None else f'{100 * m:.0f}%'} | {'' if m_ro is None else f'{100 * m_ro:.0f}%'} |"
        print(line)
    print()
    if ratios:
        print(f"rumble / RO step: median {statistics.median(ratios):.2f}x, worst {max(ratios):.2f}x, "
              f"{sum(r <= 0.9 for r in ratios)} of {len(ratios)} cases at or below 0.9x")
    if peaks:
        print(f"rumble / RO peak: median {statistics.median(peaks):.2f}x, worst {max(peaks):.2f}x, "
              f"{sum(p <= 1.0 for p in peaks)} of {len(peaks)} cases at or below RO's peak")
    if mfus:
        print(f"mean MFU: rumble {100 * statistics.mean(mfus):.1f}% over {len(mfus)} cases"
              + (f", RO {100 * statistics.mean(mfus_ro):.1f}% over {len(mfus_ro)}" if mfus_ro else ""))
    for r in rows:
        if (r.get("flops_per_step") and mine_flops(rows, r["case"])
                and abs(r["flops_per_step"] / mine_flops(rows, r["case"]) - 1) > 1e-3):
            print(f"warning: {r['case']} {r.get('executor')}: flops_per_step {r['flops_per_step']:.4g} "
                  f"differs from rumble's {mine_flops(rows, r['case']):.4g}")


def budgeted(r):
    """A rumble line run under an explicit --memory-budget (scripts/gpu's RO_BUDGETS)."""
    return r.get("ro_fraction") is not None or r.get("memory_budget") not in (None, "fastest")


def budget_runs(rows):
    """rumble under a memory budget beside its default plan and RO, per case."""
    runs = [r for r in rows if budgeted(r)]
    if not runs:
        return
    print("\n### suite under a memory budget\n")
    print("| case | budget | rumble ms | rumble GB | step / RO | step / default | chosen |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in runs:
        c = r["case"]
        if r.get("failed") or r.get("error"):
            print(f"| {c} | {r.get('ro_fraction', '')}x RO | error: {str(r.get('error', 'failed'))[:120]} | | | | |")
            continue
        gpu = r.get("gpu")
        same = [x for x in rows if x["case"] == c and not budgeted(x) and not x.get("failed")
                and (gpu is None or x.get("gpu") == gpu)]
        ro = [x for x in same if x.get("executor") == "torch-compile-ro"]
        mine = [x for x in same if x.get("executor", "").startswith("rumble")]
        ms = r.get("median_step_ms")
        vs_ro = f"{ms / ro[-1]['median_step_ms']:.2f}" if ro and ms else ""
        vs_def = f"{ms / mine[-1]['median_step_ms']:.2f}" if mine and ms else ""
        print(f"| {c} | {r.get('memory_budget')} | {fmt(ms, digits=2)} | {fmt(peak(r), GB, 2)} | {vs_ro} "
              f"| {vs_def} | {r.get('chosen', '')} |")


def mine_flops(rows, case):
    r = next((r for r in rows if r.get("case") == case and r.get("executor", "").startswith("rumble")
              and r.get("flops_per_step")), None)
    return r and r["flops_per_step"]


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    if args[0] == "--brief":
        print(brief(read(args[1] if len(args) > 1 else "-")))
        return
    rows = read(args[0])
    preset_rows = [r for r in rows if "case" not in r]
    suite_rows = [r for r in rows if "case" in r]
    if preset_rows:
        presets(preset_rows)
    if suite_rows:
        suite(suite_rows)
        budget_runs(suite_rows)


if __name__ == "__main__":
    main()
