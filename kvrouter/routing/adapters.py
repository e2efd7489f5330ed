"""LoRA adapter placement: which replicas may take a request that names an adapter.

A replica serves its fleet's `lora_adapters` and its own (`ReplicaConfig.lora_adapters`); its `Route` carries the
set (`Route.lora_adapters`; None: placement unknown, every replica serves every adapter, as replay builds its
routes). A request naming an adapter (`RoutingFacts.lora`) may go only to replicas that serve it: `Router.decide`
filters its candidates with `serving` before the policy sees them, so the choice stays KV-aware among them. Pure:
the live proxy and virtual-time replay share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvrouter.openai_request import RequestError


class Placed(Protocol):
    @property
    def lora_adapters(self) -> frozenset[str] | None: ...


R = TypeVar("R", bound=Placed)


def serves(route: Placed, lora: str | None) -> bool:
    """True when `route` may take a request for `lora` (None: the base model, every replica serves it)."""
    return lora is None or route.lora_adapters is None or lora in route.lora_adapters


def serving(routes: Sequence[R], lora: str | None) -> list[R]:
    """The routes that serve `lora`, in their order."""
    if lora is None:
        return list(routes)
    return [route for route in routes if serves(route, lora)]


def unavailable(lora: str) -> RequestError:
    """The answer when no routable replica serves `lora`: a 503 (the adapter exists, its replicas are down)."""
    return RequestError(
        f"no healthy replica serves the LoRA adapter {lora!r}",
        status=503,
        code="no_replica_available",
        type_="server_error",
    )


__all__ = ["Placed", "serves", "serving", "unavailable"]
