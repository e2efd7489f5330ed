"""The Redis event plane: a relay writes each replica's normalised KV events to Redis; routers follow them.

`layout` names the keys (one hash slot per replica), `entries` is the wire format of stream entries and
snapshots, `state` the relay's authoritative per-replica block state, `writer` the relay's side of Redis and
`follower` the router's. See docs/redis-sizing.md for the design and its sizing.
"""
