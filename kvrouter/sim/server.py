"""One simulated vLLM replica's HTTP server (aiohttp): vLLM's OpenAI API over an engine model.

Endpoints as vLLM serves them: /v1/completions (a string, token ids, or a batch of either), /v1/chat/completions
(the tokenizer's chat template), both streaming (SSE, `stream_options.include_usage`) or not, with
`usage.prompt_tokens_details.cached_tokens`; /v1/models, /health, /version, /tokenize, POST /reset_prefix_cache,
/metrics. A request whose `model` names one of `lora_adapters` runs under that adapter (its blocks keyed by it,
its events carrying it). Any other `model` is served by the base model, unchecked — unless `strict_model` is set:
then, as vLLM does, a `model` that is neither the served name nor an adapter gets a 404 NotFoundError ("The model
`X` does not exist.") and only a missing or empty one falls back to the base model, so a router in front that
rewrites the model name fails here as it would on real vLLM. /v1/models lists the served name as vLLM does (`root`
the model's path, one permission entry).
A request spends the profile's front-end overhead, then its prompts enter the engine; tokens stream back as the
engine's passes end. Generation always runs to `max_tokens` (the simulator never samples EOS, so `ignore_eos` is
accepted and changes nothing); without `max_tokens` a request gets `default_max_tokens`, capped by the context
window. A client that disconnects has its requests aborted in the engine. `priority` (vLLM's request field, an
integer) reaches the engine under `scheduling_policy` priority; under fcfs a nonzero one is a 400 ("Got priority
N but Priority scheduling is not enabled."), as vLLM answers it.

Disaggregated prefill/decode (`kvrouter.sim.kv_transfer`, vLLM's NixlConnector protocol): a replica has a `role`.
A `prefill` or `both` replica answers a prefill leg (`kv_transfer_params.do_remote_decode`, one prompt) like any
request and adds the top-level `kv_transfer_params` that point a decode worker at it. A `decode` or `both` replica
takes a decode leg (`do_remote_prefill`, naming a producer registered in `KvPeers`): it waits the profile's KV
transfer time, then runs the request with its prompt's KV counted as transferred (its blocks stored, and announced
on the event stream, at admission). A leg a replica's role cannot serve, malformed params or an unknown engine id
get a 400 error; a decode leg whose prefill worker has died since it answered gets a 500 (the KV pull failed, as
under vLLM's `kv_load_failure_policy: fail`). `PdFaults` make a replica fail its legs for tests: answer prefill legs
with an error status, die after answering one (every later connection is closed unanswered, /health included), or
reject transfers (500).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvrouter.sim.device import LiveDevice
from kvrouter.sim.driver import DONE, EngineDriver, Tracked
from kvrouter.sim.hashing import prompt_hashes
from kvrouter.sim.kv_transfer import (
    KvPeers,
    KvTransferError,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
    prefill_answer,
)
from kvrouter.sim.metrics import ReplicaMetrics
from kvrouter.sim.model import EngineModel, EngineRequest, SchedulingPolicy
from kvrouter.sim.profiles import KvTransfer
from kvrouter.sim.publisher import KvEventPublisher
from kvrouter.sim.textio import SimTokenizer
from kvrouter.typedefs import ReplicaRole


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    name: str
    model_name: str
    max_model_len: int
    request_overhead_s: float = 0.0
    time_scale: float = 1.0
    hash_seed: int = 0
    default_max_tokens: int = 256
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapter names served besides the base model; a request naming one is keyed by it (vLLM's rule)."""
    role: ReplicaRole = "both"
    """Which legs of a disaggregated request it takes: prefill (KV producer), decode (consumer), both."""
    kv_transfer: KvTransfer | None = None
    """A decode leg's KV transfer cost (the profile's); None: instant."""
    engine_id: str = ""
    """The id its prefill answers name (vLLM's engine_id); default `<name>-engine`."""
    strict_model: bool = False
    """Refuse (404, as vLLM) a request whose `model` is neither `model_name` nor an adapter; else serve any name."""
    model_root: str = ""
    """What /v1/models gives as the base model's `root` (vLLM: the model's path); default `model_name`."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """The engine's --scheduling-policy (as the engine was built): under fcfs a request's nonzero `priority` is a
    400, as vLLM answers it; under priority the engine orders by it."""

    @property
    def kv_engine_id(self) -> str:
        return self.engine_id or f"{self.name}-engine"


@dataclass(slots=True)
class PdFaults:
    """Ways a replica fails its P/D legs, for tests (settable while it runs)."""

    prefill_status: int | None = None
    """Answer every prefill leg with this status and an error body."""
    die_after_prefill: bool = False
    """After answering one prefill leg, close every connection unanswered (a crashed worker)."""
    reject_transfers: bool = False
    """Answer every decode leg 500: the KV could not be pulled."""
    dead: bool = False
    """Set once a `die_after_prefill` replica has answered its prefill leg."""


@dataclass(slots=True)
class Replica:
    settings: ReplicaSettings
    engine: EngineModel
    driver: EngineDriver
    tokenizer: SimTokenizer
    metrics: ReplicaMetrics
    publisher: KvEventPublisher | None
    ids: itertools.count[int]
    peers: KvPeers
    faults: PdFaults


REPLICA = web.AppKey("replica", Replica)


class ApiError(Exception):
    def __init__(
        self, message: str, status: int = 400, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param


def _error(error: ApiError) -> web.Response:
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.status}}
    return web.json_response(body, status=error.status)


def _check_model(settings: ReplicaSettings, body: dict[str, Any]) -> None:
    """vLLM's model check (OpenAIModelRegistry.check_model): a missing or empty name means the base model."""
    model = body.get("model")
    if not settings.strict_model or not model or model == settings.model_name or model in settings.lora_adapters:
        return
    raise ApiError(f"The model `{model}` does not exist.", 404, "NotFoundError", param="model")


def build_replica_app(
    settings: ReplicaSettings,
    engine: EngineModel,
    tokenizer: SimTokenizer,
    *,
    publisher: KvEventPublisher | None = None,
    clock: Callable[[], float] = time.monotonic,
    peers: KvPeers | None = None,
    faults: PdFaults | None = None,
    device: LiveDevice | None = None,
) -> web.Application:
    """`peers`: the transfer plane shared by the replicas of one process (this replica registers in it; default a
    plane of its own). `device`: the GPU it shares with other replicas of the process (default one of its own)."""
    metrics = ReplicaMetrics(settings.model_name, engine.gauges)
    driver = EngineDriver(
        engine, time_scale=settings.time_scale, publisher=publisher, metrics=metrics, clock=clock, device=device
    )
    peers = peers if peers is not None else KvPeers()
    faults = faults if faults is not None else PdFaults()
    peers.register(settings.kv_engine_id, settings.role, lambda: not faults.dead)
    replica = Replica(settings, engine, driver, tokenizer, metrics, publisher, itertools.count(), peers, faults)
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_dead_replica])
    app[REPLICA] = replica
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/metrics", _metrics)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    replica = app[REPLICA]
    if replica.publisher is not None:
        replica.publisher.start()
    replica.driver.start()
    yield
    await replica.driver.stop()
    if replica.publisher is not None:
        await replica.publisher.close()


@web.middleware
async def _dead_replica(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A replica that died (`PdFaults.die_after_prefill`) closes every connection without an answer."""
    if request.app[REPLICA].faults.dead:
        if request.transport is not None:
            request.transport.close()
        raise web.HTTPServiceUnavailable()  # never reaches the closed connection
    return await handler(request)


# -- small endpoints -----------------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": "0.32.0+kvrouter.sim"})


async def _models(request: web.Request) -> web.Response:
    settings = request.app[REPLICA].settings
    created = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    model = {
        "id": settings.model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": settings.model_root or settings.model_name,
        "parent": None,
        "max_model_len": settings.max_model_len,
        "permission": [permission],
    }
    # vLLM's adapter cards carry no max_model_len.
    adapters = [
        {**model, "id": name, "root": name, "parent": settings.model_name, "max_model_len": None}
        for name in settings.lora_adapters
    ]
    return web.json_response({"object": "list", "data": [model, *adapters]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[REPLICA].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    # Like vLLM, AllBlocksCleared goes out with the engine's next pass, not at the reset itself.
    ok = replica.engine.reset_prefix_cache()
    return web.json_response({"success": ok})


async def _tokenize(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    try:
        body = await _json_body(request)
        _check_model(replica.settings, body)
        if "messages" in body:
            ids = await replica.tokenizer.chat_ids(_messages(body), body.get("tools"))
        elif isinstance(body.get("prompt"), str):
            ids = await replica.tokenizer.completion_ids(body["prompt"])
        else:
            raise ApiError("'prompt' (a string) or 'messages' is required")
    except ApiError as error:
        return _error(error)
    strings = replica.tokenizer.token_strings(ids) if body.get("return_token_strs") else None
    return web.json_response(
        {"count": len(ids), "max_model_len": replica.settings.max_model_len, "tokens": ids, "token_strs": strings}
    )


# -- request decoding ----------------------------------------------------------------------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError("'messages' must be a non-empty list of objects")
    return messages


async def _completion_prompts(replica: Replica, prompt: object) -> list[list[int]]:
    def is_ids(value: object) -> bool:
        return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)

    if isinstance(prompt, str):
        return [await replica.tokenizer.completion_ids(prompt)]
    if is_ids(prompt):
        assert isinstance(prompt, list)
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [await replica.tokenizer.completion_ids(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise ApiError("'prompt' must be a string, a list of strings, token ids or a list of token-id lists")


def _priority(body: dict[str, Any], settings: ReplicaSettings) -> int:
    """vLLM's request `priority` (an integer, 0 by default); nonzero only under the priority policy."""
    value = body.get("priority", 0)
    if value is None:
        value = 0
    if type(value) is not int:
        raise ApiError("'priority' must be an integer", param="priority")
    if value != 0 and settings.scheduling_policy != "priority":
        raise ApiError(f"Got priority {value} but Priority scheduling is not enabled.")
    return value


def _max_tokens(body: dict[str, Any], settings: ReplicaSettings, longest_prompt: int) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    room = settings.max_model_len - longest_prompt
    if value is None:
        value = min(settings.default_max_tokens, room)
    if type(value) is not int or value < 1:
        raise ApiError("'max_tokens' must be a positive integer")
    if longest_prompt + value > settings.max_model_len:
        raise ApiError(
            f"This model's maximum context length is {settings.max_model_len} tokens. However, you requested "
            f"{longest_prompt + value} tokens ({longest_prompt} in the messages, {value} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return int(value)


# -- generation ----------------------------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    try:
        body = await _json_body(request)
        _check_model(replica.settings, body)
        prompts = await _completion_prompts(replica, body.get("prompt"))
    except ApiError as error:
        return _error(error)
    return await _generate(request, replica, body, prompts, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    replica = request.app[REPLICA]
    try:
        body = await _json_body(request)
        _check_model(replica.settings, body)
        prompts = [await replica.tokenizer.chat_ids(_messages(body), body.get("tools"))]
    except ApiError as error:
        return _error(error)
    except Exception as error:  # a template that cannot render these messages
        return _error(ApiError(f"chat template failed: {error}"))
    return await _generate(request, replica, body, prompts, chat=True)


async def _generate(
    request: web.Request, replica: Replica, body: dict[str, Any], prompts: list[list[int]], *, chat: bool
) -> web.StreamResponse:
    settings = replica.settings
    arrived = time.monotonic()
    try:
        max_tokens = _max_tokens(body, settings, max(len(p) for p in prompts))
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError("'cache_salt' must be a non-empty string")
        leg = _leg(replica, body, prompts)
        priority = _priority(body, settings)
    except ApiError as error:
        return _error(error)
    faults = replica.faults
    if isinstance(leg, RemoteDecode) and faults.prefill_status is not None:
        status = faults.prefill_status
        kind = "InternalServerError" if status >= 500 else "BadRequestError"
        return _error(ApiError(f"prefill failed (injected fault {status})", status, kind))
    if isinstance(leg, RemotePrefill) and (faults.reject_transfers or not replica.peers.is_alive(leg.engine_id)):
        why = "injected fault" if faults.reject_transfers else "the prefill worker is gone"
        message = f"KV transfer from {leg.engine_id!r} failed ({why})"
        return _error(ApiError(message, 500, "InternalServerError"))
    model = body.get("model")
    lora_name = model if isinstance(model, str) and model in settings.lora_adapters else None
    lora_id = settings.lora_adapters.index(lora_name) + 1 if lora_name is not None else None
    number = next(replica.ids)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{settings.name}-{number}"
    if settings.request_overhead_s > 0:
        await asyncio.sleep(settings.request_overhead_s / settings.time_scale)
    if isinstance(leg, RemotePrefill) and settings.kv_transfer is not None:
        await asyncio.sleep(settings.kv_transfer.seconds(len(prompts[0])) / settings.time_scale)
    sink: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    block_size = replica.engine.block_size
    tracked: list[Tracked] = []
    try:
        for index, ids in enumerate(prompts):
            outputs = replica.tokenizer.sample_outputs(f"{settings.hash_seed}:{request_id}:{index}", max_tokens)
            engine_request = EngineRequest(
                request_id=f"{request_id}-{index}",
                prompt_len=len(ids),
                block_hashes=prompt_hashes(
                    ids, block_size, cache_salt=salt, lora_name=lora_name, seed=settings.hash_seed
                ),
                max_tokens=max_tokens,
                arrival=replica.driver.sim_time(),
                token_ids=ids,
                cache_salt=salt,
                lora_name=lora_name,
                lora_id=lora_id,
                output_token_ids=outputs,
                kv_transferred=isinstance(leg, RemotePrefill),
                priority=priority,
            )
            item = Tracked(engine_request, index, sink, arrived)
            replica.driver.submit(item)
            tracked.append(item)
        stream = body.get("stream") is True
        if stream:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            return await _stream(request, replica, request_id, tracked, sink, chat=chat, include_usage=usage)
        answer = await _complete(replica, request_id, tracked, sink, chat=chat)
        if isinstance(leg, RemoteDecode):
            answer = _prefill_answered(request, replica, request_id, answer)
        return answer
    except ValueError as error:
        return _error(ApiError(str(error)))
    finally:
        for item in tracked:
            if not item.finished:
                replica.driver.abort(item.request.request_id)


def _leg(replica: Replica, body: dict[str, Any], prompts: list[list[int]]) -> RemoteDecode | RemotePrefill | None:
    """Which leg of a disaggregated request this is, checked against the replica's role; raises ApiError."""
    settings = replica.settings
    try:
        leg = parse_kv_transfer_params(body.get("kv_transfer_params"))
    except KvTransferError as error:
        raise ApiError(str(error)) from None
    if leg is None:
        return None
    if len(prompts) != 1:
        raise ApiError("'kv_transfer_params' takes a single prompt")
    if isinstance(leg, RemoteDecode):
        if settings.role == "decode":
            raise ApiError(f"{settings.name} is a decode worker (kv_consumer): it does not prefill for a remote decode")
        return leg
    if settings.role == "prefill":
        raise ApiError(f"{settings.name} is a prefill worker (kv_producer): it does not take remote prefills")
    if not replica.peers.is_producer(leg.engine_id):
        raise ApiError(f"'kv_transfer_params.remote_engine_id' {leg.engine_id!r} is not a known prefill worker")
    blocks = -(-len(prompts[0]) // replica.engine.block_size)
    if len(leg.block_ids) > blocks:
        raise ApiError(f"'kv_transfer_params.remote_block_ids' has {len(leg.block_ids)} blocks, the prompt {blocks}")
    return leg


def _prefill_answered(request: web.Request, replica: Replica, request_id: str, answer: web.Response) -> web.Response:
    """The prefill leg's answer with the params that point the decode worker here."""
    assert answer.text is not None
    body = json.loads(answer.text)
    prompt = body["usage"]["prompt_tokens"]
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    host, port = (str(sockname[0]), int(sockname[1])) if isinstance(sockname, tuple) else ("127.0.0.1", 0)
    blocks = list(range(-(-prompt // replica.engine.block_size)))
    body["kv_transfer_params"] = prefill_answer(replica.settings.kv_engine_id, blocks, host, port, request_id)
    if replica.faults.die_after_prefill:
        replica.faults.dead = True
    return web.json_response(body)


def _usage(tracked: list[Tracked]) -> dict[str, Any]:
    prompt = sum(t.request.prompt_len for t in tracked)
    completion = sum(t.emitted for t in tracked)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in tracked)},
    }


def _text(replica: Replica, item: Tracked, start: int, end: int) -> str:
    outputs = item.request.output_token_ids or ()
    return "".join(replica.tokenizer.text_of(t) for t in outputs[start:end])


async def _complete(
    replica: Replica, request_id: str, tracked: list[Tracked], sink: asyncio.Queue[tuple[int, str]], *, chat: bool
) -> web.Response:
    remaining = len(tracked)
    while remaining:
        _, kind = await sink.get()
        if kind == DONE:
            remaining -= 1
    choices: list[dict[str, Any]] = []
    for item in tracked:
        text = _text(replica, item, 0, item.emitted)
        if chat:
            message = {"role": "assistant", "content": text, "tool_calls": []}
            choices.append(
                {"index": item.index, "message": message, "logprobs": None, "finish_reason": "length",
                 "stop_reason": None}
            )  # fmt: skip
        else:
            choices.append(
                {"index": item.index, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "prompt_logprobs": None}
            )  # fmt: skip
    body = {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": replica.settings.model_name,
        "choices": choices,
        "usage": _usage(tracked),
    }
    return web.json_response(body)


async def _stream(
    request: web.Request,
    replica: Replica,
    request_id: str,
    tracked: list[Tracked],
    sink: asyncio.Queue[tuple[int, str]],
    *,
    chat: bool,
    include_usage: bool,
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    head = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": replica.settings.model_name,
    }
    sent = [0] * len(tracked)
    remaining = len(tracked)
    with contextlib.suppress(ConnectionResetError):
        while remaining:
            index, kind = await sink.get()
            if kind == DONE:
                remaining -= 1
                continue
            item = tracked[index]
            if chat and sent[index] == 0:
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}  # fmt: skip
                await response.write(_sse({**head, "choices": [role]}))
            text = _text(replica, item, sent[index], item.emitted)
            sent[index] = item.emitted
            finish = "length" if item.emitted >= item.request.max_tokens else None
            if chat:
                choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            await response.write(_sse({**head, "choices": [choice]}))
        if include_usage:
            await response.write(_sse({**head, "choices": [], "usage": _usage(tracked)}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
