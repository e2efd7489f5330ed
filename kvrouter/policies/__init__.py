"""Routing policies: one module each behind `kvrouter.policies.base.Policy`; `build_policy` is the factory.

`round_robin` and `least_loaded` need nothing but the load picture; `kv_aware` (prefix overlap against load) is
imported only when asked for, so its dependencies cost nothing to the others.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from kvrouter.config import ConfigError, Settings
from kvrouter.policies.base import Policy


def build_policy(name: str, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy called `name`, configured from `settings`, reading `clock` (the router's: monotonic live,
    virtual in replay); `ConfigError` for an unknown or missing one."""
    if name == "round_robin":
        from kvrouter.policies.round_robin import RoundRobinPolicy

        return RoundRobinPolicy()
    if name == "least_loaded":
        from kvrouter.policies.least_loaded import LeastLoadedPolicy

        return LeastLoadedPolicy()
    if name == "kv_aware":
        try:
            module = importlib.import_module("kvrouter.policies.kv_aware")
        except ModuleNotFoundError as error:
            if error.name != "kvrouter.policies.kv_aware":
                raise
            message = "policy 'kv_aware' is not available in this build; use round_robin or least_loaded"
            raise ConfigError(message) from None
        policy: Policy = module.KvAwarePolicy.from_settings(settings, clock=clock)
        return policy
    raise ConfigError(f"policy: expected one of round_robin, least_loaded, kv_aware, got {name!r}")
