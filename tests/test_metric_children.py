"""Held metric children update the metric as `labels()` does, and a forgotten one is looked up again."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrouter.events.metrics import EventMetrics
from kvrouter.metric_children import LabelledChildren


def test_a_held_child_is_the_metrics_own() -> None:
    registry = CollectorRegistry()
    counter = Counter("things", "Things.", ["kind", "status"], registry=registry)
    children = LabelledChildren(counter)
    children("a", "ok").inc()
    children("a", "ok").inc(2)
    children("b", "bad").inc()
    assert children("a", "ok") is counter.labels("a", "ok")
    assert registry.get_sample_value("things_total", {"kind": "a", "status": "ok"}) == 3
    assert registry.get_sample_value("things_total", {"kind": "b", "status": "bad"}) == 1


def test_a_forgotten_child_is_looked_up_again_after_its_removal() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("lag", "Lag.", ["replica"], registry=registry)
    children = LabelledChildren(gauge)
    children("r0").set(1.5)
    gauge.remove("r0")
    children.forget("r0")
    children("r0").set(2.5)
    assert registry.get_sample_value("lag", {"replica": "r0"}) == 2.5


def test_event_metrics_lag_survives_a_forgotten_replica() -> None:
    registry = CollectorRegistry()
    metrics = EventMetrics(registry)
    metrics.lag("r0", 0.25)
    metrics.count("r0", "BlockStored", "ok")
    assert registry.get_sample_value("kvrouter_kv_event_lag_seconds", {"replica": "r0"}) == 0.25
    metrics.forget("r0")
    assert registry.get_sample_value("kvrouter_kv_event_lag_seconds", {"replica": "r0"}) is None
    metrics.lag("r0", 0.5)
    assert registry.get_sample_value("kvrouter_kv_event_lag_seconds", {"replica": "r0"}) == 0.5
    metrics.count("r0", "BlockStored", "ok")
    assert (
        registry.get_sample_value("kvrouter_kv_events_total", {"replica": "r0", "type": "BlockStored", "status": "ok"})
        == 2
    )
