"""Reused prefixes are exact: whatever the template and the text, a prompt's ids equal tokenizing it whole.

The render cache reuses a cached render's ids up to an added token's end and tokenizes only the rest; the
tokenizer is called directly, not through transformers' wrapper; the cache finds shared prefixes in C. Each of
those is held here against transformers tokenizing the whole rendered prompt, over several chat templates
(the project's tiny tokenizer, the captured vLLM model's, and templates that put text right against the added
tokens) and texts drawn to sit across the boundaries: spaces and newlines, added-token text and fragments of it,
non-ASCII, in growing conversations and in siblings that share a system prompt.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.openai_request import ParsedRequest, parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer, _native_common_prefix, _shared_prefix
from tests.vllm_captures import model_dir


def lists(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """A chat prompt's ids come as the render cache's array('I'): compare them as lists."""
    return [list(prompt) for prompt in prompts]


# Text right against the added tokens, before and after, with and without whitespace.
TIGHT = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPACED = (
    "{% for m in messages %}{{ m['role'] }}: <|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@functools.cache
def tokenizer(name: str) -> HfPromptTokenizer:
    if name == "captured":
        return HfPromptTokenizer(model_dir(), threads=1)
    tokenizer = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    if name != "tiny":
        tokenizer.tokenizer.chat_template = {"tight": TIGHT, "spaced": SPACED}[name]
    return tokenizer


PIECES = st.sampled_from(
    [
        "the",
        " the",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "x",
        "=",
        "é",
        "日本",
        "😀",
        "<|end|>",
        "<|user|>",
        "<|",
        "|>",
        "<s>",
        "</s",
        ">",
        "1",
        "23",
        "def",
        " class",
        "Hello",
        ",",
        ".",
    ]
)
TEXTS = st.lists(PIECES, max_size=40).map("".join)
TEMPLATES = st.sampled_from(["tiny", "captured", "tight", "spaced"])


def chat(messages: list[dict[str, Any]]) -> ParsedRequest:
    return parse_request("chat", json.dumps({"model": "m", "messages": messages}).encode())


def whole(tokenizer: HfPromptTokenizer, request: ParsedRequest) -> list[int]:
    return list(tokenizer.tokenizer(tokenizer.render(request), add_special_tokens=False).input_ids)


@settings(max_examples=60, deadline=None)
@given(TEMPLATES, TEXTS, st.lists(st.tuples(TEXTS, TEXTS), min_size=1, max_size=5))
def test_a_growing_conversation_equals_whole_prompt_tokenization(
    template: str, system: str, turns: list[tuple[str, str]]
) -> None:
    prompt = tokenizer(template)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be exact. " * 60 + system}]
    for user, assistant in turns:
        messages.append({"role": "user", "content": user})
        request = chat(messages)
        assert lists(prompt.token_ids(request)) == [whole(prompt, request)]
        messages.append({"role": "assistant", "content": assistant})


@settings(max_examples=60, deadline=None)
@given(TEMPLATES, TEXTS, st.lists(TEXTS, min_size=2, max_size=5))
def test_siblings_sharing_a_system_prompt_equal_whole_prompt_tokenization(
    template: str, system: str, questions: list[str]
) -> None:
    prompt = tokenizer(template)
    head = {"role": "system", "content": "Answer briefly. " * 60 + system}
    for question in questions:
        request = chat([head, {"role": "user", "content": question}])
        assert lists(prompt.token_ids(request)) == [whole(prompt, request)]


def test_the_cache_reuses_prefixes_here(tmp_path: Path) -> None:
    # The properties above would hold trivially if nothing were ever reused: make sure they exercise reuse.
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    head = {"role": "system", "content": "Answer briefly. " * 60}
    for question in ["a", "b", "c"]:
        lists(prompt.token_ids(chat([head, {"role": "user", "content": question}])))
    assert prompt.cache.partial_hits == 2
    prompt.close()


ANY_TEXT = st.text(alphabet=st.sampled_from("ab \n\u00e9\u65e5\U0001f600\ud800"), max_size=600)


@settings(max_examples=500, deadline=None)
@given(ANY_TEXT, ANY_TEXT, ANY_TEXT)
def test_the_c_common_prefix_equals_the_pure_one(head: str, a: str, b: str) -> None:
    assert _native_common_prefix is not None, "the compiled extension is what runs here"
    expected = next(
        (i for i, (x, y) in enumerate(zip(head + a, head + b, strict=False)) if x != y), min(len(a), len(b)) + len(head)
    )
    assert _native_common_prefix(head + a, head + b) == _shared_prefix(head + a, head + b) == expected
