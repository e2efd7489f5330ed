"""The bench report: exact percentiles, hit rate from replica counters, shares, goodput, and its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrouter.loadgen.report import (
    LoadSample,
    RowData,
    console_table,
    counter_deltas,
    percentile,
    render_markdown,
    summarize,
    write_report,
)


def _record(start: float, ttft: float, e2e: float, replica: str, error: str | None = None) -> dict[str, object]:
    return {
        "label": "x", "session": "s", "turn": 0, "due_s": start, "start_s": start, "status": 200,
        "ttft_s": ttft, "e2e_s": e2e, "itl_mean_s": 0.01, "output_tokens": 10, "prompt_tokens": 100,
        "cached_tokens": 40, "replica": replica, "error": error,
    }  # fmt: skip


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_counter_deltas_subtract_the_start() -> None:
    assert counter_deltas({"a": 5.0}, {"a": 8.0, "b": 2.0}) == {"a": 3.0, "b": 2.0}
    assert counter_deltas(None, {"a": 1.0}) == {"a": 1.0}
    assert counter_deltas({"a": 1.0}, None) == {}


def _row() -> RowData:
    records = [_record(i * 0.5, 0.1 * (i + 1), 1.0 + i * 0.1, "r0" if i % 4 else "r1") for i in range(20)]
    records.append(_record(3.0, 0.0, 0.2, "r0", error="HTTP 500: boom"))
    counters = {
        "r0": {"vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 300.0,
               "vllm:e2e_request_latency_seconds_count": 15.0},
        "r1": {"vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 100.0,
               "vllm:e2e_request_latency_seconds_count": 5.0},
    }  # fmt: skip
    samples = [LoadSample(float(t), "r0", 1.0, float(t % 2), 0.5) for t in range(10)]
    samples += [LoadSample(float(t), "r1", 0.0, 0.0, 0.1) for t in range(10)]
    return RowData("round_robin", records, scheduled=22, counters=counters, samples=samples)


def test_summary_fields() -> None:
    summary = summarize(_row(), time_scale=2.0, slo_ttft_s=2.0)
    assert summary["completed"] == 20 and summary["errors"] == 1 and summary["incomplete"] == 1
    assert summary["ttft_p50"] == pytest.approx(2.0)  # 10th of 0.1..2.0, times the time scale
    assert summary["ttft_p99"] == pytest.approx(4.0)
    assert summary["hit_rate"] == pytest.approx(0.2)
    assert summary["client_cached_fraction"] == pytest.approx(0.4)
    span = (9.5 + 1.0 + 19 * 0.1) * 2.0  # first start 0, last end 9.5 + 2.9, engine time
    assert summary["requests_per_s"] == pytest.approx(20 / span)
    assert summary["goodput_per_s"] == pytest.approx(10 / span)  # TTFT (engine) <= 2 s: the first ten
    replicas = summary["replicas"]
    assert replicas["r0"]["share"] == pytest.approx(0.75) and replicas["r1"]["share"] == pytest.approx(0.25)
    assert replicas["r0"]["hit_rate"] == pytest.approx(0.3)
    assert replicas["r0"]["busy"] == 1.0 and replicas["r1"]["busy"] == 0.0
    assert replicas["r0"]["queue_mean"] == pytest.approx(0.5) and replicas["r0"]["queue_max"] == 1.0


def test_shares_fall_back_to_the_replica_header_without_replica_metrics() -> None:
    row = _row()
    row.counters = {}
    row.samples = []
    replicas = summarize(row)["replicas"]
    assert replicas["r1"]["share"] == pytest.approx(5 / 21)


def test_report_files_and_ratios(tmp_path: Path) -> None:
    base = summarize(_row())
    better = dict(base, ttft_p50=base["ttft_p50"] / 2, ttft_p99=base["ttft_p99"] / 4, hit_rate=0.4)
    report = {"parameters": {"workload": "multi-tenant", "slo_ttft_s": 2.0}, "baseline": "round_robin",
              "results": {"round_robin": base, "kv_aware": better}}  # fmt: skip
    write_report(tmp_path, report)
    assert json.loads((tmp_path / "report.json").read_text())["results"]["kv_aware"]["hit_rate"] == 0.4
    markdown = (tmp_path / "report.md").read_text()
    assert "| kv_aware | 0.50× | 0.25× |" in markdown
    assert "| round_robin | r0 | 75.0% |" in markdown
    assert render_markdown(report) == markdown
    assert "kv_aware vs round_robin: TTFT p50 0.50×, p99 0.25×, hit 2.00×" in console_table(report)


def _late_row(name: str, late_s: float) -> RowData:
    records = [_record(float(i), 0.1, 0.5, "r0") for i in range(100)]
    for record in records:
        record["start_s"] = float(record["due_s"]) + late_s  # type: ignore[arg-type]
    return RowData(name, records, scheduled=100)


def test_lateness_is_on_screen_and_warns_past_the_threshold() -> None:
    # On a loaded 2-core box the demo's verdict flipped with no word of it on screen (only in report.md).
    def report_of(late_s: float) -> dict[str, object]:
        rows = {
            "round_robin": summarize(_late_row("round_robin", 0.002)),
            "kv_aware": summarize(_late_row("kv_aware", late_s)),
        }
        return {"parameters": {"workload": "multi-tenant"}, "baseline": "round_robin", "results": rows}

    calm = console_table(report_of(0.05))
    assert (
        "Load generator lateness (p99 of send time minus scheduled time, wall): round_robin 2 ms, kv_aware 50 ms"
        in calm
    )
    assert "WARNING" not in calm
    busy = console_table(report_of(0.25))
    assert "WARNING: the load generator fell behind its schedule (p99 lateness 250 ms on kv_aware, over 100 ms)" in busy
    assert "WARNING" in render_markdown(report_of(0.25)) and "WARNING" not in render_markdown(report_of(0.05))


def test_report_md_links_the_plots_it_has() -> None:
    report = {"parameters": {"workload": "multi-tenant"}, "baseline": "round_robin",
              "results": {"round_robin": summarize(_row())}, "plots": ["ttft_cdf.png", "replica_load.png"]}  # fmt: skip
    markdown = render_markdown(report)
    assert "- [TTFT CDF](ttft_cdf.png)" in markdown
    assert "(replica_load.png)" in markdown and "ttft_over_time.png" not in markdown
    assert "Plots:" not in render_markdown({**report, "plots": []})


def test_replica_load_rows_share_one_y_scale() -> None:
    # Each row used to get its own y scale, so a replica queueing 40 requests looked like one queueing 2.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvrouter.loadgen.plots import replica_load_figure

    calm = RowData("kv_aware", [], 1, samples=[LoadSample(float(t), "r0", 1.0, float(t % 2), 0.1) for t in range(10)])
    piled = RowData("round_robin", [], 1, samples=[LoadSample(float(t), "r0", 8.0, 4.0 * t, 0.9) for t in range(10)])
    figure = replica_load_figure(plt, [calm, piled], 1.0)
    try:
        (calm_load, calm_share), (piled_load, piled_share) = figure.axes[0:2], figure.axes[2:4]
        assert calm_load.get_ylim() == piled_load.get_ylim()
        assert calm_load.get_ylim()[1] >= 44  # the tall row's peak, on both rows
        assert calm_share.get_ylim() == piled_share.get_ylim() == (0.0, 1.0)
    finally:
        plt.close(figure)
