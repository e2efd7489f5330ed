"""The plain chat render is transformers' render: the same text, the same errors, or transformers' own path.

`HfPromptTokenizer.render` runs the compiled chat template itself for plain messages (string values, no tools,
documents, template arguments or continued message) instead of calling `apply_chat_template`. Held here against
`apply_chat_template` over several templates (the tiny tokenizer's, the captured vLLM model's, templates that put
text right against the added tokens, one that reads optional keys) and generated messages, with None values, extra
keys and the fields transformers rewrites (which must take its path).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.openai_request import ParsedRequest, RequestError, parse_request
from kvrouter.tinymodel import ensure_tokenizer
from kvrouter.tokenization import HfPromptTokenizer
from tests.test_tokenization_reuse import SPACED, TEXTS, TIGHT
from tests.vllm_captures import model_dir

OPTIONAL = (
    "{% for m in messages %}[{{ m['role'] }}{% if m.name is defined %} ({{ m.name }}){% endif %}]"
    "{% if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system only first') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
)


@functools.cache
def tokenizer(name: str) -> HfPromptTokenizer:
    if name == "captured":
        return HfPromptTokenizer(model_dir(), threads=1)
    tokenizer = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    if name != "tiny":
        tokenizer.tokenizer.chat_template = {"tight": TIGHT, "spaced": SPACED, "optional": OPTIONAL}[name]
    return tokenizer


def chat(body: dict[str, Any]) -> ParsedRequest:
    return parse_request("chat", json.dumps({"model": "m", **body}).encode())


def transformers_render(prompt: HfPromptTokenizer, request: ParsedRequest) -> str:
    """What `render` returned before the plain path: every request through `apply_chat_template`."""
    body = request.body
    messages = [prompt._message(m) for m in request.messages or ()]
    text: str = prompt.tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=False,
        tools=None,
        documents=None,
    )
    return text


ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
EXTRA = st.dictionaries(
    st.sampled_from(["name", "thinking", "reasoning_content", "reasoning", "tool_call_id", "extra"]),
    st.one_of(st.none(), TEXTS, st.integers(0, 3)),
    max_size=2,
)
MESSAGE = st.builds(
    lambda role, content, extra: {"role": role, "content": content, **extra},
    ROLES,
    st.one_of(TEXTS, st.none()),
    EXTRA,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["tiny", "captured", "tight", "spaced", "optional"]),
    st.lists(MESSAGE, min_size=1, max_size=6),
    st.sampled_from([None, True, False]),
)
def test_the_plain_render_equals_apply_chat_template(
    template: str, messages: list[dict[str, Any]], generation: bool | None
) -> None:
    prompt = tokenizer(template)
    body: dict[str, Any] = {"messages": messages}
    if generation is not None:
        body["add_generation_prompt"] = generation
    request = chat(body)
    try:
        expected: str | Exception = transformers_render(prompt, request)
    except Exception as error:  # render wraps it as a 400
        expected = error
    if isinstance(expected, str):
        assert prompt.render(request) == expected
    else:
        with pytest.raises(RequestError) as raised:
            prompt.render(request)
        assert str(expected) in raised.value.message


@pytest.mark.parametrize("template", ["tiny", "captured", "tight", "spaced", "optional"])
def test_the_plain_render_is_taken_for_plain_messages(template: str) -> None:
    prompt = tokenizer(template)
    prompt.render(chat({"messages": [{"role": "user", "content": "hello"}]}))
    source, compiled, _ = prompt._plain
    assert source is prompt.tokenizer.chat_template and compiled is not None


def test_a_template_error_is_the_same_400() -> None:
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    prompt.tokenizer.chat_template = STRICT
    request = chat({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]})
    with pytest.raises(RequestError, match="system only first") as raised:
        prompt.render(request)
    assert raised.value.status == 400
    assert prompt._plain[1] is not None
    prompt.close()


def test_a_template_that_renders_otherwise_takes_transformers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another transformers version could build the template's context differently: the probe sees it and the
    # plain render is never used for that template.
    import kvrouter.tokenization as tokenization

    compile_template = tokenization._hf_compile_template
    assert compile_template is not None

    class Different:
        def __init__(self, template: str) -> None:
            self.compiled = compile_template(template)

        def render(self, **context: Any) -> str:
            return str(self.compiled.render(**context)) + "!"

    monkeypatch.setattr(tokenization, "_hf_compile_template", Different)
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    request = chat({"messages": [{"role": "user", "content": "hello"}]})
    assert prompt.render(request) == transformers_render(prompt, request)
    assert prompt._plain[1] is None
    prompt.close()


def test_tools_documents_and_template_arguments_take_transformers_path() -> None:
    prompt = HfPromptTokenizer(ensure_tokenizer(), threads=1)
    prompt.tokenizer.chat_template = (
        "{{ greeting | default('') }}{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    request = chat(
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "chat_template_kwargs": {"greeting": "hi"}}
    )
    assert prompt.render(request) == "hilookupx"
    prompt.close()
