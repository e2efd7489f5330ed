"""Which fleet serves a request's `model`, in a router serving several (`kvrouter.server.fleets`).

Every fleet answers to its model name, its aliases and its LoRA adapters (`FleetConfig.served_names`, unique
across fleets by validation). An unknown model is OpenAI's 404 (`model_not_found`); a request without `model` goes
to the only fleet when there is one, and is a 400 when there are several.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvrouter.config import FleetConfig
from kvrouter.openai_request import RequestError
from kvrouter.server.proxy import Proxy
from kvrouter.server.status import StatusEndpoints


@dataclass(slots=True)
class FleetApp:
    """One model's fleet: its configuration and the application `create_app` built for it (never served alone)."""

    fleet: FleetConfig
    app: web.Application
    registry: CollectorRegistry
    proxy: Proxy
    status: StatusEndpoints

    @property
    def model(self) -> str:
        assert self.fleet.model is not None, "a models list names every fleet's model"
        return self.fleet.model


class ModelDirectory:
    """Which fleet serves a request's `model` (pure): model names, aliases and LoRA adapters, each in one fleet."""

    def __init__(self, fleets: Sequence[FleetApp]) -> None:
        self.fleets = tuple(fleets)
        self.by_name = {name: fleet for fleet in fleets for name in fleet.fleet.served_names}

    def find(self, model: object) -> FleetApp:
        """The fleet for `model` (the body's value, maybe absent); raises RequestError (400, 404)."""
        if model is None:
            if len(self.fleets) == 1:
                return self.fleets[0]
            served = ", ".join(fleet.model for fleet in self.fleets)
            raise RequestError(
                f"the request names no model; this router serves several ({served}): set 'model'",
                param="model",
                code="model_required",
            )
        if not isinstance(model, str):
            raise RequestError("'model' must be a string", param="model")
        fleet = self.by_name.get(model)
        if fleet is None:
            raise RequestError(
                f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found"
            )
        return fleet


MODELS = web.AppKey("kvrouter_models", ModelDirectory)


__all__ = ["MODELS", "FleetApp", "ModelDirectory"]
