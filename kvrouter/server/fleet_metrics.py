"""One Prometheus exposition for a router serving several models (`kvrouter.server.fleets`).

Every fleet keeps its own registry (its collectors are the one-fleet router's, unchanged), so the same metric
names exist once per fleet. `ModelMetrics` merges them into one family per name and adds a `model` label (the
fleet's model) to every sample: one HELP and one TYPE line per family, and a query can sum over models or pick
one. Replica names are unique across fleets, so a replica's series are its model's anyway; the label makes the
fleet-wide series (saturation, calibration, the flow gate, the index size) distinguishable too. The front's
client edge is shared by every model; its families (client connections and rejections) come from the front's own
registry without a `model` label, and the fleets' idle edges are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

EDGE_FAMILIES = frozenset({"kvrouter_client_connections", "kvrouter_client_rejections"})
"""Measured at the front (the client edge), for every model at once."""
FRONT_ONLY = frozenset({"kvrouter_client_connections"})
"""Families a fleet also has but never moves (its own edge serves no client)."""


class ModelMetrics:
    """A collector: the front's edge families plus every fleet's families, labelled by model."""

    def __init__(self, front: CollectorRegistry, fleets: Sequence[tuple[str, CollectorRegistry]]) -> None:
        self.front = front
        self.fleets = tuple(fleets)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for family in self.front.collect():
            if family.name in EDGE_FAMILIES:
                families[family.name] = family
        for model, registry in self.fleets:
            for family in registry.collect():
                if family.name in FRONT_ONLY:
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                merged.samples.extend(
                    sample._replace(labels={**sample.labels, "model": model}) for sample in family.samples
                )
        return list(families.values())


def exposition_registry(front: CollectorRegistry, fleets: Sequence[tuple[str, CollectorRegistry]]) -> CollectorRegistry:
    """A registry holding only the merged view (what /metrics renders)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelMetrics(front, fleets))
    return registry


__all__ = ["EDGE_FAMILIES", "ModelMetrics", "exposition_registry"]
