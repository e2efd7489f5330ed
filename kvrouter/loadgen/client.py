"""What a load-test user does, without Locust: the flags, the shared replay state, and one streamed request.

`locustfile.py` wires this into Locust; keeping it here keeps the locustfile declarative and lets tests drive a
request with a plain `requests.Session`. The response body is read with `read1`, which returns whatever bytes
have arrived (chunked or not), so the first content token is timed when it arrives, not when a buffer fills.

Flags (all `--kv-*`, so they never collide with Locust's): the workload and its knobs, the model name (asked
from /v1/models when omitted), and `--kv-records FILE`, a JSON-lines file with one `RequestRecord` per request,
which `kvrouter bench` reads for exact percentiles (Locust's own are bucketed) and per-replica shares.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from kvrouter.loadgen.plan import PlannedRequest, WorkloadParams
from kvrouter.loadgen.stream import Dispatcher, RequestRecord, StreamTimer
from kvrouter.loadgen.workloads import WORKLOADS, build_schedule, with_overrides

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
REPLICA_HEADER = "x-kvrouter-replica"
SESSION_HEADER = "x-session-id"

Fire = Callable[..., None]
"""Locust's `events.request.fire` (keyword arguments)."""


class _Response(Protocol):
    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...


def add_flags(parser: Any) -> None:
    """Add the --kv-* flags to Locust's (configargparse) parser or a plain argparse parser."""
    group = parser.add_argument_group("kvrouter workload")
    group.add_argument("--kv-workload", default="multi-tenant", choices=sorted(WORKLOADS), help="Workload.")
    group.add_argument("--kv-seed", type=int, default=0, help="Seed; the same seed gives the same requests.")
    group.add_argument("--kv-duration", type=float, default=60.0, help="Seconds of arrivals to schedule.")
    group.add_argument("--kv-rate", type=float, default=None, help="Sessions starting per second.")
    group.add_argument("--kv-tenants", type=int, default=None, help="Tenants (system prompts).")
    group.add_argument("--kv-system-tokens", type=int, default=None, help="System prompt size, tokens.")
    group.add_argument("--kv-output-tokens", type=int, default=None, help="max_tokens of chat requests.")
    group.add_argument("--kv-turns", type=int, default=None, help="Turns per chat / steps per agent loop.")
    group.add_argument("--kv-think", type=float, default=None, help="Mean pause between turns, seconds.")
    group.add_argument("--kv-trace", default=None, help="Mooncake trace file (jsonl).")
    group.add_argument("--kv-trace-speedup", type=float, default=None, help="Trace seconds per wall second.")
    group.add_argument("--kv-trace-start", type=float, default=None, help="Start offset into the trace, s.")
    group.add_argument("--kv-vocab", type=int, default=None, help="Token ids of trace prompts are < this.")
    group.add_argument("--kv-model", default="", help="Model name to send (default: first of /v1/models).")
    group.add_argument("--kv-records", default="", help="Write one JSON line per request to this file.")
    group.add_argument("--kv-timeout", type=float, default=900.0, help="Per-request read timeout, seconds.")
    group.add_argument(
        "--kv-session-header",
        action="store_true",
        help="Send each session's key as x-session-id (session affinity hints; chat and agent sessions).",
    )


def params_from_options(options: Any) -> tuple[str, WorkloadParams]:
    params = with_overrides(
        WorkloadParams(seed=options.kv_seed, duration_s=options.kv_duration),
        rate=options.kv_rate,
        tenants=options.kv_tenants,
        system_tokens=options.kv_system_tokens,
        output_tokens=options.kv_output_tokens,
        turns=options.kv_turns,
        think_s=options.kv_think,
        trace=Path(options.kv_trace) if options.kv_trace else None,
        trace_speedup=options.kv_trace_speedup,
        trace_start_s=options.kv_trace_start,
        vocab_high=options.kv_vocab,
    )
    return options.kv_workload, params


def discover_model(get: Callable[[str], _Response]) -> str:
    """The first model the endpoint serves."""
    response = get("/v1/models")
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered {response.status_code}; pass --kv-model")
    models = json.loads(response.text).get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models listed no model; pass --kv-model")
    return str(models[0]["id"])


@dataclass(slots=True)
class Replay:
    """The state every user of one test shares: the schedule, its clock origin and the records file."""

    dispatcher: Dispatcher
    model: str
    timeout_s: float
    records: IO[str] | None = None
    session_header: bool = False
    """Send the session key as `x-session-id`."""
    clock: Callable[[], float] = time.monotonic
    origin: float | None = None
    completed: int = 0
    errors: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, options: Any, model: str) -> Replay:
        name, params = params_from_options(options)
        sessions = build_schedule(name, params)
        records = open(options.kv_records, "w", encoding="utf-8") if options.kv_records else None  # noqa: SIM115
        header = bool(getattr(options, "kv_session_header", False))
        return cls(Dispatcher(sessions), model, options.kv_timeout, records, session_header=header)

    def now(self) -> float:
        """Seconds since the first user asked for work (the schedule's time zero)."""
        if self.origin is None:
            self.origin = self.clock()
        return self.clock() - self.origin

    def write(self, record: RequestRecord) -> None:
        self.completed += 1
        if record.error is not None:
            self.errors += 1
        if self.records is not None:
            self.records.write(record.to_json() + "\n")
            self.records.flush()

    def close(self) -> None:
        if self.records is not None:
            self.records.close()
            self.records = None


def send(
    post: Callable[..., Any],
    replay: Replay,
    planned: PlannedRequest,
    record: RequestRecord,
) -> RequestRecord:
    """Send one planned request with streaming and time it; `post` is `client.post` (Locust's or requests')."""
    body = planned.make_body()
    body["model"] = replay.model
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body, separators=(",", ":")).encode()
    started = replay.clock()
    timer = StreamTimer(started)
    request_headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if replay.session_header:
        request_headers[SESSION_HEADER] = record.session
    try:
        with post(
            PATHS[planned.endpoint],
            data=payload,
            headers=request_headers,
            stream=True,
            timeout=(10.0, replay.timeout_s),
            **_locust_kwargs(post, planned.label),
        ) as response:
            record.status = int(getattr(response, "status_code", 0) or 0)
            headers = getattr(response, "headers", None) or {}
            record.replica = headers.get(REPLICA_HEADER)
            if record.status != 200:
                # Status 0: no answer at all; Locust keeps the connection error on the response, not in its text.
                failure = getattr(response, "error", None) if record.status == 0 else None
                detail = repr(failure) if failure is not None else getattr(response, "text", "") or ""
                record.error = f"HTTP {record.status}: {_short(detail)}"
                _mark_failure(response, record.error)
            else:
                raw = response.raw
                while True:
                    data = raw.read1(65536)
                    if not data:
                        break
                    timer.feed(data, replay.clock())
                timer.fill(record, replay.clock())
                if record.error is not None:
                    _mark_failure(response, record.error)
    except Exception as error:  # connection errors, timeouts: recorded, never fatal to the user
        record.error = record.error or f"{type(error).__name__}: {error}"
        if record.e2e_s is None:
            record.e2e_s = replay.clock() - started
    return record


def _locust_kwargs(post: Callable[..., Any], label: str) -> dict[str, Any]:
    # Locust's HttpSession takes `name` and `catch_response`; a plain requests.Session does not.
    owner = getattr(post, "__self__", None)
    if owner is not None and hasattr(owner, "request_event"):
        return {"name": label, "catch_response": True}
    return {}


def _mark_failure(response: Any, message: str) -> None:
    failure = getattr(response, "failure", None)
    if callable(failure):
        failure(message)


def _short(text: str) -> str:
    return text.replace("\n", " ")[:200]


def fire_timings(fire: Fire, record: RequestRecord) -> None:
    """Report TTFT, mean inter-token latency and end-to-end time (with output tokens) as Locust requests."""
    failure = None if record.error is None else RuntimeError(record.error)
    for kind, seconds in (("TTFT", record.ttft_s), ("ITL", record.itl_mean_s)):
        if seconds is not None:
            fire(
                request_type=kind,
                name=record.label,
                response_time=seconds * 1000,
                response_length=0,
                exception=None,
                context={},
            )
    fire(
        request_type="E2E",
        name=record.label,
        response_time=(record.e2e_s or 0.0) * 1000,
        response_length=record.output_tokens,
        exception=failure,
        context={},
    )
