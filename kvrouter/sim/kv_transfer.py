"""vLLM's KV-transfer protocol as a simulated replica speaks it (NixlConnector's `kv_transfer_params`), pure.

A disaggregated request comes in two legs, as vLLM's own P/D proxy sends them:

* The prefill leg carries `"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, ...}`
  (the remote fields null) and `max_tokens` 1; a KV producer answers it non-streaming with a top-level
  `kv_transfer_params` telling the decode worker where to pull the prompt's KV from: `do_remote_prefill` true,
  `do_remote_decode` false, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, `tp_size`, and
  `remote_request_id` (newer vLLM; older ones leave it out).
* The decode leg is the client's request with those params added; a KV consumer pulls the KV instead of computing
  the prompt and streams the answer.

Both flags false (or the field absent or null) is a plain request. `KvPeers` is the simulated transfer plane:
the engine ids of the replicas one `kvrouter sim` process serves and their roles, so a decode replica can tell a
real prefill worker's id from a made-up one (vLLM's decode side would fail the handshake).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrouter.typedefs import ReplicaRole


class KvTransferError(ValueError):
    """Malformed or unusable `kv_transfer_params` (answered 400, as vLLM answers a bad request)."""


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """A prefill leg: compute the prompt, answer with where its KV is."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A decode leg: the prompt's KV is on `engine_id`, in `block_ids`."""

    engine_id: str
    block_ids: tuple[int, ...]
    host: str | None = None
    port: int | None = None
    request_id: str | None = None


def _flag(params: dict[str, Any], name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise KvTransferError(f"'kv_transfer_params.{name}' must be a boolean")
    return value


def parse_kv_transfer_params(value: object) -> RemoteDecode | RemotePrefill | None:
    """The leg a request's `kv_transfer_params` asks for; None: a plain request. Raises KvTransferError."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise KvTransferError("'kv_transfer_params' must be an object")
    remote_decode = _flag(value, "do_remote_decode")
    remote_prefill = _flag(value, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise KvTransferError("'kv_transfer_params' cannot ask for both do_remote_decode and do_remote_prefill")
    if remote_decode:
        return RemoteDecode()
    if not remote_prefill:
        return None
    engine_id = value.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise KvTransferError("'kv_transfer_params.remote_engine_id' must be a non-empty string")
    blocks = value.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(type(block) is int and block >= 0 for block in blocks):
        raise KvTransferError("'kv_transfer_params.remote_block_ids' must be a list of non-negative integers")
    host = value.get("remote_host")
    if host is not None and not isinstance(host, str):
        raise KvTransferError("'kv_transfer_params.remote_host' must be a string")
    port = value.get("remote_port")
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        raise KvTransferError("'kv_transfer_params.remote_port' must be a port number")
    request_id = value.get("remote_request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise KvTransferError("'kv_transfer_params.remote_request_id' must be a string")
    return RemotePrefill(engine_id, tuple(blocks), host, port, request_id)


def prefill_answer(
    engine_id: str, block_ids: list[int], host: str, port: int, request_id: str, tp_size: int = 1
) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill worker answers with (NixlConnector's `request_finished`)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "tp_size": tp_size,
    }


ROLES: dict[str, ReplicaRole] = {"prefill": "prefill", "decode": "decode", "both": "both"}


def fleet_roles(text: str | None, count: int) -> list[ReplicaRole]:
    """`prefill,decode,both` or `2P2D` (N prefill then M decode) -> one role per replica, `count` of them;
    None: every replica `both`. Raises ValueError."""
    if text is None:
        return ["both"] * count
    shape = re.fullmatch(r"(\d+)P(\d+)D", text.strip(), flags=re.IGNORECASE)
    roles: list[ReplicaRole] = []
    if shape is not None:
        roles = [ROLES["prefill"]] * int(shape.group(1)) + [ROLES["decode"]] * int(shape.group(2))
    else:
        for item in text.split(","):
            role = ROLES.get(item.strip().lower())
            if role is None:
                raise ValueError(f"roles: expected NPMD or a comma list of prefill, decode, both; got {text!r}")
            roles.append(role)
    if len(roles) != count:
        raise ValueError(f"roles: {text!r} names {len(roles)} replicas, not {count}")
    if all(role == "prefill" for role in roles):
        raise ValueError(f"roles: {text!r} has no decode-capable replica (decode or both)")
    return roles


class KvPeers:
    """The engine ids a decode replica can pull KV from, with their roles and whether each is still up (one
    `kvrouter sim` process's replicas)."""

    def __init__(self) -> None:
        self._roles: dict[str, ReplicaRole] = {}
        self._alive: dict[str, Callable[[], bool]] = {}

    def register(self, engine_id: str, role: ReplicaRole, alive: Callable[[], bool] = lambda: True) -> None:
        self._roles[engine_id] = role
        self._alive[engine_id] = alive

    def is_producer(self, engine_id: str) -> bool:
        """Whether `engine_id` is a replica that prefills for remote decode (role prefill or both)."""
        role = self._roles.get(engine_id)
        return role is not None and role != "decode"

    def is_alive(self, engine_id: str) -> bool:
        """Whether the KV can still be pulled from `engine_id` (a worker that died holds none)."""
        alive = self._alive.get(engine_id)
        return alive is not None and alive()


__all__ = [
    "KvPeers",
    "KvTransferError",
    "RemoteDecode",
    "RemotePrefill",
    "fleet_roles",
    "parse_kv_transfer_params",
    "prefill_answer",
]
