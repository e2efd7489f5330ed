"""Request -> token ids exactly as vLLM computes them, and the multi-turn render cache equals a fresh tokenize."""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvrouter.openai_request import ParsedRequest, RequestError, parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer, PromptLimits, build_prompt_tokenizer
from tests.vllm_captures import model_dir


def lists(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """A chat prompt's ids come as the render cache's array('I'): compare them as lists."""
    return [list(prompt) for prompt in prompts]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture
def tiny(tiny_dir: Path) -> HfPromptTokenizer:
    tokenizer = HfPromptTokenizer(tiny_dir, threads=2)
    yield tokenizer  # type: ignore[misc]
    tokenizer.close()


def chat(**body: Any) -> ParsedRequest:
    return parse_request("chat", json.dumps({"model": "m", **body}).encode())


def completion(**body: Any) -> ParsedRequest:
    return parse_request("completion", json.dumps({"model": "m", **body}).encode())


def fresh_chat_ids(tokenizer: HfPromptTokenizer, request: ParsedRequest) -> list[int]:
    return list(tokenizer.tokenizer(tokenizer.render(request), add_special_tokens=False).input_ids)


# ---- what vLLM 0.32 answered on its /render endpoints for the captured model ---------------------------------


def test_the_captured_models_chat_and_completion_ids_equal_vllms_render() -> None:
    tokenizer = HfPromptTokenizer(model_dir(), threads=1)
    messages = [{"role": "system", "content": "short system"}, {"role": "user", "content": "Hello there"}]
    assert lists(tokenizer.token_ids(chat(messages=messages))) == [
        [5, 205, 2388, 1865, 6, 205, 3, 205, 3056, 358, 1365, 6, 205, 4, 205]
    ]
    assert lists(tokenizer.token_ids(completion(prompt="Hello world, this is a render test."))) == [
        [0, 3056, 358, 7814, 18, 542, 317, 273, 8083, 1105, 20]
    ]


# ---- prompt shapes ------------------------------------------------------------------------------------------


def test_completion_prompt_shapes(tiny: HfPromptTokenizer) -> None:
    bos = tiny.tokenizer.bos_token_id
    one = lists(tiny.token_ids(completion(prompt="def f(x):\n    return x")))
    assert len(one) == 1 and one[0][0] == bos and one[0].count(bos) == 1
    batch = lists(tiny.token_ids(completion(prompt=["import os", "import sys"])))
    assert len(batch) == 2 and all(p[0] == bos for p in batch)
    assert lists(tiny.token_ids(completion(prompt=[5, 6, 7]))) == [[5, 6, 7]]
    assert lists(tiny.token_ids(completion(prompt=[[5, 6], [7]]))) == [[5, 6], [7]]
    without = lists(tiny.token_ids(completion(prompt="import os", add_special_tokens=False)))
    assert without == [batch[0][1:]]
    assert lists(tiny.token_ids(completion(prompt=[1, 2, 3, 4, 5], truncate_prompt_tokens=2))) == [[4, 5]]


def test_chat_has_exactly_one_bos_and_the_generation_prompt(tiny: HfPromptTokenizer) -> None:
    bos = tiny.tokenizer.bos_token_id
    messages = [{"role": "user", "content": "hi"}]
    ids = lists(tiny.token_ids(chat(messages=messages)))[0]
    assert ids[0] == bos and ids.count(bos) == 1
    assert tiny.render(chat(messages=messages)).endswith("<|assistant|>\n")
    assert not tiny.render(chat(messages=messages, add_generation_prompt=False)).endswith("<|assistant|>\n")
    continued = [*messages, {"role": "assistant", "content": "Hel"}]
    text = tiny.render(chat(messages=continued, add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("<|assistant|>\nHel")
    # add_special_tokens=True on a chat request doubles the BOS, as it does in vLLM.
    assert lists(tiny.token_ids(chat(messages=messages, add_special_tokens=True)))[0][:2] == [bos, bos]


def test_tools_text_parts_and_tool_call_arguments(tiny: HfPromptTokenizer) -> None:
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    text = tiny.render(chat(messages=messages, tools=[tool]))
    assert "You can call these tools" in text and '"name": "search"' in text and "a\nb" in text
    assert '"description": null' in text  # vLLM dumps the validated tool model, absent fields as null
    call = {"id": "1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    with_call = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert '"arguments": {"q": "x"}' in tiny.render(chat(messages=with_call))


def test_chat_template_kwargs_reach_the_template(tiny: HfPromptTokenizer) -> None:
    tiny.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    messages = [{"role": "user", "content": "q"}]
    assert tiny.render(chat(messages=messages, chat_template_kwargs={"enable_thinking": True})) == "q<think>"
    assert tiny.render(chat(messages=messages)) == "q"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "continue_final_message": True},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]},
        {"messages": [{"role": "raise", "content": "x"}]},
    ],
)
def test_requests_that_cannot_be_rendered_are_400(tiny: HfPromptTokenizer, body: dict[str, Any]) -> None:
    tiny.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'raise' %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(RequestError) as caught:
        lists(tiny.token_ids(chat(**body)))
    assert caught.value.status == 400


# ---- the render cache ---------------------------------------------------------------------------------------


def test_a_growing_conversation_reuses_the_previous_turn_and_equals_a_fresh_tokenize(
    tiny: HfPromptTokenizer,
) -> None:
    rng = random.Random(7)
    words = ["def", "  ", "\n", "class", "x", "=", "(", ")", "é", "日本語", "<|end|>", " \n\n", "return", "tab\t"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": " ".join(rng.choices(words, k=400))}]
    for turn in range(12):
        messages.append({"role": "user", "content": "".join(rng.choices(words, k=rng.randint(5, 60)))})
        request = chat(messages=messages)
        assert lists(tiny.token_ids(request)) == [fresh_chat_ids(tiny, request)], f"turn {turn}"
        messages.append({"role": "assistant", "content": "".join(rng.choices(words, k=rng.randint(1, 40)))})
    assert tiny.cache.partial_hits >= 10
    again = chat(messages=messages[:-1])
    assert lists(tiny.token_ids(again)) == [fresh_chat_ids(tiny, again)]
    assert tiny.cache.hits >= 1


def test_when_added_token_text_and_ids_disagree_the_offsets_decide(tiny: HfPromptTokenizer) -> None:
    tiny._atomic_text = re.compile(r"(?!x)x")  # finds nothing, so every render takes the offsets path
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief <|end|> " * 60}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn}\n\n"})
        request = chat(messages=messages)
        assert lists(tiny.token_ids(request)) == [fresh_chat_ids(tiny, request)]
        messages.append({"role": "assistant", "content": f" answer {turn} "})
    assert tiny.cache.partial_hits >= 3


def test_a_tokenizer_that_treats_an_inputs_first_piece_specially_gets_no_unsafe_reuse(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # SentencePiece-style: "▁" is prepended to the first piece of an input only, so "x<|end|>" + "hello" as
    # two inputs differs from one input; reuse across that boundary would change the ids.
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    core.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<|end|>", "<|user|>"], show_progress=False)
    core.train_from_iterator(["hello world, this is the tokenizer", "the quick brown fox jumps"] * 50, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=core, additional_special_tokens=["<|end|>", "<|user|>"])
    wrapped.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    wrapped.save_pretrained(str(tmp_path))
    tokenizer = HfPromptTokenizer(tmp_path, threads=1)
    assert tokenizer._atomic == frozenset()
    messages: list[dict[str, Any]] = []
    for turn in range(4):
        messages.append({"role": "user", "content": "hello world the fox " * 40 + str(turn)})
        request = chat(messages=messages)
        assert lists(tokenizer.token_ids(request)) == [fresh_chat_ids(tokenizer, request)]
    tokenizer.close()


def test_sibling_conversations_sharing_a_system_prompt_are_exact(tiny: HfPromptTokenizer) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    for question in ["What is 2+2?", "What is 2+2?\n", "What", "What is 2+2? Explain.", ""]:
        request = chat(messages=[system, {"role": "user", "content": question}])
        assert lists(tiny.token_ids(request)) == [fresh_chat_ids(tiny, request)]


def test_the_cache_is_bounded(tiny_dir: Path) -> None:
    tokenizer = HfPromptTokenizer(tiny_dir, threads=1, cache_entries=3)
    for n in range(10):
        lists(tokenizer.token_ids(chat(messages=[{"role": "user", "content": f"question {n} " * 200}])))
    assert len(tokenizer.cache) == 3
    tokenizer.close()


def encodes_by_thread(tokenizer: HfPromptTokenizer) -> list[tuple[str, int]]:
    """(thread name, characters) of every encode `tokenizer` makes from now on."""
    seen: list[tuple[str, int]] = []
    original = tokenizer._encode

    def spy(text: str, add_special: bool) -> list[int]:
        seen.append((threading.current_thread().name, len(text)))
        return original(text, add_special)

    tokenizer._encode = spy  # type: ignore[method-assign]
    return seen


LOOP = threading.main_thread().name


async def test_short_tails_encode_on_the_loop_and_long_ones_on_the_threads(tiny_dir: Path) -> None:
    tokenizer = HfPromptTokenizer(tiny_dir, threads=2, inline_chars=300)
    seen = encodes_by_thread(tokenizer)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer invoices. " * 60}]
    turns = [("hello", LOOP), ("a long question " * 40, "kvrouter-tokenizer_"), ("thanks", LOOP)]
    for n, (question, expected) in enumerate(turns):
        if n:
            messages.append({"role": "assistant", "content": f"answer {n}"})
        request = chat(messages=[*messages, {"role": "user", "content": question}])
        before = len(seen)
        ids = lists(await tokenizer.prompt_token_ids(request))
        assert ids == [fresh_chat_ids(tokenizer, request)]
        if n == 0:  # nothing cached yet: the whole render is the tail, over the bound
            assert len(seen) == before + 1 and seen[-1][1] > 300 and seen[-1][0].startswith("kvrouter-tokenizer_")
            continue
        (thread, chars), *rest = seen[before:]
        assert not rest and thread.startswith(expected), seen
        assert (chars <= 300) == (expected == LOOP)
    tokenizer.close()


async def test_completion_prompts_over_the_bound_and_large_prompts_take_the_threads(tiny_dir: Path) -> None:
    limits = PromptLimits(large_chars=1000)
    tokenizer = HfPromptTokenizer(tiny_dir, threads=2, inline_chars=800, limits=limits)
    seen = encodes_by_thread(tokenizer)
    await tokenizer.prompt_token_ids(completion(prompt="hello"))
    await tokenizer.prompt_token_ids(completion(prompt=["x" * 500, "y" * 500]))  # 1,000 characters to encode
    # Over `large_chars` (and a cached render covers all but the last words): still its own large-prompt thread.
    system = {"role": "system", "content": "a shared preamble. " * 60}
    await tokenizer.prompt_token_ids(chat(messages=[system, {"role": "user", "content": "one"}]))
    await tokenizer.prompt_token_ids(chat(messages=[system, {"role": "user", "content": "two"}]))
    threads = [name for name, _ in seen]
    assert threads[0] == LOOP
    assert threads[1].startswith("kvrouter-tokenizer_") and threads[2].startswith("kvrouter-tokenizer_")
    assert threads[3:] and all(name.startswith("kvrouter-tokenizer-large_") for name in threads[3:]), threads
    tokenizer.close()


async def test_inline_chars_zero_sends_every_request_to_the_threads(tiny_dir: Path) -> None:
    tokenizer = HfPromptTokenizer(tiny_dir, threads=2, inline_chars=0)
    seen = encodes_by_thread(tokenizer)
    assert await tokenizer.prompt_token_ids(completion(prompt="hello")) == [
        list(tokenizer.tokenizer("hello").input_ids)
    ]
    await tokenizer.prompt_token_ids(chat(messages=[{"role": "user", "content": "hi"}]))
    assert len(seen) == 2 and all(name.startswith("kvrouter-tokenizer_") for name, _ in seen), seen
    tokenizer.close()


def test_a_negative_inline_bound_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="inline_chars must be at least 0"):
        HfPromptTokenizer(tiny_dir, inline_chars=-1)


def test_no_tokenizer_configured_means_none_and_a_bad_path_is_an_error(tmp_path: Path) -> None:
    assert build_prompt_tokenizer(None, threads=1) is None
    with pytest.raises(ValueError, match=r"directory .*missing does not exist \(replicas.yaml 'tokenizer'"):
        build_prompt_tokenizer(tmp_path / "missing", threads=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        build_prompt_tokenizer(tmp_path / "file", threads=1)
    with pytest.raises(ValueError, match=r"holds neither tokenizer\.json nor tokenizer_config\.json"):
        build_prompt_tokenizer(tmp_path, threads=1)
    # A directory with the files but broken content still gets transformers' own reason.
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        build_prompt_tokenizer(tmp_path, threads=1)


def test_the_tiny_tokenizer_folder_is_readable_by_other_users(tmp_path: Path) -> None:
    # The image builds it as root for its non-root user: a private (0700) folder made `kvrouter sim` fail there.
    from kvrouter.tinymodel import build_tokenizer

    target = build_tokenizer(tmp_path / "tiny")
    assert target.stat().st_mode & 0o005 == 0o005
    for path in target.iterdir():
        assert path.stat().st_mode & 0o004, path
