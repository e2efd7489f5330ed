"""A peer allow-list for event sockets that bind: ZMQ's ZAP handshake, answered from a list of networks.

When a replica's `kv_events.bind` is true the router binds its SUB socket and vLLM's publisher connects to it;
without more, every process that can reach the address may publish, and its events steer routing. vLLM's
publisher cannot authenticate (it sets no CURVE or PLAIN keys), so the one check ZMQ can make of it is the peer's
address: with the NULL mechanism, a socket that names a ZAP domain asks the context's ZAP handler (a REP socket
at `inproc://zeromq.zap.01`) about every connection before any message of it is read, and a refused peer is
disconnected. `PeerAllowList` is that handler: it allows an address inside one of `networks` and refuses the rest,
counting each refusal through `on_refused`.

A context holds one ZAP handler, so a source with an allow-list runs its socket on a context of its own (see
`zmq_source`). The check is an address check, no more: a network policy, or an ipc:// endpoint protected by file
permissions, keeps strangers off the socket in the first place.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "kvrouter-kv-events"
"""The domain a guarded socket names: without one, libzmq does not ask the handler about NULL connections."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def allowed(networks: tuple[Network, ...], address: str) -> bool:
    """Whether a peer at `address` (as ZAP reports it) is inside one of `networks` (pure)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in network for network in networks)


class PeerAllowList:
    """The ZAP handler of one context; `start` binds it (before the guarded socket binds), `stop` closes it."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        networks: Iterable[str],
        *,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.context = context
        self.networks = parse_networks(networks)
        self.on_refused = on_refused
        self.refused = 0
        self.accepted = 0
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        socket = self.context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(ZAP_ENDPOINT)
        self._socket = socket
        self._task = asyncio.create_task(self._serve(socket), name="kvrouter-kv-events-zap")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _serve(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            request = await socket.recv_multipart()
            await socket.send_multipart(self.answer(request))

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request: 200 for an allowed address, 400 otherwise."""
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address = request[:4]
        peer = address.decode("ascii", "replace")
        if version == b"1.0" and allowed(self.networks, peer):
            self.accepted += 1
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(peer)
        return [b"1.0", request_id, b"400", b"address not allowed", b"", b""]


__all__ = ["ZAP_DOMAIN", "ZAP_ENDPOINT", "PeerAllowList", "allowed", "parse_networks"]
