"""The bench report's PNG plots: TTFT CDF per row, TTFT over time, and per-replica load over time.

matplotlib is imported inside `write_plots` with the Agg backend, so the bench needs no display and the rest of
kvrouter never pays for matplotlib. Times are engine seconds (see `report.py`). `save_figure` is the common
finish of a one-axes plot, shared with the replay report. In replica_load.png every row shares one y scale
per column, so a policy that piles requests on one replica looks taller than one that spreads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvrouter.loadgen.report import RowData


def write_plots(out: Path, rows: Sequence[RowData], *, time_scale: float = 1.0) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = [
        _ttft_cdf(plt, out / "ttft_cdf.png", rows, time_scale),
        _ttft_over_time(plt, out / "ttft_over_time.png", rows, time_scale),
        _replica_load(plt, out / "replica_load.png", rows, time_scale),
    ]
    return written


def _ok_ttft(row: RowData) -> list[Mapping[str, Any]]:
    return [r for r in row.records if r.get("error") is None and r.get("ttft_s") is not None]


def _ttft_cdf(plt: Any, path: Path, rows: Sequence[RowData], scale: float) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        values = sorted(r["ttft_s"] * scale for r in _ok_ttft(row))
        if values:
            fractions = [(index + 1) / len(values) for index in range(len(values))]
            axes.step(values, fractions, where="post", label=row.name)
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (s, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("TTFT CDF")
    save_figure(plt, figure, axes, path, dpi=110)
    return path


def _ttft_over_time(plt: Any, path: Path, rows: Sequence[RowData], scale: float) -> Path:
    figure, axes = plt.subplots(figsize=(9, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, row in enumerate(rows):
        color = colors[index % len(colors)]
        points = sorted((r["start_s"] * scale, r["ttft_s"] * scale) for r in _ok_ttft(row))
        if points:
            axes.scatter([p[0] for p in points], [p[1] for p in points], s=5, alpha=0.3, color=color)
            windows = _window_p90(points)
            axes.plot([w[0] for w in windows], [w[1] for w in windows], color=color, lw=2, label=f"{row.name} (p90)")
    axes.set_yscale("log")
    axes.set_xlabel("request start (s since the load began)")
    axes.set_ylabel("TTFT (s, log scale)")
    axes.set_title("TTFT over time")
    save_figure(plt, figure, axes, path, dpi=110)
    return path


def save_figure(plt: Any, figure: Any, axes: Any, path: Path, *, dpi: int) -> None:
    """The common finish of a one-axes plot: a log-friendly grid, the legend, then written as a PNG and closed."""
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


def _window_p90(points: Sequence[tuple[float, float]], windows: int = 30) -> list[tuple[float, float]]:
    """p90 of TTFT in consecutive time windows, for a line over the scatter."""
    if not points:
        return []
    start, end = points[0][0], points[-1][0]
    width = max((end - start) / windows, 1e-9)
    buckets: dict[int, list[float]] = {}
    for at, value in points:
        buckets.setdefault(min(windows - 1, int((at - start) / width)), []).append(value)
    result = []
    for index in sorted(buckets):
        values = sorted(buckets[index])
        result.append((start + (index + 0.5) * width, values[max(0, int(0.9 * len(values) + 0.5) - 1)]))
    return result


def _replica_load(plt: Any, path: Path, rows: Sequence[RowData], scale: float) -> Path:
    figure = replica_load_figure(plt, rows, scale)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def replica_load_figure(plt: Any, rows: Sequence[RowData], scale: float) -> Any:
    """One row of axes per bench row: requests running + waiting per replica over time, and request shares."""
    # sharey="col": rows compared at a glance need one scale (matplotlib's default gives each row its own).
    figure, grid = plt.subplots(len(rows), 2, figsize=(11, 2.6 * len(rows) + 0.5), squeeze=False, sharey="col")
    for index, row in enumerate(rows):
        over_time, shares = grid[index]
        replicas = sorted({s.replica for s in row.samples})
        for replica in replicas:
            samples = [s for s in row.samples if s.replica == replica]
            over_time.plot(
                [s.t_s * scale for s in samples], [s.running + s.waiting for s in samples], label=replica, lw=1
            )
        over_time.set_title(f"{row.name}: requests running + waiting per replica", fontsize=9)
        over_time.set_xlabel("s since the load began", fontsize=8)
        if replicas:
            over_time.legend(fontsize=7)
        counts: dict[str, float] = {}
        for record in row.records:
            if record.get("replica"):
                counts[record["replica"]] = counts.get(record["replica"], 0) + 1
        finished = {name: c.get("vllm:e2e_request_latency_seconds_count", 0.0) for name, c in row.counters.items()}
        if any(finished.values()):
            counts = finished
        names = sorted(counts)
        total = sum(counts.values()) or 1.0
        shares.bar(names, [counts[name] / total for name in names])
        shares.set_title(f"{row.name}: share of requests", fontsize=9)
        shares.set_ylim(0, 1)
        shares.tick_params(axis="x", labelsize=7)
    return figure
