"""A replay's results: the bench report's fields per policy, a table, per-request CSVs and a TTFT CDF plot.

Fields follow `kvrouter.loadgen.report` (times in seconds, nearest-rank percentiles): ttft_p50/p90/p99,
e2e_p50/p99, requests_per_s and output_tokens_per_s over the span from the first arrival to the last finish,
hit_rate = prompt tokens the engines served from cache ÷ prompt tokens, and per replica its share of requests and
its `prefill_share` of the prompt tokens the fleet computed (not served from cache: the work a replica's speed
pays for).
Replay adds `predicted_hit_rate` (what the router believed was cached where it sent each request), preemptions,
and the floor: each request's TTFT alone on an idle engine with the best cache any earlier request could have
left (`floor_ttft_p50`/`p99`), the bound no routing can beat. `itl_p50`/`itl_p99` are percentiles of each
request's mean inter-token latency (the bench's `itl_mean_s`). A disaggregated fleet adds `pd`: requests split,
the plan reasons and the KV transfer times; a split request's prompt counts towards its prefill worker's
`prefill_share` and `hit_rate`, its request towards its decode worker's `share`.
`tail` says where the slowest 1% spent their TTFT (router queue, engine queue, in the engine; `tail_summary`), and
each request's CSV row has the same split (`queued_ms`, `engine_wait_ms`): the start of a diagnosis of the tail.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from kvrouter.loadgen.plots import save_figure
from kvrouter.loadgen.report import percentile
from kvrouter.replay.driver import ReplayResult, RequestRecord

CSV_FIELDS = (
    "trace_index",
    "replica",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "predicted_cached_tokens",
    "ttft_ms",
    "e2e_ms",
    "floor_ttft_ms",
    "preemptions",
    "tenant",
    "band",
    "queued_ms",
    "rejected",
    "itl_ms",
    "pd_reason",
    "prefill_replica",
    "transfer_ms",
    "engine_wait_ms",
)


def summarize(result: ReplayResult, floors: Sequence[float] | None = None) -> dict[str, Any]:
    records = result.records
    done = [r for r in records if r.finish is not None and r.first_token is not None]
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    e2e = [r.finish - r.arrival for r in done if r.finish is not None]
    itl = [value for r in done if (value := r.itl) is not None]
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.finish for r in done if r.finish is not None), default=start)
    span = end - start
    prompt = sum(r.prompt_tokens for r in records)
    counts: dict[str, int] = dict.fromkeys(result.replicas, 0)
    cached_by: dict[str, int] = dict.fromkeys(result.replicas, 0)
    prompt_by: dict[str, int] = dict.fromkeys(result.replicas, 0)
    for record in records:
        if record.replica not in counts:
            continue  # turned away by the router queue: never reached an engine
        counts[record.replica] += 1
        worker = record.prefill_replica or record.replica
        cached_by[worker] += record.cached_tokens
        prompt_by[worker] += record.prompt_tokens
    total = len(records)
    computed = prompt - sum(cached_by.values())
    summary: dict[str, Any] = {
        "policy": result.policy,
        "scheduled": total,
        "completed": len(done),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "requests_per_s": len(done) / span if span > 0 else None,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / span if span > 0 else None,
        "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else None,
        "predicted_hit_rate": sum(r.predicted_cached for r in records) / prompt if prompt else None,
        "preemptions": sum(r.preemptions for r in records),
        "engine_passes": result.passes,
        "replicas": {
            name: {
                "share": counts[name] / total if total else None,
                "requests": counts[name],
                "hit_rate": cached_by[name] / prompt_by[name] if prompt_by[name] else None,
                "prefill_share": (prompt_by[name] - cached_by[name]) / computed if computed > 0 else None,
            }
            for name in result.replicas
        },
    }
    if floors is not None:
        summary["floor_ttft_p50"] = percentile(floors, 50)
        summary["floor_ttft_p99"] = percentile(floors, 99)
    summary["tail"] = tail_summary(done, floors, records)
    if any(r.queued_s > 0 or r.rejected is not None for r in records) or len({r.tenant for r in records}) > 1:
        summary["flow"] = flow_summary(result)
    if any(r.pd_reason is not None for r in records):
        summary["pd"] = pd_summary(records)
    return summary


def tail_summary(
    done: Sequence[RequestRecord], floors: Sequence[float] | None, records: Sequence[RequestRecord]
) -> dict[str, Any] | None:
    """Where the slowest 1% of answered requests (TTFT at or above p99) spent their TTFT, as means: in the router
    queue, waiting in the engine to be admitted (behind queued prefill, or for free KV blocks for the whole
    prompt), and in the engine from admission to the first token (its own prefill and the passes it shares); their
    prompts and what of them was cached; with floors, what each would take alone on an idle engine."""
    ttfts = [(ttft, r) for r in done if (ttft := r.ttft) is not None and r.prefill_replica is None]
    if not ttfts:
        return None
    threshold = cast(float, percentile([ttft for ttft, _ in ttfts], 99))
    slow = [r for ttft, r in ttfts if ttft >= threshold]
    count = len(slow)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    engine_waits = [wait for r in slow if (wait := r.engine_wait) is not None]
    in_engine = [cast(float, r.first_token) - r.admitted for r in slow if r.admitted is not None]
    tail: dict[str, Any] = {
        "requests": count,
        "ttft_mean": mean([cast(float, r.ttft) for r in slow]),
        "queued_mean": mean([r.queued_s for r in slow]),
        "engine_wait_mean": mean(engine_waits),
        "in_engine_mean": mean(in_engine),
        "prompt_tokens_mean": mean([float(r.prompt_tokens) for r in slow]),
        "cached_share": sum(r.cached_tokens for r in slow) / max(1, sum(r.prompt_tokens for r in slow)),
    }
    if floors is not None:
        position = {id(r): number for number, r in enumerate(records)}
        tail["floor_mean"] = mean([floors[position[id(r)]] for r in slow])
    return tail


def pd_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """A disaggregated fleet's part: how many requests were split, why each plan was what it was, the transfers."""
    reasons: dict[str, int] = {}
    for r in records:
        if r.pd_reason is not None:
            reasons[r.pd_reason] = reasons.get(r.pd_reason, 0) + 1
    transfers = [r.transfer_s for r in records if r.prefill_replica is not None]
    return {
        "split": len(transfers),
        "reasons": dict(sorted(reasons.items())),
        "transfer_p50": percentile(transfers, 50) if transfers else None,
        "transfer_p99": percentile(transfers, 99) if transfers else None,
    }


def _group(records: Sequence[RequestRecord]) -> dict[str, Any]:
    done = [r for r in records if r.first_token is not None]
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    return {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(r.rejected is not None for r in records),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "queued_p99": percentile([r.queued_s for r in records if r.rejected is None], 99),
        "longest_wait": max((r.queued_s for r in records), default=0.0),
    }


def flow_summary(result: ReplayResult) -> dict[str, Any]:
    """The router queue's part: waits and rejections overall, per band and per tenant, and its fairness."""
    records = result.records
    bands = sorted({r.band for r in records})
    tenants = sorted({r.tenant for r in records})
    fairness = result.fairness
    return {
        "queued": sum(r.queued_s > 0 for r in records),
        "rejected": {
            reason: sum(r.rejected == reason for r in records) for reason in ("queue_full", "ttl", "predicted_ttl")
        },
        "queued_p99": percentile([r.queued_s for r in records if r.rejected is None], 99),
        "bands": {band: _group([r for r in records if r.band == band]) for band in bands},
        "tenants": {tenant: _group([r for r in records if r.tenant == tenant]) for tenant in tenants},
        "jain_windows": len(fairness),
        "jain_mean": sum(fairness) / len(fairness) if fairness else None,
        "jain_p10": percentile(fairness, 10) if fairness else None,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _ms1(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, one row per policy."""
    lines = [
        "| policy | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 / p99 (ms) | req/s | output tok/s "
        "| prefix hit | predicted hit | replica shares | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        shares = " / ".join(_pct(v["share"]) for v in s["replicas"].values())
        rps = s["requests_per_s"]
        tps = s["output_tokens_per_s"]
        lines.append(
            f"| {s['policy']} | {_ms(s['ttft_p50'])} / {_ms(s['ttft_p90'])} / {_ms(s['ttft_p99'])} "
            f"| {_ms1(s.get('itl_p50'))} / {_ms1(s.get('itl_p99'))} "
            f"| {_ms(s['e2e_p50'])} / {_ms(s['e2e_p99'])} | {'-' if rps is None else f'{rps:.2f}'} "
            f"| {'-' if tps is None else f'{tps:,.0f}'} | {_pct(s['hit_rate'])} | {_pct(s['predicted_hit_rate'])} "
            f"| {shares} | {s['preemptions']} |"
        )
    if any(s.get("flow") is not None for s in summaries):
        lines.append("")
    for s in summaries:
        flow = s.get("flow")
        if flow is None:
            continue
        rejected = flow["rejected"]
        bands = "; ".join(
            f"{name} p99 {_ms(group['ttft_p99'])} ms ({group['rejected']} rejected)"
            for name, group in flow["bands"].items()
        )
        jain = flow["jain_mean"]
        lines.append(
            f"{s['policy']}: queued {flow['queued']}, wait p99 {_ms(flow['queued_p99'])} ms, rejected "
            f"{rejected['queue_full']} full / {rejected['ttl']} ttl / {rejected['predicted_ttl']} at once "
            f"(predicted past the TTL); {bands}"
            + ("" if jain is None else f"; Jain {jain:.3f} over {flow['jain_windows']} windows")
        )
    lines.append("")
    for s in summaries:
        tail = s.get("tail")
        if tail is None:
            continue
        floor_text = "" if tail.get("floor_mean") is None else f"; alone (floor) {_ms(tail['floor_mean'])} ms"
        lines.append(
            f"{s['policy']}: slowest 1% ({tail['requests']}), mean TTFT {_ms(tail['ttft_mean'])} ms = router queue "
            f"{_ms(tail['queued_mean'])} + engine queue {_ms(tail['engine_wait_mean'])} + in the engine "
            f"{_ms(tail['in_engine_mean'])} ms; prompts {tail['prompt_tokens_mean']:,.0f} tokens, "
            f"{_pct(tail['cached_share'])} cached{floor_text}"
        )
    if any(s.get("pd") is not None for s in summaries):
        lines.append("")
    for s in summaries:
        pd = s.get("pd")
        if pd is None:
            continue
        reasons = ", ".join(f"{reason} {count}" for reason, count in pd["reasons"].items())
        transfer = (
            "" if pd["transfer_p50"] is None
            else f"; KV transfer p50 {_ms1(pd['transfer_p50'])} ms, p99 {_ms1(pd['transfer_p99'])} ms"
        )  # fmt: skip
        lines.append(f"{s['policy']}: split {pd['split']} of {s['scheduled']} ({reasons}){transfer}")
    floor = next((s for s in summaries if s.get("floor_ttft_p99") is not None), None)
    if floor is not None:
        lines.append("")
        lines.append(
            f"Floor (each request alone on an idle engine, best-case cache): TTFT p50 {_ms(floor['floor_ttft_p50'])} "
            f"ms, p99 {_ms(floor['floor_ttft_p99'])} ms."
        )
    return "\n".join(lines)


def write_csv(path: Path, result: ReplayResult, floors: Sequence[float] | None = None) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_FIELDS)
        for position, r in enumerate(result.records):
            ttft = r.ttft
            e2e = r.e2e
            writer.writerow(
                [
                    r.index,
                    r.replica,
                    f"{r.arrival:.6f}",
                    r.prompt_tokens,
                    r.output_tokens,
                    r.cached_tokens,
                    r.predicted_cached,
                    "" if ttft is None else f"{ttft * 1000:.3f}",
                    "" if e2e is None else f"{e2e * 1000:.3f}",
                    "" if floors is None else f"{floors[position] * 1000:.3f}",
                    r.preemptions,
                    r.tenant,
                    r.band,
                    f"{r.queued_s * 1000:.3f}",
                    r.rejected or "",
                    "" if (itl := r.itl) is None else f"{itl * 1000:.3f}",
                    r.pd_reason or "",
                    r.prefill_replica or "",
                    f"{r.transfer_s * 1000:.3f}",
                    "" if (wait := r.engine_wait) is None else f"{wait * 1000:.3f}",
                ]
            )


def plot_ttft_cdf(path: Path, results: Sequence[ReplayResult], floors: Sequence[float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    curves: list[tuple[str, list[float]]] = [
        (result.policy, sorted(t * 1000 for r in result.records if (t := r.ttft) is not None)) for result in results
    ]
    if floors is not None:
        curves.append(("floor", sorted(f * 1000 for f in floors)))
    for label, values in curves:
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.plot(values, fractions, label=label, linestyle=":" if label == "floor" else "-")
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (ms, log scale)")
    axes.set_ylabel("fraction of requests")
    save_figure(plt, figure, axes, path, dpi=120)


def write_outputs(
    out: Path,
    results: Sequence[ReplayResult],
    summaries: Sequence[dict[str, Any]],
    floors: Sequence[float] | None,
    meta: dict[str, Any],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {"replay": meta, "rows": {s["policy"]: s for s in summaries}}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(table(summaries) + "\n", encoding="utf-8")
    for result in results:
        write_csv(out / f"requests_{result.policy}.csv", result, floors)
    plot_ttft_cdf(out / "ttft_cdf.png", results, floors)
