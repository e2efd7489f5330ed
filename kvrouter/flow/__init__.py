"""Flow control: a queue in the router, with priority bands and per-tenant fairness (docs/flow-control.md).

Pure parts: `settings` (the `flow:` section of replicas.yaml), `classes` (a request's band and tenant from its
headers and body), `saturation` (when every eligible replica has a full engine pass of work queued), `queue`
(bands, weighted fair sharing of served tokens per tenant inside a band, TTLs, lengths, anti-starvation). The live
shell is `kvrouter.server.flow_gate`; the replay drives the same queue on its virtual clock.
"""
