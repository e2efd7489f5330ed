"""Load generation: deterministic workloads, the Locust user that replays them, and the bench report.

`workloads` and `trace` are pure (a seed in, a schedule of sessions out); `stream` times an SSE response;
`locustfile` is the only module that imports Locust and runs only inside the Locust process; `fleet`, `report`
and `plots` serve `kvrouter bench` and `kvrouter demo`.
"""
