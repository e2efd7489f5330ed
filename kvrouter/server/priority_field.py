"""Writing a request's band into the body's `priority`, vLLM's field, for engines that schedule by it.

A client may name its band by the `x-kvrouter-priority` header alone; vLLM never sees that header. With
`flow.engine_priority` on, such a request's body gets `"priority": N` (the band's distance from the default band,
`kvrouter.flow.classes`) before it goes upstream, so a fleet started with `--scheduling-policy priority` orders
its engine queues and preemptions by the same band the router queue used. Off by default because vLLM under its
default fcfs policy answers any nonzero `priority` with a 400 ("Got priority -1 but Priority scheduling is not
enabled."): the router cannot see the engines' policy, the operator says it.

The rules of the rest of the proxy still hold: the body is forwarded byte for byte unless the router must change
it; this is one of the few changes it makes (with the streamed form of an assembled answer, kvrouter/server/
assembly.py, and the legs of a disaggregated request). The body the router decoded is re-encoded with the new
field last (`kvrouter.server.json_body`). The inflated body is what is re-encoded, so a client's gzip body goes
upstream plain (engines accept no compressed bodies anyway, kvrouter/server/body_encoding.py).
"""

from __future__ import annotations

import dataclasses

from kvrouter.openai_request import ParsedRequest
from kvrouter.server.json_body import encode_body


def with_priority(parsed: ParsedRequest, priority: int) -> tuple[ParsedRequest, bytes]:
    """The request with `priority` set in its body, and the bytes to forward."""
    body = dict(parsed.body)
    body["priority"] = priority
    return dataclasses.replace(parsed, body=body), encode_body(body, finite_json=parsed.finite_json)


__all__ = ["with_priority"]
