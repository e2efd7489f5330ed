"""`kvrouter bench --target` end to end against a real streaming server: report files, plots, progress."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from kvrouter.bench import execute, plan_from_args
from kvrouter.cli import build_parser
from tests.loadgen_fake import build_fake_app


async def test_bench_against_a_running_endpoint_writes_the_report(tmp_path: Path) -> None:
    runner = web.AppRunner(build_fake_app(first_delay=0.05, token_delay=0.005))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        args = build_parser("bench").parse_args(
            ["--workload", "multi-tenant", "--policies", "", "--target", f"fake=http://127.0.0.1:{port}",
             "--duration", "4", "--rate", "3", "--system-tokens", "200", "--output-tokens", "5",
             "--users", "16", "--out", str(tmp_path / "out"), "--drain", "30"]
        )  # fmt: skip
        plan = plan_from_args(args)
        lines: list[str] = []
        report = await asyncio.to_thread(execute, plan, lines.append)
    finally:
        await runner.cleanup()
    out = tmp_path / "out"
    result = report["results"]["fake"]
    assert result["scheduled"] > 0
    assert result["completed"] == result["scheduled"] and result["errors"] == 0
    assert 0.04 < result["ttft_p50"] < result["e2e_p50"]
    assert result["replicas"]["fake"]["share"] == 1.0
    assert json.loads((out / "report.json").read_text())["results"]["fake"]["completed"] == result["completed"]
    assert "| fake |" in (out / "report.md").read_text()
    for name in ("ttft_cdf.png", "ttft_over_time.png", "replica_load.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert (out / "fake" / "locust_stats.csv").is_file()
    assert any(line.startswith("[fake]") and "done" in line for line in lines)
