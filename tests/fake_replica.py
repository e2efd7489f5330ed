"""Fake vLLM replicas: real aiohttp applications on 127.0.0.1 port 0 speaking the shapes vLLM's OpenAI server
speaks — chat and text completions (JSON and SSE with a delay between chunks, usage with
`prompt_tokens_details.cached_tokens`), /health, /metrics in vLLM's Prometheus format (one series per engine),
/v1/models, /tokenize and /detokenize.

A test steers a replica through `FakeBehaviour` (answer status, delays, a `hold` event that parks streams after
their first chunk, dying mid-stream) and reads back what it saw: every request's headers and raw body, which
requests finished and which were cancelled because the router closed the connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict


@dataclass
class FakeBehaviour:
    status: int = 200
    """Answer completions with this status (>= 400: an OpenAI error body)."""
    health_status: int = 200
    chunks: int = 3
    """Content chunks in a stream (and words in a non-stream answer)."""
    first_delay: float = 0.0
    """Seconds before the first chunk (or the whole non-stream answer): the prefill."""
    chunk_delay: float = 0.0
    """Seconds between stream chunks: decoding."""
    cached_tokens: int | None = 0
    """Reported in usage.prompt_tokens_details; None leaves the details out (vLLM's default)."""
    die_after_chunks: int | None = None
    """Drop the connection after this many content chunks."""
    hold: asyncio.Event | None = None
    """When set, streams park after their first chunk until the event is set."""
    waiting: tuple[int, ...] = (0,)
    """vllm:num_requests_waiting per engine (its length is the number of engines)."""
    running: tuple[int, ...] = (0,)
    kv_usage: tuple[float, ...] = (0.0,)
    poison_marker: bytes | None = None
    """Completions whose raw body contains these bytes are answered 500 (an input that crashes the engine)."""
    hang: bool = False
    """Completions and pass-through calls are read and never answered (an engine hung behind a live server)."""
    redirect_to: str | None = None
    """Answer completions, /tokenize, /health and /metrics with a 307 to this URL."""
    body_bytes: int | None = None
    """Answer non-stream completions (or errors, with `status`) with a chunked JSON body of about this size."""
    metrics_bytes: int | None = None
    """Pad /metrics with comment lines to about this size."""
    busy_engine: bool = False
    """vllm:generation_tokens_total rises on every scrape: the engine is computing something."""
    pd_prefill: bool = True
    """A request whose kv_transfer_params ask for a remote decode is answered as vLLM's NixlConnector prefill
    instance answers: one token, and top-level kv_transfer_params saying where the prompt's KV is."""
    prefill_params: dict[str, Any] | None = None
    """Send these kv_transfer_params instead of the NixlConnector-shaped ones (an empty dict: send none)."""
    reject_transfer: int | None = None
    """Answer requests carrying kv_transfer_params with do_remote_prefill with this status (a failed KV pull)."""


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeReplica:
    name: str
    model: str = "fake-model"
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    port: int = 0
    seen: list[SeenRequest] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    in_flight: int = 0
    scrapes: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def completions_seen(self) -> list[SeenRequest]:
        return [r for r in self.seen if r.path.endswith("completions")]

    def build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        return app

    async def start(self) -> FakeReplica:
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening (later connects are refused); `start` again reopens on the same port."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers -------------------------------------------------------------------------------------------

    async def _record(self, request: web.Request) -> tuple[SeenRequest, dict[str, Any]]:
        raw = await request.read()
        seen = SeenRequest(request.method, request.path, CIMultiDict(request.headers), raw)
        self.seen.append(seen)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        return seen, body if isinstance(body, dict) else {}

    async def _hostile(self, request: web.Request, raw: bytes = b"") -> web.StreamResponse | None:
        """The answer of a hostile behaviour, or None to answer normally."""
        behaviour = self.behaviour
        if behaviour.redirect_to is not None:
            return web.Response(status=307, headers={"Location": behaviour.redirect_to})
        if behaviour.hang:
            await asyncio.Event().wait()
        if behaviour.poison_marker is not None and behaviour.poison_marker in raw:
            return self._error(500)
        if behaviour.body_bytes is not None and request.path.endswith("completions"):
            response = web.StreamResponse(status=behaviour.status, headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"padding": "')
            piece = b"x" * 65536
            for _ in range(behaviour.body_bytes // len(piece) + 1):
                await response.write(piece)
            await response.write(b'"}')
            await response.write_eof()
            return response
        return None

    def _error(self, status: int) -> web.Response:
        body = {"error": {"message": f"{self.name} fails with {status}", "type": "Error", "code": status}}
        return web.json_response(body, status=status)

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if self.behaviour.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.behaviour.cached_tokens}
        return usage

    def words(self) -> list[str]:
        return [f"{self.name}-{i} " for i in range(self.behaviour.chunks)]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        seen, body = await self._record(request)
        request_id = request.headers.get("x-request-id", "none")
        behaviour = self.behaviour
        hostile = await self._hostile(request, seen.body)
        if hostile is not None:
            return hostile
        if behaviour.status != 200:
            return self._error(behaviour.status)
        transfer = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if isinstance(transfer, dict):
            if transfer.get("do_remote_decode") and behaviour.pd_prefill:
                try:
                    if behaviour.first_delay:
                        await asyncio.sleep(behaviour.first_delay)
                except asyncio.CancelledError:
                    self.cancelled.append(request_id)
                    raise
                return self._prefilled(chat, max(1, len(seen.body) // 4))
            if transfer.get("do_remote_prefill") and behaviour.reject_transfer is not None:
                return self._error(behaviour.reject_transfer)
        self.in_flight += 1
        try:
            if behaviour.first_delay:
                await asyncio.sleep(behaviour.first_delay)
            prompt_tokens = max(1, len(seen.body) // 4)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                response = await self._stream(request, chat, prompt_tokens, include_usage)
            else:
                response = self._whole(chat, prompt_tokens)
            self.finished.append(request_id)
            return response
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        finally:
            self.in_flight -= 1

    def _prefilled(self, chat: bool, prompt_tokens: int) -> web.Response:
        params = self.behaviour.prefill_params
        if params is None:
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": f"engine-{self.name}",
                "remote_request_id": f"req-{self.name}",
                "remote_host": "127.0.0.1",
                "remote_port": self.port,
                "tp_size": 1,
            }
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
        payload: dict[str, Any] = {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(prompt_tokens, 1),
        }
        if params:
            payload["kv_transfer_params"] = params
        self.finished.append("prefill")
        return web.json_response(payload)

    def _whole(self, chat: bool, prompt_tokens: int) -> web.Response:
        text = "".join(self.words())
        created = int(time.time())
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "reasoning_content": None, "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
            kind, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
            kind, prefix = "text_completion", "cmpl"
        payload = {
            "id": f"{prefix}-{self.name}",
            "object": kind,
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(prompt_tokens, len(self.words())),
            "prompt_logprobs": None,
        }
        return web.json_response(payload)

    async def _stream(
        self, request: web.Request, chat: bool, prompt_tokens: int, include_usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        created = int(time.time())
        kind, prefix = ("chat.completion.chunk", "chatcmpl") if chat else ("text_completion", "cmpl")
        base = {"id": f"{prefix}-{self.name}", "object": kind, "created": created, "model": self.model}

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps({**base, **payload}).encode() + b"\n\n"

        def piece(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                delta = {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

        behaviour = self.behaviour
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            await response.write(event({"choices": [role]}))
        words = self.words()
        for position, word in enumerate(words):
            if behaviour.die_after_chunks is not None and position >= behaviour.die_after_chunks:
                assert request.transport is not None
                request.transport.close()
                return response
            if position > 0 and behaviour.chunk_delay:
                await asyncio.sleep(behaviour.chunk_delay)
            finish = "stop" if position == len(words) - 1 else None
            await response.write(event({"choices": [piece(word, finish)]}))
            if position == 0 and behaviour.hold is not None:
                await behaviour.hold.wait()
        if include_usage:
            await response.write(event({"choices": [], "usage": self._usage(prompt_tokens, len(words))}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _health(self, request: web.Request) -> web.Response:
        if self.behaviour.redirect_to is not None:
            return web.Response(status=307, headers={"Location": self.behaviour.redirect_to})
        return web.Response(status=self.behaviour.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        behaviour = self.behaviour
        self.scrapes += 1
        if behaviour.redirect_to is not None:
            return web.Response(status=307, headers={"Location": behaviour.redirect_to})
        labels = 'engine="{engine}",model_name="' + self.model + '"'
        gauges: list[tuple[str, str, tuple[float, ...]]] = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", behaviour.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", behaviour.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", behaviour.kv_usage),
        ]
        lines: list[str] = []
        for name, description, values in gauges:
            lines += [f"# HELP {name} {description}", f"# TYPE {name} gauge"]
            lines += [f"{name}{{{labels.format(engine=e)}}} {float(v)}" for e, v in enumerate(values)]
        lines += [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="{self.model}"}} 1234.0',
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{self.model}"}} 0.0',
            'python_gc_objects_collected_total{generation="0"} 12.0',
        ]
        if behaviour.busy_engine:
            lines.append(f'vllm:generation_tokens_total{{engine="0",model_name="{self.model}"}} {self.scrapes}.0')
        if behaviour.metrics_bytes is not None:
            lines += ["# " + "x" * 1000] * (behaviour.metrics_bytes // 1000)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model,
            "object": "model",
            "created": 1_700_000_000,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": 4096,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        seen, body = await self._record(request)
        hostile = await self._hostile(request, seen.body)
        if hostile is not None:
            return hostile
        text = body.get("prompt") or ""
        tokens = [ord(c) for c in str(text)]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        _, body = await self._record(request)
        tokens = body.get("tokens") or []
        return web.json_response({"prompt": "".join(chr(t) for t in tokens)})
