"""A fake OpenAI streaming server for load-generator tests: a real aiohttp application on a real socket.

Streams `max_tokens` content chunks `token_delay` apart after `first_delay`, then a usage chunk and [DONE];
the first chat chunk carries only the role, as vLLM's does. Run as a script it serves on the given port.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiohttp import web

FAKE_REPLICA = web.AppKey("fake_replica", dict)


def build_fake_app(first_delay: float = 0.05, token_delay: float = 0.01) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[FAKE_REPLICA] = {"bodies": []}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        app[FAKE_REPLICA]["bodies"].append(body)
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "x-kvrouter-replica": "fake"})
        await response.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(first_delay)
        count = int(body.get("max_tokens") or 4)
        for index in range(count):
            if index:
                await asyncio.sleep(token_delay)
            choice = {"index": 0, "delta": {"content": f" t{index}"}} if chat else {"index": 0, "text": f" t{index}"}
            await send({"choices": [choice]})
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 10
        await send(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": count,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
        )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


if __name__ == "__main__":
    web.run_app(build_fake_app(), host="127.0.0.1", port=int(sys.argv[1]))
