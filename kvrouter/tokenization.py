"""Request -> the exact token ids the engine will see, with a prefix-reusing cache; long encodes off the event loop.

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
tokenizing from scratch (tests check it on every path, tests/test_tokenization_reuse.py over templates and texts).
The hot path's costs: the shared prefix is found with memcmp (`_blockkeys.common_prefix`; slices without the
extension), ids move in and out of the cache as 4-byte arrays, and the Rust tokenizer is called directly, its
batch call releasing the GIL, as transformers does, without the wrapper's per-call checks. Plain chat messages
are rendered from transformers' compiled template with the context `apply_chat_template` would build, without
its per-call copies (`_plain_render`; checked against it per template), and work reaches the threads through
`WorkerThreads` (kvrouter/worker_threads.py), not `run_in_executor`.

On the loop or on the threads (`inline_chars`): the render, the cache lookups and an encode of at most
`inline_chars` characters (the text left after the cached prefix; a completion prompt's every string) run on the
event loop; a longer encode goes to the threads. The render and the lookups hold the GIL wherever they run, so a
thread buys them nothing; what a thread buys is the Rust encode, which releases the GIL, and only while the loop has
other work. The hop itself (the hand-off, the GIL passed back and forth, futex wakeups: kernel time was ~20% of the
router's CPU when every request hopped) costs ~170 µs of CPU a request (`loadtest/bench_tokenizer_inline.py`:
router_cpu.py's bodies one at a time, 504-524 µs a request with every request on the threads, 334-357 µs with the
default), more than encoding a multi-turn tail (one answer and one question, ~400 characters: 67-139 µs, medians of
8,000 calls with the project's tiny tokenizer, `kvrouter.tinymodel`, on this 2-core machine). The bound is for the
loop's latency: 2,048 characters (~480 tokens) encode in ~0.5 ms (medians 0.46-0.59 ms over six runs, p99 ≤ 0.87
ms), so no request holds the loop for much more than half a millisecond to encode, and longer work never runs
there. `inline_chars = 0` sends every request to the threads, as before. Prompts over `large_chars` keep their own
thread and queue bound either way. The ids are the same on both paths (the same code runs, only the thread
differs; tests/test_hot_path_equivalence.py).

Block keys of a cached prefix (`RenderCache.block_keys`): an entry keeps its prompt's chained block keys per
(block size, seed, adapter and salt), at most four such sets; a render that reused a cached prefix's ids starts
with the keys of that prefix's full blocks, and the router hashes only the blocks after them. The keys are the
same, bit for bit, as hashing the prompt from scratch (tests/test_block_key_reuse.py); their bytes count in the
cache's budget.

Hostile prompts (`PromptLimits`): a prompt longer than `max_chars` characters (message contents, tools,
documents, prompt strings: counted before rendering) or `max_tokens` tokens (token-id prompts before anything,
text after tokenizing) is a 413; token ids outside the tokenizer's vocabulary are a 400. A prompt longer than
`large_chars` tokenizes on its own single thread, so small requests never queue behind it; at most `large_queue`
such prompts tokenize or wait at once, one more is a 429.

Knobs: `threads` (tokenizer worker threads for ordinary prompts; HF fast tokenizers release the GIL),
`inline_chars` (the longest encode done on the event loop; 0: none), `limits`,
`cache_entries` and `cache_bytes` (bound the cache: ids are kept as 4-byte arrays and every entry's bytes are
counted — text, ids, boundaries, block keys and overhead). A request that cannot be rendered raises `RequestError`
(400).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from kvrouter.blocks import extend_keys, root_material
from kvrouter.openai_request import ParsedRequest, RequestError
from kvrouter.typedefs import BlockKey
from kvrouter.worker_threads import WorkerThreads

try:  # memcmp in C (kvrouter/_blockkeys.c); absent when the extension was not built
    from kvrouter._blockkeys import common_prefix as _native_common_prefix
except ImportError:
    _native_common_prefix = None  # type: ignore[assignment]

try:  # transformers' own (cached) compile of a chat template: the plain render below runs exactly its template
    from transformers.utils.chat_template_utils import _compile_jinja_template as _hf_compile_template
except ImportError:  # another transformers layout: every render goes through apply_chat_template
    _hf_compile_template = None  # type: ignore[assignment]

_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})
"""Message keys transformers copies under each other's names before rendering: such messages take its path."""
_PROBE_CHATS: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "Be brief.\n"},
        {"role": "user", "content": "Hello <s> world"},
        {"role": "assistant", "content": " Hi."},
        {"role": "user", "content": "Again?"},
    ],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "Hello"}],
)

_HEAD_CHARS = 256
_PER_HEAD = 8
_MIN_REUSE_CHARS = 512
_SCAN_CHARS = 4096
_LIST_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)")


_ENTRY_OVERHEAD = 512
"""Bytes an entry costs beyond its text and arrays: the entry object, dict and LRU slots, its head key."""
_KEY_BYTES = 60
"""Bytes a cached block key costs: its list slot (8, and up to 1/8 more where a grown list over-allocates) and its
64-bit int (48 as allocated). Kept as ints, not packed: turning ~250 packed keys back into ints per request costs
about what hashing them does. Ints a prefix shares with another entry are counted in each."""
_KEYS_OVERHEAD = 160
"""Bytes one set of block keys costs beyond its keys: the list object, its dict slot and key tuple."""
_KEY_SPECS = 4
"""Sets of block keys an entry keeps (one per block size, seed, adapter and salt); the oldest goes first."""

KeySpec = tuple[int, int, bytes]
"""What a chain of block keys depends on besides the tokens: block size, seed, the root (adapter and salt)."""


@dataclass(frozen=True, slots=True)
class PromptLimits:
    max_chars: int = 1_000_000
    max_tokens: int = 262_144
    large_chars: int = 32_768
    large_queue: int = 8


def prompt_chars(request: ParsedRequest) -> int:
    """Characters of every string the prompt is made of (walked without recursion: nesting depth is the client's)."""
    if request.endpoint != "chat":
        prompt = request.prompt
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(p) for p in prompt or () if isinstance(p, str))
    body = request.body
    stack: list[object] = [request.messages, body.get("tools"), body.get("documents"), body.get("chat_template_kwargs")]
    total = 0
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return total


def _too_large(what: str, limit: int) -> RequestError:
    return RequestError(
        f"the prompt is longer than {limit} {what} (the router's limit)",
        status=413,
        code="prompt_too_large",
        param="messages" if what == "characters" else "prompt",
    )


def _keys_nbytes(keys: list[BlockKey]) -> int:
    return len(keys) * _KEY_BYTES + _KEYS_OVERHEAD


@dataclass(frozen=True, slots=True)
class _Stored:
    """A cached render in compact form: ids as 4-byte unsigned ints, offsets as 8-byte ints."""

    text: str
    ids: array[int]
    boundaries: array[int]
    counts: array[int]
    keys: dict[KeySpec, list[BlockKey]]
    """Block keys of the ids' first full blocks (all of them, or those a cached prefix gave), per `KeySpec`,
    shared read-only with the requests that asked; changed only under the cache's lock, which counts their bytes."""

    @classmethod
    def of(cls, render: _Render) -> _Stored:
        # The ids array is the render's own: renders are built once and never changed afterwards.
        return cls(render.text, render.ids, array("q", render.boundaries), array("q", render.counts), render.keys)

    def nbytes(self) -> int:
        arrays = sum(len(a) * a.itemsize for a in (self.ids, self.boundaries, self.counts))
        keys = sum(map(_keys_nbytes, self.keys.values()))
        return sys.getsizeof(self.text) + arrays + keys + _ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class _Render:
    text: str
    ids: array[int]
    """4-byte unsigned ints: a cached prefix's ids are copied in and out as one block, not int by int."""
    boundaries: list[int]
    """Character offsets right after an added token, ascending ..."""
    counts: list[int]
    """... and how many ids precede each of those offsets."""
    keys: dict[KeySpec, list[BlockKey]]
    """Known block keys of the ids' first full blocks, per `KeySpec` (a cached prefix's; see `_Stored.keys`)."""


class RenderCache:
    """Bounded LRU of rendered chat texts and their ids, findable by a shared leading text (thread-safe)."""

    def __init__(self, *, max_entries: int = 1024, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._by_ids: dict[int, _Stored] = {}
        """Entries by the identity of their ids array (which each keeps alive): how a prompt finds its keys."""
        self._by_head: dict[str, list[str]] = {}
        self.nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.partial_hits = 0
        self.misses = 0

    def exact(self, text: str) -> array[int] | None:
        """The cached render's ids, shared with the cache: read them, never change them."""
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
        best: tuple[_Stored, int] | None = None
        # Newest first, so a tie goes to the latest render: the likeliest to hold block keys, and warm in memory.
        for render in reversed(candidates):
            shared = common_prefix(render.text, text)
            position = bisect_right(render.boundaries, shared) - 1
            if position >= 0 and (best is None or render.boundaries[position] > best[0].boundaries[best[1]]):
                best = (render, position)
        with self._lock:
            if best is not None and best[0].boundaries[best[1]] >= _MIN_REUSE_CHARS:
                self.partial_hits += 1
                render, position = best
                boundary = render.boundaries[position]
                count = render.counts[position]
                # The prefix's ids are the entry's first `count`: so are the keys of its full blocks.
                keys = {spec: known[: count // spec[0]] for spec, known in render.keys.items() if count >= spec[0]}
                return _Render(
                    render.text[:boundary],
                    render.ids[:count],
                    render.boundaries[: position + 1].tolist(),
                    render.counts[: position + 1].tolist(),
                    keys,
                )
            self.misses += 1
            return None

    def put(self, render: _Render) -> None:
        stored = _Stored.of(render)
        size = stored.nbytes()
        if size > self.max_bytes:
            return
        with self._lock:
            if render.text in self._entries:
                self._entries.move_to_end(render.text)
                return
            self._entries[render.text] = stored
            self._by_ids[id(stored.ids)] = stored
            self.nbytes += size
            head = self._by_head.setdefault(render.text[:_HEAD_CHARS], [])
            head.append(render.text)
            if len(head) > _PER_HEAD:
                del head[0]
            self._evict()

    def block_keys(
        self, ids: Sequence[int], block_size: int, *, seed: int, lora: str | None, cache_salt: str | None
    ) -> list[BlockKey] | None:
        """Chained block keys of `ids` when they are a cached entry's ids array (the very object `exact` or a
        tokenize returned), reusing the keys the entry holds for the same block size, seed, adapter and salt and
        keeping the result there; None when `ids` is no entry's (the caller hashes them itself). The list is
        shared with the cache: read it, never change it."""
        with self._lock:
            stored = self._by_ids.get(id(ids))
            if stored is None or stored.ids is not ids:
                return None
            spec = (block_size, seed, root_material(lora, cache_salt))
            known = stored.keys.get(spec)
        full = len(ids) // block_size
        if known is not None and len(known) == full:
            return known
        keys = extend_keys(ids, block_size, known or (), seed=seed, lora=lora, cache_salt=cache_salt)
        with self._lock:
            if self._by_ids.get(id(ids)) is stored:
                held = stored.keys
                old = held.pop(spec, None)
                change = _keys_nbytes(keys) - (0 if old is None else _keys_nbytes(old))
                while len(held) >= _KEY_SPECS:
                    change -= _keys_nbytes(held.pop(next(iter(held))))
                held[spec] = keys
                self.nbytes += change
                if change > 0:
                    self._evict()
        return keys

    def _evict(self) -> None:
        """Drop the least recently used entries until both bounds hold (the lock is held)."""
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            old_text, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes()
            if self._by_ids.get(id(old.ids)) is old:
                del self._by_ids[id(old.ids)]
            bucket = self._by_head.get(old_text[:_HEAD_CHARS])
            if bucket is not None and old_text in bucket:
                bucket.remove(old_text)
                if not bucket:
                    del self._by_head[old_text[:_HEAD_CHARS]]

    def __len__(self) -> int:
        return len(self._entries)


def _shared_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix: equal `_SCAN_CHARS`-long slices are skipped, then the slice holding
    the first difference is bisected (bisecting the whole texts copies ~15 prefixes of ~18 KB per call)."""
    n = min(len(a), len(b))
    low = 0
    while True:
        if low >= n:
            return n
        high = min(low + _SCAN_CHARS, n)
        if a[low:high] != b[low:high]:
            break
        low = high
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


common_prefix: Callable[[str, str], int] = _shared_prefix if _native_common_prefix is None else _native_common_prefix
"""The common-prefix length the cache uses: C's memcmp (~1 µs on 18 KB), else the slices above (~15 µs)."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_tokenizer_dir(path: str | Path) -> None:
    """What transformers would report as a bad Hugging Face repo id, said in terms of replicas.yaml: the router
    only ever reads a local directory, so name the directory and the file that is missing."""
    directory = Path(path)
    if not directory.exists():
        raise ValueError(f"directory {directory} does not exist (replicas.yaml 'tokenizer' names a local directory)")
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory (replicas.yaml 'tokenizer' names a local directory)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{directory} holds neither {' nor '.join(TOKENIZER_FILES)}: point replicas.yaml 'tokenizer' at the "
            "model's tokenizer files (the directory vLLM loads the model or its tokenizer from)"
        )


class HfPromptTokenizer:
    """`routing.PromptTokenizer` over a local Hugging Face tokenizer directory (never downloads)."""

    def __init__(
        self,
        path: str | Path,
        *,
        threads: int = 2,
        inline_chars: int = 2048,
        limits: PromptLimits | None = None,
        cache_entries: int = 1024,
        cache_bytes: int = 256 * 1024 * 1024,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        if inline_chars < 0:
            raise ValueError(
                f"inline_chars must be at least 0 (0: every prompt tokenizes on the threads), not {inline_chars}"
            )
        check_tokenizer_dir(path)
        from transformers import AutoTokenizer

        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot load the tokenizer from {path}: {error}") from error
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"the tokenizer in {path} is not a fast (Rust) tokenizer")
        self.cache = RenderCache(max_entries=cache_entries, max_bytes=cache_bytes)
        self.limits = limits or PromptLimits()
        self.inline_chars = inline_chars
        self._on_refused = on_refused or (lambda reason: None)
        self._pool = WorkerThreads(threads, "kvrouter-tokenizer")
        # One thread of its own for large prompts: ordinary requests never wait behind them.
        self._large_pool = WorkerThreads(1, "kvrouter-tokenizer-large")
        self._large_pending = 0
        self.vocab_size = len(self.tokenizer)
        self._backend: Any = getattr(self.tokenizer, "_tokenizer", None)
        self._split_special = bool(getattr(self.tokenizer, "split_special_tokens", False))
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
        # The plain render's (chat_template it was checked against, compiled template, special tokens), replaced
        # as one tuple so a tokenizer thread never pairs one template with another's compile (`_plain_render`).
        self._plain: tuple[object, Any, dict[str, Any]] = (None, None, {})

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

    def block_keys(
        self, ids: Sequence[int], block_size: int, *, seed: int, lora: str | None, cache_salt: str | None
    ) -> list[BlockKey] | None:
        """Block keys of a prompt this tokenizer returned from its render cache, reusing the keys of the cached
        prefix it was tokenized from (`RenderCache.block_keys`); None for other prompts."""
        return self.cache.block_keys(ids, block_size, seed=seed, lora=lora, cache_salt=cache_salt)

    def close(self) -> None:
        self._pool.close()
        self._large_pool.close()

    async def prompt_token_ids(self, request: ParsedRequest) -> list[Sequence[int]]:
        """Token ids of every prompt of `request`; 413/400/429 `RequestError`s for what the limits refuse."""
        try:
            chars = self.check(request)
            if chars <= self.limits.large_chars:
                if self.inline_chars:
                    return await self._token_ids_inline(request, chars)
                return await self._pool.run(self.token_ids, request)
            if self._large_pending >= self.limits.large_queue:
                raise RequestError(
                    "too many large prompts are being tokenized; retry later",
                    status=429,
                    code="tokenizer_busy",
                    type_="server_error",
                )
            self._large_pending += 1
            try:
                return await self._large_pool.run(self.token_ids, request)
            finally:
                self._large_pending -= 1
        except RequestError as error:
            reason = _REFUSALS.get(error.code)
            if reason is not None:
                self._on_refused(reason)
            raise

    async def _token_ids_inline(self, request: ParsedRequest, chars: int) -> list[Sequence[int]]:
        """`token_ids` with the render, the cache lookups and the encode of at most `inline_chars` characters on
        the event loop, a longer encode on the threads (`chars`: the prompt's characters, already checked)."""
        body = request.body
        add_special = self._add_special(body)
        if request.endpoint != "chat":
            if chars > self.inline_chars:  # every character of a completion prompt is encoded
                return await self._pool.run(self.token_ids, request)
            return self._within_limits(
                body, self._completion_ids(request, True if add_special is None else add_special)
            )
        text = self.render(request)
        work = self._chat_work(text, bool(add_special))
        if work.encode is None:
            return self._within_limits(body, [work.ids])
        if work.chars <= self.inline_chars:
            return self._within_limits(body, [work.encode(text)])
        return self._within_limits(body, [await self._pool.run(work.encode, text)])

    def check(self, request: ParsedRequest) -> int:
        """The prompt's characters, once they and any token ids are within the limits (cheap: no tokenizing)."""
        chars = prompt_chars(request)
        if chars > self.limits.max_chars:
            raise _too_large("characters", self.limits.max_chars)
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            batch = prompt if isinstance(prompt[0], list) else [prompt]
            for ids in batch:
                self._check_ids(ids)
        return chars

    def _check_ids(self, ids: list[int]) -> None:
        if len(ids) > self.limits.max_tokens:
            raise _too_large("tokens", self.limits.max_tokens)
        if ids and max(ids) >= self.vocab_size:
            raise RequestError(
                f"token id {max(ids)} is outside the model's vocabulary of {self.vocab_size}",
                param="prompt",
                code="invalid_token_id",
            )

    # ---- synchronous core (on the pool; short work on the loop) ------------------------------------------------------

    def token_ids(self, request: ParsedRequest) -> list[Sequence[int]]:
        """Token ids of every prompt: lists, or (a chat prompt) the render cache's 4-byte array, shared with it
        and read-only, which block keys hash in place (no list of thousands of ints per request)."""
        body = request.body
        add_special = self._add_special(body)
        prompts: list[Sequence[int]]
        if request.endpoint == "chat":
            prompts = [self._chat_ids(request, bool(add_special))]
        else:
            prompts = self._completion_ids(request, True if add_special is None else add_special)
        return self._within_limits(body, prompts)

    @staticmethod
    def _add_special(body: Mapping[str, Any]) -> bool | None:
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise RequestError("'add_special_tokens' must be a boolean", param="add_special_tokens")
        return add_special

    def _within_limits(self, body: Mapping[str, Any], prompts: list[Sequence[int]]) -> list[Sequence[int]]:
        """The prompts truncated as the request asks, once none is longer than `max_tokens`."""
        truncate = body.get("truncate_prompt_tokens")
        if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate > 0:
            prompts = [ids[-truncate:] for ids in prompts]
        if any(len(ids) > self.limits.max_tokens for ids in prompts):
            raise _too_large("tokens", self.limits.max_tokens)
        return prompts

    def _completion_ids(self, request: ParsedRequest, add_special: bool) -> list[Sequence[int]]:
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
        backend = self._backend
        # The Rust tokenizer directly, in the state transformers' own call leaves it in (no truncation, no
        # padding, its split_special_tokens): the same ids without the wrapper's ~100-200 µs of checks per call.
        # The batch call, as transformers makes it: it releases the GIL while it tokenizes (`encode` holds it,
        # and would stall the event loop for as long); the fast variant skips the character offsets.
        if (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == self._split_special
        ):
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return list(encode([text], add_special_tokens=add_special)[0].ids)
        return list(self.tokenizer(text, add_special_tokens=add_special).input_ids)

    def _encode_with_special(self, text: str) -> list[int]:
        return self._encode(text, True)

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
        if not kwargs and tools is None and documents is None and not continue_final:
            text = self._plain_render(messages, add_generation_prompt)
            if text is not None:
                return text
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

    def _plain_render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
        """The text `apply_chat_template` renders for plain messages (string values only, no tools, documents,
        template arguments or continued message), from the same compiled template with the same context, without
        its per-call work (normalising and deep-copying every message, looking up the template and the special
        tokens): about half of a multi-turn render's CPU. None: such a request takes transformers' path.

        What transformers does for these inputs reduces to: drop the keys whose value is None, copy the rest, and
        render `messages`, `tools=None`, `documents=None`, `add_generation_prompt` and the special tokens. Each
        template is checked against `apply_chat_template` on sample chats before its first plain render, and a
        template that renders differently (another transformers version) is never rendered this way;
        tests/test_tokenization_reuse.py holds both paths equal over templates and generated messages.
        """
        template = self.tokenizer.chat_template
        source, compiled, special = self._plain
        if template is not source:
            compiled, special = self._checked_plain_template(template)
            self._plain = (template, compiled, special)
        if compiled is None or not messages:
            return None
        chat = []
        for message in messages:
            plain: dict[str, str] = {}
            for key, value in message.items():
                if value is None:
                    continue
                if type(value) is not str or type(key) is not str or key in _REASONING_FIELDS:
                    return None
                plain[key] = value
            chat.append(plain)
        try:
            text = compiled.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **special,
            )
        except Exception as error:  # as in `render`: jinja2 errors, template `raise_exception`
            raise RequestError(f"the chat template cannot render this request: {error}", param="messages") from None
        if not isinstance(text, str):
            raise RequestError("the chat template did not render text", param="messages")
        return text

    def _checked_plain_template(self, template: object) -> tuple[Any, dict[str, Any]]:
        """The compiled template and special tokens for the plain render, if it renders the sample chats exactly
        as `apply_chat_template` does (and at least one of them renders at all); else (None, {})."""
        if _hf_compile_template is None or type(template) is not str:
            return None, {}
        special = dict(self.tokenizer.special_tokens_map)
        for value in special.values():
            if type(value) is not str and not (type(value) in (list, tuple) and all(type(v) is str for v in value)):
                return None, {}
        try:
            compiled = _hf_compile_template(template)
        except Exception:
            return None, {}
        checked = False
        for chat in _PROBE_CHATS:
            for generation in (True, False):
                try:
                    expected = self.tokenizer.apply_chat_template(
                        [dict(m) for m in chat], tokenize=False, add_generation_prompt=generation
                    )
                except Exception:
                    expected = None
                try:
                    got = compiled.render(
                        messages=[dict(m) for m in chat],
                        tools=None,
                        documents=None,
                        add_generation_prompt=generation,
                        **special,
                    )
                except Exception:
                    got = None
                if got != expected:
                    return None, {}
                checked = checked or got is not None
        return (compiled, special) if checked else (None, {})

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

    def _chat_ids(self, request: ParsedRequest, add_special: bool) -> Sequence[int]:
        text = self.render(request)
        work = self._chat_work(text, add_special)
        return work.ids if work.encode is None else work.encode(text)

    def _chat_work(self, text: str, add_special: bool) -> _ChatWork:
        """What the ids of a rendered chat prompt take: none (the render cache has them), or an encode of the whole
        text (special tokens added) or of what follows its longest cached start (kept in the cache)."""
        if add_special:
            return _ChatWork((), len(text), self._encode_with_special)
        ids = self.cache.exact(text)
        if ids is not None:
            return _ChatWork(ids, 0, None)
        head = self.cache.best_prefix(text) or _no_head()
        return _ChatWork((), len(text) - len(head.text), partial(self._tokenize_and_keep, head=head))

    def _tokenize_and_keep(self, text: str, head: _Render) -> array[int]:
        """The ids of `text` from those of `head` (a known start of it), kept in the cache."""
        render = self._tokenize_render(text, head)
        self.cache.put(render)
        return render.ids

    def _tokenize_render(self, text: str, head: _Render) -> _Render:
        """Tokenize what follows `head` (a known start of `text`) and note the safe boundaries.

        A boundary is the end of an added token: the text on either side tokenizes independently. They are found
        by matching the added tokens' text, paired in order with the added-token ids in the result; if the two
        disagree in number, the tokenizer's character offsets decide (slower, always right).
        """
        start = len(head.text)
        tail = text[start:]
        tail_ids = self._encode(tail, False)
        positions = list(itertools.compress(itertools.count(), map(self._atomic.__contains__, tail_ids)))
        ends = [] if self._atomic_text is None else [m.end() for m in self._atomic_text.finditer(tail)]
        if len(ends) != len(positions):
            offsets = self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
            ends = [offsets[p][1] for p in positions]
        base = len(head.ids)
        return _Render(
            text,
            head.ids + array("I", tail_ids),
            head.boundaries + [start + end for end in ends],
            head.counts + [base + position + 1 for position in positions],
            head.keys,
        )


class _ChatWork(NamedTuple):
    ids: Sequence[int]
    """The ids, when nothing is left to encode."""
    chars: int
    """Characters `encode` tokenizes (the cached start's are not)."""
    encode: Callable[[str], Sequence[int]] | None
    """Called with the rendered text: its ids; None when `ids` are the answer."""


def _no_head() -> _Render:
    """The empty start a render without a cached prefix tokenizes from (new each time: the cache keeps its keys
    dict and adds to it)."""
    return _Render("", array("I"), [], [], {})


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


# RequestError code -> kvrouter_client_rejections_total reason, for the refusals the limits make.
_REFUSALS = {
    "prompt_too_large": "prompt_too_large",
    "tokenizer_busy": "tokenizer_busy",
    "invalid_token_id": "bad_token_ids",
}


def build_prompt_tokenizer(
    path: str | Path | None, *, threads: int, limits: PromptLimits | None = None
) -> HfPromptTokenizer | None:
    """The fleet's tokenizer, or None when replicas.yaml names none (routing falls back to load only)."""
    if path is None:
        return None
    return HfPromptTokenizer(path, threads=threads, limits=limits)


__all__ = ["HfPromptTokenizer", "PromptLimits", "RenderCache", "build_prompt_tokenizer", "prompt_chars"]
