"""Locust users replaying a kvrouter workload against any OpenAI-compatible endpoint (`--host`).

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 64 -r 64 \
        --kv-workload multi-tenant --kv-rate 2 --kv-duration 60

Each user takes the schedule's next session, sleeps until it is due and sends its requests with `stream=True`
(HttpUser, not FastHttpUser, which would hold the whole stream), reading the SSE events as they arrive. Besides
Locust's own POST entry (time to response headers), every request fires `TTFT` (first content token), `ITL`
(mean inter-token latency) and `E2E` (with output tokens as the response length) through `events.request.fire`.
Users are a pool of connections, not the load: arrivals follow the schedule, so give enough users (`-u`) for
the sessions that run at once. The run ends by itself when the schedule is done.
"""

from __future__ import annotations

from typing import Any

import gevent  # type: ignore[import-untyped]
from locust import HttpUser, constant, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

from kvrouter.loadgen.client import Replay, add_flags, discover_model, fire_timings, send
from kvrouter.loadgen.stream import RequestRecord


def _flags(parser: Any) -> None:
    add_flags(parser)


def _start(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    model = options.kv_model
    if not model:
        import requests

        host = (environment.host or "").rstrip("/")
        model = discover_model(lambda path: requests.get(host + path, timeout=10))
    environment.kv_replay = Replay.build(options, model)


def _stop(environment: Any, **_: Any) -> None:
    replay = getattr(environment, "kv_replay", None)
    if replay is not None:
        replay.close()


def _listen(hooks: Any) -> None:
    hooks.init_command_line_parser.add_listener(_flags)
    hooks.test_start.add_listener(_start)
    hooks.test_stop.add_listener(_stop)


_listen(events)


class OpenAIStreamingUser(HttpUser):
    wait_time = constant(0)

    @task
    def replay_session(self) -> None:
        replay: Replay = self.environment.kv_replay
        session = replay.dispatcher.take()
        if session is None:
            raise StopUser()
        try:
            due = session.start_s
            for turn, planned in enumerate(session.requests):
                if turn:
                    due = replay.now() + planned.think_s  # closed loop inside a session
                gevent.sleep(max(0.0, due - replay.now()))
                record = RequestRecord(planned.label, session.key, turn, due, replay.now())
                send(self.client.post, replay, planned, record)
                fire_timings(self.environment.events.request.fire, record)
                replay.write(record)
        finally:
            replay.dispatcher.finish()
        if replay.dispatcher.exhausted and self.environment.runner is not None:
            # Locust rewrites its CSV files once per interval and not at exit: quit after one more write.
            gevent.spawn_later(CSV_STATS_INTERVAL_SEC + 0.5, self.environment.runner.quit)
