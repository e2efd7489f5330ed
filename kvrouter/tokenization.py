"""Request -> the exact token ids the engine will see, off the event loop, with a prefix-reusing cache.

Chat requests are rendered the way vLLM renders them: the tokenizer's chat template with
`add_generation_prompt` (default true) and `continue_final_message` (default false) from the request, its
`tools`, `documents` and `chat_template_kwargs`; text parts of a message joined with newlines when the template
expects string content; assistant `tool_calls[].function.arguments` given to the template as objects. The
rendered text is tokenized with `add_special_tokens=False` unless the request says otherwise (the template
carries BOS itself, so it is never doubled). Completion prompts: a string or each string of a batch with
`add_special_tokens=True` (vLLM's default), token ids taken as they are; `truncate_prompt_tokens` keeps the
last N tokens like vLLM.

Multi-turn reuse: a growing conversation renders to a text that starts with (most of) the previous turn's text.
The cache keeps recent renders with their ids and the positions right after each added token (added tokens are
matched before the tokenizer's pre-tokenizer runs, so the text on either side tokenizes independently); a new
render reuses the ids up to the last such boundary inside the longest shared prefix with a cached render and
tokenizes only the rest. Added tokens for which splitting there is not exact on sample texts (overlapping added
tokens, SentencePiece's "prepend to the first piece") are never used as boundaries. The result equals
tokenizing from scratch (tests check it on every path).

Knobs: `threads` (tokenizer worker threads; HF fast tokenizers release the GIL), `cache_entries` and
`cache_chars` (bound the cache). A request that cannot be rendered raises `RequestError` (400).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrouter.openai_request import ParsedRequest, RequestError

_HEAD_CHARS = 256
_PER_HEAD = 8
_MIN_REUSE_CHARS = 512
_LIST_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)")


@dataclass(frozen=True, slots=True)
class _Render:
    text: str
    ids: list[int]
    boundaries: list[int]
    """Character offsets right after an added token, ascending ..."""
    counts: list[int]
    """... and how many ids precede each of those offsets."""


class RenderCache:
    """Bounded LRU of rendered chat texts and their ids, findable by a shared leading text (thread-safe)."""

    def __init__(self, *, max_entries: int = 1024, max_chars: int = 64 * 1024 * 1024) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, _Render] = OrderedDict()
        self._by_head: dict[str, list[str]] = {}
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.partial_hits = 0
        self.misses = 0

    def exact(self, text: str) -> list[int] | None:
        with self._lock:
            render = self._entries.get(text)
            if render is None:
                return None
            self._entries.move_to_end(text)
            self.hits += 1
            return render.ids

    def best_prefix(self, text: str) -> _Render | None:
        """The cached render's part (text, ids, boundaries) up to the last safe boundary inside the longest
        prefix it shares with `text`."""
        with self._lock:
            candidates = [self._entries[t] for t in self._by_head.get(text[:_HEAD_CHARS], ()) if t in self._entries]
        best: tuple[_Render, int] | None = None
        for render in candidates:
            shared = _shared_prefix(render.text, text)
            position = bisect_right(render.boundaries, shared) - 1
            if position >= 0 and (best is None or render.boundaries[position] > best[0].boundaries[best[1]]):
                best = (render, position)
        with self._lock:
            if best is not None and best[0].boundaries[best[1]] >= _MIN_REUSE_CHARS:
                self.partial_hits += 1
                render, position = best
                boundary = render.boundaries[position]
                return _Render(
                    render.text[:boundary],
                    render.ids[: render.counts[position]],
                    render.boundaries[: position + 1],
                    render.counts[: position + 1],
                )
            self.misses += 1
            return None

    def put(self, render: _Render) -> None:
        if len(render.text) > self.max_chars:
            return
        with self._lock:
            if render.text in self._entries:
                self._entries.move_to_end(render.text)
                return
            self._entries[render.text] = render
            self._chars += len(render.text)
            head = self._by_head.setdefault(render.text[:_HEAD_CHARS], [])
            head.append(render.text)
            if len(head) > _PER_HEAD:
                del head[0]
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                old_text, _ = self._entries.popitem(last=False)
                self._chars -= len(old_text)
                bucket = self._by_head.get(old_text[:_HEAD_CHARS])
                if bucket is not None and old_text in bucket:
                    bucket.remove(old_text)
                    if not bucket:
                        del self._by_head[old_text[:_HEAD_CHARS]]

    def __len__(self) -> int:
        return len(self._entries)


def _shared_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class HfPromptTokenizer:
    """`routing.PromptTokenizer` over a local Hugging Face tokenizer directory (never downloads)."""

    def __init__(
        self,
        path: str | Path,
        *,
        threads: int = 2,
        cache_entries: int = 1024,
        cache_chars: int = 64 * 1024 * 1024,
    ) -> None:
        from transformers import AutoTokenizer

        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot load the tokenizer from {path}: {error}") from error
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"the tokenizer in {path} is not a fast (Rust) tokenizer")
        self.cache = RenderCache(max_entries=cache_entries, max_chars=cache_chars)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvrouter-tokenizer")
        atomic = {
            token_id: added.content
            for token_id, added in self.tokenizer.added_tokens_decoder.items()
            if not any(getattr(added, flag, False) for flag in ("rstrip", "lstrip", "normalized", "single_word"))
            and self._splits_cleanly(added.content)
        }
        self._atomic = frozenset(atomic)
        # Leftmost-longest, like the tokenizer's own added-token matcher: finds where they split the text.
        contents = sorted(set(atomic.values()), key=len, reverse=True)
        self._atomic_text = re.compile("|".join(map(re.escape, contents))) if contents else None
        template = self.tokenizer.chat_template
        self._list_content = isinstance(template, str) and bool(_LIST_CONTENT.search(template))

    def _splits_cleanly(self, content: str) -> bool:
        """Whether text ending right after `content` tokenizes independently of what follows, checked on samples.

        Catches what the token flags do not tell: a longer added token that overlaps this one, or a
        pre-tokenizer that treats the first piece of an input differently (SentencePiece's "prepend first").
        """
        def ids(text: str) -> list[int]:
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

        for before in ("", "a b", "\n"):
            for after in ("hello", " hello", "\n\nx", "Hello world", "1", "<", "|"):
                if ids(before + content + after) != ids(before + content) + ids(after):
                    return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prompt_token_ids(self, request: ParsedRequest) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.token_ids, request)

    # ---- synchronous core (runs on the pool) --------------------------------------------------------------

    def token_ids(self, request: ParsedRequest) -> list[list[int]]:
        body = request.body
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise RequestError("'add_special_tokens' must be a boolean", param="add_special_tokens")
        if request.endpoint == "chat":
            prompts = [self._chat_ids(request, bool(add_special))]
        else:
            prompts = self._completion_ids(request, True if add_special is None else add_special)
        truncate = body.get("truncate_prompt_tokens")
        if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate > 0:
            prompts = [ids[-truncate:] for ids in prompts]
        return prompts

    def _completion_ids(self, request: ParsedRequest, add_special: bool) -> list[list[int]]:
        prompt = request.prompt
        if prompt is None:
            raise RequestError("'prompt' is required", param="prompt")
        if isinstance(prompt, str):
            return [self._encode(prompt, add_special)]
        if prompt and isinstance(prompt[0], str):
            return [self._encode(str(text), add_special) for text in prompt]
        if prompt and isinstance(prompt[0], list):
            return [list(ids) for ids in prompt]
        return [list(prompt)]  # type: ignore[arg-type]

    def _encode(self, text: str, add_special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special).input_ids)

    def render(self, request: ParsedRequest) -> str:
        """The chat prompt text the engine's template produces for `request`."""
        body = request.body
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False)
        if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final, bool):
            raise RequestError("'add_generation_prompt' and 'continue_final_message' must be booleans")
        if add_generation_prompt and continue_final:
            raise RequestError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                param="continue_final_message",
            )
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list", param="tools")
        documents = body.get("documents")
        messages = [self._message(m) for m in request.messages or ()]
        arguments: dict[str, Any] = dict(kwargs)
        arguments.update(
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tools=None if tools is None else [_tool(t) for t in tools],
            documents=documents,
        )
        try:
            text = self.tokenizer.apply_chat_template(messages, **arguments)
        except RequestError:
            raise
        except Exception as error:  # jinja2 errors, template `raise_exception`, bad argument types
            raise RequestError(f"the chat template cannot render this request: {error}", param="messages") from None
        if not isinstance(text, str):
            raise RequestError("the chat template did not render text", param="messages")
        return text

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        result = dict(message)
        content = message.get("content")
        if isinstance(content, list) and not self._list_content:
            texts = []
            for part in content:
                if not isinstance(part, Mapping):
                    raise RequestError("message content parts must be objects", param="messages")
                if part.get("type", "text") == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise RequestError("a text content part needs a string 'text'", param="messages")
                    texts.append(text)
            result["content"] = "\n".join(texts)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            result["tool_calls"] = [_tool_call(call) for call in calls]
        return result

    def _chat_ids(self, request: ParsedRequest, add_special: bool) -> list[int]:
        text = self.render(request)
        if add_special:
            return self._encode(text, True)
        ids = self.cache.exact(text)
        if ids is not None:
            return list(ids)
        head = self.cache.best_prefix(text)
        render = self._tokenize_render(text, head or _Render("", [], [], []))
        self.cache.put(render)
        return list(render.ids)

    def _tokenize_render(self, text: str, head: _Render) -> _Render:
        """Tokenize what follows `head` (a known start of `text`) and note the safe boundaries.

        A boundary is the end of an added token: the text on either side tokenizes independently. They are found
        by matching the added tokens' text, paired in order with the added-token ids in the result; if the two
        disagree in number, the tokenizer's character offsets decide (slower, always right).
        """
        start = len(head.text)
        tail = text[start:]
        tail_ids: list[int] = list(self.tokenizer(tail, add_special_tokens=False).input_ids)
        positions = list(itertools.compress(itertools.count(), map(self._atomic.__contains__, tail_ids)))
        ends = [] if self._atomic_text is None else [m.end() for m in self._atomic_text.finditer(tail)]
        if len(ends) != len(positions):
            offsets = self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
            ends = [offsets[p][1] for p in positions]
        base = len(head.ids)
        return _Render(
            text,
            head.ids + tail_ids,
            head.boundaries + [start + end for end in ends],
            head.counts + [base + position + 1 for position in positions],
        )


def _tool(tool: object) -> dict[str, Any]:
    """A tool as vLLM hands it to templates: its validated model dumped, with absent optional fields as None."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        raise RequestError("each tool must be an object with a 'function' object", param="tools")
    function = tool["function"]
    if not isinstance(function.get("name"), str):
        raise RequestError("each tool function needs a string 'name'", param="tools")
    dumped = dict(tool)
    dumped["type"] = tool.get("type", "function")
    dumped["function"] = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        **{k: v for k, v in function.items() if k not in ("name", "description", "parameters")},
    }
    return dumped


def _tool_call(call: object) -> object:
    """vLLM parses a JSON-string `arguments` into an object before rendering, for templates that iterate it."""
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise RequestError("tool call arguments must be a JSON object", param="messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


def build_prompt_tokenizer(path: str | Path | None, *, threads: int) -> HfPromptTokenizer | None:
    """The fleet's tokenizer, or None when replicas.yaml names none (routing falls back to load only)."""
    if path is None:
        return None
    return HfPromptTokenizer(path, threads=threads)


__all__ = ["HfPromptTokenizer", "RenderCache", "build_prompt_tokenizer"]
