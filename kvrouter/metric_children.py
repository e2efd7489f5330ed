"""A labelled Prometheus metric's children, looked up once per label values rather than on every update.

`metric.labels(...)` validates and joins its values and takes the metric's lock on every call (~1.3 µs here,
`loadtest/bench_relay_reads.py`); a held child's `inc()` or `set()` costs ~0.36 µs. Counters and gauges updated
per request or per KV-event batch go through `LabelledChildren`. Only for label values from a bounded set (the
metric keeps a child per values anyway, so the cache holds no more than the metric does); a caller that removes
a child from the metric calls `forget` with the same values, or the cache would update the removed child.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

M = TypeVar("M", bound="_Labelled")


class _Labelled(Protocol):
    def labels(self: M, *values: str) -> M: ...


class LabelledChildren(Generic[M]):
    __slots__ = ("_children", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def forget(self, *values: str) -> None:
        self._children.pop(values, None)


__all__ = ["LabelledChildren"]
