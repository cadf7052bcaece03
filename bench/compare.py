"""Puts rumble's and the references' measurements side by side.

usage: python3 bench/compare.py RESULTS.jsonl [--markdown]

Reads JSON lines from `rumble bench --json` and bench/reference/torch_ref.py (keys: workload,
executor, peak_allocated_bytes, device_used_bytes, first_step_ms, median_step_ms; rumble's also
load_bytes and arena_bytes) and prints one table per workload, then the ratios of rumble's
graphed executor to the best reference (below 1.0 means rumble is better).
"""
import json
import sys

MB = 1e6


def fmt(v, scale=1.0, digits=1):
    return "" if v is None else f"{v / scale:,.{digits}f}"


def main():
    rows = []
    for line in open(sys.argv[1]):
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
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
                print(f"| {r['executor']} | failed | | | | | |")
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


if __name__ == "__main__":
    main()
