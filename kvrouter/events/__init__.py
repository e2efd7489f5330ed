"""vLLM KV-cache events: wire decoding (`wire`), the ZMQ source with gap replay (`zmq_source`), and ingest into
the prefix index (`ingest`). The source hands normalised `EventBatch`es to a sink callback, so the router's
embedded ingest and the Redis relay share one implementation."""
