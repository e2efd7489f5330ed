"""How close kv_aware's engine source comes to a replica's real prefill rate, light and loaded.

Starts one simulated replica (`kvrouter sim`'s app, in process, on 127.0.0.1) of a profile, sends it streamed
token-id prompts that share nothing (every token computed) at a fixed number of requests in flight, scrapes its
/metrics every `--scrape-s` of wall time and feeds the scrapes to `EngineRates` exactly as the router's scrape
loop does (`kvrouter/routing/engine_rates.py`). It prints, per concurrency, the share of the run some request was
in prefill, the bound and the profile's own prefill rate for one full pass from an empty context, and their
ratio: the bound must stay at or below 1.0x, and the closer the better.

    python loadtest/engine_rate_check.py --profile dynamo-mocker --concurrency 1,4,16 --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import aiohttp
from aiohttp import web

from kvrouter.routing.engine_rates import EngineRates, EngineTotals, parse_engine_totals
from kvrouter.sim.profiles import build_engine, get_profile
from kvrouter.sim.server import ReplicaSettings, build_replica_app
from kvrouter.sim.textio import SimTokenizer
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.typedefs import ReplicaName


async def run(profile_name: str, concurrency: int, requests: int, scale: float, scrape_s: float, seed: int) -> None:
    profile = get_profile(profile_name)
    settings = ReplicaSettings(
        name="e0", model_name="m", max_model_len=131072, request_overhead_s=profile.request_overhead_s,
        time_scale=scale,
    )  # fmt: skip
    app = build_replica_app(settings, build_engine(profile), SimTokenizer(ensure_tokenizer()))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    rates = EngineRates()
    started = time.monotonic()
    done = False

    async def scrape(session: aiohttp.ClientSession) -> EngineTotals | None:
        async with session.get(f"{url}/metrics") as response:
            scraped = parse_engine_totals(await response.text())
        rates.observe(ReplicaName("e0"), scraped)
        return scraped if isinstance(scraped, EngineTotals) else None

    async def scraper(session: aiohttp.ClientSession) -> None:
        while not done:
            await scrape(session)
            await asyncio.sleep(scrape_s)

    async def client(session: aiohttp.ClientSession, queue: asyncio.Queue[list[int]]) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": "m", "prompt": prompt, "max_tokens": 16, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for _ in response.content:
                    pass

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for _ in range(requests):
        length = rng.randint(1000, 12000)
        queue.put_nowait([rng.randrange(1, 30000) for _ in range(length)])
    async with aiohttp.ClientSession() as session:
        watcher = asyncio.create_task(scraper(session))
        await asyncio.gather(*(client(session, queue) for _ in range(concurrency)))
        done = True
        await watcher
        final = await scrape(session)
    await runner.cleanup()
    batch = 8192
    full_pass_s = profile.step_time(batch, 0, batch, batch * batch / 2)
    true_rate = batch / full_pass_s
    bound = rates.rate(ReplicaName("e0"))
    assert final is not None
    by_prefill_time = final.computed_tokens / final.prefill_s
    busy = final.prefill_s / ((time.monotonic() - started) * scale)
    print(
        f"| {profile_name} | {concurrency} | {requests} | {busy:.2f} "
        f"| {by_prefill_time:,.0f} | {bound or 0:,.0f} | {true_rate:,.0f} | {(bound or 0) / true_rate:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="dynamo-mocker")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--time-scale", type=float, default=10.0, help="Simulated seconds per wall second.")
    parser.add_argument("--scrape-s", type=float, default=0.1, help="Wall seconds between scrapes.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        "| profile | in flight | requests | Σ prefill s ÷ elapsed s | Σ tokens / Σ prefill s | engine bound "
        "| profile rate | bound / rate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        asyncio.run(run(args.profile, concurrency, args.requests, args.time_scale, args.scrape_s, args.seed))


if __name__ == "__main__":
    main()
