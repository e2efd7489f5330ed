"""Hot-spot variant of a trace: from a moment on, one tenant's prefix suddenly opens `share` of the requests.

From `start` (a fraction of the trace's duration) on, requests are chosen evenly (every second one at share 0.5,
deterministic) and their first `prefix_blocks` trace blocks are replaced by one tenant's fixed prefix (a long
shared system prompt and tool schema, say); the rest of each chosen prompt keeps its own blocks, now behind the
tenant's prefix, so turns of one conversation that were both chosen still share their history. Prompt and output
lengths and arrival times are unchanged, so the fleet's work is the same and only its prefix structure moves:
half of the traffic wants one prefix, which a cache-greedy router piles onto its holder.

Knobs (`kvrouter replay --hot-share/--hot-start/--hot-prefix-blocks`): `share` [0 = off], `start` [1/3],
`prefix_blocks` [16: 8k tokens in 512-token Mooncake blocks].
"""

from __future__ import annotations

from dataclasses import replace

from kvrouter.replay.trace import Trace, TraceRequest


def hot_spot(trace: Trace, *, share: float, start: float = 1 / 3, prefix_blocks: int = 16) -> Trace:
    if not 0 <= share <= 1 or not 0 <= start <= 1 or prefix_blocks < 1:
        raise ValueError("share and start must be in [0, 1], prefix_blocks positive")
    requests = trace.requests
    if share == 0 or not requests:
        return trace
    top = max((max(request.chain, default=0) for request in requests), default=0) + 1
    tenant = tuple(range(top, top + prefix_blocks))
    # Chain ids behind the tenant's prefix are new prefixes: shift them past every id in use.
    offset = top + prefix_blocks
    begin = requests[0].arrival + start * (requests[-1].arrival - requests[0].arrival)
    due = 0.0
    result: list[TraceRequest] = []
    for request in requests:
        if request.arrival >= begin:
            due += share
            if due >= 1.0:
                due -= 1.0
                request = _behind_tenant(request, tenant, offset, trace.block_tokens)
        result.append(request)
    return replace(trace, requests=tuple(result))


def _behind_tenant(request: TraceRequest, tenant: tuple[int, ...], offset: int, block_tokens: int) -> TraceRequest:
    blocks = max(1, -(-request.input_length // block_tokens))
    if blocks <= len(tenant):
        chain = tenant[:blocks]
    else:
        chain = tenant + tuple(offset + block for block in request.chain[len(tenant) : blocks])
    return replace(request, chain=chain)
