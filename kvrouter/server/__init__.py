"""The router's HTTP server: the async shell a request passes through, and the process that runs it.

Everything here does I/O on the event loop; the decisions it acts on are made by the pure core in
`kvrouter/routing/`. Grouped by what a newcomer asks first — "where is the server?":

* `app.py` — `create_app`: every long-lived object of a router process is built and wired here.
* `proxy.py` — the completion handlers and the relay to the chosen replica (retries, timeouts, lifecycle reports).
* `status.py` — /v1/models, /health, /metrics, /debug/route.
* `streaming.py` — header hygiene and usage scanning on the bytes relayed.
* `client_limits.py` — the client edge: per-connection limits, slow-client protection, the listening site.
* `body_encoding.py` — compressed request bodies, inflated in bounded slices.
* `replicas.py` — replica state: health probes, passive failures, circuit breaker, engine /metrics scraping.
* `serving.py` — run one built app until SIGTERM/SIGINT and drain; shared by `kvrouter/serve.py` and workers.
* `workers.py` — `--workers N`: a supervisor and N router processes on one port (SO_REUSEPORT).
* `worker_metrics.py` — `/metrics` under `--workers`: every worker's metrics in each scrape, labelled `worker`.

The `serve` subcommand itself (flags, settings, exit codes) stays at `kvrouter/serve.py`, beside the other
subcommands (`relay.py`, `bench.py`, `demo.py`).
"""
