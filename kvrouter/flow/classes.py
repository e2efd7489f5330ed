"""A request's flow class: its priority band and its tenant (the fairness id), read once at the edge.

Priority: the `x-kvrouter-priority` header (a band name, or an integer) wins over the body's `priority` field
(the integer vLLM accepts: lower is more urgent, 0 the default). An integer moves that many bands from the default
band, clamped to the first and last (with high / normal / low: -1 is high, 0 normal, 1 or more low). A well-formed
value naming no band gets the default band and is counted (`unknown_priority`); a malformed one (not a name, not an
integer, a non-integer `priority`) is a 400.

Engine priority (`engine_priority`, off by default): a request whose band came from the header alone (no
`priority` in the body) and is not the default band gets `engine_priority`, the integer the router writes into
its body's `priority` for the engines — the band's distance from the default band (-1 for `high` with the default
bands), the same integer this module reads back as that band. A body that has a `priority` keeps it, and a
default-band request's body is left alone (0 is vLLM's default).

Tenant: the first of `tenant_from` that the request carries — the `x-kvrouter-tenant` header (a name: letters,
digits, `_.:-`, at most 64; anything else is a 400), the client's API key (the tenant that lists it, else an opaque
digest of the key: keys never reach labels or logs), the body's `user` string (a digest when it is not a plain
name). None: the tenant `anonymous`. A tenant not listed under `tenants` weighs 1 and is shown as `other` in
metrics (bounded labels); a header naming one while tenants are configured is counted (`unknown_tenant`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrouter.flow.settings import NAME_PATTERN, FlowConfig
from kvrouter.openai_request import RequestError

PRIORITY_HEADER = "x-kvrouter-priority"
TENANT_HEADER = "x-kvrouter-tenant"
ANONYMOUS = "anonymous"
OTHER_LABEL = "other"
_NAME = re.compile(NAME_PATTERN)
_INTEGER = re.compile(r"^[+-]?[0-9]{1,9}$")


@dataclass(frozen=True, slots=True)
class FlowClass:
    band: int
    """Index into the configured bands, 0 the most urgent."""
    tenant: str
    """The fairness id (a configured tenant's name, a header's name, or a digest)."""
    weight: float = 1.0
    label: str = OTHER_LABEL
    """What metrics show: the configured tenant's name, `anonymous`, or `other`."""
    unknown: tuple[str, ...] = ()
    """Values that fell back to a default: `unknown_priority`, `unknown_tenant` (counted by the caller)."""
    engine_priority: int | None = None
    """The `priority` to write into the body for the engines (`FlowConfig.engine_priority`); None: unchanged."""


def _digest(kind: str, value: str) -> str:
    return f"{kind}-{hashlib.blake2b(value.encode('utf-8', 'surrogatepass'), digest_size=6).hexdigest()}"


class FlowClassifier:
    def __init__(self, config: FlowConfig) -> None:
        self.config = config
        self.bands = {band.name.lower(): number for number, band in enumerate(config.bands)}
        self.default_band = config.default_band_index
        self.by_key = {key: name for name, tenant in config.tenants.items() for key in tenant.api_keys}

    def band_of(self, header: str | None, body_priority: object) -> tuple[int, bool]:
        """(band, known): `known` is False when a well-formed value named no band."""
        if header is not None:
            value = header.strip()
            if _INTEGER.fullmatch(value):
                return self._shift(int(value)), True
            if _NAME.fullmatch(value) is None:
                raise RequestError(
                    f"header {PRIORITY_HEADER} must be a band name or an integer",
                    code="invalid_priority",
                    param=PRIORITY_HEADER,
                )
            band = self.bands.get(value.lower())
            return (self.default_band, False) if band is None else (band, True)
        if body_priority is None:
            return self.default_band, True
        if isinstance(body_priority, bool) or not isinstance(body_priority, int):
            raise RequestError("'priority' must be an integer", code="invalid_priority", param="priority")
        return self._shift(body_priority), True

    def _shift(self, value: int) -> int:
        return min(len(self.bands) - 1, max(0, self.default_band + value))

    def tenant_of(self, header: str | None, api_key: str, user: object) -> tuple[str, bool]:
        """(tenant, known): `known` is False for a header naming a tenant the configuration does not list."""
        if user is not None and not isinstance(user, str):
            raise RequestError("'user' must be a string", param="user")
        for source in self.config.tenant_from:
            if source == "header" and header is not None:
                value = header.strip()
                if _NAME.fullmatch(value) is None:
                    raise RequestError(
                        f"header {TENANT_HEADER} must be a name of letters, digits and _.:- (at most 64)",
                        code="invalid_tenant",
                        param=TENANT_HEADER,
                    )
                return value, not self.config.tenants or value in self.config.tenants
            if source == "api_key" and api_key:
                return self.by_key.get(api_key) or _digest("key", api_key), True
            if source == "user" and user:
                return (user if _NAME.fullmatch(user) else _digest("user", user)), True
        return ANONYMOUS, True

    def classify(self, headers: Mapping[str, str], api_key: str, body: Mapping[str, Any]) -> FlowClass:
        header = headers.get(PRIORITY_HEADER)
        band, band_known = self.band_of(header, body.get("priority"))
        tenant, tenant_known = self.tenant_of(headers.get(TENANT_HEADER), api_key, body.get("user"))
        configured = self.config.tenants.get(tenant)
        label = tenant if configured is not None or tenant == ANONYMOUS else OTHER_LABEL
        unknown = tuple(
            name for name, known in (("unknown_priority", band_known), ("unknown_tenant", tenant_known)) if not known
        )
        engine_priority = None
        if self.config.engine_priority and header is not None and "priority" not in body and band != self.default_band:
            engine_priority = band - self.default_band
        return FlowClass(band, tenant, configured.weight if configured else 1.0, label, unknown, engine_priority)

    def of(self, band: int, tenant: str) -> FlowClass:
        """A class built directly (the replay assigns tenants and bands itself)."""
        configured = self.config.tenants.get(tenant)
        label = tenant if configured is not None else OTHER_LABEL
        return FlowClass(band, tenant, configured.weight if configured else 1.0, label)


__all__ = ["ANONYMOUS", "PRIORITY_HEADER", "TENANT_HEADER", "FlowClass", "FlowClassifier"]
