"""Turn one bench run per policy into report.json and report.md (pure: data in, dicts and text out).

Inputs per row (a policy, or another router): the Locust users' per-request records, the replicas' counters
over the run (prefix-cache queries and hits, finished requests) and their load gauges sampled every second.
Latencies are exact nearest-rank percentiles over the records (Locust's own are bucketed). All times are
engine seconds: wall-clock durations multiplied by the simulator's time scale, so a run sped up or slowed down
reports what the simulated hardware would show.

Definitions: `hit_rate` = prefix-cache hits ÷ queries summed over replicas (tokens, as vLLM counts them);
`goodput_per_s` = requests per second that finished without error and with TTFT ≤ the SLO; a replica's
`busy` = share of samples with a request running or waiting; `queue_mean` = mean waiting requests;
`load_generator_lag_p99_wall_s` = how late Locust sent requests against the schedule (a loaded client machine
shows here rather than as a silently lower rate). Past `LATENESS_WARN_S` the console table and report.md say
so in a warning: the rows were then not sent the same load, and the verdict reflects the machine too.
report.md links the plots listed in the report's "plots" (names of the PNGs written beside it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LATENESS_WARN_S = 0.1
"""p99 lateness of the load generator (wall seconds) above which a comparison is flagged as machine-bound."""

PLOT_TITLES = {
    "ttft_cdf.png": "TTFT CDF",
    "ttft_over_time.png": "TTFT over time",
    "replica_load.png": "Requests per replica over time, and shares",
}

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
FINISHED = "vllm:e2e_request_latency_seconds_count"


@dataclass(frozen=True, slots=True)
class LoadSample:
    t_s: float
    """Wall seconds since the row's load started."""
    replica: str
    running: float
    waiting: float
    kv_usage: float


@dataclass(slots=True)
class RowData:
    name: str
    records: list[dict[str, Any]]
    scheduled: int
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    """Replica -> counter deltas over the run."""
    samples: list[LoadSample] = field(default_factory=list)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut short when Locust was stopped
    return records


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def counter_deltas(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float]:
    if after is None:
        return {}
    start = before or {}
    return {name: value - start.get(name, 0.0) for name, value in after.items()}


def summarize(row: RowData, *, time_scale: float = 1.0, slo_ttft_s: float = 2.0) -> dict[str, Any]:
    ok = [r for r in row.records if r.get("error") is None and r.get("ttft_s") is not None]
    errors = sum(1 for r in row.records if r.get("error") is not None)
    ttft = [r["ttft_s"] * time_scale for r in ok]
    e2e = [r["e2e_s"] * time_scale for r in ok if r.get("e2e_s") is not None]
    itl = [r["itl_mean_s"] * time_scale for r in ok if r.get("itl_mean_s") is not None]
    span = _span(row.records) * time_scale
    output_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    good = sum(1 for value in ttft if value <= slo_ttft_s)
    queries = sum(c.get(QUERIES, 0.0) for c in row.counters.values())
    hits = sum(c.get(HITS, 0.0) for c in row.counters.values())
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = sum(int(r.get("cached_tokens") or 0) for r in ok)
    lags = [max(0.0, r["start_s"] - r["due_s"]) for r in row.records if "due_s" in r]
    return {
        "scheduled": row.scheduled,
        "completed": len(ok),
        "errors": errors,
        "incomplete": max(0, row.scheduled - len(row.records)),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "itl_p50": percentile(itl, 50),
        "requests_per_s": len(ok) / span if span else None,
        "output_tokens_per_s": output_tokens / span if span else None,
        "goodput_per_s": good / span if span else None,
        "goodput_fraction": good / row.scheduled if row.scheduled else None,
        "hit_rate": hits / queries if queries else None,
        "client_cached_fraction": cached / prompt if prompt else None,
        "replicas": _replicas(row),
        "load_generator_lag_p99_wall_s": percentile(lags, 99),
    }


def _span(records: Sequence[Mapping[str, Any]]) -> float:
    starts = [float(r["start_s"]) for r in records if r.get("start_s") is not None]
    ends = [float(r["start_s"]) + float(r["e2e_s"]) for r in records if r.get("e2e_s") is not None]
    if not starts or not ends:
        return 0.0
    return max(ends) - min(starts)


def _replicas(row: RowData) -> dict[str, dict[str, float | None]]:
    finished = {name: c.get(FINISHED, 0.0) for name, c in row.counters.items()}
    if not any(finished.values()):
        # Other routers' runs against other fleets: fall back to the router's response header.
        finished = {}
        for record in row.records:
            if record.get("replica"):
                finished[record["replica"]] = finished.get(record["replica"], 0.0) + 1
    total = sum(finished.values())
    names = sorted(set(finished) | {s.replica for s in row.samples})
    result: dict[str, dict[str, float | None]] = {}
    for name in names:
        samples = [s for s in row.samples if s.replica == name]
        counters = row.counters.get(name, {})
        queries = counters.get(QUERIES, 0.0)
        result[name] = {
            "share": finished.get(name, 0.0) / total if total else None,
            "requests": finished.get(name, 0.0),
            "hit_rate": counters.get(HITS, 0.0) / queries if queries else None,
            "busy": sum(1 for s in samples if s.running + s.waiting > 0) / len(samples) if samples else None,
            "queue_mean": sum(s.waiting for s in samples) / len(samples) if samples else None,
            "queue_max": max((s.waiting for s in samples), default=None),
            "kv_usage_max": max((s.kv_usage for s in samples), default=None),
        }
    return result


def _fmt(value: Any, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "–"
    return f"{value / base:.2f}×"


def render_markdown(report: Mapping[str, Any]) -> str:
    rows: Mapping[str, Mapping[str, Any]] = report["results"]
    params: Mapping[str, Any] = report["parameters"]
    lines = [f"# kvrouter bench: {params.get('workload')}", ""]
    lines += [
        "| row | TTFT p50 s | TTFT p90 s | TTFT p99 s | e2e p50 s | e2e p99 s | req/s | output tok/s "
        "| goodput/s | prefix hit | errors | busiest replica share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        shares = [v["share"] for v in r["replicas"].values() if v.get("share") is not None]
        lines.append(
            f"| {name} | {_fmt(r['ttft_p50'], 3)} | {_fmt(r['ttft_p90'], 3)} | {_fmt(r['ttft_p99'], 3)} "
            f"| {_fmt(r['e2e_p50'], 2)} | {_fmt(r['e2e_p99'], 2)} | {_fmt(r['requests_per_s'], 2)} "
            f"| {_fmt(r['output_tokens_per_s'], 0)} | {_fmt(r['goodput_per_s'], 2)} | {_pct(r['hit_rate'])} "
            f"| {r['errors'] + r['incomplete']} | {_pct(max(shares) if shares else None)} |"
        )
    baseline = str(report.get("baseline"))
    if baseline in rows and len(rows) > 1:
        base = rows[baseline]
        lines += ["", f"Ratios against {baseline}:", ""]
        lines += ["| row | TTFT p50 | TTFT p99 | e2e p99 | prefix hit | goodput |", "|---|---|---|---|---|---|"]
        for name, r in rows.items():
            if name == baseline:
                continue
            lines.append(
                f"| {name} | {_ratio(r['ttft_p50'], base['ttft_p50'])} | {_ratio(r['ttft_p99'], base['ttft_p99'])} "
                f"| {_ratio(r['e2e_p99'], base['e2e_p99'])} | {_ratio(r['hit_rate'], base['hit_rate'])} "
                f"| {_ratio(r['goodput_per_s'], base['goodput_per_s'])} |"
            )
    lines += ["", "Per replica (share of requests, prefix hit, busy = share of samples with work, mean/max queue, "
              "peak KV use):", "", "| row | replica | share | hit | busy | queue mean | queue max | KV peak |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows.items():
        for replica, v in r["replicas"].items():
            lines.append(
                f"| {name} | {replica} | {_pct(v.get('share'))} | {_pct(v.get('hit_rate'))} | {_pct(v.get('busy'))} "
                f"| {_fmt(v.get('queue_mean'), 1)} | {_fmt(v.get('queue_max'), 0)} | {_pct(v.get('kv_usage_max'))} |"
            )
    for name, reason in (report.get("failed") or {}).items():
        lines += ["", f"{name}: did not run ({reason.splitlines()[0] if reason else 'no reason'})."]
    lines += ["", lateness_line(rows) + "."]
    warning = lateness_warning(rows)
    if warning:
        lines += ["", f"**{warning}**"]
    plots = [name for name in report.get("plots") or () if name in PLOT_TITLES]
    if plots:
        lines += ["", "Plots:", ""]
        lines += [f"- [{PLOT_TITLES[name]}]({name})" for name in plots]
    lines += ["", "Parameters:", ""]
    lines += [f"- {key}: `{value}`" for key, value in params.items()]
    lines += [
        "",
        "Times are engine seconds (wall time × the simulator's time scale). Goodput counts requests with TTFT ≤ "
        f"{params.get('slo_ttft_s')} s. Prefix hit = replicas' prefix-cache hits ÷ queries (tokens).",
        "",
    ]
    return "\n".join(lines)


def write_report(out: Path, report: Mapping[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")


def lateness_line(rows: Mapping[str, Mapping[str, Any]]) -> str:
    lags = ", ".join(f"{name} {_ms(r.get('load_generator_lag_p99_wall_s'))}" for name, r in rows.items())
    return f"Load generator lateness (p99 of send time minus scheduled time, wall): {lags}"


def lateness_warning(rows: Mapping[str, Mapping[str, Any]], threshold_s: float = LATENESS_WARN_S) -> str | None:
    """A warning when the load generator fell behind its schedule on any row; None when it kept up."""
    late = {
        name: float(r["load_generator_lag_p99_wall_s"])
        for name, r in rows.items()
        if r.get("load_generator_lag_p99_wall_s") is not None and r["load_generator_lag_p99_wall_s"] > threshold_s
    }
    if not late:
        return None
    worst = max(late, key=lambda name: late[name])
    return (
        f"WARNING: the load generator fell behind its schedule (p99 lateness {_ms(late[worst])} on {worst}, over "
        f"{_ms(threshold_s)}): this machine was too busy to send the same load to every row, so the comparison "
        "measures the machine as well as the routing. Rerun on a quieter machine (fewer other processes)."
    )


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.0f} ms"


def console_table(report: Mapping[str, Any]) -> str:
    """A compact table for the terminal."""
    rows: Mapping[str, Mapping[str, Any]] = report["results"]
    header = (
        f"{'row':<16} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p99':>9} {'req/s':>7} {'goodput':>8} {'hit':>7} {'err':>4}"
    )
    lines = [header, "-" * len(header)]
    for name, r in rows.items():
        lines.append(
            f"{name:<16} {_fmt(r['ttft_p50'], 3):>9} {_fmt(r['ttft_p99'], 3):>9} {_fmt(r['e2e_p99'], 2):>9} "
            f"{_fmt(r['requests_per_s'], 2):>7} {_fmt(r['goodput_per_s'], 2):>8} {_pct(r['hit_rate']):>7} "
            f"{r['errors'] + r['incomplete']:>4}"
        )
    baseline = str(report.get("baseline"))
    if baseline in rows:
        base = rows[baseline]
        for name, r in rows.items():
            if name != baseline:
                lines.append(
                    f"{name} vs {baseline}: TTFT p50 {_ratio(r['ttft_p50'], base['ttft_p50'])}, "
                    f"p99 {_ratio(r['ttft_p99'], base['ttft_p99'])}, hit {_ratio(r['hit_rate'], base['hit_rate'])}"
                )
    if rows:
        lines.append(lateness_line(rows))
        warning = lateness_warning(rows)
        if warning:
            lines.append(warning)
    return "\n".join(lines)
