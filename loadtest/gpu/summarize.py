"""Median and spread of several `kvrouter bench` runs of the same rows, as one Markdown table per load.

usage: python loadtest/gpu/summarize.py LABEL=REPORT_DIR[,REPORT_DIR...] ...

Each LABEL (a load, say `12 req/s`) names one or more bench output directories (one per seed); for every row
(policy) the table gives the median over the runs and, with two runs or more, the lowest and highest in
brackets: TTFT p50 / p90 / p99, e2e p99, the replicas' own prefix-cache hit rate (vLLM's counters), per-replica
request shares (the median run's), errors and incomplete requests summed over the runs, and how many runs there
were. Reads only report.json; prints to stdout.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

COLUMNS = (("ttft_p50", "TTFT p50", "s"), ("ttft_p90", "TTFT p90", "s"), ("ttft_p99", "TTFT p99", "s"),
           ("e2e_p99", "e2e p99", "s"), ("hit_rate", "prefix hit", "%"))  # fmt: skip


def _cell(values: list[float], unit: str) -> str:
    def show(value: float) -> str:
        return f"{100 * value:.1f}%" if unit == "%" else f"{value:.3f} s"

    if not values:
        return "–"
    middle = show(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({show(min(values))} – {show(max(values))})"


def table(label: str, reports: list[dict[str, Any]]) -> str:
    rows: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        for name, result in report["results"].items():
            rows.setdefault(name, []).append(result)
    titles = " | ".join(title for _, title, _ in COLUMNS)
    head = f"| row | runs | requests | {titles} | errors | share per replica |"
    lines = [f"**{label}**", "", head, "|" + "---|" * (head.count("|") - 1)]
    for name, results in rows.items():
        cells = [_cell([r[key] for r in results if r.get(key) is not None], unit) for key, _, unit in COLUMNS]
        by_p99 = sorted(results, key=lambda r: r.get("ttft_p99") or 0.0)
        shares = by_p99[len(by_p99) // 2].get("replicas", {})
        share = " / ".join(f"{100 * s['share']:.0f}" for s in shares.values()) + " %"
        requests = "/".join(str(r["scheduled"]) for r in results)
        problems = sum(r["errors"] + r["incomplete"] for r in results)
        lines.append(f"| {name} | {len(results)} | {requests} | " + " | ".join(cells) + f" | {problems} | {share} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for argument in argv:
        label, _, dirs = argument.partition("=")
        reports = [json.loads((Path(d) / "report.json").read_text()) for d in dirs.split(",") if d]
        print(table(label, reports))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
