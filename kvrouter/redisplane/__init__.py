"""The Redis event plane: a relay writes each replica's normalised KV events to Redis; routers follow them.

`layout` names the keys (one hash slot per replica), `entries` is the wire format of stream entries and
snapshots, `state` the relay's authoritative per-replica block state, `writer` the relay's side of Redis,
`catchup` reads a replica's snapshot and stream back, `follower` is the router's side, `wiring` builds it for the
app with its metrics, `clients` makes Redis clients for a single Redis, Sentinel or Cluster from one URL
(password, ACL user, TLS; `masked_url` for logs), and `problems` counts and logs hostile data without stopping.
The relay command itself is `kvrouter.relay`. See docs/redis-sizing.md for the design and its sizing.
"""
