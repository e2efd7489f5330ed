"""The Locust users against a real streaming server: TTFT is the first content token, not the whole stream."""

from __future__ import annotations

import asyncio
import csv
import json
import sys
import time
from pathlib import Path

import pytest
import requests
from aiohttp import web

from kvrouter.loadgen.client import Replay, send
from kvrouter.loadgen.plan import PlannedRequest, WorkloadParams
from kvrouter.loadgen.stream import Dispatcher, RequestRecord, StreamTimer
from kvrouter.loadgen.workloads import build_schedule
from tests.loadgen_fake import build_fake_app

ROOT = Path(__file__).resolve().parents[1]


def test_stream_timer_skips_role_chunk_and_splits_lines_anywhere() -> None:
    timer = StreamTimer(started=10.0)
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    first = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    second = b'data: {"choices":[{"delta":{"content":" there"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
    usage += b'"prompt_tokens_details":{"cached_tokens":4}}}\n\ndata: [DONE]\n\n'
    timer.feed(role, 10.1)
    assert timer.ttft is None
    timer.feed(first[:20], 10.2)
    timer.feed(first[20:], 10.3)
    timer.feed(second + usage, 10.5)
    assert timer.ttft == pytest.approx(0.3)
    assert timer.gaps == [pytest.approx(0.2)]
    record = RequestRecord("x", "s", 0, 0.0, 0.0)
    timer.fill(record, 10.6)
    assert record.error is None
    assert (record.output_tokens, record.prompt_tokens, record.cached_tokens) == (2, 7, 4)
    assert record.e2e_s == pytest.approx(0.6)


def test_stream_timer_reports_stream_errors_and_truncation() -> None:
    timer = StreamTimer(started=0.0)
    timer.feed(b'data: {"error": {"message": "engine died"}}\n\n', 1.0)
    record = RequestRecord("x", "s", 0, 0.0, 0.0)
    timer.fill(record, 1.0)
    assert record.error == "engine died"
    truncated = StreamTimer(started=0.0)
    truncated.feed(b'data: {"choices":[{"text":"a"}]}\n\n', 1.0)
    record = RequestRecord("x", "s", 0, 0.0, 0.0)
    truncated.fill(record, 1.0)
    assert record.error == "stream ended without [DONE]"


class _Unanswered:
    """What Locust's HttpSession returns when the connection fails: status 0, the error kept on the response."""

    status_code = 0
    text = None
    headers: dict[str, str] = {}
    error = ConnectionResetError(104, "Connection reset by peer")

    def __enter__(self) -> _Unanswered:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_request_without_an_answer_records_the_connection_error() -> None:
    sessions = build_schedule("multi-tenant", WorkloadParams(duration_s=5, rate=1, system_tokens=50))
    planned = sessions[0].requests[0]
    record = RequestRecord(planned.label, "s", 0, 0.0, 0.0)
    send(lambda path, **kwargs: _Unanswered(), Replay(Dispatcher(sessions), "fake-model", 30.0), planned, record)
    assert record.status == 0
    assert record.error == "HTTP 0: ConnectionResetError(104, 'Connection reset by peer')"


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_send_times_first_token_not_whole_stream() -> None:
    runner, url = await _serve(build_fake_app(first_delay=0.2, token_delay=0.1))
    try:
        sessions = build_schedule("multi-tenant", WorkloadParams(duration_s=5, rate=1, system_tokens=50))
        replay = Replay(Dispatcher(sessions), "fake-model", 30.0)
        http = requests.Session()

        def post(path: str, **kwargs: object) -> requests.Response:
            return http.post(url + path, **kwargs)  # type: ignore[arg-type]

        def body_with_8_tokens() -> dict[str, object]:
            body = sessions[0].requests[0].make_body()
            body["max_tokens"] = 8
            return body

        planned = PlannedRequest("chat", body_with_8_tokens, "multi-tenant", 8)
        record = RequestRecord(planned.label, "s", 0, 0.0, 0.0)
        await asyncio.to_thread(send, post, replay, planned, record)
        assert record.error is None, record.error
        assert record.status == 200 and record.replica == "fake"
        assert record.ttft_s is not None and record.e2e_s is not None
        assert 0.18 < record.ttft_s < 0.5
        assert record.e2e_s > record.ttft_s + 0.6  # seven more tokens 0.1 s apart
        assert record.output_tokens == 8
        assert record.itl_mean_s == pytest.approx(0.1, abs=0.05)
    finally:
        await runner.cleanup()


async def test_locust_headless_replays_the_schedule_and_fires_custom_timings(tmp_path: Path) -> None:
    app = build_fake_app(first_delay=0.05, token_delay=0.01)
    runner, url = await _serve(app)
    records = tmp_path / "records.jsonl"
    try:
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
            "--headless", "--host", url, "-u", "16", "-r", "16", "--run-time", "60s", "--only-summary",
            "--csv", str(tmp_path / "locust"),
            "--kv-workload", "multi-turn", "--kv-rate", "3", "--kv-duration", "3", "--kv-turns", "2",
            "--kv-think", "0.2", "--kv-system-tokens", "100", "--kv-output-tokens", "6",
            "--kv-records", str(records),
            cwd=str(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), timeout=90)
        assert process.returncode == 0, output.decode()[-2000:]
        assert time.monotonic() - started < 40  # ended by itself when the schedule was done
        expected = build_schedule(
            "multi-turn", WorkloadParams(duration_s=3, rate=3, turns=2, think_s=0.2, system_tokens=100)
        )
        lines = [json.loads(line) for line in records.read_text().splitlines()]
        assert len(lines) == 2 * len(expected) > 0
        assert all(line["error"] is None and line["output_tokens"] == 6 for line in lines)
        assert all(0.04 < line["ttft_s"] < line["e2e_s"] for line in lines)
        assert max(line["start_s"] - line["due_s"] for line in lines) < 0.5
        second_turns = [line for line in lines if line["turn"] == 1]
        assert second_turns and all(line["due_s"] > 0 for line in second_turns)
        with (tmp_path / "locust_stats.csv").open() as handle:
            rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}
        assert int(rows[("TTFT", "multi-turn")]["Request Count"]) == len(lines)
        assert int(rows[("E2E", "multi-turn")]["Request Count"]) == len(lines)
        assert ("ITL", "multi-turn") in rows
    finally:
        await runner.cleanup()
