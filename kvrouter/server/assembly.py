"""Non-streaming answers assembled from a streamed upstream, so the router sees the first token when it happens.

vLLM sends a non-streaming answer whole, when generation ends. Until then nothing tells the router that the
prompt's prefill is done, so the load book would count the prompt as pending prefill for the request's entire
decode and kv_aware would overrate that replica's queue (measured: 1.65 s of a 1.71 s request, against 0.19 s when
streamed). For a request of the common shape (`assemblable`: one choice, no logprobs, no tools, no echo, no
token-id or prompt-text returns; an allow-list of fields) the proxy asks the replica for a stream instead
(`stream: true`, `stream_options.include_usage`), reports the first token at the stream's first chunk, and builds
the JSON answer the replica would have sent.

Exact, not approximate: the answer's layout — its key order, the value of every field a stream does not carry,
and the serialiser's separators and escaping — is learned per replica and endpoint from one whole answer of that
replica (the first assemblable request a replica gets goes unchanged, `Plan.LEARN`). The learned body must
re-serialise to its own bytes, and every field the stream does not carry must hold its default (null, [] or {}):
a replica that adds KV-transfer parameters, per-request metrics or expert routing to every answer, or that
formats JSON in a way this module cannot reproduce, keeps its answers whole (`Plan.WHOLE`). Fields filled from
the stream: id, created, model, system_fingerprint; the choice's index, finish_reason and stop_reason; the
message's role, content and reasoning (or a completion's text); usage, each sub-field from the stream's final
usage chunk and null where that chunk leaves one out (vLLM drops nulls there). A stream that carries anything
the layout cannot hold (a non-null field it does not know, a tool call) is a mismatch: the answer is still
assembled from what was understood, the mismatch is counted and the layout forgotten, so the next request to that
replica relearns it. Layouts are also relearned after `LAYOUT_TTL_S` and whenever the replica fails a request (an
upgrade comes with a restart). The real-vLLM test compares assembled answers with vLLM's own, byte for byte.

Cost: the router decodes each stream event (one small JSON object per token) instead of one body; vLLM serialises
an event per token instead of one answer. Knob: `Settings.assemble_non_streaming` (on by default).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrouter.openai_request import Endpoint, ParsedRequest
from kvrouter.server.json_body import encode_body
from kvrouter.typedefs import ReplicaName

LAYOUT_TTL_S = 600.0
"""A learned layout is relearned this long after it was learned, so an upgraded replica's answers are followed."""
MAX_EVENT_BYTES = 1 << 20
"""The most bytes of one unfinished stream event held; a longer event is a broken stream."""

# The fields of a non-streaming request that leave the answer's shape alone (one choice, text only, no per-token
# or prompt-side extras). A request with any other field is forwarded unchanged: an allow-list, so a field a
# future vLLM adds (which might add to the answer) never reaches the assembler unexamined.
_SHARED_FIELDS = frozenset(
    {
        "model",
        "stream",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "length_penalty",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "user",
        "n",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "truncate_prompt_tokens",
        "priority",
        "cache_salt",
        "request_id",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "add_special_tokens",
        "vllm_xargs",
        "logprobs",
        "echo",
    }
)
_CHAT_FIELDS = _SHARED_FIELDS | {
    "messages",
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "mm_processor_kwargs",
    "parallel_tool_calls",
}
_COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt", "suffix"}
# Fields the assembler fills from the stream, per level of the answer; every other field of the layout must hold
# its default (`_DEFAULTS`) for the layout to be usable.
_TOP_FILLED = frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint"})
_CHOICE_FILLED = frozenset({"index", "message", "text", "finish_reason", "stop_reason"})
_MESSAGE_FILLED = frozenset({"role", "content", "reasoning", "reasoning_content"})
_TEXT_DELTAS = ("content", "reasoning", "reasoning_content")
# What a stream event may carry besides the filled fields without changing the answer (vLLM sends some of these
# as explicit nulls, and an empty tool-call list).
_DEFAULTS: tuple[Any, ...] = (None, [], {})


def assemblable(parsed: ParsedRequest) -> bool:
    """True when the request's answer can be assembled exactly from a stream (see the module docstring)."""
    body = parsed.body
    if parsed.stream or "stream_options" in body:
        return False
    allowed = _CHAT_FIELDS if parsed.endpoint == "chat" else _COMPLETION_FIELDS
    if any(name not in allowed for name in body):
        return False
    if body.get("n", 1) not in (1, None) or body.get("echo") not in (False, None):
        return False
    if body.get("logprobs") not in (False, None):
        return False
    if parsed.endpoint == "completion":
        prompt = body.get("prompt")
        # One prompt, one choice: a batch of prompts answers with a choice per prompt.
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in prompt)
        )
        return single and body.get("suffix") is None
    return True


def streamed_body(parsed: ParsedRequest) -> bytes:
    """The request as a stream with a final usage chunk; every other field as the client sent it
    (`kvrouter.server.json_body`: msgspec for a body msgspec decoded, json for the rest)."""
    body = dict(parsed.body)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return encode_body(body, finite_json=parsed.finite_json)


@dataclass(frozen=True, slots=True)
class JsonStyle:
    """How a server serialises JSON: its separators and whether it escapes non-ASCII characters."""

    separators: tuple[str, str]
    ensure_ascii: bool

    def dumps(self, value: Any) -> bytes:
        text = json.dumps(value, ensure_ascii=self.ensure_ascii, allow_nan=False, separators=self.separators)
        try:
            return text.encode()
        except UnicodeEncodeError:
            # A lone surrogate in generated text: the one form that encodes (the replica could not send it raw).
            return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=self.separators).encode()


# vLLM (Starlette's JSONResponse) first; then Python's defaults (aiohttp's json_response) and the other two mixes.
STYLES = (
    JsonStyle((",", ":"), ensure_ascii=False),
    JsonStyle((", ", ": "), ensure_ascii=True),
    JsonStyle((",", ":"), ensure_ascii=True),
    JsonStyle((", ", ": "), ensure_ascii=False),
)


@dataclass(frozen=True, slots=True)
class Layout:
    """One replica's non-streaming answer shape for one endpoint, learned from a whole answer it sent."""

    endpoint: Endpoint
    template: Mapping[str, Any]
    style: JsonStyle


def _defaults_only(obj: Mapping[str, Any], filled: frozenset[str]) -> bool:
    return all(key in filled or value in _DEFAULTS for key, value in obj.items())


def learn_layout(endpoint: Endpoint, body: bytes) -> Layout | None:
    """The layout of `body` (a 200 answer to an assemblable request), or None when it cannot be reproduced."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, dict) or not _defaults_only(answer, _TOP_FILLED):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if not _defaults_only(choice, _CHOICE_FILLED) or not isinstance(answer.get("usage"), dict):
        return None
    if endpoint == "chat":
        message = choice.get("message")
        if not isinstance(message, dict) or not _defaults_only(message, _MESSAGE_FILLED):
            return None
    elif not isinstance(choice.get("text"), str):
        return None
    style = next((style for style in STYLES if style.dumps(answer) == body), None)
    return None if style is None else Layout(endpoint, answer, style)


class StreamError(Exception):
    """The stream cannot become an answer: it broke its own format (a retry elsewhere may do better)."""


@dataclass(slots=True)
class StreamedAnswer:
    """What a replica's SSE stream said, gathered event by event (`feed`) for `assemble`."""

    endpoint: Endpoint
    limit: int
    """The most bytes of generated text held (`max_upstream_body_bytes`); past it `too_large` is set."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Top-level id, object, created, model, system_fingerprint: the first non-null value of each."""
    role: str | None = None
    texts: dict[str, list[str]] = field(default_factory=dict)
    """Generated text by field (content, reasoning, ...; a completion's text under "text")."""
    finish_reason: Any = None
    stop_reason: Any = None
    index: int = 0
    usage: dict[str, Any] | None = None
    error: bytes | None = None
    """The JSON of an error event (`{"error": {...}}`), as the replica sent it."""
    error_status: int = 500
    done: bool = False
    """The stream's `data: [DONE]` arrived."""
    too_large: bool = False
    unexpected: list[str] = field(default_factory=list)
    """Non-default fields no layout can hold, by path (a mismatch)."""
    _size: int = 0
    _pending: bytes = b""

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        *events, self._pending = data.split(b"\n\n")
        if len(self._pending) > MAX_EVENT_BYTES:
            raise StreamError(f"a stream event longer than {MAX_EVENT_BYTES} bytes")
        for event in events:
            self._event(event)

    def close(self) -> None:
        if self._pending.strip():
            self._event(self._pending)
        self._pending = b""

    def _event(self, event: bytes) -> None:
        payload = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
        if not payload:
            return  # comments and keep-alives
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            raise StreamError("a stream event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise StreamError("a stream event that is not a JSON object")
        if "error" in chunk:
            self._error(chunk, payload)
            return
        for key, value in chunk.items():
            if key == "choices":
                self._choices(value)
            elif key == "usage":
                if isinstance(value, dict):
                    self.usage = value
            elif key in _TOP_FILLED:
                if value is not None:
                    self.fields.setdefault(key, value)
            elif value not in _DEFAULTS:
                self.unexpected.append(key)

    def _error(self, chunk: dict[str, Any], payload: bytes) -> None:
        self.error = payload
        error = chunk["error"]
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
            self.error_status = code

    def _choices(self, choices: Any) -> None:
        if not isinstance(choices, list):
            raise StreamError("a stream event whose choices are not a list")
        for choice in choices:
            if not isinstance(choice, dict):
                raise StreamError("a stream choice that is not an object")
            for key, value in choice.items():
                if key == "delta" and self.endpoint == "chat" and isinstance(value, dict):
                    self._delta(value)
                elif key == "text" and self.endpoint == "completion" and isinstance(value, str):
                    self._text("text", value)
                elif key == "index" and isinstance(value, int):
                    self.index = value
                elif key == "finish_reason" and value is not None:
                    self.finish_reason = value
                elif key == "stop_reason" and value is not None:
                    self.stop_reason = value
                elif key not in _CHOICE_FILLED and value not in _DEFAULTS:
                    self.unexpected.append(f"choices.{key}")

    def _delta(self, delta: Mapping[str, Any]) -> None:
        for key, value in delta.items():
            if key == "role" and isinstance(value, str):
                self.role = self.role or value
            elif key in _TEXT_DELTAS and isinstance(value, str):
                self._text(key, value)
            elif value not in _DEFAULTS:
                self.unexpected.append(f"delta.{key}")

    def _text(self, key: str, value: str) -> None:
        self._size += len(value)
        if self._size > self.limit:
            self.too_large = True
            return
        self.texts.setdefault(key, []).append(value)


def _fill(template: Any, value: Any) -> Any:
    """`value` laid out like `template`: a dict's keys in the template's order (the stream's extras after them)."""
    if not isinstance(template, dict):
        return value
    if not isinstance(value, dict):
        return None
    out = {key: _fill(default, value.get(key)) for key, default in template.items()}
    out.update((key, item) for key, item in value.items() if key not in template)
    return out


def assemble(layout: Layout, answer: StreamedAnswer) -> tuple[bytes, list[str]]:
    """The whole answer's bytes, and what of the stream the layout could not hold (empty: exact)."""
    unexpected = list(answer.unexpected)
    texts = {key: "".join(parts) for key, parts in answer.texts.items()}
    template = layout.template
    choice_template: Mapping[str, Any] = template["choices"][0]
    choice: dict[str, Any] = {}
    for key, default in choice_template.items():
        if key == "index":
            choice[key] = answer.index
        elif key == "message":
            choice[key] = _message(default, answer, texts)
        elif key == "text":
            choice[key] = texts.get("text", "")
        elif key == "finish_reason":
            choice[key] = answer.finish_reason if answer.finish_reason is not None else "stop"
        elif key == "stop_reason":
            choice[key] = answer.stop_reason
        else:
            choice[key] = default
    if layout.endpoint == "chat":
        known = set(choice_template["message"])
        unexpected += [f"delta.{key}" for key in texts if key not in known]
    out: dict[str, Any] = {}
    for key, default in template.items():
        if key == "choices":
            out[key] = [choice]
        elif key == "usage":
            out[key] = _fill(default, answer.usage or {})
            unexpected += [f"usage.{extra}" for extra in (answer.usage or {}) if extra not in default]
        elif key in _TOP_FILLED and key != "object":
            out[key] = answer.fields.get(key, default if key == "system_fingerprint" else None)
        else:
            out[key] = default
    return layout.style.dumps(out), unexpected


def _message(template: Mapping[str, Any], answer: StreamedAnswer, texts: Mapping[str, str]) -> dict[str, Any]:
    message: dict[str, Any] = {}
    for key, default in template.items():
        if key == "role":
            message[key] = answer.role or default
        elif key == "content":
            message[key] = texts.get("content", "")
        elif key in _TEXT_DELTAS:
            message[key] = texts.get(key, default)
        else:
            message[key] = default
    return message


class Plan(enum.Enum):
    """How one attempt fetches a non-streaming answer."""

    WHOLE = "whole"
    """Forward the client's bytes; the answer comes whole (first token known only at its end)."""
    LEARN = "learn"
    """As WHOLE, and learn the replica's layout from the answer."""
    ASSEMBLE = "assemble"
    """Ask for a stream and assemble the answer."""


@dataclass(slots=True)
class AnswerFetch:
    """One attempt's plan for a non-streaming request: how its answer is fetched, and why (a metric label)."""

    parsed: ParsedRequest
    plan: Plan
    layout: Layout | None
    reason: str
    """disabled, request_shape, replica_layout (WHOLE); learning (LEARN); assembled (ASSEMBLE)."""

    def streamed_body(self) -> bytes:
        return streamed_body(self.parsed)


@dataclass(slots=True)
class _Known:
    layout: Layout | None
    """None: the replica's answers cannot be assembled (until relearned)."""
    learned_at: float


class AnswerLayouts:
    """The layouts learned per (replica, endpoint), with their expiry; synchronous, the clock injected."""

    def __init__(self, clock: Callable[[], float], *, ttl_s: float = LAYOUT_TTL_S) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._known: dict[tuple[ReplicaName, Endpoint], _Known] = {}

    def plan(self, replica: ReplicaName, endpoint: Endpoint) -> tuple[Plan, Layout | None]:
        key = (replica, endpoint)
        known = self._known.get(key)
        if known is not None and self._clock() - known.learned_at >= self._ttl_s:
            del self._known[key]
            known = None
        if known is None:
            return Plan.LEARN, None
        if known.layout is None:
            return Plan.WHOLE, None
        return Plan.ASSEMBLE, known.layout

    def learn(self, replica: ReplicaName, endpoint: Endpoint, body: bytes) -> Layout | None:
        layout = learn_layout(endpoint, body)
        self._known[(replica, endpoint)] = _Known(layout, self._clock())
        return layout

    def refuse(self, replica: ReplicaName, endpoint: Endpoint) -> None:
        """The replica's streamed answers cannot be used (until the layout's expiry)."""
        self._known[(replica, endpoint)] = _Known(None, self._clock())

    def forget(self, replica: ReplicaName) -> None:
        for key in [key for key in self._known if key[0] == replica]:
            del self._known[key]


__all__ = [
    "AnswerFetch",
    "AnswerLayouts",
    "Layout",
    "Plan",
    "StreamError",
    "StreamedAnswer",
    "assemblable",
    "assemble",
    "learn_layout",
    "streamed_body",
]
