"""vLLM KV-cache events, from the wire to the prefix index.

`wire` decodes the engines' msgpack once into typed values; `zmq_source` follows one replica's publisher (seq
tracking per DP rank, gap replay, restart detection) and hands each normalised `EventBatch` to a sink callback,
so the router's embedded ingest and the Redis relay share one implementation; `ingest` applies batches to the
index with kvrouter's own block keys; `embedded` runs one source per replica inside the router; `metrics` holds
the Prometheus collectors both modes use.
"""
