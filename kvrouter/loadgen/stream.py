"""Timing a streamed OpenAI response, and handing out a schedule's sessions to load-test users (pure).

`StreamTimer` is fed the response's raw bytes as they arrive, with the arrival time, and finds the SSE events in
them. TTFT is the time of the first event that carries content (chat `delta.content`, `reasoning_content` or
`tool_calls`; completion `text`): vLLM's first chat chunk carries only the role and says nothing about the
prefill. Inter-token latency is the gap between content events; output tokens come from the final usage chunk
(`stream_options.include_usage`) and fall back to the number of content events.

`Dispatcher` gives each free user the next session and the time it is due, measured from the test's start;
the users sleep until then, so arrivals are open-loop as long as enough users are free (a late start is recorded
as `lag_s`, so an overloaded load generator shows up in the report instead of silently lowering the rate).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvrouter.loadgen.plan import Session


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds, `start_s` from the test's start."""

    label: str
    session: str
    turn: int
    due_s: float
    start_s: float
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_mean_s: float | None = None
    itl_max_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None
    error: str | None = None

    @property
    def lag_s(self) -> float:
        return self.start_s - self.due_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


@dataclass(slots=True)
class StreamTimer:
    """Feed bytes with `feed(data, now)`; read the timings once `done` (or the stream ended)."""

    started: float
    first_content: float | None = None
    last_content: float | None = None
    content_events: int = 0
    gaps: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None
    _buffer: bytes = b""

    def feed(self, data: bytes, now: float) -> None:
        self._buffer += data
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return
            line = self._buffer[:cut].strip()
            self._buffer = self._buffer[cut + 1 :]
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = f"undecodable SSE event: {payload[:80]!r}"
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            error = event["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        if _has_content(event.get("choices")):
            if self.first_content is None:
                self.first_content = now
            elif self.last_content is not None:
                self.gaps.append(now - self.last_content)
            self.last_content = now
            self.content_events += 1

    @property
    def ttft(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.started

    @property
    def output_tokens(self) -> int:
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return self.content_events

    @property
    def prompt_tokens(self) -> int | None:
        value = None if self.usage is None else self.usage.get("prompt_tokens")
        return value if isinstance(value, int) else None

    @property
    def cached_tokens(self) -> int | None:
        details = None if self.usage is None else self.usage.get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) else None

    def fill(self, record: RequestRecord, ended: float) -> None:
        record.ttft_s = self.ttft
        record.e2e_s = ended - self.started
        if self.gaps:
            record.itl_mean_s = sum(self.gaps) / len(self.gaps)
            record.itl_max_s = max(self.gaps)
        record.output_tokens = self.output_tokens
        record.prompt_tokens = self.prompt_tokens
        record.cached_tokens = self.cached_tokens
        if self.error is not None:
            record.error = self.error
        elif not self.done:
            record.error = "stream ended without [DONE]"
        elif self.first_content is None:
            record.error = "no content in the stream"


def _has_content(choices: object) -> bool:
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
        ):
            return True
    return False


@dataclass(slots=True)
class Dispatcher:
    """Hands out sessions in start order; tracks how many are still running so the test can end."""

    sessions: Sequence[Session]
    next_index: int = 0
    running: int = 0

    def take(self) -> Session | None:
        if self.next_index >= len(self.sessions):
            return None
        session = self.sessions[self.next_index]
        self.next_index += 1
        self.running += 1
        return session

    def finish(self) -> None:
        self.running -= 1

    @property
    def exhausted(self) -> bool:
        return self.next_index >= len(self.sessions) and self.running == 0

    @property
    def progress(self) -> tuple[int, int]:
        return self.next_index, len(self.sessions)
