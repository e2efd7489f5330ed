"""Hot-spot trace variant: half the requests after the start share one tenant prefix; lengths and times kept."""

from __future__ import annotations

import json
from pathlib import Path

from kvrouter.replay.hotspot import hot_spot
from kvrouter.replay.trace import load_trace


def test_half_the_traffic_after_the_start_opens_with_the_tenant_prefix(tmp_path: Path) -> None:
    rows = [
        {"timestamp": t * 100, "input_length": 2000 + t, "output_length": 5, "hash_ids": [0, 1 + t, 50 + t, 90 + t]}
        for t in range(12)
    ]
    rows.append({"timestamp": 1200, "input_length": 300, "output_length": 5, "hash_ids": [0]})
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    trace = load_trace(path)
    hot = hot_spot(trace, share=0.5, start=0.5, prefix_blocks=2)
    assert hot_spot(trace, share=0.0) is trace
    changed = [i for i, (a, b) in enumerate(zip(trace.requests, hot.requests, strict=True)) if a != b]
    assert changed == [7, 9, 11]  # from t=600 (half of 0..1200) on, every second request
    tenant = hot.requests[7].chain[:2]
    used = {c for r in trace.requests for c in r.chain}
    assert not used & set(tenant)
    for i in changed:
        before, after = trace.requests[i], hot.requests[i]
        assert after.chain[:2] == tenant and len(after.chain) == len(before.chain)
        assert (after.arrival, after.input_length, after.output_length) == (
            before.arrival,
            before.input_length,
            before.output_length,
        )
        assert not used & set(after.chain[2:])  # blocks behind the tenant prefix are new prefixes
    assert hot.requests[9].chain[2:] != hot.requests[11].chain[2:]
    short = hot_spot(trace, share=1.0, start=1.0, prefix_blocks=2).requests[-1]
    assert short.chain == tenant[:1]  # a one-block prompt gets the tenant's first block only
