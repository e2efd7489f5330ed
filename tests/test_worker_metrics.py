"""`/metrics` under `--workers`: every worker's exposition in one scrape, labelled by worker
(kvrouter/server/worker_metrics.py). The merge on real expositions, and the gathering over real Unix sockets;
`tests/test_load_share_local.py` scrapes a real `kvrouter --workers 2`."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.server.worker_metrics import EXPOSITION, WorkerMetrics, merge


def exposition(requests: float, in_flight: float, latencies: list[float]) -> bytes:
    registry = CollectorRegistry()
    counter = Counter("kvrouter_requests", "Requests answered.", ["replica", "status"], registry=registry)
    counter.labels("a", "200").inc(requests)
    Gauge("kvrouter_in_flight", "In flight.", registry=registry).set(in_flight)
    histogram = Histogram("kvrouter_ttft_seconds", "TTFT.", ["replica"], buckets=[0.1, 1.0], registry=registry)
    for latency in latencies:
        histogram.labels("a").observe(latency)
    return generate_latest(registry)


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_the_merge_labels_every_sample_and_keeps_each_family_together() -> None:
    zero = exposition(5, 2, [0.05, 0.5])
    one = exposition(7, 1, [2.0])
    merged = merge([(0, zero), (1, one)], scraped=2, expected=2)
    # The text format wants one HELP/TYPE per family and its samples together: a family split in two would parse
    # as two families of one name.
    parsed = list(text_string_to_metric_families(merged.decode()))
    families = {family.name: family for family in parsed}
    assert len(families) == len(parsed)
    assert merged.count(b"# TYPE kvrouter_requests_total counter") == 1
    values = samples(merged)
    assert values[("kvrouter_requests_total", (("replica", "a"), ("status", "200"), ("worker", "0")))] == 5
    assert values[("kvrouter_requests_total", (("replica", "a"), ("status", "200"), ("worker", "1")))] == 7
    assert values[("kvrouter_in_flight", (("worker", "0"),))] == 2
    assert values[("kvrouter_in_flight", (("worker", "1"),))] == 1
    bucket = (("le", "1.0"), ("replica", "a"), ("worker", "0"))
    assert values[("kvrouter_ttft_seconds_bucket", bucket)] == 2
    assert values[("kvrouter_ttft_seconds_count", (("replica", "a"), ("worker", "1")))] == 1
    assert families["kvrouter_ttft_seconds"].type == "histogram"
    assert values[("kvrouter_workers_scraped", ())] == 2 and values[("kvrouter_workers_expected", ())] == 2
    # Each worker's samples are its own exposition's, nothing else: the label is the only change.
    for number, text in ((0, zero), (1, one)):
        worker = ("worker", str(number))
        own = {(name, tuple(sorted((*labels, worker)))): value for (name, labels), value in samples(text).items()}
        assert {key: values[key] for key in own} == own


async def test_a_scrape_gathers_the_other_workers_over_their_sockets(share_dir: Path) -> None:
    """Worker 1 serves its exposition on its socket; worker 0's scrape holds both, and leaves out worker 2,
    which is not there (restarting), saying so."""
    peer = WorkerMetrics(share_dir, 1, 3)
    app = web.Application()
    app[EXPOSITION] = lambda: exposition(7, 1, [])
    context = peer.context(app)
    await anext(context)
    try:
        assert peer.path.exists() and peer.path.stat().st_mode & 0o777 == 0o600
        merged = await WorkerMetrics(share_dir, 0, 3, timeout_s=1.0).gather(exposition(5, 2, []))
        values = samples(merged)
        assert values[("kvrouter_requests_total", (("replica", "a"), ("status", "200"), ("worker", "1")))] == 7
        assert values[("kvrouter_requests_total", (("replica", "a"), ("status", "200"), ("worker", "0")))] == 5
        assert not [labels for _, labels in values if ("worker", "2") in labels]
        assert values[("kvrouter_workers_scraped", ())] == 2 and values[("kvrouter_workers_expected", ())] == 3
    finally:
        await anext(context, None)
    assert not peer.path.exists()  # removed when the worker stops
